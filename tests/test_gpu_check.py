"""``make gpu-check`` (benchmarks/gpu_check.py) without a GPU: its dry run, and the parts of the real run
that need no GPU (the wheel checks, the pytest result parsing in which a skip fails, the figures of the
kernel bench, the one-screen summary)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks import gpu_check as gc

ROOT = Path(__file__).resolve().parents[1]
GPU_MD_MISSING = ("deepspeed", "megatron-core", "lion-pytorch", "hjson", "pydantic", "pydantic-core",
                  "annotated-types", "typing-inspection")  # what a bare CUDA image lacks


@pytest.mark.dist
def test_dry_run_checks_every_step_and_writes_the_summary(tmp_path):
    """GPU_CHECK_DRY=1: every step's inputs check out (the pytest selections collect the GPU tests, the
    wheel list covers what the image lacks), the budgets fit one 8-minute device call, and the summary
    is written and printed in its format."""
    env = {**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dry"] and summary["passed"] and summary["budget_s"] == gc.BUDGET_S <= 480
    assert [s["name"] for s in summary["steps"]] == [s.name for s in gc.STEPS]
    assert sum(s["budget_s"] for s in summary["steps"]) <= gc.BUDGET_S
    for s in summary["steps"]:
        assert s["status"] == "dry-ok", s
        assert (tmp_path / s["log"]).exists() or s["name"] in ("install", "build", "deepspeed", "bench"), s
        assert set(s) == {"name", "what", "status", "seconds", "budget_s", "figures", "note", "log"}
    steps = {s["name"]: s for s in summary["steps"]}
    assert steps["sync_tests"]["figures"]["collected"] == len(gc.SYNC_TESTS) == 4
    assert steps["ranks"]["figures"]["collected"] == 2  # 2 and 4 ranks
    assert steps["cuda_tests"]["figures"]["collected"] > 300
    # big_step's dry run: the tiny GPT on CPU, every optimizer but Triton timed and checked
    big = steps["big_step"]
    assert big["figures"]["params"] == 544_256, big
    assert {"lion_fused_ms", "adamw_fused_ms", "lioncub_N8_ms", "lion_fused_vs_adamw",
            "lioncub_N8_vs_adamw"} <= set(big["figures"]), big
    assert "lion_pytorch_triton skipped" in big["note"], big
    assert json.loads((tmp_path / "big_step.json").read_text())[0]["bench"] == "big_step"
    text = res.stdout.strip().splitlines()
    assert text[0].startswith("GPU check (DRY RUN): PASSED") and len(text) <= 40  # one screen
    for st in gc.STEPS:
        assert any(line.startswith(f"{st.name} ") and "dry-ok" in line for line in text), st.name
    assert (tmp_path / "summary.txt").read_text().strip().splitlines() == text


@pytest.mark.unit
def test_a_second_check_in_the_same_out_starts_with_fresh_logs(tmp_path):
    """Step logs are appended to within one check; an earlier check's logs and junit reports in the same
    $OUT are removed first (a second dry run counted every collected test twice: "8 collected, want 4")."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "sync_tests.log").write_text("tests/a.py::test_x\n" * 4)
    (tmp_path / "cuda_tests.xml").write_text("<testsuites/>")
    (logs / "notes.log").write_text("not the check's")  # not a step's log: kept
    gc.Ctx(tmp_path, dry=True, budget_s=10)
    assert not (logs / "sync_tests.log").exists() and not (tmp_path / "cuda_tests.xml").exists()
    assert (logs / "notes.log").read_text() == "not the check's"


@pytest.mark.dist
def test_dry_run_twice_in_one_out_counts_once(tmp_path):
    """The documented dry run, twice in the same output folder (as a checkout's gpu_check_out/ is): the
    second run collects the same 4 sync tests, not 8."""
    env = {**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    for _ in range(2):
        res = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--only", "sync_tests"], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        (step,) = json.loads((tmp_path / "summary.json").read_text())["steps"]
        assert step["figures"]["collected"] == len(gc.SYNC_TESTS) == 4, step


@pytest.mark.dist
def test_make_gpu_check_uses_the_venv_python_once_setup_made_it():
    """``make gpu-check`` runs the venv's python (it has torch) when .venv exists, else $(PY); the
    system python3 has no torch, so the documented dry run failed after ``make setup``."""
    res = subprocess.run(["make", "-n", "gpu-check"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    cmd = [ln for ln in res.stdout.splitlines() if "benchmarks.gpu_check" in ln]
    assert len(cmd) == 1, res.stdout
    want = ".venv/bin/python" if (ROOT / ".venv" / "bin" / "python").exists() else "python3"
    assert cmd[0].split()[0] == want, cmd
    res = subprocess.run(["make", "-n", "gpu-check", "GPU_PY=python3.12"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert "python3.12 -m benchmarks.gpu_check" in res.stdout, res.stdout


@pytest.mark.unit
def test_wheel_list_covers_what_the_image_lacks_at_this_venvs_versions():
    want = gc.pinned_wheels()
    assert set(GPU_MD_MISSING) <= set(want)
    assert gc.wheel_list_gaps() == []
    from importlib import metadata

    assert all(metadata.version(d) == v for d, v in want.items())


def _fake_wheel(folder: Path, name: str, requires: str = ""):
    with zipfile.ZipFile(folder / name, "w") as z:
        dist = "-".join(name.split("-")[:2])
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: x\n{requires}")


@pytest.mark.unit
def test_wheel_checks(tmp_path):
    _fake_wheel(tmp_path, "pydantic-2.1.0-py3-none-any.whl", "Requires-Dist: pydantic-core==2.5.0\n")
    _fake_wheel(tmp_path, "pydantic_core-2.5.0-cp312-cp312-manylinux_2_17_x86_64.whl")
    _fake_wheel(tmp_path, "psutil-7.0.0-cp36-abi3-manylinux_2_28_x86_64.whl")
    _fake_wheel(tmp_path, "msgpack-1.0.0-cp311-cp311-manylinux_2_28_x86_64.whl")
    _fake_wheel(tmp_path, "hjson-3.0.0-py3-none-any.whl")
    _fake_wheel(tmp_path, "hjson-3.1.0-py3-none-any.whl")
    problems = gc.check_wheels(tmp_path, {"pydantic": "2.1.0", "pydantic-core": None, "psutil": None,
                                          "msgpack": None, "hjson": None, "einops": None})
    assert len(problems) == 3, problems
    assert any("msgpack" in p and "CPython 3.12" in p for p in problems)  # a cp311 wheel
    assert any(p.startswith("hjson: 2 wheels") for p in problems)
    assert any(p.startswith("einops: 0 wheels") for p in problems)
    assert gc.check_wheels(tmp_path, {"pydantic": "2.2.0"}) == ["pydantic: pydantic-2.1.0-py3-none-any.whl is 2.1.0, "
                                                               "want 2.2.0"]
    (tmp_path / "pydantic_core-2.5.0-cp312-cp312-manylinux_2_17_x86_64.whl").unlink()
    _fake_wheel(tmp_path, "pydantic_core-2.6.0-cp312-cp312-manylinux_2_17_x86_64.whl")
    assert gc.check_wheels(tmp_path, {}) == ["pydantic 2.1.0 pins pydantic-core==2.5.0, the folder has ['2.6.0']"]


@pytest.mark.dist
def test_a_skipped_gpu_test_fails_its_step(tmp_path):
    """The real run's pytest steps count from the junit report; a skip fails the step (it did not run)."""
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_x.py").write_text("import pytest\npytestmark = pytest.mark.unit\ndef test_a(): pass\n"
                                     "@pytest.mark.skip(reason='no GPU')\ndef test_b(): pass\n")
    ctx = gc.Ctx(tmp_path / "out", dry=False, budget_s=300)
    ctx.env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(tests)])
    res = gc._pytest(ctx, "x", [str(tests / "test_x.py"), "--rootdir", str(tests)], 120)
    assert res.status == "failed" and res.figures == {"passed": 1, "failed": 0, "skipped": 1}
    assert "skipped" in res.note
    res = gc._pytest(ctx, "y", [str(tests / "test_x.py"), "-k", "test_a", "--rootdir", str(tests)], 120)
    assert res.status == "passed" and res.figures == {"passed": 1, "failed": 0, "skipped": 0}


@pytest.mark.unit
def test_bench_figures_and_summary(tmp_path):
    big, mid, small = 1 << 28, 1 << 24, 1 << 20
    recs = [{"kernel": "lion_step", "dtype": "fp32", "impl": "fused", "numel": big, "frac_of_floor": 0.9,
             "kernel_us": 6.0},
            {"kernel": "lion_step", "dtype": "fp32", "impl": "lion_pytorch_triton", "numel": big, "frac_of_floor": 0.9,
             "kernel_us": 5.0},
            {"kernel": "lion_step", "dtype": "fp32", "impl": "lion_pytorch_triton", "numel": mid, "frac_of_floor": 0.9,
             "kernel_us": 1.0},
            {"kernel": "vote_apply_N8", "dtype": "bf16", "impl": "fused", "numel": mid, "frac_of_floor": 0.5,
             "kernel_us": 1.0},
            {"kernel": "vote_apply_N8", "dtype": "bf16", "impl": "fused", "numel": small, "frac_of_floor": 0.1,
             "kernel_us": 1.0}]
    figs = gc.bench_figures(recs)  # 1M is reported but not held to the target (launch-bound)
    assert figs == {"lion_step_fp32_256M": 0.9, "vote_apply_N8_bf16_16M": 0.5, "lion_step_fp32_vs_triton": 1.2,
                    "below_target": ["vote_apply_N8_bf16_16M"]}
    bench = next(st for st in gc.STEPS if st.name == "bench")
    steps = [(gc.STEPS[0], gc.Result("passed", {"gpu": "H100"}), 3.0),
             (bench, gc.Result("failed", figs, "below 85%"), 40.0)]
    ctx = gc.Ctx(tmp_path, dry=False, budget_s=10)
    summary = gc.summarize(ctx, steps, {"gpu": "H100", "torch": "2.11", "python": "3.12"})
    assert not summary["passed"] and summary["seconds"] == 43.0
    text = gc.render(summary).splitlines()
    assert text[0].startswith("GPU check: FAILED | H100 | torch 2.11")
    assert any(line.startswith("bench       failed") for line in text)
    assert any("lion_step_fp32_vs_triton=1.2" in line for line in text)
    assert any("note: below 85%" in line for line in text)


def _big(name, ms, **kw):
    rec = {"bench": "big_step", "optimizer": name, "params": 1_315_819_520, "skipped": None, "ms": ms,
           "finite": True, "changed_frac": 0.9, "kernels": "cuda", "peak_GB": 12.0, "peak_check_GB": 14.6}
    return {**rec, **kw}


@pytest.mark.unit
def test_big_step_figures_and_failures():
    """The big_step step's figures (ms per step of each optimizer, the ratios to fused AdamW and to
    Triton, the peak memory) and what fails it (a needed optimizer not timed, parameters not finite or
    unchanged, Lion on other kernels than cuda); a Triton skip is a note only."""
    recs = [_big("lion_fused", 6.0), _big("adamw_fused", 8.0, kernels="torch"), _big("lioncub_N8", 10.0),
            _big("lion_pytorch_triton", 5.0, kernels="triton")]
    figs = gc.big_step_figures(recs)
    assert figs == {"params": 1_315_819_520, "lion_fused_ms": 6.0, "adamw_fused_ms": 8.0, "lioncub_N8_ms": 10.0,
                    "lion_pytorch_triton_ms": 5.0, "lion_fused_vs_adamw": 0.75, "lioncub_N8_vs_adamw": 1.25,
                    "lion_pytorch_triton_vs_adamw": 0.625, "lion_fused_vs_triton": 1.2, "peak_GB": 14.6}
    assert gc.big_step_problems(recs, dry=False) == []
    recs[-1] = {"optimizer": "lion_pytorch_triton", "params": 1, "skipped": "triton is not importable"}
    assert gc.big_step_problems(recs, dry=False) == []
    assert "lion_fused_vs_triton" not in gc.big_step_figures(recs)
    bad = [_big("lion_fused", 6.0, kernels="torch"), _big("adamw_fused", 8.0, finite=False),
           _big("lioncub_N8", 1.0, changed_frac=0.0)]
    assert gc.big_step_problems(bad, dry=False) == ["lion_fused ran on the torch kernels, not cuda",
                                                    "adamw_fused: parameters not finite after a step",
                                                    "lioncub_N8: parameters unchanged after a step"]
    assert gc.big_step_problems(bad[:1], dry=True) == ["adamw_fused not timed", "lioncub_N8 not timed"]
    skipped = [_big("lion_fused", 6.0), {"optimizer": "adamw_fused", "skipped": "time budget spent"}]
    assert "adamw_fused not timed (time budget spent)" in gc.big_step_problems(skipped, dry=False)


@pytest.mark.unit
def test_budgets_fit_one_device_call():
    assert sum(st.budget_s for st in gc.STEPS) <= gc.BUDGET_S <= 480
    assert [st.name for st in gc.STEPS][-2:] == ["bench", "big_step"]


@pytest.mark.unit
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="with a GPU this would run the real JIT builds")
def test_the_build_step_builds_both_extensions_at_once_and_fails_when_one_fails():
    """The build step's code starts one process per extension: on a CPU machine the C++ one loads
    (its timing line printed) while the CUDA one cannot, and the step's exit status says so."""
    res = subprocess.run([sys.executable, "-c", gc.BUILD_CODE], cwd=ROOT, capture_output=True, text=True,
                         timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [ln.split() for ln in res.stdout.splitlines() if ln.startswith("GPU_CHECK_BUILD ")]
    assert [ln[1] for ln in lines] == ["cpp"] and float(lines[0][4]) >= 0, res.stdout + res.stderr
    assert res.returncode != 0 and "CUDA" in res.stderr, res.stderr[-2000:]
