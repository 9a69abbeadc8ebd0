"""DeepSpeed ZeRO-3 with LionCub (issue 44): votes across node groups, global Lion, offload, refusals.

One launch of 4 gloo ranks (2 node groups × 2 ranks, ``node_size: 2``) runs every scenario,
each with real ``deepspeed.initialize`` engines (DS_ACCELERATOR=cpu):

* ``voters: "node"`` at stage 3, fp32 and bf16 (bf16 with two ZeRO-3 sub-groups, each stepped by
  its own LionCub): every step equals a brute-force node-voter oracle computed in the test from what each group's ZeRO-3 produced (the reduced gradient
  shards, gathered over the shard peers: the oracle never imitates DeepSpeed's reduction order):
  per-group momenta, majority across the groups, the hash tie rule keyed on the element's index
  inside its parameter; the reduced shard is the group's mean gradient (checked against dense
  gradients, allclose); the partitions are bit-identical across the groups; no floating-point
  tensor crosses a group; the momentum per rank is 1/L of the model;
* gradient clipping (each group clips its own mean gradient) and a non-finite gradient in one
  group only (every group skips the step together; also finite gradients whose combined norm
  overflows in one group only, offloaded with two sub-groups);
* ``engine.save_checkpoint`` / ``load_checkpoint``: resume is exact; another layout is refused by
  name before anything loads;
* stage 3 without votes is global Lion on the partitions; optimizer offload to the CPU (no votes)
  at stages 2 and 3 trains exactly like the same stage without offload;
* votes with ``offload_optimizer`` (the CPU partitions vote over gloo groups) train as without;
* refusals: offload with votes below stage 3, a LionCub instance with voters="node" at stage 3.
"""
from __future__ import annotations

import base64
import json
import os
import shutil

import pytest
import torch

from dist_helpers import run_ranks

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(__import__("importlib").util.find_spec("deepspeed") is None,
                                 reason="deepspeed not installed")]

WORLD, L = 4, 2
STEPS, SAVE_AT = 5, 2
HUGE_GRAD = 3.2e18
LR, WD, BETAS = 3e-3, 0.1, (0.9, 0.99)
ENV = {"DS_ACCELERATOR": "cpu", "LOCAL_SIZE": str(L), "LIONCUB_KERNELS": "torch"}


def _model(seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # odd sizes: 15x7 does not split evenly over 2 ranks (ZeRO-3 pads the last partition)
        return torch.nn.Sequential(torch.nn.Linear(7, 15), torch.nn.Tanh(), torch.nn.Linear(15, 3))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 7, generator=g), torch.randn(6, 3, generator=g)


def _cfg(dtype="fp32", clip=0.0, offload=False, stage=3, **params):
    cfg = {"train_micro_batch_size_per_gpu": 6, "steps_per_print": 10 ** 6, "gradient_clipping": clip,
           "zero_optimization": {"stage": stage},
           "optimizer": {"type": "LionCub", "params": {"lr": LR, "betas": list(BETAS), "weight_decay": WD,
                                                       "comm": "1bit", **params}}}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _engine(cfg, seed=0):
    import deepspeed
    model = _model(seed)
    if cfg.get("bf16", {}).get("enabled"):
        model = model.to(torch.bfloat16)
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def _loss(engine, rank, step, dtype, poison=False):
    x, y = _batch(rank, step)
    if dtype == "bf16":
        x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
    if poison:
        x = x * float("nan")
    return torch.nn.functional.mse_loss(engine(x).float(), y.float())


def _full_params(engine):
    import deepspeed
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().float().clone() for p in engine.module.parameters()]


def _train(engine, rank, start, stop, dtype, record=None, poison_at=None):
    """Steps start..stop; ``record`` gets per step what each inner LionCub saw and made."""
    for step in range(start, stop + 1):
        if record is not None:
            record.setdefault("full_before", []).append(_full_params(engine))
        loss = _loss(engine, rank, step, dtype, poison=(step == poison_at and rank == 0))
        engine.backward(loss)
        engine.step()


def _capture(opt, record):
    """Hooks on the LionCubs inside ZeRO3Votes: the reduced gradient shard and fp32 values."""
    for i, inner in enumerate(opt.inner):
        def pre(o, args, kwargs, i=i):
            record.setdefault("grads", []).append((i, [v.grad.detach().clone() for v, _, _ in opt.views[i]]))
            record.setdefault("before", []).append((i, [v.detach().clone() for v, _, _ in opt.views[i]]))

        def post(o, args, kwargs, i=i):
            record.setdefault("after", []).append((i, [v.detach().clone() for v, _, _ in opt.views[i]]))
        inner.register_step_pre_hook(pre)
        inner.register_step_post_hook(post)


def _oracle(per_group_grads, theta0, starts, steps):
    """Node-voter oracle on one shard: ``per_group_grads[j][s]`` the group's reduced shard at step
    s (one tensor per parameter view), ``theta0`` the views' fp32 values, ``starts`` their first
    element's index inside the parameter. Returns the values after each step."""
    from lioncub_ds.kernels import reference
    nn = len(per_group_grads)
    theta = [t.clone() for t in theta0]
    momenta = [[torch.zeros_like(t) for t in theta0] for _ in range(nn)]
    out = []
    for s in range(steps):
        new = []
        for k, (t, start) in enumerate(zip(theta, starts)):
            gs = [per_group_grads[j][s][k] for j in range(nn)]
            cs = [reference.lion_direction(momenta[j][k], gs[j], BETAS[0]) for j in range(nn)]
            votes = torch.sign(torch.stack(cs))
            plus, cnt = (votes > 0).sum(0), (votes != 0).sum(0)
            diff = 2 * plus - cnt
            delta = torch.sign(diff).float()
            tie = reference.tie_hash_sign(s + 1, torch.arange(start, start + t.numel(), dtype=torch.int64)).float()
            delta = torch.where((diff == 0) & (cnt > 0), tie, delta)
            e = t.clone()
            e.mul_(1.0 - LR * WD)
            e.add_(delta.mul(-LR))
            new.append(e)
            for j in range(nn):
                reference.momentum_update(momenta[j][k], gs[j], BETAS[1])
        theta = new
        out.append([t.clone() for t in theta])
    return out


def _dense_mean_shards(model_params_before, rank, step, sg, views, k):
    """The group's mean of its ranks' dense gradients at ``step``, cut to shard k like ZeRO-3."""
    import torch.distributed as dist
    dense = _model()
    with torch.no_grad():
        for p, v in zip(dense.parameters(), model_params_before):
            p.copy_(v)
    x, y = _batch(rank, step)
    torch.nn.functional.mse_loss(dense(x), y).backward()
    flat = [p.grad.reshape(-1) for p in dense.parameters()]
    mine = torch.cat(flat)
    gathered = [torch.empty_like(mine) for _ in range(sg.shard_size)]
    dist.all_gather(gathered, mine, group=sg.shard)  # test-only, outside any step
    mean = torch.stack(gathered).sum(0) / sg.shard_size
    out, off = [], 0
    for p in dense.parameters():
        n = (p.numel() + sg.shard_size - 1) // sg.shard_size
        full = torch.zeros(n * sg.shard_size)
        full[:p.numel()] = mean[off:off + p.numel()]
        out.append(full[k * n:(k + 1) * n])
        off += p.numel()
    return out


def _votes_scenario(rank, dtype, clip, ckpt_dir, sub_group_size=None):
    """``sub_group_size``: ZeRO-3 splits each rank's partition into sub-groups of about that many
    elements, each stepped by its own LionCub (a 70B model on 8 ranks has 9 at the default 1e9)."""
    import torch.distributed as dist
    from lioncub_ds.testing import nccl_contract
    cfg = _cfg(dtype, clip=clip, voters="node", node_size=L)
    if sub_group_size is not None:
        cfg["zero_optimization"]["sub_group_size"] = sub_group_size
    engine = _engine(cfg)
    opt = engine.basic_optimizer
    sg = opt.shard_groups
    record = {}
    _capture(opt, record)
    mark = len(nccl_contract.log()) if nccl_contract.installed() else 0
    _train(engine, rank, 1, STEPS, dtype, record)
    calls = [(e[0], list(e[1]) if e[1] else None, e[2]) for e in nccl_contract.log()[mark:]] \
        if nccl_contract.installed() else []
    k = sg.shard_rank
    exact, mean_ok, same_across_groups, low = True, None, True, None
    for i, views in enumerate(opt.views):
        # the oracle for this rank's shard of sub-group i, from every group's reduced shards (gathered
        # over the peers)
        grads = [g for j, g in record["grads"] if j == i]
        every = [None] * sg.groups
        dist.all_gather_object(every, grads, group=sg.peers)
        starts = [int(getattr(v, "lioncub_element_start")) for v, _, _ in views]
        want = _oracle(every, next(b for j, b in record["before"] if j == i), starts, STEPS)
        got = [a for j, a in record["after"] if j == i]
        # the real elements of each partition: the last one's padding is never read, and ZeRO-3 leaves
        # it unset (whatever the memory held, NaN bits included, on which torch.equal is False)
        real = [max(0, min(n, p.ds_numel - k * n)) for (_, _, n), p in zip(views, engine.optimizer.fp16_groups[i])]
        exact &= all(torch.equal(a[:r], b[:r]) for s in range(STEPS) for a, b, r in zip(got[s], want[s], real))
        if clip == 0.0 and dtype == "fp32" and sub_group_size is None:
            mean_ok = (mean_ok is not False) and all(torch.allclose(a, b, rtol=1e-5, atol=1e-7)
                          for s in range(STEPS)
                          for a, b in zip(grads[s], _dense_mean_shards(record["full_before"][s], rank, s + 1, sg,
                                                                       views, sg.shard_rank)))
        final = [v.detach()[:r].clone() for (v, _, _), r in zip(views, real)]
        peers_final = [None] * sg.groups
        dist.all_gather_object(peers_final, final, group=sg.peers)
        same_across_groups &= all(torch.equal(a, b) for other in peers_final for a, b in zip(other, final))
        if dtype == "bf16":  # the bf16 partition is the fp32 master rounded
            low = (low is not False) and all(
                torch.equal(p.ds_tensor.detach().reshape(-1)[:r], v.detach()[:r].to(torch.bfloat16))
                for p, (v, _, _), r in zip(engine.optimizer.fp16_groups[i], views, real))
    out = {"full_final": _full_params(engine), "exact": exact, "mean_ok": mean_ok, "same_across_groups": same_across_groups, "low": low,
           "calls": calls, "momentum_bytes": opt.state_bytes().get("momentum", 0),
           "public_state": _public_state_bytes(engine),
           "params": sum(p.ds_numel for p in engine.module.parameters()),
           "summary": engine.lioncub.summary(), "group": sg.group_index, "shard": sg.shard_rank,
           "steps": opt.step_count, "sub_groups": len(opt.views)}
    if ckpt_dir is not None:
        out.update(_resume(engine, rank, dtype, ckpt_dir))
    return out


def _public_state_bytes(engine):
    from lioncub_ds.deepspeed import state_bytes
    return state_bytes(engine)


def _copy_with_layout(rank, ckpt_dir, suffix, **changes):
    """Rank 0 copies the checkpoint with its vote layout file changed; every rank gets the path."""
    copy = ckpt_dir + suffix
    if rank == 0:
        shutil.copytree(ckpt_dir, copy)
        path = os.path.join(copy, "t", "lioncub_zero3_layout.json")
        with open(path) as f:
            layout = json.load(f)
        layout.update(changes)
        with open(path, "w") as f:
            json.dump(layout, f)
    return copy


def _refusal_of(engine, where, tag):
    """The error ``engine.load_checkpoint`` raises (its type and message), or None."""
    try:
        engine.load_checkpoint(where, tag=tag)
        return None
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}"


def _resume(engine, rank, dtype, ckpt_dir):
    """Train a fresh engine to SAVE_AT, save, train to STEPS; a fresh one loads and trains to STEPS:
    identical to the uninterrupted ``engine``. Then a changed layout is refused before loading."""
    import torch.distributed as dist
    want = _full_params(engine)
    a = _engine(_cfg(dtype, voters="node", node_size=L))
    _train(a, rank, 1, SAVE_AT, dtype)
    a.save_checkpoint(ckpt_dir, tag="t")
    saved_full = _full_params(a)
    dist.barrier()
    consolidated = None
    if rank == 0:  # DeepSpeed's zero_to_fp32 refuses the per-group files; the helper reads group 0's
        from lioncub_ds.deepspeed import zero3_fp32_state_dict
        sd = zero3_fp32_state_dict(ckpt_dir, tag="t")
        names = [n for n, _ in a.module.named_parameters()]
        consolidated = sorted(sd) == sorted(names) and all(
            torch.equal(sd[n].reshape(-1), p.reshape(-1)) for n, p in zip(names, saved_full))
    b = _engine(_cfg(dtype, voters="node", node_size=L))
    b.load_checkpoint(ckpt_dir, tag="t")
    _train(b, rank, SAVE_AT + 1, STEPS, dtype)
    resumed = all(torch.equal(x, y) for x, y in zip(_full_params(b), want))
    files = sorted(os.listdir(os.path.join(ckpt_dir, "t")))
    dist.barrier()
    bad = _copy_with_layout(rank, ckpt_dir, "_bad", shard_groups=1, shard_size=4)
    dist.barrier()
    before = _full_params(b)
    refused = _refusal_of(b, bad, "t")
    unchanged = all(torch.equal(x, y) for x, y in zip(_full_params(b), before))
    # node-local storage: the layout file is missing on the other node (ranks 2, 3 here); every rank
    # refuses together (without the agreement, ranks 0, 1 would load and 2, 3 raise)
    local = ckpt_dir + "_local"
    if rank == 0:
        shutil.copytree(ckpt_dir, local)
        os.remove(os.path.join(local, "t", "lioncub_zero3_layout.json"))
    dist.barrier()
    refused_local = _refusal_of(b, ckpt_dir if rank < WORLD // 2 else local, "t")
    # node-local storage, no tag given: DeepSpeed wrote 'latest' on global rank 0 only, so the other
    # node (ranks 2, 3) finds no tag; every rank refuses (without the agreement, ranks 0, 1 would load
    # and ranks 2, 3 load nothing: the groups would go on from different states)
    nolatest = ckpt_dir + "_nolatest"
    if rank == 0:
        shutil.copytree(ckpt_dir, nolatest)
        os.remove(os.path.join(nolatest, "latest"))
    # the same groups, other partitions (sub_group_size or the model changed): the refusal says so
    subgroups = _copy_with_layout(rank, ckpt_dir, "_subgroups", sub_groups=[7, 8])
    dist.barrier()
    before = _full_params(b)
    refusals = {label: _refusal_of(b, where, tag) for label, where, tag in (
        ("no_latest", ckpt_dir if rank < WORLD // 2 else nolatest, None), ("sub_groups", subgroups, "t"))}
    unchanged_latest = all(torch.equal(x, y) for x, y in zip(_full_params(b), before))
    return {"resumed": resumed, "files": files, "refused": refused, "unchanged_after_refusal": unchanged,
            "refused_local": refused_local, "consolidated": consolidated, "refusals": refusals,
            "unchanged_after_no_latest": unchanged_latest}


def _skip_scenario(rank, huge=False):
    """A non-finite gradient in group 0 only: every group skips the step, together. ``huge``: with the
    optimizer offloaded (whose sub-group norms are fp32) and two ZeRO-3 sub-groups, finite gradients in
    group 0 whose sub-group norms are finite but whose combined norm overflows fp32 (ZeRO-3 skips on
    it): every group skips that step too."""
    cfg = _cfg("fp32", offload=huge, voters="node", node_size=L, timeout_s=60)
    if huge:  # the 15x7 weight's partition (53 elements per rank) alone, then the other three
        cfg["zero_optimization"]["sub_group_size"] = 50
    engine = _engine(cfg)
    opt = engine.basic_optimizer
    active = [False]
    if huge and rank == 0:
        # group mean 1.6e18 per element: 105 and 63 elements give squared norms 2.7e38 and 1.6e38
        # (fp32 max 3.4e38), their sum overflows
        for p in engine.module.parameters():
            p.register_hook(lambda g: g + HUGE_GRAD if active[0] else g)
    _train(engine, rank, 1, 2, "fp32")
    before = _full_params(engine)
    active[0] = True
    _train(engine, rank, 3, 3, "fp32", poison_at=None if huge else 3)
    active[0] = False
    skipped = all(torch.equal(x, y) for x, y in zip(_full_params(engine), before))
    _train(engine, rank, 4, 4, "fp32")
    return {"skipped": skipped, "steps": opt.step_count, "final": _full_params(engine),
            "sub_groups": len(opt.inner)}


def _offload_votes_scenario(rank):
    """Votes with the fp32 partitions offloaded to the CPU (the votes go over gloo groups there):
    the same training as without offload."""
    engine = _engine(_cfg("fp32", offload=True, voters="node", node_size=L))
    _train(engine, rank, 1, STEPS, "fp32")
    return {"params": _full_params(engine), "summary": engine.lioncub.summary(),
            "offloaded": all(f.device.type == "cpu" for f in engine.optimizer.fp32_partitioned_groups_flat)}


def _plain_scenario(rank, stage, offload):
    """No votes: DeepSpeed reduces over every rank, LionCub is global Lion on its partition."""
    engine = _engine(_cfg("fp32", stage=stage, offload=offload))
    _train(engine, rank, 1, 3, "fp32")
    return {"params": _full_params(engine) if stage == 3 else
            [p.detach().clone() for p in engine.module.parameters()],
            "summary": engine.lioncub.summary()}


def _seeded_scenario(rank):
    """A model seeded per rank (as scripts that seed by rank do): the groups start from rank 0's
    weights, so the run equals the one where every rank built the same model."""
    engine = _engine(_cfg("fp32", voters="node", node_size=L), seed=rank)
    _train(engine, rank, 1, STEPS, "fp32")
    return {"params": _full_params(engine)}


def _zero_init_refusal(rank):
    """A model built under deepspeed.zero.Init (partitioned over the world): refused by name."""
    import deepspeed
    cfg = _cfg("fp32", voters="node", node_size=L)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = _model()
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


def _size_disagreement(rank):
    """node_size from the launcher's LOCAL_SIZE, 2 on one node and 4 on the other: every rank
    raises the same error (the ranks of size 4 would otherwise build plain ZeRO-3 while the others
    wait in the group set-up)."""
    cfg = _cfg("fp32", voters="node")
    old = {var: os.environ.pop(var, None) for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")}
    os.environ["LOCAL_SIZE"] = "2" if rank < WORLD // 2 else "4"
    try:
        return _refusal(cfg)
    finally:
        for var, value in old.items():
            os.environ.pop(var, None)
            if value is not None:
                os.environ[var] = value


def _refusal(cfg, client=False):
    import deepspeed
    from lioncub_ds import LionCub
    model = _model()
    try:
        if client:
            opt = LionCub(model.parameters(), lr=LR, voters="node", node_size=L)
            deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        else:
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


def _all(rank, world_size, tmp):
    os.environ["LOCAL_RANK"] = str(rank % L)
    import lioncub_ds.deepspeed  # noqa: F401 - registers LionCub
    out = {"plain3": _plain_scenario(rank, 3, False), "offload3": _plain_scenario(rank, 3, True),
           "plain2": _plain_scenario(rank, 2, False), "offload2": _plain_scenario(rank, 2, True),
           "fp32": _votes_scenario(rank, "fp32", 0.0, os.path.join(tmp, "ckpt")),
           "bf16": _votes_scenario(rank, "bf16", 1.0, None, sub_group_size=50),
           "skip": _skip_scenario(rank),
           "skip_huge": _skip_scenario(rank, huge=True),
           "offload_votes": _offload_votes_scenario(rank),
           # a plain engine after the vote engines: DeepSpeed keeps the last mpu in a module global
           "plain3_after": _plain_scenario(rank, 3, False),
           "refuse_offload_votes": _refusal(_cfg("fp32", stage=2, offload=True, voters="node", node_size=L)),
           "refuse_client": _refusal({k: v for k, v in _cfg("fp32").items() if k != "optimizer"}, client=True),
           "seeded": _seeded_scenario(rank),
           "refuse_zero_init": _zero_init_refusal(rank),
           "refuse_sizes": _size_disagreement(rank),
           "refuse_zeropp": _refusal(dict(_cfg("fp32", voters="node", node_size=L),
                                          zero_optimization={"stage": 3, "zero_quantized_gradients": True})),
           "refuse_base64": _refusal(base64.urlsafe_b64encode(
               json.dumps(_cfg("fp32", voters="node", node_size=L)).encode()).decode())}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zero3"))
    return run_ranks(_all, WORLD, tmp, timeout=900, env=ENV)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_step_equals_the_node_voter_oracle_and_groups_stay_identical(results, dtype):
    for r, res in enumerate(results):
        x = res[dtype]
        assert x["exact"], f"rank {r} ({dtype}): a step differs from the oracle"
        assert x["same_across_groups"], f"rank {r}: the partitions differ across groups"
        assert x["steps"] == STEPS
        assert x["sub_groups"] == (2 if dtype == "bf16" else 1)  # bf16: the 15x7 weight, then the rest
        assert "ZeRO stage 3 with node voters" in x["summary"] and "2 node groups x 2 ranks" in x["summary"]
        if dtype == "bf16":
            assert x["low"], f"rank {r}: the bf16 partition is not the rounded fp32 master"
    assert [(x[dtype]["group"], x[dtype]["shard"]) for x in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_the_reduced_shard_is_the_groups_mean_gradient(results):
    assert all(res["fp32"]["mean_ok"] for res in results)


def test_only_votes_cross_a_group_and_state_is_one_over_L(results):
    floats_inside = 0
    for r, res in enumerate(results):
        x = res["fp32"]
        assert x["calls"], "positive control: the contract log recorded the steps' collectives"
        for name, ranks, dtype_s in x["calls"]:
            groups = {q // L for q in (ranks if ranks else range(WORLD))}
            if len(groups) > 1:
                assert dtype_s in ("torch.uint8", "torch.int8", "torch.int32", "torch.int64"), (r, name, dtype_s)
            elif dtype_s and "float" in dtype_s:
                floats_inside += 1
        # fp32 momentum of this rank's partition only: about 1/L of the model
        assert x["momentum_bytes"] <= 4 * (x["params"] / L + 64), x
        # the public helper reports the same momenta (summed over the sub-groups) and the model's size
        pub = x["public_state"]
        assert pub["momentum"] == x["momentum_bytes"] > 0 and pub["params"] == x["params"], pub
        assert pub["total"] == sum(v for k, v in pub.items() if k not in ("total", "params")), pub
    assert floats_inside > 0  # ZeRO-3's reduce-scatter and all-gather stay inside each group


def test_resume_is_exact_and_another_layout_is_refused_before_loading(results):
    for r, res in enumerate(results):
        x = res["fp32"]
        assert x["resumed"], f"rank {r}: resume differs"
        assert x["refused"] and "1 shard groups x 4 ranks" in x["refused"] and "node_size" in x["refused"], x
        assert x["unchanged_after_refusal"]
    assert results[0]["fp32"]["consolidated"], "zero3_fp32_state_dict differs from the saved model"
    files = results[0]["fp32"]["files"]
    # every group's ZeRO files (their momenta differ), and the layout
    assert "lioncub_zero3_layout.json" in files
    assert any("group1" in f and f.endswith("optim_states.pt") for f in files), files
    assert sum(f.endswith("optim_states.pt") for f in files) == WORLD, files


def test_a_checkpoint_some_rank_cannot_verify_is_refused_on_every_rank(results):
    for r, res in enumerate(results):
        x = res["fp32"]["refused_local"]
        assert x and "nothing was loaded" in x, (r, x)


def test_a_tag_only_some_ranks_find_is_refused_on_every_rank(results):
    """No tag given and 'latest' only on the first node (DeepSpeed writes it on global rank 0)."""
    for r, res in enumerate(results):
        x = res["fp32"]["refusals"]["no_latest"]
        assert x and x.startswith("ZeRO3VotesError") and "nothing was loaded, on any rank" in x, (r, x)
        assert ("no 'latest' file" in x) if r >= WORLD // 2 else ("another rank finds no checkpoint" in x), (r, x)
        assert res["fp32"]["unchanged_after_no_latest"]


def test_other_partitions_are_named_in_the_layout_refusal(results):
    for r, res in enumerate(results):
        x = res["fp32"]["refusals"]["sub_groups"]
        assert x and "in 2 sub-group partition(s) of 7, 8 elements" in x and "sub_group_size" in x, (r, x)


def test_groups_start_from_rank_zeros_weights_when_ranks_seed_apart(results):
    for r, res in enumerate(results):
        assert all(torch.equal(a, b) for a, b in zip(res["seeded"]["params"], res["fp32"]["full_final"])), \
            f"rank {r}: a run whose ranks built different models differs from the same-model run"


def test_a_zero_init_model_and_disagreeing_node_sizes_are_refused_on_every_rank(results):
    for r, res in enumerate(results):
        assert "zero.Init" in res["refuse_zero_init"] and "voters='rank'" in res["refuse_zero_init"], (r, res)
        assert "resolved different node sizes" in res["refuse_sizes"] and "rank 3: 4" in res["refuse_sizes"], \
            (r, res["refuse_sizes"])
        assert "zero_quantized_gradients=True" in res["refuse_zeropp"] and "Allowed" in res["refuse_zeropp"], r
        assert "could not" in res["refuse_base64"] and "voters='node'" in res["refuse_base64"], r


@pytest.mark.parametrize("case", ["skip", "skip_huge"])
def test_a_non_finite_gradient_in_one_group_skips_the_step_in_every_group(results, case):
    """``skip_huge`` (offloaded, two sub-groups): each sub-group's norm is finite in group 0, their
    combination is not."""
    finals = [res[case]["final"] for res in results]
    for r, res in enumerate(results):
        assert res[case]["skipped"], f"rank {r} stepped"
        assert res[case]["steps"] == 3  # steps 1, 2, 4
        assert res[case]["sub_groups"] == (2 if case == "skip_huge" else 1)
        assert all(torch.equal(a, b) for a, b in zip(finals[r], finals[0]))


def test_stage3_without_votes_is_global_lion_and_offload_trains_identically(results):
    for key in ("plain3", "offload3", "plain2", "offload2", "plain3_after"):
        firsts = results[0][key]["params"]
        for res in results:
            assert all(torch.equal(a, b) for a, b in zip(res[key]["params"], firsts)), key
    for a, b in (("plain3", "offload3"), ("plain2", "offload2"), ("plain3", "plain3_after")):
        assert all(torch.equal(x, y) for x, y in zip(results[0][a]["params"], results[0][b]["params"])), (a, b)
    for key in ("plain3", "plain3_after"):
        assert "ZeRO stage 3 (global Lion" in results[0][key]["summary"] and "N=4" in results[0][key]["summary"]


def test_votes_with_the_optimizer_offloaded_train_as_without(results):
    for r, res in enumerate(results):
        x = res["offload_votes"]
        assert x["offloaded"] and "ZeRO stage 3 with node voters" in x["summary"]
        assert all(torch.equal(a, b) for a, b in zip(x["params"], res["fp32"]["full_final"])), f"rank {r}"


def test_settings_it_cannot_serve_are_refused_by_name(results):
    for res in results:
        assert "offload_optimizer" in res["refuse_offload_votes"] and "stage=3" in res["refuse_offload_votes"]
        assert "optimizer=" in res["refuse_client"] and "stage=3" in res["refuse_client"]


def test_the_pretraining_script_trains_under_the_deepspeed_launcher(tmp_path):
    """docs/deepspeed.md's CPU command: 4 ranks as 2 node groups x 2, ZeRO-3 with votes, replicas in sync."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from test_front_door import _launch
    out_json = tmp_path / "run.json"
    proc, log = _launch(tmp_path, "--deepspeed_config", "configs/ds_cpu_zero3_node_voters.json", "--preset", "tiny",
                        "--steps", "4", "--log-interval", "2", "--eval-iters", "1", "--no-progress",
                        "--json-out", str(out_json), ranks=4, timeout=900)
    assert proc.returncode == 0, log[-6000:]
    summary = json.loads(out_json.read_text())
    assert summary["engine_mode"] == "LionCub (zero3_votes)" and summary["zero_stage"] == 3 and summary["params_in_sync"]
    assert summary["node_groups"] == 2 and summary["node_size"] == 2
    # votes only between the groups: 1 bit per element of this rank's partition, ~32x below an fp32 two-level
    # all-reduce's inter-node share (the mean of the 4 steps includes one int8 momentum sync)
    last = summary["comm_stats"]["last_step"]["by_scope"]["inter_node"]
    assert 0 < last < summary["two_level_inter_node_bytes"] / 24, summary
    assert summary["inter_node_bytes_per_step"] < summary["two_level_inter_node_bytes"] / 8, summary
