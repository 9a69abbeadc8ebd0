// lioncub_cpu_local.inl -- kernel body of the local half: (a) local step, (b) momentum update,
// (g) int8 codes, (i) the single-process Lion step, (k) the abstention list, (l) the bbit local step.
// Compiled once per ISA (lioncub_cpu_isa_instantiate.h); see lioncub_cpu.h.

namespace {

// ------------------------------------------------------------------ (a) local step
// The 64 elements at i0 of one tensor (n <= 64 of them; the rest of c is 0): c = fl(fl(b1*m) +
// fl(ob1*g)), and with UPD the new momentum fl(fl(b2*m) + fl(ob2*g)) stored into `mo` (m itself, or a
// second buffer: m is then only read).
template <int GT, int MT, bool UPD>
inline void c_and_momentum64(const void* g, const void* m, void* mo, int64_t i0, int n, const Coef& k, float* c) {
  alignas(64) float gf[64], mf[64], mn[64];
  const float* gs = gf;
  const float* ms = mf;
  if (n == 64) {
    // fp32 is read in place; other dtypes are widened into the staging arrays first
    if constexpr (GT == kF32) gs = static_cast<const float*>(g) + i0;
    else load64<GT>(g, i0, gf);
    if constexpr (MT == kF32) ms = static_cast<const float*>(m) + i0;
    else load64<MT>(m, i0, mf);
  } else {
    for (int j = 0; j < n; ++j) {
      gf[j] = ld<GT>(g, i0 + j);
      mf[j] = ld<MT>(m, i0 + j);
    }
    for (int j = n; j < 64; ++j) gf[j] = mf[j] = 0.0f;
  }
  for (int j = 0; j < 64; ++j) c[j] = ms[j] * k.b1 + gs[j] * k.ob1;
  if constexpr (UPD) {
    for (int j = 0; j < 64; ++j) mn[j] = ms[j] * k.b2 + gs[j] * k.ob2;
    if (n == 64) {
      if constexpr (MT == kF32) {
        std::memcpy(static_cast<float*>(mo) + i0, mn, sizeof(mn));
      } else {
        uint16_t* mp = static_cast<uint16_t*>(mo) + i0;
        for (int j = 0; j < 64; ++j) mp[j] = f32_to_bf16(mn[j]);
      }
    } else {
      for (int j = 0; j < n; ++j) st<MT>(mo, i0 + j, mn[j]);
    }
  }
}

template <int GT, int MT, bool UPD>
void ls_range(const void* g, const void* m, void* mo, int64_t e0, int64_t e1, const Coef& k, uint8_t* sbytes,
              uint8_t* zbytes, int64_t& n_nonfinite, int64_t& n_zero) {
  alignas(64) float c[64];
  int64_t nf = 0, nzc = 0;
  for (int64_t i0 = e0; i0 < e1; i0 += 64) {
    const int n = static_cast<int>(std::min<int64_t>(64, e1 - i0));
    c_and_momentum64<GT, MT, UPD>(g, m, mo, i0, n, k, c);
    uint64_t s, z, f, e;
    masks64(c, s, z, f, e);
    const uint64_t valid = n == 64 ? ~uint64_t(0) : ((uint64_t(1) << n) - 1);
    nf += popcount64(~f & valid);
    nzc += popcount64(e & valid);
    const int64_t byte0 = (i0 - e0) >> 3;
    const int nbytes = (n + 7) >> 3;
    store_bits(sbytes + byte0, s & valid, nbytes);
    store_bits(zbytes + byte0, z & valid, nbytes);
  }
  n_nonfinite += nf;
  n_zero += nzc;
}

template <int GT, int MT>
void mom_range(const void* g, void* m, int64_t e0, int64_t e1, float b2, float ob2) {
  alignas(64) float gf[64], mf[64], mn[64];
  for (int64_t i0 = e0; i0 < e1; i0 += 64) {
    const int n = static_cast<int>(std::min<int64_t>(64, e1 - i0));
    if (n == 64) {
      load64<GT>(g, i0, gf);
      load64<MT>(m, i0, mf);
      for (int j = 0; j < 64; ++j) mn[j] = mf[j] * b2 + gf[j] * ob2;
      if constexpr (MT == kF32) {
        std::memcpy(static_cast<float*>(m) + i0, mn, sizeof(mn));
      } else {
        uint16_t* mp = static_cast<uint16_t*>(m) + i0;
        for (int j = 0; j < 64; ++j) mp[j] = f32_to_bf16(mn[j]);
      }
    } else {
      for (int j = 0; j < n; ++j) {
        const float v = ld<MT>(m, i0 + j) * b2 + ld<GT>(g, i0 + j) * ob2;
        st<MT>(m, i0 + j, v);
      }
    }
  }
}

#define LC_GM_SWITCH(gt, mt, CALL)                                  \
  do {                                                              \
    const int lc_key_ = (gt) * 4 + (mt);                            \
    if (lc_key_ == kF32 * 4 + kF32) { CALL(kF32, kF32); }           \
    else if (lc_key_ == kF32 * 4 + kBF16) { CALL(kF32, kBF16); }    \
    else if (lc_key_ == kBF16 * 4 + kF32) { CALL(kBF16, kF32); }    \
    else if (lc_key_ == kBF16 * 4 + kBF16) { CALL(kBF16, kBF16); }  \
    else if (lc_key_ == kF16 * 4 + kF32) { CALL(kF16, kF32); }      \
    else if (lc_key_ == kF16 * 4 + kBF16) { CALL(kF16, kBF16); }    \
  } while (0)

struct Item {
  int64_t t, e0, e1;
};

std::vector<Item> chunk_items(const Slot* slots, int64_t ntensors, int64_t chunk, int64_t* work) {
  std::vector<Item> items;
  items.reserve(static_cast<size_t>(ntensors));  // one allocation for a bucket of small tensors
  int64_t w = 0;
  for (int64_t t = 0; t < ntensors; ++t) {
    const int64_t n = slots[t].numel;
    for (int64_t e0 = 0; e0 < n; e0 += chunk) items.push_back({t, e0, std::min(n, e0 + chunk)});
    w += n;
  }
  if (work) *work = w;
  return items;
}

}  // namespace


LocalStepCounts local_step_impl(const Slot* grads, const Slot* momenta, const Slot* momenta_out, int64_t ntensors,
                                int64_t total, double beta1, double beta2, bool update_momentum, uint8_t* sign_out,
                                uint8_t* nonzero_out, int nthreads) {
  (void)total;
  const Coef k{static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
               static_cast<float>(1.0 - beta2)};
  int64_t work = 0;
  const std::vector<Item> items = chunk_items(momenta, ntensors, kChunk, &work);
  std::vector<int64_t> nf(items.size(), 0), nz(items.size(), 0);
  parallel_for_dynamic(static_cast<int64_t>(items.size()), threads_for(work, nthreads), [&](int64_t it) {
    const Item& I = items[it];
    const Slot& g = grads[I.t];
    const Slot& m = momenta[I.t];
    void* mo = momenta_out ? momenta_out[I.t].data : m.data;
    const int64_t byte0 = (m.offset + I.e0) >> 3;
#define LC_LS(G, M)                                                                                          \
  if (update_momentum)                                                                                       \
    ls_range<G, M, true>(g.data, m.data, mo, I.e0, I.e1, k, sign_out + byte0, nonzero_out + byte0, nf[it],  \
                         nz[it]);                                                                            \
  else                                                                                                       \
    ls_range<G, M, false>(g.data, m.data, mo, I.e0, I.e1, k, sign_out + byte0, nonzero_out + byte0, nf[it], \
                          nz[it]);
    LC_GM_SWITCH(g.dtype, m.dtype, LC_LS);
#undef LC_LS
  });
  LocalStepCounts out{0, 0};
  for (size_t i = 0; i < items.size(); ++i) {
    out.n_nonfinite += nf[i];
    out.n_zero += nz[i];
  }
  return out;
}

void momentum_update_impl(const Slot* momenta, const Slot* grads, int64_t ntensors, double beta2, int nthreads) {
  const float b2 = static_cast<float>(beta2), ob2 = static_cast<float>(1.0 - beta2);
  int64_t work = 0;
  const std::vector<Item> items = chunk_items(momenta, ntensors, kChunk, &work);
  parallel_for_dynamic(static_cast<int64_t>(items.size()), threads_for(work, nthreads), [&](int64_t it) {
    const Item& I = items[it];
    const Slot& g = grads[I.t];
    const Slot& m = momenta[I.t];
#define LC_MU(G, M) mom_range<G, M>(g.data, m.data, I.e0, I.e1, b2, ob2);
    LC_GM_SWITCH(g.dtype, m.dtype, LC_MU);
#undef LC_MU
  });
}

// ------------------------------------------------------------------ (g) int8_local_step
namespace {

// c of elements [i0, i0+n) of one tensor with non-finite -> 0; returns #non-finite. out: |c| or c.
template <int GT, int MT, bool ABS>
inline int64_t c_block(const void* g, const void* m, int64_t i0, int64_t n, float b1, float ob1, float* out) {
  int64_t bad = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float c = ld<MT>(m, i0 + j) * b1 + ld<GT>(g, i0 + j) * ob1;
    const uint32_t u = f2u(c);
    const bool fin = (u & 0x7F800000u) != 0x7F800000u;
    bad += fin ? 0 : 1;
    const float v = ABS ? u2f(u & 0x7FFFFFFFu) : c;
    out[j] = fin ? v : 0.0f;
  }
  return bad;
}

// Partial statistics of one block of kSumBlock elements of one tensor (lcc: the defined order).
struct SumAcc {
  double s = 0.0;    // l1: ordered sum of |c| over the block; l0: of log(m); linf: max |c|
  int64_t nnz = 0;   // l0: #nonzero |c|
  int64_t esum = 0;  // l0: sum of the exponents e (exact)
  int64_t bad = 0;   // #non-finite c
};

// lcc::lane_tree when the lanes past `live` hold +0.0: the same result without adding them. x + (+0.0)
// == x unless x is -0.0, and no lane is ever -0.0: each starts at +0.0, and a round-to-nearest sum is
// -0.0 only when both of its terms are.
inline double live_lane_tree(double* acc, int live) {
  for (int s = kSumLanes / 2; s > 0; s >>= 1) {
    for (int l = 0; l + s < live && l < s; ++l) acc[l] = dadd(acc[l], acc[l + s]);
    live = std::min(live, s);
  }
  return live > 0 ? acc[0] : 0.0;
}

template <int GT, int MT>
struct Int8Tensor {
  // The block [b, e) (b a multiple of kSumBlock): lane l adds elements b + l + 256k in index order.
  static SumAcc block(const Slot& g, const Slot& m, int64_t b, int64_t e, float b1, float ob1, int kind) {
    alignas(64) float tmp[512];
    alignas(64) double acc[kSumLanes];
    // lanes at or past `live` would stay +0.0: neither zeroed nor added, so a small tensor does not pay
    // the 256 lanes (live_lane_tree)
    const int live = static_cast<int>(std::min<int64_t>(e - b, kSumLanes));
    for (int l = 0; l < live; ++l) acc[l] = 0.0;
    SumAcc r;
    float mx = 0.0f;
    for (int64_t i = b; i < e; i += 512) {  // i - b is a multiple of 512: element i + j is in lane j & 255
      const int64_t n = std::min<int64_t>(512, e - i);
      r.bad += c_block<GT, MT, true>(g.data, m.data, i, n, b1, ob1, tmp);
      if (kind == kScaleL1) {
        const int64_t n0 = std::min<int64_t>(n, kSumLanes);
        for (int64_t j = 0; j < n0; ++j) acc[j] += static_cast<double>(tmp[j]);
        for (int64_t j = kSumLanes; j < n; ++j) acc[j - kSumLanes] += static_cast<double>(tmp[j]);
      } else if (kind == kScaleL0) {
        for (int64_t j = 0; j < n; ++j) {
          if (tmp[j] > 0.0f) {
            double lm;
            r.esum += log_parts(tmp[j], &lm);
            r.nnz += 1;
            acc[j & (kSumLanes - 1)] += lm;
          }
        }
      } else {
        for (int64_t j = 0; j < n; ++j) mx = tmp[j] > mx ? tmp[j] : mx;
      }
    }
    r.s = kind == kScaleLinf ? static_cast<double>(mx) : live_lane_tree(acc, live);
    return r;
  }
  static void quantize(const Slot& g, const Slot& m, int64_t b, int64_t e, float b1, float ob1, float hs,
                       float scale, float lv, int8_t* q) {
    alignas(64) float tmp[512];
    const float magic = 12582912.0f;  // 1.5 * 2^23: (v + magic) - magic rounds |v| < 2^22 half-to-even
    for (int64_t i = b; i < e; i += 512) {
      const int64_t n = std::min<int64_t>(512, e - i);
      c_block<GT, MT, false>(g.data, m.data, i, n, b1, ob1, tmp);
      for (int64_t j = 0; j < n; ++j) {
        float v = (tmp[j] * hs) / scale;
        v = v < lv ? v : lv;  // clamp first (|v| <= s keeps the magic rounding exact); v is never NaN
        v = v > -lv ? v : -lv;
        const float r = (v + magic) - magic;
        q[i + j] = static_cast<int8_t>(static_cast<int32_t>(r));
      }
    }
  }
};

#define LC_INT8(G, M, BODY)                  \
  do {                                       \
    using K = Int8Tensor<G, M>;              \
    BODY;                                    \
  } while (0)
#define LC_I8_SWITCH(gt, mt, BODY)                                                   \
  do {                                                                               \
    const int lc_key_ = (gt) * 4 + (mt);                                             \
    if (lc_key_ == kF32 * 4 + kF32) LC_INT8(kF32, kF32, BODY);                       \
    else if (lc_key_ == kF32 * 4 + kBF16) LC_INT8(kF32, kBF16, BODY);                \
    else if (lc_key_ == kBF16 * 4 + kF32) LC_INT8(kBF16, kF32, BODY);                \
    else if (lc_key_ == kBF16 * 4 + kBF16) LC_INT8(kBF16, kBF16, BODY);              \
    else if (lc_key_ == kF16 * 4 + kF32) LC_INT8(kF16, kF32, BODY);                  \
    else if (lc_key_ == kF16 * 4 + kBF16) LC_INT8(kF16, kBF16, BODY);                \
  } while (0)

struct Task {
  int64_t t, b, e;
};

// Each tensor's scale of |c| (reference.int8_scale: l1 / l0 in the defined order, linf the max; non-finite
// c count and are scaled as 0): pass 1, the statistics of every block of kSumBlock elements (in parallel,
// any order), then per tensor the block results in block order. Adds the non-finite count to *bad.
std::vector<float> tensor_scales(const Slot* grads, const Slot* momenta, int64_t ntensors, float b1, float ob1,
                                 int32_t kind, int nthr, int64_t* bad) {
  std::vector<Task> tasks;
  tasks.reserve(static_cast<size_t>(ntensors));
  std::vector<int64_t> first(ntensors + 1, 0);
  for (int64_t t = 0; t < ntensors; ++t) {
    first[t] = static_cast<int64_t>(tasks.size());
    const int64_t n = momenta[t].numel;
    for (int64_t b = 0; b < n; b += kSumBlock) tasks.push_back({t, b, std::min(n, b + kSumBlock)});
  }
  first[ntensors] = static_cast<int64_t>(tasks.size());
  std::vector<SumAcc> part(tasks.size());
  parallel_for_dynamic(static_cast<int64_t>(tasks.size()), nthr, [&](int64_t i) {
    const Task& T = tasks[i];
    const Slot& g = grads[T.t];
    const Slot& m = momenta[T.t];
    LC_I8_SWITCH(g.dtype, m.dtype, part[i] = K::block(g, m, T.b, T.e, b1, ob1, kind));
  });
  std::vector<float> scale(ntensors, 0.0f);
  for (int64_t t = 0; t < ntensors; ++t) {
    double s = 0.0;
    int64_t nnz = 0, esum = 0;
    for (int64_t i = first[t]; i < first[t + 1]; ++i) {
      *bad += part[i].bad;
      if (kind == kScaleLinf) s = part[i].s > s ? part[i].s : s;
      else s += part[i].s;
      nnz += part[i].nnz;
      esum += part[i].esum;
    }
    if (kind == kScaleL1) scale[t] = l1_scale(s, momenta[t].numel);
    else if (kind == kScaleL0) scale[t] = l0_scale(esum, s, nnz);
    else scale[t] = static_cast<float>(s);
  }
  return scale;
}

int64_t work_of(const Slot* slots, int64_t ntensors) {
  int64_t work = 0;
  for (int64_t t = 0; t < ntensors; ++t) work += slots[t].numel;
  return work;
}

}  // namespace

int64_t int8_local_step_impl(const Slot* grads, const Slot* momenta, int64_t ntensors, int64_t total,
                             double beta1, int32_t kind, int32_t levels, int8_t* q_out, int nthreads) {
  (void)total;
  const float b1 = static_cast<float>(beta1), ob1 = static_cast<float>(1.0 - beta1);
  const float hs = static_cast<float>(static_cast<double>(levels) / 2.0);
  const float lv = static_cast<float>(levels);
  const int nthr = threads_for(work_of(momenta, ntensors), nthreads);
  int64_t bad_total = 0;
  const std::vector<float> scale = tensor_scales(grads, momenta, ntensors, b1, ob1, kind, nthr, &bad_total);

  // quantize
  std::vector<Task> qtasks;
  qtasks.reserve(static_cast<size_t>(ntensors));
  for (int64_t t = 0; t < ntensors; ++t) {
    const float a = scale[t];
    if (!(a > 0.0f) || !std::isfinite(a)) continue;  // a == 0 or non-finite: q stays 0
    const int64_t n = momenta[t].numel;
    for (int64_t b = 0; b < n; b += kChunk) qtasks.push_back({t, b, std::min(n, b + kChunk)});
  }
  parallel_for_dynamic(static_cast<int64_t>(qtasks.size()), nthr, [&](int64_t i) {
    const Task& T = qtasks[i];
    const Slot& g = grads[T.t];
    const Slot& m = momenta[T.t];
    int8_t* q = q_out + m.offset;
    LC_I8_SWITCH(g.dtype, m.dtype, K::quantize(g, m, T.b, T.e, b1, ob1, hs, scale[T.t], lv, q));
  });
  return bad_total;
}
#undef LC_I8_SWITCH
#undef LC_INT8

// ------------------------------------------------------------------ (l) bbit local step
namespace {

// Elements [e0, e1) of one tensor placed at bucket position `base` (e0 a multiple of 64): the nonzero bits,
// the b code planes (plane j at planes + j * plane_bytes), the counts, and with UPD the momentum update.
template <int GT, int MT, bool UPD>
void bbit_range(const void* g, const void* m, void* mo, int64_t base, int64_t e0, int64_t e1, const Coef& k,
                float ratio, const lc_bbit_args& bb, int64_t plane_bytes, uint8_t* planes, uint8_t* nzbytes,
                int64_t& n_nonfinite, int64_t& n_zero) {
  alignas(64) float c[64], u[64];
  alignas(64) uint32_t code[64], h[64];
  const bool dither = bb.rounding == kDither;
  if (!dither)  // nearest rounding reads no u: zeroed once, and not at all when dithering (256 bytes per run)
    for (int j = 0; j < 64; ++j) u[j] = 0.0f;
  int64_t nf = 0, nzc = 0;
  for (int64_t i0 = e0; i0 < e1; i0 += 64) {
    const int n = static_cast<int>(std::min<int64_t>(64, e1 - i0));
    c_and_momentum64<GT, MT, UPD>(g, m, mo, i0, n, k, c);
    uint64_t s, z, f, e;
    masks64(c, s, z, f, e);
    const uint64_t valid = n == 64 ? ~uint64_t(0) : ((uint64_t(1) << n) - 1);
    nf += popcount64(~f & valid);
    nzc += popcount64(e & valid);
    const int64_t byte0 = (base + i0) >> 3;
    const int nbytes = (n + 7) >> 3;
    store_bits(nzbytes + byte0, z & valid, nbytes);
    // the last run of a tensor (n < 64) computes its n elements only: a small tensor is one such run
    if (dither) {
      tie_hashes64(bb.seed, bb.tie_rows, bb.tie_nrows, base + i0, h, n);
      for (int j = 0; j < n; ++j) u[j] = static_cast<float>(h[j] >> 8) * 5.9604644775390625e-08f;  // dither_u
    }
    for (int j = 0; j < n; ++j)
      code[j] = bbit_code(((f >> j) & 1u) ? c[j] : 0.0f, ratio, bb.bits, bb.rounding, u[j]);
    for (int b = 0; b < bb.bits; ++b) {
      uint64_t word = 0;
      for (int j = 0; j < n; ++j) word |= static_cast<uint64_t>((code[j] >> b) & 1u) << j;
      store_bits(planes + b * plane_bytes + byte0, word & valid, nbytes);
    }
  }
  n_nonfinite += nf;
  n_zero += nzc;
}

}  // namespace

LocalStepCounts bbit_local_step_impl(const Slot* grads, const Slot* momenta, const Slot* momenta_out,
                                     int64_t ntensors, int64_t total, double beta1, double beta2,
                                     bool update_momentum, const lc_bbit_args& bb, uint8_t* planes_out,
                                     uint8_t* nonzero_out, int nthreads) {
  const Coef k{static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
               static_cast<float>(1.0 - beta2)};
  int64_t work = 0, scale_bad = 0;
  const std::vector<Item> items = chunk_items(momenta, ntensors, kChunk, &work);
  const int nthr = threads_for(work, nthreads);
  std::vector<float> ratio = tensor_scales(grads, momenta, ntensors, k.b1, k.ob1, bb.kind, nthr, &scale_bad);
  for (float& r : ratio) r = bbit_ratio(r, bb.kind, bb.bits);
  std::vector<int64_t> nf(items.size(), 0), nz(items.size(), 0);
  parallel_for_dynamic(static_cast<int64_t>(items.size()), nthr, [&](int64_t it) {
    const Item& I = items[it];
    const Slot& g = grads[I.t];
    const Slot& m = momenta[I.t];
    void* mo = momenta_out ? momenta_out[I.t].data : m.data;
#define LC_BB(G, M)                                                                                               \
  if (update_momentum)                                                                                            \
    bbit_range<G, M, true>(g.data, m.data, mo, m.offset, I.e0, I.e1, k, ratio[I.t], bb, total / 8, planes_out,   \
                           nonzero_out, nf[it], nz[it]);                                                          \
  else                                                                                                            \
    bbit_range<G, M, false>(g.data, m.data, mo, m.offset, I.e0, I.e1, k, ratio[I.t], bb, total / 8, planes_out,  \
                            nonzero_out, nf[it], nz[it]);
    LC_GM_SWITCH(g.dtype, m.dtype, LC_BB);
#undef LC_BB
  });
  LocalStepCounts out{0, 0};
  for (size_t i = 0; i < items.size(); ++i) {
    out.n_nonfinite += nf[i];
    out.n_zero += nz[i];
  }
  return out;
}

// ------------------------------------------------------------------ (i) single-process Lion step
namespace {

// Elements [e0, e1) of one tensor: c, theta and m in one pass (reference.lion_step).
template <int PT, int GT, int MT, bool DECAY>
void lion_range(void* p, const void* g, void* m, int64_t e0, int64_t e1, const Coef& k, float df, float nl) {
  alignas(64) float gf[64], mf[64], pf[64];
  for (int64_t i0 = e0; i0 < e1; i0 += 64) {
    const int n = static_cast<int>(std::min<int64_t>(64, e1 - i0));
    if (n == 64) {
      load64<GT>(g, i0, gf);
      load64<MT>(m, i0, mf);
      load64<PT>(p, i0, pf);
    } else {
      for (int j = 0; j < n; ++j) {
        gf[j] = ld<GT>(g, i0 + j);
        mf[j] = ld<MT>(m, i0 + j);
        pf[j] = ld<PT>(p, i0 + j);
      }
      for (int j = n; j < 64; ++j) gf[j] = mf[j] = pf[j] = 0.0f;
    }
    for (int j = 0; j < 64; ++j) {
      const float c = mf[j] * k.b1 + gf[j] * k.ob1;
      float v = pf[j];
      if constexpr (DECAY) {
        v = v * df;
        if constexpr (PT != kF32) v = round_bf16(v);
      }
      const float x = lion_sign(c) * nl;
      pf[j] = v + x;
      mf[j] = mf[j] * k.b2 + gf[j] * k.ob2;
    }
    if (n == 64) {
      if constexpr (PT == kF32) {
        std::memcpy(static_cast<float*>(p) + i0, pf, sizeof(pf));
      } else {
        uint16_t* pp = static_cast<uint16_t*>(p) + i0;
        for (int j = 0; j < 64; ++j) pp[j] = f32_to_bf16(pf[j]);
      }
      if constexpr (MT == kF32) {
        std::memcpy(static_cast<float*>(m) + i0, mf, sizeof(mf));
      } else {
        uint16_t* mp = static_cast<uint16_t*>(m) + i0;
        for (int j = 0; j < 64; ++j) mp[j] = f32_to_bf16(mf[j]);
      }
    } else {
      for (int j = 0; j < n; ++j) {
        st<PT>(p, i0 + j, pf[j]);
        st<MT>(m, i0 + j, mf[j]);
      }
    }
  }
}

template <int PT, int GT, int MT>
inline void lion_range_d(bool decay, void* p, const void* g, void* m, int64_t e0, int64_t e1, const Coef& k, float df,
                         float nl) {
  if (decay) lion_range<PT, GT, MT, true>(p, g, m, e0, e1, k, df, nl);
  else lion_range<PT, GT, MT, false>(p, g, m, e0, e1, k, df, nl);
}

template <int PT>
inline void lion_range_pt(int gt, int mt, bool decay, void* p, const void* g, void* m, int64_t e0, int64_t e1,
                          const Coef& k, float df, float nl) {
#define LC_LION(G, M) lion_range_d<PT, G, M>(decay, p, g, m, e0, e1, k, df, nl);
  LC_GM_SWITCH(gt, mt, LC_LION);
#undef LC_LION
}

}  // namespace

void lion_step_impl(const Slot* params, const Slot* grads, const Slot* momenta, int64_t ntensors,
                    const LionStepArgs& args, int nthreads) {
  const Coef k{args.betas.b1, args.betas.omb1, args.betas.b2, args.betas.omb2};
  const bool decay = args.apply_decay != 0;
  int64_t work = 0;
  const std::vector<Item> items = chunk_items(params, ntensors, kChunk, &work);
  parallel_for_dynamic(static_cast<int64_t>(items.size()), threads_for(work, nthreads), [&](int64_t it) {
    const Item& I = items[it];
    const Slot& p = params[I.t];
    const Slot& g = grads[I.t];
    const Slot& m = momenta[I.t];
    if (p.dtype == kF32)
      lion_range_pt<kF32>(g.dtype, m.dtype, decay, p.data, g.data, m.data, I.e0, I.e1, k, args.decay, args.neg_lr);
    else
      lion_range_pt<kBF16>(g.dtype, m.dtype, decay, p.data, g.data, m.data, I.e0, I.e1, k, args.decay, args.neg_lr);
  });
}

#undef LC_GM_SWITCH

// ------------------------------------------------------------------ (k) abstain_list
int64_t abstain_list_impl(const uint8_t* nonzero, const uint8_t* mask, int64_t nbytes, int64_t capacity,
                          int32_t* out) {
  int32_t* idx = out + 1;
  int32_t* val = out + 1 + capacity;
  for (int64_t k = 0; k < capacity; ++k) {
    idx[k] = -1;
    val[k] = 0;
  }
  int64_t count = 0;
  auto scan = [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      if (nonzero[j] == mask[j]) continue;
      if (count < capacity) {
        idx[count] = static_cast<int32_t>(j);
        val[count] = nonzero[j];
      }
      ++count;
    }
  };
  // Abstentions are rare: compare 8 bytes at a time and look inside a word only where it differs.
  int64_t i = 0;
  for (; i + 8 <= nbytes; i += 8) {
    uint64_t a, b;
    std::memcpy(&a, nonzero + i, 8);
    std::memcpy(&b, mask + i, 8);
    if (a != b) scan(i, i + 8);
  }
  scan(i, nbytes);
  out[0] = static_cast<int32_t>(count);
  return count;
}
