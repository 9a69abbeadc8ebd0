"""megatron-core import guard and the few version differences this integration touches.

Supported: megatron-core 0.16.x (Python 3.10/3.11: the newest pip gives on 3.11) through
0.19.x (Python >= 3.12). Every difference is handled here, explicitly:

* ``_get_param_groups(model_chunks, config, config_overrides)``: same signature in
  0.16-0.19, but 0.16 applies the standard overrides (no weight decay on biases and
  1-D parameters, decoupled lr) itself when ``config_overrides is None`` while 0.18+
  leaves that to ``get_megatron_optimizer``. We always pass explicit overrides
  (:func:`standard_overrides`), which means the same thing on every version.
* ``ProcessGroupCollection.setup_process_groups_for_optimizer``: 0.19 adds
  ``expt_tp_pp_with_egtp_remat_group`` (the expert model-parallel group Megatron then
  uses for gradient statistics); older versions have ``expt_tp_pp_group`` only.
* ``OptimizerConfig.lion_beta1/2`` exist from 0.17 (megatron-core's own Lion, through emerging-optimizers);
  Megatron-LM's training loop builds a config for ``--optimizer lion`` from 0.18 (0.17 raises
  "Invalid optimizer type!" in ``get_megatron_optimizer_config``).
* The bucket groups' ``finish_grad_sync`` sets ``grad_reduce_finished`` from 0.19.
* ``DistributedOptimizer._get_model_param_range_map(param)["param"]``: the range of a model
  parameter's elements this rank's shard holds (the same in 0.16-0.19 and main): the one private
  method read here, for the node-voter shard map (:func:`shard_range`).
"""
from __future__ import annotations

import importlib

MIN_VERSION = (0, 16)
TESTED_VERSIONS = ("0.16.1",)
CHECKED_AGAINST_SOURCE = ("0.17.1", "0.18.2", "0.19.0")

# ---------------------------------------------------------------------------------------------
# Megatron-LM's training package (megatron.training: not on the package index). What
# lioncub_ds.megatron.training.install() replaces, and the call site each replacement serves,
# read in NVIDIA/Megatron-LM at tags core_v0.16.1, core_v0.17.1, core_v0.18.2, core_v0.19.0 and
# main (core 0.20.0, commit d98e8a64, 2026-08-22). Versions are Megatron-LM tags (= megatron-core).
# (module, name, versions, call site)
MEGATRON_LM_PATCHES = (
    ("megatron.training.arguments", "add_megatron_arguments", "0.16 - main",
     "parse_args(): parser = add_megatron_arguments(parser) (module-global lookup); pretrain() takes "
     "extra_args_provider only up to 0.17, so this is the hook for --lioncub-* on every version"),
    ("megatron.training.initialize", "validate_args", "0.16 - 0.17",
     "initialize_megatron(): validate_args(args, args_defaults) (imported from .arguments)"),
    ("megatron.training.arguments", "validate_args", "0.18 - main",
     "parse_and_validate_args(): validate_args(args, args_defaults), called by pretrain_gpt.py's __main__ "
     "(not with --yaml-cfg: then the check runs in get_megatron_optimizer, after the model is built)"),
    ("megatron.training.training", "get_megatron_optimizer", "0.16 - main",
     "setup_model_and_optimizer(): get_megatron_optimizer(config, model, config_overrides=..., "
     "use_gloo_process_groups=..., dump_param_to_param_group_map=...) (imported from megatron.core.optimizer; "
     "not reached for --optimizer muon/dist_muon in 0.16, which INCOMPATIBLE_FLAGS refuses)"),
    ("megatron.training.training", "save_checkpoint", "0.16 - main",
     "save_checkpoint_and_time() and the end of pretrain()/train(): save_checkpoint(iteration, model, optimizer, "
     "opt_param_scheduler, num_floating_point_operations_so_far, checkpointing_context, non_persistent_ckpt=..., "
     "...) (imported from megatron.training.checkpointing; 0.18+ in a parenthesised import)"),
    ("megatron.training.training", "load_checkpoint", "0.16 - main",
     "setup_model_and_optimizer(): load_checkpoint(model, optimizer, opt_param_scheduler, "
     "checkpointing_context=..., ...) -> (iteration, num_floating_point_operations_so_far)"),
)
# Used, not patched: megatron.training.checkpointing.get_checkpoint_name(path, iteration, release=False, ...,
# return_base_dir=True) -> <path>/iter_XXXXXXX (0.16 - main), get_checkpoint_tracker_filename(path) ->
# <path>/latest_checkpointed_iteration.txt, _NON_PERSISTENT_CKPT_SUBDIR = 'non_persistent';
# megatron.training.get_args (every version). Wrapped for the length of one non-persistent save only
# (training._keeping_last_finished; skipped where it is absent):
# megatron.training.checkpointing.cleanup_old_non_persistent_checkpoint(save_dir, leave_ckpt_num=1, do_async=False),
# which save_checkpoint calls through its module's globals.

# Keyword arguments Megatron-LM passes to get_megatron_optimizer that our factory takes.
FACTORY_KWARGS = ("config_overrides", "use_gloo_process_groups", "pg_collection", "dump_param_to_param_group_map")


class MegatronNotAvailableError(ImportError):
    """megatron-core is missing or too old for lioncub_ds.megatron."""


def megatron_version() -> tuple | None:
    try:
        info = importlib.import_module("megatron.core.package_info")
    except ImportError:
        return None
    return (int(info.MAJOR), int(info.MINOR), int(info.PATCH))


def require_megatron(what: str = "lioncub_ds.megatron"):
    """Import megatron.core or raise a clear ImportError (called by every Megatron function)."""
    try:
        core = importlib.import_module("megatron.core")
    except ImportError as exc:
        raise MegatronNotAvailableError(
            f"{what} needs megatron-core >= {MIN_VERSION[0]}.{MIN_VERSION[1]} "
            "(pip install megatron-core; Python 3.11 gets 0.16.x, 0.17+ needs Python >= 3.12). "
            f"Import failed: {exc}") from exc
    ver = megatron_version()
    if ver is not None and ver[:2] < MIN_VERSION:
        raise MegatronNotAvailableError(
            f"{what} needs megatron-core >= {MIN_VERSION[0]}.{MIN_VERSION[1]}; found "
            f"{'.'.join(map(str, ver))} (its _get_param_groups / process-group helpers differ)")
    return core


def standard_overrides(config):
    """Megatron's standard per-parameter overrides (wd_mult=0 on biases and 1-D params, decoupled lr)."""
    from megatron.core.optimizer import get_standard_config_overrides
    return get_standard_config_overrides(config)


def check_overrides(config, config_overrides) -> None:
    from megatron.core import optimizer as mopt
    fn = getattr(mopt, "check_config_overrides_consistency", None)
    if fn is not None:
        fn(config, config_overrides)


def optimizer_process_groups(pg_collection, model_chunks) -> dict:
    """The groups Megatron's own optimizer factory uses, with our names.

    Returns dict with ``dp_cp`` (dense vote group), ``expt_dp`` (expert vote group),
    ``mp`` (dense grad-stats group), ``expt_mp`` (expert grad-stats group), ``tp``,
    ``expt_tp`` (TP groups for the wrappers' duplicate filtering) and ``ep``.
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    d = ProcessGroupCollection.setup_process_groups_for_optimizer(pg_collection, model_chunks, False)
    expt_mp = d.get("expt_tp_pp_with_egtp_remat_group") or d.get("expt_tp_pp_group")
    if pg_collection is not None and hasattr(pg_collection, "tp"):
        tp = pg_collection.tp
    else:
        tp = parallel_state.get_tensor_model_parallel_group()
    expt_tp = getattr(pg_collection, "expt_tp", None) if pg_collection is not None else None
    if expt_tp is None:
        try:
            expt_tp = parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
        except TypeError:  # older signature without check_initialized
            expt_tp = parallel_state.get_expert_tensor_parallel_group()
        expt_tp = expt_tp or tp
    ep = getattr(pg_collection, "ep", None) if pg_collection is not None else None
    if ep is None:
        try:
            ep = parallel_state.get_expert_model_parallel_group(check_initialized=False)
        except TypeError:
            ep = parallel_state.get_expert_model_parallel_group()
    return {"dp_cp": d["dp_cp_group"], "expt_dp": d["expt_dp_group"], "mp": d["mp_group"],
            "expt_mp": expt_mp, "tp": tp, "expt_tp": expt_tp, "ep": ep}


def shard_range(dopt, model_param):
    """The elements of ``model_param`` (flattened) that this rank's shard in Megatron's
    DistributedOptimizer ``dopt`` holds: an object with ``start`` / ``end``."""
    return dopt._get_model_param_range_map(model_param)["param"]
