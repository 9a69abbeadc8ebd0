"""Megatron-core GPT pretraining with Lion Cub (local momentum, 1-bit votes over data-parallel ranks).

GPU (one node, 8 GPUs, TP=2 -> 4 data-parallel ranks vote; bf16 by default on GPU):

    torchrun --nproc_per_node 8 examples/pretrain_gpt_megatron.py \\
        --tensor-model-parallel-size 2 --train-iters 2000 --data stdlib \\
        --lioncub-comm 1bit --lioncub-momentum-sync-every 100

Several nodes: ``examples/launch_megatron_multinode.sh`` (two-level momentum sync: inside
each node every K steps, across nodes every K').

CPU (gloo, fp32). Megatron's DDP, optimizer wrappers and attention hard-code CUDA, so on a
CPU-only machine pass ``--cpu-shim``: it imports the TEST-ONLY shim
``lioncub_ds.testing.megatron_cpu_shim`` (it redirects megatron's torch.cuda calls to the CPU).
Never use it for GPU training:

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/pretrain_gpt_megatron.py --cpu-shim \\
        --tensor-model-parallel-size 2 --train-iters 60 --data mock

This script drives megatron-core directly. To run Megatron-LM's own ``pretrain_gpt.py`` with
LionCub instead, use ``python -m lioncub_ds.megatron.run pretrain_gpt.py ...`` (docs/megatron.md).

What it shows: a megatron-core ``GPTModel`` (local layer spec, optional MoE experts), Megatron
DDP with its data-parallel gradient reduction switched off, LionCub built by
``lioncub_ds.megatron.get_megatron_lioncub_optimizer`` from an ``OptimizerConfig`` (Megatron's
param groups, wrappers, ``OptimizerParamScheduler``, grad clipping), Megatron's
forward/backward schedules (pipeline parallel included), dist-checkpointing with per-rank
LionCub momenta (``--save`` / ``--load``), and the LionCub wire bytes per step next to what an
fp32 / bf16 gradient all-reduce would send. ``--optimizer adam`` runs Megatron's own Adam with
all-reduced gradients on the same model and data (a baseline).

Data: ``--data mock`` (synthetic but learnable byte sequences: x[t+1] = (5 x[t] + 3) mod 256
from random starts), ``--data stdlib`` (the bundled real text: CPython's standard library
source, byte level; see ``benchmarks.data.text``), ``--data-files`` or ``--token-file``.
Every data-parallel rank reads its own shard; tensor/pipeline peers read the same batch.

Exit status: 0, or 1 if ``--min-drop`` is set and the validation loss fell by less.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import zlib

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the checkout's root: the workshop (``benchmarks``: the GPT, the data) is not in the wheel
sys.path.insert(0, REPO)


def build_parser() -> argparse.ArgumentParser:
    from lioncub_ds.megatron import add_lioncub_args
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron's distributed optimizer (with --lioncub-voters node: its instances vote)")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="K instances of the distributed optimizer (the voters with --lioncub-voters node)")
    g.add_argument("--cpu-shim", action="store_true",
                   help="CPU ranks: import the test-only lioncub_ds.testing.megatron_cpu_shim (never for GPU training)")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--num-experts", type=int, default=None, help="MoE experts per layer (local spec, top-1)")
    g.add_argument("--bf16", action="store_true", help="bf16 params (default on GPU)")
    g.add_argument("--fp16", action="store_true", help="fp16 params with dynamic loss scaling")
    g.add_argument("--fp32", action="store_true", help="fp32 params (default on CPU)")
    g = p.add_argument_group("training")
    g.add_argument("--train-iters", type=int, default=200)
    g.add_argument("--micro-batch-size", type=int, default=8)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro-batch-size x data-parallel size (one micro-batch per step)")
    g.add_argument("--optimizer", choices=("lioncub", "adam"), default="lioncub",
                   help="adam: Megatron's own Adam with all-reduced gradients (baseline)")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=1e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=20)
    g.add_argument("--lr-decay-style", default="cosine", choices=("constant", "linear", "cosine"))
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9, help="also LionCub's β1 unless --lioncub-beta1")
    g.add_argument("--adam-beta2", type=float, default=0.99, help="also LionCub's β2 unless --lioncub-beta2")
    g.add_argument("--seed", type=int, default=1234)
    g = p.add_argument_group("data")
    g.add_argument("--data", choices=("mock", "stdlib"), default="mock")
    g.add_argument("--data-files", nargs="+", default=None, help="train on these text files (byte level)")
    g.add_argument("--token-file", default=None, help="raw uint8/uint16 token file (memmap)")
    g.add_argument("--token-dtype", default="uint8", choices=("uint8", "uint16"))
    g.add_argument("--max-bytes", type=int, default=8 * 2**20, help="cap on the stdlib corpus")
    g = p.add_argument_group("logging, evaluation, checkpoints")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=50)
    g.add_argument("--eval-iters", type=int, default=4)
    g.add_argument("--save", default=None, help="checkpoint directory (Megatron dist-checkpointing + LionCub)")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None, help="resume from the latest checkpoint in this directory")
    g.add_argument("--min-drop", type=float, default=None, help="exit 1 unless val loss dropped by this much")
    g.add_argument("--json-out", default=None)
    add_lioncub_args(p)
    return p


# ----------------------------------------------------------------------------- data
class MockData:
    """Learnable synthetic bytes: each sequence follows x[t+1] = (5 x[t] + 3) mod 256."""
    vocab_size = 256

    def get_batch(self, split, batch_size, seq_len, rank=0, world_size=1, step=0, seed=0, device="cpu"):
        key = f"{seed}/{split}/{rank}/{world_size}/{step}".encode()
        g = torch.Generator().manual_seed(zlib.crc32(key))
        seq = [torch.randint(0, 256, (batch_size, 1), generator=g)]
        for _ in range(seq_len):
            seq.append((5 * seq[-1] + 3) % 256)
        chunk = torch.cat(seq, 1)
        return chunk[:, :-1].to(device), chunk[:, 1:].to(device)


def load_data(args):
    if args.data == "mock" and not args.data_files and not args.token_file:
        return MockData()
    from benchmarks.data.text import load_dataset
    return load_dataset("stdlib", max_bytes=args.max_bytes, files=args.data_files, token_file=args.token_file,
                        token_dtype=args.token_dtype)


# ----------------------------------------------------------------------------- model
def padded_vocab(vocab, tp):
    multiple = 128 * tp
    return int(math.ceil(vocab / multiple) * multiple)


def build_model(args, vocab, use_cuda, dtype):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module
    moe = {}
    if args.num_experts:
        moe = dict(num_moe_experts=args.num_experts, moe_router_topk=1, moe_router_pre_softmax=True,
                   moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=1e-2,
                   expert_model_parallel_size=args.expert_model_parallel_size, add_bias_linear=False)
    cfg = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, sequence_parallel=args.sequence_parallel,
        use_cpu_initialization=not use_cuda, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, **moe)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=args.num_experts),
                     vocab_size=vocab, max_sequence_length=args.seq_length,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    if use_cuda:
        model.cuda(torch.cuda.current_device())
    if dtype != torch.float32:
        model = Float16Module(cfg, model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=dtype != torch.float32,
                                               overlap_grad_reduce=False,
                                               use_distributed_optimizer=args.use_distributed_optimizer,
                                               num_distributed_optimizer_instances=args.num_distributed_optimizer_instances)
    ddp = DistributedDataParallel(cfg, ddp_config, model)
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = ddp.no_sync
    return cfg, ddp


def build_optimizer(args, ddp, dtype):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from lioncub_ds.megatron import get_megatron_lioncub_optimizer, lioncub_settings_from_args
    ocfg = OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                           adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad,
                           bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
                           use_distributed_optimizer=args.use_distributed_optimizer)
    if args.optimizer == "adam":
        return get_megatron_optimizer(ocfg, [ddp])
    return get_megatron_lioncub_optimizer(ocfg, [ddp], lioncub=lioncub_settings_from_args(args),
                                          disable_grad_reduction=not args.lioncub_keep_grad_allreduce)


def build_scheduler(args, optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
                                   lr_warmup_steps=min(args.lr_warmup_iters, max(0, args.train_iters - 1)),
                                   lr_decay_steps=args.train_iters,
                                   lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
                                   end_wd=args.weight_decay, wd_incr_steps=args.train_iters,
                                   wd_incr_style="constant")


# ----------------------------------------------------------------------------- steps
def run_batches(args, ddp, data, split, step, n_micro, device, forward_only):
    """Megatron's schedule over ``n_micro`` micro-batches; mean loss on the last stage (else None)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    batches = [data.get_batch(split, args.micro_batch_size, args.seq_length, rank=dp_rank, world_size=dp_size,
                              step=step * n_micro + m, seed=args.seed, device=device) for m in range(n_micro)]
    pos = torch.arange(args.seq_length, device=device).unsqueeze(0).expand(args.micro_batch_size, -1)

    def forward_step(data_iterator, model):
        x, y = next(data_iterator)
        out = model(x, pos, None, labels=y)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach().clone()}
        return out, loss_func

    out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=[ddp],
                                      num_microbatches=n_micro, seq_length=args.seq_length,
                                      micro_batch_size=args.micro_batch_size, forward_only=forward_only)
    if not out:
        return None
    return sum(float(o["loss"]) for o in out) / len(out)


def dp_mean(value, device):
    """Mean over data-parallel ranks of a last-stage scalar (for logging only)."""
    from megatron.core import parallel_state as ps
    t = torch.tensor([value if value is not None else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return float(t) / ps.get_data_parallel_world_size()


# ----------------------------------------------------------------------------- checkpoints
def checkpoint_state(ddp, optimizer, scheduler, iteration, is_loading=False):
    from megatron.core.utils import unwrap_model
    model_sd = unwrap_model(ddp).sharded_state_dict()
    return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading),
            "scheduler": scheduler.state_dict(), "iteration": iteration}


def save_checkpoint(args, ddp, optimizer, scheduler, iteration):
    from megatron.core import dist_checkpointing
    from lioncub_ds.megatron.checkpoint import before_checkpoint_save, quiet_nonempty_dir_warning
    path = os.path.join(args.save, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    if args.optimizer == "lioncub":
        # per_rank: every rank writes its LionCub file now, BEFORE Megatron's save and the tracker
        # below, so "latest" never points at a checkpoint without them; sync: average the momenta.
        before_checkpoint_save(optimizer, args.lioncub_checkpoint_mode, checkpoint_dir=path)
    with quiet_nonempty_dir_warning(path):
        dist_checkpointing.save(checkpoint_state(ddp, optimizer, scheduler, iteration), path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(args.save, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
        print(f"saved checkpoint {path}", flush=True)


def load_checkpoint(args, ddp, optimizer, scheduler):
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model
    from lioncub_ds.megatron import after_checkpoint_load
    marker = os.path.join(args.load, "latest_checkpointed_iteration.txt")
    if not os.path.exists(marker):
        if dist.get_rank() == 0:
            print(f"no checkpoint in {args.load}; starting from scratch", flush=True)
        return 0
    iteration = int(open(marker).read().strip())
    path = os.path.join(args.load, f"iter_{iteration:07d}")
    state = dist_checkpointing.load(checkpoint_state(ddp, optimizer, scheduler, iteration, is_loading=True), path)
    unwrap_model(ddp).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if args.optimizer == "lioncub":
        after_checkpoint_load(optimizer, path, args.lioncub_checkpoint_mode, reshard=args.lioncub_reshard,
                              iteration=iteration)
    if dist.get_rank() == 0:
        print(f"resumed from {path} (iteration {iteration})", flush=True)
    return iteration


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.cpu_shim:
        from lioncub_ds.testing import megatron_cpu_shim  # TEST-ONLY: see its docstring
        megatron_cpu_shim.install()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from lioncub_ds.megatron import lioncub_optimizers

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and not args.cpu_shim
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # plain `python examples/...`: a world of one
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    dtype = torch.float32
    if args.bf16 or (use_cuda and not (args.fp16 or args.fp32)):
        dtype = torch.bfloat16
    if args.fp16:
        dtype = torch.float16
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                 pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                                 expert_model_parallel_size=args.expert_model_parallel_size,
                                 num_distributed_optimizer_instances=args.num_distributed_optimizer_instances)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    dp_size = ps.get_data_parallel_world_size()
    gbs = args.global_batch_size or args.micro_batch_size * dp_size
    if gbs % (args.micro_batch_size * dp_size):
        raise SystemExit(f"--global-batch-size {gbs} must be a multiple of micro-batch-size x DP "
                         f"({args.micro_batch_size} x {dp_size})")
    n_micro = gbs // (args.micro_batch_size * dp_size)
    data = load_data(args)
    vocab = padded_vocab(data.vocab_size, args.tensor_model_parallel_size)

    cfg, ddp = build_model(args, vocab, use_cuda, dtype)
    optimizer = build_optimizer(args, ddp, dtype)
    if cfg.fp16:
        cfg.grad_scale_func = optimizer.scale_loss
    scheduler = build_scheduler(args, optimizer)
    start = load_checkpoint(args, ddp, optimizer, scheduler) if args.load else 0
    lcs = lioncub_optimizers(optimizer)
    report = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and \
        ps.get_data_parallel_rank() == 0
    if rank == 0:
        n_params = sum(p.numel() for p in ddp.parameters())
        print(f"GPT {args.num_layers}x{args.hidden_size} ({n_params / 1e6:.2f}M params on rank 0), "
              f"world={world} TP={args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size} "
              f"DP={dp_size} micro-batches/step={n_micro} dtype={dtype} optimizer={args.optimizer} "
              f"wrappers={[type(o).__name__ for o in getattr(optimizer, 'chained_optimizers', [optimizer])]}",
              flush=True)

    def evaluate(it):
        losses = [run_batches(args, ddp, data, "val", 10_000 + i, 1, device, forward_only=True)
                  for i in range(args.eval_iters)]
        if not ps.is_pipeline_last_stage():
            return None
        v = dp_mean(sum(losses) / len(losses), device)
        if report:
            print(f"iter {it:6d} | validation loss {v:.4f}", flush=True)
        return v

    history, t0, skipped = [], time.time(), 0
    first_val = val = evaluate(start)
    for it in range(start, args.train_iters):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = run_batches(args, ddp, data, "train", it, n_micro, device, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        if ok:
            scheduler.step(increment=1)
        else:
            skipped += 1
        if (it + 1) % args.log_interval == 0 or it == start:
            mean_loss = dp_mean(loss, device) if ps.is_pipeline_last_stage() else None
            if report:
                msg = (f"iter {it + 1:6d} | loss {mean_loss:.4f} | lr {optimizer.param_groups[0]['lr']:.3e} | "
                       f"local grad norm {float(grad_norm or 0):.3f} | {(time.time() - t0) / (it + 1 - start):.3f} s/it")
                if lcs:
                    cum = lcs[0].comm_stats()["cumulative"]
                    steps = max(1, lcs[0].comm_stats()["steps"])
                    msg += (f" | LionCub sent {cum['bytes_sent'] / steps / 1e3:.1f} kB/step vs fp32 all-reduce "
                            f"{cum['fp32_allreduce_bytes'] / steps / 1e3:.1f} kB (x{cum['ratio_vs_fp32'] or 0:.1f})")
                print(msg, flush=True)
                history.append({"iter": it + 1, "loss": mean_loss})
        if (it + 1) % args.eval_interval == 0 or it + 1 == args.train_iters:
            val = evaluate(it + 1)
        if args.save and args.save_interval and (it + 1) % args.save_interval == 0:
            save_checkpoint(args, ddp, optimizer, scheduler, it + 1)
    if args.save and (not args.save_interval or args.train_iters % args.save_interval):
        save_checkpoint(args, ddp, optimizer, scheduler, args.train_iters)

    summary = {"final_val_loss": val, "first_val_loss": first_val, "history": history, "skipped_steps": skipped,
               "optimizer": args.optimizer, "seconds": time.time() - t0,
               "comm": lcs[0].comm_stats()["cumulative"] if lcs else None}
    if report and args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    code = 0
    if report and args.min_drop is not None and val is not None and first_val is not None:
        if not val <= first_val - args.min_drop:
            print(f"validation loss fell {first_val - val:.3f} < --min-drop {args.min_drop}", flush=True)
            code = 1
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
