"""Property tests of the vote codecs (issue 8), with hypothesis.

The reference codecs (lioncub_ds.kernels.reference) are checked against plain Python loops: bit and
lane layouts, vote counting and the tie rules, lanes that never carry, int8 sums that
never overflow, and the two-phase sharded vote against the direct one. If the C++
kernels (lioncub_ds.kernels.loader) load, every backend function is checked against the
torch reference, bit for bit.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lioncub_ds.kernels import reference
from lioncub_ds.comm.abstain import any_voter
from lioncub_ds.comm.onebit import phase2_needs_nonzero

pytestmark = pytest.mark.unit

FAST = settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
M32 = 0xFFFFFFFF


# ----------------------------------------------------------------------------- python references
def py_pack_bits(bits):
    out = []
    for j in range(0, len(bits), 8):
        out.append(sum((bits[j + k] & 1) << k for k in range(8)))
    return out


def py_pack_lanes(values, p):
    per = 8 // p
    return [sum(values[j + k] << (k * p) for k in range(per)) for j in range(0, len(values), per)]


def py_tie_hash(step, index):
    h = ((index & M32) * 0x9E3779B1 + (index >> 32) * 0xC2B2AE3D + (step & M32) * 0x85EBCA77 + 0x165667B1) & M32
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & M32
    h ^= h >> 12
    h = (h * 0x297A2D39) & M32
    h ^= h >> 15
    return 1 if h & 1 else -1


def py_decide(votes, vote, tie_break, step, base):
    """votes: list over ranks of lists of -1/0/+1 -> list of Δ (float)."""
    n = len(votes)
    out = []
    for i in range(len(votes[0])):
        plus = sum(1 for r in range(n) if votes[r][i] > 0)
        cnt = sum(1 for r in range(n) if votes[r][i] != 0)
        diff = 2 * plus - cnt
        if vote == "average":
            out.append(float(torch.tensor(diff, dtype=torch.float32) / float(n)))
        elif diff != 0:
            out.append(1.0 if diff > 0 else -1.0)
        elif cnt == 0 or tie_break == "zero":
            out.append(0.0)
        elif tie_break == "alternate":
            out.append(1.0 if step % 2 == 1 else -1.0)
        else:
            out.append(float(py_tie_hash(step, base + i)))
    return out


def planes(votes):
    """votes [N][numel] of -1/0/+1 -> (sign, nonzero) uint8 [N, numel/8] via the codec's packer."""
    v = torch.tensor(votes, dtype=torch.int8)
    sign = torch.stack([reference.pack_bits(row > 0) for row in v])
    nonzero = torch.stack([reference.pack_bits(row != 0) for row in v])
    return sign, nonzero


# ----------------------------------------------------------------------------- strategies
@st.composite
def vote_sets(draw, max_n=9, max_bytes=8, n_multiple=1, abstain=None):
    """N ranks' votes over numel = 8*k*n_multiple(N) coordinates, rich in ties and abstentions."""
    n = draw(st.integers(1, max_n))
    k = draw(st.integers(1, max_bytes))
    numel = 8 * k * (n if n_multiple == "n" else 1)
    can_abstain = draw(st.booleans()) if abstain is None else abstain
    alphabet = [-1, 0, 1] if can_abstain else [-1, 1]
    votes = [[0] * numel for _ in range(n)]
    for i in range(numel):
        pattern = draw(st.sampled_from(["random", "tie", "unanimous", "silent"] if can_abstain
                                       else ["random", "tie", "unanimous"]))
        if pattern == "tie" and n >= 2:
            col = [1] * (n // 2) + [-1] * (n // 2)
            if n % 2:  # an odd N ties only when someone abstains
                col.append(0 if can_abstain else draw(st.sampled_from([-1, 1])))
            col = draw(st.permutations(col))
        elif pattern == "unanimous":
            col = [draw(st.sampled_from([-1, 1]))] * n
        elif pattern == "silent":
            col = [0] * n
        else:
            col = [draw(st.sampled_from(alphabet)) for _ in range(n)]
        for r in range(n):
            votes[r][i] = col[r]
    return votes


TIE = st.sampled_from(["zero", "alternate", "hash"])
STEP = st.integers(1, 2**33)
BASE = st.integers(0, 2**31).map(lambda b: b // 8 * 8)


# ----------------------------------------------------------------------------- bits and lanes
@FAST
@given(st.lists(st.integers(0, 1), min_size=0, max_size=40).map(lambda b: b * 8))
def test_pack_bits_layout_and_roundtrip(bits):
    t = torch.tensor(bits, dtype=torch.uint8)
    packed = reference.pack_bits(t)
    assert packed.dtype == torch.uint8 and packed.tolist() == py_pack_bits(bits)  # LSB first
    assert reference.unpack_bits(packed).tolist() == bits
    assert reference.pack_bits(t.bool()).tolist() == packed.tolist()


@FAST
@given(st.binary(min_size=0, max_size=64), st.integers(0, 64))
def test_unpack_then_pack_is_identity(raw, cut):
    packed = torch.tensor(list(raw), dtype=torch.uint8)
    bits = reference.unpack_bits(packed)
    assert torch.equal(reference.pack_bits(bits), packed)
    numel = min(cut, bits.numel())
    assert torch.equal(reference.unpack_bits(packed, numel), bits[:numel])


@FAST
@given(st.sampled_from([1, 2, 4, 8]).flatmap(
    lambda p: st.tuples(st.just(p), st.lists(st.integers(0, (1 << p) - 1), min_size=0, max_size=24).map(lambda v: v * (8 // p)))))
def test_lanes_layout_and_roundtrip(case):
    p, values = case
    t = torch.tensor(values, dtype=torch.int64)
    packed = reference.pack_lanes(t, p)
    assert packed.dtype == torch.uint8 and packed.tolist() == py_pack_lanes(values, p)
    assert reference.unpack_lanes(packed, p).tolist() == values
    if p == 1:
        assert torch.equal(packed, reference.pack_bits(t))


@FAST
@given(st.integers(1, 255))
def test_lane_width_is_the_smallest_that_cannot_carry(n):
    p = reference.lane_bits_for(n)
    assert (1 << p) - 1 >= n
    assert p == 1 or (1 << (p // 2)) - 1 < n


@FAST
@given(vote_sets(max_n=15, max_bytes=6).flatmap(lambda v: st.tuples(st.just(v), st.sampled_from(
    [p for p in (1, 2, 4, 8) if (1 << p) - 1 >= len(v)]))))
def test_pbit_lanes_never_carry_in_a_uint8_sum(case):
    """Each rank encodes its 0/1 votes in p-bit lanes; a wrapping uint8 SUM (in any order, as
    an all-reduce does) leaves exactly the per-lane counts when 2**p - 1 >= N."""
    votes, p = case
    n = len(votes)
    sign, nonzero = planes(votes)
    plus_lanes, cnt_lanes = [], []
    for r in range(n):
        pl, cl = reference.count_lanes(sign[r:r + 1], nonzero[r:r + 1], p)
        plus_lanes.append(pl)
        cnt_lanes.append(cl)
    for lanes, expect in ((plus_lanes, [sum(1 for r in range(n) if votes[r][i] > 0) for i in range(len(votes[0]))]),
                          (cnt_lanes, [sum(1 for r in range(n) if votes[r][i] != 0) for i in range(len(votes[0]))])):
        acc = torch.zeros_like(lanes[0])
        for ln in reversed(lanes):
            acc += ln  # uint8: wraps mod 256 like the collective would
        assert torch.equal(torch.stack(lanes).sum(0, dtype=torch.uint8), acc)
        assert reference.unpack_lanes(acc, p).tolist() == expect


# ----------------------------------------------------------------------------- votes
@FAST
@given(vote_sets(), st.sampled_from(["majority", "average"]), TIE, STEP, BASE)
def test_vote_equals_brute_force_count(votes, vote, tie_break, step, base):
    n, numel = len(votes), len(votes[0])
    sign, nonzero = planes(votes)
    abstains = any(v == 0 for row in votes for v in row)
    plus, cnt = reference.count_votes(sign, nonzero if abstains else None, numel)
    assert plus.tolist() == [sum(1 for r in range(n) if votes[r][i] > 0) for i in range(numel)]
    assert cnt.tolist() == [sum(1 for r in range(n) if votes[r][i] != 0) for i in range(numel)]
    delta = reference.decide(plus, cnt, n, vote, tie_break, step, base)
    assert delta.dtype == torch.float32
    assert delta.tolist() == py_decide(votes, vote, tie_break, step, base)
    # the full vote-and-apply path gives the same Δ (θ = 0, lr = 1, no decay: θ' = -Δ)
    theta = torch.zeros(numel)
    out = reference.vote_apply(sign, nonzero if abstains else None, [theta], [0], 1.0, 0.0, step, tie_break, vote, n, base)
    assert torch.equal(out, delta) and torch.equal(theta, -delta)


@FAST
@given(STEP, st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_tie_hash_matches_python(step, indices):
    got = reference.tie_hash_sign(step, torch.tensor(indices, dtype=torch.int64)).tolist()
    assert got == [py_tie_hash(step, i) for i in indices]


@FAST
@given(vote_sets(max_n=8, max_bytes=3, n_multiple="n"), TIE, STEP, BASE)
def test_sharded_two_phase_vote_equals_direct_vote(votes, tie_break, step, base):
    """1bit algorithm, simulated in one process: rank r counts shard r of every rank's bits,
    packs the result; decoding the gathered result planes gives the direct vote exactly."""
    n, numel = len(votes), len(votes[0])
    sign, nonzero = planes(votes)
    abstain = any(v == 0 for row in votes for v in row)
    nz = nonzero if abstain else None
    direct = reference.decide(*reference.count_votes(sign, nz, numel), n, "majority", tie_break, step, base)
    shard = numel // 8 // n
    send_nz = phase2_needs_nonzero(n, tie_break, abstain)
    res_sign, res_nz = [], []
    for r in range(n):
        s, z = reference.shard_vote(sign[:, r * shard:(r + 1) * shard].contiguous(),
                                None if nz is None else nz[:, r * shard:(r + 1) * shard].contiguous(),
                                step, tie_break, base + r * shard * 8)
        res_sign.append(s)
        res_nz.append(z)
    if not send_nz:  # phase 2 sends one plane: Δ is 0 only where nobody voted, which every rank knows
        voted = (torch.tensor(votes) != 0).any(0)
        assert torch.equal(direct != 0, voted)
    full_sign = torch.cat(res_sign).reshape(1, -1)
    if send_nz:
        full_nz = torch.cat(res_nz).reshape(1, -1)
    else:  # every rank has every rank's nonzero plane (the abstention payloads): OR them
        full_nz = any_voter(nz).reshape(1, -1) if nz is not None else None
    theta = torch.zeros(numel)
    decoded = reference.vote_apply(full_sign, full_nz, [theta], [0], 1.0, 0.0, step, tie_break, "majority", 1, base)
    assert torch.equal(decoded, direct)


@FAST
@given(vote_sets(max_n=8, max_bytes=3, n_multiple="n"), STEP, BASE)
def test_sharded_average_vote_equals_direct_average(votes, step, base):
    """1bit with vote='average': shard owners return p-bit counts; the result is the direct mean."""
    n, numel = len(votes), len(votes[0])
    sign, nonzero = planes(votes)
    abstain = any(v == 0 for row in votes for v in row)
    nz = nonzero if abstain else None
    direct = reference.decide(*reference.count_votes(sign, nz, numel), n, "average", "hash", step, base)
    p = reference.lane_bits_for(n)
    shard = numel // 8 // n
    plus, cnt = [], []
    for r in range(n):
        pl, cl = reference.count_lanes(sign[:, r * shard:(r + 1) * shard].contiguous(),
                                   None if nz is None else nz[:, r * shard:(r + 1) * shard].contiguous(), p)
        plus.append(pl)
        cnt.append(cl)
    theta = torch.zeros(numel)
    got = reference.lanes_apply(torch.cat(plus), None if nz is None else torch.cat(cnt), n, p, [theta], [0], 1.0, 0.0,
                            step, "hash", "average", base)
    assert torch.equal(got, direct)


# ----------------------------------------------------------------------------- int8
@FAST
@given(st.integers(1, 127), st.integers(1, 6), st.sampled_from(["l1", "l0", "linf"]), st.integers(0, 2**31 - 1),
       st.booleans())
def test_int8_sum_never_overflows(n, k, kind, seed, extreme):
    """s = floor(127/N) levels: any N codes in [-s, s] sum (in int8, in any order) without overflow."""
    levels = reference.int8_levels(n)
    assert n * levels <= 127 < n * (levels + 1)  # the most levels that cannot overflow
    numel = 8 * k
    gen = torch.Generator().manual_seed(seed)
    codes = []
    for r in range(n):
        c = torch.randn(numel, generator=gen) * float(torch.rand((), generator=gen) * 100 + 1e-3)
        if extreme:
            c = c.sign() * 1e6 + c  # every code clipped to +-s
        c[torch.rand(numel, generator=gen) < 0.1] = 0.0
        q = reference.int8_quantize(c, reference.int8_scale(c, kind), levels)
        assert q.dtype == torch.int8 and int(q.abs().max()) <= levels
        codes.append(q)
    exact = torch.stack(codes).to(torch.int32).sum(0)
    assert int(exact.abs().max()) <= 127
    acc = torch.zeros(numel, dtype=torch.int8)
    for q in codes:
        acc += q  # int8 arithmetic wraps: equal to the exact sum only if no partial sum overflowed
    assert torch.equal(acc.to(torch.int32), exact)
    acc = torch.zeros(numel, dtype=torch.int8)
    for q in reversed(codes):
        acc += q
    assert torch.equal(acc.to(torch.int32), exact)


@FAST
@given(st.integers(128, 100000))
def test_int8_refuses_worlds_that_could_overflow(n):
    with pytest.raises(ValueError, match="world size <= 127"):
        reference.int8_levels(n)


# ============================================================================= native kernels
def _native_backend():
    try:
        from lioncub_ds import kernels
        return kernels._load_native("cpp")
    except Exception as exc:  # noqa: BLE001 - not built on this machine / not written yet
        return exc


@pytest.fixture(scope="module")
def native():
    be = _native_backend()
    if isinstance(be, Exception):
        pytest.skip(f"lioncub_ds.kernels.loader C++ backend unavailable: {str(be).splitlines()[0] if str(be) else be!r}")
    return be


def bits_equal(a, b):
    """Bit-exact equality (signed zeros included); any NaN equals any NaN.

    NaN payloads are not compared: ATen's vectorized fp32->bf16 conversion writes NaN as
    0xFFFF, its scalar path and the C++ kernels as 0x7FC0. A NaN momentum never arises in
    LionCub (a step with a non-finite value is skipped before the momentum update).
    """
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        if not torch.equal(nan_a, nan_b):
            return False
        width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a[~nan_a].contiguous().view(width), b[~nan_b].contiguous().view(width))
    return torch.equal(a, b)


@st.composite
def buckets(draw, allow_bad=True):
    """A bucket of 1-3 tensors (fp32 or bf16 grads/momenta) at 8-aligned offsets, padded."""
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    sizes = draw(st.lists(st.integers(1, 300), min_size=1, max_size=3))
    gdtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    mdtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    world = draw(st.integers(1, 8))
    grads, moms, offsets, off = [], [], [], 0
    for n in sizes:
        g = torch.randn(n, generator=gen) * 10 ** float(torch.randint(-3, 3, (), generator=gen))
        m = torch.randn(n, generator=gen) * 0.1
        zero = torch.rand(n, generator=gen) < 0.15
        g[zero] = 0.0
        m[zero] = 0.0
        if allow_bad and draw(st.booleans()):
            g[int(torch.randint(0, n, (), generator=gen))] = draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
        grads.append(g.to(gdtype))
        moms.append(m.to(mdtype))
        offsets.append(off)
        off += (n + 7) // 8 * 8
    total = reference.padded_numel(off, world)
    beta1 = draw(st.sampled_from([0.9, 0.95, 0.5]))
    beta2 = draw(st.sampled_from([0.99, 0.98, 0.9]))
    return grads, moms, offsets, total, beta1, beta2, world


@settings(max_examples=30, deadline=None, database=None)
@given(buckets(), st.booleans())
def test_native_local_step_matches_torch(native, bucket, update):
    grads, moms, offsets, total, b1, b2, _ = bucket
    m_ref = [m.clone() for m in moms]
    m_nat = [m.clone() for m in moms]
    ref = reference.local_step(grads, m_ref, offsets, total, b1, b2, update)
    got = native.local_step(grads, m_nat, offsets, total, b1, b2, update)
    assert bits_equal(got[0], ref[0]) and bits_equal(got[1], ref[1])
    assert (got[2], got[3]) == (ref[2], ref[3])  # non-finite count drives the skip; zero count the abstain flag
    assert all(bits_equal(a, b) for a, b in zip(m_nat, m_ref))


@settings(max_examples=30, deadline=None, database=None)
@given(buckets())
def test_native_momentum_update_matches_torch(native, bucket):
    grads, moms, _, _, _, b2, _ = bucket
    m_ref = [m.clone() for m in moms]
    m_nat = [m.clone() for m in moms]
    for m, g in zip(m_ref, grads):
        reference.momentum_update(m, g, b2)
    native.momentum_update_list(m_nat, grads, b2)
    assert all(bits_equal(a, b) for a, b in zip(m_nat, m_ref))


def _params_like(sizes, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen)).to(dtype) for n in sizes]


@settings(max_examples=30, deadline=None, database=None)
@given(vote_sets(max_n=9, max_bytes=6), st.sampled_from(["majority", "average"]), TIE, STEP, BASE,
       st.sampled_from([torch.float32, torch.bfloat16]), st.sampled_from([1e-3, 0.1, 3e-4]),
       st.sampled_from([0.0, 0.1]), st.integers(0, 2**31 - 1))
def test_native_vote_apply_matches_torch(native, votes, vote, tie_break, step, base, pdtype, lr, wd, seed):
    n, numel = len(votes), len(votes[0])
    sign, nonzero = planes(votes)
    abstain = any(v == 0 for row in votes for v in row)
    nz = nonzero if abstain else None
    first = numel // 16 * 8  # two tensors when there is room, at 8-aligned offsets
    sizes = [first, numel - first] if first else [numel]
    offsets = [0, first][:len(sizes)]
    p_ref = _params_like(sizes, pdtype, seed)
    p_nat = [p.clone() for p in p_ref]
    d_ref = reference.vote_apply(sign, nz, p_ref, offsets, lr, wd, step, tie_break, vote, n, base)
    d_nat = native.vote_apply(sign, nz, p_nat, offsets, lr, wd, step, tie_break, vote, n, base)
    assert bits_equal(d_nat, d_ref)
    assert all(bits_equal(a, b) for a, b in zip(p_nat, p_ref))


@settings(max_examples=30, deadline=None, database=None)
@given(vote_sets(max_n=9, max_bytes=4), TIE, STEP, BASE)
def test_native_shard_vote_matches_torch(native, votes, tie_break, step, base):
    sign, nonzero = planes(votes)
    for nz in (None, nonzero) if not any(v == 0 for row in votes for v in row) else (nonzero,):
        ref = reference.shard_vote(sign, nz, step, tie_break, base)
        got = native.shard_vote(sign, nz, step, tie_break, base)
        assert bits_equal(got[0], ref[0]) and bits_equal(got[1], ref[1])


@settings(max_examples=30, deadline=None, database=None)
@given(vote_sets(max_n=15, max_bytes=4).flatmap(lambda v: st.tuples(st.just(v), st.sampled_from(
    [p for p in (1, 2, 4, 8) if (1 << p) - 1 >= len(v)]))), STEP, BASE, st.sampled_from(["majority", "average"]), TIE)
def test_native_lanes_match_torch(native, case, step, base, vote, tie_break):
    votes, p = case
    n, numel = len(votes), len(votes[0])
    sign, nonzero = planes(votes)
    abstain = any(v == 0 for row in votes for v in row)
    nz = nonzero if abstain else None
    ref = reference.count_lanes(sign, nz, p)
    got = native.count_lanes(sign, nz, p)
    assert bits_equal(got[0], ref[0]) and bits_equal(got[1], ref[1])
    theta_ref, theta_nat = [torch.zeros(numel)], [torch.zeros(numel)]
    d_ref = reference.lanes_apply(ref[0], ref[1], n, p, theta_ref, [0], 0.01, 0.1, step, tie_break, vote, base)
    d_nat = native.lanes_apply(ref[0], ref[1], n, p, theta_nat, [0], 0.01, 0.1, step, tie_break, vote, base)
    assert bits_equal(d_nat, d_ref) and bits_equal(theta_nat[0], theta_ref[0])


@settings(max_examples=30, deadline=None, database=None)
@given(buckets(), st.sampled_from(["l1", "l0", "linf"]), st.integers(1, 127))
def test_native_int8_matches_torch(native, bucket, kind, n):
    grads, moms, offsets, total, b1, _, _ = bucket
    levels = reference.int8_levels(n)
    q_ref, bad_ref = reference.int8_local_step(grads, moms, offsets, total, b1, kind, levels)
    q_nat, bad_nat = native.int8_local_step(grads, moms, offsets, total, b1, kind, levels)
    assert bad_nat == bad_ref
    assert bits_equal(q_nat, q_ref), f"int8 codes differ at {(q_nat != q_ref).nonzero().reshape(-1)[:8].tolist()}"
    qsum = (q_ref.to(torch.int32) * min(n, 3)).clamp(-127, 127).to(torch.int8)
    p_ref = [torch.randn(g.numel()) for g in grads]
    p_nat = [p.clone() for p in p_ref]
    d_ref = reference.int8_apply(qsum, p_ref, offsets, 1e-3, 0.1)
    d_nat = native.int8_apply(qsum, p_nat, offsets, 1e-3, 0.1)
    assert bits_equal(d_nat, d_ref) and all(bits_equal(a, b) for a, b in zip(p_nat, p_ref))

