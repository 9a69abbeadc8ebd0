// lioncub_cpu_dispatch.cpp -- the public entry points of lioncub_cpu.h: each calls the AVX2 copy of
// its kernel (lioncub_cpu_local.cpp / lioncub_cpu_vote.cpp) when the CPU has AVX2, else the portable one.
#include "lioncub_cpu_detail.h"

// The per-ISA kernels, defined in lioncub_cpu_local.inl / lioncub_cpu_vote.inl.
#define LC_IMPL_DECLS                                                                                          \
  LocalStepCounts local_step_impl(const Slot* grads, const Slot* momenta, const Slot* momenta_out,                 \
                                  int64_t ntensors, int64_t total, double beta1, double beta2, bool update_momentum,\
                                  uint8_t* sign_out, uint8_t* nonzero_out, int nthreads);                           \
  void momentum_update_impl(const Slot* momenta, const Slot* grads, int64_t ntensors, double beta2, int nthreads);  \
  void vote_apply_impl(const uint8_t* sign, const uint8_t* nonzero, int64_t nplanes, int64_t plane_bytes,           \
                       const Slot* params, int64_t nparams, const ApplyArgs& args, float* delta_out, int nthreads); \
  void shard_vote_impl(const uint8_t* sign, const uint8_t* nonzero, int64_t nplanes, int64_t shard_bytes,           \
                       int64_t step, int32_t tie, const int64_t* tie_rows, int64_t tie_nrows, uint8_t* out_sign,    \
                       uint8_t* out_nonzero, int nthreads);                                                         \
  int64_t count_lanes_impl(const uint8_t* sign, const uint8_t* nonzero, int64_t nplanes, int64_t shard_bytes,       \
                           int p, uint8_t* plus_out, uint8_t* cnt_out, int nthreads);                               \
  void lanes_apply_impl(const uint8_t* plus, const uint8_t* cnt, int64_t lane_bytes, int p, const Slot* params,     \
                        int64_t nparams, const ApplyArgs& args, float* delta_out, int nthreads);                    \
  int64_t int8_local_step_impl(const Slot* grads, const Slot* momenta, int64_t ntensors, int64_t total,             \
                               double beta1, int32_t kind, int32_t levels, int8_t* q_out, int nthreads);            \
  void int8_apply_impl(const int8_t* qsum, int64_t numel, const Slot* params, int64_t nparams,                      \
                       const ApplyArgs& args, float* delta_out, int nthreads);                                      \
  void lion_step_impl(const Slot* params, const Slot* grads, const Slot* momenta, int64_t ntensors,                 \
                      const LionStepArgs& args, int nthreads);                                                      \
  void zero_sign_apply_impl(const uint8_t* sign, int64_t sign_stride, const uint8_t* nonzero, int64_t nz_stride,    \
                            const ::lc_zero_piece* pieces, int64_t npieces, int nthreads);                  \
  int64_t abstain_list_impl(const uint8_t* nonzero, const uint8_t* mask, int64_t nbytes, int64_t capacity,          \
                            int32_t* out);                                                                          \
  LocalStepCounts bbit_local_step_impl(const Slot* grads, const Slot* momenta, const Slot* momenta_out,             \
                                       int64_t ntensors, int64_t total, double beta1, double beta2,                 \
                                       bool update_momentum, const ::lc_bbit_args& bb, uint8_t* planes_out,         \
                                       uint8_t* nonzero_out, int nthreads);                                         \
  void bbit_shard_vote_impl(const uint8_t* planes, const uint8_t* nonzero, int64_t nplanes, int bits,               \
                            int64_t shard_bytes, int64_t step, int32_t tie, const int64_t* tie_rows,                \
                            int64_t tie_nrows, uint8_t* out_sign, uint8_t* out_nonzero, int nthreads);

namespace lioncub {
namespace cpu {
#if LIONCUB_X86
namespace isa_avx2 {
LC_IMPL_DECLS
}  // namespace isa_avx2
#endif
namespace isa_base {
LC_IMPL_DECLS
}  // namespace isa_base
}  // namespace cpu
}  // namespace lioncub
#undef LC_IMPL_DECLS

// ------------------------------------------------------------ public entry points (dispatch)
namespace lioncub {
namespace cpu {
namespace {
std::atomic<int> g_isa{0};

bool cpu_has_avx2() {
#if LIONCUB_X86
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

int initial_isa() {
  const char* e = std::getenv("LIONCUB_CPU_ISA");  // "base" forces the portable path
  if (e && (std::strcmp(e, "base") == 0 || std::strcmp(e, "baseline") == 0)) return 1;
  return 0;
}

bool use_avx2() {
  static const int env = initial_isa();
  int s = g_isa.load(std::memory_order_relaxed);
  if (s == 0) s = env;
  if (s == 1) return false;
  return cpu_has_avx2();
}
}  // namespace

#if LIONCUB_X86
#define LC_CALL(fn, ...) (use_avx2() ? isa_avx2::fn(__VA_ARGS__) : isa_base::fn(__VA_ARGS__))
#else
#define LC_CALL(fn, ...) (isa_base::fn(__VA_ARGS__))
#endif

void set_isa(int isa) { g_isa.store(isa, std::memory_order_relaxed); }
const char* isa_name() { return use_avx2() ? "avx2" : "baseline"; }

LocalStepCounts local_step(const Slot* grads, const Slot* momenta, const Slot* momenta_out, int64_t ntensors,
                           int64_t total, double beta1, double beta2, bool update_momentum, uint8_t* sign_out,
                           uint8_t* nonzero_out, int nthreads) {
  return LC_CALL(local_step_impl, grads, momenta, momenta_out, ntensors, total, beta1, beta2, update_momentum,
                 sign_out, nonzero_out, nthreads);
}

void momentum_update(const Slot* momenta, const Slot* grads, int64_t ntensors, double beta2, int nthreads) {
  LC_CALL(momentum_update_impl, momenta, grads, ntensors, beta2, nthreads);
}

void vote_apply(const uint8_t* sign, const uint8_t* nonzero, int64_t nplanes, int64_t plane_bytes,
                const Slot* params, int64_t nparams, const ApplyArgs& args, float* delta_out, int nthreads) {
  LC_CALL(vote_apply_impl, sign, nonzero, nplanes, plane_bytes, params, nparams, args, delta_out, nthreads);
}

void shard_vote(const uint8_t* sign, const uint8_t* nonzero, int64_t nplanes, int64_t shard_bytes, int64_t step,
                int32_t tie, const int64_t* tie_rows, int64_t tie_nrows, uint8_t* out_sign, uint8_t* out_nonzero,
                int nthreads) {
  LC_CALL(shard_vote_impl, sign, nonzero, nplanes, shard_bytes, step, tie, tie_rows, tie_nrows, out_sign,
          out_nonzero, nthreads);
}

int64_t count_lanes(const uint8_t* sign, const uint8_t* nonzero, int64_t nplanes, int64_t shard_bytes, int p,
                    uint8_t* plus_out, uint8_t* cnt_out, int nthreads) {
  return LC_CALL(count_lanes_impl, sign, nonzero, nplanes, shard_bytes, p, plus_out, cnt_out, nthreads);
}

void lanes_apply(const uint8_t* plus, const uint8_t* cnt, int64_t lane_bytes, int p, const Slot* params,
                 int64_t nparams, const ApplyArgs& args, float* delta_out, int nthreads) {
  LC_CALL(lanes_apply_impl, plus, cnt, lane_bytes, p, params, nparams, args, delta_out, nthreads);
}

int64_t int8_local_step(const Slot* grads, const Slot* momenta, int64_t ntensors, int64_t total, double beta1,
                        int32_t kind, int32_t levels, int8_t* q_out, int nthreads) {
  return LC_CALL(int8_local_step_impl, grads, momenta, ntensors, total, beta1, kind, levels, q_out, nthreads);
}

void int8_apply(const int8_t* qsum, int64_t numel, const Slot* params, int64_t nparams, const ApplyArgs& args,
                float* delta_out, int nthreads) {
  LC_CALL(int8_apply_impl, qsum, numel, params, nparams, args, delta_out, nthreads);
}

void lion_step(const Slot* params, const Slot* grads, const Slot* momenta, int64_t ntensors, const LionStepArgs& args,
               int nthreads) {
  LC_CALL(lion_step_impl, params, grads, momenta, ntensors, args, nthreads);
}

void zero_sign_apply(const uint8_t* sign, int64_t sign_stride, const uint8_t* nonzero, int64_t nz_stride,
                     const ::lc_zero_piece* pieces, int64_t npieces, int nthreads) {
  LC_CALL(zero_sign_apply_impl, sign, sign_stride, nonzero, nz_stride, pieces, npieces, nthreads);
}

int64_t abstain_list(const uint8_t* nonzero, const uint8_t* mask, int64_t nbytes, int64_t capacity, int32_t* out) {
  return LC_CALL(abstain_list_impl, nonzero, mask, nbytes, capacity, out);
}

LocalStepCounts bbit_local_step(const Slot* grads, const Slot* momenta, const Slot* momenta_out, int64_t ntensors,
                                int64_t total, double beta1, double beta2, bool update_momentum,
                                const ::lc_bbit_args& bb, uint8_t* planes_out, uint8_t* nonzero_out, int nthreads) {
  return LC_CALL(bbit_local_step_impl, grads, momenta, momenta_out, ntensors, total, beta1, beta2, update_momentum,
                 bb, planes_out, nonzero_out, nthreads);
}

void bbit_shard_vote(const uint8_t* planes, const uint8_t* nonzero, int64_t nplanes, int bits, int64_t shard_bytes,
                     int64_t step, int32_t tie, const int64_t* tie_rows, int64_t tie_nrows, uint8_t* out_sign,
                     uint8_t* out_nonzero, int nthreads) {
  LC_CALL(bbit_shard_vote_impl, planes, nonzero, nplanes, bits, shard_bytes, step, tie, tie_rows, tie_nrows, out_sign,
          out_nonzero, nthreads);
}

#undef LC_CALL

}  // namespace cpu
}  // namespace lioncub
