"""``bench netns_nodes`` on a tiny model: two namespaces (nodes) joined by a shaped veth pair."""
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
    assert [r["variant"] for r in recs] == list(netns_nodes.VARIANTS)
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
