"""The fused comm="bbit" kernels against the pure-torch reference (reference.bbit_local_step,
reference.bbit_shard_vote), bit for bit: the b code planes, the nonzero plane, the counts, the momenta
and the shard owner's result planes, at odd sizes, ties, zeros, NaN/Inf, all-zero tensors, bf16 / fp16
/ fp32, every b, both roundings, every scale and tie rule.

Backends: ``cpp`` (the C++ kernels, both ISA paths; unit tier), ``emu`` (the CUDA kernels run by the
host emulation, tests/emu_backend.py; dist tier: it compiles) and ``cuda`` (the CUDA extension on a
GPU; skipped without one, run by ``make gpu-check``, where a skip counts as a failure).
"""
from __future__ import annotations

import pytest
import torch

from emu_backend import EmuBackend
from lioncub_ds import kernels
from lioncub_ds.kernels import loader, reference
from lioncub_ds.kernels.ops import NativeBackend

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
REF = kernels.TorchBackend()
_NO_GPU = "needs a CUDA GPU (torch.cuda.is_available() is False); make gpu-check runs it"


@pytest.fixture(scope="module")
def cpp_be():
    return loader.load("cpp")  # must build here: an exception fails the tests


@pytest.fixture(params=[pytest.param("cpp-avx2", marks=pytest.mark.unit),
                        pytest.param("cpp-baseline", marks=pytest.mark.unit),
                        pytest.param("emu", marks=pytest.mark.dist),
                        pytest.param("cuda", marks=[pytest.mark.dist, pytest.mark.skipif(
                            not torch.cuda.is_available(), reason=_NO_GPU)])])
def backend(request, monkeypatch):
    """(backend, device): the C++ kernels on one ISA path, the emulated CUDA kernels or the CUDA ones."""
    name = request.param
    if name.startswith("cpp"):
        be = request.getfixturevalue("cpp_be")
        be.set_isa(name.split("-")[1])
        request.addfinalizer(lambda: be.set_isa("auto"))
        return be, torch.device("cpu")
    if name == "emu":
        return EmuBackend(sms=1), torch.device("cpu")
    monkeypatch.setenv("LIONCUB_KERNELS", "cuda")
    be = kernels.backend_for("cuda")
    assert be.name == "cuda"
    return be, torch.device("cuda")


def same(a, b, what):
    """Bit for bit on CPU copies (any NaN equals any NaN)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if a.is_floating_point():
        na, nb = torch.isnan(a), torch.isnan(b)
        assert torch.equal(na, nb), f"{what}: NaN positions differ"
        a = a.view(torch.int32 if a.element_size() == 4 else torch.int16)[~na]
        b = b.view(torch.int32 if b.element_size() == 4 else torch.int16)[~nb]
    bad = (a != b).reshape(-1)
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} of {bad.numel()} differ, first at {int(bad.nonzero()[0])}"


def bucket(sizes, gdt, mdt, seed):
    """Grads / momenta with planted exact zeros of c (g = m = 0), NaN / +-Inf grads, equal magnitudes,
    a tensor whose c is all zero (scale 0), and the bucket layout (gaps of 8 between tensors)."""
    g = torch.Generator().manual_seed(seed)
    grads, moms = [], []
    for i, n in enumerate(sizes):
        gr = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 2
        m = torch.randn(n, generator=g) * 0.1
        if n >= 12:
            gr[1] = m[1] = 0.0
            gr[2], m[2] = -0.0, 0.0
            gr[5:9] = gr[4]
            m[5:9] = m[4]
        if n >= 16 and i % 2 == 0:
            gr[3], gr[n // 2], gr[n - 1] = float("nan"), float("inf"), -float("inf")
        grads.append(gr.to(gdt))
        moms.append(m.to(mdt))
    grads.append(torch.zeros(11, dtype=gdt))  # all-zero c: ratio 0, codes of x = 0, every element abstains
    moms.append(torch.zeros(11, dtype=mdt))
    offsets, cur = [], 0
    for t in grads:
        offsets.append(cur)
        cur = (cur + t.numel() + 7) // 8 * 8 + 8
    return grads, moms, offsets, reference.padded_numel(cur, 4)


SIZES = [1, 7, 9, 4097, 2 * 16384 + 3]  # odd sizes; the last spans three scale blocks
DTYPES = [(F32, F32), (BF16, F32), (F16, BF16), (BF16, BF16)]


@pytest.mark.parametrize("kind", reference.SCALE_KINDS)
@pytest.mark.parametrize("rounding", reference.ROUNDINGS)
@pytest.mark.parametrize("gdt,mdt", DTYPES)
def test_bbit_local_step(backend, kind, rounding, gdt, mdt):
    be, dev = backend
    for bits in reference.VOTE_BITS:
        update = bits % 2 == 0
        grads, moms, offsets, total = bucket(SIZES, gdt, mdt, 10 * bits + len(kind))
        # parameter-local indices far from the positions (one near 2**32: the dither's high word changes)
        segs = reference.tie_segments(offsets, [12345, 0, 2**32 - 3, 5, 7, 0])
        seed = reference.dither_seed(bits + 3, 1)
        ref_m = [m.clone() for m in moms]
        dev_m = [m.to(dev) for m in moms]
        got = be.bbit_local_step([t.to(dev) for t in grads], dev_m, offsets, total, 0.9, 0.99, kind, bits, rounding,
                                 seed, segs, update_momentum=update)
        ref = REF.bbit_local_step(grads, ref_m, offsets, total, 0.9, 0.99, kind, bits, rounding, seed, segs,
                                  update_momentum=update)
        what = f"b={bits} {rounding} {kind}"
        same(got[0], ref[0], f"code planes ({what})")
        same(got[1], ref[1], f"nonzero plane ({what})")
        assert (got[2], got[3]) == (ref[2], ref[3]), f"non-finite / zero counts ({what})"
        for k, (a, b) in enumerate(zip(dev_m, ref_m)):
            same(a, b, f"momentum {k} ({what})")


@pytest.mark.parametrize("mdt", [F32, BF16])
def test_bbit_local_step_momenta_out_and_device_counts(backend, mdt):
    """momentum_double_buffer: the new momenta go to momenta_out (the momenta are unchanged); device_counts
    returns the counts as 0-dim int64 tensors on the device."""
    be, dev = backend
    grads, moms, offsets, total = bucket([9, 4097, 1], BF16, mdt, 77)
    segs = reference.tie_segments(offsets)
    ref_m = [m.clone() for m in moms]
    ref = REF.bbit_local_step(grads, ref_m, offsets, total, 0.95, 0.98, "l1", 2, "dither", 99, segs, True)
    dev_m = [m.to(dev) for m in moms]
    outs = [torch.full_like(m, 3.0) for m in dev_m]
    got = be.bbit_local_step([t.to(dev) for t in grads], dev_m, offsets, total, 0.95, 0.98, "l1", 2, "dither", 99,
                             segs, True, device_counts=True, momenta_out=outs)
    same(got[0], ref[0], "code planes")
    same(got[1], ref[1], "nonzero plane")
    assert all(isinstance(c, torch.Tensor) and c.dim() == 0 and c.dtype == torch.int64 and c.device.type == dev.type
               for c in got[2:])
    assert (int(got[2]), int(got[3])) == (ref[2], ref[3])
    for k in range(len(moms)):
        same(outs[k], ref_m[k], f"momenta_out {k}")
        same(dev_m[k], moms[k], f"momentum {k} (unchanged)")


def code_planes(n, bits, nbytes, g, ties=True):
    """Every rank's random codes of one shard as [N, bits, bytes] planes; with ties, the first 64 elements
    hold codes whose levels cancel exactly (rank pairs at +-q; all ranks at level 0 where 0 is a level)."""
    q = reference.bbit_qmax(bits)
    codes = torch.randint(0, q + 1, (n, nbytes * 8), generator=g, dtype=torch.int64)
    if ties and nbytes >= 8:
        k = torch.randint(0, q + 1, (64,), generator=g)
        codes[: n // 2 * 2: 2, :64] = k
        codes[1: n // 2 * 2: 2, :64] = q - k  # levels 2k - q and q - 2k cancel
        if n % 2 and bits > 1:
            codes[-1, :64] = q // 2  # the odd rank out sends level 0
    return reference.pack_bitplanes(codes.reshape(-1).to(torch.uint8), bits).reshape(bits, n, -1).transpose(0, 1)


SHARD_CASES = [(n, bits, tie, nz, nb) for n in (1, 2, 3, 4, 7, 8) for bits in reference.VOTE_BITS
               for tie, nz, nb in (("zero", False, 9), ("alternate", True, 13), ("hash", True, 513), ("hash", False, 1))]
SHARD_CASES += [(16, 3, "hash", True, 40), (300, 2, "hash", True, 24), (300, 4, "alternate", False, 8)]


@pytest.mark.parametrize("n,bits,tie,with_nz,nbytes", SHARD_CASES)
def test_bbit_shard_vote(backend, n, bits, tie, with_nz, nbytes):
    be, dev = backend
    g = torch.Generator().manual_seed(1000 * n + 10 * bits + nbytes)
    planes = code_planes(n, bits, nbytes, g).contiguous()
    nz = None
    if with_nz:
        nz = torch.randint(0, 256, (n, nbytes), generator=g, dtype=torch.int32).to(torch.uint8)
        nz |= torch.randint(0, 256, (n, nbytes), generator=g, dtype=torch.int32).to(torch.uint8)
        nz[:, :1] = 0  # nobody voted: no move
    segs = reference.tie_segments([0, 64, 8 * nbytes - 8], [7, 0, 2**32 - 2], start=40, stop=40 + 8 * nbytes)
    for step in (6, 7):
        got = be.bbit_shard_vote(planes.to(dev), None if nz is None else nz.to(dev), bits, step, tie, segs)
        ref = REF.bbit_shard_vote(planes, nz, bits, step, tie, segs)
        same(got[0], ref[0], f"result sign plane (step {step})")
        same(got[1], ref[1], f"result nonzero plane (step {step})")


@pytest.mark.parametrize("tie", reference.TIE_RULES)
def test_one_bit_nearest_is_the_1bit_majority(backend, tie):
    """b = 1 with nearest rounding: the shard vote of sign planes is shard_vote's majority, bit for bit."""
    be, dev = backend
    g = torch.Generator().manual_seed(5)
    sign = torch.randint(0, 256, (4, 33), generator=g, dtype=torch.int32).to(torch.uint8)
    nz = sign ^ torch.randint(0, 256, (4, 33), generator=g, dtype=torch.int32).to(torch.uint8)
    for z in (None, nz):
        got = be.bbit_shard_vote(sign.view(4, 1, 33).to(dev), None if z is None else z.to(dev), 1, 3, tie, 8)
        want = REF.shard_vote(sign, z, 3, tie, 8)
        same(got[0], want[0], "sign")
        same(got[1], want[1], "nonzero")


def test_dither_follows_the_parameter_not_the_bucket_layout(backend):
    """The same parameters in two bucket layouts (order, offsets) get the same codes per parameter."""
    be, dev = backend
    grads, moms, _, _ = bucket([37, 4097, 9], F32, F32, 3)
    per = {}
    for order in ([0, 1, 2, 3], [3, 2, 0, 1]):
        offs, cur = [0] * len(order), 16
        for i in order:
            offs[i] = cur
            cur = (cur + grads[i].numel() + 7) // 8 * 8 + 24
        total = reference.padded_numel(cur, 2)
        planes, *_ = be.bbit_local_step([t.to(dev) for t in grads], [m.to(dev) for m in moms], offs, total, 0.9, 0.99,
                                        "l0", 3, "dither", 1234, reference.tie_segments(offs))
        codes = reference.unpack_bitplanes(planes.cpu(), 3)
        per[tuple(order)] = [codes[o:o + t.numel()] for o, t in zip(offs, grads)]
    for a, b in zip(*per.values()):
        assert torch.equal(a, b)


class _NoExtension:
    def __getattr__(self, name):
        raise AssertionError(f"the extension was called ({name}) before the arguments were checked")


@pytest.mark.unit
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_bad_input_is_refused_in_python_with_the_setting_named(device_type):
    be = NativeBackend(_NoExtension(), device_type)  # a fresh backend over an "extension" that fails any call
    g, m = [torch.zeros(9)], [torch.zeros(9)]
    args = dict(grads=g, momenta=m, offsets=[0], total=16, beta1=0.9, beta2=0.99, kind="l1", bits=2,
                rounding="dither", seed=5, segments=None)
    for key, bad, words in (("bits", 5, "vote_bits"), ("bits", True, "vote_bits"), ("rounding", "up", "rounding"),
                            ("kind", "l2", "quant scale"), ("seed", -1, "seed"), ("seed", 2**32, "seed"),
                            ("offsets", [3], "offsets"), ("total", 12, "total")):
        with pytest.raises(ValueError, match=words):
            be.bbit_local_step(**{**args, key: bad})
    planes = torch.zeros(2, 2, 4, dtype=torch.uint8)
    for kw, words in ((dict(bits=3), "planes"), (dict(nonzero=torch.zeros(2, 3, dtype=torch.uint8)), "nonzero"),
                      (dict(tie_break="coin"), "tie_break"), (dict(planes=planes[0]), "planes")):
        call = dict(planes=planes, nonzero=None, bits=2, step=1, tie_break="hash", segments=0) | kw
        with pytest.raises(ValueError, match=words):
            be.bbit_shard_vote(**call)


@pytest.mark.dist
@pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_GPU)
def test_bbit_never_synchronizes(monkeypatch):
    """comm="bbit" on CUDA: the local step (every scale; device counts, the momentum update) and the shard
    vote issue no host synchronization (torch's sync debug mode "error"), and give the reference's bits."""
    monkeypatch.setenv("LIONCUB_KERNELS", "cuda")
    be = kernels.backend_for("cuda")
    grads, moms, offsets, total = bucket([9, 4097, 1], BF16, F32, 11)
    segs = reference.tie_segments(offsets, [5, 0, 2**32 - 3, 0])
    g = torch.Generator().manual_seed(12)
    planes, nz = code_planes(4, 2, 40, g).contiguous(), torch.randint(0, 256, (4, 40), generator=g).to(torch.uint8)
    d_g, d_m, d_planes, d_nz = [t.cuda() for t in grads], [m.cuda() for m in moms], planes.cuda(), nz.cuda()
    got = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for kind in reference.SCALE_KINDS:
            got.append(be.bbit_local_step(d_g, d_m, offsets, total, 0.9, 0.99, kind, 2, "dither", 7, segs, True,
                                          device_counts=True))
        shard = be.bbit_shard_vote(d_planes, d_nz, 2, 3, "hash", 8)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for kind, out in zip(reference.SCALE_KINDS, got):
        ref = REF.bbit_local_step(grads, moms, offsets, total, 0.9, 0.99, kind, 2, "dither", 7, segs, True)
        same(out[0], ref[0], f"code planes ({kind})")
        same(out[1], ref[1], f"nonzero plane ({kind})")
        assert (int(out[2]), int(out[3])) == (ref[2], ref[3])
    for a, b in zip(d_m, moms):
        same(a, b, "momentum after three updates")
    for a, b in zip(shard, REF.bbit_shard_vote(planes, nz, 2, 3, "hash", 8)):
        same(a, b, "shard vote planes")
