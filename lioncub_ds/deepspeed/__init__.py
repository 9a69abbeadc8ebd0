"""DeepSpeed integration: ``"optimizer": {"type": "LionCub", "params": {...}}`` in a ds_config.

Importing this module registers LionCub with DeepSpeed (and imports deepspeed). Scripts
that never import lioncub_ds get the same registration lazily: the installed
``lioncub_ds_autohook.pth`` runs it the moment ``deepspeed`` is imported (see
:mod:`lioncub_ds.deepspeed.lioncub_ds_autohook`; opt out with LIONCUB_DS_AUTOREGISTER=0).

ZeRO stage 0: Lion Cub (local momentum, 1-bit votes, the engine never all-reduces
gradients). ZeRO stage 1/2: global Lion on DeepSpeed's reduced gradients, with the
parameter all-gather replaced by a 1-bit sign all-gather where replicas can reproduce
the update exactly. ZeRO stage 3: global Lion on the partitions, or with ``"voters": "node"``
ZeRO-3 inside each node group and votes across them. Optimizer offload (CPU) at stages 1-3.
Rank 0 logs one line through DeepSpeed's logger saying which path was taken. The DeepSpeed
names patched or read, and the tested versions, are in :mod:`._compat`. See docs/deepspeed.md
(also the Hugging Face Trainer recipe).

Public helpers::

    lioncub_of(engine)          # the LionCub inside an engine
    comm_stats(engine)          # wire bytes per step / cumulative, with the baselines
    state_bytes(engine)         # this rank's optimizer-state bytes (LionCub's and DeepSpeed's fp32 copy)
    save_checkpoint(engine, dir, tag) / load_checkpoint(engine, dir, tag)
"""
from __future__ import annotations

from .checkpoint import load_checkpoint, load_rank_state, save_checkpoint, save_rank_state
from ._compat import DeepSpeedCompatError
from .engine import (INTEGRATION_KEYS, OPTIMIZER_NAME, LionCubDeepSpeedError, config_warnings, is_registered,
                     lioncub_of, register, set_options, split_params)
from .zero import ZeroSignAllGatherError
from .zero3 import fp32_state_dict as zero3_fp32_state_dict

__all__ = ["register", "is_registered", "lioncub_of", "comm_stats", "state_bytes", "save_checkpoint", "load_checkpoint",
           "save_rank_state", "load_rank_state", "set_options", "split_params", "config_warnings",
           "LionCubDeepSpeedError", "DeepSpeedCompatError",
           "ZeroSignAllGatherError", "OPTIMIZER_NAME", "INTEGRATION_KEYS", "zero3_fp32_state_dict"]


def comm_stats(engine) -> dict:
    """What the optimizer side of one engine sends, per step and cumulative (bytes per rank).

    Stage 0: LionCub's own telemetry (votes, control flags, momentum sync) with the fp32/bf16
    ring all-reduce baselines of the same gradients. ZeRO 1/2: the sign all-gather against
    DeepSpeed's parameter all-gather (``zero_allgather``); DeepSpeed's gradient reduction
    is not counted here (it is the same either way).
    """
    st = getattr(engine, "lioncub", None)
    if st is None:
        return {}
    if st.mode in ("local_momentum", "zero3_votes"):  # LionCub's own votes (ZeRO-3: summed over sub-groups)
        out = st.optimizer.comm_stats()
        out["mode"] = st.mode
        return out
    out = {"mode": "zero", "stage": st.stage}
    if st.zero_adapter is not None:
        out["zero_allgather"] = "sign"
        out.update(st.zero_adapter.snapshot_stats())
    else:
        out["zero_allgather"] = "params"
    return out


def state_bytes(engine) -> dict:
    """This rank's optimizer-state bytes at ZeRO stage 0: LionCub's own (``momentum``, ``master``:
    voters="node" / master-only fp32 master shards, ``spare``: momentum_double_buffer, ``workspace``:
    node voters' / master-only's step buffers kept between steps) plus
    ``deepspeed_master``: the fp32 copies DeepSpeed's fp16/bf16 wrapper keeps of every parameter (0
    when LionCub steps the parameters itself: fp32, or bf16 with ``node_size``). ``total`` sums them; ``params`` counts the
    model's trainable elements. At ZeRO-3 with votes: the momenta of this rank's partitions (summed
    over its sub-groups; DeepSpeed's own fp32 partitions are not counted). Empty when the engine has
    no LionCub."""
    st = getattr(engine, "lioncub", None)
    if st is not None and st.mode == "zero3_votes":
        out = {k: v for k, v in st.optimizer.state_bytes().items() if k != "params"}
        out["total"] = sum(out.values())
        out["params"] = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters() if p.requires_grad)
        return out
    opt = lioncub_of(engine)
    if opt is None:
        return {}
    out = {k: v for k, v in opt.state_bytes().items() if k != "params"}
    ds_master = 0
    wrapper = engine.optimizer
    if wrapper is not opt:
        import torch
        seen = set()
        for name in ("fp32_groups", "fp32_groups_flat", "single_partition_of_fp32_groups"):
            for group in getattr(wrapper, name, None) or []:
                for t in (group if isinstance(group, (list, tuple)) else [group]):
                    if isinstance(t, torch.Tensor) and id(t) not in seen:
                        seen.add(id(t))
                        ds_master += t.numel() * t.element_size()
    out["deepspeed_master"] = ds_master
    out["total"] = sum(v for k, v in out.items())
    out["params"] = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    return out


register()
