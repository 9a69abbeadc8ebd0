"""Benchmarks: ``python -m lioncub_ds.bench <name> [args]`` (``all`` runs every one).

Each entry of :data:`BENCHMARKS` maps a name to a module exposing ``build_parser()`` and
``main(argv=None) -> int``. Every benchmark accepts ``--json PATH`` (a JSON list of flat records)
and ``--out DIR`` (plots, and ``DIR/<name>.json`` when ``--json`` is not given), so that
``all --out DIR`` can run them in turn. Adding a benchmark is one line here.
"""
from __future__ import annotations

BENCHMARKS: dict[str, str] = {
    "kernels": "lioncub_ds.bench.kernels",    # fused C++ kernels vs unfused torch vs the copy floor
    "comm": "lioncub_ds.bench.comm",          # wire bytes per rank per step, by algorithm
    "netns": "lioncub_ds.bench.netns",        # step time on a rate-limited loopback (network namespace)
    "netns_nodes": "lioncub_ds.bench.netns_nodes",  # 2 namespaces (nodes) joined by a shaped veth pair
    "converge": "lioncub_ds.bench.converge",  # validation loss of a small GPT, per optimizer
    "scaling": "lioncub_ds.bench.scaling",    # alpha-beta model: predicted comm time vs world size
    "zero": "lioncub_ds.bench.zero",          # ZeRO-1 sign all-gather vs DeepSpeed's parameter all-gather
    "startup": "lioncub_ds.bench.startup",    # interpreter start-up with / without the DeepSpeed .pth hook
}
