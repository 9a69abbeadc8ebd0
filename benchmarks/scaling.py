"""``python -m benchmarks scaling``: predicted communication time per optimizer step
for N = 2 … 1024 ranks, from the α-β model that ``comm="auto"`` uses
(:class:`lioncub_ds.comm.cost.CostModel`, the one implementation).

Calibration on this machine:

* α (per message) and β (per byte) are fitted by least squares (relative error) to gloo
  collectives on loopback (all_reduce fp32, all_gather and all_to_all uint8; N = 2 and 4;
  1 KB … 16 MB), with the same ring terms the telemetry counts;
* γ (kernel time per counted vote byte) is the slope of the vote kernel's time
  (``vote_apply`` over 1, 4, 16, 64 voters) of the active kernel backend; γ_reduce (what the
  fp32/bf16 baselines' reduction costs per summed byte) is an fp32 in-place add;
* the fitted loopback model (α, β only: comm_stats times the collectives, not the kernels)
  is checked against real LionCub steps.

Then the target network's α and β replace the loopback ones (γ is kept) and every
algorithm is predicted over its real bucket layout (25 MB fp32 buckets, DDP's default
for the all-reduce baselines too). Crossovers are found on every integer N.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

from lioncub_ds.comm import make_algorithm
from lioncub_ds.comm.cost import CostModel
from .common import add_output_args, finish, line_plot, median, print_table, pyplot, run_ranks

NAME = "scaling"

NETWORKS = {  # name: (bandwidth Gbit/s, per-message latency µs, keep the calibrated CPU kernel time γ)
    "100GbE": (100.0, 25.0, True),
    "400G-IB": (400.0, 5.0, True),
    "400G-IB, γ=0": (400.0, 5.0, False),  # GPU-like: kernel time negligible next to the wire
}
ALGORITHMS = ("fp32_allreduce", "bf16_allreduce", "allgather", "1bit", "pbit", "int8")
PAIRS = [("allgather", "bf16_allreduce"), ("allgather", "fp32_allreduce"), ("allgather", "1bit"),
         ("1bit", "bf16_allreduce"), ("pbit", "1bit"), ("int8", "bf16_allreduce"), ("pbit", "bf16_allreduce")]
BUCKET_NUMEL = 25 * 2**20 // 4  # LionCub's default bucket_size_mb=25 (and DDP's bucket_cap_mb=25)


# ----------------------------------------------------------------------------- prediction
def valid(algorithm: str, n: int) -> bool:
    if algorithm == "pbit":
        return n <= 255  # 8-bit lanes count at most 255 votes
    if algorithm == "int8":
        return n <= 127  # s = floor(127/N) >= 1
    return True


def predict_step(model: CostModel, algorithm: str, numel: int, n: int, bucket_numel: int = BUCKET_NUMEL) -> float:
    """Communication time of one optimizer step: one collective (set) per bucket."""
    full, rest = divmod(numel, bucket_numel)
    t = full * model.predict(algorithm, bucket_numel, n) if full else 0.0
    if rest:
        t += model.predict(algorithm, rest, n)
    return t


def crossovers(model: CostModel, numel: int, n_max: int, pairs=PAIRS) -> list[dict]:
    """Every integer N in [2, n_max] where algorithm a starts / stops being faster than b
    (``world_size``: the first N of the new order; None when the order never changes)."""
    out = []
    for a, b in pairs:
        prev, found, last = None, False, n_max
        for n in range(2, n_max + 1):
            if not (valid(a, n) and valid(b, n)):
                last = n - 1
                break
            faster = predict_step(model, a, numel, n) < predict_step(model, b, numel, n)
            if prev is not None and faster != prev:
                out.append({"a": a, "b": b, "world_size": n,
                            "event": f"{a} {'becomes faster than' if faster else 'loses to'} {b} at N={n}"})
                found = True
            prev = faster
        if not found:
            limit = f" ({a if not valid(a, last + 1) else b} cannot run beyond N={last})" if last < n_max else ""
            out.append({"a": a, "b": b, "world_size": None,
                        "event": f"no crossover for N <= {last}: {a} is always {'faster' if prev else 'slower'}"
                                 f" than {b}{limit}"})
    return out


# ----------------------------------------------------------------------------- calibration
def _time_collective(fn, reps):
    import torch.distributed as dist

    ts = []
    for _ in range(reps + 1):
        dist.barrier()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts[1:])  # the first call warms up connections; other work on the machine only adds time


def _calib_rank(rank, n, sizes, reps, validate_numel, validate_steps):
    import torch.distributed as dist

    from lioncub_ds import LionCub

    out = {"samples": [], "validate": []}
    for nbytes in sizes:
        f32 = torch.ones(max(1, nbytes // 4))
        t = _time_collective(lambda: dist.all_reduce(f32), reps)
        out["samples"].append(("all_reduce", f32.numel() * 4, t))
        chunk = max(1, nbytes // n)
        u8 = torch.ones(chunk, dtype=torch.uint8)
        gathered = torch.empty(chunk * n, dtype=torch.uint8)
        ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        t = _time_collective(lambda: ag(gathered, u8), reps)
        out["samples"].append(("all_gather", gathered.numel(), t))
        a2a_in = torch.ones(chunk * n, dtype=torch.uint8)
        a2a_out = torch.empty_like(a2a_in)
        t = _time_collective(lambda: dist.all_to_all_single(a2a_out, a2a_in), reps)
        out["samples"].append(("all_to_all", a2a_in.numel(), t))
    if validate_numel:
        gen = torch.Generator().manual_seed(rank)
        params = [torch.nn.Parameter(torch.zeros(validate_numel))]
        for algo in ("allgather", "1bit", "pbit", "int8"):
            if not valid(algo, n):
                continue
            kw = {"quant": "l1"} if algo == "int8" else {}
            opt = LionCub(params, lr=1e-4, comm=algo, **kw)
            ts = []
            for _ in range(validate_steps + 1):
                g = torch.randn(params[0].shape, generator=gen)
                params[0].grad = g.masked_fill_(g == 0, 1e-3)
                dist.barrier()
                opt.step()
                ts.append(opt.comm_stats()["last_step"]["comm_time_s"])
            out["validate"].append((algo, median(ts[1:])))
    return out


def measure_gamma(numel: int = 1 << 22, voters=(1, 4, 16, 64), reps: int = 5) -> tuple[float, float, list, str]:
    """γ from the vote kernel of the active backend (this process, one thread; the fastest of
    ``reps`` runs, since other work on the machine only ever adds time)."""
    from lioncub_ds import kernels

    be = kernels.backend_for("cpu")
    k = numel // 8
    params = [torch.zeros(numel)]
    gen = torch.Generator().manual_seed(0)
    samples = []
    for nv in voters:
        sign = torch.randint(0, 256, (nv, k), dtype=torch.uint8, generator=gen)
        ts = []
        for step in range(reps + 1):
            t = time.perf_counter()
            be.vote_apply(sign, None, params, [0], 1e-4, 0.0, step + 1, "hash", "majority", nv, 0)
            ts.append(time.perf_counter() - t)
        samples.append((nv * k, min(ts[1:])))
    gamma, intercept = CostModel.fit_gamma(samples)
    return gamma, intercept, samples, be.name


def measure_gamma_reduce(numel: int = 1 << 22, reps: int = 5) -> float:
    """Seconds per byte of an fp32 in-place add (what a ring all-reduce's reduction does per byte)."""
    a = torch.ones(numel)
    b = torch.ones(numel)
    ts = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        a.add_(b)
        ts.append(time.perf_counter() - t)
    return min(ts[1:]) / (4 * numel)


def calibrate(world_sizes=(2, 4), sizes=(1 << 10, 1 << 14, 1 << 18, 1 << 21, 1 << 24), reps=5,
              validate_numel=1 << 22, validate_steps=3, gamma_numel=1 << 22, verbose=True):
    """Fit α, β (loopback gloo) and γ (vote kernel). Returns (CostModel, calibration records)."""
    samples, raw, validate = [], [], []
    for n in world_sizes:
        t0 = time.perf_counter()
        res = run_ranks(_calib_rank, n, list(sizes), reps, validate_numel, validate_steps)
        for i, (kind, nbytes, _) in enumerate(res[0]["samples"]):
            t = max(r["samples"][i][2] for r in res)  # the slowest rank ends the collective
            m, b = CostModel.collective_terms(kind, nbytes, n)
            samples.append((m, b, t))
            raw.append({"kind": kind, "world_size": n, "nbytes": nbytes, "messages": m, "bytes_sent": b,
                        "measured_s": t})
        for i, (algo, _) in enumerate(res[0]["validate"]):
            validate.append({"algorithm": algo, "world_size": n, "numel": validate_numel,
                             "measured_s": max(r["validate"][i][1] for r in res)})
        if verbose:
            print(f"[bench scaling] loopback calibration N={n}: {time.perf_counter() - t0:.1f} s", flush=True)
    gamma, intercept, gsamples, backend = measure_gamma(gamma_numel)
    gamma_reduce = measure_gamma_reduce(gamma_numel)
    model = CostModel.fit(samples, gamma, gamma_reduce)
    recs = [{"bench": "scaling_calibration", "alpha_s": model.alpha_s, "beta_s_per_byte": model.beta_s_per_byte,
             "loopback_bandwidth_gbit": model.bandwidth_gbit, "gamma_s_per_byte": gamma,
             "gamma_reduce_s_per_byte": gamma_reduce,
             "gamma_intercept_s": intercept, "gamma_numel": gamma_numel, "kernel_backend": backend,
             "samples": len(samples)}]
    for r in raw:
        pred = model.collective_time(r["messages"], r["bytes_sent"])
        r.update(bench="scaling_fit", predicted_s=pred, ratio=r["measured_s"] / pred if pred > 0 else float("inf"))
        recs.append(r)
    ratios = sorted(r["ratio"] for r in raw)
    recs[0].update(fit_residual_min=ratios[0], fit_residual_max=ratios[-1], fit_residual_median=median(ratios))
    wire = CostModel(model.alpha_s, model.beta_s_per_byte, 0.0, 0.0)  # comm_stats times the collectives only
    for v in validate:
        # + the step's flags: their own tiny all-reduce, unless they ride in the vote (1bit, allgather)
        pred = wire.predict(v["algorithm"], v["numel"], v["world_size"])
        if not make_algorithm(v["algorithm"]).carries_flags:
            pred += wire.collective_time(*CostModel.collective_terms("all_reduce", 8, v["world_size"]))
        recs.append({"bench": "scaling_validate", **v, "predicted_s": pred, "ratio": v["measured_s"] / pred})
    for nb, t in gsamples:
        recs.append({"bench": "scaling_gamma", "bytes_processed": nb, "measured_s": t})
    return model, recs


# ----------------------------------------------------------------------------- bench
def run(numels=(25_000_000, 1_000_000_000), n_max=1024, networks=NETWORKS, calib_kw=None, model=None,
        verbose=True):
    """Returns (records, crossover records, calibration records)."""
    calib = []
    if model is None:
        model, calib = calibrate(verbose=verbose, **(calib_kw or {}))
    grid = [2 ** i for i in range(1, int(math.log2(n_max)) + 1)]
    records, cross = [], []
    for net, (bw, lat, keep_gamma) in networks.items():
        m = model.with_network(bw, lat)
        if not keep_gamma:
            m = CostModel(m.alpha_s, m.beta_s_per_byte, 0.0, 0.0)
        for numel in numels:
            for algo in ALGORITHMS:
                for n in grid:
                    if not valid(algo, n):
                        continue
                    records.append({"bench": NAME, "algorithm": algo, "network": net, "world_size": n,
                                    "predicted_comm_time_s": predict_step(m, algo, numel, n), "numel": numel,
                                    "bandwidth_gbit": bw, "latency_us": lat,
                                    "gamma_s_per_byte": m.gamma_s_per_byte,
                                    "gamma_reduce_s_per_byte": m.gamma_reduce_s_per_byte})
            for c in crossovers(m, numel, n_max):
                cross.append({"bench": "scaling_crossover", "network": net, "numel": numel, **c})
            for n in grid:
                cross.append({"bench": "scaling_auto_choice", "network": net, "numel": numel, "world_size": n,
                              "choice": m.choose(BUCKET_NUMEL, n)})
    return records, cross, calib


def plot(records, out):
    plt = pyplot()
    recs = [r for r in records if r.get("bench") == NAME]
    nets = list(dict.fromkeys(r["network"] for r in recs))
    numels = list(dict.fromkeys(r["numel"] for r in recs))
    cross = [r for r in records if r.get("bench") == "scaling_crossover"]
    fig, axes = plt.subplots(len(numels), len(nets), figsize=(6.2 * len(nets), 4.4 * len(numels)), dpi=110,
                             squeeze=False)
    for i, numel in enumerate(numels):
        for j, net in enumerate(nets):
            ax = axes[i][j]
            for algo in ALGORITHMS:
                pts = [(r["world_size"], r["predicted_comm_time_s"]) for r in recs
                       if r["network"] == net and r["numel"] == numel and r["algorithm"] == algo]
                if pts:
                    ax.plot(*zip(*pts), marker="o", markersize=3, label=algo)
            for c in cross:
                if c["network"] == net and c["numel"] == numel and c["a"] == "allgather" \
                        and c["b"] == "bf16_allreduce" and c["world_size"]:
                    ax.axvline(c["world_size"], color="grey", linestyle=":")
                    ax.text(c["world_size"], ax.get_ylim()[0], f" allgather > bf16 AR\n at N={c['world_size']}",
                            fontsize=7, color="grey", va="bottom")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("ranks N")
            ax.set_ylabel("predicted comm time per step (s)")
            bw = next(r["bandwidth_gbit"] for r in recs if r["network"] == net)
            lat = next(r["latency_us"] for r in recs if r["network"] == net)
            ax.set_title(f"{net} ({bw:g} Gbit/s, α={lat:g} µs), P={numel / 1e6:g}M", fontsize=9)
            ax.grid(True, alpha=0.3, which="both")
            ax.legend(fontsize=7)
    fig.suptitle("α-β model (lioncub_ds.comm.cost.CostModel), γ calibrated on this machine", fontsize=10)
    fig.tight_layout()
    path = os.path.join(out, "scaling.png")
    fig.savefig(path)
    plt.close(fig)
    files = [path]
    fit = [r for r in records if r.get("bench") == "scaling_fit"]
    if fit:
        series = {}
        for r in fit:
            key = f"{r['kind']} N={r['world_size']}"
            series.setdefault(key, ([], []))
            series[key][0].append(r["nbytes"])
            series[key][1].append(r["measured_s"] / r["predicted_s"])
        files.append(line_plot(os.path.join(out, "scaling_fit.png"), series, xlabel="message bytes",
                               ylabel="measured / α-β fit", title="Loopback gloo: measured time vs fitted α-β model",
                               logx=True))
    return files


def build_parser():
    p = argparse.ArgumentParser(prog="python -m benchmarks scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--numels", type=int, nargs="+", default=[25_000_000, 1_000_000_000],
                   help="model sizes (parameters) to predict for")
    p.add_argument("--max-world-size", type=int, default=1024)
    p.add_argument("--calib-world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--calib-max-bytes", type=int, default=1 << 24, help="largest calibration message")
    p.add_argument("--calib-reps", type=int, default=5)
    p.add_argument("--validate-numel", type=int, default=1 << 22, help="LionCub steps used to check the fit (0: skip)")
    p.add_argument("--gamma-numel", type=int, default=1 << 22)
    add_output_args(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    sizes = [s for s in (1 << 10, 1 << 14, 1 << 18, 1 << 21, 1 << 24, 1 << 26) if s <= args.calib_max_bytes]
    if len(sizes) < 2:
        sizes = [1 << 10, max(args.calib_max_bytes, 1 << 11)]
    calib_kw = dict(world_sizes=tuple(args.calib_world_sizes), sizes=tuple(sizes), reps=args.calib_reps,
                    validate_numel=args.validate_numel, gamma_numel=args.gamma_numel)
    records, cross, calib = run(tuple(args.numels), args.max_world_size, NETWORKS, calib_kw)
    c = calib[0]
    print(f"[bench scaling] calibration: α = {c['alpha_s'] * 1e6:.1f} µs/message, β = {c['beta_s_per_byte'] * 1e9:.3f} "
          f"ns/byte (loopback ≈ {c['loopback_bandwidth_gbit']:.2f} Gbit/s), γ = {c['gamma_s_per_byte'] * 1e9:.3f} "
          f"ns/counted vote byte ({c['kernel_backend']} kernels), γ_reduce = {c['gamma_reduce_s_per_byte'] * 1e9:.3f} "
          f"ns/summed byte (fp32 add)")
    if "fit_residual_min" in c:
        print(f"[bench scaling] fit residuals (measured / fitted α-β time, the scaling_fit records): "
              f"{c['fit_residual_min']:.2f}–{c['fit_residual_max']:.2f}x over "
              f"{sum(r['bench'] == 'scaling_fit' for r in calib)} samples (median {c['fit_residual_median']:.2f}x)")
    val = [r for r in calib if r["bench"] == "scaling_validate"]
    if val:
        print_table(val, [("algorithm", "algorithm"), ("world_size", "N"), ("numel", "P"),
                          ("measured_s", "measured s", ".4f"), ("predicted_s", "fitted model s", ".4f"),
                          ("ratio", "measured/model", ".2f")],
                    title="[bench scaling] loopback check: a LionCub step's comm time vs the fitted model")
    for numel in args.numels:
        for net in NETWORKS:
            rows = []
            for n in sorted({r["world_size"] for r in records}):
                row = {"N": n}
                for r in records:
                    if r["network"] == net and r["numel"] == numel and r["world_size"] == n:
                        row[r["algorithm"]] = r["predicted_comm_time_s"] * 1e3
                rows.append(row)
            print_table(rows, ["N"] + [(a, a + " ms", ".3g") for a in ALGORITHMS],
                        title=f"[bench scaling] predicted comm time per step (ms), {net}, P={numel:,}")
    crec = [r for r in cross if r["bench"] == "scaling_crossover"]
    print_table(crec, [("network", "network"), ("numel", "P"), ("event", "crossover")],
                title="[bench scaling] crossovers (every integer N checked)")
    autos = [r for r in cross if r["bench"] == "scaling_auto_choice"]
    for net in NETWORKS:
        seq = [f"N={r['world_size']}:{r['choice']}" for r in autos if r["network"] == net and r["numel"] == args.numels[0]]
        print(f"[bench scaling] comm='auto' picks per 25 MB bucket on {net}: " + ", ".join(seq))
    finish(NAME, args, records + cross + calib, plot)
    print(f"[bench scaling] done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
