"""The tables of a ``bench converge`` study, from its merged JSON: what docs/convergence.md quotes.

A study's merged JSON (``bench converge --merge ... --json X``) holds every run; this module turns it
into the per-seed tables of docs/convergence.md (final validation loss per seed, paired gap to global
Lion with its 95% interval, bytes saved), the frontier per N (worst seed, and a post-hoc interval
without named seeds, shown beside the result, never as it) and the slow starts (runs still above a
validation loss at an early step, from the curve records). No training; nothing here is hand-typed
into the docs: ``--doc`` rewrites the block between ``<!-- MARKER -->`` and ``<!-- /MARKER -->``,
``--check`` fails when that block is not what the JSON gives (tests/test_converge_report.py).

    python -m benchmarks.converge_report docs/lion_w300/converge.json --doc docs/convergence.md --marker w300-tables
    python -m benchmarks.converge_report docs/lion_w300/converge.json --drop-seed 8:6 --slow-step 150 --slow-above 2.45

A size study's trend JSON (``bench converge --trend ... --json X``) gives the short table of the gap
against model size instead (``--width``: a row per width, a column per variant):

    python -m benchmarks.converge_report docs/lion_w300_width/converge.json --width --doc docs/convergence.md --marker w300-width
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .converge import merge, paired_gaps, summarize, t_interval

# Row order of the per-seed tables: the controls, then the recommendation and its neighbours, then the
# variants that send more or less (issue 34's list); any other variant follows by name.
ROW_ORDER = ("lion", "adamw", "cub_1bit_sync20_int8", "cub_1bit_sync10_int8", "cub_1bit_sync20_int8_node2",
             "cub_1bit_sync20_int8_node4", "cub_1bit", "cub_b3", "cub_int8")


def load(path) -> list[dict]:
    """The run and curve records of a merged JSON or a JSONL file (read as ``converge --merge`` reads it)."""
    _, runs, _, curves = merge([str(path)])
    return runs + curves


def runs_of(records) -> list[dict]:
    return [r for r in records if r.get("bench") == "converge"]


def fmt_lr(x: float) -> str:
    """0.004 -> '4e-3', 0.011 -> '1.1e-2' (how the docs write lrs)."""
    mant, exp = f"{x:.1e}".split("e")
    return f"{mant.rstrip('0').rstrip('.')}e{int(exp)}"


def _order(order):
    order = tuple(order)
    return lambda v: (order.index(v), "") if v in order else (len(order), v)


def gap_text(s: dict, seeds_word: str = " seeds") -> str:
    """A summary row's paired gap as the tables write it: "+1.17% [+0.81, +1.53] (10 seeds)", or
    "+2.48% (1 seed)" where one seed gives no interval (``seeds_word=""``: "(10)")."""
    if len(s["seeds"]) < 2:
        return f"{s['gap_pct']:+.2f}% (1 seed)"
    return f"{s['gap_pct']:+.2f}% [{s['ci_lo_pct']:+.2f}, {s['ci_hi_pct']:+.2f}] ({len(s['seeds'])}{seeds_word})"


def seed_table(records, n: int, order=ROW_ORDER) -> str:
    """One N's markdown table: a row per variant, a column per seed (final val loss), the paired gap
    to global Lion over the seeds both have, and x fewer bytes than an fp32 all-reduce (node voters:
    the inter-node link's). Rows in ``order``, then any other variant by name; a seed a variant has
    not run is '–'."""
    runs = [r for r in runs_of(records) if r["world_size"] == n]
    if not runs:
        raise ValueError(f"no runs at N = {n} (N with runs: {sorted({r['world_size'] for r in runs_of(records)})})")
    seeds = sorted({r["seed"] for r in runs})
    summary = {s["variant"]: s for s in summarize(runs)}
    head = [f"N = {n}", *map(str, seeds), "paired gap to global Lion [95% CI]", "x fewer bytes"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for v in sorted({r["variant"] for r in runs}, key=_order(order)):
        mine = {r["seed"]: r for r in runs if r["variant"] == v}
        r0 = mine[min(mine)]
        s = summary.get(v)
        if v == "lion":
            gap = "—"
        elif s is None:
            gap = "no paired seed"
        else:
            gap = gap_text(s)
        cells = [f"`{v}`, lr {fmt_lr(r0['lr'])}", *(f"{mine[k]['val_loss']:.3f}" if k in mine else "–" for k in seeds),
                 gap, f"{r0['bytes_ratio_vs_fp32']:.1f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def seed_tables(records, order=ROW_ORDER) -> str:
    """Every N's table, smallest N first, a blank line between them."""
    return "\n".join(seed_table(records, n, order) for n in sorted({r["world_size"] for r in runs_of(records)}))


def frontier(records, n: int, drop_seeds=()) -> list[dict]:
    """Per variant other than global Lion at N: its :func:`summarize` row (x fewer bytes, the paired
    gap [95% CI]) with the worst seed, and (when ``drop_seeds`` is given) the same interval without
    those seeds: post hoc, for beside."""
    runs = [r for r in runs_of(records) if r["world_size"] == n]
    order = _order(ROW_ORDER)
    out = []
    for row in sorted((s for s in summarize(runs) if s["variant"] != "lion"), key=lambda s: order(s["variant"])):
        gaps = paired_gaps(runs, row["variant"])
        row["worst_seed"] = max(gaps, key=gaps.get)
        row["worst_gap_pct"] = gaps[row["worst_seed"]]
        kept = [g for s, g in gaps.items() if s not in drop_seeds]
        if drop_seeds and len(kept) >= 2:
            m, h, _ = t_interval(kept)
            row.update(post_hoc_gap_pct=m, post_hoc_lo_pct=m - h, post_hoc_hi_pct=m + h, post_hoc_seeds=len(kept))
        out.append(row)
    return out


def slow_starts(records, step: int, above: float) -> list[dict]:
    """The runs whose validation loss at ``step`` (a curve record) is above ``above``, and every
    run's value there: [{world_size, variant, seed, val_loss_at_step, final val_loss, slow}]."""
    final = {(r["world_size"], r["variant"], r["seed"]): r["val_loss"] for r in runs_of(records)}
    at = {(c["world_size"], c["variant"], c["seed"]): c["val_loss"] for c in records
          if c.get("bench") == "converge_curve" and c["step"] == step}
    missing = sorted(k for k in final if k not in at)
    if missing:
        raise ValueError(f"no curve record at step {step} for {len(missing)} runs, e.g. {missing[0]}: "
                         f"pick a step the study evaluated (its eval_every)")
    return [{"world_size": k[0], "variant": k[1], "seed": k[2], "val_loss_at_step": at[k], "val_loss": final[k],
             "slow": at[k] > above} for k in sorted(final)]


def width_columns(n: int) -> dict:
    """The size study's columns at N = ``n`` (issue 45's list): the recommendation, node voters of 2
    ranks, and AdamW, as {variant: header}."""
    return {"cub_1bit_sync20_int8": "recommendation", "cub_1bit_sync20_int8_node2": f"node voters {n // 2} × 2 + sync",
            "adamw": "AdamW"}


def width_table(trend_rows, n: int = 16, columns=None) -> str:
    """The gap against model size at N = ``n``: a row per width (parameters, global Lion's lr), a
    column per variant ({variant: header}; default :func:`width_columns`) with its paired gap to global
    Lion [95% CI] and seed count (the trend rows of ``bench converge --trend``; a variant a width has
    not run is '–')."""
    columns = width_columns(n) if columns is None else columns
    rows = [r for r in trend_rows if r.get("bench") == "converge_trend" and r["world_size"] == n]
    if not rows:
        raise ValueError(f"no converge_trend rows at N = {n}")
    widths = sorted({r["d_model"] for r in rows})
    head = ["width (d_model)", "parameters", "global Lion's lr", *columns.values()]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for d in widths:
        mine = {r["variant"]: r for r in rows if r["d_model"] == d}
        r0 = next(iter(mine.values()))
        cells = [str(d), f"{r0['params']:,}" if r0.get("params") else "–",
                 fmt_lr(r0["lion_lr"]) if r0.get("lion_lr") else "–"]
        for v in columns:
            s = mine.get(v)
            cells.append("–" if s is None else gap_text(s, seeds_word=""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def replace_block(doc: str, marker: str, body: str) -> str:
    """``doc`` with the text between ``<!-- marker -->`` and ``<!-- /marker -->`` replaced by ``body``."""
    start, end = f"<!-- {marker} -->\n", f"<!-- /{marker} -->"
    i, j = doc.find(start), doc.find(end)
    if i < 0 or j < 0 or j < i:
        raise ValueError(f"--marker {marker!r}: the doc needs the lines '<!-- {marker} -->' and '<!-- /{marker} -->' "
                         "around the block, in that order")
    return doc[:i + len(start)] + body + doc[j:]


def write_block(args, body: str) -> int:
    """``body`` into ``--doc``'s ``--marker`` block (``--check``: compare only; 1 if it differs), or printed."""
    if not args.doc:
        print(body)
        return 0
    old = Path(args.doc).read_text()
    new = replace_block(old, args.marker, body)
    width = " --width" if args.width else ""
    if args.check:
        if new != old:
            print(f"{args.doc}: the {args.marker} block is not what {args.json} gives; regenerate with "
                  f"python -m benchmarks.converge_report {args.json}{width} --doc {args.doc} --marker {args.marker}")
            return 1
        print(f"{args.doc}: the {args.marker} block matches {args.json}")
    elif new != old:
        Path(args.doc).write_text(new)
        print(f"{args.doc}: rewrote the {args.marker} block")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.converge_report", description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="a study's merged JSON (bench converge --merge ... --json) or a JSONL of runs")
    p.add_argument("--doc", help="a markdown file whose block between the --marker lines gets the per-seed tables")
    p.add_argument("--marker", default=None,
                   help="the block's name (default w300-tables; with --width, w300-width)")
    p.add_argument("--order", nargs="+", default=list(ROW_ORDER), metavar="VARIANT",
                   help="the tables' row order (default: global Lion, AdamW, then issue 34's list); others follow")
    p.add_argument("--check", action="store_true", help="with --doc: write nothing; exit 1 if the block differs")
    p.add_argument("--drop-seed", nargs="*", default=[], metavar="N:SEED",
                   help="the frontier's post-hoc column: the interval without these seeds at that N")
    p.add_argument("--slow-step", type=int, default=None, help="count slow starts: val loss at this step ...")
    p.add_argument("--slow-above", type=float, default=2.45, help="... above this (nats/byte; default 2.45)")
    p.add_argument("--width", action="store_true",
                   help="the JSON is a size study's trend (bench converge --trend --json): the short table of the gap "
                        "against model size (a row per width), into --doc's --marker block or printed")
    args = p.parse_args(argv)
    if args.marker is None:
        args.marker = "w300-width" if args.width else "w300-tables"
    if args.width:
        if args.drop_seed or args.slow_step is not None:
            p.error("--drop-seed and --slow-step read a study's runs; --width reads a trend JSON: not both")
        try:
            table = width_table(json.loads(Path(args.json).read_text()))
        except (ValueError, TypeError, AttributeError) as exc:  # (JSONDecodeError is a ValueError)
            p.error(f"{args.json}: {exc} (make it with bench converge --trend ... --json)")
        return write_block(args, table)
    drop = {}
    for item in args.drop_seed:
        n, _, s = item.partition(":")
        if not (n.isdigit() and s.isdigit()):
            p.error(f"--drop-seed {item!r}: expected N:SEED, e.g. 8:6")
        drop.setdefault(int(n), set()).add(int(s))
    records = load(args.json)
    if not runs_of(records):
        p.error(f"{args.json}: no converge run records in it")
    if write_block(args, seed_tables(records, args.order)):
        return 1
    for n in sorted({r["world_size"] for r in runs_of(records)}):
        print(f"\nN = {n}: frontier (paired gap to global Lion)" + (f"; post hoc without seeds {sorted(drop[n])}"
                                                                    if n in drop else ""))
        for f in frontier(records, n, drop.get(n, ())):
            line = (f"  {f['variant']:<30} {f['bytes_ratio_vs_fp32']:6.1f}x  {f['gap_pct']:+.2f}% "
                    f"[{f['ci_lo_pct']:+.2f}, {f['ci_hi_pct']:+.2f}] ({len(f['seeds'])} seeds)  worst seed "
                    f"{f['worst_seed']}: {f['worst_gap_pct']:+.1f}%")
            if "post_hoc_gap_pct" in f:
                line += (f"  | post hoc {f['post_hoc_gap_pct']:+.2f}% [{f['post_hoc_lo_pct']:+.2f}, "
                         f"{f['post_hoc_hi_pct']:+.2f}] ({f['post_hoc_seeds']} seeds)")
            print(line)
    if args.slow_step is not None:
        rows = slow_starts(records, args.slow_step, args.slow_above)
        slow = [r for r in rows if r["slow"]]
        rest = [r["val_loss_at_step"] for r in rows if not r["slow"]]
        print(f"\nslow starts (val loss at step {args.slow_step} > {args.slow_above}): {len(slow)} of {len(rows)} runs"
              + (f"; the others at most {max(rest):.3f} there" if rest else ""))
        for fam in ("lion", "adamw"):
            mine = [r for r in rows if r["variant"] == fam]
            print(f"  {fam}: {sum(r['slow'] for r in mine)} of {len(mine)}")
        cub = [r for r in rows if r["variant"] not in ("lion", "adamw")]
        print(f"  Lion Cub: {sum(r['slow'] for r in cub)} of {len(cub)}")
        for r in slow:
            print(f"    N = {r['world_size']} {r['variant']} seed {r['seed']}: {r['val_loss_at_step']:.3f} at step "
                  f"{args.slow_step}, final {r['val_loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
