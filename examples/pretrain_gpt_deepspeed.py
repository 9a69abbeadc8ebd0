"""Pretrain the small GPT with DeepSpeed and Lion Cub (the ``deepspeed`` launcher).

The training loop lives in the workshop beside the package, outside the wheel
(:mod:`benchmarks.ds_pretrain`, which ``python -m benchmarks.ds_demo`` runs); this file is the same entry point:

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_accelerators 2 examples/pretrain_gpt_deepspeed.py \\
        --deepspeed_config configs/ds_lioncub_recommended.json --preset tiny --steps 30

Run it with ``--help`` for every flag (``--steps`` fits the config's lr schedule to the run).
"""
import os
import sys

# the checkout's root: the workshop (``benchmarks``: the GPT, the data, the training loops) is not in the wheel
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.ds_pretrain import exit_cleanly, main  # noqa: E402

if __name__ == "__main__":
    exit_cleanly(main())
