"""Node voters (voters="node") with overlap=True and momentum_double_buffer=True on real gloo ranks.

With overlap the group's reduce-scatter of a bucket is issued from the gradient-ready hooks
during backward and its local step and vote follow one bucket behind (docs/node_voters.md). Each
launch trains the same model with every (overlap, momentum_double_buffer) pair through
micro-batch accumulation (no_sync), parameters with a gradient on some ranks only and one
without a gradient anywhere, a non-finite loss on one rank (skipped everywhere), in-place
clipping on ONE rank after its backward issued the reduce-scatters (every rank reduce-scatters
and votes again), and a backward whose gradients are thrown away (zero_grad). After every
variant the parameters, the momentum shards and the fp32 master shards must equal the plain
step's bit for bit, and every rank must hold the same parameters. The NCCL-contract log (on by
default) checks that every pair of ranks issued the same collectives in the same order.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lioncub_ds import LionCub
from dist_helpers import run_ranks

pytestmark = pytest.mark.dist

ENV = {"LIONCUB_KERNELS": "torch"}
STEPS = 7
VARIANTS = ((False, False), (True, False), (False, True), (True, True))  # (overlap, momentum_double_buffer)


class Net(torch.nn.Module):
    """Odd sizes. ``unused`` never has a gradient, ``side`` on some ranks and steps only
    (registered first: their buckets come last in the launch order, so the reduce-scatters of the
    others are issued in backward); embedding rows 30..39 are never used (abstentions)."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(3, 5)
        self.side = torch.nn.Linear(7, 3)
        self.emb = torch.nn.Embedding(40, 13)
        self.fc1 = torch.nn.Linear(13, 37)
        self.fc2 = torch.nn.Linear(37, 7)

    def forward(self, idx, use_side):
        h = self.fc2(torch.tanh(self.fc1(self.emb(idx).mean(1))))
        return h.float().sum() if not use_side else h.float().sum() + self.side(h).float().pow(2).sum()


def _train(model, opt, rank, world):
    gen = torch.Generator().manual_seed(50 + rank)
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        micro = 2 if step % 3 == 1 else 1
        for k in range(micro):
            idx = torch.randint(0, 30, (5, 3), generator=gen)
            use_side = (step + rank) % 2 == 0
            if k < micro - 1:
                with opt.no_sync():  # accumulation: this backward starts nothing
                    model(idx, use_side).backward()
                continue
            loss = model(idx, use_side)
            if step == 5 and rank == world - 1:
                loss = loss * float("nan")  # one rank's NaN: the step is skipped on every rank
            loss.backward()
        if step == 4 and rank == 1:  # one rank clips in place after its hooks issued the reduce-scatters
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        if step == 6:  # gradients thrown away after their reduce-scatters started, then a fresh backward
            opt.zero_grad()
            model(torch.randint(0, 30, (5, 3), generator=gen), True).backward()
        opt.step()


def _variants(rank, world, node_size, comm, dtypes):
    out = {}
    for dtype in dtypes:
        for overlap, double in VARIANTS:
            torch.manual_seed(0)
            model = Net().to(dtype)
            opt = LionCub(model.parameters(), lr=1e-2, weight_decay=0.1, comm=comm, voters="node", node_size=node_size,
                          bucket_size_mb=0.0004, comm_bucket_mb=0.00002, overlap=overlap,
                          momentum_double_buffer=double)
            _train(model, opt, rank, world)
            node = opt.state_dict()["lioncub"]["node"]
            params = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
            every = [torch.zeros_like(params) for _ in range(world)]
            dist.all_gather(every, params)
            stats = opt.comm_stats()
            out[str(dtype), overlap, double] = {
                "params": params, "replicas": all(torch.equal(params, e) for e in every),
                "momentum": torch.cat([node["momentum"][i] for i in sorted(node["momentum"])]),
                "master": torch.cat([node["master"][i] for i in sorted(node["master"])] or [torch.zeros(0)]),
                "overlap": stats["overlap"], "skipped": stats["skipped_steps"], "steps": opt.step_count,
                "batches": len(opt.plan.batches), "spare": opt.state_bytes()["spare"],
                "momentum_bytes": opt.state_bytes()["momentum"]}
    return out


def _check(res, world, dtypes):
    for dtype in dtypes:
        d = str(dtype)
        for r in range(world):
            plain = res[r][d, False, False]
            assert plain["batches"] > 2, plain["batches"]  # several buckets and batches
            assert plain["skipped"] == 1 and plain["steps"] == STEPS - 1
            assert plain["overlap"] == {"batches_launched_in_backward": 0, "revotes": 0}
            assert (plain["master"].numel() > 0) == (dtype != torch.float32)
            for overlap, double in VARIANTS[1:]:
                got = res[r][d, overlap, double]
                what = (d, overlap, double, r)
                assert torch.equal(got["params"], plain["params"]), what
                assert torch.equal(got["momentum"], plain["momentum"]), what
                assert torch.equal(got["master"], plain["master"]), what
                assert got["replicas"], what
                assert got["skipped"] == 1, what
                # double buffering: one spare momentum shard as large as the momentum shards
                assert got["spare"] == (got["momentum_bytes"] if double else 0), what
                if overlap:
                    # votes started in backward (their buckets' reduce-scatters were issued there);
                    # every rank voted again twice: after the clipping rank's change (step 4), and
                    # in the step after the backward zero_grad threw away (step 6: zero_grad issues
                    # no collective, the step finishes those votes on every rank together)
                    assert got["overlap"]["batches_launched_in_backward"] > 0, what
                    assert got["overlap"]["revotes"] == 2, what
                    assert got["overlap"] == res[0][d, overlap, double]["overlap"], what  # the same on every rank
            assert torch.equal(plain["params"], res[0][d, False, False]["params"]), (d, r)  # replicas identical


@pytest.mark.parametrize("n_groups,size,comm,dtypes", [
    (2, 2, "1bit", (torch.float32, torch.bfloat16)),
    (2, 3, "pbit", (torch.float32,)),
    (1, 2, "allgather", (torch.bfloat16,)),  # one voter: no votes cross a node, the node still reduce-scatters
], ids=["2x2-1bit-fp32-bf16", "2x3-pbit-fp32", "1x2-allgather-bf16"])
def test_overlap_and_double_buffer_equal_the_plain_node_voter_step(n_groups, size, comm, dtypes):
    world = n_groups * size
    res = run_ranks(_variants, world, size, comm, dtypes, timeout=400, env=ENV)
    _check(res, world, dtypes)


def _host_reads(rank, world):
    """Backward (whose hooks issue the reduce-scatters and start the votes) and step() together
    read the host once per step, as the plain step does (tests/test_host_reads.py)."""
    from lioncub_ds.testing import host_reads

    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    model.unused.requires_grad_(False)  # (a parameter without a gradient anywhere costs a read of its own)
    opt = LionCub(model.parameters(), lr=1e-2, comm="1bit", voters="node", node_size=2, bucket_size_mb=0.0004,
                  comm_bucket_mb=0.00002, overlap=True, momentum_double_buffer=True)
    gen = torch.Generator().manual_seed(7 + rank)
    per_step = []
    for _ in range(3):
        opt.zero_grad()
        idx = torch.randint(0, 30, (5, 3), generator=gen)
        with host_reads.counting() as reads:
            model(idx, True).backward()
            opt.step()
        per_step.append(list(reads))
    return {"reads": per_step, "overlap": opt.comm_stats()["overlap"], "steps": opt.step_count}


def test_overlapped_node_voters_read_the_host_once_per_step():
    res = run_ranks(_host_reads, 4, timeout=300, env=ENV)
    for r in range(4):
        assert res[r]["steps"] == 3 and res[r]["overlap"]["batches_launched_in_backward"] > 0, res[r]
        for step, reads in enumerate(res[r]["reads"], 1):
            assert len(reads) == 1, f"rank {r} step {step}: {len(reads)} host reads: {reads}"
            method, where, _ = reads[0]
            assert method == "tolist" and where.startswith("pipeline.py"), (r, reads)
