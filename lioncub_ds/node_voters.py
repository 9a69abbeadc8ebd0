"""Node voters (``voters="node"``, docs/node_voters.md, SPEC §7): shard inside a node group,
vote across node groups.

World N = Nn groups × L consecutive ranks. Every flat bucket of the layout is padded to a
multiple of 8·Nn·L and cut into L equal shards; local rank k of every group owns shard k. Per
step, on the rank (group j, local rank k):

1. the group's gradients are reduce-scattered: an all_to_all inside the group (in the
   gradients' dtype), then the L rows are summed in fp32 in local-rank order (row 0 + row 1 + ... + row L−1, one add at a time)
   and divided by L: ḡ_jk, the same bits on every platform;
2. shard k votes with the shard-k owners of the other groups (the shard peers) through the
   ordinary pipeline: the shard bucket's "parameters" are views of a flat fp32 work buffer
   (for bf16/fp16 parameters the persistent fp32 master shard; for fp32 parameters a copy of
   their values made for the step), its gradients are views of ḡ_jk, its momenta views of the
   rank's momentum shard, and the hash tie rule keys on the element's index inside its real
   parameter (``param_starts``), as in flat voting;
3. after the agreed update, the group all-gathers the shards (in the parameters' dtype) and
   every rank copies them into its parameters.

Nothing full-precision crosses a group boundary: steps 1 and 3 use the group's own process
group, step 2 only the vote's messages and the step's flags.
"""
from __future__ import annotations

import torch

from .layout import Bucket


def shard_pieces(bucket: Bucket, size: int, local_rank: int) -> list:
    """The parameters' pieces inside shard ``local_rank`` of ``size`` equal shards of ``bucket``:
    (param, start inside it, length, offset in the shard)."""
    numel = bucket.numel // size
    lo = local_rank * numel
    pieces = []
    for p, off in zip(bucket.params, bucket.offsets):
        a, b = max(off, lo), min(off + p.numel(), lo + numel)
        if a < b:
            pieces.append((p, a - off, b - a, a - lo))
    return pieces


def copy_pieces_from_params(pieces, flat) -> None:
    for p, start, length, at in pieces:
        flat[at:at + length].copy_(p.detach().reshape(-1)[start:start + length])


def keep_pieces(flat, pieces, ids) -> list:
    """(flat, offset, copy) of the pieces of ``flat`` that belong to the parameters whose ``id``
    is in ``ids``, for :func:`restore_pieces` after the step."""
    return [(flat, at, flat[at:at + length].clone()) for q, _, length, at in pieces if id(q) in ids]


def restore_pieces(kept) -> None:
    for flat, at, values in kept:
        flat[at:at + values.numel()].copy_(values)


def gather_into_params(coll, buckets, shards) -> None:
    """All-gather every bucket's shard inside the group (in the parameters' dtype) and copy the
    whole bucket into its parameters."""
    pending = [coll.all_gather(flat.to(b.params[0].dtype), "node_all_gather", async_op=True)
               for b, flat in zip(buckets, shards)]
    for b, pend in zip(buckets, pending):
        full = pend.wait().reshape(-1)
        for p, off in zip(b.params, b.offsets):
            p.detach().copy_(full[off:off + p.numel()].view_as(p))


class MasterShards:
    """Master-only sharding (``voters="rank"`` with ``node_size``): every rank still votes with
    its own full momentum over the whole bucket, so Δ is the flat vote's; only the fp32 master of
    bf16/fp16 parameters is sharded over the group. The apply goes to this rank's master shard
    (the vote jobs are pointed at its pieces, with their parameter-local tie indices), then the
    group all-gathers the shards into the parameters. fp32 buckets are applied as in flat voting."""

    def __init__(self, buckets: list[Bucket], topology, node_coll, store):
        self.buckets, self.coll, self.store = buckets, node_coll, store
        self.size, self.local_rank = topology.node_size, topology.local_rank
        self.sharded = [i for i, b in enumerate(buckets) if b.params[0].dtype != torch.float32]
        self.pieces = {i: shard_pieces(buckets[i], self.size, self.local_rank) for i in self.sharded}

    def master(self, i: int) -> torch.Tensor:
        b = self.buckets[i]
        numel = b.numel // self.size
        return self.store.shard("master", i, numel, torch.float32, b.params[0].device,
                                fill=lambda flat: copy_pieces_from_params(self.pieces[i], flat))

    def redirect(self, i: int, job) -> None:
        """Point bucket ``i``'s apply at this rank's master shard (after the vote is counted)."""
        if i not in self.pieces:
            return
        flat, lo = self.master(i), self.local_rank * (self.buckets[i].numel // self.size)
        pieces = self.pieces[i] or [(None, 0, 0, 0)]
        job.params = [flat[at:at + length] for _, _, length, at in pieces]
        job.offsets = [lo + at for _, _, _, at in pieces]
        job.param_starts = [start for _, start, _, _ in pieces]

    def finish(self) -> None:
        gather_into_params(self.coll, [self.buckets[i] for i in self.sharded], [self.master(i) for i in self.sharded])


class NodeShards:
    """This rank's shard of every flat bucket, its buffers and the group's collectives."""

    def __init__(self, full_buckets: list[Bucket], topology, node_coll, store):
        self.full = full_buckets
        self.size, self.local_rank = topology.node_size, topology.local_rank
        self.coll, self.store = node_coll, store
        self.shards: list[Bucket] = []
        self.pieces: list[list] = []   # per bucket: (param, start inside it, length, offset in the shard)
        for fb in full_buckets:
            numel = fb.numel // self.size
            lo = self.local_rank * numel
            pieces = shard_pieces(fb, self.size, self.local_rank)
            self.pieces.append(pieces)
            # an empty shard (the bucket's real elements all live in other shards) still votes, with
            # one all-padding piece, so that every shard peer runs the same collectives
            # (an empty shard's one piece is all padding: length 0 in the real-element mask)
            self.shards.append(Bucket(fb.group_index, [], [None] * max(1, len(pieces)),
                                      [q[3] for q in pieces] or [0], numel, sum(q[2] for q in pieces),
                                      fb.base + lo, param_starts=[q[1] for q in pieces] or [0],
                                      lengths=[q[2] for q in pieces] or [0],
                                      kind=(fb.params[0].device, torch.float32)))
        self.device = full_buckets[0].params[0].device if full_buckets else torch.device("cpu")
        self.missing: list = []  # per bucket: this step's parameters without a gradient on this rank
        self.grads: list = []   # this step's ḡ shard per bucket
        self.work: list = []    # this step's fp32 parameter shard per bucket (the master, or a copy)
        self.problems: list = []

    def low_precision(self, i: int) -> bool:
        return self.full[i].params[0].dtype != torch.float32

    # ------------------------------------------------------------------ before the vote
    def _work(self, i: int) -> torch.Tensor:
        """Bucket ``i``'s flat fp32 shard of parameter values: the persistent master for bf16/fp16
        parameters (made from their values the first time), a copy for the step otherwise."""
        sb = self.shards[i]
        if self.low_precision(i):
            return self.store.shard("master", i, sb.numel, torch.float32, self.device,
                                    fill=lambda flat: copy_pieces_from_params(self.pieces[i], flat))
        work = torch.zeros(sb.numel, dtype=torch.float32, device=self.device)
        copy_pieces_from_params(self.pieces[i], work)
        return work

    @staticmethod
    def _views(flat, pieces):
        return [flat[at:at + length] for _, _, length, at in pieces] or [flat]

    def begin(self, grad_problem) -> None:
        """Reduce-scatter every bucket's gradients inside the group (launched together, then
        summed in local-rank order) and point each shard bucket at this step's buffers.
        ``grad_problem(bucket)``: this rank's reason its gradients are unusable, or None (it then
        sends zeros and the flags make every rank refuse the step)."""
        pending, self.problems, self.missing = [], [], []
        for fb in self.full:
            problem = grad_problem(fb)
            self.problems.append(problem)
            # indices (in the full bucket) of the parameters without a gradient on this rank: the
            # step leaves a parameter that has none on ANY rank alone, as flat voting does
            self.missing.append(tuple(k for k, p in enumerate(fb.params) if p.grad is None))
            # the gradients travel in their own dtype (torch keeps p.grad in p's dtype, the same on
            # every rank): bf16 halves the group's bytes, and the fp32 sum below is the same
            flat = torch.zeros(fb.numel, dtype=fb.params[0].dtype, device=self.device)
            if problem is None:
                for p, off in zip(fb.params, fb.offsets):
                    if p.grad is not None:
                        flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
            pending.append(self.coll.all_to_all(flat.view(self.size, -1), "node_reduce_scatter", async_op=True))
        self.grads, self.work = [], []
        for i, pend in enumerate(pending):
            rows = pend.wait()
            acc = rows[0].to(torch.float32, copy=True)
            for row in rows[1:]:  # local-rank order: the documented sum, in fp32
                acc.add_(row.to(torch.float32))
            acc.div_(self.size)
            self.grads.append(acc)
            self.work.append(self._work(i))
            self.shards[i].params = self._views(self.work[i], self.pieces[i])

    def inputs(self, i: int):
        """(gradients, momenta) of shard bucket ``i`` for the local step: views of ḡ and of the
        momentum shard, piece by piece."""
        sb = self.shards[i]
        m = self.store.shard("momentum", i, sb.numel, self.store.dtype, self.device)
        return self._views(self.grads[i], self.pieces[i]), self._views(m, self.pieces[i])

    def keep(self, idle) -> list:
        """Copies of the momentum and master pieces of the ``idle`` parameters in this rank's
        shards (:func:`keep_pieces`)."""
        ids = {id(p) for p in idle}
        kept = []
        for i, pieces in enumerate(self.pieces):
            if not any(id(q[0]) in ids for q in pieces):
                continue
            kept += keep_pieces(self.store.shard("momentum", i, self.shards[i].numel, self.store.dtype, self.device),
                                pieces, ids)
            if self.low_precision(i):
                kept += keep_pieces(self.work[i], pieces, ids)  # the persistent master shard
        return kept

    # ------------------------------------------------------------------ after the vote
    def finish(self) -> None:
        """All-gather the updated shards inside the group (in the parameters' dtype) and copy
        them into the parameters; drop the step's buffers."""
        gather_into_params(self.coll, self.full, self.work)
        self.release()

    def release(self) -> None:
        """Forget the step's gradient and work buffers (the master shards stay)."""
        self.grads, self.work = [], []
        for sb in self.shards:
            sb.params = []
