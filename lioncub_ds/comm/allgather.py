"""``allgather``: every rank all-gathers all packed 1-bit votes and counts them locally.

Wire bytes per rank: (N−1)·(P/8 + abstention payload) (comm/abstain.py). Simple, one
collective, but grows with N: it loses to a bf16 ring all-reduce past N≈32.
"""
from __future__ import annotations

import torch

from .base import Collectives, VoteAlgorithm, VoteJob, payload_len, refetched, split_columns


class AllGatherVote(VoteAlgorithm):
    name = "allgather"
    carries_flags = True

    def launch(self, jobs: list[VoteJob], coll: Collectives, backend, flags=None):
        parts = [t for j in jobs for t in (j.sign, j.payload)]
        riders = None
        if flags is not None:  # last: the widths below never reach it
            parts.append(flags.view(torch.uint8))
            riders = {"control": 4 * flags.numel()}
        return coll.all_gather(torch.cat(parts), self.name, async_op=True, riders=riders)

    def received(self, pending, jobs, coll):
        cols = split_columns(pending.wait(), [w for j in jobs for w in (j.plane_bytes, j.payload.numel())])
        return cols[1::2]

    def complete(self, pending, jobs, coll, backend):
        cols = split_columns(pending.wait(), [w for j in jobs for w in (j.plane_bytes, j.payload.numel())])
        for j, sign in zip(jobs, cols[0::2]):
            j.delta = backend.vote_apply(sign.contiguous(), j.planes, j.params, j.bucket, j.lr, j.weight_decay,
                                         j.step, j.tie_break, j.vote, coll.world_size, j.segments(),
                                         return_delta=j.keep_delta)

    def wire_bytes(self, numel, world_size, *, mode="list", vote="majority", tie_break="hash", abstain=False,
                   overflow=False):
        refetch = numel // 8 if refetched(mode, overflow) else 0  # the planes, all-gathered after an overflow
        return (world_size - 1) * (numel // 8 + payload_len(numel, world_size, mode) + refetch)

    def messages(self, world_size):
        return world_size - 1
