"""LionCub: Distributed Lion with compressed vote collectives (docs/conventions.md).

One process (torch.distributed not initialized, or a group of one rank): exactly
:class:`lioncub_ds.Lion`. N > 1 ranks: each rank keeps its own momentum, never
all-reduces gradients, and every rank applies the same vote Δ:

    local step (kernels) → vote phase 1 (comm) → the step's flags (non-finite, abstentions;
    carried by phase 1 or their own all-reduce) → rest of the vote → apply Δ (kernels) and
    momentum update → optional momentum sync / drift check

The optimizer knows nothing of DeepSpeed or Megatron; they set ``process_group``.
"""
from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from .agreement import agree_settings
from .kernels.reference import padded_numel
from .comm import Collectives, make_algorithm
from .comm.abstain import list_capacity, real_mask
from .comm.cost import CostModel
from .comm.pbit import check_lane_bits
from .config import DEFAULT_NETWORK, LionCubConfig, LionCubConfigError
from .lion import check_param_group, lr_value, nonfinite_count, restore_momenta, saved_momenta
from .lion import lion as lion_functional
from .groups import consecutive_blocks, create_on_all_ranks, group_ranks, settle_at_exit
from .momentum_sync import MomentumSync, node_group_size, select_params
from .pipeline import VotePipeline, comm_batches
from .telemetry import CommStats

log = logging.getLogger("lioncub_ds")

STATE_FORMAT = 1


class NonFiniteError(FloatingPointError):
    """A gradient or momentum was NaN/Inf on some rank and ``nonfinite='raise'``."""


class ReplicaDriftError(RuntimeError):
    """Parameters differ across ranks."""


class StepInputError(RuntimeError):
    """A step's input is unusable on some rank (e.g. a gradient on a parameter frozen at the
    first step). Agreed through the step's flags (summed over ranks), so every rank raises it together
    and no rank is left waiting in a collective; no state was changed."""


# Checksums of the drift check are computed in chunks of this many elements (bounded memory).
FINGERPRINT_CHUNK = 1 << 20


@dataclass
class Bucket:
    group_index: int
    params: list
    names: list
    offsets: list
    numel: int          # padded to a multiple of 8·N
    real_numel: int
    base: int
    algorithm: object = None
    mask: object = None      # uint8 plane: bit 1 at real elements (abstention lists are relative to it)
    capacity: int = 0        # entries of an abstention list (0: the plane always travels)
    mode: str = "list"       # how abstentions travel this step: "list" or "plane" (agreed, see _finish)


def check_world_size(cfg: LionCubConfig, n: int) -> None:
    """Settings whose validity depends on the number of voting ranks N."""
    if cfg.pbit_bits is not None and cfg.comm in ("pbit", "auto"):
        check_lane_bits(cfg.pbit_bits, n)
    if cfg.quant != "sign" and cfg.comm != "bbit" and n > 127:
        raise LionCubConfigError(f"LionCub: comm={cfg.comm!r} with quant={cfg.quant!r} (int8 votes) supports at most "
                                 f"127 ranks (s = floor(127/N) levels); this group has {n}; allowed: quant='sign'")
    if cfg.quant == "sign" and n > 255 and (cfg.comm == "pbit" or (cfg.comm == "1bit" and cfg.vote == "average")):
        raise LionCubConfigError(f"LionCub: comm={cfg.comm!r} with vote={cfg.vote!r} counts votes in 8-bit lanes: at "
                                 f"most 255 ranks; this group has {n}; allowed: comm='1bit' (majority) or 'allgather'")


def _split_named(params):
    """Accept tensors, (name, tensor) pairs or param groups; return torch-style groups.

    Names are kept in each group's ``param_names`` (torch's own key) for selective sync. The
    argument forms follow torch.optim: a bare tensor is refused (TypeError, torch's wording), a
    group's ``params`` may be one tensor, names are given for every parameter or for none.
    """
    if isinstance(params, torch.Tensor):
        raise TypeError("LionCub: params argument given to the optimizer should be an iterable of Tensors or dicts, "
                        "but got " + torch.typename(params))
    params = list(params)
    if not params:
        raise ValueError("LionCub got an empty parameter list")

    def unnamed(ps, where):
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        named = [isinstance(p, tuple) for p in ps]
        if any(named) and not all(named):
            raise ValueError(f"LionCub: all optimizer params should be with/without names. Some param names are "
                             f"missing ({where}: {sum(named)} of {len(ps)} are (name, tensor) pairs)")
        if any(named):
            for p in ps:
                if len(p) != 2 or not isinstance(p[0], str):
                    raise ValueError(f"LionCub: a named parameter must be a (str, tensor) pair; got a tuple of "
                                     f"{len(p)} ({where})")
            return [p for _, p in ps], [nm for nm, _ in ps]
        return ps, None

    if isinstance(params[0], dict):
        groups = []
        for k, g in enumerate(params):
            if not isinstance(g, dict):
                raise TypeError(f"LionCub: param group #{k} is a {type(g).__name__}; allowed: every entry a dict "
                                "(param groups) or none")
            g = dict(g)
            ps, names = unnamed(g.get("params", []), f"param group #{k}")
            if names is not None:
                g["param_names"] = names
            elif "names" in g and "param_names" not in g:
                g["param_names"] = list(g.pop("names"))
            g["params"] = ps
            groups.append(g)
        return groups
    ps, names = unnamed(params, "the parameter list")
    return [{"params": ps, "param_names": names}] if names is not None else [{"params": ps}]


class LionCub(Optimizer):
    """Lion Cub: communication-efficient distributed Lion.

    Args (see README "LionCub arguments" for allowed values and wire bytes):
        params: tensors, ``named_parameters()`` or param groups (with optional 'param_names').
        lr, betas, weight_decay: as :class:`lioncub_ds.Lion`.
        vote: "majority" (Δ = sign of the vote sum) or "average" (Δ = mean of votes).
        comm: "auto" | "allgather" | "1bit" | "pbit" | "int8" | "bbit".
        quant: "sign" (1-bit votes) or "l1" | "l0" | "linf" (int8 or b-bit scaled votes).
        vote_bits, rounding: comm="bbit" only: bits per vote code (1-4, default 2) and "dither"
            (default: unbiased, a reproducible per-rank stream) or "nearest".
        tie_break: "hash" (default) | "alternate" | "zero": what an even-N tie does.
        momentum_sync: None or a dict (every, until, schedule, k, layers, group, group_size, inter_every).
        process_group: the data-parallel group that votes (default: the world).
        momentum_dtype: torch.float32 (default) or torch.bfloat16.
        bucket_size_mb: MB of fp32 parameters per flat bucket (default 25).
        pbit_bits: force the pbit lane width (1/2/4/8; must satisfy 2**p − 1 >= N).
        network: {"bandwidth_gbit", "latency_us"} for comm="auto"'s cost model.
        nonfinite: "skip" (default: every rank skips the step) or "raise".
        drift_check_every: every K steps compare parameter checksums across ranks (0 = off).
        drift_action: "raise" or "resync" (broadcast from rank 0, with a warning).
        timeout_s: collective timeout; a dead rank makes the others fail after this long.
        foreach: single-process path: None (auto: the fused kernel of the device's backend), True (torch
            foreach) or False (single tensor); all give the same bits.
        comm_bucket_mb: MB of packed votes per communication batch: one collective per phase for a
            whole batch of parameter buckets (default 4).
        overlap: start each bucket's vote from gradient-ready hooks during backward (like DDP);
            ``no_sync()`` for gradient accumulation. Bit-identical to overlap=False.
        momentum_double_buffer: +4 bytes per parameter: the local pass writes the next momentum into a
            second buffer, saving the momentum pass after the vote (sign votes; bit-identical).

    Process groups (the timeout group, node subgroups) are created here, on every rank of the
    world in the same order, when torch.distributed is initialized (else at the first step),
    and again by :meth:`set_process_group`. So every rank must construct its LionCub.
    """

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, vote="majority", comm="auto",
                 quant="sign", tie_break="hash", momentum_sync=None, process_group=None,
                 momentum_dtype=torch.float32, bucket_size_mb=25.0, pbit_bits=None, network=None,
                 nonfinite="skip", drift_check_every=0, drift_action="raise", timeout_s=None, foreach=None,
                 comm_bucket_mb=4.0, overlap=False, momentum_double_buffer=False, vote_bits=None, rounding=None,
                 **unknown):
        # Validate everything before any state exists. ``unknown`` only exists to name a mistyped
        # setting with a suggestion (LionCubConfigError), instead of a bare TypeError.
        lr_given = lr  # a 1-element tensor lr stays in the param groups (schedulers fill it in place)
        settings = dict(lr=lr_value(lr, "LionCub"), betas=betas, weight_decay=weight_decay, vote=vote, comm=comm, quant=quant,
                        tie_break=tie_break, momentum_sync=momentum_sync, momentum_dtype=momentum_dtype,
                        bucket_size_mb=bucket_size_mb, pbit_bits=pbit_bits, nonfinite=nonfinite,
                        drift_check_every=drift_check_every, drift_action=drift_action, timeout_s=timeout_s,
                        foreach=foreach, comm_bucket_mb=comm_bucket_mb, overlap=overlap,
                        momentum_double_buffer=momentum_double_buffer, vote_bits=vote_bits, rounding=rounding,
                        **unknown)
        if network is not None:
            settings["network"] = network
        self.config = LionCubConfig.from_kwargs(**settings)
        groups = _split_named(params)
        cfg = self.config
        defaults = dict(lr=lr_given if isinstance(lr_given, torch.Tensor) else cfg.lr, betas=tuple(cfg.betas),
                        weight_decay=cfg.weight_decay)
        self._process_group = process_group
        self._group_lost = False
        self._dist = None  # resolved at construction or lazily: (vote group, world_size, rank)
        self._node_group = None
        self._created_groups = []
        self._construction_groups = groups  # what _resolve_group agrees on before param_groups exist
        if dist.is_available() and dist.is_initialized():
            self._resolve_group()  # fails now (before state) on e.g. a pbit width too small for N
        if cfg.momentum_sync is not None and cfg.momentum_sync.layers:
            if not all("param_names" in g for g in groups):
                raise LionCubConfigError("LionCub: momentum_sync.layers needs parameter names; pass "
                                         "model.named_parameters() or param groups carrying 'param_names'")
        super().__init__(groups, defaults)
        self._buckets = None
        self._pipe = None
        self._no_sync_depth = 0
        self._launch_condition = None
        self._warned_revote = False
        self._revotes = 0                   # steps that voted again (gradients changed after their vote)
        self._backward_launches = 0         # communication batches launched from gradient-ready hooks
        self._step_count = 0
        self.stats = CommStats()
        self._plan_logged = False
        self._skipped_steps = 0
        self._next_momenta = {}  # momentum_double_buffer: param -> the buffer the next momentum goes to

    def add_param_group(self, param_group):
        """torch's add_param_group, after LionCub's checks (complex parameters, a parameter listed twice
        in the group: refused before anything changes). After the first distributed step the new
        parameters need a new bucket layout: the current one is dropped (votes started in backward are
        drained: collective, so add the group on every rank, as the same program does) and the next
        step builds the layout again."""
        params = check_param_group(param_group, "LionCub")
        seen = set()
        for i, p in enumerate(params):
            p = p[1] if isinstance(p, tuple) else p
            if id(p) in seen:
                raise LionCubConfigError(f"LionCub: parameter #{i} of the group (shape {tuple(p.shape)}) is listed more "
                                         "than once; allowed: each parameter once (it would be stepped twice)")
            seen.add(id(p))
        if getattr(self, "_buckets", None) is not None:
            if self._pipe is not None and self._pipe.busy:
                self._pipe.drain()
            self._drop_layout()
        super().add_param_group(param_group)

    def _drop_layout(self):
        for handle in getattr(self, "_hook_handles", []):
            handle.remove()
        self._hook_handles = []
        self._pipe = None
        self._buckets = None

    # ------------------------------------------------------------------ copy / pickle
    # torch's Optimizer.__getstate__ keeps only defaults, state and param_groups. A copy keeps the
    # settings and counters too; the bucket layout, hooks and pipeline are rebuilt at its first step
    # (they hold the original's parameters). Process groups do not pickle: copy.deepcopy votes over
    # the original's groups (without owning them); an unpickled copy of an optimizer that had a
    # process group of its own needs set_process_group() before its first distributed step.
    _COPIED = ("config", "_step_count", "_skipped_steps", "stats", "_revotes", "_backward_launches",
               "_warned_revote", "_plan_logged")

    def __getstate__(self):
        state = super().__getstate__()
        state.update({k: self.__dict__[k] for k in self._COPIED if k in self.__dict__})
        state["_group_lost"] = self.__dict__.get("_process_group") is not None or self.__dict__.get("_group_lost", False)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if "_dist" in self.__dict__:
            # torch's own load_state_dict ends with __setstate__ on this live optimizer: its layout,
            # hooks and groups stay (resetting them here would leave the installed hooks behind)
            return
        self._process_group = None
        self._dist = None
        self._node_group = None
        self._created_groups = []
        self._buckets = None
        self._pipe = None
        self._hook_handles = []
        self._no_sync_depth = 0
        self._launch_condition = None
        self._next_momenta = {}

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        # the same vote group (and node subgroup): still owned, and released, by the original only
        new._process_group, new._dist, new._node_group = self._process_group, self._dist, self._node_group
        new._group_lost = False
        return new

    # ------------------------------------------------------------------ group
    def set_process_group(self, group) -> None:
        """Vote over ``group`` (integrations call this before the first step)."""
        if self._buckets is not None:
            raise RuntimeError("LionCub.set_process_group must be called before the first step")
        self._process_group = group
        self._group_lost = False
        self._dist = None
        self._resolve_group()

    def _resolve_group(self):
        """Check N-dependent settings, then create this optimizer's groups (collective, all ranks)."""
        cfg = self.config
        group = self._process_group
        if group is None and getattr(self, "_group_lost", False):
            raise RuntimeError("LionCub: this optimizer was unpickled from one that voted over a process group of its "
                               "own (process groups do not pickle); call set_process_group(group) on every rank "
                               "before its first step")
        n = dist.get_world_size(group)
        # one all-gather: the settings that must match do (else LionCubConfigError on every rank)
        agree_settings(cfg, getattr(self, "param_groups", None) or self._construction_groups, group)
        check_world_size(cfg, n)  # before creating anything (the groups below)
        settle_at_exit()  # a distributed run: let c10d's workers finish before the interpreter's teardown
        ranks = group_ranks(group)
        ms = cfg.momentum_sync
        wanted = []
        if cfg.timeout_s is not None and n > 1:
            wanted.append(ranks)  # the vote group again, with LionCub's timeout
        if ms is not None and ms.group == "node" and n > 1:
            size = node_group_size(ms.group_size, n)
            me = dist.get_rank(group)
            wanted.append(consecutive_blocks(ranks, size)[me // size])
        # Collective over the world whenever the settings (the same on every rank) need a group:
        # every rank takes part in every group creation, in the same order.
        created = create_on_all_ranks(wanted, cfg.timeout_s) if wanted else []
        self._created_groups = list(created)
        if cfg.timeout_s is not None and n > 1:
            group = created.pop(0)
        self._node_group = created[0] if created else None
        self._dist = (group, n, dist.get_rank(group))
        return self._dist

    def release_process_group(self) -> None:
        """Destroy the process groups this LionCub created (its timeout group, its node
        subgroup) and forget its vote group. For the end of training: a group's worker threads
        stop only when its last reference is gone (see :mod:`lioncub_ds.groups` for what they
        can do during the interpreter's teardown). Call it on every rank. The next
        distributed step (or :meth:`set_process_group`) resolves the groups again."""
        for g in getattr(self, "_created_groups", []):
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - already gone with the default group
                pass
        self._created_groups = []
        self._node_group = None
        self._dist = None
        self._drop_layout()  # rebuilt (with the new group's collectives) at the next step; hooks too

    @property
    def vote_group(self):
        """The process group whose ranks vote together (None: the world, or not distributed)."""
        if not self.distributed:
            return None
        return self._dist[0]

    @property
    def rank(self) -> int:
        """This process's rank inside :attr:`vote_group` (0 when not distributed)."""
        return self._dist[2] if self.distributed else 0

    @property
    def world_size(self) -> int:
        if self._dist is None:
            if not (dist.is_available() and dist.is_initialized()):
                return 1
            self._resolve_group()
        return self._dist[1]

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    # ------------------------------------------------------------------ layout
    def _build_buckets(self):
        cfg = self.config
        group, n, _ = self._dist
        stats_coll = Collectives(group, self.stats, cfg.timeout_s)
        self._coll = stats_coll
        net = {**DEFAULT_NETWORK, **cfg.network}
        cost = CostModel.from_network(net["bandwidth_gbit"], net["latency_us"])
        buckets, base, frozen = [], 0, []
        cap = cfg.bucket_numel
        for gi, g in enumerate(self.param_groups):
            names = g.get("param_names", [None] * len(g["params"]))
            by_kind = {}
            for p, name in zip(g["params"], names):
                if not p.requires_grad:
                    frozen.append((p, name))
                    continue
                by_kind.setdefault((p.device, p.dtype), []).append((p, name))
            for members in by_kind.values():
                cur = []
                size = 0
                for p, name in members + [(None, None)]:
                    aligned = (p.numel() + 7) // 8 * 8 if p is not None else 0
                    if p is not None and (size + aligned <= cap or not cur):
                        cur.append((p, name, size))
                        size += aligned
                        continue
                    total = padded_numel(size, n)
                    buckets.append(Bucket(gi, [q for q, _, _ in cur], [nm for _, nm, _ in cur],
                                          [o for _, _, o in cur], total, sum(q.numel() for q, _, _ in cur), base))
                    base += total
                    cur, size = ([(p, name, 0)], aligned) if p is not None else ([], 0)
        for b in buckets:
            if cfg.comm == "auto":
                if cfg.quant != "sign":
                    name = "int8"
                else:
                    name = cost.choose(b.numel, n, vote=cfg.vote, tie_break=cfg.tie_break, pbit_bits=cfg.pbit_bits)
            else:
                name = cfg.comm
            b.algorithm = make_algorithm(name, pbit_bits=cfg.pbit_bits, vote_bits=cfg.bbit[0], rounding=cfg.bbit[1],
                                         quant=cfg.quant)
            if b.algorithm.encoding == "bits":
                b.mask = real_mask(b.offsets, [p.numel() for p in b.params], b.numel, b.params[0].device)
                b.capacity = list_capacity(b.numel // 8, n)
                b.mode = "list"  # a count alone (capacity 0) when the bucket is small
        self._buckets = buckets
        self._batches = comm_batches(buckets, cfg.comm_bucket_mb, n)
        # The step's flags ride in the last batch's phase 1 when its algorithm delivers every
        # rank's message to every rank, and when nothing can be launched before step() knows every
        # input problem (overlap launches during backward: a separate flag all-reduce then).
        self._carry_flags = (not cfg.overlap and bool(buckets)
                             and buckets[self._batches[-1][0]].algorithm.carries_flags)
        self._pipe = VotePipeline(self)
        if cfg.overlap:
            self._install_hooks()
        # Frozen at the first step: not in the buckets. A gradient showing up there later would be
        # ignored silently, so step() checks them (a cheap loop over a usually empty list).
        self._frozen = frozen
        ms = cfg.momentum_sync
        self._msync = None
        if ms is not None:
            node = Collectives(self._node_group, self.stats, cfg.timeout_s) if ms.group == "node" else None
            self._msync = MomentumSync(ms, stats_coll, node)
            named = []
            for g in self.param_groups:
                names = g.get("param_names", [None] * len(g["params"]))
                named += [(nm, p) for p, nm in zip(g["params"], names) if p.requires_grad]
            self._sync_params = select_params(ms, named)
        if not self._plan_logged and self._dist[2] == 0:
            log.info("LionCub comm plan (N=%d): %s", n, "; ".join(
                f"bucket {i}: {b.real_numel} params -> {b.algorithm.name}" for i, b in enumerate(buckets)))
            self._plan_logged = True

    def comm_plan(self) -> list[dict]:
        """Per bucket: size, algorithm, and predicted/formula wire bytes per rank."""
        if not self.distributed:
            return []
        if self._buckets is None:
            self._build_buckets()
        n = self.world_size
        cfg = self.config
        cost = CostModel.from_network(cfg.network["bandwidth_gbit"], cfg.network["latency_us"])
        return [{"bucket": i, "group": b.group_index, "numel": b.real_numel, "padded_numel": b.numel,
                 "algorithm": b.algorithm.name,
                 "wire_bytes": b.algorithm.wire_bytes(b.numel, n, mode=b.mode, vote=cfg.vote, tie_break=cfg.tie_break),
                 "predicted_s": cost.predict(b.algorithm.name, b.real_numel, n, vote=cfg.vote,
                                             tie_break=cfg.tie_break, pbit_bits=cfg.pbit_bits)}
                for i, b in enumerate(self._buckets)]

    def comm_stats(self) -> dict:
        """Bytes sent per collective / algorithm, per step and cumulative (see telemetry)."""
        snap = self.stats.snapshot()
        snap["skipped_steps"] = self._skipped_steps
        # overlap=True: how many communication batches a backward launched (cumulative), and how
        # many steps had to vote again because gradients changed after their vote (wasted votes).
        snap["overlap"] = {"batches_launched_in_backward": self._backward_launches, "revotes": self._revotes}
        return snap

    # ------------------------------------------------------------------ state
    def _momentum(self, p):
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, dtype=self.config.momentum_dtype,
                                                memory_format=torch.contiguous_format)
            state["step"] = torch.zeros((), dtype=torch.float32, device="cpu")  # a host counter, as in torch.optim
        return state["exp_avg"]

    def _next_momentum(self, p):
        """momentum_double_buffer: where this step's local pass writes p's next momentum. It
        becomes the state's ``exp_avg`` when the step commits (the old one is then reused), so a
        skipped step changes nothing. Not optimizer state: never saved."""
        buf = self._next_momenta.get(p)
        m = self._momentum(p)
        if buf is None or buf.dtype != m.dtype or buf.shape != m.shape or buf.device != m.device:
            buf = self._next_momenta[p] = torch.empty_like(m, memory_format=torch.contiguous_format)
        return buf

    def _commit_momentum(self, p, new):
        state = self.state[p]
        self._next_momenta[p] = state["exp_avg"]
        state["exp_avg"] = new

    def state_dict(self):
        sd = super().state_dict()
        sd["lioncub"] = {"format": STATE_FORMAT, "step": self._step_count, "skipped_steps": self._skipped_steps,
                         "world_size": self.world_size,
                         "rank": self._dist[2] if self._dist else 0, "comm_stats": self.stats.state_dict()}
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("lioncub", None)
        # torch casts floating state to the parameter's dtype; keep the momenta exact instead.
        saved = saved_momenta(self, state_dict)
        for p, m in saved.items():
            bad = nonfinite_count(m)
            if bad:
                raise LionCubConfigError(
                    f"LionCub.load_state_dict: the momentum of parameter {tuple(p.shape)} holds {bad} non-finite "
                    "value(s); allowed: finite momenta (at N > 1 every later step would be skipped); no state was "
                    "changed")
        super().load_state_dict(state_dict)
        restore_momenta(self, saved, self.config.momentum_dtype)
        if extra is not None:
            self._step_count = int(extra.get("step", 0))
            self._skipped_steps = int(extra.get("skipped_steps", 0))
            if "comm_stats" in extra:
                self.stats.load_state_dict(extra["comm_stats"])

    @property
    def step_count(self) -> int:
        """Applied optimizer steps (skipped steps do not count); the tie rules use it."""
        return self._step_count

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.distributed:
            self._local_lion_step()
        else:
            self._distributed_step()
        return loss

    def _local_lion_step(self):
        for g in self.param_groups:
            params, grads, momenta = [], [], []
            for p in g["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:  # the rule of every N (refused there through the step's flags)
                    raise StepInputError(f"LionCub: the gradient of parameter {tuple(p.shape)} is sparse; allowed: "
                                         "a dense gradient of the parameter's shape; no state was changed")
                params.append(p)
                grads.append(p.grad)
                momenta.append(self._momentum(p))
            b1, b2 = g["betas"]
            lion_functional(params, grads, momenta, lr=lr_value(g["lr"]), beta1=b1, beta2=b2,
                            weight_decay=g["weight_decay"], foreach=self.config.foreach)
            for p in params:
                self.state[p]["step"] += 1
        self._step_count += 1

    def _frozen_param_error(self) -> str | None:
        """This rank's reason to refuse the step, or None (agreed through the flags before raising)."""
        for p, name in self._frozen:
            if p.grad is not None:
                return (f"LionCub: parameter {name or tuple(p.shape)} had requires_grad=False at the first step (so it "
                        "has no place in the vote buckets) but now has a gradient on this rank; set requires_grad "
                        "before the first step, or clear its .grad")
        return None

    @property
    def _device(self):
        """Where the step's small tensors (flags, checksums) live: the parameters' device (NCCL
        takes only CUDA tensors)."""
        for g in self.param_groups:
            for p in g["params"]:
                return p.device
        return torch.device("cpu")

    def _grads(self, bucket):
        # A parameter without a gradient on this rank votes with g = 0 (its momentum still
        # decays); every rank must run the same collectives, whatever its batch used.
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]

    def _distributed_step(self):
        cfg = self.config
        if self._buckets is None:
            self._build_buckets()
        n = self.world_size
        pipe = self._pipe
        step = self._step_count + 1
        if pipe.stale or (pipe.busy and pipe.changed_since_vote()):
            # A gradient changed after its bucket voted during backward (a second backward without
            # no_sync(), or clipping in place): vote again from the gradients as they are now.
            if not self._warned_revote:
                log.warning("LionCub(overlap=True): gradients changed after they were voted on in backward (a "
                            "second backward without opt.no_sync(), or in-place clipping); voting again in step()")
                self._warned_revote = True
            self._revotes += 1
            pipe.drain()
        flags, input_error = pipe.finish(self._frozen_param_error())
        if flags[1] > 0:
            pipe.drain()
            self.stats.end_step()
            raise StepInputError(
                (input_error + "; " if input_error else "LionCub: ") +
                f"{flags[1]} of {n} ranks found an unusable input at step {step}; every rank raises this, no "
                "state was changed")
        if flags[0] > 0:
            pipe.drain()
            self._skipped_steps += 1
            self.stats.end_step()
            if cfg.nonfinite == "raise":
                count = f"{flags[2]}{'+' if flags[2] >= 2**20 else ''}"
                raise NonFiniteError(f"LionCub: non-finite gradient or momentum on {flags[0]} of {n} ranks at step "
                                     f"{step} (non-finite values in all: {count}); nonfinite='raise'. No state was "
                                     "changed.")
            log.warning("LionCub: non-finite gradient/momentum on %d of %d ranks at step %d: step skipped on every rank",
                        flags[0], n, step)
            return
        # Parameters without a gradient on every rank stay as they are (as in Lion): their votes
        # (c = β1·m, from g = 0) ran with everyone else's and are undone here.
        idle = pipe.idle_everywhere(flags)
        kept = [(p, p.detach().clone(), self._momentum(p).clone()) for p in idle]
        pipe.complete(flags)
        for p, value, m in kept:
            p.copy_(value)
            self._momentum(p).copy_(m)
        self._step_count = step
        idle_ids = {id(p) for p in idle}
        for b in self._buckets:
            for p in b.params:
                if id(p) not in idle_ids:
                    self.state[p]["step"] += 1
        if self._msync is not None:
            where = self._msync.scope(step - 1)
            if where is not None:
                MomentumSync.average_over(where, [self._momentum(p) for p in self._sync_params], cfg.bucket_numel,
                                          cfg.momentum_sync.dtype)
        self.stats.end_step()
        if cfg.drift_check_every and step % cfg.drift_check_every == 0:
            self.check_replicas()  # its bytes count towards the next step

    # ------------------------------------------------------------------ overlap with backward
    def _install_hooks(self):
        self._hook_handles = []
        for i, b in enumerate(self._buckets):
            for p in b.params:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(
                    lambda param, i=i: self._on_grad_ready(i, param)))

    def _on_grad_ready(self, i, p):
        if self._no_sync_depth == 0 and self._pipe is not None and \
                (self._launch_condition is None or self._launch_condition()):
            self._pipe.grad_ready(i, p)

    def set_launch_condition(self, condition) -> None:
        """``overlap=True``: ``condition()`` (no arguments, returns a bool) is asked whenever a
        gradient-ready hook fires during backward; False keeps that backward from starting votes,
        exactly as if it ran inside :meth:`no_sync`. For training loops that own the
        gradient-accumulation boundary (the DeepSpeed integration passes "is this micro-batch
        the engine's accumulation boundary"). It must answer the same on every rank for the same
        backward. ``None`` (the default): every backward outside ``no_sync()`` may start votes.
        Without overlap it changes nothing."""
        if condition is not None and not callable(condition):
            raise TypeError(f"LionCub.set_launch_condition: expected a callable or None, got {condition!r}")
        self._launch_condition = condition

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation with ``overlap=True``: backward passes inside this context only
        accumulate gradients; the backward after it (the last micro-batch) starts the votes.
        Without overlap it changes nothing (votes always start in ``step()``)."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    def prepare_step(self):
        """Start every vote now (the local steps of buckets without one yet, and their launches),
        so communication runs while the caller does other work before ``step()``. Collective:
        call it on every rank, or on none."""
        if not self.distributed:
            return
        if self._buckets is None:
            self._build_buckets()
        self._pipe.launch_all()

    def zero_grad(self, set_to_none: bool = True):
        # Votes started in backward for gradients that are now being discarded: finish their
        # collectives (every rank does the same) and forget them.
        if self._pipe is not None and self._pipe.busy:
            self._pipe.drain()
        super().zero_grad(set_to_none=set_to_none)

    def sync_momenta(self, scope: str = "world") -> None:
        """Average the momenta now (in momentum_sync.dtype, default fp32), over the vote group
        (``scope="world"``) or this rank's node subgroup (``scope="node"``, needs
        momentum_sync.group='node'). Collective: every rank of the group must call it.
        Which momenta: those momentum_sync.layers selects (all when it is not set)."""
        if scope not in ("world", "node"):
            raise LionCubConfigError(f"LionCub.sync_momenta: invalid scope={scope!r}; allowed: 'world' | 'node'")
        if not self.distributed:
            return
        if self._buckets is None:
            self._build_buckets()
        if scope == "node" and self._node_group is None:
            raise LionCubConfigError("LionCub.sync_momenta(scope='node') needs momentum_sync={'group': 'node', ...}")
        if self._msync is not None:
            coll, params = (self._msync.world if scope == "world" else self._msync.node), self._sync_params
        else:
            coll, params = self._coll, [p for b in self._buckets for p in b.params]
        dtype = self.config.momentum_sync.dtype if self.config.momentum_sync is not None else "fp32"
        MomentumSync.average_over(coll, [self._momentum(p) for p in params], self.config.bucket_numel, dtype)

    # ------------------------------------------------------------------ drift guard
    def _fingerprints(self, params):
        """Two int64 checksums per parameter: the sum of its bit patterns and a position-weighted
        sum, computed in chunks of FINGERPRINT_CHUNK elements (memory bounded by the chunk,
        whatever the parameter's size). Integer sums wrap identically on every rank."""
        out = torch.zeros(len(params), 2, dtype=torch.int64, device=self._device)
        for i, p in enumerate(params):
            flat = p.detach().reshape(-1)
            ints = flat.view(torch.int32 if flat.element_size() == 4 else torch.int16)
            for start in range(0, ints.numel(), FINGERPRINT_CHUNK):
                chunk = ints[start:start + FINGERPRINT_CHUNK].to(torch.int64)
                idx = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=chunk.device)
                idx.remainder_(65521)
                out[i, 0] += chunk.sum()
                out[i, 1] += chunk.mul_(idx).sum()
        return out.reshape(-1)

    def check_replicas(self, action: str | None = None) -> bool:
        """Compare parameter checksums across ranks. True if identical.

        On a mismatch: ``action`` (default: the drift_action setting) "raise" names the first
        differing parameters; "resync" broadcasts every parameter from group rank 0.
        """
        if not self.distributed:
            return True
        if self._buckets is None:
            self._build_buckets()
        action = action or self.config.drift_action
        params = [p for b in self._buckets for p in b.params]
        names = [nm for b in self._buckets for nm in b.names]
        fp = self._fingerprints(params)
        both = torch.cat([fp, -fp])
        self._coll.all_reduce_(both, "drift_check", op=dist.ReduceOp.MAX)
        hi, neg_lo = both[:fp.numel()], both[fp.numel():]
        differs = (hi != -neg_lo).reshape(-1, 2).any(dim=1)
        if not bool(differs.any()):
            return True
        idx = differs.nonzero().reshape(-1).tolist()
        labels = [names[i] or f"param #{i} (shape {tuple(params[i].shape)})" for i in idx[:5]]
        msg = (f"LionCub: parameters differ across the {self.world_size} ranks at step {self._step_count}: "
               f"{', '.join(labels)}" + (f" and {len(idx) - 5} more" if len(idx) > 5 else ""))
        if action == "resync":
            log.warning("%s; re-synchronizing every parameter from rank 0", msg)
            for p in params:
                if p.is_contiguous():
                    self._coll.broadcast_(p.data, 0, "drift_resync")
                else:  # a broadcast sends raw memory: go through a contiguous copy of the view
                    buf = p.detach().contiguous()
                    self._coll.broadcast_(buf, 0, "drift_resync")
                    p.data.copy_(buf)
            return False
        raise ReplicaDriftError(msg)
