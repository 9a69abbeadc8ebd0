"""``benchmarks.converge_queue``: a study as one-run jobs, in row order, resumable."""
from __future__ import annotations

import json

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
