"""Node voters (voters="node", SPEC §7, issue 24) on real gloo ranks: Nn groups × L ranks.

Every check runs inside one launch per (Nn, L) (process start-up dominates the cost):
* each step equals a brute-force oracle computed independently in every rank (the gradients are
  deterministic per (rank, step), so no communication is needed for it): Nn voters, voter j with
  the mean of its L ranks' gradients (summed in local-rank order) and its own momentum, sign
  votes with abstentions and the hash tie rule on the element's index inside its parameter;
* every rank holds bit-identical parameters after every step;
* no floating-point tensor crosses a group boundary (the NCCL-contract log of every collective,
  its group and dtype), and comm_stats splits the bytes into intra- and inter-node;
* the optimizer state per rank follows the formula (momentum shards of 1/L of each bucket);
* a checkpoint resumes exactly at the same (Nn, L), and a changed L is refused.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lioncub_ds import Lion, LionCub
from lioncub_ds.config import LionCubConfigError
from lioncub_ds.kernels import reference
from lioncub_ds.testing import nccl_contract
from dist_helpers import SmallNet as Net, run_ranks

pytestmark = pytest.mark.dist

ENV = {"LIONCUB_KERNELS": "torch"}
STEPS = 5
LR, WD, BETAS = 0.01, 0.1, (0.9, 0.99)


def _grads(model, rank, step):
    """Rank ``rank``'s gradients at ``step`` (deterministic; computed by any process)."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    idx = torch.randint(0, 6, (4, 3), generator=gen)
    y = torch.randn(4, 3, generator=gen)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(idx), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _simulate(n_groups, size, dtype, first, last, momenta, master, tie_break="hash", record=None):
    """Steps first..last of plain Distributed Lion over node-mean gradients: Nn = ``n_groups``
    voters of ``size`` ranks, voter j's momenta ``momenta[j][k]`` (fp32, changed in place), fp32
    ``master`` values. Returns the parameters (in ``dtype``) after each step and the final masters;
    ``record``: a list that gets, per step, every parameter's (voters' sign votes, Δ)."""
    ref = Net().to(dtype)  # the gradients come from a model in the parameters' dtype, as in the run
    out = []
    for step in range(first, last + 1):
        with torch.no_grad():
            for p, m in zip(ref.parameters(), master):
                p.copy_(m.to(dtype))  # the forward sees the parameters in their dtype
        per_rank = [_grads(ref, r, step) for r in range(n_groups * size)]
        new = []
        for k, theta in enumerate(master):
            gbar = []
            for j in range(n_groups):
                acc = per_rank[j * size][k].float().clone()
                for rank_in_group in range(1, size):
                    acc.add_(per_rank[j * size + rank_in_group][k].float())
                gbar.append(acc.div_(size))
            cs = [reference.lion_direction(momenta[j][k].reshape(-1), gbar[j].reshape(-1), BETAS[0])
                  for j in range(n_groups)]
            votes = torch.sign(torch.stack(cs))
            plus, cnt = (votes > 0).sum(0), (votes != 0).sum(0)
            diff = 2 * plus - cnt
            delta = torch.sign(diff).float()
            ties = (diff == 0) & (cnt > 0)
            if tie_break == "hash":
                tie = reference.tie_hash_sign(step, torch.arange(theta.numel(), dtype=torch.int64)).float()
            else:
                tie = torch.zeros(theta.numel())
            delta = torch.where(ties, tie, delta)
            if record is not None:
                record.append((step, k, votes, delta))
            e = theta.clone()
            e.mul_(1.0 - LR * WD)
            e.add_(delta.view_as(e).mul(-LR))
            new.append(e)
            for j in range(n_groups):
                reference.momentum_update(momenta[j][k], gbar[j], BETAS[1])
        master = new
        out.append([m.to(dtype) for m in master])
    return out, master


def _average_voters(momenta, ks):
    """momentum_sync over the voters in the oracle: parameter k's momenta (for k in ``ks``) become
    their fp32 mean (sum in voter order, then / Nn)."""
    for k in ks:
        mean = momenta[0][k].clone()
        for m in momenta[1:]:
            mean.add_(m[k])
        mean.div_(len(momenta))
        for m in momenta:
            m[k].copy_(mean)


def _oracle(n_groups, size, dtype, tie_break, steps):
    """The parameters after each step, by plain Distributed Lion over node-mean gradients."""
    torch.manual_seed(0)
    master = [p.detach().float().clone() for p in Net().to(dtype).parameters()]
    momenta = [[torch.zeros_like(m) for m in master] for _ in range(n_groups)]
    return _simulate(n_groups, size, dtype, 1, steps, momenta, master, tie_break)[0]


def _run(rank, world_size, size, comm, dtype, tie_break):
    torch.manual_seed(0)
    model = Net().to(dtype)
    kw = {"quant": "l1"} if comm in ("int8", "bbit") else {}
    opt = LionCub(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, comm=comm, tie_break=tie_break,
                  voters="node", node_size=size, bucket_size_mb=0.0002, **kw)  # several buckets
    nccl_contract.reset()
    after = []
    for step in range(1, STEPS + 1):
        for p, g in zip(model.parameters(), _grads(model, rank, step)):
            p.grad = g.to(dtype)
        opt.step()
        after.append([p.detach().clone() for p in model.parameters()])
    res = {"after": after, "stats": opt.comm_stats(), "state": opt.state_bytes(),
           "shard_numels": [b.numel for b in opt.plan.buckets],
           "full_numels": [b.numel for b in opt.plan.sharding.full],
           "log": list(nccl_contract.log()), "world": opt.world_size, "rank": opt.rank}
    # resume: a fresh optimizer on the same model loads this one's state and goes on like it
    sd = opt.state_dict()
    twin_model = Net().to(dtype)
    twin_model.load_state_dict(model.state_dict())
    twin = LionCub(twin_model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, comm=comm, tie_break=tie_break,
                   voters="node", node_size=size, bucket_size_mb=0.0002, **kw)
    twin.load_state_dict(sd)
    for m, o in ((model, opt), (twin_model, twin)):
        for p, g in zip(m.parameters(), _grads(m, rank, STEPS + 1)):
            p.grad = g.to(dtype)
        o.step()
    res["resumed_equal"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))
    # a different L: refused before anything is loaded
    flat = LionCub(Net().to(dtype).parameters(), lr=LR, comm=comm, voters="node", node_size=1, **kw)
    try:
        flat.load_state_dict(sd)
        res["other_layout"] = None
    except LionCubConfigError as exc:
        res["other_layout"] = str(exc)
    return res


CASES = [(2, 2, "1bit", torch.float32, "hash"), (2, 3, "1bit", torch.float32, "zero"),
         (3, 2, "allgather", torch.float32, "hash"), (4, 2, "pbit", torch.float32, "hash"),
         (1, 2, "1bit", torch.float32, "hash"), (2, 2, "1bit", torch.bfloat16, "hash")]


@pytest.mark.parametrize("n_groups,size,comm,dtype,tie_break", CASES,
                         ids=[f"{n}x{s}-{c}-{str(d)[6:]}-{t}" for n, s, c, d, t in CASES])
def test_node_voters_match_the_oracle_on_real_ranks(n_groups, size, comm, dtype, tie_break):
    world = n_groups * size
    res = run_ranks(_run, world, size, comm, dtype, tie_break, timeout=400, env=ENV)
    want = _oracle(n_groups, size, dtype, tie_break, STEPS)
    for r in range(world):
        assert res[r]["world"] == world and res[r]["rank"] == r
        for step in range(STEPS):
            for k, (got, exp) in enumerate(zip(res[r]["after"][step], want[step])):
                assert torch.equal(got, exp), f"rank {r} step {step + 1} param {k}: {(got - exp).abs().max()}"
        assert res[r]["resumed_equal"]
        assert res[r]["other_layout"] is not None and "voters" in res[r]["other_layout"]
    # no floating-point tensor in a collective whose group spans two node groups
    node_of = lambda rank: rank // size  # noqa: E731
    for r in range(world):
        for entry in res[r]["log"]:
            ranks, dtype_s = entry[1], entry[2]
            if ranks and len({node_of(x) for x in ranks}) > 1:
                assert dtype_s in ("torch.uint8", "torch.int8", "torch.int32", "torch.int64"), entry
        scopes = res[r]["stats"]["cumulative"]["by_scope"]
        assert set(scopes) <= {"intra_node", "inter_node"}, scopes
        if n_groups == 1:
            assert scopes.get("inter_node", 0) == 0  # one voter: no votes on the slow link
    # state per rank: a momentum shard of 1/L of every bucket (fp32), and fp32 masters for bf16 only
    for r in range(world):
        st = res[r]["state"]
        assert [f // size for f in res[r]["full_numels"]] == res[r]["shard_numels"]
        assert st["momentum"] == 4 * sum(res[r]["shard_numels"])
        assert st["master"] == (4 * sum(res[r]["shard_numels"]) if dtype != torch.float32 else 0)
        assert st["momentum"] <= 4 * st["params"] / size * 1.05 + 4 * 8 * world * len(res[r]["full_numels"])
        # the step buffers kept between steps (docs/node_voters.md): the gradients' send and receive
        # buffers and the parameters' all-gather buffer (whole buckets, in the parameters' dtype), the
        # fp32 mean-gradient shard, and for fp32 parameters the fp32 work shard
        full, shard, elt = sum(res[r]["full_numels"]), sum(res[r]["shard_numels"]), dtype.itemsize
        assert st["workspace"] == 3 * elt * full + 4 * shard + (4 * shard if dtype == torch.float32 else 0), st


def _flat_vs_node1(rank, world_size):
    out = []
    for voters in ("rank", "node"):
        torch.manual_seed(0)
        model = Net()
        kw = {"node_size": 1} if voters == "node" else {}
        opt = LionCub(model.parameters(), lr=LR, weight_decay=WD, comm="1bit", voters=voters, **kw)
        for step in range(1, 4):
            for p, g in zip(model.parameters(), _grads(model, rank, step)):
                p.grad = g
            opt.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return out


def test_node_size_one_is_flat_voting_bit_for_bit():
    res = run_ranks(_flat_vs_node1, 3, timeout=240, env=ENV)
    for r in range(3):
        assert torch.equal(res[r][0], res[r][1])


def _bad_node_size(rank, world_size):
    try:
        LionCub(Net().parameters(), lr=LR, voters="node", node_size=2)
    except LionCubConfigError as exc:
        return str(exc)
    return None


def test_a_node_size_that_does_not_divide_the_ranks_is_refused():
    res = run_ranks(_bad_node_size, 3, timeout=240, env=ENV)
    for r in range(3):
        assert res[r] is not None and "node_size=2" in res[r] and "divisor of 3" in res[r]


def _replicas(rank, world_size, comm, sync):
    torch.manual_seed(0)
    model = Net()
    kw = {"quant": "l1"} if comm in ("int8", "bbit") else {}
    if sync:
        kw["momentum_sync"] = {"every": 1, "dtype": "int8"}  # after every step: the peers hold the same
    opt = LionCub(model.parameters(), lr=LR, weight_decay=WD, comm=comm, voters="node", node_size=2,
                  bucket_size_mb=0.0002, **kw)
    for step in range(1, 5):
        for p, g in zip(model.parameters(), _grads(model, rank, step)):
            p.grad = g
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(every, flat)
    shards = opt.state_dict()["lioncub"]["node"]["momentum"]
    return {"same": all(torch.equal(flat, e) for e in every), "moved": opt.step_count,
            "momentum": torch.cat([shards[i] for i in sorted(shards)])}


@pytest.mark.parametrize("comm,sync", [("int8", False), ("bbit", False), ("1bit", True)])
def test_scaled_votes_and_momentum_sync_keep_replicas_identical(comm, sync):
    res = run_ranks(_replicas, 4, comm, sync, timeout=300, env=ENV)
    for r in range(4):
        assert res[r]["same"] and res[r]["moved"] == 4
    if sync:  # the sync averaged each momentum shard over the two voters: the shard peers hold the same
        assert torch.equal(res[0]["momentum"], res[2]["momentum"])
        assert torch.equal(res[1]["momentum"], res[3]["momentum"])


def _master_only(rank, world_size, comm):
    """voters='rank' with node_size=2 on bf16 parameters vs flat LionCub stepping fp32 copies of
    them (what a framework's fp32 master does): the same parameters after every step."""
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    ref = Net()
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    kw = {"quant": "l1"} if comm in ("int8", "bbit") else {}
    opt = LionCub(model.parameters(), lr=LR, weight_decay=WD, comm=comm, node_size=2, bucket_size_mb=0.0002, **kw)
    ref_opt = LionCub(ref.parameters(), lr=LR, weight_decay=WD, comm=comm, bucket_size_mb=0.0002, **kw)
    same = []
    for step in range(1, STEPS + 1):
        grads = _grads(model, rank, step)
        for p, q, g in zip(model.parameters(), ref.parameters(), grads):
            p.grad, q.grad = g, g.float()
        opt.step()
        ref_opt.step()
        same.append(all(torch.equal(p, q.to(torch.bfloat16)) for p, q in zip(model.parameters(), ref.parameters())))
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    every = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(every, flat)
    sd = opt.state_dict()
    return {"same": same, "replicas": all(torch.equal(flat, e) for e in every), "state": opt.state_bytes(),
            "layout": {k: v for k, v in sd["lioncub"]["node"].items() if k not in ("momentum", "master")},
            "scopes": opt.comm_stats()["cumulative"]["by_scope"]}


def _resync_with_masters(rank, world_size, voters):
    """bf16 parameters with fp32 master shards; rank 0's parameters are moved by +1 (drift),
    check_replicas('resync') broadcasts them: the next step must start from them, not from the
    master shards' old values."""
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    opt = LionCub(model.parameters(), lr=LR, weight_decay=WD, comm="1bit", voters=voters, node_size=2,
                  drift_action="resync")
    for step in (1, 2):
        for p, g in zip(model.parameters(), _grads(model, rank, step)):
            p.grad = g
        opt.step()
    before = [p.detach().float().clone() for p in model.parameters()]
    if rank == 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    agreed = opt.check_replicas()
    for p, g in zip(model.parameters(), _grads(model, rank, 3)):
        p.grad = g
    opt.step()
    after = [p.detach().float() for p in model.parameters()]
    # one step moves a parameter by lr·(1 + |wd·p|) at most: far less than the +1 of the resync
    moved = min(float((a - b).mean()) for a, b in zip(after, before))
    flat = torch.cat([a.reshape(-1) for a in after])
    every = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(every, flat)
    return {"agreed": agreed, "moved": moved, "replicas": all(torch.equal(flat, e) for e in every)}


@pytest.mark.parametrize("voters", ["node", "rank"])
def test_resync_rebuilds_the_master_shards(voters):
    res = run_ranks(_resync_with_masters, 4, voters, timeout=300, env=ENV)
    for r in range(4):
        assert res[r]["agreed"] is False and res[r]["replicas"]
        assert res[r]["moved"] > 0.9, res[r]  # the resynchronized (+1) values, not the old masters'


@pytest.mark.parametrize("comm", ["1bit", "pbit", "int8"])
def test_master_only_sharding_equals_flat_voting_on_an_fp32_master(comm):
    res = run_ranks(_master_only, 4, comm, timeout=300, env=ENV)
    for r in range(4):
        assert all(res[r]["same"]), res[r]["same"]
        assert res[r]["replicas"]
        st = res[r]["state"]
        # full fp32 momenta (every rank votes with its own), and a master of 1/L of the padded buckets
        assert st["master"] == 4 * sum(res[r]["layout"]["numels"]) and st["momentum"] == 4 * st["params"]
        assert st["master"] <= 4 * st["params"] / 2 * 1.05 + 4 * 8 * 4 * len(res[r]["layout"]["numels"])
        assert res[r]["layout"]["node_size"] == 2 and res[r]["layout"]["local_rank"] == r % 2
        assert res[r]["scopes"].get("intra_node", 0) > 0


def _idle(rank, world_size, voters, dtype):
    """Three parameters in shared buckets: ``used`` has a gradient on every rank every step;
    ``idle`` never has one; ``late`` has the same gradient on every rank at steps 1, 2, 5 and none
    at steps 3, 4. As in Lion (and flat voting), a parameter without a gradient on any rank keeps
    its value, its momentum and its fp32 master: ``idle`` never moves, and ``late`` follows
    single-process Lion that skips it at steps 3, 4 (identical gradients: every voter agrees)."""
    torch.manual_seed(0)
    used, idle, late = (torch.nn.Parameter(torch.randn(s).to(dtype)) for s in ((29,), (11,), (7,)))
    idle0 = idle.detach().clone()
    ref = torch.nn.Parameter(late.detach().float().clone())
    kw = dict(voters="node") if voters == "node" else {}
    opt = LionCub([used, idle, late], lr=LR, weight_decay=WD, betas=BETAS, comm="1bit", node_size=2,
                  bucket_size_mb=0.0001, **kw)
    ref_opt = Lion([ref], lr=LR, weight_decay=WD, betas=BETAS)
    same = []
    for step in range(1, 6):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        used.grad = torch.randn(29, generator=gen).to(dtype)
        shared = torch.randn(7, generator=torch.Generator().manual_seed(step)).to(dtype)
        late.grad = shared if step in (1, 2, 5) else None
        ref.grad = shared.float() if step in (1, 2, 5) else None
        opt.step()
        ref_opt.step()
        same.append(torch.equal(late.detach(), ref.detach().to(dtype)))
    flat = torch.cat([p.detach().float() for p in (used, idle, late)])
    every = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(every, flat)
    return {"idle_kept": torch.equal(idle.detach(), idle0), "late_as_lion": same,
            "replicas": all(torch.equal(flat, e) for e in every)}


@pytest.mark.parametrize("voters,dtype", [("node", torch.float32), ("node", torch.bfloat16),
                                          ("rank", torch.bfloat16)], ids=["node-fp32", "node-bf16", "master-only-bf16"])
def test_a_parameter_without_a_gradient_on_any_rank_keeps_value_momentum_and_master(voters, dtype):
    res = run_ranks(_idle, 4, voters, dtype, timeout=300, env=ENV)
    for r in range(4):
        assert res[r]["idle_kept"], r
        assert all(res[r]["late_as_lion"]), (r, res[r]["late_as_lion"])
        assert res[r]["replicas"], r


# Parameters of odd sizes; with a tiny bucket_size_mb each is a bucket of its own: more buckets
# than the ring of whole-bucket step buffers has slots (sharding.WINDOW), of different sizes, so
# slots change hands (a 1-element parameter's bucket has a shard of padding only, which its local
# step reads: it must be zero, whatever the slot's last bucket left there).
RING_SIZES = (37, 5, 61, 3, 29, 17, 8, 91, 1, 44, 13)


def _many_buckets_vs_one(rank, world_size, dtype, kw, prepare):
    import logging

    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("lioncub_ds").addHandler(handler)
    out = {}
    for mb in (1e-6, 1.0):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in RING_SIZES]
        opt = LionCub(params, lr=LR, betas=BETAS, weight_decay=WD, comm="1bit", bucket_size_mb=mb, **kw)
        for step in range(1, 5):
            gen = torch.Generator().manual_seed(100 * rank + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            if step == 2 and rank == 1:  # skipped on every rank; the next steps go on
                for p in params:
                    p.grad.fill_(float("inf"))  # as a loss of inf gives
            if prepare and step % 2:
                opt.prepare_step()  # the votes start before step(): the window fills from here
            opt.step()
        full = getattr(opt.plan.sharding, "full", opt.plan.buckets)  # (master-only: the buckets are full)
        out[mb] = {"params": [p.detach().clone() for p in params], "workspace": opt.state_bytes()["workspace"],
                   "full": [b.numel for b in full], "shard": [b.numel for b in opt.plan.buckets],
                   "steps": opt.step_count, "skipped": [w for w in warnings if "non-finite" in w]}
        warnings.clear()
    return out


RING_CASES = {"node-fp32": (torch.float32, {"voters": "node", "node_size": 2}, False),
              "node-bf16-prepare_step": (torch.bfloat16, {"voters": "node", "node_size": 2}, True),
              "master_only-bf16": (torch.bfloat16, {"node_size": 2}, False)}


@pytest.mark.parametrize("case", list(RING_CASES))
def test_the_ring_of_step_buffers_changes_no_bit_and_bounds_their_memory(case):
    """Eleven buckets through four slots equal one bucket bit for bit (so do all ranks), and the
    buffers kept between steps are at most a window of the largest buckets, not the model: node
    voters (send, receive and all-gather rings; also with prepare_step() starting the votes) and
    master-only sharding (its all-gather ring)."""
    from lioncub_ds.sharding import WINDOW

    dtype, kw, prepare = RING_CASES[case]
    res = run_ranks(_many_buckets_vs_one, 4, dtype, kw, prepare, timeout=300, env=ENV)
    elt = dtype.itemsize
    rings_per_bucket = 3 if kw.get("voters") == "node" else 1  # master-only: the all-gather's only
    for r in range(4):
        many, one = res[r][1e-6], res[r][1.0]
        assert len(many["full"]) == len(RING_SIZES) > WINDOW and len(one["full"]) == 1
        # only step 2 is skipped: a bucket whose shard is all padding (a 1-element parameter's)
        # reads zeros there, not what the slot's last bucket left (the skipped step's infs)
        for run in (many, one):
            assert run["steps"] == 3 and len(run["skipped"]) == 1, run["skipped"]
            assert f"at step 2 (non-finite values in all: {sum(RING_SIZES)})" in run["skipped"][0], run["skipped"]
        for k, (a, b) in enumerate(zip(many["params"], one["params"])):
            assert torch.equal(a, b), f"rank {r} param {k}: {(a.float() - b.float()).abs().max()}"
            assert torch.equal(a, res[0][1e-6]["params"][k])
        shard = 0
        if kw.get("voters") == "node":
            shard = 4 * sum(many["shard"]) * (2 if dtype == torch.float32 else 1)  # ḡ shards (+ fp32 work shards)
        rings = many["workspace"] - shard
        # the ring slots: at most the WINDOW largest buckets, each in the parameters' dtype
        assert 0 < rings <= rings_per_bucket * elt * sum(sorted(many["full"])[-WINDOW:]), many
        assert rings < rings_per_bucket * elt * sum(many["full"]), many  # whole-bucket buffers: every bucket
