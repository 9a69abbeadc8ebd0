// lioncub_cpu.h -- fused CPU kernels of lioncub_ds (plain C++17, no torch headers).
//
// Every kernel reproduces the pure-torch reference (lioncub_ds/kernels/reference.py) bit for bit:
//   * bit order LSB first: element i lives in byte i >> 3, bit i & 7; p-bit lanes likewise;
//   * vote planes: sign bit = (c > 0 and finite), nonzero bit = (c != 0 and finite);
//   * fp32 arithmetic with one rounding per operation and NO fused multiply-add (build with
//     -ffp-contract=off); scalars such as beta1 and 1 - beta1 are computed in double and then
//     rounded to float, exactly what torch does with a python scalar;
//   * bf16 stored as uint16_t: bf16 -> f32 by a 16-bit shift, f32 -> bf16 round-to-nearest-even
//     (any NaN -> 0x7FC0, as torch). The scalar contract (conversions, tie hash, enums, the
//     int8 scale arithmetic) is csrc/common/lioncub_common.h, shared with the CUDA kernels.
//
// Tensors are passed as raw pointers with element counts and dtype codes. Buckets are flat
// element ranges; each tensor starts at an element offset (a multiple of 8) inside its bucket.
// Output bit/lane/int8 buffers must be zero-initialised by the caller: a kernel writes only the
// bytes that cover each tensor (padding stays 0).
//
// `nthreads` is the OpenMP thread count to use (the binding passes at::get_num_threads()).
#pragma once

#include <cstddef>
#include <cstdint>

#include "../common/lioncub_common.h"

namespace lioncub {
namespace cpu {

// DType, TieRule, VoteMode, ScaleKind and the scalar helpers: csrc/common/lioncub_common.h.
using namespace ::lcc;

// A flat tensor placed in a bucket: `numel` elements of `dtype` at element `offset`.
struct Slot {
  void* data;
  int64_t numel;
  int64_t offset;
  int32_t dtype;
};

struct LocalStepCounts {
  int64_t n_nonfinite;  // #c that are NaN or +-Inf (real elements only)
  int64_t n_zero;       // #c == 0 (real elements only; -0 counts)
};

// Decision + apply parameters: the one argument struct of both backends (csrc/common,
// lc_make_apply_args); tie_rows is a host pointer here.
using ApplyArgs = ::lc_apply_args;

// (a) c = fl(fl(b1*m) + fl((1-b1)*g)) per tensor -> sign / nonzero planes (total/8 bytes each,
//     zero-initialised by the caller). grads[i].offset is ignored; momenta[i].offset is the
//     tensor's offset in the bucket. With update_momentum, fl(fl(b2*m) + fl((1-b2)*g)) is
//     written in the same pass (c uses the old m): into momenta_out[i] (same dtype and numel as
//     momenta[i]; m is then only read) or, when momenta_out is nullptr, into m itself.
LocalStepCounts local_step(const Slot* grads, const Slot* momenta, const Slot* momenta_out, int64_t ntensors,
                           int64_t total, double beta1, double beta2, bool update_momentum, uint8_t* sign_out,
                           uint8_t* nonzero_out, int nthreads);

// (b) m <- fl(fl(b2*m) + fl((1-b2)*g)) for every tensor.
void momentum_update(const Slot* momenta, const Slot* grads, int64_t ntensors, double beta2, int nthreads);

// (c) N packed planes [nplanes, plane_bytes] (+ optional nonzero planes) -> Δ -> apply to params.
//     Without nonzero planes every plane votes (cnt = nplanes). delta_out (nullable) receives
//     the fp32 Δ of all plane_bytes*8 bucket elements.
void vote_apply(const uint8_t* sign, const uint8_t* nonzero, int64_t nplanes, int64_t plane_bytes,
                const Slot* params, int64_t nparams, const ApplyArgs& args, float* delta_out, int nthreads);

// (d) phase 1 of the two-phase majority vote: [nplanes, shard_bytes] -> result sign and nonzero planes.
//     tie_rows / tie_nrows: the shard's tie-index table (as in ApplyArgs).
void shard_vote(const uint8_t* sign, const uint8_t* nonzero, int64_t nplanes, int64_t shard_bytes, int64_t step,
                int32_t tie, const int64_t* tie_rows, int64_t tie_nrows, uint8_t* out_sign, uint8_t* out_nonzero,
                int nthreads);

// (e) [nplanes, shard_bytes] planes -> p-bit lanes of plus counts (shard_bytes*p bytes) and, when
//     nonzero planes are given, of voter counts. Returns the largest voter count (nplanes when
//     nonzero == nullptr); when it exceeds 2**p - 1 the lane contents are unspecified.
int64_t count_lanes(const uint8_t* sign, const uint8_t* nonzero, int64_t nplanes, int64_t shard_bytes, int p,
                    uint8_t* plus_out, uint8_t* cnt_out, int nthreads);

// (f) summed p-bit lanes (lane_bytes bytes: lane_bytes*8/p elements) -> Δ -> apply.
//     cnt == nullptr: every element has args.world_size voters.
void lanes_apply(const uint8_t* plus, const uint8_t* cnt, int64_t lane_bytes, int p, const Slot* params,
                 int64_t nparams, const ApplyArgs& args, float* delta_out, int nthreads);

// (g) per tensor: scale a of |c| (l1 mean, l0 geometric mean of nonzero, linf max), then
//     q = clip(round_half_even(fl(fl(c*(s/2))/a)), -s, s) into q_out (total int8, zeroed by the
//     caller). Non-finite c count and quantize as 0. Returns #non-finite c.
//     The l1 / l0 scales use the project's own fixed summation order and fp64 arithmetic
//     (lcc::kSumBlock / lane_tree / log_parts / det_exp; reference.int8_scale): the same bits for
//     either ISA path, any thread count, and on the GPU.
int64_t int8_local_step(const Slot* grads, const Slot* momenta, int64_t ntensors, int64_t total, double beta1,
                        int32_t kind, int32_t levels, int8_t* q_out, int nthreads);

// (h) summed int8 codes -> Δ = sign(Σq) -> apply (args: only neg_lr / decay / apply_decay used).
void int8_apply(const int8_t* qsum, int64_t numel, const Slot* params, int64_t nparams, const ApplyArgs& args,
                float* delta_out, int nthreads);

// (i) single-process Lion step over ntensors tensors (reference.lion_step), one pass: reads g, m,
//     theta once, writes m, theta once. c = fl(fl(b1*m) + fl(omb1*g)); theta <- fl(theta*decay)
//     rounded to theta's dtype (if apply_decay); theta <- fl(theta + fl(lion_sign(c)*neg_lr));
//     m <- fl(fl(b2*m) + fl(omb2*g)) rounded once. params / momenta: f32 or bf16; grads: f32, bf16
//     or f16; offsets are ignored.
using LionStepArgs = ::lc_lion_step_args;
void lion_step(const Slot* params, const Slot* grads, const Slot* momenta, int64_t ntensors,
               const LionStepArgs& args, int nthreads);

// (j) ZeRO sign all-gather apply (reference.zero_sign_apply): every piece (lc_zero_piece, host
//     addresses, fp32 targets) in one call. Planes: sign [N, sign_stride] bytes, nonzero
//     [N, nz_stride] or nullptr (every bit votes).
void zero_sign_apply(const uint8_t* sign, int64_t sign_stride, const uint8_t* nonzero, int64_t nz_stride,
                     const ::lc_zero_piece* pieces, int64_t npieces, int nthreads);

// (k) abstention list (reference.abstain_list): the bytes where nonzero differs from mask
//     (nbytes each). out[0] = their count; out[1..capacity] = the first `capacity` byte indices
//     in order (-1 when fewer); out[1+capacity..2*capacity] = nonzero's byte there (0 when
//     unused). Returns the count. One thread: the planes are 1/32 of the gradient.
int64_t abstain_list(const uint8_t* nonzero, const uint8_t* mask, int64_t nbytes, int64_t capacity, int32_t* out);

// (l) comm="bbit", the local step (reference.bbit_local_step): as (a), but the votes are b-bit codes of c
//     (bb: lc_bbit_args, tie_rows a host pointer), scaled per tensor by its own bb.kind scale (non-finite c
//     count and are scaled and coded as 0) and rounded to the nearest level or dithered at each element's
//     tie index; written as bb.bits code planes of total/8 bytes (plane j = bit j of the codes) into
//     planes_out, with the nonzero plane (both zero-initialised by the caller). Returns the counts of (a).
LocalStepCounts bbit_local_step(const Slot* grads, const Slot* momenta, const Slot* momenta_out, int64_t ntensors,
                                int64_t total, double beta1, double beta2, bool update_momentum,
                                const ::lc_bbit_args& bb, uint8_t* planes_out, uint8_t* nonzero_out, int nthreads);

// (l) comm="bbit", the shard owner's vote (reference.bbit_shard_vote): planes [nplanes, bits, shard_bytes]
//     (every rank's code planes of the shard), nonzero [nplanes, shard_bytes] or nullptr (every rank votes)
//     -> Δ = sign(Σ over voting ranks of 2k - Q); Σ = 0 with a voter takes the tie rule (table as in (d)),
//     no voter gives 0 -> out_sign (Δ > 0) and out_nonzero (Δ != 0), shard_bytes each.
void bbit_shard_vote(const uint8_t* planes, const uint8_t* nonzero, int64_t nplanes, int bits, int64_t shard_bytes,
                     int64_t step, int32_t tie, const int64_t* tie_rows, int64_t tie_nrows, uint8_t* out_sign,
                     uint8_t* out_nonzero, int nthreads);

// Instruction-set path: 0 = auto (AVX2 when the CPU has it), 1 = portable baseline, 2 = AVX2.
// Both paths give identical results; the switch exists for tests and benchmarks.
void set_isa(int isa);
const char* isa_name();

}  // namespace cpu
}  // namespace lioncub
