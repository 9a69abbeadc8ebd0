"""Distributed LionCub on real gloo ranks: votes vs a brute-force reference, identity across
ranks, equivalence with single-process Lion, momentum sync, telemetry formulas, resume."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import lioncub_ds
from lioncub_ds import checkpoint
from lioncub_ds.kernels import reference
from lioncub_ds.flags import flag_bytes, flag_words
from lioncub_ds.momentum_sync import geometric_steps
from dist_helpers import SmallNet as Net, run_ranks  # Net: odd sizes; embedding rows no rank uses

pytestmark = pytest.mark.dist

STEPS = 200
COMBOS = ([(c, v, t, "sign") for c in ("allgather", "1bit", "pbit") for v in ("majority", "average")
           for t in ("hash", "alternate", "zero")]
          + [("int8", "majority", "hash", q) for q in ("l1", "l0", "linf")]
          + [("auto", "majority", "hash", "sign")]
          + [("bbit", "majority", t, q) for t, q in (("hash", "l1"), ("zero", "linf"), ("alternate", "l0"))])
# comm="bbit": the code width and rounding of each combination above
BBIT = {("hash", "l1"): dict(vote_bits=2, rounding="dither"), ("zero", "linf"): dict(vote_bits=3, rounding="nearest"),
        ("alternate", "l0"): dict(vote_bits=1, rounding="dither")}
# Several small buckets (one of them holds only abstaining rows some steps): a few combinations suffice.
MULTI_BUCKET = {("1bit", "majority", "zero", "sign"), ("pbit", "average", "hash", "sign"), ("allgather", "majority", "alternate", "sign"),
                ("bbit", "majority", "hash", "l1")}


def _batch(gen, rank_data=True):
    idx = torch.randint(0, 6, (4, 3), generator=gen)  # rows 6..10 never used
    return idx, torch.randn(4, 3, generator=gen)


def _bucket_c(opt, b, grads, momenta):
    c = torch.zeros(b.numel)
    b1 = opt.param_groups[b.group_index]["betas"][0]
    for p, off in zip(b.params, b.offsets):
        c[off:off + p.numel()] = reference.lion_direction(momenta[p].reshape(-1), grads[p].reshape(-1), b1)
    return c


def _brute_force(opt, before, grads, momenta, n):
    """Expected parameters after one step, from every rank's fp32 c gathered with plain dist.all_gather."""
    cfg = opt.config
    expected = {p: before[p].clone() for p in before}
    local = torch.cat([_bucket_c(opt, b, grads, momenta) for b in opt.plan.buckets])
    gathered = [torch.zeros_like(local) for _ in range(n)]
    dist.all_gather(gathered, local)
    everyone = torch.stack(gathered)
    for b in opt.plan.buckets:
        g = opt.param_groups[b.group_index]
        c_all = everyone[:, b.base:b.base + b.numel]
        if cfg.quant == "sign":
            votes = torch.sign(c_all)
            plus = (votes > 0).sum(0)
            cnt = (votes != 0).sum(0)
            diff = 2 * plus - cnt
            if cfg.vote == "average":
                delta = diff.float() / n
            else:
                delta = torch.sign(diff).float()
                ties = (diff == 0) & (cnt > 0)
                # the tie rule keys on (step, index inside the parameter), whatever the bucket layout
                tie = torch.zeros(b.numel)
                for p, off in zip(b.params, b.offsets):
                    idx = torch.arange(p.numel(), dtype=torch.int64)
                    tie[off:off + p.numel()] = reference.tie_values(cfg.tie_break, opt.step_count + 1, [(0, 0)],
                                                                p.numel(), "cpu").float() \
                        if cfg.tie_break != "hash" else reference.tie_hash_sign(opt.step_count + 1, idx).float()
                delta = torch.where(ties, tie, delta)
        elif cfg.comm == "bbit":
            delta = _bbit_oracle(opt, b, c_all, n)
        else:
            q = torch.zeros(b.numel, dtype=torch.int32)
            levels = 127 // n
            for r in range(n):
                for p, off in zip(b.params, b.offsets):
                    cp = c_all[r, off:off + p.numel()]
                    q[off:off + p.numel()] += reference.int8_quantize(cp, reference.int8_scale(cp, cfg.quant), levels).to(torch.int32)
            assert int(q.abs().max()) <= 127  # the int8 sum can never have overflowed
            delta = torch.sign(q).float()
        lr, wd = g["lr"], g["weight_decay"]
        for p, off in zip(b.params, b.offsets):
            e = expected[p]
            if wd:
                e.mul_(1.0 - lr * wd)
            e.add_(delta[off:off + p.numel()].view_as(e).mul(-lr))
    return expected


def _bbit_oracle(opt, b, c_all, n):
    """comm="bbit" from every rank's fp32 c: each rank's codes (its own per-parameter scale and its own
    dither stream at the parameter-local index), Σ (2k − Q) over the ranks whose c != 0, then sign;
    Σ = 0 with a voter: the tie rule; no voter: 0."""
    cfg, step = opt.config, opt.step_count + 1
    bits, rounding = cfg.bbit
    m = reference.bbit_qmax(bits)
    total = torch.zeros(b.numel, dtype=torch.int64)
    voters = torch.zeros(b.numel, dtype=torch.int64)
    tie = torch.zeros(b.numel)
    for p, off in zip(b.params, b.offsets):
        idx = torch.arange(p.numel(), dtype=torch.int64)
        tie[off:off + p.numel()] = (reference.tie_hash_sign(step, idx).float() if cfg.tie_break == "hash" else
                                    reference.tie_values(cfg.tie_break, step, [(0, 0)], p.numel(), "cpu").float())
        for r in range(n):
            cp = c_all[r, off:off + p.numel()]
            votes = cp != 0
            ratio = reference.bbit_ratio(reference.int8_scale(cp, cfg.quant), cfg.quant, bits)
            u = reference.dither_uniform(reference.dither_seed(step, r), idx) if rounding == "dither" else None
            k = reference.bbit_codes(cp, ratio, bits, rounding, u).to(torch.int64)
            assert k.numel() == 0 or int(k.max()) <= m
            total[off:off + p.numel()] += torch.where(votes, 2 * k - m, 0)
            voters[off:off + p.numel()] += votes.to(torch.int64)
    delta = torch.sign(total).float()
    ties = (total == 0) & (voters > 0)
    return torch.where(ties, tie, delta)


def _votes_match_brute_force(rank, n):
    """Every combination: Δ equals the brute force at every step; replicas bit-identical."""
    report = {}
    runs = [(c, False) for c in COMBOS] + [(c, True) for c in sorted(MULTI_BUCKET)]
    for (comm, vote, tie, quant), multi in runs:
        torch.manual_seed(0)
        model = Net()
        opt = lioncub_ds.LionCub(model.named_parameters(), lr=3e-3, weight_decay=0.1, comm=comm, vote=vote,
                                 tie_break=tie, quant=quant, **BBIT.get((tie, quant), {}) if comm == "bbit" else {},
                                 bucket_size_mb=0.0004 if multi else 25.0)
        gen = torch.Generator().manual_seed(1000 + rank)
        mismatched = 0
        for step in range(STEPS):
            idx, y = _batch(gen)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(idx), y).backward()
            if step == 0:
                assert opt.plan is not None  # built now (the layout the brute force reads)
            before = {p: p.detach().clone() for p in model.parameters()}
            grads = {p: p.grad.clone() for p in model.parameters()}
            momenta = {p: opt.momenta.get(p).clone() for p in model.parameters()}
            expected = _brute_force(opt, before, grads, momenta, n)
            opt.step()
            mismatched += sum(not torch.equal(p.detach(), expected[p]) for p in model.parameters())
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        report[(comm, vote, tie, quant, multi)] = (mismatched, flat, [b.algorithm.name for b in opt.plan.buckets],
                                            opt.comm_stats()["cumulative"]["by_algorithm"])
    return report


@pytest.mark.parametrize("n", [2, 3, 4])
def test_votes_equal_brute_force_and_replicas_identical(n):
    reports = run_ranks(_votes_match_brute_force, n, timeout=900)
    for key in reports[0]:
        for r in range(n):
            assert reports[r][key][0] == 0, f"N={n} {key}: rank {r} deviated from the brute-force vote"
            assert torch.equal(reports[r][key][1], reports[0][key][1]), f"N={n} {key}: rank {r} differs from rank 0"
        algos = reports[0][key][2]
        assert (len(algos) > 1) == key[4], f"{key}: {len(algos)} buckets"
        if key[0] != "auto":
            assert set(algos) == {key[0]}
        else:
            assert set(algos) <= {"allgather", "1bit", "pbit"}
        assert key[0] == "auto" or reports[0][key][3].get(key[0], 0) > 0


def _same_data_as_lion(rank, n):
    out = []
    # bbit with 1-bit nearest codes: every rank sends the sign of its (equal) c
    for comm, extra in (("allgather", {}), ("1bit", {}), ("pbit", {}),
                        ("bbit", dict(quant="l1", vote_bits=1, rounding="nearest"))):
        torch.manual_seed(0)
        model = Net()
        ref = Net()
        ref.load_state_dict(model.state_dict())
        opt = lioncub_ds.LionCub(model.parameters(), lr=3e-3, weight_decay=0.1, comm=comm, **extra)
        lion = lioncub_ds.Lion(ref.parameters(), lr=3e-3, weight_decay=0.1)
        gen = torch.Generator().manual_seed(7)  # the same data on every rank
        for _ in range(60):
            idx, y = _batch(gen)
            for m, o in ((model, opt), (ref, lion)):
                o.zero_grad()
                torch.nn.functional.mse_loss(m(idx), y).backward()
                o.step()
        out.append(all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters())))
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_identical_data_reproduces_single_process_lion(n):
    for r, res in enumerate(run_ranks(_same_data_as_lion, n)):
        assert all(res), f"rank {r}: LionCub with identical data differs from Lion ({res})"


def _gathered_momenta(opt, model, n):
    """Every rank's flat momentum, in rank order."""
    m = torch.cat([opt.momenta.get(p).reshape(-1) for p in model.parameters()])
    g = [torch.zeros_like(m) for _ in range(n)]
    dist.all_gather(g, m)
    return g


def _sync_and_telemetry(rank, n):
    out = {}
    # every-K sync: equal right after a sync step, different between
    torch.manual_seed(0)
    model = Net()
    opt = lioncub_ds.LionCub(model.parameters(), lr=1e-3, comm="1bit", momentum_sync={"every": 5})
    gen = torch.Generator().manual_seed(50 + rank)
    equal_after = []
    for s in range(12):
        idx, y = _batch(gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(idx), y).backward()
        opt.step()
        g = _gathered_momenta(opt, model, n)
        equal_after.append(all(torch.equal(g[0], x) for x in g))
    out["every5"] = equal_after
    # two-level: node pairs every step, everyone every 3rd step
    if n == 4:
        torch.manual_seed(0)
        model = Net()
        opt = lioncub_ds.LionCub(model.parameters(), lr=1e-3, comm="pbit",
                                 momentum_sync={"group": "node", "group_size": 2, "every": 1, "inter_every": 3})
        pattern = []
        for s in range(4):
            idx, y = _batch(gen)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(idx), y).backward()
            opt.step()
            g = _gathered_momenta(opt, model, n)
            pattern.append((torch.equal(g[0], g[1]), torch.equal(g[2], g[3]), torch.equal(g[0], g[2])))
        out["node"] = pattern
    # layers: only fc2 synced
    torch.manual_seed(0)
    model = Net()
    opt = lioncub_ds.LionCub(model.named_parameters(), lr=1e-3, momentum_sync={"every": 1, "layers": ["fc2.*"]})
    idx, y = _batch(gen)
    torch.nn.functional.mse_loss(model(idx), y).backward()
    opt.step()
    layer_eq = {}
    for name, p in model.named_parameters():
        m = opt.momenta.get(p).reshape(-1).clone()
        g = [torch.zeros_like(m) for _ in range(n)]
        dist.all_gather(g, m)
        layer_eq[name] = all(torch.equal(g[0], x) for x in g)
    out["layers"] = layer_eq
    # telemetry: bytes per step for each algorithm, one bucket of P elements, no abstentions
    P = 1000
    tele = {}
    for comm in ("allgather", "1bit", "pbit", "int8"):
        w = torch.nn.Parameter(torch.zeros(P))
        opt = lioncub_ds.LionCub([w], lr=1e-3, comm=comm, quant="l1" if comm == "int8" else "sign")
        w.grad = torch.randn(P, generator=gen) + 0.01  # no exact zeros
        opt.step()
        tele[comm] = opt.comm_stats()["last_step"]
    out["telemetry"] = tele
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_momentum_sync_and_telemetry(n):
    res = run_ranks(_sync_and_telemetry, n)[0]
    assert res["every5"] == [s % 5 == 0 for s in range(12)]
    if n == 4:
        # step 0: inter (0 % 3 == 0); 1, 2: pairs only; 3: inter again
        assert res["node"] == [(True, True, True), (True, True, False), (True, True, False), (True, True, True)]
    assert res["layers"]["fc2.weight"] and res["layers"]["fc2.bias"]
    assert not res["layers"]["fc1.weight"]
    P = 1000
    padded = (P + 8 * n - 1) // (8 * n) * (8 * n)
    # the step's flags, int32 words: the non-finite count, then the rank counts of the head and per
    # bucket [overflow, abstains], two per word (flags.flag_words);
    # allgather and 1bit carry them in their first phase (to every rank), the others all-reduce them
    words = 4 * flag_words(1, n)
    assert flag_words(1, n) == 1 + (36 + 2 + 1) // 2  # 37 head entries (one a full word) + 2 per bucket
    control = {comm: (n - 1) * words if comm in ("allgather", "1bit") else 2 * (n - 1) * words // n
               for comm in ("allgather", "1bit", "pbit", "int8")}
    assert all(control[c] == flag_bytes(1, n, c in ("allgather", "1bit")) for c in control)
    p_lane = reference.lane_bits_for(n)
    lst = 4  # a small bucket's abstention list: the count alone (no rank abstains here)
    formulas = {"allgather": (n - 1) * (padded // 8 + lst),
                "1bit": (n - 1) * (padded // 8 // n + lst) + (n - 1) * (padded // 8 // n),
                "pbit": 2 * (n - 1) * (padded * p_lane // 8 + n * lst) // n,
                "int8": 2 * (n - 1) * padded // n}
    for comm, st in res["telemetry"].items():
        assert st["by_algorithm"][comm] == formulas[comm], comm
        assert st["by_algorithm"]["control"] == control[comm], comm
        assert st["bytes_sent"] == formulas[comm] + control[comm]
        assert st["fp32_allreduce_bytes"] == 2 * (n - 1) * 4 * P // n
        assert st["bf16_allreduce_bytes"] == 2 * (n - 1) * 2 * P // n
    onebit = res["telemetry"]["1bit"]["by_algorithm"]["1bit"]
    assert onebit <= 2 * (n - 1) / n * padded / 8 + (n - 1) * lst
    # 32x at scale; at P = 1000 the 4-byte count every rank sends weighs up to 3%
    assert res["telemetry"]["1bit"]["fp32_allreduce_bytes"] / onebit >= 29


@pytest.mark.unit
def test_geometric_schedule_matches_formula():
    import math
    for k in (1, 2, 3.5):
        steps = geometric_steps(k, 500)
        t, expect = 0, []
        for j in range(1000):
            if t >= 500:
                break
            expect.append(t)
            t += math.floor(2 ** (j / k))
        assert steps == expect
    assert geometric_steps(1, 20) == [0, 1, 3, 7, 15]


def _train(model, opt, gen, steps):
    for _ in range(steps):
        idx, y = _batch(gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(idx), y).backward()
        opt.step()


def _resume(rank, n, directory):
    def fresh():
        torch.manual_seed(0)
        m = Net()
        return m, lioncub_ds.LionCub(m.parameters(), lr=3e-3, weight_decay=0.1, comm="1bit", tie_break="alternate",
                                     momentum_sync={"every": 7})
    m1, o1 = fresh()
    _train(m1, o1, torch.Generator().manual_seed(rank), 100)
    m2, o2 = fresh()
    gen = torch.Generator().manual_seed(rank)
    _train(m2, o2, gen, 50)
    checkpoint.save(o2, directory)
    torch.save(m2.state_dict(), os.path.join(directory, f"model{rank}.pt"))
    gen_state = gen.get_state()
    m3, o3 = fresh()
    m3.load_state_dict(torch.load(os.path.join(directory, f"model{rank}.pt")))
    checkpoint.load(o3, directory)
    gen3 = torch.Generator()
    gen3.set_state(gen_state)
    _train(m3, o3, gen3, 50)
    return [torch.equal(a, b) for a, b in zip(m1.parameters(), m3.parameters())], o3.step_count


def test_save_resume_is_bit_identical():
    with tempfile.TemporaryDirectory() as d:
        for same, steps in run_ranks(_resume, 2, d):
            assert all(same) and steps == 100


# ----------------------------------------------------------------------------- NCCL contract: devices
STRAY_CASES = [dict(comm=c) for c in ("allgather", "1bit", "pbit", "auto")] + [
    dict(comm="int8", quant="l1"), dict(comm="1bit", momentum_sync={"every": 1}),
    dict(comm="pbit", drift_check_every=1), dict(comm="1bit", bucket_size_mb=0.0004)]


def _stray_default_device(rank, n, directory):
    """The step under a stray default device (meta): a tensor the library makes without device=
    reaches a collective on 'meta' instead of the parameters' device (under NCCL: a CPU tensor
    next to CUDA parameters), and the contract refuses it. Also checkpoint.load (issue 11, item 1)."""
    from lioncub_ds.testing import nccl_contract

    def under_meta(fn):
        err = None
        calls = len(nccl_contract.log())
        with nccl_contract.expecting_violation() as v:
            try:
                with nccl_contract.stray_default_device("meta"):
                    fn()
            except nccl_contract.NCCLContractError:
                raise
            except Exception as exc:  # noqa: BLE001 - a device mix-up torch itself refuses
                err = f"{type(exc).__name__}: {exc}".splitlines()[0]
        calls = len(nccl_contract.log()) - calls
        dist.barrier()
        return v.message, err, calls

    out = {"step": []}
    for kw in STRAY_CASES:
        torch.manual_seed(0)
        model = Net()
        opt = lioncub_ds.LionCub(model.named_parameters(), lr=1e-3, **kw)
        gen = torch.Generator().manual_seed(rank)
        _train(model, opt, gen, 2)  # state exists
        idx, y = _batch(gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(idx), y).backward()
        out["step"].append((kw,) + under_meta(opt.step))
    checkpoint.save(opt, directory)
    out["load"] = under_meta(lambda: checkpoint.load(opt, directory))
    return out


@pytest.fixture(scope="module")
def stray_run():
    with tempfile.TemporaryDirectory() as d:
        return run_ranks(_stray_default_device, 2, d, timeout=600)


def test_step_creates_no_collective_tensor_off_the_parameters_device(stray_run):
    for kw, msg, err, calls in stray_run[0]["step"]:
        # a vote (allgather / 1bit carry the flags in it; the others add a flag all-reduce)
        assert calls >= 1, f"{kw}: the step under the stray device issued no collective"
        assert msg is None and err is None, f"{kw}: {err or ''}\n{msg}"


def test_checkpoint_load_agreement_stays_on_the_parameters_device(stray_run):
    msg, err, calls = stray_run[0]["load"]
    assert calls >= 1 and msg is None and err is None, f"{err or ''}\n{msg}"


def _groups_in_step(rank, n):
    """Every process group LionCub needs exists after the constructor: none is created in step()."""
    from lioncub_ds.testing import nccl_contract
    out = {}
    for name, kw in (("plain", dict(comm="1bit")),
                     ("node_sync", dict(comm="pbit", momentum_sync={"group": "node", "group_size": 2, "every": 1,
                                                                    "inter_every": 2})),
                     ("timeout", dict(comm="allgather", timeout_s=60))):
        torch.manual_seed(0)
        model = Net()
        opt = lioncub_ds.LionCub(model.named_parameters(), lr=1e-3, **kw)
        gen = torch.Generator().manual_seed(rank)
        with nccl_contract.expecting_violation() as v:
            with nccl_contract.no_group_creation("inside LionCub.step()"):
                _train(model, opt, gen, 3)
        out[name] = v.message
        dist.barrier()
    return out


def test_no_process_group_is_created_inside_step():
    res = run_ranks(_groups_in_step, 2, timeout=300)
    for r, out in enumerate(res):
        bad = {k: v.splitlines()[:6] for k, v in out.items() if v}
        assert not bad, f"rank {r}: {bad}"
