"""The study: lr tuning per family, the paired runs of every (N, seed, variant), resumed from what a
stopped study appended (``--partial``), and the command that re-runs one record."""
from __future__ import annotations

import json
import math
import os

import torch

from .records import NAME, append_jsonl, jsonl_records, warn_unreadable
from .training import train_one
from .variants import DEFAULT_LR, DEFAULT_VARIANTS, FAMILIES, PRESET_KEYS, PROTOCOLS, make_cfg, spec_of, warmup_of


def _load(cfg):
    from benchmarks.data import load_dataset

    return load_dataset(cfg["data"])


def tune(world_sizes, cfg, grid, tune_seed, device="cpu", verbose=True, ds=None, base=None, tune_with=None):
    """lr sweep per family and N on ``tune_seed`` -> ({N: {family: best lr}}, records).

    ``base``: the lrs of the families not swept (the Lion-family wd follows lr_adamw)."""
    ds = ds or _load(cfg)
    best, recs = {}, []
    for n in world_sizes:
        best[n] = {}
        for fam, lrs in grid.items():
            results = []
            for lr in lrs:
                trial = {**DEFAULT_LR, **(base or {}), **best[n]}
                trial[fam] = lr
                variant = (tune_with or {}).get(fam, FAMILIES[fam])
                r = train_one(variant, tune_seed, n, cfg, trial, ds, device)
                loss = r["curve"][-1][1]
                results.append((loss if math.isfinite(loss) else float("inf"), lr))
                recs.append({"bench": "converge_tune", "world_size": n, "family": fam, "variant": variant,
                             "lr": lr, "seed": tune_seed, "val_loss": loss, "steps": cfg["steps"],
                             "betas": list(cfg["betas"]) if fam != "adamw" else list(cfg["adamw_betas"])})
                if verbose:
                    print(f"[bench converge] tune N={n} {fam:5s} lr {lr:.2e}: val {loss:.4f}  ({r['wall_s']:.0f} s)",
                          flush=True)
            best[n][fam] = min(results)[1]
    return best, recs


def _dlion_from_1bit(r):
    """D-Lion majority (all-gather) and Lion Cub 1bit apply the same Δ every step (same votes, same
    tie rule): one simulated run gives both; only the bytes differ."""
    out = dict(r, variant="dlion")
    out["curve"] = [(s, l, a["allgather"]) for (s, l, _), a in zip(r["curve"], r["alt_curve"])]
    out["bytes"] = r["alt_curve"][-1]["allgather"]
    return out


def _run_from_kept(rec, curves):
    """A kept run (its record and curve lines from --partial) in :func:`train_one`'s form, so that
    ``dlion`` can be derived from a kept ``cub_1bit`` instead of run again; None when its curves do
    not carry the all-gather bytes (files written before they did)."""
    pts = sorted(curves, key=lambda c: c["step"])
    if not pts or any("allgather_bytes_per_rank" not in c for c in pts):
        return None
    return {"curve": [(c["step"], c["val_loss"], c["bytes_per_rank"]) for c in pts],
            "alt_curve": [{"allgather": c["allgather_bytes_per_rank"]} for c in pts],
            "bytes": rec["bytes_per_rank"], "sync_bytes": rec["sync_bytes_per_rank"],
            "intra_bytes": rec.get("intra_node_bytes_per_rank", 0), "node_size": rec.get("node_size", 1),
            "params": rec["params"], "wall_s": rec["wall_s"], "digest": rec["digest"], "lr": rec["lr"],
            "family": rec["family"], "fp32_allreduce_bytes_per_step": rec["fp32_allreduce_bytes"] / rec["steps"]}


def study_settings(cfg, protocol, corpus, device) -> str:
    """Everything that decides a run's result besides N, seed, variant and the lrs (threads do not)."""
    return json.dumps({"cfg": {k: v for k, v in cfg.items() if k != "threads"}, "protocol": protocol,
                       "corpus": corpus, "device": device}, sort_keys=True)


def finished_runs(path, settings: str, lrs_of) -> dict:
    """{(N, seed, variant, lr): (record, its curve records)} of the runs in the --partial file
    ``path`` that this study would make: each run counts under the ``converge_config`` line that its
    invocation wrote before it, whose :func:`study_settings` must equal ``settings`` and whose lrs
    for N must equal ``lrs_of(N)`` (every family's: AdamW's lr enters Lion's weight decay); its
    curve lines are the ones written right after it. Unreadable lines (a run cut off mid-write) are
    skipped, with a warning. A missing file has none."""
    if not path or not os.path.exists(path):
        return {}
    keys = json.loads(settings)["cfg"]  # the settings a config line is compared on
    out, cur, rec, bad = {}, None, None, 0
    for r in jsonl_records(path):
        if r is None:
            bad, rec = bad + 1, None  # the curve lines after a cut-off line belong to no kept run
            continue
        kind = r.get("bench")
        if kind == "converge_config":
            same = study_settings({k: r.get(k) for k in keys}, r.get("protocol"),
                                  r.get("corpus"), r.get("device", "cpu")) == settings
            cur, rec = (r.get("lrs", {}) if same else None), None
        elif kind == NAME:
            n, rec = r.get("world_size"), None
            lrs = None if cur is None else cur.get(str(n))
            if lrs is not None and json.dumps(lrs, sort_keys=True) == json.dumps(lrs_of(n), sort_keys=True):
                rec = out.setdefault((n, r["seed"], r["variant"], r["lr"]), (r, []))
                rec = rec if rec[0] is r else None  # a second copy of a kept run: its curves are not wanted
        elif kind == "converge_curve" and rec is not None and \
                (r.get("world_size"), r.get("seed"), r.get("variant")) == (rec[0]["world_size"], rec[0]["seed"],
                                                                          rec[0]["variant"]):
            rec[1].append(r)
    warn_unreadable("--partial", path, bad)
    return out


def run(variants=DEFAULT_VARIANTS, seeds=(0, 1, 2, 3, 4), world_sizes=(8,), lrs=None, device="cpu", verbose=True,
        ds=None, partial=None, protocol="custom", **kw):
    """Paired runs. ``lrs``: {N: {family: lr}} (or one {family: lr} for every N). Returns records, curves.
    ``partial``: a JSONL file each finished run is appended to; a run already there with the same
    settings and lrs (:func:`finished_runs`: written by ``main``, which records them first) is
    taken from it instead of run again, so a stopped study resumes where it stopped."""
    cfg = make_cfg(**kw)
    torch.set_num_threads(cfg["threads"])
    ds = ds or _load(cfg)
    records, curves = [], []

    def lrs_of(n):
        lr_n = dict(DEFAULT_LR)
        if lrs:
            lr_n.update(lrs.get(n, lrs) if all(isinstance(k, int) for k in lrs) else lrs)
        return lr_n

    kept = finished_runs(partial, study_settings(cfg, protocol, ds.name, device), lrs_of)
    for n in world_sizes:
        lr_n = lrs_of(n)
        for seed in seeds:
            done = {}
            order = sorted(variants, key=lambda v: v == "dlion")  # dlion reuses cub_1bit when both are asked
            for v in order:
                old = kept.get((n, seed, v, lr_n[spec_of(v)["family"]]))
                if old is not None:
                    records.append(old[0])
                    curves += old[1]
                    if v == "cub_1bit":
                        done[v] = _run_from_kept(*old)
                    if verbose:
                        print(f"[bench converge] N={n:2d} seed {seed} {v:22s} val {old[0]['val_loss']:.4f}  "
                              f"(kept from {partial})", flush=True)
                    continue
                if v == "dlion" and done.get("cub_1bit") is not None:
                    r = _dlion_from_1bit(done["cub_1bit"])
                else:
                    r = train_one(v, seed, n, cfg, lr_n, ds, device)
                done[v] = r
                spec = spec_of(v)
                rec = {"bench": NAME, "variant": v, "label": spec["label"], "family": r["family"],
                       "world_size": n, "seed": seed, "steps": cfg["steps"], "lr": r["lr"],
                       "val_loss": r["curve"][-1][1], "first_val_loss": r["curve"][0][1],
                       "bytes_per_rank": int(r["bytes"]), "sync_bytes_per_rank": int(r["sync_bytes"]),
                       "fp32_allreduce_bytes": int(r["fp32_allreduce_bytes_per_step"] * cfg["steps"]),
                       "params": r["params"], "digest": r["digest"], "wall_s": round(r["wall_s"], 1),
                       "sync": json.dumps(spec.get("sync")) if spec.get("sync") else "",
                       "sync_dtype": spec["sync"].get("dtype", "fp32") if spec.get("sync") else "",
                       # the preset: re-run with --protocol NAME --world-sizes N --seeds S --variants V
                       "protocol": protocol, **{k: cfg[k] for k in PRESET_KEYS}, "warmup": warmup_of(v, cfg)}
                if spec["kind"] not in ("adamw", "lion", "hybrid"):  # voters Nn x L; bytes_per_rank: the inter-node link's
                    L = r["node_size"]
                    rec.update(node_size=L, voters=n // L, intra_node_bytes_per_rank=int(r["intra_bytes"]),
                               momentum_per_rank_ratio=1.0 / L)
                rec["bytes_ratio_vs_fp32"] = rec["fp32_allreduce_bytes"] / rec["bytes_per_rank"]
                records.append(rec)
                mine = [{"bench": "converge_curve", "variant": v, "world_size": n, "seed": seed, "step": step,
                         "val_loss": loss, "bytes_per_rank": int(sent)} for step, loss, sent in r["curve"]]
                if v == "cub_1bit":  # what D-Lion's all-gather would have sent: dlion from a kept cub_1bit
                    for c, a in zip(mine, r["alt_curve"]):
                        c["allgather_bytes_per_rank"] = int(a["allgather"])
                curves += mine
                if partial:
                    append_jsonl(partial, [rec] + mine)
                if verbose:
                    print(f"[bench converge] N={n:2d} seed {seed} {v:22s} val {rec['val_loss']:.4f}  "
                          f"{rec['bytes_ratio_vs_fp32']:6.1f}x fewer bytes than fp32  {r['wall_s']:.0f} s", flush=True)
    return records, curves, cfg


def command_for(record) -> list[str]:
    """The ``bench converge`` arguments that re-run ``record`` (one run: its protocol, N, seed and
    variant, plus every preset setting in which it differs from its protocol, and its lr)."""
    name = record["protocol"].split(" (")[0]
    base = PROTOCOLS[name]["settings"] if name in PROTOCOLS else {}
    argv = (["--protocol", name] if name in PROTOCOLS else []) + [
        "--world-sizes", str(record["world_size"]), "--seeds", str(record["seed"]), "--variants", record["variant"],
        "--lr", f"{record['family']}={record['lr']!r}"]
    for k in PRESET_KEYS:
        v = record[k]
        if k == "warmup" and "warmup" in spec_of(record["variant"]):
            continue  # the variant's own warm-up, not a preset setting
        if k in base and base[k] == v or (k not in base and make_cfg()[k] == v):
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            argv.append(flag if v else "--no-" + k.replace("_", "-"))
        elif v is None:
            continue
        else:
            argv += [flag, *map(str, v)] if isinstance(v, list) else [flag, str(v)]
    return argv
