"""The README's first command, ``python -m lioncub_ds.plan ...``, runs on a machine without torch (a
fresh clone before ``make setup``), and ``import lioncub_ds`` imports no torch until a runtime name
is used (PEP 562 in lioncub_ds/__init__.py). Each check runs in a child interpreter; "without
torch" is a ``sys.meta_path`` finder that refuses every ``torch`` import, as a missing package would."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]

NO_TORCH = textwrap.dedent("""
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None

    sys.meta_path.insert(0, NoTorch())
    for name in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
        del sys.modules[name]
""")


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_the_planner_runs_without_torch():
    code = NO_TORCH + textwrap.dedent("""
        import runpy
        sys.argv[0] = "python -m lioncub_ds.plan"
        try:
            runpy.run_module("lioncub_ds.plan", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            assert not exc.code, exc.code
        assert "torch" not in sys.modules
    """)
    res = _python(code, "--params", "7B", "--nodes", "8", "--gpus-per-node", "8", "--inter-node-gbit", "100")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("PREDICTIONS") and "Recommendation: lioncub_" in res.stdout
    assert "lion_w300 N = " in res.stdout
    # the refusal of a bad input needs no torch either: one line, exit 2
    bad = _python(code.replace("assert not exc.code, exc.code", "raise"), "--params", "1e30")
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1 and "--params" in bad.stderr, bad.stderr


def test_the_blocker_does_block_torch():
    """The check above is only as good as its finder: the runtime really fails under it."""
    res = _python(NO_TORCH + "import lioncub_ds\nlioncub_ds.LionCub\n")
    assert res.returncode == 1 and "No module named 'torch' (blocked by the test)" in res.stderr


def test_import_is_lazy_and_the_public_names_still_resolve():
    code = textwrap.dedent("""
        import sys
        import lioncub_ds
        assert "torch" not in sys.modules, "import lioncub_ds imported torch"
        from lioncub_ds import Lion, LionCubConfigError
        from lioncub_ds.optimizer import LionCub
        assert lioncub_ds.LionCub is LionCub and "torch" in sys.modules
        assert lioncub_ds.CheckpointError is lioncub_ds.checkpoint.CheckpointError
        assert lioncub_ds.CollectiveError.__module__ == "lioncub_ds.comm.base"
        assert lioncub_ds.kernels.backend_for is not None  # a submodule, as the eager imports made it
        assert set(lioncub_ds.__all__) <= set(dir(lioncub_ds))
        try:
            lioncub_ds.NoSuchName
        except AttributeError as exc:
            assert "NoSuchName" in str(exc)
        else:
            raise AssertionError("an unknown name resolved")
        print("ok")
    """)
    res = _python(code)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
