// bindings.cpp -- the Python module: the CPU wrappers (and, built with LIONCUB_WITH_CUDA, the CUDA
// ones of bindings_cuda.cpp). bindings*.{h,cpp} are the only files that include torch headers.
//
// Thin wrappers: check every tensor argument (device, dtype, contiguity, sizes; each message
// names the argument), allocate the outputs, release the GIL and call the raw kernels of
// csrc/cpu/lioncub_cpu.h (or, built with LIONCUB_WITH_CUDA, launch those of csrc/cuda/lioncub_cuda.h).
// The CPU and the CUDA wrappers share one set of argument checks (bindings_checks.h). lioncub_ds/kernels/cpp.py
// and cuda.py turn these into the backend objects whose methods mirror the reference backend.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "bindings_checks.h"
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

using namespace lioncub_bind;

namespace {

int threads() { return std::max(1, at::get_num_threads()); }

// ------------------------------------------------------------------------------- CPU helpers
// Tensors placed in a bucket of `total` elements at `offsets` (multiples of 8, no overrun).
std::vector<lc::Slot> make_slots(const std::vector<at::Tensor>& ts, const std::vector<int64_t>& offsets,
                                 const char* name, bool allow_f16, int64_t total) {
  TORCH_CHECK(ts.size() == offsets.size(), "lioncub cpp kernels: ", name, " has ", ts.size(),
              " tensors but offsets has ", offsets.size(), " entries");
  std::vector<lc::Slot> out(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    const std::string nm = arg_name(name, static_cast<int64_t>(i));
    check_tensor(ts[i], nm, kCpu);
    const int32_t code = float_code(ts[i], nm, allow_f16, kCpu);
    check_offset(i, offsets[i], ts[i].numel(), nm, total, kCpu);
    out[i] = lc::Slot{ts[i].data_ptr(), ts[i].numel(), offsets[i], code};
  }
  return out;
}

std::pair<const int64_t*, int64_t> tie_table(const at::Tensor& t) {
  check_segments(t, kCpu);
  return {t.data_ptr<int64_t>(), t.size(0)};
}

lc::ApplyArgs apply_args(double lr, double wd, int64_t step, int64_t tie, int64_t vote, int64_t world,
                         const at::Tensor& segments) {
  check_codes(tie, vote, world, kCpu);
  const auto tt = tie_table(segments);
  return lc_make_apply_args(lr, wd, step, static_cast<int32_t>(tie), static_cast<int32_t>(vote),
                            static_cast<int32_t>(world), tt.first, tt.second);
}

// The optional second momentum buffers of a local step: one per momentum, its dtype, in its place.
std::vector<lc::Slot> momenta_out_slots(const std::vector<at::Tensor>& momenta, const std::vector<lc::Slot>& m,
                                        const c10::optional<std::vector<at::Tensor>>& momenta_out,
                                        const std::vector<int64_t>& offsets, int64_t total) {
  std::vector<lc::Slot> mo;
  if (!momenta_out.has_value()) return mo;
  check_pairs(momenta, "momenta", *momenta_out, "momenta_out", kCpu);
  mo = make_slots(*momenta_out, offsets, "momenta_out", false, total);
  for (size_t i = 0; i < mo.size(); ++i)
    TORCH_CHECK(mo[i].dtype == m[i].dtype, "lioncub cpp kernels: ", arg_name("momenta_out", i),
                " must have the dtype of ", arg_name("momenta", i));
  return mo;
}

// The (sign, nonzero) result planes of a shard vote: s bytes each, zeroed.
std::pair<at::Tensor, at::Tensor> result_planes(int64_t s) {
  auto opts = at::TensorOptions().dtype(at::kByte).device(at::kCPU);
  return {at::zeros({s}, opts), at::zeros({s}, opts)};
}

// ------------------------------------------------------------------------------------ kernels
std::tuple<at::Tensor, at::Tensor, int64_t, int64_t> local_step(const std::vector<at::Tensor>& grads,
                                                               const std::vector<at::Tensor>& momenta,
                                                               const std::vector<int64_t>& offsets, int64_t total,
                                                               double beta1, double beta2, bool update_momentum,
                                                               const c10::optional<std::vector<at::Tensor>>& momenta_out) {
  check_total(total, 8, kCpu);
  check_pairs(grads, "grads", momenta, "momenta", kCpu);
  auto g = make_slots(grads, offsets, "grads", true, total);
  auto m = make_slots(momenta, offsets, "momenta", false, total);
  const std::vector<lc::Slot> mo = momenta_out_slots(momenta, m, momenta_out, offsets, total);
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
  check_dtype(nonzero, "nonzero", at::kByte, kCpu);
  check_dtype(mask, "mask", at::kByte, kCpu);
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
  check_pairs(momenta, "momenta", grads, "grads", kCpu);
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
  const auto [n, b] = plane_shape(sign, "sign", true, kCpu);
  check_nonzero(nonzero, {n, b}, true, kCpu);
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
  const auto [n, s] = plane_shape(sign, "sign", false, kCpu);
  check_nonzero(nonzero, {n, s}, false, kCpu);
  check_tie(tie, kCpu);
  const auto tt = tie_table(segments);
  auto [out_sign, out_nz] = result_planes(s);
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
  const auto [n, s] = plane_shape(sign, "sign", false, kCpu);
  check_nonzero(nonzero, {n, s}, false, kCpu);
  check_lane_width(p, kCpu);
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
  check_dtype(plus, "plus_lanes", at::kByte, kCpu);
  check_lane_width(p, kCpu);
  const int64_t bytes = plus.numel();
  if (cnt.has_value()) {
    check_dtype(*cnt, "cnt_lanes", at::kByte, kCpu);
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
  check_total(total, 1, kCpu);
  check_int8_codes(kind, levels, kCpu);
  check_pairs(grads, "grads", momenta, "momenta", kCpu);
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
  check_dtype(qsum, "qsum", at::kChar, kCpu);
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
  check_pairs(params, "params", grads, "grads", kCpu);
  check_pairs(params, "params", momenta, "momenta", kCpu);
  std::vector<int64_t> offs(params.size(), 0);
  auto p = make_slots(params, offs, "params", false, INT64_MAX);
  auto g = make_slots(grads, offs, "grads", true, INT64_MAX);
  auto m = make_slots(momenta, offs, "momenta", false, INT64_MAX);
  const lc::LionStepArgs a = lc_make_lion_step_args(lr, weight_decay, beta1, beta2);
  pybind11::gil_scoped_release nogil;
  lc::lion_step(p.data(), g.data(), m.data(), static_cast<int64_t>(p.size()), a, threads());
}

// comm="bbit": the local step (b code planes, the nonzero plane, the counts) and the shard vote.
std::tuple<at::Tensor, at::Tensor, int64_t, int64_t> bbit_local_step(
    const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& momenta, const std::vector<int64_t>& offsets,
    int64_t total, double beta1, double beta2, bool update_momentum, int64_t kind, int64_t bits, int64_t rounding,
    int64_t seed, const at::Tensor& segments, const c10::optional<std::vector<at::Tensor>>& momenta_out) {
  check_total(total, 8, kCpu);
  check_bbit_codes(kind, bits, rounding, seed, kCpu);
  check_pairs(grads, "grads", momenta, "momenta", kCpu);
  auto g = make_slots(grads, offsets, "grads", true, total);
  auto m = make_slots(momenta, offsets, "momenta", false, total);
  const std::vector<lc::Slot> mo = momenta_out_slots(momenta, m, momenta_out, offsets, total);
  const auto tt = tie_table(segments);
  const lc_bbit_args bb{static_cast<int32_t>(bits), static_cast<int32_t>(rounding), static_cast<int32_t>(kind),
                        static_cast<uint32_t>(seed), tt.first, tt.second};
  auto opts = at::TensorOptions().dtype(at::kByte).device(at::kCPU);
  at::Tensor planes = at::zeros({bits, total / 8}, opts);
  at::Tensor nz = at::zeros({total / 8}, opts);
  lc::LocalStepCounts r{0, 0};
  {
    pybind11::gil_scoped_release nogil;
    r = lc::bbit_local_step(g.data(), m.data(), mo.empty() ? nullptr : mo.data(), static_cast<int64_t>(g.size()),
                            total, beta1, beta2, update_momentum, bb, planes.data_ptr<uint8_t>(), nz.data_ptr<uint8_t>(),
                            threads());
  }
  return {planes, nz, r.n_nonfinite, r.n_zero};
}

std::tuple<at::Tensor, at::Tensor> bbit_shard_vote(const at::Tensor& planes, const c10::optional<at::Tensor>& nonzero,
                                                   int64_t bits, int64_t step, int64_t tie,
                                                   const at::Tensor& segments) {
  TORCH_CHECK(bits >= 1 && bits <= 4, "lioncub cpp kernels: vote_bits must be 1..4, got ", bits);
  const auto [n, s] = code_planes_shape(planes, bits, kCpu);
  check_nonzero(nonzero, {n, s}, false, kCpu);
  check_tie(tie, kCpu);
  const auto tt = tie_table(segments);
  auto [out_sign, out_nz] = result_planes(s);
  {
    pybind11::gil_scoped_release nogil;
    lc::bbit_shard_vote(planes.data_ptr<uint8_t>(), nonzero.has_value() ? nonzero->data_ptr<uint8_t>() : nullptr, n,
                        static_cast<int>(bits), s, step, static_cast<int32_t>(tie), tt.first, tt.second,
                        out_sign.data_ptr<uint8_t>(), out_nz.data_ptr<uint8_t>(), threads());
  }
  return {out_sign, out_nz};
}

}  // namespace

namespace {

int32_t cpu_cast_code(const at::Tensor& t) { return float_code(t, "casts", true, kCpu); }

void zero_sign_apply(const at::Tensor& sign, const c10::optional<at::Tensor>& nonzero,
                     const std::vector<at::Tensor>& targets, const std::vector<c10::optional<at::Tensor>>& casts,
                     const at::Tensor& layout, const std::vector<double>& lrs, const std::vector<double>& wds) {
  const auto [n, b] = plane_shape(sign, "sign", false, kCpu);
  const int64_t zb = zero_nonzero_bytes(nonzero, n, b, kCpu);
  check_zero_targets(targets, casts, kCpu);
  const auto pieces = zero_pieces(n, 8 * std::min(b, zb), targets, casts, layout, lrs, wds, &cpu_cast_code);
  pybind11::gil_scoped_release nogil;
  lc::zero_sign_apply(sign.data_ptr<uint8_t>(), b, nonzero.has_value() ? nonzero->data_ptr<uint8_t>() : nullptr, zb,
                      pieces.data(), static_cast<int64_t>(pieces.size()), threads());
}

}  // namespace

#ifdef LIONCUB_WITH_CUDA
namespace lioncub_cuda {
void register_cuda(pybind11::module_& m);  // bindings_cuda.cpp: the CUDA wrappers, `cuda_` names
}  // namespace lioncub_cuda
#endif


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
  m.def("bbit_local_step", &bbit_local_step, "comm=bbit local step: b code planes + nonzero plane (+ momentum)",
        py::arg("grads"), py::arg("momenta"), py::arg("offsets"), py::arg("total"), py::arg("beta1"), py::arg("beta2"),
        py::arg("update_momentum"), py::arg("kind"), py::arg("bits"), py::arg("rounding"), py::arg("seed"),
        py::arg("segments"), py::arg("momenta_out") = py::none());
  m.def("bbit_shard_vote", &bbit_shard_vote, "comm=bbit shard vote: sign of the summed levels, tie rule");
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
