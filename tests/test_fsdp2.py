"""FSDP2 with votes (lioncub_ds.fsdp, issue 44 item 3) on 4 real gloo ranks: 2 shard groups × 2.

One launch runs every check (process start-up dominates the cost); the tests below read its
results. What each rank records per step: FSDP2's reduced gradient shards (before and after
gradient clipping), its parameter shards after the step and the NCCL-contract call log. The
oracle runs here, in the parent, on the full tensors put together from the shards:

* per shard group j the gradient LionCub must see is the one FSDP2 produced (gathered from the
  ranks, not recomputed: FSDP2's reduction order is its own), checked separately to be close to
  the mean of the group's local gradients (computed here from the same batches) and, after
  ``clip_grad_norm_``, to be that mean scaled to the group's own norm;
* Nn voters, voter j with its own momentum of every full parameter, sign votes with abstentions,
  majority across the groups with the hash tie rule keyed on the element's index inside the full
  parameter (a shard-local index would break other ties on the second shard), decoupled decay:
  every step's parameters must equal it bit for bit, in fp32 and with bf16 mixed precision;
* one shard group (L = world) is plain Lion on the group-mean gradient (no votes, no bytes
  between groups);
* no floating-point tensor crosses between shard groups (FSDP2's all-gathers and reduce-scatters
  stay inside the group, the votes cross as bytes), per the call log of every collective;
* optimizer state per rank is this rank's shards' momenta: 1/L of flat LionCub's over a group;
* a DCP checkpoint resumes bit-exactly, another shard size is refused by name before anything
  loads, and bad settings are refused on every rank before any process group or state exists.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lioncub_ds.kernels import reference
from dist_helpers import SmallNet as Net, run_ranks

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]
ENV = {"LIONCUB_KERNELS": "torch"}
WORLD, L = 4, 2
STEPS, MORE = 4, 2
LR, WD, BETAS, CLIP = 0.01, 0.1, (0.9, 0.99), 0.3
NAMES = [n for n, _ in Net().named_parameters()]
INTEGER = ("torch.uint8", "torch.int8", "torch.int32", "torch.int64")


def _batch(rank, step):
    """Rank ``rank``'s batch at ``step`` (deterministic, so the parent can recompute it)."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, 6, (4, 3), generator=gen), torch.randn(4, 3, generator=gen)


def _loss(model, rank, step):
    idx, y = _batch(rank, step)
    return torch.nn.functional.mse_loss(model(idx).float(), y)


def _locals(model):
    with torch.no_grad():
        return [p.to_local().detach().clone() for p in model.parameters()]


def _train(model, opt, first, last, clip=True):
    """Steps first..last; per step FSDP2's reduced gradient shards before / after clipping and the
    parameter shards after the step."""
    import torch.distributed as dist
    rank = dist.get_rank()
    rec = []
    for step in range(first, last + 1):
        _loss(model, rank, step).backward()
        pre = [p.grad.to_local().clone() for p in model.parameters()]
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        post = [p.grad.to_local().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        rec.append({"pre": pre, "post": post, "after": _locals(model)})
    return rec


class Block(torch.nn.Module):
    """A block that may hold another block: ``modules=Block`` matches a parent and its child."""

    def __init__(self, inner=None):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)
        self.inner = inner

    def forward(self, x):
        x = torch.tanh(self.fc(x))
        return self.inner(x) if self.inner is not None else x


class Nested(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(6, 3)
        self.outer = Block(Block())
        self.head = torch.nn.Linear(3, 3)

    def forward(self, idx):
        return self.head(self.outer(self.emb(idx).mean(1)))


def _meta_net():
    with torch.device("meta"):
        return Net()


def _refusal_cases():
    """label -> (model, shard_and_vote's keywords, the words the message must hold)."""
    def twice(net):
        ps = list(net.parameters())
        return [{"params": ps}, {"params": [ps[0]], "lr": 0.5}]
    cases = {label: (lambda: Net(), kw, [label]) for label, kw in {
        "shard_size=3": dict(shard_size=3), "voters": dict(voters="node"), "node_size": dict(node_size=2),
        "overlap": dict(overlap=True), "momentum_sync.group": dict(momentum_sync={"every": 5, "group": "node"}),
        "lr": dict(lr=-1.0)}.items()}
    cases.update({
        # a parameter listed twice (two groups, or twice in one): it would be stepped twice
        "twice in two groups": (Net, lambda net: dict(params=twice(net)),
                                ["'emb.weight'", "listed twice", "groups 0 and 1", "listed once"]),
        "twice in one group": (Net, lambda net: dict(params=[*net.parameters(), net.fc2.bias]),
                               ["'fc2.bias'", "listed twice", "listed once"]),
        "pair with a name the model lacks": (Net, lambda net: dict(params=[("fc9.weight", net.fc1.weight)]),
                                             ["'fc9.weight'", "not a parameter of the model", "named_parameters"]),
        "pair with another parameter": (Net, lambda net: dict(params=[("fc1.weight", net.fc2.weight)]),
                                        ["'fc1.weight'", "not the model's parameter"]),
        "modules as a string": (Net, dict(modules="Block"), ["modules='Block'", "module class", "allowed"]),
        "modules not a module class": (Net, dict(modules=(int,)), ["int is not a torch.nn.Module class", "allowed"]),
        "modules outside the model": (Net, lambda net: dict(modules=[torch.nn.Linear(2, 2)]),
                                      ["not inside the model", "allowed"]),
        "init_weights": (Net, dict(init_weights=3), ["init_weights=3", "not callable"]),
        "meta without init_weights": (_meta_net, {}, ["meta device", "init_weights=fn"]),
        "timeout_s": (Net, dict(timeout_s=-1.0), ["timeout_s=-1.0"]),
        "a param group's own lr": (Net, lambda net: dict(params=[{"params": list(net.parameters()), "lr": -1.0}]),
                                   ["param group #0", "lr=-1.0", "allowed"]),
    })
    return cases


def _refusals(rank):
    """Bad settings, groupings, params and modules: LionCubConfigError on every rank, before any
    process group (no collective, no new_group in the call log), optimizer or FSDP2 sharding exists."""
    from torch.distributed.tensor import DTensor
    from lioncub_ds.fsdp import shard_and_vote
    from lioncub_ds.testing import nccl_contract
    from dist_helpers import recording_optimizer_inits
    out = {}
    for label, (make, kw, _) in _refusal_cases().items():
        net = make()
        kw = kw(net) if callable(kw) else kw
        before = len(nccl_contract.log())
        with recording_optimizer_inits() as inits:
            try:
                shard_and_vote(net, **{"shard_size": L, "lr": LR, **kw})
                msg = None
            except Exception as exc:  # noqa: BLE001 - the type is checked by the test
                msg = f"{type(exc).__name__}: {exc}"
        sharded = any(isinstance(p, DTensor) for p in net.parameters())
        out[label] = (msg, len(nccl_contract.log()) - before, list(inits), sharded)
    return out


def _late_refusals(sg):
    """LionCubFSDP on models that FSDP2 did not shard on the shard mesh: refused before any state."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from lioncub_ds.config import LionCubConfigError
    from lioncub_ds.fsdp import LionCubFSDP
    from dist_helpers import recording_optimizer_inits
    import torch.distributed as dist
    from lioncub_ds.fsdp import shard_mesh
    hsdp = Net()
    fully_shard(hsdp, mesh=init_device_mesh("cpu", (WORLD // L, L), mesh_dim_names=("replicate", "shard")))
    meta = _meta_net()  # sharded on "meta", never materialized
    fully_shard(meta, mesh=shard_mesh(sg))
    torch.manual_seed(100 + dist.get_rank())  # every rank its own weights: the groups start apart
    apart = Net()
    fully_shard(apart, mesh=shard_mesh(sg))
    out = {}
    for label, model in (("plain", Net()), ("hsdp", hsdp), ("meta", meta), ("apart", apart)):
        with recording_optimizer_inits() as inits:
            try:
                LionCubFSDP(model, shard_groups=sg, lr=LR)
                msg = None
            except LionCubConfigError as exc:
                msg = str(exc)
        out[label] = (msg, list(inits))
    return out


def _rank_body(rank, world_size, path):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from lioncub_ds.config import LionCubConfigError
    from lioncub_ds.fsdp import load, save, shard_and_vote
    from lioncub_ds.testing import nccl_contract
    settings = dict(lr=LR, betas=BETAS, weight_decay=WD, comm="1bit")
    res = {"refused": _refusals(rank)}

    # fp32, 2 groups x 2: the oracle run, its call log, its state; a checkpoint after STEPS steps
    torch.manual_seed(0)
    model, opt = shard_and_vote(Net(), L, **settings)
    res["init"] = _locals(model)
    nccl_contract.reset()
    res["fp32"] = _train(model, opt, 1, STEPS)
    res["log"] = nccl_contract.log()
    res["state"] = opt.state_bytes()
    res["scopes"] = dict(opt.comm_stats()["cumulative"]["by_scope"])
    res["starts"] = [getattr(leaf, "lioncub_element_start") for _, _, leaf in opt._fsdp]
    save(path, model, opt)
    res["continued"] = _train(model, opt, STEPS + 1, STEPS + MORE)

    # resume: a fresh model and optimizer load the checkpoint and take the same steps
    torch.manual_seed(1)  # another init: everything must come from the checkpoint
    model2, opt2 = shard_and_vote(Net(), L, **settings)
    load(path, model2, opt2)
    res["resumed"] = _train(model2, opt2, STEPS + 1, STEPS + MORE)
    res["resumed_step"] = opt2.step_count
    res["skip"] = _nonfinite_on_one_rank(model2, opt2, STEPS + MORE + 1)

    # another shard size: refused by name before anything loads; then one group: global Lion
    torch.manual_seed(0)
    model4, opt4 = shard_and_vote(Net(), WORLD, **settings)
    fresh = _locals(model4)
    try:
        load(path, model4, opt4)
        res["other_size"] = None
    except LionCubConfigError as exc:
        res["other_size"] = str(exc)
    res["other_size_untouched"] = all(torch.equal(a, b) for a, b in zip(fresh, _locals(model4)))
    res["one_init"] = fresh
    res["one"] = _train(model4, opt4, 1, STEPS, clip=False)
    res["one_scopes"] = dict(opt4.comm_stats()["cumulative"]["by_scope"])

    # bf16 mixed precision: bf16 all-gathers and reduce-scatters, fp32 sharded parameters and momenta
    torch.manual_seed(0)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model_bf, opt_bf = shard_and_vote(Net(), L, mp_policy=mp, **dict(settings, comm="allgather"))
    res["bf16_init"] = _locals(model_bf)
    nccl_contract.reset()
    res["bf16"] = _train(model_bf, opt_bf, 1, STEPS)
    res["bf16_log"] = nccl_contract.log()
    res["late_refused"] = _late_refusals(opt.fsdp_shard_groups)

    # L = 1: no sharding, every rank a voter (flat LionCub on its own gradient)
    torch.manual_seed(0)
    model1, opt1 = shard_and_vote(Net(), 1, **settings)
    res["flat_init"] = _locals(model1)
    res["flat"] = _train(model1, opt1, 1, 2)

    # momentum_sync over the voters (the one float allowed between groups, when set)
    torch.manual_seed(0)
    model_s, opt_s = shard_and_vote(Net(), L, momentum_sync={"every": 1}, **settings)
    nccl_contract.reset()
    _train(model_s, opt_s, 1, 2, clip=False)
    res["sync_log"] = nccl_contract.log()
    res["sync_momenta"] = [opt_s.state[leaf]["exp_avg"].clone() for _, _, leaf in opt_s._fsdp]
    res["sync_after"] = _locals(model_s)
    res["review"] = _review(rank, path)
    return res


def _review(rank, path):
    """The review's cases, each caught (its error text kept) so one failure names itself:
    groups starting apart, nested modules=, a model on "meta" with init_weights, timeout_s,
    make_shard_groups' refusal."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from lioncub_ds.comm.base import Collectives, group_timeout_s
    from lioncub_ds.fsdp import shard_and_vote
    from lioncub_ds.groups import make_shard_groups
    from lioncub_ds.testing import nccl_contract
    settings = dict(lr=LR, betas=BETAS, weight_decay=WD, comm="1bit")
    out = {}

    def apart():  # every rank its own seed: shard_and_vote broadcasts shard group 0's shards
        torch.manual_seed(100 + rank)
        model, opt = shard_and_vote(Net(), L, **settings)
        return {"init": _locals(model), "steps": _train(model, opt, 1, 2, clip=False)}

    def nested():  # modules=Block matches a Block and the Block inside it: children are sharded first
        torch.manual_seed(0)
        model, opt = shard_and_vote(Nested(), L, modules=Block, **settings)
        wrapped = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
        for step in (1, 2):
            idx, y = _batch(rank, step)
            torch.nn.functional.mse_loss(model(idx), y).backward()
            opt.step()
            opt.zero_grad()
        return {"wrapped": wrapped, "after": _locals(model), "count": opt.step_count}

    def meta():  # built on "meta": shard_and_vote runs to_empty and init_weights, then the optimizer
        seen = []

        def init_weights(model):
            seen.append(not torch.is_grad_enabled()
                        and all(isinstance(p, DTensor) and p.device.type == "cpu" for p in model.parameters()))
            torch.manual_seed(200 + rank)
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        model, opt = shard_and_vote(_meta_net(), L, init_weights=init_weights, **settings)
        return {"seen": seen, "init": _locals(model), "steps": _train(model, opt, 1, 2, clip=False),
                "count": opt.step_count}

    def timeout():
        torch.manual_seed(0)
        model, opt = shard_and_vote(Net(), L, timeout_s=123.0, **settings)
        _train(model, opt, 1, 1, clip=False)
        colls = [c for c in vars(opt.plan.sharding).values() if isinstance(c, Collectives)]
        return {"config": opt.config.timeout_s, "deadlines": sorted({c.timeout.total_seconds() for c in colls}),
                "groups": [group_timeout_s(g, torch.device("cpu")) for g in (opt.fsdp_shard_groups.shard,
                                                                            opt.fsdp_shard_groups.peers)]}

    def bad_size():
        res = {}
        for label, kw in (("shard_size", {}), ("node_size", {"setting": "node_size"})):
            before = len(nccl_contract.log())
            try:
                make_shard_groups(3, **kw)
                res[label] = (None, 0)
            except ValueError as exc:
                res[label] = (str(exc), len(nccl_contract.log()) - before)
        return res

    def regrouped(path):
        """Saved with two param groups (their own lr / weight decay); loaded into one group, into the
        same two groups cut elsewhere, and into the groups in another order: refused by name, nothing
        loaded; into the same groups: loaded, the groups' settings back."""
        from lioncub_ds.fsdp import load, save
        from lioncub_ds.config import LionCubConfigError

        def split(net, k, lrs=(0.01, 0.001)):
            pairs = list(net.named_parameters())
            return [{"params": pairs[:k], "lr": lrs[0], "weight_decay": 0.5},
                    {"params": pairs[k:], "lr": lrs[1], "weight_decay": 0.0}]
        torch.manual_seed(0)
        net = Net()
        model, opt = shard_and_vote(net, L, params=split(net, 2), **dict(settings, lr=0.005))
        _train(model, opt, 1, 1, clip=False)
        save(path, model, opt)
        res = {}
        for label, make in (("one group", lambda n: None), ("cut elsewhere", lambda n: split(n, 3, (0.003, 0.003))),
                            ("reordered", lambda n: split(n, 2)[::-1]), ("same", lambda n: split(n, 2, (0.7, 0.7)))):
            torch.manual_seed(0)
            n = Net()
            m2, o2 = shard_and_vote(n, L, params=make(n), **settings)
            before = [(g["lr"], g["weight_decay"]) for g in o2.param_groups]
            try:
                load(path, m2, o2)
                res[label] = ("loaded", o2.step_count, [(g["lr"], g["weight_decay"]) for g in o2.param_groups])
            except LionCubConfigError as exc:
                res[label] = (str(exc), o2.step_count, [(g["lr"], g["weight_decay"]) for g in o2.param_groups] == before)
        return res

    def sync_resume(path):
        """A drift-scheduled momentum sync: the resumed run syncs after the same steps as the
        uninterrupted one (its trigger and counters are in the checkpoint), bit for bit."""
        from lioncub_ds.fsdp import load, save
        kw = dict(settings, momentum_sync={"schedule": "drift", "threshold": 0.005, "min_every": 4})

        def run(model, opt, first, last):
            syncs = []
            for step in range(first, last + 1):
                _train(model, opt, step, step, clip=False)
                syncs.append(opt.comm_stats()["momentum_sync"]["syncs"])
            return syncs, _locals(model)
        torch.manual_seed(0)
        model, opt = shard_and_vote(Net(), 1, **kw)
        run(model, opt, 1, 4)
        save(path, model, opt)
        whole = run(model, opt, 5, 16)
        torch.manual_seed(5)
        model2, opt2 = shard_and_vote(Net(), 1, **kw)
        load(path, model2, opt2)
        resumed = run(model2, opt2, 5, 16)
        return {"syncs": (whole[0], resumed[0]),
                "equal": all(torch.equal(a, b) for a, b in zip(whole[1], resumed[1]))}

    def copies():
        """copy.deepcopy / pickle of LionCubFSDP: refused by name (a copy would step tensors FSDP2 never
        all-gathers); and a parameter frozen at construction, unfrozen before the first step, trains."""
        import copy
        import pickle
        torch.manual_seed(0)
        net = Net()
        net.emb.weight.requires_grad_(False)
        model, opt = shard_and_vote(net, L, **settings)
        res = {}
        for label, fn in (("deepcopy", copy.deepcopy), ("pickle", pickle.dumps)):
            try:
                fn(opt)
                res[label] = None
            except TypeError as exc:
                res[label] = str(exc)
        model.emb.weight.requires_grad_(True)
        before = _locals(model)[0]
        _train(model, opt, 1, 1, clip=False)
        res["unfrozen_moved"] = not torch.equal(before, _locals(model)[0])
        return res

    for label, case in (("apart", apart), ("nested", nested), ("meta", meta), ("timeout", timeout),
                        ("bad_size", bad_size), ("regrouped", lambda: regrouped(path + "-regrouped")),
                        ("sync_resume", lambda: sync_resume(path + "-sync")),
                        ("copies", copies)):
        try:
            out[label] = case()
        except Exception as exc:  # noqa: BLE001 - the test names it
            out[label] = f"{type(exc).__name__}: {exc}"
    return out


def _nonfinite_on_one_rank(model, opt, step):
    """A NaN in one element of rank 2's gradient shard: every rank skips the step (agreed over the
    shard group and across the groups), nothing changes; the next step goes on."""
    import torch.distributed as dist
    rank = dist.get_rank()
    before, count = _locals(model), opt.step_count
    _loss(model, rank, step).backward()
    if rank == 2:
        next(iter(model.parameters())).grad.to_local().view(-1)[3] = float("nan")
    opt.step()
    opt.zero_grad()
    out = {"unchanged": all(torch.equal(a, b) for a, b in zip(before, _locals(model))),
           "count": opt.step_count - count, "skipped": opt.comm_stats()["skipped_steps"]}
    _loss(model, rank, step + 1).backward()
    opt.step()
    opt.zero_grad()
    out["then"] = opt.step_count - count
    out["after"] = _locals(model)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fsdp2_dcp"))
    return run_ranks(_rank_body, WORLD, path, timeout=600, env=ENV)


# ----------------------------------------------------------------------------- the oracle
def _cat(shards_by_rank, group, size):
    """Full tensors of shard group ``group`` from its ranks' shard lists (dim 0, shard-rank order)."""
    members = range(group * size, (group + 1) * size)
    return [torch.cat([shards_by_rank[r][k] for r in members]) for k in range(len(NAMES))]


def _field(ranks, run, step, field):
    """Every rank's shard list of ``field`` ("pre", "post", "after") at step index ``step`` of ``run``."""
    return [r[run][step][field] for r in ranks]


def _vote_step(thetas, momenta, grads, step):
    """One step of Distributed Lion over Nn voters: ``grads[j]`` / ``momenta[j]`` voter j's full
    tensors (momenta changed in place); majority with abstentions (c == 0), hash ties on the
    element's index inside the full parameter, decoupled decay. Returns the new fp32 parameters."""
    new = []
    for k, theta in enumerate(thetas):
        cs = [reference.lion_direction(m[k].reshape(-1), g[k].reshape(-1), BETAS[0]) for m, g in zip(momenta, grads)]
        votes = torch.sign(torch.stack(cs))
        plus, cnt = (votes > 0).sum(0), (votes != 0).sum(0)
        diff = 2 * plus - cnt
        tie = reference.tie_hash_sign(step, torch.arange(theta.numel(), dtype=torch.int64)).float()
        delta = torch.where((diff == 0) & (cnt > 0), tie, torch.sign(diff).float())
        e = theta.float().clone()
        e.mul_(1.0 - LR * WD)
        e.add_(delta.view_as(e).mul(-LR))
        new.append(e)
        for m, g in zip(momenta, grads):
            reference.momentum_update(m[k], g[k], BETAS[1])
    return new


def _check_against_oracle(ranks, run, init, size, first=1):
    """Every step of ``run`` against the oracle fed with the gradients FSDP2 handed LionCub (after
    clipping); every group's shards must equal it bit for bit (so the replicas are identical)."""
    groups = WORLD // size
    thetas = _cat([r[init] for r in ranks], 0, size)
    momenta = [[torch.zeros_like(t, dtype=torch.float32) for t in thetas] for _ in range(groups)]
    for s in range(len(ranks[0][run])):
        grads = [_cat(_field(ranks, run, s, "post"), j, size) for j in range(groups)]
        thetas = _vote_step(thetas, momenta, grads, first + s)
        for j in range(groups):
            got = _cat(_field(ranks, run, s, "after"), j, size)
            for name, g, exp in zip(NAMES, got, thetas):
                assert g.dtype == torch.float32 and torch.equal(g, exp), \
                    f"{run} step {first + s} group {j} {name}: max diff {(g - exp).abs().max()}"


def _local_grads(thetas, rank, step, dtype):
    """Rank ``rank``'s own gradient at ``step`` by a plain (unsharded) model in ``dtype``."""
    model = Net()
    with torch.no_grad():
        for p, t in zip(model.parameters(), thetas):
            p.copy_(t)
    model.to(dtype)
    _loss(model, rank, step).backward()
    return [p.grad.float() for p in model.parameters()]


def _check_reduced_gradients(ranks, run, init, size, dtype, tol, clip=True):
    """FSDP2's reduced shards (gathered) are the mean of the group's local gradients; after
    clip_grad_norm_ that mean times min(1, CLIP / its norm over the group). Returns how many
    (step, group) pairs were clipped."""
    clipped = 0
    thetas = _cat([r[init] for r in ranks], 0, size)
    for s in range(len(ranks[0][run])):
        for j in range(WORLD // size):
            local = [_local_grads(thetas, r, s + 1, dtype) for r in range(j * size, (j + 1) * size)]
            mean = [torch.stack(gs).mean(0) for gs in zip(*local)]
            pre = _cat(_field(ranks, run, s, "pre"), j, size)
            post = _cat(_field(ranks, run, s, "post"), j, size)
            for name, a, b in zip(NAMES, pre, mean):
                assert torch.allclose(a, b, **tol), f"{run} step {s + 1} group {j} {name}: {(a - b).abs().max()}"
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in pre]))
            coef = min(1.0, CLIP / (float(norm) + 1e-6)) if clip else 1.0
            clipped += coef < 1.0
            for name, a, b in zip(NAMES, post, pre):
                assert torch.allclose(a, b * coef, rtol=1e-5, atol=1e-7), f"{run} step {s + 1} group {j} {name} clip"
        thetas = _cat(_field(ranks, run, s, "after"), 0, size)
    return clipped


# ----------------------------------------------------------------------------- the tests
def test_every_step_equals_the_node_voter_oracle_fp32(ranks):
    _check_against_oracle(ranks, "fp32", "init", L)
    clipped = _check_reduced_gradients(ranks, "fp32", "init", L, torch.float32, dict(rtol=1e-5, atol=1e-7))
    assert clipped > 0  # the clip threshold is low enough to act: the clipped path is exercised


def test_every_step_equals_the_oracle_with_bf16_mixed_precision(ranks):
    _check_against_oracle(ranks, "bf16", "bf16_init", L)
    _check_reduced_gradients(ranks, "bf16", "bf16_init", L, torch.bfloat16, dict(rtol=0.05, atol=2e-3))
    # FSDP2 all-gathers and reduce-scatters in bf16 inside the shard group
    for r in ranks:
        fsdp = [e for e in r["bf16_log"]
                if e[0] in ("all_gather_single", "reduce_scatter_single") and e[2] not in INTEGER]
        assert fsdp and all(e[2] == "torch.bfloat16" for e in fsdp), fsdp


def test_one_shard_group_is_global_lion_on_the_shards(ranks):
    _check_against_oracle(ranks, "one", "one_init", WORLD)
    _check_reduced_gradients(ranks, "one", "one_init", WORLD, torch.float32, dict(rtol=1e-5, atol=1e-7), clip=False)
    for r in ranks:
        assert r["one_scopes"].get("inter_node", 0) == 0, r["one_scopes"]


def test_the_hash_tie_rule_keys_on_the_full_parameter_index(ranks):
    """Shard k starts at k·ceil(d0/L) rows (torch.chunk, as FSDP2 cuts): its ELEMENT_START."""
    shapes = [tuple(p.shape) for p in Net().parameters()]
    for rank, r in enumerate(ranks):
        k = rank % L
        for shape, start in zip(shapes, r["starts"]):
            inner = 1 if len(shape) == 1 else shape[1]
            assert start == min(k * -(-shape[0] // L), shape[0]) * inner


def test_only_votes_cross_between_shard_groups(ranks):
    group_of = lambda x: x // L  # noqa: E731
    for rank, r in enumerate(ranks):
        crossing = [e for e in r["log"] if e[1] and len({group_of(x) for x in e[1]}) > 1]
        assert crossing, "the votes must cross"
        assert all(e[2] in INTEGER for e in crossing), [e for e in crossing if e[2] not in INTEGER]
        inside = [e for e in r["log"] if e[1] and len({group_of(x) for x in e[1]}) == 1]
        assert any(e[0] == "reduce_scatter_single" and e[2] == "torch.float32" for e in inside)
        assert r["scopes"].get("inter_node", 0) > 0


def test_shard_size_one_is_flat_voting(ranks):
    """L = 1: FSDP2 on one rank shards nothing; the 4 ranks are 4 voters on their own gradients."""
    _check_against_oracle(ranks, "flat", "flat_init", 1)


def test_a_nonfinite_gradient_on_one_rank_skips_the_step_everywhere(ranks):
    for r in ranks:
        assert r["skip"]["unchanged"] and r["skip"]["count"] == 0 and r["skip"]["skipped"] == 1, r["skip"]
        assert r["skip"]["then"] == 1
    for a, b in ((0, 2), (1, 3)):  # the replicas of each shard still agree after the next step
        assert all(torch.equal(x, y) for x, y in zip(ranks[a]["skip"]["after"], ranks[b]["skip"]["after"]))


def test_momentum_sync_averages_the_voters_momenta_across_groups(ranks):
    for a, b in ((0, 2), (1, 3)):
        assert all(torch.equal(x, y) for x, y in zip(ranks[a]["sync_momenta"], ranks[b]["sync_momenta"]))
        assert all(torch.equal(x, y) for x, y in zip(ranks[a]["sync_after"], ranks[b]["sync_after"]))
    for rank, r in enumerate(ranks):  # the float crossing between groups is the sync's all-reduce, nothing else
        crossing = [e for e in r["sync_log"] if e[1] and len({x // L for x in e[1]}) > 1 and e[2] not in INTEGER]
        assert crossing and all(e[0] == "all_reduce" and e[2] == "torch.float32" for e in crossing), crossing


def test_state_per_rank_is_one_shard_of_flat_lioncub(ranks):
    total = sum(p.numel() for p in Net().parameters())  # flat LionCub: an fp32 momentum of every element
    for j in range(WORLD // L):
        group = [ranks[r]["state"] for r in range(j * L, (j + 1) * L)]
        assert sum(st["momentum"] for st in group) == 4 * total  # the group's shards hold each element once
        for st in group:
            assert st["master"] == 0 and st["momentum"] <= 4 * total / L * 1.2


def test_checkpoint_resume_is_bit_exact(ranks):
    for r in ranks:
        assert r["resumed_step"] == STEPS + MORE
        for a, b in zip(r["continued"], r["resumed"]):
            for x, y in zip(a["after"], b["after"]):
                assert torch.equal(x, y)
    # and the continued run is still the oracle's (steps STEPS+1.. after the saved state)
    whole = [dict(r, all=r["fp32"] + r["continued"]) for r in ranks]
    _check_against_oracle(whole, "all", "init", L)


def test_another_shard_size_is_refused_by_name_before_loading(ranks):
    for r in ranks:
        assert r["other_size"] is not None and "shard_size=2" in r["other_size"] and "shard_size=4" in r["other_size"]
        assert r["other_size_untouched"]


def test_bad_settings_are_refused_on_every_rank_before_any_group_or_state(ranks):
    cases = _refusal_cases()
    for r in ranks:
        assert set(r["refused"]) == set(cases)
        # a LionCubConfigError with the words, and no collective, no group, no optimizer, no sharding
        wrong = {label: got for label, got in r["refused"].items()
                 if not (got[0] is not None and got[0].startswith("LionCubConfigError: ")
                         and all(w in got[0] for w in cases[label][2]) and got[1:] == (0, [], False))}
        assert not wrong, "\n".join(f"{label}: {got}" for label, got in wrong.items())
        for label, (msg, inits) in r["late_refused"].items():
            assert msg is not None and inits == [], (label, msg)
        assert "2-D mesh" in r["late_refused"]["hsdp"][0] and "not sharded" in r["late_refused"]["plain"][0]
        assert "on the meta device" in r["late_refused"]["meta"][0]


def test_the_example_trains_the_gpt_with_hsdp_and_votes_under_torchrun(tmp_path):
    """examples/pretrain_gpt_fsdp2.py on 4 CPU ranks (2 shard groups x 2) for a few steps: the loss
    goes down, the shard replicas agree across the groups, and the bytes between the groups are
    the votes': far below FSDP2's HSDP all-reduce of the same shards."""
    import re
    from lioncub_ds.testing import free_port
    launcher = Path(sys.executable).with_name("torchrun")
    cmd = [str(launcher), "--nproc_per_node", str(WORLD), "--master_port", str(free_port()),
           str(ROOT / "examples" / "pretrain_gpt_fsdp2.py"), "--shard-size", str(L), "--preset", "tiny",
           "--steps", "4", "--log-interval", "2", "--eval-iters", "1", "--max-bytes", "300000"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", LIONCUB_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "2 shard groups x 2" in out and "shard replicas identical across groups: yes" in out, out[-3000:]
    ratios = [int(x) for x in re.findall(r"vs FSDP2 HSDP all-reduce [\d.]+ [KMG]?B \((\d+)x less\)", out)]
    assert len(ratios) == 2 and min(ratios) >= 16, out[-3000:]  # fp32 shards: ~32x (1 bit against 32)


# ----------------------------------------------------------------------------- the review's cases
def _case(ranks, label):
    for rank, r in enumerate(ranks):
        assert isinstance(r["review"][label], dict), (rank, r["review"][label])
    return [r["review"][label] for r in ranks]


def _same_across_groups(shards):
    """Rank k of every shard group holds the same bits as rank k of group 0."""
    for r in range(L, WORLD):
        assert all(torch.equal(a, b) for a, b in zip(shards[r % L], shards[r])), f"rank {r} differs from {r % L}"


def test_groups_seeded_apart_start_identical_and_stay_so(ranks):
    """Every rank seeded apart: shard_and_vote broadcasts shard group 0's shards to the peers
    (rank k of group 0 keeps the chunk k of its own init), and every step keeps them identical."""
    res = _case(ranks, "apart")
    _same_across_groups([x["init"] for x in res])
    for k in range(L):  # group 0's rank k: the k-th torch.chunk of its own seeded init, untouched
        torch.manual_seed(100 + k)
        full = [p.detach() for p in Net().parameters()]
        assert all(torch.equal(torch.chunk(t, L)[k], got) for t, got in zip(full, res[k]["init"]))
    for s in range(2):
        _same_across_groups([x["steps"][s]["after"] for x in res])


def test_lioncubfsdp_refuses_groups_that_start_apart(ranks):
    """By hand (no broadcast): shards that differ across the peers are refused at construction."""
    for r in ranks:
        msg, inits = r["late_refused"]["apart"]
        assert msg is not None and inits == [], msg
        assert "start from different weights" in msg and "'emb.weight'" in msg and "shard_and_vote" in msg, msg


def test_nested_modules_are_sharded_children_first(ranks):
    for x in _case(ranks, "nested"):
        assert x["wrapped"] == ["", "outer", "outer.inner"] and x["count"] == 2, x["wrapped"]
    _same_across_groups([x["after"] for x in _case(ranks, "nested")])


def test_a_meta_model_is_materialized_and_initialized_by_init_weights(ranks):
    res = _case(ranks, "meta")
    for x in res:
        assert x["seen"] == [True] and x["count"] == 2  # once, sharded, materialized, under no_grad
        assert all(t.device.type == "cpu" and torch.isfinite(t).all() for t in x["init"])
    # reset_parameters ran: Linear's biases are drawn, not left as to_empty's memory or zeros
    for name, k, fan_in in (("fc1.bias", 2, 5), ("fc2.bias", 4, 13)):
        full = torch.cat([res[r]["init"][k] for r in range(L)])
        bound = 1 / fan_in ** 0.5
        assert full.abs().max() <= bound and full.abs().sum() > 0, (name, full)
    _same_across_groups([x["init"] for x in res])
    for s in range(2):
        _same_across_groups([x["steps"][s]["after"] for x in res])


def test_timeout_s_is_the_groups_and_lioncubs_deadline(ranks):
    for x in _case(ranks, "timeout"):
        assert x["config"] == 123.0 and x["deadlines"] == [123.0], x
        assert x["groups"] == [123.0, 123.0], x


def test_make_shard_groups_names_the_argument_and_the_allowed_sizes(ranks):
    for x in _case(ranks, "bad_size"):
        msg, calls = x["shard_size"]
        assert msg is not None and calls == 0, x
        assert "shard_size=3" in msg and "node_size" not in msg and "allowed: one of [1, 2, 4]" in msg, msg
        assert x["node_size"][0] is not None and "node_size=3" in x["node_size"][0], x


def test_backend_takes_reads_the_backends_devices():
    """The CPU-shard refusal's rule (CPUOffloadPolicy under NCCL): which device a backend carries."""
    from lioncub_ds.fsdp.optimizer import backend_takes
    assert not backend_takes("nccl", "cpu") and backend_takes("nccl", "cuda")
    assert backend_takes("gloo", "cpu") and backend_takes("cpu:gloo,cuda:nccl", "cpu")
    assert not backend_takes("cuda:nccl", "cpu")


def test_param_groups_of_another_structure_are_refused_by_name(ranks):
    """Each group's lr and weight decay come back by position: a checkpoint of two groups loads
    only into the same two groups (their settings restored), never into one group, the groups cut
    elsewhere or in another order."""
    for x in _case(ranks, "regrouped"):
        assert x["same"] == ("loaded", 1, [(0.01, 0.5), (0.001, 0.0)]), x["same"]
        for label in ("one group", "cut elsewhere", "reordered"):
            msg, count, unchanged = x[label]
            assert "param groups differ" in msg and "allowed: the param groups it was saved with" in msg, (label, msg)
            assert count == 0 and unchanged, (label, x[label])
        assert "saved [emb.weight, fc1.weight; fc1.bias, fc2.weight, fc2.bias], here [emb.weight, fc1.weight, " \
               "fc1.bias (+2)]" in x["one group"][0], x["one group"][0]


def test_a_drift_scheduled_momentum_sync_resumes_on_the_same_steps(ranks):
    for x in _case(ranks, "sync_resume"):
        whole, resumed = x["syncs"]
        assert whole == resumed and whole[-1] > whole[0], x["syncs"]
        assert x["equal"]


def test_copies_are_refused_and_a_parameter_unfrozen_before_the_first_step_trains(ranks):
    for x in _case(ranks, "copies"):
        for label in ("deepcopy", "pickle"):
            assert x[label] and "LionCubFSDP cannot be copied or pickled" in x[label], (label, x[label])
        assert x["unfrozen_moved"]
