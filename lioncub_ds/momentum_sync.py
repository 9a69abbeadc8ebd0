"""Selective momentum synchronization (docs/conventions.md, lever 3): when, what and with whom.

Steps are 0-based indices of applied optimizer steps (the first step is 0). A sync
happens right after that step's local momentum update:

* ``schedule="every"``: steps s with s % every == 0;
* ``schedule="geometric"``: T0 = 0, T(j+1) = T(j) + floor(2**(j/k));
* ``until``: only steps s < until;
* ``layers``: only parameters whose names match one of the fnmatch patterns;
* ``group="node"``: the average runs inside subgroups of ``group_size`` consecutive
  ranks (default: the ranks per node, :func:`lioncub_ds.groups.resolve_ranks_per_node`); with
  ``inter_every`` K', every K'-th step (s % K' == 0, same ``until``) averages across the whole
  group instead.

* ``schedule="drift"``: when the votes' disagreement with Δ has risen by ``threshold`` (below).

``dtype="fp32"`` (default): all-reduce(SUM) then divide (ReduceOp.AVG does not exist on gloo).
``dtype="bf16"`` / ``"int8"``: a two-phase average in that format, like the ``1bit`` vote: each
rank encodes its chunk (bf16; int8 = round(m·127/a) with its own a = max|m|, sent along),
``all_to_all`` gives rank r shard r of every rank's codes, rank r decodes them and adds them in
fp32 in rank order, divides by N, encodes the mean shard (int8: with the shard's own max) and
``all_gather`` returns every shard to every rank. Wire bytes per rank: 2·(N−1)/N·P·w (+ scales),
w = 2 or 1: 2x or 4x fewer than the fp32 all-reduce; the sum's order is the project's own, so
every rank (and the simulation in bench converge) gets the same bits at any N.

The drift schedule (``schedule="drift"``, sign votes). A free signal of how far the local momenta
have drifted apart: the fraction of a rank's votes that disagree with the agreed Δ where both are
nonzero (:func:`vote_disagreement`); with node voters a rank casts its voter's votes on its shard,
so its fraction is over that shard, and the sum runs over the Nn·L ranks. Each rank turns its own fraction into
fixed-point units (:func:`disagreement_units`, :func:`drift_scale` per whole fraction) on the
device while it applies step t's Δ; the units ride in step t+1's flag vector (one more int32
word, summed over the ranks with the flags: no collective and no host read of their own), so
step t+1 reads the sum D(t) of every rank's units with its flags, and every rank decides alike
from it (:class:`DriftTrigger`). The sync after step t (1-based, after its momentum update) is
decided from D(t−1), the signal of the step before (which is also what the simulation uses): it
runs when t − (the last sync's step) ≥ ``min_every`` and D(t−1) − B ≥ τ·N·scale, where S is
the last sync's step (0 before the first) and the baseline B the lowest signal since it, min D(u)
over S < u ≤ t−1 (D(S+1), the first, is from votes made with the averaged momenta). The drift
is a *rise* of the disagreement from its low point: early in training the disagreement falls as
the momenta fill, and a baseline fixed at D(S+1) would then never be exceeded. B is known from
step S+2 on, so two syncs are at least 3 steps apart whatever ``min_every``.
"""
from __future__ import annotations

import fnmatch
import math
from functools import lru_cache

import torch

from .config import LionCubConfigError, MomentumSyncConfig
from .groups import resolve_ranks_per_node
# the ring-model bytes of one sync (torch-free, shared with the planner)
from .wire import sync_wire_bytes  # noqa: F401 - re-exported


def geometric_steps(k: float, limit: int) -> list[int]:
    """Sync steps of the geometric schedule below ``limit``: T0=0, T(j+1)=T(j)+floor(2**(j/k))."""
    out, t, j = [], 0, 0
    while t < limit:
        out.append(t)
        if j / k >= 64:  # the next gap is >= 2**64 steps, past any limit (and 2.0 ** 1024 would overflow)
            break
        t += int(math.floor(2.0 ** (j / k)))
        j += 1
    return out


@lru_cache(maxsize=64)
def _geometric_set(k: float, limit: int) -> frozenset:
    return frozenset(geometric_steps(k, limit))


def on_schedule(cfg: MomentumSyncConfig, s: int) -> bool:
    if cfg.until is not None and s >= cfg.until:
        return False
    if cfg.schedule == "every":
        return s % cfg.every == 0
    # geometric: membership among all T(j) <= s (cache in chunks of 4096 steps)
    limit = (s // 4096 + 1) * 4096
    return s in _geometric_set(cfg.k, limit)


def select_params(cfg: MomentumSyncConfig, named: list[tuple[str | None, torch.Tensor]]) -> list[torch.Tensor]:
    if not cfg.layers:
        return [p for _, p in named]
    if any(name is None for name, _ in named):
        raise LionCubConfigError("LionCub: momentum_sync.layers needs parameter names; pass model.named_parameters() "
                                 "or param groups carrying 'param_names' (or 'names')")
    return [p for name, p in named if any(fnmatch.fnmatchcase(name, pat) for pat in cfg.layers)]


def node_group_size(group_size: int | None, n: int) -> int:
    """The node subgroup size: ``group_size``, else the ranks per node
    (:func:`lioncub_ds.groups.resolve_ranks_per_node`); must divide the group size ``n``."""
    try:
        group_size = resolve_ranks_per_node(group_size, "momentum_sync.group_size")
    except ValueError as exc:
        raise LionCubConfigError(str(exc)) from None
    if group_size < 1 or n % group_size:
        raise LionCubConfigError(f"LionCub: momentum_sync.group_size={group_size} must divide the group size {n}")
    return group_size


def sync_group_size(cfg, n: int) -> int | None:
    """The node subgroup size of settings ``cfg``'s ``momentum_sync={"group": "node"}`` over a vote
    group of ``n`` ranks (None: no node subgroup)."""
    ms = cfg.momentum_sync
    if ms is None or not ms.per_node or n <= 1:
        return None
    return node_group_size(ms.group_size, n)


class MomentumSync:
    """Decides, per step, whether and where momenta are averaged, and does it."""

    def __init__(self, cfg: MomentumSyncConfig, collectives, node_collectives=None, ranks: int | None = None):
        self.cfg = cfg
        self.world = collectives
        self.node = node_collectives
        # schedule="drift": the decision state, the same on every rank (fed from the flags summed
        # over the ``ranks`` of the step, default the group's)
        self.trigger = (DriftTrigger(cfg.threshold, cfg.min_every, ranks or collectives.world_size) if cfg.drift
                        else None)

    def scope(self, s: int):
        """None, or the Collectives to average over at step index s (drift: as the trigger decides
        from the signals observed so far; :meth:`synced` after averaging)."""
        cfg = self.cfg
        if cfg.drift:
            return self.world if drift_due(cfg, self.trigger, s) else None
        if cfg.per_node:
            if cfg.inter_every is not None and (cfg.until is None or s < cfg.until) and s % cfg.inter_every == 0:
                return self.world
            return self.node if on_schedule(cfg, s) else None
        return self.world if on_schedule(cfg, s) else None

    @staticmethod
    def average_over(coll, momenta: list[torch.Tensor], chunk_numel: int, dtype: str = "fp32") -> None:
        """Average momenta over ``coll``'s group, a few big collectives (one per :func:`sync_chunks`
        chunk): fp32 all-reduces, or the two-phase bf16 / int8 average (module docstring)."""
        if not momenta or coll.world_size <= 1:
            return
        for idx in sync_chunks([m.numel() for m in momenta], chunk_numel):
            chunk = [momenta[i] for i in idx]
            flat = torch.cat([t.reshape(-1).float() for t in chunk])
            if dtype == "fp32":
                coll.all_reduce_(flat, "momentum_sync")
                flat.div_(coll.world_size)
            else:
                flat = MomentumSync._two_phase(coll, flat, dtype)
            off = 0
            for t in chunk:
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()

    @staticmethod
    def _two_phase(coll, flat: torch.Tensor, dtype: str) -> torch.Tensor:
        n, length = coll.world_size, flat.numel()
        shard = -(-length // n)
        padded = torch.zeros(n * shard, dtype=torch.float32, device=flat.device)
        padded[:length] = flat
        rows = sync_encode(padded.view(n, shard), dtype)  # row j goes to rank j (its shard)
        mean = shard_mean(coll.all_to_all(rows, "momentum_sync"), dtype)
        gathered = coll.all_gather(sync_encode(mean.view(1, -1), dtype)[0], "momentum_sync")
        return sync_decode(gathered, dtype).reshape(-1)[:length]


# ----------------------------------------------------------------------------- the drift schedule
DRIFT_UNITS = 1 << 16  # fixed-point units of one rank's whole disagreement fraction


def drift_scale(world_size: int) -> int:
    """Units of one rank's whole fraction: 2**16, less past 2**15 ranks, so the sum over the ranks
    fits the int32 flag word (sums of raw counts would not: N·P passes 2**31 on large models)."""
    return min(DRIFT_UNITS, (2 ** 31 - 1) // max(1, world_size))


def vote_disagreement(sign: torch.Tensor, nonzero: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """int64 [..., 2] on the device: [this voter's votes that disagree with Δ where both are
    nonzero, the coordinates where both are nonzero]. ``sign`` / ``nonzero``: the voter's packed
    planes (uint8 [..., B], LSB first: c > 0, c ≠ 0), ``delta``: the agreed Δ [8·B] (any real
    values: only their signs count, so an averaged Δ works alike)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=sign.device)
    pos = ((sign.unsqueeze(-1) >> shifts) & 1).flatten(-2).bool()
    voted = ((nonzero.unsqueeze(-1) >> shifts) & 1).flatten(-2).bool()
    both = voted & (delta != 0)
    differ = both & (pos != (delta > 0))
    return torch.stack([differ.sum(-1), both.sum(-1)], dim=-1)


def disagreement_units(counts: torch.Tensor, world_size: int) -> torch.Tensor:
    """int64 counts [..., 2] ([disagree, both], summed over a voter's buckets) -> the voter's
    fraction in units of :func:`drift_scale` (floored; 0 where it cast no vote), on the device."""
    differ, both = counts[..., 0], counts[..., 1]
    return torch.where(both > 0, differ * drift_scale(world_size) // both.clamp(min=1), torch.zeros_like(both))


def drift_due(cfg: MomentumSyncConfig, trigger: "DriftTrigger", s: int) -> bool:
    """schedule="drift": whether the sync at 0-based step index ``s`` runs (the trigger's rule,
    within ``until``); LionCub and the simulation both ask this."""
    return trigger.due(s + 1) and (cfg.until is None or s < cfg.until)


class DriftTrigger:
    """When schedule="drift" syncs (module docstring): host state fed with the summed signal
    D (every rank's :func:`disagreement_units`) of each applied step, the same on every rank (the
    sums are the step's agreed flags) and in the simulation (which calls it with the same sums)."""

    def __init__(self, threshold: float, min_every: int, world_size: int):
        self.min_every = min_every
        self.needed = threshold * world_size * drift_scale(world_size)  # τ in units of summed fractions
        self.last_sync = 0       # the step of the last sync (0: none yet)
        self.baseline = None     # the lowest D since it, once one is known
        self.signal = None       # (step, D) of the latest observed step

    def observe(self, step: int, summed: int) -> None:
        """D of applied step ``step`` (known at the next step, from its flags)."""
        self.signal = (step, int(summed))
        if step > self.last_sync:  # the low point since the last sync (module docstring)
            self.baseline = int(summed) if self.baseline is None else min(self.baseline, int(summed))

    def due(self, step: int) -> bool:
        """Whether the sync after applied step ``step`` runs (from D of step − 1)."""
        if self.baseline is None or self.signal is None or step - self.last_sync < self.min_every:
            return False
        return self.signal[1] - self.baseline >= self.needed

    def synced(self, step: int) -> None:
        self.last_sync, self.baseline = step, None

    def state_dict(self) -> dict:
        return {"last_sync": self.last_sync, "baseline": self.baseline,
                "signal": None if self.signal is None else list(self.signal)}

    def load_state_dict(self, sd: dict) -> None:
        self.last_sync, self.baseline = int(sd["last_sync"]), sd["baseline"]
        self.signal = None if sd["signal"] is None else tuple(int(x) for x in sd["signal"])


# ----------------------------------------------------------------------------- checkpointed state
# What a checkpoint keeps of the momentum sync (``state_dict()["lioncub"]["momentum_sync"]``), so
# that a resumed run syncs after the same steps as an uninterrupted one (docs/checkpoints.md):
#   "syncs", "last_sync": the counters (comm_stats()["momentum_sync"]);
#   "trigger": schedule="drift": DriftTrigger.state_dict() (last sync step, low point, latest signal);
#   "pending": schedule="drift": the signal of the last applied step, which the next step reads
#     with its flags: {"step": t, "units": this rank's disagreement_units} (per rank: every rank's
#     file holds its own), or {"step": t, "sum": D(t)} once summed over the ranks (agreed: the one
#     replica of a checkpoint that keeps one for every rank, after LionCub.sync_momenta(all_params=True)).


def check_sync_state(value) -> dict | None:
    """A saved momentum-sync state (above) as host values, or ValueError naming what is wrong
    (checked before a load changes anything)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"the saved momentum_sync state is a {type(value).__name__}; allowed: a dict")
    try:
        out = {"syncs": int(value.get("syncs", 0)), "last_sync": int(value.get("last_sync", 0)), "trigger": None,
               "pending": None}
        trig = value.get("trigger")
        if trig is not None:
            signal = trig["signal"]
            out["trigger"] = {"last_sync": int(trig["last_sync"]),
                              "baseline": None if trig["baseline"] is None else int(trig["baseline"]),
                              "signal": None if signal is None else [int(signal[0]), int(signal[1])]}
        pend = value.get("pending")
        if pend is not None:
            kind = "sum" if "sum" in pend else "units"
            out["pending"] = {"step": int(pend["step"]), kind: int(pend[kind])}
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"the saved momentum_sync state is malformed ({type(exc).__name__}: {exc}); allowed: what "
                         "LionCub.state_dict() writes") from None
    return out


def summed_pending(states) -> tuple[int, int] | None:
    """(t, D(t)) from every old rank's saved momentum-sync state (a resharded resume reads them
    all): the sum of their pending units, or the sum one of them already holds; None when some
    rank has nothing pending for that step (nothing to observe)."""
    pending = [(check_sync_state(s) or {}).get("pending") for s in states]
    if not pending or any(p is None for p in pending) or len({p["step"] for p in pending}) > 1:
        return None
    if "sum" in pending[0]:
        return pending[0]["step"], pending[0]["sum"]
    if any("units" not in p for p in pending):
        return None
    return pending[0]["step"], sum(p["units"] for p in pending)


def resharded_sync_state(value, pending_sum: tuple[int, int] | None, same_ranks: bool) -> dict | None:
    """The momentum-sync state of a resharded resume (lioncub_ds.checkpoint): the counters and the
    last sync's step carry over; the per-rank pending units belong to the old layout's ranks, so
    the pending signal is their sum ``pending_sum`` ((step, D) over every old rank's file, or
    None). The signals are sums over the ranks: with another number of ranks the trigger starts
    its low point again (no baseline, no signal, nothing pending)."""
    state = check_sync_state(value)
    if state is None:
        return None
    state["pending"] = {"step": pending_sum[0], "sum": pending_sum[1]} if pending_sum is not None else None
    if not same_ranks:
        state["pending"] = None
        if state["trigger"] is not None:
            state["trigger"].update(baseline=None, signal=None)
    return state


# ----------------------------------------------------------------------------- bf16 / int8 averaging
def sync_encode(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """Rows of fp32 values [R, L] -> uint8 rows [R, W]: bf16 codes, or int8 codes followed by the
    row's fp32 scale a = max|x| (q = round(x * fl(127 / a)), ties to even; a = 0 -> q = 0)."""
    if dtype == "bf16":
        return x.to(torch.bfloat16).contiguous().view(torch.uint8)
    a = x.abs().amax(dim=1, keepdim=True) if x.shape[1] else torch.zeros(x.shape[0], 1, device=x.device)
    inv = torch.where(a > 0, 127.0 / torch.where(a > 0, a, torch.ones_like(a)), torch.zeros_like(a))
    q = torch.round(x * inv).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q.view(torch.uint8), a.contiguous().view(torch.uint8)], dim=1)


def sync_decode(rows: torch.Tensor, dtype: str) -> torch.Tensor:
    """Inverse of :func:`sync_encode`: uint8 rows [R, W] -> fp32 [R, L] (int8: q * fl(a / 127))."""
    if dtype == "bf16":
        return rows.contiguous().view(torch.bfloat16).float()
    q = rows[:, :-4].contiguous().view(torch.int8).float()
    a = rows[:, -4:].reshape(-1).clone().view(torch.float32).view(-1, 1)  # a fresh, aligned copy
    return q * (a / 127.0)


def shard_mean(received: torch.Tensor, dtype: str) -> torch.Tensor:
    """Every rank's encoded shard [N, W] -> their fp32 mean, summed in rank order."""
    vals = sync_decode(received, dtype)
    acc = vals[0].clone()
    for r in range(1, vals.shape[0]):
        acc = acc + vals[r]
    return acc / vals.shape[0]


def quantized_average(rows: torch.Tensor, dtype: str) -> torch.Tensor:
    """What every rank ends with after a bf16 / int8 sync of N ranks' flat chunks ``rows`` [N, L]
    (the executable contract of the collective path in :meth:`MomentumSync.average_over`)."""
    n, length = rows.shape
    shard = -(-length // n)
    padded = torch.zeros(n, n * shard, dtype=torch.float32, device=rows.device)
    padded[:, :length] = rows
    out = []
    for j in range(n):
        sent = sync_encode(padded[:, j * shard:(j + 1) * shard], dtype)  # row r: rank r's shard j
        mean = shard_mean(sent, dtype)
        out.append(sync_decode(sync_encode(mean.view(1, -1), dtype), dtype)[0])
    return torch.cat(out)[:length]


def sync_chunks(numels: list[int], chunk_numel: int) -> list[list[int]]:
    """How a sync groups the momenta into collectives: indices of consecutive momenta while their
    elements fit ``chunk_numel`` (a larger one alone). The real sync, the simulation and the
    planner's bytes all chunk this way."""
    chunks, cur, size = [], [], 0
    for i, numel in enumerate(numels):
        if cur and size + numel > chunk_numel:
            chunks.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += numel
    if cur:
        chunks.append(cur)
    return chunks


def sync_bytes(numels: list[int], world_size: int, dtype: str, chunk_numel: int) -> int:
    """Bytes one rank sends for one sync of momenta of ``numels`` elements (chunked as
    :func:`sync_chunks`, each chunk :func:`sync_wire_bytes`)."""
    return sum(sync_wire_bytes(sum(numels[i] for i in idx), world_size, dtype)
               for idx in sync_chunks(numels, chunk_numel))


