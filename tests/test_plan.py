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
import math
import re
import subprocess
import sys
from pathlib import Path

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
ROOT = Path(__file__).resolve().parents[1]


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
    assert m.gpu_params(2, 1) < m.total  # a TP slice


# ----------------------------------------------------------------------------- convergence table
STUDY = ROOT / "docs" / "lion_w300" / "converge.json"


def _summaries():
    """The chosen study's summary rows, read from its committed JSON (not through the planner's table)."""
    return [r for r in json.loads(STUDY.read_text()) if r.get("bench") == "converge_summary"]


def _want(r):
    L = r.get("node_size", 1)
    sync = re.search(r"_sync([0-9]+)_int8", r["variant"])
    what = f"node voters {r['world_size'] // L} x {L}" if L > 1 else "flat 1bit"
    what += f" + int8 sync/{sync.group(1)}" if sync else ""
    return (f"lion_w300 N = {r['world_size']}, {what}: {r['gap_pct']:+.2f}% [{r['ci_lo_pct']:+.2f}, "
            f"{r['ci_hi_pct']:+.2f}], {len(r['seeds'])} seeds")


@pytest.mark.unit
def test_convergence_table_is_the_committed_studies():
    from benchmarks.plan_check import convergence_rows

    assert P.convergence_table() == json.loads(json.dumps(convergence_rows())), \
        "regenerate it: python -m benchmarks plan_check --write-convergence-table"
    assert {src["study"] for src in P.convergence_table()["sources"]} == {"lion_w300"}  # no superseded preset


@pytest.mark.unit
def test_convergence_column_quotes_lion_w300_where_measured():
    """Every configuration lion_w300 measured, planned on the cluster it ran as (N / L nodes of L GPUs),
    is quoted from the study's JSON: the study, N, the configuration, the gap, its interval, the seeds."""
    checked = 0
    for r in _summaries():
        L = r.get("node_size", 1)
        name = {"cub_1bit_sync20_int8": "lioncub_1bit_sync20",
                f"cub_1bit_sync20_int8_node{L}": "lioncub_node_voters_sync20"}.get(r["variant"])
        if name is None:
            continue
        res = P.plan(P.ModelSpec(params=10**9), P.ClusterSpec(nodes=r["world_size"] // L, gpus_per_node=L),
                     P.WorkloadSpec(), strategies=(name,))
        conv = _row(res, name)["convergence"]
        assert conv["text"] == _want(r) and conv["exact"], (conv["text"], _want(r))
        checked += 1
    assert checked >= 9  # N = 8, 16, 32: flat + sync, node voters of 2 and 4 (and N = 64 once committed)


@pytest.mark.unit
def test_convergence_column_quotes_the_nearest_measured_n_with_its_interval():
    """8 nodes x 8 GPUs (what the planner recommends node voters for): the largest measured N nearest to
    64, and there the node size nearest to 8; with --sync-every 0, flat 1bit without sync; a
    configuration the study never ran says so. Every output line fits 120 columns."""
    rows = [r for r in _summaries() if re.fullmatch(r"cub_1bit_sync20_int8_node[0-9]+", r["variant"])]
    n = min({r["world_size"] for r in rows}, key=lambda m: (abs(math.log(m / 64)), -m))
    near = min((r for r in rows if r["world_size"] == n), key=lambda r: (abs(math.log(r["node_size"] / 8)),
                                                                         -r["node_size"]))
    res = P.plan(P.ModelSpec(params=7 * 10**9), P.ClusterSpec(nodes=8, gpus_per_node=8), P.WorkloadSpec())
    conv = _row(res, "lioncub_node_voters_sync20")["convergence"]
    exact = n == 64 and near["node_size"] == 8
    assert conv["text"] == (_want(near) if exact else f"not measured at N = 64; nearest: {_want(near)}")
    assert conv["ci95"] == [near["ci_lo_pct"], near["ci_hi_pct"]]
    text = P.format_plan(res)
    assert all(len(line) <= P.WIDTH for line in text.splitlines()), max(text.splitlines(), key=len)
    for r in res["strategies"]:
        if r["name"] not in P.EXACT:
            assert "lion_w300 N = " in r["convergence"]["text"] and re.search(r"\[[-+][0-9.]+, [-+][0-9.]+\]",
                                                                              r["convergence"]["text"])
            assert r["convergence"]["text"] in text.replace("\n    ", " ")
    flat = {r["world_size"]: r for r in _summaries() if r["variant"] == "cub_1bit"}
    nosync = P.plan(P.ModelSpec(params=10**9), P.ClusterSpec(nodes=4, gpus_per_node=4), P.WorkloadSpec(),
                    sync_every=0)
    assert _row(nosync, "lioncub_1bit_sync20")["convergence"]["text"] == _want(flat[16])
    assert _row(nosync, "lioncub_node_voters_sync20")["convergence"]["text"] == \
        "not measured: lion_w300 has no node voters run"
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
    assert '"type": "LionCub"' in text
    assert "--lioncub-comm 1bit" in text or "Megatron-LM: not available for this strategy" in text


@pytest.mark.unit
@pytest.mark.parametrize("args, flag, allowed", [
    (["--params", "-5"], "--params", "integer >= 1 and <= 1e+15"),
    (["--params", "1e30"], "--params", "integer >= 1 and <= 1e+15"),   # was an OverflowError traceback
    (["--params", "1e16"], "--params", "integer >= 1 and <= 1e+15"),   # was a MemoryError
    (["--params", "1e400"], "--params", "integer >= 1 and <= 1e+15"),
    (["--params", "1B", "--nodes", "2.5"], "--nodes", "integer >= 1"),
    (["--params", "1B", "--nodes", "0"], "--nodes", "integer >= 1"),
    (["--params", "1B", "--precision", "fp8"], "--precision", "bf16"),
    (["--params", "1B", "--inter-node-gbit", "-1"], "--inter-node-gbit", "number >= 0.001"),
    (["--params", "1B", "--inter-node-gbit", "1e-300"], "--inter-node-gbit", "number >= 0.001"),  # 300-digit times
    (["--params", "1B", "--inter-node-gbit", "nan"], "--inter-node-gbit", "number >= 0.001"),
    (["--params", "1B", "--mfu", "1.5"], "--mfu", "<= 1"),
    (["--params", "1B", "--strategies", "fsdp"], "--strategies", "ddp_bf16"),
    (["--nodes", "2"], "--params", "GPT shape"),
    (["--params", "1B", "--tp", "3"], "--tp", "divisor"),
    (["--params", "1B", "--sync-every", "-1"], "--sync-every", "integer >= 0"),
    (["--layers", "10000", "--hidden", "1000000", "--vocab", "5", "--seq", "5"], "--hidden", "at most 1e+15"),
])
def test_bad_input_names_the_flag_and_the_allowed_values(args, flag, allowed, capsys):
    with pytest.raises(SystemExit) as exc:
        P.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and allowed in err, err
    assert len(err.splitlines()) == 1, err  # one line, no usage block, no traceback


def _cli_flags():
    return sorted({f for a in P.build_parser()._actions for f in a.option_strings} & set(P.LIMITS))


@pytest.mark.unit
@pytest.mark.parametrize("flag", _cli_flags())
def test_every_flag_refuses_values_outside_its_range_in_one_line(flag, capsys):
    """Each numeric flag has a lowest and a highest value: just outside either end, the program says
    so in one line naming the flag and the range; at either end it plans."""
    integer, lo, hi = P.LIMITS[flag]
    base = {"--params": "1B", "--nodes": "2", "--gpus-per-node": "2"}
    below, above = (lo - 1, hi + 1) if integer else (lo / 2 if lo else -1e-9, hi * 2)
    for value in (below, above):
        args = dict(base, **{flag: repr(value)})
        with pytest.raises(SystemExit) as exc:
            P.main([f"{k}={v}" for k, v in args.items()])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and len(err.splitlines()) == 1, err
        assert f"{flag} must be {P.allowed(flag)}" in err, err


@pytest.mark.unit
def test_bad_values_through_the_function_api():
    with pytest.raises(P.PlanInputError, match="--nodes.*integer >= 1"):
        P.ClusterSpec(nodes=2.5)
    with pytest.raises(P.PlanInputError, match="--precision.*bf16 | fp16 | fp32"):
        P.WorkloadSpec(precision="int4")
    with pytest.raises(P.PlanInputError, match="--params.*integer >= 1"):
        P.ModelSpec(params=-1)
    with pytest.raises(P.PlanInputError, match="--params.*<= 1e"):
        P.ModelSpec(params=10**30)
    with pytest.raises(P.PlanInputError, match="--inter-node-gbit.*>= 0.001"):
        P.ClusterSpec(inter_gbit_s=1e-300)
    with pytest.raises(P.PlanInputError, match="--update-time-s"):
        P.WorkloadSpec(update_time_s=float("inf"))
    with pytest.raises(P.PlanInputError, match="--sync-every"):
        P.plan(P.ModelSpec(params=10**9), P.ClusterSpec(), P.WorkloadSpec(), sync_every=-1)


@pytest.mark.unit
@pytest.mark.parametrize("params", [10**13, 10**15])
def test_the_largest_models_plan_in_closed_form(params):
    """--params 1e13 ran for minutes and 1e16 ran out of memory: one list entry per 4M-element tensor.
    The layout is runs of equal sizes now: a model of any allowed size is two runs of tensors, its
    buckets a few runs, and the bytes are the per-bucket formula times the bucket count."""
    model, cluster = P.ModelSpec(params=params), P.ClusterSpec(nodes=8, gpus_per_node=8, inter_gbit_s=1e-3)
    runs = model.gpu_runs(1, 1)
    chunk = 4 * 2**20
    assert runs == ((chunk, params // chunk), (params % chunk, 1))
    res = P.plan(model, cluster, P.WorkloadSpec(bucket_size_mb=1e-3))  # buckets of 256: a chunk per bucket
    flat = _row(res, "lioncub_1bit_sync20")
    votes = flat["collectives"][0]
    assert votes["purpose"].startswith("votes (phase 1)")
    n, pad = 64, P.wire.padded_numel
    ones = [(pad((chunk + 7) // 8 * 8, n), params // chunk), (pad((params % chunk + 7) // 8 * 8, n), 1)]
    phase1 = sum(c * (P.wire.onebit_wire_bytes(b, n) - ring_bytes("all_gather", b // 8, n)) for b, c in ones)
    assert votes["bytes_per_gpu"] == phase1 + P.wire.flag_bytes(params // chunk + 1, n, carried=True)
    for r in res["strategies"]:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("step_time_s", "tokens_per_s", "bytes_per_gpu"))
    text = P.format_plan(res)
    assert max(len(x) for x in text.splitlines()) <= P.WIDTH


@pytest.mark.dist
def test_module_runs_as_a_program():
    res = _cli("--params", "1.3B", "--nodes", "2", "--inter-node-gbit", "100")
    assert res.returncode == 0, res.stderr
    assert "Recommendation:" in res.stdout
    bad = _cli("--params", "1B", "--nodes", "two")
    assert bad.returncode == 2 and "--nodes must be an integer >= 1" in bad.stderr
    assert len(bad.stderr.splitlines()) == 1, bad.stderr
