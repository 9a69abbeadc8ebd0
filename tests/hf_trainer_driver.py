"""Test driver for tests/test_hf_trainer.py: runs examples/hf_trainer_lioncub.py several times in ONE launch.

Like the example, it never imports lioncub_ds: ``"type": "LionCub"`` resolves through the
installed import hook. A launch costs ~10 s of imports on 2 CPU cores, so the scenarios
(ZeRO 0 and 1, each a full run with a checkpoint and a resume from it on a fresh model)
share one launch. accelerate allows one DeepSpeed Accelerator per process, so its
singletons are reset between runs (test plumbing, not something a user does); every run
builds its own Trainer, model and DeepSpeed engine from the ds_config.

Usage (under the deepspeed launcher or torchrun):
    hf_trainer_driver.py --config CFG --out DIR [--stages 0,1] [--steps 16] [--save 8]
Writes DIR/<stage>/{full,resume}.rank<r>.json (the example's result files).
"""
import argparse
import importlib.util
import json
import os
import sys
import time

__test__ = False

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "hf_trainer_lioncub.py")


def load_example():
    spec = importlib.util.spec_from_file_location("hf_trainer_lioncub", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stages", default="0,1")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--save", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--overlap", action="store_true", help='adds "overlap": true to the ds_config optimizer params')
    p.add_argument("--node-size", type=int, default=None,
                   help='adds "voters": "node", "node_size": N to the ds_config optimizer params')
    p.add_argument("--no-resume", action="store_true", help="only the full run")
    p.add_argument("--eps-auto", action="store_true",
                   help='adds "eps": "auto" to the ds_config optimizer params, as HF\'s own templates have it')
    p.add_argument("--param", action="append", default=[], metavar="KEY=JSON",
                   help='sets optimizer.params[KEY] = JSON in the ds_config (repeatable), e.g. --param \'comm="auto"\'')
    args = p.parse_args()
    assert "lioncub_ds" not in sys.modules
    example = load_example()
    from accelerate.state import AcceleratorState

    config = args.config
    if args.overlap or args.node_size or args.eps_auto or args.param:  # the template plus what a user adds to its params
        with open(args.config) as f:
            cfg = json.load(f)
        if args.overlap:
            cfg["optimizer"]["params"]["overlap"] = True
        if args.eps_auto:
            cfg["optimizer"]["params"]["eps"] = "auto"
        if args.node_size:
            cfg["optimizer"]["params"].update(voters="node", node_size=args.node_size)
        for item in args.param:
            key, _, value = item.partition("=")
            cfg["optimizer"]["params"][key] = json.loads(value)
        os.makedirs(args.out, exist_ok=True)
        config = os.path.join(args.out, "ds_config_edited.json")
        if int(os.environ.get("RANK", "0")) == 0:
            with open(config + ".tmp", "w") as f:
                json.dump(cfg, f)
            os.replace(config + ".tmp", config)
        while not os.path.exists(config):  # rank 0 writes it (no process group exists yet)
            time.sleep(0.05)
    for stage in [int(s) for s in args.stages.split(",")]:
        out = os.path.join(args.out, f"stage{stage}")
        os.makedirs(out, exist_ok=True)
        common = ["--deepspeed", config, "--gradient_accumulation_steps", str(args.grad_accum), "--zero_stage", str(stage), "--use_cpu", "--output_dir",
                  os.path.join(out, "ckpt"), "--max_steps", str(args.steps), "--save_steps", str(args.save),
                  "--per_device_train_batch_size", "8", "--learning_rate", "5e-3", "--adam_beta1", "0.95",
                  "--adam_beta2", "0.98", "--weight_decay", "0.1", "--max_grad_norm", "1.0", "--logging_steps", "1",
                  "--report_to", "none", "--disable_tqdm", "true", "--save_only_model", "false", "--seed", "7"]
        runs = (("full", []),) if args.no_resume else (("full", []), ("resume", ["--resume_from", str(args.save)]))
        for name, extra in runs:
            rc = example.main(common + extra + ["--result_json", os.path.join(out, name)])
            if rc:  # a setting error: the example said it in one line from rank 0
                return rc
            AcceleratorState._reset_state(reset_partial_state=True)  # noqa: SLF001 - see the module doc
    return 0


if __name__ == "__main__":
    rc = main()
    # The recipe docs/deepspeed.md gives for the end of an HF script: tear the process groups
    # down, flush, and leave without the interpreter's teardown, where a gloo worker freeing the
    # last collective's tensors can abort a finished run ("terminate called without an active
    # exception", pytorch/pytorch#38228; lioncub_ds.groups).
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
