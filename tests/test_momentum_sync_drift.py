"""momentum_sync schedule="drift" (issue 34 item 5): the setting, the signal (each rank's votes that
disagree with the applied Δ, carried in the next step's flags), the decision (the same on every
rank and in the simulation: momentum_sync.DriftTrigger) and its bytes, on real gloo ranks."""
from __future__ import annotations

import pytest
import torch

from lioncub_ds import LionCub, LionCubConfigError
from lioncub_ds.config import LionCubConfig, MomentumSyncConfig
from lioncub_ds.flags import flag_bytes
from lioncub_ds.momentum_sync import DriftTrigger, disagreement_units, drift_scale, vote_disagreement
from dist_helpers import SmallNet, recording_optimizer_inits, run_ranks


def _pack(bits: torch.Tensor) -> torch.Tensor:
    """[..., 8k] 0/1 -> uint8 [..., k], LSB first (the planes' order), written out independently."""
    w = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int64)
    return (bits.reshape(*bits.shape[:-1], -1, 8).long() * w).sum(-1).to(torch.uint8)


# ----------------------------------------------------------------------------- unit: setting, signal, trigger
@pytest.mark.unit
@pytest.mark.parametrize("value,match", [
    ({"schedule": "drift"}, r"momentum_sync.threshold=None; allowed: a number strictly between 0 and 1"),
    ({"schedule": "drift", "threshold": 0}, r"momentum_sync.threshold=0; allowed: a number strictly between 0 and 1"),
    ({"schedule": "drift", "threshold": 1.0}, r"threshold=1.0; allowed"),
    ({"schedule": "drift", "threshold": float("nan")}, r"threshold=nan; allowed"),
    ({"schedule": "drift", "threshold": True}, r"threshold=True; allowed"),
    ({"schedule": "drift", "threshold": 0.1, "min_every": 0}, r"min_every=0; allowed: an integer >= 1"),
    ({"schedule": "drift", "threshold": 0.1, "min_every": 2.5}, r"min_every=2.5; allowed: an integer >= 1"),
    ({"schedule": "drift", "threshold": 0.1, "every": 5}, r"momentum_sync.every is not used with schedule='drift'"),
    ({"schedule": "drift", "threshold": 0.1, "group": "node"}, r"momentum_sync.group is not used with"),
    ({"every": 5, "threshold": 0.1}, r"momentum_sync.threshold is only used with schedule='drift'"),
    ({"schedule": "geometric", "min_every": 3}, r"momentum_sync.min_every is only used with schedule='drift'"),
    ({"schedule": "drifts", "threshold": 0.1}, r"momentum_sync.schedule='drifts'; allowed: every \| geometric \| drift"),
])
def test_bad_drift_settings_are_refused_before_any_state(value, match):
    with recording_optimizer_inits() as inits, pytest.raises(LionCubConfigError, match=match):
        LionCub(SmallNet().parameters(), momentum_sync=value)
    assert inits == []


@pytest.mark.unit
def test_drift_setting_and_what_it_refuses():
    ms = MomentumSyncConfig.from_value({"threshold": 0.05, "dtype": "int8"})  # threshold alone: drift
    assert (ms.schedule, ms.threshold, ms.min_every, ms.dtype, ms.drift) == ("drift", 0.05, 2, "int8", True)
    with pytest.raises(LionCubConfigError, match=r"schedule='drift' counts the 1-bit sign votes.*comm='int8'"):
        LionCubConfig.from_kwargs(comm="int8", quant="l1", momentum_sync={"schedule": "drift", "threshold": 0.1})
    with pytest.raises(LionCubConfigError, match=r"schedule='drift' counts the 1-bit sign votes.*comm='bbit'"):
        LionCubConfig.from_kwargs(comm="bbit", quant="l1", momentum_sync={"schedule": "drift", "threshold": 0.1})
    # node voters: accepted (each rank's signal is over its shard, tests/test_node_voters_drift.py)
    assert LionCubConfig.from_kwargs(voters="node", node_size=2,
                                     momentum_sync={"schedule": "drift", "threshold": 0.1}).momentum_sync.drift


@pytest.mark.unit
def test_drift_under_megatron_is_validated_like_lioncubs_own():
    """Accepted with per-rank and node voters (their runs: tests/test_megatron*.py, against oracles);
    a bad value is refused naming the setting, as LionCub itself does."""
    from lioncub_ds.megatron.optimizer import lioncub_settings
    drift = {"schedule": "drift", "threshold": 0.05}
    for voters in ("rank", "node"):
        assert lioncub_settings({"voters": voters, "momentum_sync": drift})["momentum_sync"] == drift
        with pytest.raises(LionCubConfigError, match="threshold"):
            lioncub_settings({"voters": voters, "momentum_sync": dict(drift, threshold=-1.0)})
    assert lioncub_settings({"momentum_sync": {"every": 20, "dtype": "int8"}})["momentum_sync"]["every"] == 20


@pytest.mark.unit
@pytest.mark.parametrize("numel", [8, 136, 1000])
def test_vote_disagreement_counts_against_a_plain_count(numel):
    gen = torch.Generator().manual_seed(numel)
    c = torch.randint(-1, 2, (3, numel), generator=gen).float()  # some zeros: abstentions
    delta = torch.randint(-1, 2, (numel,), generator=gen).float() * torch.rand(numel, generator=gen)  # averaged Δ
    got = vote_disagreement(_pack(c > 0), _pack(c != 0), delta)
    for i in range(3):
        both = [k for k in range(numel) if c[i, k] != 0 and delta[k] != 0]
        differ = [k for k in both if (c[i, k] > 0) != (delta[k] > 0)]
        assert got[i].tolist() == [len(differ), len(both)]
        assert vote_disagreement(_pack(c[i] > 0), _pack(c[i] != 0), delta).tolist() == got[i].tolist()
    units = disagreement_units(torch.tensor([[3, 7], [0, 0], [7, 7]]), 4)
    assert units.tolist() == [3 * 65536 // 7, 0, 65536]
    assert drift_scale(2 ** 15) * 2 ** 15 < 2 ** 31 and drift_scale(3) == 65536


def _drive(trigger, signals):
    """Feed one rank's signal D(t) (a mean fraction per applied step t) to ``trigger`` as a step does
    (D(t−1) observed at step t, then the sync decision): the steps that synced, up to one past the last signal."""
    unit, synced = drift_scale(1), []
    for step in range(1, len(signals) + 2):
        if step > 1:
            trigger.observe(step - 1, int(signals[step - 1] * unit))
        if trigger.due(step):
            trigger.synced(step)
            synced.append(step)
    return synced


@pytest.mark.unit
def test_trigger_rule():
    """The sync after step t uses D(t−1); the baseline is the lowest D since the last sync (from
    the first step after it); at least max(min_every, 3) steps apart."""
    t = DriftTrigger(0.25, 2, 1)
    synced = _drive(t, {1: 0.1, 2: 0.1, 3: 0.4, 4: 0.2, 5: 0.2, 6: 0.2, 7: 0.5, 8: 0.9})
    # 4: D(3) − D(1) ≥ .25; then baseline D(5) = .2, and D(7) − .2 ≥ .25 at step 8; step 9 is 1 after it
    assert synced == [4, 8]
    t2 = DriftTrigger(0.25, 2, 1)
    t2.load_state_dict(t.state_dict())
    assert t2.state_dict() == t.state_dict()
    # a falling signal (momenta filling) then a rise: the rise counts from the low point (0.1), not
    # from the first signal after the sync (0.5, never exceeded)
    fired = _drive(DriftTrigger(0.25, 2, 1), {1: 0.5, 2: 0.3, 3: 0.1, 4: 0.2, 5: 0.4, 6: 0.4})
    assert fired == [6]  # D(5) − min(D(1..5)) = 0.4 − 0.1 ≥ 0.25


# ----------------------------------------------------------------------------- real ranks
def _fixed_grads_rank(rank, n, settings, steps, comm):
    """Steps 1–2: every rank's gradient is the same (no disagreement); from step 3 on each rank's is
    fixed, a common part + its own part: between syncs its momentum drifts towards its own
    gradient, so its disagreement with Δ rises step after step."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(1001)), torch.nn.Parameter(torch.randn(37, 3))]
    gen = torch.Generator().manual_seed(7)
    common = [torch.randn(p.shape, generator=gen) for p in params]
    own = torch.Generator().manual_seed(100 + rank)
    grads = [c * 0.3 + torch.randn(c.shape, generator=own) for c in common]
    grads[0][::5] = 0.0  # exact zeros: abstentions (both c and m stay 0 there)
    opt = LionCub(params, lr=1e-3, betas=(0.9, 0.9), comm=comm, momentum_sync=settings, bucket_size_mb=0.002)
    synced, stats = [], []
    for step in range(1, steps + 1):
        for p, g, c in zip(params, grads, common):
            p.grad = (c if step <= 2 else g).clone()
        opt.step()
        cs = opt.comm_stats()
        if cs["last_step"]["by_algorithm"].get("momentum_sync", 0) > 0:
            synced.append(step)
        stats.append(cs["momentum_sync"])
    cs = opt.comm_stats()
    return {"synced": synced, "stats": stats, "params": [p.detach().clone() for p in params],
            "cumulative": cs["cumulative"], "buckets": len(opt.plan.buckets), "steps": cs["steps"]}


@pytest.mark.dist
@pytest.mark.parametrize("n,comm", [(3, "1bit"), (4, "allgather")])
def test_drift_decisions_agree_and_track_the_rule(n, comm):
    """(a) every rank syncs at the same steps and ends bit-identical; (c) a tiny threshold syncs
    as soon as the rule allows (here the signal rises every step between syncs), at the gap
    max(min_every, 3); a threshold that is never reached never syncs, and then the only extra
    bytes are the drift flag word."""
    steps = 14
    tiny = {"schedule": "drift", "threshold": 1e-6, "min_every": 4, "dtype": "int8"}
    small = {"schedule": "drift", "threshold": 1e-6, "min_every": 1}
    never = {"schedule": "drift", "threshold": 0.999, "min_every": 1}
    res = run_ranks(_drift_rank_all, n, [tiny, small, never], steps, comm, timeout=400)
    tiny_r, small_r, never_r = ([r[i] for r in res] for i in range(3))
    for runs in (tiny_r, small_r, never_r):
        assert all(r["synced"] == runs[0]["synced"] for r in runs)  # the same decisions everywhere
        assert all(r["stats"] == runs[0]["stats"] for r in runs)
        for r in runs[1:]:
            for a, b in zip(r["params"], runs[0]["params"]):
                assert torch.equal(a, b)
    # every rank read the same signal; it rose between syncs in this set-up
    # step 4: D(3) > D(1) = 0 (the baseline); then every min_every steps
    assert tiny_r[0]["synced"] == [4, 8, 12]
    assert small_r[0]["synced"] == [4, 7, 10, 13]  # min_every=1: the signal's own minimum gap, 3
    stats = tiny_r[0]["stats"]
    assert stats[-1]["syncs"] == 3 and stats[-1]["last_sync_step"] == 12 and stats[-1]["schedule"] == "drift"
    assert 0 < stats[-1]["signal"] < 1 and stats[-1]["signal_step"] == steps - 1
    assert never_r[0]["synced"] == [] and never_r[0]["stats"][-1]["syncs"] == 0
    cum = never_r[0]["cumulative"]
    carried = comm in ("1bit", "allgather")
    assert cum["by_algorithm"]["control"] == steps * flag_bytes(never_r[0]["buckets"], n, carried, drift=True)
    assert cum["by_algorithm"]["control"] > steps * flag_bytes(never_r[0]["buckets"], n, carried)
    assert "momentum_sync" not in cum["by_algorithm"]
    assert tiny_r[0]["cumulative"]["by_algorithm"]["momentum_sync"] > 0


def _drift_rank_all(rank, n, settings_list, steps, comm):
    return [_fixed_grads_rank(rank, n, s, steps, comm) for s in settings_list]


# ----------------------------------------------------------------------------- the simulation == real LionCub
# early in training the disagreement mostly falls (the momenta gather history), so syncs are rare;
# these seeds and the tiny threshold give a few syncs in 12 steps (the decisions are what is compared)
SIM_SYNC = {"schedule": "drift", "threshold": 0.001, "min_every": 2, "dtype": "int8"}
SIM_STEPS = 12


def _sim_cfg():
    from benchmarks import converge as C
    return C.make_cfg(steps=SIM_STEPS, n_layer=1, n_head=2, d_model=32, seq_len=16, batch_size=2, warmup=2,
                      lion_wd=0.1)


def _real_drift_rank(rank, n, seed, lr):
    """Rank ``rank`` of real LionCub on the simulation's small GPT: per step whether it synced."""
    from benchmarks import converge as C
    from benchmarks.data import load_dataset
    from benchmarks.models.gpt import param_digest

    cfg = _sim_cfg()
    ds = load_dataset(cfg["data"])
    model = C.build_model_for(cfg, seed)
    opt = LionCub(model.optim_groups(cfg["lion_wd"]), lr=lr, betas=tuple(cfg["betas"]), comm="1bit",
                  tie_break=cfg["tie_break"], momentum_sync=SIM_SYNC)
    synced = []
    for step in range(cfg["steps"]):
        for g in opt.param_groups:
            g["lr"] = C.lr_at(step, cfg["steps"], lr, cfg["warmup"], cfg["min_lr_ratio"])
        x, y = ds.get_batch("train", cfg["batch_size"], cfg["seq_len"], rank, n, step=step, seed=seed)
        opt.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        opt.step()
        if opt.comm_stats()["last_step"]["by_algorithm"].get("momentum_sync", 0) > 0:
            synced.append(step + 1)
    cs = opt.comm_stats()
    return synced, param_digest(model), cs["cumulative"]["bytes_sent"], cs["momentum_sync"]


@pytest.mark.dist
@pytest.mark.parametrize("n,seed", [(3, 7), (4, 2)])
def test_simulation_syncs_where_real_lioncub_does(n, seed):
    """(b) bench converge's SimLionCub with the same drift settings takes the same decisions (the
    same DriftTrigger fed with the same integer sums) and ends with the same parameters and bytes."""
    from benchmarks import converge as C
    from benchmarks.data import load_dataset
    from benchmarks.models.gpt import param_digest

    lr = 3e-3
    real = run_ranks(_real_drift_rank, n, seed, lr, timeout=400)
    assert all(r[:3] == real[0][:3] for r in real)  # every rank: the same syncs, parameters and bytes
    cfg = _sim_cfg()
    ds = load_dataset(cfg["data"])
    model = C.build_model_for(cfg, seed)
    opt = C.SimLionCub(model.optim_groups(cfg["lion_wd"]), n, lr=lr, betas=tuple(cfg["betas"]), comm="1bit",
                       tie_break=cfg["tie_break"], momentum_sync=SIM_SYNC)
    grads = C.WorkerGrads(model, cfg)
    for step in range(cfg["steps"]):
        for g in opt.param_groups:
            g["lr"] = C.lr_at(step, cfg["steps"], lr, cfg["warmup"], cfg["min_lr_ratio"])
        opt.step(grads([ds.get_batch("train", cfg["batch_size"], cfg["seq_len"], i, n, step=step, seed=seed)
                        for i in range(n)]))
    synced, digest, sent, stats = real[0]
    assert len(synced) >= 2, synced  # the threshold is low enough to sync in this run
    assert opt.sync_steps == synced
    assert param_digest(model) == digest
    assert opt.bytes_sent == sent
    assert opt.trigger.state_dict()["signal"][0] == SIM_STEPS and stats["signal_step"] == SIM_STEPS - 1


def _master_only_rank(rank, n):
    torch.manual_seed(0)
    model = SmallNet().to(torch.bfloat16)
    opt = LionCub(model.parameters(), lr=0.01, comm="1bit", node_size=2, bucket_size_mb=0.0002,
                  momentum_sync={"schedule": "drift", "threshold": 1e-6, "min_every": 1})
    for step in range(1, 7):
        gen = torch.Generator().manual_seed(100 * rank + step)
        idx, y = torch.randint(0, 6, (4, 3), generator=gen), torch.randn(4, 3, generator=gen)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(idx).float(), y).backward()
        opt.step()
    return opt.comm_stats()["momentum_sync"], [p.detach().clone() for p in model.parameters()]


@pytest.mark.dist
def test_drift_with_master_only_sharding_agrees():
    """voters="rank" with node_size (bf16 parameters, fp32 master sharded in pairs of ranks): the
    vote is flat, so is the signal; every rank decides alike and ends bit-identical."""
    res = run_ranks(_master_only_rank, 4, timeout=300)
    assert res[0][0]["syncs"] >= 1
    for stats, params in res[1:]:
        assert stats == res[0][0]
        assert all(torch.equal(a, b) for a, b in zip(params, res[0][1]))
