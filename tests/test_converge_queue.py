"""``benchmarks.converge_queue``: a study as one-run jobs, in row order, resumable."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import converge_queue as Q

TINY_FLAGS = ["--steps", "4", "--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "16",
              "--batch-size", "2", "--warmup", "2", "--eval-every", "2", "--eval-iters", "1", "--eval-batch", "2"]


@pytest.mark.unit
def test_jobs_fill_rows_in_order():
    assert Q.jobs([8], ["lion", "cub_1bit"], [0, 1]) == [(8, "lion", 0), (8, "lion", 1), (8, "cub_1bit", 0),
                                                         (8, "cub_1bit", 1)]


@pytest.mark.unit
def test_finished_reads_every_jsonl_of_the_protocol_and_skips_torn_lines(tmp_path):
    rec = lambda v, s, proto="lion_w300": json.dumps({"bench": "converge", "protocol": proto, "world_size": 8,
                                                      "variant": v, "seed": s})
    (tmp_path / "a.jsonl").write_text(rec("lion", 0) + "\n" + rec("lion", 1, "lion_w150") + "\n")
    (tmp_path / "b.jsonl").write_text('{"bench": "converge_config"}\n' + rec("cub_1bit", 3) + "\n{\"bench\": \"conv")
    (tmp_path / "c.json").write_text(rec("adamw", 0))  # not a *.jsonl: not read
    assert Q.finished([tmp_path, tmp_path / "missing"], "lion_w300") == {(8, "lion", 0), (8, "cub_1bit", 3)}


@pytest.mark.unit
def test_a_run_of_another_shape_under_the_same_name_is_not_done(tmp_path, capsys):
    # widths 128 and 256 are both "lion_w300 (with d_model changed)": the record's own settings decide
    rec = lambda d: json.dumps({"bench": "converge", "protocol": "lion_w300 (with d_model changed)", "world_size": 16,
                                "variant": "lion", "seed": 0, "d_model": d, "betas": [0.8, 0.9]})
    (tmp_path / "w128.jsonl").write_text(rec(128) + "\n")
    name = "lion_w300 (with d_model changed)"
    assert Q.finished([tmp_path], name, {"d_model": 128, "betas": [0.8, 0.9]}) == {(16, "lion", 0)}
    assert Q.finished([tmp_path], name, {"d_model": 256, "betas": [0.8, 0.9]}) == set()
    assert Q.finished([tmp_path], name, {"d_model": 128, "betas": [0.9, 0.99]}) == set()
    argv = ["--protocol", "lion_w300", "--world-sizes", "16", "--seeds", "0", "--variants", "lion", "--dir",
            str(tmp_path / "q"), "--done", str(tmp_path), "--dry-run", "--"]
    assert Q.main(argv + ["--d-model", "256"]) == 0
    assert "1 runs to do, 0 already done" in capsys.readouterr().out
    assert Q.main(argv + ["--d-model", "128"]) == 0
    assert "0 runs to do, 1 already done" in capsys.readouterr().out


@pytest.mark.unit
@pytest.mark.parametrize("change, message", [
    ({"--variants": "cub_nope"}, "unknown converge variant 'cub_nope'"),
    ({"--workers": "0"}, "--workers 0: must be >= 1"),
    ({"--world-sizes": "0"}, "each must be >= 1"),
    ({"--": "--no-such-flag"}, "are not bench converge flags"),
])
def test_bad_arguments_are_refused_before_any_run(tmp_path, capsys, change, message):
    flags = {"--protocol": "lion_w300", "--world-sizes": "2", "--seeds": "0", "--variants": "lion",
             "--dir": str(tmp_path / "q"), "--workers": "1", **change}
    with pytest.raises(SystemExit):
        Q.main([x for k, v in flags.items() for x in (k, v)])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


@pytest.mark.unit
def test_dry_run_lists_what_is_left(tmp_path, capsys):
    done = tmp_path / "committed"
    done.mkdir()
    (done / "x.jsonl").write_text(json.dumps({"bench": "converge", "protocol": "lion_w300", "world_size": 2,
                                              "variant": "lion", "seed": 0}) + "\n")
    assert Q.main(["--protocol", "lion_w300", "--world-sizes", "2", "--seeds", "0", "1", "--variants", "lion",
                   "--dir", str(tmp_path / "q"), "--done", str(done), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "1 runs to do, 1 already done" in out
    (cmd,) = [line for line in out.splitlines() if "benchmarks converge" in line]
    assert "--seeds 1 --variants lion" in cmd and cmd.endswith("n2_lion_s1.jsonl")


@pytest.mark.dist
def test_a_queue_runs_its_jobs_and_a_second_call_runs_none(tmp_path, capsys):
    argv = ["--protocol", "lion_w300", "--world-sizes", "2", "--seeds", "0", "--variants", "lion", "cub_1bit",
            "--dir", str(tmp_path), "--workers", "2", "--", *TINY_FLAGS]
    assert Q.main(argv) == 0
    # two workers' progress lines each stand on their own line
    progress = [x for x in capsys.readouterr().out.splitlines() if " start " in x or " end " in x]
    assert len(progress) == 4 and all(x.count("[converge_queue]") == 1 for x in progress)
    recs = {}
    for v in ("lion", "cub_1bit"):
        lines = [json.loads(x) for x in (tmp_path / f"n2_{v}_s0.jsonl").read_text().splitlines()]
        (recs[v],) = [r for r in lines if r["bench"] == "converge"]
        assert recs[v]["variant"] == v and recs[v]["steps"] == 4 and recs[v]["protocol"].startswith("lion_w300 (with ")
    assert recs["lion"]["val_loss"] != recs["cub_1bit"]["val_loss"]
    assert Q.main(argv) == 0
    assert "0 runs to do, 2 already done" in capsys.readouterr().out


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.dist
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopping_the_queue_ends_its_runs(tmp_path, sig):
    """``kill <queue pid>`` (or Ctrl-C's SIGINT) on a real queue with two runs in flight: the queue ends
    both runs' process groups and exits 128 + the signal; no run is left behind to be started a
    second time by the next queue."""
    root = Path(__file__).resolve().parents[1]
    long_flags = [x if x != "4" else "1000000" for x in TINY_FLAGS]  # --steps 1000000: runs until ended
    queue = subprocess.Popen([sys.executable, "-m", "benchmarks.converge_queue", "--protocol", "lion_w300",
                              "--world-sizes", "2", "--seeds", "0", "1", "2", "--variants", "lion", "--dir",
                              str(tmp_path), "--workers", "2", "--", *long_flags],
                             cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs = []
    try:
        deadline = time.monotonic() + 300
        while len(runs) < 2 and time.monotonic() < deadline and queue.poll() is None:
            time.sleep(0.2)
            runs = _children(queue.pid)
        assert len(runs) == 2, f"the queue did not start two runs: {queue.poll()}"
        queue.send_signal(sig)
        out, err = queue.communicate(timeout=300)
        assert queue.returncode == 128 + sig, (queue.returncode, err)
        assert f"stopped by {signal.Signals(sig).name}" in err
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in runs) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in runs), "runs outlived their queue"
        assert "start n2_lion_s2" not in out  # the third run never started
    finally:
        for p in runs:  # the old queue left them running: end them here
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        if queue.poll() is None:
            queue.kill()
