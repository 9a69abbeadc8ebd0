"""The distributed step's pipeline: local steps, communication batches, async launch, finish.

Like torch DDP's reducer: parameter buckets are grouped into communication batches (one
collective per phase for a whole batch, sized by ``comm_bucket_mb`` of packed votes), and a
batch is launched asynchronously as soon as every bucket in it has its local step (signs).
Batches launch in one fixed order on every rank (last parameters first: backward produces
their gradients first), so every rank issues the same collectives in the same order, whenever
each becomes ready. With ``overlap=True`` the local steps run from gradient-ready hooks during
backward; otherwise at the start of ``step()``. ``finish`` then reads the step's one flag
tensor (non-finite values, unusable inputs, abstention overflow): every rank's flags ride in
the last batch's first-phase message when that algorithm sends every rank's message to every
rank (1bit, allgather) and the launch happens in ``step()``; otherwise one small all-reduce
agrees on them. ``complete`` counts the votes, runs the momentum update while any second phase
is in flight, and applies. Nothing here changes optimizer state before the flags are agreed: a
skipped step is free.
"""
from __future__ import annotations

import logging

import torch

from . import kernels
from .kernels.reference import dither_seed, int8_levels
from .lion import lr_value
from .comm import VoteJob
from .telemetry import ring_bytes

log = logging.getLogger("lioncub_ds")

# The step's flag tensor, summed over ranks: [ranks with a non-finite value, ranks with an unusable
# input, non-finite values in all (each rank's count capped at 2**20), ranks where some voting
# parameter has no gradient], then per bucket [ranks whose abstention list overflowed, ranks with
# an abstention].
FLAG_HEAD = 4


def flag_bytes(n_buckets: int, world_size: int, carried: bool) -> int:
    """Bytes one rank sends per step for the flags: carried in a gather-like first phase (to every
    other rank), or in their own all-reduce (ring)."""
    words = 4 * (FLAG_HEAD + 2 * n_buckets)
    return (world_size - 1) * words if carried else ring_bytes("all_reduce", words, world_size)


def comm_batches(buckets, comm_bucket_mb: float, world_size: int) -> list[list[int]]:
    """Bucket indices per communication batch, in launch order (last buckets first).

    Consecutive buckets with the same algorithm, device and dtype share a batch while their
    packed votes (bits: numel/8 bytes; int8: numel bytes) fit ``comm_bucket_mb`` MB."""
    cap = comm_bucket_mb * 2 ** 20
    batches, cur, size = [], [], 0
    for i in reversed(range(len(buckets))):
        b = buckets[i]
        width = b.numel // 8 if b.algorithm.encoding == "bits" else b.numel
        key = (b.algorithm.name, b.params[0].device, b.params[0].dtype)
        if cur and (key != cur_key or size + width > cap):
            batches.append(cur)
            cur, size = [], 0
        cur.append(i)
        cur_key = key
        size += width
    if cur:
        batches.append(cur)
    return batches


class _Local:
    """One bucket's local half of a step (nothing written to optimizer state)."""
    __slots__ = ("job", "grads", "momenta", "backend", "nonfinite", "flags", "versions", "next_momenta", "missing")

    def __init__(self, job, grads, momenta, backend, nonfinite, flags, versions, next_momenta=None, missing=()):
        self.job, self.grads, self.momenta, self.backend = job, grads, momenta, backend
        # indices (in the bucket) of the parameters without a gradient on this rank
        self.missing = tuple(missing)
        self.nonfinite, self.flags, self.versions = nonfinite, flags, versions
        # momentum_double_buffer: the momenta already advanced by the local pass (else None)
        self.next_momenta = next_momenta


class VotePipeline:
    """The per-step state of one LionCub's distributed step."""

    def __init__(self, opt):
        self.opt = opt
        self.reset()

    def reset(self):
        n_buckets = len(self.opt._buckets)
        self.local: list[_Local | None] = [None] * n_buckets
        self.ready: list[set] = [set() for _ in range(n_buckets)]
        self.launched: list = [None] * len(self.opt._batches)
        self.next_batch = 0
        self.stale = False
        self.error: str | None = None
        # set when the last batch's phase 1 carried the step's flags, with this rank's reason for
        # its "unusable input" flag (uniform over ranks: only finish() asks for a carry)
        self.flags_carried = False
        self.carried_error: str | None = None

    @property
    def busy(self) -> bool:
        return any(x is not None for x in self.local)

    # ------------------------------------------------------------------ local step
    def _grad_problem(self, b) -> str | None:
        for p, name in zip(b.params, b.names):
            gr = p.grad
            if gr is not None and (gr.is_sparse or gr.shape != p.shape or gr.device != p.device):
                return (f"LionCub: the gradient of parameter {name or tuple(p.shape)} is "
                        f"{'sparse' if gr.is_sparse else f'{tuple(gr.shape)} on {gr.device}'}; allowed: a dense "
                        f"gradient of the parameter's shape {tuple(p.shape)} on {p.device}")
        return None

    def prepare(self, i: int) -> None:
        """Bucket ``i``'s local step: its votes and abstention payload, and its flag entries."""
        opt, b = self.opt, self.opt._buckets[i]
        cfg = opt.config
        g = opt.param_groups[b.group_index]
        b1, b2 = g["betas"]
        dev = b.params[0].device
        be = kernels.backend_for(dev.type)
        job = VoteJob(b.params, b.offsets, b.numel, None, lr_value(g["lr"]), g["weight_decay"], opt._step_count + 1,
                      cfg.tie_break, cfg.vote)
        problem = self._grad_problem(b)
        if problem is not None:
            # This rank cannot vote: send well-formed zeros so every rank's collectives still
            # match, and say why through the flags (every rank raises together).
            self.error = self.error or problem
            grads, momenta = [], []
            if b.algorithm.encoding == "int8":
                job.codes = torch.zeros(b.numel, dtype=torch.int8, device=dev)
            else:
                self._payload(job, b, torch.zeros(b.algorithm.planes, b.numel // 8, dtype=torch.uint8, device=dev),
                              torch.zeros(b.numel // 8, dtype=torch.uint8, device=dev), be)
            zero = torch.zeros((), dtype=torch.int64, device=dev)
            self.local[i] = _Local(job, grads, momenta, be, zero, torch.zeros(2, dtype=torch.int32, device=dev), [])
            return
        grads = opt._grads(b)
        momenta = [opt._momentum(p) for p in b.params]
        # counts stay on the device (device_counts): finish() folds them into the step's one flag read
        nxt = None
        if b.algorithm.encoding == "int8":
            job.codes, nonfinite = be.int8_local_step(grads, momenta, b.offsets, b.numel, b1, cfg.quant,
                                                      int8_levels(opt.world_size), device_counts=True)
            flags = torch.zeros(2, dtype=torch.int32, device=dev)
        else:
            # momentum_double_buffer: the next momenta are written in this same pass over g and m
            # (into spare buffers: a skipped step must leave m unchanged), saving a second pass later
            nxt = [opt._next_momentum(p) for p in b.params] if cfg.momentum_double_buffer else None
            al = b.algorithm
            if al.name == "bbit":  # b-bit codes as bit planes (job.sign), dithered per rank and step
                sign, nz, nonfinite, _ = be.bbit_local_step(grads, momenta, b.offsets, b.numel, b1, b2, al.quant,
                                                            al.bits, al.rounding, dither_seed(job.step, opt.rank),
                                                            job.segments(), nxt is not None, device_counts=True,
                                                            momenta_out=nxt)
            else:
                sign, nz, nonfinite, _ = be.local_step(grads, momenta, b.offsets, b.numel, b1, b2, nxt is not None,
                                                       device_counts=True, momenta_out=nxt)
            flags = self._payload(job, b, sign, nz, be)
        versions = [(p.grad, p.grad._version) for p in b.params if p.grad is not None]
        missing = [k for k, p in enumerate(b.params) if p.grad is None]
        self.local[i] = _Local(job, grads, momenta, be, nonfinite, flags, versions, nxt, missing)

    @staticmethod
    def _payload(job, b, sign, nz, be):
        """Fill the job's abstention payload; return its flag entries [overflow, abstains] (device)."""
        job.sign, job.nonzero, job.mask, job.mode, job.capacity = sign, nz, b.mask, b.mode, b.capacity
        # the plane mode sends the plane and needs only the count (a list of capacity 0)
        words = be.abstain_list(nz, b.mask, b.capacity if b.mode == "list" else 0)
        job.payload = nz if b.mode == "plane" else words.view(torch.uint8)
        count = words[0]
        return torch.stack([(count > b.capacity).to(torch.int32), (count > 0).to(torch.int32)])

    # ------------------------------------------------------------------ launch
    def grad_ready(self, i: int, p) -> None:
        """A gradient-ready hook fired for parameter ``p`` of bucket ``i``."""
        if self.local[i] is not None:  # a second backward after this bucket voted: redo at step()
            self.stale = True
            return
        self.ready[i].add(id(p))
        if len(self.ready[i]) == len(self.opt._buckets[i].params):
            self.prepare(i)
            before = self.next_batch
            self.launch_ready()
            self.opt._backward_launches += self.next_batch - before

    def launch_ready(self, carry_flags: bool = False, frozen_error: str | None = None) -> None:
        """Launch, in the fixed order, every batch whose buckets all have their local step.
        ``carry_flags`` (only from finish(), on every rank): the last batch carries the step's
        flags, with ``frozen_error`` (this rank's), if its algorithm can."""
        opt = self.opt
        while self.next_batch < len(opt._batches):
            batch = opt._batches[self.next_batch]
            if any(self.local[i] is None for i in batch):
                return
            jobs = [self.local[i].job for i in batch]
            first = self.local[batch[0]]
            flags = None
            if carry_flags and opt._carry_flags and self.next_batch == len(opt._batches) - 1:
                # Launched from step() after every local step: the last batch's phase 1 carries
                # the step's flags (no flag all-reduce of its own).
                self.flags_carried, self.carried_error = True, frozen_error or self.error
                flags = self._own_flags(self.carried_error)
            self.launched[self.next_batch] = opt._buckets[batch[0]].algorithm.launch(jobs, opt._coll, first.backend,
                                                                                     flags)
            self.next_batch += 1

    def launch_all(self, carry_flags: bool = False, frozen_error: str | None = None) -> None:
        """Local steps of the buckets that have none yet (in launch order), launching as they
        complete (``carry_flags``, ``frozen_error``: see launch_ready)."""
        for batch in self.opt._batches:
            for i in batch:
                if self.local[i] is None:
                    self.prepare(i)
            self.launch_ready(carry_flags, frozen_error)

    def changed_since_vote(self) -> bool:
        """A gradient replaced or modified in place (e.g. clipped) after its bucket voted."""
        for i, loc in enumerate(self.local):
            if loc is None:
                continue
            b = self.opt._buckets[i]
            now = [(p.grad, p.grad._version) for p in b.params if p.grad is not None]
            if len(now) != len(loc.versions) or any(a is not c or v != w for (a, v), (c, w) in zip(now, loc.versions)):
                return True
        return False

    def drain(self) -> None:
        """Discard this step's votes and start over. Every batch is launched first: ranks may have
        launched different prefixes of the batch order during backward, and every rank must issue
        the same collectives (all batches once) before any of them votes again."""
        opt = self.opt
        self.launch_all()
        for k, state in enumerate(self.launched):
            if state is not None:
                batch = opt._batches[k]
                opt._buckets[batch[0]].algorithm.received(state, [self.local[i].job for i in batch], opt._coll)
        self.reset()

    # ------------------------------------------------------------------ finish
    def finish(self, frozen_error: str | None):
        """Agree on the flags (the step's one host read) and complete every batch.

        Returns (flags list, this rank's input error or None); raises nothing itself: the caller
        decides."""
        opt = self.opt
        self.launch_all(carry_flags=True, frozen_error=frozen_error)
        if self.flags_carried:  # they came with the last batch's phase 1
            last = len(opt._batches) - 1
            algorithm = opt._buckets[opt._batches[last][0]].algorithm
            width = FLAG_HEAD + 2 * len(self.local)
            rows = algorithm.flag_rows(self.launched[last], width)
            return rows.sum(0, dtype=torch.int64).tolist(), self.carried_error  # the one host read of the step
        error = frozen_error or self.error
        flags = self._own_flags(error)
        opt._coll.all_reduce_(flags, "control")
        flags = flags.tolist()  # the one host read of the step
        return flags, error

    def _own_flags(self, error) -> torch.Tensor:
        """This rank's flag vector (int32, on the device; summed over ranks it is the step's flags)."""
        dev = self.opt._device
        # this rank's non-finite count, summed on the device; clamped so that the sum over ranks
        # cannot overflow int32 (the message says "at least")
        nonfinite = torch.stack([loc.nonfinite.to(dev) for loc in self.local] +
                                [torch.zeros((), dtype=torch.int64, device=dev)]).sum().clamp_(max=2**20)
        missing = int(any(loc.missing for loc in self.local))
        head = torch.stack([(nonfinite > 0).to(torch.int32), torch.full((), int(bool(error)), dtype=torch.int32,
                                                                        device=dev), nonfinite.to(torch.int32),
                            torch.full((), missing, dtype=torch.int32, device=dev)])
        return torch.cat([head] + [loc.flags.to(dev) for loc in self.local])

    def idle_everywhere(self, flags) -> list:
        """The voting parameters that have no gradient on ANY rank this step (Lion leaves such a
        parameter alone: no decay, no momentum change). Only when the flags say some rank lacks a
        gradient (agreed: every rank runs the same collective), one int32 per parameter is summed."""
        if flags[3] == 0:
            return []
        opt = self.opt
        params, have = [], []
        for i, loc in enumerate(self.local):
            b = opt._buckets[i]
            params += b.params
            have += [0 if k in loc.missing else 1 for k in range(len(b.params))]
        counts = torch.tensor(have, dtype=torch.int32, device=opt._device)
        opt._coll.all_reduce_(counts, "missing_grads")
        return [p for p, c in zip(params, counts.tolist()) if c == 0]

    def complete(self, flags) -> None:
        opt = self.opt
        coll = opt._coll
        received = []
        for k, state in enumerate(self.launched):
            batch = opt._batches[k]
            received.append(opt._buckets[batch[0]].algorithm.received(state, [self.local[i].job for i in batch], coll))
        step = opt._step_count + 1
        for k, batch in enumerate(opt._batches):
            for i, recv in zip(batch, received[k]):
                b, job = opt._buckets[i], self.local[i].job
                g = opt.param_groups[b.group_index]
                job.lr, job.weight_decay, job.step = lr_value(g["lr"]), g["weight_decay"], step
                if b.algorithm.encoding != "bits":
                    continue
                overflow, abstains = flags[FLAG_HEAD + 2 * i], flags[FLAG_HEAD + 1 + 2 * i]
                if abstains == 0:
                    job.planes = None
                elif job.mode == "list" and overflow > 0:  # some rank's list was too short: the planes
                    job.planes = coll.all_gather(job.nonzero, "abstain_planes")
                else:
                    job.planes = job.payloads_from(recv)
                # Many abstentions travel as the plane next step; few as a list (agreed: same on every rank).
                b.mode = "plane" if overflow > 0 else "list"
        counted = []
        for k, batch in enumerate(opt._batches):
            jobs = [self.local[i].job for i in batch]
            counted.append(opt._buckets[batch[0]].algorithm.count(self.launched[k], jobs, coll,
                                                                   self.local[batch[0]].backend))
        # The momenta do not depend on the vote: they advance while any phase 2 is in flight.
        for i, loc in enumerate(self.local):
            b = opt._buckets[i]
            if loc.next_momenta is not None:
                for p, m in zip(b.params, loc.next_momenta):
                    opt._commit_momentum(p, m)
            else:
                loc.backend.momentum_update_list(loc.momenta, loc.grads, opt.param_groups[b.group_index]["betas"][1])
            opt.stats.add_baseline(b.real_numel, opt.world_size)
        for k, batch in enumerate(opt._batches):
            jobs = [self.local[i].job for i in batch]
            opt._buckets[batch[0]].algorithm.complete(counted[k], jobs, coll, self.local[batch[0]].backend)
        self.reset()
