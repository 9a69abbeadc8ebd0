// bindings.cpp -- the only translation unit that includes torch headers.
//
// Thin wrappers: check every tensor argument (device, dtype, contiguity, sizes; each message
// names the argument), allocate the outputs, release the GIL and call the raw kernels of
// csrc/cpu/lioncub_cpu.h. lioncub_ds/_native.py turns these into the backend object whose
// methods mirror lioncub_ds.ops.TorchBackend exactly.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/lioncub_cpu.h"

// LIONCUB_SRC_HASH: "h" + sha1 of the kernel sources, passed as a bare token by the build
// (lioncub_ds/_native.py, setup.py) so that no shell quoting is involved.
#define LIONCUB_STR2(x) #x
#define LIONCUB_STR(x) LIONCUB_STR2(x)
#ifdef LIONCUB_SRC_HASH
#define LIONCUB_SRC_HASH_STR LIONCUB_STR(LIONCUB_SRC_HASH)
#else
#define LIONCUB_SRC_HASH_STR ""
#endif

namespace lc = lioncub::cpu;

namespace {

int threads() { return std::max(1, at::get_num_threads()); }

std::string arg_name(const char* name, int64_t i) {
  return i < 0 ? std::string(name) : std::string(name) + "[" + std::to_string(i) + "]";
}

int32_t float_code(const at::Tensor& t, const std::string& name, bool allow_f16) {
  const auto st = t.scalar_type();
  if (st == at::kFloat) return lc::kF32;
  if (st == at::kBFloat16) return lc::kBF16;
  if (allow_f16 && st == at::kHalf) return lc::kF16;
  TORCH_CHECK(false, "lioncub cpp kernels: ", name, " must be ",
              allow_f16 ? "float32, bfloat16 or float16" : "float32 or bfloat16", ", got ", st);
  return -1;
}

void check_cpu_contig(const at::Tensor& t, const std::string& name) {
  TORCH_CHECK(t.defined(), "lioncub cpp kernels: ", name, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), "lioncub cpp kernels: ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), "lioncub cpp kernels: ", name, " must be contiguous");
  TORCH_CHECK(!t.is_sparse(), "lioncub cpp kernels: ", name, " must be dense");
}

void check_u8(const at::Tensor& t, const std::string& name) {
  check_cpu_contig(t, name);
  TORCH_CHECK(t.scalar_type() == at::kByte, "lioncub cpp kernels: ", name, " must be uint8, got ", t.scalar_type());
}

// Tensors placed in a bucket of `total` elements at `offsets` (multiples of 8, no overrun).
std::vector<lc::Slot> make_slots(const std::vector<at::Tensor>& ts, const std::vector<int64_t>& offsets,
                                 const char* name, bool allow_f16, int64_t total) {
  TORCH_CHECK(ts.size() == offsets.size(), "lioncub cpp kernels: ", name, " has ", ts.size(),
              " tensors but offsets has ", offsets.size(), " entries");
  std::vector<lc::Slot> out(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    const std::string nm = arg_name(name, static_cast<int64_t>(i));
    check_cpu_contig(ts[i], nm);
    const int32_t code = float_code(ts[i], nm, allow_f16);
    const int64_t off = offsets[i];
    TORCH_CHECK(off >= 0 && off % 8 == 0, "lioncub cpp kernels: offsets[", i, "]=", off,
                " must be a non-negative multiple of 8");
    TORCH_CHECK(off + ts[i].numel() <= total, "lioncub cpp kernels: ", nm, " (", ts[i].numel(),
                " elements at offset ", off, ") does not fit the bucket of ", total, " elements");
    out[i] = lc::Slot{ts[i].data_ptr(), ts[i].numel(), off, code};
  }
  return out;
}

void check_pairs(const std::vector<at::Tensor>& a, const char* an, const std::vector<at::Tensor>& b,
                 const char* bn) {
  TORCH_CHECK(a.size() == b.size(), "lioncub cpp kernels: ", an, " has ", a.size(), " tensors but ", bn, " has ",
              b.size());
  for (size_t i = 0; i < a.size(); ++i)
    TORCH_CHECK(a[i].numel() == b[i].numel(), "lioncub cpp kernels: ", arg_name(an, i), " has ", a[i].numel(),
                " elements but ", arg_name(bn, i), " has ", b[i].numel());
}

// [N, B] (or [B]: N = 1) uint8 planes.
std::pair<int64_t, int64_t> plane_shape(const at::Tensor& t, const char* name, bool require_2d) {
  check_u8(t, name);
  if (require_2d) {
    TORCH_CHECK(t.dim() == 2, "lioncub cpp kernels: ", name, " must be a 2-D [N, bytes] uint8 tensor, got ",
                t.dim(), " dims");
  } else {
    TORCH_CHECK(t.dim() == 1 || t.dim() == 2, "lioncub cpp kernels: ", name,
                " must be a 1-D or 2-D [N, bytes] uint8 tensor, got ", t.dim(), " dims");
  }
  const int64_t n = t.dim() == 2 ? t.size(0) : 1;
  const int64_t b = t.size(-1);
  TORCH_CHECK(n >= 1 && n <= 65535, "lioncub cpp kernels: ", name, " must hold 1..65535 planes, got ", n);
  return {n, b};
}

void check_same_planes(const c10::optional<at::Tensor>& nz, int64_t n, int64_t b, bool require_2d) {
  if (!nz.has_value()) return;
  const auto s = plane_shape(*nz, "nonzero", require_2d);
  TORCH_CHECK(s.first == n && s.second == b, "lioncub cpp kernels: nonzero planes [", s.first, ", ", s.second,
              "] must match the sign planes [", n, ", ", b, "]");
}

// The tie-index table: int64 [K, 2] (pos, index) rows on the CPU, rows[0].pos == 0
// (lioncub_ds/kernels/reference.py as_segments builds and validates it before any call).
std::pair<const int64_t*, int64_t> tie_table(const at::Tensor& t) {
  check_cpu_contig(t, "segments");
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 2 && t.size(1) == 2 && t.size(0) >= 1,
              "lioncub cpp kernels: segments must be an int64 [K, 2] tensor with K >= 1");
  return {t.data_ptr<int64_t>(), t.size(0)};
}

lc::ApplyArgs apply_args(double lr, double wd, int64_t step, int64_t tie, int64_t vote, int64_t world,
                         const at::Tensor& segments) {
  TORCH_CHECK(tie >= 0 && tie <= 2, "lioncub cpp kernels: tie rule code must be 0..2, got ", tie);
  TORCH_CHECK(vote == 0 || vote == 1, "lioncub cpp kernels: vote mode code must be 0 or 1, got ", vote);
  TORCH_CHECK(world >= 1 && world <= INT32_MAX, "lioncub cpp kernels: world_size must be in 1..2**31-1, got ", world);
  const auto tt = tie_table(segments);
  return lc_make_apply_args(lr, wd, step, static_cast<int32_t>(tie), static_cast<int32_t>(vote),
                            static_cast<int32_t>(world), tt.first, tt.second);
}

// ------------------------------------------------------------------------------------ kernels
std::tuple<at::Tensor, at::Tensor, int64_t, int64_t> local_step(const std::vector<at::Tensor>& grads,
                                                               const std::vector<at::Tensor>& momenta,
                                                               const std::vector<int64_t>& offsets, int64_t total,
                                                               double beta1, double beta2, bool update_momentum,
                                                               const c10::optional<std::vector<at::Tensor>>& momenta_out) {
  TORCH_CHECK(total >= 0 && total % 8 == 0, "lioncub cpp kernels: total must be a non-negative multiple of 8, got ",
              total);
  check_pairs(grads, "grads", momenta, "momenta");
  auto g = make_slots(grads, offsets, "grads", true, total);
  auto m = make_slots(momenta, offsets, "momenta", false, total);
  std::vector<lc::Slot> mo;
  if (momenta_out.has_value()) {
    check_pairs(momenta, "momenta", *momenta_out, "momenta_out");
    mo = make_slots(*momenta_out, offsets, "momenta_out", false, total);
    for (size_t i = 0; i < mo.size(); ++i)
      TORCH_CHECK(mo[i].dtype == m[i].dtype, "lioncub cpp kernels: ", arg_name("momenta_out", i),
                  " must have the dtype of ", arg_name("momenta", i));
  }
  auto opts = at::TensorOptions().dtype(at::kByte).device(at::kCPU);
  at::Tensor sign = at::zeros({total / 8}, opts);
  at::Tensor nz = at::zeros({total / 8}, opts);
  lc::LocalStepCounts r{0, 0};
  {
    pybind11::gil_scoped_release nogil;
    r = lc::local_step(g.data(), m.data(), mo.empty() ? nullptr : mo.data(), static_cast<int64_t>(g.size()), total,
                       beta1, beta2, update_momentum, sign.data_ptr<uint8_t>(), nz.data_ptr<uint8_t>(), threads());
  }
  return {sign, nz, r.n_nonfinite, r.n_zero};
}

// The abstention list of a nonzero plane against the bucket's mask (reference.abstain_list).
at::Tensor abstain_list(const at::Tensor& nonzero, const at::Tensor& mask, int64_t capacity) {
  check_u8(nonzero, "nonzero");
  check_u8(mask, "mask");
  check_cpu_contig(nonzero, "nonzero");
  check_cpu_contig(mask, "mask");
  TORCH_CHECK(nonzero.dim() == 1 && mask.dim() == 1 && nonzero.numel() == mask.numel(),
              "lioncub cpp kernels: nonzero and mask must be 1-D planes of the same size");
  TORCH_CHECK(capacity >= 0 && capacity <= nonzero.numel() && nonzero.numel() <= INT32_MAX,
              "lioncub cpp kernels: capacity must be in 0..plane bytes (< 2**31), got ", capacity);
  at::Tensor out = at::empty({1 + 2 * capacity}, at::TensorOptions().dtype(at::kInt).device(at::kCPU));
  pybind11::gil_scoped_release nogil;
  lc::abstain_list(nonzero.data_ptr<uint8_t>(), mask.data_ptr<uint8_t>(), nonzero.numel(), capacity,
                   out.data_ptr<int32_t>());
  return out;
}

void momentum_update_list(const std::vector<at::Tensor>& momenta, const std::vector<at::Tensor>& grads,
                          double beta2) {
  check_pairs(momenta, "momenta", grads, "grads");
  std::vector<int64_t> offs(momenta.size(), 0);
  auto m = make_slots(momenta, offs, "momenta", false, INT64_MAX);
  auto g = make_slots(grads, offs, "grads", true, INT64_MAX);
  pybind11::gil_scoped_release nogil;
  lc::momentum_update(m.data(), g.data(), static_cast<int64_t>(m.size()), beta2, threads());
}

c10::optional<at::Tensor> vote_apply(const at::Tensor& sign, const c10::optional<at::Tensor>& nonzero,
                                     const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets,
                                     double lr, double weight_decay, int64_t step, int64_t tie, int64_t vote,
                                     int64_t world_size, const at::Tensor& segments, bool return_delta) {
  const auto [n, b] = plane_shape(sign, "sign", false);
  check_same_planes(nonzero, n, b, false);
  const int64_t numel = b * 8;
  auto p = make_slots(params, offsets, "params", false, numel);
  const auto a = apply_args(lr, weight_decay, step, tie, vote, world_size, segments);
  at::Tensor delta;
  if (return_delta) delta = at::empty({numel}, at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
  {
    pybind11::gil_scoped_release nogil;
    lc::vote_apply(sign.data_ptr<uint8_t>(), nonzero.has_value() ? nonzero->data_ptr<uint8_t>() : nullptr, n, b,
                   p.data(), static_cast<int64_t>(p.size()), a, return_delta ? delta.data_ptr<float>() : nullptr,
                   threads());
  }
  if (return_delta) return delta;
  return c10::nullopt;
}

std::tuple<at::Tensor, at::Tensor> shard_vote(const at::Tensor& sign, const c10::optional<at::Tensor>& nonzero,
                                              int64_t step, int64_t tie, const at::Tensor& segments) {
  const auto [n, s] = plane_shape(sign, "sign", true);
  check_same_planes(nonzero, n, s, true);
  TORCH_CHECK(tie >= 0 && tie <= 2, "lioncub cpp kernels: tie rule code must be 0..2, got ", tie);
  const auto tt = tie_table(segments);
  auto opts = at::TensorOptions().dtype(at::kByte).device(at::kCPU);
  at::Tensor out_sign = at::zeros({s}, opts);
  at::Tensor out_nz = at::zeros({s}, opts);
  {
    pybind11::gil_scoped_release nogil;
    lc::shard_vote(sign.data_ptr<uint8_t>(), nonzero.has_value() ? nonzero->data_ptr<uint8_t>() : nullptr, n, s,
                   step, static_cast<int32_t>(tie), tt.first, tt.second, out_sign.data_ptr<uint8_t>(),
                   out_nz.data_ptr<uint8_t>(), threads());
  }
  return {out_sign, out_nz};
}

std::tuple<at::Tensor, c10::optional<at::Tensor>, int64_t> count_lanes(const at::Tensor& sign,
                                                                      const c10::optional<at::Tensor>& nonzero,
                                                                      int64_t p) {
  const auto [n, s] = plane_shape(sign, "sign", true);
  check_same_planes(nonzero, n, s, true);
  TORCH_CHECK(p == 1 || p == 2 || p == 4 || p == 8, "lioncub cpp kernels: lane width p must be 1, 2, 4 or 8, got ",
              p);
  auto opts = at::TensorOptions().dtype(at::kByte).device(at::kCPU);
  at::Tensor plus = at::zeros({s * p}, opts);
  c10::optional<at::Tensor> cnt;
  if (nonzero.has_value()) cnt = at::zeros({s * p}, opts);
  int64_t mx = 0;
  {
    pybind11::gil_scoped_release nogil;
    mx = lc::count_lanes(sign.data_ptr<uint8_t>(), nonzero.has_value() ? nonzero->data_ptr<uint8_t>() : nullptr, n,
                         s, static_cast<int>(p), plus.data_ptr<uint8_t>(),
                         cnt.has_value() ? cnt->data_ptr<uint8_t>() : nullptr, threads());
  }
  return {plus, cnt, mx};
}

c10::optional<at::Tensor> lanes_apply(const at::Tensor& plus, const c10::optional<at::Tensor>& cnt,
                                      int64_t world_size, int64_t p, const std::vector<at::Tensor>& params,
                                      const std::vector<int64_t>& offsets, double lr, double weight_decay,
                                      int64_t step, int64_t tie, int64_t vote, const at::Tensor& segments,
                                      bool return_delta) {
  check_u8(plus, "plus_lanes");
  TORCH_CHECK(p == 1 || p == 2 || p == 4 || p == 8, "lioncub cpp kernels: lane width p must be 1, 2, 4 or 8, got ",
              p);
  const int64_t bytes = plus.numel();
  if (cnt.has_value()) {
    check_u8(*cnt, "cnt_lanes");
    TORCH_CHECK(cnt->numel() == bytes, "lioncub cpp kernels: cnt_lanes has ", cnt->numel(),
                " bytes but plus_lanes has ", bytes);
  }
  const int64_t numel = bytes * 8 / p;
  auto prm = make_slots(params, offsets, "params", false, numel);
  const auto a = apply_args(lr, weight_decay, step, tie, vote, world_size, segments);
  at::Tensor delta;
  if (return_delta) delta = at::empty({numel}, at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
  {
    pybind11::gil_scoped_release nogil;
    lc::lanes_apply(plus.data_ptr<uint8_t>(), cnt.has_value() ? cnt->data_ptr<uint8_t>() : nullptr, bytes,
                    static_cast<int>(p), prm.data(), static_cast<int64_t>(prm.size()), a,
                    return_delta ? delta.data_ptr<float>() : nullptr, threads());
  }
  if (return_delta) return delta;
  return c10::nullopt;
}

std::tuple<at::Tensor, int64_t> int8_local_step(const std::vector<at::Tensor>& grads,
                                                const std::vector<at::Tensor>& momenta,
                                                const std::vector<int64_t>& offsets, int64_t total, double beta1,
                                                int64_t kind, int64_t levels) {
  TORCH_CHECK(total >= 0, "lioncub cpp kernels: total must be >= 0, got ", total);
  TORCH_CHECK(kind >= 0 && kind <= 2, "lioncub cpp kernels: scale kind code must be 0..2, got ", kind);
  TORCH_CHECK(levels >= 1 && levels <= 127, "lioncub cpp kernels: levels must be 1..127, got ", levels);
  check_pairs(grads, "grads", momenta, "momenta");
  auto g = make_slots(grads, offsets, "grads", true, total);
  auto m = make_slots(momenta, offsets, "momenta", false, total);
  at::Tensor q = at::zeros({total}, at::TensorOptions().dtype(at::kChar).device(at::kCPU));
  int64_t bad = 0;
  const int tt = threads();
  {
    pybind11::gil_scoped_release nogil;
    bad = lc::int8_local_step(g.data(), m.data(), static_cast<int64_t>(g.size()), total, beta1,
                              static_cast<int32_t>(kind), static_cast<int32_t>(levels), q.data_ptr<int8_t>(), tt);
  }
  return {q, bad};
}

c10::optional<at::Tensor> int8_apply(const at::Tensor& qsum, const std::vector<at::Tensor>& params,
                                     const std::vector<int64_t>& offsets, double lr, double weight_decay,
                                     bool return_delta) {
  check_cpu_contig(qsum, "qsum");
  TORCH_CHECK(qsum.scalar_type() == at::kChar, "lioncub cpp kernels: qsum must be int8, got ", qsum.scalar_type());
  const int64_t numel = qsum.numel();
  auto prm = make_slots(params, offsets, "params", false, numel);
  at::Tensor delta;
  if (return_delta) delta = at::empty({numel}, at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
  {
    pybind11::gil_scoped_release nogil;
    const lc::ApplyArgs a = lc_make_apply_args(lr, weight_decay, 0, 0, 0, 1, nullptr, 0);
    lc::int8_apply(qsum.data_ptr<int8_t>(), numel, prm.data(), static_cast<int64_t>(prm.size()), a,
                   return_delta ? delta.data_ptr<float>() : nullptr, threads());
  }
  if (return_delta) return delta;
  return c10::nullopt;
}

void lion_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& momenta, double lr, double weight_decay, double beta1, double beta2) {
  check_pairs(params, "params", grads, "grads");
  check_pairs(params, "params", momenta, "momenta");
  std::vector<int64_t> offs(params.size(), 0);
  auto p = make_slots(params, offs, "params", false, INT64_MAX);
  auto g = make_slots(grads, offs, "grads", true, INT64_MAX);
  auto m = make_slots(momenta, offs, "momenta", false, INT64_MAX);
  const lc::LionStepArgs a = lc_make_lion_step_args(lr, weight_decay, beta1, beta2);
  pybind11::gil_scoped_release nogil;
  lc::lion_step(p.data(), g.data(), m.data(), static_cast<int64_t>(p.size()), a, threads());
}

}  // namespace

// The pieces of a ZeRO sign all-gather apply (shared by the CPU and CUDA bindings): `layout` int64
// [K, 5] rows (group, row, bit, start, numel) (reference.ZeroLayout.pieces), targets[g] fp32 and
// casts[g] (optional) with the element counts of their groups, one lr / weight decay per group.
// Every row is checked to lie inside its planes and tensors (a second line behind checks.py).
constexpr int64_t kPieceChunk = 16384;  // chunk_start counts chunks of this many elements (LC_CHUNK)
static std::vector<lc_zero_piece> zero_pieces(int64_t rows, int64_t row_bits, const std::vector<at::Tensor>& targets,
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

namespace {

int32_t cpu_cast_code(const at::Tensor& t) { return float_code(t, "casts", true); }

void zero_sign_apply(const at::Tensor& sign, const c10::optional<at::Tensor>& nonzero,
                     const std::vector<at::Tensor>& targets, const std::vector<c10::optional<at::Tensor>>& casts,
                     const at::Tensor& layout, const std::vector<double>& lrs, const std::vector<double>& wds) {
  const auto [n, b] = plane_shape(sign, "sign", true);
  int64_t zb = b;
  if (nonzero.has_value()) {
    const auto z = plane_shape(*nonzero, "nonzero", true);
    TORCH_CHECK(z.first == n, "lioncub kernels: nonzero has ", z.first, " rows but sign has ", n);
    zb = z.second;
  }
  for (size_t g = 0; g < targets.size(); ++g) {
    check_cpu_contig(targets[g], arg_name("targets", static_cast<int64_t>(g)));
    if (casts[g].has_value()) check_cpu_contig(*casts[g], arg_name("casts", static_cast<int64_t>(g)));
  }
  const auto pieces = zero_pieces(n, 8 * std::min(b, zb), targets, casts, layout, lrs, wds, &cpu_cast_code);
  pybind11::gil_scoped_release nogil;
  lc::zero_sign_apply(sign.data_ptr<uint8_t>(), b, nonzero.has_value() ? nonzero->data_ptr<uint8_t>() : nullptr, zb,
                      pieces.data(), static_cast<int64_t>(pieces.size()), threads());
}

}  // namespace

// ---- CUDA launchers (LIONCUB_WITH_CUDA) ----
#ifdef LIONCUB_WITH_CUDA
// Tensor wrappers over the raw-pointer launchers of csrc/cuda/lioncub_cuda.h, registered with a
// `cuda_` prefix. Every launch runs on the current CUDA stream under a guard for the tensors' device.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "cuda/lioncub_cuda.h"

namespace lioncub_cuda {

#define LC_CUDA_CHECK(expr, what)                                                              \
  do {                                                                                         \
    const cudaError_t lc_err_ = (expr);                                                        \
    TORCH_CHECK(lc_err_ == cudaSuccess, "lioncub_ds CUDA kernel ", what, " failed: ",         \
                cudaGetErrorString(lc_err_));                                                  \
  } while (0)

static int dtype_code(const at::Tensor& t, const std::string& name) {
  switch (t.scalar_type()) {
    case at::kFloat: return LC_FLOAT32;
    case at::kBFloat16: return LC_BFLOAT16;
    case at::kHalf: return LC_FLOAT16;
    default:
      TORCH_CHECK(false, name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
  return -1;
}

static void check_cuda(const at::Tensor& t, const std::string& name, const at::Device& dev) {
  TORCH_CHECK(t.defined(), name, " is undefined");
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.device() == dev, name, " must be on ", dev, " (the device of the first tensor), got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

static void check_plane(const at::Tensor& t, const std::string& name, const at::Device& dev, at::ScalarType st) {
  check_cuda(t, name, dev);
  TORCH_CHECK(t.scalar_type() == st, name, " must be ", st, ", got ", t.scalar_type());
}

static at::Tensor uint8_like(int64_t n, const at::Device& dev) {
  return at::empty({n}, at::TensorOptions().dtype(at::kByte).device(dev));
}

// The device array of lc_tensor_meta of one multi-tensor launch.
struct Meta {
  at::Tensor dev;      // int64 [T, LC_META_WORDS] on the device (kept alive until the launch is queued)
  int n = 0;           // T (tensors with numel 0 dropped)
  int64_t chunks = 0;  // total LC_CHUNK chunks
  const lc_tensor_meta* ptr() const {
    return n ? reinterpret_cast<const lc_tensor_meta*>(dev.data_ptr<int64_t>()) : nullptr;
  }
};

// a: grads or params; b: momenta (same length) or nullptr; offsets: bucket element offsets
// (multiples of 8, tensors within [0, limit) and non-overlapping -> sorted by offset), or
// nullptr for a plain list (momentum update: any order, no layout).
static Meta build_meta(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>* b,
                       const std::vector<int64_t>* offsets, int64_t limit, const char* a_name, const char* b_name,
                       const at::Device& dev) {
  TORCH_CHECK(b == nullptr || b->size() == a.size(), a_name, " and ", b_name, " must have the same length, got ",
              a.size(), " and ", b->size());
  TORCH_CHECK(offsets == nullptr || offsets->size() == a.size(), "offsets must have one entry per tensor of ",
              a_name, ", got ", offsets->size(), " for ", a.size());
  std::vector<std::array<int64_t, LC_META_WORDS>> rows;
  rows.reserve(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const std::string an = std::string(a_name) + "[" + std::to_string(i) + "]";
    check_cuda(a[i], an, dev);
    int64_t dt = dtype_code(a[i], an);
    uint64_t bp = 0;
    if (b) {
      const std::string bn = std::string(b_name) + "[" + std::to_string(i) + "]";
      check_cuda((*b)[i], bn, dev);
      TORCH_CHECK((*b)[i].numel() == a[i].numel(), bn, " has ", (*b)[i].numel(), " elements, ", an, " has ",
                  a[i].numel());
      dt |= static_cast<int64_t>(dtype_code((*b)[i], bn)) << 8;
      bp = reinterpret_cast<uint64_t>((*b)[i].data_ptr());
    }
    const int64_t numel = a[i].numel();
    const int64_t off = offsets ? (*offsets)[i] : 0;
    if (offsets) {
      TORCH_CHECK(off >= 0 && off % 8 == 0, "offsets[", i, "] must be a non-negative multiple of 8, got ", off);
      TORCH_CHECK(off + numel <= limit, an, " (offset ", off, ", ", numel, " elements) ends past the bucket of ",
                  limit, " elements");
    }
    if (numel == 0) continue;
    rows.push_back({static_cast<int64_t>(reinterpret_cast<uint64_t>(a[i].data_ptr())), static_cast<int64_t>(bp),
                    off, numel, 0, dt});
  }
  if (offsets) {
    std::stable_sort(rows.begin(), rows.end(), [](const auto& x, const auto& y) { return x[2] < y[2]; });
    for (size_t k = 1; k < rows.size(); ++k)
      TORCH_CHECK(rows[k][2] >= rows[k - 1][2] + rows[k - 1][3], a_name, ": the tensors at offsets ", rows[k - 1][2],
                  " and ", rows[k][2], " overlap");
  }
  Meta m;
  for (auto& r : rows) {
    r[4] = m.chunks;
    m.chunks += lc_num_chunks(r[3]);
  }
  m.n = static_cast<int>(rows.size());
  at::Tensor host = at::empty({m.n, LC_META_WORDS}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  if (m.n) std::memcpy(host.data_ptr<int64_t>(), rows.data(), rows.size() * sizeof(rows[0]));
  m.dev = host.to(dev, /*non_blocking=*/true);  // pinned: the caching host allocator keeps it until the copy ran
  return m;
}

static lc_lion_args lion_args(double beta1, double beta2) { return lc_make_lion_args(beta1, beta2); }

// The tie-index table (int64 [K, 2] on the CPU, validated by reference.as_segments) copied to the
// device through pinned memory without a host sync; keep the returned tensor alive until the
// launch is queued.
static at::Tensor device_table(const at::Tensor& segments, const at::Device& dev) {
  TORCH_CHECK(segments.device().is_cpu() && segments.scalar_type() == at::kLong && segments.dim() == 2 &&
                  segments.size(1) == 2 && segments.size(0) >= 1,
              "segments must be an int64 [K, 2] CPU tensor with K >= 1");
  at::Tensor host = at::empty({segments.size(0), 2}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  host.copy_(segments);
  return host.to(dev, /*non_blocking=*/true);
}

static lc_apply_args apply_args(double lr, double weight_decay, int64_t step, int64_t tie, int64_t vote,
                                int64_t world_size, const at::Tensor& table) {
  TORCH_CHECK(tie >= 0 && tie <= 2, "tie code must be 0 (zero), 1 (alternate) or 2 (hash), got ", tie);
  TORCH_CHECK(vote == 0 || vote == 1, "vote code must be 0 (majority) or 1 (average), got ", vote);
  TORCH_CHECK(world_size >= 1 && world_size <= INT32_MAX, "world_size must be >= 1, got ", world_size);
  return lc_make_apply_args(lr, weight_decay, step, static_cast<int32_t>(tie), static_cast<int32_t>(vote),
                            static_cast<int32_t>(world_size), table.defined() ? table.data_ptr<int64_t>() : nullptr,
                            table.defined() ? table.size(0) : 0);
}

// [rows, row_bytes] view of a 1-D or 2-D packed plane (reference.vote_apply accepts 1-D as one row).
static std::pair<int, int64_t> plane_shape(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 1 || t.dim() == 2, name, " must be 1-D or 2-D [ranks, bytes], got ", t.dim(), "-D");
  const int64_t rows = t.dim() == 2 ? t.size(0) : 1;
  TORCH_CHECK(rows >= 1 && rows <= LC_MAX_ROWS, name, " must have 1..", LC_MAX_ROWS, " rows, got ", rows);
  return {static_cast<int>(rows), t.dim() == 2 ? t.size(1) : t.size(0)};
}

// ----------------------------------------------------------------------------- local step
std::tuple<at::Tensor, at::Tensor, at::Tensor> local_step(const std::vector<at::Tensor>& grads,
                                                          const std::vector<at::Tensor>& momenta,
                                                          const std::vector<int64_t>& offsets, int64_t total,
                                                          double beta1, double beta2, bool update_momentum) {
  TORCH_CHECK(!grads.empty(), "grads must not be empty");
  TORCH_CHECK(total >= 0 && total % 8 == 0, "total must be a non-negative multiple of 8, got ", total);
  const at::Device dev = grads[0].device();
  const c10::cuda::CUDAGuard guard(dev);
  const Meta meta = build_meta(grads, &momenta, &offsets, total, "grads", "momenta", dev);
  at::Tensor sign = uint8_like(total / 8, dev), nonzero = uint8_like(total / 8, dev);
  at::Tensor counts = at::zeros({2}, at::TensorOptions().dtype(at::kLong).device(dev));
  LC_CUDA_CHECK(lc_local_step(meta.ptr(), meta.n, total, lion_args(beta1, beta2), update_momentum ? 1 : 0,
                              sign.data_ptr<uint8_t>(), nonzero.data_ptr<uint8_t>(), counts.data_ptr<int64_t>(),
                              at::cuda::getCurrentCUDAStream()),
                "local_step");
  return {sign, nonzero, counts};  // counts: int64 [#non-finite c, #zero c] on the device
}

void momentum_update(const std::vector<at::Tensor>& momenta, const std::vector<at::Tensor>& grads, double beta2) {
  if (grads.empty()) return;
  const at::Device dev = grads[0].device();
  const c10::cuda::CUDAGuard guard(dev);
  const Meta meta = build_meta(grads, &momenta, nullptr, 0, "grads", "momenta", dev);
  LC_CUDA_CHECK(lc_momentum_update(meta.ptr(), meta.n, meta.chunks, lion_args(0.0, beta2),
                                   at::cuda::getCurrentCUDAStream()),
                "momentum_update");
}

// ----------------------------------------------------------------------------- votes
std::optional<at::Tensor> vote_apply(const at::Tensor& sign, const std::optional<at::Tensor>& nonzero,
                                     const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets,
                                     double lr, double weight_decay, int64_t step, int64_t tie, int64_t vote,
                                     int64_t world_size, const at::Tensor& segments, bool return_delta) {
  const at::Device dev = sign.device();
  const c10::cuda::CUDAGuard guard(dev);
  check_plane(sign, "sign", dev, at::kByte);
  const auto [rows, row_bytes] = plane_shape(sign, "sign");
  if (nonzero) {
    check_plane(*nonzero, "nonzero", dev, at::kByte);
    TORCH_CHECK(nonzero->sizes() == sign.sizes(), "nonzero must have the shape of sign ", sign.sizes(), ", got ",
                nonzero->sizes());
  }
  const Meta meta = build_meta(params, nullptr, &offsets, row_bytes * 8, "params", "", dev);
  const at::Tensor table = device_table(segments, dev);
  std::optional<at::Tensor> delta;
  if (return_delta) delta = at::empty({row_bytes * 8}, at::TensorOptions().dtype(at::kFloat).device(dev));
  LC_CUDA_CHECK(lc_vote_apply(sign.data_ptr<uint8_t>(), nonzero ? nonzero->data_ptr<uint8_t>() : nullptr, rows,
                              row_bytes, meta.ptr(), meta.n,
                              apply_args(lr, weight_decay, step, tie, vote, world_size, table),
                              delta ? delta->data_ptr<float>() : nullptr, at::cuda::getCurrentCUDAStream()),
                "vote_apply");
  return delta;
}

std::tuple<at::Tensor, at::Tensor> shard_vote(const at::Tensor& sign, const std::optional<at::Tensor>& nonzero,
                                              int64_t step, int64_t tie, const at::Tensor& segments) {
  const at::Device dev = sign.device();
  const c10::cuda::CUDAGuard guard(dev);
  check_plane(sign, "sign", dev, at::kByte);
  TORCH_CHECK(sign.dim() == 2, "sign must be 2-D [ranks, shard bytes], got ", sign.dim(), "-D");
  const auto [rows, row_bytes] = plane_shape(sign, "sign");
  if (nonzero) {
    check_plane(*nonzero, "nonzero", dev, at::kByte);
    TORCH_CHECK(nonzero->sizes() == sign.sizes(), "nonzero must have the shape of sign ", sign.sizes(), ", got ",
                nonzero->sizes());
  }
  TORCH_CHECK(tie >= 0 && tie <= 2, "tie code must be 0 (zero), 1 (alternate) or 2 (hash), got ", tie);
  at::Tensor out_sign = uint8_like(row_bytes, dev), out_nz = uint8_like(row_bytes, dev);
  const at::Tensor table = device_table(segments, dev);
  LC_CUDA_CHECK(lc_shard_vote(sign.data_ptr<uint8_t>(), nonzero ? nonzero->data_ptr<uint8_t>() : nullptr, rows,
                              row_bytes, static_cast<int>(tie), step, table.data_ptr<int64_t>(), table.size(0),
                              out_sign.data_ptr<uint8_t>(),
                              out_nz.data_ptr<uint8_t>(), at::cuda::getCurrentCUDAStream()),
                "shard_vote");
  return {out_sign, out_nz};
}

// Returns (plus, cnt, overflow): overflow is a device int32 [1] flag (nonzero where a count did not
// fit its lane) when a count could overflow, else None; Python raises (never a C++ exception here).
std::tuple<at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> count_lanes(
    const at::Tensor& sign, const std::optional<at::Tensor>& nonzero, int64_t p) {
  const at::Device dev = sign.device();
  const c10::cuda::CUDAGuard guard(dev);
  check_plane(sign, "sign", dev, at::kByte);
  TORCH_CHECK(sign.dim() == 2, "sign must be 2-D [ranks, bytes], got ", sign.dim(), "-D");
  TORCH_CHECK_VALUE(p == 1 || p == 2 || p == 4 || p == 8, "lane width p must be one of (1, 2, 4, 8), got ", p);
  const auto [rows, row_bytes] = plane_shape(sign, "sign");
  const int64_t top = (int64_t{1} << p) - 1;
  if (nonzero) {
    check_plane(*nonzero, "nonzero", dev, at::kByte);
    TORCH_CHECK(nonzero->sizes() == sign.sizes(), "nonzero must have the shape of sign ", sign.sizes(), ", got ",
                nonzero->sizes());
  } else {
    TORCH_CHECK_VALUE(row_bytes == 0 || rows <= top, "count ", rows, " does not fit a ", p, "-bit lane");
  }
  TORCH_CHECK_VALUE(rows <= 255, "count_lanes counts at most 255 ranks (8-bit lanes), got ", rows);
  at::Tensor plus = uint8_like(row_bytes * p, dev);
  std::optional<at::Tensor> cnt;
  if (nonzero) cnt = uint8_like(row_bytes * p, dev);
  const bool check = nonzero.has_value() && rows > top && row_bytes > 0;  // only then can a lane overflow
  std::optional<at::Tensor> overflow;
  if (check) overflow = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(dev));
  LC_CUDA_CHECK(lc_count_lanes(sign.data_ptr<uint8_t>(), nonzero ? nonzero->data_ptr<uint8_t>() : nullptr, rows,
                               row_bytes, static_cast<int>(p), plus.data_ptr<uint8_t>(),
                               cnt ? cnt->data_ptr<uint8_t>() : nullptr, check ? overflow->data_ptr<int32_t>() : nullptr,
                               at::cuda::getCurrentCUDAStream()),
                "count_lanes");
  return {plus, cnt, overflow};
}

std::optional<at::Tensor> lanes_apply(const at::Tensor& plus_lanes, const std::optional<at::Tensor>& cnt_lanes,
                                      int64_t world_size, int64_t p, const std::vector<at::Tensor>& params,
                                      const std::vector<int64_t>& offsets, double lr, double weight_decay,
                                      int64_t step, int64_t tie, int64_t vote, const at::Tensor& segments,
                                      bool return_delta) {
  const at::Device dev = plus_lanes.device();
  const c10::cuda::CUDAGuard guard(dev);
  check_plane(plus_lanes, "plus_lanes", dev, at::kByte);
  TORCH_CHECK_VALUE(p == 1 || p == 2 || p == 4 || p == 8, "lane width p must be one of (1, 2, 4, 8), got ", p);
  if (cnt_lanes) {
    check_plane(*cnt_lanes, "cnt_lanes", dev, at::kByte);
    TORCH_CHECK(cnt_lanes->numel() == plus_lanes.numel(), "cnt_lanes must have ", plus_lanes.numel(),
                " bytes like plus_lanes, got ", cnt_lanes->numel());
  }
  const int64_t numel = plus_lanes.numel() * 8 / p;
  const Meta meta = build_meta(params, nullptr, &offsets, numel, "params", "", dev);
  const at::Tensor table = device_table(segments, dev);
  std::optional<at::Tensor> delta;
  if (return_delta) delta = at::empty({numel}, at::TensorOptions().dtype(at::kFloat).device(dev));
  LC_CUDA_CHECK(lc_lanes_apply(plus_lanes.data_ptr<uint8_t>(), cnt_lanes ? cnt_lanes->data_ptr<uint8_t>() : nullptr,
                               numel, static_cast<int>(p), meta.ptr(), meta.n,
                               apply_args(lr, weight_decay, step, tie, vote, world_size, table),
                               delta ? delta->data_ptr<float>() : nullptr, at::cuda::getCurrentCUDAStream()),
                "lanes_apply");
  return delta;
}

// ----------------------------------------------------------------------------- int8
std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_local_step(const std::vector<at::Tensor>& grads,
                                                               const std::vector<at::Tensor>& momenta,
                                                               const std::vector<int64_t>& offsets, int64_t total,
                                                               double beta1, int64_t kind, int64_t levels) {
  TORCH_CHECK(!grads.empty(), "grads must not be empty");
  TORCH_CHECK(total >= 0 && total % 8 == 0, "total must be a non-negative multiple of 8, got ", total);
  TORCH_CHECK(kind >= 0 && kind <= 2, "scale kind code must be 0 (l1), 1 (l0) or 2 (linf), got ", kind);
  TORCH_CHECK_VALUE(levels >= 1 && levels <= 127, "int8 levels must be in 1..127, got ", levels);
  const at::Device dev = grads[0].device();
  const c10::cuda::CUDAGuard guard(dev);
  const Meta meta = build_meta(grads, &momenta, &offsets, total, "grads", "momenta", dev);
  at::Tensor q = at::empty({total}, at::TensorOptions().dtype(at::kChar).device(dev));
  at::Tensor scales = at::empty({std::max(meta.n, 1)}, at::TensorOptions().dtype(at::kFloat).device(dev));
  at::Tensor n_bad = at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(dev));
  const size_t ws_bytes = lc_int8_workspace_bytes(meta.chunks);
  at::Tensor ws = uint8_like(static_cast<int64_t>(std::max<size_t>(ws_bytes, 8)), dev);
  LC_CUDA_CHECK(lc_int8_local_step(meta.ptr(), meta.n, meta.chunks, total, lion_args(beta1, 0.0),
                                   static_cast<int>(kind), static_cast<int>(levels), q.data_ptr<int8_t>(),
                                   scales.data_ptr<float>(), ws.data_ptr(), ws_bytes, n_bad.data_ptr<int64_t>(),
                                   at::cuda::getCurrentCUDAStream()),
                "int8_local_step");
  return {q, n_bad, scales};  // scales: per tensor in offset order (for inspection)
}

std::optional<at::Tensor> int8_apply(const at::Tensor& qsum, const std::vector<at::Tensor>& params,
                                     const std::vector<int64_t>& offsets, double lr, double weight_decay,
                                     bool return_delta) {
  const at::Device dev = qsum.device();
  const c10::cuda::CUDAGuard guard(dev);
  check_plane(qsum, "qsum", dev, at::kChar);
  const int64_t numel = qsum.numel();
  const Meta meta = build_meta(params, nullptr, &offsets, numel, "params", "", dev);
  std::optional<at::Tensor> delta;
  if (return_delta) delta = at::empty({numel}, at::TensorOptions().dtype(at::kFloat).device(dev));
  LC_CUDA_CHECK(lc_int8_apply(qsum.data_ptr<int8_t>(), numel, meta.ptr(), meta.n,
                              apply_args(lr, weight_decay, 0, 0, 0, 1, at::Tensor()),
                              delta ? delta->data_ptr<float>() : nullptr,
                              at::cuda::getCurrentCUDAStream()),
                "int8_apply");
  return delta;
}

// ----------------------------------------------------------------------------- single-process step
void lion_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& momenta, double lr, double weight_decay, double beta1, double beta2) {
  TORCH_CHECK(grads.size() == params.size() && momenta.size() == params.size(),
              "params, grads and momenta must have the same length, got ", params.size(), ", ", grads.size(), " and ",
              momenta.size());
  if (params.empty()) return;
  const at::Device dev = params[0].device();
  const c10::cuda::CUDAGuard guard(dev);
  std::vector<std::array<int64_t, LC_META_WORDS>> rows;
  int64_t chunks = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string idx = "[" + std::to_string(i) + "]";
    check_cuda(params[i], "params" + idx, dev);
    check_cuda(grads[i], "grads" + idx, dev);
    check_cuda(momenta[i], "momenta" + idx, dev);
    const int64_t n = params[i].numel();
    TORCH_CHECK(grads[i].numel() == n && momenta[i].numel() == n, "params", idx, " has ", n,
                " elements; grads and momenta must have as many");
    const int64_t dt = dtype_code(params[i], "params" + idx) | (dtype_code(grads[i], "grads" + idx) << 8) |
                       (static_cast<int64_t>(dtype_code(momenta[i], "momenta" + idx)) << 16);
    if (n == 0) continue;
    rows.push_back({static_cast<int64_t>(reinterpret_cast<uint64_t>(params[i].data_ptr())),
                    static_cast<int64_t>(reinterpret_cast<uint64_t>(grads[i].data_ptr())),
                    static_cast<int64_t>(reinterpret_cast<uint64_t>(momenta[i].data_ptr())), n, chunks, dt});
    chunks += lc_num_chunks(n);
  }
  if (rows.empty()) return;
  static_assert(sizeof(lc_lion_meta) == LC_META_WORDS * 8, "lc_lion_meta layout");
  at::Tensor host = at::empty({static_cast<int64_t>(rows.size()), LC_META_WORDS},
                              at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::memcpy(host.data_ptr<int64_t>(), rows.data(), rows.size() * sizeof(rows[0]));
  const at::Tensor meta = host.to(dev, /*non_blocking=*/true);
  LC_CUDA_CHECK(lc_lion_step(reinterpret_cast<const lc_lion_meta*>(meta.data_ptr<int64_t>()),
                             static_cast<int>(rows.size()), chunks,
                             lc_make_lion_step_args(lr, weight_decay, beta1, beta2), at::cuda::getCurrentCUDAStream()),
                "lion_step");
}

static int32_t cuda_cast_code(const at::Tensor& t) { return dtype_code(t, "casts"); }

void zero_sign_apply(const at::Tensor& sign, const std::optional<at::Tensor>& nonzero,
                     const std::vector<at::Tensor>& targets, const std::vector<std::optional<at::Tensor>>& casts,
                     const at::Tensor& layout, const std::vector<double>& lrs, const std::vector<double>& wds) {
  const at::Device dev = sign.device();
  const c10::cuda::CUDAGuard guard(dev);
  check_plane(sign, "sign", dev, at::kByte);
  TORCH_CHECK(sign.dim() == 2, "sign must be 2-D [ranks, bytes], got ", sign.dim(), "-D");
  int64_t zb = sign.size(1);
  if (nonzero) {
    check_plane(*nonzero, "nonzero", dev, at::kByte);
    TORCH_CHECK(nonzero->dim() == 2 && nonzero->size(0) == sign.size(0), "nonzero must be 2-D with ", sign.size(0),
                " rows");
    zb = nonzero->size(1);
  }
  TORCH_CHECK(casts.size() == targets.size(), "casts must have one entry per target");
  for (size_t g = 0; g < targets.size(); ++g) {
    check_cuda(targets[g], "targets[" + std::to_string(g) + "]", dev);
    if (casts[g]) check_cuda(*casts[g], "casts[" + std::to_string(g) + "]", dev);
  }
  static_assert(LC_CHUNK == kPieceChunk, "piece chunks are LC_CHUNK chunks");
  const auto pieces = zero_pieces(sign.size(0), 8 * std::min<int64_t>(sign.size(1), zb), targets, casts, layout, lrs,
                                  wds, &cuda_cast_code);
  if (pieces.empty()) return;
  const int64_t chunks = pieces.back().chunk_start + lc_num_chunks(pieces.back().numel);
  static_assert(sizeof(lc_zero_piece) == 64, "lc_zero_piece layout");
  at::Tensor host = at::empty({static_cast<int64_t>(pieces.size() * sizeof(lc_zero_piece))},
                              at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr<uint8_t>(), pieces.data(), pieces.size() * sizeof(lc_zero_piece));
  const at::Tensor dpieces = host.to(dev, /*non_blocking=*/true);
  LC_CUDA_CHECK(lc_zero_sign_apply(sign.data_ptr<uint8_t>(), sign.size(1),
                                   nonzero ? nonzero->data_ptr<uint8_t>() : nullptr, zb,
                                   reinterpret_cast<const lc_zero_piece*>(dpieces.data_ptr<uint8_t>()),
                                   static_cast<int>(pieces.size()), chunks, at::cuda::getCurrentCUDAStream()),
                "zero_sign_apply");
}

void register_cuda(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("cuda_local_step", &local_step, "fused local step (CUDA)", py::arg("grads"), py::arg("momenta"),
        py::arg("offsets"), py::arg("total"), py::arg("beta1"), py::arg("beta2"), py::arg("update_momentum"));
  m.def("cuda_momentum_update_list", &momentum_update, "multi-tensor momentum update (CUDA)", py::arg("momenta"),
        py::arg("grads"), py::arg("beta2"));
  m.def("cuda_vote_apply", &vote_apply, "vote + apply (CUDA)", py::arg("sign"), py::arg("nonzero"),
        py::arg("params"), py::arg("offsets"), py::arg("lr"), py::arg("weight_decay"), py::arg("step"),
        py::arg("tie"), py::arg("vote"), py::arg("world_size"), py::arg("segments"), py::arg("return_delta"));
  m.def("cuda_shard_vote", &shard_vote, "two-phase vote, phase 1 (CUDA)", py::arg("sign"), py::arg("nonzero"),
        py::arg("step"), py::arg("tie"), py::arg("segments"));
  m.def("cuda_count_lanes", &count_lanes, "p-bit counts (CUDA)", py::arg("sign"), py::arg("nonzero"), py::arg("p"));
  m.def("cuda_lanes_apply", &lanes_apply, "summed lanes + apply (CUDA)", py::arg("plus_lanes"),
        py::arg("cnt_lanes"), py::arg("world_size"), py::arg("p"), py::arg("params"), py::arg("offsets"),
        py::arg("lr"), py::arg("weight_decay"), py::arg("step"), py::arg("tie"), py::arg("vote"), py::arg("segments"),
        py::arg("return_delta"));
  m.def("cuda_int8_local_step", &int8_local_step, "int8 local step (CUDA)", py::arg("grads"), py::arg("momenta"),
        py::arg("offsets"), py::arg("total"), py::arg("beta1"), py::arg("kind"), py::arg("levels"));
  m.def("cuda_int8_apply", &int8_apply, "int8 apply (CUDA)", py::arg("qsum"), py::arg("params"), py::arg("offsets"),
        py::arg("lr"), py::arg("weight_decay"), py::arg("return_delta"));
  m.def("cuda_lion_step", &lion_step, "single-process Lion step (CUDA, one launch)", py::arg("params"),
        py::arg("grads"), py::arg("momenta"), py::arg("lr"), py::arg("weight_decay"), py::arg("beta1"),
        py::arg("beta2"));
  m.def("cuda_zero_sign_apply", &zero_sign_apply, "ZeRO sign all-gather apply (CUDA, one launch)", py::arg("sign"),
        py::arg("nonzero"), py::arg("targets"), py::arg("casts"), py::arg("layout"), py::arg("lrs"),
        py::arg("weight_decays"));
}

}  // namespace lioncub_cuda
// ===== end of the CUDA section ==============================================================
#endif
// ---- end CUDA launchers ----

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lioncub_ds fused kernels (C++ CPU; CUDA when built with LIONCUB_WITH_CUDA)";
  m.def("local_step", &local_step, "sign/nonzero planes of c (+ optional momentum update, in place or to momenta_out)",
        py::arg("grads"), py::arg("momenta"), py::arg("offsets"), py::arg("total"), py::arg("beta1"), py::arg("beta2"),
        py::arg("update_momentum"), py::arg("momenta_out") = py::none());
  m.def("abstain_list", &abstain_list, "abstention list: count, first K differing byte indices and values");
  m.def("momentum_update_list", &momentum_update_list, "m <- b2*m + (1-b2)*g for every tensor");
  m.def("vote_apply", &vote_apply, "N sign planes -> Δ -> apply");
  m.def("shard_vote", &shard_vote, "two-phase vote, phase 1");
  m.def("count_lanes", &count_lanes, "planes -> p-bit count lanes (returns max voter count)");
  m.def("lanes_apply", &lanes_apply, "summed p-bit lanes -> Δ -> apply");
  m.def("int8_local_step", &int8_local_step, "scaled int8 codes of c");
  m.def("int8_apply", &int8_apply, "summed int8 codes -> Δ -> apply");
  m.def("lion_step", &lion_step, "single-process Lion step over lists of tensors (one pass)");
  m.def("zero_sign_apply", &zero_sign_apply, "ZeRO sign all-gather: apply every partition's update in one call");
  m.def("set_isa", [](int64_t isa) { lc::set_isa(static_cast<int>(isa)); }, "0 auto, 1 baseline, 2 avx2");
  m.def("isa", []() { return std::string(lc::isa_name()); });
  m.def("src_hash", []() { return std::string(LIONCUB_SRC_HASH_STR); });
#ifdef LIONCUB_WITH_CUDA
  lioncub_cuda::register_cuda(m);
#endif
  m.attr("has_cuda") = pybind11::bool_(
#ifdef LIONCUB_WITH_CUDA
      true
#else
      false
#endif
  );
}
