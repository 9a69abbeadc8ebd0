"""Lion Cub vs. plain Lion under DeepSpeed on 2 CPU ranks, side by side.

    python -m benchmarks.ds_demo                 # ~3-6 min on 2 cores
    python -m benchmarks.ds_demo --steps 300 --preset demo

Runs :mod:`benchmarks.ds_pretrain` (the workshop beside the package, outside the wheel) twice with the ``deepspeed`` launcher
(``deepspeed --num_accelerators 2``, ``DS_ACCELERATOR=cpu``, ``OMP_NUM_THREADS=1``,
gloo) on the bundled real text with the same seed, data order and steps:

1. ``DEMO_CONFIG`` (= ``configs/ds_cpu_demo.json``): ``"type": "LionCub"`` at ZeRO stage 0: every rank keeps its
   own momentum, gradients are never all-reduced, only 1-bit votes travel;
2. ``--baseline``: plain Lion (``lioncub_ds.Lion``) with DeepSpeed's normal gradient
   all-reduce (bytes counted by the ring formula 2(N-1)/N x gradient bytes),

then prints validation loss, throughput and bytes sent per step for both. Before either run, :func:`prebuild`
loads what the first launch would otherwise build inside its wall time: LionCub's C++ kernels (prebuilt by
``make setup``; JIT-built here if not) and DeepSpeed's CPU shared-memory comm op (JIT-built by DeepSpeed, cached).
Their times are printed on their own line, so the two wall times compare the runs, not a one-time build.
:func:`run_comparison` is the function ``python -m benchmarks.demo`` can call.
Exit status: 0 when both runs lowered the validation loss and kept the replicas identical.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lioncub_ds.ds_shm import removing_launch_workspaces
from lioncub_ds.telemetry import format_bytes
from lioncub_ds.testing.spawn import free_port

__all__ = ["run_comparison", "format_comparison", "main", "DEMO_CONFIG"]

# The demo's ds_config (configs/ds_cpu_demo.json in the repository holds the same; a test checks it).
DEMO_CONFIG = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "steps_per_print": 1000000,
    "zero_optimization": {"stage": 0},
    "optimizer": {"type": "LionCub", "params": {
        "lr": 0.001, "betas": [0.9, 0.99], "weight_decay": 0.1, "vote": "majority", "comm": "auto",
        "tie_break": "hash", "momentum_dtype": "fp32", "nonfinite": "skip", "drift_check_every": 50}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 20, "total_num_steps": 200,
        "warmup_type": "linear"}},
}


def train_script() -> Path:
    """The training script the demo launches (beside this file, in the source checkout's workshop)."""
    return Path(__file__).resolve().with_name("ds_pretrain.py")


def _package_parent() -> str:
    """The checkout's root: on every rank's PYTHONPATH, so that ``benchmarks`` (not in the wheel) imports."""
    return str(Path(__file__).resolve().parents[1])


def _config() -> dict:
    return json.loads(json.dumps(DEMO_CONFIG))


def _launcher() -> list[str]:
    exe = Path(sys.executable).with_name("deepspeed")
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-m", "deepspeed.launcher.runner"]



# One JIT cache for this process and the ranks (torch's own default differs: it adds a py311_cpu folder).
_EXT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")


def _run_env() -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    root = _package_parent()  # the checkout the demo runs from
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TORCH_EXTENSIONS_DIR", _EXT_DIR)
    return env


# DeepSpeed's own JIT build of its CPU comm op (what deepspeed.init_distributed does on a CPU accelerator).
_DS_SHM_OP = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"


def prebuild(verbose: bool = True, timeout: float = 1200.0) -> dict:
    """Build or load, before the timed runs, what the first launch would otherwise build in its wall time.

    Returns ``{"kernels": how, "kernels_s": s, "deepspeed_op_s": s}``; ``how`` is ``"prebuilt"`` (the module
    ``make setup`` built), ``"jit"`` (JIT-built now or taken from the JIT cache) or the backend used instead."""
    from lioncub_ds import kernels
    from lioncub_ds.kernels import loader

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", _EXT_DIR)  # a JIT build here must land where the ranks look
    t0 = time.perf_counter()
    be = kernels.backend_for("cpu")  # falls back to the reference, with a warning, if it cannot be built
    out = {"kernels": (loader.origin("cpp") if be.name == "cpp" else None) or be.name,
           "kernels_s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", _DS_SHM_OP], env=_run_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
        if proc.returncode != 0:  # the runs will build it (or fail) themselves; say so, do not stop here
            out["deepspeed_op_error"] = proc.stdout.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
    except subprocess.TimeoutExpired:
        out["deepspeed_op_error"] = [f"timed out after {timeout:.0f} s"]
    out["deepspeed_op_s"] = time.perf_counter() - t0
    if verbose:
        print(f"[benchmarks.ds_demo] {format_prebuild(out)}", flush=True)
    return out


def format_prebuild(pre: dict) -> str:
    how = {"prebuilt": "prebuilt by make setup", "jit": "JIT build, or its cache"}.get(
        pre["kernels"], f"not built: the {pre['kernels']} backend")
    ds = (f"{pre['deepspeed_op_s']:.0f} s (JIT build, or its cache)" if "deepspeed_op_error" not in pre else
          f"FAILED ({pre['deepspeed_op_error'][0][:120]}); the runs build it themselves")
    return (f"one-time builds, before both runs and not in their wall times: LionCub's C++ kernels "
            f"{pre['kernels_s']:.1f} s ({how}); DeepSpeed's CPU comm op {ds}")


def _run_one(mode: str, cfg_path: Path, out_json: Path, *, steps: int, preset: str, world_size: int,
             extra: list[str], timeout: float, verbose: bool) -> dict:
    port = free_port()  # never the launcher's default 29500: it may be a live job's on a shared machine
    cmd = _launcher() + ["--num_accelerators", str(world_size), "--master_port", str(port),
                         str(train_script()), "--deepspeed_config", str(cfg_path), "--steps", str(steps),
                         "--preset", preset, "--json-out", str(out_json), "--no-progress"] + extra
    if mode == "baseline":
        cmd.append("--baseline")
    env = _run_env()
    t0 = time.perf_counter()
    tail: list[str] = []
    with removing_launch_workspaces(port):  # this launch's DeepSpeed CPU shm buffers outlive its ranks
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        try:
            for line in proc.stdout:
                tail = (tail + [line])[-60:]
                if verbose and line.startswith("[pretrain]"):
                    print(f"  [{mode}] {line[len('[pretrain]'):].strip()}", flush=True)
            rc = proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{mode} run timed out after {timeout:.0f} s")
    if rc not in (0, 1) or not out_json.exists():
        raise RuntimeError(f"{mode} run failed (exit {rc}):\n{''.join(tail)}")
    with open(out_json) as f:
        summary = json.load(f)
    summary["launch_s"] = time.perf_counter() - t0
    return summary


def _kernel_load(summary: dict) -> str:
    if "kernel_load_s" not in summary:
        return "?"
    how = {"prebuilt": "prebuilt", "jit": "JIT"}.get(summary["kernel_origin"], summary["kernel_origin"])
    return f"{summary['kernel_load_s']:.1f} s ({how})"


def format_comparison(lc: dict, base: dict) -> str:
    rows = [
        ("optimizer", "LionCub (ZeRO-0, local momentum)", "Lion + gradient all-reduce"),
        ("val loss: start", f"{lc['first_val_loss']:.4f}", f"{base['first_val_loss']:.4f}"),
        ("val loss: end", f"{lc['last_val_loss']:.4f}", f"{base['last_val_loss']:.4f}"),
        ("mean bytes / step / rank", format_bytes(lc["bytes_sent_per_step"]), format_bytes(base["bytes_sent_per_step"])),
        ("tokens / s", f"{lc['tokens_per_s']:,.0f}", f"{base['tokens_per_s']:,.0f}"),
        ("replicas identical", "yes" if lc["params_in_sync"] else "NO", "yes" if base["params_in_sync"] else "NO"),
        ("wall time (launch)", f"{lc['launch_s']:.0f} s", f"{base['launch_s']:.0f} s"),
        ("  of which kernel load", _kernel_load(lc), _kernel_load(base)),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{r[0]:<{w0}} | {r[1]:<{w1}} | {r[2]}" for r in rows]
    sep = "-" * max(len(ln) for ln in lines)
    ratio = base["bytes_sent_per_step"] / lc["bytes_sent_per_step"] if lc["bytes_sent_per_step"] else float("inf")
    head = (f"DeepSpeed demo: GPT '{lc['preset']}' ({lc['params'] / 1e6:.2f}M params), {lc['world_size']} CPU ranks, "
            f"{lc['steps']} steps, {lc['tokens_per_step']:,} tokens/step")
    foot = (f"Speed is tokens/s over the timed training steps; the wall time adds process start-up, DeepSpeed "
            f"set-up and evaluation.\nLion Cub sent {ratio:.0f}x fewer bytes per step (mean) than the fp32 gradient "
            f"all-reduce "
            f"(ring: 2(N-1)/N x {lc['params']:,} x 4 B); val loss {lc['last_val_loss']:.3f} vs "
            f"{base['last_val_loss']:.3f}.")
    return "\n".join([sep, head, sep] + lines + [sep, foot])


def run_comparison(steps: int = 150, preset: str = "tiny", world_size: int = 2, out_dir: str | None = None,
                   extra_args: list[str] | None = None, timeout: float = 1200.0, verbose: bool = True) -> dict:
    """Run Lion Cub and the all-reduce baseline under the deepspeed launcher; print and return both summaries."""
    tmp = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="lioncub_ds_demo_"))
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = _config()
    cfg_path = tmp / "ds_cpu_demo.json"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=1)
    extra = ["--log-interval", str(max(1, steps // 6)), "--eval-interval", str(max(1, steps // 3))]
    extra += list(extra_args or [])
    results = {}
    t0 = time.perf_counter()
    results["prebuild"] = prebuild(verbose=verbose, timeout=timeout)
    for mode in ("lioncub", "baseline"):
        if verbose:
            print(f"[benchmarks.ds_demo] {mode}: deepspeed --num_accelerators {world_size} "
                  f"benchmarks/ds_pretrain.py --deepspeed_config {cfg_path.name}"
                  f"{' --baseline' if mode == 'baseline' else ''} --steps {steps} --preset {preset}", flush=True)
        results[mode] = _run_one(mode, cfg_path, tmp / f"{mode}.json", steps=steps, preset=preset,
                                 world_size=world_size, extra=extra, timeout=timeout, verbose=verbose)
    results["total_s"] = time.perf_counter() - t0
    results["table"] = format_comparison(results["lioncub"], results["baseline"]) + "\n" + \
        format_prebuild(results["prebuild"])
    if verbose:
        print(results["table"], flush=True)
        print(f"[benchmarks.ds_demo] total {results['total_s']:.0f} s; summaries in {tmp}", flush=True)
    with open(tmp / "comparison.json", "w") as f:
        json.dump({k: v for k, v in results.items() if k != "table"}, f, indent=1)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ds_demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--preset", default="tiny", help="GPT preset (tiny / demo / bench20m)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--out-dir", default=None, help="where the configs and summaries go (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    args, extra = p.parse_known_args(argv)
    res = run_comparison(steps=args.steps, preset=args.preset, world_size=args.world_size, out_dir=args.out_dir,
                         extra_args=extra, timeout=args.timeout)
    ok = all(res[m]["params_in_sync"] and res[m]["last_val_loss"] < res[m]["first_val_loss"]
             for m in ("lioncub", "baseline"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
