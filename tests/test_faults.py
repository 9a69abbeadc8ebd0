"""Faults and bad input on real gloo ranks (issue 22, section 2).

Each scenario is one launch of 2 ranks (pure-torch kernels) with several checks inside: process
start-up dominates the cost.
"""
from __future__ import annotations

import glob
import os

import pytest
import torch

from lioncub_ds import LionCub, checkpoint
from lioncub_ds.checkpoint import CheckpointError
from lioncub_ds.config import LionCubConfigError
from lioncub_ds.optimizer import StepInputError
from dist_helpers import run_ranks

N = 2
ENV = {"LIONCUB_KERNELS": "torch"}


def _grads_for(params, rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(p.shape, generator=g) for p in params]


# ----------------------------------------------------------------------------- item 6: no gradient anywhere
def _idle_scenario(rank, world_size, comm, overlap):
    torch.manual_seed(0)
    used, idle, half = (torch.nn.Parameter(torch.randn(s)) for s in ((30,), (11,), (5,)))
    idle0, half0 = idle.detach().clone(), half.detach().clone()
    opt = LionCub([used, idle, half], lr=0.05, weight_decay=0.1, comm=comm, overlap=overlap)
    out = {}
    for k in range(4):
        used.grad = _grads_for([used], rank, k)[0]
        # ``half`` has a gradient on rank 0 only: it votes with g = 0 on rank 1 and moves
        half.grad = _grads_for([half], rank, 10 + k)[0] if rank == 0 else None
        if k == 0:
            out["m_idle_before"] = None
        opt.step()
        opt.zero_grad()
    out.update(idle=idle.detach(), idle0=idle0, half=half.detach(), half0=half0, used=used.detach(),
               m_idle=opt.state[idle]["exp_avg"].clone() if "exp_avg" in opt.state[idle] else None)
    # every parameter frozen: the step does nothing, and does not crash
    frozen = [torch.nn.Parameter(torch.randn(4), requires_grad=False) for _ in range(2)]
    before = [f.detach().clone() for f in frozen]
    opt2 = LionCub(frozen, lr=0.05, comm=comm)
    opt2.step()
    opt2.step()
    out["frozen_unchanged"] = all(torch.equal(f, b) for f, b in zip(frozen, before))
    return out


@pytest.mark.parametrize("comm,overlap", [("1bit", False), ("pbit", True), ("allgather", False)])
def test_a_parameter_without_a_gradient_on_every_rank_stays_put(comm, overlap):
    res = run_ranks(_idle_scenario, N, comm, overlap, timeout=300, env=ENV)
    for r in range(N):
        assert torch.equal(res[r]["idle"], res[r]["idle0"])  # as Lion: no decay, no vote
        m = res[r]["m_idle"]
        assert m is None or not m.any()  # its momentum never moved from zero
        assert not torch.equal(res[r]["half"], res[r]["half0"])  # a gradient on one rank: still voted
        assert res[r]["frozen_unchanged"]
    assert torch.equal(res[0]["half"], res[1]["half"]) and torch.equal(res[0]["used"], res[1]["used"])
