"""``pbit``: packed-count SUM all-reduce.

Each rank writes its vote as 0/1 into p-bit lanes packed in bytes; a plain uint8 SUM
all-reduce leaves the count of +1 votes in every lane. 2^p − 1 ≥ N keeps lanes from
carrying (p=2: N≤3, p=4: N≤15, p=8: N≤255). Wire bytes per rank: 2·(N−1)/N·p·P/8.
Works on any backend that sums uint8; no custom reduction.
"""
from __future__ import annotations

from ..conventions import lane_bits_for
from ..config import LionCubConfigError
import torch

from .base import Collectives, VoteAlgorithm, VoteJob, payload_len, refetched, split_columns


def check_lane_bits(p: int, world_size: int) -> None:
    if (1 << p) - 1 < world_size:
        raise LionCubConfigError(
            f"LionCub: pbit_bits={p} is too small for {world_size} ranks: a {p}-bit lane counts at most "
            f"{(1 << p) - 1} votes; allowed: pbit_bits >= {lane_bits_for(world_size)} (or None to choose)")


class PBitVote(VoteAlgorithm):
    """The buffer of a bucket: [plus lanes | N payload slots]. A rank writes its own abstention
    payload into its slot and zeros elsewhere, so the same uint8 SUM delivers every rank's
    payload (one rank contributes to each byte: no carry)."""

    name = "pbit"

    def __init__(self, bits: int | None = None):
        self.bits = bits

    def lane_bits(self, world_size: int) -> int:
        if self.bits is None:
            return lane_bits_for(world_size)
        check_lane_bits(self.bits, world_size)
        return self.bits

    def _widths(self, jobs, n, p):
        return [w for j in jobs for w in (j.plane_bytes * p, n * j.payload.numel())]

    def launch(self, jobs: list[VoteJob], coll: Collectives, backend, flags=None):
        n, rank = coll.world_size, coll.rank
        p = self.lane_bits(n)
        parts = []
        for j in jobs:
            plus, _ = backend.count_lanes(j.sign.view(1, -1), None, p)  # 0/1 lanes (abstainers have sign 0)
            slots = torch.zeros(n, j.payload.numel(), dtype=torch.uint8, device=j.payload.device)
            slots[rank] = j.payload
            parts += [plus, slots.reshape(-1)]
        return coll.all_reduce_(torch.cat(parts), self.name, async_op=True)

    def received(self, pending, jobs, coll):
        n = coll.world_size
        cols = split_columns(pending.wait().view(1, -1), self._widths(jobs, n, self.lane_bits(n)))
        return [c.reshape(n, -1) for c in cols[1::2]]

    def complete(self, pending, jobs, coll, backend):
        n = coll.world_size
        p = self.lane_bits(n)
        cols = split_columns(pending.wait().view(1, -1), self._widths(jobs, n, p))
        for j, plus in zip(jobs, cols[0::2]):
            cnt = None
            if j.planes is not None:  # voters per element, from every rank's nonzero plane
                _, cnt = backend.count_lanes(j.planes, j.planes, p)
            j.delta = backend.lanes_apply(plus.reshape(-1), cnt, n, p, j.params, j.bucket, j.lr, j.weight_decay,
                                          j.step, j.tie_break, j.vote, j.segments(), return_delta=j.keep_delta)

    def wire_bytes(self, numel, world_size, *, mode="list", vote="majority", tie_break="hash", abstain=False,
                   overflow=False):
        n = world_size
        total = numel * self.lane_bits(n) // 8 + n * payload_len(numel, n, mode)
        refetch = (n - 1) * (numel // 8) if refetched(mode, overflow) else 0  # the planes, all-gathered
        return 2 * (n - 1) * total // n + refetch

    def messages(self, world_size):
        return 2 * (world_size - 1)

