"""``python -m lioncub_ds.bench converge``: validation loss vs steps and vs bytes (SPEC §6).

A small GPT trained on the bundled real text (CPython's standard-library source, byte
level) by N gloo ranks, each drawing from its own shard of the training split, with the
same seed, model init, data order, learning-rate schedule and number of steps for every
optimizer:

* ``adamw``: AdamW on all-reduced (averaged, fp32) gradients;
* ``lion``: global Lion on all-reduced gradients (the reference);
* ``dlion_allgather``: Distributed Lion, majority vote of all-gathered 1-bit votes, local
  momenta never synchronized;
* ``lioncub_{1bit,pbit,int8}``: Lion Cub (int8 = l1-scaled votes), each also with
  selective momentum synchronization (``..._sync``, policy ``--sync``);
* ``lioncub_1bit_tiezero`` (an even-N tie moves nothing; phase 2 carries 2 planes) and
  ``lioncub_1bit_avg`` (vote="average": Δ = mean of the votes), to show what the vote rule costs.

Bytes are what each rank sends over the whole run: LionCub's own telemetry (votes, the
control flags and momentum syncs), and 2·(N−1)/N·4·P per step for the all-reduced baselines.
Validation: the same fixed val batches (each rank its own val shard) at every evaluation.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from .common import add_output_args, finish, line_plot, print_table, run_ranks

NAME = "converge"
DEFAULT_SYNC = {"every": 50}
VARIANTS = ("adamw", "lion", "dlion_allgather", "lioncub_1bit", "lioncub_1bit_sync", "lioncub_pbit",
            "lioncub_pbit_sync", "lioncub_int8", "lioncub_int8_sync", "lioncub_1bit_tiezero", "lioncub_1bit_avg")
LIONCUB_KW = {"dlion_allgather": dict(comm="allgather"), "lioncub_1bit": dict(comm="1bit"),
              "lioncub_pbit": dict(comm="pbit"), "lioncub_int8": dict(comm="int8", quant="l1"),
              # optional extras (not in the default list): the even-N tie rule and the averaging vote
              "lioncub_1bit_tiezero": dict(comm="1bit", tie_break="zero"),
              "lioncub_1bit_avg": dict(comm="1bit", vote="average")}
EXTRA_VARIANTS = ("lioncub_1bit_tiezero_sync", "lioncub_1bit_avg_sync")


def _lr_at(step, steps, peak, warmup, min_ratio=0.1):
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, steps - warmup))
    lo = peak * min_ratio
    return lo + 0.5 * (peak - lo) * (1.0 + math.cos(math.pi * frac))


def _make_opt(variant, model, cfg):
    from lioncub_ds import Lion, LionCub

    if variant == "adamw":
        groups = model.optim_groups(cfg["adamw_wd"])
        for g in groups:
            g.pop("names", None)
        return torch.optim.AdamW(groups, lr=cfg["adamw_lr"], betas=(0.9, 0.95)), cfg["adamw_lr"], True
    groups = model.optim_groups(cfg["lion_wd"])
    if variant == "lion":
        for g in groups:
            g.pop("names", None)
        return Lion(groups, lr=cfg["lion_lr"], betas=tuple(cfg["betas"])), cfg["lion_lr"], True
    base = variant[:-5] if variant.endswith("_sync") else variant
    kw = dict(LIONCUB_KW[base])
    if variant.endswith("_sync"):
        kw["momentum_sync"] = cfg["sync"]
    return LionCub(groups, lr=cfg["lion_lr"], betas=tuple(cfg["betas"]), **kw), cfg["lion_lr"], False


@torch.no_grad()
def _evaluate(model, ds, cfg, rank, n):
    import torch.distributed as dist

    model.eval()
    tot = torch.zeros((), dtype=torch.float64)
    for i in range(cfg["eval_iters"]):
        x, y = ds.get_batch("val", cfg["batch_size"], cfg["seq_len"], rank, n, step=i, seed=12345)
        tot += model(x, y)[1].double()
    tot /= cfg["eval_iters"]
    dist.all_reduce(tot)
    model.train()
    return float(tot) / n


def _train_one(variant, seed, cfg, rank, n, ds):
    import torch.distributed as dist

    from lioncub_ds.models import build_model
    from lioncub_ds.telemetry import ring_bytes

    model = build_model(cfg["preset"], seed=seed, seq_len=cfg["seq_len"])
    params = [p for p in model.parameters() if p.requires_grad]
    nparams = sum(p.numel() for p in params)
    opt, peak, allreduce = _make_opt(variant, model, cfg)
    ar_bytes = ring_bytes("all_reduce", 4 * nparams, n)
    curve = [(0, _evaluate(model, ds, cfg, rank, n), 0)]
    sent = 0
    t0 = time.perf_counter()
    for step in range(cfg["steps"]):
        lr = _lr_at(step, cfg["steps"], peak, cfg["warmup"])
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = ds.get_batch("train", cfg["batch_size"], cfg["seq_len"], rank, n, step=step, seed=seed)
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        if allreduce:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat.div_(n)
            off = 0
            for p in params:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()
            sent += ar_bytes
        opt.step()
        if not allreduce:
            sent = opt.comm_stats()["cumulative"]["bytes_sent"]
        if (step + 1) % cfg["eval_every"] == 0 or step + 1 == cfg["steps"]:
            curve.append((step + 1, _evaluate(model, ds, cfg, rank, n), sent))
    wall = time.perf_counter() - t0
    digest = torch.stack([p.detach().double().sum() for p in params]).sum().item()
    return {"variant": variant, "seed": seed, "curve": curve, "bytes": sent, "params": nparams, "wall_s": wall,
            "fp32_allreduce_bytes_per_step": ar_bytes, "digest": digest}


def _rank_fn(rank, n, cfg):
    torch.manual_seed(0)
    from lioncub_ds.data import load_dataset

    ds = load_dataset()
    out = []
    for seed in cfg["seeds"]:
        for v in cfg["variants"]:
            out.append(_train_one(v, seed, cfg, rank, n, ds))
            if rank == 0 and cfg.get("verbose"):
                r = out[-1]
                print(f"[bench converge] seed {seed} {v:18s} val {r['curve'][0][1]:.3f} -> {r['curve'][-1][1]:.4f}"
                      f"  bytes/rank {r['bytes'] / 1e6:8.2f} MB  {r['wall_s']:.0f} s", flush=True)
    return out


def run(variants=VARIANTS, seeds=(0, 1), world_size=4, steps=600, preset="tiny", seq_len=64, batch_size=8,
        lion_lr=1e-3, adamw_lr=3e-3, lion_wd=0.5, adamw_wd=0.1, betas=(0.9, 0.99), warmup=20, eval_every=50,
        eval_iters=4, sync=None, verbose=True):
    from lioncub_ds.data import load_dataset

    load_dataset()  # build the corpus cache once, before the ranks race for it
    cfg = dict(variants=list(variants), seeds=list(seeds), steps=steps, preset=preset, seq_len=seq_len,
               batch_size=batch_size, lion_lr=lion_lr, adamw_lr=adamw_lr, lion_wd=lion_wd, adamw_wd=adamw_wd,
               betas=list(betas), warmup=warmup, eval_every=eval_every, eval_iters=eval_iters,
               sync=dict(sync or DEFAULT_SYNC), verbose=verbose)
    res = run_ranks(_rank_fn, world_size, cfg, timeout=6 * 3600)
    records, curves = [], []
    for i, r in enumerate(res[0]):
        in_sync = len({round(rr[i]["digest"], 9) for rr in res}) == 1
        records.append({"bench": NAME, "variant": r["variant"], "seed": r["seed"], "steps": steps,
                        "val_loss": r["curve"][-1][1], "bytes_per_rank": int(r["bytes"]),
                        "world_size": world_size, "params": r["params"], "preset": preset,
                        "tokens_per_rank_per_step": batch_size * seq_len, "first_val_loss": r["curve"][0][1],
                        "fp32_allreduce_bytes_per_step": r["fp32_allreduce_bytes_per_step"],
                        "bytes_vs_global_lion": None, "val_loss_vs_global_lion": None, "params_in_sync": in_sync,
                        "wall_s": r["wall_s"], "sync": json.dumps(cfg["sync"]) if r["variant"].endswith("_sync") else ""})
        for step, loss, sent in r["curve"]:
            curves.append({"bench": "converge_curve", "variant": r["variant"], "seed": r["seed"], "step": step,
                           "val_loss": loss, "bytes_per_rank": int(sent)})
    for rec in records:
        ref = next((x for x in records if x["variant"] == "lion" and x["seed"] == rec["seed"]), None)
        if ref is not None:
            rec["bytes_vs_global_lion"] = ref["bytes_per_rank"] / rec["bytes_per_rank"] if rec["bytes_per_rank"] else None
            rec["val_loss_vs_global_lion"] = rec["val_loss"] / ref["val_loss"]
    return records, curves, cfg


TABLE = [("seed", "seed"), ("variant", "variant"), ("val_loss", "final val loss", ".4f"),
         ("val_loss_vs_global_lion", "vs Lion", ".4f"), ("bytes_per_rank", "bytes/rank (run)"),
         ("bytes_vs_global_lion", "x fewer bytes than Lion", ".1f"), ("params_in_sync", "in sync")]


def check_goal(records) -> list[str]:
    out = []
    for seed in sorted({r["seed"] for r in records}):
        cubs = [r for r in records if r["seed"] == seed and r["variant"].startswith("lioncub")
                and r["bytes_vs_global_lion"] is not None and r["bytes_vs_global_lion"] >= 16]
        if not cubs:
            out.append(f"seed {seed}: no Lion Cub variant sent >= 16x fewer bytes than global Lion")
            continue
        best = min(cubs, key=lambda r: r["val_loss"])
        gap = (best["val_loss_vs_global_lion"] - 1) * 100
        out.append(f"seed {seed}: best Lion Cub with >= 16x fewer bytes: {best['variant']} val loss "
                   f"{best['val_loss']:.4f} ({gap:+.2f}% vs global Lion), {best['bytes_vs_global_lion']:.1f}x fewer "
                   f"bytes (goal within 2%: {'OK' if gap <= 2 else 'MISSED'})")
    seeds = sorted({r["seed"] for r in records})
    if len(seeds) > 1:
        mean = {}
        for v in dict.fromkeys(r["variant"] for r in records):
            rs = [r for r in records if r["variant"] == v]
            if len(rs) == len(seeds):
                mean[v] = (sum(r["val_loss"] for r in rs) / len(rs),
                           min(r["bytes_vs_global_lion"] or 0 for r in rs))
        if "lion" in mean:
            cubs = {v: m for v, m in mean.items() if v.startswith("lioncub") and m[1] >= 16}
            for v, (loss, fewer) in mean.items():
                out.append(f"mean over seeds {seeds}: {v:22s} val loss {loss:.4f} "
                           f"({(loss / mean['lion'][0] - 1) * 100:+6.2f}% vs global Lion), {fewer:.1f}x fewer bytes")
            if cubs:
                v, (loss, fewer) = min(cubs.items(), key=lambda kv: kv[1][0])
                gap = (loss / mean["lion"][0] - 1) * 100
                out.append(f"mean over seeds: best Lion Cub with >= 16x fewer bytes: {v} {gap:+.2f}% vs global Lion "
                           f"(goal within 2%: {'OK' if gap <= 2 else 'MISSED'})")
    return out


def plot(records, out):
    curves = [r for r in records if r.get("bench") == "converge_curve"]
    files = []
    for seed in sorted({r["seed"] for r in curves}):
        by_step, by_bytes = {}, {}
        for r in curves:
            if r["seed"] != seed:
                continue
            by_step.setdefault(r["variant"], ([], []))
            by_step[r["variant"]][0].append(r["step"])
            by_step[r["variant"]][1].append(r["val_loss"])
            if r["bytes_per_rank"] > 0:
                by_bytes.setdefault(r["variant"], ([], []))
                by_bytes[r["variant"]][0].append(r["bytes_per_rank"] / 2**20)
                by_bytes[r["variant"]][1].append(r["val_loss"])
        files.append(line_plot(os.path.join(out, f"converge_steps_seed{seed}.png"), by_step, xlabel="step",
                               ylabel="validation loss (nats/byte)",
                               title=f"Small GPT on CPython stdlib text, 4 ranks, seed {seed}: val loss vs step"))
        plt = __import__("lioncub_ds.bench.common", fromlist=["pyplot"]).pyplot()
        fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
        for label, (xs, ys) in by_bytes.items():
            ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.4, label=label)
        ax.set_xscale("log")
        ax.set_xlabel("MB sent per rank (cumulative)")
        ax.set_ylabel("validation loss (nats/byte)")
        ax.set_title(f"Val loss vs bytes sent, seed {seed}", fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out, f"converge_bytes_seed{seed}.png")
        fig.savefig(path)
        plt.close(fig)
        files.append(path)
    return files


def build_parser():
    p = argparse.ArgumentParser(prog="python -m lioncub_ds.bench converge", description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + EXTRA_VARIANTS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lion-lr", type=float, default=1e-3)
    p.add_argument("--adamw-lr", type=float, default=3e-3)
    p.add_argument("--lion-wd", type=float, default=0.5)
    p.add_argument("--adamw-wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=4, help="val batches per rank per evaluation")
    p.add_argument("--sync", default=json.dumps(DEFAULT_SYNC), help="momentum_sync policy (JSON) of the *_sync variants")
    add_output_args(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    records, curves, cfg = run(tuple(args.variants), tuple(args.seeds), args.world_size, args.steps, args.preset,
                               args.seq_len, args.batch_size, args.lion_lr, args.adamw_lr, args.lion_wd,
                               args.adamw_wd, warmup=args.warmup, eval_every=args.eval_every,
                               eval_iters=args.eval_iters, sync=json.loads(args.sync))
    print_table(records, TABLE, title=f"[bench converge] GPT preset={args.preset} ({records[0]['params']:,} params), "
                                      f"{args.world_size} ranks x {args.batch_size}x{args.seq_len} tokens, "
                                      f"{args.steps} steps, sync policy {args.sync}")
    for m in check_goal(records):
        print("[bench converge] " + m)
    finish(NAME, args, records + curves, plot)
    print(f"[bench converge] done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
