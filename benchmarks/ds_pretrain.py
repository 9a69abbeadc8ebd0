"""Pretrain the small GPT with DeepSpeed and Lion Cub, driven by the ``deepspeed`` launcher.

In the workshop beside the package, not in the wheel (``python -m benchmarks.ds_demo`` launches this file by
path); ``examples/pretrain_gpt_deepspeed.py`` runs the same ``main``.

    # 2 CPU ranks (gloo), the bundled real text (CPython's standard library source, byte level):
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_accelerators 2 examples/pretrain_gpt_deepspeed.py \\
        --deepspeed_config configs/ds_cpu_demo.json --steps 200

    # 8 GPUs, bf16, Lion Cub at ZeRO stage 0 (no gradient all-reduce, 1-bit votes):
    deepspeed --num_gpus 8 examples/pretrain_gpt_deepspeed.py --deepspeed_config configs/ds_gpt_bf16_stage0.json \\
        --preset bench20m --steps 5000 --save-dir runs/gpt --save-interval 500
    ... --resume                 # continue from <save-dir>/latest, bit-identically
    ... --baseline               # plain Lion + DeepSpeed's gradient all-reduce (the comparison run)
    ... --data-files a.txt b.txt # your own text (byte level) | --token-file tokens.u16 --token-dtype uint16

Everything LionCub-specific is in the ds_config ("optimizer": {"type": "LionCub", ...});
this script is an ordinary DeepSpeed training loop (the GPT model and the data loader come from
``benchmarks``; it imports lioncub_ds for the registration and the wire-byte telemetry).
``--steps N`` fits the config's WarmupDecayLR / WarmupCosineLR schedule to N steps (see :func:`fit_schedule`).
The Hugging Face template (``configs/ds_hf_lioncub.json``: "auto" values) is refused with a message.

Logged every --log-interval steps (rank 0): train loss (mean over ranks), lr, tokens/s, and the
bytes each rank sent in the LAST optimizer step for the optimizer's communication; the done line
gives the MEAN over the run (momentum syncs included, which the last step may not have). Lion Cub:
measured by its telemetry (votes + control flags + momentum syncs; ZeRO-1/2: the sign all-gather),
against DeepSpeed's gradient all-reduce by the ring formula 2(N-1)/N x gradient bytes. Node voters
(``"voters": "node"``): the inter-node bytes (votes and syncs between the node groups), against
the inter-node share of a two-level all-reduce (reduce-scatter in the node, all-reduce of each
1/L shard across the Nn groups: 2(Nn-1)/Nn x gradient bytes / L), and the intra-node bytes apart.
``--json-out`` writes the run summary (rank 0). Exit status: 0 ok; 1 the validation loss
did not drop by --min-drop; 2 the parameters differ across ranks.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import fields

import torch
import torch.distributed as dist

# run by path (the deepspeed launcher): the checkout's root, for ``benchmarks`` (the workshop is not in the wheel)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402

import lioncub_ds.deepspeed as lds  # noqa: E402  (registers "type": "LionCub"; also done lazily by the .pth hook)
from lioncub_ds import Lion  # noqa: E402
from benchmarks.data import DEFAULT_MAX_BYTES, load_dataset  # noqa: E402
from lioncub_ds.config import LionCubConfig, LionCubConfigError  # noqa: E402
from lioncub_ds.deepspeed.engine import ZERO_ALLGATHER_MODES  # noqa: E402
from lioncub_ds.groups import exit_cleanly  # noqa: E402,F401  (also the examples' exit)
from benchmarks.common import quiet_progress_lock  # noqa: E402
from benchmarks.models import PRESETS, build_model  # noqa: E402
from benchmarks.models.gpt import param_digest  # noqa: E402
from lioncub_ds.telemetry import format_bytes, ring_bytes  # noqa: E402

PREFIX = "[pretrain]"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--preset", default="demo", choices=tuple(PRESETS), help="GPT size")
    p.add_argument("--seq-len", type=int, default=None, help="context length (default: the preset's)")
    p.add_argument("--steps", type=int, default=200,
                   help="optimizer steps; the config's WarmupDecayLR or WarmupCosineLR schedule is fitted to them: "
                        "total_num_steps becomes --steps and warmup_num_steps is scaled by --steps / total_num_steps "
                        "(at least 1); other schedulers run as the config has them")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    p.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="cap on the bundled stdlib corpus")
    p.add_argument("--data-files", nargs="+", default=None, help="train on these text files (byte level)")
    p.add_argument("--token-file", default=None, help="a raw uint8/uint16 token file (memory-mapped)")
    p.add_argument("--token-dtype", default="uint8", choices=("uint8", "uint16"))
    p.add_argument("--log-interval", type=int, default=20)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--eval-iters", type=int, default=4, help="validation batches per rank per evaluation")
    p.add_argument("--save-dir", default=None, help="checkpoint directory (engine.save_checkpoint)")
    p.add_argument("--save-interval", type=int, default=0, help="checkpoint every K steps (0: only at the end "
                   "when --save-dir is given)")
    p.add_argument("--resume", action="store_true", help="continue from <save-dir>/latest")
    p.add_argument("--baseline", action="store_true",
                   help="plain Lion (lioncub_ds.Lion) with DeepSpeed's normal gradient all-reduce")
    p.add_argument("--min-drop", type=float, default=0.0, help="exit 1 unless val loss drops by this much")
    p.add_argument("--json-out", default=None, help="write the run summary here (rank 0)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args(argv)
    if not args.deepspeed_config:
        p.error("--deepspeed_config is required")
    if args.steps < 1:
        p.error(f"--steps {args.steps}: must be >= 1")
    return args


# DeepSpeed's schedulers with a length in steps: the total, then the lengths inside it (scaled alike).
SCHEDULE_LENGTHS = {"WarmupDecayLR": ("total_num_steps", ("warmup_num_steps",)),
                    "WarmupCosineLR": ("total_num_steps", ("warmup_num_steps",))}
DEEPSPEED_DEFAULT_WARMUP = 1000  # both schedulers' default warmup_num_steps


def fit_schedule(cfg: dict, steps: int) -> str | None:
    """Fit the ds_config's learning-rate schedule to ``steps`` optimizer steps (in place).

    WarmupDecayLR and WarmupCosineLR: ``total_num_steps`` becomes ``steps`` and ``warmup_num_steps``
    is scaled by steps / total_num_steps (at least 1, at most ``steps``), so that the run ends where
    the config's schedule ends (decayed) instead of inside its warm-up. Returns a line to log, or
    None when the config has no scheduler."""
    sched = cfg.get("scheduler")
    if not sched:
        return None
    kind = sched.get("type")
    if kind not in SCHEDULE_LENGTHS:
        return (f"--steps {steps} leaves the {kind} scheduler as the config has it (only "
                f"{' and '.join(SCHEDULE_LENGTHS)} have a total length to fit)")
    total_key, inner = SCHEDULE_LENGTHS[kind]
    sp = sched.setdefault("params", {})
    total = int(sp[total_key])
    before = {k: int(sp.get(k, DEEPSPEED_DEFAULT_WARMUP)) for k in inner}
    sp[total_key] = steps
    for key, value in before.items():
        sp[key] = min(steps, max(1, round(value * steps / max(1, total))))
    fitted = ", ".join(f"{k} {before[k]} -> {sp[k]}" for k in inner)
    return f"--steps {steps}: {kind} fitted to the run ({total_key} {total} -> {steps}, {fitted})"


def hf_placeholders(cfg: dict) -> list[str]:
    """The keys whose value is the Hugging Face Trainer's "auto" placeholder (filled from its
    TrainingArguments), leaving out the LionCub settings for which "auto" is a value of their own."""
    own_auto = {f.name for f in fields(LionCubConfig) if "auto" in (f.metadata["choices"] or ())}
    if "auto" in ZERO_ALLGATHER_MODES:
        own_auto.add("zero_allgather")
    found = []

    def walk(node, path):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, path + (key,))
        elif isinstance(node, str) and node == "auto" and not (path[:2] == ("optimizer", "params")
                                                               and path[-1] in own_auto):
            found.append(".".join(path))
    walk(cfg, ())
    return found


def read_config(path: str) -> dict:
    """The ds_config, refused with one message (no traceback) when it is the HF Trainer's template."""
    with open(path) as f:
        cfg = json.load(f)
    auto = hf_placeholders(cfg)
    if auto:
        raise SystemExit(
            f"{path} is a template for the Hugging Face Trainer: {', '.join(auto)} "
            f"{'is' if len(auto) == 1 else 'are'} \"auto\", which only the HF Trainer fills in (from its "
            "TrainingArguments). This script needs numbers there: use e.g. configs/ds_cpu_demo.json or "
            "configs/ds_lioncub_recommended.json, or run the template with an HF script "
            "(examples/hf_trainer_lioncub.py; docs/deepspeed.md, \"Hugging Face Trainer\").")
    opt = cfg.get("optimizer") or {}
    if isinstance(opt, dict) and lds.engine.is_lioncub_name(opt.get("type")):
        try:  # the settings, checked here too: a typo is one line from rank 0, not a traceback per rank
            lds.engine.split_params(opt.get("params"))
        except LionCubConfigError as exc:
            raise SystemExit(f"{path}: {exc}") from None
    return cfg


def load_config(args, cfg: dict):
    """(the ds_config to run, the optimizer params); fits the schedule to ``--steps`` (returns its note too)."""
    note = fit_schedule(cfg, args.steps)
    if args.baseline:
        opt = cfg.pop("optimizer", {"params": {}})
        if opt.get("type", "LionCub").replace("_", "").lower() != "lioncub":
            raise SystemExit(f"--baseline replaces a LionCub optimizer; the config has {opt.get('type')!r}")
        if cfg.get("zero_optimization", {}).get("stage", 0) > 0:
            cfg["zero_allow_untested_optimizer"] = True  # plain Lion is not on DeepSpeed's ZeRO list
        return cfg, opt.get("params", {}), note
    return cfg, cfg.get("optimizer", {}).get("params", {}), note


def grad_bytes_per_element(engine) -> int:
    if engine.bfloat16_enabled() or engine.fp16_enabled():
        return 2
    return 4


def prepare_kernels(device_type: str, rank: int) -> tuple[float, str]:
    """Load the fused kernels (LionCub's and lioncub_ds.Lion's) before the timed loop; local rank 0 first.

    Returns this rank's seconds and what it loaded: ``"prebuilt"`` (the module ``make setup`` built),
    ``"jit"`` (JIT-built now, or taken from the JIT cache) or the backend's name when not native."""
    from lioncub_ds import kernels
    from lioncub_ds.kernels import loader
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    t0 = time.perf_counter()
    if local_rank == 0:
        be = kernels.backend_for(device_type)
        took = time.perf_counter() - t0
    dist.barrier()
    if local_rank != 0:
        be = kernels.backend_for(device_type)
        took = time.perf_counter() - t0
    return took, (loader.origin(be.name) if be.name in ("cpp", "cuda") else None) or be.name



def ratio_text(sent: float, baseline: float, baseline_name: str) -> str:
    """'(32x less than the fp32 gradient all-reduce)'; honest when it is not less."""
    if not baseline or not sent:
        return ""
    r = baseline / sent
    if r >= 1.05:
        return f" ({r:.0f}x less than {baseline_name})" if r >= 10 else f" ({r:.1f}x less than {baseline_name})"
    return f" ({sent / baseline:.2f}x the bytes of {baseline_name})"


class SentBytes:
    """What this rank's optimizer sends per step, and the baseline it is compared with.

    ``last()`` labels the last optimizer step's bytes (a step with or without a momentum sync);
    ``mean()`` the mean over the run, momentum syncs included. Node voters: the inter-node bytes
    (``by_scope["inter_node"]``: votes and syncs between node groups) against the inter-node share of
    a two-level all-reduce, and the intra-node bytes (reduce-scatter / all-gather) apart."""

    def __init__(self, grad_bytes: int, world_size: int, *, dtype: str = "fp32", baseline_run: bool = False,
                 local_momentum: bool = True, nodes: tuple[int, int] | None = None):
        """``grad_bytes``: the model's gradient bytes; ``local_momentum``: LionCub at ZeRO stage 0 (votes
        instead of the gradient all-reduce); ``nodes``: (Nn node groups, L ranks each) for node voters."""
        self.grad_allreduce = ring_bytes("all_reduce", grad_bytes, world_size)
        self.baseline_run = baseline_run
        self.local_momentum = local_momentum and not baseline_run
        self.name = f"the {dtype} gradient all-reduce"
        self.nodes = nodes
        if nodes is not None:
            voters, size = nodes
            self.inter_baseline = ring_bytes("all_reduce", grad_bytes // size, voters)
            self.inter_name = f"a two-level {dtype} all-reduce's inter-node bytes"
        self.steps, self.total, self.inter, self.intra = 0, 0, 0, 0
        self.last_total = self.last_inter = self.last_intra = 0

    @classmethod
    def for_engine(cls, engine, baseline_run: bool, world_size: int, nparams: int) -> "SentBytes":
        per_elem = grad_bytes_per_element(engine)
        mode = None if baseline_run else engine.lioncub.mode
        local_momentum = mode in ("local_momentum", "zero3_votes")
        opt = None if baseline_run else lds.lioncub_of(engine)
        nodes = None
        if mode == "zero3_votes":  # ZeRO-3 inside each node group, votes across: Nn groups x L ranks
            sg = engine.lioncub.optimizer.shard_groups
            nodes = (sg.groups, sg.shard_size)
        elif local_momentum and opt.config.voters == "node" and opt.distributed and opt.topology.node_size > 1:
            nodes = (opt.topology.world_size, opt.topology.node_size)  # Nn node groups x L ranks
        return cls(per_elem * nparams, world_size, dtype="fp32" if per_elem == 4 else "16-bit",
                   baseline_run=baseline_run, local_momentum=local_momentum, nodes=nodes)

    def record(self, stats: dict) -> None:
        if self.baseline_run:
            total, scope = self.grad_allreduce, {}
        else:
            last = stats.get("last_step", {})
            total, scope = int(last.get("bytes_sent", 0)), last.get("by_scope", {})
        self.last_total, self.last_inter, self.last_intra = (total, int(scope.get("inter_node", 0)),
                                                             int(scope.get("intra_node", 0)))
        self.steps += 1
        self.total += self.last_total
        self.inter += self.last_inter
        self.intra += self.last_intra

    def _text(self, total: float, inter: float, intra: float, what: str) -> str:
        if self.nodes is not None:
            voters, size = self.nodes
            if voters == 1:
                head = f"inter-node: none (one node group of {size} ranks: no votes cross nodes)"
            else:
                head = (f"inter-node {format_bytes(inter)}{what}"
                        f"{ratio_text(inter, self.inter_baseline, self.inter_name)}")
            groups = f"{voters} node group{'s' if voters > 1 else ''} x {size} ranks"
            return f"{head}; intra-node {format_bytes(intra)}{what} ({groups})"
        if self.baseline_run:
            return f"{format_bytes(total)}{what} ({self.name}, by the ring formula)"
        ratio = ratio_text(total, self.grad_allreduce, self.name) if self.local_momentum else ""
        return f"{format_bytes(total)}{what}{ratio}"

    def last(self) -> str:
        return "sent in the last step: " + self._text(self.last_total, self.last_inter, self.last_intra, "/rank")

    def mean(self) -> str:
        n = max(1, self.steps)
        return (f"sent, mean of {self.steps} steps incl. momentum syncs: "
                + self._text(self.total / n, self.inter / n, self.intra / n, "/step/rank"))

    def summary(self) -> dict:
        n = max(1, self.steps)
        out = {"bytes_sent_per_step": self.total / n, "ring_allreduce_bytes_per_step": self.grad_allreduce}
        if self.nodes is not None:
            out.update(node_groups=self.nodes[0], node_size=self.nodes[1], inter_node_bytes_per_step=self.inter / n,
                       intra_node_bytes_per_step=self.intra / n, two_level_inter_node_bytes=self.inter_baseline)
        return out


@torch.no_grad()
def evaluate(engine, ds, args, seq_len, rank, world_size) -> float:
    model = engine.module
    was = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=engine.device)
    for i in range(args.eval_iters):
        x, y = ds.get_batch("val", engine.train_micro_batch_size_per_gpu(), seq_len, rank, world_size, step=i,
                            seed=args.seed, device=engine.device)
        total += model(x, y)[1].double()
    total /= max(1, args.eval_iters)
    if world_size > 1:
        dist.all_reduce(total)
        total /= world_size
    model.train(was)
    return float(total)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = read_config(args.deepspeed_config)  # before any process group: a refusal is one message
    except SystemExit as exc:
        if int(os.environ.get("RANK", "0")) != 0:
            raise SystemExit(2) from None  # rank 0 says why
        raise SystemExit(f"{PREFIX} {exc}") from None
    torch.set_num_threads(max(1, args.threads))
    deepspeed.init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0

    def log(msg):
        if is_main:
            print(f"{PREFIX} {msg}", flush=True)

    cfg, opt_params, schedule_note = load_config(args, cfg)
    if schedule_note:
        log(schedule_note)
    # Rank 0 builds the corpus cache first; the others then read it.
    if is_main:
        ds = load_dataset(max_bytes=args.max_bytes, files=args.data_files, token_file=args.token_file,
                          token_dtype=args.token_dtype)
    dist.barrier()
    if not is_main:
        ds = load_dataset(max_bytes=args.max_bytes, files=args.data_files, token_file=args.token_file,
                          token_dtype=args.token_dtype)
    model = build_model(args.preset, seed=args.seed, seq_len=args.seq_len, vocab=ds.vocab_size)
    seq_len = model.cfg.seq_len
    nparams = model.param_count()
    weight_decay = float(opt_params.get("weight_decay", 0.0))
    groups = model.optim_groups(weight_decay)  # no decay on biases, norms, embeddings
    if args.baseline:
        lion = Lion([{k: v for k, v in g.items() if k != "names"} for g in groups], lr=opt_params.get("lr", 1e-4),
                    betas=tuple(opt_params.get("betas", (0.9, 0.99))), weight_decay=weight_decay)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=lion, config=cfg)
    else:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    wiring = getattr(engine, "lioncub", None)
    if not args.baseline and wiring is None:
        raise SystemExit(f"{args.deepspeed_config}: the optimizer is not LionCub (use --baseline for plain Lion)")
    mode = "baseline: Lion + gradient all-reduce" if args.baseline else f"LionCub ({wiring.mode})"
    # Both runs: LionCub's step and lioncub_ds.Lion's fused step use the same kernels.
    kernel_s, kernel_origin = prepare_kernels(engine.device.type, rank)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    tokens_per_step = micro * gas * seq_len * world_size
    sent = SentBytes.for_engine(engine, args.baseline, world_size, nparams)

    start = 0
    if args.resume:
        if not args.save_dir:
            raise SystemExit("--resume needs --save-dir")
        path, client = engine.load_checkpoint(args.save_dir)
        if path is None:
            raise SystemExit(f"--resume: no checkpoint found in {args.save_dir}")
        start = int((client or {}).get("step", engine.global_steps))
        log(f"resumed from {path} at step {start}")
    log(f"{mode} | preset={args.preset} params={nparams / 1e6:.2f}M world_size={world_size} "
        f"device={engine.device} data={ds.name} batch={micro}x{gas}x{seq_len}/rank steps={args.steps}")

    from tqdm import tqdm
    quiet_progress_lock()
    show_bar = is_main and not args.no_progress and sys.stderr.isatty()
    bar = tqdm(total=args.steps, initial=start, disable=not show_bar, dynamic_ncols=True, mininterval=1.0,
               desc="train", file=sys.stderr)
    vals = [(start, evaluate(engine, ds, args, seq_len, rank, world_size))]
    log(f"step {start:5d} | val loss {vals[0][1]:.4f}")
    loss_acc = torch.zeros(2, dtype=torch.float64, device=engine.device)
    train_time, t_wall = 0.0, time.perf_counter()
    last_train = float("nan")
    stats, lrs = {}, []
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        for m in range(gas):
            x, y = ds.get_batch("train", micro, seq_len, rank, world_size, step=step * gas + m, seed=args.seed,
                                device=engine.device)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            loss_acc[0] += loss.detach().double()
            loss_acc[1] += 1
        train_time += time.perf_counter() - t0
        if not args.baseline:
            stats = lds.comm_stats(engine)
        sent.record(stats)
        done = step + 1
        if done % args.log_interval == 0 or done == args.steps:
            if world_size > 1:
                dist.all_reduce(loss_acc)
            last_train = float(loss_acc[0] / loss_acc[1])
            loss_acc.zero_()
            tps = tokens_per_step * (done - start) / max(train_time, 1e-9)
            lr = engine.get_lr()[0]
            lrs.append((done, lr))
            log(f"step {done:5d} | train loss {last_train:.4f} | lr {lr:.2e} | {tps:,.0f} tok/s | {sent.last()}")
            bar.set_postfix_str(f"loss {last_train:.3f} | {tps:,.0f} tok/s | {format_bytes(sent.last_total)}/step",
                                refresh=False)
        bar.update(1)
        if done % args.eval_interval == 0 or done == args.steps:
            vals.append((done, evaluate(engine, ds, args, seq_len, rank, world_size)))
            log(f"step {done:5d} | val loss {vals[-1][1]:.4f}")
        if args.save_dir and ((args.save_interval and done % args.save_interval == 0) or done == args.steps):
            engine.save_checkpoint(args.save_dir, tag=f"step{done}", client_state={"step": done})
            log(f"saved checkpoint {args.save_dir}/step{done}")
    bar.close()
    digests = [None] * world_size
    if engine.zero_optimization_stage() == 3:  # ZeRO-3 keeps only partitions: gather them to compare replicas
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            mine = param_digest(engine.module)
    else:
        mine = param_digest(engine.module)
    dist.all_gather_object(digests, mine)
    in_sync = len(set(digests)) == 1
    steps_run = max(1, args.steps - start)
    summary = {
        "mode": "baseline" if args.baseline else "lioncub", "engine_mode": mode, "preset": args.preset,
        "params": nparams, "world_size": world_size, "steps": args.steps, "start_step": start,
        "zero_stage": engine.zero_optimization_stage(), "tokens_per_step": tokens_per_step,
        "first_val_loss": vals[0][1], "last_val_loss": vals[-1][1], "val_losses": vals, "last_train_loss": last_train,
        **sent.summary(), "lrs": lrs, "scheduler": cfg.get("scheduler"),
        "tokens_per_s": tokens_per_step * steps_run / max(train_time, 1e-9), "train_s": train_time,
        "wall_s": time.perf_counter() - t_wall, "skipped_steps": int(engine.skipped_steps),
        "params_in_sync": in_sync, "param_digest": digests[0],
        "kernel_load_s": kernel_s, "kernel_origin": kernel_origin,
        "comm_stats": json.loads(json.dumps(stats, default=str)) if stats else None,
    }
    log(f"done | val loss {summary['first_val_loss']:.4f} -> {summary['last_val_loss']:.4f} | "
        f"{summary['tokens_per_s']:,.0f} tok/s | {sent.mean()} | params in sync: {'yes' if in_sync else 'NO'}")
    if is_main and args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=1)
    if not in_sync:
        return 2
    if not (math.isfinite(summary["last_val_loss"]) and
            summary["last_val_loss"] <= summary["first_val_loss"] - args.min_drop):
        return 1
    return 0


if __name__ == "__main__":
    exit_cleanly(main())
