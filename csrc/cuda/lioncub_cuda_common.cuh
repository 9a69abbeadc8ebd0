// lioncub_cuda_common.cuh -- per-element / per-word logic of the fused kernels.
//
// Everything here is __host__ __device__ (LC_HD; LC_DEV for the few helpers that call a kernel's
// lambdas) and uses only integer ops and correctly rounded single fp32 ops (no FMA:
// __fmul_rn/__fadd_rn/__fdiv_rn on the device). The element I/O takes the dtype as a template
// parameter (kAnyDT: read at run time) and separates loads (raw bits) from conversions, so that a
// thread can have several units' loads in flight before its first store. The kernels (lioncub_local.cu, lioncub_vote.cu, lioncub_step.cu) add the grid-stride
// loops, the warp shuffles and the block reductions around it, and start through lc::launch (at the
// end of this file). The test-only host emulation (tests/cuda_emu) compiles those same .cu files
// with a host compiler and runs their kernels, so nothing here or there is restated for it.
// The vote-side per-word logic (tie rules, bit-sliced counts, lanes) is in lioncub_cuda_vote.cuh.
//
// Bit order (docs/conventions.md): element i of a packed plane is bit (i & 7) of byte (i >> 3);
// read as little-endian 32-bit words, element 32*w + k is bit k of word w.
#ifndef LIONCUB_CUDA_COMMON_CUH_
#define LIONCUB_CUDA_COMMON_CUH_

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <cuda_runtime.h>  // the occupancy API (a template of the runtime's C++ API)
#include <vector_types.h>

#include "lioncub_cuda.h"
#include "../common/lioncub_common.h"

#include <cmath>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define LC_HD __host__ __device__ __forceinline__
#define LC_DEV __device__ __forceinline__  // device only: the helpers that call a kernel's lambdas
#else
#define LC_HD inline
#define LC_DEV inline
#endif

// Unroll hints for the device compiler only (host compilers would warn about them).
#if defined(__CUDA_ARCH__)
#define LC_UNROLL _Pragma("unroll")
#define LC_UNROLL_4 _Pragma("unroll 4")
#else
#define LC_UNROLL
#define LC_UNROLL_4
#endif

namespace lc {

// Threads per block of every kernel; the chunked reductions need exactly this many.
constexpr int kThreads = 256;
// The int8 scale's defined order: one block of the sum = one LC_CHUNK chunk, one lane = one thread.
static_assert(kThreads == lcc::kSumLanes && LC_CHUNK == lcc::kSumBlock, "int8 sum order (csrc/common)");
#define LC_SAME(a, b) (static_cast<int>(a) == static_cast<int>(b))
static_assert(LC_SAME(LC_FLOAT32, lcc::kF32) && LC_SAME(LC_BFLOAT16, lcc::kBF16) && LC_SAME(LC_FLOAT16, lcc::kF16),
              "dtype codes");
static_assert(LC_SAME(LC_TIE_ZERO, lcc::kTieZero) && LC_SAME(LC_TIE_ALTERNATE, lcc::kTieAlternate) &&
                  LC_SAME(LC_TIE_HASH, lcc::kTieHash),
              "tie codes");
static_assert(LC_SAME(LC_VOTE_MAJORITY, lcc::kMajority) && LC_SAME(LC_VOTE_AVERAGE, lcc::kAverage), "vote codes");
static_assert(LC_SAME(LC_SCALE_L1, lcc::kScaleL1) && LC_SAME(LC_SCALE_L0, lcc::kScaleL0) &&
                  LC_SAME(LC_SCALE_LINF, lcc::kScaleLinf),
              "scale codes");
static_assert(LC_SAME(LC_ROUND_NEAREST, lcc::kNearest) && LC_SAME(LC_ROUND_DITHER, lcc::kDither), "rounding codes");
#undef LC_SAME

// ----------------------------------------------------------------------------- scalar fp32
using lcc::f2u;
using lcc::u2f;

// One correctly rounded op each; never contracted into an FMA.
LC_HD float fmul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  volatile float r = a * b;  // volatile: the host compiler may not contract either
  return r;
#endif
}

LC_HD float fadd(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  volatile float r = a + b;
  return r;
#endif
}

LC_HD float fdiv(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  volatile float r = a / b;
  return r;
#endif
}

// Round half to even (torch.round).
LC_HD float rint_even(float x) {
#ifdef __CUDA_ARCH__
  return rintf(x);
#else
  return std::nearbyint(x);
#endif
}

LC_HD float fmin_(float a, float b) {
#ifdef __CUDA_ARCH__
  return fminf(a, b);
#else
  return std::fmin(a, b);
#endif
}

LC_HD float fmax_(float a, float b) {
#ifdef __CUDA_ARCH__
  return fmaxf(a, b);
#else
  return std::fmax(a, b);
#endif
}

// Index of the lowest set bit of a nonzero word.
LC_HD int ctz32(uint32_t x) {
#ifdef __CUDA_ARCH__
  return __ffs(static_cast<int>(x)) - 1;
#else
  return __builtin_ctz(x);
#endif
}

LC_HD bool is_finite(float x) { return (f2u(x) & 0x7f800000u) != 0x7f800000u; }
LC_HD float fabs_(float x) { return u2f(f2u(x) & 0x7fffffffu); }

// ----------------------------------------------------------------------------- 16-bit floats
// The conversions of the scalar contract (csrc/common): bf16 RNE with NaN -> 0x7FC0 (torch's
// rule), fp16 RNE. Integer-only, so the device gives the host's bits.
LC_HD float bf16_to_f(uint16_t h) { return lcc::bf16_to_f32(h); }
LC_HD uint16_t f_to_bf16(float f) { return lcc::f32_to_bf16(f); }
LC_HD float h_to_f(uint16_t h) { return lcc::f16_to_f32(h); }
LC_HD uint16_t f_to_h(float f) { return lcc::f32_to_f16(f); }

LC_HD float from16(int dt, uint16_t h) { return dt == LC_BFLOAT16 ? bf16_to_f(h) : h_to_f(h); }
LC_HD uint16_t to16(int dt, float f) { return dt == LC_BFLOAT16 ? f_to_bf16(f) : f_to_h(f); }

// fp32 value after a round trip through dtype dt (what storing into a dt tensor keeps).
LC_HD float round_to(int dt, float x) { return dt == LC_FLOAT32 ? x : from16(dt, to16(dt, x)); }

// ----------------------------------------------------------------------------- dtypes as template parameters
// The element I/O and the unit bodies take their tensors' dtype codes as template parameters (DT): a
// body compiled for one dtype has no dtype branch left. kAnyDT compiles the run-time code (the dtype
// read from the meta) for every other case. A bucket's dtypes are in its device-side meta, so the host
// cannot pick: a kernel picks the body once per chunk (chunked kernels) or once per group of units
// that share one dtype combination (the others: the units of a bucket nearly always do).
constexpr int kAnyDT = -1;
constexpr int64_t kMixed = -1;  // units of different dtype combinations: the run-time body
template <int DT>
struct DTc {
  static constexpr int value = DT;
};
template <int DT>
LC_HD int dt_or(int rt) {
  return DT == kAnyDT ? rt : DT;
}
LC_HD constexpr int64_t pair_code(int a, int b) { return a | (b << 8); }

// f(DTc<dt>{}) for one tensor's dtype code (kMixed or any other code: the run-time body).
template <class F>
LC_DEV void dispatch_dt(int64_t code, F&& f) {
  switch (code) {
    case LC_FLOAT32: f(DTc<LC_FLOAT32>{}); break;
    case LC_BFLOAT16: f(DTc<LC_BFLOAT16>{}); break;
    case LC_FLOAT16: f(DTc<LC_FLOAT16>{}); break;
    default: f(DTc<kAnyDT>{});
  }
}

// f(DTc<a>{}, DTc<b>{}) for a (gradient, momentum) code a | b << 8: the combinations a step meets
// (fp32 / fp32, 16-bit gradients with fp32 momenta, bf16 / bf16) compiled each; others run time.
template <class F>
LC_DEV void dispatch_pair(int64_t code, F&& f) {
  switch (code) {
    case pair_code(LC_FLOAT32, LC_FLOAT32): f(DTc<LC_FLOAT32>{}, DTc<LC_FLOAT32>{}); break;
    case pair_code(LC_BFLOAT16, LC_FLOAT32): f(DTc<LC_BFLOAT16>{}, DTc<LC_FLOAT32>{}); break;
    case pair_code(LC_FLOAT16, LC_FLOAT32): f(DTc<LC_FLOAT16>{}, DTc<LC_FLOAT32>{}); break;
    case pair_code(LC_BFLOAT16, LC_BFLOAT16): f(DTc<LC_BFLOAT16>{}, DTc<LC_BFLOAT16>{}); break;
    default: f(DTc<kAnyDT>{}, DTc<kAnyDT>{});
  }
}

// ----------------------------------------------------------------------------- 8-element I/O
// 8 elements as loaded, not yet converted: fp32 bits in w[0..7], 16-bit values two per word in w[0..3]
// (element 2i in the low half). A thread issues the loads of all its units first and converts them
// after (raw_to_f8), so that 2-4 units' loads are in flight at once, never one unit at a time.
struct Raw8 {
  uint32_t w[8];
};

LC_HD bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// 16-byte loads and stores of the bulk data as global-memory accesses cached in L2 only (the addresses
// are integers in the meta, so the compiler could not tell their space and made generic ones); streamed
// data gains nothing from L1. The host emulation reads and writes plainly.
LC_HD uint4 ld16(const void* p) {
#ifdef __CUDA_ARCH__
  return __ldcg(reinterpret_cast<const uint4*>(p));
#else
  return *reinterpret_cast<const uint4*>(p);
#endif
}
LC_HD void st16(void* p, uint4 x) {
#ifdef __CUDA_ARCH__
  __stcg(reinterpret_cast<uint4*>(p), x);
#else
  *reinterpret_cast<uint4*>(p) = x;
#endif
}
LC_HD uint4 u4(float x, float y, float z, float w) {
  uint4 r;
  r.x = f2u(x);
  r.y = f2u(y);
  r.z = f2u(z);
  r.w = f2u(w);
  return r;
}

// Elements j..j+n-1 (n <= 8) of a tensor of dtype DT (dt_rt: the run-time code) at addr; 16-byte vector
// loads when the 8 elements are all there and 16-byte aligned (FULL: the caller knows they are, so
// no scalar path is compiled). Elements past n read as 0.
template <int DT, bool FULL = false>
LC_HD void load_raw8(uint64_t addr, int dt_rt, int64_t j, int n, Raw8& r) {
  if (dt_or<DT>(dt_rt) == LC_FLOAT32) {
    const uint32_t* __restrict__ p = reinterpret_cast<const uint32_t*>(addr) + j;
    if (FULL || (n == 8 && aligned16(p))) {
      const uint4 x0 = ld16(p), x1 = ld16(p + 4);
      r.w[0] = x0.x; r.w[1] = x0.y; r.w[2] = x0.z; r.w[3] = x0.w;
      r.w[4] = x1.x; r.w[5] = x1.y; r.w[6] = x1.z; r.w[7] = x1.w;
    } else {
      LC_UNROLL
      for (int i = 0; i < 8; ++i) r.w[i] = i < n ? p[i] : 0u;
    }
  } else {
    const uint16_t* __restrict__ p = reinterpret_cast<const uint16_t*>(addr) + j;
    if (FULL || (n == 8 && aligned16(p))) {
      const uint4 x = ld16(p);
      r.w[0] = x.x; r.w[1] = x.y; r.w[2] = x.z; r.w[3] = x.w;
    } else {
      LC_UNROLL
      for (int i = 0; i < 4; ++i) {
        const uint32_t lo = 2 * i < n ? p[2 * i] : 0u, hi = 2 * i + 1 < n ? p[2 * i + 1] : 0u;
        r.w[i] = lo | (hi << 16);
      }
    }
    LC_UNROLL
    for (int i = 4; i < 8; ++i) r.w[i] = 0u;
  }
}

// The 8 loaded elements as fp32.
template <int DT>
LC_HD void raw_to_f8(const Raw8& r, int dt_rt, float v[8]) {
  const int dt = dt_or<DT>(dt_rt);
  LC_UNROLL
  for (int i = 0; i < 8; ++i)
    v[i] = dt == LC_FLOAT32 ? u2f(r.w[i]) : from16(dt, static_cast<uint16_t>(r.w[i >> 1] >> (16 * (i & 1))));
}

// Store v[0..n-1] into elements j.. of a tensor of dtype DT, rounding once to it.
template <int DT, bool FULL = false>
LC_HD void store8(uint64_t addr, int dt_rt, int64_t j, int n, const float v[8]) {
  const int dt = dt_or<DT>(dt_rt);
  if (dt == LC_FLOAT32) {
    float* __restrict__ p = reinterpret_cast<float*>(addr) + j;
    if (FULL || (n == 8 && aligned16(p))) {
      st16(p, u4(v[0], v[1], v[2], v[3]));
      st16(p + 4, u4(v[4], v[5], v[6], v[7]));
    } else {
      LC_UNROLL
      for (int i = 0; i < 8; ++i)
        if (i < n) p[i] = v[i];
    }
  } else {
    uint16_t* __restrict__ p = reinterpret_cast<uint16_t*>(addr) + j;
    uint16_t h[8];
    LC_UNROLL
    for (int i = 0; i < 8; ++i) h[i] = to16(dt, v[i]);
    if (FULL || (n == 8 && aligned16(p))) {
      uint4 x;
      x.x = h[0] | (static_cast<uint32_t>(h[1]) << 16);
      x.y = h[2] | (static_cast<uint32_t>(h[3]) << 16);
      x.z = h[4] | (static_cast<uint32_t>(h[5]) << 16);
      x.w = h[6] | (static_cast<uint32_t>(h[7]) << 16);
      st16(p, x);
    } else {
      LC_UNROLL
      for (int i = 0; i < 8; ++i)
        if (i < n) p[i] = h[i];
    }
  }
}

// Δ of 8 elements into a flat fp32 buffer at element e0 (n <= 8 of them).
LC_HD void store_delta8(float* __restrict__ out, int64_t e0, int n, const float d[8]) {
  float* p = out + e0;
  if (n == 8 && aligned16(p)) {
    st16(p, u4(d[0], d[1], d[2], d[3]));
    st16(p + 4, u4(d[4], d[5], d[6], d[7]));
  } else {
    LC_UNROLL
    for (int i = 0; i < 8; ++i)
      if (i < n) p[i] = d[i];
  }
}

// One element of dtype DT as loaded (fp32 bits or the 16-bit value), and as fp32.
template <int DT>
LC_HD uint32_t load_raw1(uint64_t addr, int dt_rt, int64_t j) {
  if (dt_or<DT>(dt_rt) == LC_FLOAT32) return reinterpret_cast<const uint32_t*>(addr)[j];
  return reinterpret_cast<const uint16_t*>(addr)[j];
}
template <int DT>
LC_HD float raw1_to_f(uint32_t r, int dt_rt) {
  const int dt = dt_or<DT>(dt_rt);
  return dt == LC_FLOAT32 ? u2f(r) : from16(dt, static_cast<uint16_t>(r));
}

// ----------------------------------------------------------------------------- tensor lookup
struct Tensor {
  uint64_t a, b;
  int64_t offset, numel, chunk_start;
  int dta, dtb;
};

LC_HD Tensor read_meta(const lc_tensor_meta* __restrict__ meta, int t) {
  Tensor r;
  r.a = meta[t].a;
  r.b = meta[t].b;
  r.offset = meta[t].offset;
  r.numel = meta[t].numel;
  r.chunk_start = meta[t].chunk_start;
  const int64_t d = meta[t].dtypes;
  r.dta = static_cast<int>(d & 0xff);
  r.dtb = static_cast<int>((d >> 8) & 0xff);
  return r;
}

// Largest t in [lo, n) with meta[t].offset <= e, or lo - 1 if none.
LC_HD int search_offset(const lc_tensor_meta* __restrict__ meta, int lo, int n, int64_t e) {
  int hi = n - 1, ans = lo - 1;
  while (lo <= hi) {
    const int mid = (lo + hi) >> 1;
    if (meta[mid].offset <= e) {
      ans = mid;
      lo = mid + 1;
    } else {
      hi = mid - 1;
    }
  }
  return ans;
}

// The tensor holding bucket element e (meta sorted by offset), or -1 for a gap/padding.
// `hint` caches the last answer: a thread's elements only grow, so this is usually a
// single comparison.
LC_HD int locate(const lc_tensor_meta* __restrict__ meta, int n, int64_t e, int& hint) {
  int h = hint;
  if (h < 0 || e < meta[h].offset) {
    h = search_offset(meta, 0, n, e);
  } else if (h + 1 < n && e >= meta[h + 1].offset) {
    h = search_offset(meta, h + 1, n, e);
  }
  hint = h;
  return (h >= 0 && e < meta[h].offset + meta[h].numel) ? h : -1;
}

// The entry (tensor or piece) owning global chunk `chunk` of an array with chunk_start ascending.
template <class M>
LC_HD int search_chunk_of(const M* __restrict__ meta, int n, int64_t chunk) {
  int lo = 0, hi = n - 1, ans = 0;
  while (lo <= hi) {
    const int mid = (lo + hi) >> 1;
    if (meta[mid].chunk_start <= chunk) {
      ans = mid;
      lo = mid + 1;
    } else {
      hi = mid - 1;
    }
  }
  return ans;
}

// The tensor owning global chunk `chunk` (chunk_start ascending in array order).
LC_HD int search_chunk(const lc_tensor_meta* __restrict__ meta, int n, int64_t chunk) {
  return search_chunk_of(meta, n, chunk);
}

// The chunk [c0, c1) of an entry of `numel` elements starting at chunk `first`, as a block walks it:
// thread x takes the units (8 elements) c0 + 8x + 8*kThreads*k, U of them per round (k = 0..U-1: their
// loads first, then their math and stores); f(j, n): the rounds' unit starts and sizes (n = 0: none).
template <int U, class F>
LC_DEV void chunk_rounds(int64_t c0, int64_t c1, F&& f) {
  for (int64_t j0 = c0 + 8 * static_cast<int64_t>(threadIdx.x); j0 < c1; j0 += 8 * kThreads * U) {
    int64_t j[U];
    int n[U];
    LC_UNROLL
    for (int k = 0; k < U; ++k) {
      j[k] = j0 + 8 * kThreads * k;
      const int64_t rem = c1 - j[k];
      n[k] = rem <= 0 ? 0 : (rem < 8 ? static_cast<int>(rem) : 8);
    }
    f(j, n);
  }
}

// ----------------------------------------------------------------------------- units of a bucket
// One unit of 8 bucket elements (at 8u) of a multi-tensor launch, as a thread holds it between its
// loads and its math: the tensor t (-1: a gap, padding or no unit), the place there (j: the index of
// its first element, n <= 8 elements), the tensors' addresses a and b, their dtypes (code = the meta's
// dtypes: a | b << 8) and a's and b's 8 elements as loaded (x, y).
struct Slot {
  uint64_t a, b;
  int64_t j;
  int t, n, code;
  bool full;  // n == 8 and both tensors 16-byte aligned (j is a multiple of 8: the base decides)
  Raw8 x, y;
};
LC_HD int dt_a(const Slot& s) { return s.code & 0xff; }
LC_HD int dt_b(const Slot& s) { return (s.code >> 8) & 0xff; }

// The slot of unit u (no tensor when !valid), by locate (hint as there: a thread's units only grow).
LC_HD void find_slot(const lc_tensor_meta* __restrict__ meta, int nt, int64_t u, bool valid, int& hint, Slot& s) {
  s.t = valid ? locate(meta, nt, 8 * u, hint) : -1;
  s.n = 0;
  s.code = 0;
  s.full = true;
  if (s.t < 0) return;
  s.a = meta[s.t].a;
  s.b = meta[s.t].b;
  s.j = 8 * u - meta[s.t].offset;
  const int64_t rem = meta[s.t].numel - s.j;
  s.n = rem < 8 ? static_cast<int>(rem) : 8;
  s.code = static_cast<int>(meta[s.t].dtypes & 0xffff);
  s.full = s.n == 8 && aligned16(reinterpret_cast<const void*>(s.a)) && aligned16(reinterpret_cast<const void*>(s.b));
}

// The loads of a slot with a tensor: a's elements, and b's when `two`.
template <int DTA, int DTB, bool FULL>
LC_HD void load_slot(Slot& s, bool two) {
  if (s.t < 0) return;
  load_raw8<DTA, FULL>(s.a, dt_a(s), s.j, s.n, s.x);
  if (two) load_raw8<DTB, FULL>(s.b, dt_b(s), s.j, s.n, s.y);
}

// A thread's round of U slots: all their loads first, then body(k) for each slot (its math and stores);
// body also runs for slots without a tensor (their outputs are zeros). Run-time dtypes: the dtype only
// picks the width of a load. When every slot with a tensor is whole and aligned (the usual round) the
// loads are vector accesses only; else, with SPLIT, one slot at a time (its loads, with the scalar paths
// of partial and unaligned units, then its body: the fewest registers, the body compiled twice), without
// SPLIT all loads first on that path too (the body compiled once).
template <bool SPLIT, int U, class Body>
LC_DEV void run_slots(Slot (&s)[U], bool two, Body&& body) {
  bool full = true;
  LC_UNROLL
  for (int k = 0; k < U; ++k) full = full && s[k].full;
  if (full) {
    LC_UNROLL
    for (int k = 0; k < U; ++k) load_slot<kAnyDT, kAnyDT, true>(s[k], two);
  } else if (!SPLIT) {
    LC_UNROLL
    for (int k = 0; k < U; ++k) load_slot<kAnyDT, kAnyDT, false>(s[k], two);
  }
  if (SPLIT && !full) {
    LC_UNROLL
    for (int k = 0; k < U; ++k) {
      load_slot<kAnyDT, kAnyDT, false>(s[k], two);
      body(k);
    }
  } else {
    LC_UNROLL
    for (int k = 0; k < U; ++k) body(k);
  }
}

// The 8 loaded elements of dtype code dt as fp32, and a store of 8 values: one switch per unit into the
// body compiled for that dtype (no dtype test per element).
LC_HD void to_f8(const Raw8& r, int dt, float v[8]) {
  switch (dt) {
    case LC_FLOAT32: raw_to_f8<LC_FLOAT32>(r, dt, v); break;
    case LC_BFLOAT16: raw_to_f8<LC_BFLOAT16>(r, dt, v); break;
    default: raw_to_f8<LC_FLOAT16>(r, dt, v);
  }
}
LC_HD void store8_dt(uint64_t addr, int dt, int64_t j, int n, const float v[8]) {
  switch (dt) {
    case LC_FLOAT32: store8<LC_FLOAT32>(addr, dt, j, n, v); break;
    case LC_BFLOAT16: store8<LC_BFLOAT16>(addr, dt, j, n, v); break;
    default: store8<LC_FLOAT16>(addr, dt, j, n, v);
  }
}

// ----------------------------------------------------------------------------- Lion math
// c = fl(fl(m*b1) + fl(g*omb1)), like m.float().mul(beta1).add_(g.float().mul(1 - beta1)).
LC_HD float lion_c(float m, float g, const lc_lion_args& la) { return fadd(fmul(m, la.b1), fmul(g, la.omb1)); }
LC_HD float lion_m(float m, float g, const lc_lion_args& la) { return fadd(fmul(m, la.b2), fmul(g, la.omb2)); }

// The momentum update of 8 elements (m <- fl(fl(m*b2) + fl(g*omb2))), stored rounded once to m's dtype.
template <int DTM, bool FULL = false>
LC_HD void momentum_store8(const float g[8], float m[8], uint64_t addr, int dt_rt, int64_t j, int n,
                           const lc_lion_args& la) {
  LC_UNROLL
  for (int i = 0; i < 8; ++i) m[i] = lion_m(m[i], g[i], la);
  store8<DTM, FULL>(addr, dt_rt, j, n, m);
}

// The local step of a loaded slot (g = a, m = b; reference.local_step): its sign and nonzero bytes; adds
// to the non-finite / zero counters; with upd, the momentum update in the same pass.
LC_HD void local_slot(const Slot& s, const lc_lion_args& la, bool upd, uint32_t& sbyte, uint32_t& zbyte, int& nbad,
                      int& nzero) {
  float g[8], m[8];
  to_f8(s.x, dt_a(s), g);
  to_f8(s.y, dt_b(s), m);
  sbyte = 0;
  zbyte = 0;
  LC_UNROLL
  for (int i = 0; i < 8; ++i) {
    if (i < s.n) {
      const float c = lion_c(m[i], g[i], la);
      const bool fin = is_finite(c);
      if (fin && c > 0.0f) sbyte |= 1u << i;
      if (fin && c != 0.0f) zbyte |= 1u << i;
      nbad += fin ? 0 : 1;
      nzero += c == 0.0f ? 1 : 0;
    }
  }
  if (upd) {
    LC_UNROLL
    for (int i = 0; i < 8; ++i) m[i] = lion_m(m[i], g[i], la);
    store8_dt(s.b, dt_b(s), s.j, s.n, m);
  }
}

// ----------------------------------------------------------------------------- apply
// theta <- fl(theta*decay) (rounded to the dtype); theta <- fl(theta + fl(Δ*neg_lr)); x: theta as loaded.
template <int DT, bool FULL>
LC_HD void apply_raw8(const Raw8& x, uint64_t addr, int dt_rt, int64_t j, int n, const float d[8],
                      const lc_apply_args& a) {
  const int dt = dt_or<DT>(dt_rt);
  float v[8];
  raw_to_f8<DT>(x, dt, v);
  LC_UNROLL
  for (int i = 0; i < 8; ++i) {
    float t = v[i];
    if (a.apply_decay) t = round_to(dt, fmul(t, a.decay));
    v[i] = fadd(t, fmul(d[i], a.neg_lr));
  }
  store8<DT, FULL>(addr, dt, j, n, v);
}

// Apply Δ to a loaded apply slot (its parameter in a; nothing for a gap or padding), in the body
// compiled for the parameter's dtype.
LC_HD void apply_slot(const Slot& s, const float d[8], const lc_apply_args& a) {
  if (s.t < 0) return;
  switch (dt_a(s)) {
    case LC_FLOAT32: apply_raw8<LC_FLOAT32, false>(s.x, s.a, LC_FLOAT32, s.j, s.n, d, a); break;
    case LC_BFLOAT16: apply_raw8<LC_BFLOAT16, false>(s.x, s.a, LC_BFLOAT16, s.j, s.n, d, a); break;
    default: apply_raw8<LC_FLOAT16, false>(s.x, s.a, LC_FLOAT16, s.j, s.n, d, a);
  }
}

// ----------------------------------------------------------------------------- int8
struct Acc {
  double s;        // l1: ordered sum |c|; linf: max |c|; l0: ordered sum of log(m) over nonzero |c|
  long long n;     // l0: number of nonzero |c|
  long long esum;  // l0: sum of the exponents e of the nonzero |c| = m * 2^e (exact)
};

// l1 / l0 add (the lane tree and the block order of lcc), linf takes the max.
LC_HD Acc acc_combine(Acc x, Acc y, int kind) {
  if (kind == LC_SCALE_LINF) {
    x.s = y.s > x.s ? y.s : x.s;
  } else {
    x.s = lcc::dadd(x.s, y.s);
    x.n += y.n;
    x.esum += y.esum;
  }
  return x;
}

// The per-tensor scale from the reduced statistic (reference.int8_scale); with bits (comm="bbit", 1..4)
// the ratio of the b-bit codes instead (reference.bbit_ratio).
LC_HD float int8_scale_of(Acc tot, int64_t numel, int kind, int bits = 0) {
  float a;
  if (kind == LC_SCALE_L1) a = lcc::l1_scale(tot.s, numel);
  else if (kind == LC_SCALE_LINF) a = static_cast<float>(tot.s);
  else a = lcc::l0_scale(tot.esum, tot.s, tot.n);
  return bits ? lcc::bbit_ratio(a, kind, bits) : a;
}

// The codes of a loaded slot (scale a of its tensor; a not > 0 or not finite: all 0).
LC_HD void int8_slot(const Slot& s, const lc_lion_args& la, int levels, float a, int8_t q[8]) {
  float g[8], m[8];
  to_f8(s.x, dt_a(s), g);
  to_f8(s.y, dt_b(s), m);
  const bool ok = (a > 0.0f) && is_finite(a);
  const float hs = static_cast<float>(levels) * 0.5f;  // exact
  const float lim = static_cast<float>(levels);
  LC_UNROLL
  for (int i = 0; i < 8; ++i) {
    q[i] = 0;
    if (ok && i < s.n) {
      float c = lion_c(m[i], g[i], la);
      if (!is_finite(c)) c = 0.0f;
      float x = rint_even(fdiv(fmul(c, hs), a));
      x = fmin_(fmax_(x, -lim), lim);
      q[i] = static_cast<int8_t>(static_cast<int>(x));
    }
  }
}

LC_HD void store_q8(int8_t* __restrict__ out, int64_t e0, const int8_t q[8]) {
  int8_t* p = out + e0;
  if ((reinterpret_cast<uintptr_t>(p) & 7u) == 0) {
    uint2 x;
    x.x = static_cast<uint8_t>(q[0]) | (static_cast<uint32_t>(static_cast<uint8_t>(q[1])) << 8) |
          (static_cast<uint32_t>(static_cast<uint8_t>(q[2])) << 16) |
          (static_cast<uint32_t>(static_cast<uint8_t>(q[3])) << 24);
    x.y = static_cast<uint8_t>(q[4]) | (static_cast<uint32_t>(static_cast<uint8_t>(q[5])) << 8) |
          (static_cast<uint32_t>(static_cast<uint8_t>(q[6])) << 16) |
          (static_cast<uint32_t>(static_cast<uint8_t>(q[7])) << 24);
    *reinterpret_cast<uint2*>(p) = x;
  } else {
    LC_UNROLL
    for (int i = 0; i < 8; ++i) p[i] = q[i];
  }
}

// ----------------------------------------------------------------------------- comm="bbit"
// The tie-index table looked up once per unit (8 elements: a byte; 32: a word) instead of once per
// tied element: the row of the unit's first position e0 gives the tie indices of e0 .. stop-1 as
// base + (e - e0); a row that starts inside the unit (never for conventions.tie_segments' tables,
// whose positions are multiples of 8) is looked up again from there. Same indices, same bits.
struct TieRun {
  uint64_t base;
  int64_t e0, stop;
};
LC_HD TieRun tie_run(const int64_t* __restrict__ rows, int64_t nrows, int64_t e0) {
  if (nrows <= 0) return TieRun{static_cast<uint64_t>(e0), e0, INT64_MAX};
  const int64_t k = lcc::tie_row(rows, nrows, e0);
  return TieRun{static_cast<uint64_t>(rows[2 * k + 1]) + static_cast<uint64_t>(e0 - rows[2 * k]), e0,
                k + 1 < nrows ? rows[2 * (k + 1)] : INT64_MAX};
}
LC_HD uint64_t tie_index_in(const TieRun& run, const int64_t* __restrict__ rows, int64_t nrows, int64_t e) {
  return e < run.stop ? run.base + static_cast<uint64_t>(e - run.e0) : lcc::tie_index(rows, nrows, e);
}

// The b-bit local step of a loaded slot at bucket element e0 (reference.bbit_local_step): bit i of
// codes[j] is bit j of element e0 + i's code, zbyte its nonzero bits; adds the zeros of c to nzero; the
// momentum update when asked. ratio: its tensor's ratio. Gaps and padding: all 0.
template <int BITS>
LC_HD void bbit_slot(const Slot& s, int64_t e0, const lc_lion_args& la, bool upd, float ratio, const lc_bbit_args& bb,
                     uint32_t codes[BITS], uint32_t& zbyte, int& nzero) {
  LC_UNROLL
  for (int j = 0; j < BITS; ++j) codes[j] = 0;
  zbyte = 0;
  if (s.t < 0) return;
  float g[8], m[8];
  to_f8(s.x, dt_a(s), g);
  to_f8(s.y, dt_b(s), m);
  const bool dither = bb.rounding == LC_ROUND_DITHER;
  const TieRun run = dither ? tie_run(bb.tie_rows, bb.tie_nrows, e0) : TieRun{0u, e0, e0};
  LC_UNROLL
  for (int i = 0; i < 8; ++i) {
    if (i < s.n) {
      const float c = lion_c(m[i], g[i], la);
      const bool fin = is_finite(c);
      if (fin && c != 0.0f) zbyte |= 1u << i;
      nzero += c == 0.0f ? 1 : 0;
      const float d = dither ? lcc::dither_u(bb.seed, tie_index_in(run, bb.tie_rows, bb.tie_nrows, e0 + i)) : 0.0f;
      const uint32_t k = lcc::bbit_code(fin ? c : 0.0f, ratio, BITS, bb.rounding, d);
      LC_UNROLL
      for (int j = 0; j < BITS; ++j) codes[j] |= ((k >> j) & 1u) << i;
    }
  }
  if (upd) {
    LC_UNROLL
    for (int i = 0; i < 8; ++i) m[i] = lion_m(m[i], g[i], la);
    store8_dt(s.b, dt_b(s), s.j, s.n, m);
  }
}

// Rows -> number of bit-sliced levels (a counter of up to 2**KB - 1). 4 levels for
// every rows <= 15: fewer kernel variants to compile, and the counting is never the
// bottleneck of these memory-bound kernels.
inline int levels_for_rows(int rows) {
  if (rows <= 15) return 4;
  if (rows <= 255) return 8;
  if (rows <= LC_MAX_ROWS) return 16;
  return 0;
}

// The multiprocessors of the current device (cached per device).
inline int device_sms(int& dev) {
  static int sms_cache[64] = {0};
  dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) dev = 0;
  int sms = (dev >= 0 && dev < 64) ? sms_cache[dev] : 0;
  if (sms <= 0) {
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) sms = 108;
    if (dev >= 0 && dev < 64) sms_cache[dev] = sms;  // benign race: every writer stores the same value
  }
  return sms;
}

// Blocks of a grid-stride launch over `items` work items of `per_block` each: never more than the
// work needs, at most 8 per SM; lc::launch then trims it to one full wave of the kernel's own
// occupancy (resident_blocks). Every kernel's result is independent of its grid (tests: any SM count).
inline int grid_for(int64_t items, int64_t per_block) {
  int dev = 0;
  const int sms = device_sms(dev);
  int64_t want = (items + per_block - 1) / per_block;
  const int64_t cap = static_cast<int64_t>(sms) * 8;
  if (want > cap) want = cap;
  if (want < 1) want = 1;
  return static_cast<int>(want);
}

// Blocks of `block` threads of `kernel` that one SM holds at once (its registers and shared memory:
// the occupancy API), cached per kernel, block size and device; thread_local: no lock on a launch.
// A grid of SMs x this many blocks is one full wave (8 per SM at 40-64 registers was 1.3-2 waves).
template <class K>
inline int resident_blocks(K kernel, int block, int dev) {
  struct Entry {
    const void* kernel;
    int dev, block, blocks;
  };
  thread_local Entry cache[64];
  thread_local int used = 0;
  const void* key = reinterpret_cast<const void*>(kernel);
  for (int i = 0; i < used; ++i)
    if (cache[i].kernel == key && cache[i].dev == dev && cache[i].block == block) return cache[i].blocks;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, block, 0) != cudaSuccess || n < 1) n = 1;
  if (used < 64) cache[used++] = Entry{key, dev, block, n};
  return n;
}

// ----------------------------------------------------------------------------- launches
// Every kernel starts through lc::launch: `grid` blocks of `block` threads on `stream`; returns the
// launch's error. nvcc launches it on the GPU. A host compiler builds these sources only for the
// test-only emulation (tests/cuda_emu), which defines lc_host_launch: it runs the same kernel
// function once per emulated thread (`body(ctx)`), with the thread's coordinates set.
#if !defined(__CUDACC__)
extern "C" cudaError_t lc_host_launch(int grid, int block, cudaStream_t stream, void (*body)(const void*),
                                      const void* ctx);
#endif

template <class... P, class... A>
inline cudaError_t launch(void (*kernel)(P...), int grid, int block, cudaStream_t stream, A... args) {
  static_assert(sizeof...(P) == sizeof...(A), "one argument per kernel parameter");
  int dev = 0;
  const int sms = device_sms(dev);
  const int64_t wave = static_cast<int64_t>(sms) * resident_blocks(kernel, block, dev);
  if (grid > wave) grid = static_cast<int>(wave);
#if defined(__CUDACC__)
  kernel<<<grid, block, 0, stream>>>(static_cast<P>(args)...);
  return cudaGetLastError();
#else
  const auto call = [kernel, args...]() { kernel(static_cast<P>(args)...); };
  return lc_host_launch(grid, block, stream,
                        [](const void* c) { (*static_cast<const decltype(call)*>(c))(); }, &call);
#endif
}

}  // namespace lc

#endif  // LIONCUB_CUDA_COMMON_CUH_
