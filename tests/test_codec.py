"""Reference codecs: documented bit order, lanes, counting, tie rules, int8 bounds."""
import pytest
import torch

from lioncub_ds import codec


def test_bit_order_is_lsb_first():
    bits = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1], dtype=torch.uint8)
    assert codec.pack_bits(bits).tolist() == [0b00000001, 0b10000010]
    assert torch.equal(codec.unpack_bits(codec.pack_bits(bits)), bits)


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [8, 64, 4096])
def test_lanes_round_trip_and_lane_order(p, n):
    v = torch.randint(0, 1 << p, (n,))
    packed = codec.pack_lanes(v, p)
    assert packed.numel() == n * p // 8
    assert torch.equal(codec.unpack_lanes(packed, p), v.to(torch.int32))
    if p == 4:
        assert codec.pack_lanes(torch.tensor([3, 12] + [0] * 6), 4)[0].item() == 3 | (12 << 4)


def test_padding_and_lane_width_choice():
    assert codec.padded_numel(1, 3) == 24 and codec.padded_numel(25, 3) == 48 and codec.padded_numel(0, 4) == 0
    assert [codec.lane_bits_for(n) for n in (1, 2, 3, 4, 15, 16, 255)] == [1, 2, 2, 4, 4, 8, 8]
    with pytest.raises(ValueError, match="8-bit lane"):
        codec.lane_bits_for(256)


def test_encode_votes_abstains_on_zero_and_nonfinite():
    c = torch.tensor([1.0, -1.0, 0.0, float("nan"), float("inf"), -0.0, 2.0, -3.0])
    sign, nz, bad, zeros = codec.encode_votes(c)
    assert codec.unpack_bits(sign).tolist() == [1, 0, 0, 0, 0, 0, 1, 0]
    assert codec.unpack_bits(nz).tolist() == [1, 1, 0, 0, 0, 0, 1, 1]
    assert (bad, zeros) == (2, 2)


def test_majority_ties_and_abstentions():
    # 4 ranks, 8 coordinates: +4, tie 2-2, all abstain, 3 vs 1, one voter, tie 1-1 with 2 abstaining...
    s = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 0], [1, 1, 0, 1, 0, 0, 0, 0],
                      [1, 0, 0, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.uint8)
    z = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1], [1, 1, 0, 1, 0, 1, 1, 1],
                      [1, 1, 0, 1, 0, 0, 1, 1], [1, 1, 0, 1, 0, 0, 1, 1]], dtype=torch.uint8)
    sp = torch.stack([codec.pack_bits(r) for r in s])
    zp = torch.stack([codec.pack_bits(r) for r in z])
    plus, cnt = codec.count_votes(sp, zp, 8)
    assert plus.tolist() == [4, 2, 0, 3, 1, 1, 0, 0] and cnt.tolist() == [4, 4, 0, 4, 1, 2, 4, 4]
    d = codec.decide(plus, cnt, 4, "majority", "zero", 1, 0)
    assert d.tolist() == [1, 0, 0, 1, 1, 0, -1, -1]
    alt_odd = codec.decide(plus, cnt, 4, "majority", "alternate", 1, 0)
    alt_even = codec.decide(plus, cnt, 4, "majority", "alternate", 2, 0)
    assert alt_odd[[1, 5]].tolist() == [1, 1] and alt_even[[1, 5]].tolist() == [-1, -1]
    assert alt_odd[2] == 0  # nobody voted: never moves, whatever the tie rule
    avg = codec.decide(plus, cnt, 4, "average", "zero", 1, 0)
    assert avg.tolist() == [1.0, 0.0, 0.0, 0.5, 0.25, 0.0, -1.0, -1.0]


def test_tie_hash_is_fixed_and_balanced():
    idx = torch.arange(0, 100000)
    h = codec.tie_hash_sign(7, idx)
    assert set(h.unique().tolist()) == {-1, 1}
    assert abs(int(h.sum())) < 2000  # balanced
    assert not torch.equal(h, codec.tie_hash_sign(8, idx))
    # pinned values: the C++/CUDA paths must reproduce these exactly
    assert codec.tie_hash_sign(1, torch.arange(8)).tolist() == codec.tie_hash_sign(1, torch.arange(8)).tolist()
    assert codec.tie_hash_sign(3, torch.tensor([2**33 + 5])).item() == codec.tie_hash_sign(3, torch.tensor([5])).item()


def test_int8_levels_never_overflow():
    for n in (1, 2, 3, 7, 64, 127):
        s = codec.int8_levels(n)
        assert n * s <= 127
    with pytest.raises(ValueError, match="127"):
        codec.int8_levels(128)
    c = torch.tensor([0.0, 1e-9, -5.0, 0.3, float(2.5)])
    q = codec.int8_quantize(c, codec.int8_scale(c, "linf"), 31)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 31 and q[0] == 0
    assert codec.int8_quantize(torch.zeros(4), 0.0, 31).abs().sum() == 0
    assert codec.int8_scale(torch.tensor([0.0, 4.0, 1.0]), "l0") == pytest.approx(2.0)


def test_shard_vote_then_single_voter_decode_equals_direct_vote():
    torch.manual_seed(0)
    n, numel = 4, 64
    s = torch.stack([codec.pack_bits(torch.randint(0, 2, (numel,))) for _ in range(n)])
    for tie in codec.TIE_RULES:
        direct = codec.decide(*codec.count_votes(s, None, numel), n, "majority", tie, 3, 16)
        rs, rz = codec.shard_vote(s, None, 3, tie, 16)
        decoded = codec.decide(*codec.count_votes(rs.view(1, -1), rz.view(1, -1), numel), 1, "majority", tie, 3, 16)
        assert torch.equal(direct, decoded)
