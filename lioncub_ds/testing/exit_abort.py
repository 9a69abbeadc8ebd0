"""Reproducer for the SIGABRT at exit (issue 17; docs/deepspeed.md "Exit status").

Launches 2 gloo ranks (plain subprocesses, ``env://`` rendezvous) several times. Each rank
does a few all_reduces and ends the way the HF Trainer ends a run: one last collective (like
the Trainer's ``store_flos`` all_gather), then a normal interpreter exit. The gloo worker may
then release that collective's tensors after ``Py_FinalizeEx`` has begun, and CPython < 3.14
aborts the process: ``terminate called without an active exception`` (see the comment in
:mod:`lioncub_ds.groups`).

``--exit``:
  * ``normal``: nothing else (torch and CPython as they are; aborts a few launches in ten);
  * ``lioncub``: a LionCub takes one distributed step first, which registers
    :func:`lioncub_ds.groups.settle_at_exit` (the library's mitigation);
  * ``settle``: registers :func:`~lioncub_ds.groups.settle_at_exit` without a LionCub;
  * ``recipe``: ends with :func:`lioncub_ds.groups.exit_cleanly` (destroy, flush, ``os._exit``).

    python -m lioncub_ds.testing.exit_abort --launches 20 --exit normal

Prints one line per launch and a summary; exit status 1 when any rank's status was not 0.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

EXITS = ("normal", "lioncub", "settle", "recipe")
_RANK_ENV = "LIONCUB_EXIT_ABORT_RANK"


def _rank_main(mode: str) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "settle":
        from lioncub_ds.groups import settle_at_exit
        settle_at_exit()
    elif mode == "lioncub":
        from lioncub_ds import LionCub
        p = torch.nn.Parameter(torch.zeros(64))
        opt = LionCub([p], lr=1e-3)  # resolves its group now: registers the settle
        p.grad = torch.randn(64, generator=torch.Generator().manual_seed(rank))
        opt.step()
    for _ in range(10):
        dist.all_reduce(torch.ones(1024))
    print(f"[exit_abort] rank {rank} done", flush=True)
    # Like the HF Trainer's last collective (trainer_pt_utils.distributed_broadcast_scalars, from
    # store_flos): an all_gather right before the script returns. gloo's worker may let go of
    # its tensors only after the interpreter's teardown has begun.
    dist.all_gather([torch.empty(1) for _ in range(world)], torch.tensor([float(rank)]))
    if mode == "recipe":
        from lioncub_ds.groups import exit_cleanly
        exit_cleanly(0)
    return 0


def launch(mode: str, world_size: int = 2, timeout: float = 120.0, env: dict | None = None):
    """One launch: ``world_size`` ranks of this module. Returns ([rc per rank], combined log)."""
    from lioncub_ds.testing.spawn import free_port

    base = dict(os.environ)
    base.setdefault("LIONCUB_KERNELS", "torch")  # the kernels play no part; never JIT-build them here
    base.update(env or {})
    base.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size),
                 "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", "1"), _RANK_ENV: mode})
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base["PYTHONPATH"] = os.pathsep.join([root] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p])
    procs = []
    for r in range(world_size):
        procs.append(subprocess.Popen([sys.executable, "-m", "lioncub_ds.testing.exit_abort"],
                                      env=dict(base, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    rcs, logs = [], []
    deadline = time.monotonic() + timeout
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
        rcs.append(p.returncode)
        logs.append(f"--- rank {r} (rc={p.returncode})\n{out}")
    return rcs, "".join(logs)


def main(argv=None) -> int:
    mode = os.environ.get(_RANK_ENV)
    if mode:
        return _rank_main(mode)
    ap = argparse.ArgumentParser(prog="python -m lioncub_ds.testing.exit_abort", description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=10)
    ap.add_argument("--exit", choices=EXITS, default="normal")
    ap.add_argument("--world-size", type=int, default=2)
    args = ap.parse_args(argv)
    bad = 0
    for i in range(args.launches):
        rcs, log = launch(args.exit, args.world_size)
        failed = any(rc != 0 for rc in rcs)
        bad += failed
        print(f"launch {i}: rcs={rcs}" + ("  <- " + ("terminate called" if "terminate called" in log else "failed")
                                          if failed else ""), flush=True)
    print(f"{args.exit}: {bad} of {args.launches} launches had a rank exit non-zero", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
