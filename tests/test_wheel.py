"""The installed wheel holds the runtime only: no benchmark, simulation, demo model, data or demo module."""
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKSHOP = ("bench", "benchmarks", "models", "data", "demo", "ds_demo", "ds_pretrain", "pretrain_gpt", "converge",
            "netns", "netns_nodes", "scaling", "gpt", "text")


@pytest.mark.dist
def test_the_wheel_lists_only_runtime_modules(tmp_path):
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "LIONCUB_BUILD_EXT": "0"})
    assert res.returncode == 0, res.stdout + res.stderr
    (wheel,) = tmp_path.glob("lioncub_ds-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    modules = [n for n in names if n.endswith(".py")]
    assert any(n == "lioncub_ds/optimizer.py" for n in modules)  # the runtime is there
    assert any(n.startswith("lioncub_ds/deepspeed/") for n in modules)
    assert "lioncub_ds/plan_convergence.json" in names  # the planner's measured convergence costs (package data)
    outside = [n for n in modules if not n.startswith("lioncub_ds/") and not n.endswith("lioncub_ds_autohook.py")]
    assert not outside, f"modules outside the package in the wheel: {outside}"
    ours = [Path(n) for n in modules if n.startswith("lioncub_ds/")]
    stems = {p.stem for p in ours} | {part for p in ours for part in p.parts[1:-1]}
    assert not stems & set(WORKSHOP), f"workshop modules in the wheel: {sorted(stems & set(WORKSHOP))}"
