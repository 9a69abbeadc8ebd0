"""Pretrain the small GPT with DeepSpeed and Lion Cub (the ``deepspeed`` launcher).

The training loop ships inside the package (:mod:`lioncub_ds.deepspeed.pretrain_gpt`, which
``python -m lioncub_ds.deepspeed.demo`` runs); this file is the same entry point:

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_accelerators 2 examples/pretrain_gpt_deepspeed.py \\
        --deepspeed_config configs/ds_cpu_demo.json --steps 200

Run it with ``--help`` for every flag.
"""
import os
import sys

try:
    import lioncub_ds  # noqa: F401
except ImportError:  # a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lioncub_ds.deepspeed.pretrain_gpt import exit_cleanly, main  # noqa: E402

if __name__ == "__main__":
    exit_cleanly(main())
