// lioncub_cuda_emu.cpp -- serial host emulation of the fused CUDA kernels (tests only).
//
// Not part of any build of the package (it lives under tests/, so it is not in the wheel).
// tests/test_cuda_kernels.py compiles it with the
// host C++ compiler (CUDA include dir on the path, no GPU needed) and checks it against
// lioncub_ds/kernels/reference.py, so the per-element logic of the kernels -- everything in
// lioncub_cuda_common.cuh and lioncub_cuda_vote.cuh: bit order, bit-sliced counting, majority masks, tie rules,
// lanes, int8 scales and codes, the 16-byte vector paths, the tensor lookup -- is
// verified on a machine without a GPU. The emulation mirrors each kernel's thread
// structure: grid-stride loops with a given number of threads (so the lookup hints jump
// across tensors as on the device), warps of 32 lanes for vote_apply with the same
// word-to-lane hand-off the shuffles do, and the same fixed reduction trees for int8.
//
// BLIND SPOT: the emulation rebuilds that thread structure itself. The launch configuration,
// the __shfl_sync hand-offs, shared memory and __syncthreads of the real .cu kernels are NOT
// exercised here, so a launch or warp-shuffle bug in csrc/cuda/*.cu passes these tests. Only a
// run of tests/test_cuda_kernels.py on a GPU (docs/kernels.md, "GPU checklist") covers them.
// All pointers are host pointers; every function returns 0, or -1 for invalid arguments.
#include <stdint.h>

#include <vector>

#include "../../csrc/cuda/lioncub_cuda.h"
#include "../../csrc/cuda/lioncub_cuda_vote.cuh"  // and lioncub_cuda_common.cuh

using namespace lc;

namespace {

lc_lion_args lion_args(float b1, float omb1, float b2, float omb2) {
  lc_lion_args la;
  la.b1 = b1;
  la.omb1 = omb1;
  la.b2 = b2;
  la.omb2 = omb2;
  return la;
}

lc_apply_args apply_args(float neg_lr, float decay, int apply_decay, int tie, int vote, int world_size, int64_t step,
                         const int64_t* tie_rows, int64_t tie_nrows) {
  lc_apply_args a;
  a.neg_lr = neg_lr;
  a.decay = decay;
  a.apply_decay = apply_decay;
  a.tie = tie;
  a.vote = vote;
  a.world_size = world_size;
  a.step = step;
  a.tie_rows = tie_rows;
  a.tie_nrows = tie_nrows;
  return a;
}

template <int KB>
void vote_apply_t(const uint8_t* sign, const uint8_t* nz, int rows, int64_t row_bytes, const lc_tensor_meta* meta,
                  int nt, const lc_apply_args& a, float* delta_out, int64_t nwarps) {
  const bool aligned = (reinterpret_cast<uintptr_t>(sign) & 3u) == 0 &&
                       (nz == nullptr || (reinterpret_cast<uintptr_t>(nz) & 3u) == 0) && row_bytes % 4 == 0;
  const bool avg = a.vote == LC_VOTE_AVERAGE;
  const int64_t nwords = (row_bytes + 3) >> 2, ntiles = (nwords + 31) >> 5;
  for (int64_t warp = 0; warp < nwarps; ++warp) {
    int hint[32];
    for (int l = 0; l < 32; ++l) hint[l] = -1;
    for (int64_t tile = warp; tile < ntiles; tile += nwarps) {
      uint32_t P[32][KB], C[32][KB], pos[32], neg[32], tie[32];
      for (int lane = 0; lane < 32; ++lane) {  // phase 1: every lane counts its word
        const int64_t w = tile * 32 + lane;
        if (w < nwords) {
          count_word<KB>(sign, nz, rows, row_bytes, w, aligned, P[lane], C[lane]);
        } else {
          for (int k = 0; k < KB; ++k) P[lane][k] = C[lane][k] = 0u;
        }
        pos[lane] = neg[lane] = tie[lane] = 0u;
        if (!avg) majority_masks<KB>(P[lane], C[lane], pos[lane], neg[lane], tie[lane]);
      }
      for (int r = 0; r < 4; ++r) {  // phase 2: lane takes unit 32r+lane from lane src (a shuffle)
        for (int lane = 0; lane < 32; ++lane) {
          const int src = r * 8 + (lane >> 2), sel = lane & 3;
          const int64_t u = tile * 128 + r * 32 + lane;
          float d[8];
          if (!avg) majority_delta8(pos[src], neg[src], tie[src], sel, a, u * 8, d);
          else average_delta8<KB>(P[src], C[src], sel, a, d);
          if (u < row_bytes) {
            if (delta_out) store_delta8(delta_out, u * 8, 8, d);
            apply_at(meta, nt, u * 8, d, a, hint[lane]);
          }
        }
      }
    }
  }
}

template <int KB>
void shard_vote_t(const uint8_t* sign, const uint8_t* nz, int rows, int64_t row_bytes, int tie_rule, int64_t step,
                  const int64_t* tie_rows, int64_t tie_nrows, uint8_t* out_sign, uint8_t* out_nz, int64_t nthreads) {
  const bool aligned = (reinterpret_cast<uintptr_t>(sign) & 3u) == 0 &&
                       (nz == nullptr || (reinterpret_cast<uintptr_t>(nz) & 3u) == 0) && row_bytes % 4 == 0;
  const bool out_aligned = (reinterpret_cast<uintptr_t>(out_sign) & 3u) == 0 &&
                           (reinterpret_cast<uintptr_t>(out_nz) & 3u) == 0;
  const int64_t nwords = (row_bytes + 3) >> 2;
  for (int64_t t = 0; t < nthreads; ++t)
    for (int64_t w = t; w < nwords; w += nthreads) {
      uint32_t P[KB], C[KB], pos, neg, tie, os, oz;
      count_word<KB>(sign, nz, rows, row_bytes, w, aligned, P, C);
      majority_masks<KB>(P, C, pos, neg, tie);
      shard_word(pos, neg, tie, tie_rule, step, w * 32, tie_rows, tie_nrows, os, oz);
      store_words(out_sign, w * 4, row_bytes, &os, 1, out_aligned);
      store_words(out_nz, w * 4, row_bytes, &oz, 1, out_aligned);
    }
}

template <int KB>
int count_lanes_t(const uint8_t* sign, const uint8_t* nz, int rows, int64_t row_bytes, int p, uint8_t* plus_out,
                  uint8_t* cnt_out, int64_t nthreads) {
  const bool aligned = (reinterpret_cast<uintptr_t>(sign) & 3u) == 0 &&
                       (nz == nullptr || (reinterpret_cast<uintptr_t>(nz) & 3u) == 0) && row_bytes % 4 == 0;
  const bool out_aligned = (reinterpret_cast<uintptr_t>(plus_out) & 3u) == 0 &&
                           (cnt_out == nullptr || (reinterpret_cast<uintptr_t>(cnt_out) & 3u) == 0);
  const int64_t nwords = (row_bytes + 3) >> 2, out_bytes = row_bytes * p;
  int overflow = 0;
  for (int64_t t = 0; t < nthreads; ++t)
    for (int64_t w = t; w < nwords; w += nthreads) {
      uint32_t P[KB], C[KB], o[8];
      count_word<KB>(sign, nz, rows, row_bytes, w, aligned, P, C);
      pack_lanes_word<KB>(P, p, o);
      store_words(plus_out, w * 4 * p, out_bytes, o, p, out_aligned);
      if (cnt_out) {
        pack_lanes_word<KB>(C, p, o);
        store_words(cnt_out, w * 4 * p, out_bytes, o, p, out_aligned);
      }
      if (nz) {
        uint32_t hi = 0u;
        for (int k = 0; k < KB; ++k)
          if (k >= p) hi |= C[k];
        const int64_t nvalid = row_bytes - 4 * w;
        const uint32_t valid = nvalid >= 4 ? 0xffffffffu : ((1u << (8 * nvalid)) - 1u);
        if (hi & valid) overflow = 1;
      }
    }
  return overflow;
}

}  // namespace

extern "C" {

int lc_emu_local_step(const lc_tensor_meta* meta, int nt, int64_t total, float b1, float omb1, float b2, float omb2,
                      int upd, uint8_t* sign, uint8_t* nz, int64_t* counts, int64_t nthreads) {
  if (total % 8 || nthreads < 1) return -1;
  const lc_lion_args la = lion_args(b1, omb1, b2, omb2);
  const int64_t units = total / 8;
  for (int64_t t = 0; t < nthreads; ++t) {
    int hint = -1;
    for (int64_t u = t; u < units; u += nthreads) {
      uint32_t s, z;
      int b = 0, zr = 0;
      local_unit(meta, nt, u * 8, la, upd, hint, s, z, b, zr);
      sign[u] = static_cast<uint8_t>(s);
      nz[u] = static_cast<uint8_t>(z);
      counts[0] += b;
      counts[1] += zr;
    }
  }
  return 0;
}

int lc_emu_momentum_update(const lc_tensor_meta* meta, int nt, int64_t n_chunks, float b2, float omb2) {
  const lc_lion_args la = lion_args(0.0f, 0.0f, b2, omb2);
  for (int64_t ch = 0; ch < n_chunks; ++ch) {
    const Tensor T = read_meta(meta, search_chunk(meta, nt, ch));
    const int64_t c0 = (ch - T.chunk_start) * LC_CHUNK;
    const int64_t c1 = T.numel < c0 + LC_CHUNK ? T.numel : c0 + LC_CHUNK;
    for (int tid = 0; tid < kThreads; ++tid)
      for (int64_t j = c0 + 8 * tid; j < c1; j += 8 * kThreads) {
        const int64_t rem = c1 - j;
        momentum_unit(T, j, rem < 8 ? static_cast<int>(rem) : 8, la);
      }
  }
  return 0;
}

int lc_emu_int8_local_step(const lc_tensor_meta* meta, int nt, int64_t n_chunks, int64_t total, float b1, float omb1,
                           int kind, int levels, int8_t* q, float* scales, int64_t* n_bad, int64_t nthreads) {
  if (total % 8 || nthreads < 1) return -1;
  const lc_lion_args la = lion_args(b1, omb1, 0.0f, 0.0f);
  std::vector<Acc> partials(static_cast<size_t>(n_chunks));
  std::vector<Acc> v(kThreads);
  for (int64_t ch = 0; ch < n_chunks; ++ch) {  // pass 1: one block per chunk
    const Tensor T = read_meta(meta, search_chunk(meta, nt, ch));
    const int64_t c0 = (ch - T.chunk_start) * LC_CHUNK;
    const int64_t c1 = T.numel < c0 + LC_CHUNK ? T.numel : c0 + LC_CHUNK;
    for (int tid = 0; tid < kThreads; ++tid) {
      int nb = 0;
      v[tid] = int8_thread_partial(T, c0, c1, tid, la, kind, nb);
      *n_bad += nb;
    }
    partials[ch] = acc_tree(v.data(), kind);
  }
  for (int t = 0; t < nt; ++t) {  // pass 2: one thread per tensor, chunk results in chunk order
    const Tensor T = read_meta(meta, t);
    const int64_t nch = (T.numel + LC_CHUNK - 1) / LC_CHUNK;
    Acc acc;
    acc.s = 0.0;
    acc.n = 0;
    acc.esum = 0;
    for (int64_t k = 0; k < nch; ++k) acc = acc_combine(acc, partials[T.chunk_start + k], kind);
    scales[t] = int8_scale_of(acc, T.numel, kind);
  }
  const int64_t units = total / 8;  // pass 3: one thread per unit
  for (int64_t t = 0; t < nthreads; ++t) {
    int hint = -1;
    for (int64_t u = t; u < units; u += nthreads) {
      int8_t c[8];
      int8_unit(meta, nt, u * 8, la, levels, scales, hint, c);
      store_q8(q, u * 8, c);
    }
  }
  return 0;
}

int lc_emu_vote_apply(const uint8_t* sign, const uint8_t* nz, int rows, int64_t row_bytes, const lc_tensor_meta* meta,
                      int nt, float neg_lr, float decay, int apply_decay, int tie, int vote, int world_size,
                      int64_t step, const int64_t* tie_rows, int64_t tie_nrows, float* delta_out, int64_t nwarps) {
  if (rows < 1 || nwarps < 1) return -1;
  const lc_apply_args a = apply_args(neg_lr, decay, apply_decay, tie, vote, world_size, step, tie_rows, tie_nrows);
  switch (levels_for_rows(rows)) {
    case 4: vote_apply_t<4>(sign, nz, rows, row_bytes, meta, nt, a, delta_out, nwarps); return 0;
    case 8: vote_apply_t<8>(sign, nz, rows, row_bytes, meta, nt, a, delta_out, nwarps); return 0;
    case 16: vote_apply_t<16>(sign, nz, rows, row_bytes, meta, nt, a, delta_out, nwarps); return 0;
    default: return -1;
  }
}

int lc_emu_shard_vote(const uint8_t* sign, const uint8_t* nz, int rows, int64_t row_bytes, int tie, int64_t step,
                      const int64_t* tie_rows, int64_t tie_nrows, uint8_t* out_sign, uint8_t* out_nz,
                      int64_t nthreads) {
  if (rows < 1 || nthreads < 1) return -1;
  switch (levels_for_rows(rows)) {
    case 4: shard_vote_t<4>(sign, nz, rows, row_bytes, tie, step, tie_rows, tie_nrows, out_sign, out_nz, nthreads); return 0;
    case 8: shard_vote_t<8>(sign, nz, rows, row_bytes, tie, step, tie_rows, tie_nrows, out_sign, out_nz, nthreads); return 0;
    case 16: shard_vote_t<16>(sign, nz, rows, row_bytes, tie, step, tie_rows, tie_nrows, out_sign, out_nz, nthreads); return 0;
    default: return -1;
  }
}

// Returns 1 when a count overflowed its lane, 0 otherwise, -1 for invalid arguments.
int lc_emu_count_lanes(const uint8_t* sign, const uint8_t* nz, int rows, int64_t row_bytes, int p, uint8_t* plus_out,
                       uint8_t* cnt_out, int64_t nthreads) {
  if (rows < 1 || rows > 255 || nthreads < 1 || (p != 1 && p != 2 && p != 4 && p != 8)) return -1;
  switch (levels_for_rows(rows)) {
    case 4: return count_lanes_t<4>(sign, nz, rows, row_bytes, p, plus_out, cnt_out, nthreads);
    case 8: return count_lanes_t<8>(sign, nz, rows, row_bytes, p, plus_out, cnt_out, nthreads);
    default: return -1;
  }
}

int lc_emu_lanes_apply(const uint8_t* plus, const uint8_t* cnt, int64_t numel, int p, const lc_tensor_meta* meta,
                       int nt, float neg_lr, float decay, int apply_decay, int tie, int vote, int world_size,
                       int64_t step, const int64_t* tie_rows, int64_t tie_nrows, float* delta_out, int64_t nthreads) {
  if (nthreads < 1 || (p != 1 && p != 2 && p != 4 && p != 8)) return -1;
  const lc_apply_args a = apply_args(neg_lr, decay, apply_decay, tie, vote, world_size, step, tie_rows, tie_nrows);
  const int64_t units = (numel + 7) / 8;
  for (int64_t t = 0; t < nthreads; ++t) {
    int hint = -1;
    for (int64_t u = t; u < units; u += nthreads) {
      const int64_t e0 = u * 8, rem = numel - e0;
      const int n = rem < 8 ? static_cast<int>(rem) : 8;
      float d[8];
      lanes_delta8(plus, cnt, u, n, p, a, d);
      if (delta_out) store_delta8(delta_out, e0, n, d);
      apply_at(meta, nt, e0, d, a, hint);
    }
  }
  return 0;
}

int lc_emu_int8_apply(const int8_t* qsum, int64_t numel, const lc_tensor_meta* meta, int nt, float neg_lr,
                      float decay, int apply_decay, float* delta_out, int64_t nthreads) {
  if (nthreads < 1) return -1;
  const lc_apply_args a = apply_args(neg_lr, decay, apply_decay, 0, 0, 1, 0, nullptr, 0);
  const int64_t units = (numel + 7) / 8;
  for (int64_t t = 0; t < nthreads; ++t) {
    int hint = -1;
    for (int64_t u = t; u < units; u += nthreads) {
      const int64_t e0 = u * 8, rem = numel - e0;
      const int n = rem < 8 ? static_cast<int>(rem) : 8;
      float d[8];
      int8_delta8(qsum, e0, n, d);
      if (delta_out) store_delta8(delta_out, e0, n, d);
      apply_at(meta, nt, e0, d, a, hint);
    }
  }
  return 0;
}

// lioncub_step.cu lion_step_kernel: one block per chunk, thread tid takes units tid, tid + kThreads, ...
int lc_emu_lion_step(const lc_lion_meta* meta, int nt, int64_t n_chunks, float b1, float omb1, float b2, float omb2,
                     float neg_lr, float decay, int apply_decay) {
  lc_lion_step_args a;
  a.betas = lion_args(b1, omb1, b2, omb2);
  a.neg_lr = neg_lr;
  a.decay = decay;
  a.apply_decay = apply_decay;
  for (int64_t ch = 0; ch < n_chunks; ++ch) {
    const LionTensor T = read_lion_meta(meta, search_chunk_of(meta, nt, ch));
    const int64_t c0 = (ch - T.chunk_start) * LC_CHUNK;
    const int64_t c1 = T.numel < c0 + LC_CHUNK ? T.numel : c0 + LC_CHUNK;
    for (int tid = 0; tid < kThreads; ++tid)
      for (int64_t j = c0 + 8 * tid; j < c1; j += 8 * kThreads) {
        const int64_t rem = c1 - j;
        lion_unit(T, j, rem < 8 ? static_cast<int>(rem) : 8, a);
      }
  }
  return 0;
}

// lioncub_step.cu zero_apply_kernel, likewise over the pieces' chunks.
int lc_emu_zero_sign_apply(const uint8_t* sign, int64_t sign_stride, const uint8_t* nz, int64_t nz_stride,
                           const lc_zero_piece* pieces, int np, int64_t n_chunks) {
  for (int64_t ch = 0; ch < n_chunks; ++ch) {
    const lc_zero_piece P = pieces[search_chunk_of(pieces, np, ch)];
    const int64_t c0 = (ch - P.chunk_start) * LC_CHUNK;
    const int64_t c1 = P.numel < c0 + LC_CHUNK ? P.numel : c0 + LC_CHUNK;
    for (int tid = 0; tid < kThreads; ++tid)
      for (int64_t j = c0 + 8 * tid; j < c1; j += 8 * kThreads) {
        const int64_t rem = c1 - j;
        zero_unit(P, sign, sign_stride, nz, nz_stride, j, rem < 8 ? static_cast<int>(rem) : 8);
      }
  }
  return 0;
}

}  // extern "C"
