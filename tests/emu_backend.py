"""The host emulation of the CUDA kernels as a kernel backend (tests only; tests/cuda_emu/).

:func:`emu_lib` compiles ``csrc/cuda/*.cu`` with the host C++ compiler (``tests/cuda_emu/include``
first on the include path: the device-side names) and links them with the emulation runtime
``tests/cuda_emu/lioncub_cuda_emu.cpp``: the result holds the kernels' own C API
(``csrc/cuda/lioncub_cuda.h``), and each launch runs the real ``__global__`` functions, their
launch configuration, shared memory, barriers and warp shuffles, on an emulated device of a
settable number of SMs (tests/cuda_emu/lioncub_cuda_emu.cpp says what it still cannot see).
:class:`EmuBackend` calls that API through ctypes on CPU tensors, behind the TorchBackend
signatures, building the argument arrays exactly as the CUDA half of ``csrc/bindings.cpp`` does.

The build needs only a C++17 compiler (``$CXX`` or c++ / g++), no CUDA; it is cached by the hash
of its sources under the temp folder.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lioncub_ds.kernels import reference

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
EMU_DIR = ROOT / "tests" / "cuda_emu"
KERNELS = sorted((CSRC / "cuda").glob("*.cu"))
RUNTIME = [EMU_DIR / "lioncub_cuda_emu.cpp", EMU_DIR / "emu_selftest.cu"]  # the runtime + its own tests
FLAGS = ["-std=c++17", "-O2", "-fPIC", "-ffp-contract=off", "-Wall", "-Wno-unknown-pragmas"]

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
TIE_CODE, VOTE_CODE, SCALE_CODE = reference.TIE_CODES, reference.VOTE_CODES, reference.SCALE_CODES
ROUNDING_CODE = reference.ROUNDING_CODES
LC_CHUNK = 16384

P, I, L, U = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint64
F, D, SZ = ctypes.c_float, ctypes.c_double, ctypes.c_size_t


class LionArgs(ctypes.Structure):  # lc_lion_args (csrc/common/lioncub_common.h)
    _fields_ = [("b1", F), ("omb1", F), ("b2", F), ("omb2", F)]


class ApplyArgs(ctypes.Structure):  # lc_apply_args
    _fields_ = [("neg_lr", F), ("decay", F), ("apply_decay", ctypes.c_int32), ("tie", ctypes.c_int32),
                ("vote", ctypes.c_int32), ("world_size", ctypes.c_int32), ("step", L), ("tie_rows", P),
                ("tie_nrows", L)]


class BBitArgs(ctypes.Structure):  # lc_bbit_args
    _fields_ = [("bits", ctypes.c_int32), ("rounding", ctypes.c_int32), ("kind", ctypes.c_int32),
                ("seed", ctypes.c_uint32), ("tie_rows", P), ("tie_nrows", L)]


class LionStepArgs(ctypes.Structure):  # lc_lion_step_args
    _fields_ = [("betas", LionArgs), ("neg_lr", F), ("decay", F), ("apply_decay", ctypes.c_int32)]


# the C API of csrc/cuda/lioncub_cuda.h (+ lc_make_* of csrc/common, exported by the runtime)
SIGNATURES = {
    "lc_local_step": ([P, I, L, LionArgs, I, P, P, P, P], I),
    "lc_momentum_update": ([P, I, L, LionArgs, P], I),
    "lc_int8_workspace_bytes": ([L], SZ),
    "lc_int8_local_step": ([P, I, L, L, LionArgs, I, I, P, P, P, SZ, P, P], I),
    "lc_vote_apply": ([P, P, I, L, P, I, ApplyArgs, P, P], I),
    "lc_shard_vote": ([P, P, I, L, I, L, P, L, P, P, P], I),
    "lc_count_lanes": ([P, P, I, L, I, P, P, P, P], I),
    "lc_lanes_apply": ([P, P, L, I, P, I, ApplyArgs, P, P], I),
    "lc_int8_apply": ([P, L, P, I, ApplyArgs, P, P], I),
    "lc_lion_step": ([P, I, L, LionStepArgs, P], I),
    "lc_zero_sign_apply": ([P, L, P, L, P, I, L, P], I),
    "lc_bbit_local_step": ([P, I, L, L, LionArgs, BBitArgs, I, P, P, P, P, SZ, P, P], I),
    "lc_bbit_shard_vote": ([P, P, I, I, L, I, L, P, L, P, P, P], I),
    "lc_emu_configure": ([I, U], I),
    "lc_emu_selftest": ([I, P, I], I),
    "lc_emu_lion_args": ([D, D], LionArgs),
    "lc_emu_apply_args": ([D, D, L, I, I, I, P, L], ApplyArgs),
    "lc_emu_lion_step_args": ([D, D, D, D], LionStepArgs),
}

_LIB: dict = {}


def _compiler() -> str:
    for cand in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cand and shutil.which(cand):
            return cand
    raise RuntimeError("no C++ compiler found ($CXX, c++, g++, clang++): cannot build the CUDA host emulation")


def emu_lib():
    """The emulation library (built once per source hash, then cached on disk and in the process)."""
    if "lib" in _LIB:
        return _LIB["lib"]
    cxx = _compiler()
    sources = KERNELS + RUNTIME
    h = hashlib.sha1(" ".join([cxx] + FLAGS).encode())
    for p in sorted(sources + list(CSRC.rglob("*.h")) + list(CSRC.rglob("*.cuh")) + list(EMU_DIR.rglob("*.h"))):
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    cache = Path(tempfile.gettempdir()) / f"lioncub_cuda_emu_{os.getuid()}"
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"{h.hexdigest()[:16]}.so"
    if not out.exists():
        build = Path(tempfile.mkdtemp(prefix="build_", dir=cache))
        inc = ["-I", str(EMU_DIR / "include")]

        def compile_one(src: Path):
            lang = ["-x", "c++"] if src.suffix == ".cu" else []
            cmd = [cxx, *FLAGS, *inc, *lang, "-c", str(src), "-o", str(build / (src.name + ".o"))]
            res = subprocess.run(cmd, capture_output=True, text=True)
            return cmd, res

        with ThreadPoolExecutor(max_workers=2) as pool:
            for cmd, res in pool.map(compile_one, sources):
                if res.returncode != 0:
                    raise RuntimeError(f"building the CUDA host emulation failed:\n$ {' '.join(cmd)}\n{res.stderr}")
        tmp = build / "emu.so"
        cmd = [cxx, "-shared", *[str(build / (s.name + ".o")) for s in sources], "-o", str(tmp)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"linking the CUDA host emulation failed:\n$ {' '.join(cmd)}\n{res.stderr}")
        os.replace(tmp, out)  # atomic: a concurrent session sees a whole library or none
        shutil.rmtree(build, ignore_errors=True)
    lib = ctypes.CDLL(str(out))
    for name, (args, res) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    _LIB["lib"] = lib
    return lib


def _ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def build_meta(a_list, b_list, offsets, limit=None, bucket=True):
    """int64 [T, 6] lc_tensor_meta rows, sorted by offset (what bindings.cpp builds for CUDA).

    bucket=False: a plain list (momentum update), no offsets, no order, no layout checks."""
    rows = []
    for i, a in enumerate(a_list):
        if a.numel() == 0:
            continue
        b = None if b_list is None else b_list[i]
        off = int(offsets[i])
        assert off % 8 == 0, "tensor offsets must be multiples of 8"
        dt = DTYPE_CODE[a.dtype] | ((DTYPE_CODE[b.dtype] << 8) if b is not None else 0)
        rows.append([a.data_ptr(), 0 if b is None else b.data_ptr(), off, a.numel(), 0, dt])
    if bucket:
        rows.sort(key=lambda r: r[2])
    chunks = 0
    for k, r in enumerate(rows):
        if bucket and k and r[2] < rows[k - 1][2] + rows[k - 1][3]:
            raise ValueError("tensors overlap in the bucket")
        if limit is not None and r[2] + r[3] > limit:
            raise ValueError("tensor beyond the end of the bucket")
        r[4] = chunks
        chunks += (r[3] + LC_CHUNK - 1) // LC_CHUNK
    meta = torch.tensor(rows, dtype=torch.int64).reshape(-1, 6)
    return meta, len(rows), chunks


class EmuBackend:
    """The CUDA kernels, run by the host emulation, behind the TorchBackend signatures (CPU tensors).

    ``sms``: the emulated device's multiprocessors (the grid sizes lc::grid_for picks: at most 8
    blocks of 256 threads per SM, so small counts make every grid-stride loop go round);
    ``seed``: 0 runs threads and blocks in index order, else in a permutation of that seed."""

    name = "emu"

    def __init__(self, sms: int = 1, seed: int = 0):
        self.lib = emu_lib()
        self.sms, self.seed = sms, seed

    def _call(self, fn, *args):
        assert self.lib.lc_emu_configure(self.sms, self.seed) == 0
        rc = getattr(self.lib, fn)(*args)
        assert rc == 0, f"{fn} returned cudaError {rc}"

    def _apply(self, lr, weight_decay, step=0, tie_break="zero", vote="majority", world_size=1, segs=None):
        return self.lib.lc_emu_apply_args(lr, weight_decay, step, TIE_CODE[tie_break], VOTE_CODE[vote], world_size,
                                          _ptr(segs), 0 if segs is None else segs.shape[0])

    def local_step(self, grads, momenta, offsets, total, beta1, beta2, update_momentum=False):
        grads = [g.contiguous() for g in grads]
        meta, nt, _ = build_meta(grads, momenta, offsets, total)
        sign = torch.empty(total // 8, dtype=torch.uint8)
        nz = torch.empty(total // 8, dtype=torch.uint8)
        counts = torch.zeros(2, dtype=torch.int64)
        self._call("lc_local_step", _ptr(meta), nt, total, self.lib.lc_emu_lion_args(beta1, beta2),
                   int(update_momentum), _ptr(sign), _ptr(nz), _ptr(counts), None)
        return sign, nz, int(counts[0]), int(counts[1])

    def momentum_update_list(self, momenta, grads, beta2):
        grads = [g.contiguous() for g in grads]
        meta, nt, chunks = build_meta(grads, momenta, [0] * len(grads), bucket=False)
        self._call("lc_momentum_update", _ptr(meta), nt, chunks, self.lib.lc_emu_lion_args(0.0, beta2), None)

    def vote_apply(self, sign, nonzero, params, offsets, lr, weight_decay, step, tie_break, vote, world_size,
                   segments=None, return_delta=True):
        segs = reference.tie_segments(offsets) if segments is None else reference.as_segments(segments)
        rows = sign.shape[0] if sign.dim() > 1 else 1
        row_bytes = sign.numel() // rows
        meta, nt, _ = build_meta(params, None, offsets, row_bytes * 8)
        delta = torch.empty(row_bytes * 8, dtype=torch.float32) if return_delta else None
        tie = tie_break if vote == "majority" else "zero"
        self._call("lc_vote_apply", _ptr(sign), _ptr(nonzero), rows, row_bytes, _ptr(meta), nt,
                   self._apply(lr, weight_decay, step, tie, vote, world_size, segs), _ptr(delta), None)
        return delta

    def shard_vote(self, sign, nonzero, step, tie_break, segments):
        segs = reference.as_segments(segments)
        rows, s = sign.shape
        out_s = torch.empty(s, dtype=torch.uint8)
        out_z = torch.empty(s, dtype=torch.uint8)
        self._call("lc_shard_vote", _ptr(sign), _ptr(nonzero), rows, s, TIE_CODE[tie_break], step, _ptr(segs),
                   segs.shape[0], _ptr(out_s), _ptr(out_z), None)
        return out_s, out_z

    def count_lanes(self, sign, nonzero, p):
        rows, s = sign.shape
        if nonzero is None and rows > (1 << p) - 1 and s > 0:
            raise ValueError(f"count {rows} does not fit a {p}-bit lane")
        plus = torch.empty(s * p, dtype=torch.uint8)
        cnt = None if nonzero is None else torch.empty(s * p, dtype=torch.uint8)
        overflow = torch.zeros(1, dtype=torch.int32)
        self._call("lc_count_lanes", _ptr(sign), _ptr(nonzero), rows, s, p, _ptr(plus), _ptr(cnt), _ptr(overflow),
                   None)
        if int(overflow[0]):
            raise ValueError(f"a count does not fit a {p}-bit lane")
        return plus, cnt

    def lanes_apply(self, plus_lanes, cnt_lanes, world_size, p, params, offsets, lr, weight_decay, step, tie_break,
                    vote, segments=None, return_delta=True):
        segs = reference.tie_segments(offsets) if segments is None else reference.as_segments(segments)
        numel = plus_lanes.numel() * 8 // p
        meta, nt, _ = build_meta(params, None, offsets, numel)
        delta = torch.empty(numel, dtype=torch.float32) if return_delta else None
        tie = tie_break if vote == "majority" else "zero"
        self._call("lc_lanes_apply", _ptr(plus_lanes), _ptr(cnt_lanes), numel, p, _ptr(meta), nt,
                   self._apply(lr, weight_decay, step, tie, vote, world_size, segs), _ptr(delta), None)
        return delta

    def int8_local_step(self, grads, momenta, offsets, total, beta1, kind, levels):
        grads = [g.contiguous() for g in grads]
        meta, nt, chunks = build_meta(grads, momenta, offsets, total)
        q = torch.empty(total, dtype=torch.int8)
        scales = torch.zeros(max(nt, 1), dtype=torch.float32)
        n_bad = torch.zeros(1, dtype=torch.int64)
        ws_bytes = self.lib.lc_int8_workspace_bytes(chunks)
        ws = torch.empty(max(ws_bytes, 8), dtype=torch.uint8)
        self._call("lc_int8_local_step", _ptr(meta), nt, chunks, total, self.lib.lc_emu_lion_args(beta1, 0.0),
                   SCALE_CODE[kind], levels, _ptr(q), _ptr(scales), _ptr(ws), ws_bytes, _ptr(n_bad), None)
        return q, int(n_bad[0])

    def int8_apply(self, qsum, params, offsets, lr, weight_decay, return_delta=True):
        numel = qsum.numel()
        meta, nt, _ = build_meta(params, None, offsets, numel)
        delta = torch.empty(numel, dtype=torch.float32) if return_delta else None
        self._call("lc_int8_apply", _ptr(qsum), numel, _ptr(meta), nt, self._apply(lr, weight_decay), _ptr(delta),
                   None)
        return delta

    def lion_step(self, params, grads, momenta, lr, weight_decay, beta1, beta2):
        grads = [g.contiguous() for g in grads]
        rows, chunks = [], 0
        for p, g, m in zip(params, grads, momenta):
            if p.numel() == 0:
                continue
            dt = DTYPE_CODE[p.dtype] | (DTYPE_CODE[g.dtype] << 8) | (DTYPE_CODE[m.dtype] << 16)
            rows.append([p.data_ptr(), g.data_ptr(), m.data_ptr(), p.numel(), chunks, dt])
            chunks += (p.numel() + LC_CHUNK - 1) // LC_CHUNK
        meta = torch.tensor(rows, dtype=torch.int64).reshape(-1, 6)
        self._call("lc_lion_step", _ptr(meta), len(rows), chunks,
                   self.lib.lc_emu_lion_step_args(lr, weight_decay, beta1, beta2), None)

    def zero_sign_apply(self, sign, nonzero, targets, casts, layout, lrs, weight_decays):
        """The pieces the binding builds (lc_zero_piece, 64 bytes each) from the layout's rows."""
        raw, chunks = b"", 0
        for g, row, bit, start, numel in layout.rows():
            t, c = targets[g], None if casts is None else casts[g]
            a = self.lib.lc_emu_lion_step_args(lrs[g], weight_decays[g], 0.0, 0.0)
            raw += struct.pack("<QQqqqqffii", t.data_ptr() + 4 * start,
                               0 if c is None else c.data_ptr() + c.element_size() * start, row, bit, numel, chunks,
                               a.neg_lr, a.decay, a.apply_decay, 0 if c is None else DTYPE_CODE[c.dtype])
            chunks += (numel + LC_CHUNK - 1) // LC_CHUNK
        pieces = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(64, dtype=torch.uint8)
        self._call("lc_zero_sign_apply", _ptr(sign), sign.shape[1], _ptr(nonzero),
                   0 if nonzero is None else nonzero.shape[1], _ptr(pieces), len(layout.rows()), chunks, None)

    def bbit_local_step(self, grads, momenta, offsets, total, beta1, beta2, kind, bits, rounding, seed, segments,
                        update_momentum=False, device_counts=False, momenta_out=None):
        if update_momentum and momenta_out is not None:  # as the CUDA backend: the in-place step on copies
            for o, m in zip(momenta_out, momenta):
                o.copy_(m)
            momenta = list(momenta_out)
        grads = [g.contiguous() for g in grads]
        segs = reference.as_segments(segments)
        meta, nt, chunks = build_meta(grads, momenta, offsets, total)
        planes = torch.empty(bits, total // 8, dtype=torch.uint8)
        nz = torch.empty(total // 8, dtype=torch.uint8)
        ratios = torch.zeros(max(nt, 1), dtype=torch.float32)
        counts = torch.zeros(2, dtype=torch.int64)
        ws_bytes = self.lib.lc_int8_workspace_bytes(chunks)
        ws = torch.empty(max(ws_bytes, 8), dtype=torch.uint8)
        bb = BBitArgs(bits, ROUNDING_CODE[rounding], SCALE_CODE[kind], seed, _ptr(segs), segs.shape[0])
        self._call("lc_bbit_local_step", _ptr(meta), nt, chunks, total, self.lib.lc_emu_lion_args(beta1, beta2), bb,
                   int(update_momentum), _ptr(planes), _ptr(nz), _ptr(ratios), _ptr(ws), ws_bytes, _ptr(counts), None)
        if device_counts:
            return planes, nz, counts[0].clone(), counts[1].clone()
        return planes, nz, int(counts[0]), int(counts[1])

    def bbit_shard_vote(self, planes, nonzero, bits, step, tie_break, segments):
        segs = reference.as_segments(segments)
        planes = planes.contiguous()
        rows, _, s = planes.shape
        out_s = torch.empty(s, dtype=torch.uint8)
        out_z = torch.empty(s, dtype=torch.uint8)
        self._call("lc_bbit_shard_vote", _ptr(planes), _ptr(nonzero), rows, bits, s, TIE_CODE[tie_break],
                   step, _ptr(segs), segs.shape[0], _ptr(out_s), _ptr(out_z), None)
        return out_s, out_z
