"""momentum_sync with ``layers`` under node voters (2 voters × 2 ranks, real gloo ranks): the sync
averages, over the two voters, only the momentum pieces of the selected parameters in each rank's
shards. Checked against the node-voter oracle of test_node_voters.py with the same sync applied
to the oracle's voter momenta (fp32 mean of two: exact), parameters after every step; the oracle
itself is checked to depart from both "sync everything" and "sync nothing", so the test can fail.
"""
from __future__ import annotations

import pytest
import torch

from lioncub_ds import LionCub
from dist_helpers import SmallNet as Net, run_ranks
from test_node_voters import BETAS, ENV, LR, STEPS, WD, _average_voters, _grads, _simulate

pytestmark = pytest.mark.dist

LAYERS = ["fc1.*"]


def _oracle(selected):
    """Parameters after each step: 2 node voters × 2 ranks, momenta of parameter indices
    ``selected`` averaged over the voters after every step."""
    torch.manual_seed(0)
    master = [p.detach().float().clone() for p in Net().parameters()]
    momenta = [[torch.zeros_like(m) for m in master] for _ in range(2)]
    out = []
    for step in range(1, STEPS + 1):
        after, master = _simulate(2, 2, torch.float32, step, step, momenta, master)
        out += after
        _average_voters(momenta, selected)
    return out


def _run(rank, world_size):
    torch.manual_seed(0)
    model = Net()
    opt = LionCub(model.named_parameters(), lr=LR, betas=BETAS, weight_decay=WD, comm="1bit", voters="node",
                  node_size=2, bucket_size_mb=0.0002, momentum_sync={"every": 1, "layers": LAYERS})
    after = []
    for step in range(1, STEPS + 1):
        for p, g in zip(model.parameters(), _grads(model, rank, step)):
            p.grad = g
        opt.step()
        after.append([p.detach().clone() for p in model.parameters()])
    return after


def test_layers_sync_with_node_voters_matches_the_oracle():
    names = [n for n, _ in Net().named_parameters()]
    selected = [k for k, n in enumerate(names) if n.startswith("fc1.")]
    expect = _oracle(selected)
    for other in (_oracle([]), _oracle(list(range(len(names))))):
        assert any(not torch.equal(a, b) for s, t in zip(expect, other) for a, b in zip(s, t))
    res = run_ranks(_run, 4, timeout=300, env=ENV)
    for r in range(4):
        for step, (got, want) in enumerate(zip(res[r], expect), 1):
            for name, a, b in zip(names, got, want):
                assert torch.equal(a, b), (r, step, name)
