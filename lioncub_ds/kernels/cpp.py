"""The C++ CPU backend: the fused kernels of ``csrc/cpu`` behind the reference's signatures.

Built and loaded by :mod:`lioncub_ds.kernels.loader`. Arguments are checked in Python first
(:mod:`lioncub_ds.kernels.checks`); tensors the kernels do not handle take the reference path.
"""
from __future__ import annotations

import torch

from . import reference as ref
from .checks import (all_plain, is_plain, planes_ok, validate_abstain_list, validate_bbit_local,
                     validate_bbit_shard_vote, validate_count_lanes, validate_int8_apply, validate_lanes_apply,
                     validate_lion_step, validate_local, validate_momentum, validate_shard_vote, validate_vote_apply,
                     validate_zero_apply)

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_STATE_DTYPES = (torch.float32, torch.bfloat16)


def _packed(t):
    """Packed planes, lanes and int8 codes are small (at most 1 byte per element): a strided
    view (a column of a gathered buffer, a decoded plane) is copied, not sent to the reference,
    which is 100x slower."""
    if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_contiguous():
        return t.contiguous()
    return t


class CppBackend:
    """Fused C++ CPU kernels with the exact interface of :class:`lioncub_ds.kernels.TorchBackend`.

    ``vote_apply``, ``lanes_apply`` and ``int8_apply`` return Δ like the reference; pass
    ``return_delta=False`` to skip materialising it (4 bytes per element of extra writes).
    """

    name = "cpp"

    def __init__(self, ext):
        self._ext = ext

    # -- introspection / test hooks
    @property
    def isa(self) -> str:
        return self._ext.isa()

    def set_isa(self, isa: str) -> None:
        """'auto', 'baseline' or 'avx2' (both paths give identical results)."""
        codes = {"auto": 0, "baseline": 1, "base": 1, "avx2": 2}
        if isa not in codes:
            raise ValueError(f"isa must be one of {tuple(codes)}, got {isa!r}")
        self._ext.set_isa(codes[isa])

    def _state_ok(self, grads, momenta) -> bool:
        return all_plain(grads, _GRAD_DTYPES) and all_plain(momenta, _STATE_DTYPES)

    # -- (a) local step
    def local_step(self, grads, momenta, offsets, total, beta1, beta2, update_momentum=False, device_counts=False,
                   momenta_out=None):
        total, offs = validate_local(grads, momenta, offsets, total, momenta_out)
        if not self._state_ok(grads, momenta) or (momenta_out is not None
                                                  and not all_plain(momenta_out, _STATE_DTYPES)):
            return ref.local_step(grads, momenta, offs, total, beta1, beta2, update_momentum, device_counts,
                                  momenta_out)
        sign, nz, n_bad, n_zero = self._ext.local_step(list(grads), list(momenta), offs, total, float(beta1),
                                                      float(beta2), bool(update_momentum),
                                                      None if momenta_out is None else list(momenta_out))
        if device_counts:
            return sign, nz, *ref.as_device_counts(sign.device, n_bad, n_zero)
        return sign, nz, int(n_bad), int(n_zero)

    def abstain_list(self, nonzero, mask, capacity):
        capacity = validate_abstain_list(nonzero, mask, capacity)
        if not (is_plain(nonzero, (torch.uint8,)) and is_plain(mask, (torch.uint8,))):
            return ref.abstain_list(nonzero, mask, capacity)
        return self._ext.abstain_list(nonzero, mask, capacity)

    # -- (b) momentum
    def momentum_update_list(self, momenta, grads, beta2):
        validate_momentum(momenta, grads)
        if self._state_ok(grads, momenta):
            self._ext.momentum_update_list(list(momenta), list(grads), float(beta2))
            return
        for m, g in zip(momenta, grads):
            ref.momentum_update(m, g, beta2)

    # -- (c) vote + apply
    def vote_apply(self, sign, nonzero, params, offsets, lr, weight_decay, step, tie_break, vote, world_size,
                   segments=None, return_delta=True):
        v, t, world, offs, segs = validate_vote_apply(sign, nonzero, params, offsets, tie_break, vote, world_size,
                                                      segments)
        sign, nonzero = _packed(sign), _packed(nonzero)
        if not (planes_ok(sign, nonzero) and all_plain(params, _STATE_DTYPES)):
            return ref.vote_apply(sign, nonzero, params, offs, lr, weight_decay, step, tie_break, vote, world_size,
                                  segs, return_delta)
        return self._ext.vote_apply(sign, nonzero, list(params), offs, float(lr), float(weight_decay), int(step), t,
                                    v, world, segs, bool(return_delta))

    # -- (d) two-phase vote, phase 1
    def shard_vote(self, sign, nonzero, step, tie_break, segments):
        t, segs = validate_shard_vote(sign, nonzero, tie_break, segments)
        sign, nonzero = _packed(sign), _packed(nonzero)
        if not planes_ok(sign, nonzero):
            return ref.shard_vote(sign, nonzero, step, tie_break, segs)
        out_sign, out_nz = self._ext.shard_vote(sign, nonzero, int(step), t, segs)
        return out_sign, out_nz

    # -- (e) p-bit count lanes
    def count_lanes(self, sign, nonzero, p):
        p = validate_count_lanes(sign, nonzero, p)
        sign, nonzero = _packed(sign), _packed(nonzero)
        if not planes_ok(sign, nonzero):
            return ref.count_lanes(sign, nonzero, p)
        plus, cnt, mx = self._ext.count_lanes(sign, nonzero, p)
        if sign.shape[1] > 0 and mx > (1 << p) - 1:
            raise ValueError(f"count {mx} does not fit a {p}-bit lane")
        return plus, cnt

    # -- (f) summed lanes + apply
    def lanes_apply(self, plus_lanes, cnt_lanes, world_size, p, params, offsets, lr, weight_decay, step, tie_break,
                    vote, segments=None, return_delta=True):
        p, v, t, world, offs, segs = validate_lanes_apply(plus_lanes, cnt_lanes, world_size, p, params, offsets,
                                                          tie_break, vote, segments)
        plus_lanes, cnt_lanes = _packed(plus_lanes), _packed(cnt_lanes)
        lanes_ok = is_plain(plus_lanes, (torch.uint8,)) and (cnt_lanes is None or is_plain(cnt_lanes, (torch.uint8,)))
        if not (lanes_ok and all_plain(params, _STATE_DTYPES)):
            return ref.lanes_apply(plus_lanes, cnt_lanes, world_size, p, params, offs, lr, weight_decay, step,
                                   tie_break, vote, segs, return_delta)
        return self._ext.lanes_apply(plus_lanes.reshape(-1), None if cnt_lanes is None else cnt_lanes.reshape(-1),
                                     world, p, list(params), offs, float(lr), float(weight_decay), int(step), t, v,
                                     segs, bool(return_delta))

    # -- (g) int8 codes
    def int8_local_step(self, grads, momenta, offsets, total, beta1, kind, levels, device_counts=False):
        code = ref.enum_code("quant scale", kind)
        total, offs = validate_local(grads, momenta, offsets, total)
        if not self._state_ok(grads, momenta) or not 1 <= levels <= 127:
            return ref.int8_local_step(grads, momenta, offs, total, beta1, kind, levels, device_counts)
        q, n_bad = self._ext.int8_local_step(list(grads), list(momenta), offs, total, float(beta1), code,
                                             int(levels))
        if device_counts:
            return q, *ref.as_device_counts(q.device, n_bad)
        return q, int(n_bad)

    # -- (h) int8 apply
    def int8_apply(self, qsum, params, offsets, lr, weight_decay, return_delta=True):
        offs = validate_int8_apply(qsum, params, offsets)
        qsum = _packed(qsum)
        if not (is_plain(qsum, (torch.int8,)) and all_plain(params, _STATE_DTYPES)):
            return ref.int8_apply(qsum, params, offs, lr, weight_decay, return_delta)
        return self._ext.int8_apply(qsum.reshape(-1), list(params), offs, float(lr), float(weight_decay),
                                    bool(return_delta))

    # -- (i) single-process Lion step
    def lion_step(self, params, grads, momenta, lr, weight_decay, beta1, beta2):
        """One pass per tensor; tensors the kernel does not take (non-contiguous, float64, fp16
        parameters) take the reference path in the same call."""
        validate_lion_step(params, grads, momenta)
        ref.lion_step_split(
            lambda ps, gs, ms: self._ext.lion_step(ps, gs, ms, float(lr), float(weight_decay), float(beta1),
                                                   float(beta2)),
            lambda p, g, m: is_plain(p, _STATE_DTYPES) and is_plain(g, _GRAD_DTYPES) and is_plain(m, _STATE_DTYPES),
            params, grads, momenta, lr, weight_decay, beta1, beta2)

    # -- (k) comm="bbit": the local step and the shard owner's vote
    def bbit_local_step(self, grads, momenta, offsets, total, beta1, beta2, kind, bits, rounding, seed, segments,
                        update_momentum=False, device_counts=False, momenta_out=None):
        total, offs, code, bits, rcode, seed, segs = validate_bbit_local(grads, momenta, offsets, total, kind, bits,
                                                                         rounding, seed, segments, momenta_out)
        if not self._state_ok(grads, momenta) or (momenta_out is not None
                                                  and not all_plain(momenta_out, _STATE_DTYPES)):
            return ref.bbit_local_step(grads, momenta, offs, total, beta1, beta2, kind, bits, rounding, seed, segs,
                                       update_momentum, device_counts, momenta_out)
        planes, nz, n_bad, n_zero = self._ext.bbit_local_step(
            list(grads), list(momenta), offs, total, float(beta1), float(beta2), bool(update_momentum), code, bits,
            rcode, seed, segs, None if momenta_out is None else list(momenta_out))
        if device_counts:
            return planes, nz, *ref.as_device_counts(planes.device, n_bad, n_zero)
        return planes, nz, int(n_bad), int(n_zero)

    def bbit_shard_vote(self, planes, nonzero, bits, step, tie_break, segments):
        t, bits, segs = validate_bbit_shard_vote(planes, nonzero, bits, tie_break, segments)
        planes, nonzero = _packed(planes), _packed(nonzero)
        if not (is_plain(planes, (torch.uint8,)) and planes.shape[0] <= 65535
                and (nonzero is None or is_plain(nonzero, (torch.uint8,)))):
            return ref.bbit_shard_vote(planes, nonzero, bits, step, tie_break, segs)
        return self._ext.bbit_shard_vote(planes, nonzero, bits, int(step), t, segs)

    # -- (j) ZeRO sign all-gather apply
    def zero_sign_apply(self, sign, nonzero, targets, casts, layout, lrs, weight_decays):
        validate_zero_apply(sign, nonzero, targets, casts, layout, lrs, weight_decays)
        casts = [None] * len(targets) if casts is None else list(casts)
        sign, nonzero = _packed(sign), _packed(nonzero)
        ok = (planes_ok(sign, nonzero) and all_plain(targets, (torch.float32,))
              and all(c is None or is_plain(c, _GRAD_DTYPES) for c in casts))
        if not ok:
            return ref.zero_sign_apply(sign, nonzero, targets, casts, layout, lrs, weight_decays)
        self._ext.zero_sign_apply(sign, nonzero, list(targets), casts, layout.pieces, [float(v) for v in lrs],
                                  [float(v) for v in weight_decays])
