"""``python -m benchmarks plan_check``: the planner's step times against ``bench netns`` and
``bench netns_nodes`` on this machine (docs/planner.md, "Checked against measurements").

For every measured variant that is a planner strategy, :func:`lioncub_ds.plan.evaluate` predicts the
step time from this machine's inputs only:

* the compute time: the same run's ``no_comm`` forward+backward, and its update time (the fused Lion
  on every parameter), from which each strategy's update is scaled by its memory traffic;
* the link settings of the run: ``bench netns``: 4 ranks behind ONE token bucket of R Gbit/s on a
  loopback (each rank gets R/4 when all send, as in a ring); ``bench netns_nodes``: 2 nodes of 2 ranks,
  a veth shaped to R Gbit/s per direction between them, unshaped loopbacks inside;
* the host's copy rate and per-message latency: gloo over TCP copies every byte with the CPUs, and
  here all ranks share 2 cores. Fitted (α-β, :meth:`CostModel.fit`, with each sample's bytes summed
  over the ranks) to gloo collectives on loopback alone (``bench scaling``'s calibration samples:
  the committed docs/scaling.json, or ``--calibrate`` to measure them now), never to the variants
  checked here;
* overlap 0: backward and the collectives share the same 2 cores (measured: DDP's overlapped bf16
  all-reduce is within 1-3% of the same all-reduce after backward, docs/netns.json);
* gloo's reduce-scatter sends all-reduce bytes (docs/netns_nodes.json: the two-level baseline's
  loopback counter).

Measurements: the committed docs/netns.json and docs/netns_nodes.json, or ``--rerun`` (as root:
both benchmarks run now, in their own network namespaces, deleted at the end). The error is
100·(predicted / measured − 1); the target band is ±25%.

``--write-convergence-table`` regenerates ``lioncub_ds/plan_convergence.json`` (the convergence cost
the planner quotes) from the committed study summaries (:data:`STUDIES`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from .common import add_output_args, finish, print_table

NAME = "plan_check"
ROOT = Path(__file__).resolve().parents[1]
TABLE_PATH = ROOT / "lioncub_ds" / "plan_convergence.json"
BAND_PCT = 25.0

# The convergence studies the planner quotes, in order of preference when two hold the same
# (configuration, N) with the same number of seeds.
STUDIES = (("docs/long_n8_10seeds/converge.json", "long_n8_10seeds"),
           ("docs/node_voters_converge/converge.json", "node_voters_converge"),
           ("docs/long/converge.json", "long"))
# converge variants -> (planner family, node size L): only the configurations the planner offers
_NODE = re.compile(r"^cub_1bit(?P<sync>_sync20_int8)?_node(?P<L>[0-9]+)$")

# measured variant -> (planner strategy, LionCub's momentum sync period in that run)
PAIRS = {"netns": {"ddp_lion_bf16": "ddp_bf16", "lion_bf16_allreduce": "ddp_bf16",
                   "lioncub_1bit": "lioncub_1bit_sync20", "lioncub_1bit_overlap": "lioncub_1bit_sync20"},
         "netns_nodes": {"ddp_lion_bf16": "ddp_bf16", "two_level_bf16": "megatron_distopt_kN",
                         "lioncub_1bit": "lioncub_1bit_sync20", "lioncub_1bit_node": "lioncub_node_voters_sync20"}}
RANKS = {"netns": (1, 4), "netns_nodes": (2, 2)}  # (nodes, ranks per node)


# ----------------------------------------------------------------------------- convergence table
def family_of(variant: str):
    """(family, L) of a converge variant the planner quotes, or None."""
    if variant == "cub_1bit":
        return "flat_1bit", 1
    if variant == "cub_1bit_sync20_int8":
        return "flat_1bit_sync20_int8", 1
    m = _NODE.match(variant)
    if m:
        return ("node_1bit_sync20_int8" if m.group("sync") else "node_1bit"), int(m.group("L"))
    return None


def convergence_rows(root: Path = ROOT) -> dict:
    """The planner's convergence table from the committed study summaries: per (family, N, L) the
    row with the most seeds (ties: the earlier study in :data:`STUDIES`)."""
    best, sources = {}, []
    for rel, study in STUDIES:
        recs = json.loads((root / rel).read_text())
        cfg = next(r for r in recs if r.get("bench") == "converge_config")
        params = next((r["params"] for r in recs if r.get("bench") == "converge"), None)
        sources.append({"study": study, "file": rel, "preset": cfg.get("preset"), "params": params,
                        "steps": cfg.get("steps"), "tie_break": cfg.get("tie_break"), "betas": cfg.get("betas")})
        for r in recs:
            if r.get("bench") != "converge_summary":
                continue
            fam = family_of(r["variant"])
            if fam is None or any(isinstance(r.get(k), float) and math.isnan(r[k]) for k in ("ci_lo_pct", "ci_hi_pct")):
                continue
            key = (fam[0], r["world_size"], fam[1])
            row = {"family": fam[0], "world_size": r["world_size"], "node_size": fam[1], "variant": r["variant"],
                   "gap_pct": round(r["gap_pct"], 3), "ci_lo_pct": round(r["ci_lo_pct"], 3),
                   "ci_hi_pct": round(r["ci_hi_pct"], 3), "seeds": len(r["seeds"]), "study": study,
                   "bytes_ratio_vs_fp32": round(r["bytes_ratio_vs_fp32"], 2)}
            if key not in best or row["seeds"] > best[key]["seeds"]:
                best[key] = row
    rows = sorted(best.values(), key=lambda r: (r["family"], r["node_size"], r["world_size"]))
    return {"generated_by": "python -m benchmarks plan_check --write-convergence-table",
            "what": "paired gap of the final validation loss to global Lion (all-reduced gradients), % with a 95% "
                    "t-interval over seeds, from bench converge's simulation of LionCub (bit-identical to real "
                    "ranks); a small GPT on the pinned corpus: see each study's protocol",
            "sources": sources, "rows": rows}


def write_convergence_table(path: Path = TABLE_PATH, root: Path = ROOT) -> dict:
    table = convergence_rows(root)
    path.write_text(json.dumps(table, indent=1) + "\n")
    return table


# ----------------------------------------------------------------------------- this machine's inputs
def host_link(samples: list[dict]) -> dict:
    """Per-message latency α and the host's copy rate (GB/s, all ranks together) from gloo loopback
    collectives: ``samples`` = [{kind, world_size, messages, bytes_sent, measured_s}, ...] (bench
    scaling's ``scaling_fit`` records). Each sample's bytes are summed over its ranks: on one host
    every byte any rank sends is copied by the same CPUs."""
    from lioncub_ds.comm.cost import CostModel

    model = CostModel.fit([(r["messages"], r["bytes_sent"] * r["world_size"], r["measured_s"]) for r in samples])
    return {"alpha_us": model.alpha_s * 1e6, "host_gbyte_s": 1.0 / model.beta_s_per_byte / 1e9,
            "samples": len(samples)}


def calibrate_now(world_sizes=(2, 4), sizes=(1 << 10, 1 << 14, 1 << 18, 1 << 21, 1 << 24), reps=5) -> list[dict]:
    """Fresh loopback samples (bench scaling's collectives only, no LionCub step)."""
    from lioncub_ds.comm.cost import CostModel

    from .common import run_ranks
    from .scaling import _calib_rank

    out = []
    for n in world_sizes:
        res = run_ranks(_calib_rank, n, list(sizes), reps, 0, 0)
        for i, (kind, nbytes, _) in enumerate(res[0]["samples"]):
            m, b = CostModel.collective_terms(kind, nbytes, n)
            out.append({"kind": kind, "world_size": n, "nbytes": nbytes, "messages": m, "bytes_sent": b,
                        "measured_s": max(r["samples"][i][2] for r in res)})
    return out


def bench_numels() -> tuple:
    """The trainable tensors of the netns benchmarks' model (the layout LionCub builds for it)."""
    from .models import build_model
    from .netns import MODEL

    model = build_model(MODEL["preset"], seed=0, n_layer=MODEL["n_layer"], d_model=MODEL["d_model"],
                        n_head=MODEL["n_head"], seq_len=32)
    return tuple(p.numel() for p in model.parameters() if p.requires_grad)


def machine(bench: str, bandwidth_gbit: float, floor: dict, link: dict):
    """(ClusterSpec, WorkloadSpec) of one run of ``bench`` at ``bandwidth_gbit``; ``floor``: its
    ``no_comm`` record (compute and update time), ``link``: :func:`host_link`."""
    from lioncub_ds.plan import ClusterSpec, WorkloadSpec

    nodes, per_node = RANKS[bench]
    if bench == "netns":  # one token bucket shared by every rank: R / N each when all send
        intra, inter = bandwidth_gbit / 8 / per_node, bandwidth_gbit
    else:  # unshaped loopbacks (bounded by the host's copies), the veth shaped per direction
        intra, inter = 1e6, bandwidth_gbit
    cluster = ClusterSpec(nodes=nodes, gpus_per_node=per_node, gpu_mem_gib=64, intra_gbyte_s=intra,
                          inter_gbit_s=inter, intra_latency_us=link["alpha_us"], inter_latency_us=link["alpha_us"],
                          host_gbyte_s=link["host_gbyte_s"], host_scope="machine", overlap=0.0, backend="gloo")
    work = WorkloadSpec(precision="fp32", tokens_per_gpu=int(floor.get("tokens_per_rank") or 32),
                        compute_time_s=floor["compute_time_s"], update_time_s=floor["kernel_time_s"])
    return cluster, work


def compare(measured: dict, link: dict, numels: tuple) -> list[dict]:
    """One record per (bench, bandwidth, variant) that is a planner strategy."""
    from lioncub_ds.plan import ModelSpec, Topology, evaluate

    model = ModelSpec(param_numels=numels)
    out = []
    for bench, recs in measured.items():
        for bw in sorted({r["bandwidth_gbit"] for r in recs}):
            run = {r["variant"]: r for r in recs if r["bandwidth_gbit"] == bw and r.get("step_time_s")}
            if "no_comm" not in run:
                continue
            cluster, work = machine(bench, bw, run["no_comm"], link)
            top = Topology.of(cluster, work)
            for variant, strat in PAIRS[bench].items():
                if variant not in run:
                    continue
                m = run[variant]
                p = evaluate(strat, model, cluster, work, top, sync_every=None)
                err = 100.0 * (p["step_time_s"] / m["step_time_s"] - 1.0)
                out.append({"bench": NAME, "measured_in": bench, "bandwidth_gbit": bw, "variant": variant,
                            "strategy": strat, "measured_step_s": m["step_time_s"],
                            "predicted_step_s": p["step_time_s"], "error_pct": err,
                            "within_band": abs(err) <= BAND_PCT,
                            "measured_comm_s": m.get("comm_time_s"), "predicted_comm_s": p["exposed_comm_overlap_s"],
                            "measured_kernel_s": m.get("kernel_time_s"), "predicted_update_s": p["update_time_s"],
                            "compute_s": p["compute_time_s"], "predicted_bytes_per_rank": p["bytes_per_gpu"],
                            "measured_bytes_per_rank": m.get("bytes_per_rank", m.get("formula_bytes_per_rank")),
                            "predicted_inter_node_bytes_per_rank": (p["inter_node_bytes_per_node"] / RANKS[bench][1]
                                                                    if bench == "netns_nodes" else None),
                            "measured_inter_node_bytes_per_rank": m.get("inter_node_bytes_per_rank"),
                            "bound": ", ".join(sorted({c["bound"] for c in p["collectives"]}))})
    return out


def rerun(steps: int, out_dir: str) -> dict:
    """Run bench netns and bench netns_nodes now (as root); their records by bench."""
    from . import netns, netns_nodes

    got = {}
    for mod, bench in ((netns, "netns"), (netns_nodes, "netns_nodes")):
        path = os.path.join(out_dir, f"{bench}.json")
        argv = ["--json", path, "--steps", str(steps)]
        if bench == "netns":
            argv += ["--variants", "no_comm", *PAIRS["netns"]]
        rc = mod.main(argv)
        if rc:
            raise RuntimeError(f"bench {bench} failed (exit {rc})")
        got[bench] = json.loads(Path(path).read_text())
    return got


# ----------------------------------------------------------------------------- main
COLUMNS = [("measured_in", "bench"), ("bandwidth_gbit", "Gbit/s", "g"), ("variant", "variant"),
           ("strategy", "planner strategy"), ("measured_step_s", "measured s", ".3f"),
           ("predicted_step_s", "predicted s", ".3f"), ("error_pct", "error %", "+.1f"),
           ("measured_comm_s", "meas. comm s", ".3f"), ("predicted_comm_s", "pred. comm s", ".3f"),
           ("measured_kernel_s", "meas. update s", ".3f"), ("predicted_update_s", "pred. update s", ".3f")]


def build_parser():
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {NAME}", description=__doc__.split("\n\n")[0])
    p.add_argument("--netns", default=str(ROOT / "docs" / "netns.json"), help="bench netns records")
    p.add_argument("--netns-nodes", default=str(ROOT / "docs" / "netns_nodes.json"), help="bench netns_nodes records")
    p.add_argument("--scaling", default=str(ROOT / "docs" / "scaling.json"),
                   help="bench scaling records whose scaling_fit samples calibrate the host's copies")
    p.add_argument("--calibrate", action="store_true", help="measure the loopback samples now instead")
    p.add_argument("--rerun", action="store_true", help="run bench netns and netns_nodes now (as root)")
    p.add_argument("--steps", type=int, default=8, help="measured rounds of each benchmark with --rerun")
    p.add_argument("--write-convergence-table", action="store_true",
                   help=f"regenerate {TABLE_PATH.relative_to(ROOT)} from the committed studies and exit")
    add_output_args(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.write_convergence_table:
        table = write_convergence_table()
        print(f"[bench {NAME}] wrote {len(table['rows'])} rows to {TABLE_PATH}")
        return 0
    t0 = time.perf_counter()
    if args.calibrate:
        samples = calibrate_now()
        source = "measured now (bench scaling's loopback collectives)"
    else:
        samples = [r for r in json.loads(Path(args.scaling).read_text()) if r.get("bench") == "scaling_fit"]
        source = args.scaling
    link = host_link(samples)
    print(f"[bench {NAME}] host link from {len(samples)} gloo loopback samples ({source}): "
          f"α = {link['alpha_us']:.0f} µs per message, host copies {link['host_gbyte_s']:.2f} GB/s (all ranks)")
    if args.rerun:
        with tempfile.TemporaryDirectory(prefix="lioncub_plan_check_") as tmp:
            measured = rerun(args.steps, tmp)
        where = "measured now"
    else:
        measured = {"netns": json.loads(Path(args.netns).read_text()),
                    "netns_nodes": json.loads(Path(args.netns_nodes).read_text())}
        where = f"{args.netns}, {args.netns_nodes}"
    recs = compare(measured, link, bench_numels())
    for r in recs:
        r.update(alpha_us=link["alpha_us"], host_gbyte_s=link["host_gbyte_s"], calibration=source,
                 measurements=where)
    print_table(recs, COLUMNS, title=f"[bench {NAME}] predicted (lioncub_ds.plan) vs measured step time "
                                     f"(measurements: {where}); band ±{BAND_PCT:g}%")
    worst = max(recs, key=lambda r: abs(r["error_pct"])) if recs else None
    inside = sum(r["within_band"] for r in recs)
    if worst:
        print(f"[bench {NAME}] {inside} of {len(recs)} within ±{BAND_PCT:g}%; worst {worst['error_pct']:+.1f}% "
              f"({worst['measured_in']} {worst['bandwidth_gbit']:g} Gbit/s {worst['variant']}); "
              f"{time.perf_counter() - t0:.1f} s")
    summary = {"bench": f"{NAME}_summary", "within_band": inside, "rows": len(recs), "band_pct": BAND_PCT,
               "max_abs_error_pct": abs(worst["error_pct"]) if worst else None, **link, "calibration": source,
               "measurements": where}
    finish(NAME, args, recs + [summary])
    return 0


if __name__ == "__main__":
    sys.exit(main())
