"""``python -m benchmarks netns_nodes``: two nodes joined by a slow link (SPEC §7), as root.

Topology (two "nodes" on one machine). Each node is its own network namespace (unique names,
``lioncub-nodes-<pid>-<hex>-a`` / ``-b``) holding L ranks (``--ranks-per-node``, default 2); the
two namespaces are joined by a veth pair (``lcn-a`` 10.77.0.1/24 in node a, ``lcn-b`` 10.77.0.2/24
in node b) with a token bucket on BOTH ends (``tc qdisc replace dev lcn-X root tbf rate <bw>gbit
burst 512kb latency 100ms``: each direction has its own <bw>, like a full-duplex NIC); the
loopbacks are unshaped (the fast link inside a node). Both namespaces are deleted at the end, also
on an error or Ctrl-C/SIGTERM (the veth pair dies with them).

Addresses. Gloo binds each rank's one device to ONE address that it publishes through the store,
and every peer connects to that address. Every rank therefore binds to its node's veth address
(``GLOO_SOCKET_IFNAME=lcn-a`` / ``lcn-b``), which the other node can reach; the rendezvous
(``tcp://10.77.0.1:<port>``, rank 0's TCPStore) is on node a's veth address too. A connection
between two ranks of the same node goes to a local address of their own namespace, and Linux
routes every packet for a local address through that namespace's ``lo`` (the ``local`` routing
table), whatever device holds the address: node-internal traffic never touches the veth and its
token bucket. The counters prove it: each node's first rank reads its namespace's ``lo`` tx and
veth tx/rx byte counters after the barrier that opens a step and after the one that closes it.
``inter_node_bytes_per_rank`` = (veth tx of node a + of node b) / N; ``intra_node_bytes_per_rank``
= (lo tx of a + of b) / N (N = 2L; TCP/IP headers and the step's barriers included: ``no_comm``'s
row shows that overhead). (Binding to 127.0.0.1 would leave node b unable to reach node a; binding
node-mates to loopback and peers to the veth would need two devices per rank, which gloo does not
split by peer.)

Variants (same model, data and interleaved rounds as ``bench netns``; every one ends with the same
fused Lion kernels):

* ``no_comm``: each rank steps on its own gradient (the compute floor);
* ``ddp_lion_bf16``: torch DDP with ``bf16_compress_hook`` over all N ranks, then fused Lion;
* ``two_level_bf16``: the baseline of Megatron's multi-instance distributed optimizer
  (``--use-distributed-optimizer --num-distributed-optimizer-instances``): per 25 MB bucket the
  bf16 gradients are reduce-scattered inside the node (node group: the L ranks of a namespace),
  each 1/L shard is all-reduced in bf16 across the nodes (cross group: the ranks with the same
  local rank), Lion updates the shard (momentum of the shard only), and the node all-gathers the
  updated shard (in the parameters' dtype, fp32 here, as Megatron gathers its parameters);
* ``lioncub_1bit``: flat LionCub ``comm="1bit"``, every rank a voter;
* ``lioncub_1bit_node``: LionCub ``comm="1bit", voters="node", node_size=L`` (SPEC §7). Where this
  LionCub refuses the setting (:class:`LionCubConfigError`, found by constructing it on the ranks)
  the variant is reported as ``unavailable`` (with the error) and the others still run;
* ``lioncub_1bit_node_overlap``: the same with ``overlap=True``: the node's reduce-scatter of each
  bucket is issued from the gradient-ready hooks during backward and its vote follows one bucket
  behind (docs/node_voters.md); its exposed communication is step()'s wait plus what backward did
  not hide (the barrier after it), as for ``bench netns``'s overlap variants. Optional like the above.

Parameter sharding (issue 44; each on a model copy of its own, same seed; not in the default list,
``--variants`` selects them; optional: a framework that cannot build one reports it ``unavailable``):

* ``fsdp2_hsdp_bf16``: PyTorch FSDP2 HSDP, ``fully_shard`` on a 2-D (replicate, shard) DeviceMesh
  ((2, L): the shard dimension is a node), ``MixedPrecisionPolicy(reduce_dtype=bfloat16)`` (fp32
  parameters and all-gathers, bf16 gradients: reduce-scatter inside the node, all-reduce across
  nodes, as the bf16 baselines above), then the fused Lion update of the local shards. Both FSDP2
  variants shard the whole model as one unit with ``reshard_after_forward=True`` (parameters
  all-gathered for forward and again for backward, as every block of a per-block sharding);
* ``fsdp2_votes``: ``lioncub_ds.fsdp.shard_and_vote(model, shard_size=L, comm="1bit",
  mp_policy=<the same>)``: FSDP2 on a 1-D mesh per node, LionCub's 1-bit votes across nodes;
* ``zero3``: DeepSpeed ZeRO-3 over all N ranks with LionCub in the ds_config (no votes: global
  Lion on the fp32 partitions), fp32, ``DS_ACCELERATOR=cpu``;
* ``zero3_votes``: the same with ``"voters": "node", "node_size": L`` (ZeRO-3 inside each node,
  1-bit votes across: lioncub_ds/deepspeed/zero3.py).

Their communication inside forward and backward (all-gathers, reduce-scatters, HSDP's all-reduce)
is estimated like DDP's: forward+backward minus ``no_comm``'s, plus the waits inside step().
DeepSpeed's CPU accelerator would map a shared-memory all-reduce (``ShareMemCommBuilder``, /dev/shm,
which both namespaces share) that moves data between processes without any network device: only
``inference_all_reduce`` uses it, never ZeRO-3 training, but the bench disables it
(``deepspeed.comm.torch.build_shm_op`` returns None in the ranks) so that every byte DeepSpeed sends
goes through gloo's sockets and the veth counters (and no /dev/shm workspace is left behind).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time

import torch

from .common import GracefulExit, add_output_args, median, pyplot, run_ranks
from .netns import (DDP_BASELINE, FLOOR_VARIANT, FusedLion, _baseline_buckets, _kill_group, _make_opt, _sh,
                    add_run_args, child_env, delete_namespace, model_overrides, net_counter, ns_counter, preflight,
                    rank_cfg, report, run_guarded, setup_rank, timed_rounds)
from .netns import summarize as summarize_times

NAME = "netns_nodes"
TWO_LEVEL = "two_level_bf16"
NODE_VOTERS = "lioncub_1bit_node"
NODE_OVERLAP = "lioncub_1bit_node_overlap"
FSDP_HSDP = "fsdp2_hsdp_bf16"
FSDP_VOTES = "fsdp2_votes"
ZERO3 = "zero3"
ZERO3_VOTES = "zero3_votes"
SHARDED = (FSDP_HSDP, FSDP_VOTES, ZERO3, ZERO3_VOTES)  # parameters sharded (issue 44)
DEFAULT_VARIANTS = (FLOOR_VARIANT, DDP_BASELINE, TWO_LEVEL, "lioncub_1bit", NODE_VOTERS, NODE_OVERLAP)
VARIANTS = DEFAULT_VARIANTS + SHARDED
# reported "unavailable" when this LionCub (or FSDP2 / DeepSpeed) refuses their settings
OPTIONAL = (NODE_VOTERS, NODE_OVERLAP) + SHARDED
# the sharded variants' goal: inter-node bytes per rank of the votes <= 1/10 of the same framework without
SHARDED_GOALS = ((ZERO3_VOTES, ZERO3), (FSDP_VOTES, FSDP_HSDP))
SHARDED_GOAL = 10
IFNAMES = ("lcn-a", "lcn-b")  # the veth ends, one inside each namespace
ADDRS = ("10.77.0.1", "10.77.0.2")  # exist only inside the two namespaces
QDISC = "tbf rate {rate} burst 512kb latency 100ms"
LR, BETAS = 1e-4, (0.95, 0.98)
WHAT = "two network namespaces joined by a veth pair (ip netns add, ip link add) and shapes it"


def lioncub_kw(variant: str, ranks_per_node: int) -> dict | None:
    """LionCub's settings for a variant, or None when the variant is not a LionCub."""
    if variant == "lioncub_1bit":
        return dict(comm="1bit")
    if variant in (NODE_VOTERS, NODE_OVERLAP):
        return dict(comm="1bit", voters="node", node_size=ranks_per_node, overlap=variant == NODE_OVERLAP)
    return None


# ----------------------------------------------------------------------------- ranks (inside a namespace)
class TwoLevelLion(FusedLion):
    """Megatron's multi-instance distributed optimizer as a baseline: per DDP-style bucket (padded
    to a multiple of 8·L), bf16 gradients reduce-scattered in ``node_group``, the rank's shard
    all-reduced in bf16 in ``cross_group``, the fused Lion update of the shard (its own momentum,
    P/L per rank), and the fp32 all-gather of the updated shards in ``node_group``. The sums are
    not divided by N: sign(c) does not change when g and m carry the same factor."""

    def __init__(self, params, lr, betas, node_group, cross_group, local_rank, ranks_per_node, nodes):
        from lioncub_ds import kernels

        self.params, self.lr, self.betas, self.step_count = params, lr, betas, 0
        self.be = kernels.backend_for("cpu")
        self.node_group, self.cross_group = node_group, cross_group
        self.L, self.nodes = ranks_per_node, nodes
        self.buckets = []
        for ps, offs, size in _baseline_buckets(params):
            total = -(-size // (8 * self.L)) * 8 * self.L
            shard = total // self.L
            lo, hi = local_rank * shard, (local_rank + 1) * shard
            # (param, first element of it in the shard, where it lands in the shard, how many)
            pieces = [(p, max(lo, o) - o, max(lo, o) - lo, min(hi, o + p.numel()) - max(lo, o))
                      for p, o in zip(ps, offs) if o < hi and o + p.numel() > lo]
            self.buckets.append((ps, offs, total, shard, pieces, torch.zeros(shard)))
        self.last_split = None

    def step(self, n=1):
        """Returns (seconds inside the collectives, bytes this rank sent); ``last_split``: the
        ring formula's bytes inside the node and across nodes."""
        import torch.distributed as dist

        from lioncub_ds.telemetry import ring_bytes

        # torch >= 2.10 names them *_single (the *_tensor names warn); older torch has only those
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.step_count += 1
        comm_s, intra, inter = 0.0, 0, 0
        for ps, offs, total, size, pieces, mom in self.buckets:
            flat = torch.zeros(total, dtype=torch.bfloat16)
            for p, o in zip(ps, offs):
                flat[o:o + p.numel()].copy_(p.grad.reshape(-1))
            grad = torch.empty(size, dtype=torch.bfloat16)
            t = time.perf_counter()
            reduce_scatter(grad, flat, group=self.node_group)  # fast link
            dist.all_reduce(grad, group=self.cross_group)  # slow link: 1/L of the bucket per rank
            comm_s += time.perf_counter() - t
            intra += ring_bytes("reduce_scatter", total * 2, self.L)
            inter += ring_bytes("all_reduce", size * 2, self.nodes)
            master = torch.zeros(size)
            for p, src, dst, cnt in pieces:
                master[dst:dst + cnt].copy_(p.detach().view(-1)[src:src + cnt])
            self.apply_bucket([master], [0], size, [grad.float()], [mom])
            full = torch.empty(total)
            t = time.perf_counter()
            all_gather(full, master, group=self.node_group)  # fast link
            comm_s += time.perf_counter() - t
            intra += ring_bytes("all_gather", total * 4, self.L)
            with torch.no_grad():
                for p, o in zip(ps, offs):
                    p.view(-1).copy_(full[o:o + p.numel()])
        self.last_split = {"intra_node_bytes": intra, "inter_node_bytes": inter}
        return comm_s, intra + inter


def _groups(rank, n, L):
    """(node group, cross group) of ``rank``: every rank creates every group, in the same order."""
    import torch.distributed as dist

    node = cross = None
    for j in range(n // L):
        g = dist.new_group(list(range(j * L, (j + 1) * L)))
        node = g if j == rank // L else node
    for k in range(L):
        g = dist.new_group(list(range(k, n, L)))
        cross = g if k == rank % L else cross
    return node, cross


# ----------------------------------------------------------------------------- sharded variants (issue 44)
class ShardedLion(FusedLion):
    """HSDP's optimizer: the fused Lion update of this rank's local shards (FSDP2's storage, so
    the next all-gather reads the update), on FSDP2's reduced gradient shards (already averaged
    inside the node and all-reduced across nodes in backward). Momentum: the shards only."""

    def __init__(self, sharded, lr, betas):
        # (FSDP2's DTensor parameter, a plain tensor aliasing its local shard); empty shards skipped
        self.sharded = [(p, p.to_local().detach()) for p in sharded]
        self.sharded = [(p, leaf) for p, leaf in self.sharded if leaf.numel()]
        super().__init__([leaf for _, leaf in self.sharded], lr, betas)
        self.last_split = None

    def step(self, n=1):
        """Returns (0 s: the collectives ran in backward, 0: their bytes are not modelled here)."""
        self.step_count += 1
        grads = {id(leaf): p.grad.to_local() for p, leaf in self.sharded}
        for ps, offs, total in self.buckets:
            self.apply_bucket(ps, offs, total, [grads[id(q)] for q in ps])
        return 0.0, 0


class VoteStep:
    """The step of a sharded variant as ``timed_rounds`` calls a baseline's: ``step(n)`` runs it
    and returns (seconds the host waited inside LionCub's collectives, LionCub's bytes per rank:
    the votes and their flags); ``last_split``: LionCub's inter-node bytes (the votes)."""

    def __init__(self, step, stats):
        self._step, self._stats, self.last_split = step, stats, None

    def step(self, n=1):
        self._step()
        last = (self._stats() or {}).get("last_step") or {}
        scope = last.get("by_scope") or {}
        inter = scope.get("inter_node", scope.get("vote_group"))
        self.last_split = {"inter_node_bytes": int(inter)} if inter is not None else None
        return float(last.get("wait_time_s", 0.0)), int(last.get("bytes_sent", 0))


class _EngineLoss:
    """A DeepSpeed variant's loss: ``backward()`` is the engine's (ZeRO-3's reduce-scatter hooks)."""

    def __init__(self, engine, loss):
        self.engine, self.loss = engine, loss

    def backward(self):
        self.engine.backward(self.loss)

    def detach(self):
        return self.loss.detach()


class EngineModel:
    """A DeepSpeed engine as ``timed_rounds`` calls a model: ``(x, y) -> (logits, loss)``."""

    def __init__(self, engine):
        self.engine = engine

    def zero_grad(self, set_to_none=True):
        pass  # engine.step() clears ZeRO-3's gradient partitions itself

    def __call__(self, x, y):
        logits, loss = self.engine(x, y)
        return logits, _EngineLoss(self.engine, loss)


def _no_ds_shm():
    """DeepSpeed's CPU accelerator maps a shared-memory all-reduce (/dev/shm, shared by both
    namespaces: bytes moved there would cross "nodes" without touching the veth). Only
    ``inference_all_reduce`` uses it, but the bench makes sure: DeepSpeed's backend gets no shm op,
    so all its collectives are torch.distributed (gloo, bound to the veth addresses)."""
    import importlib

    # (``import deepspeed.comm.torch as m`` binds the torch package: deepspeed.comm has a ``torch`` attribute)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def _ds_config(v, cfg, L):
    params = {"lr": LR, "betas": list(BETAS), "weight_decay": 0.0, "comm": "1bit"}
    if v == ZERO3_VOTES:
        params.update(voters="node", node_size=L)
    return {"train_micro_batch_size_per_gpu": cfg["batch_size"], "gradient_accumulation_steps": 1,
            "steps_per_print": 10 ** 9, "wall_clock_breakdown": False, "zero_optimization": {"stage": 3},
            "optimizer": {"type": "LionCub", "params": params}}


def build_sharded(v, rank, n, L, cfg, new_model):
    """(model as ``timed_rounds`` calls it, optimizer with ``step(n) -> (comm s, bytes)``) of a
    sharded variant, on a fresh model copy. Collective: every rank, the same order."""
    model = new_model()
    if v in (ZERO3, ZERO3_VOTES):
        import logging
        import warnings

        # DeepSpeed 0.19 calls the *_tensor collectives, which torch >= 2.10 deprecates at every call
        warnings.filterwarnings("ignore", category=FutureWarning, message=r".*torch\.distributed\..* is deprecated")

        os.environ["LOCAL_RANK"] = str(rank % L)  # DeepSpeed reads it
        _no_ds_shm()
        import deepspeed

        import lioncub_ds.deepspeed  # noqa: F401 - registers LionCub with DeepSpeed
        deepspeed.utils.logger.setLevel(logging.WARNING)
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_ds_config(v, cfg, L))[0]
        if getattr(deepspeed.comm.comm.cdb, "shm_comm_op", None) is not None:
            raise RuntimeError("DeepSpeed's shared-memory all-reduce is on: it would bypass the veth")
        opt = engine.basic_optimizer
        return EngineModel(engine), VoteStep(engine.step, getattr(opt, "comm_stats", lambda: {}))
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    if v == FSDP_HSDP:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (n // L, L), mesh_dim_names=("replicate", "shard"))
        # reshard_after_forward=True as shard_and_vote's default (FSDP2's own default keeps the ROOT
        # unsharded between forward and backward): both re-gather the parameters for backward
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
        return model, ShardedLion([p for p in model.parameters() if p.requires_grad], LR, BETAS)
    from lioncub_ds.fsdp import shard_and_vote

    model, opt = shard_and_vote(model, shard_size=L, mp_policy=policy, reshard_after_forward=True, device_type="cpu",
                                lr=LR, betas=BETAS, comm="1bit")
    return model, VoteStep(opt.step, opt.comm_stats)


def _add_sharded(rank, n, cfg, st):
    """Build the sharded variants of ``cfg`` into ``st`` (those it cannot build: ``unavailable``)."""
    from benchmarks.models import build_model
    from lioncub_ds.config import LionCubConfigError

    L = cfg["ranks_per_node"]

    def new_model():
        return build_model(cfg["preset"], seed=0, n_layer=cfg["n_layer"], d_model=cfg["d_model"],
                           n_head=cfg["n_head"], seq_len=cfg["seq_len"])

    for v in cfg["variants"]:
        if v not in SHARDED:
            continue
        try:
            st["models"][v], st["opts"][v] = build_sharded(v, rank, n, L, cfg, new_model)
        except Exception as exc:  # noqa: BLE001 - only the refusals below, the rest is raised
            # the same on every rank (a missing package, a refused setting, a DeepSpeed whose ZeRO-3
            # the integration does not know: ZeRO3VotesError): no rank is left waiting
            if not (isinstance(exc, (ImportError, LionCubConfigError, NotImplementedError, ValueError))
                    or type(exc).__name__ == "ZeRO3VotesError"):
                raise
            st["unavailable"][v] = f"{type(exc).__name__}: {exc}"
            continue
        st["kws"][v] = None


def _rank_fn(rank, n, cfg):
    L = cfg["ranks_per_node"]
    node_group, cross_group = _groups(rank, n, L) if TWO_LEVEL in cfg["variants"] else (None, None)

    def make_opt(v, kw, params, cfg):
        if v == TWO_LEVEL:
            return TwoLevelLion(params, LR, BETAS, node_group, cross_group, rank % L, L, n // L)
        return _make_opt(v, kw, params, cfg)

    plain = dict(cfg, variants=[v for v in cfg["variants"] if v not in SHARDED])
    st = setup_rank(rank, n, plain, kw_for=lambda v: lioncub_kw(v, L), make_opt=make_opt, optional=OPTIONAL)
    _add_sharded(rank, n, cfg, st)
    ifname = cfg["ifname"]

    def probe():  # this namespace's counters: its loopback (inside the node) and its veth end
        return {"ns_lo_tx_bytes": net_counter("lo", "tx_bytes"), "veth_tx_bytes": net_counter(ifname, "tx_bytes"),
                "veth_rx_bytes": net_counter(ifname, "rx_bytes")}

    rows = timed_rounds(rank, n, cfg, st, probe if rank % L == 0 else None)
    return {"rows": rows, "params": sum(p.numel() for p in st["params"]), "unavailable": st["unavailable"]}


def inner(args) -> int:
    """Runs inside node ``--node``'s namespace: its L ranks of the N = 2L; writes their rows."""
    L = args.ranks_per_node
    cfg = rank_cfg(args, baseline_update="fused", ranks_per_node=L, ifname=args.ifname)
    env = {"GLOO_SOCKET_IFNAME": args.ifname, "LOCAL_WORLD_SIZE": str(L),
           "MASTER_ADDR": args.init.split("//")[1].rsplit(":", 1)[0], "DS_ACCELERATOR": "cpu"}
    res = run_ranks(_rank_fn, 2 * L, cfg, timeout=args.timeout, env=env, init=args.init,
                    ranks=range(args.node * L, (args.node + 1) * L))
    out = {"params": res[0]["params"], "ranks": [r["rows"] for r in res], "unavailable": res[0]["unavailable"],
           "cfg": cfg}
    with open(args.result, "w") as f:
        json.dump(out, f)
    return 0


# ----------------------------------------------------------------------------- records
def summarize(raws, bandwidth_gbit: float, ranks_per_node: int, warmup: int) -> list[dict]:
    """One record per variant from the two nodes' rows (node a's ranks, then node b's). Times as in
    ``bench netns`` (median over the measured rounds of the slowest rank); bytes per rank: the
    medians over rounds of the two namespaces' counters / N."""
    L, n = ranks_per_node, 2 * ranks_per_node
    raw = {"params": raws[0]["params"], "ranks": raws[0]["ranks"] + raws[1]["ranks"], "cfg": raws[0]["cfg"]}
    leaders = [r["ranks"][0] for r in raws]
    all_rows = raw["ranks"]
    recs = []
    for rec in (summarize_times(raw, bandwidth_gbit, n, warmup) if all_rows[0] else []):
        v = rec["variant"]
        idx = [i for i, r in enumerate(leaders[0]) if r["variant"] == v and r["round"] >= warmup]

        def per_rank(key, agg=sum, idx=idx):
            vals = [[ld[i].get(key) for ld in leaders] for i in idx]
            vals = [agg(x) / (n if agg is sum else 1) for x in vals if None not in x]
            return median(vals) if vals else None

        def formula(key, idx=idx):
            vals = [sum(rr[i].get("split", {}).get(key, 0) for rr in all_rows) / n for i in idx
                    if all(key in rr[i].get("split", {}) for rr in all_rows)]
            return int(median(vals)) if vals else None

        inter, intra = per_rank("veth_tx_bytes"), per_rank("ns_lo_tx_bytes")
        busiest = per_rank("veth_tx_bytes", max)  # the more loaded direction of the link
        floor = busiest * 8 / (bandwidth_gbit * 1e9) if busiest else None
        out = {"bench": NAME, "variant": v, "status": "ok", "bandwidth_gbit": bandwidth_gbit, "nodes": 2,
               "ranks_per_node": L, "world_size": n, "params": rec["params"],
               "step_time_s": rec["step_time_s"], "compute_time_s": rec["compute_time_s"],
               "comm_time_s": rec["comm_time_s"], "kernel_time_s": rec["kernel_time_s"],
               "comm_time_method": rec["comm_time_method"],
               "inter_node_bytes_per_rank": _int(inter),
               "inter_node_rx_bytes_per_rank": _int(per_rank("veth_rx_bytes")),
               "inter_node_bytes_busiest_direction": _int(busiest),
               "intra_node_bytes_per_rank": _int(intra),
               "bytes_method": "veth tx (inter) and lo tx (intra) counters of both namespaces, / N; "
                               "TCP/IP headers and the step's two barriers included",
               "formula_bytes_per_rank": rec["bytes_per_rank"],
               "formula_inter_node_bytes_per_rank": formula("inter_node_bytes"),
               "formula_intra_node_bytes_per_rank": formula("intra_node_bytes"),
               "floor_comm_time_s": floor, "comm_vs_floor": (rec["comm_time_s"] / floor
                                                             if floor and rec["comm_time_s"] is not None else None),
               "speedup_vs_ddp_lion_bf16": rec["speedup_vs_ddp_lion_bf16"], "speedup_vs_two_level_bf16": None,
               "step_vs_no_comm": rec["step_vs_no_comm"], "measured_steps": rec["measured_steps"],
               "step_time_min_s": rec["step_time_min_s"], "step_time_max_s": rec["step_time_max_s"],
               "tokens_per_rank": rec["tokens_per_rank"]}
        if v in SHARDED:
            _sharded_times(out, v)
        recs.append(out)
    by = {r["variant"]: r for r in recs}
    floor_rec = by.get(FLOOR_VARIANT)
    for v in SHARDED:
        r = by.get(v)
        if r is None:
            continue
        # the framework's collectives run inside forward and backward: estimated like DDP's
        r["compute_time_with_overlapped_comm_s"] = total = r["compute_time_s"]
        if floor_rec is not None:
            extra = max(0.0, total - floor_rec["compute_time_s"])
            r["compute_time_s"] = total - extra
            r["comm_time_s"] = (r["comm_time_s"] or 0.0) + extra
        else:
            r["comm_time_s"] = None
        r["comm_vs_floor"] = (r["comm_time_s"] / r["floor_comm_time_s"]
                              if r["comm_time_s"] is not None and r["floor_comm_time_s"] else None)
    for r in recs:
        if TWO_LEVEL in by:
            r["speedup_vs_two_level_bf16"] = by[TWO_LEVEL]["step_time_s"] / r["step_time_s"]
    unavailable = {}
    for raw_node in raws:
        unavailable.update(raw_node.get("unavailable") or {})
    order = list(raws[0]["cfg"]["variants"])
    for v, why in unavailable.items():
        by[v] = {"bench": NAME, "variant": v, "status": "unavailable", "reason": why[:300],
                 "bandwidth_gbit": bandwidth_gbit, "nodes": 2, "ranks_per_node": L, "world_size": n,
                 "params": raw["params"], "step_time_s": None, "inter_node_bytes_per_rank": None,
                 "intra_node_bytes_per_rank": None, "formula_bytes_per_rank": None}
    recs = [by[v] for v in order if v in by]
    for r in recs:
        r["topology"] = (f"2 network namespaces x {L} ranks on their own loopback (unshaped), joined by a veth "
                         f"pair with {QDISC.format(rate=f'{bandwidth_gbit:g}gbit')} on both ends; gloo bound to "
                         f"the veth addresses {ADDRS[0]} / {ADDRS[1]} (GLOO_SOCKET_IFNAME), rendezvous on "
                         f"{ADDRS[0]}")
    return recs


def _int(x):
    return int(x) if x is not None else None


def _sharded_times(out: dict, v: str) -> None:
    """A sharded variant's record: what its bytes and times mean (see the module doc)."""
    votes = v in (FSDP_VOTES, ZERO3_VOTES)
    # the formula covers LionCub's own collectives only (votes + flags), not the framework's
    out["lioncub_bytes_per_rank"] = out["formula_bytes_per_rank"] if votes else None
    out["formula_bytes_per_rank"] = None
    if not votes:
        out["formula_inter_node_bytes_per_rank"] = None
    out["comm_time_method"] = ("estimated: forward+backward minus no_comm's (the framework's all-gathers and "
                               "reduce-scatters" + (", HSDP's all-reduce across nodes" if v == FSDP_HSDP else "")
                               + " run inside them)" + (" plus the waits inside LionCub's votes" if votes else ""))
    out["sharding"] = {FSDP_HSDP: "FSDP2 HSDP: fully_shard on a (replicate, shard) = (2, L) mesh, reduce_dtype "
                                  "bf16, reshard_after_forward=True, fused Lion on the local shards",
                       FSDP_VOTES: "lioncub_ds.fsdp.shard_and_vote(shard_size=L, comm='1bit'), reduce_dtype bf16, "
                                   "reshard_after_forward=True",
                       ZERO3: "DeepSpeed ZeRO-3 over all N ranks, fp32, LionCub (global Lion on the partitions)",
                       ZERO3_VOTES: "DeepSpeed ZeRO-3 in each node (node_size=L), fp32, LionCub 1-bit votes "
                                    "across nodes"}[v]
    if v in (ZERO3, ZERO3_VOTES):
        out["ds_shm_allreduce"] = "disabled (every DeepSpeed collective goes through gloo and the veth)"


# ----------------------------------------------------------------------------- namespaces (the parent)
def _wait_nodes(children, timeout: float) -> None:
    """Wait for both nodes' children; the first failure (or the timeout) raises, and the caller's
    ``finally`` kills the other node (its ranks would wait for the dead ones until gloo's timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [c.poll() for c in children]
        for j, rc in enumerate(codes):
            if rc not in (None, 0):
                raise RuntimeError(f"bench {NAME}: the ranks of node {'ab'[j]} failed (exit code {rc})")
        if all(rc == 0 for rc in codes):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench {NAME}: no result after {timeout:.0f} s")
        time.sleep(0.2)


def run(bandwidths=(1.0, 10.0), ranks_per_node=2, steps=8, warmup=1, seq_len=32, batch_size=1,
        variants=DEFAULT_VARIANTS,
        timeout=1200, model_overrides=None, verbose=True):
    why = preflight(NAME, WHAT)
    if why:
        raise PermissionError(why)
    tag = f"{os.getpid()}-{secrets.token_hex(3)}"
    nss = [f"lioncub-nodes-{tag}-{c}" for c in "ab"]
    created, children, records = [], [], []
    with GracefulExit(), tempfile.TemporaryDirectory(prefix="lioncub_netns_nodes_") as tmp:
        try:
            for ns in nss:
                _sh(["ip", "netns", "add", ns])
                created.append(ns)
                _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            _sh(["ip", "link", "add", IFNAMES[0], "netns", nss[0], "type", "veth", "peer", "name", IFNAMES[1],
                 "netns", nss[1]])
            for ns, ifname, addr in zip(nss, IFNAMES, ADDRS):
                _sh(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", ifname])
                _sh(["ip", "-n", ns, "link", "set", ifname, "up"])
            for i, bw in enumerate(bandwidths):
                qdisc = QDISC.format(rate=f"{bw:g}gbit")
                for ns, ifname in zip(nss, IFNAMES):
                    _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", ifname, "root", *qdisc.split()])
                    if verbose:
                        shown = _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", ifname]).stdout.strip()
                        print(f"[bench {NAME}] {ns}: {ifname} {shown}", flush=True)
                init = f"tcp://{ADDRS[0]}:{29500 + i}"  # rank 0's store, on node a's veth address
                results = [os.path.join(tmp, f"raw_{bw:g}_{j}.json") for j in range(2)]
                before = [ns_counter(ns, ifname) for ns, ifname in zip(nss, IFNAMES)]
                t0 = time.perf_counter()
                for j, (ns, ifname) in enumerate(zip(nss, IFNAMES)):
                    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "benchmarks.netns_nodes", "--inner",
                           "--node", str(j), "--ifname", ifname, "--init", init, "--result", results[j],
                           "--ranks-per-node", str(ranks_per_node), "--steps", str(steps), "--warmup", str(warmup),
                           "--seq-len", str(seq_len), "--batch-size", str(batch_size), "--timeout", str(timeout),
                           "--variants", *variants]
                    for key, val in (model_overrides or {}).items():
                        cmd += [f"--{key.replace('_', '-')}", str(val)]
                    children.append(subprocess.Popen(cmd, env=child_env(), start_new_session=True))
                _wait_nodes(children, timeout + 60)
                children = []
                raws = []
                for path in results:
                    with open(path) as f:
                        raws.append(json.load(f))
                after = [ns_counter(ns, ifname) for ns, ifname in zip(nss, IFNAMES)]
                recs = summarize(raws, bw, ranks_per_node, warmup)
                load = os.getloadavg()[0]
                for r in recs:
                    r["qdisc"] = f"{qdisc} on each veth end (one bucket per direction)"
                    r["veth_tx_bytes_whole_run"] = (sum(after) - sum(before)) if None not in before + after else None
                    r["loadavg_1m_after"] = round(load, 2)
                records += recs
                if verbose:
                    print(f"[bench {NAME}] {bw:g} Gbit/s: {len(recs)} variants in {time.perf_counter() - t0:.1f} s",
                          flush=True)
        finally:
            for child in children:
                _kill_group(child)
            for ns in created:
                delete_namespace(ns, NAME, verbose)
    return records


TABLE = [("bandwidth_gbit", "Gbit/s"), ("variant", "variant"), ("status", "status"), ("step_time_s", "step s", ".3f"),
         ("speedup_vs_ddp_lion_bf16", "x vs DDP bf16", ".2f"), ("speedup_vs_two_level_bf16", "x vs 2-level", ".2f"),
         ("step_vs_no_comm", "/no_comm", ".2f"), ("comm_time_s", "exposed comm s", ".3f"),
         ("inter_node_bytes_per_rank", "veth B/rank"), ("intra_node_bytes_per_rank", "lo B/rank"),
         ("formula_bytes_per_rank", "formula B/rank"), ("formula_inter_node_bytes_per_rank", "formula inter B/rank")]


def check_goal(records) -> list[str]:
    """Issue 24's and issue 44's benchmark goals and the topology's sanity checks, from this run's records."""
    out = []
    for bw in sorted({r["bandwidth_gbit"] for r in records}):
        rs = {r["variant"]: r for r in records if r["bandwidth_gbit"] == bw}
        pre = f"{bw:g} Gbit/s between nodes:"
        ok = {v: r for v, r in rs.items() if r["status"] == "ok"}
        ddp, two, flat, node = (ok.get(v) for v in (DDP_BASELINE, TWO_LEVEL, "lioncub_1bit", NODE_VOTERS))
        if ddp and two and two["inter_node_bytes_per_rank"]:
            q = ddp["inter_node_bytes_per_rank"] / two["inter_node_bytes_per_rank"]
            out.append(f"{pre} two_level_bf16 puts {q:.2f}x fewer bytes on the veth than DDP bf16")
        for r in ok.values():
            if (r["inter_node_bytes_per_rank"] or 0) > 100_000 and r["inter_node_rx_bytes_per_rank"] is not None:
                q = r["inter_node_rx_bytes_per_rank"] / r["inter_node_bytes_per_rank"]
                if abs(q - 1) > 0.02:
                    out.append(f"{pre} WARNING {r['variant']}: veth rx/tx = {q:.3f} (expected 1)")
        for votes, plain in SHARDED_GOALS:  # issue 44: the votes' inter-node bytes vs the framework's own
            if votes not in rs or plain not in rs:
                continue
            a, b = ok.get(votes), ok.get(plain)
            if a is None or b is None:
                why = "; ".join(f"{x} unavailable ({rs[x].get('reason', '')[:80]})" for x in (votes, plain)
                                if rs[x]["status"] != "ok")
                out.append(f"{pre} {votes} vs {plain} not measured: {why}")
                continue
            out.append(sharded_goal(pre, a, b))
        if NODE_VOTERS in rs and node is None:
            out.append(f"{pre} {NODE_VOTERS} unavailable ({rs[NODE_VOTERS].get('reason', '')[:80]}...): "
                       "the node-voter goals are not measured")
            continue
        over = ok.get(NODE_OVERLAP)
        if node and over and over["step_time_s"]:
            out.append(f"{pre} node voters with overlap=True: {node['step_time_s'] / over['step_time_s']:.2f}x "
                       f"the speed of node voters without (exposed comm {over['comm_time_s'] or 0:.3f} s vs "
                       f"{node['comm_time_s'] or 0:.3f} s)")
        if not node or not node["inter_node_bytes_per_rank"]:
            continue
        # (what, ratio, goal, strict): issue 24's goals for node voters (the step times at 1 Gbit/s)
        L, slow = node["ranks_per_node"], bw == 1
        goals = [(f"fewer bytes on the veth than flat LionCub (L = {L})", flat, "inter_node_bytes_per_rank", L, False),
                 ("fewer bytes on the veth than two_level_bf16", two, "inter_node_bytes_per_rank", 16, False),
                 ("faster per step than DDP bf16", ddp, "step_time_s", 5 if slow else None, False),
                 ("faster per step than flat LionCub", flat, "step_time_s", 1 if slow else None, True)]
        for what, ref, key, goal, strict in goals:
            if ref is None:
                continue
            q = ref[key] / node[key]
            met = None if goal is None else (q > goal if strict else q >= goal)
            out.append(f"{pre} node voters {q:.2f}x {what}"
                       + (f" (goal {'>' if strict else '>='} {goal}x: {'OK' if met else 'MISSED'})" if goal else ""))
    return out


def sharded_goal(pre: str, votes: dict, plain: dict) -> str:
    """Issue 44's goal for a sharded variant with votes against the same framework without: its
    inter-node (veth) bytes per rank <= 1/SHARDED_GOAL of the other's."""
    a, b = votes["inter_node_bytes_per_rank"], plain["inter_node_bytes_per_rank"]
    if not a or b is None:
        return f"{pre} {votes['variant']} vs {plain['variant']}: no veth bytes measured"
    q = b / a
    met = a * SHARDED_GOAL <= b
    return (f"{pre} {votes['variant']} puts {q:.1f}x fewer bytes per rank on the veth than {plain['variant']} "
            f"({a:,} vs {b:,}; goal <= 1/{SHARDED_GOAL}: {'OK' if met else 'MISSED'}); step "
            f"{plain['step_time_s'] / votes['step_time_s']:.2f}x as fast")


def plot(records, out):
    plt = pyplot()
    bws = sorted({r["bandwidth_gbit"] for r in records})
    fig, axes = plt.subplots(1, len(bws) + 1, figsize=(5.2 * (len(bws) + 1), 4.8), dpi=110, squeeze=False)
    first = [r for r in records if r["bandwidth_gbit"] == bws[0]]
    for ax, bw in zip(axes[0], bws):
        rs = [r for r in records if r["bandwidth_gbit"] == bw]
        xs = range(len(rs))
        comp = [r.get("compute_time_s") or 0.0 for r in rs]
        rest = [max(0.0, (r["step_time_s"] or 0.0) - c) for r, c in zip(rs, comp)]
        ax.bar(xs, comp, label="forward + backward", color="#9bbbd9")
        ax.bar(xs, rest, bottom=comp, label="communication + update", color="#e07b5a")
        for x, r in zip(xs, rs):
            if r["status"] != "ok":
                ax.text(x, 0, r["status"], rotation=90, ha="center", va="bottom", fontsize=8, color="grey")
            elif r.get("speedup_vs_ddp_lion_bf16"):
                ax.text(x, r["step_time_s"], f"{r['speedup_vs_ddp_lion_bf16']:.1f}x", ha="center", va="bottom",
                        fontsize=8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["variant"].replace("_", "\n") for r in rs], fontsize=7)
        ax.set_ylabel("median step time (s)")
        ax.set_title(f"{bw:g} Gbit/s veth between 2 nodes x {rs[0]['ranks_per_node']} ranks\n"
                     f"({rs[0]['params'] / 1e6:.1f}M-param GPT; labels: x vs DDP bf16)", fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    ax = axes[0][-1]
    xs = list(range(len(first)))
    ok = [x for x, r in zip(xs, first) if r["status"] == "ok"]
    ax.bar([x - 0.2 for x in ok], [first[x]["inter_node_bytes_per_rank"] for x in ok], width=0.4,
           label="inter-node (veth counters)", color="#e07b5a")
    ax.bar([x + 0.2 for x in ok], [first[x]["intra_node_bytes_per_rank"] for x in ok], width=0.4,
           label="intra-node (lo counters)", color="#9bbbd9")
    ax.set_yscale("log")
    ax.set_ylim(bottom=100)
    for x, r in zip(xs, first):
        if r["status"] != "ok":
            ax.text(x, 100, r["status"], rotation=90, ha="center", va="bottom", fontsize=8, color="grey")
    ax.set_xticks(xs)
    ax.set_xticklabels([r["variant"].replace("_", "\n") for r in first], fontsize=7)
    ax.set_ylabel("bytes per rank per step")
    ax.set_title(f"measured bytes per rank per step ({bws[0]:g} Gbit/s run)", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3, which="both")
    fig.tight_layout()
    path = os.path.join(out, f"{NAME}.png")
    fig.savefig(path)
    plt.close(fig)
    return [path]


def build_parser():
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {NAME}", description=__doc__.split("\n\n")[0])
    p.add_argument("--bandwidths", type=float, nargs="+", default=[1.0, 10.0],
                   help="tbf rate of the veth between the nodes, Gbit/s (each direction)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="L: ranks in each of the 2 namespaces")
    add_run_args(p)
    p.set_defaults(steps=8)  # ~2.5 min for 6 variants x 2 bandwidths on 2 cores; 4 rounds were noisy
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS,
                   help=f"default: {' '.join(DEFAULT_VARIANTS)}; parameter sharding (issue 44): {' '.join(SHARDED)}")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per bandwidth before giving up")
    for hidden in ("--node", "--ifname", "--init", "--result"):
        p.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    add_output_args(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.inner:
        args.node = int(args.node)
        return inner(args)
    t0 = time.perf_counter()
    overrides = model_overrides(args)
    records, rc = run_guarded(NAME, preflight(NAME, WHAT), lambda: run(
        tuple(args.bandwidths), args.ranks_per_node, args.steps, args.warmup, args.seq_len, args.batch_size,
        tuple(args.variants), args.timeout, overrides))
    if rc:
        return rc
    return report(NAME, args, records, TABLE, f"2 nodes (network namespaces) x {args.ranks_per_node} gloo ranks, "
                  "the veth between them shaped per direction, unshaped loopback inside; bytes per rank per step",
                  check_goal, plot, t0)


if __name__ == "__main__":
    sys.exit(main())
