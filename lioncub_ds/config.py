"""One validated settings object for LionCub.

Every error names the setting, the value given and what is allowed, and is raised
before the optimizer creates any state. The same checks serve the Python constructor,
the ds_config ``params`` section and Megatron's ``--lioncub-*`` arguments.
"""
from __future__ import annotations

import difflib
import math
import numbers
from dataclasses import MISSING, dataclass, field, fields

import torch

from .conventions import ROUNDINGS, SCALE_KINDS, TIE_RULES, VOTE_BITS, VOTE_MODES

COMM_ALGORITHMS = ("auto", "allgather", "1bit", "pbit", "int8", "bbit")
SCALED_ALGORITHMS = ("int8", "bbit")  # need quant = l1 | l0 | linf
SIGN_ALGORITHMS = ("allgather", "1bit", "pbit")
VOTES = VOTE_MODES
QUANTS = ("sign",) + SCALE_KINDS  # "sign": 1-bit votes; the others: int8 / b-bit codes with that scale
# comm="bbit" defaults: 2-bit codes (21x fewer bytes than an fp32 all-reduce), dithered rounding
BBIT_DEFAULTS = {"vote_bits": 2, "rounding": "dither"}
NONFINITE_POLICIES = ("skip", "raise")
DRIFT_ACTIONS = ("raise", "resync")
MOMENTUM_DTYPES = (torch.float32, torch.bfloat16)
SYNC_KEYS = ("every", "until", "schedule", "k", "threshold", "min_every", "layers", "group", "group_size", "inter_every",
             "dtype")
SYNC_DTYPES = ("fp32", "bf16", "int8")
SYNC_SCHEDULES = ("every", "geometric", "drift")
# the keys schedule="drift" uses (the others choose fixed steps or node subgroups)
DRIFT_SYNC_KEYS = ("schedule", "threshold", "min_every", "until", "layers", "dtype")
SYNC_GROUPS = ("world", "node")
VOTERS = ("rank", "node")


NETWORK_KEYS = ("bandwidth_gbit", "latency_us")
# The network comm="auto" plans for when none is given: 10 Gbit/s Ethernet, 50 µs per message.
DEFAULT_NETWORK = {"bandwidth_gbit": 10.0, "latency_us": 50.0}
NETWORK_HELP = {"bandwidth_gbit": "network bandwidth in Gbit/s for comm=auto's cost model (> 0; default 10)",
                "latency_us": "per-message latency in µs for comm=auto's cost model (>= 0; default 50)"}
# Constructor arguments that are not settings: (default, allowed, meaning), for the README table.
CONSTRUCTOR_ONLY = {"process_group": ("world", "a ProcessGroup",
                                      "the data-parallel group that votes (DeepSpeed and Megatron set it)"),
                    "shard_groups": ("`None`", "a `lioncub_ds.groups.ShardGroups`",
                                     "the parameters are this rank's shards of a framework's sharded parameters "
                                     "(DeepSpeed ZeRO-3, FSDP2): vote with the peers holding the same shard, one voter "
                                     "per shard group (the integrations set it)"),
                    "config": ("`None`", "a `LionCubConfig`",
                               "every setting at once, already validated (integrations validate once, early); "
                               "then no setting keyword may be given")}


class LionCubConfigError(ValueError):
    """A LionCub setting has a wrong type, range or combination."""


def _err(key, value, allowed):
    return LionCubConfigError(f"LionCub: invalid {key}={value!r}; allowed: {allowed}")


def _is_real(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def unknown_key_error(key, allowed, where):
    close = difflib.get_close_matches(str(key), allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return LionCubConfigError(f"LionCub: unknown {where} key {key!r}{hint}; allowed keys: {', '.join(allowed)}")


def parse_dtype(key, value):
    if isinstance(value, str):
        names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
        if value in names:
            return names[value]
    if value in MOMENTUM_DTYPES:
        return value
    raise _err(key, value, "torch.float32 / 'fp32' or torch.bfloat16 / 'bf16'")


def validate_common(*, lr, betas, weight_decay, momentum_dtype=torch.float32, foreach=None, owner="LionCub",
                    lr_zero_ok=False):
    """Checks shared by Lion and LionCub. ``lr_zero_ok``: a param group's own lr, which may be 0
    as in torch (a frozen subset, a warm-up scheduler's first value)."""
    if not _is_real(lr) or not (lr >= 0 if lr_zero_ok else lr > 0) or not math.isfinite(lr):
        allowed = "a finite number >= 0 (0: the group does not move)" if lr_zero_ok else "a finite number > 0"
        raise LionCubConfigError(f"{owner}: invalid lr={lr!r}; allowed: {allowed}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or not all(_is_real(b) and 0.0 <= b < 1.0 for b in betas):
        raise LionCubConfigError(f"{owner}: invalid betas={betas!r}; allowed: two numbers (beta1, beta2), each 0 <= beta < 1")
    if not _is_real(weight_decay) or not weight_decay >= 0 or not math.isfinite(weight_decay):
        raise LionCubConfigError(f"{owner}: invalid weight_decay={weight_decay!r}; allowed: a finite number >= 0")
    if momentum_dtype not in MOMENTUM_DTYPES:
        raise LionCubConfigError(f"{owner}: invalid momentum_dtype={momentum_dtype!r}; allowed: torch.float32, torch.bfloat16")
    if foreach not in (None, True, False):
        raise LionCubConfigError(f"{owner}: invalid foreach={foreach!r}; allowed: None, True, False")


# Whether a LionCubConfig setting must be the same on every rank of the vote group (``agree=``),
# compared once when the vote group is resolved (lioncub_ds.agreement):
AGREE_RANKS = "ranks"   # compared as is (a value that differs changes the collectives or the update)
AGREE_GROUPS = "groups"  # compared per param group (torch fills each group's value from the default)
AGREE_LOCAL = "local"   # this rank's own business: never compared
AGREE_KINDS = (AGREE_RANKS, AGREE_GROUPS, AGREE_LOCAL)


def setting(default=MISSING, *, type, help, choices=None, allowed=None, default_doc=None, default_factory=MISSING,
            agree=None, why=None):
    """A settings field carrying what the ``--lioncub-*`` flags, the README table, the constructor's
    keywords and the settings agreement across ranks are made of.

    type: the type of one value (float, int, str, bool; list: one or more strings); choices: the
    values allowed besides a None default (also the command line's choices); allowed: the README's
    "allowed" text when it is not just the choices; help: one line, Markdown (the README's
    "meaning"; the command-line help is the same text without the Markdown); default_doc: the
    README's "default" cell when the default's repr is not what a user writes; agree (every
    LionCubConfig field): AGREE_RANKS, AGREE_GROUPS or AGREE_LOCAL, and why: the reason.
    """
    meta = {"type": type, "help": help, "choices": None if choices is None else tuple(choices),
            "allowed": allowed, "default_doc": default_doc, "agree": agree, "why": why}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class MomentumSyncConfig:
    """When to average momenta across ranks (docs/conventions.md, lever 3)."""
    schedule: str = setting("every", type=str, choices=SYNC_SCHEDULES,
                            help="`every`: every K steps; `geometric`: T0 = 0, T(j+1) = T(j) + ⌊2^(j/k)⌋; `drift`: "
                                 "when the votes' disagreement with Δ has risen by `threshold`")
    every: int = setting(1, type=int, allowed="int ≥ 1", help="K: average momenta every K steps (schedule `every`)")
    k: float = setting(1.0, type=float, allowed="> 0", help="geometric schedule: the gap doubles every k syncs")
    threshold: float | None = setting(None, type=float, allowed="0 < τ < 1",
                                      help="τ of schedule `drift` (required there): sync when the ranks' mean "
                                           "fraction of votes that disagree with Δ has risen by τ since the first "
                                           "step after the last sync")
    min_every: int = setting(2, type=int, allowed="int ≥ 1",
                             help="schedule `drift`: at least this many steps between syncs (the signal allows "
                                  "3 at the least)")
    until: int | None = setting(None, type=int, allowed="int ≥ 0",
                                help="sync only on 0-based steps < until")
    layers: tuple = setting((), type=list, allowed="fnmatch patterns",
                            help="only parameters whose names match these patterns, e.g. `*.attn.*` (default: all)")
    group: str = setting("world", type=str, choices=SYNC_GROUPS,
                         help="`world`: the whole vote group; `node`: subgroups of `group_size` consecutive ranks")
    group_size: int | None = setting(None, type=int, allowed="int ≥ 1",
                                     help="ranks per node for group `node` (default: `LOCAL_WORLD_SIZE`, else "
                                          "`LOCAL_SIZE`)")
    inter_every: int | None = setting(None, type=int, allowed="int ≥ 1",
                                      help="with group `node`: every K'-th step average across the whole group instead")
    dtype: str = setting("fp32", type=str, choices=SYNC_DTYPES,
                         help="what travels: `fp32` (all-reduce), or `bf16` / `int8` (a two-phase average, 2x / 4x fewer bytes)")

    def __repr__(self):
        # Only what differs from the defaults, as a user writes it: the full form outgrows the
        # settings-agreement error's cut (agreement.MAX_VALUE_CHARS) and hides the one field that differs.
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                   if getattr(self, f.name) != f.default]
        return f"MomentumSyncConfig({', '.join(changed)})"

    @classmethod
    def from_value(cls, value):
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise _err("momentum_sync", value, "None or a dict with keys " + ", ".join(SYNC_KEYS))
        for key in value:
            if key not in SYNC_KEYS:
                raise unknown_key_error(key, SYNC_KEYS, "momentum_sync")
        v = dict(value)
        schedule = v.get("schedule", "geometric" if "k" in v and "every" not in v else
                         "drift" if "threshold" in v and "every" not in v else "every")
        if schedule not in SYNC_SCHEDULES:
            raise _err("momentum_sync.schedule", schedule, " | ".join(SYNC_SCHEDULES))
        threshold, min_every = cls._drift_keys(v, schedule)
        every = v.get("every", 1)
        if not _is_int(every) or every < 1:
            raise _err("momentum_sync.every", every, "an integer >= 1")
        k = v.get("k", 1.0)
        if not _is_real(k) or not k > 0 or not math.isfinite(k):
            raise _err("momentum_sync.k", k, "a number > 0")
        until = v.get("until")
        if until is not None and (not _is_int(until) or until < 0):
            raise _err("momentum_sync.until", until, "None or an integer >= 0")
        layers = v.get("layers", ())
        if isinstance(layers, str):
            layers = (layers,)
        if not isinstance(layers, (list, tuple)) or not all(isinstance(x, str) and x for x in layers):
            raise _err("momentum_sync.layers", v.get("layers"), "a list of parameter-name patterns (fnmatch), e.g. ['*.attn.*']")
        group = v.get("group", "world")
        if group not in SYNC_GROUPS:
            raise _err("momentum_sync.group", group, " | ".join(SYNC_GROUPS))
        group_size = v.get("group_size")
        if group_size is not None and (not _is_int(group_size) or group_size < 1):
            raise _err("momentum_sync.group_size", group_size, "None or an integer >= 1")
        inter_every = v.get("inter_every")
        if inter_every is not None and (not _is_int(inter_every) or inter_every < 1):
            raise _err("momentum_sync.inter_every", inter_every, "None or an integer >= 1")
        if group == "world" and (group_size is not None or inter_every is not None):
            raise LionCubConfigError("LionCub: momentum_sync.group_size / inter_every need momentum_sync.group='node'")
        dtype = v.get("dtype", "fp32")
        if dtype not in SYNC_DTYPES:
            raise _err("momentum_sync.dtype", dtype, " | ".join(repr(d) for d in SYNC_DTYPES))
        return cls(schedule=schedule, every=int(every), k=float(k), threshold=threshold, min_every=min_every,
                   until=until, layers=tuple(layers), group=group, group_size=group_size, inter_every=inter_every,
                   dtype=dtype)

    @staticmethod
    def _drift_keys(v: dict, schedule: str):
        """(threshold, min_every) of schedule="drift"; the drift keys are refused elsewhere, and the
        keys that choose fixed steps or node subgroups are refused with it."""
        if schedule != "drift":
            for key in ("threshold", "min_every"):
                if key in v:
                    raise LionCubConfigError(f"LionCub: momentum_sync.{key} is only used with schedule='drift' "
                                             f"(got schedule={schedule!r})")
            return None, 2
        for key in v:
            if key not in DRIFT_SYNC_KEYS:
                raise LionCubConfigError(f"LionCub: momentum_sync.{key} is not used with schedule='drift' (it syncs "
                                         "when the votes' disagreement with Δ rises, over the whole vote group); "
                                         f"allowed keys: {', '.join(DRIFT_SYNC_KEYS)}")
        threshold = v.get("threshold")
        if not _is_real(threshold) or not 0.0 < threshold < 1.0:
            raise _err("momentum_sync.threshold", threshold, "a number strictly between 0 and 1 (a rise of the "
                       "fraction of votes that disagree with Δ; required with schedule='drift')")
        min_every = v.get("min_every", 2)
        if not _is_int(min_every) or min_every < 1:
            raise _err("momentum_sync.min_every", min_every, "an integer >= 1 (steps between syncs)")
        return float(threshold), int(min_every)

    @property
    def drift(self) -> bool:
        """Syncs decided from the votes' disagreement with Δ (``schedule="drift"``)."""
        return self.schedule == "drift"

    @property
    def per_node(self) -> bool:
        """Averages run inside node subgroups (``group="node"``), with rarer ones across them."""
        return self.group == "node"


@dataclass(frozen=True)
class LionCubConfig:
    lr: float = setting(1e-4, type=float, allowed="> 0", default_doc="`1e-4`",
                        help="η. Typical LLM: 3–10x smaller than AdamW",
                        agree=AGREE_GROUPS, why="applied by every rank")
    betas: tuple = setting((0.9, 0.99), type=float, allowed="each in [0, 1)",
                           help="(β1, β2). Typical LLM: (0.95, 0.98)",
                           agree=AGREE_GROUPS, why="every rank's vote and momentum")
    weight_decay: float = setting(0.0, type=float, allowed="≥ 0",
                                  help="decoupled λ: θ·(1 − η·λ). Typical: 3–10x AdamW's",
                                  agree=AGREE_GROUPS, why="applied by every rank")
    vote: str = setting("majority", type=str, choices=VOTES,
                        help="Δ = sign(Σδ_i) or (1/N)·Σδ_i. `average` only with `quant=\"sign\"`",
                        agree=AGREE_RANKS, why="which vote is computed (and, with 1bit, what its messages carry)")
    comm: str = setting("auto", type=str, choices=COMM_ALGORITHMS,
                        help="vote collective ([below](#communication-algorithms-and-wire-bytes)); `auto`: per bucket the "
                             "cheapest exact sign algorithm by the α-β model (`int8` with a scaled `quant`); `int8` and "
                             "`bbit` need quant `l1`, `l0` or `linf`",
                        agree=AGREE_RANKS, why="which collectives run")
    quant: str = setting("sign", type=str, choices=QUANTS,
                         help="1-bit signs, or scaled votes with that per-tensor scale (`int8` and `bbit` only)",
                         agree=AGREE_RANKS, why="int8 / b-bit scale: message layout and the scale all-reduce")
    tie_break: str = setting("hash", type=str, choices=TIE_RULES,
                             help="even-N ties: no move; +1 odd / −1 even steps; ±1 from a hash of (step, the "
                                  "element's index inside its parameter)",
                             agree=AGREE_RANKS, why="what an even-N tie does (and the 1bit/pbit paths it selects)")
    momentum_sync: MomentumSyncConfig | None = setting(None, type=dict, allowed="dict, see below",
                                                       help="selective momentum averaging",
                                                       agree=AGREE_RANKS, why="when and over which groups momenta are "
                                                                              "averaged (collectives), which layers")
    momentum_dtype: torch.dtype = setting(torch.float32, type=str, choices=("fp32", "bf16"),
                                          allowed="`torch.float32`, `torch.bfloat16` (or `\"fp32\"`, `\"bf16\"`)",
                                          help="momentum storage; math is fp32",
                                          agree=AGREE_RANKS, why="the dtype of the momenta the momentum sync all-"
                                                                 "reduces; the vote's c")
    bucket_size_mb: float = setting(25.0, type=float, allowed="> 0", help="MB of fp32 parameters per flat bucket",
                                    agree=AGREE_RANKS, why="the bucket layout: message sizes and which algorithm "
                                                           "comm='auto' picks")
    pbit_bits: int | None = setting(None, type=int, choices=(1, 2, 4, 8),
                                    allowed="`None`, `1`, `2`, `4`, `8` with 2^p − 1 ≥ N",
                                    help="force the pbit lane width (`pbit`/`auto`)",
                                    agree=AGREE_RANKS, why="pbit lane width: message size")
    vote_bits: int | None = setting(None, type=int, choices=VOTE_BITS,
                                    help="`bbit` only: bits per vote code (`None`: 2; 2 bits send 21x fewer bytes "
                                         "than an fp32 all-reduce)",
                                    agree=AGREE_RANKS, why="bbit code width: message size")
    rounding: str | None = setting(None, type=str, choices=ROUNDINGS,
                                   help="`bbit` only: `dither` (`None`'s choice: unbiased, a reproducible per-rank "
                                        "stream) or `nearest`",
                                   agree=AGREE_RANKS, why="bbit dither / nearest: what is voted")
    network: dict = setting(type=dict, default_factory=lambda: dict(DEFAULT_NETWORK), allowed="> 0, ≥ 0",
                            default_doc='`{"bandwidth_gbit": 10, "latency_us": 50}`',
                            help="the α-β model behind `comm=\"auto\"` (a message costs latency + bytes / bandwidth)",
                            agree=AGREE_RANKS, why="comm='auto' picks each bucket's algorithm from it (compared only "
                                                   "then)")
    nonfinite: str = setting("skip", type=str, choices=NONFINITE_POLICIES,
                             help="NaN/Inf on any rank: every rank skips the step, or raises `NonFiniteError`",
                             agree=AGREE_RANKS, why="skip on every rank, or raise: one rank raising leaves the others "
                                                    "waiting")
    drift_check_every: int = setting(0, type=int, allowed="int ≥ 0",
                                     help="every K steps compare parameter checksums across ranks (0 = off)",
                                     agree=AGREE_RANKS, why="the drift check is a collective every K steps")
    drift_action: str = setting("raise", type=str, choices=DRIFT_ACTIONS,
                                help="`ReplicaDriftError` naming the parameters, or broadcast from rank 0",
                                agree=AGREE_RANKS, why="raise, or resync (a broadcast)")
    timeout_s: float | None = setting(None, type=float, allowed="> 0",
                                      help="collective timeout: a dead rank makes the others raise instead of hanging",
                                      agree=AGREE_RANKS, why="set or not: a timeout group is created (a world "
                                                             "collective); the value itself is each rank's own deadline"
                                                             " and may differ (compared as set / not set)")
    foreach: bool | None = setting(None, type=bool, choices=(True, False),
                                   help="single-process path: `None` = the fused kernel of the device's backend "
                                        "(C++ / CUDA, one pass), `True` / `False` = torch foreach / single tensor "
                                        "(same bits)",
                                   agree=AGREE_LOCAL, why="the single-process path only (N = 1); same bits either "
                                                          "way")
    comm_bucket_mb: float = setting(4.0, type=float, allowed="> 0",
                                    help="MB of packed votes per communication batch (one collective per phase per "
                                         "batch); 1 is faster at 1 Gbit/s, slower at 10 ([measured](docs/results.md))",
                                    agree=AGREE_RANKS, why="communication batches: one collective per phase per "
                                                           "batch")
    overlap: bool = setting(False, type=bool, choices=(True, False),
                            help="start votes from gradient-ready hooks during backward; bit-identical to `False`. "
                                 "DeepSpeed: ZeRO 0 with fp32 only; Megatron: refused ([why](docs/megatron.md))",
                            agree=AGREE_RANKS, why="the flags ride in a vote message or travel in their own all-"
                                                   "reduce")
    momentum_double_buffer: bool = setting(False, type=bool, choices=(True, False),
                                           help="+4 bytes per parameter (one more momentum-sized buffer, not saved in "
                                                "checkpoints): the local pass writes the next momentum there, so a "
                                                "step reads g and m once instead of twice; bit-identical to `False`. "
                                                "Sign votes only (`int8` keeps its momentum pass)",
                                           agree=AGREE_LOCAL, why="where the local pass writes the next momentum; "
                                                                  "bit-identical")
    voters: str = setting("rank", type=str, choices=VOTERS,
                          help="every rank votes (`rank`), or one voter per group of `node_size` ranks: the group "
                               "reduce-scatters its gradients, each rank keeps momentum (and the fp32 master of "
                               "bf16/fp16 parameters) for 1/L of them and votes with the same shard of the other "
                               "groups ([node voters](docs/node_voters.md))",
                          agree=AGREE_RANKS, why="flat votes, or node groups that shard and vote across groups "
                                                 "(other groups)")
    node_size: int | None = setting(None, type=int, allowed="`None` or an int ≥ 1 dividing N",
                                    help="ranks per group L. `voters=\"node\"`: `None` = the ranks per node "
                                         "(`LOCAL_WORLD_SIZE`, else `LOCAL_SIZE`: a group is a node), 1 = flat voting. `voters=\"rank\"`: shards only the fp32 master "
                                         "of bf16/fp16 parameters over the group (`None`: no master)",
                                    agree=AGREE_RANKS, why="the groups' size L: the shard layout and who votes "
                                                           "with whom (compared as resolved on each rank)")

    def __post_init__(self):
        validate_common(lr=self.lr, betas=self.betas, weight_decay=self.weight_decay,
                        momentum_dtype=self.momentum_dtype, foreach=self.foreach)
        for key, allowed in (("vote", VOTES), ("comm", COMM_ALGORITHMS), ("quant", QUANTS),
                             ("tie_break", TIE_RULES), ("nonfinite", NONFINITE_POLICIES),
                             ("drift_action", DRIFT_ACTIONS)):
            value = getattr(self, key)
            if not isinstance(value, str) or value not in allowed:
                raise _err(key, value, " | ".join(repr(a) for a in allowed))
        if self.comm in SCALED_ALGORITHMS and self.quant == "sign":
            raise LionCubConfigError(f"LionCub: comm={self.comm!r} needs a scaled quantizer: quant='l1' | 'l0' | 'linf' "
                                     "(got quant='sign')")
        for key, allowed in (("vote_bits", VOTE_BITS), ("rounding", ROUNDINGS)):
            value = getattr(self, key)
            if value is None:
                continue
            if value not in allowed or isinstance(value, bool):
                raise _err(key, value, "None (comm='bbit' default: " + repr(BBIT_DEFAULTS[key]) + ") or one of "
                           + ", ".join(repr(a) for a in allowed))
            if self.comm != "bbit":
                raise LionCubConfigError(f"LionCub: {key}={value!r} is only used with comm='bbit' (got comm={self.comm!r})")
        if self.comm in SIGN_ALGORITHMS and self.quant != "sign":
            raise LionCubConfigError(f"LionCub: comm={self.comm!r} sends 1-bit signs and needs quant='sign' "
                                     f"(got quant={self.quant!r}); use comm='int8' or 'auto' for scaled quantizers")
        if self.vote == "average" and self.quant != "sign":
            kind = "b-bit" if self.comm == "bbit" else "int8"
            raise LionCubConfigError(f"LionCub: vote='average' is not meaningful with the {kind} quantizer "
                                     f"(quant={self.quant!r}); allowed: vote='majority' with {kind}, or quant='sign' "
                                     "for averaging")
        if not _is_real(self.bucket_size_mb) or not self.bucket_size_mb > 0 or not math.isfinite(self.bucket_size_mb):
            raise _err("bucket_size_mb", self.bucket_size_mb, "a number > 0 (MB of fp32 parameters per bucket)")
        if self.pbit_bits is not None:
            if self.pbit_bits not in (1, 2, 4, 8) or isinstance(self.pbit_bits, bool):
                raise _err("pbit_bits", self.pbit_bits, "None (choose from the world size) or one of 1, 2, 4, 8")
            if self.comm not in ("pbit", "auto"):
                raise LionCubConfigError(f"LionCub: pbit_bits={self.pbit_bits!r} is only used with comm='pbit' or 'auto' "
                                         f"(got comm={self.comm!r})")
        if not isinstance(self.network, dict):
            raise _err("network", self.network, "a dict with bandwidth_gbit (> 0) and latency_us (>= 0)")
        for key in self.network:
            if key not in NETWORK_KEYS:
                raise unknown_key_error(key, NETWORK_KEYS, "network")
        bw = self.network.get("bandwidth_gbit", 10.0)
        lat = self.network.get("latency_us", 50.0)
        if not _is_real(bw) or not bw > 0:
            raise _err("network.bandwidth_gbit", bw, "a number > 0")
        if not _is_real(lat) or not lat >= 0:
            raise _err("network.latency_us", lat, "a number >= 0")
        if not _is_int(self.drift_check_every) or self.drift_check_every < 0:
            raise _err("drift_check_every", self.drift_check_every, "an integer >= 0 (0 = off)")
        if not _is_real(self.comm_bucket_mb) or not self.comm_bucket_mb > 0 or not math.isfinite(self.comm_bucket_mb):
            raise _err("comm_bucket_mb", self.comm_bucket_mb, "a number > 0 (MB of packed votes per communication batch)")
        for key in ("overlap", "momentum_double_buffer"):
            if not isinstance(getattr(self, key), bool):
                raise _err(key, getattr(self, key), "True or False")
        self._check_voters()
        ms = self.momentum_sync
        if ms is not None and ms.drift and self.quant != "sign":
            raise LionCubConfigError(f"LionCub: momentum_sync schedule='drift' counts the 1-bit sign votes that "
                                     f"disagree with Δ; comm={self.comm!r} with quant={self.quant!r} sends scaled "
                                     "codes; allowed: quant='sign' with comm '1bit', 'allgather', 'pbit' or 'auto', "
                                     "or schedule 'every' / 'geometric'")
        if self.timeout_s is not None and (not _is_real(self.timeout_s) or not 0 < self.timeout_s < math.inf):
            raise _err("timeout_s", self.timeout_s, "None or a number of seconds > 0")

    def _check_voters(self):
        # the voters / node_size rules live beside the one resolver of the sharding mode
        from .groups import check_voter_settings
        check_voter_settings(self, LionCubConfigError)

    @property
    def bbit(self) -> tuple[int, str]:
        """(vote_bits, rounding) of comm='bbit', defaults filled in."""
        return (self.vote_bits or BBIT_DEFAULTS["vote_bits"], self.rounding or BBIT_DEFAULTS["rounding"])

    @property
    def bucket_numel(self) -> int:
        return max(8, int(self.bucket_size_mb * 2**20 / 4) // 8 * 8)

    @classmethod
    def keys(cls):
        return tuple(f.name for f in fields(cls))

    @classmethod
    def defaults(cls) -> dict:
        """{setting: its default}."""
        return {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(cls)}

    @classmethod
    def agreement(cls, kind: str) -> tuple:
        """The settings whose ``agree=`` is ``kind`` (AGREE_RANKS, AGREE_GROUPS or AGREE_LOCAL)."""
        return tuple(f.name for f in fields(cls) if f.metadata["agree"] == kind)

    @classmethod
    def from_kwargs(cls, where="LionCub argument", **kwargs):
        """Build from keyword settings (ds_config params, CLI); unknown keys get a suggestion."""
        allowed = cls.keys()
        for key in kwargs:
            if key not in allowed:
                raise unknown_key_error(key, allowed, where)
        kw = dict(kwargs)
        if "betas" in kw and isinstance(kw["betas"], list):
            kw["betas"] = tuple(kw["betas"])
        if "momentum_dtype" in kw:
            kw["momentum_dtype"] = parse_dtype("momentum_dtype", kw["momentum_dtype"])
        if "momentum_sync" in kw:
            kw["momentum_sync"] = MomentumSyncConfig.from_value(kw["momentum_sync"])
        if "network" in kw and isinstance(kw["network"], dict):
            kw["network"] = {**DEFAULT_NETWORK, **kw["network"]}
        return cls(**kw)


def _check_declarations(cls) -> None:
    """Every setting says whether it must agree across ranks (a new one cannot forget)."""
    for f in fields(cls):
        if f.metadata.get("agree") not in AGREE_KINDS or not f.metadata.get("why"):
            raise TypeError(f"LionCubConfig.{f.name}: declare agree= (one of {', '.join(AGREE_KINDS)}) and why= "
                            "in its setting(...)")


_check_declarations(LionCubConfig)
