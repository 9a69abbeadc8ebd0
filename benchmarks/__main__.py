"""``python -m benchmarks <name> [args]`` -- dispatch to a registered benchmark.

``python -m benchmarks all [--out DIR]`` runs every benchmark of
:data:`benchmarks.BENCHMARKS` in turn with its default settings, each writing
``DIR/<name>.json`` (and its plots) into ``DIR`` (default ``results``).
"""
from __future__ import annotations

import importlib
import sys

from . import BENCHMARKS


def _usage() -> str:
    names = ", ".join(sorted(BENCHMARKS))
    return (f"usage: python -m benchmarks <name> [args]   (name: {names}, or all)\n"
            f"       python -m benchmarks <name> --help")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "all":
        if "--out" not in rest and not any(a.startswith("--out=") for a in rest):
            rest = ["--out", "results"] + rest
        status = 0
        for bench in BENCHMARKS:
            print(f"==> python -m benchmarks {bench} {' '.join(rest)}", flush=True)
            try:
                rc = importlib.import_module(BENCHMARKS[bench]).main(list(rest))
            except Exception as exc:  # noqa: BLE001 - one failing benchmark must not hide the others
                print(f"==> {bench} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                rc = 1
            status = status or int(rc or 0)
        return status
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}\n{_usage()}", file=sys.stderr)
        return 2
    return int(importlib.import_module(BENCHMARKS[name]).main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
