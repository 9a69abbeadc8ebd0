"""Decisions of a step that every rank must take alike come from the summed flags (issue 22,
items 1 and 2): voting again when gradients changed after their vote in backward on SOME ranks
(clipping that fires on one rank only), and refusing a step whose lr / weight decay / betas
differ across ranks (a scheduler stepped on one rank only). Real gloo ranks.
"""
from __future__ import annotations

import time

import pytest
import torch

from lioncub_ds import LionCub
from lioncub_ds.optimizer import StepInputError
from dist_helpers import run_ranks

pytestmark = pytest.mark.dist

N = 2
ENV = {"LIONCUB_KERNELS": "torch"}
COMMS = ("1bit", "pbit", "int8", "allgather", "bbit")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _loss(model, rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.randn(5, 13, generator=g), torch.randn(5, 3, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


def _clip_on_one_rank(rank, world_size, comm, overlap):
    """overlap votes during backward; then rank 1 scales its gradients in place (as clipping
    does on the ranks whose local norm is above the limit). Returns the parameters after 4
    steps, the revote count, and the wall time (a hang would hit the timeout)."""
    model = _model()
    kw = {"quant": "l1"} if comm in ("int8", "bbit") else {}
    opt = LionCub(model.parameters(), lr=0.01, weight_decay=0.1, comm=comm, overlap=overlap, timeout_s=60, **kw)
    t = time.perf_counter()
    for step in range(4):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        if rank == 1 and step % 2 == 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # fires here only
        opt.step()
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "revotes": opt.comm_stats()["overlap"]["revotes"], "seconds": time.perf_counter() - t}


@pytest.mark.parametrize("comm", COMMS)
def test_clipping_on_one_rank_with_overlap_votes_again_everywhere(comm):
    """Every rank votes again together and the result equals the run without overlap (which
    votes after the clipping): the re-vote decision is collective."""
    got = run_ranks(_clip_on_one_rank, N, comm, True, timeout=240, env=ENV)
    ref = run_ranks(_clip_on_one_rank, N, comm, False, timeout=240, env=ENV)
    assert torch.equal(got[0]["params"], got[1]["params"])
    assert torch.equal(got[0]["params"], ref[0]["params"])
    # clipping fired at steps 1 and 3 on rank 1: both ranks counted two re-votes
    assert got[0]["revotes"] == got[1]["revotes"] == 2
    assert ref[0]["revotes"] == 0


def _scheduler_on_one_rank(rank, world_size, what, comm):
    model = _model()
    kw = {"quant": "l1"} if comm in ("int8", "bbit") else {}
    opt = LionCub(model.parameters(), lr=0.01, weight_decay=0.1, comm=comm, **kw)
    for step in range(2):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        opt.step()
    if rank == 1:  # a scheduler stepped on this rank only
        g = opt.param_groups[0]
        if what == "lr":
            g["lr"] = 0.02
        elif what == "weight_decay":
            g["weight_decay"] = 0.2
        else:
            g["betas"] = (0.8, 0.99)
    before = [p.detach().clone() for p in model.parameters()]
    m_before = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    opt.zero_grad()
    _loss(model, rank, 2).backward()
    try:
        opt.step()
        err = None
    except StepInputError as exc:
        err = str(exc)
    unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) and \
        all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(model.parameters(), m_before))
    return {"error": err, "unchanged": unchanged, "steps": opt.step_count}


@pytest.mark.parametrize("what,comm", [("lr", "1bit"), ("weight_decay", "pbit"), ("betas", "int8")])
def test_hyper_parameters_changed_on_one_rank_are_refused_on_every_rank(what, comm):
    res = run_ranks(_scheduler_on_one_rank, N, what, comm, timeout=240, env=ENV)
    for r in range(N):
        err = res[r]["error"]
        assert err is not None, f"rank {r}: the step ran with {what} differing across ranks"
        assert f"{what} of param group 0" in err and "rank 0:" in err and "rank 1:" in err, err
        assert res[r]["unchanged"] and res[r]["steps"] == 2
    assert res[0]["error"] == res[1]["error"]


def _many_one_step_mismatches(rank, world_size, tries):
    """Rank 1 gives ``tries`` different wrong lrs, one step each; every one must be refused on both
    ranks (the agreement hashes the hyper-parameters: with 8 bits about one in 256 got through and
    the replicas drifted apart). Then a step with equal settings applies."""
    model = _model()
    opt = LionCub(model.parameters(), lr=0.01, weight_decay=0.1, comm="1bit")
    opt.zero_grad()
    _loss(model, rank, 0).backward()
    before = [p.detach().clone() for p in model.parameters()]
    passed = []
    for k in range(tries):
        opt.param_groups[0]["lr"] = 0.01 * (1.0 + (k + 1) * 1e-4) if rank == 1 else 0.01
        try:
            opt.step()
            passed.append(k)
        except StepInputError:
            pass
    opt.param_groups[0]["lr"] = 0.01
    unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.step()
    return {"passed": passed, "unchanged": unchanged, "steps": opt.step_count,
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}


def test_every_one_step_lr_mismatch_is_refused():
    res = run_ranks(_many_one_step_mismatches, N, 1200, timeout=300, env=ENV)
    for r in range(N):
        assert res[r]["passed"] == [], f"rank {r}: mismatched lrs applied at tries {res[r]['passed'][:5]}"
        assert res[r]["unchanged"] and res[r]["steps"] == 1
    assert torch.equal(res[0]["params"], res[1]["params"])


@pytest.mark.unit
@pytest.mark.parametrize("n,buckets", [(2, 1), (3, 2), (127, 5), (32767, 3), (40000, 2)])
def test_packed_flags_sum_like_the_logical_ones(n, buckets):
    """Summing packed words over ranks and unpacking equals summing the logical flags (no lane
    carries, up to the largest N that packs; unpacked above it)."""
    from lioncub_ds.flags import FLAG_HEAD, NONFINITE_VALUES, flag_words, pack_flags, unpack_flags
    g = torch.Generator().manual_seed(n)
    width = FLAG_HEAD + 2 * buckets
    ranks = min(n, 50)  # the sum of 50 ranks' flags, scaled up to N ranks' worst case below
    logical = torch.randint(0, 2, (ranks, width), generator=g, dtype=torch.int32)
    logical[:, NONFINITE_VALUES] = torch.randint(0, 2**20, (ranks,), generator=g, dtype=torch.int32)
    if n > ranks:  # every rank flags every entry: the largest sums N can give
        logical = torch.ones(1, width, dtype=torch.int32)
        logical[0, NONFINITE_VALUES] = 1
        packed = pack_flags(logical[0], n) * n
        want = (logical[0] * n).tolist()
    else:
        packed = torch.stack([pack_flags(row, n) for row in logical]).sum(0)
        want = logical.sum(0).tolist()
    assert packed.numel() == flag_words(buckets, n)
    assert unpack_flags(packed.tolist(), buckets, n) == want
