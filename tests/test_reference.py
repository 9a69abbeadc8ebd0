"""Reference codecs and the conventions they follow: documented bit order, lanes, counting, tie rules,
int8 bounds."""
import pytest
import torch

from lioncub_ds import conventions
from lioncub_ds.kernels import reference

pytestmark = pytest.mark.unit


def test_bit_order_is_lsb_first():
    bits = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1], dtype=torch.uint8)
    assert reference.pack_bits(bits).tolist() == [0b00000001, 0b10000010]
    assert torch.equal(reference.unpack_bits(reference.pack_bits(bits)), bits)


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [8, 64, 4096])
def test_lanes_round_trip_and_lane_order(p, n):
    v = torch.randint(0, 1 << p, (n,))
    packed = reference.pack_lanes(v, p)
    assert packed.numel() == n * p // 8
    assert torch.equal(reference.unpack_lanes(packed, p), v.to(torch.int32))
    if p == 4:
        assert reference.pack_lanes(torch.tensor([3, 12] + [0] * 6), 4)[0].item() == 3 | (12 << 4)


def test_literal_lane_patterns():
    # p = 2: lanes 1, 2, 3, 0 -> 0b00_11_10_01; p = 1 is pack_bits; p = 8 is the bytes themselves
    assert reference.pack_lanes(torch.tensor([1, 2, 3, 0]), 2).tolist() == [0b00111001]
    assert reference.pack_lanes(torch.tensor([1, 0, 1, 1, 0, 0, 0, 1]), 1).tolist() == [0b10001101]
    assert reference.pack_lanes(torch.tensor([7, 200]), 8).tolist() == [7, 200]
    assert reference.unpack_lanes(torch.tensor([0b11100100], dtype=torch.uint8), 2).tolist() == [0, 1, 2, 3]


def test_padding_and_lane_width_choice():
    assert [conventions.padded_numel(k, n) for k, n in ((1, 3), (25, 3), (0, 4))] == [24, 48, 0]
    assert [conventions.lane_bits_for(n) for n in (1, 2, 3, 4, 15, 16, 255)] == [1, 2, 2, 4, 4, 8, 8]
    with pytest.raises(ValueError, match="8-bit lane"):
        conventions.lane_bits_for(256)


def test_encode_votes_abstains_on_zero_and_nonfinite():
    c = torch.tensor([1.0, -1.0, 0.0, float("nan"), float("inf"), -0.0, 2.0, -3.0])
    sign, nz, bad, zeros = reference.encode_votes(c)
    assert reference.unpack_bits(sign).tolist() == [1, 0, 0, 0, 0, 0, 1, 0]
    assert reference.unpack_bits(nz).tolist() == [1, 1, 0, 0, 0, 0, 1, 1]
    assert (bad, zeros) == (2, 2)


def test_majority_ties_and_abstentions():
    # 4 ranks, 8 coordinates: +4, tie 2-2, all abstain, 3 vs 1, one voter, tie 1-1 with 2 abstaining...
    s = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 0], [1, 1, 0, 1, 0, 0, 0, 0],
                      [1, 0, 0, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.uint8)
    z = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1], [1, 1, 0, 1, 0, 1, 1, 1],
                      [1, 1, 0, 1, 0, 0, 1, 1], [1, 1, 0, 1, 0, 0, 1, 1]], dtype=torch.uint8)
    sp = torch.stack([reference.pack_bits(r) for r in s])
    zp = torch.stack([reference.pack_bits(r) for r in z])
    plus, cnt = reference.count_votes(sp, zp, 8)
    assert plus.tolist() == [4, 2, 0, 3, 1, 1, 0, 0] and cnt.tolist() == [4, 4, 0, 4, 1, 2, 4, 4]
    d = reference.decide(plus, cnt, 4, "majority", "zero", 1, 0)
    assert d.tolist() == [1, 0, 0, 1, 1, 0, -1, -1]
    alt_odd = reference.decide(plus, cnt, 4, "majority", "alternate", 1, 0)
    alt_even = reference.decide(plus, cnt, 4, "majority", "alternate", 2, 0)
    assert alt_odd[[1, 5]].tolist() == [1, 1] and alt_even[[1, 5]].tolist() == [-1, -1]
    assert alt_odd[2] == 0  # nobody voted: never moves, whatever the tie rule
    avg = reference.decide(plus, cnt, 4, "average", "zero", 1, 0)
    assert avg.tolist() == [1.0, 0.0, 0.0, 0.5, 0.25, 0.0, -1.0, -1.0]


def test_tie_hash_pinned_values():
    """The tie hash of docs/conventions.md, pinned on values computed independently of the reference."""
    m32 = 0xFFFFFFFF
    # (step=1, index=0) by hand, every intermediate written out:
    h = (0 * 0x9E3779B1 + 0 * 0xC2B2AE3D + 1 * 0x85EBCA77 + 0x165667B1) & m32
    assert h == 0x9C423228
    h ^= h >> 15
    assert h == 0x9C430AAC
    h = (h * 0x2C1B3C6D) & m32
    assert h == 0xEF2FDB3C
    h ^= h >> 12
    assert h == 0xEF2129C1
    h = (h * 0x297A2D39) & m32
    assert h == 0xE1B338F9
    h ^= h >> 15
    assert h == 0xE1B2FB9F  # odd: a tie at (step 1, index 0) takes +1
    # the same formula in plain Python integers, for a few more pairs (index >= 2**32 uses the high word)
    def plain(step, i):
        x = ((i & m32) * 0x9E3779B1 + (i >> 32) * 0xC2B2AE3D + (step & m32) * 0x85EBCA77 + 0x165667B1) & m32
        x ^= x >> 15
        x = (x * 0x2C1B3C6D) & m32
        x ^= x >> 12
        x = (x * 0x297A2D39) & m32
        return x ^ (x >> 15)

    pairs = [(1, 0), (1, 1), (1, 7), (2, 0), (3, 5), (3, 2**33 + 5), (1000, 123456789), (2**32 + 1, 1)]
    pinned = [0xE1B2FB9F, 0x92AC13BD, 0xB52EDB7E, 0x7B069B49, 0x64AC9B13, 0x8FEF6A2E, 0x488675C6, 0x92AC13BD]
    assert [plain(s, i) for s, i in pairs] == pinned
    for (step, i), want in zip(pairs, pinned):
        assert reference.tie_hash(step, torch.tensor([i])).item() == want
        assert reference.tie_hash_sign(step, torch.tensor([i])).item() == (1 if want & 1 else -1)
    assert reference.tie_hash_sign(1, torch.arange(16)).tolist() == [1, 1, -1, -1, -1, -1, -1, -1, 1, 1, 1, -1, -1, -1,
                                                                 -1, 1]
    # the high word counts: 2**33 + 5 does not alias 5
    assert reference.tie_hash(3, torch.tensor([2**33 + 5])).item() != reference.tie_hash(3, torch.tensor([5])).item()
    h = reference.tie_hash_sign(7, torch.arange(0, 100000))
    assert abs(int(h.sum())) < 2000  # balanced


def test_tie_segments_map_positions_to_parameter_indices():
    # parameters of 5, 16 and 3 elements at offsets 0, 8, 24 (8-aligned), bucket of 32
    segs = conventions.tie_segments([0, 8, 24])
    assert segs.tolist() == [[0, 0], [8, 0], [24, 0]]
    idx = reference.tie_index(segs, 32, "cpu").tolist()
    assert idx == [0, 1, 2, 3, 4, 5, 6, 7] + list(range(16)) + list(range(8))  # gaps continue the numbering
    # the same parameters in another order / another bucket: the same index per element
    other = reference.tie_index(conventions.tie_segments([16, 0, 40]), 48, "cpu").tolist()
    assert other[16:21] == idx[0:5] and other[0:16] == idx[8:24] and other[40:43] == idx[24:27]
    # a shard [12, 28) of the first bucket, and a piece of a parameter that starts at its element 100
    shard = conventions.tie_segments([0, 8, 24], start=12, stop=28)
    assert shard.tolist() == [[0, 4], [12, 0]]
    assert reference.tie_index(shard, 16, "cpu").tolist() == idx[12:28]
    assert conventions.tie_segments([0], [100]).tolist() == [[0, 100]]
    assert reference.as_segments(7).tolist() == [[0, 7]] and reference.as_segments(None).tolist() == [[0, 0]]
    with pytest.raises(ValueError, match="position 0"):
        reference.as_segments([[4, 0]])
    with pytest.raises(ValueError, match="increase"):
        reference.as_segments([[0, 0], [8, 1], [8, 2]])


def test_int8_levels_never_overflow():
    for n in (1, 2, 3, 7, 64, 127):
        s = conventions.int8_levels(n)
        assert n * s <= 127
    with pytest.raises(ValueError, match="127"):
        conventions.int8_levels(128)
    c = torch.tensor([0.0, 1e-9, -5.0, 0.3, float(2.5)])
    q = reference.int8_quantize(c, reference.int8_scale(c, "linf"), 31)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 31 and q[0] == 0
    assert reference.int8_quantize(torch.zeros(4), 0.0, 31).abs().sum() == 0
    assert reference.int8_scale(torch.tensor([0.0, 4.0, 1.0]), "l0") == pytest.approx(2.0)


def test_shard_vote_then_single_voter_decode_equals_direct_vote():
    torch.manual_seed(0)
    n, numel = 4, 64
    s = torch.stack([reference.pack_bits(torch.randint(0, 2, (numel,))) for _ in range(n)])
    for tie in reference.TIE_RULES:
        direct = reference.decide(*reference.count_votes(s, None, numel), n, "majority", tie, 3, 16)
        rs, rz = reference.shard_vote(s, None, 3, tie, 16)  # an int: the one-row table [[0, 16]]
        decoded = reference.decide(*reference.count_votes(rs.view(1, -1), rz.view(1, -1), numel), 1, "majority", tie, 3, 16)
        assert torch.equal(direct, decoded)
