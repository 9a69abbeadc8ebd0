"""Pretrain the small GPT with FSDP2 sharding inside groups and Lion Cub votes across them (HSDP + votes).

    # 4 CPU ranks (gloo) as 2 "nodes" of 2: FSDP2 shards inside each pair, the pairs vote
    torchrun --nproc_per_node 4 examples/pretrain_gpt_fsdp2.py --shard-size 2 --preset tiny --steps 30
    ... --bf16                       # FSDP2 MixedPrecisionPolicy: bf16 all-gathers and reduce-scatters
    ... --save-dir runs/fsdp2        # torch.distributed.checkpoint at the end (and every --save-interval)
    ... --resume                     # continue from --save-dir, bit-exactly

    # 2 nodes x 8 GPUs: one shard group per node (the default --shard-size is LOCAL_WORLD_SIZE)
    torchrun --nnodes 2 --nproc_per_node 8 ... examples/pretrain_gpt_fsdp2.py --preset bench20m --steps 5000

Every block of the GPT and the root are ``fully_shard``-ed on the shard group's 1-D mesh
(:func:`lioncub_ds.fsdp.shard_and_vote`): FSDP2 all-gathers parameters and reduce-scatters
gradients inside the group (the fast link); LionCub steps each rank's shard and votes with the
same shard of the other groups (the slow link). Logged (rank 0): train loss (mean over ranks),
and the bytes this rank sent between groups in the step (LionCub's telemetry: votes and control
flags) against what FSDP2's own HSDP all-reduce of the same gradient shards would send there (the
ring formula 2(Nn-1)/Nn x the padded shard bytes, in FSDP2's reduce dtype). Exit status: 0 ok;
1 the validation loss did not drop by --min-drop; 2 a refused setting or checkpoint (one line
from rank 0), or shard replicas that differ across groups.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

# the checkout's root: the workshop (``benchmarks``: the GPT, the data) is not in the wheel
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.data import DEFAULT_MAX_BYTES, load_dataset  # noqa: E402
from benchmarks.models import PRESETS, build_model  # noqa: E402
from benchmarks.models.gpt import Block  # noqa: E402
from lioncub_ds.config import LionCubConfigError  # noqa: E402
from lioncub_ds.errors import ReplicaDriftError  # noqa: E402
from lioncub_ds.fsdp import element_start, load, save, shard_and_vote  # noqa: E402
from lioncub_ds.groups import exit_cleanly  # noqa: E402
from lioncub_ds.telemetry import format_bytes, ring_bytes  # noqa: E402

PREFIX = "[fsdp2]"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shard-size", type=int, default=None,
                   help="ranks per shard group (FSDP2 shards inside it; the groups vote); default LOCAL_WORLD_SIZE")
    p.add_argument("--preset", default="tiny", choices=tuple(PRESETS), help="GPT size")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.99))
    p.add_argument("--comm", default="1bit", help="LionCub's vote collective (1bit, allgather, pbit, int8, auto)")
    p.add_argument("--clip", type=float, default=1.0, help="clip each group's mean gradient to this norm (0: off)")
    p.add_argument("--bf16", action="store_true", help="MixedPrecisionPolicy(param_dtype=bf16), fp32 shards")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="cap on the bundled stdlib corpus")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--eval-iters", type=int, default=4)
    p.add_argument("--save-dir", default=None, help="torch.distributed.checkpoint directory")
    p.add_argument("--save-interval", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from --save-dir")
    p.add_argument("--min-drop", type=float, default=0.0, help="exit 1 unless the val loss drops by this much")
    args = p.parse_args(argv)
    if args.resume and not args.save_dir:
        p.error("--resume needs --save-dir")
    return args


def hsdp_allreduce_bytes(opt, reduce_bytes: int) -> int:
    """What FSDP2's HSDP all-reduce would send per step and rank between the groups: its ring
    all-reduce over the Nn replicas of this rank's padded gradient shards (FSDP2 pads dim 0 to
    ceil(d0 / L) rows on every rank), ``reduce_bytes`` per element."""
    sg = opt.fsdp_shard_groups
    # shard 0 is never short: its rows are the padded rows of every rank
    numel = sum(element_start(p.shape, 0, sg.shard_size)[1] * (p.numel() // max(1, p.shape[0]))
                for _, p, _ in opt.sharded_params)
    return ring_bytes("all_reduce", numel * reduce_bytes, sg.groups)


@torch.no_grad()
def evaluate(model, ds, args, seq_len, rank, world) -> float:
    total = torch.zeros((), dtype=torch.float64)
    for i in range(args.eval_iters):
        x, y = ds.get_batch("val", args.batch_size, seq_len, rank, world, step=i, seed=args.seed)
        total += model(x, y)[1].double()
    dist.all_reduce(total)  # logging only (a float over the world, once per evaluation)
    return float(total) / (args.eval_iters * world)


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank, world = dist.get_rank(), dist.get_world_size()

    def log(msg):
        if rank == 0:
            print(f"{PREFIX} {msg}", flush=True)

    ds = load_dataset(max_bytes=args.max_bytes) if rank == 0 else None
    dist.barrier()  # rank 0 builds the corpus cache; the others read it
    ds = ds or load_dataset(max_bytes=args.max_bytes)
    model = build_model(args.preset, seed=args.seed, vocab=ds.vocab_size)
    seq_len, nparams = model.cfg.seq_len, model.param_count()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    groups = model.optim_groups(args.weight_decay)  # no decay on biases, norms, embeddings
    start = 0
    try:  # a refusal is the same on every rank: one line from rank 0
        model, opt = shard_and_vote(model, args.shard_size, modules=Block, params=groups,
                                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16) if args.bf16 else None,
                                    lr=args.lr, betas=tuple(args.betas), weight_decay=args.weight_decay,
                                    comm=args.comm)
        if args.resume:
            load(args.save_dir, model, opt)  # another shard size: refused before anything loads
            start = opt.step_count + opt.comm_stats()["skipped_steps"]
            log(f"resumed from {args.save_dir} at step {start}")
    except LionCubConfigError as exc:
        log(f"refused: {exc}")
        dist.barrier()  # rank 0 has said why before any rank exits (torchrun then stops the others)
        dist.destroy_process_group()
        return 2
    sg = opt.fsdp_shard_groups
    hsdp = hsdp_allreduce_bytes(opt, 2 if args.bf16 else 4)
    log(f"preset={args.preset} params={nparams / 1e6:.2f}M ranks={world} = {sg.groups} shard groups x "
        f"{sg.shard_size} | LionCub comm={args.comm} | {'bf16 mixed precision' if args.bf16 else 'fp32'} | "
        f"batch {args.batch_size}x{seq_len}/rank")
    first_val = evaluate(model, ds, args, seq_len, rank, world)
    log(f"step {start:5d} | val loss {first_val:.4f}")
    loss_sum, loss_n, inter_total = torch.zeros((), dtype=torch.float64), 0, 0
    for step in range(start, args.steps):
        x, y = ds.get_batch("train", args.batch_size, seq_len, rank, world, step=step, seed=args.seed)
        _, loss = model(x, y)
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # each group's own mean gradient
        opt.step()
        opt.zero_grad()
        loss_sum += loss.detach().double()
        loss_n += 1
        last = opt.comm_stats()["last_step"]["by_scope"]
        inter = int(last.get("inter_node", 0))
        inter_total += inter
        done = step + 1
        if done % args.log_interval == 0 or done == args.steps:
            dist.all_reduce(loss_sum)  # logging only
            train_loss = float(loss_sum) / (loss_n * world)
            loss_sum.zero_()
            loss_n = 0
            between = (f"between groups {format_bytes(inter)}/rank vs FSDP2 HSDP all-reduce {format_bytes(hsdp)}"
                       f" ({hsdp / inter:.0f}x less)" if inter else
                       "between groups: none (one shard group: no votes)")
            log(f"step {done:5d} | train loss {train_loss:.4f} | {between} | "
                f"inside a group (LionCub's flags) {format_bytes(int(last.get('intra_node', 0)))}/rank")
        if args.save_dir and ((args.save_interval and done % args.save_interval == 0) or done == args.steps):
            save(args.save_dir, model, opt)
            log(f"saved {args.save_dir} at step {done}")
    last_val = evaluate(model, ds, args, seq_len, rank, world)
    try:  # every shard's checksum against its peers' (integers across groups)
        in_sync = opt.check_replicas("raise")
    except ReplicaDriftError as exc:
        log(str(exc))
        in_sync = False
    ran = max(1, args.steps - start)
    log(f"done | val loss {first_val:.4f} -> {last_val:.4f} | between groups, mean {format_bytes(inter_total / ran)}"
        f"/step/rank vs FSDP2 HSDP all-reduce {format_bytes(hsdp)} | shard replicas identical across groups: "
        f"{'yes' if in_sync else 'NO'}")
    dist.destroy_process_group()
    if not in_sync:
        return 2
    return 0 if last_val <= first_val - args.min_drop else 1


if __name__ == "__main__":
    exit_cleanly(main())
