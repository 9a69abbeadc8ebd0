// lioncub_cpu_isa.h -- per-instruction-set helpers of the kernel bodies (loads, stores, vote masks).
// Included by lioncub_cpu_isa_instantiate.h inside namespace isa_avx2 / isa_base, LC_AVX2 set.
// No include guard on purpose (one copy per ISA namespace).

using namespace ::lioncub::cpu::detail;
using ::lioncub::cpu::Slot;
using ::lioncub::cpu::ApplyArgs;
using ::lioncub::cpu::LocalStepCounts;
using ::lioncub::cpu::LionStepArgs;

namespace {

struct Coef {
  float b1, ob1, b2, ob2;
};

template <int DT>
inline float ld(const void* p, int64_t i) {
  if constexpr (DT == kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (DT == kBF16) {
    return u2f(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
  } else {
    return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}

template <int DT>
inline void st(void* p, int64_t i, float v) {
  if constexpr (DT == kF32) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
  }
}

// Load 64 consecutive elements (i0..i0+63) as fp32.
template <int DT>
inline void load64(const void* p, int64_t i0, float* out) {
  if constexpr (DT == kF16) {
#if LC_AVX2
    const uint16_t* h = static_cast<const uint16_t*>(p) + i0;
    for (int q = 0; q < 8; ++q)
      _mm256_storeu_ps(out + 8 * q, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8 * q))));
    return;
#endif
  }
  for (int j = 0; j < 64; ++j) out[j] = ld<DT>(p, i0 + j);
}

// Bit masks of 64 fp32 values: gt = (c > 0 & finite), nz = (c != 0 & finite), fin = finite, eq = (c == 0).
inline void masks64(const float* c, uint64_t& gt, uint64_t& nz, uint64_t& fin, uint64_t& eq) {
#if LC_AVX2
  const __m256 zero = _mm256_setzero_ps();
  const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  // v > 0 is false for NaN; |v| > 0 is false for NaN and +-0; |v| < inf is false for NaN and +-inf.
  // Then c == 0 exactly where c is finite and |c| > 0 is not: eq = fin & ~nz.
  uint64_t a = 0, b = 0, f = 0;
  for (int q = 0; q < 8; ++q) {
    const __m256 v = _mm256_loadu_ps(c + 8 * q);
    const __m256 av = _mm256_and_ps(v, absm);
    const __m256 fi = _mm256_cmp_ps(av, inf, _CMP_LT_OQ);
    a |= static_cast<uint64_t>(_mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(v, zero, _CMP_GT_OQ), fi))) << (8 * q);
    b |= static_cast<uint64_t>(_mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(av, zero, _CMP_GT_OQ), fi)))
         << (8 * q);
    f |= static_cast<uint64_t>(_mm256_movemask_ps(fi)) << (8 * q);
  }
  gt = a;
  nz = b;
  fin = f;
  eq = f & ~b;
#elif LIONCUB_X86 && defined(__SSE2__)
  const __m128 zero = _mm_setzero_ps();
  const __m128 absm = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
  const __m128 inf = _mm_set1_ps(std::numeric_limits<float>::infinity());
  uint64_t a = 0, b = 0, f = 0, e = 0;
  for (int q = 0; q < 16; ++q) {
    const __m128 v = _mm_loadu_ps(c + 4 * q);
    const __m128 fi = _mm_cmplt_ps(_mm_and_ps(v, absm), inf);
    const __m128 pz = _mm_cmpgt_ps(v, zero);
    const __m128 ez = _mm_cmpeq_ps(v, zero);
    a |= static_cast<uint64_t>(_mm_movemask_ps(_mm_and_ps(pz, fi))) << (4 * q);
    b |= static_cast<uint64_t>(_mm_movemask_ps(_mm_andnot_ps(ez, fi))) << (4 * q);
    f |= static_cast<uint64_t>(_mm_movemask_ps(fi)) << (4 * q);
    e |= static_cast<uint64_t>(_mm_movemask_ps(ez)) << (4 * q);
  }
  gt = a;
  nz = b;
  fin = f;
  eq = e;
#else
  uint64_t a = 0, b = 0, f = 0, e = 0;
  for (int j = 0; j < 64; ++j) {
    const uint32_t u = f2u(c[j]);
    const bool fi = (u & 0x7F800000u) != 0x7F800000u;
    const bool ez = c[j] == 0.0f;
    a |= static_cast<uint64_t>(fi && c[j] > 0.0f) << j;
    b |= static_cast<uint64_t>(fi && !ez) << j;
    f |= static_cast<uint64_t>(fi) << j;
    e |= static_cast<uint64_t>(ez) << j;
  }
  gt = a;
  nz = b;
  fin = f;
  eq = e;
#endif
}

// tie_hash(step, index) of the n <= 64 positions e .. e+n-1 under a tie-index table (the hash tie
// rule's bit 0, the dither's high bits): one segment and one high word over the n (the common case)
// is a 32-bit loop over all 64 that vectorizes; where a row starts inside the run, the rows are
// walked from e's (they are sorted by position) instead of searched per element.
inline void tie_hashes64(uint64_t step, const int64_t* rows, int64_t nrows, int64_t e, uint32_t* h, int n = 64) {
  const uint64_t idx0 = tie_index(rows, nrows, e);
  const uint32_t lo0 = static_cast<uint32_t>(idx0);
  if (tie_next_start(rows, nrows, e) >= e + n && lo0 <= 0xFFFFFFFFu - 63u) {  // (h[j >= n]: not read)
    const uint32_t hb = tie_hash_base(step, static_cast<uint32_t>(idx0 >> 32));
    for (int j = 0; j < 64; ++j) h[j] = tie_hash_mix((lo0 + static_cast<uint32_t>(j)) * 0x9E3779B1u + hb);
    return;
  }
  if (nrows <= 0) {
    for (int j = 0; j < n; ++j) h[j] = tie_hash(step, static_cast<uint64_t>(e + j));
    return;
  }
  int64_t k = tie_row(rows, nrows, e);
  for (int j = 0; j < n; ++j) {
    const int64_t pos = e + j;
    while (k + 1 < nrows && rows[2 * (k + 1)] <= pos) ++k;  // tie_row(rows, nrows, pos)
    h[j] = tie_hash(step, static_cast<uint64_t>(rows[2 * k + 1]) + static_cast<uint64_t>(pos - rows[2 * k]));
  }
}

inline void store_bits(uint8_t* out, uint64_t bits, int nbytes) {
  if (nbytes == 8) {
    std::memcpy(out, &bits, 8);
  } else {
    for (int b = 0; b < nbytes; ++b) out[b] = static_cast<uint8_t>(bits >> (8 * b));
  }
}

}  // namespace
