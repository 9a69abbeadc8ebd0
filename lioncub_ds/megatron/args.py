"""``--lioncub-*`` command-line arguments for every LionCub setting (Megatron style).

``add_lioncub_args(parser)`` adds them (usable as Megatron-LM's ``extra_args_provider``);
``lioncub_settings_from_args(args)`` turns the parsed namespace into the ``lioncub`` dict of
:func:`lioncub_ds.megatron.get_megatron_lioncub_optimizer`. Settings left unset keep
LionCub's defaults; lr and weight decay come from Megatron's own ``--lr`` /
``--weight-decay``. Values are validated by :class:`lioncub_ds.LionCubConfig` when the
optimizer is built (errors name the setting, the value and what is allowed).
"""
from __future__ import annotations

import argparse
import json

from ..config import (COMM_ALGORITHMS, DRIFT_ACTIONS, NONFINITE_POLICIES, QUANTS, SYNC_GROUPS, SYNC_SCHEDULES,
                      TIE_RULES, VOTES, LionCubConfigError)
from .checkpoint import CHECKPOINT_MODES


def _bool(text):
    t = str(text).lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    if t in ("none", "auto"):
        return None
    raise argparse.ArgumentTypeError(f"expected true/false/auto, got {text!r}")


def add_lioncub_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("LionCub (communication-efficient distributed Lion)")
    a = g.add_argument
    a("--lioncub-vote", choices=VOTES, default=None, help="majority: Δ = sign(Σ votes); average: Δ = mean of votes")
    a("--lioncub-comm", choices=COMM_ALGORITHMS, default=None,
      help="vote collective: auto (α-β cost model) | allgather | 1bit (two-phase sharded) | pbit | int8")
    a("--lioncub-quant", choices=QUANTS, default=None, help="sign (1-bit votes) or l1/l0/linf (int8 scaled votes)")
    a("--lioncub-tie-break", choices=TIE_RULES, default=None, help="even-N tie rule")
    a("--lioncub-beta1", type=float, default=None,
      help="Lion β1 (default: --adam-beta1, or --lion-beta1 with --optimizer lion on Megatron-LM >= 0.18)")
    a("--lioncub-beta2", type=float, default=None, help="Lion β2 (momentum decay; default as for β1)")
    a("--lioncub-momentum-dtype", choices=("fp32", "bf16"), default=None, help="momentum storage dtype")
    a("--lioncub-bucket-size-mb", type=float, default=None, help="MB of fp32 parameters per vote bucket")
    a("--lioncub-pbit-bits", type=int, choices=(1, 2, 4, 8), default=None, help="force the pbit lane width")
    a("--lioncub-bandwidth-gbit", type=float, default=None, help="network bandwidth for comm=auto's cost model")
    a("--lioncub-latency-us", type=float, default=None, help="per-message latency for comm=auto's cost model")
    a("--lioncub-nonfinite", choices=NONFINITE_POLICIES, default=None,
      help="NaN/Inf gradient on any rank: skip the step everywhere, or raise")
    a("--lioncub-drift-check-every", type=int, default=None, help="compare parameter checksums every K steps (0=off)")
    a("--lioncub-drift-action", choices=DRIFT_ACTIONS, default=None, help="on drift: raise, or resync from rank 0")
    a("--lioncub-timeout-s", type=float, default=None, help="vote collective timeout in seconds")
    a("--lioncub-foreach", type=_bool, default=None, help="single-rank path: use foreach kernels (true/false/auto)")
    a("--lioncub-overlap", action="store_true", default=None,
      help="NOT SUPPORTED under Megatron (refused with the reason): votes cannot start during backward, because "
           "Megatron hands the optimizer its gradients (main_grad) only inside step(); votes start in step()")
    a("--lioncub-momentum-double-buffer", action="store_true", default=None,
      help="+4 bytes/parameter: the local pass writes the next momentum into a second buffer, saving the "
           "separate momentum pass over g and m after the vote (bit-identical)")
    # selective momentum synchronization
    a("--lioncub-momentum-sync-every", type=int, default=None,
      help="average momenta over the data-parallel group every K steps (enables momentum sync)")
    a("--lioncub-momentum-sync-schedule", choices=SYNC_SCHEDULES, default=None,
      help="every: every K steps; geometric: T(j+1) = T(j) + floor(2^(j/k))")
    a("--lioncub-momentum-sync-k", type=float, default=None, help="geometric schedule growth (gap doubles every k syncs)")
    a("--lioncub-momentum-sync-until", type=int, default=None, help="sync only before this step")
    a("--lioncub-momentum-sync-layers", nargs="+", default=None,
      help="only parameters whose names match these fnmatch patterns, e.g. '*self_attention*'")
    a("--lioncub-momentum-sync-group", choices=SYNC_GROUPS, default=None,
      help="world: the whole data-parallel group; node: data-parallel peers on the same node")
    a("--lioncub-momentum-sync-group-size", type=int, default=None,
      help="data-parallel peers per node for group=node (default: from LOCAL_WORLD_SIZE)")
    a("--lioncub-momentum-sync-inter-every", type=int, default=None,
      help="with group=node: every K' steps average across nodes (the whole data-parallel group) instead")
    a("--lioncub-momentum-sync", default=None,
      help='momentum sync as one JSON object, e.g. \'{"group": "node", "every": 10, "inter_every": 100}\'')
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


_SIMPLE = {"vote": "lioncub_vote", "comm": "lioncub_comm", "quant": "lioncub_quant",
           "tie_break": "lioncub_tie_break", "momentum_dtype": "lioncub_momentum_dtype",
           "bucket_size_mb": "lioncub_bucket_size_mb", "pbit_bits": "lioncub_pbit_bits",
           "nonfinite": "lioncub_nonfinite", "drift_check_every": "lioncub_drift_check_every",
           "drift_action": "lioncub_drift_action", "timeout_s": "lioncub_timeout_s", "foreach": "lioncub_foreach",
           "overlap": "lioncub_overlap", "momentum_double_buffer": "lioncub_momentum_double_buffer"}
_SYNC = {"every": "lioncub_momentum_sync_every", "schedule": "lioncub_momentum_sync_schedule",
         "k": "lioncub_momentum_sync_k", "until": "lioncub_momentum_sync_until",
         "layers": "lioncub_momentum_sync_layers", "group": "lioncub_momentum_sync_group",
         "group_size": "lioncub_momentum_sync_group_size", "inter_every": "lioncub_momentum_sync_inter_every"}


def lioncub_settings_from_args(args) -> dict:
    """The ``lioncub`` settings dict from a namespace parsed with :func:`add_lioncub_args`."""
    out = {}
    for key, attr in _SIMPLE.items():
        value = getattr(args, attr, None)
        if value is not None:
            out[key] = value
    b1, b2 = getattr(args, "lioncub_beta1", None), getattr(args, "lioncub_beta2", None)
    if (b1 is None) != (b2 is None):
        raise LionCubConfigError("LionCub: give both --lioncub-beta1 and --lioncub-beta2, or neither")
    if b1 is not None:
        out["betas"] = (b1, b2)
    net = {}
    if getattr(args, "lioncub_bandwidth_gbit", None) is not None:
        net["bandwidth_gbit"] = args.lioncub_bandwidth_gbit
    if getattr(args, "lioncub_latency_us", None) is not None:
        net["latency_us"] = args.lioncub_latency_us
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
    for key, attr in _SYNC.items():
        value = getattr(args, attr, None)
        if value is not None:
            sync[key] = list(value) if key == "layers" else value
    if sync:
        out["momentum_sync"] = sync
    return out
