// bindings.cpp -- the one file that includes torch headers: the kernels as torch custom ops.
//
// Every op is declared once, in lioncub_ds/kernels/ops.py (its torch.library schema, its fake
// implementation and the argument checks). This file registers the implementations of those
// schemas: the CPU kernels of csrc/cpu (TORCH_LIBRARY_IMPL(lioncub, CPU)) and, built with
// LIONCUB_WITH_CUDA, the CUDA launchers of csrc/cuda (TORCH_LIBRARY_IMPL(lioncub, CUDA)). The
// same functions are also exposed to Python directly (eager_calls.h: the Python module, without the
// dispatcher's boxing; ops.py says when each is used).
//
// No argument errors are raised here: ops.py validates in Python and raises the errors a user sees
// (a C++ exception thrown through a JIT extension crashes the process on some images). What lives
// here are LC_INV invariants, checked before anything is written: they keep memory safe if an entry
// is called around ops.py (raw torch.ops), and they are the gate of the CPU's eager calls
// (eager_calls.h catches them and answers None: ops.py then runs its checks).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/lioncub_common.h"
#include "cpu/lioncub_cpu.h"
#ifdef LIONCUB_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/lioncub_cuda.h"
#endif

// LIONCUB_SRC_HASH: "h" + sha1 of the kernel sources, passed as a bare token by the build
// (lioncub_ds/kernels/loader.py, setup.py) so that no shell quoting is involved.
#define LIONCUB_STR2(x) #x
#define LIONCUB_STR(x) LIONCUB_STR2(x)
#ifdef LIONCUB_SRC_HASH
#define LIONCUB_SRC_HASH_STR LIONCUB_STR(LIONCUB_SRC_HASH)
#else
#define LIONCUB_SRC_HASH_STR ""
#endif

#define LC_INV(cond, what)                                                                                    \
  TORCH_CHECK(cond, "lioncub internal: ", what,                                                               \
              " (the kernels take arguments only through lioncub_ds/kernels/ops.py, which validates them)")

namespace lc = lioncub::cpu;

namespace {

using TL = at::TensorList;
using OptT = std::optional<at::Tensor>;

// The dtype code of the scalar contract (csrc/common: kF32, kBF16, kF16).
int32_t dtype_code(const at::Tensor& t, bool allow_f16) {
  const auto st = t.scalar_type();
  if (st == at::kFloat) return lcc::kF32;
  if (st == at::kBFloat16) return lcc::kBF16;
  LC_INV(allow_f16 && st == at::kHalf, "a tensor of an unsupported dtype");
  return lcc::kF16;
}

// The bucket offsets: an int64 CPU tensor of one entry per tensor (ops.Layout).
const int64_t* offsets_of(const at::Tensor& offsets, size_t n) {
  LC_INV(offsets.device().is_cpu() && offsets.scalar_type() == at::kLong && offsets.is_contiguous() &&
             static_cast<size_t>(offsets.numel()) == n,
         "offsets must be an int64 CPU tensor with one entry per tensor");
  return offsets.data_ptr<int64_t>();
}

void tensor_inv(const at::Tensor& t, const at::Device& dev) {
  LC_INV(t.defined() && t.layout() == at::kStrided && t.is_contiguous() &&
             (dev.is_cpu() ? t.device().is_cpu() : t.device() == dev),
         "a dense contiguous tensor on the call's device");
}

// Planes [N, B] (or [B]): (N, B).
std::pair<int64_t, int64_t> plane_inv(const at::Tensor& t, const at::Device& dev, int64_t max_rows = 65535) {
  tensor_inv(t, dev);
  LC_INV(t.scalar_type() == at::kByte && (t.dim() == 1 || t.dim() == 2), "uint8 planes [N, bytes]");
  const int64_t n = t.dim() == 2 ? t.size(0) : 1;
  LC_INV(n >= 1 && n <= max_rows, "1..65535 planes");
  return {n, t.size(-1)};
}

// dim: the dims the planes must have (0: either; the CPU passes its sign planes' dims).
const uint8_t* nonzero_inv(const OptT& nz, std::pair<int64_t, int64_t> shape, const at::Device& dev, int64_t dim = 0) {
  if (!nz.has_value()) return nullptr;
  LC_INV(plane_inv(*nz, dev) == shape && (dim == 0 || nz->dim() == dim), "nonzero planes of the sign planes' shape");
  return nz->data_ptr<uint8_t>();
}

// The tie-index table: int64 [K, 2] (pos, index) rows in the kernels' memory (ops.Layout keeps
// one copy per device, built once per bucket).
std::pair<const int64_t*, int64_t> tie_table(const at::Tensor& t, const at::Device& dev) {
  tensor_inv(t, dev);
  LC_INV(t.scalar_type() == at::kLong && t.dim() == 2 && t.size(1) == 2 && t.size(0) >= 1, "segments int64 [K, 2]");
  return {t.data_ptr<int64_t>(), t.size(0)};
}

lc_apply_args apply_args(double lr, double wd, int64_t step, int64_t tie, int64_t vote, int64_t world,
                         std::pair<const int64_t*, int64_t> tt) {
  LC_INV(tie >= 0 && tie <= 2 && (vote == 0 || vote == 1) && world >= 1 && world <= INT32_MAX, "vote codes");
  return lc_make_apply_args(lr, wd, step, static_cast<int32_t>(tie), static_cast<int32_t>(vote),
                            static_cast<int32_t>(world), tt.first, tt.second);
}

at::TensorOptions opts(at::ScalarType st, const at::Device& dev) { return at::TensorOptions().dtype(st).device(dev); }

// An apply's Δ (fp32 [numel]) or, without return_delta, an empty tensor (ops.py gives None).
at::Tensor delta_out(bool return_delta, int64_t numel, const at::Device& dev) {
  return at::empty({return_delta ? numel : 0}, opts(at::kFloat, dev));
}

// A zero_sign_apply cast: an empty tensor stands for "no cast" (a schema cannot hold Tensor?[] mutably).
bool has_cast(const at::Tensor& c) { return c.defined() && c.numel() > 0; }

// The pieces of a ZeRO sign all-gather apply: `layout` int64 [K, 5] rows (group, row, bit, start,
// numel) (reference.ZeroLayout.pieces), targets[g] fp32, casts[g] (or empty), one lr / weight decay
// per group. chunk_start counts LC_CHUNK chunks (CUDA only).
constexpr int64_t kPieceChunk = 16384;
std::vector<lc_zero_piece> zero_pieces(int64_t rows, int64_t row_bits, TL targets, TL casts, const at::Tensor& layout,
                                       at::ArrayRef<double> lrs, at::ArrayRef<double> wds) {
  const size_t ng = targets.size();
  LC_INV(casts.size() == ng && lrs.size() == ng && wds.size() == ng, "one cast, lr and weight decay per group");
  LC_INV(layout.device().is_cpu() && layout.scalar_type() == at::kLong && layout.dim() == 2 && layout.size(1) == 5 &&
             layout.is_contiguous(),
         "layout int64 [K, 5] on the CPU");
  std::vector<lc_zero_piece> out(static_cast<size_t>(layout.size(0)));
  const int64_t* L = layout.data_ptr<int64_t>();
  int64_t chunks = 0;
  for (size_t k = 0; k < out.size(); ++k) {
    const int64_t g = L[5 * k], row = L[5 * k + 1], bit = L[5 * k + 2], start = L[5 * k + 3], n = L[5 * k + 4];
    LC_INV(g >= 0 && g < static_cast<int64_t>(ng) && row >= 0 && row < rows && bit >= 0 && n >= 0 &&
               bit + n <= row_bits && start >= 0 && start + n <= targets[g].numel() &&
               targets[g].scalar_type() == at::kFloat &&
               (!has_cast(casts[g]) || casts[g].numel() == targets[g].numel()),
           "a layout row inside its planes and tensors");
    const lc_lion_step_args a = lc_make_lion_step_args(lrs[g], wds[g], 0.0, 0.0);
    lc_zero_piece& P = out[k];
    const at::Tensor& c = casts[g];
    P.target = reinterpret_cast<uint64_t>(targets[g].data_ptr<float>() + start);
    P.cast = has_cast(c) ? reinterpret_cast<uint64_t>(static_cast<char*>(c.data_ptr()) + start * c.element_size()) : 0;
    P.cast_dtype = has_cast(c) ? dtype_code(c, true) : 0;
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

// ================================================================================ CPU
namespace cpu {

const at::Device kDev(at::kCPU);
int threads() { return std::max(1, at::get_num_threads()); }
at::Tensor u8(int64_t n) { return at::empty({n}, opts(at::kByte, kDev)); }
at::Tensor zeroed(int64_t n, at::ScalarType st) {  // at::zeros without the fill's dispatch (~0.3 µs)
  at::Tensor t = at::empty({n}, opts(st, kDev));
  if (n) std::memset(t.data_ptr(), 0, static_cast<size_t>(t.nbytes()));
  return t;
}

// Tensors placed in a bucket of `total` elements at `offs` (nullptr: a plain list, no bucket),
// inside it and not overlapping.
using Slots = c10::SmallVector<lc::Slot, 16>;  // up to 16 tensors without a heap allocation (~0.1 µs)
Slots slots(TL ts, const int64_t* offs, int64_t total, bool allow_f16) {
  Slots out(ts.size());
  c10::SmallVector<std::pair<int64_t, int64_t>, 16> spans;
  for (size_t i = 0; i < ts.size(); ++i) {
    tensor_inv(ts[i], kDev);
    const int64_t off = offs ? offs[i] : 0, n = ts[i].numel();
    LC_INV(!offs || (off >= 0 && off % 8 == 0 && off + n <= total), "a tensor inside its bucket");
    out[i] = lc::Slot{ts[i].data_ptr(), n, off, dtype_code(ts[i], allow_f16)};
    if (offs && n) spans.emplace_back(off, off + n);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) LC_INV(spans[i].first >= spans[i - 1].second, "tensors apart in a bucket");
  return out;
}

// No output's memory overlaps another output's or an input's (ops.no_shared_memory).
void apart(TL outs, std::initializer_list<TL> ins) {
  std::vector<std::tuple<uintptr_t, uintptr_t, bool>> spans;
  auto add = [&](TL ts, bool out) {
    for (const auto& t : ts)
      if (t.numel()) {
        const auto a = reinterpret_cast<uintptr_t>(t.data_ptr());
        spans.emplace_back(a, a + static_cast<uintptr_t>(t.nbytes()), out);
      }
  };
  add(outs, true);
  for (TL ts : ins) add(ts, false);
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    LC_INV(!(std::get<0>(spans[i]) < std::get<1>(spans[i - 1]) && (std::get<2>(spans[i]) || std::get<2>(spans[i - 1]))),
           "outputs apart from each other and from the inputs");
}

void same_numels(TL a, TL b) {
  LC_INV(a.size() == b.size(), "paired lists of one length");
  for (size_t i = 0; i < a.size(); ++i) LC_INV(a[i].numel() == b[i].numel(), "paired tensors of one size");
}

// momenta_out (empty: none): one buffer per momentum, its dtype.
Slots out_slots(TL momenta_out, TL momenta, TL grads, const Slots& m, const int64_t* offs, int64_t total) {
  if (momenta_out.empty()) return {};
  apart(momenta_out, {momenta, grads});
  auto mo = slots(momenta_out, offs, total, false);
  LC_INV(mo.size() == m.size(), "one momenta_out per momentum");
  for (size_t i = 0; i < mo.size(); ++i) LC_INV(mo[i].dtype == m[i].dtype && mo[i].numel == m[i].numel, "momenta_out");
  return mo;
}

// An output of `n` elements of `st`, zeroed (the kernels write only their tensors' bytes): the eager
// path's reused workspace (ops.Layout) or a fresh tensor.
void zero_out(const at::Tensor& t, at::ScalarType st, int64_t n) {
  LC_INV(t.device().is_cpu() && t.scalar_type() == st && t.is_contiguous() && t.numel() == n, "an output buffer");
  if (n) std::memset(t.data_ptr(), 0, static_cast<size_t>(t.nbytes()));
}

void local_step_into(TL grads, TL momenta, TL momenta_out, const at::Tensor& offsets, int64_t total, double beta1,
                     double beta2, bool update_momentum, const at::Tensor& sign, const at::Tensor& nz,
                     const at::Tensor& counts) {
  LC_INV(total >= 0 && total % 8 == 0, "total");
  same_numels(grads, momenta);
  const int64_t* offs = offsets_of(offsets, grads.size());
  auto g = slots(grads, offs, total, true);
  auto m = slots(momenta, offs, total, false);
  const auto mo = out_slots(momenta_out, momenta, grads, m, offs, total);
  zero_out(sign, at::kByte, total / 8);
  zero_out(nz, at::kByte, total / 8);
  zero_out(counts, at::kLong, 2);
  const auto r = lc::local_step(g.data(), m.data(), mo.empty() ? nullptr : mo.data(), static_cast<int64_t>(g.size()),
                                total, beta1, beta2, update_momentum, sign.data_ptr<uint8_t>(),
                                nz.data_ptr<uint8_t>(), threads());
  counts.data_ptr<int64_t>()[0] = r.n_nonfinite;
  counts.data_ptr<int64_t>()[1] = r.n_zero;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> local_step(TL grads, TL momenta, TL momenta_out,
                                                          const at::Tensor& offsets, int64_t total, double beta1,
                                                          double beta2, bool update_momentum) {
  LC_INV(total >= 0 && total % 8 == 0, "total");
  at::Tensor sign = u8(total / 8), nz = u8(total / 8), counts = at::empty({2}, opts(at::kLong, kDev));
  local_step_into(grads, momenta, momenta_out, offsets, total, beta1, beta2, update_momentum, sign, nz, counts);
  return {sign, nz, counts};
}

at::Tensor abstain_list(const at::Tensor& nonzero, const at::Tensor& mask, int64_t capacity) {
  const auto a = plane_inv(nonzero, kDev), b = plane_inv(mask, kDev);
  LC_INV(nonzero.dim() == 1 && a == b && capacity >= 0 && capacity <= a.second && a.second <= INT32_MAX,
         "two 1-D planes of one size, capacity <= their bytes");
  at::Tensor out = at::empty({1 + 2 * capacity}, opts(at::kInt, kDev));
  lc::abstain_list(nonzero.data_ptr<uint8_t>(), mask.data_ptr<uint8_t>(), a.second, capacity, out.data_ptr<int32_t>());
  return out;
}

void momentum_update(TL momenta, TL grads, double beta2) {
  same_numels(momenta, grads);
  auto m = slots(momenta, nullptr, 0, false);
  auto g = slots(grads, nullptr, 0, true);
  lc::momentum_update(m.data(), g.data(), static_cast<int64_t>(m.size()), beta2, threads());
}

at::Tensor vote_apply(const at::Tensor& sign, const OptT& nonzero, TL params, const at::Tensor& offsets, double lr,
                      double weight_decay, int64_t step, int64_t tie, int64_t vote, int64_t world_size,
                      const at::Tensor& segments, bool return_delta) {
  const auto shape = plane_inv(sign, kDev);
  const uint8_t* nz = nonzero_inv(nonzero, shape, kDev, sign.dim());
  const int64_t numel = shape.second * 8;
  auto p = slots(params, offsets_of(offsets, params.size()), numel, false);
  const auto a = apply_args(lr, weight_decay, step, tie, vote, world_size, tie_table(segments, kDev));
  at::Tensor delta = delta_out(return_delta, numel, kDev);
  lc::vote_apply(sign.data_ptr<uint8_t>(), nz, shape.first, shape.second, p.data(), static_cast<int64_t>(p.size()), a,
                 return_delta ? delta.data_ptr<float>() : nullptr, threads());
  return delta;
}

std::tuple<at::Tensor, at::Tensor> shard_vote(const at::Tensor& sign, const OptT& nonzero, int64_t step, int64_t tie,
                                              const at::Tensor& segments) {
  const auto shape = plane_inv(sign, kDev);
  const uint8_t* nz = nonzero_inv(nonzero, shape, kDev, sign.dim());
  LC_INV(sign.dim() == 2 && tie >= 0 && tie <= 2, "2-D planes, tie code");
  const auto tt = tie_table(segments, kDev);
  at::Tensor out_sign = zeroed(shape.second, at::kByte);
  at::Tensor out_nz = zeroed(shape.second, at::kByte);
  lc::shard_vote(sign.data_ptr<uint8_t>(), nz, shape.first, shape.second, step, static_cast<int32_t>(tie), tt.first,
                 tt.second, out_sign.data_ptr<uint8_t>(), out_nz.data_ptr<uint8_t>(), threads());
  return {out_sign, out_nz};
}

// (plus, cnt (empty without nonzero), overflow: int32 [1] set when a count did not fit its lane,
// or [0] when none can: ops.count_lanes raises, never a C++ exception)
std::tuple<at::Tensor, at::Tensor, at::Tensor> count_lanes(const at::Tensor& sign, const OptT& nonzero, int64_t p) {
  const auto shape = plane_inv(sign, kDev);
  const uint8_t* nz = nonzero_inv(nonzero, shape, kDev, sign.dim());
  LC_INV(sign.dim() == 2 && (p == 1 || p == 2 || p == 4 || p == 8), "2-D planes, lane width");
  const int64_t s = shape.second, top = (int64_t{1} << p) - 1;
  at::Tensor plus = zeroed(s * p, at::kByte);
  at::Tensor cnt = zeroed(nz ? s * p : 0, at::kByte);
  const bool check = nz && shape.first > top && s > 0;
  at::Tensor overflow = zeroed(check ? 1 : 0, at::kInt);
  const int64_t mx = lc::count_lanes(sign.data_ptr<uint8_t>(), nz, shape.first, s, static_cast<int>(p),
                                     plus.data_ptr<uint8_t>(), nz ? cnt.data_ptr<uint8_t>() : nullptr, threads());
  if (check && mx > top) overflow.data_ptr<int32_t>()[0] = 1;
  return {plus, cnt, overflow};
}

at::Tensor lanes_apply(const at::Tensor& plus, const OptT& cnt, int64_t world_size, int64_t p, TL params,
                       const at::Tensor& offsets, double lr, double weight_decay, int64_t step, int64_t tie,
                       int64_t vote, const at::Tensor& segments, bool return_delta) {
  const auto shape = plane_inv(plus, kDev);
  LC_INV(plus.dim() == 1 && (p == 1 || p == 2 || p == 4 || p == 8), "1-D lanes, lane width");
  const uint8_t* c = nonzero_inv(cnt, shape, kDev, plus.dim());
  const int64_t numel = shape.second * 8 / p;
  auto prm = slots(params, offsets_of(offsets, params.size()), numel, false);
  const auto a = apply_args(lr, weight_decay, step, tie, vote, world_size, tie_table(segments, kDev));
  at::Tensor delta = delta_out(return_delta, numel, kDev);
  lc::lanes_apply(plus.data_ptr<uint8_t>(), c, shape.second, static_cast<int>(p), prm.data(),
                  static_cast<int64_t>(prm.size()), a, return_delta ? delta.data_ptr<float>() : nullptr, threads());
  return delta;
}

void int8_local_step_into(TL grads, TL momenta, const at::Tensor& offsets, int64_t total, double beta1, int64_t kind,
                          int64_t levels, const at::Tensor& q, const at::Tensor& n_bad) {
  LC_INV(total >= 0 && kind >= 0 && kind <= 2 && levels >= 1 && levels <= 127, "int8 codes");
  same_numels(grads, momenta);
  const int64_t* offs = offsets_of(offsets, grads.size());
  auto g = slots(grads, offs, total, true);
  auto m = slots(momenta, offs, total, false);
  zero_out(q, at::kChar, total);
  zero_out(n_bad, at::kLong, 1);
  n_bad.data_ptr<int64_t>()[0] =
      lc::int8_local_step(g.data(), m.data(), static_cast<int64_t>(g.size()), total, beta1, static_cast<int32_t>(kind),
                          static_cast<int32_t>(levels), q.data_ptr<int8_t>(), threads());
}

std::tuple<at::Tensor, at::Tensor> int8_local_step(TL grads, TL momenta, const at::Tensor& offsets, int64_t total,
                                                   double beta1, int64_t kind, int64_t levels) {
  LC_INV(total >= 0, "total");
  at::Tensor q = at::empty({total}, opts(at::kChar, kDev)), n_bad = at::empty({1}, opts(at::kLong, kDev));
  int8_local_step_into(grads, momenta, offsets, total, beta1, kind, levels, q, n_bad);
  return {q, n_bad};
}

at::Tensor int8_apply(const at::Tensor& qsum, TL params, const at::Tensor& offsets, double lr, double weight_decay,
                      bool return_delta) {
  tensor_inv(qsum, kDev);
  LC_INV(qsum.scalar_type() == at::kChar, "int8 qsum");
  const int64_t numel = qsum.numel();
  auto prm = slots(params, offsets_of(offsets, params.size()), numel, false);
  at::Tensor delta = delta_out(return_delta, numel, kDev);
  const lc::ApplyArgs a = lc_make_apply_args(lr, weight_decay, 0, 0, 0, 1, nullptr, 0);
  lc::int8_apply(qsum.data_ptr<int8_t>(), numel, prm.data(), static_cast<int64_t>(prm.size()), a,
                 return_delta ? delta.data_ptr<float>() : nullptr, threads());
  return delta;
}

void lion_step(TL params, TL grads, TL momenta, double lr, double weight_decay, double beta1, double beta2) {
  same_numels(params, grads);
  same_numels(params, momenta);
  auto p = slots(params, nullptr, 0, false);
  auto g = slots(grads, nullptr, 0, true);
  auto m = slots(momenta, nullptr, 0, false);
  lc::lion_step(p.data(), g.data(), m.data(), static_cast<int64_t>(p.size()),
                lc_make_lion_step_args(lr, weight_decay, beta1, beta2), threads());
}

void zero_sign_apply(const at::Tensor& sign, const OptT& nonzero, TL targets, TL casts, const at::Tensor& layout,
                     at::ArrayRef<double> lrs, at::ArrayRef<double> wds) {
  const auto shape = plane_inv(sign, kDev);
  LC_INV(sign.dim() == 2, "2-D sign planes");
  int64_t zb = shape.second;
  if (nonzero.has_value()) {
    const auto z = plane_inv(*nonzero, kDev);
    LC_INV(nonzero->dim() == 2 && z.first == shape.first, "nonzero rows");
    zb = z.second;
  }
  for (const auto& t : targets) tensor_inv(t, kDev);
  for (const auto& c : casts)
    if (has_cast(c)) tensor_inv(c, kDev);
  const auto pieces = zero_pieces(shape.first, 8 * std::min(shape.second, zb), targets, casts, layout, lrs, wds);
  lc::zero_sign_apply(sign.data_ptr<uint8_t>(), shape.second,
                      nonzero.has_value() ? nonzero->data_ptr<uint8_t>() : nullptr, zb, pieces.data(),
                      static_cast<int64_t>(pieces.size()), threads());
}

void bbit_local_step_into(TL grads, TL momenta, TL momenta_out, const at::Tensor& offsets, int64_t total, double beta1,
                          double beta2, bool update_momentum, int64_t kind, int64_t bits, int64_t rounding,
                          int64_t seed, const at::Tensor& segments, const at::Tensor& planes, const at::Tensor& nz,
                          const at::Tensor& counts) {
  LC_INV(total >= 0 && total % 8 == 0 && kind >= 0 && kind <= 2 && bits >= 1 && bits <= 4 &&
             (rounding == 0 || rounding == 1) && seed >= 0 && seed <= UINT32_MAX,
         "bbit codes");
  same_numels(grads, momenta);
  const int64_t* offs = offsets_of(offsets, grads.size());
  auto g = slots(grads, offs, total, true);
  auto m = slots(momenta, offs, total, false);
  const auto mo = out_slots(momenta_out, momenta, grads, m, offs, total);
  const auto tt = tie_table(segments, kDev);
  const lc_bbit_args bb{static_cast<int32_t>(bits), static_cast<int32_t>(rounding), static_cast<int32_t>(kind),
                        static_cast<uint32_t>(seed), tt.first, tt.second};
  zero_out(planes, at::kByte, bits * (total / 8));
  zero_out(nz, at::kByte, total / 8);
  zero_out(counts, at::kLong, 2);
  const auto r = lc::bbit_local_step(g.data(), m.data(), mo.empty() ? nullptr : mo.data(),
                                     static_cast<int64_t>(g.size()), total, beta1, beta2, update_momentum, bb,
                                     planes.data_ptr<uint8_t>(), nz.data_ptr<uint8_t>(), threads());
  counts.data_ptr<int64_t>()[0] = r.n_nonfinite;
  counts.data_ptr<int64_t>()[1] = r.n_zero;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bbit_local_step(TL grads, TL momenta, TL momenta_out,
                                                               const at::Tensor& offsets, int64_t total, double beta1,
                                                               double beta2, bool update_momentum, int64_t kind,
                                                               int64_t bits, int64_t rounding, int64_t seed,
                                                               const at::Tensor& segments) {
  LC_INV(total >= 0 && total % 8 == 0 && bits >= 1 && bits <= 4, "bbit codes");
  at::Tensor planes = at::empty({bits, total / 8}, opts(at::kByte, kDev));
  at::Tensor nz = u8(total / 8), counts = at::empty({2}, opts(at::kLong, kDev));
  bbit_local_step_into(grads, momenta, momenta_out, offsets, total, beta1, beta2, update_momentum, kind, bits, rounding,
                       seed, segments, planes, nz, counts);
  return {planes, nz, counts};
}

std::tuple<at::Tensor, at::Tensor> bbit_shard_vote(const at::Tensor& planes, const OptT& nonzero, int64_t bits,
                                                   int64_t step, int64_t tie, const at::Tensor& segments) {
  tensor_inv(planes, kDev);
  LC_INV(planes.scalar_type() == at::kByte && planes.dim() == 3 && planes.size(1) == bits && bits >= 1 && bits <= 4 &&
             planes.size(0) >= 1 && planes.size(0) <= 65535 && tie >= 0 && tie <= 2,
         "code planes uint8 [N, bits, bytes]");
  const std::pair<int64_t, int64_t> shape{planes.size(0), planes.size(2)};
  const uint8_t* nz = nonzero_inv(nonzero, shape, kDev, 2);
  const auto tt = tie_table(segments, kDev);
  at::Tensor out_sign = zeroed(shape.second, at::kByte);
  at::Tensor out_nz = zeroed(shape.second, at::kByte);
  lc::bbit_shard_vote(planes.data_ptr<uint8_t>(), nz, shape.first, static_cast<int>(bits), shape.second, step,
                      static_cast<int32_t>(tie), tt.first, tt.second, out_sign.data_ptr<uint8_t>(),
                      out_nz.data_ptr<uint8_t>(), threads());
  return {out_sign, out_nz};
}

}  // namespace cpu

// ================================================================================ CUDA
#ifdef LIONCUB_WITH_CUDA
namespace cuda {

static_assert(int{LC_FLOAT32} == int{lcc::kF32} && int{LC_BFLOAT16} == int{lcc::kBF16} &&
                  int{LC_FLOAT16} == int{lcc::kF16},
              "dtype codes (dtype_code)");
static_assert(LC_MAX_ROWS == 65535, "plane rows (plane_inv)");
static_assert(LC_CHUNK == kPieceChunk, "piece chunks are LC_CHUNK chunks");
static_assert(sizeof(lc_lion_meta) == LC_META_WORDS * 8, "lc_lion_meta layout");
static_assert(sizeof(lc_zero_piece) == 64, "lc_zero_piece layout");

// A launcher's error is a device fault, not an argument error: it is raised (as every CUDA error in torch).
#define LC_CUDA_CHECK(expr, what)                                                                          \
  do {                                                                                                     \
    const cudaError_t lc_err_ = (expr);                                                                    \
    TORCH_CHECK(lc_err_ == cudaSuccess, "lioncub_ds CUDA kernel ", what, " failed: ", cudaGetErrorString(lc_err_)); \
  } while (0)

cudaStream_t stream() { return at::cuda::getCurrentCUDAStream(); }

// Rows of int64 copied to the device through pinned memory without a host sync; the caching host
// allocator keeps the pinned block until the copy ran. Keep the result alive until the launch is queued.
template <class Row>
at::Tensor to_device(const std::vector<Row>& rows, const at::Device& dev) {
  const int64_t bytes = static_cast<int64_t>(rows.size() * sizeof(Row));
  at::Tensor host = at::empty({std::max<int64_t>(bytes, 8)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  if (bytes) std::memcpy(host.data_ptr<uint8_t>(), rows.data(), static_cast<size_t>(bytes));
  return host.to(dev, /*non_blocking=*/true);
}

// The device array of lc_tensor_meta of one multi-tensor launch.
struct Meta {
  at::Tensor dev;
  int n = 0;           // tensors with numel > 0
  int64_t chunks = 0;  // LC_CHUNK chunks in all
  const lc_tensor_meta* ptr() const { return n ? reinterpret_cast<const lc_tensor_meta*>(dev.data_ptr<uint8_t>()) : nullptr; }
};

// a: grads or params; b: momenta (same length) or empty; offs: bucket offsets (nullptr: a plain
// list, momentum update). Rows sorted by offset (ops.Layout checked they do not overlap).
Meta build_meta(TL a, TL b, const int64_t* offs, int64_t limit, const at::Device& dev) {
  LC_INV(b.empty() || a.size() == b.size(), "paired lists of one length");
  std::vector<std::array<int64_t, LC_META_WORDS>> rows;
  rows.reserve(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    tensor_inv(a[i], dev);
    int64_t dt = dtype_code(a[i], true);
    uint64_t bp = 0;
    if (!b.empty()) {
      tensor_inv(b[i], dev);
      LC_INV(b[i].numel() == a[i].numel(), "paired tensors of one size");
      dt |= static_cast<int64_t>(dtype_code(b[i], true)) << 8;
      bp = reinterpret_cast<uint64_t>(b[i].data_ptr());
    }
    const int64_t numel = a[i].numel(), off = offs ? offs[i] : 0;
    LC_INV(!offs || (off >= 0 && off % 8 == 0 && off + numel <= limit), "a tensor inside its bucket");
    if (numel == 0) continue;
    rows.push_back({static_cast<int64_t>(reinterpret_cast<uint64_t>(a[i].data_ptr())), static_cast<int64_t>(bp), off,
                    numel, 0, dt});
  }
  if (offs) std::stable_sort(rows.begin(), rows.end(), [](const auto& x, const auto& y) { return x[2] < y[2]; });
  Meta m;
  for (auto& r : rows) {
    r[4] = m.chunks;
    m.chunks += lc_num_chunks(r[3]);
  }
  m.n = static_cast<int>(rows.size());
  m.dev = to_device(rows, dev);
  return m;
}

at::Tensor u8(int64_t n, const at::Device& dev) { return at::empty({n}, opts(at::kByte, dev)); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> local_step(TL grads, TL momenta, TL momenta_out,
                                                          const at::Tensor& offsets, int64_t total, double beta1,
                                                          double beta2, bool update_momentum) {
  LC_INV(!grads.empty() && total >= 0 && total % 8 == 0, "a non-empty bucket");
  const at::Device dev = grads[0].device();
  const c10::cuda::CUDAGuard guard(dev);
  const int64_t* offs = offsets_of(offsets, grads.size());
  // momenta_out: no kernel with an output pointer yet: copy m, then the in-place step on the copy
  // (c from the copy's exact bits); 20 B/param like the in-place path (a fused variant moves 12).
  if (update_momentum && !momenta_out.empty()) {
    LC_INV(momenta_out.size() == momenta.size(), "one momenta_out per momentum");
    for (size_t i = 0; i < momenta.size(); ++i) momenta_out[i].copy_(momenta[i]);
  }
  TL m = update_momentum && !momenta_out.empty() ? momenta_out : momenta;
  const Meta meta = build_meta(grads, m, offs, total, dev);
  at::Tensor sign = u8(total / 8, dev), nonzero = u8(total / 8, dev);
  at::Tensor counts = at::zeros({2}, opts(at::kLong, dev));
  LC_CUDA_CHECK(lc_local_step(meta.ptr(), meta.n, total, lc_make_lion_args(beta1, beta2), update_momentum ? 1 : 0,
                              sign.data_ptr<uint8_t>(), nonzero.data_ptr<uint8_t>(), counts.data_ptr<int64_t>(),
                              stream()),
                "local_step");
  return {sign, nonzero, counts};  // counts: int64 [#non-finite c, #zero c] on the device
}

void momentum_update(TL momenta, TL grads, double beta2) {
  if (grads.empty()) return;
  const at::Device dev = grads[0].device();
  const c10::cuda::CUDAGuard guard(dev);
  const Meta meta = build_meta(grads, momenta, nullptr, 0, dev);
  LC_CUDA_CHECK(lc_momentum_update(meta.ptr(), meta.n, meta.chunks, lc_make_lion_args(0.0, beta2), stream()),
                "momentum_update");
}

at::Tensor vote_apply(const at::Tensor& sign, const OptT& nonzero, TL params, const at::Tensor& offsets, double lr,
                      double weight_decay, int64_t step, int64_t tie, int64_t vote, int64_t world_size,
                      const at::Tensor& segments, bool return_delta) {
  const at::Device dev = sign.device();
  const c10::cuda::CUDAGuard guard(dev);
  const auto shape = plane_inv(sign, dev);
  const uint8_t* nz = nonzero_inv(nonzero, shape, dev);
  const int64_t numel = shape.second * 8;
  const Meta meta = build_meta(params, {}, offsets_of(offsets, params.size()), numel, dev);
  at::Tensor delta = delta_out(return_delta, numel, dev);
  LC_CUDA_CHECK(lc_vote_apply(sign.data_ptr<uint8_t>(), nz, static_cast<int>(shape.first), shape.second, meta.ptr(),
                              meta.n, apply_args(lr, weight_decay, step, tie, vote, world_size, tie_table(segments, dev)),
                              return_delta ? delta.data_ptr<float>() : nullptr, stream()),
                "vote_apply");
  return delta;
}

std::tuple<at::Tensor, at::Tensor> shard_vote(const at::Tensor& sign, const OptT& nonzero, int64_t step, int64_t tie,
                                              const at::Tensor& segments) {
  const at::Device dev = sign.device();
  const c10::cuda::CUDAGuard guard(dev);
  const auto shape = plane_inv(sign, dev);
  const uint8_t* nz = nonzero_inv(nonzero, shape, dev);
  LC_INV(tie >= 0 && tie <= 2, "tie code");
  const auto tt = tie_table(segments, dev);
  at::Tensor out_sign = u8(shape.second, dev), out_nz = u8(shape.second, dev);
  LC_CUDA_CHECK(lc_shard_vote(sign.data_ptr<uint8_t>(), nz, static_cast<int>(shape.first), shape.second,
                              static_cast<int>(tie), step, tt.first, tt.second, out_sign.data_ptr<uint8_t>(),
                              out_nz.data_ptr<uint8_t>(), stream()),
                "shard_vote");
  return {out_sign, out_nz};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> count_lanes(const at::Tensor& sign, const OptT& nonzero, int64_t p) {
  const at::Device dev = sign.device();
  const c10::cuda::CUDAGuard guard(dev);
  const auto shape = plane_inv(sign, dev, 255);
  const uint8_t* nz = nonzero_inv(nonzero, shape, dev);
  LC_INV(p == 1 || p == 2 || p == 4 || p == 8, "lane width");
  const int64_t s = shape.second, top = (int64_t{1} << p) - 1;
  LC_INV(nz || s == 0 || shape.first <= top, "counts that fit their lanes");
  at::Tensor plus = u8(s * p, dev), cnt = u8(nz ? s * p : 0, dev);
  const bool check = nz && shape.first > top && s > 0;  // only then can a lane overflow
  at::Tensor overflow = at::zeros({check ? 1 : 0}, opts(at::kInt, dev));
  LC_CUDA_CHECK(lc_count_lanes(sign.data_ptr<uint8_t>(), nz, static_cast<int>(shape.first), s, static_cast<int>(p),
                               plus.data_ptr<uint8_t>(), nz ? cnt.data_ptr<uint8_t>() : nullptr,
                               check ? overflow.data_ptr<int32_t>() : nullptr, stream()),
                "count_lanes");
  return {plus, cnt, overflow};
}

at::Tensor lanes_apply(const at::Tensor& plus, const OptT& cnt, int64_t world_size, int64_t p, TL params,
                       const at::Tensor& offsets, double lr, double weight_decay, int64_t step, int64_t tie,
                       int64_t vote, const at::Tensor& segments, bool return_delta) {
  const at::Device dev = plus.device();
  const c10::cuda::CUDAGuard guard(dev);
  const auto shape = plane_inv(plus, dev);
  LC_INV(plus.dim() == 1 && (p == 1 || p == 2 || p == 4 || p == 8), "1-D lanes, lane width");
  const uint8_t* c = nonzero_inv(cnt, shape, dev);
  const int64_t numel = shape.second * 8 / p;
  const Meta meta = build_meta(params, {}, offsets_of(offsets, params.size()), numel, dev);
  at::Tensor delta = delta_out(return_delta, numel, dev);
  LC_CUDA_CHECK(lc_lanes_apply(plus.data_ptr<uint8_t>(), c, numel, static_cast<int>(p), meta.ptr(), meta.n,
                               apply_args(lr, weight_decay, step, tie, vote, world_size, tie_table(segments, dev)),
                               return_delta ? delta.data_ptr<float>() : nullptr, stream()),
                "lanes_apply");
  return delta;
}

std::tuple<at::Tensor, at::Tensor> int8_local_step(TL grads, TL momenta, const at::Tensor& offsets, int64_t total,
                                                   double beta1, int64_t kind, int64_t levels) {
  LC_INV(!grads.empty() && total >= 0 && total % 8 == 0 && kind >= 0 && kind <= 2 && levels >= 1 && levels <= 127,
         "int8 codes of a non-empty bucket");
  const at::Device dev = grads[0].device();
  const c10::cuda::CUDAGuard guard(dev);
  const Meta meta = build_meta(grads, momenta, offsets_of(offsets, grads.size()), total, dev);
  at::Tensor q = at::empty({total}, opts(at::kChar, dev));
  at::Tensor scales = at::empty({std::max(meta.n, 1)}, opts(at::kFloat, dev));
  at::Tensor n_bad = at::zeros({1}, opts(at::kLong, dev));
  const size_t ws_bytes = lc_int8_workspace_bytes(meta.chunks);
  at::Tensor ws = u8(static_cast<int64_t>(std::max<size_t>(ws_bytes, 8)), dev);
  LC_CUDA_CHECK(lc_int8_local_step(meta.ptr(), meta.n, meta.chunks, total, lc_make_lion_args(beta1, 0.0),
                                   static_cast<int>(kind), static_cast<int>(levels), q.data_ptr<int8_t>(),
                                   scales.data_ptr<float>(), ws.data_ptr(), ws_bytes, n_bad.data_ptr<int64_t>(),
                                   stream()),
                "int8_local_step");
  return {q, n_bad};
}

at::Tensor int8_apply(const at::Tensor& qsum, TL params, const at::Tensor& offsets, double lr, double weight_decay,
                      bool return_delta) {
  const at::Device dev = qsum.device();
  const c10::cuda::CUDAGuard guard(dev);
  tensor_inv(qsum, dev);
  LC_INV(qsum.scalar_type() == at::kChar, "int8 qsum");
  const int64_t numel = qsum.numel();
  const Meta meta = build_meta(params, {}, offsets_of(offsets, params.size()), numel, dev);
  at::Tensor delta = delta_out(return_delta, numel, dev);
  LC_CUDA_CHECK(lc_int8_apply(qsum.data_ptr<int8_t>(), numel, meta.ptr(), meta.n,
                              lc_make_apply_args(lr, weight_decay, 0, 0, 0, 1, nullptr, 0),
                              return_delta ? delta.data_ptr<float>() : nullptr, stream()),
                "int8_apply");
  return delta;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bbit_local_step(TL grads, TL momenta, TL momenta_out,
                                                               const at::Tensor& offsets, int64_t total, double beta1,
                                                               double beta2, bool update_momentum, int64_t kind,
                                                               int64_t bits, int64_t rounding, int64_t seed,
                                                               const at::Tensor& segments) {
  LC_INV(!grads.empty() && total >= 0 && total % 8 == 0 && kind >= 0 && kind <= 2 && bits >= 1 && bits <= 4 &&
             (rounding == 0 || rounding == 1) && seed >= 0 && seed <= UINT32_MAX,
         "bbit codes of a non-empty bucket");
  const at::Device dev = grads[0].device();
  const c10::cuda::CUDAGuard guard(dev);
  if (update_momentum && !momenta_out.empty()) {  // as local_step: the in-place step on copies of m
    LC_INV(momenta_out.size() == momenta.size(), "one momenta_out per momentum");
    for (size_t i = 0; i < momenta.size(); ++i) momenta_out[i].copy_(momenta[i]);
  }
  TL m = update_momentum && !momenta_out.empty() ? momenta_out : momenta;
  const Meta meta = build_meta(grads, m, offsets_of(offsets, grads.size()), total, dev);
  const auto tt = tie_table(segments, dev);
  at::Tensor planes = at::empty({bits, total / 8}, opts(at::kByte, dev));
  at::Tensor nonzero = u8(total / 8, dev);
  at::Tensor ratios = at::empty({std::max(meta.n, 1)}, opts(at::kFloat, dev));
  at::Tensor counts = at::zeros({2}, opts(at::kLong, dev));
  const size_t ws_bytes = lc_int8_workspace_bytes(meta.chunks);
  at::Tensor ws = u8(static_cast<int64_t>(std::max<size_t>(ws_bytes, 8)), dev);
  const lc_bbit_args bb{static_cast<int32_t>(bits), static_cast<int32_t>(rounding), static_cast<int32_t>(kind),
                        static_cast<uint32_t>(seed), tt.first, tt.second};
  LC_CUDA_CHECK(lc_bbit_local_step(meta.ptr(), meta.n, meta.chunks, total, lc_make_lion_args(beta1, beta2), bb,
                                   update_momentum ? 1 : 0, planes.data_ptr<uint8_t>(), nonzero.data_ptr<uint8_t>(),
                                   ratios.data_ptr<float>(), ws.data_ptr(), ws_bytes, counts.data_ptr<int64_t>(),
                                   stream()),
                "bbit_local_step");
  return {planes, nonzero, counts};
}

std::tuple<at::Tensor, at::Tensor> bbit_shard_vote(const at::Tensor& planes, const OptT& nonzero, int64_t bits,
                                                   int64_t step, int64_t tie, const at::Tensor& segments) {
  const at::Device dev = planes.device();
  const c10::cuda::CUDAGuard guard(dev);
  tensor_inv(planes, dev);
  LC_INV(planes.scalar_type() == at::kByte && planes.dim() == 3 && planes.size(1) == bits && bits >= 1 && bits <= 4 &&
             planes.size(0) >= 1 && planes.size(0) <= LC_MAX_ROWS && tie >= 0 && tie <= 2,
         "code planes uint8 [N, bits, bytes]");
  const std::pair<int64_t, int64_t> shape{planes.size(0), planes.size(2)};
  const uint8_t* nz = nonzero_inv(nonzero, shape, dev);
  const auto tt = tie_table(segments, dev);
  at::Tensor out_sign = u8(shape.second, dev), out_nz = u8(shape.second, dev);
  LC_CUDA_CHECK(lc_bbit_shard_vote(planes.data_ptr<uint8_t>(), nz, static_cast<int>(shape.first),
                                   static_cast<int>(bits), shape.second, static_cast<int>(tie), step, tt.first,
                                   tt.second, out_sign.data_ptr<uint8_t>(), out_nz.data_ptr<uint8_t>(), stream()),
                "bbit_shard_vote");
  return {out_sign, out_nz};
}

void lion_step(TL params, TL grads, TL momenta, double lr, double weight_decay, double beta1, double beta2) {
  if (params.empty()) return;
  LC_INV(params.size() == grads.size() && params.size() == momenta.size(), "paired lists of one length");
  const at::Device dev = params[0].device();
  const c10::cuda::CUDAGuard guard(dev);
  std::vector<std::array<int64_t, LC_META_WORDS>> rows;
  int64_t chunks = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    tensor_inv(params[i], dev);
    tensor_inv(grads[i], dev);
    tensor_inv(momenta[i], dev);
    const int64_t n = params[i].numel();
    LC_INV(grads[i].numel() == n && momenta[i].numel() == n, "paired tensors of one size");
    const int64_t dt = dtype_code(params[i], true) | (dtype_code(grads[i], true) << 8) |
                       (static_cast<int64_t>(dtype_code(momenta[i], true)) << 16);
    if (n == 0) continue;
    rows.push_back({static_cast<int64_t>(reinterpret_cast<uint64_t>(params[i].data_ptr())),
                    static_cast<int64_t>(reinterpret_cast<uint64_t>(grads[i].data_ptr())),
                    static_cast<int64_t>(reinterpret_cast<uint64_t>(momenta[i].data_ptr())), n, chunks, dt});
    chunks += lc_num_chunks(n);
  }
  if (rows.empty()) return;
  const at::Tensor meta = to_device(rows, dev);
  LC_CUDA_CHECK(lc_lion_step(reinterpret_cast<const lc_lion_meta*>(meta.data_ptr<uint8_t>()),
                             static_cast<int>(rows.size()), chunks,
                             lc_make_lion_step_args(lr, weight_decay, beta1, beta2), stream()),
                "lion_step");
}

void zero_sign_apply(const at::Tensor& sign, const OptT& nonzero, TL targets, TL casts, const at::Tensor& layout,
                     at::ArrayRef<double> lrs, at::ArrayRef<double> wds) {
  const at::Device dev = sign.device();
  const c10::cuda::CUDAGuard guard(dev);
  const auto shape = plane_inv(sign, dev);
  LC_INV(sign.dim() == 2, "2-D sign planes");
  int64_t zb = shape.second;
  if (nonzero.has_value()) {
    const auto z = plane_inv(*nonzero, dev);
    LC_INV(nonzero->dim() == 2 && z.first == shape.first, "nonzero rows");
    zb = z.second;
  }
  for (const auto& t : targets) tensor_inv(t, dev);
  for (const auto& c : casts)
    if (has_cast(c)) tensor_inv(c, dev);
  const auto pieces = zero_pieces(shape.first, 8 * std::min(shape.second, zb), targets, casts, layout, lrs, wds);
  if (pieces.empty()) return;
  const int64_t chunks = pieces.back().chunk_start + lc_num_chunks(pieces.back().numel);
  const at::Tensor dpieces = to_device(pieces, dev);
  LC_CUDA_CHECK(lc_zero_sign_apply(sign.data_ptr<uint8_t>(), shape.second,
                                   nonzero.has_value() ? nonzero->data_ptr<uint8_t>() : nullptr, zb,
                                   reinterpret_cast<const lc_zero_piece*>(dpieces.data_ptr<uint8_t>()),
                                   static_cast<int>(pieces.size()), chunks, stream()),
                "zero_sign_apply");
}

}  // namespace cuda
#endif  // LIONCUB_WITH_CUDA

}  // namespace

// The op list, once: X(name) for every op with a CPU and a CUDA implementation (abstain_list has a
// CPU kernel only; on CUDA ops.py registers the reference's torch ops, asynchronous already).
#define LIONCUB_OPS(X) \
  X(local_step) X(momentum_update) X(vote_apply) X(shard_vote) X(count_lanes) X(lanes_apply) X(int8_local_step) \
  X(int8_apply) X(lion_step) X(zero_sign_apply) X(bbit_local_step) X(bbit_shard_vote)

// The C++ build registers the CPU implementations; the CUDA build (which also holds the CPU kernel
// sources, for set_isa) only the CUDA ones, so a process that loads both never registers one twice.
#ifndef LIONCUB_WITH_CUDA
TORCH_LIBRARY_IMPL(lioncub, CPU, m) {
#define LIONCUB_IMPL_CPU(name) m.impl(#name, &cpu::name);
  LIONCUB_OPS(LIONCUB_IMPL_CPU)
  m.impl("abstain_list", &cpu::abstain_list);
}
#else
TORCH_LIBRARY_IMPL(lioncub, CUDA, m) {
#define LIONCUB_IMPL_CUDA(name) m.impl(#name, &cuda::name);
  LIONCUB_OPS(LIONCUB_IMPL_CUDA)
}
#endif

#include "eager_calls.h"  // the Python module: the same functions without the dispatcher
