"""A plain DeepSpeed training script: it never imports lioncub_ds.

``tests/test_deepspeed.py`` runs it ONCE under the ``deepspeed`` launcher on 2 CPU ranks
(``DS_ACCELERATOR=cpu``, gloo); it plays every scenario in that one launch (an engine
per scenario) and writes ``<out>/rank<r>.json`` for the test to check. The only thing
that makes ``"type": "LionCub"`` resolve is the installed ``lioncub_ds_autohook.pth``
(the lazy hook that registers LionCub when ``deepspeed`` is imported).

Instrumentation (test-only): torch.distributed collectives are wrapped BEFORE deepspeed
is imported (deepspeed caches function pointers at init), and every call during the
training steps is recorded as (collective, dtype, numel). fp16 on this CPU: DeepSpeed's
CPU accelerator reports fp16 unsupported (no AVX512-FP16); torch runs fp16 Linear layers
on CPU anyway, so the script overrides that one capability check.

This module is collected by pytest but defines no tests (``__test__ = False``); all work
happens in :func:`main`.
"""
import argparse
import functools
import hashlib
import json
import os
import sys
import time
import traceback

__test__ = False

_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
                "_reduce_scatter_base", "all_to_all_single", "broadcast", "reduce")


class Recorder:
    def __init__(self):
        self.on = False
        self.calls = []

    def start(self):
        self.calls = []
        self.on = True

    def stop(self):
        self.on = False
        return self.calls


REC = Recorder()


def _first_tensor(args, kwargs):
    import torch
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v
        if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
            return v[0]
    return None


def instrument():
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in _COLLECTIVES:
        for mod in (dist, c10d):
            f = getattr(mod, name, None)
            if f is None or getattr(f, "_counted", False):
                continue

            def make(f=f, name=name):
                @functools.wraps(f)
                def counted(*args, **kwargs):
                    if REC.on:
                        t = _first_tensor(args, kwargs)
                        REC.calls.append((name, str(t.dtype) if t is not None else None,
                                          int(t.numel()) if t is not None else 0))
                    return f(*args, **kwargs)
                counted._counted = True
                return counted

            setattr(mod, name, make())


def summarize(calls):
    """Collectives of one scenario's training steps, grouped."""
    out = {"float_reduce_calls": 0, "float_reduce_max_numel": 0, "float_allgather_calls": 0,
           "float_allgather_max_numel": 0, "int_calls": 0, "by_name": {}}
    for name, dtype, numel in calls:
        key = f"{name}:{dtype}"
        out["by_name"][key] = out["by_name"].get(key, 0) + 1
        is_float = dtype is not None and ("float" in dtype or "bfloat" in dtype or "half" in dtype)
        if is_float and ("reduce" in name) and numel >= 32:
            out["float_reduce_calls"] += 1
            out["float_reduce_max_numel"] = max(out["float_reduce_max_numel"], numel)
        elif is_float and "gather" in name and numel >= 32:
            out["float_allgather_calls"] += 1
            out["float_allgather_max_numel"] = max(out["float_allgather_max_numel"], numel)
        elif not is_float:
            out["int_calls"] += 1
    return out


def tensor_hash(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().reshape(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()[:24]


# ----------------------------------------------------------------------------- training
def make_model(seed=0):
    import torch
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def batch(rank, step, micro, dtype, n=8):
    """Deterministic per (rank, step, micro): every rank sees different data."""
    import torch
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro + 1)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(7)) / 4
    y = x @ w + 0.01 * torch.randn(n, 4, generator=g)
    return x.to(dtype), y


def eval_loss(engine, dtype):
    import torch
    g = torch.Generator().manual_seed(99)
    x = torch.randn(64, 16, generator=g)
    y = x @ (torch.randn(16, 4, generator=torch.Generator().manual_seed(7)) / 4)
    with torch.no_grad():
        return float(((engine.module(x.to(dtype)).float() - y) ** 2).mean())


def model_dtype(cfg):
    import torch
    if cfg.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if cfg.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


def momenta_hash(engine):
    opt = engine.basic_optimizer
    ms = [opt.state[p]["exp_avg"] for g in opt.param_groups for p in g["params"] if "exp_avg" in opt.state[p]]
    return tensor_hash(ms)


def loss_scale(engine):
    opt = engine.optimizer
    for attr in ("cur_scale", "loss_scale"):
        v = getattr(opt, attr, None)
        if isinstance(v, (int, float)):
            return float(v)
    cfg = getattr(opt, "loss_scale_config", None)
    return float(getattr(cfg, "cur_scale", 1.0)) if cfg is not None else None


def train(engine, rank, steps, start=0, inject=None, trace=None):
    """``steps`` optimizer steps; ``inject=(step, rank, value)`` corrupts one gradient after backward."""
    import torch
    dtype = model_dtype(engine.config if isinstance(engine.config, dict) else {})
    gas = engine.gradient_accumulation_steps()
    losses = []
    for s in range(start, start + steps):
        lr_before = [g["lr"] for g in engine.basic_optimizer.param_groups]
        before = [p.detach().float().clone() for p in engine.module.parameters()]
        for micro in range(gas):
            x, y = batch(rank, s, micro, dtype)
            loss = ((engine(x).float() - y) ** 2).mean()
            engine.backward(loss)
            if inject is not None and inject[0] == s and inject[1] == rank and micro == gas - 1:
                p = next(engine.module.parameters())
                grad = p.grad if p.grad is not None else getattr(p, "_hp_grad", None)
                grad.view(-1)[0] = inject[2]
            engine.step()
            losses.append(float(loss.detach()))
        if trace is not None:
            change = max(float((p.detach().float() - b).abs().max())
                         for p, b in zip(engine.module.parameters(), before))
            trace.append({"step": s, "lr": lr_before, "max_change": change, "loss_scale": loss_scale(engine),
                          "skipped": int(engine.skipped_steps)})
    return losses


def summary(engine, rank, losses, dtype, calls=None):
    import torch
    opt = engine.basic_optimizer
    out = {"params": tensor_hash(list(engine.module.parameters())), "momenta": momenta_hash(engine),
           "eval_loss": eval_loss(engine, dtype), "losses": losses, "skipped_steps": int(engine.skipped_steps),
           "global_steps": int(engine.global_steps), "optimizer": type(opt).__name__,
           "engine_optimizer": type(engine.optimizer).__name__,
           "enable_backward_allreduce": bool(engine.enable_backward_allreduce),
           "lioncub_step_count": int(getattr(opt, "step_count", -1)),
           "lioncub_world_size": int(getattr(opt, "world_size", -1))}
    st = getattr(engine, "lioncub", None)
    out["state"] = repr(st)
    if calls is not None:
        out["collectives"] = summarize(calls)
    lds = sys.modules.get("lioncub_ds.deepspeed")
    if lds is not None:
        cs = lds.comm_stats(engine)
        out["comm_stats"] = json.loads(json.dumps(cs, default=str))
    out["flat_numel"] = sum(p.numel() for p in engine.module.parameters())
    del torch
    return out


def run_scenario(name, cfg, rank, args, steps=6, inject=None, resume_at=None, tmp=None):
    import deepspeed
    import torch
    dtype = model_dtype(cfg)
    model = make_model(0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    res = {"init_eval_loss": eval_loss(engine, dtype)}
    trace = []
    REC.start()
    t0 = time.perf_counter()
    if resume_at is None:
        losses = train(engine, rank, steps, inject=inject, trace=trace)
    else:
        losses = train(engine, rank, resume_at, trace=trace)
        REC.on = False  # pause (keep what was recorded)
        engine.save_checkpoint(tmp, tag="mid")
        res["rank_files"] = sorted(f for f in os.listdir(os.path.join(tmp, "mid")) if f.startswith("lioncub-rank"))
        REC.on = True
        losses += train(engine, rank, steps - resume_at, start=resume_at, trace=trace)
    calls = REC.stop()
    res["train_s"] = time.perf_counter() - t0
    res.update(summary(engine, rank, losses, dtype, calls))
    res["trace"] = trace
    if resume_at is not None:
        model2 = make_model(123)  # a different init: everything must come from the checkpoint
        engine2, _, _, _ = deepspeed.initialize(model=model2, model_parameters=model2.parameters(), config=cfg)
        path, _ = engine2.load_checkpoint(tmp, tag="mid")
        res["resume_loaded"] = path is not None
        res["resume_global_steps_at_load"] = int(engine2.global_steps)
        losses2 = train(engine2, rank, steps - resume_at, start=resume_at)
        res["resumed"] = summary(engine2, rank, losses2, dtype)
    torch.distributed.barrier()
    return res


def expect_error(cfg, rank):
    import deepspeed
    model = make_model(0)
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except Exception as exc:  # noqa: BLE001
        return {"error_type": type(exc).__name__, "error": str(exc)}
    return {"error_type": None, "error": None}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--out", required=True)
    p.add_argument("--only", default=None, help="comma-separated scenario names")
    args = p.parse_args()

    assert "lioncub_ds" not in sys.modules
    instrument()
    t_import = time.perf_counter()
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    result = {"import_deepspeed_s": time.perf_counter() - t_import,
              "hook_registered": "lioncub_ds.deepspeed" in sys.modules}
    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()
    torch.set_num_threads(1)
    acc = get_accelerator()
    acc.is_fp16_supported = lambda: True  # see module doc (test-only)

    base = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10 ** 6, "wall_clock_breakdown": False}

    def lioncub(**params):
        return {"type": "LionCub", "params": {"lr": 3e-3, "betas": [0.9, 0.99], "weight_decay": 0.1, **params}}

    warmup = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 4e-3, "warmup_num_steps": 4,
                                             "warmup_type": "linear"}}
    decay = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 2,
                                                 "total_num_steps": 8, "warmup_type": "linear"}}
    tmp = os.path.join(args.out, "ckpt")
    scenarios = {
        "fp32_stage0": lambda: run_scenario(
            "fp32_stage0", dict(base, optimizer=lioncub(weight_decay=0.0), scheduler=warmup, gradient_clipping=1.0),
            rank, args, steps=8, resume_at=4, tmp=tmp + "_fp32"),
        "gas3_stage0": lambda: run_scenario(
            "gas3_stage0", dict(base, gradient_accumulation_steps=3, optimizer=lioncub(comm="pbit")), rank, args,
            steps=4),
        "bf16_stage0": lambda: run_scenario(
            "bf16_stage0", dict(base, bf16={"enabled": True}, optimizer=lioncub(comm="1bit"), gradient_clipping=0.5),
            rank, args, steps=6),
        "fp16_stage0_overflow": lambda: run_scenario(
            "fp16_stage0_overflow",
            dict(base, fp16={"enabled": True, "initial_scale_power": 10, "loss_scale_window": 100},
                 optimizer=lioncub(comm="allgather")),
            rank, args, steps=6, inject=(2, 1, float("inf"))),
        "fp32_nan_stage0": lambda: run_scenario(
            "fp32_nan_stage0", dict(base, optimizer=lioncub()), rank, args, steps=5, inject=(2, 1, float("nan"))),
        "zero1_fp32_sign": lambda: run_scenario(
            "zero1_fp32_sign", dict(base, zero_optimization={"stage": 1}, optimizer=lioncub(), scheduler=decay),
            rank, args, steps=6),
        "zero1_fp32_params": lambda: run_scenario(
            "zero1_fp32_params", dict(base, zero_optimization={"stage": 1}, optimizer=lioncub(zero_allgather="params"),
                                      scheduler=decay), rank, args, steps=6),
        "zero2_fp32_sign": lambda: run_scenario(
            "zero2_fp32_sign", dict(base, zero_optimization={"stage": 2}, optimizer=lioncub(), gradient_clipping=1.0),
            rank, args, steps=6, resume_at=3, tmp=tmp + "_z2"),
        "zero1_bf16_replica": lambda: run_scenario(
            "zero1_bf16_replica", dict(base, bf16={"enabled": True}, zero_optimization={"stage": 1},
                                       optimizer=lioncub(zero_fp32_replica=True)), rank, args, steps=6),
        "zero1_bf16_params": lambda: run_scenario(
            "zero1_bf16_params", dict(base, bf16={"enabled": True}, zero_optimization={"stage": 1},
                                      optimizer=lioncub()), rank, args, steps=6),
        "zero2_bf16_replica": lambda: run_scenario(
            "zero2_bf16_replica", dict(base, bf16={"enabled": True}, zero_optimization={"stage": 2},
                                       optimizer=lioncub(zero_fp32_replica=True)),
            rank, args, steps=6, resume_at=3, tmp=tmp + "_z2bf16"),
        "err_misspelled": lambda: expect_error(dict(base, optimizer=lioncub(weight_decy=0.1)), rank),
        "err_stage3": lambda: expect_error(dict(base, zero_optimization={"stage": 3}, optimizer=lioncub()), rank),
        "err_offload": lambda: expect_error(dict(base, zero_optimization={"stage": 2, "offload_optimizer": {
            "device": "cpu"}}, optimizer=lioncub()), rank),
    }
    only = set(args.only.split(",")) if args.only else None
    for name, fn in scenarios.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as exc:  # noqa: BLE001 - report, keep going (the other scenarios still count)
            result[name] = {"exception": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        result[name]["wall_s"] = time.perf_counter() - t0
        torch.distributed.barrier()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
