"""The Hugging Face Trainer with ``"type": "LionCub"`` in its ds_config, as a user runs it.

One launch of ``tests/hf_trainer_driver.py`` under the ``deepspeed`` launcher on 2 CPU ranks
(gloo) runs ``examples/hf_trainer_lioncub.py`` (a plain HF script: it never imports
lioncub_ds) four times: ZeRO 0 and ZeRO 1, each a full run that saves a checkpoint half-way
and a resume from that checkpoint on a freshly initialised model. The ds_config is the
HF-style template ``configs/ds_hf_lioncub.json`` (``"auto"`` values; no ``eps``: Lion has none, and
the template draws no LionCub warning). Needs transformers and accelerate (pinned in requirements.txt).
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lioncub_ds.testing import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "hf_trainer_driver.py"
CONFIG = ROOT / "configs" / "ds_hf_lioncub.json"
STEPS, SAVE = 16, 8

_missing = [m for m in ("transformers", "accelerate", "deepspeed") if importlib.util.find_spec(m) is None]
needs_hf = pytest.mark.skipif(bool(_missing), reason=f"not installed: {', '.join(_missing)}")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "LIONCUB_DS_AUTOREGISTER": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions"))
    return env


def launch(out: Path, *args, timeout=900, ranks=2):
    launcher = Path(sys.executable).with_name("deepspeed")
    cmd = [str(launcher) if launcher.exists() else "deepspeed", "--num_accelerators", str(ranks), "--master_port",
           str(free_port()), str(DRIVER), "--config", str(CONFIG), "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=str(out.parent), env=_env(), capture_output=True, text=True, timeout=timeout)
    return proc, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    if _missing:
        pytest.skip(f"not installed: {', '.join(_missing)}")
    out = tmp_path_factory.mktemp("hf") / "out"
    proc, log = launch(out, "--stages", "0,1", "--steps", str(STEPS), "--save", str(SAVE))
    if proc.returncode != 0:
        raise AssertionError(f"HF Trainer launch failed (rc={proc.returncode}):\n{log[-8000:]}")
    res = {}
    for stage in (0, 1):
        for name in ("full", "resume"):
            res[stage, name] = [json.loads((out / f"stage{stage}" / f"{name}.rank{r}.json").read_text())
                                for r in range(2)]
    return res, log


@pytest.mark.parametrize("stage,wrapper", [(0, "LionCub"), (1, "DeepSpeedZeroOptimizer")])
def test_hf_trainer_trains_with_identical_replicas(hf, stage, wrapper):
    res, _ = hf
    a, b = res[stage, "full"]
    for r in (a, b):
        assert r["world_size"] == 2 and r["global_step"] == STEPS
        assert r["optimizer"] == "LionCub" and r["engine_optimizer"] == wrapper
        first, last = r["losses"][0][1], sum(x[1] for x in r["losses"][-3:]) / 3
        assert last < first - 0.4, r["losses"]  # ln(64) = 4.16 at the start
    assert a["digest"] == b["digest"], "parameters differ across ranks"
    assert a["losses"] == b["losses"]


@pytest.mark.parametrize("stage", [0, 1])
def test_hf_trainer_resume_is_bit_exact(hf, stage):
    res, _ = hf
    for full, resumed in zip(res[stage, "full"], res[stage, "resume"]):
        assert resumed["global_step"] == STEPS
        # the resumed model started from another init: everything came from checkpoint-SAVE
        assert resumed["digest"] == full["digest"]
        after = [x for x in full["losses"] if x[0] > SAVE]
        assert [x for x in resumed["losses"] if x[0] > SAVE] == after and len(after) == STEPS - SAVE


def test_hf_template_draws_no_warning_and_the_path_is_logged_once(hf):
    res, log = hf
    engines = 4  # 2 stages x (full, resume)
    assert log.count("LionCub ignores") == 0, log[-4000:]  # the shipped template has no eps
    assert log.count("LionCub got betas=") == 0  # the driver passes Lion's betas
    # rank 0 only, through DeepSpeed's logger: one line per engine, not one per rank
    lines = [ln for ln in log.splitlines() if "LionCub: ZeRO stage" in ln]
    assert len(lines) == engines, lines
    s0 = [ln for ln in lines if "ZeRO stage 0" in ln]
    s1 = [ln for ln in lines if "ZeRO stage 1" in ln]
    assert len(s0) == len(s1) == 2
    for ln in s0:
        assert "local momentum" in ln and "comm=auto" in ln and "N=2" in ln and "wrapper=LionCub" in ln, ln
    for ln in s1:
        assert "global Lion" in ln and "N=2" in ln and "sign all-gather=on" in ln, ln
        assert "wrapper=DeepSpeedZeroOptimizer" in ln, ln


@needs_hf
def test_hf_trainer_overlap_with_accumulation_is_bit_identical(tmp_path):
    """``"overlap": true`` in the HF template at ZeRO 0 with 2 micro-batches per step: the same
    losses and parameters as without overlap (the votes start in the boundary micro-batch's
    backward, through HF's set_gradient_accumulation_boundary), on identical replicas. Both runs
    add ``"eps": "auto"`` as HF's own templates have it: accepted, ignored, one warning on rank 0."""
    runs = {}
    for name, extra in (("off", []), ("on", ["--overlap"])):
        out = tmp_path / name / "out"
        out.parent.mkdir()
        proc, log = launch(out, "--stages", "0", "--steps", "6", "--save", "100", "--grad-accum", "2",
                           "--no-resume", "--eps-auto", *extra)
        assert proc.returncode == 0, log[-8000:]
        # one engine in this launch: one line, from rank 0 only (DeepSpeed's logger)
        assert log.count("LionCub ignores optimizer.params eps=1e-08") == 1, log[-4000:]
        runs[name] = [json.loads((out / "stage0" / f"full.rank{r}.json").read_text()) for r in range(2)], log
    (off, _), (on, log_on) = runs["off"], runs["on"]
    assert "overlap=on" in log_on, log_on[-4000:]
    for a, b in zip(off, on):
        assert a["global_step"] == b["global_step"] == 6
        assert a["losses"] == b["losses"]
        assert a["digest"] == b["digest"]
    assert on[0]["digest"] == on[1]["digest"]


@needs_hf
def test_hf_trainer_node_voters_trains_and_resumes_bit_exact(tmp_path):
    """The HF template with ``"voters": "node", "node_size": 2`` added to its optimizer params, on
    4 ranks (2 node groups x 2 ranks) at ZeRO 0: the loss goes down, the replicas are identical,
    and a resume from HF's checkpoint (every rank's shard file) ends bit-identical."""
    steps, save = 8, 4
    out = tmp_path / "out"
    proc, log = launch(out, "--stages", "0", "--steps", str(steps), "--save", str(save), "--node-size", "2",
                       ranks=4)
    assert proc.returncode == 0, log[-8000:]
    full = [json.loads((out / "stage0" / f"full.rank{r}.json").read_text()) for r in range(4)]
    resumed = [json.loads((out / "stage0" / f"resume.rank{r}.json").read_text()) for r in range(4)]
    lines = [ln for ln in log.splitlines() if "LionCub: ZeRO stage 0" in ln]
    assert len(lines) == 2 and all("node voters" in ln and "2 node groups x 2 ranks" in ln for ln in lines), lines
    for r, (a, b) in enumerate(zip(full, resumed)):
        assert a["world_size"] == 4 and a["global_step"] == b["global_step"] == steps
        assert a["digest"] == full[0]["digest"], f"rank {r}: parameters differ across ranks"
        assert b["digest"] == a["digest"], f"rank {r}: the resume is not bit-exact"
        assert a["losses"][-1][1] < a["losses"][0][1], a["losses"]
        assert [x for x in b["losses"] if x[0] > save] == [x for x in a["losses"] if x[0] > save]
    ckpt = out / "stage0" / "ckpt" / f"checkpoint-{save}" / f"global_step{save}"
    assert sorted(f.name for f in ckpt.glob("lioncub-rank*")) == [f"lioncub-rank{r:05d}-of-00004.pt"
                                                                 for r in range(4)]


def test_launch_exits_cleanly(hf):
    _, log = hf
    assert "terminate called" not in log and "exits with return code = -6" not in log


@pytest.mark.parametrize("launcher", [pytest.param("hf", marks=needs_hf), "gloo"])
def test_repeated_launches_exit_cleanly(tmp_path, launcher):
    """The exit-time SIGABRT seen in 2 of 33 runs (issue 17): every launch must end with status 0.

    ``hf``: the HF driver under the deepspeed launcher, which ends with the exit recipe
    (lioncub_ds.groups.exit_cleanly). ``gloo``: the cheap reproducer
    (lioncub_ds.testing.exit_abort: 2 gloo ranks that, like the Trainer, exit right after a
    collective; without a mitigation it aborts a few launches in ten), with a LionCub whose
    exit settle is the only mitigation.
    LIONCUB_HF_LAUNCHES / LIONCUB_EXIT_LAUNCHES set how many (default 2 / 4)."""
    if launcher == "gloo":
        from lioncub_ds.testing.exit_abort import launch as launch_ranks
        for i in range(int(os.environ.get("LIONCUB_EXIT_LAUNCHES", "4"))):
            rcs, log = launch_ranks("lioncub", env={"PYTHONPATH": str(ROOT)})
            assert rcs == [0, 0] and "terminate called" not in log, f"launch {i}: rcs={rcs}\n{log[-6000:]}"
        return
    for i in range(int(os.environ.get("LIONCUB_HF_LAUNCHES", "2"))):
        out = tmp_path / f"run{i}" / "out"
        out.parent.mkdir(parents=True)
        proc, log = launch(out, "--stages", "1", "--steps", "4", "--save", "2")
        assert proc.returncode == 0 and "terminate called" not in log, f"launch {i}: rc={proc.returncode}\n{log[-6000:]}"


@pytest.mark.skipif(os.environ.get("LIONCUB_EXIT_REPRO") != "1", reason="diagnostic: set LIONCUB_EXIT_REPRO=1")
def test_reproducer_aborts_without_a_mitigation():
    """The positive control for the ``gloo`` launches above: with torch and CPython as they are
    (CPython < 3.14), a normal exit right after a collective does abort."""
    import platform
    from lioncub_ds.testing.exit_abort import launch as launch_ranks
    if tuple(int(x) for x in platform.python_version_tuple()[:2]) >= (3, 14):
        pytest.skip("CPython >= 3.14 parks such threads instead of ending them (gh-87135)")
    logs = [launch_ranks("normal", env={"PYTHONPATH": str(ROOT)}) for _ in range(20)]
    assert any("terminate called without an active exception" in log for _, log in logs)


# ----------------------------------------------------------------------------- LionCub's own "auto" values
AUTO_LINE = ('[hf_trainer_lioncub] dropped optimizer.params.comm="auto", optimizer.params.zero_allgather="auto" '
             'from the ds_config')


def _example():
    import importlib.util as iu
    spec = iu.spec_from_file_location("hf_trainer_lioncub_example", ROOT / "examples" / "hf_trainer_lioncub.py")
    mod = iu.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@needs_hf
def test_the_example_knows_which_lioncub_settings_take_auto():
    """The example's list of LionCub keys whose "auto" it drops is every LionCub setting (and
    DeepSpeed option) that accepts "auto", and "auto" is the default of each (dropping = the same run)."""
    from dataclasses import fields

    from lioncub_ds.config import LionCubConfig, MomentumSyncConfig
    from lioncub_ds.deepspeed import engine
    ex = _example()
    takes_auto = {f.name for f in fields(LionCubConfig) if "auto" in (f.metadata.get("choices") or ())}
    takes_auto |= {k for k in engine.INTEGRATION_KEYS if k == "zero_allgather" and "auto" in engine.ZERO_ALLGATHER_MODES}
    assert takes_auto == set(ex.LIONCUB_AUTO_DEFAULTS)
    defaults = {**LionCubConfig.defaults(), **engine.DEFAULT_OPTIONS}
    assert all(defaults[k] == "auto" for k in ex.LIONCUB_AUTO_DEFAULTS)
    assert not any("auto" in (f.metadata.get("choices") or ()) for f in fields(MomentumSyncConfig))
    assert not set(ex.HF_FILLED_PARAMS) & takes_auto


@needs_hf
def test_the_example_drops_lioncub_autos_and_names_any_other():
    ex = _example()
    template = json.loads(CONFIG.read_text())
    cfg = json.loads(CONFIG.read_text())
    cfg["optimizer"]["params"].update(comm="auto", zero_allgather="auto", eps="auto")
    assert ex.lioncub_autos_for_hf(cfg) == ["comm", "zero_allgather"]
    # HF's own placeholders stay for HF to fill; the rest of the config is untouched
    template["optimizer"]["params"]["eps"] = "auto"
    assert cfg == template
    assert ex.lioncub_autos_for_hf(json.loads(CONFIG.read_text())) == []
    for params, path in (({"vote": "auto"}, "optimizer.params.vote"),
                         ({"network": {"bandwidth_gbit": "auto"}}, "optimizer.params.network.bandwidth_gbit"),
                         ({"com": "auto"}, "optimizer.params.com")):
        cfg = json.loads(CONFIG.read_text())
        cfg["optimizer"]["params"].update(params)
        with pytest.raises(ex.DsConfigError) as err:
            ex.lioncub_autos_for_hf(cfg)
        assert str(err.value).startswith(f'ds_config {path} is "auto"') and "\n" not in str(err.value)
    other = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "comm": "auto"}}}
    assert ex.lioncub_autos_for_hf(other) == [] and other["optimizer"]["params"]["comm"] == "auto"


@needs_hf
def test_hf_trainer_trains_with_lioncub_auto_values(tmp_path):
    """``"comm": "auto"`` and ``"zero_allgather": "auto"`` (LionCub's own values, their defaults)
    in the HF template: the run trains (HF would stop on them: "`optimizer.params.comm` not found in
    kwargs", once per rank), and rank 0 says in one line that the example dropped them."""
    out = tmp_path / "out"
    proc, log = launch(out, "--stages", "0", "--steps", "4", "--save", "100", "--no-resume",
                       "--param", 'comm="auto"', "--param", 'zero_allgather="auto"')
    assert proc.returncode == 0, log[-8000:]
    assert "not found in kwargs" not in log
    assert log.count(AUTO_LINE) == 1, log[-4000:]
    runs = [json.loads((out / "stage0" / f"full.rank{r}.json").read_text()) for r in range(2)]
    assert all(r["global_step"] == 4 and r["optimizer"] == "LionCub" for r in runs)
    assert runs[0]["digest"] == runs[1]["digest"]
    lines = [ln for ln in log.splitlines() if "LionCub: ZeRO stage 0" in ln]
    assert len(lines) == 1 and "comm=auto" in lines[0], lines


BAD_VALUE_LINE = ("[hf_trainer_lioncub] ds_config optimizer.params.comm: LionCub: invalid comm='bbitt'; allowed: "
                  "'auto' | 'allgather' | '1bit' | 'pbit' | 'int8' | 'bbit'")
OTHER_AUTO_LINE = ('[hf_trainer_lioncub] ds_config optimizer.params.vote is "auto": HF fills "auto" in '
                   "optimizer.params only for lr, betas, eps, weight_decay and LionCub takes it only for comm, "
                   "zero_allgather; write a value for vote or drop the key (LionCub's default)")


@needs_hf
@pytest.mark.parametrize("param,line", [('comm="bbitt"', BAD_VALUE_LINE), ('vote="auto"', OTHER_AUTO_LINE)],
                         ids=["bad-value", "auto-on-another-key"])
def test_hf_trainer_setting_error_is_one_line_from_rank_0(tmp_path, param, line):
    """A bad LionCub value (``"comm": "bbitt"``, raised by LionCub when DeepSpeed builds it) or
    ``"auto"`` on a LionCub key that takes no "auto" (HF would stop with "`optimizer.params.vote`
    not found in kwargs", once per rank): the run stops before it trains, exit status 2, with one
    line from rank 0 naming the key (no traceback, nothing from the other rank)."""
    out = tmp_path / "out"
    proc, log = launch(out, "--stages", "0", "--steps", "4", "--save", "100", "--no-resume", "--param", param)
    assert proc.returncode == 2, log[-8000:]
    key = param.split("=")[0]
    assert [ln for ln in log.splitlines() if f"optimizer.params.{key}" in ln] == [line], log[-8000:]
    assert "Traceback" not in log and "not found in kwargs" not in log and "'loss'" not in log, log[-8000:]
    assert not (out / "stage0" / "full.rank0.json").exists()
