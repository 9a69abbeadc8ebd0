"""Spawn N gloo ranks on 127.0.0.1 and collect what each returns (the one shared helper)."""
from __future__ import annotations

import io
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, env):
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(out, buf)  # plain bytes: shared-memory tensors die with this process
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException as exc:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0, env: dict | None = None):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; return results by rank.

    ``fn`` must be importable (module level). Any rank's exception fails the call with its traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    base_env = {"MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": str(world_size)}
    base_env.update(env or {})
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, base_env)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank}: {payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
