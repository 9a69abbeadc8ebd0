"""comm="bbit" (two-phase b-bit scaled votes): the reference codec against brute force, its
settings, and its wire-byte formula. Real-rank tests (brute-force oracle, identical replicas, the
NCCL contract, the simulation == real ranks) live with the other algorithms' in
test_distributed.py, test_nccl_contract.py and test_converge.py."""
from __future__ import annotations

import pytest
import torch

from lioncub_ds import LionCubConfigError
from lioncub_ds.comm import make_algorithm
from lioncub_ds.config import LionCubConfig
from lioncub_ds.kernels import reference as R

pytestmark = pytest.mark.unit

pytestmark = pytest.mark.unit

ODD_SIZES = (1, 7, 13, 61, 1003, 16384 + 37)


def _c(numel, seed, zeros=0.1, ties=True):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(numel, generator=g) * torch.rand(numel, generator=g) ** 3  # heavy-ish tail
    c[torch.rand(numel, generator=g) < zeros] = 0.0
    if ties and numel > 4:
        c[:3] = c[3]  # equal magnitudes
    return c


# ----------------------------------------------------------------------------- the ordered sums and scales
@pytest.mark.parametrize("numel", ODD_SIZES)
def test_row_sums_and_scales_equal_the_one_tensor_versions(numel):
    rows = torch.stack([_c(numel, s) for s in range(3)] + [torch.zeros(numel)])
    sums = R.ordered_sum_rows(rows.double())
    for r in range(rows.shape[0]):
        assert float(sums[r]) == R.ordered_sum(rows[r].double())
    for kind in R.SCALE_KINDS:
        assert R.scale_rows(rows, kind) == [R.int8_scale(rows[r], kind) for r in range(rows.shape[0])]
        for bits in R.VOTE_BITS:
            ratios = R.bbit_ratio_rows(rows, kind, bits)
            assert ratios.dtype == torch.float32 and ratios.shape == (rows.shape[0], 1)
            expect = [R.bbit_ratio(R.int8_scale(rows[r], kind), kind, bits) for r in range(rows.shape[0])]
            assert ratios.view(-1).tolist() == expect
    assert R.bbit_ratio_rows(rows, "l1", 2)[-1, 0] == 0.0  # an all-zero tensor: ratio 0


def test_ratio_is_max_level_over_clip_point():
    c = torch.tensor([1.0, -3.0, 0.0, 2.0])  # L1 = 1.5, Linf = 3
    assert R.bbit_ratio(R.int8_scale(c, "l1"), "l1", 2) == pytest.approx(2 / (2 * 1.5))
    assert R.bbit_ratio(R.int8_scale(c, "linf"), "linf", 3) == pytest.approx(6 / 3)
    assert R.bbit_ratio(0.0, "l1", 2) == 0.0 and R.bbit_ratio(float("nan"), "l1", 2) == 0.0


# ----------------------------------------------------------------------------- codes
def _levels(bits):
    m = R.bbit_qmax(bits)
    return torch.arange(-m, m + 1, 2, dtype=torch.float32)


@pytest.mark.parametrize("bits", R.VOTE_BITS)
@pytest.mark.parametrize("numel", ODD_SIZES[:5])
def test_nearest_codes_are_the_closest_level_halves_up(bits, numel):
    c = _c(numel, bits * 100 + numel)
    ratio = R.bbit_ratio(R.int8_scale(c, "l1"), "l1", bits)
    k = R.bbit_codes(c, ratio, bits, "nearest")
    m = R.bbit_qmax(bits)
    assert k.dtype == torch.uint8 and int(k.max()) <= m
    x = (c * ratio).clamp(-m, m)
    levels = _levels(bits)
    dist = (x.view(-1, 1) - levels.view(1, -1)).abs()
    best = dist.min(1).values
    q = (2 * k.to(torch.int64) - m).float()
    # a closest level (fp32 arithmetic: an ulp's doubt only right at a halfway point) ...
    err = (x - q).abs()
    assert bool((err <= best + 1e-6).all()) and bool(((err == best) | ((err - 1).abs() < 1e-6)).all())
    halfway = x.remainder(2) == (0 if bits == 1 else 1)  # halfway between two levels (2 apart)
    assert torch.equal(q[halfway], (x[halfway] + 1).clamp(max=m))  # ... and exact halfway cases go up


def test_midtread_levels_send_zero_for_small_c():
    """b >= 2: |x| < 1 (c below half a level) rounds to the zero level; b = 1 has no zero level."""
    c = torch.tensor([1e-30, -1e-30, 0.3, -0.49, 0.51, -0.51])
    for bits in (2, 3, 4):
        q = 2 * R.bbit_codes(c, 2.0, bits, "nearest").to(torch.int64) - R.bbit_qmax(bits)
        assert q.tolist() == [0, 0, 0, 0, 2, -2]
    q1 = 2 * R.bbit_codes(c, 2.0, 1, "nearest").to(torch.int64) - 1
    assert q1.tolist() == [1, -1, 1, -1, 1, -1]
    assert [R.bbit_qmax(b) for b in R.VOTE_BITS] == [1, 2, 6, 14]


def test_one_bit_nearest_is_the_sign():
    c = _c(1003, 5)
    k = R.bbit_codes(c, R.bbit_ratio(R.int8_scale(c, "l1"), "l1", 1), 1, "nearest")
    nz = c != 0
    assert torch.equal((k[nz] == 1), c[nz] > 0)


@pytest.mark.parametrize("bits", (1, 2, 3))
def test_dither_is_unbiased_and_only_touches_the_two_neighbouring_levels(bits):
    m = R.bbit_qmax(bits)
    x = torch.linspace(-m, m, 41)  # inside the range, ratio 1: x is the target level
    idx = torch.arange(41, dtype=torch.int64)
    total = torch.zeros(41, dtype=torch.float64)
    draws = 4000
    for s in range(draws):
        u = R.dither_uniform(R.dither_seed(s, 3), idx)
        q = (2 * R.bbit_codes(x, 1.0, bits, "dither", u).to(torch.int64) - m).double()
        lo = torch.floor((x.double() + m) / 2) * 2 - m
        assert bool(((q == lo) | (q == lo + 2)).all())
        total += q
    mean = total / draws
    # each draw has variance <= 1 (two levels 2 apart): 5 sd of the mean of 4000 draws is 0.08
    assert float((mean - x.double()).abs().max()) < 0.08


def test_dither_streams_differ_per_rank_and_step_and_are_in_range():
    idx = torch.arange(10007, dtype=torch.int64)
    us = [R.dither_uniform(R.dither_seed(step, rank), idx) for step in (1, 2) for rank in (0, 1, 2)]
    for u in us:
        assert u.dtype == torch.float32 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
        assert 0.48 < float(u.mean()) < 0.52
    for i in range(len(us)):
        for j in range(i):
            assert not torch.equal(us[i], us[j])
    assert torch.equal(us[0], R.dither_uniform(R.dither_seed(1, 0), idx))  # reproducible


@pytest.mark.parametrize("bits", R.VOTE_BITS)
def test_bitplanes_round_trip(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2 ** bits, (8 * 37,), generator=g, dtype=torch.int64).to(torch.uint8)
    planes = R.pack_bitplanes(codes, bits)
    assert planes.shape == (bits, 37)
    assert torch.equal(R.unpack_bitplanes(planes, bits), codes)
    assert torch.equal(R.unpack_bitplanes(planes.unsqueeze(0).expand(3, -1, -1), bits), codes.expand(3, -1))


# ----------------------------------------------------------------------------- the shard owner's vote
@pytest.mark.parametrize("bits", R.VOTE_BITS)
@pytest.mark.parametrize("n", (2, 3, 4))
@pytest.mark.parametrize("tie_break", R.TIE_RULES)
def test_shard_vote_equals_brute_force(bits, n, tie_break):
    numel, step = 8 * 13, 5
    g = torch.Generator().manual_seed(bits * 10 + n)
    codes = torch.randint(0, R.bbit_qmax(bits) + 1, (n, numel), generator=g, dtype=torch.int64).to(torch.uint8)
    nz = torch.rand(n, numel, generator=g) > 0.3
    nz[:, :8] = False  # nobody votes
    planes = torch.stack([R.pack_bitplanes(codes[r], bits) for r in range(n)])
    nz_planes = torch.stack([R.pack_bits(nz[r]) for r in range(n)])
    segs = R.tie_segments([0], [40])  # a shard that starts at index 40 of its parameter
    sign, nonzero = R.bbit_shard_vote(planes, nz_planes, bits, step, tie_break, segs)
    m = R.bbit_qmax(bits)
    total = ((2 * codes.to(torch.int64) - m) * nz).sum(0)
    voters = nz.sum(0)
    tie = R.tie_values(tie_break, step, segs, numel, "cpu")
    expect = torch.where(total != 0, torch.sign(total), torch.where(voters > 0, tie.to(torch.int64), 0))
    got = R.unpack_bits(sign).to(torch.int64) * 2 - 1
    got = torch.where(R.unpack_bits(nonzero).bool(), got, 0)
    assert torch.equal(got, expect)
    # everybody votes: no planes needed
    s2, _ = R.bbit_shard_vote(planes, None, bits, step, tie_break, segs)
    all_total = (2 * codes.to(torch.int64) - m).sum(0)
    expect2 = torch.where(all_total != 0, torch.sign(all_total), tie.to(torch.int64))
    assert torch.equal(R.unpack_bits(s2).to(torch.int64) * 2 - 1, torch.where(expect2 == 0, -1, expect2))


@pytest.mark.parametrize("tie_break", R.TIE_RULES)
def test_one_bit_nearest_shard_vote_is_the_majority_vote(tie_break):
    """b = 1, nearest: the code is the sign bit, and the owner's result is 1bit's, bit for bit."""
    n, numel = 4, 8 * 21
    cs = torch.stack([_c(numel, 40 + r) for r in range(n)])
    signs = torch.stack([R.pack_bits(cs[r] > 0) for r in range(n)])
    nz = torch.stack([R.pack_bits(cs[r] != 0) for r in range(n)])
    codes = torch.stack([R.pack_bitplanes(R.bbit_codes(cs[r], R.bbit_ratio(R.int8_scale(cs[r], "l1"), "l1", 1), 1,
                                                       "nearest"), 1) for r in range(n)])
    segs = R.tie_segments([0])
    got = R.bbit_shard_vote(codes, nz, 1, 3, tie_break, segs)
    want = R.shard_vote(signs, nz, 3, tie_break, segs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ----------------------------------------------------------------------------- the local step
def test_local_step_codes_follow_the_parameter_not_the_bucket_layout():
    """The same parameter at another bucket offset, behind another parameter, gets the same codes
    (per-parameter scale, dither at the parameter-local index); momenta advance as Lion's."""
    g1, g2 = _c(13, 1), _c(29, 2)
    m1, m2 = _c(13, 3) * 0.1, _c(29, 4) * 0.1
    seed = R.dither_seed(7, 1)
    for dtype in (torch.float32, torch.bfloat16):
        a = R.bbit_local_step([g2.to(dtype)], [m2.clone()], [0], 32, 0.9, 0.99, "l1", 2, "dither", seed,
                              R.tie_segments([0]))
        b = R.bbit_local_step([g1.to(dtype), g2.to(dtype)], [m1.clone(), m2.clone()], [0, 16], 48, 0.9, 0.99, "l1",
                              2, "dither", seed, R.tie_segments([0, 16]))
        ca = R.unpack_bitplanes(a[0], 2)
        cb = R.unpack_bitplanes(b[0], 2)
        assert torch.equal(ca[:29], cb[16:45])
    out = [torch.empty_like(m1), torch.empty_like(m2)]
    ms = [m1.clone(), m2.clone()]
    R.bbit_local_step([g1, g2], ms, [0, 16], 48, 0.9, 0.99, "linf", 3, "nearest", 0, R.tie_segments([0, 16]),
                      update_momentum=True, momenta_out=out)
    assert torch.equal(ms[0], m1) and torch.equal(ms[1], m2)  # untouched
    ref = m1.clone()
    R.momentum_update(ref, g1, 0.99)
    assert torch.equal(out[0], ref)


def test_local_step_counts_nonfinite_and_zeros():
    g = _c(21, 9, zeros=0.0)
    g[3] = float("nan")
    m = torch.zeros(21)
    g[5] = 0.0
    planes, nz, bad, zero = R.bbit_local_step([g], [m], [0], 24, 0.9, 0.99, "l1", 2, "dither", 1, R.tie_segments([0]))
    assert (bad, zero) == (1, 1)
    assert planes.shape == (2, 3) and torch.equal(nz, R.pack_bits(torch.cat([(g != 0) & torch.isfinite(g),
                                                                             torch.zeros(3, dtype=torch.bool)])))


# ----------------------------------------------------------------------------- settings and bytes
def test_settings_are_validated_with_their_names():
    cfg = LionCubConfig.from_kwargs(comm="bbit", quant="l1")
    assert cfg.bbit == (2, "dither")
    assert LionCubConfig.from_kwargs(comm="bbit", quant="l0", vote_bits=3, rounding="nearest").bbit == (3, "nearest")
    with pytest.raises(LionCubConfigError, match=r"vote_bits=5.*1, 2, 3, 4"):
        LionCubConfig.from_kwargs(comm="bbit", quant="l1", vote_bits=5)
    with pytest.raises(LionCubConfigError, match=r"vote_bits=True"):
        LionCubConfig.from_kwargs(comm="bbit", quant="l1", vote_bits=True)
    with pytest.raises(LionCubConfigError, match=r"rounding='stochastic'.*'nearest', 'dither'"):
        LionCubConfig.from_kwargs(comm="bbit", quant="l1", rounding="stochastic")
    with pytest.raises(LionCubConfigError, match=r"vote_bits=2 is only used with comm='bbit'"):
        LionCubConfig.from_kwargs(comm="1bit", vote_bits=2)
    with pytest.raises(LionCubConfigError, match=r"comm='bbit' needs a scaled quantizer"):
        LionCubConfig.from_kwargs(comm="bbit")
    with pytest.raises(LionCubConfigError, match=r"vote='average'"):
        LionCubConfig.from_kwargs(comm="bbit", quant="l1", vote="average")


@pytest.mark.parametrize("n", (2, 3, 8, 16))
def test_wire_bytes_formula(n):
    numel = R.padded_numel(100_003, n)
    one = make_algorithm("1bit")
    for bits in R.VOTE_BITS:
        algo = make_algorithm("bbit", vote_bits=bits)
        for mode in ("list", "plane"):
            got = algo.wire_bytes(numel, n, mode=mode)
            assert got == one.wire_bytes(numel, n, mode=mode) + (n - 1) * (bits - 1) * numel // 8 // n
        # (N-1)/N·P·(b+1)/8 plus the abstention payload: 64/(b+1)x below an fp32 ring all-reduce
        fp32 = 2 * (n - 1) * 4 * numel // n
        ratio = fp32 / algo.wire_bytes(numel, n, mode="list")
        assert 0.9 * 64 / (bits + 1) < ratio <= 64 / (bits + 1)


# ----------------------------------------------------------------------------- error feedback (simulation only)
def test_error_feedback_sums_carry_c_over_steps():
    """The simulation's error-feedback screening variant: constant c below half a ternary level;
    without feedback every code is 0 (nothing is ever sent), with it the codes' running sum tracks
    the running sum of c."""
    from benchmarks.converge import bbit_feedback, bbit_residual

    c = torch.full((1, 64), 0.2)
    c[0, 0] = 1.0
    ratio = R.bbit_ratio(R.int8_scale(c, "linf"), "linf", 2)  # Q / max|c| = 2: x = 0.4 for c = 0.2
    res = torch.zeros_like(c)
    total = torch.zeros_like(c)
    for _ in range(50):
        v, voting = bbit_feedback(c, res)
        k = R.bbit_codes(v, ratio, 2, "nearest")
        res = bbit_residual(v, voting, k, ratio, 2, res)
        total += (k.float() * 2 - 2) / ratio
    assert int((R.bbit_codes(c, ratio, 2, "nearest") != 1).sum()) == 1  # alone: only the big one is sent
    assert float((total - 50 * c).abs().max()) <= 1.0 / ratio + 1e-5  # with feedback: within one level
