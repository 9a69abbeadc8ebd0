// eager_calls.h -- the Python module of the extension (included once, at the end of bindings.cpp).
//
// The op implementations of bindings.cpp, called without the dispatcher (the eager path of
// lioncub_ds/kernels/ops.py: the dispatcher's boxing costs ~2 µs per call; torch.compile uses the
// registered ops). Lists arrive as std::vector (pybind's conversion) and pass on as TensorList; the
// GIL is released around an op that reads at least kGilFreeElements elements.
//
// Two forms per op on the CPU build:
// * `name`: the op itself (ops.py calls it after its Python checks passed);
// * `try_name`: the same op gated by its own LC_INV invariants (checked before anything is written):
//   an argument that does not fit answers None instead of raising (nothing crosses the module
//   boundary), and ops.py then runs its Python checks: the ValueError naming the argument, or the
//   reference path. A bucket that the caller keeps (ops.Layout) is thus checked by one C++ call,
//   ~20 ns per tensor, instead of Python attribute reads (~80 ns each, several per tensor).
//   `try_*_into` write the local steps' outputs into given buffers (the layout's workspace, reused
//   from step to step: no allocation and no new Python object per call).
#pragma once

namespace {
template <class T>
struct py_arg {
  using type = T;
};
template <>
struct py_arg<TL> {
  using type = std::vector<at::Tensor>;
};
template <>
struct py_arg<at::ArrayRef<double>> {
  using type = std::vector<double>;
};

// Elements a call reads: the GIL is released only around a call with enough work to matter to
// another Python thread (releasing and taking it back costs ~0.5 µs, a tenth of a small call).
constexpr int64_t kGilFreeElements = int64_t{1} << 14;
template <class T>
int64_t elements_of(const T&) {
  return 0;
}
inline int64_t elements_of(const at::Tensor& t) { return t.defined() ? t.numel() : 0; }
inline int64_t elements_of(const OptT& t) { return t ? elements_of(*t) : 0; }
inline int64_t elements_of(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const auto& t : ts) n += elements_of(t);
  return n;
}
template <class... T>
bool releases_gil(const T&... args) {
  return (int64_t{0} + ... + elements_of(args)) >= kGilFreeElements;
}
using OptionalNoGil = std::optional<pybind11::gil_scoped_release>;

template <class R, class... A>
auto direct(R (*fn)(A...)) {
  return [fn](typename py_arg<std::decay_t<A>>::type... args) -> R {
    OptionalNoGil nogil;
    if (releases_gil(args...)) nogil.emplace();
    return fn(args...);
  };
}

// The gated form: the op's result (True for an op without one), or None where an invariant failed.
template <class R, class... A>
auto gated(R (*fn)(A...)) {
  return [fn](typename py_arg<std::decay_t<A>>::type... args) -> pybind11::object {
    bool ok = true;
    if constexpr (std::is_void_v<R>) {
      {
        OptionalNoGil nogil;
        if (releases_gil(args...)) nogil.emplace();
        try {
          fn(args...);
        } catch (...) {
          ok = false;
        }
      }
      return ok ? pybind11::object(pybind11::bool_(true)) : pybind11::object(pybind11::none());
    } else {
      std::optional<R> r;
      {
        OptionalNoGil nogil;
        if (releases_gil(args...)) nogil.emplace();
        try {
          r.emplace(fn(args...));
        } catch (...) {
          ok = false;
        }
      }
      return ok ? pybind11::cast(std::move(*r)) : pybind11::object(pybind11::none());
    }
  };
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lioncub_ds fused kernels: torch ops lioncub::* (CPU; CUDA when built with LIONCUB_WITH_CUDA)";
#ifndef LIONCUB_WITH_CUDA
#define LIONCUB_DEF_CPU(name) \
  m.def(#name, direct(&cpu::name));  \
  m.def("try_" #name, gated(&cpu::name));
  LIONCUB_OPS(LIONCUB_DEF_CPU)
  LIONCUB_DEF_CPU(abstain_list)
  m.def("try_local_step_into", gated(&cpu::local_step_into));
  m.def("try_int8_local_step_into", gated(&cpu::int8_local_step_into));
  m.def("try_bbit_local_step_into", gated(&cpu::bbit_local_step_into));
#else
#define LIONCUB_DEF_CUDA(name) m.def("cuda_" #name, direct(&cuda::name));
  LIONCUB_OPS(LIONCUB_DEF_CUDA)
#endif
  m.def("set_isa", [](int64_t isa) { lc::set_isa(static_cast<int>(isa)); }, "0 auto, 1 baseline, 2 avx2");
  m.def("isa", []() { return std::string(lc::isa_name()); });
  m.def("src_hash", []() { return std::string(LIONCUB_SRC_HASH_STR); });
  m.attr("has_cuda") = pybind11::bool_(
#ifdef LIONCUB_WITH_CUDA
      true
#else
      false
#endif
  );
}
