"""The process groups LionCub creates, and torch.distributed compat shims.

NCCL's rule (docs/conventions.md, "NCCL contract"): every group is created on EVERY rank of
the world, in the same order, outside the training step. A data-parallel group is usually
one of several (Megatron: one per tensor/pipeline coordinate), and each rank only knows its
own, so :func:`create_on_all_ranks` first all-gathers every rank's wanted member lists once,
then every rank creates the union in one sorted order and keeps the groups it belongs to.
It runs at construction (or ``set_process_group``), never inside ``step()``.
"""
from __future__ import annotations

import datetime
import inspect
import os
import sys

import torch.distributed as dist


def group_ranks(group) -> list[int]:
    """Global ranks of ``group`` (None: the world)."""
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def create_on_all_ranks(wanted: list[list[int]], timeout_s: float | None = None) -> list:
    """Collective over the world: every rank passes the member lists it needs (in any number,
    possibly none) and gets back one group per list, created with ``timeout_s``.

    Every rank of the world must call this the same number of times, in the same order.
    """
    world = dist.get_world_size()
    gathered = [None] * world
    dist.all_gather_object(gathered, [list(map(int, r)) for r in wanted])
    union = sorted({tuple(r) for lists in gathered for r in lists}, key=lambda r: (len(r), r))
    kw = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s is not None else {}
    created = {}
    for ranks in union:
        created[ranks] = dist.new_group(list(ranks), **kw)
    return [created[tuple(r)] for r in wanted]


def consecutive_blocks(ranks: list[int], size: int) -> list[list[int]]:
    """``ranks`` cut into blocks of ``size`` consecutive members (size divides len(ranks))."""
    return [ranks[i:i + size] for i in range(0, len(ranks), size)]


# torch >= 2.6 takes broadcast(..., group_src=); older torch (2.4/2.5) only a global src rank.
_BROADCAST_HAS_GROUP_SRC = "group_src" in inspect.signature(dist.broadcast).parameters


def broadcast(tensor, src_group_rank: int, group, async_op: bool = False, *, use_group_src: bool | None = None):
    """``dist.broadcast`` from the group-local rank ``src_group_rank`` on any torch >= 2.4."""
    if use_group_src is None:
        use_group_src = _BROADCAST_HAS_GROUP_SRC
    if use_group_src:
        return dist.broadcast(tensor, group_src=src_group_rank, group=group, async_op=async_op)
    return dist.broadcast(tensor, src=group_ranks(group)[src_group_rank], group=group, async_op=async_op)


def exit_cleanly(rc: int = 0) -> None:
    """End a finished training process: tear its process groups down, flush, and leave without
    the interpreter's own teardown, where gloo's threads can abort a finished run with
    "terminate called without an active exception" (pytorch/pytorch#65231; seen here in the
    demo and HF launches after their work had been written). Never returns."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
