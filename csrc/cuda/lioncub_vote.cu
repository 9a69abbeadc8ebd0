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

// A warp owns a tile of 32 words (1024 elements, 128 bytes per plane row) at a time.
template <int KB, bool AVG>
__global__ void __launch_bounds__(kThreads)
    vote_apply_kernel(const uint8_t* __restrict__ sign, const uint8_t* __restrict__ nonzero, int rows,
                      int64_t row_bytes, int aligned, const lc_tensor_meta* __restrict__ meta, int nt,
                      lc_apply_args a, float* __restrict__ delta_out) {
  const int lane = threadIdx.x & 31;
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
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // unrolled: the four rounds' shuffles and stores overlap
      const int src = r * 8 + (lane >> 2);  // the lane owning word 8r + lane/4 of the tile
      const int sel = lane & 3;             // byte of that word = unit 32r + lane of the tile
      const int64_t u = tile * 128 + r * 32 + lane;
      float d[8];
      if (!AVG) {
        const uint32_t ps = __shfl_sync(kFull, pos, src);
        const uint32_t ns = __shfl_sync(kFull, neg, src);
        const uint32_t ts = __shfl_sync(kFull, tie, src);
        majority_delta8(ps, ns, ts, sel, a, u * 8, d);
      } else {
        uint32_t Ps[KB], Cs[KB];
#pragma unroll
        for (int k = 0; k < KB; ++k) {
          Ps[k] = __shfl_sync(kFull, P[k], src);
          Cs[k] = __shfl_sync(kFull, C[k], src);
        }
        average_delta8<KB>(Ps, Cs, sel, a, d);
      }
      if (u < row_bytes) {
        if (delta_out) store_delta8(delta_out, u * 8, 8, d);
        apply_at(meta, nt, u * 8, d, a, hint);
      }
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

// comm="bbit": one thread per word of 32 elements of the shard.
template <int KB>
__global__ void __launch_bounds__(kThreads)
    bbit_shard_vote_kernel(const uint8_t* __restrict__ planes, const uint8_t* __restrict__ nonzero, int rows, int bits,
                           int64_t row_bytes, int aligned, int tie_rule, int64_t step,
                           const int64_t* __restrict__ tie_rows, int64_t tie_nrows, uint8_t* __restrict__ out_sign,
                           uint8_t* __restrict__ out_nz, int out_aligned) {
  const int64_t nwords = (row_bytes + 3) >> 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < nwords; w += stride) {
    uint32_t P[4][KB], C[KB], pos, neg, tie, os, oz;
    bbit_count_word<KB>(planes, nonzero, rows, bits, row_bytes, w, aligned != 0, P, C);
    bbit_masks<KB>(P, C, bits, pos, neg, tie);
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

// One thread per unit of 8 elements: p bytes of plus lanes (and of cnt lanes).
__global__ void __launch_bounds__(kThreads)
    lanes_apply_kernel(const uint8_t* __restrict__ plus, const uint8_t* __restrict__ cnt, int64_t numel, int p,
                       const lc_tensor_meta* __restrict__ meta, int nt, lc_apply_args a,
                       float* __restrict__ delta_out) {
  const int64_t units = (numel + 7) / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int hint = -1;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < units; u += stride) {
    const int64_t e0 = u * 8, rem = numel - e0;
    const int n = rem < 8 ? static_cast<int>(rem) : 8;
    float d[8];
    lanes_delta8(plus, cnt, u, n, p, a, d);
    if (delta_out) store_delta8(delta_out, e0, n, d);
    apply_at(meta, nt, e0, d, a, hint);
  }
}

__global__ void __launch_bounds__(kThreads)
    int8_apply_kernel(const int8_t* __restrict__ qsum, int64_t numel, const lc_tensor_meta* __restrict__ meta, int nt,
                      lc_apply_args a, float* __restrict__ delta_out) {
  const int64_t units = (numel + 7) / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int hint = -1;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < units; u += stride) {
    const int64_t e0 = u * 8, rem = numel - e0;
    const int n = rem < 8 ? static_cast<int>(rem) : 8;
    float d[8];
    int8_delta8(qsum, e0, n, d);
    if (delta_out) store_delta8(delta_out, e0, n, d);
    apply_at(meta, nt, e0, d, a, hint);
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
  const int64_t nwords = (row_bytes + 3) / 4;
  return launch(bbit_shard_vote_kernel<KB>, grid_for(nwords, kThreads), kThreads, stream, planes, nonzero, rows, bits,
                row_bytes, aligned, tie, step, tie_rows, tie_nrows, out_sign, out_nz, out_aligned);
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
