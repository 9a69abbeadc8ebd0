"""overlap=True with a gradient edited in place through ``.data`` after backward (issue 48, item 1).

``p.grad.data.mul_(c)`` changes the gradient without bumping its ``_version`` (torch counts
in-place edits of the tensor, not of its ``.data`` alias), so a check of ``(p.grad,
p.grad._version)`` alone misses it: the votes started in backward were applied as they were,
on the old gradients (193 of 676 parameters differed from overlap=False in the report). The
step now also compares a device-side fingerprint of the gradients each vote read in backward
(counted into the step's flags: no extra host read), so every rank votes again and the result
equals the plain step bit for bit. Node voters (2 x 2: the edit comes after the node group's
reduce-scatter) and flat voting (4 ranks), the edit on ONE rank, one launch.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lioncub_ds import LionCub
from dist_helpers import run_ranks

pytestmark = pytest.mark.dist

ENV = {"LIONCUB_KERNELS": "torch"}
STEPS, EDIT_STEP, EDIT_RANK = 4, 2, 1


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 23), torch.nn.Tanh(), torch.nn.Linear(23, 7))


def _train(rank, voters, overlap, edit):
    model = _model()
    kw = dict(voters="node", node_size=2) if voters == "node" else {}
    opt = LionCub(model.parameters(), lr=1e-2, weight_decay=0.1, comm="1bit", bucket_size_mb=0.0004,
                  comm_bucket_mb=0.00002, overlap=overlap, **kw)
    gen = torch.Generator().manual_seed(40 + rank)
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        model(torch.randn(6, 9, generator=gen)).pow(2).sum().backward()
        if step == EDIT_STEP and rank == EDIT_RANK:
            for p in model.parameters():  # hand-written clipping of old training loops: no version bump
                edit(p.grad)
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.zeros_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(every, params)
    return {"params": params, "replicas": all(torch.equal(params, e) for e in every),
            "overlap": opt.comm_stats()["overlap"]}


EDITS = {"data_mul": lambda g: g.data.mul_(0.01), "data_zero_first_row": lambda g: g.data[:1].zero_(),
         "inplace_mul": lambda g: g.mul_(0.01)}  # the last bumps the version (caught before the fix too)


def _all(rank, world):
    out = {}
    for voters in ("node", "rank"):
        for name, edit in EDITS.items():
            out[voters, name] = {overlap: _train(rank, voters, overlap, edit) for overlap in (False, True)}
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, 4, timeout=400, env=ENV)


@pytest.mark.parametrize("voters", ["node", "rank"])
@pytest.mark.parametrize("edit", list(EDITS))
def test_a_gradient_edited_after_backward_is_voted_again(results, voters, edit):
    for r in range(4):
        plain, over = results[r][voters, edit][False], results[r][voters, edit][True]
        assert plain["replicas"] and over["replicas"], r
        assert over["overlap"]["batches_launched_in_backward"] > 0, over["overlap"]
        # the edit came after the votes (node voters: the reduce-scatters) started: every rank votes again, once
        assert over["overlap"]["revotes"] == 1, (r, over["overlap"])
        assert torch.equal(over["params"], plain["params"]), f"rank {r}: overlap=True differs from overlap=False"


class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x, use_b):
        h = self.a(x)
        return self.b(h) if use_b else h


def _discarded_backward(rank, world_size, voters, overlap):
    """A backward thrown away by zero_grad() (every rank) while one rank's batch left a parameter
    of the bucket without a gradient: that rank started no vote in backward, the others did."""
    torch.manual_seed(0)
    model = _TwoLayers()
    kw = dict(voters="node", node_size=2) if voters == "node" else {}
    opt = LionCub(model.parameters(), lr=0.01, comm="1bit", overlap=overlap, timeout_s=60, **kw)
    for it in range(4):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * rank + it))
        model(x, not (rank == 1 and it == 1)).pow(2).mean().backward()
        if it == 1:
            opt.zero_grad()  # e.g. a batch the loop decides to skip, on every rank
            continue
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("voters", ["rank", "node"])
def test_a_backward_thrown_away_by_zero_grad_issues_no_lone_collective(voters):
    """zero_grad() drained the started votes only on the ranks that had started some: a collective
    the other ranks never issued (a hang without timeout_s). Now the next step() agrees they are
    stale and every rank votes again: the result equals overlap=False on the same batches."""
    world = 4 if voters == "node" else 2
    got = run_ranks(_discarded_backward, world, voters, True, timeout=300, env=ENV, contract=True)
    want = run_ranks(_discarded_backward, world, voters, False, timeout=300, env=ENV)
    for r in range(world):
        assert all(torch.equal(a, b) for a, b in zip(got[r], want[r])), r
        assert all(torch.equal(a, b) for a, b in zip(got[r], got[0])), r
