"""A plain DeepSpeed training script: it never imports lioncub_ds.

``tests/test_deepspeed.py`` runs it ONCE under the ``deepspeed`` launcher on 2 CPU ranks
(``DS_ACCELERATOR=cpu``, gloo); it plays every scenario in that one launch (an engine
per scenario) and writes ``<out>/rank<r>.json`` for the test to check. The only thing
that makes ``"type": "LionCub"`` resolve is the installed ``lioncub_ds_autohook.pth``
(the lazy hook that registers LionCub when ``deepspeed`` is imported).

Instrumentation (test-only): the NCCL-contract wrapper (``lioncub_ds/testing/nccl_contract.py``,
loaded by file path: it imports only torch) is installed BEFORE deepspeed is imported (deepspeed
caches function pointers at init). It records every collective (op, group, dtype, shape, reduce
op) and the rank's log goes into its JSON, where the test compares the ranks' logs and checks
that no tensor left the parameters' device and no dtype/op pair NCCL refuses was used
(``LIONCUB_NCCL_CONTRACT=0``: recorded, not enforced). Per scenario, the calls during the
training steps are summarised. fp16 on this CPU: DeepSpeed's CPU accelerator reports fp16
unsupported (no AVX512-FP16); torch runs fp16 Linear layers on CPU anyway, so the script
overrides that one capability check.

This module is collected by pytest but defines no tests (``__test__ = False``); all work
happens in :func:`main`.
"""
import argparse
import hashlib
import json
import os
import sys
import time
import traceback

__test__ = False

CONTRACT_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lioncub_ds", "testing",
                             "nccl_contract.py")


def _load_contract():
    import importlib.util
    spec = importlib.util.spec_from_file_location("_lioncub_nccl_contract", CONTRACT_PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


NC = None  # the contract module, once instrument() ran


class Recorder:
    """The contract log's entries between start() and stop(), minus paused stretches."""

    def __init__(self):
        self.calls, self.mark, self.on = [], 0, False

    def start(self):
        self.calls, self.mark, self.on = [], len(NC.log()), True

    def pause(self):
        self.calls += NC.log()[self.mark:]
        self.on = False

    def resume(self):
        self.mark, self.on = len(NC.log()), True

    def stop(self):
        if self.on:
            self.pause()
        return self.calls


REC = Recorder()


def instrument():
    global NC
    NC = _load_contract()
    NC.install(device="cpu", enforce=os.environ.get("LIONCUB_NCCL_CONTRACT", "1") != "0")


def summarize(calls):
    """Collectives of one scenario's training steps, grouped. ``calls``: contract log entries."""
    import math
    out = {"float_reduce_calls": 0, "float_reduce_max_numel": 0, "float_allgather_calls": 0,
           "float_allgather_max_numel": 0, "int_calls": 0, "uint8_allgather_calls": 0, "uint8_allgather_bytes": 0,
           "by_name": {}}
    for entry in calls:
        name, dtype = entry[0], entry[2] if len(entry) > 2 else None
        if name.startswith("new_") or name == "split_group" or dtype == "object":
            continue
        shape = entry[3]
        numel = math.prod(shape) if shape is not None else 0
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
        if dtype == "torch.uint8" and "gather" in name:
            out["uint8_allgather_calls"] += 1
            out["uint8_allgather_bytes"] += numel
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
            # Every coordinate, exactly: unmoved, or moved by lr (one fp32 rounding of before -/+ lr).
            moved = not_lr = 0
            for p, b in zip(engine.module.parameters(), before):
                a = p.detach().float()
                lr = torch.tensor(lr_before[0], dtype=torch.float32)
                ok = (a == b) | (a == b - lr) | (a == b + lr)
                moved += int((a != b).sum())
                not_lr += int((~ok).sum())
            trace.append({"step": s, "lr": lr_before, "max_change": change, "loss_scale": loss_scale(engine),
                          "skipped": int(engine.skipped_steps), "moved": moved, "not_lr_moves": not_lr})
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
    if lds is not None and out["optimizer"] == "LionCub":
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
        REC.pause()  # keep what was recorded
        engine.save_checkpoint(tmp, tag="mid")
        res["rank_files"] = sorted(f for f in os.listdir(os.path.join(tmp, "mid")) if f.startswith("lioncub-rank"))
        REC.resume()
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


def bruteforce_scenario(cfg, rank, steps=5):
    """Stage 0 through the real engine: after every engine.step(), each parameter equals what a
    literal majority vote over every rank's (gradient, momentum) gives, exactly.

    Literal implementation (docs/conventions.md): c_i = β1·m_i + (1−β1)·g_i, δ_i = sign(c_i) (0 abstains),
    Δ = sign(Σ_i δ_i) (tie_break="zero": a tie moves nothing), θ ← θ·(1 − η·λ) − η·Δ; g_i is the
    local gradient after DeepSpeed's ``gradient_clipping`` (default 1.0), which at stage 0 scales
    each rank's gradient by clip / (‖g_i‖ + 1e-6) when that is below 1 (its local norm)."""
    import deepspeed
    import torch
    import torch.distributed as dist
    model = make_model(0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    opt = engine.basic_optimizer
    params = list(engine.module.parameters())
    group_of = {p: g for g in opt.param_groups for p in g["params"]}
    n = dist.get_world_size()
    out = {"steps": 0, "mismatched_elements": 0, "elements": 0, "moved": 0, "ties": 0}
    seen = {}

    def at_step(o, a, k):  # what LionCub itself is handed (diagnostics for a mismatch)
        seen["grads"] = [p.grad.detach().clone() for p in params]
        seen["momenta"] = [o.state[p]["exp_avg"].clone() if "exp_avg" in o.state[p] else None for p in params]

    opt.register_step_pre_hook(at_step)
    for s in range(steps):
        x, y = batch(rank, s, 0, torch.float32)
        engine.backward(((engine(x).float() - y) ** 2).mean())
        before = [p.detach().clone() for p in params]
        clip = cfg.get("gradient_clipping", 1.0)  # DeepSpeed's default is 1.0
        norm = float(sum(float((p.grad.float() ** 2).sum()) for p in params)) ** 0.5
        coef = clip / (norm + 1e-6) if clip > 0 else 1.0
        c = []
        for p in params:
            g = group_of[p]
            b1 = g["betas"][0]
            m = opt.state[p]["exp_avg"] if "exp_avg" in opt.state[p] else torch.zeros_like(p)
            grad = p.grad.float() * coef if coef < 1.0 else p.grad.float()
            c.append((b1 * m.float() + (1 - b1) * grad).reshape(-1))
        local = torch.cat(c)
        everyone = [torch.zeros_like(local) for _ in range(n)]
        dist.all_gather(everyone, local)
        votes = torch.stack([torch.sign(e) for e in everyone]).sum(0)
        delta = torch.sign(votes)
        out["ties"] += int(((votes == 0) & (torch.stack(everyone) != 0).any(0)).sum())
        grads_bw = [p.grad.detach().clone() for p in params]
        moms_bw = [opt.state[p]["exp_avg"].clone() if "exp_avg" in opt.state[p] else None for p in params]
        engine.step()
        if "grads" in seen and "grad_diff" not in out:
            gd = [float((a - b).abs().max()) for a, b in zip(seen["grads"], grads_bw)]
            ratio = [float((a.norm() / b.norm())) for a, b in zip(seen["grads"], grads_bw)]
            md = [float((a - b).abs().max()) if a is not None and b is not None else None
                  for a, b in zip(seen["momenta"], moms_bw)]
            if max(gd) > 0 or any(x for x in md if x):
                out["grad_diff"] = {"step": s, "grad_maxdiff": gd, "grad_norm_ratio": ratio, "momentum_maxdiff": md}
        off = 0
        for p, b in zip(params, before):
            g = group_of[p]
            lr, wd = g["lr"], g["weight_decay"]
            d = delta[off:off + p.numel()].view_as(b)
            off += p.numel()
            e = b.clone()
            if wd:
                e.mul_(1.0 - lr * wd)
            e.add_(d.mul(-lr))
            bad = p.detach() != e
            if bad.any() and "first_mismatch" not in out:
                out["first_mismatch"] = {"step": s, "param": tuple(p.shape), "got": p.detach()[bad][:4].tolist(),
                                         "expected": e[bad][:4].tolist(), "before": b[bad][:4].tolist(),
                                         "expected_delta": d[bad][:4].tolist()}
            out["mismatched_elements"] += int(bad.sum())
            out["elements"] += p.numel()
            out["moved"] += int((d != 0).sum())
        out["steps"] += 1
    out["lioncub_step_count"] = int(opt.step_count)
    out["params"] = tensor_hash(params)
    return out


def frozen_scenario(cfg, rank, steps=3):
    """A LoRA-like model: the first layer frozen, deepspeed.initialize without model_parameters (so
    DeepSpeed hands every parameter, frozen ones included, to the optimizer): it trains, the frozen
    layer stays as it was, the replicas agree."""
    import deepspeed
    model = make_model(0)
    for p in model[0].parameters():
        p.requires_grad_(False)
    frozen = tensor_hash(list(model[0].parameters()))
    trainable = tensor_hash(list(model[2].parameters()))
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    train(engine, rank, steps)
    return {"frozen_unchanged": tensor_hash(list(engine.module[0].parameters())) == frozen,
            "trained": tensor_hash(list(engine.module[2].parameters())) != trainable,
            "params": tensor_hash(list(engine.module.parameters()))}


def weights_only_load_scenario(cfg, rank, tmp, lr):
    """Stage 0 behind DeepSpeed's bf16 / fp16 wrapper: a weights-only load (load_optimizer_states=False)
    into an engine built from another init; the next step must start from the loaded weights (the
    wrapper's fp32 masters refreshed from them), moving each by about lr, not back to the old init."""
    import deepspeed
    import torch
    dtype = model_dtype(cfg)
    model = make_model(0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    train(engine, rank, 2)
    engine.save_checkpoint(tmp, tag="w")
    saved = [p.detach().float().clone() for p in engine.module.parameters()]
    model2 = make_model(321)
    engine2, *_ = deepspeed.initialize(model=model2, model_parameters=model2.parameters(), config=cfg)
    engine2.load_checkpoint(tmp, tag="w", load_optimizer_states=False, load_lr_scheduler_states=False)
    loaded = [p.detach().float().clone() for p in engine2.module.parameters()]
    train(engine2, rank, 1)
    after = [p.detach().float() for p in engine2.module.parameters()]
    torch.distributed.barrier()
    return {"loaded_equal": all(torch.equal(a, b) for a, b in zip(saved, loaded)),
            "max_move": max(float((a - b).abs().max()) for a, b in zip(after, loaded)), "lr": lr,
            "dtype": str(dtype)}


def node_local_missing_scenario(cfg, rank, tmp):
    """Stage 0, node-local storage: rank 1's copy of the checkpoint lacks the tag folder. Every rank
    raises CheckpointError together (rank 1 skipped the check and went on into DeepSpeed's load while
    rank 0 waited in it), and no rank changed its state."""
    import shutil
    import deepspeed
    import torch
    model = make_model(0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    train(engine, rank, 2)
    engine.save_checkpoint(tmp, tag="t")
    torch.distributed.barrier()
    other = tmp + "_other_node"
    if rank == 0:
        shutil.copytree(tmp, other, ignore=shutil.ignore_patterns("t"))
    torch.distributed.barrier()
    train(engine, rank, 1, start=2)
    before = tensor_hash(list(engine.module.parameters()))
    try:
        engine.load_checkpoint(tmp if rank == 0 else other, tag="t")
        err = None
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        err = f"{type(exc).__name__}: {exc}"
    torch.distributed.barrier()
    return {"error": err, "unchanged": tensor_hash(list(engine.module.parameters())) == before}


def sequence_parallel_scenario(cfg, rank, steps=3, inject=None):
    """A Ulysses-style mpu (DeepSpeed's seam): both ranks are one replica (data-parallel size 1),
    sequence-parallel 2, each with its own chunk's gradient. DeepSpeed reduces over the
    sequence-data group; LionCub must vote over it too, or the replica's ranks drift apart."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.utils import groups as ds_groups
    world = dist.get_world_size()
    single = [dist.new_group([r]) for r in range(world)]

    class SequenceParallelMPU:
        def get_model_parallel_rank(self): return 0
        def get_model_parallel_world_size(self): return 1
        def get_model_parallel_group(self): return single[rank]
        def get_data_parallel_rank(self): return 0
        def get_data_parallel_world_size(self): return 1
        def get_data_parallel_group(self): return single[rank]
        def get_sequence_parallel_rank(self): return rank
        def get_sequence_parallel_world_size(self): return world
        def get_sequence_parallel_group(self): return dist.group.WORLD
        def get_sequence_data_parallel_group(self): return dist.group.WORLD
        def get_sequence_data_parallel_rank(self): return rank
        def get_sequence_data_parallel_world_size(self): return world

    before = getattr(ds_groups, "mpu", None)
    try:
        model = make_model(0)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                          mpu=SequenceParallelMPU())
        train(engine, rank, steps, inject=inject)
        return {"params": tensor_hash(list(engine.module.parameters())), "summary": engine.lioncub.summary(),
                "skipped_steps": int(engine.skipped_steps), "lioncub_step_count": engine.basic_optimizer.step_count,
                "engine_optimizer": type(engine.optimizer).__name__}
    finally:
        ds_groups.mpu = before  # DeepSpeed keeps the last engine's mpu in a module global


def error_table(base, rank):
    """tests/test_config_validation.py's INVALID table through deepspeed.initialize: each case must fail
    with LionCubConfigError before any optimizer exists (torch.optim.Optimizer.__init__ never runs)."""
    import importlib.util
    import deepspeed
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_config_validation.py")
    spec = importlib.util.spec_from_file_location("_lioncub_invalid_table", path)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    from dist_helpers import recording_optimizer_inits
    out = {}
    with recording_optimizer_inits() as inits:
        for case_id, kwargs, _pattern in table.INVALID:
            params = table._ds_params(kwargs)
            cfg = dict(base, optimizer={"type": "LionCub", "params": {"lr": 3e-3, **params}})
            del inits[:]
            model = make_model(0)
            before = tensor_hash(list(model.parameters()))
            try:
                deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
                err = (None, None)
            except Exception as exc:  # noqa: BLE001
                err = (type(exc).__name__, str(exc))
            out[case_id] = {"error_type": err[0], "error": err[1], "optimizer_inits": list(inits),
                            "params_untouched": tensor_hash(list(model.parameters())) == before}
    return out


def expect_error(cfg, rank):
    import deepspeed
    model = make_model(0)
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except Exception as exc:  # noqa: BLE001
        return {"error_type": type(exc).__name__, "error": str(exc)}
    return {"error_type": None, "error": None}


def parse_args():
    """The launched script's arguments: ``--out DIR`` and ``--only a,b`` (``--local_rank``: the launcher's)."""
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--out", required=True)
    p.add_argument("--only", default=None, help="comma-separated scenario names")
    return p.parse_args()


def main():
    args = parse_args()

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
        # a finite bf16 gradient whose square overflows the wrapper's fp32 norm, on one rank only
        "bf16_stage0_huge_grad": lambda: run_scenario(
            "bf16_stage0_huge_grad", dict(base, bf16={"enabled": True}, optimizer=lioncub(comm="1bit", timeout_s=120)),
            rank, args, steps=5, inject=(2, 1, 1e20)),
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
        # positive control for "no float all-reduce": the same harness with LionCub off
        "control_sgd_stage0": lambda: run_scenario(
            "control_sgd_stage0", dict(base, optimizer={"type": "SGD", "params": {"lr": 1e-2}}), rank, args, steps=2),
        "bruteforce_stage0": lambda: bruteforce_scenario(
            dict(base, optimizer=lioncub(comm="1bit", tie_break="zero", weight_decay=0.1)), rank),
        "bruteforce_stage0_pbit": lambda: bruteforce_scenario(
            dict(base, optimizer=lioncub(comm="pbit", tie_break="zero", weight_decay=0.0, betas=[0.95, 0.98]),
                 gradient_clipping=0.0), rank),
        "frozen_stage0": lambda: frozen_scenario(dict(base, optimizer=lioncub()), rank),
        "node_local_missing_stage0": lambda: node_local_missing_scenario(dict(base, optimizer=lioncub()), rank,
                                                                         tmp + "_nl"),
        "bf16_stage0_weights_only_load": lambda: weights_only_load_scenario(
            dict(base, bf16={"enabled": True}, optimizer=lioncub(weight_decay=0.0)), rank, tmp + "_w", 3e-3),
        "err_table": lambda: error_table(base, rank),
        "err_misspelled": lambda: expect_error(dict(base, optimizer=lioncub(weight_decy=0.1)), rank),
        # what is still refused now that stage 3 and offload are served (tests/test_deepspeed_zero3.py)
        "err_node_stage2": lambda: expect_error(dict(base, zero_optimization={"stage": 2},
                                                     optimizer=lioncub(voters="node")), rank),
        "err_offload_stage0": lambda: expect_error(dict(base, zero_optimization={"stage": 0, "offload_optimizer": {
            "device": "cpu"}}, optimizer=lioncub()), rank),
        # last: an mpu (DeepSpeed's module global is restored after it)
        "sequence_parallel_stage0": lambda: sequence_parallel_scenario(dict(base, optimizer=lioncub()), rank),
        # bf16: DeepSpeed agrees its overflow check over its data- and model-parallel groups, which
        # an inf on one sequence-parallel rank of the replica does not cross
        "sequence_parallel_bf16_overflow": lambda: sequence_parallel_scenario(
            dict(base, bf16={"enabled": True}, optimizer=lioncub(timeout_s=120)), rank, steps=3,
            inject=(1, 1, float("inf"))),
    }
    play(scenarios, args.only, result)
    result["nccl_contract"] = NC.snapshot()
    write_result(args.out, rank, result)


def play(scenarios: dict, only, result: dict) -> None:
    """Run every scenario (or those named in ``only``, comma-separated) into ``result``; a failing
    scenario is reported and the others still run. A barrier after each keeps the ranks together."""
    import torch
    only = set(only.split(",")) if only else None
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


def write_result(out: str, rank: int, result: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


def exit_now() -> None:
    """Leave without the interpreter's teardown once the results are written: a gloo worker
    freeing the last collective's tensors can abort a finished rank there ("terminate called
    without an active exception", pytorch/pytorch#38228), which would fail the launch for
    nothing (docs/deepspeed.md)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_now()
