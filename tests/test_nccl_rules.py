"""Issue 11's NCCL rules for the optimizer core, checked on CPU with real gloo ranks.

NCCL cannot run two ranks here, so each rule is made observable on gloo:
* small tensors on the parameters' device: the ranks run LionCub's collectives with the
  default device set to 'meta', so any tensor the library creates without ``device=`` lands
  on a device other than the parameters' (as a CPU tensor would beside CUDA parameters) and
  the collective fails;
* groups created at construction, on every rank, in the same order: ``dist.new_group`` calls
  are recorded per rank and compared;
* an error one rank finds is agreed before anyone raises: the others would otherwise wait;
* ``timeout_s`` waits with a deadline, independently of the group's own timeout;
* bounded memory of the drift checksum.
"""
from __future__ import annotations

import os
import resource
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from lioncub_ds import LionCub, checkpoint
from lioncub_ds.comm.base import Collectives, CollectiveError
from lioncub_ds.groups import broadcast
from lioncub_ds.optimizer import StepInputError
from lioncub_ds.telemetry import CommStats
from dist_helpers import run_ranks

pytestmark = pytest.mark.dist


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(7, 13)
        self.fc2 = torch.nn.Linear(13, 3)
        self.extra = torch.nn.Parameter(torch.zeros(5))  # frozen at the first step in one scenario

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))).sum() + 0 * self.extra.sum()


def _backward(model, gen):
    model.zero_grad(set_to_none=True)
    model(torch.randn(4, 7, generator=gen)).backward()


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            [opt.state[p]["exp_avg"].clone() for p in model.parameters() if p in opt.state])


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------- one 4-rank launch
def _scenarios(rank, n, directory):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(100 + rank)
    out = {}

    # (6) groups: record every dist.new_group call; LionCub must create all of its groups at
    # construction, on every rank, in the same order (also groups that do not contain this rank).
    real_new_group = dist.new_group
    calls = []

    def recording_new_group(ranks=None, *args, **kwargs):
        calls.append(tuple(ranks) if ranks is not None else None)
        return real_new_group(ranks, *args, **kwargs)

    dp_groups = [real_new_group([0, 2]), real_new_group([1, 3])]  # like Megatron's DP groups (TP=2)
    dist.new_group = recording_new_group
    try:
        m1, m2 = Net(), Net()
        opt_dp = LionCub(m1.parameters(), lr=1e-2, comm="1bit", process_group=dp_groups[rank % 2], timeout_s=120)
        opt_node = LionCub(m2.parameters(), lr=1e-2, comm="1bit",
                           momentum_sync={"every": 1, "group": "node", "group_size": 2})
        at_construction = list(calls)
        for _ in range(2):
            for m, o in ((m1, opt_dp), (m2, opt_node)):
                _backward(m, gen)
                o.step()
        out["group_calls"] = calls
        out["group_calls_at_construction"] = at_construction
        out["timeout_of_vote_group"] = _timeout_s(opt_dp.vote_group)
        out["vote_group_ranks"] = dist.get_process_group_ranks(opt_dp.vote_group)
    finally:
        dist.new_group = real_new_group

    # (5) a gradient on a parameter that was frozen at the first step, on rank 1 only: every rank
    # raises StepInputError once the flags are agreed, nobody hangs, nothing changes.
    model = Net()
    model.extra.requires_grad_(False)
    opt = LionCub(model.parameters(), lr=1e-2, comm="1bit")
    _backward(model, gen)
    opt.step()
    _backward(model, gen)
    if rank == 1:
        model.extra.grad = torch.ones(5)
    before = _snapshot(model, opt)
    try:
        opt.step()
        out["frozen"] = "no error"
    except StepInputError as exc:
        out["frozen"] = str(exc)
    out["frozen_untouched"] = _same(before[0], _snapshot(model, opt)[0]) and _same(before[1], _snapshot(model, opt)[1])
    model.extra.grad = None
    opt.step()  # the ranks' collectives are still in step
    out["frozen_step_count"] = opt.step_count

    # (1) every small collective of a step, a checkpoint load, the drift check and a momentum
    # sync, with the default device elsewhere than the parameters ('meta' stands for the CPU
    # beside CUDA parameters): tensors created without device= would fail the collective.
    model = Net()
    opt = LionCub(model.parameters(), lr=1e-2, comm="1bit")
    _backward(model, gen)
    opt.step()
    checkpoint.save(opt, directory)
    _backward(model, gen)
    with torch.device("meta"):
        opt.step()
        out["meta_load"] = checkpoint.load(opt, directory)
        out["meta_replicas"] = opt.check_replicas()
        opt.sync_momenta()
        out["meta_step"] = opt.step_count

    # (4) broadcast from a group-local rank, with and without torch>=2.6's group_src
    for use_group_src in (True, False):
        t = torch.full((3,), float(rank))
        if use_group_src and not _has_group_src():
            continue
        broadcast(t, 1, dp_groups[rank % 2], use_group_src=use_group_src)
        out[f"bcast_{use_group_src}"] = t.tolist()
    return out


def _has_group_src():
    import inspect
    return "group_src" in inspect.signature(dist.broadcast).parameters


def _timeout_s(group):
    from lioncub_ds.comm.base import group_timeout_s
    return group_timeout_s(group, torch.device("cpu"))


def test_nccl_rules_on_four_ranks():
    with tempfile.TemporaryDirectory() as d:
        res = run_ranks(_scenarios, 4, d, timeout=300)
    # (6) the same group creations on every rank, all at construction, none in a step
    calls = [r["group_calls"] for r in res]
    assert all(c == calls[0] for c in calls), calls
    assert all(r["group_calls"] == r["group_calls_at_construction"] for r in res), "a group was created in a step"
    created = set(calls[0])
    assert {(0, 2), (1, 3)} <= created, "every rank creates the timeout groups of both DP groups"
    assert {(0, 1), (2, 3)} <= created, "every rank creates every node subgroup"
    for r, out in enumerate(res):
        assert out["timeout_of_vote_group"] == 120
        assert out["vote_group_ranks"] == [r % 2, r % 2 + 2]
    # (5) agreed error on every rank, nothing changed, the next step works everywhere
    for r, out in enumerate(res):
        assert "1 of 4 ranks found an unusable input at step 2" in out["frozen"], out["frozen"]
        if r == 1:
            assert "requires_grad=False at the first step" in out["frozen"], out["frozen"]
        assert out["frozen_untouched"], r
        assert out["frozen_step_count"] == 2
    # (1) load, drift check and momentum sync work with tensors on the parameters' device
    for out in res:
        assert out["meta_load"] and out["meta_replicas"] is True and out["meta_step"] == 1  # load went back to step 1
    # (4) both broadcast paths give the source's values
    for r, out in enumerate(res):
        src = [2, 3][r % 2]  # group-local rank 1 of [0, 2] and of [1, 3]
        for key in ("bcast_True", "bcast_False"):
            if key in out:
                assert out[key] == [float(src)] * 3, (r, key, out[key])
    assert "bcast_False" in res[0]


# ----------------------------------------------------------------------------- timeout_s: a deadline
STALL_S = 12.0


def _deadline_scenario(rank, n):
    # The default gloo group waits 30 min; only the deadline of the wait can end rank 0's wait.
    coll = Collectives(None, CommStats(), timeout_s=3.0)
    t = torch.ones(5)
    if rank == 1:
        time.sleep(STALL_S)  # a stalled peer, which joins late (so both processes end cleanly)
    start = time.time()
    try:
        coll.all_reduce_(t, "control")
        return {"kind": "ok", "waited": time.time() - start}
    except CollectiveError as exc:
        return {"kind": "CollectiveError", "waited": time.time() - start, "msg": str(exc)}


def test_timeout_s_is_a_deadline_on_the_wait():
    res = run_ranks(_deadline_scenario, 2, timeout=120)
    assert res[0]["kind"] == "CollectiveError", res
    assert 2.5 <= res[0]["waited"] < STALL_S - 2, res  # the deadline, not the peer's arrival
    assert "collective timeout: 3 s" in res[0]["msg"] and "all_reduce (control" in res[0]["msg"], res[0]["msg"]
    assert res[1]["kind"] == "ok"


# ----------------------------------------------------------------------------- drift check memory
BIG = 1 << 25  # 32M fp32 elements (128 MB): unchunked checksums would take 3 x 256 MB more


def _drift_memory(rank, n):
    p = torch.nn.Parameter(torch.full((BIG,), 0.5))
    q = torch.nn.Parameter(torch.zeros(3))
    opt = LionCub([p, q], lr=1e-3, comm="1bit")
    opt.comm_plan()  # the bucket layout exists before we measure the check itself
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    same = opt.check_replicas()
    with torch.no_grad():
        if rank == 1:
            p[BIG - 1] = 0.25  # the last element of the big parameter differs
    try:
        opt.check_replicas()
        caught = None
    except Exception as exc:  # noqa: BLE001
        caught = f"{type(exc).__name__}: {exc}"
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"same": same, "grew_mb": (after - before) / 1024, "caught": caught}


def test_drift_check_memory_is_bounded():
    res = run_ranks(_drift_memory, 2, timeout=300)
    for out in res:
        assert out["same"] is True
        assert out["caught"] and "ReplicaDriftError" in out["caught"] and "param #0" in out["caught"], out
        assert out["grew_mb"] < 96, f"the drift check grew the peak memory by {out['grew_mb']:.0f} MB"


# ----------------------------------------------------------------------------- release_process_group
def _release_and_resume(rank, n):
    torch.manual_seed(0)
    model = Net()
    opt = LionCub(model.parameters(), lr=1e-2, comm="1bit", timeout_s=60, overlap=True)
    gen = torch.Generator().manual_seed(7)  # the same data on every rank
    created = list(opt.created_groups)
    _backward(model, gen)
    opt.step()
    opt.release_process_group()  # every rank: LionCub's own groups destroyed, references dropped
    released = opt.created_groups == []
    _backward(model, gen)  # a backward after the release: no stale hook fires into the old layout
    opt.step()  # resolves and creates its groups again, on every rank
    return {"created": len(created), "released": released, "recreated": len(opt.created_groups),
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]), "steps": opt.step_count}


def test_release_process_group_then_resume():
    res = run_ranks(_release_and_resume, 2, timeout=300)
    for out in res:
        assert out["created"] == 1 and out["recreated"] == 1 and out["steps"] == 2, out
        assert out["released"], out
        assert torch.equal(out["params"], res[0]["params"])
