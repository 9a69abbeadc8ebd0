// lioncub_vote.cu -- fused CUDA kernels of the vote half of a Lion Cub step:
// vote + apply (all-gather), shard vote (two-phase, phase 1), count lanes (p-bit encode /
// averaging phase 1), lanes + apply (p-bit all-reduce), int8 apply, and the comm="bbit" shard vote.
//
// Votes are counted 32 elements at a time with bit-sliced counters on 32-bit words
// (KB levels, a counter of up to 2**KB - 1 per element): each rank's word costs ~3*KB
// integer ops for 32 elements and is never unpacked to bytes. vote_apply then hands the
// decided Δ of each word to the lanes of its warp with shuffles so that the parameter
// loads and stores of a warp are contiguous (lane L, round r: unit 32r+L of the tile).
//
// CUDA headers only (no torch). Build: nvcc -c -std=c++17 --fmad=false -gencode ...
#include <cuda_runtime.h>
#include <stdint.h>

#include "lioncub_cuda.h"
#include "lioncub_cuda_vote.cuh"

namespace lc {
namespace {

constexpr unsigned kFull = 0xffffffffu;

inline bool aligned4(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 3u) == 0; }

// A warp owns a tile of 32 words (1024 elements, 128 bytes per plane row) at a time. Lane L takes the
// tile's units (bytes) 32r + L, r = 0..3, two rounds at a time: their Δ inputs shuffled (by every lane),
// then both units' parameters located and loaded together, then Δ, apply (a switch per unit into the
// body of its parameter's dtype) and store.
template <int KB, bool AVG>
__global__ void __launch_bounds__(kThreads, KB == 16 || (AVG && KB == 8) ? 2 : 3)  // resident blocks (registers <= 80 / 128)
    vote_apply_kernel(const uint8_t* __restrict__ sign, const uint8_t* __restrict__ nonzero, int rows,
                      int64_t row_bytes, int aligned, const lc_tensor_meta* __restrict__ meta, int nt,
                      lc_apply_args a, float* __restrict__ delta_out) {
  const int lane = threadIdx.x & 31;
  const int sel = lane & 3;  // round r: byte sel of word 8r + lane/4 of the tile = unit 32r + lane
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t nwarps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t nwords = (row_bytes + 3) >> 2;
  const int64_t ntiles = (nwords + 31) >> 5;
  int hint = -1;
  for (int64_t tile = warp; tile < ntiles; tile += nwarps) {  // warp-uniform loop
    const int64_t w = tile * 32 + lane;
    uint32_t P[KB], C[KB];
    if (w < nwords) {
      count_word<KB>(sign, nonzero, rows, row_bytes, w, aligned != 0, P, C);
    } else {
#pragma unroll
      for (int k = 0; k < KB; ++k) P[k] = C[k] = 0u;
    }
    uint32_t pos = 0u, neg = 0u, tie = 0u;
    if (!AVG) majority_masks<KB>(P, C, pos, neg, tie);
#pragma unroll 1
    for (int h = 0; h < 4; h += 2) {  // rounds h and h + 1 (warp-uniform)
      float d[2][8];
#pragma unroll
      for (int k = 0; k < 2; ++k) {  // Δ: its inputs shuffled by every lane, before any branch
        const int src = (h + k) * 8 + (lane >> 2);  // the lane owning word 8r + lane/4 of the tile
        if (!AVG) {
          const uint32_t ps = __shfl_sync(kFull, pos, src);
          const uint32_t ns = __shfl_sync(kFull, neg, src);
          const uint32_t ts = __shfl_sync(kFull, tie, src);
          majority_delta8(ps, ns, ts, sel, a, (tile * 128 + (h + k) * 32 + lane) * 8, d[k]);
        } else {
          uint32_t Ps[KB], Cs[KB];
#pragma unroll
          for (int q = 0; q < KB; ++q) {
            Ps[q] = __shfl_sync(kFull, P[q], src);
            Cs[q] = __shfl_sync(kFull, C[q], src);
          }
          average_delta8<KB>(Ps, Cs, sel, a, d[k]);
        }
      }
      Slot s[2];  // the two units' parameters located and loaded together
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int64_t u = tile * 128 + (h + k) * 32 + lane;
        find_slot(meta, nt, u, u < row_bytes, hint, s[k]);
      }
      run_slots<true>(s, false, [&](int k) {
        const int64_t u = tile * 128 + (h + k) * 32 + lane;
        if (u >= row_bytes) return;
        if (delta_out) store_delta8(delta_out, u * 8, 8, d[k]);
        apply_slot(s[k], d[k], a);
      });
    }
  }
}

template <int KB>
__global__ void __launch_bounds__(kThreads)
    shard_vote_kernel(const uint8_t* __restrict__ sign, const uint8_t* __restrict__ nonzero, int rows,
                      int64_t row_bytes, int aligned, int tie_rule, int64_t step, const int64_t* __restrict__ tie_rows,
                      int64_t tie_nrows, uint8_t* __restrict__ out_sign, uint8_t* __restrict__ out_nz,
                      int out_aligned) {
  const int64_t nwords = (row_bytes + 3) >> 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < nwords; w += stride) {
    uint32_t P[KB], C[KB], pos, neg, tie, os, oz;
    count_word<KB>(sign, nonzero, rows, row_bytes, w, aligned != 0, P, C);
    majority_masks<KB>(P, C, pos, neg, tie);
    shard_word(pos, neg, tie, tie_rule, step, w * 32, tie_rows, tie_nrows, os, oz);
    store_words(out_sign, w * 4, row_bytes, &os, 1, out_aligned != 0);
    store_words(out_nz, w * 4, row_bytes, &oz, 1, out_aligned != 0);
  }
}

// comm="bbit": one thread per word of 32 elements of the shard; the codes' width BITS a template parameter.
template <int KB, int BITS>
__global__ void __launch_bounds__(kThreads)
    bbit_shard_vote_kernel(const uint8_t* __restrict__ planes, const uint8_t* __restrict__ nonzero, int rows,
                           int64_t row_bytes, int aligned, int tie_rule, int64_t step,
                           const int64_t* __restrict__ tie_rows, int64_t tie_nrows, uint8_t* __restrict__ out_sign,
                           uint8_t* __restrict__ out_nz, int out_aligned) {
  const int64_t nwords = (row_bytes + 3) >> 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < nwords; w += stride) {
    uint32_t P[BITS][KB], C[KB], pos, neg, tie, os, oz;
    bbit_count_word<KB, BITS>(planes, nonzero, rows, row_bytes, w, aligned != 0, P, C);
    bbit_masks<KB, BITS>(P, C, pos, neg, tie);
    shard_word(pos, neg, tie, tie_rule, step, w * 32, tie_rows, tie_nrows, os, oz);
    store_words(out_sign, w * 4, row_bytes, &os, 1, out_aligned != 0);
    store_words(out_nz, w * 4, row_bytes, &oz, 1, out_aligned != 0);
  }
}

template <int KB>
__global__ void __launch_bounds__(kThreads)
    count_lanes_kernel(const uint8_t* __restrict__ sign, const uint8_t* __restrict__ nonzero, int rows,
                       int64_t row_bytes, int aligned, int p, uint8_t* __restrict__ plus_out,
                       uint8_t* __restrict__ cnt_out, int out_aligned, int32_t* __restrict__ overflow) {
  const int64_t nwords = (row_bytes + 3) >> 2;
  const int64_t out_bytes = row_bytes * p;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < nwords; w += stride) {
    uint32_t P[KB], C[KB], o[8];
    count_word<KB>(sign, nonzero, rows, row_bytes, w, aligned != 0, P, C);
    pack_lanes_word<KB>(P, p, o);
    store_words(plus_out, w * 4 * p, out_bytes, o, p, out_aligned != 0);
    if (cnt_out) {
      pack_lanes_word<KB>(C, p, o);
      store_words(cnt_out, w * 4 * p, out_bytes, o, p, out_aligned != 0);
    }
    if (overflow && nonzero) {
      uint32_t hi = 0u;
#pragma unroll
      for (int k = 0; k < KB; ++k)
        if (k >= p) hi |= C[k];
      const int64_t nvalid = row_bytes - 4 * w;
      const uint32_t valid = nvalid >= 4 ? 0xffffffffu : ((1u << (8 * nvalid)) - 1u);
      if (hi & valid) atomicOr(overflow, 1);
    }
  }
}

// Units per thread and round of lanes_apply / int8_apply: u, u + S (S: the grid's threads); their vote
// inputs and parameters loaded together, then Δ, apply and store.
constexpr int kApplyUnits = 2;

// p bytes of plus lanes (and of cnt lanes) per unit of 8 elements. At most 80 registers: 3 resident
// blocks (sm_90: 84 bytes of spill stores, in the scalar path of unaligned 16-bit parameters).
__global__ void __launch_bounds__(kThreads, 3)
    lanes_apply_kernel(const uint8_t* __restrict__ plus, const uint8_t* __restrict__ cnt, int64_t numel, int p,
                       const lc_tensor_meta* __restrict__ meta, int nt, lc_apply_args a,
                       float* __restrict__ delta_out) {
  const int64_t units = (numel + 7) / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int hint = -1;
  for (int64_t u0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u0 < units;
       u0 += kApplyUnits * stride) {
    Slot s[kApplyUnits];
    uint64_t xp[kApplyUnits], xc[kApplyUnits];
    int n[kApplyUnits];
#pragma unroll
    for (int k = 0; k < kApplyUnits; ++k) {
      const int64_t u = u0 + k * stride, rem = numel - 8 * u;
      n[k] = rem < 8 ? static_cast<int>(rem) : 8;
      find_slot(meta, nt, u, u < units, hint, s[k]);
      xp[k] = u < units ? load_lane_unit(plus, u, p, n[k]) : 0ull;
      xc[k] = u < units && cnt ? load_lane_unit(cnt, u, p, n[k]) : 0ull;
    }
    float d[kApplyUnits][8];  // Δ decided once per unit, outside the load paths
#pragma unroll
    for (int k = 0; k < kApplyUnits; ++k) lanes_delta8(xp[k], xc[k], cnt != nullptr, u0 + k * stride, n[k], p, a, d[k]);
    run_slots<false>(s, false, [&](int k) {
      const int64_t u = u0 + k * stride;
      if (u >= units) return;
      if (delta_out) store_delta8(delta_out, 8 * u, n[k], d[k]);
      apply_slot(s[k], d[k], a);
    });
  }
}

__global__ void __launch_bounds__(kThreads)
    int8_apply_kernel(const int8_t* __restrict__ qsum, int64_t numel, const lc_tensor_meta* __restrict__ meta, int nt,
                      lc_apply_args a, float* __restrict__ delta_out) {
  const int64_t units = (numel + 7) / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int hint = -1;
  for (int64_t u0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u0 < units;
       u0 += kApplyUnits * stride) {
    Slot s[kApplyUnits];
    uint64_t q[kApplyUnits];
    int n[kApplyUnits];
#pragma unroll
    for (int k = 0; k < kApplyUnits; ++k) {
      const int64_t u = u0 + k * stride, rem = numel - 8 * u;
      n[k] = rem < 8 ? static_cast<int>(rem) : 8;
      find_slot(meta, nt, u, u < units, hint, s[k]);
      q[k] = u < units ? load_q8(qsum, 8 * u, n[k]) : 0ull;
    }
    run_slots<false>(s, false, [&](int k) {
      const int64_t u = u0 + k * stride;
      if (u >= units) return;
      float d[8];
      q8_delta(q[k], d);
      if (delta_out) store_delta8(delta_out, 8 * u, n[k], d);
      apply_slot(s[k], d, a);
    });
  }
}

template <int KB>
cudaError_t launch_vote_apply(const uint8_t* sign, const uint8_t* nonzero, int rows, int64_t row_bytes,
                              const lc_tensor_meta* params, int nt, const lc_apply_args& a, float* delta_out,
                              cudaStream_t stream) {
  const int aligned = aligned4(sign) && (nonzero == nullptr || aligned4(nonzero)) && row_bytes % 4 == 0;
  const int64_t ntiles = ((row_bytes + 3) / 4 + 31) / 32;
  const int grid = grid_for(ntiles, kThreads / 32);
  if (a.vote == LC_VOTE_AVERAGE)
    return launch(vote_apply_kernel<KB, true>, grid, kThreads, stream, sign, nonzero, rows, row_bytes, aligned, params,
                  nt, a, delta_out);
  return launch(vote_apply_kernel<KB, false>, grid, kThreads, stream, sign, nonzero, rows, row_bytes, aligned, params,
                nt, a, delta_out);
}

template <int KB>
cudaError_t launch_shard_vote(const uint8_t* sign, const uint8_t* nonzero, int rows, int64_t row_bytes, int tie,
                              int64_t step, const int64_t* tie_rows, int64_t tie_nrows, uint8_t* out_sign,
                              uint8_t* out_nz, cudaStream_t stream) {
  const int aligned = aligned4(sign) && (nonzero == nullptr || aligned4(nonzero)) && row_bytes % 4 == 0;
  const int out_aligned = aligned4(out_sign) && aligned4(out_nz);
  const int64_t nwords = (row_bytes + 3) / 4;
  return launch(shard_vote_kernel<KB>, grid_for(nwords, kThreads), kThreads, stream, sign, nonzero, rows, row_bytes,
                aligned, tie, step, tie_rows, tie_nrows, out_sign, out_nz, out_aligned);
}

template <int KB>
cudaError_t launch_bbit_shard_vote(const uint8_t* planes, const uint8_t* nonzero, int rows, int bits, int64_t row_bytes,
                                   int tie, int64_t step, const int64_t* tie_rows, int64_t tie_nrows,
                                   uint8_t* out_sign, uint8_t* out_nz, cudaStream_t stream) {
  const int aligned = aligned4(planes) && (nonzero == nullptr || aligned4(nonzero)) && row_bytes % 4 == 0;
  const int out_aligned = aligned4(out_sign) && aligned4(out_nz);
  const int grid = grid_for((row_bytes + 3) / 4, kThreads);
  switch (bits) {  // 1..4, checked by the caller
    case 1:
      return launch(bbit_shard_vote_kernel<KB, 1>, grid, kThreads, stream, planes, nonzero, rows, row_bytes, aligned,
                    tie, step, tie_rows, tie_nrows, out_sign, out_nz, out_aligned);
    case 2:
      return launch(bbit_shard_vote_kernel<KB, 2>, grid, kThreads, stream, planes, nonzero, rows, row_bytes, aligned,
                    tie, step, tie_rows, tie_nrows, out_sign, out_nz, out_aligned);
    case 3:
      return launch(bbit_shard_vote_kernel<KB, 3>, grid, kThreads, stream, planes, nonzero, rows, row_bytes, aligned,
                    tie, step, tie_rows, tie_nrows, out_sign, out_nz, out_aligned);
    default:
      return launch(bbit_shard_vote_kernel<KB, 4>, grid, kThreads, stream, planes, nonzero, rows, row_bytes, aligned,
                    tie, step, tie_rows, tie_nrows, out_sign, out_nz, out_aligned);
  }
}

template <int KB>
cudaError_t launch_count_lanes(const uint8_t* sign, const uint8_t* nonzero, int rows, int64_t row_bytes, int p,
                               uint8_t* plus_out, uint8_t* cnt_out, int32_t* overflow, cudaStream_t stream) {
  const int aligned = aligned4(sign) && (nonzero == nullptr || aligned4(nonzero)) && row_bytes % 4 == 0;
  const int out_aligned = aligned4(plus_out) && (cnt_out == nullptr || aligned4(cnt_out));
  const int64_t nwords = (row_bytes + 3) / 4;
  return launch(count_lanes_kernel<KB>, grid_for(nwords, kThreads), kThreads, stream, sign, nonzero, rows, row_bytes,
                aligned, p, plus_out, cnt_out, out_aligned, overflow);
}

bool valid_apply_args(const lc_apply_args& a) {
  if (a.tie != LC_TIE_ZERO && a.tie != LC_TIE_ALTERNATE && a.tie != LC_TIE_HASH) return false;
  if (a.tie_nrows < 0 || (a.tie_nrows > 0 && a.tie_rows == nullptr)) return false;
  return a.vote == LC_VOTE_MAJORITY || a.vote == LC_VOTE_AVERAGE;
}

}  // namespace
}  // namespace lc

extern "C" cudaError_t lc_vote_apply(const uint8_t* sign, const uint8_t* nonzero, int rows, int64_t row_bytes,
                                     const lc_tensor_meta* params, int n_tensors, lc_apply_args args,
                                     float* delta_out, cudaStream_t stream) {
  if (rows < 1 || row_bytes < 0 || n_tensors < 0 || (n_tensors > 0 && params == nullptr) ||
      !lc::valid_apply_args(args))
    return cudaErrorInvalidValue;
  if (row_bytes == 0) return cudaSuccess;
  if (sign == nullptr) return cudaErrorInvalidValue;
  switch (lc::levels_for_rows(rows)) {
    case 4: return lc::launch_vote_apply<4>(sign, nonzero, rows, row_bytes, params, n_tensors, args, delta_out, stream);
    case 8: return lc::launch_vote_apply<8>(sign, nonzero, rows, row_bytes, params, n_tensors, args, delta_out, stream);
    case 16:
      return lc::launch_vote_apply<16>(sign, nonzero, rows, row_bytes, params, n_tensors, args, delta_out, stream);
    default: return cudaErrorInvalidValue;
  }
}

extern "C" cudaError_t lc_shard_vote(const uint8_t* sign, const uint8_t* nonzero, int rows, int64_t row_bytes,
                                     int tie, int64_t step, const int64_t* tie_rows, int64_t tie_nrows,
                                     uint8_t* out_sign, uint8_t* out_nonzero, cudaStream_t stream) {
  if (rows < 1 || row_bytes < 0 || (tie != LC_TIE_ZERO && tie != LC_TIE_ALTERNATE && tie != LC_TIE_HASH) ||
      tie_nrows < 0 || (tie_nrows > 0 && tie_rows == nullptr))
    return cudaErrorInvalidValue;
  if (row_bytes == 0) return cudaSuccess;
  if (sign == nullptr || out_sign == nullptr || out_nonzero == nullptr) return cudaErrorInvalidValue;
  switch (lc::levels_for_rows(rows)) {
    case 4:
      return lc::launch_shard_vote<4>(sign, nonzero, rows, row_bytes, tie, step, tie_rows, tie_nrows, out_sign,
                                      out_nonzero, stream);
    case 8:
      return lc::launch_shard_vote<8>(sign, nonzero, rows, row_bytes, tie, step, tie_rows, tie_nrows, out_sign,
                                      out_nonzero, stream);
    case 16:
      return lc::launch_shard_vote<16>(sign, nonzero, rows, row_bytes, tie, step, tie_rows, tie_nrows, out_sign,
                                       out_nonzero, stream);
    default: return cudaErrorInvalidValue;
  }
}

extern "C" cudaError_t lc_count_lanes(const uint8_t* sign, const uint8_t* nonzero, int rows, int64_t row_bytes, int p,
                                      uint8_t* plus_out, uint8_t* cnt_out, int32_t* overflow, cudaStream_t stream) {
  if (rows < 1 || rows > 255 || row_bytes < 0 || (p != 1 && p != 2 && p != 4 && p != 8) ||
      (nonzero == nullptr && cnt_out != nullptr))
    return cudaErrorInvalidValue;
  if (row_bytes == 0) return cudaSuccess;
  if (sign == nullptr || plus_out == nullptr || (nonzero != nullptr && cnt_out == nullptr))
    return cudaErrorInvalidValue;
  switch (lc::levels_for_rows(rows)) {
    case 4: return lc::launch_count_lanes<4>(sign, nonzero, rows, row_bytes, p, plus_out, cnt_out, overflow, stream);
    case 8: return lc::launch_count_lanes<8>(sign, nonzero, rows, row_bytes, p, plus_out, cnt_out, overflow, stream);
    default: return cudaErrorInvalidValue;
  }
}

extern "C" cudaError_t lc_lanes_apply(const uint8_t* plus_lanes, const uint8_t* cnt_lanes, int64_t numel, int p,
                                      const lc_tensor_meta* params, int n_tensors, lc_apply_args args,
                                      float* delta_out, cudaStream_t stream) {
  if (numel < 0 || (p != 1 && p != 2 && p != 4 && p != 8) || n_tensors < 0 || (n_tensors > 0 && params == nullptr) ||
      !lc::valid_apply_args(args))
    return cudaErrorInvalidValue;
  if (numel == 0) return cudaSuccess;
  if (plus_lanes == nullptr) return cudaErrorInvalidValue;
  const int64_t units = (numel + 7) / 8;
  return lc::launch(lc::lanes_apply_kernel, lc::grid_for(units, lc::kThreads), lc::kThreads, stream, plus_lanes,
                    cnt_lanes, numel, p, params, n_tensors, args, delta_out);
}

extern "C" cudaError_t lc_int8_apply(const int8_t* qsum, int64_t numel, const lc_tensor_meta* params, int n_tensors,
                                     lc_apply_args args, float* delta_out, cudaStream_t stream) {
  if (numel < 0 || n_tensors < 0 || (n_tensors > 0 && params == nullptr)) return cudaErrorInvalidValue;
  if (numel == 0) return cudaSuccess;
  if (qsum == nullptr) return cudaErrorInvalidValue;
  const int64_t units = (numel + 7) / 8;
  return lc::launch(lc::int8_apply_kernel, lc::grid_for(units, lc::kThreads), lc::kThreads, stream, qsum, numel, params,
                    n_tensors, args, delta_out);
}

extern "C" cudaError_t lc_bbit_shard_vote(const uint8_t* planes, const uint8_t* nonzero, int rows, int bits,
                                          int64_t row_bytes, int tie, int64_t step, const int64_t* tie_rows,
                                          int64_t tie_nrows, uint8_t* out_sign, uint8_t* out_nonzero,
                                          cudaStream_t stream) {
  if (rows < 1 || bits < 1 || bits > 4 || row_bytes < 0 ||
      (tie != LC_TIE_ZERO && tie != LC_TIE_ALTERNATE && tie != LC_TIE_HASH) || tie_nrows < 0 ||
      (tie_nrows > 0 && tie_rows == nullptr))
    return cudaErrorInvalidValue;
  if (row_bytes == 0) return cudaSuccess;
  if (planes == nullptr || out_sign == nullptr || out_nonzero == nullptr) return cudaErrorInvalidValue;
  switch (lc::levels_for_rows(rows)) {
    case 4:
      return lc::launch_bbit_shard_vote<4>(planes, nonzero, rows, bits, row_bytes, tie, step, tie_rows, tie_nrows,
                                           out_sign, out_nonzero, stream);
    case 8:
      return lc::launch_bbit_shard_vote<8>(planes, nonzero, rows, bits, row_bytes, tie, step, tie_rows, tie_nrows,
                                           out_sign, out_nonzero, stream);
    case 16:
      return lc::launch_bbit_shard_vote<16>(planes, nonzero, rows, bits, row_bytes, tie, step, tie_rows, tie_nrows,
                                            out_sign, out_nonzero, stream);
    default: return cudaErrorInvalidValue;
  }
}
