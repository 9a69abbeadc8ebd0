"""The one table of kernel sources and build flags (standard library only).

Read by :mod:`lioncub_ds.kernels.loader` (JIT builds) and by ``setup.py`` (ahead-of-time builds, through
``runpy``, so that it works before torch is importable). Paths are relative to ``csrc/``.

``-ffp-contract=off`` / ``--fmad=false`` are part of the numerical contract: a fused multiply-add
would change results in the last bit (csrc/common/lioncub_common.h). No ``-march``: the CPU kernels
pick their AVX2 path at run time, so a built module may move between machines.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

# C++ CPU backend
CPP_EXT_NAME = "lioncub_cpu"             # JIT module name (TORCH_EXTENSIONS_DIR/<name>)
CPP_MODULE = "lioncub_ds._lioncub_cpu"   # prebuilt by LIONCUB_BUILD_EXT=1 pip install .
CPP_SOURCES = ("bindings.cpp", "cpu/lioncub_cpu_local.cpp", "cpu/lioncub_cpu_vote.cpp", "cpu/lioncub_cpu_dispatch.cpp")
CPP_HEADERS = ("eager_calls.h", "common/lioncub_common.h", "cpu/lioncub_cpu.h", "cpu/lioncub_cpu_detail.h",
               "cpu/lioncub_cpu_isa.h", "cpu/lioncub_cpu_isa_instantiate.h", "cpu/lioncub_cpu_local.inl",
               "cpu/lioncub_cpu_vote.inl")
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fno-fast-math")
LDFLAGS = ("-fopenmp",)

# CUDA backend: the same extension built with LIONCUB_WITH_CUDA and the .cu kernels
CUDA_EXT_NAME = "lioncub_cuda"
CUDA_MODULE = "lioncub_ds._lioncub_cuda"  # prebuilt by LIONCUB_BUILD_EXT=1 LIONCUB_BUILD_CUDA=1 pip install .
CUDA_SOURCES = CPP_SOURCES + ("cuda/lioncub_local.cu", "cuda/lioncub_vote.cu",
                              "cuda/lioncub_step.cu")
CUDA_HEADERS = CPP_HEADERS + ("cuda/lioncub_cuda.h", "cuda/lioncub_cuda_common.cuh", "cuda/lioncub_cuda_vote.cuh")
CUDA_DEFINES = ("-DLIONCUB_WITH_CUDA",)
NVCC_FLAGS = ("-O3", "-std=c++17", "--fmad=false")  # no FMA: the same bits as the CPU path


def source_hash(root, sources=CPP_SOURCES, headers=CPP_HEADERS) -> str:
    """sha1 of the kernel sources under ``root`` (csrc/); a built module's ``src_hash()`` is
    ``"h" + source_hash(...)`` of the sources it was built from."""
    root = Path(root)
    h = hashlib.sha1()
    for rel in tuple(sources) + tuple(headers):
        h.update(rel.encode())
        h.update((root / rel).read_bytes())
    return h.hexdigest()
