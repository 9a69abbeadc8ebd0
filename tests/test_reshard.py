"""Resharding node-voter and master-only state (issue 31 item 1) on real gloo ranks.

A job trains S steps under one layout and saves its per-rank files; a job of another shape
loads them with ``lioncub_ds.checkpoint.load(..., reshard=...)`` and trains T more steps. Each
case is checked bit for bit against an oracle written here from the definitions (SPEC §7,
docs/checkpoints.md), not from the code under test:

* the old run: Nn voters, voter j with the mean of its L ranks' gradients (summed in local-rank
  order) and its own momentum, fp32 masters of bf16 parameters;
* the reshard: when the number of voters changes, every new voter starts from the mean of the
  old voters' momenta (summed in fp32 from zero in voter order, then divided by their count);
  when it does not, new voter j keeps old voter j's momentum; the fp32 masters are the old ones;
* the new rank's state: its shard of the new layout's bucket (parameters at 8-aligned offsets,
  padded to a multiple of 8 · ranks, cut into L equal shards), or a momentum per parameter;
* then T steps of the new layout, every rank's parameters compared after each step.

Cases: 2x2 -> 4x1 (flat), 2x2 -> 1x4, 4x2 -> 2x2, 2x3 -> 3x2, flat 4 -> 2x2, 2x2 -> 2x2 with
other buckets (same voters: exact), master-only L=2 -> L=4. A corrupt or missing rank file,
reshard="error" when the voters change, and param groups of other sizes across a reshard are refused
on every rank with nothing changed.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from lioncub_ds import LionCub, checkpoint
from dist_helpers import SmallNet as Net, run_ranks
from test_node_voters import BETAS, LR, WD, _grads, _simulate  # the node-voter oracle: Nn voters on node means

pytestmark = pytest.mark.dist

ENV = {"LIONCUB_KERNELS": "torch"}
S, T = 3, 2          # steps before the save, steps after the resharded load
SMALL = 0.0002       # bucket_size_mb: one bucket per parameter (the old layouts use it: shards cut
                     # across several buckets); the new layouts use the default (one bucket)

# a layout: (kind, node_size) with kind "node" (voters="node"), "flat" or "master" (master-only)
F32, B16 = torch.float32, torch.bfloat16


def _optimizer(model, layout, bucket_mb=25.0):
    kind, size = layout
    kw = {"voters": "node", "node_size": size} if kind == "node" else {"node_size": size} if kind == "master" else {}
    return LionCub(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, comm="1bit", tie_break="hash",
                   bucket_size_mb=bucket_mb, **kw)


def _steps(model, opt, rank, first, last, dtype):
    after = []
    for step in range(first, last + 1):
        for p, g in zip(model.parameters(), _grads(model, rank, step)):
            p.grad = g.to(dtype)
        opt.step()
        after.append([p.detach().clone() for p in model.parameters()])
    return after


def _state_of(opt):
    """This rank's momentum and master tensors, as saved (copies)."""
    sd = opt.state_dict()
    node = sd["lioncub"].get("node")
    per_param = {i: st["exp_avg"].clone() for i, st in sd["state"].items() if "exp_avg" in st}
    if node is None:
        return {"exp_avg": per_param, "momentum": {}, "master": {}}
    return {"exp_avg": per_param, "momentum": {i: t.clone() for i, t in node["momentum"].items()},
            "master": {i: t.clone() for i, t in node["master"].items()}}


# ----------------------------------------------------------------------------- rank side
def _save_run(rank, world, layout, dtype, directory, bucket_mb):
    torch.manual_seed(0)
    model = Net().to(dtype)
    opt = _optimizer(model, layout, bucket_mb)
    _steps(model, opt, rank, 1, S, dtype)
    checkpoint.save(opt, directory)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(directory, "model.pt"))
    return True


def _load_run(rank, world, layout, dtype, directory):
    model = Net().to(dtype)
    model.load_state_dict(torch.load(os.path.join(directory, "model.pt")))
    opt = _optimizer(model, layout)
    checkpoint.load(opt, directory)
    state = _state_of(opt)
    return {"state": state, "step": opt.step_count, "after": _steps(model, opt, rank, S + 1, S + T, dtype)}


def _refusals(rank, world, directory, scratch):
    """reshard='error' when the voters change, a corrupt rank file, a missing rank file: every rank
    raises CheckpointError and keeps its state; then the good files load."""
    import torch.distributed as dist
    model = Net().to(B16)
    model.load_state_dict(torch.load(os.path.join(directory, "model.pt")))
    opt = _optimizer(model, ("node", 4))
    _steps(model, opt, rank, 1, 1, B16)  # some state of its own to keep
    before = (_state_of(opt), [p.detach().clone() for p in model.parameters()], opt.step_count)
    out = {}
    cases = [("error", directory, "error")]
    for case in ("corrupt", "missing"):
        d = os.path.join(scratch, case)
        if rank == 0:
            shutil.copytree(directory, d)
            victim = checkpoint.rank_file(d, 1, 4)
            if case == "missing":
                os.remove(victim)
            else:  # one flipped bit inside a momentum shard
                data = bytearray(open(victim, "rb").read())
                shards = torch.load(victim, weights_only=True)["optimizer"]["lioncub"]["node"]["momentum"].values()
                shard = max(shards, key=lambda t: int((t != 0).sum()))
                start = int((shard != 0).nonzero()[0])
                pos = bytes(data).find(shard[start:start + 4].numpy().tobytes())
                assert pos > 0
                data[pos + 2] ^= 0x10
                open(victim, "wb").write(bytes(data))
        dist.barrier()
        cases.append((case, d, "average"))
    for case, d, policy in cases:
        try:
            checkpoint.load(opt, d, reshard=policy)
            out[case] = None
        except checkpoint.CheckpointError as exc:
            out[case] = str(exc)
        now = (_state_of(opt), [p.detach().clone() for p in model.parameters()], opt.step_count)
        out[case + "_unchanged"] = _same(before, now)
    checkpoint.load(opt, directory)  # the intact files still load
    out["loaded_step"] = opt.step_count
    # param groups of another structure (as many groups, other sizes) across a reshard: each group's
    # lr and weight decay are restored by position, so the load must refuse, not mix them up
    ps = list(model.parameters())
    split = lambda k, wd: [{"params": ps[:k], "weight_decay": wd}, {"params": ps[k:], "weight_decay": 0.0}]  # noqa: E731
    saved = LionCub(split(1, WD), lr=LR, betas=BETAS, comm="1bit", voters="node", node_size=2)
    _steps(model, saved, rank, 1, 1, B16)
    d = os.path.join(scratch, "groups")
    checkpoint.save(saved, d)
    regrouped = LionCub(split(2, 0.5), lr=LR, betas=BETAS, comm="1bit", voters="node", node_size=4)
    try:
        checkpoint.load(regrouped, d)
        out["groups"] = None
    except checkpoint.CheckpointError as exc:
        out["groups"] = str(exc)
    out["groups_unchanged"] = (regrouped.step_count, len(regrouped.state),
                               [g["weight_decay"] for g in regrouped.param_groups]) == (0, 0, [0.5, 0.0])
    return out


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a),
                                                                                                         _bits(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _scenario(rank, world, plan, scratch):
    """Run the steps of ``plan`` (save or load entries) in order, in this one launch."""
    import torch.distributed as dist
    out = {}
    for name, what, args in plan:
        if what == "save":
            _save_run(rank, world, *args)
        elif what == "load":
            out[name] = _load_run(rank, world, *args)
        else:
            out[name] = _refusals(rank, world, *args, scratch)
        dist.barrier()
    return out


# ----------------------------------------------------------------------------- the oracle
def _voters(layout, world):
    kind, size = layout
    return (world // size, size) if kind == "node" else (world, 1)


def _old_state(layout, world, dtype):
    """The oracle's voter momenta and masters after the S saved steps of ``layout``."""
    torch.manual_seed(0)
    init = [p.detach().float().clone() for p in Net().to(dtype).parameters()]
    n_groups, size = _voters(layout, world)
    momenta = [[torch.zeros_like(p) for p in init] for _ in range(n_groups)]
    _, master = _simulate(n_groups, size, dtype, 1, S, momenta, init)
    return momenta, master


def _resharded(momenta, new_voters):
    """The definition: the same number of voters keeps each voter's momentum; otherwise every new
    voter gets the mean (fp32, summed from zero in voter order, divided by the count)."""
    if len(momenta) == new_voters:
        return [[m.clone() for m in voter] for voter in momenta]
    mean = []
    for k in range(len(momenta[0])):
        acc = torch.zeros_like(momenta[0][k], dtype=torch.float32)
        for voter in momenta:
            acc += voter[k].float()
        mean.append(acc / len(momenta))
    return [[m.clone() for m in mean] for _ in range(new_voters)]


def _bucket(tensors, ranks):
    """The layout's one bucket: each parameter at an 8-aligned offset, padded to 8 · ranks."""
    parts, size = [], 0
    for t in tensors:
        aligned = (t.numel() + 7) // 8 * 8
        parts.append(torch.cat([t.reshape(-1).float(), torch.zeros(aligned - t.numel())]))
        size += aligned
    unit = 8 * ranks
    flat = torch.cat(parts)
    return torch.cat([flat, torch.zeros((size + unit - 1) // unit * unit - size)])


def _check_case(res, old_layout, old_world, new_layout, new_world, dtype):
    momenta, master = _old_state(old_layout, old_world, dtype)
    n_new, size = _voters(new_layout, new_world)
    new_momenta = _resharded(momenta, n_new)
    low = dtype != torch.float32
    for r in range(new_world):
        got = res[r]["state"]
        voter, k = r // size, r % size
        assert res[r]["step"] == S
        if new_layout[0] == "node":
            shard = _bucket(new_momenta[voter], new_world).chunk(size)[k]
            assert list(got["momentum"]) == [0] and _same(got["momentum"][0], shard), f"rank {r}: momentum shard"
            assert got["exp_avg"] == {}
            if low:
                assert _same(got["master"][0], _bucket(master, new_world).chunk(size)[k]), f"rank {r}: master shard"
            else:
                assert got["master"] == {}
        else:
            assert sorted(got["exp_avg"]) == list(range(len(master)))
            for i, m in enumerate(new_momenta[voter]):
                assert _same(got["exp_avg"][i], m), f"rank {r}: momentum of parameter {i}"
            if new_layout[0] == "master" and low:  # the master shard of the group of node_size ranks
                group = new_layout[1]
                assert _same(got["master"][0], _bucket(master, new_world).chunk(group)[r % group]), \
                    f"rank {r}: master shard"
    want, _ = _simulate(*_voters(new_layout, new_world), dtype, S + 1, S + T, new_momenta, master)
    for r in range(new_world):
        for step in range(T):
            for i, (a, b) in enumerate(zip(res[r]["after"][step], want[step])):
                assert _same(a, b), f"rank {r}, step {S + 1 + step}, parameter {i}: {(a.float() - b.float()).abs().max()}"


# ----------------------------------------------------------------------------- the cases
@pytest.fixture(scope="module")
def runs():
    scratch = tempfile.mkdtemp(prefix="lioncub-reshard-")
    d = lambda name: os.path.join(scratch, name)  # noqa: E731
    try:
        eight = run_ranks(_scenario, 8, [("save_4x2", "save", (("node", 2), B16, d("4x2"), SMALL))], scratch,
                          timeout=600, env=ENV)
        four = run_ranks(_scenario, 4, [
            ("", "save", (("node", 2), F32, d("2x2-f32"), SMALL)),
            ("2x2-4x1", "load", (("flat", 1), F32, d("2x2-f32"))),
            ("", "save", (("node", 2), B16, d("2x2-b16"), SMALL)),
            ("2x2-1x4", "load", (("node", 4), B16, d("2x2-b16"))),
            ("2x2-2x2", "load", (("node", 2), B16, d("2x2-b16"))),
            ("4x2-2x2", "load", (("node", 2), B16, d("4x2"))),
            ("", "save", (("flat", 1), F32, d("flat4"), SMALL)),
            ("flat4-2x2", "load", (("node", 2), F32, d("flat4"))),
            ("", "save", (("master", 2), B16, d("master2"), SMALL)),
            ("master2-master4", "load", (("master", 4), B16, d("master2"))),
            ("refusals", "refuse", (d("2x2-b16"),)),
        ], scratch, timeout=600, env=ENV)
        six = run_ranks(_scenario, 6, [("", "save", (("node", 3), B16, d("2x3"), SMALL)),
                                       ("2x3-3x2", "load", (("node", 2), B16, d("2x3")))], scratch,
                        timeout=600, env=ENV)
        yield {"eight": eight, "four": four, "six": six}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


CASES = [("2x2-4x1", ("node", 2), 4, ("flat", 1), 4, F32, "four"),
         ("2x2-1x4", ("node", 2), 4, ("node", 4), 4, B16, "four"),
         ("4x2-2x2", ("node", 2), 8, ("node", 2), 4, B16, "four"),
         ("2x3-3x2", ("node", 3), 6, ("node", 2), 6, B16, "six"),
         ("flat4-2x2", ("flat", 1), 4, ("node", 2), 4, F32, "four"),
         ("2x2-2x2", ("node", 2), 4, ("node", 2), 4, B16, "four"),
         ("master2-master4", ("master", 2), 4, ("master", 4), 4, B16, "four")]


@pytest.mark.parametrize("name,old,old_world,new,new_world,dtype,launch", CASES, ids=[c[0] for c in CASES])
def test_resharded_state_and_steps_equal_the_oracle(runs, name, old, old_world, new, new_world, dtype, launch):
    _check_case([r[name] for r in runs[launch]], old, old_world, new, new_world, dtype)


def test_refused_on_every_rank_with_nothing_changed(runs):
    for r, res in enumerate(runs["four"]):
        x = res["refusals"]
        assert x["error"] and "reshard='average'" in x["error"] and "node_size=2 (2 node groups" in x["error"] \
            and "node_size=4 (1 node group" in x["error"], (r, x["error"])
        # the message leads with what changed (4 ranks saved, 4 ranks now: the rank count is no news)
        assert x["error"].split(": ", 1)[1].startswith("the voters change from 2 to 1 ("), (r, x["error"])
        assert x["corrupt"] and ("corrupted" in x["corrupt"] or "another rank" in x["corrupt"]), (r, x["corrupt"])
        assert x["missing"] and ("not found" in x["missing"] or "another rank" in x["missing"]), (r, x["missing"])
        for case in ("error", "corrupt", "missing"):
            assert x[case + "_unchanged"], (r, case)
        assert x["loaded_step"] == S
        assert x["groups"] and "param groups hold [1, " in x["groups"] and x["groups_unchanged"], (r, x["groups"])
    # the rank files are read by every rank: each names the bad file itself
    assert all("lioncub-rank00001-of-00004.pt" in res["refusals"]["corrupt"] for res in runs["four"])
