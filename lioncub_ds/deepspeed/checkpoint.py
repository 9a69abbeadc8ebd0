"""``engine.save_checkpoint`` / ``engine.load_checkpoint`` that keep EVERY rank's momentum.

At ZeRO stage 0 DeepSpeed writes the optimizer state once, from data-parallel rank 0
(``mp_rank_00_model_states.pt``), and loads that one copy into every rank. With Lion Cub
every rank has its own momentum, so the integration hooks the two engine methods (on the
engine instance, at ``deepspeed.initialize``):

* save: every rank first writes its own LionCub state to
  ``<save_dir>/<tag>/lioncub-rank{r:05d}-of-{N:05d}.pt`` (:mod:`lioncub_ds.checkpoint`:
  atomic, versioned, ``weights_only``), then DeepSpeed saves as usual (``latest`` is
  written last, so it never points at a tag without the per-rank files).
* load: every rank first reads and checks its own file, and the ranks agree (a bad or missing
  file raises ``CheckpointError`` on every rank before DeepSpeed has loaded anything); then
  DeepSpeed loads as usual, then every rank restores its own file (a world-size
  change starts every rank from the mean momentum, see ``lioncub_ds.checkpoint``). A
  checkpoint without the files (saved without lioncub_ds) loads with a warning: every
  rank then continues from rank 0's momentum.

ZeRO stage 1/2 checkpoints are DeepSpeed's own: each rank already saves its momentum
partition (``zero_pp_rank_*_optim_states.pt``). After a load the fp32 replica of the
sign all-gather (if enabled) is re-synchronized from the loaded masters.

Equivalent explicit helpers: :func:`save_checkpoint` / :func:`load_checkpoint`.
"""
from __future__ import annotations

import inspect
import os

import torch.distributed as dist

from .. import checkpoint as lc_checkpoint
from ..groups import world_max
from . import _compat

_MARK = "_lioncub_ds_ckpt_hook"


def _state(engine):
    return getattr(engine, "lioncub", None)


def _resolve_tag(engine, load_dir, tag):
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, "latest")
    if os.path.isfile(latest):
        with open(latest) as fd:
            return fd.read().strip()
    return None


def save_rank_state(engine, save_dir, tag) -> str | None:
    """Write this rank's LionCub state into the tag directory (stage 0 only). Returns the path."""
    st = _state(engine)
    if st is None or st.mode != "local_momentum":
        return None
    return lc_checkpoint.save(st.optimizer, os.path.join(save_dir, str(tag)))


def prepare_rank_state(engine, load_dir, tag, reshard: str = "average"):
    """Stage 0: read, check and agree on every rank's LionCub file of the tag directory, changing
    nothing (collective). Returns what :func:`lioncub_ds.checkpoint.apply_load` takes, or None (not
    stage-0 local momentum, or a checkpoint saved without lioncub_ds: a warning)."""
    st = _state(engine)
    if st is None or st.mode != "local_momentum":
        return None
    directory = os.path.join(load_dir, str(tag))
    error, prepared = None, None
    try:
        prepared = lc_checkpoint.prepare_load(st.optimizer, directory, reshard=reshard)
    except lc_checkpoint.CheckpointError as exc:
        error = exc
    # Agreed over the world, not only the vote group prepare_load agrees in (node voters' peers):
    # every rank raises together, or none. "Saved without lioncub_ds" only when NO rank finds a
    # file: a rank alone without them (node-local storage) must not go on into DeepSpeed's load.
    if _every_rank(error is None, st.optimizer):
        return prepared
    no_files = error is not None and "no LionCub checkpoint files" in str(error)
    if _every_rank(no_files, st.optimizer):
        what = ("every rank keeps its current momentum shards (voters='node'; the fp32 masters are rebuilt from "
                "the loaded weights)" if st.optimizer.strategy.node_voters
                else "every rank keeps its current momentum (the fp32 master shards are rebuilt from the loaded "
                     "weights)" if st.optimizer.strategy.shards_state
                else "every rank continues from data-parallel rank 0's momentum")
        _compat.ds_logger().warning(f"lioncub_ds: {directory} has no per-rank LionCub files (saved without "
                                    f"lioncub_ds?): {what}")
        return None
    if error is None:
        raise lc_checkpoint.CheckpointError(f"LionCub: another rank could not load its LionCub state from {directory} "
                                            "(see that rank's error); no rank changed its state")
    if no_files:
        raise lc_checkpoint.CheckpointError(
            f"LionCub: this rank finds no per-rank LionCub files in {directory}, other ranks do (node-local storage "
            "without this node's files?); no rank changed its state") from None
    raise error


def _every_rank(flag: bool, optimizer) -> bool:
    """Whether ``flag`` holds on every rank of the world (at checkpoint time only)."""
    return world_max([not flag], lc_checkpoint.device_of(optimizer))[0] == 0


def load_rank_state(engine, load_dir, tag, reshard: str = "average") -> str | None:
    """Restore this rank's LionCub state from the tag directory (stage 0), or refresh ZeRO replicas."""
    st = _state(engine)
    if st is None:
        return None
    if st.mode == "zero":
        if st.zero_adapter is not None:
            st.zero_adapter.refresh()
        return None
    prepared = prepare_rank_state(engine, load_dir, tag, reshard)
    return lc_checkpoint.apply_load(st.optimizer, prepared) if prepared is not None else None


def save_checkpoint(engine, save_dir, tag=None, **kwargs):
    """``engine.save_checkpoint`` with every rank's momentum (same as the hooked engine method)."""
    return engine.save_checkpoint(save_dir, tag, **kwargs)


def load_checkpoint(engine, load_dir, tag=None, **kwargs):
    """``engine.load_checkpoint`` restoring every rank's momentum (same as the hooked engine method)."""
    return engine.load_checkpoint(load_dir, tag, **kwargs)


def refresh_node_masters(optimizer) -> None:
    """voters="node" / master-only sharding: rebuild this rank's fp32 master shards from the (just loaded) 16-bit
    parameters at the next step, as DeepSpeed's ``refresh_fp32_params`` does for its own copy."""
    optimizer.momenta.drop_masters()


def install_engine_hooks(engine) -> None:
    """Wrap this engine's save/load_checkpoint (instance attributes; idempotent)."""
    if getattr(engine.save_checkpoint, _MARK, False):
        return
    orig_save = engine.save_checkpoint
    orig_load = engine.load_checkpoint
    save_sig = inspect.signature(orig_save)
    load_sig = inspect.signature(orig_load)

    def hooked_save(*args, **kwargs):
        bound = save_sig.bind(*args, **kwargs)
        bound.apply_defaults()
        if bound.arguments.get("tag") is None:
            bound.arguments["tag"] = f"global_step{engine.global_steps}"
        st = _state(engine)
        if st is None or st.mode != "local_momentum":
            return orig_save(*bound.args, **bound.kwargs)
        error = None
        try:
            save_rank_state(engine, bound.arguments["save_dir"], bound.arguments["tag"])
        except Exception as exc:  # noqa: BLE001 - agreed below, then raised (disk full, quota, node-local storage)
            error = exc
        # Agreed over the world, which is also the barrier: every rank's file is written before rank 0
        # can write "latest" (DeepSpeed's save does not synchronize first with checkpoint.tag_validation
        # "Ignore"); a rank whose write failed does not leave the others waiting in a barrier: every
        # rank raises, before DeepSpeed writes anything of this checkpoint.
        if _every_rank(error is None, st.optimizer):
            return orig_save(*bound.args, **bound.kwargs)
        if error is not None:
            raise error
        raise lc_checkpoint.CheckpointError(
            f"LionCub: another rank could not write its LionCub state into "
            f"{os.path.join(str(bound.arguments['save_dir']), str(bound.arguments['tag']))} (see that rank's error); "
            "DeepSpeed's checkpoint was not written")

    def hooked_load(*args, **kwargs):
        bound = load_sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        st = _state(engine)
        prepared = None
        if (st is not None and st.mode == "local_momentum" and a.get("load_optimizer_states", True)
                and not a.get("load_module_only", False)):
            # Stage 0: check every rank's LionCub file BEFORE DeepSpeed replaces the parameters, the
            # step and the momentum, so a CheckpointError ("no rank changed its state") stays true.
            tag = _resolve_tag(engine, a["load_dir"], a.get("tag"))
            here = tag is not None and os.path.isdir(os.path.join(a["load_dir"], str(tag)))
            # agreed: a rank without the tag folder (node-local storage) checks with the others
            # (its check fails, and every rank raises together) instead of skipping the collective
            if not _every_rank(not here, st.optimizer):
                prepared = prepare_rank_state(engine, a["load_dir"], tag if tag is not None else "latest")
        node = st is not None and st.mode == "local_momentum" and st.optimizer.strategy.shards_state
        # a flat engine resuming sharded files (node voters -> flat): DeepSpeed's own optimizer file
        # then holds data-parallel rank 0's sharded state, which the flat LionCub cannot take; every
        # rank's state comes from the per-rank files, the wrapper's fp32 masters from the weights
        from_sharded = (not node and prepared is not None and os.path.isdir(prepared[1])
                        and lc_checkpoint.saved_sharded(prepared[1]))
        if from_sharded:
            a["load_optimizer_states"] = False
        if node:
            # voters="node" / master-only sharding: DeepSpeed's own file holds data-parallel rank 0's
            # state only, whose shards are not this rank's; every rank's state comes from its own file.
            keep_lioncub = a.get("load_optimizer_states", True) and not a.get("load_module_only", False)
            a["load_optimizer_states"] = False
        result = orig_load(*bound.args, **bound.kwargs)
        load_path = result[0] if isinstance(result, tuple) else result
        if load_path is None or st is None:
            return result
        if st.mode == "zero":
            if st.zero_adapter is not None:  # masters changed (loaded, or rebuilt from the 16-bit weights)
                st.zero_adapter.refresh()
        elif prepared is not None:
            lc_checkpoint.apply_load(st.optimizer, prepared)
            if from_sharded and engine.optimizer is not st.optimizer and hasattr(engine.optimizer,
                                                                                  "refresh_fp32_params"):
                engine.optimizer.refresh_fp32_params()
        elif node:  # no LionCub files, or not asked to load the optimizer state
            refresh_node_masters(st.optimizer)  # the loaded 16-bit weights, not the old masters
        elif (engine.optimizer is not st.optimizer and hasattr(engine.optimizer, "refresh_fp32_params")
              and (not a.get("load_optimizer_states", True) or a.get("load_module_only", False))):
            # stage 0 behind DeepSpeed's fp16 / bf16 wrapper, weights only: DeepSpeed skips the
            # wrapper's state, whose fp32 masters still hold the old weights (the next step would
            # write them back over the loaded ones); they are rebuilt from the loaded weights
            engine.optimizer.refresh_fp32_params()
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        return result

    for fn, orig in ((hooked_save, orig_save), (hooked_load, orig_load)):
        setattr(fn, _MARK, True)
        fn.__wrapped__ = orig
        fn.__doc__ = (orig.__doc__ or "") + "\n\n(lioncub_ds: also saves/restores every rank's LionCub momentum.)"
    engine.save_checkpoint = hooked_save
    engine.load_checkpoint = hooked_load
