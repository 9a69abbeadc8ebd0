"""Per-rank optimizer state: save, validate, load, reshard.

Every rank keeps its own momentum, so every rank writes its own file,
``lioncub-rank{r:05d}-of-{N:05d}.pt``, atomically (temporary file + fsync + rename).
Files carry a format version and a SHA-256 digest of their whole content (tensors
included: ``torch.load`` does not verify the bytes of tensor data, so a flipped bit
there would otherwise load silently), and are read with ``torch.load(weights_only=True)``.
Everything is checked (digest, format, world size, parameter count and shapes, momentum
shapes) before the optimizer is touched: a bad file raises :class:`CheckpointError` and
leaves the running state as it was.

Resharding (``reshard=``) when the files were saved under another layout: another world size,
or another sharding of the state (node voters' Nn × L, master-only sharding's L, flat voting,
another bucket size, Megatron's distributed-optimizer instances). Every new shard is rebuilt
from the saved shards, element by element (:class:`StateMap`):

* momentum: when the number of voters is unchanged, new voter j resumes old voter j's momentum
  exactly; otherwise ``"average"`` (default) starts every new voter from the mean of all old
  voters' momenta (the state a momentum sync would produce; summed in fp32 in voter order, then
  divided by their count) and ``"error"`` refuses;
* fp32 master shards (bf16/fp16 parameters): exactly, from the old shards (every old node group
  holds the same masters; the lowest one's are read). A layout without masters (flat voting)
  gives none: the next step makes them from the parameters.

It needs every old rank's file, all from the same step; each rank reads them one at a time.
"""
from __future__ import annotations

import glob
import hashlib
import logging
import os
import re
import secrets
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .lion import nonfinite_count
from .momentum_sync import resharded_sync_state, summed_pending
from .sharding import describe_layout, fingerprints

FORMAT_VERSION = 2  # 2: adds "sha256"; format 1 files (no digest) are still read
READABLE_FORMATS = (1, 2)
KIND = "lioncub_optimizer_state"
RESHARD_POLICIES = ("average", "error")
_NAME = re.compile(r"lioncub-rank(\d{5})-of-(\d{5})\.pt$")

log = logging.getLogger("lioncub_ds")


class CheckpointError(RuntimeError):
    """A LionCub checkpoint is missing, corrupted, truncated or does not fit the optimizer."""


def rank_file(directory, rank: int, world_size: int) -> str:
    return os.path.join(directory, f"lioncub-rank{rank:05d}-of-{world_size:05d}.pt")


# Temporary files: ".tmp-<target file name>-<random>.pt" (the target names which writer left one
# behind after a kill -9); ".tmp-<8 random characters>.pt" from lioncub_ds before 22.
_LEGACY_TMP = re.compile(r"^\.tmp-[A-Za-z0-9_]{8}\.pt$")


def _tmp_prefix(path: str) -> str:
    return ".tmp-" + os.path.basename(path) + "-"


def remove_stale_temporaries(path: str, legacy: bool = False) -> list[str]:
    """Remove the temporary files an interrupted (killed) :func:`atomic_torch_save` of ``path`` left
    in its directory, and with ``legacy`` the unattributed ones of older versions. Call it only
    while no save of ``path`` runs (each rank cleans its own file's). Returns the removed paths."""
    directory = os.path.dirname(os.path.abspath(path))
    prefix = _tmp_prefix(path)
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        if (name.startswith(prefix) and name.endswith(".pt")) or (legacy and _LEGACY_TMP.match(name)):
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(os.path.join(directory, name))
            except FileNotFoundError:
                pass
    if removed:
        log.warning("LionCub: removed %d temporary file(s) left by an interrupted save: %s", len(removed),
                    ", ".join(os.path.basename(r) for r in removed))
    return removed


def _new_temporary(directory: str, prefix: str):
    """(fd, path) of a new file ``<prefix><random>.pt``, created exclusively with the mode a plain
    open() gives (0666 less the umask): tempfile.mkstemp's 0600 would survive the rename, and a
    copy job or another user on shared storage could not read the checkpoint."""
    while True:
        tmp = os.path.join(directory, f"{prefix}{secrets.token_hex(8)}.pt")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), tmp
        except FileExistsError:
            continue


def atomic_torch_save(obj, path: str) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path``. Temporary
    files an earlier, killed save of ``path`` left behind are removed first."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    remove_stale_temporaries(path)
    fd, tmp = _new_temporary(directory, _tmp_prefix(path))
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def payload_digest(obj) -> str:
    """SHA-256 of a checkpoint payload's content (structure, values, tensor dtypes/shapes/bytes).

    Canonical: dict keys are visited in a fixed order, tuples and lists are distinguished,
    tensors are hashed from their raw bytes (no copy for contiguous CPU tensors).
    """
    h = hashlib.sha256()

    def walk(x):
        if isinstance(x, torch.Tensor):
            t = x.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous().reshape(-1)
            h.update(f"T{t.dtype}{tuple(x.shape)}:".encode())
            if t.numel():
                h.update(t.view(torch.uint8).numpy())
        elif isinstance(x, dict):
            h.update(f"D{len(x)}{{".encode())
            for k in sorted(x, key=lambda k: (type(k).__name__, repr(k))):
                walk(k)
                walk(x[k])
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(f"{'L' if isinstance(x, list) else 'U'}{len(x)}[".encode())
            for v in x:
                walk(v)
            h.update(b"]")
        else:
            h.update(f"{type(x).__name__}:{x!r};".encode())

    walk(obj)
    return h.hexdigest()


def _rank_info(optimizer):
    return optimizer.rank, optimizer.world_size


def _shapes(optimizer):
    return [list(p.shape) for g in optimizer.param_groups for p in g["params"]]


def save(optimizer, directory: str) -> str:
    """Write this rank's optimizer state to ``directory``; returns the file path."""
    rank, world = _rank_info(optimizer)
    payload = {"kind": KIND, "format": FORMAT_VERSION, "rank": rank, "world_size": world,
               "param_shapes": _shapes(optimizer), "optimizer": optimizer.state_dict(),
               "params_checksum": params_checksum(optimizer)}
    payload["sha256"] = payload_digest(payload)
    path = rank_file(directory, rank, world)
    if rank == 0:
        remove_stale_temporaries(path, legacy=True)
    atomic_torch_save(payload, path)
    return path


def params_checksum(optimizer) -> list[int]:
    """Two int64 checksums of the parameters the optimizer steps (fingerprints, summed over the
    tensors). Every rank of a vote group holds these bit for bit (each applies the same Δ to the
    same values), so the files of one save carry one checksum per vote group: a load compares them
    and refuses files left by another run at the same step (no collective at save time)."""
    # the voting parameters only: a frozen one (requires_grad=False) is never stepped and may hold
    # a per-rank value (a running statistic kept as a Parameter), as the replica check ignores it
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if not params:
        return [0, 0]
    return [int(v) for v in fingerprints(params, device_of(optimizer)).sum(dim=0).tolist()]


def read(path: str) -> dict:
    """Load and validate one file (never unpickles arbitrary objects)."""
    if not os.path.exists(path):
        raise CheckpointError(f"LionCub checkpoint file not found: {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, bad pickle, foreign object...
        raise CheckpointError(f"LionCub checkpoint {path} is corrupted or truncated "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
    if not isinstance(payload, dict) or payload.get("kind") != KIND:
        raise CheckpointError(f"{path} is not a LionCub optimizer checkpoint")
    if payload.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"{path} has checkpoint format {payload.get('format')!r}; this lioncub_ds reads "
                              f"formats {', '.join(map(str, READABLE_FORMATS))}")
    if payload["format"] >= 2:
        stored = payload.pop("sha256", None)
        actual = payload_digest(payload)
        if stored != actual:
            raise CheckpointError(f"{path} is corrupted: its content does not match the SHA-256 digest it was saved "
                                  f"with (stored {str(stored)[:16]}..., computed {actual[:16]}...)")
    for key in ("rank", "world_size", "param_shapes", "optimizer"):
        if key not in payload:
            raise CheckpointError(f"{path} is not a complete LionCub optimizer checkpoint (no {key!r})")
    return payload


def _check_fits(payload, optimizer, path):
    """This rank's own file, saved under this rank's layout: it must fit the optimizer as it is."""
    # an integration's own layout first (Megatron's distributed-optimizer instances): the shards
    # a file holds are this rank's only under the layout they were saved with, and the error
    # should name the layouts, not the shapes that follow from them
    check_layout = getattr(optimizer, "check_saved_layout", None)
    if check_layout is not None:
        lc = payload["optimizer"].get("lioncub") if isinstance(payload.get("optimizer"), dict) else None
        try:
            check_layout(lc if isinstance(lc, dict) else {})
        except ValueError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc
    _check_params(payload, _shapes(optimizer), path)
    _check_groups(payload, optimizer, path)
    # voters="node": the file's momentum (and master) shards must be this rank's shards of this
    # layout; checked here, before anything is loaded, not only in load_state_dict
    check_node = getattr(optimizer, "_check_node_state", None)
    if check_node is not None:
        lc = payload["optimizer"].get("lioncub")
        node = lc.get("node") if isinstance(lc, dict) else None
        try:
            check_node(node)
        except ValueError as exc:  # LionCubConfigError
            raise CheckpointError(f"{path}: {exc}") from exc
        _check_shards(node, path)


def _check_groups(payload, optimizer, path):
    """The file's param groups hold as many parameters each as the optimizer's (the flat shape list
    can match while the groups do not; torch would refuse only in load_state_dict, after an
    integration has loaded the rest of its checkpoint)."""
    groups = payload["optimizer"].get("param_groups") if isinstance(payload["optimizer"], dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups):
        raise CheckpointError(f"{path} holds no param groups")
    got = [len(g["params"]) for g in groups]
    want = [len(g["params"]) for g in optimizer.param_groups]
    if got != want:
        raise CheckpointError(f"{path}: its param groups hold {got} parameters, the optimizer's {want}; allowed: the "
                              "param groups the checkpoint was saved with")


def _check_shards(node, path):
    """Saved node-voter / master-only shards of this rank's layout: each of its bucket's size, finite
    (the flat momenta are checked by _check_params; a NaN shard would skip every later step)."""
    if not isinstance(node, dict):
        return
    size_of = shard_sizes(node)
    for kind in ("momentum", "master"):
        for i, t in (node.get(kind) or {}).items():
            want = size_of.get(int(i))
            if not isinstance(t, torch.Tensor) or want is None or t.numel() != want:
                got = t.numel() if isinstance(t, torch.Tensor) else type(t).__name__
                raise CheckpointError(f"{path}: the {kind} shard of bucket #{i} has {got} elements; this rank's "
                                      f"shard of that bucket has {want}")
            _check_finite(t, f"the {kind} shard of bucket #{i}", path)


def _check_params(payload, want, path):
    """The file's parameter shapes are ``want``; its per-parameter momenta fit them and are finite."""
    got = payload.get("param_shapes")
    if got is None or len(got) != len(want):
        raise CheckpointError(f"{path} holds state for {len(got or [])} parameters; the optimizer has {len(want)}")
    for i, (a, b) in enumerate(zip(got, want)):
        if list(a) != list(b):
            raise CheckpointError(f"{path}: parameter #{i} has shape {tuple(a)} in the checkpoint but {tuple(b)} "
                                  "in the optimizer")
    state = payload["optimizer"].get("state", {}) if isinstance(payload["optimizer"], dict) else None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds no optimizer state dict")
    for idx, st in state.items():
        if not isinstance(idx, int) or not 0 <= idx < len(want):
            raise CheckpointError(f"{path}: state for parameter #{idx!r}, but the optimizer has {len(want)} parameters")
        m = st.get("exp_avg") if isinstance(st, dict) else None
        if m is not None and (not isinstance(m, torch.Tensor) or list(m.shape) != list(want[idx])):
            shape = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
            raise CheckpointError(f"{path}: the momentum of parameter #{idx} has shape {shape}; the parameter has "
                                  f"{tuple(want[idx])}")
        _check_finite(m, f"the momentum of parameter #{idx}", path)


def _check_finite(m, what, path):
    bad = nonfinite_count(m)
    if bad:
        raise CheckpointError(f"{path}: {what} holds {bad} non-finite value(s) (its digest is valid: it was saved so); "
                              "refusing it, since at N > 1 every later step would be skipped")


# ----------------------------------------------------------------------------- layouts and resharding
def layout_text(lc: dict | None, world: int | None = None) -> str:
    """Words for the layout a rank's state has (``state_dict()["lioncub"]`` or ``state_layout()``):
    Megatron's instances, or the sharding's own words (:func:`lioncub_ds.sharding.describe_layout`)."""
    lc = lc if isinstance(lc, dict) else {}
    mega = lc.get("megatron_layout")
    if mega is not None:
        return (f"--num-distributed-optimizer-instances {mega['instances']} x {mega['instance_size']} ranks per "
                "instance")
    return describe_layout(lc.get("node")) + (f" on {world} ranks" if world else "")


_NODE_IDENTITY = ("voters", "node_size", "local_rank", "numels")


def same_layout(saved: dict | None, mine: dict | None) -> bool:
    """Whether state saved with layout ``saved`` is this rank's state under ``mine`` as it is (no resharding).
    Both: ``state_dict()["lioncub"]`` or ``state_layout()``."""
    saved = saved if isinstance(saved, dict) else {}
    mine = mine if isinstance(mine, dict) else {}
    if saved.get("megatron_layout") != mine.get("megatron_layout"):
        return False
    a, b = saved.get("node"), mine.get("node")
    if a is None or b is None:
        return a is None and b is None
    if any(a.get(k) != b.get(k) for k in _NODE_IDENTITY):
        return False
    return "map" not in a or a["map"] == b.get("map")  # files from before the map: by the sizes alone


@dataclass
class Piece:
    """Elements [start, start + length) of the flattened parameter ``key`` (its index in the
    optimizer, or its name for Megatron's shards), at offset ``at`` of the tensor that holds them."""
    key: object
    start: int
    length: int
    at: int


@dataclass
class Holder:
    """One tensor of a rank's state: ``address`` ("state", i): parameter i's ``exp_avg``;
    ("momentum" | "master", i): node shard of bucket i; ("main", i): Megatron's fp32 main shard i."""
    address: tuple
    numel: int
    pieces: list


@dataclass
class StateMap:
    """Which elements of which parameters one rank's state holds, and for which voter."""
    kind: str      # "flat" | "master_only" | "node" | "instances" (Megatron's distributed optimizer)
    voters: int    # the momentum's voters in this layout (N, Nn or K)
    voter: int     # the voter whose momentum this rank holds (a piece of)
    replica: int   # the copy of the fp32 masters this rank holds a shard of (every copy is the same)
    momentum: list = field(default_factory=list)
    master: list = field(default_factory=list)

    @property
    def family(self) -> str:
        """Layouts of one family reshard into each other (plain LionCub; Megatron's shards)."""
        return "megatron" if self.kind == "instances" else "plain"


def _shard_pieces(members, numels, local_rank: int, size: int) -> list:
    """The pieces of shard ``local_rank`` (``size`` elements) of a bucket whose parameters are
    ``members`` ([index, offset in the bucket] each)."""
    lo, out = local_rank * size, []
    for idx, off in members:
        a, b = max(off, lo), min(off + numels[idx], lo + size)
        if a < b:
            out.append(Piece(idx, a - off, b - a, a - lo))
    return out


def shard_sizes(node: dict) -> dict:
    """{bucket index: elements of this rank's shard of it} of a node layout (``state_dict()["lioncub"]
    ["node"]``): master-only sharding lists the sizes of its sharded buckets only, in the order of
    ``masters``; node voters list every bucket's."""
    numels = list(node.get("numels") or [])
    if node.get("voters") == "rank":
        return dict(zip(node.get("masters") or [], numels))
    return dict(enumerate(numels))


def state_map(lc: dict, rank: int, world: int, numels: list) -> StateMap:
    """The :class:`StateMap` of a rank's state from its layout (``state_dict()["lioncub"]`` or
    ``state_layout()``); ``numels``: the element count of every parameter (plain LionCub)."""
    lc = lc if isinstance(lc, dict) else {}
    mega = lc.get("megatron_layout")
    if mega is not None:
        pieces = lc.get("param_pieces")
        if pieces is None:
            raise CheckpointError("the state has no map of its shards onto the parameters (saved by a lioncub_ds "
                                  "before resharding existed); resume it with the layout it was saved with, save it "
                                  "again, then change the layout")
        size = mega["instance_size"]
        holders = [[Holder((kind, i), int(n), [Piece(name, int(start), int(n), 0)])
                    for i, (name, start, n) in enumerate(pieces)] for kind in ("state", "main")]
        return StateMap("instances", mega["instances"], rank // size, rank // size, *holders)
    flat = [Holder(("state", i), n, [Piece(i, 0, n, 0)]) for i, n in enumerate(numels)]
    node = lc.get("node")
    if node is None:
        return StateMap("flat", world, rank, rank, flat)
    members = node.get("map")
    if members is None:
        raise CheckpointError("the shards have no map onto the parameters (saved by a lioncub_ds before resharding "
                              "existed); resume with the layout they were saved with, save again, then change the "
                              "layout")
    size, k = node["node_size"], node["local_rank"]
    keys, sizes = sorted(members), shard_sizes(node)
    if node["voters"] == "rank":  # master-only sharding: flat momenta, masters of the sharded buckets
        master = [Holder(("master", i), sizes[i], _shard_pieces(members[i], numels, k, sizes[i])) for i in keys]
        return StateMap("master_only", world, rank, rank // size, flat, master)
    shard = {i: Holder(("momentum", i), sizes[i], _shard_pieces(members[i], numels, k, sizes[i])) for i in keys}
    master = [Holder(("master", i), h.numel, h.pieces) for i, h in shard.items() if i in node.get("masters", ())]
    return StateMap("node", node["voters"], rank // size, rank // size, list(shard.values()), master)


def _held_tensor(opt_state: dict, address):
    """The tensor at ``address`` in a saved optimizer state (None: not there)."""
    kind, i = address
    if kind == "state":
        st = opt_state.get("state", {}).get(i)
        return st.get("exp_avg") if isinstance(st, dict) else None
    lc = opt_state.get("lioncub") or {}
    if kind == "main":
        shards = lc.get("main_shards")
        return shards[i] if isinstance(shards, (list, tuple)) and i < len(shards) else None
    return ((lc.get("node") or {}).get(kind) or {}).get(i)


class _Rebuild:
    """This rank's new state, element by element, from the old ranks' pieces (one file at a time)."""

    def __init__(self, target: StateMap, average: bool, old_voters: int):
        self.target, self.average, self.old_voters = target, average, old_voters
        self.values = {w: [torch.zeros(h.numel, dtype=torch.float32) for h in getattr(target, w)]
                       for w in ("momentum", "master")}
        self.seen = {w: [torch.zeros(h.numel, dtype=torch.int32) for h in getattr(target, w)]
                     for w in ("momentum", "master")}
        self.index = {}
        for w in ("momentum", "master"):
            for hi, h in enumerate(getattr(target, w)):
                for pc in h.pieces:
                    self.index.setdefault((w, pc.key), []).append((hi, pc))

    def add(self, which: str, piece: Piece, values: torch.Tensor) -> None:
        for hi, pc in self.index.get((which, piece.key), ()):
            a, b = max(piece.start, pc.start), min(piece.start + piece.length, pc.start + pc.length)
            if a >= b:
                continue
            src = values[piece.at + a - piece.start:piece.at + b - piece.start]
            lo = pc.at + a - pc.start
            dst = self.values[which][hi][lo:lo + b - a]
            if which == "momentum" and self.average:
                dst.add_(src.float())  # the mean: summed in voter order, divided at the end
            else:
                dst.copy_(src)  # one source per element: its bits
            self.seen[which][hi][lo:lo + b - a] += 1

    def momenta(self, where: str):
        """(address, values) of every target momentum that the old state covers: every element of a
        piece either from each old voter (average) or from this rank's voter, or not at all."""
        want = self.old_voters if self.average else 1
        for h, values, seen in zip(self.target.momentum, self.values["momentum"], self.seen["momentum"]):
            covered = False
            for pc in h.pieces:
                got = seen[pc.at:pc.at + pc.length]
                if bool((got == want).all()):
                    covered = True
                elif bool((got != 0).any()):
                    raise CheckpointError(
                        f"{where}: the saved momenta cover elements {pc.start}..{pc.start + pc.length - 1} of parameter "
                        f"{pc.key!r} only partly ({int(got.min())} to {int(got.max())} of {want} voters); the files do "
                        "not describe one layout of this model")
            if covered:
                yield h.address, values.div_(self.old_voters) if self.average else values

    def masters(self):
        """(address, values) of every target master shard whose every element has a saved master."""
        for h, values, seen in zip(self.target.master, self.values["master"], self.seen["master"]):
            if all(bool((seen[pc.at:pc.at + pc.length] > 0).all()) for pc in h.pieces):
                yield h.address, values
            elif any(bool((seen[pc.at:pc.at + pc.length] > 0).any()) for pc in h.pieces):
                log.warning("LionCub: the saved fp32 masters cover the master shard %s only partly; it is made from "
                            "the parameters at the next step", h.address)


def _numels(shapes) -> list:
    out = []
    for shape in shapes:
        n = 1
        for d in shape:
            n *= int(d)
        out.append(n)
    return out


def _reshard(optimizer, directory: str, old_world: int, reshard: str) -> dict:
    """This rank's state under its own layout, rebuilt from the ``old_world`` rank files of another
    layout (module doc). Reads one file at a time; changes nothing."""
    rank, world = _rank_info(optimizer)
    mine = optimizer.state_layout() if hasattr(optimizer, "state_layout") else {"node": None}
    shapes = _shapes(optimizer)
    target = state_map(mine, rank, world, _numels(shapes))
    rebuild, first, steps, old_text, syncs = None, None, set(), None, []
    for r in range(old_world):
        path = rank_file(directory, r, old_world)
        payload = read(path)
        if payload["world_size"] != old_world or payload["rank"] != r:
            raise CheckpointError(f"{path} claims rank {payload['rank']} of {payload['world_size']}")
        state = payload["optimizer"]
        lc = state.get("lioncub") if isinstance(state, dict) else None
        lc = lc if isinstance(lc, dict) else {}
        try:
            old = state_map(lc, r, old_world, _numels(payload.get("param_shapes") or []))
        except (CheckpointError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: {exc}") from exc
        if old.family != target.family:
            raise CheckpointError(f"{path} holds {layout_text(lc, old_world)} state; this optimizer has "
                                  f"{layout_text(mine, world)}: Megatron's distributed-optimizer shards and a plain "
                                  "LionCub's state do not reshard into each other")
        if target.family == "plain":
            _check_params(payload, shapes, path)
        if first is None:
            first, old_text = state, layout_text(lc, old_world)
            average = old.voters != target.voters
            if average and reshard == "error":  # the change first: the rank counts may well be equal
                raise CheckpointError(
                    f"{directory}: the voters change from {old.voters} to {target.voters} (saved with {old_text}; "
                    f"this run has {layout_text(mine, world)}), so no new voter has an old voter's momentum to "
                    "resume; allowed with reshard='error': the same number of voters; pass reshard='average' to start "
                    "every voter from the mean momentum")
            rebuild = _Rebuild(target, average, old.voters)
        elif layout_text(lc, old_world) != old_text or old.voters != rebuild.old_voters:
            raise CheckpointError(f"{directory}: the rank files describe different layouts ({old_text}; {path}: "
                                  f"{layout_text(lc, old_world)})")
        steps.add(lc.get("step"))
        syncs.append(lc.get("momentum_sync"))  # every old rank's: the drift signal is their sum
        if rebuild.average or old.voter == target.voter:
            for h in old.momentum:
                t = _held_tensor(state, h.address)
                if t is None and h.address[0] == "momentum":
                    t = torch.zeros(h.numel)  # a node shard is made at the first step: zeros until then
                if t is None:
                    continue
                if t.numel() != h.numel:
                    raise CheckpointError(f"{path}: the momentum {h.address} holds {t.numel()} elements; its layout "
                                          f"says {h.numel}")
                _check_finite(t, f"the momentum {h.address}", path)
                for pc in h.pieces:
                    rebuild.add("momentum", pc, t.reshape(-1))
        if old.replica == 0:  # the masters: every replica holds the same values
            for h in old.master:
                t = _held_tensor(state, h.address)
                if t is None:
                    continue
                if t.numel() != h.numel:
                    raise CheckpointError(f"{path}: the master shard {h.address} holds {t.numel()} elements; its "
                                          f"layout says {h.numel}")
                for pc in h.pieces:
                    rebuild.add("master", pc, t.reshape(-1))
    if len(steps) > 1:
        raise CheckpointError(f"{directory}: the {old_world} rank files were saved at different steps "
                              f"{sorted(steps, key=repr)} (an interrupted or mixed save?); refusing to reshard them")
    log.warning("LionCub: resharding optimizer state from %d ranks (%s) to %d ranks (%s)%s", old_world, old_text,
                world, layout_text(mine, world),
                " by averaging momenta" if rebuild.average else ", every voter keeps its momentum")
    try:
        sync = resharded_sync_state(syncs[0], summed_pending(syncs), old_world == world)
    except ValueError as exc:
        raise CheckpointError(f"{directory}: {exc}") from exc
    return _assemble(optimizer, mine, shapes, rebuild, first, directory, sync)


def _assemble(optimizer, mine: dict, shapes: list, rebuild: _Rebuild, first: dict, where: str,
              sync: dict | None = None) -> dict:
    """The rebuilt pieces as a state dict in this optimizer's own format (for ``load_state_dict``)."""
    rank, world = _rank_info(optimizer)
    dtype = optimizer.config.momentum_dtype
    old_lc = first.get("lioncub") or {}
    step = int(old_lc.get("step", 0))
    state, shards, main = {}, {"momentum": {}, "master": {}}, {}
    for (kind, i), values in rebuild.momenta(where):
        if kind == "state":  # torch's per-parameter step counter: the optimizer's step count
            state[i] = {"exp_avg": values.view(shapes[i]).to(dtype),
                        "step": torch.tensor(float(step), dtype=torch.float32)}
        else:
            shards["momentum"][i] = values.to(dtype)
    for (kind, i), values in rebuild.masters():
        if kind == "main":
            main[i] = values.view(shapes[i])
        else:
            shards["master"][i] = values
    lioncub = {k: v for k, v in old_lc.items() if k in ("format", "step", "skipped_steps", "comm_stats")}
    if sync is not None:  # the momentum sync's schedule and counters (momentum_sync.resharded_sync_state)
        lioncub["momentum_sync"] = sync
    lioncub.update({k: v for k, v in mine.items() if k != "node"}, world_size=world, rank=rank)
    if mine.get("node") is not None:
        lioncub["node"] = dict(mine["node"], **shards)
    if mine.get("megatron_layout") is not None and len(main) == len(shapes):
        lioncub["main_shards"] = [main[i] for i in range(len(shapes))]
    old_groups = first.get("param_groups") or []
    # each group's lr / betas / weight decay are restored by position: the groups must hold as many
    # parameters each as when saved (the flat shape list can match while the grouping does not).
    # Megatron's node voters step pieces of the parameters, as many per group as the layout cuts
    # (another layout: other counts); their groups are Megatron's own, matched by position.
    got = [len(g.get("params") or []) for g in old_groups]
    want = [len(g["params"]) for g in optimizer.param_groups]
    if len(got) != len(want) or (got != want and mine.get("megatron_layout") is None):
        raise CheckpointError(f"{where}: the checkpoint's param groups hold {got} parameters, this optimizer's "
                              f"{want}; allowed: the param groups it was saved with; no state was changed")
    groups, n = [], 0
    for old, g in zip(old_groups, optimizer.param_groups):
        groups.append(dict({k: v for k, v in old.items() if k not in ("params", "param_names")},
                           params=list(range(n, n + len(g["params"])))))
        n += len(g["params"])
    return {"state": state, "param_groups": groups, "lioncub": lioncub}


def _prepare(optimizer, directory: str, reshard: str):
    """Read and validate this rank's state (no side effects). Returns (state dict, source)."""
    rank, world = _rank_info(optimizer)
    path = rank_file(directory, rank, world)
    found = sorted(glob.glob(os.path.join(directory, "lioncub-rank*-of-*.pt")))
    worlds = {int(_NAME.search(f).group(2)) for f in found if _NAME.search(f)}
    if len(worlds) > 1:
        # checked before this rank's own file: a stale set must never be resumed silently
        raise CheckpointError(f"{directory} mixes checkpoints of world sizes {sorted(worlds)}; refusing to guess "
                              "which set to resume (move the stale rank files away)")
    mine = optimizer.state_layout() if hasattr(optimizer, "state_layout") else {"node": None}
    if os.path.exists(path):
        payload = read(path)
        if payload["world_size"] != world or payload["rank"] != rank:
            raise CheckpointError(f"{path} claims rank {payload['rank']} of {payload['world_size']}")
        lc = payload["optimizer"].get("lioncub") if isinstance(payload["optimizer"], dict) else None
        if same_layout(lc, mine):
            _check_fits(payload, optimizer, path)
            return payload["optimizer"], path, payload.get("params_checksum")
        old_world = world  # the same ranks under another layout: reshard
    elif not worlds:
        raise CheckpointError(f"no LionCub checkpoint files in {directory}")
    else:
        old_world = worlds.pop()
    return _reshard(optimizer, directory, old_world, reshard), directory, None


def saved_sharded(directory: str) -> bool:
    """Whether the rank files in ``directory`` hold a sharded layout (node voters, master-only,
    instances), read from one file's header only (memory-mapped: no tensor is read)."""
    found = sorted(glob.glob(os.path.join(directory, "lioncub-rank*-of-*.pt")))
    if not found:
        return False
    try:
        payload = torch.load(found[0], map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - read() reports a broken file by name when it is loaded
        return False
    state = payload.get("optimizer") if isinstance(payload, dict) else None
    lc = state.get("lioncub") if isinstance(state, dict) else None
    return isinstance(lc, dict) and lc.get("node") is not None


def device_of(optimizer):
    """Where the optimizer's parameters live (an NCCL group takes only CUDA tensors)."""
    return next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))


def _agree(optimizer, failed: bool, step: int, checksum=None) -> tuple[int, int, int, bool]:
    """All ranks of the optimizer's group: (#failed, max step, min step, whether the files'
    parameter checksums differ). ``checksum``: this rank's file's (None: a file without one, or a
    reshard, which reads every file itself)."""
    if not optimizer.distributed:
        return int(failed), step, step, False
    c = [int(v) for v in checksum] if isinstance(checksum, (list, tuple)) and len(checksum) == 2 else [0, 0]
    has = int(checksum is not None)
    # On the parameters' device: an NCCL group takes only CUDA tensors. MAX of each value and of
    # its negation: the max and the min at once (equal on every rank iff max == min).
    vals = [int(failed), step, -step, has, -has, c[0], -c[0], c[1], -c[1]]
    flags = torch.tensor(vals, dtype=torch.int64, device=device_of(optimizer))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=optimizer.vote_group)
    # MAX of the failure flag says "some rank failed"; count is not needed
    got = flags.tolist()
    differ = any(got[k] != -got[k + 1] for k in (3, 5, 7))
    return got[0], got[1], -got[2], differ


def prepare_load(optimizer, directory: str, reshard: str = "average") -> tuple[dict, str]:
    """The checking half of :func:`load`: read and validate this rank's state, and agree across
    ranks; changes nothing. Returns (state dict, source) for :func:`apply_load`. Collective when
    the optimizer is distributed (same errors as :func:`load`)."""
    if reshard not in RESHARD_POLICIES:
        raise ValueError(f"reshard={reshard!r} is not allowed; allowed: {', '.join(RESHARD_POLICIES)}")
    error, state, source, checksum = None, None, directory, None
    try:
        state, source, checksum = _prepare(optimizer, directory, reshard)
    except CheckpointError as exc:
        error = exc
    step = int(state.get("lioncub", {}).get("step", 0)) if state is not None else -1
    failed, hi, lo, differ = _agree(optimizer, error is not None, step, checksum)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"LionCub: another rank could not load its checkpoint from {directory}; "
                              "no rank changed its state")
    if hi != lo:
        raise CheckpointError(f"LionCub: ranks' checkpoints in {directory} were saved at different steps "
                              f"({lo}..{hi}; an interrupted save?); no rank changed its state")
    if differ:
        raise CheckpointError(f"LionCub: ranks' checkpoints in {directory} come from different saves (the parameters "
                              "they were saved with differ: a file left by another run at the same step?); no rank "
                              "changed its state")
    return state, source


def apply_load(optimizer, prepared: tuple[dict, str]) -> str:
    """The changing half of :func:`load` (after :func:`prepare_load` succeeded on every rank)."""
    state, source = prepared
    optimizer.load_state_dict(state)
    rank, world = _rank_info(optimizer)
    remove_stale_temporaries(rank_file(source if os.path.isdir(source) else os.path.dirname(source), rank, world),
                             legacy=rank == 0)
    return source


def load(optimizer, directory: str, reshard: str = "average") -> str:
    """Load this rank's state from ``directory`` (see module doc for ``reshard``).

    Collective when the optimizer is distributed: every rank validates its own file first,
    then all ranks agree; if any rank failed, or ranks would resume from different steps
    (e.g. an interrupted save), every rank raises :class:`CheckpointError` and no rank
    changes its state.
    """
    return apply_load(optimizer, prepare_load(optimizer, directory, reshard))
