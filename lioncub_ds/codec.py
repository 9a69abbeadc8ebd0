"""Pure-torch reference codecs: the contract every fast path (C++, CUDA) must match.

Conventions (SPEC §4), identical in torch, C++ and CUDA:

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
  -1 on even steps; ``"hash"`` +1 or -1 from a 32-bit integer hash of
  (step, flat index) -- see :func:`tie_hash_sign`.
* **Apply**: theta <- fl(theta * decay) with decay = fl32(1 - lr*wd), then
  theta <- fl(theta + fl32(-lr * delta)); every op is rounded to the parameter
  dtype (fp32 math, no fused multiply-add), exactly like ``p.mul_(); p.add_()``.
* **Momentum**: m <- fl(fl(beta2*m) + fl((1-beta2)*g)) in fp32, then rounded to
  the momentum dtype once. c = fl(fl(beta1*m) + fl((1-beta1)*g)) in fp32.

All functions work on flat contiguous tensors; padding elements carry zeros.
"""
from __future__ import annotations

import math

import torch

TIE_RULES = ("zero", "alternate", "hash")
VOTE_MODES = ("majority", "average")
SCALE_KINDS = ("l1", "l0", "linf")
LANE_WIDTHS = (1, 2, 4, 8)

_M32 = 0xFFFFFFFF


def padded_numel(numel: int, world_size: int) -> int:
    """Smallest multiple of 8*world_size that holds ``numel`` elements."""
    unit = 8 * max(1, world_size)
    return (numel + unit - 1) // unit * unit


def lane_bits_for(n: int) -> int:
    """Smallest lane width p in {1,2,4,8} with 2**p - 1 >= n (a lane never carries)."""
    for p in LANE_WIDTHS:
        if (1 << p) - 1 >= n:
            return p
    raise ValueError(f"a count of up to {n} does not fit an 8-bit lane (needs 2**p - 1 >= {n}, p <= 8)")


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


def local_step(grads, momenta, offsets, total, beta1, beta2, update_momentum=False):
    """The local half of a Distributed Lion step over one bucket.

    ``grads``/``momenta``: lists of tensors; ``offsets``: element offset of each tensor in
    the bucket (multiples of 8); ``total``: padded bucket size (multiple of 8). Returns
    (sign bits, nonzero bits, #non-finite c, #zero c) over the real elements only
    (padding abstains and is not counted). With ``update_momentum`` the momenta are
    advanced in the same pass (otherwise call :func:`momentum_update` after the vote).
    """
    c = torch.zeros(total, dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for g, m, off in zip(grads, momenta, offsets):
        c[off:off + g.numel()] = lion_direction(m.reshape(-1), g.reshape(-1), beta1)
        if update_momentum:
            momentum_update(m, g, beta2)
    sign, nonzero, n_nonfinite, _ = encode_votes(c)
    n_real = sum(g.numel() for g in grads)
    n_zero = int((c == 0).sum()) - (total - n_real)
    return sign, nonzero, n_nonfinite, n_zero


# ----------------------------------------------------------------------------- votes
def tie_hash_sign(step: int, index: torch.Tensor) -> torch.Tensor:
    """+1/-1 (int32) from a 32-bit hash of (step, flat index); uint32 arithmetic mod 2**32."""
    i = index.to(torch.int64) & _M32
    h = (i * 0x9E3779B1 + (step & _M32) * 0x85EBCA77 + 0x165667B1) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x2C1B3C6D) & _M32
    h = h ^ (h >> 12)
    h = (h * 0x297A2D39) & _M32
    h = h ^ (h >> 15)
    return ((h & 1) * 2 - 1).to(torch.int32)


def tie_values(tie_break: str, step: int, base: int, numel: int, device) -> torch.Tensor:
    """The value a tied coordinate takes: int32 tensor of -1/0/+1 for indices base..base+numel."""
    if tie_break == "zero":
        return torch.zeros(numel, dtype=torch.int32, device=device)
    if tie_break == "alternate":
        return torch.full((numel,), 1 if step % 2 == 1 else -1, dtype=torch.int32, device=device)
    if tie_break == "hash":
        return tie_hash_sign(step, torch.arange(base, base + numel, dtype=torch.int64, device=device))
    raise ValueError(f"tie_break must be one of {TIE_RULES}, got {tie_break!r}")


def count_votes(sign: torch.Tensor, nonzero: torch.Tensor | None, numel: int):
    """sign/nonzero: uint8 [N, bytes] packed planes -> (plus, cnt) int32 per element."""
    s = unpack_bits(sign.reshape(-1)).reshape(sign.shape[0], -1)[:, :numel].to(torch.int32)
    if nonzero is None:
        return s.sum(0, dtype=torch.int32), torch.full((numel,), sign.shape[0], dtype=torch.int32, device=sign.device)
    z = unpack_bits(nonzero.reshape(-1)).reshape(sign.shape[0], -1)[:, :numel].to(torch.int32)
    return (s & z).sum(0, dtype=torch.int32), z.sum(0, dtype=torch.int32)


def decide(plus, cnt, world_size, vote, tie_break, step, base):
    """(plus, cnt) counts -> fp32 Δ for every element (SPEC §2, §4)."""
    diff = 2 * plus - cnt
    if vote == "average":
        return diff.float() / float(world_size)
    if vote != "majority":
        raise ValueError(f"vote must be one of {VOTE_MODES}, got {vote!r}")
    delta = torch.sign(diff)
    ties = (diff == 0) & (cnt > 0)
    if tie_break != "zero" and bool(ties.any()):
        tv = tie_values(tie_break, step, base, diff.numel(), diff.device)
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


def vote_apply(sign, nonzero, params, offsets, lr, weight_decay, step, tie_break, vote, world_size, base=0,
               return_delta=True):
    """N packed vote planes -> Δ -> apply to params. Returns Δ (fp32 flat), or None without ``return_delta``."""
    numel = sign.shape[-1] * 8
    plus, cnt = count_votes(sign.reshape(sign.shape[0] if sign.dim() > 1 else 1, -1),
                            None if nonzero is None else nonzero.reshape(nonzero.shape[0] if nonzero.dim() > 1 else 1, -1),
                            numel)
    delta = decide(plus, cnt, world_size, vote, tie_break, step, base)
    apply_update(params, offsets, delta, lr, weight_decay)
    return delta if return_delta else None


def shard_vote(sign, nonzero, step, tie_break, base):
    """Two-phase vote, phase 1 (majority): N packed chunks [N, S] -> packed result planes.

    Returns (sign bits, nonzero bits or None). The nonzero plane is returned only when
    the result can be 0 somewhere (abstentions or tie_break='zero' with a tie), so a
    phase-2 all-gather carries 1 bit per element whenever Δ is never 0.
    """
    numel = sign.shape[1] * 8
    plus, cnt = count_votes(sign, nonzero, numel)
    delta = decide(plus, cnt, sign.shape[0], "majority", tie_break, step, base)
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


def lanes_apply(plus_lanes, cnt_lanes, world_size, p, params, offsets, lr, weight_decay, step, tie_break, vote, base=0,
                return_delta=True):
    """Summed p-bit lanes (counts of +1 votes, and of voters) -> Δ -> apply. Returns Δ."""
    numel = plus_lanes.numel() * 8 // p
    plus = unpack_lanes(plus_lanes, p, numel)
    cnt = unpack_lanes(cnt_lanes, p, numel) if cnt_lanes is not None else torch.full_like(plus, world_size)
    delta = decide(plus, cnt, world_size, vote, tie_break, step, base)
    apply_update(params, offsets, delta, lr, weight_decay)
    return delta if return_delta else None


# ----------------------------------------------------------------------------- int8
def int8_levels(world_size: int) -> int:
    """s = floor(127 / N): |sum of N codes| <= N*s <= 127, so an int8 SUM never overflows."""
    s = 127 // world_size
    if s < 1:
        raise ValueError(f"int8 quantization needs world size <= 127, got {world_size}")
    return s


def int8_scale(c: torch.Tensor, kind: str) -> float:
    """Per-tensor scale a of |c| (fp32): l1 mean, l0 geometric mean (of nonzero |c|), linf max."""
    a = c.abs()
    if kind == "l1":
        v = a.mean() if a.numel() else torch.zeros(())
    elif kind == "linf":
        v = a.max() if a.numel() else torch.zeros(())
    elif kind == "l0":
        nz = a[a > 0]
        v = torch.exp(torch.log(nz.double()).mean()).float() if nz.numel() else torch.zeros(())
    else:
        raise ValueError(f"quant scale must be one of {SCALE_KINDS}, got {kind!r}")
    return float(v)


def int8_quantize(c: torch.Tensor, scale: float, levels: int) -> torch.Tensor:
    """q = clip(round((s/2) * c / a), -s, s) as int8 (round half to even); a == 0 -> q = 0."""
    if not scale > 0 or not math.isfinite(scale):
        return torch.zeros_like(c, dtype=torch.int8)
    q = torch.round(c * (float(levels) / 2.0) / scale).clamp_(-levels, levels)
    return q.to(torch.int8)


def int8_local_step(grads, momenta, offsets, total, beta1, kind, levels):
    """c per tensor -> int8 codes in a flat bucket buffer. Returns (q, #non-finite)."""
    q = torch.zeros(total, dtype=torch.int8, device=grads[0].device if grads else "cpu")
    n_bad = 0
    for g, m, off in zip(grads, momenta, offsets):
        c = lion_direction(m.reshape(-1), g.reshape(-1), beta1)
        finite = torch.isfinite(c)
        n_bad += int((~finite).sum())
        c = torch.where(finite, c, torch.zeros_like(c))
        q[off:off + c.numel()] = int8_quantize(c, int8_scale(c, kind), levels)
    return q, n_bad


def int8_apply(qsum, params, offsets, lr, weight_decay, return_delta=True):
    """Summed int8 codes -> Δ = sign(Σq) (a zero sum never moves: magnitudes cancelled) -> apply."""
    delta = torch.sign(qsum.to(torch.int32)).float()
    apply_update(params, offsets, delta, lr, weight_decay)
    return delta if return_delta else None
