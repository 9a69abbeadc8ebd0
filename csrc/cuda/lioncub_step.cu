// lioncub_step.cu -- fused CUDA kernels of the single-process Lion step (Lion, LionCub at N = 1,
// the ZeRO-1/2 partition step) and of the ZeRO sign all-gather apply (every rank's partition from
// the all-gathered sign planes: unpack, decay, apply, cast, in one launch).
//
// Both are chunked multi-tensor launches: one block per LC_CHUNK chunk of one tensor (piece),
// grid-stride over the chunks; a thread takes units of 8 consecutive elements, 2 (Lion step) or 4
// (apply) of them per round, all their loads issued before any store (16-byte vector loads and stores
// when the units are whole and the tensors aligned), so a warp reads and writes contiguous memory; the
// body is compiled per dtype combination and picked once per chunk. Memory-bound: a Lion step moves
// 20 B/param in fp32 (read g, m, theta; write m, theta), the apply 8 B + 1 bit (+2 B cast).
//
// CUDA headers only (no torch). Build: nvcc -c -std=c++17 --fmad=false -gencode ...
// The per-element logic lives in lioncub_cuda_common.cuh; the test-only host emulation (tests/cuda_emu)
// runs these kernels themselves.
#include <cuda_runtime.h>
#include <stdint.h>

#include "lioncub_cuda.h"
#include "lioncub_cuda_common.cuh"

namespace lc {
namespace {

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

LC_HD constexpr int64_t triple_code(int p, int g, int m) { return p | (g << 8) | (m << 16); }

// f(DTc<p>{}, DTc<g>{}, DTc<m>{}) for the (param, grad, momentum) dtype combinations a step meets (fp32;
// bf16 / fp16 parameters and gradients with fp32 momenta; all bf16), compiled each; others at run time.
template <class F>
LC_DEV void dispatch_triple(int64_t code, F&& f) {
  switch (code) {
    case triple_code(LC_FLOAT32, LC_FLOAT32, LC_FLOAT32):
      f(DTc<LC_FLOAT32>{}, DTc<LC_FLOAT32>{}, DTc<LC_FLOAT32>{});
      break;
    case triple_code(LC_BFLOAT16, LC_BFLOAT16, LC_FLOAT32):
      f(DTc<LC_BFLOAT16>{}, DTc<LC_BFLOAT16>{}, DTc<LC_FLOAT32>{});
      break;
    case triple_code(LC_FLOAT16, LC_FLOAT16, LC_FLOAT32):
      f(DTc<LC_FLOAT16>{}, DTc<LC_FLOAT16>{}, DTc<LC_FLOAT32>{});
      break;
    case triple_code(LC_BFLOAT16, LC_BFLOAT16, LC_BFLOAT16):
      f(DTc<LC_BFLOAT16>{}, DTc<LC_BFLOAT16>{}, DTc<LC_BFLOAT16>{});
      break;
    default: f(DTc<kAnyDT>{}, DTc<kAnyDT>{}, DTc<kAnyDT>{});
  }
}

// The step's arithmetic on 8 elements as fp32, stored (theta, m) rounded once to their dtypes.
template <int DTP, int DTM, bool FULL = false>
LC_HD void lion_math(const LionTensor& T, int64_t j, int n, const float g[8], float m[8], float p[8],
                     const lc_lion_step_args& a) {
  const int dtp = dt_or<DTP>(T.dtp);
  LC_UNROLL
  for (int i = 0; i < 8; ++i) {
    const float c = lion_c(m[i], g[i], a.betas);
    float x = p[i];
    if (a.apply_decay) x = round_to(dtp, fmul(x, a.decay));
    p[i] = fadd(x, fmul(lcc::lion_sign(c), a.neg_lr));
    m[i] = lion_m(m[i], g[i], a.betas);
  }
  store8<DTP, FULL>(T.p, T.dtp, j, n, p);
  store8<DTM, FULL>(T.m, T.dtm, j, n, m);
}

// Elements [j, j+n) (n <= 8) of one tensor, loaded (theta, g, m): one Lion step (reference.lion_step).
template <int DTP, int DTG, int DTM, bool FULL = false>
LC_HD void lion_raw(const LionTensor& T, int64_t j, int n, const Raw8& rp, const Raw8& rg, const Raw8& rm,
                    const lc_lion_step_args& a) {
  float g[8], m[8], p[8];
  raw_to_f8<DTG>(rg, T.dtg, g);
  raw_to_f8<DTM>(rm, T.dtm, m);
  raw_to_f8<DTP>(rp, T.dtp, p);
  lion_math<DTP, DTM, FULL>(T, j, n, g, m, p, a);
}

// The same step for one unit, each tensor converted as soon as it is loaded (the fewest registers): the
// run-time-dtype body, and the units that are not whole or not 16-byte aligned.
template <int DTP, int DTG, int DTM>
LC_HD void lion_unit(const LionTensor& T, int64_t j, int n, const lc_lion_step_args& a) {
  float g[8], m[8], p[8];
  Raw8 r;
  load_raw8<DTG>(T.g, T.dtg, j, n, r);
  raw_to_f8<DTG>(r, T.dtg, g);
  load_raw8<DTM>(T.m, T.dtm, j, n, r);
  raw_to_f8<DTM>(r, T.dtm, m);
  load_raw8<DTP>(T.p, T.dtp, j, n, r);
  raw_to_f8<DTP>(r, T.dtp, p);
  lion_math<DTP, DTM>(T, j, n, g, m, p, a);
}

// One block per LC_CHUNK chunk of one tensor. A round of a thread is 2 units: when both are whole and
// the tensors 16-byte aligned, the body compiled for the tensor's dtypes loads theta, g and m of both
// (2 x 96 bytes in fp32) before it computes and stores either; else (a tensor's last units, an unaligned
// tensor, dtypes without a compiled body) one unit at a time at run-time dtypes.
__global__ void __launch_bounds__(kThreads)
    lion_step_kernel(const lc_lion_meta* __restrict__ meta, int nt, int64_t n_chunks, lc_lion_step_args a) {
  constexpr int U = 2;
  for (int64_t ch = blockIdx.x; ch < n_chunks; ch += gridDim.x) {
    const LionTensor T = read_lion_meta(meta, search_chunk_of(meta, nt, ch));
    const int64_t c0 = (ch - T.chunk_start) * LC_CHUNK;
    const int64_t c1 = T.numel < c0 + LC_CHUNK ? T.numel : c0 + LC_CHUNK;
    const bool al = aligned16(reinterpret_cast<const void*>(T.p)) && aligned16(reinterpret_cast<const void*>(T.g)) &&
                    aligned16(reinterpret_cast<const void*>(T.m));
    chunk_rounds<U>(c0, c1, [&](const int64_t* j, const int* n) {
      dispatch_triple(al && n[U - 1] == 8 ? triple_code(T.dtp, T.dtg, T.dtm) : kMixed, [&](auto P, auto G, auto M) {
        constexpr int DTP = decltype(P)::value, DTG = decltype(G)::value, DTM = decltype(M)::value;
        if constexpr (DTP == kAnyDT) {
          LC_UNROLL
          for (int k = 0; k < U; ++k)
            if (n[k] > 0) lion_unit<DTP, DTG, DTM>(T, j[k], n[k], a);
        } else {
          Raw8 rp[U], rg[U], rm[U];
          LC_UNROLL
          for (int k = 0; k < U; ++k) {
            load_raw8<DTG, true>(T.g, T.dtg, j[k], 8, rg[k]);
            load_raw8<DTM, true>(T.m, T.dtm, j[k], 8, rm[k]);
            load_raw8<DTP, true>(T.p, T.dtp, j[k], 8, rp[k]);
          }
          LC_UNROLL
          for (int k = 0; k < U; ++k) lion_raw<DTP, DTG, DTM, true>(T, j[k], 8, rp[k], rg[k], rm[k], a);
        }
      });
    });
  }
}

// The n (<= 8) bits starting at bit `bit` of `row`, LSB first; reads only the bytes holding them.
LC_HD uint32_t load_bits8(const uint8_t* __restrict__ row, int64_t bit, int n) {
  const uint8_t* q = row + (bit >> 3);
  const int sh = static_cast<int>(bit & 7);
  uint32_t x = q[0];
  if (sh + n > 8) x |= static_cast<uint32_t>(q[1]) << 8;
  return (x >> sh) & ((1u << n) - 1u);
}

// Elements [j, j+n) (n <= 8) of one piece (lc_zero_piece), x its fp32 target as loaded, s / z its owner's
// vote bits: Δ, apply, then the low-precision copy (dtype CDT).
template <int CDT, bool FULL>
LC_HD void zero_raw(const lc_zero_piece& P, int64_t j, int n, uint32_t s, uint32_t z, const Raw8& x) {
  float v[8];
  raw_to_f8<LC_FLOAT32>(x, LC_FLOAT32, v);
  LC_UNROLL
  for (int i = 0; i < 8; ++i) {
    const float d = ((z >> i) & 1u) ? (((s >> i) & 1u) ? 1.0f : -1.0f) : 0.0f;
    float t = v[i];
    if (P.apply_decay) t = fmul(t, P.decay);
    v[i] = fadd(t, fmul(d, P.neg_lr));
  }
  store8<LC_FLOAT32, FULL>(P.target, LC_FLOAT32, j, n, v);
  if (P.cast) store8<CDT, FULL>(P.cast, P.cast_dtype, j, n, v);
}

// One block per LC_CHUNK chunk of one piece. A round of a thread is 4 units: whole ones of an aligned
// piece load their targets and bits first, the copy's dtype compiled; other units one at a time.
__global__ void __launch_bounds__(kThreads)
    zero_apply_kernel(const uint8_t* __restrict__ sign, int64_t sign_stride, const uint8_t* __restrict__ nonzero,
                      int64_t nz_stride, const lc_zero_piece* __restrict__ pieces, int np, int64_t n_chunks) {
  constexpr int U = 4;
  for (int64_t ch = blockIdx.x; ch < n_chunks; ch += gridDim.x) {
    const lc_zero_piece P = pieces[search_chunk_of(pieces, np, ch)];
    const int64_t c0 = (ch - P.chunk_start) * LC_CHUNK;
    const int64_t c1 = P.numel < c0 + LC_CHUNK ? P.numel : c0 + LC_CHUNK;
    const uint8_t* srow = sign + P.row * sign_stride;
    const uint8_t* zrow = nonzero ? nonzero + P.row * nz_stride : nullptr;
    const bool al = aligned16(reinterpret_cast<const void*>(P.target)) && aligned16(reinterpret_cast<const void*>(P.cast));
    const int64_t cdt = P.cast ? P.cast_dtype : LC_FLOAT32;  // no copy: the fp32 body (never stores it)
    chunk_rounds<U>(c0, c1, [&](const int64_t* j, const int* n) {
      dispatch_dt(al && n[U - 1] == 8 ? cdt : kMixed, [&](auto C) {
        constexpr int CDT = decltype(C)::value;
        if constexpr (CDT == kAnyDT) {
          LC_UNROLL
          for (int k = 0; k < U; ++k) {
            if (n[k] > 0) {
              Raw8 x;
              const uint32_t sb = load_bits8(srow, P.bit + j[k], n[k]);
              const uint32_t zb = zrow ? load_bits8(zrow, P.bit + j[k], n[k]) : 0xffu;
              load_raw8<LC_FLOAT32>(P.target, LC_FLOAT32, j[k], n[k], x);
              zero_raw<CDT, false>(P, j[k], n[k], sb, zb, x);
            }
          }
        } else {
          Raw8 x[U];
          uint32_t sb[U], zb[U];
          LC_UNROLL
          for (int k = 0; k < U; ++k) {
            sb[k] = load_bits8(srow, P.bit + j[k], 8);
            zb[k] = zrow ? load_bits8(zrow, P.bit + j[k], 8) : 0xffu;
            load_raw8<LC_FLOAT32, true>(P.target, LC_FLOAT32, j[k], 8, x[k]);
          }
          LC_UNROLL
          for (int k = 0; k < U; ++k) zero_raw<CDT, true>(P, j[k], 8, sb[k], zb[k], x[k]);
        }
      });
    });
  }
}

}  // namespace
}  // namespace lc

extern "C" cudaError_t lc_lion_step(const lc_lion_meta* meta, int n_tensors, int64_t n_chunks, lc_lion_step_args args,
                                    cudaStream_t stream) {
  if (n_tensors < 0 || n_chunks < 0 || (n_chunks > 0 && (meta == nullptr || n_tensors == 0)))
    return cudaErrorInvalidValue;
  if (n_chunks == 0) return cudaSuccess;
  return lc::launch(lc::lion_step_kernel, lc::grid_for(n_chunks, 1), lc::kThreads, stream, meta, n_tensors, n_chunks,
                    args);
}

extern "C" cudaError_t lc_zero_sign_apply(const uint8_t* sign, int64_t sign_stride, const uint8_t* nonzero,
                                          int64_t nz_stride, const lc_zero_piece* pieces, int n_pieces,
                                          int64_t n_chunks, cudaStream_t stream) {
  if (n_pieces < 0 || n_chunks < 0 || sign_stride < 0 || nz_stride < 0 ||
      (n_chunks > 0 && (pieces == nullptr || n_pieces == 0 || sign == nullptr)))
    return cudaErrorInvalidValue;
  if (n_chunks == 0) return cudaSuccess;
  return lc::launch(lc::zero_apply_kernel, lc::grid_for(n_chunks, 1), lc::kThreads, stream, sign, sign_stride, nonzero,
                    nz_stride, pieces, n_pieces, n_chunks);
}
