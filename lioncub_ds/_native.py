"""Native kernel loader: the C++ CPU backend (and, later, the CUDA one).

``load("cpp")`` returns a backend object whose methods have exactly the signatures and
return values of :class:`lioncub_ds.ops.TorchBackend` (the pure-torch reference in
:mod:`lioncub_ds.codec`), computed by the fused kernels of ``csrc/``. It uses, in order:

1. the module prebuilt by ``LIONCUB_BUILD_EXT=1 pip install .`` (``lioncub_ds._lioncub_cpu``;
   with ``LIONCUB_BUILD_CUDA=1`` also ``lioncub_ds._lioncub_cuda``), unless the sources next to
   the package differ from what it was built from;
2. a JIT build with :func:`torch.utils.cpp_extension.load` (ninja; cached in
   ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``; ~30-60 s the first time).

Sources and flags: :mod:`lioncub_ds.kernels.build` (the one table; setup.py reads it too).

Anything the kernels do not handle (non-contiguous tensors, float64/fp16 parameters, ...)
falls back to the reference functions, so results are always those of the torch path; bad
arguments raise a ValueError in Python before any extension call.
"""
from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

from . import codec
from .kernels import build as _build

log = logging.getLogger("lioncub_ds")

EXT_NAME = _build.CPP_EXT_NAME
PREBUILT_MODULE = _build.CPP_MODULE
CFLAGS = list(_build.CFLAGS)
LDFLAGS = list(_build.LDFLAGS)
SOURCES = _build.CPP_SOURCES
HEADERS = _build.CPP_HEADERS

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_STATE_DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
_loaded: dict = {}


# ----------------------------------------------------------------------------- sources / build
def csrc_dir() -> Path | None:
    """The kernel sources: ``<repo>/csrc`` (checkout, editable install) or ``lioncub_ds/csrc``
    (a wheel/sdist install, copied there by setup.py)."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "csrc", here / "csrc"):
        if all((cand / s).is_file() for s in SOURCES):
            return cand
    return None


def source_hash(root: Path | None = None, cuda: bool = False) -> str:
    """sha1 of the kernel sources (a built module's ``src_hash()`` is ``"h" + source_hash()``)."""
    root = root or csrc_dir()
    if root is None:
        return ""
    if cuda:
        return _build.source_hash(root, _build.CUDA_SOURCES, _build.CUDA_HEADERS)
    return _build.source_hash(root)


def _prebuilt(module=PREBUILT_MODULE, cuda=False):
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    root = csrc_dir()
    if root is not None and getattr(mod, "src_hash", lambda: "")() not in ("", "h" + source_hash(root, cuda)):
        log.info("lioncub_ds: prebuilt %s is older than the sources in %s; JIT-building instead", module, root)
        return None
    return mod


def _jit_build():
    root = csrc_dir()
    if root is None:
        raise RuntimeError("lioncub_ds: C++ kernel sources not found (looked for csrc/ next to and inside the "
                           "package); reinstall with LIONCUB_BUILD_EXT=1 or use LIONCUB_KERNELS=torch")
    from torch.utils.cpp_extension import load as cpp_load

    verbose = os.environ.get("LIONCUB_BUILD_VERBOSE", "0") == "1"
    return cpp_load(
        name=f"{EXT_NAME}_{source_hash(root)[:12]}",  # keyed by the sources: checkouts never evict each other
        sources=[str(root / s) for s in SOURCES],
        extra_cflags=CFLAGS,
        extra_ldflags=LDFLAGS,
        extra_include_paths=[str(root)],
        verbose=verbose,
    )


def _retry(build, attempts=3):
    """torch serializes builds with a lock file, but a process can still read a .so that another
    process is replacing (seen when sources change under running ranks): try again."""
    for i in range(attempts):
        try:
            return build()
        except (ImportError, OSError):
            if i == attempts - 1:
                raise
            time.sleep(2.0 * (i + 1))


def build_cpp_extension():
    """The compiled C++ module (prebuilt, else JIT). Raises if it cannot be built."""
    with _lock:
        if "cpp_ext" not in _loaded:
            mod = _prebuilt()
            if mod is None:
                mod = _retry(_jit_build)
            _loaded["cpp_ext"] = mod
        return _loaded["cpp_ext"]


CUDA_SOURCES = _build.CUDA_SOURCES
CUDA_CFLAGS = list(_build.NVCC_FLAGS)


def _load_cuda():
    """The CUDA backend: JIT-built with ninja (cached) when torch has CUDA and nvcc is present."""
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is available")
    from torch.utils.cpp_extension import CUDA_HOME
    from torch.utils.cpp_extension import load as cpp_load

    if CUDA_HOME is None:
        raise RuntimeError("CUDA kernels need nvcc (CUDA_HOME not found)")
    root = csrc_dir()
    if root is None:
        raise RuntimeError("lioncub_ds: CUDA kernel sources not found")
    with _lock:
        if "cuda" not in _loaded:
            from ._native_cuda import CudaBackend

            ext = _prebuilt(_build.CUDA_MODULE, cuda=True)  # LIONCUB_BUILD_CUDA=1 pip install .
            if ext is None:
                ext = _retry(lambda: cpp_load(
                    name=f"{_build.CUDA_EXT_NAME}_{source_hash(root, cuda=True)[:12]}", sources=[str(root / s) for s in CUDA_SOURCES],
                    extra_include_paths=[str(root)], extra_cflags=CFLAGS + list(_build.CUDA_DEFINES),
                    extra_ldflags=LDFLAGS, extra_cuda_cflags=CUDA_CFLAGS,
                    verbose=os.environ.get("LIONCUB_BUILD_VERBOSE", "0") == "1"))
            if not getattr(ext, "has_cuda", False):
                raise RuntimeError("the lioncub_cuda extension was built without CUDA")
            _loaded["cuda"] = CudaBackend(ext)
        return _loaded["cuda"]


def load(kind: str):
    """The native backend for ``kind`` ('cpp' or 'cuda'), built once per process."""
    if kind == "cpp":
        with _lock:
            be = _loaded.get("cpp")
        if be is None:
            be = CppBackend(build_cpp_extension())
            with _lock:
                _loaded["cpp"] = be
        return be
    if kind == "cuda":
        return _load_cuda()
    raise ValueError(f"native kernel kind must be 'cpp' or 'cuda', got {kind!r}")


# ----------------------------------------------------------------------------- validation
# Every public kernel entry validates in Python before it calls the extension: on some platforms a
# C++ exception thrown through a JIT-built extension crashes the process (GPU.md), so bad input must
# never reach a TORCH_CHECK. Structural errors raise a ValueError that names the argument and what
# is allowed; tensors the kernels do not handle (non-contiguous, float64, another device type) take
# the reference path (lioncub_ds.codec), whose results are the contract.
def _plain(t, dtypes, device_type="cpu") -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == device_type and t.layout == torch.strided
            and t.is_contiguous() and t.dtype in dtypes)


def _all_plain(ts, dtypes, device_type="cpu") -> bool:
    return all(_plain(t, dtypes, device_type) for t in ts)


def _offsets(offsets) -> list:
    if isinstance(offsets, torch.Tensor):
        return [int(v) for v in offsets.tolist()]
    return [int(v) for v in offsets]


def check_tensors(named) -> None:
    """``named``: [(name, tensor or None)]: every tensor is a torch.Tensor, all on one device."""
    dev = None
    for name, t in named:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"lioncub kernels: {name} must be a torch.Tensor, got {type(t).__name__}")
        if dev is None:
            dev, first = t.device, name
        elif t.device != dev:
            raise ValueError(f"lioncub kernels: {name} is on {t.device} but {first} is on {dev}: every tensor of a "
                             "call must be on one device")


def check_bucket(tensors, offsets, limit, name, others=None, others_name=None) -> list:
    """Offsets are non-negative multiples of 8, every tensor fits [0, limit) and none overlap;
    ``others`` (momenta of grads...) pair one to one with ``tensors``. Returns the int offsets."""
    offs = _offsets(offsets)
    if len(offs) != len(tensors):
        raise ValueError(f"lioncub kernels: {name} has {len(tensors)} tensors but offsets has {len(offs)} entries")
    if others is not None:
        if len(others) != len(tensors):
            raise ValueError(f"lioncub kernels: {name} has {len(tensors)} tensors but {others_name} has {len(others)}")
        for i, (a, b) in enumerate(zip(tensors, others)):
            if a.numel() != b.numel():
                raise ValueError(f"lioncub kernels: {name}[{i}] has {a.numel()} elements but {others_name}[{i}] has "
                                 f"{b.numel()}")
    spans = []
    ordered = True
    for i, (t, o) in enumerate(zip(tensors, offs)):
        n = t.numel()
        if o < 0 or o % 8:
            raise ValueError(f"lioncub kernels: offsets[{i}]={o} must be a non-negative multiple of 8")
        if limit is not None and o + n > limit:
            raise ValueError(f"lioncub kernels: {name}[{i}] ({n} elements at offset {o}) does not fit the "
                             f"bucket of {limit} elements")
        if n:
            ordered = ordered and (not spans or o >= spans[-1][0])
            spans.append((o, o + n, i))
    if not ordered:
        spans.sort()
    for (a0, a1, i), (b0, _, j) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ValueError(f"lioncub kernels: {name}[{i}] and {name}[{j}] overlap in the bucket "
                             f"(offsets {a0} and {b0})")
    return offs


def check_planes(sign, nonzero, two_d: bool, max_rows=None) -> None:
    """sign: uint8 [N, bytes] (or [bytes] when not two_d); nonzero: None or the same shape."""
    check_tensors([("sign", sign), ("nonzero", nonzero)])
    dims = (2,) if two_d else (1, 2)
    if sign.dim() not in dims:
        raise ValueError(f"lioncub kernels: sign must be a {'2-D [N, bytes]' if two_d else '1-D or 2-D [N, bytes]'} "
                         f"uint8 tensor, got {sign.dim()} dims")
    if nonzero is not None and tuple(nonzero.shape) != tuple(sign.shape):
        raise ValueError(f"lioncub kernels: nonzero planes {tuple(nonzero.shape)} must match the sign planes "
                         f"{tuple(sign.shape)}")
    if sign.dim() == 2 and sign.shape[0] < 1:
        raise ValueError("lioncub kernels: sign must hold at least one plane")


def check_world(world_size) -> int:
    w = int(world_size)
    if not 1 <= w < 2**31:
        raise ValueError(f"lioncub kernels: world_size must be in 1..2**31-1, got {world_size!r}")
    return w


def check_lane_width(p) -> int:
    if p not in codec.LANE_WIDTHS:
        raise ValueError(f"lane width p must be one of {codec.LANE_WIDTHS}, got {p!r}")
    return int(p)


def check_total(total) -> int:
    t = int(total)
    if t < 0 or t % 8:
        raise ValueError(f"lioncub kernels: total must be a non-negative multiple of 8, got {total!r}")
    return t


def _planes_ok(sign, nonzero, device_type="cpu", max_rows=65535) -> bool:
    rows = sign.shape[0] if sign.dim() == 2 else 1
    return (_plain(sign, (torch.uint8,), device_type) and 1 <= rows <= max_rows
            and (nonzero is None or _plain(nonzero, (torch.uint8,), device_type)))


class CppBackend:
    """Fused C++ CPU kernels with the exact interface of :class:`lioncub_ds.ops.TorchBackend`.

    ``vote_apply``, ``lanes_apply`` and ``int8_apply`` return Δ like the reference; pass
    ``return_delta=False`` to skip materialising it (4 bytes per element of extra writes).
    """

    name = "cpp"

    def __init__(self, ext):
        self._ext = ext

    # -- introspection / test hooks
    @property
    def isa(self) -> str:
        return self._ext.isa()

    def set_isa(self, isa: str) -> None:
        """'auto', 'baseline' or 'avx2' (both paths give identical results)."""
        codes = {"auto": 0, "baseline": 1, "base": 1, "avx2": 2}
        if isa not in codes:
            raise ValueError(f"isa must be one of {tuple(codes)}, got {isa!r}")
        self._ext.set_isa(codes[isa])

    # -- (a) local step
    def local_step(self, grads, momenta, offsets, total, beta1, beta2, update_momentum=False):
        total = check_total(total)
        check_tensors([(f"grads[{i}]", g) for i, g in enumerate(grads)]
                      + [(f"momenta[{i}]", m) for i, m in enumerate(momenta)])
        offs = check_bucket(grads, offsets, total, "grads", momenta, "momenta")
        if not (_all_plain(grads, _GRAD_DTYPES) and _all_plain(momenta, _STATE_DTYPES)):
            return codec.local_step(grads, momenta, offs, total, beta1, beta2, update_momentum)
        sign, nz, n_bad, n_zero = self._ext.local_step(list(grads), list(momenta), offs, total, float(beta1),
                                                      float(beta2), bool(update_momentum))
        return sign, nz, int(n_bad), int(n_zero)

    # -- (b) momentum
    def momentum_update_list(self, momenta, grads, beta2):
        check_tensors([(f"grads[{i}]", g) for i, g in enumerate(grads)]
                      + [(f"momenta[{i}]", m) for i, m in enumerate(momenta)])
        if len(momenta) != len(grads):
            raise ValueError(f"lioncub kernels: momenta has {len(momenta)} tensors but grads has {len(grads)}")
        for i, (m, g) in enumerate(zip(momenta, grads)):
            if m.numel() != g.numel():
                raise ValueError(f"lioncub kernels: momenta[{i}] has {m.numel()} elements but grads[{i}] has "
                                 f"{g.numel()}")
        if _all_plain(grads, _GRAD_DTYPES) and _all_plain(momenta, _STATE_DTYPES):
            self._ext.momentum_update_list(list(momenta), list(grads), float(beta2))
            return
        for m, g in zip(momenta, grads):
            codec.momentum_update(m, g, beta2)

    # -- (c) vote + apply
    def vote_apply(self, sign, nonzero, params, offsets, lr, weight_decay, step, tie_break, vote, world_size,
                   segments=None, return_delta=True):
        v = codec.enum_code("vote", vote)
        t = codec.enum_code("tie_break", tie_break) if v == 0 else 0
        world = check_world(world_size)
        check_planes(sign, nonzero, False)
        check_tensors([("sign", sign)] + [(f"params[{i}]", p) for i, p in enumerate(params)])
        offs = check_bucket(params, offsets, sign.shape[-1] * 8, "params")
        segs = codec.tie_segments(offs) if segments is None else codec.as_segments(segments)
        if not (_planes_ok(sign, nonzero) and _all_plain(params, _STATE_DTYPES)):
            return codec.vote_apply(sign, nonzero, params, offs, lr, weight_decay, step, tie_break, vote, world_size,
                                    segs, return_delta)
        return self._ext.vote_apply(sign, nonzero, list(params), offs, float(lr), float(weight_decay), int(step), t,
                                    v, world, segs, bool(return_delta))

    # -- (d) two-phase vote, phase 1
    def shard_vote(self, sign, nonzero, step, tie_break, segments):
        t = codec.enum_code("tie_break", tie_break)
        check_planes(sign, nonzero, True)
        segs = codec.as_segments(segments)
        if not _planes_ok(sign, nonzero):
            return codec.shard_vote(sign, nonzero, step, tie_break, segs)
        out_sign, out_nz = self._ext.shard_vote(sign, nonzero, int(step), t, segs)
        return out_sign, out_nz

    # -- (e) p-bit count lanes
    def count_lanes(self, sign, nonzero, p):
        p = check_lane_width(p)
        check_planes(sign, nonzero, True)
        top = (1 << p) - 1
        if nonzero is None and sign.shape[1] > 0 and sign.shape[0] > top:
            raise ValueError(f"count {sign.shape[0]} does not fit a {p}-bit lane")
        if not _planes_ok(sign, nonzero):
            return codec.count_lanes(sign, nonzero, p)
        plus, cnt, mx = self._ext.count_lanes(sign, nonzero, p)
        if sign.shape[1] > 0 and mx > top:
            raise ValueError(f"count {mx} does not fit a {p}-bit lane")
        return plus, cnt

    # -- (f) summed lanes + apply
    def lanes_apply(self, plus_lanes, cnt_lanes, world_size, p, params, offsets, lr, weight_decay, step, tie_break,
                    vote, segments=None, return_delta=True):
        p = check_lane_width(p)
        v = codec.enum_code("vote", vote)
        t = codec.enum_code("tie_break", tie_break) if v == 0 else 0
        world = check_world(world_size)
        check_tensors([("plus_lanes", plus_lanes), ("cnt_lanes", cnt_lanes)]
                      + [(f"params[{i}]", q) for i, q in enumerate(params)])
        if cnt_lanes is not None and cnt_lanes.numel() != plus_lanes.numel():
            raise ValueError(f"lioncub kernels: cnt_lanes has {cnt_lanes.numel()} bytes but plus_lanes has "
                             f"{plus_lanes.numel()}")
        offs = check_bucket(params, offsets, plus_lanes.numel() * 8 // p, "params")
        segs = codec.tie_segments(offs) if segments is None else codec.as_segments(segments)
        lanes_ok = _plain(plus_lanes, (torch.uint8,)) and (cnt_lanes is None or _plain(cnt_lanes, (torch.uint8,)))
        if not (lanes_ok and _all_plain(params, _STATE_DTYPES)):
            return codec.lanes_apply(plus_lanes, cnt_lanes, world_size, p, params, offs, lr, weight_decay, step,
                                     tie_break, vote, segs, return_delta)
        return self._ext.lanes_apply(plus_lanes.reshape(-1), None if cnt_lanes is None else cnt_lanes.reshape(-1),
                                     world, p, list(params), offs, float(lr), float(weight_decay), int(step), t, v,
                                     segs, bool(return_delta))

    # -- (g) int8 codes
    def int8_local_step(self, grads, momenta, offsets, total, beta1, kind, levels):
        code = codec.enum_code("quant scale", kind)
        total = check_total(total)
        check_tensors([(f"grads[{i}]", g) for i, g in enumerate(grads)]
                      + [(f"momenta[{i}]", m) for i, m in enumerate(momenta)])
        offs = check_bucket(grads, offsets, total, "grads", momenta, "momenta")
        if not (_all_plain(grads, _GRAD_DTYPES) and _all_plain(momenta, _STATE_DTYPES)) or not 1 <= levels <= 127:
            return codec.int8_local_step(grads, momenta, offs, total, beta1, kind, levels)
        q, n_bad = self._ext.int8_local_step(list(grads), list(momenta), offs, total, float(beta1), code,
                                             int(levels))
        return q, int(n_bad)

    # -- (h) int8 apply
    def int8_apply(self, qsum, params, offsets, lr, weight_decay, return_delta=True):
        check_tensors([("qsum", qsum)] + [(f"params[{i}]", p) for i, p in enumerate(params)])
        offs = check_bucket(params, offsets, qsum.numel(), "params")
        if not (_plain(qsum, (torch.int8,)) and _all_plain(params, _STATE_DTYPES)):
            return codec.int8_apply(qsum, params, offs, lr, weight_decay, return_delta)
        return self._ext.int8_apply(qsum.reshape(-1), list(params), offs, float(lr), float(weight_decay),
                                    bool(return_delta))
