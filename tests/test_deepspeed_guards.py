"""DeepSpeed integration guards: HF template keys, the version/name check, the stage-0 wrapper guard,
the ZeRO sign all-gather's collectives, and the self-contained demo.

The wrapper guard runs real DeepSpeed engines on 2 gloo ranks (DS_ACCELERATOR=cpu).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import warnings
from pathlib import Path

import pytest

from lioncub_ds import LionCubConfigError

pytestmark = pytest.mark.integration  # engines on ranks and launches; the in-process checks are unit

ROOT = Path(__file__).resolve().parents[1]
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def engine_mod():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed not installed")
    from lioncub_ds.deepspeed import engine
    return engine


# ----------------------------------------------------------------------------- HF template keys
@pytest.mark.unit
def test_eps_is_accepted_and_dropped(engine_mod):
    params, options = engine_mod.split_params({"lr": 1e-4, "betas": [0.95, 0.98], "eps": 1e-8, "weight_decay": 0.1})
    assert "eps" not in params and params["betas"] == [0.95, 0.98] and options["zero_allgather"] == "auto"
    assert engine_mod.split_params({"eps": None})[0] == {}


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["auto", -1.0, float("nan"), True, [1e-8]])
def test_eps_with_a_bad_value_names_key_value_and_allowed(engine_mod, bad):
    with pytest.raises(LionCubConfigError, match=r"eps=.*allowed: a number >= 0 or null .*Lion has no epsilon"):
        engine_mod.split_params({"eps": bad})


@pytest.mark.unit
def test_eps_and_adam_betas_warnings(engine_mod):
    w = engine_mod.config_warnings({"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8})
    assert len(w) == 2
    assert "eps=1e-08" in w[0] and "Lion has no epsilon" in w[0]
    assert "(0.9, 0.999)" in w[1] and "--adam_beta2" in w[1] and "(0.95, 0.98)" in w[1]
    assert engine_mod.config_warnings({"betas": [0.95, 0.98]}) == []
    assert engine_mod.config_warnings({"betas": (0.9, 0.99)}) == []
    assert engine_mod.config_warnings({}) == []


@pytest.mark.unit
def test_misspelled_eps_still_gets_a_suggestion(engine_mod):
    with pytest.raises(LionCubConfigError, match=r"unknown ds_config optimizer.params key 'epsilon'"):
        engine_mod.split_params({"epsilon": 1e-8})


# ----------------------------------------------------------------------------- _compat
@pytest.mark.unit
@needs_deepspeed
def test_every_patched_or_read_name_exists_in_the_installed_deepspeed():
    from lioncub_ds.deepspeed import _compat
    assert _compat.missing_names() == []
    ver = _compat.check()
    assert ver is not None and len(ver) == 3


@pytest.mark.unit
@needs_deepspeed
def test_registration_patches_what_compat_lists():
    import deepspeed.runtime.engine as ds_engine
    import lioncub_ds.deepspeed  # noqa: F401  (registers)
    from lioncub_ds.deepspeed import _compat
    for name in _compat.ENGINE_PATCHED:
        assert getattr(getattr(ds_engine.DeepSpeedEngine, name), "_lioncub_ds_patch", False), name


@pytest.mark.unit
@needs_deepspeed
def test_unknown_version_warns_once_and_names_the_range(monkeypatch):
    import deepspeed
    from lioncub_ds.deepspeed import _compat
    monkeypatch.setattr(deepspeed, "__version__", "9.1.0")
    monkeypatch.setattr(_compat, "_warned", False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert _compat.check() == (9, 1, 0)
        _compat.check()
    msgs = [str(r.message) for r in rec if "supported range" in str(r.message)]
    assert len(msgs) == 1 and "9.1.0" in msgs[0] and ">= 0.19.0, < 0.20.0" in msgs[0], msgs


@pytest.mark.unit
@needs_deepspeed
def test_a_missing_name_is_an_error_that_names_it(monkeypatch):
    from deepspeed.runtime.zero import stage_1_and_2
    from lioncub_ds.deepspeed import _compat
    monkeypatch.delattr(stage_1_and_2, "all_gather_dp_groups")
    assert _compat.missing_names() == ["deepspeed.runtime.zero.stage_1_and_2.all_gather_dp_groups"]
    with pytest.raises(_compat.DeepSpeedCompatError, match=r"lacks deepspeed\.runtime\.zero\.stage_1_and_2\."
                                                           r"all_gather_dp_groups.*tested: 0\.19\.8"):
        _compat.check()


# ----------------------------------------------------------------------------- no torch API names / versions
@pytest.mark.unit
def test_integration_sources_assert_no_torch_api_names_or_versions():
    """Feature detection only: the integration never compares torch versions or names a torch collective."""
    for path in (ROOT / "lioncub_ds" / "deepspeed").glob("*.py"):
        src = path.read_text()
        assert "torch.__version__" not in src, path
        assert not re.search(r"all_gather_(single|into_tensor)|_all_gather_base", src), path


# ----------------------------------------------------------------------------- the demo lives in the workshop
@pytest.mark.unit
def test_demo_runs_the_training_loop_beside_it_with_the_repository_config():
    from benchmarks import ds_demo as demo
    script = demo.train_script()
    assert script.is_file() and script.resolve().parent == Path(demo.__file__).resolve().parent
    assert script.resolve().parent == ROOT / "benchmarks"  # the workshop, not the wheel's lioncub_ds/
    # the demo's config is the repository's
    assert json.loads((ROOT / "configs" / "ds_cpu_demo.json").read_text()) == demo.DEMO_CONFIG


def test_demo_reports_builds_apart_from_the_wall_times():
    """A first run's kernel build is reported on its own, never read as LionCub being slow (issue 23)."""
    from benchmarks import ds_demo as demo
    run = {"launch_s": 20.0, "first_val_loss": 5.0, "last_val_loss": 3.0, "bytes_sent_per_step": 10,
           "tokens_per_s": 1000.0, "params_in_sync": True, "preset": "tiny", "params": 100, "world_size": 2,
           "steps": 5, "tokens_per_step": 64}
    table = demo.format_comparison(dict(run, kernel_load_s=0.01, kernel_origin="prebuilt"),
                                   dict(run, kernel_load_s=1.5, kernel_origin="jit"))
    assert "of which kernel load   | 0.0 s (prebuilt)" in table and "1.5 s (JIT)" in table
    assert "tokens / s" in table and "Speed is tokens/s" in table
    line = demo.format_prebuild({"kernels": "jit", "kernels_s": 95.0, "deepspeed_op_s": 40.0})
    assert "not in their wall times" in line and "C++ kernels 95.0 s (JIT build" in line


# ----------------------------------------------------------------------------- stage-0 wrapper guard (real engines)
def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _cfg(stage, **extra):
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10 ** 6, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "LionCub", "params": {"lr": 1e-3, "betas": [0.9, 0.99]}}}
    cfg.update(extra)
    return cfg


def _rank_env(rank, world_size):
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world_size)})


def _initialize(cfg):
    import deepspeed
    import lioncub_ds.deepspeed  # noqa: F401
    model = _model()
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def _old_bf16_routing(rank, world_size):
    """Stage 0 + bf16 routed to BF16_Optimizer, as DeepSpeed versions that send bf16 with fp32
    gradient accumulation there do (0.19.8 itself routes it to the unpartitioned bf16 wrapper):
    the routing decision is replaced, the engine, the wrapper factory and the guard are real."""
    _rank_env(rank, world_size)
    from deepspeed.runtime.engine import DeepSpeedEngine
    import lioncub_ds.deepspeed  # noqa: F401
    from lioncub_ds.deepspeed import LionCubDeepSpeedError
    DeepSpeedEngine._do_optimizer_sanity_check = lambda self, opt: "bf16"
    try:
        _initialize(_cfg(0, bf16={"enabled": True}))
    except LionCubDeepSpeedError as exc:
        return {"error": str(exc)}
    return {"error": None}


def _stage0_bf16_and_zero1_bf16_fp32_accum(rank, world_size):
    _rank_env(rank, world_size)
    import torch
    from lioncub_ds.deepspeed import LionCubDeepSpeedError
    from lioncub_ds.deepspeed.engine import check_unpartitioned
    out = {}
    eng = _initialize(_cfg(0, bf16={"enabled": True}))  # DeepSpeed's unpartitioned bf16 wrapper: accepted
    out["stage0_wrapper"] = type(eng.optimizer).__name__
    check_unpartitioned(eng, eng.basic_optimizer)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    for _ in range(2):
        loss = eng(x).float().pow(2).mean()
        eng.backward(loss)
        eng.step()
    out["stage0_params"] = [p.detach().float().sum().item() for p in eng.module.parameters()]
    # ZeRO 1, bf16 parameters, fp32 gradient accumulation: DeepSpeed's BF16_Optimizer (partitioned
    # fp32 masters; global Lion there is correct). The stage-0 check recognises the partitioning.
    eng1 = _initialize(_cfg(1, bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}))
    out["zero1_wrapper"] = type(eng1.optimizer).__name__
    try:
        check_unpartitioned(eng1, eng1.basic_optimizer)
        out["zero1_error"] = None
    except LionCubDeepSpeedError as exc:
        out["zero1_error"] = str(exc)
    return out


@needs_deepspeed
def test_stage0_bf16_optimizer_routing_is_a_clear_error():
    from dist_helpers import run_ranks
    res = run_ranks(_old_bf16_routing, 2, env=ENV, timeout=300)
    for r in res:
        e = r["error"]
        assert e is not None, "a stage-0 LionCub inside BF16_Optimizer must not be built"
        for needle in ("zero_optimization.stage=0", "bf16.enabled=true", "BF16_Optimizer", "partitioned",
                       "zero_optimization.stage=1 or 2"):
            assert needle in e, (needle, e)


@needs_deepspeed
def test_stage0_wrapper_must_be_unpartitioned():
    from dist_helpers import run_ranks
    a, b = run_ranks(_stage0_bf16_and_zero1_bf16_fp32_accum, 2, env=ENV, timeout=300)
    for r in (a, b):
        assert r["stage0_wrapper"] != "BF16_Optimizer"
        assert r["zero1_wrapper"] == "BF16_Optimizer"
        e = r["zero1_error"]
        assert e is not None and "BF16_Optimizer" in e and "every rank would vote on a different partition" in e, e
    assert a["stage0_params"] == b["stage0_params"]


# ----------------------------------------------------------------------------- groups created by the integration
def _singleton_lifecycle(rank, world_size):
    import torch
    import torch.distributed as dist
    from lioncub_ds.deepspeed import engine
    g = engine.singleton_group()
    assert engine.singleton_group() is g  # one per process, however many engines
    t = torch.ones(3)
    dist.all_reduce(t, group=g)
    first = engine.destroy_created_groups()
    second = engine.destroy_created_groups()
    w = torch.ones(3)
    dist.all_reduce(w)  # the default group is untouched
    return {"single": t.tolist(), "first": first, "second": second, "world": w.tolist()}


@needs_deepspeed
def test_the_integration_destroys_only_the_groups_it_created():
    from dist_helpers import run_ranks
    for r in run_ranks(_singleton_lifecycle, 2, env=ENV, timeout=300):
        assert r == {"single": [1.0] * 3, "first": 1, "second": 0, "world": [2.0] * 3}, r


def test_shm_workspaces_of_a_launch_are_removed(tmp_path, monkeypatch):
    """lioncub_ds.ds_shm removes exactly the DeepSpeed workspaces of a launch (its port, this user) that
    appeared during it: not another launch's that appeared meanwhile, not those from before; and a
    rank's own name follows DeepSpeed's pattern (uid, MASTER_ADDR, MASTER_PORT, rank)."""
    from lioncub_ds import ds_shm

    monkeypatch.setattr(ds_shm, "SHM_DIR", str(tmp_path))
    uid = os.getuid()
    old = ds_shm.workspace_name(uid, "127.0.0.1", 29501, 0)
    (tmp_path / old).write_bytes(b"x")  # from before: kept
    (tmp_path / "unrelated").write_bytes(b"x")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29501")
    other = [ds_shm.workspace_name(uid, "127.0.0.1", 29500, 0), ds_shm.workspace_name(uid + 1, "127.0.0.1", 29501, 1),
             ds_shm.workspace_name(uid, "a_host", 2950, 0)]
    with ds_shm.removing_launch_workspaces(29501):
        for rank in (1, 2):
            (tmp_path / ds_shm.own_shm_workspace(rank)).write_bytes(b"x")
        for name in other:  # another job's, on its own port (or another user's): not this launch's
            (tmp_path / name).write_bytes(b"x")
        assert len(ds_shm.shm_workspaces()) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([old, "unrelated", *other])
    assert ds_shm.workspace_port(ds_shm.workspace_name(7, "my_host", 1234, 3)) == (7, "1234")
    assert ds_shm.workspace_port(ds_shm.workspace_name(7, "", "", 0)) == (7, "")
    assert ds_shm.workspace_port("deepspeed_allreduce_buffer_x") is None
    assert ds_shm.own_shm_workspace(3) == f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_29501_3"


# ----------------------------------------------------------------------------- a save that fails on one rank
def _save_fails_on_one_rank(rank, world_size, directory):
    """Stage 0: rank 1 cannot write its LionCub file (disk full, injected into the file write);
    every rank raises from save_checkpoint (none waits in a barrier), and DeepSpeed wrote no
    checkpoint of that tag. A save after it works."""
    import time
    import torch
    _rank_env(rank, world_size)
    from lioncub_ds import checkpoint as lc_checkpoint
    eng = _initialize(_cfg(0))
    x = torch.randn(4, 16)
    eng.backward(eng(x).pow(2).mean())
    eng.step()
    real_save = lc_checkpoint.save

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    if rank == 1:
        lc_checkpoint.save = full_disk
    t = time.perf_counter()
    try:
        eng.save_checkpoint(directory, tag="bad")
        err = None
    except Exception as exc:  # noqa: BLE001
        err = f"{type(exc).__name__}: {exc}"
    waited = time.perf_counter() - t
    lc_checkpoint.save = real_save
    eng.save_checkpoint(directory, tag="good")
    return {"error": err, "seconds": waited}


@needs_deepspeed
def test_a_save_that_fails_on_one_rank_raises_on_every_rank(tmp_path):
    from dist_helpers import run_ranks
    a, b = run_ranks(_save_fails_on_one_rank, 2, str(tmp_path), env=ENV, timeout=300)
    assert b["error"] is not None and "No space left on device" in b["error"], b
    assert a["error"] is not None and "another rank could not write its LionCub state" in a["error"], a
    assert not (tmp_path / "bad" / "mp_rank_00_model_states.pt").exists()
    assert (tmp_path / "good" / "mp_rank_00_model_states.pt").exists()


@pytest.mark.unit
@needs_deepspeed
def test_zero3_votes_pick_the_ranks_device_as_deepspeed_will(monkeypatch):
    """ZeRO-3 with votes runs collectives before DeepSpeed's engine picks the GPU: the wrapper makes
    the rank's device current first (args.device_rank, else LOCAL_RANK, as the engine picks it);
    a single process without LOCAL_RANK is left alone."""
    from types import SimpleNamespace

    from lioncub_ds.deepspeed.zero3 import select_device

    class Recorder:
        def __init__(self):
            self.calls = []

        def set_device(self, index):
            self.calls.append(index)

    acc = Recorder()
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert select_device(None, acc) == 3
    assert select_device(SimpleNamespace(device_rank=5), acc) == 5
    assert select_device(SimpleNamespace(device_rank=None, other=1), acc) == 3
    monkeypatch.delenv("LOCAL_RANK")
    assert select_device(None, acc) is None
    assert acc.calls == [3, 5, 3]


def _client_optimizer_cases(rank, world_size):
    """(a) deepspeed.initialize refuses a client LionCub (ZeRO-Offload with a client optimizer): the
    optimizer still votes over its ranks afterwards (it was moved onto a one-rank group for stage 1);
    (b) a torch LR scheduler's wrapper on the client LionCub survives initialize (bf16 stage 0);
    (c) the eps / Adam-betas warnings also at stage 3 with voters="node"."""
    _rank_env(rank, world_size)
    import logging
    import warnings

    import deepspeed
    import torch
    import lioncub_ds.deepspeed  # noqa: F401
    from lioncub_ds import LionCub
    from lioncub_ds.deepspeed import _compat
    out = {}
    model = _model()
    opt = LionCub(model.parameters(), lr=1e-3)
    cfg = _cfg(1, gradient_clipping=0.0)
    del cfg["optimizer"]
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    try:
        deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        out["refused"] = None
    except Exception as exc:  # noqa: BLE001 - DeepSpeed's own refusal
        out["refused"] = type(exc).__name__
    out["after"] = (opt.world_size, opt.distributed)

    model = _model().to(torch.bfloat16)
    opt = LionCub(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    cfg = _cfg(0, bf16={"enabled": True}, gradient_clipping=0.0)
    del cfg["optimizer"]
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
    out["kept_step"] = "step" in opt.__dict__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.randn(4, 16, dtype=torch.bfloat16)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    out["overridden_warning"] = any("overridden" in str(w.message) for w in caught)

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    _compat.ds_logger().addHandler(handler)
    try:
        cfg = _cfg(3)
        cfg["optimizer"]["params"].update(betas=[0.9, 0.999], eps=1e-8, voters="node", node_size=1)
        _initialize(cfg)
    finally:
        _compat.ds_logger().removeHandler(handler)
    text = [r.getMessage() for r in records]
    out["stage3_warnings"] = [m for m in text if "eps" in m or "0.999" in m]
    return out


@needs_deepspeed
def test_initialize_leaves_a_client_lioncub_voting_its_scheduler_wrapped_and_warns_at_stage_3():
    from dist_helpers import run_ranks
    a, b = run_ranks(_client_optimizer_cases, 2, env=ENV, timeout=300)
    for r in (a, b):
        assert r["refused"] is not None and r["after"] == (2, True), r
        assert r["kept_step"] and not r["overridden_warning"], r
    assert len(a["stage3_warnings"]) >= 2, a["stage3_warnings"]  # rank 0 logs them


def _fp16_stage0_gradients(rank, world_size):
    """fp16 at stage 0: per step, the norm of the gradient LionCub receives, against the same
    model's gradient computed in fp32 beside it (a float copy of the current fp16 weights), at a
    loss scale of 4096; then with gradient_clipping 0.01. (The scale is kept: on a step where it
    grows, DeepSpeed's wrapper raises it before it unscales, for every optimizer alike.)"""
    _rank_env(rank, world_size)
    import copy

    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    import lioncub_ds.deepspeed  # noqa: F401
    get_accelerator().is_fp16_supported = lambda: True  # torch runs fp16 Linear on CPU (test-only)
    out = {}
    for label, clip in (("plain", 0.0), ("clipped", 0.01)):
        model = _model()
        cfg = _cfg(0, fp16={"enabled": True, "initial_scale_power": 12, "loss_scale_window": 1000},
                   gradient_clipping=clip)
        cfg["optimizer"]["params"]["weight_decay"] = 0.0
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        lc = engine.basic_optimizer
        got = []
        lc.register_step_pre_hook(lambda o, a, k: got.append(float(torch.sqrt(sum(
            (p.grad.float() ** 2).sum() for g in o.param_groups for p in g["params"])))))
        rows = []
        for step in range(6):
            gen = torch.Generator().manual_seed(100 * rank + step)
            x = torch.randn(4, 16, generator=gen)
            ref_model = copy.deepcopy(engine.module).float()
            ref_loss = ref_model(x).pow(2).mean()
            ref = float(torch.sqrt(sum((g ** 2).sum() for g in torch.autograd.grad(ref_loss, list(ref_model.parameters())))))
            loss = engine(x.half()).float().pow(2).mean()
            returned = engine.backward(loss)
            scale = float(engine.optimizer.loss_scale_config.cur_scale)
            engine.step()
            rows.append((ref, got[-1] if got else None, scale, float(returned), float(loss)))
        out[label] = rows
    return out


@needs_deepspeed
def test_fp16_at_stage_0_hands_lioncub_the_true_gradient_and_clips_it():
    """DeepSpeed 0.19's engine.backward leaves the loss unscaled for its stage-0 fp16 wrapper, which
    still divides by the loss scale: LionCub got gradient / scale and clipping never fired."""
    from dist_helpers import run_ranks
    for r in run_ranks(_fp16_stage0_gradients, 2, env=ENV, timeout=300):
        assert all(row[2] == 2 ** 12 for row in r["plain"]), r["plain"]  # gradients reach LionCub unscaled
        for ref, got, scale, returned, loss in r["plain"]:
            assert got is not None and abs(got / ref - 1) < 0.02, (ref, got, scale)
            assert returned == loss  # engine.backward still returns the unscaled loss
        for ref, got, scale, _, _ in r["clipped"]:
            assert ref > 0.011 and abs(got - 0.01) < 1e-4, (ref, got, scale)


def _second_engine_on_the_same_model(rank, world_size):
    """Two deepspeed.initialize calls on one model, both with overlap=true: after the second, the
    first optimizer (DeepSpeed keeps its engine alive) starts no votes in the new engine's backward."""
    _rank_env(rank, world_size)
    import deepspeed
    import torch
    import lioncub_ds.deepspeed  # noqa: F401
    model = _model()
    cfg = _cfg(0, gradient_clipping=0.0)
    cfg["optimizer"]["params"].update(comm="1bit", overlap=True)

    def train(engine, steps):
        for step in range(steps):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * rank + step))
            engine.backward(engine(x).pow(2).mean())
            engine.step()
    first, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    train(first, 2)
    old = first.basic_optimizer
    before = old.overlap_counts["batches_launched_in_backward"]
    second, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    train(second, 2)
    return {"old_before": before, "old_after": old.overlap_counts["batches_launched_in_backward"],
            "new": second.basic_optimizer.overlap_counts["batches_launched_in_backward"]}


@needs_deepspeed
def test_a_second_engine_takes_the_overlap_hooks_over():
    from dist_helpers import run_ranks
    for r in run_ranks(_second_engine_on_the_same_model, 2, env=ENV, timeout=300):
        assert r["old_before"] > 0 and r["new"] > 0, r  # both overlapped while they owned the model
        assert r["old_after"] == r["old_before"], r
