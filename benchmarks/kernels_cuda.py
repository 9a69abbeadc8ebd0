"""CUDA kernel benchmark (docs/results.md): fused CUDA kernels vs the unfused torch path.

The single-process ``lion_step`` is also timed against lion-pytorch's Triton update when
lion-pytorch and triton are installed (``impl: lion_pytorch_triton``).

For each kernel of a Lion Cub step and for fp32 and bf16 (grads, params, momenta of that
dtype), times the fused kernel (the ``cuda`` backend: ``lioncub_ds.kernels.backend_for('cuda')``)
and the unfused torch path (``lioncub_ds.kernels.reference`` functions on the same CUDA tensors),
per 1B parameters, and reports each as a fraction of its bandwidth floor: the bytes the
kernel must move per parameter divided by the device-to-device copy bandwidth measured
in the same run. Timings: warm-up calls, then CUDA events around each call, median of
``repeats`` calls.

    from benchmarks.kernels_cuda import run_cuda
    records = run_cuda("results/kernels_cuda.json")

Called by the kernels benchmark when CUDA is available; needs a GPU.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from lioncub_ds import kernels
from lioncub_ds.kernels import reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _median_ms(fn, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(device, nbytes: int = 1 << 30, repeats: int = 20, warmup: int = 3) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), repeats, warmup)
    del src, dst
    return 2.0 * nbytes / (ms * 1e-3)


def _fused_backend():
    """The CUDA backend, or None when it cannot be built/loaded here."""
    try:
        be = kernels.backend_for("cuda")
    except Exception:  # noqa: BLE001 - LIONCUB_KERNELS may forbid it; report torch only
        return None
    return be if getattr(be, "name", "") == "cuda" else None


def _layout(numel: int, world: int):
    """A bucket of four tensors (one of odd size) filling about `numel` elements."""
    sizes = [numel // 2, numel // 4, numel // 4 - 64, 7]
    offsets, cur = [], 0
    for n in sizes:
        offsets.append(cur)
        cur = (cur + n + 7) // 8 * 8
    return sizes, offsets, reference.padded_numel(cur, world)


def _call(fn, *args, **kw):
    """Call a backend method, asking the fused one not to return Δ where it can."""
    try:
        return fn(*args, return_delta=False, **kw)
    except TypeError:
        return fn(*args, **kw)


def _cases(be, dtype, numel, world, device, gen):
    """(kernel, bytes per parameter, callable) for one backend."""
    sizes, offsets, total = _layout(numel, world)
    esz = torch.tensor([], dtype=dtype).element_size()
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
    bits = 2  # comm="bbit": the default 2-bit codes (ternary levels); its shard vote reads every rank's code planes
    bsegs = reference.tie_segments(offsets)
    bplanes = torch.randint(0, 256, (world, bits, nbytes), device=device, dtype=torch.int32,
                            generator=gen).to(torch.uint8)
    qsum = torch.randint(-127, 128, (total,), device=device, dtype=torch.int32, generator=gen).to(torch.int8)
    apply_kw = dict(lr=1e-6, weight_decay=0.1, step=3, tie_break="hash")
    pb = 1.0 / 8.0  # one bit plane, bytes per parameter
    # ZeRO sign all-gather apply: N partitions of one group (an fp32 replica; for bf16 also the cast
    # into the bf16 flat buffer), sign rows with the flag byte, a little end padding
    part = numel // world
    zlay = reference.zero_layout(world, [part], [0], [[(0, world * part - 5)]])
    zsign = torch.randint(0, 256, (world, (part + 7) // 8 + 1), device=device, dtype=torch.int32,
                          generator=gen).to(torch.uint8)
    ztarget = [torch.randn(world * part, device=device, generator=gen)]
    zcast = None if dtype == torch.float32 else [ztarget[0].to(dtype)]
    zbytes = 8 + pb + (0 if zcast is None else esz)
    return [
        ("lion_step", 5 * esz, lambda: be.lion_step(params, grads, moms, 1e-6, 0.1, 0.9, 0.99)),
        (f"zero_sign_apply_N{world}", zbytes,
         lambda: be.zero_sign_apply(zsign, None, ztarget, zcast, zlay, [1e-6], [0.1])),
        ("local_step", esz + 2 * esz + 2 * pb,
         lambda: be.local_step(grads, moms, offsets, total, 0.9, 0.99, update_momentum=True)),
        ("momentum_update", esz + 2 * esz, lambda: be.momentum_update_list(moms, grads, 0.99)),
        (f"vote_apply_N{world}", world * pb + 2 * esz,
         lambda: _call(be.vote_apply, sign, None, params, offsets, vote="majority", world_size=world, **apply_kw)),
        (f"vote_apply_nz_N{world}", 2 * world * pb + 2 * esz,
         lambda: _call(be.vote_apply, sign, nz, params, offsets, vote="majority", world_size=world, **apply_kw)),
        (f"vote_apply_avg_N{world}", 2 * world * pb + 2 * esz,
         lambda: _call(be.vote_apply, sign, nz, params, offsets, vote="average", world_size=world, **apply_kw)),
        (f"shard_vote_N{world}", 2 * world * pb + 2 * pb, lambda: be.shard_vote(sign, nz, 3, "hash", 0)),
        (f"count_lanes_p{p}_N{world}", 2 * world * pb + 2 * p * pb, lambda: be.count_lanes(sign, nz, p)),
        (f"lanes_apply_p{p}_N{world}", p * pb + 2 * esz,
         lambda: _call(be.lanes_apply, plus_l, None, world, p, params, offsets, vote="majority", **apply_kw)),
        ("int8_local_step_l1", 2 * esz + 1,
         lambda: be.int8_local_step(grads, moms, offsets, total, 0.9, "l1", levels)),
        ("int8_apply", 1 + 2 * esz, lambda: _call(be.int8_apply, qsum, params, offsets, 1e-6, 0.1)),
        # g and m read twice (the per-tensor scale needs the whole tensor before the first code), m written
        # once, the b code planes and the nonzero plane written
        (f"bbit_local_step_l1_b{bits}", 5 * esz + (bits + 1) * pb,
         lambda: be.bbit_local_step(grads, moms, offsets, total, 0.9, 0.99, "l1", bits, "dither", 12345, bsegs, True,
                                    device_counts=True)),
        (f"bbit_shard_vote_N{world}_b{bits}", world * (bits + 1) * pb + 2 * pb,
         lambda: be.bbit_shard_vote(bplanes, nz, bits, 3, "hash", 0)),
    ]


def run_cuda(json_path=None, numel: int = 1 << 26, world_size: int = 8, repeats: int = 25, warmup: int = 5,
             dtypes=("fp32", "bf16"), with_torch: bool = True):
    """Time every fused CUDA kernel and its unfused torch path; print a table, return flat records.

    ``numel``: elements per timed call (results are scaled to 1B parameters); ``world_size``:
    the N of the vote kernels; ``with_torch=False``: the fused kernels only (the torch path is slow:
    ``make gpu-check`` leaves it out). Writes the records as a JSON list to ``json_path`` if given.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("run_cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    bw = copy_bandwidth(device)
    fused = _fused_backend()
    torch_be = kernels.TorchBackend()
    per_b = 1e9 / numel
    records = []
    for dt_name in dtypes:
        dtype = DTYPES[dt_name]
        impls = ([("torch", torch_be)] if with_torch else []) + ([("fused", fused)] if fused is not None else [])
        times = {}
        for impl, be in impls:
            gen = torch.Generator(device=device).manual_seed(0)
            for kernel, bpp, fn in _cases(be, dtype, numel, world_size, device, gen):
                times[(impl, kernel)] = (_median_ms(fn, repeats, warmup), bpp)
            torch.cuda.empty_cache()
        for (impl, kernel), (ms, bpp) in times.items():
            floor_ms = bpp * 1e9 / bw * 1e3
            torch_ms = times[("torch", kernel)][0] if ("torch", kernel) in times else None
            records.append({
                "bench": "kernels_cuda", "kernel": kernel, "dtype": dt_name, "impl": impl, "device": name,
                "world_size": world_size, "numel": numel, "ms": ms, "ms_per_1B": ms * per_b,
                "bytes_per_param": bpp, "floor_ms_per_1B": floor_ms, "frac_of_floor": floor_ms / (ms * per_b),
                "copy_GBps": bw / 1e9, "speedup_vs_torch": None if torch_ms is None else torch_ms / ms,
            })
    records += _lion_pytorch(numel, dtypes, bw, repeats, warmup, device, name, per_b)
    _print_table(records, name, bw, fused is not None)
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records, indent=1))
    return records


def _lion_pytorch(numel, dtypes, bw, repeats, warmup, device, name, per_b):
    """lion-pytorch's Triton update (lion_pytorch.triton.update_fn, one launch per parameter) on the
    lion_step tensors, when lion-pytorch and triton are installed."""
    try:
        from lion_pytorch.triton import update_fn
    except Exception:  # noqa: BLE001 - not installed (or no triton): nothing to compare with
        return []
    out = []
    for dt_name in dtypes:
        dtype = DTYPES[dt_name]
        esz = torch.tensor([], dtype=dtype).element_size()
        gen = torch.Generator(device=device).manual_seed(0)
        sizes, _, _ = _layout(numel, 1)
        ps, gs, ms = ([torch.randn(n, device=device, generator=gen).to(dtype) for n in sizes] for _ in range(3))
        ms_t = _median_ms(lambda: [update_fn(p, g, m, 1e-6, 0.1, 0.9, 0.99) for p, g, m in zip(ps, gs, ms)], repeats,
                          warmup)
        floor_ms = 5 * esz * 1e9 / bw * 1e3
        out.append({"bench": "kernels_cuda", "kernel": "lion_step", "dtype": dt_name, "impl": "lion_pytorch_triton",
                    "device": name, "numel": numel, "ms": ms_t, "ms_per_1B": ms_t * per_b, "bytes_per_param": 5 * esz,
                    "floor_ms_per_1B": floor_ms, "frac_of_floor": floor_ms / (ms_t * per_b), "copy_GBps": bw / 1e9})
    return out


def _print_table(records, name, bw, have_fused):
    print(f"CUDA kernels on {name}: device-to-device copy {bw / 1e9:.0f} GB/s (read + write); "
          f"times per 1B parameters" + ("" if have_fused else " -- fused CUDA backend unavailable, torch only"))
    head = f"{'kernel':<24} {'dtype':<5} {'B/param':>7} {'floor ms':>9} {'fused ms':>9} {'of floor':>8} " \
           f"{'torch ms':>9} {'of floor':>8} {'speedup':>8}"
    print(head)
    print("-" * len(head))
    rows = {}
    for r in records:
        rows.setdefault((r["kernel"], r["dtype"]), {})[r["impl"]] = r
    for (kernel, dt), d in rows.items():
        t, f = d.get("torch"), d.get("fused")
        if t is None and f is None:
            continue
        any_ = t or f
        fused_cols = f"{f['ms_per_1B']:>9.2f} {f['frac_of_floor']:>8.1%} " if f else f"{'-':>9} {'-':>8} "
        torch_cols = f"{t['ms_per_1B']:>9.2f} {t['frac_of_floor']:>8.1%} " if t else f"{'-':>9} {'-':>8} "
        speed = f"{f['speedup_vs_torch']:>7.1f}x" if f and t else f"{'-':>8}"
        print(f"{kernel:<24} {dt:<5} {any_['bytes_per_param']:>7.3f} {any_['floor_ms_per_1B']:>9.2f} " + fused_cols
              + torch_cols + speed)
    for r in records:
        if r["impl"] == "lion_pytorch_triton":
            print(f"lion_step {r['dtype']}: lion-pytorch Triton {r['ms_per_1B']:.2f} ms per 1B ({r['frac_of_floor']:.1%} "
                  "of floor)")


if __name__ == "__main__":  # pragma: no cover - manual run on a GPU machine
    import sys

    run_cuda(sys.argv[1] if len(sys.argv) > 1 else None)
