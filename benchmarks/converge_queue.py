"""Run a ``bench converge`` study as a queue of one-run jobs, a few at a time, resumable.

A 10-seed study is tens of CPU-hours of single-threaded runs. This runs each (N, variant, seed) as its
own ``python -m benchmarks converge`` process (one torch thread: part of what makes runs repeatable)
with ``--partial DIR/<tag>.jsonl``, ``--workers`` of them at once, rows in order (every seed of the
first variant, then the next), so a stopped queue leaves whole rows behind. Run it again with the
same arguments and it skips every run already in a ``*.jsonl`` of ``--dir`` or of a ``--done`` folder
(e.g. the study's committed runs), and a run cut off mid-way starts again from its step 0 (its
partial file keeps what finished). Then merge: ``python -m benchmarks converge --merge DIR/*.jsonl``.

    python -m benchmarks.converge_queue --protocol lion_w300 --world-sizes 32 --seeds 0 1 2 3 4 5 6 7 8 9 \\
        --variants cub_b3 cub_int8 --dir runs/w3 --done docs/lion_w300/runs --workers 2
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from . import converge as C


def jobs(world_sizes, variants, seeds) -> list[tuple[int, str, int]]:
    """(N, variant, seed) in queue order: per N, every seed of one variant before the next variant."""
    return [(n, v, s) for n in world_sizes for v in variants for s in seeds]


def tag(n: int, variant: str, seed: int) -> str:
    return f"n{n}_{variant}_s{seed}"


def finished(folders, protocol: str, preset: dict | None = None) -> set[tuple[int, str, int]]:
    """(N, variant, seed) of the runs of ``protocol`` recorded in any ``*.jsonl`` of ``folders``
    (unreadable lines, from a run cut off mid-way through a write, are skipped). ``preset``: the
    settings the queue's runs use (PRESET_KEYS: model shape, steps, betas, ...); a record made with
    other values is another run, so it does not count (a width-256 queue must not skip the
    width-128 runs of the same folder: both are "lion_w300 (with d_model changed)")."""
    want = {k: json.dumps(v) for k, v in (preset or {}).items()}
    done = set()
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
            for r in C.jsonl_records(path):
                if r is None or r.get("bench") != "converge" or r.get("protocol") != protocol:
                    continue
                if any(k in r and json.dumps(r[k]) != v for k, v in want.items()):
                    continue
                done.add((r["world_size"], r["variant"], r["seed"]))
    return done


def command(protocol: str, n: int, variant: str, seed: int, folder: str, extra=()) -> list[str]:
    return [sys.executable, "-m", "benchmarks", "converge", "--protocol", protocol, "--threads", "1",
            "--world-sizes", str(n), "--seeds", str(seed), "--variants", variant,
            "--partial", os.path.join(folder, tag(n, variant, seed) + ".jsonl"), *extra]


class Runs:
    """The runs in flight, each in a process group of its own, so that the queue ends them (and
    whatever they started) when it is stopped: ``kill <queue pid>`` reaches the queue only, and runs
    left behind would be started a second time by the next queue, two records per run."""

    def __init__(self):
        self.lock = threading.Lock()
        self.live: set[subprocess.Popen] = set()
        self.stopped_by = None  # the signal that stopped the queue

    def start(self, cmd, **kw):
        """The run's process, or None once the queue is stopping (no new run starts)."""
        with self.lock:  # a run starts whole or not at all, never between a stop's look and its kill
            if self.stopped_by is not None:
                return None
            proc = subprocess.Popen(cmd, start_new_session=True, **kw)
            self.live.add(proc)
            return proc

    def finished(self, proc) -> None:
        with self.lock:
            self.live.discard(proc)

    def stop(self, signum, frame=None) -> None:
        """The SIGTERM / SIGINT handler: end every run's process group (SIGTERM; a second signal, SIGKILL)."""
        with self.lock:
            again = self.stopped_by is not None
            self.stopped_by = signum
            live = list(self.live)
        for proc in live:
            try:
                os.killpg(proc.pid, signal.SIGKILL if again else signal.SIGTERM)
            except ProcessLookupError:
                pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.converge_queue", description=__doc__.split("\n\n")[0])
    p.add_argument("--protocol", required=True, choices=sorted(C.PROTOCOLS))
    p.add_argument("--world-sizes", type=int, nargs="+", required=True)
    p.add_argument("--seeds", type=int, nargs="+", required=True)
    p.add_argument("--variants", nargs="+", required=True)
    p.add_argument("--dir", required=True, help="where each run's <tag>.jsonl and <tag>.log go")
    p.add_argument("--done", nargs="*", default=[], metavar="DIR",
                   help="more folders of *.jsonl whose runs count as done (e.g. docs/<study>/runs)")
    p.add_argument("--workers", type=int, default=2, help="runs at once (default 2: one per core of a 2-core machine)")
    p.add_argument("--dry-run", action="store_true", help="print the commands of the runs still to do, run none")
    p.add_argument("extra", nargs="*", help="after --: more bench converge flags for every run (they change the "
                                            "preset: the records say so)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers {args.workers}: must be >= 1")
    for v in args.variants:
        try:
            C.spec_of(v)
        except ValueError as exc:
            p.error(f"--variants: {exc}")
    if any(n < 1 for n in args.world_sizes):
        p.error(f"--world-sizes {args.world_sizes}: each must be >= 1")
    # the name the runs' records will carry: the protocol's, or "NAME (with ... changed)" under extra flags
    try:
        conv = C.build_parser().parse_args(["--protocol", args.protocol, *args.extra])
    except SystemExit:
        p.error(f"the flags after -- ({' '.join(args.extra)}) are not bench converge flags")
    conv = C.apply_protocol(conv)
    preset = {k: v for k, v in C.make_cfg(**conv.settings).items() if k in C.PRESET_KEYS}
    done = finished([args.dir, *args.done], conv.protocol_name, preset)
    every = jobs(args.world_sizes, args.variants, args.seeds)
    todo = [j for j in every if j not in done]
    print(f"[converge_queue] {len(todo)} runs to do, {len(every) - len(todo)} already done; {args.workers} at a "
          f"time; logs in {args.dir}/", flush=True)
    if args.dry_run:
        for j in todo:
            print(" ".join(command(args.protocol, *j, args.dir, args.extra)))
        return 0
    os.makedirs(args.dir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def say(msg):
        # one write per line: print() writes the text and the newline apart, so two workers' lines
        # could run together
        sys.stdout.write(f"[converge_queue] {time.strftime('%H:%M:%S')} {msg}\n")
        sys.stdout.flush()

    runs = Runs()

    def one(job):
        t0 = time.time()
        with open(os.path.join(args.dir, tag(*job) + ".log"), "w") as log:
            proc = runs.start(command(args.protocol, *job, args.dir, args.extra), stdout=log,
                              stderr=subprocess.STDOUT, env=env)
            if proc is None:
                return None
            say(f"start {tag(*job)} pid={proc.pid}")
            rc = proc.wait()
        runs.finished(proc)
        say(f"end {tag(*job)} rc={rc} ({time.time() - t0:.0f} s)")
        return rc

    handlers = {sig: signal.signal(sig, runs.stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with ThreadPoolExecutor(args.workers) as pool:
            rcs = list(pool.map(one, todo))
    finally:
        for sig, old_handler in handlers.items():
            signal.signal(sig, old_handler)
    if runs.stopped_by is not None:
        name = signal.Signals(runs.stopped_by).name
        print(f"[converge_queue] stopped by {name}: the runs in flight were ended with their process groups; "
              "the same command resumes", file=sys.stderr, flush=True)
        return 128 + runs.stopped_by
    failed = [tag(*j) for j, rc in zip(todo, rcs) if rc != 0]
    if failed:
        print(f"[converge_queue] {len(failed)} runs failed (see their .log): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
