// bindings_checks.h -- the argument checks shared by the CPU wrappers (bindings.cpp) and the CUDA
// wrappers (bindings_cuda.cpp). With those two files, the only code that includes torch headers.
//
// A second line of defence behind the Python validation (lioncub_ds/kernels/checks.py): every
// message starts with the backend ("lioncub cpp kernels" / "lioncub cuda kernels") and names the
// argument. `On`: where the call's tensors must live (the CPU, or the CUDA device of its first tensor).
#ifndef LIONCUB_BINDINGS_CHECKS_H_
#define LIONCUB_BINDINGS_CHECKS_H_

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/lioncub_common.h"

namespace lioncub_bind {

inline std::string arg_name(const char* name, int64_t i) {
  return i < 0 ? std::string(name) : std::string(name) + "[" + std::to_string(i) + "]";
}

// ------------------------------------------------------------------------------ tensors
struct On {
  at::Device dev;
  const char* who;
};
inline const On kCpu{at::Device(at::kCPU), "lioncub cpp kernels"};

inline void check_tensor(const at::Tensor& t, const std::string& name, const On& on) {
  TORCH_CHECK(t.defined(), on.who, ": ", name, " is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, on.who, ": ", name, " must be dense");
  TORCH_CHECK(on.dev.is_cpu() ? t.device().is_cpu() : t.device() == on.dev, on.who, ": ", name, " must be on ", on.dev,
              on.dev.is_cuda() ? " (the device of the call's first tensor)" : "", ", got ", t.device());
  TORCH_CHECK(t.is_contiguous(), on.who, ": ", name, " must be contiguous");
}

inline void check_dtype(const at::Tensor& t, const std::string& name, at::ScalarType st, const On& on) {
  check_tensor(t, name, on);
  TORCH_CHECK(t.scalar_type() == st, on.who, ": ", name, " must be ", st, ", got ", t.scalar_type());
}

// The dtype code of the scalar contract (csrc/common: kF32, kBF16, kF16).
inline int32_t float_code(const at::Tensor& t, const std::string& name, bool allow_f16, const On& on) {
  const auto st = t.scalar_type();
  if (st == at::kFloat) return lcc::kF32;
  if (st == at::kBFloat16) return lcc::kBF16;
  if (allow_f16 && st == at::kHalf) return lcc::kF16;
  TORCH_CHECK(false, on.who, ": ", name, " must be ",
              allow_f16 ? "float32, bfloat16 or float16" : "float32 or bfloat16",
              ", got ", st);
  return -1;
}

// Two lists of tensors of the same length whose entries have the same element counts.
inline void check_pairs(const std::vector<at::Tensor>& a, const char* an, const std::vector<at::Tensor>& b,
                        const char* bn, const On& on) {
  TORCH_CHECK(a.size() == b.size(), on.who, ": ", an, " has ", a.size(), " tensors but ", bn, " has ", b.size());
  for (size_t i = 0; i < a.size(); ++i)
    TORCH_CHECK(a[i].numel() == b[i].numel(), on.who, ": ", arg_name(an, i), " has ", a[i].numel(),
                " elements but ", arg_name(bn, i), " has ", b[i].numel());
}

// Tensor i (`name`, numel elements) at bucket element `off` of a bucket of `total` elements.
inline void check_offset(size_t i, int64_t off, int64_t numel, const std::string& name, int64_t total, const On& on) {
  TORCH_CHECK(off >= 0 && off % 8 == 0, on.who, ": offsets[", i, "]=", off, " must be a non-negative multiple of 8");
  TORCH_CHECK(off + numel <= total, on.who, ": ", name, " (", numel, " elements at offset ", off,
              ") does not fit the bucket of ", total, " elements");
}

inline void check_total(int64_t total, int64_t multiple, const On& on) {
  TORCH_CHECK(total >= 0 && total % multiple == 0, on.who, ": total must be a non-negative multiple of ", multiple,
              ", got ", total);
}

// [N, B] (or, with allow_1d, [B]: N = 1) uint8 planes of 1..65535 rows.
inline std::pair<int64_t, int64_t> plane_shape(const at::Tensor& t, const char* name, bool allow_1d, const On& on) {
  check_dtype(t, name, at::kByte, on);
  TORCH_CHECK(t.dim() == 2 || (allow_1d && t.dim() == 1), on.who, ": ", name, " must be a ",
              allow_1d ? "1-D or 2-D" : "2-D", " [N, bytes] uint8 tensor, got ", t.dim(), " dims");
  const int64_t n = t.dim() == 2 ? t.size(0) : 1;
  TORCH_CHECK(n >= 1 && n <= 65535, on.who, ": ", name, " must hold 1..65535 planes, got ", n);
  return {n, t.size(-1)};
}

// Optional nonzero planes: the shape of the sign planes.
inline void check_nonzero(const c10::optional<at::Tensor>& nz, std::pair<int64_t, int64_t> sign, bool allow_1d,
                          const On& on) {
  if (!nz.has_value()) return;
  const auto s = plane_shape(*nz, "nonzero", allow_1d, on);
  TORCH_CHECK(s == sign, on.who, ": nonzero planes [", s.first, ", ", s.second, "] must match the sign planes [",
              sign.first, ", ", sign.second, "]");
}

inline void check_tie(int64_t tie, const On& on) {
  TORCH_CHECK(tie >= 0 && tie <= 2, on.who, ": tie rule code must be 0 (zero), 1 (alternate) or 2 (hash), got ", tie);
}

inline void check_codes(int64_t tie, int64_t vote, int64_t world, const On& on) {
  check_tie(tie, on);
  TORCH_CHECK(vote == 0 || vote == 1, on.who, ": vote mode code must be 0 (majority) or 1 (average), got ", vote);
  TORCH_CHECK(world >= 1 && world <= INT32_MAX, on.who, ": world_size must be in 1..2**31-1, got ", world);
}

inline void check_lane_width(int64_t p, const On& on) {
  TORCH_CHECK(p == 1 || p == 2 || p == 4 || p == 8, on.who, ": lane width p must be 1, 2, 4 or 8, got ", p);
}

inline void check_int8_codes(int64_t kind, int64_t levels, const On& on) {
  TORCH_CHECK(kind >= 0 && kind <= 2, on.who, ": scale kind code must be 0 (l1), 1 (l0) or 2 (linf), got ", kind);
  TORCH_CHECK(levels >= 1 && levels <= 127, on.who, ": levels must be 1..127, got ", levels);
}

inline void check_bbit_codes(int64_t kind, int64_t bits, int64_t rounding, int64_t seed, const On& on) {
  TORCH_CHECK(kind >= 0 && kind <= 2, on.who, ": scale kind code must be 0 (l1), 1 (l0) or 2 (linf), got ", kind);
  TORCH_CHECK(bits >= 1 && bits <= 4, on.who, ": vote_bits must be 1..4, got ", bits);
  TORCH_CHECK(rounding == 0 || rounding == 1, on.who, ": rounding code must be 0 (nearest) or 1 (dither), got ",
              rounding);
  TORCH_CHECK(seed >= 0 && seed <= UINT32_MAX, on.who, ": the dither seed must be a 32-bit value, got ", seed);
}

// b-bit code planes [N, bits, S] uint8 of 1..65535 ranks: returns (N, S).
inline std::pair<int64_t, int64_t> code_planes_shape(const at::Tensor& t, int64_t bits, const On& on) {
  check_dtype(t, "planes", at::kByte, on);
  TORCH_CHECK(t.dim() == 3 && t.size(1) == bits && t.size(0) >= 1 && t.size(0) <= 65535, on.who,
              ": planes must be a [N, bits, bytes] uint8 tensor with 1..65535 ranks and bits = ", bits);
  return {t.size(0), t.size(2)};
}

// The tie-index table: int64 [K, 2] (pos, index) rows on the CPU, rows[0].pos == 0
// (lioncub_ds/kernels/reference.py as_segments builds and validates it before any call).
inline void check_segments(const at::Tensor& t, const On& on) {
  check_tensor(t, "segments", kCpu);
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 2 && t.size(1) == 2 && t.size(0) >= 1, on.who,
              ": segments must be an int64 [K, 2] CPU tensor with K >= 1");
}

// ZeRO sign apply: one optional cast per fp32 target, all on the call's device.
inline void check_zero_targets(const std::vector<at::Tensor>& targets,
                               const std::vector<c10::optional<at::Tensor>>& casts, const On& on) {
  TORCH_CHECK(casts.size() == targets.size(), on.who, ": casts must have one entry per target");
  for (size_t g = 0; g < targets.size(); ++g) {
    check_tensor(targets[g], arg_name("targets", static_cast<int64_t>(g)), on);
    if (casts[g].has_value()) check_tensor(*casts[g], arg_name("casts", static_cast<int64_t>(g)), on);
  }
}

// ZeRO sign apply: bytes per row of the optional nonzero planes (their own width, the rows of sign).
inline int64_t zero_nonzero_bytes(const c10::optional<at::Tensor>& nz, int64_t rows, int64_t bytes, const On& on) {
  if (!nz.has_value()) return bytes;
  const auto z = plane_shape(*nz, "nonzero", false, on);
  TORCH_CHECK(z.first == rows, on.who, ": nonzero has ", z.first, " rows but sign has ", rows);
  return z.second;
}

// The pieces of a ZeRO sign all-gather apply (shared by the CPU and CUDA bindings): `layout` int64
// [K, 5] rows (group, row, bit, start, numel) (reference.ZeroLayout.pieces), targets[g] fp32 and
// casts[g] (optional) with the element counts of their groups, one lr / weight decay per group.
// Every row is checked to lie inside its planes and tensors (a second line behind checks.py).
inline constexpr int64_t kPieceChunk = 16384;  // chunk_start counts chunks of this many elements (LC_CHUNK)
inline std::vector<lc_zero_piece> zero_pieces(int64_t rows, int64_t row_bits, const std::vector<at::Tensor>& targets,
                                             const std::vector<c10::optional<at::Tensor>>& casts,
                                             const at::Tensor& layout, const std::vector<double>& lrs,
                                             const std::vector<double>& wds, int32_t (*code)(const at::Tensor&)) {
  const size_t ng = targets.size();
  TORCH_CHECK(casts.size() == ng && lrs.size() == ng && wds.size() == ng, "lioncub kernels: targets, casts, lrs and "
              "weight_decays must have one entry per group");
  TORCH_CHECK(layout.device().is_cpu() && layout.scalar_type() == at::kLong && layout.dim() == 2 &&
                  layout.size(1) == 5 && layout.is_contiguous(),
              "lioncub kernels: layout must be a contiguous int64 [K, 5] CPU tensor");
  std::vector<lc_zero_piece> out(static_cast<size_t>(layout.size(0)));
  const int64_t* L = layout.data_ptr<int64_t>();
  int64_t chunks = 0;
  for (size_t k = 0; k < out.size(); ++k) {
    const int64_t g = L[5 * k], row = L[5 * k + 1], bit = L[5 * k + 2], start = L[5 * k + 3], n = L[5 * k + 4];
    TORCH_CHECK(g >= 0 && g < static_cast<int64_t>(ng) && row >= 0 && row < rows && bit >= 0 && n >= 0 &&
                    bit + n <= row_bits && start >= 0 && start + n <= targets[g].numel(),
                "lioncub kernels: layout row ", k, " lies outside its planes or tensors");
    TORCH_CHECK(targets[g].scalar_type() == at::kFloat, "lioncub kernels: targets must be float32");
    const auto& c = casts[g];
    TORCH_CHECK(!c.has_value() || c->numel() == targets[g].numel(), "lioncub kernels: casts[", g,
                "] must have the element count of targets[", g, "]");
    const lc_lion_step_args a = lc_make_lion_step_args(lrs[g], wds[g], 0.0, 0.0);
    lc_zero_piece& P = out[k];
    P.target = reinterpret_cast<uint64_t>(targets[g].data_ptr<float>() + start);
    P.cast = c.has_value() ? reinterpret_cast<uint64_t>(static_cast<char*>(c->data_ptr()) + start * c->element_size())
                           : 0;
    P.cast_dtype = c.has_value() ? code(*c) : 0;
    P.row = row;
    P.bit = bit;
    P.numel = n;
    P.chunk_start = chunks;
    chunks += (n + kPieceChunk - 1) / kPieceChunk;
    P.neg_lr = a.neg_lr;
    P.decay = a.decay;
    P.apply_decay = a.apply_decay;
  }
  return out;
}

}  // namespace lioncub_bind

#endif  // LIONCUB_BINDINGS_CHECKS_H_
