"""Settings that must match across ranks are agreed at construction (issue 22, section 2, item 2).

A setting that differs on one rank used to make gloo abort, a collective time out, flags be read
from mismatched buffers, or replicas diverge silently. Now one small all-gather at construction
compares them, and every rank raises the same LionCubConfigError naming the setting and each
rank's value. One launch per world size runs every case (process start-up dominates the cost).
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from lioncub_ds import LionCub
from lioncub_ds.config import LionCubConfig, LionCubConfigError, MomentumSyncConfig
from dist_helpers import recording_optimizer_inits, run_ranks

pytestmark = pytest.mark.dist  # real gloo ranks

ENV = {"LIONCUB_KERNELS": "torch"}
SHAPES = ((4, 5), (7,), (3, 2))

# setting -> (its value on every rank but the last, its value on the last rank); the base
# settings fix comm (so "comm" is the only difference in its own case).
CASES = {
    "tie_break": ("hash", "zero"),
    "vote": ("majority", "average"),
    "bucket_size_mb": (25.0, 0.0001),
    "overlap": (False, True),
    "comm": ("1bit", "pbit"),
    "momentum_sync": (None, {"every": 2}),
    "lr": (0.01, 0.02),
    "weight_decay": (0.0, 0.1),
    "parameters": (SHAPES, ((4, 5), (7,), (3, 3))),
}
BASE = dict(lr=0.01, comm="1bit")


def _make(rank, world_size, setting, values, process_group=None):
    value = values[1] if rank == world_size - 1 else values[0]
    shapes = value if setting == "parameters" else SHAPES
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    kw = dict(BASE)
    if setting != "parameters":
        kw[setting] = value
    return LionCub(params, process_group=process_group, **kw)


def _attempt(fn):
    """(error type, message, seconds, optimizer inits) of one construction."""
    t0 = time.perf_counter()
    with recording_optimizer_inits() as inits:
        try:
            fn()
            err = None
        except Exception as exc:  # noqa: BLE001 - the test compares type and message
            err = (type(exc).__name__, str(exc))
    return err, time.perf_counter() - t0, list(inits)


def _make_named(rank, world_size, case):
    """Two same-shaped parameters, named: in another order on the last rank ("param_order"), or
    passed without names there ("names_on_some_ranks": nothing to compare it with, accepted)."""
    torch.manual_seed(0)
    named = [(nm, torch.nn.Parameter(torch.randn(4, 5))) for nm in ("a.weight", "b.weight")]
    last = rank == world_size - 1
    if case == "param_order" and last:
        named = named[::-1]
    params = [p for _, p in named] if case == "names_on_some_ranks" and last else named
    return LionCub(params, **BASE)


def _mismatch_scenario(rank, world_size, cases):
    out = {}
    for setting in cases:
        out[setting] = _attempt(lambda: _make(rank, world_size, setting, CASES[setting]))
    for case in ("param_order", "names_on_some_ranks"):
        out[case] = _attempt(lambda: _make_named(rank, world_size, case))
    # The same check when the vote group is set later (DeepSpeed and Megatron call
    # set_process_group): constructed over a group of one rank (nothing to agree), then the world.
    singles = [dist.new_group([r]) for r in range(world_size)]
    opt = _make(rank, world_size, "tie_break", CASES["tie_break"], process_group=singles[rank])
    out["set_process_group"] = _attempt(lambda: opt.set_process_group(None))
    dist.barrier()  # nobody is left behind in a collective
    return out


@pytest.fixture(scope="module")
def mismatch_n2():
    return run_ranks(_mismatch_scenario, 2, list(CASES), timeout=240, env=ENV)


@pytest.fixture(scope="module")
def mismatch_n3():
    return run_ranks(_mismatch_scenario, 3, ["tie_break", "parameters"], timeout=240, env=ENV)


def _shown(setting, value):
    """How the error shows a value (momentum_sync: its validated form)."""
    return repr(MomentumSyncConfig.from_value(value) if setting == "momentum_sync" else value)


def _check_error(res, setting, values, world_size, named=None):
    for r in range(world_size):
        err, seconds, inits = res[r][setting]
        assert err is not None, f"rank {r}: no error for {setting} differing on one rank"
        kind, msg = err
        assert kind == "LionCubConfigError", msg
        assert inits == [], "an optimizer was constructed before the error"
        assert seconds < 20, f"rank {r} took {seconds:.1f} s to raise (a timeout, not an agreement)"
        assert msg == res[0][setting][0][1], "every rank raises the same message"
        assert (named or setting) in msg
        for v in values:
            assert _shown(setting, v) in msg, (v, msg)
    return res[0][setting][0][1]


@pytest.mark.parametrize("setting", [s for s in CASES if s != "parameters"])
def test_a_setting_differing_on_one_rank_raises_on_every_rank(mismatch_n2, setting):
    values = CASES[setting]
    msg = _check_error(mismatch_n2, setting, values, 2)
    line = next(x for x in msg.splitlines() if x.strip().startswith(setting))
    assert f"rank 0: {_shown(setting, values[0])}" in line and f"rank 1: {_shown(setting, values[1])}" in line, line


def test_a_parameter_shape_differing_on_one_rank_raises_on_every_rank(mismatch_n2):
    msg = _check_error(mismatch_n2, "parameters", [], 2)
    assert "entry 2" in msg and "rank 0: group 0 #2: shape (3, 2)" in msg and "rank 1: group 0 #2: shape (3, 3)" in msg


def test_named_parameters_in_another_order_on_one_rank_raise_on_every_rank(mismatch_n2, mismatch_n3):
    # the same shapes in the same order (the layout agrees): only the names tell them apart
    msg = _check_error(mismatch_n2, "param_order", [], 2, named="param_names")
    assert "entry 0: rank 0: group 0 'a.weight'; rank 1: group 0 'b.weight'" in msg, msg
    msg = _check_error(mismatch_n3, "param_order", [], 3, named="param_names")
    assert "ranks 0, 1: group 0 'a.weight'; rank 2: group 0 'b.weight'" in msg, msg
    for res, n in ((mismatch_n2, 2), (mismatch_n3, 3)):  # names on some ranks only: the named ranks agree
        assert all(res[r]["names_on_some_ranks"][0] is None for r in range(n)), res


def test_set_process_group_agrees_too(mismatch_n2):
    msg = _check_error(mismatch_n2, "set_process_group", CASES["tie_break"], 2, named="tie_break")
    assert "tie_break: rank 0: 'hash'; rank 1: 'zero'" in msg


def test_three_ranks_name_each_rank_value(mismatch_n3):
    msg = _check_error(mismatch_n3, "tie_break", CASES["tie_break"], 3)
    assert "ranks 0, 1: 'hash'; rank 2: 'zero'" in msg, msg
    msg = _check_error(mismatch_n3, "parameters", [], 3)
    assert "ranks 0, 1: group 0 #2: shape (3, 2)" in msg and "rank 2: group 0 #2: shape (3, 3)" in msg, msg


# ----------------------------------------------------------------------------- identical settings
def _identical_scenario(rank, world_size):
    from lioncub_ds.testing import nccl_contract
    import lioncub_ds.optimizer as optimizer_module

    def train(make):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
        mark = len(nccl_contract.log())
        opt = make(params)
        calls = nccl_contract.log()[mark:]
        stats = opt.comm_stats()["cumulative"]["collectives"]
        for k in range(3):
            g = torch.Generator().manual_seed(100 * rank + k)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        return [p.detach().clone() for p in params], calls, stats

    make = lambda ps: LionCub(ps, lr=0.01, weight_decay=0.1, comm="pbit", tie_break="hash")  # noqa: E731
    agreed, calls, stats = train(make)
    # the same run without the agreement: the step's results do not depend on it
    original = getattr(optimizer_module, "agree_settings", None)
    optimizer_module.agree_settings = lambda *a, **k: None
    try:
        plain, calls_without, _ = train(make)
    finally:
        if original is None:
            del optimizer_module.agree_settings
        else:
            optimizer_module.agree_settings = original
    return dict(agreed=agreed, plain=plain, calls=calls, calls_without=calls_without, stats=stats)


def test_identical_settings_cost_one_collective_and_train_as_before():
    res = run_ranks(_identical_scenario, 2, timeout=240, env=ENV)
    for r in range(2):
        calls = res[r]["calls"]
        assert len(calls) == 1 and calls[0][0] == "all_gather" and calls[0][2] == "torch.int64", calls
        assert res[r]["calls_without"] == []
        assert res[r]["stats"] == 0  # construction is not counted in comm_stats (docs/conventions.md)
        for a, b in zip(res[r]["agreed"], res[r]["plain"]):
            assert torch.equal(a, b)
    for a, b in zip(res[0]["agreed"], res[1]["agreed"]):
        assert torch.equal(a, b)  # replicas identical


@pytest.mark.unit
def test_every_setting_is_agreed_or_declared_local():
    from lioncub_ds.agreement import AGREED_FIELDS, LOCAL_FIELDS
    assert sorted(AGREED_FIELDS + LOCAL_FIELDS) == sorted(LionCubConfig.keys())
    assert issubclass(LionCubConfigError, ValueError)
