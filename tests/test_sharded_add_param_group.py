"""add_param_group after the first step with sharded state (node voters 2 × 2, master-only
sharding over node groups of 2), on 4 real gloo ranks.

The oracle is the same run with the group there from the start and no gradient for its
parameters until it is "added": a parameter without a gradient on any rank keeps its value,
momentum and master, so both runs must end bit-identical, the added group must have moved, the
sharded state must have grown by the new buckets, and every rank must hold the same parameters.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lioncub_ds import LionCub
from dist_helpers import run_ranks

pytestmark = pytest.mark.dist

ENV = {"LIONCUB_KERNELS": "torch"}
BEFORE, AFTER = 3, 3


def _params(dtype):
    gen = torch.Generator().manual_seed(7)
    a = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in (37, 11)]
    b = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in (29, 5)]
    return a, b


def _grad(p, rank, step, k):
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + k)
    return torch.randn(p.shape, generator=gen).to(p.dtype)


def _run(rank, world_size, voters, dtype, late):
    a, b = _params(dtype)
    kw = dict(lr=0.01, weight_decay=0.1, comm="1bit", voters=voters, node_size=2)
    groups = [{"params": a}] if late else [{"params": a}, {"params": b, "lr": 0.03}]
    opt = LionCub(groups, **kw)
    state_before = None
    for step in range(BEFORE + AFTER):
        if late and step == BEFORE:
            state_before = sum(opt.state_bytes().values())
            opt.add_param_group({"params": b, "lr": 0.03})
        for k, p in enumerate(a):
            p.grad = _grad(p, rank, step, k)
        for k, p in enumerate(b):
            p.grad = _grad(p, rank, step, 10 + k) if step >= BEFORE else None
        opt.step()
    flat = torch.cat([p.detach().float() for p in a + b])
    every = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(every, flat)
    moved = not torch.equal(torch.cat([p.detach() for p in b]), torch.cat([p.detach() for p in _params(dtype)[1]]))
    return {"flat": flat, "replicas": all(torch.equal(flat, e) for e in every), "moved": moved,
            "grew": None if state_before is None else sum(opt.state_bytes().values()) > state_before}


CASES = {"node-voters-fp32": ("node", torch.float32), "node-voters-bf16": ("node", torch.bfloat16),
         "master-only-bf16": ("rank", torch.bfloat16)}


def _all(rank, world_size):
    return {case: {late: _run(rank, world_size, voters, dtype, late) for late in (True, False)}
            for case, (voters, dtype) in CASES.items()}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, 4, timeout=400, env=ENV)  # one launch: process start-up dominates


@pytest.mark.parametrize("case", list(CASES))
def test_a_group_added_after_steps_equals_the_group_there_from_the_start(results, case):
    for r in range(4):
        late, early = results[r][case][True], results[r][case][False]
        assert late["replicas"] and early["replicas"], r
        assert late["moved"], r
        assert late["grew"], r  # the new buckets got their shards
        assert torch.equal(late["flat"], early["flat"]), r
