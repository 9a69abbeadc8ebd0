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

Ordering (crash safety): pass the iteration directory to :func:`before_checkpoint_save`
(``before_checkpoint_save(opt, "per_rank", checkpoint_dir=iter_dir)``, what
:mod:`lioncub_ds.megatron.training` does): every rank then writes its files *before*
Megatron's save starts, so they are complete before Megatron writes
``latest_checkpointed_iteration.txt`` (Megatron writes the tracker on rank 0 after a barrier,
or in the finalize step of an async save, i.e. after every rank's files). A crash during the
save leaves the previous "latest" intact. ``dist_checkpointing.save`` only warns
("Overwriting old incomplete / corrupted checkpoint") when the directory is not empty
(megatron-core 0.16-0.20). :func:`after_checkpoint_save` is then a no-op for that directory.

A load that does not find the files (a checkpoint written without LionCub's hooks, or by an
older lioncub_ds whose save stopped between Megatron's tracker and the files) fails on every
rank with one :class:`~lioncub_ds.checkpoint.CheckpointError` that says what is missing and
how to resume (see :func:`load_lioncub_states`).
"""
from __future__ import annotations

import contextlib
import glob
import logging
import os
import weakref

import torch
import torch.distributed as dist

from .. import checkpoint as lc_checkpoint
from ..groups import world_max
from .optimizer import lioncub_optimizers, split_refusal

CHECKPOINT_MODES = ("per_rank", "sync")
SUBDIR = "lioncub"


# Where each LionCub was last saved (kept by this adapter, not on the optimizer)
_SAVED_TO = weakref.WeakKeyDictionary()

def _check_mode(mode, optimizer=None):
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"lioncub checkpoint mode={mode!r} is not allowed; allowed: {', '.join(CHECKPOINT_MODES)}")
    # voters='node': Megatron's checkpoint keeps no optimizer tensors (its distributed optimizer's
    # checkpoint reads Adam's state), so the shards live in the per-rank files only
    if mode == "sync" and optimizer is not None and any(
            getattr(o, "megatron_layout", None) is not None for o in lioncub_optimizers(optimizer)):
        raise ValueError("lioncub checkpoint mode='sync' (--lioncub-checkpoint-mode sync) is not supported with "
                         "--lioncub-voters node: the momentum and fp32 main shards are kept in the per-rank files "
                         "only; allowed: per_rank (the default)")


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


def _flag_device(optimizer):
    for opt in lioncub_optimizers(optimizer):
        for g in opt.param_groups:
            for p in g["params"]:
                return p.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def missing_lioncub_files(optimizer, checkpoint_dir: str) -> list[str]:
    """This rank's expected per-rank files that are absent (and not a data-parallel resize to reshard)."""
    out = []
    for opt in lioncub_optimizers(optimizer):
        d = rank_directory(checkpoint_dir, opt)
        rank, world = opt.rank, opt.world_size
        path = lc_checkpoint.rank_file(d, rank, world)
        if os.path.exists(path):
            continue
        others = glob.glob(os.path.join(d, "lioncub-rank*-of-*.pt"))
        # Files of another data-parallel size are a resize (lioncub_ds.checkpoint reshards them);
        # none, or only this size's files of other ranks, mean this rank's file is missing.
        if not others or all(p.endswith(f"-of-{world:05d}.pt") for p in others):
            out.append(path)
    return out


def split_mismatch(optimizer, checkpoint_dir: str) -> str | None:
    """Why the checkpoint's dense optimizers are not this run's, or None.

    --overlap-param-gather-with-optimizer-step gives the first model chunk an optimizer of its
    own (files under ``dense_chunk0/`` and ``dense_later_chunks/``); without it one optimizer
    holds every chunk (``dense/``). Each file holds its own optimizer's shards, so files of the
    other split are not loaded piecewise; the error says so instead of "files missing"."""
    root = os.path.join(checkpoint_dir, SUBDIR)
    try:
        saved = sorted(d for d in os.listdir(root) if d.startswith("dense") and os.path.isdir(os.path.join(root, d)))
    except OSError:
        return None
    mine = sorted({getattr(o, "megatron_kind", "dense") for o in lioncub_optimizers(optimizer)} - {"expert"})
    if not saved or not mine or saved == mine:
        return None
    return split_refusal(f"the per-rank files of {checkpoint_dir}", saved, mine) + " No rank loaded anything"


def missing_files_message(checkpoint_dir: str, n_missing_ranks: int, example: str | None,
                          iteration=None) -> str:
    it = f" (iteration {iteration})" if iteration is not None else ""
    here = f" This rank expected {example}." if example else ""
    return (
        f"LionCub: the Megatron checkpoint {checkpoint_dir}{it} has no LionCub per-rank momentum files for "
        f"{n_missing_ranks} rank(s) (expected under {os.path.join(checkpoint_dir, SUBDIR)}).{here} "
        "What happened: Megatron's own files are there, the per-rank LionCub files are not. lioncub_ds.megatron "
        "writes them before Megatron's save starts, so Megatron's tracker (latest_checkpointed_iteration.txt) "
        "never points at a checkpoint without them; they are absent when the checkpoint was written without "
        "LionCub's checkpoint hooks (plain pretrain_gpt.py, or another optimizer), with --lioncub-checkpoint-mode "
        "sync or --no-save-optim, by an older lioncub_ds whose save stopped between Megatron's tracker and the "
        "per-rank files, or when the lioncub/ folder was not copied with the checkpoint. No rank changed its "
        "state. To resume from this checkpoint, relaunch with ONE of: "
        "(1) --lioncub-checkpoint-mode sync: every data-parallel rank resumes from the single momentum replica "
        "Megatron stored (data-parallel rank 0's, like a momentum sync; later saves average the momenta first); "
        "(2) --no-load-optim: model weights only; LionCub momenta start at zero (Megatron then also skips its "
        "optimizer and LR-scheduler state). If some ranks' files are there (another data-parallel size), "
        "--lioncub-reshard average starts every rank from their mean.")


def load_lioncub_states(optimizer, checkpoint_dir: str, reshard: str = "average", iteration=None) -> list[str]:
    """Restore the per-rank states written by :func:`save_lioncub_states` (after Megatron's own load).

    Collective over the world (every rank calls): first every rank checks that its files are
    there and all ranks agree (one small all-reduce on the parameters' device); if any rank
    misses its files, every rank raises the same :class:`~lioncub_ds.checkpoint.CheckpointError`
    (what is missing, why, and how to resume) and no rank changed its state. Then each LionCub
    loads with :func:`lioncub_ds.checkpoint.load` (validated, agreed inside its vote group);
    a failure there is again agreed over the world before anyone raises.
    """
    device = _flag_device(optimizer)
    split = split_mismatch(optimizer, checkpoint_dir)
    missing = missing_lioncub_files(optimizer, checkpoint_dir)
    any_split, n_missing = world_max([1 if split else 0, 1 if missing else 0], device)
    if any_split:
        raise lc_checkpoint.CheckpointError(split or f"LionCub: another rank found {checkpoint_dir}'s optimizers split "
                                            "otherwise than this run's (see that rank's error); no rank loaded")
    if n_missing:
        count = 1
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([1 if missing else 0], dtype=torch.int64, device=device)
            dist.all_reduce(t)
            count = int(t.item())
        example = missing[0] if missing else None
        raise lc_checkpoint.CheckpointError(missing_files_message(checkpoint_dir, count, example, iteration))
    # Every optimizer (dense, expert) is checked before any is loaded, each check agreed in its own
    # vote group, and a failure does not skip the next one's check: the vote groups of the dense and
    # the expert optimizer cut the world differently (e.g. TP 2, expert TP 1), so a rank that stopped
    # after the dense check would leave its expert group's peers waiting.
    opts = lioncub_optimizers(optimizer)
    error, prepared = None, []
    for opt in opts:
        try:
            prepared.append(lc_checkpoint.prepare_load(opt, rank_directory(checkpoint_dir, opt), reshard=reshard))
        except lc_checkpoint.CheckpointError as exc:
            error = error or exc
    failed, = world_max([1 if error is not None else 0], device)
    if error is not None:
        raise error
    if failed:
        raise lc_checkpoint.CheckpointError(
            f"LionCub: another rank could not load its LionCub state from {checkpoint_dir} (see that rank's error); "
            "stopping every rank, no rank changed its state")
    return [lc_checkpoint.apply_load(opt, p) for opt, p in zip(opts, prepared)]


def has_lioncub_states(checkpoint_dir: str) -> bool:
    return os.path.isdir(os.path.join(checkpoint_dir, SUBDIR))


def sync_momenta(optimizer) -> None:
    """Average every LionCub momentum over its data-parallel group, now (all ranks must call)."""
    for opt in lioncub_optimizers(optimizer):
        if not opt.distributed:
            continue
        # ALL momenta (not only momentum_sync.layers): Megatron stores one replica for every rank.
        opt.sync_momenta(all_params=True)


def before_checkpoint_save(optimizer, mode: str = "per_rank", checkpoint_dir: str | None = None) -> list[str]:
    """Every rank, right before Megatron saves.

    ``sync``: average the momenta (Megatron then stores the one replica every rank has).
    ``per_rank`` with ``checkpoint_dir`` (the iteration directory Megatron is about to write):
    write this rank's files now, so they are complete before Megatron's tracker says "latest"
    (returns the paths). ``per_rank`` without a directory: nothing (call
    :func:`after_checkpoint_save` then).
    """
    _check_mode(mode, optimizer)
    if mode == "sync":
        sync_momenta(optimizer)
        return []
    if checkpoint_dir is None:
        return []
    paths = save_lioncub_states(optimizer, checkpoint_dir)
    _mark_saved(optimizer, checkpoint_dir)
    return paths


def _save_key(opt, checkpoint_dir):
    return (os.path.abspath(checkpoint_dir), getattr(opt, "_step_count", None))


def _mark_saved(optimizer, checkpoint_dir):
    for opt in lioncub_optimizers(optimizer):
        _SAVED_TO[opt] = _save_key(opt, checkpoint_dir)


def after_checkpoint_save(optimizer, checkpoint_dir: str, mode: str = "per_rank") -> list[str]:
    """Every rank, right after Megatron saved into ``checkpoint_dir``: ``per_rank`` writes the files
    unless :func:`before_checkpoint_save` already wrote them there at this step.

    (Writing them before Megatron's save is the crash-safe order; see the module doc.)
    """
    _check_mode(mode)
    if mode != "per_rank":
        return []
    opts = lioncub_optimizers(optimizer)
    if opts and all(_SAVED_TO.get(o) == _save_key(o, checkpoint_dir) for o in opts):
        return []
    paths = save_lioncub_states(optimizer, checkpoint_dir)
    _mark_saved(optimizer, checkpoint_dir)
    return paths


def after_checkpoint_load(optimizer, checkpoint_dir: str, mode: str = "per_rank", reshard: str = "average",
                          iteration=None) -> None:
    """Every rank, after Megatron loaded ``checkpoint_dir`` into the optimizer (``sync``: nothing to do)."""
    _check_mode(mode, optimizer)
    if mode == "per_rank":
        load_lioncub_states(optimizer, checkpoint_dir, reshard=reshard, iteration=iteration)


class _DropNonEmptyWarning(logging.Filter):
    def filter(self, record):
        return not str(record.getMessage()).startswith("Overwriting old incomplete / corrupted checkpoint")


@contextlib.contextmanager
def quiet_nonempty_dir_warning(iter_dir):
    """dist_checkpointing.save warns "Overwriting old incomplete / corrupted checkpoint" when the
    directory is not empty; with only our lioncub/ folder in it, that warning would be misleading."""
    try:
        only_ours = sorted(os.listdir(iter_dir)) == [SUBDIR]
    except OSError:
        only_ours = False
    if not only_ours:
        yield
        return
    logger = logging.getLogger("megatron.core.dist_checkpointing.serialization")
    f = _DropNonEmptyWarning()
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)
