"""The sharding mode is decided once (issue 47): :func:`lioncub_ds.groups.resolve_strategy` turns the
settings, the vote group's size and the launcher's environment into one frozen
:class:`~lioncub_ds.groups.Strategy` (``opt.strategy``, carried by the topology), and
``make_sharding`` dispatches on it. No other module reads the ``voters`` / ``node_size`` settings:
the check below parses the package with ``ast``.

The DeepSpeed case where two deciders used to disagree (``voters: "node"`` whose node size resolves
to 1, bf16, stage 0) runs under the launcher in tests/test_deepspeed_node_voters.py."""
from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest

from lioncub_ds import LionCub, LionCubConfig, LionCubConfigError
from lioncub_ds.groups import (FLAT, INSTANCES, MASTER_ONLY, NODE_VOTERS, SINGLE, ShardGroups, Strategy, requested,
                               resolve_strategy)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lioncub_ds"

# The resolver, and the strategies that the resolved mode selects (they read the resolved sizes).
DECIDERS = {"groups.py", "sharding.py"}
SETTING_NAMES = {"voters", "node_size", "lioncub_voters", "lioncub_node_size", "node_voters", "shards_in_node"}
# What the settings are called where they are read: a LionCubConfig (cfg, config, x.config), a raw
# mapping (a ds_config's optimizer params, Megatron's lioncub dict, keyword arguments) or a parsed
# command line. Saved layouts and resolved topologies/strategies carry sizes too: reading those is fine.
SETTINGS_HOLDERS = {"cfg", "config", "settings", "params", "given", "raw", "args", "a", "kwargs", "options",
                    "lioncub", "opt_params"}


def _holder(node: ast.AST) -> str | None:
    """The last name of an expression (``self.optimizer.config`` -> ``config``)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _const(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def settings_reads(source: str) -> list[tuple[int, str]]:
    """(line, what) of every read of the voters / node_size settings in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr in SETTING_NAMES \
                and _holder(node.value) in SETTINGS_HOLDERS:
            found.append((node.lineno, f"{_holder(node.value)}.{node.attr}"))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and _const(node.slice) in SETTING_NAMES and _holder(node.value) in SETTINGS_HOLDERS:
            found.append((node.lineno, f"{_holder(node.value)}[{_const(node.slice)!r}]"))
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "get" and _const(node.args[0]) in SETTING_NAMES \
                    and _holder(f.value) in SETTINGS_HOLDERS:
                found.append((node.lineno, f"{_holder(f.value)}.get({_const(node.args[0])!r})"))
            elif isinstance(f, ast.Name) and f.id == "getattr" and len(node.args) >= 2 \
                    and _const(node.args[1]) in SETTING_NAMES and _holder(node.args[0]) in SETTINGS_HOLDERS:
                found.append((node.lineno, f"getattr({_holder(node.args[0])}, {_const(node.args[1])!r})"))
    return found


def test_the_check_finds_every_form_of_reading_the_settings():
    """The detector itself: each way the package used to decide the mode again is found; reads of a
    saved layout or of the resolved topology are not."""
    bad = '''
cfg.voters
self.optimizer.config.node_size
st.optimizer.config.shards_in_node
settings.get("voters")
params["node_size"]
getattr(a, "lioncub_voters", None)
optimizer.config.node_voters
'''
    assert len(settings_reads(bad)) == 7
    fine = '''
topology.node_size
t.strategy.node_voters
layout.get("voters")
node["node_size"]
row["node_size"]
{"voters": "node"}
'''
    assert settings_reads(fine) == []


def test_no_module_but_the_resolver_and_the_strategies_reads_voters_or_node_size():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() in DECIDERS:
            continue
        for line, what in settings_reads(path.read_text()):
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert not offenders, ("these modules decide the sharding mode again from the settings; read opt.strategy "
                           "(or lioncub_ds.groups.requested(settings) before the world is known):\n"
                           + "\n".join(offenders))


def test_the_config_no_longer_derives_the_mode():
    for name in ("node_voters", "shards_in_node"):
        assert not hasattr(LionCubConfig, name), name


# ----------------------------------------------------------------------------- the resolver
def cfg(**kw):
    return LionCubConfig.from_kwargs(lr=1e-3, **kw)


@pytest.mark.parametrize("settings, ranks, want", [
    (dict(), 8, Strategy(FLAT, 8, 8)),
    (dict(node_size=1), 8, Strategy(FLAT, 8, 8)),
    (dict(node_size=4), 8, Strategy(MASTER_ONLY, 8, 8, 4)),
    (dict(voters="node", node_size=4), 8, Strategy(NODE_VOTERS, 8, 2, 4)),
    (dict(voters="node", node_size=8), 8, Strategy(NODE_VOTERS, 8, 1, 8)),
    # one rank per node group: every rank is a voter, which is flat voting (nothing to shard)
    (dict(voters="node", node_size=1), 8, Strategy(FLAT, 8, 8)),
])
def test_resolve_strategy(settings, ranks, want):
    assert resolve_strategy(cfg(**settings), ranks) == want


def test_node_voters_take_the_launchers_ranks_per_node(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "2")  # the deepspeed launcher's variable
    assert resolve_strategy(cfg(voters="node"), 6) == Strategy(NODE_VOTERS, 6, 3, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # torchrun's wins
    assert resolve_strategy(cfg(voters="node"), 6) == Strategy(NODE_VOTERS, 6, 2, 3)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("LOCAL_SIZE")
    with pytest.raises(ValueError, match="node_size=None takes the ranks per node from LOCAL_WORLD_SIZE"):
        resolve_strategy(cfg(voters="node"), 6)
    # voters='rank' never asks the environment
    assert resolve_strategy(cfg(), 6) == Strategy(FLAT, 6, 6)


def test_a_node_size_that_does_not_divide_the_ranks_is_named():
    with pytest.raises(ValueError, match=r"node_size=4 does not divide the 6 ranks"):
        resolve_strategy(cfg(voters="node", node_size=4), 6)
    with pytest.raises(ValueError, match=r"node_size=4 does not divide the 6 ranks"):
        resolve_strategy(cfg(node_size=4), 6)


def test_shard_groups_are_the_layout():
    sg = ShardGroups(shard=None, peers=None, world=None, shard_size=4, shard_rank=1, groups=3, group_index=0)
    assert resolve_strategy(cfg(), 12, sg) == Strategy(INSTANCES, 12, 3)


@pytest.mark.parametrize("settings, mode, node_size", [
    ({}, FLAT, None),
    ({"voters": "rank", "node_size": 1}, FLAT, 1),
    ({"node_size": 2}, MASTER_ONLY, 2),
    ({"voters": "node"}, NODE_VOTERS, None),
    ({"voters": "node", "node_size": 8}, NODE_VOTERS, 8),
])
def test_requested_reads_every_form_of_the_settings(settings, mode, node_size):
    """A ds_config's params (a dict), a LionCubConfig and Megatron's parsed flags ask the same."""
    ns = argparse.Namespace(**{f"lioncub_{k}": v for k, v in settings.items()})
    for form in (settings, cfg(**settings), ns):
        r = requested(form)
        assert (r.mode, r.node_size) == (mode, node_size), form


def test_a_lioncub_not_distributed_is_single_and_the_strategy_is_frozen():
    import torch
    opt = LionCub([torch.nn.Parameter(torch.zeros(3))], lr=1e-3, voters="node", node_size=2)
    assert opt.strategy == SINGLE == Strategy(FLAT, 1, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opt.strategy.mode = NODE_VOTERS


def test_invalid_voter_settings_name_the_setting_before_anything_exists():
    with pytest.raises(LionCubConfigError, match=r"invalid voters='nodes'; allowed: 'rank' \| 'node'"):
        cfg(voters="nodes")
    with pytest.raises(LionCubConfigError, match=r"invalid node_size=0; allowed: None \(LOCAL_WORLD_SIZE\)"):
        cfg(voters="node", node_size=0)
    with pytest.raises(LionCubConfigError, match="momentum_sync group='node' has nothing to average"):
        cfg(voters="node", momentum_sync={"every": 10, "group": "node"})
