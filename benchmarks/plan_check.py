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

# The convergence study the planner quotes: the chosen preset's (docs/convergence.md), never a
# superseded one. A (configuration, N, L) takes the row of the first study listed that has it; new
# world sizes and node sizes in the study's JSON (e.g. N = 64) are picked up by
# --write-convergence-table without a change here.
STUDIES = (("docs/lion_w300/converge.json", "lion_w300"),)
# converge variants the planner offers: 1bit votes, flat or node voters of L, an int8 momentum sync every K or none
_VARIANT = re.compile(r"^cub_1bit(?:_sync(?P<every>[0-9]+)_int8)?(?:_node(?P<L>[0-9]+))?$")

# measured variant -> (planner strategy, LionCub's momentum sync period in that run)
PAIRS = {"netns": {"ddp_lion_bf16": "ddp_bf16", "lion_bf16_allreduce": "ddp_bf16",
                   "lioncub_1bit": "lioncub_1bit_sync20", "lioncub_1bit_overlap": "lioncub_1bit_sync20"},
         "netns_nodes": {"ddp_lion_bf16": "ddp_bf16", "two_level_bf16": "megatron_distopt_kN",
                         "lioncub_1bit": "lioncub_1bit_sync20", "lioncub_1bit_node": "lioncub_node_voters_sync20"}}
RANKS = {"netns": (1, 4), "netns_nodes": (2, 2)}  # (nodes, ranks per node)


# ----------------------------------------------------------------------------- convergence table
def family_of(variant: str):
    """(family, L) of a converge variant the planner quotes, or None: ``cub_1bit_sync20_int8_node4`` ->
    ("node_1bit_sync20_int8", 4), ``cub_1bit`` -> ("flat_1bit", 1)."""
    m = _VARIANT.match(variant)
    if m is None:
        return None
    family = ("node" if m["L"] else "flat") + "_1bit" + (f"_sync{m['every']}_int8" if m["every"] else "")
    return family, int(m["L"] or 1)


def convergence_rows(root: Path = ROOT) -> dict:
    """The planner's convergence table from the committed study summaries: per (family, N, L) the
    row of the first study in :data:`STUDIES` that has it."""
    from .converge import GOAL_GAP_PCT  # (torch: only here, the planner's other checks do not need it)

    best, sources = {}, []
    for rel, study in STUDIES:
        recs = json.loads((root / rel).read_text())
        cfg = next(r for r in recs if r.get("bench") == "converge_config" and r.get("protocol") == study)
        params = next((r["params"] for r in recs if r.get("bench") == "converge"), None)
        sources.append({"study": study, "file": rel, "preset": cfg.get("protocol"), "model": cfg.get("preset"),
                        "params": params, "steps": cfg.get("steps"), "tie_break": cfg.get("tie_break"),
                        "betas": cfg.get("betas")})
        for r in recs:
            if r.get("bench") != "converge_summary":
                continue
            fam = family_of(r["variant"])
            if fam is None or any(isinstance(r.get(k), float) and math.isnan(r[k]) for k in ("ci_lo_pct", "ci_hi_pct")):
                continue
            key = (fam[0], r["world_size"], fam[1])
            row = {"family": fam[0], "world_size": r["world_size"], "node_size": fam[1],
                   "voters": r["world_size"] // fam[1], "variant": r["variant"],
                   # as the study has them: the planner rounds once, when it prints
                   "gap_pct": r["gap_pct"], "ci_lo_pct": r["ci_lo_pct"], "ci_hi_pct": r["ci_hi_pct"],
                   "seeds": len(r["seeds"]), "study": study,
                   "preset": cfg.get("protocol"), "bytes_ratio_vs_fp32": round(r["bytes_ratio_vs_fp32"], 2)}
            best.setdefault(key, row)
    rows = sorted(best.values(), key=lambda r: (r["family"], r["node_size"], r["world_size"]))
    return {"generated_by": "python -m benchmarks plan_check --write-convergence-table",
            "what": "paired gap of the final validation loss to global Lion (all-reduced gradients), % with a 95% "
                    "t-interval over seeds, from bench converge's simulation of LionCub (bit-identical to real "
                    "ranks); a small GPT on the pinned corpus: see each study's protocol",
            "goal_gap_pct": GOAL_GAP_PCT, "sources": sources, "rows": rows}


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



# ----------------------------------------------------------------------------- the veth's real rate
PROBE_BYTES = 128 * 2**20  # per direction: ~1 s at 1 Gbit/s, long enough for TCP to settle behind the tbf


def _tcp_recv(addr: str, port: int, nbytes: int) -> None:
    """Receive ``nbytes`` on ``addr:port``; print the wall-clock times of the first and last byte."""
    import socket

    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port))
    srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    buf = memoryview(bytearray(1 << 20))
    got, first = 0, None
    while got < nbytes:
        k = conn.recv_into(buf)
        if not k:
            break
        first = first or time.time()
        got += k
    print(json.dumps({"bytes": got, "first": first, "last": time.time()}), flush=True)


def _tcp_send(addr: str, port: int, nbytes: int) -> None:
    import socket

    conn = socket.create_connection((addr, port))
    chunk, sent = bytes(1 << 20), 0
    while sent < nbytes:
        conn.sendall(chunk)
        sent += len(chunk)
    conn.close()


def _streams(pairs, nbytes: int) -> float:
    """TCP streams at once, ``pairs`` = [(receiver's namespace, address, port, sender's namespace)];
    Gbit/s per stream: all bytes over the window from the first byte to the last, / streams."""
    import subprocess

    from .netns import child_env

    me = [sys.executable, "-m", "benchmarks.plan_check"]
    recv = [subprocess.Popen(["ip", "netns", "exec", ns, *me, "--tcp-recv", f"{addr}|{port}|{nbytes}"],
                             stdout=subprocess.PIPE, text=True, env=child_env()) for ns, addr, port, _ in pairs]
    for r in recv:
        if r.stdout.readline().strip() != "ready":
            raise RuntimeError("link probe: a receiver did not start")
    send = [subprocess.Popen(["ip", "netns", "exec", ns, *me, "--tcp-send", f"{addr}|{port}|{nbytes}"],
                             env=child_env()) for _, addr, port, ns in pairs]
    for p in send:
        p.wait(timeout=600)
    got = [json.loads(r.communicate(timeout=600)[0].strip().splitlines()[-1]) for r in recv]
    window = max(g["last"] for g in got) - min(g["first"] for g in got)
    return sum(g["bytes"] for g in got) * 8 / window / 1e9 / len(pairs)


def probe_links(bandwidths=(1.0, 10.0), nbytes: int = PROBE_BYTES) -> list[dict]:
    """The veth's real rate, as root: two namespaces joined by a veth pair shaped per direction
    exactly as in ``bench netns_nodes``, one plain TCP stream each way at once (python sockets, 1 MB
    writes: no gloo, no optimizer, no variant of the check). The namespaces are deleted at the end.
    (The loopbacks need no probe: an unshaped one is bounded by the host's copies, which the gloo
    calibration measures, and a shaped one by its token bucket.)"""
    from .netns import _sh, delete_namespace, preflight
    from .netns_nodes import QDISC

    why = preflight(NAME, "network namespaces and a veth pair, and shapes them with tc")
    if why:
        raise PermissionError(why)
    tag = f"{os.getpid()}-{os.urandom(3).hex()}"
    a, b = (f"lioncub-probe-{tag}-{c}" for c in "ab")
    ifs, addrs = ("lcp-a", "lcp-b"), ("10.79.0.1", "10.79.0.2")
    out = []
    try:
        for ns in (a, b):
            _sh(["ip", "netns", "add", ns])
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        _sh(["ip", "link", "add", ifs[0], "netns", a, "type", "veth", "peer", "name", ifs[1], "netns", b])
        for ns, ifname, addr in zip((a, b), ifs, addrs):
            _sh(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", ifname])
            _sh(["ip", "-n", ns, "link", "set", ifname, "up"])
        for i, bw in enumerate(bandwidths):
            for ns, ifname in zip((a, b), ifs):
                _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", ifname, "root",
                     *QDISC.format(rate=f"{bw:g}gbit").split()])
            veth = _streams([(b, addrs[1], 29700 + 2 * i, a), (a, addrs[0], 29701 + 2 * i, b)], nbytes)
            out.append({"bench": f"{NAME}_link", "bandwidth_gbit": bw, "veth_gbit_per_direction": veth,
                        "stream_bytes": nbytes, "loadavg_1m": round(os.getloadavg()[0], 2),
                        "method": "one TCP stream each way at once over the veth shaped as in bench netns_nodes "
                                  "(python sockets, 1 MB writes)"})
            print(f"[bench {NAME}] veth behind a {bw:g} Gbit/s tbf: {veth:.2f} Gbit/s each way (plain TCP, both "
                  "ways at once)", flush=True)
    finally:
        for ns in (a, b):
            delete_namespace(ns, NAME, verbose=False)
    return out


def bench_numels() -> tuple:
    """The trainable tensors of the netns benchmarks' model (the layout LionCub builds for it)."""
    from .models import build_model
    from .netns import MODEL

    model = build_model(MODEL["preset"], seed=0, n_layer=MODEL["n_layer"], d_model=MODEL["d_model"],
                        n_head=MODEL["n_head"], seq_len=32)
    return tuple(p.numel() for p in model.parameters() if p.requires_grad)


def machine(bench: str, bandwidth_gbit: float, floor: dict, link: dict, rates: dict | None = None):
    """(ClusterSpec, WorkloadSpec) of one run of ``bench`` at ``bandwidth_gbit``; ``floor``: its
    ``no_comm`` record (compute and update time), ``link``: :func:`host_link`; ``rates``: the
    :func:`probe_links` record of this qdisc rate (None: the nominal rate)."""
    from lioncub_ds.plan import ClusterSpec, WorkloadSpec

    nodes, per_node = RANKS[bench]
    if bench == "netns":  # one token bucket shared by every rank: R / N each when all send
        intra, inter = bandwidth_gbit / 8 / per_node, bandwidth_gbit
    else:  # unshaped loopbacks (bounded by the host's copies), the veth shaped per direction
        intra, inter = 1e6, min(bandwidth_gbit, rates["veth_gbit_per_direction"]) if rates else bandwidth_gbit
    cluster = ClusterSpec(nodes=nodes, gpus_per_node=per_node, gpu_mem_gib=64, intra_gbyte_s=intra,
                          inter_gbit_s=inter, intra_latency_us=link["alpha_us"], inter_latency_us=link["alpha_us"],
                          host_gbyte_s=link["host_gbyte_s"], host_scope="machine", overlap=0.0, backend="gloo")
    work = WorkloadSpec(precision="fp32", tokens_per_gpu=int(floor.get("tokens_per_rank") or 32),
                        compute_time_s=floor["compute_time_s"], update_time_s=floor["kernel_time_s"])
    return cluster, work


def compare(measured: dict, link: dict, numels: tuple, probes: list[dict] | None = None) -> list[dict]:
    """One record per (bench, bandwidth, variant) that is a planner strategy; ``probes``: the links'
    measured rates (:func:`probe_links`; None: nominal)."""
    from lioncub_ds.plan import ModelSpec, Topology, evaluate

    model = ModelSpec(param_numels=numels)
    out = []
    for bench, recs in measured.items():
        for bw in sorted({r["bandwidth_gbit"] for r in recs}):
            run = {r["variant"]: r for r in recs if r["bandwidth_gbit"] == bw and r.get("step_time_s")}
            if "no_comm" not in run:
                continue
            rates = next((r for r in probes or [] if r["bandwidth_gbit"] == bw), None)
            cluster, work = machine(bench, bw, run["no_comm"], link, rates)
            top = Topology.of(cluster, work)
            for variant, strat in PAIRS[bench].items():
                if variant not in run:
                    continue
                m = run[variant]
                p = evaluate(strat, model, cluster, work, top, sync_every=None)
                err = 100.0 * (p["step_time_s"] / m["step_time_s"] - 1.0)
                out.append({"bench": NAME, "measured_in": bench, "bandwidth_gbit": bw, "variant": variant,
                            "veth_gbit_used": cluster.inter_gbit_s if bench == "netns_nodes" else None,
                            "veth_rate": ("measured" if rates else "nominal") if bench == "netns_nodes" else None,
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



# ----------------------------------------------------------------------------- the docs' cluster table
# Published link figures (docs/planner.md cites them): nccl-tests all_reduce busbw on 8 x H100 SXM
# NVLink 460-480 GB/s; multi-node H100 with 8 x 400 Gbit/s NDR InfiniBand 400-450 GB/s (~ the line rate).
NVLINK_GBYTE = 450.0
GRID_MODELS = {  # name: (ModelSpec kwargs, tp, pp, tokens per GPU per step)
    "GPT 1.3B": (dict(layers=24, hidden=2048, vocab=50257, seq=2048), 1, 1, 16384),
    "GPT 7B": (dict(layers=32, hidden=4096, vocab=50257, seq=2048), 1, 1, 16384),
    "GPT 70B": (dict(params=70_000_000_000, layers=80, hidden=8192, vocab=50257, seq=2048), 8, 2, 4096),
}
GRID_CLUSTERS = ((2, 8), (8, 8), (64, 8))
GRID_LINKS = (25.0, 100.0, 400.0)
# how sensitive the conclusion is to the link figures and the workload (each changes one input)
SENSITIVITY = {"inter-node at 50% of its rate": dict(inter_factor=0.5),
               "NVLink busbw 360 GB/s (80%)": dict(intra=360.0),
               "4x the latencies": dict(latency_factor=4.0),
               "1/4 of the tokens per GPU": dict(tokens_factor=0.25)}


def grid_cell(name, nodes, gbit, inter_factor=1.0, intra=NVLINK_GBYTE, latency_factor=1.0, tokens_factor=1.0):
    from lioncub_ds.plan import ClusterSpec, ModelSpec, WorkloadSpec, plan

    kw, tp, pp, tokens = GRID_MODELS[name]
    cluster = ClusterSpec(nodes=nodes, gpus_per_node=8, gpu_mem_gib=80, intra_gbyte_s=intra,
                          inter_gbit_s=gbit * inter_factor, intra_latency_us=5 * latency_factor,
                          inter_latency_us=10 * latency_factor, hbm_gbyte_s=3000)
    work = WorkloadSpec(precision="bf16", tokens_per_gpu=int(tokens * tokens_factor), mfu=0.4, peak_tflops=989,
                        tp=tp, pp=pp)
    return plan(ModelSpec(**kw), cluster, work)


def _summary(res) -> dict:
    from lioncub_ds.plan import EXACT

    fit = [r for r in res["strategies"] if r["fits"]]
    exact = min((r for r in fit if r["name"] in EXACT), key=lambda r: r["step_time_s"], default=None)
    cub = min((r for r in fit if r["name"] not in EXACT), key=lambda r: r["step_time_s"], default=None)
    return {"best_exact": exact and exact["name"], "best_exact_step_s": exact and exact["step_time_s"],
            "best_lioncub": cub and cub["name"], "best_lioncub_step_s": cub and cub["step_time_s"],
            "speedup": (exact["step_time_s"] / cub["step_time_s"]) if exact and cub else None,
            "recommended": res["recommendation"]["name"],
            "convergence": cub["convergence"]["text"] if cub else None,
            "data_parallel": res["inputs"]["data_parallel"]}


SHORT = {"ddp_bf16": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "megatron_distopt_k1": "Megatron distopt K=1",
         "megatron_distopt_kN": "Megatron distopt K=nodes", "lioncub_1bit_sync20": "LionCub flat + sync",
         "lioncub_master_only": "LionCub master-only + sync", "lioncub_node_voters_sync20": "LionCub node voters + sync",
         "zero3": "ZeRO-3", "fsdp2_hsdp": "FSDP2 HSDP", "lioncub_zero3_node_voters_sync20": "ZeRO-3 + LionCub votes",
         "lioncub_fsdp2_node_voters_sync20": "FSDP2 + LionCub votes"}


def grid_markdown(recs: list[dict]) -> str:
    """docs/planner.md's table: per cell the fastest exact and LionCub strategies, the speedup, the
    pick, and the speedup's range over :data:`SENSITIVITY` with how often the pick's kind (exact or
    LionCub) stays."""
    from lioncub_ds.plan import EXACT

    lines = ["| model (TP × PP) | nodes × 8 H100 | Gbit/s per node | DP | fastest exact: step s | fastest LionCub: "
             "step s | LionCub speedup | pick | speedup over the 4 variations [min, max]; same kind of pick |",
             "|---|---:|---:|---:|---|---|---:|---|---|"]
    for r in recs:
        _, tp, pp, _ = GRID_MODELS[r["model"]]
        sp = [r["speedup"]] + [v["speedup"] for v in r["sensitivity"].values() if v["speedup"]]
        kind = r["recommended"] in EXACT
        same = sum((v["recommended"] in EXACT) == kind for v in r["sensitivity"].values())
        lines.append(f"| {r['model']} ({tp} × {pp}) | {r['nodes']} | {r['inter_node_gbit']:g} | {r['data_parallel']} | "
                     f"{SHORT[r['best_exact']]}: {r['best_exact_step_s']:.2f} | {SHORT[r['best_lioncub']]}: "
                     f"{r['best_lioncub_step_s']:.2f} | {r['speedup']:.2f}x | {SHORT[r['recommended']]} | "
                     f"[{min(sp):.2f}, {max(sp):.2f}]; {same}/{len(r['sensitivity'])} |")
    return "\n".join(lines)


def cluster_grid() -> list[dict]:
    """The predictions of docs/planner.md's cluster table, with their sensitivity."""
    out = []
    for name in GRID_MODELS:
        for nodes, gpus in GRID_CLUSTERS:
            for gbit in GRID_LINKS:
                base = grid_cell(name, nodes, gbit)
                rec = {"bench": f"{NAME}_grid", "model": name, "nodes": nodes, "gpus_per_node": gpus,
                       "inter_node_gbit": gbit, "intra_node_gbyte": NVLINK_GBYTE, **_summary(base),
                       "strategies": {r["name"]: {"step_time_s": r["step_time_s"], "fits": r["fits"],
                                                  "tokens_per_s": r["tokens_per_s"],
                                                  "inter_node_bytes_per_node": r["inter_node_bytes_per_node"],
                                                  "model_state_bytes_per_gpu": r["model_state_bytes_per_gpu"]}
                                      for r in base["strategies"]}}
                sens = {}
                for label, kw in SENSITIVITY.items():
                    s = _summary(grid_cell(name, nodes, gbit, **kw))
                    sens[label] = {"recommended": s["recommended"], "speedup": s["speedup"]}
                rec["sensitivity"] = sens
                out.append(rec)
    return out

def check_markdown(recs: list[dict]) -> str:
    """The error table of docs/planner.md."""
    lines = ["| measured in | Gbit/s | variant | planner strategy | measured step s | predicted s | error | "
             "predicted comm s (measured) | predicted update s (measured) |", "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in recs:
        if r.get("bench") != NAME:
            continue
        lines.append(f"| `{r['measured_in']}` | {r['bandwidth_gbit']:g} | `{r['variant']}` | `{r['strategy']}` | "
                     f"{r['measured_step_s']:.3f} | {r['predicted_step_s']:.3f} | {r['error_pct']:+.1f}% | "
                     f"{r['predicted_comm_s']:.3f} ({r['measured_comm_s']:.3f}) | "
                     f"{r['predicted_update_s']:.3f} ({r['measured_kernel_s']:.3f}) |")
    return "\n".join(lines)


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
    p.add_argument("--probe", action="store_true",
                   help="measure the veth's real rate now (plain TCP across it, as root) and predict "
                        "bench netns_nodes with it instead of the nominal qdisc rate")
    p.add_argument("--links", default=None, help="a plan_check JSON whose plan_check_link records give the rates")
    p.add_argument("--tcp-recv", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tcp-send", default=None, help=argparse.SUPPRESS)
    p.add_argument("--grid", action="store_true",
                   help="write the docs' cluster table (predictions for GPT 1.3B/7B/70B on 2/8/64 x 8 H100s) and exit")
    p.add_argument("--write-convergence-table", action="store_true",
                   help=f"regenerate {TABLE_PATH.relative_to(ROOT)} from the committed studies and exit")
    add_output_args(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.tcp_recv or args.tcp_send:  # one end of a probe stream, inside a namespace
        addr, port, nbytes = (args.tcp_recv or args.tcp_send).split("|")
        (_tcp_recv if args.tcp_recv else _tcp_send)(addr, int(port), int(nbytes))
        return 0
    if args.write_convergence_table:
        table = write_convergence_table()
        print(f"[bench {NAME}] wrote {len(table['rows'])} rows to {TABLE_PATH}")
        return 0
    if args.grid:
        recs = cluster_grid()
        print_table(recs, [("model", "model"), ("nodes", "nodes"), ("inter_node_gbit", "Gbit/s/node", "g"),
                           ("data_parallel", "DP"), ("best_exact", "fastest exact"),
                           ("best_exact_step_s", "step s", ".3f"), ("best_lioncub", "fastest LionCub"),
                           ("best_lioncub_step_s", "step s", ".3f"), ("speedup", "speedup", ".2f"),
                           ("recommended", "recommended")],
                    title=f"[bench {NAME}] PREDICTIONS (lioncub_ds.plan) for 8 x H100 nodes, NVLink {NVLINK_GBYTE:g} GB/s")
        print(grid_markdown(recs))
        finish(NAME, args, recs)
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
        where = "measured now (bench netns, bench netns_nodes; their records are in this file)"
    else:
        measured = {"netns": json.loads(Path(args.netns).read_text()),
                    "netns_nodes": json.loads(Path(args.netns_nodes).read_text())}
        where = f"{args.netns}, {args.netns_nodes}"
    probes = None
    if args.probe:
        probes = probe_links()
    elif args.links:
        probes = [r for r in json.loads(Path(args.links).read_text()) if r.get("bench") == f"{NAME}_link"]
    recs = compare(measured, link, bench_numels(), probes)
    for r in recs:
        r.update(alpha_us=link["alpha_us"], host_gbyte_s=link["host_gbyte_s"], calibration=source,
                 measurements=where)
    print_table(recs, COLUMNS, title=f"[bench {NAME}] predicted (lioncub_ds.plan) vs measured step time "
                                     f"(measurements: {where}); band ±{BAND_PCT:g}%")
    print(check_markdown(recs))
    worst = max(recs, key=lambda r: abs(r["error_pct"])) if recs else None
    inside = sum(r["within_band"] for r in recs)
    if worst:
        print(f"[bench {NAME}] {inside} of {len(recs)} within ±{BAND_PCT:g}%; worst {worst['error_pct']:+.1f}% "
              f"({worst['measured_in']} {worst['bandwidth_gbit']:g} Gbit/s {worst['variant']}); "
              f"{time.perf_counter() - t0:.1f} s")
    summary = {"bench": f"{NAME}_summary", "within_band": inside, "rows": len(recs), "band_pct": BAND_PCT,
               "max_abs_error_pct": abs(worst["error_pct"]) if worst else None, **link, "calibration": source,
               "measurements": where}
    summary["veth_rate"] = "measured (link probe)" if probes else "nominal (the qdisc rate)"
    raw = [dict(r, bench=f"{NAME}_measured_{r.get('bench', '')}") for recs_ in measured.values() for r in recs_] \
        if args.rerun else []
    finish(NAME, args, recs + (probes or []) + raw + [summary])
    return 0


if __name__ == "__main__":
    sys.exit(main())
