// lioncub_cpu_vote.inl -- kernel body of the vote half: vote counting (bit-sliced counters),
// decisions (reference.decide, tie rules via the tie-index table), apply; (c) vote_apply,
// (d) shard_vote, (e) count_lanes, (f) lanes_apply, (h) int8_apply, (j) the ZeRO sign apply, (l) the
// bbit shard vote. Compiled once per ISA.

namespace {

// ------------------------------------------------------------------ vote counting
inline uint64_t load_word(const uint8_t* p, int64_t avail) {
  uint64_t w = 0;
  if (avail >= 8) {
    std::memcpy(&w, p, 8);
  } else {
    for (int64_t b = 0; b < avail; ++b) w |= static_cast<uint64_t>(p[b]) << (8 * b);
  }
  return w;
}

// Add one bit plane x into bit-sliced counters C[0..nb) (ripple carry, branch-free).
template <int NB>
inline void bs_add(uint64_t* C, int nbits, uint64_t x) {
  const int nb = NB > 0 ? NB : nbits;
  for (int b = 0; b < nb; ++b) {
    const uint64_t t = C[b] & x;
    C[b] ^= x;
    x = t;
  }
}

// Bit-sliced counters of 64 elements -> one int32 count per element.
template <int NB>
inline void bs_extract(const uint64_t* C, int nbits, int32_t* out) {
  const int nb = NB > 0 ? NB : nbits;
  const uint64_t* sp = spread();
  alignas(64) uint8_t lo[64];
  const int nlo = std::min(nb, 8);
  for (int q = 0; q < 8; ++q) {
    uint64_t l = 0;
    for (int b = 0; b < nlo; ++b) l += sp[(C[b] >> (8 * q)) & 0xFF] << b;
    std::memcpy(lo + 8 * q, &l, 8);
  }
  if (nb <= 8) {
    for (int j = 0; j < 64; ++j) out[j] = lo[j];
  } else {
    alignas(64) uint8_t hi[64];
    for (int q = 0; q < 8; ++q) {
      uint64_t h = 0;
      for (int b = 8; b < nb; ++b) h += sp[(C[b] >> (8 * q)) & 0xFF] << (b - 8);
      std::memcpy(hi + 8 * q, &h, 8);
    }
    for (int j = 0; j < 64; ++j) out[j] = static_cast<int32_t>(lo[j]) | (static_cast<int32_t>(hi[j]) << 8);
  }
}

inline int bit_length(int64_t n) {
  int b = 0;
  while (n > 0) {
    ++b;
    n >>= 1;
  }
  return std::max(b, 1);
}

// Vote counts of elements [e0, e0+n) (e0 % 64 == 0) of N planes of B bytes each: bit-sliced
// counters over whole 64-bit words (N planes -> ceil(log2(N+1)) counter planes), then one
// extraction per counter plane (not per rank).
struct PlaneCounter {
  const uint8_t* sign;
  const uint8_t* nz;  // nullable
  int64_t N, B;
  int nbits;

  template <int NB, bool NZ>
  void count_t(int64_t e0, int64_t n, int32_t* plus, int32_t* cnt) const {
    const int nb = NB > 0 ? NB : nbits;
    for (int64_t w0 = 0; w0 < n; w0 += 64) {
      const int64_t byte0 = (e0 + w0) >> 3;
      const int64_t avail = B - byte0;
      uint64_t P[NB > 0 ? NB : 16], C[NB > 0 ? NB : 16];
      for (int b = 0; b < nb; ++b) P[b] = C[b] = 0;
      const uint8_t* sp = sign + byte0;
      const uint8_t* zp = NZ ? nz + byte0 : nullptr;
      for (int64_t r = 0; r < N; ++r, sp += B) {
        uint64_t sw = load_word(sp, avail);
        if constexpr (NZ) {
          const uint64_t zw = load_word(zp, avail);
          zp += B;
          sw &= zw;
          bs_add<NB>(C, nb, zw);
        }
        bs_add<NB>(P, nb, sw);
      }
      if constexpr (NZ) bs_extract<NB>(C, nb, cnt + w0);
      bs_extract<NB>(P, nb, plus + w0);
    }
  }

  void count(int64_t e0, int64_t n, int32_t* plus, int32_t* cnt) const {
    const bool z = nz != nullptr;
    switch (nbits) {
      case 1: z ? count_t<1, true>(e0, n, plus, cnt) : count_t<1, false>(e0, n, plus, cnt); break;
      case 2: z ? count_t<2, true>(e0, n, plus, cnt) : count_t<2, false>(e0, n, plus, cnt); break;
      case 3: z ? count_t<3, true>(e0, n, plus, cnt) : count_t<3, false>(e0, n, plus, cnt); break;
      case 4: z ? count_t<4, true>(e0, n, plus, cnt) : count_t<4, false>(e0, n, plus, cnt); break;
      default: z ? count_t<0, true>(e0, n, plus, cnt) : count_t<0, false>(e0, n, plus, cnt); break;
    }
  }
};

// ------------------------------------------------------------------ decisions (reference.decide)
struct DecideArgs {
  int32_t vote, tie;
  float world_f;    // (float)world_size, the average divisor
  uint64_t step;    // hash tie rule
  int32_t alt;      // +1 on odd steps, -1 on even steps
  const int64_t* tie_rows;  // tie-index table (lcc::tie_index)
  int64_t tie_nrows;
};

// Δ of n elements whose tie indices are idx0, idx0 + 1, ... (one tie-index segment).
template <int VOTE, int TIE, bool HASCNT>
inline void decide_t(const int32_t* __restrict plus, const int32_t* __restrict cnt, int32_t cnt_const, int64_t n,
                     const DecideArgs& a, uint64_t idx0, float* __restrict delta) {
  if constexpr (VOTE == kAverage) {
    const float w = a.world_f;
    for (int64_t j = 0; j < n; ++j) {
      const int32_t c = HASCNT ? cnt[j] : cnt_const;
      const int32_t d = 2 * plus[j] - c;
      delta[j] = static_cast<float>(d) / w;
    }
  } else {
    const uint32_t lo0 = static_cast<uint32_t>(idx0);
    const uint32_t hb = tie_hash_base(a.step, static_cast<uint32_t>(idx0 >> 32));
    const int32_t alt = a.alt;
    for (int64_t j = 0; j < n; ++j) {
      const int32_t c = HASCNT ? cnt[j] : cnt_const;
      const int32_t d = 2 * plus[j] - c;
      int32_t s = (d > 0) - (d < 0);
      // branch-free so that the loop vectorizes: s == 0 exactly where d == 0
      if constexpr (TIE == kTieAlternate) {
        const int32_t tie = static_cast<int32_t>(d == 0) & static_cast<int32_t>(c > 0);
        s += tie * alt;
      } else if constexpr (TIE == kTieHash) {
        // the caller guarantees one high word over the run: lo(idx0) + n - 1 does not wrap
        const int32_t tie = static_cast<int32_t>(d == 0) & static_cast<int32_t>(c > 0);
        const uint32_t h = tie_hash_mix((lo0 + static_cast<uint32_t>(j)) * 0x9E3779B1u + hb);
        const int32_t hv = static_cast<int32_t>((h & 1u) << 1) - 1;
        s += tie * hv;
      }
      delta[j] = static_cast<float>(s);
    }
  }
}

template <int VOTE, int TIE, bool HASCNT>
inline void decide_seg(const int32_t* plus, const int32_t* cnt, int32_t cnt_const, int64_t n, const DecideArgs& a,
                       int64_t e0, float* delta) {
  if constexpr (TIE != kTieHash) {
    decide_t<VOTE, TIE, HASCNT>(plus, cnt, cnt_const, n, a, 0, delta);
  } else {
    // split [e0, e0 + n) where a new tie-index segment starts (a parameter boundary) and where the
    // low 32 bits of the index wrap (so each run has one high word)
    int64_t j = 0;
    while (j < n) {
      const int64_t pos = e0 + j;
      const int64_t next = tie_next_start(a.tie_rows, a.tie_nrows, pos);
      const uint64_t idx = tie_index(a.tie_rows, a.tie_nrows, pos);
      const int64_t to_wrap = static_cast<int64_t>(0x100000000ull - (idx & 0xFFFFFFFFull));
      const int64_t len = std::min(std::min(n - j, next - pos), to_wrap);
      decide_t<VOTE, TIE, HASCNT>(plus + j, HASCNT ? cnt + j : cnt, cnt_const, len, a, idx, delta + j);
      j += len;
    }
  }
}

inline void decide(const int32_t* plus, const int32_t* cnt, int32_t cnt_const, int64_t n, const DecideArgs& a,
                   int64_t e0, float* delta) {
  const bool hc = cnt != nullptr;
  if (a.vote == kAverage) {
    if (hc) decide_seg<kAverage, kTieZero, true>(plus, cnt, cnt_const, n, a, e0, delta);
    else decide_seg<kAverage, kTieZero, false>(plus, cnt, cnt_const, n, a, e0, delta);
    return;
  }
  // Without per-element voter counts and with an odd count, 2*plus - cnt is never 0: no tie can
  // occur, so the (identical) tie-free loop is used.
  const int32_t tie = (!hc && (cnt_const & 1)) ? static_cast<int32_t>(kTieZero) : a.tie;
  switch (tie) {
    case kTieAlternate:
      if (hc) decide_seg<kMajority, kTieAlternate, true>(plus, cnt, cnt_const, n, a, e0, delta);
      else decide_seg<kMajority, kTieAlternate, false>(plus, cnt, cnt_const, n, a, e0, delta);
      break;
    case kTieHash:
      if (hc) decide_seg<kMajority, kTieHash, true>(plus, cnt, cnt_const, n, a, e0, delta);
      else decide_seg<kMajority, kTieHash, false>(plus, cnt, cnt_const, n, a, e0, delta);
      break;
    default:
      if (hc) decide_seg<kMajority, kTieZero, true>(plus, cnt, cnt_const, n, a, e0, delta);
      else decide_seg<kMajority, kTieZero, false>(plus, cnt, cnt_const, n, a, e0, delta);
      break;
  }
}

DecideArgs make_decide_args(int32_t vote, int32_t tie, int64_t world_size, int64_t step, const int64_t* tie_rows,
                            int64_t tie_nrows) {
  DecideArgs a;
  a.vote = vote;
  a.tie = tie;
  a.world_f = static_cast<float>(static_cast<double>(world_size));
  a.step = static_cast<uint64_t>(step);
  a.alt = (step & 1) ? 1 : -1;
  a.tie_rows = tie_rows;
  a.tie_nrows = tie_nrows;
  return a;
}

// ------------------------------------------------------------------ majority straight from the counters
// For the majority vote the decision needs no per-element counts: with bit-sliced counters P (plus)
// and C (voters) of 64 elements, Δ > 0 where 2P > C, Δ < 0 where 2P < C and a tie where 2P == C
// and C > 0 -- all computed with a few whole-word operations, then the tie rule fills the ties.

// mask of elements whose bit-sliced counter P (nb bits) is >= the constant k
inline uint64_t bs_ge_const(const uint64_t* P, int nb, int64_t k) {
  if (k <= 0) return ~uint64_t(0);
  if (k >> nb) return 0;
  uint64_t gt = 0, eq = ~uint64_t(0);
  for (int b = nb - 1; b >= 0; --b) {
    if ((k >> b) & 1) {
      eq &= P[b];
    } else {
      gt |= eq & P[b];
      eq &= ~P[b];
    }
  }
  return gt | eq;
}

// 64 tie-break bits of reference.tie_hash_sign (1 = +1) for positions e .. e+63 under a tie-index table.
inline uint64_t hash_bits64(uint64_t step, const int64_t* rows, int64_t nrows, int64_t e) {
  alignas(64) uint32_t hv[64];
  tie_hashes64(step, rows, nrows, e, hv);
  uint32_t lo = 0, hi = 0;
  for (int j = 0; j < 32; ++j) lo |= (hv[j] & 1u) << j;
  for (int j = 0; j < 32; ++j) hi |= (hv[32 + j] & 1u) << j;
  return static_cast<uint64_t>(lo) | (static_cast<uint64_t>(hi) << 32);
}

// Δ of 64 elements as float -1/0/+1 from the final (pos, neg) masks.
inline void expand_delta32(uint32_t p, uint32_t q, float* __restrict d) {
  for (int j = 0; j < 32; ++j)
    d[j] = static_cast<float>(static_cast<int32_t>((p >> j) & 1u) - static_cast<int32_t>((q >> j) & 1u));
}
inline void expand_delta(uint64_t pos, uint64_t neg, float* __restrict d) {
#if LC_AVX2
  // variable shifts vectorize with AVX2
  expand_delta32(static_cast<uint32_t>(pos), static_cast<uint32_t>(neg), d);
  expand_delta32(static_cast<uint32_t>(pos >> 32), static_cast<uint32_t>(neg >> 32), d + 32);
#else
  // baseline: bytes of 0/1 from the spread table, then a plain (vectorizable) conversion
  const uint64_t* sp = spread();
  alignas(64) uint8_t pb[64], nb[64];
  for (int q = 0; q < 8; ++q) {
    std::memcpy(pb + 8 * q, &sp[(pos >> (8 * q)) & 0xFF], 8);
    std::memcpy(nb + 8 * q, &sp[(neg >> (8 * q)) & 0xFF], 8);
  }
  for (int j = 0; j < 64; ++j) d[j] = static_cast<float>(static_cast<int32_t>(pb[j]) - static_cast<int32_t>(nb[j]));
#endif
}

// The tie rule on the tied elements `ties` of the 64 starting at position e: "alternate" and "hash" add
// them to pos or neg ("zero" leaves them at 0).
inline void break_ties(int32_t tie, int32_t alt, uint64_t step, const int64_t* rows, int64_t nrows, int64_t e,
                       uint64_t ties, uint64_t& pos, uint64_t& neg) {
  if (!ties) return;
  if (tie == kTieAlternate) {
    if (alt > 0) pos |= ties; else neg |= ties;
  } else if (tie == kTieHash) {
    const uint64_t hb = hash_bits64(step, rows, nrows, e);
    pos |= ties & hb;
    neg |= ties & ~hb;
  }
}

struct MajorityCounter {
  const uint8_t* sign;
  const uint8_t* nz;  // nullable
  int64_t N, B;
  int nbits;
  int32_t tie;
  uint64_t step;
  int32_t alt;
  const int64_t* tie_rows;  // tie-index table (lcc::tie_index)
  int64_t tie_nrows;

  // final (pos, neg) masks of the 64 elements starting at element e (e % 64 == 0)
  template <int NB, bool NZ>
  inline void word_t(int64_t e, uint64_t& pos_out, uint64_t& neg_out) const {
    const int nb = NB > 0 ? NB : nbits;
    const int64_t byte0 = e >> 3;
    const int64_t avail = B - byte0;
    uint64_t P[NB > 0 ? NB : 16], C[NB > 0 ? NB : 16];
    for (int b = 0; b < nb; ++b) P[b] = C[b] = 0;
    const uint8_t* sp = sign + byte0;
    const uint8_t* zp = NZ ? nz + byte0 : nullptr;
    for (int64_t r = 0; r < N; ++r, sp += B) {
      uint64_t sw = load_word(sp, avail);
      if constexpr (NZ) {
        const uint64_t zw = load_word(zp, avail);
        zp += B;
        sw &= zw;
        bs_add<NB>(C, nb, zw);
      }
      bs_add<NB>(P, nb, sw);
    }
    uint64_t pos, neg, ties;
    if constexpr (NZ) {
      // compare Q = 2P (nb+1 bits) with C (nb bits), most significant bit first
      uint64_t gt = 0, lt = 0, eq = ~uint64_t(0), any = 0;
      for (int b = nb; b >= 0; --b) {
        const uint64_t q = b >= 1 ? P[b - 1] : 0;
        const uint64_t c = b < nb ? C[b] : 0;
        gt |= eq & q & ~c;
        lt |= eq & ~q & c;
        eq &= ~(q ^ c);
      }
      for (int b = 0; b < nb; ++b) any |= C[b];
      pos = gt;
      neg = lt;
      ties = eq & any;
    } else {
      pos = bs_ge_const(P, nb, N / 2 + 1);       // 2P > N
      neg = ~bs_ge_const(P, nb, (N + 1) / 2);    // 2P < N
      ties = (N & 1) ? 0 : ~(pos | neg);         // 2P == N (N >= 1 voters)
    }
    break_ties(tie, alt, step, tie_rows, tie_nrows, e, ties, pos, neg);
    pos_out = pos;
    neg_out = neg;
  }

  inline void word(int64_t e, uint64_t& pos, uint64_t& neg) const {
    const bool z = nz != nullptr;
    switch (nbits) {
      case 1: z ? word_t<1, true>(e, pos, neg) : word_t<1, false>(e, pos, neg); break;
      case 2: z ? word_t<2, true>(e, pos, neg) : word_t<2, false>(e, pos, neg); break;
      case 3: z ? word_t<3, true>(e, pos, neg) : word_t<3, false>(e, pos, neg); break;
      case 4: z ? word_t<4, true>(e, pos, neg) : word_t<4, false>(e, pos, neg); break;
      default: z ? word_t<0, true>(e, pos, neg) : word_t<0, false>(e, pos, neg); break;
    }
  }
};

MajorityCounter make_majority(const uint8_t* sign, const uint8_t* nonzero, int64_t nplanes, int64_t bytes,
                              int32_t tie, int64_t step, const int64_t* tie_rows, int64_t tie_nrows) {
  MajorityCounter mc;
  mc.sign = sign;
  mc.nz = nonzero;
  mc.N = nplanes;
  mc.B = bytes;
  mc.nbits = bit_length(nplanes);
  mc.tie = tie;
  mc.step = static_cast<uint64_t>(step);
  mc.alt = (step & 1) ? 1 : -1;
  mc.tie_rows = tie_rows;
  mc.tie_nrows = tie_nrows;
  return mc;
}

// ------------------------------------------------------------------ apply (reference.apply_update)
template <int PT, bool DECAY>
inline void apply_range_t(void* p, int64_t i0, const float* d, int64_t n, float df, float nl) {
  if constexpr (PT == kF32) {
    float* t = static_cast<float*>(p) + i0;
    for (int64_t j = 0; j < n; ++j) {
      float v = t[j];
      if constexpr (DECAY) v = v * df;
      const float x = d[j] * nl;
      t[j] = v + x;
    }
  } else {
    uint16_t* t = static_cast<uint16_t*>(p) + i0;
    for (int64_t j = 0; j < n; ++j) {
      float v = bf16_to_f32(t[j]);
      if constexpr (DECAY) v = round_bf16(v * df);
      const float x = d[j] * nl;
      t[j] = f32_to_bf16(v + x);
    }
  }
}

inline void apply_range(const Slot& s, int64_t i0, const float* d, int64_t n, bool decay, float df, float nl) {
  if (s.dtype == kF32) {
    if (decay) apply_range_t<kF32, true>(s.data, i0, d, n, df, nl);
    else apply_range_t<kF32, false>(s.data, i0, d, n, df, nl);
  } else {
    if (decay) apply_range_t<kBF16, true>(s.data, i0, d, n, df, nl);
    else apply_range_t<kBF16, false>(s.data, i0, d, n, df, nl);
  }
}

// Runs prod(e0, n, delta) for every block of kBlk bucket elements that a parameter covers (all
// blocks when delta_out is given), writes Δ to delta_out and applies it to the parameters.
template <class Prod>
void apply_driver(int64_t numel, const Slot* params, int64_t nparams, const ApplyArgs& args, float* delta_out,
                  int nthreads, const Prod& prod) {
  if (numel <= 0) return;
  const bool decay = args.apply_decay != 0;
  const float df = args.decay;
  const float nl = args.neg_lr;
  std::vector<int64_t> order;
  order.reserve(nparams);
  for (int64_t i = 0; i < nparams; ++i)
    if (params[i].numel > 0) order.push_back(i);
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return params[a].offset < params[b].offset; });
  const int64_t nblocks = divup(numel, kBlk);
  std::vector<int64_t> blocks;
  int64_t work = 0;
  if (delta_out) {
    blocks.resize(nblocks);
    for (int64_t b = 0; b < nblocks; ++b) blocks[b] = b;
    work = numel;
  } else {
    std::vector<char> need(nblocks, 0);
    for (int64_t i : order) {
      const int64_t b0 = params[i].offset / kBlk, b1 = (params[i].offset + params[i].numel - 1) / kBlk;
      for (int64_t b = b0; b <= b1; ++b) need[b] = 1;
      work += params[i].numel;
    }
    for (int64_t b = 0; b < nblocks; ++b)
      if (need[b]) blocks.push_back(b);
  }
  // first[b]: index into `order` of the first parameter that ends after block b starts.
  // Work items of kGroup blocks, scheduled dynamically (robust when a core is busy elsewhere).
  constexpr int64_t kGroup = 16;
  const int64_t nitems = divup(static_cast<int64_t>(blocks.size()), kGroup);
  parallel_for_dynamic(nitems, threads_for(work, nthreads), [&](int64_t item) {
    alignas(64) float delta[kBlk];
    const int64_t bend = std::min<int64_t>(static_cast<int64_t>(blocks.size()), (item + 1) * kGroup);
    for (int64_t bi = item * kGroup; bi < bend; ++bi) {
      const int64_t e0 = blocks[bi] * kBlk;
      const int64_t n = std::min(kBlk, numel - e0);
      prod(e0, n, delta);
      if (delta_out) std::memcpy(delta_out + e0, delta, sizeof(float) * n);
      // parameters overlapping [e0, e0 + n)
      auto it = std::partition_point(order.begin(), order.end(), [&](int64_t i) {
        return params[i].offset + params[i].numel <= e0;
      });
      for (; it != order.end(); ++it) {
        const Slot& s = params[*it];
        if (s.offset >= e0 + n) break;
        const int64_t lo = std::max(e0, s.offset), hi = std::min(e0 + n, s.offset + s.numel);
        if (hi > lo) apply_range(s, lo - s.offset, delta + (lo - e0), hi - lo, decay, df, nl);
      }
    }
  });
}

}  // namespace

// ------------------------------------------------------------------ (c) vote_apply
void vote_apply_impl(const uint8_t* sign, const uint8_t* nonzero, int64_t nplanes, int64_t plane_bytes,
                     const Slot* params, int64_t nparams, const ApplyArgs& args, float* delta_out, int nthreads) {
  if (args.vote == kMajority) {
    const MajorityCounter mc = make_majority(sign, nonzero, nplanes, plane_bytes, args.tie, args.step, args.tie_rows,
                                              args.tie_nrows);
    auto prod = [&](int64_t e0, int64_t n, float* delta) {
      for (int64_t w0 = 0; w0 < n; w0 += 64) {  // delta has room for whole words (kBlk % 64 == 0)
        uint64_t pos, neg;
        mc.word(e0 + w0, pos, neg);
        expand_delta(pos, neg, delta + w0);
      }
    };
    apply_driver(plane_bytes * 8, params, nparams, args, delta_out, nthreads, prod);
    return;
  }
  const PlaneCounter pc{sign, nonzero, nplanes, plane_bytes, bit_length(nplanes)};
  const DecideArgs da =
      make_decide_args(args.vote, args.tie, args.world_size, args.step, args.tie_rows, args.tie_nrows);
  const int32_t cnt_const = static_cast<int32_t>(nplanes);
  auto prod = [&](int64_t e0, int64_t n, float* delta) {
    alignas(64) int32_t plus[kBlk], cnt[kBlk];
    pc.count(e0, n, plus, nonzero ? cnt : nullptr);
    decide(plus, nonzero ? cnt : nullptr, cnt_const, n, da, e0, delta);
  };
  apply_driver(plane_bytes * 8, params, nparams, args, delta_out, nthreads, prod);
}

// ------------------------------------------------------------------ (d) shard_vote
void shard_vote_impl(const uint8_t* sign, const uint8_t* nonzero, int64_t nplanes, int64_t shard_bytes,
                     int64_t step, int32_t tie, const int64_t* tie_rows, int64_t tie_nrows, uint8_t* out_sign,
                     uint8_t* out_nonzero, int nthreads) {
  const int64_t numel = shard_bytes * 8;
  if (numel <= 0) return;
  const MajorityCounter mc = make_majority(sign, nonzero, nplanes, shard_bytes, tie, step, tie_rows, tie_nrows);
  const int64_t nblocks = divup(numel, kBlk);
  parallel_for_static(nblocks, threads_for(numel * nplanes / 4, nthreads), [&](int64_t b) {
    const int64_t e0 = b * kBlk;
    const int64_t n = std::min(kBlk, numel - e0);
    for (int64_t w0 = 0; w0 < n; w0 += 64) {
      uint64_t pos, neg;
      mc.word(e0 + w0, pos, neg);
      const int nbytes = static_cast<int>(std::min<int64_t>(8, (n - w0) >> 3));
      store_bits(out_sign + ((e0 + w0) >> 3), pos, nbytes);
      store_bits(out_nonzero + ((e0 + w0) >> 3), pos | neg, nbytes);
    }
  });
}

// ------------------------------------------------------------------ (l) bbit_shard_vote
// Per word of 64 elements: bit-sliced counters of each code plane's voting bits and of the voters, then
// Σq = 2·Σ_j 2^j·P_j − Q·C per element, its sign, and the tie rule where Σq = 0 with a voter.
void bbit_shard_vote_impl(const uint8_t* planes, const uint8_t* nonzero, int64_t nplanes, int bits,
                          int64_t shard_bytes, int64_t step, int32_t tie, const int64_t* tie_rows, int64_t tie_nrows,
                          uint8_t* out_sign, uint8_t* out_nonzero, int nthreads) {
  const int64_t numel = shard_bytes * 8;
  if (numel <= 0) return;
  const int nb = bit_length(nplanes), q = bbit_qmax(bits);
  const int32_t alt = (step & 1) ? 1 : -1;
  const int64_t nwords = divup(numel, 64), per_item = 8;
  parallel_for_static(divup(nwords, per_item), threads_for(numel * nplanes * bits / 4, nthreads), [&](int64_t item) {
    for (int64_t w = item * per_item; w < std::min(nwords, (item + 1) * per_item); ++w) {
      const int64_t e = w * 64, byte0 = e >> 3, avail = shard_bytes - byte0;
      uint64_t P[4][16] = {}, C[16] = {};
      for (int64_t r = 0; r < nplanes; ++r) {
        const uint64_t zw = nonzero ? load_word(nonzero + r * shard_bytes + byte0, avail) : ~uint64_t(0);
        if (nonzero) bs_add<0>(C, nb, zw);
        for (int j = 0; j < bits; ++j)
          bs_add<0>(P[j], nb, load_word(planes + (r * bits + j) * shard_bytes + byte0, avail) & zw);
      }
      alignas(64) int32_t cnt[64], pj[64], sum[64];
      if (nonzero) bs_extract<0>(C, nb, cnt);
      else std::fill(cnt, cnt + 64, static_cast<int32_t>(nplanes));
      std::fill(sum, sum + 64, 0);
      for (int j = 0; j < bits; ++j) {
        bs_extract<0>(P[j], nb, pj);
        for (int i = 0; i < 64; ++i) sum[i] += pj[i] << j;
      }
      uint64_t pos = 0, neg = 0, ties = 0;
      for (int i = 0; i < 64; ++i) {
        const int32_t qs = 2 * sum[i] - q * cnt[i];
        pos |= static_cast<uint64_t>(qs > 0) << i;
        neg |= static_cast<uint64_t>(qs < 0) << i;
        ties |= static_cast<uint64_t>(qs == 0 && cnt[i] > 0) << i;
      }
      break_ties(tie, alt, static_cast<uint64_t>(step), tie_rows, tie_nrows, e, ties, pos, neg);
      const int nbytes = static_cast<int>(std::min<int64_t>(8, (numel - e) >> 3));
      store_bits(out_sign + byte0, pos, nbytes);
      store_bits(out_nonzero + byte0, pos | neg, nbytes);
    }
  });
}

// ------------------------------------------------------------------ (e) count_lanes
int64_t count_lanes_impl(const uint8_t* sign, const uint8_t* nonzero, int64_t nplanes, int64_t shard_bytes, int p,
                         uint8_t* plus_out, uint8_t* cnt_out, int nthreads) {
  const int64_t numel = shard_bytes * 8;
  if (numel <= 0) return 0;
  const PlaneCounter pc{sign, nonzero, nplanes, shard_bytes, bit_length(nplanes)};
  const int64_t nblocks = divup(numel, kBlk);
  const int per = 8 / p;
  std::vector<int64_t> maxc(nblocks, 0);
  parallel_for_static(nblocks, threads_for(numel * nplanes / 4, nthreads), [&](int64_t b) {
    alignas(64) int32_t plus[kBlk], cnt[kBlk];
    const int64_t e0 = b * kBlk;
    const int64_t n = std::min(kBlk, numel - e0);
    pc.count(e0, n, plus, nonzero ? cnt : nullptr);
    int32_t mx = 0;
    if (nonzero) {
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, cnt[j]);
    } else {
      mx = static_cast<int32_t>(nplanes);
    }
    maxc[b] = mx;
    const int64_t ob = e0 * p / 8;  // first output byte of the block
    const int64_t nob = n * p / 8;
    for (int64_t k = 0; k < nob; ++k) {
      uint32_t v = 0, c = 0;
      for (int t = 0; t < per; ++t) {
        v += static_cast<uint32_t>(plus[k * per + t]) << (t * p);
        if (nonzero) c += static_cast<uint32_t>(cnt[k * per + t]) << (t * p);
      }
      plus_out[ob + k] = static_cast<uint8_t>(v);
      if (nonzero) cnt_out[ob + k] = static_cast<uint8_t>(c);
    }
  });
  int64_t mx = 0;
  for (int64_t v : maxc) mx = std::max(mx, v);
  return mx;
}

// ------------------------------------------------------------------ (f) lanes_apply
void lanes_apply_impl(const uint8_t* plus, const uint8_t* cnt, int64_t lane_bytes, int p, const Slot* params,
                      int64_t nparams, const ApplyArgs& args, float* delta_out, int nthreads) {
  const int64_t numel = lane_bytes * 8 / p;
  const DecideArgs da =
      make_decide_args(args.vote, args.tie, args.world_size, args.step, args.tie_rows, args.tie_nrows);
  const int32_t cnt_const = static_cast<int32_t>(args.world_size);
  const uint32_t mask = (1u << p) - 1u;
  auto prod = [&](int64_t e0, int64_t n, float* delta) {
    alignas(64) int32_t pl[kBlk], cn[kBlk];
    if (p == 8) {
      for (int64_t j = 0; j < n; ++j) pl[j] = plus[e0 + j];
      if (cnt)
        for (int64_t j = 0; j < n; ++j) cn[j] = cnt[e0 + j];
    } else {
      const int per = 8 / p;
      const int64_t b0 = e0 / per;  // e0 is a multiple of 64, hence of per
      for (int64_t j = 0; j < n; ++j) {
        const int sh = static_cast<int>((j % per) * p);
        pl[j] = static_cast<int32_t>((static_cast<uint32_t>(plus[b0 + j / per]) >> sh) & mask);
        if (cnt) cn[j] = static_cast<int32_t>((static_cast<uint32_t>(cnt[b0 + j / per]) >> sh) & mask);
      }
    }
    decide(pl, cnt ? cn : nullptr, cnt_const, n, da, e0, delta);
  };
  apply_driver(numel, params, nparams, args, delta_out, nthreads, prod);
}

// ------------------------------------------------------------------ (h) int8_apply
void int8_apply_impl(const int8_t* qsum, int64_t numel, const Slot* params, int64_t nparams, const ApplyArgs& args,
                     float* delta_out, int nthreads) {
  auto prod = [&](int64_t e0, int64_t n, float* delta) {
    const int8_t* q = qsum + e0;
    for (int64_t j = 0; j < n; ++j) delta[j] = static_cast<float>((q[j] > 0) - (q[j] < 0));
  };
  apply_driver(numel, params, nparams, args, delta_out, nthreads, prod);
}

// ------------------------------------------------------------------ (j) ZeRO sign all-gather apply
namespace {

// The n (<= 64) bits starting at bit `bit` of `row`, LSB first (bits past n are 0); reads only the
// bytes that hold them.
inline uint64_t load_bits64(const uint8_t* row, int64_t bit, int n) {
  const uint8_t* b = row + (bit >> 3);
  const int sh = static_cast<int>(bit & 7);
  const int nbytes = (sh + n + 7) >> 3;  // 1..9
  uint64_t w = load_word(b, std::min(nbytes, 8)) >> sh;
  if (nbytes == 9) w |= static_cast<uint64_t>(b[8]) << (64 - sh);  // sh > 0 here
  return n == 64 ? w : (w & ((uint64_t(1) << n) - 1));
}

template <bool DECAY>
void zero_piece_range(const lc_zero_piece& P, const uint8_t* srow, const uint8_t* zrow, int64_t e0, int64_t e1) {
  alignas(64) float delta[64];
  float* t = reinterpret_cast<float*>(P.target);
  for (int64_t i0 = e0; i0 < e1; i0 += 64) {
    const int n = static_cast<int>(std::min<int64_t>(64, e1 - i0));
    const uint64_t s = load_bits64(srow, P.bit + i0, n);
    const uint64_t z = zrow ? load_bits64(zrow, P.bit + i0, n) : ~uint64_t(0);
    expand_delta(s & z, ~s & z, delta);  // +1 where it voted +, -1 where it voted -, 0 where it abstained
    apply_range_t<kF32, DECAY>(t, i0, delta, n, P.decay, P.neg_lr);
    if (P.cast == 0) continue;
    const float* v = t + i0;
    if (P.cast_dtype == kF32) {
      std::memcpy(reinterpret_cast<float*>(P.cast) + i0, v, sizeof(float) * n);
    } else if (P.cast_dtype == kBF16) {
      uint16_t* c = reinterpret_cast<uint16_t*>(P.cast) + i0;
      for (int j = 0; j < n; ++j) c[j] = f32_to_bf16(v[j]);
    } else {
      uint16_t* c = reinterpret_cast<uint16_t*>(P.cast) + i0;
      for (int j = 0; j < n; ++j) c[j] = f32_to_f16(v[j]);
    }
  }
}

}  // namespace

void zero_sign_apply_impl(const uint8_t* sign, int64_t sign_stride, const uint8_t* nonzero, int64_t nz_stride,
                          const ::lc_zero_piece* pieces, int64_t npieces, int nthreads) {
  struct Work {
    int64_t k, e0, e1;
  };
  std::vector<Work> items;
  int64_t work = 0;
  for (int64_t k = 0; k < npieces; ++k) {
    const int64_t n = pieces[k].numel;
    for (int64_t e0 = 0; e0 < n; e0 += kChunk) items.push_back({k, e0, std::min(n, e0 + kChunk)});
    work += n;
  }
  parallel_for_dynamic(static_cast<int64_t>(items.size()), threads_for(work, nthreads), [&](int64_t it) {
    const Work& W = items[it];
    const lc_zero_piece& P = pieces[W.k];
    const uint8_t* srow = sign + P.row * sign_stride;
    const uint8_t* zrow = nonzero ? nonzero + P.row * nz_stride : nullptr;
    if (P.apply_decay) zero_piece_range<true>(P, srow, zrow, W.e0, W.e1);
    else zero_piece_range<false>(P, srow, zrow, W.e0, W.e1);
  });
}
