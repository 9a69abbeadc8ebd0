"""Smoke tests of the benchmarks (tiny sizes; no timing assertions)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from lioncub_ds.bench import BENCHMARKS, comm, converge, netns, scaling
from lioncub_ds.comm.cost import CostModel

COMM_FIELDS = {"bench", "algorithm", "vote", "world_size", "numel", "bytes_per_rank", "fp32_allreduce_bytes",
               "bf16_allreduce_bytes", "ratio_vs_fp32", "ratio_vs_bf16"}


def test_registry_lists_every_benchmark():
    for name in ("kernels", "comm", "netns", "converge", "scaling"):
        assert name in BENCHMARKS


def test_comm_records_and_1bit_ratio(tmp_path):
    configs = [c for c in comm.CONFIGS if c[0] in ("1bit/majority", "1bit/majority/tie=zero", "allgather/majority",
                                                   "int8/majority (l1)")]
    recs = comm.run(world_sizes=(2,), numel=65536, steps=1, chunk=20000, configs=configs, verbose=False)
    assert len(recs) == len(configs)
    for r in recs:
        assert COMM_FIELDS <= set(r), COMM_FIELDS - set(r)
        assert r["bench"] == "comm" and r["world_size"] == 2 and r["same_on_all_ranks"]
        assert r["fp32_allreduce_bytes"] == 2 * r["bf16_allreduce_bytes"] == 4 * 65536
        # counted bytes = the algorithm's own formula + the one small control all-reduce
        assert r["bytes_per_rank"] == r["algorithm_wire_bytes"] + r["control_bytes"]
    one = next(r for r in recs if r["label"] == "1bit/majority")
    assert one["ratio_vs_fp32"] >= 30
    zero = next(r for r in recs if r["label"] == "1bit/majority/tie=zero")
    assert zero["bytes_per_rank"] > one["bytes_per_rank"]  # even N + tie zero: phase 2 carries 2 planes
    path = tmp_path / "comm.json"
    from lioncub_ds.bench.common import write_json

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
    assert ag and ag[0]["world_size"] is not None and 8 <= ag[0]["world_size"] <= 64  # SPEC: ~32
    files = scaling.plot(recs + cross, str(tmp_path))
    assert all(os.path.getsize(f) > 0 for f in files)


def test_scaling_calibration_tiny():
    model, recs = scaling.calibrate(world_sizes=(2,), sizes=(1 << 10, 1 << 16), reps=1, validate_numel=0,
                                    gamma_numel=1 << 12, verbose=False)
    assert model.alpha_s >= 0 and model.beta_s_per_byte >= 0 and model.gamma_s_per_byte >= 0
    assert recs[0]["bench"] == "scaling_calibration"


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


@pytest.mark.skipif(not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")),
                    reason="bench netns needs root and iproute2 (ip, tc)")
def test_netns_tiny_run():
    recs = netns.run(bandwidths=(10.0,), world_size=2, steps=1, warmup=0, seq_len=8, batch_size=1,
                     variants=("lion_bf16_allreduce", "lioncub_1bit"), timeout=600,
                     model_overrides={"n_layer": 1, "d_model": 32, "n_head": 2}, verbose=False)
    assert [r["variant"] for r in recs] == ["lion_bf16_allreduce", "lioncub_1bit"]
    for r in recs:
        assert {"bench", "variant", "bandwidth_gbit", "world_size", "params", "step_time_s", "comm_time_s",
                "floor_comm_time_s", "speedup_vs_bf16_allreduce"} <= set(r)
        assert r["bytes_per_rank"] > 0
    assert recs[1]["bytes_per_rank"] < recs[0]["bytes_per_rank"]
    assert not [ln for ln in os.popen("ip netns list").read().splitlines() if ln.startswith("lioncub-bench-")
                and ln.split("-")[2] == str(os.getpid())]
