"""The host cost of a kernel call (issue 46, item 2; docs/kernels.md, "Host cost per call"): a
bucket's layout made once (``backend.layout_for``) and passed as ``offsets``; the local steps'
outputs a workspace of the layout, reused (no allocation, no ATen op at all in the steady state);
every call of a known layout one gated C++ call that answers None when an argument does not fit,
after which the Python checks raise the same errors as before (or take the reference path). The
pipeline keeps one layout per bucket."""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lioncub_ds import kernels
from lioncub_ds.comm.abstain import real_mask
from lioncub_ds.kernels import ops, reference

from dist_helpers import SmallNet, run_ranks

B1, B2, LR, WD, N = 0.9, 0.99, 1e-3, 0.1, 4
SIZES = [13, 1, 40, 64]


@pytest.fixture(scope="module")
def be():
    from lioncub_ds.kernels.loader import load
    try:
        backend = load("cpp")
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"C++ extension unavailable: {exc}")
    if backend._try is None:
        pytest.skip("the extension has no gated entries")
    return backend


class _Ops(TorchDispatchMode):
    """Records every ATen op dispatched while active (C++ calls from inside the extension included)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _bucket(seed, sizes=SIZES):
    gen = torch.Generator().manual_seed(seed)
    offs, off = [], 0
    for n in sizes:
        offs.append(off)
        off += (n + 7) // 8 * 8
    total = reference.padded_numel(off, N)
    return [torch.randn(n, generator=gen) for n in sizes], offs, total


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.view(torch.uint8) if a.is_floating_point() else a, b.view(torch.uint8) if b.is_floating_point() else b)
    return a == b


pytestmark = pytest.mark.unit


def test_layout_for_of_each_backend():
    _, offs, total = _bucket(0)
    assert kernels.TorchBackend().layout_for(offs, total) is offs  # the reference checks every call
    lay = ops.NativeBackend(None, "cuda").layout_for(offs, total)
    assert isinstance(lay, ops.Layout) and lay.owned and lay.offsets == offs and lay.limit == total
    assert ops.layout_for(lay, total) is lay
    with pytest.raises(ValueError, match=r"offsets\[1\]=4"):
        ops.NativeBackend(None, "cuda").layout_for([0, 4], 16)
    with pytest.raises(ValueError, match="total"):
        ops.NativeBackend(None, "cuda").layout_for([0], 12)


def test_the_steady_state_allocates_nothing(be):
    """With the bucket's layout, the second and later calls of the local steps write into the same
    outputs (data_ptr stable) and dispatch no ATen op at all (no allocation); the applies without Δ
    and the abstention list allocate only their one (empty or small) output. Every result equals the
    reference's, bit for bit."""
    momenta, offs, total = _bucket(1)
    params = _bucket(2)[0]
    ref_m, ref_p = [m.clone() for m in momenta], [p.clone() for p in params]
    lay = be.layout_for(offs, total)
    mask = real_mask(offs, SIZES, total, "cpu")
    seg = reference.tie_segments(offs)
    ptrs = None
    for step in range(1, 4):
        grads = _bucket(10 + step)[0]
        grads[1].zero_()  # an abstention
        want = reference.local_step(grads, ref_m, offs, total, B1, B2, True, device_counts=True)
        want_b = reference.bbit_local_step(grads, [m.clone() for m in ref_m], offs, total, B1, B2, "l1", 2, "dither",
                                           7, seg, False, True)
        want_q = reference.int8_local_step(grads, ref_m, offs, total, B1, "l1", 31, True)
        with _Ops() as mode:
            got = be.local_step(grads, momenta, lay, total, B1, B2, True, device_counts=True)
            got_b = be.bbit_local_step(grads, momenta, lay, total, B1, B2, "l1", 2, "dither", 7, seg, False,
                                       device_counts=True)
            got_q = be.int8_local_step(grads, momenta, lay, total, B1, "l1", 31, device_counts=True)
        if step > 1:
            assert mode.ops == [], mode.ops
        with _Ops() as mode:
            words = be.abstain_list(got[1], mask, 4)
        for a, b in zip(want + want_b + want_q, got + got_b + got_q):
            assert _same(a, b)
        assert torch.equal(words, reference.abstain_list(want[1], mask, 4))
        assert [o for o in mode.ops if "empty" not in o] == [] or step == 1, mode.ops  # the list: its one output
        assert all(torch.equal(a, b) for a, b in zip(ref_m, momenta))
        now = [t.data_ptr() for t in (got[0], got[1], got[2], got_b[0], got_q[0])]
        assert ptrs is None or now == ptrs
        ptrs = now
        # the applies (Δ not returned: nothing allocated)
        sign = torch.randint(0, 256, (N, total // 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(step))
        lanes = torch.randint(0, 256, (total * 4 // 8,), dtype=torch.uint8)
        q = torch.randint(-3, 4, (total,), dtype=torch.int8)
        reference.vote_apply(sign, None, ref_p, offs, LR, WD, step, "hash", "majority", N, seg)
        reference.lanes_apply(lanes, None, N, 4, ref_p, offs, LR, WD, step, "hash", "average", seg)
        reference.int8_apply(q, ref_p, offs, LR, WD)
        with _Ops() as mode:
            assert be.vote_apply(sign, None, params, lay, LR, WD, step, "hash", "majority", N, seg, False) is None
            assert be.lanes_apply(lanes, None, N, 4, params, lay, LR, WD, step, "hash", "average", seg, False) is None
            assert be.int8_apply(q, params, lay, LR, WD, False) is None
        # one ATen op each: the 0-element placeholder of the Δ they do not return (the op's schema returns a Tensor)
        assert mode.ops == ["aten.empty.memory_format"] * 3 or step == 1, mode.ops
        assert all(_same(a, b) for a, b in zip(ref_p, params))


def test_an_offsets_list_allocates_its_outputs(be):
    """Callers that pass an offsets list get new outputs every call (found again by the list's
    identity, checked once): a result they keep is never overwritten."""
    grads, offs, total = _bucket(3)
    momenta = [torch.zeros_like(g) for g in grads]
    first = be.local_step(grads, momenta, offs, total, B1, B2, False)
    with _Ops() as mode:
        second = be.local_step([-g for g in grads], momenta, offs, total, B1, B2, False)
    assert any("zeros" in o or "empty" in o for o in mode.ops), mode.ops  # what the layout saves
    assert first[0].data_ptr() != second[0].data_ptr()
    assert torch.equal(first[0], reference.local_step(grads, [m.clone() for m in momenta], offs, total, B1, B2)[0])


def test_a_tensor_that_does_not_fit_gives_the_python_errors(be):
    """The gated entry answers None (no exception leaves C++) when an argument does not fit its
    invariants; the public call then raises the same ValueError as the Python checks, before
    anything is written, or takes the reference path."""
    grads, offs, total = _bucket(4)
    momenta = [torch.zeros_like(g) for g in grads]
    lay = be.layout_for(offs, total)
    ext = be._ext
    bad = [g.clone() for g in grads]
    bufs = ops._local_ws(total)[0]

    def gate(gs, ms=momenta, outs=()):
        return ext.try_local_step_into(gs, ms, outs, lay.table, total, B1, B2, bool(outs), *bufs)

    assert gate(grads) is True
    for gs in (grads[:2], bad[:1] + [torch.zeros(2)] + bad[2:], bad[:2] + [bad[2].double()] + bad[3:],
               bad[:3] + [torch.zeros(128)[::2]], [torch.zeros(13, device="meta")] + bad[1:],
               [torch.zeros(13)] + bad[1:2] + [torch.zeros(80)] + bad[3:]):  # the last: grads[2] overlaps grads[3]
        assert gate(gs) is None
    with pytest.raises(TypeError):  # pybind's conversion: the public call catches it and runs the checks
        gate([1.0] + bad[1:])
    assert gate(grads, momenta[:1] + [torch.zeros(1, dtype=torch.float16)] + momenta[2:]) is None
    assert gate(grads, momenta, [m for m in momenta]) is None  # the momenta themselves: shared memory
    assert gate(grads, momenta, [torch.zeros(13)] * 1 + [torch.zeros(1)] * 3) is None
    # the public call: the same errors as ever, before any kernel runs
    kept = [m.clone() for m in momenta]
    with pytest.raises(ValueError, match=r"grads\[1\] has 2 elements but momenta\[1\] has 1"):
        be.local_step(bad[:1] + [torch.zeros(2)] + bad[2:], momenta, lay, total, B1, B2, True)
    with pytest.raises(ValueError, match=r"momenta_out\[\d\] shares memory"):
        be.local_step(grads, momenta, lay, total, B1, B2, True, momenta_out=[momenta[0].view(-1)] + momenta[1:])
    with pytest.raises(ValueError, match="momenta_out must be a list of 4"):
        be.local_step(grads, momenta, lay, total, B1, B2, True, momenta_out=[])
    with pytest.raises(TypeError, match=r"grads\[0\] must be a torch.Tensor"):
        be.local_step([1.0] + grads[1:], momenta, lay, total, B1, B2, True)
    assert all(torch.equal(a, b) for a, b in zip(kept, momenta))
    # float64 gradients: the reference path, the reference's bits
    g64 = [g.double() for g in grads]
    want = reference.local_step(g64, [m.clone() for m in momenta], offs, total, B1, B2)
    got = be.local_step(g64, [m.clone() for m in momenta], lay, total, B1, B2)
    assert all(_same(a, b) for a, b in zip(want, got))
    # planes of another shape, a parameter of another size: None from the gate, then the Python errors
    params = [torch.zeros_like(g) for g in grads]
    sign = torch.zeros(N, total // 8, dtype=torch.uint8)
    seg = lay.tie_table("cpu")
    assert ext.try_vote_apply(sign, None, params, lay.table, LR, WD, 1, 2, 0, N, seg, False) is not None
    assert ext.try_vote_apply(sign, torch.zeros(N, 1, dtype=torch.uint8), params, lay.table, LR, WD, 1, 2, 0, N,
                              seg, False) is None
    assert ext.try_vote_apply(sign, sign[0], params, lay.table, LR, WD, 1, 2, 0, N, seg, False) is None
    with pytest.raises(ValueError, match="nonzero planes"):
        be.vote_apply(sign, torch.zeros(N, 1, dtype=torch.uint8), params, lay, LR, WD, 1, "hash", "majority", N)
    with pytest.raises(ValueError, match="nonzero planes"):  # [1, B] planes and a [B] plane: not one shape
        be.vote_apply(sign[:1], sign[0], params, lay, LR, WD, 1, "hash", "majority", 1)
    with pytest.raises(ValueError, match="does not fit"):
        be.vote_apply(sign, None, params[:3] + [torch.zeros(65)], lay, LR, WD, 1, "hash", "majority", N)
    # the layout-free calls
    assert ext.try_momentum_update(momenta, grads[:3], B2) is None
    with pytest.raises(ValueError, match=r"momenta\[0\] has 13 elements but grads\[0\] has 14"):
        be.momentum_update_list(momenta, [torch.zeros(14)] + grads[1:], B2)
    with pytest.raises(ValueError, match=r"grads\[0\] has 9"):
        be.lion_step(params, [torch.zeros(9)] + grads[1:], momenta, LR, WD, B1, B2)
    nz = torch.zeros(8, dtype=torch.uint8)
    assert ext.try_abstain_list(nz, nz[:4], 0) is None
    with pytest.raises(ValueError, match="capacity must be"):
        be.abstain_list(nz, nz, 9)
    with pytest.raises(ValueError, match="capacity must be"):
        be.abstain_list(nz, nz, True)
    with pytest.raises(ValueError, match="does not fit a 1-bit lane"):
        be.count_lanes(sign, None, 1)
    with pytest.raises(ValueError, match="sign must be a 2-D"):
        be.shard_vote(sign[0], None, 1, "hash", seg)
    with pytest.raises(ValueError, match="sign must be a 2-D"):
        be.count_lanes(sign[0], sign[0], 4)
    with pytest.raises(ValueError, match="nonzero planes must be uint8"):
        be.bbit_shard_vote(torch.zeros(1, 2, 8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8), 2, 1, "hash",
                           seg)
    with pytest.raises(ValueError, match="vote_bits must be one of"):
        be.bbit_local_step(grads, momenta, lay, total, B1, B2, "l1", True, "dither", 7, seg)
    assert all(torch.equal(a, b) for a, b in zip(kept, momenta))


def test_bad_input_gives_the_python_errors_through_the_gate(be):
    """Every bad call of test_kernels_cpu (there stopped before a stand-in extension) raises the same
    error with the real extension, whose gated entries see it first."""
    from test_kernels_cpu import _bad_calls

    for want, call in _bad_calls(be):
        with pytest.raises((ValueError, TypeError), match=want):
            call()
    # and with the offsets as the bucket's layout (the pipeline's form)
    lay = be.layout_for([0], 16)
    with pytest.raises(ValueError, match="does not fit"):
        be.local_step([torch.zeros(24)], [torch.zeros(24)], lay, 16, 0.9, 0.99)


def test_a_bucket_checked_again_after_new_sizes(be):
    """A layout validated with one set of sizes takes another valid set after the Python checks (node
    voters' pieces, a parameter list of new objects), and refuses one that does not fit."""
    grads, offs, total = _bucket(5)
    lay = be.layout_for(offs, total)
    sign = torch.randint(0, 256, (2, total // 8), dtype=torch.uint8)
    for sizes in (SIZES, [13, 1, 33, 64], SIZES):
        params = [torch.zeros(n) for n in sizes]
        want = [p.clone() for p in params]
        reference.vote_apply(sign, None, want, offs, LR, WD, 1, "hash", "majority", 2)
        be.vote_apply(sign, None, params, lay, LR, WD, 1, "hash", "majority", 2)
        assert all(_same(a, b) for a, b in zip(want, params))
    with pytest.raises(ValueError, match=r"params\[2\] and params\[3\] overlap"):
        be.vote_apply(sign, None, [torch.zeros(n) for n in [13, 1, 41, 64]], lay, LR, WD, 1, "hash", "majority", 2)


# ----------------------------------------------------------------------------- the pipeline
COMMS = {"allgather": {}, "1bit": dict(overlap=True, momentum_double_buffer=True), "pbit": {},
         "int8": dict(quant="l1"), "bbit": dict(quant="l1", momentum_double_buffer=True)}


def _pipeline(rank, world_size):
    """Per comm: 3 steps with the C++ kernels, then the same with the torch backend; the bucket's
    layout object and its outputs across steps; ATen ops inside the local steps' kernel calls."""
    from lioncub_ds import LionCub
    from lioncub_ds.kernels.ops import NativeBackend

    counted = {"ops": []}
    originals = {}
    for name in ("local_step", "bbit_local_step", "int8_local_step"):
        originals[name] = getattr(NativeBackend, name)

        def wrapped(self, *a, _orig=originals[name], **k):
            if not counted.get("on"):
                return _orig(self, *a, **k)
            with _Ops() as mode:
                out = _orig(self, *a, **k)
            counted["ops"] += mode.ops
            return out

        setattr(NativeBackend, name, wrapped)
    # a gated call that answers None (an argument the gate does not take) costs a C++ exception
    # (~20 µs): the pipeline's calls must all fit
    for name in ("_gated", "_local_gated"):
        originals[name] = getattr(NativeBackend, name)

        def observed(self, op, *a, _orig=originals[name], **k):
            r = _orig(self, op, *a, **k)
            if r is None:
                counted.setdefault("misses", []).append(op)
            return r

        setattr(NativeBackend, name, observed)
    # a call that never reached its gate (no known layout, no tie table) runs the extension's
    # checked entry through _run: counted as a miss too
    originals["_run"] = NativeBackend._run

    def unguarded(self, op, *a, _orig=originals["_run"]):
        counted.setdefault("misses", []).append("_run:" + op)
        return _orig(self, op, *a)

    NativeBackend._run = unguarded
    out = {}
    try:
        for comm in COMMS:
            res = {}
            for kind in ("cpp", "torch"):
                os.environ["LIONCUB_KERNELS"] = kind
                torch.manual_seed(0)
                model = SmallNet()
                # buckets of ~16 to 64 elements: 1 to 4 bytes of each plane per rank
                opt = LionCub(model.parameters(), lr=0.01, weight_decay=0.1, bucket_size_mb=0.00006, comm=comm,
                              **COMMS[comm])
                seen, misses = [], []
                for step in range(1, 4):
                    gen = torch.Generator().manual_seed(100 * rank + step)
                    idx, y = torch.randint(0, 6, (4, 3), generator=gen), torch.randn(4, 3, generator=gen)
                    model.zero_grad()
                    torch.nn.functional.mse_loss(model(idx), y).backward()
                    counted["on"], counted["ops"] = kind == "cpp" and step > 1, []
                    opt.step()
                    counted["on"] = False
                    buckets = opt.plan.buckets
                    misses += counted.pop("misses", [])
                    seen.append(([id(b.kernels) for b in buckets],
                                 [sorted(t.data_ptr() for w in b.kernels.layout.ws.values() for t in w[0])
                                  if kind == "cpp" else [] for b in buckets], list(counted["ops"])))
                res[kind] = {"seen": seen, "misses": misses,
                             "steps": [float(opt.state[p]["step"]) for p in model.parameters()], "params": [p.detach().clone() for p in model.parameters()],
                             "momenta": [opt.state[p]["exp_avg"].clone() for p in model.parameters()
                                         if "exp_avg" in opt.state[p]]}
            out[comm] = res
    finally:
        for name, fn in originals.items():
            setattr(NativeBackend, name, fn)
    return out


@pytest.mark.dist
def test_the_pipeline_keeps_one_layout_per_bucket_and_the_reference_bits():
    res = run_ranks(_pipeline, 2, timeout=400)
    for r in range(2):
        for comm in COMMS:
            cpp, ref = res[r][comm]["cpp"], res[r][comm]["torch"]
            ids, ptrs, _ = cpp["seen"][0]
            for step, (i, p, aten) in enumerate(cpp["seen"][1:], 2):
                assert i == ids and p == ptrs, (r, comm, step)  # one layout, the same outputs
                assert aten == [], (r, comm, step, aten)         # the local steps dispatch nothing
            assert all(p for p in ptrs), (r, comm)               # every bucket has its workspace
            assert cpp["misses"] == [], (r, comm, cpp["misses"])  # every kernel call through its gate
            assert cpp["steps"] == ref["steps"] == [3.0] * len(cpp["steps"]), (r, comm)  # the step counters
            for a, b in zip(cpp["params"] + cpp["momenta"], ref["params"] + ref["momenta"]):
                assert torch.equal(a, b), (r, comm)


@pytest.mark.parametrize("gdt,mdt", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                                     (torch.bfloat16, torch.float32)])
def test_the_gated_calls_equal_the_reference_in_every_dtype(be, gdt, mdt):
    """Through the bucket's layout (the gated entries, the workspace), bf16 / fp16 gradients and bf16
    momenta and parameters: every output, momentum and parameter equals the reference bit for bit
    over steps with exact zeros and ties (N = 4 random planes tie often), odd sizes."""
    base, offs, total = _bucket(20)
    momenta = [t.to(mdt) for t in base]
    params = [t.to(mdt) for t in _bucket(21)[0]]
    ref_m, ref_p = [m.clone() for m in momenta], [p.clone() for p in params]
    lay = be.layout_for(offs, total)
    seg = reference.tie_segments(offs)
    for step in range(1, 4):
        grads = [g.to(gdt) for g in _bucket(30 + step)[0]]
        grads[0][:5] = 0  # exact zeros: abstentions
        want = reference.local_step(grads, ref_m, offs, total, B1, B2, False)
        got = be.local_step(grads, momenta, lay, total, B1, B2, False)
        assert all(_same(a, b) for a, b in zip(want, got))
        want_q = reference.int8_local_step(grads, ref_m, offs, total, B1, "l1", 31)
        got_q = be.int8_local_step(grads, momenta, lay, total, B1, "l1", 31)
        assert all(_same(a, b) for a, b in zip(want_q, got_q))
        want_b = reference.bbit_local_step(grads, ref_m, offs, total, B1, B2, "l1", 2, "dither", step, seg)
        got_b = be.bbit_local_step(grads, momenta, lay, total, B1, B2, "l1", 2, "dither", step, seg)
        assert all(_same(a, b) for a, b in zip(want_b, got_b))
        sign = torch.randint(0, 256, (N, total // 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(step))
        nz = torch.randint(0, 256, (N, total // 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
        d_ref = reference.vote_apply(sign, nz, ref_p, offs, LR, WD, step, "hash", "majority", N, seg)
        d_got = be.vote_apply(sign, nz, params, lay, LR, WD, step, "hash", "majority", N, seg)
        assert _same(d_ref, d_got)
        reference.momentum_update(ref_m[1], grads[1], B2)
        be.momentum_update_list(momenta[1:2], grads[1:2], B2)
        assert all(_same(a, b) for a, b in zip(ref_p + ref_m, params + momenta))


# ----------------------------------------------------------------------------- borrowed arguments
# The extension's Python module takes tensors borrowed from their Python objects (csrc/eager_calls.h):
# no reference count of a tensor changes for a call, the objects are held while a call runs without
# the GIL, and a call accepts what pybind's conversion accepted.

def _refcounts(ts):
    """Python's reference count and the C++ TensorImpl's use count of each tensor."""
    import sys
    return [(sys.getrefcount(t), t._use_count()) for t in ts]


def test_borrowed_arguments_leave_every_reference_count_as_it_was(be):
    g, offs, total = _bucket(20)
    m, _, _ = _bucket(21)
    otab = torch.tensor(offs, dtype=torch.int64)
    segs = reference.tie_segments(offs)
    before = _refcounts([*g, *m, otab, segs])
    ext = be._ext
    for _ in range(50):
        ext.local_step(g, m, (), otab, total, B1, B2, True)
        assert ext.try_local_step(g, m, (), otab, total, B1, B2, True) is not None
        ext.bbit_local_step(g, m, (), otab, total, B1, B2, True, 0, 2, 1, 7, segs)
        # a list that fails half-way (a non-tensor after two tensors) lets go of what it took
        assert be._gated("local_step", [g[0], g[1], "x", g[3]], m, (), otab, total, B1, B2, True) is None
        assert be._gated("local_step", g, m, (), "not a tensor", total, B1, B2, True) is None
    assert _refcounts([*g, *m, otab, segs]) == before


def test_borrowed_arguments_take_what_pybind_took(be):
    import collections

    g, offs, total = _bucket(22)
    m, _, _ = _bucket(23)
    want = reference.local_step(g, [t.clone() for t in m], offs, total, B1, B2)
    params = [torch.nn.Parameter(t.clone()) for t in g]  # a tensor subclass
    for grads in (g, tuple(g), collections.deque(g), params, (t for t in g), dict(enumerate(g)).values()):
        got = be._ext.local_step(grads, [t.clone() for t in m], (), torch.tensor(offs, dtype=torch.int64), total,
                                 B1, B2, False)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for bad in ("abc", b"abc", 3, None, [g[0], None], dict(enumerate(g))):
        assert be._gated("local_step", bad, m, (), torch.tensor(offs, dtype=torch.int64), total, B1, B2,
                         False) is None


def test_a_call_without_the_gil_holds_its_tensors(be):
    """A call of >= 16K elements releases the GIL; another thread that drops the only references to
    its tensors meanwhile (and allocates tensors of their sizes, which would take their memory) must
    not free them under the kernel: the bits stay the reference's."""
    import threading

    sizes = [(1 << 20) + 8] * 4  # ~20 ms of kernel: the other thread runs inside the call
    g, offs, total = _bucket(24, sizes)
    m, _, _ = _bucket(25, sizes)
    want = reference.local_step(g, [t.clone() for t in m], offs, total, B1, B2)
    otab = torch.tensor(offs, dtype=torch.int64)
    for _ in range(3):
        grads = [t.clone() for t in g]
        moms = [t.clone() for t in m]
        started, junk = threading.Event(), []

        def drop():
            started.wait()
            grads.clear()  # the call's lists held the last references to its tensors
            moms.clear()
            junk.extend(torch.full((n,), float("nan")) for n in sizes * 2)

        th = threading.Thread(target=drop)
        th.start()
        started.set()
        got = be._ext.local_step(grads, moms, (), otab, total, B1, B2, False)
        th.join()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_call_without_the_gil_owns_its_tensors(be):
    """A GIL-free call takes owning references to its tensors first (a borrow adds none): while it runs,
    each tensor's use count is 2, so torch.utils.swap_tensors from another thread refuses to pull the
    memory from under the kernel. Another thread reads the use count during the call (a call of ~10-50
    ms on one thread; up to 5 tries, for a machine too loaded to run that thread in time)."""
    import threading

    sizes = [(1 << 21) + 8] * 6
    g, offs, total = _bucket(26, sizes)
    m, _, _ = _bucket(27, sizes)
    otab = torch.tensor(offs, dtype=torch.int64)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seen = []
        for _ in range(5):
            grads, moms = [t.clone() for t in g], [t.clone() for t in m]
            started, done = threading.Event(), threading.Event()

            def watch():
                started.wait()
                while not done.is_set():
                    seen.append(grads[-1]._use_count())

            th = threading.Thread(target=watch)
            th.start()
            started.set()
            be._ext.local_step(grads, moms, (), otab, total, B1, B2, False)
            done.set()
            th.join()
            if 2 in seen:
                break
    finally:
        torch.set_num_threads(threads)
    assert 2 in seen, f"use counts seen during the calls: {sorted(set(seen))}"
    assert grads[-1]._use_count() == 1  # and given back after the call
