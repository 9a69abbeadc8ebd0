"""Node voters under Megatron with model parallelism, experts and fp16 (issue 31 item 3).

The same brute-force oracle as tests/test_megatron_node_voters.py (K voters, voter j with the
mean gradient of instance j and its own momentum, the literal Lion vote), on gloo ranks with the
test shim:

* 4 ranks: MoE expert parameters (EP = 2: each expert's shard votes over the expert
  data-parallel group's instances; EP = 1: Megatron keeps the replicated experts with the dense
  parameters);
  fp16 with Megatron's loss scale (gradients unscaled by it, fp32 main shards), and an inf on one
  rank that makes every rank skip the step;
* 8 ranks: TP = 2 and PP = 2 with K = 2 instances of L = 2 data-parallel ranks each; PP = 2
  with a virtual pipeline of 2 chunks and --overlap-param-gather-with-optimizer-step (fp32, bf16);
  the same split at TP = 2 with an expert tensor-parallel size of 1 (its gradient norm, Megatron's
  checkpoint calls on the chain).

After every step every parameter equals the oracle bit for bit, and every momentum shard its
voter's oracle momentum; replicas (the ranks at one model-parallel position) stay identical.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
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


def _with_step_resume(ckpt):
    """--overlap-param-gather-with-optimizer-step: each of the two dense optimizers writes and reads
    its own per-rank files (a resume is exact); a run without the flag refuses them, naming it,
    before anything is loaded."""
    import torch.distributed as dist
    from lioncub_ds.checkpoint import CheckpointError
    from lioncub_ds.megatron import after_checkpoint_load, get_megatron_lioncub_optimizer, lioncub_optimizers
    from test_megatron_node_voters import _build, _chunks, _opt_config, _train_then_write_files

    def make(with_step):
        _, ddp = _build(2, overlap=True, param_gather=True)
        config = _opt_config(overlap_param_gather=True, overlap_param_gather_with_optimizer_step=with_step)
        return ddp, get_megatron_lioncub_optimizer(config, _chunks(ddp), lioncub={"voters": "node"})

    def momenta(opt):
        return {lc.megatron_kind: [lc.state[p]["exp_avg"].clone() for g in lc.param_groups for p in g["params"]
                                   if "exp_avg" in lc.state.get(p, {})] for lc in lioncub_optimizers(opt)}

    ddp, opt = make(True)
    _train_then_write_files(ddp, opt, 2, ckpt)
    dist.barrier()
    out = {"saved": sorted(os.listdir(os.path.join(ckpt, "lioncub")))}
    want = momenta(opt)
    _, back = make(True)
    after_checkpoint_load(back, ckpt)
    got = momenta(back)
    out["resumed_exact"] = want.keys() == got.keys() and all(
        len(want[k]) == len(got[k]) > 0 and all(torch.equal(a, b) for a, b in zip(want[k], got[k])) for k in want)
    _, other = make(False)
    try:
        after_checkpoint_load(other, ckpt)
        out["refused"] = None
    except CheckpointError as exc:
        out["refused"] = str(exc)
    out["untouched"] = all(not v for v in momenta(other).values())
    return out


def _eight(rank, world, tmpdir):
    from lioncub_ds.testing import megatron_cpu_shim
    megatron_cpu_shim.install()
    warnings.filterwarnings("ignore")
    out = {"rank": rank}
    _init(2, tp=2)
    out["tp2"] = dict(_oracle_run(2, steps=2, extra={"tie_break": "hash"}), **_position())
    _init(2, pp=2)
    out["pp2"] = dict(_oracle_run(2, steps=2), **_position())
    # a virtual pipeline (2 chunks per stage) with --overlap-param-gather-with-optimizer-step
    _init(2, pp=2, vp=2)
    for dtype in (torch.float32, torch.bfloat16):
        out[f"vp2_with_step_{str(dtype)[6:]}"] = dict(
            _oracle_run(2, steps=2, overlap=True, param_gather=True, with_step=True, dtype=dtype), **_position())
    out["vp2_with_step_resume"] = _with_step_resume(os.path.join(tmpdir, "vp2"))
    return out


def _split_tp2_etp1(rank, world, tmpdir):
    """TP = 2 with an expert tensor-parallel size of 1, PP = 2 x 2 virtual chunks: one step with
    and without the first chunk's optimizer apart (Megatron's gradient norm, for clipping and the
    log); then Megatron-LM's legacy checkpoint call (--ckpt-format torch) for the distributed
    optimizer's parameter-state file, on the ChainedOptimizer of the split."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from lioncub_ds.megatron import get_megatron_lioncub_optimizer
    from lioncub_ds.testing import megatron_cpu_shim
    from test_megatron_node_voters import _batch, _build, _chunks, _forward, _fwd_bwd, _opt_config
    megatron_cpu_shim.install()
    warnings.filterwarnings("ignore")
    _init(2, tp=2, pp=2, vp=2, etp=1)
    out, opts = {}, {}
    for with_step in (False, True):
        _, ddp = _build(2, overlap=True, param_gather=True)
        config = _opt_config(overlap_param_gather=True, overlap_param_gather_with_optimizer_step=with_step)
        opt = opts[with_step] = get_megatron_lioncub_optimizer(config, _chunks(ddp), lioncub={"voters": "node"})
        ddp.zero_grad_buffer()
        opt.zero_grad()
        _fwd_bwd(ddp, _batch(0))
        ok, norm, _ = opt.step()
        _forward(ddp)  # the first chunk's all-gather (started in step) completes
        out[with_step] = {"ok": ok, "norm": norm, "kinds": [o.optimizer.megatron_kind for o in opt.chained_optimizers]}
    # one file per model-parallel position, as Megatron-LM names it
    path = os.path.join(tmpdir, f"distrib_optim_tp{ps.get_tensor_model_parallel_rank()}"
                                f"_pp{ps.get_pipeline_model_parallel_rank()}.pt")
    try:
        opt.save_parameter_state(path)
        dist.barrier()
        opt.load_parameter_state(path)
        out["parameter_state"] = torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["parameter_state"] = f"{type(exc).__name__}: {exc}"
    # Megatron's optimizer checkpoint (the common state) of one split loaded into the other: as
    # state_dict() writes it (--ckpt-format torch: a list with the split), and as torch_dist's
    # sharded_state_dict keys it (one entry per optimizer under 0, 1, ...)
    for saved, into in ((True, False), (False, True), (True, True)):
        for form in ("list", "keyed"):
            sd = opts[saved].state_dict()
            if form == "keyed":
                sd = dict(enumerate(sd)) if isinstance(sd, list) else {0: sd}
            try:
                opts[into].load_state_dict(sd)
                out[f"load_{saved}_into_{into}_{form}"] = None
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out[f"load_{saved}_into_{into}_{form}"] = f"{type(exc).__name__}: {exc}"
    return out


def _eight_ranks_with_tmpdir(fn, prefix):
    """fn on 8 ranks with a scratch directory (removed afterwards)."""
    if not HAVE_MEGATRON:
        pytest.skip("megatron-core is not installed")
    tmpdir = tempfile.mkdtemp(prefix=prefix)
    try:
        yield run_ranks(fn, 8, tmpdir, timeout=900)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.fixture(scope="module")
def split_tp2_etp1():
    yield from _eight_ranks_with_tmpdir(_split_tp2_etp1, "lioncub-megatron-split-")


@pytest.fixture(scope="module")
def four():
    if not HAVE_MEGATRON:
        pytest.skip("megatron-core is not installed")
    return run_ranks(_four, 4, timeout=600)


@pytest.fixture(scope="module")
def eight():
    yield from _eight_ranks_with_tmpdir(_eight, "lioncub-megatron-vp-")


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
@pytest.mark.parametrize("case", ["vp2_with_step_float32", "vp2_with_step_bfloat16"])
def test_param_gather_overlapped_with_the_optimizer_step_matches_the_oracle(eight, case):
    """--overlap-param-gather-with-optimizer-step (PP = 2, 2 virtual chunks per stage): the first
    chunk's dense parameters have an optimizer of their own, stepped first; Megatron starts that
    chunk's all-gather when it returns, and the other chunk's optimizer steps (and votes) while it
    runs. Both equal the oracle, which knows nothing of the split."""
    _check(eight, case, ["dense_chunk0", "dense_later_chunks"])
    for r in eight:
        o = r[case]
        assert o["chunks_by_kind"] == {"dense_chunk0": ["chunk0"], "dense_later_chunks": ["chunk1"]}, o
        assert o["starts_with_step"] == [True, False], o
        # when step() returns, the first chunk's all-gather has started, the other waits for its forward
        assert o["dispatched_in_step"] == [True, False], o


@needs_megatron
def test_param_gather_overlapped_with_the_optimizer_step_resumes_and_refuses_the_other_split(eight):
    for r in eight:
        x = r["vp2_with_step_resume"]
        assert x["saved"] == ["dense_chunk0", "dense_later_chunks"], x
        assert x["resumed_exact"], x
        assert x["refused"] and "--overlap-param-gather-with-optimizer-step" in x["refused"] and \
            "--no-load-optim" in x["refused"], x
        assert x["untouched"], x


@needs_megatron
def test_split_optimizers_count_tensor_parallel_replicas_once_in_the_grad_norm(split_tp2_etp1):
    """The first chunk's optimizer and the later chunks' are dense: their gradient norm (clipping,
    the logged grad norm) counts a tensor-parallel replica (a layer norm, a row-parallel bias) once,
    through the tensor-parallel group, not the expert tensor-parallel group (here of size 1, so
    every TP rank would count it): the norm equals the one optimizer's without the split."""
    for r in split_tp2_etp1:
        whole, split = r[False], r[True]
        assert whole["ok"] and split["ok"], r
        assert whole["kinds"] == ["dense"] and split["kinds"] == ["dense_chunk0", "dense_later_chunks"], r
        assert whole["norm"] > 0 and split["norm"] == pytest.approx(whole["norm"], rel=1e-5), r


@needs_megatron
def test_split_optimizers_save_and_load_megatrons_parameter_state_file(split_tp2_etp1):
    """Megatron-LM's --ckpt-format torch saves and loads the distributed optimizers' parameter
    state through the ChainedOptimizer: with two of them its own code gathers Adam's state (which
    LionCub's have not); the file says where the state is (the per-rank files) and loads."""
    for r in split_tp2_etp1:
        assert r["parameter_state"] == {"lioncub_node_voters": True,
                                        "state": "in the LionCub per-rank files (lioncub/)"}, r


@needs_megatron
def test_megatrons_optimizer_checkpoint_of_the_other_split_is_refused_naming_the_flag(split_tp2_etp1):
    """Megatron's optimizer state_dict of the split (one entry per optimizer, as a list or keyed
    0, 1 as torch_dist keeps it) loaded without it, and the one optimizer's loaded with it: refused,
    naming the flag, both ways (its ChainedOptimizer would otherwise hand the entries to the wrong
    optimizers); the same split loads."""
    split, whole = "(dense_chunk0, dense_later_chunks)", "(dense)"
    for r in split_tp2_etp1:
        for form in ("list", "keyed"):
            for key, kinds in ((f"load_True_into_False_{form}", f"saved with the first model chunk's dense optimizer "
                                                                f"apart {split}, this run has one dense optimizer for "
                                                                f"every model chunk {whole}"),
                               (f"load_False_into_True_{form}", f"saved with one dense optimizer for every model "
                                                                f"chunk {whole}, this run has the first model "
                                                                f"chunk's dense optimizer apart {split}")):
                msg = r[key]
                assert msg and msg.startswith("LionCubConfigError") and kinds in msg, (key, msg)
                assert "--overlap-param-gather-with-optimizer-step" in msg and "--no-load-optim" in msg, (key, msg)
            assert r[f"load_True_into_True_{form}"] is None, r


@needs_megatron
@pytest.mark.parametrize("case", ["tp2", "pp2"])
def test_tensor_and_pipeline_parallel_node_voters_match_the_oracle(eight, case):
    _check(eight, case, ["dense"])
