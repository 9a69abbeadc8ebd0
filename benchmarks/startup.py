"""``python -m benchmarks startup``: what the DeepSpeed auto-registration hook costs at start-up.

``pip install`` puts ``lioncub_ds_autohook.pth`` in site-packages; at interpreter start-up it
imports a stdlib-only module that puts one finder on ``sys.meta_path``. This bench measures:

* the hook module's own import time, from ``python -X importtime -c pass``
  (the ``lioncub_ds_autohook`` line; needs the ``.pth`` installed);
* the wall time of fresh interpreters with and without the hook, as an A/B of one code path:
  ``python -S -c "import site; <skip the hook's .pth or not>; site.main(); <payload>"``, so
  that both arms process site-packages identically except for that one ``.pth`` file. Payloads:
  ``pass`` (start-up), ``import torch`` (many imports go past the finder) and, with
  ``--deepspeed``, ``import deepspeed`` (with the hook this also imports
  ``lioncub_ds.deepspeed`` and registers LionCub: that is the hook's real work).

Runs alternate between the arms; medians and the spread (min–max) are reported, because one
interpreter start is milliseconds and a busy machine moves it by more than the hook costs.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import time

from .common import add_output_args, finish, print_table

NAME = "startup"
PTH = "lioncub_ds_autohook.pth"
_SKIP = ("import site as s; _a = s.addpackage; "
         "s.addpackage = lambda d, n, k: None if n == %r else _a(d, n, k); " % PTH)


def hook_installed() -> str | None:
    """Path of the installed .pth, or None."""
    for d in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        p = os.path.join(d, PTH)
        if os.path.exists(p):
            return p
    return None


def hook_import_us(reps: int = 5) -> list[float]:
    """Self+cumulative import time (µs) of the hook module, from -X importtime, ``reps`` runs."""
    out = []
    env = dict(os.environ)
    env.pop("LIONCUB_DS_AUTOREGISTER", None)
    for _ in range(reps):
        res = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], stderr=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, text=True, env=env)
        for line in res.stderr.splitlines():
            m = re.match(r"import time:\s+(\d+)\s+\|\s+(\d+)\s+\|\s+(.*)$", line)
            if m and m.group(3).strip() == "lioncub_ds_autohook":
                out.append(float(m.group(2)))
    return out


def _time(payload: str, with_hook: bool) -> float:
    code = ("" if with_hook else _SKIP) + "import site; site.main(); " + payload
    env = dict(os.environ)
    env.pop("LIONCUB_DS_AUTOREGISTER", None)
    env.setdefault("DS_ACCELERATOR", "cpu")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-S", "-c", code], check=True, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def run(reps: int = 20, deepspeed: bool = False, verbose=True) -> list[dict]:
    pth = hook_installed()
    if pth is None:
        raise RuntimeError(f"{PTH} is not installed in this interpreter's site-packages "
                           "(pip install -e . installs it)")
    payloads = {"pass": "pass", "import torch": "import torch"}
    if deepspeed:
        payloads["import deepspeed"] = "import deepspeed"
    records = []
    imp = hook_import_us(min(reps, 10))
    records.append({"bench": NAME, "measure": "hook module import (-X importtime, cumulative)", "pth": pth,
                    "median_ms": statistics.median(imp) / 1e3 if imp else None,
                    "min_ms": min(imp) / 1e3 if imp else None, "max_ms": max(imp) / 1e3 if imp else None,
                    "runs": len(imp)})
    for name, code in payloads.items():
        n = reps if name != "import deepspeed" else max(3, reps // 4)
        _time(code, True), _time(code, False)  # warm the page cache
        with_h, without = [], []
        for i in range(n):
            for arm in ((True, False) if i % 2 == 0 else (False, True)):
                (with_h if arm else without).append(_time(code, arm))
        m_w, m_wo = statistics.median(with_h), statistics.median(without)
        records.append({"bench": NAME, "measure": f"python -c '{code}'", "payload": code, "runs": n,
                        "with_hook_median_ms": m_w * 1e3, "without_hook_median_ms": m_wo * 1e3,
                        "difference_ms": (m_w - m_wo) * 1e3,
                        "with_hook_range_ms": [min(with_h) * 1e3, max(with_h) * 1e3],
                        "without_hook_range_ms": [min(without) * 1e3, max(without) * 1e3]})
        if verbose:
            print(f"[bench startup] {code}: {n} runs per arm", flush=True)
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    for r in records:
        r["loadavg_1m"] = round(load, 2)
    return records


def build_parser():
    p = argparse.ArgumentParser(prog="python -m benchmarks startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=20, help="interpreter starts per arm and payload")
    p.add_argument("--deepspeed", action="store_true", help="also time 'import deepspeed' (seconds per run)")
    add_output_args(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        records = run(args.reps, args.deepspeed)
    except RuntimeError as exc:
        print(f"[bench startup] {exc}", file=sys.stderr)
        return 2
    r0 = records[0]
    print(f"[bench startup] {r0['measure']}: median {r0['median_ms']:.3f} ms "
          f"(min {r0['min_ms']:.3f}, max {r0['max_ms']:.3f}, {r0['runs']} runs)")
    rows = [dict(r, with_range="{:.0f}–{:.0f}".format(*r["with_hook_range_ms"]),
                 without_range="{:.0f}–{:.0f}".format(*r["without_hook_range_ms"])) for r in records[1:]]
    print_table(rows, [("measure", "command"), ("runs", "runs/arm"), ("with_hook_median_ms", "with hook ms", ".1f"),
                       ("with_range", "range"), ("without_hook_median_ms", "without ms", ".1f"),
                       ("without_range", "range"), ("difference_ms", "difference ms", "+.1f")],
                title=f"[bench startup] fresh interpreters, hook .pth processed or skipped (python -S + site.main()), "
                      f"medians; load average {r0['loadavg_1m']}")
    finish(NAME, args, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
