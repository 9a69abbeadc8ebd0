"""The one native-kernel loader: builds or finds the compiled extension, returns a backend.

``load("cpp")`` and ``load("cuda")`` return a :class:`~lioncub_ds.kernels.ops.NativeBackend` (CPU or
CUDA tensors) with exactly the signatures and results of the pure-torch reference
(:mod:`lioncub_ds.kernels.reference`). Loading the module registers its kernels as the CPU (or CUDA)
implementations of the ``torch.ops.lioncub`` ops that :mod:`lioncub_ds.kernels.ops` declares. It uses,
in order:

1. the module prebuilt by ``LIONCUB_BUILD_EXT=1 pip install .`` (``lioncub_ds._lioncub_cpu``;
   with ``LIONCUB_BUILD_CUDA=1`` also ``lioncub_ds._lioncub_cuda``), unless the sources next to
   the package differ from what it was built from;
2. a JIT build with :func:`torch.utils.cpp_extension.load` (ninja; cached in
   ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``; ~30-60 s the first time).

JIT builds of one extension are serialized across processes by :func:`build_lock`: an advisory
``flock`` on ``<build dir>/lioncub.lock``, which the kernel releases when its holder dies. A build
that was killed (Ctrl-C during the first import, an OOM kill) leaves torch's own lock file
(``<build dir>/lock``) behind, and torch would wait for it forever; the loader, holding the flock
(so no build is running), removes it with a warning. Waiting for a live build is bounded
(``LIONCUB_BUILD_WAIT_S``, default 1800 s): past it the error names the building process and the
lock file.

Sources and flags: :mod:`lioncub_ds.kernels.build` (the one table; setup.py reads it too).
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib
import logging
import os
import socket
import sys
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


BUILD_WAIT_S = 1800.0  # LIONCUB_BUILD_WAIT_S overrides: the longest wait for another process's build
TORCH_LOCK = "lock"    # torch.utils.cpp_extension's lock file (FileBaton) inside the build directory
OWN_LOCK = "lioncub.lock"


def jit_build_directory(name: str) -> str:
    """Where the JIT build of extension ``name`` lives: ``$TORCH_EXTENSIONS_DIR/<name>``, else
    under torch's default build root (:func:`torch.utils.cpp_extension.get_default_build_root`),
    one folder per Python version."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        root = os.path.join(get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}")
    return os.path.join(root, name)


def _owner(fd) -> str:
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").split()
        pid, host, since = text[0], text[1], float(text[2])
        return f"process {pid} on {host}, building for {time.time() - since:.0f} s"
    except (OSError, IndexError, ValueError):
        return "another process"


@contextlib.contextmanager
def build_lock(build_dir: str, wait_s: float | None = None):
    """Hold the build of the extension in ``build_dir`` (see the module docstring): wait at most
    ``wait_s`` seconds (default ``LIONCUB_BUILD_WAIT_S`` or BUILD_WAIT_S) for a live build by
    another process, then raise RuntimeError naming it and the lock file; once held, a lock file
    torch left behind (its build was killed) is removed with a warning."""
    if wait_s is None:
        wait_s = float(os.environ.get("LIONCUB_BUILD_WAIT_S", BUILD_WAIT_S))
    os.makedirs(build_dir, exist_ok=True)
    path = os.path.join(build_dir, OWN_LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline, told = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"lioncub_ds: waited {wait_s:.0f} s for the kernel build in {build_dir} by {_owner(fd)} "
                        f"(it holds {path}); it is still running: let it finish, or stop that process "
                        "(LIONCUB_BUILD_WAIT_S sets how long to wait; LIONCUB_KERNELS=torch needs no build)") from None
                if not told:
                    log.info("lioncub_ds: waiting for the kernel build in %s by %s", build_dir, _owner(fd))
                    told = True
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {time.time():.3f}\n".encode(), 0)
        stale = os.path.join(build_dir, TORCH_LOCK)
        if os.path.exists(stale):  # we hold the build: whoever made this file is gone
            log.warning("lioncub_ds: removing %s, left by a kernel build that was killed (no process is building "
                        "now); building again", stale)
            with contextlib.suppress(FileNotFoundError):
                os.remove(stale)
        yield
    finally:
        os.close(fd)  # releases the flock


def jit_load(name: str, **kwargs):
    """:func:`torch.utils.cpp_extension.load` of extension ``name`` in :func:`jit_build_directory`,
    under :func:`build_lock`."""
    from torch.utils.cpp_extension import load as cpp_load

    build_dir = jit_build_directory(name)
    with build_lock(build_dir):
        return cpp_load(name=name, build_directory=build_dir, **kwargs)


def _jit_build():
    root = csrc_dir()
    if root is None:
        raise RuntimeError("lioncub_ds: C++ kernel sources not found (looked for csrc/ next to and inside the "
                           "package); reinstall with LIONCUB_BUILD_EXT=1 or use LIONCUB_KERNELS=torch")
    verbose = os.environ.get("LIONCUB_BUILD_VERBOSE", "0") == "1"
    return jit_load(
        f"{EXT_NAME}_{source_hash(root)[:12]}",  # keyed by the sources: checkouts never evict each other
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

    if CUDA_HOME is None:
        raise RuntimeError("CUDA kernels need nvcc (CUDA_HOME not found)")
    root = csrc_dir()
    if root is None:
        raise RuntimeError("lioncub_ds: CUDA kernel sources not found")
    load("cpp")  # the CPU implementations of the ops (the CUDA build registers only its CUDA ones)
    with _lock:
        if "cuda" not in _loaded:
            from .ops import NativeBackend

            ext, how = _prebuilt(_build.CUDA_MODULE, cuda=True), "prebuilt"  # LIONCUB_BUILD_CUDA=1 pip install .
            if ext is None:
                how = "jit"
                ext = _retry(lambda: jit_load(
                    f"{_build.CUDA_EXT_NAME}_{source_hash(root, cuda=True)[:12]}", sources=[str(root / s) for s in CUDA_SOURCES],
                    extra_include_paths=[str(root)], extra_cflags=CFLAGS + list(_build.CUDA_DEFINES),
                    extra_ldflags=LDFLAGS, extra_cuda_cflags=CUDA_CFLAGS,
                    verbose=os.environ.get("LIONCUB_BUILD_VERBOSE", "0") == "1"))
            if not getattr(ext, "has_cuda", False):
                raise RuntimeError("the lioncub_cuda extension was built without CUDA")
            _loaded["cuda"], _loaded["cuda_origin"] = NativeBackend(ext, "cuda"), how
        return _loaded["cuda"]


def load(kind: str):
    """The native backend for ``kind`` ('cpp' or 'cuda'), built once per process."""
    if kind == "cpp":
        from .ops import NativeBackend  # first: the schemas the extension's kernels implement

        with _lock:
            be = _loaded.get("cpp")
        if be is None:
            be = NativeBackend(build_cpp_extension(), "cpu")
            with _lock:
                _loaded["cpp"] = be
        return be
    if kind == "cuda":
        return _load_cuda()
    raise ValueError(f"native kernel kind must be 'cpp' or 'cuda', got {kind!r}")
