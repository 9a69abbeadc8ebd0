"""Parameter groups added with add_param_group are agreed across ranks (issue 48, item 3).

A group added on some ranks only made gloo abort one rank ("collective mismatch", exit -6: the
ranks' layouts, hence their collectives, differed), and a group of another shape on one rank
((6, 5) against (5, 5): the same padded buckets) was stepped silently. Now the step plan keeps
its layout until the next step, whose flags tell every rank that some rank holds a group its
layout lacks; every rank then compares its groups and raises the same LionCubConfigError when
they differ, with parameters and optimizer state unchanged; when they agree the step runs with
the new group. 4 gloo ranks, one launch: flat voting and node voters 2 x 2, the group added
after a step or before the first one.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lioncub_ds import LionCub
from dist_helpers import run_ranks

pytestmark = pytest.mark.dist

ENV = {"LIONCUB_KERNELS": "torch"}
ODD_RANK = 2


def _grads(params, rank, step):
    gen = torch.Generator().manual_seed(100 * rank + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _state(opt, params):
    sd = opt.state_dict()
    node = sd["lioncub"].get("node")
    momenta = ([t.clone() for _, t in sorted(node["momentum"].items())] if node is not None
               else [st["exp_avg"].clone() for _, st in sorted(sd["state"].items())])
    return [p.detach().clone() for p in params], momenta, opt.step_count


def _case(rank, voters, case, when):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 5))
    b = torch.nn.Parameter(torch.randn(6 if case == "shape" and rank == ODD_RANK else 5, 5))
    kw = dict(voters="node", node_size=2) if voters == "node" else {}
    opt = LionCub([a], lr=0.01, comm="1bit", **kw)
    steps = 1 if when == "after_a_step" else 0
    for step in range(steps):
        _grads([a], rank, step)
        opt.step()
    if not (case == "missing" and rank == ODD_RANK):
        opt.add_param_group({"params": [b], "lr": 0.02})
    before = _state(opt, [a])
    error = None
    try:
        for step in range(steps, steps + 2):
            _grads([a, b], rank, step)
            opt.step()
    except Exception as exc:  # noqa: BLE001 - the test compares type and message
        error = (type(exc).__name__, str(exc))
    after = _state(opt, [a])
    unchanged = all(torch.equal(x, y) for x, y in zip(before[0] + before[1], after[0] + after[1]))
    flat = torch.cat([a.detach().reshape(-1), b.detach().reshape(-1)])
    every = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    same_shape = case != "shape"
    if same_shape:
        dist.all_gather(every, flat)
    dist.barrier()
    return {"error": error, "unchanged": unchanged and before[2] == after[2], "steps": opt.step_count,
            "replicas": same_shape and all(torch.equal(flat, e) for e in every)}


CASES = [(v, c, w) for v in ("rank", "node") for c in ("missing", "shape", "same") for w in ("after_a_step",)]
CASES += [("rank", c, "before_the_first_step") for c in ("missing", "same")]


def _all(rank, world):
    return {key: _case(rank, *key) for key in CASES}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, 4, timeout=400, env=ENV)


@pytest.mark.parametrize("voters,case,when", [k for k in CASES if k[1] != "same"])
def test_a_group_added_differently_raises_the_same_error_on_every_rank(results, voters, case, when):
    errors = [results[r][voters, case, when]["error"] for r in range(4)]
    assert all(e is not None for e in errors), errors
    assert len(set(errors)) == 1, errors  # the same error, word for word, on every rank
    kind, msg = errors[0]
    assert kind == "LionCubConfigError", msg
    assert msg.startswith("LionCub: the parameter groups differ across the ranks at step"), msg
    assert "add_param_group" in msg and "no state was changed" in msg, msg
    if case == "shape":
        assert f"rank {ODD_RANK}: group 1 #0: shape (6, 5)" in msg and "group 1 #0: shape (5, 5)" in msg, msg
    else:
        assert "parameters: ranks 0, 1, 3: 2 in 2 groups; rank 2: 1 in 1 group" in msg, msg
    for r in range(4):
        assert results[r][voters, case, when]["unchanged"], r  # parameters, momenta, step count


@pytest.mark.parametrize("voters,case,when", [k for k in CASES if k[1] == "same"])
def test_a_group_added_on_every_rank_is_stepped(results, voters, case, when):
    for r in range(4):
        got = results[r][voters, case, when]
        assert got["error"] is None, got["error"]
        assert got["steps"] == (3 if when == "after_a_step" else 2) and got["replicas"], got


def _freeze_then_add(rank, world_size, kw, dtype, add):
    """Steps on [a, b]; a frozen after step 3; then (``add``) a group [c] added and one more step.
    Returns (b before that step, b after it, the step's error or None)."""
    from lioncub_ds.config import LionCubConfigError

    def grads(ps, step):
        g = torch.Generator().manual_seed(1000 * rank + step)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    torch.manual_seed(0)
    a = torch.nn.Parameter((torch.randn(5, 5) * 10).to(dtype))
    b = torch.nn.Parameter(torch.randn(6, 5).to(dtype))
    c = torch.nn.Parameter(torch.randn(4, 4).to(dtype))
    opt = LionCub([a, b], lr=0.01, comm="1bit", **kw)
    for step in range(3):
        grads([a, b], step)
        opt.step()
    a.requires_grad_(False)
    a.grad = None
    grads([b], 3)
    opt.step()
    before = b.detach().clone()
    if add:
        opt.add_param_group({"params": [c]})
        grads([b, c], 4)
    else:
        grads([b], 4)
    try:
        opt.step()
        error = None
    except LionCubConfigError as exc:
        error = str(exc)
    return before, b.detach().clone(), error


def _freeze_cases(rank, world_size):
    out = {}
    for name, kw, dtype in (("flat", {}, torch.float32), ("node", dict(voters="node", node_size=2), torch.float32),
                            ("master_only", dict(node_size=2), torch.bfloat16)):
        out[name] = (_freeze_then_add(rank, world_size, kw, dtype, False),
                     _freeze_then_add(rank, world_size, kw, dtype, True))
    return out


def test_a_group_added_after_a_parameter_was_frozen():
    """Flat voting keeps momenta per parameter: the added group changes nothing for b. With shards
    kept by bucket (node voters, master-only) the frozen parameter moved the old buckets: refused on
    every rank by name, b untouched (it was stepped with another parameter's shard, or crashed)."""
    for r in run_ranks(_freeze_cases, 2, timeout=300, env=ENV):
        (_, plain, _), (_, added, error) = r["flat"]
        assert error is None and torch.equal(plain, added)
        for name in ("node", "master_only"):
            (_, _, fine), (before, after, error) = r[name]
            assert fine is None, (name, fine)
            assert error and "frozen or unfrozen since the first step" in error and "no parameter" in error, error
            assert torch.equal(before, after), name
