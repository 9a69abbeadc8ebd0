// lioncub_step.cu -- fused CUDA kernels of the single-process Lion step (Lion, LionCub at N = 1,
// the ZeRO-1/2 partition step) and of the ZeRO sign all-gather apply (every rank's partition from
// the all-gathered sign planes: unpack, decay, apply, cast, in one launch).
//
// Both are chunked multi-tensor launches: one block per LC_CHUNK chunk of one tensor (piece),
// grid-stride over the chunks; a thread takes 8 consecutive elements (16-byte vector loads and
// stores where aligned), so a warp reads and writes contiguous memory. Memory-bound: a Lion step
// moves 20 B/param in fp32 (read g, m, theta; write m, theta), the apply 8 B + 1 bit (+2 B cast).
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

__global__ void __launch_bounds__(kThreads)
    lion_step_kernel(const lc_lion_meta* __restrict__ meta, int nt, int64_t n_chunks, lc_lion_step_args a) {
  for (int64_t ch = blockIdx.x; ch < n_chunks; ch += gridDim.x) {
    const LionTensor T = read_lion_meta(meta, search_chunk_of(meta, nt, ch));
    const int64_t c0 = (ch - T.chunk_start) * LC_CHUNK;
    const int64_t c1 = T.numel < c0 + LC_CHUNK ? T.numel : c0 + LC_CHUNK;
    for (int64_t j = c0 + 8 * static_cast<int64_t>(threadIdx.x); j < c1; j += 8 * static_cast<int64_t>(blockDim.x)) {
      const int64_t rem = c1 - j;
      lion_unit(T, j, rem < 8 ? static_cast<int>(rem) : 8, a);
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    zero_apply_kernel(const uint8_t* __restrict__ sign, int64_t sign_stride, const uint8_t* __restrict__ nonzero,
                      int64_t nz_stride, const lc_zero_piece* __restrict__ pieces, int np, int64_t n_chunks) {
  for (int64_t ch = blockIdx.x; ch < n_chunks; ch += gridDim.x) {
    const lc_zero_piece P = pieces[search_chunk_of(pieces, np, ch)];
    const int64_t c0 = (ch - P.chunk_start) * LC_CHUNK;
    const int64_t c1 = P.numel < c0 + LC_CHUNK ? P.numel : c0 + LC_CHUNK;
    for (int64_t j = c0 + 8 * static_cast<int64_t>(threadIdx.x); j < c1; j += 8 * static_cast<int64_t>(blockDim.x)) {
      const int64_t rem = c1 - j;
      zero_unit(P, sign, sign_stride, nonzero, nz_stride, j, rem < 8 ? static_cast<int>(rem) : 8);
    }
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
