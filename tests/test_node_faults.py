"""Faults a fault-injection pass found with node voters and master-only sharding (issue 31 item 5),
each on 4 real gloo ranks as 2 x 2:

* a node size that only ONE rank gets wrong (an explicit ``node_size``, or ``LOCAL_WORLD_SIZE``
  unset there) gives EVERY rank the same error naming node_size (not one rank raising alone while
  the others wait in the constructor, then a raw gloo error);
* ``node_size=None`` with ``LOCAL_WORLD_SIZE`` differing across ranks is refused at construction
  (the resolved group size is compared, not the raw None);
* ``check_replicas(action="resync")`` with bf16 parameters keeps the fp32 master shards exact: a
  run whose perturbed rank was resynced goes on exactly like a twin that was never perturbed;
* loading a master-only checkpoint into flat LionCub names the real difference (node_size).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from lioncub_ds import LionCub
from lioncub_ds.config import LionCubConfigError
from dist_helpers import SmallNet, run_ranks

pytestmark = pytest.mark.dist

LR, WD = 0.01, 0.1
ENV = {"LIONCUB_KERNELS": "torch"}


def _construct(rank, world_size, case):
    """Every rank constructs a node-voter LionCub; ``case`` breaks the node size on some ranks."""
    os.environ.pop("LOCAL_SIZE", None)
    kw = dict(voters="node", node_size=None)
    if case == "node_size_on_one_rank":
        kw["node_size"] = 3 if rank == 3 else 2
    elif case == "local_world_size_unset_on_one_rank":
        if rank == 3:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = "2"
    elif case == "local_world_size_differs":
        os.environ["LOCAL_WORLD_SIZE"] = "2" if rank < 2 else "4"
    try:
        LionCub(SmallNet().parameters(), lr=LR, comm="1bit", **kw)
    except LionCubConfigError as exc:
        return {"error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a raw backend error is what this test refuses
        return {"error": f"{type(exc).__name__}: {exc}", "raw": True}
    return {"error": None}


@pytest.mark.parametrize("case,values", [
    ("node_size_on_one_rank", ("ranks 0-2: 2", "rank 3: ", "node_size=3 does not divide")),
    ("local_world_size_unset_on_one_rank", ("ranks 0-2: 2", "rank 3: ", "LOCAL_WORLD_SIZE")),
    ("local_world_size_differs", ("ranks 0, 1: 2", "ranks 2, 3: 4")),
])
def test_a_node_size_that_differs_across_ranks_gives_every_rank_an_error_naming_node_size(case, values):
    res = run_ranks(_construct, 4, case, timeout=180, env=ENV)
    errors = [res[r]["error"] for r in range(4)]
    for r in range(4):
        assert errors[r] is not None and not res[r].get("raw"), (r, errors[r])
        assert "node_size" in errors[r] and "every rank raises this" in errors[r], errors[r]
        for v in values:
            assert v in errors[r], (v, errors[r])
    assert len(set(errors)) == 1  # the same words on every rank


def _resync_twin(rank, world_size, voters):
    """Two runs side by side on the same ranks, bf16 parameters with fp32 master shards: ``twin``
    is never perturbed; ``run``'s parameters on rank 3 are moved after step 2, and
    check_replicas('resync') puts rank 0's back. Both then go on for 6 steps."""
    models, opts = [], []
    for _ in range(2):
        torch.manual_seed(0)
        model = SmallNet().to(torch.bfloat16)
        models.append(model)
        opts.append(LionCub(model.parameters(), lr=LR, weight_decay=WD, comm="1bit", voters=voters, node_size=2,
                            bucket_size_mb=0.0002))
    found = []
    for step in range(1, 9):
        gen = torch.Generator().manual_seed(100 * rank + step)
        idx, y = torch.randint(0, 6, (4, 3), generator=gen), torch.randn(4, 3, generator=gen)
        for model, opt in zip(models, opts):
            model.zero_grad()
            torch.nn.functional.mse_loss(model(idx).float(), y).backward()
            opt.step()
        if step == 2:
            if rank == 3:
                with torch.no_grad():
                    for p in models[0].parameters():
                        p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)).to(p.dtype))
            found = [opt.check_replicas(action="resync") for opt in opts]
    run, twin = ([p.detach().float().reshape(-1) for p in m.parameters()] for m in models)
    flat = torch.cat(run)
    every = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(every, flat)
    return {"found": found, "differ": int(sum((a != b).sum() for a, b in zip(run, twin))),
            "numel": flat.numel(), "replicas": all(torch.equal(flat, e) for e in every)}


@pytest.mark.parametrize("voters", ["node", "rank"], ids=["node-voters", "master-only"])
def test_resync_keeps_the_fp32_master_shards_exact(voters):
    res = run_ranks(_resync_twin, 4, voters, timeout=300, env=ENV)
    for r in range(4):
        assert res[r]["found"] == [False, True], res[r]  # run: drift found and resynced; twin: none
        assert res[r]["replicas"], r
        assert res[r]["differ"] == 0, f"rank {r}: {res[r]['differ']} of {res[r]['numel']} elements differ from the twin"


def _master_only_into_flat(rank, world_size):
    torch.manual_seed(0)
    model = SmallNet().to(torch.bfloat16)
    opt = LionCub(model.parameters(), lr=LR, comm="1bit", node_size=2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    flat = LionCub(model.parameters(), lr=LR, comm="1bit")
    try:
        flat.load_state_dict(opt.state_dict())
    except LionCubConfigError as exc:
        return str(exc)
    return None


def test_a_master_only_checkpoint_into_flat_lioncub_names_node_size():
    res = run_ranks(_master_only_into_flat, 4, timeout=180, env=ENV)
    for r in range(4):
        msg = res[r]
        assert msg is not None and "node_size=2" in msg and "master-only" in msg, msg
        assert "voters='node'" not in msg, msg  # both have voters='rank': the difference is node_size
