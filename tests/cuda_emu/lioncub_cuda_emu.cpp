// lioncub_cuda_emu.cpp -- the runtime of the host emulation of the CUDA kernels (tests only).
//
// Not part of any build of the package (it lives under tests/, so it is not in the wheel).
// tests/test_cuda_kernels.py compiles csrc/cuda/lioncub_{local,vote,step}.cu with the host C++
// compiler, tests/cuda_emu/include/ first on the include path (cuda_runtime.h & co.: the device-side
// names), and links them with this file. Python then calls the kernels' own C API (lioncub_cuda.h:
// lc_local_step, lc_vote_apply, ...) on host memory, and every launch runs the real __global__
// functions of csrc/cuda with their real launch configuration (lc::grid_for on an emulated device of
// a settable number of SMs), shared memory, __syncthreads and warp shuffles. No kernel code is
// restated here: this file only runs CUDA threads.
//
// How: lc::launch (csrc/cuda/lioncub_cuda_common.cuh) calls lc_host_launch below when the kernels are
// built by a host compiler. Blocks run one after another (in index order, or a seeded permutation);
// the threads of a block are fibers (ucontext, one stack each) run by a cooperative scheduler: a thread
// runs until it reaches __syncthreads (all threads of the block must arrive) or a __shfl_*_sync (all
// 32 lanes of its warp must arrive, each with its value), or ends. A barrier or shuffle that a thread
// of the block / warp never reaches (it ended, or waits elsewhere) fails the launch with
// cudaErrorLaunchFailure: on a GPU that is undefined behaviour, here it is an error. The order in
// which runnable threads (and blocks) are resumed is the natural one, or a seeded permutation, so a
// kernel whose output depends on the order of independent threads fails a test that compares seeds.
//
// WHAT THIS STILL DOES NOT SEE (docs/kernels.md): threads never run truly concurrently (a data race
// between two threads of a barrier interval, memory ordering, or an atomic's interleaving cannot show
// up, beyond what the permuted orders reveal); the device compiler's code (nvcc's own compile of
// these sources is checked by tests/test_cuda_compile.py, not run); the device intrinsics (__fmul_rn,
// __ffs, rintf, ...: the host branches of the same LC_HD functions run instead, checked against the
// same reference); shared memory starts with the previous block's contents instead of garbage; the
// CUDA runtime itself (streams, device memory, the torch bindings of bindings_cuda.cpp).
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <algorithm>
#include <random>
#include <vector>

#include "cuda_runtime.h"
#include "../../csrc/common/lioncub_common.h"

namespace {

constexpr size_t kStack = 256 * 1024;  // per emulated thread (virtual; the kernels use a few KB)
constexpr int kMaxThreads = 1024;

enum State { kRunnable, kAtBarrier, kAtShuffle, kDone };

struct Fiber {
  ucontext_t ctx;
  State state = kRunnable;
  unsigned shuffles = 0;  // shuffles this thread has passed (selects the exchange buffer)
  lc_emu::Coords coords;
};

struct Emulator {
  int sms = 2;                   // the emulated device's multiprocessors (lc::grid_for reads them)
  uint64_t seed = 0;             // 0: natural order; else the seed of the thread / block permutations
  cudaError_t last = cudaSuccess;
  std::vector<char> stacks;
  std::vector<Fiber> fibers;
  std::vector<int> order;
  ucontext_t scheduler;
  Fiber* current = nullptr;
  int nthreads = 0;
  int at_barrier = 0;
  std::vector<int> at_shuffle;               // per warp: lanes waiting
  std::vector<uint64_t> slots;               // [warp][2][32] published values
  void (*body)(const void*) = nullptr;
  const void* ctx = nullptr;
  bool failed = false;
};

Emulator& emu() {
  static Emulator e;
  return e;
}

void fiber_main() {
  Emulator& e = emu();
  e.body(e.ctx);
  e.current->state = kDone;  // uc_link returns to the scheduler
}

// Suspend the running thread until the scheduler resumes it.
void yield_to_scheduler() {
  Emulator& e = emu();
  swapcontext(&e.current->ctx, &e.scheduler);
}

void release(State waiting, int warp) {
  Emulator& e = emu();
  for (int t = 0; t < e.nthreads; ++t) {
    Fiber& f = e.fibers[t];
    if (f.state == waiting && (warp < 0 || t / 32 == warp)) f.state = kRunnable;
  }
}

// Runs one block: every thread from its start to its end; false when a barrier or shuffle cannot
// complete (some thread of the block / warp never arrives).
bool run_block(const lc_emu::Coords& base, std::mt19937_64* rng) {
  Emulator& e = emu();
  e.at_barrier = 0;
  std::fill(e.at_shuffle.begin(), e.at_shuffle.end(), 0);
  for (int t = 0; t < e.nthreads; ++t) {
    Fiber& f = e.fibers[t];
    f.state = kRunnable;
    f.shuffles = 0;
    f.coords = base;
    f.coords.thread = uint3{static_cast<unsigned>(t), 0u, 0u};
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = e.stacks.data() + static_cast<size_t>(t) * kStack;
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = &e.scheduler;
    makecontext(&f.ctx, fiber_main, 0);
  }
  for (;;) {
    if (rng) std::shuffle(e.order.begin(), e.order.begin() + e.nthreads, *rng);
    bool ran = false, all_done = true;
    for (int k = 0; k < e.nthreads; ++k) {
      Fiber& f = e.fibers[e.order[k]];
      if (f.state == kRunnable) {
        e.current = &f;
        swapcontext(&e.scheduler, &f.ctx);
        ran = true;
      }
      all_done = all_done && f.state == kDone;
    }
    if (all_done) return true;
    if (!ran) return false;  // everyone left waits for a thread that will never come
  }
}

}  // namespace

// ----------------------------------------------------------------------------- device-side names
namespace lc_emu {

const Coords& coords() { return emu().current->coords; }

void syncthreads() {
  Emulator& e = emu();
  if (++e.at_barrier == e.nthreads) {
    e.at_barrier = 0;
    release(kAtBarrier, -1);
    return;
  }
  e.current->state = kAtBarrier;
  yield_to_scheduler();
}

uint64_t exchange(unsigned mask, uint64_t value, int src) {
  Emulator& e = emu();
  Fiber& f = *e.current;
  if (mask != 0xffffffffu) {  // the kernels shuffle whole warps only
    e.failed = true;
    f.state = kDone;
    yield_to_scheduler();
  }
  const int t = static_cast<int>(f.coords.thread.x), warp = t / 32, lane = t % 32;
  const size_t base = (static_cast<size_t>(warp) * 2 + (f.shuffles & 1u)) * 32;
  e.slots[base + lane] = value;
  f.shuffles += 1;
  if (++e.at_shuffle[warp] == 32) {
    e.at_shuffle[warp] = 0;
    release(kAtShuffle, warp);
  } else {
    f.state = kAtShuffle;
    yield_to_scheduler();
  }
  return e.slots[base + src];
}

}  // namespace lc_emu

// ----------------------------------------------------------------------------- launches
extern "C" cudaError_t lc_host_launch(int grid, int block, cudaStream_t, void (*body)(const void*), const void* ctx) {
  Emulator& e = emu();
  if (grid < 1 || block < 32 || block > kMaxThreads || block % 32 != 0) return e.last = cudaErrorInvalidConfiguration;
  if (e.stacks.size() < static_cast<size_t>(block) * kStack) e.stacks.resize(static_cast<size_t>(block) * kStack);
  e.fibers.resize(std::max<size_t>(e.fibers.size(), block));
  e.order.resize(block);
  for (int t = 0; t < block; ++t) e.order[t] = t;
  e.at_shuffle.assign(block / 32, 0);
  e.slots.assign(static_cast<size_t>(block / 32) * 2 * 32, 0);
  e.nthreads = block;
  e.body = body;
  e.ctx = ctx;
  e.failed = false;
  std::vector<int> blocks(grid);
  for (int b = 0; b < grid; ++b) blocks[b] = b;
  std::mt19937_64 rng(e.seed);
  if (e.seed) std::shuffle(blocks.begin(), blocks.end(), rng);
  lc_emu::Coords base;
  base.block_dim = uint3{static_cast<unsigned>(block), 1u, 1u};
  base.grid_dim = uint3{static_cast<unsigned>(grid), 1u, 1u};
  for (int b : blocks) {
    base.block = uint3{static_cast<unsigned>(b), 0u, 0u};
    if (!run_block(base, e.seed ? &rng : nullptr) || e.failed) return e.last = cudaErrorLaunchFailure;
  }
  return cudaSuccess;
}

extern "C" {

cudaError_t cudaGetLastError(void) {
  const cudaError_t r = emu().last;
  emu().last = cudaSuccess;
  return r;
}

cudaError_t cudaGetDevice(int* device) {
  *device = emu().sms;  // one emulated device per SM count: lc::grid_for caches the count per device
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  *value = device;
  return cudaSuccess;
}

// An emulated SM holds 1536 threads' worth of blocks (6 of 256 threads: a kernel at ~40 registers on
// an sm_90 SM), so lc::launch trims grids to a wave below lc::grid_for's 8 blocks per SM, as on a GPU.
int lc_emu_resident_blocks(int block) { return block > 0 && block <= 1536 ? 1536 / block : 1; }

const char* cudaGetErrorString(cudaError_t error) {
  return error == cudaSuccess ? "no error" : "emulated CUDA error";
}

// The emulated device: `sms` multiprocessors (1..63) and the schedule (0: threads and blocks in index
// order; else the seed of their permutations). Returns 0, or -1 for an SM count out of range.
int lc_emu_configure(int sms, uint64_t seed) {
  if (sms < 1 || sms > 63) return -1;
  emu().sms = sms;
  emu().seed = seed;
  return 0;
}

// The kernels' argument structs, made by the one host function of csrc/common each (what the bindings call).
lc_lion_args lc_emu_lion_args(double beta1, double beta2) { return lc_make_lion_args(beta1, beta2); }
lc_apply_args lc_emu_apply_args(double lr, double weight_decay, int64_t step, int tie, int vote, int world_size,
                                const int64_t* tie_rows, int64_t tie_nrows) {
  return lc_make_apply_args(lr, weight_decay, step, tie, vote, world_size, tie_rows, tie_nrows);
}
lc_lion_step_args lc_emu_lion_step_args(double lr, double weight_decay, double beta1, double beta2) {
  return lc_make_lion_step_args(lr, weight_decay, beta1, beta2);
}

}  // extern "C"
