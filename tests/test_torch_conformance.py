"""torch.optim conformance (issue 22, section 1): what PyTorch's own optimizer tests check, asked of
Lion and LionCub. Modelled on torch's suite, not copied from it: copies (deepcopy, pickle) step like
the original; state_dict round trips across parameter and momentum dtypes resume bit-exactly;
add_param_group after steps; step(closure); step hooks; zero_grad(set_to_none=False); the argument
forms torch accepts and refuses; an LR scheduler (and a tensor lr) driving lr; foreach vs single
tensor bits in fp16/bf16; complex parameters refused.

Single-process checks run in this process (LionCub with torch.distributed not initialized is the
N = 1 case); the distributed ones on 2 real gloo ranks.
"""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from lioncub_ds import Lion, LionCub
from lioncub_ds.config import LionCubConfigError
from dist_helpers import run_ranks

pytestmark = pytest.mark.unit

CLASSES = (Lion, LionCub)
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MOMENTUM_DTYPES = (torch.float32, torch.bfloat16)


def _params(dtype=torch.float32, seed=0, shapes=((40, 25), (25,), (7,))):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(params, step, seed=100):
    g = torch.Generator().manual_seed(seed + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


def _run(opt, params, steps, first=0):
    for k in range(first, first + steps):
        for p, g in zip(params, _grads(params, k)):
            p.grad = g
        opt.step()


def _params_of(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype
        assert torch.equal(x.detach(), y.detach())


# ----------------------------------------------------------------------------- copies
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("mdtype", MOMENTUM_DTYPES)
@pytest.mark.parametrize("before", [0, 3])
def test_a_copy_steps_exactly_like_the_original(cls, how, mdtype, before):
    params = _params(torch.bfloat16)
    opt = cls(params, lr=0.01, weight_decay=0.1, momentum_dtype=mdtype)
    _run(opt, params, before)
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    twin_params = _params_of(twin)
    assert all(a is not b for a, b in zip(twin_params, params))
    _run(opt, params, 4, first=before)
    _run(twin, twin_params, 4, first=before)
    _assert_same(twin_params, params)
    for p, q in zip(params, twin_params):
        assert twin.state[q]["exp_avg"].dtype == mdtype
        assert torch.equal(twin.state[q]["exp_avg"], opt.state[p]["exp_avg"])
    if cls is LionCub:
        assert twin.config == opt.config and twin.step_count == opt.step_count == before + 4


def _copy_ranks(rank, world_size, overlap):
    torch.manual_seed(0)
    params = _params(torch.float32, shapes=((33, 5), (17,)))
    opt = LionCub(params, lr=0.01, weight_decay=0.1, comm="1bit", overlap=overlap)
    for k in range(2):
        for p, g in zip(params, _grads(params, 10 * rank + k)):
            p.grad = g
        opt.step()
    twin = copy.deepcopy(opt)
    tp = _params_of(twin)
    for k in range(2, 4):
        grads = _grads(params, 10 * rank + k)
        for ps, o in ((params, opt), (tp, twin)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            o.step()
    return {"orig": [p.detach() for p in params], "copy": [p.detach() for p in tp], "steps": twin.step_count,
            "rank_of_copy": twin.rank}


@pytest.mark.dist
def test_a_deepcopy_votes_like_the_original_on_two_ranks():
    res = run_ranks(_copy_ranks, 2, False, timeout=300, env={"LIONCUB_KERNELS": "torch"})
    for r in (0, 1):
        _assert_same(res[r]["copy"], res[r]["orig"])
        assert res[r]["steps"] == 4 and res[r]["rank_of_copy"] == r
    _assert_same(res[0]["orig"], res[1]["orig"])  # the replicas agree (the vote ran on both)


# ----------------------------------------------------------------------------- state_dict
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("pdtype", PARAM_DTYPES)
@pytest.mark.parametrize("mdtype", MOMENTUM_DTYPES)
def test_state_dict_resume_is_bit_exact(cls, pdtype, mdtype):
    """7 + 15 steps uninterrupted == 7 steps, state_dict through torch.save, a fresh optimizer, 15 steps."""
    shapes = ((1000,), (13, 3))
    ref_params = _params(pdtype, shapes=shapes)
    ref = cls(ref_params, lr=3e-3, weight_decay=0.05, momentum_dtype=mdtype)
    _run(ref, ref_params, 22)

    params = _params(pdtype, shapes=shapes)
    first = cls(params, lr=3e-3, weight_decay=0.05, momentum_dtype=mdtype)
    _run(first, params, 7)
    import io
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = cls(resumed_params, lr=3e-3, weight_decay=0.05, momentum_dtype=mdtype)
    resumed.load_state_dict(saved)
    for p in resumed_params:
        assert resumed.state[p]["exp_avg"].dtype == mdtype  # not the parameter's dtype (torch's cast)
        assert resumed.state[p]["exp_avg"].shape == p.shape
    _run(resumed, resumed_params, 15, first=7)
    _assert_same(resumed_params, ref_params)


# ----------------------------------------------------------------------------- add_param_group, closure, hooks
@pytest.mark.parametrize("cls", CLASSES)
def test_add_param_group_after_steps(cls):
    a, b = _params(shapes=((10, 4), (6,)))
    ra, rb = (torch.nn.Parameter(t.detach().clone()) for t in (a, b))
    opt = cls([a], lr=0.01)
    ref = Lion([ra], lr=0.01)
    for k in range(2):
        a.grad, ra.grad = (torch.full_like(a, k + 1.0),) * 2
        opt.step(), ref.step()
    opt.add_param_group({"params": [b], "lr": 0.05, "weight_decay": 0.2})
    ref.add_param_group({"params": [rb], "lr": 0.05, "weight_decay": 0.2})
    assert opt.param_groups[1]["betas"] == opt.defaults["betas"]
    for k in range(3):
        for p, q, g in zip((a, b), (ra, rb), _grads([a, b], k)):
            p.grad, q.grad = g, g.clone()
        opt.step(), ref.step()
    _assert_same([a, b], [ra, rb])
    assert not torch.equal(b.detach(), _params(shapes=((10, 4), (6,)))[1].detach())  # the new group moved


def _add_group_ranks(rank, world_size):
    a, b = _params(shapes=((10, 4), (6,)))
    b0 = b.detach().clone()
    opt = LionCub([a], lr=0.01, comm="1bit")
    for k in range(2):
        a.grad = _grads([a], 10 * rank + k)[0]
        opt.step()
    opt.add_param_group({"params": [b], "lr": 0.05})
    for k in range(2, 4):
        a.grad, b.grad = _grads([a, b], 10 * rank + k)
        opt.step()
    return {"a": a.detach(), "b": b.detach(), "b0": b0}


@pytest.mark.dist
def test_add_param_group_after_distributed_steps_is_voted_on():
    res = run_ranks(_add_group_ranks, 2, timeout=300, env={"LIONCUB_KERNELS": "torch"})
    assert not torch.equal(res[0]["b"], res[0]["b0"])  # the new group is stepped (not left out of the buckets)
    assert torch.equal(res[0]["b"], res[1]["b"]) and torch.equal(res[0]["a"], res[1]["a"])


@pytest.mark.parametrize("cls", CLASSES)
def test_step_with_closure_returns_the_loss_and_uses_its_gradients(cls):
    torch.manual_seed(0)
    model, twin = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(8, 5)
    opt, ref = cls(model.parameters(), lr=0.01), Lion(twin.parameters(), lr=0.01)
    calls = []

    def closure(m=model, o=opt):
        o.zero_grad()
        assert torch.is_grad_enabled()
        loss = m(x).pow(2).sum()
        loss.backward()
        calls.append(float(loss.detach()))
        return loss

    loss = opt.step(closure)
    assert calls == [float(loss.detach())]
    ref.step(lambda: closure(twin, ref))
    _assert_same(list(model.parameters()), list(twin.parameters()))


@pytest.mark.parametrize("cls", CLASSES)
def test_step_pre_and_post_hooks(cls):
    params = _params()
    opt = cls(params, lr=0.01)
    seen = []
    pre = opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(
        ("pre", float(o.state[params[0]]["step"]) if o.state[params[0]] else None)))
    post = opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", float(o.state[params[0]]["step"]))))
    _run(opt, params, 2)
    assert seen == [("pre", None), ("post", 1.0), ("pre", 1.0), ("post", 2.0)]
    pre.remove(), post.remove()
    _run(opt, params, 1, first=2)
    assert len(seen) == 4


@pytest.mark.parametrize("cls", CLASSES)
def test_zero_grad_set_to_none_false_keeps_zero_tensors(cls):
    params = _params()
    ref_params = _params()
    opt, ref = cls(params, lr=0.01), Lion(ref_params, lr=0.01)
    _run(opt, params, 2), _run(ref, ref_params, 2)
    grads = [p.grad for p in params]
    opt.zero_grad(set_to_none=False)
    ref.zero_grad(set_to_none=False)
    assert all(p.grad is g and not g.any() for p, g in zip(params, grads))
    opt.step(), ref.step()  # a zero gradient: the momentum alone moves the parameters, as in Lion
    _assert_same(params, ref_params)


# ----------------------------------------------------------------------------- argument forms
@pytest.mark.parametrize("cls", CLASSES + (torch.optim.AdamW,))
def test_a_bare_tensor_is_refused_as_torch_does(cls):
    for bad in (torch.randn(3, 2), torch.nn.Parameter(torch.randn(3, 2))):
        with pytest.raises(TypeError, match="iterable of Tensors or dicts"):
            cls(bad, lr=0.01)


@pytest.mark.parametrize("cls", CLASSES)
def test_a_group_whose_params_is_one_tensor(cls):
    w, rw = _params(shapes=((4, 3),)), _params(shapes=((4, 3),))
    opt = cls([{"params": w[0]}], lr=0.01)
    ref = Lion(rw, lr=0.01)
    assert opt.param_groups[0]["params"] == [w[0]]
    _run(opt, w, 2), _run(ref, rw, 2)
    _assert_same(w, rw)


@pytest.mark.parametrize("cls", CLASSES)
def test_named_parameters_all_or_none(cls):
    p, q = _params(shapes=((3,), (2,)))
    opt = cls([("weight", p), ("bias", q)], lr=0.01)
    assert opt.param_groups[0]["param_names"] == ["weight", "bias"]
    with pytest.raises(ValueError, match="with/without names"):
        cls([("weight", p), q], lr=0.01)
    with pytest.raises(ValueError, match="with/without names"):
        cls([{"params": [("weight", p), q]}], lr=0.01)


@pytest.mark.parametrize("cls", CLASSES)
def test_complex_parameters_are_refused(cls):
    z = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
    with pytest.raises(LionCubConfigError, match="complex"):
        cls([z], lr=0.01)
    opt = cls(_params(), lr=0.01)
    with pytest.raises(LionCubConfigError, match="complex"):
        opt.add_param_group({"params": [z]})
    assert len(opt.param_groups) == 1


def test_lioncub_refuses_a_parameter_listed_twice():
    p, q = _params(shapes=((3,), (2,)))
    with pytest.raises(LionCubConfigError, match="more than once"):
        LionCub([p, q, p], lr=0.01)


# ----------------------------------------------------------------------------- lr
@pytest.mark.parametrize("cls", CLASSES)
def test_an_lr_scheduler_drives_lr(cls):
    params, ref_params = _params(), _params()
    opt = cls(params, lr=0.1, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)
    # the reference: Lion with the lr set by hand each step
    ref = Lion(ref_params, lr=0.1, weight_decay=0.1)
    for k in range(4):
        ref.param_groups[0]["lr"] = 0.1 * 0.5 ** k
        _run(opt, params, 1, first=k)
        _run(ref, ref_params, 1, first=k)
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 4)
    _assert_same(params, ref_params)


@pytest.mark.parametrize("cls", CLASSES)
def test_a_one_element_tensor_lr_is_accepted(cls):
    params, ref_params = _params(), _params()
    lr = torch.tensor(0.02)
    opt = cls(params, lr=lr, weight_decay=0.1)
    ref = Lion(ref_params, lr=0.02, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for k in range(3):
        _run(opt, params, 1, first=k)
        _run(ref, ref_params, 1, first=k)
        sched.step()
        ref.param_groups[0]["lr"] = float(opt.param_groups[0]["lr"])
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    _assert_same(params, ref_params)
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        cls(_params(), lr=torch.tensor([0.1, 0.2]))


# ----------------------------------------------------------------------------- bits
@pytest.mark.parametrize("pdtype", (torch.float16, torch.bfloat16, torch.float32, torch.float64))
@pytest.mark.parametrize("lr,wd", [(1e-2, 0.1), (0.1, 0.3), (3e-4, 1.0)])
def test_foreach_and_single_tensor_give_the_same_bits(pdtype, lr, wd):
    """fp16 with weight decay once differed in 322 of 10,000 elements (torch._foreach_mul_ rounds a
    half-precision product differently from Tensor.mul_)."""
    out = []
    for foreach in (True, False):
        params = _params(pdtype, shapes=((10000,), (77,)))
        opt = Lion(params, lr=lr, weight_decay=wd, foreach=foreach)
        _run(opt, params, 3)
        out.append(params)
    _assert_same(out[0], out[1])


# ----------------------------------------------------------------------------- a review's findings
@pytest.mark.parametrize("cls", CLASSES)
def test_a_group_given_as_a_generator_keeps_its_parameters(cls):
    """``add_param_group({"params": model.head.parameters()})`` and a constructor group given as a
    generator: every parameter is added (the check once read the generator and torch got it empty)."""
    body, head = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)
    opt = cls(body.parameters(), lr=1e-3)
    opt.add_param_group({"params": head.parameters()})
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    opt2 = cls([{"params": body.parameters()}, {"params": (p for p in head.parameters()), "lr": 2e-3}], lr=1e-3)
    assert [len(g["params"]) for g in opt2.param_groups] == [2, 2]
    for p in head.parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in head.parameters()]
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, head.parameters()))


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("bad", [dict(lr=-1.0), dict(lr="0.1"), dict(betas=(1.5, 0.9)), dict(weight_decay=-1),
                                 dict(lr=float("nan"))])
def test_a_groups_own_settings_are_checked_before_it_is_added(cls, bad):
    opt = cls(_params(), lr=1e-3)
    key = next(iter(bad))
    with pytest.raises(LionCubConfigError, match=rf"param group #1\): invalid {key}="):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], **bad})
    assert len(opt.param_groups) == 1
    with pytest.raises(LionCubConfigError, match=rf"param group #0\): invalid {key}="):
        cls([{"params": _params(), **bad}], lr=1e-3)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("fault", ["sparse", "lr"])
def test_a_bad_later_group_leaves_every_group_unstepped(cls, fault):
    """A sparse gradient or a lr tensor of two elements in the second group: the step raises and the
    first group's parameters, momenta and step counters are unchanged (they were stepped first)."""
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    opt = cls([{"params": [a]}, {"params": [b]}], lr=1e-2)
    a.grad = torch.ones(3)
    if fault == "sparse":
        b.grad = torch.zeros(4).to_sparse()
    else:
        b.grad = torch.ones(4)
        opt.param_groups[1]["lr"] = torch.tensor([1e-2, 1e-2])
    with pytest.raises((RuntimeError, ValueError)):
        opt.step()
    assert torch.equal(a.detach(), torch.zeros(3))
    assert "exp_avg" not in opt.state[a] or torch.equal(opt.state[a]["exp_avg"], torch.zeros(3))
    assert getattr(opt, "step_count", 0) == 0


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("which", [0, 1])
def test_a_momentum_of_another_shape_is_refused_at_load(cls, which):
    """Same element count, other shape (the first or a later parameter): refused before anything is
    loaded (the kernels would read it in the wrong order and step silently wrong)."""
    shapes = [(5,), (5,)]
    shapes[which] = (3, 4)
    src_p = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    src = cls(src_p, lr=1e-3)
    for q in src_p:
        q.grad = torch.randn(q.shape)
    src.step()
    shapes[which] = (4, 3)
    opt = cls([torch.nn.Parameter(torch.zeros(s)) for s in shapes], lr=1e-3)
    with pytest.raises(LionCubConfigError, match=rf"parameter #{which} has shape \(3, 4\), the parameter \(4, 3\)"
                                                 r".*no state was changed"):
        opt.load_state_dict(src.state_dict())
    assert len(opt.state) == 0


@pytest.mark.parametrize("cls", CLASSES)
def test_a_group_with_lr_zero_is_accepted_as_torch_does(cls):
    """A frozen subset ({"lr": 0}), or a group added while a warm-up scheduler holds lr at 0."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = cls([{"params": [a]}, {"params": [b], "lr": 0.0}], lr=1e-2)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(4))], "lr": 0.0})
    a.grad, b.grad = torch.ones(3), torch.ones(2)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(2)) and not torch.equal(a.detach(), torch.ones(3))


@pytest.mark.parametrize("cls", CLASSES)
def test_a_set_of_parameters_is_refused_as_torch_does(cls):
    with pytest.raises(TypeError, match="ordered collections"):
        cls([{"params": set(_params())}], lr=1e-3)
    opt = cls(_params(), lr=1e-3)
    with pytest.raises(TypeError, match="ordered collections"):
        opt.add_param_group({"params": {torch.nn.Parameter(torch.zeros(2))}})
    with pytest.raises(TypeError, match="ordered collections"):
        LionCub(set(_params()), lr=1e-3)  # LionCub: every rank must list them in one order


def test_lion_steps_after_loading_a_lioncub_state_dict():
    src_p, p = _params(), _params()
    src = LionCub(src_p, lr=1e-3)
    for q, g in zip(src_p, _grads(src_p, 0)):
        q.grad = g
    src.step()
    lion = Lion(p, lr=1e-3)
    lion.load_state_dict(src.state_dict())
    for q, g in zip(p, _grads(p, 1)):
        q.grad = g
    lion.step()  # was KeyError: 'foreach' (LionCub's groups have no such key)
    assert all(torch.isfinite(q).all() for q in p)


def test_one_process_reloads_its_own_state_with_a_non_finite_momentum_as_lion_does():
    """N = 1 never skips (the momentum keeps a NaN, as Lion's does); its own checkpoint loads again."""
    for cls in CLASSES:
        p = _params()
        opt = cls(p, lr=1e-3)
        for q in p:
            q.grad = torch.full_like(q, float("nan"))
        opt.step()
        cls(_params(), lr=1e-3).load_state_dict(opt.state_dict())


def _names_after_load(rank, world_size):
    """A checkpoint whose param_names name other parameters (Megatron's common state is global rank
    0's: another pipeline stage's names, here one fewer) loads into a distributed LionCub whose
    groups carry their own names: the live names stay, every parameter still steps; a group with no
    names of its own does not take a list of another length; a group whose names do not fit its
    parameters is refused at the step, by name, instead of leaving parameters out of the buckets."""
    torch.manual_seed(0)
    src = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    a = LionCub([("stage0.a", src[0]), ("stage0.b", src[1]), ("stage0.c", src[2])], lr=0.01)
    for p in src:
        p.grad = torch.randn(5)
    a.step()
    sd = a.state_dict()
    sd["param_groups"][0]["param_names"] = ["stage0.a", "stage0.b"]
    mine = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    b = LionCub([("stage1.x", mine[0]), ("stage1.y", mine[1]), ("stage1.z", mine[2])], lr=0.01)
    b.load_state_dict(sd)
    out = {"names": list(b.param_groups[0]["param_names"])}
    before = [p.detach().clone() for p in mine]
    for p in mine:
        p.grad = torch.randn(5)
    b.step()
    out["moved"] = [not torch.equal(x, p) for x, p in zip(before, mine)]
    plain = LionCub([torch.nn.Parameter(torch.randn(5)) for _ in range(3)], lr=0.01)
    plain.load_state_dict(sd)
    out["plain_has_names"] = "param_names" in plain.param_groups[0]
    broken = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    c = LionCub([("u", broken[0]), ("v", broken[1]), ("w", broken[2])], lr=0.01)
    c.param_groups[0]["param_names"] = ["u", "v"]
    for p in broken:
        p.grad = torch.randn(5)
    try:
        c.step()
        out["broken"] = None
    except ValueError as exc:
        out["broken"] = str(exc)
    return out


def test_loaded_param_names_never_replace_the_live_ones():
    for r in run_ranks(_names_after_load, 2):
        assert r["names"] == ["stage1.x", "stage1.y", "stage1.z"], r
        assert r["moved"] == [True, True, True], r
        assert not r["plain_has_names"], r
        assert r["broken"] and "2 param_names for 3 parameters" in r["broken"], r
