"""A resumed run with momentum_sync schedule "drift" syncs after the same steps (issue 48, item 4).

The drift trigger decides each sync from host state (the last sync's step, the low point of the
signal since, the latest signal) and from the signal of the step before, which every rank's
votes leave on the device and the next step reads with its flags. None of it was saved: a run
resumed at step 5 synced after other steps than the uninterrupted run and diverged
(docs/checkpoints.md promises a bit-identical resume). Now ``state_dict()`` carries the trigger,
the counters and this rank's pending signal; one launch of 4 gloo ranks checks, against the
uninterrupted run (which saves too, saving changes nothing):

* per-rank files (``lioncub_ds.checkpoint``, what the DeepSpeed stage-0 and Megatron per-rank
  hooks call): node voters 2 x 2 and flat voting;
* one replica for every rank (Megatron's ``--lioncub-checkpoint-mode sync``): the momenta and
  the pending signal are made the same on every rank by ``sync_momenta(all_params=True)``, then
  rank 0's state dict is loaded everywhere.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lioncub_ds import LionCub
from lioncub_ds import checkpoint as ckpt
from dist_helpers import run_ranks

pytestmark = pytest.mark.dist

ENV = {"LIONCUB_KERNELS": "torch"}
STEPS, SAVE_AT = 12, 5
SYNC = {"schedule": "drift", "threshold": 0.002, "min_every": 1}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(11, 29), torch.nn.Tanh(), torch.nn.Linear(29, 5))


def _opt(model, voters):
    kw = dict(voters="node", node_size=2) if voters == "node" else {}
    return LionCub(model.parameters(), lr=3e-3, betas=(0.9, 0.99), comm="1bit", bucket_size_mb=0.0004,
                   momentum_sync=SYNC, **kw)


def _steps(model, opt, rank, first, last, syncs_at):
    for step in range(first, last + 1):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        opt.zero_grad()
        model(torch.randn(16, 11, generator=gen)).pow(2).mean().backward()
        opt.step()
        if opt.comm_stats()["momentum_sync"]["last_sync_step"] == step:
            syncs_at.append(step)


def _result(model, opt, syncs_at):
    sd = opt.state_dict()
    node = sd["lioncub"].get("node")
    momenta = (torch.cat([node["momentum"][i] for i in sorted(node["momentum"])]) if node is not None
               else torch.cat([sd["state"][i]["exp_avg"].reshape(-1) for i in sorted(sd["state"])]))
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]), "momenta": momenta,
            "syncs_at": list(syncs_at), "stats": opt.comm_stats()["momentum_sync"]}


def _run(rank, voters, directory, path, straight):
    """``path``: "files" (per-rank files) or "replica" (one replica for all); ``straight``: the
    uninterrupted run that saves the same way."""
    model, syncs_at = _model(), []
    opt = _opt(model, voters)
    _steps(model, opt, rank, 1, SAVE_AT, syncs_at)
    if path == "replica":
        opt.sync_momenta(all_params=True)  # the sync a one-replica save does (the uninterrupted run too)
    if straight:
        ckpt.save(opt, directory)  # saving changes nothing
        _steps(model, opt, rank, SAVE_AT + 1, STEPS, syncs_at)
        return _result(model, opt, syncs_at)
    weights = [p.detach().clone() for p in model.parameters()]
    if path == "files":
        ckpt.save(opt, directory)
    else:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, opt.state_dict())
        replica = every[0]
    dist.barrier()
    model = _model()  # a fresh process, as far as the optimizer can tell
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
    opt = _opt(model, voters)
    if path == "files":
        ckpt.load(opt, directory)
    else:
        opt.load_state_dict(replica)
    resumed = list(syncs_at)
    _steps(model, opt, rank, SAVE_AT + 1, STEPS, resumed)
    return _result(model, opt, resumed)


def _all(rank, world, tmp):
    out = {}
    for voters, path in (("node", "files"), ("rank", "files"), ("rank", "replica")):
        directory = f"{tmp}/{voters}-{path}"
        out[voters, path] = {"straight": _run(rank, voters, directory + "-straight", path, True),
                             "resumed": _run(rank, voters, directory, path, False)}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_all, 4, str(tmp_path_factory.mktemp("drift")), timeout=400, env=ENV)


@pytest.mark.parametrize("voters,path", [("node", "files"), ("rank", "files"), ("rank", "replica")])
def test_a_resumed_drift_run_syncs_after_the_same_steps(results, voters, path):
    for r in range(4):
        straight, resumed = results[r][voters, path]["straight"], results[r][voters, path]["resumed"]
        # the schedule is exercised on both sides of the save: syncs before it and after it
        assert any(s <= SAVE_AT for s in straight["syncs_at"]), straight["syncs_at"]
        assert any(s > SAVE_AT for s in straight["syncs_at"]), straight["syncs_at"]
        assert resumed["syncs_at"] == straight["syncs_at"], (r, resumed["syncs_at"], straight["syncs_at"])
        assert resumed["stats"] == straight["stats"], r  # the counters carry over too
        assert torch.equal(resumed["momenta"], straight["momenta"]), r
        assert torch.equal(resumed["params"], straight["params"]), r
