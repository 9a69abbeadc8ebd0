"""``python -m lioncub_ds.plan``: what each data-parallel strategy costs on your cluster.

For a model (a parameter count, or a GPT shape), a precision, tokens per GPU per step (with a
measured compute time, or an MFU and a peak FLOP/s) and a cluster (nodes × GPUs, GPU memory, the
intra-node bus bandwidth and the inter-node bandwidth per node, with their latencies), it predicts
per strategy: the optimizer and model state per GPU (with the step buffers LionCub keeps) and
whether it fits, the bytes each GPU sends per step (inside a node, and across nodes per node), the
communication time, the exposed communication with and without overlap, the step time and tokens/s,
and the convergence cost our studies measured for that configuration and N (or "not measured"), with
the settings they ran at. It starts with a recommendation and the exact ds_config block or Megatron
flags (only configs their integration accepts: a strategy with none left is left out, and said so).
Bytes print in decimal units, as the rates (1 GB = 10^9 bytes).

Everything is a **prediction** from the model below; docs/planner.md says how far it is from our
own measurements (``python -m benchmarks plan_check``) and from published link figures.

The model (docs/planner.md, "The model"):

* **Bytes** are what ``comm_stats()`` counts: the telemetry ring model
  (:func:`lioncub_ds.telemetry.ring_bytes`), the 1bit vote's ``wire_bytes`` over the real bucket
  layout (:func:`lioncub_ds.layout.build_buckets`), the step's flags
  (:func:`lioncub_ds.flags.flag_bytes`), the node group's traffic
  (:func:`lioncub_ds.sharding.node_group_bytes`) and the momentum sync
  (:func:`lioncub_ds.momentum_sync.sync_bytes`), each as :mod:`lioncub_ds.wire` restates it:
  torch-free, in closed form over runs of equal tensors and buckets (a 10^15-parameter model is a
  few runs), held equal to those functions by tests/test_wire.py. DDP's and ZeRO's / Megatron's
  bytes are their collectives (all-reduce; reduce-scatter + all-gather) in the same ring model.
* **Links**: a collective over a group that spans several nodes is a ring (all-reduce, all-gather,
  reduce-scatter: every node boundary carries one rank's stream) or direct (all-to-all: each rank
  sends its share to every other rank). The time of a collective is the slowest of: the bytes that
  leave a node over the node's inter-node bandwidth, the bytes each GPU sends over its intra-node
  bus bandwidth, and (where the host CPUs move the bytes: gloo over TCP) every byte over the host's
  copy rate; plus a latency per step of a hierarchical ring (L−1 inside a node, Nn−1 across nodes):
  the α-β model of :class:`lioncub_ds.comm.cost.CostModel` with the link each byte crosses.
* **Overlap**: the gradient reduction of DDP, ZeRO-2 and Megatron (``--overlap-grad-reduce``) runs
  during backward (2/3 of the compute); ``overlap`` (0–1) says how much of backward can hide it; the
  last bucket is never hidden. LionCub's votes overlap only where the integration allows it (fp32,
  ``overlap=True``; not with bf16 under DeepSpeed, not under Megatron).
* **Update**: the optimizer's memory traffic per parameter (fused Lion 20 B, a LionCub vote step
  28 B, node voters' and master-only sharding's from their code paths) over the GPU's memory
  bandwidth.
* **Memory**: parameters, gradients, optimizer state and the buffers LionCub's sharding keeps from
  step to step (:func:`node_voter_workspace_bytes`, :func:`master_only_workspace_bytes`).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import textwrap
from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib import resources

from . import wire
from .telemetry import ring_bytes

__all__ = ["ModelSpec", "ClusterSpec", "WorkloadSpec", "PlanInputError", "plan", "main", "STRATEGIES",
           "convergence_table", "parse_count"]

PRECISIONS = ("bf16", "fp16", "fp32")
BACKENDS = ("nccl", "gloo")
HOST_SCOPES = ("node", "machine")
SYNC_DTYPE = "int8"          # the recommended momentum sync (docs/convergence.md): int8 every 20 steps
SYNC_EVERY = 20
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb, and LionCub's bucket_size_mb default
DS_REDUCE_BUCKET_NUMEL = 500_000_000  # DeepSpeed's reduce_bucket_size default (elements)
# LionCub's step spends host time per bucket (Python, the pipeline's views and flags, kernel launches),
# whatever the bucket's size: 0.07-0.12 ms measured on a 2-core VM's CPU (docs/kernels.md, "Host cost per
# call"; not measured on a GPU host). Not in the predicted step time; printed from this many buckets on.
HOST_MS_PER_BUCKET = (0.07, 0.12)
HOST_NOTE_BUCKETS = 1000
BACKWARD_SHARE = 2.0 / 3.0   # backward's share of forward + backward (2 of the 3 matmul passes)
# Memory traffic per updated parameter of the optimizer step (bytes; read + write):
#   fused Lion: read g, m, master/param, write m, master/param (+ the bf16 copy): 20;
#   a LionCub vote step: the local pass reads g and m (8), the momentum update reads g, m and writes m (12),
#   the apply reads and writes the master/param (8): 28.
UPDATE_BYTES_LION = 20
UPDATE_BYTES_VOTE = 28


def node_voter_update_bytes(wg: int, wp: int, node_size: int, mixed: bool) -> float:
    """Memory traffic per element of the full bucket of a node-voter step besides its collectives
    (lioncub_ds/sharding.py, ``NodeVoters.begin`` / ``finish``): the flat gradient buffer zeroed and
    filled (3·wg), the fp32 row sum of the L received rows ((wg + 4) for the first, 12 per further
    row plus its fp32 copy when the gradients are not fp32, the division 8; per shard element), fp32
    parameters copied into a work shard (12 per shard element; bf16/fp16 keep a persistent master),
    the vote step on the shard (28), the master cast back for the all-gather (4 + wp, mixed only) and
    the gathered bucket copied into the parameters (2·wp)."""
    L = node_size
    rows = (wg + 4) + (L - 1) * (12 + (wg + 4 if wg != 4 else 0)) + 8
    shard = rows + (0 if mixed else 12) + UPDATE_BYTES_VOTE + ((4 + wp) if mixed else 0)
    return 3 * wg + shard / L + 2 * wp


def master_only_update_bytes(wp: int, node_size: int) -> float:
    """Per element, master-only sharding (``sharding.MasterOnly``): the vote step's local pass and
    momentum update on every element (20), the apply on this rank's master shard (8), the shard cast
    to the parameters' dtype for the all-gather (4 + wp) and the gathered bucket copied in (2·wp)."""
    return 20 + (8 + 4 + wp) / node_size + 2 * wp


def node_voter_workspace_bytes(buckets: wire.Runs, wg: int, wp: int, node_size: int, mixed: bool) -> int:
    """Bytes of the buffers node voters keep from one step to the next (``sharding.NodeVoters``'s
    :class:`~lioncub_ds.sharding.Workspace`), for full buckets of these padded sizes (runs, in
    layout order): rings of ``wire.WINDOW`` bucket-sized slots for the group's send and receive
    buffers (in the gradients' dtype, taken in launch order: last bucket first) and for the
    all-gather's receive buffers (in the parameters' dtype, in layout order: buckets k and
    k + WINDOW share a slot either way, so the slots' sizes are the same); per bucket the fp32
    gradient shard (``grad``, 1/L) and for fp32 parameters the fp32 parameter shard (``work``,
    1/L; bf16/fp16 ones step their persistent master instead)."""
    shard = wire.total(buckets) // node_size
    return (2 * wg + wp) * sum(wire.ring_slot_numels(buckets)) + 4 * shard + (0 if mixed else 4 * shard)


def master_only_workspace_bytes(buckets: wire.Runs, wp: int) -> int:
    """Master-only sharding's kept buffers (``sharding.MasterOnly``'s Workspace): the all-gather's
    ring of ``wire.WINDOW`` bucket-sized receive buffers, in the parameters' dtype."""
    return wp * sum(wire.ring_slot_numels(buckets))


class PlanInputError(ValueError):
    """A planner input is out of range: the message names the flag and the allowed values."""


# Every input's allowed range, read by the CLI's parsers and by the dataclasses alike (the program and
# the function API refuse the same values). Generous for any real cluster, and narrow enough that
# every prediction stays a finite number printed in a few digits: a 10^15-parameter model (500x the
# largest trained today) over 1 Mbit/s is still a finite step time.
MAX_PARAMS = 10**15
LIMITS = {  # flag -> (integer?, lowest, highest)
    "--params": (True, 1, MAX_PARAMS), "--layers": (True, 1, 10_000), "--hidden": (True, 1, 10**6),
    "--vocab": (True, 1, 10**8), "--seq": (True, 1, 10**8), "--tokens-per-gpu": (True, 1, 10**9),
    "--tp": (True, 1, 4096), "--pp": (True, 1, 4096), "--instances": (True, 1, 10**7),
    "--nodes": (True, 1, 100_000), "--gpus-per-node": (True, 1, 4096), "--sync-every": (True, 0, 10**9),
    "--compute-time-s": (False, 1e-6, 1e6), "--update-time-s": (False, 0.0, 1e6), "--mfu": (False, 1e-3, 1.0),
    "--peak-tflops": (False, 1e-3, 1e6), "--gpu-mem-gib": (False, 1e-3, 1e6),
    "--intra-node-gbyte": (False, 1e-3, 1e6), "--inter-node-gbit": (False, 1e-3, 1e6),
    "--intra-latency-us": (False, 0.0, 1e6), "--inter-latency-us": (False, 0.0, 1e6),
    "--hbm-gbyte": (False, 1e-3, 1e6), "--host-gbyte": (False, 1e-3, 1e6), "--overlap": (False, 0.0, 1.0),
    "--activation-gib": (False, 0.0, 1e6), "--bucket-size-mb": (False, 1e-3, 1e6),
    "--comm-bucket-mb": (False, 1e-3, 1e6),
    "--min-speedup": (False, 1e-2, 100.0),
}


def allowed(flag: str) -> str:
    integer, lo, hi = LIMITS[flag]
    return f"{'an integer' if integer else 'a number'} >= {lo:g} and <= {hi:g}"


def _err(flag, value, allowed_text):
    return PlanInputError(f"lioncub_ds.plan: invalid {flag} {value!r}; allowed: {allowed_text}")


def _check(flag, value):
    """``value`` if it is in ``flag``'s range (:data:`LIMITS`), else a PlanInputError naming both."""
    integer, lo, hi = LIMITS[flag]
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or not lo <= value <= hi:
        raise _err(flag, value, allowed(flag))
    return value if integer else float(value)


def parse_count(text) -> int:
    """A parameter count: an int, or a number with a K/M/B/T suffix ("1.3B", "7e9")."""
    if isinstance(text, bool):
        raise ValueError(text)
    if isinstance(text, int):
        return text
    if isinstance(text, float):
        if not math.isfinite(text) or text != int(text):
            raise ValueError(text)
        return int(text)
    s = str(text).strip().upper().replace("_", "")
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(s[-1:], None)
    value = float(s[:-1]) * scale if scale else float(s)
    if not math.isfinite(value) or (not scale and value != int(value)):  # "1.5" parameters: a missing suffix?
        raise ValueError(text)
    return int(round(value))


# ----------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class ModelSpec:
    """The model: ``params`` (total), or a GPT shape (``layers``, ``hidden``, ``vocab``, ``seq``) from
    which the count is derived (12·h² + 13·h per layer, tied (V + S)·h embeddings). ``param_numels``:
    the exact trainable tensors of one GPU (tests; the layout then matches the real one)."""
    params: int | None = None
    layers: int | None = None
    hidden: int | None = None
    vocab: int | None = None
    seq: int | None = None
    param_numels: tuple | None = None

    def __post_init__(self):
        shape = (self.layers, self.hidden, self.vocab, self.seq)
        if self.param_numels is not None:
            if not self.param_numels or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                            for n in self.param_numels) or sum(self.param_numels) > MAX_PARAMS:
                raise _err("param_numels", self.param_numels,
                           f"a non-empty list of integers >= 1 summing to <= {MAX_PARAMS:g}")
        elif all(x is None for x in shape):
            if self.params is None:
                raise PlanInputError("lioncub_ds.plan: give the model as --params N, or as a GPT shape "
                                     "--layers --hidden --vocab --seq")
        elif any(x is None for x in shape):
            missing = [f"--{k}" for k, x in zip(("layers", "hidden", "vocab", "seq"), shape) if x is None]
            raise PlanInputError(f"lioncub_ds.plan: a GPT shape needs --layers, --hidden, --vocab and --seq; "
                                 f"missing: {', '.join(missing)}")
        for k, x in zip(("--layers", "--hidden", "--vocab", "--seq"), shape):
            if x is not None:
                _check(k, x)
        if self.params is not None:
            _check("--params", self.params)
        elif self.layers is not None and self.total > MAX_PARAMS:
            raise PlanInputError(f"lioncub_ds.plan: invalid GPT shape --layers {self.layers} --hidden {self.hidden} "
                                 f"--vocab {self.vocab} --seq {self.seq} ({self.total:.3g} parameters); allowed: "
                                 f"at most {MAX_PARAMS:g} parameters, as --params")

    @property
    def total(self) -> int:
        if self.param_numels is not None and self.params is None:
            return sum(self.param_numels)
        if self.params is not None:
            return self.params
        h = self.hidden
        return self.layers * (12 * h * h + 13 * h) + (self.vocab + self.seq) * h + 2 * h

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6·P, plus attention's 12·layers·hidden·seq when the shape is known."""
        attn = 12 * self.layers * self.hidden * self.seq if self.layers else 0
        return 6.0 * self.total + attn

    def gpu_runs(self, tp: int, pp: int) -> tuple:
        """The trainable tensors one GPU holds, as runs ``(numel, count)`` in order (its TP slice of
        its PP stage's layers; the first stage, with the embeddings). Without a shape: the
        total / (tp·pp), cut into 4M-element tensors (one run, whatever the size)."""
        return _gpu_runs(self, tp, pp)

    def gpu_params(self, tp: int, pp: int) -> int:
        return wire.total(self.gpu_runs(tp, pp))


@lru_cache(maxsize=8)
def _gpu_runs(model: ModelSpec, tp: int, pp: int) -> tuple:
    # cached: every strategy asks, and 10,000 GPT layers are 100,000 tensors
    if model.param_numels is not None:
        return tuple(wire.runs_of(model.param_numels))
    if model.layers and model.params is None:
        h = model.hidden
        per_layer = [3 * h * h // tp, 3 * h // tp, h * h // tp, h, 2 * h, 4 * h * h // tp, 4 * h // tp,
                     4 * h * h // tp, h, 2 * h]
        layers = -(-model.layers // pp)
        out = [-(-model.vocab * h // tp), model.seq * h] + per_layer * layers + [2 * h]
        return tuple(wire.runs_of(n for n in out if n > 0))
    per_gpu = -(-model.total // (tp * pp))
    chunk = 4 * 2**20
    return tuple(wire.add_run(wire.add_run([], chunk, per_gpu // chunk), per_gpu % chunk, int(per_gpu % chunk > 0)))


@dataclass(frozen=True)
class ClusterSpec:
    """The cluster. ``intra_gbyte_s``: each GPU's bus bandwidth inside a node (GB/s, nccl-tests'
    busbw: H100 NVLink ~450); ``inter_gbit_s``: the inter-node bandwidth per node (Gbit/s, all its
    NICs); latencies per message (µs). ``hbm_gbyte_s``: the memory bandwidth the optimizer kernels
    get. ``host_gbyte_s``: where the host CPUs copy every byte (gloo / TCP; None for NCCL over
    NVLink and RDMA), the rate at which the ranks sharing a host (``host_scope``: a node, or the
    whole machine) move their bytes. ``overlap``: the share of backward that can hide overlapped
    communication (1 on GPUs; 0 where compute and communication share the same cores)."""
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_mem_gib: float = 80.0
    intra_gbyte_s: float = 450.0
    inter_gbit_s: float = 100.0
    intra_latency_us: float = 5.0
    inter_latency_us: float = 10.0
    hbm_gbyte_s: float = 3000.0
    host_gbyte_s: float | None = None
    host_scope: str = "node"
    overlap: float = 1.0
    backend: str = "nccl"

    def __post_init__(self):
        for flag, value in (("--nodes", self.nodes), ("--gpus-per-node", self.gpus_per_node),
                            ("--gpu-mem-gib", self.gpu_mem_gib), ("--intra-node-gbyte", self.intra_gbyte_s),
                            ("--inter-node-gbit", self.inter_gbit_s), ("--intra-latency-us", self.intra_latency_us),
                            ("--inter-latency-us", self.inter_latency_us), ("--hbm-gbyte", self.hbm_gbyte_s),
                            ("--overlap", self.overlap)):
            _check(flag, value)
        if self.host_gbyte_s is not None:
            _check("--host-gbyte", self.host_gbyte_s)
        if self.host_scope not in HOST_SCOPES:
            raise _err("--host-scope", self.host_scope, " | ".join(HOST_SCOPES))
        if self.backend not in BACKENDS:
            raise _err("--backend", self.backend, " | ".join(BACKENDS))

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class WorkloadSpec:
    """Precision, tokens per GPU per step, and the compute time (measured, or from ``mfu`` ×
    ``peak_tflops``); ``tp`` / ``pp``: tensor- and pipeline-parallel sizes (TP inside a node);
    ``instances``: K of Megatron's distributed optimizer (default: one per node);
    ``activation_gib``: memory per GPU reserved for activations when judging the fit;
    ``bucket_size_mb`` / ``comm_bucket_mb``: LionCub's settings of those names."""
    precision: str = "bf16"
    tokens_per_gpu: int = 8192
    compute_time_s: float | None = None
    mfu: float = 0.4
    peak_tflops: float = 989.0
    tp: int = 1
    pp: int = 1
    instances: int | None = None
    activation_gib: float = 0.0
    update_time_s: float | None = None  # measured fused-Lion update of one GPU's parameters (overrides hbm)
    bucket_size_mb: float = 25.0        # LionCub's bucket_size_mb (its layout and the momentum sync's chunks)
    comm_bucket_mb: float = wire.COMM_BUCKET_MB  # LionCub's comm_bucket_mb (votes packed per comm batch)

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise _err("--precision", self.precision, " | ".join(PRECISIONS))
        for flag, value in (("--tokens-per-gpu", self.tokens_per_gpu), ("--mfu", self.mfu),
                            ("--peak-tflops", self.peak_tflops), ("--tp", self.tp), ("--pp", self.pp),
                            ("--activation-gib", self.activation_gib), ("--bucket-size-mb", self.bucket_size_mb),
                            ("--compute-time-s", self.compute_time_s), ("--instances", self.instances),
                            ("--update-time-s", self.update_time_s), ("--comm-bucket-mb", self.comm_bucket_mb)):
            if value is not None:
                _check(flag, value)

    @property
    def param_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"


# ----------------------------------------------------------------------------- topology
def _divisors(m: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(m) + 1) if m % d == 0]
    return sorted(set(small + [m // d for d in small]))


def _aligned(span: int, gpus_per_node: int) -> bool:
    """``span`` consecutive ranks from a multiple of ``span`` stay clear of node boundaries."""
    return span % gpus_per_node == 0 or gpus_per_node % span == 0


@dataclass(frozen=True)
class Geometry:
    """A kind of process group: ``size`` ranks, ``per_node`` of them in each node it spans."""
    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return max(1, self.size // max(1, self.per_node))


@dataclass(frozen=True)
class Topology:
    """Data-parallel layout (Megatron's order: TP innermost, then DP, then PP): N data-parallel
    ranks, L of each DP group in a node, so Nn = N / L nodes per DP group and G / L DP groups per node."""
    n: int
    local: int
    gpus_per_node: int
    nodes: int

    @classmethod
    def of(cls, cluster: ClusterSpec, work: WorkloadSpec) -> "Topology":
        g, total = cluster.gpus_per_node, cluster.gpus
        mp = work.tp * work.pp
        if g % work.tp:
            raise PlanInputError(f"lioncub_ds.plan: invalid --tp {work.tp}: tensor parallelism stays inside a node; "
                                 f"allowed: a divisor of --gpus-per-node {g}")
        if total % mp:
            raise PlanInputError(f"lioncub_ds.plan: invalid --tp {work.tp} x --pp {work.pp} = {mp}; allowed: a "
                                 f"divisor of the {total} GPUs (--nodes {cluster.nodes} x --gpus-per-node {g})")
        n = total // mp
        # Megatron's order puts a data-parallel group (with its TP slices) on tp·N consecutive ranks:
        # whole nodes (tp·N a multiple of the node's GPUs) or a whole share of one node (a divisor of
        # them). Anything else straddles a node boundary, which the link model cannot price.
        span = work.tp * n
        if not _aligned(span, g):
            ok = [pp for pp in _divisors(total // work.tp) if _aligned(total // pp, g)]
            raise PlanInputError(
                f"lioncub_ds.plan: invalid --tp {work.tp} x --pp {work.pp} on {cluster.nodes} x {g} GPUs: each "
                f"data-parallel group ({n} ranks x TP {work.tp} = {span} consecutive GPUs, Megatron's order) would "
                f"straddle nodes of {g} GPUs; allowed: --tp x --pp that leave TP x DP a divisor or a multiple of "
                f"--gpus-per-node {g} (with --tp {work.tp}: --pp {', '.join(map(str, ok[:12]))})")
        local = min(n, g // work.tp)
        return cls(n, local, g, cluster.nodes)

    @property
    def dp_nodes(self) -> int:
        return self.n // self.local

    def group(self, kind: str, size: int | None = None) -> Geometry:
        """"dp": all N; "node": the L DP ranks of a node; "cross": one per node group (Nn);
        "instance" / "peers": Megatron's K instances of ``size`` consecutive DP ranks, and the K
        ranks at one place of every instance."""
        if kind == "dp":
            return Geometry(self.n, self.local)
        if kind == "node":
            return Geometry(self.local, self.local)
        if kind == "cross":
            return Geometry(self.dp_nodes, 1)
        if kind == "instance":
            return Geometry(size, min(size, self.local))
        if kind == "peers":  # size = K; one rank per instance of n/K consecutive ranks
            inst = self.n // size
            return Geometry(size, max(1, self.local // inst))
        raise ValueError(kind)


# ----------------------------------------------------------------------------- traffic
@dataclass
class Traffic:
    """``count`` collectives of one kind in a step (buckets, comm batches, sync chunks): ``sent``
    bytes per rank in all (telemetry's ring model), on a group ``geo``; ``every``: once per that many
    steps; ``scope``: the comm_stats scope it is counted under; ``overlappable``: may run during
    backward."""
    purpose: str
    kind: str
    sent: float
    geo: Geometry
    scope: str = "vote_group"
    every: int = 1
    overlappable: bool = False
    count: int = 1
    # a gloo reduce-scatter sends all-reduce bytes on the wire (measured in bench netns_nodes), the
    # telemetry still counts the ring's
    wire_factor: float = 1.0

    def links(self, top: Topology) -> tuple[float, float]:
        """(bytes leaving a node over the inter-node link, bytes each GPU sends on its node's bus)."""
        g, sent = self.geo, self.sent * self.wire_factor
        if g.size <= 1:
            return 0.0, 0.0
        groups_per_node = top.gpus_per_node / g.per_node if g.nodes > 1 else 0
        if g.nodes <= 1:
            return 0.0, sent
        if self.kind == "all_to_all":  # direct: each rank's share for ranks of other nodes leaves the node
            off = (g.size - g.per_node) / (g.size - 1)
            return top.gpus_per_node * sent * off, sent * (g.per_node - 1) / (g.size - 1)
        # ring: one rank's stream crosses each node boundary per group
        return groups_per_node * sent, sent * (g.per_node - 1) / g.per_node

    def latency_s(self, cluster: ClusterSpec) -> float:
        """The latency terms: per collective one pass of (an all-reduce: two) over the group's steps,
        a hierarchical ring for NCCL (L−1 steps inside a node at the intra-node latency, Nn−1 across
        nodes at the inter-node one), a flat ring of N−1 steps for gloo."""
        g = self.geo
        if g.size <= 1:
            return 0.0
        rounds = 2 if self.kind == "all_reduce" else 1
        a_in, a_out = cluster.intra_latency_us * 1e-6, cluster.inter_latency_us * 1e-6
        if cluster.backend == "gloo":
            per = (g.size - 1) * (a_out if g.nodes > 1 else a_in)
        else:
            per = (g.per_node - 1) * a_in + (g.nodes - 1) * a_out
        return self.count * rounds * per


def collective_time(t: Traffic, top: Topology, cluster: ClusterSpec) -> dict:
    """Seconds of one occurrence: the slowest link (inter-node per node, intra-node per GPU, the
    host's copies) plus the latency terms (:meth:`Traffic.latency_s`)."""
    inter, intra = t.links(top)
    inter_s = inter * 8 / (cluster.inter_gbit_s * 1e9)
    intra_s = intra / (cluster.intra_gbyte_s * 1e9)
    host_s = 0.0
    if cluster.host_gbyte_s is not None and t.geo.size > 1:
        sharing = cluster.gpus if cluster.host_scope == "machine" else top.gpus_per_node
        host_s = t.sent * t.wire_factor * sharing / (cluster.host_gbyte_s * 1e9)
    wire = max(inter_s, intra_s, host_s)
    return {"time_s": wire + t.latency_s(cluster), "inter_bytes_per_node": inter, "intra_bytes_per_gpu": intra,
            "bound": "inter-node link" if wire == inter_s and inter_s > 0 else
            "host copies" if wire == host_s and host_s > 0 else "intra-node bus" if intra_s > 0 else "none"}


# ----------------------------------------------------------------------------- strategies
STRATEGIES = ("ddp_bf16", "zero1", "zero2", "zero3", "fsdp2_hsdp", "megatron_distopt_k1", "megatron_distopt_kN",
              "lioncub_1bit_sync20", "lioncub_master_only", "lioncub_node_voters_sync20",
              "lioncub_zero3_node_voters_sync20", "lioncub_fsdp2_node_voters_sync20")
LABELS = {
    "ddp_bf16": "DDP, bf16 gradients all-reduced (overlapped), Lion",
    "zero1": "DeepSpeed ZeRO-1, Lion (reduce-scatter after backward + parameter all-gather)",
    "zero2": "DeepSpeed ZeRO-2, Lion (overlap_comm reduce-scatter + parameter all-gather)",
    "zero3": "DeepSpeed ZeRO-3 over every rank, Lion (parameters, gradients, state sharded 1/N)",
    "fsdp2_hsdp": "FSDP2 HSDP (shard in the node, bf16 all-reduce across nodes), Lion",
    "megatron_distopt_k1": "Megatron distributed optimizer, 1 instance, Lion",
    "megatron_distopt_kN": "Megatron distributed optimizer, K instances (one per node), Lion",
    "lioncub_1bit_sync20": "LionCub flat 1bit{sync}",
    "lioncub_master_only": "LionCub flat 1bit{sync}, fp32 master sharded in the node (master-only)",
    "lioncub_node_voters_sync20": "LionCub node voters (1bit across nodes){sync}",
    "lioncub_zero3_node_voters_sync20": "DeepSpeed ZeRO-3 in the node + LionCub votes across nodes{sync}",
    "lioncub_fsdp2_node_voters_sync20": "FSDP2 in the node + LionCub votes across nodes{sync}",
}
EXACT = ("ddp_bf16", "zero1", "zero2", "zero3", "fsdp2_hsdp", "megatron_distopt_k1",
         "megatron_distopt_kN")  # = global Lion
# parameters sharded too: (framework, shard group, votes across the groups)
SHARDED = {"zero3": ("deepspeed", "dp", False), "fsdp2_hsdp": ("fsdp2", "node", False),
           "lioncub_zero3_node_voters_sync20": ("deepspeed", "node", True),
           "lioncub_fsdp2_node_voters_sync20": ("fsdp2", "node", True)}


@lru_cache(maxsize=64)
def _lioncub_layout(runs: tuple, voters: int, bucket_size_mb: float = 25.0,
                    comm_mb: float = wire.COMM_BUCKET_MB) -> tuple[list, int]:
    """(bucket runs, number of comm batches) of LionCub's real layout (``comm="1bit"``) for tensors
    of these runs and ``voters`` ranks: :func:`lioncub_ds.wire.bucket_runs` / ``batch_count``, the
    closed forms of :func:`lioncub_ds.layout.build_buckets` and ``comm_batches``."""
    buckets = wire.bucket_runs(list(runs), bucket_size_mb, voters)
    return buckets, wire.batch_count(buckets, comm_mb)


def _vote_traffic(runs, voters: int, geo: Geometry, scope: str, bucket_mb: float, shard: int = 1,
                  comm_mb: float = wire.COMM_BUCKET_MB) -> list[Traffic]:
    """LionCub's 1bit votes of a step (votes + the step's flags, which ride in the last batch):
    phase 1 all_to_all and phase 2 all_gather of every comm batch. ``shard`` = L for node voters
    (each full bucket of the Nn·L layout cut into L shards: the buckets the vote runs on, and the
    ones its comm batches pack: ``sharding.NodeVoters.buckets`` through ``layout.comm_batches``)."""
    if voters <= 1:
        return []
    buckets, batches = _lioncub_layout(tuple(runs), voters * shard, bucket_mb, comm_mb)
    if shard > 1:
        batches = wire.batch_count([(numel // shard, c) for numel, c in buckets], comm_mb)
    total = phase2 = 0
    for numel, c in buckets:
        numel //= shard
        total += c * wire.onebit_wire_bytes(numel, voters)
        phase2 += c * ring_bytes("all_gather", numel // 8, voters)  # the shard results, 1 bit per element
    flags = wire.flag_bytes(wire.count(buckets), voters, carried=True)  # 1bit's phase 1 carries them
    return [Traffic("votes (phase 1) + flags", "all_to_all", total - phase2 + flags, geo, scope, count=batches),
            Traffic("votes (phase 2)", "all_gather", phase2, geo, scope, count=batches)]


def _family(kind: str, sync_every) -> str:
    """The convergence table's family of a LionCub configuration."""
    return f"{kind}_1bit" + (f"_sync{sync_every}_{SYNC_DTYPE}" if sync_every else "")


def _sync_traffic(runs, voters, geo, scope, every, bucket_mb: float) -> list[Traffic]:
    if voters <= 1 or not every:
        return []
    chunks = wire.sync_chunk_runs(list(runs), bucket_mb)
    sent = sum(c * wire.sync_wire_bytes(numel, voters, SYNC_DTYPE) for numel, c in chunks)
    # each chunk: an all_to_all of the encoded shards, then an all_gather of the mean shards (half the bytes each)
    return [Traffic(f"momentum sync ({SYNC_DTYPE}, every {every}): {phase}", kind, sent / 2, geo, scope,
                    every=every, count=wire.count(chunks))
            for phase, kind in (("shards to their owners", "all_to_all"), ("means gathered", "all_gather"))]


def _across_nodes(runs, top: Topology, bucket_mb: float, sync_every,
                  comm_mb: float = wire.COMM_BUCKET_MB) -> list[Traffic]:
    """What one voter per node sends across the nodes (node voters, and ZeRO-3 / FSDP2 with votes):
    the 1-bit vote of its 1/L shard of every bucket over the Nn nodes, and the sync of the momentum shards."""
    nn, L, cross = top.dp_nodes, top.local, top.group("cross")
    buckets, _ = _lioncub_layout(tuple(runs), top.n, bucket_mb)
    return (_vote_traffic(runs, nn, cross, "inter_node", bucket_mb, shard=L, comm_mb=comm_mb)
            + _sync_traffic([(numel // L, c) for numel, c in buckets], nn, cross, "inter_node", sync_every, bucket_mb))


def _ring_traffic(purpose, kind, nbytes, geo, scope, buckets=1, overlappable=False, wire_factor=1.0):
    sent = ring_bytes(kind, int(nbytes), geo.size)
    return Traffic(purpose, kind, sent, geo, scope, overlappable=overlappable, count=buckets, wire_factor=wire_factor)


def _buckets_of(nbytes: float, cap: float = DDP_BUCKET_BYTES) -> int:
    return max(1, math.ceil(nbytes / cap))


def strategy(name: str, model: ModelSpec, cluster: ClusterSpec, work: WorkloadSpec, top: Topology,
             sync_every: int | None = SYNC_EVERY) -> dict:
    """One strategy's traffic, state and update bytes (before timing). ``sync_every``: the LionCub
    strategies' int8 momentum sync period (None: no sync)."""
    runs = model.gpu_runs(work.tp, work.pp)
    p = wire.total(runs)
    wp = work.param_bytes
    wg = wp
    n, L = top.n, top.local
    mixed = work.mixed
    mb, cmb = work.bucket_size_mb, work.comm_bucket_mb
    rs_factor = 2.0 if cluster.backend == "gloo" else 1.0  # gloo's reduce-scatter sends as an all-reduce
    traffic: list[Traffic] = []
    state = {"params": wp * p, "grads": wg * p, "momentum": 4 * p, "master": 4 * p if mixed else 0,
             "grad_partition": 0, "workspace": 0}
    master_holder = "framework" if mixed else "none"
    update = UPDATE_BYTES_LION * p
    overlap_ok = False
    notes = []
    conv = ("global", n, 1)
    config = {}
    if name == "ddp_bf16":
        gb = 2 * p
        traffic.append(_ring_traffic("gradient all-reduce (bf16)", "all_reduce", gb, top.group("dp"), "dp",
                                     _buckets_of(gb), overlappable=True))
        overlap_ok = True
        config = _ddp_config(work)
    elif name in ("zero1", "zero2"):
        stage = int(name[-1])
        pad = -(-p // n) * n
        traffic.append(_ring_traffic("gradient reduce-scatter (bf16)" if mixed else "gradient reduce-scatter",
                                     "reduce_scatter", wg * pad, top.group("dp"), "dp",
                                     _buckets_of(wg * pad, 2 * DS_REDUCE_BUCKET_NUMEL), overlappable=stage == 2,
                                     wire_factor=rs_factor))
        traffic.append(_ring_traffic("parameter all-gather", "all_gather", wp * pad, top.group("dp"), "dp",
                                     _buckets_of(wp * pad, 2 * DS_REDUCE_BUCKET_NUMEL)))
        state.update(momentum=4 * pad // n, master=(4 * pad // n) if mixed else 0,
                     grad_partition=4 * pad // n if mixed else 0)
        if stage == 2:
            state["grads"] = wg * (pad // n + min(p, DS_REDUCE_BUCKET_NUMEL))
        master_holder = "optimizer partition" if mixed else "none"
        update = UPDATE_BYTES_LION * pad // n
        overlap_ok = stage == 2
        config = _zero_config(stage, work)
    elif name in SHARDED:
        framework, where, votes = SHARDED[name]
        shard = n if where == "dp" else L
        geo = top.group(where)
        pad = -(-p // shard) * shard
        # ZeRO-3 / FSDP2 inside the shard group: the parameters all-gathered for the forward and again
        # for the backward (the backward's overlaps), the gradients reduce-scattered (overlapped)
        nb = _buckets_of(wp * pad, 2 * DS_REDUCE_BUCKET_NUMEL)
        traffic.append(_ring_traffic("parameter all-gather for the forward", "all_gather", wp * pad, geo, where, nb))
        traffic.append(_ring_traffic("parameter all-gather for the backward", "all_gather", wp * pad, geo, where, nb,
                                     overlappable=True))
        traffic.append(_ring_traffic("gradient reduce-scatter", "reduce_scatter", wg * pad, geo, where, nb,
                                     overlappable=True, wire_factor=rs_factor))
        state.update(params=wp * pad // shard, grads=wg * pad // shard, momentum=4 * pad // shard,
                     master=(4 * pad // shard) if mixed else 0)
        master_holder = "framework shard" if mixed else "none"
        update = UPDATE_BYTES_LION * pad // shard
        overlap_ok = True
        if votes:
            traffic += _across_nodes(runs, top, mb, sync_every, cmb)
            update = UPDATE_BYTES_VOTE * pad // shard
            conv = (_family("node" if L > 1 else "flat", sync_every), n, L)
        elif where == "node" and top.dp_nodes > 1:  # HSDP: the shard all-reduced across the nodes in bf16
            traffic.append(_ring_traffic("shard all-reduce across nodes (bf16)", "all_reduce", 2 * pad // L,
                                         top.group("cross"), "across nodes", nb, overlappable=True))
        config = _sharded_config(framework, votes, work, sync_every)
        if L == 1 and votes:
            notes.append("one data-parallel rank per node: each rank is its own shard group (flat voting)")
    elif name.startswith("megatron_distopt"):
        k = 1 if name.endswith("k1") else (work.instances or top.dp_nodes)
        if n % k:
            raise PlanInputError(f"lioncub_ds.plan: --instances {k} must divide the {n} data-parallel ranks")
        s = n // k
        pad = -(-p // s) * s
        inst, peers = top.group("instance", s), top.group("peers", k)
        # --grad-reduce-in-bf16: the gradient buffer and its reduction in bf16 (2 B), whatever the parameters
        nb = _buckets_of(2 * pad, 40 * 2**20 * 2)  # Megatron's DDP buckets: ~40M elements
        traffic.append(_ring_traffic("gradient reduce-scatter in the instance (bf16)", "reduce_scatter", 2 * pad,
                                     inst, "instance", nb, overlappable=True, wire_factor=rs_factor))
        if k > 1:
            traffic.append(_ring_traffic("shard all-reduce across instances (bf16)", "all_reduce", 2 * pad // s,
                                         peers, "across instances", nb, overlappable=True))
        traffic.append(_ring_traffic("parameter all-gather in the instance", "all_gather", wp * pad, inst,
                                     "instance", nb))
        state.update(momentum=4 * pad // s, master=(4 * pad // s) if mixed else 0, grads=2 * p)
        master_holder = "optimizer shard" if mixed else "none"
        update = UPDATE_BYTES_LION * pad // s
        overlap_ok = True
        config = _megatron_distopt_config(k, work)
        notes.append(f"K = {k} instance(s) of {s} data-parallel ranks")
    elif name == "lioncub_1bit_sync20":
        geo = top.group("dp")
        traffic += _vote_traffic(runs, n, geo, "vote_group", mb, comm_mb=cmb)
        traffic += _sync_traffic(runs, n, geo, "vote_group", sync_every, mb)
        update = UPDATE_BYTES_VOTE * p
        overlap_ok = work.precision == "fp32"
        conv = (_family("flat", sync_every), n, 1)
        config = _lioncub_config(work, {}, sync_every)
    elif name == "lioncub_master_only":
        geo = top.group("dp")
        traffic += _vote_traffic(runs, n, geo, "vote_group", mb, comm_mb=cmb)
        traffic += _sync_traffic(runs, n, geo, "vote_group", sync_every, mb)
        update = UPDATE_BYTES_VOTE * p
        conv = (_family("flat", sync_every), n, 1)
        if mixed and L > 1:
            update = master_only_update_bytes(wp, L) * p
            buckets, _ = _lioncub_layout(tuple(runs), n, mb)
            total = wire.total(buckets)
            traffic.append(Traffic("master shards all-gather in the node", "all_gather",
                                   sum(c * ring_bytes("all_gather", wp * numel, L) for numel, c in buckets),
                                   top.group("node"), "intra_node", count=wire.count(buckets)))
            state["master"] = 4 * total // L
            state["workspace"] = master_only_workspace_bytes(buckets, wp)
            master_holder = "LionCub (1/L shard)"
        elif not mixed:
            notes.append("fp32 parameters have no master: the same as flat")
        config = _lioncub_config(work, {"node_size": L}, sync_every)
        if mixed and L > 1:
            notes.append(f"workspace: LionCub's all-gather receive buffers ({wire.WINDOW} buckets in turn), kept "
                         "from step to step")
    elif name == "lioncub_node_voters_sync20":
        nn = top.dp_nodes
        buckets, _ = _lioncub_layout(tuple(runs), n, mb)
        total = wire.total(buckets)
        if L > 1:
            traffic.append(Traffic("node group: gradient reduce-scatter, parameter all-gather, flags", "all_to_all",
                                   wire.node_group_bytes(buckets, wg, wp, L, n), top.group("node"), "intra_node",
                                   count=2 * wire.count(buckets) + 1))
        traffic += _across_nodes(runs, top, mb, sync_every, cmb)
        state.update(momentum=4 * total // L, master=(4 * total // L) if mixed else 0)
        master_holder = "LionCub (1/L shard)" if mixed else "none"
        update = node_voter_update_bytes(wg, wp, L, mixed) * total
        conv = (_family("node" if L > 1 else "flat", sync_every), n, L)
        # the launcher's LOCAL_SIZE is L only when every GPU of a node is a data-parallel rank of one group
        extra = {"voters": "node"} if L == top.gpus_per_node else {"voters": "node", "node_size": L}
        config = _lioncub_config(work, extra, sync_every, node_voters=(nn, L))
        if L == 1:
            notes.append("one data-parallel rank per node: node voters are flat voting")
        else:
            state["workspace"] = node_voter_workspace_bytes(buckets, wg, wp, L, mixed)
            shards = "fp32 gradient shards" + ("" if mixed else " and parameter shards")
            notes.append(f"workspace: LionCub's step buffers (the group's send, receive and all-gather buffers, "
                         f"{wire.WINDOW} buckets in turn; {shards} of 1/L), kept from step to step; under Megatron "
                         "(its flags) the distributed optimizer's own buffers take their place")
    else:
        raise _err("strategy", name, ", ".join(STRATEGIES))
    host_buckets = None  # the buckets LionCub's step walks on each rank (its host time is per bucket)
    if name in LIONCUB_STAGE0:
        host_buckets = wire.count(_lioncub_layout(tuple(runs), n, mb)[0])
    elif name in SHARDED and SHARDED[name][2]:  # votes on this rank's 1/L partition of every parameter
        host_buckets = math.ceil(4 * (-(-p // L)) / (mb * 2**20))
    sync = f" + {SYNC_DTYPE} momentum sync every {sync_every}" if sync_every else ", no momentum sync"
    refused = refusals(name, work, top)
    config = {k: v for k, v in config.items() if k not in refused}
    return {"name": name, "label": LABELS[name].format(sync=sync), "traffic": traffic, "state": state, "master_holder": master_holder,
            "update_bytes": update, "overlap_ok": overlap_ok, "conv_key": conv, "config": config, "notes": notes,
            "refused": refused, "runnable": any(config.get(k) for k in RUNNERS), "host_buckets": host_buckets}


RUNNERS = ("deepspeed", "megatron_flags", "torch")  # the config keys a strategy is run from
LIONCUB_STAGE0 = ("lioncub_1bit_sync20", "lioncub_master_only", "lioncub_node_voters_sync20")


def refusals(name: str, work: WorkloadSpec, top: Topology) -> dict:
    """{config key: why} for the configs of ``name`` that its framework refuses on this workload, as
    the integrations do (lioncub_ds/deepspeed/engine.py ``check_supported``, lioncub_ds/deepspeed/zero3.py,
    DeepSpeed's pipeline engine, lioncub_ds.fsdp.shard_and_vote's world-wide groups): the planner prints
    none of them. A strategy left with no config is left out (not predicted, not recommended)."""
    why = []
    if work.pp > 1 and name in ("zero2", "zero3", "lioncub_zero3_node_voters_sync20"):
        why.append("DeepSpeed's pipeline engine refuses ZeRO-2 and ZeRO-3 with pipeline parallelism (--pp > 1)")
    if work.pp > 1 and name in LIONCUB_STAGE0:
        why.append("LionCub at DeepSpeed's ZeRO stage 0 does not support pipeline parallelism (--pp > 1)")
    if work.tp > 1 and name == "lioncub_zero3_node_voters_sync20":
        why.append("ZeRO-3 with LionCub's votes makes DeepSpeed's data-parallel groups itself and refuses an mpu "
                   "(tensor parallelism, --tp > 1)")
    if work.precision == "fp16" and (name == "lioncub_node_voters_sync20"
                                     or (name == "lioncub_master_only" and top.local > 1)):
        why.append("LionCub refuses " + ("voters='node'" if name == "lioncub_node_voters_sync20" else
                                         "master-only sharding (node_size > 1)") + " with fp16.enabled=true "
                   "(DeepSpeed's fp16 wrapper keeps a full fp32 master on every rank): use bf16 or fp32")
    out = {"deepspeed": "; ".join(why)} if why else {}
    if (work.tp > 1 or work.pp > 1) and name == "lioncub_fsdp2_node_voters_sync20":
        out["torch"] = ("lioncub_ds.fsdp.shard_and_vote shards and votes over every rank of the world: no tensor or "
                        "pipeline parallelism (--tp, --pp > 1)")
    return out


# ----------------------------------------------------------------------------- configs
# Lion's usual LLM betas, in every printed config (docs/hyperparameters.md): a starting point to tune.
# The convergence studies the planner quotes ran other betas (printed next to each quote).
CONFIG_BETAS = (0.95, 0.98)


def _ds_precision(work: WorkloadSpec) -> dict:
    return {"bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True}}, "fp32": {}}[work.precision]


def _lioncub_params(extra: dict, sync_every, bucket_mb: float = 25.0, comm_mb: float = wire.COMM_BUCKET_MB) -> dict:
    base = {"lr": 1e-4, "betas": list(CONFIG_BETAS), "weight_decay": 0.1, "comm": "1bit", "vote": "majority",
            "tie_break": "hash", "momentum_dtype": "fp32", "nonfinite": "skip"}
    if bucket_mb != 25.0:
        base["bucket_size_mb"] = bucket_mb
    if comm_mb != wire.COMM_BUCKET_MB:
        base["comm_bucket_mb"] = comm_mb
    if sync_every:
        base["momentum_sync"] = {"every": sync_every, "dtype": SYNC_DTYPE}
    base.update(extra)
    return base


def _lioncub_config(work: WorkloadSpec, extra: dict, sync_every, node_voters=None) -> dict:
    ds = dict(_ds_precision(work), zero_optimization={"stage": 0},
              optimizer={"type": "LionCub", "params": _lioncub_params(extra, sync_every, work.bucket_size_mb,
                                                                      work.comm_bucket_mb)})
    flags = ["--lioncub-comm 1bit", f"--lioncub-beta1 {CONFIG_BETAS[0]:g}", f"--lioncub-beta2 {CONFIG_BETAS[1]:g}"]
    if work.bucket_size_mb != 25.0:
        flags.append(f"--lioncub-bucket-size-mb {work.bucket_size_mb:g}")
    if work.comm_bucket_mb != wire.COMM_BUCKET_MB:
        flags.append(f"--lioncub-comm-bucket-mb {work.comm_bucket_mb:g}")
    if sync_every:
        flags += [f"--lioncub-momentum-sync-every {sync_every}", f"--lioncub-momentum-sync-dtype {SYNC_DTYPE}"]
    if node_voters is not None:
        nn, _ = node_voters
        flags = ["--use-distributed-optimizer", f"--num-distributed-optimizer-instances {nn}",
                 "--lioncub-voters node"] + flags
    megatron = flags
    if extra.get("voters", "rank") == "rank" and "node_size" in extra:
        megatron = None  # Megatron refuses master-only sharding: its distributed optimizer shards the master
    return {"deepspeed": ds, "megatron_flags": megatron}


def _ddp_config(work: WorkloadSpec) -> dict:
    # with TP or PP not every rank is a replica: DDP runs over the data-parallel group the plan priced
    group = ", process_group=<this rank's data-parallel group>" if work.tp * work.pp > 1 else ""
    return {"torch": f"DistributedDataParallel(model{group}); model.register_comm_hook(None, bf16_compress_hook); "
                     "lioncub_ds.Lion(model.parameters(), lr=1e-4, betas=(0.95, 0.98), weight_decay=0.1)"}


def _zero_config(stage: int, work: WorkloadSpec) -> dict:
    zero = {"stage": stage}
    if stage == 2:
        zero.update(overlap_comm=True, contiguous_gradients=True, reduce_scatter=True)
    ds = dict(_ds_precision(work), zero_optimization=zero,
              optimizer={"type": "LionCub", "params": {"lr": 1e-4, "betas": list(CONFIG_BETAS), "weight_decay": 0.1,
                                                       "momentum_dtype": "fp32", "zero_allgather": "params"}})
    return {"deepspeed": ds}


def _sharded_config(framework: str, votes: bool, work: WorkloadSpec, sync_every) -> dict:
    """ZeRO-3 (a ds_config) or FSDP2 (the torch calls), with LionCub's votes across nodes or without."""
    extra = {"voters": "node"} if votes else {}
    params = _lioncub_params(extra, sync_every if votes else None, work.bucket_size_mb,
                             work.comm_bucket_mb if votes else wire.COMM_BUCKET_MB)
    if framework == "deepspeed":
        if not votes:
            params = {k: v for k, v in params.items() if k not in ("comm", "vote", "tie_break", "nonfinite")}
        return {"deepspeed": dict(_ds_precision(work), zero_optimization={"stage": 3, "overlap_comm": True},
                                  optimizer={"type": "LionCub", "params": params}),
                "megatron_flags": None}  # Megatron shards no parameters this way: its node voters are the match
    if votes:
        sync = f', momentum_sync={{"every": {sync_every}, "dtype": "{SYNC_DTYPE}"}}' if sync_every else ""
        return {"torch": "model, opt = lioncub_ds.fsdp.shard_and_vote(model, shard_size=<GPUs per node>, lr=1e-4, "
                         f"betas=(0.95, 0.98), weight_decay=0.1, comm=\"1bit\"{sync})"}
    shape = ("(nodes, data-parallel ranks per node) over this rank's data-parallel ranks"
             if work.tp * work.pp > 1 else "(nodes, gpus_per_node)")
    return {"torch": f"mesh = init_device_mesh(\"cuda\", {shape}); fully_shard(model, mesh=mesh); "
                     "lioncub_ds.Lion(model.parameters(), lr=1e-4, betas=(0.95, 0.98), weight_decay=0.1)"}


def _megatron_distopt_config(k: int, work: WorkloadSpec) -> dict:
    flags = ["--optimizer lion", f"--lion-beta1 {CONFIG_BETAS[0]:g}", f"--lion-beta2 {CONFIG_BETAS[1]:g}",
             "--use-distributed-optimizer",
             "--overlap-grad-reduce", "--grad-reduce-in-bf16"]
    if k > 1:
        flags.append(f"--num-distributed-optimizer-instances {k}")
    return {"megatron_flags": flags, "note": "Megatron-LM >= 0.18 (its own --optimizer lion); no LionCub"}


# ----------------------------------------------------------------------------- convergence
@lru_cache(maxsize=1)
def convergence_table() -> dict:
    """The measured convergence costs (lioncub_ds/plan_convergence.json, generated from the committed
    study summaries by ``python -m benchmarks plan_check --write-convergence-table``)."""
    with resources.files(__package__).joinpath("plan_convergence.json").open("r", encoding="utf-8") as f:
        return json.load(f)


_FAMILY = re.compile(r"^(?P<kind>flat|node)_1bit(?:_sync(?P<every>[0-9]+)_int8)?$")


def configuration(family: str, node_size: int = 1, voters: int | None = None) -> str:
    """A family of the table in words: "node voters 16 x 2 + int8 sync/20", "flat 1bit"."""
    m = _FAMILY.match(family)
    if m is None:
        raise ValueError(f"unknown convergence family {family!r}")
    what = (f"node voters {voters} x {node_size}" if voters else "node voters") if m["kind"] == "node" \
        else "flat 1bit"
    return what + (f" + int8 sync/{m['every']}" if m["every"] else "")


def quote(row: dict) -> str:
    """One measured row as the planner prints it: the study, N, the configuration, the paired gap with
    its 95% interval and the seeds ("lion_w300 N = 32, node voters 16 x 2 + int8 sync/20: +1.07%
    [+0.70, +1.44], 10 seeds"), and, when the interval's upper bound is above the studies' goal (a gap
    of at most 2%), that it is ("...; upper bound above the 2% goal")."""
    goal = convergence_table().get("goal_gap_pct")
    over = f"; upper bound above the {goal:g}% goal" if goal is not None and row["ci_hi_pct"] > goal else ""
    return (f"{row['study']} N = {row['world_size']}, "
            f"{configuration(row['family'], row['node_size'], row.get('voters'))}: {row['gap_pct']:+.2f}% "
            f"[{row['ci_lo_pct']:+.2f}, {row['ci_hi_pct']:+.2f}], {row['seeds']} seeds{over}")


def convergence_cost(key: tuple) -> dict:
    """What the chosen study measured for the configuration ``(family, N, L)``: the row at this N and L,
    else the nearest measured N (log scale; a tie goes to the larger N) and there the nearest L,
    quoted with its interval and seeds. ``exact``: measured at this very N and L."""
    family, n, local = key
    if family == "global":
        return {"gap_pct": 0.0, "ci95": [0.0, 0.0], "seeds": None, "study": "reference", "exact": True,
                "text": "none: global Lion (all-reduced gradients) is the studies' reference"}
    voters = n // local if family.startswith("node") else n
    if voters <= 1:  # one voter steps Lion on the (node-)mean gradient: global Lion, nothing to measure
        what = "one rank" if n <= 1 else f"one node group of {n} (node voters: Lion on the node-mean gradient)"
        return {"gap_pct": 0.0, "ci95": [0.0, 0.0], "seeds": None, "study": "reference", "exact": True,
                "text": f"none: {what} votes alone, which is global Lion (N = {n})"}
    table = convergence_table()
    rows = [r for r in table["rows"] if r["family"] == family]
    if not rows:
        studies = ", ".join(src["study"] for src in table["sources"])
        return {"gap_pct": None, "ci95": None, "seeds": None, "study": None, "exact": False,
                "text": f"not measured: {studies} has no {configuration(family)} run"}
    near_n = min({r["world_size"] for r in rows}, key=lambda m: (abs(math.log(m / n)), -m))
    row = min((r for r in rows if r["world_size"] == near_n),
              key=lambda r: (abs(math.log(r["node_size"] / local)), -r["node_size"]))
    exact = near_n == n and row["node_size"] == local
    where = f"N = {n}" + (f" with L = {local}" if near_n == n else "")
    return {"gap_pct": row["gap_pct"], "ci95": [row["ci_lo_pct"], row["ci_hi_pct"]], "seeds": row["seeds"],
            "study": row["study"], "preset": row.get("preset"), "world_size": row["world_size"],
            "node_size": row["node_size"], "exact": exact, "measured_at": measured_at(row["study"]),
            "text": quote(row) if exact else f"not measured at {where}; nearest: {quote(row)}"}


def measured_at(study: str) -> dict:
    """The settings ``study`` trained at (its source entry in the table): model size, steps, betas,
    tie_break."""
    src = next((x for x in convergence_table()["sources"] if x["study"] == study), {})
    return {k: src.get(k) for k in ("params", "steps", "betas", "tie_break")}


def settings_text(study: str) -> str:
    """"betas (0.8, 0.9), tie_break hash, 1,200 steps of a 120,576-parameter GPT": what ``study``
    measured at, next to every quote (the printed configs run other betas)."""
    m = measured_at(study)
    betas = f"betas ({m['betas'][0]:g}, {m['betas'][1]:g})" if m.get("betas") else "betas not recorded"
    return (f"{betas}, tie_break {m.get('tie_break') or '?'}, {m.get('steps') or 0:,} steps of a "
            f"{m.get('params') or 0:,}-parameter GPT")


# ----------------------------------------------------------------------------- the plan
def _compute_time(model: ModelSpec, work: WorkloadSpec) -> float:
    if work.compute_time_s is not None:
        return work.compute_time_s
    return work.tokens_per_gpu * model.flops_per_token() / (work.mfu * work.peak_tflops * 1e12)


def evaluate(name, model, cluster, work, top, sync_every=SYNC_EVERY) -> dict:
    s = strategy(name, model, cluster, work, top, sync_every)
    compute = _compute_time(model, work)
    if work.update_time_s is not None:  # measured fused Lion on this GPU's parameters: scales the bytes
        p = model.gpu_params(work.tp, work.pp)
        update = work.update_time_s * s["update_bytes"] / (UPDATE_BYTES_LION * p)
    else:
        update = s["update_bytes"] / (cluster.hbm_gbyte_s * 1e9)
    comm = overlappable = 0.0
    inter = intra = sent = 0.0
    by_scope: dict = {}
    parts = []
    for t in s["traffic"]:
        ct = collective_time(t, top, cluster)
        per_step = ct["time_s"] / t.every
        comm += per_step
        if t.overlappable and s["overlap_ok"]:
            overlappable += per_step
        inter += ct["inter_bytes_per_node"] / t.every
        intra += ct["intra_bytes_per_gpu"] / t.every
        sent += t.sent / t.every
        by_scope[t.scope] = by_scope.get(t.scope, 0.0) + t.sent / t.every
        parts.append({"purpose": t.purpose, "collective": t.kind, "scope": t.scope, "bytes_per_gpu": t.sent,
                      "every_steps": t.every, "count": t.count, "time_s": ct["time_s"], "bound": ct["bound"]})
    backward = BACKWARD_SHARE * compute
    # the last bucket of an overlapped reduction starts when backward ends: never hidden
    last = sum(p_["time_s"] / t.count for p_, t in zip(parts, s["traffic"]) if t.overlappable and s["overlap_ok"])
    exposed_overlap = comm - overlappable + max(overlappable - cluster.overlap * backward, min(last, overlappable))
    step = compute + update + exposed_overlap
    st = s["state"]
    optimizer_state = st["momentum"] + st["master"] + st["grad_partition"]
    model_state = st["params"] + st["grads"] + optimizer_state + st["workspace"]
    budget = cluster.gpu_mem_gib * 2**30 - work.activation_gib * 2**30
    conv = convergence_cost(s["conv_key"])
    return {"name": name, "label": s["label"],
            "bytes_per_gpu": sent, "bytes_per_gpu_by_scope": by_scope,
            "inter_node_bytes_per_node": inter, "intra_node_bytes_per_gpu": intra,
            "state_bytes_per_gpu": optimizer_state, "workspace_bytes_per_gpu": st["workspace"],
            "state_breakdown": dict(st, master_holder=s["master_holder"]),
            "model_state_bytes_per_gpu": model_state, "fits": model_state <= budget,
            "comm_time_s": comm, "exposed_comm_no_overlap_s": comm, "exposed_comm_overlap_s": exposed_overlap,
            "overlap_used": bool(s["overlap_ok"] and overlappable > 0),
            "compute_time_s": compute, "update_time_s": update, "step_time_s": step,
            "tokens_per_s": work.tokens_per_gpu * cluster.gpus / step,
            "convergence": conv, "collectives": parts, "config": s["config"], "refused": s["refused"],
            "runnable": s["runnable"], "notes": s["notes"], "lioncub_buckets_per_rank": s["host_buckets"]}


def plan(model: ModelSpec, cluster: ClusterSpec, work: WorkloadSpec, strategies=STRATEGIES,
         min_speedup: float = 1.1, sync_every: int | None = SYNC_EVERY) -> dict:
    """Predictions for every strategy, and the recommendation (a dict; ``main`` prints it).
    ``sync_every``: the LionCub strategies' int8 momentum sync period (None or 0: none)."""
    top = Topology.of(cluster, work)
    for name in strategies:
        if name not in STRATEGIES:
            raise _err("--strategies", name, ", ".join(STRATEGIES))
    _check("--min-speedup", min_speedup)
    if sync_every is not None:
        _check("--sync-every", sync_every)
    rows, left_out = [], []
    for name in strategies:
        row = evaluate(name, model, cluster, work, top, sync_every or None)
        if row.pop("runnable"):
            rows.append(row)
        else:  # every config it has is refused here: not predicted, not recommended, said why
            left_out.append({"name": name, "label": row["label"],
                             "why": "; ".join(row["refused"].values()) + " (and it has no other config)"})
    return {"inputs": {"model": {k: v for k, v in asdict(model).items() if k != "param_numels"},
                       "params": model.total, "cluster": asdict(cluster), "workload": asdict(work),
                       "data_parallel": top.n, "dp_ranks_per_node": top.local, "dp_nodes": top.dp_nodes},
            "strategies": rows, "left_out": left_out, "recommendation": recommend(rows, min_speedup, top.local),
            "note": "predictions from lioncub_ds.plan's model (docs/planner.md), not measurements"}


def _measured_note(conv: dict) -> str:
    if not conv.get("measured_at"):
        return ""
    return (f" (measured at {settings_text(conv['study'])}; this config's betas are "
            f"({CONFIG_BETAS[0]:g}, {CONFIG_BETAS[1]:g}))")


NODE_VOTER_STRATEGIES = ("lioncub_node_voters_sync20", "lioncub_zero3_node_voters_sync20",
                         "lioncub_fsdp2_node_voters_sync20")
NEAR_TIE = 1.05  # a node-voter strategy this close to the fastest LionCub one is preferred


def _meets_goal(row: dict) -> bool | None:
    """Whether the interval quoted for ``row`` has its upper bound within the studies' goal (None:
    nothing measured, or no goal)."""
    goal = convergence_table().get("goal_gap_pct")
    ci = row["convergence"].get("ci95")
    return None if goal is None or ci is None else ci[1] <= goal


def _best_lioncub(cubs: list[dict], ranks_per_node: int = 1) -> dict | None:
    """The LionCub strategy weighed against the exact ones: the fastest of those whose measured
    interval meets the studies' goal (upper bound at most the goal; all of them when none does),
    or, with several ranks per node (L > 1), a node-voter strategy within NEAR_TIE of it
    (docs/convergence.md: with several nodes, one voter per node; the flat gap grows with N, the
    node voters' does not)."""
    if not cubs:
        return None
    pool = [r for r in cubs if _meets_goal(r)] or cubs  # (quotes "not measured": kept only when nothing meets it)
    best = min(pool, key=lambda r: r["step_time_s"])
    near = [r for r in pool if ranks_per_node > 1 and r["name"] in NODE_VOTER_STRATEGIES
            and r["step_time_s"] <= NEAR_TIE * best["step_time_s"]]
    return min(near, key=lambda r: r["step_time_s"]) if near else best


def recommend(rows: list[dict], min_speedup: float, ranks_per_node: int = 1) -> dict:
    """The fastest strategy that fits; a LionCub strategy only when it beats the fastest exact one
    (global Lion) by ``min_speedup``, since its convergence cost is measured only on small models,
    and, where an exact one fits, never one whose measured gap's upper bound misses the goal.
    ``ranks_per_node``: L (several: a node-voter strategy near the fastest LionCub one is preferred)."""
    if not rows:
        return {"name": None, "why": "none of the strategies asked for runs on this workload (see left_out)",
                "config": None}
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        least = min(rows, key=lambda r: r["model_state_bytes_per_gpu"])
        return {"name": None, "why": f"nothing fits; the least memory is {least['name']} "
                                     f"({_bytes(least['model_state_bytes_per_gpu'])} per GPU): add tensor "
                                     "or pipeline parallelism (--tp, --pp) or GPUs", "config": None}
    exact = [r for r in fitting if r["name"] in EXACT]
    best_exact = min(exact, key=lambda r: r["step_time_s"]) if exact else None
    best_cub = _best_lioncub([r for r in fitting if r["name"] not in EXACT], ranks_per_node)
    missed = best_cub is not None and _meets_goal(best_cub) is False  # measured, its upper bound above the goal
    fast = best_cub is not None and (best_exact is None
                                     or best_exact["step_time_s"] >= min_speedup * best_cub["step_time_s"])
    if fast and (best_exact is None or not missed):
        pick = best_cub
        speed = best_exact["step_time_s"] / best_cub["step_time_s"] if best_exact else None
        why = (f"{speed:.2f}x the step rate of the fastest exact strategy ({best_exact['name']})"
               if best_exact else "the only strategies that fit are LionCub's") + \
              f"; convergence cost: {best_cub['convergence']['text']}" + _measured_note(best_cub["convergence"])
    else:
        pick = best_exact
        why = "the fastest exact strategy (global Lion: no convergence cost)"
        if fast and missed:
            why += (f"; the fastest LionCub strategy that fits ({best_cub['name']}, "
                    f"{best_exact['step_time_s'] / best_cub['step_time_s']:.2f}x) misses the convergence goal: "
                    f"{best_cub['convergence']['text']}")
        elif best_cub is not None:
            why += (f"; the fastest LionCub strategy ({best_cub['name']}) would be "
                    f"{best_exact['step_time_s'] / best_cub['step_time_s']:.3f}x, below the {min_speedup:g}x worth "
                    "a convergence risk")
    return {"name": pick["name"], "label": pick["label"], "why": why, "config": pick["config"],
            "refused": pick["refused"], "step_time_s": pick["step_time_s"], "tokens_per_s": pick["tokens_per_s"],
            "lioncub_buckets_per_rank": pick.get("lioncub_buckets_per_rank")}


# ----------------------------------------------------------------------------- CLI
def _arg(flag):
    """The argparse type of ``flag``: its range from :data:`LIMITS` (the same check as the API's)."""
    def parse(text):
        integer, _, _ = LIMITS[flag]
        try:
            value = parse_count(text) if flag == "--params" else int(str(text), 10) if integer else float(text)
        except (ValueError, IndexError, OverflowError):
            value = None
        try:
            return _check(flag, value)
        except PlanInputError:
            example = " (e.g. 1300000000, 1.3B, 7e9)" if flag == "--params" else ""
            raise argparse.ArgumentTypeError(f"{flag} must be {allowed(flag)}{example}, got {text!r}") from None
    return parse


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line: the flag and what it allows (argparse would print the whole usage first)."""
        message = re.sub(r"^argument (\S+): (?=\1 )", "", message)  # our messages name the flag already
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m lioncub_ds.plan",
                                description="Predicted memory, bytes and step time per data-parallel strategy "
                                            "(DDP, ZeRO, Megatron's distributed optimizer, LionCub), with the "
                                            "measured convergence cost and a recommended config. Predictions: "
                                            "see docs/planner.md for how far they are from measurements.")
    m = p.add_argument_group("model (--params, or the GPT shape)")
    m.add_argument("--params", type=_arg("--params"), help="parameter count (1300000000, 1.3B, 7e9)")
    for flag in ("layers", "hidden", "vocab", "seq"):
        m.add_argument(f"--{flag}", type=_arg(f"--{flag}"))
    w = p.add_argument_group("workload")
    w.add_argument("--precision", default="bf16", choices=PRECISIONS)
    w.add_argument("--tokens-per-gpu", type=_arg("--tokens-per-gpu"), default=8192,
                   help="tokens per GPU per optimizer step (micro-batches x sequence length x accumulation)")
    w.add_argument("--compute-time-s", type=_arg("--compute-time-s"),
                   help="measured forward+backward time of one step (else from --mfu and --peak-tflops)")
    w.add_argument("--mfu", type=_arg("--mfu"), default=0.4)
    w.add_argument("--peak-tflops", type=_arg("--peak-tflops"), default=989.0,
                   help="peak dense bf16 TFLOP/s per GPU (H100 SXM: 989)")
    w.add_argument("--tp", type=_arg("--tp"), default=1, help="tensor-parallel size (inside a node)")
    w.add_argument("--pp", type=_arg("--pp"), default=1, help="pipeline-parallel size")
    w.add_argument("--instances", type=_arg("--instances"),
                   help="K of Megatron's distributed optimizer (default: one instance per node)")
    w.add_argument("--bucket-size-mb", type=_arg("--bucket-size-mb"), default=25.0,
                   help="LionCub's bucket_size_mb (its vote buckets and momentum-sync chunks)")
    w.add_argument("--comm-bucket-mb", type=_arg("--comm-bucket-mb"), default=wire.COMM_BUCKET_MB,
                   help="LionCub's comm_bucket_mb (MB of packed votes per communication batch)")
    w.add_argument("--activation-gib", type=_arg("--activation-gib"), default=0.0,
                   help="GPU memory reserved for activations when judging the fit (default 0: model states only)")
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=_arg("--nodes"), default=1)
    c.add_argument("--gpus-per-node", type=_arg("--gpus-per-node"), default=8)
    c.add_argument("--gpu-mem-gib", type=_arg("--gpu-mem-gib"), default=80.0)
    c.add_argument("--intra-node-gbyte", type=_arg("--intra-node-gbyte"), default=450.0,
                   help="per-GPU bus bandwidth inside a node, GB/s (nccl-tests busbw; H100 NVLink ~450)")
    c.add_argument("--inter-node-gbit", type=_arg("--inter-node-gbit"), default=100.0,
                   help="inter-node bandwidth per node, Gbit/s (all its NICs)")
    c.add_argument("--intra-latency-us", type=_arg("--intra-latency-us"), default=5.0)
    c.add_argument("--inter-latency-us", type=_arg("--inter-latency-us"), default=10.0)
    c.add_argument("--hbm-gbyte", type=_arg("--hbm-gbyte"), default=3000.0,
                   help="memory bandwidth of the optimizer kernels, GB/s (H100 SXM HBM3: 3350 peak)")
    c.add_argument("--overlap", type=_arg("--overlap"), default=1.0,
                   help="share of backward that hides overlapped communication (0-1)")
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), metavar="NAME",
                   help=f"which strategies (default all): {', '.join(STRATEGIES)}")
    p.add_argument("--sync-every", type=_arg("--sync-every"), default=SYNC_EVERY, metavar="K",
                   help="LionCub's int8 momentum sync every K steps (the recommended 20; 0: none). For "
                        "momentum_sync schedule='drift', whose rate the planner cannot predict, give the mean gap "
                        "between syncs of a run (steps / comm_stats()['momentum_sync']['syncs'])")
    p.add_argument("--min-speedup", type=_arg("--min-speedup"), default=1.1,
                   help="recommend a LionCub strategy only when this much faster than the best exact one")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _specs(args) -> tuple[ModelSpec, ClusterSpec, WorkloadSpec]:
    model = ModelSpec(params=args.params, layers=args.layers, hidden=args.hidden, vocab=args.vocab, seq=args.seq)
    cluster = ClusterSpec(nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_mem_gib=args.gpu_mem_gib,
                          intra_gbyte_s=args.intra_node_gbyte, inter_gbit_s=args.inter_node_gbit,
                          intra_latency_us=args.intra_latency_us, inter_latency_us=args.inter_latency_us,
                          hbm_gbyte_s=args.hbm_gbyte, overlap=args.overlap)
    work = WorkloadSpec(precision=args.precision, tokens_per_gpu=args.tokens_per_gpu,
                        compute_time_s=args.compute_time_s, mfu=args.mfu, peak_tflops=args.peak_tflops,
                        tp=args.tp, pp=args.pp, instances=args.instances, activation_gib=args.activation_gib,
                        bucket_size_mb=args.bucket_size_mb, comm_bucket_mb=args.comm_bucket_mb)
    return model, cluster, work


WIDTH = 120  # every printed line fits a 120-column terminal


def _wrap(text: str, indent: str = "", more: str = "    ") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + more,
                         break_long_words=False, break_on_hyphens=False) or [indent]


def _seconds(t: float) -> str:
    return f"{t:.3f}" if t < 1e4 else f"{t:.3g}"


def _bytes(n: float) -> str:
    """Bytes in decimal units, as the rates are (GB/s, Gbit/s): 1 GB = 10^9 bytes."""
    for unit, scale in (("kB", 1e3), ("MB", 1e6), ("GB", 1e9), ("TB", 1e12), ("PB", 1e15)):
        if abs(n) < 1000 * scale or unit == "PB":
            v = n / scale
            return f"{n:.0f} B" if abs(n) < 1000 else f"{v:.1f} {unit}" if abs(v) < 100 else f"{v:.0f} {unit}"


def _rate(x: float) -> str:
    return f"{x:,.0f}" if 1 <= x < 1e12 else f"{x:.3g}"


def _recommendation_lines(result: dict) -> list[str]:
    rec = result["recommendation"]
    lines = _wrap(f"Recommendation: {rec['name'] or 'none'}" + (f" ({rec['label']})" if rec.get("label") else ""),
                  more="  ")
    lines += _wrap(f"why: {rec['why']}", "  ")
    cfg = rec.get("config") or {}
    refused = rec.get("refused") or {}
    if cfg.get("deepspeed"):
        lines += ["  ds_config.json:", "    " + json.dumps(cfg["deepspeed"], indent=2).replace("\n", "\n    ")]
    elif refused.get("deepspeed"):
        lines += _wrap(f"DeepSpeed: not available here: {refused['deepspeed']}", "  ")
    if cfg.get("megatron_flags"):
        lioncub = any(str(f).startswith("--lioncub") for f in cfg["megatron_flags"])
        lines += ["  Megatron-LM (" + ("python -m lioncub_ds.megatron.run pretrain_gpt.py" if lioncub
                                      else "torchrun ... pretrain_gpt.py: Megatron's own optimizer") + " ...):"]
        flags = _wrap(" ".join(cfg["megatron_flags"]), "    ", more="")
        lines += [f"{x} \\" for x in flags[:-1]] + flags[-1:]  # a shell line continued
    elif cfg.get("deepspeed") and "megatron_flags" in cfg:
        lines.append("  Megatron-LM: not available for this strategy (use node voters there)")
    if cfg.get("torch"):
        lines += ["  torch:"] + [f"    {stmt};" for stmt in cfg["torch"].split("; ")]
    if cfg.get("note"):
        lines += _wrap(f"note: {cfg['note']}", "  ")
    buckets = rec.get("lioncub_buckets_per_rank")
    if buckets and buckets >= HOST_NOTE_BUCKETS:
        lo, hi = (buckets * ms / 1e3 for ms in HOST_MS_PER_BUCKET)
        mb = result["inputs"]["workload"]["bucket_size_mb"]
        lines += _wrap(f"host time: {buckets:,} buckets per rank at bucket_size_mb={mb:g}; LionCub's step spends "
                       f"{HOST_MS_PER_BUCKET[0]:g}-{HOST_MS_PER_BUCKET[1]:g} ms of host time per bucket (measured on "
                       f"a CPU, not on a GPU host; not in the step time below): {lo:.2g}-{hi:.2g} s per step. A larger "
                       "--bucket-size-mb cuts it (docs/hyperparameters.md)", "  ")
    return lines


def format_plan(result: dict) -> str:
    """The plan as the CLI prints it: the inputs, the recommendation and its config, then every
    strategy's predictions, what was left out, and the measured convergence costs."""
    inp = result["inputs"]
    c, w = inp["cluster"], inp["workload"]
    lines = _wrap(f"PREDICTIONS (lioncub_ds.plan's model; docs/planner.md) for {inp['params'] / 1e9:,.2f}B "
                  f"parameters, {w['precision']}, {c['nodes']} x {c['gpus_per_node']} GPUs (DP {inp['data_parallel']}, "
                  f"TP {w['tp']}, PP {w['pp']}), {c['inter_gbit_s']:g} Gbit/s per node, {c['intra_gbyte_s']:g} GB/s "
                  f"per GPU inside a node, {w['tokens_per_gpu']} tokens/GPU/step, {c['gpu_mem_gib']:g} GiB "
                  f"({_bytes(c['gpu_mem_gib'] * 2**30)}) per GPU", more="  ") + [""]
    lines += _recommendation_lines(result) + [""]
    hdr = ("strategy", "mem/GPU", "buffers", "fits", "sent/GPU", "inter/node", "exposed no/ovl s",
           "step s", "tokens/s")
    rows = []
    for r in result["strategies"]:
        ws = r["workspace_bytes_per_gpu"]
        rows.append((r["name"], _bytes(r["model_state_bytes_per_gpu"]), _bytes(ws) if ws else "-",
                     "yes" if r["fits"] else "NO", _bytes(r["bytes_per_gpu"]), _bytes(r["inter_node_bytes_per_node"]),
                     f"{_seconds(r['exposed_comm_no_overlap_s'])} / {_seconds(r['exposed_comm_overlap_s'])}",
                     _seconds(r["step_time_s"]), _rate(r["tokens_per_s"])))
    widths = [max(len(str(x[i])) for x in rows + [hdr]) for i in range(len(hdr))]
    for row in [hdr] + rows:
        lines.append("  ".join(str(x).ljust(wd) for x, wd in zip(row, widths)).rstrip())
    lines += _wrap("mem/GPU: parameters, gradients, optimizer state and buffers (LionCub's step buffers, kept "
                   "from step to step) per GPU; exposed: the communication not hidden, without / with overlap; "
                   "bytes in decimal units like the rates (1 GB = 10^9 bytes)", more="  ")
    for out in result.get("left_out", []):
        lines += _wrap(f"left out: {out['name']}: {out['why']}", more="  ")
    # the convergence column: one cell per strategy, each with its interval, under the study it quotes
    src = (convergence_table()["sources"] or [{}])[0]
    lines += [""] + _wrap(f"Convergence cost (measured, not predicted: study {src.get('study')}, preset "
                          f"{src.get('preset')}: {settings_text(src.get('study'))}, where the printed configs use "
                          f"betas ({CONFIG_BETAS[0]:g}, {CONFIG_BETAS[1]:g}); the paired gap of the final validation "
                          "loss to global Lion at the same N, with its 95% interval over seeds):", more="  ")
    cells = [(", ".join(r["name"] for r in result["strategies"] if r["name"] in EXACT),
              convergence_cost(("global", 0, 1))["text"])]
    cells += [(r["name"], r["convergence"]["text"]) for r in result["strategies"] if r["name"] not in EXACT]
    for names, text in cells:
        if names and len(f"  {names}: {text}") <= WIDTH:
            lines.append(f"  {names}: {text}")
        elif names:  # the cell on lines of its own, so that its interval stays on one line
            lines += [f"  {names}:"] + _wrap(text, "    ")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model, cluster, work = _specs(args)
        result = plan(model, cluster, work, strategies=tuple(args.strategies), min_speedup=args.min_speedup,
                      sync_every=args.sync_every)
    except PlanInputError as exc:
        parser.error(str(exc).replace("lioncub_ds.plan: ", ""))
    if args.json:
        print(json.dumps(result, indent=1, default=float))
    else:
        print(format_plan(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
