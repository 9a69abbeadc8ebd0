"""The JIT build lock (issue 33 item 4): a build killed half-way (Ctrl-C during the first import,
an OOM kill) leaves torch's lock file in the build directory, and torch's loader alone then waits
for it forever. lioncub_ds's loader notices that no process is building (its own flock is free:
the kernel released it when the builder died), removes the stale file with a warning and builds;
a build that IS running is waited for, but only so long.

The killed build here is real: a process JIT-building an extension (through the loader's
``jit_load``, as the kernels are built) is killed with SIGKILL while its compiler runs.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lioncub_ds.kernels import loader

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]
NAME = "lioncub_lock_probe"
# Including torch's headers makes the compile take long enough to be killed in the middle.
SOURCE = textwrap.dedent("""
    #include <torch/extension.h>
    int64_t probe(int64_t x) { return 2 * x + 1; }
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("probe", &probe); }
""")
BUILD = textwrap.dedent("""
    import sys
    from lioncub_ds.kernels.loader import jit_load
    mod = jit_load(sys.argv[1], sources=[sys.argv[2]], extra_cflags=["-O0"])
    print("probe", mod.probe(20), flush=True)
""")


def _env(ext_dir):
    return dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_dir), PYTHONPATH=str(ROOT), MAX_JOBS="1",
                OMP_NUM_THREADS="1")


def _wait_for(path: Path, proc, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, f"the build ended before its lock appeared: {proc.communicate()}"
        assert time.monotonic() < deadline, f"{path} did not appear in {seconds} s"
        time.sleep(0.05)


def test_a_lock_left_by_a_killed_build_is_removed_and_the_build_runs(tmp_path, monkeypatch):
    src = tmp_path / "probe.cpp"
    src.write_text(SOURCE)
    ext_dir = tmp_path / "ext"
    env = _env(ext_dir)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext_dir))
    build_dir = Path(loader.jit_build_directory(NAME))
    stale = build_dir / loader.TORCH_LOCK

    # 1. a real build, killed (with its compiler: the whole session) while the compiler runs
    first = subprocess.Popen([sys.executable, "-c", BUILD, NAME, str(src)], env=env, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(stale, first, 300)
        time.sleep(1.0)  # the compiler is running now
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    assert first.returncode == -signal.SIGKILL
    assert stale.exists(), "the killed build should have left torch's lock behind"
    assert not (build_dir / f"{NAME}.so").exists()

    # 2. torch's own loader waits for that lock (forever: here for 5 s), so the test is meaningful
    plain = textwrap.dedent("""
        import sys
        from torch.utils.cpp_extension import load
        load(name=sys.argv[1], sources=[sys.argv[2]], build_directory=sys.argv[3], extra_cflags=["-O0"])
    """)
    waiting = subprocess.Popen([sys.executable, "-c", plain, NAME, str(src), str(build_dir)], env=env,
                               start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=5)
    finally:
        os.killpg(waiting.pid, signal.SIGKILL)
        waiting.wait()
    assert stale.exists()

    # 3. lioncub_ds's loader removes it, says so, and builds
    second = subprocess.run([sys.executable, "-c", BUILD, NAME, str(src)], env=env, capture_output=True, text=True,
                            timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "probe 41" in second.stdout
    assert f"removing {stale}" in second.stderr and "killed" in second.stderr, second.stderr[-3000:]
    assert not stale.exists()


HOLD = textwrap.dedent("""
    import sys, time
    from lioncub_ds.kernels.loader import build_lock
    with build_lock(sys.argv[1]):
        print("held", flush=True)
        time.sleep(600)
""")


def test_a_running_build_is_waited_for_only_so_long_and_released_when_its_process_dies(tmp_path):
    build_dir = tmp_path / "ext" / NAME
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(build_dir)], env=_env(tmp_path / "ext"),
                              start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            with loader.build_lock(str(build_dir), wait_s=1.0):
                pass
        assert time.monotonic() - t0 < 30
        msg = str(info.value)
        assert f"process {holder.pid}" in msg and str(build_dir / loader.OWN_LOCK) in msg, msg
        assert "LIONCUB_BUILD_WAIT_S" in msg
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    # the holder is dead: its lock went with it (no file to remove by hand)
    t0 = time.monotonic()
    with loader.build_lock(str(build_dir), wait_s=30.0):
        assert time.monotonic() - t0 < 5
