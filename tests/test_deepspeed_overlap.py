"""``"overlap": true`` through real DeepSpeed engines (DS_ACCELERATOR=cpu, 2 gloo ranks, one launch).

Stage 0 (Lion Cub votes), fp32, with gradient accumulation: only the backward of the
accumulation-boundary micro-batch starts votes (the engine's own boundary, and
``engine.no_sync()``), one vote per optimizer step, bit-identical to overlap off, replicas
identical, resume bit-identical. Gradient clipping that changes the gradients after the votes
started makes the step vote again (counted). ZeRO 1/2 and stage-0 fp16/bf16 refuse
``overlap: true`` in ``deepspeed.initialize`` before LionCub exists (or is touched).

Every collective is recorded by the NCCL-contract wrapper (the spawner installs it), so the
test sees which collectives each micro-batch's backward and each ``engine.step()`` issued.
"""
from __future__ import annotations

import importlib.util
import logging
import os

import pytest

pytestmark = pytest.mark.integration

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
STEPS, SAVE_AT = 4, 2


def _model(seed=0):
    import torch
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(rank, step, micro):
    import torch
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro + 1)
    x = torch.randn(8, 16, generator=g)
    y = x @ (torch.randn(16, 4, generator=torch.Generator().manual_seed(7)) / 4)
    return x, y


def _cfg(stage=0, gas=3, clip=0.0, **params):
    return {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": gas, "steps_per_print": 10 ** 6,
            "gradient_clipping": clip, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "LionCub", "params": {"lr": 3e-3, "betas": [0.9, 0.99], "weight_decay": 0.1,
                                                        **params}}}


def _initialize(cfg, seed=0, optimizer=None):
    import deepspeed
    import lioncub_ds.deepspeed  # noqa: F401  (registers)
    model = _model(seed)
    kw = {"optimizer": optimizer} if optimizer is not None else {}
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, **kw)[0]


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _calls(since):
    """Collectives issued since log position ``since`` (group creations left out)."""
    from lioncub_ds.testing import nccl_contract
    return [f"{e[0]}:{e[2]}" for e in nccl_contract.log()[since:] if e[0] not in ("new_group", "new_subgroups")]


def _train(engine, rank, steps, start=0, no_sync_first=False, nan_at=None):
    """``steps`` optimizer steps; per step the collectives of each backward and of each engine.step().

    ``no_sync_first``: gradient_accumulation_steps=1 and the user accumulates one extra
    micro-batch inside ``engine.no_sync()`` before the step's last one. With
    ``managed_gradient_accumulation: false`` the loop calls backward for every micro-batch,
    then ``step()`` once (the caller owns the boundary)."""
    from lioncub_ds.testing import nccl_contract
    gas = engine.gradient_accumulation_steps()
    managed = engine.managed_gradient_accumulation()
    trace = []
    for s in range(start, start + steps):
        rec = {"backward": [], "step": []}
        if no_sync_first:
            x, y = _batch(rank, s, 9)
            mark = len(nccl_contract.log())
            with engine.no_sync():
                engine.backward(((engine(x) - y) ** 2).mean())
            rec["backward"].append(_calls(mark))
        for micro in range(gas):
            x, y = _batch(rank, s, micro)
            mark = len(nccl_contract.log())
            loss = ((engine(x) - y) ** 2).mean()
            if nan_at == (s, rank) and micro == gas - 1:
                loss = loss * float("nan")  # this rank's boundary gradients are NaN when its votes start
            engine.backward(loss)
            rec["backward"].append(_calls(mark))
            if managed:
                mark = len(nccl_contract.log())
                engine.step()
                rec["step"].append(_calls(mark))
        if not managed:
            mark = len(nccl_contract.log())
            engine.step()
            rec["step"].append(_calls(mark))
        trace.append(rec)
    return trace


def _state(engine):
    import torch
    opt = engine.basic_optimizer
    return {"params": torch.cat([p.detach().reshape(-1).clone() for p in engine.module.parameters()]),
            "momenta": torch.cat([opt.state[p]["exp_avg"].reshape(-1).clone() for p in engine.module.parameters()]),
            "step_count": opt.step_count, "overlap": dict(opt.comm_stats()["overlap"]),
            "spare_momenta": len(opt.momenta.spares),
            "summary": engine.lioncub.summary()}


def _run(cfg, rank, ckpt, no_sync_first=False, nan_at=None):
    """Train STEPS steps with a checkpoint at SAVE_AT; resume a fresh engine from it."""
    engine = _initialize(cfg)
    trace = _train(engine, rank, SAVE_AT, no_sync_first=no_sync_first, nan_at=nan_at)
    out = {}
    if ckpt is not None:
        engine.save_checkpoint(ckpt, tag="mid")
    trace += _train(engine, rank, STEPS - SAVE_AT, start=SAVE_AT, no_sync_first=no_sync_first, nan_at=nan_at)
    out.update(_state(engine), trace=trace, skipped_steps=int(engine.skipped_steps))
    if ckpt is not None:
        engine2 = _initialize(cfg, seed=123)  # another init: everything must come from the checkpoint
        path, _ = engine2.load_checkpoint(ckpt, tag="mid")
        assert path is not None
        out["resume_trace"] = _train(engine2, rank, STEPS - SAVE_AT, start=SAVE_AT, no_sync_first=no_sync_first)
        out["resumed"] = _state(engine2)
    return out


def _expect_refusal(cfg, optimizer=None):
    """deepspeed.initialize must raise before LionCub's constructor runs (ds_config) or before the
    client LionCub is touched; the model's parameters are untouched."""
    import torch
    from dist_helpers import recording_optimizer_inits
    model = _model(0)
    before = [p.detach().clone() for p in model.parameters()]
    dist_before = optimizer.topology if optimizer is not None else None
    with recording_optimizer_inits() as inits:
        try:
            import deepspeed
            kw = {"optimizer": optimizer} if optimizer is not None else {}
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, **kw)
            err = (None, None)
        except Exception as exc:  # noqa: BLE001
            err = (type(exc).__name__, str(exc))
    out = {"error_type": err[0], "error": err[1], "optimizer_inits": inits,
           # (DeepSpeed itself casts the module to bf16 before it configures the optimizer)
           "params_untouched": all(torch.equal(a.to(b.dtype), b.detach()) for a, b in zip(before, model.parameters()))}
    if optimizer is not None:
        # still voting over the world (ZeRO would have given it a one-rank group), no layout, no hooks
        out["client_untouched"] = (optimizer.topology is dist_before and optimizer.world_size == 2
                                   and optimizer._plan is None)
    return out


def _overlap_rank(rank, world_size, tmp):
    os.environ.update({"LOCAL_RANK": str(rank)})
    import torch
    import lioncub_ds
    import lioncub_ds.deepspeed  # noqa: F401
    torch.set_num_threads(1)
    caught = _Warnings()
    logging.getLogger("lioncub_ds").addHandler(caught)
    from deepspeed.utils import logger as ds_logger
    ds_caught = _Warnings()
    ds_logger.addHandler(ds_caught)
    out = {}
    # several parameter buckets and communication batches, so batches launch one by one in backward
    small = {"bucket_size_mb": 0.0005, "comm_bucket_mb": 0.00002}
    for comm in ("1bit", "pbit"):
        for overlap in (False, True):
            out[(comm, overlap)] = _run(_cfg(comm=comm, overlap=overlap, **small), rank,
                                        os.path.join(tmp, f"{comm}-{overlap}"))
    out["revote_warnings_accum"] = [m for m in caught.messages if "voting again" in m]
    # gradient_accumulation_steps=1, the user accumulates with engine.no_sync()
    for overlap in (False, True):
        out[("no_sync", overlap)] = _run(_cfg(gas=1, comm="1bit", overlap=overlap, **small), rank, None,
                                         no_sync_first=True)
    out["revote_warnings_no_sync"] = [m for m in caught.messages if "voting again" in m]
    # a NaN on rank 1 at step 2's boundary micro-batch: every rank skips that step, with or without overlap
    for overlap in (False, True):
        out[("nan", overlap)] = _run(_cfg(comm="1bit", overlap=overlap, **small), rank, None, nan_at=(2, 1))
    out["revote_warnings_nan"] = [m for m in caught.messages if "voting again" in m]
    # "momentum_double_buffer": true in the ds_config: a checkpoint/resume run and a NaN-skip run
    out[("1bit", "double")] = _run(_cfg(comm="1bit", momentum_double_buffer=True, **small), rank,
                                   os.path.join(tmp, "1bit-double"))
    out[("nan", "double")] = _run(_cfg(comm="1bit", momentum_double_buffer=True, **small), rank, None,
                                  nan_at=(2, 1))
    # unmanaged accumulation: the caller's step() is the boundary, so the votes start there
    for overlap in (False, True):
        out[("unmanaged", overlap)] = _run(dict(_cfg(comm="pbit", overlap=overlap),
                                                managed_gradient_accumulation=False), rank, None)
    # gradient clipping that always clips: the votes started in backward are redone after clipping
    for overlap in (False, True):
        out[("clip", overlap)] = _run(_cfg(gas=2, clip=1e-4, comm="1bit", overlap=overlap), rank, None)
    out["revote_warnings_clip"] = [m for m in caught.messages if "voting again" in m]
    out["clip_notes"] = [m for m in ds_caught.messages if "overlap=true with gradient_clipping" in m]
    # refusals, before any state exists
    out["zero1"] = _expect_refusal(_cfg(stage=1, overlap=True))
    out["zero2"] = _expect_refusal(_cfg(stage=2, overlap=True))
    out["bf16"] = _expect_refusal(dict(_cfg(overlap=True), bf16={"enabled": True}))
    model = _model(0)
    client = lioncub_ds.LionCub(model.parameters(), lr=1e-3, overlap=True)
    cfg = _cfg(stage=1)
    del cfg["optimizer"]
    out["zero1_client"] = _expect_refusal(cfg, optimizer=client)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed not installed")
    from dist_helpers import run_ranks
    tmp = str(tmp_path_factory.mktemp("ds_overlap"))
    return run_ranks(_overlap_rank, 2, tmp, env=ENV, timeout=900)


def _vote_calls(trace_step):
    """Collectives of one optimizer step: every backward's and every engine.step()'s, in order."""
    return [c for part in trace_step["backward"] + trace_step["step"] for c in part]


@needs_deepspeed
@pytest.mark.parametrize("comm", ["1bit", "pbit"])
def test_accumulation_overlap_is_bit_identical_and_votes_once_per_step(results, comm):
    import torch
    for r, res in enumerate(results):
        off, on = res[(comm, False)], res[(comm, True)]
        assert torch.equal(on["params"], off["params"]) and torch.equal(on["momenta"], off["momenta"]), r
        assert torch.equal(on["params"], results[0][(comm, True)]["params"]), "replicas differ across ranks"
        assert on["step_count"] == off["step_count"] == STEPS
        assert "overlap=on" in on["summary"] and "overlap" not in off["summary"]
        for s, (a, b) in enumerate(zip(off["trace"], on["trace"])):
            # the same vote collectives per optimizer step, whoever issued them; the flags have their
            # own all-reduce with overlap, and without it too unless they ride in the vote (1bit)
            flags = lambda calls: [c for c in calls if c.startswith("all_reduce:torch.int32")]  # noqa: E731
            votes = lambda calls: sorted(c for c in calls if c not in flags(calls))  # noqa: E731
            assert votes(_vote_calls(a)) == votes(_vote_calls(b)), (r, s)
            assert len(flags(_vote_calls(b))) == 1, (r, s, b)
            assert len(flags(_vote_calls(a))) == (0 if comm == "1bit" else 1), (r, s, a)
            # non-boundary micro-batches never communicate, with or without overlap
            assert b["backward"][:-1] == [[], []] and a["backward"] == [[], [], []], (r, s, b)
            assert b["step"][:-1] == [[], []], (r, s, b)
            if s == 0:  # the hooks exist from the first step on: its votes start in step()
                assert b["backward"][-1] == [], (r, b)
            else:  # the boundary micro-batch's backward launched the votes; step() only finishes them
                assert b["backward"][-1], (r, s, b)
                assert not any(c.startswith("all_reduce:torch.int32") for c in b["backward"][-1])
        # every communication batch of steps 2..STEPS launched in backward, none was voted on twice
        assert on["overlap"]["revotes"] == 0 and off["overlap"]["batches_launched_in_backward"] == 0
        assert on["overlap"]["batches_launched_in_backward"] > 2 * (STEPS - 1)
        assert res["revote_warnings_accum"] == []


@needs_deepspeed
@pytest.mark.parametrize("comm", ["1bit", "pbit"])
def test_accumulation_overlap_resume_is_bit_identical(results, comm):
    import torch
    for r, res in enumerate(results):
        on = res[(comm, True)]
        assert torch.equal(on["resumed"]["params"], on["params"]), r
        assert torch.equal(on["resumed"]["momenta"], on["momenta"]), r
        assert on["resumed"]["overlap"]["revotes"] == 0
        # after the resume the first step votes in step(), the next one from backward again
        first, second = on["resume_trace"]
        assert first["backward"][-1] == [] and second["backward"][-1], on["resume_trace"]
    assert not torch.equal(results[0][(comm, True)]["momenta"], results[1][(comm, True)]["momenta"])


@needs_deepspeed
def test_engine_no_sync_micro_batch_does_not_launch(results):
    import torch
    for r, res in enumerate(results):
        off, on = res[("no_sync", False)], res[("no_sync", True)]
        assert torch.equal(on["params"], off["params"]) and torch.equal(on["momenta"], off["momenta"]), r
        for s, b in enumerate(on["trace"]):
            assert b["backward"][0] == [], (r, s, b)  # inside engine.no_sync(): nothing starts
            assert bool(b["backward"][1]) == (s > 0), (r, s, b)
        assert on["overlap"]["revotes"] == 0
        assert res["revote_warnings_no_sync"] == []


@needs_deepspeed
def test_nonfinite_on_one_rank_skips_on_every_rank_with_overlap(results):
    import torch
    for r, res in enumerate(results):
        off, on = res[("nan", False)], res[("nan", True)]
        assert torch.equal(on["params"], off["params"]) and torch.equal(on["momenta"], off["momenta"]), r
        assert torch.equal(on["params"], results[0][("nan", True)]["params"])
        assert on["skipped_steps"] == off["skipped_steps"] == 1 and on["step_count"] == STEPS - 1, on
        assert on["trace"][2]["backward"][-1], "the NaN step's votes were launched in backward too"
        assert on["overlap"]["revotes"] == 0
    assert results[0]["revote_warnings_nan"] == []


@needs_deepspeed
def test_unmanaged_accumulation_votes_in_step(results):
    import torch
    for r, res in enumerate(results):
        off, on = res[("unmanaged", False)], res[("unmanaged", True)]
        assert torch.equal(on["params"], off["params"]) and torch.equal(on["momenta"], off["momenta"]), r
        assert on["step_count"] == STEPS
        for a, b in zip(off["trace"], on["trace"]):
            assert b["backward"] == [[], [], []] and b["step"] == a["step"], (r, b)
        assert on["overlap"] == {"batches_launched_in_backward": 0, "revotes": 0}


@needs_deepspeed
def test_clipping_after_the_votes_started_votes_again_and_stays_exact(results):
    import torch
    for r, res in enumerate(results):
        off, on = res[("clip", False)], res[("clip", True)]
        assert torch.equal(on["params"], off["params"]) and torch.equal(on["momenta"], off["momenta"]), r
        # every step after the first launched in backward, and clipping (always active here) changed the
        # gradients afterwards: each of those steps voted again, once
        assert on["overlap"]["revotes"] == STEPS - 1, on["overlap"]
        assert len(res["revote_warnings_clip"]) == 1  # one warning per optimizer, not per step
    # said once at wiring, on rank 0, for the one engine with overlap and clipping
    assert len(results[0]["clip_notes"]) == 1 and "gradient_clipping=0.0001" in results[0]["clip_notes"][0]
    assert results[1]["clip_notes"] == []


@needs_deepspeed
@pytest.mark.parametrize("name,needles", [
    ("zero1", ("overlap=true", "zero_optimization.stage=1", "Allowed: overlap=false")),
    ("zero2", ("overlap=true", "zero_optimization.stage=2", "Allowed: overlap=false")),
    ("bf16", ("overlap=true", "bf16.enabled=true", "fp32 parameters")),
    ("zero1_client", ("overlap=true", "zero_optimization.stage=1", "Allowed: overlap=false")),
])
def test_unsupported_overlap_is_refused_before_any_state(results, name, needles):
    for res in results:
        e = res[name]
        assert e["error_type"] == "LionCubDeepSpeedError", e
        for needle in needles:
            assert needle in e["error"], (needle, e["error"])
        assert e["optimizer_inits"] == [] and e["params_untouched"], e
        if name == "zero1_client":
            assert e["client_untouched"], e


@needs_deepspeed
def test_double_buffer_in_ds_config_is_bit_identical_resumes_and_skips(results):
    """``"momentum_double_buffer": true`` under DeepSpeed stage 0: the same parameters and momenta
    as without it, a resume from its checkpoint equal to the uninterrupted run, and a NaN on one
    rank skipped on every rank with the momenta untouched."""
    import torch
    for r, res in enumerate(results):
        plain, double = res[("1bit", False)], res[("1bit", "double")]
        assert double["spare_momenta"] > 0 and plain["spare_momenta"] == 0, r  # the setting reached LionCub
        assert torch.equal(plain["params"], double["params"]) and torch.equal(plain["momenta"], double["momenta"]), r
        assert torch.equal(double["resumed"]["params"], double["params"]), r
        assert torch.equal(double["resumed"]["momenta"], double["momenta"]), r
        nan_plain, nan_double = res[("nan", False)], res[("nan", "double")]
        assert torch.equal(nan_plain["params"], nan_double["params"]), r
        assert torch.equal(nan_plain["momenta"], nan_double["momenta"]), r
        assert nan_double["step_count"] == nan_plain["step_count"] == STEPS - 1, r


# ----------------------------------------------------------------------------- clipping on one rank only
CLIP_COMMS = ("1bit", "pbit", "int8", "allgather", "bbit")
# rank 1's loss is scaled up so that its local gradient norm exceeds gradient_clipping=1.0 at every
# step; rank 0's is scaled down so that its norm stays below it: DeepSpeed clips on rank 1 only
CLIP_LOSS_SCALE = (0.05, 50.0)


def _clip_one_rank(rank, world_size, tmp):
    """Per comm, overlap off and on: STEPS steps (2 micro-batches each) with clipping on rank 1 only."""
    os.environ.update({"LOCAL_RANK": str(rank)})
    import torch
    import lioncub_ds.deepspeed  # noqa: F401
    torch.set_num_threads(1)
    out = {}
    for comm in CLIP_COMMS:
        for overlap in (False, True):
            quant = {"quant": "l1"} if comm in ("int8", "bbit") else {}
            cfg = _cfg(gas=2, clip=1.0, comm=comm, overlap=overlap, timeout_s=60,
                       bucket_size_mb=0.0005, comm_bucket_mb=0.00002, **quant)
            engine = _initialize(cfg)
            norms = []
            for s in range(STEPS):
                for micro in range(2):
                    x, y = _batch(rank, s, micro)
                    engine.backward(((engine(x) - y) ** 2).mean() * CLIP_LOSS_SCALE[rank])
                    engine.step()
                norms.append(float(engine.get_global_grad_norm()))
            res = _state(engine)
            res["norms"] = norms
            out[(comm, overlap)] = res
    return out


@pytest.fixture(scope="module")
def clip_one_rank(tmp_path_factory):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed not installed")
    from dist_helpers import run_ranks
    return run_ranks(_clip_one_rank, 2, str(tmp_path_factory.mktemp("ds_clip_one")), env=ENV, timeout=600)


@needs_deepspeed
@pytest.mark.parametrize("comm", CLIP_COMMS)
def test_clipping_on_one_rank_only_with_overlap_votes_again_everywhere(clip_one_rank, comm):
    """Issue 22 item 1 under DeepSpeed: ``"overlap": true`` with ``"gradient_clipping": 1.0`` where
    only rank 1's local norm exceeds the limit. The re-vote is agreed through the step's flags, so
    no rank waits for a collective the other never issues (it used to time out at step 2), and
    every rank ends bit-identical to the same run with overlap off."""
    import torch
    res = clip_one_rank
    for r in range(2):
        off, on = res[r][(comm, False)], res[r][(comm, True)]
        assert torch.equal(on["params"], off["params"]) and torch.equal(on["momenta"], off["momenta"]), r
        assert torch.equal(on["params"], res[0][(comm, True)]["params"]), "replicas differ across ranks"
        assert on["step_count"] == off["step_count"] == STEPS
        assert on["norms"] == off["norms"]
    # the data really clips on rank 1 only
    assert all(n > 1.0 for n in res[1][(comm, True)]["norms"]), res[1][(comm, True)]["norms"]
    assert all(n < 1.0 for n in res[0][(comm, True)]["norms"]), res[0][(comm, True)]["norms"]
    # rank 1's clipping changed its gradients after the votes started (steps 2..STEPS): both ranks voted again
    assert res[0][(comm, True)]["overlap"]["revotes"] == res[1][(comm, True)]["overlap"]["revotes"] == STEPS - 1
