"""Agree, once, that every rank of the vote group runs LionCub with the same settings.

A setting that differs on one rank makes the ranks issue different collectives (gloo aborts
with "collective mismatch", NCCL hangs until its timeout), read their flags from mismatched
buffers, or silently apply different updates (``lr``, ``weight_decay``). At construction (and
whenever the vote group is resolved again: :meth:`LionCub.set_process_group`, the first step
after :meth:`LionCub.release_process_group`, an unpickled copy) every rank hashes each setting
that must match, and the parameter layout, into a 63-bit digest (SHA-256, stable across
processes and Python versions) and all-gathers the digests: ONE small int64 all-gather on the
parameters' device (NCCL takes CUDA tensors only), 8 bytes per setting and rank.

Every rank sees the same gathered table, so every rank takes the same path. Only on a mismatch
does a second collective run (``all_gather_object`` of the differing settings' values), and
every rank then raises the same :class:`LionCubConfigError`, naming each differing setting and
each rank's value. Nothing is changed before the error (LionCub calls this before creating any
process group or optimizer state).

Parameter groups added later with ``add_param_group`` are compared at the next step, by the same
function: the step plan keeps the layout it was built with until then, so a rank that added a
group and one that did not still issue the same collectives; the step's flags say that some rank
holds groups its layout lacks, and every rank compares its groups (the same error on every rank
when they differ, nothing changed) before the layout is rebuilt with them
(:meth:`lioncub_ds.pipeline.StepPlan.run`).
"""
from __future__ import annotations

import hashlib
import numbers

import torch
import torch.distributed as dist

from .config import AGREE_GROUPS, AGREE_LOCAL, AGREE_RANKS, LionCubConfig, LionCubConfigError
from .lion import lr_value

# What must match, field by field of LionCubConfig: each field declares it (``agree=`` and ``why=``
# in config.py, next to its type, choices and help).
AGREED_FIELDS = LionCubConfig.agreement(AGREE_RANKS)
# Compared per param group (torch fills each group's lr / betas / weight_decay from the defaults).
GROUP_SETTINGS = LionCubConfig.agreement(AGREE_GROUPS)
# Not compared as settings: purely local ones, and the per-group ones (compared per group instead).
LOCAL_FIELDS = LionCubConfig.agreement(AGREE_LOCAL) + GROUP_SETTINGS
# Then the layout ("parameters"): the number of groups, and per parameter its shape, dtype and
# requires_grad (the buckets, their sizes and their order); and "param_names", the ordered names
# where they are given (named_parameters(), or groups carrying 'param_names'): two same-shaped
# parameters passed in another order on one rank have the same layout, and the votes would mix
# them up (replicas then differ). A rank that gives no names compares as NO_NAMES, which matches
# any rank's names: only the ranks that name their parameters are compared.
NO_NAMES = "not given (no parameter names)"

MAX_VALUE_CHARS = 160  # longer values are cut in the error message


def _canon(value):
    """Equal settings, equal repr: numbers as floats (weight_decay=0 is weight_decay=0.0), lists
    as tuples, dicts sorted."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, (list, tuple)):
        return tuple(_canon(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _canon(v)) for k, v in value.items()))
    return value


def digest(value) -> int:
    """A stable 63-bit hash of a setting's value (fits an int64, positive; SHA-256 of its
    canonical repr, unlike Python's ``hash``, which is salted per process for strings)."""
    h = hashlib.sha256(repr(_canon(value)).encode("utf-8", "backslashreplace")).digest()
    return int.from_bytes(h[:8], "little") & (2**63 - 1)


def _group_value(group: dict, key: str, default):
    value = group.get(key, default)
    if key == "lr":
        try:
            value = lr_value(value)  # a 1-element tensor lr is compared as its value
        except Exception:  # noqa: BLE001 - never raise on one rank only: compare what is there
            return repr(value)
    if isinstance(value, list):
        value = tuple(value)
    return value


def _param_desc(p):
    if not isinstance(p, torch.Tensor):
        return ("not a tensor", type(p).__name__)
    return (tuple(p.shape), str(p.dtype).replace("torch.", ""), bool(p.requires_grad))


# Sizes each rank resolves from its settings and its environment (LionCub passes them, the same
# keys on every rank): compared as resolved, each rank's value or its reason it has none.
RESOLVED_LABELS = {
    "node_size": "node_size (ranks per node group as resolved on each rank: the setting, else LOCAL_WORLD_SIZE, "
                 "then LOCAL_SIZE)",
    "momentum_sync.group_size": "momentum_sync.group_size (as resolved on each rank: the setting, else "
                                "LOCAL_WORLD_SIZE, then LOCAL_SIZE)",
}


def agreed_values(cfg: LionCubConfig, groups, resolved: dict | None = None) -> dict:
    """{setting: canonical value} of everything that must match across ranks, in a fixed order
    (the same keys on every rank, whatever the settings: the all-gathered tensor has one length).
    ``resolved``: {key of RESOLVED_LABELS: this rank's resolved size, or its error text}, compared
    instead of the raw setting (``node_size=None`` means different sizes on different machines)."""
    resolved = dict(resolved or {})
    values = {}
    for name in AGREED_FIELDS:
        if name in resolved:
            values[name] = resolved.pop(name)
            continue
        value = getattr(cfg, name)
        if name == "network":
            value = tuple(sorted(value.items())) if cfg.comm == "auto" else "unused (comm is not 'auto')"
        elif name == "timeout_s":
            value = "set" if value is not None else None
        values[name] = value
    defaults = {key: getattr(cfg, key) for key in GROUP_SETTINGS}
    groups = list(groups)
    for key in GROUP_SETTINGS:
        per_group = tuple(_group_value(g, key, defaults[key]) for g in groups)
        values[key] = per_group[0] if len(per_group) == 1 else per_group
    values["parameters"] = tuple(tuple(_param_desc(p) for p in g.get("params", ())) for g in groups)
    named = any(g.get("param_names") for g in groups)
    values["param_names"] = tuple(tuple(g.get("param_names") or ()) for g in groups) if named else NO_NAMES
    values.update(sorted(resolved.items()))
    return values


def _device(groups) -> torch.device:
    for g in groups:
        for p in g.get("params", ()):
            if isinstance(p, torch.Tensor):
                return p.device
    return torch.device("cpu")


def agree_settings(cfg: LionCubConfig, groups, group=None, device=None, resolved: dict | None = None,
                   what: tuple[str, str] | None = None) -> None:
    """Compare the settings that must match across the ranks of ``group`` (collective: every rank
    of the group calls it), with the ``resolved`` sizes (see :func:`agreed_values`). Raises
    :class:`LionCubConfigError` on every rank on a mismatch; ``what``: (what differs, what is
    allowed and what happens) for its first sentence, when not at construction (the parameter
    groups added later, compared at the next step)."""
    n = dist.get_world_size(group)
    if n <= 1:
        return
    groups = list(groups)
    values = agreed_values(cfg, groups, resolved)
    if device is None:
        device = _device(groups)
    mine = torch.tensor([digest(v) for v in values.values()], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).cpu()  # construction only: one host read
    differing = [name for k, name in enumerate(values) if not _same(table[:, k], name)]
    if not differing:
        return
    # Every rank saw the same table: every rank is here, with the same list.
    everyone = [None] * n
    dist.all_gather_object(everyone, {name: values[name] for name in differing}, group=group)
    lines = [_describe(name, [v[name] for v in everyone]) for name in differing]
    head, tail = what or ("settings that must be the same on every rank of the vote group differ",
                          "every rank raises this, before any process group or optimizer state is created")
    raise LionCubConfigError(f"LionCub: {head} ({n} ranks; ranks numbered inside the vote group); {tail}:\n  " +
                             "\n  ".join(lines))


def _same(column: torch.Tensor, name: str) -> bool:
    """Whether every rank's digest of setting ``name`` matches (``param_names``: among the ranks
    that give names; every rank sees the same column, so every rank decides alike)."""
    if name == "param_names":
        column = column[column != digest(NO_NAMES)]
    return column.numel() == 0 or bool((column == column[0]).all())


def _cut(text: str) -> str:
    return text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS - 15] + f"... ({len(text)} chars)"


def _ranks(rs: list[int]) -> str:
    if len(rs) == 1:
        return f"rank {rs[0]}"
    if rs == list(range(rs[0], rs[-1] + 1)) and len(rs) > 2:
        return f"ranks {rs[0]}-{rs[-1]}"
    return "ranks " + ", ".join(map(str, rs))


def _by_value(shown: list[str], ranks: list[int] | None = None) -> str:
    """'rank 0: x; ranks 1-3: y' (ranks holding the same value together; ``ranks``: the rank of
    each entry of ``shown``, default its position)."""
    order, who = [], {}
    for r, s in zip(ranks if ranks is not None else range(len(shown)), shown):
        if s not in who:
            order.append(s)
            who[s] = []
        who[s].append(r)
    return "; ".join(f"{_ranks(who[s])}: {s}" for s in order)


def _describe(name: str, per_rank: list) -> str:
    if name == "parameters":
        return _describe_layout(per_rank)
    if name == "param_names":  # the ranks that give names (the others are not compared)
        ranks = [r for r, v in enumerate(per_rank) if isinstance(v, tuple)]
        flat = [[(gi, nm) for gi, g in enumerate(per_rank[r]) for nm in g] for r in ranks]
        return _describe_first_difference(
            "param_names (the parameters' names in the order passed: every rank must pass the same parameters in "
            "the same order)", flat, lambda x: f"group {x[0]} {x[1]!r}", ranks)
    shown = [_cut(repr(v)) for v in per_rank]
    label = name
    if name in GROUP_SETTINGS and any(isinstance(v, tuple) and (name != "betas" or (v and isinstance(v[0], tuple)))
                                      for v in per_rank):
        label = f"{name} (one value per param group)"
    elif name in RESOLVED_LABELS:
        label = RESOLVED_LABELS[name]
    elif name == "timeout_s":
        label = "timeout_s (set on some ranks only)"
    elif name == "network":
        label = "network (comm='auto' picks each bucket's algorithm from it)"
    return f"{label}: {_by_value(shown)}"


def _describe_layout(per_rank: list) -> str:
    counts = [f"{sum(len(g) for g in v)} in {len(v)} group{'s' if len(v) != 1 else ''}" for v in per_rank]
    flat = [[(gi, i, d) for gi, g in enumerate(v) for i, d in enumerate(g)] for v in per_rank]

    def show(entry):
        gi, i, d = entry
        if d[0] == "not a tensor":
            return f"group {gi} #{i}: not a tensor ({d[1]})"
        shape, dtype, grad = d
        return f"group {gi} #{i}: shape {shape} {dtype}{'' if grad else ' requires_grad=False'}"

    first = _describe_first_difference("parameters", flat, show)
    if len(set(counts)) > 1:
        first += f" (parameters: {_by_value(counts)})"
    return first


def _describe_first_difference(label, lists, show, ranks: list[int] | None = None) -> str:
    """The first position where the ranks' lists differ, and each rank's entry there (``ranks``:
    the rank of each list, default its position)."""
    if not all(isinstance(x, list) for x in lists):
        return f"{label}: {_by_value([_cut(repr(x)) for x in lists], ranks)}"
    k = 0
    while all(k < len(x) for x in lists) and all(x[k] == lists[0][k] for x in lists):
        k += 1
    if all(k == len(x) for x in lists):  # the same entries, grouped differently
        return f"{label}: {_by_value([_cut(repr(x)) for x in lists], ranks)}"
    shown = [_cut(show(x[k])) if k < len(x) else f"none (only {len(x)} entries)" for x in lists]
    return f"{label} differ first at entry {k}: {_by_value(shown, ranks)}"
