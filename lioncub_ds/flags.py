"""The step's flag vector: what each rank reports, how it is packed for the wire (for every rank
of the step), and the hash of the step's hyper-parameters. Summed over every rank of the step
(the vote group's sum, then the sharding strategy's, on the device: :mod:`lioncub_ds.sharding`),
it is the step's one host read, and every decision that must be the same everywhere is taken
from it (:mod:`lioncub_ds.pipeline`).
"""
from __future__ import annotations

import hashlib

import torch

from .lion import lr_value
from .telemetry import ring_bytes

# The step's flag tensor (int32), summed over ranks:
#   [0] ranks with a non-finite value, [1] ranks with an unusable input, [2] non-finite values in
#   all (each rank's count capped at 2**20), [3] ranks where some voting parameter has no gradient,
#   [4] ranks whose gradients changed after their bucket voted in backward,
#   [5 .. 5+HYPER_BITS) one bit each of a hash of this step's lr, weight decay and betas (every
#   group): a sum strictly between 0 and N means the ranks disagree,
# then per bucket two entries, by the bucket's abstention mode (comm/abstain.py): in list mode [ranks
# whose list overflowed, ranks with an abstention]; in chunks and plane modes [ranks whose list would
# overflow, ranks whose chunk list overflowed].
# On the wire every entry but the non-finite value count is a count of ranks (≤ N), so two share
# one int32 word in 16-bit lanes (N < 2**15: the sums never carry into the next lane).
# With momentum_sync schedule="drift" one more full word follows the count: this rank's vote
# disagreement with the previous applied step's Δ (momentum_sync.disagreement_units, ≤ 2**31/N),
# summed like the rest; unpacked, it comes last (index FLAG_HEAD + 2·buckets).
NONFINITE_RANKS, UNUSABLE_RANKS, NONFINITE_VALUES, MISSING_RANKS, CHANGED_RANKS, HYPER = range(6)
# 32 bits: a disagreement that hashes alike passes once in 2**32 steps (8 bits let one in 256
# one-step lr mismatches through, and the parameters drifted apart unseen)
HYPER_BITS = 32
FLAG_HEAD = HYPER + HYPER_BITS
PACKED_BELOW = 2 ** 15

def host_values_on(values: list, device) -> torch.Tensor:
    """Host-known int32 values as a tensor on the step's device without a stream synchronisation:
    a pageable host-to-CUDA copy (``torch.tensor(..., device="cuda")``) waits for the queued
    kernels, which would add a second host sync to the step; a pinned buffer copies asynchronously."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=torch.int32, device=device)
    pinned = torch.tensor(values, dtype=torch.int32, device="cpu").pin_memory()
    return pinned.to(device, non_blocking=True)


def flag_words(n_buckets: int, world_size: int, drift: bool = False) -> int:
    """int32 words of the packed flag vector (``drift``: with the drift schedule's word)."""
    lanes = 2 if world_size < PACKED_BELOW else 1
    return 1 + int(drift) + (FLAG_HEAD - 1 + 2 * n_buckets + lanes - 1) // lanes


def flag_head_words(world_size: int, drift: bool = False) -> int:
    """The packed words that hold the step-wide head (the per-bucket entries follow, word-aligned:
    FLAG_HEAD - 1 is even)."""
    return 1 + int(drift) + (FLAG_HEAD - 1) // (2 if world_size < PACKED_BELOW else 1)


def pack_flags(logical: torch.Tensor, world_size: int, drift: torch.Tensor | None = None) -> torch.Tensor:
    """The flag vector as sent: the non-finite value count, the drift word (``drift``: int32 [1],
    schedule="drift" only), then the rank counts two per word."""
    count = logical[NONFINITE_VALUES:NONFINITE_VALUES + 1]
    if drift is not None:
        count = torch.cat([count, drift.reshape(1).to(count.dtype)])
    rest = torch.cat([logical[:NONFINITE_VALUES], logical[NONFINITE_VALUES + 1:]])
    if world_size >= PACKED_BELOW:
        return torch.cat([count, rest])
    if rest.numel() % 2:
        rest = torch.cat([rest, rest.new_zeros(1)])
    pairs = rest.view(-1, 2)
    return torch.cat([count, pairs[:, 0] + pairs[:, 1] * 65536])


def unpack_flags(words: list, n_buckets: int, world_size: int, drift: bool = False) -> list:
    """The summed packed words -> the logical flag list (indices as named above; ``drift``: the
    summed drift word last, at :func:`drift_index`)."""
    count, rest = words[0], words[1 + int(drift):]
    if world_size < PACKED_BELOW:
        rest = [x for w in rest for x in (w & 0xFFFF, w >> 16)]
    rest = rest[:FLAG_HEAD - 1 + 2 * n_buckets]
    return rest[:NONFINITE_VALUES] + [count] + rest[NONFINITE_VALUES:] + ([words[1]] if drift else [])


def drift_index(n_buckets: int) -> int:
    """Where the unpacked flag list holds the summed drift word (schedule="drift")."""
    return FLAG_HEAD + 2 * n_buckets


def flag_bytes(n_buckets: int, world_size: int, carried: bool, drift: bool = False) -> int:
    """Bytes one rank sends per step for the flags: carried in a gather-like first phase (to every
    other rank), or in their own all-reduce (ring); ``drift``: with the drift schedule's word."""
    words = 4 * flag_words(n_buckets, world_size, drift)
    return (world_size - 1) * words if carried else ring_bytes("all_reduce", words, world_size)


def hyper_values(param_groups) -> list[tuple]:
    """Per param group, the hyper-parameters every rank must apply alike this step."""
    return [(lr_value(g["lr"]), float(g["weight_decay"]), tuple(float(b) for b in g["betas"])) for g in param_groups]


def hyper_bits(values: list[tuple], step: int) -> list[int]:
    """HYPER_BITS bits of a hash of this step's hyper-parameters (:func:`hyper_values`, read once per
    step: a tensor lr is read on the host once per step and group), salted with the step number so a
    lasting disagreement that happens to collide once is caught at the next step."""
    digest = hashlib.blake2b(repr((step, values)).encode(), digest_size=HYPER_BITS // 8).digest()
    word = int.from_bytes(digest, "little")
    return [(word >> k) & 1 for k in range(HYPER_BITS)]


def hyper_disagree(flags, world_size: int) -> bool:
    return any(0 < x < world_size for x in flags[HYPER:HYPER + HYPER_BITS])
