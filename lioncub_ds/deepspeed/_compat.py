"""Every DeepSpeed name lioncub_ds.deepspeed patches or reads, in one place, checked at registration.

Tested: DeepSpeed 0.19.8 (CPU, gloo; the version pinned in requirements.txt). Supported range:
``MIN_VERSION <= version < MAX_VERSION``. Outside it, :func:`check` warns once, naming the
version and the tested range, and registration goes on if every name below exists; a
missing name is an error (:class:`DeepSpeedCompatError`) that names it, because the
integration cannot work without it.

What is patched (class or module attributes, wrapped, originals kept as ``__wrapped__``):

* ``deepspeed.runtime.engine.DeepSpeedEngine``: ``_is_supported_optimizer``,
  ``_configure_basic_optimizer``, ``_configure_optimizer``, ``_configure_fp16_optimizer``,
  ``_configure_bf16_optimizer``;
* ``deepspeed.runtime.zero.stage_1_and_2.all_gather_dp_groups`` (the name the ZeRO 1/2
  optimizer's ``step`` calls);
* ``deepspeed.runtime.fp16.unfused_optimizer.is_invalid_grad_norm`` where it exists (the fp16 /
  bf16 wrapper's own-norm skip at stage 0, which 0.19.8 has and 0.19.0–0.19.5 do not: agreed
  over LionCub's vote group while the wrapper steps LionCub);
* ``deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS`` gains LionCub.

Per engine (instance attributes): ``clip_fp32_gradients`` (stage 0: local clipping), the
fp16 / bf16 wrapper's ``step`` and its ``overflow_checker.check`` (stage 0: both skip decisions
agreed over the vote group),
``save_checkpoint`` / ``load_checkpoint`` (per-rank momentum files),
``enable_backward_allreduce`` (stage 0: off) and ``pipeline_enable_backward_allreduce``.

DeepSpeed's CPU shm all-reduce workspace files (which it never unlinks) are named in
:mod:`lioncub_ds.ds_shm`, a standard-library module that launchers can import without DeepSpeed.

What is read (engine methods and attributes; ZeRO 1/2 optimizer attributes for the sign
all-gather): see ``ENGINE_METHODS``, ``ENGINE_ATTRS`` and ``ZERO_ATTRS`` below. A ZeRO
attribute that is missing turns the sign all-gather off with the reason in the log line
(``zero_allgather: "auto"``) or raises (``"sign"``); it never mis-trains.
"""
from __future__ import annotations

import importlib
import re
import warnings

MIN_VERSION = (0, 19, 0)
MAX_VERSION = (0, 20, 0)   # exclusive
TESTED_VERSIONS = ("0.19.8",)

ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
# Methods patched on the engine class.
ENGINE_PATCHED = ("_is_supported_optimizer", "_configure_basic_optimizer", "_configure_optimizer",
                  "_configure_fp16_optimizer", "_configure_bf16_optimizer")
# Methods called on an engine.
ENGINE_METHODS = ("optimizer_name", "optimizer_params", "zero_optimization", "zero_optimization_stage",
                  "zero_offload_optimizer", "torch_autocast_enabled", "torch_autocast_dtype", "gradient_clipping",
                  "bfloat16_enabled", "fp16_enabled", "clip_fp32_gradients", "save_checkpoint", "load_checkpoint",
                  "is_gradient_accumulation_boundary")
# Attributes read on an engine instance (checked when it is wired).
ENGINE_ATTRS = ("basic_optimizer", "optimizer", "client_optimizer", "module", "global_rank", "global_steps",
                "enable_backward_allreduce")
# Optional engine attributes (absent is fine): mpu, data_parallel_group, seq_data_parallel_group,
# param_names, pipeline_parallelism, has_moe_layers, pipeline_enable_backward_allreduce,
# inside_no_sync_ctxt (overlap: a backward inside engine.no_sync() starts no votes).

# Module-level names.
MODULE_NAMES = (
    ("deepspeed.runtime.zero.utils", "ZERO_SUPPORTED_OPTIMIZERS"),
    ("deepspeed.runtime.zero.stage_1_and_2", "all_gather_dp_groups"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"),
    ("deepspeed.utils", "logger"),
    ("deepspeed", "initialize"),           # wrapped: ZeRO-3 with votes sets the node-group mpu (zero3.py)
    ("deepspeed.utils.groups", "mpu"),     # restored after such an engine is built (a module global)
)
# ZeRO-3 with votes (lioncub_ds/deepspeed/zero3.py) reads DeepSpeedZeroOptimizer_Stage3's
# fp32_partitioned_groups_flat, fp16_groups, sub_group_to_group_id, dp_process_group and the
# parameters' partition_numel() / ds_numel; per instance it wraps _get_norm_groups and
# has_overflow (the skip decision, agreed across groups; where the optimizer's module has
# combine_grad_norm_groups, as 0.19.8's does, the combined norm ZeRO-3 skips on joins it) and, on the engine,
# _get_rank_zero_ckpt_name and _get_ckpt_name (per-group checkpoint file names). A missing one is
# an error at wiring that names it (zero3.ZERO3_ATTRS).
# Attributes of DeepSpeedZeroOptimizer that the ZeRO sign all-gather reads (the flat buffers,
# their partitions, the fp32 master partitions, the data-parallel groups, the parameter
# offsets inside each flat buffer, the offload / autocast switches).
ZERO_ATTRS = ("parallel_partitioned_bit16_groups", "bit16_groups_flat", "single_partition_of_fp32_groups",
              "real_dp_process_group", "round_robin_bit16_offsets", "round_robin_bit16_meta")
ZERO_OPTIONAL_ATTRS = ("cpu_offload", "torch_autocast_gradscaler")


class DeepSpeedCompatError(ImportError):
    """The installed DeepSpeed lacks a name this integration patches or reads."""


def deepspeed_version() -> tuple | None:
    try:
        import deepspeed
    except ImportError:
        return None
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", str(getattr(deepspeed, "__version__", "")))
    return tuple(int(x) for x in m.groups()) if m else None


def _fmt(v) -> str:
    return ".".join(map(str, v)) if v else "unknown"


def _resolve(dotted: str):
    mod, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(mod), name)


def missing_names() -> list[str]:
    """Names this integration needs that the installed DeepSpeed lacks ([] when all exist)."""
    out = []
    try:
        engine = _resolve(ENGINE)
    except (ImportError, AttributeError) as exc:
        return [f"{ENGINE} ({type(exc).__name__}: {exc})"]
    for name in ENGINE_PATCHED + ENGINE_METHODS:
        if not callable(getattr(engine, name, None)):
            out.append(f"{ENGINE}.{name}")
    for mod, name in MODULE_NAMES:
        try:
            m = importlib.import_module(mod)
        except ImportError:
            out.append(f"{mod} (module)")
            continue
        if not hasattr(m, name):
            out.append(f"{mod}.{name}")
    return out


_warned = False


def check() -> tuple | None:
    """Run at registration: error if a needed name is missing, one warning outside the tested range."""
    global _warned
    ver = deepspeed_version()
    missing = missing_names()
    if missing:
        raise DeepSpeedCompatError(
            f"lioncub_ds.deepspeed cannot register LionCub with DeepSpeed {_fmt(ver)}: it lacks "
            f"{', '.join(missing)}. Supported: DeepSpeed >= {_fmt(MIN_VERSION)}, < {_fmt(MAX_VERSION)} "
            f"(tested: {', '.join(TESTED_VERSIONS)}); install one of those (pip install deepspeed=={TESTED_VERSIONS[-1]}).")
    if not _warned and (ver is None or not MIN_VERSION <= ver < MAX_VERSION):
        _warned = True
        warnings.warn(
            f"lioncub_ds.deepspeed: DeepSpeed {_fmt(ver)} is outside the supported range >= {_fmt(MIN_VERSION)}, "
            f"< {_fmt(MAX_VERSION)} (tested: {', '.join(TESTED_VERSIONS)}). Every name the integration patches "
            "exists, so LionCub is registered; run a short job and compare replicas before relying on it.",
            RuntimeWarning, stacklevel=3)
    return ver


def ds_logger():
    """DeepSpeed's own logger (what the user already sees)."""
    from deepspeed.utils import logger
    return logger


def engine_missing(engine) -> list[str]:
    """Engine instance attributes the wiring reads that this engine lacks."""
    return [name for name in ENGINE_ATTRS if not hasattr(engine, name)]


def zero_missing(zopt) -> list[str]:
    """ZeRO 1/2 optimizer attributes the sign all-gather reads that ``zopt`` lacks."""
    return [name for name in ZERO_ATTRS if not hasattr(zopt, name)]


def zero_optimizer_class():
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    return DeepSpeedZeroOptimizer

