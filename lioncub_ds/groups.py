"""The process groups LionCub creates, and torch.distributed compat shims.

NCCL's rule (docs/conventions.md, "NCCL contract"): every group is created on EVERY rank of
the world, in the same order, outside the training step. A data-parallel group is usually
one of several (Megatron: one per tensor/pipeline coordinate), and each rank only knows its
own, so :func:`create_on_all_ranks` first all-gathers every rank's wanted member lists once,
then every rank creates the union in one sorted order and keeps the groups it belongs to.
It runs at construction (or ``set_process_group``), never inside ``step()``.
"""
from __future__ import annotations

import atexit
import datetime
import inspect
import numbers
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    """Who a LionCub's step talks to: the vote group (None: the world), its size and this rank's
    place in it, and the node subgroup of ``momentum_sync={"group": "node"}`` (or None)."""
    group: object
    world_size: int
    rank: int
    sync_node_group: object = None
    # voters="node" (L > 1): ``group`` is then this rank's shard peers (one rank per node group,
    # the same local rank: the slow link), ``world_size`` the Nn voters and ``rank`` this node
    # group's index; ``node_group`` holds the L ranks of this rank's node group (the fast link)
    node_group: object = None
    node_size: int = 1
    local_rank: int = 0
    full_group: object = None   # every rank of the vote (None: the world)
    # Shards stepped by a framework (Megatron's distributed optimizer with K instances): ``group``
    # is this rank's shard peers (one rank per instance), voting flat on this rank's shard; the
    # step's decisions (skip, refuse) are also summed over ``agree_group``, the ``agree_size``
    # ranks of this rank's instance that step the other shards of the same parameters (this
    # rank is ``agree_rank`` there), so every rank of the data-parallel group decides alike
    agree_group: object = None
    agree_size: int = 1
    agree_rank: int = 0
    # the link the votes cross (CommStats.by_scope): "inter_node" when the voters are instances
    vote_scope: str = "vote_group"
    # the mode the groups above serve (resolve_strategy); with master-only sharding every rank
    # votes (``group``, ``world_size``, ``rank`` as flat) and only the fp32 master of bf16/fp16
    # parameters is sharded over ``node_group``
    strategy: "Strategy" = None

    @property
    def master_only(self) -> bool:
        return self.strategy.mode == MASTER_ONLY

    @property
    def node_voters(self) -> bool:
        """One voter per node group: ``group`` holds this rank's shard peers."""
        return self.strategy.node_voters

    @property
    def ranks(self) -> int:
        """Ranks taking part in a step: Nn·L (N with master-only sharding; K·L with instances)."""
        if self.master_only:
            return self.world_size
        return self.world_size * self.node_size * self.agree_size

    @property
    def global_rank(self) -> int:
        """This rank's place among :attr:`ranks` (instances are consecutive blocks of ranks)."""
        if self.master_only:
            return self.rank
        return (self.rank * self.node_size + self.local_rank) * self.agree_size + self.agree_rank


# The environment variables that say how many ranks share this rank's machine, in the order they
# are read: torchrun (and most launchers) set LOCAL_WORLD_SIZE; the deepspeed launcher sets
# LOCAL_SIZE instead.
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")


def resolve_ranks_per_node(explicit: int | None = None, setting: str = "node_size") -> int:
    """The ranks of one node group: THE rule, used by every part of LionCub and its integrations
    (node voters' ``node_size``, ``momentum_sync.group_size``, Megatron's per-node peers).

    ``explicit`` (the setting, when given) wins; otherwise ``LOCAL_WORLD_SIZE`` (torchrun), then
    ``LOCAL_SIZE`` (the deepspeed launcher); with neither set an explicit setting is needed.
    Raises ValueError naming ``setting`` (and the variable, when it holds no positive integer)."""
    if explicit is not None:
        return explicit
    for var in LOCAL_SIZE_VARS:
        env = os.environ.get(var)
        if env is None:
            continue
        if not env.strip().isdigit() or int(env) < 1:
            raise ValueError(f"LionCub: {setting}=None takes the ranks per node from {var}, which is {env!r}; "
                             f"allowed: {var} a positive integer, or {setting}=<ranks per node>")
        return int(env)
    raise ValueError(f"LionCub: {setting}=None takes the ranks per node from {' or '.join(LOCAL_SIZE_VARS)}, and "
                     f"neither is set (torchrun sets the first, the deepspeed launcher the second); allowed: "
                     f"{setting}=<ranks per node>")


# ----------------------------------------------------------------------------- the strategy
# The sharding mode, decided here once (issue 47): every other module reads a Strategy (or a
# Request, before the world is known), never the voters / node_size settings themselves, so two
# places cannot decide differently (a voters="node" whose node size resolves to 1 IS flat voting).
FLAT = "flat"                # every rank votes and holds a momentum per parameter
MASTER_ONLY = "master_only"  # every rank votes; the fp32 master of 16-bit parameters is sharded in the node
NODE_VOTERS = "node_voters"  # one voter per node group: momentum (and master) sharded 1/L, votes across groups
INSTANCES = "instances"      # a framework's shard groups (Megatron's instances, ZeRO-3, FSDP2) are the voters
MODES = (FLAT, MASTER_ONLY, NODE_VOTERS, INSTANCES)


@dataclass(frozen=True)
class Request:
    """What the settings ask for, before the world is known: ``mode`` (FLAT, MASTER_ONLY or
    NODE_VOTERS) and the explicit ``node_size`` (None: the launcher's environment). For the
    integrations that decide before a LionCub exists (DeepSpeed's config checks, Megatron's factory);
    the mode a run gets is :func:`resolve_strategy`'s (node voters of one rank per node are flat)."""
    mode: str
    node_size: int | None = None

    @property
    def node_voters(self) -> bool:
        return self.mode == NODE_VOTERS

    @property
    def shards_state(self) -> bool:
        """The settings shard state inside node groups (node voters or master-only sharding)."""
        return self.mode != FLAT

    def ranks_per_node(self) -> int:
        """L: the explicit node_size, else the launcher's (:func:`resolve_ranks_per_node`; ValueError)."""
        return resolve_ranks_per_node(self.node_size, "node_size")


def requested(settings) -> Request:
    """The :class:`Request` of ``settings``: a :class:`~lioncub_ds.config.LionCubConfig`, a mapping
    (a ds_config's ``optimizer.params``, Megatron's lioncub settings) or an argparse namespace
    (``--lioncub-voters`` / ``--lioncub-node-size``). Values are not validated here (the config does)."""
    if isinstance(settings, dict):
        voters, node_size = settings.get("voters", "rank"), settings.get("node_size")
    elif hasattr(settings, "lioncub_voters") or hasattr(settings, "lioncub_node_size"):
        voters = getattr(settings, "lioncub_voters", None) or "rank"
        node_size = getattr(settings, "lioncub_node_size", None)
    else:
        voters, node_size = getattr(settings, "voters", "rank"), getattr(settings, "node_size", None)
    if voters == "node":
        return Request(NODE_VOTERS, node_size)
    return Request(MASTER_ONLY if (node_size or 1) > 1 else FLAT, node_size)


@dataclass(frozen=True)
class Strategy:
    """How a LionCub's step is laid out over its ``ranks``, resolved once from the settings, the
    vote group and the environment (:func:`resolve_strategy`); ``opt.strategy``, carried by its
    :class:`Topology`. ``node_size``: L, the ranks that shard state inside a node group (1: none);
    ``voters``: N, the votes counted per coordinate."""
    mode: str
    ranks: int
    voters: int
    node_size: int = 1

    @property
    def node_voters(self) -> bool:
        return self.mode == NODE_VOTERS

    @property
    def shards_state(self) -> bool:
        """LionCub itself shards state inside node groups (node voters, master-only sharding)."""
        return self.mode in (NODE_VOTERS, MASTER_ONLY)

    def describe(self) -> str:
        """The strategy in the settings' words (log lines, errors)."""
        if self.mode == NODE_VOTERS:
            return f"voters='node' ({self.voters} node groups x {self.node_size} ranks)"
        if self.mode == MASTER_ONLY:
            return f"voters='rank' with node_size={self.node_size} (master-only sharding, {self.voters} voters)"
        if self.mode == INSTANCES:
            return f"shard groups ({self.voters} groups x {self.ranks // max(self.voters, 1)} ranks)"
        return f"flat voting ({self.voters} voters)"


SINGLE = Strategy(FLAT, 1, 1)  # not distributed


def resolve_strategy(settings, ranks: int, shard_groups=None) -> Strategy:
    """THE decision of the sharding mode: ``settings`` (a LionCubConfig) over a vote group of
    ``ranks`` ranks, or a framework's ``shard_groups`` (:class:`ShardGroups`, which are then the
    layout). Node voters take L from ``node_size``, else the launcher (:func:`resolve_ranks_per_node`);
    ``voters="rank"`` with ``node_size`` > 1 is master-only sharding; an L of 1 is flat voting.
    Raises ValueError naming the setting when L cannot be found or does not divide ``ranks``."""
    if shard_groups is not None:
        return Strategy(INSTANCES, shard_groups.groups * shard_groups.shard_size, shard_groups.groups)
    req = requested(settings)
    size = req.ranks_per_node() if req.node_voters else (req.node_size or 1)
    if ranks % size:
        raise ValueError(f"LionCub: node_size={size} does not divide the {ranks} ranks of the vote group; allowed: a "
                         f"divisor of {ranks}")
    if size == 1:
        return Strategy(FLAT, ranks, ranks)
    if req.node_voters:
        return Strategy(NODE_VOTERS, ranks, ranks // size, size)
    return Strategy(MASTER_ONLY, ranks, ranks, size)


def check_voter_settings(settings, error) -> None:
    """The voters / node_size settings' own rules, for the config's validation (``settings`` a
    LionCubConfig; ``error(message)`` makes the exception)."""
    voters, node_size = settings.voters, settings.node_size
    if not isinstance(voters, str) or voters not in ("rank", "node"):
        raise error(f"LionCub: invalid voters={voters!r}; allowed: 'rank' | 'node'")
    if node_size is not None and (isinstance(node_size, bool) or not isinstance(node_size, numbers.Integral)
                                  or node_size < 1):
        raise error(f"LionCub: invalid node_size={node_size!r}; allowed: None (LOCAL_WORLD_SIZE) or an integer >= 1")
    ms = settings.momentum_sync
    if voters == "node" and ms is not None and ms.group != "world":
        raise error("LionCub: momentum_sync group='node' has nothing to average with voters='node' (the ranks of a "
                    "node hold one voter's momentum, sharded, not copies of it); allowed: group='world' (the sync "
                    "averages over the voters)")


def group_ranks(group) -> list[int]:
    """Global ranks of ``group`` (None: the world)."""
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def create_on_all_ranks(wanted: list[list[int]], timeout_s: float | None = None, backend: str | None = None) -> list:
    """Collective over the world: every rank passes the member lists it needs (in any number,
    possibly none) and gets back one group per list, created with ``timeout_s`` (and ``backend``,
    None: the default one).

    Every rank of the world must call this the same number of times, in the same order.
    """
    world = dist.get_world_size()
    gathered = [None] * world
    dist.all_gather_object(gathered, [list(map(int, r)) for r in wanted])
    union = sorted({tuple(r) for lists in gathered for r in lists}, key=lambda r: (len(r), r))
    kw = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s is not None else {}
    if backend is not None:
        kw["backend"] = backend
    created = {}
    for ranks in union:
        created[ranks] = dist.new_group(list(ranks), **kw)
    return [created[tuple(r)] for r in wanted]


@dataclass(frozen=True)
class ShardGroups:
    """A framework's 2-D layout of data-parallel ranks (docs/node_voters.md): ``groups`` shard groups of
    ``shard_size`` consecutive ranks. Inside a shard group the framework shards parameters,
    gradients and optimizer state (DeepSpeed ZeRO-3 on a node, FSDP2's shard mesh dimension: the
    fast link); the ``peers`` of a rank are the one rank per shard group holding the same shard
    (the slow link). LionCub given ``shard_groups=`` steps this rank's shards and votes with its
    peers (each shard group is one voter); the step's decisions (skip, refuse) are agreed over
    ``shard`` too, so every rank of the step decides alike. Made by :func:`make_shard_groups`."""
    shard: object        # the shard_size ranks of this rank's shard group
    peers: object        # the ``groups`` ranks with this rank's shard_rank, one per shard group
    world: object        # every rank of the step (None: the world)
    shard_size: int
    shard_rank: int      # this rank's place in its shard group: which shard it holds
    groups: int          # Nn, the voters
    group_index: int     # which shard group this rank is in


def make_shard_groups(shard_size: int | None = None, *, group=None, timeout_s: float | None = None,
                      backend: str | None = None, setting: str = "shard_size") -> ShardGroups:
    """Create the shard groups and peer groups over ``group`` (None: the world) on every rank of
    the world, in one order (:func:`create_on_all_ranks`). ``shard_size`` None: the ranks per node
    (:func:`resolve_ranks_per_node`), so a shard group is a machine. ``backend`` (e.g. "gloo" for
    shards that live in CPU memory under an NCCL job) makes all three groups, ``world`` too, with
    that backend. Every rank must call it. Raises ValueError (before any group exists) naming
    ``setting`` (the caller's name for the size: ``shard_size`` here, ``node_size`` for node
    voters) and the allowed values when the size cannot be found or does not divide the group."""
    ranks = group_ranks(group)
    size = resolve_ranks_per_node(shard_size, setting)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1 or len(ranks) % size:
        raise ValueError(f"LionCub: {setting}={size!r} (the ranks of one shard group) must be a positive divisor "
                         f"of the {len(ranks)} data-parallel ranks; allowed: one of "
                         f"{[d for d in range(1, len(ranks) + 1) if len(ranks) % d == 0]}")
    me = ranks.index(dist.get_rank())
    k = me % size
    wanted = [consecutive_blocks(ranks, size)[me // size], ranks[k::size]] + ([ranks] if backend else [])
    made = create_on_all_ranks(wanted, timeout_s, backend)
    world = made[2] if backend else group
    return ShardGroups(made[0], made[1], world, size, k, len(ranks) // size, me // size)


def consecutive_blocks(ranks: list[int], size: int) -> list[list[int]]:
    """``ranks`` cut into blocks of ``size`` consecutive members (size divides len(ranks))."""
    return [ranks[i:i + size] for i in range(0, len(ranks), size)]


def world_max(values, device, group=None) -> list[int]:
    """Element-wise MAX of small integers over every rank of ``group`` (default: the world; int64
    on ``device``: the parameters' device, NCCL takes no CPU tensor; every rank calls); the values
    themselves without torch.distributed or with one rank. Decisions that every rank must take
    alike (raise or go on, skip or step)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [int(v) for v in values]
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


# torch >= 2.6 takes broadcast(..., group_src=); older torch (2.4/2.5) only a global src rank.
_BROADCAST_HAS_GROUP_SRC = "group_src" in inspect.signature(dist.broadcast).parameters


def broadcast(tensor, src_group_rank: int, group, async_op: bool = False, *, use_group_src: bool | None = None):
    """``dist.broadcast`` from the group-local rank ``src_group_rank`` on any torch >= 2.4."""
    if use_group_src is None:
        use_group_src = _BROADCAST_HAS_GROUP_SRC
    if use_group_src:
        return dist.broadcast(tensor, group_src=src_group_rank, group=group, async_op=async_op)
    return dist.broadcast(tensor, src=group_ranks(group)[src_group_rank], group=group, async_op=async_op)


# ----------------------------------------------------------------------------- exit
# Why a finished rank can die with "terminate called without an active exception" (SIGABRT)
# while the interpreter exits (issue 17, docs/deepspeed.md "Exit status"); backtraces taken
# with torch 2.13 / CPython 3.11:
#
#   pt_gloo_runloop: ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork -> ~AsyncWork
#     -> TensorImpl::decref_pyobject -> gil_scoped_acquire -> PyEval_AcquireThread
#     -> take_gil -> PyThread_exit_thread -> pthread_exit -> _Unwind_ForcedUnwind
#     -> __gxx_personality_v0 -> std::terminate
#   main thread: Py_FinalizeEx -> finalize_modules
#
# torch's intrusive_ptr keeps a tensor's Python object alive while C++ holds extra references
# to the tensor, and releases it (TensorImpl::decref_pyobject, which takes the GIL) when the
# last extra reference goes (c10/util/intrusive_ptr.h, "PyObject preservation"). A gloo worker
# lets go of a finished Work only after the caller's wait() has returned, so the Work's
# tensors are often released on the worker, GIL and all. When that happens after
# Py_FinalizeEx has begun, CPython < 3.14 ends the thread with pthread_exit, whose forced
# unwind cannot pass the noexcept destructors on the stack: std::terminate
# (pytorch/pytorch#38228; CPython gh-87135 parks such threads instead, from 3.14). It takes a
# collective with tensors in the last milliseconds before the interpreter exits (the HF
# Trainer's last all_gather, in store_flos, is one); whether the caller still references the
# tensor does not matter. Neither LionCub's groups nor its kernels are on the stack.

EXIT_SETTLE_S = 0.05  # LIONCUB_EXIT_SETTLE_S overrides; 0 turns the settle off
_SETTLE_REGISTERED = False
_WORKER_THREAD_PREFIXES = ("pt_gloo", "pt_nccl")


def _has_pg_worker_threads() -> bool:
    """Whether this process may run c10d worker threads: torch.distributed is initialized, or
    (Linux) a thread carries a c10d worker's name (groups can outlive the default group)."""
    if dist.is_available() and dist.is_initialized():
        return True
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith(_WORKER_THREAD_PREFIXES):
                    return True
    except OSError:
        pass
    return False


def settle_pg_workers(seconds: float | None = None) -> float:
    """Release the GIL for ``seconds`` while the interpreter is still whole, so that a c10d
    worker finishing the last collective frees its tensors now, not during the interpreter's
    teardown (see the comment above). Returns the seconds slept (0 without worker threads)."""
    if seconds is None:
        seconds = float(os.environ.get("LIONCUB_EXIT_SETTLE_S", EXIT_SETTLE_S))
    if seconds <= 0 or not _has_pg_worker_threads():
        return 0.0
    time.sleep(seconds)
    return seconds


def settle_at_exit() -> None:
    """Run :func:`settle_pg_workers` at interpreter exit (registered once; LionCub does it when
    it resolves its process group). Best effort: a worker descheduled for longer than the settle
    can still be late. :func:`exit_cleanly` is the sure way out."""
    global _SETTLE_REGISTERED
    if not _SETTLE_REGISTERED:
        _SETTLE_REGISTERED = True
        atexit.register(settle_pg_workers)


_EXIT_CALLBACKS: list = []


def on_exit(fn) -> None:
    """Run ``fn()`` when the process ends: at interpreter exit (atexit) and in
    :func:`exit_cleanly` (which skips atexit); registered once per function, run once."""
    if fn in _EXIT_CALLBACKS:
        return
    _EXIT_CALLBACKS.append(fn)
    atexit.register(_run_exit_callback, fn)


def _run_exit_callback(fn) -> None:
    if fn in _EXIT_CALLBACKS:
        _EXIT_CALLBACKS.remove(fn)
        try:
            fn()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def exit_cleanly(rc: int = 0) -> None:
    """End a finished training process: tear its process groups down, flush, and leave without
    the interpreter's own teardown, where a c10d worker that frees a tensor can abort the
    process ("terminate called without an active exception", see the comment above). Never
    returns."""
    for fn in list(_EXIT_CALLBACKS):  # before the groups go: a callback may ask for the rank
        _run_exit_callback(fn)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
