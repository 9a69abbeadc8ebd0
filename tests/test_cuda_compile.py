"""Every CUDA source compiles with nvcc for sm_80 (A100) and sm_90 (H100), no GPU needed.

The .cu files include only CUDA runtime / bf16 / fp16 and standard headers (never torch),
so `nvcc -c` builds them on a CPU-only machine. Compiles run two at a time, once per
session; each (file, arch) is its own test. Skipped only when nvcc is absent (looked up
on PATH and in /usr/local/cuda/bin).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # nvcc itself: dist

ROOT = Path(__file__).resolve().parents[1]
CUDA_DIR = ROOT / "csrc" / "cuda"
SOURCES = sorted(p.name for p in CUDA_DIR.glob("*.cu"))
ARCHS = ("80", "90")
FLAGS = ("-c", "-std=c++17", "--fmad=false", "-O3")
HEADERS = sorted(p.name for p in CUDA_DIR.iterdir() if p.suffix in (".h", ".cuh"))
ALLOWED_INCLUDES = {"cuda_runtime.h", "cuda_runtime_api.h", "cuda_bf16.h", "cuda_fp16.h", "vector_types.h",
                    "stdint.h", "stddef.h", "string.h", "math.h", "cstdint", "cstddef", "cstring", "cmath",
                    "../common/lioncub_common.h", *HEADERS}
MAX_LINES = 800  # per C++ / CUDA file (issue 21)
COMMON = ROOT / "csrc" / "common" / "lioncub_common.h"


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    cand = Path("/usr/local/cuda/bin/nvcc")
    return str(cand) if cand.exists() else None


NVCC = find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH or in /usr/local/cuda/bin: "
                                                      "the CUDA sources cannot be compiled on this machine")


def _compile(src: str, arch: str, outdir: str):
    cmd = [NVCC, *FLAGS, "-gencode", f"arch=compute_{arch},code=sm_{arch}", str(CUDA_DIR / src),
           "-o", str(Path(outdir) / f"{src}.sm_{arch}.o")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    return cmd, res.returncode, res.stdout + res.stderr


@pytest.fixture(scope="module")
def compiled():
    """All (file, arch) compiles, two in parallel (each takes ~10-30 s)."""
    outdir = tempfile.mkdtemp(prefix="lioncub_nvcc_")
    jobs = [(src, arch) for src in SOURCES for arch in ARCHS]
    # the slowest (largest) sources first so the two workers finish together
    jobs.sort(key=lambda j: -(CUDA_DIR / j[0]).stat().st_size)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(jobs, pool.map(lambda j: _compile(j[0], j[1], outdir), jobs)))
    yield results
    shutil.rmtree(outdir, ignore_errors=True)


def test_sources_exist():
    assert {"lioncub_local.cu", "lioncub_vote.cu", "lioncub_step.cu"} <= set(SOURCES), SOURCES
    assert (CUDA_DIR / "lioncub_cuda.h").exists() and COMMON.exists()
    # the host emulation is test-only: it lives under tests/, never in csrc/ (the wheel ships csrc/)
    assert not list(CUDA_DIR.glob("*emu*")) and (ROOT / "tests" / "cuda_emu" / "lioncub_cuda_emu.cpp").exists()


@pytest.mark.parametrize("src", SOURCES + HEADERS + ["../common/lioncub_common.h"])
def test_sources_include_no_torch(src):
    text = (CUDA_DIR / src).read_text()
    includes = re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', text, flags=re.M)
    bad = [h for h in includes if h not in ALLOWED_INCLUDES]
    assert not bad, f"{src} includes {bad}: csrc/cuda may include only CUDA runtime and standard headers"


def test_no_source_file_is_too_long():
    files = [p for d in (ROOT / "csrc", ROOT / "tests" / "cuda_emu") for p in d.rglob("*") if p.is_file()]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert len(files) > 10 and not long, f"split these files (over {MAX_LINES} lines): {long}"


@pytest.mark.dist
@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("src", SOURCES)
def test_nvcc_compiles(compiled, src, arch):
    cmd, rc, log = compiled[(src, arch)]
    assert rc == 0, f"nvcc failed for {src} sm_{arch}:\n$ {' '.join(cmd)}\n{log}"


def test_cuda_backend_has_the_reference_signatures():
    """The CUDA wrapper (importable without a GPU) exposes every backend method with the
    TorchBackend parameters (plus the optional return_delta)."""
    import inspect

    from lioncub_ds.kernels.ops import NativeBackend
    from lioncub_ds.kernels import TorchBackend

    for name in ("local_step", "momentum_update_list", "vote_apply", "shard_vote", "count_lanes", "lanes_apply",
                 "int8_local_step", "int8_apply"):
        ref = [p for p in inspect.signature(getattr(TorchBackend, name)).parameters if p != "self"]
        got = [p for p in inspect.signature(getattr(NativeBackend, name)).parameters if p != "self"]
        assert got[:len(ref)] == ref or got == ref, (name, ref, got)


def test_one_build_table():
    """lioncub_ds/kernels/build.py is the only list of sources and flags: setup.py reads it (via
    runpy, no torch), the JIT loader uses it, it covers every file under csrc/ (so the source hash
    sees every change), and the CUDA build produces the module the CUDA loader loads."""
    import runpy

    from lioncub_ds.kernels import loader

    table = runpy.run_path(str(ROOT / "lioncub_ds" / "kernels" / "build.py"))
    listed = set(table["CUDA_SOURCES"]) | set(table["CUDA_HEADERS"])
    on_disk = {str(p.relative_to(ROOT / "csrc")) for p in (ROOT / "csrc").rglob("*") if p.is_file()}
    assert on_disk == listed, f"csrc/ files not in the build table: {on_disk - listed}; listed but absent: {listed - on_disk}"
    assert loader.SOURCES == table["CPP_SOURCES"] and loader.CUDA_SOURCES == table["CUDA_SOURCES"]
    assert table["CUDA_MODULE"] == "lioncub_ds._lioncub_cuda" and table["CPP_MODULE"] == loader.PREBUILT_MODULE
    setup_text = (ROOT / "setup.py").read_text()
    assert "kernels\" / \"build.py\"" in setup_text or "kernels/build.py" in setup_text
    assert "cpu/" not in setup_text and ".cu\"" not in setup_text, "setup.py must not list sources itself"
    assert 'BUILD["CUDA_MODULE"]' in setup_text
