"""The one native-kernel loader: builds or finds the compiled extension, returns a backend.

``load("cpp")`` returns :class:`~lioncub_ds.kernels.cpp.CppBackend`, ``load("cuda")``
:class:`~lioncub_ds.kernels.cuda.CudaBackend`; both have exactly the signatures and results
of the pure-torch reference (:mod:`lioncub_ds.kernels.reference`). It uses, in order:

1. the module prebuilt by ``LIONCUB_BUILD_EXT=1 pip install .`` (``lioncub_ds._lioncub_cpu``;
   with ``LIONCUB_BUILD_CUDA=1`` also ``lioncub_ds._lioncub_cuda``), unless the sources next to
   the package differ from what it was built from;
2. a JIT build with :func:`torch.utils.cpp_extension.load` (ninja; cached in
   ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``; ~30-60 s the first time).

Sources and flags: :mod:`lioncub_ds.kernels.build` (the one table; setup.py reads it too).
"""
from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

from . import build as _build

log = logging.getLogger("lioncub_ds")

EXT_NAME = _build.CPP_EXT_NAME
PREBUILT_MODULE = _build.CPP_MODULE
CFLAGS = list(_build.CFLAGS)
LDFLAGS = list(_build.LDFLAGS)
SOURCES = _build.CPP_SOURCES
HEADERS = _build.CPP_HEADERS

_lock = threading.Lock()
_loaded: dict = {}


# ----------------------------------------------------------------------------- sources / build
def csrc_dir() -> Path | None:
    """The kernel sources: ``<repo>/csrc`` (checkout, editable install) or ``lioncub_ds/csrc``
    (a wheel/sdist install, copied there by setup.py)."""
    here = Path(__file__).resolve().parent.parent  # the lioncub_ds package
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
            mod, how = _prebuilt(), "prebuilt"
            if mod is None:
                mod, how = _retry(_jit_build), "jit"
            _loaded["cpp_ext"], _loaded["cpp_origin"] = mod, how
        return _loaded["cpp_ext"]


def origin(kind: str = "cpp") -> str | None:
    """How this process got the ``kind`` ('cpp' or 'cuda') extension: ``"prebuilt"`` (the module
    installed with ``LIONCUB_BUILD_EXT=1``), ``"jit"`` (built or taken from the JIT cache), or None
    when it has not been loaded."""
    with _lock:
        return _loaded.get("cpp_origin" if kind == "cpp" else "cuda_origin")


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
            from .cuda import CudaBackend

            ext, how = _prebuilt(_build.CUDA_MODULE, cuda=True), "prebuilt"  # LIONCUB_BUILD_CUDA=1 pip install .
            if ext is None:
                how = "jit"
                ext = _retry(lambda: cpp_load(
                    name=f"{_build.CUDA_EXT_NAME}_{source_hash(root, cuda=True)[:12]}", sources=[str(root / s) for s in CUDA_SOURCES],
                    extra_include_paths=[str(root)], extra_cflags=CFLAGS + list(_build.CUDA_DEFINES),
                    extra_ldflags=LDFLAGS, extra_cuda_cflags=CUDA_CFLAGS,
                    verbose=os.environ.get("LIONCUB_BUILD_VERBOSE", "0") == "1"))
            if not getattr(ext, "has_cuda", False):
                raise RuntimeError("the lioncub_cuda extension was built without CUDA")
            _loaded["cuda"], _loaded["cuda_origin"] = CudaBackend(ext), how
        return _loaded["cuda"]


def load(kind: str):
    """The native backend for ``kind`` ('cpp' or 'cuda'), built once per process."""
    if kind == "cpp":
        from .cpp import CppBackend

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
