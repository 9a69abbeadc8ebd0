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

constexpr int64_t kGrain = 32768;  // at::internal::GRAIN_SIZE (torch's reduction split)
constexpr int64_t kChunk = 32768;  // elements per work item of the streaming kernels (multiple of 64)
constexpr int64_t kBlk = 512;      // elements per decision block of the apply kernels (multiple of 64; L1-sized)

inline uint32_t f2u(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float bf16_to_f32(uint16_t h) { return u2f(static_cast<uint32_t>(h) << 16); }
// Round to nearest even; a NaN stays a quiet NaN with its sign and top payload bits.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f2u(f);
  const uint32_t rne = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>(f != f ? nan : rne);  // f != f: NaN (a single compare once vectorized)
}
// f rounded to bf16 (round to nearest even), returned as the fp32 value of that bf16.
inline float round_bf16(float f) {
  const uint32_t u = f2u(f);
  const uint32_t rne = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  const uint32_t nan = (u | 0x00400000u) & 0xFFFF0000u;
  return u2f(f != f ? nan : rne);
}
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t ex = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (ex == 0x1Fu) return u2f(sign | 0x7F800000u | (man << 13));
  if (ex == 0) {
    const float f = static_cast<float>(man) * 5.9604644775390625e-08f;  // man * 2^-24, exact
    return sign ? -f : f;
  }
  return u2f(sign | ((ex + 112u) << 23) | (man << 13));
}

// codec.tie_hash_sign: uint32 arithmetic mod 2**32; the vote is +1 when the low bit is set.
inline uint32_t tie_hash(uint32_t step, uint32_t idx) {
  uint32_t h = idx * 0x9E3779B1u + step * 0x85EBCA77u + 0x165667B1u;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 12;
  h *= 0x297A2D39u;
  h ^= h >> 15;
  return h;
}

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

// utils::CeilLog2 of ATen (cascade-sum level size).
inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<unsigned long long>(x - 1));
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

// How torch splits a full reduction of L elements over T threads (TensorIteratorBase::parallel_reduce
// -> two_pass_reduction -> at::parallel_for with GRAIN_SIZE): chunk c is [c*cs, min(L, (c+1)*cs)).
struct SumPlan {
  int64_t L = 0;
  int T = 1;
  bool serial = true;
  int64_t cs = 0;
  int64_t nchunks = 0;
};
inline SumPlan plan_sum(int64_t L, int T) {
  SumPlan p;
  p.L = L;
  p.T = std::max(1, T);
  if (L <= 0) {
    p.nchunks = 0;
    return p;
  }
  if (L < kGrain || p.T == 1) {
    p.serial = true;
    p.cs = L;
    p.nchunks = 1;
  } else {
    const int64_t nthr = std::min<int64_t>(p.T, divup(L, kGrain));
    p.serial = false;
    p.cs = divup(L, nthr);
    p.nchunks = divup(L, p.cs);
  }
  return p;
}

// ATen's cascade_sum for one contiguous chunk of L values fed in order (SumKernel.cpp:
// vectorized_inner_sum -> row_sum -> multi_row_sum with 4 levels, 4 columns of W-lane vectors).
// W = 1 reproduces the scalar row_sum used when L < Vectorized::size().
template <typename T, int W>
struct CascadeSum {
  static constexpr int R = 4 * W;  // values per row (4 vectors)
  int64_t L, vec_size, rows_end, vec_end;
  int lp;
  int64_t lmask;
  int64_t pos = 0, nrows = 0;
  bool finalized = false;
  T acc[4][4][W];
  T fin = T(0);
  T buf[R];
  int bufn = 0;

  explicit CascadeSum(int64_t len) : L(len) {
    vec_size = L / W;
    const int64_t rows = vec_size / 4;
    rows_end = rows * R;
    vec_end = vec_size * W;
    lp = static_cast<int>(std::max<int64_t>(4, ceil_log2(rows) / 4));
    lmask = (int64_t(1) << lp) - 1;
    for (int j = 0; j < 4; ++j)
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < W; ++l) acc[j][k][l] = T(0);
  }
  inline void add_row(const T* x) {
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < W; ++l) acc[0][k][l] += x[k * W + l];
    ++nrows;
    if ((nrows & lmask) == 0) {
      for (int j = 1; j < 4; ++j) {
        for (int k = 0; k < 4; ++k)
          for (int l = 0; l < W; ++l) {
            acc[j][k][l] += acc[j - 1][k][l];
            acc[j - 1][k][l] = T(0);
          }
        if ((nrows & (lmask << (j * lp))) != 0) break;
      }
    }
  }
  inline void finalize_rows() {
    for (int j = 1; j < 4; ++j)
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < W; ++l) acc[0][k][l] += acc[j][k][l];
    finalized = true;
  }
  void feed(const T* x, int64_t n) {
    while (n > 0) {
      if (pos < rows_end) {
        if (bufn == 0) {
          const int64_t nr = std::min(n / R, (rows_end - pos) / R);
          for (int64_t r = 0; r < nr; ++r) add_row(x + r * R);
          if (nr > 0) {
            x += nr * R;
            n -= nr * R;
            pos += nr * R;
            continue;
          }
        }
        const int64_t take = std::min<int64_t>(std::min<int64_t>(n, R - bufn), rows_end - pos);
        for (int64_t i = 0; i < take; ++i) buf[bufn + i] = x[i];
        bufn += static_cast<int>(take);
        x += take;
        n -= take;
        pos += take;
        if (bufn == R) {
          add_row(buf);
          bufn = 0;
        }
        continue;
      }
      if (!finalized) finalize_rows();
      if (pos < vec_end) {
        const int64_t take = std::min<int64_t>(std::min<int64_t>(n, W - bufn), vec_end - pos);
        for (int64_t i = 0; i < take; ++i) buf[bufn + i] = x[i];
        bufn += static_cast<int>(take);
        x += take;
        n -= take;
        pos += take;
        if (bufn == W) {
          for (int l = 0; l < W; ++l) acc[0][0][l] += buf[l];
          bufn = 0;
        }
        continue;
      }
      fin += *x;  // scalar tail of vectorized_inner_sum
      ++x;
      --n;
      ++pos;
    }
  }
  T finish() {
    if (!finalized) finalize_rows();
    for (int k = 1; k < 4; ++k)
      for (int l = 0; l < W; ++l) acc[0][0][l] += acc[0][k][l];
    T r = fin;
    for (int l = 0; l < W; ++l) r += acc[0][0][l];
    return r;
  }
};

// Sum of one chunk of L values produced in order by gen(n, out), in torch's order for a
// `vec_width`-lane Vectorized<T>.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // gen() fills tmp before feed() reads it
#endif
template <typename T, int W, class Gen>
inline T cascade_chunk_w(int64_t L, Gen& gen) {
  CascadeSum<T, W> s(L);
  T tmp[512];
  int64_t left = L;
  while (left > 0) {
    const int64_t n = std::min<int64_t>(512, left);
    gen(n, tmp);
    s.feed(tmp, n);
    left -= n;
  }
  return s.finish();
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
template <typename T, class Gen>
inline T cascade_chunk(int64_t L, int vec_width, Gen& gen) {
  if (L < vec_width) return cascade_chunk_w<T, 1>(L, gen);
  switch (vec_width) {
    case 4: return cascade_chunk_w<T, 4>(L, gen);
    case 8: return cascade_chunk_w<T, 8>(L, gen);
    case 16: return cascade_chunk_w<T, 16>(L, gen);
    default: return cascade_chunk_w<T, 1>(L, gen);
  }
}
// Combine per-chunk results like two_pass_reduction: buffer[T] (identity 0), then a cascade sum
// of the buffer, then out = 0 + that.
template <typename T>
inline T combine_chunks(const SumPlan& p, const T* partials, int vec_width) {
  if (p.nchunks == 0) return T(0);
  if (p.serial) return T(0) + partials[0];
  std::vector<T> buffer(p.T, T(0));
  for (int64_t c = 0; c < p.nchunks; ++c) buffer[c] = T(0) + partials[c];
  int64_t i = 0;
  auto gen = [&](int64_t n, T* out) {
    for (int64_t j = 0; j < n; ++j) out[j] = buffer[i + j];
    i += n;
  };
  const T r = cascade_chunk<T>(p.T, vec_width, gen);
  return T(0) + r;
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
                int32_t tie, int64_t base, uint8_t* out_sign, uint8_t* out_nonzero, int nthreads) {
  LC_CALL(shard_vote_impl, sign, nonzero, nplanes, shard_bytes, step, tie, base, out_sign, out_nonzero, nthreads);
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
                        int32_t kind, int32_t levels, int vec_width, int torch_threads, int8_t* q_out,
                        int nthreads) {
  return LC_CALL(int8_local_step_impl, grads, momenta, ntensors, total, beta1, kind, levels, vec_width,
                 torch_threads, q_out, nthreads);
}

void int8_apply(const int8_t* qsum, int64_t numel, const Slot* params, int64_t nparams, double lr,
                double weight_decay, float* delta_out, int nthreads) {
  LC_CALL(int8_apply_impl, qsum, numel, params, nparams, lr, weight_decay, delta_out, nthreads);
}

float torch_mean_abs(const float* x, int64_t n, int vec_width, int torch_threads) {
  using namespace detail;
  const SumPlan plan = plan_sum(n, torch_threads);
  std::vector<float> part(std::max<int64_t>(1, plan.nchunks), 0.f);
  for (int64_t c = 0; c < plan.nchunks; ++c) {
    const int64_t b = c * plan.cs, e = std::min(n, b + plan.cs);
    int64_t i = b;
    auto gen = [&](int64_t k, float* out) {
      for (int64_t j = 0; j < k; ++j) out[j] = std::fabs(x[i + j]);
      i += k;
    };
    part[c] = cascade_chunk<float>(e - b, vec_width, gen);
  }
  const float s = combine_chunks<float>(plan, part.data(), vec_width);
  return n ? s / static_cast<float>(n) : 0.f;
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
  uint32_t step32;  // step mod 2**32 (hash)
  int32_t alt;      // +1 on odd steps, -1 on even steps
  uint64_t base;    // flat index of bucket element 0
};

template <int VOTE, int TIE, bool HASCNT>
inline void decide_t(const int32_t* __restrict plus, const int32_t* __restrict cnt, int32_t cnt_const, int64_t n,
                     const DecideArgs& a, int64_t e0, float* __restrict delta) {
  if constexpr (VOTE == kAverage) {
    const float w = a.world_f;
    for (int64_t j = 0; j < n; ++j) {
      const int32_t c = HASCNT ? cnt[j] : cnt_const;
      const int32_t d = 2 * plus[j] - c;
      delta[j] = static_cast<float>(d) / w;
    }
  } else {
    const uint32_t idx0 = static_cast<uint32_t>(a.base + static_cast<uint64_t>(e0));
    const uint32_t step32 = a.step32;
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
        const int32_t hv = static_cast<int32_t>((tie_hash(step32, idx0 + static_cast<uint32_t>(j)) & 1u) << 1) - 1;
        s += tie * hv;
      }
      delta[j] = static_cast<float>(s);
    }
  }
}

inline void decide(const int32_t* plus, const int32_t* cnt, int32_t cnt_const, int64_t n, const DecideArgs& a,
                   int64_t e0, float* delta) {
  const bool hc = cnt != nullptr;
  if (a.vote == kAverage) {
    if (hc) decide_t<kAverage, kTieZero, true>(plus, cnt, cnt_const, n, a, e0, delta);
    else decide_t<kAverage, kTieZero, false>(plus, cnt, cnt_const, n, a, e0, delta);
    return;
  }
  // Without per-element voter counts and with an odd count, 2*plus - cnt is never 0: no tie can
  // occur, so the (identical) tie-free loop is used.
  const int32_t tie = (!hc && (cnt_const & 1)) ? static_cast<int32_t>(kTieZero) : a.tie;
  switch (tie) {
    case kTieAlternate:
      if (hc) decide_t<kMajority, kTieAlternate, true>(plus, cnt, cnt_const, n, a, e0, delta);
      else decide_t<kMajority, kTieAlternate, false>(plus, cnt, cnt_const, n, a, e0, delta);
      break;
    case kTieHash:
      if (hc) decide_t<kMajority, kTieHash, true>(plus, cnt, cnt_const, n, a, e0, delta);
      else decide_t<kMajority, kTieHash, false>(plus, cnt, cnt_const, n, a, e0, delta);
      break;
    default:
      if (hc) decide_t<kMajority, kTieZero, true>(plus, cnt, cnt_const, n, a, e0, delta);
      else decide_t<kMajority, kTieZero, false>(plus, cnt, cnt_const, n, a, e0, delta);
      break;
  }
}

DecideArgs make_decide_args(int32_t vote, int32_t tie, int64_t world_size, int64_t step, int64_t base) {
  DecideArgs a;
  a.vote = vote;
  a.tie = tie;
  a.world_f = static_cast<float>(static_cast<double>(world_size));
  a.step32 = static_cast<uint32_t>(static_cast<uint64_t>(step));
  a.alt = (step & 1) ? 1 : -1;
  a.base = static_cast<uint64_t>(base);
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

// 64 tie-break bits of codec.tie_hash_sign (1 = +1) for flat indices idx0 .. idx0+63.
inline uint64_t hash_bits64(uint32_t step32, uint32_t idx0) {
  alignas(64) uint32_t hv[64];
  for (int j = 0; j < 64; ++j) hv[j] = tie_hash(step32, idx0 + static_cast<uint32_t>(j)) & 1u;
  uint32_t lo = 0, hi = 0;
  for (int j = 0; j < 32; ++j) lo |= hv[j] << j;
  for (int j = 0; j < 32; ++j) hi |= hv[32 + j] << j;
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

struct MajorityCounter {
  const uint8_t* sign;
  const uint8_t* nz;  // nullable
  int64_t N, B;
  int nbits;
  int32_t tie;
  uint32_t step32;
  int32_t alt;
  uint64_t base;

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
        const uint64_t hb = hash_bits64(step32, static_cast<uint32_t>(base + static_cast<uint64_t>(e)));
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
                              int32_t tie, int64_t step, int64_t base) {
  MajorityCounter mc;
  mc.sign = sign;
  mc.nz = nonzero;
  mc.N = nplanes;
  mc.B = bytes;
  mc.nbits = bit_length(nplanes);
  mc.tie = tie;
  mc.step32 = static_cast<uint32_t>(static_cast<uint64_t>(step));
  mc.alt = (step & 1) ? 1 : -1;
  mc.base = static_cast<uint64_t>(base);
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
    const MajorityCounter mc = make_majority(sign, nonzero, nplanes, plane_bytes, args.tie, args.step, args.base);
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
  const DecideArgs da = make_decide_args(args.vote, args.tie, args.world_size, args.step, args.base);
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
                     int64_t step, int32_t tie, int64_t base, uint8_t* out_sign, uint8_t* out_nonzero,
                     int nthreads) {
  const int64_t numel = shard_bytes * 8;
  if (numel <= 0) return;
  const MajorityCounter mc = make_majority(sign, nonzero, nplanes, shard_bytes, tie, step, base);
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
  const DecideArgs da = make_decide_args(args.vote, args.tie, args.world_size, args.step, args.base);
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

template <int GT, int MT>
struct Int8Tensor {
  // l1: torch-order partial sum of |c| over [b, e); counts non-finite.
  static float l1_chunk(const Slot& g, const Slot& m, int64_t b, int64_t e, float b1, float ob1, int vw,
                        int64_t& bad) {
    int64_t i = b;
    int64_t nb = 0;
    auto gen = [&](int64_t n, float* out) {
      nb += c_block<GT, MT, true>(g.data, m.data, i, n, b1, ob1, out);
      i += n;
    };
    const float r = cascade_chunk<float>(e - b, vw, gen);
    bad += nb;
    return r;
  }
  static float linf_chunk(const Slot& g, const Slot& m, int64_t b, int64_t e, float b1, float ob1, int64_t& bad) {
    alignas(64) float tmp[512];
    float mx = 0.0f;
    int64_t nb = 0;
    for (int64_t i = b; i < e; i += 512) {
      const int64_t n = std::min<int64_t>(512, e - i);
      nb += c_block<GT, MT, true>(g.data, m.data, i, n, b1, ob1, tmp);
      for (int64_t j = 0; j < n; ++j) mx = tmp[j] > mx ? tmp[j] : mx;
    }
    bad += nb;
    return mx;
  }
  // l0 pass 1: #non-finite and #(|c| > 0) over [b, e).
  static int64_t nnz_block(const Slot& g, const Slot& m, int64_t b, int64_t e, float b1, float ob1, int64_t& bad) {
    alignas(64) float tmp[512];
    int64_t nz = 0, nb = 0;
    for (int64_t i = b; i < e; i += 512) {
      const int64_t n = std::min<int64_t>(512, e - i);
      nb += c_block<GT, MT, true>(g.data, m.data, i, n, b1, ob1, tmp);
      for (int64_t j = 0; j < n; ++j) nz += tmp[j] > 0.0f ? 1 : 0;
    }
    bad += nb;
    return nz;
  }
  // l0 pass 2: torch-order sum of log(|c|) (double) over the nonzero values with compacted index
  // in [cb, ce); the first of them lies at or after element `start`, after `skip` nonzeros.
  static double l0_chunk(const Slot& g, const Slot& m, int64_t start, int64_t skip, int64_t count, float b1,
                         float ob1, int vw) {
    alignas(64) float ebuf[512];
    int64_t eb_n = 0, eb_pos = 0, i = start;
    const int64_t numel = m.numel;
    auto gen = [&](int64_t n, double* out) {
      int64_t k = 0;
      while (k < n) {
        if (eb_pos == eb_n) {
          eb_n = std::min<int64_t>(512, numel - i);
          c_block<GT, MT, true>(g.data, m.data, i, eb_n, b1, ob1, ebuf);
          i += eb_n;
          eb_pos = 0;
        }
        const float a = ebuf[eb_pos++];
        if (a > 0.0f) {
          if (skip > 0) {
            --skip;
          } else {
            out[k++] = std::log(static_cast<double>(a));
          }
        }
      }
    };
    return cascade_chunk<double>(count, vw, gen);
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
                             double beta1, int32_t kind, int32_t levels, int vec_width, int torch_threads,
                             int8_t* q_out, int nthreads) {
  (void)total;
  const float b1 = static_cast<float>(beta1), ob1 = static_cast<float>(1.0 - beta1);
  const float hs = static_cast<float>(static_cast<double>(levels) / 2.0);
  const float lv = static_cast<float>(levels);
  const int vw = vec_width > 0 ? vec_width : 8;
  int64_t work = 0;
  for (int64_t t = 0; t < ntensors; ++t) work += momenta[t].numel;
  const int nthr = threads_for(work, nthreads);
  std::vector<float> scale(ntensors, 0.0f);
  int64_t bad_total = 0;

  struct Task {
    int64_t t, b, e, c;
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

  if (kind == kScaleL1 || kind == kScaleLinf) {
    std::vector<SumPlan> plans(ntensors);
    std::vector<Task> tasks;
    std::vector<int64_t> first(ntensors + 1, 0);
    for (int64_t t = 0; t < ntensors; ++t) {
      const int64_t n = momenta[t].numel;
      first[t] = static_cast<int64_t>(tasks.size());
      if (kind == kScaleL1) {
        plans[t] = plan_sum(n, torch_threads);
        for (int64_t c = 0; c < plans[t].nchunks; ++c)
          tasks.push_back({t, c * plans[t].cs, std::min(n, (c + 1) * plans[t].cs), c});
      } else {
        for (int64_t b = 0, c = 0; b < n; b += kChunk, ++c) tasks.push_back({t, b, std::min(n, b + kChunk), c});
      }
    }
    first[ntensors] = static_cast<int64_t>(tasks.size());
    std::vector<float> part(tasks.size(), 0.0f);
    std::vector<int64_t> bad(tasks.size(), 0);
    parallel_for_dynamic(static_cast<int64_t>(tasks.size()), nthr, [&](int64_t i) {
      const Task& T = tasks[i];
      const Slot& g = grads[T.t];
      const Slot& m = momenta[T.t];
      if (kind == kScaleL1) {
        LC_I8_SWITCH(g.dtype, m.dtype, part[i] = K::l1_chunk(g, m, T.b, T.e, b1, ob1, vw, bad[i]));
      } else {
        LC_I8_SWITCH(g.dtype, m.dtype, part[i] = K::linf_chunk(g, m, T.b, T.e, b1, ob1, bad[i]));
      }
    });
    for (int64_t i = 0; i < static_cast<int64_t>(tasks.size()); ++i) bad_total += bad[i];
    for (int64_t t = 0; t < ntensors; ++t) {
      const int64_t n = momenta[t].numel;
      if (n == 0) continue;
      if (kind == kScaleL1) {
        const float s = combine_chunks<float>(plans[t], part.data() + first[t], vw);
        scale[t] = s / static_cast<float>(n);  // mean = sum.div_(numel): fp32 division by (float)numel
      } else {
        float mx = 0.0f;
        for (int64_t i = first[t]; i < first[t + 1]; ++i) mx = part[i] > mx ? part[i] : mx;
        scale[t] = mx;
      }
    }
  } else {  // l0
    // pass 1: per block of kChunk elements, #non-finite and #nonzero |c|
    std::vector<Task> blocks;
    std::vector<int64_t> first(ntensors + 1, 0);
    for (int64_t t = 0; t < ntensors; ++t) {
      first[t] = static_cast<int64_t>(blocks.size());
      const int64_t n = momenta[t].numel;
      for (int64_t b = 0, c = 0; b < n; b += kChunk, ++c) blocks.push_back({t, b, std::min(n, b + kChunk), c});
    }
    first[ntensors] = static_cast<int64_t>(blocks.size());
    std::vector<int64_t> nnz(blocks.size(), 0), bad(blocks.size(), 0);
    parallel_for_dynamic(static_cast<int64_t>(blocks.size()), nthr, [&](int64_t i) {
      const Task& T = blocks[i];
      const Slot& g = grads[T.t];
      const Slot& m = momenta[T.t];
      LC_I8_SWITCH(g.dtype, m.dtype, nnz[i] = K::nnz_block(g, m, T.b, T.e, b1, ob1, bad[i]));
    });
    for (size_t i = 0; i < blocks.size(); ++i) bad_total += bad[i];
    // pass 2: torch-order sum of log|c| over the compacted nonzero values of each tensor
    std::vector<SumPlan> plans(ntensors);
    std::vector<std::vector<int64_t>> prefix(ntensors);
    struct L0Task {
      int64_t t, start, skip, count;
    };
    std::vector<L0Task> tasks;
    std::vector<int64_t> tfirst(ntensors + 1, 0);
    for (int64_t t = 0; t < ntensors; ++t) {
      std::vector<int64_t>& pre = prefix[t];
      const int64_t nb = first[t + 1] - first[t];
      pre.assign(nb + 1, 0);
      for (int64_t k = 0; k < nb; ++k) pre[k + 1] = pre[k] + nnz[first[t] + k];
      const int64_t total_nz = pre[nb];
      plans[t] = plan_sum(total_nz, torch_threads);
      tfirst[t] = static_cast<int64_t>(tasks.size());
      for (int64_t c = 0; c < plans[t].nchunks; ++c) {
        const int64_t cb = c * plans[t].cs, ce = std::min(total_nz, cb + plans[t].cs);
        // block k holds compacted indices [pre[k], pre[k+1])
        const int64_t k = static_cast<int64_t>(std::upper_bound(pre.begin(), pre.end(), cb) - pre.begin()) - 1;
        tasks.push_back({t, k * kChunk, cb - pre[k], ce - cb});
      }
    }
    tfirst[ntensors] = static_cast<int64_t>(tasks.size());
    std::vector<double> part(tasks.size(), 0.0);
    const int vwd = std::max(1, vw / 2);  // Vectorized<double>::size()
    parallel_for_dynamic(static_cast<int64_t>(tasks.size()), nthr, [&](int64_t i) {
      const L0Task& T = tasks[i];
      const Slot& g = grads[T.t];
      const Slot& m = momenta[T.t];
      LC_I8_SWITCH(g.dtype, m.dtype, part[i] = K::l0_chunk(g, m, T.start, T.skip, T.count, b1, ob1, vwd));
    });
    for (int64_t t = 0; t < ntensors; ++t) {
      const int64_t total_nz = prefix[t].empty() ? 0 : prefix[t].back();
      if (total_nz == 0) {
        scale[t] = 0.0f;
        continue;
      }
      const double s = combine_chunks<double>(plans[t], part.data() + tfirst[t], vwd);
      const double mean = s / static_cast<double>(total_nz);
      scale[t] = static_cast<float>(std::exp(mean));
    }
  }

  // quantize
  std::vector<Task> qtasks;
  for (int64_t t = 0; t < ntensors; ++t) {
    const float a = scale[t];
    if (!(a > 0.0f) || !std::isfinite(a)) continue;  // a == 0 or non-finite: q stays 0
    const int64_t n = momenta[t].numel;
    for (int64_t b = 0; b < n; b += kChunk) qtasks.push_back({t, b, std::min(n, b + kChunk), 0});
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
