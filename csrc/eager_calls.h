// eager_calls.h -- the Python module of the extension (included once, at the end of bindings.cpp).
//
// The op implementations of bindings.cpp, called without the dispatcher (the eager path of
// lioncub_ds/kernels/ops.py: the dispatcher's boxing costs ~2 µs per call; torch.compile uses the
// registered ops). Tensors and tensor lists arrive borrowed from their Python objects (no reference
// count changes on the tensors; below) and pass on as at::Tensor / TensorList; the GIL is released
// around an op that reads at least kGilFreeElements elements.
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
// Tensor arguments borrowed from their Python objects for the length of a call. pybind's own
// conversion copies each at::Tensor, and a copy of a tensor that Python holds costs an incref and a
// decref through torch's Python interpreter hooks (a GIL acquire each): ~10% of a small call. A
// borrow is the same TensorImpl at +0 references (c10::MaybeOwnedTraits, as at::borrow_from_optional_tensor
// does); the Python objects are held (Py_INCREF, with the GIL) and let go, with the GIL held again,
// when the call's arguments are destroyed. A call that releases the GIL (a large one: the copies'
// cost is nothing there) makes its borrows owning first. What a call accepts is what pybind's
// casters accept: torch.Tensor and its subclasses, in any iterable but str / bytes / a mapping.
using TensorBorrow = c10::MaybeOwnedTraits<at::Tensor>;

struct HeldObjects {
  c10::SmallVector<PyObject*, 16> objs;
  HeldObjects() = default;
  HeldObjects(HeldObjects&& o) noexcept : objs(std::move(o.objs)) { o.objs.clear(); }
  HeldObjects& operator=(HeldObjects&&) = delete;
  ~HeldObjects() {
    for (PyObject* o : objs) Py_DECREF(o);
  }
  bool hold(PyObject* o) {
    if (!THPVariable_Check(o)) return false;
    Py_INCREF(o);
    objs.push_back(o);
    return true;
  }
};

// A borrow becomes an owning reference (own(), with the GIL held) before a call releases the GIL:
// holding the Python object does not hold its TensorImpl against torch.utils.swap_tensors from
// another thread (it refuses a tensor with other references; a borrow adds none).
inline void own_borrow(at::Tensor& t) {
  at::Tensor owned(t);  // +1, with the GIL held (torch's hooks may take it)
  TensorBorrow::destroyBorrow(t);
  t = std::move(owned);
}

// One holder for the three argument kinds: S is the borrowed value as the op takes it (a tensor
// list, a tensor, or an optional tensor); each_tensor visits the tensors it holds, clear_moved empties a
// moved-from value so that its destructor lets nothing go twice.
template <class F>
void each_tensor(c10::SmallVector<at::Tensor, 16>& ts, F f) {
  for (auto& t : ts) f(t);
}
template <class F>
void each_tensor(at::Tensor& t, F f) {
  if (t.defined()) f(t);
}
template <class F>
void each_tensor(OptT& t, F f) {
  if (t) f(*t);
}
inline void clear_moved(c10::SmallVector<at::Tensor, 16>& ts) { ts.clear(); }
inline void clear_moved(at::Tensor& t) { t = at::Tensor(); }
inline void clear_moved(OptT& t) { t.reset(); }

template <class S>
struct Borrowed {
  S v;
  HeldObjects held;
  bool owned = false;
  Borrowed() = default;
  Borrowed(Borrowed&& o) noexcept : v(std::move(o.v)), held(std::move(o.held)), owned(o.owned) { clear_moved(o.v); }
  Borrowed& operator=(Borrowed&&) = delete;
  ~Borrowed() {
    if (!owned) each_tensor(v, [](at::Tensor& t) { TensorBorrow::destroyBorrow(t); });
  }
  void own() {
    if (!owned) each_tensor(v, own_borrow);
    owned = true;
  }
  // the op's argument (a tensor list passes as a TensorList view of the borrows)
  using Arg = std::conditional_t<std::is_same_v<S, at::Tensor> || std::is_same_v<S, OptT>, const S&, TL>;
  operator Arg() const { return v; }  // NOLINT(google-explicit-constructor)
};
using BorrowedTensors = Borrowed<c10::SmallVector<at::Tensor, 16>>;  // Tensor[] (16 without a heap allocation)
using BorrowedTensor = Borrowed<at::Tensor>;                          // Tensor
using BorrowedOptTensor = Borrowed<OptT>;                             // Tensor? (None: no value)
}  // namespace

namespace pybind11::detail {
template <>
struct type_caster<BorrowedTensors> {
  PYBIND11_TYPE_CASTER(BorrowedTensors, const_name("list[torch.Tensor]"));
  bool load(handle src, bool) {
    // what pybind's list caster takes: any iterable but str / bytes / a mapping (a list or tuple as
    // it is, others through a list of their items; the items are held, so that list may go at the
    // end of load)
    PyObject* o = src.ptr();
    if (!PyList_Check(o) && !PyTuple_Check(o)) {
      if (PyUnicode_Check(o) || PyBytes_Check(o) || PyByteArray_Check(o) || PyDict_Check(o)) return false;
      const object items = reinterpret_steal<object>(PySequence_List(o));  // fails for a non-iterable
      if (!items) {
        PyErr_Clear();
        return false;
      }
      return load_items(items.ptr());
    }
    return load_items(o);
  }

 private:
  bool load_items(PyObject* o) {
    const bool list = PyList_Check(o);
    const Py_ssize_t n = list ? PyList_GET_SIZE(o) : PyTuple_GET_SIZE(o);
    value.v.reserve(static_cast<size_t>(n));
    value.held.objs.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = list ? PyList_GET_ITEM(o, i) : PyTuple_GET_ITEM(o, i);
      if (!value.held.hold(item)) return false;
      value.v.push_back(TensorBorrow::createBorrow(THPVariable_Unpack(item)));
    }
    return true;
  }

 public:
  static handle cast(const BorrowedTensors&, return_value_policy, handle) = delete;
};

template <>
struct type_caster<BorrowedTensor> {
  PYBIND11_TYPE_CASTER(BorrowedTensor, const_name("torch.Tensor"));
  bool load(handle src, bool) {
    if (!value.held.hold(src.ptr())) return false;
    value.v = TensorBorrow::createBorrow(THPVariable_Unpack(src.ptr()));
    return true;
  }
  static handle cast(const BorrowedTensor&, return_value_policy, handle) = delete;
};

template <>
struct type_caster<BorrowedOptTensor> {
  PYBIND11_TYPE_CASTER(BorrowedOptTensor, const_name("torch.Tensor | None"));
  bool load(handle src, bool) {
    if (src.is_none()) return true;
    if (!value.held.hold(src.ptr())) return false;
    value.v.emplace(TensorBorrow::createBorrow(THPVariable_Unpack(src.ptr())));
    return true;
  }
  static handle cast(const BorrowedOptTensor&, return_value_policy, handle) = delete;
};
}  // namespace pybind11::detail

namespace {
template <class T>
struct py_arg {
  using type = T;
};
template <>
struct py_arg<TL> {
  using type = BorrowedTensors;
};
template <>
struct py_arg<at::Tensor> {
  using type = BorrowedTensor;
};
template <>
struct py_arg<OptT> {
  using type = BorrowedOptTensor;
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
inline int64_t elements_of(TL ts) {
  int64_t n = 0;
  for (const auto& t : ts) n += elements_of(t);
  return n;
}
template <class S>
int64_t elements_of(const Borrowed<S>& a) {
  return elements_of(static_cast<typename Borrowed<S>::Arg>(a));
}
template <class... T>
bool releases_gil(const T&... args) {
  return (int64_t{0} + ... + elements_of(args)) >= kGilFreeElements;
}
using OptionalNoGil = std::optional<pybind11::gil_scoped_release>;

// The borrowed arguments made owning, then the GIL released: for a call of >= kGilFreeElements.
template <class T>
void own(T&) {}
template <class S>
void own(Borrowed<S>& a) {
  a.own();
}
template <class... T>
void release_gil_for(OptionalNoGil& nogil, T&... args) {
  if (!releases_gil(args...)) return;
  (own(args), ...);
  nogil.emplace();
}

template <class R, class... A>
auto direct(R (*fn)(A...)) {
  return [fn](typename py_arg<std::decay_t<A>>::type... args) -> R {
    OptionalNoGil nogil;
    release_gil_for(nogil, args...);
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
        release_gil_for(nogil, args...);
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
        release_gil_for(nogil, args...);
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
