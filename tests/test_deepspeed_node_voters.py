"""``"voters": "node"`` under the ``deepspeed`` launcher (issue 24 item 4).

One launch of ``tests/deepspeed_node_script.py`` with ``deepspeed --num_accelerators 4``
(DS_ACCELERATOR=cpu, gloo): 4 ranks as 2 node groups × 2 ranks (``"node_size": 2``), ZeRO
stage 0, fp32 and bf16, ``gradient_clipping`` on. The tests check its per-rank JSON:

* the engine's parameters equal a plain-torch LionCub (voters="node") on the same data, bit for
  bit, on every rank (replicas identical); with bf16 LionCub steps the bf16 parameters itself
  (no DeepSpeed fp16/bf16 wrapper) and holds their fp32 master for its shard only;
* the optimizer state per rank (``lioncub_ds.deepspeed.state_bytes``: LionCub's and DeepSpeed's
  fp32 copies) is about 1/L of today's flat stage 0 (bf16: momentum + DeepSpeed's full fp32 copy);
* no floating-point tensor crosses a node-group boundary (the NCCL-contract log of every
  collective: its group's ranks and dtype), and ``comm_stats`` splits the bytes intra/inter;
* ``save_checkpoint`` writes every rank's shard file and ``load_checkpoint`` into a freshly
  initialised engine resumes bit-exactly;
* without ``node_size`` a group is the launcher's machine (``LOCAL_SIZE``; the deepspeed
  launcher sets no ``LOCAL_WORLD_SIZE``);
* ``"overlap": true`` (fp32): bit-identical to plain LionCub without overlap;
* ZeRO stage 1/2 and fp16 are refused in ``deepspeed.initialize``, naming the setting.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lioncub_ds.testing import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "deepspeed_node_script.py"
WORLD, L = 4, 2
DTYPES = ["fp32", "bf16"]

deepspeed_missing = pytest.mark.skipif(
    __import__("importlib").util.find_spec("deepspeed") is None, reason="deepspeed not installed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from test_deepspeed import _env
    tmp = tmp_path_factory.mktemp("ds_node")
    out = tmp / "out"
    launcher = Path(sys.executable).with_name("deepspeed")
    cmd = [str(launcher) if launcher.exists() else "deepspeed", "--num_accelerators", str(WORLD),
           "--master_port", str(free_port()), str(SCRIPT), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=str(tmp), env=_env(tmp), capture_output=True, text=True, timeout=900)
    files = [out / f"rank{r}.json" for r in range(WORLD)]
    if proc.returncode != 0 or not all(f.exists() for f in files):
        raise AssertionError(f"deepspeed launch failed (rc={proc.returncode}):\n{proc.stdout[-6000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return [json.loads(f.read_text()) for f in files], proc.stdout + proc.stderr


def _node(runs, dtype):
    res, _ = runs
    out = [r[f"node_{dtype}"] for r in res]
    for r, x in enumerate(out):
        assert "exception" not in x, f"rank {r}: {x.get('traceback', x)}"
    return out


@deepspeed_missing
@pytest.mark.parametrize("dtype", DTYPES)
def test_node_voters_train_like_plain_lioncub_with_identical_replicas(runs, dtype):
    res = _node(runs, dtype)
    for r, x in enumerate(res):
        assert x["digest"] == res[0]["digest"], f"rank {r}: replicas differ"
        assert x["digest"] == x["reference_digest"], f"rank {r}: differs from plain LionCub voters='node'"
        assert x["step_count"] == 6
        want = "torch.float32" if dtype == "fp32" else "torch.bfloat16"
        # LionCub steps the model's own parameters: no DeepSpeed wrapper (and no full fp32 copy) for bf16
        assert x["param_dtypes"] == x["stepped_dtypes"] == [want] and x["wrapper"] == "LionCub", x
        assert "node voters" in x["summary"] and "N=4 (2 node groups x 2 ranks)" in x["summary"], x["summary"]
        assert ("fp32 master" in x["summary"]) == (dtype == "bf16")
    assert len({x["grad_norm"] for x in res}) == WORLD  # each rank clipped by its own local norm


@deepspeed_missing
def test_node_voters_with_overlap_train_like_plain_lioncub(runs):
    """"overlap": true (fp32, gradient clipping on): bit-identical to plain LionCub without overlap."""
    res, _ = runs
    out = [r["node_overlap_fp32"] for r in res]
    for r, x in enumerate(out):
        assert "exception" not in x, f"rank {r}: {x.get('traceback', x)}"
        assert x["digest"] == x["reference"], r
        assert x["digest"] == out[0]["digest"], r
        assert "overlap=on" in x["summary"], x["summary"]


@deepspeed_missing
@pytest.mark.parametrize("dtype", DTYPES)
def test_state_bytes_per_rank_are_about_one_over_L(runs, dtype):
    for x in _node(runs, dtype):
        node, flat = x["state_bytes"], x["flat_state_bytes"]
        shard = 4 * sum(x["shard_numels"])  # fp32 momentum shards: 1/L of every (padded) bucket
        assert sum(x["shard_numels"]) * L >= node["params"] and node["momentum"] == shard
        assert node["master"] == (shard if dtype == "bf16" else 0) and node["deepspeed_master"] == 0
        # today: full fp32 momentum, plus DeepSpeed's full fp32 copy of bf16 parameters
        assert flat["momentum"] == 4 * flat["params"]
        assert flat["deepspeed_master"] == (4 * flat["params"] if dtype == "bf16" else 0)
        state = node["total"] - node["workspace"]
        assert state <= flat["total"] / L * 1.05, (node, flat)
        # the step buffers kept between steps (docs/deepspeed.md): send + receive + all-gather of
        # whole buckets in the parameters' dtype, the fp32 mean-gradient shard, fp32's work shard
        elt, full = (4 if dtype == "fp32" else 2), L * sum(x["shard_numels"])
        assert node["workspace"] == 3 * elt * full + shard + (shard if dtype == "fp32" else 0), node
        assert flat["workspace"] == 0


@deepspeed_missing
@pytest.mark.parametrize("dtype", DTYPES)
def test_no_float_tensor_crosses_a_node_group(runs, dtype):
    res = _node(runs, dtype)
    logs = [x["calls_raw"] for x in res]
    assert all(log == logs[0] or len(log) == len(logs[0]) for log in logs)
    inside = 0
    for r, x in enumerate(res):
        for name, ranks, dtype_s, shape in x["calls_raw"]:
            groups = {q // L for q in (ranks if ranks else range(WORLD))}
            if len(groups) > 1:
                assert dtype_s in ("torch.uint8", "torch.int8", "torch.int32", "torch.int64"), (r, name, dtype_s)
            elif dtype_s and "float" in dtype_s:
                inside += 1
        scopes = x["by_scope"]
        assert set(scopes) == {"intra_node", "inter_node"} and 0 < scopes["inter_node"] < scopes["intra_node"]
    assert inside > 0  # positive control: the gradients are reduce-scattered inside the group


@deepspeed_missing
@pytest.mark.parametrize("dtype", DTYPES)
def test_checkpoint_has_every_rank_shard_and_resume_is_exact(runs, dtype):
    for r, x in enumerate(_node(runs, dtype)):
        assert x["files"] == [f"lioncub-rank{q:05d}-of-{WORLD:05d}.pt" for q in range(WORLD)]
        assert x["resume_path"] is not None
        assert x["resumed_digest"] == x["digest"], f"rank {r}: resume differs"
        assert x["resumed_losses"] == x["losses"][3:]
        # another layout (1 group x 4 ranks): engine.load_checkpoint reshards the files, as the
        # plain-torch load does (the mean of the 2 groups' momenta, the fp32 masters exactly)
        e = x["resharded"]
        assert e["same_state"] and e["stepped_equal"] and e["step"] == 3 and e["layout"] == [1, 4], e
        assert bool(e["masters"]) == (dtype == "bf16"), e
        # node voters -> flat voting through the engine
        f = x["to_flat"]
        assert f["error"] is None and f["weights"] and f["momenta"], f
        if dtype == "fp32":  # bf16: the flat engine's wrapper keeps its own fp32 masters (from the weights)
            assert f["stepped_equal"], f
    assert len({x["to_flat"]["digest"] for x in _node(runs, dtype)}) == 1  # replicas identical


@deepspeed_missing
def test_node_size_defaults_to_the_launchers_local_size(runs):
    res, _ = runs
    for x in res:
        assert x["LOCAL_SIZE"] == "4" and x["LOCAL_WORLD_SIZE"] is None
        d = x["default_node_size"]
        assert "exception" not in d, d
        assert d["node_size"] == 4 and d["groups"] == 1, d


@deepspeed_missing
def test_shipped_node_voters_config_trains(runs):
    res, _ = runs
    x = [r["shipped_config"] for r in res]
    assert all("exception" not in r for r in x), x
    assert {r["digest"] for r in x} == {x[0]["digest"]} and all(r["step_count"] == 3 for r in x)
    assert "node voters" in x[0]["summary"] and "fp32 master" in x[0]["summary"], x[0]["summary"]


@deepspeed_missing
@pytest.mark.parametrize("name,needles", [
    ("err_zero1", ("voters='node'", "zero_optimization.stage=1", "Allowed: voters='node' with zero_optimization.stage=0")),
    ("err_zero2_client", ("voters='node'", "zero_optimization.stage=2", "voters='rank'")),
    ("err_fp16", ("voters='node'", "fp16.enabled=true", "bf16.enabled=true or fp32")),
    ("err_master_only_zero1", ("node_size=2 with voters='rank' (master-only sharding)", "zero_optimization.stage=1",
                               "zero_optimization.stage=0")),
    ("err_master_only_fp16", ("node_size=2 with voters='rank'", "fp16.enabled=true", "bf16.enabled=true or fp32")),
])
def test_unsupported_node_voter_configs_are_refused(runs, name, needles):
    res, _ = runs
    for x in res:
        e = x[name]
        assert e["error_type"] == "LionCubDeepSpeedError", e
        for needle in needles:
            assert needle in e["error"], (needle, e["error"])


@deepspeed_missing
def test_node_size_one_is_flat_voting_with_deepspeeds_bf16_wrapper(runs):
    """``voters: "node"`` with ``node_size: 1`` at stage 0 in bf16: the resolved strategy is flat (4
    voters), so DeepSpeed wraps LionCub as it wraps a flat one (fp32 master copies) and the run is
    the flat run, bit for bit, on every rank."""
    res, _ = runs
    out = [r["node_size_one_bf16"] for r in res]
    for r, x in enumerate(out):
        assert "exception" not in x, f"rank {r}: {x.get('traceback', x)}"
        assert (x["mode"], x["voters"], x["node_size"]) == ("flat", WORLD, 1), x
        assert x["wrapper"] == x["flat_wrapper"] != "LionCub", x
        assert x["digest"] == x["flat_digest"] == out[0]["digest"], r
        assert "node voters" not in x["summary"], x["summary"]


@deepspeed_missing
def test_master_only_sharding_trains_like_plain_lioncub_and_resumes(runs):
    """bf16 with ``"voters": "rank", "node_size": 2``: the engine equals plain-torch LionCub with the
    same settings bit for bit (which equals flat voting on fp32 masters: tests/test_node_voters.py),
    LionCub steps the bf16 parameters with the fp32 master of its shard only (no DeepSpeed wrapper,
    no full fp32 copy), votes stay flat (no intra-node gradient traffic), and resume is exact."""
    res, _ = runs
    out = [r["master_only_bf16"] for r in res]
    for r, x in enumerate(out):
        assert "exception" not in x, f"rank {r}: {x.get('traceback', x)}"
        assert x["digest"] == out[0]["digest"] and x["digest"] == x["reference_digest"], r
        assert x["wrapper"] == "LionCub" and "fp32 master sharded 1/L" in x["summary"], x["summary"]
        node, flat = x["state_bytes"], x["flat_state_bytes"]
        assert node["momentum"] == flat["momentum"] == 4 * flat["params"]  # every rank keeps its full momentum
        assert node["master"] == 4 * sum(x["master_numels"]) and node["deepspeed_master"] == 0
        assert sum(x["master_numels"]) * 2 >= flat["params"] and node["master"] <= flat["deepspeed_master"] / 2 * 1.1
        assert flat["deepspeed_master"] == 4 * flat["params"]
        assert x["resume_path"] is not None and x["resumed_digest"] == x["digest"], r
        assert x["resumed_losses"] == x["losses"][3:]
