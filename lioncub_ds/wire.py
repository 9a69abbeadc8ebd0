"""The bytes a LionCub step sends, as torch-free arithmetic over runs of equal sizes.

The planner (:mod:`lioncub_ds.plan`) predicts ``comm_stats()`` exactly, for models from a few
tensors to 10^15 parameters, on machines without torch (its README command runs before
``make setup``). The runtime computes the same quantities over its real objects (tensors,
buckets, per-bucket lists) in modules that import torch, so this module restates each formula
it needs once, as a closed form over *runs* ``(size, count)`` (a 7B model's 1,700 equal tensors
are one run; the packing below never expands a run). Each function names the runtime function
it restates; ``tests/test_wire.py`` holds every one equal to the runtime's over a grid of sizes
and world sizes, so neither side can change alone.
"""
from __future__ import annotations

import math

from .telemetry import ring_bytes

Runs = list  # [(size, count), ...] in order; count >= 1

# lioncub_ds.flags: FLAG_HEAD (the step-wide entries) and PACKED_BELOW (two 16-bit lanes per word)
FLAG_HEAD = 37
PACKED_BELOW = 2 ** 15
WORD = 4                     # lioncub_ds.comm.abstain.WORD: bytes of one int32 list word
COMM_BUCKET_MB = 4.0         # LionCubConfig.comm_bucket_mb's default
WINDOW = 4                   # lioncub_ds.sharding.WINDOW: buckets whose whole-bucket step buffers exist at once


def add_run(runs: Runs, size: int, count: int = 1) -> Runs:
    """Append ``count`` items of ``size``, merged into the last run when equal."""
    if count > 0:
        if runs and runs[-1][0] == size:
            runs[-1] = (size, runs[-1][1] + count)
        else:
            runs.append((size, count))
    return runs


def runs_of(sizes) -> Runs:
    out: Runs = []
    for s in sizes:
        add_run(out, int(s))
    return out


def total(runs: Runs) -> int:
    return sum(s * c for s, c in runs)


def count(runs: Runs) -> int:
    return sum(c for _, c in runs)


def pack(runs: Runs, cap: float) -> Runs:
    """The greedy packing every layout of the runtime uses (:func:`lioncub_ds.layout.build_buckets`,
    :func:`~lioncub_ds.layout.comm_batches`, :func:`lioncub_ds.momentum_sync.sync_chunks`): items
    in order join the open bin while the bin's size plus theirs stays <= ``cap``, an item alone
    may exceed it. Returns the bins' sizes as runs, in order, in O(number of runs)."""
    cap = math.floor(cap)  # the sizes are integers: size > cap exactly when size > floor(cap)
    out: Runs = []
    size, open_ = 0, False
    for a, c in runs:
        if a < 1:
            raise ValueError(f"item size {a} < 1")
        while c:
            if open_:
                room = (cap - size) // a if size + a <= cap else 0
                if not room:
                    add_run(out, size)
                    size, open_ = 0, False
                    continue
                take = min(c, room)
                size, c = size + take * a, c - take
                continue
            per_bin = max(1, cap // a)   # items a bin takes from empty (one alone when larger than cap)
            closed = (c - 1) // per_bin  # bins this run fills and leaves; its last bin stays open
            add_run(out, per_bin * a, closed)
            size, open_, c = (c - closed * per_bin) * a, True, 0
    if open_:
        add_run(out, size)
    return out


# ----------------------------------------------------------------------------- the vote layout
def padded_numel(numel: int, world_size: int) -> int:
    """:func:`lioncub_ds.conventions.padded_numel`: the smallest multiple of 8·N >= ``numel``."""
    unit = 8 * max(1, world_size)
    return (numel + unit - 1) // unit * unit


def bucket_numel(bucket_size_mb: float) -> int:
    """``LionCubConfig.bucket_numel``: elements of a vote bucket."""
    return max(8, int(bucket_size_mb * 2**20 / 4) // 8 * 8)


def bucket_runs(numels: Runs, bucket_size_mb: float, world_size: int) -> Runs:
    """Padded sizes of the vote buckets :func:`lioncub_ds.layout.build_buckets` makes of one
    group's tensors of these sizes (each 8-aligned inside its bucket, the bucket padded to 8·N)."""
    aligned = [((n + 7) // 8 * 8, c) for n, c in numels]
    out: Runs = []
    for size, c in pack(aligned, bucket_numel(bucket_size_mb)):
        add_run(out, padded_numel(size, world_size), c)
    return out


def ring_slot_numels(sizes: Runs, window: int = WINDOW) -> list[int]:
    """:func:`lioncub_ds.sharding.ring_capacity` in elements: slot s of a ring of ``window``
    buffers holds the largest of the items at positions s, s + window, ... of ``sizes`` (runs in
    the order the items take the slots)."""
    out, at = [0] * window, 0
    for size, c in sizes:
        for k in range(min(c, window)):
            out[(at + k) % window] = max(out[(at + k) % window], size)
        at += c
    return out


def batch_count(buckets: Runs, comm_bucket_mb: float = COMM_BUCKET_MB) -> int:
    """Communication batches of 1-bit buckets (:func:`lioncub_ds.layout.comm_batches`: from the
    last bucket, packed votes of numel/8 bytes while they fit ``comm_bucket_mb``)."""
    return count(pack([(n // 8, c) for n, c in reversed(buckets)], comm_bucket_mb * 2**20))


# ----------------------------------------------------------------------------- bytes
def onebit_wire_bytes(numel: int, world_size: int) -> int:
    """``OneBitVote.wire_bytes(numel, N)`` as the planner's configuration runs it (majority vote,
    tie_break="hash", abstentions as a list, nobody abstaining): phase 1 each rank's shard of
    the vote bits plus its abstention list (a count and capacity K pairs of int32,
    K = plane/(1024·N): :func:`lioncub_ds.comm.abstain.list_capacity`), phase 2 the shard results."""
    n = world_size
    plane = numel // 8
    shard = plane // n
    payload = WORD * (1 + 2 * (plane // (1024 * max(1, n))))
    return (n - 1) * (shard + payload) + (n - 1) * shard


def flag_words(n_buckets: int, world_size: int) -> int:
    """:func:`lioncub_ds.flags.flag_words` (no drift word): int32 words of the packed flags."""
    lanes = 2 if world_size < PACKED_BELOW else 1
    return 1 + (FLAG_HEAD - 1 + 2 * n_buckets + lanes - 1) // lanes


def flag_bytes(n_buckets: int, world_size: int, carried: bool) -> int:
    """:func:`lioncub_ds.flags.flag_bytes`: the flags carried in a gather-like phase, or all-reduced."""
    words = 4 * flag_words(n_buckets, world_size)
    return (world_size - 1) * words if carried else ring_bytes("all_reduce", words, world_size)


def sync_wire_bytes(numel: int, world_size: int, dtype: str) -> int:
    """Bytes one rank sends to sync ``numel`` momenta in ``dtype`` (telemetry's ring model); the runtime's
    :mod:`lioncub_ds.momentum_sync` uses this one."""
    n = world_size
    if n <= 1:
        return 0
    if dtype == "fp32":
        return 2 * (n - 1) * 4 * numel // n
    shard = -(-numel // n)
    width = 2 * shard if dtype == "bf16" else shard + 4
    return 2 * (n - 1) * width


def sync_chunk_runs(numels: Runs, bucket_size_mb: float) -> Runs:
    """Element counts of a momentum sync's collectives (:func:`lioncub_ds.momentum_sync.sync_chunks`
    with chunks of a vote bucket's size)."""
    return pack(numels, bucket_numel(bucket_size_mb))


def node_group_bytes(buckets: Runs, grad_size: int, param_size: int, node_size: int, ranks: int) -> int:
    """:func:`lioncub_ds.sharding.node_group_bytes`: per full bucket the gradient reduce-scatter
    and the shard all-gather inside the node group, plus the all-reduce of the flags as int64."""
    out = ring_bytes("all_reduce", 8 * flag_words(count(buckets), ranks), node_size)
    for numel, c in buckets:
        out += c * (ring_bytes("all_to_all", grad_size * numel, node_size)
                    + ring_bytes("all_gather", param_size * numel, node_size))
    return out
