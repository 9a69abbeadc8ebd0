"""The small interface every vote algorithm implements, and the collectives it uses.

An algorithm receives one bucket's local votes (packed planes, or int8 codes), runs
its collectives through :class:`Collectives` (which counts bytes and time), and
applies the agreed Δ to the bucket's parameters through the kernel backend. It also
states its own wire-byte formula, which the telemetry tests and the α-β cost model
(``comm="auto"``) both use.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..conventions import tie_segments
from .abstain import (ChunkCode, decode_lists, encode as abstain_encode, list_capacity, next_mode,
                      payload_bytes, plane_source, real_mask, words_of)
from ..groups import broadcast
from ..telemetry import CommStats

# torch ≥ 2.13 renamed the tensor-in/tensor-out all-gather; older torch (GPU images) has only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CollectiveError(RuntimeError):
    """A LionCub collective failed: a rank died or stalled past the timeout, or the network broke.

    The message names the collective, its purpose, this rank, the group size and the
    group's timeout; the backend's own error is chained as ``__cause__``.
    """


def group_timeout_s(group, device) -> float | None:
    """The timeout (seconds) of ``group``'s backend for ``device``; None if torch does not say."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        return pg._get_backend(device).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - private API; the timeout is only used in a message
        return None


class Collectives:
    """torch.distributed collectives over one group, each counted in :class:`CommStats`.

    Every collective is issued with ``async_op=True`` and waited on at once. With
    ``timeout_s`` the wait has that deadline: under NCCL, whose errors otherwise surface at a
    later stream synchronisation outside any ``try`` (or as a watchdog abort), a dead or
    stalled peer then raises :class:`CollectiveError` here, on the host, within ``timeout_s``.
    Without it the wait only orders the current stream after the collective (no host sync on
    CUDA), and the group's own timeout handles a dead peer.
    """

    def __init__(self, group, stats: CommStats, timeout_s: float | None = None, scope: str = "vote_group"):
        self.group = group
        self.scope = scope  # which link the bytes cross (CommStats.by_scope)
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.stats = stats
        self.timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None

    def _failed(self, kind, purpose, t, nbytes, device, exc) -> CollectiveError:
        timeout = group_timeout_s(self.group, device)
        if self.timeout is not None:
            timeout = self.timeout.total_seconds() if timeout is None else min(timeout, self.timeout.total_seconds())
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return CollectiveError(
            f"LionCub: {kind} ({purpose}, {nbytes} bytes) failed on rank {self.rank} of a group of "
            f"{self.world_size} ranks after {time.perf_counter() - t:.1f} s (collective timeout: "
            f"{'unknown' if timeout is None else f'{timeout:g} s'}; LionCub(timeout_s=...) sets it): "
            f"{type(exc).__name__}: {first}. A rank that crashed, was killed or stalled past the timeout "
            "causes this: check the other ranks' logs.")

    def _launch(self, kind, purpose, tensor, launch, out, sent_nbytes, riders=None) -> "Pending":
        t = time.perf_counter()
        try:
            work = launch()
        except RuntimeError as exc:
            raise self._failed(kind, purpose, t, tensor.numel() * tensor.element_size(), tensor.device, exc) from exc
        return Pending(self, kind, purpose, work, out, tensor, sent_nbytes, t, riders)

    def all_gather(self, inp: torch.Tensor, purpose: str, async_op: bool = False, riders: dict | None = None,
                   out: torch.Tensor | None = None):
        """[k] -> [N, k] (row i = rank i's input); with ``async_op`` a :class:`Pending`. ``riders``:
        {purpose: bytes of each rank's input} that serve another purpose (counted under it); ``out``:
        a contiguous buffer of N·k elements to receive into (reused across steps), else a new one."""
        if out is None:
            out = torch.empty(self.world_size * inp.numel(), dtype=inp.dtype, device=inp.device)
        out = out.view(-1)
        src = inp.reshape(-1).contiguous()
        pending = self._launch("all_gather", purpose, inp,
                               lambda: _all_gather_single(out, src, group=self.group, async_op=True),
                               out.view(self.world_size, -1), out.numel() * out.element_size(),
                               {k: self.world_size * v for k, v in (riders or {}).items()})
        return pending if async_op else pending.wait()

    def all_to_all(self, inp: torch.Tensor, purpose: str, async_op: bool = False, riders: dict | None = None,
                   out: torch.Tensor | None = None):
        """[N, k] (row j goes to rank j) -> [N, k] (row i came from rank i). ``riders``: {purpose:
        bytes of each row} that serve another purpose (counted under it); ``out``: a contiguous
        [N, k] buffer to receive into (reused across steps), else a new one."""
        if out is None:
            out = torch.empty_like(inp)
        src = inp.contiguous()
        pending = self._launch("all_to_all", purpose, inp,
                               lambda: dist.all_to_all_single(out, src, group=self.group, async_op=True),
                               out, inp.numel() * inp.element_size(),
                               {k: self.world_size * v for k, v in (riders or {}).items()})
        return pending if async_op else pending.wait()

    def all_reduce_(self, tensor: torch.Tensor, purpose: str, op=dist.ReduceOp.SUM, async_op: bool = False):
        pending = self._launch("all_reduce", purpose, tensor,
                               lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True),
                               tensor, tensor.numel() * tensor.element_size())
        return pending if async_op else pending.wait()

    def broadcast_(self, tensor: torch.Tensor, src_group_rank: int, purpose: str) -> torch.Tensor:
        return self._launch("broadcast", purpose, tensor,
                            lambda: broadcast(tensor, src_group_rank, self.group, async_op=True),
                            tensor, tensor.numel() * tensor.element_size()).wait()


class Pending:
    """An issued collective. :meth:`wait` waits for it (with the deadline of ``timeout_s``),
    counts it in the stats and returns its output; later calls return the output again."""

    def __init__(self, coll: Collectives, kind, purpose, work, out, inp, sent_nbytes, t, riders=None):
        self.coll, self.kind, self.purpose, self.work, self.out = coll, kind, purpose, work, out
        self._in_bytes = inp.numel() * inp.element_size()
        self._device = inp.device
        self._sent, self._t, self._done, self._riders = sent_nbytes, t, False, riders

    def wait(self) -> torch.Tensor:
        if not self._done:
            coll = self.coll
            t_wait = time.perf_counter()
            try:
                if coll.timeout is not None:
                    self.work.wait(coll.timeout)
                else:
                    self.work.wait()
            except RuntimeError as exc:
                raise coll._failed(self.kind, self.purpose, self._t, self._in_bytes, self._device, exc) from exc
            self._done = True
            now = time.perf_counter()
            coll.stats.record_wait(now - t_wait)
            coll.stats.record(self.kind, self.purpose, self._sent, coll.world_size, now - self._t, self._riders,
                              coll.scope)
        return self.out


@dataclass(frozen=True)
class BucketKernels:
    """What the kernels keep of one parameter bucket, made once (the pipeline keeps it on the bucket,
    :meth:`make`): the backend it was made for, the bucket's offsets and parameter starts (the
    objects it was made from), the backend's layout of the bucket (``backend.layout_for``: an
    opaque object, checked once, which the kernel calls take in place of the offsets: no lookup
    per call, and outputs reused from step to step) and the bucket's tie-index table."""
    backend: object
    offsets: list
    param_starts: list | None
    layout: object
    segments: torch.Tensor
    # the tie-index tables of slices of the bucket (a shard owner's), by (start, stop): made once, so
    # that the kernels also know them by identity from step to step
    slices: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def make(cls, backend, offsets, param_starts, numel: int) -> "BucketKernels":
        return cls(backend, offsets, param_starts, backend.layout_for(offsets, numel),
                   tie_segments(offsets, param_starts))

    def slice_segments(self, start: int, stop: int | None) -> torch.Tensor:
        key = (start, stop)
        t = self.slices.get(key)
        if t is None:
            t = self.slices[key] = tie_segments(self.offsets, self.param_starts, start, stop)
        return t

    def fits(self, backend, offsets, param_starts) -> bool:
        """Whether it was made for this backend and these very offsets / starts objects."""
        return self.backend is backend and self.offsets is offsets and self.param_starts is param_starts


@dataclass
class VoteJob:
    """One parameter bucket's vote in one step: local votes in, parameters updated in place."""
    params: list          # the bucket's parameters
    offsets: list         # element offset of each parameter in the bucket (multiples of 8)
    numel: int            # padded bucket size: a multiple of 8·N
    # index inside its parameter of each parameter's first element in this bucket (the hash tie
    # rule keys on the parameter-local index, docs/conventions.md); None: every parameter starts whole, at 0
    param_starts: list | None
    lr: float
    weight_decay: float
    step: int             # 1-based optimizer step
    tie_break: str
    vote: str
    sign: torch.Tensor | None = None     # uint8 [numel/8]: this rank's sign plane
    codes: torch.Tensor | None = None    # int8 [numel] (int8 algorithm)
    # abstentions (comm/abstain.py): mode "list", "chunks" or "plane" (None for int8), this rank's
    # payload (uint8 bytes: the list's int32 words, the chunk code, or the nonzero plane) and nonzero plane
    mode: str | None = None
    capacity: int = 0
    payload: torch.Tensor | None = None
    nonzero: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    # filled after the step's flags: every rank's nonzero plane [N, numel/8], or None when no
    # rank abstained anywhere in the bucket (every vote counts); with ``planes_sharded`` only
    # this rank's shard of every rank's plane [N, numel/8/N] (algorithms that shard planes)
    planes: torch.Tensor | None = None
    planes_sharded: bool = False
    # chunks mode: every rank's chunk list (int32 [N, 1+2K]) when the planes were decoded from the
    # chunk code; a sharded 1bit/bbit vote then rebuilds the result's nonzero plane from them and
    # the shard owners' full-chunk bits (ChunkCode.result_nonzero) instead of sending that plane
    chunk_lists: torch.Tensor | None = None
    # keep_delta (momentum_sync schedule="drift"): ``complete`` leaves the applied Δ of the bucket
    # (fp32 [numel]) in ``delta``, for the vote-disagreement signal; else nothing is materialised
    keep_delta: bool = False
    delta: torch.Tensor | None = None
    # the bucket's BucketKernels (the pipeline's, made once per bucket); used while ``offsets`` and
    # ``param_starts`` are the objects it was made from (a redirect to a master shard changes them)
    kernels: BucketKernels | None = None

    def __post_init__(self):
        if self.param_starts is not None and not isinstance(self.param_starts, (list, tuple)):
            raise TypeError("VoteJob.param_starts must be None or one parameter-local start index per parameter, "
                            f"got {self.param_starts!r} (the hash tie rule no longer takes a flat bucket base)")

    def segments(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The tie-index table of bucket positions [start, stop) (conventions.tie_segments)."""
        k = self.kernels
        if k is not None and k.offsets is self.offsets and k.param_starts is self.param_starts:
            return k.segments if start == 0 and stop is None else k.slice_segments(start, stop)
        return tie_segments(self.offsets, self.param_starts, start, stop)

    @property
    def bucket(self):
        """What the kernel calls take as ``offsets``: the bucket's layout (BucketKernels) while the
        offsets are the ones it was made from, else the offsets."""
        k = self.kernels
        return k.layout if k is not None and k.offsets is self.offsets else self.offsets

    @property
    def plane_bytes(self) -> int:
        return self.numel // 8

    def payloads_from(self, received: torch.Tensor, sharded: bool = False, rank: int = 0) -> torch.Tensor:
        """[N, payload bytes] received -> every rank's nonzero plane [N, numel/8] (mode aware);
        ``sharded`` (plane or chunks mode of an algorithm that shards planes, this being ``rank``):
        what arrived gives only this rank's shard of every rank's plane [N, numel/8/N]. Sets
        ``planes_sharded`` and ``chunk_lists``."""
        self.planes_sharded = sharded and self.mode in ("plane", "chunks")
        self.chunk_lists = None
        if self.mode == "plane":
            return received.contiguous()  # a column of phase 1's output: the kernels take it as one block
        if self.mode == "chunks":
            code = ChunkCode(self.plane_bytes, received.shape[0])
            planes, self.chunk_lists = code.decode(received, self.mask, rank if self.planes_sharded else None)
            return planes
        return decode_lists(words_of(received), self.mask, self.capacity)


class VoteAlgorithm:
    """Interface of a vote algorithm over a *batch* of jobs (parameter buckets whose messages
    travel together, one collective per phase). The step pipeline only calls it, never asks
    which algorithm it holds (tests/test_layering.py):

    * ``abstention_layout(...)`` and ``batch_bytes(numel)``: what a bucket of the layout keeps for
      this algorithm (layout.assign_algorithms) and how much its votes weigh in a batch
      (layout.comm_batches);
    * ``local_step(job, grads, momenta, backend, betas, world_size, seed, momenta_out=None)``: this
      rank's votes for one bucket, encoded as this algorithm sends them, with its abstention payload
      and its two flag entries; ``no_votes(job, device, backend, world_size)``: well-formed zero votes for a
      rank that cannot vote; ``advances_momenta``: whether the local step can write the next momenta
      in its own pass (momentum_double_buffer);
    * ``launch(jobs, coll, backend, flags=None)``: issue phase 1 asynchronously (it may start during
      backward); returns a state object. An algorithm with ``carries_flags`` accepts the step's
      flag vector (int32, this rank's) and sends it to every rank in the same message: the step
      then needs no flag all-reduce of its own; ``flag_rows(state, width)`` gives every rank's
      vector [N, width] once phase 1 has arrived;
    * ``received(state, jobs, coll)``: wait for phase 1; returns per job what arrived of every
      rank's abstention payload (``[N, bytes]``), or None per job where nothing abstention-related
      travels (int8);
    * ``agree_planes(job, received, first, second, coll)``: from the step's summed flags, set
      ``job.planes`` and return how the bucket's abstentions travel next step;
    * ``count(state, jobs, coll, backend)``: (after the step's flags set ``job.planes``) count
      what must be counted before a phase 2 and launch that phase asynchronously, if the
      algorithm has one; returns the state ``complete`` takes (default: ``state`` itself). The
      pipeline runs the momentum update while a phase 2 is in flight;
    * ``complete(state, jobs, coll, backend)``: wait for phase 2 if any, apply Δ to the parameters
      (a job with ``keep_delta`` keeps the applied Δ in ``job.delta``).

    ``wire_bytes(...)`` and ``messages(...)`` state the cost (telemetry tests, α-β model)."""

    name = "?"
    encoding = "bits"
    supports_average = True
    carries_flags = False  # phase 1 delivers every rank's message to every rank (gather-like)
    # the local step can write the next momenta in the same pass over g and m (momentum_double_buffer)
    advances_momenta = True

    # ------------------------------------------------------------------ layout and local step
    def abstention_layout(self, offsets, numels, numel: int, device, world_size: int) -> tuple:
        """(mask, capacity, mode) of a bucket: the real-element plane its abstentions are relative
        to, the capacity of an abstention list, and the first step's mode (comm/abstain.py; a
        count alone, capacity 0, when the bucket is small). ``offsets`` / ``numels``: where each
        parameter (piece) sits in the bucket of ``numel`` (padded) elements."""
        return real_mask(offsets, numels, numel, device), list_capacity(numel // 8, world_size), "list"

    def batch_bytes(self, numel: int) -> int:
        """What a bucket of ``numel`` (padded) elements weighs when communication batches are cut
        (comm_bucket_mb): its packed votes, one plane (numel/8 bytes)."""
        return numel // 8

    def local_step(self, job: VoteJob, grads, momenta, backend, betas, world_size: int, seed,
                   momenta_out=None) -> tuple:
        """This rank's votes for ``job``'s bucket from its gradients and momenta (c = β1·m + (1−β1)·g,
        in one fused pass of the backend), as this algorithm sends them: ``job.sign`` (packed), the
        nonzero plane and the abstention payload in ``job.mode``. ``seed``: step -> this rank's
        32-bit random seed (for an algorithm that rounds at random; called only by one that does).
        ``momenta_out`` (only where ``advances_momenta``): where the pass writes the next momenta.
        Returns (this rank's non-finite count: int64 scalar, the bucket's two flag entries: int32
        [2]), both left on the device: the step folds them into its one host read."""
        beta1, beta2 = betas
        sign, nonzero, nonfinite, _ = backend.local_step(grads, momenta, job.bucket, job.numel, beta1, beta2,
                                                         momenta_out is not None, device_counts=True,
                                                         momenta_out=momenta_out)
        return nonfinite, self._encode(job, sign, nonzero, backend, world_size)

    def no_votes(self, job: VoteJob, device, backend, world_size: int) -> None:
        """Well-formed zero votes on ``device``, shaped as :meth:`local_step` gives them (this rank
        cannot vote: every rank's collectives must still match; the step's flags say why)."""
        nonzero = torch.zeros(job.numel // 8, dtype=torch.uint8, device=device)
        self._encode(job, self._zero_votes(job.numel, device), nonzero, backend, world_size)

    def _zero_votes(self, numel: int, device) -> torch.Tensor:
        """A sign plane of zeros, in the local step's shape (uint8 [numel/8])."""
        return torch.zeros(numel // 8, dtype=torch.uint8, device=device)

    def _encode(self, job: VoteJob, sign, nonzero, backend, world_size: int) -> torch.Tensor:
        """Keep the votes in ``job`` with their abstention payload; return its two flag entries."""
        job.sign, job.nonzero = sign, nonzero
        job.payload, flags = abstain_encode(nonzero, job.mask, job.mode, job.capacity, world_size, backend)
        return flags

    # ------------------------------------------------------------------ phases
    def shards_planes(self, vote: str) -> bool:
        """Whether whole nonzero planes (plane mode, or the planes fetched after an overflow) travel
        sharded: rank r receives only shard r of every rank's plane (an all-to-all, (N−1)/N·P/8
        bytes instead of an all-gather's (N−1)·P/8), and phase 2 carries the result's nonzero
        plane. Only an algorithm whose shard owner decides Δ alone can (``1bit``/``bbit``
        majority); the others need every rank's whole plane."""
        return False

    def agree_planes(self, job: VoteJob, received, first: int, second: int, coll: "Collectives") -> str | None:
        """Set ``job.planes`` from the bucket's summed flag entries (the same on every rank, read
        with the step's one host read): None where nobody abstains, the planes fetched once more
        where some rank's list overflowed (:meth:`overflow_planes`), else decoded from
        ``received`` (phase 1's payload columns [N, bytes]). comm/abstain.py says what the two
        entries mean in each mode. Returns how the bucket's abstentions travel next step
        (:func:`~lioncub_ds.comm.abstain.next_mode`: every rank switches together)."""
        source = plane_source(job.mode, first, second)
        job.chunk_lists = None
        if source == "none":
            job.planes = None
        elif source == "fetch":
            job.planes = self.overflow_planes(job, coll)
        else:
            job.planes = job.payloads_from(received, self.shards_planes(job.vote), coll.rank)
        return next_mode(job.mode, first, second)

    def overflow_planes(self, job: VoteJob, coll: "Collectives") -> torch.Tensor:
        """After a step in which some rank's abstention list overflowed: every rank's nonzero plane,
        in the form this algorithm counts (sharded: an all-to-all of the shards; else an all-gather)."""
        if self.shards_planes(job.vote):
            n = coll.world_size
            job.planes_sharded = True
            return coll.all_to_all(job.nonzero.reshape(n, -1), "abstain_planes")
        job.planes_sharded = False
        return coll.all_gather(job.nonzero, "abstain_planes")

    def launch(self, jobs: list[VoteJob], coll: Collectives, backend, flags=None):
        raise NotImplementedError

    def flag_rows(self, state, width: int) -> torch.Tensor:
        """Every rank's flag vector (int32 [N, width]) from phase 1's output, whose rows end with
        it (the carriers put it last)."""
        if not self.carries_flags:
            raise NotImplementedError(f"comm {self.name!r} does not carry the step's flags")
        # a copy (not .contiguous(): one row of one rank is already contiguous at an odd offset)
        return state.wait()[:, -4 * width:].clone(memory_format=torch.contiguous_format).view(torch.int32)

    def received(self, state, jobs: list[VoteJob], coll: Collectives) -> list:
        raise NotImplementedError

    def count(self, state, jobs: list[VoteJob], coll: Collectives, backend):
        return state

    def complete(self, state, jobs: list[VoteJob], coll: Collectives, backend) -> None:
        raise NotImplementedError

    def run(self, job: VoteJob, coll: Collectives, backend) -> None:
        """One bucket on its own, outside a step's pipeline (tools, tests): its abstentions travel
        as the plane (``job.nonzero``; None: nobody abstains). Every rank calls it with the same
        bucket. Gives the same parameters as the pipeline."""
        if self.encoding == "bits":
            job.mask = real_mask(job.offsets, [p.numel() for p in job.params], job.numel, job.sign.device)
            job.nonzero = job.mask if job.nonzero is None else job.nonzero
            job.mode, job.capacity, job.payload = "plane", 0, job.nonzero
        state = self.launch([job], coll, backend)
        received = self.received(state, [job], coll)[0]
        if self.encoding == "bits":
            job.planes = job.payloads_from(received, self.shards_planes(job.vote), coll.rank)
        self.complete(self.count(state, [job], coll, backend), [job], coll, backend)

    def wire_bytes(self, numel: int, world_size: int, *, mode: str = "list", vote: str = "majority",
                   tie_break: str = "hash", abstain: bool = False, overflow: bool = False) -> int:
        """Bytes one rank sends for a bucket of ``numel`` (padded) elements whose abstentions
        travel as ``mode`` ("list", with the capacity of :func:`list_capacity`, "chunks" or
        "plane": comm/abstain.py); ``abstain``: some rank abstains in the bucket this step (in
        list mode: the chunks and plane modes always count the planes; 1bit sends more then with
        tie_break="zero", or when the planes travel sharded); ``overflow``: a list- or chunks-mode
        step in which some rank's list overflowed, so the planes travel once more (all-gathered,
        or sharded: :meth:`shards_planes`)."""
        raise NotImplementedError

    def messages(self, world_size: int) -> int:
        """Latency terms (sequential message rounds) of one call, ring model."""
        raise NotImplementedError


def payload_len(numel: int, world_size: int, mode: str) -> int:
    """Bytes of one rank's whole abstention payload for a bucket of ``numel`` elements."""
    plane = numel // 8
    return payload_bytes(mode, plane, list_capacity(plane, world_size), world_size)


def refetched(mode: str, overflow: bool) -> bool:
    """Whether the planes travel once more this step (a list or chunk list overflowed)."""
    return overflow and mode in ("list", "chunks")


def planes_counted(mode: str, abstain: bool) -> bool:
    """Whether the vote counts nonzero planes this step: in list mode only where some rank
    abstains; in chunks and plane modes always (their flags do not say whether anybody abstains)."""
    return abstain or mode != "list"


def split_columns(buf: torch.Tensor, widths: list[int]) -> list[torch.Tensor]:
    """[N, Σ widths (+ unused columns)] -> views [N, w] in order (one torch call for all of them: a
    slice per bucket costs ~2 µs of Python each)."""
    widths = list(widths)
    rest = buf.shape[1] - sum(widths)
    return list(buf.split(widths + [rest] if rest else widths, dim=1))[:len(widths)]
