// lioncub_common.h -- the scalar contract shared by the C++ CPU kernels (csrc/cpu) and the CUDA
// kernels (csrc/cuda, + the test-only host emulation under tests/). Plain C++17 / CUDA, no torch.
//
// Everything here is __host__ __device__ under nvcc (LC_HD) and plain inline otherwise, and uses
// only integer operations and correctly rounded IEEE operations (+, -, *, / in fp32 or fp64,
// never contracted into a fused multiply-add: device code uses the __*_rn intrinsics, host code
// is built with -ffp-contract=off). So every function gives the same bits on every CPU, ISA and
// GPU, and lioncub_ds/kernels/reference.py (the executable contract) computes the same values with torch.
//
//   * enums: dtype, tie rule, vote mode, int8 scale kind (codes shared with lioncub_ds/conventions.py);
//   * f2u / u2f, bf16 and fp16 <-> fp32 (bf16: round to nearest even, NaN -> 0x7FC0 like torch);
//   * the tie hash of (step, parameter-local index) and the tie-index table lookup (docs/conventions.md);
//   * the int8 L1/L0 scale: fixed-order fp64 sum (lane tree), deterministic log / exp;
//   * the b-bit codes of comm="bbit" (ratio, nearest / dithered rounding) and their sum's sign.
#ifndef LIONCUB_COMMON_H_
#define LIONCUB_COMMON_H_

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define LC_HD __host__ __device__ __forceinline__
#else
#define LC_HD inline
#endif

#if defined(__BYTE_ORDER__) && (__BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__)
#error "lioncub kernels assume a little-endian machine (bit planes are read as little-endian words)"
#endif

// ----------------------------------------------------------------------------- argument structs
// One ABI for the CPU and the CUDA kernels (C layout; csrc/cuda/lioncub_cuda.h uses the same).
//
// The scalars of an apply (vote_apply, lanes_apply, int8_apply), computed on the host by
// lc_make_apply_args exactly like reference.apply_update does: decay = (float)(1.0 - lr*wd) in
// double, apply_decay = ((1.0 - lr*wd) != 1.0) in double, neg_lr = (float)(-lr).
typedef struct lc_apply_args {
  float neg_lr;
  float decay;
  int32_t apply_decay;
  int32_t tie;         // lcc::TieRule
  int32_t vote;        // lcc::VoteMode
  int32_t world_size;  // divisor of the average vote (and cnt of lanes_apply without cnt lanes)
  int64_t step;        // tie rules alternate / hash
  // hash tie rule: the tie-index table, tie_nrows rows of int64 (pos, index) sorted by pos,
  // rows[0].pos == 0 (conventions.tie_segments; lcc::tie_index), in the kernels' memory (host for the
  // CPU, device for CUDA); tie_nrows == 0 (tie_rows NULL): the index is the position
  const int64_t* tie_rows;
  int64_t tie_nrows;
} lc_apply_args;

// The scalars of a local step: b1 = (float)beta1, omb1 = (float)(1.0 - beta1) computed in
// double, likewise b2 / omb2 (exactly what `m.float().mul(beta1)` and
// `g.float().mul(1.0 - beta1)` use).
typedef struct lc_lion_args {
  float b1, omb1, b2, omb2;
} lc_lion_args;

// The scalars of a single-process Lion step (reference.lion_step): the betas as in lc_lion_args,
// neg_lr / decay / apply_decay as in lc_apply_args.
typedef struct lc_lion_step_args {
  lc_lion_args betas;
  float neg_lr;
  float decay;
  int32_t apply_decay;
} lc_lion_step_args;

// One piece of a ZeRO sign all-gather apply (reference.zero_sign_apply): numel consecutive fp32
// elements at `target` take Δ from the vote bits bit .. bit+numel-1 of plane row `row` (the
// owner rank): +1 where the sign bit is set, -1 where not, 0 where the nonzero bit is clear;
// target <- fl(target*decay) (if apply_decay); target <- fl(target + fl(Δ*neg_lr)); then `cast`
// (if not 0) receives target rounded once to cast_dtype (lcc::DType). 64 bytes; chunk_start
// is the prefix sum of LC_CHUNK chunks (CUDA only).
typedef struct lc_zero_piece {
  uint64_t target;
  uint64_t cast;
  int64_t row;
  int64_t bit;
  int64_t numel;
  int64_t chunk_start;
  float neg_lr;
  float decay;
  int32_t apply_decay;
  int32_t cast_dtype;
} lc_zero_piece;

// The settings of a b-bit local step (comm="bbit", reference.bbit_local_step): b-bit codes k in 0..Q
// of c scaled per tensor by its `kind` scale, rounded to the nearest level or dithered with the
// stream `seed` (reference.dither_seed of the step and the rank) at each element's tie index, read
// from the bucket's tie-index table (as in lc_apply_args: tie_nrows rows of (pos, index), in the
// kernels' memory; tie_nrows == 0: the index is the position).
typedef struct lc_bbit_args {
  int32_t bits;      // b, 1..4
  int32_t rounding;  // lcc::Rounding
  int32_t kind;      // lcc::ScaleKind of the per-tensor scale
  uint32_t seed;     // the dither stream
  const int64_t* tie_rows;
  int64_t tie_nrows;
} lc_bbit_args;

inline lc_apply_args lc_make_apply_args(double lr, double weight_decay, int64_t step, int32_t tie, int32_t vote,
                                        int32_t world_size, const int64_t* tie_rows, int64_t tie_nrows) {
  const double decay = 1.0 - lr * weight_decay;  // exactly reference.apply_update
  lc_apply_args a;
  a.neg_lr = static_cast<float>(-lr);
  a.decay = static_cast<float>(decay);
  a.apply_decay = decay != 1.0 ? 1 : 0;
  a.tie = tie;
  a.vote = vote;
  a.world_size = world_size;
  a.step = step;
  a.tie_rows = tie_rows;
  a.tie_nrows = tie_nrows;
  return a;
}

inline lc_lion_args lc_make_lion_args(double beta1, double beta2) {
  lc_lion_args la;
  la.b1 = static_cast<float>(beta1);
  la.omb1 = static_cast<float>(1.0 - beta1);
  la.b2 = static_cast<float>(beta2);
  la.omb2 = static_cast<float>(1.0 - beta2);
  return la;
}

inline lc_lion_step_args lc_make_lion_step_args(double lr, double weight_decay, double beta1, double beta2) {
  const lc_apply_args ap = lc_make_apply_args(lr, weight_decay, 0, 0, 0, 1, nullptr, 0);
  lc_lion_step_args a;
  a.betas = lc_make_lion_args(beta1, beta2);
  a.neg_lr = ap.neg_lr;
  a.decay = ap.decay;
  a.apply_decay = ap.apply_decay;
  return a;
}

namespace lcc {

// ----------------------------------------------------------------------------- enums
// Python declares the same codes once, in lioncub_ds/conventions.py (TIE_RULES, VOTE_MODES, SCALE_KINDS, ROUNDINGS:
// the code of a name is its position in the tuple).
enum DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };
enum TieRule : int32_t { kTieZero = 0, kTieAlternate = 1, kTieHash = 2 };
enum VoteMode : int32_t { kMajority = 0, kAverage = 1 };
enum ScaleKind : int32_t { kScaleL1 = 0, kScaleL0 = 1, kScaleLinf = 2 };
enum Rounding : int32_t { kNearest = 0, kDither = 1 };

// ----------------------------------------------------------------------------- bits
LC_HD uint32_t f2u(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
#endif
}
LC_HD float u2f(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}
LC_HD uint64_t d2u(double d) {
#ifdef __CUDA_ARCH__
  return static_cast<uint64_t>(__double_as_longlong(d));
#else
  uint64_t u;
  memcpy(&u, &d, 8);
  return u;
#endif
}
LC_HD double u2d(uint64_t u) {
#ifdef __CUDA_ARCH__
  return __longlong_as_double(static_cast<long long>(u));
#else
  double d;
  memcpy(&d, &u, 8);
  return d;
#endif
}

// ----------------------------------------------------------------------------- correctly rounded fp64 ops
LC_HD double dadd(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dadd_rn(a, b);
#else
  return a + b;  // -ffp-contract=off: never fused
#endif
}
LC_HD double dmul(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
LC_HD double ddiv(double a, double b) {
#ifdef __CUDA_ARCH__
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

// torch.sign of an fp32 value: +1 / -1, and +0 for +-0 and NaN (both compares are false), so a
// NaN c leaves theta where the decay put it, as in the reference Lion. Branch-free.
LC_HD float lion_sign(float c) {
  return static_cast<float>(static_cast<int32_t>(c > 0.0f) - static_cast<int32_t>(c < 0.0f));
}

// ----------------------------------------------------------------------------- 16-bit floats
LC_HD float bf16_to_f32(uint16_t h) { return u2f(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; any NaN -> 0x7FC0 (what torch's c10::BFloat16 gives). Branch-free
// (a select), so host loops over it vectorize.
LC_HD uint16_t f32_to_bf16(float f) {
  const uint32_t u = f2u(f);
  const uint32_t rne = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rne);
}

// f rounded to bf16 (as f32_to_bf16), returned as the fp32 value of that bf16.
LC_HD float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

LC_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t ex = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (ex == 0x1Fu) return u2f(sign | 0x7F800000u | (man << 13));
  if (ex == 0) {
    const float v = static_cast<float>(man) * 5.9604644775390625e-08f;  // man * 2^-24, exact
    return u2f(f2u(v) | sign);
  }
  return u2f(sign | ((ex + 112u) << 23) | (man << 13));
}

// fp32 -> fp16, round to nearest even; NaN -> quiet NaN (sign kept), overflow -> inf.
LC_HD uint16_t f32_to_f16(float f) {
  const uint32_t x = f2u(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (ax < 0x38800000u) {  // below 2^-14: subnormal half (or 0), round(|f| * 2^24) half to even
    const float v = u2f(ax) * 16777216.0f;  // exact: a power-of-two scale-up
#ifdef __CUDA_ARCH__
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(rintf(v)));
#else
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(__builtin_nearbyintf(v)));
#endif
  }
  uint32_t h = ((((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13));
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

// ----------------------------------------------------------------------------- tie rule (docs/conventions.md)
// The hash tie rule keys on (step, i) where i is the element's index INSIDE ITS PARAMETER,
// never a position in a bucket: reference.tie_hash_sign. uint32 arithmetic mod 2**32; the tied
// coordinate takes +1 when bit 0 of the hash is set, -1 otherwise.
// The hash split for vector loops: tie_hash(step, i) == tie_hash_mix(lo(i) * 0x9E3779B1 +
// tie_hash_base(step, hi(i))), so a run of indices with one high word is a 32-bit loop.
LC_HD uint32_t tie_hash_base(uint64_t step, uint32_t hi) {
  return hi * 0xC2B2AE3Du + static_cast<uint32_t>(step) * 0x85EBCA77u + 0x165667B1u;
}
LC_HD uint32_t tie_hash_mix(uint32_t h) {
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 12;
  h *= 0x297A2D39u;
  h ^= h >> 15;
  return h;
}
LC_HD uint32_t tie_hash(uint64_t step, uint64_t index) {
  return tie_hash_mix(static_cast<uint32_t>(index) * 0x9E3779B1u +
                      tie_hash_base(step, static_cast<uint32_t>(index >> 32)));
}

// Tie-index table (conventions.tie_segments): `nrows` rows of int64 (pos, index), sorted by pos with
// rows[0].pos == 0: position p (relative to element 0 of the planes a kernel reads) has tie
// index rows[k].index + (p - rows[k].pos) for the last row k with rows[k].pos <= p. nrows == 0
// means the single row (0, 0). Looked up only where a tie occurs.
LC_HD int64_t tie_row(const int64_t* rows, int64_t nrows, int64_t pos) {
  int64_t lo = 0, hi = nrows - 1;  // rows[0].pos == 0 <= pos
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (rows[2 * mid] <= pos) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}
LC_HD uint64_t tie_index(const int64_t* rows, int64_t nrows, int64_t pos) {
  if (nrows <= 0) return static_cast<uint64_t>(pos);
  const int64_t k = tie_row(rows, nrows, pos);
  return static_cast<uint64_t>(rows[2 * k + 1]) + static_cast<uint64_t>(pos - rows[2 * k]);
}
// First position after `pos` where a new row starts (INT64_MAX if none).
LC_HD int64_t tie_next_start(const int64_t* rows, int64_t nrows, int64_t pos) {
  if (nrows <= 0) return INT64_MAX;
  const int64_t k = tie_row(rows, nrows, pos);
  return k + 1 < nrows ? rows[2 * (k + 1)] : INT64_MAX;
}

// The value (-1, 0, +1) a tied coordinate at tie index `index` takes under `rule`.
LC_HD int tie_value(int rule, int64_t step, uint64_t index) {
  if (rule == kTieAlternate) return (step & 1) ? 1 : -1;
  if (rule == kTieHash) return (tie_hash(static_cast<uint64_t>(step), index) & 1u) ? 1 : -1;
  return 0;
}

// ----------------------------------------------------------------------------- int8 scales (docs/conventions.md)
// The L1 / L0 scales sum per tensor in an order this project defines (reference.ordered_sum):
// blocks of kSumBlock elements from element 0; in a block, lane l (0..kSumLanes-1) adds the
// fp64 values of elements l, l + kSumLanes, l + 2*kSumLanes, ... in index order starting
// from +0.0 (an element that does not contribute adds nothing); the lanes are combined by the
// tree of lane_tree(); the tensor sum adds the block results in block order starting from +0.0.
constexpr int64_t kSumBlock = 16384;
constexpr int kSumLanes = 256;

// for s = 128, 64, ..., 1: acc[l] = acc[l] + acc[l + s] for l < s; the result is acc[0].
LC_HD double lane_tree(double* acc) {
  for (int s = kSumLanes / 2; s > 0; s >>= 1)
    for (int l = 0; l < s; ++l) acc[l] = dadd(acc[l], acc[l + s]);
  return acc[0];
}

// ln2, sqrt(2), 1/ln2 rounded to double; 1/(2k+1) for k = 0..10 and 1/k! for k = 0..14,
// each the double nearest the exact value (reference._LOG_COEF / _EXP_COEF hold the same).
constexpr double kLn2 = 0x1.62e42fefa39efp-1;
constexpr double kSqrt2 = 0x1.6a09e667f3bcdp+0;
constexpr double kInvLn2 = 0x1.71547652b82fep+0;

// x > 0 finite (fp32): x = m * 2^e with m in (sqrt(2)/2, sqrt(2)], e an integer (exact, via
// the bits of (double)x); returns e and stores log(m) = 2*atanh(s), s = (m - 1)/(m + 1), as
// the Horner polynomial t = C10; t = t*s^2 + Ck (k = 9..0); log(m) = (s + s)*t.
LC_HD int64_t log_parts(float x, double* logm) {
  const double coef[11] = {0x1.0000000000000p+0, 0x1.5555555555555p-2, 0x1.999999999999ap-3,
                           0x1.2492492492492p-3, 0x1.c71c71c71c71cp-4, 0x1.745d1745d1746p-4,
                           0x1.3b13b13b13b14p-4, 0x1.1111111111111p-4, 0x1.e1e1e1e1e1e1ep-5,
                           0x1.af286bca1af28p-5, 0x1.8618618618618p-5};
  const uint64_t b = d2u(static_cast<double>(x));
  int64_t e = static_cast<int64_t>((b >> 52) & 0x7FF) - 1023;
  double m = u2d((b & 0x000FFFFFFFFFFFFFull) | 0x3FF0000000000000ull);
  if (m > kSqrt2) {
    m = dmul(m, 0.5);
    e += 1;
  }
  const double s = ddiv(dadd(m, -1.0), dadd(m, 1.0));
  const double z = dmul(s, s);
  double t = coef[10];
  for (int k = 9; k >= 0; --k) t = dadd(dmul(t, z), coef[k]);
  *logm = dmul(dadd(s, s), t);
  return e;
}

// exp(y) for the L0 mean: k = floor(y*(1/ln2) + 0.5), r = y - k*ln2, p = 1/14!; p = p*r + 1/j!
// (j = 13..0); result p * 2^k (exact scaling).
LC_HD double det_exp(double y) {
  const double coef[15] = {0x1.0000000000000p+0, 0x1.0000000000000p+0, 0x1.0000000000000p-1,
                           0x1.5555555555555p-3, 0x1.5555555555555p-5, 0x1.1111111111111p-7,
                           0x1.6c16c16c16c17p-10, 0x1.a01a01a01a01ap-13, 0x1.a01a01a01a01ap-16,
                           0x1.71de3a556c734p-19, 0x1.27e4fb7789f5cp-22, 0x1.ae64567f544e4p-26,
                           0x1.1eed8eff8d898p-29, 0x1.6124613a86d09p-33, 0x1.93974a8c07c9dp-37};
#ifdef __CUDA_ARCH__
  const double k = floor(dadd(dmul(y, kInvLn2), 0.5));
#else
  const double k = __builtin_floor(dadd(dmul(y, kInvLn2), 0.5));
#endif
  const double r = dadd(y, -dmul(k, kLn2));
  double p = coef[14];
  for (int j = 13; j >= 0; --j) p = dadd(dmul(p, r), coef[j]);
  // p * 2^k: k is within [-160, 140] for any mean of fp32 logs; two exact power-of-two steps
  const int ki = static_cast<int>(k);
  const int k1 = ki / 2, k2 = ki - k1;
  const double s1 = u2d(static_cast<uint64_t>(1023 + k1) << 52), s2 = u2d(static_cast<uint64_t>(1023 + k2) << 52);
  return dmul(dmul(p, s1), s2);
}

// The L1 scale from the ordered sum of |c| over `numel` elements: fp32(sum / numel).
LC_HD float l1_scale(double sum, int64_t numel) {
  return numel > 0 ? static_cast<float>(ddiv(sum, static_cast<double>(numel))) : 0.0f;
}

// The L0 scale from E = sum of the exponents (exact int64), M = the ordered sum of log(m) and
// nnz = #nonzero |c|: fp32(det_exp(((double)E * ln2 + M) / nnz)).
LC_HD float l0_scale(int64_t esum, double msum, int64_t nnz) {
  if (nnz <= 0) return 0.0f;
  const double y = ddiv(dadd(dmul(static_cast<double>(esum), kLn2), msum), static_cast<double>(nnz));
  return static_cast<float>(det_exp(y));
}

// ----------------------------------------------------------------------------- b-bit scaled votes (comm="bbit")
// reference.bbit_qmax / bbit_ratio / dither_uniform / bbit_codes / decide_sum, element by element.
// fp32 operations are one IEEE rounding each (device: the __*_rn intrinsics; host: -ffp-contract=off).
LC_HD float fmul32(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
LC_HD float fadd32(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
LC_HD float floor32(float x) {
#ifdef __CUDA_ARCH__
  return floorf(x);
#else
  return __builtin_floorf(x);
#endif
}
LC_HD bool finite32(float x) { return (f2u(x) & 0x7f800000u) != 0x7f800000u; }

// Q, the largest level: 1 for b = 1 (levels +-1), 2^b - 2 for b >= 2 (levels -Q..Q in steps of 2).
LC_HD int bbit_qmax(int bits) { return bits == 1 ? 1 : (1 << bits) - 2; }

// fp32(Q / (clip * a)) in fp64 (clip = 1 for linf, else 2: both exact), rounded once; 0 when a is not
// > 0 or not finite (every c of the tensor is then 0 or non-finite: the codes of x = 0).
LC_HD float bbit_ratio(float a, int kind, int bits) {
  if (!(a > 0.0f) || !finite32(a)) return 0.0f;
  const double clip = kind == kScaleLinf ? 1.0 : 2.0;
  return static_cast<float>(ddiv(static_cast<double>(bbit_qmax(bits)), dmul(clip, static_cast<double>(a))));
}

// The dither u in [0, 1) of tie index `index` in stream `seed`: (tie_hash(seed, index) >> 8) * 2^-24, exact.
LC_HD float dither_u(uint32_t seed, uint64_t index) {
  return static_cast<float>(tie_hash(seed, index) >> 8) * 5.9604644775390625e-08f;
}

// The code k (0..Q) of a finite c: x = clamp(fl(c * ratio), -Q, Q); nearest: k = floor(fl(fl(x * 0.5) + h))
// + o (h = 0.5, o = Q/2 for b >= 2; h = 0, o = 1 for b = 1); dither: k = floor(fl(fl(fl(x + Q) * 0.5) + u));
// then capped to 0..Q.
LC_HD uint32_t bbit_code(float c, float ratio, int bits, int rounding, float u) {
  const float q = static_cast<float>(bbit_qmax(bits));
  float x = fmul32(c, ratio);
  x = x < -q ? -q : (x > q ? q : x);
  float k;
  if (rounding == kNearest) {
    const float h = bits == 1 ? 0.0f : 0.5f, o = bits == 1 ? 1.0f : fmul32(q, 0.5f);
    k = fadd32(floor32(fadd32(fmul32(x, 0.5f), h)), o);
  } else {
    k = floor32(fadd32(fmul32(fadd32(x, q), 0.5f), u));
  }
  k = k < 0.0f ? 0.0f : (k > q ? q : k);
  return static_cast<uint32_t>(k);
}

}  // namespace lcc

#endif  // LIONCUB_COMMON_H_
