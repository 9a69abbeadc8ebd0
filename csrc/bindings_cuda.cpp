// bindings_cuda.cpp -- the CUDA wrappers of the extension (built with LIONCUB_WITH_CUDA only:
// lioncub_ds/kernels/build.py CUDA_SOURCES); bindings.cpp registers them (register_cuda).
//
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

#include "bindings_checks.h"
#include "cuda/lioncub_cuda.h"

namespace lioncub_cuda {

using namespace lioncub_bind;

#define LC_CUDA_CHECK(expr, what)                                                              \
  do {                                                                                         \
    const cudaError_t lc_err_ = (expr);                                                        \
    TORCH_CHECK(lc_err_ == cudaSuccess, "lioncub_ds CUDA kernel ", what, " failed: ",         \
                cudaGetErrorString(lc_err_));                                                  \
  } while (0)

static_assert(int{LC_FLOAT32} == int{lcc::kF32} && int{LC_BFLOAT16} == int{lcc::kBF16} &&
                  int{LC_FLOAT16} == int{lcc::kF16},
              "dtype codes (float_code)");
static_assert(LC_MAX_ROWS == 65535, "plane rows (plane_shape)");

// Where this call's tensors must live (bindings_checks.h): the device of its first tensor.
static On on_cuda(const at::Device& dev) { return On{dev, "lioncub cuda kernels"}; }

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
  const On on = on_cuda(dev);
  if (b) check_pairs(a, a_name, *b, b_name, on);
  TORCH_CHECK(offsets == nullptr || offsets->size() == a.size(), on.who, ": offsets must have one entry per tensor of ",
              a_name, ", got ", offsets->size(), " for ", a.size());
  std::vector<std::array<int64_t, LC_META_WORDS>> rows;
  rows.reserve(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const std::string an = arg_name(a_name, static_cast<int64_t>(i));
    check_tensor(a[i], an, on);
    int64_t dt = float_code(a[i], an, true, on);
    uint64_t bp = 0;
    if (b) {
      const std::string bn = arg_name(b_name, static_cast<int64_t>(i));
      check_tensor((*b)[i], bn, on);
      dt |= static_cast<int64_t>(float_code((*b)[i], bn, true, on)) << 8;
      bp = reinterpret_cast<uint64_t>((*b)[i].data_ptr());
    }
    const int64_t numel = a[i].numel();
    const int64_t off = offsets ? (*offsets)[i] : 0;
    if (offsets) check_offset(i, off, numel, an, limit, on);
    if (numel == 0) continue;
    rows.push_back({static_cast<int64_t>(reinterpret_cast<uint64_t>(a[i].data_ptr())), static_cast<int64_t>(bp),
                    off, numel, 0, dt});
  }
  if (offsets) {
    std::stable_sort(rows.begin(), rows.end(), [](const auto& x, const auto& y) { return x[2] < y[2]; });
    for (size_t k = 1; k < rows.size(); ++k)
      TORCH_CHECK(rows[k][2] >= rows[k - 1][2] + rows[k - 1][3], on.who, ": ", a_name, ": the tensors at offsets ",
                  rows[k - 1][2],
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
  check_segments(segments, on_cuda(dev));
  at::Tensor host = at::empty({segments.size(0), 2}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  host.copy_(segments);
  return host.to(dev, /*non_blocking=*/true);
}

static lc_apply_args apply_args(double lr, double weight_decay, int64_t step, int64_t tie, int64_t vote,
                                int64_t world_size, const at::Tensor& table, const On& on) {
  check_codes(tie, vote, world_size, on);
  return lc_make_apply_args(lr, weight_decay, step, static_cast<int32_t>(tie), static_cast<int32_t>(vote),
                            static_cast<int32_t>(world_size), table.defined() ? table.data_ptr<int64_t>() : nullptr,
                            table.defined() ? table.size(0) : 0);
}

// ----------------------------------------------------------------------------- local step
std::tuple<at::Tensor, at::Tensor, at::Tensor> local_step(const std::vector<at::Tensor>& grads,
                                                          const std::vector<at::Tensor>& momenta,
                                                          const std::vector<int64_t>& offsets, int64_t total,
                                                          double beta1, double beta2, bool update_momentum) {
  TORCH_CHECK(!grads.empty(), "lioncub cuda kernels: grads must not be empty");
  const at::Device dev = grads[0].device();
  check_total(total, 8, on_cuda(dev));
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
  const On on = on_cuda(dev);
  const c10::cuda::CUDAGuard guard(dev);
  const auto [rows, row_bytes] = plane_shape(sign, "sign", true, on);
  check_nonzero(nonzero, {rows, row_bytes}, true, on);
  const Meta meta = build_meta(params, nullptr, &offsets, row_bytes * 8, "params", "", dev);
  const at::Tensor table = device_table(segments, dev);
  std::optional<at::Tensor> delta;
  if (return_delta) delta = at::empty({row_bytes * 8}, at::TensorOptions().dtype(at::kFloat).device(dev));
  LC_CUDA_CHECK(lc_vote_apply(sign.data_ptr<uint8_t>(), nonzero ? nonzero->data_ptr<uint8_t>() : nullptr, rows,
                              row_bytes, meta.ptr(), meta.n,
                              apply_args(lr, weight_decay, step, tie, vote, world_size, table, on),
                              delta ? delta->data_ptr<float>() : nullptr, at::cuda::getCurrentCUDAStream()),
                "vote_apply");
  return delta;
}

std::tuple<at::Tensor, at::Tensor> shard_vote(const at::Tensor& sign, const std::optional<at::Tensor>& nonzero,
                                              int64_t step, int64_t tie, const at::Tensor& segments) {
  const at::Device dev = sign.device();
  const On on = on_cuda(dev);
  const c10::cuda::CUDAGuard guard(dev);
  const auto [rows, row_bytes] = plane_shape(sign, "sign", false, on);
  check_nonzero(nonzero, {rows, row_bytes}, false, on);
  check_tie(tie, on);
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
  const On on = on_cuda(dev);
  const c10::cuda::CUDAGuard guard(dev);
  const auto [rows, row_bytes] = plane_shape(sign, "sign", false, on);
  check_nonzero(nonzero, {rows, row_bytes}, false, on);
  check_lane_width(p, on);
  const int64_t top = (int64_t{1} << p) - 1;
  if (!nonzero) {
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
  const On on = on_cuda(dev);
  const c10::cuda::CUDAGuard guard(dev);
  check_dtype(plus_lanes, "plus_lanes", at::kByte, on);
  check_lane_width(p, on);
  if (cnt_lanes) {
    check_dtype(*cnt_lanes, "cnt_lanes", at::kByte, on);
    TORCH_CHECK(cnt_lanes->numel() == plus_lanes.numel(), on.who, ": cnt_lanes has ", cnt_lanes->numel(),
                " bytes but plus_lanes has ", plus_lanes.numel());
  }
  const int64_t numel = plus_lanes.numel() * 8 / p;
  const Meta meta = build_meta(params, nullptr, &offsets, numel, "params", "", dev);
  const at::Tensor table = device_table(segments, dev);
  std::optional<at::Tensor> delta;
  if (return_delta) delta = at::empty({numel}, at::TensorOptions().dtype(at::kFloat).device(dev));
  LC_CUDA_CHECK(lc_lanes_apply(plus_lanes.data_ptr<uint8_t>(), cnt_lanes ? cnt_lanes->data_ptr<uint8_t>() : nullptr,
                               numel, static_cast<int>(p), meta.ptr(), meta.n,
                               apply_args(lr, weight_decay, step, tie, vote, world_size, table, on),
                               delta ? delta->data_ptr<float>() : nullptr, at::cuda::getCurrentCUDAStream()),
                "lanes_apply");
  return delta;
}

// ----------------------------------------------------------------------------- int8
std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_local_step(const std::vector<at::Tensor>& grads,
                                                               const std::vector<at::Tensor>& momenta,
                                                               const std::vector<int64_t>& offsets, int64_t total,
                                                               double beta1, int64_t kind, int64_t levels) {
  TORCH_CHECK(!grads.empty(), "lioncub cuda kernels: grads must not be empty");
  const at::Device dev = grads[0].device();
  check_total(total, 8, on_cuda(dev));
  check_int8_codes(kind, levels, on_cuda(dev));
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
  const On on = on_cuda(dev);
  const c10::cuda::CUDAGuard guard(dev);
  check_dtype(qsum, "qsum", at::kChar, on);
  const int64_t numel = qsum.numel();
  const Meta meta = build_meta(params, nullptr, &offsets, numel, "params", "", dev);
  std::optional<at::Tensor> delta;
  if (return_delta) delta = at::empty({numel}, at::TensorOptions().dtype(at::kFloat).device(dev));
  LC_CUDA_CHECK(lc_int8_apply(qsum.data_ptr<int8_t>(), numel, meta.ptr(), meta.n,
                              apply_args(lr, weight_decay, 0, 0, 0, 1, at::Tensor(), on),
                              delta ? delta->data_ptr<float>() : nullptr,
                              at::cuda::getCurrentCUDAStream()),
                "int8_apply");
  return delta;
}

// ----------------------------------------------------------------------------- comm="bbit"
std::tuple<at::Tensor, at::Tensor, at::Tensor> bbit_local_step(const std::vector<at::Tensor>& grads,
                                                               const std::vector<at::Tensor>& momenta,
                                                               const std::vector<int64_t>& offsets, int64_t total,
                                                               double beta1, double beta2, bool update_momentum,
                                                               int64_t kind, int64_t bits, int64_t rounding,
                                                               int64_t seed, const at::Tensor& segments) {
  TORCH_CHECK(!grads.empty(), "lioncub cuda kernels: grads must not be empty");
  const at::Device dev = grads[0].device();
  const On on = on_cuda(dev);
  check_total(total, 8, on);
  check_bbit_codes(kind, bits, rounding, seed, on);
  const c10::cuda::CUDAGuard guard(dev);
  const Meta meta = build_meta(grads, &momenta, &offsets, total, "grads", "momenta", dev);
  const at::Tensor table = device_table(segments, dev);
  at::Tensor planes = at::empty({bits, total / 8}, at::TensorOptions().dtype(at::kByte).device(dev));
  at::Tensor nonzero = uint8_like(total / 8, dev);
  at::Tensor ratios = at::empty({std::max(meta.n, 1)}, at::TensorOptions().dtype(at::kFloat).device(dev));
  at::Tensor counts = at::zeros({2}, at::TensorOptions().dtype(at::kLong).device(dev));
  const size_t ws_bytes = lc_int8_workspace_bytes(meta.chunks);
  at::Tensor ws = uint8_like(static_cast<int64_t>(std::max<size_t>(ws_bytes, 8)), dev);
  const lc_bbit_args bb{static_cast<int32_t>(bits), static_cast<int32_t>(rounding), static_cast<int32_t>(kind),
                        static_cast<uint32_t>(seed), table.data_ptr<int64_t>(), table.size(0)};
  LC_CUDA_CHECK(lc_bbit_local_step(meta.ptr(), meta.n, meta.chunks, total, lion_args(beta1, beta2), bb,
                                   update_momentum ? 1 : 0, planes.data_ptr<uint8_t>(), nonzero.data_ptr<uint8_t>(),
                                   ratios.data_ptr<float>(), ws.data_ptr(), ws_bytes, counts.data_ptr<int64_t>(),
                                   at::cuda::getCurrentCUDAStream()),
                "bbit_local_step");
  return {planes, nonzero, counts};  // counts: int64 [#non-finite c, #zero c] on the device
}

std::tuple<at::Tensor, at::Tensor> bbit_shard_vote(const at::Tensor& planes, const std::optional<at::Tensor>& nonzero,
                                                   int64_t bits, int64_t step, int64_t tie,
                                                   const at::Tensor& segments) {
  const at::Device dev = planes.device();
  const On on = on_cuda(dev);
  const c10::cuda::CUDAGuard guard(dev);
  TORCH_CHECK(bits >= 1 && bits <= 4, on.who, ": vote_bits must be 1..4, got ", bits);
  const auto [rows, row_bytes] = code_planes_shape(planes, bits, on);
  check_nonzero(nonzero, {rows, row_bytes}, false, on);
  check_tie(tie, on);
  at::Tensor out_sign = uint8_like(row_bytes, dev), out_nz = uint8_like(row_bytes, dev);
  const at::Tensor table = device_table(segments, dev);
  LC_CUDA_CHECK(lc_bbit_shard_vote(planes.data_ptr<uint8_t>(), nonzero ? nonzero->data_ptr<uint8_t>() : nullptr,
                                   static_cast<int>(rows), static_cast<int>(bits), row_bytes, static_cast<int>(tie),
                                   step, table.data_ptr<int64_t>(), table.size(0), out_sign.data_ptr<uint8_t>(),
                                   out_nz.data_ptr<uint8_t>(), at::cuda::getCurrentCUDAStream()),
                "bbit_shard_vote");
  return {out_sign, out_nz};
}

// ----------------------------------------------------------------------------- single-process step
void lion_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& momenta, double lr, double weight_decay, double beta1, double beta2) {
  if (params.empty() && grads.empty() && momenta.empty()) return;
  const at::Device dev = (params.empty() ? grads : params)[0].device();
  const On on = on_cuda(dev);
  check_pairs(params, "params", grads, "grads", on);
  check_pairs(params, "params", momenta, "momenta", on);
  const c10::cuda::CUDAGuard guard(dev);
  std::vector<std::array<int64_t, LC_META_WORDS>> rows;
  int64_t chunks = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string pn = arg_name("params", i), gn = arg_name("grads", i), mn = arg_name("momenta", i);
    check_tensor(params[i], pn, on);
    check_tensor(grads[i], gn, on);
    check_tensor(momenta[i], mn, on);
    const int64_t n = params[i].numel();
    const int64_t dt = float_code(params[i], pn, true, on) | (float_code(grads[i], gn, true, on) << 8) |
                       (static_cast<int64_t>(float_code(momenta[i], mn, true, on)) << 16);
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

static int32_t cuda_cast_code(const at::Tensor& t) { return float_code(t, "casts", true, on_cuda(t.device())); }

void zero_sign_apply(const at::Tensor& sign, const std::optional<at::Tensor>& nonzero,
                     const std::vector<at::Tensor>& targets, const std::vector<std::optional<at::Tensor>>& casts,
                     const at::Tensor& layout, const std::vector<double>& lrs, const std::vector<double>& wds) {
  const at::Device dev = sign.device();
  const On on = on_cuda(dev);
  const c10::cuda::CUDAGuard guard(dev);
  const auto [rows, row_bytes] = plane_shape(sign, "sign", false, on);
  const int64_t zb = zero_nonzero_bytes(nonzero, rows, row_bytes, on);
  check_zero_targets(targets, casts, on);
  static_assert(LC_CHUNK == kPieceChunk, "piece chunks are LC_CHUNK chunks");
  const auto pieces = zero_pieces(rows, 8 * std::min<int64_t>(row_bytes, zb), targets, casts, layout, lrs, wds,
                                  &cuda_cast_code);
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
  m.def("cuda_bbit_local_step", &bbit_local_step, "comm=bbit local step (CUDA, three launches)", py::arg("grads"),
        py::arg("momenta"), py::arg("offsets"), py::arg("total"), py::arg("beta1"), py::arg("beta2"),
        py::arg("update_momentum"), py::arg("kind"), py::arg("bits"), py::arg("rounding"), py::arg("seed"),
        py::arg("segments"));
  m.def("cuda_bbit_shard_vote", &bbit_shard_vote, "comm=bbit shard vote (CUDA)", py::arg("planes"),
        py::arg("nonzero"), py::arg("bits"), py::arg("step"), py::arg("tie"), py::arg("segments"));
  m.def("cuda_lion_step", &lion_step, "single-process Lion step (CUDA, one launch)", py::arg("params"),
        py::arg("grads"), py::arg("momenta"), py::arg("lr"), py::arg("weight_decay"), py::arg("beta1"),
        py::arg("beta2"));
  m.def("cuda_zero_sign_apply", &zero_sign_apply, "ZeRO sign all-gather apply (CUDA, one launch)", py::arg("sign"),
        py::arg("nonzero"), py::arg("targets"), py::arg("casts"), py::arg("layout"), py::arg("lrs"),
        py::arg("weight_decays"));
}

}  // namespace lioncub_cuda
