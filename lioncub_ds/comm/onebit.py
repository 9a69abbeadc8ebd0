"""``1bit``: the two-phase sharded vote.

Phase 1: all-to-all of packed bits, so rank r holds shard r of every rank's votes and
counts them. Phase 2: all-gather of the packed shard results. Wire bytes per rank:
2·(N−1)/N·P/8, independent of N.

The phase-2 result needs a second (nonzero) plane only where Δ can be 0: when some
rank abstained in the bucket, or with tie_break="zero" and an even N. With
vote="average" the shard owner sends the vote counts back in p-bit lanes,
p = ⌈log2(N+1)⌉ rounded up to 1/2/4/8.
"""
from __future__ import annotations

import torch

from ..codec import lane_bits_for
from .base import Collectives, VoteAlgorithm, VoteJob, stack_planes


def phase2_needs_nonzero(world_size: int, abstain: bool, tie_break: str) -> bool:
    return abstain or (tie_break == "zero" and world_size % 2 == 0)


class OneBitVote(VoteAlgorithm):
    name = "1bit"

    def run(self, job: VoteJob, coll: Collectives, backend) -> None:
        n, rank = coll.world_size, coll.rank
        shard = job.numel // 8 // n  # bytes per shard and plane
        planes = [job.sign.view(n, shard)]
        if job.nonzero is not None:
            planes.append(job.nonzero.view(n, shard))
        send = planes[0] if len(planes) == 1 else torch.cat(planes, dim=1)
        recv = coll.all_to_all(send, self.name)
        sign = recv[:, :shard].contiguous()
        nonzero = recv[:, shard:].contiguous() if job.nonzero is not None else None
        # the tie-index table of this rank's shard: parameter-local indices, whatever the layout
        shard_segments = job.segments(rank * shard * 8, (rank + 1) * shard * 8)
        abstain = job.nonzero is not None
        if job.vote == "average":
            p = lane_bits_for(n)
            plus, cnt = backend.count_lanes(sign, nonzero, p)
            gathered = coll.all_gather(stack_planes(plus, cnt), self.name)
            lanes = shard * p  # bytes of one lane plane for one shard
            plus_all = gathered[:, :lanes].reshape(-1)
            cnt_all = gathered[:, lanes:].reshape(-1) if cnt is not None else None
            backend.lanes_apply(plus_all, cnt_all, n, p, job.params, job.offsets, job.lr, job.weight_decay,
                                job.step, job.tie_break, "average", job.segments(), return_delta=False)
            return
        res_sign, res_nz = backend.shard_vote(sign, nonzero, job.step, job.tie_break, shard_segments)
        send_nz = phase2_needs_nonzero(n, abstain, job.tie_break)
        gathered = coll.all_gather(stack_planes(res_sign, res_nz if send_nz else None), self.name)
        full_sign = gathered[:, :shard].reshape(1, -1)
        full_nz = gathered[:, shard:].reshape(1, -1) if send_nz else None
        # One "voter" (the agreed result): counting it reproduces Δ exactly, no tie is possible.
        backend.vote_apply(full_sign, full_nz, job.params, job.offsets, job.lr, job.weight_decay, job.step,
                           job.tie_break, "majority", 1, job.segments(), return_delta=False)

    def wire_bytes(self, numel, world_size, *, abstain=False, vote="majority", tie_break="hash"):
        n = world_size
        bits = numel // 8
        phase1 = (n - 1) * (2 if abstain else 1) * bits // n
        if vote == "average":
            p = lane_bits_for(n)
            phase2 = (n - 1) * (2 if abstain else 1) * bits * p // n
        else:
            phase2 = (n - 1) * (2 if phase2_needs_nonzero(n, abstain, tie_break) else 1) * bits // n
        return phase1 + phase2

    def messages(self, world_size):
        return 2 * (world_size - 1)
