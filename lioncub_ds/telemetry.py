"""Bytes and time per collective, per step and cumulative.

Bytes are what ONE rank sends, by the ring model used throughout docs/conventions.md and docs/results.md:
all_reduce of T bytes: 2·(N−1)/N·T; all_gather producing T bytes: (N−1)/N·T;
all_to_all of T bytes: (N−1)/N·T; broadcast of T bytes from the root: T (the root;
others 0, counted on every rank as the root's T/N share is not meaningful).
"""
from __future__ import annotations

from collections import defaultdict


def format_bytes(n: float) -> str:
    """Human-readable bytes: 512 B, 27.1 KB, 5.0 MB."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} GB"


def ring_bytes(kind: str, nbytes: int, world_size: int) -> int:
    """Bytes one rank sends for a collective over ``nbytes`` (the full tensor)."""
    n = world_size
    if n <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (n - 1) * nbytes // n
    if kind in ("all_gather", "all_to_all", "reduce_scatter"):
        return (n - 1) * nbytes // n
    if kind == "broadcast":
        return nbytes
    raise ValueError(f"unknown collective kind {kind!r}")


def _zero():
    # comm_time_s: each collective from launch to done (overlapped time included);
    # wait_time_s: the time the host spent blocked waiting for them (the exposed part)
    return {"bytes_sent": 0, "fp32_allreduce_bytes": 0, "bf16_allreduce_bytes": 0, "comm_time_s": 0.0,
            "wait_time_s": 0.0, "collectives": 0, "by_collective": defaultdict(int), "by_algorithm": defaultdict(int),
            # which link: "vote_group" (flat voting), or with node voters "intra_node" (the node
            # group's reduce-scatter / all-gather / flags) and "inter_node" (votes between groups)
            "by_scope": defaultdict(int)}


class CommStats:
    """Accumulates what the optimizer's collectives send."""

    def __init__(self):
        self.cumulative = _zero()
        self.last_step = _zero()
        self._current = _zero()
        self.steps = 0

    def record(self, kind: str, purpose: str, nbytes: int, world_size: int, seconds: float,
               riders: dict | None = None, scope: str = "vote_group") -> int:
        """One collective over ``nbytes``. ``riders``: {purpose: nbytes} of it that served another
        purpose (the step's flags riding in a vote message): counted under that purpose."""
        sent = ring_bytes(kind, nbytes, world_size)
        parts = {purpose: sent}
        for other, part in (riders or {}).items():
            moved = ring_bytes(kind, part, world_size)
            parts[purpose] -= moved
            parts[other] = parts.get(other, 0) + moved
        for acc in (self._current, self.cumulative):
            acc["bytes_sent"] += sent
            acc["comm_time_s"] += seconds
            acc["collectives"] += 1
            acc["by_collective"][kind] += sent
            acc["by_scope"][scope] += sent
            for name, part in parts.items():
                acc["by_algorithm"][name] += part
        return sent

    def record_wait(self, seconds: float) -> None:
        for acc in (self._current, self.cumulative):
            acc["wait_time_s"] += seconds

    def add_baseline(self, numel: int, world_size: int) -> None:
        """What an fp32 / bf16 ring all-reduce of ``numel`` gradients would send."""
        for acc in (self._current, self.cumulative):
            acc["fp32_allreduce_bytes"] += ring_bytes("all_reduce", 4 * numel, world_size)
            acc["bf16_allreduce_bytes"] += ring_bytes("all_reduce", 2 * numel, world_size)

    def end_step(self) -> None:
        self.last_step = self._current
        self._current = _zero()
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps, "cumulative": _plain(self.cumulative)}

    def load_state_dict(self, sd):
        self.steps = int(sd.get("steps", 0))
        cum = _zero()
        for k, v in sd.get("cumulative", {}).items():
            if isinstance(v, dict):
                cum[k].update(v)
            else:
                cum[k] = v
        self.cumulative = cum

    def snapshot(self) -> dict:
        return {"steps": self.steps, "last_step": _plain(self.last_step), "cumulative": _plain(self.cumulative)}


def _plain(acc):
    out = dict(acc)
    out["by_collective"] = dict(acc["by_collective"])
    out["by_algorithm"] = dict(acc["by_algorithm"])
    out["by_scope"] = dict(acc["by_scope"])
    fp32 = out["fp32_allreduce_bytes"]
    out["ratio_vs_fp32"] = (fp32 / out["bytes_sent"]) if out["bytes_sent"] else None
    out["ratio_vs_bf16"] = (out["bf16_allreduce_bytes"] / out["bytes_sent"]) if out["bytes_sent"] else None
    return out

