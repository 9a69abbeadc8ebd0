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
whether the nonzero plane follows. Every rank then applies all partitions of all groups with one
backend call (``zero_sign_apply``: unpack, decay, apply and the cast into the low-precision
buffer, one kernel), with no per-rank loop; the step's one host read is that flag (whether the
second all-gather, of the nonzero planes, follows: every rank must know before issuing it).
"""
from __future__ import annotations

import time
import weakref

import torch

from .. import kernels
from ..comm.base import Collectives
from ..kernels.reference import zero_layout
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


def _real_ranges(zopt, i, flat_numel):
    """Sorted, disjoint [a, b) ranges of the flat buffer of group ``i`` that hold parameters (the
    rest is alignment padding)."""
    offsets = zopt.round_robin_bit16_offsets
    metas = zopt.round_robin_bit16_meta
    spans = sorted((int(o), min(int(o) + int(m.numel()), flat_numel)) for o, m in zip(offsets[i], metas[i]))
    out = []
    for a, b in spans:
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class ZeroSignAllGather:
    """The per-engine adapter; see the module doc.

    Collectives go through :class:`lioncub_ds.comm.base.Collectives` (bytes and time in a
    :class:`~lioncub_ds.telemetry.CommStats`, failures as ``CollectiveError``); the local
    direction, the bit packing and the apply go through the kernel backend of the
    parameters' device (``local_step``, then ``zero_sign_apply`` over every partition: Δ = the
    owner's sign, 0 where it abstains).
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
        real = [_real_ranges(zopt, i, self.flat[i].numel()) for i in range(len(self.psize))]
        # every partition of every group: where its votes are in a plane row, which elements are real
        self.layout = zero_layout(self.n, self.psize, self.offsets, real)
        self.pad_index, self.pad_count = [], []  # this rank's partition: local padding positions, their count
        for i, ps in enumerate(self.psize):
            lo, hi = self.rank * ps, (self.rank + 1) * ps
            keep = torch.ones(ps, dtype=torch.bool)
            for a, b in real[i]:
                if min(b, hi) > max(a, lo):
                    keep[max(a, lo) - lo:min(b, hi) - lo] = False
            idx = keep.nonzero().reshape(-1)
            self.pad_index.append(idx.to(dev))
            self.pad_count.append(int(idx.numel()))
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
            pad = self.pad_index[i]
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
            # The counts stay on the device: no host read here.
            sign, nonzero, n_nonfinite, n_zero = self.backend.local_step(
                [grad], [m], [0], self.nbytes[i] * 8, g["betas"][0], g["betas"][1], False, device_counts=True)
            abstain = (n_nonfinite + n_zero) > self.pad_count[i]  # a real coordinate abstained (0-dim bool)
            snap = None if self.replica is not None else self.masters[i].detach().clone()
            self.pending[i] = {"sign": sign, "nonzero": nonzero, "abstain": abstain,
                               "lr": float(g["lr"]), "wd": float(g["weight_decay"]), "snapshot": snap}

    @torch.no_grad()
    def run(self):
        """All-gather the packed signs and apply every partition's update on every rank (one kernel)."""
        t0 = time.perf_counter()
        pending, self.pending = self.pending, {}
        if len(pending) != len(self.parts):
            missing = sorted(set(range(len(self.parts))) - set(pending))
            raise ZeroSignAllGatherError(f"ZeRO step updated groups {sorted(pending)} but not {missing}")
        groups = range(len(self.parts))
        flag = torch.stack([pending[i]["abstain"] for i in groups]).any().to(torch.uint8).reshape(1)
        signs = self.coll.all_gather(torch.cat([pending[i]["sign"] for i in groups] + [flag]), "zero_sign")
        nonzero = None
        if bool(signs[:, -1].any()):  # the step's one host read: does the nonzero all-gather follow?
            nonzero = self.coll.all_gather(torch.cat([pending[i]["nonzero"] for i in groups]), "zero_nonzero")
            self.nonzero_plane_steps += 1
        own = [slice(self.rank * ps, (self.rank + 1) * ps) for ps in self.psize]
        if self.replica is None:
            # this rank's partition restarts from its pre-step master (== every rank's copy of it)
            for i in groups:
                self.flat[i][own[i]].copy_(pending[i]["snapshot"])
            targets, casts = self.flat, None
        else:
            targets, casts = self.replica, self.flat  # one rounding fp32 -> bf16/fp16, identical everywhere
        self.backend.zero_sign_apply(signs, nonzero, targets, casts, self.layout, [pending[i]["lr"] for i in groups],
                                     [pending[i]["wd"] for i in groups])
        for i in groups:
            self.masters[i].copy_(targets[i][own[i]])
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
