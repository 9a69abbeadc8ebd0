"""``int8``: scaled int8 quantization of c, SUM all-reduce, Δ = sign(Σq).

s = ⌊127/N⌋ levels, so |Σq| ≤ N·s ≤ 127 never overflows int8. Each rank scales by its
own per-tensor a (l1: mean|c|, l0: geometric mean, linf: max), so no scale travels.
Keeps magnitude information; majority vote only. Wire bytes per rank: 2·(N−1)/N·P.
"""
from __future__ import annotations

from .base import Collectives, VoteAlgorithm, VoteJob


class Int8Vote(VoteAlgorithm):
    name = "int8"
    encoding = "int8"
    supports_average = False

    def run(self, job: VoteJob, coll: Collectives, backend) -> None:
        summed = coll.all_reduce_(job.codes, self.name)
        backend.int8_apply(summed, job.params, job.offsets, job.lr, job.weight_decay, return_delta=False)

    def wire_bytes(self, numel, world_size, *, abstain=False, vote="majority", tie_break="hash"):
        return 2 * (world_size - 1) * numel // world_size

    def messages(self, world_size):
        return 2 * (world_size - 1)
