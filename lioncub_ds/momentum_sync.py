"""Selective momentum synchronization (docs/conventions.md, lever 3): when, what and with whom.

Steps are 0-based indices of applied optimizer steps (the first step is 0). A sync
happens right after that step's local momentum update:

* ``schedule="every"``: steps s with s % every == 0;
* ``schedule="geometric"``: T0 = 0, T(j+1) = T(j) + floor(2**(j/k));
* ``until``: only steps s < until;
* ``layers``: only parameters whose names match one of the fnmatch patterns;
* ``group="node"``: the average runs inside subgroups of ``group_size`` consecutive
  ranks (default ``LOCAL_WORLD_SIZE``); with ``inter_every`` K', every K'-th step
  (s % K' == 0, same ``until``) averages across the whole group instead.

Averaging is all-reduce(SUM) then divide (ReduceOp.AVG does not exist on gloo), in fp32.
"""
from __future__ import annotations

import fnmatch
import math
import os
from functools import lru_cache

import torch

from .config import LionCubConfigError, MomentumSyncConfig


def geometric_steps(k: float, limit: int) -> list[int]:
    """Sync steps of the geometric schedule below ``limit``: T0=0, T(j+1)=T(j)+floor(2**(j/k))."""
    out, t, j = [], 0, 0
    while t < limit:
        out.append(t)
        t += int(math.floor(2.0 ** (j / k)))
        j += 1
    return out


@lru_cache(maxsize=64)
def _geometric_set(k: float, limit: int) -> frozenset:
    return frozenset(geometric_steps(k, limit))


def on_schedule(cfg: MomentumSyncConfig, s: int) -> bool:
    if cfg.until is not None and s >= cfg.until:
        return False
    if cfg.schedule == "every":
        return s % cfg.every == 0
    # geometric: membership among all T(j) <= s (cache in chunks of 4096 steps)
    limit = (s // 4096 + 1) * 4096
    return s in _geometric_set(cfg.k, limit)


def select_params(cfg: MomentumSyncConfig, named: list[tuple[str | None, torch.Tensor]]) -> list[torch.Tensor]:
    if not cfg.layers:
        return [p for _, p in named]
    if any(name is None for name, _ in named):
        raise LionCubConfigError("LionCub: momentum_sync.layers needs parameter names; pass model.named_parameters() "
                                 "or param groups carrying 'param_names' (or 'names')")
    return [p for name, p in named if any(fnmatch.fnmatchcase(name, pat) for pat in cfg.layers)]


def node_group_size(group_size: int | None, n: int) -> int:
    """The node subgroup size: ``group_size`` or ``LOCAL_WORLD_SIZE``; must divide the group size ``n``."""
    if group_size is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            raise LionCubConfigError("LionCub: momentum_sync.group='node' needs momentum_sync.group_size or the "
                                     "LOCAL_WORLD_SIZE environment variable (set by torchrun / deepspeed)")
        group_size = int(env)
    if group_size < 1 or n % group_size:
        raise LionCubConfigError(f"LionCub: momentum_sync.group_size={group_size} must divide the group size {n}")
    return group_size


class MomentumSync:
    """Decides, per step, whether and where momenta are averaged, and does it."""

    def __init__(self, cfg: MomentumSyncConfig, collectives, node_collectives=None):
        self.cfg = cfg
        self.world = collectives
        self.node = node_collectives

    def scope(self, s: int):
        """None, or the Collectives to average over at step index s."""
        cfg = self.cfg
        if cfg.group == "node":
            if cfg.inter_every is not None and (cfg.until is None or s < cfg.until) and s % cfg.inter_every == 0:
                return self.world
            return self.node if on_schedule(cfg, s) else None
        return self.world if on_schedule(cfg, s) else None

    @staticmethod
    def average_over(coll, momenta: list[torch.Tensor], chunk_numel: int) -> None:
        """Average momenta over ``coll``'s group in fp32, a few big all-reduces."""
        if not momenta or coll.world_size <= 1:
            return
        chunk, size = [], 0
        for m in momenta + [None]:
            if m is not None and (size + m.numel() <= chunk_numel or not chunk):
                chunk.append(m)
                size += m.numel()
                continue
            flat = torch.cat([t.reshape(-1).float() for t in chunk])
            coll.all_reduce_(flat, "momentum_sync")
            flat.div_(coll.world_size)
            off = 0
            for t in chunk:
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()
            chunk, size = ([m], m.numel()) if m is not None else ([], 0)
