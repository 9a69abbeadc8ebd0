"""DeepSpeed engine wiring for LionCub (registration, stage-0 local momentum, ZeRO 1/2).

What :func:`register` patches (idempotent; originals kept as ``__wrapped__``):

* ``DeepSpeedEngine._is_supported_optimizer``: ``"LionCub"`` (any case) is a known type.
* ``DeepSpeedEngine._configure_basic_optimizer``: builds :class:`lioncub_ds.LionCub` from
  ``optimizer.params`` (validated first; a misspelled key names the closest valid one).
* ``DeepSpeedEngine._configure_optimizer``: refuses unsupported settings *before* any state
  exists, then wires the engine (below) once DeepSpeed has built its wrappers.
* ``deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS`` gains LionCub (no
  ``zero_allow_untested_optimizer`` needed).
* ``deepspeed.runtime.zero.stage_1_and_2.all_gather_dp_groups``: a dispatcher that runs the
  1-bit sign all-gather for engines that enabled it (see :mod:`.zero`), and DeepSpeed's own
  all-gather for everything else.

Wiring, ZeRO stage 0 (Lion Cub semantics, docs/conventions.md): ``engine.enable_backward_allreduce =
False`` (gradients are never all-reduced, also not at the accumulation boundary or in the
unmanaged-accumulation path: both test that flag), LionCub votes over the engine's
data-parallel group (the mpu's when one is given), gradient clipping clips each rank's
LOCAL gradient by its LOCAL norm, fp32 steps that LionCub skips (non-finite gradients on
any rank) are reported to the engine like an fp16 overflow. fp16/bf16 wrappers agree on
overflow over the data-parallel group (DeepSpeed's ``CheckOverflow`` all-reduces its flag
when ``enable_backward_allreduce`` is False), so every rank skips and backs off its loss
scale identically.

The wrapper must be unpartitioned at stage 0: ``_configure_bf16_optimizer`` refuses to wrap
a stage-0 LionCub in DeepSpeed's BF16_Optimizer (partitioned fp32 masters), and
:func:`check_unpartitioned` checks any wrapper after the fact.

Wiring, ZeRO stage 1/2 (global-Lion semantics): DeepSpeed reduces the gradients and
partitions the momentum; LionCub runs as a plain single-process Lion on its fp32
partition (it gets a process group of size 1, so it never votes; destroyed at exit).

ds_config ``params`` also accept ``eps`` (HF's template fills it; Lion has none): dropped,
with one warning on rank 0 (:func:`config_warnings`, also for Adam's betas (0.9, 0.999)).
Every engine logs one line on rank 0 through DeepSpeed's logger (:meth:`EngineState.summary`).
Every DeepSpeed name used here is listed and checked in :mod:`._compat`.
"""
from __future__ import annotations

import atexit
import collections
import contextvars
import math
import numbers
import types
import weakref

import torch
import torch.distributed as dist

from ..config import LionCubConfig, LionCubConfigError, unknown_key_error
from .. import ds_shm, groups
from ..groups import Request, create_on_all_ranks, requested, world_max
from ..optimizer import LionCub
from . import _compat

OPTIMIZER_NAME = "LionCub"
# ds_config optimizer.params keys that configure the integration, not the optimizer.
INTEGRATION_KEYS = ("zero_allgather", "zero_fp32_replica")
# Keys other optimizers' templates carry that Lion has no use for: accepted, ignored, warned about.
# HF's DeepSpeed template has "eps": "auto" (filled from --adam_epsilon).
IGNORED_KEYS = ("eps",)
ZERO_ALLGATHER_MODES = ("auto", "sign", "params")
# What HF's "betas": "auto" fills in by default (--adam_beta1 / --adam_beta2): Adam's betas.
ADAM_DEFAULT_BETAS = (0.9, 0.999)
DEFAULT_OPTIONS = {"zero_allgather": "auto", "zero_fp32_replica": False}
_MARK = "_lioncub_ds_patch"
_OPTIONS_ATTR = "_lioncub_ds_options"  # on a LionCub: its integration options (set by build / set_options)

_SINGLETON_GROUP = {}
# What this adapter remembers about each LionCub it drives (kept here, not on the optimizer):
# the vote group it built for it, and its step count before the engine's step (overflow report).
_BUILT_GROUP = weakref.WeakKeyDictionary()
_STEPS_BEFORE = weakref.WeakKeyDictionary()
# (group, device) while a stage-0 fp16/bf16 wrapper around LionCub steps (_agree_wrapper_skips)
_AGREE_NORM_OVER = contextvars.ContextVar("lioncub_agree_norm_over", default=None)
# Optimizers that hold the singleton group: released at exit (process-lifetime resource, not options).
_SINGLETON_USERS: "weakref.WeakSet" = weakref.WeakSet()
_registered = False


class LionCubDeepSpeedError(RuntimeError):
    """A DeepSpeed setting that LionCub does not support (named in the message)."""


def is_lioncub_name(name) -> bool:
    return isinstance(name, str) and name.replace("_", "").lower() == "lioncub"


# ----------------------------------------------------------------------------- options
def split_params(params: dict | None, where: str = "ds_config optimizer.params"):
    """Split ds_config params into (LionCub kwargs, integration options); validate both.

    ``eps`` (Adam's epsilon; HF's template has ``"eps": "auto"``) is accepted and dropped:
    Lion has no epsilon. :func:`config_warnings` says so.
    """
    params = dict(params or {})
    if "max_grad_norm" in params:
        raise LionCubConfigError("LionCub: 'max_grad_norm' is not an optimizer parameter; use the ds_config "
                                 "top-level \"gradient_clipping\" (it clips each rank's local gradient at ZeRO "
                                 "stage 0, the reduced gradient at stage 1/2)")
    allowed = LionCubConfig.keys() + INTEGRATION_KEYS + IGNORED_KEYS
    for key in params:
        if key not in allowed:
            raise unknown_key_error(key, allowed, where)
    if "eps" in params:
        eps = params.pop("eps")
        if eps is not None and not (isinstance(eps, numbers.Real) and not isinstance(eps, bool)
                                    and math.isfinite(eps) and eps >= 0):
            raise LionCubConfigError(f"LionCub: invalid {where} eps={eps!r}; allowed: a number >= 0 or null "
                                     "(ignored: Lion has no epsilon; remove the key)")
    options = {"zero_allgather": params.pop("zero_allgather", "auto"),
               "zero_fp32_replica": params.pop("zero_fp32_replica", False)}
    if options["zero_allgather"] not in ZERO_ALLGATHER_MODES:
        raise LionCubConfigError(f"LionCub: invalid zero_allgather={options['zero_allgather']!r}; allowed: "
                                 + " | ".join(repr(m) for m in ZERO_ALLGATHER_MODES))
    if not isinstance(options["zero_fp32_replica"], bool):
        raise LionCubConfigError(f"LionCub: invalid zero_fp32_replica={options['zero_fp32_replica']!r}; "
                                 "allowed: true | false")
    LionCubConfig.from_kwargs(where=where, **params)  # every optimizer setting, before any state exists
    return params, options


def config_warnings(params: dict | None) -> list[str]:
    """What to tell the user about a (valid) ds_config ``optimizer.params`` section."""
    params = params or {}
    out = []
    if "eps" in params:
        out.append(f"LionCub ignores optimizer.params eps={params['eps']!r}: Lion has no epsilon (HF's DeepSpeed "
                   "template fills \"eps\": \"auto\" from --adam_epsilon). Remove the key to silence this.")
    betas = params.get("betas")
    if isinstance(betas, (list, tuple)) and len(betas) == 2 and tuple(float(b) for b in betas) == ADAM_DEFAULT_BETAS:
        out.append("LionCub got betas=(0.9, 0.999): Adam's defaults, which HF's \"betas\": \"auto\" fills from "
                   "--adam_beta1/--adam_beta2 when they are not set. Lion wants a smaller beta2: (0.9, 0.99) "
                   "(Lion's default) or (0.95, 0.98) for LLMs. Pass --adam_beta1 0.95 --adam_beta2 0.98 (HF) or "
                   "write \"betas\": [0.95, 0.98] into the ds_config.")
    return out


def options_of(optimizer) -> dict:
    return dict(getattr(optimizer, _OPTIONS_ATTR, None) or DEFAULT_OPTIONS)


def set_options(optimizer, **options) -> None:
    """Integration options for a LionCub built by the user (client optimizer)."""
    for key in options:
        if key not in INTEGRATION_KEYS:
            raise unknown_key_error(key, INTEGRATION_KEYS, "LionCub DeepSpeed option")
    _, checked = split_params(options)
    setattr(optimizer, _OPTIONS_ATTR, checked)


# ----------------------------------------------------------------------------- groups
def data_parallel_group(engine):
    """The group LionCub votes over: the ranks DeepSpeed would reduce gradients over. With a
    sequence-parallel mpu (Ulysses) that is its sequence-data-parallel group: the ranks of one
    replica hold different sequence chunks, so each votes with its own partial gradient and all
    apply the same update (over the data-parallel group alone they would drift apart). Else the
    mpu's data-parallel group, else the engine's."""
    mpu = getattr(engine, "mpu", None)
    if mpu is not None and hasattr(mpu, "get_sequence_data_parallel_group"):
        return mpu.get_sequence_data_parallel_group()
    if mpu is not None and hasattr(mpu, "get_data_parallel_group"):
        return mpu.get_data_parallel_group()
    group = getattr(engine, "seq_data_parallel_group", None)
    if group is None:
        group = getattr(engine, "data_parallel_group", None)
    return group


def singleton_group():
    """A process group holding only this rank (LionCub then never votes). Cached; destroyed at exit.

    Collective on its first call: every rank creates every rank's one-rank group, in the same
    order (NCCL's rule), and keeps its own."""
    rank = dist.get_rank()
    if rank not in _SINGLETON_GROUP:
        _SINGLETON_GROUP[rank] = create_on_all_ranks([[rank]])[0]
        if len(_SINGLETON_GROUP) == 1:
            atexit.register(destroy_created_groups)
    return _SINGLETON_GROUP[rank]


def destroy_created_groups() -> int:
    """Destroy the process groups this integration created (runs at interpreter exit).

    Housekeeping: the HF Trainer never calls ``destroy_process_group``, so the groups would
    otherwise live until the interpreter's teardown. (The SIGABRT at exit seen in issue 17 is
    not caused by idle groups but by a worker freeing a late collective's tensors; see
    :mod:`lioncub_ds.groups`.) These groups hold one rank each, so destroying them is local:
    it cannot wait for a peer that is gone. Groups the user or DeepSpeed created are left
    alone. Returns how many were destroyed.
    """
    groups = list(_SINGLETON_GROUP.values())
    _SINGLETON_GROUP.clear()
    # A gloo group's worker threads stop only when the last reference goes: destroy_process_group
    # alone leaves them running while an optimizer still holds the group (measured: the thread
    # count does not drop). Drop ours, and let the optimizer drop its own where it can.
    for opt in list(_SINGLETON_USERS):
        release = getattr(opt, "release_process_group", None)
        if callable(release):
            release()
        if _BUILT_GROUP.get(opt) is not None:
            _BUILT_GROUP.pop(opt, None)
    _SINGLETON_USERS.clear()
    done = 0
    for group in groups:
        try:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group(group)
                done += 1
        except Exception:  # noqa: BLE001 - already destroyed with the default group: nothing left to do
            pass
    return done


# ----------------------------------------------------------------------------- checks
def overlap_requested(engine, optimizer=None) -> bool:
    """Whether the LionCub of this engine has ``overlap`` on: the client optimizer's setting, else
    the ds_config ``optimizer.params`` (only ``true`` counts; other values fail validation)."""
    if isinstance(optimizer, LionCub):
        return bool(optimizer.config.overlap)
    if optimizer is None and is_lioncub_name(engine.optimizer_name()):
        return (engine.optimizer_params() or {}).get("overlap") is True
    return False


def check_overlap(engine, optimizer=None) -> None:
    """``overlap: true`` needs votes that can start in backward: ZeRO stage 0 with fp32 parameters.

    Raised from ``deepspeed.initialize`` before LionCub is built (ds_config) or touched (a
    client optimizer), so nothing has changed yet."""
    if not overlap_requested(engine, optimizer):
        return
    stage = engine.zero_optimization_stage()
    if stage >= 1:
        raise LionCubDeepSpeedError(
            f"LionCub: optimizer.params overlap=true is not supported at ZeRO stage {stage} "
            f"(zero_optimization.stage={stage}): there DeepSpeed reduces the gradients and LionCub steps its fp32 "
            "partition as a single-process Lion, so there are no votes to start in backward (DeepSpeed overlaps its "
            "own gradient reduction: zero_optimization.overlap_comm). Allowed: overlap=false (or leave it out) at "
            "stage 1/2, or overlap=true with zero_optimization.stage=0 (Lion Cub votes).")
    low = "fp16.enabled=true" if engine.fp16_enabled() else "bf16.enabled=true" if engine.bfloat16_enabled() else None
    if low is not None:
        raise LionCubDeepSpeedError(
            f"LionCub: optimizer.params overlap=true at ZeRO stage 0 needs fp32 parameters; with {low} DeepSpeed's "
            "fp16/bf16 wrapper hands LionCub fp32 master copies and copies (unscales, clips) their gradients inside "
            "step(), so no vote can start in backward. Allowed: overlap=false with fp16/bf16, or overlap=true with "
            "fp32 parameters.")


# the engine whose overlapped LionCub owns a parameter's gradient-ready hook (a later
# deepspeed.initialize on the same model takes it over): an attribute on the parameter
_OVERLAP_OWNER = "_lioncub_overlap_engine"


def accumulation_boundary_condition(engine, params=()):
    """LionCub's launch condition at stage 0: a backward starts votes only when it is the engine's
    gradient-accumulation boundary (``engine.is_gradient_accumulation_boundary()``, which also
    honours ``set_gradient_accumulation_boundary``) and it does not run inside ``engine.no_sync()``.
    With ``managed_gradient_accumulation: false`` the boundary is ``step()`` itself, so the votes
    start there. Holds the engine weakly (the engine owns the optimizer).

    ``params``: the optimizer's parameters, claimed for this engine. DeepSpeed keeps an engine alive
    after the user drops it, and its optimizer's hooks stay on the parameters: when a later
    ``deepspeed.initialize`` on the same model claims them, the old optimizer starts no more votes
    in backward (it would launch collectives no step ever waits for)."""
    ref = weakref.ref(engine)
    params = list(params)
    for p in params:
        setattr(p, _OVERLAP_OWNER, ref)
    first = params[0] if params else None

    def condition() -> bool:
        if first is not None and getattr(first, _OVERLAP_OWNER, ref) is not ref:
            return False  # another engine took these parameters over
        eng = ref()
        if eng is None:
            return True
        return not getattr(eng, "inside_no_sync_ctxt", False) and bool(eng.is_gradient_accumulation_boundary())

    return condition


def overlap_clipping_warning(clip: float) -> str:
    return (f"LionCub overlap=true with gradient_clipping={clip:g} (DeepSpeed's default is 1.0): a vote needs the "
            "clipped gradient, so a step whose local gradient norm exceeds the clip votes again in step() after "
            "clipping (exact, but that step's overlapped votes are wasted; comm_stats(engine)['overlap']['revotes'] "
            "counts them). Set \"gradient_clipping\": 0 to keep every step overlapped.")


def requested_strategy(engine, optimizer=None) -> Request:
    """What the LionCub of this engine asks for (:func:`lioncub_ds.groups.requested`, before any
    group exists): the client optimizer's settings, else the ds_config ``optimizer.params`` (flat
    when neither is a LionCub)."""
    if isinstance(optimizer, LionCub):
        return requested(optimizer.config)
    if optimizer is None and is_lioncub_name(engine.optimizer_name()):
        return requested(engine.optimizer_params() or {})
    return requested({})


def check_node_voters(engine, optimizer=None) -> None:
    """``voters: "node"``, and master-only sharding (``voters: "rank"`` with ``node_size`` > 1),
    need ZeRO stage 0 with fp32 or bf16 parameters: LionCub shards the fp32 master of bf16
    parameters (and, with node voters, the momentum) inside each node group itself.

    Raised from ``deepspeed.initialize`` before LionCub is built (ds_config) or touched (a client
    optimizer), so nothing has changed yet."""
    req = requested_strategy(engine, optimizer)
    node = req.node_voters
    if not req.shards_state:
        return
    what = "voters='node'" if node else f"node_size={req.node_size} with voters='rank' (master-only sharding)"
    shards = ("the momentum and the fp32 master" if node else "the fp32 master of bf16 parameters")
    stage = engine.zero_optimization_stage()
    if stage == 3 and node and optimizer is None:
        return  # ZeRO-3 inside each node group, votes across them (lioncub_ds.deepspeed.zero3)
    if stage == 3 and node:
        raise LionCubDeepSpeedError(
            "LionCub: voters='node' at zero_optimization.stage=3 is set up from the ds_config (deepspeed.initialize "
            "makes one ZeRO-3 group per node group), not from a LionCub instance passed as optimizer=. Allowed: "
            "\"optimizer\": {\"type\": \"LionCub\", \"params\": {..., \"voters\": \"node\"}} in the ds_config.")
    if stage >= 1:
        raise LionCubDeepSpeedError(
            f"LionCub: optimizer.params {what} is not supported at ZeRO stage {stage} "
            f"(zero_optimization.stage={stage}): there DeepSpeed reduce-scatters uncompressed gradients over every "
            "rank and partitions the optimizer over all of them (global Lion), so there is no node group to shard in "
            f"and no vote between groups. Allowed: {what} with zero_optimization.stage=0 (LionCub shards {shards} "
            "inside each node group), voters='node' with zero_optimization.stage=3 (ZeRO-3 inside each node group, "
            "votes across them), or voters='rank' without node_size (the default) at stage 1/2/3.")
    if engine.fp16_enabled():
        raise LionCubDeepSpeedError(
            f"LionCub: optimizer.params {what} is not supported with fp16.enabled=true: DeepSpeed's fp16 "
            "loss-scaling wrapper keeps a full fp32 master copy of every parameter on every rank and hands LionCub "
            f"those copies, so sharding inside the node group would save none of that memory. Allowed: {what} "
            "with bf16.enabled=true or fp32 parameters, or voters='rank' without node_size with fp16.")


def check_supported(engine, optimizer=None) -> None:
    """Refuse settings LionCub cannot honour, naming the setting (never mis-train silently).

    ``optimizer``: the client LionCub when one was passed (else the ds_config settings are read)."""
    stage = engine.zero_optimization_stage()
    # read at stage 0 too: DeepSpeed ignores offload_optimizer there, and a user who set it expects it served
    off = engine.zero_offload_optimizer()
    device = getattr(off, "device", None)
    device = getattr(device, "value", device)
    node_voters = requested_strategy(engine, optimizer).node_voters
    if off is not None and device not in (None, "none"):
        if stage == 0:
            raise LionCubDeepSpeedError(
                f"LionCub: zero_optimization.offload_optimizer.device={device!r} needs ZeRO stage 1, 2 or 3 "
                "(zero_optimization.stage=0 keeps no partition to offload). Allowed: stage 1/2/3 with offload, or "
                "no offload_optimizer at stage 0.")
        if device != "cpu":
            raise LionCubDeepSpeedError(
                f"LionCub: zero_optimization.offload_optimizer.device={device!r} is not supported (the fp32 "
                "partitions must stay in memory for LionCub's kernels). Allowed: \"cpu\" or \"none\".")
        if node_voters and stage != 3:
            raise LionCubDeepSpeedError(
                f"LionCub: zero_optimization.offload_optimizer with voters='node' needs zero_optimization.stage=3 "
                f"(got {stage}). Allowed: stage 3 with voters='node', or voters='rank' with offload at stage 1/2/3.")
    if stage == 0:
        if getattr(engine, "pipeline_parallelism", False):
            raise LionCubDeepSpeedError(
                "LionCub at ZeRO stage 0 does not support pipeline parallelism (PipelineModule) yet: its "
                "per-stage gradient reduction is not wired. Use ZeRO stage 1 with pipeline parallelism.")
        if getattr(engine, "has_moe_layers", False):
            raise LionCubDeepSpeedError(
                "LionCub at ZeRO stage 0 does not support MoE layers: expert parameters have their own "
                "data-parallel groups. Use ZeRO stage 1/2.")
        if engine.torch_autocast_enabled() and engine.torch_autocast_dtype() == torch.float16:
            raise LionCubDeepSpeedError(
                "LionCub at ZeRO stage 0 does not support torch_autocast with float16 (torch.amp.GradScaler "
                "decides overflow per rank, ranks would diverge). Use \"fp16\": {\"enabled\": true} (DeepSpeed's "
                "loss scaler agrees on overflow across ranks) or bf16.")
    check_node_voters(engine, optimizer)
    check_overlap(engine, optimizer)


# ----------------------------------------------------------------------------- build
def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def build_optimizer(engine, model_parameters):
    """LionCub from the ds_config (``optimizer.type == "LionCub"``)."""
    raw = engine.optimizer_params()
    params, options = split_params(raw)
    stage = engine.zero_optimization_stage()
    group = None
    if dist.is_available() and dist.is_initialized():
        group = singleton_group() if stage >= 1 else data_parallel_group(engine)
    if stage == 0:
        model_parameters = _with_names(model_parameters, getattr(engine, "param_names", {}))
    # one validation of the settings, handed to the constructor as is (node_size=None: the launcher's
    # ranks per node, by lioncub_ds.groups.resolve_ranks_per_node: LOCAL_WORLD_SIZE, then LOCAL_SIZE)
    config = LionCubConfig.from_kwargs(where="ds_config optimizer.params", **params)
    if stage == 3:
        from . import zero3
        if zero3.shard_groups_of(engine) is not None:  # voters="node": ZeRO-3 per node group, votes across
            opt = zero3.build(engine, model_parameters, config)
            setattr(opt, _OPTIONS_ATTR, options)
            if _global_rank() == 0:
                for msg in config_warnings(raw):
                    _compat.ds_logger().warning(msg)
            return opt
        if requested(params).node_voters and dist.is_available() and dist.is_initialized():
            # votes were asked for, but the wrapped deepspeed.initialize made no node groups: one group
            # (L = the world) is plain ZeRO-3; anything else means it could not read the ds_config
            try:
                size = requested(params).ranks_per_node()
            except ValueError as exc:
                raise LionCubConfigError(str(exc)) from None
            if size != dist.get_world_size():
                raise zero3.ZeRO3VotesError(
                    "LionCub: optimizer.params voters='node' at zero_optimization.stage=3 needs deepspeed.initialize "
                    "to read the ds_config before DeepSpeed builds the engine (it makes the node groups), and it "
                    "could not (a config given in a form other than a dict or a JSON/HJSON file path, e.g. base64?). "
                    "Allowed: config=<dict> or a path to the JSON file, with lioncub_ds imported or installed.")
        config = zero3.inner_config(config)  # one ZeRO-3 group over every rank: global Lion, no vote
    opt = LionCub(model_parameters, process_group=group, config=config)
    if stage >= 1 and group is not None:
        _SINGLETON_USERS.add(opt)
    setattr(opt, _OPTIONS_ATTR, options)
    _BUILT_GROUP[opt] = group
    if _global_rank() == 0:
        for msg in config_warnings(raw):
            _compat.ds_logger().warning(msg)
    return opt


def _with_names(model_parameters, names: dict):
    """Attach parameter names (for momentum_sync.layers) when every parameter has one."""
    items = list(model_parameters)
    if not items or not names:
        return items
    if isinstance(items[0], dict):
        out = []
        for g in items:
            g = dict(g)
            ps = list(g["params"])
            if "param_names" not in g and "names" not in g and ps and not isinstance(ps[0], tuple) \
                    and all(p in names for p in ps):
                g["param_names"] = [names[p] for p in ps]
            g["params"] = ps
            out.append(g)
        return out
    if isinstance(items[0], torch.Tensor) and all(p in names for p in items):
        return [{"params": items, "param_names": [names[p] for p in items]}]
    return items


# ----------------------------------------------------------------------------- wiring
class EngineState:
    """What the integration attached to one engine (``engine.lioncub``)."""

    def __init__(self, optimizer, stage, mode, options, *, world_size=1, zero_adapter=None, sign_off_reason=None,
                 wrapper=""):
        self.optimizer = optimizer
        self.stage = stage
        self.mode = mode  # "local_momentum" (stage 0), "zero" (stage 1/2/3), "zero3_votes" (stage 3, voters="node")
        self.options = dict(options)  # zero_allgather, zero_fp32_replica
        self.world_size = world_size  # data-parallel ranks
        self.zero_adapter = zero_adapter
        self.sign_off_reason = sign_off_reason
        self.wrapper = wrapper

    @property
    def master_sharded(self) -> bool:
        """voters="node" or master-only sharding with 16-bit parameters stepped by LionCub itself:
        it holds their fp32 master shards (DeepSpeed's full fp32 copy is never made)."""
        return (self.mode == "local_momentum" and self.optimizer.strategy.shards_state
                and any(p.dtype != torch.float32 for g in self.optimizer.param_groups for p in g["params"]))

    @property
    def sign_allgather(self) -> bool:
        return self.zero_adapter is not None

    def summary(self) -> str:
        """The one line logged at wiring: stage, comm, N, sign all-gather, wrapper."""
        if self.mode == "zero3_votes":
            sg = self.optimizer.shard_groups
            return (f"LionCub: ZeRO stage 3 with node voters (ZeRO-3 inside each node group: parameters, gradients and "
                    f"fp32 master sharded 1/L; sign votes across groups); comm={self.optimizer.config.comm}; "
                    f"N={self.world_size} ({sg.groups} node groups x {sg.shard_size} ranks); wrapper={self.wrapper}")
        if self.mode == "local_momentum":
            what = "Lion Cub: local momentum, sign votes, no gradient all-reduce"
            comm = self.optimizer.config.comm
            sign = "off (stage 0 votes instead)"
        else:
            what = "global Lion on DeepSpeed's reduced gradients"
            comm = "none (DeepSpeed reduces gradients)"
            sign = "on" if self.sign_allgather else f"off ({self.sign_off_reason})"
        n = str(self.world_size)
        t = self.optimizer.topology if self.mode == "local_momentum" else None
        if t is not None and t.strategy.node_voters:
            what = ("Lion Cub node voters: reduce-scatter inside each node group, momentum"
                    + (" and fp32 master" if self.master_sharded else "") + " sharded 1/L, sign votes across groups")
            n = f"{t.world_size * t.node_size} ({t.world_size} node groups x {t.node_size} ranks)"
        elif t is not None and t.strategy.shards_state:
            what += (f"; fp32 master sharded 1/L over node groups of L={t.node_size} ranks" if self.master_sharded
                     else f"; node_size={t.node_size} (fp32 parameters: no master to shard)")
        line = (f"LionCub: ZeRO stage {self.stage} ({what}); comm={comm}; N={n}; "
                f"sign all-gather={sign}; wrapper={self.wrapper}")
        if self.mode == "local_momentum" and self.optimizer.config.overlap:
            line += "; overlap=on (votes start in the backward of each accumulation-boundary micro-batch)"
        return line

    def __repr__(self):
        return (f"EngineState(stage={self.stage}, mode={self.mode!r}, "
                f"zero_allgather={'sign' if self.zero_adapter else 'params' if self.mode == 'zero' else None})")


def check_unpartitioned(engine, opt) -> None:
    """Stage 0: LionCub must step full replicas. A wrapper that hands it a partition (DeepSpeed's
    BF16_Optimizer keeps fp32 masters partitioned across the data-parallel ranks) would make
    each rank vote on a different slice of the model, silently. Raise instead."""
    # Unpartitioned wrappers hand LionCub the parameters themselves or full fp32 copies of them,
    # so every tensor it steps has the shape of a model parameter (a subset is fine). A partitioned
    # wrapper hands it flat slices instead.
    # trainable tensors on both sides: frozen parameters (e.g. LoRA's base weights) may sit in the
    # optimizer's groups, and LionCub leaves them out of its buckets
    shapes = collections.Counter(tuple(p.shape) for p in engine.module.parameters() if p.requires_grad)
    stepped_shapes = collections.Counter(tuple(p.shape) for g in opt.param_groups for p in g["params"]
                                         if p.requires_grad)
    if stepped_shapes - shapes:
        model = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
        stepped = sum(p.numel() for g in opt.param_groups for p in g["params"] if p.requires_grad)
        raise LionCubDeepSpeedError(
            f"LionCub at ZeRO stage 0 needs an unpartitioned optimizer wrapper, but DeepSpeed wrapped it in "
            f"{type(engine.optimizer).__name__}, which gives it {stepped:,} of the model's {model:,} trainable "
            "elements (fp32 master weights partitioned across the data-parallel ranks): every rank would vote on "
            "a different partition. " + _BF16_ADVICE)


_BF16_ADVICE = ("Either keep zero_optimization.stage=0 (Lion Cub) with bf16.enabled=true and no "
                "data_types.grad_accum_dtype=\"fp32\" (DeepSpeed then uses its unpartitioned bf16 wrapper), or "
                "fp32 / fp16.enabled=true; or use zero_optimization.stage=1 or 2 (global Lion on reduced gradients, "
                "where partitioned masters are correct).")


def scale_fp16_loss(engine) -> None:
    """Stage 0 fp16: the loss is scaled before backward, as DeepSpeed's fp16 wrapper expects.

    DeepSpeed's fp16 wrapper at stage 0 (``FP16_UnfusedOptimizer``) divides the gradients by its loss
    scale and clips by norm / scale, but DeepSpeed 0.19's ``engine.backward`` scales the loss only for
    its ZeRO optimizers and torch autocast: the gradients reached LionCub 1/scale too small, clipping
    never fired, and the dynamic scale, never overflowing, grew until the gradients underflowed. The
    first backward (at a scale other than 1) tells whether this DeepSpeed scales the loss itself (the
    gradient reaching the loss tensor); if it does not, that backward's gradients are scaled after
    the fact and every later loss is scaled before backward (returned unscaled, as DeepSpeed returns it)."""
    cfg = getattr(engine.optimizer, "loss_scale_config", None)
    if cfg is None or not getattr(cfg, "use_grad_scaling", False):
        return
    orig = engine.backward
    ours = None  # None: not known yet; True: this wrapper scales the loss; False: DeepSpeed does

    def backward(loss, *args, **kwargs):
        nonlocal ours
        scale = float(cfg.cur_scale)
        if ours is True:
            # in fp32, as DeepSpeed's own fp16 backward scales it (an fp16 loss x 65536 would overflow)
            out = orig(loss.float() * scale, *args, **kwargs)
            return (out / scale).to(loss.dtype) if isinstance(out, torch.Tensor) else out
        if ours is False or scale == 1.0 or not (isinstance(loss, torch.Tensor) and loss.requires_grad):
            return orig(loss, *args, **kwargs)
        seen = []
        hook = loss.register_hook(lambda g: seen.append(float(g.detach().float().reshape(-1)[0])))
        try:
            out = orig(loss, *args, **kwargs)
        finally:
            hook.remove()
        if seen:
            scale_wrt_gas = kwargs.get("scale_wrt_gas", args[1] if len(args) > 1 else True)
            gas = engine.gradient_accumulation_steps() if scale_wrt_gas else 1
            ours = abs(seen[0] * gas - 1.0) < 0.5  # 1/gas unscaled; scale/gas when DeepSpeed scaled it
            if ours:
                with torch.no_grad():
                    for p in engine.module.parameters():
                        if p.grad is not None:
                            p.grad.mul_(scale)
        return out

    backward.__wrapped__ = orig
    engine.backward = backward


def wire(engine) -> EngineState:
    opt = engine.basic_optimizer
    stage = engine.zero_optimization_stage()
    check_supported(engine, opt)
    missing = _compat.engine_missing(engine)
    if missing:
        raise LionCubDeepSpeedError(f"LionCub cannot wire this DeepSpeed engine: it lacks {', '.join(missing)} "
                                    f"(tested DeepSpeed: {', '.join(_compat.TESTED_VERSIONS)})")
    options = options_of(opt)
    wrapper = type(engine.optimizer).__name__
    if stage == 0:
        check_unpartitioned(engine, opt)
        engine.enable_backward_allreduce = False
        if hasattr(engine, "pipeline_enable_backward_allreduce"):
            engine.pipeline_enable_backward_allreduce = False
        group = data_parallel_group(engine) if dist.is_available() and dist.is_initialized() else None
        if group is not None and _BUILT_GROUP.get(opt) is not group:
            try:
                opt.set_process_group(group)
            except RuntimeError as exc:
                raise LionCubDeepSpeedError(f"LionCub: cannot vote over the engine's data-parallel group: {exc}; "
                                            "pass an optimizer that has not stepped yet") from exc
        engine.clip_fp32_gradients = types.MethodType(clip_local_gradients, engine)
        if engine.optimizer is not opt and engine.fp16_enabled():
            scale_fp16_loss(engine)
        if engine.optimizer is not opt and group is not None:
            _agree_wrapper_skips(engine.optimizer, group)
        if engine.optimizer is opt:
            _report_skips_as_overflow(opt)
            if engine.bfloat16_enabled() or engine.fp16_enabled():
                # bf16 with its master sharded: no DeepSpeed wrapper, so nothing else clips (the engine
                # clips only fp32 runs itself); clip the local bf16 gradients right before the step.
                _clip_before_step(engine, opt)
        if opt.config.overlap:
            if engine.optimizer is not opt:  # check_overlap refuses fp16/bf16; any other wrapper too
                raise LionCubDeepSpeedError(
                    f"LionCub: optimizer.params overlap=true at ZeRO stage 0 needs LionCub to step the model's own "
                    f"parameters, but DeepSpeed wrapped it in {type(engine.optimizer).__name__}, which copies the "
                    "gradients inside step(). Allowed: overlap=false with this config.")
            # Gradient accumulation: only the accumulation-boundary micro-batch's backward starts votes.
            opt.set_launch_condition(accumulation_boundary_condition(
                engine, [p for g in opt.param_groups for p in g["params"]]))
            clip = float(engine.gradient_clipping() or 0.0)
            if clip > 0 and getattr(engine, "global_rank", 0) == 0:
                _compat.ds_logger().warning(overlap_clipping_warning(clip))
        state = EngineState(opt, stage, "local_momentum", options, world_size=opt.world_size, wrapper=wrapper)
    else:
        if dist.is_available() and dist.is_initialized() and opt.world_size != 1:
            try:
                opt.set_process_group(singleton_group())
                _SINGLETON_USERS.add(opt)
            except RuntimeError as exc:
                raise LionCubDeepSpeedError(f"LionCub under ZeRO stage {stage} must run as a single-process Lion "
                                            f"on its partition: {exc}") from exc
        from .zero import maybe_enable_sign_allgather
        adapter, why = maybe_enable_sign_allgather(engine, opt, options)
        group = data_parallel_group(engine) if dist.is_available() and dist.is_initialized() else None
        n = dist.get_world_size(group) if group is not None or (dist.is_available() and dist.is_initialized()) else 1
        state = EngineState(opt, stage, "zero", options, world_size=n, zero_adapter=adapter, sign_off_reason=why,
                            wrapper=wrapper)
    from .checkpoint import install_engine_hooks
    install_engine_hooks(engine)
    engine.lioncub = state
    if getattr(engine, "global_rank", 0) == 0:
        # WARNING level: DeepSpeed's logger and its handler default to WARNING, and the HF Trainer sets
        # the logger to its own level (WARNING unless --log_level), so an INFO line would never show.
        # Which semantics were chosen (local-momentum votes or global Lion) changes what is trained.
        _compat.ds_logger().warning(state.summary())
    return state


def _agree_wrapper_skips(wrapper, group) -> None:
    """Stage 0 under DeepSpeed's fp16 / bf16 wrapper (FP16_UnfusedOptimizer), which decides two
    skips before it steps LionCub, both made here over LionCub's vote group ``group``:

    * its overflow check (``overflow_checker.check``): DeepSpeed all-reduces it over its own
      data-parallel and model-parallel groups, which are not the vote group under a sequence-
      parallel mpu (Ulysses: the ranks of one replica vote together; an overflow on one of them
      skipped there alone while the others voted);
    * its own rank's gradient norm (:func:`make_agreed_invalid_norm`): a finite bf16 gradient
      above ~1.8e19 overflows the fp32 norm on that rank alone.

    A rank that skips while the others vote pairs its next step's collectives with their step's."""
    step = wrapper.step
    device = next((p.device for g in getattr(wrapper, "fp16_groups", ()) for p in g), torch.device("cpu"))

    def agreed_step(*args, **kwargs):
        token = _AGREE_NORM_OVER.set((group, device))
        try:
            return step(*args, **kwargs)
        finally:
            _AGREE_NORM_OVER.reset(token)

    wrapper.step = agreed_step
    checker = getattr(wrapper, "overflow_checker", None)
    if checker is not None and callable(getattr(checker, "check", None)):
        check = checker.check

        def agreed_check(*args, **kwargs):
            # (the wrapper reads its own decision on the host right here anyway)
            return world_max([bool(check(*args, **kwargs))], device, group)[0] > 0

        checker.check = agreed_check


def make_agreed_invalid_norm(orig):
    """DeepSpeed's ``is_invalid_grad_norm`` as the fp16 / bf16 wrapper calls it: unchanged, except
    inside a LionCub wrapper's step (:func:`_agree_wrapper_skips`), where one rank's verdict is every
    rank's (every rank calls it once per step, right after the agreed overflow check, so the
    collective matches)."""
    def is_invalid_grad_norm(norm):
        invalid = orig(norm)
        over = _AGREE_NORM_OVER.get()
        if over is None:
            return invalid
        group, device = over
        return world_max([bool(invalid)], device, group)[0] > 0
    return is_invalid_grad_norm


def _report_skips_as_overflow(opt):
    """fp32 stage 0: LionCub's agreed skip (non-finite grads on some rank) -> engine.optimizer.overflow."""
    opt.overflow = False

    def pre(o, args, kwargs):
        _STEPS_BEFORE[o] = o.step_count

    def post(o, args, kwargs):
        o.overflow = o.step_count == _STEPS_BEFORE.get(o, o.step_count - 1)

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)


def _clip_before_step(engine, opt) -> None:
    """Clip each rank's local gradient at the start of ``opt.step()`` when the engine will not
    (16-bit parameters stepped by LionCub itself). Holds the engine weakly."""
    ref = weakref.ref(engine)

    def pre(o, args, kwargs):
        eng = ref()
        if eng is not None and float(eng.gradient_clipping() or 0.0) > 0:
            clip_local_gradients(eng)

    opt.register_step_pre_hook(pre)


def clip_local_gradients(engine):
    """``gradient_clipping`` at ZeRO stage 0: scale each rank's local gradient to norm <= clip.

    The norm is this rank's own (model-parallel peers included through the mpu); no
    data-parallel communication. The same rule DeepSpeed's fp16/bf16 wrapper applies to its
    local gradients, so fp32 / bf16 / fp16 clip identically.
    """
    max_norm = float(engine.gradient_clipping())
    params = [p for p in engine.module.parameters() if p.grad is not None]
    if not params:
        return 0.0
    mpu = getattr(engine, "mpu", None)
    sq = []
    for p in params:
        if mpu is not None and not (mpu.get_model_parallel_rank() == 0 or getattr(p, "model_parallel", False)
                                    or getattr(p, "tensor_model_parallel", False)):
            continue
        sq.append(p.grad.detach().float().pow(2).sum())
    total = torch.stack(sq).sum() if sq else torch.zeros((), device=params[0].grad.device)
    if mpu is not None:
        dist.all_reduce(total, group=mpu.get_model_parallel_group())
    # On the device, without a host read (the step's one read is its flags): the coefficient in
    # float64, as a Python float would be, min(1, clip / (norm + 1e-6)); 1 for a non-finite norm
    # (LionCub sees the non-finite gradient and skips the step on every rank). Multiplying by 1
    # changes no bit; a 16-bit gradient is scaled in fp32 and rounded once, as a scalar multiply is.
    norm = total.sqrt()
    engine._global_grad_norm = norm
    coef = (max_norm / (norm.double() + 1e-6)).clamp(max=1.0)
    coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef)).float()
    for p in params:
        g = p.grad.detach()
        if g.dtype == torch.float32:
            g.mul_(coef)
        else:
            g.copy_(g.float().mul_(coef))
    return norm


# ----------------------------------------------------------------------------- patches
def _patch(cls_or_mod, name, make):
    current = getattr(cls_or_mod, name)
    if getattr(current, _MARK, False):
        return
    wrapper = make(current)
    setattr(wrapper, _MARK, True)
    wrapper.__wrapped__ = current
    setattr(cls_or_mod, name, wrapper)


def _remove_own_shm_workspace() -> None:
    """DeepSpeed's CPU accelerator never unlinks its per-rank shm all-reduce workspace
    (lioncub_ds.ds_shm): remove this rank's name when the process ends."""
    if dist.is_available() and dist.is_initialized():
        ds_shm.remove_shm_workspaces([ds_shm.own_shm_workspace(dist.get_rank())])


def register() -> None:
    """Teach DeepSpeed ``"type": "LionCub"`` (idempotent; imports deepspeed)."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        import deepspeed  # noqa: F401
        _compat.check()  # every name patched or read below exists; warns outside the tested range
        from deepspeed.runtime import engine as ds_engine
        from deepspeed.runtime.fp16 import unfused_optimizer
        from deepspeed.runtime.zero import stage_1_and_2
        from deepspeed.runtime.zero import utils as zero_utils
    except BaseException:
        _registered = False
        raise
    groups.on_exit(_remove_own_shm_workspace)
    Engine = ds_engine.DeepSpeedEngine

    def make_supported(orig):
        def _is_supported_optimizer(self, optimizer_name):
            return is_lioncub_name(optimizer_name) or orig(self, optimizer_name)
        return _is_supported_optimizer

    def make_basic(orig):
        def _configure_basic_optimizer(self, model_parameters):
            if self.client_optimizer is None and is_lioncub_name(self.optimizer_name()):
                # the settings' values first (a node_size of the wrong type must be named, not compared)
                split_params(self.optimizer_params())
                check_supported(self)  # reads the ds_config optimizer.params (overlap)
                return build_optimizer(self, model_parameters)
            return orig(self, model_parameters)
        return _configure_basic_optimizer

    def make_configure(orig):
        def _configure_optimizer(self, client_optimizer, model_parameters):
            switched = None  # the user's LionCub moved onto the one-rank group: (the group it had,)
            if isinstance(client_optimizer, LionCub):
                check_supported(self, client_optimizer)  # before its process group is touched
                if self.zero_optimization_stage() >= 1 and dist.is_available() and dist.is_initialized() \
                        and client_optimizer.world_size != 1:
                    switched = (client_optimizer.process_group,)
                    client_optimizer.set_process_group(singleton_group())
                    _SINGLETON_USERS.add(client_optimizer)
            try:
                orig(self, client_optimizer, model_parameters)
            except BaseException:
                # DeepSpeed refused it (e.g. ZeRO-Offload with a client optimizer): the user's optimizer
                # goes back to voting over its own group, not left as a silent single-process Lion
                if switched is not None:
                    _SINGLETON_USERS.discard(client_optimizer)
                    client_optimizer.set_process_group(switched[0])
                raise
            basic = getattr(self, "basic_optimizer", None)
            if isinstance(basic, LionCub):
                wire(self)
            else:
                from .zero3 import ZeRO3Votes, wire_engine
                if isinstance(basic, ZeRO3Votes):
                    wire_engine(self)
        return _configure_optimizer

    def make_no_init_step(orig):
        # DeepSpeed's FP16_UnfusedOptimizer / BF16_Optimizer "initialize optimizer states" by calling
        # step() once with all-zero gradients. For Lion that is not free: it applies one decoupled
        # weight-decay step and counts a step (ranks stay identical, but the model is decayed before
        # training starts). LionCub creates its state lazily, so that call is made a no-op.
        def configure_wrapper(self, optimizer, *args, **kwargs):
            if not isinstance(optimizer, LionCub):
                return orig(self, optimizer, *args, **kwargs)
            own = optimizer.__dict__.get("step")  # e.g. the wrapper a torch LR scheduler puts there
            optimizer.step = _no_step
            try:
                return orig(self, optimizer, *args, **kwargs)
            finally:
                if own is None:
                    del optimizer.step
                else:
                    optimizer.step = own
        return configure_wrapper

    def make_bf16_guard(orig):
        # DeepSpeed's BF16_Optimizer partitions the fp32 masters across the data-parallel ranks (it is
        # ZeRO-1-like). Fine at stage >= 1 (global Lion on a partition); at stage 0 every rank would
        # vote on a different partition. Refuse before the wrapper is built.
        configure = make_no_init_step(orig)

        def _configure_bf16_optimizer(self, optimizer, *args, **kwargs):
            if isinstance(optimizer, LionCub) and self.zero_optimization_stage() == 0:
                why = []
                if getattr(self, "pipeline_parallelism", False):
                    why.append("pipeline parallelism")
                accum = _grad_accum_dtype(self)
                if accum is not None:
                    why.append(f"data_types.grad_accum_dtype={accum}")
                raise LionCubDeepSpeedError(
                    "LionCub at ZeRO stage 0 (zero_optimization.stage=0) with bf16.enabled=true: DeepSpeed routes "
                    "this config" + (f" ({', '.join(why)})" if why else "") + " to BF16_Optimizer, whose fp32 master "
                    "weights are partitioned across the data-parallel ranks, so every rank would vote on a different "
                    "partition. " + _BF16_ADVICE)
            return configure(self, optimizer, *args, **kwargs)
        return _configure_bf16_optimizer

    def make_fp16_configure(orig):
        # DDP_BFLOAT16 (stage 0, bf16 without fp32 gradient accumulation) and FP16 both land here.
        # With voters="node" or master-only sharding (stage 0 and bf16 only: check_node_voters
        # refuses fp16) LionCub steps the bf16 parameters itself and keeps their fp32 master only for
        # its 1/L shard; DeepSpeed's
        # FP16_UnfusedOptimizer would keep a full fp32 copy of every parameter on every rank (and a
        # full fp32 gradient copy per step), which is what node voters exist to avoid.
        configure = make_no_init_step(orig)

        def _configure_fp16_optimizer(self, optimizer, *args, **kwargs):
            # the resolved strategy, not the settings: voters="node" whose node size resolves to 1
            # is flat voting, which needs DeepSpeed's wrapper like any flat LionCub
            if (isinstance(optimizer, LionCub) and self.zero_optimization_stage() == 0 and self.bfloat16_enabled()
                    and optimizer.strategy.shards_state):
                return optimizer
            return configure(self, optimizer, *args, **kwargs)
        return _configure_fp16_optimizer

    from .zero3 import make_initialize
    _patch(deepspeed, "initialize", make_initialize)
    _patch(Engine, "_configure_fp16_optimizer", make_fp16_configure)
    _patch(Engine, "_configure_bf16_optimizer", make_bf16_guard)
    _patch(Engine, "_is_supported_optimizer", make_supported)
    _patch(Engine, "_configure_basic_optimizer", make_basic)
    _patch(Engine, "_configure_optimizer", make_configure)
    from .zero3 import ZeRO3Votes
    for cls in (LionCub, ZeRO3Votes):
        if cls not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
            zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(cls)
    from .zero import make_allgather_dispatch
    _patch(stage_1_and_2, "all_gather_dp_groups", make_allgather_dispatch)
    if hasattr(unfused_optimizer, "is_invalid_grad_norm"):  # (older 0.19 wrappers have no own-norm skip)
        _patch(unfused_optimizer, "is_invalid_grad_norm", make_agreed_invalid_norm)


def _grad_accum_dtype(engine):
    try:
        cfg = engine._config  # noqa: SLF001 - only used to name the setting in an error message
        value = getattr(cfg, "grad_accum_dtype", None)
        return None if value is None else str(value)
    except Exception:  # noqa: BLE001
        return None


def _no_step(closure=None):
    return None


def is_registered() -> bool:
    return _registered


def lioncub_of(engine) -> LionCub | None:
    """The LionCub inside a DeepSpeed engine (or None; at ZeRO-3 with votes there is one per
    sub-group: ``engine.basic_optimizer.inner``, and :func:`lioncub_ds.deepspeed.comm_stats` /
    ``state_bytes`` sum them)."""
    opt = getattr(engine, "basic_optimizer", None)
    return opt if isinstance(opt, LionCub) else None
