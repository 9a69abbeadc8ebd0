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
__device__ void block_add_counts(unsigned long long x, unsigned long long y, int64_t* __restrict__ out, bool two) {
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

// Units per thread and round of the unit kernels of a bucket (local step, int8 codes, bbit codes): the
// units u, u + S (S: the grid's threads), loaded together (g and m: 2 x 64 bytes in fp32), then each
// converted (one switch per unit into its dtype's body), computed and stored; a warp's loads stay contiguous.
constexpr int kLocalUnits = 2;

// One thread per unit of 8 bucket elements (one output byte of each plane), kLocalUnits per round.
template <bool UPD>
__global__ void __launch_bounds__(kThreads)
    local_step_kernel(const lc_tensor_meta* __restrict__ meta, int nt, int64_t units, lc_lion_args la,
                      uint8_t* __restrict__ sign, uint8_t* __restrict__ nonzero, int64_t* __restrict__ counts) {
  int hint = -1;
  unsigned long long nbad = 0, nzero = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t u0 = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; u0 < units;
       u0 += kLocalUnits * stride) {
    Slot s[kLocalUnits];
    LC_UNROLL
    for (int k = 0; k < kLocalUnits; ++k) find_slot(meta, nt, u0 + k * stride, u0 + k * stride < units, hint, s[k]);
    run_slots<true>(s, true, [&](int k) {
      const int64_t u = u0 + k * stride;
      if (u >= units) return;
      uint32_t sb = 0, zb = 0;
      int b = 0, zr = 0;
      if (s[k].t >= 0) local_slot(s[k], la, UPD, sb, zb, b, zr);
      sign[u] = static_cast<uint8_t>(sb);
      nonzero[u] = static_cast<uint8_t>(zb);
      nbad += static_cast<unsigned long long>(b);
      nzero += static_cast<unsigned long long>(zr);
    });
  }
  block_add_counts(nbad, nzero, counts, true);
}

// One block per LC_CHUNK chunk of one tensor (grid-stride over the chunks of the list). A round of a thread
// is 2 units: whole ones of aligned tensors load g and m of both first, the body compiled for the dtypes;
// other units (a tensor's last, unaligned tensors, other dtypes) one at a time at run-time dtypes.
__global__ void __launch_bounds__(kThreads, 3)  // without the bound ptxas chose 64 registers and spilled
    momentum_kernel(const lc_tensor_meta* __restrict__ meta, int nt, int64_t n_chunks, lc_lion_args la) {
  constexpr int U = 2;
  for (int64_t ch = blockIdx.x; ch < n_chunks; ch += gridDim.x) {
    const Tensor T = read_meta(meta, search_chunk(meta, nt, ch));
    const int64_t c0 = (ch - T.chunk_start) * LC_CHUNK;
    const int64_t c1 = T.numel < c0 + LC_CHUNK ? T.numel : c0 + LC_CHUNK;
    const bool al = aligned16(reinterpret_cast<const void*>(T.a)) && aligned16(reinterpret_cast<const void*>(T.b));
    chunk_rounds<U>(c0, c1, [&](const int64_t* j, const int* n) {
      dispatch_pair(al && n[U - 1] == 8 ? pair_code(T.dta, T.dtb) : kMixed, [&](auto G, auto M) {
        constexpr int DTG = decltype(G)::value, DTM = decltype(M)::value;
        if constexpr (DTG == kAnyDT) {  // each tensor converted as soon as it is loaded (fewest registers)
          LC_UNROLL
          for (int k = 0; k < U; ++k) {
            if (n[k] > 0) {
              float g[8], m[8];
              Raw8 r;
              load_raw8<DTG>(T.a, T.dta, j[k], n[k], r);
              raw_to_f8<DTG>(r, T.dta, g);
              load_raw8<DTM>(T.b, T.dtb, j[k], n[k], r);
              raw_to_f8<DTM>(r, T.dtb, m);
              momentum_store8<DTM>(g, m, T.b, T.dtb, j[k], n[k], la);
            }
          }
        } else {
          Raw8 rg[U], rm[U];
          LC_UNROLL
          for (int k = 0; k < U; ++k) {
            load_raw8<DTG, true>(T.a, T.dta, j[k], 8, rg[k]);
            load_raw8<DTM, true>(T.b, T.dtb, j[k], 8, rm[k]);
          }
          LC_UNROLL
          for (int k = 0; k < U; ++k) {
            float g[8], m[8];
            raw_to_f8<DTG>(rg[k], T.dta, g);
            raw_to_f8<DTM>(rm[k], T.dtb, m);
            momentum_store8<DTM, true>(g, m, T.b, T.dtb, j[k], 8, la);
          }
        }
      });
    });
  }
}

// Lane `lane` (0..kThreads-1) of the chunk [c0, c1) of tensor T (c0 a multiple of LC_CHUNK): the
// elements c0 + lane + kThreads*k in index order (lcc's defined order), its partial statistic of |c|
// and its number of non-finite c. The loads of kBatch elements are issued before any is added.
template <int DTG, int DTM, int KIND>
LC_HD Acc int8_lane_partial(const Tensor& T, int64_t c0, int64_t c1, int lane, const lc_lion_args& la, int& nbad) {
  constexpr int kBatch = 8;
  Acc acc;
  acc.s = 0.0;
  acc.n = 0;
  acc.esum = 0;
  for (int64_t j0 = c0 + lane; j0 < c1; j0 += kBatch * kThreads) {
    uint32_t rg[kBatch], rm[kBatch];
    LC_UNROLL
    for (int v = 0; v < kBatch; ++v) {
      const int64_t j = j0 + static_cast<int64_t>(v) * kThreads;
      rg[v] = j < c1 ? load_raw1<DTG>(T.a, T.dta, j) : 0u;
      rm[v] = j < c1 ? load_raw1<DTM>(T.b, T.dtb, j) : 0u;
    }
    LC_UNROLL
    for (int v = 0; v < kBatch; ++v) {
      if (j0 + static_cast<int64_t>(v) * kThreads >= c1) break;
      float c = lion_c(raw1_to_f<DTM>(rm[v], T.dtb), raw1_to_f<DTG>(rg[v], T.dta), la);
      if (!is_finite(c)) {
        ++nbad;
        c = 0.0f;
      }
      const float ac = fabs_(c);
      if (KIND == LC_SCALE_L1) {
        acc.s = lcc::dadd(acc.s, static_cast<double>(ac));
      } else if (KIND == LC_SCALE_LINF) {
        if (static_cast<double>(ac) > acc.s) acc.s = static_cast<double>(ac);
      } else if (ac > 0.0f) {
        double lm;
        acc.esum += lcc::log_parts(ac, &lm);
        acc.s = lcc::dadd(acc.s, lm);
        acc.n += 1;
      }
    }
  }
  return acc;
}

// int8 pass 1: per chunk (one block of lcc's defined sum order), thread = lane: the lane sums in
// index order, then the fixed lane tree (lcc::lane_tree) in shared memory; + #non-finite.
template <int KIND>
__global__ void __launch_bounds__(kThreads)
    int8_partials_kernel(const lc_tensor_meta* __restrict__ meta, int nt, int64_t n_chunks, lc_lion_args la,
                         Acc* __restrict__ partials, int64_t* __restrict__ n_bad) {
  constexpr bool kL0 = KIND == LC_SCALE_L0;  // only l0 has counts and exponents
  __shared__ double ss[kThreads];
  __shared__ long long sn[kL0 ? kThreads : 1];
  __shared__ long long se[kL0 ? kThreads : 1];
  const int tid = threadIdx.x;
  unsigned long long bad = 0;
  for (int64_t ch = blockIdx.x; ch < n_chunks; ch += gridDim.x) {
    const Tensor T = read_meta(meta, search_chunk(meta, nt, ch));
    const int64_t c0 = (ch - T.chunk_start) * LC_CHUNK;
    const int64_t c1 = T.numel < c0 + LC_CHUNK ? T.numel : c0 + LC_CHUNK;
    int nb = 0;
    Acc acc;
    dispatch_pair(pair_code(T.dta, T.dtb), [&](auto G, auto M) {
      acc = int8_lane_partial<decltype(G)::value, decltype(M)::value, KIND>(T, c0, c1, tid, la, nb);
    });
    bad += static_cast<unsigned long long>(nb);
    ss[tid] = acc.s;
    if (kL0) {
      sn[tid] = acc.n;
      se[tid] = acc.esum;
    }
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
      if (tid < s) {
        if (KIND == LC_SCALE_LINF) {
          ss[tid] = ss[tid + s] > ss[tid] ? ss[tid + s] : ss[tid];  // acc_combine's max
        } else {
          ss[tid] = lcc::dadd(ss[tid], ss[tid + s]);
        }
        if (kL0) {
          sn[tid] += sn[tid + s];
          se[tid] += se[tid + s];
        }
      }
      __syncthreads();
    }
    if (tid == 0) {
      Acc r;
      r.s = ss[0];
      r.n = kL0 ? sn[0] : 0;
      r.esum = kL0 ? se[0] : 0;
      partials[ch] = r;
    }
    __syncthreads();
  }
  block_add_counts(bad, 0ull, n_bad, false);
}

// int8 pass 2: one block per tensor; the tensor's chunk results in chunk order (lcc's defined order: a
// sequential fp64 sum of the block sums, starting from +0.0), staged in shared memory kThreads at a time
// by the whole block (the next stage loads while thread 0 adds this one), added by thread 0 in that
// order -> scale (bits > 0, comm="bbit": the codes' ratio).
template <int KIND>
__global__ void __launch_bounds__(kThreads)
    int8_scale_kernel(const lc_tensor_meta* __restrict__ meta, int nt, const Acc* __restrict__ partials, int bits,
                      float* __restrict__ scales) {
  __shared__ Acc stage[2][kThreads];
  const int tid = threadIdx.x;
  for (int t = blockIdx.x; t < nt; t += gridDim.x) {  // block-uniform
    const int64_t first = meta[t].chunk_start, numel = meta[t].numel;
    const int64_t nch = (numel + LC_CHUNK - 1) / LC_CHUNK;
    if (tid < nch) stage[0][tid] = partials[first + tid];
    __syncthreads();
    Acc acc;
    acc.s = 0.0;
    acc.n = 0;
    acc.esum = 0;
    int buf = 0;
    for (int64_t s0 = 0; s0 < nch; s0 += kThreads, buf ^= 1) {
      const int64_t next = s0 + kThreads + tid;
      if (next < nch) stage[buf ^ 1][tid] = partials[first + next];
      if (tid == 0) {
        const int cnt = nch - s0 < kThreads ? static_cast<int>(nch - s0) : kThreads;
        for (int i = 0; i < cnt; ++i) acc = acc_combine(acc, stage[buf][i], KIND);
      }
      __syncthreads();
    }
    if (tid == 0) scales[t] = int8_scale_of(acc, numel, KIND, bits);
  }
}

// int8 pass 3: one thread per unit of 8 bucket elements -> 8 codes (gaps: 0), kLocalUnits per round.
// At most 80 registers (3 resident blocks: 87 would leave 2; no spill at 80 on sm_90).
__global__ void __launch_bounds__(kThreads, 3)
    int8_quantize_kernel(const lc_tensor_meta* __restrict__ meta, int nt, int64_t units, lc_lion_args la, int levels,
                         const float* __restrict__ scales, int8_t* __restrict__ q) {
  int hint = -1;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t u0 = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; u0 < units;
       u0 += kLocalUnits * stride) {
    Slot s[kLocalUnits];
    float a[kLocalUnits];
    LC_UNROLL
    for (int k = 0; k < kLocalUnits; ++k) {
      find_slot(meta, nt, u0 + k * stride, u0 + k * stride < units, hint, s[k]);
      a[k] = s[k].t >= 0 ? scales[s[k].t] : 0.0f;
    }
    run_slots<true>(s, true, [&](int k) {
      const int64_t u = u0 + k * stride;
      if (u >= units) return;
      int8_t c[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (s[k].t >= 0) int8_slot(s[k], la, levels, a[k], c);
      store_q8(q, u * 8, c);
    });
  }
}

// bbit pass 3: one thread per unit of 8 bucket elements -> one byte of each of the BITS code planes and
// of the nonzero plane (gaps: 0), + #zero c; the momentum update when asked. kLocalUnits per round.
template <int BITS>
__global__ void __launch_bounds__(kThreads)
    bbit_codes_kernel(const lc_tensor_meta* __restrict__ meta, int nt, int64_t units, lc_lion_args la, int upd,
                      const float* __restrict__ ratios, lc_bbit_args bb, uint8_t* __restrict__ planes,
                      uint8_t* __restrict__ nonzero, int64_t* __restrict__ n_zero) {
  int hint = -1;
  unsigned long long nzero = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t u0 = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; u0 < units;
       u0 += kLocalUnits * stride) {
    Slot s[kLocalUnits];
    float r[kLocalUnits];
    LC_UNROLL
    for (int k = 0; k < kLocalUnits; ++k) {
      find_slot(meta, nt, u0 + k * stride, u0 + k * stride < units, hint, s[k]);
      r[k] = s[k].t >= 0 ? ratios[s[k].t] : 0.0f;
    }
    run_slots<false>(s, true, [&](int k) {
      const int64_t u = u0 + k * stride;
      if (u >= units) return;
      uint32_t codes[BITS], z;
      int zr = 0;
      bbit_slot<BITS>(s[k], u * 8, la, upd != 0, r[k], bb, codes, z, zr);
      LC_UNROLL
      for (int j = 0; j < BITS; ++j) planes[j * units + u] = static_cast<uint8_t>(codes[j]);
      nonzero[u] = static_cast<uint8_t>(z);
      nzero += static_cast<unsigned long long>(zr);
    });
  }
  block_add_counts(nzero, 0ull, n_zero, false);
}

// The scales (int8 passes 1 and 2, one body per scale kind): chunk partials, then per tensor.
template <int KIND>
cudaError_t launch_scales(const lc_tensor_meta* meta, int nt, int64_t n_chunks, const lc_lion_args& la,
                          Acc* partials, int64_t* n_bad, int bits, float* scales, cudaStream_t stream) {
  const cudaError_t e = launch(int8_partials_kernel<KIND>, grid_for(n_chunks, 1), kThreads, stream, meta, nt, n_chunks,
                               la, partials, n_bad);
  if (e != cudaSuccess) return e;
  return launch(int8_scale_kernel<KIND>, grid_for(nt, 1), kThreads, stream, meta, nt, partials, bits, scales);
}

cudaError_t launch_scales_of(int kind, const lc_tensor_meta* meta, int nt, int64_t n_chunks, const lc_lion_args& la,
                             Acc* partials, int64_t* n_bad, int bits, float* scales, cudaStream_t stream) {
  switch (kind) {
    case LC_SCALE_L1: return launch_scales<LC_SCALE_L1>(meta, nt, n_chunks, la, partials, n_bad, bits, scales, stream);
    case LC_SCALE_L0: return launch_scales<LC_SCALE_L0>(meta, nt, n_chunks, la, partials, n_bad, bits, scales, stream);
    default: return launch_scales<LC_SCALE_LINF>(meta, nt, n_chunks, la, partials, n_bad, bits, scales, stream);
  }
}

template <int BITS>
cudaError_t launch_bbit_codes(const lc_tensor_meta* meta, int nt, int64_t units, const lc_lion_args& la, int upd,
                              const float* ratios, const lc_bbit_args& bb, uint8_t* planes, uint8_t* nonzero,
                              int64_t* n_zero, cudaStream_t stream) {
  return launch(bbit_codes_kernel<BITS>, grid_for(units, kThreads), kThreads, stream, meta, nt, units, la, upd, ratios,
                bb, planes, nonzero, n_zero);
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
  const int grid = lc::grid_for(units, lc::kThreads);
  if (update_momentum)
    return lc::launch(lc::local_step_kernel<true>, grid, lc::kThreads, stream, meta, n_tensors, units, args, sign_out,
                      nonzero_out, counts);
  return lc::launch(lc::local_step_kernel<false>, grid, lc::kThreads, stream, meta, n_tensors, units, args, sign_out,
                    nonzero_out, counts);
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
    const cudaError_t e =
        lc::launch_scales_of(kind, meta, n_tensors, n_chunks, args, partials, n_bad, 0, scales_out, stream);
    if (e != cudaSuccess) return e;
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
    const cudaError_t e =
        lc::launch_scales_of(bb.kind, meta, n_tensors, n_chunks, args, partials, counts, bb.bits, ratios_out, stream);
    if (e != cudaSuccess) return e;
  }
  const int64_t units = total / 8;
  if (units == 0) return cudaSuccess;
  if (planes_out == nullptr || nonzero_out == nullptr) return cudaErrorInvalidValue;
  switch (bb.bits) {  // the codes' width as a template parameter (1..4, checked above)
    case 1:
      return lc::launch_bbit_codes<1>(meta, n_tensors, units, args, update_momentum, ratios_out, bb, planes_out,
                                      nonzero_out, counts + 1, stream);
    case 2:
      return lc::launch_bbit_codes<2>(meta, n_tensors, units, args, update_momentum, ratios_out, bb, planes_out,
                                      nonzero_out, counts + 1, stream);
    case 3:
      return lc::launch_bbit_codes<3>(meta, n_tensors, units, args, update_momentum, ratios_out, bb, planes_out,
                                      nonzero_out, counts + 1, stream);
    default:
      return lc::launch_bbit_codes<4>(meta, n_tensors, units, args, update_momentum, ratios_out, bb, planes_out,
                                      nonzero_out, counts + 1, stream);
  }
}
