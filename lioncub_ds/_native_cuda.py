"""CUDA backend: wraps the CUDA build of the extension with the TorchBackend signatures.

Outputs match lioncub_ds/codec.py bit for bit (floats exactly), except int8 codes for the
l1/l0 scales, which may differ by one where the unrounded code sits on a rounding boundary
(the scale's sum is deterministic but not in torch's order). The apply methods take
``return_delta`` (False: skip writing the fp32 Δ and return None).
"""
from __future__ import annotations

import torch

from . import codec

_TIE_CODE = {"zero": 0, "alternate": 1, "hash": 2}
_VOTE_CODE = {"majority": 0, "average": 1}
_SCALE_CODE = {"l1": 0, "l0": 1, "linf": 2}


def _tie_code(tie_break):
    try:
        return _TIE_CODE[tie_break]
    except (KeyError, TypeError):
        raise ValueError(f"tie_break must be one of {codec.TIE_RULES}, got {tie_break!r}") from None


def _vote_code(vote):
    try:
        return _VOTE_CODE[vote]
    except (KeyError, TypeError):
        raise ValueError(f"vote must be one of {codec.VOTE_MODES}, got {vote!r}") from None


def _scale_code(kind):
    try:
        return _SCALE_CODE[kind]
    except (KeyError, TypeError):
        raise ValueError(f"quant scale must be one of {codec.SCALE_KINDS}, got {kind!r}") from None


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
        if not grads:
            z = torch.zeros(int(total) // 8, dtype=torch.uint8, device="cuda")
            return z, z.clone(), 0, 0
        sign, nonzero, counts = self._ext.cuda_local_step(
            [g.contiguous() for g in grads], list(momenta), [int(o) for o in offsets], int(total),
            float(beta1), float(beta2), bool(update_momentum))
        n_nonfinite, n_zero = counts.tolist()
        return sign, nonzero, n_nonfinite, n_zero

    def momentum_update_list(self, momenta, grads, beta2):
        if grads:
            self._ext.cuda_momentum_update_list(list(momenta), [g.contiguous() for g in grads], float(beta2))

    # ------------------------------------------------------------------ votes
    def vote_apply(self, sign, nonzero, params, offsets, lr, weight_decay, step, tie_break, vote, world_size,
                   base=0, return_delta=True):
        return self._ext.cuda_vote_apply(
            sign.contiguous(), None if nonzero is None else nonzero.contiguous(), list(params),
            [int(o) for o in offsets], float(lr), float(weight_decay), int(step), _tie_code(tie_break),
            _vote_code(vote), int(world_size), int(base), bool(return_delta))

    def shard_vote(self, sign, nonzero, step, tie_break, base):
        return self._ext.cuda_shard_vote(sign.contiguous(), None if nonzero is None else nonzero.contiguous(),
                                         int(step), _tie_code(tie_break), int(base))

    def count_lanes(self, sign, nonzero, p):
        if p not in codec.LANE_WIDTHS:
            raise ValueError(f"lane width p must be one of {codec.LANE_WIDTHS}, got {p}")
        plus, cnt = self._ext.cuda_count_lanes(sign.contiguous(),
                                               None if nonzero is None else nonzero.contiguous(), int(p))
        return plus, cnt

    def lanes_apply(self, plus_lanes, cnt_lanes, world_size, p, params, offsets, lr, weight_decay, step, tie_break,
                    vote, base=0, return_delta=True):
        if p not in codec.LANE_WIDTHS:
            raise ValueError(f"lane width p must be one of {codec.LANE_WIDTHS}, got {p}")
        return self._ext.cuda_lanes_apply(
            plus_lanes.contiguous(), None if cnt_lanes is None else cnt_lanes.contiguous(), int(world_size), int(p),
            list(params), [int(o) for o in offsets], float(lr), float(weight_decay), int(step),
            _tie_code(tie_break), _vote_code(vote), int(base), bool(return_delta))

    # ------------------------------------------------------------------ int8
    def int8_local_step(self, grads, momenta, offsets, total, beta1, kind, levels):
        code = _scale_code(kind)
        if not grads:
            return torch.zeros(int(total), dtype=torch.int8, device="cuda"), 0
        q, n_bad, _scales = self._ext.cuda_int8_local_step(
            [g.contiguous() for g in grads], list(momenta), [int(o) for o in offsets], int(total), float(beta1),
            code, int(levels))
        return q, int(n_bad.item())

    def int8_apply(self, qsum, params, offsets, lr, weight_decay, return_delta=True):
        return self._ext.cuda_int8_apply(qsum.contiguous(), list(params), [int(o) for o in offsets], float(lr),
                                         float(weight_decay), bool(return_delta))
# ===== end of the CUDA backend ===============================================================
