"""``int8``: scaled int8 quantization of c, SUM all-reduce, Δ = sign(Σq).

s = ⌊127/N⌋ levels, so |Σq| ≤ N·s ≤ 127 never overflows int8. Each rank scales by its
own per-tensor a (l1: mean|c|, l0: geometric mean, linf: max), so no scale travels.
Keeps magnitude information; majority vote only. Wire bytes per rank: 2·(N−1)/N·P.
A zero c gives q = 0, so abstentions need nothing on the wire.
"""
from __future__ import annotations

import torch

from .base import Collectives, VoteAlgorithm, VoteJob


class Int8Vote(VoteAlgorithm):
    name = "int8"
    encoding = "int8"
    supports_average = False

    def launch(self, jobs: list[VoteJob], coll: Collectives, backend, flags=None):
        buf = jobs[0].codes if len(jobs) == 1 else torch.cat([j.codes for j in jobs])
        return coll.all_reduce_(buf, self.name, async_op=True)

    def received(self, pending, jobs, coll):
        pending.wait()
        return [None] * len(jobs)

    def complete(self, pending, jobs, coll, backend):
        summed, off = pending.wait(), 0
        for j in jobs:
            j.delta = backend.int8_apply(summed[off:off + j.numel], j.params, j.offsets, j.lr, j.weight_decay,
                                         return_delta=j.keep_delta)
            off += j.numel

    def wire_bytes(self, numel, world_size, *, mode="list", vote="majority", tie_break="hash", abstain=False,
                   overflow=False):
        return 2 * (world_size - 1) * numel // world_size

    def messages(self, world_size):
        return 2 * (world_size - 1)
