// lioncub_cuda_vote.cuh -- per-word logic of the vote kernels: tie rules, bit-sliced vote counts,
// majority masks, the shard vote's result planes and the p-bit lanes (lioncub_vote.cu). Split from lioncub_cuda_common.cuh (the scalar contract, element I/O,
// tensor lookup, Lion math, apply and int8), on which it builds; same rules: __host__ __device__
// (LC_HD), integer ops and correctly rounded single fp32 ops only.
#ifndef LIONCUB_CUDA_VOTE_CUH_
#define LIONCUB_CUDA_VOTE_CUH_

#include "lioncub_cuda_common.cuh"

namespace lc {

// ----------------------------------------------------------------------------- votes
// The value a tied coordinate at position e of the unit of `run` takes.
LC_HD float tie_value_in(const lc_apply_args& a, const TieRun& run, int64_t e) {
  if (a.tie == LC_TIE_ZERO) return 0.0f;
  return static_cast<float>(
      lcc::tie_value(a.tie, a.step, a.tie == LC_TIE_HASH ? tie_index_in(run, a.tie_rows, a.tie_nrows, e) : 0));
}

// reference.decide for one element (bucket element index e); a tie reads its index through `run`
// (looked up by the caller, once per unit, when `*have` is false).
LC_HD float decide(int plus, int cnt, const lc_apply_args& a, int64_t e, int64_t e0, TieRun& run, bool& have) {
  const int diff = 2 * plus - cnt;
  if (a.vote == LC_VOTE_AVERAGE) return fdiv(static_cast<float>(diff), static_cast<float>(a.world_size));
  if (diff > 0) return 1.0f;
  if (diff < 0) return -1.0f;
  if (cnt == 0) return 0.0f;
  if (!have && a.tie == LC_TIE_HASH) {
    run = tie_run(a.tie_rows, a.tie_nrows, e0);
    have = true;
  }
  return tie_value_in(a, run, e);
}

// 32-bit word w of a packed row of row_bytes bytes (bytes past the end read as 0).
// `aligned`: the row starts 4-byte aligned and row_bytes % 4 == 0 (so every word is whole).
LC_HD uint32_t load_word(const uint8_t* __restrict__ row, int64_t w, int64_t row_bytes, bool aligned) {
  const int64_t b = w * 4;
  if (aligned) return *reinterpret_cast<const uint32_t*>(row + b);
  uint32_t x = 0;
  LC_UNROLL
  for (int i = 0; i < 4; ++i)
    if (b + i < row_bytes) x |= static_cast<uint32_t>(row[b + i]) << (8 * i);
  return x;
}

// Bit-sliced counter: L[k] holds bit k of 32 counters; add the 0/1 bits of x.
template <int KB>
LC_HD void slice_add(uint32_t* L, uint32_t x) {
  LC_UNROLL
  for (int k = 0; k < KB; ++k) {
    const uint32_t carry = L[k] & x;
    L[k] ^= x;
    x = carry;
  }
}

// Counts of word w over `rows` planes: P = #(sign & nonzero), C = #nonzero (or rows).
template <int KB>
LC_HD void count_word(const uint8_t* __restrict__ sign, const uint8_t* __restrict__ nonzero, int rows,
                      int64_t row_bytes, int64_t w, bool aligned, uint32_t* P, uint32_t* C) {
  LC_UNROLL
  for (int k = 0; k < KB; ++k) {
    P[k] = 0u;
    C[k] = nonzero ? 0u : (((rows >> k) & 1) ? 0xffffffffu : 0u);
  }
  if (nonzero) {
    LC_UNROLL_4
    for (int r = 0; r < rows; ++r) {
      const int64_t o = static_cast<int64_t>(r) * row_bytes;
      const uint32_t z = load_word(nonzero + o, w, row_bytes, aligned);
      const uint32_t s = load_word(sign + o, w, row_bytes, aligned) & z;
      slice_add<KB>(P, s);
      slice_add<KB>(C, z);
    }
  } else {
    LC_UNROLL_4
    for (int r = 0; r < rows; ++r)
      slice_add<KB>(P, load_word(sign + static_cast<int64_t>(r) * row_bytes, w, row_bytes, aligned));
  }
}

// Majority masks of 32 elements from bit-sliced counts: compares 2P with C bitwise.
// pos: 2P > C, neg: 2P < C, tie: 2P == C with C > 0 (cnt == 0 -> no bit: no move).
template <int KB>
LC_HD void majority_masks(const uint32_t* P, const uint32_t* C, uint32_t& pos, uint32_t& neg, uint32_t& tie) {
  uint32_t gt = 0u, lt = 0u, eq = 0xffffffffu, any = 0u;
  // level KB of 2P is P[KB-1]; C has no level KB
  gt |= eq & P[KB - 1];
  eq &= ~P[KB - 1];
  LC_UNROLL
  for (int k = KB - 1; k >= 1; --k) {
    const uint32_t a = P[k - 1], b = C[k];
    gt |= eq & a & ~b;
    lt |= eq & ~a & b;
    eq &= ~(a ^ b);
  }
  lt |= eq & C[0];  // level 0 of 2P is 0
  eq &= ~C[0];
  LC_UNROLL
  for (int k = 0; k < KB; ++k) any |= C[k];
  pos = gt;
  neg = lt;
  tie = eq & any;
}

// Value of counter `bit` (0..31) of a bit-sliced counter.
template <int KB>
LC_HD int level_value(const uint32_t* L, int bit) {
  int v = 0;
  LC_UNROLL
  for (int k = 0; k < KB; ++k) v |= static_cast<int>((L[k] >> bit) & 1u) << k;
  return v;
}

// Δ of the 8 elements of byte `sel` of a word from its majority masks (e0: bucket index
// of the first of the 8 elements).
LC_HD void majority_delta8(uint32_t pos, uint32_t neg, uint32_t tie, int sel, const lc_apply_args& a, int64_t e0,
                           float d[8]) {
  const uint32_t sh = 8u * static_cast<uint32_t>(sel);
  const uint32_t pb = (pos >> sh) & 0xffu, nb = (neg >> sh) & 0xffu, tb = (tie >> sh) & 0xffu;
  // the tie row once per unit, and only when one of its elements ties under the hash rule
  const TieRun run = (tb && a.tie == LC_TIE_HASH) ? tie_run(a.tie_rows, a.tie_nrows, e0) : TieRun{0u, e0, e0};
  LC_UNROLL
  for (int i = 0; i < 8; ++i) {
    float v = 0.0f;
    if ((pb >> i) & 1u) v = 1.0f;
    else if ((nb >> i) & 1u) v = -1.0f;
    else if ((tb >> i) & 1u) v = tie_value_in(a, run, e0 + i);
    d[i] = v;
  }
}

// Average Δ of the 8 elements of byte `sel`: (float)(2p - c) / (float)world_size.
template <int KB>
LC_HD void average_delta8(const uint32_t* P, const uint32_t* C, int sel, const lc_apply_args& a, float d[8]) {
  LC_UNROLL
  for (int i = 0; i < 8; ++i) {
    const int bit = 8 * sel + i;
    const int diff = 2 * level_value<KB>(P, bit) - level_value<KB>(C, bit);
    d[i] = fdiv(static_cast<float>(diff), static_cast<float>(a.world_size));
  }
}

// Result planes of a majority shard vote for one word: sign (Δ > 0) and nonzero (Δ != 0);
// e0: shard position of the word's first element; rows / nrows: the shard's tie-index table.
LC_HD void shard_word(uint32_t pos, uint32_t neg, uint32_t tie, int tie_rule, int64_t step, int64_t e0,
                      const int64_t* rows, int64_t nrows, uint32_t& out_sign, uint32_t& out_nz) {
  uint32_t tplus = 0u, tminus = 0u;
  if (tie_rule == LC_TIE_ALTERNATE) {
    if (step & 1) tplus = tie;
    else tminus = tie;
  } else if (tie_rule == LC_TIE_HASH && tie) {
    const TieRun run = tie_run(rows, nrows, e0);  // once per word (32 elements), only tied bits hashed
    uint32_t m = tie;
    while (m) {
      const int b = ctz32(m);
      m &= m - 1u;
      if (lcc::tie_hash(static_cast<uint64_t>(step), tie_index_in(run, rows, nrows, e0 + b)) & 1u) tplus |= 1u << b;
    }
    tminus = tie & ~tplus;
  }
  out_sign = pos | tplus;
  out_nz = pos | neg | tplus | tminus;
}

// ----------------------------------------------------------------------------- comm="bbit"
// The counts of word w over `rows` ranks' code planes ([rows, BITS, row_bytes]) and nonzero planes
// ([rows, row_bytes] or NULL: every rank votes): P[j] = #(bit j of the code & nonzero), C = #nonzero
// (or rows), as bit-sliced counters. The words of 4 ranks are loaded before they are added.
template <int KB, int BITS>
LC_HD void bbit_count_word(const uint8_t* __restrict__ planes, const uint8_t* __restrict__ nonzero, int rows,
                           int64_t row_bytes, int64_t w, bool aligned, uint32_t (&P)[BITS][KB], uint32_t (&C)[KB]) {
  LC_UNROLL
  for (int k = 0; k < KB; ++k) {
    C[k] = nonzero ? 0u : (((rows >> k) & 1) ? 0xffffffffu : 0u);
    LC_UNROLL
    for (int j = 0; j < BITS; ++j) P[j][k] = 0u;
  }
  if (nonzero) {
    LC_UNROLL_4
    for (int r = 0; r < rows; ++r) {
      const uint32_t z = load_word(nonzero + static_cast<int64_t>(r) * row_bytes, w, row_bytes, aligned);
      uint32_t x[BITS];
      LC_UNROLL
      for (int j = 0; j < BITS; ++j)
        x[j] = load_word(planes + (static_cast<int64_t>(r) * BITS + j) * row_bytes, w, row_bytes, aligned);
      slice_add<KB>(C, z);
      LC_UNROLL
      for (int j = 0; j < BITS; ++j) slice_add<KB>(P[j], x[j] & z);
    }
  } else {
    LC_UNROLL_4
    for (int r = 0; r < rows; ++r) {
      uint32_t x[BITS];
      LC_UNROLL
      for (int j = 0; j < BITS; ++j)
        x[j] = load_word(planes + (static_cast<int64_t>(r) * BITS + j) * row_bytes, w, row_bytes, aligned);
      LC_UNROLL
      for (int j = 0; j < BITS; ++j) slice_add<KB>(P[j], x[j]);
    }
  }
}

// acc += b over W bit-sliced levels (the sum fits W levels).
template <int W>
LC_HD void slice_sum(uint32_t (&acc)[W], const uint32_t (&b)[W]) {
  uint32_t carry = 0u;
  LC_UNROLL
  for (int k = 0; k < W; ++k) {
    const uint32_t x = acc[k], y = b[k];
    acc[k] = x ^ y ^ carry;
    carry = (x & y) | (carry & (x ^ y));
  }
}

// The masks of the word's 32 elements from those counts: pos (Σq > 0), neg (Σq < 0) and tie (Σq == 0
// with a voter), Σq = Σ over voting ranks of 2k - Q = 2·S − Q·C with S = Σ_j 2^j·P_j
// (reference.decide_sum), for all 32 elements at once in bit-sliced integers: b = 1 (Q = 1) compares
// X = 2S with Y = C; b >= 2 (Q = 2^b − 2, so Σq = 2·(S + C − 2^(b−1)·C)) compares X = S + C with
// Y = 2^(b−1)·C. X, Y < 2^(KB+b): KB + BITS levels. Exact integers: the same masks as element by element.
template <int KB, int BITS>
LC_HD void bbit_masks(const uint32_t (&P)[BITS][KB], const uint32_t (&C)[KB], uint32_t& pos, uint32_t& neg,
                      uint32_t& tie) {
  constexpr int W = KB + BITS;
  uint32_t X[W], Y[W];
  if (BITS == 1) {
    LC_UNROLL
    for (int k = 0; k < W; ++k) {
      X[k] = k >= 1 && k - 1 < KB ? P[0][k - 1] : 0u;
      Y[k] = k < KB ? C[k] : 0u;
    }
  } else {
    LC_UNROLL
    for (int k = 0; k < W; ++k) {
      X[k] = k < KB ? C[k] : 0u;
      Y[k] = k >= BITS - 1 && k - (BITS - 1) < KB ? C[k - (BITS - 1)] : 0u;
    }
    LC_UNROLL
    for (int j = 0; j < BITS; ++j) {
      uint32_t T[W];
      LC_UNROLL
      for (int k = 0; k < W; ++k) T[k] = k >= j && k - j < KB ? P[j][k - j] : 0u;
      slice_sum<W>(X, T);
    }
  }
  uint32_t gt = 0u, lt = 0u, eq = 0xffffffffu, any = 0u;
  LC_UNROLL
  for (int k = W - 1; k >= 0; --k) {
    gt |= eq & X[k] & ~Y[k];
    lt |= eq & ~X[k] & Y[k];
    eq &= ~(X[k] ^ Y[k]);
  }
  LC_UNROLL
  for (int k = 0; k < KB; ++k) any |= C[k];
  pos = gt;
  neg = lt;
  tie = eq & any;
}

// ----------------------------------------------------------------------------- lanes
LC_HD uint32_t spread2(uint32_t x) {  // bit i of the low 16 -> bit 2i
  x &= 0xffffu;
  x = (x | (x << 8)) & 0x00ff00ffu;
  x = (x | (x << 4)) & 0x0f0f0f0fu;
  x = (x | (x << 2)) & 0x33333333u;
  x = (x | (x << 1)) & 0x55555555u;
  return x;
}
LC_HD uint32_t spread4(uint32_t x) {  // bit i of the low 8 -> bit 4i
  x &= 0xffu;
  x = (x | (x << 12)) & 0x000f000fu;
  x = (x | (x << 6)) & 0x03030303u;
  x = (x | (x << 3)) & 0x11111111u;
  return x;
}
LC_HD uint32_t spread8(uint32_t x) {  // bit i of the low 4 -> bit 8i
  x &= 0xfu;
  x = (x | (x << 14)) & 0x00030003u;
  x = (x | (x << 7)) & 0x01010101u;
  return x;
}

// 32 counters (bit-sliced, KB levels) -> p-bit lanes, LSB first: p words out[0..p-1].
template <int KB>
LC_HD void pack_lanes_word(const uint32_t* L, int p, uint32_t out[8]) {
#define LC_LVL(k) ((k) < KB ? L[(k) < KB ? (k) : 0] : 0u)
  if (p == 1) {
    out[0] = L[0];
  } else if (p == 2) {
    LC_UNROLL
    for (int q = 0; q < 2; ++q) out[q] = spread2(LC_LVL(0) >> (16 * q)) | (spread2(LC_LVL(1) >> (16 * q)) << 1);
  } else if (p == 4) {
    LC_UNROLL
    for (int q = 0; q < 4; ++q) {
      uint32_t o = 0u;
      LC_UNROLL
      for (int k = 0; k < 4; ++k) o |= spread4(LC_LVL(k) >> (8 * q)) << k;
      out[q] = o;
    }
  } else {
    LC_UNROLL
    for (int q = 0; q < 8; ++q) {
      uint32_t o = 0u;
      LC_UNROLL
      for (int k = 0; k < 8; ++k) o |= spread8(LC_LVL(k) >> (4 * q)) << k;
      out[q] = o;
    }
  }
#undef LC_LVL
}

// Write the bytes [b0, b0 + nb) of a little-endian word array (out bytes past `limit`
// are not written). `aligned`: dst + b0 is 4-byte aligned and nb % 4 == 0.
LC_HD void store_words(uint8_t* __restrict__ dst, int64_t b0, int64_t limit, const uint32_t* words, int nwords,
                       bool aligned) {
  if (aligned && b0 + 4 * nwords <= limit) {
    uint32_t* d = reinterpret_cast<uint32_t*>(dst + b0);
    LC_UNROLL
    for (int q = 0; q < 8; ++q)
      if (q < nwords) d[q] = words[q];
    return;
  }
  LC_UNROLL
  for (int q = 0; q < 8; ++q) {
    if (q < nwords) {
      LC_UNROLL
      for (int b = 0; b < 4; ++b)
        if (b0 + 4 * q + b < limit) dst[b0 + 4 * q + b] = static_cast<uint8_t>(words[q] >> (8 * b));
    }
  }
}

// p*(n elements)/8 lane bytes of unit u (8 elements) as one integer, LSB first.
LC_HD uint64_t load_lane_unit(const uint8_t* __restrict__ lanes, int64_t u, int p, int n) {
  const uint8_t* src = lanes + u * p;
  if (n == 8 && (reinterpret_cast<uintptr_t>(src) & static_cast<uintptr_t>(p - 1)) == 0) {
    switch (p) {
      case 1: return src[0];
      case 2: return *reinterpret_cast<const uint16_t*>(src);
      case 4: return *reinterpret_cast<const uint32_t*>(src);
      default: return *reinterpret_cast<const unsigned long long*>(src);
    }
  }
  const int nb = (n * p + 7) / 8;
  uint64_t x = 0;
  for (int b = 0; b < nb; ++b) x |= static_cast<uint64_t>(src[b]) << (8 * b);
  return x;
}

// Δ of unit u (elements 8u.., n <= 8 of them) from its summed p-bit lanes as loaded (xp, and xc when
// has_cnt, else every element has a.world_size voters; reference.lanes_apply).
LC_HD void lanes_delta8(uint64_t xp, uint64_t xc, bool has_cnt, int64_t u, int n, int p, const lc_apply_args& a,
                        float d[8]) {
  const uint64_t mask = (1ull << p) - 1ull;
  TieRun run{0u, u * 8, u * 8};
  bool have = false;
  LC_UNROLL
  for (int i = 0; i < 8; ++i) {
    if (i < n) {
      const int pl = static_cast<int>((xp >> (i * p)) & mask);
      const int c = has_cnt ? static_cast<int>((xc >> (i * p)) & mask) : a.world_size;
      d[i] = decide(pl, c, a, u * 8 + i, u * 8, run, have);
    } else {
      d[i] = 0.0f;
    }
  }
}

// ----------------------------------------------------------------------------- int8 apply
// The 8 int8 codes of the unit at e0 (n <= 8 of them; the others 0) as one little-endian integer.
LC_HD uint64_t load_q8(const int8_t* __restrict__ qsum, int64_t e0, int n) {
  const int8_t* p = qsum + e0;
  if (n == 8 && (reinterpret_cast<uintptr_t>(p) & 7u) == 0) {
    const uint2 x = *reinterpret_cast<const uint2*>(p);
    return static_cast<uint64_t>(x.x) | (static_cast<uint64_t>(x.y) << 32);
  }
  uint64_t x = 0;
  LC_UNROLL
  for (int i = 0; i < 8; ++i)
    if (i < n) x |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return x;
}

// Δ = sign of each of the 8 codes (reference.int8_apply).
LC_HD void q8_delta(uint64_t x, float d[8]) {
  LC_UNROLL
  for (int i = 0; i < 8; ++i) {
    const int8_t q = static_cast<int8_t>(static_cast<uint8_t>(x >> (8 * i)));
    d[i] = q > 0 ? 1.0f : (q < 0 ? -1.0f : 0.0f);
  }
}

}  // namespace lc

#endif  // LIONCUB_CUDA_VOTE_CUH_
