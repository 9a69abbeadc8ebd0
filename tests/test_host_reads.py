"""One host read per step (the NCCL contract, SPEC §5; issue 31 item 4) in every sharding mode, on
real gloo ranks: flat voting (flags carried by the vote, or in their own all-reduce), master-only
sharding, and node voters, whose flags are summed over the shard peers AND over the node group
and still read once. ``lioncub_ds.testing.host_reads`` counts every read of tensor values made
from lioncub_ds code outside the kernels (on CUDA each one waits for the queued kernels).
"""
from __future__ import annotations

import pytest
import torch

from lioncub_ds import LionCub
from lioncub_ds.testing import host_reads
from dist_helpers import SmallNet, run_ranks

pytestmark = pytest.mark.dist

STEPS = 3
# (label, parameter dtype, settings); 4 ranks: node_size=2 gives 2 x 2
MODES = [
    ("flat-1bit-carried", torch.float32, dict(comm="1bit")),
    ("flat-int8-allreduce", torch.float32, dict(comm="int8", quant="l1")),
    # schedule="drift": the disagreement rides in the next step's flags (no read of its own)
    ("flat-pbit-drift", torch.float32, dict(comm="pbit", momentum_sync={"schedule": "drift", "threshold": 1e-6,
                                                                        "min_every": 1})),
    ("master-only-bf16", torch.bfloat16, dict(comm="1bit", node_size=2)),
    # a 1-element tensor lr: read once per step and group (with the flags), not once per bucket
    ("flat-1bit-tensor-lr", torch.float32, dict(comm="1bit", lr=torch.tensor(0.01))),
    ("node-1bit-tensor-lr", torch.float32, dict(comm="1bit", voters="node", node_size=2, lr=torch.tensor(0.01))),
    ("node-1bit-fp32", torch.float32, dict(comm="1bit", voters="node", node_size=2)),
    ("node-int8-bf16", torch.bfloat16, dict(comm="int8", quant="l1", voters="node", node_size=2)),
    ("node-pbit-sync", torch.float32, dict(comm="pbit", voters="node", node_size=2,
                                          momentum_sync={"every": 2, "dtype": "int8"})),
]


def _reads_per_step(rank, world_size):
    out = {}
    for label, dtype, kw in MODES:
        torch.manual_seed(0)
        model = SmallNet().to(dtype)
        kw = dict(kw)
        opt = LionCub(model.parameters(), lr=kw.pop("lr", 0.01), weight_decay=0.1, bucket_size_mb=0.0002, **kw)
        per_step = []
        for step in range(1, STEPS + 1):
            gen = torch.Generator().manual_seed(100 * rank + step)
            idx, y = torch.randint(0, 6, (4, 3), generator=gen), torch.randn(4, 3, generator=gen)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(idx).float(), y).backward()
            with host_reads.counting() as reads:
                opt.step()
            per_step.append(list(reads))
        out[label] = {"reads": per_step, "steps": opt.step_count}
    return out


def test_every_sharding_mode_reads_the_host_once_per_step():
    res = run_ranks(_reads_per_step, 4, timeout=400, env={"LIONCUB_KERNELS": "torch"})
    for r in range(4):
        for label, _, _ in MODES:
            got = res[r][label]
            assert got["steps"] == STEPS, (r, label)
            for step, reads in enumerate(got["reads"], 1):
                if "tensor-lr" in label:  # the lr itself, once (one param group), then the flags
                    lr_reads = [x for x in reads if x[1].startswith("lion.py")]
                    assert len(lr_reads) == 1, f"rank {r} {label} step {step}: {reads}"
                    reads = [x for x in reads if x not in lr_reads]
                assert len(reads) == 1, f"rank {r} {label} step {step}: {len(reads)} host reads: {reads}"
                method, where, _ = reads[0]
                assert method == "tolist" and where.startswith("pipeline.py"), (r, label, reads)


def test_the_counter_sees_reads_from_lioncub_code_only():
    """The counter is only as good as what it sees: a read in lioncub_ds code is counted, with its
    place; a read in the test itself or in the kernels is not."""
    from lioncub_ds.kernels import reference
    from lioncub_ds.lion import lr_value
    with host_reads.counting() as reads:
        lr_value(torch.tensor([0.5]))      # lioncub_ds/lion.py reads a tensor lr: counted
        torch.ones(3).tolist()             # this test: not counted
        bool(torch.ones(1))
        reference.scale_rows(torch.ones(2, 3), "linf")  # the kernels read: not counted
    assert [(m, w.split(":")[0]) for m, w, _ in reads] == [("__float__", "lion.py")], reads
    assert not any(name in torch.Tensor.__dict__ for name in host_reads.READS)  # restored as they were
