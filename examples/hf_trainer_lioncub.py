"""A plain Hugging Face Trainer script: LionCub comes from the ds_config alone.

This script never imports lioncub_ds. ``"optimizer": {"type": "LionCub", ...}`` in the
ds_config resolves because installing lioncub_ds puts a tiny import hook in
site-packages that registers the type when ``deepspeed`` is imported (see
docs/deepspeed.md). Everything else is the usual HF recipe:

    # 2 CPU ranks (gloo). --use_cpu is required on a machine without GPUs.
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_accelerators 2 examples/hf_trainer_lioncub.py \\
        --deepspeed configs/ds_hf_lioncub.json --use_cpu --output_dir runs/hf \\
        --max_steps 40 --per_device_train_batch_size 8 --learning_rate 1e-3 \\
        --adam_beta1 0.95 --adam_beta2 0.98 --weight_decay 0.1 --save_steps 20 --logging_steps 5

    # the same with torchrun
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/hf_trainer_lioncub.py \\
        --deepspeed configs/ds_hf_lioncub.json --use_cpu --output_dir runs/hf ...

The model is a tiny GPT-2 built from a config (no download) and the data is synthetic:
each sequence counts modulo the vocabulary from a random start with a random stride,
so the next token is predictable from the two before it and the loss drops fast.

Extra flags (besides every TrainingArguments flag):
  --resume_from STEP   start from a different init and resume from ``output_dir/checkpoint-STEP``
                       (the same max_steps): the test checks that this run ends bit-identical
                       to the uninterrupted one
  --result_json PATH   write per-rank results (losses, a parameter digest) to PATH.rank<r>.json
  --zero_stage S       override ``zero_optimization.stage`` of the ds_config (a temp copy)
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import time

import torch
from transformers import (GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainerCallback,
                          TrainingArguments, set_seed)


@dataclasses.dataclass
class ScriptArgs:
    vocab: int = 64
    seq_len: int = 32
    samples: int = 512
    n_embd: int = 32
    n_layer: int = 2
    resume_from: int | None = None
    result_json: str | None = None
    zero_stage: int | None = None


class CountingData(torch.utils.data.Dataset):
    """x[t] = (start + stride * t) mod vocab, fixed by a seed."""

    def __init__(self, n, seq_len, vocab, seed=1234):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 8, (n, 1), generator=g)
        self.x = (start + stride * torch.arange(seq_len)) % vocab

    def __len__(self):
        return self.x.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def build_model(a: ScriptArgs, seed: int):
    set_seed(seed)
    cfg = GPT2Config(vocab_size=a.vocab, n_positions=a.seq_len, n_embd=a.n_embd, n_layer=a.n_layer, n_head=2, bos_token_id=0, eos_token_id=0,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def digest(model) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step (seconds), for the record."""

    def __init__(self):
        self.t = None
        self.steps = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(round(time.perf_counter() - self.t, 4))


def losses(trainer):
    return [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]


def main(argv=None):
    parser = HfArgumentParser((ScriptArgs, TrainingArguments))
    a, targs = parser.parse_args_into_dataclasses(argv)
    if a.zero_stage is not None:
        with open(targs.deepspeed) as f:
            cfg = json.load(f)
        cfg.setdefault("zero_optimization", {})["stage"] = a.zero_stage
        fd, path = tempfile.mkstemp(prefix="ds_config_", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(cfg, f)
        targs = dataclasses.replace(targs, deepspeed=path)
    data = CountingData(a.samples, a.seq_len, a.vocab)
    timer = StepTimer()
    resume = None if a.resume_from is None else os.path.join(targs.output_dir, f"checkpoint-{a.resume_from}")
    # On a resume the model starts from another init: the weights, the optimizer state (every rank's
    # LionCub momentum) and the scheduler must all come from the checkpoint.
    model = build_model(a, targs.seed + (1 if resume else 0))
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[timer])
    trainer.train(resume_from_checkpoint=resume)
    out = {"rank": targs.process_index, "world_size": targs.world_size, "losses": losses(trainer),
           "digest": digest(trainer.model), "global_step": trainer.state.global_step,
           "optimizer": type(getattr(trainer.model_wrapped, "basic_optimizer", None)).__name__,
           "engine_optimizer": type(getattr(trainer.model_wrapped, "optimizer", None)).__name__,
           "step_s": timer.steps}
    if a.result_json:
        with open(f"{a.result_json}.rank{targs.process_index}.json", "w") as f:
            json.dump(out, f)
    if targs.process_index == 0:
        print(f"[hf_trainer_lioncub] loss {out['losses'][0][1]:.4f} -> {out['losses'][-1][1]:.4f} "
              f"after {out['global_step']} steps", flush=True)
    return 0


if __name__ == "__main__":
    rc = main()
    # The Trainer's last collective (an all_gather) can leave a gloo worker releasing its
    # tensors while the interpreter tears itself down, which aborts a finished run
    # ("terminate called without an active exception", pytorch/pytorch#38228; with or without
    # LionCub, docs/deepspeed.md). Tear the groups down, flush, and leave without that teardown.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
