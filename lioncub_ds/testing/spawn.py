"""Spawn N gloo ranks on 127.0.0.1 and collect what each returns (the one rank spawner).

Used by the tests (with the NCCL-contract wrapper on) and by the benchmarks (off).
"""
from __future__ import annotations

import io
import os
import pickle
import queue as _queue
import socket
import sys
import tempfile
import threading
import time
import traceback

import torch

from . import nccl_contract

__all__ = ["free_port", "run_ranks", "RankError"]


class RankError(RuntimeError):
    """A spawned rank failed (the message carries its traceback)."""


PORT_TAKEN = "port_taken"
TCP_ATTEMPTS = 3


_GIVEN: list[int] = []


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it). Every launch of the
    project's tests, demos and benches takes its port here, never a fixed one (port 29500, the
    launchers' default, may be a live job's on a shared machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _GIVEN.append(port)
    return port


def ports_given() -> tuple[int, ...]:
    """Every port :func:`free_port` returned in this process: its own launches' ports, by which
    tests/conftest.py tells their DeepSpeed shm workspaces from another job's (lioncub_ds.ds_shm)."""
    return tuple(_GIVEN)


def _watch(rank, q, dump, contract, main_ident):
    """On the parent's request (a rank seems hung): report where the main thread is, and the log.

    ``dump`` is a lock-free shared flag, polled: a multiprocessing Event would make the parent's
    ``set()`` wait for every waiting thread to acknowledge, forever if one of them belonged to a
    rank that had already exited (the parent then hung instead of reporting the silent rank)."""
    while not dump.value:
        time.sleep(0.2)
    frame = sys._current_frames().get(main_ident)
    stack = "".join(traceback.format_stack(frame)[-8:]) if frame is not None else "(no stack)"
    q.put((rank, "hung", f"hung; its main thread is at:\n{stack}", nccl_contract.snapshot() if contract else None))


def _worker(rank, world_size, init_method, payload, q, env, threads, contract, device, dump):
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    torch.set_num_threads(threads)
    import torch.distributed as dist

    snap = None
    threading.Thread(target=_watch, args=(rank, q, dump, contract, threading.get_ident()), daemon=True).start()
    try:
        if contract:
            # Before the rank function's module is imported, so references it takes at import
            # time already point at the wrappers (install() also patches earlier ones).
            nccl_contract.install(device)
        fn, args = pickle.loads(payload)
        try:
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
        except Exception as exc:  # noqa: BLE001
            if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
                # the free port was taken between free_port() and the store's listen (another
                # job on the machine): nothing has run yet, the parent launches again elsewhere
                q.put((rank, PORT_TAKEN, str(exc), None))
                return
            raise
        try:
            out = fn(rank, world_size, *args)
        finally:
            if contract:
                snap = nccl_contract.snapshot()
            dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(out, buf)  # plain bytes: shared-memory tensors die with this process
        q.put((rank, "ok", buf.getvalue(), snap))
    except BaseException as exc:  # noqa: BLE001 - report any failure to the parent
        if contract and snap is None:
            snap = nccl_contract.snapshot()
        q.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}", snap))


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0, env: dict | None = None, threads: int = 1,
              daemon: bool = False, init: str = "tcp", contract: bool = False, device=None, grace: float = 10.0,
              ranks=None):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned gloo processes; return results by rank.

    ``fn`` must be importable (module level); ``args`` must pickle. Any rank's exception raises
    :class:`RankError` with that rank's traceback (the other ranks get ``grace`` seconds to
    report, then are killed).

    * ``init``: ``"tcp"`` (127.0.0.1 and a free port) or ``"file"`` (a FileStore in a fresh
      temporary directory: no port race), or an ``init_method`` URL (``tcp://ADDR:PORT``) that
      the ranks spawned elsewhere use too (with ``ranks``).
    * ``ranks``: which global ranks of the ``world_size`` to spawn here (default all); the others
      are spawned by another call (another host or network namespace) with the same URL ``init``.
      Returns the results of these ranks, in the order given.
    * ``daemon``: daemonic ranks die with the parent but cannot start processes of their own;
      Megatron ranks (dist-checkpointing) start children, so the default is False.
    * ``contract``: install the NCCL-contract wrapper (:mod:`lioncub_ds.testing.nccl_contract`)
      in every rank with ``device`` as the parameters' device (default cpu). Violations raise
      :class:`~lioncub_ds.testing.nccl_contract.NCCLContractError`; after the ranks finish, their
      call logs are compared here and a mismatch raises it too, with the first difference.
    """
    if init != "tcp":
        return _run_once(fn, world_size, args, timeout, env, threads, daemon, init, contract, device, grace, ranks)
    # "tcp": the port free_port() found may be taken by another process before rank 0's store
    # listens on it (a race with every other job on the machine); then launch again on another
    for _ in range(TCP_ATTEMPTS):
        out = _run_once(fn, world_size, args, timeout, env, threads, daemon,
                        f"tcp://127.0.0.1:{free_port()}", contract, device, grace, ranks)
        if out is not PORT_TAKEN:
            return out
    raise RankError(f"rank 0 could not listen on a free port in {TCP_ATTEMPTS} attempts (EADDRINUSE each time)")


def _run_once(fn, world_size, args, timeout, env, threads, daemon, init, contract, device, grace, ranks):
    """One launch of :func:`run_ranks`; returns PORT_TAKEN if the store's port was taken."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    tmpdir = None
    if init == "file":
        tmpdir = tempfile.mkdtemp(prefix="lioncub-store-")
        init_method = "file://" + os.path.join(tmpdir, "store")
    elif "://" in init:
        init_method = init
    else:
        raise ValueError(f"init={init!r}; allowed: 'tcp', 'file', or an init_method URL")
    ranks = list(range(world_size)) if ranks is None else list(ranks)
    base_env = {"MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": str(threads), "LOCAL_WORLD_SIZE": str(world_size),
                "WORLD_SIZE": str(world_size)}
    base_env.update(env or {})
    payload = pickle.dumps((fn, args))
    dev = str(device) if device is not None else None
    dump = ctx.RawValue("b", 0)  # the parent's "report where you are" flag (see _watch)
    procs = {r: ctx.Process(target=_worker, args=(r, world_size, init_method, payload, q, base_env, threads, contract,
                                                  dev, dump), daemon=daemon)
             for r in ranks}
    for p in procs.values():
        p.start()
    results, errors, snaps = {}, {}, {}
    port_taken = False
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < len(ranks) and not port_taken:
            try:
                rank, status, data, snap = q.get(timeout=0.5)
            except _queue.Empty:
                for i, p in procs.items():
                    if p.exitcode not in (None, 0) and i not in results and i not in errors:
                        time.sleep(0.5)  # its report may still be in the pipe
                        if q.empty():
                            errors[i] = f"died with exit code {p.exitcode} (no report)"
                if time.monotonic() > deadline:
                    missing = [i for i in ranks if i not in results and i not in errors]
                    dump.value = 1  # ask the silent ranks where they are (and for their call logs)
                    until = time.monotonic() + 5.0
                    while missing and time.monotonic() < until:
                        try:
                            rank, status, data, snap = q.get(timeout=0.5)
                        except _queue.Empty:
                            continue
                        if rank in missing:
                            missing.remove(rank)
                            errors[rank] = f"no report after {timeout:.0f} s: " + str(data)
                            if snap is not None:
                                snaps[rank] = snap
                    for i in missing:
                        errors[i] = f"no report after {timeout:.0f} s (hung?)"
                continue
            if status == "hung":
                continue  # a late answer to the dump request
            if status == PORT_TAKEN:
                port_taken = True  # the others wait for a store that is not there: stop them all
                continue
            if snap is not None:
                snaps[rank] = snap
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(data), weights_only=False)
            else:
                errors[rank] = data
                deadline = min(deadline, time.monotonic() + grace)  # let the others report, briefly
    finally:
        for p in procs.values():
            p.join(timeout=2 if errors or port_taken else 30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if tmpdir is not None:
            import shutil
            shutil.rmtree(tmpdir, ignore_errors=True)
    if port_taken:
        return PORT_TAKEN
    contract_msgs = []
    if contract:
        for r in sorted(snaps):
            if snaps[r]["violations"]:
                contract_msgs.append(f"rank {r}: {snaps[r]['violations'][0]}")
        if len(snaps) == len(ranks):
            diff = nccl_contract.compare_logs([snaps[r] for r in ranks])
            if diff:
                contract_msgs.append(diff + ("\n  (a failed rank's log ends where it failed)" if errors else ""))
    if errors:
        text = "\n".join(f"rank {r}: {errors[r]}" for r in sorted(errors))
        if contract_msgs:
            text = "\n".join(contract_msgs) + "\n" + text
        raise (nccl_contract.NCCLContractError if contract_msgs else RankError)(text)
    if contract_msgs:
        raise nccl_contract.NCCLContractError("\n".join(contract_msgs))
    return [results[r] for r in ranks]
