"""``python -m benchmarks comm``: wire bytes per rank per optimizer step (docs/results.md).

For N gloo ranks and P parameters, every algorithm and vote rule runs real optimizer
steps; the bytes are those the telemetry counts inside the collectives (``comm_stats()``,
ring model: what one rank sends), shown next to an fp32 and a bf16 ring all-reduce of
the same gradients (2·(N−1)/N·bytes) and next to the closed-form formula of docs/conventions.md.
Bytes are counted, not timed, so the gradients are random and there is no model compute.

``--zeros``: the case of exact zeros in runs (docs/conventions.md, "Abstentions"): an
Embedding(256, 64) + Linear(64, 256) trained on batches that use 40% of the rows, per comm the
bytes per step against the same model with every row used (the dense floor), on 4 ranks
(``python -m benchmarks comm --zeros --json docs/comm_zeros.json``).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from lioncub_ds.telemetry import format_bytes
from .common import add_output_args, finish, line_plot, print_table, run_ranks

NAME = "comm"

# (label, LionCub kwargs). tie_break defaults to "hash" (phase 2 of 1bit: one plane).
CONFIGS = [
    ("allgather/majority", dict(comm="allgather", vote="majority")),
    ("allgather/average", dict(comm="allgather", vote="average")),
    ("1bit/majority", dict(comm="1bit", vote="majority")),
    ("1bit/majority/tie=zero", dict(comm="1bit", vote="majority", tie_break="zero")),
    ("1bit/average", dict(comm="1bit", vote="average")),
    ("pbit/majority", dict(comm="pbit", vote="majority")),
    ("pbit/average", dict(comm="pbit", vote="average")),
    ("int8/majority (l1)", dict(comm="int8", vote="majority", quant="l1")),
]


def lane_bits(n: int) -> int:
    for p in (1, 2, 4, 8):
        if (1 << p) - 1 >= n:
            return p
    raise ValueError(n)


def spec_formula(kw: dict, n: int, p: int) -> tuple[float, str]:
    """Closed form (docs/conventions.md) (no padding, no control message): bytes one rank sends per step."""
    comm, vote, tie = kw["comm"], kw.get("vote", "majority"), kw.get("tie_break", "hash")
    if comm == "allgather":
        return (n - 1) * p / 8, "(N-1)·P/8"
    if comm == "1bit":
        phase1 = (n - 1) / n * p / 8
        if vote == "average":
            lanes = lane_bits(n)
            return phase1 + (n - 1) / n * lanes * p / 8, f"(N-1)/N·P/8·(1+{lanes})"
        planes = 2 if (tie == "zero" and n % 2 == 0) else 1
        return phase1 + planes * (n - 1) / n * p / 8, "2·(N-1)/N·P/8" if planes == 1 else "3·(N-1)/N·P/8"
    if comm == "pbit":
        lanes = lane_bits(n)
        return 2 * (n - 1) / n * lanes * p / 8, f"2·(N-1)/N·{lanes}·P/8"
    if comm == "int8":
        return 2 * (n - 1) / n * p, "2·(N-1)/N·P"
    raise ValueError(comm)


def _params(numel: int, chunk: int):
    """Parameters of the given total size, in tensors of at most ``chunk`` elements (odd sizes)."""
    sizes, left = [], numel
    while left > 0:
        s = min(chunk, left)
        sizes.append(s)
        left -= s
    return [torch.nn.Parameter(torch.zeros(s)) for s in sizes]


def _rank_fn(rank, n, numel, steps, chunk, configs):
    from lioncub_ds import LionCub

    gen = torch.Generator().manual_seed(1000 + rank)
    params = _params(numel, chunk)
    for p in params:
        p.data.normal_(0.0, 0.02, generator=gen)
    out = []
    for label, kw in configs:
        if kw["comm"] == "int8" and n > 127:
            continue
        t0 = time.perf_counter()
        opt = LionCub(params, lr=1e-4, **kw)
        for _ in range(steps):
            for p in params:
                # A fresh random gradient each step. randn returns an exact 0.0 about once in 2**24
                # draws; an exact zero in c makes that rank abstain there, which adds an entry to
                # the bucket's abstention list (docs/conventions.md, "Abstentions"). Replace them,
                # so every step sends exactly the formula's bytes (docs/results.md).
                g = torch.randn(p.shape, generator=gen)
                p.grad = g.masked_fill_(g == 0, 1e-3)
            opt.step()
        st = opt.comm_stats()
        last = st["last_step"]
        plan = opt.comm_plan()
        out.append({"label": label, "kw": kw, "bytes": last["bytes_sent"], "by_collective": last["by_collective"],
                    "by_algorithm": last["by_algorithm"], "fp32": last["fp32_allreduce_bytes"],
                    "bf16": last["bf16_allreduce_bytes"], "plan_bytes": sum(b["wire_bytes"] for b in plan),
                    "buckets": len(plan), "algorithms": sorted({b["algorithm"] for b in plan}),
                    "seconds": time.perf_counter() - t0})
        for p in params:
            p.grad = None
        del opt
    return out


def run(world_sizes=(2, 4, 8), numel=25_000_000, steps=1, chunk=4_000_000, configs=None, verbose=True):
    configs = CONFIGS if configs is None else configs
    records = []
    for n in world_sizes:
        t0 = time.perf_counter()
        res = run_ranks(_rank_fn, n, numel, steps, chunk, configs)
        for i, r0 in enumerate(res[0]):
            same = all(r[i]["bytes"] == r0["bytes"] for r in res)
            kw = r0["kw"]
            formula, ftext = spec_formula(kw, n, numel)
            rec = {"bench": NAME, "algorithm": kw["comm"], "vote": kw.get("vote", "majority"), "world_size": n,
                   "numel": numel, "bytes_per_rank": int(r0["bytes"]),
                   "fp32_allreduce_bytes": int(r0["fp32"]), "bf16_allreduce_bytes": int(r0["bf16"]),
                   "ratio_vs_fp32": r0["fp32"] / r0["bytes"], "ratio_vs_bf16": r0["bf16"] / r0["bytes"],
                   "tie_break": kw.get("tie_break", "hash"), "quant": kw.get("quant", "sign"),
                   "label": r0["label"], "spec_formula": ftext, "spec_formula_bytes": round(formula),
                   "algorithm_wire_bytes": int(r0["plan_bytes"]),
                   "control_bytes": int(r0["by_algorithm"].get("control", 0)),
                   "by_collective": ";".join(f"{k}={v}" for k, v in sorted(r0["by_collective"].items())),
                   "buckets": r0["buckets"], "same_on_all_ranks": same, "steps": steps}
            records.append(rec)
        if verbose:
            print(f"[bench comm] N={n}: {len(res[0])} configs in {time.perf_counter() - t0:.1f} s", flush=True)
    return records


TABLE = [("world_size", "N"), ("label", "algorithm/vote"), ("bytes_per_rank", "bytes/rank/step"),
         ("spec_formula_bytes", "closed form"), ("spec_formula", "formula"),
         ("fp32_allreduce_bytes", "fp32 AR"), ("bf16_allreduce_bytes", "bf16 AR"),
         ("ratio_vs_fp32", "x vs fp32", ".1f"), ("ratio_vs_bf16", "x vs bf16", ".1f")]


def check_goal(records) -> list[str]:
    """The issue's goal: 1bit (default tie rule, majority) ≥30x below fp32 at every N."""
    msgs = []
    for r in records:
        if r["algorithm"] == "1bit" and r["vote"] == "majority" and r["tie_break"] == "hash":
            ok = r["ratio_vs_fp32"] >= 30
            msgs.append(f"N={r['world_size']}: 1bit is {r['ratio_vs_fp32']:.1f}x below fp32 all-reduce "
                        f"({'OK' if ok else 'MISSED'}: goal >= 30x)")
    return msgs


def plot(records, out):
    import os

    files = []
    series = {}
    for r in records:
        series.setdefault(r["label"], ([], []))
        series[r["label"]][0].append(r["world_size"])
        series[r["label"]][1].append(r["ratio_vs_fp32"])
    files.append(line_plot(os.path.join(out, "comm_ratio.png"), series, xlabel="ranks N",
                           ylabel="fp32 all-reduce bytes / algorithm bytes", logx=True, logy=True,
                           title=f"Wire bytes per rank per step, P={records[0]['numel'] / 1e6:.1f}M: "
                                 "compression vs fp32 ring all-reduce"))
    return files


# ----------------------------------------------------------------------------- exact zeros in runs
# (issue 46 item 6) An untied Embedding whose rows a batch never touches has c = 0 exactly on
# those rows: those coordinates abstain (docs/conventions.md, "Abstentions"). The case measures
# the bytes per step of such a model against the same model with every row used (the dense
# floor: nothing abstains), on real gloo ranks.
ZERO_CONFIGS = [("1bit", dict(comm="1bit")), ("bbit", dict(comm="bbit", quant="l1")),
                ("allgather", dict(comm="allgather")), ("pbit", dict(comm="pbit"))]
ZERO_GOAL = 1.1  # bytes per step with unused rows <= 1.1x the dense floor (issue 46)


def _zeros_rank(rank, n, vocab, dim, used, batch, seq, steps, configs):
    import torch.nn.functional as F

    from lioncub_ds import LionCub

    # the tokens batches are drawn from: the same fixed share of the vocabulary on every rank, so
    # the other rows are never used (a padded vocabulary, tokens not in the data yet)
    pool = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:round(used * vocab)]
    out = []
    for label, kw in configs:
        for case in ("unused rows", "every row used"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab))
            opt = LionCub(model.parameters(), lr=1e-3, **kw)
            gen = torch.Generator().manual_seed(1000 + rank)
            sent, modes = [], []
            for _ in range(steps):
                if case == "unused rows":
                    x = pool[torch.randint(len(pool), (batch, seq + 1), generator=gen)]
                else:  # every token occurs among every rank's inputs
                    x = torch.randint(vocab, (batch, seq + 1), generator=gen)
                    inputs = x[:, :seq].reshape(-1)
                    inputs[:vocab] = torch.randperm(vocab, generator=gen)
                    x[:, :seq] = inputs.view(batch, seq)
                loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, vocab), x[:, 1:].reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                modes.append(opt.plan.buckets[0].mode if opt.plan is not None else "list")
                opt.step()
                sent.append(int(opt.comm_stats()["last_step"]["bytes_sent"]))
            last = opt.comm_stats()["last_step"]
            out.append({"label": label, "case": case, "sent": sent, "modes": modes,
                        "params": sum(p.numel() for p in model.parameters()),
                        "numel": opt.plan.buckets[0].numel, "buckets": len(opt.plan.buckets),
                        "control": int(last["by_algorithm"].get("control", 0)),
                        "fp32": int(last["fp32_allreduce_bytes"])})
    return out


def run_zeros(world_size=4, vocab=256, dim=64, used=0.4, batch=4, seq=64, steps=6, configs=None, verbose=True):
    """The embedding case: per comm, bytes per step with ``1 - used`` of the rows never used,
    against the same model with every row used in every batch (the dense floor)."""
    from lioncub_ds.comm import make_algorithm

    configs = ZERO_CONFIGS if configs is None else configs
    if batch * seq < vocab:
        raise ValueError("the dense case needs batch * seq >= vocab input tokens per batch (every row used)")
    t0 = time.perf_counter()
    res = run_ranks(_zeros_rank, world_size, vocab, dim, used, batch, seq, steps, configs)
    records = []
    for i in range(0, len(res[0]), 2):
        zero, dense = res[0][i], res[0][i + 1]
        algo = make_algorithm(zero["label"], quant="l1")
        # what the same step sent before the chunk code: the plane after an overflowed list
        plane = algo.wire_bytes(zero["numel"], world_size, mode="plane", abstain=True) + zero["control"]
        steady = zero["sent"][-1]
        records.append({
            "bench": NAME, "case": "embedding_unused_rows", "algorithm": zero["label"], "world_size": world_size,
            "model": f"Embedding({vocab}, {dim}) + Linear({dim}, {vocab})", "params": zero["params"],
            "rows_used": used, "tokens_per_rank_batch": batch * seq, "steps": steps,
            "bytes_per_step": steady, "dense_floor_bytes": dense["sent"][-1],
            "ratio_vs_dense_floor": steady / dense["sent"][-1],
            "mean_bytes_per_step": sum(zero["sent"]) / steps, "bytes_each_step": zero["sent"],
            "modes": zero["modes"], "dense_modes": dense["modes"], "plane_mode_bytes": plane,
            "fp32_allreduce_bytes": zero["fp32"], "ratio_vs_fp32": zero["fp32"] / steady,
            "goal": f"<= {ZERO_GOAL}x the dense floor",
            "same_on_all_ranks": all(r[i]["sent"] == zero["sent"] and r[i + 1]["sent"] == dense["sent"]
                                     for r in res)})
    if verbose:
        print(f"[bench comm --zeros] N={world_size}: {len(records)} configs in {time.perf_counter() - t0:.1f} s",
              flush=True)
    return records


ZERO_TABLE = [("algorithm", "comm"), ("bytes_per_step", "bytes/step"), ("dense_floor_bytes", "dense floor"),
              ("ratio_vs_dense_floor", "x floor", ".3f"), ("plane_mode_bytes", "plane mode"),
              ("fp32_allreduce_bytes", "fp32 AR"), ("ratio_vs_fp32", "x vs fp32", ".1f"),
              ("mean_bytes_per_step", "mean (with step 1)", ".0f")]


def check_zeros(records) -> list[str]:
    msgs = []
    for r in records:
        if r["algorithm"] == "1bit":
            ok = r["ratio_vs_dense_floor"] <= ZERO_GOAL
            msgs.append(f"1bit with {100 - round(100 * r['rows_used'])}% of the embedding rows unused: "
                        f"{r['bytes_per_step']} bytes per step, {r['ratio_vs_dense_floor']:.3f}x the dense floor "
                        f"({r['dense_floor_bytes']}) ({'OK' if ok else 'MISSED'}: goal <= {ZERO_GOAL}x)")
    return msgs


def build_parser():
    p = argparse.ArgumentParser(prog="python -m benchmarks comm", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=None, help="default 2 4 8 (with --zeros: 4)")
    p.add_argument("--numel", type=int, default=25_000_000, help="parameters (split into tensors of <= --chunk)")
    p.add_argument("--chunk", type=int, default=4_000_000)
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps per config (the last one is reported; default 1, with --zeros 6)")
    p.add_argument("--zeros", action="store_true",
                   help="the embedding case instead: Embedding(256, 64) + Linear(64, 256), batches that use 40%% "
                        "of the rows, bytes per step against the same model with every row used (at the first "
                        "of --world-sizes, default 4)")
    add_output_args(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    if args.zeros:
        n = args.world_sizes[0] if args.world_sizes else 4
        records = run_zeros(n, steps=args.steps or 6)
        r0 = records[0]
        print_table(records, ZERO_TABLE, title=f"[bench comm --zeros] bytes each rank sends per step, N={n}, "
                                               f"{r0['model']} ({r0['params']:,} parameters), "
                                               f"{round(100 * r0['rows_used'])}% of the rows used")
        for m in check_zeros(records):
            print("[bench comm --zeros] " + m)
        finish(NAME, args, records)
        print(f"[bench comm --zeros] done in {time.perf_counter() - t0:.1f} s")
        return 0 if all(r["same_on_all_ranks"] for r in records) else 1
    args.steps, args.world_sizes = args.steps or 1, args.world_sizes or [2, 4, 8]
    records = run(args.world_sizes, args.numel, args.steps, args.chunk)
    print_table(records, TABLE, title=f"[bench comm] bytes each rank sends per optimizer step, P={args.numel:,} "
                                      f"({format_bytes(4 * args.numel)} fp32)")
    for m in check_goal(records):
        print("[bench comm] " + m)
    bad = [r for r in records if not r["same_on_all_ranks"]]
    if bad:
        print(f"[bench comm] WARNING: ranks disagree on bytes for {len(bad)} configs", file=sys.stderr)
    finish(NAME, args, records, plot)
    print(f"[bench comm] done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
