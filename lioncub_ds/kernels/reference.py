"""Pure-torch reference codecs: the contract every fast path (C++, CUDA) must match.

Conventions (docs/conventions.md), identical in torch, C++ and CUDA:

* **Bit order**: LSB first. Element ``i`` lives in byte ``i >> 3`` at bit ``i & 7``.
  p-bit lanes likewise: element ``i`` occupies bits ``[(i*p) & 7, +p)`` of byte
  ``(i*p) >> 3``, lowest lane first.
* **Vote planes**: a rank's vote at a coordinate is the pair (sign bit, nonzero bit):
  sign bit = 1 iff c > 0; nonzero bit = 1 iff c != 0 and c is finite. A coordinate
  whose c is exactly 0 (or non-finite) *abstains*. The nonzero plane is only sent
  when some rank has an abstention in the bucket; otherwise every vote counts.
* **Counting**: plus = #(sign & nonzero), cnt = #nonzero, diff = 2*plus - cnt.
  majority: sign(diff); diff == 0 -> 0 if cnt == 0 (nobody voted: no move),
  otherwise the tie rule. average: diff / N (fp32).
* **Tie rules** (``tie_break``): ``"zero"`` no move; ``"alternate"`` +1 on odd steps,
  -1 on even steps; ``"hash"`` +1 or -1 from a 32-bit integer hash of (step, the
  element's index INSIDE ITS PARAMETER) -- see :func:`tie_hash_sign`. The index never
  depends on the bucket layout: a *tie-index table* (:func:`tie_segments`) maps each
  position of a bucket (or of a 1bit shard) to its parameter-local index, so bucket
  size, parameter order, rank layout and pipeline stage do not change which way a tie
  breaks. Padding and the gaps between parameters continue the numbering of the
  parameter before them (they never tie in a real step: they abstain or vote -1 on
  every rank).
* **Apply**: theta <- fl(theta * decay) with decay = fl32(1 - lr*wd), then
  theta <- fl(theta + fl32(-lr * delta)); every op is rounded to the parameter
  dtype (fp32 math, no fused multiply-add), exactly like ``p.mul_(); p.add_()``.
* **Momentum**: m <- fl(fl(beta2*m) + fl((1-beta2)*g)) in fp32, then rounded to
  the momentum dtype once. c = fl(fl(beta1*m) + fl((1-beta1)*g)) in fp32.

* **int8 scales** (docs/conventions.md): L1 = fp32(S / n) with S the fp64 sum of |c| in the order
  of :func:`ordered_sum`; L0 = fp32(exp(mean log|c|)) over the nonzero |c|, with the log
  and exp written out in IEEE fp64 operations (:func:`log_parts`, :func:`det_exp`) so
  that torch, C++ and CUDA give the same bits; Linf = max|c| (order-free).

All functions work on flat contiguous tensors; padding elements carry zeros.
"""
from __future__ import annotations

import math

import torch

# The project's fixed conventions (rule / mode / kind names and their kernel codes, padding, lane
# widths, int8 levels, the tie-index table) live in lioncub_ds/conventions.py, below both the kernels
# and comm/; they are re-exported here as part of the executable contract.
from ..conventions import (LANE_WIDTHS, ROUNDING_CODES, ROUNDINGS, SCALE_CODES, SCALE_KINDS,  # noqa: F401
                           TIE_CODES, TIE_RULES, VOTE_BITS, VOTE_CODES, VOTE_MODES, enum_code, int8_levels,
                           lane_bits_for, padded_numel, tie_segments)

_M32 = 0xFFFFFFFF


# ----------------------------------------------------------------------------- bits
def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a flat 0/1 tensor (any int/bool dtype) to uint8, LSB first. numel % 8 == 0."""
    n = bits.numel()
    if n % 8:
        raise ValueError(f"pack_bits needs a multiple of 8 elements, got {n}")
    b = bits.reshape(-1, 8).to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=bits.device)
    return (b * weights).sum(dim=1, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8, device=bits.device)


def unpack_bits(packed: torch.Tensor, numel: int | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 -> flat uint8 0/1 of length 8*len (or ``numel``)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    out = (packed.reshape(-1, 1) >> shifts) & 1
    out = out.reshape(-1)
    return out if numel is None else out[:numel]


# ----------------------------------------------------------------------------- lanes
def pack_lanes(values: torch.Tensor, p: int) -> torch.Tensor:
    """Pack non-negative ints < 2**p into p-bit lanes (LSB first). numel*p % 8 == 0."""
    if p not in LANE_WIDTHS:
        raise ValueError(f"lane width p must be one of {LANE_WIDTHS}, got {p}")
    per = 8 // p
    n = values.numel()
    if n % per:
        raise ValueError(f"pack_lanes(p={p}) needs a multiple of {per} elements, got {n}")
    v = values.reshape(-1, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32, device=values.device) * p
    return (v << shifts).sum(dim=1).to(torch.uint8)


def unpack_lanes(packed: torch.Tensor, p: int, numel: int | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_lanes`: uint8 -> int32 values."""
    per = 8 // p
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * p
    out = ((packed.to(torch.int32).reshape(-1, 1) >> shifts) & ((1 << p) - 1)).reshape(-1)
    return out if numel is None else out[:numel]


# ----------------------------------------------------------------------------- local step
def lion_direction(m: torch.Tensor, g: torch.Tensor, beta1: float) -> torch.Tensor:
    """c = fl(fl(beta1*m) + fl((1-beta1)*g)) in fp32 (no FMA)."""
    return m.float().mul(beta1).add_(g.float().mul(1.0 - beta1))


def momentum_update(m: torch.Tensor, g: torch.Tensor, beta2: float) -> None:
    """In place: m <- fl(fl(beta2*m) + fl((1-beta2)*g)), fp32 math, one rounding to m's dtype."""
    new = m.float().mul_(beta2).add_(g.float().mul(1.0 - beta2))
    m.copy_(new)


def encode_votes(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Flat fp32 c (numel % 8 == 0) -> (sign bits, nonzero bits, #non-finite, #zero)."""
    finite = torch.isfinite(c)
    sign = (c > 0) & finite
    nonzero = (c != 0) & finite
    n_nonfinite = int((~finite).sum())
    n_zero = int((c == 0).sum())
    return pack_bits(sign), pack_bits(nonzero), n_nonfinite, n_zero


def local_step(grads, momenta, offsets, total, beta1, beta2, update_momentum=False, device_counts=False,
               momenta_out=None):
    """The local half of a Distributed Lion step over one bucket.

    ``grads``/``momenta``: lists of tensors; ``offsets``: element offset of each tensor in
    the bucket (multiples of 8); ``total``: padded bucket size (multiple of 8). Returns
    (sign bits, nonzero bits, #non-finite c, #zero c) over the real elements only
    (padding abstains and is not counted). With ``update_momentum`` the momenta are
    advanced in the same pass (otherwise call :func:`momentum_update` after the vote): in
    place, or, given ``momenta_out`` (one tensor per momentum, same dtype and size, sharing no
    memory with the inputs), written there with the momenta left unchanged.
    ``device_counts``: the two counts are 0-dim int64 tensors on the bucket's device instead
    of Python ints, so a caller can fold them into other device flags without a host read
    (the CUDA backend then never synchronizes).
    """
    c = bucket_direction(grads, momenta, offsets, total, beta1)
    if update_momentum:
        advance_momenta(grads, momenta, beta2, momenta_out)
    sign, nonzero, n_nonfinite, _ = encode_votes(c)
    n_zero = real_zero_count(c, grads, total)
    if device_counts:
        return sign, nonzero, *as_device_counts(c.device, n_nonfinite, n_zero)
    return sign, nonzero, n_nonfinite, n_zero


def bucket_direction(grads, momenta, offsets, total, beta1) -> torch.Tensor:
    """The bucket's flat fp32 c (padding and gaps 0)."""
    c = torch.zeros(total, dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for g, m, off in zip(grads, momenta, offsets):
        c[off:off + g.numel()] = lion_direction(m.reshape(-1), g.reshape(-1), beta1)
    return c


def real_zero_count(c: torch.Tensor, grads, total: int) -> int:
    """Zeros of a bucket's c among its real elements (the padding and gaps are zero too)."""
    return int((c == 0).sum()) - (total - sum(g.numel() for g in grads))


def advance_momenta(grads, momenta, beta2, momenta_out=None) -> None:
    """:func:`momentum_update` of each momentum: in place, or into ``momenta_out`` (m unchanged)."""
    for k, (g, m) in enumerate(zip(grads, momenta)):
        if momenta_out is not None:
            momenta_out[k].copy_(m)
            m = momenta_out[k]
        momentum_update(m, g, beta2)


def abstain_list(nonzero: torch.Tensor, mask: torch.Tensor, capacity: int) -> torch.Tensor:
    """A rank's abstention list (comm/abstain.py): int32 [1 + 2K], K = ``capacity``.

    Word 0 counts the bytes where the nonzero plane differs from the bucket's mask; then the
    first K such byte indices in order (-1 when fewer), then the plane's byte at each (0 when
    unused). Fixed size, no host read."""
    diff = nonzero != mask
    count = diff.sum(dtype=torch.int32).reshape(1)
    if capacity == 0:
        return count
    idx = torch.nonzero_static(diff, size=capacity, fill_value=-1).reshape(-1)
    vals = torch.where(idx >= 0, nonzero[idx.clamp(min=0)].to(torch.int32), torch.zeros_like(idx, dtype=torch.int32))
    return torch.cat([count, idx.to(torch.int32), vals])


def as_device_counts(device, *counts):
    """Host ints -> 0-dim int64 tensors on ``device`` (the ``device_counts=True`` form)."""
    return tuple(torch.tensor(int(v), dtype=torch.int64, device=device) for v in counts)


# ----------------------------------------------------------------------------- votes
def tie_hash(step: int, index: torch.Tensor) -> torch.Tensor:
    """The 32-bit tie hash (as int64 values in [0, 2**32)) of (step, index), index = the
    element's index inside its parameter (int64 >= 0). uint32 arithmetic mod 2**32 (docs/conventions.md):

    h = lo(i)*0x9E3779B1 + hi(i)*0xC2B2AE3D + lo(step)*0x85EBCA77 + 0x165667B1
    h ^= h >> 15; h *= 0x2C1B3C6D; h ^= h >> 12; h *= 0x297A2D39; h ^= h >> 15
    (lo/hi: the low/high 32 bits). :func:`tie_hash_sign`: +1 if h is odd, else -1.
    """
    i = index.to(torch.int64)
    lo, hi = i & _M32, (i >> 32) & _M32
    h = (lo * 0x9E3779B1 + hi * 0xC2B2AE3D + (step & _M32) * 0x85EBCA77 + 0x165667B1) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x2C1B3C6D) & _M32
    h = h ^ (h >> 12)
    h = (h * 0x297A2D39) & _M32
    return h ^ (h >> 15)


def tie_hash_sign(step: int, index: torch.Tensor) -> torch.Tensor:
    """+1/-1 (int32): the value a tie at (step, parameter-local index) takes under
    tie_break='hash': +1 where :func:`tie_hash` is odd, -1 where it is even."""
    return ((tie_hash(step, index) & 1) * 2 - 1).to(torch.int32)


def as_segments(segments) -> torch.Tensor:
    """A tie-index table from what the vote functions accept: a table (tensor or list of
    (pos, index) pairs), None (the table [[0, 0]]: index = position) or an int b (the single
    row [[0, b]]: one parameter whose element 0 has index b). Validated; int64 [K, 2] on CPU."""
    if segments is None:
        return torch.zeros(1, 2, dtype=torch.int64, device="cpu")
    if isinstance(segments, bool):
        raise TypeError(f"tie segments must be a table, an int or None, got {segments!r}")
    if isinstance(segments, int):
        if segments < 0:
            raise ValueError(f"a tie index must be >= 0, got {segments}")
        return torch.tensor([[0, segments]], dtype=torch.int64, device="cpu")
    where = segments.device if isinstance(segments, torch.Tensor) else "cpu"  # never the default device
    t = torch.as_tensor(segments, dtype=torch.int64, device=where).detach().cpu().reshape(-1, 2).contiguous()
    if t.shape[0] == 0 or int(t[0, 0]) != 0:
        raise ValueError("a tie-index table needs a first row at position 0 (tie_segments builds one)")
    if t.shape[0] > 1 and not bool((t[1:, 0] > t[:-1, 0]).all()):
        raise ValueError("tie-index table positions must increase strictly")
    if bool((t[:, 1] < 0).any()):
        raise ValueError("tie indices must be >= 0")
    return t


def tie_index(segments, numel: int, device) -> torch.Tensor:
    """The tie index (int64) of positions 0..numel-1 under a tie-index table."""
    t = as_segments(segments).to(device)
    pos = torch.arange(numel, dtype=torch.int64, device=device)
    k = torch.searchsorted(t[:, 0].contiguous(), pos, right=True) - 1
    return t[k, 1] + (pos - t[k, 0])


def tie_values(tie_break: str, step: int, segments, numel: int, device) -> torch.Tensor:
    """The value a tied coordinate takes: int32 tensor of -1/0/+1 for positions 0..numel-1
    (``segments``: a tie-index table, see :func:`as_segments`)."""
    if tie_break == "zero":
        return torch.zeros(numel, dtype=torch.int32, device=device)
    if tie_break == "alternate":
        return torch.full((numel,), 1 if step % 2 == 1 else -1, dtype=torch.int32, device=device)
    if tie_break == "hash":
        return tie_hash_sign(step, tie_index(segments, numel, device))
    raise ValueError(f"tie_break must be one of {TIE_RULES}, got {tie_break!r}")


def count_votes(sign: torch.Tensor, nonzero: torch.Tensor | None, numel: int):
    """sign/nonzero: uint8 [N, bytes] packed planes -> (plus, cnt) int32 per element."""
    s = unpack_bits(sign.reshape(-1)).reshape(sign.shape[0], -1)[:, :numel].to(torch.int32)
    if nonzero is None:
        return s.sum(0, dtype=torch.int32), torch.full((numel,), sign.shape[0], dtype=torch.int32, device=sign.device)
    z = unpack_bits(nonzero.reshape(-1)).reshape(sign.shape[0], -1)[:, :numel].to(torch.int32)
    return (s & z).sum(0, dtype=torch.int32), z.sum(0, dtype=torch.int32)


def decide(plus, cnt, world_size, vote, tie_break, step, segments=None):
    """(plus, cnt) counts -> fp32 Δ for every element (docs/conventions.md); ``segments``: the
    tie-index table of the elements (:func:`as_segments`)."""
    diff = 2 * plus - cnt
    if vote == "average":
        return diff.float() / float(world_size)
    if vote != "majority":
        raise ValueError(f"vote must be one of {VOTE_MODES}, got {vote!r}")
    delta = torch.sign(diff)
    ties = (diff == 0) & (cnt > 0)
    # the shortcut reads the host: only on the CPU (on a GPU the tie values cost less than a sync)
    if tie_break != "zero" and (diff.device.type != "cpu" or bool(ties.any())):
        tv = tie_values(tie_break, step, segments, diff.numel(), diff.device)
        delta = torch.where(ties, tv, delta)
    return delta.float()


def apply_update(params, offsets, delta: torch.Tensor, lr: float, weight_decay: float) -> None:
    """theta <- fl(theta*decay); theta <- fl(theta + fl(-lr*Δ)) per tensor (Δ: flat fp32 bucket)."""
    decay = 1.0 - lr * weight_decay
    for p, off in zip(params, offsets):
        d = delta[off:off + p.numel()].view_as(p)
        if decay != 1.0:
            p.mul_(decay)
        p.add_(d.mul(-lr))


def vote_apply(sign, nonzero, params, offsets, lr, weight_decay, step, tie_break, vote, world_size, segments=None,
               return_delta=True):
    """N packed vote planes -> Δ -> apply to params. Returns Δ (fp32 flat), or None without ``return_delta``.

    ``segments``: the tie-index table of the planes' elements; None: ``tie_segments(offsets)``
    (whole parameters, each numbered from 0)."""
    numel = sign.shape[-1] * 8
    plus, cnt = count_votes(sign.reshape(sign.shape[0] if sign.dim() > 1 else 1, -1),
                            None if nonzero is None else nonzero.reshape(nonzero.shape[0] if nonzero.dim() > 1 else 1, -1),
                            numel)
    segs = tie_segments(offsets) if segments is None else segments
    delta = decide(plus, cnt, world_size, vote, tie_break, step, segs)
    apply_update(params, offsets, delta, lr, weight_decay)
    return delta if return_delta else None


def shard_vote(sign, nonzero, step, tie_break, segments):
    """Two-phase vote, phase 1 (majority): N packed chunks [N, S] -> packed result planes.

    ``segments``: the tie-index table of the shard (``tie_segments(offsets, start=shard
    start, stop=shard end)``). Returns (sign bits, nonzero bits). The caller sends the
    nonzero plane in phase 2 only when the result can be 0 somewhere (abstentions or
    tie_break='zero' with an even N), so phase 2 carries 1 bit per element whenever Δ is
    never 0.
    """
    numel = sign.shape[1] * 8
    plus, cnt = count_votes(sign, nonzero, numel)
    delta = decide(plus, cnt, sign.shape[0], "majority", tie_break, step, segments)
    out_sign = pack_bits(delta > 0)
    out_nz = pack_bits(delta != 0)
    return out_sign, out_nz


def count_lanes(sign, nonzero, p):
    """Phase 1 of an averaging two-phase vote, and the p-bit encoder (N = 1).

    sign/nonzero: uint8 [N, S] packed planes -> (plus lanes, cnt lanes or None), each
    p-bit packed; cnt lanes only when a nonzero plane is given.
    """
    numel = sign.shape[1] * 8
    plus, cnt = count_votes(sign, nonzero, numel)
    top = (1 << p) - 1
    if int(cnt.max()) > top if cnt.numel() else False:
        raise ValueError(f"count {int(cnt.max())} does not fit a {p}-bit lane")
    return pack_lanes(plus, p), (None if nonzero is None else pack_lanes(cnt, p))


def lanes_apply(plus_lanes, cnt_lanes, world_size, p, params, offsets, lr, weight_decay, step, tie_break, vote,
                segments=None, return_delta=True):
    """Summed p-bit lanes (counts of +1 votes, and of voters) -> Δ -> apply. Returns Δ.
    ``segments`` as in :func:`vote_apply`."""
    numel = plus_lanes.numel() * 8 // p
    plus = unpack_lanes(plus_lanes, p, numel)
    cnt = unpack_lanes(cnt_lanes, p, numel) if cnt_lanes is not None else torch.full_like(plus, world_size)
    segs = tie_segments(offsets) if segments is None else segments
    delta = decide(plus, cnt, world_size, vote, tie_break, step, segs)
    apply_update(params, offsets, delta, lr, weight_decay)
    return delta if return_delta else None


# ----------------------------------------------------------------------------- single-process step
def lion_step(params, grads, momenta, lr, weight_decay, beta1, beta2):
    """One Lion step over lists of tensors, in place (docs/conventions.md), per tensor:

    c = fl(fl(β1·m) + fl((1−β1)·g)) in fp32; θ ← fl(θ·decay) (decay = 1 − lr·wd, skipped when it is 1);
    θ ← fl(θ + fl(−lr·sign(c))); m ← fl(fl(β2·m) + fl((1−β2)·g)), rounded once to m's dtype.

    ``sign`` is torch.sign: ±1, and 0 for ±0 and for NaN (a NaN c leaves θ where the decay put it).
    The fused kernels read g, m, θ once and write m, θ once (20 B/param in fp32).
    """
    decay = 1.0 - lr * weight_decay
    for p, g, m in zip(params, grads, momenta):
        g32 = g.float()
        c = m.float().mul(beta1).add_(g32.mul(1.0 - beta1))
        if decay != 1.0:
            p.mul_(decay)
        p.add_(torch.sign(c), alpha=-lr)
        m.copy_(m.float().mul_(beta2).add_(g32.mul(1.0 - beta2)))



def lion_step_split(fused, qualifies, params, grads, momenta, lr, weight_decay, beta1, beta2):
    """A native backend's lion_step: ``fused`` over the (θ, g, m) triples ``qualifies`` accepts (one
    call), :func:`lion_step` over the rest; the same bits either way."""
    fast = [i for i, t in enumerate(zip(params, grads, momenta)) if qualifies(*t)]
    if fast:
        fused([params[i] for i in fast], [grads[i] for i in fast], [momenta[i] for i in fast])
    if len(fast) < len(params):
        rest = sorted(set(range(len(params))) - set(fast))
        lion_step([params[i] for i in rest], [grads[i] for i in rest], [momenta[i] for i in rest], lr,
                  weight_decay, beta1, beta2)

# ----------------------------------------------------------------------------- ZeRO sign all-gather apply
class ZeroLayout:
    """Where the partitions of a ZeRO sign all-gather live (:func:`zero_layout` builds it; read-only).

    ``world_size`` N; per group g: ``part_numels[g]`` P_g (partition j is elements [j·P_g, (j+1)·P_g) of
    the group's flat buffer) and ``byte_offsets[g]`` (its votes are bits 8·o_g .. 8·o_g + P_g − 1 of
    plane row j). ``pieces``: int64 [K, 5] rows (group, row, bit, start, numel): the real elements
    (padding left out), split at partition boundaries; bit = the row bit of element ``start``.
    """

    __slots__ = ("world_size", "part_numels", "byte_offsets", "_rows", "_pieces")

    def __init__(self, world_size, part_numels, byte_offsets, rows):
        self.world_size = int(world_size)
        self.part_numels = tuple(int(v) for v in part_numels)
        self.byte_offsets = tuple(int(v) for v in byte_offsets)
        self._rows = tuple(tuple(int(v) for v in r) for r in rows)
        self._pieces = None

    @property
    def groups(self) -> int:
        return len(self.part_numels)

    @property
    def plane_bytes(self) -> int:
        """Bytes a plane row needs to hold every group's votes."""
        return max((o + (p + 7) // 8 for o, p in zip(self.byte_offsets, self.part_numels)), default=0)

    @property
    def pieces(self) -> torch.Tensor:
        if self._pieces is None:
            self._pieces = torch.tensor(self._rows, dtype=torch.int64, device="cpu").reshape(-1, 5)
        return self._pieces.clone()  # a copy: the layout cannot be changed through it

    def rows(self):
        return self._rows


def zero_layout(world_size, part_numels, byte_offsets, real_ranges=None) -> ZeroLayout:
    """The :class:`ZeroLayout` of G groups. ``real_ranges[g]``: sorted, disjoint [a, b) ranges of group
    g's flat buffer (N·P_g elements) that hold parameters (None, or a None entry: all of it); the rest
    is padding and never moves. Raises ValueError for ranges or offsets that do not fit."""
    n = int(world_size)
    if n < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    parts, offs = [int(v) for v in part_numels], [int(v) for v in byte_offsets]
    if len(parts) != len(offs):
        raise ValueError(f"part_numels has {len(parts)} groups but byte_offsets has {len(offs)}")
    real_ranges = [None] * len(parts) if real_ranges is None else list(real_ranges)
    if len(real_ranges) != len(parts):
        raise ValueError(f"real_ranges has {len(real_ranges)} groups but part_numels has {len(parts)}")
    rows = []
    for g, (ps, o, ranges) in enumerate(zip(parts, offs, real_ranges)):
        if ps < 0 or o < 0:
            raise ValueError(f"group {g}: part_numels and byte_offsets must be >= 0, got {ps} and {o}")
        total = n * ps
        ranges = [(0, total)] if ranges is None else [(int(a), int(b)) for a, b in ranges]
        prev = 0
        for a, b in ranges:
            if not prev <= a <= b <= total:
                raise ValueError(f"group {g}: real range [{a}, {b}) must be sorted, disjoint and inside "
                                 f"[0, {total})")
            prev = b
            while a < b:  # split at partition boundaries
                j = a // ps
                stop = min(b, (j + 1) * ps)
                rows.append((g, j, 8 * o + (a - j * ps), a, stop - a))
                a = stop
    return ZeroLayout(n, parts, offs, rows)


def zero_sign_apply(sign, nonzero, targets, casts, layout, lrs, weight_decays):
    """The ZeRO sign all-gather apply: every rank's partition of every group from the all-gathered planes.

    ``sign``: uint8 [N, B] (row j: rank j's packed sign bits, LSB first); ``nonzero``: None (every
    bit votes) or uint8 [N, B'] (its nonzero bits). For each group g (:class:`ZeroLayout`) and each
    real element q of partition j = q // P_g: Δ = +1 where rank j's sign bit is set, −1 where not, 0
    where its nonzero bit is clear; ``targets[g][q]`` ← θ·(1 − lr_g·wd_g) − lr_g·Δ with
    :func:`apply_update`'s arithmetic (what :func:`vote_apply` with one voter does), and ``casts[g]``
    (None, or a bf16/fp16 copy of the group) receives it rounded once. Padding is untouched.
    """
    n = sign.shape[0]
    for g, (ps, o) in enumerate(zip(layout.part_numels, layout.byte_offsets)):
        nb = (ps + 7) // 8
        s = unpack_bits(sign[:, o:o + nb].reshape(-1)).reshape(n, -1)[:, :ps].reshape(-1).to(torch.int32)
        delta = 2 * s - 1
        if nonzero is not None:
            z = unpack_bits(nonzero[:, o:o + nb].reshape(-1)).reshape(n, -1)[:, :ps].reshape(-1).to(torch.int32)
            delta = delta * z
        delta = delta.float()
        cast = None if casts is None else casts[g]
        for gg, _row, _bit, start, numel in layout.rows():
            if gg != g:
                continue
            t = targets[g][start:start + numel]
            apply_update([t], [0], delta[start:start + numel], lrs[g], weight_decays[g])
            if cast is not None:
                cast[start:start + numel].copy_(t)


# ----------------------------------------------------------------------------- int8
SUM_BLOCK = 16384  # elements per block of the ordered sum (csrc/common: kSumBlock)
SUM_LANES = 256    # lanes per block (kSumLanes)
_LN2 = float.fromhex("0x1.62e42fefa39efp-1")
_SQRT2 = float.fromhex("0x1.6a09e667f3bcdp+0")
_INV_LN2 = float.fromhex("0x1.71547652b82fep+0")
_LOG_COEF = [1.0 / (2 * k + 1) for k in range(11)]           # 1/(2k+1), k = 0..10
_EXP_COEF = [1.0 / math.factorial(k) for k in range(15)]     # 1/k!, k = 0..14


def ordered_sum(values: torch.Tensor) -> float:
    """The fp64 sum of a flat fp64 tensor in the order this project defines (docs/conventions.md).

    Blocks of SUM_BLOCK elements from element 0. In a block, lane l (0..255) adds elements
    l, l+256, l+512, ... in index order, starting from +0.0 (missing elements of the last
    block add nothing); then for s = 128, 64, ..., 1: lane[l] = lane[l] + lane[l+s] (l < s);
    the block's sum is lane[0]. The result adds the block sums in block order, from +0.0.
    Every add is one IEEE fp64 addition; nothing depends on the ISA, threads or GPU model.
    """
    return float(ordered_sum_rows(values.reshape(1, -1))[0])


def ordered_sum_rows(values: torch.Tensor) -> torch.Tensor:
    """:func:`ordered_sum` of each row of a [R, n] tensor at once (fp64 [R], the same bits)."""
    rows, n = values.shape
    out = torch.zeros(rows, dtype=torch.float64, device=values.device)
    if n == 0:
        return out
    nb = -(-n // SUM_BLOCK)
    x = torch.zeros(rows, nb * SUM_BLOCK, dtype=torch.float64, device=values.device)
    x[:, :n] = values.to(torch.float64)
    x = x.view(rows, nb, SUM_BLOCK // SUM_LANES, SUM_LANES)
    acc = torch.zeros(rows, nb, SUM_LANES, dtype=torch.float64, device=values.device)
    for k in range(SUM_BLOCK // SUM_LANES):  # adding a padding +0.0 leaves a lane unchanged
        acc = acc + x[:, :, k, :]
    s = SUM_LANES // 2
    while s > 0:
        acc[:, :, :s] = acc[:, :, :s] + acc[:, :, s:2 * s]
        s //= 2
    for b in range(nb):  # one fp64 add per block, in block order (not a compensated sum)
        out = out + acc[:, b, 0]
    return out


def log_parts(a: torch.Tensor):
    """a: fp32 > 0, finite -> (e int64, log(m) fp64) with a = m * 2**e, m in (sqrt2/2, sqrt2].

    log(m) = 2*atanh(s), s = (m-1)/(m+1): t = 1/21; t = t*s^2 + 1/(2k+1) for k = 9..0;
    log(m) = (s+s)*t -- IEEE fp64 operations only, so C++ and CUDA give the same bits."""
    b = a.to(torch.float64).view(torch.int64)
    e = ((b >> 52) & 0x7FF) - 1023
    m = ((b & 0x000FFFFFFFFFFFFF) | 0x3FF0000000000000).view(torch.float64)
    big = m > _SQRT2
    m = torch.where(big, m * 0.5, m)
    e = e + big.to(torch.int64)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    t = torch.full_like(s, _LOG_COEF[10])
    for k in range(9, -1, -1):
        t = t * z + _LOG_COEF[k]
    return e, (s + s) * t


def det_exp(y: float) -> float:
    """exp(y) in IEEE fp64 operations: k = floor(y*(1/ln2) + 0.5), r = y - k*ln2,
    p = 1/14!; p = p*r + 1/j! (j = 13..0); p * 2**k."""
    k = math.floor(y * _INV_LN2 + 0.5)
    r = y - k * _LN2
    p = _EXP_COEF[14]
    for j in range(13, -1, -1):
        p = p * r + _EXP_COEF[j]
    return math.ldexp(p, k)


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64, device="cpu").float())


def int8_scale(c: torch.Tensor, kind: str) -> float:
    """Per-tensor scale a of |c| as an fp32 value (docs/conventions.md; c finite):

    * l1: fp32(S / n), S = :func:`ordered_sum` of |c| (fp64), n = numel;
    * l0: over the nnz nonzero |c| = m * 2**e (:func:`log_parts`): E = sum of e (exact
      int64), M = ordered sum of log(m) (zeros contribute nothing to their lane);
      fp32(det_exp((E*ln2 + M) / nnz)), each operation one fp64 rounding; 0 if nnz == 0;
    * linf: max |c| (order-free).
    """
    return scale_rows(c.reshape(1, -1), kind)[0]


def scale_rows(c: torch.Tensor, kind: str) -> list[float]:
    """:func:`int8_scale` of each row of a [R, n] tensor (the same values; l1 / linf batched)."""
    a = c.float().abs()
    rows, n = a.shape
    if n == 0:
        return [0.0] * rows
    if kind == "l1":
        return [_f32(s / n) for s in ordered_sum_rows(a).tolist()]
    if kind == "linf":
        return [float(v) for v in a.max(dim=1).values.tolist()]
    if kind == "l0":
        out = []
        for r in a:
            nz = r > 0
            nnz = int(nz.sum())
            if nnz == 0:
                out.append(0.0)
                continue
            e, logm = log_parts(torch.where(nz, r, torch.ones_like(r)))
            esum = int(torch.where(nz, e, torch.zeros_like(e)).sum())
            msum = ordered_sum(torch.where(nz, logm, torch.zeros_like(logm)))
            out.append(_f32(det_exp((float(esum) * _LN2 + msum) / nnz)))
        return out
    raise ValueError(f"quant scale must be one of {SCALE_KINDS}, got {kind!r}")


def int8_quantize(c: torch.Tensor, scale: float, levels: int) -> torch.Tensor:
    """q = clip(round((s/2) * c / a), -s, s) as int8 (round half to even); a == 0 -> q = 0."""
    if not scale > 0 or not math.isfinite(scale):
        return torch.zeros_like(c, dtype=torch.int8)
    q = torch.round(c * (float(levels) / 2.0) / scale).clamp_(-levels, levels)
    return q.to(torch.int8)


def int8_local_step(grads, momenta, offsets, total, beta1, kind, levels, device_counts=False):
    """c per tensor -> int8 codes in a flat bucket buffer. Returns (q, #non-finite);
    ``device_counts``: the count as a 0-dim int64 tensor on q's device (see :func:`local_step`)."""
    q = torch.zeros(total, dtype=torch.int8, device=grads[0].device if grads else "cpu")
    n_bad = 0
    for g, m, off in zip(grads, momenta, offsets):
        c = lion_direction(m.reshape(-1), g.reshape(-1), beta1)
        finite = torch.isfinite(c)
        n_bad += int((~finite).sum())
        c = torch.where(finite, c, torch.zeros_like(c))
        q[off:off + c.numel()] = int8_quantize(c, int8_scale(c, kind), levels)
    if device_counts:
        return q, *as_device_counts(q.device, n_bad)
    return q, n_bad


def int8_apply(qsum, params, offsets, lr, weight_decay, return_delta=True):
    """Summed int8 codes -> Δ = sign(Σq) (a zero sum never moves: magnitudes cancelled) -> apply."""
    delta = torch.sign(qsum.to(torch.int32)).float()
    apply_update(params, offsets, delta, lr, weight_decay)
    return delta if return_delta else None


# ----------------------------------------------------------------------------- b-bit scaled votes (comm="bbit")
# Each rank sends b-bit codes k in 0..Q standing for the levels q = 2k - Q. b >= 2: Q = 2**b - 2, the
# 2**b - 1 even levels -Q..Q, zero among them (a midtread quantizer: a rank whose c is small next to
# its tensor's scale mostly sends 0 and adds no noise to the sum; with b = 2 the votes are ternary).
# b = 1: Q = 1, the levels -1 and +1 (the sign vote). An exact c == 0 abstains through the
# abstention payload, as with 1-bit signs. The shard owner sums q over the voting ranks in int32 and
# takes the sign (docs/conventions.md).
# x = c * Q / (CLIP_MULTIPLE * a) is clipped to [-Q, Q]: the levels span +-2a for the mean-like
# scales (L1, L0), +-a for the max (Linf, where nothing clips).
CLIP_MULTIPLE = {"l1": 2.0, "l0": 2.0, "linf": 1.0}


def bbit_qmax(bits: int) -> int:
    """Q, the largest level: 1 for b = 1 (levels +-1), 2**b - 2 for b >= 2 (levels -Q..Q in steps of 2)."""
    return 1 if bits == 1 else (1 << bits) - 2


def bbit_ratio(scale: float, kind: str, bits: int) -> float:
    """fp32(Q / (CLIP_MULTIPLE[kind] * a)) (one fp64 division, rounded once); 0.0 if a is not > 0."""
    if not scale > 0 or not math.isfinite(scale):
        return 0.0
    return _f32(float(bbit_qmax(bits)) / (CLIP_MULTIPLE[kind] * scale))


def bbit_ratio_rows(c: torch.Tensor, kind: str, bits: int) -> torch.Tensor:
    """:func:`bbit_ratio` of each row's scale of a [R, n] c, as fp32 [R, 1] on c's device (the same
    bits). L1 and Linf are computed on the device (no host read: the CUDA step does not sync);
    L0 goes through :func:`scale_rows` on the host."""
    a = c.float().abs()
    if kind == "l0" or a.shape[1] == 0:
        return torch.tensor([[bbit_ratio(x, kind, bits)] for x in scale_rows(a, kind)], dtype=torch.float32,
                            device=c.device)
    if kind == "l1":
        scale = (ordered_sum_rows(a) / a.shape[1]).to(torch.float32)  # fp32(S / n), as int8_scale
    elif kind == "linf":
        scale = a.max(dim=1).values
    else:
        raise ValueError(f"quant scale must be one of {SCALE_KINDS}, got {kind!r}")
    m = float(bbit_qmax(bits))
    good = (scale > 0) & torch.isfinite(scale)
    safe = torch.where(good, scale, torch.ones_like(scale)).to(torch.float64)
    ratio = (m / (CLIP_MULTIPLE[kind] * safe)).to(torch.float32)
    return torch.where(good, ratio, torch.zeros_like(ratio)).view(-1, 1)


def dither_seed(step: int, rank: int) -> int:
    """The 32-bit dither seed of (step, rank): :func:`tie_hash` of index ``rank`` at ``step``.
    Each rank rounds with its own stream; every stream is reproducible."""
    return int(tie_hash(step, torch.tensor([rank], dtype=torch.int64))[0])


def dither_uniform(seed: int, index: torch.Tensor) -> torch.Tensor:
    """u in [0, 1) (fp32, exact): (tie_hash(seed, index) >> 8) * 2**-24, ``index`` the element's
    index inside its parameter (the layout never changes a rank's rounding)."""
    return (tie_hash(seed, index) >> 8).to(torch.float32) * (2.0 ** -24)


def bbit_codes(c: torch.Tensor, ratio, bits: int, rounding: str, u: torch.Tensor | None = None):
    """fp32 c -> uint8 codes k in 0..Q (:func:`bbit_qmax`), standing for q = 2k - Q (fp32 math, each
    op rounded once; h = 0.5 and o = Q/2 for b >= 2, h = 0 and o = 1 for b = 1):

    x = clamp(fl(c * ratio), -Q, Q);
    "nearest": k = floor(fl(fl(x * 0.5) + h)) + o, capped at Q: the level closest to x, halfway
    points go up, and no rounding of a small x can flip its sign (b = 1: the sign vote);
    "dither": k = floor(fl(fl(fl(x + Q) * 0.5) + u)), capped at Q: unbiased, E[q] = x.
    ``u``: :func:`dither_uniform` of the elements (dither only). ``ratio``: a float, or fp32 [R, 1]
    for the rows of a [R, n] c. A zero ratio (c all zero) gives the codes of x = 0: such
    coordinates abstain anyway."""
    qmax = float(bbit_qmax(bits))
    x = (c.float() * ratio).clamp_(-qmax, qmax)
    if rounding == "nearest":
        h, o = (0.0, 1.0) if bits == 1 else (0.5, qmax * 0.5)
        k = torch.floor(x * 0.5 + h) + o
    elif rounding == "dither":
        k = torch.floor((x + qmax) * 0.5 + u)
    else:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    return k.clamp_(0.0, qmax).to(torch.uint8)


def bbit_sum(codes: torch.Tensor, nonzero: torch.Tensor | None, bits: int) -> torch.Tensor:
    """codes uint8 [N, numel] (k per rank), nonzero 0/1 [N, numel] or None (everybody votes)
    -> int32 Σ over voting ranks of (2k - Q)."""
    q = codes.to(torch.int32) * 2 - bbit_qmax(bits)
    if nonzero is not None:
        q = q * nonzero.to(torch.int32)
    return q.sum(0, dtype=torch.int32)


def decide_sum(qsum, voted, tie_break, step, segments=None):
    """int32 Σq -> fp32 Δ = sign(Σq); Σq == 0 where some rank voted -> the tie rule; where nobody
    voted (``voted`` false; None: everybody voted) -> 0. With Q = 1 this is the majority rule."""
    cnt = torch.ones_like(qsum) if voted is None else voted.to(torch.int32)
    return decide(qsum + cnt, 2 * cnt, 2, "majority", tie_break, step, segments)  # diff = qsum


def pack_bitplanes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [numel] (numel % 8 == 0) -> [bits, numel/8] packed planes, plane j = bit j."""
    return torch.stack([pack_bits((codes >> j) & 1) for j in range(bits)])


def unpack_bitplanes(planes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bitplanes` over the last dim: [..., bits, bytes] -> uint8 codes [..., 8*bytes]."""
    out = None
    for j in range(bits):
        plane = planes.select(-2, j)
        v = unpack_bits(plane.reshape(-1)).reshape(*plane.shape[:-1], -1) << j
        out = v if out is None else out | v
    return out


def bbit_local_step(grads, momenta, offsets, total, beta1, beta2, kind, bits, rounding, seed, segments,
                    update_momentum=False, device_counts=False, momenta_out=None):
    """The local half of a comm="bbit" step over one bucket: as :func:`local_step`, but the votes
    are b-bit codes of c, per tensor scaled by its own ``kind`` scale (a non-finite c counts and
    is scaled as 0) and rounded with the dither stream ``seed`` (:func:`dither_seed` of the step
    and this rank) at each element's parameter-local index (``segments``: the bucket's tie-index
    table). Returns (codes as bit planes uint8 [bits, total/8], nonzero plane, #non-finite, #zero)."""
    c = bucket_direction(grads, momenta, offsets, total, beta1)
    if update_momentum:
        advance_momenta(grads, momenta, beta2, momenta_out)
    _, nonzero, n_nonfinite, _ = encode_votes(c)
    n_zero = real_zero_count(c, grads, total)
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
    index = tie_index(segments, total, c.device) if rounding == "dither" else None
    codes = torch.zeros(total, dtype=torch.uint8, device=c.device)
    for g, off in zip(grads, offsets):
        piece = c[off:off + g.numel()].view(1, -1)
        u = dither_uniform(seed, index[off:off + g.numel()]) if index is not None else None
        codes[off:off + g.numel()] = bbit_codes(piece, bbit_ratio_rows(piece, kind, bits), bits, rounding, u).view(-1)
    planes = pack_bitplanes(codes, bits)
    if device_counts:
        return planes, nonzero, *as_device_counts(c.device, n_nonfinite, n_zero)
    return planes, nonzero, n_nonfinite, n_zero


def bbit_shard_vote(planes, nonzero, bits, step, tie_break, segments):
    """Two-phase b-bit vote at the shard owner: every rank's code planes of this shard
    [N, bits, S] and nonzero planes [N, S] (None: everybody votes) -> packed result planes
    (sign bits, nonzero bits), as :func:`shard_vote`."""
    codes = unpack_bitplanes(planes, bits)  # [N, 8S]
    nz = None if nonzero is None else unpack_bits(nonzero.reshape(-1)).reshape(nonzero.shape[0], -1)
    qsum = bbit_sum(codes, nz, bits)
    delta = decide_sum(qsum, None if nz is None else nz.any(0), tie_break, step, segments)
    return pack_bits(delta > 0), pack_bits(delta != 0)
