"""``python -m benchmarks zero``: ZeRO-1 sign all-gather vs DeepSpeed's parameter all-gather.

Runs ``examples/pretrain_gpt_deepspeed.py`` on 2 CPU ranks (``torch.distributed.run``,
``DS_ACCELERATOR=cpu``, gloo) once per config and reads ``lioncub_ds.deepspeed.comm_stats(engine)``
from the run summary (``--json-out``):

* ``configs/ds_cpu_zero1.json``: fp32 parameters, ZeRO stage 1, ``zero_allgather: "auto"``;
* ``configs/ds_cpu_zero1_bf16.json``: bf16 parameters, ZeRO stage 1, ``zero_fp32_replica: true``.

Bytes are per rank per optimizer step, counted in the collectives (ring model): the sign
all-gather that rebuilds the parameters against the parameter all-gather DeepSpeed would have
sent. ZeRO's gradient reduce-scatter is the same either way and is not included. The first
DeepSpeed run on a CPU machine JIT-builds its shm op (~35 s, cached afterwards).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from lioncub_ds.ds_shm import removing_launch_workspaces
from lioncub_ds.testing.spawn import free_port
from .common import add_output_args, finish, print_table

NAME = "zero"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"fp32": "configs/ds_cpu_zero1.json", "bf16 + zero_fp32_replica": "configs/ds_cpu_zero1_bf16.json"}


def run_one(label: str, config: str, steps: int, preset: str, world_size: int, timeout: float, verbose=True) -> dict:
    with tempfile.TemporaryDirectory(prefix="lioncub_zero_") as tmp:
        out = os.path.join(tmp, "summary.json")
        port = free_port()  # never the launcher's default 29500: it may be a live job's on a shared machine
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--master_addr", "127.0.0.1",
               "--master_port", str(port), "--nproc_per_node", str(world_size),
               os.path.join(ROOT, "examples", "pretrain_gpt_deepspeed.py"), "--deepspeed_config",
               os.path.join(ROOT, config), "--preset", preset, "--steps", str(steps), "--log-interval", str(steps),
               "--eval-interval", str(steps), "--eval-iters", "1", "--no-progress", "--json-out", out]
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        t0 = time.perf_counter()
        with removing_launch_workspaces(port):  # this launch's DeepSpeed CPU shm buffers outlive its ranks
            res = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, timeout=timeout)
        if res.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"bench zero: {label} run failed (exit {res.returncode}):\n{res.stdout[-4000:]}")
        with open(out) as f:
            summary = json.load(f)
    cs = summary.get("comm_stats") or {}
    n = max(1, int(cs.get("steps", 0)))
    last = cs.get("last_step") or {}
    rec = {"bench": NAME, "params_dtype": label, "config": config, "preset": preset, "params": summary["params"],
           "world_size": summary["world_size"], "zero_stage": summary["zero_stage"], "steps": n,
           "zero_allgather": cs.get("zero_allgather"),
           "sign_allgather_bytes_last_step": last.get("bytes_sent"),
           "param_allgather_bytes_last_step": last.get("param_allgather_bytes"),
           "sign_allgather_bytes_per_step": cs.get("bytes_sent", 0) / n,
           "param_allgather_bytes_per_step": cs.get("param_allgather_bytes", 0) / n,
           "ratio_last_step": (last.get("param_allgather_bytes") / last["bytes_sent"]) if last.get("bytes_sent") else None,
           "ratio_cumulative": cs.get("ratio_vs_param_allgather"),
           "nonzero_plane_steps": cs.get("nonzero_plane_steps"),
           "extra_memory_bytes_per_rank": cs.get("extra_memory_bytes"),
           "params_in_sync": summary.get("params_in_sync"), "val_loss_first": summary.get("first_val_loss"),
           "val_loss_last": summary.get("last_val_loss"), "wall_s": time.perf_counter() - t0}
    if verbose:
        print(f"[bench zero] {label}: {rec['wall_s']:.1f} s", flush=True)
    return rec


def build_parser():
    p = argparse.ArgumentParser(prog="python -m benchmarks zero", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    add_output_args(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        records = [run_one(c, CONFIGS[c], args.steps, args.preset, args.world_size, args.timeout) for c in args.configs]
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"[bench zero] FAILED: {exc}", file=sys.stderr)
        return 1
    print_table(records, [("params_dtype", "parameters"), ("sign_allgather_bytes_last_step", "sign AG B (last step)"),
                          ("param_allgather_bytes_last_step", "DeepSpeed param AG B"),
                          ("ratio_last_step", "ratio", ".1f"), ("ratio_cumulative", f"ratio over {args.steps} steps", ".1f"),
                          ("nonzero_plane_steps", "steps with nonzero plane"),
                          ("extra_memory_bytes_per_rank", "extra memory B/rank"), ("params_in_sync", "in sync")],
                title=f"[bench zero] ZeRO-1, {args.world_size} CPU ranks, GPT {args.preset} "
                      f"({records[0]['params']:,} params), bytes per rank per optimizer step "
                      f"(gradient reduce not included)")
    finish(NAME, args, records)
    print(f"[bench zero] done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
