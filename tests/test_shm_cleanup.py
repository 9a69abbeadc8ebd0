"""tests/conftest.py removes the DeepSpeed shared-memory workspaces of the suite's own launches after
each test, and never another job's (issue 48: a DeepSpeed CPU run started by hand on the same
machine looped on ``open("/dev/shm/deepspeed_allreduce_buffer_…")`` while the suite ran elsewhere).

The check runs the real conftest in a real pytest process: its one test makes a launch of its own
(a child with MASTER_PORT from ``free_port()`` that creates its workspaces by DeepSpeed's names, as
DeepSpeed's shm.cpp does) while another job's live workspace (port 29500, the launchers' default)
appears in /dev/shm. After that pytest ends, the launch's workspaces are gone and the other job's
is still there."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lioncub_ds import ds_shm

pytestmark = [pytest.mark.dist,
              pytest.mark.skipif(not os.path.isdir(ds_shm.SHM_DIR), reason=f"no {ds_shm.SHM_DIR} here")]

ROOT = Path(__file__).resolve().parents[1]

INNER = textwrap.dedent("""
    import json
    import os
    import subprocess
    import sys

    import pytest

    from lioncub_ds import ds_shm
    from lioncub_ds.testing import free_port

    pytestmark = pytest.mark.dist


    def test_a_launch_while_another_job_runs():
        # another job's workspace appears while this test runs (not there when the suite started)
        open(os.path.join(ds_shm.SHM_DIR, os.environ["FOREIGN_WORKSPACE"]), "w").close()
        port = free_port()
        make = ("import os; from lioncub_ds import ds_shm; "
                "[open(os.path.join(ds_shm.SHM_DIR, ds_shm.own_shm_workspace(r)), 'w').close() for r in (0, 1)]")
        subprocess.run([sys.executable, "-c", make], check=True,
                       env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
        mine = [ds_shm.workspace_name(os.getuid(), "127.0.0.1", port, r) for r in (0, 1)]
        assert set(mine) <= ds_shm.shm_workspaces()
        with open(os.environ["REPORT"], "w") as f:
            json.dump(mine, f)
""")


def test_the_suite_removes_its_own_launches_workspaces_and_no_one_elses(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", suite / "conftest.py")
    shutil.copy(ROOT / "pytest.ini", suite / "pytest.ini")
    (suite / "test_inner.py").write_text(INNER)
    # a name no real job has (its MASTER_ADDR is this test's), on the launchers' default port
    foreign = ds_shm.workspace_name(os.getuid(), f"lioncub-test-{os.getpid()}", 29500, 0)
    report = tmp_path / "mine.json"
    env = dict(os.environ, FOREIGN_WORKSPACE=foreign, REPORT=str(report),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)],
                             cwd=suite, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        mine = json.loads(report.read_text())
        left = ds_shm.shm_workspaces()
        assert not set(mine) & left, "the suite's own launch left its workspaces"
        assert foreign in left, "the suite removed another job's workspace"
    finally:
        ds_shm.remove_shm_workspaces([foreign, *(json.loads(report.read_text()) if report.exists() else [])])
