"""ZeRO-3 with votes: DeepSpeed shards inside a group, LionCub votes across groups (docs/node_voters.md).

``"zero_optimization": {"stage": 3}`` with ``"optimizer": {"type": "LionCub", "params": {...,
"voters": "node"}}``: the N data-parallel ranks form Nn shard groups of L consecutive ranks
(``node_size``, default the launcher's ranks per node, so a group is a machine). DeepSpeed's
ZeRO-3 runs inside each group: parameters, gradients and the fp32 master partitioned over its L
ranks, the gradients reduce-scattered (averaged) over the fast link. LionCub steps the fp32
partition it is given and votes with the shard peers (the rank holding the same partition in
every other group): each group is one voter, with its own momentum of its partition, and every
group applies the same Δ, so the partitions stay identical across groups. The inter-group link
carries the votes (and an explicitly configured momentum sync), never a gradient.

How the group is set up, from the ds_config alone: ``deepspeed.initialize`` is wrapped so that,
for such a config and no ``mpu`` of the user's, it creates the groups on every rank
(:func:`lioncub_ds.groups.make_shard_groups`) and passes DeepSpeed a model-parallel unit
(:class:`ShardGroupsMPU`, DeepSpeed's public ``mpu`` seam) whose data-parallel group is the
shard group. DeepSpeed then partitions and reduces inside the group; the unit still reports the
true data-parallel rank and size (N), so batch sizes and DeepSpeed's data loader see every rank.

What DeepSpeed calls the optimizer: :class:`ZeRO3Votes`, a thin torch optimizer. ZeRO-3 calls
its ``step()`` once per sub-group with the fp32 flat partition of that sub-group as the only
parameter; it hands the step to one LionCub per sub-group (``shard_groups=``) over views of the
flat partition, one per model parameter, each tagged with its first element's index inside the
parameter, so the hash tie rule keys on the element's index inside its parameter (docs/conventions.md).

Decisions every group must share: ZeRO-3 skips a step whose gradient norm is not finite (and,
with fp16, one that overflows), but it computes them over the group only. The wrapper agrees
them across groups (one small all-reduce of a flag over the shard peers, on the step's existing
host read), so every group skips together. Gradient clipping: each group clips its own mean
gradient by its own norm (each voter's decision, as at stage 0 each rank's).

Checkpoints: DeepSpeed writes one ZeRO file per rank of its data-parallel group; with several
groups the rank of group j > 0 writes its files under a name of its own (``..._group{j}...``)
so the groups' momenta (which differ) are all kept, and a load reads each rank's own file. A
checkpoint saved with another group layout is refused by name before anything loads.
"""
from __future__ import annotations

import importlib
import json
import os
import zlib

import torch
import torch.distributed as dist

from ..config import LionCubConfig, LionCubConfigError
from ..groups import ShardGroups, group_ranks, make_shard_groups, requested, world_max
from ..layout import ELEMENT_START
from ..optimizer import LionCub


class ZeRO3VotesError(RuntimeError):
    pass


# ----------------------------------------------------------------------------- the ds_config
def _load_config(config):
    """The ds_config as a dict (a dict, or a JSON/HJSON file path), or None when unreadable here
    (DeepSpeed reads it again and reports its own errors)."""
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        with open(config) as f:
            text = f.read()
        try:
            return json.loads(text)
        except ValueError:
            try:
                import hjson
                return hjson.loads(text)
            except Exception:  # noqa: BLE001 - DeepSpeed parses it again and says what is wrong
                return None
    return None


def offloaded(cfg: dict) -> bool:
    """The ds_config's ``zero_optimization.offload_optimizer.device`` is "cpu"."""
    off = (cfg.get("zero_optimization") or {}).get("offload_optimizer") or {}
    return isinstance(off, dict) and off.get("device") == "cpu"


def votes_requested(cfg) -> dict | None:
    """The LionCub ``optimizer.params`` of a stage-3 ds_config (a dict, from :func:`_load_config`)
    asking for votes across groups (``voters: "node"``), else None."""
    if not isinstance(cfg, dict):
        return None
    opt = cfg.get("optimizer") or {}
    zero = cfg.get("zero_optimization") or {}
    from .engine import is_lioncub_name
    if not (isinstance(opt, dict) and is_lioncub_name(opt.get("type")) and isinstance(zero, dict)):
        return None
    params = opt.get("params") or {}
    if zero.get("stage") != 3 or not isinstance(params, dict) or not requested(params).node_voters:
        return None
    return params


# ----------------------------------------------------------------------------- the mpu seam
class ShardGroupsMPU:
    """DeepSpeed's model-parallel unit for ZeRO-3 with votes: no model parallelism; the
    data-parallel *group* is this rank's shard group (what ZeRO-3 partitions and reduces over),
    while the data-parallel *rank and size* stay the true ones (N ranks), which DeepSpeed uses
    for batch sizes and its data loader."""

    def __init__(self, sg: ShardGroups, own_group, cpu_groups: ShardGroups | None = None):
        self.shard_groups = sg
        # offload_optimizer: the same groups over gloo, for the votes on the CPU partitions
        self.cpu_shard_groups = cpu_groups
        self._own = own_group  # a group of this rank alone: the (trivial) model-parallel group

    def get_data_parallel_group(self):
        return self.shard_groups.shard

    def get_data_parallel_group_ranks(self):
        return group_ranks(self.shard_groups.shard)

    def get_data_parallel_rank(self):
        return dist.get_rank(self.shard_groups.world)

    def get_data_parallel_world_size(self):
        return dist.get_world_size(self.shard_groups.world)

    def get_model_parallel_group(self):
        return self._own

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self):
        return dist.get_rank()


def shard_groups_of(engine) -> ShardGroups | None:
    mpu = getattr(engine, "mpu", None)
    return mpu.shard_groups if isinstance(mpu, ShardGroupsMPU) else None


def make_initialize(orig):
    """``deepspeed.initialize`` that sets up the shard groups for a stage-3 LionCub config with
    ``voters: "node"`` (before DeepSpeed builds anything)."""

    def initialize(*args, **kwargs):
        import inspect
        bound = inspect.signature(orig).bind_partial(*args, **kwargs)
        given = dict(bound.arguments)
        config = given.get("config") or given.get("config_params")
        if config is None and given.get("args") is not None:
            config = getattr(given["args"], "deepspeed_config", None)
        config = _load_config(config)  # read once: the votes and the offload are asked of the same dict
        params = votes_requested(config)
        if params is None:
            return orig(*args, **kwargs)
        if given.get("mpu") is not None:
            raise ZeRO3VotesError(
                "LionCub: optimizer.params voters='node' with zero_optimization.stage=3 sets DeepSpeed's data-parallel "
                "group itself (one ZeRO-3 group per node group), but deepspeed.initialize got an mpu: model "
                "parallelism with ZeRO-3 votes is not supported. Allowed: no mpu, or voters='rank' (global Lion on "
                "the ZeRO-3 partitions).")
        refused = unsupported_settings(config)
        if refused:
            raise LionCubConfigError(refused)
        if not (dist.is_available() and dist.is_initialized()):
            import deepspeed
            deepspeed.init_distributed(dist_backend=given.get("dist_backend"))
        # the collectives below run before DeepSpeed's engine picks this rank's GPU: without this,
        # every rank of a node would use cuda:0 under NCCL (a duplicate-GPU error or a hang)
        select_device(given.get("args"))
        # every rank resolves L (node_size, else the launcher's ranks per node) and the ranks agree on
        # it before any group exists: a rank that cannot resolve it, or resolves another L (a hostfile
        # with unequal slots), makes every rank raise the same error instead of some waiting for it
        size = agreed_node_size(params)
        world = dist.get_world_size()
        model = given.get("model")
        if size == world:
            # one group: ZeRO-3 over every rank, global Lion on the partitions (no vote needed)
            return orig(*args, **kwargs)
        if model is not None:
            check_not_zero_init(model)
        try:
            sg = make_shard_groups(size, timeout_s=params.get("timeout_s"), setting="node_size")
            # offload_optimizer: the fp32 partitions (and so the votes) live in CPU memory, which NCCL
            # does not carry: the votes go over gloo groups of the same ranks (1 bit per element)
            cpu = make_shard_groups(size, timeout_s=params.get("timeout_s"), backend="gloo", setting="node_size") \
                if offloaded(config) else None
        except ValueError as exc:
            raise LionCubConfigError(str(exc)) from None
        if model is not None:
            # ZeRO-3 broadcasts the starting weights inside the group only (its data-parallel group):
            # groups that started apart (a seed per rank) would apply the same Δ to different values
            # forever. One broadcast from rank 0 over every rank, as torch DDP does at construction.
            broadcast_start(model)
        from deepspeed.utils import groups as ds_groups
        from .engine import singleton_group
        given["mpu"] = ShardGroupsMPU(sg, singleton_group(), cpu)
        before = getattr(ds_groups, "mpu", None)
        try:
            return orig(**given)
        finally:
            # DeepSpeed keeps the last engine's mpu in a module global, which a later engine without
            # one would read as its own; this engine holds its mpu itself (engine.mpu)
            ds_groups.mpu = before

    return initialize


def select_device(args, accelerator=None) -> int | None:
    """Make this rank's accelerator device current, the one DeepSpeed's engine will pick
    (``args.device_rank`` when the args have one, else ``LOCAL_RANK``); returns it, or None when
    there is none to pick (no LOCAL_RANK: a single process). ``accelerator``: DeepSpeed's
    ``get_accelerator()`` by default (on the CPU accelerator setting the device does nothing)."""
    rank = getattr(args, "device_rank", None) if args is not None else None
    if rank is None:
        rank = int(os.environ.get("LOCAL_RANK", -1))
    if rank < 0:
        return None
    if accelerator is None:
        from deepspeed.accelerator import get_accelerator
        accelerator = get_accelerator()
    accelerator.set_device(rank)
    return rank


# ZeRO++ settings that communicate over groups DeepSpeed derives from the world, not from the
# data-parallel group it is given: with votes they would reduce gradients across node groups (or
# cut partitions of another size). Key -> (what it does, the value that is allowed).
ZEROPP_REFUSED = {"zero_quantized_gradients": ("quantized gradient all-to-all over every rank", False),
                  "zero_hpz_partition_size": ("a secondary parameter partition over world-derived groups", 1)}


def unsupported_settings(config: dict) -> str | None:
    """The refusal message for a stage-3 votes config with a ZeRO++ setting it cannot serve, or None."""
    zero = config.get("zero_optimization") or {}
    bad = [(k, zero[k], what, ok) for k, (what, ok) in ZEROPP_REFUSED.items()
           if k in zero and zero[k] not in (None, ok) and not (ok == 1 and zero[k] in (0, 1))]
    if not bad:
        return None
    return ("LionCub: optimizer.params voters='node' with zero_optimization.stage=3 does not support " +
            "; ".join(f"zero_optimization.{k}={v!r} ({what})" for k, v, what, _ in bad) +
            ": ZeRO++ builds those groups from the whole world, so gradients would cross the node groups. "
            "Allowed: " + ", ".join(f"{k}={ok!r}" for k, _, _, ok in bad) + " (or left out), or voters='rank'.")


def agreed_node_size(params: dict) -> int:
    """L for the shard groups, resolved on every rank and agreed over the world (one object
    all-gather, at initialize): raises the same LionCubConfigError on every rank when some rank
    cannot resolve it or the ranks resolve different values."""
    try:
        mine = requested(params).ranks_per_node()
    except ValueError as exc:
        mine = str(exc)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if all(v == every[0] for v in every) and not isinstance(every[0], str):
        return every[0]
    errors = [(r, v) for r, v in enumerate(every) if isinstance(v, str)]
    if errors:
        r, msg = errors[0]
        raise LionCubConfigError(f"{msg} (on {len(errors)} of {len(every)} ranks, rank {r} first; every rank raises "
                                 "this, nothing was built)")
    sizes = ", ".join(f"rank {r}: {v}" for r, v in enumerate(every))
    raise LionCubConfigError("LionCub: the ranks resolved different node sizes for voters='node' at ZeRO stage 3 "
                             f"({sizes}; node_size unset takes each rank's LOCAL_WORLD_SIZE / LOCAL_SIZE, which "
                             "differ when nodes run different numbers of ranks). Allowed: the same number of ranks on "
                             "every node, or node_size=<L> in optimizer.params with L dividing the world size; every "
                             "rank raises this, nothing was built")


def check_not_zero_init(model) -> None:
    """Refuse a model built under ``deepspeed.zero.Init``: its parameters are already partitioned
    over the group it was built with (the world, by default), not over the node group ZeRO-3 with
    votes needs, and it started from each group's own broadcast. Raised on every rank alike (the
    same model code), before any group is made."""
    built = [n for n, p in model.named_parameters() if hasattr(p, "ds_id")]
    if built:
        raise ZeRO3VotesError(
            f"LionCub: voters='node' at zero_optimization.stage=3 needs the model built outside deepspeed.zero.Init "
            f"(parameter {built[0]!r} is already partitioned by it, over another group than the node group). Allowed: "
            "build the model without zero.Init (Hugging Face: load it before TrainingArguments / HfDeepSpeedConfig "
            "sees the ZeRO-3 config, so that from_pretrained does not use zero.Init), or voters='rank'.")


def broadcast_start(model) -> None:
    """Every parameter and buffer from rank 0 over every rank (in place; through the accelerator
    for NCCL, which carries no CPU tensor)."""
    device = None
    if dist.get_backend() == "nccl":
        from deepspeed.accelerator import get_accelerator
        device = torch.device(get_accelerator().current_device_name())
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if (device is None or t.device == device) and t.is_contiguous():
                dist.broadcast(t.data, src=0)
            else:
                buf = t.data.to(device or t.device).contiguous()
                dist.broadcast(buf, src=0)
                t.data.copy_(buf)


# ----------------------------------------------------------------------------- the optimizer
def inner_config(config: LionCubConfig) -> LionCubConfig:
    """The settings of the LionCubs stepping the partitions: the grouping is the framework's."""
    kw = {f: getattr(config, f) for f in LionCubConfig.keys()}
    kw.update(voters="rank", node_size=None)
    return LionCubConfig(**kw)


class ZeRO3Votes(torch.optim.Optimizer):
    """The optimizer DeepSpeed's ZeRO-3 steps (see the module doc). Its param groups carry the
    hyperparameters (schedulers set ``lr`` here); the LionCubs inside read them at every step.
    State lives in those LionCubs; ``state_dict`` holds theirs (ZeRO-3 saves it per rank)."""

    def __init__(self, params, config: LionCubConfig, shard_groups: ShardGroups, names: dict | None = None):
        defaults = dict(lr=config.lr, betas=tuple(config.betas), weight_decay=config.weight_decay)
        super().__init__(params, defaults)
        self.config = config
        self.shard_groups = shard_groups
        self.names = dict(names or {})
        self.inner: list = []       # one LionCub per ZeRO-3 sub-group (made by wire())
        self.flats: list = []       # the fp32 flat partition each LionCub's views alias
        self.views: list = []       # per sub-group: [(view, offset, numel)]
        self.sub_to_group: list = []
        self._by_flat: dict = {}

    def wire(self, zopt) -> None:
        """Build the LionCubs over ZeRO-3's fp32 partitions (collective: every rank, same order)."""
        k = self.shard_groups.shard_rank
        cfg = inner_config(self.config)
        for i, flat in enumerate(zopt.fp32_partitioned_groups_flat):
            if flat.numel() == 0:
                raise ZeRO3VotesError("LionCub: ZeRO-3 with votes needs the fp32 partitions in memory; "
                                      "offload_optimizer.device='nvme' swaps them out. Allowed: 'none' or 'cpu'.")
            views, names, off = [], [], 0
            for p in zopt.fp16_groups[i]:
                n = int(p.partition_numel())
                v = flat.detach().narrow(0, off, n)
                v.requires_grad_(True)
                # the partition of shard rank k starts at element k*n of the flattened parameter
                setattr(v, ELEMENT_START, k * n)
                views.append((v, off, n))
                names.append(self.names.get(p))
                off += n
            if off != flat.numel():
                raise ZeRO3VotesError(f"LionCub: ZeRO-3 sub-group {i}: the parameters' partitions ({off} elements) "
                                      f"do not tile its fp32 partition ({flat.numel()})")
            gid = int(zopt.sub_group_to_group_id[i])
            g = self.param_groups[gid]
            group = {"params": [v for v, _, _ in views], "lr": g["lr"], "betas": g["betas"],
                     "weight_decay": g["weight_decay"]}
            if all(nm is not None for nm in names):
                group["param_names"] = names
            self.inner.append(LionCub([group], config=cfg, shard_groups=self.shard_groups))
            self.flats.append(flat)
            self.views.append(views)
            self.sub_to_group.append(gid)
            self._by_flat[id(flat)] = i

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ZeRO3VotesError("LionCub under ZeRO-3 takes no closure")
        flats = [p for g in self.param_groups for p in g["params"]]
        if not self.inner or not flats:
            return None  # ZeRO-3's set-up, before wire(): nothing to step
        i = self._by_flat.get(id(flats[0])) if len(flats) == 1 else None
        if i is None:
            raise ZeRO3VotesError("LionCub: ZeRO-3 stepped a tensor that is not one of its fp32 partitions "
                                  "(swapped or rebuilt?)")
        flat, inner = self.flats[i], self.inner[i]
        g = self.param_groups[self.sub_to_group[i]]
        ig = inner.param_groups[0]
        ig["lr"], ig["betas"], ig["weight_decay"] = g["lr"], g["betas"], g["weight_decay"]
        grad = flat.grad
        for v, off, n in self.views[i]:
            v.grad = None if grad is None else grad.narrow(0, off, n)
        try:
            inner.step()
        finally:
            for v, _, _ in self.views[i]:
                v.grad = None
        return None

    def zero_grad(self, set_to_none: bool = True):
        return None  # ZeRO-3 owns the gradients

    # --------------------------------------------------------------- state
    def state_dict(self):
        return {"lioncub_zero3": [opt.state_dict() for opt in self.inner],
                "layout": self.layout(), "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                                          for g in self.param_groups]}

    def load_state_dict(self, state_dict):
        saved = state_dict.get("lioncub_zero3") if isinstance(state_dict, dict) else None
        if saved is None:
            raise ZeRO3VotesError("LionCub: this ZeRO-3 checkpoint holds no LionCub state (saved by another "
                                   "optimizer or without votes)")
        if state_dict.get("layout") != self.layout():
            raise layout_error("the checkpoint", state_dict.get("layout"), self.layout())
        for opt, sd in zip(self.inner, saved):
            opt.load_state_dict(sd)
        for g, sg in zip(self.param_groups, state_dict.get("param_groups", [])):
            for key in ("lr", "betas", "weight_decay"):
                if key in sg:
                    g[key] = sg[key]

    def layout(self) -> dict:
        sg = self.shard_groups
        return {"shard_groups": sg.groups, "shard_size": sg.shard_size,
                "sub_groups": [int(f.numel()) for f in self.flats]}

    # --------------------------------------------------------------- what the integration reports
    def comm_stats(self) -> dict:
        """LionCub's telemetry summed over the sub-groups' LionCubs (bytes per rank; each steps once
        per optimizer step, so ``last_step`` is the optimizer step's)."""
        out: dict = {}
        snaps = [opt.comm_stats() for opt in self.inner]
        for snap in snaps:
            _add_into(out, snap)
        for part in (out.get("last_step"), out.get("cumulative")):
            if isinstance(part, dict):
                sent = part.get("bytes_sent") or 0
                part["ratio_vs_fp32"] = part.get("fp32_allreduce_bytes", 0) / sent if sent else None
                part["ratio_vs_bf16"] = part.get("bf16_allreduce_bytes", 0) / sent if sent else None
        if snaps:
            out["steps"] = snaps[0]["steps"]  # every sub-group's LionCub steps once per optimizer step
        return out

    def state_bytes(self) -> dict:
        out: dict = {}
        for opt in self.inner:
            _add_into(out, opt.state_bytes())
        return out

    @property
    def step_count(self) -> int:
        return self.inner[0].step_count if self.inner else 0


def _add_into(acc: dict, snap: dict) -> None:
    """Sum the numbers of ``snap`` into ``acc``, key by key (nested dicts too); other values: the first seen."""
    for key, value in snap.items():
        if isinstance(value, dict):
            _add_into(acc.setdefault(key, {}), value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            acc[key] = acc.get(key, 0) + value
        else:
            acc.setdefault(key, value)


def describe(layout, other=None) -> str:
    """The vote layout in words; with ``other``, also its partition sizes where those are what differs."""
    if not isinstance(layout, dict):
        return "no ZeRO-3 vote layout"
    text = f"{layout.get('shard_groups')} shard groups x {layout.get('shard_size')} ranks (node_size)"
    groups_same = isinstance(other, dict) and all(layout.get(k) == other.get(k) for k in ("shard_groups", "shard_size"))
    if groups_same and layout.get("sub_groups") != other.get("sub_groups"):
        sizes = layout.get("sub_groups") or []
        shown = ", ".join(f"{n:,}" for n in sizes[:4]) + (f" and {len(sizes) - 4} more" if len(sizes) > 4 else "")
        text += f" in {len(sizes)} sub-group partition(s) of {shown} elements"
    return text


def layout_error(where: str, saved, mine: dict, tail: str = "") -> ZeRO3VotesError:
    """The refusal of a checkpoint saved under another vote layout (names both, what differs, and
    the way out)."""
    if (isinstance(saved, dict) and all(saved.get(k) == mine.get(k) for k in ("shard_groups", "shard_size"))):
        allowed = ("Allowed: the model and zero_optimization.sub_group_size it was saved with (the partitions "
                   "each rank steps; ZeRO-3 votes do not reshard yet)")
    else:
        allowed = ("Allowed: resume with the same node_size and number of ranks (ZeRO-3 votes do not reshard yet)")
    return ZeRO3VotesError(f"LionCub: {where} was saved with {describe(saved, mine)}; this run has "
                           f"{describe(mine, saved)}. {allowed}{tail}")


def build(engine, model_parameters, config: LionCubConfig) -> ZeRO3Votes:
    names = {p: n for n, p in engine.module.named_parameters()}
    cpu = engine.mpu.cpu_shard_groups  # offload_optimizer: vote over gloo on the CPU partitions
    return ZeRO3Votes(model_parameters, config, cpu if cpu is not None else shard_groups_of(engine), names)


# ----------------------------------------------------------------------------- agreement
def agree_across_groups(zopt, sg: ShardGroups) -> None:
    """Make ZeRO-3's skip decisions (non-finite gradient norm; fp16 overflow) the same in every
    group: each is computed over the group, then a flag is all-reduced (MAX) over the shard peers.

    ZeRO-3 (where its module has ``combine_grad_norm_groups``) also skips when the sub-groups' norms
    combine to an invalid one; with the optimizer offloaded the norms are fp32, so two finite ones can
    overflow together in one group only. That combination, made by DeepSpeed's own function on the
    same norms, joins the flag."""
    device = _param_device(zopt)  # the parameters' device: NCCL takes no CPU tensor (offloaded masters are)
    combine = getattr(importlib.import_module(type(zopt).__module__), "combine_grad_norm_groups", None)

    def flag_max(bad) -> bool:
        t = torch.as_tensor(bad, device=device).to(torch.int32).reshape(1)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=sg.peers)
        return bool(t.item())  # ZeRO-3 reads its decision on the host right after: no extra sync point

    get_norms = zopt._get_norm_groups  # noqa: SLF001 - the seam listed in lioncub_ds/deepspeed/_compat.py

    def _get_norm_groups():
        norms = get_norms()
        # invalid: non-finite, or DeepSpeed's -1 sentinel for one (what its is_invalid_grad_norm tests);
        # decided on the device, so the flag's all-reduce carries the step's only host read
        bad = torch.zeros((), dtype=torch.bool, device=device)
        for t in [*norms, *([combine(norms)] if combine is not None and norms else [])]:
            t = torch.as_tensor(t, device=device)
            bad = bad | (~torch.isfinite(t) | (t < 0)).any()
        if flag_max(bad):
            return [torch.tensor(float("inf"), device=torch.as_tensor(norms[0]).device)] if norms else norms
        return norms

    zopt._get_norm_groups = _get_norm_groups  # noqa: SLF001

    has_overflow = zopt.has_overflow

    def agreed_overflow(*args, **kwargs):
        return flag_max(bool(has_overflow(*args, **kwargs)))

    zopt.has_overflow = agreed_overflow


def _param_device(zopt):
    for group in zopt.fp16_groups:
        for p in group:
            return p.device
    return torch.device("cpu")


# ----------------------------------------------------------------------------- wiring
ZERO3_ATTRS = ("fp32_partitioned_groups_flat", "fp16_groups", "sub_group_to_group_id", "_get_norm_groups",
               "has_overflow", "dp_process_group")
LAYOUT_FILE = "lioncub_zero3_layout.json"


def wire_engine(engine):
    """After DeepSpeed built its ZeRO-3 optimizer around :class:`ZeRO3Votes`: build the LionCubs
    on the fp32 partitions, agree the skip decisions across groups, name the per-group checkpoint
    files, attach ``engine.lioncub`` and log the one line."""
    from . import _compat
    from .checkpoint import install_engine_hooks
    from .engine import EngineState, check_supported, options_of
    opt = engine.basic_optimizer
    check_supported(engine)
    zopt = engine.optimizer
    missing = [a for a in ZERO3_ATTRS if not hasattr(zopt, a)]
    if missing:
        raise ZeRO3VotesError(f"LionCub: this DeepSpeed's ZeRO-3 optimizer ({type(zopt).__name__}) lacks "
                              f"{', '.join(missing)}; tested DeepSpeed: {', '.join(_compat.TESTED_VERSIONS)}")
    sg = shard_groups_of(engine)  # the default backend's groups: ZeRO-3's, and its skip flag's
    # ZeRO-3 partitions and reduces each parameter over its own ds_process_group: every one must be
    # the node group (a model from zero.Init is refused in initialize; this catches any other way)
    shard = group_ranks(sg.shard)
    other = [p for group in zopt.fp16_groups for p in group
             if group_ranks(getattr(p, "ds_process_group", zopt.dp_process_group)) != shard]
    if dist.get_world_size(zopt.dp_process_group) != sg.shard_size or other:
        raise ZeRO3VotesError("LionCub: ZeRO-3 partitions over a group that is not the node group (a model built "
                              "under deepspeed.zero.Init?); build the model outside deepspeed.zero.Init")
    opt.wire(zopt)
    agree_across_groups(zopt, sg)
    name_files_per_group(engine, sg)
    install_engine_hooks(engine)
    install_layout_check(engine, opt)
    n = sg.groups * sg.shard_size
    engine.lioncub = EngineState(opt, 3, "zero3_votes", options_of(opt), world_size=n,
                                 wrapper=type(zopt).__name__)
    if getattr(engine, "global_rank", 0) == 0:
        _compat.ds_logger().warning(engine.lioncub.summary())
    return engine.lioncub


def name_files_per_group(engine, sg: ShardGroups) -> None:
    """ZeRO-3 names its per-rank files by the rank inside its data-parallel group, the same in
    every shard group: group j > 0 inserts ``_group{j}`` (its momenta differ from group 0's)."""
    j = sg.group_index
    if j == 0:
        return
    rank_zero_name = engine._get_rank_zero_ckpt_name  # noqa: SLF001 - listed in _compat
    ckpt_name = engine._get_ckpt_name  # noqa: SLF001

    def _get_rank_zero_ckpt_name(checkpoints_path, tag, mp_rank, dp_rank, bf16_mode):
        name = rank_zero_name(checkpoints_path, tag, mp_rank, dp_rank, bf16_mode)
        head, base = os.path.split(name)
        return os.path.join(head, base.replace(f"pp_rank_{dp_rank}_", f"pp_rank_{dp_rank}_group{j}_", 1))

    def _get_ckpt_name(checkpoints_path, tag, mp_placeholder=None, pp_placeholder=None):
        name = ckpt_name(checkpoints_path, tag, mp_placeholder, pp_placeholder)
        head, base = os.path.split(name)
        return os.path.join(head, base.replace("_mp_rank_", f"_group{j}_mp_rank_", 1)
                            if base.startswith("zero_pp_rank_") else base)

    engine._get_rank_zero_ckpt_name = _get_rank_zero_ckpt_name  # noqa: SLF001
    engine._get_ckpt_name = _get_ckpt_name  # noqa: SLF001


def install_layout_check(engine, opt: ZeRO3Votes) -> None:
    """save: every rank writes the vote layout beside DeepSpeed's files (the same content; with
    node-local storage each node then has it); load: every rank reads it, the ranks agree (one
    flag all-reduce over every rank), and another layout, or a file some rank cannot read, is
    refused on every rank by name before DeepSpeed loads anything."""
    save, load = engine.save_checkpoint, engine.load_checkpoint

    def save_checkpoint(save_dir, tag=None, *args, **kwargs):
        if tag is None:
            tag = f"global_step{engine.global_steps}"
        os.makedirs(os.path.join(save_dir, str(tag)), exist_ok=True)
        path = os.path.join(save_dir, str(tag), LAYOUT_FILE)
        tmp = f"{path}.tmp{dist.get_rank()}"  # one temporary per rank: the replace is atomic either way
        with open(tmp, "w") as f:
            json.dump(opt.layout(), f)
        os.replace(tmp, path)
        return save(save_dir, tag, *args, **kwargs)

    def load_checkpoint(load_dir, tag=None, *args, **kwargs):
        from .checkpoint import _resolve_tag
        t = _resolve_tag(engine, load_dir, tag)
        here = t is not None and os.path.isdir(os.path.join(load_dir, str(t)))
        saved, problem = None, None
        if here:
            path = os.path.join(load_dir, str(t), LAYOUT_FILE)
            if os.path.isfile(path):
                with open(path) as f:
                    saved = json.load(f)
            if saved != opt.layout():
                problem = layout_error(os.path.dirname(path), saved, opt.layout(), "; nothing was loaded")
        # agreed over every rank: DeepSpeed writes 'latest' on global rank 0 only, so with node-local
        # storage a rank of another node may find no tag (or another one) and load nothing while the
        # others load: the groups would go on from different states. The tag's CRC: equal everywhere.
        crc = zlib.crc32(str(t).encode()) if here else 0
        refused, some_here, some_missing, crc_max, crc_neg = world_max(
            [problem is not None, here, not here, crc, -crc if here else -(2**32)], engine.device)
        if problem is not None:
            raise problem
        if refused:
            raise ZeRO3VotesError(f"LionCub: another rank refused the checkpoint {load_dir!r} (tag {t!r}): its vote "
                                  f"layout file ({LAYOUT_FILE}) is missing there or says another layout (node-local "
                                  "storage without the file on that node?); nothing was loaded, on any rank")
        if some_here and some_missing:
            if here:
                what = f"this rank finds tag {t!r} in {load_dir!r}, another rank finds no checkpoint there"
            elif t is None:
                what = f"this rank finds no 'latest' file in {load_dir!r} (and no tag was given), other ranks do"
            else:
                what = f"this rank finds no tag folder {os.path.join(load_dir, str(t))!r}, other ranks do"
            raise ZeRO3VotesError(f"LionCub: {what} (DeepSpeed writes 'latest' on global rank 0 only: node-local "
                                  "storage?). Allowed: load_checkpoint(load_dir, tag=<the tag>) with the tag folder "
                                  "on every node; nothing was loaded, on any rank")
        if some_here and crc_max != -crc_neg:
            raise ZeRO3VotesError(f"LionCub: the ranks resolved different checkpoint tags in {load_dir!r} (this rank: "
                                  f"{t!r}; 'latest' differs between nodes?). Allowed: load_checkpoint(load_dir, "
                                  "tag=<the tag>); nothing was loaded, on any rank")
        return load(load_dir, tag, *args, **kwargs)

    save_checkpoint.__wrapped__, load_checkpoint.__wrapped__ = save, load
    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint


# ----------------------------------------------------------------------------- consolidation
def fp32_state_dict(checkpoint_dir, tag=None) -> dict:
    """The full fp32 model state dict of a ZeRO-3-with-votes checkpoint, on the CPU (what
    DeepSpeed's ``zero_to_fp32`` gives for plain ZeRO-3). DeepSpeed's tool counts every
    ``*_optim_states.pt`` of the tag folder and expects one per partition, so it refuses the
    ``_group{j}`` files of the other groups; their partitions equal group 0's (every group applies
    the same update), so group 0's files alone are the whole model. This reads them through
    DeepSpeed's own consolidation, from a scratch folder of links to every other file."""
    import tempfile

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    checkpoint_dir = os.path.abspath(os.fspath(checkpoint_dir))
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"LionCub: no tag given and no 'latest' file in {checkpoint_dir!r}; allowed: "
                                    "tag=<the tag folder's name>")
        with open(latest) as f:
            tag = f.read().strip()
    src = os.path.join(checkpoint_dir, str(tag))
    if not os.path.isdir(src):
        raise FileNotFoundError(f"LionCub: no checkpoint tag folder {src!r}")
    with tempfile.TemporaryDirectory(prefix="lioncub_zero3_") as tmp:
        dst = os.path.join(tmp, str(tag))
        os.makedirs(dst)
        for name in os.listdir(src):
            if "_group" not in name:
                os.symlink(os.path.join(src, name), os.path.join(dst, name))
        return get_fp32_state_dict_from_zero_checkpoint(tmp, tag=str(tag))
