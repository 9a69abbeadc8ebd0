"""The fused CUDA kernels against the pure-torch reference (lioncub_ds/kernels/reference.py).

Every test runs against two backends with the TorchBackend signatures:

* ``cuda``: ``lioncub_ds.kernels.backend_for('cuda')`` with ``LIONCUB_KERNELS=cuda`` (the
  built extension, CUDA tensors). Skipped when ``torch.cuda.is_available()`` is False; in
  ``make gpu-check`` such a skip counts as a failure.
* ``emu``: the host emulation (tests/emu_backend.py, tests/cuda_emu/): csrc/cuda/*.cu compiled
  by the host C++ compiler and run on an emulated device, through the kernels' own C API
  (csrc/cuda/lioncub_cuda.h) on CPU tensors. The real kernels run there -- their launch
  configuration, grid-stride loops, shared memory, __syncthreads and warp shuffles -- with each
  CUDA thread a fiber. Needs only a C++ compiler.

The reference always runs on CPU copies of the same data. Bits, lanes, int8 codes (all
three scales: the l1/l0 sums follow the project's own order, csrc/common) and counts
must match bit for bit and floats exactly (NaN matches NaN).

What the emulation cannot see (tests/cuda_emu/lioncub_cuda_emu.cpp, docs/kernels.md): true
concurrency (races, memory ordering), the device compiler's code and intrinsics, the CUDA
runtime and the torch bindings. Run this file on a GPU (the ``cuda`` backend: ``make gpu-check``)
before trusting a change to the .cu files.
"""
from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest
import torch

from emu_backend import DTYPE_CODE, EmuBackend
from lioncub_ds import kernels
from lioncub_ds.kernels import reference
from test_kernels_cpu import TIE_PARAMS, bucket_planes  # the same parameters and bucket planes as the C++ tie tests

pytestmark = pytest.mark.dist  # builds the host emulation with a C++ compiler

BIG = 1048579  # the large odd size of the GPU runs
BIG_EMU = 65539    # its stand-in for the (serial) host emulation: still > 4 chunks of LC_CHUNK


# ----------------------------------------------------------------------------- fixtures
_NO_GPU = "needs a CUDA GPU (torch.cuda.is_available() is False); the host emulation ('emu') runs instead"


@pytest.fixture(params=[pytest.param("emu"),
                        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_GPU))])
def backend(request, monkeypatch):
    """(backend, device, big size): the CUDA extension on 'cuda', the host emulation on 'cpu'."""
    if request.param == "emu":
        return EmuBackend(), torch.device("cpu"), BIG_EMU
    monkeypatch.setenv("LIONCUB_KERNELS", "cuda")
    be = kernels.backend_for("cuda")  # LIONCUB_KERNELS=cuda: must build/load, never falls back
    assert be.name == "cuda", f"expected the CUDA backend, got {be.name!r}"
    return be, torch.device("cuda"), BIG


REF = kernels.TorchBackend()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def same(a: torch.Tensor, b: torch.Tensor, what: str):
    """Bit-for-bit equality on CPU copies; NaN equals NaN (any payload)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if a.is_floating_point():
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        assert torch.equal(nan_a, nan_b), f"{what}: NaN positions differ"
        ia = a.view(torch.int32 if a.element_size() == 4 else torch.int16)
        ib = b.view(torch.int32 if b.element_size() == 4 else torch.int16)
        bad = (ia != ib) & ~nan_a
    else:
        bad = a != b
    if bool(bad.any()):
        idx = torch.nonzero(bad.reshape(-1))[:5].reshape(-1).tolist()
        fa, fb = a.reshape(-1), b.reshape(-1)
        raise AssertionError(f"{what}: {int(bad.sum())} of {a.numel()} differ, first at {idx}: "
                             f"{[fa[i].item() for i in idx]} vs ref {[fb[i].item() for i in idx]}")


def layout(sizes, world, gap=8):
    """Offsets (multiples of 8, with gaps) and the padded bucket size for tensors of `sizes`."""
    offsets, cur = [], 0
    for n in sizes:
        offsets.append(cur)
        cur = (cur + n + 7) // 8 * 8 + gap
    return offsets, reference.padded_numel(cur, world)


def rand_tensors(sizes, dtype, g, planted=True, scale=1.0):
    out = []
    for n in sizes:
        t = torch.randn(n, generator=g) * scale
        if planted and n >= 7:
            t[1] = 0.0
            t[n // 2] = 0.0
        out.append(t.to(dtype))
    return out


def plant_nonfinite(grads):
    for t in grads:
        n = t.numel()
        if n >= 9:
            t[3] = float("nan")
            t[5] = float("inf")
            t[n - 1] = float("-inf")


def local_inputs(sizes, gdt, mdt, g):
    """CPU grads with planted NaN/+-Inf and momenta (scale 0.1), both 0 at each tensor's last
    element: an exact zero of c there."""
    grads = rand_tensors(sizes, gdt, g)
    plant_nonfinite(grads)
    moms = rand_tensors(sizes, mdt, g, scale=0.1)
    for gr, m in zip(grads, moms):
        gr[-1:] = 0.0
        m[-1:] = 0.0
    return grads, moms


def to(ts, device):
    return [t.to(device) for t in ts]


def make_params(sizes, dtype, g, device):
    """Params on `device` and CPU reference copies; one of them a storage-offset view."""
    cpu = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    dev = []
    for k, t in enumerate(cpu):
        if k == 1:  # a view whose data pointer is 4 (fp32) / 2 (bf16) bytes past an aligned one
            host = torch.zeros(t.numel() + 1, dtype=dtype, device=device)
            v = host[1:]
            v.copy_(t.to(device))
            dev.append(v)
        else:
            dev.append(t.clone().to(device))
    return dev, [t.clone() for t in cpu]


# ----------------------------------------------------------------------------- local step
@pytest.mark.parametrize("gdt,mdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                     (torch.float16, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("update", [False, True])
def test_local_step(backend, gdt, mdt, update):
    be, dev, big = backend
    g = gen(1)
    sizes = [1, 7, 9, 4097, big] if update else [9, 1, 4097, 7]
    grads, moms = local_inputs(sizes, gdt, mdt, g)
    offsets, total = layout(sizes, 4)
    ref_m = [m.clone() for m in moms]
    dev_m = to(moms, dev)
    got = be.local_step(to(grads, dev), dev_m, offsets, total, 0.9, 0.99, update_momentum=update)
    ref = REF.local_step(grads, ref_m, offsets, total, 0.9, 0.99, update_momentum=update)
    same(got[0], ref[0], "sign plane")
    same(got[1], ref[1], "nonzero plane")
    assert (got[2], got[3]) == (ref[2], ref[3]), "non-finite / zero counts"
    for k, (a, b) in enumerate(zip(dev_m, ref_m)):
        same(a, b, f"momentum {k}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_GPU)
@pytest.mark.parametrize("gdt,mdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                     (torch.float16, torch.float32)])
def test_local_step_momenta_out(monkeypatch, gdt, mdt):
    """momentum_double_buffer on CUDA: the in-place call's votes and new momenta, written to
    momenta_out, the momenta untouched."""
    monkeypatch.setenv("LIONCUB_KERNELS", "cuda")
    be = kernels.backend_for("cuda")
    g = gen(5)
    sizes = [1, 7, 9, 4097, BIG]
    grads, moms = local_inputs(sizes, gdt, mdt, g)
    offsets, total = layout(sizes, 4)
    ref_m = [m.clone() for m in moms]
    ref = REF.local_step(grads, ref_m, offsets, total, 0.9, 0.99, update_momentum=True)
    dev_m = to(moms, "cuda")
    outs = [torch.full_like(m, 3.0) for m in dev_m]
    got = be.local_step(to(grads, "cuda"), dev_m, offsets, total, 0.9, 0.99, True, momenta_out=outs)
    same(got[0], ref[0], "sign plane")
    same(got[1], ref[1], "nonzero plane")
    assert (got[2], got[3]) == (ref[2], ref[3])
    for k in range(len(sizes)):
        same(outs[k], ref_m[k], f"momenta_out {k}")
        same(dev_m[k], moms[k], f"momentum {k} (unchanged)")


def test_local_step_empty_bucket_and_gaps(backend):
    be, dev, big = backend
    g = gen(2)
    sizes = [16, 3]
    grads, moms = rand_tensors(sizes, torch.float32, g), rand_tensors(sizes, torch.float32, g)
    offsets = [64, 8]  # unsorted offsets, a gap at the start and between the tensors
    total = 128
    got = be.local_step(to(grads, dev), to(moms, dev), offsets, total, 0.95, 0.98)
    ref = REF.local_step(grads, [m.clone() for m in moms], offsets, total, 0.95, 0.98)
    same(got[0], ref[0], "sign plane")
    same(got[1], ref[1], "nonzero plane")
    assert got[2:] == ref[2:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_GPU)
def test_local_step_never_synchronizes_with_device_counts(monkeypatch):
    """The optimizer's local half of a step on CUDA (local_step / int8_local_step with
    device_counts=True, then the abstention payload) issues no host synchronization:
    torch's sync debug mode turns any into an error. The counts still equal the reference's."""
    from lioncub_ds.comm.abstain import list_capacity, real_mask

    monkeypatch.setenv("LIONCUB_KERNELS", "cuda")
    be = kernels.backend_for("cuda")
    g = gen(11)
    sizes = [7, 4097, 9, 1]
    grads, moms = local_inputs(sizes, torch.bfloat16, torch.float32, g)
    offsets, total = layout(sizes, 4)
    d_grads, d_moms = to(grads, "cuda"), to(moms, "cuda")
    mask = real_mask(offsets, sizes, total, "cuda")
    cap = list_capacity(total // 8, 4)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sign, nz, n_bad, n_zero = be.local_step(d_grads, d_moms, offsets, total, 0.9, 0.99, device_counts=True)
        payload = be.abstain_list(nz, mask, cap)
        q, q_bad = be.int8_local_step(d_grads, d_moms, offsets, total, 0.9, "l1", 3, device_counts=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref = REF.local_step(grads, [m.clone() for m in moms], offsets, total, 0.9, 0.99)
    same(sign, ref[0], "sign plane")
    same(nz, ref[1], "nonzero plane")
    assert (int(n_bad), int(n_zero)) == (ref[2], ref[3])
    assert int(q_bad) == REF.int8_local_step(grads, moms, offsets, total, 0.9, "l1", 3)[1]
    same(payload, REF.abstain_list(ref[1], mask.cpu(), cap), "abstention list")
    assert payload.is_cuda and q.is_cuda


@pytest.mark.parametrize("gdt,mdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                     (torch.float16, torch.float32)])
def test_momentum_update_list(backend, gdt, mdt):
    be, dev, big = backend
    g = gen(3)
    sizes = [big, 7, 1, 4097, 9]
    grads = rand_tensors(sizes, gdt, g)
    plant_nonfinite(grads)
    moms = rand_tensors(sizes, mdt, g)
    dev_m = to(moms, dev)
    be.momentum_update_list(dev_m, to(grads, dev), 0.98)
    REF.momentum_update_list(moms, grads, 0.98)
    for k, (a, b) in enumerate(zip(dev_m, moms)):
        same(a, b, f"momentum {k}")


# ----------------------------------------------------------------------------- votes
def rand_planes(n_rows, nbytes, g, nz_density=0.8):
    sign = torch.randint(0, 256, (n_rows, nbytes), generator=g, dtype=torch.int32).to(torch.uint8)
    bits = (torch.rand(n_rows, nbytes * 8, generator=g) < nz_density).to(torch.uint8)
    return sign, reference.pack_bits(bits.reshape(-1)).reshape(n_rows, nbytes)


VOTE_CASES = [(n, tie, vote) for n in (1, 2, 3, 4, 7, 8) for tie, vote in
              (("zero", "majority"), ("alternate", "majority"), ("hash", "majority"), ("zero", "average"))]


@pytest.mark.parametrize("n,tie,vote", VOTE_CASES)
@pytest.mark.parametrize("pdt,with_nz", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True),
                                         (torch.float16, True)])
def test_vote_apply(backend, n, tie, vote, pdt, with_nz):
    be, dev, big = backend
    g = gen(10 + n)
    sizes = [4097, 1, 9, 7] if n != 8 else [big, 7, 1, 9]
    offsets, total = layout(sizes, n)
    sign, nz = rand_planes(n, total // 8, g)
    if not with_nz:
        nz = None
    dev_p, ref_p = make_params(sizes, pdt, g, dev)
    for step in (3, 4):
        kw = dict(lr=1e-3, weight_decay=0.1 if step == 3 else 0.0, step=step, tie_break=tie, vote=vote,
                  world_size=n, segments=None if step == 3 else reference.tie_segments(offsets, [12345, 0, 2**32 - 3, 5]))
        d_got = be.vote_apply(sign.to(dev), None if nz is None else nz.to(dev), dev_p, offsets, **kw)
        d_ref = REF.vote_apply(sign, nz, ref_p, offsets, **kw)
        same(d_got, d_ref, f"delta (step {step})")
        for k, (a, b) in enumerate(zip(dev_p, ref_p)):
            same(a, b, f"param {k} (step {step})")


def test_vote_apply_one_dim_plane(backend):
    be, dev, big = backend
    g = gen(5)
    sizes = [9, 20]
    offsets, total = layout(sizes, 1)
    sign, _ = rand_planes(1, total // 8, g)
    dev_p, ref_p = make_params(sizes, torch.float32, g, dev)
    kw = dict(lr=1e-2, weight_decay=0.0, step=1, tie_break="zero", vote="majority", world_size=1)
    same(be.vote_apply(sign.reshape(-1).to(dev), None, dev_p, offsets, **kw),
         REF.vote_apply(sign.reshape(-1), None, ref_p, offsets, **kw), "delta")
    for a, b in zip(dev_p, ref_p):
        same(a, b, "param")


SHARD_CASES = ([(n, tie, nz, nb) for n in (1, 2, 3, 4, 7, 8) for tie in ("zero", "alternate", "hash")
                for nz in (False, True) for nb in (1, 7, 9, 513)]
               + [(n, tie, True, "big") for n in (2, 3, 8) for tie in ("zero", "hash")]
               + [(4, "alternate", False, "big")])


@pytest.mark.parametrize("n,tie,with_nz,nbytes", SHARD_CASES)
def test_shard_vote(backend, n, tie, with_nz, nbytes):
    be, dev, big = backend
    nbytes = big // 8 + 1 if nbytes == "big" else nbytes
    g = gen(100 + n + nbytes)
    sign, nz = rand_planes(n, nbytes, g, nz_density=0.6)
    if not with_nz:
        nz = None
    for step in (6, 7):
        segs = reference.tie_segments([0, 64, 8 * nbytes - 8], [7, 0, 3], start=40, stop=40 + 8 * nbytes)
        got = be.shard_vote(sign.to(dev), None if nz is None else nz.to(dev), step, tie, segs)
        ref = REF.shard_vote(sign, nz, step, tie, segs)
        same(got[0], ref[0], "result sign plane")
        same(got[1], ref[1], "result nonzero plane")


LANES_COUNT_CASES = ([(n, nz, nb) for n in (1, 2, 3, 4, 7, 8) for nz in (False, True) for nb in (1, 9, 4097)]
                     + [(1, False, "big"), (3, True, "big"), (8, True, "big"), (8, False, "big")])


@pytest.mark.parametrize("n,with_nz,nbytes", LANES_COUNT_CASES)
def test_count_lanes(backend, n, with_nz, nbytes):
    be, dev, big = backend
    nbytes = big // 8 + 3 if nbytes == "big" else nbytes
    g = gen(200 + n + nbytes)
    sign, nz = rand_planes(n, nbytes, g)
    if not with_nz:
        nz = None
    for p in sorted({reference.lane_bits_for(n), 4, 8}):
        if p < reference.lane_bits_for(n):
            continue
        got = be.count_lanes(sign.to(dev), None if nz is None else nz.to(dev), p)
        ref = REF.count_lanes(sign, nz, p)
        same(got[0], ref[0], f"plus lanes p={p}")
        if nz is None:
            assert got[1] is None and ref[1] is None
        else:
            same(got[1], ref[1], f"cnt lanes p={p}")


_OVERFLOW_CHECK = """
import torch
from lioncub_ds.kernels import reference

def check(be, dev):
    sign = torch.full((4, 5), 255, dtype=torch.uint8)
    nz = torch.full((4, 5), 255, dtype=torch.uint8)
    for call in (lambda: reference.count_lanes(sign, nz, 2), lambda: be.count_lanes(sign.to(dev), nz.to(dev), 2),
                 lambda: be.count_lanes(sign.to(dev), None, 2)):
        try:
            call()
        except ValueError:
            pass
        else:
            raise AssertionError("a count of 4 fit a 2-bit lane")
    nz[:, :] = 0b01010101
    nz[0] = 0  # row 0 never votes: at most 3 voters per element
    got = be.count_lanes(sign.to(dev), nz.to(dev), 2)  # max count 3 fits 2 bits: no error, as in the reference
    ref = reference.count_lanes(sign, nz, 2)
    assert torch.equal(got[0].cpu(), ref[0]) and torch.equal(got[1].cpu(), ref[1])
"""


def test_count_lanes_overflow_raises(backend):
    """A count that does not fit its lane raises a ValueError (from Python: the CUDA binding returns
    an overflow flag). The CUDA variant runs in a subprocess, so a crash fails only this test."""
    be, dev, big = backend
    if be.name == "emu":
        scope = {}
        exec(_OVERFLOW_CHECK, scope)
        scope["check"](be, dev)
        return
    code = _OVERFLOW_CHECK + "\nimport os\nos.environ['LIONCUB_KERNELS'] = 'cuda'\nfrom lioncub_ds import kernels\n" \
                             "check(kernels.backend_for('cuda'), torch.device('cuda'))\nprint('ok')\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), \
        f"rc={res.returncode} (negative: a signal, -11 = segfault)\n{res.stdout}\n{res.stderr[-4000:]}"


LANE_CASES = [(n, p, tie, vote) for n, p in ((1, 1), (2, 2), (3, 2), (4, 4), (7, 4), (8, 4), (8, 8))
              for tie, vote in (("zero", "majority"), ("hash", "majority"), ("alternate", "average"))]


@pytest.mark.parametrize("n,p,tie,vote", LANE_CASES)
@pytest.mark.parametrize("pdt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_cnt", [False, True])
def test_lanes_apply(backend, n, p, tie, vote, pdt, with_cnt):
    be, dev, big = backend
    g = gen(300 + 10 * n + p)
    sizes = [big, 9] if (p == 8 and tie == "hash") else [4097, 1, 7, 9]
    offsets, total = layout(sizes, n)
    cnt = torch.randint(0, n + 1, (total,), generator=g) if with_cnt else torch.full((total,), n)
    plus = (torch.rand(total, generator=g) * (cnt + 1).float()).floor().clamp_(max=cnt.float()).to(torch.int64)
    plus_l = reference.pack_lanes(plus, p)
    cnt_l = reference.pack_lanes(cnt, p) if with_cnt else None
    dev_p, ref_p = make_params(sizes, pdt, g, dev)
    kw = dict(lr=3e-4, weight_decay=0.5, step=9, tie_break=tie, vote=vote)
    d_got = be.lanes_apply(plus_l.to(dev), None if cnt_l is None else cnt_l.to(dev), n, p, dev_p, offsets, **kw)
    d_ref = REF.lanes_apply(plus_l, cnt_l, n, p, ref_p, offsets, **kw)
    same(d_got, d_ref, "delta")
    for k, (a, b) in enumerate(zip(dev_p, ref_p)):
        same(a, b, f"param {k}")


# ----------------------------------------------------------------------------- int8
def _check_int8(q, ref_q, grads, momenta, offsets, beta1, kind, levels):
    same(q, ref_q, f"int8 codes ({kind})")  # every scale bit for bit (csrc/common: the defined order)


@pytest.mark.parametrize("kind", ["l1", "l0", "linf"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("gdt,mdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_int8_local_step(backend, kind, n, gdt, mdt):
    be, dev, big = backend
    g = gen(400 + n)
    sizes = [1, 7, 9, 4097] + ([big] if n in (3, 8) else [])
    grads, moms = local_inputs(sizes, gdt, mdt, g)
    zero_t = [torch.zeros(5, dtype=gdt)]  # a tensor whose c is all 0: scale 0 -> codes 0
    grads, moms = grads + zero_t, moms + [torch.zeros(5, dtype=mdt)]
    sizes = sizes + [5]
    offsets, total = layout(sizes, n)
    levels = reference.int8_levels(n)
    q, n_bad = be.int8_local_step(to(grads, dev), to(moms, dev), offsets, total, 0.9, kind, levels)
    ref_q, ref_bad = REF.int8_local_step(grads, moms, offsets, total, 0.9, kind, levels)
    assert n_bad == ref_bad
    _check_int8(q, ref_q, grads, moms, offsets, 0.9, kind, levels)


@pytest.mark.parametrize("pdt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_int8_apply(backend, pdt, wd):
    be, dev, big = backend
    g = gen(500)
    sizes = [big, 1, 7, 9, 4097]
    offsets, total = layout(sizes, 8)
    qsum = torch.randint(-127, 128, (total,), generator=g).to(torch.int8)
    qsum[::5] = 0
    dev_p, ref_p = make_params(sizes, pdt, g, dev)
    d_got = be.int8_apply(qsum.to(dev), dev_p, offsets, 1e-3, wd)
    d_ref = REF.int8_apply(qsum, ref_p, offsets, 1e-3, wd)
    same(d_got, d_ref, "delta")
    for k, (a, b) in enumerate(zip(dev_p, ref_p)):
        same(a, b, f"param {k}")


def test_params_with_nonfinite_values(backend):
    """NaN/inf parameters stay NaN/inf exactly as in the reference (decay and step)."""
    be, dev, big = backend
    g = gen(600)
    sizes = [33]
    offsets, total = layout(sizes, 2)
    sign, nz = rand_planes(2, total // 8, g)
    dev_p, ref_p = make_params(sizes, torch.float32, g, dev)
    for p in (dev_p[0], ref_p[0]):
        p[0], p[1], p[2] = float("nan"), float("inf"), -0.0
    kw = dict(lr=1e-3, weight_decay=0.1, step=2, tie_break="hash", vote="majority", world_size=2)
    same(be.vote_apply(sign.to(dev), nz.to(dev), dev_p, offsets, **kw),
         REF.vote_apply(sign, nz, ref_p, offsets, **kw), "delta")
    same(dev_p[0], ref_p[0], "param")


@pytest.mark.parametrize("n", [16, 255, 300])
@pytest.mark.parametrize("vote", ["majority", "average"])
def test_many_ranks(backend, n, vote):
    """8- and 16-level bit-sliced counters (N > 15, N > 255): vote_apply, shard_vote, count_lanes."""
    be, dev, big = backend
    g = gen(800 + n)
    sizes = [9, 300]
    offsets, total = layout(sizes, n)
    sign, nz = rand_planes(n, total // 8, g, nz_density=0.9)
    dev_p, ref_p = make_params(sizes, torch.float32, g, dev)
    kw = dict(lr=1e-3, weight_decay=0.0, step=2, tie_break="hash", vote=vote, world_size=n)
    same(be.vote_apply(sign.to(dev), nz.to(dev), dev_p, offsets, **kw),
         REF.vote_apply(sign, nz, ref_p, offsets, **kw), "delta")
    for a, b in zip(dev_p, ref_p):
        same(a, b, "param")
    for x, y in zip(be.shard_vote(sign.to(dev), None, 3, "hash", 8), REF.shard_vote(sign, None, 3, "hash", 8)):
        same(x, y, "shard vote planes")
    if n <= 255:
        for x, y in zip(be.count_lanes(sign.to(dev), nz.to(dev), 8), REF.count_lanes(sign, nz, 8)):
            same(x, y, "count lanes")


def test_apply_without_delta(backend):
    """return_delta=False (no Δ buffer: a NULL delta_out in the kernels) applies the same update."""
    be, dev, big = backend
    g = gen(650)
    sizes = [4097, 9, 1]
    offsets, total = layout(sizes, 4)
    sign, nz = rand_planes(4, total // 8, g)
    p = reference.lane_bits_for(4)
    plus = reference.pack_lanes(torch.randint(0, 5, (total,), generator=g), p)
    qsum = torch.randint(-20, 21, (total,), generator=g).to(torch.int8)
    kw = dict(lr=1e-3, weight_decay=0.2, step=5, tie_break="hash")
    calls = [
        ("vote_apply", lambda B, ps, dv, **x: B.vote_apply(sign.to(dv), nz.to(dv), ps, offsets, vote="majority",
                                                             world_size=4, **kw, **x)),
        ("lanes_apply", lambda B, ps, dv, **x: B.lanes_apply(plus.to(dv), None, 4, p, ps, offsets, vote="average",
                                                               **kw, **x)),
        ("int8_apply", lambda B, ps, dv, **x: B.int8_apply(qsum.to(dv), ps, offsets, 1e-3, 0.2, **x)),
    ]
    for name, call in calls:
        dev_p, ref_p = make_params(sizes, torch.bfloat16, g, dev)
        assert call(be, dev_p, dev, return_delta=False) is None
        call(REF, ref_p, torch.device("cpu"))
        for k, (a, b) in enumerate(zip(dev_p, ref_p)):
            same(a, b, f"{name}: param {k}")


@pytest.mark.parametrize("sms,seed", [(1, 0), (3, 7), (63, 2**40 + 5)])
def test_emulated_device_size_and_schedule_do_not_matter(sms, seed):
    """The grid sizes lc::grid_for picks (from the SM count) and the order in which the emulation runs
    threads and blocks (a seeded permutation) change nothing: the kernels' counts (atomics), the int8
    scales (shared-memory trees), the votes (warp shuffles) and the applies equal the reference."""
    be = EmuBackend(sms=sms, seed=seed)
    g = gen(700 + sms)
    sizes = [4097, 9, 1, 7, 2 * 16384 + 3]
    grads, moms = local_inputs(sizes, torch.bfloat16, torch.float32, g)
    offsets, total = layout(sizes, 3)
    got = be.local_step(grads, [m.clone() for m in moms], offsets, total, 0.9, 0.99)
    ref = REF.local_step(grads, [m.clone() for m in moms], offsets, total, 0.9, 0.99)
    same(got[0], ref[0], "sign plane")
    same(got[1], ref[1], "nonzero plane")
    assert got[2:] == ref[2:], "non-finite / zero counts"
    for kind in ("l1", "l0"):
        same(be.int8_local_step(grads, moms, offsets, total, 0.9, kind, 42)[0],
             REF.int8_local_step(grads, moms, offsets, total, 0.9, kind, 42)[0], f"int8 codes {kind}")
    sign, nz = rand_planes(3, total // 8, g)
    for vote in ("majority", "average"):
        params, ref_p = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
        same(be.vote_apply(sign, nz, params, offsets, 1e-3, 0.0, 5, "hash", vote, 3),
             REF.vote_apply(sign, nz, ref_p, offsets, 1e-3, 0.0, 5, "hash", vote, 3), f"delta ({vote})")
        for a, b in zip(params, ref_p):
            same(a, b, "param")


def _selftest(which, grid, seed=0, n=2048):
    be = EmuBackend(seed=seed)
    out = torch.zeros(n, dtype=torch.int32)
    assert be.lib.lc_emu_configure(be.sms, be.seed) == 0
    rc = be.lib.lc_emu_selftest(which, ctypes.c_void_p(out.data_ptr()), grid)
    return rc, out


def test_emulation_runs_barriers_shuffles_and_shared_memory_like_a_gpu():
    """The emulation's runtime on small kernels of its own (tests/cuda_emu/emu_selftest.cu): a shuffle
    reduction, a shared-memory exchange across a barrier, and the errors a GPU would leave undefined."""
    rc, out = _selftest(0, 3)  # warp sums by __shfl_down_sync
    assert rc == 0
    want = [sum(range(32 * w, 32 * w + 32)) for w in range(3 * 256 // 32)]
    assert out[:len(want)].tolist() == want
    rc, out = _selftest(1, 2)  # each thread reads its mirror's value from shared memory after __syncthreads
    assert rc == 0 and out[:512].tolist() == [1000 * b + 255 - t for b in range(2) for t in range(256)]
    assert _selftest(2, 1)[0] == 719  # a __syncthreads that some threads skip: cudaErrorLaunchFailure
    assert _selftest(3, 1)[0] == 719  # a whole-warp shuffle that one lane skips: cudaErrorLaunchFailure
    # the last writer of one word differs between schedules: an order-dependent kernel shows up
    assert len({int(_selftest(4, 4, seed)[1][0]) for seed in range(6)}) > 1


# ----------------------------------------------------------------------------- tie rule: layout independence
TIE_LAYOUTS = [[["a", "b", "c"]], [["c"], ["b", "a"]], [["b", "c", "a"]]]


@pytest.mark.parametrize("n,abstain", [(2, False), (4, True)])
def test_tie_outcome_independent_of_layout(backend, n, abstain):
    """docs/conventions.md: the same votes give the same Δ per parameter whatever the bucket layout, through
    vote_apply, shard_vote (+ 1-voter decode) and lanes_apply."""
    be, dev, _ = backend
    g = gen(900 + n)
    votes = {}
    for name, numel in TIE_PARAMS.items():
        v = torch.where(torch.rand(n, numel, generator=g) < 0.5, 1, -1).to(torch.int8)
        v[: n // 2, ::2], v[n // 2:, ::2] = 1, -1  # exact ties at every other element
        if abstain:
            v[0, 1::5] = 0
        votes[name] = v
    p = reference.lane_bits_for(n)

    def run(layout, how):
        params = {name: torch.zeros(numel, device=dev) for name, numel in TIE_PARAMS.items()}
        for names in layout:
            offs, total, sign, nz = bucket_planes(names, votes, n)
            sign, nz = sign.to(dev), nz.to(dev) if abstain else None
            ps = [params[nm] for nm in names]
            if how == "vote_apply":
                be.vote_apply(sign, nz, ps, offs, 1.0, 0.0, 3, "hash", "majority", n)
            elif how == "shard_vote":
                shard = total // 8 // n
                rs, rz = [], []
                for r in range(n):
                    segs = reference.tie_segments(offs, start=r * shard * 8, stop=(r + 1) * shard * 8)
                    s, z = be.shard_vote(sign[:, r * shard:(r + 1) * shard].contiguous(),
                                         None if nz is None else nz[:, r * shard:(r + 1) * shard].contiguous(), 3,
                                         "hash", segs)
                    rs.append(s)
                    rz.append(z)
                be.vote_apply(torch.cat(rs).view(1, -1), torch.cat(rz).view(1, -1), ps, offs, 1.0, 0.0, 3, "hash",
                              "majority", 1)
            else:
                plus = torch.zeros(total * p // 8, dtype=torch.uint8, device=dev)
                cnt = torch.zeros_like(plus) if abstain else None
                for r in range(n):
                    pr, cr = be.count_lanes(sign[r:r + 1].contiguous(),
                                            None if nz is None else nz[r:r + 1].contiguous(), p)
                    plus += pr
                    if abstain:
                        cnt += cr
                be.lanes_apply(plus, cnt, n, p, ps, offs, 1.0, 0.0, 3, "hash", "majority")
        return params

    for how in ("vote_apply", "shard_vote", "lanes_apply"):
        res = [run(lay, how) for lay in TIE_LAYOUTS]
        for k, r in enumerate(res[1:], 1):
            for name in TIE_PARAMS:
                same(r[name], res[0][name], f"{how}: parameter {name!r}, layout {k} vs 0")


# ----------------------------------------------------------------------------- single-process step, ZeRO apply
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def lion_inputs(sizes, pdt, gdt, mdt, g, dev):
    """Params (one a storage-offset view), grads and momenta on `dev` + CPU reference copies. Planted:
    NaN/+-Inf grads, exact zeros of c (g = m = 0, and g = -0.0), subnormal-sized momenta."""
    grads, moms = local_inputs(sizes, gdt, mdt, g)
    for gr, m in zip(grads, moms):
        if gr.numel() >= 12:
            gr[10], m[10] = -0.0, 0.0
            m[11] = 1e-40 if mdt == F32 else 0.0
    dev_p, ref_p = make_params(sizes, pdt, g, dev)
    return dev_p, ref_p, to(grads, dev), grads, [m.clone().to(dev) for m in moms], moms


@pytest.mark.parametrize("pdt,gdt,mdt", [(F32, F32, F32), (F32, BF16, F32), (F32, F16, BF16), (BF16, BF16, BF16),
                                         (BF16, F32, F32), (F16, F16, F32)])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lion_step(backend, pdt, gdt, mdt, wd):
    """The fused single-process step == reference.lion_step (lion.py's arithmetic) element by element."""
    be, dev, big = backend
    g = gen(1000 + 7 * DTYPE_CODE[pdt] + DTYPE_CODE[gdt] + int(wd * 10))
    sizes = [1, 7, 9, 4097, 0, big] if pdt == F32 else [1, 7, 9, 4097, 33]
    dev_p, ref_p, dev_g, ref_g, dev_m, ref_m = lion_inputs(sizes, pdt, gdt, mdt, g, dev)
    for step in range(2):
        be.lion_step(dev_p, dev_g, dev_m, 1e-3, wd, 0.9, 0.99)
        REF.lion_step(ref_p, ref_g, ref_m, 1e-3, wd, 0.9, 0.99)
        for k in range(len(sizes)):
            same(dev_p[k], ref_p[k], f"param {k} (step {step})")
            same(dev_m[k], ref_m[k], f"momentum {k} (step {step})")


def zero_case(n, g, cast_dtype, with_nz, dev):
    """Two groups (odd partition sizes, a byte offset, padding inside and at the end), planes with
    a flag byte (sign rows longer than nonzero rows, as zero.py sends them)."""
    parts, offs = [37, 1001], [0, 5]
    nbytes = offs[1] + (parts[1] + 7) // 8
    sign = torch.randint(0, 256, (n, nbytes + 1), generator=g, dtype=torch.int32).to(torch.uint8)
    nz = (torch.randint(0, 256, (n, nbytes), generator=g, dtype=torch.int32).to(torch.uint8)
          | torch.randint(0, 256, (n, nbytes), generator=g, dtype=torch.int32).to(torch.uint8)) if with_nz else None
    ranges = [[(0, n * parts[0] - 3)], [(3, 500), (700, n * parts[1] - 11)]]
    layout = reference.zero_layout(n, parts, offs, ranges)
    targets = [torch.randn(n * p, generator=g) for p in parts]
    targets[0][2], targets[1][4], targets[1][6] = float("nan"), -0.0, float("inf")
    casts = None if cast_dtype is None else [torch.randn(n * p, generator=g).to(cast_dtype) for p in parts]
    dev_t = []
    for t in targets:  # storage-offset views: the 16-byte vector paths see unaligned starts too
        host = torch.zeros(t.numel() + 1, device=dev)
        host[1:].copy_(t.to(dev))
        dev_t.append(host[1:])
    dev_c = None if casts is None else [c.clone().to(dev) for c in casts]
    return sign, nz, layout, targets, casts, dev_t, dev_c


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("with_nz", [False, True])
@pytest.mark.parametrize("cast_dtype", [None, BF16, F16])
def test_zero_sign_apply(backend, n, with_nz, cast_dtype):
    """Every partition of every group in one call == the reference (padding untouched, casts rounded once)."""
    be, dev, _ = backend
    g = gen(1100 + 10 * n + int(with_nz))
    sign, nz, layout, targets, casts, dev_t, dev_c = zero_case(n, g, cast_dtype, with_nz, dev)
    lrs, wds = [1e-3, 2e-3], [0.1, 0.0]
    be.zero_sign_apply(sign.to(dev), None if nz is None else nz.to(dev), dev_t, dev_c, layout, lrs, wds)
    REF.zero_sign_apply(sign, nz, targets, casts, layout, lrs, wds)
    for k in range(2):
        same(dev_t[k], targets[k], f"target {k}")
        if casts is not None:
            same(dev_c[k], casts[k], f"cast {k}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_GPU)
def test_torch_sign_on_cuda_is_the_kernel_rule():
    """The kernels' sign (lcc::lion_sign: +0 for +-0 and NaN) is what torch.sign and _foreach_sign give on
    CUDA too, so the fused step equals the pure-torch Lion there."""
    x = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), -float("inf"), 2.0, -3.0] * 3, device="cuda")
    want = [0, 0, 0, 0x3F800000, -0x40800000, 0x3F800000, -0x40800000] * 3
    assert torch.sign(x).view(torch.int32).tolist() == want
    assert torch._foreach_sign([x])[0].view(torch.int32).tolist() == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_GPU)
def test_lion_step_and_zero_apply_never_synchronize(monkeypatch):
    """lion_step and zero_sign_apply on CUDA issue no host synchronization (sync debug mode 'error')."""
    monkeypatch.setenv("LIONCUB_KERNELS", "cuda")
    be = kernels.backend_for("cuda")
    g = gen(1200)
    dev_p, ref_p, dev_g, ref_g, dev_m, ref_m = lion_inputs([7, 4097, 9], F32, BF16, F32, g, "cuda")
    sign, nz, layout, targets, casts, dev_t, dev_c = zero_case(4, g, BF16, True, "cuda")
    d_sign, d_nz = sign.cuda(), nz.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        be.lion_step(dev_p, dev_g, dev_m, 1e-3, 0.1, 0.9, 0.99)
        be.zero_sign_apply(d_sign, d_nz, dev_t, dev_c, layout, [1e-3, 2e-3], [0.1, 0.0])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    REF.lion_step(ref_p, ref_g, ref_m, 1e-3, 0.1, 0.9, 0.99)
    REF.zero_sign_apply(sign, nz, targets, casts, layout, [1e-3, 2e-3], [0.1, 0.0])
    for a, b in zip(dev_p + dev_m + dev_t + dev_c, ref_p + ref_m + targets + casts):
        same(a, b, "after the sync-free calls")


@pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_GPU)
def test_fp16_parameters_take_the_cuda_applies_without_a_host_sync(monkeypatch):
    """fp16 θ on CUDA: vote_apply and int8_apply run the CUDA kernels (they take fp16
    θ), not the reference (whose tie rule reads the host), in sync debug mode 'error'; same bits."""
    monkeypatch.setenv("LIONCUB_KERNELS", "cuda")
    be = kernels.backend_for("cuda")
    g = gen(1300)
    n, sizes = 4, [4097, 1, 9, 7]
    offsets, total = layout(sizes, n)
    sign, nz = rand_planes(n, total // 8, g)
    dev_p, ref_p = make_params(sizes, F16, g, "cuda")
    qsum = torch.randint(-8, 9, (total,), generator=g, dtype=torch.int32).to(torch.int8)
    d_sign, d_nz, d_q = sign.cuda(), nz.cuda(), qsum.cuda()
    kw = dict(lr=1e-3, weight_decay=0.1, step=3, tie_break="hash", vote="majority", world_size=n)
    be.vote_apply(d_sign, d_nz, dev_p, offsets, **kw)  # the bucket's layout made (and checked) once
    REF.vote_apply(sign, nz, ref_p, offsets, **kw)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        be.vote_apply(d_sign, d_nz, dev_p, offsets, **kw)
        be.int8_apply(d_q, dev_p, offsets, 1e-3, 0.0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    REF.vote_apply(sign, nz, ref_p, offsets, **kw)
    REF.int8_apply(qsum, ref_p, offsets, 1e-3, 0.0)
    for k, (a, b) in enumerate(zip(dev_p, ref_p)):
        same(a, b, f"fp16 param {k}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_GPU)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_lion_fused_equals_foreach_on_cuda(dtype):
    """lioncub_ds.Lion on CUDA: the fused kernel (default) and the pure-torch foreach path give the same bits."""
    from lioncub_ds import Lion

    def run(foreach):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(17, 33), torch.nn.GELU(), torch.nn.Linear(33, 5)).to("cuda", dtype)
        opt = Lion(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=foreach,
                   momentum_dtype=torch.float32 if dtype == F32 else BF16)
        gx = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(20):
            x = torch.randn(16, 17, generator=gx, device="cuda").to(dtype)
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()
        return [p.detach() for p in model.parameters()]

    for a, b in zip(run(None), run(True)):
        same(a, b, "param")
