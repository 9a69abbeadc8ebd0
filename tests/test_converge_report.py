"""``benchmarks.converge_report``: the per-seed tables, frontier and slow starts of a study, and that
docs/convergence.md quotes the committed study's JSON, which holds exactly the committed runs."""
from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest

from benchmarks import converge as C
from benchmarks import converge_report as R

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
W300 = ROOT / "docs" / "lion_w300"
W300_RUNS = ROOT / "studies" / "lion_w300" / "runs"  # the per-run files the merge reads (outside docs/)


def run(v, n, seed, loss, ratio=1.0, lr=4e-3):
    return {"bench": "converge", "variant": v, "world_size": n, "seed": seed, "val_loss": loss, "lr": lr,
            "bytes_per_rank": 1, "bytes_ratio_vs_fp32": ratio, "steps": 10}


def curve(v, n, seed, step, loss):
    return {"bench": "converge_curve", "variant": v, "world_size": n, "seed": seed, "step": step, "val_loss": loss}


def test_fmt_lr():
    assert [R.fmt_lr(x) for x in (4e-3, 8e-3, 1.1e-2, 5e-4, 2.8e-3)] == ["4e-3", "8e-3", "1.1e-2", "5e-4", "2.8e-3"]


def test_seed_table_by_hand():
    recs = [run("lion", 8, 0, 1.0), run("lion", 8, 1, 2.0), run("lion", 8, 2, 4.0),
            run("cub_1bit", 8, 0, 1.01, ratio=31.5), run("cub_1bit", 8, 1, 2.04, ratio=31.5),  # seed 2 missing
            run("adamw", 8, 2, 4.4, lr=8e-3)]
    lines = R.seed_table(recs, 8).splitlines()
    assert lines[0] == "| N = 8 | 0 | 1 | 2 | paired gap to global Lion [95% CI] | x fewer bytes |"
    # rows: global Lion first, AdamW next, then Lion Cub; a seed a variant has not run is an empty cell
    assert lines[2] == "| `lion`, lr 4e-3 | 1.000 | 2.000 | 4.000 | — | 1.0x |"
    assert lines[3] == "| `adamw`, lr 8e-3 | – | – | 4.400 | +10.00% (1 seed) | 1.0x |"
    # gaps +1% and +2%: mean 1.5, sd 0.7071, t(1) = 12.7062 -> half-width 6.353
    assert lines[4] == "| `cub_1bit`, lr 4e-3 | 1.010 | 2.040 | – | +1.50% [-4.85, +7.85] (2 seeds) | 31.5x |"
    with pytest.raises(ValueError, match="no runs at N = 16"):
        R.seed_table(recs, 16)


def test_frontier_worst_seed_and_post_hoc():
    recs = [run("lion", 8, s, 1.0) for s in range(4)] + [run("cub_1bit", 8, s, x, 30.0)
                                                         for s, x in enumerate((1.01, 1.02, 1.10, 1.03))]
    (row,) = R.frontier(recs, 8, drop_seeds={2})
    assert row["variant"] == "cub_1bit" and row["seeds"] == [0, 1, 2, 3] and row["worst_seed"] == 2
    assert row["worst_gap_pct"] == pytest.approx(10.0)
    mean, half, _ = C.t_interval([1.0, 2.0, 3.0])
    assert row["post_hoc_seeds"] == 3 and row["post_hoc_gap_pct"] == pytest.approx(mean)
    assert row["post_hoc_hi_pct"] == pytest.approx(mean + half)
    assert "post_hoc_gap_pct" not in R.frontier(recs, 8)[0]


def test_slow_starts_need_a_curve_at_the_step():
    recs = [run("lion", 8, 0, 1.3), run("cub_1bit", 8, 0, 1.4), curve("lion", 8, 0, 150, 2.40),
            curve("cub_1bit", 8, 0, 150, 2.60)]
    rows = {r["variant"]: r for r in R.slow_starts(recs, 150, 2.45)}
    assert not rows["lion"]["slow"] and rows["cub_1bit"]["slow"] and rows["cub_1bit"]["val_loss"] == 1.4
    with pytest.raises(ValueError, match="no curve record at step 100"):
        R.slow_starts(recs, 100, 2.45)


def test_replace_block_needs_both_markers():
    doc = "a\n<!-- t -->\nold\n<!-- /t -->\nb\n"
    assert R.replace_block(doc, "t", "new\n") == "a\n<!-- t -->\nnew\n<!-- /t -->\nb\n"
    with pytest.raises(ValueError, match="--marker 'u'"):
        R.replace_block(doc, "u", "new\n")


def test_bad_drop_seed_is_refused(capsys):
    with pytest.raises(SystemExit):
        R.main([str(W300 / "converge.json"), "--drop-seed", "8-6"])
    assert "--drop-seed '8-6': expected N:SEED" in capsys.readouterr().err


def test_the_docs_quote_the_study_json():
    """docs/convergence.md's per-seed tables of the chosen preset are what its committed JSON gives (the
    command the page shows), and that JSON holds exactly the runs committed in studies/lion_w300/runs/
    (same N, variant, seed, loss, digest). The superseded presets' JSON is in docs/archive/
    (tests/test_docs.py checks the archive page's figures against it)."""
    assert R.main([str(W300 / "converge.json"), "--doc", str(ROOT / "docs" / "convergence.md"),
                   "--marker", "w300-tables", "--check"]) == 0
    assert "--marker w300-tables" in (ROOT / "docs" / "convergence.md").read_text()
    key = lambda r: (r["world_size"], r["variant"], r["seed"], r["val_loss"], r["digest"])
    merged = sorted(map(key, R.runs_of(R.load(W300 / "converge.json"))))
    _, runs, _, _ = C.merge(sorted(glob.glob(str(W300_RUNS / "*.jsonl"))))
    assert len(runs) >= 270 and merged == sorted(map(key, runs))


def test_check_fails_on_a_stale_block(tmp_path):
    doc = (ROOT / "docs" / "convergence.md").read_text().replace("| 1.285 |", "| 1.286 |", 1)
    assert doc != (ROOT / "docs" / "convergence.md").read_text()
    (tmp_path / "c.md").write_text(doc)
    args = [str(W300 / "converge.json"), "--doc", str(tmp_path / "c.md"), "--marker", "w300-tables"]
    assert R.main(args + ["--check"]) == 1
    assert R.main(args) == 0 and R.main(args + ["--check"]) == 0  # rewritten: now it matches


WIDTH = ROOT / "docs" / "lion_w300_width"
WIDTH_RUNS = [*sorted(glob.glob(str(W300_RUNS / "w3_n16_*.jsonl"))),
              *sorted(glob.glob(str(ROOT / "studies" / "lion_w300_width" / "runs" / "*.jsonl")))]
WIDTH_VARIANTS = ["lion", "adamw", "cub_1bit_sync20_int8", "cub_1bit_sync20_int8_node2"]


def test_width_table_by_hand():
    """A row per width, a column per variant; a width without a variant shows '–', one seed says so."""
    def row(v, d, gap, lo, hi, seeds, params):
        return {"bench": "converge_trend", "world_size": 16, "variant": v, "d_model": d, "params": params,
                "lion_lr": 4e-3, "gap_pct": gap, "ci_lo_pct": lo, "ci_hi_pct": hi, "seeds": seeds}
    rows = [row("cub_1bit_sync20_int8", 128, -0.09, -6.61, 6.43, [0, 1, 2, 3, 4], 437760),
            row("adamw", 128, 1.5, 1.0, 2.0, [0, 1], 437760),
            row("cub_1bit_sync20_int8", 64, 1.17, 0.81, 1.53, list(range(10)), 120576),
            row("adamw", 64, 1.92, float("nan"), float("nan"), [0], 120576),
            dict(row("adamw", 64, 9.0, 8.0, 10.0, [0, 1], 120576), world_size=8)]  # another N: not in the table
    lines = R.width_table(rows).splitlines()
    assert lines[0] == ("| width (d_model) | parameters | global Lion's lr | recommendation | node voters 8 × 2 + sync "
                        "| AdamW |")
    assert lines[2] == "| 64 | 120,576 | 4e-3 | +1.17% [+0.81, +1.53] (10) | – | +1.92% (1 seed) |"
    assert lines[3] == "| 128 | 437,760 | 4e-3 | -0.09% [-6.61, +6.43] (5) | – | +1.50% [+1.00, +2.00] (2) |"
    with pytest.raises(ValueError, match="no converge_trend rows at N = 32"):
        R.width_table(rows, n=32)


def test_the_docs_quote_the_width_study_json(capsys):
    """docs/convergence.md's size table is what the committed trend JSON gives, and that JSON's rows
    are what --trend computes from the committed runs (width 64: lion_w300's N = 16 runs)."""
    assert R.main([str(WIDTH / "converge.json"), "--width", "--doc", str(ROOT / "docs" / "convergence.md"),
                   "--marker", "w300-width", "--check"]) == 0
    committed = [r for r in json.loads((WIDTH / "converge.json").read_text()) if r.get("bench") == "converge_trend"]
    records = []
    for path in WIDTH_RUNS:
        records += C.merge([path], variants=WIDTH_VARIANTS, world_sizes=[16])[1]
    recomputed = C.trend(records)
    key = lambda r: (r["variant"], r["d_model"], tuple(r["seeds"]), r["params"], r["lion_lr"])
    assert sorted(map(key, committed)) == sorted(map(key, recomputed))
    assert R.width_table(committed) == R.width_table(recomputed)  # the gaps and intervals too
    assert {r["d_model"] for r in committed} >= {64, 128}
    with pytest.raises(SystemExit):  # a study JSON without trend rows is refused by name
        R.main([str(W300 / "converge.json"), "--width"])
    assert "no converge_trend rows at N = 16" in capsys.readouterr().err


def test_width_check_fails_on_a_stale_block_and_the_marker_defaults_to_the_width_block(tmp_path, capsys):
    doc = (ROOT / "docs" / "convergence.md").read_text()
    stale = doc.replace("| 64 | 120,576 |", "| 64 | 120,577 |", 1)
    assert stale != doc
    (tmp_path / "c.md").write_text(stale)
    args = [str(WIDTH / "converge.json"), "--width", "--doc", str(tmp_path / "c.md")]  # no --marker
    assert R.main(args + ["--check"]) == 1
    assert "--width --doc" in capsys.readouterr().out  # the regenerate command it prints keeps --width
    assert R.main(args) == 0 and (tmp_path / "c.md").read_text() == doc  # only the width block changed
    with pytest.raises(SystemExit):
        R.main(args + ["--slow-step", "150"])
    assert "--width reads a trend JSON" in capsys.readouterr().err
