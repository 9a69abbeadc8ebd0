"""The distributed step and its one owner, :class:`StepPlan`.

A plan is built from the optimizer's settings and parameter groups and from the process-group
topology (:class:`lioncub_ds.groups.Topology`); it holds everything fixed from one step to
the next: ONE sharding strategy, chosen at construction (flat, master-only or node voters:
:mod:`lioncub_ds.sharding`, which says what the step votes on, what its inputs are, what is
kept and how it finishes; the plan never asks which one it holds), the bucket layout
(:mod:`lioncub_ds.layout`), the communication batches, where the step's flags travel, the
gradient-ready hooks and the momentum-sync scope. The optimizer keeps
the settings, the state (its momenta behind a small store: get / next / commit) and the public
API; the plan reads nothing private of it.

Like torch DDP's reducer, parameter buckets are grouped into communication batches (one
collective per phase for a whole batch, sized by ``comm_bucket_mb`` of packed votes), and a
batch is launched asynchronously as soon as every bucket in it has its local step (signs).
Batches launch in one fixed order on every rank (last parameters first: backward produces
their gradients first), so every rank issues the same collectives in the same order, whenever
each becomes ready. With ``overlap=True`` the local steps run from gradient-ready hooks during
backward (node voters: the hooks issue the node group's reduce-scatters, and the local steps
follow one bucket behind, :meth:`lioncub_ds.sharding.NodeVoters.take`); otherwise at the start
of ``step()``. ``finish`` then sums the step's flag vector
over the vote group: every rank's flags ride in the last batch's first-phase message when that
algorithm sends every rank's message to every rank (1bit, allgather) and the launch happens in
``step()``; otherwise one small all-reduce agrees on them. The sharding sums them over the
rest of the step's ranks on the device (node voters: the node group), and the plan reads them
once: the step's one host read. ``complete`` counts the votes, runs
the momentum update while any second phase is in flight, and applies. Nothing changes
optimizer state before the flags are agreed: a skipped step is free.

Decisions that must be the same on every rank are taken from the summed flags, never from a
rank's own view: skipping (non-finite values), refusing (unusable inputs, hyper-parameters
that differ across ranks), voting again (gradients changed after their vote in backward).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import kernels
from .agreement import agree_settings
from .comm import BucketKernels, Collectives, VoteJob
from .config import LionCubConfigError
from .errors import ReplicaDriftError, StepInputError
from .flags import (CHANGED_RANKS, FLAG_HEAD, MISSING_RANKS, NONFINITE_RANKS, NONFINITE_VALUES, UNUSABLE_RANKS,
                    drift_index, flag_words, host_values_on, hyper_bits, hyper_disagree, hyper_values, pack_flags,
                    unpack_flags)
from .kernels.reference import dither_seed
from .layout import assign_algorithms, comm_batches, cost_model, group_names
from .lion import count_steps
from .momentum_sync import MomentumSync, disagreement_units, drift_scale, select_params, vote_disagreement
from .sharding import GradRead, make_sharding, reads_changed, replicas_differ

log = logging.getLogger("lioncub_ds")


@dataclass
class StepOutcome:
    applied: bool
    message: str = ""   # why the step was skipped (non-finite values), for the optimizer's warning or error


class StepPlan:
    """The distributed step of one LionCub: layout, batches, hooks, flags, momentum sync.

    ``opt`` is read through its public API only (``config``, ``param_groups``, ``state``,
    ``step_count``, ``stats``, ``momenta``, ``overlap_counts``, ``momentum_sync_state``: taken
    once, when the plan is built); ``may_launch()`` says whether
    a gradient-ready hook may start votes now (``no_sync()`` and the launch condition)."""

    def __init__(self, opt, topology, may_launch=None):
        cfg = opt.config
        self.opt, self.config, self.topology = opt, cfg, topology
        # the voters: N ranks, or with node voters Nn node groups (this rank votes for its group's shard)
        self.world_size, self.rank = topology.world_size, topology.rank
        self.ranks = topology.ranks   # every rank of the step (Nn·L)
        # The one place the sharding mode enters: flat, master-only or node voters (lioncub_ds.sharding),
        # chosen once from the topology; the plan asks it the same things whichever it is.
        self.sharding = make_sharding(opt, topology)
        self.buckets, self.frozen = self.sharding.buckets, self.sharding.frozen
        # the parameter groups the layout was built from: one added later (add_param_group) joins
        # the layout only once every rank of the step has agreed on it (run, _agree_late_groups)
        self.n_groups = len(opt.param_groups)
        self.coll, self.world_coll = self.sharding.coll, self.sharding.world_coll
        assign_algorithms(self.buckets, cfg, self.world_size)
        self.batches = comm_batches(self.buckets, cfg.comm_bucket_mb, self.world_size)
        self.sharding.launch_order([i for batch in self.batches for i in batch])
        # The step's flags ride in the last batch's phase 1 when its algorithm delivers every
        # rank's message to every rank, and when nothing can be launched before step() knows every
        # input problem (overlap launches during backward: a separate flag all-reduce then).
        self.carry_flags = (not cfg.overlap and bool(self.buckets)
                            and self.buckets[self.batches[-1][0]].algorithm.carries_flags)
        self.device = next((p.device for g in opt.param_groups for p in g["params"]), torch.device("cpu"))
        self.msync, self.sync_params = None, []
        ms = cfg.momentum_sync
        # momentum_sync schedule="drift": this rank's vote disagreement with the last applied Δ
        # (int32 [1] on the device, disagreement_units) and that step's number; it rides in the
        # next step's flags (momentum_sync module docstring)
        self.drift = ms is not None and ms.drift
        self.drift_units, self.drift_step = None, 0
        # (drift) D(drift_step) when the host knows the sum over the ranks already (a checkpoint of
        # one replica for every rank, or sync_momenta(all_params=True)): the next step observes it
        # instead of the flags' sum (the same value where both exist)
        self.drift_sum = None
        self.syncs, self.last_sync = 0, 0
        if ms is not None:
            node = (Collectives(topology.sync_node_group, opt.stats, cfg.timeout_s)
                    if topology.sync_node_group is not None else None)
            self.msync = MomentumSync(ms, self.coll, node, topology.ranks)
            named = [(nm, p) for g in opt.param_groups for p, nm in zip(g["params"], group_names(g))
                     if p.requires_grad]
            self.sync_params = select_params(ms, named)
            if opt.momentum_sync_state is not None:  # loaded (load_state_dict) before this plan was built
                self.load_momentum_sync_state(opt.momentum_sync_state)
                opt.momentum_sync_state = None
        self.pipe = VotePipeline(self)
        self.may_launch = may_launch
        self.hooks = []
        if cfg.overlap:  # on the real parameters (node voters vote on shards of them)
            for i, b in enumerate(self.sharding.full):
                for p in b.params:
                    self.hooks.append(p.register_post_accumulate_grad_hook(lambda q, i=i: self._grad_ready(i, q)))
        self.warned_revote = False

    def close(self) -> None:
        """Remove the hooks (the layout is being dropped: new parameters or new groups)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []

    def _grad_ready(self, i, p):
        if self.may_launch is None or self.may_launch():
            self.pipe.grad_ready(i, p)

    def describe(self) -> list[dict]:
        """Per bucket: size, algorithm, and predicted/formula wire bytes per rank."""
        n, cfg = self.world_size, self.config
        cost = cost_model(cfg)
        return [{"bucket": i, "group": b.group_index, "numel": b.real_numel, "padded_numel": b.numel,
                 "algorithm": b.algorithm.name,
                 "wire_bytes": b.algorithm.wire_bytes(b.numel, n, mode=b.mode, vote=cfg.vote, tie_break=cfg.tie_break),
                 "predicted_s": cost.predict(b.algorithm.name, b.real_numel, n, vote=cfg.vote,
                                             tie_break=cfg.tie_break, pbit_bits=cfg.pbit_bits)}
                for i, b in enumerate(self.buckets)]

    def params(self) -> list:
        """The voting parameters (the real ones, also where the plan votes on shards)."""
        return [p for b in self.sharding.full for p in b.params]

    def _abandon(self) -> None:
        """Forget this step's votes and buffers (a skipped or refused step changes nothing)."""
        self.pipe.drain()
        self.sharding.abandon()
        self.opt.stats.end_step()

    def _agreed_flags(self, frozen_error: str | None, changed):
        """The step's flags summed over every rank of the step, as a host list (the step's one host
        read), and this rank's input error."""
        words, input_error = self.pipe.finish(frozen_error, changed)
        words = self.sharding.agree(words).tolist()  # the one host read of the step
        return unpack_flags(words, len(self.buckets), self.ranks, self.drift), input_error

    # ------------------------------------------------------------------ the step
    def _frozen_param_error(self) -> str | None:
        """This rank's reason to refuse the step, or None (agreed through the flags before raising)."""
        for p, name in self.frozen:
            if p.grad is not None:
                return (f"LionCub: parameter {name or tuple(p.shape)} had requires_grad=False at the first step (so it "
                        "has no place in the vote buckets) but now has a gradient on this rank; set requires_grad "
                        "before the first step, or clear its .grad")
        return None

    def _late_groups(self) -> str | None:
        """This rank's reason to hold the step: parameter groups added (add_param_group) since the
        layout was built. The step still runs the layout's collectives, so a rank that added a
        group and one that did not reach the flags together; the flags then say "unusable input"
        and every rank compares the groups (:meth:`_agree_late_groups`)."""
        added = len(self.opt.param_groups) - self.n_groups
        if added == 0:
            return None
        return f"LionCub: {added} parameter group(s) added with add_param_group since the step plan was built"

    def _agree_late_groups(self, step: int) -> bool:
        """On every rank, when the flags say that some rank found an unusable input: whether some
        rank holds parameter groups its layout lacks (one int64 all-reduce over every rank of the
        step, on this error path only). If one does, every rank forgets the step's votes and
        compares its parameter groups with the ranks that hold the same parameters
        (:func:`lioncub_ds.agreement.agree_settings`: a group missing on some rank, or with other
        parameters, raises the same LionCubConfigError on every rank, nothing changed); if they
        agree, every rank rebuilds its layout with them and the step runs again (True)."""
        late = torch.tensor([int(self._late_groups() is not None)], dtype=torch.int64, device=self.device)
        self.world_coll.all_reduce_(late, "late_groups")
        if late.item() == 0:  # a host read on the error path only
            return False
        self.pipe.drain()
        self.sharding.abandon()
        try:
            agree_settings(self.config, self.opt.param_groups, group=self.sharding.replicas().group,
                           device=self.device,
                           what=(f"the parameter groups differ across the ranks at step {step} (add_param_group "
                                 "called on some ranks only, or with other parameters or settings)",
                                 "allowed: the same add_param_group calls on every rank; every rank raises this, no "
                                 "state was changed"))
        except LionCubConfigError:
            self.opt.stats.end_step()
            raise
        self._rebuild()
        return True

    def _rebuild(self) -> None:
        """The layout again, from every parameter group (agreed: _agree_late_groups). What lasts
        from one layout to the next stays: the momentum sync's counters and drift state, the
        warning already given; sharded state is kept by bucket index (buckets are cut group by
        group: the new groups' buckets come after the others, which are unchanged)."""
        keep = {k: getattr(self, k) for k in ("syncs", "last_sync", "drift_units", "drift_step", "drift_sum",
                                              "warned_revote")}
        trigger = self.msync.trigger if self.msync is not None else None
        by_bucket = self.sharding.holds_shards  # momentum / master shards kept by bucket index
        before = [[id(p) for p in b.params] for b in self.sharding.full]
        self.close()
        self.__init__(self.opt, self.topology, self.may_launch)
        self.__dict__.update(keep)
        if trigger is not None:
            self.msync.trigger = trigger
        if by_bucket and [[id(p) for p in b.params] for b in self.sharding.full][:len(before)] != before:
            # a parameter frozen (or unfrozen) since the last layout moved the old groups' buckets:
            # their kept shards would be stepped as other parameters' (same on every rank)
            raise LionCubConfigError(
                "LionCub: a parameter frozen or unfrozen since the first step changed the buckets of the existing "
                "param groups, and with voters='node' / node_size the momentum (and master) shards are kept by "
                "bucket; allowed: add param groups only while the existing groups' trainable parameters stay as "
                "they were at the first step (freeze before the first step), or voters='rank' without node_size; "
                "no parameter or momentum was changed")

    def run(self, step: int) -> StepOutcome:
        """Step ``step`` (the optimizer's step count + 1) on every rank: the votes, the agreed
        flags, then apply, the momentum update and the momentum sync. Raises StepInputError on
        every rank together; returns whether the step was applied (else skipped, unchanged)."""
        opt, pipe, n = self.opt, self.pipe, self.ranks
        frozen_error = self._frozen_param_error() or self._late_groups()
        self.sharding.begin()
        # A gradient changed after its bucket voted (or, with node voters, was reduce-scattered)
        # during backward (a second backward without no_sync(), or clipping in place, also through
        # .data, maybe on some ranks only): this rank's view goes into the flags (a fingerprint's
        # verdict stays on the device), and if any rank saw a change every rank votes again (node
        # voters: reduce-scatter again first).
        changed = True if pipe.stale else pipe.changed_since_vote() if pipe.busy else False
        flags, input_error = self._agreed_flags(frozen_error, changed)
        if flags[CHANGED_RANKS] > 0:
            if not self.warned_revote:
                log.warning("LionCub(overlap=True): gradients changed after backward started their votes on %d of %d "
                            "ranks (a second backward without opt.no_sync(), in-place clipping, or zero_grad() after "
                            "backward); voting again in step(), on every rank", flags[CHANGED_RANKS], n)
                self.warned_revote = True
            opt.overlap_counts["revotes"] += 1
            pipe.drain()
            self.sharding.begin()
            flags, input_error = self._agreed_flags(frozen_error, False)
        if flags[UNUSABLE_RANKS] > 0:
            if self._agree_late_groups(step):
                return self.run(step)  # every rank, with the groups added on every rank
            self._abandon()
            raise StepInputError(
                (input_error + "; " if input_error else "LionCub: ") +
                f"{flags[UNUSABLE_RANKS]} of {n} ranks found an unusable input at step {step}; every rank raises "
                "this, no state was changed")
        if hyper_disagree(flags, n):
            self._abandon()
            raise StepInputError(self._hyper_mismatch(step))
        if flags[NONFINITE_RANKS] > 0:
            self._abandon()
            count = f"{flags[NONFINITE_VALUES]}{'+' if flags[NONFINITE_VALUES] >= 2**20 else ''}"
            return StepOutcome(False, f"non-finite gradient or momentum on {flags[NONFINITE_RANKS]} of {n} ranks at "
                                      f"step {step} (non-finite values in all: {count})")
        if self.drift and self.drift_step == step - 1 > 0:
            # the summed disagreement of the previous applied step, read with this step's flags
            # (or known already: drift_sum): it decides this step's sync (below), the same on every rank
            self.msync.trigger.observe(step - 1, flags[drift_index(len(self.buckets))] if self.drift_sum is None
                                       else self.drift_sum)
        # Parameters without a gradient on every rank stay as they are (as in Lion): their votes
        # (c = β1·m, from g = 0) ran with everyone else's and are undone here.
        idle = pipe.idle_everywhere(flags)
        kept = self.sharding.keep(idle)
        pipe.complete(flags, step)
        kept.restore_pieces()  # before the all-gathers: the shards carry the old values
        self.sharding.finish()  # sharded state: the group all-gathers the updated shards into the parameters
        kept.restore_params(opt.momenta)
        idle_ids = {id(p) for p in idle}
        count_steps([st for st in (opt.state[p] for p in self.params() if id(p) not in idle_ids) if "step" in st])
        if self.msync is not None:
            where = self.msync.scope(step - 1)  # drift: from the previous step's signal (observed above)
            if where is not None:
                MomentumSync.average_over(where, self.sharding.synced_momenta(self.sync_params), self.config.bucket_numel,
                                          self.config.momentum_sync.dtype)
                self.syncs, self.last_sync = self.syncs + 1, step
                if self.drift:
                    self.msync.trigger.synced(step)
        opt.stats.end_step()
        return StepOutcome(True)

    def momentum_sync_stats(self) -> dict | None:
        """The momentum sync so far (host values, no read): syncs run, the last one's step, and with
        schedule="drift" the latest signal and its baseline as mean fractions over the ranks."""
        if self.msync is None:
            return None
        out = {"schedule": self.config.momentum_sync.schedule, "syncs": self.syncs, "last_sync_step": self.last_sync}
        if self.drift:
            trig, unit = self.msync.trigger, self.ranks * drift_scale(self.ranks)
            out["signal_step"] = None if trig.signal is None else trig.signal[0]
            out["signal"] = None if trig.signal is None else trig.signal[1] / unit
            out["baseline"] = None if trig.baseline is None else trig.baseline / unit
        return out

    def momentum_sync_state(self) -> dict | None:
        """The momentum sync's state for a checkpoint (momentum_sync.check_sync_state says what it
        holds), or None without a momentum sync. Reads this rank's pending drift units from the
        device: one host read, when a checkpoint is made (never in a step)."""
        if self.msync is None:
            return None
        pending = None
        if self.drift and self.drift_step > 0:
            if self.drift_sum is not None:
                pending = {"step": self.drift_step, "sum": int(self.drift_sum)}
            elif self.drift_units is not None:
                pending = {"step": self.drift_step, "units": int(self.drift_units.item())}
        return {"syncs": self.syncs, "last_sync": self.last_sync,
                "trigger": self.msync.trigger.state_dict() if self.drift else None, "pending": pending}

    def load_momentum_sync_state(self, state: dict | None) -> None:
        """Resume the momentum sync from :meth:`momentum_sync_state` (checked by
        momentum_sync.check_sync_state); what does not apply to this schedule is ignored."""
        if self.msync is None or state is None:
            return
        self.syncs, self.last_sync = state["syncs"], state["last_sync"]
        if not self.drift:
            return
        if state["trigger"] is not None:
            self.msync.trigger.load_state_dict(state["trigger"])
        pending = state["pending"] or {}
        self.drift_step = pending.get("step", 0)
        self.drift_sum = pending.get("sum")
        units = pending.get("units")
        self.drift_units = None if units is None else torch.tensor([units], dtype=torch.int32, device=self.device)

    def _hyper_mismatch(self, step: int) -> str:
        """The error message for hyper-parameters that differ across ranks: gathers every rank's
        values (only on this error path, which every rank takes together)."""
        mine = hyper_values(self.opt.param_groups)
        every = [None] * self.ranks
        dist.all_gather_object(every, mine, group=self.world_coll.group)
        lines = []
        for gi in range(len(mine)):
            for k, what in enumerate(("lr", "weight_decay", "betas")):
                vals = [r[gi][k] if gi < len(r) else None for r in every]
                if len(set(vals)) > 1:
                    lines.append(f"{what} of param group {gi}: " + ", ".join(f"rank {r}: {v!r}" for r, v in
                                                                             enumerate(vals)))
        if len({len(r) for r in every}) > 1:
            lines.append("param groups: " + ", ".join(f"rank {r}: {len(v)}" for r, v in enumerate(every)))
        detail = "; ".join(lines) or "(the values' hashes differ)"
        return (f"LionCub: the hyper-parameters differ across ranks at step {step}: {detail}; allowed: the same "
                "values on every rank (a scheduler must step alike everywhere); every rank raises this, no state "
                "was changed")

    # ------------------------------------------------------------------ other collective services
    def sync_momenta(self, scope: str) -> None:
        dtype = self.config.momentum_sync.dtype if self.config.momentum_sync is not None else "fp32"
        if self.msync is not None:
            coll = self.msync.world if scope == "world" else self.msync.node
            MomentumSync.average_over(coll, self.sharding.synced_momenta(self.sync_params), self.config.bucket_numel,
                                      dtype)
        else:
            MomentumSync.average_over(self.coll, self.sharding.momenta(), self.config.bucket_numel, dtype)

    def average_all_momenta(self) -> None:
        """Every momentum averaged (fp32) over the vote group: what a checkpoint that keeps one
        replica for every rank needs (e.g. Megatron's). With schedule="drift" the pending signal
        is summed over the ranks of the step as well (one int64 all-reduce), so that the replica
        holds D(t) itself, not one rank's share of it (momentum_sync_state)."""
        MomentumSync.average_over(self.coll, self.sharding.momenta(), self.config.bucket_numel)
        if self.drift and self.drift_units is not None and self.drift_sum is None:
            summed = self.drift_units.to(torch.int64)
            self.world_coll.all_reduce_(summed, "drift_signal")
            self.drift_sum = int(summed.item())  # outside the step: a checkpoint is being made

    def check_replicas(self, action: str, step: int) -> bool:
        params = self.params()
        names = [nm for b in self.sharding.full for nm in b.names]
        # the ranks that hold what this rank steps, value for value (Megatron's instances: the
        # shard peers); the verdict is every rank's (each raises or re-synchronizes together)
        replicas = self.sharding.replicas()
        differs = replicas_differ(params, self.device,
                                  lambda t: replicas.all_reduce_(t, "drift_check", op=dist.ReduceOp.MAX))
        if not self.sharding.agree_found(bool(differs.any())):
            return True
        idx = differs.nonzero().reshape(-1).tolist()
        labels = [names[i] or f"param #{i} (shape {tuple(params[i].shape)})" for i in idx[:5]]
        msg = (f"LionCub: parameters differ across the {replicas.world_size} ranks at step {step}: "
               f"{', '.join(labels) or '(on the shards of other ranks)'}" +
               (f" and {len(idx) - 5} more" if len(idx) > 5 else ""))
        if action == "resync":
            log.warning("%s; re-synchronizing every parameter from rank 0", msg)
            for p in params:
                if p.is_contiguous():
                    replicas.broadcast_(p.data, 0, "drift_resync")
                else:  # a broadcast sends raw memory: go through a contiguous copy of the view
                    buf = p.detach().contiguous()
                    replicas.broadcast_(buf, 0, "drift_resync")
                    p.data.copy_(buf)
            # state derived from the parameters (fp32 master shards of 16-bit parameters) follows them
            self.sharding.after_resync()
            return False
        raise ReplicaDriftError(msg)


class _Local:
    """One bucket's local half of a step (nothing written to optimizer state)."""
    __slots__ = ("job", "grads", "momenta", "backend", "nonfinite", "flags", "read", "next_momenta", "missing")

    def __init__(self, job, grads, momenta, backend, nonfinite, flags, read, next_momenta=None, missing=()):
        self.job, self.grads, self.momenta, self.backend = job, grads, momenta, backend
        # indices (in the bucket) of the parameters without a gradient on this rank
        self.missing = tuple(missing)
        # the gradients it read (sharding.GradRead; None: a rank that cannot vote sends zeros)
        self.nonfinite, self.flags, self.read = nonfinite, flags, read
        # momentum_double_buffer: the momenta already advanced by the local pass (else None)
        self.next_momenta = next_momenta


class VotePipeline:
    """The per-step state of a :class:`StepPlan`: local steps, launched batches, flags."""

    def __init__(self, plan: StepPlan):
        self.plan = plan
        self.seed = (0, 0)  # (step, this rank's seed of it): see step_seed
        self.reset()

    def reset(self):
        n_buckets = len(self.plan.buckets)
        self.local: list[_Local | None] = [None] * n_buckets
        self.ready: list[set] = [set() for _ in range(n_buckets)]
        self.launched: list = [None] * len(self.plan.batches)
        self.next_batch = 0
        self.stale = False
        self.error: str | None = None
        # set when the last batch's phase 1 carried the step's flags, with this rank's reason for
        # its "unusable input" flag (uniform over ranks: only finish() asks for a carry)
        self.flags_carried = False
        self.carried_error: str | None = None
        # this step's (lr, weight decay, betas) per group, read with its flags (flags.hyper_values)
        self.hypers = None
        # device type -> the kernels' backend, resolved once per step (LIONCUB_KERNELS is read then:
        # an environment read per bucket cost ~1 µs)
        self.backends: dict = {}

    @property
    def busy(self) -> bool:
        return any(x is not None for x in self.local) or self.plan.sharding.started()

    # ------------------------------------------------------------------ local step
    def prepare(self, i: int, watch: bool = True) -> None:
        """Bucket ``i``'s local step: its votes and abstention payload, and its flag entries.
        ``watch``: it runs before step() (backward's hooks, prepare_step()): keep a fingerprint of
        the gradients it read (sharding.GradRead), so that an edit through ``.data`` is caught."""
        plan, b = self.plan, self.plan.buckets[i]
        cfg, opt = plan.config, plan.opt
        algorithm = b.algorithm
        g = opt.param_groups[b.group_index]
        dev = b.device_dtype()[0]
        be = self.backends.get(dev.type)
        if be is None:
            be = self.backends[dev.type] = kernels.backend_for(dev.type)
        grads, momenta, missing, problem = plan.sharding.inputs(i)  # first: it may set b.params (shards)
        # the bucket's layout as the kernels keep it: made once per bucket (and backend), then passed
        # to every kernel call of the bucket (checked once, no lookup, the local step's outputs reused)
        k = b.kernels
        if k is None or not k.fits(be, b.offsets, b.param_starts):
            k = b.kernels = BucketKernels.make(be, b.offsets, b.param_starts, b.numel)
        # lr: set by complete() before any apply reads it (a tensor lr is read once per step and group:
        # with the step's flags, hyper_values), so no host read here, in backward's hooks
        job = VoteJob(b.params, b.offsets, b.numel, b.param_starts, 0.0, g["weight_decay"],
                      opt.step_count + 1, cfg.tie_break, cfg.vote, mask=b.mask, mode=b.mode, capacity=b.capacity,
                      keep_delta=plan.drift, kernels=k)
        if problem is not None:
            # This rank cannot vote: send well-formed zeros so every rank's collectives still
            # match, and say why through the flags (every rank raises together).
            self.error = self.error or problem
            algorithm.no_votes(job, dev, be, plan.world_size)
            zero = torch.zeros((), dtype=torch.int64, device=dev)
            self.local[i] = _Local(job, [], [], be, zero, torch.zeros(2, dtype=torch.int32, device=dev), None)
            return
        # momentum_double_buffer: the next momenta are written in the same pass over g and m (into
        # spare buffers: a skipped step must leave m unchanged), saving a second pass later
        nxt = plan.sharding.next_momenta(i) if cfg.momentum_double_buffer and algorithm.advances_momenta else None
        # counts stay on the device (device_counts): finish() folds them into the step's one flag read
        nonfinite, flags = algorithm.local_step(job, grads, momenta, be, g["betas"], plan.world_size, self.step_seed,
                                                momenta_out=nxt)
        read = GradRead(b.params, dev, watch)  # (node voters' shards have none: the sharding's reads)
        self.local[i] = _Local(job, grads, momenta, be, nonfinite, flags, read, nxt, missing)

    def step_seed(self, step: int) -> int:
        """This rank's 32-bit random seed at ``step`` (reference.dither_seed), for an algorithm whose
        local step rounds at random (bbit's dither); computed when first asked, once per step."""
        if self.seed[0] != step:
            self.seed = (step, dither_seed(step, self.plan.rank))
        return self.seed[1]

    # ------------------------------------------------------------------ launch
    def grad_ready(self, i: int, p) -> None:
        """A gradient-ready hook fired for parameter ``p`` of bucket ``i`` (of the real parameters)."""
        sharding = self.plan.sharding
        if self.local[i] is not None or sharding.taken(i):  # a second backward after this bucket's
            self.stale = True                                 # gradients were read: redo at step()
            return
        self.ready[i].add(id(p))
        if len(self.ready[i]) == len(sharding.full[i].params):
            for k in sharding.take(i):  # the buckets whose local step may run now
                self.prepare(k)
            before = self.next_batch
            self.launch_ready()
            self.plan.opt.overlap_counts["batches_launched_in_backward"] += self.next_batch - before

    def launch_ready(self, carry_flags: bool = False, frozen_error: str | None = None, changed=False) -> None:
        """Launch, in the fixed order, every batch whose buckets all have their local step.
        ``carry_flags`` (only from finish(), on every rank): the last batch carries the step's
        flags, with ``frozen_error`` and ``changed`` (this rank's), if its algorithm can."""
        plan = self.plan
        while self.next_batch < len(plan.batches):
            batch = plan.batches[self.next_batch]
            if any(self.local[i] is None for i in batch):
                return
            jobs = [self.local[i].job for i in batch]
            first = self.local[batch[0]]
            flags = None
            if carry_flags and plan.carry_flags and self.next_batch == len(plan.batches) - 1:
                # Launched from step() after every local step: the last batch's phase 1 carries
                # the step's flags (no flag all-reduce of its own).
                self.flags_carried, self.carried_error = True, frozen_error or self.error
                flags = self._own_flags(self.carried_error, changed)
            self.launched[self.next_batch] = plan.buckets[batch[0]].algorithm.launch(jobs, plan.coll, first.backend,
                                                                                     flags)
            self.next_batch += 1

    def launch_all(self, carry_flags: bool = False, frozen_error: str | None = None, changed=False,
                   watch: bool = True) -> None:
        """Local steps of the buckets that have none yet (in launch order), launching as they
        complete (``carry_flags``, ``frozen_error``, ``changed``: see launch_ready; ``watch``:
        before step(), see prepare)."""
        for batch in self.plan.batches:
            for i in batch:
                if self.local[i] is None:
                    self.prepare(i, watch)
            self.launch_ready(carry_flags, frozen_error, changed)

    def changed_since_vote(self):
        """A gradient replaced or modified in place (e.g. clipped) after its bucket voted (or the
        sharding read it: node voters' reduce-scatter): True when the host can tell, else an int32
        [1] on the device (a fingerprint differs: an edit through ``.data``), which goes into the
        step's flags unread (sharding.reads_changed), or False."""
        return reads_changed(self.plan.sharding.reads() + [loc.read for loc in self.local if loc is not None],
                             self.plan.device)

    def drain(self) -> None:
        """Discard this step's votes and start over. Every batch is launched first: ranks may have
        launched different prefixes of the batch order during backward, and every rank must issue
        the same collectives (all batches once) before any of them votes again."""
        plan = self.plan
        plan.sharding.begin()  # what is left is read now and thrown away: no fingerprints (GradRead)
        self.launch_all(watch=False)
        for k, state in enumerate(self.launched):
            if state is not None:
                batch = plan.batches[k]
                plan.buckets[batch[0]].algorithm.received(state, [self.local[i].job for i in batch], plan.coll)
        plan.sharding.abandon()  # its own collectives (node voters' reduce-scatters) are done too
        self.reset()

    # ------------------------------------------------------------------ finish
    def finish(self, frozen_error: str | None, changed=False):
        """Launch what is left and sum the flags over the vote group (carried by the last batch's
        phase 1, or their own all-reduce).

        Returns (the summed flag words on the device, packed for every rank of the step: with node
        voters or instances the sums go on over them; this rank's input error or None); raises
        nothing itself: the caller agrees on them over every rank of the step (the sharding) and
        reads them (the step's one host read)."""
        plan = self.plan
        self.launch_all(carry_flags=True, frozen_error=frozen_error, changed=changed, watch=False)
        if self.flags_carried:  # they came with the last batch's phase 1
            last = len(plan.batches) - 1
            algorithm = plan.buckets[plan.batches[last][0]].algorithm
            width = flag_words(len(self.local), plan.ranks, plan.drift)
            rows = algorithm.flag_rows(self.launched[last], width)
            return rows.sum(0, dtype=torch.int64), self.carried_error
        error = frozen_error or self.error
        flags = self._own_flags(error, changed)
        plan.coll.all_reduce_(flags, "control")
        return flags, error

    def _own_flags(self, error, changed) -> torch.Tensor:
        """This rank's flag vector (int32, on the device; summed over ranks it is the step's flags).
        ``changed``: a bool, or an int32 [1] on the device (changed_since_vote)."""
        plan = self.plan
        dev = plan.device
        # this rank's non-finite count, summed on the device; clamped so that the sum over ranks
        # cannot overflow int32 (the message says "at least")
        nonfinite = torch.stack([loc.nonfinite.to(dev) for loc in self.local] +
                                [torch.zeros((), dtype=torch.int64, device=dev)]).sum().clamp_(max=2**20)
        missing = int(any(loc.missing for loc in self.local))
        self.hypers = hyper_values(plan.opt.param_groups)  # complete() applies these lrs: read once
        host = [int(bool(error)), missing, int(changed is True)] + hyper_bits(self.hypers, plan.opt.step_count + 1)
        host = host_values_on(host, dev)
        if isinstance(changed, torch.Tensor):  # a fingerprint compared on the device: never read here
            host = torch.cat([host[:2], changed.to(device=dev, dtype=torch.int32), host[3:]])
        head = torch.cat([(nonfinite > 0).to(torch.int32).reshape(1), host[:1], nonfinite.to(torch.int32).reshape(1),
                          host[1:]])
        # schedule="drift": the previous applied step's disagreement (0 before the first: not read)
        drift = None
        if plan.drift:
            drift = plan.drift_units if plan.drift_units is not None else torch.zeros(1, dtype=torch.int32, device=dev)
        # packed for every rank of the step: with node voters or instances the sums go on over them
        return pack_flags(torch.cat([head] + [loc.flags.to(dev) for loc in self.local]), plan.ranks, drift)

    def idle_everywhere(self, flags) -> list:
        """The voting parameters that have no gradient on ANY rank this step (Lion leaves such a
        parameter alone: no decay, no momentum change). Only when the flags say some rank lacks a
        gradient (agreed: every rank runs the same collective), one int32 per parameter is summed."""
        if flags[MISSING_RANKS] == 0:
            return []
        plan = self.plan
        params, have = [], []
        full = plan.sharding.full  # loc.missing indexes these
        for i, loc in enumerate(self.local):
            b = full[i]
            params += b.params
            have += [0 if k in loc.missing else 1 for k in range(len(b.params))]
        counts = torch.tensor(have, dtype=torch.int32, device=plan.device)
        plan.sharding.count_everywhere(counts)
        return [p for p, c in zip(params, counts.tolist()) if c == 0]

    def complete(self, flags, step: int) -> None:
        plan = self.plan
        opt, coll = plan.opt, plan.coll
        received = []
        for k, state in enumerate(self.launched):
            batch = plan.batches[k]
            received.append(plan.buckets[batch[0]].algorithm.received(state, [self.local[i].job for i in batch], coll))
        for k, batch in enumerate(plan.batches):
            for i, recv in zip(batch, received[k]):
                b, job = plan.buckets[i], self.local[i].job
                g = opt.param_groups[b.group_index]
                # this step's lr as finish() read it with the flags (_own_flags: every path to here)
                job.lr, job.weight_decay, job.step = self.hypers[b.group_index][0], g["weight_decay"], step
                first, second = flags[FLAG_HEAD + 2 * i], flags[FLAG_HEAD + 1 + 2 * i]
                # the planes (None, the payloads, or fetched), and how abstentions travel next step
                b.mode = b.algorithm.agree_planes(job, recv, first, second, coll)
        counted = []
        for k, batch in enumerate(plan.batches):
            jobs = [self.local[i].job for i in batch]
            counted.append(plan.buckets[batch[0]].algorithm.count(self.launched[k], jobs, coll,
                                                                   self.local[batch[0]].backend))
        # The momenta do not depend on the vote: they advance while any phase 2 is in flight.
        for i, loc in enumerate(self.local):
            b = plan.buckets[i]
            if loc.next_momenta is not None:
                plan.sharding.commit_momenta(i, loc.next_momenta)
            else:
                loc.backend.momentum_update_list(loc.momenta, loc.grads, opt.param_groups[b.group_index]["betas"][1])
            opt.stats.add_baseline(*plan.sharding.baseline(i))
        disagreement = torch.zeros(2, dtype=torch.int64, device=plan.device) if plan.drift else None
        for k, batch in enumerate(plan.batches):
            jobs = [self.local[i].job for i in batch]
            for i, job in zip(batch, jobs):  # where the counted Δ is applied (e.g. a master shard)
                plan.sharding.redirect(i, job)
            plan.buckets[batch[0]].algorithm.complete(counted[k], jobs, coll, self.local[batch[0]].backend)
            if disagreement is not None:  # this rank's votes against the applied Δ (on the device)
                for job in jobs:
                    disagreement += vote_disagreement(job.sign, job.nonzero, job.delta).to(plan.device)
                    job.delta = None
        if disagreement is not None:  # rides in the next step's flags (the sync after that step uses it)
            plan.drift_units = disagreement_units(disagreement, plan.ranks).to(torch.int32).reshape(1)
            plan.drift_step, plan.drift_sum = step, None
        self.reset()
