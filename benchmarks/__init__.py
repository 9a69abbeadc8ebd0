"""Benchmarks: ``python -m benchmarks <name> [args]`` (``all`` runs every one).

Each entry of :data:`BENCHMARKS` maps a name to a module exposing ``build_parser()`` and
``main(argv=None) -> int``. Every benchmark accepts ``--json PATH`` (a JSON list of flat records)
and ``--out DIR`` (plots, and ``DIR/<name>.json`` when ``--json`` is not given), so that
``all --out DIR`` can run them in turn. Adding a benchmark is one line here.
"""
from __future__ import annotations

BENCHMARKS: dict[str, str] = {
    "kernels": "benchmarks.kernels",    # fused C++ kernels vs unfused torch vs the copy floor
    "comm": "benchmarks.comm",          # wire bytes per rank per step, by algorithm
    "netns": "benchmarks.netns",        # step time on a rate-limited loopback (network namespace)
    "netns_nodes": "benchmarks.netns_nodes",  # 2 namespaces (nodes) joined by a shaped veth pair
    "converge": "benchmarks.converge",  # validation loss of a small GPT, per optimizer
    "scaling": "benchmarks.scaling",    # alpha-beta model: predicted comm time vs world size
    "zero": "benchmarks.zero",          # ZeRO-1 sign all-gather vs DeepSpeed's parameter all-gather
    "offload": "benchmarks.offload",    # the offloaded CPU step: LionCub vs DeepSpeed's CPU Lion / Adam
    "startup": "benchmarks.startup",    # interpreter start-up with / without the DeepSpeed .pth hook
    "plan_check": "benchmarks.plan_check",  # lioncub_ds.plan's predicted step times vs netns / netns_nodes
    "big_step": "benchmarks.big_step",  # one optimizer step over a 1.3B GPT: Lion, AdamW, Triton Lion, LionCub N=8
}
