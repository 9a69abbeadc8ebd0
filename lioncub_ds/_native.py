"""Native kernel loader: the C++ CPU backend (and, later, the CUDA one).

``load("cpp")`` returns a backend object whose methods have exactly the signatures and
return values of :class:`lioncub_ds.ops.TorchBackend` (the pure-torch reference in
:mod:`lioncub_ds.codec`), computed by the fused kernels of ``csrc/``. It uses, in order:

1. the module prebuilt by ``LIONCUB_BUILD_EXT=1 pip install .`` (``lioncub_ds._lioncub_cpu``),
   unless the sources next to the package are newer than what it was built from;
2. a JIT build with :func:`torch.utils.cpp_extension.load` (ninja; cached in
   ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``; ~30-60 s the first time).

Flags: ``-O3 -fopenmp -ffp-contract=off`` and no ``-march``: the cache may move between
machines, and the kernels pick their AVX2 path at run time. ``-ffp-contract=off`` is part of
the contract: a fused multiply-add would change results in the last bit.

Anything the kernels do not handle (non-contiguous tensors, float64/fp16 parameters, ...)
falls back to the reference functions, so results are always those of the torch path.
"""
from __future__ import annotations

import hashlib
import importlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

from . import codec

log = logging.getLogger("lioncub_ds")

EXT_NAME = "lioncub_cpu"
PREBUILT_MODULE = "lioncub_ds._lioncub_cpu"
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-fast-math"]
LDFLAGS = ["-fopenmp"]
SOURCES = ("bindings.cpp", "cpu/lioncub_cpu.cpp")
HEADERS = ("cpu/lioncub_cpu.h",)

_TIE = {"zero": 0, "alternate": 1, "hash": 2}
_VOTE = {"majority": 0, "average": 1}
_KIND = {"l1": 0, "l0": 1, "linf": 2}
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


def source_hash(root: Path | None = None) -> str:
    """sha1 of the kernel sources (a built module's ``src_hash()`` is ``"h" + source_hash()``)."""
    root = root or csrc_dir()
    if root is None:
        return ""
    h = hashlib.sha1()
    for rel in SOURCES + HEADERS:
        h.update(rel.encode())
        h.update((root / rel).read_bytes())
    return h.hexdigest()


def _prebuilt():
    try:
        mod = importlib.import_module(PREBUILT_MODULE)
    except ImportError:
        return None
    root = csrc_dir()
    if root is not None and getattr(mod, "src_hash", lambda: "")() not in ("", "h" + source_hash(root)):
        log.info("lioncub_ds: prebuilt %s is older than the sources in %s; JIT-building instead",
                 PREBUILT_MODULE, root)
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
        name=EXT_NAME,
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


CUDA_SOURCES = ("bindings.cpp", "cpu/lioncub_cpu.cpp", "cuda/lioncub_local.cu", "cuda/lioncub_vote.cu")
CUDA_CFLAGS = ["-O3", "-std=c++17", "--fmad=false"]  # no FMA: the same bits as the CPU path


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

            ext = cpp_load(name="lioncub_cuda", sources=[str(root / s) for s in CUDA_SOURCES],
                           extra_include_paths=[str(root)], extra_cflags=CFLAGS + ["-DLIONCUB_WITH_CUDA"],
                           extra_ldflags=LDFLAGS, extra_cuda_cflags=CUDA_CFLAGS,
                           verbose=os.environ.get("LIONCUB_BUILD_VERBOSE", "0") == "1")
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


def torch_vec_width() -> int:
    """Lanes of ATen's Vectorized<float> for the CPU capability torch runs with (its sum order)."""
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - very old torch: assume 256-bit vectors
        cap = "DEFAULT"
    return 16 if str(cap).upper().startswith("AVX512") else 8


# ----------------------------------------------------------------------------- backend
def _plain(t, dtypes) -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided
            and t.is_contiguous() and t.dtype in dtypes)


def _all_plain(ts, dtypes) -> bool:
    return all(_plain(t, dtypes) for t in ts)


def _offsets(offsets) -> list:
    if isinstance(offsets, torch.Tensor):
        return [int(v) for v in offsets.tolist()]
    return [int(v) for v in offsets]


def _tie(tie_break: str) -> int:
    if tie_break not in _TIE:
        raise ValueError(f"tie_break must be one of {codec.TIE_RULES}, got {tie_break!r}")
    return _TIE[tie_break]


def _vote(vote: str) -> int:
    if vote not in _VOTE:
        raise ValueError(f"vote must be one of {codec.VOTE_MODES}, got {vote!r}")
    return _VOTE[vote]


def _planes_ok(sign, nonzero, two_d: bool) -> bool:
    if not _plain(sign, (torch.uint8,)) or sign.dim() not in ((2,) if two_d else (1, 2)):
        return False
    if nonzero is None:
        return True
    return _plain(nonzero, (torch.uint8,)) and nonzero.shape == sign.shape


class CppBackend:
    """Fused C++ CPU kernels with the exact interface of :class:`lioncub_ds.ops.TorchBackend`.

    ``vote_apply``, ``lanes_apply`` and ``int8_apply`` return Δ like the reference; pass
    ``return_delta=False`` to skip materialising it (4 bytes per element of extra writes).
    """

    name = "cpp"

    def __init__(self, ext):
        self._ext = ext
        self.vec_width = torch_vec_width()

    # -- introspection / test hooks
    @property
    def isa(self) -> str:
        return self._ext.isa()

    def set_isa(self, isa: str) -> None:
        """'auto', 'baseline' or 'avx2' (both paths give identical results)."""
        self._ext.set_isa({"auto": 0, "baseline": 1, "base": 1, "avx2": 2}[isa])

    # -- (a) local step
    def local_step(self, grads, momenta, offsets, total, beta1, beta2, update_momentum=False):
        offs = _offsets(offsets)
        if not (_all_plain(grads, _GRAD_DTYPES) and _all_plain(momenta, _STATE_DTYPES)):
            return codec.local_step(grads, momenta, offs, total, beta1, beta2, update_momentum)
        if total % 8:
            raise ValueError(f"pack_bits needs a multiple of 8 elements, got {total}")
        sign, nz, n_bad, n_zero = self._ext.local_step(list(grads), list(momenta), offs, int(total), float(beta1),
                                                      float(beta2), bool(update_momentum))
        return sign, nz, int(n_bad), int(n_zero)

    # -- (b) momentum
    def momentum_update_list(self, momenta, grads, beta2):
        if _all_plain(grads, _GRAD_DTYPES) and _all_plain(momenta, _STATE_DTYPES):
            self._ext.momentum_update_list(list(momenta), list(grads), float(beta2))
            return
        for m, g in zip(momenta, grads):
            codec.momentum_update(m, g, beta2)

    # -- (c) vote + apply
    def vote_apply(self, sign, nonzero, params, offsets, lr, weight_decay, step, tie_break, vote, world_size, base=0,
                   return_delta=True):
        v = _vote(vote)
        t = _tie(tie_break) if v == 0 else 0
        offs = _offsets(offsets)
        if not (_planes_ok(sign, nonzero, False) and _all_plain(params, _STATE_DTYPES)):
            return codec.vote_apply(sign, nonzero, params, offs, lr, weight_decay, step, tie_break, vote, world_size,
                                    base)
        return self._ext.vote_apply(sign, nonzero, list(params), offs, float(lr), float(weight_decay), int(step), t,
                                    v, int(world_size), int(base), bool(return_delta))

    # -- (d) two-phase vote, phase 1
    def shard_vote(self, sign, nonzero, step, tie_break, base):
        t = _tie(tie_break)
        if not _planes_ok(sign, nonzero, True):
            return codec.shard_vote(sign, nonzero, step, tie_break, base)
        out_sign, out_nz = self._ext.shard_vote(sign, nonzero, int(step), t, int(base))
        return out_sign, out_nz

    # -- (e) p-bit count lanes
    def count_lanes(self, sign, nonzero, p):
        if p not in codec.LANE_WIDTHS:
            raise ValueError(f"lane width p must be one of {codec.LANE_WIDTHS}, got {p}")
        if not _planes_ok(sign, nonzero, True):
            return codec.count_lanes(sign, nonzero, p)
        top = (1 << p) - 1
        if nonzero is None and sign.shape[1] > 0 and sign.shape[0] > top:
            raise ValueError(f"count {sign.shape[0]} does not fit a {p}-bit lane")
        plus, cnt, mx = self._ext.count_lanes(sign, nonzero, int(p))
        if sign.shape[1] > 0 and mx > top:
            raise ValueError(f"count {mx} does not fit a {p}-bit lane")
        return plus, cnt

    # -- (f) summed lanes + apply
    def lanes_apply(self, plus_lanes, cnt_lanes, world_size, p, params, offsets, lr, weight_decay, step, tie_break,
                    vote, base=0, return_delta=True):
        if p not in codec.LANE_WIDTHS:
            raise ValueError(f"lane width p must be one of {codec.LANE_WIDTHS}, got {p}")
        v = _vote(vote)
        t = _tie(tie_break) if v == 0 else 0
        offs = _offsets(offsets)
        lanes_ok = _plain(plus_lanes, (torch.uint8,)) and (
            cnt_lanes is None or (_plain(cnt_lanes, (torch.uint8,)) and cnt_lanes.numel() == plus_lanes.numel()))
        if not (lanes_ok and _all_plain(params, _STATE_DTYPES)):
            return codec.lanes_apply(plus_lanes, cnt_lanes, world_size, p, params, offs, lr, weight_decay, step,
                                     tie_break, vote, base)
        return self._ext.lanes_apply(plus_lanes.reshape(-1), None if cnt_lanes is None else cnt_lanes.reshape(-1),
                                     int(world_size), int(p), list(params), offs, float(lr), float(weight_decay),
                                     int(step), t, v, int(base), bool(return_delta))

    # -- (g) int8 codes
    def int8_local_step(self, grads, momenta, offsets, total, beta1, kind, levels):
        if kind not in _KIND:
            raise ValueError(f"quant scale must be one of {codec.SCALE_KINDS}, got {kind!r}")
        offs = _offsets(offsets)
        if not (_all_plain(grads, _GRAD_DTYPES) and _all_plain(momenta, _STATE_DTYPES)) or not 1 <= levels <= 127:
            return codec.int8_local_step(grads, momenta, offs, total, beta1, kind, levels)
        q, n_bad = self._ext.int8_local_step(list(grads), list(momenta), offs, int(total), float(beta1), _KIND[kind],
                                             int(levels), self.vec_width)
        return q, int(n_bad)

    # -- (h) int8 apply
    def int8_apply(self, qsum, params, offsets, lr, weight_decay, return_delta=True):
        offs = _offsets(offsets)
        if not (_plain(qsum, (torch.int8,)) and _all_plain(params, _STATE_DTYPES)):
            return codec.int8_apply(qsum, params, offs, lr, weight_decay)
        return self._ext.int8_apply(qsum.reshape(-1), list(params), offs, float(lr), float(weight_decay),
                                    bool(return_delta))
