"""``overlap=True`` under Megatron is refused, early and with the reason (issue 12).

Megatron's DDP accumulates gradients into ``main_grad`` buffers and its optimizer wrappers copy
them to the parameters LionCub steps (fp32 main parameters with bf16/fp16) inside
``optimizer.step()``, after unscaling and ``clip_grad``: no gradient-ready hook on those
parameters fires in backward, so overlap cannot be real there. The refusal must name the
setting, say why and what to use, and come before anything changed: the ``--lioncub-overlap``
flag in the one early Megatron-LM argument error, the ``lioncub`` settings in the factory
(real megatron-core DDP chunks on 2 gloo ranks: grad reduction still on, no optimizer built,
parameters untouched).
"""
from __future__ import annotations

import argparse
import importlib.util

import pytest
import torch

from dist_helpers import recording_optimizer_inits, run_ranks
from lioncub_ds import LionCubConfigError
from lioncub_ds.megatron import add_lioncub_args, lioncub_settings, lioncub_settings_from_args

pytestmark = pytest.mark.integration

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core not installed")
NEEDLES = ("overlap=True", "--lioncub-overlap", "main_grad", "inside optimizer.step()", "Use overlap=False")


@pytest.mark.unit
def test_overlap_setting_is_refused_with_the_reason():
    p = add_lioncub_args(argparse.ArgumentParser())
    assert lioncub_settings_from_args(p.parse_args([])) == {}  # unset: not in the settings at all
    settings = lioncub_settings_from_args(p.parse_args(["--lioncub-overlap"]))
    assert settings == {"overlap": True}
    for bad in (settings, {"comm": "1bit", "overlap": True}):
        with pytest.raises(LionCubConfigError) as info:
            lioncub_settings(bad)
        for needle in NEEDLES:
            assert needle in str(info.value), (needle, str(info.value))
    with pytest.raises(LionCubConfigError, match="overlap"):
        lioncub_settings(overlap=True)
    assert lioncub_settings({"overlap": False}) == {"overlap": False}


@pytest.mark.unit
def test_megatron_lm_flag_is_in_the_one_early_error():
    from test_megatron_training import GOOD, make_standins
    from lioncub_ds.megatron import training as lt
    lt.uninstall()
    calls = []
    s = make_standins(calls)
    lt.install(training=s.training, checkpointing=s.checkpointing, arguments=s.arguments, initialize=s.initialize)
    try:
        args = s.arguments.parse_args(argv=GOOD + ["--lioncub-overlap", "--use-distributed-optimizer"])
        with pytest.raises(lt.LionCubMegatronArgsError) as info:
            s.arguments.validate_args(args, {})
        msg = str(info.value)
        assert "--lioncub-overlap: Megatron hands the optimizer its gradients" in msg, msg
        assert "--use-distributed-optimizer" in msg  # listed together, in one message
        assert calls == []  # before Megatron's own validation, so before any model or process group
        assert lt.megatron_args_problems(s.arguments.parse_args(argv=GOOD)) == []
    finally:
        lt.uninstall()


def _refused_before_any_state(rank, world):
    from test_megatron import _build, _opt_config, _setup, _train_step
    from lioncub_ds.megatron import (MegatronLionCub, dp_grad_reduction_disabled, get_megatron_lioncub_optimizer,
                                     lioncub_optimizers)
    _setup(tp=1)
    _, ddp = _build(1)
    before = [p.detach().clone() for p in ddp.parameters()]
    out = {}
    with recording_optimizer_inits() as inits:
        try:
            get_megatron_lioncub_optimizer(_opt_config(), [ddp], lioncub={"comm": "1bit", "overlap": True})
            out["error"] = None
        except LionCubConfigError as exc:
            out["error"] = str(exc)
        try:  # the class itself, for code that builds it directly
            MegatronLionCub([p for p in ddp.parameters()], lr=1e-3, overlap=True)
            out["class_error"] = None
        except LionCubConfigError as exc:
            out["class_error"] = str(exc)
    out["inits"] = inits
    out["reduction_still_on"] = not dp_grad_reduction_disabled(ddp) and not any(
        "start_grad_sync" in vars(bg) for bg in list(ddp.bucket_groups) + list(ddp.expert_parallel_bucket_groups))
    out["params_untouched"] = all(torch.equal(a, b.detach()) for a, b in zip(before, ddp.parameters()))
    # the same chunks then train with overlap off (the default)
    opt = get_megatron_lioncub_optimizer(_opt_config(), [ddp], lioncub={"comm": "1bit"})
    _train_step(ddp, opt, 0)
    out["stepped"] = [lc.step_count for lc in lioncub_optimizers(opt)]
    return out


@needs_megatron
def test_factory_refuses_overlap_before_any_state_on_real_ddp_chunks():
    for r in run_ranks(_refused_before_any_state, 2, timeout=600):
        for key in ("error", "class_error"):
            assert r[key] is not None, (key, r)
            for needle in NEEDLES:
                assert needle in r[key], (key, needle, r[key])
        assert r["inits"] == [], r["inits"]  # no optimizer was constructed
        assert r["reduction_still_on"] and r["params_untouched"], r
        assert r["stepped"] == [1], r
