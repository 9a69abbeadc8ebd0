"""``pbit``: packed-count SUM all-reduce.

Each rank writes its vote as 0/1 into p-bit lanes packed in bytes; a plain uint8 SUM
all-reduce leaves the count of +1 votes in every lane. 2^p − 1 ≥ N keeps lanes from
carrying (p=2: N≤3, p=4: N≤15, p=8: N≤255). Wire bytes per rank: 2·(N−1)/N·p·P/8.
Works on any backend that sums uint8; no custom reduction.
"""
from __future__ import annotations

from ..codec import lane_bits_for
from ..config import LionCubConfigError
from .base import Collectives, VoteAlgorithm, VoteJob, stack_planes


def check_lane_bits(p: int, world_size: int) -> None:
    if (1 << p) - 1 < world_size:
        raise LionCubConfigError(
            f"LionCub: pbit_bits={p} is too small for {world_size} ranks: a {p}-bit lane counts at most "
            f"{(1 << p) - 1} votes; allowed: pbit_bits >= {lane_bits_for(world_size)} (or None to choose)")


class PBitVote(VoteAlgorithm):
    name = "pbit"

    def __init__(self, bits: int | None = None):
        self.bits = bits

    def lane_bits(self, world_size: int) -> int:
        if self.bits is None:
            return lane_bits_for(world_size)
        check_lane_bits(self.bits, world_size)
        return self.bits

    def run(self, job: VoteJob, coll: Collectives, backend) -> None:
        n = coll.world_size
        p = self.lane_bits(n)
        plus, cnt = backend.count_lanes(job.sign.view(1, -1), None if job.nonzero is None else job.nonzero.view(1, -1), p)
        summed = coll.all_reduce_(stack_planes(plus, cnt).clone(), self.name)
        lanes = plus.numel()
        backend.lanes_apply(summed[:lanes], summed[lanes:] if cnt is not None else None, n, p, job.params,
                            job.offsets, job.lr, job.weight_decay, job.step, job.tie_break, job.vote, job.segments(),
                            return_delta=False)

    def wire_bytes(self, numel, world_size, *, abstain=False, vote="majority", tie_break="hash"):
        p = self.lane_bits(world_size)
        return 2 * (world_size - 1) * (2 if abstain else 1) * (numel * p // 8) // world_size

    def messages(self, world_size):
        return 2 * (world_size - 1)
