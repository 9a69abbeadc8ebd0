// emu_selftest.cu -- small kernels that test the host emulation's runtime itself (tests only; built
// into the emulation library with csrc/cuda/*.cu). tests/test_cuda_kernels.py
// (test_emulation_runs_barriers_shuffles_and_shared_memory_like_a_gpu) checks what each one gives.
#include <cuda_runtime.h>
#include <stdint.h>

#include "../../csrc/cuda/lioncub_cuda_common.cuh"

namespace {

// 0: every warp's sum of its global thread indices, by __shfl_down_sync, into out[warp]
__global__ void warp_sum_kernel(int32_t* out) {
  unsigned v = blockIdx.x * blockDim.x + threadIdx.x;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31u) == 0) out[(blockIdx.x * blockDim.x + threadIdx.x) / 32] = static_cast<int32_t>(v);
}

// 1: out[b*256 + t] = the value thread 255 - t stored in shared memory before the barrier
__global__ void mirror_kernel(int32_t* out) {
  __shared__ int32_t s[256];
  s[threadIdx.x] = static_cast<int32_t>(1000 * blockIdx.x + threadIdx.x);
  __syncthreads();
  out[blockIdx.x * 256 + threadIdx.x] = s[255 - threadIdx.x];
}

// 2: a barrier that the upper threads of the block skip (undefined on a GPU; an error here)
__global__ void divergent_barrier_kernel(int32_t* out) {
  if (threadIdx.x < 100) __syncthreads();
  out[threadIdx.x] = 1;
}

// 3: a whole-warp shuffle that lane 31 skips (undefined on a GPU; an error here)
__global__ void partial_shuffle_kernel(int32_t* out) {
  if ((threadIdx.x & 31u) != 31u) out[threadIdx.x] = static_cast<int32_t>(__shfl_sync(0xffffffffu, threadIdx.x, 0));
}

// 4: every thread writes its index into one word: the last writer depends on the schedule
__global__ void last_writer_kernel(int32_t* out) { out[0] = static_cast<int32_t>(blockIdx.x * blockDim.x + threadIdx.x); }

}  // namespace

extern "C" cudaError_t lc_emu_selftest(int which, int32_t* out, int grid) {
  switch (which) {
    case 0: return lc::launch(warp_sum_kernel, grid, lc::kThreads, nullptr, out);
    case 1: return lc::launch(mirror_kernel, grid, lc::kThreads, nullptr, out);
    case 2: return lc::launch(divergent_barrier_kernel, grid, lc::kThreads, nullptr, out);
    case 3: return lc::launch(partial_shuffle_kernel, grid, lc::kThreads, nullptr, out);
    case 4: return lc::launch(last_writer_kernel, grid, lc::kThreads, nullptr, out);
    default: return cudaErrorInvalidValue;
  }
}
