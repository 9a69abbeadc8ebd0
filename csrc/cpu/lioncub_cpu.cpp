// lioncub_cpu.cpp -- fused CPU kernels of lioncub_ds. See lioncub_cpu.h for the contract.
//
// Build flags: -O3 -fopenmp -ffp-contract=off (no FMA contraction: every result must equal torch's
// separate mul / add bit for bit). No -march flag: the kernel body below is compiled twice, once for
// the portable x86-64 baseline (SSE2) and once with `#pragma GCC target("avx2,popcnt,f16c")`; the
// AVX2 copy is chosen at run time when the CPU has it. Both copies give identical results (the
// target list has no FMA). On other architectures only the portable copy is built.
//
// Layout of this file: the outer pass (LIONCUB_CPU_BODY undefined) holds includes, scalar helpers
// and the public entry points; it includes this same file again inside two namespaces with
// LIONCUB_CPU_BODY defined to instantiate the kernel body once per instruction set.

#ifndef LIONCUB_CPU_BODY
// ===================================================================================== outer pass
#include "lioncub_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#include <immintrin.h>
#define LIONCUB_X86 1
#else
#define LIONCUB_X86 0
#endif

#if defined(__BYTE_ORDER__) && (__BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__)
#error "lioncub_cpu assumes a little-endian machine (bit planes are read as little-endian words)"
#endif

#if defined(__FP_FAST_FMAF) && !defined(LIONCUB_ALLOW_FMA)
// Not an error by itself (the flag only says the target has an FMA instruction), but the build
// must use -ffp-contract=off; lioncub_ds/_native.py and setup.py always pass it.
#endif

namespace lioncub {
namespace cpu {
namespace detail {

constexpr int64_t kChunk = 32768;  // elements per work item of the streaming kernels (multiple of 64)
constexpr int64_t kBlk = 512;      // elements per decision block of the apply kernels (multiple of 64; L1-sized)

// f2u / u2f, the bf16 / fp16 conversions and the tie hash: csrc/common/lioncub_common.h (lcc).

// spread[v]: byte j = bit j of v (used to turn bit-sliced counter planes into byte counts).
struct SpreadTable {
  uint64_t t[256];
  SpreadTable() {
    for (int v = 0; v < 256; ++v) {
      uint64_t r = 0;
      for (int j = 0; j < 8; ++j) r |= static_cast<uint64_t>((v >> j) & 1) << (8 * j);
      t[v] = r;
    }
  }
};
inline const uint64_t* spread() {
  static const SpreadTable table;
  return table.t;
}

inline int64_t divup(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int popcount64(uint64_t x) { return __builtin_popcountll(x); }

// Threads for `work` elements of streaming work: one thread per ~64K elements, at most nthreads.
inline int threads_for(int64_t work, int nthreads) {
  const int64_t t = work / 65536;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, t)));
}

template <class F>
inline void parallel_for_dynamic(int64_t n, int nthreads, const F& f) {
  if (n <= 0) return;
  const int nt = static_cast<int>(std::min<int64_t>(nthreads, n));
#ifdef _OPENMP
  if (nt > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) f(i);
}

template <class F>
inline void parallel_for_static(int64_t n, int nthreads, const F& f) {
  if (n <= 0) return;
  const int nt = static_cast<int>(std::min<int64_t>(nthreads, n));
#ifdef _OPENMP
  if (nt > 1) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) f(i);
}

}  // namespace detail
}  // namespace cpu
}  // namespace lioncub

// ------------------------------------------------------------ the kernel body, once per ISA
#define LIONCUB_CPU_BODY 1
#if LIONCUB_X86
#pragma GCC push_options
#pragma GCC target("avx2,popcnt,f16c")
#define LC_AVX2 1
namespace lioncub {
namespace cpu {
namespace isa_avx2 {
#include "lioncub_cpu.cpp"
}  // namespace isa_avx2
}  // namespace cpu
}  // namespace lioncub
#undef LC_AVX2
#pragma GCC pop_options
#endif
#define LC_AVX2 0
namespace lioncub {
namespace cpu {
namespace isa_base {
#include "lioncub_cpu.cpp"
}  // namespace isa_base
}  // namespace cpu
}  // namespace lioncub
#undef LC_AVX2
#undef LIONCUB_CPU_BODY

// ------------------------------------------------------------ public entry points (dispatch)
namespace lioncub {
namespace cpu {
namespace {
std::atomic<int> g_isa{0};

bool cpu_has_avx2() {
#if LIONCUB_X86
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

int initial_isa() {
  const char* e = std::getenv("LIONCUB_CPU_ISA");  // "base" forces the portable path
  if (e && (std::strcmp(e, "base") == 0 || std::strcmp(e, "baseline") == 0)) return 1;
  return 0;
}

bool use_avx2() {
  static const int env = initial_isa();
  int s = g_isa.load(std::memory_order_relaxed);
  if (s == 0) s = env;
  if (s == 1) return false;
  return cpu_has_avx2();
}
}  // namespace

#if LIONCUB_X86
#define LC_CALL(fn, ...) (use_avx2() ? isa_avx2::fn(__VA_ARGS__) : isa_base::fn(__VA_ARGS__))
#else
#define LC_CALL(fn, ...) (isa_base::fn(__VA_ARGS__))
#endif

void set_isa(int isa) { g_isa.store(isa, std::memory_order_relaxed); }
const char* isa_name() { return use_avx2() ? "avx2" : "baseline"; }

LocalStepCounts local_step(const Slot* grads, const Slot* momenta, int64_t ntensors, int64_t total, double beta1,
                           double beta2, bool update_momentum, uint8_t* sign_out, uint8_t* nonzero_out,
                           int nthreads) {
  return LC_CALL(local_step_impl, grads, momenta, ntensors, total, beta1, beta2, update_momentum, sign_out,
                 nonzero_out, nthreads);
}

void momentum_update(const Slot* momenta, const Slot* grads, int64_t ntensors, double beta2, int nthreads) {
  LC_CALL(momentum_update_impl, momenta, grads, ntensors, beta2, nthreads);
}

void vote_apply(const uint8_t* sign, const uint8_t* nonzero, int64_t nplanes, int64_t plane_bytes,
                const Slot* params, int64_t nparams, const ApplyArgs& args, float* delta_out, int nthreads) {
  LC_CALL(vote_apply_impl, sign, nonzero, nplanes, plane_bytes, params, nparams, args, delta_out, nthreads);
}

void shard_vote(const uint8_t* sign, const uint8_t* nonzero, int64_t nplanes, int64_t shard_bytes, int64_t step,
                int32_t tie, const int64_t* tie_rows, int64_t tie_nrows, uint8_t* out_sign, uint8_t* out_nonzero,
                int nthreads) {
  LC_CALL(shard_vote_impl, sign, nonzero, nplanes, shard_bytes, step, tie, tie_rows, tie_nrows, out_sign,
          out_nonzero, nthreads);
}

int64_t count_lanes(const uint8_t* sign, const uint8_t* nonzero, int64_t nplanes, int64_t shard_bytes, int p,
                    uint8_t* plus_out, uint8_t* cnt_out, int nthreads) {
  return LC_CALL(count_lanes_impl, sign, nonzero, nplanes, shard_bytes, p, plus_out, cnt_out, nthreads);
}

void lanes_apply(const uint8_t* plus, const uint8_t* cnt, int64_t lane_bytes, int p, const Slot* params,
                 int64_t nparams, const ApplyArgs& args, float* delta_out, int nthreads) {
  LC_CALL(lanes_apply_impl, plus, cnt, lane_bytes, p, params, nparams, args, delta_out, nthreads);
}

int64_t int8_local_step(const Slot* grads, const Slot* momenta, int64_t ntensors, int64_t total, double beta1,
                        int32_t kind, int32_t levels, int8_t* q_out, int nthreads) {
  return LC_CALL(int8_local_step_impl, grads, momenta, ntensors, total, beta1, kind, levels, q_out, nthreads);
}

void int8_apply(const int8_t* qsum, int64_t numel, const Slot* params, int64_t nparams, double lr,
                double weight_decay, float* delta_out, int nthreads) {
  LC_CALL(int8_apply_impl, qsum, numel, params, nparams, lr, weight_decay, delta_out, nthreads);
}

#undef LC_CALL

}  // namespace cpu
}  // namespace lioncub

#else  // LIONCUB_CPU_BODY
// ===================================================================================== kernel body
// Compiled once per instruction set (namespaces isa_avx2 / isa_base). LC_AVX2 says which.

using namespace ::lioncub::cpu::detail;
using ::lioncub::cpu::Slot;
using ::lioncub::cpu::ApplyArgs;
using ::lioncub::cpu::LocalStepCounts;

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
  uint64_t a = 0, b = 0, f = 0, e = 0;
  for (int q = 0; q < 8; ++q) {
    const __m256 v = _mm256_loadu_ps(c + 8 * q);
    const __m256 fi = _mm256_cmp_ps(_mm256_and_ps(v, absm), inf, _CMP_LT_OQ);
    const __m256 pz = _mm256_cmp_ps(v, zero, _CMP_GT_OQ);
    const __m256 ez = _mm256_cmp_ps(v, zero, _CMP_EQ_OQ);
    a |= static_cast<uint64_t>(_mm256_movemask_ps(_mm256_and_ps(pz, fi))) << (8 * q);
    b |= static_cast<uint64_t>(_mm256_movemask_ps(_mm256_andnot_ps(ez, fi))) << (8 * q);
    f |= static_cast<uint64_t>(_mm256_movemask_ps(fi)) << (8 * q);
    e |= static_cast<uint64_t>(_mm256_movemask_ps(ez)) << (8 * q);
  }
  gt = a;
  nz = b;
  fin = f;
  eq = e;
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

inline void store_bits(uint8_t* out, uint64_t bits, int nbytes) {
  if (nbytes == 8) {
    std::memcpy(out, &bits, 8);
  } else {
    for (int b = 0; b < nbytes; ++b) out[b] = static_cast<uint8_t>(bits >> (8 * b));
  }
}

// ------------------------------------------------------------------ (a) local step
template <int GT, int MT, bool UPD>
void ls_range(const void* g, void* m, int64_t e0, int64_t e1, const Coef& k, uint8_t* sbytes, uint8_t* zbytes,
              int64_t& n_nonfinite, int64_t& n_zero) {
  alignas(64) float gf[64], mf[64], c[64], mn[64];
  int64_t nf = 0, nzc = 0;
  for (int64_t i0 = e0; i0 < e1; i0 += 64) {
    const int n = static_cast<int>(std::min<int64_t>(64, e1 - i0));
    if (n == 64) {
      load64<GT>(g, i0, gf);
      load64<MT>(m, i0, mf);
    } else {
      for (int j = 0; j < n; ++j) {
        gf[j] = ld<GT>(g, i0 + j);
        mf[j] = ld<MT>(m, i0 + j);
      }
      for (int j = n; j < 64; ++j) gf[j] = mf[j] = 0.0f;
    }
    for (int j = 0; j < 64; ++j) c[j] = mf[j] * k.b1 + gf[j] * k.ob1;
    if constexpr (UPD) {
      for (int j = 0; j < 64; ++j) mn[j] = mf[j] * k.b2 + gf[j] * k.ob2;
      if (n == 64) {
        if constexpr (MT == kF32) {
          std::memcpy(static_cast<float*>(m) + i0, mn, sizeof(mn));
        } else {
          uint16_t* mp = static_cast<uint16_t*>(m) + i0;
          for (int j = 0; j < 64; ++j) mp[j] = f32_to_bf16(mn[j]);
        }
      } else {
        for (int j = 0; j < n; ++j) st<MT>(m, i0 + j, mn[j]);
      }
    }
    uint64_t s, z, f, e;
    masks64(c, s, z, f, e);
    const uint64_t valid = n == 64 ? ~uint64_t(0) : ((uint64_t(1) << n) - 1);
    nf += popcount64(~f & valid);
    nzc += popcount64(e & valid);
    const int64_t byte0 = (i0 - e0) >> 3;
    const int nbytes = (n + 7) >> 3;
    store_bits(sbytes + byte0, s & valid, nbytes);
    store_bits(zbytes + byte0, z & valid, nbytes);
  }
  n_nonfinite += nf;
  n_zero += nzc;
}

template <int GT, int MT>
void mom_range(const void* g, void* m, int64_t e0, int64_t e1, float b2, float ob2) {
  alignas(64) float gf[64], mf[64], mn[64];
  for (int64_t i0 = e0; i0 < e1; i0 += 64) {
    const int n = static_cast<int>(std::min<int64_t>(64, e1 - i0));
    if (n == 64) {
      load64<GT>(g, i0, gf);
      load64<MT>(m, i0, mf);
      for (int j = 0; j < 64; ++j) mn[j] = mf[j] * b2 + gf[j] * ob2;
      if constexpr (MT == kF32) {
        std::memcpy(static_cast<float*>(m) + i0, mn, sizeof(mn));
      } else {
        uint16_t* mp = static_cast<uint16_t*>(m) + i0;
        for (int j = 0; j < 64; ++j) mp[j] = f32_to_bf16(mn[j]);
      }
    } else {
      for (int j = 0; j < n; ++j) {
        const float v = ld<MT>(m, i0 + j) * b2 + ld<GT>(g, i0 + j) * ob2;
        st<MT>(m, i0 + j, v);
      }
    }
  }
}

#define LC_GM_SWITCH(gt, mt, CALL)                                  \
  do {                                                              \
    const int lc_key_ = (gt) * 4 + (mt);                            \
    if (lc_key_ == kF32 * 4 + kF32) { CALL(kF32, kF32); }           \
    else if (lc_key_ == kF32 * 4 + kBF16) { CALL(kF32, kBF16); }    \
    else if (lc_key_ == kBF16 * 4 + kF32) { CALL(kBF16, kF32); }    \
    else if (lc_key_ == kBF16 * 4 + kBF16) { CALL(kBF16, kBF16); }  \
    else if (lc_key_ == kF16 * 4 + kF32) { CALL(kF16, kF32); }      \
    else if (lc_key_ == kF16 * 4 + kBF16) { CALL(kF16, kBF16); }    \
  } while (0)

struct Item {
  int64_t t, e0, e1;
};

std::vector<Item> chunk_items(const Slot* slots, int64_t ntensors, int64_t chunk, int64_t* work) {
  std::vector<Item> items;
  int64_t w = 0;
  for (int64_t t = 0; t < ntensors; ++t) {
    const int64_t n = slots[t].numel;
    for (int64_t e0 = 0; e0 < n; e0 += chunk) items.push_back({t, e0, std::min(n, e0 + chunk)});
    w += n;
  }
  if (work) *work = w;
  return items;
}

}  // namespace

LocalStepCounts local_step_impl(const Slot* grads, const Slot* momenta, int64_t ntensors, int64_t total,
                                double beta1, double beta2, bool update_momentum, uint8_t* sign_out,
                                uint8_t* nonzero_out, int nthreads) {
  (void)total;
  const Coef k{static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
               static_cast<float>(1.0 - beta2)};
  int64_t work = 0;
  const std::vector<Item> items = chunk_items(momenta, ntensors, kChunk, &work);
  std::vector<int64_t> nf(items.size(), 0), nz(items.size(), 0);
  parallel_for_dynamic(static_cast<int64_t>(items.size()), threads_for(work, nthreads), [&](int64_t it) {
    const Item& I = items[it];
    const Slot& g = grads[I.t];
    const Slot& m = momenta[I.t];
    const int64_t byte0 = (m.offset + I.e0) >> 3;
#define LC_LS(G, M)                                                                                      \
  if (update_momentum)                                                                                   \
    ls_range<G, M, true>(g.data, m.data, I.e0, I.e1, k, sign_out + byte0, nonzero_out + byte0, nf[it], \
                         nz[it]);                                                                        \
  else                                                                                                   \
    ls_range<G, M, false>(g.data, m.data, I.e0, I.e1, k, sign_out + byte0, nonzero_out + byte0, nf[it], nz[it]);
    LC_GM_SWITCH(g.dtype, m.dtype, LC_LS);
#undef LC_LS
  });
  LocalStepCounts out{0, 0};
  for (size_t i = 0; i < items.size(); ++i) {
    out.n_nonfinite += nf[i];
    out.n_zero += nz[i];
  }
  return out;
}

void momentum_update_impl(const Slot* momenta, const Slot* grads, int64_t ntensors, double beta2, int nthreads) {
  const float b2 = static_cast<float>(beta2), ob2 = static_cast<float>(1.0 - beta2);
  int64_t work = 0;
  const std::vector<Item> items = chunk_items(momenta, ntensors, kChunk, &work);
  parallel_for_dynamic(static_cast<int64_t>(items.size()), threads_for(work, nthreads), [&](int64_t it) {
    const Item& I = items[it];
    const Slot& g = grads[I.t];
    const Slot& m = momenta[I.t];
#define LC_MU(G, M) mom_range<G, M>(g.data, m.data, I.e0, I.e1, b2, ob2);
    LC_GM_SWITCH(g.dtype, m.dtype, LC_MU);
#undef LC_MU
  });
}

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

// ------------------------------------------------------------------ decisions (codec.decide)
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
    const uint64_t step = a.step;
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
        const int32_t tie = static_cast<int32_t>(d == 0) & static_cast<int32_t>(c > 0);
        const int32_t hv = static_cast<int32_t>((tie_hash(step, idx0 + static_cast<uint64_t>(j)) & 1u) << 1) - 1;
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
    // split [e0, e0 + n) where a new tie-index segment starts (a parameter boundary)
    int64_t j = 0;
    while (j < n) {
      const int64_t pos = e0 + j;
      const int64_t next = tie_next_start(a.tie_rows, a.tie_nrows, pos);
      const int64_t len = std::min(n - j, next - pos);
      decide_t<VOTE, TIE, HASCNT>(plus + j, HASCNT ? cnt + j : cnt, cnt_const, len, a,
                                  tie_index(a.tie_rows, a.tie_nrows, pos), delta + j);
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

// 64 tie-break bits of codec.tie_hash_sign (1 = +1) for positions e .. e+63 under a tie-index table.
inline uint64_t hash_bits64(uint64_t step, const int64_t* rows, int64_t nrows, int64_t e) {
  const uint64_t idx0 = tie_index(rows, nrows, e);
  if (tie_next_start(rows, nrows, e) >= e + 64) {  // one segment (the common case): vectorizes
    alignas(64) uint32_t hv[64];
    for (int j = 0; j < 64; ++j) hv[j] = tie_hash(step, idx0 + static_cast<uint64_t>(j)) & 1u;
    uint32_t lo = 0, hi = 0;
    for (int j = 0; j < 32; ++j) lo |= hv[j] << j;
    for (int j = 0; j < 32; ++j) hi |= hv[32 + j] << j;
    return static_cast<uint64_t>(lo) | (static_cast<uint64_t>(hi) << 32);
  }
  uint64_t out = 0;
  for (int j = 0; j < 64; ++j)
    out |= static_cast<uint64_t>(tie_hash(step, tie_index(rows, nrows, e + j)) & 1u) << j;
  return out;
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
    if (ties) {
      if (tie == kTieAlternate) {
        if (alt > 0) pos |= ties; else neg |= ties;
      } else if (tie == kTieHash) {
        const uint64_t hb = hash_bits64(step, tie_rows, tie_nrows, e);
        pos |= ties & hb;
        neg |= ties & ~hb;
      }
    }
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

// ------------------------------------------------------------------ apply (codec.apply_update)
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
void apply_driver(int64_t numel, const Slot* params, int64_t nparams, double lr, double wd, float* delta_out,
                  int nthreads, const Prod& prod) {
  if (numel <= 0) return;
  const double decay_d = 1.0 - lr * wd;
  const bool decay = decay_d != 1.0;
  const float df = static_cast<float>(decay_d);
  const float nl = static_cast<float>(-lr);
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
    apply_driver(plane_bytes * 8, params, nparams, args.lr, args.weight_decay, delta_out, nthreads, prod);
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
  apply_driver(plane_bytes * 8, params, nparams, args.lr, args.weight_decay, delta_out, nthreads, prod);
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
  apply_driver(numel, params, nparams, args.lr, args.weight_decay, delta_out, nthreads, prod);
}

// ------------------------------------------------------------------ (h) int8_apply
void int8_apply_impl(const int8_t* qsum, int64_t numel, const Slot* params, int64_t nparams, double lr,
                     double weight_decay, float* delta_out, int nthreads) {
  auto prod = [&](int64_t e0, int64_t n, float* delta) {
    const int8_t* q = qsum + e0;
    for (int64_t j = 0; j < n; ++j) delta[j] = static_cast<float>((q[j] > 0) - (q[j] < 0));
  };
  apply_driver(numel, params, nparams, lr, weight_decay, delta_out, nthreads, prod);
}

// ------------------------------------------------------------------ (g) int8_local_step
namespace {

// c of elements [i0, i0+n) of one tensor with non-finite -> 0; returns #non-finite. out: |c| or c.
template <int GT, int MT, bool ABS>
inline int64_t c_block(const void* g, const void* m, int64_t i0, int64_t n, float b1, float ob1, float* out) {
  int64_t bad = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float c = ld<MT>(m, i0 + j) * b1 + ld<GT>(g, i0 + j) * ob1;
    const uint32_t u = f2u(c);
    const bool fin = (u & 0x7F800000u) != 0x7F800000u;
    bad += fin ? 0 : 1;
    const float v = ABS ? u2f(u & 0x7FFFFFFFu) : c;
    out[j] = fin ? v : 0.0f;
  }
  return bad;
}

// Partial statistics of one block of kSumBlock elements of one tensor (lcc: the defined order).
struct SumAcc {
  double s = 0.0;    // l1: ordered sum of |c| over the block; l0: of log(m); linf: max |c|
  int64_t nnz = 0;   // l0: #nonzero |c|
  int64_t esum = 0;  // l0: sum of the exponents e (exact)
  int64_t bad = 0;   // #non-finite c
};

template <int GT, int MT>
struct Int8Tensor {
  // The block [b, e) (b a multiple of kSumBlock): lane l adds elements b + l + 256k in index order.
  static SumAcc block(const Slot& g, const Slot& m, int64_t b, int64_t e, float b1, float ob1, int kind) {
    alignas(64) float tmp[512];
    alignas(64) double acc[kSumLanes];
    for (int l = 0; l < kSumLanes; ++l) acc[l] = 0.0;
    SumAcc r;
    float mx = 0.0f;
    for (int64_t i = b; i < e; i += 512) {  // i - b is a multiple of 512: element i + j is in lane j & 255
      const int64_t n = std::min<int64_t>(512, e - i);
      r.bad += c_block<GT, MT, true>(g.data, m.data, i, n, b1, ob1, tmp);
      if (kind == kScaleL1) {
        const int64_t n0 = std::min<int64_t>(n, kSumLanes);
        for (int64_t j = 0; j < n0; ++j) acc[j] += static_cast<double>(tmp[j]);
        for (int64_t j = kSumLanes; j < n; ++j) acc[j - kSumLanes] += static_cast<double>(tmp[j]);
      } else if (kind == kScaleL0) {
        for (int64_t j = 0; j < n; ++j) {
          if (tmp[j] > 0.0f) {
            double lm;
            r.esum += log_parts(tmp[j], &lm);
            r.nnz += 1;
            acc[j & (kSumLanes - 1)] += lm;
          }
        }
      } else {
        for (int64_t j = 0; j < n; ++j) mx = tmp[j] > mx ? tmp[j] : mx;
      }
    }
    r.s = kind == kScaleLinf ? static_cast<double>(mx) : lane_tree(acc);
    return r;
  }
  static void quantize(const Slot& g, const Slot& m, int64_t b, int64_t e, float b1, float ob1, float hs,
                       float scale, float lv, int8_t* q) {
    alignas(64) float tmp[512];
    const float magic = 12582912.0f;  // 1.5 * 2^23: (v + magic) - magic rounds |v| < 2^22 half-to-even
    for (int64_t i = b; i < e; i += 512) {
      const int64_t n = std::min<int64_t>(512, e - i);
      c_block<GT, MT, false>(g.data, m.data, i, n, b1, ob1, tmp);
      for (int64_t j = 0; j < n; ++j) {
        float v = (tmp[j] * hs) / scale;
        v = v < lv ? v : lv;  // clamp first (|v| <= s keeps the magic rounding exact); v is never NaN
        v = v > -lv ? v : -lv;
        const float r = (v + magic) - magic;
        q[i + j] = static_cast<int8_t>(static_cast<int32_t>(r));
      }
    }
  }
};

}  // namespace

int64_t int8_local_step_impl(const Slot* grads, const Slot* momenta, int64_t ntensors, int64_t total,
                             double beta1, int32_t kind, int32_t levels, int8_t* q_out, int nthreads) {
  (void)total;
  const float b1 = static_cast<float>(beta1), ob1 = static_cast<float>(1.0 - beta1);
  const float hs = static_cast<float>(static_cast<double>(levels) / 2.0);
  const float lv = static_cast<float>(levels);
  int64_t work = 0;
  for (int64_t t = 0; t < ntensors; ++t) work += momenta[t].numel;
  const int nthr = threads_for(work, nthreads);
  std::vector<float> scale(ntensors, 0.0f);
  int64_t bad_total = 0;

  struct Task {
    int64_t t, b, e;
  };
#define LC_INT8(G, M, BODY)                  \
  do {                                       \
    using K = Int8Tensor<G, M>;              \
    BODY;                                    \
  } while (0)
#define LC_I8_SWITCH(gt, mt, BODY)                                                   \
  do {                                                                               \
    const int lc_key_ = (gt) * 4 + (mt);                                             \
    if (lc_key_ == kF32 * 4 + kF32) LC_INT8(kF32, kF32, BODY);                       \
    else if (lc_key_ == kF32 * 4 + kBF16) LC_INT8(kF32, kBF16, BODY);                \
    else if (lc_key_ == kBF16 * 4 + kF32) LC_INT8(kBF16, kF32, BODY);                \
    else if (lc_key_ == kBF16 * 4 + kBF16) LC_INT8(kBF16, kBF16, BODY);              \
    else if (lc_key_ == kF16 * 4 + kF32) LC_INT8(kF16, kF32, BODY);                  \
    else if (lc_key_ == kF16 * 4 + kBF16) LC_INT8(kF16, kBF16, BODY);                \
  } while (0)

  // pass 1: the statistics of every block of kSumBlock elements (in parallel, any order)
  std::vector<Task> tasks;
  std::vector<int64_t> first(ntensors + 1, 0);
  for (int64_t t = 0; t < ntensors; ++t) {
    first[t] = static_cast<int64_t>(tasks.size());
    const int64_t n = momenta[t].numel;
    for (int64_t b = 0; b < n; b += kSumBlock) tasks.push_back({t, b, std::min(n, b + kSumBlock)});
  }
  first[ntensors] = static_cast<int64_t>(tasks.size());
  std::vector<SumAcc> part(tasks.size());
  parallel_for_dynamic(static_cast<int64_t>(tasks.size()), nthr, [&](int64_t i) {
    const Task& T = tasks[i];
    const Slot& g = grads[T.t];
    const Slot& m = momenta[T.t];
    LC_I8_SWITCH(g.dtype, m.dtype, part[i] = K::block(g, m, T.b, T.e, b1, ob1, kind));
  });
  // pass 2: per tensor, the block results in block order (the defined order)
  for (int64_t t = 0; t < ntensors; ++t) {
    double s = 0.0;
    int64_t nnz = 0, esum = 0;
    for (int64_t i = first[t]; i < first[t + 1]; ++i) {
      bad_total += part[i].bad;
      if (kind == kScaleLinf) s = part[i].s > s ? part[i].s : s;
      else s += part[i].s;
      nnz += part[i].nnz;
      esum += part[i].esum;
    }
    if (kind == kScaleL1) scale[t] = l1_scale(s, momenta[t].numel);
    else if (kind == kScaleL0) scale[t] = l0_scale(esum, s, nnz);
    else scale[t] = static_cast<float>(s);
  }

  // quantize
  std::vector<Task> qtasks;
  for (int64_t t = 0; t < ntensors; ++t) {
    const float a = scale[t];
    if (!(a > 0.0f) || !std::isfinite(a)) continue;  // a == 0 or non-finite: q stays 0
    const int64_t n = momenta[t].numel;
    for (int64_t b = 0; b < n; b += kChunk) qtasks.push_back({t, b, std::min(n, b + kChunk)});
  }
  parallel_for_dynamic(static_cast<int64_t>(qtasks.size()), nthr, [&](int64_t i) {
    const Task& T = qtasks[i];
    const Slot& g = grads[T.t];
    const Slot& m = momenta[T.t];
    int8_t* q = q_out + m.offset;
    LC_I8_SWITCH(g.dtype, m.dtype, K::quantize(g, m, T.b, T.e, b1, ob1, hs, scale[T.t], lv, q));
  });
#undef LC_I8_SWITCH
#undef LC_INT8
  return bad_total;
}

#undef LC_GM_SWITCH

#endif  // LIONCUB_CPU_BODY
