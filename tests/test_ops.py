"""The kernels as torch custom ops (lioncub_ds/kernels/ops.py, csrc/bindings.cpp): every op passes
torch.library.opcheck on the C++ CPU implementation, a compiled Lion step holds the fused op in its
graph and gives the eager bits, and a bucket's structure is checked once, not per call."""
from __future__ import annotations

import pytest
import torch

from lioncub_ds.kernels import loader, ops, reference

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def be():
    return loader.load("cpp")  # registers the CPU implementations; must build here


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _planes(n, nbytes, seed):
    return torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=_gen(seed))


def _bucket(sizes, dtype, seed):
    gen = _gen(seed)
    offs, cur = [], 0
    for s in sizes:
        offs.append(cur)
        cur = (cur + s + 7) // 8 * 8
    total = reference.padded_numel(cur, 2)
    ts = [torch.randn(s, generator=gen).to(dtype) for s in sizes]
    return ts, offs, total


def _samples():
    """name -> (args, kwargs) of one call of each op, on CPU tensors (odd sizes, bf16 and fp32)."""
    g, offs, total = _bucket([13, 1, 40], torch.float32, 1)
    m = [t.to(torch.bfloat16) for t in _bucket([13, 1, 40], torch.float32, 2)[0]]
    mo = [torch.zeros_like(t) for t in m]
    o = torch.tensor(offs, dtype=torch.int64)
    p = _bucket([13, 1, 40], torch.float32, 3)[0]
    seg = reference.tie_segments(offs)
    sign, nz = _planes(4, total // 8, 4), _planes(4, total // 8, 5)
    lanes = torch.randint(0, 256, (total * 2 // 8,), dtype=torch.uint8, generator=_gen(6))
    qsum = torch.randint(-20, 21, (total,), dtype=torch.int8, generator=_gen(7))
    code_planes = torch.randint(0, 256, (3, 2, total // 8), dtype=torch.uint8, generator=_gen(8))
    lay = reference.zero_layout(2, [24], [0])
    return {
        "local_step": ((g, m, mo, o, total, 0.9, 0.99, True), {}),
        "abstain_list": ((nz[0], nz[1], 3), {}),
        "momentum_update": ((m, g, 0.99), {}),
        "vote_apply": ((sign, nz, p, o, 1e-3, 0.1, 3, 2, 0, 4, seg, True), {}),
        "shard_vote": ((sign, None, 3, 2, seg), {}),
        "count_lanes": ((sign, nz, 2), {}),
        "lanes_apply": ((lanes, lanes.clone(), 3, 2, p, o, 1e-3, 0.1, 3, 2, 1, seg, False), {}),
        "int8_local_step": ((g, m, o, total, 0.9, 0, 31), {}),
        "int8_apply": ((qsum, p, o, 1e-3, 0.1, True), {}),
        "lion_step": ((p, g, [t.float() for t in m], 1e-3, 0.1, 0.9, 0.99), {}),
        "zero_sign_apply": ((_planes(2, 3, 9), None, [torch.randn(48, generator=_gen(10))],
                             [torch.zeros(48, dtype=torch.bfloat16)], lay.pieces, [1e-3], [0.1]), {}),
        "bbit_local_step": ((g, m, [], o, total, 0.9, 0.99, False, 1, 2, 1, 77, seg), {}),
        "bbit_shard_vote": ((code_planes, nz[:3, :code_planes.shape[2]].contiguous(), 2, 3, 2, seg), {}),
    }


def test_every_op_is_declared_once_with_a_fake():
    """One schema per op in the lioncub namespace, each with a fake (meta) implementation."""
    assert set(_samples()) == set(ops.SCHEMAS)
    for name in ops.SCHEMAS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"lioncub::{name}", "Meta") or \
            torch._library.simple_registry.singleton.find(f"lioncub::{name}").fake_impl.kernel is not None, name


@pytest.mark.parametrize("name", sorted(ops.SCHEMAS))
def test_opcheck(be, name):
    """torch.library.opcheck: schema (mutations and aliasing as declared), fake tensor, AOT dispatch."""
    args, kwargs = _samples()[name]
    torch.library.opcheck(ops.op(name), args, kwargs)


def test_fake_shapes_match_the_cpu_kernels(be):
    """The fake implementations give the real outputs' shapes and dtypes (for every op that returns)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name, (args, kwargs) in _samples().items():
        real = ops.op(name)(*[a.clone() if isinstance(a, torch.Tensor) else
                              [t.clone() for t in a] if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)
                              else a for a in args], **kwargs)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else
                         [mode.from_tensor(t) for t in a] if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)
                         else a for a in args]
            fake = ops.op(name)(*fake_args, **kwargs)
        real = real if isinstance(real, tuple) else (real,)
        fake = fake if isinstance(fake, tuple) else (fake,)
        assert [(tuple(t.shape), t.dtype) for t in real if t is not None] == \
            [(tuple(t.shape), t.dtype) for t in fake if t is not None], name


def test_compiled_lion_step_calls_the_fused_op(be, monkeypatch):
    """torch.compile of lioncub_ds.Lion's step: the graph dynamo captures holds lioncub.lion_step,
    and three compiled steps give the eager fused steps' bits (fp32 and bf16 parameters)."""
    from torch._dynamo.backends.debugging import aot_eager

    from lioncub_ds import Lion, kernels

    monkeypatch.setenv("LIONCUB_KERNELS", "auto")
    monkeypatch.setattr(kernels, "_cache", {})
    torch._dynamo.reset()
    gen = _gen(11)
    shapes = [(7, 5), (64,), (3,)]
    init = [torch.randn(s, generator=gen).to(dt) for s, dt in zip(shapes, (torch.float32, torch.bfloat16,
                                                                          torch.float32))]
    grads = [[torch.randn(s, generator=gen).to(t.dtype) for s, t in zip(shapes, init)] for _ in range(3)]
    runs = {}
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    for compiled in (False, True):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = Lion(params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
        step = torch.compile(opt.step, backend=backend) if compiled else opt.step
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            step()
        runs[compiled] = [p.detach().clone() for p in params] + [opt.state[p]["exp_avg"].clone() for p in params]
    torch._dynamo.reset()
    assert any("lioncub.lion_step" in str(gm.graph) for gm in graphs), [str(gm.graph) for gm in graphs]
    for a, b in zip(runs[False], runs[True]):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.uint8) if b.dtype == torch.bfloat16 else b)


def test_a_bucket_is_checked_once_and_fresh_gradients_every_call(be, monkeypatch):
    """The structural checks of a bucket run on its first call only (the layout is found again by
    the offsets object); fresh gradients are still checked every call: another size is refused
    before the extension, float64 takes the reference path (same bits)."""
    calls = []
    real = ops.validate_local
    monkeypatch.setattr(ops, "validate_local", lambda *a, **k: calls.append(1) or real(*a, **k))
    _, offs, total = _bucket([13, 1, 40], torch.float32, 1)
    momenta = [torch.zeros(n) for n in (13, 1, 40)]
    for seed in range(3):
        grads = _bucket([13, 1, 40], torch.float32, 20 + seed)[0]
        want_m = [m.clone() for m in momenta]
        want = reference.local_step(grads, want_m, offs, total, 0.9, 0.99, True)
        got = be.local_step(grads, momenta, offs, total, 0.9, 0.99, True)
        for a, b in zip(want, got):
            assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)
        assert all(torch.equal(a, b) for a, b in zip(want_m, momenta))
    assert len(calls) == 1
    bad = _bucket([13, 2, 40], torch.float32, 30)[0]
    with pytest.raises(ValueError, match=r"grads\[1\] has 2 elements but momenta\[1\] has 1"):
        be.local_step(bad, momenta, offs, total, 0.9, 0.99, True)
    g64 = [g.double() for g in _bucket([13, 1, 40], torch.float32, 31)[0]]
    m_ref = [m.clone() for m in momenta]
    want = reference.local_step(g64, m_ref, offs, total, 0.9, 0.99, True)
    got = be.local_step(g64, momenta, offs, total, 0.9, 0.99, True)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert all(torch.equal(a, b) for a, b in zip(m_ref, momenta))


def test_layouts_do_not_keep_tensors_alive(be):
    """A layout remembers the tensors it checked by weak reference: a dropped model's momenta and
    parameters are freed (an old plan's buckets must not hold GPU memory)."""
    import gc
    import weakref

    _, offs, total = _bucket([16], torch.float32, 1)
    momenta = [torch.zeros(16)]
    be.local_step([torch.ones(16)], momenta, offs, total, 0.9, 0.99, True)
    gone = weakref.ref(momenta[0])
    del momenta
    gc.collect()
    assert gone() is None


def test_a_parameter_list_of_new_objects_is_checked_again(be):
    """Parameters are checked by identity: new tensor objects at the same offsets (node voters'
    views) are checked again, and a wrong size is refused in Python."""
    sign = _planes(2, 4, 3)
    offs = [0, 16]
    for sizes in ((16, 16), (16, 9)):
        params = [torch.zeros(n) for n in sizes]
        be.vote_apply(sign, None, params, offs, 1e-3, 0.0, 1, "hash", "majority", 2)
    with pytest.raises(ValueError, match="does not fit"):
        be.vote_apply(sign, None, [torch.zeros(16), torch.zeros(17)], offs, 1e-3, 0.0, 1, "hash", "majority", 2)
