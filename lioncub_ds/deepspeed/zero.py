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
  with the same arithmetic (:func:`lioncub_ds.codec.apply_update`), so all ranks stay
  bit-identical.
* **bf16 / fp16 parameters** with ``zero_fp32_replica: true``: every rank keeps an fp32
  replica of all parameters (extra memory: 4 bytes per parameter per rank, i.e. what
  ZeRO-1/2 saved on master weights, minus nothing: the owner's master partition is kept
  too), updates it from the signs and casts it into the low-precision buffer.
  Without the replica the low-precision copies cannot reproduce the fp32 master, and the
  integration keeps DeepSpeed's parameter all-gather (``zero_allgather: "auto"``) or
  refuses (``"sign"``).

Conventions: the bit order is lioncub_ds.codec's (LSB first); the alignment padding of
DeepSpeed's flat buffers never moves (Δ = 0 there on every rank, no bits needed); a real
coordinate whose c is exactly 0 (or non-finite) does not move (the nonzero plane carries it).
One all-gather per step carries every group's sign bits plus one flag byte per rank saying
whether the nonzero plane follows.
"""
from __future__ import annotations

import logging
import time
import weakref

import torch
import torch.distributed as dist

from ..codec import apply_update, lion_direction, pack_bits, unpack_bits
from ..telemetry import ring_bytes

log = logging.getLogger("lioncub_ds")

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_ADAPTERS: dict = {}  # id(zero_opt.parallel_partitioned_bit16_groups) -> weakref(adapter)


class ZeroSignAllGatherError(RuntimeError):
    pass


def make_allgather_dispatch(orig):
    """Wrap DeepSpeed's ``all_gather_dp_groups``: sign all-gather where enabled and pending."""

    def all_gather_dp_groups(groups_flat, partitioned_param_groups, dp_process_group, start_alignment_factor,
                             allgather_bucket_size):
        ref = _ADAPTERS.get(id(partitioned_param_groups))
        adapter = ref() if ref is not None else None
        if adapter is not None and adapter.parts is partitioned_param_groups and adapter.pending:
            return adapter.run()
        return orig(groups_flat, partitioned_param_groups, dp_process_group, start_alignment_factor,
                    allgather_bucket_size)

    return all_gather_dp_groups


def _pad_ranges(zopt, i, flat_numel):
    """Sorted [a, b) ranges of the flat buffer of group ``i`` that hold no parameter."""
    offsets = getattr(zopt, "round_robin_bit16_offsets", None)
    metas = getattr(zopt, "round_robin_bit16_meta", None)
    if offsets is None or metas is None:
        raise ZeroSignAllGatherError("this DeepSpeed version does not expose round_robin_bit16_offsets/meta")
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
    """The per-engine adapter; see the module doc."""

    def __init__(self, zopt, lion, replica: bool):
        self.zopt = zopt
        self.lion = lion
        self.parts = zopt.parallel_partitioned_bit16_groups
        self.flat = zopt.bit16_groups_flat
        self.masters = zopt.single_partition_of_fp32_groups
        groups = zopt.real_dp_process_group
        self.group = groups[0]
        if any(g is not self.group for g in groups):
            raise ZeroSignAllGatherError("parameter groups use different data-parallel groups (MoE?)")
        self.n = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
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
        self.stats = {"steps": 0, "bytes_sent": 0, "param_allgather_bytes": 0, "nonzero_plane_steps": 0,
                      "comm_time_s": 0.0, "last_step": {}}
        self._hook = lion.register_step_pre_hook(self._pre_step)
        _ADAPTERS[id(self.parts)] = weakref.ref(self)

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
            c = torch.zeros(self.nbytes[i] * 8, dtype=torch.float32, device=p.device)
            if p.grad is not None:
                m = optimizer.state.get(p, {}).get("exp_avg")
                if m is None:
                    m = torch.zeros_like(p, dtype=torch.float32)
                c[:ps] = lion_direction(m.reshape(-1), p.grad.reshape(-1), g["betas"][0])
            pad = self.pad_index[i][self.rank]
            if pad.numel():
                c[pad] = 0.0
            ok = torch.isfinite(c)
            sign = pack_bits((c > 0) & ok)
            nonzero_mask = (c != 0) & ok
            abstain = int(ps - nonzero_mask[:ps].sum()) - int(pad.numel())
            snap = None if self.replica is not None else self.masters[i].detach().clone()
            self.pending[i] = {"sign": sign, "nonzero": pack_bits(nonzero_mask), "abstain": abstain > 0,
                               "lr": float(g["lr"]), "wd": float(g["weight_decay"]), "snapshot": snap}

    def _gather(self, buf):
        out = torch.empty(self.n * buf.numel(), dtype=buf.dtype, device=buf.device)
        _all_gather_single(out, buf.contiguous(), group=self.group)
        return out.view(self.n, -1)

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
        send = torch.cat([pending[i]["sign"] for i in range(len(self.parts))] + [flag])
        sent = ring_bytes("all_gather", send.numel() * self.n, self.n)
        signs = self._gather(send)
        nonzero = None
        if bool(signs[:, -1].any()):
            nz_send = torch.cat([pending[i]["nonzero"] for i in range(len(self.parts))])
            nonzero = self._gather(nz_send)
            sent += ring_bytes("all_gather", nz_send.numel() * self.n, self.n)
            self.stats["nonzero_plane_steps"] += 1
        for i, ps in enumerate(self.psize):
            lr, wd = pending[i]["lr"], pending[i]["wd"]
            o, nb = self.offsets[i], self.nbytes[i]
            target = self.replica[i] if self.replica is not None else self.flat[i]
            for j in range(self.n):
                bits = unpack_bits(signs[j, o:o + nb], ps).to(torch.float32)
                delta = bits.mul_(2.0).sub_(1.0)
                if nonzero is not None:
                    delta.mul_(unpack_bits(nonzero[j, o:o + nb], ps).to(torch.float32))
                pad = self.pad_index[i][j]
                if pad.numel():
                    delta[pad] = 0.0
                if j == self.rank and self.replica is None:
                    x = pending[i]["snapshot"]           # the owner's pre-step master == everyone's replica
                    apply_update([x], [0], delta, lr, wd)
                    target[j * ps:(j + 1) * ps].copy_(x)
                    self.masters[i].copy_(x)
                else:
                    apply_update([target[j * ps:(j + 1) * ps]], [0], delta, lr, wd)
            if self.replica is not None:
                self.flat[i].copy_(self.replica[i])  # one rounding fp32 -> bf16/fp16, identical everywhere
                self.masters[i].copy_(self.replica[i][self.rank * ps:(self.rank + 1) * ps])
        baseline = sum(ring_bytes("all_gather", f.numel() * f.element_size(), self.n) for f in self.flat)
        dt = time.perf_counter() - t0
        self.stats["steps"] += 1
        self.stats["bytes_sent"] += sent
        self.stats["param_allgather_bytes"] += baseline
        self.stats["comm_time_s"] += dt
        self.stats["last_step"] = {"bytes_sent": sent, "param_allgather_bytes": baseline,
                                   "nonzero_plane": nonzero is not None, "time_s": dt}

    @torch.no_grad()
    def refresh(self):
        """Re-sync the fp32 replica from every owner's fp32 master (after a checkpoint load)."""
        if self.replica is None:
            return
        for i, master in enumerate(self.masters):
            out = self._gather(master.detach().float().reshape(-1))
            self.replica[i].copy_(out.reshape(-1))

    def snapshot_stats(self) -> dict:
        s = dict(self.stats)
        s["ratio_vs_param_allgather"] = (s["param_allgather_bytes"] / s["bytes_sent"]) if s["bytes_sent"] else None
        s["extra_memory_bytes"] = self.extra_memory_bytes()
        return s

    def close(self):
        self._hook.remove()
        _ADAPTERS.pop(id(self.parts), None)


def maybe_enable_sign_allgather(engine, lion, options):
    """Install the sign all-gather on a ZeRO-1/2 engine when the options and the setup allow it."""
    mode = options.get("zero_allgather", "auto")
    replica = bool(options.get("zero_fp32_replica", False))
    if mode == "params":
        return None
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    zopt = engine.optimizer
    why = None
    if type(zopt) is not DeepSpeedZeroOptimizer:
        why = f"the ZeRO wrapper is {type(zopt).__name__}, not DeepSpeedZeroOptimizer"
    elif getattr(zopt, "cpu_offload", False):
        why = "optimizer offload is on"
    elif getattr(zopt, "torch_autocast_gradscaler", None) is not None:
        why = "torch_autocast's GradScaler steps the optimizer"
    elif zopt.bit16_groups_flat and zopt.bit16_groups_flat[0].dtype != torch.float32 and not replica:
        why = (f"parameters are {zopt.bit16_groups_flat[0].dtype} and the fp32 master lives only on its owner; "
               "set \"zero_fp32_replica\": true (+4 bytes/parameter/rank) to let every rank reproduce it")
    if why is None:
        try:
            low_precision = zopt.bit16_groups_flat[0].dtype != torch.float32
            adapter = ZeroSignAllGather(zopt, lion, replica=replica and low_precision)
        except ZeroSignAllGatherError as exc:
            why = str(exc)
    if why is not None:
        if mode == "sign":
            raise ZeroSignAllGatherError(f"LionCub: zero_allgather='sign' is not possible here: {why}")
        if getattr(engine, "global_rank", 0) == 0:
            log.info("lioncub_ds: ZeRO keeps DeepSpeed's parameter all-gather (%s)", why)
        return None
    if getattr(engine, "global_rank", 0) == 0:
        log.info("lioncub_ds: ZeRO stage %d uses the 1-bit sign all-gather (extra memory %d bytes/rank)",
                 engine.zero_optimization_stage(), adapter.extra_memory_bytes())
    return adapter
