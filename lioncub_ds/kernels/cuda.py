"""The CUDA backend: the fused kernels of ``csrc/cuda`` behind the reference's signatures.

Outputs match :mod:`lioncub_ds.kernels.reference` bit for bit (floats exactly, int8 codes
included: the l1/l0 scales use the project's own summation order and fp64 arithmetic,
csrc/common). The apply methods take ``return_delta`` (False: skip writing the fp32 Δ and
return None). Built and loaded by :mod:`lioncub_ds.kernels.loader`; arguments are checked in
Python first (:mod:`lioncub_ds.kernels.checks`, the same checks as the C++ backend), and
tensors the kernels do not handle (non-contiguous parameters or momenta, float64, CPU
tensors) take the reference path.
"""
from __future__ import annotations

import torch

from . import reference as ref
from .checks import (validate_abstain_list, validate_bbit_local, validate_bbit_shard_vote, validate_count_lanes,
                     validate_int8_apply, validate_lanes_apply, validate_lion_step, validate_local, validate_momentum,
                     validate_shard_vote, validate_vote_apply, validate_zero_apply)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_ROWS = 65535  # LC_MAX_ROWS


def _cuda_plain(ts) -> bool:
    return all(isinstance(t, torch.Tensor) and t.is_cuda and t.layout == torch.strided and t.is_contiguous()
               and t.dtype in _DTYPES for t in ts)


def _cuda_u8(t, dtype=torch.uint8) -> bool:
    return t is None or (t.is_cuda and t.layout == torch.strided and t.dtype == dtype)


def _rows(sign) -> int:
    return sign.shape[0] if sign.dim() == 2 else 1


def _contig(t):
    return None if t is None else t.contiguous()


class CudaBackend:
    """Fused CUDA kernels (csrc/cuda) behind the TorchBackend signatures; CUDA tensors only.

    Every method is one multi-tensor launch per bucket (int8_local_step, bbit_local_step: three),
    on the current CUDA stream. local_step / int8_local_step / bbit_local_step synchronize only to
    return their counts as ints; with ``device_counts=True`` (what the optimizer uses) they do not.
    count_lanes synchronizes for its overflow check, only when a count could overflow.
    """

    name = "cuda"

    def __init__(self, ext):
        self._ext = ext

    @staticmethod
    def _state_ok(grads, momenta) -> bool:
        return _cuda_plain(momenta) and all(g.is_cuda and g.dtype in _DTYPES for g in grads)

    # ------------------------------------------------------------------ local step
    def local_step(self, grads, momenta, offsets, total, beta1, beta2, update_momentum=False, device_counts=False,
                   momenta_out=None):
        total, offs = validate_local(grads, momenta, offsets, total, momenta_out)
        if update_momentum and momenta_out is not None:
            # No CUDA kernel with an output pointer yet: copy m, then the fused in-place step on the
            # copy (c from the copy's exact bits). 20 B/param like the in-place path; a fused
            # variant would move 12 (docs/kernels.md, GPU checklist).
            for o, m in zip(momenta_out, momenta):
                o.copy_(m)
            return self.local_step(grads, list(momenta_out), offs, total, beta1, beta2, True, device_counts)
        if not grads:
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            z = torch.zeros(total // 8, dtype=torch.uint8, device=dev)
            return (z, z.clone(), *ref.as_device_counts(dev, 0, 0)) if device_counts else (z, z.clone(), 0, 0)
        if not self._state_ok(grads, momenta):
            return ref.local_step(grads, momenta, offs, total, beta1, beta2, update_momentum, device_counts)
        sign, nonzero, counts = self._ext.cuda_local_step(
            [g.contiguous() for g in grads], list(momenta), offs, total, float(beta1), float(beta2),
            bool(update_momentum))
        if device_counts:  # no host read: the caller folds them into its flags
            return sign, nonzero, counts[0].to(torch.int64), counts[1].to(torch.int64)
        n_nonfinite, n_zero = counts.tolist()
        return sign, nonzero, n_nonfinite, n_zero

    @staticmethod
    def abstain_list(nonzero, mask, capacity):
        # torch ops with fixed-size outputs: asynchronous on the device, no kernel of our own needed
        return ref.abstain_list(nonzero, mask, validate_abstain_list(nonzero, mask, capacity))

    def momentum_update_list(self, momenta, grads, beta2):
        validate_momentum(momenta, grads)
        if not grads:
            return
        if not self._state_ok(grads, momenta):
            for m, g in zip(momenta, grads):
                ref.momentum_update(m, g, beta2)
            return
        self._ext.cuda_momentum_update_list(list(momenta), [g.contiguous() for g in grads], float(beta2))

    # ------------------------------------------------------------------ votes
    def vote_apply(self, sign, nonzero, params, offsets, lr, weight_decay, step, tie_break, vote, world_size,
                   segments=None, return_delta=True):
        v, t, world, offs, segs = validate_vote_apply(sign, nonzero, params, offsets, tie_break, vote, world_size,
                                                      segments)
        if not (_cuda_u8(sign) and _cuda_u8(nonzero) and _cuda_plain(params) and _rows(sign) <= _MAX_ROWS):
            return ref.vote_apply(sign, nonzero, params, offs, lr, weight_decay, step, tie_break, vote, world_size,
                                  segs, return_delta)
        return self._ext.cuda_vote_apply(sign.contiguous(), _contig(nonzero), list(params), offs, float(lr),
                                         float(weight_decay), int(step), t, v, world, segs, bool(return_delta))

    def shard_vote(self, sign, nonzero, step, tie_break, segments):
        t, segs = validate_shard_vote(sign, nonzero, tie_break, segments)
        if not (_cuda_u8(sign) and _cuda_u8(nonzero) and _rows(sign) <= _MAX_ROWS):
            return ref.shard_vote(sign, nonzero, step, tie_break, segs)
        return self._ext.cuda_shard_vote(sign.contiguous(), _contig(nonzero), int(step), t, segs)

    def count_lanes(self, sign, nonzero, p):
        p = validate_count_lanes(sign, nonzero, p)
        if not (_cuda_u8(sign) and _cuda_u8(nonzero) and sign.shape[0] <= 255):
            return ref.count_lanes(sign, nonzero, p)
        plus, cnt, overflow = self._ext.cuda_count_lanes(sign.contiguous(), _contig(nonzero), p)
        if overflow is not None and int(overflow.item()) != 0:  # only when a count could overflow
            raise ValueError(f"a count does not fit a {p}-bit lane")
        return plus, cnt

    def lanes_apply(self, plus_lanes, cnt_lanes, world_size, p, params, offsets, lr, weight_decay, step, tie_break,
                    vote, segments=None, return_delta=True):
        p, v, t, world, offs, segs = validate_lanes_apply(plus_lanes, cnt_lanes, world_size, p, params, offsets,
                                                          tie_break, vote, segments)
        if not (_cuda_u8(plus_lanes) and _cuda_u8(cnt_lanes) and _cuda_plain(params)):
            return ref.lanes_apply(plus_lanes, cnt_lanes, world_size, p, params, offs, lr, weight_decay, step,
                                   tie_break, vote, segs, return_delta)
        return self._ext.cuda_lanes_apply(plus_lanes.contiguous(), _contig(cnt_lanes), world, p, list(params), offs,
                                          float(lr), float(weight_decay), int(step), t, v, segs, bool(return_delta))

    # ------------------------------------------------------------------ int8
    def int8_local_step(self, grads, momenta, offsets, total, beta1, kind, levels, device_counts=False):
        code = ref.enum_code("quant scale", kind)
        total, offs = validate_local(grads, momenta, offsets, total)
        if not grads:
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            q = torch.zeros(total, dtype=torch.int8, device=dev)
            return (q, *ref.as_device_counts(dev, 0)) if device_counts else (q, 0)
        if not (self._state_ok(grads, momenta) and 1 <= int(levels) <= 127):
            return ref.int8_local_step(grads, momenta, offs, total, beta1, kind, levels, device_counts)
        q, n_bad, _scales = self._ext.cuda_int8_local_step(
            [g.contiguous() for g in grads], list(momenta), offs, total, float(beta1), code, int(levels))
        if device_counts:
            return q, n_bad.reshape(()).to(torch.int64)
        return q, int(n_bad.item())

    def int8_apply(self, qsum, params, offsets, lr, weight_decay, return_delta=True):
        offs = validate_int8_apply(qsum, params, offsets)
        if not (_cuda_u8(qsum, torch.int8) and _cuda_plain(params)):
            return ref.int8_apply(qsum, params, offs, lr, weight_decay, return_delta)
        return self._ext.cuda_int8_apply(qsum.contiguous(), list(params), offs, float(lr), float(weight_decay),
                                         bool(return_delta))

    # ------------------------------------------------------------------ comm="bbit"
    def bbit_local_step(self, grads, momenta, offsets, total, beta1, beta2, kind, bits, rounding, seed, segments,
                        update_momentum=False, device_counts=False, momenta_out=None):
        total, offs, code, bits, rcode, seed, segs = validate_bbit_local(grads, momenta, offsets, total, kind, bits,
                                                                         rounding, seed, segments, momenta_out)
        if update_momentum and momenta_out is not None:  # as local_step: the in-place step on copies of m
            for o, m in zip(momenta_out, momenta):
                o.copy_(m)
            return self.bbit_local_step(grads, list(momenta_out), offs, total, beta1, beta2, kind, bits, rounding,
                                        seed, segs, True, device_counts)
        if not grads:
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            planes = torch.zeros(bits, total // 8, dtype=torch.uint8, device=dev)
            nz = torch.zeros(total // 8, dtype=torch.uint8, device=dev)
            return (planes, nz, *ref.as_device_counts(dev, 0, 0)) if device_counts else (planes, nz, 0, 0)
        if not self._state_ok(grads, momenta):
            return ref.bbit_local_step(grads, momenta, offs, total, beta1, beta2, kind, bits, rounding, seed, segs,
                                       update_momentum, device_counts)
        planes, nz, counts = self._ext.cuda_bbit_local_step(
            [g.contiguous() for g in grads], list(momenta), offs, total, float(beta1), float(beta2),
            bool(update_momentum), code, bits, rcode, seed, segs)
        if device_counts:  # no host read: the caller folds them into its flags
            return planes, nz, counts[0].to(torch.int64), counts[1].to(torch.int64)
        n_nonfinite, n_zero = counts.tolist()
        return planes, nz, n_nonfinite, n_zero

    def bbit_shard_vote(self, planes, nonzero, bits, step, tie_break, segments):
        t, bits, segs = validate_bbit_shard_vote(planes, nonzero, bits, tie_break, segments)
        if not (_cuda_u8(planes) and _cuda_u8(nonzero) and planes.shape[0] <= _MAX_ROWS):
            return ref.bbit_shard_vote(planes, nonzero, bits, step, tie_break, segs)
        return self._ext.cuda_bbit_shard_vote(planes.contiguous(), _contig(nonzero), bits, int(step), t, segs)

    # ------------------------------------------------------------------ single-process step, ZeRO apply
    def lion_step(self, params, grads, momenta, lr, weight_decay, beta1, beta2):
        """One launch over every qualifying tensor (one pass: 20 B/param in fp32); the others
        (non-contiguous parameters or momenta, float64, CPU tensors) take the reference path."""
        validate_lion_step(params, grads, momenta)
        ref.lion_step_split(
            lambda ps, gs, ms: self._ext.cuda_lion_step(ps, [g.contiguous() for g in gs], ms, float(lr),
                                                        float(weight_decay), float(beta1), float(beta2)),
            lambda p, g, m: _cuda_plain((p, m)) and g.is_cuda and g.layout == torch.strided and g.dtype in _DTYPES,
            params, grads, momenta, lr, weight_decay, beta1, beta2)

    def zero_sign_apply(self, sign, nonzero, targets, casts, layout, lrs, weight_decays):
        """One launch over every partition of every group; no host synchronization."""
        validate_zero_apply(sign, nonzero, targets, casts, layout, lrs, weight_decays)
        casts = [None] * len(targets) if casts is None else list(casts)
        ok = (_cuda_u8(sign) and _cuda_u8(nonzero)
              and all(t.is_cuda and t.is_contiguous() and t.dtype == torch.float32 for t in targets)
              and all(c is None or (c.is_cuda and c.is_contiguous() and c.dtype in _DTYPES) for c in casts))
        if not ok:
            return ref.zero_sign_apply(sign, nonzero, targets, casts, layout, lrs, weight_decays)
        self._ext.cuda_zero_sign_apply(sign.contiguous(), _contig(nonzero), list(targets), casts, layout.pieces,
                                       [float(v) for v in lrs], [float(v) for v in weight_decays])
