"""Pretrain the small GPT with Lion Cub under torchrun (the same loop as ``python -m benchmarks.demo``).

    torchrun --nproc_per_node 2 examples/pretrain_gpt.py --steps 200
    torchrun --nproc_per_node 2 examples/pretrain_gpt.py --steps 200 --comm 1bit --momentum-sync 50
    torchrun --nproc_per_node 2 examples/pretrain_gpt.py --optim lion        # all-reduced-gradient baseline
    torchrun --nproc_per_node 8 examples/pretrain_gpt.py --device auto --preset bench20m   # GPUs: NCCL

Reads RANK / WORLD_SIZE / LOCAL_RANK (and MASTER_ADDR / MASTER_PORT) from the
environment that torchrun sets; run without torchrun it trains on one process.
With ``--optim lioncub`` the gradients are never all-reduced: each rank keeps its own
momentum and only the 1-bit votes travel. Exit status as in ``benchmarks.demo``.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

# the checkout's root: the workshop (``benchmarks``: the GPT, the data, the training loops) is not in the wheel
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.demo import build_parser, check_lioncub_flags, check_summary, train  # noqa: E402


def main(argv=None) -> int:
    parser = build_parser("torchrun --nproc_per_node N examples/pretrain_gpt.py", world_size_flag=False)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.set_defaults(device="auto")
    args = parser.parse_args(argv)
    check_lioncub_flags(parser, args)  # every rank checks; a bad combination is one line, not a traceback

    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank if args.local_rank is not None else 0))

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        # torchrun sets OMP_NUM_THREADS=1 for multi-process runs; honour an explicit --threads otherwise.
        torch.set_num_threads(max(1, args.threads))
    if world_size > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size)
    try:
        summary = train(args, rank, world_size, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return check_summary(summary, args.min_drop) if rank == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
