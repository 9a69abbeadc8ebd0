"""Abstentions on the wire (docs/conventions.md, "Abstentions"): few as a list, runs as chunks, many as a plane.

A coordinate whose c is exactly 0 (or non-finite) abstains: its bit in the rank's *nonzero
plane* is 0. Every rank knows where the real elements of a bucket are (the *mask*: bit 1 at
real elements, 0 at padding), so a rank only needs to say where its nonzero plane differs
from the mask. Per bucket and step, every rank uses the same mode:

* ``list``: int32 words ``[count, idx_0..idx_{K-1}, val_0..val_{K-1}]``: ``count`` bytes of the
  plane differ from the mask; the first K of them (in index order) are listed as (byte index,
  plane byte); unused slots hold idx = -1. A rank with count > K *overflows*: the step's flag
  all-reduce says so, and that bucket's planes are then fetched in full (exact either way).
  A small bucket has K = 0: its list is the count alone (4 bytes).
* ``chunks``: for zeros that come in runs (embedding rows nobody has used yet, whole tensors).
  The plane is cut into *chunks* of 8 bytes (64 elements of the bucket); a rank sends one bit
  per chunk, 1 where its whole chunk abstains, and a list (capacity :func:`chunk_capacity`) of
  the bytes where its plane differs from the *base*: the mask with those chunks cleared. A run
  of abstentions costs 1 bit per chunk it covers, plus the bytes of the chunks at its ends that
  it covers in part. A chunk list that overflows fetches the planes, as in list mode. An algorithm
  whose shard owner decides Δ alone sends rank r the list and only the bits of the chunks that
  touch shard r (``VoteAlgorithm.shards_planes``; :class:`ChunkCode`).
* ``plane``: the whole nonzero plane (scattered abstentions that overflow both lists). Algorithms
  whose shard owner decides Δ alone send each rank only its shard of the plane (the same for
  the planes fetched after an overflow).

The capacities are fixed per bucket (from its size and N), so every message has the same size on
every rank: no size exchange, no host synchronisation. The two flag entries of a bucket (summed
over ranks, read with the step's one host read) mean, per mode (:func:`encode`):

* list: [ranks whose list overflows, ranks that abstain];
* chunks and plane: [ranks whose *list* would overflow, ranks whose *chunk list* overflows].

From them every rank takes the same decisions: :func:`plane_source` (this step: no planes, the
payloads, or fetch the planes) and :func:`next_mode` (the next step's mode). A rank's lists are
built by its kernel backend's ``abstain_list`` (the reference,
:func:`lioncub_ds.kernels.reference.abstain_list`, pure torch with fixed-size outputs:
``torch.nonzero_static``), run against the mask or the base; the chunk bits, the base and all
decoding are pure torch on the planes' device (this module: comm never imports the kernels).
"""
from __future__ import annotations

import torch

WORD = 4  # bytes of one int32 list word
MODES = ("list", "chunks", "plane")
CHUNK = 8  # bytes of a chunk (64 elements): an embedding row of 64·k elements at a 64-aligned
#            offset in its bucket is whole chunks


def list_capacity(plane_bytes: int, world_size: int) -> int:
    """K: entries of a rank's list in a bucket whose planes have ``plane_bytes`` bytes.

    A list reaches every other rank, so N lists cost (N−1)·4·(1+2K) bytes per rank: with
    K = plane_bytes / (1024·N) that is about 1/256 of the 1bit vote's own
    2·(N−1)/N·plane_bytes (1bit stays 31.9x below an fp32 all-reduce). 0 for small buckets
    (a count alone)."""
    return plane_bytes // (1024 * max(1, world_size))


def chunk_capacity(plane_bytes: int, world_size: int) -> int:
    """Entries of a rank's list in chunks mode: 4x the list mode's, about 1/64 of the 1bit vote
    (the bytes at the ends of runs, which chunks leave to the list)."""
    return plane_bytes // (256 * max(1, world_size))


def list_words(capacity: int) -> int:
    return 1 + 2 * capacity


class ChunkCode:
    """The chunks-mode payload of one bucket (same on every rank: from its size and N).

    The chunks are the bucket plane's bytes 8j .. 8j+7 (64 elements, ``CHUNK`` bytes), the last
    one zero-padded, whatever the shards: an embedding whose rows are 64·k elements and which
    starts at a multiple of 64 elements in its bucket (the first parameter of a bucket does) has
    its unused rows as whole chunks. A chunk can straddle two shards, so a shard owner receives
    a *window* of ``window`` chunk bits, from chunk ⌊r·S/8⌋ (S: shard bytes), that covers its
    shard; bits outside the shard are ignored (sender) or neutral (phase 2: 1 = full).

    Whole payload: ``[list words (4·(1+2K) bytes) | the zero bits of every chunk]``; a shard
    owner's row: ``[list words | the zero bits of its window]``; bits LSB first (chunk j: bit j%8
    of byte j/8), zero-padded to whole bytes."""

    def __init__(self, plane_bytes: int, world_size: int):
        self.n = max(1, world_size)
        self.plane_bytes = plane_bytes
        self.shard = plane_bytes // self.n
        self.chunks = (plane_bytes + CHUNK - 1) // CHUNK
        self.window = (self.shard + CHUNK - 1) // CHUNK + 1  # chunks a shard can touch
        self.bits_bytes = (self.chunks + 7) // 8
        self.window_bytes = (self.window + 7) // 8
        self.capacity = chunk_capacity(plane_bytes, self.n)
        self.list_bytes = WORD * list_words(self.capacity)

    @property
    def payload_bytes(self) -> int:
        """Bytes of a whole payload (every chunk's bit: algorithms that count on every rank)."""
        return self.list_bytes + self.bits_bytes

    @property
    def shard_payload_bytes(self) -> int:
        """Bytes a shard owner receives from each rank: the list and its window's bits."""
        return self.list_bytes + self.window_bytes

    def offset(self, rank: int) -> int:
        """Byte of shard ``rank``'s start inside its window."""
        return rank * self.shard % CHUNK

    def _padded(self, plane: torch.Tensor) -> torch.Tensor:
        """[..., plane bytes] -> [..., chunks, CHUNK] (zero-padded)."""
        pad = self.chunks * CHUNK - self.plane_bytes
        if pad:
            plane = torch.nn.functional.pad(plane, (0, pad))
        return plane.view(*plane.shape[:-1], self.chunks, CHUNK)

    def _windows(self, device) -> torch.Tensor:
        """int64 [N, window]: chunk index of each owner's window bits (may run past the last chunk)."""
        first = torch.arange(self.n, device=device) * self.shard // CHUNK
        return first.view(-1, 1) + torch.arange(self.window, device=device)

    @staticmethod
    def bytes_of(chunk_flags: torch.Tensor) -> torch.Tensor:
        """bool [..., k chunks] -> [..., k·CHUNK] (each chunk's flag on each of its bytes)."""
        return chunk_flags.unsqueeze(-1).expand(*chunk_flags.shape, CHUNK).reshape(*chunk_flags.shape[:-1], -1)

    def zero_chunks(self, nonzero: torch.Tensor) -> torch.Tensor:
        """bool [chunks]: chunks where the plane is all zero (every element abstains or is padding)."""
        return (self._padded(nonzero) == 0).all(-1)

    def base(self, mask: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """The mask with the zero chunks cleared ([..., plane bytes] from zero [..., chunks])."""
        return mask.masked_fill(self.bytes_of(zero)[..., :self.plane_bytes], 0)

    def payload_rows(self, payload: torch.Tensor) -> torch.Tensor:
        """[N, shard_payload_bytes]: row r = the list and the zero bits of shard r's window (what
        the owner of shard r receives when the planes travel sharded)."""
        bits = payload[self.list_bytes:]
        zero = unpack_rows(bits.view(1, -1), self.chunks)[0]
        idx = self._windows(bits.device).clamp_(max=self.chunks - 1)  # past the end: ignored by the owner
        lst = payload[:self.list_bytes].view(1, -1).expand(self.n, -1)
        return torch.cat([lst, pack_rows(zero[idx])], dim=1)

    def decode(self, received: torch.Tensor, mask: torch.Tensor, rank: int | None = None):
        """Every rank's nonzero plane from its payload: (planes, lists).

        ``rank`` None: ``received`` is [N, payload_bytes] (whole payloads) -> planes [N, plane bytes].
        Else it is [N, shard_payload_bytes] (the list and the bits of shard ``rank``'s window, the
        sharded form) -> shard ``rank`` of every rank's plane [N, shard]. ``lists``: int32
        [N, 1+2K] (the result's nonzero plane is rebuilt from them: :meth:`result_nonzero`). Exact
        when no rank's list overflowed (the caller checks that through the flags)."""
        lists = words_of(received[:, :self.list_bytes])
        bits = received[:, self.list_bytes:]
        if rank is None:
            zero = unpack_rows(bits, self.chunks)
            return scatter_lists(self.base(mask.view(1, -1), zero), lists, self.capacity), lists
        lo, off = rank * self.shard, self.offset(rank)
        zero = self.bytes_of(unpack_rows(bits, self.window))[:, off:off + self.shard]
        return scatter_lists(mask[lo:lo + self.shard].view(1, -1).masked_fill(zero, 0), lists, self.capacity,
                             start=lo), lists

    def full_bits(self, result_nonzero: torch.Tensor, mask_shard: torch.Tensor, rank: int) -> torch.Tensor:
        """The shard owner's phase-2 side message: uint8 [window_bytes], bit 1 at the chunks of its
        window where the result's nonzero plane equals the mask on every byte of the chunk that
        lies in its shard (so 1 where none does: neutral when the owners' bits are combined)."""
        off = self.offset(rank)
        equal = result_nonzero == mask_shard
        equal = torch.nn.functional.pad(equal, (off, self.window * CHUNK - off - self.shard), value=True)
        return pack_rows(equal.view(1, self.window, CHUNK).all(-1)).view(-1)

    def result_nonzero(self, full_bits: torch.Tensor, lists: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The result's nonzero plane [plane bytes] (Δ ≠ 0 exactly where some rank voted) from every
        shard owner's :meth:`full_bits` [N, window_bytes] and every rank's chunk list [N, 1+2K].

        Exact: a chunk where some rank sent all its real elements is full in the result; in every
        other chunk a rank either abstains throughout (it lists nothing there) or differs from
        the base, which is the mask there, so it lists each byte that is not the mask's, and its
        other bytes are the mask's. The result there is the OR of those ranks' chunks."""
        windows = unpack_rows(full_bits, self.window)                          # [N, window]
        full = torch.ones(self.chunks + self.window, dtype=torch.bool, device=mask.device)
        full.scatter_reduce_(0, self._windows(mask.device).reshape(-1), windows.reshape(-1), "amin")  # AND
        full = self.bytes_of(full[:self.chunks])[:self.plane_bytes]
        if self.capacity:
            idx = lists[:, 1:1 + self.capacity].to(torch.int64)
            listed = torch.zeros(lists.shape[0], self.chunks + 1, dtype=torch.bool, device=mask.device)
            listed.scatter_(1, torch.where(idx < 0, torch.full_like(idx, self.chunks), idx // CHUNK), True)
            rows = mask.view(1, -1).masked_fill(~self.bytes_of(listed[:, :self.chunks])[:, :self.plane_bytes], 0)
            voted = any_voter(scatter_lists(rows, lists, self.capacity))
        else:
            voted = torch.zeros_like(mask)
        return torch.where(full, mask, voted)


def words_of(columns: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 4k] (received columns) -> int32 [N, k]: a view where the columns are contiguous
    and start on a 4-byte boundary, else an aligned copy (a column of a one-row message, or one
    that follows an odd number of vote bytes, starts anywhere)."""
    if columns.is_contiguous() and columns.storage_offset() % 4 == 0 and all(st % 4 == 0 for st in columns.stride()[:-1]):
        return columns.view(torch.int32)  # (a one-row slice is contiguous whatever its row stride)
    return columns.clone(memory_format=torch.contiguous_format).view(torch.int32)


def pack_rows(bits: torch.Tensor) -> torch.Tensor:
    """bool [R, W] -> uint8 [R, ceil(W/8)], LSB first (the bit order of every plane), zero-padded."""
    rows, width = bits.shape
    pad = (-width) % 8
    b = torch.nn.functional.pad(bits.to(torch.uint8), (0, pad)).view(rows, -1, 8)
    # made on the device: a small host tensor copied to CUDA would wait for the queued kernels
    weights = torch.ones(8, dtype=torch.uint8, device=bits.device) << torch.arange(8, dtype=torch.uint8,
                                                                                   device=bits.device)
    return (b * weights).sum(dim=2, dtype=torch.uint8)


def unpack_rows(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: uint8 [R, w] -> bool [R, width]."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).view(packed.shape[0], -1)[:, :width].bool()


def scatter_lists(base: torch.Tensor, lists: torch.Tensor, capacity: int, start: int = 0) -> torch.Tensor:
    """Planes [N, B] = ``base`` ([N or 1, B]) with each rank's listed bytes written in (its row of
    ``lists``, int32 [N, 1+2K]); entries outside bytes [start, start + B) are skipped (a shard)."""
    n, nbytes = lists.shape[0], base.shape[-1]
    planes = torch.empty(n, nbytes + 1, dtype=torch.uint8, device=base.device)
    planes[:, :nbytes] = base
    if capacity:
        idx = lists[:, 1:1 + capacity].to(torch.int64) - start
        outside = (idx < 0) | (idx >= nbytes)  # unused slots (-1) and other shards hit the spare column
        idx = torch.where(outside, torch.full_like(idx, nbytes), idx)
        planes.scatter_(1, idx, lists[:, 1 + capacity:].to(torch.uint8))
    return planes[:, :nbytes]


def payload_bytes(mode: str, plane_bytes: int, capacity: int, world_size: int = 1) -> int:
    """Bytes of one rank's whole abstention payload for a bucket (``capacity``: the list mode's)."""
    if mode == "plane":
        return plane_bytes
    if mode == "chunks":
        return ChunkCode(plane_bytes, world_size).payload_bytes
    return WORD * list_words(capacity)


_THRESHOLDS: dict = {}


def _list_thresholds(capacity: int, device) -> torch.Tensor:
    """int32 [capacity, 0] on ``device``, made once per (capacity, device): a list's count is compared
    with both at once."""
    key = (capacity, device)
    t = _THRESHOLDS.get(key)
    if t is None:
        t = _THRESHOLDS[key] = torch.tensor([capacity, 0], dtype=torch.int32, device=device)
    return t


def encode(nonzero: torch.Tensor, mask: torch.Tensor, mode: str, capacity: int, world_size: int, backend):
    """This rank's abstention payload (uint8, 1-D) in ``mode`` and its two flag entries (int32 [2],
    on the device; meaning per mode in the module docstring). ``capacity``: the list mode's K."""
    if mode == "list":
        words = backend.abstain_list(nonzero, mask, capacity)
        # [count > capacity, count > 0] in two torch ops (this runs once per bucket and step)
        return words.view(torch.uint8), torch.gt(words[:1], _list_thresholds(capacity, words.device)).to(torch.int32)
    if mode not in MODES:
        raise ValueError(f"abstention mode must be one of {MODES}, got {mode!r}")
    code = ChunkCode(nonzero.numel(), world_size)
    zero = code.zero_chunks(nonzero)
    base = code.base(mask, zero)
    long = backend.abstain_list(nonzero, mask, 0)[0]  # a list's count: whether list mode would do
    if mode == "chunks":
        words = backend.abstain_list(nonzero, base, code.capacity)
        payload = torch.cat([words.view(torch.uint8), pack_rows(zero.view(1, -1)).view(-1)])
    else:
        words, payload = backend.abstain_list(nonzero, base, 0), nonzero
    return payload, torch.stack([(long > capacity).to(torch.int32), (words[0] > code.capacity).to(torch.int32)])


def summed_flags(planes, mask: torch.Tensor, mode: str, capacity: int, world_size: int, backend) -> tuple[int, int]:
    """A bucket's two flag entries summed over ranks, from every rank's nonzero plane (an iterable
    of uint8 [B]): what the step's flags carry, by the same :func:`encode` (for a simulation of
    the step, e.g. benchmarks.converge: then :func:`plane_source` and :func:`next_mode`)."""
    first = second = 0
    for nonzero in planes:
        f, s = encode(nonzero.contiguous(), mask, mode, capacity, world_size, backend)[1].tolist()
        first, second = first + f, second + s
    return first, second


def plane_source(mode: str, first: int, second: int) -> str:
    """Where this step's nonzero planes come from, from a bucket's summed flag entries: "none"
    (nobody abstains: every vote counts), "fetch" (some rank's list, or chunk list, overflowed:
    the planes travel once more) or "payload" (decoded from what phase 1 carried)."""
    if mode == "list":
        return "none" if second == 0 else "fetch" if first > 0 else "payload"
    if mode == "chunks":
        return "fetch" if second > 0 else "payload"
    return "payload"


def next_mode(mode: str, first: int, second: int) -> str:
    """The next step's mode, from this step's mode and summed flag entries (the same on every
    rank): a list while every rank's list fits; chunks while every rank's chunk list fits; else
    the plane. A list that overflows tries chunks first (the flags of list mode do not say
    whether chunks would fit)."""
    if first == 0:
        return "list"
    if mode == "list":
        return "chunks"
    return "plane" if second > 0 else "chunks"


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
    return scatter_lists(mask.view(1, -1), lists, capacity)


def any_voter(planes: torch.Tensor) -> torch.Tensor:
    """Bitwise OR of N nonzero planes [N, B]: bit 1 where at least one rank voted."""
    out = planes[0].clone()
    for i in range(1, planes.shape[0]):
        out |= planes[i]
    return out
