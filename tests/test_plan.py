"""The planner (``python -m lioncub_ds.plan``, docs/planner.md): its bytes and state against real
LionCub ranks, its formulas against the known collectives, its CLI, JSON and errors.

* dist: for every strategy LionCub runs (flat ``1bit`` with the int8 momentum sync every 20,
  master-only sharding, node voters 2 × 2 with the sync) the bytes the planner predicts per scope
  equal what ``comm_stats()`` counts over 20 steps on 4 gloo ranks (one sync period), and its state
  per GPU equals ``state_bytes()`` plus the parameters and gradients;
* unit: DDP's, ZeRO's and Megatron's bytes are their collectives in the ring model; links, memory,
  the recommendation, the convergence table (regenerated from the committed studies), the CLI and
  its errors.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from lioncub_ds import plan as P
from lioncub_ds.telemetry import ring_bytes
from dist_helpers import run_ranks

# with 0.1 MB buckets (26,208 elements): one tensor larger than a bucket (a bucket of its own), odd
# small ones sharing one, and another of its own: three buckets, every one padded
NUMELS = (70_001, 1003, 77, 4099, 33_333)
BUCKET_MB = 0.1
STEPS = 20  # one momentum-sync period: the sync runs at step index 0 of every 20


def _spec(nodes=2, gpus=2, precision="fp32", numels=NUMELS, bucket_mb=25.0, **cluster):
    return (P.ModelSpec(param_numels=numels), P.ClusterSpec(nodes=nodes, gpus_per_node=gpus, **cluster),
            P.WorkloadSpec(precision=precision, compute_time_s=0.1, bucket_size_mb=bucket_mb))


def _row(result, name):
    return next(r for r in result["strategies"] if r["name"] == name)


def _scoped_bytes(row, steps):
    """Bytes per scope over ``steps`` steps, from the planner's collectives (exact integers)."""
    out = {}
    for c in row["collectives"]:
        assert steps % c["every_steps"] == 0
        out[c["scope"]] = out.get(c["scope"], 0) + round(c["bytes_per_gpu"]) * (steps // c["every_steps"])
    return out


# ----------------------------------------------------------------------------- real ranks
def _train(rank, n, numels, dtype, kw, steps):
    from lioncub_ds import LionCub

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(k).to(dtype)) for k in numels]
    opt = LionCub(params, lr=1e-3, betas=(0.95, 0.98), comm="1bit", bucket_size_mb=BUCKET_MB,
                  momentum_sync={"every": 20, "dtype": "int8"}, **kw)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        for p in params:  # positive: no c is exactly 0 (node means included), so nobody abstains
            p.grad = (torch.rand(p.shape, generator=gen) + 0.01).to(dtype)
        opt.step()
    cum = opt.comm_stats()["cumulative"]
    return {"bytes": cum["bytes_sent"], "scopes": dict(cum["by_scope"]), "state": opt.state_bytes(),
            "params": sum(p.numel() * p.element_size() for p in params),
            "grads": sum(p.grad.numel() * p.grad.element_size() for p in params)}


CASES = {  # strategy -> (LionCub settings, parameter dtype)
    "lioncub_1bit_sync20": ({}, torch.float32),
    "lioncub_master_only": ({"node_size": 2}, torch.bfloat16),
    "lioncub_node_voters_sync20": ({"voters": "node", "node_size": 2}, torch.bfloat16),
}


@pytest.mark.dist
@pytest.mark.parametrize("name", list(CASES))
def test_bytes_and_state_equal_real_ranks(name):
    kw, dtype = CASES[name]
    res = run_ranks(_train, 4, NUMELS, dtype, kw, STEPS, timeout=600)
    precision = "fp32" if dtype == torch.float32 else "bf16"
    row = _row(P.plan(*_spec(precision=precision, bucket_mb=BUCKET_MB), strategies=(name,)), name)
    want = _scoped_bytes(row, STEPS)
    for r in res:
        got = {k: v for k, v in r["scopes"].items() if v}
        assert got == want, (name, got, want)
        assert r["bytes"] == sum(want.values())
        assert r["bytes"] == pytest.approx(row["bytes_per_gpu"] * STEPS, rel=1e-12)
        st = row["state_breakdown"]
        assert st["momentum"] == r["state"]["momentum"]
        lioncub_master = st["master"] if st["master_holder"].startswith("LionCub") else 0
        assert lioncub_master == r["state"]["master"]
        assert st["params"] == r["params"] and st["grads"] == r["grads"]
        framework = st["master"] - lioncub_master
        assert row["model_state_bytes_per_gpu"] == (r["state"]["momentum"] + r["state"]["master"] + framework
                                                     + r["params"] + r["grads"])
    if name == "lioncub_node_voters_sync20":
        assert set(want) == {"intra_node", "inter_node"}
        assert row["inter_node_bytes_per_node"] > 0
    elif name == "lioncub_master_only":
        assert set(want) == {"vote_group", "intra_node"}
        assert r["state"]["master"] > 0
    else:
        assert set(want) == {"vote_group"}


# ----------------------------------------------------------------------------- formulas
@pytest.mark.unit
def test_baselines_are_their_collectives():
    numels = (1_000_003, 4099)
    p = sum(numels)
    res = P.plan(*_spec(nodes=4, gpus=8, precision="bf16", numels=numels))
    n = 32
    ddp = _row(res, "ddp_bf16")
    assert ddp["bytes_per_gpu"] == ring_bytes("all_reduce", 2 * p, n)
    pad = -(-p // n) * n
    for z in ("zero1", "zero2"):
        assert _row(res, z)["bytes_per_gpu"] == ring_bytes("reduce_scatter", 2 * pad, n) + \
            ring_bytes("all_gather", 2 * pad, n)
    k1 = _row(res, "megatron_distopt_k1")
    assert k1["bytes_per_gpu"] == ring_bytes("reduce_scatter", 2 * pad, n) + ring_bytes("all_gather", 2 * pad, n)
    kn = _row(res, "megatron_distopt_kN")  # 4 instances of 8: reduce-scatter, all-reduce of the shard, all-gather
    pad8 = -(-p // 8) * 8
    assert kn["bytes_per_gpu"] == (ring_bytes("reduce_scatter", 2 * pad8, 8) + ring_bytes("all_reduce", 2 * pad8 // 8, 4)
                                   + ring_bytes("all_gather", 2 * pad8, 8))
    # a ring over nodes: one rank's stream crosses each node boundary; the two-level one sends
    # only the shards' all-reduce across nodes (8 ranks of a node, each its own shard)
    assert ddp["inter_node_bytes_per_node"] == ring_bytes("all_reduce", 2 * p, n)
    assert kn["inter_node_bytes_per_node"] == 8 * ring_bytes("all_reduce", 2 * pad8 // 8, 4)
    # memory: Lion's momentum and fp32 master, sharded over the data-parallel group or the instance
    assert ddp["state_bytes_per_gpu"] == 8 * p
    assert _row(res, "zero1")["state_bytes_per_gpu"] == 3 * 4 * pad // n
    assert kn["state_bytes_per_gpu"] == 8 * pad8 // 8


@pytest.mark.unit
def test_node_voters_cross_nodes_once_per_node():
    res = P.plan(*_spec(nodes=8, gpus=8, precision="bf16", numels=(7_000_001,)), sync_every=0)
    flat, node = _row(res, "lioncub_1bit_sync20"), _row(res, "lioncub_node_voters_sync20")
    # flat voting's all-to-all sends each GPU's share for the other nodes over the NIC (8 x 7/8 x 56/63 P/8
    # per node, + P/8 of the ring all-gather); node voters send one voter's 2 x 7/8 x P/8 per node
    assert flat["inter_node_bytes_per_node"] > 4 * node["inter_node_bytes_per_node"]
    assert node["state_bytes_per_gpu"] * 8 == pytest.approx(flat["state_bytes_per_gpu"], rel=1e-3)  # momentum, master / L
    assert res["inputs"]["dp_ranks_per_node"] == 8 and res["inputs"]["dp_nodes"] == 8


@pytest.mark.unit
def test_time_follows_the_links_and_the_recommendation_follows_the_time():
    kw = dict(params=7 * 10**9)
    slow = P.plan(P.ModelSpec(**kw), P.ClusterSpec(nodes=8, inter_gbit_s=25), P.WorkloadSpec())
    fast = P.plan(P.ModelSpec(**kw), P.ClusterSpec(nodes=8, inter_gbit_s=3200), P.WorkloadSpec())
    for name in P.STRATEGIES:
        assert _row(slow, name)["step_time_s"] >= _row(fast, name)["step_time_s"]
    assert slow["recommendation"]["name"] not in P.EXACT  # 25 Gbit/s: the bytes decide
    assert fast["recommendation"]["name"] in P.EXACT      # 3.2 Tbit/s: nothing worth a convergence risk
    one = P.plan(P.ModelSpec(**kw), P.ClusterSpec(nodes=1), P.WorkloadSpec())
    assert all(_row(one, n)["inter_node_bytes_per_node"] == 0 for n in P.STRATEGIES)
    r = _row(slow, "ddp_bf16")
    assert r["exposed_comm_overlap_s"] <= r["exposed_comm_no_overlap_s"] == r["comm_time_s"]
    assert r["tokens_per_s"] == pytest.approx(8192 * 64 / r["step_time_s"])


@pytest.mark.unit
def test_fit_and_what_does_not_fit():
    res = P.plan(P.ModelSpec(params=70 * 10**9), P.ClusterSpec(nodes=2), P.WorkloadSpec(tp=8))
    assert not _row(res, "ddp_bf16")["fits"]  # 70B/8 x 14 bytes = 123 GB
    tiny = P.plan(P.ModelSpec(params=70 * 10**9), P.ClusterSpec(nodes=1, gpu_mem_gib=1), P.WorkloadSpec())
    assert tiny["recommendation"]["name"] is None and "nothing fits" in tiny["recommendation"]["why"]


@pytest.mark.unit
def test_gpt_shape_counts_and_flops():
    m = P.ModelSpec(layers=24, hidden=2048, vocab=50257, seq=2048)
    assert 1.2e9 < m.total < 1.5e9
    assert m.flops_per_token() == 6 * m.total + 12 * 24 * 2048 * 2048
    assert sum(m.gpu_numels(2, 1)) < m.total  # a TP slice


# ----------------------------------------------------------------------------- convergence table
@pytest.mark.unit
def test_convergence_table_is_the_committed_studies():
    from benchmarks.plan_check import convergence_rows

    assert P.convergence_table() == json.loads(json.dumps(convergence_rows())), \
        "regenerate it: python -m benchmarks plan_check --write-convergence-table"


@pytest.mark.unit
def test_convergence_cost_names_its_study_or_says_not_measured():
    c = P.convergence_cost(("node_1bit_sync20_int8", 16, 2))
    assert c["study"] == "node_voters_converge" and c["seeds"] == 5 and abs(c["gap_pct"] - 0.245) < 1e-9
    assert P.convergence_cost(("flat_1bit_sync20_int8", 8, 1))["seeds"] == 10  # the 10-seed study wins
    miss = P.convergence_cost(("flat_1bit_sync20_int8", 64, 1))
    assert miss["gap_pct"] is None and miss["text"].startswith("not measured at N=64")
    assert P.convergence_cost(("global", 64, 1))["gap_pct"] == 0.0


# ----------------------------------------------------------------------------- CLI, JSON, errors
def _cli(*args):
    return subprocess.run([sys.executable, "-m", "lioncub_ds.plan", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.unit
def test_cli_json_lists_every_strategy_with_the_issue_fields():
    out = P.main  # the same entry point as python -m lioncub_ds.plan
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert out(["--params", "1.3B", "--nodes", "2", "--gpus-per-node", "8", "--inter-node-gbit", "100",
                    "--json"]) == 0
    data = json.loads(buf.getvalue())
    assert [s["name"] for s in data["strategies"]] == list(P.STRATEGIES)
    for s in data["strategies"]:
        for key in ("name", "bytes_per_gpu", "inter_node_bytes_per_node", "state_bytes_per_gpu", "fits",
                    "step_time_s"):
            assert key in s, key
        assert s["step_time_s"] > 0 and isinstance(s["fits"], bool)
    rec = data["recommendation"]
    assert rec["name"] in P.STRATEGIES and rec["config"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        out(["--params", "7e9", "--nodes", "8", "--inter-node-gbit", "25"])
    text = buf.getvalue()
    assert text.startswith("PREDICTIONS") and "Recommendation:" in text
    assert '"type": "LionCub"' in text and "--lioncub-comm 1bit" in text


@pytest.mark.unit
@pytest.mark.parametrize("args, flag, allowed", [
    (["--params", "-5"], "--params", "positive count"),
    (["--params", "1B", "--nodes", "2.5"], "--nodes", "integer >= 1"),
    (["--params", "1B", "--nodes", "0"], "--nodes", "integer >= 1"),
    (["--params", "1B", "--precision", "fp8"], "--precision", "bf16"),
    (["--params", "1B", "--inter-node-gbit", "-1"], "--inter-node-gbit", "number > 0"),
    (["--params", "1B", "--mfu", "1.5"], "--mfu", "<= 1"),
    (["--params", "1B", "--strategies", "fsdp"], "--strategies", "ddp_bf16"),
    (["--nodes", "2"], "--params", "GPT shape"),
    (["--params", "1B", "--tp", "3"], "--tp", "divisor"),
])
def test_bad_input_names_the_flag_and_the_allowed_values(args, flag, allowed, capsys):
    with pytest.raises(SystemExit) as exc:
        P.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and allowed in err, err


@pytest.mark.unit
def test_bad_values_through_the_function_api():
    with pytest.raises(P.PlanInputError, match="--nodes.*integer >= 1"):
        P.ClusterSpec(nodes=2.5)
    with pytest.raises(P.PlanInputError, match="--precision.*bf16 | fp16 | fp32"):
        P.WorkloadSpec(precision="int4")
    with pytest.raises(P.PlanInputError, match="--params.*integer >= 1"):
        P.ModelSpec(params=-1)
    with pytest.raises(P.PlanInputError, match="--sync-every"):
        P.plan(P.ModelSpec(params=10**9), P.ClusterSpec(), P.WorkloadSpec(), sync_every=-1)


@pytest.mark.dist
def test_module_runs_as_a_program():
    res = _cli("--params", "1.3B", "--nodes", "2", "--inter-node-gbit", "100")
    assert res.returncode == 0, res.stderr
    assert "Recommendation:" in res.stdout
    bad = _cli("--params", "1B", "--nodes", "two")
    assert bad.returncode == 2 and "--nodes must be an integer >= 1" in bad.stderr
