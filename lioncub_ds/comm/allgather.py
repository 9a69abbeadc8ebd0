"""``allgather``: every rank all-gathers all packed 1-bit votes and counts them locally.

Wire bytes per rank: (N−1)·P/8 (×2 when the nonzero plane rides along). Simple, one
collective, but grows with N: it loses to a bf16 ring all-reduce past N≈32.
"""
from __future__ import annotations

from .base import Collectives, VoteAlgorithm, VoteJob, stack_planes


class AllGatherVote(VoteAlgorithm):
    name = "allgather"

    def run(self, job: VoteJob, coll: Collectives, backend) -> None:
        nbytes = job.numel // 8
        gathered = coll.all_gather(stack_planes(job.sign, job.nonzero), self.name)
        sign = gathered[:, :nbytes]
        nonzero = gathered[:, nbytes:] if job.nonzero is not None else None
        backend.vote_apply(sign.contiguous(), None if nonzero is None else nonzero.contiguous(), job.params,
                           job.offsets, job.lr, job.weight_decay, job.step, job.tie_break, job.vote,
                           coll.world_size, job.segments(), return_delta=False)

    def wire_bytes(self, numel, world_size, *, abstain=False, vote="majority", tie_break="hash"):
        planes = 2 if abstain else 1
        return (world_size - 1) * planes * numel // 8

    def messages(self, world_size):
        return world_size - 1
