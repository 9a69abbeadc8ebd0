"""Smoke tests of the benchmarks (tiny sizes; no timing assertions)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from benchmarks import BENCHMARKS, comm, converge, netns, netns_nodes, scaling
from lioncub_ds.comm.cost import CostModel

pytestmark = pytest.mark.unit  # tests that spawn ranks or a child process: dist

COMM_FIELDS = {"bench", "algorithm", "vote", "world_size", "numel", "bytes_per_rank", "fp32_allreduce_bytes",
               "bf16_allreduce_bytes", "ratio_vs_fp32", "ratio_vs_bf16"}


def test_registry_lists_every_benchmark():
    for name in ("kernels", "comm", "netns", "netns_nodes", "converge", "scaling", "zero", "startup"):
        assert name in BENCHMARKS


def _raw(rows_by_rank, params=1000):
    return {"ranks": rows_by_rank, "params": params, "cfg": {"batch_size": 1, "seq_len": 8}}


def _row(v, r, step, comp, comm, upd, nbytes, lo=None):
    return {"round": r, "variant": v, "step_s": step, "compute_s": comp, "comm_s": comm, "update_s": upd,
            "bytes": nbytes, "collectives": None, "loss": 0.0, "lo_tx_bytes": lo}


def test_netns_summarize_slowest_rank_split_and_ddp_estimate():
    # 2 ranks, 1 measured round (round 0 is warm-up). Known numbers in, known numbers out.
    r0 = [_row(v, 0, 9, 9, 9, 9, 0) for v in ("no_comm", "ddp_lion_bf16", "lion_bf16_allreduce", "lioncub_1bit")] + [
        _row("no_comm", 1, 0.50, 0.40, 0.0, 0.05, 0, lo=800),
        _row("ddp_lion_bf16", 1, 1.00, 0.90, 0.0, 0.05, 3000, lo=6800),
        _row("lion_bf16_allreduce", 1, 2.00, 0.40, 1.50, 1.60, 3000, lo=6800),
        _row("lioncub_1bit", 1, 0.80, 0.40, 0.20, 0.35, 250, lo=900)]
    r1 = [dict(x) for x in r0]
    r1[-1].update(comm_s=0.10, update_s=0.30)  # rank 1 leaves 1bit's collectives earlier
    r1[-3].update(compute_s=0.95)  # rank 1's ddp backward (with overlapped all-reduce) is slower
    recs = {r["variant"]: r for r in netns.summarize(_raw([r0, r1]), 1.0, 2, warmup=1)}
    one = recs["lioncub_1bit"]
    assert one["comm_time_s"] == 0.20 and one["comm_time_min_rank_s"] == 0.10  # slowest rank, not the minimum
    assert one["kernel_time_s"] == pytest.approx(0.20)  # max over ranks of update - comm: 0.15 / 0.20
    assert one["floor_comm_time_s"] == pytest.approx(2 * 250 * 8 / 1e9)
    assert one["link_bytes_per_rank"] == 450 and one["link_vs_formula"] == pytest.approx(1.8)
    assert one["link_rate_per_rank_gbit"] == 0.5 and one["shared_token_bucket"]
    ddp = recs["ddp_lion_bf16"]
    assert ddp["compute_time_with_overlapped_comm_s"] == 0.95
    assert ddp["comm_time_s"] == pytest.approx(0.55) and ddp["compute_time_s"] == pytest.approx(0.40)
    assert one["speedup_vs_ddp_lion_bf16"] == pytest.approx(1.0 / 0.8)
    assert one["speedup_vs_bf16_allreduce"] == pytest.approx(2.0 / 0.8)
    assert one["step_vs_no_comm"] == pytest.approx(0.8 / 0.5)
    msgs = netns.check_goal(list(recs.values()))
    assert any("goal >= 5x: MISSED" in m for m in msgs)
    assert any("ceiling with free forward+backward" in m and "(1.500 + 0.100) / (0.200 + 0.200) = 4.00x" in m
               for m in msgs)


def test_netns_count_zeros_tiny():
    recs = netns.count_zeros(world_size=2, steps=2, seq_len=8, batch_size=1,
                             model_overrides={"n_layer": 1, "d_model": 32, "n_head": 2})
    for r in recs:
        assert r["grad_zeros"] + r["c_zeros"] > 0 and 0 <= r["rank"] < 2 and 0 <= r["step"] < 2
    for s in netns.summarize_zeros(recs, 2, 2):
        assert s["c_zeros_min"] <= s["c_zeros_median"] <= s["c_zeros_max"] <= s["numel"]


@pytest.mark.dist
def test_startup_skip_arm_really_skips_the_hook():
    import subprocess
    import sys

    from benchmarks import startup

    if startup.hook_installed() is None:
        pytest.skip("the .pth hook is not installed in this interpreter")
    probe = "import sys; print('lioncub_ds_autohook' in sys.modules)"
    outs = [subprocess.run([sys.executable, "-S", "-c", (pre + "import site; site.main(); " + probe)],
                           capture_output=True, text=True, check=True).stdout.strip()
            for pre in ("", startup._SKIP)]
    assert outs == ["True", "False"]


def test_zero_configs_are_stage1_with_the_sign_allgather():
    from benchmarks import zero

    for label, path in zero.CONFIGS.items():
        cfg = json.loads((Path(zero.ROOT) / path).read_text())
        assert cfg["zero_optimization"]["stage"] == 1 and cfg["optimizer"]["type"] == "LionCub"
        assert cfg["optimizer"]["params"]["zero_allgather"] == "auto"
        assert cfg.get("bf16", {}).get("enabled", False) == label.startswith("bf16")
        assert cfg["optimizer"]["params"].get("zero_fp32_replica", False) == label.startswith("bf16")


@pytest.mark.dist
def test_comm_records_and_1bit_ratio(tmp_path):
    configs = [c for c in comm.CONFIGS if c[0] in ("1bit/majority", "1bit/majority/tie=zero", "allgather/majority",
                                                   "int8/majority (l1)")]
    recs = comm.run(world_sizes=(2,), numel=65536, steps=1, chunk=20000, configs=configs, verbose=False)
    assert len(recs) == len(configs)
    for r in recs:
        assert COMM_FIELDS <= set(r), COMM_FIELDS - set(r)
        assert r["bench"] == "comm" and r["world_size"] == 2 and r["same_on_all_ranks"]
        assert r["fp32_allreduce_bytes"] == 2 * r["bf16_allreduce_bytes"] == 4 * 65536
        # counted bytes = the algorithm's own formula + the step's flags (carried or all-reduced)
        assert r["bytes_per_rank"] == r["algorithm_wire_bytes"] + r["control_bytes"]
    one = next(r for r in recs if r["label"] == "1bit/majority")
    assert one["ratio_vs_fp32"] >= 30
    zero = next(r for r in recs if r["label"] == "1bit/majority/tie=zero")
    assert zero["bytes_per_rank"] > one["bytes_per_rank"]  # even N + tie zero: phase 2 carries 2 planes
    path = tmp_path / "comm.json"
    from benchmarks.common import write_json

    write_json(path, recs)
    assert json.loads(path.read_text())[0]["bench"] == "comm"


def test_cost_model_fit_recovers_alpha_beta():
    true = CostModel(30e-6, 2e-9, 0.0)
    samples = [(m, b, true.collective_time(m, b)) for m in (1, 2, 6) for b in (1e3, 1e5, 1e7)]
    fit = CostModel.fit(samples)
    assert fit.alpha_s == pytest.approx(30e-6, rel=1e-6)
    assert fit.beta_s_per_byte == pytest.approx(2e-9, rel=1e-6)
    gamma, _ = CostModel.fit_gamma([(1e6, 1e-3 + 5e-4), (2e6, 1e-3 + 1e-3), (4e6, 1e-3 + 2e-3)])
    assert gamma == pytest.approx(5e-10, rel=1e-6)
    moved = fit.with_network(400, 5)
    assert moved.alpha_s == pytest.approx(5e-6) and moved.bandwidth_gbit == pytest.approx(400)


def test_scaling_predictions_and_crossovers(tmp_path):
    model = CostModel(50e-6, 1e-9, 0.0)
    recs, cross, _ = scaling.run(numels=(25_000_000,), n_max=256, model=model, verbose=False)
    for r in recs:
        assert {"bench", "algorithm", "network", "world_size", "predicted_comm_time_s"} <= set(r)
        assert r["predicted_comm_time_s"] > 0
    assert {r["algorithm"] for r in recs} == set(scaling.ALGORITHMS)
    assert max(r["world_size"] for r in recs if r["algorithm"] == "pbit") <= 255
    ag = [c for c in cross if c["bench"] == "scaling_crossover" and c["a"] == "allgather"
          and c["b"] == "bf16_allreduce" and c["network"] == "400G-IB, γ=0"]
    assert ag and ag[0]["world_size"] is not None and 8 <= ag[0]["world_size"] <= 64  # docs/conventions.md: ~32
    files = scaling.plot(recs + cross, str(tmp_path))
    assert all(os.path.getsize(f) > 0 for f in files)


def test_cost_model_fit_recovers_alpha_beta_from_noisy_samples():
    # +-20% deterministic multiplicative noise: the relative-error fit must land near the truth and
    # reproduce every sample within the noise (a broken or clamped fit fails both).
    true = CostModel(400e-6, 1.5e-9, 0.0)
    noise = (1.2, 0.8, 1.1, 0.9, 1.0, 1.15, 0.85, 1.05, 0.95)
    pts = [(m, b) for m in (1, 2, 6) for b in (1e3, 1e6, 3e7)]
    samples = [(m, b, true.collective_time(m, b) * f) for (m, b), f in zip(pts, noise)]
    fit = CostModel.fit(samples)
    assert fit.alpha_s == pytest.approx(400e-6, rel=0.2)
    assert fit.beta_s_per_byte == pytest.approx(1.5e-9, rel=0.2)
    for m, b, t in samples:
        assert 1 / 1.5 < t / fit.collective_time(m, b) < 1.5
    # time slightly FALLING with bytes (unconstrained β < 0): β is clamped to 0 and α refitted alone
    lat = CostModel.fit([(m, b, 1e-4 * m - 1e-12 * b) for m, b in pts])
    assert lat.beta_s_per_byte == 0 and lat.alpha_s == pytest.approx(1e-4, rel=0.3)


@pytest.mark.dist
def test_scaling_calibration_tiny():
    model, recs = scaling.calibrate(world_sizes=(2,), sizes=(1 << 10, 1 << 20), reps=2, validate_numel=0,
                                    gamma_numel=1 << 12, verbose=False)
    assert recs[0]["bench"] == "scaling_calibration"
    # No timing bands (a loaded CI machine made a 1 KB message take 10x its fitted time): real
    # collectives take time, so the fit cannot be all zero; the records must be the fit's.
    assert model.alpha_s + model.beta_s_per_byte > 0
    fit = [r for r in recs if r["bench"] == "scaling_fit"]
    assert len(fit) == 2 * 3
    for r in fit:
        # each record's prediction is the fitted model's, and its ratio is measured / predicted
        assert r["measured_s"] > 0
        assert r["predicted_s"] == pytest.approx(model.collective_time(r["messages"], r["bytes_sent"]))
        assert r["ratio"] == pytest.approx(r["measured_s"] / r["predicted_s"])
    assert recs[0]["fit_residual_min"] == min(r["ratio"] for r in fit)
    assert recs[0]["fit_residual_max"] == max(r["ratio"] for r in fit)


def test_converge_tiny():
    recs, curves, _ = converge.run(variants=("lion", "cub_1bit"), seeds=(0,), world_sizes=(2,), steps=2,
                                   n_layer=1, d_model=32, seq_len=16, batch_size=2, warmup=1, eval_every=1,
                                   eval_iters=1, eval_batch=2, verbose=False)
    assert [r["variant"] for r in recs] == ["lion", "cub_1bit"]
    for r in recs:
        assert {"bench", "variant", "seed", "steps", "val_loss", "bytes_per_rank", "digest"} <= set(r)
    assert recs[1]["bytes_per_rank"] < recs[0]["bytes_per_rank"]
    assert len(curves) == 2 * 3


def test_netns_refuses_clearly_when_it_cannot_run(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netns.main(["--steps", "1"]) != 0
    assert "root" in capsys.readouterr().err
    assert netns_nodes.main(["--steps", "1"]) != 0
    assert "root" in capsys.readouterr().err


@pytest.mark.dist
@pytest.mark.skipif(not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")),
                    reason="bench netns needs root and iproute2 (ip, tc)")
def test_netns_tiny_run():
    variants = ("no_comm", "ddp_lion_bf16", "lion_bf16_allreduce", "lioncub_1bit", "lioncub_1bit_overlap",
                "lioncub_1bit_cb0.5")
    recs = netns.run(bandwidths=(10.0,), world_size=2, steps=1, warmup=1, seq_len=8, batch_size=1,
                     variants=variants, timeout=600,
                     model_overrides={"n_layer": 1, "d_model": 32, "n_head": 2}, verbose=False)
    assert tuple(r["variant"] for r in recs) == variants
    by = {r["variant"]: r for r in recs}
    for r in recs:
        assert {"bench", "variant", "bandwidth_gbit", "world_size", "params", "step_time_s", "comm_time_s",
                "kernel_time_s", "compute_time_s", "floor_comm_time_s", "speedup_vs_bf16_allreduce",
                "speedup_vs_ddp_lion_bf16", "step_vs_no_comm", "link_bytes_per_rank",
                "link_rate_per_rank_gbit"} <= set(r)
        assert r["link_bytes_per_rank"] is not None  # the namespace's lo counter was read
    assert by["no_comm"]["bytes_per_rank"] == 0
    for v in ("ddp_lion_bf16", "lion_bf16_allreduce", "lioncub_1bit", "lioncub_1bit_overlap"):
        # what crossed the link: the formula's bytes plus headers and barriers (no_comm's row), never less
        assert by[v]["link_bytes_per_rank"] >= by[v]["bytes_per_rank"] > 0
    assert by["ddp_lion_bf16"]["bytes_per_rank"] == by["lion_bf16_allreduce"]["bytes_per_rank"]
    assert by["lioncub_1bit"]["link_bytes_per_rank"] < by["lion_bf16_allreduce"]["link_bytes_per_rank"]
    assert by["lioncub_1bit_overlap"]["link_bytes_per_rank"] < by["lion_bf16_allreduce"]["link_bytes_per_rank"]
    assert by["lioncub_1bit_overlap"]["comm_time_method"].startswith("overlapped")
    assert not [ln for ln in os.popen("ip netns list").read().splitlines() if ln.startswith("lioncub-bench-")
                and ln.split("-")[2] == str(os.getpid())]


def test_kernels_lion_step_table_smoke():
    """The single-process step table: every implementation timed, the fused step checked against foreach."""
    import torch

    from benchmarks import kernels as kb

    recs = kb.run_lion_step(4096, 1, [torch.float32, torch.bfloat16])
    impls = {r["impl"] for r in recs}
    assert {"fused", "foreach", "single"} <= impls
    assert all(r["lion_match"] and r["bytes_per_param"] in (20, 10) and r["s_per_1M"] > 0 for r in recs)
    assert "fused" in kb.format_lion_table(recs)
