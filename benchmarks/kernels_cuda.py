"""CUDA kernel benchmark (docs/kernels.md, docs/results.md): kernels timed, not calls.

    python -m benchmarks kernels --device cuda [--json PATH]      (needs a GPU)
    from benchmarks.kernels_cuda import run_cuda; run_cuda("results/kernels_cuda.json")
    run_cuda(None, dry_run=True)   # the same code path on CPU tensors and the C++ kernels (tests)

Per kernel x dtype (fp32, bf16) x size (default 1M, 16M, 268M elements), each kernel called as the
optimizer calls it (``device_counts=True``: no host read; no Δ returned; the bucket's offsets list and
tensors kept from call to call, so its layout is built once), it records:

* ``call_us``: the time per call as a user sees it: from the call to the end of its device work
  (synchronize before and after; median);
* ``kernel_us``: the device time of the call's kernels, L2 flushed before every repetition (a uint8
  buffer of twice the L2 written between reps): the profiler's kernel times (CUPTI, the flush kernels
  left out) when it records any, else CUDA events around the call; ``b2b_us``: back-to-back calls
  between two events (the host's launch cost hidden when it is shorter than the kernel);
* ``host_us``: the host time of one call (its Python and binding, the launches; no synchronize);
* the floor: ``floor_bytes_per_param`` (what the kernel must read and write: every input once, every
  output once) over the device-to-device copy bandwidth measured in the same run, and the kernel's
  fraction of it (``frac_of_floor`` = floor / kernel time); a kernel that reads its inputs twice
  (``passes`` 2: the int8 / bbit local steps, whose per-tensor scale needs the whole tensor before
  the first code) also gives ``kernel_bytes_per_param`` (what it moves) and the fraction of that;
* lion-pytorch's Triton step at each size (``impl: lion_pytorch_triton``) when it is installed.

The unfused torch path (``with_torch=True``) is timed the same way at the smallest size only.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from lioncub_ds import kernels
from lioncub_ds.kernels import reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SIZES = (1 << 20, 1 << 24, 1 << 28)
LION_TENSORS = (0.5, 0.25, 0.25)  # the Lion step's tensor sizes as fractions (one odd tensor added)


# ----------------------------------------------------------------------------- timers
class CudaTimer:
    """Device timing on a CUDA device: events, the profiler's kernel times, an L2 flush."""

    dry = False

    def __init__(self, device):
        self.device = device
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (64 << 20)
        self.flush_buf = torch.empty(2 * l2, dtype=torch.uint8, device=device)
        self._flush_names = None

    def sync(self):
        torch.cuda.synchronize(self.device)

    def flush(self):
        self.flush_buf.zero_()

    def flush_names(self) -> set:
        """Names of the kernels the flush launches (left out of the profiler's sums)."""
        if self._flush_names is None:
            self._flush_names = {e.name for e in self._profile(self.flush, 1)}
        return self._flush_names

    def _profile(self, fn, reps):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            self.sync()
        return [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
                and e.device_time > 0 and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]

    def events_us(self, fn, reps, flush) -> float:
        times = []
        for _ in range(reps):
            if flush:
                self.flush()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    def kernel_us(self, fn, reps) -> tuple[float, str]:
        """Device µs per call of ``fn``'s kernels, L2 flushed before each rep: (time, how)."""
        flush = self.flush_names()

        def rep():
            self.flush()
            fn()

        try:
            evs = [e for e in self._profile(rep, reps) if e.name not in flush]
        except Exception:  # noqa: BLE001 - no CUPTI on this image: events instead
            evs = []
        if evs:
            return sum(e.device_time for e in evs) / reps, "profiler"
        return self.events_us(fn, reps, flush=True), "events"

    def b2b_us(self, fn, reps) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / reps


class HostTimer:
    """The dry run's timer: CPU tensors, wall clock for every figure (checks the code path, not a GPU)."""

    dry = True

    def __init__(self, device):
        self.device = device

    def sync(self):
        pass

    def flush(self):
        pass

    def _wall(self, fn, reps):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    def kernel_us(self, fn, reps):
        return self._wall(fn, reps), "wall (dry run)"

    def b2b_us(self, fn, reps):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e6 / reps

    def events_us(self, fn, reps, flush):
        return self._wall(fn, reps)


def call_us(timer, fn, reps) -> float:
    """A call as a user sees it: synchronized before, timed to the end of its device work."""
    times = []
    for _ in range(reps):
        timer.sync()
        t0 = time.perf_counter()
        fn()
        timer.sync()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def host_us(timer, fn, reps) -> float:
    """The host time of one call (no synchronize inside the timing; the device drained between reps)."""
    times = []
    for _ in range(reps):
        timer.sync()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def copy_bandwidth(timer, nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written (L2 flushed)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=timer.device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    us = timer.events_us(lambda: dst.copy_(src), repeats, flush=True)
    del src, dst
    return 2.0 * nbytes / (us * 1e-6)


# ----------------------------------------------------------------------------- cases
def _backend(dry_run: bool):
    """The fused backend (CUDA, or the C++ one for a dry run), or None when it cannot be loaded."""
    try:
        be = kernels.backend_for("cpu" if dry_run else "cuda")
    except Exception:  # noqa: BLE001 - LIONCUB_KERNELS may forbid it; report torch only
        return None
    return be if getattr(be, "name", "") in (("cpp",) if dry_run else ("cuda",)) else None


def _layout(numel: int, world: int):
    """A bucket of four tensors (one of odd size) filling about ``numel`` elements."""
    sizes = [int(numel * f) for f in LION_TENSORS]
    sizes[-1] -= 64
    sizes.append(7)
    offsets, cur = [], 0
    for n in sizes:
        offsets.append(cur)
        cur = (cur + n + 7) // 8 * 8
    return sizes, offsets, reference.padded_numel(cur, world)


def _no_delta(fn, *args, **kw):
    """A backend's apply asked not to return Δ where it can (the optimizer's call; torch always returns it)."""
    try:
        return fn(*args, return_delta=False, **kw)
    except TypeError:
        return fn(*args, **kw)


def floors(esz: int, world: int, p: int, bits: int) -> dict:
    """kernel -> (floor bytes per parameter: every input read once, every output written once;
    the bytes the kernel moves when it makes two passes, else None). pb: one bit plane per parameter."""
    pb = 1.0 / 8.0
    return {
        "lion_step": (5 * esz, None),                                  # read g, m, θ; write m, θ
        "local_step": (3 * esz + 2 * pb, None),                        # read g, m; write m, sign, nonzero
        "momentum_update": (3 * esz, None),                            # read g, m; write m
        f"vote_apply_N{world}": (world * pb + 2 * esz, None),          # read N sign planes, θ; write θ
        f"vote_apply_nz_N{world}": (2 * world * pb + 2 * esz, None),   # + N nonzero planes
        f"vote_apply_avg_N{world}": (2 * world * pb + 2 * esz, None),
        f"shard_vote_N{world}": (2 * world * pb + 2 * pb, None),       # read 2N planes; write sign, nonzero
        f"count_lanes_p{p}_N{world}": (2 * world * pb + 2 * p * pb, None),
        f"lanes_apply_p{p}_N{world}": (p * pb + 2 * esz, None),
        "int8_local_step_l1": (2 * esz + 1, 4 * esz + 1),              # read g, m (twice: scale, then codes); write q
        "int8_apply": (1 + 2 * esz, None),                             # read qsum, θ; write θ
        f"bbit_local_step_l1_b{bits}": (3 * esz + (bits + 1) * pb,     # read g, m (twice); write m, b planes, nonzero
                                        5 * esz + (bits + 1) * pb),
        f"bbit_shard_vote_N{world}_b{bits}": (world * (bits + 1) * pb + 2 * pb, None),
        f"zero_sign_apply_N{world}": (8 + pb, None),                  # read and write the fp32 target, one sign bit
    }


def _cases(be, dtype, numel, world, device, gen):
    """(kernel, callable) for one backend, as the optimizer calls it."""
    sizes, offsets, total = _layout(numel, world)
    grads = [torch.randn(n, device=device, generator=gen).to(dtype) for n in sizes]
    moms = [torch.randn(n, device=device, generator=gen).mul_(0.01).to(dtype) for n in sizes]
    params = [torch.randn(n, device=device, generator=gen).to(dtype) for n in sizes]
    nbytes = total // 8
    sign = torch.randint(0, 256, (world, nbytes), device=device, dtype=torch.int32, generator=gen).to(torch.uint8)
    nz = torch.full((world, nbytes), 0xFF, device=device, dtype=torch.uint8)
    nz[:, ::97] = 0x7F  # a few abstentions
    p = reference.lane_bits_for(world)
    plus_l = torch.randint(0, 256, (total * p // 8,), device=device, dtype=torch.int32, generator=gen).to(torch.uint8)
    plus_l &= {1: 0xFF, 2: 0x55, 4: 0x33, 8: 0x03}[p]  # counts <= 3 <= world in every lane
    levels = reference.int8_levels(world)
    bits = 2  # comm="bbit": the default 2-bit codes; its shard vote reads every rank's code planes
    segs = reference.tie_segments(offsets)
    shard_segs = reference.tie_segments(offsets, None, 0, total)
    bplanes = torch.randint(0, 256, (world, bits, nbytes), device=device, dtype=torch.int32,
                            generator=gen).to(torch.uint8)
    qsum = torch.randint(-127, 128, (total,), device=device, dtype=torch.int32, generator=gen).to(torch.int8)
    apply_kw = dict(lr=1e-6, weight_decay=0.1, step=3, tie_break="hash", segments=segs)
    # ZeRO sign all-gather apply: N partitions of one group (an fp32 replica; for bf16 also the cast
    # into the bf16 flat buffer), sign rows with the flag byte, a little end padding
    part = numel // world
    zlay = reference.zero_layout(world, [part], [0], [[(0, world * part - 5)]])
    zsign = torch.randint(0, 256, (world, (part + 7) // 8 + 1), device=device, dtype=torch.int32,
                          generator=gen).to(torch.uint8)
    ztarget = [torch.randn(world * part, device=device, generator=gen)]
    zcast = None if dtype == torch.float32 else [ztarget[0].to(dtype)]
    return [
        ("lion_step", lambda: be.lion_step(params, grads, moms, 1e-6, 0.1, 0.9, 0.99)),
        (f"zero_sign_apply_N{world}", lambda: be.zero_sign_apply(zsign, None, ztarget, zcast, zlay, [1e-6], [0.1])),
        ("local_step", lambda: be.local_step(grads, moms, offsets, total, 0.9, 0.99, True, device_counts=True)),
        ("momentum_update", lambda: be.momentum_update_list(moms, grads, 0.99)),
        (f"vote_apply_N{world}",
         lambda: _no_delta(be.vote_apply, sign, None, params, offsets, vote="majority", world_size=world, **apply_kw)),
        (f"vote_apply_nz_N{world}",
         lambda: _no_delta(be.vote_apply, sign, nz, params, offsets, vote="majority", world_size=world, **apply_kw)),
        (f"vote_apply_avg_N{world}",
         lambda: _no_delta(be.vote_apply, sign, nz, params, offsets, vote="average", world_size=world, **apply_kw)),
        (f"shard_vote_N{world}", lambda: be.shard_vote(sign, nz, 3, "hash", shard_segs)),
        (f"count_lanes_p{p}_N{world}", lambda: be.count_lanes(sign, nz, p)),
        (f"lanes_apply_p{p}_N{world}",
         lambda: _no_delta(be.lanes_apply, plus_l, None, world, p, params, offsets, vote="majority", **apply_kw)),
        ("int8_local_step_l1",
         lambda: be.int8_local_step(grads, moms, offsets, total, 0.9, "l1", levels, device_counts=True)),
        ("int8_apply", lambda: _no_delta(be.int8_apply, qsum, params, offsets, 1e-6, 0.1)),
        (f"bbit_local_step_l1_b{bits}",
         lambda: be.bbit_local_step(grads, moms, offsets, total, 0.9, 0.99, "l1", bits, "dither", 12345, segs, True,
                                    device_counts=True)),
        (f"bbit_shard_vote_N{world}_b{bits}", lambda: be.bbit_shard_vote(bplanes, nz, bits, 3, "hash", shard_segs)),
    ], floors(torch.tensor([], dtype=dtype).element_size(), world, p, bits)


def _measure(timer, fn, repeats, warmup):
    for _ in range(warmup):
        fn()
    timer.sync()
    k, how = timer.kernel_us(fn, repeats)
    return {"call_us": call_us(timer, fn, repeats), "kernel_us": k, "kernel_timing": how,
            "b2b_us": timer.b2b_us(fn, repeats), "host_us": host_us(timer, fn, repeats)}


def _record(base, kernel, dt_name, impl, numel, m, floor_bpp, kernel_bpp, bw, extra_cast=0):
    floor_bpp += extra_cast
    floor_us = floor_bpp * numel / bw * 1e6
    rec = dict(base, kernel=kernel, dtype=dt_name, impl=impl, numel=numel, **m,
               floor_bytes_per_param=floor_bpp, floor_us=floor_us, frac_of_floor=floor_us / m["kernel_us"],
               passes=1 if kernel_bpp is None else 2,
               # the older field names (docs/results.md, gpu_check.bench_figures)
               ms=m["kernel_us"] / 1e3, ms_per_1B=m["kernel_us"] / 1e3 * 1e9 / numel, bytes_per_param=floor_bpp,
               floor_ms_per_1B=floor_bpp * 1e9 / bw * 1e3)
    if kernel_bpp is not None:
        rec["kernel_bytes_per_param"] = kernel_bpp + extra_cast
        rec["frac_of_kernel_bytes"] = (kernel_bpp + extra_cast) * numel / bw * 1e6 / m["kernel_us"]
    return rec


def run_cuda(json_path=None, numel: int | None = None, world_size: int = 8, repeats: int = 15, warmup: int = 3,
             dtypes=("fp32", "bf16"), with_torch: bool = False, sizes=SIZES, dry_run: bool = False):
    """Time every fused kernel (see the module docstring); print a table, return flat records.

    ``sizes``: elements per call (``numel``, if given, replaces them with one size); ``world_size``: the N
    of the vote kernels; ``with_torch``: also the unfused torch path, at the smallest size;
    ``dry_run``: CPU tensors, the C++ kernels and wall clocks (the code path without a GPU, for tests).
    Writes the records as a JSON list to ``json_path`` if given."""
    if dry_run:
        device, name = torch.device("cpu"), "cpu (dry run)"
        timer = HostTimer(device)
        bw = copy_bandwidth(timer, nbytes=1 << 24, repeats=3)
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("run_cuda needs a CUDA GPU (torch.cuda.is_available() is False); dry_run=True runs "
                               "the same code on CPU tensors")
        device = torch.device("cuda")
        name = torch.cuda.get_device_name(device)
        timer = CudaTimer(device)
        bw = copy_bandwidth(timer)
    sizes = (numel,) if numel is not None else tuple(sizes)
    fused = _backend(dry_run)
    base = {"bench": "kernels_cuda", "device": name, "world_size": world_size, "copy_GBps": bw / 1e9,
            "dry_run": dry_run}
    records = []
    for n in sizes:
        for dt_name in dtypes:
            dtype = DTYPES[dt_name]
            impls = [("fused", fused)] if fused is not None else []
            if with_torch and n == min(sizes):
                impls.append(("torch", kernels.TorchBackend()))
            for impl, be in impls:
                gen = torch.Generator(device=device).manual_seed(0)
                cases, fl = _cases(be, dtype, n, world_size, device, gen)
                esz = torch.tensor([], dtype=dtype).element_size()
                for kernel, fn in cases:
                    m = _measure(timer, fn, repeats, warmup)
                    # zero_sign_apply also writes the bf16 cast of the target
                    cast = esz if kernel.startswith("zero_sign_apply") and dtype != torch.float32 else 0
                    records.append(_record(base, kernel, dt_name, impl, n, m, *fl[kernel], bw, cast))
                del cases
                if not dry_run:
                    torch.cuda.empty_cache()
        records += _lion_pytorch(timer, base, n, dtypes, bw, repeats, warmup)
    _print_table(records, name, bw, fused is not None)
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records, indent=1))
    return records


def _lion_pytorch(timer, base, numel, dtypes, bw, repeats, warmup):
    """lion-pytorch's Triton update (lion_pytorch.triton.update_fn, one launch per parameter) on the
    lion_step tensors, when lion-pytorch and triton are installed (never in a dry run)."""
    if timer.dry:
        return []
    try:
        from lion_pytorch.triton import update_fn
    except Exception:  # noqa: BLE001 - not installed (or no triton): nothing to compare with
        return []
    out = []
    for dt_name in dtypes:
        dtype = DTYPES[dt_name]
        esz = torch.tensor([], dtype=dtype).element_size()
        gen = torch.Generator(device=timer.device).manual_seed(0)
        sizes, _, _ = _layout(numel, 1)
        ps, gs, ms = ([torch.randn(n, device=timer.device, generator=gen).to(dtype) for n in sizes] for _ in range(3))
        m = _measure(timer, lambda: [update_fn(p, g, mm, 1e-6, 0.1, 0.9, 0.99) for p, g, mm in zip(ps, gs, ms)],
                     repeats, warmup)
        out.append(_record(base, "lion_step", dt_name, "lion_pytorch_triton", numel, m, 5 * esz, None, bw))
    return out


def _print_table(records, name, bw, have_fused):
    print(f"CUDA kernels on {name}: device-to-device copy {bw / 1e9:.0f} GB/s (read + write, L2 flushed); "
          "kernel = device time of the call's kernels, L2 flushed before each rep; call = as a user sees it "
          "(synchronized); host = the call's host time; floor = bytes every input read once and every output "
          "written once, at the copy bandwidth; 2p: a two-pass kernel (its own bytes in parentheses)"
          + ("" if have_fused else " -- fused backend unavailable"))
    head = (f"{'kernel':<26} {'dtype':<5} {'numel':>6} {'impl':<8} {'B/param':>7} {'floor us':>9} {'kernel us':>10} "
            f"{'of floor':>8} {'b2b us':>8} {'call us':>8} {'host us':>8}")
    print(head)
    print("-" * len(head))
    for r in records:
        two = f" 2p ({r['frac_of_kernel_bytes']:.0%})" if r.get("passes") == 2 else ""
        print(f"{r['kernel']:<26} {r['dtype']:<5} {r['numel'] / 2**20:>5.0f}M {r['impl'][:8]:<8} "
              f"{r['floor_bytes_per_param']:>7.3f} {r['floor_us']:>9.1f} {r['kernel_us']:>10.1f} "
              f"{r['frac_of_floor']:>8.1%} {r['b2b_us']:>8.1f} {r['call_us']:>8.1f} {r['host_us']:>8.1f}{two}")


if __name__ == "__main__":  # pragma: no cover - manual run on a GPU machine
    import sys

    run_cuda(sys.argv[1] if len(sys.argv) > 1 else None)
