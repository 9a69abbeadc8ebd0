// lioncub_cuda.h -- C API of the fused Lion Cub CUDA kernels (raw pointers + stream).
//
// The contract of every launcher is the pure-torch reference lioncub_ds/kernels/reference.py
// (docs/conventions.md, docs/kernels.md): LSB-first bit order, (sign, nonzero) vote planes, plus/cnt counting,
// diff = 2*plus - cnt, tie rules zero/alternate/hash (hash of the step and the element's
// index inside its parameter, via a tie-index table), average = (float)diff/(float)N,
// apply theta <- fl(theta*decay); theta <- fl(theta + fl(neg_lr*delta)) rounded to the
// parameter dtype after each op, fp32 math, one rounding per op, no fused multiply-add.
//
// This header includes only the CUDA runtime API: it is what csrc/bindings.cpp
// includes (under LIONCUB_WITH_CUDA). No torch header is ever included by csrc/cuda/.
//
// Multi-tensor launches
// ---------------------
// A bucket of T tensors is described by a DEVICE array of lc_tensor_meta (one entry per
// tensor, T entries, SORTED BY offset ascending, numel > 0, non-overlapping, every
// offset a multiple of 8 so a packed byte never straddles two tensors). Each launcher
// makes ONE kernel launch over all tensors of the bucket (int8: three, see below).
// The binding fills it as an int64 [T, LC_META_WORDS] tensor (pointers as integers),
// computing chunk_start as the prefix sum of lc_num_chunks(numel).
//
// All launchers return cudaSuccess or the error of the launch (cudaGetLastError) or
// cudaErrorInvalidValue for arguments out of range. Launchers never synchronize.
#ifndef LIONCUB_CUDA_H_
#define LIONCUB_CUDA_H_

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include "../common/lioncub_common.h"

#ifdef __cplusplus
extern "C" {
#endif

// ----------------------------------------------------------------------------- enums
// The C spelling of the codes of csrc/common/lioncub_common.h (lcc::DType, TieRule, VoteMode,
// ScaleKind, Rounding; lioncub_cuda_common.cuh static_asserts that they agree).
typedef enum lc_dtype { LC_FLOAT32 = 0, LC_BFLOAT16 = 1, LC_FLOAT16 = 2 } lc_dtype;
typedef enum lc_tie { LC_TIE_ZERO = 0, LC_TIE_ALTERNATE = 1, LC_TIE_HASH = 2 } lc_tie;
typedef enum lc_vote { LC_VOTE_MAJORITY = 0, LC_VOTE_AVERAGE = 1 } lc_vote;
typedef enum lc_scale { LC_SCALE_L1 = 0, LC_SCALE_L0 = 1, LC_SCALE_LINF = 2 } lc_scale;
typedef enum lc_rounding { LC_ROUND_NEAREST = 0, LC_ROUND_DITHER = 1 } lc_rounding;

// Elements per chunk of the chunked (per-tensor) kernels: momentum update and the int8
// scale reduction. A tensor of numel elements has lc_num_chunks(numel) chunks.
#define LC_CHUNK 16384
#define LC_META_WORDS 6
// Largest number of vote rows (ranks) the bit-sliced counters handle (16 levels).
#define LC_MAX_ROWS 65535

// One tensor of a bucket: 6 x 8 bytes, filled by the binding as int64.
typedef struct lc_tensor_meta {
  uint64_t a;           // address of the first tensor: gradient (local step) or parameter (apply)
  uint64_t b;           // address of the second tensor: momentum (local step), else 0
  int64_t offset;       // element offset of the tensor in the bucket, multiple of 8
  int64_t numel;        // number of elements, > 0
  int64_t chunk_start;  // index of the tensor's first LC_CHUNK chunk (prefix sum over the list)
  int64_t dtypes;       // lc_dtype of a | (lc_dtype of b) << 8
} lc_tensor_meta;

static inline int64_t lc_num_chunks(int64_t numel) { return (numel + LC_CHUNK - 1) / LC_CHUNK; }

// lc_apply_args (the scalars of an apply + the tie-index table, DEVICE pointer here) and
// lc_lion_args (the scalars of a local step): csrc/common/lioncub_common.h, the one ABI shared
// with the CPU kernels, filled by lc_make_apply_args / lc_make_lion_args.

// ----------------------------------------------------------------------------- local step
// reference.local_step over one bucket of `total` elements (multiple of 8):
//   c = fl(fl(b1*m) + fl(omb1*g)) per element; sign bit = c > 0 && finite, nonzero bit =
//   c != 0 && finite, LSB first, into sign_out / nonzero_out (total/8 bytes each; every
//   byte is written, padding and gaps between tensors get 0);
//   counts[0] += #non-finite c, counts[1] += #(c == 0) over real elements (int64[2] on
//   the device, zeroed by the caller); with update_momentum, m <- fl(fl(b2*m)+fl(omb2*g))
//   rounded once to m's dtype, in the same pass.
// meta[i].a = grad (fp32/bf16/fp16), meta[i].b = momentum (fp32/bf16/fp16).
cudaError_t lc_local_step(const lc_tensor_meta* meta, int n_tensors, int64_t total, lc_lion_args args,
                          int update_momentum, uint8_t* sign_out, uint8_t* nonzero_out, int64_t* counts,
                          cudaStream_t stream);

// reference.momentum_update over a list (one launch): meta[i].a = grad, meta[i].b = momentum;
// offsets are ignored (any order), chunk_start must be the prefix sum of chunks.
cudaError_t lc_momentum_update(const lc_tensor_meta* meta, int n_tensors, int64_t n_chunks, lc_lion_args args,
                               cudaStream_t stream);

// ----------------------------------------------------------------------------- votes
// reference.vote_apply: `rows` packed planes of row_bytes bytes each ([rows, row_bytes],
// row-major), nonzero planes likewise or NULL (every vote counts, cnt = rows). Counts
// the votes of 32 elements at once with bit-sliced counters on 32-bit words, decides Δ
// (majority + tie rule, or average = (float)diff / (float)world_size) for all
// 8*row_bytes elements, writes Δ to delta_out (fp32, 8*row_bytes; may be NULL) and
// applies it to the parameters meta[i].a (fp32/bf16/fp16, offsets < 8*row_bytes).
cudaError_t lc_vote_apply(const uint8_t* sign, const uint8_t* nonzero, int rows, int64_t row_bytes,
                          const lc_tensor_meta* params, int n_tensors, lc_apply_args args, float* delta_out,
                          cudaStream_t stream);

// reference.shard_vote (phase 1 of the two-phase vote, majority): [rows, row_bytes] planes ->
// out_sign (Δ > 0) and out_nonzero (Δ != 0), row_bytes bytes each; tie: lc_tie; tie_rows /
// tie_nrows: the shard's tie-index table on the device (as in lc_apply_args).
cudaError_t lc_shard_vote(const uint8_t* sign, const uint8_t* nonzero, int rows, int64_t row_bytes,
                          int tie, int64_t step, const int64_t* tie_rows, int64_t tie_nrows, uint8_t* out_sign,
                          uint8_t* out_nonzero, cudaStream_t stream);

// reference.count_lanes: [rows, row_bytes] planes -> plus counts (and cnt counts when nonzero
// != NULL) in p-bit lanes (p in 1,2,4,8), row_bytes*p bytes each. rows == 1 is the p-bit
// encoder. A count above 2**p - 1 sets *overflow (device int32, zeroed by the caller;
// may be NULL) -- only possible when nonzero != NULL and rows > 2**p - 1; the caller
// must reject nonzero == NULL with rows > 2**p - 1 itself (the reference raises). rows <= 255
// (a p <= 8 lane never holds more; more rows -> cudaErrorInvalidValue).
cudaError_t lc_count_lanes(const uint8_t* sign, const uint8_t* nonzero, int rows, int64_t row_bytes, int p,
                           uint8_t* plus_out, uint8_t* cnt_out, int32_t* overflow, cudaStream_t stream);

// reference.lanes_apply: summed p-bit lanes (numel elements; plus_lanes holds numel*p/8 bytes,
// cnt_lanes likewise or NULL: cnt = args.world_size) -> Δ -> apply; delta_out may be NULL.
cudaError_t lc_lanes_apply(const uint8_t* plus_lanes, const uint8_t* cnt_lanes, int64_t numel, int p,
                           const lc_tensor_meta* params, int n_tensors, lc_apply_args args, float* delta_out,
                           cudaStream_t stream);

// ----------------------------------------------------------------------------- int8
// Bytes of device workspace lc_int8_local_step needs for n_chunks chunks (8-aligned).
size_t lc_int8_workspace_bytes(int64_t n_chunks);

// reference.int8_local_step: per tensor c (non-finite c counted into *n_bad -- device int64,
// zeroed by the caller -- and treated as 0), scale a (reference.int8_scale: l1 fp32(S/numel) and
// l0 fp32(exp(mean log|c|)) with the project's fixed fp64 summation order and its
// deterministic log/exp (lcc::lane_tree, log_parts, det_exp), bit-identical to the CPU;
// linf: max|c|) written to scales_out[i] for meta[i] (device fp32, n_tensors), then
// q = clip(rint(fl(fl(c*(s/2)) / a)), -s, s) (s = levels) as int8 into q_out
// (total bytes, padding and gaps 0); a not > 0 or not finite gives q = 0. Three launches
// (chunk partials, per-tensor scale, quantize), deterministic (fixed reduction order).
cudaError_t lc_int8_local_step(const lc_tensor_meta* meta, int n_tensors, int64_t n_chunks, int64_t total,
                               lc_lion_args args, int kind, int levels, int8_t* q_out, float* scales_out,
                               void* workspace, size_t workspace_bytes, int64_t* n_bad, cudaStream_t stream);

// reference.int8_apply: Δ = sign(qsum) (int8 sum of the codes, numel elements) -> apply.
cudaError_t lc_int8_apply(const int8_t* qsum, int64_t numel, const lc_tensor_meta* params, int n_tensors,
                          lc_apply_args args, float* delta_out, cudaStream_t stream);

// ----------------------------------------------------------------------------- comm="bbit"
// reference.bbit_local_step over one bucket (meta as for lc_local_step; bb: lc_bbit_args, tie_rows a DEVICE
// pointer): per tensor the bb.kind scale of |c| (as lc_int8_local_step: non-finite c counted into
// counts[0] and scaled as 0) and its ratio fp32(Q / (clip * a)) into ratios_out[i] (device fp32, n_tensors);
// then the b-bit codes of c (nearest, or dithered at each element's tie index) as bb.bits code planes
// of total/8 bytes into planes_out (plane j = bit j of the codes, row-major [bits, total/8]), the nonzero
// plane into nonzero_out, counts[1] += #(c == 0) over real elements (every output byte is written;
// padding and gaps 0); with update_momentum, the momentum update of lc_local_step in the same pass.
// Workspace: lc_int8_workspace_bytes(n_chunks). Three launches, no host synchronization.
cudaError_t lc_bbit_local_step(const lc_tensor_meta* meta, int n_tensors, int64_t n_chunks, int64_t total,
                               lc_lion_args args, lc_bbit_args bb, int update_momentum, uint8_t* planes_out,
                               uint8_t* nonzero_out, float* ratios_out, void* workspace, size_t workspace_bytes,
                               int64_t* counts, cudaStream_t stream);

// reference.bbit_shard_vote: every rank's code planes of one shard, [rows, bits, row_bytes] row-major, and
// its nonzero plane [rows, row_bytes] (or NULL: every rank votes) -> Δ = sign(Σ over voting ranks of
// 2k - Q); Σ = 0 with a voter takes the tie rule (tie, step, the shard's tie-index table on the device, as
// lc_shard_vote), no voter gives 0 -> out_sign (Δ > 0) and out_nonzero (Δ != 0), row_bytes bytes each.
cudaError_t lc_bbit_shard_vote(const uint8_t* planes, const uint8_t* nonzero, int rows, int bits, int64_t row_bytes,
                               int tie, int64_t step, const int64_t* tie_rows, int64_t tie_nrows, uint8_t* out_sign,
                               uint8_t* out_nonzero, cudaStream_t stream);

// ----------------------------------------------------------------------------- single-process step
// One tensor of a Lion step: 6 x 8 bytes, filled by the binding as int64 (chunk_start as in
// lc_tensor_meta; tensors in any order, numel > 0).
typedef struct lc_lion_meta {
  uint64_t param;       // fp32 / bf16 / fp16
  uint64_t grad;        // fp32 / bf16 / fp16
  uint64_t momentum;    // fp32 / bf16 / fp16
  int64_t numel;
  int64_t chunk_start;
  int64_t dtypes;       // lc_dtype of param | grad << 8 | momentum << 16
} lc_lion_meta;

// reference.lion_step over a list (one launch, one pass: reads g, m, theta once, writes m,
// theta once): c = fl(fl(b1*m) + fl(omb1*g)); theta <- fl(theta*decay) rounded to theta's dtype
// (if apply_decay); theta <- fl(theta + fl(lcc::lion_sign(c)*neg_lr)); m <- fl(fl(b2*m) +
// fl(omb2*g)) rounded once to m's dtype.
cudaError_t lc_lion_step(const lc_lion_meta* meta, int n_tensors, int64_t n_chunks, lc_lion_step_args args,
                         cudaStream_t stream);

// reference.zero_sign_apply: every piece (lc_zero_piece, device array, fp32 targets, chunk_start
// the prefix sum of lc_num_chunks(numel)) in one launch, n_chunks chunks in all. sign: [rows,
// sign_stride] bytes; nonzero: [rows, nz_stride] or NULL (every bit votes).
cudaError_t lc_zero_sign_apply(const uint8_t* sign, int64_t sign_stride, const uint8_t* nonzero, int64_t nz_stride,
                               const lc_zero_piece* pieces, int n_pieces, int64_t n_chunks, cudaStream_t stream);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // LIONCUB_CUDA_H_
