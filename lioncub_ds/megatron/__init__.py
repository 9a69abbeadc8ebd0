"""Lion Cub for Megatron-core and Megatron-LM (megatron-core 0.16 - 0.20; see docs/megatron.md).

Megatron-LM's own scripts (``pretrain_gpt.py`` & co.), same arguments plus ``--lioncub-*``::

    torchrun --nproc_per_node 8 -m lioncub_ds.megatron.run pretrain_gpt.py <Megatron-LM args> --lioncub-comm 1bit

(or ``lioncub_ds.megatron.training.install()`` before Megatron-LM's ``pretrain()``). megatron-core directly:

    from lioncub_ds.megatron import get_megatron_lioncub_optimizer
    optimizer = get_megatron_lioncub_optimizer(optimizer_config, model_chunks,
                                               lioncub={"comm": "1bit", "momentum_sync": {"every": 100}})

* :func:`get_megatron_lioncub_optimizer` (alias ``get_megatron_optimizer``): same arguments
  as ``megatron.core.optimizer.get_megatron_optimizer`` plus LionCub settings; Megatron's
  parameter groups, wrappers, scheduler, grad clipping and checkpoint plumbing keep working.
  It also switches DDP's data-parallel gradient reduction off on the model chunks.
* :func:`disable_dp_grad_reduction` / :func:`enable_dp_grad_reduction`: the switch itself.
* ``lioncub={"voters": "node"}`` with Megatron's distributed optimizer (K instances): the
  instances vote (:func:`vote_across_instances` switches off the all-reduce across them).
* :func:`before_checkpoint_save` / :func:`after_checkpoint_save` / :func:`after_checkpoint_load`:
  per-rank momenta across Megatron checkpoints (``per_rank`` files, or ``sync`` before saving).
* :func:`add_lioncub_args` / :func:`lioncub_settings_from_args`: ``--lioncub-*`` flags.

Importing this package never imports megatron; the functions that need it raise
:class:`MegatronNotAvailableError` (an ImportError) with install instructions.
"""
from ._compat import MegatronNotAvailableError, megatron_version, require_megatron
from .args import add_lioncub_args, lioncub_settings_from_args
from .checkpoint import (CHECKPOINT_MODES, after_checkpoint_load, after_checkpoint_save, before_checkpoint_save,
                         load_lioncub_states, save_lioncub_states, sync_momenta)
from .ddp import (LocalMomentumConfigError, check_local_momentum_ddp, disable_dp_grad_reduction,
                  dp_grad_reduction_disabled, enable_dp_grad_reduction, instance_votes_enabled,
                  restore_instance_all_reduce, vote_across_instances)
from .optimizer import (MegatronLionCub, dp_ranks_per_node, get_megatron_lioncub_optimizer, get_megatron_optimizer,
                        lioncub_optimizers, lioncub_settings, ranks_per_node)

__all__ = [
    "CHECKPOINT_MODES", "LocalMomentumConfigError", "MegatronLionCub", "MegatronNotAvailableError",
    "add_lioncub_args", "lioncub_settings", "ranks_per_node",
    "after_checkpoint_load", "after_checkpoint_save", "before_checkpoint_save",
    "check_local_momentum_ddp", "disable_dp_grad_reduction", "dp_grad_reduction_disabled", "dp_ranks_per_node",
    "enable_dp_grad_reduction", "get_megatron_lioncub_optimizer", "get_megatron_optimizer",
    "instance_votes_enabled", "restore_instance_all_reduce", "vote_across_instances",
    "lioncub_optimizers", "lioncub_settings_from_args", "load_lioncub_states",
    "megatron_version", "require_megatron", "save_lioncub_states", "sync_momenta",
]
