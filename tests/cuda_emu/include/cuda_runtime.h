// cuda_runtime.h -- the host emulation's stand-in for CUDA's device-side language (tests only).
//
// tests/test_cuda_kernels.py compiles csrc/cuda/*.cu with the host C++ compiler and this folder first
// on the include path: the kernels' own code (every __global__ function, its launch configuration,
// its shared memory, barriers and warp shuffles) then runs on the CPU. lioncub_cuda_emu.cpp is the
// runtime behind these names: each CUDA thread of a block is a fiber (its own stack); __syncthreads
// and __shfl_*_sync suspend a fiber until every thread of its block / warp has arrived, as on the
// device, and a barrier or shuffle that some thread never reaches fails the launch. Blocks run one at
// a time, so `__shared__` (a static variable here) is shared by exactly one block's threads.
#ifndef LC_EMU_CUDA_RUNTIME_H_
#define LC_EMU_CUDA_RUNTIME_H_

#include <stdint.h>
#include <string.h>

#include "cuda_runtime_api.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

namespace lc_emu {

// The coordinates of the running thread (threadIdx, blockIdx, blockDim, gridDim).
struct Coords {
  uint3 thread, block, block_dim, grid_dim;
};
const Coords& coords();
void syncthreads();
// Every lane of the calling thread's warp publishes `value`; returns lane `src`'s (a warp barrier).
uint64_t exchange(unsigned mask, uint64_t value, int src);

template <class T>
inline T shfl(unsigned mask, T v, int src) {
  static_assert(sizeof(T) <= 8, "shuffles of up to 8 bytes");
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  bits = exchange(mask, bits, src);
  T out;
  memcpy(&out, &bits, sizeof(T));
  return out;
}

}  // namespace lc_emu

#define threadIdx (::lc_emu::coords().thread)
#define blockIdx (::lc_emu::coords().block)
#define blockDim (::lc_emu::coords().block_dim)
#define gridDim (::lc_emu::coords().grid_dim)

inline void __syncthreads() { ::lc_emu::syncthreads(); }

template <class T>
inline T __shfl_sync(unsigned mask, T v, int src) {
  return ::lc_emu::shfl(mask, v, src & 31);
}

template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta) {
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int src = lane + static_cast<int>(delta);
  const T got = ::lc_emu::shfl(mask, v, src < 32 ? src : lane);  // past the warp: the caller's own value
  return got;
}

// The occupancy API: blocks of `block` threads one emulated SM holds at once (lc_emu_resident_blocks).
extern "C" int lc_emu_resident_blocks(int block);
template <class T>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, T, int block, size_t) {
  *n = lc_emu_resident_blocks(block);
  return cudaSuccess;
}

// One fiber runs at a time: a read-modify-write is atomic.
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  const unsigned long long old = *p;
  *p = old + v;
  return old;
}
inline int atomicOr(int* p, int v) {
  const int old = *p;
  *p = old | v;
  return old;
}

#endif  // LC_EMU_CUDA_RUNTIME_H_
