"""ZeRO stage 1/2: replace the all-gather of updated parameters by an all-gather of 1-bit signs.

DeepSpeed's ``DeepSpeedZeroOptimizer.step`` lets each rank update its own fp32 partition,
copies it into the (fp32/bf16/fp16) flat parameter buffer and all-gathers the partitions
(``all_gather_dp_groups``): (N-1)/N * P * 4 bytes per rank and step for fp32 parameters,
P * 2 for bf16. A Lion update is ``θ <- θ*(1 - lr*wd) - lr*Δ`` with ``Δ = sign(c)`` in
{-1, 0, +1}, so a rank that holds the same θ as the partition owner can apply the update
itself from Δ alone: 1 bit per parameter, plus (only on steps where some real coordinate
has c == 0 exactly) a second "nonzero" bit plane. That is 32x fewer bytes than the fp32
parameter all-gather, 16x fewer than bf16.

Where replicas reproduce the owner's result exactly:

* **fp32 parameters** (no extra memory): every rank's flat buffer *is* an fp32 replica.
  The owner applies the same update to its master partition (and the flat copy of it)
  with the same arithmetic (:func:`lioncub_ds.kernels.reference.apply_update`), so all ranks stay
  bit-identical.
* **bf16 / fp16 parameters** with ``zero_fp32_replica: true``: every rank keeps an fp32
  replica of all parameters (extra memory: 4 bytes per parameter per rank, i.e. what
  ZeRO-1/2 saved on master weights, minus nothing: the owner's master partition is kept
  too), updates it from the signs and casts it into the low-precision buffer.
  Without the replica the low-precision copies cannot reproduce the fp32 master, and the
  integration keeps DeepSpeed's parameter all-gather (``zero_allgather: "auto"``) or
  refuses (``"sign"``).

Conventions: the bit order is lioncub_ds.kernels.reference's (LSB first); the alignment padding of
DeepSpeed's flat buffers never moves (Δ = 0 there on every rank, no bits needed); a real
coordinate whose c is exactly 0 (or non-finite) does not move (the nonzero plane carries it).
One all-gather per step carries every group's sign bits plus one flag byte per rank saying
whether the nonzero plane follows.
"""
from __future__ import annotations

import time
import weakref

import torch

from .. import kernels
from ..comm.base import Collectives
from ..telemetry import CommStats, ring_bytes
from . import _compat

_TAG = "_lioncub_ds_sign_allgather"  # on DeepSpeed's first flat buffer: weakref to its adapter


class ZeroSignAllGatherError(RuntimeError):
    pass


def make_allgather_dispatch(orig):
    """Wrap DeepSpeed's ``all_gather_dp_groups``: sign all-gather where enabled and pending."""

    def all_gather_dp_groups(groups_flat, partitioned_param_groups, dp_process_group, start_alignment_factor,
                             allgather_bucket_size):
        ref = getattr(groups_flat[0], _TAG, None) if groups_flat else None
        adapter = ref() if ref is not None else None
        if adapter is not None and adapter.parts is partitioned_param_groups and adapter.pending:
            return adapter.run()
        return orig(groups_flat, partitioned_param_groups, dp_process_group, start_alignment_factor,
                    allgather_bucket_size)

    return all_gather_dp_groups


def _pad_ranges(zopt, i, flat_numel):
    """Sorted [a, b) ranges of the flat buffer of group ``i`` that hold no parameter."""
    offsets = zopt.round_robin_bit16_offsets
    metas = zopt.round_robin_bit16_meta
    real = sorted((int(o), int(o) + int(m.numel())) for o, m in zip(offsets[i], metas[i]))
    gaps, pos = [], 0
    for a, b in real:
        if a > pos:
            gaps.append((pos, a))
        pos = max(pos, b)
    if pos < flat_numel:
        gaps.append((pos, flat_numel))
    return gaps


class ZeroSignAllGather:
    """The per-engine adapter; see the module doc.

    Collectives go through :class:`lioncub_ds.comm.base.Collectives` (bytes and time in a
    :class:`~lioncub_ds.telemetry.CommStats`, failures as ``CollectiveError``); the local
    direction, the bit packing and the apply go through the kernel backend of the
    parameters' device (``local_step`` and ``vote_apply`` with one voter: Δ = the owner's
    sign, 0 where it abstains).
    """

    def __init__(self, zopt, lion, replica: bool):
        missing = _compat.zero_missing(zopt)
        if missing:
            raise ZeroSignAllGatherError(f"this DeepSpeed's ZeRO optimizer lacks {', '.join(missing)}")
        self.lion = lion
        self.parts = zopt.parallel_partitioned_bit16_groups
        self.flat = zopt.bit16_groups_flat
        self.masters = zopt.single_partition_of_fp32_groups
        groups = zopt.real_dp_process_group
        self.group = groups[0]
        if any(g is not self.group for g in groups):
            raise ZeroSignAllGatherError("parameter groups use different data-parallel groups (MoE?)")
        self.stats = CommStats()
        self.coll = Collectives(self.group, self.stats)
        self.n = self.coll.world_size
        self.rank = self.coll.rank
        self.psize = [int(p[0].numel()) for p in self.parts]
        for i, ps in enumerate(self.psize):
            if self.flat[i].numel() != ps * self.n or any(int(p.numel()) != ps for p in self.parts[i]):
                raise ZeroSignAllGatherError(f"group {i}: partitions are not equal slices of the flat buffer")
        self.nbytes = [(ps + 7) // 8 for ps in self.psize]
        self.offsets, off = [], 0
        for nb in self.nbytes:
            self.offsets.append(off)
            off += nb
        self.total_bytes = off
        self.replica = None
        if replica:
            # Equal to every owner's master now: DeepSpeed built each master as flat_partition.float().
            self.replica = [f.detach().float().clone() for f in self.flat]
        dev = self.flat[0].device
        self.backend = kernels.backend_for(dev.type)
        self.pad_index = []  # [group][partition] -> LongTensor of local padding positions
        for i, ps in enumerate(self.psize):
            gaps = _pad_ranges(zopt, i, self.flat[i].numel())
            per = []
            for j in range(self.n):
                lo, hi = j * ps, (j + 1) * ps
                idx = [torch.arange(max(a, lo) - lo, min(b, hi) - lo) for a, b in gaps if min(b, hi) > max(a, lo)]
                per.append(torch.cat(idx).to(dev) if idx else torch.zeros(0, dtype=torch.long, device=dev))
            self.pad_index.append(per)
        self.master_index = {id(m): i for i, m in enumerate(self.masters)}
        self.pending: dict = {}
        self.steps = 0
        self.param_allgather_bytes = 0
        self.nonzero_plane_steps = 0
        self.last_step: dict = {}
        self._hook = lion.register_step_pre_hook(self._pre_step)
        setattr(self.flat[0], _TAG, weakref.ref(self))

    # -------------------------------------------------------------- memory
    def extra_memory_bytes(self) -> int:
        """Bytes this adapter keeps beyond DeepSpeed's own buffers (the fp32 replica)."""
        return sum(r.numel() * 4 for r in self.replica) if self.replica is not None else 0

    # -------------------------------------------------------------- step
    @torch.no_grad()
    def _pre_step(self, optimizer, args, kwargs):
        """Runs inside DeepSpeed's ``_optimizer_step(i)``: encode this partition's Δ."""
        for g in optimizer.param_groups:
            p = g["params"][0]
            i = self.master_index.get(id(p))
            if i is None:
                continue
            ps = self.psize[i]
            pad = self.pad_index[i][self.rank]
            if p.grad is not None:
                grad = p.grad.reshape(-1)
                if pad.numel():
                    grad.index_fill_(0, pad, 0.0)  # padding never moves, on the owner's master either
                m = optimizer.state.get(p, {}).get("exp_avg")
                m = torch.zeros(ps, dtype=torch.float32, device=p.device) if m is None else m.reshape(-1)
            else:
                grad = torch.zeros(ps, dtype=torch.float32, device=p.device)
                m = grad
            # c = beta1*m + (1-beta1)*g packed to sign / nonzero planes; momentum untouched (Lion updates it).
            sign, nonzero, n_nonfinite, n_zero = self.backend.local_step(
                [grad], [m], [0], self.nbytes[i] * 8, g["betas"][0], g["betas"][1], False)
            abstain = n_nonfinite + n_zero - int(pad.numel()) > 0
            snap = None if self.replica is not None else self.masters[i].detach().clone()
            self.pending[i] = {"sign": sign, "nonzero": nonzero, "abstain": abstain,
                               "lr": float(g["lr"]), "wd": float(g["weight_decay"]), "snapshot": snap}

    def _apply(self, target, j, i, sign, nonzero, lr, wd):
        """target (a flat fp32 slice of partition j) <- Lion update with Δ = owner j's sign (0 where it abstains)."""
        pad = self.pad_index[i][j]
        keep = target[pad].clone() if pad.numel() else None
        self.backend.vote_apply(sign, nonzero, [target], [0], lr, wd, 1, "zero", "majority", 1, 0,
                                return_delta=False)
        if keep is not None:
            target[pad] = keep  # padding does not move (its sign bit is 0 when no nonzero plane is sent)

    @torch.no_grad()
    def run(self):
        """All-gather the packed signs and apply every partition's update on every rank."""
        t0 = time.perf_counter()
        pending, self.pending = self.pending, {}
        if len(pending) != len(self.parts):
            missing = sorted(set(range(len(self.parts))) - set(pending))
            raise ZeroSignAllGatherError(f"ZeRO step updated groups {sorted(pending)} but not {missing}")
        dev = self.flat[0].device
        flag = torch.tensor([1 if any(v["abstain"] for v in pending.values()) else 0], dtype=torch.uint8, device=dev)
        signs = self.coll.all_gather(torch.cat([pending[i]["sign"] for i in range(len(self.parts))] + [flag]),
                                     "zero_sign")
        nonzero = None
        if bool(signs[:, -1].any()):
            nonzero = self.coll.all_gather(torch.cat([pending[i]["nonzero"] for i in range(len(self.parts))]),
                                           "zero_nonzero")
            self.nonzero_plane_steps += 1
        for i, ps in enumerate(self.psize):
            lr, wd = pending[i]["lr"], pending[i]["wd"]
            o, nb = self.offsets[i], self.nbytes[i]
            target = self.replica[i] if self.replica is not None else self.flat[i]
            for j in range(self.n):
                sign_j = signs[j:j + 1, o:o + nb].contiguous()
                nz_j = nonzero[j:j + 1, o:o + nb].contiguous() if nonzero is not None else None
                if j == self.rank and self.replica is None:
                    x = pending[i]["snapshot"]           # the owner's pre-step master == everyone's replica
                    self._apply(x, j, i, sign_j, nz_j, lr, wd)
                    target[j * ps:(j + 1) * ps].copy_(x)
                    self.masters[i].copy_(x)
                else:
                    self._apply(target[j * ps:(j + 1) * ps], j, i, sign_j, nz_j, lr, wd)
            if self.replica is not None:
                self.flat[i].copy_(self.replica[i])  # one rounding fp32 -> bf16/fp16, identical everywhere
                self.masters[i].copy_(self.replica[i][self.rank * ps:(self.rank + 1) * ps])
        baseline = sum(ring_bytes("all_gather", f.numel() * f.element_size(), self.n) for f in self.flat)
        self.stats.end_step()
        sent = self.stats.last_step["bytes_sent"]
        self.steps += 1
        self.param_allgather_bytes += baseline
        self.last_step = {"bytes_sent": sent, "param_allgather_bytes": baseline, "nonzero_plane": nonzero is not None,
                          "time_s": time.perf_counter() - t0}

    @torch.no_grad()
    def refresh(self):
        """Re-sync the fp32 replica from every owner's fp32 master (after a checkpoint load)."""
        if self.replica is None:
            return
        for i, master in enumerate(self.masters):
            out = self.coll.all_gather(master.detach().float().reshape(-1), "zero_replica_refresh")
            self.replica[i].copy_(out.reshape(-1))

    def snapshot_stats(self) -> dict:
        cum = self.stats.snapshot()["cumulative"]
        s = {"steps": self.steps, "bytes_sent": cum["bytes_sent"], "param_allgather_bytes": self.param_allgather_bytes,
             "nonzero_plane_steps": self.nonzero_plane_steps, "comm_time_s": cum["comm_time_s"],
             "by_collective": cum["by_collective"], "by_purpose": cum["by_algorithm"],
             "last_step": dict(self.last_step)}
        s["ratio_vs_param_allgather"] = (s["param_allgather_bytes"] / s["bytes_sent"]) if s["bytes_sent"] else None
        s["extra_memory_bytes"] = self.extra_memory_bytes()
        return s

    def close(self):
        self._hook.remove()
        if getattr(self.flat[0], _TAG, None) is not None:
            delattr(self.flat[0], _TAG)


def maybe_enable_sign_allgather(engine, lion, options):
    """Install the sign all-gather on a ZeRO-1/2 engine when the options and the setup allow it.

    Returns (adapter or None, why it is off or None).
    """
    mode = options.get("zero_allgather", "auto")
    replica = bool(options.get("zero_fp32_replica", False))
    if mode == "params":
        return None, "zero_allgather=\"params\""
    zopt = engine.optimizer
    why = None
    if type(zopt) is not _compat.zero_optimizer_class():
        why = f"the ZeRO wrapper is {type(zopt).__name__}, not DeepSpeedZeroOptimizer"
    elif getattr(zopt, "cpu_offload", False):
        why = "optimizer offload is on"
    elif getattr(zopt, "torch_autocast_gradscaler", None) is not None:
        why = "torch_autocast's GradScaler steps the optimizer"
    elif _compat.zero_missing(zopt):
        why = f"this DeepSpeed's ZeRO optimizer lacks {', '.join(_compat.zero_missing(zopt))}"
    elif zopt.bit16_groups_flat and zopt.bit16_groups_flat[0].dtype != torch.float32 and not replica:
        why = (f"parameters are {zopt.bit16_groups_flat[0].dtype} and the fp32 master lives only on its owner; "
               "set \"zero_fp32_replica\": true (+4 bytes/parameter/rank) to let every rank reproduce it")
    adapter = None
    if why is None:
        try:
            low_precision = zopt.bit16_groups_flat[0].dtype != torch.float32
            adapter = ZeroSignAllGather(zopt, lion, replica=replica and low_precision)
        except ZeroSignAllGatherError as exc:
            why = str(exc)
    if why is not None and mode == "sign":
        raise ZeroSignAllGatherError(f"LionCub: zero_allgather='sign' is not possible here: {why}")
    return adapter, why
