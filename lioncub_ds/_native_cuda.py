"""CUDA backend: wraps the CUDA build of the extension with the TorchBackend signatures.

Outputs match lioncub_ds/codec.py bit for bit (floats exactly, int8 codes included: the l1/l0
scales use the project's own summation order and fp64 arithmetic, csrc/common). The apply
methods take ``return_delta`` (False: skip writing the fp32 Δ and return None).

Every method validates its arguments in Python before it calls the extension (see
:mod:`lioncub_ds._native`): a C++ exception through a JIT-built extension crashes the process
on some platforms, so bad input raises a ValueError here, and tensors the kernels do not handle
(non-contiguous parameters or momenta, float64, CPU tensors) take the reference path.
"""
from __future__ import annotations

import torch

from . import codec
from ._native import (_offsets, check_bucket, check_lane_width, check_planes, check_tensors, check_total,
                      check_world)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_ROWS = 65535  # LC_MAX_ROWS


def _cuda_plain(ts) -> bool:
    return all(isinstance(t, torch.Tensor) and t.is_cuda and t.layout == torch.strided and t.is_contiguous()
               and t.dtype in _DTYPES for t in ts)


def _cuda_u8(t, dtype=torch.uint8) -> bool:
    return t is None or (t.is_cuda and t.layout == torch.strided and t.dtype == dtype)


def _rows(sign) -> int:
    return sign.shape[0] if sign.dim() == 2 else 1


class CudaBackend:
    """Fused CUDA kernels (csrc/cuda) behind the TorchBackend signatures; CUDA tensors only.

    Every method is one multi-tensor launch per bucket (int8_local_step: three), on the
    current CUDA stream; only local_step / int8_local_step (their int counts) and
    count_lanes (an overflow check, only when a count could overflow) synchronize.
    """

    name = "cuda"

    def __init__(self, ext):
        self._ext = ext

    # ------------------------------------------------------------------ local step
    def local_step(self, grads, momenta, offsets, total, beta1, beta2, update_momentum=False):
        total = check_total(total)
        check_tensors([(f"grads[{i}]", g) for i, g in enumerate(grads)]
                      + [(f"momenta[{i}]", m) for i, m in enumerate(momenta)])
        offs = check_bucket(grads, offsets, total, "grads", momenta, "momenta")
        if not grads:
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            z = torch.zeros(total // 8, dtype=torch.uint8, device=dev)
            return z, z.clone(), 0, 0
        if not (_cuda_plain(momenta) and all(g.is_cuda and g.dtype in _DTYPES for g in grads)):
            return codec.local_step(grads, momenta, offs, total, beta1, beta2, update_momentum)
        sign, nonzero, counts = self._ext.cuda_local_step(
            [g.contiguous() for g in grads], list(momenta), offs, total, float(beta1), float(beta2),
            bool(update_momentum))
        n_nonfinite, n_zero = counts.tolist()
        return sign, nonzero, n_nonfinite, n_zero

    def momentum_update_list(self, momenta, grads, beta2):
        check_tensors([(f"grads[{i}]", g) for i, g in enumerate(grads)]
                      + [(f"momenta[{i}]", m) for i, m in enumerate(momenta)])
        check_bucket(momenta, [0] * len(momenta), None, "momenta", grads, "grads")
        if not grads:
            return
        if not (_cuda_plain(momenta) and all(g.is_cuda and g.dtype in _DTYPES for g in grads)):
            for m, g in zip(momenta, grads):
                codec.momentum_update(m, g, beta2)
            return
        self._ext.cuda_momentum_update_list(list(momenta), [g.contiguous() for g in grads], float(beta2))

    # ------------------------------------------------------------------ votes
    def vote_apply(self, sign, nonzero, params, offsets, lr, weight_decay, step, tie_break, vote, world_size,
                   segments=None, return_delta=True):
        v = codec.enum_code("vote", vote)
        t = codec.enum_code("tie_break", tie_break) if v == 0 else 0
        world = check_world(world_size)
        check_planes(sign, nonzero, False)
        check_tensors([("sign", sign)] + [(f"params[{i}]", p) for i, p in enumerate(params)])
        offs = check_bucket(params, offsets, sign.shape[-1] * 8, "params")
        segs = codec.tie_segments(offs) if segments is None else codec.as_segments(segments)
        if not (_cuda_u8(sign) and _cuda_u8(nonzero) and _cuda_plain(params) and _rows(sign) <= _MAX_ROWS
                and world < 2**31):
            return codec.vote_apply(sign, nonzero, params, offs, lr, weight_decay, step, tie_break, vote, world_size,
                                    segs, return_delta)
        return self._ext.cuda_vote_apply(
            sign.contiguous(), None if nonzero is None else nonzero.contiguous(), list(params), offs, float(lr),
            float(weight_decay), int(step), t, v, world, segs, bool(return_delta))

    def shard_vote(self, sign, nonzero, step, tie_break, segments):
        t = codec.enum_code("tie_break", tie_break)
        check_planes(sign, nonzero, True)
        segs = codec.as_segments(segments)
        if not (_cuda_u8(sign) and _cuda_u8(nonzero) and _rows(sign) <= _MAX_ROWS):
            return codec.shard_vote(sign, nonzero, step, tie_break, segs)
        return self._ext.cuda_shard_vote(sign.contiguous(), None if nonzero is None else nonzero.contiguous(),
                                         int(step), t, segs)

    def count_lanes(self, sign, nonzero, p):
        p = check_lane_width(p)
        check_planes(sign, nonzero, True)
        rows, top = sign.shape[0], (1 << p) - 1
        if nonzero is None and sign.shape[1] > 0 and rows > top:
            raise ValueError(f"count {rows} does not fit a {p}-bit lane")
        if not (_cuda_u8(sign) and _cuda_u8(nonzero) and rows <= 255):
            return codec.count_lanes(sign, nonzero, p)
        plus, cnt, overflow = self._ext.cuda_count_lanes(sign.contiguous(),
                                                         None if nonzero is None else nonzero.contiguous(), p)
        if overflow is not None and int(overflow.item()) != 0:  # only when a count could overflow
            raise ValueError(f"a count does not fit a {p}-bit lane")
        return plus, cnt

    def lanes_apply(self, plus_lanes, cnt_lanes, world_size, p, params, offsets, lr, weight_decay, step, tie_break,
                    vote, segments=None, return_delta=True):
        p = check_lane_width(p)
        v = codec.enum_code("vote", vote)
        t = codec.enum_code("tie_break", tie_break) if v == 0 else 0
        world = check_world(world_size)
        check_tensors([("plus_lanes", plus_lanes), ("cnt_lanes", cnt_lanes)]
                      + [(f"params[{i}]", q) for i, q in enumerate(params)])
        if cnt_lanes is not None and cnt_lanes.numel() != plus_lanes.numel():
            raise ValueError(f"lioncub kernels: cnt_lanes has {cnt_lanes.numel()} bytes but plus_lanes has "
                             f"{plus_lanes.numel()}")
        offs = check_bucket(params, offsets, plus_lanes.numel() * 8 // p, "params")
        segs = codec.tie_segments(offs) if segments is None else codec.as_segments(segments)
        if not (_cuda_u8(plus_lanes) and _cuda_u8(cnt_lanes) and _cuda_plain(params) and world < 2**31):
            return codec.lanes_apply(plus_lanes, cnt_lanes, world_size, p, params, offs, lr, weight_decay, step,
                                     tie_break, vote, segs, return_delta)
        return self._ext.cuda_lanes_apply(
            plus_lanes.contiguous(), None if cnt_lanes is None else cnt_lanes.contiguous(), world, p, list(params),
            offs, float(lr), float(weight_decay), int(step), t, v, segs, bool(return_delta))

    # ------------------------------------------------------------------ int8
    def int8_local_step(self, grads, momenta, offsets, total, beta1, kind, levels):
        code = codec.enum_code("quant scale", kind)
        total = check_total(total)
        check_tensors([(f"grads[{i}]", g) for i, g in enumerate(grads)]
                      + [(f"momenta[{i}]", m) for i, m in enumerate(momenta)])
        offs = check_bucket(grads, offsets, total, "grads", momenta, "momenta")
        if not grads:
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            return torch.zeros(total, dtype=torch.int8, device=dev), 0
        if not (_cuda_plain(momenta) and all(g.is_cuda and g.dtype in _DTYPES for g in grads)
                and 1 <= int(levels) <= 127):
            return codec.int8_local_step(grads, momenta, offs, total, beta1, kind, levels)
        q, n_bad, _scales = self._ext.cuda_int8_local_step(
            [g.contiguous() for g in grads], list(momenta), offs, total, float(beta1), code, int(levels))
        return q, int(n_bad.item())

    def int8_apply(self, qsum, params, offsets, lr, weight_decay, return_delta=True):
        check_tensors([("qsum", qsum)] + [(f"params[{i}]", p) for i, p in enumerate(params)])
        offs = check_bucket(params, _offsets(offsets), qsum.numel(), "params")
        if not (_cuda_u8(qsum, torch.int8) and _cuda_plain(params)):
            return codec.int8_apply(qsum, params, offs, lr, weight_decay, return_delta)
        return self._ext.cuda_int8_apply(qsum.contiguous(), list(params), offs, float(lr), float(weight_decay),
                                         bool(return_delta))
