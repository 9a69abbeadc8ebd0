"""Per-rank Lion Cub momenta across Megatron checkpoints.

Megatron's checkpoints keep ONE replica of the optimizer state per data-parallel group:
``sharded_state_dict`` tags every optimizer tensor with the model parameter's replica id,
and only the data-parallel rank 0 replica is written (the legacy format is likewise written
by DP rank 0 only). Lion Cub's momenta differ across data-parallel ranks, so on resume
every rank would get DP rank 0's momentum. Two ways to keep resume exact:

* ``mode="per_rank"`` (default, recommended): :func:`save_lioncub_states` writes every
  rank's LionCub state to its own file next to Megatron's checkpoint, with
  :mod:`lioncub_ds.checkpoint` (atomic, versioned, ``weights_only``)::

      <checkpoint_dir>/lioncub/<dense|expert>/<model-parallel tag>/lioncub-rank{r}-of-{N}.pt

  where ``r`` / ``N`` are the rank / size of the vote (data-parallel) group and the tag is
  the rank's model-parallel position (``mp00003``; expert: ``emp00001-ep00002``).
  :func:`load_lioncub_states`, called *after* Megatron has loaded its checkpoint, puts the
  exact per-rank momenta back; a changed data-parallel size starts every rank from the mean
  momentum (``reshard="average"``) or refuses (``"error"``). The training trajectory is
  untouched: a resumed run matches an uninterrupted one bit for bit.
* ``mode="sync"``: :func:`sync_momenta` averages every momentum over its data-parallel
  group right before Megatron saves (an extra momentum sync at the save step, in the live
  run too), so the single replica Megatron stores is every rank's momentum; resume is exact
  with no extra files, but saving perturbs the run (like a momentum sync would). The state is
  then plain Megatron state, so it also reshards when TP/PP change (per-rank files are keyed by
  the model-parallel position and follow a data-parallel resize only).

Around Megatron's own save / load, every rank calls :func:`before_checkpoint_save`,
:func:`after_checkpoint_save` and :func:`after_checkpoint_load`, which dispatch on the mode.
"""
from __future__ import annotations

import contextlib
import os

import torch.distributed as dist

from .. import checkpoint as lc_checkpoint
from ..comm import Collectives
from ..momentum_sync import MomentumSync
from .optimizer import lioncub_optimizers

CHECKPOINT_MODES = ("per_rank", "sync")
SUBDIR = "lioncub"


def _check_mode(mode):
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"lioncub checkpoint mode={mode!r} is not allowed; allowed: {', '.join(CHECKPOINT_MODES)}")


def rank_directory(checkpoint_dir: str, opt) -> str:
    kind = getattr(opt, "megatron_kind", "dense")
    tag = getattr(opt, "megatron_tag", None) or f"mp{dist.get_rank() if dist.is_initialized() else 0:05d}"
    return os.path.join(checkpoint_dir, SUBDIR, kind, tag)


def save_lioncub_states(optimizer, checkpoint_dir: str) -> list[str]:
    """Write this rank's state of every LionCub inside ``optimizer``; returns the file paths."""
    paths = []
    for opt in lioncub_optimizers(optimizer):
        with (opt.full_state() if hasattr(opt, "full_state") else contextlib.nullcontext()):
            paths.append(lc_checkpoint.save(opt, rank_directory(checkpoint_dir, opt)))
    return paths


def load_lioncub_states(optimizer, checkpoint_dir: str, reshard: str = "average") -> list[str]:
    """Restore the per-rank states written by :func:`save_lioncub_states` (after Megatron's own load)."""
    return [lc_checkpoint.load(opt, rank_directory(checkpoint_dir, opt), reshard=reshard)
            for opt in lioncub_optimizers(optimizer)]


def has_lioncub_states(checkpoint_dir: str) -> bool:
    return os.path.isdir(os.path.join(checkpoint_dir, SUBDIR))


def sync_momenta(optimizer) -> None:
    """Average every LionCub momentum over its data-parallel group, now (all ranks must call)."""
    for opt in lioncub_optimizers(optimizer):
        if not opt.distributed:
            continue
        group = opt._dist[0] if opt._dist is not None else opt._resolve_group()[0]
        coll = Collectives(group, opt.stats)
        momenta = [opt._momentum(p) for g in opt.param_groups for p in g["params"] if p.requires_grad]
        MomentumSync(opt.config.momentum_sync, coll).average(momenta, coll, opt.config.bucket_numel)


def before_checkpoint_save(optimizer, mode: str = "per_rank") -> None:
    """Every rank, right before Megatron saves: ``sync`` averages the momenta; ``per_rank``: nothing."""
    _check_mode(mode)
    if mode == "sync":
        sync_momenta(optimizer)


def after_checkpoint_save(optimizer, checkpoint_dir: str, mode: str = "per_rank") -> list[str]:
    """Every rank, right after Megatron saved into ``checkpoint_dir``: ``per_rank`` writes the files.

    (After, not before: Megatron's dist-checkpointing expects an empty directory.)
    """
    _check_mode(mode)
    return save_lioncub_states(optimizer, checkpoint_dir) if mode == "per_rank" else []


def after_checkpoint_load(optimizer, checkpoint_dir: str, mode: str = "per_rank", reshard: str = "average") -> None:
    """Every rank, after Megatron loaded ``checkpoint_dir`` into the optimizer (``sync``: nothing to do)."""
    _check_mode(mode)
    if mode == "per_rank":
        load_lioncub_states(optimizer, checkpoint_dir, reshard=reshard)
