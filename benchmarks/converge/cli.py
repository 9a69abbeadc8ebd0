"""``python -m benchmarks converge``: does Lion Cub train as well as Lion? (docs/results.md)

The command line: a study, ``--tune``, ``--merge``, ``--trend``, ``--grads-speed`` (the protocol: the
package's docstring)."""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ..common import add_output_args, finish, print_table
from .grads import GRADS
from .plots import plot, plot_trend
from .records import NAME, append_jsonl, merge
from .stats import SUMMARY_TABLE, check_goal, markdown_table, summarize, trend, trend_table
from .study import _load, run, tune
from .training import grads_speed
from .variants import (BASE_SETTINGS, DEFAULT_LR, DEFAULT_LR_GRID, FAMILIES, PRESET_KEYS, PROTOCOLS, VARIANTS,
                       make_cfg, spec_of)


def _parse_lr(items):
    out = {}
    for it in items or []:
        fam, _, val = it.partition("=")
        if fam not in FAMILIES or not val:
            raise SystemExit(f"--lr {it!r}: expected FAMILY=LR with FAMILY in {', '.join(FAMILIES)}")
        out[fam] = float(val)
    return out


def build_parser():
    p = argparse.ArgumentParser(prog="python -m benchmarks converge", description=__doc__.split("\n\n")[0])
    p.add_argument("--protocol", choices=sorted(PROTOCOLS), default=None,
                   help="a named study (steps, betas, N, seeds, lrs, variants; docs/convergence.md): short = 300 "
                        "steps, beta (0.8, 0.9); long = 1,200 steps, beta (0.95, 0.98), N = 8 and 16; long99 = "
                        "1,200 steps, beta (0.9, 0.99). Explicit flags override its values")
    p.add_argument("--tune-with", nargs="*", default=[], metavar="FAMILY=VARIANT",
                   help="with --tune: the variant whose run tunes FAMILY's lr (default: "
                        + ", ".join(f"{f}={v}" for f, v in FAMILIES.items()) + ")")
    p.add_argument("--variants", nargs="+", default=None,
                   help=f"any of {', '.join(VARIANTS)}; NAME:FAMILY runs a Lion Cub variant with FAMILY's lr "
                        "(e.g. cub_1bit:lion)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="paired seeds (default 0 1 2 3 4)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=None, help="simulated workers N (default 8)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 300)")
    p.add_argument("--preset", default=None, help="the GPT preset the shape flags override (default tiny)")
    p.add_argument("--n-layer", type=int, default=None, help="(default 2)")
    p.add_argument("--n-head", type=int, default=None, help="(default 2)")
    p.add_argument("--d-model", type=int, default=None, help="(default 64)")
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None,
                   help="biases in the Linear layers and LayerNorms (default: on)")
    p.add_argument("--tie-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="the output head is the token embedding (default: on)")
    p.add_argument("--seq-len", type=int, default=None, help="(default 64)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per worker per step (default 4)")
    p.add_argument("--warmup", type=int, default=None, help="linear warm-up steps (default 30)")
    p.add_argument("--min-lr-ratio", type=float, default=None,
                   help="cosine decay ends at this fraction of the peak lr (default 0.1)")
    p.add_argument("--betas", type=float, nargs=2, default=None, help="Lion-family (beta1, beta2) (default 0.9 0.99)")
    p.add_argument("--eval-every", type=int, default=None, help="(default 50)")
    p.add_argument("--eval-iters", type=int, default=None, help="fixed val batches per evaluation (default 8)")
    p.add_argument("--eval-batch", type=int, default=None, help="(default 32)")
    p.add_argument("--adamw-betas", type=float, nargs=2, default=None, help="(default 0.9 0.95)")
    p.add_argument("--adamw-wd", type=float, default=None, help="(default 0.1)")
    p.add_argument("--lion-wd", type=float, default=None,
                   help="Lion-family decoupled wd (default: adamw_wd * lr_adamw / lr_lion, the same lr*wd)")
    p.add_argument("--tie-break", default=None, help="(default hash)")
    p.add_argument("--data", default=None, choices=["deps", "stdlib"], help="(default deps: the pinned corpus)")
    p.add_argument("--grads", default=None, choices=GRADS,
                   help="how the N workers' gradients are computed (WorkerGrads): loop = one pass per worker, "
                        "bit-identical to real ranks; vmap = one vectorized pass (votes agree on >= 99.9%% of "
                        "coordinates); vmap_compiled = vmap through torch.compile (default: the protocol's, else loop)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default 1; fixed: part of what makes runs repeatable)")
    p.add_argument("--lr", nargs="*", default=[], metavar="FAMILY=LR",
                   help=f"fixed lr per family ({', '.join(FAMILIES)}); skips tuning that family")
    p.add_argument("--tune", action="store_true", help="sweep the lr of each family not fixed by --lr, per N")
    p.add_argument("--tune-seed", type=int, default=1000)
    p.add_argument("--tune-only", action="store_true", help="with --tune: report the sweep, train nothing else")
    p.add_argument("--lr-grid", default=json.dumps({k: list(v) for k, v in DEFAULT_LR_GRID.items()}),
                   help="JSON {family: [lr, ...]} for --tune")
    p.add_argument("--partial", default=None, metavar="JSONL",
                   help="append each finished run's records here as it completes (a stopped study keeps them; "
                        "--merge reads .jsonl)")
    p.add_argument("--grads-speed", action="store_true",
                   help="no training: time each --grads mode side by side (interleaved rounds) on the preset's model "
                        "and batches at each --world-sizes N, and report the speed-up over the exact loop")
    p.add_argument("--trend", nargs="+", default=None, metavar="JSON",
                   help="no training: the paired gap per preset from several studies' JSON / JSONL files (each at "
                        "one per-worker batch and width), as a table and a plot against the batch (--out)")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="no training: merge the records of earlier runs' JSON files (e.g. one per N or per variant "
                        "group, same settings; a run found in several files is taken from the first), then "
                        "summarize, plot and write --json/--out as usual; --variants / --world-sizes given "
                        "explicitly keep only those runs")
    add_output_args(p)
    return p


SETTING_FLAGS = ("steps", "preset", "n_layer", "n_head", "d_model", "bias", "tie_weights", "seq_len", "batch_size",
                 "warmup", "min_lr_ratio", "betas", "eval_every", "eval_iters", "eval_batch", "adamw_betas",
                 "adamw_wd", "lion_wd", "tie_break", "data", "grads", "threads")


def apply_protocol(args):
    """The run's settings: make_cfg's defaults, then ``--protocol``'s (or the base defaults), then the
    flags given explicitly. Sets ``args.settings`` (make_cfg's keywords), ``args.protocol_name``,
    N / seeds / variants, and ``args.base_lr`` (below --lr, which also stops --tune from sweeping
    that family)."""
    proto = PROTOCOLS[args.protocol] if args.protocol else BASE_SETTINGS
    for key in ("world_sizes", "seeds", "variants"):
        if getattr(args, key) is None:
            setattr(args, key, list(proto[key]))
    given = {k: getattr(args, k) for k in SETTING_FLAGS if getattr(args, k) is not None}
    args.settings = {**proto["settings"], **given}
    for k in ("betas", "adamw_betas"):
        if k in args.settings:
            args.settings[k] = list(args.settings[k])
    # a protocol with explicit changes to its preset is another preset: the records say which keys changed
    changed = sorted(k for k in given if k in PRESET_KEYS and proto["settings"].get(k) != args.settings[k])
    args.protocol_name = (args.protocol or "custom") + (f" (with {', '.join(changed)} changed)" if changed and args.protocol else "")
    args.base_lr = dict(proto["lr"])
    return args


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    explicit = {"variants": args.variants, "world_sizes": args.world_sizes}  # before the protocol fills them
    args = apply_protocol(args)
    t0 = time.perf_counter()
    if args.trend:
        records = []
        for path in args.trend:
            records += merge([path], **explicit)[1]
        rows = trend(records)
        print(trend_table(rows))
        finish(NAME, args, rows, plot_trend, extra_md=trend_table(rows))  # the runs stay in their own files
        return 0
    if args.merge:
        meta, records, tune_recs, curves = merge(args.merge, **explicit)
        summary = summarize(records)
        print_table(summary, SUMMARY_TABLE, title=f"[bench converge] merged {len(records)} runs from {len(args.merge)} "
                                                  "files: paired gap to global Lion")
        for m in check_goal(summary):
            print("[bench converge] " + m)
        finish(NAME, args, meta + summary + records + tune_recs + curves, plot,
               extra_md=markdown_table(summary) + "\n" + "\n".join("- " + m for m in check_goal(summary)) + "\n")
        return 0
    kw = dict(args.settings)
    if args.grads_speed:
        cfg = make_cfg(**kw)
        torch.set_num_threads(cfg["threads"])
        recs = [r for n in args.world_sizes for r in grads_speed(cfg, n, _load(cfg))]
        print_table(recs, [("world_size", "N"), ("mode", "grads"), ("s_per_step", "s / step", ".4f"),
                           ("first_call_s", "first call s", ".1f"), ("speedup_vs_loop", "speed-up vs loop", ".2f")],
                    title=f"[bench converge] the N workers' gradients, {cfg['batch_size']} sequences per worker")
        finish(NAME, args, recs)
        return 0
    cfg = make_cfg(**kw)
    torch.set_num_threads(cfg["threads"])
    ds = _load(cfg)
    fixed = _parse_lr(args.lr)
    tune_recs = []
    lrs = {n: {**DEFAULT_LR, **args.base_lr, **fixed} for n in args.world_sizes}
    if args.tune:
        grid = {f: v for f, v in json.loads(args.lr_grid).items() if f not in fixed}
        for v in args.variants:
            spec_of(v)  # fail early on a bad name
        fams_needed = {spec_of(v)["family"] for v in args.variants} | {"adamw"}
        grid = {f: v for f, v in grid.items() if f in fams_needed}
        with_ = {}
        for it in args.tune_with:
            fam, _, var = it.partition("=")
            if fam not in FAMILIES or spec_of(var)["family"] != fam:
                raise SystemExit(f"--tune-with {it!r}: expected FAMILY=VARIANT with a variant of that family")
            with_[fam] = var
        best, tune_recs = tune(args.world_sizes, cfg, grid, args.tune_seed, args.device, ds=ds,
                               base={**args.base_lr, **fixed}, tune_with=with_)
        for n in args.world_sizes:
            lrs[n].update(best[n])
        for n in args.world_sizes:
            print(f"[bench converge] tuned lr N={n}: " + ", ".join(f"{f}={v:.2e}" for f, v in lrs[n].items()),
                  flush=True)
        if args.tune_only:
            if args.partial:
                append_jsonl(args.partial, tune_recs)
            finish(NAME, args, tune_recs)
            return 0
    if args.partial:  # the settings the runs after it were made with (finished_runs reads them)
        append_jsonl(args.partial, [{"bench": "converge_config", "protocol": args.protocol_name,
                                     "argv": list(sys.argv[1:] if argv is None else argv), "corpus": ds.name,
                                     "device": args.device, "lrs": {str(n): v for n, v in lrs.items()}, **cfg},
                                    *tune_recs])
    records, curves, cfg = run(tuple(args.variants), tuple(args.seeds), tuple(args.world_sizes), lrs, args.device,
                               protocol=args.protocol_name,
                               ds=ds, partial=args.partial, **kw)
    summary = summarize(records)
    print_table(summary, SUMMARY_TABLE, title=f"[bench converge] {records[0]['params']:,}-param GPT on {ds.name}, "
                                              f"{cfg['steps']} steps, seeds {args.seeds}: paired gap to global Lion")
    for m in check_goal(summary):
        print("[bench converge] " + m)
    meta = {"bench": "converge_config", "protocol": args.protocol_name, "argv": list(sys.argv[1:] if argv is None else argv), "corpus": ds.name,
            "lrs": {str(n): v for n, v in lrs.items()}, "wall_s": round(time.perf_counter() - t0, 1), **cfg}
    finish(NAME, args, [meta] + summary + records + tune_recs + curves, plot,
           extra_md=markdown_table(summary) + "\n" + "\n".join("- " + m for m in check_goal(summary)) + "\n")
    print(f"[bench converge] done in {time.perf_counter() - t0:.1f} s")
    return 0
