"""DeepSpeed integration: real DeepSpeed on CPU (DS_ACCELERATOR=cpu, gloo), 2 ranks.

One launch of ``tests/deepspeed_script.py`` under the ``deepspeed`` launcher plays
every scenario (each launch costs 30-90 s here, most of it imports); the tests below
check its per-rank JSON. The script never imports lioncub_ds: ``"type": "LionCub"``
resolves through the lazy hook (``lioncub_ds_autohook.pth``). When the package is not
installed in this interpreter's site-packages (e.g. a stale editable install), the test
puts the same ``.pth`` in a temporary site directory processed by Python's own ``site``
machinery (``site.addsitedir`` from a ``sitecustomize``), which exercises the same code.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from lioncub_ds.testing import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "deepspeed_script.py"
HOOK_DIR = ROOT / "lioncub_ds" / "deepspeed"

deepspeed_missing = pytest.mark.skipif(
    __import__("importlib").util.find_spec("deepspeed") is None, reason="deepspeed not installed")


def _hook_installed() -> bool:
    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    return any(os.path.exists(os.path.join(d, "lioncub_ds_autohook.pth")) for d in dirs)


def _shim(tmp: Path) -> Path:
    """A PYTHONPATH entry whose sitecustomize processes our .pth like site-packages would."""
    sitedir = tmp / "site"
    sitedir.mkdir(parents=True, exist_ok=True)
    for name in ("lioncub_ds_autohook.pth", "lioncub_ds_autohook.py"):
        shutil.copy(HOOK_DIR / name, sitedir / name)
    (tmp / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(sitedir)!r})\n")
    return tmp


def _env(tmp: Path) -> dict:
    env = dict(os.environ)
    paths = [str(ROOT)]
    if not _hook_installed():
        paths.insert(0, str(_shim(tmp / "shim")))
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "LIONCUB_DS_AUTOREGISTER": "1"})
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions"))
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Launch the scenario script once; return [rank0 results, rank1 results]."""
    tmp = tmp_path_factory.mktemp("ds")
    out = tmp / "out"
    launcher = Path(sys.executable).with_name("deepspeed")
    cmd = [str(launcher) if launcher.exists() else "deepspeed", "--num_accelerators", "2",
           "--master_port", str(free_port()), str(SCRIPT), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=str(tmp), env=_env(tmp), capture_output=True, text=True, timeout=1500)
    files = [out / f"rank{r}.json" for r in range(2)]
    if proc.returncode != 0 or not all(f.exists() for f in files):
        raise AssertionError(f"deepspeed launch failed (rc={proc.returncode}):\n{proc.stdout[-6000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return [json.loads(f.read_text()) for f in files]


def _scenario(runs, name):
    a, b = runs[0][name], runs[1][name]
    for r in (a, b):
        assert "exception" not in r, f"{name}: {r.get('exception')}\n{r.get('traceback')}"
    return a, b


def _common_ok(a, b, *, min_drop=0.05):
    assert a["params"] == b["params"], "parameters differ across ranks"
    for r in (a, b):
        assert r["eval_loss"] < r["init_eval_loss"] - min_drop, (r["init_eval_loss"], r["eval_loss"])
        assert r["optimizer"] == "LionCub"


# ----------------------------------------------------------------------------- registration
@deepspeed_missing
def test_unmodified_script_gets_lioncub_from_the_lazy_hook(runs):
    src = SCRIPT.read_text()
    assert not re.search(r"^\s*(import|from)\s+lioncub_ds", src, re.M), "the script must not import lioncub_ds"
    for r in runs:
        assert r["hook_registered"] is True


@pytest.mark.unit
def test_ds_config_params_are_validated_with_suggestions():
    from lioncub_ds import LionCubConfigError
    from lioncub_ds.deepspeed.engine import split_params

    kwargs, options = split_params({"lr": 1e-4, "betas": [0.95, 0.98], "comm": "1bit", "zero_allgather": "sign"})
    assert kwargs == {"lr": 1e-4, "betas": [0.95, 0.98], "comm": "1bit"}
    assert options == {"zero_allgather": "sign", "zero_fp32_replica": False}
    with pytest.raises(LionCubConfigError, match=r"'beta'.*did you mean 'betas'"):
        split_params({"beta": [0.9, 0.99]})
    with pytest.raises(LionCubConfigError, match=r"did you mean 'zero_fp32_replica'"):
        split_params({"zero_fp32_replicas": True})
    with pytest.raises(LionCubConfigError, match=r"comm='2bit'"):
        split_params({"comm": "2bit"})
    with pytest.raises(LionCubConfigError, match="gradient_clipping"):
        split_params({"max_grad_norm": 1.0})
    with pytest.raises(LionCubConfigError, match="zero_allgather"):
        split_params({"zero_allgather": "bits"})


def test_autohook_is_cheap_and_fires_only_on_deepspeed(tmp_path):
    """Interpreter start-up with the .pth: no torch, no lioncub_ds; a (fake) deepspeed import fires it once."""
    shim = _shim(tmp_path / "shim")
    fake = tmp_path / "fake"
    (fake / "deepspeed").mkdir(parents=True)
    (fake / "deepspeed" / "__init__.py").write_text("LOADED = True\n")
    code = (
        "import sys\n"
        "assert 'torch' not in sys.modules and 'lioncub_ds' not in sys.modules, sorted(sys.modules)\n"
        "hooks = [f for f in sys.meta_path if getattr(f, '_lioncub_ds_autohook', False)]\n"
        "assert len(hooks) == 1 and sys.meta_path[0] is hooks[0]\n"
        "import json, importlib\n"
        "import deepspeed\n"
        "print(json.dumps({'loaded': deepspeed.LOADED, 'loader': type(deepspeed.__loader__).__name__,\n"
        "  'hooks_left': sum(getattr(f, '_lioncub_ds_autohook', False) for f in sys.meta_path),\n"
        "  'registered_tried': 'lioncub_ds' in sys.modules}))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim), str(fake), str(ROOT)]),
               LIONCUB_DS_AUTOREGISTER="1")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    # The fake package has no deepspeed.runtime: registration is attempted, warns, never breaks the import.
    assert info == {"loaded": True, "loader": "SourceFileLoader", "hooks_left": 0, "registered_tried": True}
    # Opt-out: nothing installed.
    env["LIONCUB_DS_AUTOREGISTER"] = "0"
    proc = subprocess.run([sys.executable, "-c", "import sys; print(sum(getattr(f, '_lioncub_ds_autohook', False) "
                           "for f in sys.meta_path))"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "0", proc.stderr
    # Start-up cost of the hook module itself (python -X importtime, self time in microseconds).
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"],
                          env=dict(env, LIONCUB_DS_AUTOREGISTER="1"),
                          capture_output=True, text=True, timeout=120)
    line = [ln for ln in proc.stderr.splitlines() if ln.rstrip().endswith("lioncub_ds_autohook")]
    assert line, proc.stderr[-2000:]
    self_us = int(line[0].split("|")[0].split(":")[1])
    assert self_us < 50_000, f"hook import took {self_us} us"


@pytest.mark.unit
def test_local_clipping_rule():
    """gradient_clipping at stage 0 scales each rank's LOCAL gradient to the clip norm (no communication)."""
    from lioncub_ds.deepspeed.engine import clip_local_gradients

    lin = torch.nn.Linear(3, 2)
    for p in lin.parameters():
        p.grad = torch.full_like(p, 2.0)
    norm0 = float(torch.sqrt(sum((p.grad ** 2).sum() for p in lin.parameters())))
    eng = types.SimpleNamespace(module=lin, mpu=None, gradient_clipping=lambda: 1.0)
    assert float(clip_local_gradients(eng)) == pytest.approx(norm0)
    norm1 = float(torch.sqrt(sum((p.grad ** 2).sum() for p in lin.parameters())))
    assert norm1 == pytest.approx(1.0, rel=1e-5)
    # the same bits as a host-side coefficient would give (min(1, clip / (norm + 1e-6)) as a Python float)
    for p in lin.parameters():
        p.grad = torch.full_like(p, 2.0)
    want = [p.grad * (1.0 / (norm0 + 1e-6)) for p in lin.parameters()]
    clip_local_gradients(eng)
    assert all(torch.equal(p.grad, w) for p, w in zip(lin.parameters(), want))
    eng.gradient_clipping = lambda: 10.0  # below the clip: untouched
    before = [p.grad.clone() for p in lin.parameters()]
    assert float(clip_local_gradients(eng)) == pytest.approx(1.0, rel=1e-5)
    assert all(torch.equal(p.grad, b) for p, b in zip(lin.parameters(), before))


# ----------------------------------------------------------------------------- stage 0
@deepspeed_missing
def test_stage0_fp32_local_momentum_no_gradient_allreduce(runs):
    a, b = _scenario(runs, "fp32_stage0")
    _common_ok(a, b)
    assert a["momenta"] != b["momenta"], "each rank must keep its own momentum"
    for r in (a, b):
        assert r["enable_backward_allreduce"] is False
        assert r["lioncub_world_size"] == 2
        c = r["collectives"]
        assert c["float_reduce_calls"] == 0, f"a gradient all-reduce happened: {c['by_name']}"
        assert c["float_allgather_calls"] == 0, c["by_name"]
        # Not even a 1-element float all-reduce: gradient_clipping uses the LOCAL norm (DeepSpeed's fp32
        # clip would average the norm across ranks).
        assert not [k for k in c["by_name"] if k.startswith("all_reduce:torch.float")], c["by_name"]
        assert c["int_calls"] >= r["lioncub_step_count"]  # a vote per step (the flags ride in it or follow it)
        # votes, not gradients: far below an fp32 all-reduce even on this small model, where the
        # step's fixed ~80 bytes of flags weigh in (a large model approaches 32x)
        assert r["comm_stats"]["cumulative"]["ratio_vs_fp32"] > 12


@deepspeed_missing
def test_stage0_scheduler_drives_lioncub_lr(runs):
    a, _ = _scenario(runs, "fp32_stage0")
    lrs = [t["lr"][0] for t in a["trace"]]
    assert max(lrs) == pytest.approx(4e-3) and lrs[0] < lrs[-1], lrs  # WarmupLR ramps to warmup_max_lr
    assert lrs == sorted(lrs)
    for t in a["trace"]:  # weight_decay=0: every moved coordinate moves by exactly lr (sign update)
        assert t["max_change"] == pytest.approx(t["lr"][0], rel=1e-3, abs=1e-9), t
        assert t["not_lr_moves"] == 0, t  # every coordinate, exactly
        assert (t["moved"] > 0) == (t["lr"][0] > 0), t


@deepspeed_missing
def test_stage0_gradient_accumulation_one_vote_per_step(runs):
    a, b = _scenario(runs, "gas3_stage0")
    _common_ok(a, b)
    for r in (a, b):
        assert r["global_steps"] == 4 and r["lioncub_step_count"] == 4
        by = r["collectives"]["by_name"]
        assert by.get("all_reduce:torch.int32") == 4, by  # one control flag per optimizer step (not per micro-step)
        assert by.get("all_reduce:torch.uint8") == 4, by  # one pbit vote per optimizer step
        assert r["collectives"]["float_reduce_calls"] == 0, by


@deepspeed_missing
def test_stage0_bf16(runs):
    a, b = _scenario(runs, "bf16_stage0")
    _common_ok(a, b)
    for r in (a, b):
        assert r["engine_optimizer"] == "FP16_UnfusedOptimizer"
        assert r["collectives"]["float_reduce_calls"] == 0, r["collectives"]["by_name"]
        assert r["lioncub_step_count"] == 6  # DeepSpeed's zero-gradient "init" step is not counted


@deepspeed_missing
def test_stage0_fp16_overflow_on_one_rank_skips_on_all(runs):
    a, b = _scenario(runs, "fp16_stage0_overflow")
    _common_ok(a, b, min_drop=0.02)
    def keys(r):
        return [(t["loss_scale"], t["skipped"], t["lr"]) for t in r["trace"]]
    assert keys(a) == keys(b)
    for r in (a, b):
        assert r["skipped_steps"] == 1 and r["lioncub_step_count"] == 5
        scales = [t["loss_scale"] for t in r["trace"]]
        assert scales[1] == 2 * scales[2], scales  # backed off at the injected step, identically on both ranks
        assert r["trace"][2]["max_change"] == 0.0
        assert r["collectives"]["float_reduce_calls"] == 0


@deepspeed_missing
def test_stage0_bf16_norm_overflow_on_one_rank_skips_on_all(runs):
    """DeepSpeed's bf16 / fp16 wrapper skips a step by its own rank's gradient norm after the
    overflow check it agrees on: a finite bf16 gradient of 1e20 on one rank overflows that rank's
    fp32 norm only. The skip is agreed over the data-parallel group: every rank skips that step."""
    a, b = _scenario(runs, "bf16_stage0_huge_grad")
    assert a["params"] == b["params"], "parameters differ across ranks"
    assert [t["skipped"] for t in a["trace"]] == [t["skipped"] for t in b["trace"]]
    for r in (a, b):
        assert r["engine_optimizer"] == "FP16_UnfusedOptimizer"
        assert r["skipped_steps"] == 1 and r["lioncub_step_count"] == 4, (r["skipped_steps"], r["lioncub_step_count"])
        assert r["trace"][2]["max_change"] == 0.0


@deepspeed_missing
def test_stage0_bf16_overflow_on_one_sequence_parallel_rank_skips_on_both(runs):
    """The two ranks of one replica (sequence-parallel 2) vote together; DeepSpeed's bf16 wrapper
    agrees its overflow check over its data- and model-parallel groups (each rank alone here), so
    the check is agreed over the vote group too: an inf on one rank skips the step on both."""
    a, b = _scenario(runs, "sequence_parallel_bf16_overflow")
    assert a["params"] == b["params"]
    for r in (a, b):
        assert r["engine_optimizer"] == "FP16_UnfusedOptimizer"
        assert r["skipped_steps"] == 1 and r["lioncub_step_count"] == 2, (r["skipped_steps"], r["lioncub_step_count"])


@deepspeed_missing
def test_stage0_fp32_nonfinite_on_one_rank_skips_on_all(runs):
    a, b = _scenario(runs, "fp32_nan_stage0")
    _common_ok(a, b, min_drop=0.02)
    for r in (a, b):
        assert r["skipped_steps"] == 1 and r["lioncub_step_count"] == 4
        assert r["trace"][2]["max_change"] == 0.0


@deepspeed_missing
def test_stage0_no_float_allreduce_harness_positive_control(runs):
    """The same harness with LionCub off (torch SGD): it does count DeepSpeed's gradient all-reduce."""
    a, b = _scenario(runs, "control_sgd_stage0")
    for r in (a, b):
        assert r["optimizer"] == "SGD" and r["enable_backward_allreduce"] is True
        c = r["collectives"]
        assert c["float_reduce_calls"] >= 2, c["by_name"]  # one gradient all-reduce per step at least
        assert c["float_reduce_max_numel"] >= r["flat_numel"] // 2, c
    assert a["params"] == b["params"]


@deepspeed_missing
@pytest.mark.parametrize("name", ["bruteforce_stage0", "bruteforce_stage0_pbit"])
def test_stage0_engine_equals_brute_force_vote(runs, name):
    """Through the real DeepSpeed engine: every parameter, every step, equals a literal majority vote
    over both ranks' gradients and momenta (computed in the script, compared exactly)."""
    a, b = _scenario(runs, name)
    for r in (a, b):
        assert r["steps"] == 5 and r["lioncub_step_count"] == 5
        assert r["mismatched_elements"] == 0, r
        assert r["moved"] > 0 and r["ties"] > 0, r  # 2 ranks: ties happen, and the tie rule is checked
    assert a["params"] == b["params"]


@deepspeed_missing
def test_frozen_parameters_handed_to_lioncub_at_stage0_train_and_stay(runs):
    a, b = _scenario(runs, "frozen_stage0")
    assert a["params"] == b["params"]
    for r in (a, b):
        assert r["frozen_unchanged"] and r["trained"], r


@deepspeed_missing
def test_a_weights_only_load_behind_the_bf16_wrapper_steps_from_the_loaded_weights(runs):
    for r in _scenario(runs, "bf16_stage0_weights_only_load"):
        assert r["loaded_equal"], r
        # one Lion step moves a weight by lr (plus a bf16 rounding of the weight); the stale masters
        # of the other init moved it by ~1
        assert r["max_move"] < 4 * r["lr"] + 0.02, r


@deepspeed_missing
def test_a_checkpoint_missing_on_one_node_stops_every_rank_unchanged(runs):
    a, b = runs[0]["node_local_missing_stage0"], runs[1]["node_local_missing_stage0"]
    for r in (a, b):
        assert r["error"] and r["error"].startswith("CheckpointError") and "no rank changed its state" in r["error"], r
        assert r["unchanged"], r
    assert "this rank finds no per-rank LionCub files" in b["error"], b


@deepspeed_missing
def test_sequence_parallel_ranks_of_one_replica_vote_together_and_stay_identical(runs):
    a, b = _scenario(runs, "sequence_parallel_stage0")
    assert "N=2" in a["summary"], a["summary"]  # the sequence-data group, not the data-parallel group of 1
    assert a["params"] == b["params"]


@deepspeed_missing
def test_invalid_settings_fail_in_deepspeed_initialize_before_any_state(runs):
    """The INVALID table of test_config_validation through deepspeed.initialize (ds_config entry point):
    LionCubConfigError naming the key, before torch.optim.Optimizer.__init__ runs, parameters untouched."""
    from test_config_validation import INVALID, _ds_pattern
    for r in runs:
        got = r["err_table"]
        assert "exception" not in got, got
        assert set(got) - {"wall_s"} == {case[0] for case in INVALID}
        for case_id, kwargs, pattern in INVALID:
            e = got[case_id]
            if set(kwargs) == {"eps"}:  # HF's DeepSpeed template carries "eps": accepted, dropped with a warning
                assert e["error_type"] is None and e["optimizer_inits"] == ["LionCub"], (case_id, e)
                continue
            assert e["error_type"] == "LionCubConfigError", (case_id, e)
            assert re.search(_ds_pattern(pattern), e["error"]), (case_id, e["error"])
            assert e["optimizer_inits"] == [] and e["params_untouched"], (case_id, e)


@deepspeed_missing
def test_nccl_contract_holds_through_deepspeed(runs):
    """Every collective of the whole run (DeepSpeed init, every scenario) on the parameters' device, with
    dtype/op pairs NCCL supports, and the same sequence on both ranks."""
    from lioncub_ds.testing import nccl_contract
    snaps = [r["nccl_contract"] for r in runs]
    for r, snap in enumerate(snaps):
        assert snap["violations"] == [], f"rank {r}: {snap['violations'][0]}"
        assert len(snap["log"]) > 50
    diff = nccl_contract.compare_logs(snaps)
    assert diff is None, diff


# ----------------------------------------------------------------------------- ZeRO
@deepspeed_missing
@pytest.mark.parametrize("name,ratio", [("zero1_fp32_sign", 25), ("zero2_fp32_sign", 25),
                                        ("zero1_bf16_replica", 12), ("zero2_bf16_replica", 12)])
def test_zero_sign_allgather(runs, name, ratio):
    a, b = _scenario(runs, name)
    _common_ok(a, b)
    for r in (a, b):
        assert r["lioncub_world_size"] == 1, "LionCub must not vote inside ZeRO"
        assert r["enable_backward_allreduce"] is True  # ZeRO reduces gradients: global-Lion semantics
        c = r["collectives"]
        assert c["float_allgather_calls"] == 0, f"parameters were all-gathered: {c['by_name']}"
        # the signs travel as uint8 all-gathers (whatever torch calls the API), every parameter's bit each step
        assert c["uint8_allgather_calls"] >= 3, c["by_name"]
        assert c["uint8_allgather_bytes"] * 8 >= c["uint8_allgather_calls"] * r["flat_numel"], c
        cs = r["comm_stats"]
        assert cs["zero_allgather"] == "sign" and cs["ratio_vs_param_allgather"] > ratio, cs
        if "bf16" in name:  # the fp32 replica: 4 bytes per (padded) parameter on every rank
            assert cs["extra_memory_bytes"] >= 4 * r["flat_numel"]
        else:
            assert cs["extra_memory_bytes"] == 0


@deepspeed_missing
@pytest.mark.parametrize("sign,params", [("zero1_fp32_sign", "zero1_fp32_params"),
                                         ("zero1_bf16_replica", "zero1_bf16_params")])
def test_zero_sign_allgather_matches_parameter_allgather_bit_for_bit(runs, sign, params):
    s, _ = _scenario(runs, sign)
    p, _ = _scenario(runs, params)
    assert p["comm_stats"]["zero_allgather"] == "params"
    assert p["collectives"]["float_allgather_calls"] > 0
    assert s["params"] == p["params"] and s["momenta"] == p["momenta"]


@deepspeed_missing
def test_zero_scheduler(runs):
    a, _ = _scenario(runs, "zero1_fp32_sign")
    lrs = [t["lr"][0] for t in a["trace"]]
    peak = lrs.index(max(lrs))
    assert max(lrs) == pytest.approx(3e-3) and 0 < peak < len(lrs) - 1 and lrs[-1] < max(lrs), lrs  # WarmupDecayLR


# ----------------------------------------------------------------------------- checkpoints
@deepspeed_missing
@pytest.mark.parametrize("name", ["fp32_stage0", "zero2_fp32_sign", "zero2_bf16_replica"])
def test_checkpoint_resume_is_bit_identical(runs, name):
    a, b = _scenario(runs, name)
    for r in (a, b):
        assert r["resume_loaded"]
        assert r["resumed"]["params"] == r["params"] and r["resumed"]["momenta"] == r["momenta"]
        assert r["resumed"]["losses"] == r["losses"][-len(r["resumed"]["losses"]):]
    if name == "fp32_stage0":
        assert a["rank_files"] == ["lioncub-rank00000-of-00002.pt", "lioncub-rank00001-of-00002.pt"]
        assert a["resumed"]["momenta"] != b["resumed"]["momenta"]  # each rank got ITS momentum back


# ----------------------------------------------------------------------------- errors
@deepspeed_missing
def test_clear_errors(runs):
    for r in runs:
        e = r["err_misspelled"]
        assert e["error_type"] == "LionCubConfigError" and "did you mean 'weight_decay'" in e["error"], e
        e = r["err_node_stage2"]
        assert e["error_type"] == "LionCubDeepSpeedError" and "zero_optimization.stage=2" in e["error"], e
        assert "voters='node'" in e["error"] and "stage=3" in e["error"], e  # the way out is named
        e = r["err_offload_stage0"]
        assert e["error_type"] == "LionCubDeepSpeedError" and "offload_optimizer.device='cpu'" in e["error"], e
        assert "stage 1, 2 or 3" in e["error"], e
