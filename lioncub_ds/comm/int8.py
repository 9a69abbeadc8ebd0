"""``int8``: scaled int8 quantization of c, SUM all-reduce, Δ = sign(Σq).

s = ⌊127/N⌋ levels, so |Σq| ≤ N·s ≤ 127 never overflows int8. Each rank scales by its
own per-tensor a (l1: mean|c|, l0: geometric mean, linf: max), so no scale travels.
Keeps magnitude information; majority vote only. Wire bytes per rank: 2·(N−1)/N·P.
A zero c gives q = 0, so abstentions need nothing on the wire.
"""
from __future__ import annotations

import torch

from ..conventions import int8_levels
from .base import Collectives, VoteAlgorithm, VoteJob


class Int8Vote(VoteAlgorithm):
    name = "int8"
    encoding = "int8"
    supports_average = False
    advances_momenta = False  # int8_local_step writes codes only: the momenta advance in their own pass

    def __init__(self, quant: str = "l1"):
        self.quant = quant  # the per-tensor scale: l1, l0 or linf

    def abstention_layout(self, offsets, numels, numel, device, world_size):
        return None, 0, None  # a zero c gives q = 0: nothing abstention-related travels

    def batch_bytes(self, numel):
        return numel  # one int8 code per element

    def local_step(self, job, grads, momenta, backend, betas, world_size, seed, momenta_out=None):
        """Scaled int8 codes (``job.codes``); no abstention flags (zeros)."""
        job.codes, nonfinite = backend.int8_local_step(grads, momenta, job.bucket, job.numel, betas[0], self.quant,
                                                       int8_levels(world_size), device_counts=True)
        return nonfinite, torch.zeros(2, dtype=torch.int32, device=job.codes.device)

    def no_votes(self, job, device, backend, world_size):
        job.codes = torch.zeros(job.numel, dtype=torch.int8, device=device)

    def agree_planes(self, job, received, first, second, coll):
        return job.mode  # no planes: every rank's code is counted, a zero as 0

    def launch(self, jobs: list[VoteJob], coll: Collectives, backend, flags=None):
        buf = jobs[0].codes if len(jobs) == 1 else torch.cat([j.codes for j in jobs])
        return coll.all_reduce_(buf, self.name, async_op=True)

    def received(self, pending, jobs, coll):
        pending.wait()
        return [None] * len(jobs)

    def complete(self, pending, jobs, coll, backend):
        summed, off = pending.wait(), 0
        for j in jobs:
            j.delta = backend.int8_apply(summed[off:off + j.numel], j.params, j.bucket, j.lr, j.weight_decay,
                                         return_delta=j.keep_delta)
            off += j.numel

    def wire_bytes(self, numel, world_size, *, mode="list", vote="majority", tie_break="hash", abstain=False,
                   overflow=False):
        return 2 * (world_size - 1) * numel // world_size

    def messages(self, world_size):
        return 2 * (world_size - 1)
