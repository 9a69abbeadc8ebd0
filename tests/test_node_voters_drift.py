"""The drift-scheduled momentum sync with node voters (2 voters × 2 ranks, real gloo ranks).

With node voters each rank votes for its voter on its shard, so its signal is its share of
disagreeing votes on that shard (lioncub_ds.momentum_sync, "the drift schedule"): the summed
signal is over the Nn·L ranks. The oracle (test_node_voters._simulate, with the hash tie rule:
with two voters every disagreement is a tie, which Δ = 0 would leave out) records
every voter's sign votes and Δ; from the shard pieces each rank reports, it computes each
rank's units, their sum, and the sync decisions with the same DriftTrigger rule, averaging the
oracle's voter momenta where it syncs. Checked: the parameters after every step, the signal every
rank read at every step, and the syncs (at least one sync and one step without, so the
schedule's decisions are exercised); replicas bit-identical.
"""
from __future__ import annotations

import pytest
import torch

from lioncub_ds import LionCub
from dist_helpers import DriftDecisions, SmallNet as Net, disagreement, run_ranks
from test_node_voters import BETAS, ENV, LR, WD, _average_voters, _grads, _simulate

pytestmark = pytest.mark.dist

GROUPS, SIZE, STEPS = 2, 2, 10
SYNC = {"schedule": "drift", "threshold": 0.01, "min_every": 2}


def _run(rank, world_size):
    torch.manual_seed(0)
    model = Net()
    opt = LionCub(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, comm="1bit", tie_break="hash",
                  voters="node", node_size=SIZE, bucket_size_mb=0.0002, momentum_sync=SYNC)
    index = {id(p): k for k, p in enumerate(model.parameters())}
    after, seen = [], []
    for step in range(1, STEPS + 1):
        for p, g in zip(model.parameters(), _grads(model, rank, step)):
            p.grad = g
        opt.step()
        after.append([p.detach().clone() for p in model.parameters()])
        st = opt.comm_stats()["momentum_sync"]
        seen.append((st["signal_step"], st["signal"], st["syncs"], st["last_sync_step"]))
    pieces = [(index[id(p)], start, length) for bucket in opt.plan.sharding.pieces
              for p, start, length, _ in bucket if length > 0]
    return {"after": after, "seen": seen, "pieces": pieces}


def _oracle(pieces):
    """Parameters after each step, and per step what the ranks' stats say after it: (the step whose
    signal was read, that summed signal, syncs so far, the last sync's step); and the signal's unit."""
    torch.manual_seed(0)
    ranks = GROUPS * SIZE
    master = [p.detach().float().clone() for p in Net().parameters()]
    momenta = [[torch.zeros_like(m) for m in master] for _ in range(GROUPS)]
    decisions = DriftDecisions(SYNC, ranks)
    out = []
    for step in range(1, STEPS + 1):
        record = []
        after, master = _simulate(GROUPS, SIZE, torch.float32, step, step, momenta, master, "hash", record)
        out += after
        votes = {k: (v, d) for _, k, v, d in record}
        summed = 0
        for r in range(ranks):  # each rank: its voter's votes on its shard's pieces
            differ = both = 0
            for k, start, length in pieces[r]:
                v, d = votes[k]
                a, b = disagreement(v[r // SIZE][start:start + length], d[start:start + length])
                differ, both = differ + a, both + b
            summed += decisions.units(differ, both)
        if decisions.step(step, summed):  # after this step's momentum update
            _average_voters(momenta, range(len(master)))
    return out, decisions.rows, decisions.unit


def test_drift_sync_with_node_voters_matches_the_oracle():
    res = run_ranks(_run, GROUPS * SIZE, timeout=300, env=ENV)
    expect, rows, unit = _oracle([r["pieces"] for r in res])
    assert 0 < rows[-1][2] < STEPS - 1, rows  # the schedule both synced and waited
    for r in range(GROUPS * SIZE):
        for step, (got, want) in enumerate(zip(res[r]["after"], expect), 1):
            for a, b in zip(got, want):
                assert torch.equal(a, b), (r, step)
        for step, (seen, row) in enumerate(zip(res[r]["seen"], rows), 1):
            signal_step, signal, synced, last = seen
            assert (signal_step, synced, last) == (row[0], row[2], row[3]), (r, step, seen, row)
            if row[1] is not None:
                assert round(signal * unit) == row[1], (r, step, signal, row[1] / unit)
