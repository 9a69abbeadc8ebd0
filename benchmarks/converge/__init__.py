"""``python -m benchmarks converge``: does Lion Cub train as well as Lion? (docs/results.md)

A small byte-level GPT trained on the **pinned corpus** (the Python sources of
``deepspeed==0.19.8`` + ``megatron-core==0.16.1``, checked by SHA-256; ``--data stdlib``
for CPython's standard library) by **N simulated data-parallel workers in one process**:

* every worker i draws its own batch from its own shard of the training split
  (``TextDataset.get_batch(..., rank=i, world_size=N, step, seed)``: exactly what rank i of
  a real run draws), and computes its own gradient on the shared parameters (the replicas
  of a Lion Cub run are bit-identical, so one copy is enough);
* the optimizer math of each variant is run over the N gradients: per-worker momenta,
  the vote of the chosen ``comm``/``vote``/``quant``/``tie_break`` with LionCub's own codec
  functions (:mod:`lioncub_ds.kernels.reference`), the same bucket layout and tie indices, the
  momentum-sync policy of :mod:`lioncub_ds.momentum_sync`. ``tests/test_converge.py``
  checks that the simulation gives bit-identical parameters and the same bytes as the real
  multi-rank :class:`~lioncub_ds.LionCub` on gloo ranks;
* bytes are what one rank sends over the run, mirroring LionCub's telemetry (votes, the
  step flags (carried or all-reduced), momentum syncs), and 2·(N−1)/N·4·P per step for the
  all-reduced baselines;
* node voters (``voters="node"``, SPEC §7; variants ``*_nodeL``): the N workers are Nn = N/L
  groups of L consecutive workers; each group's gradients are averaged as the real step's
  reduce-scatter does (summed in worker order, one add at a time, then divided by L) and the
  Nn group means vote. Bytes are split as LionCub's ``comm_stats()["by_scope"]``: the records'
  ``bytes_per_rank`` is the inter-node traffic (votes over Nn voters on shards of 1/L of each
  bucket, the flags, momentum syncs), ``intra_node_bytes_per_rank`` the node group's
  reduce-scatter, all-gather and flag all-reduce.

Protocol: the same seed, init, data order, lr schedule and steps for every variant (paired);
learning rates tuned per optimizer family on a separate seed (``--tune``); ≥5 seeds;
per N the mean paired gap to global Lion, 100·(L_v/L_lion − 1), with a 95% t-interval over
seeds. The same command gives the same numbers (single process, fixed thread count).

The package, one concern per module: :mod:`.variants` (the variants' specs, the protocols, a run's
settings), :mod:`.simulator` (the simulated LionCub), :mod:`.grads` (the N workers' gradients),
:mod:`.training` (one run), :mod:`.study` (tuning, the paired runs, resuming), :mod:`.records` (the
JSON / JSONL records: append, read, merge), :mod:`.stats` (paired gaps, intervals, tables),
:mod:`.plots` and :mod:`.cli`. The names below are the package's API (``benchmarks.converge.X``).
"""
from __future__ import annotations

from .cli import SETTING_FLAGS, apply_protocol, build_parser, main
from .grads import GRADS, WorkerGrads
from .plots import plot, plot_trend
from .records import NAME, append_jsonl, jsonl_records, merge, warn_unreadable
from .simulator import SimLionCub, bbit_feedback, bbit_residual
from .stats import (GOAL_GAP_PCT, SUMMARY_TABLE, best_lion_lr, check_goal, markdown_table, paired_gaps, summarize,
                    t_interval, t_quantile_975, trend, trend_axis, trend_table)
from .study import command_for, finished_runs, run, study_settings, tune
from .training import (HybridLionAdamW, build_model_for, build_variant, evaluate, grads_speed, lr_at,
                       real_lioncub_rank, train_one)
from .variants import (BASE_SETTINGS, DEFAULT_LR, DEFAULT_LR_GRID, DEFAULT_VARIANTS, FAMILIES, PRESET_KEYS, PROTOCOLS,
                       SMALL_LAYERS, VARIANTS, make_cfg, spec_of, warmup_of)

__all__ = ["SETTING_FLAGS", "apply_protocol", "build_parser", "main", "GRADS", "WorkerGrads", "plot", "plot_trend",
           "NAME", "append_jsonl", "jsonl_records", "merge", "warn_unreadable", "SimLionCub", "bbit_feedback",
           "bbit_residual", "GOAL_GAP_PCT", "SUMMARY_TABLE", "best_lion_lr", "check_goal", "markdown_table", "paired_gaps",
           "summarize", "t_interval", "t_quantile_975", "trend", "trend_axis", "trend_table", "command_for",
           "finished_runs", "run",
           "study_settings", "tune", "HybridLionAdamW", "build_model_for", "build_variant", "evaluate",
           "grads_speed", "lr_at", "real_lioncub_rank", "train_one", "BASE_SETTINGS", "DEFAULT_LR",
           "DEFAULT_LR_GRID", "DEFAULT_VARIANTS", "FAMILIES", "PRESET_KEYS", "PROTOCOLS", "SMALL_LAYERS", "VARIANTS",
           "make_cfg", "spec_of", "warmup_of"]
