"""One optimizer step over a GPT-sized model (~1.3B parameters, a few hundred tensors): the fused
single-process Lion against torch's fused AdamW, lion-pytorch's Triton Lion and LionCub's two kernel
halves at N = 8 (issue 46, item 5).

    python -m benchmarks.big_step                          # on a GPU: the 1.3B model (--scale full)
    python -m benchmarks.big_step --scale tiny --device cpu --json big_step.json   # the CPU dry run
    make gpu-check                                         # its big_step step runs the full size

The model: a GPT with tied embeddings, d_model 2048, 24 layers, vocab 50304, context 2048
(``--scale full``). Per layer: LayerNorm weight and bias twice, qkv [3d, d] + bias, proj [d, d] + bias,
fc [4d, d] + bias, fc2 [d, 4d] + bias; then wte [V, d], wpe [ctx, d] and the final LayerNorm:
12·L·d² + 13·L·d + V·d + ctx·d + 2·d = 1,315,819,520 parameters in 12·L + 4 = 292 tensors.
``--scale tiny`` (d_model 128, 2 layers, vocab 1024, context 128: 544,256 parameters, about 1 MB in
bf16) runs on CPU in seconds: the dry run of the same code path (tests/test_big_step.py).

Parameters and gradients are bf16 (random, fixed); each optimizer's state is built in turn, timed, and
freed before the next (``del`` + ``torch.cuda.empty_cache()``), so the peak is the largest one's, not
the sum. The optimizers and their state:

* ``lion_fused``: ``lioncub_ds.Lion`` on its fused path (``kernels.backend_for`` -> the loader's CUDA
  or C++ ``lion_step``, one call per step); momentum fp32 (its default ``momentum_dtype``).
* ``adamw_fused``: ``torch.optim.AdamW(fused=True)`` (on CPU: fused when this torch has it there,
  else its default); exp_avg and exp_avg_sq in the parameters' dtype (bf16), torch's rule.
* ``lion_pytorch_triton``: ``lion_pytorch.Lion(..., use_triton=True)`` (one Triton launch per
  parameter); exp_avg bf16 (``zeros_like(p)``). Skipped, with the reason, where triton or CUDA is
  missing (always on CPU).
* ``lioncub_N8``: the distributed step's kernel halves on one device, no communication: per bucket
  of the optimizer's layout (``layout.build_buckets``, bucket_size_mb 25, padded for N = 8) the local
  step (``backend.local_step``: this rank's packed sign votes, momenta untouched), this rank's plane
  copied into row 0 of an [8, P/8] buffer whose other 7 rows are fixed random votes (as if
  all-gathered; the tests also run it with 8 copies of this rank's row, where it must equal Lion),
  the apply of the 8 ranks' votes (``backend.vote_apply``, majority, hash tie-break, no abstentions),
  then the momentum update (``backend.momentum_update_list``): the optimizer's default two passes
  (momentum_double_buffer off). Momentum fp32. Not timed: the collectives, the abstention encoding
  and the step's one host read of its flags. The phases are timed apart too (``local_ms``,
  ``apply_ms``, ``momentum_ms``).

Timing: CUDA events around each step (the device's span, host launch gaps included), after
``--warmup`` steps, median of ``--reps``; on CPU the wall clock. ``host_ms`` is the median host time
of the step call (no synchronize). Every optimizer's first step is also checked: all parameters stay
finite, and the fraction of parameter elements that changed (``changed_frac``) is recorded. Records:
ms per step, ms per 1B parameters, the ratio to fused AdamW measured in the same run, the state's
GB and the peak GPU memory of its timed steps (``torch.cuda.max_memory_allocated``; ``peak_check_GB``:
with the first step's check, which holds a copy of the parameters).
"""
from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time

import torch

from .common import add_output_args, finish, print_table, write_json

PRESETS = {
    "full": dict(d_model=2048, layers=24, vocab=50304, ctx=2048, bucket_mb=25.0),
    "tiny": dict(d_model=128, layers=2, vocab=1024, ctx=128, bucket_mb=0.25),
}
OPTIMIZERS = ("lion_fused", "adamw_fused", "lioncub_N8", "lion_pytorch_triton")
LION_LR, ADAMW_LR, WEIGHT_DECAY, BETAS = 3e-4, 1e-3, 0.1, (0.9, 0.99)
PARAM_DTYPE = torch.bfloat16


# ----------------------------------------------------------------------------- the model's shapes
def gpt_shapes(d_model: int, layers: int, vocab: int, ctx: int) -> list[tuple[str, tuple]]:
    """(name, shape) of every parameter of a GPT with tied embeddings (GPT-2's layout)."""
    d = d_model
    shapes = [("wte.weight", (vocab, d)), ("wpe.weight", (ctx, d))]
    for i in range(layers):
        h = f"h.{i}."
        shapes += [(h + "ln_1.weight", (d,)), (h + "ln_1.bias", (d,)),
                   (h + "attn.qkv.weight", (3 * d, d)), (h + "attn.qkv.bias", (3 * d,)),
                   (h + "attn.proj.weight", (d, d)), (h + "attn.proj.bias", (d,)),
                   (h + "ln_2.weight", (d,)), (h + "ln_2.bias", (d,)),
                   (h + "mlp.fc.weight", (4 * d, d)), (h + "mlp.fc.bias", (4 * d,)),
                   (h + "mlp.fc2.weight", (d, 4 * d)), (h + "mlp.fc2.bias", (d,))]
    return shapes + [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]


def param_count(d_model: int, layers: int, vocab: int, ctx: int) -> int:
    """12·L·d² + 13·L·d + V·d + ctx·d + 2·d (gpt_shapes, counted in closed form)."""
    d = d_model
    return 12 * layers * d * d + 13 * layers * d + vocab * d + ctx * d + 2 * d


# ----------------------------------------------------------------------------- timing
class Clock:
    """CUDA events on a GPU (the device's span), the wall clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def time_phases(clock: Clock, phases, reps: int, warmup: int) -> dict:
    """Run the phases in order ``warmup`` times, then ``reps`` times timed: the median ms of the whole
    step and of each phase, and the median host ms of the step's calls."""
    for _ in range(warmup):
        for _, fn in phases:
            fn()
    clock.sync()
    steps, hosts, per = [], [], {name: [] for name, _ in phases}
    for _ in range(reps):
        clock.sync()
        t0 = time.perf_counter()
        marks = [clock.mark()]
        for _, fn in phases:
            fn()
            marks.append(clock.mark())
        hosts.append((time.perf_counter() - t0) * 1e3)
        clock.sync()
        steps.append(clock.ms(marks[0], marks[-1]))
        for (name, _), a, b in zip(phases, marks, marks[1:]):
            per[name].append(clock.ms(a, b))
    out = {"ms": statistics.median(steps), "ms_min": min(steps), "ms_max": max(steps),
           "host_ms": statistics.median(hosts)}
    if len(phases) > 1:
        out.update({f"{name}_ms": statistics.median(v) for name, v in per.items()})
    return out


# ----------------------------------------------------------------------------- checks
@torch.no_grad()
def first_step_check(params, step_fns) -> dict:
    """One step (``step_fns`` in order) against a snapshot: every parameter finite, and the fraction of
    elements that changed. One host read."""
    before = [p.detach().clone() for p in params]
    for fn in step_fns:
        fn()
    bad = torch.stack([(~torch.isfinite(p)).sum() for p in params]).sum()
    moved = torch.stack([(p != b).sum() for p, b in zip(params, before)]).sum()
    bad, moved = torch.stack([bad, moved]).tolist()
    del before
    total = sum(p.numel() for p in params)
    return {"finite": bad == 0, "changed_frac": moved / total}


def tensors_gb(ts) -> float:
    return sum(t.numel() * t.element_size() for t in ts) / 1e9


def state_tensors(opt) -> list:
    return [v for st in opt.state.values() for v in st.values()
            if isinstance(v, torch.Tensor) and v.numel() > 1]


def _dtype(dt) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dt, str(dt))


# ----------------------------------------------------------------------------- the optimizers
def _lion_fused(params, device, ctx):
    from lioncub_ds import Lion, kernels

    be = kernels.backend_for(device.type)
    opt = Lion(params, lr=LION_LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    fused = be.name != "torch"
    info = {"impl": f"lioncub_ds.Lion, fused ({be.name} lion_step)" if fused
            else "lioncub_ds.Lion, foreach (no native kernels: torch fallback)",
            "kernels": be.name, "state": f"exp_avg {_dtype(opt.momentum_dtype)}"}
    return opt, [("step", opt.step)], info, lambda: state_tensors(opt)


def _adamw_fused(params, device, ctx):
    try:
        opt = torch.optim.AdamW(params, lr=ADAMW_LR, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY, fused=True)
        impl = "torch AdamW(fused=True)"
        # a device without a fused kernel refuses at the first step: try it on a throw-away parameter
        probe = torch.zeros(8, device=device, dtype=PARAM_DTYPE, requires_grad=True)
        probe.grad = torch.ones_like(probe)
        torch.optim.AdamW([probe], fused=True).step()
    except (RuntimeError, ValueError) as exc:
        if device.type == "cuda":
            raise
        opt = torch.optim.AdamW(params, lr=ADAMW_LR, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY)
        impl = f"torch AdamW (default: fused refused on {device.type}: {str(exc)[:60]})"
    info = {"impl": impl, "kernels": "torch", "state": f"exp_avg, exp_avg_sq {_dtype(PARAM_DTYPE)}"}
    return opt, [("step", opt.step)], info, lambda: state_tensors(opt)


def triton_unavailable(device) -> str | None:
    """Why lion-pytorch's Triton Lion cannot run here, or None."""
    if device.type != "cuda":
        return f"Triton needs a CUDA device (this run is on {device.type})"
    import importlib.util

    for mod in ("triton", "lion_pytorch"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not importable"
    try:  # lion_pytorch.triton calls exit() when triton is missing: catch SystemExit too
        import lion_pytorch.triton  # noqa: F401
    except BaseException as exc:  # noqa: BLE001
        return f"lion_pytorch.triton does not import ({type(exc).__name__}: {exc})"
    return None


def _lion_pytorch_triton(params, device, ctx):
    from lion_pytorch import Lion as TritonLion

    opt = TritonLion(params, lr=LION_LR, betas=BETAS, weight_decay=WEIGHT_DECAY, use_triton=True)
    info = {"impl": "lion_pytorch.Lion(use_triton=True), one launch per tensor", "kernels": "triton",
            "state": f"exp_avg {_dtype(PARAM_DTYPE)}"}
    return opt, [("step", opt.step)], info, lambda: state_tensors(opt)


def _lioncub_n8(params, device, ctx):
    from lioncub_ds import kernels
    from lioncub_ds.conventions import tie_segments
    from lioncub_ds.layout import build_buckets

    world = ctx["world_size"]
    be = kernels.backend_for(device.type)
    bucket_numel = max(8, int(ctx["bucket_mb"] * 2**20 / 4) // 8 * 8)  # LionCubConfig.bucket_numel's rule
    buckets, _ = build_buckets([{"params": params}], bucket_numel, world)
    gen = torch.Generator(device=device).manual_seed(1)
    jobs = []
    for b in buckets:
        nbytes = b.numel // 8
        votes = torch.randint(0, 256, (world, nbytes), device=device, dtype=torch.int32,
                              generator=gen).to(torch.uint8)  # rows 1..N-1: the other ranks' votes
        jobs.append({"params": b.params, "grads": [p.grad for p in b.params], "offsets": b.offsets,
                     "numel": b.numel, "segments": tie_segments(b.offsets, b.param_starts), "votes": votes,
                     "momenta": [torch.zeros_like(p, dtype=torch.float32) for p in b.params], "sign": None})
    counter = [0]
    beta1, beta2 = BETAS

    def local():
        for j in jobs:
            j["sign"] = be.local_step(j["grads"], j["momenta"], j["offsets"], j["numel"], beta1, beta2, False,
                                      device_counts=True)[0]

    copies = ctx.get("other_votes", "random") == "copies"

    def apply():
        counter[0] += 1
        for j in jobs:
            sign = j["sign"].view(1, -1)  # this rank's row of the gathered planes (every row: "copies")
            j["votes"][:world if copies else 1].copy_(sign.expand(world if copies else 1, -1))
            be.vote_apply(j["votes"], None, j["params"], j["offsets"], LION_LR, WEIGHT_DECAY, counter[0], "hash",
                          "majority", world, j["segments"], return_delta=False)

    def momentum():
        for j in jobs:
            be.momentum_update_list(j["momenta"], j["grads"], beta2)

    info = {"impl": f"local_step + vote_apply N={world} + momentum_update ({be.name}), {len(buckets)} buckets",
            "kernels": be.name, "state": f"exp_avg fp32 + {world} x 1-bit vote planes", "world_size": world,
            "buckets": len(buckets), "bucket_numel": bucket_numel}
    owner = [jobs]  # dropped with the case

    def state():
        return [m for j in owner[0] for m in j["momenta"]] + [j["votes"] for j in owner[0]]

    return owner, [("local", local), ("apply", apply), ("momentum", momentum)], info, state


BUILDERS = {"lion_fused": _lion_fused, "adamw_fused": _adamw_fused, "lioncub_N8": _lioncub_n8,
            "lion_pytorch_triton": _lion_pytorch_triton}


# ----------------------------------------------------------------------------- the run
def make_model(shapes, device, seed=0):
    """bf16 parameters ~ N(0, 0.02²) and fixed bf16 gradients ~ N(0, 0.01²), one tensor per shape."""
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for _, shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, device=device, generator=gen, dtype=torch.float32)
                               .mul_(0.02).to(PARAM_DTYPE))
        p.grad = torch.randn(shape, device=device, generator=gen, dtype=torch.float32).mul_(0.01).to(PARAM_DTYPE)
        params.append(p)
    return params


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args) -> list[dict]:
    t_start = time.monotonic()
    dims = resolve_dims(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("big_step: --device cuda but torch sees no CUDA device (--scale tiny --device cpu is the "
                         "dry run)")
    shapes = gpt_shapes(dims["d_model"], dims["layers"], dims["vocab"], dims["ctx"])
    n = sum(math.prod(s) for _, s in shapes)
    assert n == param_count(dims["d_model"], dims["layers"], dims["vocab"], dims["ctx"])
    clock = Clock(device)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"big_step: GPT d_model {dims['d_model']}, {dims['layers']} layers, vocab {dims['vocab']}, context "
          f"{dims['ctx']} (tied embeddings): {n:,} parameters in {len(shapes)} tensors; params and grads "
          f"{_dtype(PARAM_DTYPE)}; {dev_name}; {'CUDA events' if clock.cuda else 'wall clock'}, warm-up "
          f"{args.warmup}, median of {args.reps}", flush=True)
    params = make_model(shapes, device)
    base = {"bench": "big_step", "device": dev_name, "scale": args.scale, **{k: dims[k] for k in
            ("d_model", "layers", "vocab", "ctx")}, "params": n, "tensors": len(shapes),
            "param_dtype": _dtype(PARAM_DTYPE), "grad_dtype": _dtype(PARAM_DTYPE), "reps": args.reps,
            "warmup": args.warmup, "timing": "cuda events" if clock.cuda else "wall clock",
            "dry_run": device.type != "cuda", "torch": torch.__version__,
            "model_GB": tensors_gb(params) + tensors_gb([p.grad for p in params])}
    records = []
    for name in args.optimizers:
        rec = dict(base, optimizer=name, skipped=None)
        spent = time.monotonic() - t_start
        why = None
        if args.time_budget and spent > args.time_budget:
            why = f"time budget spent ({spent:.0f} s of {args.time_budget:.0f} s)"
        elif name == "lion_pytorch_triton":
            why = triton_unavailable(device)
        if why is not None:
            rec["skipped"] = why
            records.append(rec)
            print(f"[big_step] {name}: skipped: {why}", flush=True)
            continue
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.monotonic()
        owner, phases, info, state = BUILDERS[name](params, device, {"world_size": args.world_size,
                                                                    "bucket_mb": dims["bucket_mb"]})
        with torch.no_grad():
            check = first_step_check(params, [fn for _, fn in phases])
            rec.update(info, **check, state_GB=tensors_gb(state()))
            if device.type == "cuda":  # the check's snapshot of the parameters counted apart
                rec["peak_check_GB"] = torch.cuda.max_memory_allocated(device) / 1e9
                torch.cuda.reset_peak_memory_stats(device)
            rec.update(time_phases(clock, phases, args.reps, args.warmup))
        rec["ms_per_1B"] = rec["ms"] * 1e9 / n
        rec["peak_GB"] = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
        rec["setup_and_timing_s"] = time.monotonic() - t0
        del owner, phases, state
        _free(device)
        records.append(rec)
        print(f"[big_step] {name}: {rec['ms']:.3f} ms per step ({rec['setup_and_timing_s']:.1f} s)", flush=True)
        if args.json:
            write_json(args.json, records)  # what a killed run leaves behind
    adamw = next((r["ms"] for r in records if r["optimizer"] == "adamw_fused" and not r["skipped"]), None)
    for r in records:
        r["vs_adamw"] = r["ms"] / adamw if adamw and not r["skipped"] else None
    del params
    _free(device)
    return records


def resolve_dims(args) -> dict:
    dims = dict(PRESETS[args.scale])
    for k in ("d_model", "layers", "vocab", "ctx", "bucket_mb"):
        if getattr(args, k) is not None:
            dims[k] = getattr(args, k)
    return dims


def print_records(records: list[dict]) -> str:
    rows = []
    for r in records:
        dtypes = f"{r['param_dtype']} p+g; {r['state']}" if not r["skipped"] else "-"
        note = r["skipped"] and f"skipped: {r['skipped']}"
        if not r["skipped"] and "local_ms" in r:
            note = f"local {r['local_ms']:.3g} + apply {r['apply_ms']:.3g} + momentum {r['momentum_ms']:.3g} ms"
        rows.append(dict(r, dtypes=dtypes, note=note or "", finite=r.get("finite"),
                         changed=None if r["skipped"] else f"{r['changed_frac']:.1%}"))
    cols = [("optimizer", "optimizer"), ("kernels", "kernels"), ("dtypes", "dtypes"), ("ms", "ms/step", ".3f"),
            ("ms_per_1B", "ms/1B params", ".3f"), ("vs_adamw", "vs AdamW", ".3f"), ("host_ms", "host ms", ".3f"),
            ("state_GB", "state GB", ".3f"), ("peak_GB", "peak GB", ".2f"), ("finite", "finite"),
            ("changed", "changed"), ("note", "note")]
    text = print_table(rows, cols, title="one optimizer step (median); vs AdamW = ms / fused AdamW's ms, same run")
    peaks = [r["peak_GB"] for r in records if r.get("peak_GB") is not None]
    if peaks:
        check = max(r.get("peak_check_GB") or 0.0 for r in records)
        print(f"peak GPU memory: {max(peaks):.2f} GB in the timed steps, {max(check, max(peaks)):.2f} GB with the "
              f"first step's check (a copy of the parameters); parameters + gradients "
              f"{records[0]['model_GB']:.2f} GB, one optimizer's state at a time", flush=True)
    else:
        print(f"peak GPU memory: - (no GPU); parameters + gradients {records[0]['model_GB']:.3f} GB", flush=True)
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.big_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", choices=("auto", *PRESETS), default="auto",
                   help="model size: full (1.3B, GPU), tiny (544K, the CPU dry run); auto: full on a GPU, else tiny")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available, else cpu)")
    for k, t in (("d_model", int), ("layers", int), ("vocab", int), ("ctx", int), ("bucket_mb", float)):
        p.add_argument("--" + k.replace("_", "-"), dest=k, type=t, default=None, help=f"override the preset's {k}")
    p.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    p.add_argument("--world-size", type=int, default=8, help="N of LionCub's apply (default 8)")
    p.add_argument("--reps", type=int, default=None, help="timed steps (default: 15 on a GPU, 3 on CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 3 on a GPU, 1 on CPU)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds: an optimizer not started by then is skipped (the GPU check's step budget)")
    add_output_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cuda = torch.cuda.is_available()
    args.device = args.device or ("cuda" if cuda else "cpu")
    if args.scale == "auto":
        args.scale = "full" if args.device.startswith("cuda") else "tiny"
    if args.scale == "full" and not args.device.startswith("cuda"):
        print("big_step: --scale full is 1.3B parameters: it needs a GPU (--scale tiny runs on CPU)", file=sys.stderr)
        return 2
    args.reps = args.reps or (15 if args.device.startswith("cuda") else 3)
    args.warmup = args.warmup if args.warmup is not None else (3 if args.device.startswith("cuda") else 1)
    records = run(args)
    print_records(records)
    finish("big_step", args, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
