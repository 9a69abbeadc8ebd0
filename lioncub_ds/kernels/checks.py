"""Argument checks shared by the native backends (cpp, cuda), run in Python before any extension call.

On some platforms a C++ exception thrown through a JIT-built extension crashes the process
(docs/kernels.md), so bad input must never reach a TORCH_CHECK. Structural errors raise a
ValueError (TypeError for a non-tensor) that names the argument and what is allowed. Tensors the
kernels do not handle (non-contiguous, float64, another device type) are not errors: the backend
sends them to the reference path, whose results are the contract.

The ``validate_*`` functions hold everything both backends check for one entry point, so the
two backends cannot drift apart in what they accept.
"""
from __future__ import annotations

import torch

from . import reference as ref

def is_plain(t, dtypes, device_type="cpu") -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == device_type and t.layout == torch.strided
            and t.is_contiguous() and t.dtype in dtypes)


def all_plain(ts, dtypes, device_type="cpu") -> bool:
    return all(is_plain(t, dtypes, device_type) for t in ts)


def _offsets(offsets) -> list:
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


def check_bucket(tensors, offsets, limit, name, others=None, others_name=None) -> list:
    """Offsets are non-negative multiples of 8, every tensor fits [0, limit) and none overlap;
    ``others`` (momenta of grads...) pair one to one with ``tensors``. Returns the int offsets."""
    offs = _offsets(offsets)
    if len(offs) != len(tensors):
        raise ValueError(f"lioncub kernels: {name} has {len(tensors)} tensors but offsets has {len(offs)} entries")
    if others is not None:
        if len(others) != len(tensors):
            raise ValueError(f"lioncub kernels: {name} has {len(tensors)} tensors but {others_name} has {len(others)}")
        for i, (a, b) in enumerate(zip(tensors, others)):
            if a.numel() != b.numel():
                raise ValueError(f"lioncub kernels: {name}[{i}] has {a.numel()} elements but {others_name}[{i}] has "
                                 f"{b.numel()}")
    spans = []
    ordered = True
    for i, (t, o) in enumerate(zip(tensors, offs)):
        n = t.numel()
        if o < 0 or o % 8:
            raise ValueError(f"lioncub kernels: offsets[{i}]={o} must be a non-negative multiple of 8")
        if limit is not None and o + n > limit:
            raise ValueError(f"lioncub kernels: {name}[{i}] ({n} elements at offset {o}) does not fit the "
                             f"bucket of {limit} elements")
        if n:
            ordered = ordered and (not spans or o >= spans[-1][0])
            spans.append((o, o + n, i))
    if not ordered:
        spans.sort()
    for (a0, a1, i), (b0, _, j) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ValueError(f"lioncub kernels: {name}[{i}] and {name}[{j}] overlap in the bucket "
                             f"(offsets {a0} and {b0})")
    return offs


def check_planes(sign, nonzero, two_d: bool, max_rows=None) -> None:
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


def planes_ok(sign, nonzero, device_type="cpu", max_rows=65535) -> bool:
    rows = sign.shape[0] if sign.dim() == 2 else 1
    return (is_plain(sign, (torch.uint8,), device_type) and 1 <= rows <= max_rows
            and (nonzero is None or is_plain(nonzero, (torch.uint8,), device_type)))




# ----------------------------------------------------------------------------- per entry point
def _grads_momenta(grads, momenta):
    check_tensors([(f"grads[{i}]", g) for i, g in enumerate(grads)]
                  + [(f"momenta[{i}]", m) for i, m in enumerate(momenta)])


def validate_local(grads, momenta, offsets, total, momenta_out=None):
    """local_step / int8_local_step: returns (total, int offsets). ``momenta_out`` (local_step):
    one tensor per momentum, same dtype, size and device, sharing no memory with the inputs."""
    total = check_total(total)
    _grads_momenta(grads, momenta)
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
        _no_shared_memory(momenta_out, "momenta_out", list(momenta) + list(grads), "the momenta or gradients")
    return total, offs


def _span(t):
    start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    return start, start + t.numel() * t.element_size()


def _no_shared_memory(outs, name, inputs, inputs_name) -> None:
    """No output tensor's memory overlaps another output's or an input's (same-device spans)."""
    spans = sorted([(*_span(t), i, True) for i, t in enumerate(outs) if t.numel()]
                   + [(*_span(t), -1, False) for t in inputs if t.numel()])
    for (a0, a1, i, a_out), (b0, _, j, b_out) in zip(spans, spans[1:]):
        if b0 < a1 and (a_out or b_out):
            k = i if a_out else j
            raise ValueError(f"lioncub kernels: {name}[{k}] shares memory with "
                             f"{'another output' if a_out and b_out else inputs_name}; allowed: separate buffers")


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
    _grads_momenta(grads, momenta)
    if len(momenta) != len(grads):
        raise ValueError(f"lioncub kernels: momenta has {len(momenta)} tensors but grads has {len(grads)}")
    for i, (m, g) in enumerate(zip(momenta, grads)):
        if m.numel() != g.numel():
            raise ValueError(f"lioncub kernels: momenta[{i}] has {m.numel()} elements but grads[{i}] has "
                             f"{g.numel()}")


def _vote_codes(tie_break, vote, world_size):
    v = ref.enum_code("vote", vote)
    t = ref.enum_code("tie_break", tie_break) if v == 0 else 0
    return v, t, check_world(world_size)


def _segments(offs, segments):
    return ref.tie_segments(offs) if segments is None else ref.as_segments(segments)


def validate_vote_apply(sign, nonzero, params, offsets, tie_break, vote, world_size, segments):
    """vote_apply: returns (vote code, tie code, world size, int offsets, tie-index table)."""
    v, t, world = _vote_codes(tie_break, vote, world_size)
    check_planes(sign, nonzero, False)
    check_tensors([("sign", sign)] + [(f"params[{i}]", p) for i, p in enumerate(params)])
    offs = check_bucket(params, offsets, sign.shape[-1] * 8, "params")
    return v, t, world, offs, _segments(offs, segments)


def validate_shard_vote(sign, nonzero, tie_break, segments):
    """shard_vote: returns (tie code, tie-index table)."""
    t = ref.enum_code("tie_break", tie_break)
    check_planes(sign, nonzero, True)
    return t, ref.as_segments(segments)


def validate_count_lanes(sign, nonzero, p) -> int:
    """count_lanes: returns the lane width. Without abstentions every rank's vote counts, so N
    ranks must fit a p-bit lane (a count is at most N)."""
    p = check_lane_width(p)
    check_planes(sign, nonzero, True)
    if nonzero is None and sign.shape[1] > 0 and sign.shape[0] > (1 << p) - 1:
        raise ValueError(f"count {sign.shape[0]} does not fit a {p}-bit lane")
    return p


def validate_lanes_apply(plus_lanes, cnt_lanes, world_size, p, params, offsets, tie_break, vote, segments):
    """lanes_apply: returns (lane width, vote code, tie code, world size, int offsets, tie-index table)."""
    p = check_lane_width(p)
    v, t, world = _vote_codes(tie_break, vote, world_size)
    check_tensors([("plus_lanes", plus_lanes), ("cnt_lanes", cnt_lanes)]
                  + [(f"params[{i}]", q) for i, q in enumerate(params)])
    if cnt_lanes is not None and cnt_lanes.numel() != plus_lanes.numel():
        raise ValueError(f"lioncub kernels: cnt_lanes has {cnt_lanes.numel()} bytes but plus_lanes has "
                         f"{plus_lanes.numel()}")
    offs = check_bucket(params, offsets, plus_lanes.numel() * 8 // p, "params")
    return p, v, t, world, offs, _segments(offs, segments)


def validate_int8_apply(qsum, params, offsets) -> list:
    """int8_apply: returns the int offsets."""
    check_tensors([("qsum", qsum)] + [(f"params[{i}]", p) for i, p in enumerate(params)])
    return check_bucket(params, offsets, qsum.numel(), "params")


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


def validate_bbit_local(grads, momenta, offsets, total, kind, bits, rounding, seed, segments, momenta_out=None):
    """bbit_local_step: returns (total, int offsets, scale code, bits, rounding code, seed, tie-index table)."""
    code = ref.enum_code("quant scale", kind)
    rcode = ref.enum_code("rounding", rounding)
    if isinstance(bits, bool) or bits not in ref.VOTE_BITS:
        raise ValueError(f"vote_bits must be one of {ref.VOTE_BITS}, got {bits!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"lioncub kernels: the dither seed must be an int in 0..2**32-1 (reference.dither_seed), "
                         f"got {seed!r}")
    total, offs = validate_local(grads, momenta, offsets, total, momenta_out)
    return total, offs, code, int(bits), rcode, int(seed), ref.as_segments(segments)


def validate_bbit_shard_vote(planes, nonzero, bits, tie_break, segments):
    """bbit_shard_vote: planes uint8 [N, bits, bytes], nonzero None or [N, bytes]; returns (tie code, bits,
    tie-index table)."""
    t = ref.enum_code("tie_break", tie_break)
    if isinstance(bits, bool) or bits not in ref.VOTE_BITS:
        raise ValueError(f"vote_bits must be one of {ref.VOTE_BITS}, got {bits!r}")
    check_tensors([("planes", planes), ("nonzero", nonzero)])
    if planes.dim() != 3 or planes.shape[1] != bits or planes.shape[0] < 1 or planes.dtype != torch.uint8:
        raise ValueError(f"lioncub kernels: planes must be a uint8 [N, bits={bits}, bytes] tensor with N >= 1, got "
                         f"{planes.dtype} {tuple(planes.shape)}")
    if nonzero is not None and (nonzero.dtype != torch.uint8
                                or tuple(nonzero.shape) != (planes.shape[0], planes.shape[2])):
        raise ValueError(f"lioncub kernels: nonzero planes must be uint8 [N, bytes] = {(planes.shape[0], planes.shape[2])}"
                         f", got {nonzero.dtype} {tuple(nonzero.shape)}")
    return t, int(bits), ref.as_segments(segments)
