"""``--lioncub-*`` command-line arguments for every LionCub setting (Megatron style).

``add_lioncub_args(parser)`` adds them (usable as Megatron-LM's ``extra_args_provider``);
``lioncub_settings_from_args(args)`` turns the parsed namespace into the ``lioncub`` dict of
:func:`lioncub_ds.megatron.get_megatron_lioncub_optimizer`. Settings left unset keep
LionCub's defaults. Values are validated by :class:`lioncub_ds.LionCubConfig` when the
optimizer is built (errors name the setting, the value and what is allowed).

The flags are made from the fields of :class:`lioncub_ds.LionCubConfig` (their type, choices and
help): every setting ``x_y`` is ``--lioncub-x-y``, except (tests/test_settings.py checks the list)

* ``lr`` and ``weight_decay``: Megatron's own ``--lr`` / ``--weight-decay`` (:data:`FROM_MEGATRON`);
* ``betas``: ``--lioncub-beta1`` and ``--lioncub-beta2`` (both or neither);
* ``network``: ``--lioncub-bandwidth-gbit`` and ``--lioncub-latency-us`` (one flag per key);
* ``momentum_sync``: ``--lioncub-momentum-sync-KEY`` per key of :class:`MomentumSyncConfig`, or all
  of it as one JSON object in ``--lioncub-momentum-sync``;
* switches (``overlap``, ``momentum_double_buffer``) take no value; ``foreach``
  takes true / false / auto.

Plus the integration flags, which are not optimizer settings: ``--lioncub-checkpoint-mode``,
``--lioncub-reshard``, ``--lioncub-keep-grad-allreduce``.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import fields

from ..config import NETWORK_HELP, NETWORK_KEYS, LionCubConfig, LionCubConfigError, MomentumSyncConfig
from ..config_text import plain
from .checkpoint import CHECKPOINT_MODES

# Settings whose value comes from Megatron's own flags (the dest of each).
FROM_MEGATRON = {"lr": "lr", "weight_decay": "weight_decay"}
# Settings with flags of their own shape (see the module docstring).
COMPOSITE = ("betas", "network", "momentum_sync")
# Megatron-specific help, where the setting's own help would mislead.
_HELP = {
    "overlap": "NOT SUPPORTED under Megatron (refused with the reason): votes cannot start during backward, "
               "because Megatron hands the optimizer its gradients (main_grad) only inside step(); votes start "
               "in step()",
    "voters": "rank (default): every data-parallel rank votes with its own full momentum; node: one voter per "
              "distributed-optimizer instance, needs --use-distributed-optimizer --num-distributed-optimizer-instances "
              "K (Megatron shards the parameters over each instance's DP/K ranks; see docs/megatron.md)",
    "node_size": "with --lioncub-voters node: ranks per instance, which must be DP/K (default: taken from the "
                 "instances); refused otherwise",
    "foreach": "single-process path: auto = the fused kernel of the device's backend (C++ / CUDA, one pass), "
               "true / false = torch foreach / single tensor (same bits)",
    "momentum_sync.every": "average momenta over the data-parallel group every K steps (enables momentum sync)",
    "momentum_sync.group": "world: the whole data-parallel group; node: data-parallel peers on the same node",
    "momentum_sync.group_size": "data-parallel peers per node for group=node (default: from LOCAL_WORLD_SIZE)",
    "momentum_sync.inter_every": "with group=node: every K' steps average across nodes (the whole data-parallel "
                                 "group) instead",
}


def _bool(text):
    t = str(text).lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    if t in ("none", "auto"):
        return None
    raise argparse.ArgumentTypeError(f"expected true/false/auto, got {text!r}")


def _plain(markdown: str) -> str:
    """The README's Markdown help as command-line text (argparse formats '%')."""
    return plain(markdown).replace("%", "%%")


def flag(name: str) -> str:
    return "--lioncub-" + name.replace("_", "-")


def _add(add, f, name: str, key: str) -> None:
    """One flag for the settings field ``f``, stored in ``args.lioncub_<name>`` (default None: unset)."""
    meta = f.metadata
    kw = {"default": None, "help": _HELP.get(key) or _plain(meta["help"])}
    typ = meta["type"]
    if typ is bool and f.default is False:
        kw["action"] = "store_true"        # a switch
    elif typ is bool:
        kw.update(type=_bool, metavar="{true,false,auto}")
    elif typ is list:
        kw["nargs"] = "+"
    else:
        kw["type"] = typ
        if meta["choices"] is not None:
            kw["choices"] = meta["choices"]
    add(flag(name), **kw)


def setting_flags() -> dict:
    """{setting or "momentum_sync.KEY" / "network.KEY": its flag}; betas' two flags under "betas"."""
    out = {}
    for f in fields(LionCubConfig):
        if f.name in FROM_MEGATRON:
            continue
        if f.name == "betas":
            out["betas"] = (flag("beta1"), flag("beta2"))
        elif f.name == "network":
            out.update({f"network.{k}": flag(k) for k in NETWORK_KEYS})
        elif f.name == "momentum_sync":
            out["momentum_sync"] = flag("momentum_sync")
            out.update({f"momentum_sync.{g.name}": flag(f"momentum_sync_{g.name}") for g in fields(MomentumSyncConfig)})
        else:
            out[f.name] = flag(f.name)
    return out


def add_lioncub_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("LionCub (communication-efficient distributed Lion)")
    a = g.add_argument
    for f in fields(LionCubConfig):
        if f.name in FROM_MEGATRON:
            continue
        if f.name == "betas":
            a("--lioncub-beta1", type=float, default=None,
              help="Lion β1 (default: --adam-beta1, or --lion-beta1 with --optimizer lion on Megatron-LM >= 0.18)")
            a("--lioncub-beta2", type=float, default=None, help="Lion β2 (momentum decay; default as for β1)")
        elif f.name == "network":
            for key in NETWORK_KEYS:
                a(flag(key), type=float, default=None, help=NETWORK_HELP[key])
        elif f.name == "momentum_sync":
            for sub in fields(MomentumSyncConfig):
                _add(a, sub, f"momentum_sync_{sub.name}", f"momentum_sync.{sub.name}")
            a("--lioncub-momentum-sync", default=None,
              help='momentum sync as one JSON object, e.g. \'{"group": "node", "every": 10, "inter_every": 100}\'')
        else:
            _add(a, f, f.name, f.name)
    # integration switches
    a("--lioncub-checkpoint-mode", choices=CHECKPOINT_MODES, default="per_rank",
      help="per_rank: every rank's momentum in its own file next to the checkpoint; sync: average momenta "
           "right before saving (Megatron keeps one replica per data-parallel group)")
    a("--lioncub-reshard", choices=("average", "error"), default="average",
      help="resume with another data-parallel size: average = every rank starts from the mean of the saved "
           "momenta; error = refuse")
    a("--lioncub-keep-grad-allreduce", action="store_true",
      help="baseline only: keep DDP's gradient all-reduce (all ranks then vote alike = global Lion)")
    return parser


def lioncub_settings_from_args(args) -> dict:
    """The ``lioncub`` settings dict from a namespace parsed with :func:`add_lioncub_args`."""
    out = {}
    for f in fields(LionCubConfig):
        if f.name in FROM_MEGATRON or f.name in COMPOSITE:
            continue
        value = getattr(args, "lioncub_" + f.name, None)
        if value is not None:
            out[f.name] = value
    b1, b2 = getattr(args, "lioncub_beta1", None), getattr(args, "lioncub_beta2", None)
    if (b1 is None) != (b2 is None):
        raise LionCubConfigError("LionCub: give both --lioncub-beta1 and --lioncub-beta2, or neither")
    if b1 is not None:
        out["betas"] = (b1, b2)
    net = {k: getattr(args, "lioncub_" + k) for k in NETWORK_KEYS if getattr(args, "lioncub_" + k, None) is not None}
    if net:
        out["network"] = net
    sync = {}
    text = getattr(args, "lioncub_momentum_sync", None)
    if text:
        try:
            sync = json.loads(text)
        except json.JSONDecodeError as exc:
            raise LionCubConfigError(f"LionCub: --lioncub-momentum-sync is not valid JSON ({exc}): {text!r}") from exc
        if not isinstance(sync, dict):
            raise LionCubConfigError(f"LionCub: --lioncub-momentum-sync must be a JSON object, got {text!r}")
    for key in (g.name for g in fields(MomentumSyncConfig)):
        value = getattr(args, "lioncub_momentum_sync_" + key, None)
        if value is not None:
            sync[key] = list(value) if key == "layers" else value
    if sync:
        out["momentum_sync"] = sync
    return out
