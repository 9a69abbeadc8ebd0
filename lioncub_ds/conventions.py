"""The fixed conventions of lioncub_ds (docs/conventions.md) that both the kernels and the
communication algorithms (and the settings) need: the names of the rules, modes and kinds and their
kernel codes, the padding of a bucket, the width of a p-bit lane, the int8 level count and the
tie-index table.

This module sits below both sides: it imports neither ``lioncub_ds.kernels`` nor ``lioncub_ds.comm``,
so comm/ and config.py can follow a convention without depending on the kernels (the backend is passed
in; tests/test_layering.py keeps it so). ``lioncub_ds.kernels.reference`` re-exports every name here,
as part of the executable contract.
"""
from __future__ import annotations

import functools

import torch

# The one Python declaration of the rule / mode / kind names; the code the kernels use for a
# name is its position here (csrc/common/lioncub_common.h declares the same enums).
TIE_RULES = ("zero", "alternate", "hash")
VOTE_MODES = ("majority", "average")
SCALE_KINDS = ("l1", "l0", "linf")
LANE_WIDTHS = (1, 2, 4, 8)
TIE_CODES = {name: i for i, name in enumerate(TIE_RULES)}
VOTE_CODES = {name: i for i, name in enumerate(VOTE_MODES)}
SCALE_CODES = {name: i for i, name in enumerate(SCALE_KINDS)}
# comm="bbit": how a code is rounded, and the code widths b a rank may send (see reference.bbit_codes).
ROUNDINGS = ("nearest", "dither")
ROUNDING_CODES = {name: i for i, name in enumerate(ROUNDINGS)}
VOTE_BITS = (1, 2, 3, 4)


def enum_code(kind: str, value) -> int:
    """The kernel code of ``value`` for ``kind`` ('tie_break', 'vote', 'quant scale' or 'rounding'); a
    ValueError that names the argument and the allowed values otherwise."""
    table, names = {"tie_break": (TIE_CODES, TIE_RULES), "vote": (VOTE_CODES, VOTE_MODES),
                    "quant scale": (SCALE_CODES, SCALE_KINDS), "rounding": (ROUNDING_CODES, ROUNDINGS)}[kind]
    try:
        return table[value]
    except (KeyError, TypeError):
        raise ValueError(f"{kind} must be one of {names}, got {value!r}") from None


def padded_numel(numel: int, world_size: int) -> int:
    """Smallest multiple of 8*world_size that holds ``numel`` elements."""
    unit = 8 * max(1, world_size)
    return (numel + unit - 1) // unit * unit


def lane_bits_for(n: int) -> int:
    """Smallest lane width p in {1,2,4,8} with 2**p - 1 >= n (a lane never carries)."""
    for p in LANE_WIDTHS:
        if (1 << p) - 1 >= n:
            return p
    raise ValueError(f"a count of up to {n} does not fit an 8-bit lane (needs 2**p - 1 >= {n}, p <= 8)")


def int8_levels(world_size: int) -> int:
    """s = floor(127 / N): |sum of N codes| <= N*s <= 127, so an int8 SUM never overflows."""
    s = 127 // world_size
    if s < 1:
        raise ValueError(f"int8 quantization needs world size <= 127, got {world_size}")
    return s


def tie_segments(offsets, param_starts=None, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """The tie-index table of a bucket (or of the slice [start, stop) of it, e.g. a 1bit shard).

    ``offsets``: bucket position of each parameter (piece); ``param_starts``: the index inside
    its parameter of each piece's first element (None: every parameter starts whole, at 0).
    Returns int64 [K, 2] rows (pos, index), sorted by pos, rows[0].pos == 0, positions relative
    to ``start``: position p has tie index rows[k].index + (p - rows[k].pos) for the last row k
    with rows[k].pos <= p. Positions before the first parameter count from 0; padding and gaps
    continue the numbering of the parameter before them. Parameters at the same offset (empty
    ones) give one row: the first listed.
    """
    offs = tuple(int(o) for o in (offsets.tolist() if isinstance(offsets, torch.Tensor) else offsets))
    firsts = (0,) * len(offs) if param_starts is None else tuple(int(v) for v in param_starts)
    if len(firsts) != len(offs):
        raise ValueError(f"param_starts has {len(firsts)} entries but offsets has {len(offs)}")
    return _tie_table(offs, firsts, int(start), None if stop is None else int(stop))


@functools.lru_cache(maxsize=4096)
def _tie_table(offs, firsts, start, stop) -> torch.Tensor:
    """tie_segments' table, built once per bucket (and shard) and then the same tensor on every call:
    a vote step asks for it per bucket, and the kernels keep its device copy by its identity
    (lioncub_ds/kernels/ops.py). Read-only: nothing writes into a tie-index table."""
    by_pos = {}
    for pos, idx in zip(offs, firsts):  # an empty parameter shares its offset with the next one: one row
        by_pos[pos] = idx if pos not in by_pos else by_pos[pos]
    rows = sorted(by_pos.items())
    if not rows or rows[0][0] > 0:
        rows.insert(0, (0, 0))
    k = 0
    while k + 1 < len(rows) and rows[k + 1][0] <= start:
        k += 1
    out = [(0, rows[k][1] + (start - rows[k][0]))]
    out += [(pos - start, idx) for pos, idx in rows[k + 1:] if stop is None or pos < stop]
    return torch.tensor(out, dtype=torch.int64, device="cpu").reshape(-1, 2)  # a host table
