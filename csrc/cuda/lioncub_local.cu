// lioncub_local.cu -- fused CUDA kernels of the local half of a Lion Cub step:
// local step (c -> sign/nonzero planes + counts, optional momentum update), the
// multi-tensor momentum update, the int8 local step (scale + quantize) and the comm="bbit" local step
// (the int8 scale passes, then the b-bit codes).
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

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ unsigned long long warp_sum(unsigned long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(kFull, v, o);
  return v;
}

// Adds the block's sums of (x, y) to out[0], out[1] (out[1] skipped when two == false):
// one atomic per counter and block. Every thread of the block must call it.
__device__ void block_add_counts(unsigned long long x, unsigned long long y, int64_t* out, bool two) {
  __shared__ unsigned long long sx[kThreads / 32], sy[kThreads / 32];
  x = warp_sum(x);
  y = warp_sum(y);
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  if (lane == 0) {
    sx[wid] = x;
    sy[wid] = y;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long tx = 0, ty = 0;
    for (int i = 0; i < static_cast<int>(blockDim.x >> 5); ++i) {
      tx += sx[i];
      ty += sy[i];
    }
    if (tx) atomicAdd(reinterpret_cast<unsigned long long*>(out), tx);
    if (two && ty) atomicAdd(reinterpret_cast<unsigned long long*>(out + 1), ty);
  }
}

// One thread per unit of 8 bucket elements (one output byte of each plane).
__global__ void __launch_bounds__(kThreads)
    local_step_kernel(const lc_tensor_meta* __restrict__ meta, int nt, int64_t units, lc_lion_args la, int upd,
                      uint8_t* __restrict__ sign, uint8_t* __restrict__ nonzero, int64_t* __restrict__ counts) {
  int hint = -1;
  unsigned long long nbad = 0, nzero = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < units; u += stride) {
    uint32_t s, z;
    int b = 0, zr = 0;
    local_unit(meta, nt, u * 8, la, upd, hint, s, z, b, zr);
    sign[u] = static_cast<uint8_t>(s);
    nonzero[u] = static_cast<uint8_t>(z);
    nbad += static_cast<unsigned long long>(b);
    nzero += static_cast<unsigned long long>(zr);
  }
  block_add_counts(nbad, nzero, counts, true);
}

// One block per LC_CHUNK chunk of one tensor (grid-stride over the chunks of the list).
__global__ void __launch_bounds__(kThreads)
    momentum_kernel(const lc_tensor_meta* __restrict__ meta, int nt, int64_t n_chunks, lc_lion_args la) {
  for (int64_t ch = blockIdx.x; ch < n_chunks; ch += gridDim.x) {
    const Tensor T = read_meta(meta, search_chunk(meta, nt, ch));
    const int64_t c0 = (ch - T.chunk_start) * LC_CHUNK;
    const int64_t c1 = T.numel < c0 + LC_CHUNK ? T.numel : c0 + LC_CHUNK;
    for (int64_t j = c0 + 8 * static_cast<int64_t>(threadIdx.x); j < c1; j += 8 * static_cast<int64_t>(blockDim.x)) {
      const int64_t rem = c1 - j;
      momentum_unit(T, j, rem < 8 ? static_cast<int>(rem) : 8, la);
    }
  }
}

// int8 pass 1: per chunk (one block of lcc's defined sum order), thread = lane: the lane sums in
// index order, then the fixed lane tree (lcc::lane_tree) in shared memory; + #non-finite.
__global__ void __launch_bounds__(kThreads)
    int8_partials_kernel(const lc_tensor_meta* __restrict__ meta, int nt, int64_t n_chunks, lc_lion_args la, int kind,
                         Acc* __restrict__ partials, int64_t* __restrict__ n_bad) {
  __shared__ double ss[kThreads];
  __shared__ long long sn[kThreads];
  __shared__ long long se[kThreads];
  const int tid = threadIdx.x;
  unsigned long long bad = 0;
  for (int64_t ch = blockIdx.x; ch < n_chunks; ch += gridDim.x) {
    const Tensor T = read_meta(meta, search_chunk(meta, nt, ch));
    const int64_t c0 = (ch - T.chunk_start) * LC_CHUNK;
    const int64_t c1 = T.numel < c0 + LC_CHUNK ? T.numel : c0 + LC_CHUNK;
    int nb = 0;
    const Acc acc = int8_thread_partial(T, c0, c1, tid, la, kind, nb);
    bad += static_cast<unsigned long long>(nb);
    ss[tid] = acc.s;
    sn[tid] = acc.n;
    se[tid] = acc.esum;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
      if (tid < s) {
        Acc x, y;
        x.s = ss[tid]; x.n = sn[tid]; x.esum = se[tid];
        y.s = ss[tid + s]; y.n = sn[tid + s]; y.esum = se[tid + s];
        x = acc_combine(x, y, kind);
        ss[tid] = x.s;
        sn[tid] = x.n;
        se[tid] = x.esum;
      }
      __syncthreads();
    }
    if (tid == 0) {
      Acc r;
      r.s = ss[0];
      r.n = sn[0];
      r.esum = se[0];
      partials[ch] = r;
    }
    __syncthreads();
  }
  block_add_counts(bad, 0ull, n_bad, false);
}

// int8 pass 2: one thread per tensor adds its chunk results in chunk order (lcc's defined
// order: a sequential fp64 sum of the block sums) -> scale (bits > 0, comm="bbit": the codes' ratio).
__global__ void __launch_bounds__(kThreads)
    int8_scale_kernel(const lc_tensor_meta* __restrict__ meta, int nt, const Acc* __restrict__ partials, int kind,
                      int bits, float* __restrict__ scales) {
  const int stride = static_cast<int>(gridDim.x * blockDim.x);
  for (int t = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); t < nt; t += stride) {
    const Tensor T = read_meta(meta, t);
    const int64_t nch = (T.numel + LC_CHUNK - 1) / LC_CHUNK;
    Acc acc;
    acc.s = 0.0;
    acc.n = 0;
    acc.esum = 0;
    for (int64_t k = 0; k < nch; ++k) acc = acc_combine(acc, partials[T.chunk_start + k], kind);
    scales[t] = int8_scale_of(acc, T.numel, kind, bits);
  }
}

// int8 pass 3: one thread per unit of 8 bucket elements -> 8 codes (gaps: 0).
__global__ void __launch_bounds__(kThreads)
    int8_quantize_kernel(const lc_tensor_meta* __restrict__ meta, int nt, int64_t units, lc_lion_args la, int levels,
                         const float* __restrict__ scales, int8_t* __restrict__ q) {
  int hint = -1;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < units; u += stride) {
    int8_t c[8];
    int8_unit(meta, nt, u * 8, la, levels, scales, hint, c);
    store_q8(q, u * 8, c);
  }
}

// bbit pass 3: one thread per unit of 8 bucket elements -> one byte of each code plane and of the nonzero
// plane (gaps: 0), + #zero c; the momentum update when asked.
__global__ void __launch_bounds__(kThreads)
    bbit_codes_kernel(const lc_tensor_meta* __restrict__ meta, int nt, int64_t units, lc_lion_args la, int upd,
                      const float* __restrict__ ratios, lc_bbit_args bb, uint8_t* __restrict__ planes,
                      uint8_t* __restrict__ nonzero, int64_t* __restrict__ n_zero) {
  int hint = -1;
  unsigned long long nzero = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < units; u += stride) {
    uint32_t codes[4], z;
    int zr = 0;
    bbit_unit(meta, nt, u * 8, la, upd, ratios, bb, hint, codes, z, zr);
    for (int j = 0; j < bb.bits; ++j) planes[j * units + u] = static_cast<uint8_t>(codes[j]);
    nonzero[u] = static_cast<uint8_t>(z);
    nzero += static_cast<unsigned long long>(zr);
  }
  block_add_counts(nzero, 0ull, n_zero, false);
}

}  // namespace
}  // namespace lc

extern "C" cudaError_t lc_local_step(const lc_tensor_meta* meta, int n_tensors, int64_t total, lc_lion_args args,
                                     int update_momentum, uint8_t* sign_out, uint8_t* nonzero_out, int64_t* counts,
                                     cudaStream_t stream) {
  if (n_tensors < 0 || total < 0 || total % 8 != 0 || (n_tensors > 0 && meta == nullptr) || counts == nullptr)
    return cudaErrorInvalidValue;
  const int64_t units = total / 8;
  if (units == 0) return cudaSuccess;
  if (sign_out == nullptr || nonzero_out == nullptr) return cudaErrorInvalidValue;
  return lc::launch(lc::local_step_kernel, lc::grid_for(units, lc::kThreads), lc::kThreads, stream, meta, n_tensors,
                    units, args, update_momentum, sign_out, nonzero_out, counts);
}

extern "C" cudaError_t lc_momentum_update(const lc_tensor_meta* meta, int n_tensors, int64_t n_chunks,
                                          lc_lion_args args, cudaStream_t stream) {
  if (n_tensors < 0 || n_chunks < 0 || (n_chunks > 0 && (meta == nullptr || n_tensors == 0)))
    return cudaErrorInvalidValue;
  if (n_chunks == 0) return cudaSuccess;
  return lc::launch(lc::momentum_kernel, lc::grid_for(n_chunks, 1), lc::kThreads, stream, meta, n_tensors, n_chunks,
                    args);
}

extern "C" size_t lc_int8_workspace_bytes(int64_t n_chunks) {
  return static_cast<size_t>(n_chunks > 0 ? n_chunks : 0) * sizeof(lc::Acc);
}

extern "C" cudaError_t lc_int8_local_step(const lc_tensor_meta* meta, int n_tensors, int64_t n_chunks, int64_t total,
                                          lc_lion_args args, int kind, int levels, int8_t* q_out, float* scales_out,
                                          void* workspace, size_t workspace_bytes, int64_t* n_bad,
                                          cudaStream_t stream) {
  if (n_tensors < 0 || n_chunks < 0 || total < 0 || total % 8 != 0 || levels < 1 || levels > 127 ||
      (kind != LC_SCALE_L1 && kind != LC_SCALE_L0 && kind != LC_SCALE_LINF) || n_bad == nullptr)
    return cudaErrorInvalidValue;
  if (n_tensors > 0 && (meta == nullptr || scales_out == nullptr)) return cudaErrorInvalidValue;
  if (workspace_bytes < lc_int8_workspace_bytes(n_chunks) || (n_chunks > 0 && workspace == nullptr))
    return cudaErrorInvalidValue;
  lc::Acc* partials = static_cast<lc::Acc*>(workspace);
  if (n_chunks > 0) {
    const cudaError_t e = lc::launch(lc::int8_partials_kernel, lc::grid_for(n_chunks, 1), lc::kThreads, stream, meta,
                                     n_tensors, n_chunks, args, kind, partials, n_bad);
    if (e != cudaSuccess) return e;
    const cudaError_t e2 = lc::launch(lc::int8_scale_kernel, lc::grid_for(n_tensors, lc::kThreads), lc::kThreads,
                                      stream, meta, n_tensors, partials, kind, 0, scales_out);
    if (e2 != cudaSuccess) return e2;
  }
  const int64_t units = total / 8;
  if (units == 0) return cudaSuccess;
  if (q_out == nullptr) return cudaErrorInvalidValue;
  return lc::launch(lc::int8_quantize_kernel, lc::grid_for(units, lc::kThreads), lc::kThreads, stream, meta, n_tensors,
                    units, args, levels, scales_out, q_out);
}

extern "C" cudaError_t lc_bbit_local_step(const lc_tensor_meta* meta, int n_tensors, int64_t n_chunks, int64_t total,
                                          lc_lion_args args, lc_bbit_args bb, int update_momentum, uint8_t* planes_out,
                                          uint8_t* nonzero_out, float* ratios_out, void* workspace,
                                          size_t workspace_bytes, int64_t* counts, cudaStream_t stream) {
  if (n_tensors < 0 || n_chunks < 0 || total < 0 || total % 8 != 0 || bb.bits < 1 || bb.bits > 4 ||
      (bb.rounding != LC_ROUND_NEAREST && bb.rounding != LC_ROUND_DITHER) ||
      (bb.kind != LC_SCALE_L1 && bb.kind != LC_SCALE_L0 && bb.kind != LC_SCALE_LINF) || bb.tie_nrows < 0 ||
      (bb.tie_nrows > 0 && bb.tie_rows == nullptr) || counts == nullptr)
    return cudaErrorInvalidValue;
  if (n_tensors > 0 && (meta == nullptr || ratios_out == nullptr)) return cudaErrorInvalidValue;
  if (workspace_bytes < lc_int8_workspace_bytes(n_chunks) || (n_chunks > 0 && workspace == nullptr))
    return cudaErrorInvalidValue;
  lc::Acc* partials = static_cast<lc::Acc*>(workspace);
  if (n_chunks > 0) {  // the scales and ratios (the int8 passes 1 and 2), the non-finite count into counts[0]
    const cudaError_t e = lc::launch(lc::int8_partials_kernel, lc::grid_for(n_chunks, 1), lc::kThreads, stream, meta,
                                     n_tensors, n_chunks, args, bb.kind, partials, counts);
    if (e != cudaSuccess) return e;
    const cudaError_t e2 = lc::launch(lc::int8_scale_kernel, lc::grid_for(n_tensors, lc::kThreads), lc::kThreads,
                                      stream, meta, n_tensors, partials, bb.kind, bb.bits, ratios_out);
    if (e2 != cudaSuccess) return e2;
  }
  const int64_t units = total / 8;
  if (units == 0) return cudaSuccess;
  if (planes_out == nullptr || nonzero_out == nullptr) return cudaErrorInvalidValue;
  return lc::launch(lc::bbit_codes_kernel, lc::grid_for(units, lc::kThreads), lc::kThreads, stream, meta, n_tensors,
                    units, args, update_momentum, ratios_out, bb, planes_out, nonzero_out, counts + 1);
}
