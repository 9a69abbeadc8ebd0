"""Fast tests for ``bench converge``: the pinned corpus, the t-interval, paired-seed
determinism, and the simulated N-worker LionCub against the real multi-rank LionCub."""
from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from benchmarks import converge as C
from benchmarks.common import run_ranks
from benchmarks.data import (PINNED_BYTES, PINNED_CORPUS, PINNED_SHA256, CorpusMismatchError, pinned_dataset,
                             pinned_files)

pytestmark = pytest.mark.unit

# A run small enough for a unit test: 1 layer, d=32, 8 steps of 2x16 tokens per worker.
TINY = dict(steps=8, n_layer=1, n_head=2, d_model=32, seq_len=16, batch_size=2, warmup=2, eval_every=4, eval_iters=2,
            eval_batch=4)
LRS = dict(C.DEFAULT_LR, cub=3e-3, avg=1e-2)


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return pinned_dataset(cache=tmp_path_factory.mktemp("pinned"))


# ----------------------------------------------------------------------------- the pinned corpus
def test_pinned_corpus_sha256(ds, tmp_path):
    """The corpus is exactly the pinned bytes (SHA-256 over the concatenation, >= 8 MB of real text)."""
    h = hashlib.sha256()
    n = 0
    for _, full in pinned_files():
        data = full.read_bytes() + b"\n"
        h.update(data)
        n += len(data)
    assert h.hexdigest() == PINNED_SHA256 and n == PINNED_BYTES and n >= 8 * 2**20
    assert len(ds.train) + len(ds.val) == PINNED_BYTES
    assert 0.03 < len(ds.val) / len(ds) < 0.07
    assert b"import torch" in ds.train[:200_000].tobytes()  # real Python source text
    again = pinned_dataset(cache=tmp_path, use_cache=False)
    assert (again.train == ds.train).all() and (again.val == ds.val).all()


def test_pinned_corpus_split_by_whole_files(ds):
    tr, va = set(ds.files["train"]), set(ds.files["val"])
    assert tr and va and not tr & va
    assert len(tr) + len(va) == len(pinned_files())


def test_pinned_corpus_wrong_version_or_bytes(tmp_path):
    with pytest.raises(CorpusMismatchError, match=r"deepspeed 0\.19\.8 is installed but the corpus pins deepspeed==9\.9"):
        pinned_files((("deepspeed", "9.9"),))
    with pytest.raises(CorpusMismatchError, match="no-such-dist==1.0 is not installed"):
        pinned_files((("no-such-dist", "1.0"),))
    with pytest.raises(CorpusMismatchError, match="expected 00"):
        pinned_dataset(cache=tmp_path, corpus=PINNED_CORPUS[:1], expected_sha256="00" * 32)


# ----------------------------------------------------------------------------- statistics
def test_t_interval_hand_computed():
    # gaps 1, 2, 3, 4, 5: mean 3, sd = sqrt(10/4) = 1.5811, t(0.975, 4) = 2.7764,
    # half-width = 2.7764 * 1.5811 / sqrt(5) = 1.9632
    mean, half, sd = C.t_interval([1, 2, 3, 4, 5])
    assert mean == 3.0
    assert sd == pytest.approx(1.5811388, abs=1e-6)
    assert half == pytest.approx(1.96323, abs=1e-4)
    # two values: t(0.975, 1) = 12.7062; sd = sqrt(2)/... (-1, 1): mean 0, sd sqrt(2), half 12.7062*sqrt(2)/sqrt(2)
    assert C.t_interval([-1.0, 1.0])[1] == pytest.approx(12.7062)
    assert math.isnan(C.t_interval([0.5])[1])
    assert C.t_quantile_975(9) == 2.2622 and C.t_quantile_975(1000) == 1.96


def test_summary_is_paired():
    recs = [dict(variant=v, world_size=4, seed=s, val_loss=l, bytes_per_rank=1, bytes_ratio_vs_fp32=r, lr=1e-3)
            for v, r, ls in (("lion", 1.0, (2.0, 3.0)), ("cub_1bit", 32.0, (2.02, 3.03))) for s, l in zip((0, 1), ls)]
    rows = {r["variant"]: r for r in C.summarize(recs)}
    assert rows["lion"]["gap_pct"] == 0.0
    assert rows["cub_1bit"]["gap_pct"] == pytest.approx(1.0)  # +1% on both seeds, although losses differ by 50%
    assert rows["cub_1bit"]["ci95_pct"] == pytest.approx(0.0, abs=1e-9) and rows["cub_1bit"]["meets_goal"]


# ----------------------------------------------------------------------------- determinism
def test_same_command_same_numbers(ds):
    """Two runs of the same tiny study: identical losses, bytes and parameter SHA-1 digests."""
    kw = dict(TINY, steps=4, eval_every=2)
    variants = ("lion", "adamw", "cub_1bit", "cub_1bit_sync5", "cub_int8", "cub_avg")
    a, ca, _ = C.run(variants, seeds=(0, 1), world_sizes=(4,), lrs=LRS, ds=ds, verbose=False, **kw)
    b, cb, _ = C.run(variants, seeds=(0, 1), world_sizes=(4,), lrs=LRS, ds=ds, verbose=False, **kw)
    assert [(r["variant"], r["seed"], r["val_loss"], r["bytes_per_rank"], r["digest"]) for r in a] == \
           [(r["variant"], r["seed"], r["val_loss"], r["bytes_per_rank"], r["digest"]) for r in b]
    assert ca == cb
    # Paired: every variant of a seed starts from the same init (same first val loss) ...
    for s in (0, 1):
        assert len({r["first_val_loss"] for r in a if r["seed"] == s}) == 1
    # ... and the seeds differ.
    assert a[0]["first_val_loss"] != next(r["first_val_loss"] for r in a if r["seed"] == 1)
    assert len({r["digest"] for r in a}) == len(a)


# ----------------------------------------------------------------------------- simulation == real LionCub
@pytest.mark.dist
@pytest.mark.parametrize("n,variants", [(2, ("cub_1bit", "dlion", "cub_int8", "cub_avg", "cub_1bit_sync5_small",
                                             "cub_1bit_geo", "cub_b2", "cub_b3_nearest", "cub_1bit_sync20_bf16")),
                                        (4, ("cub_1bit", "cub_int8", "cub_b2", "cub_b2_l0", "cub_1bit_sync10_int8",
                                             "cub_1bit_sync10_bf16", "cub_1bit_w300")),
                                        (4, ("cub_1bit_node2", "cub_1bit_sync20_int8_node2", "cub_1bit_node2_tz",
                                             "cub_avg_node2")),
                                        (8, ("cub_1bit_node4", "cub_1bit_sync20_int8_node2", "cub_1bit_node4_alt",
                                             "cub_avg_node4"))],
                         ids=["n2", "n4", "n4-nodes2x2", "n8-nodes2x4-4x2"])
def test_simulation_equals_real_lioncub(ds, n, variants):
    """N simulated workers give bit-identical parameters (SHA-1) and the same bytes as N real
    gloo ranks running LionCub. The fp32 momentum sync sums across ranks in gloo's order, which the
    simulation matches only for N = 2 (any order), so the fp32 sync variants run with N = 2; the
    bf16 / int8 syncs sum in the project's own order (exact at any N); the votes are integer sums.
    Node voters (``*_nodeL``: LionCub(voters="node", node_size=L)): the same parameters, and the
    simulation's bytes are the real ``comm_stats`` split by link: inter-node (votes, flags, the
    momentum sync over the Nn shard peers) and intra-node (reduce-scatter, all-gather, flags)."""
    cfg = C.make_cfg(**dict(TINY, steps=6))
    real = run_ranks(C.real_lioncub_rank, n, variants, 3, cfg, LRS, timeout=600)
    for i, variant in enumerate(variants):
        assert len({r[i][0] for r in real}) == 1  # the real replicas agree
        sim = C.train_one(variant, 3, n, cfg, LRS, ds)
        assert sim["digest"] == real[0][i][0], variant
        if "node" in variant:
            for r in real:  # every rank sends the same on each link
                assert r[i][2] == {"inter_node": sim["bytes"], "intra_node": sim["intra_bytes"]}, variant
            assert sim["bytes"] > 0 and sim["intra_bytes"] > 0
        else:
            assert sim["bytes"] == real[0][i][1], variant
        if "sync" in variant or "geo" in variant:
            assert sim["sync_bytes"] > 0
    # D-Lion in the study reuses the 1bit run (same Δ): its digest equals the real all-gather run's.
    if "dlion" in variants:
        assert real[0][variants.index("dlion")][0] == real[0][variants.index("cub_1bit")][0]
        one = C.train_one("cub_1bit", 3, n, cfg, LRS, ds)
        assert C.study._dlion_from_1bit(one)["bytes"] == real[0][variants.index("dlion")][1]


def test_even_n_ties_happen_and_sim_uses_the_hash():
    """At N=4 many coordinates tie (2 vs 2); the simulated vote applies LionCub's hash rule there."""
    from lioncub_ds.kernels import reference

    torch.manual_seed(0)
    p = torch.zeros(64, requires_grad=True)  # a trainable parameter: the layout leaves frozen ones out
    sim = C.SimLionCub([{"params": [p], "names": ["w"], "weight_decay": 0.0}], 4, lr=1.0, betas=(0.9, 0.99))
    g = torch.tensor([[1.0] * 64, [1.0] * 64, [-1.0] * 64, [-1.0] * 64])
    sim.step({p: g})
    expected = -reference.tie_hash_sign(1, torch.arange(64)).float()
    assert torch.equal(p, expected)


def test_variant_with_another_familys_lr():
    """``cub_1bit:lion`` is Lion Cub (simulated, 1-bit votes) with global Lion's tuned lr."""
    from benchmarks.models import build_model

    cfg = C.make_cfg(**TINY)
    model = build_model("tiny", seed=0, n_layer=1, d_model=32, n_head=2, seq_len=16)
    opt, fam, allreduce = C.build_variant("cub_1bit_sync20_bf16:lion", model, 4, cfg, LRS)
    assert isinstance(opt, C.SimLionCub) and not allreduce and fam == "lion"
    assert opt.groups[0]["lr"] == LRS["lion"] and opt.cfg.momentum_sync.dtype == "bf16"
    assert opt.cfg.momentum_sync.every == 20
    with pytest.raises(ValueError, match="only Lion Cub"):
        C.spec_of("adamw:lion")
    with pytest.raises(ValueError, match="unknown"):
        C.spec_of("nope")


def test_recommended_config_is_valid_and_is_the_studied_one():
    """configs/ds_lioncub_recommended.json: a valid LionCub config, and the variant the long-horizon
    study recommends (docs/convergence.md): 1-bit majority votes with hash ties and an int8 momentum
    sync every 20 steps, at the chosen preset's (lion_w300) betas, lr (global Lion's), lr*wd (= AdamW's)
    and schedule."""
    import json
    import pathlib

    from lioncub_ds.config import LionCubConfig, MomentumSyncConfig

    path = pathlib.Path(__file__).resolve().parents[1] / "configs" / "ds_lioncub_recommended.json"
    ds_cfg = json.loads(path.read_text())
    assert ds_cfg["optimizer"]["type"] == "LionCub"
    cfg = LionCubConfig.from_kwargs(**ds_cfg["optimizer"]["params"])
    spec = C.spec_of("cub_1bit_sync20_int8")
    proto = C.PROTOCOLS["lion_w300"]
    assert (cfg.comm, cfg.vote, cfg.tie_break) == (spec["comm"], "majority", "hash")
    assert cfg.momentum_sync == MomentumSyncConfig.from_value(spec["sync"])
    assert list(cfg.betas) == proto["settings"]["betas"] and cfg.lr == proto["lr"]["cub"]
    assert cfg.weight_decay == pytest.approx(0.1 * proto["lr"]["adamw"] / proto["lr"]["cub"])
    assert cfg.lr == proto["lr"]["lion"]
    sched = ds_cfg["scheduler"]["params"]
    assert ds_cfg["scheduler"]["type"] == "WarmupCosineLR" and sched["warmup_type"] == "linear"
    study = C.make_cfg(**proto["settings"])  # the bench's schedule, its defaults filled in
    assert (sched["total_num_steps"], sched["warmup_num_steps"]) == (study["steps"], study["warmup"])
    assert sched["cos_min_ratio"] == study["min_lr_ratio"] and sched["warmup_min_ratio"] == 0.0


# ----------------------------------------------------------------------------- node voters in the simulation
def test_node_voters_vote_with_the_group_mean_gradient():
    """node_size L: the N workers are N/L voters, each with its group's gradient summed in worker
    order one add at a time and divided by L (the real reduce-scatter's order), so a step equals the
    flat simulation of those N/L mean gradients; an odd parameter count, ties and abstentions."""
    torch.manual_seed(1)
    g = torch.randn(8, 37) * 1e3
    g[:, 5] = 0.0  # every worker abstains here
    g[::2, 7], g[1::2, 7] = 1.0, -1.0  # groups of 2 cancel: abstentions of the node voters
    p_node = torch.zeros(37, requires_grad=True)
    p_flat = torch.zeros(37, requires_grad=True)
    node = C.SimLionCub([{"params": [p_node], "names": ["w"], "weight_decay": 0.1}], 8, lr=0.01, betas=(0.9, 0.99),
                        node_size=2)
    flat = C.SimLionCub([{"params": [p_flat], "names": ["w"], "weight_decay": 0.1}], 4, lr=0.01, betas=(0.9, 0.99))
    rows = g.view(4, 2, 37)
    mean = (rows[:, 0] + rows[:, 1]) / 2
    assert torch.equal(node.node_means({p_node: g})[p_node], mean)
    three = torch.randn(6, 5)  # L = 3: ((g0 + g1) + g2) / 3, not a tree sum or a mean()
    sim3 = C.SimLionCub([{"params": [torch.zeros(5, requires_grad=True)], "names": ["v"], "weight_decay": 0.0}], 6,
                        lr=0.01, betas=(0.9, 0.99), node_size=3)
    got = next(iter(sim3.node_means({"x": three}).values()))
    assert torch.equal(got, (three.view(2, 3, 5)[:, 0] + three.view(2, 3, 5)[:, 1] + three.view(2, 3, 5)[:, 2]) / 3)
    for _ in range(3):
        node.step({p_node: g})
        flat.step({p_flat: mean})
    assert torch.equal(p_node, p_flat) and torch.equal(node.momenta[p_node], flat.momenta[p_flat])
    assert node.n == 4 and node.workers == 8 and node.intra_bytes > 0 and flat.intra_bytes == 0
    # the shards vote over Nn = 4 voters with half the bucket each: fewer vote bytes than 4 flat voters
    assert 0 < node.bytes_sent < flat.bytes_sent


def test_node_voters_refuse_what_the_simulation_does_not_model():
    p = torch.zeros(16, requires_grad=True)
    grp = [{"params": [p], "names": ["w"], "weight_decay": 0.0}]
    with pytest.raises(ValueError, match=r"sign comms only .*per \(parameter ∩ shard\) piece"):
        C.SimLionCub(grp, 4, lr=0.01, betas=(0.9, 0.99), comm="int8", quant="l1", node_size=2)
    with pytest.raises(ValueError, match="dividing the 6 workers"):
        C.SimLionCub(grp, 6, lr=0.01, betas=(0.9, 0.99), node_size=4)
    for sync in ({"every": 5, "layers": ["w"]}, {"schedule": "drift", "threshold": 0.05}):
        with pytest.raises(ValueError, match="layers and schedule 'drift' .* are not modelled"):
            C.SimLionCub(grp, 4, lr=0.01, betas=(0.9, 0.99), node_size=2, momentum_sync=sync)
    from lioncub_ds.config import LionCubConfigError
    with pytest.raises(LionCubConfigError, match="group='node' has nothing to average"):  # LionCub's own rule
        C.SimLionCub(grp, 4, lr=0.01, betas=(0.9, 0.99), node_size=2, momentum_sync={"every": 5, "group": "node"})


def test_node_voter_rows_in_the_table():
    """Records of node voters carry Nn × L, the momentum per rank (1/L) and the intra-node bytes;
    the bytes ratio is the inter-node link's against an fp32 all-reduce over all N ranks."""
    recs = []
    for v, ratio, L, ls in (("lion", 1.0, None, (2.0, 3.0)), ("cub_1bit_node4", 120.0, 4, (2.04, 3.06)),
                            ("cub_1bit_sync20_int8_node2", 50.0, 2, (2.02, 3.03))):
        for s, loss in zip((0, 1), ls):
            r = dict(variant=v, world_size=16, seed=s, val_loss=loss, bytes_per_rank=1, bytes_ratio_vs_fp32=ratio,
                     lr=5e-4, steps=10)
            if L:
                r.update(node_size=L, voters=16 // L, intra_node_bytes_per_rank=10 * 2**20,
                         momentum_per_rank_ratio=1 / L)
            recs.append(r)
    summary = C.summarize(recs)
    row = next(s for s in summary if s["variant"] == "cub_1bit_node4")
    assert row["gap_pct"] == pytest.approx(2.0) and row["voters"] == 4 and row["momentum_per_rank_ratio"] == 0.25
    md = C.markdown_table(summary)
    assert "voters (Nn × L)" in md and "| 4 × 4 | 1/4 |" in md and "| 1.000 |" in md and "inter-node" in md
    assert "voters" not in C.markdown_table([s for s in summary if s["variant"] == "lion"])
    goal = [m for m in C.check_goal(summary) if "node voters" in m]
    # one line per configuration (the name without _nodeL), each with its own largest L within 2%
    assert goal == ["N=16: node voters (cub_1bit): largest L with the upper 95% bound of the gap <= 2%: none; "
                    "L=4: +2.00% (upper +2.00%, 2 seeds)",
                    "N=16: node voters (cub_1bit_sync20_int8): largest L with the upper 95% bound of the gap <= 2%: "
                    "L=2 (8 voters, +1.00% [+1.00, +1.00]); L=2: +1.00% (upper +1.00%, 2 seeds)"]


def test_merge_keeps_the_first_copy_and_the_asked_runs(tmp_path):
    import json

    def rec(v, n, seed, loss):
        return {"bench": "converge", "variant": v, "world_size": n, "seed": seed, "val_loss": loss}

    a, b = tmp_path / "a.jsonl", tmp_path / "b.json"
    a.write_text("\n".join(json.dumps(r) for r in (rec("lion", 16, 0, 1.0), rec("cub_1bit_node2", 16, 0, 1.1))))
    b.write_text(json.dumps([rec("lion", 16, 0, 9.0), rec("lion", 16, 1, 2.0), rec("adamw", 16, 1, 0.5),
                             rec("lion", 8, 1, 3.0)]))
    _, records, _, _ = C.merge([str(a), str(b)], variants=["lion", "cub_1bit_node2"], world_sizes=[16])
    assert sorted((r["variant"], r["seed"], r["val_loss"]) for r in records) == \
           [("cub_1bit_node2", 0, 1.1), ("lion", 0, 1.0), ("lion", 1, 2.0)]


def test_merge_skips_a_torn_line_with_a_warning(tmp_path, capsys):
    """A run killed mid-write leaves a cut line in its --partial file, and the line stays when the run
    is redone: ``--merge DIR/*.jsonl`` (the queue's documented merge) skips it with a warning, as the
    resumed runs and the queue do, and merges every readable run."""
    part = tmp_path / "n2_s0.jsonl"
    argv = ["--world-sizes", "2", "--variants", "lion", "cub_1bit", "--steps", "2", "--n-layer", "1",
            "--d-model", "32", "--seq-len", "16", "--batch-size", "2", "--eval-every", "2", "--eval-iters", "1",
            "--eval-batch", "2", "--partial", str(part)]
    assert C.main(argv + ["--seeds", "0"]) == 0
    with open(part, "a") as f:
        f.write('{"bench": "converge", "variant": "lio')  # the writer killed mid-line
    assert C.main(argv + ["--seeds", "1"]) == 0  # the run redone after it: the cut line stays
    capsys.readouterr()
    out = tmp_path / "merged.json"
    assert C.main(["--merge", str(part), "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"--merge {part}: skipped 1 unreadable line(s)" in err
    runs = [r for r in json.loads(out.read_text()) if r["bench"] == "converge"]
    assert sorted((r["variant"], r["seed"]) for r in runs) == [("cub_1bit", 0), ("cub_1bit", 1), ("lion", 0),
                                                               ("lion", 1)]


# ----------------------------------------------------------------------------- the vectorized gradients
@pytest.mark.parametrize("mode", ["vmap"])
def test_vectorized_worker_gradients_agree_with_the_exact_loop(ds, mode):
    """``grads="vmap"`` (one vectorized pass for the N workers) against the exact per-worker loop, on
    the parameters and momenta of a real simulated run: the Lion directions' majority votes agree on
    >= 99.9% of the coordinates at every step, and a whole run's losses agree within float noise.

    Coordinates whose gradient is float noise on every worker (|g| <= 1e-6 of the parameter's largest)
    are left out of the count: the key bias of attention has an exactly zero gradient in exact
    arithmetic (softmax is invariant to a shift of one query's scores), so its sign is the rounding
    of either summation order (here 1e-11 against 5e-2), and 24 of its 32 votes differ."""
    from lioncub_ds.kernels import reference

    n, steps = 4, 6
    cfg = C.make_cfg(**dict(TINY, steps=steps))
    model = C.build_model_for(cfg, seed=5)
    opt, _, _ = C.build_variant("cub_1bit", model, n, cfg, LRS)
    exact, fast = C.WorkerGrads(model, cfg), C.WorkerGrads(model, dict(cfg, grads=mode))
    agree = total = 0
    for step in range(steps):
        batches = [ds.get_batch("train", cfg["batch_size"], cfg["seq_len"], i, n, step=step, seed=5) for i in range(n)]
        ge, gf = exact(batches), fast(batches)
        for p in ge:
            m = opt.momenta[p].reshape(n, -1)
            votes = [torch.sign(torch.sign(reference.lion_direction(m, g[p].reshape(n, -1), 0.9)).sum(0))
                     for g in (ge, gf)]
            signal = ge[p].reshape(n, -1).abs().amax(0) > 1e-6 * ge[p].abs().max()
            agree += int((votes[0] == votes[1])[signal].sum())
            total += int(signal.sum())
            assert torch.allclose(ge[p], gf[p], rtol=1e-4, atol=1e-6)
        assert agree >= 0.999 * total, (step, agree, total)
        opt.step(ge)
    runs = {g: C.train_one("cub_1bit", 5, n, dict(cfg, grads=g), LRS, ds) for g in ("loop", mode)}
    for (s0, l0, b0), (s1, l1, b1) in zip(runs["loop"]["curve"], runs[mode]["curve"]):
        # bytes: the votes are the same size; an exact zero (an abstention) that one path rounds to
        # 1e-11 changes a bucket's abstention list, so the bytes may differ by those lists only
        assert s0 == s1 and l0 == pytest.approx(l1, rel=1e-4) and b1 == pytest.approx(b0, rel=0.25)


def test_grads_setting_is_checked():
    with pytest.raises(ValueError, match="grads='fast'.*loop, vmap"):
        C.WorkerGrads(C.build_model_for(C.make_cfg(**TINY), seed=0), C.make_cfg(**dict(TINY, grads="fast")))


def test_a_record_reruns_from_itself(tmp_path):
    """Every record names its protocol and the settings that define the preset; command_for(record)
    re-runs it (changed settings included) to the same parameters."""
    argv = ["--protocol", "long", "--world-sizes", "2", "--seeds", "3", "--variants", "cub_1bit", "--steps", "3",
            "--n-layer", "1", "--d-model", "32", "--seq-len", "16", "--batch-size", "2", "--no-bias",
            "--eval-every", "3", "--eval-iters", "1", "--eval-batch", "2", "--lr", "cub=2e-3",
            "--json", str(tmp_path / "a.json")]
    assert C.main(argv) == 0
    (rec,) = [r for r in json.loads((tmp_path / "a.json").read_text()) if r["bench"] == "converge"]
    assert rec["protocol"].startswith("long (with ") and "bias" in rec["protocol"]
    assert rec["betas"] == [0.95, 0.98] and rec["bias"] is False and rec["batch_size"] == 2
    again = C.command_for(rec) + ["--eval-every", "3", "--eval-iters", "1", "--eval-batch", "2",
                                   "--json", str(tmp_path / "b.json")]
    assert C.main(again) == 0
    (rec2,) = [r for r in json.loads((tmp_path / "b.json").read_text()) if r["bench"] == "converge"]
    assert rec2["digest"] == rec["digest"] and rec2["protocol"] == rec["protocol"]


def test_a_variant_with_its_own_warmup(tmp_path):
    """``*_w300``: that run alone warms up over 300 steps (its record says so; the preset and the
    other runs keep theirs), and command_for re-runs it without a --warmup of the preset's."""
    shape = ["--world-sizes", "2", "--seeds", "3", "--steps", "3", "--n-layer", "1", "--d-model", "32",
             "--seq-len", "16", "--batch-size", "2", "--eval-every", "3", "--eval-iters", "1", "--eval-batch", "2"]
    assert C.main(["--protocol", "lion_w150", *shape, "--variants", "lion", "cub_1bit", "cub_1bit_w300",
                   "--json", str(tmp_path / "a.json")]) == 0
    recs = {r["variant"]: r for r in json.loads((tmp_path / "a.json").read_text()) if r["bench"] == "converge"}
    assert recs["cub_1bit_w300"]["warmup"] == 300 and recs["cub_1bit"]["warmup"] == 150 == recs["lion"]["warmup"]
    assert recs["cub_1bit_w300"]["digest"] != recs["cub_1bit"]["digest"]  # a lower lr on steps 0-2
    again = C.command_for(recs["cub_1bit_w300"])
    assert "--warmup" not in again
    assert C.main(again + ["--eval-every", "3", "--eval-iters", "1", "--eval-batch", "2",
                           "--json", str(tmp_path / "b.json")]) == 0
    (rec2,) = [r for r in json.loads((tmp_path / "b.json").read_text()) if r["bench"] == "converge"]
    assert rec2["digest"] == recs["cub_1bit_w300"]["digest"] and rec2["warmup"] == 300
    assert C.lr_at(2, 1200, 2.8e-3, C.warmup_of("cub_1bit_w300", C.make_cfg())) == pytest.approx(2.8e-3 * 3 / 300)


def test_trend_pairs_within_each_preset(tmp_path):
    """--trend: gaps are summarized per preset (a run is paired with global Lion of the same batch,
    width and seed only), one row per (preset, N, variant), and the plot is written."""
    kw = dict(TINY, steps=2, eval_every=2)
    files = []
    for b in (1, 2):
        recs, _, _ = C.run(("lion", "cub_1bit"), seeds=(0, 1), world_sizes=(2,), lrs=LRS, verbose=False, ds=None,
                           **dict(kw, batch_size=b))
        path = tmp_path / f"b{b}.json"
        path.write_text(json.dumps(recs))
        files.append(str(path))
    rows = C.trend(sum((json.loads(open(f).read()) for f in files), []))
    cub = [r for r in rows if r["variant"] == "cub_1bit"]
    assert sorted(r["batch_size"] for r in cub) == [1, 2] and all(len(r["seeds"]) == 2 for r in cub)
    for r in cub:
        mine = [x for x in json.loads(open(files[r["batch_size"] - 1]).read())]
        lion = {x["seed"]: x["val_loss"] for x in mine if x["variant"] == "lion"}
        gaps = [100 * (x["val_loss"] / lion[x["seed"]] - 1) for x in mine if x["variant"] == "cub_1bit"]
        assert r["gap_pct"] == pytest.approx(sum(gaps) / 2)
    assert C.main(["--trend", *files, "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "converge_trend_n2.png").exists()


def test_trend_against_width_plots_against_parameters(tmp_path):
    """A size study (presets differ in width only): each row carries its model's parameter count, the
    table shows it, and the plot's x axis is the parameters; with several batches it stays the batch."""
    kw = dict(TINY, steps=2, eval_every=2)
    recs = []
    for d in (16, 32):
        recs += C.run(("lion", "cub_1bit"), seeds=(0, 1), world_sizes=(2,), lrs=LRS, verbose=False, ds=None,
                      **dict(kw, d_model=d))[0]
    rows = C.trend(recs)
    cub = sorted((r for r in rows if r["variant"] == "cub_1bit"), key=lambda r: r["d_model"])
    params = {r["d_model"]: r["params"] for r in recs if r.get("bench") == "converge"}
    assert [r["params"] for r in cub] == [params[16], params[32]] and params[16] < params[32]
    assert C.trend_axis(rows) == ("params", "parameters (widths d_model 16, 32)")
    assert f"| {params[32]:,} |" in C.trend_table(rows)
    wider = recs + C.run(("lion", "cub_1bit"), seeds=(0, 1), world_sizes=(2,), lrs=LRS, verbose=False, ds=None,
                         **dict(kw, d_model=16, batch_size=1))[0]
    assert C.trend_axis(C.trend(wider))[0] == "batch_size"
    path = tmp_path / "w.json"
    path.write_text(json.dumps(recs))
    assert C.main(["--trend", str(path), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "converge_trend_n2.png").exists()


def test_hybrid_screening_variants_split_the_parameters(ds):
    """The screen's hybrids: AdamW steps exactly one class of parameters (the Linear weights, or the
    embeddings / norms / biases) and Lion the other, each as the plain optimizer would."""
    from lioncub_ds import Lion

    cfg = C.make_cfg(**dict(TINY, steps=1))
    for on in ("matrices", "small"):
        model = C.build_model_for(cfg, seed=2)
        opt, fam, allreduce = C.build_variant(f"hybrid_adamw_{on}", model, 2, cfg, LRS)
        assert fam == "lion" and allreduce
        ref = C.build_model_for(cfg, seed=2)
        groups = ref.optim_groups(1.0)
        adamw_groups = [g for g in groups if (g["weight_decay"] > 0) == (on == "matrices")]
        lion_groups = [g for g in groups if (g["weight_decay"] > 0) != (on == "matrices")]
        wd = cfg["adamw_wd"] * LRS["adamw"] / LRS["lion"]
        ref_opts = [torch.optim.AdamW([{"params": g["params"], "weight_decay": cfg["adamw_wd"] if g["weight_decay"] else 0.0}
                                       for g in adamw_groups], lr=LRS["adamw"], betas=tuple(cfg["adamw_betas"])),
                    Lion([{"params": g["params"], "weight_decay": wd if g["weight_decay"] else 0.0} for g in lion_groups],
                         lr=LRS["lion"], betas=tuple(cfg["betas"]))]
        x, y = ds.get_batch("train", 2, cfg["seq_len"], 0, 1, step=0, seed=0)
        for m in (model, ref):
            m(x, y)[1].backward()
        opt.set_lr(LRS["lion"])
        opt.step()
        for o in ref_opts:
            o.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), (on, name)


def test_trend_pairs_with_global_lions_best_lr_per_shape(tmp_path):
    """--trend with global Lion at several lrs in one preset (an lr bracket per shape): the lr with
    the lowest mean loss over the seeds every lr has is the baseline, the gaps pair with its runs,
    the bracket is in the rows and the table; a bracket without a common seed is refused."""
    kw = dict(TINY, steps=2, eval_every=2)
    common = dict(world_sizes=(2,), verbose=False, ds=None, **kw)
    base, _, _ = C.run(("lion", "cub_1bit"), seeds=(0, 1), lrs=LRS, **common)
    high, _, _ = C.run(("lion",), seeds=(0, 1), lrs=dict(LRS, lion=30 * LRS["lion"]), **common)
    lion = {}
    for x in base + high:
        if x.get("bench") == "converge" and x["variant"] == "lion":
            lion.setdefault(x["lr"], {})[x["seed"]] = x["val_loss"]
    assert len(lion) == 2
    best = min(lion, key=lambda lr: sum(lion[lr].values()))
    (cub,) = [r for r in C.trend(base + high) if r["variant"] == "cub_1bit"]
    assert cub["lion_lr"] == best and cub["lion_lr_bracket"][2]["best"] == best
    assert cub["lion_lr_bracket"][2]["seeds"] == [0, 1]
    gaps = [100 * (x["val_loss"] / lion[best][x["seed"]] - 1) for x in base
            if x.get("bench") == "converge" and x["variant"] == "cub_1bit"]
    assert cub["gap_pct"] == pytest.approx(sum(gaps) / 2)
    table = C.trend_table(C.trend(base + high))
    assert "Global Lion's lr per shape" in table and f"**{best:g}: " in table
    apart, _, _ = C.run(("lion",), seeds=(5,), lrs=dict(LRS, lion=3 * LRS["lion"]), **common)
    with pytest.raises(SystemExit, match="no common seed"):
        C.trend(base + apart)


def test_partial_resumes_a_stopped_study(tmp_path):
    """--partial: the runs a stopped study appended are taken from the file, with their own curves
    (not run again, not appended again) when it is started again with the same settings; a run
    with any other setting that changes results (lr of any family, evaluation, tie rule, shape) is
    a new run; a line cut off mid-write is skipped and does not spoil the next one."""
    part = tmp_path / "study.jsonl"
    argv = ["--world-sizes", "2", "--variants", "lion", "cub_1bit", "--steps", "2", "--n-layer", "1",
            "--d-model", "32", "--seq-len", "16", "--batch-size", "2", "--eval-every", "2", "--eval-iters", "1",
            "--eval-batch", "2", "--partial", str(part)]

    def readable():
        out = []
        for x in part.read_text().splitlines():
            try:
                out.append(json.loads(x))
            except ValueError:
                pass
        return out

    def lines(bench):
        return [r for r in readable() if r["bench"] == bench]

    def out(name, bench="converge"):
        return [r for r in json.loads((tmp_path / name).read_text()) if r["bench"] == bench]

    assert C.main(argv + ["--seeds", "0", "--json", str(tmp_path / "a.json")]) == 0
    first = lines("converge")
    assert C.main(argv + ["--seeds", "0", "1", "--json", str(tmp_path / "b.json")]) == 0
    assert len(lines("converge")) == 4 and lines("converge")[:2] == first  # seed 0 kept, seed 1 run
    a = {r["variant"]: r for r in out("a.json")}
    assert all(r == a[r["variant"]] for r in out("b.json") if r["seed"] == 0)  # the kept runs, whole
    curves = lambda name, seed: sorted((c["variant"], c["step"], c["val_loss"]) for c in out(name, "converge_curve")  # noqa: E731
                                       if c["seed"] == seed)
    assert curves("b.json", 0) == curves("a.json", 0)  # with their own curves
    lion_lr = a["lion"]["lr"]
    for change in (["--lr", f"lion={2 * lion_lr}"], ["--lr", "adamw=1e-2"], ["--eval-iters", "2"],
                   ["--tie-break", "zero"], ["--d-model", "16"]):
        before = len(lines("converge"))
        assert C.main(argv + ["--seeds", "0", "--variants", "lion"] + change) == 0
        assert len(lines("converge")) == before + 1, change  # run again
    # a second lr of the same run, then both resumed: nothing new
    before = len(lines("converge"))
    assert C.main(argv + ["--seeds", "0", "--variants", "lion", "--lr", f"lion={2 * lion_lr}"]) == 0
    assert C.main(argv + ["--seeds", "0", "--variants", "lion"]) == 0
    assert len(lines("converge")) == before
    # a killed writer's last line: skipped, and the next run's lines stay readable
    with open(part, "a") as f:
        f.write('{"bench": "converge", "variant": "lio')
    assert C.main(argv + ["--seeds", "2", "--variants", "lion"]) == 0
    assert [r["seed"] for r in lines("converge")][-1] == 2
    assert len(part.read_text().splitlines()) == len(readable()) + 1  # only the cut line is unreadable


def test_lion_w150_is_the_lion_preset_with_a_longer_warmup():
    """The chosen preset differs from `lion` in its warm-up and its lrs (tuned again) only,
    and `lion` stays as its records ran (old presets stay reproducible); a run under it names it,
    with no 'changed' keys."""
    old, new = C.PROTOCOLS["lion"], C.PROTOCOLS["lion_w150"]
    assert old["settings"]["warmup"] == 30 and new["settings"]["warmup"] == 150
    assert {k: v for k, v in new["settings"].items() if k != "warmup"} == \
           {k: v for k, v in old["settings"].items() if k != "warmup"}
    assert old["lr"] == {"adamw": 4e-3, "lion": 1e-3, "cub": 1e-3, "avg": 2e-3, "bbit": 1e-3}
    assert new["lr"] == {"adamw": 8e-3, "lion": 2e-3, "cub": 2e-3, "avg": 4e-3, "bbit": 2e-3}
    args = C.apply_protocol(C.build_parser().parse_args(["--protocol", "lion_w150", "--seeds", "3"]))
    assert args.protocol_name == "lion_w150" and args.settings["warmup"] == 150 and args.seeds == [3]
    args = C.apply_protocol(C.build_parser().parse_args(["--protocol", "lion", "--warmup", "150"]))
    assert args.protocol_name == "lion (with warmup changed)"


def test_lion_w300_is_lion_w150_with_a_300_step_warmup():
    """lion_w300 differs from lion_w150 in the warm-up and the lrs only; Lion Cub at global Lion's lr."""
    old, new = C.PROTOCOLS["lion_w150"], C.PROTOCOLS["lion_w300"]
    assert new["settings"] == dict(old["settings"], warmup=300)
    assert new["lr"]["cub"] == new["lr"]["lion"] == 4e-3 and new["lr"]["adamw"] == old["lr"]["adamw"]
    args = C.apply_protocol(C.build_parser().parse_args(["--protocol", "lion_w300", "--seeds", "3"]))
    assert args.protocol_name == "lion_w300" and args.settings["warmup"] == 300


def test_dlion_comes_from_a_kept_cub_1bit(tmp_path, monkeypatch):
    """dlion (the same Δ as cub_1bit, other bytes) is derived from a cub_1bit that --partial kept,
    not trained again, and equals the dlion of a study that ran both at once."""
    argv = ["--world-sizes", "2", "--seeds", "0", "--steps", "2", "--n-layer", "1", "--d-model", "32",
            "--seq-len", "16", "--batch-size", "2", "--eval-every", "1", "--eval-iters", "1", "--eval-batch", "2"]
    assert C.main(argv + ["--variants", "cub_1bit", "dlion", "--json", str(tmp_path / "both.json")]) == 0
    part = tmp_path / "study.jsonl"
    assert C.main(argv + ["--variants", "cub_1bit", "--partial", str(part)]) == 0
    trained = []
    real_train_one = C.train_one
    # the study's own look-up of train_one (benchmarks/converge/study.py)
    monkeypatch.setattr(C.study, "train_one", lambda v, *a, **k: trained.append(v) or real_train_one(v, *a, **k))
    assert C.main(argv + ["--variants", "cub_1bit", "dlion", "--partial", str(part),
                          "--json", str(tmp_path / "resumed.json")]) == 0
    assert trained == []

    def dlion(name):
        recs = json.loads((tmp_path / name).read_text())
        (rec,) = [r for r in recs if r["bench"] == "converge" and r["variant"] == "dlion"]
        curve = [(c["step"], c["val_loss"], c["bytes_per_rank"]) for c in recs
                 if c["bench"] == "converge_curve" and c["variant"] == "dlion"]
        return {k: v for k, v in rec.items() if k != "wall_s"}, curve

    both, resumed = dlion("both.json"), dlion("resumed.json")
    assert resumed == both and both[0]["bytes_per_rank"] > 0 and len(both[1]) == 3
