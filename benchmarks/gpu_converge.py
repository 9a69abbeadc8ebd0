"""``python -m benchmarks.gpu_converge``: the convergence study's question on a GPU, at a larger GPT.

Every convergence figure so far comes from a 120,576-parameter GPT on the CPU. This probe runs the same
simulation (``python -m benchmarks converge``, the chosen preset ``lion_w300``'s settings: N = 16
simulated workers, β (0.8, 0.9), 1,200 steps, 300 warm-up steps, the pinned corpus) on one CUDA device
with the largest GPT of :data:`SIZES` whose three runs fit the time left, for ONE paired seed:

1. calibrate: 20 steps of global Lion at each size, largest first, until the three runs of that size
   (extrapolated to ``--steps``, plus the lr bracket) fit ``--budget-s``;
2. bracket global Lion's lr once at that size (``--tune --tune-only`` over :data:`LR_BRACKET`, on the
   study's tuning seed 1000), and take the best lr for Lion and Lion Cub alike (as the study does);
3. the seed's three runs: global Lion, the recommendation (``cub_1bit_sync20_int8``) and AdamW.

Each run's record is appended to ``docs/gpu_converge/runs.jsonl`` with its device, size and command, and
``docs/gpu_converge/README.md``'s table is regenerated from all records (one seed per GPU session: the
paired gap per seed, and its mean once several seeds exist). ``--dry``: a tiny GPT for 5 steps on the
CPU into a scratch folder (what the tests run), so that a GPU's first minute runs the real thing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .converge.records import append_jsonl, jsonl_records

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "gpu_converge"
PROTOCOL = "lion_w300"
WORLD = 16
VARIANTS = ("lion", "cub_1bit_sync20_int8", "adamw")
# (name, n_layer, n_head, d_model), largest first: ~38M, ~21M, ~9.5M, ~3.2M parameters
SIZES = (("d640_l8", 8, 10, 640), ("d512_l7", 7, 8, 512), ("d384_l6", 6, 6, 384), ("d256_l4", 4, 4, 256))
DRY_SIZE = ("dry_d32_l1", 1, 2, 32)
LR_BRACKET = (2e-3, 4e-3, 8e-3)  # around lion_w300's 4e-3 (tuned at d_model 64)


def command(size, variant, seed, steps, device, partial, lion_lr=None, tune=False) -> list[str]:
    name, n_layer, n_head, d_model = size
    cmd = [sys.executable, "-m", "benchmarks", "converge", "--protocol", PROTOCOL, "--world-sizes", str(WORLD),
           "--device", device, "--n-layer", str(n_layer), "--n-head", str(n_head), "--d-model", str(d_model),
           "--steps", str(steps), "--variants", variant, "--partial", str(partial)]
    if tune:
        cmd += ["--tune", "--tune-only", "--seeds", "1000", "--lr-grid",
                json.dumps({"lion": list(LR_BRACKET)})]
    else:
        cmd += ["--seeds", str(seed)]
    if lion_lr is not None:
        cmd += ["--lr", f"lion={lion_lr}", f"cub={lion_lr}"]
    return cmd


def _run(cmd, timeout) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=timeout)
    return time.perf_counter() - t0


def choose_size(device, steps, budget_s, scratch, sizes=SIZES, calib_steps=20) -> tuple:
    """The largest size whose bracket (len(LR_BRACKET) runs) + the seed's three runs fit the budget."""
    for size in sizes:
        s = _run(command(size, "lion", 0, calib_steps, device, scratch / f"calib_{size[0]}.jsonl"), budget_s)
        need = s / calib_steps * steps * (len(LR_BRACKET) + len(VARIANTS))
        print(f"[gpu_converge] {size[0]}: {s:.1f} s for {calib_steps} steps -> {need:.0f} s needed", flush=True)
        if need <= budget_s:
            return size
    return sizes[-1]


def best_lr(path) -> float:
    """The bracket's best lr for global Lion (lowest final validation loss) from a --tune record file."""
    tunes = [r for r in jsonl_records(path) if r and r.get("bench") == "converge_tune" and r.get("family") == "lion"]
    if not tunes:
        raise RuntimeError(f"no lr bracket records in {path}")
    return min(tunes, key=lambda r: r["val_loss"])["lr"]


def table(records: list[dict]) -> str:
    """One row per (device, size, seed): each variant's final validation loss and the paired gaps."""
    runs = [r for r in records if r.get("bench") == "converge"]
    keys = sorted({(r.get("gpu_device", r.get("device")), r.get("size"), r["seed"]) for r in runs},
                  key=lambda k: (str(k[0]), str(k[1]), k[2]))
    lines = ["| device | GPT | params | seed | global Lion | recommendation | AdamW | recommendation vs Lion |"
             " AdamW vs Lion |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for dev, size, seed in keys:
        by = {r["variant"]: r for r in runs if (r.get("gpu_device", r.get("device")), r.get("size"), r["seed"])
              == (dev, size, seed)}
        loss = {v: by[v]["val_loss"] if v in by else None for v in VARIANTS}
        base = loss["lion"]

        def gap(v):
            return f"{100 * (loss[v] / base - 1):+.2f}%" if loss[v] is not None and base else "–"

        params = next(iter(by.values())).get("params", 0)
        cells = [f"{loss[v]:.4f}" if loss[v] is not None else "–" for v in VARIANTS]
        lines.append(f"| {dev} | {size} | {params:,} | {seed} | " + " | ".join(cells)
                     + f" | {gap('cub_1bit_sync20_int8')} | {gap('adamw')} |")
    return "\n".join(lines)


def write_readme(out: Path) -> None:
    records = [r for r in jsonl_records(out / "runs.jsonl") if r] if (out / "runs.jsonl").exists() else []
    text = (f"# Convergence on a GPU at a larger GPT\n\n`python -m benchmarks.gpu_converge` (one seed per run of it; "
            f"records in [runs.jsonl](runs.jsonl)): the `{PROTOCOL}` preset at N = {WORLD} simulated workers, "
            "global Lion's lr bracketed once per size, Lion Cub at global Lion's lr. The paired gap is the final "
            "validation loss against global Lion's on the same seed.\n\n" + table(records) + "\n")
    (out / "README.md").write_text(text)


def run(device: str, seed: int, budget_s: float, out: Path, dry: bool) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    scratch = out / "scratch"
    scratch.mkdir(exist_ok=True)
    steps = 5 if dry else 1200
    size = DRY_SIZE if dry else choose_size(device, steps, budget_s, scratch)
    tune_file = scratch / f"tune_{size[0]}.jsonl"
    _run(command(size, "lion", seed, steps, device, tune_file, tune=True), budget_s)
    lr = best_lr(tune_file)
    print(f"[gpu_converge] {size[0]}: global Lion's best lr {lr:g}", flush=True)
    for variant in VARIANTS:
        part = scratch / f"{size[0]}_{variant}_s{seed}.jsonl"
        cmd = command(size, variant, seed, steps, device, part, lion_lr=lr)
        _run(cmd, budget_s)
        recs = [r for r in jsonl_records(part) if r and r.get("bench") == "converge"]
        gpu = _device_name(device)
        for r in recs:
            r.update(size=size[0], gpu_device=gpu, bracket_lr=lr,
                     command="python -m benchmarks.gpu_converge" + (" --dry" if dry else f" --seed {seed}"))
        append_jsonl(out / "runs.jsonl", recs)
    write_readme(out)
    return out


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch
        return torch.cuda.get_device_name(0)
    return "cpu"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_converge", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0, help="the paired seed of this run (one per GPU session)")
    p.add_argument("--budget-s", type=float, default=300.0, help="seconds this probe may take (default 300)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--dry", action="store_true", help="a tiny GPT for 5 steps on the CPU (the dry run)")
    args = p.parse_args(argv)
    if args.budget_s <= 0 or args.seed < 0:
        p.error("--budget-s must be > 0 and --seed >= 0")
    device = "cpu" if args.dry else args.device
    run(device, args.seed, args.budget_s, Path(args.out), args.dry)
    print((Path(args.out) / "README.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
