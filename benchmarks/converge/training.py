"""One training run of a variant: the model, the optimizer (global Lion, AdamW, a hybrid, or the
simulated LionCub), the lr schedule, the evaluation; and the real multi-rank LionCub the simulation
is checked against."""
from __future__ import annotations

import math
import time

import torch

from .grads import GRADS, WorkerGrads
from .simulator import SimLionCub
from .variants import spec_of, warmup_of


def lr_at(step, steps, peak, warmup, min_ratio=0.1):
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio``·peak."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, steps - warmup))
    lo = peak * min_ratio
    return lo + 0.5 * (peak - lo) * (1.0 + math.cos(math.pi * frac))


class HybridLionAdamW:
    """Screening only: global Lion on one class of parameters and AdamW on the other, to find which
    parameters make Lion trail AdamW. ``adamw_on``: "matrices" (the Linear weights) or "small"
    (embeddings, norms, biases). Each part keeps its own lr schedule's peak, betas and wd (Lion:
    the study's Lion wd on the matrices; AdamW: ``adamw_wd`` on the matrices; no wd elsewhere)."""

    def __init__(self, model, adamw_on, cfg, lr, lion_wd, adamw_lr):
        from lioncub_ds import Lion

        if adamw_on not in ("matrices", "small"):
            raise ValueError(f"hybrid adamw_on={adamw_on!r} is not allowed; allowed: matrices, small")
        lion, adamw = [], []
        for g in model.optim_groups(1.0):  # weight_decay 1.0 marks the matrices' group
            matrices = g["weight_decay"] > 0
            on_adamw = matrices == (adamw_on == "matrices")
            (adamw if on_adamw else lion).append(
                {"params": g["params"], "weight_decay": (cfg["adamw_wd"] if on_adamw else lion_wd) if matrices else 0.0,
                 "peak": adamw_lr if on_adamw else lr})
        self.parts = [Lion(lion, lr=lr, betas=tuple(cfg["betas"])) if lion else None,
                      torch.optim.AdamW(adamw, lr=adamw_lr, betas=tuple(cfg["adamw_betas"])) if adamw else None]
        self.parts = [p for p in self.parts if p is not None]
        self.peak = lr

    @property
    def param_groups(self):
        return [g for p in self.parts for g in p.param_groups]

    def set_lr(self, lr):
        """The schedule's lr for the Lion part; the AdamW part follows the same schedule at its own peak."""
        for g in self.param_groups:
            g["lr"] = lr * g["peak"] / self.peak

    def step(self):
        for p in self.parts:
            p.step()


def _model_kw(cfg):
    return {k: cfg[k] for k in ("n_layer", "n_head", "d_model", "bias", "tie_weights") if cfg.get(k) is not None}


def build_variant(name, model, n, cfg, lrs):
    """-> (optimizer, family, uses all-reduced mean gradients?)."""
    from lioncub_ds import Lion

    spec = spec_of(name)
    fam, kind = spec["family"], spec["kind"]
    lr = lrs[fam]
    if kind == "adamw":
        groups = [{k: v for k, v in g.items() if k != "names"} for g in model.optim_groups(cfg["adamw_wd"])]
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg["adamw_betas"])), fam, True
    wd = cfg["adamw_wd"] * lrs["adamw"] / lr if cfg["lion_wd"] is None else cfg["lion_wd"]
    groups = model.optim_groups(wd)
    if kind == "lion":
        groups = [{k: v for k, v in g.items() if k != "names"} for g in groups]
        return Lion(groups, lr=lr, betas=tuple(cfg["betas"])), fam, True
    if kind == "hybrid":
        return HybridLionAdamW(model, spec["adamw_on"], cfg, lr, wd, lrs["adamw"]), fam, True
    opt = SimLionCub(groups, n, lr=lr, betas=tuple(cfg["betas"]), vote=spec.get("vote", "majority"),
                     comm=spec["comm"], quant=spec.get("quant", "sign"), tie_break=spec.get("tie_break", cfg["tie_break"]),
                     momentum_sync=spec.get("sync"),
                     vote_bits=spec.get("bits"), rounding=spec.get("rounding"),
                     error_feedback=spec.get("ef", False), owner_ema=spec.get("ema", 0.0),
                     vote_every=spec.get("vote_every", 1), node_size=spec.get("node", 1))
    return opt, fam, False


@torch.no_grad()
def evaluate(model, ds, cfg, device):
    model.eval()
    tot = 0.0
    for i in range(cfg["eval_iters"]):
        x, y = ds.get_batch("val", cfg["eval_batch"], cfg["seq_len"], 0, 1, step=i, seed=12345, device=device)
        tot += float(model(x, y)[1].double())
    model.train()
    return tot / cfg["eval_iters"]


def build_model_for(cfg, seed, device="cpu"):
    """The study's GPT for ``cfg`` (preset + shape overrides), initialized from ``seed``."""
    from ..models import build_model

    return build_model(cfg["preset"], seed=seed, seq_len=cfg["seq_len"], **_model_kw(cfg)).to(device)


def train_one(variant, seed, n, cfg, lrs, ds, device="cpu"):
    """One paired run: returns {curve: [(step, val loss, bytes)], bytes, digest, ...}."""
    from benchmarks.models.gpt import param_digest
    from lioncub_ds.telemetry import ring_bytes

    model = build_model_for(cfg, seed, device)
    params = [p for p in model.parameters() if p.requires_grad]
    nparams = sum(p.numel() for p in params)
    opt, fam, allreduce = build_variant(variant, model, n, cfg, lrs)
    worker_grads = None if allreduce else WorkerGrads(model, cfg)
    peak, warmup = lrs[fam], warmup_of(variant, cfg)
    ar_bytes = ring_bytes("all_reduce", 4 * nparams, n)
    curve = [(0, evaluate(model, ds, cfg, device), 0)]
    alt_curve = [{"allgather": 0}]
    sent = sync_sent = intra = 0
    t0 = time.perf_counter()
    for step in range(cfg["steps"]):
        lr = lr_at(step, cfg["steps"], peak, warmup, cfg["min_lr_ratio"])
        if isinstance(opt, HybridLionAdamW):
            opt.set_lr(lr)
        else:
            for g in opt.param_groups:
                g["lr"] = lr
        batches = [ds.get_batch("train", cfg["batch_size"], cfg["seq_len"], i, n, step=step, seed=seed,
                                device=device) for i in range(n)]
        if allreduce:
            # The mean of N equal-size workers' mean losses: one batched pass gives the mean gradient.
            for p in params:
                p.grad = None
            x = torch.cat([b[0] for b in batches])
            y = torch.cat([b[1] for b in batches])
            model(x, y)[1].backward()
            opt.step()
            sent += ar_bytes
        else:
            opt.step(worker_grads(batches))
            sent, sync_sent, intra = opt.bytes_sent, opt.sync_bytes, opt.intra_bytes
        if (step + 1) % cfg["eval_every"] == 0 or step + 1 == cfg["steps"]:
            curve.append((step + 1, evaluate(model, ds, cfg, device), sent))
            alt_curve.append({"allgather": opt.bytes_if("allgather") if isinstance(opt, SimLionCub) else None})
            if not math.isfinite(curve[-1][1]):
                break
    return {"variant": variant, "seed": seed, "world_size": n, "curve": curve, "bytes": sent, "sync_bytes": sync_sent,
            "intra_bytes": intra, "node_size": spec_of(variant).get("node", 1), "params": nparams, "wall_s": time.perf_counter() - t0, "fp32_allreduce_bytes_per_step": ar_bytes,
            "digest": param_digest(model), "lr": peak, "family": fam, "alt_curve": alt_curve}


def real_lioncub_rank(rank, n, variants, seed, cfg, lrs):
    """Rank ``rank`` of real multi-rank LionCub runs of ``variants`` (one after the other, no
    evaluation): the reference that the simulation must reproduce bit for bit.
    Returns [(param digest, bytes sent, bytes by scope)] per variant (node voters: scopes
    "inter_node" and "intra_node", else "vote_group")."""
    from lioncub_ds import LionCub
    from benchmarks.data import load_dataset
    from benchmarks.models.gpt import param_digest

    ds = load_dataset(cfg["data"])
    out = []
    for variant in variants:
        spec = spec_of(variant)
        if variant in ("adamw", "lion"):
            raise ValueError(f"{variant}: not a LionCub configuration")
        model = build_model_for(cfg, seed)
        lr = lrs[spec["family"]]
        wd = cfg["adamw_wd"] * lrs["adamw"] / lr if cfg["lion_wd"] is None else cfg["lion_wd"]
        opt = LionCub(model.optim_groups(wd), lr=lr, betas=tuple(cfg["betas"]), vote=spec.get("vote", "majority"),
                      comm=spec["comm"], quant=spec.get("quant", "sign"),
                      tie_break=spec.get("tie_break", cfg["tie_break"]), momentum_sync=spec.get("sync"),
                      vote_bits=spec.get("bits"), rounding=spec.get("rounding"),
                      **(dict(voters="node", node_size=spec["node"]) if "node" in spec else {}))
        warmup = warmup_of(variant, cfg)
        for step in range(cfg["steps"]):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg["steps"], lr, warmup, cfg["min_lr_ratio"])
            x, y = ds.get_batch("train", cfg["batch_size"], cfg["seq_len"], rank, n, step=step, seed=seed)
            opt.zero_grad(set_to_none=True)
            model(x, y)[1].backward()
            opt.step()
        cum = opt.comm_stats()["cumulative"]
        out.append((param_digest(model), cum["bytes_sent"], dict(cum["by_scope"])))
    return out


def grads_speed(cfg, n, ds, modes=GRADS, repeats=3, steps=20, seed=0):
    """Seconds per step of each gradient mode on the same model and batches, the modes interleaved
    (``repeats`` rounds of ``steps`` steps each; a compiled mode's first call, the compilation, is
    timed apart). -> records {mode, s_per_step (median of the rounds), compile_s, speedup_vs_loop}."""
    model = build_model_for(cfg, seed)
    fns = {m: WorkerGrads(model, dict(cfg, grads=m)) for m in modes}
    batches = [[ds.get_batch("train", cfg["batch_size"], cfg["seq_len"], i, n, step=t, seed=seed) for i in range(n)]
               for t in range(steps)]
    first = {}
    for m, fn in fns.items():  # warm-up (and compilation) outside the timed rounds
        t0 = time.perf_counter()
        fn(batches[0])
        first[m] = time.perf_counter() - t0
    times = {m: [] for m in modes}
    for _ in range(repeats):
        for m, fn in fns.items():
            t0 = time.perf_counter()
            for b in batches:
                fn(b)
            times[m].append((time.perf_counter() - t0) / steps)
    med = {m: sorted(v)[len(v) // 2] for m, v in times.items()}
    return [{"bench": "converge_grads_speed", "mode": m, "world_size": n, "batch_size": cfg["batch_size"],
             "d_model": cfg["d_model"], "s_per_step": med[m], "rounds_s": times[m], "first_call_s": first[m],
             "speedup_vs_loop": med.get("loop", float("nan")) / med[m]} for m in modes]
