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

Wiring, ZeRO stage 0 (Lion Cub semantics, SPEC §2): ``engine.enable_backward_allreduce =
False`` (gradients are never all-reduced, also not at the accumulation boundary or in the
unmanaged-accumulation path: both test that flag), LionCub votes over the engine's
data-parallel group (the mpu's when one is given), gradient clipping clips each rank's
LOCAL gradient by its LOCAL norm, fp32 steps that LionCub skips (non-finite gradients on
any rank) are reported to the engine like an fp16 overflow. fp16/bf16 wrappers agree on
overflow over the data-parallel group (DeepSpeed's ``CheckOverflow`` all-reduces its flag
when ``enable_backward_allreduce`` is False), so every rank skips and backs off its loss
scale identically.

Wiring, ZeRO stage 1/2 (global-Lion semantics): DeepSpeed reduces the gradients and
partitions the momentum; LionCub runs as a plain single-process Lion on its fp32
partition (it gets a process group of size 1, so it never votes).
"""
from __future__ import annotations

import logging
import types
import weakref

import torch
import torch.distributed as dist

from ..config import LionCubConfig, LionCubConfigError, unknown_key_error
from ..optimizer import LionCub

log = logging.getLogger("lioncub_ds")

OPTIMIZER_NAME = "LionCub"
# ds_config optimizer.params keys that configure the integration, not the optimizer.
INTEGRATION_KEYS = ("zero_allgather", "zero_fp32_replica")
ZERO_ALLGATHER_MODES = ("auto", "sign", "params")
_MARK = "_lioncub_ds_patch"

# Integration options of optimizers built from a ds_config (optimizer -> dict).
_OPTIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_SINGLETON_GROUP = {}
_BUILT_GROUP: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> group given at build
_registered = False


class LionCubDeepSpeedError(RuntimeError):
    """A DeepSpeed setting that LionCub does not support (named in the message)."""


def is_lioncub_name(name) -> bool:
    return isinstance(name, str) and name.replace("_", "").lower() == "lioncub"


# ----------------------------------------------------------------------------- options
def split_params(params: dict | None, where: str = "ds_config optimizer.params"):
    """Split ds_config params into (LionCub kwargs, integration options); validate both."""
    params = dict(params or {})
    if "max_grad_norm" in params:
        raise LionCubConfigError("LionCub: 'max_grad_norm' is not an optimizer parameter; use the ds_config "
                                 "top-level \"gradient_clipping\" (it clips each rank's local gradient at ZeRO "
                                 "stage 0, the reduced gradient at stage 1/2)")
    allowed = LionCubConfig.keys() + INTEGRATION_KEYS
    for key in params:
        if key not in allowed:
            raise unknown_key_error(key, allowed, where)
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


def options_of(optimizer) -> dict:
    return dict(_OPTIONS.get(optimizer, {"zero_allgather": "auto", "zero_fp32_replica": False}))


def set_options(optimizer, **options) -> None:
    """Integration options for a LionCub built by the user (client optimizer)."""
    for key in options:
        if key not in INTEGRATION_KEYS:
            raise unknown_key_error(key, INTEGRATION_KEYS, "LionCub DeepSpeed option")
    _, checked = split_params(options)
    _OPTIONS[optimizer] = checked


# ----------------------------------------------------------------------------- groups
def data_parallel_group(engine):
    """The group LionCub votes over: the mpu's data-parallel group, else the engine's."""
    mpu = getattr(engine, "mpu", None)
    if mpu is not None and hasattr(mpu, "get_data_parallel_group"):
        return mpu.get_data_parallel_group()
    group = getattr(engine, "seq_data_parallel_group", None)
    if group is None:
        group = getattr(engine, "data_parallel_group", None)
    return group


def singleton_group():
    """A process group holding only this rank (LionCub then never votes). Cached."""
    rank = dist.get_rank()
    if rank not in _SINGLETON_GROUP:
        _SINGLETON_GROUP[rank] = dist.new_group([rank], use_local_synchronization=True)
    return _SINGLETON_GROUP[rank]


# ----------------------------------------------------------------------------- checks
def check_supported(engine) -> None:
    """Refuse settings LionCub cannot honour, naming the setting (never mis-train silently)."""
    stage = engine.zero_optimization_stage()
    if stage >= 3:
        raise LionCubDeepSpeedError(
            f"LionCub does not support ZeRO stage 3 (zero_optimization.stage={stage}): parameters are partitioned "
            "and no rank holds the replica a vote or a sign all-gather updates. Use stage 0 (Lion Cub: local "
            "momentum, 1-bit votes, no gradient all-reduce) or stage 1/2 (global Lion on reduced gradients).")
    off = engine.zero_offload_optimizer() if engine.zero_optimization() else None
    device = getattr(off, "device", None)
    device = getattr(device, "value", device)
    if off is not None and device not in (None, "none"):
        raise LionCubDeepSpeedError(
            f"LionCub does not support optimizer offload (zero_optimization.offload_optimizer.device={device!r}): "
            "DeepSpeed's offload path expects its CPU Adam/Lion kernels. Remove offload_optimizer or set its "
            "device to \"none\".")
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


# ----------------------------------------------------------------------------- build
def build_optimizer(engine, model_parameters):
    """LionCub from the ds_config (``optimizer.type == "LionCub"``)."""
    params, options = split_params(engine.optimizer_params())
    stage = engine.zero_optimization_stage()
    group = None
    if dist.is_available() and dist.is_initialized():
        group = singleton_group() if stage >= 1 else data_parallel_group(engine)
    if stage == 0:
        model_parameters = _with_names(model_parameters, getattr(engine, "param_names", {}))
    opt = LionCub(model_parameters, process_group=group, **params)
    _OPTIONS[opt] = options
    if group is not None:
        _BUILT_GROUP[opt] = group
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

    def __init__(self, engine, optimizer, stage, mode, zero_adapter=None):
        self._engine = weakref.ref(engine)
        self.optimizer = optimizer
        self.stage = stage
        self.mode = mode  # "local_momentum" (stage 0) or "zero" (stage 1/2)
        self.zero_adapter = zero_adapter

    def __repr__(self):
        return (f"EngineState(stage={self.stage}, mode={self.mode!r}, "
                f"zero_allgather={'sign' if self.zero_adapter else 'params' if self.mode == 'zero' else None})")


def wire(engine) -> EngineState:
    opt = engine.basic_optimizer
    stage = engine.zero_optimization_stage()
    check_supported(engine)
    options = options_of(opt)
    if stage == 0:
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
        if engine.optimizer is opt:
            _report_skips_as_overflow(opt)
        state = EngineState(engine, opt, stage, "local_momentum")
    else:
        if dist.is_available() and dist.is_initialized() and opt.world_size != 1:
            try:
                opt.set_process_group(singleton_group())
            except RuntimeError as exc:
                raise LionCubDeepSpeedError(f"LionCub under ZeRO stage {stage} must run as a single-process Lion "
                                            f"on its partition: {exc}") from exc
        from .zero import maybe_enable_sign_allgather
        adapter = maybe_enable_sign_allgather(engine, opt, options)
        state = EngineState(engine, opt, stage, "zero", adapter)
    from .checkpoint import install_engine_hooks
    install_engine_hooks(engine)
    engine.lioncub = state
    if getattr(engine, "global_rank", 0) == 0:
        log.info("lioncub_ds: DeepSpeed engine wired: %r", state)
    return state


def _report_skips_as_overflow(opt):
    """fp32 stage 0: LionCub's agreed skip (non-finite grads on some rank) -> engine.optimizer.overflow."""
    opt.overflow = False

    def pre(o, args, kwargs):
        o._lioncub_ds_steps_before = o.step_count

    def post(o, args, kwargs):
        o.overflow = o.step_count == getattr(o, "_lioncub_ds_steps_before", o.step_count - 1)

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)


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
    norm = float(total.sqrt())
    engine._global_grad_norm = norm
    if norm != norm or norm in (float("inf"), float("-inf")):
        return norm  # LionCub sees the non-finite gradient and skips the step on every rank
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad.detach().mul_(coef)
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


def register() -> None:
    """Teach DeepSpeed ``"type": "LionCub"`` (idempotent; imports deepspeed)."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        import deepspeed  # noqa: F401
        from deepspeed.runtime import engine as ds_engine
        from deepspeed.runtime.zero import stage_1_and_2
        from deepspeed.runtime.zero import utils as zero_utils
    except BaseException:
        _registered = False
        raise
    Engine = ds_engine.DeepSpeedEngine

    def make_supported(orig):
        def _is_supported_optimizer(self, optimizer_name):
            return is_lioncub_name(optimizer_name) or orig(self, optimizer_name)
        return _is_supported_optimizer

    def make_basic(orig):
        def _configure_basic_optimizer(self, model_parameters):
            if self.client_optimizer is None and is_lioncub_name(self.optimizer_name()):
                check_supported(self)
                return build_optimizer(self, model_parameters)
            return orig(self, model_parameters)
        return _configure_basic_optimizer

    def make_configure(orig):
        def _configure_optimizer(self, client_optimizer, model_parameters):
            if isinstance(client_optimizer, LionCub):
                check_supported(self)
                if self.zero_optimization_stage() >= 1 and dist.is_available() and dist.is_initialized() \
                        and client_optimizer.world_size != 1:
                    client_optimizer.set_process_group(singleton_group())
            orig(self, client_optimizer, model_parameters)
            if isinstance(getattr(self, "basic_optimizer", None), LionCub):
                wire(self)
        return _configure_optimizer

    def make_no_init_step(orig):
        # DeepSpeed's FP16_UnfusedOptimizer / BF16_Optimizer "initialize optimizer states" by calling
        # step() once with all-zero gradients. For Lion that is not free: it applies one decoupled
        # weight-decay step and counts a step (ranks stay identical, but the model is decayed before
        # training starts). LionCub creates its state lazily, so that call is made a no-op.
        def configure_wrapper(self, optimizer, *args, **kwargs):
            if not isinstance(optimizer, LionCub):
                return orig(self, optimizer, *args, **kwargs)
            optimizer.step = _no_step
            try:
                return orig(self, optimizer, *args, **kwargs)
            finally:
                del optimizer.step
        return configure_wrapper

    _patch(Engine, "_configure_fp16_optimizer", make_no_init_step)
    _patch(Engine, "_configure_bf16_optimizer", make_no_init_step)
    _patch(Engine, "_is_supported_optimizer", make_supported)
    _patch(Engine, "_configure_basic_optimizer", make_basic)
    _patch(Engine, "_configure_optimizer", make_configure)
    if LionCub not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:
        zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(LionCub)
    from .zero import make_allgather_dispatch
    _patch(stage_1_and_2, "all_gather_dp_groups", make_allgather_dispatch)


def _no_step(closure=None):
    return None


def is_registered() -> bool:
    return _registered


def lioncub_of(engine) -> LionCub | None:
    """The LionCub inside a DeepSpeed engine (or None)."""
    opt = getattr(engine, "basic_optimizer", None)
    return opt if isinstance(opt, LionCub) else None
