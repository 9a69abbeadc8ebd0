"""Pretrain the small GPT on CPython's own source with Lion Cub on N CPU ranks.

    python -m benchmarks.demo                       # 2 gloo ranks, "demo" preset, ~2-3 min on 2 idle cores
    python -m benchmarks.demo --steps 100 --comm 1bit
    python -m benchmarks.demo --optim lion          # baseline: global Lion on all-reduced gradients

Every rank trains on its own shard of the byte-level corpus (benchmarks.data) with its
own random window stream; with ``--optim lioncub`` the gradients are NEVER all-reduced:
each rank keeps its own momentum and only 1-bit votes travel (docs/conventions.md). Baselines
``lion`` and ``adamw`` all-reduce (average) the gradients first, as plain DDP would.

Exit status: 0 on success; 1 when the validation loss did not go down by at least
``--min-drop`` nats; 2 when the parameters ended up different across ranks.

The training function :func:`train` is shared with ``examples/pretrain_gpt.py`` (torchrun)
and the benchmarks: it runs inside one already-initialized rank.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist

from .common import quiet_progress_lock
from .data import DEFAULT_MAX_BYTES, load_dataset
from lioncub_ds.config import LionCubConfig, LionCubConfigError
from lioncub_ds.groups import exit_cleanly
from .models import PRESETS, build_model
from .models.gpt import param_digest
from lioncub_ds.telemetry import format_bytes
from lioncub_ds.testing.spawn import free_port

__all__ = ["build_parser", "check_lioncub_flags", "train", "make_optimizer", "main", "launch"]

OPTIMIZERS = ("lioncub", "lion", "adamw")


def setting_choices(name: str) -> tuple:
    """The values LionCubConfig allows for setting ``name`` (its field's choices): the flags' argparse choices."""
    for f in fields(LionCubConfig):
        if f.name == name:
            return tuple(f.metadata["choices"])
    raise KeyError(name)


# ----------------------------------------------------------------------------- options
def build_parser(prog: str | None = None, *, world_size_flag: bool = True) -> argparse.ArgumentParser:
    # a one-line usage: a mistyped flag (every rank of a torchrun launch prints it) stays two lines
    p = argparse.ArgumentParser(prog=prog, usage="%(prog)s [options] (--help lists them)",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("run")
    if world_size_flag:
        g.add_argument("--world-size", type=int, default=2, help="number of CPU ranks to spawn (gloo)")
    g.add_argument("--steps", type=int, default=300, help="optimizer steps")
    g.add_argument("--seed", type=int, default=0, help="model init and data order seed")
    g.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"),
                   help="auto: cuda:LOCAL_RANK when CUDA is available (NCCL), else cpu (gloo)")
    g.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    g.add_argument("--no-progress", action="store_true", help="no tqdm bar (log lines only; also off when stderr is not a terminal)")
    g.add_argument("--log-interval", type=int, default=50, help="steps between train-loss log lines")
    g.add_argument("--eval-interval", type=int, default=100, help="steps between validation evaluations")
    g.add_argument("--eval-iters", type=int, default=8, help="validation batches per rank per evaluation")
    g.add_argument("--min-drop", type=float, default=0.25,
                   help="fail (exit 1) unless last val loss <= first val loss - this many nats")
    g.add_argument("--json-out", default=None, help="write the run summary (JSON) to this path")

    g = p.add_argument_group("model and data")
    g.add_argument("--preset", default="demo", choices=tuple(PRESETS), help="model size")
    g.add_argument("--seq-len", type=int, default=None, help="context length (default: the preset's)")
    g.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    g.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="cap on the stdlib corpus")
    g.add_argument("--data-files", nargs="+", default=None, help="train on these text files instead")
    g.add_argument("--token-file", default=None, help="train on a raw uint8/uint16 token file (memmap)")
    g.add_argument("--token-dtype", default="uint8", choices=("uint8", "uint16"))

    g = p.add_argument_group("optimizer")
    g.add_argument("--optim", default="lioncub", choices=OPTIMIZERS,
                   help="lioncub: local momentum + 1-bit votes; lion/adamw: all-reduced gradients")
    g.add_argument("--lr", type=float, default=3e-4,
                   help="peak learning rate (the default is for the demo GPT; on your model: global Lion's tuned lr, 3-10x below "
                        "AdamW's; docs/hyperparameters.md)")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to lr * this")
    g.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    g.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.99))
    g.add_argument("--weight-decay", type=float, default=0.1, help="decoupled; not on biases/norms/embeddings")
    g.add_argument("--comm", default=None, choices=setting_choices("comm"),
                   help="LionCub vote collective (default: LionCub's, auto); int8 and bbit need --quant l1|l0|linf")
    g.add_argument("--vote", default=None, choices=setting_choices("vote"), help="LionCub vote (default: majority)")
    g.add_argument("--quant", default=None, choices=setting_choices("quant"),
                   help="LionCub quantizer (default: sign; l1/l0/linf are scaled votes for --comm int8 or bbit)")
    g.add_argument("--tie-break", default=None, choices=setting_choices("tie_break"),
                   help="LionCub even-N tie rule (default: hash)")
    g.add_argument("--momentum-sync", default=None,
                   help='LionCub momentum sync: JSON, e.g. \'{"every": 50}\', or an integer K (= every K steps)')
    g.add_argument("--optim-kwargs", default=None, help="extra LionCub keyword settings as JSON")
    return p


# ----------------------------------------------------------------------------- helpers
def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _lr_at(step: int, args) -> float:
    if args.warmup > 0 and step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    span = max(1, args.steps - args.warmup)
    frac = min(1.0, (step - args.warmup) / span)
    lo = args.lr * args.min_lr_ratio
    return lo + 0.5 * (args.lr - lo) * (1.0 + math.cos(math.pi * frac))



def lioncub_settings(args) -> dict:
    """The LionCub settings the flags give (lr, betas and weight decay included)."""
    kwargs: dict[str, Any] = {"lr": args.lr, "betas": tuple(args.betas), "weight_decay": args.weight_decay}
    for key in ("comm", "vote", "quant", "tie_break"):
        if getattr(args, key, None) is not None:
            kwargs[key] = getattr(args, key)
    ms = getattr(args, "momentum_sync", None)
    if ms is not None:
        kwargs["momentum_sync"] = {"every": int(ms)} if str(ms).strip().isdigit() else json.loads(ms)
    if getattr(args, "optim_kwargs", None):
        kwargs.update(json.loads(args.optim_kwargs))
    return kwargs


# What to add on the command line when LionCubConfig refuses a combination of the flags.
_FLAG_FIXES = {"needs a scaled quantizer": "add --quant l1 (or l0, linf)",
               "needs quant='sign'": "drop --quant, or use --comm int8 or bbit"}


def check_lioncub_flags(parser: argparse.ArgumentParser, args) -> None:
    """Validate the LionCub flags in the launching process (parser.error, exit 2), before any rank starts:
    a bad combination is one message naming the fix, not a traceback from every rank."""
    if args.optim != "lioncub":
        return
    try:
        LionCubConfig.from_kwargs(where="--optim-kwargs", **lioncub_settings(args))
    except json.JSONDecodeError as exc:
        parser.error(f"--momentum-sync / --optim-kwargs: not valid JSON ({exc})")
    except LionCubConfigError as exc:
        fix = next((f"; {fix}" for key, fix in _FLAG_FIXES.items() if key in str(exc)), "")
        parser.error(f"{exc}{fix}")


def make_optimizer(model, args):
    """The optimizer named by ``args.optim``; returns ``(optimizer, needs_grad_allreduce)``."""
    groups = model.optim_groups(args.weight_decay)
    betas = tuple(args.betas)
    if args.optim == "adamw":
        return torch.optim.AdamW(groups, lr=args.lr, betas=betas, weight_decay=args.weight_decay), True
    if args.optim == "lion":
        from lioncub_ds.lion import Lion
        return Lion(groups, lr=args.lr, betas=betas, weight_decay=args.weight_decay), True
    from lioncub_ds import LionCub
    return LionCub(groups, **lioncub_settings(args)), False


def _allreduce_grads(model, world_size: int) -> None:
    """Average gradients over ranks in one flat buffer (the DDP baseline for lion/adamw)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world_size)
    off = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[off:off + n].view_as(g))
        off += n



@torch.no_grad()
def evaluate(model, ds, args, rank, world_size, device) -> float:
    """Mean validation loss over ``eval_iters`` fixed batches per rank (each rank its own val shard)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(args.eval_iters):
        x, y = ds.get_batch("val", args.batch_size, model.cfg.seq_len, rank, world_size, step=i,
                            seed=args.seed, device=device)
        total += model(x, y)[1].double()
    total /= max(1, args.eval_iters)
    if _is_dist():
        dist.all_reduce(total)
        total /= world_size
    model.train(was_training)
    return float(total)


def _comm_last_step(opt) -> dict | None:
    fn = getattr(opt, "comm_stats", None)
    if fn is None:
        return None
    try:
        return fn().get("last_step")
    except Exception:  # noqa: BLE001 - telemetry must never break training
        return None


# ----------------------------------------------------------------------------- the loop
def train(args, rank: int = 0, world_size: int = 1, device: str | torch.device = "cpu") -> dict:
    """Train inside one rank (the process group, if any, is already initialized).

    Returns the run summary (identical keys on every rank; rank 0's is the one to report)."""
    from tqdm import tqdm

    quiet_progress_lock()  # before the first bar: no multiprocessing semaphore to leak at exit_cleanly
    device = torch.device(device)
    is_main = rank == 0
    ds = load_dataset(max_bytes=args.max_bytes, files=args.data_files, token_file=args.token_file,
                      token_dtype=args.token_dtype)
    model = build_model(args.preset, seed=args.seed, seq_len=args.seq_len, vocab=ds.vocab_size).to(device)
    if _is_dist():  # same seed gives the same init; broadcast anyway so it cannot drift
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    if args.optim == "lioncub":  # load the kernels outside the timed loop; local rank 0 builds first
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if local_rank == 0:
            _prepare_kernels(quiet=not is_main)
        if _is_dist():
            dist.barrier()
        if local_rank != 0:
            _prepare_kernels(quiet=True)
    opt, needs_allreduce = make_optimizer(model, args)
    needs_allreduce = needs_allreduce and _is_dist()
    seq_len = model.cfg.seq_len
    nparams = model.param_count()
    tokens_per_step = args.batch_size * seq_len * world_size
    ar_fp32 = 2 * (world_size - 1) * 4 * nparams // world_size if world_size > 1 else 0

    def log(msg):
        if is_main:
            tqdm.write(msg, file=sys.stdout)
            sys.stdout.flush()

    log(f"[benchmarks.demo] optim={args.optim} preset={args.preset} params={nparams / 1e6:.2f}M "
        f"world_size={world_size} device={device} data={ds.name} "
        f"(train {len(ds.train) / 1e6:.2f}M / val {len(ds.val) / 1e6:.2f}M tokens) "
        f"batch={args.batch_size}x{seq_len}/rank lr={args.lr:g} steps={args.steps}")

    t0 = time.perf_counter()
    vals = [(0, evaluate(model, ds, args, rank, world_size, device))]
    log(f"step {0:5d} | val loss {vals[0][1]:.4f}")
    show_bar = is_main and not args.no_progress and sys.stderr.isatty()
    bar = tqdm(total=args.steps, disable=not show_bar, dynamic_ncols=True, mininterval=1.0, desc="train",
               file=sys.stderr)
    loss_acc = torch.zeros(2, dtype=torch.float64, device=device)  # (sum, count) since the last log
    train_time = 0.0
    cpu_time = 0.0  # this process's CPU seconds in the steps: robust to a busy machine, unlike wall time
    sent_total, sent_steps = 0, 0
    last_train = float("nan")
    model.train()
    for step in range(args.steps):
        lr = _lr_at(step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        ts, cs = time.perf_counter(), time.process_time()
        x, y = ds.get_batch("train", args.batch_size, seq_len, rank, world_size, step=step, seed=args.seed,
                            device=device)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if needs_allreduce:
            _allreduce_grads(model, world_size)
        opt.step()
        train_time += time.perf_counter() - ts
        cpu_time += time.process_time() - cs
        loss_acc[0] += loss.detach().double()
        loss_acc[1] += 1

        last = _comm_last_step(opt)
        if last is not None:
            sent = int(last.get("bytes_sent", 0))
        else:
            sent = ar_fp32 if needs_allreduce else 0
        sent_total += sent
        sent_steps += 1

        if (step + 1) % args.log_interval == 0 or step + 1 == args.steps:
            if _is_dist():
                dist.all_reduce(loss_acc)
            last_train = float(loss_acc[0] / loss_acc[1])
            loss_acc.zero_()
            fp32 = int(last.get("fp32_allreduce_bytes", ar_fp32)) if last else ar_fp32
            ratio = f" ({fp32 / sent:.0f}x < fp32 all-reduce)" if sent and fp32 >= 1.5 * sent else ""
            if last is not None and "comm_time_s" in last:
                ratio += f" | comm {1e3 * float(last['comm_time_s']):.1f} ms"
            tps = tokens_per_step * (step + 1) / train_time
            log(f"step {step + 1:5d} | train loss {last_train:.4f} | lr {lr:.2e} | {tps:,.0f} tok/s | "
                f"sent in the last step {format_bytes(sent)}/rank{ratio}")
            bar.set_postfix_str(f"loss {last_train:.3f} {tps:,.0f} tok/s tx {format_bytes(sent)}/step{ratio}",
                                refresh=False)
        bar.update(1)
        if (step + 1) % args.eval_interval == 0 or step + 1 == args.steps:
            v = evaluate(model, ds, args, rank, world_size, device)
            vals.append((step + 1, v))
            log(f"step {step + 1:5d} | val loss {v:.4f} | train loss {last_train:.4f} | "
                f"{tokens_per_step * (step + 1) / train_time:,.0f} tok/s")
    bar.close()
    wall = time.perf_counter() - t0

    digest = param_digest(model)
    in_sync = True
    if _is_dist():
        digests = [None] * world_size
        dist.all_gather_object(digests, digest)
        in_sync = len(set(digests)) == 1
    stats = None
    fn = getattr(opt, "comm_stats", None)
    if fn is not None:
        try:
            stats = fn()
        except Exception:  # noqa: BLE001
            stats = None
    summary = {
        "optim": args.optim, "preset": args.preset, "params": nparams, "world_size": world_size,
        "steps": args.steps, "batch_size": args.batch_size, "seq_len": seq_len, "lr": args.lr,
        "first_val_loss": vals[0][1], "last_val_loss": vals[-1][1], "val_losses": vals,
        "last_train_loss": last_train, "wall_s": wall, "train_s": train_time,
        "step_s": train_time / max(1, args.steps), "cpu_s_per_step_rank0": cpu_time / max(1, args.steps),
        "tokens_per_s": tokens_per_step * args.steps / train_time if train_time else 0.0,
        "bytes_sent_per_step": sent_total / max(1, sent_steps), "fp32_allreduce_bytes_per_step": ar_fp32,
        "params_in_sync": in_sync, "param_digest": digest,
        "comm_stats": _jsonable(stats) if stats is not None else None,
    }
    if is_main:
        print(f"[benchmarks.demo] done in {wall:.1f} s | val loss {summary['first_val_loss']:.4f} -> "
              f"{summary['last_val_loss']:.4f} | {summary['tokens_per_s']:,.0f} tok/s | "
              f"{summary['step_s']:.3f} s/step (rank 0 CPU {summary['cpu_s_per_step_rank0']:.3f} s/step) | "
              f"sent, mean of {args.steps} steps incl. momentum syncs: "
              f"{format_bytes(summary['bytes_sent_per_step'])}/step/rank (fp32 gradient all-reduce: "
              f"{format_bytes(ar_fp32)}) | params in sync across ranks: "
              f"{'yes' if in_sync else 'NO'}", flush=True)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(summary, f, indent=1)
    return summary


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    return str(obj)


def check_summary(summary: dict, min_drop: float) -> int:
    """Exit status for a finished run (see module doc)."""
    if not summary.get("params_in_sync", True):
        print("[benchmarks.demo] FAIL: parameters differ across ranks", file=sys.stderr)
        return 2
    first, last = summary["first_val_loss"], summary["last_val_loss"]
    if not (math.isfinite(last) and last <= first - min_drop):
        print(f"[benchmarks.demo] FAIL: val loss did not go down by {min_drop} nats "
              f"({first:.4f} -> {last:.4f})", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------- launching
def _setup_threads(n: int) -> None:
    torch.set_num_threads(max(1, n))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set (e.g. after a parallel region ran)


def _worker(rank: int, world_size: int, port: int, args, out_path: str) -> None:
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    _setup_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        summary = train(args, rank, world_size, "cpu")
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(summary, f)
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_cleanly(0)  # the work is done and written (see groups.exit_cleanly)


def _prepare_kernels(quiet: bool = False) -> None:
    """Load (JIT-building once, then cached) the CPU kernels before the ranks start, so they don't race."""
    try:
        from lioncub_ds import kernels
        t = time.perf_counter()
        name = kernels.active_backend_name("cpu")
        dt = time.perf_counter() - t
        if dt > 2.0 and not quiet:
            print(f"[benchmarks.demo] prepared the '{name}' CPU kernels in {dt:.0f} s (cached for later runs)",
                  flush=True)
    except Exception as exc:  # noqa: BLE001 - the ranks will report it themselves
        print(f"[benchmarks.demo] kernel loader: {type(exc).__name__}: {exc}", file=sys.stderr)


def launch(args) -> dict:
    """Run ``train`` on ``args.world_size`` CPU ranks spawned on this machine; returns rank 0's summary."""
    if args.world_size < 1:
        raise ValueError(f"--world-size={args.world_size} must be >= 1")
    # Build (or load) the corpus cache once, before the ranks race to do it.
    load_dataset(max_bytes=args.max_bytes, files=args.data_files, token_file=args.token_file,
                 token_dtype=args.token_dtype)
    if args.optim == "lioncub":
        _prepare_kernels()
    if args.world_size == 1:
        _setup_threads(args.threads)
        return train(args, 0, 1, "cpu")
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the spawned ranks inherit it before importing torch
    fd, out_path = tempfile.mkstemp(prefix="lioncub_demo_", suffix=".json")
    os.close(fd)
    try:
        mp.start_processes(_worker, args=(args.world_size, free_port(), args, out_path), nprocs=args.world_size,
                           join=True, start_method="spawn")
        with open(out_path) as f:
            summary = json.load(f)
    finally:
        os.unlink(out_path)
    return summary


def main(argv=None) -> int:
    parser = build_parser("python -m benchmarks.demo")
    args = parser.parse_args(argv)
    check_lioncub_flags(parser, args)
    if args.device != "cpu":
        print("[benchmarks.demo] the demo spawns CPU ranks; use examples/pretrain_gpt.py (torchrun) for CUDA",
              file=sys.stderr)
        return 2
    summary = launch(args)
    return check_summary(summary, args.min_drop)


if __name__ == "__main__":
    sys.exit(main())
