"""``python -m benchmarks offload``: the optimizer step that ZeRO's ``offload_optimizer`` runs on the CPU.

With ``"offload_optimizer": {"device": "cpu"}`` DeepSpeed keeps each rank's fp32 partition (master,
gradient, optimizer state) in CPU memory and calls the optimizer's ``step()`` there. This times
that step on one flat fp32 partition of ``--numel`` elements, side by side in interleaved rounds
(machines are noisy: the ratios are measured in one run):

* ``lioncub``: ``LionCub`` on the partition, as ZeRO steps it (single process: LionCub's fused C++
  Lion kernel);
* ``ds_cpu_lion`` / ``ds_cpu_adam``: DeepSpeed's own ``DeepSpeedCPULion`` / ``DeepSpeedCPUAdam``
  (its JIT-built AVX kernels; reported ``unavailable`` with the reason where they do not build);
* ``torch_adamw``: ``torch.optim.AdamW(foreach=True)``, the plain-torch reference.

Each row gives the median step time, the bytes the step must move (Lion: read p, g, m, write p, m
= 20 B/element; Adam: read p, g, m, v, write p, m, v = 28 B/element), the rate against a large
copy on the same machine (the memory floor), and the time against ``ds_cpu_lion``'s.
"""
from __future__ import annotations

import argparse
import time

import torch

from .common import add_output_args, finish, machine_info, median, print_table

NAME = "offload"
VARIANTS = ("lioncub", "ds_cpu_lion", "ds_cpu_adam", "torch_adamw")
BYTES_PER_ELEMENT = {"lioncub": 20, "ds_cpu_lion": 20, "ds_cpu_adam": 28, "torch_adamw": 28}


def _make(variant, p):
    """The optimizer of ``variant`` over the one tensor ``p`` (raises where it cannot be built)."""
    if variant == "lioncub":
        from lioncub_ds import LionCub
        return LionCub([p], lr=1e-4, betas=(0.95, 0.98), weight_decay=0.1)
    if variant == "ds_cpu_lion":
        from deepspeed.ops.lion import DeepSpeedCPULion
        return DeepSpeedCPULion([p], lr=1e-4, betas=(0.95, 0.98), weight_decay=0.1)
    if variant == "ds_cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam([p], lr=1e-4, weight_decay=0.1, adamw_mode=True)
    if variant == "torch_adamw":
        return torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1, foreach=True)
    raise ValueError(f"unknown variant {variant!r}; allowed: {', '.join(VARIANTS)}")


def copy_floor_gbs(numel: int, reps: int = 5) -> float:
    """GB/s of a large fp32 copy (read + write) on this machine: the memory floor's rate."""
    a, b = torch.randn(numel), torch.empty(numel)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return 8 * numel / median(times) / 1e9


def run(numel: int, rounds: int, warmup: int, variants=VARIANTS, threads: int | None = None) -> list[dict]:
    if threads:
        torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    setups, records = {}, []
    for v in variants:
        p = torch.nn.Parameter(torch.randn(numel, generator=gen))
        p.grad = torch.randn(numel, generator=gen)
        t0 = time.perf_counter()
        try:
            opt = _make(v, p)
            opt.step()  # the first step: state, and any JIT build, outside the timing
        except Exception as exc:  # noqa: BLE001 - an optimizer that does not build here is reported, not fatal
            records.append({"bench": NAME, "variant": v, "status": "unavailable",
                            "reason": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        setups[v] = (opt, time.perf_counter() - t0)
    times = {v: [] for v in setups}
    for r in range(warmup + rounds):
        for v, (opt, _) in setups.items():  # interleaved: every round times every variant once
            t0 = time.perf_counter()
            opt.step()
            if r >= warmup:
                times[v].append(time.perf_counter() - t0)
    floor = copy_floor_gbs(numel)
    base = median(times["ds_cpu_lion"]) if "ds_cpu_lion" in times else None
    for v, (opt, setup_s) in setups.items():
        t = median(times[v])
        moved = BYTES_PER_ELEMENT[v] * numel
        records.append({"bench": NAME, "variant": v, "status": "ok", "numel": numel, "step_ms": 1e3 * t,
                        "ns_per_element": 1e9 * t / numel, "gb_per_s": moved / t / 1e9,
                        "of_copy_floor": moved / t / 1e9 / floor, "vs_ds_cpu_lion": (t / base) if base else None,
                        "first_step_s": setup_s, "rounds": rounds, "threads": torch.get_num_threads(),
                        "copy_floor_gb_per_s": floor})
    return records


TABLE = [("variant", "variant"), ("status", "status"), ("step_ms", "step ms", ".2f"),
         ("gb_per_s", "GB/s", ".2f"), ("of_copy_floor", "of floor", ".2f"), ("vs_ds_cpu_lion", "x DS CPULion", ".2f")]


def build_parser():
    p = argparse.ArgumentParser(prog="python -m benchmarks offload", description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=1 << 24, help="elements of the fp32 partition (default 16M)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    add_output_args(p, default_json=None)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.numel < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--numel and --rounds must be >= 1, --warmup >= 0")
    records = run(args.numel, args.rounds, args.warmup, tuple(args.variants), args.threads)
    for r in records:
        r.update(machine_info())
    finish(NAME, args, records)
    print_table(records, TABLE, title=f"optimizer step on an offloaded fp32 partition of {args.numel:,} elements")
    return 0
