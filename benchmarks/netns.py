"""``python -m benchmarks netns``: step time on a slow network (docs/results.md), as root.

The benchmark creates its own network namespace (unique name), brings its loopback up,
puts a token bucket on it (``tc qdisc add dev lo root tbf rate 1gbit burst 512kb latency
100ms``, then 10gbit), runs 4 gloo ranks inside it on 127.0.0.1 and deletes the namespace
at the end, also on an error or Ctrl-C.

Every variant trains the same GPT-style model on the bundled text, interleaved round by
round (each round runs one step of every variant, in a rotating order) so machine noise
hits all of them alike; the per-step time is the median over the measured rounds of the
slowest rank's step (forward + backward + communication + update):

* ``no_comm``: each rank steps Lion (the same fused kernels) on its own gradient, no
  communication: the compute floor;
* ``ddp_lion_bf16``: what users run today: torch DDP (25 MB buckets, the all-reduce overlapped
  with backward) with ``bf16_compress_hook``, then the same fused Lion update;
* Lion + fp32 all-reduce, Lion + bf16 all-reduce: gradients summed by a manual bucketed
  ``all_reduce`` after backward (25 MB buckets, DDP's default), then the Lion update with the same
  fused kernels LionCub uses (``--baseline-update reference``: the pure-torch lioncub_ds.Lion);
* Distributed Lion, all-gathered votes: ``LionCub(comm="allgather")``;
* Lion Cub ``1bit``, ``pbit``, ``int8`` (l1);
* Lion Cub ``1bit`` with ``overlap=True`` (``lioncub_1bit_overlap``): local steps and vote
  launches from gradient-ready hooks during backward, like DDP. Its hooks sit on a second copy
  of the model (same seed), so they never fire in the other variants' backward. Its exposed
  communication is the wait after backward for the votes still in flight (the barrier that
  ends backward; it also absorbs the ranks' skew) plus the waits inside ``step()``;
* ``lioncub_1bit_db`` / ``lioncub_1bit_overlap_db``: the same with ``momentum_double_buffer=True``
  (the local pass also writes the next momentum: one pass over g and m per step, +4 B/param).
* A ``_cb<MB>`` suffix on any LionCub variant sets ``comm_bucket_mb``.

The link: ONE token bucket on the namespace's loopback carries every rank's traffic, so
``--bandwidths 1`` means 1 Gbit/s in total, 1/N Gbit/s per rank when all ranks send at once
(the table gives both). Step split per variant (medians over rounds of the slowest rank):
forward+backward, exposed communication (the time inside the collectives after a barrier that
absorbs the forward/backward skew; for ``ddp_lion_bf16`` its forward+backward minus
``no_comm``'s), kernels (the rest of the optimizer step). The communication floor is the wire
bytes over the token bucket's rate: floor = N · bytes_per_rank · 8 / rate. Bytes are reported
twice: the telemetry's ring formula and the namespace's ``lo`` tx counter read before and after
each step (all ranks; TCP/IP headers and two barriers included).

``--count-zeros`` (no root, no timing): counts the exact zeros of every parameter's gradient
and local c per step and rank on the same model and data (see :func:`count_zeros`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

from .common import GracefulExit, add_output_args, finish, median, print_table, run_ranks

NAME = "netns"
VARIANTS = ("no_comm", "ddp_lion_bf16", "lion_fp32_allreduce", "lion_bf16_allreduce", "dlion_allgather",
            "lioncub_1bit", "lioncub_pbit", "lioncub_int8", "lioncub_1bit_overlap", "lioncub_1bit_db",
            "lioncub_1bit_overlap_db")
LIONCUB_KW = {"dlion_allgather": dict(comm="allgather"), "lioncub_1bit": dict(comm="1bit"),
              "lioncub_1bit_overlap": dict(comm="1bit", overlap=True),
              # momentum_double_buffer: +4 B/param, one pass over g and m per step instead of two
              "lioncub_1bit_db": dict(comm="1bit", momentum_double_buffer=True),
              "lioncub_1bit_overlap_db": dict(comm="1bit", overlap=True, momentum_double_buffer=True),
              "lioncub_pbit": dict(comm="pbit"), "lioncub_int8": dict(comm="int8", quant="l1")}
_CB = re.compile(r"^(?P<base>.+)_cb(?P<mb>[0-9]+(?:\.[0-9]+)?)$")


def lioncub_kw(variant: str) -> dict | None:
    """LionCub's settings for a variant, or None when the variant is not a LionCub. A suffix
    ``_cb<MB>`` sets ``comm_bucket_mb`` (e.g. ``lioncub_1bit_cb16``: the sweep behind its default)."""
    m = _CB.match(variant)
    if m and m.group("base") in LIONCUB_KW:
        return dict(LIONCUB_KW[m.group("base")], comm_bucket_mb=float(m.group("mb")))
    return LIONCUB_KW.get(variant)


def variant_name(value: str) -> str:
    """argparse type: a known variant, or a LionCub variant with a ``_cb<MB>`` suffix."""
    if value in VARIANTS or lioncub_kw(value) is not None:
        return value
    raise argparse.ArgumentTypeError(f"unknown variant {value!r}; allowed: {', '.join(VARIANTS)}, or a LionCub "
                                     f"variant with _cb<MB> (comm_bucket_mb), e.g. lioncub_1bit_cb16")


BASELINE = "lion_bf16_allreduce"
DDP_BASELINE = "ddp_lion_bf16"
FLOOR_VARIANT = "no_comm"
BUCKET_NUMEL = 25 * 2**20 // 4

# GPT-style, >= 20M parameters, cheap compute: 2 wide pre-LN blocks (d=1024, 16 heads), tied
# byte-level embedding; ~25.5M parameters. Few tokens per rank per step keep the forward and
# backward small next to the gradient traffic.
MODEL = dict(preset="bench20m", n_layer=2, d_model=1024, n_head=16)


# ----------------------------------------------------------------------------- ranks (inside the namespace)
def _baseline_buckets(params):
    """DDP-style 25 MB buckets: (params, 8-aligned offsets, padded size) in parameter order."""
    buckets, cur, size = [], [], 0
    for p in params + [None]:
        if p is not None and (size + p.numel() <= BUCKET_NUMEL or not cur):
            cur.append((p, size))
            size += (p.numel() + 7) // 8 * 8
            continue
        buckets.append(([q for q, _ in cur], [o for _, o in cur], size))
        cur, size = ([(p, 0)], (p.numel() + 7) // 8 * 8) if p is not None else ([], 0)
    return buckets


class FusedLion:
    """Lion with the same fused kernels LionCub uses, on given gradient tensors: per DDP-style
    bucket one ``local_step`` pass (sign(c) and the momentum update) and a 1-voter ``vote_apply``
    (θ·(1-ηλ) - η·sign(c); sign(0) = 0 through the nonzero plane). No communication."""

    def __init__(self, params, lr, betas):
        from lioncub_ds import kernels

        self.params, self.lr, self.betas = params, lr, betas
        self.buckets = _baseline_buckets(params)
        self.mom = {id(p): torch.zeros_like(p) for p in params}
        self.be = kernels.backend_for("cpu")
        self.step_count = 0

    def apply_bucket(self, ps, offs, total, grads, moms=None):
        """One fused Lion update of ``ps`` (at ``offs`` in a ``total``-element bucket) on ``grads``;
        ``moms``: their momenta (default: this optimizer's, one per parameter)."""
        moms = [self.mom[id(p)] for p in ps] if moms is None else moms
        sign, nz, _, nzero = self.be.local_step(grads, moms, offs, total, self.betas[0], self.betas[1], True)
        self.be.vote_apply(sign.view(1, -1), nz.view(1, -1) if nzero else None, ps, offs, self.lr, 0.0,
                           self.step_count, "zero", "majority", 1, 0, False)

    def step(self, n=1):
        """Steps on each parameter's own ``.grad``. Returns (0.0 s of communication, 0 bytes)."""
        self.step_count += 1
        for ps, offs, total in self.buckets:
            self.apply_bucket(ps, offs, total, [p.grad for p in ps])
        return 0.0, 0


class AllReduceLion(FusedLion):
    """Lion on all-reduced gradients: per bucket, the gradients are copied (cast) into one flat
    ``dtype`` buffer, SUM-all-reduced after backward (not overlapped), and the update runs on that
    buffer.

    ``update="fused"``: the fused kernels of :class:`FusedLion`; the 1/N of the average is folded
    away (sign(c) does not change when g and m carry the same factor).
    ``update="reference"``: 1/N applied, gradients copied back, then :class:`lioncub_ds.Lion`
    (the pure-torch reference, unfused foreach ops).
    """

    def __init__(self, params, dtype, update, lr, betas):
        from lioncub_ds import Lion

        super().__init__(params, lr, betas)
        self.dtype, self.update = dtype, update
        self.ref = Lion(params, lr=lr, betas=betas) if update == "reference" else None

    def step(self, n=1):
        """Returns (seconds inside all_reduce, bytes this rank sent)."""
        import torch.distributed as dist

        from lioncub_ds.telemetry import ring_bytes

        self.step_count += 1
        comm_s, sent = 0.0, 0
        for ps, offs, total in self.buckets:
            flat = torch.zeros(total, dtype=self.dtype)
            for p, o in zip(ps, offs):
                flat[o:o + p.numel()].copy_(p.grad.reshape(-1))
            t = time.perf_counter()
            dist.all_reduce(flat)
            comm_s += time.perf_counter() - t
            sent += ring_bytes("all_reduce", total * flat.element_size(), n)
            grads = [flat[o:o + p.numel()].view_as(p) for p, o in zip(ps, offs)]
            if self.update == "fused":
                self.apply_bucket(ps, offs, total, grads)
            else:
                for p, g in zip(ps, grads):
                    p.grad.copy_(g).div_(n)
        if self.ref is not None:
            self.ref.step()
        return comm_s, sent


def net_counter(dev: str = "lo", what: str = "tx_bytes") -> int | None:
    """A byte counter of a device of this process's network namespace (all its processes' traffic,
    TCP/IP headers included): ``ip netns exec`` mounts a sysfs of the namespace."""
    try:
        with open(f"/sys/class/net/{dev}/statistics/{what}") as f:
            return int(f.read())
    except OSError:
        return None


def _lo_tx_bytes() -> int | None:
    """Bytes sent on this namespace's loopback so far: in this benchmark, the shaped link."""
    return net_counter("lo", "tx_bytes")


def _bf16_hook(state, bucket):
    """torch's ``bf16_compress_hook`` itself (cast the bucket to bf16, divide by N, async SUM
    all-reduce, cast back). DDP refuses that function by name unless CUDA/NCCL is present; gloo
    sums bf16 fine, so it is registered through this wrapper."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def _make_opt(v, kw, params, cfg):
    """The optimizer of a netns variant (``kw``: its LionCub settings, None for the baselines)."""
    from lioncub_ds import LionCub

    if kw is not None:
        return LionCub(params, lr=1e-4, betas=(0.95, 0.98), **kw)
    if v in (FLOOR_VARIANT, DDP_BASELINE):
        return FusedLion(params, 1e-4, (0.95, 0.98))
    dtype = torch.float32 if "fp32" in v else torch.bfloat16
    return AllReduceLion(params, dtype, cfg["baseline_update"], 1e-4, (0.95, 0.98))


def setup_rank(rank, n, cfg, kw_for=None, make_opt=_make_opt, optional=()):
    """One rank's model, data and one optimizer per variant of ``cfg["variants"]`` (all ranks
    construct them in the same order). ``kw_for(v)``: a variant's LionCub settings or None
    (default :func:`lioncub_kw`); ``make_opt(v, kw, params, cfg)`` builds the optimizer. A variant
    in ``optional`` whose construction raises :class:`LionCubConfigError` (a setting this LionCub
    does not know) is left out and reported in ``state["unavailable"]`` (variant -> message)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lioncub_ds.config import LionCubConfigError
    from benchmarks.data import load_dataset
    from benchmarks.models import build_model
    from lioncub_ds.telemetry import ring_bytes

    kw_for = kw_for or lioncub_kw

    def new_model():
        return build_model(cfg["preset"], seed=0, n_layer=cfg["n_layer"], d_model=cfg["d_model"],
                           n_head=cfg["n_head"], seq_len=cfg["seq_len"])

    model = new_model()
    params = [p for p in model.parameters() if p.requires_grad]
    models, kws, opts, unavailable = {}, {}, {}, {}
    for v in cfg["variants"]:
        kw = kw_for(v)  # once, not inside the timed loop
        models[v] = model
        if kw is not None and kw.get("overlap"):
            # overlap hooks on a copy of their own: they must not fire in other variants' backward
            models[v] = new_model()
        own = [p for p in models[v].parameters() if p.requires_grad]
        try:
            opts[v] = make_opt(v, kw, own, cfg)
        except LionCubConfigError as exc:
            if v not in optional:
                raise
            unavailable[v] = f"{type(exc).__name__}: {exc}"
            del models[v]
            continue
        kws[v] = kw
    st = {"model": model, "params": params, "models": models, "kws": kws, "opts": opts, "ddp": None,
          "ddp_bytes": None, "ds": load_dataset(), "unavailable": unavailable}
    if DDP_BASELINE in opts:
        # What users run today: torch DDP (default 25 MB buckets, all-reduce overlapped with backward)
        # with bf16 gradient compression. It wraps the SAME module: its reducer hooks only fire for a
        # backward that follows a forward through the DDP wrapper, so the other variants are unaffected.
        st["ddp"] = DistributedDataParallel(model)
        st["ddp"].register_comm_hook(dist.group.WORLD, _bf16_hook)
        st["ddp_bytes"] = ring_bytes("all_reduce", 2 * sum(p.numel() for p in params), n)
    return st


def _split_stats(last: dict) -> dict:
    """The intra-/inter-node byte split of a step's telemetry, where the optimizer reports one
    (numeric keys naming ``intra_node`` / ``inter_node``); {} otherwise."""
    return {k: v for k, v in last.items() if ("intra_node" in k or "inter_node" in k) and isinstance(v, (int, float))}


def timed_rounds(rank, n, cfg, st, probe=None) -> list[dict]:
    """The interleaved rounds: each round runs one step of every variant of ``st`` in a rotating
    order. ``probe()`` (this rank's counters, a dict of ints) is read after the barrier that opens
    a step and after the one that closes it; a row carries each counter's difference."""
    import torch.distributed as dist

    models, kws, opts, ddp, ds = st["models"], st["kws"], st["opts"], st["ddp"], st["ds"]
    rows = []
    variants = [v for v in cfg["variants"] if v in opts]
    for r in range(cfg["warmup"] + cfg["steps"]):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:  # rotate the order each round
            x, y = ds.get_batch("train", cfg["batch_size"], cfg["seq_len"], rank, n, step=r, seed=0)
            dist.barrier()
            c0 = probe() if probe is not None else {}
            t0 = time.perf_counter()
            models[v].zero_grad(set_to_none=True)
            _, loss = (ddp if v == DDP_BASELINE else models[v])(x, y)
            loss.backward()  # ddp_lion_bf16: returns once every bucket's all-reduce has finished
            t1 = time.perf_counter()
            dist.barrier()  # compute skew ends here, not inside the first collective
            t2 = time.perf_counter()
            opt = opts[v]
            if kws[v] is not None:
                opt.step()
                last = opt.comm_stats()["last_step"]
                # exposed communication: the time step() was blocked on its collectives (their
                # lifetimes overlap each other and the kernels: summing those would overcount)
                sent, in_step_wait = last["bytes_sent"], last["wait_time_s"]
                comm_s = in_step_wait
                if kws[v].get("overlap"):  # + what backward did not hide
                    comm_s += t2 - t1
                ncoll = last["collectives"]
                split = _split_stats(last)
            else:
                comm_s, sent = opt.step(n)
                in_step_wait = comm_s
                ncoll = None
                split = dict(getattr(opt, "last_split", None) or {})
                if v == DDP_BASELINE:
                    sent = st["ddp_bytes"]  # the ring formula for the reducer's bf16 buckets
            t3 = time.perf_counter()
            dist.barrier()  # every rank's traffic of this step has been sent
            c1 = probe() if probe is not None else {}
            row = {"round": r, "variant": v, "step_s": t3 - t0, "compute_s": t1 - t0, "comm_s": comm_s,
                   "update_s": t3 - t2, "kernel_s": t3 - t2 - in_step_wait, "bytes": sent, "collectives": ncoll,
                   "loss": float(loss.detach())}
            row.update({key: (c1[key] - val) if val is not None and c1.get(key) is not None else None
                        for key, val in c0.items()})
            if split:
                row["split"] = split
            rows.append(row)
    return rows


def _rank_fn(rank, n, cfg):
    st = setup_rank(rank, n, cfg)
    rows = timed_rounds(rank, n, cfg, st, probe=(lambda: {"lo_tx_bytes": _lo_tx_bytes()}) if rank == 0 else None)
    return {"rows": rows, "params": sum(p.numel() for p in st["params"])}


def count_zeros(world_size=4, steps=20, seq_len=32, batch_size=1, model_overrides=None, lr=1e-4,
                betas=(0.95, 0.98)) -> list[dict]:
    """Exact zeros in the bench model's gradients (``--count-zeros``; one process, no network).

    Simulates Distributed Lion on the bench's model and data in one process: for each of the N
    ranks' batches (the same ``get_batch`` calls as the timed run), the local gradient g_i, the
    local momentum m_i and c_i = β1·m_i + (1−β1)·g_i; then the majority vote
    Δ = sign(Σ sign(c_i)) (ties: 0) moves the one parameter copy. Records, per step, rank and
    parameter with any zero: how many coordinates of g_i and of c_i are exactly 0 (a rank
    abstains where c_i == 0, and a 1-bit bucket holding such a coordinate also sends its nonzero
    plane)."""
    from benchmarks.data import load_dataset
    from benchmarks.models import build_model

    cfg = dict(MODEL, **(model_overrides or {}))
    model = build_model(cfg["preset"], seed=0, n_layer=cfg["n_layer"], d_model=cfg["d_model"], n_head=cfg["n_head"],
                        seq_len=seq_len)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ds = load_dataset()
    moms = [[torch.zeros_like(p) for _, p in named] for _ in range(world_size)]
    b1, b2 = betas
    recs = []
    for step in range(steps):
        votes = [torch.zeros_like(p) for _, p in named]
        for rank in range(world_size):
            x, y = ds.get_batch("train", batch_size, seq_len, rank, world_size, step=step, seed=0)
            model.zero_grad(set_to_none=True)
            _, loss = model(x, y)
            loss.backward()
            for j, (name, p) in enumerate(named):
                g, m = p.grad, moms[rank][j]
                c = m * b1 + g * (1 - b1)
                gz, cz = int(torch.count_nonzero(g == 0)), int(torch.count_nonzero(c == 0))
                if gz or cz:
                    recs.append({"bench": "netns_zeros", "step": step, "rank": rank, "param": name,
                                 "numel": p.numel(), "grad_zeros": gz, "c_zeros": cz})
                votes[j] += torch.sign(c)
                m.mul_(b2).add_(g * (1 - b2))
        with torch.no_grad():
            for (_, p), v in zip(named, votes):
                p.add_(torch.sign(v), alpha=-lr)
    return recs


def summarize_zeros(recs: list[dict], steps: int, world_size: int) -> list[dict]:
    """Per parameter: min / median / max over (step, rank) of the exact zeros in c (0 where none)."""
    out = []
    for name in dict.fromkeys(r["param"] for r in recs):
        rs = [r for r in recs if r["param"] == name]
        cz = [r["c_zeros"] for r in rs] + [0] * (steps * world_size - len(rs))
        gz = [r["grad_zeros"] for r in rs] + [0] * (steps * world_size - len(rs))
        out.append({"bench": "netns_zeros_summary", "param": name, "numel": rs[0]["numel"], "steps": steps,
                    "world_size": world_size, "c_zeros_min": min(cz), "c_zeros_median": median(cz),
                    "c_zeros_max": max(cz), "grad_zeros_min": min(gz), "grad_zeros_max": max(gz),
                    "steps_ranks_with_c_zeros": sum(1 for v in cz if v)})
    return out


def inner(args) -> int:
    """Runs inside the namespace: N ranks, all variants; writes the raw per-step rows to --result."""
    cfg = rank_cfg(args, baseline_update=args.baseline_update)
    res = run_ranks(_rank_fn, args.world_size, cfg, timeout=args.timeout)
    out = {"params": res[0]["params"], "ranks": [r["rows"] for r in res], "cfg": cfg}
    with open(args.result, "w") as f:
        json.dump(out, f)
    return 0


def summarize(raw, bandwidth_gbit: float, world_size: int, warmup: int) -> list[dict]:
    """One record per variant. Every time is the median over the measured rounds of the slowest
    rank's value in that round:

    * ``step_time_s``: forward + backward + communication + update (t3 - t0);
    * ``compute_time_s``: forward + backward (for ``ddp_lion_bf16`` this includes the all-reduce
      that DDP overlaps with backward);
    * ``comm_time_s``: exposed communication: the time inside the collectives after backward
      (LionCub's ``comm_stats()``; the baselines' all_reduce calls). For ``ddp_lion_bf16``
      it is estimated as its forward+backward minus ``no_comm``'s (the part of the
      all-reduce that backward did not hide), when ``no_comm`` ran;
    * ``kernel_time_s``: the rest of the optimizer step: update minus collectives (local step,
      packing, vote counting, apply; for the all-reduce baselines the bucket copies and the
      fused Lion update);
    * ``link_bytes_per_rank``: bytes that crossed the shaped loopback during the step (the
      namespace's ``lo`` tx counter, all ranks, divided by N; TCP/IP headers and the two
      barriers that bracket the step included -- ``no_comm``'s row shows that overhead).
    """
    rows_by_rank = raw["ranks"]
    variants = list(dict.fromkeys(r["variant"] for r in rows_by_rank[0]))
    recs = []
    for v in variants:
        steps, comms, comms_min, comps, kerns, sent, link = [], [], [], [], [], [], []
        idx = [i for i, r in enumerate(rows_by_rank[0]) if r["variant"] == v and r["round"] >= warmup]
        for i in idx:
            steps.append(max(rr[i]["step_s"] for rr in rows_by_rank))
            # Every rank leaves a collective only when the last byte has arrived: the slowest rank's
            # time is the step's communication time (the minimum would hide the skew a real step pays).
            comms.append(max(rr[i]["comm_s"] for rr in rows_by_rank))
            comms_min.append(min(rr[i]["comm_s"] for rr in rows_by_rank))
            comps.append(max(rr[i]["compute_s"] for rr in rows_by_rank))
            kerns.append(max(rr[i].get("kernel_s", rr[i]["update_s"] - rr[i]["comm_s"]) for rr in rows_by_rank))
            sent.append(rows_by_rank[0][i]["bytes"])
            if rows_by_rank[0][i].get("lo_tx_bytes") is not None:
                link.append(rows_by_rank[0][i]["lo_tx_bytes"] / world_size)
        bpr = median(sent)
        floor = world_size * bpr * 8 / (bandwidth_gbit * 1e9)
        lbpr = median(link) if link else None
        recs.append({"bench": NAME, "variant": v, "bandwidth_gbit": bandwidth_gbit, "world_size": world_size,
                     "link_rate_total_gbit": bandwidth_gbit, "link_rate_per_rank_gbit": bandwidth_gbit / world_size,
                     "shared_token_bucket": True,
                     "params": raw["params"], "step_time_s": median(steps), "compute_time_s": median(comps),
                     "comm_time_s": median(comms), "kernel_time_s": median(kerns),
                     "comm_time_method": "slowest rank, inside the collectives after backward",
                     "comm_time_min_rank_s": median(comms_min), "comm_time_max_rank_s": median(comms),
                     "floor_comm_time_s": floor, "comm_vs_floor": median(comms) / floor if floor else None,
                     "bytes_per_rank": int(bpr), "bytes_method": "formula (telemetry ring model)",
                     "link_bytes_per_rank": int(lbpr) if lbpr is not None else None,
                     "link_vs_formula": (lbpr / bpr) if lbpr is not None and bpr else None,
                     "speedup_vs_bf16_allreduce": None, "speedup_vs_ddp_lion_bf16": None, "step_vs_no_comm": None,
                     "measured_steps": len(idx),
                     "step_time_min_s": min(steps) if steps else None, "step_time_max_s": max(steps) if steps else None,
                     "tokens_per_rank": raw["cfg"]["batch_size"] * raw["cfg"]["seq_len"]})
    by = {r["variant"]: r for r in recs}
    for v, r in by.items():
        if (lioncub_kw(v) or {}).get("overlap"):
            r["comm_time_method"] = ("overlapped with backward: the slowest rank's wait after backward for the "
                                     "votes still in flight (rank skew included) plus its waits inside step()")
    floor_rec = by.get(FLOOR_VARIANT)
    if DDP_BASELINE in by:
        d = by[DDP_BASELINE]
        d["comm_time_method"] = "estimated: its forward+backward (all-reduce overlapped) minus no_comm's"
        d["compute_time_with_overlapped_comm_s"] = total = d["compute_time_s"]
        if floor_rec is not None:
            d["comm_time_s"] = max(0.0, total - floor_rec["compute_time_s"])
            d["compute_time_s"] = total - d["comm_time_s"]
        else:
            d["comm_time_s"] = None
        d["comm_vs_floor"] = d["comm_time_s"] / d["floor_comm_time_s"] if d["comm_time_s"] is not None else None
        d["comm_time_min_rank_s"] = d["comm_time_max_rank_s"] = None
    for r in recs:
        if BASELINE in by:
            r["speedup_vs_bf16_allreduce"] = by[BASELINE]["step_time_s"] / r["step_time_s"]
        if DDP_BASELINE in by:
            r["speedup_vs_ddp_lion_bf16"] = by[DDP_BASELINE]["step_time_s"] / r["step_time_s"]
        if floor_rec is not None:
            r["step_vs_no_comm"] = r["step_time_s"] / floor_rec["step_time_s"]
    return recs


# ----------------------------------------------------------------------------- namespace (the parent)
def _sh(cmd, check=True, **kw):
    return subprocess.run(cmd, check=check, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def ns_counter(ns: str, dev: str = "lo", what: str = "tx_bytes") -> int | None:
    """A byte counter of a device of the namespace (default: its loopback's tx), read from outside
    (``ip netns exec`` sees its sysfs)."""
    res = _sh(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/{what}"], check=False)
    try:
        return int(res.stdout.strip())
    except ValueError:
        return None


def preflight(name: str = NAME, what: str = "a network namespace (ip netns add) and shapes its loopback") -> str | None:
    """None when the benchmark can run; otherwise why not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return (f"bench {name} needs root: it creates {what} with tc. Run it as root (e.g. sudo -E "
                f".venv/bin/python -m benchmarks {name}).")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return (f"bench {name} needs the '{tool}' command (package iproute2: apt-get update && "
                    "apt-get install -y iproute2).")
    return None


def child_env() -> dict:
    """The environment of a child started inside a namespace: one thread, this checkout first on
    PYTHONPATH, c10d's "hostname cannot be retrieved" warning (inside a netns) silenced."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def delete_namespace(ns: str, name: str = NAME, verbose: bool = True) -> None:
    """``ip netns del`` (its interfaces go with it: a veth pair dies with either end)."""
    res = _sh(["ip", "netns", "del", ns], check=False)
    if res.returncode != 0 and "No such file" not in res.stderr and verbose:
        print(f"[bench {name}] WARNING: could not delete namespace {ns}: {res.stderr.strip()}", file=sys.stderr)
    elif verbose:
        print(f"[bench {name}] deleted namespace {ns}", flush=True)


def _kill_group(proc):
    if proc is None or proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)  # the child's own session: it and the ranks it spawned
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run(bandwidths=(1.0, 10.0), world_size=4, steps=4, warmup=1, seq_len=32, batch_size=1, variants=VARIANTS,
        timeout=1200, model_overrides=None, verbose=True, baseline_update="fused"):
    why = preflight()
    if why:
        raise PermissionError(why)
    ns = f"lioncub-bench-{os.getpid()}-{secrets.token_hex(3)}"
    child = None
    records = []
    with GracefulExit(), tempfile.TemporaryDirectory(prefix="lioncub_netns_") as tmp:
        try:
            _sh(["ip", "netns", "add", ns])
            _sh(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])
            for bw in bandwidths:
                rate = f"{bw:g}gbit"
                _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate,
                     "burst", "512kb", "latency", "100ms"])
                qdisc = _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", "lo"]).stdout.strip()
                if verbose:
                    print(f"[bench netns] namespace {ns}: {qdisc}", flush=True)
                result = os.path.join(tmp, f"raw_{bw:g}.json")
                cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "benchmarks.netns", "--inner",
                       "--result", result, "--world-size", str(world_size), "--steps", str(steps),
                       "--warmup", str(warmup), "--seq-len", str(seq_len), "--batch-size", str(batch_size),
                       "--timeout", str(timeout), "--baseline-update", baseline_update, "--variants", *variants]
                for key, val in (model_overrides or {}).items():
                    cmd += [f"--{key.replace('_', '-')}", str(val)]
                t0 = time.perf_counter()
                lo_before = ns_counter(ns)
                child = subprocess.Popen(cmd, env=child_env(), start_new_session=True)
                rc = child.wait(timeout=timeout + 60)
                child = None
                if rc != 0:
                    raise RuntimeError(f"bench netns: the ranks inside namespace {ns} failed (exit code {rc})")
                with open(result) as f:
                    raw = json.load(f)
                recs = summarize(raw, bw, world_size, warmup)
                lo_after = ns_counter(ns)
                load = os.getloadavg()[0]
                for r in recs:
                    r["qdisc"] = f"tbf rate {rate} burst 512kb latency 100ms (one token bucket shared by all ranks)"
                    r["lo_tx_bytes_whole_run"] = (lo_after - lo_before) if None not in (lo_before, lo_after) else None
                    r["baseline_update"] = baseline_update
                    r["loadavg_1m_after"] = round(load, 2)  # other work on the machine skews CPU time
                records += recs
                if verbose:
                    print(f"[bench netns] {rate}: {len(recs)} variants in {time.perf_counter() - t0:.1f} s",
                          flush=True)
        finally:
            _kill_group(child)
            delete_namespace(ns, verbose=verbose)
    return records


TABLE = [("bandwidth_gbit", "Gbit/s total"), ("link_rate_per_rank_gbit", "/rank", ".3g"), ("variant", "variant"),
         ("step_time_s", "step s", ".3f"), ("speedup_vs_bf16_allreduce", "x vs bf16 AR", ".2f"),
         ("speedup_vs_ddp_lion_bf16", "x vs DDP bf16", ".2f"), ("step_vs_no_comm", "/no_comm", ".2f"),
         ("compute_time_s", "fwd+bwd s", ".3f"), ("comm_time_s", "exposed comm s", ".3f"),
         ("kernel_time_s", "kernels s", ".3f"), ("floor_comm_time_s", "floor s", ".3f"),
         ("comm_vs_floor", "comm/floor", ".2f"), ("bytes_per_rank", "formula B/rank"),
         ("link_bytes_per_rank", "lo B/rank"), ("link_vs_formula", "lo/formula", ".3f")]


def check_goal(records) -> list[str]:
    """The goals of issue 12 / the README, each computed from this run's records."""
    out = []
    for bw in sorted({r["bandwidth_gbit"] for r in records}):
        rs = {r["variant"]: r for r in records if r["bandwidth_gbit"] == bw}
        cubs = [r for v, r in rs.items() if v.startswith("lioncub")]
        if not cubs:
            continue
        best = min(cubs, key=lambda r: r["step_time_s"])
        pre = f"{bw:g} Gbit/s (shared by {best['world_size']} ranks, {best['link_rate_per_rank_gbit']:.3g}/rank):"
        if BASELINE in rs:
            b = rs[BASELINE]
            out.append(f"{pre} best Lion Cub ({best['variant']}) {best['speedup_vs_bf16_allreduce']:.2f}x faster per "
                       f"step than Lion + bf16 all-reduce")
            # If forward+backward cost nothing: (baseline comm + kernels) / (best comm + kernels)
            num = b["comm_time_s"] + b["kernel_time_s"]
            den = best["comm_time_s"] + best["kernel_time_s"]
            if den > 0:
                out.append(f"{pre} ceiling with free forward+backward: ({b['comm_time_s']:.3f} + "
                           f"{b['kernel_time_s']:.3f}) / ({best['comm_time_s']:.3f} + {best['kernel_time_s']:.3f}) "
                           f"= {num / den:.2f}x vs Lion + bf16 all-reduce")
        if DDP_BASELINE in rs:
            s = best["speedup_vs_ddp_lion_bf16"]
            goal = (f" (goal >= 5x: {'OK' if s >= 5 else 'MISSED'})" if bw == 1
                    else f" (goal > 1x: {'OK' if s > 1 else 'MISSED'})" if bw == 10 else "")
            out.append(f"{pre} best Lion Cub ({best['variant']}) {s:.2f}x faster per step than DDP + bf16 hook "
                       f"+ fused Lion{goal}")
        if FLOOR_VARIANT in rs:
            q = best["step_vs_no_comm"]
            out.append(f"{pre} best Lion Cub ({best['variant']}) step = {q:.2f}x no_comm's (the compute floor)"
                       + (f" (goal <= 1.2x: {'OK' if q <= 1.2 else 'MISSED'})" if bw == 10 else ""))
            if best["variant"] != "lioncub_1bit" and "lioncub_1bit" in rs:  # the defaults, for reference
                out.append(f"{pre} lioncub_1bit (default settings) step = {rs['lioncub_1bit']['step_vs_no_comm']:.2f}x "
                           "no_comm's")
        for r in cubs:
            if r["variant"].startswith("lioncub_1bit") and r["params"]:
                n = r["world_size"]
                nominal = 2 * (n - 1) / n * r["params"] / 8
                q = r["bytes_per_rank"] / nominal
                out.append(f"{pre} {r['variant']} bytes/rank = {q:.3f}x 2(N-1)/N*P/8 (goal <= 1.05x: "
                           f"{'OK' if q <= 1.05 else 'MISSED'})")
            out.append(f"{pre} {r['variant']} communication (slowest rank) = {r['comm_vs_floor']:.2f}x its "
                       f"wire-byte floor (goal <= 1.3x: {'OK' if r['comm_vs_floor'] <= 1.3 else 'MISSED'})"
                       + (f"; link bytes {r['link_vs_formula']:.3f}x the formula" if r["link_vs_formula"] else ""))
    return out


def plot(records, out):
    plt = __import__("benchmarks.common", fromlist=["pyplot"]).pyplot()
    bws = sorted({r["bandwidth_gbit"] for r in records})
    fig, axes = plt.subplots(1, len(bws), figsize=(7.5 * len(bws), 5.0), dpi=110, squeeze=False)
    for ax, bw in zip(axes[0], bws):
        rs = [r for r in records if r["bandwidth_gbit"] == bw]
        names = [r["variant"].replace("_", "\n") for r in rs]
        comp = [r["compute_time_s"] for r in rs]
        comm = [r["comm_time_s"] or 0.0 for r in rs]
        kern = [max(0.0, r["kernel_time_s"]) for r in rs]
        other = [max(0.0, r["step_time_s"] - a - b - c) for r, a, b, c in zip(rs, comp, comm, kern)]
        xs = range(len(rs))
        ax.bar(xs, comp, label="forward + backward", color="#9bbbd9")
        ax.bar(xs, comm, bottom=comp, label="exposed communication (slowest rank)", color="#e07b5a")
        b2 = [a + b for a, b in zip(comp, comm)]
        ax.bar(xs, kern, bottom=b2, label="kernels / update", color="#8fbf7f")
        ax.bar(xs, other, bottom=[a + b for a, b in zip(b2, kern)], label="rest (skew, barriers)", color="#cccccc")
        ax.scatter(xs, [c + r["floor_comm_time_s"] for c, r in zip(comp, rs)], marker="_", s=400, color="k",
                   label="fwd+bwd + wire floor", zorder=3)
        for x, r in zip(xs, rs):
            lab = r.get("speedup_vs_ddp_lion_bf16") or r.get("speedup_vs_bf16_allreduce")
            if lab:
                ax.text(x, r["step_time_s"], f"{lab:.1f}x", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, fontsize=7)
        ax.set_ylabel("median step time (s)")
        ax.set_ylim(0, 1.1 * max(max(r["step_time_s"], a + b + c) for r, a, b, c in zip(rs, comp, comm, kern)))
        ref = "DDP bf16" if any(r.get("speedup_vs_ddp_lion_bf16") for r in rs) else "Lion + bf16 AR"
        ax.set_title(f"{rs[0]['world_size']} ranks in a netns sharing ONE tbf of {bw:g} Gbit/s "
                     f"({bw / rs[0]['world_size']:.3g}/rank), {rs[0]['params'] / 1e6:.1f}M-param GPT; "
                     f"labels: x vs {ref}", fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out, "netns.png")
    fig.savefig(path)
    plt.close(fig)
    return [path]


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The settings both namespace benchmarks share: rounds, tokens per rank, model overrides."""
    p.add_argument("--steps", type=int, default=4, help="measured rounds (one step of every variant each)")
    p.add_argument("--warmup", type=int, default=1, help="rounds not measured")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--n-layer", type=int, default=None, help=f"model override (default {MODEL['n_layer']})")
    p.add_argument("--d-model", type=int, default=None, help=f"model override (default {MODEL['d_model']})")
    p.add_argument("--n-head", type=int, default=None, help=f"model override (default {MODEL['n_head']})")


def model_overrides(args) -> dict:
    return {k: getattr(args, k) for k in ("n_layer", "d_model", "n_head") if getattr(args, k) is not None}


def rank_cfg(args, **extra) -> dict:
    """What every rank needs (:data:`MODEL` with the overrides, tokens, rounds, variants)."""
    return dict(MODEL, seq_len=args.seq_len, batch_size=args.batch_size, warmup=args.warmup, steps=args.steps,
                variants=list(args.variants), **model_overrides(args), **extra)


def run_guarded(name: str, why: str | None, fn):
    """``(fn(), 0)``, or ``(None, exit code)`` with the reason printed: 2 when the preflight's
    ``why`` says it cannot run, 130 on Ctrl-C/SIGTERM, 1 when a command or the ranks failed (the
    namespaces are gone by then: ``run`` deletes them in its ``finally``)."""
    if why:
        print(f"[bench {name}] {why}", file=sys.stderr)
        return None, 2
    try:
        return fn(), 0
    except KeyboardInterrupt:
        print(f"[bench {name}] interrupted (namespaces deleted)", file=sys.stderr)
        return None, 130
    except (subprocess.CalledProcessError, RuntimeError) as exc:
        detail = getattr(exc, "stderr", None)
        print(f"[bench {name}] FAILED: {exc}" + (f": {detail.strip()}" if detail else ""), file=sys.stderr)
        return None, 1


def build_parser():
    p = argparse.ArgumentParser(prog="python -m benchmarks netns", description=__doc__.split("\n\n")[0])
    p.add_argument("--bandwidths", type=float, nargs="+", default=[1.0, 10.0], help="tbf rates in Gbit/s")
    p.add_argument("--world-size", type=int, default=4)
    add_run_args(p)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), type=variant_name,
                   help=f"default: all of {', '.join(VARIANTS)}; a LionCub variant + _cb<MB> sets comm_bucket_mb")
    p.add_argument("--baseline-update", default="fused", choices=("fused", "reference"),
                   help="the all-reduce baselines' Lion update: LionCub's fused kernels (fair: only the "
                        "communication differs) or the pure-torch reference lioncub_ds.Lion")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per bandwidth before giving up")
    p.add_argument("--count-zeros", action="store_true",
                   help="no timing, no root: count the exact zeros in every parameter's gradient and local c per "
                        "step and rank (one process simulating the N ranks; --steps steps), table + JSON")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    add_output_args(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.inner:
        return inner(args)
    if args.count_zeros:
        overrides = model_overrides(args)
        t0 = time.perf_counter()
        recs = count_zeros(args.world_size, args.steps, args.seq_len, args.batch_size, overrides)
        summ = summarize_zeros(recs, args.steps, args.world_size)
        print_table(summ, [("param", "parameter"), ("numel", "numel"), ("c_zeros_min", "c==0 min"),
                           ("c_zeros_median", "median"), ("c_zeros_max", "max"),
                           ("steps_ranks_with_c_zeros", "(step,rank)s with zeros"),
                           ("grad_zeros_min", "g==0 min"), ("grad_zeros_max", "g==0 max")],
                    title=f"[bench netns --count-zeros] exact zeros per step and rank, {args.world_size} simulated "
                          f"ranks, {args.steps} steps, {args.batch_size}x{args.seq_len} tokens/rank/step "
                          f"(parameters with no zero at all are not listed)")
        finish("netns_zeros", args, summ + recs)
        print(f"[bench netns] done in {time.perf_counter() - t0:.1f} s")
        return 0
    t0 = time.perf_counter()
    overrides = model_overrides(args)
    records, rc = run_guarded(NAME, preflight(), lambda: run(
        tuple(args.bandwidths), args.world_size, args.steps, args.warmup, args.seq_len, args.batch_size,
        tuple(args.variants), args.timeout, overrides, baseline_update=args.baseline_update))
    if rc:
        return rc
    return report(NAME, args, records, TABLE, f"{args.world_size} gloo ranks in a network namespace sharing ONE token "
                  f"bucket (rate = total; per rank = total/{args.world_size})", check_goal, plot, t0)


def report(name, args, records, table, topology: str, goals, plot_fn, t0: float) -> int:
    """The end of a namespace benchmark: the table, the goals, the JSON and the plots."""
    cfg = dict(MODEL, **model_overrides(args))
    print_table(records, table, title=f"[bench {name}] {topology}, GPT n_layer={cfg['n_layer']} "
                                      f"d_model={cfg['d_model']} ({records[0]['params']:,} params), "
                                      f"{args.batch_size}x{args.seq_len} tokens/rank/step, median of {args.steps} "
                                      "interleaved rounds")
    for m in goals(records):
        print(f"[bench {name}] " + m)
    finish(name, args, records, plot_fn)
    print(f"[bench {name}] done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
