"""lioncub_ds/wire.py restates, torch-free and over runs of equal sizes, the byte formulas the runtime
computes over its real objects. Each is held equal here to the runtime function it restates, over
grids of sizes, world sizes and bucket sizes (equal runs, odd sizes, tensors larger than a bucket),
so neither side can change alone. The planner's bytes against real ranks: tests/test_plan.py."""
from __future__ import annotations

import random

import pytest
import torch

from lioncub_ds import wire
from lioncub_ds.comm import abstain, onebit
from lioncub_ds.config import LionCubConfig
from lioncub_ds.conventions import padded_numel
from lioncub_ds.flags import FLAG_HEAD, PACKED_BELOW, flag_bytes, flag_words
from lioncub_ds.layout import assign_algorithms, build_buckets, comm_batches
from lioncub_ds.momentum_sync import sync_bytes, sync_chunks, sync_wire_bytes
from lioncub_ds.sharding import WINDOW, node_group_bytes, ring_capacity

pytestmark = pytest.mark.unit

WORLDS = (1, 2, 3, 4, 8, 16, 64, 1000, PACKED_BELOW, PACKED_BELOW + 1)


def _sizes(seed: int) -> list[int]:
    """Runs of equal tensors (as a model's layers give), odd sizes and a few larger than any bucket."""
    rng = random.Random(seed)
    out = []
    for _ in range(rng.randint(1, 12)):
        size = rng.choice([1, 7, 8, 9, 1003, 4099, 65_536, 70_001, 262_144, 1_000_003, 3_000_000])
        out += [size] * rng.choice([1, 1, 2, 5, 17])
    return out


def _expand(runs):
    return [s for s, c in runs for _ in range(c)]


def test_the_constants_are_the_runtimes():
    assert (wire.FLAG_HEAD, wire.PACKED_BELOW, wire.WORD) == (FLAG_HEAD, PACKED_BELOW, abstain.WORD)
    assert wire.COMM_BUCKET_MB == LionCubConfig().comm_bucket_mb
    assert wire.WINDOW == WINDOW
    for mb in (1e-3, 0.1, 1, 4.5, 25, 100):
        assert wire.bucket_numel(mb) == LionCubConfig(bucket_size_mb=mb).bucket_numel
    for n in (1, 7, 8, 9, 1000, 10**15 + 3):
        for w in WORLDS:
            assert wire.padded_numel(n, w) == padded_numel(n, w)


@pytest.mark.parametrize("seed", range(12))
def test_buckets_and_batches_are_the_layouts(seed):
    rng = random.Random(100 + seed)
    sizes = _sizes(seed)
    mb, world = rng.choice([0.01, 0.1, 1.0, 4.0, 25.0]), rng.choice((1, 2, 4, 8, 64))
    cfg = LionCubConfig(comm="1bit", bucket_size_mb=mb)
    params = [torch.empty(n, device="meta", requires_grad=True) for n in sizes]
    buckets, _ = build_buckets([{"params": params}], cfg.bucket_numel, world)
    assign_algorithms(buckets, cfg, world)
    runs = wire.bucket_runs(wire.runs_of(sizes), mb, world)
    assert _expand(runs) == [b.numel for b in buckets]
    assert wire.batch_count(runs) == len(comm_batches(buckets, cfg.comm_bucket_mb, world))


@pytest.mark.parametrize("seed", range(12))
def test_ring_slots_are_the_runtimes(seed):
    """The ring of whole-bucket step buffers (node voters, master-only sharding): slot sizes over
    the buckets in either order the runtime takes them, with fewer and more buckets than slots."""
    rng = random.Random(200 + seed)
    sizes = _sizes(seed)
    mb, world = rng.choice([0.01, 0.1, 1.0, 25.0]), rng.choice((1, 2, 8))
    params = [torch.empty(n, device="meta", dtype=torch.bfloat16, requires_grad=True) for n in sizes]
    buckets, _ = build_buckets([{"params": params}], LionCubConfig(bucket_size_mb=mb).bucket_numel, world)
    runs = wire.bucket_runs(wire.runs_of(sizes), mb, world)
    for order in (buckets, buckets[::-1]):
        want = ring_capacity(order)
        got = wire.ring_slot_numels(runs if order is buckets else runs[::-1])
        assert [2 * n for n in got] == want, (len(buckets), got, want)


@pytest.mark.parametrize("seed", range(12))
def test_pack_is_the_greedy_packing_of_the_expanded_items(seed):
    """``sync_chunks`` packs item by item; the runs give the same bins without expanding them."""
    rng = random.Random(seed)
    sizes = _sizes(seed)
    for cap in (1, 8, 1000, 65_536, 1_000_000, 10**7, rng.randint(1, 5_000_000)):
        want = [sum(sizes[i] for i in chunk) for chunk in sync_chunks(sizes, cap)]
        assert _expand(wire.pack(wire.runs_of(sizes), cap)) == want
        assert _expand(wire.sync_chunk_runs(wire.runs_of(sizes), 25.0)) == \
            [sum(sizes[i] for i in c) for c in sync_chunks(sizes, wire.bucket_numel(25.0))]


def test_pack_keeps_a_huge_run_a_few_runs():
    chunk, count = 4 * 2**20, 10**15 // (4 * 2**20)
    # a bin holds one chunk (two exceed 6M); the small tensor joins the last chunk's bin
    assert wire.pack([(chunk, count), (12_345, 1)], 6 * 2**20) == [(chunk, count - 1), (chunk + 12_345, 1)]
    assert wire.pack([(chunk, count)], 10**18) == [(chunk * count, 1)]


def test_vote_flag_and_sync_bytes_are_the_runtimes():
    vote = onebit.OneBitVote()
    for w in WORLDS[1:]:
        for numel in (8 * w, 8 * w * 3, padded_numel(1_000_003, w), padded_numel(7 * 2**20, w)):
            assert wire.onebit_wire_bytes(numel, w) == vote.wire_bytes(numel, w, mode="list")
        for n_buckets in (0, 1, 2, 3, 17, 10_000):
            assert wire.flag_words(n_buckets, w) == flag_words(n_buckets, w)
            for carried in (True, False):
                assert wire.flag_bytes(n_buckets, w, carried) == flag_bytes(n_buckets, w, carried)
        for numel in (1, 7, 1000, 1_000_003):
            for dtype in ("fp32", "bf16", "int8"):
                assert wire.sync_wire_bytes(numel, w, dtype) == sync_wire_bytes(numel, w, dtype)
    sizes = _sizes(3)
    for w in (2, 8, 64):
        chunks = wire.sync_chunk_runs(wire.runs_of(sizes), 1.0)
        assert sum(c * wire.sync_wire_bytes(n, w, "int8") for n, c in chunks) == \
            sync_bytes(sizes, w, "int8", wire.bucket_numel(1.0))


def test_node_group_bytes_are_the_runtimes():
    for L in (2, 4, 8):
        for ranks in (L, 4 * L, PACKED_BELOW + L):
            runs = wire.bucket_runs(wire.runs_of(_sizes(5)), 0.1, ranks)
            for wg, wp in ((4, 4), (2, 2), (4, 2)):
                want = node_group_bytes([(n, wg, wp) for n in _expand(runs)], L, ranks)
                assert wire.node_group_bytes(runs, wg, wp, L, ranks) == want
