"""Per-rank optimizer state: save, validate, load, reshard.

Every rank keeps its own momentum, so every rank writes its own file,
``lioncub-rank{r:05d}-of-{N:05d}.pt``, atomically (temporary file + fsync + rename).
Files carry a format version and are read with ``torch.load(weights_only=True)``.
Everything is checked (format, world size, parameter count and shapes) before the
optimizer is touched: a bad file raises :class:`CheckpointError` and leaves the
running state as it was.

Resharding policy when the world size changed (``reshard=``):
* ``"average"`` (default): every new rank starts from the mean of all saved momenta
  (the state a momentum sync would produce); needs every old rank's file.
* ``"error"``: refuse.
"""
from __future__ import annotations

import glob
import logging
import os
import re
import tempfile

import torch

FORMAT_VERSION = 1
KIND = "lioncub_optimizer_state"
RESHARD_POLICIES = ("average", "error")
_NAME = re.compile(r"lioncub-rank(\d{5})-of-(\d{5})\.pt$")

log = logging.getLogger("lioncub_ds")


class CheckpointError(RuntimeError):
    """A LionCub checkpoint is missing, corrupted, truncated or does not fit the optimizer."""


def rank_file(directory, rank: int, world_size: int) -> str:
    return os.path.join(directory, f"lioncub-rank{rank:05d}-of-{world_size:05d}.pt")


def atomic_torch_save(obj, path: str) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _rank_info(optimizer):
    return (optimizer._dist[2], optimizer._dist[1]) if optimizer.distributed else (0, 1)


def _shapes(optimizer):
    return [list(p.shape) for g in optimizer.param_groups for p in g["params"]]


def save(optimizer, directory: str) -> str:
    """Write this rank's optimizer state to ``directory``; returns the file path."""
    rank, world = _rank_info(optimizer)
    payload = {"kind": KIND, "format": FORMAT_VERSION, "rank": rank, "world_size": world,
               "param_shapes": _shapes(optimizer), "optimizer": optimizer.state_dict()}
    path = rank_file(directory, rank, world)
    atomic_torch_save(payload, path)
    return path


def read(path: str) -> dict:
    """Load and validate one file (never unpickles arbitrary objects)."""
    if not os.path.exists(path):
        raise CheckpointError(f"LionCub checkpoint file not found: {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, bad pickle, foreign object...
        raise CheckpointError(f"LionCub checkpoint {path} is corrupted or truncated "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
    if not isinstance(payload, dict) or payload.get("kind") != KIND:
        raise CheckpointError(f"{path} is not a LionCub optimizer checkpoint")
    if payload.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format {payload.get('format')!r}; this lioncub_ds reads "
                              f"format {FORMAT_VERSION}")
    return payload


def _check_fits(payload, optimizer, path):
    want = _shapes(optimizer)
    got = payload.get("param_shapes")
    if got is None or len(got) != len(want):
        raise CheckpointError(f"{path} holds state for {len(got or [])} parameters; the optimizer has {len(want)}")
    for i, (a, b) in enumerate(zip(got, want)):
        if list(a) != list(b):
            raise CheckpointError(f"{path}: parameter #{i} has shape {tuple(a)} in the checkpoint but {tuple(b)} "
                                  "in the optimizer")


def load(optimizer, directory: str, reshard: str = "average") -> str:
    """Load this rank's state from ``directory`` (see module doc for ``reshard``)."""
    if reshard not in RESHARD_POLICIES:
        raise ValueError(f"reshard={reshard!r} is not allowed; allowed: {', '.join(RESHARD_POLICIES)}")
    rank, world = _rank_info(optimizer)
    path = rank_file(directory, rank, world)
    if os.path.exists(path):
        payload = read(path)
        if payload["world_size"] != world or payload["rank"] != rank:
            raise CheckpointError(f"{path} claims rank {payload['rank']} of {payload['world_size']}")
        _check_fits(payload, optimizer, path)
        optimizer.load_state_dict(payload["optimizer"])
        return path
    found = sorted(glob.glob(os.path.join(directory, "lioncub-rank*-of-*.pt")))
    worlds = {int(_NAME.search(f).group(2)) for f in found if _NAME.search(f)}
    if not worlds:
        raise CheckpointError(f"no LionCub checkpoint files in {directory}")
    if len(worlds) > 1:
        raise CheckpointError(f"{directory} mixes checkpoints of world sizes {sorted(worlds)}")
    old_world = worlds.pop()
    if reshard == "error":
        raise CheckpointError(f"{directory} was saved by {old_world} ranks; this run has {world} "
                              "(pass reshard='average' to start every rank from the mean momentum)")
    payloads = []
    for r in range(old_world):
        p = rank_file(directory, r, old_world)
        payloads.append(read(p))
        _check_fits(payloads[-1], optimizer, p)
    merged = average_states([pl["optimizer"] for pl in payloads])
    log.warning("LionCub: resharding optimizer state from %d to %d ranks by averaging momenta", old_world, world)
    optimizer.load_state_dict(merged)
    return directory


def average_states(states: list[dict]) -> dict:
    """Mean of several ranks' state dicts (momenta averaged in fp32; steps must agree)."""
    first = states[0]
    out = {k: v for k, v in first.items() if k != "state"}
    out["state"] = {}
    for idx, st in first["state"].items():
        merged = dict(st)
        if "exp_avg" in st:
            acc = torch.zeros_like(st["exp_avg"], dtype=torch.float32)
            for s in states:
                acc += s["state"][idx]["exp_avg"].float()
            merged["exp_avg"] = (acc / len(states)).to(st["exp_avg"].dtype)
        out["state"][idx] = merged
    if "lioncub" in first:
        out["lioncub"] = dict(first["lioncub"])
    return out
