"""The fused C++ CPU kernels equal the pure-torch reference (lioncub_ds.kernels.reference) bit for bit.

Bit planes, lanes, int8 codes and counts must be identical; momenta, parameters and Δ must be
identical element by element (compared as raw bits; NaN positions compared as a mask). Every
test runs on fresh random inputs with planted exact zeros (g = m = 0), NaN/Inf, ties and
abstentions. The C++ extension is built (or loaded from the cache) once; a build failure is a
test error, never a skip.
"""
from __future__ import annotations

import importlib
import inspect
import math
import os
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lioncub_ds import kernels
from lioncub_ds.kernels import loader, ops, reference

pytestmark = pytest.mark.unit

SMALL = [1, 7, 8, 9, 1000, 4097]   # several tensors per bucket, odd sizes
BIG = 1048579
NS = (1, 2, 3, 4, 7, 8)
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
GRAD_DTYPES = (F32, BF16, F16)
STATE_DTYPES = (F32, BF16)
TIE_VOTE = [("majority", "zero"), ("majority", "alternate"), ("majority", "hash"), ("average", "hash")]


@pytest.fixture(scope="module")
def be():
    backend = loader.load("cpp")  # must build on this machine: an exception here fails the tests
    assert backend.name == "cpp"
    return backend


@pytest.fixture(params=["avx2", "baseline"])
def isa_be(be, request):
    """The backend forced onto one instruction-set path (identical results are required)."""
    be.set_isa(request.param)
    yield be
    be.set_isa("auto")


def _gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


# ----------------------------------------------------------------------------- comparisons
def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_same_float(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    na, nb = torch.isnan(a), torch.isnan(b)
    assert torch.equal(na, nb), f"{what}: NaN positions differ"
    ia, ib = _bits(a)[~na.reshape(-1)], _bits(b)[~nb.reshape(-1)]
    if not torch.equal(ia, ib):
        bad = (ia != ib).nonzero().reshape(-1)
        raise AssertionError(f"{what}: {bad.numel()} elements differ (first at {int(bad[0])}: "
                             f"{a.reshape(-1)[~na.reshape(-1)][bad[0]].item()!r} vs "
                             f"{b.reshape(-1)[~nb.reshape(-1)][bad[0]].item()!r})")


def assert_same(a, b, what: str):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: {a!r} vs {b!r}"
        return
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), what
        if a.is_floating_point():
            assert_same_float(a, b, what)
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: {int((a != b).sum())} elements differ"
        return
    assert type(a) is type(b) and a == b, f"{what}: {a!r} vs {b!r}"


# ----------------------------------------------------------------------------- inputs
def layout(sizes):
    offs, o = [], 0
    for n in sizes:
        offs.append(o)
        o += (n + 7) // 8 * 8
    return offs, (o + 63) // 64 * 64  # padded like a bucket of up to 8 ranks


def make_bucket(sizes, gdt, mdt, seed, *, plant_zero=True, plant_bad=True):
    """Random grads/momenta; planted exact zeros (g = m = 0 -> c == 0) and NaN/+-Inf grads."""
    gen = _gen(seed)
    grads, moms = [], []
    for i, n in enumerate(sizes):
        g = torch.randn(n, generator=gen) * 2.0
        m = torch.randn(n, generator=gen) * 0.5
        if plant_zero and n > 1:
            idx = torch.randint(0, n, (max(1, n // 10),), generator=gen)
            g[idx] = 0.0
            m[idx] = 0.0
            g[0] = -0.0
            m[0] = 0.0
        if plant_bad and n >= 9 and i % 2 == 0:
            g[n // 3] = float("nan")
            g[n // 2] = float("inf")
            g[n - 1] = float("-inf")
        grads.append(g.to(gdt))
        moms.append(m.to(mdt))
    offs, total = layout(sizes)
    return grads, moms, offs, total


def random_planes(n, nbytes, seed, *, abstain):
    gen = _gen(seed)
    sign = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=gen)
    if n % 2 == 0 and nbytes >= 8:
        # planted exact ties: the first half of the ranks vote +, the second half -
        sign[: n // 2, :4] = 0xFF
        sign[n // 2:, :4] = 0x00
    if not abstain:
        return sign, None
    nz = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=gen)
    nz |= torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=gen)  # mostly voting
    if nbytes >= 16:
        nz[:, 8:10] = 0          # nobody voted: no move, whatever the tie rule
        nz[:, 10:12] = 0xFF      # everyone voted
    return sign, nz


def make_params(sizes, dtypes, seed):
    gen = _gen(seed)
    return [(torch.randn(n, generator=gen) * 0.1).to(dtypes[i % len(dtypes)]) for i, n in enumerate(sizes)]


def clone_all(ts):
    return [t.clone() for t in ts]


# ----------------------------------------------------------------------------- interface
def test_backend_interface_matches_torch_backend(be):
    ref = kernels.TorchBackend
    for name in ("local_step", "abstain_list", "momentum_update_list", "vote_apply", "shard_vote", "count_lanes",
                 "lanes_apply", "int8_local_step", "int8_apply", "lion_step", "zero_sign_apply", "bbit_local_step",
                 "bbit_shard_vote"):
        want = list(inspect.signature(getattr(ref, name)).parameters.values())
        for impl in (be, ops.NativeBackend(None, "cuda")):
            got = [p for p in inspect.signature(getattr(impl, name)).parameters.values() if p.name != "self"]
            assert [(p.name, p.default) for p in got[:len(want)]] == [(p.name, p.default) for p in want], name
            assert all(p.default is not inspect.Parameter.empty for p in got[len(want):]), name
    assert be.name == "cpp"
    assert be.isa in ("avx2", "baseline")
    for backend in (be, kernels.TorchBackend(), ops.NativeBackend(None, "cuda")):
        assert isinstance(backend, kernels.Backend), backend
    for name in ("local_step", "abstain_list", "vote_apply", "shard_vote", "lanes_apply", "int8_local_step",
                 "lion_step", "zero_sign_apply", "bbit_local_step", "bbit_shard_vote"):  # the Protocol is the reference's
        want = [p.name for p in inspect.signature(getattr(reference, name)).parameters.values()]
        got = [p.name for p in inspect.signature(getattr(kernels.Backend, name)).parameters.values()][1:]
        assert got == want, name


def test_loader_forced_cpp(monkeypatch):
    monkeypatch.setenv("LIONCUB_KERNELS", "cpp")
    monkeypatch.setattr(kernels, "_cache", {})
    assert kernels.backend_for("cpu").name == "cpp"


def test_cuda_kind_is_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present; the CUDA loader is tested elsewhere")
    with pytest.raises(RuntimeError, match="no CUDA device is available"):
        loader.load("cuda")


class _Prebuilt:
    def __init__(self, src_hash):
        self._h = src_hash

    def src_hash(self):
        return self._h


def test_loader_prefers_a_matching_prebuilt_module(monkeypatch):
    """The module `make setup` builds (LIONCUB_BUILD_EXT=1) is used when its src_hash matches the
    sources; a stale one (sources changed since) or none at all falls back to the JIT build."""
    jit = object()
    monkeypatch.setattr(loader, "_jit_build", lambda: jit)
    current = _Prebuilt("h" + loader.source_hash())
    stale = _Prebuilt("h" + "0" * 40)
    for module, want, how in ((current, current, "prebuilt"), (stale, jit, "jit"), (None, jit, "jit")):
        monkeypatch.setitem(sys.modules, loader.PREBUILT_MODULE, module)  # None: the import raises ImportError
        monkeypatch.setattr(loader, "_loaded", {})
        assert loader.build_cpp_extension() is want
        assert loader.origin("cpp") == how


def test_real_prebuilt_module_is_chosen_only_when_current():
    """With a real prebuilt module present (after `make setup`): chosen exactly when its hash matches."""
    try:
        mod = importlib.import_module(loader.PREBUILT_MODULE)
    except ImportError:
        pytest.skip("no prebuilt lioncub_ds._lioncub_cpu here (make setup builds it; the JIT build is used)")
    assert mod.has_cuda is False
    current = mod.src_hash() == "h" + loader.source_hash()
    assert (loader._prebuilt() is mod) == current


# ----------------------------------------------------------------------------- (a) local step
@pytest.mark.parametrize("update", [False, True])
@pytest.mark.parametrize("mdt", STATE_DTYPES)
@pytest.mark.parametrize("gdt", GRAD_DTYPES)
def test_local_step(isa_be, gdt, mdt, update):
    seed = GRAD_DTYPES.index(gdt) * 10 + STATE_DTYPES.index(mdt) * 2 + int(update)
    grads, moms, offs, total = make_bucket(SMALL, gdt, mdt, seed)
    m_ref, m_cpp = clone_all(moms), clone_all(moms)
    ref = reference.local_step(grads, m_ref, offs, total, 0.9, 0.99, update)
    got = isa_be.local_step(grads, m_cpp, offs, total, 0.9, 0.99, update)
    for what, a, b in zip(("sign", "nonzero", "n_nonfinite", "n_zero"), ref, got):
        assert_same(a, b, what)
    assert ref[2] > 0 and ref[3] > 0  # the planted NaN/Inf and zeros are really there
    for i, (a, b) in enumerate(zip(m_ref, m_cpp)):
        assert_same_float(a, b, f"momentum[{i}]")


@pytest.mark.parametrize("gdt,mdt,update", [(F32, F32, True), (BF16, BF16, True), (F16, F32, False)])
def test_local_step_big(be, gdt, mdt, update):
    grads, moms, offs, total = make_bucket([BIG, 9, 1000], gdt, mdt, 99, plant_bad=(gdt is F32))
    m_ref, m_cpp = clone_all(moms), clone_all(moms)
    ref = reference.local_step(grads, m_ref, offs, total, 0.95, 0.98, update)
    got = be.local_step(grads, m_cpp, offs, total, 0.95, 0.98, update)
    for what, a, b in zip(("sign", "nonzero", "n_nonfinite", "n_zero"), ref, got):
        assert_same(a, b, what)
    for i, (a, b) in enumerate(zip(m_ref, m_cpp)):
        assert_same_float(a, b, f"momentum[{i}]")


def test_local_step_odd_betas_and_empty(be):
    grads, moms, offs, total = make_bucket([5, 17], F32, F32, 3)
    for b1, b2 in ((0.0, 0.0), (0.123456789, 0.987654321), (0.999, 0.5)):
        m_ref, m_cpp = clone_all(moms), clone_all(moms)
        ref = reference.local_step(grads, m_ref, offs, total, b1, b2, True)
        got = be.local_step(grads, m_cpp, offs, total, b1, b2, True)
        for what, a, b in zip(("sign", "nonzero", "n_nonfinite", "n_zero"), ref, got):
            assert_same(a, b, what)
        for a, b in zip(m_ref, m_cpp):
            assert_same_float(a, b, "momentum")
    ref = reference.local_step([], [], [], 64, 0.9, 0.99, False)
    got = be.local_step([], [], [], 64, 0.9, 0.99, False)
    for what, a, b in zip(("sign", "nonzero", "n_nonfinite", "n_zero"), ref, got):
        assert_same(a, b, what)


@pytest.mark.parametrize("mdt", STATE_DTYPES)
@pytest.mark.parametrize("gdt", GRAD_DTYPES)
def test_local_step_writes_next_momenta_to_momenta_out(isa_be, gdt, mdt):
    """momenta_out: the votes of the in-place call, the in-place call's new momenta written to
    the out buffers, and the momenta themselves untouched (a skipped step must not change them)."""
    grads, moms, offs, total = make_bucket(SMALL + [BIG], gdt, mdt, 41)
    m_inplace, m_kept = clone_all(moms), clone_all(moms)
    outs = [torch.full_like(m, 7.0) for m in moms]
    outs_ref = [torch.full_like(m, 7.0) for m in moms]
    want = reference.local_step(grads, m_inplace, offs, total, 0.9, 0.99, True)
    ref = reference.local_step(grads, clone_all(moms), offs, total, 0.9, 0.99, True, momenta_out=outs_ref)
    got = isa_be.local_step(grads, m_kept, offs, total, 0.9, 0.99, True, momenta_out=outs)
    for what, a, b, c in zip(("sign", "nonzero", "n_nonfinite", "n_zero"), want, ref, got):
        assert_same(a, b, what)
        assert_same(a, c, what)
    for i in range(len(moms)):
        assert_same_float(m_inplace[i], outs_ref[i], f"reference momenta_out[{i}]")
        assert_same_float(m_inplace[i], outs[i], f"momenta_out[{i}]")
        assert_same_float(moms[i], m_kept[i], f"momenta[{i}] (must be unchanged)")


@pytest.mark.parametrize("capacity", [0, 1, 3, 40])
@pytest.mark.parametrize("nbytes", [1, 7, 8, 9, 63, 1031])
def test_abstain_list(be, nbytes, capacity):
    """The count, the first K differing bytes in order and their values: exactly the reference's,
    with no difference, a few, and more than the capacity (overflow), at odd plane sizes."""
    gen = _gen(nbytes * 7 + capacity)
    mask = torch.full((nbytes,), 0xFF, dtype=torch.uint8)
    mask[-1] = 0x1F  # a last partial byte, as a bucket's mask has
    capacity = min(capacity, nbytes)
    for n_diff in (0, 1, 2, 5, nbytes):
        nz = mask.clone()
        pos = torch.randperm(nbytes, generator=gen)[:n_diff]
        nz[pos] ^= torch.randint(1, 256, (len(pos),), dtype=torch.uint8, generator=gen)
        want = reference.abstain_list(nz, mask, capacity)
        got = be.abstain_list(nz, mask, capacity)
        assert_same(want, got, f"list ({n_diff} differing bytes)")
        assert int(got[0]) == int((nz != mask).sum())


# ----------------------------------------------------------------------------- (b) momentum
@pytest.mark.parametrize("mdt", STATE_DTYPES)
@pytest.mark.parametrize("gdt", GRAD_DTYPES)
def test_momentum_update_list(be, gdt, mdt):
    sizes = SMALL + ([BIG] if gdt is BF16 else [])
    grads, moms, _, _ = make_bucket(sizes, gdt, mdt, 7)
    m_ref, m_cpp = clone_all(moms), clone_all(moms)
    kernels.TorchBackend.momentum_update_list(m_ref, grads, 0.99)
    be.momentum_update_list(m_cpp, grads, 0.99)
    for i, (a, b) in enumerate(zip(m_ref, m_cpp)):
        assert_same_float(a, b, f"momentum[{i}]")


# ----------------------------------------------------------------------------- (c) vote_apply
@pytest.mark.parametrize("vote,tie", TIE_VOTE)
@pytest.mark.parametrize("abstain", [False, True])
@pytest.mark.parametrize("n", NS)
def test_vote_apply(isa_be, n, abstain, vote, tie):
    sizes = SMALL + [33]
    offs, total = layout(sizes)
    seed = 1000 + n * 16 + int(abstain) * 8 + TIE_VOTE.index((vote, tie))
    sign, nz = random_planes(n, total // 8, seed, abstain=abstain)
    params = make_params(sizes, (F32, BF16), seed)
    wd = 0.1 if n % 2 else 0.0
    for step in (n, n + 1):  # both step parities (alternate rule)
        p_ref, p_cpp = clone_all(params), clone_all(params)
        segs = None if step % 2 else reference.tie_segments(offs, [12345 + 8 * i for i in range(len(offs))])
        d_ref = reference.vote_apply(sign, nz, p_ref, offs, 3e-3, wd, step, tie, vote, n, segments=segs)
        d_cpp = isa_be.vote_apply(sign, nz, p_cpp, offs, 3e-3, wd, step, tie, vote, n, segments=segs)
        assert_same_float(d_ref, d_cpp, "delta")
        for i, (a, b) in enumerate(zip(p_ref, p_cpp)):
            assert_same_float(a, b, f"param[{i}]")
        if vote == "majority" and n % 2 == 0 and tie != "zero" and not abstain:
            # the planted ties were broken (no zero Δ among them)
            assert bool((d_ref[:32] != 0).all())


def test_vote_apply_one_dim_planes_and_no_delta(be):
    sizes = [1000, 9]
    offs, total = layout(sizes)
    sign, nz = random_planes(1, total // 8, 5, abstain=True)
    params = make_params(sizes, (BF16, F32), 5)
    p_ref, p_cpp, p_nod = clone_all(params), clone_all(params), clone_all(params)
    d_ref = reference.vote_apply(sign[0], nz[0], p_ref, offs, 1e-2, 0.5, 4, "hash", "majority", 1)
    d_cpp = be.vote_apply(sign[0], nz[0], p_cpp, offs, 1e-2, 0.5, 4, "hash", "majority", 1)
    assert be.vote_apply(sign[0], nz[0], p_nod, offs, 1e-2, 0.5, 4, "hash", "majority", 1, 0, False) is None
    assert_same_float(d_ref, d_cpp, "delta")
    for a, b, c in zip(p_ref, p_cpp, p_nod):
        assert_same_float(a, b, "param")
        assert_same_float(a, c, "param (return_delta=False)")


@pytest.mark.parametrize("pdt", STATE_DTYPES)
def test_vote_apply_big(be, pdt):
    sizes = [BIG, 7]
    offs, total = layout(sizes)
    sign, nz = random_planes(4, total // 8, 77, abstain=True)
    params = make_params(sizes, (pdt,), 77)
    p_ref, p_cpp = clone_all(params), clone_all(params)
    # parameter-local indices that cross 2**32 inside the big parameter (the hash mixes the high word)
    segs = reference.tie_segments(offs, [2**32 - 100000, 5])
    d_ref = reference.vote_apply(sign, nz, p_ref, offs, 1e-4, 0.1, 11, "hash", "majority", 4, segments=segs)
    d_cpp = be.vote_apply(sign, nz, p_cpp, offs, 1e-4, 0.1, 11, "hash", "majority", 4, segments=segs)
    assert_same_float(d_ref, d_cpp, "delta")
    for a, b in zip(p_ref, p_cpp):
        assert_same_float(a, b, "param")
    # the same indices through lanes_apply (its decision loop splits runs where the low word wraps)
    plus = reference.count_lanes(sign, nz, 4)
    p_ref, p_cpp = clone_all(params), clone_all(params)
    d_ref = reference.lanes_apply(plus[0], plus[1], 4, 4, p_ref, offs, 1e-4, 0.1, 11, "hash", "majority", segs)
    d_cpp = be.lanes_apply(plus[0], plus[1], 4, 4, p_cpp, offs, 1e-4, 0.1, 11, "hash", "majority", segs)
    assert_same_float(d_ref, d_cpp, "delta (lanes)")


# ----------------------------------------------------------------------------- (d) shard_vote
@pytest.mark.parametrize("tie", reference.TIE_RULES)
@pytest.mark.parametrize("abstain", [False, True])
@pytest.mark.parametrize("n", NS)
def test_shard_vote(be, n, abstain, tie):
    for nbytes in (1, 513):
        sign, nz = random_planes(n, nbytes, 2000 + n + nbytes, abstain=abstain)
        # a shard that starts inside a parameter, with more parameters starting in it
        segs = reference.tie_segments([0, 40, 8 * nbytes - 8, 8 * nbytes + 16], start=24, stop=24 + 8 * nbytes)
        for step in (2, 3):
            ref = reference.shard_vote(sign, nz, step, tie, segs)
            got = be.shard_vote(sign, nz, step, tie, segs)
            assert_same(ref[0], got[0], "result sign")
            assert_same(ref[1], got[1], "result nonzero")


# ----------------------------------------------------------------------------- (e) count_lanes
@pytest.mark.parametrize("p", reference.LANE_WIDTHS)
@pytest.mark.parametrize("abstain", [False, True])
@pytest.mark.parametrize("n", NS)
def test_count_lanes(be, n, abstain, p):
    sign, nz = random_planes(n, 517, 3000 + n * 4 + p, abstain=abstain)
    try:
        ref = reference.count_lanes(sign, nz, p)
    except ValueError as exc:
        with pytest.raises(ValueError) as info:
            be.count_lanes(sign, nz, p)
        assert str(info.value) == str(exc)
        return
    got = be.count_lanes(sign, nz, p)
    assert_same(ref[0], got[0], "plus lanes")
    assert_same(ref[1], got[1], "cnt lanes")


def test_count_lanes_p1_with_abstentions_fits(be):
    # N = 2 with nonzero planes where nobody has 2 voters: the data-dependent check passes
    sign = torch.randint(0, 256, (2, 64), dtype=torch.uint8, generator=_gen(1))
    nz = torch.zeros(2, 64, dtype=torch.uint8)
    nz[0, :32] = 0xFF
    nz[1, 32:] = 0xFF
    ref = reference.count_lanes(sign, nz, 1)
    got = be.count_lanes(sign, nz, 1)
    assert_same(ref[0], got[0], "plus lanes")
    assert_same(ref[1], got[1], "cnt lanes")


# ----------------------------------------------------------------------------- (f) lanes_apply
@pytest.mark.parametrize("vote,tie", TIE_VOTE)
@pytest.mark.parametrize("abstain", [False, True])
@pytest.mark.parametrize("n", NS)
def test_lanes_apply(isa_be, n, abstain, vote, tie):
    sizes = SMALL
    offs, total = layout(sizes)
    seed = 4000 + n * 16 + int(abstain) * 8 + TIE_VOTE.index((vote, tie))
    sign, nz = random_planes(n, total // 8, seed, abstain=abstain)
    params = make_params(sizes, (BF16, F32), seed)
    for p in reference.LANE_WIDTHS:
        if (1 << p) - 1 < n:
            continue
        # the pbit algorithm: every rank packs its own plane (N = 1), a SUM all-reduce adds the bytes
        plus = torch.zeros(total // 8 * p, dtype=torch.uint8)
        cnt = torch.zeros(total // 8 * p, dtype=torch.uint8) if abstain else None
        for r in range(n):
            pr, cr = reference.count_lanes(sign[r:r + 1], None if nz is None else nz[r:r + 1], p)
            pr2, cr2 = isa_be.count_lanes(sign[r:r + 1], None if nz is None else nz[r:r + 1], p)
            assert_same(pr, pr2, "p-bit pack")
            assert_same(cr, cr2, "p-bit pack (cnt)")
            plus += pr
            if abstain:
                cnt += cr
        p_ref, p_cpp = clone_all(params), clone_all(params)
        d_ref = reference.lanes_apply(plus, cnt, n, p, p_ref, offs, 1e-3, 0.2, n + p, tie, vote, 777)
        d_cpp = isa_be.lanes_apply(plus, cnt, n, p, p_cpp, offs, 1e-3, 0.2, n + p, tie, vote, 777)
        assert_same_float(d_ref, d_cpp, f"delta (p={p})")
        for i, (a, b) in enumerate(zip(p_ref, p_cpp)):
            assert_same_float(a, b, f"param[{i}] (p={p})")


# ----------------------------------------------------------------------------- (g) int8 local step
@pytest.mark.parametrize("kind", reference.SCALE_KINDS)
@pytest.mark.parametrize("mdt", STATE_DTYPES)
@pytest.mark.parametrize("gdt", GRAD_DTYPES)
def test_int8_local_step(isa_be, gdt, mdt, kind):
    ns = NS if (gdt, mdt) == (F32, F32) else ((3,) if gdt is F16 else (2, 7))
    for n in ns:
        levels = reference.int8_levels(n)
        seed = 5000 + GRAD_DTYPES.index(gdt) * 100 + STATE_DTYPES.index(mdt) * 10 + n
        grads, moms, offs, total = make_bucket(SMALL + [40000], gdt, mdt, seed)
        ref = reference.int8_local_step(grads, moms, offs, total, 0.9, kind, levels)
        got = isa_be.int8_local_step(grads, moms, offs, total, 0.9, kind, levels)
        assert_same(ref[0], got[0], f"int8 codes (N={n})")
        assert_same(ref[1], got[1], f"#non-finite (N={n})")


@pytest.mark.parametrize("backend_name", ["torch", "cpp"])
def test_device_counts_equal_the_int_counts(be, backend_name):
    """device_counts=True (what the optimizer's pipeline asks for, so CUDA never syncs per bucket):
    the same counts as 0-dim int64 tensors on the bucket's device; everything else unchanged."""
    backend = kernels.TorchBackend() if backend_name == "torch" else be
    grads, moms, offs, total = make_bucket(SMALL, F32, F32, 77)
    plain = backend.local_step(grads, clone_all(moms), offs, total, 0.9, 0.99)
    dev = backend.local_step(grads, clone_all(moms), offs, total, 0.9, 0.99, device_counts=True)
    assert_same(plain[0], dev[0], "sign")
    assert_same(plain[1], dev[1], "nonzero")
    for what, a, b in zip(("n_nonfinite", "n_zero"), plain[2:], dev[2:]):
        assert isinstance(b, torch.Tensor) and b.dim() == 0 and b.dtype == torch.int64 and b.device == grads[0].device
        assert int(b) == a > 0, what
    q, n_bad = backend.int8_local_step(grads, moms, offs, total, 0.9, "l1", 3)
    q_dev, n_bad_dev = backend.int8_local_step(grads, moms, offs, total, 0.9, "l1", 3, device_counts=True)
    assert_same(q, q_dev, "int8 codes")
    assert isinstance(n_bad_dev, torch.Tensor) and n_bad_dev.dim() == 0 and int(n_bad_dev) == n_bad > 0


def test_strided_planes_take_the_kernels_not_the_reference(be, monkeypatch):
    """Packed planes that arrive as strided views (a column of a gathered buffer, a decoded
    abstention plane) run the C++ kernels on a copy, with the same bits; before this they fell
    to the 100x slower reference (seen as 1.4 s of 'kernels' per step in bench netns)."""
    n, sizes = 4, [61, 200, 9]
    offs, total = layout(sizes)
    sign, nz = random_planes(n, total // 8, 31, abstain=True)
    wide = torch.zeros(n, total // 8 + 5, dtype=torch.uint8)
    s_view, nz_view = wide[:, : total // 8], wide.clone()[:, 5:]
    s_view.copy_(sign)
    nz_view.copy_(nz)
    assert not s_view.is_contiguous() and not nz_view.is_contiguous()
    p_want = make_params(sizes, (F32, BF16), 32)
    d_want = be.vote_apply(sign, nz, p_want, offs, 1e-3, 0.1, 3, "hash", "majority", n)
    sh_want = be.shard_vote(sign, nz, 3, "hash", reference.tie_segments(offs))
    lanes_want = be.count_lanes(sign, nz, 4)

    def no_reference(*args, **kwargs):
        raise AssertionError("the reference path was taken")

    for name in ("vote_apply", "shard_vote", "count_lanes"):
        monkeypatch.setattr(ops.ref, name, no_reference)
    p_got = make_params(sizes, (F32, BF16), 32)
    d_got = be.vote_apply(s_view, nz_view, p_got, offs, 1e-3, 0.1, 3, "hash", "majority", n)
    assert_same_float(d_want, d_got, "delta")
    for a, b in zip(p_want, p_got):
        assert_same_float(a, b, "param")
    for a, b in zip(sh_want, be.shard_vote(s_view, nz_view, 3, "hash", reference.tie_segments(offs))):
        assert_same(a, b, "shard vote")
    for a, b in zip(lanes_want, be.count_lanes(s_view, nz_view, 4)):
        assert_same(a, b, "lanes")


def test_int8_zero_and_tiny_scales(be):
    # an all-zero tensor (a == 0 -> q = 0), a single nonzero value, and huge values (c*(s/2) overflows)
    grads = [torch.zeros(100), torch.zeros(9), torch.full((16,), 3e38)]
    moms = [torch.zeros(100), torch.zeros(9), torch.full((16,), 3e38)]
    grads[1][4] = 1e-30
    offs, total = layout([100, 9, 16])
    for kind in reference.SCALE_KINDS:
        ref = reference.int8_local_step(grads, moms, offs, total, 0.9, kind, 63)
        got = be.int8_local_step(grads, moms, offs, total, 0.9, kind, 63)
        assert_same(ref[0], got[0], f"int8 codes ({kind})")
        assert_same(ref[1], got[1], f"#non-finite ({kind})")


@pytest.mark.parametrize("kind", reference.SCALE_KINDS)
def test_int8_local_step_big(be, kind):
    """The l1/l0 scales follow the project's own summation order: the same codes with 1 and 2
    threads, on both ISA paths, equal to the reference (odd sizes, several sum blocks)."""
    grads, moms, offs, total = make_bucket([BIG, 70001, 16385, 3], BF16 if kind == "l0" else F32, F32, 6000)
    ref = reference.int8_local_step(grads, moms, offs, total, 0.95, kind, 31)
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for isa in ("avx2", "baseline"):
                be.set_isa(isa)
                got = be.int8_local_step(grads, moms, offs, total, 0.95, kind, 31)
                assert_same(ref[0], got[0], f"int8 codes ({threads} threads, {isa})")
                assert_same(ref[1], got[1], f"#non-finite ({threads} threads, {isa})")
    finally:
        torch.set_num_threads(old)
        be.set_isa("auto")


@pytest.mark.parametrize("n", [1, 3, 255, 256, 257, 16383, 16384, 16385, 40001])
def test_int8_scales_equal_reference_on_odd_sizes(be, n):
    """The scale itself (probed through codes of a one-element-per-level pattern) equals the
    reference bit for bit: l1 and l0 over one tensor of n elements with zeros and tiny values."""
    gen = _gen(n)
    g = torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(6) * 1e3
    g[::7] = 0.0
    if n > 2:
        g[1] = 1e-39  # subnormal fp32 |c| after the beta1 scaling: exercises log_parts' exponent path
    m = torch.zeros(n)
    offs, total = layout([n])
    for kind in reference.SCALE_KINDS:
        ref = reference.int8_local_step([g], [m], offs, total, 0.5, kind, 127)
        got = be.int8_local_step([g], [m], offs, total, 0.5, kind, 127)
        assert_same(ref[0], got[0], f"int8 codes ({kind})")


def test_ordered_sum_and_det_math_pinned():
    """The reference's defined arithmetic, pinned on values computed here by hand."""
    # 3 blocks + a partial one: lane sums in index order, lane tree, block order
    v = torch.arange(1, 3 * reference.SUM_BLOCK + 11, dtype=torch.float64)
    total = float(v.numel() * (v.numel() + 1) // 2)  # integers < 2**53: every order is exact here
    assert reference.ordered_sum(v) == total
    # an order-sensitive case: 1e16 then 1.0s in lane 0 vanish one by one, but in other lanes they sum first
    w = torch.zeros(reference.SUM_BLOCK, dtype=torch.float64)
    w[0] = 1e16
    w[256] = 1.0  # lane 0, after 1e16: 1e16 + 1 == 1e16 in fp64
    w[1] = 1.0    # lane 1
    w[257] = 1.0  # lane 1: lane 1 holds 2.0; the tree adds lane 1 into lane 0 -> 1e16 + 2
    assert reference.ordered_sum(w) == 1e16 + 2.0
    assert reference.det_exp(0.0) == 1.0 and reference.det_exp(math.log(8.0)) == pytest.approx(8.0, rel=1e-15)
    e, lm = reference.log_parts(torch.tensor([1.0, 2.0, 3.0, 1e-40]))
    assert e.tolist()[:2] == [0, 1] and lm.tolist()[:2] == [0.0, 0.0]
    assert lm[2].item() == pytest.approx(math.log(0.75), rel=1e-15) and e[2].item() == 2  # 3 = 0.75 * 2**2
    assert e[3].item() * math.log(2) + lm[3].item() == pytest.approx(math.log(float(torch.tensor(1e-40))), rel=1e-14)
    assert reference.int8_scale(torch.tensor([0.0, 4.0, 1.0]), "l0") == 2.0
    assert reference.int8_scale(torch.tensor([0.0, 4.0, 1.0, -3.0]), "l1") == 2.0


# ----------------------------------------------------------------------------- (h) int8 apply
@pytest.mark.parametrize("pdt", STATE_DTYPES)
def test_int8_apply(be, pdt):
    sizes = SMALL + [BIG]
    offs, total = layout(sizes)
    q = torch.randint(-127, 128, (total,), dtype=torch.int8, generator=_gen(8))
    q[::3] = 0
    params = make_params(sizes, (pdt, F32), 8)
    for wd in (0.0, 0.3):
        p_ref, p_cpp = clone_all(params), clone_all(params)
        d_ref = reference.int8_apply(q, p_ref, offs, 2e-3, wd)
        d_cpp = be.int8_apply(q, p_cpp, offs, 2e-3, wd)
        assert_same_float(d_ref, d_cpp, "delta")
        for i, (a, b) in enumerate(zip(p_ref, p_cpp)):
            assert_same_float(a, b, f"param[{i}]")


# ----------------------------------------------------------------------------- (i) single-process Lion step
def lion_bucket(sizes, pdt, gdt, mdt, seed):
    """Params, grads and momenta of ``sizes``: planted NaN/+-Inf grads, exact zeros of c (g = m = 0,
    and g = -0.0 with m = 0: c = -0.0 + 0.0), -0.0 parameters, a subnormal momentum."""
    grads, moms, _, _ = make_bucket(sizes, gdt, mdt, seed)
    gen = _gen(seed + 1)
    params = []
    for i, n in enumerate(sizes):
        p = torch.randn(n, generator=gen)
        if n >= 12:
            p[:3] = -0.0
            grads[i][10], moms[i][10] = -0.0, 0.0
            if mdt == F32:
                moms[i][11] = 1e-41
        params.append(p.to(pdt))
    return params, grads, moms


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("mdt", STATE_DTYPES)
@pytest.mark.parametrize("gdt", GRAD_DTYPES)
@pytest.mark.parametrize("pdt", STATE_DTYPES)
def test_lion_step(isa_be, pdt, gdt, mdt, wd):
    """The fused step == reference.lion_step (lion.py's arithmetic) element by element, two steps."""
    seed = 30 + 7 * STATE_DTYPES.index(pdt) + GRAD_DTYPES.index(gdt) + 3 * STATE_DTYPES.index(mdt)
    params, grads, moms = lion_bucket(SMALL + [0, 65 + 64 * 3], pdt, gdt, mdt, seed)
    p_ref, m_ref, p_cpp, m_cpp = clone_all(params), clone_all(moms), clone_all(params), clone_all(moms)
    for step in range(2):
        reference.lion_step(p_ref, grads, m_ref, 3e-3, wd, 0.9, 0.99)
        isa_be.lion_step(p_cpp, grads, m_cpp, 3e-3, wd, 0.9, 0.99)
        for i in range(len(params)):
            assert_same_float(p_ref[i], p_cpp[i], f"param[{i}] (step {step})")
            assert_same_float(m_ref[i], m_cpp[i], f"momentum[{i}] (step {step})")
    assert any(bool(torch.isnan(m).any()) for m in m_ref)  # the planted NaN really went through


@pytest.mark.parametrize("pdt,gdt,mdt", [(F32, F32, F32), (BF16, BF16, BF16), (F32, F16, BF16)])
def test_lion_step_big(be, pdt, gdt, mdt):
    """Several threads and work items per tensor; odd betas (1 - beta not exact in fp32)."""
    params, grads, moms = lion_bucket([BIG, 9, 70001], pdt, gdt, mdt, 41)
    p_ref, m_ref, p_cpp, m_cpp = clone_all(params), clone_all(moms), clone_all(params), clone_all(moms)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        reference.lion_step(p_ref, grads, m_ref, 1e-4, 0.3, 0.95, 0.98)
        be.lion_step(p_cpp, grads, m_cpp, 1e-4, 0.3, 0.95, 0.98)
    finally:
        torch.set_num_threads(old)
    for i in range(len(params)):
        assert_same_float(p_ref[i], p_cpp[i], f"param[{i}]")
        assert_same_float(m_ref[i], m_cpp[i], f"momentum[{i}]")


def test_lion_step_mixed_call(be):
    """Tensors the kernel does not take (a non-contiguous parameter, float64, fp16 parameters, a
    non-contiguous gradient) take the reference path inside the same call: the same bits."""
    gen = _gen(50)
    base = torch.randn(40, 3, generator=gen)
    mk = lambda: [base.clone()[:, 1], torch.randn(9, dtype=torch.float64, generator=_gen(51)),  # noqa: E731
                  torch.randn(17, generator=_gen(52)).half(), torch.randn(33, generator=_gen(53))]
    grads = [torch.randn(40, generator=gen), torch.randn(9, dtype=torch.float64, generator=gen),
             torch.randn(17, generator=gen).half(), torch.randn(33, 2, generator=gen)[:, 0]]
    moms = [torch.randn(40, generator=gen) * 0.1, torch.zeros(9, dtype=torch.float64), torch.zeros(17),
            torch.randn(33, generator=gen)]
    p_ref, p_cpp, m_ref, m_cpp = mk(), mk(), clone_all(moms), clone_all(moms)
    reference.lion_step(p_ref, grads, m_ref, 1e-2, 0.1, 0.9, 0.99)
    be.lion_step(p_cpp, grads, m_cpp, 1e-2, 0.1, 0.9, 0.99)
    for i in range(4):
        assert_same_float(p_ref[i], p_cpp[i], f"param[{i}]")
        assert_same_float(m_ref[i], m_cpp[i], f"momentum[{i}]")


# ----------------------------------------------------------------------------- (j) ZeRO sign all-gather apply
def zero_inputs(n, abstain, cast_dtype, seed):
    """Two groups with odd partition sizes, a byte offset, padding inside and at the end; sign rows
    one flag byte longer than the nonzero rows (as the ZeRO adapter sends them)."""
    gen = _gen(seed)
    parts, offs = [37, 5003], [0, 5]
    nbytes = offs[1] + (parts[1] + 7) // 8
    sign = torch.randint(0, 256, (n, nbytes + 1), dtype=torch.uint8, generator=gen)
    nz = None
    if abstain:
        nz = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=gen)
        nz |= torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=gen)
    ranges = [[(0, n * parts[0] - 3)], [(3, 500), (700, 701), (900, n * parts[1] - 11)]]
    targets = [torch.randn(n * p, generator=gen) for p in parts]
    targets[0][2], targets[1][4], targets[1][6], targets[1][7] = float("nan"), -0.0, float("inf"), 0.0
    casts = None if cast_dtype is None else [torch.randn(n * p, generator=gen).to(cast_dtype) for p in parts]
    return sign, nz, reference.zero_layout(n, parts, offs, ranges), targets, casts


def old_zero_loop(sign, nz, targets, casts, layout, lrs, wds):
    """What deepspeed/zero.py did before zero_sign_apply: per group and rank, vote_apply with one voter on
    the partition, padding restored from a copy, then the cast (its padding is left out here: the old
    whole-buffer copy wrote there the unchanged values the buffer already held)."""
    n = sign.shape[0]
    for g, (ps, o) in enumerate(zip(layout.part_numels, layout.byte_offsets)):
        nb = (ps + 7) // 8
        real = torch.zeros(n * ps, dtype=torch.bool)
        for gg, _r, _b, start, numel in layout.rows():
            if gg == g:
                real[start:start + numel] = True
        for j in range(n):
            view = targets[g][j * ps:(j + 1) * ps]
            pad = (~real[j * ps:(j + 1) * ps]).nonzero().reshape(-1)
            keep = view[pad].clone()
            reference.vote_apply(sign[j:j + 1, o:o + nb].contiguous(),
                                 None if nz is None else nz[j:j + 1, o:o + nb].contiguous(), [view], [0], lrs[g],
                                 wds[g], 1, "zero", "majority", 1, 0, return_delta=False)
            view[pad] = keep
        if casts is not None:
            casts[g][real] = targets[g][real].to(casts[g].dtype)


@pytest.mark.parametrize("abstain", [False, True])
@pytest.mark.parametrize("n", [1, 2, 4, 7])
def test_zero_reference_equals_the_per_rank_loop(n, abstain):
    sign, nz, lay, targets, casts = zero_inputs(n, abstain, BF16, 60 + n)
    t_old, c_old = clone_all(targets), clone_all(casts)
    old_zero_loop(sign, nz, t_old, c_old, lay, [1e-3, 3e-3], [0.1, 0.0])
    reference.zero_sign_apply(sign, nz, targets, casts, lay, [1e-3, 3e-3], [0.1, 0.0])
    for a, b in zip(t_old + c_old, targets + casts):
        assert_same_float(a, b, "per-rank loop vs reference")


@pytest.mark.parametrize("cast_dtype", [None, BF16, F16])
@pytest.mark.parametrize("abstain", [False, True])
@pytest.mark.parametrize("n", NS)
def test_zero_sign_apply(isa_be, n, abstain, cast_dtype):
    """All partitions of all groups in one call == the reference; padding (and the casts' padding) untouched."""
    sign, nz, lay, targets, casts = zero_inputs(n, abstain, cast_dtype, 70 + n)
    t_cpp, c_cpp = clone_all(targets), None if casts is None else clone_all(casts)
    t0 = clone_all(targets)
    for lrs, wds in (([1e-3, 3e-3], [0.1, 0.0]), ([2e-3, 2e-3], [0.0, 0.5])):
        reference.zero_sign_apply(sign, nz, targets, casts, lay, lrs, wds)
        isa_be.zero_sign_apply(sign, nz, t_cpp, c_cpp, lay, lrs, wds)
        for i in range(2):
            assert_same_float(targets[i], t_cpp[i], f"target[{i}]")
            if casts is not None:
                assert_same_float(casts[i], c_cpp[i], f"cast[{i}]")
    n1 = n * 5003
    for a, b in ((0, 3), (500, 700), (701, 900), (n1 - 11, n1)):  # padding of group 1 never moves
        assert_same_float(t_cpp[1][a:b], t0[1][a:b], "padding")


def test_zero_layout_pieces():
    lay = reference.zero_layout(3, [10, 4], [0, 2], [[(5, 25)], None])
    assert lay.rows() == ((0, 0, 5, 5, 5), (0, 1, 0, 10, 10), (0, 2, 0, 20, 5),
                          (1, 0, 16, 0, 4), (1, 1, 16, 4, 4), (1, 2, 16, 8, 4))
    assert lay.plane_bytes == 3 and lay.pieces.shape == (6, 5)
    for bad in ([[(5, 31)], None], [[(6, 8), (7, 9)], None]):
        with pytest.raises(ValueError, match="real range"):
            reference.zero_layout(3, [10, 4], [0, 2], bad)


# ----------------------------------------------------------------------------- fallbacks / checks
def run_isolated(code: str) -> str:
    """Run ``code`` in a fresh interpreter. On some platforms a C++ exception thrown through a
    JIT-built extension crashes the process (a segfault): isolated, it fails one test instead of
    killing the whole run."""
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600,
                         env=os.environ.copy())
    assert res.returncode == 0, (f"isolated run failed with rc={res.returncode} (negative: killed by a signal, "
                                 f"-11 = segfault)\nstdout:\n{res.stdout}\nstderr:\n{res.stderr[-4000:]}")
    return res.stdout


@pytest.mark.dist
def test_raw_entries_keep_memory_safe(be):
    """The extension's entries (and torch.ops.lioncub.*, the same functions) called around ops.py
    with arguments it would refuse raise instead of writing out of bounds (bindings.cpp's LC_INV
    invariants; the Python API never reaches them). Run in a subprocess: they throw C++ exceptions."""
    out = run_isolated("""
        import torch
        from lioncub_ds.kernels import loader, ops
        ext = loader.build_cpp_extension()
        seg = torch.zeros(1, 2, dtype=torch.int64)
        off = lambda *v: torch.tensor(v, dtype=torch.int64)
        z8 = torch.zeros(8)
        cases = [
            ("inside its bucket", lambda: ext.local_step([z8], [z8], [], off(4), 16, 0.9, 0.99, False)),
            ("inside its bucket", lambda: ext.local_step([torch.zeros(16)], [torch.zeros(16)], [], off(8), 16, 0.9,
                                                         0.99, False)),
            ("unsupported dtype", lambda: ext.local_step([z8], [z8.double()], [], off(0), 8, 0.9, 0.99, False)),
            ("offsets", lambda: ext.local_step([z8], [z8], [], off(0, 8), 8, 0.9, 0.99, False)),
            ("uint8 planes", lambda: ext.shard_vote(torch.zeros(2, 8), None, 1, 0, seg)),
            ("nonzero planes", lambda: ext.shard_vote(torch.zeros(2, 8, dtype=torch.uint8),
                                                      torch.zeros(3, 8, dtype=torch.uint8), 1, 0, seg)),
            ("segments", lambda: ext.shard_vote(torch.zeros(2, 8, dtype=torch.uint8), None, 1, 0,
                                                torch.zeros(3, dtype=torch.int64))),
            ("paired tensors", lambda: ext.lion_step([z8], [torch.zeros(9)], [z8], 1e-3, 0.0, 0.9, 0.99)),
            ("unsupported dtype", lambda: ext.lion_step([z8.half()], [z8], [z8], 1e-3, 0.0, 0.9, 0.99)),
            ("layout row", lambda: ext.zero_sign_apply(torch.zeros(2, 1, dtype=torch.uint8), None, [torch.zeros(32)],
                                                       [torch.zeros(0)], torch.tensor([[0, 0, 0, 0, 16]]), [1e-3],
                                                       [0.0])),
            ("inside its bucket", lambda: torch.ops.lioncub.vote_apply(
                torch.zeros(1, 1, dtype=torch.uint8), None, [torch.zeros(16)], off(0), 1e-3, 0.0, 1, 2, 0, 1, seg,
                False)),
        ]
        for want, call in cases:
            try:
                call()
            except RuntimeError as exc:
                assert "lioncub internal" in str(exc) and want in str(exc), (want, str(exc))
            else:
                raise AssertionError("no error for " + want)
        print("ok")
    """)
    assert out.strip().endswith("ok")


class _Boom:
    """A stand-in extension: any call into it fails the test (bad input must be stopped in Python)."""

    def __getattr__(self, name):
        raise AssertionError(f"the extension entry {name!r} was reached with bad input")


def _bad_calls(backend):
    u8 = torch.zeros(2, 8, dtype=torch.uint8)
    p = [torch.zeros(8)]
    meta = torch.zeros(8, device="meta")
    return [
        ("offsets\\[0\\]=4", lambda: backend.local_step([torch.zeros(8)], [torch.zeros(8)], [4], 16, 0.9, 0.99)),
        ("does not fit", lambda: backend.local_step([torch.zeros(16)], [torch.zeros(16)], [8], 16, 0.9, 0.99)),
        ("momenta\\[0\\] has", lambda: backend.local_step([torch.zeros(8)], [torch.zeros(9)], [0], 16, 0.9, 0.99)),
        ("total", lambda: backend.local_step([torch.zeros(8)], [torch.zeros(8)], [0], 12, 0.9, 0.99)),
        ("momenta_out must be a list of 1", lambda: backend.local_step([torch.zeros(8)], [torch.zeros(8)], [0], 16,
                                                                         0.9, 0.99, True, momenta_out=[])),
        ("momenta_out\\[0\\] .* must match", lambda: backend.local_step([torch.zeros(8)], [torch.zeros(8)], [0], 16,
                                                                         0.9, 0.99, True,
                                                                         momenta_out=[torch.zeros(8).bfloat16()])),
        ("momenta_out\\[0\\] shares memory", lambda: (lambda m: backend.local_step(
            [torch.zeros(8)], [m], [0], 16, 0.9, 0.99, True, momenta_out=[m.view(-1)]))(torch.zeros(8))),
        ("capacity must be", lambda: backend.abstain_list(u8[0], u8[1], 9)),
        ("nonzero must be a 1-D uint8", lambda: backend.abstain_list(u8, u8, 0)),
        ("mask has", lambda: backend.abstain_list(u8[0], u8[0, :4], 0)),
        ("overlap", lambda: backend.vote_apply(u8, None, [torch.zeros(16), torch.zeros(8)], [0, 8], 1e-3, 0.0, 1,
                                               "hash", "majority", 2)),
        ("tie_break", lambda: backend.vote_apply(u8, None, p, [0], 1e-3, 0.0, 1, "coin", "majority", 2)),
        ("vote must", lambda: backend.vote_apply(u8, None, p, [0], 1e-3, 0.0, 1, "hash", "mean", 2)),
        ("world_size", lambda: backend.vote_apply(u8, None, p, [0], 1e-3, 0.0, 1, "hash", "majority", 0)),
        ("nonzero planes", lambda: backend.vote_apply(u8, torch.zeros(3, 8, dtype=torch.uint8), p, [0], 1e-3, 0.0, 1,
                                                      "hash", "majority", 2)),
        ("params\\[0\\] is on meta", lambda: backend.vote_apply(u8, None, [meta], [0], 1e-3, 0.0, 1, "hash",
                                                                    "majority", 2)),
        ("position 0", lambda: backend.vote_apply(u8, None, p, [0], 1e-3, 0.0, 1, "hash", "majority", 2,
                                                  segments=[[8, 0]])),
        ("sign must be a 2-D", lambda: backend.shard_vote(u8[0], None, 1, "hash", 0)),
        ("lane width", lambda: backend.count_lanes(u8, None, 3)),
        ("does not fit a 1-bit lane", lambda: backend.count_lanes(u8, None, 1)),
        ("cnt_lanes has", lambda: backend.lanes_apply(torch.zeros(16, dtype=torch.uint8),
                                                      torch.zeros(8, dtype=torch.uint8), 2, 2, p, [0], 1e-3, 0.0, 1,
                                                      "hash", "majority")),
        ("quant scale", lambda: backend.int8_local_step([torch.zeros(8)], [torch.zeros(8)], [0], 8, 0.9, "l2", 31)),
        ("qsum is on meta", lambda: backend.int8_apply(torch.zeros(8, dtype=torch.int8, device="meta"),
                                                       [torch.zeros(8)], [0], 1e-3, 0.0)),
        # a uint8 sum reads 200 as +200 where int8 reads -56; levels outside 1..127 wrap
        ("qsum must be the int8 sum", lambda: backend.int8_apply(torch.full((8,), 200, dtype=torch.uint8),
                                                                 [torch.zeros(8)], [0], 1e-3, 0.0)),
        ("levels must be an integer in 1..127", lambda: backend.int8_local_step([torch.zeros(8)], [torch.zeros(8)],
                                                                                [0], 8, 0.9, "l1", 0)),
        ("levels must be an integer in 1..127", lambda: backend.int8_local_step([torch.zeros(8)], [torch.zeros(8)],
                                                                                [0], 8, 0.9, "l1", 300)),
        ("levels must be an integer in 1..127", lambda: backend.int8_local_step([torch.zeros(8)], [torch.zeros(8)],
                                                                                [0], 8, 0.9, "l1", 3.0)),
        ("same length", lambda: backend.lion_step(p, p, [], 1e-3, 0.0, 0.9, 0.99)),
        ("grads\\[0\\] has 9", lambda: backend.lion_step(p, [torch.zeros(9)], p, 1e-3, 0.0, 0.9, 0.99)),
        ("momenta\\[0\\] is on meta", lambda: backend.lion_step(p, p, [meta], 1e-3, 0.0, 0.9, 0.99)),
        ("grads\\[0\\] must be a torch.Tensor", lambda: backend.lion_step(p, [1.0], p, 1e-3, 0.0, 0.9, 0.99)),
        ("ZeroLayout", lambda: backend.zero_sign_apply(u8, None, p, None, [(0, 0, 0, 0, 8)], [1e-3], [0.0])),
        ("world_size", lambda: backend.zero_sign_apply(u8, None, [torch.zeros(8)], None,
                                                       reference.zero_layout(1, [8], [0]), [1e-3], [0.0])),
        ("need", lambda: backend.zero_sign_apply(u8[:, :1], None, [torch.zeros(32)], None,
                                                 reference.zero_layout(2, [16], [0]), [1e-3], [0.0])),
        ("targets\\[0\\] must be 1-D", lambda: backend.zero_sign_apply(u8, None, [torch.zeros(8)], None,
                                                                        reference.zero_layout(2, [8], [0]), [1e-3],
                                                                        [0.0])),
        ("casts\\[0\\] must be 1-D", lambda: backend.zero_sign_apply(u8, None, [torch.zeros(16)],
                                                                      [torch.zeros(15, dtype=torch.bfloat16)],
                                                                      reference.zero_layout(2, [8], [0]), [1e-3],
                                                                      [0.0])),
        ("lrs has", lambda: backend.zero_sign_apply(u8, None, [torch.zeros(16)], None,
                                                    reference.zero_layout(2, [8], [0]), [], [0.0])),
        ("nonzero", lambda: backend.zero_sign_apply(u8, torch.zeros(3, 8, dtype=torch.uint8), [torch.zeros(16)], None,
                                                    reference.zero_layout(2, [8], [0]), [1e-3], [0.0])),
        ("targets\\[0\\] is on meta", lambda: backend.zero_sign_apply(u8, None, [torch.zeros(16, device="meta")],
                                                                       None, reference.zero_layout(2, [8], [0]),
                                                                       [1e-3], [0.0])),
    ]


@pytest.mark.parametrize("kind", ["cpp", "cuda"])
def test_public_entries_validate_before_the_extension(kind):
    """Every public kernel entry rejects bad input with a ValueError that names the argument, and
    never reaches the extension (where a TORCH_CHECK could crash the process)."""
    backend = ops.NativeBackend(_Boom(), "cpu" if kind == "cpp" else "cuda")
    for want, call in _bad_calls(backend):
        with pytest.raises((ValueError, TypeError), match=want):
            call()


def test_cuda_backend_momenta_out_composite_on_reference_tensors():
    """The CUDA backend's momenta_out path (votes, then the momenta copied and advanced) gives the
    reference's results; CPU tensors take the reference inside it, never the extension."""
    grads, moms, offs, total = make_bucket(SMALL, F32, BF16, 17)
    outs, want_m = [torch.zeros_like(m) for m in moms], clone_all(moms)
    want = reference.local_step(grads, want_m, offs, total, 0.9, 0.99, True)
    kept = clone_all(moms)
    got = ops.NativeBackend(_Boom(), "cuda").local_step(grads, kept, offs, total, 0.9, 0.99, True, momenta_out=outs)
    for what, a, b in zip(("sign", "nonzero", "n_nonfinite", "n_zero"), want, got):
        assert_same(a, b, what)
    for i in range(len(moms)):
        assert_same_float(want_m[i], outs[i], f"momenta_out[{i}]")
        assert_same_float(moms[i], kept[i], f"momenta[{i}]")


@pytest.mark.parametrize("kind", ["cpp", "cuda"])
def test_unsupported_tensors_take_the_reference_path(kind):
    """float64 / non-contiguous parameters (and CPU tensors given to the CUDA backend) are updated
    by the reference, bit for bit, without touching the extension."""
    backend = ops.NativeBackend(_Boom(), "cpu" if kind == "cpp" else "cuda")
    sizes = [64, 9]
    offs, total = layout(sizes)
    sign, nz = random_planes(4, total // 8, 9, abstain=True)
    base = torch.randn(64, 2)
    mk = lambda: [base.clone()[:, 0], torch.randn(9, dtype=torch.float64, generator=_gen(3))]  # noqa: E731
    p_ref, p_be = mk(), mk()
    d_ref = reference.vote_apply(sign, nz, p_ref, offs, 1e-3, 0.0, 2, "hash", "majority", 4)
    d_be = backend.vote_apply(sign, nz, p_be, offs, 1e-3, 0.0, 2, "hash", "majority", 4)
    assert_same_float(d_ref, d_be, "delta")
    for a, b in zip(p_ref, p_be):
        assert_same_float(a, b, "param")
    g64 = [torch.randn(16, dtype=torch.float64)]
    m64 = [torch.zeros(16, dtype=torch.float64)]
    ref = reference.local_step(g64, [m64[0].clone()], [0], 16, 0.9, 0.99)
    got = backend.local_step(g64, [m64[0].clone()], [0], 16, 0.9, 0.99)
    for what, a, b in zip(("sign", "nonzero", "n_nonfinite", "n_zero"), ref, got):
        assert_same(a, b, what)

    # momentum over several tensors: each momentum is its own tensor (no bucket offsets), so none
    # "overlap" (the CUDA backend once rejected every list longer than one as overlapping)
    grads = [torch.randn(n, dtype=torch.float64, generator=_gen(5 + n)) for n in (13, 8, 1)]
    m_ref = [torch.randn(g.numel(), dtype=torch.float64, generator=_gen(9)) for g in grads]
    m_be = [m.clone() for m in m_ref]
    for m, g in zip(m_ref, grads):
        reference.momentum_update(m, g, 0.99)
    backend.momentum_update_list(m_be, grads, 0.99)
    for a, b in zip(m_ref, m_be):
        assert_same_float(a, b, "momentum")

    # the Lion step and the ZeRO apply with float64 / non-contiguous tensors
    p_ref, p_be = mk(), mk()
    g2 = [torch.randn(64, generator=_gen(6)), torch.randn(9, dtype=torch.float64, generator=_gen(7))]
    m_ref, m_be = [torch.zeros(64), torch.zeros(9, dtype=torch.float64)], [torch.zeros(64),
                                                                            torch.zeros(9, dtype=torch.float64)]
    reference.lion_step(p_ref, g2, m_ref, 1e-3, 0.1, 0.9, 0.99)
    backend.lion_step(p_be, g2, m_be, 1e-3, 0.1, 0.9, 0.99)
    for a, b in zip(p_ref + m_ref, p_be + m_be):
        assert_same_float(a, b, "lion step")
    lay = reference.zero_layout(4, [16], [0], [[(3, 60)]])
    t_ref = [torch.randn(64, dtype=torch.float64, generator=_gen(8))]
    t_be = clone_all(t_ref)
    reference.zero_sign_apply(sign, nz, t_ref, None, lay, [1e-3], [0.1])
    backend.zero_sign_apply(sign, nz, t_be, None, lay, [1e-3], [0.1])
    assert_same_float(t_ref[0], t_be[0], "zero apply")


def test_bf16_nan_matches_torch(be):
    """fp32 -> bf16 of a NaN (any sign or payload) gives 0x7FC0, torch's scalar rule, on both ISA
    paths (csrc/common; the CUDA side shares the function)."""
    nan_bits = torch.tensor([0x7FC00000, 0x7F800001, -0x00400000, 0x7FFFFFFF], dtype=torch.int32)
    for isa in ("avx2", "baseline"):
        be.set_isa(isa)
        try:
            m = torch.zeros(4, dtype=torch.bfloat16)
            g = nan_bits.view(torch.float32).clone()
            be.momentum_update_list([m], [g], 0.5)  # m <- 0.5*0 + 0.5*NaN = NaN, stored as bf16
        finally:
            be.set_isa("auto")
        assert m.view(torch.int16).tolist() == [0x7FC0] * 4, [hex(v & 0xFFFF) for v in m.view(torch.int16).tolist()]
    # torch's scalar conversion (c10::BFloat16) gives 0x7FC0; its vectorized CPU cast gives 0xFFFF, so the
    # bit-exact comparisons elsewhere treat any NaN as equal to any NaN
    ref = torch.tensor(float("nan"), dtype=torch.bfloat16)
    assert ref.view(torch.int16).item() == 0x7FC0


# ----------------------------------------------------------------------------- tie rule: layout independence
# docs/conventions.md: a tie breaks by (step, the element's index inside its parameter), so the same votes give
# the same Δ whatever the bucket size, the parameter order or a parameter's place in its bucket.
TIE_PARAMS = {"a": 37, "b": 100, "c": 13}
TIE_LAYOUTS = [[["a", "b", "c"]], [["c"], ["b", "a"]], [["b", "c", "a"]], [["a"], ["b"], ["c"]]]


def tie_votes(n, seed, abstain):
    """Per-parameter votes of n ranks in {-1, +1} (and 0 when abstaining), ties everywhere possible."""
    gen = _gen(seed)
    out = {}
    for name, numel in TIE_PARAMS.items():
        v = torch.where(torch.rand(n, numel, generator=gen) < 0.5, 1, -1).to(torch.int8)
        if n % 2 == 0:  # every other element an exact tie: half the ranks +1, half -1
            v[: n // 2, ::2] = 1
            v[n // 2:, ::2] = -1
        if abstain:
            v[0, 1::5] = 0
            v[:, 3::11] = 0
        out[name] = v
    return out


def bucket_planes(names, votes, n):
    """The bucket's offsets, padded size and per-rank (sign, nonzero) planes [n, total/8]."""
    offs, o = [], 0
    for name in names:
        offs.append(o)
        o += (TIE_PARAMS[name] + 7) // 8 * 8
    total = reference.padded_numel(o, n)
    full = torch.zeros(n, total, dtype=torch.int8)
    for name, off in zip(names, offs):
        full[:, off:off + TIE_PARAMS[name]] = votes[name]
    sign = torch.stack([reference.pack_bits(r > 0) for r in full])
    nz = torch.stack([reference.pack_bits(r != 0) for r in full])
    return offs, total, sign, nz


def run_layout(layout, votes, n, step, abstain, fn):
    """Zero parameters per name, updated by fn(names, params, offs, total, sign, nz) per bucket."""
    params = {name: torch.zeros(numel) for name, numel in TIE_PARAMS.items()}
    for names in layout:
        offs, total, sign, nz = bucket_planes(names, votes, n)
        fn(names, [params[nm] for nm in names], offs, total, sign, nz if abstain else None)
    return params


def assert_layouts_agree(results, what):
    first = results[0]
    for k, res in enumerate(results[1:], 1):
        for name in TIE_PARAMS:
            assert_same_float(res[name], first[name], f"{what}: parameter {name!r}, layout {k} vs layout 0")
    moved = torch.cat([first[nm] for nm in TIE_PARAMS])
    assert bool((moved != 0).any())


def _both_backends(be):
    return [("torch", kernels.TorchBackend()), ("cpp", be)]


@pytest.mark.parametrize("n,abstain", [(2, False), (4, False), (4, True), (3, True)])
def test_tie_outcome_independent_of_layout_vote_apply(be, n, abstain):
    votes = tie_votes(n, 11 * n + abstain, abstain)
    for bname, backend in _both_backends(be):
        for step in (1, 2):
            def fn(names, ps, offs, total, sign, nz):
                backend.vote_apply(sign, nz, ps, offs, 1.0, 0.0, step, "hash", "majority", n)
            res = [run_layout(lay, votes, n, step, abstain, fn) for lay in TIE_LAYOUTS]
            assert_layouts_agree(res, f"{bname} vote_apply step {step}")


@pytest.mark.parametrize("n,abstain", [(2, False), (4, True)])
def test_tie_outcome_independent_of_layout_pbit_lanes(be, n, abstain):
    votes = tie_votes(n, 13 * n + abstain, abstain)
    p = reference.lane_bits_for(n)
    for bname, backend in _both_backends(be):
        def fn(names, ps, offs, total, sign, nz):
            plus = cnt = None
            for r in range(n):  # pbit: each rank packs its own plane into lanes, a SUM adds them
                pr, cr = backend.count_lanes(sign[r:r + 1], None if nz is None else nz[r:r + 1], p)
                plus = pr.clone() if plus is None else plus + pr
                if cr is not None:
                    cnt = cr.clone() if cnt is None else cnt + cr
            backend.lanes_apply(plus, cnt, n, p, ps, offs, 1.0, 0.0, 5, "hash", "majority")
        res = [run_layout(lay, votes, n, 5, abstain, fn) for lay in TIE_LAYOUTS]
        assert_layouts_agree(res, f"{bname} lanes_apply")


@pytest.mark.parametrize("n,abstain", [(2, False), (4, True)])
def test_tie_outcome_independent_of_layout_sharded(be, n, abstain):
    """The 1bit phase 1 on every shard (its own tie-index table), then the 1-voter decode."""
    votes = tie_votes(n, 17 * n + abstain, abstain)
    for bname, backend in _both_backends(be):
        def fn(names, ps, offs, total, sign, nz):
            shard = total // 8 // n
            rs, rz = [], []
            for r in range(n):
                segs = reference.tie_segments(offs, start=r * shard * 8, stop=(r + 1) * shard * 8)
                s, z = backend.shard_vote(sign[:, r * shard:(r + 1) * shard].contiguous(),
                                          None if nz is None else nz[:, r * shard:(r + 1) * shard].contiguous(),
                                          7, "hash", segs)
                rs.append(s)
                rz.append(z)
            backend.vote_apply(torch.cat(rs).view(1, -1), torch.cat(rz).view(1, -1), ps, offs, 1.0, 0.0, 7, "hash",
                               "majority", 1)
        res = [run_layout(lay, votes, n, 7, abstain, fn) for lay in TIE_LAYOUTS]
        assert_layouts_agree(res, f"{bname} shard_vote")


class _Hub:
    """In-process stand-in for a process group of n ranks run as threads (tests only)."""

    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n)
        self.slots = [None] * n

    def exchange(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class _Done:
    """What an ``async_op=True`` collective returns: ``wait()`` gives the output."""

    def __init__(self, out):
        self.out = out

    def wait(self):
        return self.out


class _ThreadColl:
    def __init__(self, hub, rank):
        self.hub, self.rank, self.world_size = hub, rank, hub.n

    def all_gather(self, inp, purpose, async_op=False, riders=None):
        out = torch.stack([t.reshape(-1) for t in self.hub.exchange(self.rank, inp.reshape(-1).clone())])
        return _Done(out) if async_op else out

    def all_to_all(self, inp, purpose, async_op=False, riders=None):
        rows = self.hub.exchange(self.rank, inp.clone())
        out = torch.stack([r[self.rank] for r in rows])
        return _Done(out) if async_op else out

    def all_reduce_(self, tensor, purpose, op=None, async_op=False):
        vals = self.hub.exchange(self.rank, tensor.clone())
        tot = vals[0].clone()
        for v in vals[1:]:
            tot += v  # uint8 / int8 wrap like a SUM all-reduce (lanes never carry)
        tensor.copy_(tot)
        return _Done(tensor) if async_op else tensor


ALGOS = [("allgather", "majority"), ("1bit", "majority"), ("1bit", "average"), ("pbit", "majority")]


@pytest.mark.parametrize("algo,vote", ALGOS)
@pytest.mark.parametrize("n,abstain", [(2, False), (4, True)])
def test_tie_outcome_independent_of_layout_comm_algorithms(be, algo, vote, n, abstain):
    """Every comm algorithm that decides ties, run on n in-process ranks (threads): the same
    votes give the same parameters whatever the bucket layout, and every rank agrees."""
    from lioncub_ds.comm import VoteJob, make_algorithm

    votes = tie_votes(n, 19 * n + abstain, abstain)
    for bname, backend in _both_backends(be):
        results = []
        for layout in TIE_LAYOUTS:
            per_rank = []
            for _ in range(n):
                per_rank.append({name: torch.zeros(numel) for name, numel in TIE_PARAMS.items()})
            for names in layout:
                offs, total, sign, nz = bucket_planes(names, votes, n)
                hub = _Hub(n)
                algorithm = make_algorithm(algo)

                def rank_run(r):
                    job = VoteJob([per_rank[r][nm] for nm in names], offs, total, None, 1.0, 0.0, 3, "hash", vote,
                                  sign=sign[r].clone(), nonzero=nz[r].clone() if abstain else None)
                    algorithm.run(job, _ThreadColl(hub, r), backend)

                with ThreadPoolExecutor(max_workers=n) as pool:
                    for f in [pool.submit(rank_run, r) for r in range(n)]:
                        f.result(timeout=60)
            for r in range(1, n):
                for name in TIE_PARAMS:
                    assert_same_float(per_rank[r][name], per_rank[0][name], f"{bname} {algo}: rank {r} vs rank 0")
            results.append(per_rank[0])
        assert_layouts_agree(results, f"{bname} {algo}/{vote}")


def test_vote_job_rejects_a_flat_base():
    from lioncub_ds.comm import VoteJob

    with pytest.raises(TypeError, match="param_starts"):
        VoteJob([], [], 8, 1024, 1.0, 0.0, 1, "hash", "majority")
