"""Vote layouts the small test models never reach, on real gloo ranks.

* Abstention lists (comm/abstain.py) exist only in buckets of >= 1024·N vote bytes; the small
  models' buckets have none. A list column that starts at a byte offset not divisible by 4
  (pbit's 2-bit lanes over an odd number of plane bytes at N = 3; any comm when the vote group
  has one rank, Nn = 1 node voters, and the shard's plane is an odd number of bytes) must decode.
* ``bbit`` (b >= 2) has a zero code: Σq = 0 ties happen at an odd N too, and with
  ``tie_break="zero"`` such a coordinate must not move (phase 2 carries the result's nonzero
  plane, as for an even N).
"""
from __future__ import annotations

import pytest
import torch

import lioncub_ds
from dist_helpers import run_ranks

pytestmark = pytest.mark.dist

LR = 1e-3


def _one_step(rank, n, numel, zeros_by_rank, kwargs):
    """One step from the same start and gradient on every rank, except for exact zeros at
    ``zeros_by_rank[rank]``: (parameters after, the gradient's sign with the zeros of every rank)."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(numel, generator=gen))
    g = torch.randn(numel, generator=gen)
    start = p.detach().clone()
    opt = lioncub_ds.LionCub([p], lr=LR, weight_decay=0.0, bucket_size_mb=4.0, **kwargs)
    grad = g.clone()
    grad[list(zeros_by_rank.get(rank, []))] = 0.0
    p.grad = grad
    opt.step()
    return p.detach().clone(), start, g


@pytest.mark.parametrize("case", ["pbit_n3_odd_plane", "node_nn1_1bit", "node_nn1_allgather", "node_nn1_pbit"])
def test_abstention_lists_at_unaligned_offsets_decode(case):
    if case == "pbit_n3_odd_plane":
        # 24,600 = 24 x 1,025: a plane of 3,075 bytes (odd), list capacity 1; at N = 3 the lanes
        # are 2 bits, so the list column starts at byte 6,150. Rank 1 abstains at one coordinate.
        n, numel, zeros, kw = 3, 24600, {1: [100]}, dict(comm="pbit")
        nobody = []
    else:
        # 2 ranks, one node group: the vote group has one rank; each shard's plane is 1,025 bytes.
        # The same exact zero on both ranks: the node's mean is 0 there, nobody votes.
        comm = case.rsplit("_", 1)[1]
        n, numel, kw = 2, 16400, dict(comm=comm, voters="node", node_size=2)
        zeros = {0: [5, 8205], 1: [5, 8205]}
        nobody = [5, 8205]
    out = run_ranks(_one_step, n, numel, zeros, kw, timeout=300)
    after, start, g = out[0]
    for r, (p, _, _) in enumerate(out[1:], 1):
        assert torch.equal(p, after), f"rank {r} differs from rank 0"
    delta = torch.sign(g)
    delta[nobody] = 0.0   # where somebody still votes, the others' (equal) sign wins
    expected = start - LR * delta
    assert torch.equal(after, expected), (after - expected).abs().max()
    assert torch.equal(after[nobody], start[nobody])


def _bbit_delta(rank, n, numel):
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(numel, generator=gen))
    g = torch.randn(numel, generator=gen)   # the same on every rank: c has one sign everywhere
    start = p.detach().clone()
    opt = lioncub_ds.LionCub([p], lr=LR, weight_decay=0.0, comm="bbit", quant="l1", vote_bits=2,
                             tie_break="zero")
    p.grad = g
    opt.step()
    return torch.round((start - p.detach()) / LR), g


@pytest.mark.parametrize("n", [1, 3])
def test_bbit_zero_sum_ties_do_not_move_at_an_odd_number_of_voters(n):
    """Every rank's dithered ternary code has c's sign or is 0, so Σq has c's sign or is 0: Δ is
    sign(c) or 0, never the opposite (the bug: Σq = 0 read as Δ = −1 at an odd N). n = 1 runs
    as node voters with one group of two ranks (one voter)."""
    numel = 4099
    if n == 1:
        out = run_ranks(_bbit_node_delta, 2, numel, timeout=300)
    else:
        out = run_ranks(_bbit_delta, n, numel, timeout=300)
    delta, g = out[0]
    for r, (d, _) in enumerate(out[1:], 1):
        assert torch.equal(d, delta), f"rank {r} differs from rank 0"
    assert set(delta.unique().tolist()) <= {-1.0, 0.0, 1.0}
    assert int((delta * torch.sign(g) < 0).sum()) == 0, "a Σq = 0 tie moved against c"
    assert int((delta == 0).sum()) > 0 and int((delta != 0).sum()) > 0  # the case happened


def _bbit_node_delta(rank, n, numel):
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(numel, generator=gen))
    g = torch.randn(numel, generator=gen)
    start = p.detach().clone()
    opt = lioncub_ds.LionCub([p], lr=LR, weight_decay=0.0, comm="bbit", quant="l1", vote_bits=2,
                             tie_break="zero", voters="node", node_size=2)
    p.grad = g
    opt.step()
    return torch.round((start - p.detach()) / LR), g


@pytest.mark.unit
@pytest.mark.parametrize("rows,width,start,cols", [(1, 14517, 4, 12), (1, 14517, 1025, 12), (3, 1037, 1025, 12),
                                                   (2, 64, 8, 16), (1, 16, 0, 16)])
def test_list_columns_read_as_words_at_any_offset_and_row_stride(rows, width, start, cols):
    """uint8 columns of a received message -> int32 words, equal to reading the bytes little-endian,
    whatever the column's offset and the message's row length (a one-row slice is 'contiguous'
    with any row stride, and viewing it as int32 raised)."""
    from lioncub_ds.comm.abstain import words_of
    msg = torch.randint(0, 256, (rows, width), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    msg = msg.to(torch.uint8)
    col = msg[:, start:start + cols]
    b = col.to(torch.int64)
    want = (b[:, 0::4] | b[:, 1::4] << 8 | b[:, 2::4] << 16 | b[:, 3::4] << 24).to(torch.int64)
    want = torch.where(want >= 2 ** 31, want - 2 ** 32, want).to(torch.int32)
    assert torch.equal(words_of(col), want)
