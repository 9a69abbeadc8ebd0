"""Shared by the comm / netns / converge / scaling benchmarks: spawn gloo ranks, print
tables, write JSON records, draw PNG plots, describe the machine.

Every benchmark module exposes ``build_parser()`` and ``main(argv=None) -> int`` and
accepts ``--json PATH`` (a JSON list of flat records) and ``--out DIR`` (PNG plots).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import signal
import sys
from pathlib import Path

import torch

from lioncub_ds.testing.spawn import RankError, free_port
from lioncub_ds.testing.spawn import run_ranks as _run_ranks

__all__ = ["free_port", "run_ranks", "print_table", "write_json", "machine_info", "add_output_args",
           "finish", "line_plot", "median", "RankError", "quiet_progress_lock"]


# ----------------------------------------------------------------------------- ranks
# One spawner for tests and benchmarks (lioncub_ds.testing); benchmarks run without the NCCL contract.
def run_ranks(fn, world_size: int, *args, timeout: float = 1800.0, env: dict | None = None, threads: int = 1,
              init: str = "tcp", ranks=None):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned gloo processes on 127.0.0.1.

    ``fn`` must be importable (module level). Returns the per-rank results (list by rank).
    Any rank's exception raises :class:`RankError` with its traceback; the other ranks are killed.
    ``init`` (a ``tcp://ADDR:PORT`` URL) and ``ranks`` (a subset of the global ranks) spawn one
    node's share of a world whose other ranks run elsewhere (``bench netns_nodes``).
    """
    return _run_ranks(fn, world_size, *args, timeout=timeout, env=env, threads=threads, daemon=True, init=init,
                      ranks=ranks)


# ----------------------------------------------------------------------------- progress bars
def quiet_progress_lock() -> None:
    """Give tqdm a thread lock before its first bar, instead of the multiprocessing RLock it makes itself.

    In a rank started with the spawn method (``python -m benchmarks.demo``) that RLock is a named
    semaphore registered with the parent's resource tracker; a rank that ends through
    ``lioncub_ds.groups.exit_cleanly`` (``os._exit``, see there why) never unregisters it, and the
    tracker then warns at the end of the run that semaphores leaked. Each process here draws at most
    one bar, from one thread, so a thread lock is all tqdm needs."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


# ----------------------------------------------------------------------------- output
def median(xs):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else 0.5 * (xs[m - 1] + xs[m])


def _cell(v, fmt=None):
    if v is None:
        return "-"
    if fmt is not None:
        try:
            return format(v, fmt)
        except (TypeError, ValueError):
            return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.4g}"
    return str(v)


def format_table(rows: list[dict], columns: list, title: str | None = None, markdown: bool = False) -> str:
    """``columns``: keys or (key, header, format) tuples."""
    cols = [(c, c, None) if isinstance(c, str) else (tuple(c) + (None,) * (3 - len(c)))[:3] for c in columns]
    cells = [[_cell(r.get(k), f) for k, _, f in cols] for r in rows]
    heads = [h for _, h, _ in cols]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(heads)]
    lines = []
    if markdown:
        lines.append("| " + " | ".join(heads) + " |")
        lines.append("|" + "|".join("---:" if i else "---" for i in range(len(heads))) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in cells]
    else:
        if title:
            lines.append(title)
        lines.append("  ".join(h.rjust(w) for h, w in zip(heads, widths)))
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def print_table(rows, columns, title=None) -> str:
    text = format_table(rows, columns, title)
    print(text, flush=True)
    return text


def write_json(path, records: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:  # one record per line: a valid JSON array, a tenth smaller than indented
        f.write("[\n" + ",\n".join(json.dumps(r, default=float) for r in records) + "\n]\n")
    os.replace(tmp, path)


def write_markdown(path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def machine_info() -> dict:
    """What the README's result tables cite: CPU count, torch version, date."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.date.today().isoformat(), "loadavg_1m": round(load, 2)}


def add_output_args(p: argparse.ArgumentParser, default_json: str | None = None) -> None:
    p.add_argument("--json", default=default_json, help="write the records (a JSON list of flat dicts) here")
    p.add_argument("--out", default=None, help="directory for PNG plots (and, if --json is not given, <name>.json)")


def finish(name: str, args, records: list[dict], plot_fn=None, extra_md: str | None = None) -> None:
    """Write ``--json`` (default ``<out>/<name>.json`` when only --out is given) and the plots."""
    path = args.json or (os.path.join(args.out, f"{name}.json") if args.out else None)
    if path:
        write_json(path, records)
        print(f"[bench {name}] wrote {len(records)} records to {path}", flush=True)
    if args.out and plot_fn is not None:
        os.makedirs(args.out, exist_ok=True)
        try:
            files = plot_fn(records, args.out) or []
        except ImportError as exc:  # matplotlib missing: records are still written
            print(f"[bench {name}] no plots ({exc})", file=sys.stderr)
            files = []
        for fpath in files:
            print(f"[bench {name}] wrote {fpath}", flush=True)
    if args.out and extra_md:
        write_markdown(os.path.join(args.out, f"{name}.md"), extra_md)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_plot(path, series: dict, *, xlabel: str, ylabel: str, title: str, logx=False, logy=False,
              markers=True, vlines: dict | None = None) -> str:
    """``series``: label -> (xs, ys). Writes a PNG and returns its path."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o" if markers else None, markersize=3, linewidth=1.4, label=label)
    for label, x in (vlines or {}).items():
        ax.axvline(x, color="grey", linestyle=":", linewidth=1)
        ax.text(x, ax.get_ylim()[1], label, rotation=90, va="top", ha="right", fontsize=7, color="grey")
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


class GracefulExit:
    """Context manager: SIGINT/SIGTERM raise KeyboardInterrupt so ``finally`` blocks run."""

    def __enter__(self):
        self._old = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                self._old[sig] = signal.signal(sig, self._handler)
            except (ValueError, OSError):  # not the main thread
                pass
        return self

    @staticmethod
    def _handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False
