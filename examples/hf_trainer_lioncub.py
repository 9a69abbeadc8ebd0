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
  --zero_stage S       override ``zero_optimization.stage`` of the ds_config (an edited copy)

LionCub's own ``"auto"`` values: HF treats every ``"auto"`` string in the ds_config as a
placeholder to fill from TrainingArguments and stops on one it cannot fill (accelerate's
"`optimizer.params.comm` not found in kwargs", once per rank). LionCub takes ``"auto"`` for
``comm`` and ``zero_allgather``, where it is also the default, so this script drops those keys
before the Trainer sees the config (the same run) and says so in one line from rank 0.
``"auto"`` on any other LionCub key, and a LionCub setting error (a misspelled key, a bad
value), end the run before it trains with one line from rank 0 naming the key, exit status 2.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sys
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
    """Wall time of every optimizer step (seconds), for the record; ``began``: the loop started."""

    def __init__(self):
        self.t = None
        self.steps = []
        self.began = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.began = True

    def on_step_begin(self, args, state, control, **kwargs):
        self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(round(time.perf_counter() - self.t, 4))


# ----------------------------------------------------------------------------- LionCub's "auto" vs HF's
# In optimizer.params HF fills exactly these "auto" placeholders from TrainingArguments
# (transformers' HfTrainerDeepSpeedConfig.trainer_config_process: --learning_rate,
# --adam_beta1/2, --adam_epsilon, --weight_decay). They stay as they are.
HF_FILLED_PARAMS = ("lr", "betas", "eps", "weight_decay")
# LionCub's settings that take the value "auto", which is also their default (comm:
# lioncub_ds/config.py, COMM_ALGORITHMS, the cost model's pick; zero_allgather:
# lioncub_ds/deepspeed/engine.py, ZERO_ALLGATHER_MODES). Dropping such a key is the same run
# as writing "auto" (tests/test_hf_trainer.py checks this list against lioncub_ds).
LIONCUB_AUTO_DEFAULTS = ("comm", "zero_allgather")
TAG = "[hf_trainer_lioncub]"


class DsConfigError(ValueError):
    """A ds_config the Trainer cannot run (one line, named key)."""


def _is_lioncub(optimizer) -> bool:
    name = optimizer.get("type") if isinstance(optimizer, dict) else None
    return isinstance(name, str) and name.replace("_", "").lower() == "lioncub"


def _autos(value, path):
    """Dotted paths of the "auto" strings in value (dicts recursed, like accelerate does)."""
    if value == "auto":
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _autos(v, f"{path}.{k}")]
    return []


def lioncub_autos_for_hf(cfg: dict) -> list[str]:
    """Make a LionCub ds_config safe for HF's "auto" filling; edits cfg, returns the dropped keys.

    ``"comm": "auto"`` / ``"zero_allgather": "auto"``: dropped (LionCub's default, so the same run).
    Any other "auto" under optimizer.params that HF does not fill: DsConfigError naming it.
    """
    optimizer = cfg.get("optimizer")
    if not _is_lioncub(optimizer) or not isinstance(optimizer.get("params"), dict):
        return []
    params = optimizer["params"]
    dropped = [key for key in LIONCUB_AUTO_DEFAULTS if params.get(key) == "auto"]
    for key in dropped:
        del params[key]
    for key, value in params.items():
        if key in HF_FILLED_PARAMS:
            continue
        for path in _autos(value, f"optimizer.params.{key}"):
            raise DsConfigError(
                f"ds_config {path} is \"auto\": HF fills \"auto\" in optimizer.params only for "
                f"{', '.join(HF_FILLED_PARAMS)} and LionCub takes it only for {', '.join(LIONCUB_AUTO_DEFAULTS)}; "
                f"write a value for {path[len('optimizer.params.'):]} or drop the key (LionCub's default)")
    return dropped


def load_ds_config(deepspeed):
    """TrainingArguments.deepspeed as a dict (a copy), or None when it is not one we can read."""
    if isinstance(deepspeed, dict):
        return json.loads(json.dumps(deepspeed))
    if isinstance(deepspeed, str):
        if os.path.exists(deepspeed):
            with open(deepspeed) as f:
                return json.load(f)
        try:
            cfg = json.loads(deepspeed)
        except ValueError:
            return None
        return cfg if isinstance(cfg, dict) else None
    return None


def prepare_ds_config(targs, zero_stage=None):
    """TrainingArguments with the ds_config this script runs: --zero_stage applied, LionCub's own
    "auto" keys dropped (one line from rank 0 says which). Unchanged when there is nothing to do."""
    cfg = load_ds_config(targs.deepspeed)
    if cfg is None:
        return targs
    changed = False
    if zero_stage is not None:
        cfg.setdefault("zero_optimization", {})["stage"] = zero_stage
        changed = True
    dropped = lioncub_autos_for_hf(cfg)
    if dropped:
        changed = True
        if targs.process_index == 0:
            keys = ", ".join(f'optimizer.params.{k}="auto"' for k in dropped)
            print(f"{TAG} dropped {keys} from the ds_config: LionCub's own \"auto\" is its default "
                  "(the same run), not an HF placeholder to fill from TrainingArguments", flush=True)
    # A dict is a documented value of TrainingArguments.deepspeed; replace() re-reads it.
    return dataclasses.replace(targs, deepspeed=cfg) if changed else targs


def setting_error(exc) -> bool:
    """A ds_config / LionCub setting error: raised the same way on every rank, before training.
    (LionCub's classes are recognised by name: this script does not import lioncub_ds.)"""
    return isinstance(exc, DsConfigError) or any(
        c.__module__.startswith("lioncub_ds") and c.__name__ in ("LionCubConfigError", "LionCubDeepSpeedError")
        for c in type(exc).__mro__)


def setting_error_line(exc, targs) -> str:
    """One line; a LionCub error is prefixed with the optimizer.params keys it names."""
    msg = " ".join(str(exc).split())
    if isinstance(exc, DsConfigError):
        return f"{TAG} {msg}"
    cfg = load_ds_config(targs.deepspeed) or {}
    params = (cfg.get("optimizer") or {}).get("params") or {}
    keys = [k for k in params if re.search(rf"(?<![\w.]){re.escape(k)}=|key '{re.escape(k)}'", msg)]
    where = "".join(f" optimizer.params.{k}" for k in keys)
    return f"{TAG} ds_config{where}: {msg}"


def losses(trainer):
    return [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]


def main(argv=None):
    parser = HfArgumentParser((ScriptArgs, TrainingArguments))
    a, targs = parser.parse_args_into_dataclasses(argv)
    data = CountingData(a.samples, a.seq_len, a.vocab)
    timer = StepTimer()
    resume = None if a.resume_from is None else os.path.join(targs.output_dir, f"checkpoint-{a.resume_from}")
    try:
        targs = prepare_ds_config(targs, a.zero_stage)
        # On a resume the model starts from another init: the weights, the optimizer state (every rank's
        # LionCub momentum) and the scheduler must all come from the checkpoint.
        model = build_model(a, targs.seed + (1 if resume else 0))
        trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[timer])
        trainer.train(resume_from_checkpoint=resume)
    except Exception as exc:  # noqa: BLE001 - only setting errors are handled; the rest re-raise
        if not setting_error(exc) or timer.began:
            raise
        # Every rank reads the same ds_config and hits the same setting error at the same point:
        # rank 0 says it once, in one line, instead of one traceback per rank. Then all ranks meet
        # in a barrier before exiting: a rank that exits first makes the launcher kill the others
        # (maybe before rank 0 printed) or breaks a peer still joining the process group.
        if targs.process_index == 0:
            print(setting_error_line(exc, targs), file=sys.stderr, flush=True)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        return 2
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
