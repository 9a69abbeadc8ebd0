"""Kernels: one Backend interface, three implementations, chosen once per device type.

* :mod:`.reference`: the pure-torch reference, the executable contract (``torch`` backend);
* :mod:`.ops`: the fused kernels of ``csrc/`` as torch custom ops (``torch.ops.lioncub.*``: one
  schema, one fake implementation and one set of argument checks per op) and the one native
  backend over them (CPU or CUDA tensors), bit-identical to the reference;
* :mod:`.loader`: finds or builds the compiled extension; :mod:`.build`: the one table of
  sources and flags (setup.py reads it too).

``LIONCUB_KERNELS`` overrides the choice: ``auto`` (default: CUDA kernels for CUDA
tensors, C++ for CPU tensors, each falling back to torch with one warning when it
cannot be built), ``torch`` (pure-torch reference, never builds), ``cpp`` or ``cuda``
(must load, or raise).

Every backend exposes the same functions as :mod:`.reference` (which *is* the torch
backend), and ``layout_for(offsets, total)`` (a bucket's layout, checked once, that its owner
passes as ``offsets``): local_step, abstain_list, momentum_update_list, vote_apply, shard_vote, count_lanes,
lanes_apply, int8_local_step, int8_apply, lion_step (the single-process step),
zero_sign_apply (the ZeRO sign all-gather apply) and bbit_local_step / bbit_shard_vote (comm="bbit")
(:class:`Backend`). The native backend validates
its arguments in Python before any extension call (docs/kernels.md).
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Protocol, runtime_checkable

from . import reference

log = logging.getLogger("lioncub_ds")

BACKENDS = ("auto", "torch", "cpp", "cuda")
_lock = threading.Lock()
_cache: dict = {}


@runtime_checkable
class Backend(Protocol):
    """What the optimizer and the comm algorithms call; torch, cpp and cuda implement it with the
    signatures of :mod:`.reference` (``segments``: a tie-index table, reference.tie_segments)."""

    name: str

    def layout_for(self, offsets, total):
        """A bucket's layout (``offsets`` in a bucket of ``total`` elements), checked once, to keep
        and pass as ``offsets`` to every call of that bucket: an opaque object of this backend (the
        native one: :class:`.ops.Layout`: no lookup per call, and on the CPU the local steps' outputs
        are reused, valid until the bucket's next call of that op; the reference: the offsets)."""
        ...

    def local_step(self, grads, momenta, offsets, total, beta1, beta2, update_momentum=False,
                   device_counts=False, momenta_out=None): ...

    def abstain_list(self, nonzero, mask, capacity): ...

    def momentum_update_list(self, momenta, grads, beta2): ...

    def vote_apply(self, sign, nonzero, params, offsets, lr, weight_decay, step, tie_break, vote, world_size,
                   segments=None, return_delta=True): ...

    def shard_vote(self, sign, nonzero, step, tie_break, segments): ...

    def count_lanes(self, sign, nonzero, p): ...

    def lanes_apply(self, plus_lanes, cnt_lanes, world_size, p, params, offsets, lr, weight_decay, step, tie_break,
                    vote, segments=None, return_delta=True): ...

    def int8_local_step(self, grads, momenta, offsets, total, beta1, kind, levels, device_counts=False): ...

    def int8_apply(self, qsum, params, offsets, lr, weight_decay, return_delta=True): ...

    def lion_step(self, params, grads, momenta, lr, weight_decay, beta1, beta2): ...

    def bbit_local_step(self, grads, momenta, offsets, total, beta1, beta2, kind, bits, rounding, seed, segments,
                        update_momentum=False, device_counts=False, momenta_out=None): ...

    def bbit_shard_vote(self, planes, nonzero, bits, step, tie_break, segments): ...

    def zero_sign_apply(self, sign, nonzero, targets, casts, layout, lrs, weight_decays): ...


class TorchBackend:
    """The pure-torch reference (slow, always available)."""
    name = "torch"
    local_step = staticmethod(reference.local_step)
    abstain_list = staticmethod(reference.abstain_list)
    vote_apply = staticmethod(reference.vote_apply)
    shard_vote = staticmethod(reference.shard_vote)
    count_lanes = staticmethod(reference.count_lanes)
    lanes_apply = staticmethod(reference.lanes_apply)
    int8_local_step = staticmethod(reference.int8_local_step)
    int8_apply = staticmethod(reference.int8_apply)
    lion_step = staticmethod(reference.lion_step)
    zero_sign_apply = staticmethod(reference.zero_sign_apply)
    bbit_local_step = staticmethod(reference.bbit_local_step)
    bbit_shard_vote = staticmethod(reference.bbit_shard_vote)

    @staticmethod
    def layout_for(offsets, total):
        """The reference checks every call: a bucket's layout is its offsets."""
        return offsets

    @staticmethod
    def momentum_update_list(momenta, grads, beta2):
        for m, g in zip(momenta, grads):
            reference.momentum_update(m, g, beta2)


def requested() -> str:
    value = os.environ.get("LIONCUB_KERNELS", "auto").strip().lower()
    if value not in BACKENDS:
        raise ValueError(f"LIONCUB_KERNELS={value!r} is not allowed; allowed: {', '.join(BACKENDS)}")
    return value


def _load_native(kind: str):
    """Build/load the C++ ('cpp') or CUDA ('cuda') backend. Raises on failure."""
    from . import loader  # imported lazily: it may build (ninja, a compiler)

    return loader.load(kind)


def backend_for(device_type: str = "cpu"):
    """The backend object for tensors on ``device_type`` ('cpu' or 'cuda')."""
    want = requested()
    key = (want, device_type)
    be = _cache.get(key)  # called per bucket and step: no lock once made
    if be is not None:
        return be
    with _lock:
        if key in _cache:
            return _cache[key]
        native_kind = "cuda" if device_type == "cuda" else "cpp"
        if want == "torch":
            be = TorchBackend()
        elif want in ("cpp", "cuda"):
            if want != native_kind:
                raise RuntimeError(f"LIONCUB_KERNELS={want} cannot run {device_type} tensors")
            be = _load_native(native_kind)
        else:
            try:
                be = _load_native(native_kind)
            except Exception as exc:  # noqa: BLE001 - any build failure falls back, once, loudly
                log.warning("lioncub_ds: %s kernels unavailable (%s); using the pure-torch path", native_kind,
                            str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                be = TorchBackend()
        _cache[key] = be
        return be


def active_backend_name(device_type: str = "cpu") -> str:
    return backend_for(device_type).name
