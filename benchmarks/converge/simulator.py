"""The simulated LionCub: N workers' Lion Cub step in one process, with LionCub's own math, layout
and byte accounting (bit-identical to real ranks: tests/test_converge.py)."""
from __future__ import annotations

import torch


def bbit_feedback(c: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Error feedback (a screening variant of the simulation; LionCub has no such setting: the
    long-horizon study found it harmful, docs/convergence.md), before quantizing: (v, voting) with v = fl(c + r) where c != 0 (a voting
    coordinate) and c elsewhere (an abstaining coordinate keeps its residual for later)."""
    voting = c != 0
    return torch.where(voting, c + residual.float(), c), voting


def bbit_residual(v, voting, codes, ratio, bits, residual):
    """Error feedback, after quantizing: the new residual fl(v - fl(q / ratio)) (q = 2k - Q; what
    this rank's codes did not carry) where it voted, the old residual elsewhere; a zero ratio sends 0."""
    from lioncub_ds.kernels import reference

    q = codes.float() * 2 - reference.bbit_qmax(bits)
    ratio = torch.as_tensor(ratio, dtype=torch.float32, device=q.device)
    good = ratio > 0
    sent = torch.where(good, q / torch.where(good, ratio, torch.ones_like(ratio)), torch.zeros_like(q))
    return torch.where(voting, v - sent, residual.float())


class SimLionCub:
    """N workers' Lion Cub step in one process, with LionCub's exact math and byte accounting.

    ``groups``: param groups as from ``GPT.optim_groups`` (``params``, ``names``,
    ``weight_decay``). The bucket layout (8-aligned offsets, buckets of at most
    ``bucket_numel`` elements per group, padded to a multiple of 8·N) is LionCub's, so the
    hash tie rule (index inside each parameter) and the abstention lists see the same buckets.

    ``node_size`` L > 1: node voters (``LionCub(voters="node", node_size=L)``). ``n`` is still
    the number of workers N (``step`` takes N gradients each); they form Nn = N/L groups of L
    consecutive workers, whose mean gradients (:meth:`node_means`) are the Nn voters'. The
    layout is the real step's: ``build_buckets(groups, bucket_numel, Nn·L)``, each bucket cut
    into L shards that vote separately (their abstention lists, modes and bytes); the hash tie
    index is the element's index inside its parameter, so for sign votes the cut does not change
    Δ. Only sign comms (1bit / allgather / pbit): the real int8 / bbit per-tensor scales are per
    (parameter ∩ shard) piece, which this simulation does not model.
    """

    SIGN_COMMS = ("1bit", "allgather", "pbit")

    def __init__(self, groups, n, *, lr, betas, vote="majority", comm="1bit", quant="sign", tie_break="hash",
                 momentum_sync=None, bucket_size_mb=25.0, vote_bits=None, rounding=None,
                 error_feedback=False, owner_ema=0.0, vote_every=1, node_size=1):
        from lioncub_ds.config import LionCubConfig
        from lioncub_ds.layout import build_buckets
        from lioncub_ds.momentum_sync import select_params

        node_kw = dict(voters="node", node_size=node_size) if node_size != 1 else {}
        cfg = LionCubConfig.from_kwargs(lr=lr, betas=betas, vote=vote, comm=comm, quant=quant, tie_break=tie_break,
                                        momentum_sync=momentum_sync, bucket_size_mb=bucket_size_mb,
                                        vote_bits=vote_bits, rounding=rounding, **node_kw)
        if comm not in ("1bit", "allgather", "pbit", "int8", "bbit"):
            raise ValueError(f"SimLionCub: comm={comm!r} (allowed: 1bit, allgather, pbit, int8, bbit)")
        if not isinstance(node_size, int) or node_size < 1 or n % node_size:
            raise ValueError(f"SimLionCub: node_size={node_size!r} must be an int >= 1 dividing the {n} workers")
        if node_size > 1 and (comm not in self.SIGN_COMMS or error_feedback or owner_ema or vote_every > 1):
            raise ValueError(f"SimLionCub: node voters (node_size={node_size}) are simulated with the sign comms only "
                             f"({', '.join(self.SIGN_COMMS)}; got comm={comm!r}), without the screening keys ef / "
                             "ema / vote_every: the real int8 / bbit per-tensor scales are per (parameter ∩ shard) "
                             "piece, which the simulation does not model")
        if node_size > 1 and cfg.momentum_sync is not None and (cfg.momentum_sync.layers or cfg.momentum_sync.drift):
            raise ValueError(f"SimLionCub: node voters (node_size={node_size}) are simulated with a momentum sync of "
                             "every shard on a fixed schedule; momentum_sync layers and schedule 'drift' (which "
                             "LionCub supports with node voters: a per-shard signal) are not modelled here")
        # self.n: the voters (Nn = N/L with node voters); self.workers: the N gradients of a step
        self.workers, self.node_size = n, node_size
        n = n // node_size
        self.cfg, self.n, self.comm = cfg, n, comm
        self.error_feedback, self.residual = error_feedback, {}
        self.owner_ema, self.owner_sums = owner_ema, {}
        self.vote_every, self.last_delta = vote_every, {}
        # momentum_sync schedule="drift": LionCub's own signal and decision (lioncub_ds.momentum_sync):
        # each worker's fraction of votes that disagree with the agreed Δ (where both are nonzero),
        # in fixed-point units, summed over the workers; the sync after step t is decided from step
        # t−1's sum (in LionCub it rides in step t's flags) by the same DriftTrigger
        from lioncub_ds.momentum_sync import DriftTrigger

        ms = cfg.momentum_sync
        self.trigger = (DriftTrigger(ms.threshold, ms.min_every, n)
                        if ms is not None and ms.drift else None)
        self.sync_steps = []  # the steps after which momenta were averaged
        from lioncub_ds.comm import make_algorithm

        self.algorithm = make_algorithm(comm, vote_bits=cfg.bbit[0], rounding=cfg.bbit[1], quant=cfg.quant)
        self.groups = [dict(g, lr=lr, betas=tuple(betas)) for g in groups]
        self.momenta = {}
        self.step_count = 0
        self.bytes_sent = 0     # inter-node bytes with node voters (the vote group's link)
        self.intra_bytes = 0    # node voters: the node group's reduce-scatter, all-gather and flags
        self.sync_bytes = 0
        self.alt_bytes = {}  # sign comms with the same Δ (1bit / allgather / pbit): what each would send
        # LionCub's own layout (lioncub_ds.layout); the abstention mode of each bucket (b.mode)
        # follows the same agreed rule, layout.next_abstain_mode
        # (node voters: the layout of Nn·L ranks, each bucket then cut into L shards, as the real step)
        self.buckets, _ = build_buckets(self.groups, cfg.bucket_numel, n * node_size)
        for g in self.groups:
            for p in g["params"]:
                self.momenta[p] = torch.zeros((n,) + tuple(p.shape), dtype=torch.float32, device=p.device)
        self.sync_params = []
        if cfg.momentum_sync is not None and node_size == 1:
            named = [(nm, p) for g in self.groups for nm, p in zip(g["names"], g["params"])]
            self.sync_params = select_params(cfg.momentum_sync, named)

    @property
    def param_groups(self):
        return self.groups

    def _collective_bytes(self, kind, nbytes):
        from lioncub_ds.telemetry import ring_bytes

        return ring_bytes(kind, nbytes, self.n)

    def node_means(self, grads):
        """The Nn voters' gradients from the N workers': per group of L consecutive workers,
        (g_0 + g_1 + ... + g_{L−1}) / L in fp32, one add at a time in worker order, as the real
        step's intra-node reduce-scatter (sharding.NodeVoters.begin)."""
        L = self.node_size
        out = {}
        for p, g in grads.items():
            rows = g.reshape((self.n, L) + tuple(g.shape[1:])).float()
            acc = rows[:, 0].clone()
            for k in range(1, L):
                acc.add_(rows[:, k])
            out[p] = acc.div_(L)
        return out

    def _node_bytes(self):
        """Intra-node bytes one rank sends per step (node voters): the real step's
        (:func:`lioncub_ds.sharding.node_group_bytes`; gradients and parameters in the parameters' dtype)."""
        from lioncub_ds.sharding import node_group_bytes

        return node_group_bytes([(b.numel, b.params[0].element_size(), b.params[0].element_size())
                                 for b in self.buckets], self.node_size)

    @torch.no_grad()
    def step(self, grads):
        """``grads``: dict param -> [N, *shape] per-worker gradients (N workers: with node voters
        the Nn·L workers, averaged per group here). Returns the (inter-node) bytes sent."""
        if self.node_size > 1:
            grads = self.node_means(grads)
            self.intra_bytes += self._node_bytes()
        from lioncub_ds.kernels import reference
        from lioncub_ds.momentum_sync import disagreement_units, drift_due, on_schedule, vote_disagreement

        from lioncub_ds.comm import make_algorithm
        from lioncub_ds.comm.abstain import list_capacity, plane_source, real_mask, summed_flags
        from lioncub_ds.layout import next_abstain_mode
        from lioncub_ds.flags import flag_bytes

        cfg, n = self.cfg, self.n
        step = self.step_count + 1
        # the control flags (int32, flags.flag_bytes): carried in the first phase of 1bit /
        # allgather (LionCub without overlap), else their own all-reduce
        drift = self.trigger is not None  # one more flag word: the previous step's disagreement
        control = {name: flag_bytes(len(self.buckets), n, not cfg.overlap and make_algorithm(name).carries_flags,
                                    drift)
                   for name in ("allgather", "pbit", "1bit", "int8", "bbit")}
        voting = self.vote_every <= 1 or (step - 1) % self.vote_every == 0 or not self.last_delta
        if not voting:
            control = {k: flag_bytes(len(self.buckets), n, False, drift) for k in control}
        sent = control[self.comm]
        disagree = torch.zeros(n, 2, dtype=torch.int64)  # per worker [disagree, both] (drift)
        if self.comm not in ("int8", "bbit"):  # bytes_if: the sign comms, each with its own way of sending the flags
            for k in ("allgather", "pbit", "1bit"):
                self.alt_bytes[k] = self.alt_bytes.get(k, 0) + control[k] - control[self.comm]
        for bi, bucket in enumerate(self.buckets):
            gi, params, offsets, total = bucket.group_index, bucket.params, bucket.offsets, bucket.numel
            g = self.groups[gi]
            b1, b2 = g["betas"]
            lr, wd = g["lr"], g["weight_decay"]
            dev = params[0].device
            if self.vote_every > 1 and (step - 1) % self.vote_every != 0 and bi in self.last_delta:
                delta = self.last_delta[bi]  # no vote this step: the last agreed Δ again
            elif self.comm == "int8":
                levels = reference.int8_levels(n)
                qsum = torch.zeros(total, dtype=torch.int32, device=dev)
                for p, off in zip(params, offsets):
                    c = reference.lion_direction(self.momenta[p].reshape(n, -1), grads[p].reshape(n, -1), b1)
                    if not bool(torch.isfinite(c).all()):
                        raise FloatingPointError("SimLionCub: non-finite c (the real LionCub would skip the step)")
                    # per worker: the per-tensor scale is a reduction over that worker's c (one batched call)
                    for i, a in enumerate(reference.scale_rows(c, cfg.quant)):
                        q = reference.int8_quantize(c[i], a, levels)
                        qsum[off:off + p.numel()] += q.to(torch.int32)
                delta = torch.sign(qsum).float()
                sent += self._collective_bytes("all_reduce", total)
            else:
                c = torch.zeros((n, total), dtype=torch.float32, device=dev)
                for p, off in zip(params, offsets):
                    c[:, off:off + p.numel()] = reference.lion_direction(self.momenta[p].reshape(n, -1),
                                                                     grads[p].reshape(n, -1), b1)
                if not bool(torch.isfinite(c).all()):
                    raise FloatingPointError("SimLionCub: non-finite c (the real LionCub would skip the step)")
                # Abstentions travel as LionCub's (comm/abstain.py, encode): per worker, in list mode
                # the bytes of its nonzero plane that differ from the bucket's mask (a list of
                # capacity K), in chunks mode one bit per 8-byte chunk that abstains whole and a list
                # of the bytes that differ from the mask with those chunks cleared, else the plane.
                # The two flag entries per worker (list mode: [list overflows, abstains]; chunks and
                # plane: [a list would overflow, the chunk list overflows]) are summed over every
                # rank, and decide this step's source of the planes and the next step's mode. Node
                # voters: each of the L shards of the bucket is a bucket of the real step (the same
                # whole-byte slices of the planes and the mask), every shard in the agreed mode.
                shard = total // self.node_size
                mask = real_mask(offsets, [p.numel() for p in params], total, dev).view(self.node_size, -1)
                planes = [reference.pack_bits(c[i] != 0).view(self.node_size, -1) for i in range(n)]
                capacity = list_capacity(shard // 8, n)
                mode = bucket.mode
                first = second = 0
                for k in range(self.node_size):  # each shard's flags, summed over every rank as the step's are
                    f, s2 = summed_flags((plane[k] for plane in planes), mask[k], mode, capacity, n, reference)
                    first, second = first + f, second + s2
                abstain = second > 0 if mode == "list" else True  # chunks / plane: the planes always count
                segs = reference.tie_segments(offsets)
                # a list or chunk list that overflows fetches the planes once more (each algorithm's
                # way: whole planes all-gathered, or shards all-to-all'd), counted in its wire_bytes
                refetch = plane_source(mode, first, second) == "fetch"
                if self.comm == "bbit":
                    delta = self._bbit_delta(c, params, offsets, step, abstain, segs)
                    by = {"bbit": self.algorithm.wire_bytes(total, n, mode=mode, tie_break=cfg.tie_break,
                                                            abstain=abstain, overflow=refetch)}
                else:
                    plus = (c > 0).sum(0, dtype=torch.int32)
                    cnt = (c != 0).sum(0, dtype=torch.int32) if abstain else torch.full_like(plus, n)
                    delta = reference.decide(plus, cnt, n, cfg.vote, cfg.tie_break, step, segs)
                    if drift:  # each worker's packed votes against Δ, as LionCub counts them
                        disagree += vote_disagreement(reference.pack_bits((c > 0).reshape(-1)).view(n, -1),
                                                      reference.pack_bits((c != 0).reshape(-1)).view(n, -1),
                                                      delta).cpu()
                    # this rank's shard (every shard has the same size, mode and flags: the same bytes)
                    by = {name: make_algorithm(name).wire_bytes(shard, n, mode=mode, vote=cfg.vote,
                                                                tie_break=cfg.tie_break, abstain=abstain,
                                                                overflow=refetch)
                          for name in ("allgather", "pbit", "1bit")}
                bucket.mode = next_abstain_mode(mode, first, second)
                sent += by[self.comm]
                for k, v in by.items():
                    self.alt_bytes[k] = self.alt_bytes.get(k, 0) + v - by[self.comm]
            self.last_delta[bi] = delta
            reference.apply_update(params, offsets, delta, lr, wd)
            for p in params:
                reference.momentum_update(self.momenta[p], grads[p], b2)
        self.step_count = step
        ms = cfg.momentum_sync
        if ms is not None and (on_schedule(ms, step - 1) if not drift else drift_due(ms, self.trigger, step - 1)):
            sync = self._sync_momenta() if self.node_size == 1 else self._sync_node_momenta()
            sent += sync
            self.sync_bytes += sync
            self.sync_steps.append(step)
            if drift:
                self.trigger.synced(step)
        if drift:  # step's signal: LionCub reads it with the next step's flags
            self.trigger.observe(step, int(disagreement_units(disagree, n).sum()))
        if n <= 1:
            sent = 0  # one voter (flat N = 1, or Nn = 1): its vote group sends nothing (telemetry's ring model)
        self.bytes_sent += sent
        return sent

    def _bbit_delta(self, c, params, offsets, step, abstain, segs):
        """Δ of comm="bbit" over a bucket's c [N, total]: each worker's b-bit codes (its own
        per-tensor scale and dither stream), summed over the voters, sign and tie rule."""
        from lioncub_ds.kernels import reference

        n, cfg = self.n, self.cfg
        bits, rounding = cfg.bbit
        codes = torch.zeros(c.shape, dtype=torch.uint8, device=c.device)
        seeds = torch.tensor([[reference.dither_seed(step, i)] for i in range(n)], dtype=torch.int64, device=c.device)
        for p, off in zip(params, offsets):  # every worker at once: its own scale (a row) and stream
            cp = c[:, off:off + p.numel()]
            if self.error_feedback:  # quantize c + the residual of earlier steps; keep what was not sent
                res = self.residual.setdefault(p, torch.zeros_like(cp))
                cp, voting = bbit_feedback(cp, res)
            ratio = reference.bbit_ratio_rows(cp, cfg.quant, bits)
            idx = torch.arange(p.numel(), dtype=torch.int64, device=c.device).view(1, -1)
            u = reference.dither_uniform(seeds, idx) if rounding == "dither" else None
            k = reference.bbit_codes(cp, ratio, bits, rounding, u)
            codes[:, off:off + p.numel()] = k
            if self.error_feedback:
                res.copy_(bbit_residual(cp, voting, k, ratio, bits, res))
        nz = (c != 0) if abstain else None
        qsum = reference.bbit_sum(codes, nz, bits)
        if self.owner_ema:  # the shard owner's running sum: s <- γ·s + Σq, Δ = sign(s)
            key = (offsets[0], c.shape[1], id(params[0]))
            acc = self.owner_sums.setdefault(key, torch.zeros(c.shape[1], dtype=torch.float32, device=c.device))
            acc.mul_(self.owner_ema).add_(qsum.float())
            qsum = torch.sign(acc).to(torch.int32)
        return reference.decide_sum(qsum, None if nz is None else nz.any(0), cfg.tie_break, step, segs)

    def bytes_if(self, comm):
        """Bytes sent so far had every vote used ``comm`` (same Δ: 1bit / allgather / pbit, majority)."""
        return self.bytes_sent + self.alt_bytes.get(comm, 0)

    def _sync_node_momenta(self):
        """Node voters' momentum sync as the real step's (StepPlan._synced_momenta): every momentum
        shard (bucket order, padding included) averaged over the Nn shard peers, chunked like
        MomentumSync.average_over; shard k of every bucket on the ranks of local rank k."""
        from lioncub_ds.momentum_sync import quantized_average, sync_wire_bytes

        n, L, dtype = self.n, self.node_size, self.cfg.momentum_sync.dtype
        if n <= 1:
            return 0
        flats = []  # per bucket: the voters' flat momenta [Nn, numel] (zero in gaps and padding)
        for b in self.buckets:
            flat = torch.zeros((n, b.numel), dtype=torch.float32, device=b.params[0].device)
            for p, off in zip(b.params, b.offsets):
                flat[:, off:off + p.numel()] = self.momenta[p].reshape(n, -1)
            flats.append(flat)
        sent = 0
        for k in range(L):
            shards = [f[:, k * (f.shape[1] // L):(k + 1) * (f.shape[1] // L)] for f in flats]
            chunk, size = [], 0
            for t in shards + [None]:
                if t is not None and (size + t.shape[1] <= self.cfg.bucket_numel or not chunk):
                    chunk.append(t)
                    size += t.shape[1]
                    continue
                rows = torch.cat(chunk, dim=1)
                if k == 0:
                    sent += sync_wire_bytes(size, n, dtype)  # this rank's (local rank 0's) shards
                mean = rows.sum(0) / n if dtype == "fp32" else quantized_average(rows, dtype)
                off = 0
                for q in chunk:
                    q.copy_(mean[off:off + q.shape[1]].expand_as(q))
                    off += q.shape[1]
                chunk, size = ([t], t.shape[1]) if t is not None else ([], 0)
        for b, flat in zip(self.buckets, flats):
            for p, off in zip(b.params, b.offsets):
                self.momenta[p].copy_(flat[:, off:off + p.numel()].reshape(self.momenta[p].shape))
        return sent

    def _sync_momenta(self):
        """Average the selected momenta over the workers as LionCub does (MomentumSync.average_over):
        the same chunks; fp32: sum then divide; bf16 / int8: the two-phase average, bit for bit."""
        from lioncub_ds.momentum_sync import quantized_average, sync_wire_bytes

        if not self.sync_params or self.n <= 1:
            return 0
        n, dtype = self.n, self.cfg.momentum_sync.dtype
        chunk_numel = self.cfg.bucket_numel
        sent, chunk, size = 0, [], 0
        for p in self.sync_params + [None]:  # the same chunking as MomentumSync.average_over
            if p is not None and (size + p.numel() <= chunk_numel or not chunk):
                chunk.append(p)
                size += p.numel()
                continue
            rows = torch.cat([self.momenta[q].reshape(n, -1) for q in chunk], dim=1)
            sent += sync_wire_bytes(size, n, dtype)
            mean = rows.sum(0) / n if dtype == "fp32" else quantized_average(rows, dtype)
            off = 0
            for q in chunk:
                self.momenta[q].copy_(mean[off:off + q.numel()].view(q.shape).expand_as(self.momenta[q]))
                off += q.numel()
            chunk, size = ([p], p.numel()) if p is not None else ([], 0)
        return sent
