"""The study's plots: validation loss against steps and bytes, the bytes / gap frontier, and the gap
against the per-worker batch and width."""
from __future__ import annotations

import os

from .stats import GOAL_GAP_PCT


def plot(records, out):
    from ..common import pyplot

    plt = pyplot()
    files = []
    curves = [r for r in records if r.get("bench") == "converge_curve"]
    summary = [r for r in records if r.get("bench") == "converge_summary"]
    for n in sorted({r["world_size"] for r in curves}):
        rs = [r for r in curves if r["world_size"] == n]
        seeds = sorted({r["seed"] for r in rs})
        variants = list(dict.fromkeys(r["variant"] for r in rs))
        for xkey, fname, xlabel in (("step", f"converge_steps_n{n}.png", "step"),
                                    ("bytes_per_rank", f"converge_bytes_n{n}.png", "MB sent per rank (cumulative)")):
            fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
            for vi, v in enumerate(variants):
                pts = {}
                for r in rs:
                    if r["variant"] == v:
                        pts.setdefault(r["step"], []).append(r)
                steps = sorted(pts)
                xs = [sum(q[xkey] for q in pts[s]) / len(pts[s]) for s in steps]
                ys = [sum(q["val_loss"] for q in pts[s]) / len(pts[s]) for s in steps]
                if xkey == "bytes_per_rank":
                    keep = [(x / 2**20, y) for x, y in zip(xs, ys) if x > 0]
                    xs, ys = [k[0] for k in keep], [k[1] for k in keep]
                ax.plot(xs, ys, marker="o", markersize=2.5, linewidth=1.2, label=v, color=plt.cm.tab20(vi % 20),
                        linestyle="-" if vi < 20 else "--")
            if xkey == "bytes_per_rank":
                ax.set_xscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"val loss (nats/byte), mean of {len(seeds)} seeds")
            ax.set_title(f"N={n} simulated workers: validation loss vs {xkey.split('_')[0]}", fontsize=10)
            ax.grid(True, alpha=0.3, which="both")
            ax.legend(fontsize=7)
            fig.tight_layout()
            path = os.path.join(out, fname)
            fig.savefig(path)
            plt.close(fig)
            files.append(path)
    for n in sorted({r["world_size"] for r in summary}):
        rows = [s for s in summary if s["world_size"] == n and s["variant"] != "lion"]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
        for s in rows:
            ax.errorbar(s["bytes_ratio_vs_fp32"], s["gap_pct"], yerr=s["ci95_pct"] if s["ci95_pct"] == s["ci95_pct"]
                        else None, fmt="o", capsize=3)
            ax.annotate(s["variant"], (s["bytes_ratio_vs_fp32"], s["gap_pct"]), fontsize=7, xytext=(4, 2),
                        textcoords="offset points")
        ax.axhline(GOAL_GAP_PCT, color="green", linestyle=":", linewidth=1)
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.axvline(16.0, color="green", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("x fewer bytes than an fp32 ring all-reduce (momentum sync counted)")
        ax.set_ylabel("paired gap to global Lion, % (mean ± 95% CI)")
        ax.set_title(f"N={n}: the bytes/gap frontier (goal: right of 16x, below 2%)", fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
        fig.tight_layout()
        path = os.path.join(out, f"converge_frontier_n{n}.png")
        fig.savefig(path)
        plt.close(fig)
        files.append(path)
    return files


def plot_trend(records, out):
    """Gap to global Lion (mean, 95% CI) against the model's size (a width study) or the per-worker
    batch (:func:`trend_axis`), one line per variant (and width, against the batch)."""
    from ..common import pyplot
    from .stats import trend_axis

    plt = pyplot()
    rows = [r for r in records if r.get("bench") == "converge_trend" and r["variant"] != "lion"]
    key, label = trend_axis(rows)
    files = []
    for n in sorted({r["world_size"] for r in rows}):
        fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
        mine = [r for r in rows if r["world_size"] == n]
        lines = sorted({(r["variant"], r["d_model"] if key == "batch_size" else None) for r in mine},
                       key=lambda t: (t[0], t[1] or 0))
        for i, (v, d) in enumerate(lines):
            pts = sorted((r[key], r["gap_pct"], r["ci95_pct"]) for r in mine
                         if r["variant"] == v and (d is None or r["d_model"] == d))
            xs = [p[0] * (1 + 0.03 * (i - len(lines) / 2)) for p in pts]  # a small offset: the bars do not overlap
            solid = d is None or d == min(x[1] for x in lines)
            ax.errorbar(xs, [p[1] for p in pts], yerr=[p[2] if p[2] == p[2] else 0 for p in pts], marker="o",
                        capsize=3, label=v if d is None else f"{v}, d_model {d}", linestyle="-" if solid else "--")
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.axhline(GOAL_GAP_PCT, color="green", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel("paired gap to global Lion, % (mean ± 95% CI)")
        against = "model size" if key == "params" else "batch and width"
        ax.set_title(f"N={n}: LionCub's gap to global Lion against {against}", fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out, f"converge_trend_n{n}.png")
        fig.savefig(path)
        plt.close(fig)
        files.append(path)
    return files
