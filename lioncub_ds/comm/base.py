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
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..codec import tie_segments
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

    def __init__(self, group, stats: CommStats, timeout_s: float | None = None):
        self.group = group
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

    def _run(self, kind, purpose, tensor, launch, sent_nbytes):
        """Launch one async collective, wait (with the deadline), count it."""
        t = time.perf_counter()
        nbytes = tensor.numel() * tensor.element_size()
        try:
            work = launch()
            if self.timeout is not None:
                work.wait(self.timeout)
            else:
                work.wait()
        except RuntimeError as exc:
            raise self._failed(kind, purpose, t, nbytes, tensor.device, exc) from exc
        self.stats.record(kind, purpose, sent_nbytes, self.world_size, time.perf_counter() - t)

    def all_gather(self, inp: torch.Tensor, purpose: str) -> torch.Tensor:
        """[k] -> [N, k] (row i = rank i's input)."""
        out = torch.empty(self.world_size * inp.numel(), dtype=inp.dtype, device=inp.device)
        src = inp.reshape(-1).contiguous()
        self._run("all_gather", purpose, inp, lambda: _all_gather_single(out, src, group=self.group, async_op=True),
                  out.numel() * out.element_size())
        return out.view(self.world_size, -1)

    def all_to_all(self, inp: torch.Tensor, purpose: str) -> torch.Tensor:
        """[N, k] (row j goes to rank j) -> [N, k] (row i came from rank i)."""
        out = torch.empty_like(inp)
        src = inp.contiguous()
        self._run("all_to_all", purpose, inp, lambda: dist.all_to_all_single(out, src, group=self.group, async_op=True),
                  inp.numel() * inp.element_size())
        return out

    def all_reduce_(self, tensor: torch.Tensor, purpose: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
        self._run("all_reduce", purpose, tensor,
                  lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True),
                  tensor.numel() * tensor.element_size())
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src_group_rank: int, purpose: str) -> torch.Tensor:
        self._run("broadcast", purpose, tensor,
                  lambda: broadcast(tensor, src_group_rank, self.group, async_op=True),
                  tensor.numel() * tensor.element_size())
        return tensor


@dataclass
class VoteJob:
    """One bucket's vote: local votes in, parameters updated in place."""
    params: list          # the bucket's parameters
    offsets: list         # element offset of each parameter in the bucket (multiples of 8)
    numel: int            # padded bucket size: a multiple of 8·N
    # index inside its parameter of each parameter's first element in this bucket (the hash tie
    # rule keys on the parameter-local index, SPEC §4); None: every parameter starts whole, at 0
    param_starts: list | None
    lr: float
    weight_decay: float
    step: int             # 1-based optimizer step
    tie_break: str
    vote: str
    sign: torch.Tensor | None = None     # uint8 [numel/8]
    nonzero: torch.Tensor | None = None  # uint8 [numel/8], only when some rank abstains somewhere
    codes: torch.Tensor | None = None    # int8 [numel] (int8 algorithm)

    def __post_init__(self):
        if self.param_starts is not None and not isinstance(self.param_starts, (list, tuple)):
            raise TypeError("VoteJob.param_starts must be None or one parameter-local start index per parameter, "
                            f"got {self.param_starts!r} (the hash tie rule no longer takes a flat bucket base)")

    def segments(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The tie-index table of bucket positions [start, stop) (codec.tie_segments)."""
        return tie_segments(self.offsets, self.param_starts, start, stop)


class VoteAlgorithm:
    """Interface: ``encoding`` ('bits' or 'int8'), ``run(job, coll, backend)``,
    ``wire_bytes(...)`` and ``messages(...)`` (for the cost model)."""

    name = "?"
    encoding = "bits"
    supports_average = True

    def run(self, job: VoteJob, coll: Collectives, backend) -> None:
        raise NotImplementedError

    def wire_bytes(self, numel: int, world_size: int, *, abstain: bool = False, vote: str = "majority",
                   tie_break: str = "hash") -> int:
        """Bytes one rank sends for a bucket of ``numel`` (padded) elements."""
        raise NotImplementedError

    def messages(self, world_size: int) -> int:
        """Latency terms (sequential message rounds) of one call, ring model."""
        raise NotImplementedError


def stack_planes(*planes):
    """Concatenate the planes that exist into one buffer, so a step issues one collective."""
    present = [p for p in planes if p is not None]
    return present[0] if len(present) == 1 else torch.cat(present)
