"""How a distributed step's state and inputs are laid out over the ranks: one sharding strategy,
chosen once, when the step plan is built (:func:`make_sharding`).

* :class:`Flat` (``voters="rank"``, no ``node_size``): every rank votes with its own full
  momentum over the whole bucket layout.
* :class:`MasterOnly` (``voters="rank"`` with ``node_size`` L > 1): every rank still votes as in
  Flat, so Δ is the flat vote's; only the fp32 master of bf16/fp16 parameters is sharded over
  the node group: the apply goes to this rank's master shard, then the group all-gathers the
  shards into the parameters. fp32 buckets are applied as in flat voting.
* :class:`NodeVoters` (``voters="node"``, docs/node_voters.md): shard inside a node
  group, vote across node groups. World N = Nn groups × L consecutive ranks. Every flat bucket
  of the layout is padded to a multiple of 8·Nn·L and cut into L equal shards; local rank k of
  every group owns shard k. Per step, on the rank (group j, local rank k):

  1. the group's gradients are reduce-scattered: an all_to_all inside the group (in the
     gradients' dtype), then the L rows are summed in fp32 in local-rank order (row 0 + row 1 +
     ... + row L−1, one add at a time) and divided by L: ḡ_jk, the same bits on every platform;
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
* :class:`Instances` (Megatron's distributed optimizer with K instances): a framework steps this
  rank's shards, and LionCub votes flat on them across the instances; the step's decisions are
  also agreed over the instance.

The plan (:class:`lioncub_ds.pipeline.StepPlan`) asks every strategy the same things and never
asks which one it holds:

* what the step votes on: ``full`` (the buckets of the real parameters), ``buckets`` (what the
  pipeline votes on), ``frozen``; the collectives ``coll`` (the vote) and ``world_coll`` (every
  rank of the step);
* what the step's inputs are: :meth:`launch_order` (the order collectives of its own follow),
  :meth:`take` (a bucket's gradients are complete in backward, overlap=True: what may run now),
  :meth:`taken` / :meth:`started` / :meth:`reads` (what it read, to tell whether that changed since),
  :meth:`begin` (at the start of step()), :meth:`inputs`; :meth:`next_momenta` /
  :meth:`commit_momenta` (momentum_double_buffer);
* how the step's decisions are agreed by every rank of the step: :meth:`agree` (the flags),
  :meth:`count_everywhere` (the parameters without a gradient);
* what is kept: :meth:`keep` (an idle parameter's state), :meth:`momenta` (which momenta exist),
  :meth:`synced_momenta`, :meth:`layout` (what a checkpoint of this rank's shards must match),
  :meth:`after_resync`;
* how the step finishes: :meth:`redirect` (where a bucket's apply goes), :meth:`finish`,
  :meth:`abandon` (a skipped or refused step).
"""
from __future__ import annotations

import torch

from .comm import Collectives
from .config import LionCubConfigError
from .flags import flag_head_words, flag_words
from .groups import FLAT, INSTANCES, MASTER_ONLY, NODE_VOTERS
from .layout import Bucket, build_buckets
from .telemetry import ring_bytes


# ----------------------------------------------------------------------------- shard pieces
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


def bucket_members(opt, bucket: Bucket) -> list:
    """[index among ``opt``'s parameters, offset in the bucket] of every parameter of ``bucket``
    (the shard map a checkpoint carries: lioncub_ds.checkpoint reshards by it)."""
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    return [[index[id(p)], off] for p, off in zip(bucket.params, bucket.offsets)]


def copy_pieces_from_params(pieces, flat) -> None:
    for p, start, length, at in pieces:
        flat[at:at + length].copy_(p.detach().reshape(-1)[start:start + length])


def keep_pieces(get_flat, pieces, ids) -> list:
    """(get_flat, offset, copy) of the pieces of the flat shard ``get_flat()`` that belong to the
    parameters whose ``id`` is in ``ids``, for :meth:`Kept.restore_pieces` after the step (which
    asks ``get_flat()`` again: with momentum_double_buffer the step replaces the momentum shard)."""
    flat = get_flat()
    return [(get_flat, at, flat[at:at + length].clone()) for q, _, length, at in pieces if id(q) in ids]


# Checksums (fingerprints) are computed in chunks of this many elements (bounded memory).
FINGERPRINT_CHUNK = 1 << 20


def fingerprints(tensors, device) -> torch.Tensor:
    """int64 [len(tensors), 2] on ``device``: per tensor the sum of its bit patterns and a
    position-weighted sum, computed in chunks of FINGERPRINT_CHUNK elements (memory bounded by the
    chunk, whatever the tensor's size). Integer sums wrap identically on every rank and for every
    value (NaN included), and stay on the device (no host read)."""
    out = torch.zeros(len(tensors), 2, dtype=torch.int64, device=device)
    for i, t in enumerate(tensors):
        flat = t.detach().reshape(-1)
        size = flat.element_size()
        ints = flat.view(torch.int32 if size == 4 else torch.int16 if size % 2 == 0 else torch.uint8)
        for start in range(0, ints.numel(), FINGERPRINT_CHUNK):
            chunk = ints[start:start + FINGERPRINT_CHUNK].to(torch.int64)
            idx = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=chunk.device)
            idx.remainder_(65521)
            out[i, 0] += chunk.sum()
            out[i, 1] += chunk.mul_(idx).sum()
    return out


def replicas_differ(tensors, device, all_reduce_max) -> torch.Tensor:
    """bool [len(tensors)] on ``device``: whether each tensor differs on some rank of a group of
    replicas. ``all_reduce_max(t)``: MAX in place over that group. One all-reduce of the
    :func:`fingerprints` and their negations: MAX and MIN at once (equal everywhere iff max == min)."""
    fp = fingerprints(tensors, device).reshape(-1)  # two int64 checksums per tensor
    both = torch.cat([fp, -fp])
    all_reduce_max(both)
    hi, neg_lo = both[:fp.numel()], both[fp.numel():]
    return (hi != -neg_lo).reshape(-1, 2).any(dim=1)


def grad_versions(params) -> list:
    """(gradient, its in-place version) of every parameter that has a gradient: what a step read."""
    return [(p.grad, p.grad._version) for p in params if p.grad is not None]


def versions_differ(then, now) -> bool:
    """A gradient replaced, removed, added or modified in place (e.g. clipped) between two
    :func:`grad_versions` of the same parameters."""
    return len(now) != len(then) or any(a is not c or v != w for (a, v), (c, w) in zip(now, then))


class GradRead:
    """What a step read of some parameters' gradients, to tell later whether they changed since.

    ``versions`` (host, free) catches a gradient replaced, removed or added, and an in-place edit
    that torch counts. An edit through ``.data`` (``p.grad.data.mul_(c)``, common in hand-written
    clipping) is not counted, so a read made before step() (``watch``: in backward with
    overlap=True, or by prepare_step()) also keeps a device-side :func:`fingerprints` of the
    gradients: step() compares it on the device and counts the result into the step's flags,
    whose one host read it already makes. A read made inside step() needs no fingerprint: nothing
    can edit the gradients between it and the vote."""

    __slots__ = ("params", "versions", "fingerprint")

    def __init__(self, params, device, watch: bool):
        self.params = list(params)
        self.versions = grad_versions(self.params)
        self.fingerprint = (fingerprints([g for g, _ in self.versions], device)
                            if watch and self.versions else None)

    def replaced(self) -> bool:
        return versions_differ(self.versions, grad_versions(self.params))


def reads_changed(reads, device):
    """Whether any gradient of the :class:`GradRead` ``reads`` changed since it was read: True when
    the host can tell (:meth:`GradRead.replaced`); else an int32 [1] on ``device``, 1 when some
    watched gradient's bits differ from its fingerprint (for the step's flags: no host read);
    False when nothing was watched."""
    reads = [r for r in reads if r is not None]
    if any(r.replaced() for r in reads):
        return True
    watched = [r for r in reads if r.fingerprint is not None]
    if not watched:
        return False
    # versions unchanged: the same gradient tensors, in the same order as when they were read
    then = torch.cat([r.fingerprint for r in watched])
    now = torch.cat([fingerprints([g for g, _ in r.versions], device) for r in watched])
    return (now != then).any().to(torch.int32).reshape(1)


def reconcile_master(flat, pieces) -> None:
    """After the parameters were re-synchronized (``check_replicas(action="resync")``): each
    element of the fp32 master shard ``flat`` that still rounds to its (re-synchronized) 16-bit
    parameter keeps its exact fp32 value; an element that does not (this rank's parameter was
    overwritten) takes the parameter's value. A rank whose parameters were perturbed and resynced
    thus continues exactly like a rank that never drifted."""
    for p, start, length, at in pieces:
        value = p.detach().reshape(-1)[start:start + length]
        master = flat[at:at + length]
        master.copy_(torch.where(master.to(value.dtype) == value, master, value.to(master.dtype)))


def padding_of(bucket: Bucket) -> list[tuple[int, int]]:
    """The [start, end) ranges of ``bucket`` that no parameter covers (after each 8-aligned
    parameter, and the tail up to the padded size)."""
    gaps, at = [], 0
    for p, off in zip(bucket.params, bucket.offsets):  # (offsets ascend: layout.build_buckets)
        if off > at:
            gaps.append((at, off))
        at = max(at, off + p.numel())
    if bucket.numel > at:
        gaps.append((at, bucket.numel))
    return gaps


def gather_into_params(coll, buckets, shards, workspace, capacity) -> None:
    """All-gather every bucket's shard inside the group (in the parameters' dtype) and copy the
    whole bucket into its parameters, receiving into ``workspace``'s ring (slot sizes
    ``capacity``: :func:`ring_capacity` of ``buckets``): at most its window of all-gathers is in
    flight (a slot is copied out before the bucket after the window takes it), so the receive
    buffers are a window of buckets, not the model."""
    pending: list = []

    def land():
        b, pend = pending.pop(0)
        full = pend.wait().reshape(-1)
        for p, off in zip(b.params, b.offsets):
            p.detach().copy_(full[off:off + p.numel()].view_as(p))

    for i, (b, flat) in enumerate(zip(buckets, shards)):
        if len(pending) >= workspace.window:
            land()
        out = workspace.ring("gathered", i, i, b.numel, b.params[0].dtype, flat.device,
                             capacity[i % workspace.window])[0]  # written whole: padding not read
        pending.append((b, coll.all_gather(flat.to(b.params[0].dtype), "node_all_gather", async_op=True, out=out)))
    while pending:
        land()


def node_group_bytes(buckets: list[tuple[int, int, int]], node_size: int, ranks: int = 2) -> int:
    """Bytes one rank sends per step inside its node group with node voters (the ``intra_node``
    scope of ``comm_stats``): per full bucket of ``(padded numel, gradient itemsize, parameter
    itemsize)`` the reduce-scatter (an all_to_all of the gradients in their dtype) and the
    all-gather of the updated shards (in the parameters' dtype), plus the all-reduce of the step's
    packed flag words as int64 (:meth:`NodeVoters.agree`; ``ranks``: every rank of the step)."""
    out = ring_bytes("all_reduce", 8 * flag_words(len(buckets), ranks), node_size)
    for numel, grad_size, param_size in buckets:
        out += ring_bytes("all_to_all", grad_size * numel, node_size)
        out += ring_bytes("all_gather", param_size * numel, node_size)
    return out


def grad_problem(b) -> str | None:
    """This rank's reason bucket ``b``'s gradients are unusable (sparse, wrong shape or device), or None."""
    for p, name in zip(b.params, b.names):
        gr = p.grad
        if gr is not None and (gr.is_sparse or gr.shape != p.shape or gr.device != p.device):
            return (f"LionCub: the gradient of parameter {name or tuple(p.shape)} is "
                    f"{'sparse' if gr.is_sparse else f'{tuple(gr.shape)} on {gr.device}'}; allowed: a dense "
                    f"gradient of the parameter's shape {tuple(p.shape)} on {p.device}")
    return None


class Kept:
    """What a step keeps of the parameters no rank has a gradient for (as Lion leaves them): their
    shard pieces (restored before the group's all-gathers, which then carry the old values) and
    their values and per-parameter momenta (restored after)."""

    def __init__(self, pieces=(), params=()):
        self.pieces = list(pieces)   # (get_flat, offset, copy): keep_pieces
        self.params = list(params)   # (param, value, momentum or None)

    def restore_pieces(self) -> None:
        for get_flat, at, values in self.pieces:
            get_flat()[at:at + values.numel()].copy_(values)

    def restore_params(self, store) -> None:
        for p, value, m in self.params:
            p.copy_(value)
            if m is not None:
                store.get(p).copy_(m)


# ----------------------------------------------------------------------------- strategies
class Flat:
    """Every rank votes with its own full momentum over the whole bucket layout."""

    #: the optimizer state follows the bucket layout: momentum (and master) shards kept by bucket index,
    #: in fp32 (a later layout must keep the old buckets; float64 parameters are refused)
    holds_shards = False

    def __init__(self, opt, topology):
        cfg = opt.config
        self.opt, self.store, self.topology = opt, opt.momenta, topology
        self.coll = self.world_coll = Collectives(topology.group, opt.stats, cfg.timeout_s, scope=topology.vote_scope)
        self.buckets, self.frozen = build_buckets(opt.param_groups, cfg.bucket_numel, topology.world_size)
        self.full = self.buckets

    # ------------------------------------------------------------------ the step's inputs
    def launch_order(self, order) -> None:
        """The order the plan launches the buckets' votes in (its communication batches'): a
        strategy that issues collectives of its own for the step's inputs issues them in it."""

    def take(self, i: int) -> list:
        """Bucket ``i``'s gradients are all there (overlap=True: the gradient-ready hooks in
        backward): start what reads them. Returns the buckets whose local step may run now:
        here bucket ``i`` itself (its local step reads its gradients)."""
        return [i]

    def taken(self, i: int) -> bool:
        """Whether bucket ``i``'s gradients were read outside its local step this step (none here)."""
        return False

    def started(self) -> bool:
        """Whether this step's inputs are being gathered by collectives of the strategy's own."""
        return False

    def reads(self) -> list:
        """The :class:`GradRead` of the gradients the strategy read outside the local steps (which
        keep their own), to tell whether they changed since: none here."""
        return []

    def begin(self, watch: bool = False) -> None:
        """At the start of step() (nothing to prepare: each bucket reads its own gradients);
        ``watch``: called before step() (see :class:`GradRead`)."""

    def inputs(self, i: int):
        """(gradients, momenta, indices of parameters without a gradient here, this rank's reason
        the bucket's gradients are unusable or None) for bucket ``i``'s local step."""
        b = self.buckets[i]
        # A parameter without a gradient on this rank votes with g = 0 (its momentum still
        # decays); every rank must run the same collectives, whatever its batch used.
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
        momenta = [self.store.get(p) for p in b.params]
        return grads, momenta, [k for k, p in enumerate(b.params) if p.grad is None], grad_problem(b)

    def next_momenta(self, i: int) -> list:
        """momentum_double_buffer: where bucket ``i``'s local pass writes the next momenta (spares,
        one per momentum :meth:`inputs` gives)."""
        return [self.store.next(p) for p in self.buckets[i].params]

    def commit_momenta(self, i: int, nxt) -> None:
        """momentum_double_buffer: the step is agreed, :meth:`next_momenta`'s become the momenta."""
        for p, m in zip(self.buckets[i].params, nxt):
            self.store.commit(p, m)

    def baseline(self, i: int) -> tuple[int, int]:
        """(gradients, ranks) of the fp32 all-reduce bucket ``i`` stands in for (telemetry)."""
        return self.full[i].real_numel, self.topology.world_size

    # ------------------------------------------------------------------ agreement
    def agree(self, words: torch.Tensor) -> torch.Tensor:
        """The step's flag words (packed for every rank of the step, on the device, already summed
        over the vote group) summed over every rank of the step, still on the device: the step's
        one host read comes after."""
        return words

    def count_everywhere(self, counts: torch.Tensor) -> None:
        """Sum per-parameter counts (of :attr:`full`'s parameters) over every rank that holds them."""
        self.coll.all_reduce_(counts, "missing_grads")

    # ------------------------------------------------------------------ what is kept
    def keep(self, idle) -> Kept:
        """Copies of what the step must leave as it is for the ``idle`` parameters (no gradient on
        any rank): values and momenta (the step may replace a momentum tensor: double buffering)."""
        return Kept(params=[(p, p.detach().clone(), self.store.get(p).clone()) for p in idle])

    def momenta(self) -> list:
        """Every momentum this rank holds: one per voting parameter (or its shards)."""
        return [self.store.get(p) for b in self.full for p in b.params]

    def synced_momenta(self, selected) -> list:
        """What the momentum sync averages: the momenta of the ``selected`` parameters."""
        return [self.store.get(p) for p in selected]

    def layout(self) -> dict | None:
        """What this rank's saved shards are (a load must match it; :func:`describe_layout` says it
        in words; :mod:`lioncub_ds.checkpoint` reshards by its ``map``: per bucket, the [parameter
        index, offset] of every parameter in the full bucket); None: no shards."""
        return None

    # ------------------------------------------------------------------ the drift check
    def replicas(self):
        """The collectives over the ranks that hold what this rank steps, value for value (the
        drift check compares them): every rank of the step."""
        return self.world_coll

    def agree_found(self, found: bool) -> bool:
        """Whether any rank of the step found a drift (the replicas' verdict is everyone's here)."""
        return found

    def after_resync(self) -> None:
        """The parameters were just broadcast from rank 0 (nothing else derives from them here)."""

    # ------------------------------------------------------------------ how it finishes
    def redirect(self, i: int, job) -> None:
        """Where bucket ``i``'s apply goes (after its vote is counted): the parameters themselves."""

    def finish(self) -> None:
        """After the apply (nothing to gather: every rank applied to its own full parameters)."""

    def abandon(self) -> None:
        """A skipped or refused step: forget the step's buffers."""


class Instances(Flat):
    """Shards stepped by a framework (Megatron's distributed optimizer with K instances): this
    rank votes flat on its shards with its shard peers (one rank per instance); the step-wide
    decisions (skip, refuse) are also summed over ``agree_group``, the ranks of this rank's
    instance that step the other shards of the same parameters, so every rank of the
    data-parallel group decides alike."""

    def __init__(self, opt, topology):
        super().__init__(opt, topology)
        cfg = opt.config
        self.world_coll = Collectives(topology.full_group, opt.stats, cfg.timeout_s)
        self.agree_coll = Collectives(topology.agree_group, opt.stats, cfg.timeout_s, scope="intra_node")

    def replicas(self):
        """The shard peers: the one rank per instance that holds this rank's shard."""
        return self.coll

    def agree_found(self, found: bool) -> bool:
        """Summed over the instance, so that every rank raises or re-synchronizes together."""
        device = self.full[0].params[0].device if self.full else torch.device("cpu")
        flag = torch.tensor([int(found)], dtype=torch.int32, device=device)
        self.agree_coll.all_reduce_(flag, "drift_flag")
        return flag.item() > 0

    def agree(self, words: torch.Tensor) -> torch.Tensor:
        """Only the step-wide head is summed over the instance: the per-bucket entries belong to
        this rank's shard layout, which its shard peers share but its instance peers do not. In
        int64: the non-finite count (2**20 per rank at most) grows with every rank summed."""
        words = words.to(torch.int64)
        ms = self.opt.config.momentum_sync  # schedule="drift": its word is part of the head
        head = words[:flag_head_words(self.topology.ranks, ms is not None and ms.drift)]  # a prefix: reduced in place
        self.agree_coll.all_reduce_(head, "instance_flags")
        return words


def workspace_bytes(sharding) -> int:
    """Bytes of the step buffers a sharding strategy keeps from one step to the next (its
    :class:`Workspace`: node voters' gradient send / receive buffers, ḡ and work shards and the
    all-gather's receive buffers; master-only's all-gather buffers); none for flat voting."""
    ws = getattr(sharding, "workspace", None)
    return 0 if ws is None else ws.nbytes()


# Whole-bucket step buffers (node voters' gradient send / receive buffers, the all-gather's receive
# buffers) exist for this many buckets at once, reused in turn: the memory is WINDOW buckets, not
# the model (a 7B model in bf16 kept 42 GB of them per GPU). Four lets the group's collectives run
# up to three buckets ahead of the local steps that consume them.
WINDOW = 4


class Workspace:
    """A step's buffers, kept from one step to the next. A fresh CPU buffer costs an allocation
    and its first touch (~0.4 GB/s here against ~12 GB/s for a reused one: node voters spent a
    third of their step on it, docs/planner.md); a GPU's caching allocator hides that, but holds
    the same memory.

    * :meth:`get`: one buffer per (name, bucket), remade when its size, dtype or device changes.
      What it held at the last step is never read: its user writes all of it, or every element
      but the padding, which nothing writes and stays zero from the buffer's creation.
    * :meth:`ring`: :data:`WINDOW` buffers per name, bucket-sized, shared in turn by the buckets
      of a step (slot = the bucket's position in the step's order, modulo the window). Its user
      frees a slot (waits for and reads what is in it) before the next bucket takes it, and, where
      the padding is read, zeroes it when the slot held another bucket last (``ring`` says so):
      node voters' reduce-scatter sends it, and a shard of padding only (a small bucket's) votes
      on it, so what a skipped step's non-finite gradients left there would skip the next step."""

    def __init__(self, window: int = WINDOW):
        self.bufs: dict = {}
        self.window = window
        self.owner: dict = {}  # ring slot -> the bucket that took it last

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bufs.values())

    def get(self, name: str, i: int, numel: int, dtype, device, zero: bool = False) -> torch.Tensor:
        buf = self.bufs.get((name, i))
        if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != torch.device(device):
            buf = torch.zeros(numel, dtype=dtype, device=device)
            self.bufs[(name, i)] = buf
        elif zero:
            buf.zero_()
        return buf

    def ring(self, name: str, position: int, bucket: int, numel: int, dtype, device,
             capacity: int) -> tuple[torch.Tensor, bool]:
        """(``numel`` elements of ``dtype`` in slot ``position % window`` of ``name``, whether
        another bucket took the slot last): a buffer of ``capacity`` bytes (the largest bucket
        that takes this slot, :func:`ring_capacity`: no slot is remade when buckets differ in
        size), zeroed when made."""
        key = (name, position % self.window)
        buf = self.bufs.get(key)
        if buf is None or buf.numel() < capacity or buf.device != torch.device(device):
            buf = self.bufs[key] = torch.zeros(capacity, dtype=torch.uint8, device=device)
            self.owner[key] = bucket
        other = self.owner[key] != bucket
        self.owner[key] = bucket
        return buf[:numel * dtype.itemsize].view(dtype), other


def ring_capacity(buckets, window: int = WINDOW) -> list[int]:
    """Bytes of each :meth:`Workspace.ring` slot for these buckets in the order they take the
    slots: slot s holds the largest of the buckets at positions s, s + window, ... (in its
    parameters' dtype). With no more buckets than slots, each slot is its one bucket's size."""
    out = [0] * window
    for k, b in enumerate(buckets):
        out[k % window] = max(out[k % window], b.numel * b.params[0].element_size())
    return out


class _MasterShardsMixin:
    """The persistent fp32 master shards of bf16/fp16 buckets (``store.shard("master", i)``)."""

    def master_pieces(self):
        """(master shard, pieces) of every sharded bucket whose master exists."""
        raise NotImplementedError

    def after_resync(self) -> None:
        """The parameters were broadcast from rank 0: every master element that no longer rounds
        to its parameter takes the parameter's value; the others stay exact (never re-made from
        the 16-bit values, which would make a resynced run depart from one that never drifted)."""
        for flat, pieces in self.master_pieces():
            reconcile_master(flat, pieces)


class MasterOnly(_MasterShardsMixin, Flat):
    """Master-only sharding: every rank votes with its own full momentum over the whole bucket, so
    Δ is the flat vote's; only the fp32 master of bf16/fp16 parameters is sharded over the node
    group. The apply goes to this rank's master shard (the vote jobs are pointed at its pieces,
    with their parameter-local tie indices), then the group all-gathers the shards into the
    parameters. fp32 buckets are applied as in flat voting."""

    holds_shards = True

    def __init__(self, opt, topology):
        super().__init__(opt, topology)
        self.node_coll = Collectives(topology.node_group, opt.stats, opt.config.timeout_s, scope="intra_node")
        self.size, self.local_rank = topology.node_size, topology.local_rank
        self.sharded = [i for i, b in enumerate(self.buckets) if b.params[0].dtype != torch.float32]
        self.pieces = {i: shard_pieces(self.buckets[i], self.size, self.local_rank) for i in self.sharded}
        self.workspace = Workspace()  # the all-gather's receive buffers, kept across steps
        self.gather_capacity = ring_capacity([self.buckets[i] for i in self.sharded])

    def master(self, i: int) -> torch.Tensor:
        b = self.buckets[i]
        numel = b.numel // self.size
        return self.store.shard("master", i, numel, torch.float32, b.params[0].device,
                                fill=lambda flat: copy_pieces_from_params(self.pieces[i], flat))

    def master_pieces(self):
        masters = self.store.shards["master"]
        return [(masters[i], self.pieces[i]) for i in self.sharded if i in masters]

    def keep(self, idle) -> Kept:
        kept = super().keep(idle)
        if idle:
            ids = {id(p) for p in idle}
            kept.pieces = [k for i, pieces in self.pieces.items()
                           for k in keep_pieces(lambda i=i: self.master(i), pieces, ids)]
        return kept

    def layout(self) -> dict:
        return {"voters": "rank", "node_size": self.size, "local_rank": self.local_rank,
                "numels": [self.buckets[i].numel // self.size for i in self.sharded],
                "map": {i: bucket_members(self.opt, self.buckets[i]) for i in self.sharded},
                "masters": list(self.sharded)}

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
        gather_into_params(self.node_coll, [self.buckets[i] for i in self.sharded],
                           [self.master(i) for i in self.sharded], self.workspace, self.gather_capacity)


class NodeVoters(_MasterShardsMixin):
    """This rank's shard of every flat bucket, its buffers and the group's collectives: the
    group's reduce-scatter, the shard buckets the plan votes on, the all-gather."""

    holds_shards = True
    # every rank of the step holds the full parameters (the all-gather puts them back): the drift
    # check compares all of them, as in flat voting
    replicas = Flat.replicas
    agree_found = Flat.agree_found

    def __init__(self, opt, topology):
        cfg = opt.config
        self.opt, self.store, self.topology = opt, opt.momenta, topology
        # The layout is cut for Nn·L ranks, and the buckets the pipeline votes on are this rank's
        # shards of it.
        self.full, self.frozen = build_buckets(opt.param_groups, cfg.bucket_numel, topology.ranks)
        self.coll = Collectives(topology.group, opt.stats, cfg.timeout_s, scope="inter_node")
        self.node_coll = Collectives(topology.node_group, opt.stats, cfg.timeout_s, scope="intra_node")
        self.world_coll = Collectives(topology.full_group, opt.stats, cfg.timeout_s)
        self.size, self.local_rank = topology.node_size, topology.local_rank
        self.buckets: list[Bucket] = []
        self.pieces: list[list] = []   # per bucket: (param, start inside it, length, offset in the shard)
        for fb in self.full:
            numel = fb.numel // self.size
            lo = self.local_rank * numel
            pieces = shard_pieces(fb, self.size, self.local_rank)
            self.pieces.append(pieces)
            # an empty shard (the bucket's real elements all live in other shards) still votes, with
            # one all-padding piece, so that every shard peer runs the same collectives
            # (an empty shard's one piece is all padding: length 0 in the real-element mask)
            self.buckets.append(Bucket(fb.group_index, [], [None] * max(1, len(pieces)),
                                       [q[3] for q in pieces] or [0], numel, sum(q[2] for q in pieces),
                                       fb.base + lo, param_starts=[q[1] for q in pieces] or [0],
                                       lengths=[q[2] for q in pieces] or [0],
                                       kind=(fb.params[0].device, torch.float32)))
        self.device = self.full[0].params[0].device if self.full else torch.device("cpu")
        # the order the group's reduce-scatters are issued in: the plan's vote launch order
        # (launch_order; last buckets first, as backward produces them)
        self.launch_order(reversed(range(len(self.full))))
        self.workspace = Workspace()  # the buffers behind grads, work and the group's collectives
        self.gather_capacity = ring_capacity(self.full)  # the all-gather's slots (layout order)
        self.padding = [padding_of(fb) for fb in self.full]  # zeroed in a send slot that changes hands
        self.abandon()

    def low_precision(self, i: int) -> bool:
        return self.full[i].params[0].dtype != torch.float32

    def _momentum(self, i: int) -> torch.Tensor:
        return self.store.shard("momentum", i, self.buckets[i].numel, self.store.dtype, self.device)

    def _work(self, i: int) -> torch.Tensor:
        """Bucket ``i``'s flat fp32 shard of parameter values: the persistent master for bf16/fp16
        parameters (made from their values the first time); for fp32 parameters a buffer that
        :meth:`redirect` fills with their values just before the apply."""
        sb = self.buckets[i]
        if self.low_precision(i):
            return self.store.shard("master", i, sb.numel, torch.float32, self.device,
                                    fill=lambda flat: copy_pieces_from_params(self.pieces[i], flat))
        # redirect() writes the pieces every step; the padding between them stays zero from the start
        return self.workspace.get("work", i, sb.numel, torch.float32, self.device)

    @staticmethod
    def _views(flat, pieces):
        return [flat[at:at + length] for _, _, length, at in pieces] or [flat]

    # ------------------------------------------------------------------ the step's inputs
    # Every bucket's gradients go through the group's reduce-scatter (an all_to_all), issued in
    # the vote launch order on every rank whenever they are ready: from the gradient-ready hooks
    # during backward (overlap=True, :meth:`take`) or at the start of step() (:meth:`begin`).
    # A bucket's ḡ (and its local step) is made once the reduce-scatter of the bucket after it in
    # that order is in flight too (one bucket behind: the wait finds it done or nearly, and on a
    # GPU it only orders the stream), or at step(). Each group's collectives thus come in one
    # order on every rank, whatever the timing, and the sums are the same as without overlap.
    # The send and receive buffers are a ring of WINDOW bucket-sized slots (Workspace.ring): a
    # bucket's reduce-scatter takes the slot of the bucket WINDOW positions before it, once that
    # one's rows are summed into its ḡ. In backward the local steps run one bucket behind, so the
    # slot is free already; in step() begin() fills the window and each ḡ made issues the next.
    def launch_order(self, order) -> None:
        self.order = list(order)
        self.capacity = ring_capacity([self.full[i] for i in self.order])  # the send / receive slots

    def take(self, i: int) -> list:
        """Bucket ``i``'s gradients are all there: issue the reduce-scatters of every bucket whose
        turn has come (in the launch order, each once its gradients are there); return the
        buckets whose local step may run now (those whose successor's reduce-scatter is issued)."""
        if self.rs[i] is not None:
            return []
        self.complete[i] = True
        return self._issue()

    def taken(self, i: int) -> bool:
        return self.rs[i] is not None

    def started(self) -> bool:
        return self.issued > 0

    def reads(self) -> list:
        """What the issued reduce-scatters read (a gradient changed since: vote again)."""
        return [v for v in self.versions if v is not None]

    def begin(self, watch: bool = False) -> None:
        """Every bucket's gradients are there: issue reduce-scatters (in the launch order) while
        the window has a free slot; :meth:`inputs` issues the rest as it frees slots. ``watch``:
        before step() (prepare_step()), so a later edit of those gradients is caught (GradRead)."""
        for i in self.order:
            self.complete[i] = True
        self.watch = watch
        self._issue(watch, wait=False)

    def _issue(self, watch: bool = True, wait: bool = True, until: int | None = None) -> list:
        """Issue the reduce-scatters whose turn has come, in the launch order (up to bucket
        ``until``). A bucket's slot still held by an earlier bucket's unsummed rows: ``wait``
        sums them first (:meth:`_sum`), else the issue stops there. Returns the buckets whose
        successor in the order is now issued."""
        out = []
        while self.issued < len(self.order) and self.complete[self.order[self.issued]]:
            held = self.held[self.issued % self.workspace.window]
            if held is not None:
                if not wait:
                    break
                self._sum(held)
            i = self.order[self.issued]
            self._reduce_scatter(i, self.issued, watch)
            if self.issued > 0:
                out.append(self.order[self.issued - 1])
            self.issued += 1
            if i == until:
                break
        return out

    def _reduce_scatter(self, i: int, position: int, watch: bool) -> None:
        """Send bucket ``i``'s gradients to their shards' owners in the group (an all_to_all in the
        gradients' dtype), through ring slot ``position`` (its place in the launch order). A rank
        whose gradients are unusable sends zeros (the flags make every rank refuse the step)."""
        fb, ws = self.full[i], self.workspace
        problem = self.problems[i] = grad_problem(fb)
        # indices (in the full bucket) of the parameters without a gradient on this rank: the
        # step leaves a parameter that has none on ANY rank alone, as flat voting does
        self.missing[i] = tuple(k for k, p in enumerate(fb.params) if p.grad is None)
        self.versions[i] = GradRead(fb.params, self.device, watch)  # what was read (a later change: vote again)
        # the gradients travel in their own dtype (torch keeps p.grad in p's dtype, the same on
        # every rank): bf16 halves the group's bytes, and the fp32 sum below is the same
        # (every parameter's slot is written below; the padding is zeroed when the slot held
        # another bucket last: a shard of padding only votes on it, see Workspace)
        dtype, cap = fb.params[0].dtype, self.capacity[position % ws.window]
        flat, other = ws.ring("send", position, i, fb.numel, dtype, self.device, cap)
        if problem is not None:
            flat.zero_()
        else:
            for p, off in zip(fb.params, fb.offsets):
                slot = flat[off:off + p.numel()]
                slot.copy_(p.grad.reshape(-1)) if p.grad is not None else slot.zero_()
            if other:
                for a, b in self.padding[i]:
                    flat[a:b].zero_()
        rows = ws.ring("received", position, i, fb.numel, dtype, self.device, cap)[0].view(self.size, -1)
        self.held[position % ws.window] = i
        self.rs[i] = self.node_coll.all_to_all(flat.view(self.size, -1), "node_reduce_scatter", async_op=True,
                                               out=rows)

    def _sum(self, i: int) -> None:
        """ḡ of bucket ``i``: the L rows its reduce-scatter brought, summed in fp32 in local-rank
        order and divided by L; frees its ring slot."""
        rows = self.rs[i].wait()
        acc = self.workspace.get("grad", i, rows.shape[1], torch.float32, self.device).copy_(rows[0])
        for row in rows[1:]:  # local-rank order: the documented sum, in fp32
            acc.add_(row.to(torch.float32))
        acc.div_(self.size)
        self.grads[i] = acc
        self.held[self.held.index(i)] = None

    def inputs(self, i: int):
        """Views of ḡ and of the momentum shard, piece by piece; the parameters without a gradient
        here and the problem index the full bucket. ḡ: the L rows the reduce-scatter brought,
        summed in fp32 in local-rank order and divided by L; the shard bucket's parameters become
        views of its work buffer."""
        if not self.complete[i]:  # read before step() (prepare_step): watched
            self.begin(watch=True)
        if self.rs[i] is None:  # begin() filled the window before bucket i's turn
            self._issue(self.watch, until=i)
        if self.work[i] is None:
            if self.grads[i] is None:  # (else summed already, to free its slot for a later bucket)
                self._sum(i)
            self.work[i] = self._work(i)
            self.buckets[i].params = self._views(self.work[i], self.pieces[i])
            self._issue(self.watch, wait=False)  # the freed slot takes the next bucket
        return (self._views(self.grads[i], self.pieces[i]), self._views(self._momentum(i), self.pieces[i]),
                self.missing[i], self.problems[i])

    def next_momenta(self, i: int) -> list:
        """momentum_double_buffer: views of the spare momentum shard, piece by piece."""
        return self._views(self.store.next_shard("momentum", i), self.pieces[i])

    def commit_momenta(self, i: int, nxt) -> None:
        self.store.commit_shard("momentum", i)

    def baseline(self, i: int) -> tuple[int, int]:
        return self.full[i].real_numel, self.topology.ranks

    # ------------------------------------------------------------------ agreement
    def agree(self, words: torch.Tensor) -> torch.Tensor:
        """The flag words summed over the shard peers, then over the node group (every rank of the
        step decides from the same sums), in int64: the non-finite count grows with every rank."""
        words = words.to(torch.int64)
        self.node_coll.all_reduce_(words, "node_flags")
        return words

    def count_everywhere(self, counts: torch.Tensor) -> None:
        self.coll.all_reduce_(counts, "missing_grads")  # the shard peers' sum, then the node group's
        self.node_coll.all_reduce_(counts, "node_missing_grads")

    # ------------------------------------------------------------------ what is kept
    def keep(self, idle) -> Kept:
        """The idle parameters' values, and the momentum and master pieces of them in this rank's
        shards (:func:`keep_pieces`)."""
        kept = Kept(params=[(p, p.detach().clone(), None) for p in idle])
        ids = {id(p) for p in idle}
        for i, pieces in enumerate(self.pieces):
            if not any(id(q[0]) in ids for q in pieces):
                continue
            kept.pieces += keep_pieces(lambda i=i: self._momentum(i), pieces, ids)
            if self.low_precision(i):
                kept.pieces += keep_pieces(lambda i=i: self.work[i], pieces, ids)  # the persistent master shard
        return kept

    def momenta(self) -> list:
        shards = self.store.shards["momentum"]
        return [shards[i] for i in sorted(shards)]

    def synced_momenta(self, selected) -> list:
        """What the momentum sync averages over the shard peers: every momentum shard, or with
        ``layers`` the pieces of the selected parameters in this rank's shards (the shard peers
        hold the same pieces, so every voter sends the same lengths in the same order)."""
        ms = self.opt.config.momentum_sync
        if ms is None or not ms.layers:
            return self.momenta()
        ids = {id(p) for p in selected}
        return [self._momentum(i)[at:at + length] for i, pieces in enumerate(self.pieces)
                for p, _, length, at in pieces if id(p) in ids and length > 0]

    def master_pieces(self):
        masters = self.store.shards["master"]
        return [(masters[i], self.pieces[i]) for i in range(len(self.full)) if i in masters]

    def layout(self) -> dict:
        return {"voters": self.topology.world_size, "node_size": self.size, "local_rank": self.local_rank,
                "numels": [b.numel for b in self.buckets],
                "map": {i: bucket_members(self.opt, b) for i, b in enumerate(self.full)},
                "masters": [i for i in range(len(self.full)) if self.low_precision(i)]}

    # ------------------------------------------------------------------ how it finishes
    def redirect(self, i: int, job) -> None:
        """The shard bucket's parameters are the work buffer already; for fp32 parameters it takes
        their values now, just before the apply (the master of bf16/fp16 ones is kept)."""
        if not self.low_precision(i):
            copy_pieces_from_params(self.pieces[i], self.work[i])

    def finish(self) -> None:
        """All-gather the updated shards inside the group (in the parameters' dtype) and copy
        them into the parameters; drop the step's buffers."""
        gather_into_params(self.node_coll, self.full, self.work, self.workspace, self.gather_capacity)
        self.abandon()

    def abandon(self) -> None:
        """Forget the step's gradient and work buffers (the master shards stay), once every
        reduce-scatter issued is done (its buffers may be reused)."""
        for pend in getattr(self, "rs", ()):
            if pend is not None:
                pend.wait()
        n = len(self.full)
        self.complete = [False] * n   # per bucket: its gradients are all there (take, begin)
        self.issued = 0               # reduce-scatters issued this step: a prefix of self.order
        self.rs: list = [None] * n    # per bucket: its reduce-scatter (a Pending)
        self.versions: list = [None] * n  # per bucket: the gradients it read (GradRead)
        self.missing: list = [()] * n  # per bucket: this step's parameters without a gradient on this rank
        self.problems: list = [None] * n
        self.grads: list = [None] * n  # this step's ḡ shard per bucket
        self.held: list = [None] * self.workspace.window  # per ring slot: the bucket whose rows are unsummed
        # the reduce-scatters inputs() issues read the gradients before step() (watched) until
        # begin() says otherwise (its own watch)
        self.watch = True
        self.work: list = [None] * n   # this step's fp32 parameter shard per bucket (the master, or a buffer)
        for sb in self.buckets:
            sb.params = []


def describe_layout(layout: dict | None) -> str:
    """A strategy's :meth:`layout` (as saved with its shards, or None: no shards) in the settings' words."""
    if layout is None:
        return "no sharded state (flat voting: voters='rank' without node_size, or node_size=1)"
    if layout.get("voters") == "rank":
        return (f"voters='rank' with node_size={layout.get('node_size')} (master-only sharding: fp32 master shards "
                "of 16-bit parameters)")
    return f"voters='node' with node_size={layout.get('node_size')} ({layout.get('voters')} node groups voting)"


_BY_MODE = {FLAT: Flat, MASTER_ONLY: MasterOnly, NODE_VOTERS: NodeVoters, INSTANCES: Instances}


def make_sharding(opt, topology):
    """The strategy object of the mode resolved once (``topology.strategy``,
    :func:`lioncub_ds.groups.resolve_strategy`); nothing here decides it again. Sharded state works
    in fp32 (masters of bf16/fp16 parameters): float64 parameters are refused there, by name, on
    every rank alike, before any collective (their updates would be rounded to fp32)."""
    strategy = _BY_MODE[topology.strategy.mode]
    if strategy.holds_shards:
        wide = [p for g in opt.param_groups for p in g["params"] if p.requires_grad and p.dtype == torch.float64]
        if wide:
            raise LionCubConfigError(
                f"LionCub: {len(wide)} float64 parameter(s) (the first of shape {tuple(wide[0].shape)}) with "
                f"{topology.strategy.describe()}: the node group's shards work in fp32, so their updates would be "
                "rounded to fp32; allowed: float32 / bfloat16 / float16 parameters, or voters='rank' without "
                "node_size (flat voting steps float64 as it is)")
    return strategy(opt, topology)
