"""One source of settings (issue 21): the fields of :class:`lioncub_ds.LionCubConfig` (with their
type, default, choices and help) name every LionCub setting, and every entry point names the same
set: the constructor's keywords, the ds_config ``optimizer.params`` keys, Megatron's ``--lioncub-*``
flags (made from the fields) and the README's argument table (made from the fields).

Documented exceptions, and nothing else:
* ``process_group``: a constructor argument, not a setting (integrations set it; the README lists it);
* ds_config: ``zero_allgather`` / ``zero_fp32_replica`` (integration options) and ``eps`` (ignored);
* Megatron: ``lr`` / ``weight_decay`` come from Megatron's own ``--lr`` / ``--weight-decay``; ``betas``,
  ``network`` and ``momentum_sync`` have flags of their own shape (lioncub_ds/megatron/args.py).
"""
from __future__ import annotations

import argparse
import inspect
import re
from dataclasses import fields
from pathlib import Path

import pytest

from lioncub_ds import LionCub, LionCubConfig
from lioncub_ds import config_doc
from lioncub_ds.config import CONSTRUCTOR_ONLY, NETWORK_KEYS, SYNC_KEYS, MomentumSyncConfig
from lioncub_ds.megatron import args as margs

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = set(LionCubConfig.keys())
INTEGRATION_FLAGS = {"--lioncub-checkpoint-mode", "--lioncub-reshard", "--lioncub-keep-grad-allreduce"}


def _parser():
    return margs.add_lioncub_args(argparse.ArgumentParser())


def _lioncub_flags(parser) -> set:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--lioncub-")}


def test_every_field_carries_its_metadata():
    for cls in (LionCubConfig, MomentumSyncConfig):
        for f in fields(cls):
            meta = f.metadata
            assert meta.get("type") is not None and meta.get("help"), f"{cls.__name__}.{f.name}: no type / help"
            assert meta.get("choices") or meta.get("allowed"), f"{cls.__name__}.{f.name}: nothing says what is allowed"
            assert "|" not in meta["help"], f"{f.name}: a '|' would break the README table"
    assert {f.name for f in fields(MomentumSyncConfig)} == set(SYNC_KEYS)


def test_each_setting_declares_whether_the_ranks_must_agree_on_it():
    """Whether a setting must match across ranks is declared with the setting (agree=, why=), and
    the agreement's tuples are made from those declarations; a setting that does not say is
    refused where it is declared."""
    from dataclasses import dataclass
    from lioncub_ds import agreement
    from lioncub_ds.config import AGREE_GROUPS, AGREE_KINDS, AGREE_LOCAL, AGREE_RANKS, _check_declarations, setting
    for f in fields(LionCubConfig):
        assert f.metadata["agree"] in AGREE_KINDS and f.metadata["why"], f.name
    assert agreement.AGREED_FIELDS == LionCubConfig.agreement(AGREE_RANKS)
    assert agreement.GROUP_SETTINGS == LionCubConfig.agreement(AGREE_GROUPS) == ("lr", "betas", "weight_decay")
    assert set(agreement.LOCAL_FIELDS) == set(LionCubConfig.agreement(AGREE_LOCAL)) | set(agreement.GROUP_SETTINGS)

    @dataclass(frozen=True)
    class Undeclared:
        x: int = setting(1, type=int, allowed="int", help="a setting that does not say")

    with pytest.raises(TypeError, match="agree="):
        _check_declarations(Undeclared)


def test_constructor_keywords_are_the_settings():
    sig = inspect.signature(LionCub.__init__)
    names = {n for n, p in sig.parameters.items()
             if n not in ("self", "params") and p.kind is not inspect.Parameter.VAR_KEYWORD}
    assert names == SETTINGS | set(CONSTRUCTOR_ONLY)
    # each default is the field's default (network: None there = the default network)
    cfg = LionCubConfig()
    for name in SETTINGS - {"network"}:
        assert sig.parameters[name].default == getattr(cfg, name), name
    doc = inspect.getdoc(LionCub)
    missing = [n for n in names if not re.search(rf"\b{n}\b", doc)]
    assert not missing, f"LionCub's docstring does not describe {missing}"


def test_ds_config_keys_are_the_settings():
    engine = pytest.importorskip("lioncub_ds.deepspeed.engine", reason="lioncub_ds.deepspeed not importable")
    from lioncub_ds import LionCubConfigError
    with pytest.raises(LionCubConfigError) as info:
        engine.split_params({"no_such_setting": 1})
    allowed = set(re.search(r"allowed keys: (.*)$", str(info.value)).group(1).split(", "))
    assert allowed == SETTINGS | set(engine.INTEGRATION_KEYS) | set(engine.IGNORED_KEYS)
    assert set(engine.INTEGRATION_KEYS) == {"zero_allgather", "zero_fp32_replica"} and engine.IGNORED_KEYS == ("eps",)


def test_cli_flags_are_the_settings():
    flags = margs.setting_flags()
    assert set(margs.FROM_MEGATRON) == {"lr", "weight_decay"}
    from lioncub_ds.megatron.optimizer import _FROM_MEGATRON
    assert set(_FROM_MEGATRON) == set(margs.FROM_MEGATRON) | set(CONSTRUCTOR_ONLY)  # refused as lioncub settings
    top = {k.split(".")[0] for k in flags}
    assert top == SETTINGS - set(margs.FROM_MEGATRON)
    for name in SETTINGS - set(margs.FROM_MEGATRON) - set(margs.COMPOSITE):
        assert flags[name] == "--lioncub-" + name.replace("_", "-")
    assert {k for k in flags if k.startswith("network.")} == {f"network.{k}" for k in NETWORK_KEYS}
    assert {k for k in flags if k.startswith("momentum_sync.")} == {f"momentum_sync.{k}" for k in SYNC_KEYS}
    made = set()
    for v in flags.values():
        made |= set(v) if isinstance(v, tuple) else {v}
    assert _lioncub_flags(_parser()) == made | INTEGRATION_FLAGS


def _samples(f):
    """(argv tail, the value the settings dict gets) for every kind of value the field takes."""
    meta = f.metadata
    if meta["type"] is bool and f.default is False:
        return [([], True)]
    if meta["type"] is bool:
        return [(["true"], True), (["false"], False), (["auto"], None)]
    if meta["type"] is list:
        return [(["*attn*", "*mlp*"], ["*attn*", "*mlp*"])]
    if meta["choices"]:
        return [([str(c)], c) for c in meta["choices"]]
    return [(["3"], meta["type"]("3"))]


@pytest.mark.parametrize("name", sorted(SETTINGS - {"lr", "weight_decay", "betas", "network", "momentum_sync"}))
def test_each_flag_sets_its_setting(name):
    parser = _parser()
    f = next(f for f in fields(LionCubConfig) if f.name == name)
    assert margs.lioncub_settings_from_args(parser.parse_args([])) == {}
    for tail, value in _samples(f):
        got = margs.lioncub_settings_from_args(parser.parse_args([margs.flag(name)] + tail))
        assert got == ({} if value is None else {name: value}), (tail, got)
    if f.metadata["choices"] and f.metadata["type"] is not bool:
        with pytest.raises(SystemExit):
            parser.parse_args([margs.flag(name), "not-a-choice"])


@pytest.mark.parametrize("key", SYNC_KEYS)
def test_each_momentum_sync_flag_sets_its_key(key):
    f = next(f for f in fields(MomentumSyncConfig) if f.name == key)
    for tail, value in _samples(f):
        got = margs.lioncub_settings_from_args(_parser().parse_args([margs.flag("momentum_sync_" + key)] + tail))
        assert got == {"momentum_sync": {key: value}}


def test_bbit_settings_from_the_command_line():
    args = _parser().parse_args(["--lioncub-comm", "bbit", "--lioncub-quant", "l1", "--lioncub-vote-bits", "3",
                                 "--lioncub-rounding", "nearest",
                                 "--lioncub-comm-bucket-mb", "2", "--lioncub-latency-us", "5"])
    settings = margs.lioncub_settings_from_args(args)
    cfg = LionCubConfig.from_kwargs(**settings)
    assert (cfg.comm, cfg.quant, cfg.bbit) == ("bbit", "l1", (3, "nearest"))
    assert cfg.comm_bucket_mb == 2.0 and cfg.network == {"bandwidth_gbit": 10.0, "latency_us": 5.0}


def test_readme_table_is_made_from_the_fields():
    readme = ROOT / "README.md"
    assert config_doc.main(["--check", str(readme)]) == 0, \
        "README's LionCub arguments table is out of date: run python -m lioncub_ds.config_doc README.md"
    text = readme.read_text(encoding="utf-8")
    for name in SETTINGS | set(CONSTRUCTOR_ONLY):
        assert f"| `{name}` |" in text
    after = text[text.index(config_doc.HEADING):]
    for key in SYNC_KEYS:  # the momentum_sync keys are described in the prose below the table
        assert f"`{key}`" in after, key


def test_readme_check_notices_drift(tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    stale = tmp_path / "README.md"
    stale.write_text(readme.replace("| `vote_bits` |", "| `vote_bitz` |"), encoding="utf-8")
    assert config_doc.main(["--check", str(stale)]) == 1
    assert config_doc.main([str(stale)]) == 0 and stale.read_text(encoding="utf-8") == readme


def test_a_validated_config_is_taken_as_is():
    """Integrations validate once and hand the LionCubConfig over: the constructor keeps that very
    object (no second validation), and refuses a setting keyword beside it."""
    import torch
    from lioncub_ds import LionCubConfigError
    cfg = LionCubConfig.from_kwargs(lr=3e-3, betas=(0.95, 0.98), weight_decay=0.1, comm="1bit")
    p = torch.nn.Parameter(torch.zeros(5))
    opt = LionCub([p], config=cfg)
    assert opt.config is cfg
    assert opt.param_groups[0]["lr"] == 3e-3 and opt.param_groups[0]["betas"] == (0.95, 0.98)
    with pytest.raises(LionCubConfigError, match=r"config=\.\.\. carries every setting; also given: lr, vote"):
        LionCub([p], config=cfg, lr=1e-3, vote="average")
    with pytest.raises(TypeError, match="config must be a LionCubConfig"):
        LionCub([p], config={"lr": 1e-3})


@pytest.mark.unit
def test_a_tiny_geometric_k_gives_a_schedule_instead_of_an_overflow():
    """k far below 1 makes 2**(j/k) pass float range after a few syncs: the schedule stops there
    (every later gap is beyond any step), instead of an OverflowError after the step's apply."""
    from lioncub_ds.config import LionCubConfig
    from lioncub_ds.momentum_sync import geometric_steps, on_schedule
    cfg = LionCubConfig.from_kwargs(momentum_sync={"schedule": "geometric", "k": 1e-4}).momentum_sync
    assert [s for s in range(10) if on_schedule(cfg, s)] == [0, 1]
    assert geometric_steps(1e-4, 10**6) == [0, 1]
    assert geometric_steps(1.0, 40) == [0, 1, 3, 7, 15, 31]
