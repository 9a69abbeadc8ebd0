#!/usr/bin/env bash
# make check-cuda-build: build the CUDA extension (bindings.cpp with LIONCUB_WITH_CUDA + csrc/cuda/*.cu)
# against a CUDA build of torch, link it, and import it. No GPU needed. See docs/kernels.md.
#
# Its venv lives outside the repository ($LIONCUB_CUDA_BUILD_DIR, default ~/.cache/lioncub_cuda_build) and
# is reused while its stamp matches the pins below (the first run downloads ~2.7 GB). The build runs in a
# temporary copy of the working tree, so nothing lands in the repository. Exit status: 0 only when the
# module built, linked and imported with has_cuda; non-zero on any compile, link or import error.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

TORCH_PIN="torch===2.13.0"                # three '=': the plain PyPI build (CUDA 13), never the +cpu one
TOOLKIT_PIN="cuda-toolkit[nvcc,cccl]==13.0.3"
TOOLS_PIN="setuptools==84.2.1 ninja==1.13.2 numpy==2.4.6"
ARCHS="8.0;9.0"
PY=${PY:-python3}

base=${LIONCUB_CUDA_BUILD_DIR:-$HOME/.cache/lioncub_cuda_build}
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
venv="$base/venv-py$pyver"
want="$TORCH_PIN $TOOLKIT_PIN $TOOLS_PIN python$pyver"
say() { echo "[check-cuda-build] $*"; }
fail() { echo "[check-cuda-build] FAILED: $*" >&2; exit 1; }
t_start=$(date +%s)

# 1. The venv: CUDA torch + nvcc from PyPI, set up once per set of pins.
if [ "$(cat "$venv/.stamp" 2>/dev/null)" != "$want" ]; then
  say "setting up $venv (torch 2.13.0 CUDA 13 + nvcc 13.0: ~2.7 GB download, once)"
  rm -rf "$venv"
  mkdir -p "$base"
  "$PY" -m venv "$venv" || fail "could not create the venv $venv"
  # (the grep drops a find-links note that some machines' pip config prints for every package)
  # shellcheck disable=SC2086
  if ! "$venv/bin/python" -m pip install -q "$TORCH_PIN" "$TOOLKIT_PIN" $TOOLS_PIN 2>&1 \
      | { grep -v "^WARNING: Location '.*' is ignored" || true; }; then
    fail "could not install $TORCH_PIN $TOOLKIT_PIN into $venv"
  fi
  echo "$want" >"$venv/.stamp"
fi
vpy="$venv/bin/python"
site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
export CUDA_HOME="$site/nvidia/cu13"
[ -x "$CUDA_HOME/bin/nvcc" ] || fail "no nvcc at $CUDA_HOME/bin/nvcc (is $TOOLKIT_PIN installed in $venv?)"
# The toolkit wheel ships libcudart.so.13 only; the link step's -lcudart needs an unversioned name.
mkdir -p "$venv/cudart-link"
ln -sf "$CUDA_HOME/lib/libcudart.so.13" "$venv/cudart-link/libcudart.so"
export LIBRARY_PATH="$venv/cudart-link${LIBRARY_PATH:+:$LIBRARY_PATH}"
export PATH="$CUDA_HOME/bin:$venv/bin:$PATH"
export TORCH_CUDA_ARCH_LIST="$ARCHS" MAX_JOBS=${MAX_JOBS:-2}
unset PYTHONPATH
"$vpy" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else "torch in the venv is not a CUDA build")'
t_setup=$(date +%s)

# 2. Build and install from a temporary copy of the working tree (tracked and untracked, not ignored files).
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/src"
git ls-files -z --cached --others --exclude-standard \
  | tar --null --files-from=- --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$tmp/src"
say "building lioncub_ds._lioncub_cuda (sm ${ARCHS}, $MAX_JOBS jobs; log: $tmp/build.log while it runs)"
if ! (cd "$tmp/src" && LIONCUB_BUILD_EXT=1 LIONCUB_BUILD_CUDA=1 nice -n 10 \
      "$vpy" -m pip install -v --no-build-isolation --no-deps . >"$tmp/build.log" 2>&1); then
  grep -E '(error|Error)[: ]' "$tmp/build.log" | grep -v '^ *warning' | head -n 40 >&2 || true
  echo "---- last lines of the build log ----" >&2
  tail -n 30 "$tmp/build.log" >&2
  fail "the CUDA extension did not compile or link (above)"
fi
for arch in 80 90; do  # TORCH_CUDA_ARCH_LIST reached nvcc
  grep -q "arch=compute_$arch,code=sm_$arch" "$tmp/build.log" || fail "nvcc was not asked for sm_$arch"
done
t_build=$(date +%s)

# 3. Import it with the venv's python, outside the repository, and check what the loader checks.
cd "$tmp"
"$vpy" - <<'EOF' || fail "the CUDA extension built but does not import or is not the one the loader would choose"
import torch
import torch.utils.cpp_extension as cpp_ext

import importlib

import lioncub_ds
from lioncub_ds.kernels import build, loader, ops

assert "site-packages" in lioncub_ds.__file__, lioncub_ds.__file__  # the installed copy, not a checkout
ext = importlib.import_module(build.CUDA_MODULE)
assert ext.has_cuda is True, "built without LIONCUB_WITH_CUDA"
want = "h" + loader.source_hash(cuda=True)
assert ext.src_hash() == want, (ext.src_hash(), want)
# Every op (but abstain_list, whose CUDA implementation is the reference's torch ops) has its direct
# entry (cuda_<op>, the eager path) and a CUDA kernel registered for torch.ops.lioncub.<op>.
names = ["cuda_" + n for n in sorted(ops.SCHEMAS) if n != "abstain_list"]
missing = [n for n in names if not hasattr(ext, n)]
assert names and not missing, f"not bound: {missing}"
unregistered = [n for n in ops.SCHEMAS if not torch._C._dispatch_has_kernel_for_dispatch_key(f"lioncub::{n}", "CUDA")]
assert not unregistered, f"no CUDA kernel registered for {unregistered}"
cpu = importlib.import_module(build.CPP_MODULE)
assert cpu.has_cuda is False and cpu.src_hash() == "h" + loader.source_hash(), "the CPU module of the same build"

gpu = torch.cuda.is_available()
# The loader on a CUDA device: pretend one is there and forbid any JIT build, so it must take this module.
torch.cuda.is_available = lambda: True
def no_jit(*a, **k):
    raise AssertionError("the loader tried to JIT-build instead of using the prebuilt module")
cpp_ext.load = no_jit
be = loader.load("cuda")
assert be.name == "cuda" and be._ext is ext
print(f"[check-cuda-build] imported {ext.__file__.split('site-packages/')[-1]}: has_cuda=True, "
      f"src_hash matches, {len(names)} CUDA entry points bound; torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"GPU present: {gpu}")
EOF
say "ok: setup $((t_setup - t_start)) s, build $((t_build - t_setup)) s, import check $(($(date +%s) - t_build)) s"
