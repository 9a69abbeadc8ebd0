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
import inspect
import logging

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from .agreement import agree_settings
from .checkpoint import same_layout
from .comm.pbit import check_lane_bits
from .config import CONSTRUCTOR_ONLY, LionCubConfig, LionCubConfigError
from .config_text import constructor_doc
from .errors import NonFiniteError, ReplicaDriftError, StepInputError  # noqa: F401 - re-exported
from .lion import (SET_ERROR, call_closure, check_param_group, checked_groups, count_steps, lr_value,
                   nonfinite_count, restore_momenta, saved_momenta)
from .lion import lion as lion_functional
from .groups import (INSTANCES, MASTER_ONLY, NODE_VOTERS, SINGLE, Strategy, Topology, consecutive_blocks,
                     create_on_all_ranks, group_ranks, requested, resolve_strategy, settle_at_exit)
from .momentum_sync import check_sync_state, sync_group_size
from .pipeline import StepPlan
from .sharding import describe_layout, workspace_bytes
from .telemetry import CommStats

log = logging.getLogger("lioncub_ds")

STATE_FORMAT = 1


class MomentumStore:
    """LionCub's momenta (the optimizer state's ``exp_avg``): get / next / commit.

    ``next`` is ``momentum_double_buffer``'s spare: the step's local pass writes the next
    momentum there, and ``commit`` makes it the state's ``exp_avg`` once the step is agreed
    (the old one becomes the spare), so a skipped step changes nothing. Spares are not
    optimizer state: never saved."""

    def __init__(self, opt):
        self.opt = opt
        self.spares = {}
        self.shard_spares = {}  # node voters' momentum_double_buffer: {(kind, bucket index): spare shard}
        # node_size > 1: this rank's flat shards per bucket index, {"momentum": {i: tensor},
        # "master": {i: tensor}} (saved in state_dict()["lioncub"]["node"])
        self.shards = {"momentum": {}, "master": {}}

    @property
    def dtype(self):
        return self.opt.config.momentum_dtype

    def shard(self, kind: str, i: int, numel: int, dtype, device, fill=None):
        """node_size > 1: bucket ``i``'s ``kind`` shard, made when first asked for: zeros, then
        ``fill(tensor)`` if given (a master shard takes the parameters' values)."""
        t = self.shards[kind].get(i)
        if t is None:
            t = self.shards[kind][i] = torch.zeros(numel, dtype=dtype, device=device)
            if fill is not None:
                fill(t)
        elif t.numel() != numel:  # a layout that changed under kept shards: never step with another's
            raise LionCubConfigError(f"LionCub: the {kind} shard kept for bucket #{i} has {t.numel()} elements, the "
                                     f"bucket's shard now {numel}: the bucket layout changed under the shards kept "
                                     "by bucket (voters='node' / node_size)")
        return t

    def drop_masters(self) -> None:
        """Forget the master shards: the next step makes them again from the parameters."""
        self.shards["master"].clear()

    def state_bytes(self) -> dict:
        """Bytes of optimizer state on this rank: momenta (per-parameter or shards), fp32 master
        shards, double-buffer spares."""
        per_param = sum(st["exp_avg"].numel() * st["exp_avg"].element_size()
                        for st in self.opt.state.values() if "exp_avg" in st)
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {"momentum": per_param + size(self.shards["momentum"].values()),
                "master": size(self.shards["master"].values()),
                "spare": size(self.spares.values()) + size(self.shard_spares.values())}

    def get(self, p):
        state = self.opt.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, dtype=self.opt.config.momentum_dtype,
                                                memory_format=torch.contiguous_format)
            state["step"] = torch.zeros((), dtype=torch.float32, device="cpu")  # a host counter, as in torch.optim
        return state["exp_avg"]

    def next(self, p):
        buf = self.spares.get(p)
        m = self.get(p)
        if buf is None or buf.dtype != m.dtype or buf.shape != m.shape or buf.device != m.device:
            buf = self.spares[p] = torch.empty_like(m, memory_format=torch.contiguous_format)
        return buf

    def commit(self, p, new):
        state = self.opt.state[p]
        self.spares[p] = state["exp_avg"]
        state["exp_avg"] = new

    def next_shard(self, kind: str, i: int):
        """``next`` for bucket ``i``'s ``kind`` shard (which must exist): a spare of its size.
        Made with zeros: the local pass writes the pieces only, the padding between them stays 0
        in both buffers."""
        cur = self.shards[kind][i]
        buf = self.shard_spares.get((kind, i))
        if buf is None or buf.dtype != cur.dtype or buf.shape != cur.shape or buf.device != cur.device:
            buf = self.shard_spares[(kind, i)] = torch.zeros_like(cur)
        return buf

    def commit_shard(self, kind: str, i: int):
        """``commit`` for a shard: :meth:`next_shard`'s spare becomes the shard, the old one the spare."""
        key = (kind, i)
        self.shards[kind][i], self.shard_spares[key] = self.shard_spares[key], self.shards[kind][i]


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
    if isinstance(params, set):  # every rank must list the parameters in the same order
        raise TypeError(f"LionCub: {SET_ERROR}")
    params = list(params)
    if not params:
        raise ValueError("LionCub got an empty parameter list")

    def unnamed(ps, where):
        if isinstance(ps, set):
            raise TypeError(f"LionCub ({where}): {SET_ERROR}")
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


# The settings' defaults (from LionCubConfig), and those torch.optim takes positionally, in its order.
_DEFAULTS = LionCubConfig.defaults()
POSITIONAL = ("lr", "betas", "weight_decay")


def _given_config(config, given: set) -> LionCubConfig:
    """``LionCub(params, config=...)``: a validated LionCubConfig, and no setting keyword beside it."""
    if not isinstance(config, LionCubConfig):
        raise TypeError(f"LionCub: config must be a LionCubConfig (validated settings), got {type(config).__name__}")
    if given:
        raise LionCubConfigError(f"LionCub: config=... carries every setting; also given: {', '.join(sorted(given))}; "
                                 "allowed: config alone, or the settings as keywords without config")
    return config


class LionCub(Optimizer):
    """Lion Cub: communication-efficient distributed Lion.

    The settings are the fields of :class:`LionCubConfig` (declared once there, with their
    types, choices, help and whether they must agree across ranks): ``lr``, ``betas`` and
    ``weight_decay`` positional or keyword as in torch.optim, every other one a keyword; or
    ``config=`` a validated LionCubConfig carrying them all (integrations validate once, early).
    A mistyped keyword is refused with a suggestion. The Args below are made from the fields.

    Process groups (the timeout group, node subgroups) are created here, on every rank of the
    world in the same order, when torch.distributed is initialized (else at the first step),
    and again by :meth:`set_process_group`. So every rank must construct its LionCub.
    """

    def __init__(self, params, lr=_DEFAULTS["lr"], betas=_DEFAULTS["betas"], weight_decay=_DEFAULTS["weight_decay"], *,
                 process_group=None, config=None, shard_groups=None, **settings):
        # Validate everything before any state exists (LionCubConfig names a mistyped setting).
        given = {k for k, v in zip(POSITIONAL, (lr, betas, weight_decay)) if v is not _DEFAULTS[k]}
        if shard_groups is not None:
            process_group = _check_shard_groups(shard_groups, process_group)
        self._shard_groups = shard_groups
        if config is not None:
            self.config = _given_config(config, given | set(settings))
            self._setup(params, config.lr, process_group)
            return
        if "network" in settings and settings["network"] is None:
            del settings["network"]  # None: the default network
        lr_given = lr  # a 1-element tensor lr stays in the param groups (schedulers fill it in place)
        self.config = LionCubConfig.from_kwargs(lr=lr_value(lr, "LionCub"), betas=betas, weight_decay=weight_decay,
                                                **settings)
        self._setup(params, lr_given, process_group)

    #: set by ``shard_groups=`` (a :class:`~lioncub_ds.groups.ShardGroups`): the parameters are
    #: this rank's shards of a framework's sharded parameters
    _shard_groups = None

    def _setup(self, params, lr_given, process_group):
        """Everything after the settings are validated (``self.config``): groups, topology, state."""
        groups = _split_named(params)
        cfg = self.config
        if self._shard_groups is not None:
            check_shard_settings(cfg)
        defaults = dict(lr=lr_given if isinstance(lr_given, torch.Tensor) else cfg.lr, betas=tuple(cfg.betas),
                        weight_decay=cfg.weight_decay)
        self._process_group = process_group
        self._group_lost = False
        self._topology = None  # resolved at construction or lazily (groups.Topology)
        self._created_groups = []
        self._construction_groups = groups  # what the settings agreement reads before param_groups exist
        if dist.is_available() and dist.is_initialized():
            self._ensure_topology()  # fails now (before state) on e.g. a pbit width too small for N
        if cfg.momentum_sync is not None and cfg.momentum_sync.layers:
            if not all("param_names" in g for g in groups):
                raise LionCubConfigError("LionCub: momentum_sync.layers needs parameter names; pass "
                                         "model.named_parameters() or param groups carrying 'param_names'")
        super().__init__(groups, defaults)
        self._init_runtime()
        self._step_count = 0
        self._skipped_steps = 0
        self.stats = CommStats()
        # overlap=True: communication batches a backward launched (cumulative), and steps that
        # voted again because gradients changed after their vote (wasted votes)
        self.overlap_counts = {"batches_launched_in_backward": 0, "revotes": 0}
        self._plan_logged = False

    def _init_runtime(self):
        """What a copy or an unpickled optimizer rebuilds: the step plan (made at the first
        distributed step), no_sync() depth, the launch condition, the momentum store."""
        self._plan = None
        self._no_sync_depth = 0
        self._launch_condition = None
        self.momenta = MomentumStore(self)

    def add_param_group(self, param_group):
        """torch's add_param_group, after LionCub's checks (complex parameters, a parameter listed twice
        in the group: refused before anything changes). Distributed, the new group is agreed across
        the ranks at the next step, before it joins the step plan (add it on every rank, as the same
        program does): until then the plan keeps the groups it was built with (made now if the vote
        group is known and there is none yet), so a rank that added a group and one that did not
        still issue the same collectives; that step then compares every rank's groups (a group
        missing on a rank, or with other parameters, raises the same LionCubConfigError on every
        rank, nothing changed) and builds the plan again with them (pipeline.StepPlan.run). Sharded
        state (node voters, master-only sharding) carries over: buckets are cut group by group, so
        the new group's buckets come after the existing ones, whose shards (kept by bucket index)
        the new plan finds unchanged."""
        params = check_param_group(param_group, "LionCub", self.defaults, len(getattr(self, "param_groups", [])))
        seen = set()
        for i, p in enumerate(params):
            p = p[1] if isinstance(p, tuple) else p
            if id(p) in seen:
                raise LionCubConfigError(f"LionCub: parameter #{i} of the group (shape {tuple(p.shape)}) is listed more "
                                         "than once; allowed: each parameter once (it would be stepped twice)")
            seen.add(id(p))
        if "_plan" in self.__dict__ and self._topology is not None and self.distributed:  # after construction
            self.plan  # noqa: B018 - the plan of the groups so far (issues no collective), before this one joins
        super().add_param_group(param_group)

    def _drop_plan(self):
        if self._plan is not None:
            self._plan.close()
        self._plan = None

    # ------------------------------------------------------------------ copy / pickle
    # torch's Optimizer.__getstate__ keeps only defaults, state and param_groups. A copy keeps the
    # settings and counters too; the step plan (layout, hooks) is rebuilt at its first step (the
    # original's holds the original's parameters). Process groups do not pickle: copy.deepcopy
    # votes over the original's groups (without owning them); an unpickled copy of an optimizer
    # that had a process group of its own needs set_process_group() before its first
    # distributed step.
    _COPIED = ("config", "_step_count", "_skipped_steps", "stats", "overlap_counts", "_plan_logged")

    def __getstate__(self):
        state = super().__getstate__()
        state.update({k: self.__dict__[k] for k in self._COPIED if k in self.__dict__})
        state["_group_lost"] = self.__dict__.get("_process_group") is not None or self.__dict__.get("_group_lost", False)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if "_topology" in self.__dict__:
            # torch's own load_state_dict ends with __setstate__ on this live optimizer: its plan,
            # hooks and groups stay (resetting them here would leave the installed hooks behind)
            return
        self._process_group = None
        self._topology = None
        self._created_groups = []
        self._init_runtime()

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        # the same vote group (and node subgroup): still owned, and released, by the original only
        new._process_group, new._topology = self._process_group, self._topology
        new._group_lost = False
        return new

    # ------------------------------------------------------------------ groups
    def set_process_group(self, group) -> None:
        """Vote over ``group`` (integrations call this before the first step)."""
        if self._plan is not None:
            raise RuntimeError("LionCub.set_process_group must be called before the first step")
        self._process_group = group
        self._group_lost = False
        self._topology = None
        self._ensure_topology()

    def _ensure_topology(self) -> Topology:
        if self._topology is None:
            if self._process_group is None and getattr(self, "_group_lost", False):
                raise RuntimeError("LionCub: this optimizer was unpickled from one that voted over a process group of "
                                   "its own (process groups do not pickle); call set_process_group(group) on every "
                                   "rank before its first step")
            cfg = self.config
            n = dist.get_world_size(self._process_group)
            # The group sizes this rank resolves (from the settings, else the launcher's environment):
            # each, or this rank's reason it cannot, is agreed with the settings below, so a size that
            # differs across ranks, or fails on one rank only, gives every rank the same error
            # naming the setting (never one rank raising alone while the others wait).
            # the sharding mode, decided once (lioncub_ds.groups.resolve_strategy); with shard groups
            # the framework's groups are the layout: no node_size to resolve
            strategy, node_problem = _resolved(lambda c, k: resolve_strategy(c, k, self._shard_groups), cfg, n)
            sync_size, sync_problem = _resolved(sync_group_size, cfg, n)
            # one all-gather: the settings that must match do (else LionCubConfigError on every
            # rank); before the N-dependent checks, which would otherwise fail on some ranks only
            # with shard groups the shard peers agree (they hold same-shaped shards), as Megatron's instances do
            peers = self._shard_groups.peers if self._shard_groups is not None else self._process_group
            agree_settings(cfg, getattr(self, "param_groups", None) or self._construction_groups,
                           peers, resolved={"node_size": node_problem or strategy.node_size,
                                                          "momentum_sync.group_size": sync_problem or sync_size})
            if node_problem or sync_problem:  # the same on every rank (agreed)
                raise LionCubConfigError(node_problem or sync_problem)
            check_world_size(cfg, strategy.voters)  # N := the voters; before creating anything (the groups below)
            self._topology = self.resolve_topology(self._process_group, strategy, sync_size)
        return self._topology

    def resolve_topology(self, group, strategy: Strategy, sync_size: int | None = None) -> Topology:
        """The :class:`~lioncub_ds.groups.Topology` this optimizer votes over: ``group`` (None:
        the world), plus the groups its ``strategy`` and settings need (a timeout group, a
        momentum-sync node subgroup of ``sync_size`` ranks, the node groups of ``strategy.node_size``
        ranks), created here collectively: every rank of the world takes part in every group
        creation, in the same order. The strategy and sizes are resolved and agreed once, before
        (:func:`lioncub_ds.groups.resolve_strategy`, :func:`lioncub_ds.momentum_sync.sync_group_size`).
        An integration that makes its groups elsewhere (Megatron's factory, on every rank) overrides
        this to return them and create none."""
        cfg = self.config
        sg = self._shard_groups
        if strategy.mode == INSTANCES:  # a framework's shard groups, made on every rank by the integration
            settle_at_exit()
            return Topology(sg.peers, sg.groups, sg.group_index, None, full_group=sg.world,
                            agree_group=sg.shard, agree_size=sg.shard_size, agree_rank=sg.shard_rank,
                            vote_scope="inter_node", strategy=strategy)
        n = dist.get_world_size(group)
        size = strategy.node_size
        settle_at_exit()  # a distributed run: let c10d's workers finish before the interpreter's teardown
        ranks = group_ranks(group)
        ms = cfg.momentum_sync
        wanted = []
        if cfg.timeout_s is not None and n > 1:
            wanted.append(ranks)  # the vote group again, with LionCub's timeout
        if sync_size is not None and n > 1:
            me = dist.get_rank(group)
            wanted.append(consecutive_blocks(ranks, sync_size)[me // sync_size])
        if size > 1:  # this rank's node group (consecutive ranks), and for node voters its shard peers
            me = dist.get_rank(group)
            wanted.append(consecutive_blocks(ranks, size)[me // size])
            if strategy.mode == NODE_VOTERS:
                wanted.append(ranks[me % size::size])
        created = create_on_all_ranks(wanted, cfg.timeout_s) if wanted else []
        self._created_groups = list(created)
        if cfg.timeout_s is not None and n > 1:
            group = created.pop(0)
        if strategy.mode == NODE_VOTERS:
            node, peers = created[-2:]
            return Topology(peers, n // size, dist.get_rank(group) // size, None, node, size,
                            dist.get_rank(group) % size, group, strategy=strategy)
        if strategy.mode == MASTER_ONLY:  # the flat vote group, and the node group for the master
            node = created.pop()
            return Topology(group, n, dist.get_rank(group), created[0] if created else None, node, size,
                            dist.get_rank(group) % size, group, strategy=strategy)
        return Topology(group, n, dist.get_rank(group), created[0] if created else None, full_group=group,
                        strategy=strategy)

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
        self._topology = None
        self._drop_plan()  # rebuilt (with the new group's collectives) at the next step; hooks too

    @property
    def created_groups(self) -> list:
        """The process groups this optimizer created (and :meth:`release_process_group` destroys)."""
        return list(self._created_groups)

    @property
    def strategy(self) -> Strategy:
        """How the step is laid out (:class:`lioncub_ds.groups.Strategy`: flat, master-only, node
        voters or a framework's shard groups; ranks, voters, ranks per node), decided once from the
        settings, the vote group and the environment. Integrations read this, never the settings."""
        return self._ensure_topology().strategy if self.distributed else SINGLE

    @property
    def process_group(self):
        """The process group this optimizer was given to vote over (None: the world)."""
        return self._process_group

    @property
    def topology(self) -> Topology | None:
        """The vote group and subgroups (None when not distributed)."""
        return self._ensure_topology() if self.distributed else None

    @property
    def vote_group(self):
        """The process group of every rank taking part in the step (None: the world, or not
        distributed); with voters="node" the voters are its node groups."""
        if not self.distributed:
            return None
        t = self._topology
        return t.full_group if t.strategy.node_voters else t.group

    @property
    def rank(self) -> int:
        """This process's rank inside :attr:`vote_group` (0 when not distributed)."""
        if not self.distributed:
            return 0
        return self._topology.global_rank

    @property
    def world_size(self) -> int:
        """Ranks taking part in the step (with voters="node": Nn groups × L ranks)."""
        if self._topology is None:
            if not (dist.is_available() and dist.is_initialized()):
                return 1
            self._ensure_topology()
        return self._topology.ranks

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    # ------------------------------------------------------------------ the step plan
    @property
    def plan(self) -> StepPlan | None:
        """The distributed step's :class:`~lioncub_ds.pipeline.StepPlan` (bucket layout,
        communication batches, hooks), built at the first distributed step or here; None when
        not distributed. Building it issues no collective."""
        if not self.distributed:
            return None
        if self._plan is None:
            self._plan = StepPlan(self, self._topology, self._may_launch)
            if not self._plan_logged and self._topology.rank == 0:
                log.info("LionCub comm plan (N=%d): %s", self._topology.world_size, "; ".join(
                    f"bucket {i}: {b.real_numel} params -> {b.algorithm.name}"
                    for i, b in enumerate(self._plan.buckets)))
                self._plan_logged = True
        return self._plan

    def comm_plan(self) -> list[dict]:
        """Per bucket: size, algorithm, and predicted/formula wire bytes per rank."""
        return self.plan.describe() if self.distributed else []

    def comm_stats(self) -> dict:
        """Bytes sent per collective / algorithm, per step and cumulative (see telemetry)."""
        snap = self.stats.snapshot()
        snap["skipped_steps"] = self._skipped_steps
        snap["overlap"] = dict(self.overlap_counts)
        # syncs run (and schedule="drift"'s signal) since the step plan was built; None: no sync set
        snap["momentum_sync"] = self._plan.momentum_sync_stats() if self._plan is not None else None
        return snap

    # ------------------------------------------------------------------ state
    def state_bytes(self) -> dict:
        """This rank's optimizer-state bytes: ``momentum`` (per parameter, or its shards with
        voters="node"), ``master`` (voters="node": fp32 master shards of bf16/fp16 parameters),
        ``spare`` (momentum_double_buffer), ``workspace`` (the step buffers node voters and
        master-only sharding keep between steps: docs/node_voters.md), and ``params``: the voting
        parameters' count."""
        out = self.momenta.state_bytes()
        out["workspace"] = workspace_bytes(self._plan.sharding) if self._plan is not None else 0
        out["params"] = sum(p.numel() for g in self.param_groups for p in g["params"] if p.requires_grad)
        return out

    def _sharding(self):
        """The step's sharding strategy (lioncub_ds.sharding), or None when not distributed or when
        no state is sharded (no plan is built then: saving or loading must not install hooks)."""
        if not self.distributed or not self._topology.strategy.shards_state:
            return None
        return self.plan.sharding

    def _node_layout(self) -> dict | None:
        """Sharded state: what this rank's shards are (saved with them; a load must match it)."""
        sharding = self._sharding()
        return sharding.layout() if sharding is not None else None

    def state_layout(self) -> dict:
        """What this rank's optimizer state is a piece of, without its tensors (what
        :mod:`lioncub_ds.checkpoint` reshards by; ``state_dict()["lioncub"]`` carries the same keys).
        ``{"node": None}`` when every rank holds a momentum per parameter (flat voting); with
        voters="node" or master-only sharding ``"node"`` is the layout of its shards
        (:meth:`lioncub_ds.sharding.Flat.layout`): ``voters`` (Nn, or "rank" for master-only
        sharding), ``node_size`` L, ``local_rank``, ``numels`` (the shard sizes), ``map`` (per
        bucket index, the [parameter index, offset] of each parameter in the full bucket, whose
        shard ``local_rank`` of L equal shards this rank holds) and ``masters`` (the buckets with
        fp32 master shards)."""
        return {"node": self._node_layout()}

    #: the momentum sync's state from :meth:`load_state_dict`, held until the step plan is built
    #: (which takes it; lioncub_ds.momentum_sync.check_sync_state says what it holds)
    momentum_sync_state = None

    def current_momentum_sync_state(self) -> dict | None:
        """The momentum sync's schedule and counters as a checkpoint holds them (the step plan's, or,
        before it is built, what load_state_dict gave); None without a momentum sync."""
        return self._plan.momentum_sync_state() if self._plan is not None else self.momentum_sync_state

    def state_dict(self):
        sd = super().state_dict()
        sd["lioncub"] = {"format": STATE_FORMAT, "step": self._step_count, "skipped_steps": self._skipped_steps,
                         "world_size": self.world_size, "rank": self.rank, "comm_stats": self.stats.state_dict()}
        # the momentum sync's schedule (drift: the trigger and this rank's pending signal) and
        # counters: without them a resumed run syncs after other steps (docs/checkpoints.md)
        sync = self.current_momentum_sync_state()
        if sync is not None:
            sd["lioncub"]["momentum_sync"] = sync
        layout = self.state_layout()["node"]
        if layout is not None:  # this rank's shards (a per-rank checkpoint file holds them)
            sh = self.momenta.shards
            sd["lioncub"]["node"] = dict(layout, momentum={i: t.clone() for i, t in sh["momentum"].items()},
                                         master={i: t.clone() for i, t in sh["master"].items()})
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("lioncub", None)
        node = self._check_node_state((extra or {}).get("node"))
        try:
            sync = check_sync_state((extra or {}).get("momentum_sync"))
        except ValueError as exc:
            raise LionCubConfigError(f"LionCub.load_state_dict: {exc}; no state was changed") from None
        # torch casts floating state to the parameter's dtype; keep the momenta exact instead.
        saved = saved_momenta(self, state_dict, "LionCub")
        for p, m in saved.items():
            bad = nonfinite_count(m) if self.distributed else 0  # one process keeps them, as Lion does
            if bad:
                raise LionCubConfigError(
                    f"LionCub.load_state_dict: the momentum of parameter {tuple(p.shape)} holds {bad} non-finite "
                    "value(s); allowed: finite momenta (at N > 1 every later step would be skipped); no state was "
                    "changed")
        # torch takes a saved group's param_names over the live ones; the bucket layout and
        # momentum_sync.layers read them, so they must name these parameters: a checkpoint of another
        # pipeline stage (Megatron's common state comes from global rank 0) named stage 0's here
        live_names = [g.get("param_names") for g in self.param_groups]
        super().load_state_dict(state_dict)
        for g, names in zip(self.param_groups, live_names):
            if names is not None:
                g["param_names"] = names
            elif "param_names" in g and len(g["param_names"]) != len(g["params"]):
                g.pop("param_names")  # a saved list of another length, where this group had none
        restore_momenta(self, saved, self.config.momentum_dtype)
        if node is not None:  # on the parameters' device (a file is read to the CPU)
            device = next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))
            self.momenta.shards = {
                "momentum": {int(i): t.to(device=device, dtype=self.config.momentum_dtype).clone()
                             for i, t in node["momentum"].items()},
                "master": {int(i): t.to(device=device, dtype=torch.float32).clone() for i, t in node["master"].items()}}
        if extra is not None:
            self._step_count = int(extra.get("step", 0))
            self._skipped_steps = int(extra.get("skipped_steps", 0))
            if "comm_stats" in extra:
                self.stats.load_state_dict(extra["comm_stats"])
            if self._plan is not None:
                self._plan.load_momentum_sync_state(sync)
            else:  # the step plan takes it when it is built
                self.momentum_sync_state = sync

    def _check_node_state(self, node):
        """The saved shards must be this rank's shards of this layout (same Nn or master-only
        sharding, L, local rank, bucket sizes and parameters in them). Raises before anything is
        loaded; :func:`lioncub_ds.checkpoint.load` reshards per-rank files of another layout."""
        mine = self._node_layout()
        if same_layout({"node": node}, {"node": mine}):
            return node
        where = ""
        if node is not None and mine is not None and all(node.get(k) == mine.get(k) for k in ("voters", "node_size")):
            where = f" (local rank {node.get('local_rank')}, shards of {node.get('numels')} elements; this rank: " \
                    f"local rank {mine.get('local_rank')}, {mine.get('numels')})"
        raise LionCubConfigError(
            f"LionCub.load_state_dict: the state was saved with {describe_layout(node)}{where}, this "
            f"optimizer has {describe_layout(mine)}; allowed: the layout it was saved with (voters, node_size, "
            "ranks, bucket_size_mb); to change the layout, load the per-rank files with "
            "lioncub_ds.checkpoint.load(opt, directory, reshard='average'), which reshards them; no state was changed")

    @property
    def step_count(self) -> int:
        """Applied optimizer steps (skipped steps do not count); the tie rules use it."""
        return self._step_count

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = call_closure(closure)
        if not self.distributed:
            self._local_lion_step()
            return loss
        step = self._step_count + 1
        outcome = self.plan.run(step)
        if not outcome.applied:
            self._skipped_steps += 1
            if self.config.nonfinite == "raise":
                raise NonFiniteError(f"LionCub: {outcome.message}; nonfinite='raise'. No state was changed.")
            log.warning("LionCub: %s: step skipped on every rank", outcome.message)
            return loss
        self._step_count = step
        if self.config.drift_check_every and step % self.config.drift_check_every == 0:
            self.check_replicas()  # its bytes count towards the next step
        return loss

    def _local_lion_step(self):
        # every group checked first: a sparse gradient (the rule of every N, refused there through
        # the step's flags) or a bad lr in a later group leaves the earlier ones unstepped
        work = checked_groups(self.param_groups, lambda p: StepInputError(
            f"LionCub: the gradient of parameter {tuple(p.shape)} is sparse; allowed: a dense gradient of the "
            "parameter's shape; no state was changed"))
        for g, params, lr in work:
            b1, b2 = g["betas"]
            lion_functional(params, [p.grad for p in params], [self.momenta.get(p) for p in params], lr=lr, beta1=b1,
                            beta2=b2, weight_decay=g["weight_decay"], foreach=self.config.foreach)
            count_steps([self.state[p] for p in params])
        self._step_count += 1

    # ------------------------------------------------------------------ overlap with backward
    def _may_launch(self) -> bool:
        """A gradient-ready hook may start votes: outside no_sync() and when the launch
        condition (if any) agrees."""
        return self._no_sync_depth == 0 and (self._launch_condition is None or self._launch_condition())

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
        if self.distributed:
            self.plan.pipe.launch_all()

    def zero_grad(self, set_to_none: bool = True):
        # Votes started in backward for gradients now being discarded. No collective here: whether
        # this rank started any is its own (a rank whose batch left a parameter of a bucket without a
        # gradient started none), so draining here could pair with nothing on another rank. They are
        # marked stale instead: the next step() agrees on that through its flags, and every rank
        # drains and votes again there, together.
        if self._plan is not None and self._plan.pipe.busy:
            self._plan.pipe.stale = True
        super().zero_grad(set_to_none=set_to_none)

    def sync_momenta(self, scope: str = "world", *, all_params: bool = False) -> None:
        """Average the momenta now, over the vote group (``scope="world"``) or this rank's node
        subgroup (``scope="node"``, needs momentum_sync.group='node'). Collective: every rank of
        the group must call it. Which momenta: those momentum_sync.layers selects (all when it is
        not set), in momentum_sync.dtype (default fp32); ``all_params=True``: every voting
        parameter's momentum in fp32 over the vote group (a checkpoint that stores one replica
        for every rank, e.g. Megatron's)."""
        if scope not in ("world", "node"):
            raise LionCubConfigError(f"LionCub.sync_momenta: invalid scope={scope!r}; allowed: 'world' | 'node'")
        if all_params and scope != "world":
            raise LionCubConfigError("LionCub.sync_momenta(all_params=True) averages over the vote group; allowed: "
                                     "scope='world'")
        if not self.distributed:
            return
        if scope == "node" and self._topology.sync_node_group is None:
            raise LionCubConfigError("LionCub.sync_momenta(scope='node') needs momentum_sync={'group': 'node', ...}")
        if all_params:
            self.plan.average_all_momenta()
        else:
            self.plan.sync_momenta(scope)

    # ------------------------------------------------------------------ drift guard
    def check_replicas(self, action: str | None = None) -> bool:
        """Compare parameter checksums across ranks. True if identical.

        On a mismatch: ``action`` (default: the drift_action setting) "raise" names the first
        differing parameters; "resync" broadcasts every parameter from group rank 0.
        """
        if not self.distributed:
            return True
        return self.plan.check_replicas(action or self.config.drift_action, self._step_count)


def _check_shard_groups(sg, process_group):
    """``shard_groups=``: a :class:`~lioncub_ds.groups.ShardGroups`; the step's ranks are its
    ``world`` (a ``process_group`` given as well must be that group)."""
    from .groups import ShardGroups
    if not isinstance(sg, ShardGroups):
        raise LionCubConfigError(f"LionCub: shard_groups={type(sg).__name__} is not a lioncub_ds.groups.ShardGroups; "
                                 "allowed: None or lioncub_ds.groups.make_shard_groups(...)")
    if process_group is not None and process_group is not sg.world:
        raise LionCubConfigError("LionCub: process_group and shard_groups=... both given and the group is not "
                                 "shard_groups.world; allowed: only shard_groups (the step's ranks are its world)")
    return sg.world


def check_shard_settings(cfg) -> None:
    """With ``shard_groups=`` the framework's shard groups are the layout: settings that make one
    of LionCub's own (or hook the autograd graph of parameters it does not see) are refused."""
    req = requested(cfg)
    bad = [(k, v) for k, v in (("voters", "node" if req.node_voters else None), ("node_size", req.node_size),
                               ("overlap", cfg.overlap or None))
           if v is not None]
    ms = cfg.momentum_sync
    if ms is not None and ms.per_node:
        bad.append(("momentum_sync.group", ms.group))
    if bad:
        k, v = bad[0]
        raise LionCubConfigError(f"LionCub: {k}={v!r} with shard_groups=...: the framework's shard groups are the "
                                 "layout (each shard group is one voter, its peers vote); allowed: leave voters, "
                                 "node_size and overlap unset and momentum_sync.group='world' (the integration sets "
                                 "the groups)")


def _resolved(resolve, cfg, n):
    """(value, None) or (None, this rank's error text) of ``resolve(cfg, n)``."""
    try:
        return resolve(cfg, n), None
    except ValueError as exc:
        return None, str(exc)


def _constructor_signature() -> inspect.Signature:
    """LionCub.__init__'s signature as help() and inspect show it: made from the settings, so the
    constructor's keywords cannot drift from LionCubConfig."""
    P = inspect.Parameter
    out = [P("self", P.POSITIONAL_OR_KEYWORD), P("params", P.POSITIONAL_OR_KEYWORD)]
    out += [P(k, P.POSITIONAL_OR_KEYWORD, default=_DEFAULTS[k]) for k in POSITIONAL]
    out += [P(k, P.KEYWORD_ONLY, default=_DEFAULTS[k]) for k in LionCubConfig.keys() if k not in POSITIONAL]
    out += [P(k, P.KEYWORD_ONLY, default=None) for k in CONSTRUCTOR_ONLY]
    return inspect.Signature(out)


LionCub.__init__.__signature__ = _constructor_signature()
LionCub.__doc__ = LionCub.__doc__.rstrip() + "\n\n" + constructor_doc(POSITIONAL)
