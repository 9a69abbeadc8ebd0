"""Per-rank optimizer state: save, validate, load, reshard.

Every rank keeps its own momentum, so every rank writes its own file,
``lioncub-rank{r:05d}-of-{N:05d}.pt``, atomically (temporary file + fsync + rename).
Files carry a format version and a SHA-256 digest of their whole content (tensors
included: ``torch.load`` does not verify the bytes of tensor data, so a flipped bit
there would otherwise load silently), and are read with ``torch.load(weights_only=True)``.
Everything is checked (digest, format, world size, parameter count and shapes, momentum
shapes) before the optimizer is touched: a bad file raises :class:`CheckpointError` and
leaves the running state as it was.

Resharding policy when the world size changed (``reshard=``):
* ``"average"`` (default): every new rank starts from the mean of all saved momenta
  (the state a momentum sync would produce); needs every old rank's file.
* ``"error"``: refuse.
"""
from __future__ import annotations

import glob
import hashlib
import logging
import os
import re
import tempfile

import torch
import torch.distributed as dist

from .lion import nonfinite_count

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


def atomic_torch_save(obj, path: str) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path``. Temporary
    files an earlier, killed save of ``path`` left behind are removed first."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(path), suffix=".pt", dir=directory)
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
               "param_shapes": _shapes(optimizer), "optimizer": optimizer.state_dict()}
    payload["sha256"] = payload_digest(payload)
    path = rank_file(directory, rank, world)
    if rank == 0:
        remove_stale_temporaries(path, legacy=True)
    atomic_torch_save(payload, path)
    return path


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
    want = _shapes(optimizer)
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
        bad = nonfinite_count(m)
        if bad:
            raise CheckpointError(f"{path}: the momentum of parameter #{idx} holds {bad} non-finite value(s) (its "
                                  "digest is valid: it was saved so); refusing it, since at N > 1 every later step "
                                  "would be skipped")
    # voters="node": the file's momentum (and master) shards must be this rank's shards of this
    # layout; checked here, before anything is loaded, not only in load_state_dict
    check_node = getattr(optimizer, "_check_node_state", None)
    if check_node is not None:
        lc = payload["optimizer"].get("lioncub")
        try:
            check_node(lc.get("node") if isinstance(lc, dict) else None)
        except ValueError as exc:  # LionCubConfigError
            raise CheckpointError(f"{path}: {exc}") from exc


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
    if os.path.exists(path):
        payload = read(path)
        if payload["world_size"] != world or payload["rank"] != rank:
            raise CheckpointError(f"{path} claims rank {payload['rank']} of {payload['world_size']}")
        _check_fits(payload, optimizer, path)
        return payload["optimizer"], path
    if not worlds:
        raise CheckpointError(f"no LionCub checkpoint files in {directory}")
    old_world = worlds.pop()
    if reshard == "error":
        raise CheckpointError(f"{directory} was saved by {old_world} ranks; this run has {world} "
                              "(pass reshard='average' to start every rank from the mean momentum)")
    payloads = []
    for r in range(old_world):
        p = rank_file(directory, r, old_world)
        payloads.append(read(p))
        _check_fits(payloads[-1], optimizer, p)
    steps = sorted({pl["optimizer"].get("lioncub", {}).get("step") for pl in payloads}, key=repr)
    if len(steps) > 1:
        raise CheckpointError(f"{directory}: the {old_world} rank files were saved at different steps {steps} "
                              "(an interrupted or mixed save?); refusing to average them")
    log.warning("LionCub: resharding optimizer state from %d to %d ranks by averaging momenta", old_world, world)
    return average_states([pl["optimizer"] for pl in payloads]), directory


def _device_of(optimizer):
    """Where the optimizer's parameters live (an NCCL group takes only CUDA tensors)."""
    return next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))


def _agree(optimizer, failed: bool, step: int) -> tuple[int, int, int]:
    """All ranks of the optimizer's group: (#failed, max step, min step)."""
    if not optimizer.distributed:
        return int(failed), step, step
    # On the parameters' device: an NCCL group takes only CUDA tensors.
    flags = torch.tensor([int(failed), step, -step], dtype=torch.int64, device=_device_of(optimizer))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=optimizer.vote_group)
    # MAX of the failure flag says "some rank failed"; count is not needed
    failed, hi, neg_lo = flags.tolist()
    return failed, hi, -neg_lo


def prepare_load(optimizer, directory: str, reshard: str = "average") -> tuple[dict, str]:
    """The checking half of :func:`load`: read and validate this rank's state, and agree across
    ranks; changes nothing. Returns (state dict, source) for :func:`apply_load`. Collective when
    the optimizer is distributed (same errors as :func:`load`)."""
    if reshard not in RESHARD_POLICIES:
        raise ValueError(f"reshard={reshard!r} is not allowed; allowed: {', '.join(RESHARD_POLICIES)}")
    error, state, source = None, None, directory
    try:
        state, source = _prepare(optimizer, directory, reshard)
    except CheckpointError as exc:
        error = exc
    step = int(state.get("lioncub", {}).get("step", 0)) if state is not None else -1
    failed, hi, lo = _agree(optimizer, error is not None, step)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"LionCub: another rank could not load its checkpoint from {directory}; "
                              "no rank changed its state")
    if hi != lo:
        raise CheckpointError(f"LionCub: ranks' checkpoints in {directory} were saved at different steps "
                              f"({lo}..{hi}; an interrupted save?); no rank changed its state")
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


def average_states(states: list[dict]) -> dict:
    """Mean of several ranks' state dicts (momenta averaged in fp32; steps must agree)."""
    first = states[0]
    out = {k: v for k, v in first.items() if k != "state"}
    out["state"] = {}
    for idx, st in first["state"].items():
        merged = dict(st)
        if "exp_avg" in st:
            acc = torch.zeros_like(st["exp_avg"], dtype=torch.float32)
            for s in states:
                acc += s["state"][idx]["exp_avg"].float()
            merged["exp_avg"] = (acc / len(states)).to(st["exp_avg"].dtype)
        out["state"][idx] = merged
    if "lioncub" in first:
        out["lioncub"] = dict(first["lioncub"])
    return out
