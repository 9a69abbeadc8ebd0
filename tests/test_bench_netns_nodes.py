"""``bench netns_nodes`` on a tiny model: two namespaces (nodes) joined by a shaped veth pair; and
its records and goals (the parameter-sharding variants of issue 44) from synthetic rows."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from benchmarks import netns, netns_nodes

pytestmark = pytest.mark.dist

FIELDS = {"bench", "variant", "status", "bandwidth_gbit", "nodes", "ranks_per_node", "world_size", "params",
          "step_time_s", "inter_node_bytes_per_rank", "intra_node_bytes_per_rank", "formula_bytes_per_rank"}
COMM = ("ddp_lion_bf16", "two_level_bf16", "lioncub_1bit", "lioncub_1bit_node", "lioncub_1bit_node_overlap")


def _why_not() -> str | None:
    why = netns.preflight(netns_nodes.NAME)
    if why:
        return why
    probe = f"lioncub-probe-{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode != 0:
        return f"ip netns is unavailable here: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ours():
    return [ln for ln in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
            if ln.startswith(f"lioncub-nodes-{os.getpid()}-")]


def test_netns_nodes_tiny_run(tmp_path):
    why = _why_not()
    if why:
        pytest.skip(why)
    rc = netns_nodes.main(["--bandwidths", "10", "--steps", "1", "--warmup", "1", "--seq-len", "8", "--n-layer", "1",
                           "--d-model", "32", "--n-head", "2", "--out", str(tmp_path)])
    assert rc == 0
    assert not _ours(), "a namespace was left behind"
    recs = json.loads((tmp_path / "netns_nodes.json").read_text())
    assert (tmp_path / "netns_nodes.png").stat().st_size > 0
    assert [r["variant"] for r in recs] == list(netns_nodes.DEFAULT_VARIANTS)
    by = {r["variant"]: r for r in recs}
    for r in recs:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert (r["nodes"], r["ranks_per_node"], r["world_size"]) == (2, 2, 4)
        assert r["status"] == "ok" and r["step_time_s"] > 0, r
        if r["variant"] != "no_comm":  # what one end sent, the other received (a few barrier packets apart)
            assert r["inter_node_rx_bytes_per_rank"] == pytest.approx(r["inter_node_bytes_per_rank"], rel=0.05)
    # no_comm: only the barriers around each step cross the link
    quiet = by["no_comm"]["inter_node_bytes_per_rank"]
    assert by["no_comm"]["formula_bytes_per_rank"] == 0 and quiet < 4096
    for v in COMM:
        if not v.startswith("lioncub_1bit_node"):
            assert by[v]["inter_node_bytes_per_rank"] > max(4 * quiet, 0), v
    # node voters: one voter per node on the slow link (fewer veth bytes than flat 1bit, more than
    # the barriers), the group's gradients and parameters on the loopback
    node, flat = by["lioncub_1bit_node"], by["lioncub_1bit"]
    assert quiet < node["inter_node_bytes_per_rank"] < flat["inter_node_bytes_per_rank"]
    assert node["intra_node_bytes_per_rank"] > flat["intra_node_bytes_per_rank"]
    # with overlap=True the same collectives, started earlier: the same bytes on each link
    over = by["lioncub_1bit_node_overlap"]
    assert over["formula_bytes_per_rank"] == node["formula_bytes_per_rank"]
    assert over["inter_node_bytes_per_rank"] == pytest.approx(node["inter_node_bytes_per_rank"], rel=0.1, abs=4 * quiet)
    assert over["intra_node_bytes_per_rank"] == pytest.approx(node["intra_node_bytes_per_rank"], rel=0.1)
    # the topology: the two-level baseline sends 1/L of the bf16 gradient across nodes, flat DDP more
    two, ddp = by["two_level_bf16"], by["ddp_lion_bf16"]
    assert two["inter_node_bytes_per_rank"] < ddp["inter_node_bytes_per_rank"]
    # the address choice: node-internal traffic (reduce-scatter, all-gather: more bytes than the
    # inter-node all-reduce) stays on lo; the veth carries the cross all-reduce (+ headers, barriers)
    assert two["formula_inter_node_bytes_per_rank"] > 0
    assert two["intra_node_bytes_per_rank"] >= two["formula_intra_node_bytes_per_rank"]
    assert two["inter_node_bytes_per_rank"] <= 1.5 * two["formula_inter_node_bytes_per_rank"] + quiet


# ----------------------------------------------------------------------------- sharded variants (issue 44)
SHARDED_RUN = ("no_comm", "zero3", "zero3_votes", "fsdp2_hsdp_bf16", "fsdp2_votes")


def _rows(variant_specs, rounds=3):
    """One node's ranks' rows as ``timed_rounds`` writes them: ``variant_specs`` maps a variant to
    (compute s, comm s in step, update s, formula bytes, veth tx of this node, lo tx, split)."""
    ranks = []
    for k in range(2):
        rows = []
        for r in range(rounds):
            for v, (comp, comm, upd, sent, veth, lo, split) in variant_specs.items():
                row = {"round": r, "variant": v, "step_s": comp + upd, "compute_s": comp, "comm_s": comm,
                       "update_s": upd, "kernel_s": upd - comm, "bytes": sent, "collectives": None, "loss": 1.0}
                if k == 0:  # the node's first rank reads the namespace's counters
                    row.update(veth_tx_bytes=veth, veth_rx_bytes=veth, ns_lo_tx_bytes=lo)
                if split:
                    row["split"] = dict(split)
                rows.append(row)
        ranks.append(rows)
    return ranks


def _raws(specs, unavailable=None, order=None):
    variants = list(order or specs) + [v for v in unavailable or {} if v not in (order or ())]
    cfg = {"batch_size": 1, "seq_len": 8, "variants": variants}
    return [{"params": 1000, "ranks": _rows(specs), "unavailable": dict(unavailable or {}), "cfg": cfg}
            for j in range(2)]


SPECS = {  # (compute, comm in step, update, formula bytes, veth tx per node, lo tx per node, split)
    "no_comm": (0.10, 0.0, 0.02, 0, 2_000, 800, None),
    "zero3": (0.50, 0.0, 0.05, 0, 4_000_000, 3_000_000, {"inter_node_bytes": 0}),
    "zero3_votes": (0.30, 0.04, 0.08, 130, 200_000, 6_000_000, {"inter_node_bytes": 125}),
    "fsdp2_hsdp_bf16": (0.20, 0.0, 0.03, 0, 2_000_000, 1_000_000, None),
    "fsdp2_votes": (0.18, 0.03, 0.06, 130, 300_000, 1_500_000, {"inter_node_bytes": 125}),
}


@pytest.mark.unit
def test_sharded_variants_are_selectable_optional_and_not_in_the_default_run():
    assert set(netns_nodes.SHARDED) == {"fsdp2_hsdp_bf16", "fsdp2_votes", "zero3", "zero3_votes"}
    sharded = set(netns_nodes.SHARDED)
    assert sharded <= set(netns_nodes.VARIANTS) and sharded <= set(netns_nodes.OPTIONAL)
    assert not set(netns_nodes.SHARDED) & set(netns_nodes.DEFAULT_VARIANTS)  # the default run stays short
    p = netns_nodes.build_parser()
    assert p.parse_args([]).variants == list(netns_nodes.DEFAULT_VARIANTS)
    assert p.parse_args(["--variants", *SHARDED_RUN]).variants == list(SHARDED_RUN)
    with pytest.raises(SystemExit):
        p.parse_args(["--variants", "zero2"])


@pytest.mark.unit
def test_ds_configs_of_the_zero3_variants():
    plain, votes = (netns_nodes._ds_config(v, {"batch_size": 2}, 2) for v in ("zero3", "zero3_votes"))
    for cfg in (plain, votes):
        assert cfg["zero_optimization"] == {"stage": 3} and cfg["optimizer"]["type"] == "LionCub"
        assert cfg["train_micro_batch_size_per_gpu"] == 2 and "bf16" not in cfg  # fp32, as the bench's model
    assert "voters" not in plain["optimizer"]["params"]  # one ZeRO-3 group over all ranks: global Lion
    assert votes["optimizer"]["params"]["voters"] == "node" and votes["optimizer"]["params"]["node_size"] == 2


@pytest.mark.unit
def test_summarize_sharded_records():
    recs = netns_nodes.summarize(_raws(SPECS), 1.0, 2, 1)
    by = {r["variant"]: r for r in recs}
    assert [r["variant"] for r in recs] == list(SPECS)
    for v in netns_nodes.SHARDED:
        r = by[v]
        assert r["status"] == "ok" and r["world_size"] == 4 and r["sharding"]
        # the veth and lo counters of both nodes / N
        assert r["inter_node_bytes_per_rank"] == 2 * SPECS[v][4] // 4
        assert r["intra_node_bytes_per_rank"] == 2 * SPECS[v][5] // 4
        # the framework's collectives are not modelled: no formula that would look complete
        assert r["formula_bytes_per_rank"] is None
        # their communication runs in forward+backward: estimated against no_comm's, like DDP's
        comp, comm = SPECS[v][0], SPECS[v][1]
        assert r["compute_time_with_overlapped_comm_s"] == pytest.approx(comp)
        assert r["compute_time_s"] == pytest.approx(SPECS["no_comm"][0])
        assert r["comm_time_s"] == pytest.approx(comm + comp - SPECS["no_comm"][0])
        assert "forward+backward minus no_comm" in r["comm_time_method"]
        assert r["step_vs_no_comm"] == pytest.approx((comp + SPECS[v][2]) / 0.12)
    # votes: LionCub's own bytes (votes + flags) and its inter-node part are kept, named as such
    for v in ("zero3_votes", "fsdp2_votes"):
        assert by[v]["lioncub_bytes_per_rank"] == 130 and by[v]["formula_inter_node_bytes_per_rank"] == 125
    for v in ("zero3", "fsdp2_hsdp_bf16"):
        assert by[v]["lioncub_bytes_per_rank"] is None and by[v]["formula_inter_node_bytes_per_rank"] is None
    assert "disabled" in by["zero3"]["ds_shm_allreduce"] and "ds_shm_allreduce" not in by["fsdp2_votes"]
    # without no_comm there is nothing to estimate the hidden communication against
    no_floor = {v: s for v, s in SPECS.items() if v != "no_comm"}
    for r in netns_nodes.summarize(_raws(no_floor), 1.0, 2, 1):
        assert r["comm_time_s"] is None and r["comm_vs_floor"] is None


@pytest.mark.unit
def test_sharded_goal_met_missed_and_unavailable():
    recs = netns_nodes.summarize(_raws(SPECS), 1.0, 2, 1)
    goals = netns_nodes.check_goal(recs)
    zero3 = [g for g in goals if g.startswith("1 Gbit/s between nodes: zero3_votes")]
    fsdp = [g for g in goals if g.startswith("1 Gbit/s between nodes: fsdp2_votes")]
    # 200,000 vs 4,000,000 per node: 20x, <= 1/10; 300,000 vs 2,000,000: 6.7x, missed
    assert len(zero3) == 1 and "20.0x fewer" in zero3[0] and "goal <= 1/10: OK" in zero3[0]
    assert len(fsdp) == 1 and "6.7x fewer" in fsdp[0] and "goal <= 1/10: MISSED" in fsdp[0]
    # exactly 1/10 meets it
    a = {"variant": "zero3_votes", "inter_node_bytes_per_rank": 100, "step_time_s": 1.0}
    b = {"variant": "zero3", "inter_node_bytes_per_rank": 1000, "step_time_s": 2.0}
    line = netns_nodes.sharded_goal("x:", a, b)
    assert "goal <= 1/10: OK" in line and "2.00x as fast" in line
    assert "MISSED" in netns_nodes.sharded_goal("x:", a, dict(b, inter_node_bytes_per_rank=999))
    # a framework that cannot build a variant: reported unavailable, the goal says why it is not measured
    specs = {v: s for v, s in SPECS.items() if v != "zero3_votes"}
    missing = {"zero3_votes": "ImportError: No module named 'deepspeed'"}
    recs = netns_nodes.summarize(_raws(specs, missing, order=list(SPECS)), 1.0, 2, 1)
    by = {r["variant"]: r for r in recs}
    assert by["zero3_votes"]["status"] == "unavailable" and "deepspeed" in by["zero3_votes"]["reason"]
    assert [r["variant"] for r in recs] == list(SPECS)  # the order asked for
    goals = netns_nodes.check_goal(recs)
    assert any("zero3_votes vs zero3 not measured: zero3_votes unavailable (ImportError" in g for g in goals)
    assert any("fsdp2_votes puts" in g for g in goals)


@pytest.mark.integration
def test_netns_nodes_sharded_tiny_run(tmp_path):
    """The four sharded variants for real (DeepSpeed ZeRO-3 and FSDP2 on 2 namespaces x 2 ranks)."""
    why = _why_not()
    if why:
        pytest.skip(why)
    rc = netns_nodes.main(["--bandwidths", "10", "--steps", "1", "--warmup", "1", "--seq-len", "8", "--n-layer", "1",
                           "--d-model", "32", "--n-head", "2", "--variants", *SHARDED_RUN,
                           "--json", str(tmp_path / "sharded.json")])
    assert rc == 0
    assert not _ours(), "a namespace was left behind"
    by = {r["variant"]: r for r in json.loads((tmp_path / "sharded.json").read_text())}
    assert list(by) == list(SHARDED_RUN)
    quiet = by["no_comm"]["inter_node_bytes_per_rank"]
    for votes, plain in netns_nodes.SHARDED_GOALS:
        if by[votes]["status"] != "ok" or by[plain]["status"] != "ok":  # e.g. no DeepSpeed here
            assert by[votes]["reason"] if by[votes]["status"] != "ok" else by[plain]["reason"]
            continue
        for v in (votes, plain):
            r = by[v]
            assert r["step_time_s"] > 0 and r["intra_node_bytes_per_rank"] > 0
            assert r["inter_node_rx_bytes_per_rank"] == pytest.approx(r["inter_node_bytes_per_rank"], rel=0.05)
        # the plain framework sends gradients (and ZeRO-3 parameters) across; the votes far less
        assert by[plain]["inter_node_bytes_per_rank"] > 4 * quiet
        assert quiet < by[votes]["inter_node_bytes_per_rank"] < by[plain]["inter_node_bytes_per_rank"]
        assert by[votes]["formula_inter_node_bytes_per_rank"] > 0
