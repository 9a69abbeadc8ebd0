// lioncub_cuda_common.cuh -- per-element / per-word logic of the fused kernels.
//
// Everything here is __host__ __device__ (LC_HD) and uses only integer ops and
// correctly rounded single fp32 ops (no FMA: __fmul_rn/__fadd_rn/__fdiv_rn on the
// device). The kernels (lioncub_local.cu, lioncub_vote.cu, lioncub_step.cu) add the grid-stride
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
#else
#define LC_HD inline
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

// ----------------------------------------------------------------------------- 8-element I/O
LC_HD float4 f4(float x, float y, float z, float w) {
  float4 r;
  r.x = x;
  r.y = y;
  r.z = z;
  r.w = w;
  return r;
}

// Elements j..j+n-1 (n <= 8, j a multiple of 8) of a tensor of dtype dt at addr, as fp32.
// 16-byte vector loads when the 8 elements are all there and 16-byte aligned.
LC_HD void load8(uint64_t addr, int dt, int64_t j, int n, float v[8]) {
  if (dt == LC_FLOAT32) {
    const float* p = reinterpret_cast<const float*>(addr) + j;
    if (n == 8 && (reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
      const float4 x0 = reinterpret_cast<const float4*>(p)[0];
      const float4 x1 = reinterpret_cast<const float4*>(p)[1];
      v[0] = x0.x; v[1] = x0.y; v[2] = x0.z; v[3] = x0.w;
      v[4] = x1.x; v[5] = x1.y; v[6] = x1.z; v[7] = x1.w;
    } else {
      LC_UNROLL
      for (int i = 0; i < 8; ++i) v[i] = i < n ? p[i] : 0.0f;
    }
  } else {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(addr) + j;
    uint16_t h[8];
    if (n == 8 && (reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
      const uint4 x = *reinterpret_cast<const uint4*>(p);
      h[0] = static_cast<uint16_t>(x.x); h[1] = static_cast<uint16_t>(x.x >> 16);
      h[2] = static_cast<uint16_t>(x.y); h[3] = static_cast<uint16_t>(x.y >> 16);
      h[4] = static_cast<uint16_t>(x.z); h[5] = static_cast<uint16_t>(x.z >> 16);
      h[6] = static_cast<uint16_t>(x.w); h[7] = static_cast<uint16_t>(x.w >> 16);
    } else {
      LC_UNROLL
      for (int i = 0; i < 8; ++i) h[i] = i < n ? p[i] : static_cast<uint16_t>(0);
    }
    LC_UNROLL
    for (int i = 0; i < 8; ++i) v[i] = from16(dt, h[i]);
  }
}

// Store v[0..n-1] into elements j.. of a tensor of dtype dt, rounding once to dt.
LC_HD void store8(uint64_t addr, int dt, int64_t j, int n, const float v[8]) {
  if (dt == LC_FLOAT32) {
    float* p = reinterpret_cast<float*>(addr) + j;
    if (n == 8 && (reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
      reinterpret_cast<float4*>(p)[0] = f4(v[0], v[1], v[2], v[3]);
      reinterpret_cast<float4*>(p)[1] = f4(v[4], v[5], v[6], v[7]);
    } else {
      LC_UNROLL
      for (int i = 0; i < 8; ++i)
        if (i < n) p[i] = v[i];
    }
  } else {
    uint16_t* p = reinterpret_cast<uint16_t*>(addr) + j;
    uint16_t h[8];
    LC_UNROLL
    for (int i = 0; i < 8; ++i) h[i] = to16(dt, v[i]);
    if (n == 8 && (reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
      uint4 x;
      x.x = h[0] | (static_cast<uint32_t>(h[1]) << 16);
      x.y = h[2] | (static_cast<uint32_t>(h[3]) << 16);
      x.z = h[4] | (static_cast<uint32_t>(h[5]) << 16);
      x.w = h[6] | (static_cast<uint32_t>(h[7]) << 16);
      *reinterpret_cast<uint4*>(p) = x;
    } else {
      LC_UNROLL
      for (int i = 0; i < 8; ++i)
        if (i < n) p[i] = h[i];
    }
  }
}

// Δ of 8 elements into a flat fp32 buffer at element e0 (n <= 8 of them).
LC_HD void store_delta8(float* out, int64_t e0, int n, const float d[8]) {
  float* p = out + e0;
  if (n == 8 && (reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
    reinterpret_cast<float4*>(p)[0] = f4(d[0], d[1], d[2], d[3]);
    reinterpret_cast<float4*>(p)[1] = f4(d[4], d[5], d[6], d[7]);
  } else {
    LC_UNROLL
    for (int i = 0; i < 8; ++i)
      if (i < n) p[i] = d[i];
  }
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

// ----------------------------------------------------------------------------- Lion math
// c = fl(fl(m*b1) + fl(g*omb1)), like m.float().mul(beta1).add_(g.float().mul(1 - beta1)).
LC_HD float lion_c(float m, float g, const lc_lion_args& la) { return fadd(fmul(m, la.b1), fmul(g, la.omb1)); }
LC_HD float lion_m(float m, float g, const lc_lion_args& la) { return fadd(fmul(m, la.b2), fmul(g, la.omb2)); }

// The unit of 8 bucket elements at e0 inside tensor t of a local step's bucket: its place in the
// tensor (j: the index of its first element, n <= 8 elements) and its g and m as fp32.
struct Unit {
  Tensor T;
  int64_t j;
  int n;
  float g[8], m[8];
};

LC_HD void load_unit(const lc_tensor_meta* __restrict__ meta, int t, int64_t e0, Unit& u) {
  u.T = read_meta(meta, t);
  u.j = e0 - u.T.offset;
  const int64_t rem = u.T.numel - u.j;
  u.n = rem < 8 ? static_cast<int>(rem) : 8;
  load8(u.T.a, u.T.dta, u.j, u.n, u.g);
  load8(u.T.b, u.T.dtb, u.j, u.n, u.m);
}

// The unit's momentum update, rounded once to m's dtype and stored.
LC_HD void update_unit_momentum(Unit& u, const lc_lion_args& la) {
  LC_UNROLL
  for (int i = 0; i < 8; ++i) u.m[i] = lion_m(u.m[i], u.g[i], la);
  store8(u.T.b, u.T.dtb, u.j, u.n, u.m);
}

// One unit (8 bucket elements, e0 = 8*u) of the local step. Returns the sign and nonzero
// bytes; adds to the non-finite / zero counters; updates the momentum when asked.
LC_HD void local_unit(const lc_tensor_meta* __restrict__ meta, int nt, int64_t e0, const lc_lion_args& la,
                      int update_momentum, int& hint, uint32_t& sbyte, uint32_t& zbyte, int& nbad, int& nzero) {
  sbyte = 0;
  zbyte = 0;
  const int t = locate(meta, nt, e0, hint);
  if (t < 0) return;
  Unit u;
  load_unit(meta, t, e0, u);
  LC_UNROLL
  for (int i = 0; i < 8; ++i) {
    if (i < u.n) {
      const float c = lion_c(u.m[i], u.g[i], la);
      const bool fin = is_finite(c);
      if (fin && c > 0.0f) sbyte |= 1u << i;
      if (fin && c != 0.0f) zbyte |= 1u << i;
      nbad += fin ? 0 : 1;
      nzero += c == 0.0f ? 1 : 0;
    }
  }
  if (update_momentum) update_unit_momentum(u, la);
}

// Elements [j, j+n) of one tensor: m <- fl(fl(m*b2) + fl(g*omb2)).
LC_HD void momentum_unit(const Tensor& T, int64_t j, int n, const lc_lion_args& la) {
  float g[8], m[8];
  load8(T.a, T.dta, j, n, g);
  load8(T.b, T.dtb, j, n, m);
  LC_UNROLL
  for (int i = 0; i < 8; ++i) m[i] = lion_m(m[i], g[i], la);
  store8(T.b, T.dtb, j, n, m);
}

// ----------------------------------------------------------------------------- single-process step

struct LionTensor {
  uint64_t p, g, m;
  int64_t numel, chunk_start;
  int dtp, dtg, dtm;
};

LC_HD LionTensor read_lion_meta(const lc_lion_meta* __restrict__ meta, int t) {
  LionTensor r;
  r.p = meta[t].param;
  r.g = meta[t].grad;
  r.m = meta[t].momentum;
  r.numel = meta[t].numel;
  r.chunk_start = meta[t].chunk_start;
  const int64_t d = meta[t].dtypes;
  r.dtp = static_cast<int>(d & 0xff);
  r.dtg = static_cast<int>((d >> 8) & 0xff);
  r.dtm = static_cast<int>((d >> 16) & 0xff);
  return r;
}

// Elements [j, j+n) (n <= 8) of one tensor: one Lion step (reference.lion_step).
LC_HD void lion_unit(const LionTensor& T, int64_t j, int n, const lc_lion_step_args& a) {
  float g[8], m[8], p[8];
  load8(T.g, T.dtg, j, n, g);
  load8(T.m, T.dtm, j, n, m);
  load8(T.p, T.dtp, j, n, p);
  LC_UNROLL
  for (int i = 0; i < 8; ++i) {
    const float c = lion_c(m[i], g[i], a.betas);
    float x = p[i];
    if (a.apply_decay) x = round_to(T.dtp, fmul(x, a.decay));
    p[i] = fadd(x, fmul(lcc::lion_sign(c), a.neg_lr));
    m[i] = lion_m(m[i], g[i], a.betas);
  }
  store8(T.p, T.dtp, j, n, p);
  store8(T.m, T.dtm, j, n, m);
}

// ----------------------------------------------------------------------------- ZeRO sign all-gather apply
// The n (<= 8) bits starting at bit `bit` of `row`, LSB first; reads only the bytes holding them.
LC_HD uint32_t load_bits8(const uint8_t* __restrict__ row, int64_t bit, int n) {
  const uint8_t* q = row + (bit >> 3);
  const int sh = static_cast<int>(bit & 7);
  uint32_t x = q[0];
  if (sh + n > 8) x |= static_cast<uint32_t>(q[1]) << 8;
  return (x >> sh) & ((1u << n) - 1u);
}

// Elements [j, j+n) (n <= 8) of one piece (lc_zero_piece): Δ from the owner's vote bits, apply,
// then the low-precision copy.
LC_HD void zero_unit(const lc_zero_piece& P, const uint8_t* __restrict__ sign, int64_t sign_stride,
                     const uint8_t* __restrict__ nonzero, int64_t nz_stride, int64_t j, int n) {
  const int64_t b = P.bit + j;
  const uint32_t s = load_bits8(sign + P.row * sign_stride, b, n);
  const uint32_t z = nonzero ? load_bits8(nonzero + P.row * nz_stride, b, n) : 0xffu;
  float v[8];
  load8(P.target, LC_FLOAT32, j, n, v);
  LC_UNROLL
  for (int i = 0; i < 8; ++i) {
    const float d = ((z >> i) & 1u) ? (((s >> i) & 1u) ? 1.0f : -1.0f) : 0.0f;
    float x = v[i];
    if (P.apply_decay) x = fmul(x, P.decay);
    v[i] = fadd(x, fmul(d, P.neg_lr));
  }
  store8(P.target, LC_FLOAT32, j, n, v);
  if (P.cast) store8(P.cast, P.cast_dtype, j, n, v);
}

// ----------------------------------------------------------------------------- apply
// theta <- fl(theta*decay) (rounded to the dtype); theta <- fl(theta + fl(Δ*neg_lr)).
LC_HD void apply8(uint64_t addr, int dt, int64_t j, int n, const float d[8], const lc_apply_args& a) {
  float v[8];
  load8(addr, dt, j, n, v);
  LC_UNROLL
  for (int i = 0; i < 8; ++i) {
    float x = v[i];
    if (a.apply_decay) x = round_to(dt, fmul(x, a.decay));
    v[i] = fadd(x, fmul(d[i], a.neg_lr));
  }
  store8(addr, dt, j, n, v);
}

// Apply the Δ of the unit at bucket element e0 to whichever parameter holds it.
LC_HD void apply_at(const lc_tensor_meta* __restrict__ meta, int nt, int64_t e0, const float d[8],
                    const lc_apply_args& a, int& hint) {
  const int t = locate(meta, nt, e0, hint);
  if (t < 0) return;
  const int64_t off = meta[t].offset, numel = meta[t].numel;
  const int64_t j = e0 - off, rem = numel - j;
  apply8(meta[t].a, static_cast<int>(meta[t].dtypes & 0xff), j, rem < 8 ? static_cast<int>(rem) : 8, d, a);
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

// Element j of a tensor of dtype dt at addr, as fp32.
LC_HD float load1(uint64_t addr, int dt, int64_t j) {
  if (dt == LC_FLOAT32) return reinterpret_cast<const float*>(addr)[j];
  return from16(dt, reinterpret_cast<const uint16_t*>(addr)[j]);
}

// Lane `lane` (0..kThreads-1) of the chunk [c0, c1) of tensor T (c0 a multiple of LC_CHUNK): the
// elements c0 + lane + kThreads*k in index order (lcc's defined order), its partial statistic
// of |c| and its number of non-finite c.
LC_HD Acc int8_thread_partial(const Tensor& T, int64_t c0, int64_t c1, int lane, const lc_lion_args& la, int kind,
                              int& nbad) {
  Acc acc;
  acc.s = 0.0;
  acc.n = 0;
  acc.esum = 0;
  for (int64_t j = c0 + lane; j < c1; j += kThreads) {
    float c = lion_c(load1(T.b, T.dtb, j), load1(T.a, T.dta, j), la);
    if (!is_finite(c)) {
      ++nbad;
      c = 0.0f;
    }
    const float ac = fabs_(c);
    if (kind == LC_SCALE_L1) {
      acc.s = lcc::dadd(acc.s, static_cast<double>(ac));
    } else if (kind == LC_SCALE_LINF) {
      if (static_cast<double>(ac) > acc.s) acc.s = static_cast<double>(ac);
    } else if (ac > 0.0f) {
      double lm;
      acc.esum += lcc::log_parts(ac, &lm);
      acc.s = lcc::dadd(acc.s, lm);
      acc.n += 1;
    }
  }
  return acc;
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

// Codes of the unit at bucket element e0 (gaps and padding: 0).
LC_HD void int8_unit(const lc_tensor_meta* __restrict__ meta, int nt, int64_t e0, const lc_lion_args& la, int levels,
                     const float* __restrict__ scales, int& hint, int8_t q[8]) {
  LC_UNROLL
  for (int i = 0; i < 8; ++i) q[i] = 0;
  const int t = locate(meta, nt, e0, hint);
  if (t < 0) return;
  const float a = scales[t];
  if (!(a > 0.0f) || !is_finite(a)) return;
  Unit u;
  load_unit(meta, t, e0, u);
  const float hs = static_cast<float>(levels) * 0.5f;  // exact
  const float lim = static_cast<float>(levels);
  LC_UNROLL
  for (int i = 0; i < 8; ++i) {
    if (i < u.n) {
      float c = lion_c(u.m[i], u.g[i], la);
      if (!is_finite(c)) c = 0.0f;
      float x = rint_even(fdiv(fmul(c, hs), a));
      x = fmin_(fmax_(x, -lim), lim);
      q[i] = static_cast<int8_t>(static_cast<int>(x));
    }
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
LC_HD TieRun tie_run(const int64_t* rows, int64_t nrows, int64_t e0) {
  if (nrows <= 0) return TieRun{static_cast<uint64_t>(e0), e0, INT64_MAX};
  const int64_t k = lcc::tie_row(rows, nrows, e0);
  return TieRun{static_cast<uint64_t>(rows[2 * k + 1]) + static_cast<uint64_t>(e0 - rows[2 * k]), e0,
                k + 1 < nrows ? rows[2 * (k + 1)] : INT64_MAX};
}
LC_HD uint64_t tie_index_in(const TieRun& run, const int64_t* rows, int64_t nrows, int64_t e) {
  return e < run.stop ? run.base + static_cast<uint64_t>(e - run.e0) : lcc::tie_index(rows, nrows, e);
}
// One unit (8 bucket elements at e0) of the b-bit local step (reference.bbit_local_step): bit i of
// codes[j] is bit j of element e0 + i's code, zbyte its nonzero bits; adds the zeros of c to nzero; the
// momentum update when asked. ratios[t]: tensor t's ratio. Gaps and padding: all 0.
LC_HD void bbit_unit(const lc_tensor_meta* __restrict__ meta, int nt, int64_t e0, const lc_lion_args& la,
                     int update_momentum, const float* __restrict__ ratios, const lc_bbit_args& bb, int& hint,
                     uint32_t codes[4], uint32_t& zbyte, int& nzero) {
  LC_UNROLL
  for (int j = 0; j < 4; ++j) codes[j] = 0;
  zbyte = 0;
  const int t = locate(meta, nt, e0, hint);
  if (t < 0) return;
  Unit u;
  load_unit(meta, t, e0, u);
  const float ratio = ratios[t];
  const TieRun run = bb.rounding == LC_ROUND_DITHER ? tie_run(bb.tie_rows, bb.tie_nrows, e0) : TieRun{0u, e0, e0};
  for (int i = 0; i < u.n; ++i) {
    const float c = lion_c(u.m[i], u.g[i], la);
    const bool fin = is_finite(c);
    if (fin && c != 0.0f) zbyte |= 1u << i;
    nzero += c == 0.0f ? 1 : 0;
    const float d =
        bb.rounding == LC_ROUND_DITHER ? lcc::dither_u(bb.seed, tie_index_in(run, bb.tie_rows, bb.tie_nrows, e0 + i))
                                       : 0.0f;
    const uint32_t k = lcc::bbit_code(fin ? c : 0.0f, ratio, bb.bits, bb.rounding, d);
    LC_UNROLL
    for (int j = 0; j < 4; ++j) codes[j] |= ((k >> j) & 1u) << i;
  }
  if (update_momentum) update_unit_momentum(u, la);
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

// 8 int8 codes of unit u (n <= 8 valid), as sign Δ.
LC_HD void int8_delta8(const int8_t* __restrict__ qsum, int64_t e0, int n, float d[8]) {
  const int8_t* p = qsum + e0;
  int8_t q[8];
  if (n == 8 && (reinterpret_cast<uintptr_t>(p) & 7u) == 0) {
    const uint2 x = *reinterpret_cast<const uint2*>(p);
    LC_UNROLL
    for (int i = 0; i < 4; ++i) {
      q[i] = static_cast<int8_t>(static_cast<uint8_t>(x.x >> (8 * i)));
      q[i + 4] = static_cast<int8_t>(static_cast<uint8_t>(x.y >> (8 * i)));
    }
  } else {
    LC_UNROLL
    for (int i = 0; i < 8; ++i) q[i] = i < n ? p[i] : static_cast<int8_t>(0);
  }
  LC_UNROLL
  for (int i = 0; i < 8; ++i) d[i] = q[i] > 0 ? 1.0f : (q[i] < 0 ? -1.0f : 0.0f);
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
