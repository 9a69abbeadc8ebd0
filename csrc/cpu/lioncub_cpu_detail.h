// lioncub_cpu_detail.h -- ISA-independent helpers of the C++ CPU kernels (threads, tables).
//
// The kernels are split like csrc/cuda: lioncub_cpu_local.cpp (local step, momentum, int8 codes),
// lioncub_cpu_vote.cpp (vote counting, decisions, apply) and lioncub_cpu_dispatch.cpp (the public
// entry points of lioncub_cpu.h, choosing the AVX2 or the portable copy at run time). The bodies
// (lioncub_cpu_local.inl, lioncub_cpu_vote.inl) are compiled twice by lioncub_cpu_isa_instantiate.h:
// once for the x86-64 baseline and once with `#pragma GCC target("avx2,popcnt,f16c")` (no FMA in
// the target list: both copies give identical results). Build flags: -O3 -fopenmp
// -ffp-contract=off (lioncub_ds/kernels/build.py). The scalar contract (conversions, tie hash,
// int8 scale arithmetic) is csrc/common/lioncub_common.h, shared with the CUDA kernels.
#ifndef LIONCUB_CPU_DETAIL_H_
#define LIONCUB_CPU_DETAIL_H_

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

#endif  // LIONCUB_CPU_DETAIL_H_
