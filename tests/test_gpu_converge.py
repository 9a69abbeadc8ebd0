"""The GPU convergence probe (benchmarks/gpu_converge.py), dry-run on the CPU: a tiny GPT for 5 steps
through the real converge command (lr bracket, the seed's three runs, records, the regenerated table),
so that a GPU's first minute runs it. The real run needs CUDA and is not part of the suite."""
from __future__ import annotations

import json

import pytest

from benchmarks import gpu_converge as G

pytestmark = pytest.mark.dist


def test_the_dry_run_brackets_the_lr_runs_the_three_variants_and_writes_the_table(tmp_path):
    assert G.main(["--dry", "--out", str(tmp_path)]) == 0
    recs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    runs = [r for r in recs if r["bench"] == "converge"]
    assert sorted(r["variant"] for r in runs) == sorted(G.VARIANTS)
    for r in runs:
        # the record names the preset and that the size and steps were changed from it
        assert r["protocol"].startswith(G.PROTOCOL) and "changed" in r["protocol"]
        assert r["world_size"] == G.WORLD and r["steps"] == 5
        assert r["size"] == G.DRY_SIZE[0] and r["gpu_device"] == "cpu" and r["command"].endswith("--dry")
        assert r["bracket_lr"] in G.LR_BRACKET
    lion = next(r for r in runs if r["variant"] == "lion")
    assert lion["lr"] == lion["bracket_lr"]  # global Lion runs at the bracket's best lr
    readme = (tmp_path / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| cpu | dry_d32_l1"))
    assert row.count("%") == 2 and "–" not in row


def test_bad_input_is_refused():
    with pytest.raises(SystemExit):
        G.main(["--dry", "--budget-s", "0"])
