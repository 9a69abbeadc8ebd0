"""Kernel benchmark: fused C++ CPU kernels vs unfused torch vs the machine's copy floor (docs/results.md).

    python -m benchmarks kernels [--json PATH] [--out DIR] [--numel N] [--threads T] [--only votes|lion|host]

For fp32 and bf16 (gradients, momenta and parameters of that dtype) it times, per 1M params:

* ``local_step``: the fused one-pass local step (c -> sign + nonzero planes, counts, and the
  momentum update, ``update_momentum=True``);
* ``local_step_2pass``: local step without the momentum update + ``momentum_update_list``
  (two passes over g and m: what a caller that defers the momentum update pays);
* ``vote_apply``: N=4 packed sign planes -> majority (hash ties) -> θ·(1-ηλ) - ηΔ, Δ not returned;
* ``vote_apply+delta``: the same, also returning Δ (the reference contract; 4 more bytes/param).

* ``lion_step`` (a second table): the single-process Lion step over 8 parameters of one dtype
  (params, grads and momenta), ``numel`` in all: the fused kernel (``backend.lion_step``, one pass:
  20 B/param in fp32, 10 in bf16) side by side with lioncub_ds.Lion's pure-torch foreach and
  single-tensor paths and, when installed, lion-pytorch (its per-tensor ``update_fn``, what
  ``lion_pytorch.Lion`` runs, and its foreach optimizer), all in one round-robin with the copy.
  ``lion_match``: the fused step gave the foreach path's bits (checked in the run).

* ``--only host`` (a third table, not part of ``all``): the host cost of one call of every op on the
  C++ backend (its Python layer and binding) over a bucket of 8 tensors of 64 elements (the kernels'
  own work negligible), the same kernels through the extension alone, and the kernel calls of one
  step of a 100-bucket vote; with two yardsticks timed in the same run (an empty Python call, a
  one-element ``x.add_(x)``) so that a loaded machine can be read (docs/kernels.md).

Baselines: ``unfused``: the same math written with plain torch ops (a few large tensor ops,
vectorized pack by a multiply trick) into buffers allocated once and reused (``out=`` and
in-place ops), timed in the same round-robin as the fused kernels and the copy; checked in the run to produce the fused
kernels' planes, counts and momenta (``baseline_*_match``); ``speedup`` = unfused / fused.
``unfused_alloc``: the same ops allocating fresh temporaries on every call; for 16M-element
temporaries that mostly measures the allocator's page faults (glibc returns large blocks to
the OS), kept for reference only. ``unfused_codec``: the
pure-torch reference ``lioncub_ds.kernels.reference`` (3 runs; ``--codec-numel`` params, default all). The floor is the bytes a
kernel must move per parameter divided by the copy bandwidth (read+write bytes per second of a
large ``torch.Tensor.copy_``), timed round-robin with the fused kernels in the same run so that a
busy machine slows both alike; ``fraction_of_floor`` = floor / fused time (1.0 = at the copy
bandwidth; ``best_*``: fastest run against fastest copy). Threads: ``torch.get_num_threads()``
(the C++ kernels use the same count); timings are medians after a warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

NAME = "kernels"
B1, B2 = 0.9, 0.99
LR, WD = 1e-4, 0.1
N_VOTERS = 4
_PACK_MAGIC = 0x0102040810204080  # (8 bytes of 0/1) * magic >> 56 = the LSB-first packed byte


def _median_time(fn, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _interleaved(fns: dict, rounds: int, warmup: int = 1) -> dict:
    """Times of every fn, run round-robin (so that a busy machine slows all of them alike)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    out = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            out[k].append(time.perf_counter() - t0)
    return out


# ----------------------------------------------------------------------------- plain-torch baselines
def _pack(bits: torch.Tensor) -> torch.Tensor:
    x = bits.view(torch.uint8).view(torch.int64)
    return ((x * _PACK_MAGIC) >> 56).to(torch.uint8)


def torch_local_step(g, m, b1, b2, update_momentum=True):
    gf, mf = g.float(), m.float()
    c = mf * b1 + gf * (1.0 - b1)
    fin = torch.isfinite(c)
    sign = _pack((c > 0) & fin)
    nz = _pack((c != 0) & fin)
    n_bad = c.numel() - int(torch.count_nonzero(fin))  # (count_nonzero: bool.sum() is ~15x slower)
    n_zero = int(torch.count_nonzero(c == 0))
    if update_momentum:
        if m.dtype == torch.float32:
            m.mul_(b2).add_(gf, alpha=1.0 - b2)
        else:
            m.copy_(mf.mul_(b2).add_(gf, alpha=1.0 - b2))
    return sign, nz, n_bad, n_zero


def torch_vote_apply(planes, p, lr, wd, step):
    n = planes.shape[0]
    shifts = torch.arange(8, dtype=torch.uint8)
    plus = ((planes.unsqueeze(-1) >> shifts) & 1).sum(0, dtype=torch.int16).reshape(-1)
    diff = 2 * plus - n
    delta = torch.sign(diff).float()
    delta = torch.where(diff == 0, 1.0 if step % 2 else -1.0, delta)  # (alternate ties: cheaper than hash)
    decay = 1.0 - lr * wd
    if decay != 1.0:
        p.mul_(decay)
    p.add_(delta, alpha=-lr)
    return delta


class TorchPrealloc:
    """The same plain-torch math as :func:`torch_local_step` / :func:`torch_vote_apply`, with every
    temporary allocated once and reused (``out=`` and in-place ops): the fair unfused baseline.
    Fresh temporaries of 16M elements are fresh ``mmap`` pages for glibc's allocator, so the
    allocating version mostly measures page faults (``unfused_alloc`` in the records)."""

    def __init__(self, numel: int, dtype, n_voters: int):
        f32 = torch.float32
        self.numel, self.dtype = numel, dtype
        self.gf = torch.empty(numel, dtype=f32) if dtype != f32 else None
        self.mf = torch.empty(numel, dtype=f32) if dtype != f32 else None
        self.c, self.t = torch.empty(numel, dtype=f32), torch.empty(numel, dtype=f32)
        self.fin, self.b = torch.empty(numel, dtype=torch.bool), torch.empty(numel, dtype=torch.bool)
        self.packed64 = torch.empty(numel // 8, dtype=torch.int64)
        self.sign = torch.empty(numel // 8, dtype=torch.uint8)
        self.nz = torch.empty(numel // 8, dtype=torch.uint8)
        self.shifts = torch.arange(8, dtype=torch.uint8)
        self.unpacked = torch.empty(numel // 8, 8, dtype=torch.uint8)
        self.count = torch.empty(numel, dtype=torch.int16)
        self.delta = torch.empty(numel, dtype=f32)
        self.n_voters = n_voters

    def _pack_into(self, bits, out):
        torch.mul(bits.view(torch.uint8).view(torch.int64), _PACK_MAGIC, out=self.packed64)
        self.packed64.bitwise_right_shift_(56)
        out.copy_(self.packed64)
        return out

    def local_step(self, g, m, b1, b2):
        if self.gf is not None:
            gf, mf = self.gf.copy_(g), self.mf.copy_(m)
        else:
            gf, mf = g, m
        c, t = self.c, self.t
        torch.mul(mf, b1, out=c)
        torch.mul(gf, 1.0 - b1, out=t)
        c.add_(t)
        torch.abs(c, out=t)
        torch.lt(t, float("inf"), out=self.fin)  # finite (NaN compares false)
        torch.gt(c, 0, out=self.b)
        self.b.logical_and_(self.fin)
        self._pack_into(self.b, self.sign)
        torch.ne(c, 0, out=self.b)
        self.b.logical_and_(self.fin)
        n_nonzero = int(torch.count_nonzero(self.b))  # (bool.sum() is ~15x slower than count_nonzero)
        self._pack_into(self.b, self.nz)
        n_bad = self.numel - int(torch.count_nonzero(self.fin))
        n_zero = self.numel - n_nonzero - n_bad
        # momentum: m <- b2*m + (1-b2)*g, in place
        torch.mul(gf, 1.0 - b2, out=t)
        mf.mul_(b2).add_(t)
        if self.mf is not None:
            m.copy_(mf)
        return self.sign, self.nz, n_bad, n_zero

    def vote_apply(self, planes, p, lr, wd, step):
        cnt = self.count
        cnt.zero_()
        for j in range(planes.shape[0]):
            torch.bitwise_right_shift(planes[j].unsqueeze(-1), self.shifts, out=self.unpacked)
            self.unpacked.bitwise_and_(1)
            cnt.add_(self.unpacked.view(-1))
        cnt.mul_(2).sub_(self.n_voters)  # 2·plus − N
        torch.eq(cnt, 0, out=self.b)
        cnt.sign_()
        self.delta.copy_(cnt)
        self.delta.masked_fill_(self.b, 1.0 if step % 2 else -1.0)  # (alternate ties: cheaper than hash)
        decay = 1.0 - lr * wd
        if decay != 1.0:
            p.mul_(decay)
        p.add_(self.delta, alpha=-lr)
        return self.delta


# ----------------------------------------------------------------------------- runner
def run(numel: int, repeat: int, codec_numel: int, dtypes) -> list[dict]:
    from lioncub_ds.kernels import reference
    from lioncub_ds.kernels.loader import load

    be = load("cpp")
    threads = torch.get_num_threads()
    numel = numel // 64 * 64
    codec_numel = min(numel, codec_numel) // 64 * 64
    per_m = numel / 1e6
    per_m_codec = codec_numel / 1e6
    copy_n = max(numel, 16 << 20)
    ca, cb = torch.randn(copy_n), torch.empty(copy_n)
    copy_fn = lambda: cb.copy_(ca)  # noqa: E731
    copy_bytes = 2 * 4 * copy_n
    try:
        load_avg = os.getloadavg()[0]
    except OSError:
        load_avg = float("nan")
    common = {"bench": NAME, "numel": numel, "threads": threads, "isa": be.isa,
              "cpu": platform.processor() or platform.machine(), "nproc": os.cpu_count(), "loadavg_1min": load_avg}
    records = []
    gen = torch.Generator().manual_seed(0)
    for dt in dtypes:
        s = torch.tensor([], dtype=dt).element_size()
        g = torch.randn(numel, generator=gen).to(dt)
        m = (torch.randn(numel, generator=gen) * 0.1).to(dt)
        p = torch.randn(numel, generator=gen).to(dt)
        planes = torch.randint(0, 256, (N_VOTERS, numel // 8), dtype=torch.uint8, generator=gen)
        gc, mc, pc = g[:codec_numel].clone(), m[:codec_numel].clone(), p[:codec_numel].clone()
        planes_c = planes[:, :codec_numel // 8].contiguous()
        dname = str(dt).replace("torch.", "")

        pre = TorchPrealloc(numel, dt, N_VOTERS)
        # the baseline computes what the kernels compute: same sign / nonzero planes, momenta, counts
        gx, mx1, mx2 = g.clone(), m.clone(), m.clone()
        fs, fnz, fbad, fzero = be.local_step([gx], [mx1], [0], numel, B1, B2, True)
        ps_, pnz, pbad, pzero = pre.local_step(gx, mx2, B1, B2)
        bits_match = bool(torch.equal(fs.reshape(-1), ps_) and (fnz is None or int(fzero) == 0
                                                              or torch.equal(fnz.reshape(-1), pnz))
                          and int(fbad) == pbad and int(fzero) == pzero)
        mom_match = bool(torch.equal(mx1, mx2))
        px1, px2 = p.clone(), p.clone()
        vote_match = bool(torch.equal(torch_vote_apply(planes, px1, LR, WD, 3), pre.vote_apply(planes, px2, LR, WD, 3))
                          and torch.equal(px1, px2))
        del gx, mx1, mx2, px1, px2
        # kernel -> (bytes moved per param, fused, plain torch with reused buffers, plain torch with
        # fresh temporaries, the pure-torch reference)
        cases = {
            "local_step": (3 * s + 0.25,
                           lambda: be.local_step([g], [m], [0], numel, B1, B2, True),
                           lambda: pre.local_step(g, m, B1, B2),
                           lambda: torch_local_step(g, m, B1, B2, True),
                           lambda: reference.local_step([gc], [mc], [0], codec_numel, B1, B2, True)),
            "local_step_2pass": (5 * s + 0.25,
                                 lambda: (be.local_step([g], [m], [0], numel, B1, B2, False),
                                          be.momentum_update_list([m], [g], B2)),
                                 lambda: pre.local_step(g, m, B1, B2),
                                 lambda: torch_local_step(g, m, B1, B2, True),
                                 lambda: (reference.local_step([gc], [mc], [0], codec_numel, B1, B2, False),
                                          reference.momentum_update(mc, gc, B2))),
            "vote_apply": (2 * s + N_VOTERS / 8,
                           lambda: be.vote_apply(planes, None, [p], [0], LR, WD, 3, "hash", "majority", N_VOTERS, 0,
                                                 False),
                           lambda: pre.vote_apply(planes, p, LR, WD, 3),
                           lambda: torch_vote_apply(planes, p, LR, WD, 3),
                           lambda: reference.vote_apply(planes_c, None, [pc], [0], LR, WD, 3, "hash", "majority",
                                                    N_VOTERS)),
            "vote_apply+delta": (2 * s + N_VOTERS / 8 + 4,
                                 lambda: be.vote_apply(planes, None, [p], [0], LR, WD, 3, "hash", "majority",
                                                       N_VOTERS),
                                 lambda: pre.vote_apply(planes, p, LR, WD, 3),
                                 lambda: torch_vote_apply(planes, p, LR, WD, 3),
                                 lambda: reference.vote_apply(planes_c, None, [pc], [0], LR, WD, 3, "hash", "majority",
                                                          N_VOTERS)),
        }
        # fused kernels, the preallocated torch baseline and the copy floor in ONE round-robin (a busy
        # machine slows all of them alike, so the speedup is a side-by-side ratio); then the slow ones
        base = ("local_step", "vote_apply")
        rr = _interleaved(dict({"copy": copy_fn}, **{k: v[1] for k, v in cases.items()},
                               **{"torch:" + k: v[2] for k, v in cases.items() if k in base}), repeat)
        fused = {k: v for k, v in rr.items() if not k.startswith("torch:")}
        plain = {k[len("torch:"):]: v for k, v in rr.items() if k.startswith("torch:")}
        slow_rounds = max(3, repeat // 2)
        alloc = _interleaved({k: v[3] for k, v in cases.items() if k in base}, slow_rounds)
        for d in (plain, alloc):
            d["local_step_2pass"] = d["local_step"]
            d["vote_apply+delta"] = d["vote_apply"]
        ref = _interleaved({k: v[4] for k, v in cases.items()}, 3)
        bw = copy_bytes / statistics.median(fused["copy"])
        bw_best = copy_bytes / min(fused["copy"])
        for kernel, (bpp, *_fns) in cases.items():
            t_f = statistics.median(fused[kernel]) / per_m
            t_best = min(fused[kernel]) / per_m
            t_u = statistics.median(plain[kernel]) / per_m
            t_a = statistics.median(alloc[kernel]) / per_m
            t_c = statistics.median(ref[kernel]) / per_m_codec
            floor = bpp * 1e6 / bw
            records.append(dict(common, kernel=kernel, dtype=dname, fused_s_per_1M=t_f, unfused_s_per_1M=t_u,
                                unfused_alloc_s_per_1M=t_a, speedup_vs_unfused_alloc=t_a / t_f,
                                baseline_bits_match=bits_match, baseline_momentum_match=mom_match,
                                baseline_vote_match_alloc=vote_match,
                                unfused_codec_s_per_1M=t_c, speedup=t_u / t_f, speedup_vs_codec=t_c / t_f,
                                bytes_per_param=bpp, copy_GBps=bw / 1e9, floor_s_per_1M=floor,
                                fraction_of_floor=floor / t_f, best_fused_s_per_1M=t_best,
                                best_fraction_of_floor=(bpp * 1e6 / bw_best) / t_best, codec_numel=codec_numel))
        del g, m, p, planes
    return records


# ----------------------------------------------------------------------------- single-process Lion step
LION_TENSORS = 8  # parameters per step (odd sizes summing to numel)


def _lion_set(numel: int, dt, gen):
    weights = [3, 1, 7, 2, 5, 1, 4, 9]  # uneven parameter sizes
    sizes = [max(1, numel * w // sum(weights)) | 1 for w in weights]
    sizes[-1] = max(1, numel - sum(sizes[:-1]))
    params = [torch.randn(n, generator=gen).to(dt) for n in sizes]
    grads = [torch.randn(n, generator=gen).to(dt) for n in sizes]
    moms = [(torch.randn(n, generator=gen) * 0.1).to(dt) for n in sizes]
    return params, grads, moms


def run_lion_step(numel: int, repeat: int, dtypes) -> list[dict]:
    """The single-process step: fused vs the pure-torch paths vs lion-pytorch, against the copy floor."""
    from lioncub_ds.kernels.loader import load
    from lioncub_ds.lion import _foreach_lion, _single_tensor_lion

    try:
        from lion_pytorch.foreach import Lion as LPForeach
        from lion_pytorch.lion_pytorch import update_fn as lp_update
    except ImportError:
        LPForeach = lp_update = None
    be = load("cpp")
    threads = torch.get_num_threads()
    copy_n = max(numel, 16 << 20)
    ca, cb = torch.randn(copy_n), torch.empty(copy_n)
    copy_bytes = 2 * 4 * copy_n
    per_m = numel / 1e6
    kw = dict(lr=LR, beta1=B1, beta2=B2, weight_decay=WD)
    records = []
    gen = torch.Generator().manual_seed(1)
    for dt in dtypes:
        s = torch.tensor([], dtype=dt).element_size()
        ps, gs, ms = _lion_set(numel, dt, gen)
        # the fused step gives the foreach path's bits (one step on copies)
        p1, m1, p2, m2 = [p.clone() for p in ps], [m.clone() for m in ms], [p.clone() for p in ps], [m.clone() for m in ms]
        be.lion_step(p1, gs, m1, LR, WD, B1, B2)
        _foreach_lion(p2, gs, m2, **kw)
        match = all(torch.equal(a, b) for a, b in zip(p1 + m1, p2 + m2))
        del p1, m1, p2, m2
        cases = {"copy": lambda: cb.copy_(ca),
                 "fused": lambda: be.lion_step(ps, gs, ms, LR, WD, B1, B2),
                 "foreach": lambda: _foreach_lion(ps, gs, ms, **kw),
                 "single": lambda: _single_tensor_lion(ps, gs, ms, **kw)}
        if lp_update is not None:
            cases["lion_pytorch"] = lambda: [lp_update(p, g, m, LR, WD, B1, B2) for p, g, m in zip(ps, gs, ms)]
            lp_params = [torch.nn.Parameter(p) for p in ps]  # the same storage
            for p, g in zip(lp_params, gs):
                p.grad = g
            lp_opt = LPForeach(lp_params, lr=LR, betas=(B1, B2), weight_decay=WD)
            cases["lion_pytorch_foreach"] = lp_opt.step
        rr = _interleaved(cases, repeat)
        bw = copy_bytes / statistics.median(rr.pop("copy"))
        bpp = 5 * s  # read g, m, theta; write m, theta
        floor = bpp * 1e6 / bw
        t = {k: statistics.median(v) / per_m for k, v in rr.items()}
        for impl, ti in t.items():
            records.append({"bench": NAME, "kernel": "lion_step", "impl": impl, "dtype": str(dt).replace("torch.", ""),
                            "numel": numel, "tensors": len(ps), "threads": threads, "isa": be.isa,
                            "s_per_1M": ti, "bytes_per_param": bpp, "copy_GBps": bw / 1e9, "floor_s_per_1M": floor,
                            "fraction_of_floor": floor / ti, "x_of_floor": ti / floor,
                            "speedup_of_fused": ti / t["fused"], "lion_match": match})
        del ps, gs, ms
    return records


def format_lion_table(records: list[dict]) -> str:
    if not records:
        return "(no lion_step records)"
    r0 = records[0]
    lines = [f"lion_step: {r0['numel'] / 1e6:.1f}M params in {r0['tensors']} tensors, {r0['threads']} threads, "
             f"isa={r0['isa']}; ms per 1M params (medians, one round-robin with the copy); floor = bytes/param at the "
             "copy bandwidth; x floor = time / floor (1.0 = at the copy bandwidth); x fused = time / fused time",
             f"{'impl':<22}{'dtype':<10}{'ms/1M':>8}{'B/param':>9}{'copy GB/s':>11}{'floor':>8}{'x floor':>9}"
             f"{'x fused':>9}"]
    for r in records:
        lines.append(f"{r['impl']:<22}{r['dtype']:<10}{r['s_per_1M'] * 1e3:>8.3f}{r['bytes_per_param']:>9.1f}"
                     f"{r['copy_GBps']:>11.2f}{r['floor_s_per_1M'] * 1e3:>8.3f}{r['x_of_floor']:>9.2f}"
                     f"{r['speedup_of_fused']:>9.2f}")
    bad = sorted({r["dtype"] for r in records if not r["lion_match"]})
    lines.append("check: the fused step gives the foreach path's bits: " + ("OK" if not bad else "MISMATCH " +
                                                                              ", ".join(bad)))
    return "\n".join(lines)


def format_table(records: list[dict]) -> str:
    if not records:
        return "(no records)"
    r0 = records[0]
    lines = [f"kernels: {r0['numel'] / 1e6:.1f}M params, {r0['threads']} threads, isa={r0['isa']}, load avg "
             f"{r0['loadavg_1min']:.1f} on {r0['nproc']} cores; ms per 1M params (medians); copy = read+write GB/s "
             f"of a large copy_ timed round-robin with the fused kernels; best = fastest run vs fastest copy",
             "torch = the same math in plain torch ops with preallocated, reused buffers (the fair baseline; "
             "x torch = its speedup); torch-alloc = the same with fresh temporaries (allocator page faults)",
             f"{'kernel':<18}{'dtype':<10}{'fused':>8}{'torch':>9}{'x torch':>9}{'torch-alloc':>12}{'codec':>9}"
             f"{'x codec':>9}{'B/param':>9}{'copy':>7}{'floor':>8}{'of floor':>10}{'best':>7}"]
    for r in records:
        lines.append(f"{r['kernel']:<18}{r['dtype']:<10}{r['fused_s_per_1M'] * 1e3:>8.3f}"
                     f"{r['unfused_s_per_1M'] * 1e3:>9.3f}{r['speedup']:>9.1f}{r['unfused_alloc_s_per_1M'] * 1e3:>12.3f}"
                     f"{r['unfused_codec_s_per_1M'] * 1e3:>9.2f}"
                     f"{r['speedup_vs_codec']:>9.1f}{r['bytes_per_param']:>9.2f}"
                     f"{r['copy_GBps']:>7.2f}{r['floor_s_per_1M'] * 1e3:>8.3f}{r['fraction_of_floor'] * 100:>9.0f}%"
                     f"{r['best_fraction_of_floor'] * 100:>6.0f}%")
    bad = [f"{r['kernel']}/{r['dtype']}" for r in records
           if not (r["baseline_bits_match"] and r["baseline_momentum_match"] and r["baseline_vote_match_alloc"])]
    lines.append("baseline check: the preallocated torch baseline gives the fused kernels' sign/nonzero planes, counts "
                 "and momenta, and the allocating baseline's update: " + ("OK" if not bad else "MISMATCH " + ", ".join(bad)))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- host cost per call
HOST_TENSORS = 8   # tensors per bucket (a bucket of a few parameters)
HOST_NUMEL = 16    # elements per tensor (two bytes of votes): the per-call cost, not the kernels' element work
HOST_BUCKETS = 100


def _per_call_us(fn, calls: int, rounds: int) -> tuple[float, float]:
    """(median, best) µs per call of ``fn`` over ``rounds`` rounds of ``calls`` calls, on this thread's
    CPU clock: the host's work per call; time spent waiting for a core on a loaded machine is not in it."""
    for _ in range(max(10, calls // 10)):
        fn()
    ts = []
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        ts.append((time.thread_time() - t0) / calls * 1e6)
    return statistics.median(ts), min(ts)


def host_cases(be, tensors: int = HOST_TENSORS, numel: int = HOST_NUMEL, seed: int = 0) -> dict:
    """name -> (the public call as the optimizer makes it, the same kernel through the extension
    alone): one bucket of ``tensors`` tensors of ``numel`` elements (fp32), N = 4 voters. The bucket's
    offsets list, parameters and momenta stay the same objects from call to call (as in the
    pipeline); the gradients are fresh tensors every step (as ``p.grad`` is), here a fixed list."""
    from lioncub_ds.kernels import ops, reference

    gen = torch.Generator().manual_seed(seed)
    offs = [i * numel for i in range(tensors)]
    total = reference.padded_numel(tensors * numel, N_VOTERS)
    mk = lambda: [torch.randn(numel, generator=gen) for _ in range(tensors)]  # noqa: E731
    g, m, p = mk(), mk(), mk()
    otab = torch.tensor(offs, dtype=torch.int64)
    segs = reference.tie_segments(offs)
    planes = torch.randint(0, 256, (N_VOTERS, total // 8), dtype=torch.uint8, generator=gen)
    nz1 = planes[0].clone()
    mask = torch.full((total // 8,), 255, dtype=torch.uint8)
    lanes = torch.randint(0, 256, (total * 4 // 8,), dtype=torch.uint8, generator=gen)
    q = torch.randint(-3, 4, (total,), dtype=torch.int8, generator=gen)
    bb = torch.randint(0, 256, (N_VOTERS, 2, total // 8 // N_VOTERS), dtype=torch.uint8, generator=gen)
    shard = planes[:, :total // 8 // N_VOTERS].contiguous()
    sseg = reference.tie_segments(offs, None, 0, total // N_VOTERS)
    zlay = reference.zero_layout(N_VOTERS, [total // N_VOTERS], [0])
    zsign = torch.randint(0, 256, (N_VOTERS, total // N_VOTERS // 8), dtype=torch.uint8, generator=gen)
    ztarget = [torch.randn(total, generator=gen)]
    zpieces, znone = zlay.pieces, [torch.empty(0)]
    lay = be.layout_for(offs, total)  # what the pipeline passes: its bucket's layout, made once
    ext = be._ext
    e = ()
    return {
        "local_step": (lambda: be.local_step(g, m, lay, total, B1, B2, True, device_counts=True),
                       lambda: ext.local_step(g, m, e, otab, total, B1, B2, True)),
        "abstain_list": (lambda: be.abstain_list(nz1, mask, 16), lambda: ext.abstain_list(nz1, mask, 16)),
        "momentum_update_list": (lambda: be.momentum_update_list(m, g, B2), lambda: ext.momentum_update(m, g, B2)),
        "vote_apply": (lambda: be.vote_apply(planes, None, p, lay, LR, WD, 3, "hash", "majority", N_VOTERS, segs,
                                             False),
                       lambda: ext.vote_apply(planes, None, p, otab, LR, WD, 3, 2, 0, N_VOTERS, segs, False)),
        "shard_vote": (lambda: be.shard_vote(shard, None, 3, "hash", sseg),
                       lambda: ext.shard_vote(shard, None, 3, 2, sseg)),
        "count_lanes": (lambda: be.count_lanes(shard, None, 4), lambda: ext.count_lanes(shard, None, 4)),
        "lanes_apply": (lambda: be.lanes_apply(lanes, None, N_VOTERS, 4, p, lay, LR, WD, 3, "hash", "average",
                                               segs, False),
                        lambda: ext.lanes_apply(lanes, None, N_VOTERS, 4, p, otab, LR, WD, 3, 2, 1, segs, False)),
        "int8_local_step": (lambda: be.int8_local_step(g, m, lay, total, B1, "l1", 31, device_counts=True),
                            lambda: ext.int8_local_step(g, m, otab, total, B1, 0, 31)),
        "int8_apply": (lambda: be.int8_apply(q, p, lay, LR, WD, False),
                       lambda: ext.int8_apply(q, p, otab, LR, WD, False)),
        "lion_step": (lambda: be.lion_step(p, g, m, LR, WD, B1, B2), lambda: ext.lion_step(p, g, m, LR, WD, B1, B2)),
        "bbit_local_step": (lambda: be.bbit_local_step(g, m, lay, total, B1, B2, "l1", 2, "dither", 7, segs, True,
                                                       device_counts=True),
                            lambda: ext.bbit_local_step(g, m, e, otab, total, B1, B2, True, 0, 2, 1, 7, segs)),
        "bbit_shard_vote": (lambda: be.bbit_shard_vote(bb, None, 2, 3, "hash", sseg),
                            lambda: ext.bbit_shard_vote(bb, None, 2, 3, 2, sseg)),
        "zero_sign_apply": (lambda: be.zero_sign_apply(zsign, None, ztarget, None, zlay, [LR], [WD]),
                            lambda: ext.zero_sign_apply(zsign, None, ztarget, znone, zpieces, [LR], [WD])),
        # a caller with an offsets list (found again by its identity; fresh outputs every call)
        "local_step (offsets list)": (lambda: be.local_step(g, m, offs, total, B1, B2, True, device_counts=True),
                                      lambda: ext.local_step(g, m, e, otab, total, B1, B2, True)),
        # what each call costs through the dispatcher instead (torch.ops.lioncub.*, what a compiled graph calls)
        "local_step (torch.ops)": (lambda: ops.op("local_step")(g, m, e, otab, total, B1, B2, True),
                                   lambda: ext.local_step(g, m, e, otab, total, B1, B2, True)),
    }


def run_host(calls: int, rounds: int, buckets: int = HOST_BUCKETS) -> list[dict]:
    """Host µs per fused call on the C++ backend (each op), against the extension alone and two
    yardsticks timed in the same run (an empty Python call; ``x.add_(x)`` on a 1-element tensor, the
    cheapest torch op: a busy machine slows all of them alike); then the kernel calls of one step of a
    ``buckets``-bucket 1bit all-gather vote (per bucket: local step, abstention list, vote + apply)."""
    from lioncub_ds.kernels.loader import load

    torch.set_num_threads(1)  # the host path, not the kernels' threads
    be = load("cpp")
    x = torch.zeros(1)
    nothing = lambda: None  # noqa: E731
    yard = {"python_call": _per_call_us(nothing, calls, rounds), "torch_add_1elem": _per_call_us(lambda: x.add_(x),
                                                                                               calls, rounds)}
    try:
        load_avg = os.getloadavg()[0]
    except OSError:
        load_avg = float("nan")
    common = {"bench": NAME, "table": "host", "tensors": HOST_TENSORS, "numel_per_tensor": HOST_NUMEL,
              "voters": N_VOTERS, "isa": be.isa, "cpu": platform.processor() or platform.machine(),
              "nproc": os.cpu_count(), "loadavg_1min": load_avg, "calls": calls, "rounds": rounds,
              "python_call_us": yard["python_call"][0], "torch_add_us": yard["torch_add_1elem"][0]}
    records = []
    # This machine's speed may change by 2x for minutes at a time (a shared VM): the µs are medians
    # over the rounds in which the yardstick ran within 25% of its fastest in the whole run (the
    # machine at its usual speed; an op measured only in a slow spell is measured again, up to 4
    # times); x add, the median of each round's ratio, uses every round.
    fastest = [yard["torch_add_1elem"][1]]
    fast = lambda a: a <= 1.25 * fastest[0]  # noqa: E731

    def fast_rounds(fns: dict):
        """µs per call of each of ``fns`` ({name: (fn, calls per round)}) and of the yardstick ("add"),
        per round, timed round-robin so that load changes within the run (other jobs) hit them alike;
        and the rounds run at the machine's usual speed (all rounds if none was)."""
        rr = {k: [] for k in (*fns, "add")}
        for _ in range(5):
            for _ in range(rounds):
                for k, (fn, n) in fns.items():
                    rr[k].append(_per_call_us(fn, n, 1)[0])
                rr["add"].append(_per_call_us(lambda: x.add_(x), calls, 1)[0])
                fastest[0] = min(fastest[0], rr["add"][-1])
            if sum(map(fast, rr["add"])) >= 3:
                break
        keep = [i for i, a in enumerate(rr["add"]) if fast(a)] or list(range(len(rr["add"])))
        return rr, keep

    for name, (public, raw) in host_cases(be).items():
        rr, keep = fast_rounds({"public": (public, calls), "raw": (raw, calls)})
        t_pub, t_raw, t_add = (statistics.median([rr[k][i] for i in keep]) for k in ("public", "raw", "add"))
        ratio = statistics.median(p / a for p, a in zip(rr["public"], rr["add"]))
        records.append(dict(common, op=name, us_per_call=t_pub, best_us_per_call=min(rr["public"]),
                            extension_us=t_raw, best_extension_us=min(rr["raw"]), python_layer_us=t_pub - t_raw,
                            add_us=t_add, in_torch_adds=ratio, rounds_kept=len(keep)))
    cases = host_cases(be)
    per_bucket = [cases[k][0] for k in ("local_step", "abstain_list", "vote_apply")]
    steps = [host_cases(be, seed=b) for b in range(buckets)]  # a separate bucket (offsets, tensors) each

    def one_step():
        for c in steps:
            c["local_step"][0]()
            c["abstain_list"][0]()
            c["vote_apply"][0]()

    def paired(fn, n):
        """(median, best, the yardstick's median) of ``fn`` over the rounds at the usual speed."""
        rr, keep = fast_rounds({"fn": (fn, n)})
        return (statistics.median([rr["fn"][i] for i in keep]), min(rr["fn"]),
                statistics.median([rr["add"][i] for i in keep]))

    t_step, best_step, t_add = paired(one_step, max(1, calls // (10 * buckets)))
    records.append(dict(common, op=f"step: {buckets} buckets x {len(per_bucket)} calls", us_per_call=t_step,
                        best_us_per_call=best_step, extension_us=float("nan"), best_extension_us=float("nan"),
                        python_layer_us=float("nan"), add_us=t_add, in_torch_adds=t_step / t_add, buckets=buckets))
    whole = step_host(buckets, max(1, calls // (20 * buckets)), paired)
    if whole is not None:
        t_whole, best_whole, t_add = whole
        records.append(dict(common, op=f"LionCub.step(): {buckets} buckets, 1bit", us_per_call=t_whole,
                            best_us_per_call=best_whole, extension_us=float("nan"), best_extension_us=float("nan"),
                            python_layer_us=float("nan"), add_us=t_add, in_torch_adds=t_whole / t_add,
                            buckets=buckets, per_bucket_us=t_whole / buckets))
    return records


def step_host(buckets: int, steps: int, timer, comm: str = "1bit"):
    """``timer(step, steps)`` of one whole ``LionCub.step()`` on a model of ``buckets`` parameters of
    HOST_NUMEL elements (one bucket each) at N = N_VOTERS ranks, simulated by torch's fake process
    group: the collectives return at once and move no data (what arrives is whatever the buffers
    held), so this is the step's host time without the network: the pipeline, the flags and the
    kernel calls (on HOST_NUMEL elements each). None where the fake group is unavailable or a process group
    is already up."""
    import torch.distributed as dist

    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        return None
    if dist.is_initialized():
        return None
    from lioncub_ds import LionCub

    dist.init_process_group("fake", rank=0, world_size=N_VOTERS, store=FakeStore())
    try:
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(HOST_NUMEL, generator=gen)) for _ in range(buckets)]
        opt = LionCub(params, lr=1e-4, comm=comm, bucket_size_mb=HOST_NUMEL * 4 / 2**20)
        for p in params:
            p.grad = torch.randn(HOST_NUMEL, generator=gen)
        for _ in range(3):
            opt.step()
        return timer(opt.step, steps)
    finally:
        dist.destroy_process_group()


def format_host_table(records: list[dict]) -> str:
    r0 = records[0]
    lines = [f"host cost per fused call (C++ backend, 1 thread): a bucket of {r0['tensors']} fp32 tensors x "
             f"{r0['numel_per_tensor']} elements, N={r0['voters']}; {r0['rounds']} rounds x {r0['calls']} calls, "
             f"us: medians of the rounds in which x.add_(x) ran within 25% of the run's fastest; "
             f"load avg {r0['loadavg_1min']:.1f} on {r0['nproc']} cores",
             f"yardsticks in the same run: an empty Python call {r0['python_call_us']:.2f} us, x.add_(x) on one "
             f"element {r0['torch_add_us']:.2f} us; x add = per call / x.add_(x) timed round-robin with each op",
             f"{'op':<36}{'us/call':>10}{'best':>10}{'ext only':>10}{'python':>9}{'x add':>9}"]
    for r in records:
        lines.append(f"{r['op']:<36}{r['us_per_call']:>10.2f}{r['best_us_per_call']:>10.2f}{r['extension_us']:>10.2f}"
                     f"{r['python_layer_us']:>9.2f}{r['in_torch_adds']:>9.1f}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="write the records (a JSON list of flat dicts) here")
    ap.add_argument("--out", type=Path, default=None, help="output directory (<out>/kernels.json if no --json)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu: the C++ kernels (this table); cuda: benchmarks.kernels_cuda.run_cuda (needs a GPU)")
    ap.add_argument("--numel", type=int, default=None, help="parameters per kernel call (default 16M; cuda 64M)")
    ap.add_argument("--codec-numel", type=int, default=16 << 20, help="parameters for the slow codec baseline")
    ap.add_argument("--repeat", type=int, default=7, help="timed runs per measurement (median)")
    ap.add_argument("--threads", type=int, default=None, help="torch (and OpenMP) threads; default: torch's")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma list of float32,bfloat16")
    ap.add_argument("--only", default="all", choices=("all", "votes", "lion", "host"),
                    help="cpu: votes = the LionCub kernels table, lion = the single-process step table, host = the "
                         "host cost per call of every op and of a 100-bucket step's kernel calls (not in all)")
    ap.add_argument("--calls", type=int, default=2000, help="host: calls per timed round")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = [{"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
               "bf16": torch.bfloat16}[d.strip()] for d in args.dtypes.split(",") if d.strip()]
    path = args.json or (args.out / f"{NAME}.json" if args.out else None)
    if args.device == "cuda":
        from .kernels_cuda import run_cuda

        names = {torch.float32: "fp32", torch.bfloat16: "bf16"}
        try:
            run_cuda(path, numel=args.numel or (1 << 26), repeats=max(args.repeat, 5),
                     dtypes=[names[d] for d in dtypes])
        except RuntimeError as exc:
            print(f"[bench {NAME}] {exc}", file=sys.stderr)
            return 2
        if path is not None:
            print(f"[bench {NAME}] wrote {path}")
        return 0
    numel = args.numel or (16 << 20)
    records = []
    if args.only == "host":
        records = run_host(args.calls, max(args.repeat, 15))
        print(format_host_table(records))
    if args.only in ("all", "votes"):
        records += run(numel, args.repeat, args.codec_numel, dtypes)
        print(format_table(records))
    if args.only in ("all", "lion"):
        lion_records = run_lion_step(numel, args.repeat, dtypes)
        print(format_lion_table(lion_records))
        records += lion_records
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records, indent=1))
        print(f"[bench {NAME}] wrote {len(records)} records to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
