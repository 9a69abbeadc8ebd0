"""Faults and bad input on real gloo ranks (issue 22, section 2).

Each scenario is one launch of 2 ranks (pure-torch kernels) with several checks inside: process
start-up dominates the cost.
"""
from __future__ import annotations

import copy
import glob
import os

import pytest
import torch

from lioncub_ds import LionCub, checkpoint
from lioncub_ds.checkpoint import CheckpointError
from lioncub_ds.config import LionCubConfigError
from lioncub_ds.optimizer import StepInputError
from dist_helpers import run_ranks

pytestmark = pytest.mark.dist  # real gloo ranks; the single-process and DeepSpeed tests say so themselves

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


# ----------------------------------------------------------------------------- items 3, 5, 7
def _catch(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test compares type and message
        return f"{type(exc).__name__}: {exc}"
    return None


def _stale_tmp_names(directory):
    return sorted(os.path.basename(f) for f in glob.glob(os.path.join(directory, ".tmp-*")))


def _state_faults(rank, world_size, directory):
    import torch.distributed as dist

    out = {}
    p, q = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3))
    # 7: a parameter listed twice is refused at construction, on every rank
    out["duplicate"] = _catch(lambda: LionCub([p, q, p], lr=0.01))
    # 7: a sparse gradient: the same rule at N = 2 as at N = 1 (StepInputError on every rank)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt_e = LionCub(emb.parameters(), lr=0.01, comm="1bit")
    emb(torch.tensor([1, 2])).sum().backward()
    out["sparse"] = _catch(opt_e.step)

    # 3: drift resync of a non-contiguous parameter
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 4).t())
    b = torch.nn.Parameter(torch.randn(7))
    out["w_contiguous"] = w.is_contiguous()
    opt = LionCub([w, b], lr=0.01, comm="1bit")
    for k in range(2):
        w.grad, b.grad = _grads_for([w, b], rank, k)
        opt.step()
    if rank == 1:
        with torch.no_grad():
            w[0, 1] += 1.0
            w[3, 5] -= 2.0
    out["resync_found_drift"] = opt.check_replicas(action="resync") is False
    out["after_resync"] = opt.check_replicas()
    out["w"] = w.detach().clone()

    # 7: a NaN momentum inside a checkpoint whose digest is valid is refused on every rank
    ck = os.path.join(directory, "ck")
    path = checkpoint.save(opt, ck)
    if rank == 1:
        payload = torch.load(path, weights_only=True)
        payload.pop("sha256")
        payload["optimizer"]["state"][0]["exp_avg"][0, 0] = float("nan")
        payload["sha256"] = checkpoint.payload_digest(payload)
        torch.save(payload, path)
    dist.barrier()
    m_before = opt.state[w]["exp_avg"].clone()
    out["nan_load"] = _catch(lambda: checkpoint.load(opt, ck))
    out["nan_state_unchanged"] = torch.equal(opt.state[w]["exp_avg"], m_before)
    # the same through load_state_dict
    sd = copy.deepcopy(opt.state_dict())  # state_dict() shares the live state dicts
    sd["state"][1]["exp_avg"] = torch.full_like(sd["state"][1]["exp_avg"], float("inf"))
    out["nan_load_state_dict"] = _catch(lambda: opt.load_state_dict(sd))

    # 7: temporary files a killed save left behind are removed by the next save and load
    own_tmp = os.path.join(ck, f".tmp-{os.path.basename(path)}-abcd1234.pt")
    torch.save({"x": 1}, own_tmp)
    if rank == 0:
        torch.save({"x": 1}, os.path.join(ck, ".tmp-k3j_9xq2.pt"))  # an older version's name
    dist.barrier()
    out["tmp_before_save"] = _stale_tmp_names(ck)
    dist.barrier()
    checkpoint.save(opt, ck)
    dist.barrier()
    out["tmp_after_save"] = _stale_tmp_names(ck)
    dist.barrier()
    torch.save({"x": 1}, own_tmp)
    dist.barrier()
    out["load_ok"] = _catch(lambda: checkpoint.load(opt, ck))
    dist.barrier()
    out["tmp_after_load"] = _stale_tmp_names(ck)
    dist.barrier()

    # 5: a directory that mixes world sizes is refused, even when this rank's own file exists
    if rank == 0:
        import shutil
        shutil.copy(path, checkpoint.rank_file(ck, 0, 1))
    dist.barrier()
    out["mixed"] = _catch(lambda: checkpoint.load(opt, ck))
    return out


def test_state_faults_on_two_ranks(tmp_path):
    res = run_ranks(_state_faults, N, str(tmp_path), timeout=300, env=ENV)
    for r in range(N):
        o = res[r]
        assert o["duplicate"].startswith("LionCubConfigError") and "more than once" in o["duplicate"]
        assert o["sparse"].startswith("StepInputError") and "sparse" in o["sparse"]
        assert o["w_contiguous"] is False
        assert o["resync_found_drift"] and o["after_resync"] is True
        assert o["nan_load"].startswith("CheckpointError"), o["nan_load"]
        assert o["nan_state_unchanged"]
        assert o["nan_load_state_dict"].startswith("LionCubConfigError") and "non-finite" in o["nan_load_state_dict"]
        assert len(o["tmp_before_save"]) == 3
        assert o["tmp_after_save"] == [] and o["load_ok"] is None and o["tmp_after_load"] == []
        assert o["mixed"] is not None and "mixes checkpoints of world sizes [1, 2]" in o["mixed"], o["mixed"]
    assert "non-finite" in res[1]["nan_load"]  # the rank with the bad file names the cause
    assert torch.equal(res[0]["w"], res[1]["w"])


@pytest.mark.unit
def test_a_sparse_gradient_is_refused_at_n_1_too():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    before = emb.weight.detach().clone()
    opt = LionCub(emb.parameters(), lr=0.01)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(StepInputError, match="sparse"):
        opt.step()
    assert torch.equal(emb.weight, before) and opt.step_count == 0


# ----------------------------------------------------------------------------- item 4: DeepSpeed stage 0
def _ds_bad_file_scenario(rank, world_size, directory, damage):
    import deepspeed
    import torch.distributed as dist

    import lioncub_ds.deepspeed  # noqa: F401  (registers LionCub)
    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 6,
           "zero_optimization": {"stage": 0},
           "optimizer": {"type": "LionCub", "params": {"lr": 1e-2, "weight_decay": 0.1, "comm": "1bit"}}}
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    gen = torch.Generator().manual_seed(rank)

    def train(steps):
        for _ in range(steps):
            x = torch.randn(4, 6, generator=gen)
            engine.backward(engine(x).pow(2).mean())
            engine.step()

    opt = engine.basic_optimizer

    def snapshot():
        return {"params": [p.detach().clone() for p in engine.module.parameters()],
                "momenta": [opt.state[p]["exp_avg"].clone() for p in engine.module.parameters()],
                "global_steps": int(engine.global_steps), "step_count": opt.step_count}

    train(2)
    at_save = snapshot()
    engine.save_checkpoint(directory, tag="t")
    train(2)
    before = snapshot()
    dist.barrier()
    if rank == 1 and damage != "none":
        path = checkpoint.rank_file(os.path.join(directory, "t"), 1, world_size)
        if damage == "missing":
            os.unlink(path)
        else:
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
    dist.barrier()
    error = _catch(lambda: engine.load_checkpoint(directory, tag="t"))
    after = snapshot()

    def same(x, y):
        return (all(torch.equal(a, b) for a, b in zip(x["params"], y["params"]))
                and all(torch.equal(a, b) for a, b in zip(x["momenta"], y["momenta"]))
                and x["global_steps"] == y["global_steps"] and x["step_count"] == y["step_count"])
    return {"error": error, "unchanged": same(before, after), "resumed": same(at_save, after)}


@pytest.mark.integration
@pytest.mark.skipif(__import__("importlib").util.find_spec("deepspeed") is None, reason="deepspeed not installed")
@pytest.mark.parametrize("damage", ["truncated", "missing", "none"])
def test_deepspeed_stage0_bad_rank_file_changes_nothing(tmp_path, damage):
    res = run_ranks(_ds_bad_file_scenario, N, str(tmp_path), damage, timeout=600,
                    env={**ENV, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    if damage == "none":  # the control: an intact checkpoint resumes every rank's own state
        assert all(res[r]["error"] is None and res[r]["resumed"] for r in range(N)), res
        return
    for r in range(N):
        assert res[r]["error"] is not None and res[r]["error"].startswith("CheckpointError"), res[r]["error"]
        assert res[r]["unchanged"], f"rank {r}: DeepSpeed's load ran before the LionCub files were checked"


def _float64_parameters(rank, world_size):
    out = {}
    for name, kw in (("flat", {}), ("node", dict(voters="node", node_size=2)), ("master_only", dict(node_size=2))):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(11, dtype=torch.float64))
        before = p.detach().clone()
        opt = LionCub([p], lr=1e-3, comm="1bit", **kw)
        p.grad = torch.randn(11, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        try:
            opt.step()
            out[name] = (None, torch.equal(p.detach(), before), opt.step_count)
        except LionCubConfigError as exc:
            out[name] = (str(exc), torch.equal(p.detach(), before), opt.step_count)
    return out


def test_float64_parameters_are_refused_where_shards_work_in_fp32():
    """Node voters and master-only keep fp32 shards: a float64 parameter's update would be rounded
    to fp32, so its first step is refused by name on every rank (nothing changed); flat voting
    steps it as it is."""
    for r in run_ranks(_float64_parameters, 2, timeout=300):
        assert r["flat"] == (None, False, 1), r["flat"]
        for name in ("node", "master_only"):
            msg, unchanged, count = r[name]
            assert msg and "float64" in msg and "voters='rank' without node_size" in msg, msg
            assert unchanged and count == 0, r[name]
