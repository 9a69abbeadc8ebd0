"""LionCub in Megatron-LM's own training loop: the installer (lioncub_ds.megatron.training).

Megatron-LM's training package (``megatron.training``) is not on the package index, so the thing
under test -- OUR installer -- is exercised against stand-in module objects that carry the same
attribute names, and are called the same way, as Megatron-LM's at tags core_v0.16.1 through main
(core 0.20). What each stand-in stands for (see lioncub_ds/megatron/_compat.py, MEGATRON_LM_PATCHES):

* ``arguments.add_megatron_arguments(parser)`` and ``arguments.parse_args(extra_args_provider=None,
  ignore_unknown_args=False)``, which looks ``add_megatron_arguments`` up as a module global
  (megatron/training/arguments.py, every version); ``arguments.validate_args(args, defaults)``
  (called by ``parse_and_validate_args`` from 0.18) and ``initialize.validate_args`` (the name
  ``initialize_megatron`` calls in 0.16/0.17). Flags are declared with Megatron-LM's own names
  and defaults (``--adam-beta2`` 0.999, ``--optimizer`` adam, ...).
* ``training.get_megatron_optimizer(config, model, config_overrides=..., use_gloo_process_groups=...,
  dump_param_to_param_group_map=...)`` as ``setup_model_and_optimizer`` calls it; ``training.get_args``.
* ``training.save_checkpoint(iteration, model, optimizer, opt_param_scheduler, flops,
  checkpointing_context, non_persistent_ckpt=...)``: like Megatron-LM's torch_dist path it
  computes ``get_checkpoint_name(save, iteration, return_base_dir=True)``, lets rank 0 create it,
  calls ``megatron.core.dist_checkpointing.save`` (the real one), barriers, and then rank 0
  writes ``latest_checkpointed_iteration.txt``; at that moment the stand-in records which
  LionCub per-rank files exist (the ordering under test).
* ``training.load_checkpoint(model, optimizer, opt_param_scheduler, ...)``: reads the tracker,
  loads the real dist-checkpoint into model and optimizer unless ``--finetune`` /
  ``--no-load-optim``, returns ``(iteration, flops)``.
* ``checkpointing.get_checkpoint_name`` / ``get_checkpoint_tracker_filename``: Megatron-LM's
  naming (``iter_0000005``, ``latest_checkpointed_iteration.txt``).

Real megatron-core (GPTModel, DDP, wrappers, dist_checkpointing) runs on CPU gloo ranks through
the test-only shim. Also here (issue 11 item 6): with an uneven MoE placement (experts on the
last pipeline stage only), fp16 loss scaling, ``timeout_s`` and node momentum sync, every
process group is created at construction, by every rank, in the same order, and every group
sees the same collective sequence from all of its members.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import math
import os
import shutil
import sys
import types

import pytest
import torch

from dist_helpers import run_ranks

pytestmark = pytest.mark.integration  # the stand-in checks are unit

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core not installed")
VOCAB, SEQ, MBS, HIDDEN = 64, 16, 4, 32


# ----------------------------------------------------------------------------- stand-ins
def _megatron_lm_flags(parser):
    """A subset of Megatron-LM's own flags, with its names and defaults."""
    a = parser.add_argument
    a("--optimizer", type=str, default="adam", choices=["adam", "sgd", "muon", "dist_muon", "lion"])
    a("--adam-beta1", type=float, default=0.9)
    a("--adam-beta2", type=float, default=0.999)
    a("--lion-beta1", type=float, default=0.95)
    a("--lion-beta2", type=float, default=0.98)
    a("--lr", type=float, default=None)
    a("--use-distributed-optimizer", action="store_true")
    a("--overlap-grad-reduce", action="store_true")
    a("--overlap-param-gather", action="store_true")
    a("--overlap-param-gather-with-optimizer-step", action="store_true")
    a("--fp8-param-gather", action="store_true")
    a("--optimizer-cpu-offload", action="store_true")
    a("--num-distributed-optimizer-instances", type=int, default=1)
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--pipeline-model-parallel-size", type=int, default=1)
    a("--use-torch-fsdp2", action="store_true")
    a("--save", type=str, default=None)
    a("--load", type=str, default=None)
    a("--finetune", action="store_true")
    a("--no-load-optim", action="store_true", default=None)
    a("--no-save-optim", action="store_true", default=None)
    a("--non-persistent-ckpt-type", type=str, default=None, choices=["global", "local", "in_memory", None])
    a("--non-persistent-save-interval", type=int, default=None)
    return parser


def make_standins(validate_calls=None):
    """Module objects standing in for megatron.training.{arguments,initialize,training,checkpointing}."""
    arguments = types.ModuleType("standin.megatron.training.arguments")
    arguments.add_megatron_arguments = _megatron_lm_flags

    def parse_args(extra_args_provider=None, ignore_unknown_args=False, argv=None):
        parser = argparse.ArgumentParser(allow_abbrev=False)
        parser = arguments.add_megatron_arguments(parser)  # module-global lookup, as in Megatron-LM
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return parser.parse_args(argv)

    def validate_args(args, defaults={}):  # noqa: B006 - Megatron-LM's signature
        if validate_calls is not None:
            validate_calls.append("megatron")
        return args

    arguments.parse_args = parse_args
    arguments.validate_args = validate_args
    initialize = types.ModuleType("standin.megatron.training.initialize")
    initialize.validate_args = validate_args  # 0.16/0.17: imported into initialize

    checkpointing = types.ModuleType("standin.megatron.training.checkpointing")
    checkpointing._NON_PERSISTENT_CKPT_SUBDIR = "non_persistent"

    def get_checkpoint_name(path, iteration, release=False, pipeline_parallel=None, tensor_rank=None,
                            pipeline_rank=None, expert_parallel=None, expert_rank=None, return_base_dir=False,
                            basename="model_optim_rng.pt"):
        directory = "release" if release else "iter_{:07d}".format(iteration)
        assert return_base_dir, "the installer must ask for the iteration directory"
        return os.path.join(path, directory)

    checkpointing.get_checkpoint_name = get_checkpoint_name
    checkpointing.get_checkpoint_tracker_filename = lambda p: os.path.join(p, "latest_checkpointed_iteration.txt")

    training = types.ModuleType("standin.megatron.training.training")
    training.ARGS = None
    training.get_args = lambda: training.ARGS
    training.get_megatron_optimizer = lambda *a, **k: ("megatron's own optimizer", a, k)
    training.save_checkpoint = lambda *a, **k: None
    training.load_checkpoint = lambda *a, **k: (0, 0)
    return types.SimpleNamespace(arguments=arguments, initialize=initialize, checkpointing=checkpointing,
                                 training=training)


@pytest.fixture
def standins():
    from lioncub_ds.megatron import training as lt
    lt.uninstall()
    calls = []
    s = make_standins(calls)
    s.validate_calls = calls
    lt.install(training=s.training, checkpointing=s.checkpointing, arguments=s.arguments, initialize=s.initialize)
    yield s
    lt.uninstall()


GOOD = ["--lr", "1e-3", "--lioncub-beta1", "0.95", "--lioncub-beta2", "0.98"]


# ----------------------------------------------------------------------------- argument plumbing
@pytest.mark.unit
def test_flags_reach_megatron_parser_and_get_args(standins):
    args = standins.arguments.parse_args(argv=GOOD + ["--lioncub-comm", "1bit", "--lioncub-momentum-sync-every", "10",
                                                      "--lioncub-checkpoint-mode", "sync"])
    assert args.lioncub_comm == "1bit" and args.lioncub_checkpoint_mode == "sync"
    from lioncub_ds.megatron.training import settings_from_megatron_args
    s = settings_from_megatron_args(args)
    assert s["comm"] == "1bit" and s["betas"] == (0.95, 0.98) and s["momentum_sync"] == {"every": 10}


@pytest.mark.unit
def test_flags_added_once_even_with_extra_args_provider(standins):
    """A script that also passes extra_args_provider=add_lioncub_args (0.16/0.17 pretrain) must not clash."""
    from lioncub_ds.megatron import add_lioncub_args
    args = standins.arguments.parse_args(extra_args_provider=lambda p: p if "--lioncub-comm" in
                                         p._option_string_actions else add_lioncub_args(p), argv=GOOD)
    assert args.lioncub_checkpoint_mode == "per_rank"


@pytest.mark.unit
def test_a_drift_sync_with_model_parallelism_is_in_the_one_early_error(standins):
    """schedule drift with TP or PP > 1 (per-key flag or the JSON): refused with the other flags,
    before Megatron-LM builds the model (the optimizer factory would refuse it only after)."""
    from lioncub_ds.megatron.training import LionCubMegatronArgsError, megatron_args_problems
    p = standins.arguments.parse_args
    drift = ["--lioncub-momentum-sync-every", "20", "--lioncub-momentum-sync-schedule", "drift"]
    as_json = ["--lioncub-momentum-sync", '{"schedule": "drift", "threshold": 0.01}']
    for extra in (drift, as_json):
        for mp in (["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]):
            bad = megatron_args_problems(p(argv=GOOD + extra + mp))
            assert any(x.startswith("--lioncub-momentum-sync-schedule") and "TP = PP = 1" in x for x in bad), bad
        assert megatron_args_problems(p(argv=GOOD + extra)) == []
    assert megatron_args_problems(p(argv=GOOD + drift[:2] + ["--tensor-model-parallel-size", "2"])) == []
    with pytest.raises(LionCubMegatronArgsError, match="drift"):
        standins.arguments.validate_args(p(argv=GOOD + drift + ["--pipeline-model-parallel-size", "2"]), {})
    assert standins.validate_calls == []


@pytest.mark.unit
def test_uninstall_restores_every_name():
    from lioncub_ds.megatron import training as lt
    lt.uninstall()
    s = make_standins()
    before = {(m, n): getattr(getattr(s, m), n) for m, n in [
        ("arguments", "add_megatron_arguments"), ("arguments", "validate_args"), ("initialize", "validate_args"),
        ("training", "get_megatron_optimizer"), ("training", "save_checkpoint"), ("training", "load_checkpoint")]}
    lt.install(**{k: getattr(s, k) for k in ("training", "checkpointing", "arguments", "initialize")})
    lt.install(**{k: getattr(s, k) for k in ("training", "checkpointing", "arguments", "initialize")})  # idempotent
    assert all(getattr(getattr(s, m), n) is not f for (m, n), f in before.items())
    lt.uninstall()
    assert all(getattr(getattr(s, m), n) is f for (m, n), f in before.items())


@pytest.mark.unit
def test_compat_table_names_every_patched_symbol():
    from lioncub_ds.megatron import _compat
    names = {(m, n) for m, n, _, _ in _compat.MEGATRON_LM_PATCHES}
    assert names == {("megatron.training.arguments", "add_megatron_arguments"),
                     ("megatron.training.initialize", "validate_args"),
                     ("megatron.training.arguments", "validate_args"),
                     ("megatron.training.training", "get_megatron_optimizer"),
                     ("megatron.training.training", "save_checkpoint"),
                     ("megatron.training.training", "load_checkpoint")}


@pytest.mark.unit
def test_install_without_megatron_lm_says_what_to_do(monkeypatch):
    from lioncub_ds.megatron import training as lt
    lt.uninstall()
    import builtins
    real = builtins.__import__

    def fake(name, *a, **k):
        if name.startswith("megatron.training"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    monkeypatch.setattr("importlib.import_module", lambda name: fake(name))
    with pytest.raises(ImportError, match="not on the package index.*PYTHONPATH"):
        lt.install()
    assert not lt.installed()


@pytest.mark.unit
def test_run_help_lists_every_lioncub_flag_without_a_megatron_checkout(capsys):
    """``python -m lioncub_ds.megatron.run --help`` lists the flags it adds (the script's own --help
    needs Megatron-LM), from the same parser Megatron gets."""
    from lioncub_ds.megatron import run
    from lioncub_ds.megatron.args import add_lioncub_args

    run.main(["--help"])
    out = capsys.readouterr().out
    flags = [o for a in add_lioncub_args(argparse.ArgumentParser())._actions for o in a.option_strings
             if o.startswith("--lioncub-")]
    assert len(flags) > 20 and "--lioncub-comm" in flags and "--lioncub-momentum-sync-every" in flags
    assert [f for f in flags if f not in out] == []
    assert "pretrain_gpt.py" in out


# ----------------------------------------------------------------------------- the early error
RECIPE = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--fp8-param-gather"]


@pytest.mark.unit
@pytest.mark.parametrize("where", ["arguments", "initialize"])  # 0.18+ / 0.16-0.17 call sites
def test_one_early_error_lists_every_incompatible_flag(standins, where):
    from lioncub_ds.megatron.training import LionCubMegatronArgsError
    more = ["--optimizer-cpu-offload", "--num-distributed-optimizer-instances", "2"]
    args = standins.arguments.parse_args(argv=["--lr", "1e-3"] + RECIPE + more)
    with pytest.raises(LionCubMegatronArgsError) as info:
        getattr(standins, where).validate_args(args, {})
    msg = str(info.value)
    for flag in RECIPE + ["--optimizer-cpu-offload", "--num-distributed-optimizer-instances 2",
                          "--lioncub-beta1", "--lioncub-beta2"]:
        assert flag in msg, (flag, msg)
    assert "use_distributed_optimizer" not in msg  # command-line names, not config fields
    assert standins.validate_calls == []  # raised before Megatron's own validation (before any model)


@pytest.mark.unit
def test_early_check_passes_good_args_and_runs_megatron_validation(standins):
    args = standins.arguments.parse_args(argv=GOOD)
    standins.arguments.validate_args(args, {})
    assert standins.validate_calls == ["megatron"]


@pytest.mark.unit
def test_the_loaded_iteration_directory_is_found_for_ckpt_step_and_another_load_dir(standins, tmp_path):
    from lioncub_ds.megatron.training import loaded_iteration_dir
    ck = standins.checkpointing

    def ckpt(base, it, tracker=True):
        os.makedirs(ck.get_checkpoint_name(str(base), it, return_base_dir=True))
        if tracker:
            with open(ck.get_checkpoint_tracker_filename(str(base)), "w") as f:
                f.write(str(it))

    load, save = tmp_path / "load", tmp_path / "save"
    ckpt(load, 3)
    ckpt(load, 5)  # the tracker names 5; --ckpt-step 3 loads 3
    args = standins.arguments.parse_args(argv=GOOD + ["--load", str(load), "--save", str(save)])
    assert loaded_iteration_dir(args, ck, "load", 5).endswith("load/iter_0000005")
    assert loaded_iteration_dir(args, ck, "load", 3).endswith("load/iter_0000003")
    assert loaded_iteration_dir(args, ck, "load", 4) is None
    # global non-persistent checkpoints of the LOAD directory, --save elsewhere
    ckpt(load / "non_persistent", 7)
    nonp = standins.arguments.parse_args(argv=GOOD + ["--load", str(load), "--save", str(save),
                                                      "--non-persistent-ckpt-type", "global"])
    assert loaded_iteration_dir(nonp, ck, "load", 7).endswith("load/non_persistent/iter_0000007")


@pytest.mark.unit
def test_keeping_the_gradient_all_reduce_with_node_voters_is_refused_by_name(standins):
    from lioncub_ds.megatron.training import megatron_args_problems
    args = standins.arguments.parse_args(argv=GOOD + ["--use-distributed-optimizer", "--lioncub-voters", "node",
                                                      "--lioncub-keep-grad-allreduce"])
    problems = [p for p in megatron_args_problems(args) if p.startswith("--lioncub-keep-grad-allreduce")]
    assert problems and "no all-reduce across them to keep" in problems[0], megatron_args_problems(args)
    flat = standins.arguments.parse_args(argv=GOOD + ["--lioncub-keep-grad-allreduce"])
    assert not [p for p in megatron_args_problems(flat) if "keep-grad-allreduce" in p]


@pytest.mark.unit
def test_optimizer_choice_and_beta_rules(standins, monkeypatch):
    from lioncub_ds.megatron import _compat
    from lioncub_ds.megatron.training import LionCubMegatronArgsError, megatron_args_problems
    p = standins.arguments.parse_args
    assert any(x.startswith("--optimizer muon") for x in megatron_args_problems(p(argv=GOOD + ["--optimizer", "muon"])))
    # --optimizer lion (Megatron-LM >= 0.18): Lion's own betas, no --lioncub-beta* needed; 0.17 cannot build it
    monkeypatch.setattr(_compat, "megatron_version", lambda: (0, 18, 2))
    assert megatron_args_problems(p(argv=["--lr", "1", "--optimizer", "lion"])) == []
    monkeypatch.setattr(_compat, "megatron_version", lambda: (0, 17, 1))
    assert any("before 0.18" in x for x in megatron_args_problems(p(argv=["--lr", "1", "--optimizer", "lion"])))
    # Adam betas the user changed are taken; Megatron's defaults (0.9, 0.999) are refused
    assert megatron_args_problems(p(argv=["--lr", "1", "--adam-beta2", "0.98"])) == []
    assert any("0.999" in x for x in megatron_args_problems(p(argv=["--lr", "1"])))
    with pytest.raises(LionCubMegatronArgsError, match="--lioncub-beta1 and --lioncub-beta2"):
        standins.arguments.validate_args(p(argv=["--lr", "1", "--lioncub-beta2", "0.98"]), {})
    # keep-the-all-reduce baseline: overlapping DDP's reduction is allowed there
    assert megatron_args_problems(p(argv=GOOD + ["--overlap-grad-reduce", "--lioncub-keep-grad-allreduce"])) == []
    local = p(argv=GOOD + ["--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", "5"])
    assert any("--non-persistent-ckpt-type local" in x for x in megatron_args_problems(local))


@pytest.mark.unit
def test_optimizer_swap_reads_get_args(standins, monkeypatch):
    from lioncub_ds.megatron import optimizer as mopt
    seen = {}

    def fake_factory(config, model_chunks, *a, lioncub=None, disable_grad_reduction=True, **kw):
        seen.update(config=config, chunks=model_chunks, lioncub=lioncub, disable=disable_grad_reduction, kw=kw)
        return "lioncub"

    monkeypatch.setattr(mopt, "get_megatron_lioncub_optimizer", fake_factory)
    from lioncub_ds.megatron import training as lt
    lt.uninstall()
    lt.install(**{k: getattr(standins, k) for k in ("training", "checkpointing", "arguments", "initialize")})
    standins.training.ARGS = standins.arguments.parse_args(argv=GOOD + ["--lioncub-comm", "pbit",
                                                                        "--lioncub-keep-grad-allreduce"])
    out = standins.training.get_megatron_optimizer("cfg", ["m"], config_overrides={"x": 1},
                                                   use_gloo_process_groups=True, dump_param_to_param_group_map=None,
                                                   some_future_kwarg=3)
    assert out == "lioncub"
    assert seen["lioncub"]["comm"] == "pbit" and seen["lioncub"]["betas"] == (0.95, 0.98)
    assert seen["disable"] is False
    assert seen["kw"] == {"config_overrides": {"x": 1}, "use_gloo_process_groups": True,
                          "dump_param_to_param_group_map": None}


# ----------------------------------------------------------------------------- real ranks
def _shim():
    import warnings
    from lioncub_ds.testing import megatron_cpu_shim
    megatron_cpu_shim.install()
    warnings.filterwarnings("ignore")


def _gpt(tp=1, pp=1, moe_layers=None, dtype=torch.float32, seed=1234):
    """A tiny GPTModel in Megatron DDP; ``moe_layers``: Megatron's moe_layer_freq list (2 experts)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    moe = dict(num_moe_experts=2, moe_layer_freq=list(moe_layers), moe_router_topk=1, moe_router_pre_softmax=True,
               add_bias_linear=False, moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
               expert_model_parallel_size=ps.get_expert_model_parallel_world_size()) if moe_layers else {}
    cfg = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=2 * HIDDEN,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=dtype,
                            params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, **moe)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    if dtype != torch.float32:
        from megatron.core.transformer.module import Float16Module
        model = Float16Module(cfg, model)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=dtype != torch.float32),
                                  model)
    cfg.finalize_model_grads_func = finalize_model_grads
    return cfg, ddp


def _opt_config(**kw):
    from megatron.core.optimizer import OptimizerConfig
    base = dict(optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.999,
                clip_grad=1.0)
    base.update(kw)
    return OptimizerConfig(**base)


def _train_step(ddp, opt, step):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    g = torch.Generator().manual_seed(100 * ps.get_data_parallel_rank() + step)
    seq = [torch.randint(0, VOCAB, (MBS, 1), generator=g)]
    for _ in range(SEQ):
        seq.append((5 * seq[-1] + 3) % VOCAB)
    tokens = torch.cat(seq, 1)

    def forward_step(data_iterator, model):
        x = next(data_iterator)
        out = model(x[:, :-1], torch.arange(SEQ).unsqueeze(0).expand(MBS, -1), None, labels=x[:, 1:])
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

    ddp.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]), model=[ddp],
                                num_microbatches=1, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
    ok, _, _ = opt.step()
    assert ok


def _momenta(opt, init=False):
    from lioncub_ds.megatron import lioncub_optimizers
    return [opt_.momenta.get(p).clone() if init else opt_.state[p]["exp_avg"].clone()
            for opt_ in lioncub_optimizers(opt) for g in opt_.param_groups for p in g["params"]]


def _standin_megatron_checkpointing(s, tmp):
    """save_checkpoint / load_checkpoint as Megatron-LM's torch_dist path does them (see module doc)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    s.tracker_log = []

    def state(model, optimizer, iteration, is_loading=False):
        msd = model[0].module.sharded_state_dict()
        out = {"model": msd, "iteration": iteration}
        if optimizer is not None:  # Megatron-LM leaves the optimizer out with --finetune / --no-load-optim
            out["optimizer"] = optimizer.sharded_state_dict(msd, is_loading=is_loading)
        return out

    def cleanup_old_non_persistent_checkpoint(save_dir, leave_ckpt_num=1, do_async=False):
        # Megatron-LM's: rank 0 keeps the newest leave_ckpt_num iter_* folders, called before its save
        if dist.get_rank() != 0 or not os.path.isdir(save_dir):
            return
        iters = sorted(d for d in os.listdir(save_dir) if d.startswith("iter_"))
        for d in iters[:-leave_ckpt_num]:
            shutil.rmtree(os.path.join(save_dir, d))

    s.checkpointing.cleanup_old_non_persistent_checkpoint = cleanup_old_non_persistent_checkpoint
    s.nonpersistent_log = []

    def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, flops, checkpointing_context=None,
                        non_persistent_ckpt=False, crash_before_tracker=False, **kw):
        args = s.training.get_args()
        base = args.save
        if non_persistent_ckpt and args.non_persistent_ckpt_type == "global":
            base = os.path.join(args.save, "non_persistent")
            s.checkpointing.cleanup_old_non_persistent_checkpoint(base, leave_ckpt_num=1)
            dist.barrier()
            s.nonpersistent_log.append((iteration, sorted(d for d in os.listdir(base) if d.startswith("iter_"))))
            args = types.SimpleNamespace(**{**vars(args), "save": base})
        name = s.checkpointing.get_checkpoint_name(args.save, iteration, return_base_dir=True)
        if dist.get_rank() == 0:
            os.makedirs(name, exist_ok=True)
        dist_checkpointing.save(state(model, optimizer, iteration), name)
        dist.barrier()
        if crash_before_tracker:
            raise RuntimeError("simulated crash before the tracker")
        if dist.get_rank() == 0:
            lioncub_files = sorted(os.path.relpath(os.path.join(d, f), name)
                                   for d, _, fs in os.walk(os.path.join(name, "lioncub")) for f in fs)
            s.tracker_log.append((iteration, lioncub_files))
            with open(s.checkpointing.get_checkpoint_tracker_filename(args.save), "w") as f:
                f.write(str(iteration))
        dist.barrier()

    def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg="load", strict=True, **kw):
        args = s.training.get_args()
        load_dir = getattr(args, load_arg)
        tracker = s.checkpointing.get_checkpoint_tracker_filename(load_dir)
        if not os.path.exists(tracker):
            return 0, 0
        iteration = int(open(tracker).read())
        name = s.checkpointing.get_checkpoint_name(load_dir, iteration, return_base_dir=True)
        load_optim = not (args.finetune or args.no_load_optim)
        sd = dist_checkpointing.load(state(model, optimizer if load_optim else None, iteration, is_loading=True), name)
        model[0].module.load_state_dict(sd["model"])
        if load_optim:
            optimizer.load_state_dict(sd["optimizer"])
        return (0 if args.finetune else iteration), 0

    s.training.save_checkpoint = save_checkpoint
    s.training.load_checkpoint = load_checkpoint


def _ckpt_rank(rank, world, tmp):
    """DP=2: train through the installed swaps, save, resume, finetune, crash, missing files."""
    _shim()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from lioncub_ds.checkpoint import CheckpointError
    from lioncub_ds.megatron import lioncub_optimizers
    from lioncub_ds.megatron import training as lt
    ps.initialize_model_parallel()
    s = make_standins()
    _standin_megatron_checkpointing(s, tmp)
    lt.uninstall()
    lt.install(training=s.training, checkpointing=s.checkpointing, arguments=s.arguments, initialize=s.initialize)
    save = os.path.join(tmp, "ckpt")
    out = {}
    try:
        s.training.ARGS = s.arguments.parse_args(argv=GOOD + ["--save", save, "--load", save, "--lioncub-comm", "1bit"])
        _, ddp = _gpt()
        opt = s.training.get_megatron_optimizer(_opt_config(), [ddp], config_overrides=None,
                                                use_gloo_process_groups=True, dump_param_to_param_group_map=None)
        out["betas"] = lioncub_optimizers(opt)[0].config.betas
        out["grad_reduction_off"] = getattr(ddp, "_lioncub_local_grads", False)
        for step in range(3):
            _train_step(ddp, opt, step)
        s.training.save_checkpoint(3, [ddp], opt, None, 0, None, non_persistent_ckpt=False)
        saved = _momenta(opt)
        out["saved_differs_across_ranks"] = saved[0].sum().item()
        _train_step(ddp, opt, 3)
        # a crash between Megatron's files and its tracker: the tracker keeps pointing at iteration 3
        try:
            s.training.save_checkpoint(4, [ddp], opt, None, 0, None, crash_before_tracker=True)
        except RuntimeError:
            pass
        out["tracker_after_crash"] = open(os.path.join(save, "latest_checkpointed_iteration.txt")).read()
        out["tracker_log"] = getattr(s, "tracker_log", [])

        # resume into a fresh model + optimizer through the swapped load_checkpoint
        _, ddp2 = _gpt(seed=99)
        opt2 = s.training.get_megatron_optimizer(_opt_config(), [ddp2])
        it, _ = s.training.load_checkpoint([ddp2], opt2, None)
        out["resumed_iteration"] = it
        out["resume_exact"] = all(torch.equal(a, b) for a, b in zip(saved, _momenta(opt2)))

        # --finetune / --no-load-optim: no LionCub state read (momenta stay as built: zero)
        for flag in ("--finetune", "--no-load-optim"):
            s.training.ARGS = s.arguments.parse_args(argv=GOOD + ["--save", save, "--load", save, flag])
            _, ddp3 = _gpt(seed=7)
            opt3 = s.training.get_megatron_optimizer(_opt_config(), [ddp3])
            s.training.load_checkpoint([ddp3], opt3, None)
            out[flag] = all(float(m.abs().sum()) == 0.0 for m in _momenta(opt3, init=True))

        # --lioncub-checkpoint-mode sync with local non-persistent checkpoints (what the early error
        # recommends for them): a non-persistent save runs (it raised, naming the mode already given)
        sync_args = ["--save", os.path.join(tmp, "sync"), "--lioncub-checkpoint-mode", "sync",
                     "--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", "5"]
        s.training.ARGS = s.arguments.parse_args(argv=GOOD + sync_args)
        try:
            s.training.save_checkpoint(3, [ddp2], opt2, None, 0, None, non_persistent_ckpt=True)
            out["sync_local_save"] = None
        except Exception as exc:  # noqa: BLE001 - the message is what the test reports
            out["sync_local_save"] = f"{type(exc).__name__}: {exc}"

        # global non-persistent checkpoints, per-rank files: Megatron's clean-up of old non-persistent
        # folders runs inside its save, after LionCub wrote iteration 6's files; the last finished one
        # (5) must survive it until 6 is complete
        s.training.ARGS = s.arguments.parse_args(argv=GOOD + ["--save", os.path.join(tmp, "np"), "--load",
                                                              os.path.join(tmp, "np"), "--non-persistent-ckpt-type",
                                                              "global", "--non-persistent-save-interval", "1"])
        for it in (5, 6):
            s.training.save_checkpoint(it, [ddp2], opt2, None, 0, None, non_persistent_ckpt=True)
        out["nonpersistent_log"] = s.nonpersistent_log

        # files missing on ONE rank: every rank raises the same explained error (agreed, no hang)
        s.training.ARGS = s.arguments.parse_args(argv=GOOD + ["--save", save, "--load", save])
        dist.barrier()
        if rank == 1:
            for d, _, fs in os.walk(os.path.join(save, "iter_0000003", "lioncub")):
                for f in fs:
                    if "rank00001" in f:
                        os.unlink(os.path.join(d, f))
        dist.barrier()
        _, ddp4 = _gpt(seed=5)
        opt4 = s.training.get_megatron_optimizer(_opt_config(), [ddp4])
        try:
            s.training.load_checkpoint([ddp4], opt4, None)
            out["missing_error"] = None
        except CheckpointError as exc:
            out["missing_error"] = str(exc)
    finally:
        lt.uninstall()
        ps.destroy_model_parallel()
    return out


@needs_megatron
def test_checkpoint_order_resume_finetune_and_missing_files(tmp_path):
    res = run_ranks(_ckpt_rank, 2, str(tmp_path), timeout=400)
    r0, r1 = res
    assert r0["betas"] == (0.95, 0.98) and r0["grad_reduction_off"]
    assert r0["saved_differs_across_ranks"] != r1["saved_differs_across_ranks"]  # local momenta
    # ordering: when Megatron wrote its tracker, every rank's LionCub file was already there
    (it, files), (sync_it, sync_files), *_ = r0["tracker_log"]  # then the sync-mode save (no files of ours)
    assert sync_it == 3 and sync_files == []
    assert it == 3 and files == ["lioncub/dense/mp00000/lioncub-rank00000-of-00002.pt",
                                 "lioncub/dense/mp00000/lioncub-rank00001-of-00002.pt"]
    assert r0["tracker_after_crash"] == "3"
    for r in res:
        assert r["resumed_iteration"] == 3 and r["resume_exact"]
        assert r["--finetune"] and r["--no-load-optim"]
        msg = r["missing_error"]
        assert msg and "no LionCub per-rank momentum files for 1 rank(s)" in msg
        assert "--lioncub-checkpoint-mode sync" in msg and "--no-load-optim" in msg and "iteration 3" in msg
    assert "lioncub-rank00001-of-00002.pt" in r1["missing_error"]
    # at iteration 6's clean-up the finished iteration 5 is still there (beside LionCub's files of 6)
    assert r0["nonpersistent_log"] == [(5, ["iter_0000005"]), (6, ["iter_0000005", "iter_0000006"])], r0["nonpersistent_log"]
    assert r0["sync_local_save"] is None and r1["sync_local_save"] is None, (r0["sync_local_save"], r1["sync_local_save"])


def _drift_tp_rank(rank, world):
    """TP = 2: momentum_sync schedule="drift" is refused before anything changes (DDP's gradient
    reduction stays on); a fixed schedule builds."""
    _shim()
    from megatron.core import parallel_state as ps
    from lioncub_ds.config import LionCubConfigError
    from lioncub_ds.megatron import get_megatron_lioncub_optimizer
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    out = {}
    try:
        _, ddp = _gpt(tp=2)
        drift = {"schedule": "drift", "threshold": 0.1, "min_every": 2}
        try:
            get_megatron_lioncub_optimizer(_opt_config(), [ddp], lioncub={"momentum_sync": drift})
            out["refused"] = None
        except LionCubConfigError as exc:
            out["refused"] = str(exc)
        try:  # a bad value, found by the settings' validation
            get_megatron_lioncub_optimizer(_opt_config(), [ddp], lioncub={"comm": "nope"})
            out["bad_value"] = None
        except LionCubConfigError as exc:
            out["bad_value"] = str(exc)
        out["reduction_kept"] = not getattr(ddp, "_lioncub_local_grads", False)
        get_megatron_lioncub_optimizer(_opt_config(), [ddp], lioncub={"momentum_sync": {"every": 5}})
        out["fixed_builds"] = getattr(ddp, "_lioncub_local_grads", False)
    finally:
        ps.destroy_model_parallel()
    return out


@needs_megatron
def test_drift_schedule_with_tensor_parallelism_is_refused_before_anything_changes():
    for r in run_ranks(_drift_tp_rank, 2, timeout=300):
        assert r["refused"] and "schedule='drift'" in r["refused"] and "2 model-parallel ranks" in r["refused"], r
        assert r["bad_value"] and "comm" in r["bad_value"], r
        assert r["reduction_kept"], "DDP's gradient reduction was switched off by a refused build"
        assert r["fixed_builds"]


def _crossing_groups_rank(rank, world, tmp):
    """A dense optimizer voting over {0, 2} / {1, 3} (TP 2) and an expert one over every rank
    (expert TP 1), as Megatron builds them; rank 0's dense file corrupted: every rank raises, none
    hangs in the expert check, none changed its state."""
    import types
    import torch.distributed as dist
    from lioncub_ds import LionCub
    from lioncub_ds.checkpoint import CheckpointError
    from lioncub_ds.megatron.checkpoint import load_lioncub_states, save_lioncub_states
    dense_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    torch.manual_seed(rank)
    a, b = torch.nn.Parameter(torch.randn(37)), torch.nn.Parameter(torch.randn(29))
    dense = LionCub([a], lr=1e-2, process_group=dense_groups[rank % 2])
    expert = LionCub([b], lr=1e-2)
    dense.megatron_kind, dense.megatron_tag = "dense", f"mp{rank % 2:05d}"
    expert.megatron_kind, expert.megatron_tag = "expert", "emp00000-ep00000"
    chained = types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=dense),
                                                        types.SimpleNamespace(optimizer=expert)])
    for _ in range(2):
        a.grad, b.grad = torch.randn(37), torch.randn(29)
        dense.step()
        expert.step()
    save_lioncub_states(chained, tmp)
    dist.barrier()
    if rank == 0:
        path = glob.glob(os.path.join(tmp, "lioncub", "dense", "mp00000", "lioncub-rank00000-*.pt"))[0]
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    dist.barrier()
    before = [t.clone() for t in (dense.state[a]["exp_avg"], expert.state[b]["exp_avg"])]
    for _ in range(1):
        a.grad, b.grad = torch.randn(37), torch.randn(29)
        dense.step()
        expert.step()
    moved = [t.clone() for t in (dense.state[a]["exp_avg"], expert.state[b]["exp_avg"])]
    try:
        load_lioncub_states(chained, tmp)
        err = None
    except CheckpointError as exc:
        err = str(exc)
    after = [dense.state[a]["exp_avg"], expert.state[b]["exp_avg"]]
    return {"error": err, "unchanged": all(torch.equal(x, y) for x, y in zip(after, moved)),
            "differs_from_saved": not all(torch.equal(x, y) for x, y in zip(before, moved))}


@needs_megatron
def test_a_bad_file_under_crossing_vote_groups_stops_every_rank_without_a_hang(tmp_path):
    for r, res in enumerate(run_ranks(_crossing_groups_rank, 4, str(tmp_path), timeout=180)):
        assert res["error"], f"rank {r} loaded"
        assert res["unchanged"] and res["differs_from_saved"], (r, res)


# ----------------------------------------------------------------------------- groups at construction
def _groups_rank(rank, world):
    """PP=2 x DP=2 (EP=2: expert parameters are expert-parallel only with EP > 1), experts on the last
    stage only, fp16 loss scaling, timeout_s, node momentum sync."""
    _shim()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from lioncub_ds.megatron import get_megatron_lioncub_optimizer, lioncub_optimizers
    ps.initialize_model_parallel(pipeline_model_parallel_size=2, expert_model_parallel_size=2)
    _, ddp = _gpt(pp=2, moe_layers=[0, 1], dtype=torch.float16)
    log = {"new_group": [], "collectives": []}
    phase = ["construct"]
    orig_new_group = dist.new_group

    def new_group(ranks=None, *a, **k):
        log["new_group"].append((phase[0], tuple(ranks) if ranks is not None else None,
                                 bool(k.get("use_local_synchronization", False))))
        return orig_new_group(ranks, *a, **k)

    saved = {}
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all_single", "broadcast",
                 "reduce_scatter_tensor", "all_gather_object", "barrier"):
        if not hasattr(dist, name):
            continue
        saved[name] = getattr(dist, name)

        def wrapped(*a, _name=name, _orig=saved[name], **k):
            group = k.get("group")
            if group is None:
                group = next((x for x in a if isinstance(x, dist.ProcessGroup)), None)
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(world))
            caller = sys._getframe(1).f_code.co_filename.replace(os.sep, "/")
            ours = caller.endswith("lioncub_ds/megatron/optimizer.py")
            log["collectives"].append((phase[0], _name + (" (lioncub_ds.megatron)" if ours else ""), ranks))
            return _orig(*a, **k)
        setattr(dist, name, wrapped)
    dist.new_group = new_group
    try:
        opt = get_megatron_lioncub_optimizer(
            _opt_config(fp16=True, params_dtype=torch.float16, initial_loss_scale=2.0 ** 8), [ddp],
            lioncub={"betas": (0.95, 0.98), "timeout_s": 60,
                     "momentum_sync": {"group": "node", "every": 1, "inter_every": 2}})
        phase[0] = "step"
        kinds = sorted((o.megatron_kind, sum(p.numel() for g in o.param_groups for p in g["params"]) > 0)
                       for o in lioncub_optimizers(opt))
        for _ in range(3):  # zero gradients are enough: the collectives are what is checked
            ddp.zero_grad_buffer()
            opt.zero_grad()
            ok, _, _ = opt.step()
    finally:
        dist.new_group = orig_new_group
        for name, fn in saved.items():
            setattr(dist, name, fn)
        ps.destroy_model_parallel()
    return {"kinds": kinds, **log}


@needs_megatron
def test_groups_made_at_construction_on_all_ranks_with_uneven_experts():
    res = run_ranks(_groups_rank, 4, timeout=400)
    # Experts on stage 1 only. megatron-core (0.16 - main) aligns parameter groups over the world
    # (_get_param_groups all-gathers their keys), so stage 0 also gets an expert optimizer, with empty
    # groups; the checks below do not depend on that (one found_inf agreement per step at the chain).
    kinds = [r["kinds"] for r in res]
    assert kinds == [[("dense", True), ("expert", False)]] * 2 + [[("dense", True), ("expert", True)]] * 2
    lioncub_groups = [[g for g in r["new_group"]] for r in res]
    for r in res:
        assert all(phase == "construct" for phase, _, _ in r["new_group"]), r["new_group"]  # none in a step
        assert not any(local for _, _, local in r["new_group"])  # every rank takes part in every creation
    assert all(g == lioncub_groups[0] for g in lioncub_groups)  # same groups, same order, on every rank
    made = [ranks for _, ranks, _ in lioncub_groups[0]]
    assert (0, 1) in made and (2, 3) in made  # the dense timeout vote groups (and node subgroups)
    # NCCL contract: each group sees the same collective sequence from all of its members
    by_group = {}
    for rank, r in enumerate(res):
        for phase, name, ranks in r["collectives"]:
            if phase == "step":
                by_group.setdefault(ranks, {}).setdefault(rank, []).append(name)
    for ranks, seqs in by_group.items():
        members = [seqs.get(m, []) for m in ranks]
        assert all(s == members[0] for s in members), (ranks, seqs)
    world = tuple(range(4))
    ours = [name for name in by_group[world][0] if name.endswith("(lioncub_ds.megatron)")]
    assert ours == ["all_reduce (lioncub_ds.megatron)"] * 3  # one found_inf agreement per step (3 steps)


# ----------------------------------------------------------------------------- real Megatron-LM (opt-in)
MEGATRON_LM_DIR = os.environ.get("LIONCUB_MEGATRON_LM_DIR")


needs_megatron_lm = [
    pytest.mark.skipif(not (HAVE_MEGATRON and MEGATRON_LM_DIR and os.path.isfile(os.path.join(MEGATRON_LM_DIR or "",
                                                                                              "pretrain_gpt.py"))),
                       reason="set LIONCUB_MEGATRON_LM_DIR to a Megatron-LM checkout (tag core_v0.16.1) to run "
                              "Megatron-LM's own pretrain_gpt.py"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only launcher; on a GPU run pretrain_gpt.py through "
                                                         "lioncub_ds.megatron.run directly (docs/megatron.md)")]


def _megatron_lm(ckpt):
    """(base arguments, run(nproc, extra, port)) for Megatron-LM's pretrain_gpt.py on CPU ranks."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(here)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [repo, MEGATRON_LM_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "6", "--lr", "1e-3", "--lr-decay-style", "constant", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--transformer-impl", "local",
            "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
            "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
            "--distributed-backend", "gloo", "--use-cpu-initialization", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--eval-interval", "1000", "--eval-iters", "0", "--log-interval", "1",
            "--ckpt-format", "torch", "--save", ckpt, "--save-interval", "2",
            "--lioncub-beta1", "0.9", "--lioncub-beta2", "0.99", "--lioncub-comm", "1bit"]

    def run(nproc, extra, port):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(port), os.path.join(here, "megatron_lm_cpu_launcher.py"), "pretrain_gpt.py"] + base + extra
        return subprocess.run(cmd, cwd=MEGATRON_LM_DIR, env=env, capture_output=True, text=True, timeout=600)
    return base, run


@needs_megatron_lm[0]
@needs_megatron_lm[1]
def test_real_megatron_lm_pretrain_gpt_on_cpu(tmp_path):
    """Megatron-LM's unmodified pretrain_gpt.py through ``lioncub_ds.megatron.run`` on 2 CPU ranks (gloo):
    train 4 of 6 iterations (--exit-interval 4) with checkpoints, then resume to 6 from the per-rank files;
    and the one early error for a recipe's incompatible flags. Needs ``six`` importable (Megatron-LM)."""
    ckpt = str(tmp_path / "ckpt")
    base, run = _megatron_lm(ckpt)

    from dist_helpers import free_port
    first = run(2, ["--exit-interval", "4"], free_port())
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "voting over 2 ranks" in first.stdout + first.stderr
    for it in (2, 4):
        for r in (0, 1):
            assert os.path.isfile(os.path.join(ckpt, f"iter_{it:07d}", "lioncub", "dense", "mp00000",
                                               f"lioncub-rank{r:05d}-of-00002.pt"))
    second = run(2, ["--load", ckpt], free_port())
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert "restored every rank's momentum from" in out and "iteration        6/       6" in out
    bad = run(1, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"], free_port())
    out = bad.stdout + bad.stderr
    assert bad.returncode != 0 and "LionCubMegatronArgsError" in out
    assert all(f in out for f in ("--use-distributed-optimizer:", "--overlap-grad-reduce:", "--overlap-param-gather:"))
    assert "building GPT model" not in out


@needs_megatron_lm[0]
@needs_megatron_lm[1]
def test_real_megatron_lm_node_voters_on_cpu(tmp_path):
    """pretrain_gpt.py with --use-distributed-optimizer --num-distributed-optimizer-instances 2
    --lioncub-voters node on 4 CPU ranks (2 instances x 2): trains 4 of 6 iterations with checkpoints
    (Megatron's legacy format: its parameter-state file plus the per-rank LionCub files), resumes to 6;
    --lioncub-voters node without the distributed optimizer is the one early error."""
    from dist_helpers import free_port
    ckpt = str(tmp_path / "ckpt")
    base, run = _megatron_lm(ckpt)
    node = ["--global-batch-size", "8", "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
            "--lioncub-voters", "node"]
    first = run(4, node + ["--exit-interval", "4"], free_port())
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-3000:]
    assert "voters='node'): 2 instances x 2 ranks" in out
    for r in range(4):
        assert os.path.isfile(os.path.join(ckpt, "iter_0000004", "lioncub", "dense", "mp00000",
                                           f"lioncub-rank{r:05d}-of-00004.pt"))
    second = run(4, node + ["--load", ckpt], free_port())
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert "restored every rank's momentum from" in out and "iteration        6/       6" in out
    bad = run(1, ["--lioncub-voters", "node"], free_port())
    out = bad.stdout + bad.stderr
    assert bad.returncode != 0 and "LionCubMegatronArgsError" in out and "--lioncub-voters node:" in out
    assert "building GPT model" not in out


def _lm_losses(out):
    """{iteration: lm loss} from Megatron-LM's training log lines."""
    import re
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([-+0-9.eE]+|nan|inf)", out)}


@needs_megatron_lm[0]
@needs_megatron_lm[1]
def test_real_megatron_lm_node_voters_overlap_param_gather_with_optimizer_step_on_cpu(tmp_path):
    """pretrain_gpt.py on 4 CPU ranks: PP = 2 with a virtual pipeline (4 layers, 1 per virtual
    stage: 2 model chunks per rank), DP = 2 as 2 distributed-optimizer instances of 1 rank,
    --lioncub-voters node with --overlap-grad-reduce --overlap-param-gather
    --overlap-param-gather-with-optimizer-step: the first model chunk's dense parameters have an
    optimizer (and per-rank files) of their own. Trains 4 of 6 iterations with checkpoints,
    resumes to 6 from both optimizers' files; a resume without the flag refuses those files."""
    from dist_helpers import free_port
    ckpt = str(tmp_path / "ckpt")
    base, run = _megatron_lm(ckpt)
    # Megatron-LM's validation: the flag needs --overlap-param-gather (which needs
    # --overlap-grad-reduce) and a virtual pipeline; its interleaved schedule wants at least PP
    # micro-batches (8 / (2 x DP 2) = 2)
    overlap = ["--overlap-grad-reduce", "--overlap-param-gather"]
    vp = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
          "--global-batch-size", "8", "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
          "--lioncub-voters", "node"] + overlap
    with_step = vp + ["--overlap-param-gather-with-optimizer-step"]
    first = run(4, with_step + ["--exit-interval", "4"], free_port())
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-3000:]
    assert "Number of virtual stages per pipeline stage: 2" in out
    log_line = next((ln for ln in out.splitlines() if "voters='node'): 2 instances x 1 ranks" in ln), "")
    assert "dense_chunk0:" in log_line and "dense_later_chunks:" in log_line, out[-3000:]
    losses = _lm_losses(out)
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values()), losses
    for it in (2, 4):
        for kind in ("dense_chunk0", "dense_later_chunks"):
            for mp in (0, 1):  # the two pipeline stages
                for r in (0, 1):  # the data-parallel ranks (one per instance)
                    assert os.path.isfile(os.path.join(ckpt, f"iter_{it:07d}", "lioncub", kind, f"mp{mp:05d}",
                                                       f"lioncub-rank{r:05d}-of-00002.pt")), (it, kind, mp, r)
        assert sorted(os.listdir(os.path.join(ckpt, f"iter_{it:07d}", "lioncub"))) == \
            ["dense_chunk0", "dense_later_chunks"]
    second = run(4, with_step + ["--load", ckpt], free_port())
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert "restored every rank's momentum from" in out and "iteration        6/       6" in out
    resumed = _lm_losses(out)
    assert sorted(resumed) == [5, 6] and all(math.isfinite(v) for v in resumed.values()), resumed
    # the same checkpoint without the flag: one optimizer for every chunk; the split files are refused
    other = run(4, vp + ["--load", ckpt], free_port())
    out = other.stdout + other.stderr
    assert other.returncode != 0, out[-3000:]
    assert "--overlap-param-gather-with-optimizer-step" in out and "dense_chunk0" in out and \
        "--no-load-optim" in out, out[-3000:]
    assert not _lm_losses(out), out[-3000:]


@pytest.mark.unit
def test_run_finds_the_script(tmp_path, monkeypatch):
    """``python -m lioncub_ds.megatron.run [SCRIPT] ARGS``: cwd, then $MEGATRON_LM_DIR, then sys.path."""
    from lioncub_ds.megatron import run
    mlm = tmp_path / "Megatron-LM"
    mlm.mkdir()
    (mlm / "pretrain_gpt.py").write_text("import sys\nRESULT = list(sys.argv)\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="cannot find the Megatron-LM script 'pretrain_gpt.py'"):
        run.find_script("pretrain_gpt.py")
    monkeypatch.setenv("MEGATRON_LM_DIR", str(mlm))
    assert run.find_script("pretrain_gpt.py") == str(mlm / "pretrain_gpt.py")
    seen = {}
    monkeypatch.setattr("lioncub_ds.megatron.training.install", lambda: seen.setdefault("installed", True))
    monkeypatch.setattr("runpy.run_path", lambda path, run_name: seen.update(path=path, argv=list(sys.argv),
                                                                             run_name=run_name))
    monkeypatch.setattr(sys, "argv", ["run"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    run.main(["--lr", "1e-3", "--lioncub-comm", "1bit"])  # no script given: pretrain_gpt.py
    assert seen == {"installed": True, "path": str(mlm / "pretrain_gpt.py"), "run_name": "__main__",
                    "argv": [str(mlm / "pretrain_gpt.py"), "--lr", "1e-3", "--lioncub-comm", "1bit"]}


@pytest.mark.unit
def test_install_is_all_or_nothing():
    """A Megatron-LM without one of the names (an unsupported version) leaves nothing half-patched."""
    from lioncub_ds.megatron import training as lt
    lt.uninstall()
    s = make_standins()
    del s.training.load_checkpoint
    add, opt = s.arguments.add_megatron_arguments, s.training.get_megatron_optimizer
    with pytest.raises(AttributeError):
        lt.install(**{k: getattr(s, k) for k in ("training", "checkpointing", "arguments", "initialize")})
    assert not lt.installed()
    assert s.arguments.add_megatron_arguments is add and s.training.get_megatron_optimizer is opt
