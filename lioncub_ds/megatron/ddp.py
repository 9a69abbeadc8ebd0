"""Turn Megatron DDP's data-parallel gradient reduction off (Lion Cub's local-momentum mode).

Megatron's ``DistributedDataParallel`` accumulates every gradient into contiguous grad
buffers (``param.main_grad``) and reduces them over the data-parallel group in
``start_grad_sync`` / ``finish_grad_sync`` of each bucket group, called from
``finalize_model_grads`` (or the backward hooks with ``overlap_grad_reduce``). In Lion
Cub every data-parallel rank keeps its own momentum and votes with its *own* gradient, so
that reduction must not happen.

:func:`disable_dp_grad_reduction` replaces ``start_grad_sync`` / ``finish_grad_sync`` of
every bucket group (dense and expert) of the given model chunks with versions that keep
the bookkeeping (and DDP's optional NaN / large-gradient checks of the local buffers) but
issue no collective: ``main_grad`` then holds what Megatron's reduction would give were every
rank's gradient this rank's (the own mean gradient for dense parameters; Megatron's edp/dp for
expert ones; with a per-token loss, before Megatron's division by the global token count), so
gradient clipping and the logged norm mean what they mean under Megatron. Everything else stays
as it is: the grad buffers, ``no_sync`` for gradient accumulation, ``zero_grad_buffer``, and the
tensor/pipeline-parallel fix-ups in ``finalize_model_grads`` (sequence-parallel layer-norm grads
over TP, tied embedding grads across pipeline stages), which are model-parallel, not data-parallel,
reductions.

Settings that cannot work in this mode raise :class:`LocalMomentumConfigError`:
``use_distributed_optimizer`` (it reduce-scatters gradients and shards optimizer state
across DP ranks; Lion Cub keeps a full momentum per rank and never reduces gradients),
``overlap_grad_reduce`` (there is no gradient reduction left to overlap; the flag also
makes the backward hooks dispatch collectives), ``num_distributed_optimizer_instances > 1``
and Megatron-FSDP / torch FSDP chunks (they shard parameters and gradients over DP).

Node voters (``voters='node'``) are the exception: they run inside Megatron's distributed
optimizer, and :func:`vote_across_instances` switches off only the all-reduce across its
instances (the votes replace it), keeping the reduce-scatter inside each instance.
"""
from __future__ import annotations

import types

from ._compat import require_megatron

_FLAG = "_lioncub_local_grads"


class LocalMomentumConfigError(ValueError):
    """A Megatron setting that cannot work with Lion Cub's local-momentum mode."""


def _chunks(model_chunks):
    if isinstance(model_chunks, (list, tuple)):
        return list(model_chunks)
    return [model_chunks]


def check_local_momentum_ddp(model_chunk) -> None:
    """Raise :class:`LocalMomentumConfigError` if ``model_chunk``'s DDP settings need DP gradient reduction."""
    ddp_config = getattr(model_chunk, "ddp_config", None)
    if ddp_config is None or not (hasattr(model_chunk, "bucket_groups")
                                  and hasattr(model_chunk, "expert_parallel_bucket_groups")):
        raise LocalMomentumConfigError(
            f"lioncub_ds.megatron: expected megatron.core.distributed.DistributedDataParallel model chunks "
            f"(with bucket_groups / expert_parallel_bucket_groups), got {type(model_chunk).__name__}. "
            "Wrap the model in Megatron DDP (use_distributed_optimizer=False, overlap_grad_reduce=False), or pass "
            "disable_grad_reduction=False to the factory and make sure nothing all-reduces the gradients.")
    if getattr(ddp_config, "use_megatron_fsdp", False):
        raise LocalMomentumConfigError(
            "lioncub_ds.megatron: Megatron-FSDP shards parameters and gradients over data-parallel ranks; "
            "Lion Cub needs full local gradients and momenta on every rank. Use Megatron DDP with "
            "use_megatron_fsdp=False.")
    if getattr(ddp_config, "use_distributed_optimizer", False):
        raise LocalMomentumConfigError(
            "lioncub_ds.megatron: use_distributed_optimizer=True cannot work with Lion Cub: the distributed "
            "optimizer reduce-scatters gradients and shards optimizer state over data-parallel ranks, while "
            "Lion Cub keeps one full local momentum per rank (1 fp32 value per parameter, half of Adam's "
            "state) and exchanges only 1-bit votes. Set use_distributed_optimizer=False in both "
            "DistributedDataParallelConfig and OptimizerConfig (--use-distributed-optimizer off), or use "
            "voters='node' (--lioncub-voters node): the distributed optimizer's instances then vote.")
    if getattr(ddp_config, "num_distributed_optimizer_instances", 1) > 1:
        raise LocalMomentumConfigError(
            "lioncub_ds.megatron: num_distributed_optimizer_instances > 1 needs the distributed optimizer, "
            "which Lion Cub does not use; set it to 1.")
    if getattr(ddp_config, "overlap_grad_reduce", False):
        raise LocalMomentumConfigError(
            "lioncub_ds.megatron: overlap_grad_reduce=True cannot be used in local-momentum mode: there is no "
            "data-parallel gradient reduction left to overlap (Lion Cub votes after backward), and the flag makes "
            "DDP's backward hooks dispatch reduce collectives. Set overlap_grad_reduce=False "
            "(drop --overlap-grad-reduce).")


def _local_scale(bucket_group, bucket) -> float:
    """What Megatron's reduction would make of this rank's gradient were every rank's the same:
    its pre-scaling times the group size under a SUM (an AVG divides that size out again). Dense
    buckets: 1 (the own mean gradient); expert buckets: edp/dp (Megatron's convention for them);
    per-token loss: DP (Megatron divides by the global token count afterwards). The votes do not
    depend on it (a positive factor per tensor keeps every sign); gradient clipping and the
    logged norm do, which is why they see Megatron's scale."""
    factor = float(getattr(bucket, "gradient_scaling_factor", 1.0))
    group = getattr(bucket_group, "data_parallel_group", None)
    if group is not None and not getattr(bucket_group.ddp_config, "average_in_collective", False):
        factor *= group.size()
    return factor


def _local_start_grad_sync(self, force_all_reduce=False):
    """Local-momentum replacement: no DP collective; the buckets scaled as Megatron's reduction
    of equal gradients would leave them (:func:`_local_scale`)."""
    cfg = self.ddp_config
    check_nan = getattr(cfg, "check_for_nan_in_grad", False)
    check_large = getattr(cfg, "check_for_large_grads", False)
    if (check_nan or check_large) and hasattr(self, "check_grads"):
        self.check_grads(check_for_nan_or_inf=check_nan, check_for_large=check_large)
    for bucket in getattr(self, "buckets", ()):
        factor = _local_scale(self, bucket)
        if factor != 1.0:
            bucket.grad_data *= factor
    self.grad_reduce_handle = None


def _local_finish_grad_sync(self, force_all_reduce=False):
    self.param_gather_dispatched = False
    self.start_grad_sync(force_all_reduce=force_all_reduce)
    if hasattr(self, "grad_reduce_finished"):  # megatron-core >= 0.19
        self.grad_reduce_finished = True


def _bucket_groups(chunk):
    return list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups)


def disable_dp_grad_reduction(model_chunks) -> list:
    """Make every bucket group of ``model_chunks`` skip its data-parallel gradient collective.

    Idempotent. Returns the list of model chunks. Undo with :func:`enable_dp_grad_reduction`.
    """
    require_megatron("lioncub_ds.megatron.disable_dp_grad_reduction")
    chunks = _chunks(model_chunks)
    for chunk in chunks:
        check_local_momentum_ddp(chunk)
    for chunk in chunks:
        for bg in _bucket_groups(chunk):
            if getattr(bg, _FLAG, False):
                continue
            bg.start_grad_sync = types.MethodType(_local_start_grad_sync, bg)
            bg.finish_grad_sync = types.MethodType(_local_finish_grad_sync, bg)
            setattr(bg, _FLAG, True)
        setattr(chunk, _FLAG, True)
    return chunks


def enable_dp_grad_reduction(model_chunks) -> list:
    """Restore Megatron's own gradient reduction on ``model_chunks``."""
    chunks = _chunks(model_chunks)
    for chunk in chunks:
        for bg in _bucket_groups(chunk):
            if getattr(bg, _FLAG, False):
                del bg.start_grad_sync
                del bg.finish_grad_sync
                delattr(bg, _FLAG)
        if getattr(chunk, _FLAG, False):
            delattr(chunk, _FLAG)
    return chunks


# ----------------------------------------------------------------------------- node voters
# With --use-distributed-optimizer --num-distributed-optimizer-instances K, each bucket group's
# start_grad_sync reduce-scatters the gradients inside the instance (L = DP/K ranks: each rank
# gets its shard of the instance's gradient), then all-reduces that shard across the K
# instances. Node voters keep the first and replace the second with the vote (the LionCub
# inside the distributed optimizer votes over the inter-instance group). The seam: a bucket
# group decides on the inter-instance all-reduce from its own ``ddp_config``
# (``num_distributed_optimizer_instances > 1``), so each bucket group gets a copy that says one
# instance; the model chunk's config (which the distributed optimizer compares across chunks)
# stays as the user made it.
_INSTANCES_FLAG = "_lioncub_instance_votes"


def check_instance_ddp(model_chunk) -> int:
    """Raise :class:`LocalMomentumConfigError` unless ``model_chunk`` can vote across distributed-
    optimizer instances; returns K (``num_distributed_optimizer_instances``)."""
    ddp_config = getattr(model_chunk, "ddp_config", None)
    if ddp_config is None or not (hasattr(model_chunk, "bucket_groups")
                                  and hasattr(model_chunk, "expert_parallel_bucket_groups")):
        raise LocalMomentumConfigError(
            f"lioncub_ds.megatron: voters='node' expects megatron.core.distributed.DistributedDataParallel model "
            f"chunks (with bucket_groups), got {type(model_chunk).__name__}")
    if getattr(ddp_config, "use_megatron_fsdp", False):
        raise LocalMomentumConfigError(
            "lioncub_ds.megatron: voters='node' runs on Megatron's distributed optimizer, not Megatron-FSDP; set "
            "use_megatron_fsdp=False")
    if not getattr(ddp_config, "use_distributed_optimizer", False):
        raise LocalMomentumConfigError(
            "lioncub_ds.megatron: voters='node' (--lioncub-voters node) needs the distributed optimizer: set "
            "use_distributed_optimizer=True in DistributedDataParallelConfig and OptimizerConfig "
            "(--use-distributed-optimizer --num-distributed-optimizer-instances K; K instances = K voters)")
    if getattr(ddp_config, "reduce_scatter_with_fp32_accumulation", False):
        raise LocalMomentumConfigError(
            "lioncub_ds.megatron: reduce_scatter_with_fp32_accumulation=True is not supported with voters='node'; "
            "allowed: False")
    return int(getattr(ddp_config, "num_distributed_optimizer_instances", 1) or 1)


def instances_of(model_chunks) -> int:
    """K, the distributed-optimizer instances of ``model_chunks`` (every chunk checked by
    :func:`check_instance_ddp`, and all must agree)."""
    ks = {check_instance_ddp(chunk) for chunk in model_chunks}
    if len(ks) != 1:
        raise LocalMomentumConfigError(f"lioncub_ds.megatron: model chunks disagree on num_distributed_optimizer_"
                                       f"instances ({sorted(ks)}); allowed: one value")
    return ks.pop()


def vote_across_instances(model_chunks) -> int:
    """Switch off the inter-instance gradient all-reduce of every bucket group of ``model_chunks``
    (the votes replace it); the reduce-scatter inside each instance stays. Returns K.

    The DDP pre-scales gradients for a mean over the whole data-parallel group (1/DP before a
    SUM, or an AVG in the collective). Without the all-reduce across instances, a SUM would
    leave each shard at 1/K of its instance's mean; the buckets' scaling factor is multiplied
    by K so that every shard holds exactly the mean gradient of its instance's L ranks (the
    gradient Megatron would have had if every rank had seen this instance's data). Idempotent;
    undo with :func:`restore_instance_all_reduce`.
    """
    require_megatron("lioncub_ds.megatron.vote_across_instances")
    import dataclasses
    chunks = _chunks(model_chunks)
    k = instances_of(chunks)
    for chunk in chunks:
        for bg in _bucket_groups(chunk):
            if k == 1 or getattr(bg, _INSTANCES_FLAG, None) is not None:
                continue
            cfg = bg.ddp_config
            rescale = 1.0 if getattr(cfg, "average_in_collective", False) else float(k)
            setattr(bg, _INSTANCES_FLAG, (cfg, rescale))
            bg.ddp_config = dataclasses.replace(cfg, num_distributed_optimizer_instances=1)
            for bucket in bg.buckets:
                bucket.gradient_scaling_factor *= rescale
        setattr(chunk, _INSTANCES_FLAG, k)
    return k


def restore_instance_all_reduce(model_chunks) -> list:
    """Undo :func:`vote_across_instances` (Megatron's own all-reduce across instances again)."""
    chunks = _chunks(model_chunks)
    for chunk in chunks:
        for bg in _bucket_groups(chunk):
            saved = getattr(bg, _INSTANCES_FLAG, None)
            if saved is not None:
                cfg, rescale = saved
                bg.ddp_config = cfg
                for bucket in bg.buckets:
                    bucket.gradient_scaling_factor /= rescale
                delattr(bg, _INSTANCES_FLAG)
        if hasattr(chunk, _INSTANCES_FLAG):
            delattr(chunk, _INSTANCES_FLAG)
    return chunks


def instance_votes_enabled(model_chunk) -> bool:
    return getattr(model_chunk, _INSTANCES_FLAG, None) is not None


def dp_grad_reduction_disabled(model_chunk) -> bool:
    return bool(getattr(model_chunk, _FLAG, False))
