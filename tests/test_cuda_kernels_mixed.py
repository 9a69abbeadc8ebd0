"""The CUDA kernels on buckets whose tensors differ in dtype, in alignment and in size, against the
reference, bit for bit (host emulation; the real kernels on a GPU).

The kernels pick a body compiled for the dtypes once per chunk (chunked kernels) or convert each unit in
the body of its dtype, and a thread loads 2-4 units before it computes and stores any of them, on the
vector path only when every unit of its round is whole and 16-byte aligned. These tests make one
thread's units fall into tensors of different dtypes (fp32 / bf16 / fp16 in one bucket), into storage-
offset views (unaligned starts), into a tensor's last partial unit and into gaps, on an emulated device
of one SM (every grid-stride loop goes round many times).
"""
from __future__ import annotations

import pytest
import torch

from emu_backend import EmuBackend
from lioncub_ds import kernels
from lioncub_ds.kernels import reference
from test_cuda_kernels import layout, same

pytestmark = pytest.mark.dist  # builds the host emulation with a C++ compiler

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
REF = kernels.TorchBackend()
_NO_GPU = "needs a CUDA GPU (torch.cuda.is_available() is False); the host emulation ('emu') runs instead"

# Sizes around one grid stride of units (1 SM: a few thousand threads x 8 elements), odd, with
# tensors of every dtype in turn: a thread's two units of a round lie in different tensors.
SIZES = [13001, 7, 9000, 1, 20483, 4097, 33]
GDTS = [F32, BF16, F16, F32, BF16, F32, F16]
MDTS = [F32, F32, BF16, BF16, F32, F16, F32]
PDTS = [F32, BF16, F16, BF16, F32, F16, F32]


@pytest.fixture(params=[pytest.param("emu"),
                        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_GPU))])
def backend(request, monkeypatch):
    if request.param == "emu":
        return EmuBackend(sms=1), torch.device("cpu")
    monkeypatch.setenv("LIONCUB_KERNELS", "cuda")
    be = kernels.backend_for("cuda")
    assert be.name == "cuda"
    return be, torch.device("cuda")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def on(t, dev, unaligned):
    """t on dev; unaligned: a view whose data pointer is one element past an allocation's start."""
    if not unaligned:
        return t.clone().to(dev)
    host = torch.zeros(t.numel() + 1, dtype=t.dtype, device=dev)
    host[1:].copy_(t.to(dev))
    return host[1:]


def local_inputs(g, dev):
    grads, moms = [], []
    for n, gdt, mdt in zip(SIZES, GDTS, MDTS):
        gr = torch.randn(n, generator=g)
        m = torch.randn(n, generator=g) * 0.1
        if n >= 16:
            gr[3], gr[n - 1] = float("nan"), float("inf")
            gr[5], m[5] = 0.0, 0.0  # c exactly 0
        grads.append(gr.to(gdt))
        moms.append(m.to(mdt))
    dev_g = [on(t, dev, k == 2) for k, t in enumerate(grads)]  # tensor 2: an unaligned gradient
    dev_m = [on(t, dev, k == 4) for k, t in enumerate(moms)]  # tensor 4: an unaligned momentum
    return grads, moms, dev_g, dev_m


def test_local_step_mixed_dtypes(backend):
    be, dev = backend
    grads, moms, dev_g, dev_m = local_inputs(gen(1), dev)
    offsets, total = layout(SIZES, 4)
    for update in (False, True):
        ref_m = [m.clone() for m in moms]
        got = be.local_step(dev_g, dev_m, offsets, total, 0.9, 0.99, update_momentum=update)
        ref = REF.local_step(grads, ref_m, offsets, total, 0.9, 0.99, update_momentum=update)
        same(got[0], ref[0], f"sign plane (update={update})")
        same(got[1], ref[1], f"nonzero plane (update={update})")
        assert (got[2], got[3]) == (ref[2], ref[3])
        for k, (a, b) in enumerate(zip(dev_m, ref_m)):
            same(a, b, f"momentum {k} (update={update})")
        moms = ref_m


def test_momentum_update_mixed_dtypes(backend):
    be, dev = backend
    grads, moms, dev_g, dev_m = local_inputs(gen(2), dev)
    be.momentum_update_list(dev_m, dev_g, 0.98)
    REF.momentum_update_list(moms, grads, 0.98)
    for k, (a, b) in enumerate(zip(dev_m, moms)):
        same(a, b, f"momentum {k}")


@pytest.mark.parametrize("kind", ["l1", "l0", "linf"])
def test_int8_local_step_mixed_dtypes(backend, kind):
    be, dev = backend
    grads, moms, dev_g, dev_m = local_inputs(gen(3), dev)
    offsets, total = layout(SIZES, 8)
    q, n_bad = be.int8_local_step(dev_g, dev_m, offsets, total, 0.9, kind, reference.int8_levels(8))
    ref_q, ref_bad = REF.int8_local_step(grads, moms, offsets, total, 0.9, kind, reference.int8_levels(8))
    assert n_bad == ref_bad
    same(q, ref_q, f"int8 codes ({kind})")


@pytest.mark.parametrize("bits,rounding", [(1, "nearest"), (2, "dither"), (3, "nearest"), (4, "dither")])
def test_bbit_local_step_mixed_dtypes(backend, bits, rounding):
    be, dev = backend
    grads, moms, dev_g, dev_m = local_inputs(gen(4 + bits), dev)
    offsets, total = layout(SIZES, 4)
    segs = reference.tie_segments(offsets, [7, 2**32 - 5, 0, 3, 11, 0, 5])
    seed = reference.dither_seed(5, 1)
    ref_m = [m.clone() for m in moms]
    got = be.bbit_local_step(dev_g, dev_m, offsets, total, 0.9, 0.99, "l1", bits, rounding, seed, segs,
                             update_momentum=True)
    ref = REF.bbit_local_step(grads, ref_m, offsets, total, 0.9, 0.99, "l1", bits, rounding, seed, segs,
                              update_momentum=True)
    same(got[0], ref[0], "code planes")
    same(got[1], ref[1], "nonzero plane")
    assert (got[2], got[3]) == (ref[2], ref[3])
    for k, (a, b) in enumerate(zip(dev_m, ref_m)):
        same(a, b, f"momentum {k}")


def params(g, dev):
    ref = [torch.randn(n, generator=g).to(dt) for n, dt in zip(SIZES, PDTS)]
    return [on(t, dev, k == 1) for k, t in enumerate(ref)], ref  # tensor 1: an unaligned bf16 parameter


@pytest.mark.parametrize("n,tie,vote", [(4, "hash", "majority"), (2, "alternate", "majority"), (3, "zero", "average"),
                                        (20, "hash", "majority"), (20, "zero", "average")])
def test_vote_apply_mixed_dtypes(backend, n, tie, vote):
    be, dev = backend
    g = gen(10 + n)
    offsets, total = layout(SIZES, n)
    sign = torch.randint(0, 256, (n, total // 8), generator=g, dtype=torch.int32).to(torch.uint8)
    nz = torch.randint(0, 256, (n, total // 8), generator=g, dtype=torch.int32).to(torch.uint8) | sign
    dev_p, ref_p = params(g, dev)
    kw = dict(lr=1e-3, weight_decay=0.1, step=5, tie_break=tie, vote=vote, world_size=n)
    same(be.vote_apply(sign.to(dev), nz.to(dev), dev_p, offsets, **kw), REF.vote_apply(sign, nz, ref_p, offsets, **kw),
         "delta")
    for k, (a, b) in enumerate(zip(dev_p, ref_p)):
        same(a, b, f"param {k}")


@pytest.mark.parametrize("p,tie", [(2, "hash"), (4, "zero")])
def test_lanes_apply_mixed_dtypes(backend, p, tie):
    be, dev = backend
    g = gen(20 + p)
    n = 3
    offsets, total = layout(SIZES, n)
    cnt = torch.randint(0, n + 1, (total,), generator=g)
    plus = (torch.rand(total, generator=g) * (cnt + 1).float()).floor().clamp_(max=cnt.float()).to(torch.int64)
    plus_l, cnt_l = reference.pack_lanes(plus, p), reference.pack_lanes(cnt, p)
    dev_p, ref_p = params(g, dev)
    kw = dict(lr=3e-4, weight_decay=0.5, step=9, tie_break=tie, vote="majority")
    same(be.lanes_apply(plus_l.to(dev), cnt_l.to(dev), n, p, dev_p, offsets, **kw),
         REF.lanes_apply(plus_l, cnt_l, n, p, ref_p, offsets, **kw), "delta")
    for k, (a, b) in enumerate(zip(dev_p, ref_p)):
        same(a, b, f"param {k}")


def test_int8_apply_mixed_dtypes(backend):
    be, dev = backend
    g = gen(30)
    offsets, total = layout(SIZES, 8)
    qsum = torch.randint(-127, 128, (total,), generator=g).to(torch.int8)
    qsum[::5] = 0
    dev_p, ref_p = params(g, dev)
    same(be.int8_apply(qsum.to(dev), dev_p, offsets, 1e-3, 0.1), REF.int8_apply(qsum, ref_p, offsets, 1e-3, 0.1),
         "delta")
    for k, (a, b) in enumerate(zip(dev_p, ref_p)):
        same(a, b, f"param {k}")


def test_lion_step_mixed_dtypes(backend):
    """Every (param, grad, momentum) dtype combination in one list: the compiled bodies and the run-time
    one, aligned and unaligned tensors, sizes that end inside a thread's round."""
    be, dev = backend
    g = gen(40)
    combos = [(p, gr, m) for p in (F32, BF16, F16) for gr in (F32, BF16, F16) for m in (F32, BF16)]
    sizes = [16384 + 5 + 77 * k for k in range(len(combos))]
    ref_p = [torch.randn(n, generator=g).to(c[0]) for n, c in zip(sizes, combos)]
    ref_g = [torch.randn(n, generator=g).to(c[1]) for n, c in zip(sizes, combos)]
    ref_m = [(torch.randn(n, generator=g) * 0.1).to(c[2]) for n, c in zip(sizes, combos)]
    dev_p = [on(t, dev, k % 3 == 1) for k, t in enumerate(ref_p)]
    dev_g = [on(t, dev, k % 4 == 2) for k, t in enumerate(ref_g)]
    dev_m = [on(t, dev, k % 5 == 3) for k, t in enumerate(ref_m)]
    for step in range(2):
        be.lion_step(dev_p, dev_g, dev_m, 1e-3, 0.1, 0.9, 0.99)
        REF.lion_step(ref_p, ref_g, ref_m, 1e-3, 0.1, 0.9, 0.99)
        for k in range(len(sizes)):
            same(dev_p[k], ref_p[k], f"param {k} {combos[k]} (step {step})")
            same(dev_m[k], ref_m[k], f"momentum {k} {combos[k]} (step {step})")
