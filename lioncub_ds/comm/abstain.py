"""Abstentions on the wire (docs/conventions.md, "Abstentions"): few as a list, many as a plane.

A coordinate whose c is exactly 0 (or non-finite) abstains: its bit in the rank's *nonzero
plane* is 0. Every rank knows where the real elements of a bucket are (the *mask*: bit 1 at
real elements, 0 at padding), so a rank only needs to say where its nonzero plane differs
from the mask, byte by byte. Per bucket and step, every rank uses the same mode:

* ``list``: int32 words ``[count, idx_0..idx_{K-1}, val_0..val_{K-1}]``: ``count`` bytes of the
  plane differ from the mask; the first K of them (in index order) are listed as (byte index,
  plane byte); unused slots hold idx = -1. A rank with count > K *overflows*: the step's flag
  all-reduce says so, and that bucket's planes are then all-gathered in full (exact either way).
  A small bucket has K = 0: its list is the count alone (4 bytes).
* ``plane``: the whole nonzero plane, for the step after a bucket overflowed (many
  abstentions tend to persist, e.g. embedding rows nobody has used yet). Algorithms whose shard
  owner decides Δ alone send each rank only its shard of the plane
  (``VoteAlgorithm.shards_planes``; the same after an overflow).

The capacity K is fixed per bucket (from its size and N), so every message has the same size on
every rank: no size exchange, no host synchronisation. A rank's list is built by its kernel
backend's ``abstain_list`` (the reference, :func:`lioncub_ds.kernels.reference.abstain_list`,
is pure torch with fixed-size outputs: ``torch.nonzero_static``); decoding below is pure torch.
"""
from __future__ import annotations

import torch

WORD = 4  # bytes of one int32 list word


def list_capacity(plane_bytes: int, world_size: int) -> int:
    """K: entries of a rank's list in a bucket whose planes have ``plane_bytes`` bytes.

    A list reaches every other rank, so N lists cost (N−1)·4·(1+2K) bytes per rank: with
    K = plane_bytes / (1024·N) that is about 1/256 of the 1bit vote's own
    2·(N−1)/N·plane_bytes (1bit stays 31.9x below an fp32 all-reduce). 0 for small buckets
    (a count alone)."""
    return plane_bytes // (1024 * max(1, world_size))


def list_words(capacity: int) -> int:
    return 1 + 2 * capacity


def payload_bytes(mode: str, plane_bytes: int, capacity: int) -> int:
    """Bytes of one rank's abstention payload for a bucket."""
    return plane_bytes if mode == "plane" else WORD * list_words(capacity)


def real_mask(offsets, numels, total: int, device) -> torch.Tensor:
    """uint8 plane of ``total`` elements with bit 1 exactly at the parameters' elements.

    Built byte-wise (offsets are multiples of 8): full bytes 0xFF, a parameter's last partial
    byte its low bits (LSB first), in total/8 bytes of memory."""
    mask = torch.zeros(total // 8, dtype=torch.uint8, device=device)
    for off, n in zip(offsets, numels):
        if off % 8:
            raise ValueError(f"real_mask: parameter offsets must be multiples of 8, got {off}")
        start, full = off // 8, n // 8
        mask[start:start + full] = 0xFF
        if n % 8:
            mask[start + full] = (1 << (n % 8)) - 1
    return mask


def decode_lists(lists: torch.Tensor, mask: torch.Tensor, capacity: int) -> torch.Tensor:
    """Every rank's nonzero plane (uint8 [N, B]) from their lists (int32 [N, 1 + 2K]).

    Exact when no rank overflowed (count <= K); the caller checks that through the flags."""
    n, nbytes = lists.shape[0], mask.numel()
    planes = torch.empty(n, nbytes + 1, dtype=torch.uint8, device=mask.device)
    planes[:, :nbytes] = mask
    if capacity:
        idx = lists[:, 1:1 + capacity].to(torch.int64)
        idx = torch.where(idx < 0, torch.full_like(idx, nbytes), idx)  # unused slots hit the spare column
        planes.scatter_(1, idx, lists[:, 1 + capacity:].to(torch.uint8))
    return planes[:, :nbytes]


def any_voter(planes: torch.Tensor) -> torch.Tensor:
    """Bitwise OR of N nonzero planes [N, B]: bit 1 where at least one rank voted."""
    out = planes[0].clone()
    for i in range(1, planes.shape[0]):
        out |= planes[i]
    return out
