"""``1bit``: the two-phase sharded vote.

Phase 1: all-to-all of packed bits, so rank r holds shard r of every rank's votes and
counts them; every rank's abstention payload (comm/abstain.py: a short list, or the plane)
rides along to every rank. Phase 2: all-gather of the packed shard results. Wire bytes per
rank: 2·(N−1)/N·P/8 + (N−1)·payload, nearly independent of N.

Phase 2 carries 1 bit per element: where Δ is 0 because nobody voted, every rank already
knows it from the payloads. Only tie_break="zero" with a possible tie (an even N, or
abstentions) adds the result's nonzero plane. Whole nonzero planes (plane mode, or after a list
overflowed) travel *sharded* with majority votes: rank r receives only shard r of each rank's
plane, and phase 2 then carries the result's nonzero plane: (N−1)/N·2·P/8 more bytes instead of
the (N−1)·P/8 of sending every plane to every rank (N/2 times fewer: 8x at N = 16). The chunk code
(comm/abstain.py, runs of abstentions) travels sharded too: rank r receives every rank's list
and shard r's zero-chunk bits, and phase 2 carries one bit per chunk of the result (chunk all
voted), from which, with the lists, every rank rebuilds where Δ is 0: (N−1)/N·P/64 bytes
instead of a plane. With vote="average" the shard owner sends the +1 counts back in
p-bit lanes, p = ⌈log2(N+1)⌉ rounded up to 1/2/4/8, and every rank counts the voters itself.
"""
from __future__ import annotations

import torch

from ..conventions import lane_bits_for
from .abstain import ChunkCode, any_voter
from .base import (Collectives, VoteAlgorithm, VoteJob, payload_len, planes_counted, refetched,
                   split_columns)


def phase2_needs_nonzero(world_size: int, tie_break: str, abstain: bool = False, zero_level: bool = False) -> bool:
    """Δ can be 0 on a tie (not only where nobody voted): the result's nonzero plane travels.
    A tie of ±1 votes needs an even number of voters: an even N, or abstentions; with a zero
    level among the codes (``bbit``, b >= 2) Σq = 0 at any N."""
    return tie_break == "zero" and (world_size % 2 == 0 or abstain or zero_level)


class OneBitVote(VoteAlgorithm):
    name = "1bit"
    carries_flags = True  # like the payloads, the flags go to every rank

    planes = 1  # packed vote planes per element (bbit: its b code planes)
    zero_level = False  # a voter's code can be 0 (bbit, b >= 2): Σ = 0 ties at an odd N too

    def shards_planes(self, vote: str) -> bool:
        return vote == "majority"  # average: every rank counts the voters itself (whole planes)

    def _sends_shards(self, j: VoteJob) -> bool:
        return j.mode in ("plane", "chunks") and self.shards_planes(j.vote)

    def _payload_rows(self, j: VoteJob, n: int) -> torch.Tensor:
        """[N, width]: row r = what rank r receives of this rank's abstention payload: shard r of
        the plane (sharded plane mode), the chunk list and shard r's zero-chunk bits (sharded
        chunks mode), else the whole payload (a list, the chunk code, or the plane)."""
        if self._sends_shards(j):
            return j.payload.view(n, -1) if j.mode == "plane" else ChunkCode(j.plane_bytes, n).payload_rows(j.payload)
        return j.payload.view(1, -1).expand(n, -1)

    def _payload_width(self, j: VoteJob, n: int) -> int:
        if not self._sends_shards(j):
            return j.payload.numel()
        return j.plane_bytes // n if j.mode == "plane" else ChunkCode(j.plane_bytes, n).shard_payload_bytes

    def _phase1_widths(self, jobs, n):
        return [w for j in jobs for w in (self.planes * j.plane_bytes // n, self._payload_width(j, n))]

    def _phase2_extra(self, j: VoteJob, n: int) -> str | None:
        """What phase 2 carries besides the result's sign (majority; the same on every rank: the
        planes follow the agreed flags and mode): "plane", the result's nonzero plane (Δ can be 0
        on a tie; or the planes travelled sharded, so no rank but the owner knows where nobody
        voted); "chunks", one bit per chunk instead (the planes came as the sharded chunk code:
        the lists rebuild the rest); None (every rank knows where nobody voted, or nobody abstains)."""
        if phase2_needs_nonzero(n, j.tie_break, j.planes is not None, self.zero_level):
            return "plane"
        if j.planes is not None and j.planes_sharded:
            return "plane" if j.chunk_lists is None else "chunks"
        return None

    def _vote_rows(self, j: VoteJob, n: int) -> torch.Tensor:
        """[N, width]: row r = what rank r receives of this rank's votes (shard r of each plane)."""
        shard = j.plane_bytes // n
        return j.sign.view(self.planes, n, shard).transpose(0, 1).reshape(n, self.planes * shard)

    def _shard_vote(self, backend, votes, nz, j: VoteJob, rank: int, n: int):
        """The shard owner's (sign, nonzero) result planes from every rank's votes [N, width]."""
        shard = j.plane_bytes // n
        return backend.shard_vote(votes.contiguous(), nz, j.step, j.tie_break,
                                  j.segments(rank * shard * 8, (rank + 1) * shard * 8))

    def launch(self, jobs: list[VoteJob], coll: Collectives, backend, flags=None):
        n = coll.world_size
        rows = []
        for j in jobs:
            rows += [self._vote_rows(j, n), self._payload_rows(j, n)]
        riders = None
        if flags is not None:  # last: the widths above never reach it
            rows.append(flags.view(torch.uint8).view(1, -1).expand(n, -1))
            riders = {"control": 4 * flags.numel()}
        return coll.all_to_all(torch.cat(rows, dim=1), self.name, async_op=True, riders=riders)

    def received(self, pending, jobs, coll):
        return split_columns(pending.wait(), self._phase1_widths(jobs, coll.world_size))[1::2]

    def count(self, pending, jobs, coll, backend):
        """Shard votes, then phase 2 launched (its all-gather in flight when this returns)."""
        n, rank = coll.world_size, coll.rank
        signs = split_columns(pending.wait(), self._phase1_widths(jobs, n))[0::2]
        average = jobs[0].vote == "average"
        p = lane_bits_for(n)
        send_nz = [None if average else self._phase2_extra(j, n) for j in jobs]
        parts, widths = [], []
        for j, sign, snz in zip(jobs, signs, send_nz):
            shard = j.plane_bytes // n
            if j.planes is None:
                nz = None
            elif j.planes_sharded:
                nz = j.planes.contiguous()
            else:
                nz = j.planes[:, rank * shard:(rank + 1) * shard].contiguous()
            if average:
                plus, _ = backend.count_lanes(sign.contiguous(), nz, p)
                parts.append(plus)
                widths.append(plus.numel())
            else:
                res_sign, res_nz = self._shard_vote(backend, sign, nz, j, rank, n)
                if snz == "chunks":
                    res_nz = ChunkCode(j.plane_bytes, n).full_bits(res_nz, j.mask[rank * shard:(rank + 1) * shard], rank)
                parts += [res_sign, res_nz] if snz else [res_sign]
                widths += [shard, res_nz.numel()] if snz else [shard]
        return coll.all_gather(torch.cat(parts), self.name, async_op=True), widths, send_nz  # [N, Σ widths]

    def complete(self, state, jobs, coll, backend):
        pending, widths, send_nz = state
        n = coll.world_size
        average = jobs[0].vote == "average"
        p = lane_bits_for(n)
        cols = iter(split_columns(pending.wait(), widths))
        for j, snz in zip(jobs, send_nz):
            mine = [next(cols)] + ([next(cols)] if snz else [])
            if average:
                cnt = None if j.planes is None else backend.count_lanes(j.planes, j.planes, p)[1]
                j.delta = backend.lanes_apply(mine[0].contiguous().view(-1), cnt, n, p, j.params, j.bucket, j.lr,
                                              j.weight_decay, j.step, j.tie_break, "average", j.segments(),
                                              return_delta=j.keep_delta)
                continue
            # a column of the gathered [N, widths] (copied once; a 1-byte column would stay a strided view,
            # which the kernels' gated entry does not take)
            full_sign = mine[0].contiguous().view(1, -1)
            if snz == "chunks":  # where Δ is 0: from the owners' full-chunk bits and every rank's list
                full_nz = ChunkCode(j.plane_bytes, n).result_nonzero(mine[1], j.chunk_lists, j.mask).view(1, -1)
            elif snz:
                full_nz = mine[1].contiguous().view(1, -1)
            else:  # Δ = 0 exactly where no rank voted (every rank knows the planes)
                full_nz = None if j.planes is None else any_voter(j.planes).view(1, -1)
            # One "voter" (the agreed result): counting it reproduces Δ exactly, no tie is possible.
            j.delta = backend.vote_apply(full_sign, full_nz, j.params, j.bucket, j.lr, j.weight_decay, j.step,
                                         j.tie_break, "majority", 1, j.segments(), return_delta=j.keep_delta)

    def wire_bytes(self, numel, world_size, *, mode="list", vote="majority", tie_break="hash", abstain=False,
                   overflow=False):
        n = world_size
        shard = numel // 8 // n
        splits = self.shards_planes(vote)
        counted = planes_counted(mode, abstain)
        fetch = refetched(mode, overflow)
        if splits and mode == "plane":
            payload = shard
        elif splits and mode == "chunks":
            payload = ChunkCode(numel // 8, n).shard_payload_bytes
        else:
            payload = payload_len(numel, n, mode)
        phase1 = (n - 1) * (shard + payload)
        if fetch:  # the planes once more: this rank's shards, or the whole plane to all
            phase1 += (n - 1) * (shard if splits else numel // 8)
        if vote == "average":
            phase2 = (n - 1) * shard * lane_bits_for(n)
        elif phase2_needs_nonzero(n, tie_break, counted, self.zero_level) or (splits and counted and (mode == "plane" or fetch)):
            phase2 = 2 * (n - 1) * shard  # the result's sign and nonzero planes
        elif splits and mode == "chunks":
            phase2 = (n - 1) * (shard + ChunkCode(numel // 8, n).window_bytes)  # sign, full-chunk bits
        else:
            phase2 = (n - 1) * shard
        return phase1 + phase2

    def messages(self, world_size):
        return 2 * (world_size - 1)
