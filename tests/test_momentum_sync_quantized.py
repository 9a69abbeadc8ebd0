"""Momentum sync in bf16 and int8 (momentum_sync={"dtype": ...}): the codec, the reference average,
and the two-phase collective on real gloo ranks against that reference (bit for bit, at odd sizes
and N that do not divide them), with its bytes."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lioncub_ds
from lioncub_ds import LionCubConfigError
from lioncub_ds.config import LionCubConfig
from lioncub_ds.momentum_sync import (MomentumSync, quantized_average, sync_decode, sync_encode, sync_wire_bytes)
from dist_helpers import run_ranks

pytestmark = pytest.mark.unit  # the tests on ranks are marked dist


def _rows(n, length, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, length, generator=g) * torch.logspace(-3, 1, n).view(-1, 1)
    if length > 3:
        x[:, :3] = 0.0
    return x


@pytest.mark.parametrize("length", (1, 7, 61, 1003))
def test_codec(length):
    x = _rows(3, length, length)
    bf = sync_decode(sync_encode(x, "bf16"), "bf16")
    assert torch.equal(bf, x.to(torch.bfloat16).float())
    enc = sync_encode(x, "int8")
    assert enc.dtype == torch.uint8 and enc.shape == (3, length + 4)
    back = sync_decode(enc, "int8")
    a = x.abs().amax(dim=1, keepdim=True)
    assert bool(((back - x).abs() <= a / 254 * 1.0001 + 1e-12).all())  # half a level
    assert torch.equal(back.abs().amax(dim=1, keepdim=True), a)  # the max is exact
    zero = sync_decode(sync_encode(torch.zeros(2, length), "int8"), "int8")
    assert torch.equal(zero, torch.zeros(2, length))


@pytest.mark.parametrize("dtype,tol", (("bf16", 2 ** -7), ("int8", 2 / 127)))
@pytest.mark.parametrize("n", (1, 2, 3, 5))
def test_reference_average_is_close_to_the_mean(dtype, tol, n):
    x = _rows(n, 1003, 5 + n)
    avg = quantized_average(x, dtype)
    exact = x.mean(0)
    scale = x.abs().amax()
    assert float((avg - exact).abs().max()) <= tol * float(scale)
    assert torch.equal(avg[:3], torch.zeros(3))


def test_dtype_setting():
    assert LionCubConfig.from_kwargs(momentum_sync={"every": 5, "dtype": "int8"}).momentum_sync.dtype == "int8"
    assert LionCubConfig.from_kwargs(momentum_sync={"every": 5}).momentum_sync.dtype == "fp32"
    with pytest.raises(LionCubConfigError, match=r"momentum_sync.dtype='fp16'.*'fp32' \| 'bf16' \| 'int8'"):
        LionCubConfig.from_kwargs(momentum_sync={"every": 5, "dtype": "fp16"})


@pytest.mark.parametrize("n,length", [(2, 6), (3, 7), (4, 1003)])
def test_wire_bytes_formula(n, length):
    assert sync_wire_bytes(length, n, "fp32") == 2 * (n - 1) * 4 * length // n
    shard = -(-length // n)
    assert sync_wire_bytes(length, n, "bf16") == 2 * (n - 1) * 2 * shard
    assert sync_wire_bytes(length, n, "int8") == 2 * (n - 1) * (shard + 4)


def _sync_on_ranks(rank, n):
    """Per dtype: this rank's momenta after average_over (small chunks: several collectives, sizes
    not multiples of N), every rank's momenta before (for the reference), and the bytes counted."""
    from lioncub_ds.comm.base import Collectives
    from lioncub_ds.telemetry import CommStats

    out = {}
    for dtype in ("bf16", "int8"):
        g = torch.Generator().manual_seed(100 + rank)
        momenta = [torch.randn(s, generator=g) * (rank + 1) for s in (5, 13, 1, 29)]
        momenta.append(torch.randn(3, 7, generator=g).to(torch.bfloat16))  # a bf16 momentum
        flat = torch.cat([m.float().reshape(-1) for m in momenta])
        every = [torch.zeros_like(flat) for _ in range(n)]
        dist.all_gather(every, flat)
        stats = CommStats()
        coll = Collectives(None, stats, None)
        MomentumSync.average_over(coll, momenta, chunk_numel=20, dtype=dtype)
        out[dtype] = (torch.stack(every), [m.clone() for m in momenta],
                      stats.snapshot()["cumulative"]["bytes_sent"])
    return out


@pytest.mark.dist
@pytest.mark.parametrize("n", (2, 3))
def test_two_phase_sync_equals_the_reference_on_real_ranks(n):
    res = run_ranks(_sync_on_ranks, n, timeout=300)
    sizes = (5, 13, 1, 29, 21)
    chunks = [[0, 1, 2], [3], [4]]  # chunk_numel=20: 5+13+1 fit, 29 alone, 21 alone
    for dtype in ("bf16", "int8"):
        before = res[0][dtype][0]
        offs = [sum(sizes[:i]) for i in range(len(sizes))]
        want_bytes = 0
        for chunk in chunks:
            lo, hi = offs[chunk[0]], offs[chunk[-1]] + sizes[chunk[-1]]
            expect = quantized_average(before[:, lo:hi], dtype)
            want_bytes += sync_wire_bytes(hi - lo, n, dtype)
            for r in range(n):
                got = torch.cat([res[r][dtype][1][i].float().reshape(-1) for i in chunk])
                if chunk == [4]:  # a bf16 momentum stores the average rounded to bf16
                    assert torch.equal(got, expect.to(torch.bfloat16).float()), (dtype, r)
                else:
                    assert torch.equal(got, expect), (dtype, chunk, r)
        for r in range(n):
            assert res[r][dtype][2] == want_bytes, (dtype, r)


def _lioncub_sync_dtype(rank, n):
    out = {}
    for dtype in ("fp32", "bf16", "int8"):
        torch.manual_seed(0)
        model = torch.nn.Linear(7, 5)
        opt = lioncub_ds.LionCub(model.parameters(), lr=1e-2, comm="1bit", momentum_sync={"every": 2, "dtype": dtype})
        g = torch.Generator().manual_seed(rank)
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(3, 7, generator=g)).pow(2).mean().backward()
            opt.step()
        st = opt.comm_stats()["cumulative"]["by_algorithm"]
        out[dtype] = (torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in model.parameters()]),
                      st.get("momentum_sync", 0), torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return out


@pytest.mark.dist
def test_lioncub_momentum_sync_dtype_on_real_ranks():
    """The setting reaches the step: after a sync step every rank holds the same momenta; bf16 costs
    about half, int8 about a quarter of the fp32 sync's bytes; replicas stay identical."""
    n = 2
    res = run_ranks(_lioncub_sync_dtype, n, timeout=300)
    for dtype in ("fp32", "bf16", "int8"):
        # steps 0 and 2 synced (every=2); step 3 is not a sync step, so compare after the last sync via
        # the parameters (identical) and the byte counts
        assert torch.equal(res[0][dtype][2], res[1][dtype][2]), dtype
    fp32, bf16, int8 = (res[0][d][1] for d in ("fp32", "bf16", "int8"))
    assert fp32 > 0 and bf16 == pytest.approx(fp32 / 2, rel=0.1) and int8 < fp32 / 3
