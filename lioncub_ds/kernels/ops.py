"""The fused kernels as torch custom ops: each op declared once, checked once, one native backend.

* **Declared once**: every op has one ``torch.library`` schema (namespace ``lioncub``, :data:`SCHEMAS`)
  and one fake implementation (output shapes only), so ``torch.compile`` can trace a call and
  ``torch.library.opcheck`` can test it. ``csrc/bindings.cpp`` (the one binding file) registers the
  CPU kernels and, built with CUDA, the CUDA launchers as the implementations of these schemas.
* **Errors raised in one place**: the errors a user sees are raised here, in Python (a C++ exception
  thrown through a JIT extension crashes the process on some images); bindings.cpp's invariants,
  checked before anything is written, only decide whether the CPU's gated entry runs (a failure is
  caught inside the extension: the checks here then run). A ValueError (TypeError for a
  non-tensor) names the argument and what is allowed. Tensors the kernels do not handle
  (non-contiguous, float64, another device type) are not errors: they take the reference path,
  whose results are the contract.
* **Once per bucket, not per call**: a bucket's offsets (non-negative multiples of 8 inside the
  bucket) and its tie-index table (on the kernels' device) are checked and built once and kept in a
  :class:`Layout`: the bucket's owner (the pipeline) makes it with ``backend.layout_for`` and passes
  it as ``offsets`` (no lookup; on the CPU the local steps then write into the layout's workspace,
  the same outputs every step); an offsets list is found again by its identity.
* **One C++ call per call on the CPU**: for a known layout, the call goes first to the extension's
  gated entry (``try_<op>``: the op's own invariants over every tensor, then the kernel), which
  answers None instead of running when an argument does not fit; the Python checks then run (the
  ValueError naming the argument, or the reference path). On CUDA, tensors that stay the same
  objects (parameters, momenta) are checked once per layout, fresh ones (gradients, received planes)
  with a few attribute reads. docs/kernels.md measures what is left.

:class:`NativeBackend` (``name`` "cpp" for CPU tensors, "cuda" for CUDA tensors) has exactly the
signatures and results of :mod:`.reference`. In eager mode it calls the registered C++ functions
directly (the same functions, without the dispatcher's boxing: ~2 µs less per call); while
``torch.compile`` traces, it calls ``torch.ops.lioncub.*``, which the compiled graph then holds.
"""
from __future__ import annotations

import numbers
import operator
import types
import weakref
from collections import OrderedDict

import torch

from . import reference as ref

NAMESPACE = "lioncub"

# ----------------------------------------------------------------------------- schemas (one per op)
# Mutated arguments carry (x!). An apply's Δ is an empty tensor without return_delta; count_lanes'
# cnt is empty without nonzero planes, its overflow flag [1] only when a count could overflow; a
# zero_sign_apply cast of 0 elements means "no cast" (a schema has no mutable Tensor?[]).
SCHEMAS = {
    "local_step": "(Tensor[] grads, Tensor(a!)[] momenta, Tensor(b!)[] momenta_out, Tensor offsets, int total, "
                  "float beta1, float beta2, bool update_momentum) -> (Tensor, Tensor, Tensor)",
    "abstain_list": "(Tensor nonzero, Tensor mask, int capacity) -> Tensor",
    "momentum_update": "(Tensor(a!)[] momenta, Tensor[] grads, float beta2) -> ()",
    "vote_apply": "(Tensor sign, Tensor? nonzero, Tensor(a!)[] params, Tensor offsets, float lr, float weight_decay, "
                  "int step, int tie, int vote, int world_size, Tensor segments, bool return_delta) -> Tensor",
    "shard_vote": "(Tensor sign, Tensor? nonzero, int step, int tie, Tensor segments) -> (Tensor, Tensor)",
    "count_lanes": "(Tensor sign, Tensor? nonzero, int p) -> (Tensor, Tensor, Tensor)",
    "lanes_apply": "(Tensor plus, Tensor? cnt, int world_size, int p, Tensor(a!)[] params, Tensor offsets, float lr, "
                   "float weight_decay, int step, int tie, int vote, Tensor segments, bool return_delta) -> Tensor",
    "int8_local_step": "(Tensor[] grads, Tensor[] momenta, Tensor offsets, int total, float beta1, int kind, "
                       "int levels) -> (Tensor, Tensor)",
    "int8_apply": "(Tensor qsum, Tensor(a!)[] params, Tensor offsets, float lr, float weight_decay, "
                  "bool return_delta) -> Tensor",
    "lion_step": "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momenta, float lr, float weight_decay, "
                 "float beta1, float beta2) -> ()",
    "zero_sign_apply": "(Tensor sign, Tensor? nonzero, Tensor(a!)[] targets, Tensor(b!)[] casts, Tensor layout, "
                       "float[] lrs, float[] weight_decays) -> ()",
    "bbit_local_step": "(Tensor[] grads, Tensor(a!)[] momenta, Tensor(b!)[] momenta_out, Tensor offsets, int total, "
                       "float beta1, float beta2, bool update_momentum, int kind, int bits, int rounding, int seed, "
                       "Tensor segments) -> (Tensor, Tensor, Tensor)",
    "bbit_shard_vote": "(Tensor planes, Tensor? nonzero, int bits, int step, int tie, Tensor segments) "
                       "-> (Tensor, Tensor)",
}

_lib = torch.library.Library(NAMESPACE, "DEF")
for _name, _schema in SCHEMAS.items():
    _lib.define(_name + _schema)


def op(name: str):
    """The registered op ``torch.ops.lioncub.<name>.default``."""
    return getattr(getattr(torch.ops, NAMESPACE), name).default


# ----------------------------------------------------------------------------- fake implementations
def _u8(like, n):
    return like.new_empty((n,), dtype=torch.uint8)


def _device_of(*lists):
    for ts in lists:
        if len(ts):
            return ts[0]
    return torch.empty(0)


@torch.library.register_fake("lioncub::local_step")
def _(grads, momenta, momenta_out, offsets, total, beta1, beta2, update_momentum):
    like = _device_of(grads, momenta)
    return _u8(like, total // 8), _u8(like, total // 8), like.new_empty((2,), dtype=torch.int64)


@torch.library.register_fake("lioncub::abstain_list")
def _(nonzero, mask, capacity):
    return nonzero.new_empty((1 + 2 * capacity,), dtype=torch.int32)


@torch.library.register_fake("lioncub::momentum_update")
def _(momenta, grads, beta2):
    return None


def _delta(like, numel, return_delta):
    return like.new_empty((numel if return_delta else 0,), dtype=torch.float32)


@torch.library.register_fake("lioncub::vote_apply")
def _(sign, nonzero, params, offsets, lr, weight_decay, step, tie, vote, world_size, segments, return_delta):
    return _delta(sign, sign.shape[-1] * 8, return_delta)


@torch.library.register_fake("lioncub::shard_vote")
def _(sign, nonzero, step, tie, segments):
    return _u8(sign, sign.shape[-1]), _u8(sign, sign.shape[-1])


def overflow_checked(rows, row_bytes, p, with_nonzero) -> bool:
    """Whether count_lanes can overflow a p-bit lane (then it returns an overflow flag [1], else [0])."""
    return with_nonzero and rows > (1 << p) - 1 and row_bytes > 0


@torch.library.register_fake("lioncub::count_lanes")
def _(sign, nonzero, p):
    rows, s = (sign.shape[0] if sign.dim() == 2 else 1), sign.shape[-1]
    return (_u8(sign, s * p), _u8(sign, s * p if nonzero is not None else 0),
            sign.new_empty((1 if overflow_checked(rows, s, p, nonzero is not None) else 0,), dtype=torch.int32))


@torch.library.register_fake("lioncub::lanes_apply")
def _(plus, cnt, world_size, p, params, offsets, lr, weight_decay, step, tie, vote, segments, return_delta):
    return _delta(plus, plus.numel() * 8 // p, return_delta)


@torch.library.register_fake("lioncub::int8_local_step")
def _(grads, momenta, offsets, total, beta1, kind, levels):
    like = _device_of(grads, momenta)
    return like.new_empty((total,), dtype=torch.int8), like.new_empty((1,), dtype=torch.int64)


@torch.library.register_fake("lioncub::int8_apply")
def _(qsum, params, offsets, lr, weight_decay, return_delta):
    return _delta(qsum, qsum.numel(), return_delta)


@torch.library.register_fake("lioncub::lion_step")
def _(params, grads, momenta, lr, weight_decay, beta1, beta2):
    return None


@torch.library.register_fake("lioncub::zero_sign_apply")
def _(sign, nonzero, targets, casts, layout, lrs, weight_decays):
    return None


@torch.library.register_fake("lioncub::bbit_local_step")
def _(grads, momenta, momenta_out, offsets, total, beta1, beta2, update_momentum, kind, bits, rounding, seed,
      segments):
    like = _device_of(grads, momenta)
    return (like.new_empty((bits, total // 8), dtype=torch.uint8), _u8(like, total // 8),
            like.new_empty((2,), dtype=torch.int64))


@torch.library.register_fake("lioncub::bbit_shard_vote")
def _(planes, nonzero, bits, step, tie, segments):
    return _u8(planes, planes.shape[2]), _u8(planes, planes.shape[2])


# abstain_list on CUDA: the reference's torch ops (fixed-size outputs, asynchronous on the device):
# no kernel of our own is needed there.
torch.library.impl(f"{NAMESPACE}::abstain_list", "CUDA", lib=_lib)(ref.abstain_list)


# ----------------------------------------------------------------------------- checks (the one place)
GRAD_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))
STATE_DTYPES = frozenset((torch.float32, torch.bfloat16))
# the parameters (θ) the kernels apply to: the C++ kernels take fp32/bf16, the CUDA kernels fp16 too
# (the emulated CUDA kernels are checked against the reference with fp16 θ: tests/test_cuda_kernels.py)
PARAM_DTYPES = {"cpu": STATE_DTYPES, "cuda": STATE_DTYPES | {torch.float16}}
_STRIDED = torch.strided


def is_plain(t, dtypes, device_type="cpu") -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == device_type and t.layout == _STRIDED
            and t.is_contiguous() and t.dtype in dtypes)


def all_plain(ts, dtypes, device_type="cpu") -> bool:
    return all(is_plain(t, dtypes, device_type) for t in ts)


def _int_offsets(offsets) -> list:
    if offsets.__class__ is Layout:
        return list(offsets.offsets)
    if isinstance(offsets, torch.Tensor):
        return [int(v) for v in offsets.tolist()]
    return [int(v) for v in offsets]


def check_tensors(named) -> None:
    """``named``: [(name, tensor or None)]: every tensor is a torch.Tensor, all on one device."""
    dev = None
    for name, t in named:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"lioncub kernels: {name} must be a torch.Tensor, got {type(t).__name__}")
        if dev is None:
            dev, first = t.device, name
        elif t.device != dev:
            raise ValueError(f"lioncub kernels: {name} is on {t.device} but {first} is on {dev}: every tensor of a "
                             "call must be on one device")


def check_offsets(offs, limit) -> None:
    for i, o in enumerate(offs):
        if o < 0 or o % 8:
            raise ValueError(f"lioncub kernels: offsets[{i}]={o} must be a non-negative multiple of 8")
        if limit is not None and o > limit:
            raise ValueError(f"lioncub kernels: offsets[{i}]={o} lies outside the bucket of {limit} elements")


def check_bucket(tensors, offsets, limit, name, others=None, others_name=None) -> list:
    """Offsets are non-negative multiples of 8, every tensor fits [0, limit) and none overlap;
    ``others`` (momenta of grads...) pair one to one with ``tensors``. Returns the int offsets."""
    offs = _int_offsets(offsets)
    if len(offs) != len(tensors):
        raise ValueError(f"lioncub kernels: {name} has {len(tensors)} tensors but offsets has {len(offs)} entries")
    if others is not None:
        if len(others) != len(tensors):
            raise ValueError(f"lioncub kernels: {name} has {len(tensors)} tensors but {others_name} has {len(others)}")
        for i, (a, b) in enumerate(zip(tensors, others)):
            if a.numel() != b.numel():
                raise ValueError(f"lioncub kernels: {name}[{i}] has {a.numel()} elements but {others_name}[{i}] has "
                                 f"{b.numel()}")
    check_offsets(offs, None)
    spans = []
    for i, (t, o) in enumerate(zip(tensors, offs)):
        n = t.numel()
        if limit is not None and o + n > limit:
            raise ValueError(f"lioncub kernels: {name}[{i}] ({n} elements at offset {o}) does not fit the "
                             f"bucket of {limit} elements")
        if n:
            spans.append((o, o + n, i))
    spans.sort()
    for (a0, a1, i), (b0, _, j) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ValueError(f"lioncub kernels: {name}[{i}] and {name}[{j}] overlap in the bucket "
                             f"(offsets {a0} and {b0})")
    return offs


def check_planes(sign, nonzero, two_d: bool) -> None:
    """sign: uint8 [N, bytes] (or [bytes] when not two_d); nonzero: None or the same shape."""
    check_tensors([("sign", sign), ("nonzero", nonzero)])
    dims = (2,) if two_d else (1, 2)
    if sign.dim() not in dims:
        raise ValueError(f"lioncub kernels: sign must be a {'2-D [N, bytes]' if two_d else '1-D or 2-D [N, bytes]'} "
                         f"uint8 tensor, got {sign.dim()} dims")
    if nonzero is not None and tuple(nonzero.shape) != tuple(sign.shape):
        raise ValueError(f"lioncub kernels: nonzero planes {tuple(nonzero.shape)} must match the sign planes "
                         f"{tuple(sign.shape)}")
    if sign.dim() == 2 and sign.shape[0] < 1:
        raise ValueError("lioncub kernels: sign must hold at least one plane")


def check_world(world_size) -> int:
    w = int(world_size)
    if not 1 <= w < 2**31:
        raise ValueError(f"lioncub kernels: world_size must be in 1..2**31-1, got {world_size!r}")
    return w


def check_lane_width(p) -> int:
    if p not in ref.LANE_WIDTHS:
        raise ValueError(f"lane width p must be one of {ref.LANE_WIDTHS}, got {p!r}")
    return int(p)


def check_total(total) -> int:
    t = int(total)
    if t < 0 or t % 8:
        raise ValueError(f"lioncub kernels: total must be a non-negative multiple of 8, got {total!r}")
    return t


def check_bits(bits) -> int:
    if isinstance(bits, bool) or bits not in ref.VOTE_BITS:
        raise ValueError(f"vote_bits must be one of {ref.VOTE_BITS}, got {bits!r}")
    return int(bits)


def _span(t):
    start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    return start, start + t.numel() * t.element_size()


def no_shared_memory(outs, name, inputs, inputs_name) -> None:
    """No output tensor's memory overlaps another output's or an input's (same-device spans)."""
    spans = sorted([(*_span(t), i, True) for i, t in enumerate(outs) if t.numel()]
                   + [(*_span(t), -1, False) for t in inputs if t.numel()])
    for (a0, a1, i, a_out), (b0, _, j, b_out) in zip(spans, spans[1:]):
        if b0 < a1 and (a_out or b_out):
            k = i if a_out else j
            raise ValueError(f"lioncub kernels: {name}[{k}] shares memory with "
                             f"{'another output' if a_out and b_out else inputs_name}; allowed: separate buffers")


def validate_local(grads, momenta, offsets, total, momenta_out=None):
    """local_step / int8_local_step / bbit_local_step: returns (total, int offsets). ``momenta_out``:
    one tensor per momentum, same dtype, size and device, sharing no memory with the inputs."""
    total = check_total(total)
    check_tensors([(f"grads[{i}]", g) for i, g in enumerate(grads)]
                  + [(f"momenta[{i}]", m) for i, m in enumerate(momenta)])
    offs = check_bucket(grads, offsets, total, "grads", momenta, "momenta")
    if momenta_out is not None:
        if not isinstance(momenta_out, (list, tuple)) or len(momenta_out) != len(momenta):
            raise ValueError(f"lioncub kernels: momenta_out must be a list of {len(momenta)} tensors (one per "
                             f"momentum), got {type(momenta_out).__name__}"
                             f"{f' of {len(momenta_out)}' if isinstance(momenta_out, (list, tuple)) else ''}")
        check_tensors([(f"momenta_out[{i}]", t) for i, t in enumerate(momenta_out)]
                      + [(f"momenta[{i}]", t) for i, t in enumerate(momenta)])
        for i, (o, m) in enumerate(zip(momenta_out, momenta)):
            if o.dtype != m.dtype or o.numel() != m.numel():
                raise ValueError(f"lioncub kernels: momenta_out[{i}] ({o.dtype}, {o.numel()} elements) must match "
                                 f"momenta[{i}] ({m.dtype}, {m.numel()} elements)")
        no_shared_memory(momenta_out, "momenta_out", list(momenta) + list(grads), "the momenta or gradients")
    return total, offs


def validate_abstain_list(nonzero, mask, capacity) -> int:
    """abstain_list: two 1-D uint8 planes of one size on one device; 0 <= capacity <= plane bytes."""
    check_tensors([("nonzero", nonzero), ("mask", mask)])
    for name, t in (("nonzero", nonzero), ("mask", mask)):
        if t.dtype != torch.uint8 or t.dim() != 1:
            raise ValueError(f"lioncub kernels: {name} must be a 1-D uint8 plane, got {t.dtype} with {t.dim()} dims")
    if nonzero.numel() != mask.numel():
        raise ValueError(f"lioncub kernels: nonzero has {nonzero.numel()} bytes but mask has {mask.numel()}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not 0 <= capacity <= nonzero.numel():
        raise ValueError(f"lioncub kernels: capacity must be an int in 0..{nonzero.numel()} (the plane's bytes), "
                         f"got {capacity!r}")
    if nonzero.numel() >= 2**31:
        raise ValueError(f"lioncub kernels: an abstention list indexes planes of < 2**31 bytes, got {nonzero.numel()}")
    return capacity


def validate_momentum(momenta, grads) -> None:
    check_tensors([(f"grads[{i}]", g) for i, g in enumerate(grads)]
                  + [(f"momenta[{i}]", m) for i, m in enumerate(momenta)])
    if len(momenta) != len(grads):
        raise ValueError(f"lioncub kernels: momenta has {len(momenta)} tensors but grads has {len(grads)}")
    for i, (m, g) in enumerate(zip(momenta, grads)):
        if m.numel() != g.numel():
            raise ValueError(f"lioncub kernels: momenta[{i}] has {m.numel()} elements but grads[{i}] has "
                             f"{g.numel()}")


def vote_codes(tie_break, vote, world_size):
    """(vote code, tie code, world size) of an apply; the tie rule only matters to majority votes."""
    v = ref.enum_code("vote", vote)
    t = ref.enum_code("tie_break", tie_break) if v == 0 else 0
    return v, t, check_world(world_size)


def validate_params(params, limit, offsets, planes_named):
    """An apply's parameters: tensors on the planes' device, placed in a bucket of ``limit`` elements."""
    check_tensors(planes_named + [(f"params[{i}]", p) for i, p in enumerate(params)])
    return check_bucket(params, offsets, limit, "params")


def validate_lion_step(params, grads, momenta) -> None:
    """lion_step: three lists of tensors on one device, paired one to one with equal element counts."""
    if not (len(params) == len(grads) == len(momenta)):
        raise ValueError(f"lioncub kernels: params, grads and momenta must have the same length, got {len(params)}, "
                         f"{len(grads)} and {len(momenta)}")
    check_tensors([(f"params[{i}]", p) for i, p in enumerate(params)]
                  + [(f"grads[{i}]", g) for i, g in enumerate(grads)]
                  + [(f"momenta[{i}]", m) for i, m in enumerate(momenta)])
    for i, (p, g, m) in enumerate(zip(params, grads, momenta)):
        if not p.numel() == g.numel() == m.numel():
            raise ValueError(f"lioncub kernels: params[{i}] has {p.numel()} elements but grads[{i}] has {g.numel()} "
                             f"and momenta[{i}] {m.numel()}")


def validate_zero_apply(sign, nonzero, targets, casts, layout, lrs, weight_decays) -> None:
    """zero_sign_apply: planes [N, bytes] holding every group's votes, one 1-D target (and optional
    cast) of N·P_g elements and one lr / weight decay per group of the layout."""
    if not isinstance(layout, ref.ZeroLayout):
        raise TypeError(f"lioncub kernels: layout must be a ZeroLayout (reference.zero_layout), got "
                        f"{type(layout).__name__}")
    check_tensors([("sign", sign), ("nonzero", nonzero)] + [(f"targets[{g}]", t) for g, t in enumerate(targets)]
                  + [(f"casts[{g}]", c) for g, c in enumerate(casts or [])])
    if sign.dim() != 2 or (nonzero is not None and (nonzero.dim() != 2 or nonzero.shape[0] != sign.shape[0])):
        raise ValueError(f"lioncub kernels: sign must be 2-D [N, bytes] and nonzero None or 2-D with as many rows, "
                         f"got {tuple(sign.shape)} and {None if nonzero is None else tuple(nonzero.shape)}")
    n = sign.shape[0]
    if n != layout.world_size:
        raise ValueError(f"lioncub kernels: sign has {n} planes but the layout has world_size {layout.world_size}")
    need = layout.plane_bytes
    for name, t in (("sign", sign), ("nonzero", nonzero)):
        if t is not None and t.shape[1] < need:
            raise ValueError(f"lioncub kernels: {name} rows have {t.shape[1]} bytes but the layout needs {need}")
    ng = layout.groups
    for name, v in (("targets", targets), ("lrs", lrs), ("weight_decays", weight_decays)) + \
            ((("casts", casts),) if casts is not None else ()):
        if len(v) != ng:
            raise ValueError(f"lioncub kernels: {name} has {len(v)} entries but the layout has {ng} groups")
    for g, ps in enumerate(layout.part_numels):
        for name, t in (("targets", targets[g]), ("casts", None if casts is None else casts[g])):
            if t is not None and (t.dim() != 1 or t.numel() != n * ps):
                raise ValueError(f"lioncub kernels: {name}[{g}] must be 1-D with {n * ps} elements (N x part numel), "
                                 f"got shape {tuple(t.shape)}")


def validate_bbit_codes(kind, bits, rounding, seed):
    """bbit_local_step's codes: (scale code, bits, rounding code, seed)."""
    code = ref.enum_code("quant scale", kind)
    rcode = ref.enum_code("rounding", rounding)
    bits = check_bits(bits)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"lioncub kernels: the dither seed must be an int in 0..2**32-1 (reference.dither_seed), "
                         f"got {seed!r}")
    return code, bits, rcode, int(seed)


def validate_code_planes(planes, nonzero, bits):
    """bbit_shard_vote: planes uint8 [N, bits, bytes], nonzero None or [N, bytes]."""
    check_tensors([("planes", planes), ("nonzero", nonzero)])
    if planes.dim() != 3 or planes.shape[1] != bits or planes.shape[0] < 1 or planes.dtype != torch.uint8:
        raise ValueError(f"lioncub kernels: planes must be a uint8 [N, bits={bits}, bytes] tensor with N >= 1, got "
                         f"{planes.dtype} {tuple(planes.shape)}")
    if nonzero is not None and (nonzero.dtype != torch.uint8
                                or tuple(nonzero.shape) != (planes.shape[0], planes.shape[2])):
        raise ValueError(f"lioncub kernels: nonzero planes must be uint8 [N, bytes] = {(planes.shape[0], planes.shape[2])}"
                         f", got {nonzero.dtype} {tuple(nonzero.shape)}")


# ----------------------------------------------------------------------------- layouts (once per bucket)
class Layout:
    """One bucket as the kernels see it, checked once: int offsets (and an int64 CPU tensor of them for
    the kernels), the bucket size, its tie-index table (one copy per device) and the tensors already
    checked against it (by identity). Built by :func:`layout_for`."""

    __slots__ = ("key", "offsets", "limit", "table", "seen", "_tables", "owned", "ws")

    def __init__(self, key, offs, limit, owned=False):
        self.key = key                    # the caller's offsets object (held: its id stays unique)
        self.offsets = offs               # list of ints (validated)
        self.limit = limit
        self.table = torch.tensor(offs, dtype=torch.int64)
        self.seen = {}                    # argument name -> weak references to the tensors checked against it
        self._tables = {}
        # made by NativeBackend.layout_for and kept by the bucket's owner: the CPU local steps write into
        # ws (op -> (its output buffers, the result tuple over them)), valid until that op's next call
        self.owned = owned
        self.ws = {}

    def __repr__(self):
        return f"Layout({len(self.offsets)} tensors in {self.limit} elements{', owned' if self.owned else ''})"

    def tie_table(self, device):
        """The bucket's tie-index table (conventions.tie_segments of the offsets) on ``device``."""
        t = self._tables.get(device)
        if t is None:
            t = self._tables[device] = ref.tie_segments(self.offsets).to(device)
        return t


_LAYOUTS: "OrderedDict[int, Layout]" = OrderedDict()
_MAX_LAYOUTS = 4096  # buckets of every live plan (a least-recently-used bound: old plans' layouts go)


def layout_for(offsets, limit: int) -> Layout:
    """The :class:`Layout` of ``offsets`` in a bucket of ``limit`` elements: found again by the identity
    of the offsets object (and its unchanged content), else checked and made. Raises ValueError for
    offsets that are not non-negative multiples of 8 inside the bucket. A Layout passed as
    ``offsets`` is itself (when its bucket has ``limit`` elements)."""
    if offsets.__class__ is Layout:
        if offsets.limit == limit:
            return offsets
        offsets = offsets.key
    lay = _cached_layout(offsets)
    if lay is not None and lay.limit == limit:
        return lay
    offs = _int_offsets(offsets)
    check_offsets(offs, limit)
    lay = Layout(offsets, offs, limit)
    _LAYOUTS[id(offsets)] = lay
    _LAYOUTS.move_to_end(id(offsets))
    while len(_LAYOUTS) > _MAX_LAYOUTS:
        _LAYOUTS.popitem(last=False)
    return lay


def _cached_layout(offsets):
    """The cached Layout of this very offsets object, if its content is unchanged; else None."""
    lay = _LAYOUTS.get(id(offsets))
    if lay is not None and lay.key is offsets and (
            lay.offsets == offsets if isinstance(offsets, list) else lay.offsets == _int_offsets(offsets)):
        return lay
    return None


def _refs(ts) -> tuple:
    """Weak references to tensors checked once (a layout must not keep an old model's state alive)."""
    return tuple(map(weakref.ref, ts))


def _same(ts, refs) -> bool:
    """Whether ``ts`` are the very tensor objects ``refs`` (from :func:`_refs`) point to."""
    return refs is not None and len(ts) == len(refs) and all(map(operator.is_, ts, map(operator.call, refs)))


_NUMEL, _CONTIGUOUS, _DTYPE = torch.Tensor.numel, torch.Tensor.is_contiguous, operator.attrgetter("dtype")


# the validated tie-index tables of callers' segments tensors, by identity (the tensor is held)
_TABLES: "OrderedDict[int, tuple]" = OrderedDict()


def tie_table(segments, device, layout=None):
    """A tie-index table on ``device``: the layout's own for ``segments=None`` (vote_apply,
    lanes_apply), else the caller's table, validated (reference.as_segments) the first time this
    tensor is seen and copied to ``device`` once."""
    if segments is None and layout is not None:
        return layout.tie_table(device)
    if isinstance(segments, torch.Tensor):
        hit = _TABLES.get(id(segments))
        if hit is not None and hit[0] is segments:
            t = hit[1].get(device)
            if t is None:
                t = hit[1][device] = hit[1]["cpu"].to(device)
            return t
        checked = ref.as_segments(segments)
        tables = {"cpu": checked}
        _TABLES[id(segments)] = (segments, tables)
        while len(_TABLES) > _MAX_LAYOUTS:
            _TABLES.popitem(last=False)
        return checked if str(device) == "cpu" else tables.setdefault(device, checked.to(device))
    return ref.as_segments(segments).to(device)


def _checked_segments(segments):
    """A caller's tie-index table for the reference path: validated (None stays None: the bucket's own)."""
    return None if segments is None else ref.as_segments(segments)


# ----------------------------------------------------------------------------- the native backend
def _packed(t):
    """Packed planes, lanes and int8 codes are small (at most 1 byte per element): a strided
    view (a column of a gathered buffer, a decoded plane) is copied, not sent to the reference,
    which is 100x slower."""
    if isinstance(t, torch.Tensor) and t.layout == _STRIDED and not t.is_contiguous():
        return t.contiguous()
    return t


_EMPTY = ()
_compiling = torch.compiler.is_compiling


def _local_ws(total, planes=None):
    """A local step's workspace (CPU): (sign or code planes, nonzero plane, counts int64 [2]) and the
    result tuple over them (the counts as 0-dim views: the device_counts form)."""
    first = torch.zeros(total // 8 if planes is None else (planes, total // 8), dtype=torch.uint8)
    nz, counts = torch.zeros(total // 8, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64)
    return (first, nz, counts), (first, nz, counts[0], counts[1])


def _int8_ws(total, planes=None):
    q, n_bad = torch.zeros(total, dtype=torch.int8), torch.zeros(1, dtype=torch.int64)
    return (q, n_bad), (q, n_bad.reshape(()))


def _outs_ok(momenta_out, momenta) -> bool:
    """momenta_out for a gated call: None, or a list / tuple of one tensor per momentum (the C++ side
    reads an empty list as none)."""
    return momenta_out is None or (momenta_out.__class__ in (list, tuple) and len(momenta_out) == len(momenta))


def _rows(planes) -> int:
    """Rows of 2-D planes ([N, bytes]); anything else counts as too many (the checks then run)."""
    return planes.shape[0] if isinstance(planes, torch.Tensor) and planes.dim() == 2 else 1 << 62


def _memo(table: dict, key, make):
    """``make()`` remembered under ``key`` (the few enum / code combinations a run uses); an unhashable
    key is not remembered."""
    try:
        return table[key]
    except KeyError:
        v = table[key] = make()
        return v
    except TypeError:
        return make()


_APPLY_CODES: dict = {}
_QUANT_CODES: dict = {}
_BBIT_CODES: dict = {}


class NativeBackend:
    """The fused kernels of one device type (``"cpu"``: name "cpp"; ``"cuda"``: name "cuda") with the
    exact interface of :class:`lioncub_ds.kernels.TorchBackend`.

    ``vote_apply``, ``lanes_apply`` and ``int8_apply`` return Δ like the reference; pass
    ``return_delta=False`` to skip materialising it (4 bytes per element of extra writes). On CUDA
    nothing synchronizes with the host except what returns host ints: ``device_counts=False`` of the
    local steps, and count_lanes' overflow check when a count could overflow.

    :meth:`layout_for` gives a bucket's owner (the pipeline) its :class:`Layout` to pass as
    ``offsets``. On the CPU a call with a known layout is one gated C++ call (module docstring),
    and the local steps of an owned layout return the layout's workspace: the same tensors every
    call, valid until that op's next call with that layout.
    """

    def __init__(self, ext, device_type: str = "cpu"):
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
        self._ext = ext
        self.device_type = device_type
        self.param_dtypes = PARAM_DTYPES[device_type]
        self.name = "cpp" if device_type == "cpu" else "cuda"
        self._prefix = "" if device_type == "cpu" else "cuda_"
        self._cuda = device_type == "cuda"
        self._on_device = operator.attrgetter("is_cuda" if self._cuda else "is_cpu")
        self._direct = {}
        # the gated entries (try_<op>) of a CPU build that has them; a stand-in module (tests) takes
        # the Python checks alone
        self._try = ext if (not self._cuda and isinstance(ext, types.ModuleType)
                            and hasattr(ext, "try_local_step_into")) else None
        self._tries = {} if self._try is None else {
            n[4:]: getattr(ext, n) for n in dir(ext) if n.startswith("try_")}

    def layout_for(self, offsets, total) -> Layout:
        """A bucket's :class:`Layout`, checked now (offsets non-negative multiples of 8 inside ``total``
        elements), for its owner to keep and pass as ``offsets`` to every call of the bucket."""
        total = check_total(total)
        if offsets.__class__ is Layout:
            offsets = offsets.key
        offs = _int_offsets(offsets)
        check_offsets(offs, total)
        return Layout(offsets, offs, total, owned=True)

    def _eager(self, offsets):
        """The known layout of a call that may take the gated C++ entry, else None."""
        if self._try is None:
            return None
        cls = offsets.__class__
        lay = offsets if cls is Layout else (_cached_layout(offsets) if cls is list else None)
        return None if lay is None or _compiling() else lay

    def _gate_tables(self, offsets, segments):
        """(the known layout, the CPU tie table) of a gated call, in one look (a call's Python costs
        ~0.1-0.2 µs here: the applies make this one call, not five); None where the call cannot take
        the gated entry or the tie table would raise (the Python checks then raise in order)."""
        lay = self._eager(offsets)
        table = None if lay is None else self._tie_cpu(segments, lay)
        return None if table is None else (lay, table)

    def _segments_table(self, segments):
        """The CPU tie table of a shard vote's segments for its gated entry (None: the checks run)."""
        if self._try is None or _compiling():
            return None
        return self._tie_cpu(segments)

    def _tie_cpu(self, segments, lay=None):
        """The tie-index table on the CPU: the layout's own for ``segments=None``, else the caller's
        (known by identity after the first time); None where it would raise."""
        if segments is None and lay is not None:
            return lay.tie_table("cpu")
        hit = _TABLES.get(id(segments)) if segments.__class__ is torch.Tensor else None
        return hit[1]["cpu"] if hit is not None and hit[0] is segments else self._cpu_table(segments, lay)

    @staticmethod
    def _cpu_table(segments, lay):
        """tie_table on the CPU, or None where it would raise (the Python checks then raise in order)."""
        try:
            return tie_table(segments, "cpu", lay)
        except (ValueError, TypeError, RuntimeError):
            return None

    def _gated(self, name, *args):
        """The extension's ``try_<name>``: its result, or None when an argument does not fit."""
        try:
            return self._tries[name](*args)
        except TypeError:  # an argument pybind cannot convert (not a tensor list...): the checks say which
            return None

    def __repr__(self):
        return f"NativeBackend({self.name})"

    # -- the call: the extension's function directly, or the registered op while torch.compile traces
    def _run(self, name, *args):
        if torch.compiler.is_compiling():
            return op(name)(*args)
        fn = self._direct.get(name)
        if fn is None:
            fn = self._direct[name] = getattr(self._ext, self._prefix + name)
        return fn(*args)

    # -- introspection / test hooks (the CPU kernels' ISA dispatch)
    @property
    def isa(self) -> str:
        return self._ext.isa()

    def set_isa(self, isa: str) -> None:
        """'auto', 'baseline' or 'avx2' (both paths give identical results)."""
        codes = {"auto": 0, "baseline": 1, "base": 1, "avx2": 2}
        if isa not in codes:
            raise ValueError(f"isa must be one of {tuple(codes)}, got {isa!r}")
        self._ext.set_isa(codes[isa])

    # -- per-call checks of what changes from call to call (layouts hold the rest)
    def _fits(self, ts, numels, dtypes) -> bool:
        """Fresh tensors (gradients): of the sizes the layout was checked with, on this device type, of
        an allowed dtype, contiguous. C-level maps (a Python loop costs ~1 µs per tensor); a sparse or
        non-tensor argument raises inside: not fitting."""
        try:
            return (tuple(map(_NUMEL, ts)) == numels and all(map(self._on_device, ts))
                    and dtypes.issuperset(map(_DTYPE, ts)) and all(map(_CONTIGUOUS, ts)))
        except (AttributeError, RuntimeError, TypeError):
            return False

    def _plane_ok(self, t, dtype=torch.uint8, max_rows=65535) -> bool:
        return (t is None or (isinstance(t, torch.Tensor) and t.is_cuda is self._cuda and not t.is_meta
                              and t.dtype is dtype and t.layout is _STRIDED and t.is_contiguous()
                              and (t.dim() < 2 or t.shape[0] <= max_rows)))

    @staticmethod
    def _bucket(lay, name, ts, validate):
        """``ts`` (a stable list: momenta, parameters) checked against ``lay``: by identity after the
        first time. ``validate()`` runs the full checks (raising) and returns whether the kernels take
        them; a True result is remembered for these tensor objects."""
        if _same(ts, lay.seen.get(name)):
            return True
        if not validate():
            return False
        lay.seen[name] = _refs(ts)
        return True

    # -- (a) local step
    def local_step(self, grads, momenta, offsets, total, beta1, beta2, update_momentum=False, device_counts=False,
                   momenta_out=None):
        lay = self._eager(offsets)
        if lay is not None and grads and lay.limit == total and _outs_ok(momenta_out, momenta):
            args = (grads, momenta, _EMPTY if momenta_out is None else momenta_out, lay.table, lay.limit, beta1,
                    beta2, bool(update_momentum))
            r = self._local_gated("local_step", lay, args, _local_ws, device_counts)
            if r is not None:
                return r
        lay = None if _compiling() else layout_for(offsets, check_total(total))
        fast = lay is not None and self._local_ok(lay, grads, momenta, momenta_out)
        if not fast:
            total, offs = validate_local(grads, momenta, offsets, total, momenta_out)
            plain = (all_plain(grads, GRAD_DTYPES, self.device_type)
                     and all_plain(momenta, STATE_DTYPES, self.device_type)
                     and (momenta_out is None or all_plain(momenta_out, STATE_DTYPES, self.device_type)))
            if not plain:
                return ref.local_step(grads, momenta, offs, total, beta1, beta2, update_momentum, device_counts,
                                      momenta_out)
            if not grads:
                return self._empty_local(total, device_counts)
            if lay is not None:
                self._remember_local(lay, grads, momenta, momenta_out)
            table = lay.table if lay is not None else torch.tensor(offs, dtype=torch.int64)
        else:
            if not grads:
                return self._empty_local(lay.limit, device_counts)
            table, total = lay.table, lay.limit
        sign, nz, counts = self._run("local_step", grads, momenta, _EMPTY if momenta_out is None else momenta_out,
                                     table, total, beta1, beta2, bool(update_momentum))
        if device_counts:  # no host read: the caller folds them into its flags
            return (sign, nz, *counts.unbind())
        n_bad, n_zero = counts.tolist()
        return sign, nz, n_bad, n_zero

    def _local_gated(self, name, lay, args, make_ws, device_counts, planes=None):
        """A gated local step (None: an argument does not fit): into the layout's workspace
        (``make_ws(total, planes)`` the first time) when the layout is owned, else into fresh outputs."""
        if lay.owned:
            w = lay.ws.get(name)
            if w is None:  # (outputs, the result over them, the op's gated entry into them)
                w = lay.ws[name] = (*make_ws(lay.limit, planes), self._tries[name + "_into"])
            bufs, res, into = w
            try:
                if into(*args, *bufs) is None:
                    return None
            except TypeError:  # as _gated: an argument pybind cannot convert
                return None
        else:
            bufs = self._gated(name, *args)
            if bufs is None:
                return None
            res = (*bufs[:-1], *bufs[-1].unbind())  # the counts (int8: its one) as 0-dim tensors
        if device_counts:
            return res
        return (*bufs[:-1], *bufs[-1].tolist())

    def _local_ok(self, lay, grads, momenta, momenta_out) -> bool:
        numels = lay.seen.get("numels")
        if numels is None or not self._fits(grads, numels, GRAD_DTYPES):
            return False
        if not _same(momenta, lay.seen.get("momenta")):
            return False
        return momenta_out is None or _same(momenta_out, lay.seen.get("momenta_out"))

    def _remember_local(self, lay, grads, momenta, momenta_out):
        lay.seen["numels"] = tuple(g.numel() for g in grads)
        lay.seen["momenta"] = _refs(momenta)
        if momenta_out is not None:
            lay.seen["momenta_out"] = _refs(momenta_out)

    def _empty_local(self, total, device_counts, planes=None):
        dev = self.device_type if self.device_type == "cpu" or torch.cuda.is_available() else "cpu"
        first = torch.zeros(total // 8, dtype=torch.uint8, device=dev) if planes is None else \
            torch.zeros(planes, total // 8, dtype=torch.uint8, device=dev)
        nz = torch.zeros(total // 8, dtype=torch.uint8, device=dev)
        return (first, nz, *ref.as_device_counts(dev, 0, 0)) if device_counts else (first, nz, 0, 0)

    def abstain_list(self, nonzero, mask, capacity):
        if self._try is not None and capacity.__class__ is int and not _compiling():
            r = self._gated("abstain_list", nonzero, mask, capacity)
            if r is not None:
                return r
        capacity = validate_abstain_list(nonzero, mask, capacity)
        if self._cuda or not (is_plain(nonzero, (torch.uint8,)) and is_plain(mask, (torch.uint8,))):
            # CUDA: the reference's torch ops (asynchronous, fixed-size outputs) are its implementation
            return ref.abstain_list(nonzero, mask, capacity)
        return self._run("abstain_list", nonzero, mask, capacity)

    # -- (b) momentum
    def momentum_update_list(self, momenta, grads, beta2):
        if self._try is not None and not _compiling() and self._gated("momentum_update", momenta, grads, beta2):
            return
        seen = self._momentum_seen  # the momenta checked last time (by identity) and their sizes
        if grads and _same(momenta, seen[0]) and self._fits(grads, seen[1], GRAD_DTYPES):
            self._run("momentum_update", momenta, grads, beta2)
            return
        validate_momentum(momenta, grads)
        if not grads:
            return
        if all_plain(grads, GRAD_DTYPES, self.device_type) and all_plain(momenta, STATE_DTYPES, self.device_type):
            if not torch.compiler.is_compiling():
                self._momentum_seen = (_refs(momenta), tuple(m.numel() for m in momenta))
            self._run("momentum_update", momenta, grads, beta2)
            return
        for m, g in zip(momenta, grads):
            ref.momentum_update(m, g, beta2)

    # -- (c) vote + apply
    def _apply_params(self, lay, params, offsets, limit, planes_named):
        """An apply's parameters against the bucket's layout (identity after the first time)."""
        def validate():
            validate_params(params, limit, offsets, planes_named)
            return all_plain(params, self.param_dtypes, self.device_type)
        return self._bucket(lay, "params", params, validate)

    def vote_apply(self, sign, nonzero, params, offsets, lr, weight_decay, step, tie_break, vote, world_size,
                   segments=None, return_delta=True):
        v, t, world = _memo(_APPLY_CODES, (tie_break, vote, world_size),
                            lambda: vote_codes(tie_break, vote, world_size))
        gate = self._gate_tables(offsets, segments)
        if gate is not None:
            delta = self._gated("vote_apply", sign, nonzero, params, gate[0].table, lr, weight_decay, step, t, v,
                                world, gate[1], bool(return_delta))
            if delta is not None:
                return delta if return_delta else None
        check_planes(sign, nonzero, False)
        sign, nonzero = _packed(sign), _packed(nonzero)
        limit = sign.shape[-1] * 8
        lay = layout_for(offsets, limit)
        ok = (self._plane_ok(sign) and self._plane_ok(nonzero)
              and self._apply_params(lay, params, offsets, limit, [("sign", sign)]))
        if not ok:
            validate_params(params, limit, offsets, [("sign", sign)])
            return ref.vote_apply(sign, nonzero, params, lay.offsets, lr, weight_decay, step, tie_break, vote,
                                  world_size, _checked_segments(segments), return_delta)
        delta = self._run("vote_apply", sign, nonzero, params, lay.table, lr, weight_decay, step, t, v, world,
                          tie_table(segments, sign.device, lay), bool(return_delta))
        return delta if return_delta else None

    # -- (d) two-phase vote, phase 1
    def shard_vote(self, sign, nonzero, step, tie_break, segments):
        t = _memo(_APPLY_CODES, ("tie", tie_break), lambda: ref.enum_code("tie_break", tie_break))
        table = self._segments_table(segments)
        r = None if table is None else self._gated("shard_vote", sign, nonzero, step, t, table)
        if r is not None:
            return r
        check_planes(sign, nonzero, True)
        sign, nonzero = _packed(sign), _packed(nonzero)
        if not (self._plane_ok(sign) and self._plane_ok(nonzero)):
            return ref.shard_vote(sign, nonzero, step, tie_break, ref.as_segments(segments))
        return self._run("shard_vote", sign, nonzero, step, t, tie_table(segments, sign.device))

    # -- (e) p-bit count lanes
    def count_lanes(self, sign, nonzero, p):
        p = check_lane_width(p)
        # gated unless a count could overflow a lane without nonzero planes (an error, raised below)
        r = self._gated("count_lanes", sign, nonzero, p) if (
            self._try is not None and not _compiling()
            and (nonzero is not None or _rows(sign) <= (1 << p) - 1)) else None
        if r is None:
            check_planes(sign, nonzero, True)
            if nonzero is None and sign.shape[1] > 0 and sign.shape[0] > (1 << p) - 1:
                raise ValueError(f"count {sign.shape[0]} does not fit a {p}-bit lane")
            sign, nonzero = _packed(sign), _packed(nonzero)
            if not (self._plane_ok(sign, max_rows=255 if self._cuda else 65535) and self._plane_ok(nonzero)):
                return ref.count_lanes(sign, nonzero, p)
            r = self._run("count_lanes", sign, nonzero, p)
        plus, cnt, overflow = r
        if overflow.numel() and int(overflow.item()) != 0:  # a host read only when a count could overflow
            ref.count_lanes(sign, nonzero, p)  # the error path: raises the reference's message (the count)
            raise ValueError(f"a count does not fit a {p}-bit lane")
        return plus, (cnt if nonzero is not None else None)

    # -- (f) summed lanes + apply
    def lanes_apply(self, plus_lanes, cnt_lanes, world_size, p, params, offsets, lr, weight_decay, step, tie_break,
                    vote, segments=None, return_delta=True):
        p = check_lane_width(p)
        v, t, world = _memo(_APPLY_CODES, (tie_break, vote, world_size),
                            lambda: vote_codes(tie_break, vote, world_size))
        gate = self._gate_tables(offsets, segments)
        if gate is not None:
            delta = self._gated("lanes_apply", plus_lanes, cnt_lanes, world, p, params, gate[0].table, lr,
                                weight_decay, step, t, v, gate[1], bool(return_delta))
            if delta is not None:
                return delta if return_delta else None
        check_tensors([("plus_lanes", plus_lanes), ("cnt_lanes", cnt_lanes)])
        if cnt_lanes is not None and cnt_lanes.numel() != plus_lanes.numel():
            raise ValueError(f"lioncub kernels: cnt_lanes has {cnt_lanes.numel()} bytes but plus_lanes has "
                             f"{plus_lanes.numel()}")
        plus_lanes, cnt_lanes = _packed(plus_lanes), _packed(cnt_lanes)
        limit = plus_lanes.numel() * 8 // p
        lay = layout_for(offsets, limit)
        ok = (self._plane_ok(plus_lanes) and self._plane_ok(cnt_lanes)
              and self._apply_params(lay, params, offsets, limit, [("plus_lanes", plus_lanes)]))
        if not ok:
            validate_params(params, limit, offsets, [("plus_lanes", plus_lanes)])
            return ref.lanes_apply(plus_lanes, cnt_lanes, world_size, p, params, lay.offsets, lr, weight_decay, step,
                                   tie_break, vote, _checked_segments(segments), return_delta)
        delta = self._run("lanes_apply", plus_lanes.reshape(-1), None if cnt_lanes is None else cnt_lanes.reshape(-1),
                          world, p, params, lay.table, lr, weight_decay, step, t, v,
                          tie_table(segments, plus_lanes.device, lay), bool(return_delta))
        return delta if return_delta else None

    # -- (g) int8 codes
    def int8_local_step(self, grads, momenta, offsets, total, beta1, kind, levels, device_counts=False):
        if not (levels.__class__ is int or isinstance(levels, numbers.Integral) and not isinstance(levels, bool)) \
                or not 1 <= levels <= 127:
            raise ValueError(f"lioncub kernels: int8 levels must be an integer in 1..127 (int8_levels(N)), "
                             f"got {levels!r}")
        code = _memo(_QUANT_CODES, kind, lambda: ref.enum_code("quant scale", kind))
        lay = self._eager(offsets)
        if lay is not None and grads and lay.limit == total and levels.__class__ is int:
            r = self._local_gated("int8_local_step", lay, (grads, momenta, lay.table, lay.limit, beta1, code, levels),
                                  _int8_ws, device_counts)
            if r is not None:
                return r
        lay = None if _compiling() else layout_for(offsets, check_total(total))
        if lay is not None and 1 <= levels <= 127 and self._local_ok(lay, grads, momenta, None):
            table, total = lay.table, lay.limit
        else:
            total, offs = validate_local(grads, momenta, offsets, total)
            if not (all_plain(grads, GRAD_DTYPES, self.device_type)
                    and all_plain(momenta, STATE_DTYPES, self.device_type) and 1 <= levels <= 127):
                return ref.int8_local_step(grads, momenta, offs, total, beta1, kind, levels, device_counts)
            if lay is not None:
                self._remember_local(lay, grads, momenta, None)
            table = lay.table if lay is not None else torch.tensor(offs, dtype=torch.int64)
        if not grads:
            dev = self.device_type if self.device_type == "cpu" or torch.cuda.is_available() else "cpu"
            q = torch.zeros(total, dtype=torch.int8, device=dev)
            return (q, *ref.as_device_counts(dev, 0)) if device_counts else (q, 0)
        q, n_bad = self._run("int8_local_step", grads, momenta, table, total, beta1, code, int(levels))
        if device_counts:
            return q, n_bad.reshape(())
        return q, int(n_bad.item())

    # -- (h) int8 apply
    def int8_apply(self, qsum, params, offsets, lr, weight_decay, return_delta=True):
        lay = self._eager(offsets)
        if lay is not None:
            delta = self._gated("int8_apply", qsum, params, lay.table, lr, weight_decay, bool(return_delta))
            if delta is not None:
                return delta if return_delta else None
        check_tensors([("qsum", qsum)])
        if qsum.dtype != torch.int8:
            raise ValueError(f"lioncub kernels: qsum must be the int8 sum of the codes, got {qsum.dtype}")
        qsum = _packed(qsum)
        limit = qsum.numel()
        lay = layout_for(offsets, limit)
        ok = self._plane_ok(qsum, torch.int8) and self._apply_params(lay, params, offsets, limit, [("qsum", qsum)])
        if not ok:
            validate_params(params, limit, offsets, [("qsum", qsum)])
            return ref.int8_apply(qsum, params, lay.offsets, lr, weight_decay, return_delta)
        delta = self._run("int8_apply", qsum.reshape(-1), params, lay.table, lr, weight_decay, bool(return_delta))
        return delta if return_delta else None

    # -- (i) single-process Lion step
    def lion_step(self, params, grads, momenta, lr, weight_decay, beta1, beta2):
        """One pass per tensor; tensors the kernel does not take (non-contiguous, float64, fp16
        parameters) take the reference path in the same call."""
        if self._try is not None and params and not _compiling() and self._gated(
                "lion_step", params, grads, momenta, lr, weight_decay, beta1, beta2):
            return
        if not torch.compiler.is_compiling() and len(params) == len(grads) == len(momenta) and params \
                and _same(params, self._lion_seen[0]) and _same(momenta, self._lion_seen[1]) \
                and self._fits(grads, self._lion_seen[2], GRAD_DTYPES):
            self._run("lion_step", params, grads, momenta, float(lr), float(weight_decay), float(beta1), float(beta2))
            return
        validate_lion_step(params, grads, momenta)
        dev = self.device_type

        def qualifies(p, g, m):
            return (is_plain(p, self.param_dtypes, dev) and is_plain(g, GRAD_DTYPES, dev)
                    and is_plain(m, STATE_DTYPES, dev))

        if params and all(qualifies(*t) for t in zip(params, grads, momenta)):
            if not torch.compiler.is_compiling():  # the same tensor objects skip these checks next time
                self._lion_seen = (_refs(params), _refs(momenta), tuple(g.numel() for g in grads))
            self._run("lion_step", params, grads, momenta, float(lr), float(weight_decay), float(beta1), float(beta2))
            return
        ref.lion_step_split(
            lambda ps, gs, ms: self._run("lion_step", ps, gs, ms, float(lr), float(weight_decay), float(beta1),
                                         float(beta2)),
            qualifies, params, grads, momenta, lr, weight_decay, beta1, beta2)

    _lion_seen = (None, None, ())
    _bbit_last = (None, None, None, None, None)  # bbit_local_step: (kind, bits, rounding, segments, resolved)
    _momentum_seen = (None, ())
    _zero_seen = None

    # -- (k) comm="bbit": the local step and the shard owner's vote
    def bbit_local_step(self, grads, momenta, offsets, total, beta1, beta2, kind, bits, rounding, seed, segments,
                        update_momentum=False, device_counts=False, momenta_out=None):
        lay = self._eager(offsets)
        if lay is not None and grads and lay.limit == total and seed.__class__ is int and (
                momenta_out is None or _outs_ok(momenta_out, momenta)):
            # the codes and the tie table of the last call's settings, recognised by identity (a step
            # passes the same objects each time): one look instead of a memo key and a table lookup
            last = self._bbit_last
            if last[0] is kind and last[1] is bits and last[2] is rounding and last[3] is segments:
                code, b, rcode, table = last[4]
            else:
                code, b, rcode = _memo(_BBIT_CODES, (kind, bits.__class__, bits, rounding),
                                       lambda: validate_bbit_codes(kind, bits, rounding, 0)[:3])
                table = self._tie_cpu(segments)
                if table is not None and segments is not None:
                    self._bbit_last = (kind, bits, rounding, segments, (code, b, rcode, table))
            if table is not None:
                args = (grads, momenta, _EMPTY if momenta_out is None else momenta_out, lay.table, lay.limit, beta1,
                        beta2, bool(update_momentum), code, b, rcode, seed, table)
                r = self._local_gated("bbit_local_step", lay, args, _local_ws, device_counts, b)
                if r is not None:
                    return r
        code, bits, rcode, seed = validate_bbit_codes(kind, bits, rounding, seed)
        lay = None if _compiling() else layout_for(offsets, check_total(total))
        if lay is not None and self._local_ok(lay, grads, momenta, momenta_out):
            table, total = lay.table, lay.limit
        else:
            total, offs = validate_local(grads, momenta, offsets, total, momenta_out)
            plain = (all_plain(grads, GRAD_DTYPES, self.device_type)
                     and all_plain(momenta, STATE_DTYPES, self.device_type)
                     and (momenta_out is None or all_plain(momenta_out, STATE_DTYPES, self.device_type)))
            if not plain:
                return ref.bbit_local_step(grads, momenta, offs, total, beta1, beta2, kind, bits, rounding, seed,
                                           ref.as_segments(segments), update_momentum, device_counts, momenta_out)
            if lay is not None:
                self._remember_local(lay, grads, momenta, momenta_out)
            table = lay.table if lay is not None else torch.tensor(offs, dtype=torch.int64)
        if not grads:
            return self._empty_local(total, device_counts, planes=bits)
        dev = grads[0].device
        planes, nz, counts = self._run("bbit_local_step", grads, momenta,
                                       _EMPTY if momenta_out is None else momenta_out, table, total, beta1, beta2,
                                       bool(update_momentum), code, bits, rcode, seed, tie_table(segments, dev))
        if device_counts:
            return (planes, nz, *counts.unbind())
        n_bad, n_zero = counts.tolist()
        return planes, nz, n_bad, n_zero

    def bbit_shard_vote(self, planes, nonzero, bits, step, tie_break, segments):
        t = _memo(_APPLY_CODES, ("tie", tie_break), lambda: ref.enum_code("tie_break", tie_break))
        table = self._segments_table(segments) if bits.__class__ is int else None
        r = None if table is None else self._gated("bbit_shard_vote", planes, nonzero, bits, step, t, table)
        if r is not None:
            return r
        bits = check_bits(bits)
        validate_code_planes(planes, nonzero, bits)
        planes, nonzero = _packed(planes), _packed(nonzero)
        if not (self._plane_ok(planes) and self._plane_ok(nonzero)):
            return ref.bbit_shard_vote(planes, nonzero, bits, step, tie_break, ref.as_segments(segments))
        return self._run("bbit_shard_vote", planes, nonzero, bits, step, t, tie_table(segments, planes.device))

    # -- (j) ZeRO sign all-gather apply
    def zero_sign_apply(self, sign, nonzero, targets, casts, layout, lrs, weight_decays):
        # the layout, targets and casts of the last call (identity) and the plane shapes: checked then
        seen, key = self._zero_seen, (tuple(sign.shape) if isinstance(sign, torch.Tensor) else None,
                                      None if not isinstance(nonzero, torch.Tensor) else tuple(nonzero.shape))
        known = (seen is not None and seen[0] is layout and seen[1] == key and _same(targets, seen[2])
                 and (casts is None) == (seen[3] is None) and (casts is None or _same(casts, seen[3]))
                 and len(lrs) == len(weight_decays) == len(targets))
        if known and self._try is not None and not _compiling() and self._gated(
                "zero_sign_apply", sign, nonzero, targets,
                seen[6] if casts is None else [seen[4] if c is None else c for c in casts], seen[5], lrs,
                weight_decays):
            return  # the planes' dtype, dims and rows checked by the gate; the rest by identity above
        if known and self._plane_ok(sign) and self._plane_ok(nonzero):
            none = seen[4]
            self._run("zero_sign_apply", sign, nonzero, targets,
                      [none] * len(targets) if casts is None else [none if c is None else c for c in casts], seen[5],
                      [float(v) for v in lrs], [float(v) for v in weight_decays])
            return
        validate_zero_apply(sign, nonzero, targets, casts, layout, lrs, weight_decays)
        cast_list = [None] * len(targets) if casts is None else list(casts)
        sign, nonzero = _packed(sign), _packed(nonzero)
        dev = self.device_type
        ok = (self._plane_ok(sign) and self._plane_ok(nonzero) and all_plain(targets, (torch.float32,), dev)
              and all(c is None or is_plain(c, GRAD_DTYPES, dev) for c in cast_list))
        if not ok:
            return ref.zero_sign_apply(sign, nonzero, targets, cast_list, layout, lrs, weight_decays)
        none = targets[0].new_empty(0) if targets else torch.empty(0)
        cast_args, pieces = [none if c is None else c for c in cast_list], layout.pieces
        if not torch.compiler.is_compiling():  # (a ZeroLayout is small and takes no weak reference)
            self._zero_seen = (layout, key, _refs(targets), None if casts is None else _refs(casts), none, pieces,
                               [none] * len(targets))
        self._run("zero_sign_apply", sign, nonzero, targets, cast_args, pieces, [float(v) for v in lrs],
                  [float(v) for v in weight_decays])
