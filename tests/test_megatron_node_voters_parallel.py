"""Node voters under Megatron with model parallelism, experts and fp16 (issue 31 item 3).

The same brute-force oracle as tests/test_megatron_node_voters.py (K voters, voter j with the
mean gradient of instance j and its own momentum, the literal Lion vote), on gloo ranks with the
test shim:

* 4 ranks: MoE expert parameters (EP = 2: each expert's shard votes over the expert
  data-parallel group's instances; EP = 1: Megatron keeps the replicated experts with the dense
  parameters);
  fp16 with Megatron's loss scale (gradients unscaled by it, fp32 main shards), and an inf on one
  rank that makes every rank skip the step;
* 8 ranks: TP = 2 and PP = 2 with K = 2 instances of L = 2 data-parallel ranks each.

After every step every parameter equals the oracle bit for bit, and every momentum shard its
voter's oracle momentum; replicas (the ranks at one model-parallel position) stay identical.
"""
from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from dist_helpers import run_ranks
from test_megatron_node_voters import _init, _nan_run, _oracle_run

pytestmark = pytest.mark.integration

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed")
SCALE = 1024.0  # a power of two: unscaling is exact, so the oracle's instance mean is the run's


def _position():
    """This rank's model-parallel position (replicas share it) and data-parallel rank."""
    from megatron.core import parallel_state as ps
    return {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
            "ep": ps.get_expert_model_parallel_rank(), "dp": ps.get_data_parallel_rank()}


def _four(rank, world):
    from lioncub_ds.testing import megatron_cpu_shim
    megatron_cpu_shim.install()
    warnings.filterwarnings("ignore")
    out = {"rank": rank}
    _init(2, ep=2)
    out["moe_ep2"] = dict(_oracle_run(2, steps=3, experts=4, extra={"tie_break": "hash"}), **_position())
    _init(2)
    out["moe_ep1"] = dict(_oracle_run(2, steps=2, experts=2), **_position())
    out["fp16"] = dict(_oracle_run(2, steps=3, dtype=torch.float16, scale=SCALE), **_position())
    # an inf on one rank: Megatron's scaler finds it there only; the one agreed all-reduce of
    # "found inf" makes every rank skip the step (parameters and momenta unchanged)
    out["fp16_overflow"] = _nan_run(2, dtype=torch.float16, bad=float("inf"), scale=SCALE)
    return out


def _eight(rank, world):
    from lioncub_ds.testing import megatron_cpu_shim
    megatron_cpu_shim.install()
    warnings.filterwarnings("ignore")
    out = {"rank": rank}
    _init(2, tp=2)
    out["tp2"] = dict(_oracle_run(2, steps=2, extra={"tie_break": "hash"}), **_position())
    _init(2, pp=2)
    out["pp2"] = dict(_oracle_run(2, steps=2), **_position())
    return out


@pytest.fixture(scope="module")
def four():
    if not HAVE_MEGATRON:
        pytest.skip("megatron-core is not installed")
    return run_ranks(_four, 4, timeout=600)


@pytest.fixture(scope="module")
def eight():
    if not HAVE_MEGATRON:
        pytest.skip("megatron-core is not installed")
    return run_ranks(_eight, 8, timeout=900)


def _check(results, case, kinds):
    replicas = {}
    for r in results:
        o = r[case]
        assert o["kinds"] == kinds, (r["rank"], case, o["kinds"])
        assert o["mismatched"] == 0 and o["moved"] > 0, (r["rank"], case, o["mismatched"], o["moved"])
        assert o["momentum_mismatched"] == 0, (r["rank"], case, o["momentum_mismatched"])
        replicas.setdefault((o["tp"], o["pp"], o["ep"]), []).append(o["fps"])
    for where, fps in replicas.items():  # the data-parallel replicas of each model-parallel position
        assert len(fps) > 1 and all(f == fps[0] for f in fps), (case, where)


@needs_megatron
def test_expert_parameters_vote_over_the_expert_data_parallel_instances(four):
    _check(four, "moe_ep2", ["dense", "expert"])
    # EP = 1: Megatron treats the (replicated) experts as dense parameters: one optimizer
    _check(four, "moe_ep1", ["dense"])


@needs_megatron
def test_fp16_with_megatrons_loss_scale_matches_the_oracle(four):
    _check(four, "fp16", ["dense"])


@needs_megatron
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(four):
    for r in four:
        x = r["fp16_overflow"]
        assert x["ok"] is False and x["unchanged"] and x["trained_after"] and x["skipped"] == 0, (r["rank"], x)
        assert x["fp"] == four[0]["fp16_overflow"]["fp"], r["rank"]


@needs_megatron
@pytest.mark.parametrize("case", ["tp2", "pp2"])
def test_tensor_and_pipeline_parallel_node_voters_match_the_oracle(eight, case):
    _check(eight, case, ["dense"])
