"""The study's records on disk: JSONL files appended run by run (``--partial``), read back line by line
(a line a killed writer cut off is skipped, with a warning), and merged (``--merge``)."""
from __future__ import annotations

import json
import os
import sys


NAME = "converge"


def append_jsonl(path, records) -> None:
    """Append ``records`` to the JSONL file ``path``, one per line (a last line that a killed writer
    left unfinished is closed first, so it stays one unreadable line instead of spoiling the next)."""
    torn = False
    if os.path.exists(path) and os.path.getsize(path):
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
    with open(path, "a") as f:
        if torn:
            f.write("\n")
        for r in records:
            f.write(json.dumps(r) + "\n")


def jsonl_records(path):
    """Each line of the JSONL file ``path`` in order: its record, or None where the line does not parse
    (a run killed mid-write leaves one; the resumed run, the queue and ``--merge`` skip it, and the
    line stays after the run is redone, so every reader must)."""
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except ValueError:
                r = None
            yield r if isinstance(r, dict) else None


def warn_unreadable(where: str, path, bad: int) -> None:
    if bad:
        print(f"[bench converge] {where} {path}: skipped {bad} unreadable line(s) (a run cut off mid-write)",
              file=sys.stderr, flush=True)


def merge(paths, variants=None, world_sizes=None):
    """Records (config, per-run records, tune records, curves) of several JSON outputs, deduplicated
    (the first file's run wins), optionally only the runs of ``variants`` / ``world_sizes``."""
    meta, records, tune_recs, curves, seen = [], [], [], [], set()
    for path in paths:
        if path.endswith(".jsonl"):
            recs = list(jsonl_records(path))
            warn_unreadable("--merge", path, recs.count(None))
            recs = [r for r in recs if r is not None]
        else:
            with open(path) as f:
                recs = json.load(f)
        for r in recs:
            b = r.get("bench")
            if b == "converge_config":
                meta.append(r)
            elif b == NAME:
                key = (r["world_size"], r["variant"], r["seed"])
                if (variants and r["variant"] not in variants) or (world_sizes and r["world_size"] not in world_sizes):
                    continue
                if key not in seen:
                    seen.add(key)
                    records.append(r)
            elif b == "converge_tune" and not (world_sizes and r["world_size"] not in world_sizes):
                tune_recs.append(r)
            elif b == "converge_curve":
                curves.append(r)
    keys = {(r["world_size"], r["variant"], r["seed"]) for r in records}
    curves = [c for c in curves if (c["world_size"], c["variant"], c["seed"]) in keys]
    uniq, cseen = [], set()
    for c in curves:
        k = (c["world_size"], c["variant"], c["seed"], c["step"])
        if k not in cseen:
            cseen.add(k)
            uniq.append(c)
    settings = {k: v for k, v in (meta[0] if meta else {}).items() if k not in ("argv", "lrs", "wall_s", "variants")}
    for m in meta[1:]:
        diff = {k for k in settings if k in m and m[k] != settings[k] and k not in ("bench",)}
        if diff:
            raise SystemExit(f"--merge: the runs differ in settings {sorted(diff)}: not comparable")
    return meta, records, tune_recs, uniq
