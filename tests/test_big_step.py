"""benchmarks/big_step.py (the GPU check's 1.3B-parameter step) on CPU: the tiny dry run's table and JSON,
every optimizer's first step (parameters finite and changed), the kernel halves' wiring (8 agreeing
votes give Lion's step bit for bit) and the model's exact size. No timing assertions."""
from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import BENCHMARKS, big_step

pytestmark = pytest.mark.unit

FIELDS = {"bench", "device", "scale", "params", "tensors", "param_dtype", "grad_dtype", "optimizer", "skipped", "impl",
          "kernels", "state", "ms", "ms_per_1B", "vs_adamw", "host_ms", "state_GB", "peak_GB", "finite",
          "changed_frac", "reps", "warmup", "timing"}
TINY = dict(d_model=64, layers=1, vocab=256, ctx=64)


def test_the_full_model_is_the_1_3b_gpt():
    full = big_step.PRESETS["full"]
    dims = {k: full[k] for k in ("d_model", "layers", "vocab", "ctx")}
    shapes = big_step.gpt_shapes(**dims)
    assert sum(math.prod(s) for _, s in shapes) == big_step.param_count(**dims) == 1_315_819_520
    assert len(shapes) == 12 * 24 + 4 == 292
    assert dict(shapes)["h.0.mlp.fc2.weight"] == (2048, 4 * 2048) and dict(shapes)["wte.weight"] == (50304, 2048)
    tiny = big_step.PRESETS["tiny"]
    assert big_step.param_count(**{k: tiny[k] for k in dims}) == 544_256


def test_tiny_dry_run_table_and_json(tmp_path, capsys):
    path = tmp_path / "big_step.json"
    assert "big_step" in BENCHMARKS
    rc = big_step.main(["--scale", "tiny", "--device", "cpu", "--reps", "1", "--warmup", "0", "--json", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    records = json.loads(path.read_text())
    assert [r["optimizer"] for r in records] == list(big_step.OPTIMIZERS)
    by = {r["optimizer"]: r for r in records}
    assert "Triton needs a CUDA device" in by["lion_pytorch_triton"]["skipped"]
    for name in ("lion_fused", "adamw_fused", "lioncub_N8"):
        r = by[name]
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["skipped"] is None and r["params"] == 544_256 and r["tensors"] == 28
        assert r["param_dtype"] == r["grad_dtype"] == "bf16" and r["device"] == "cpu" and r["dry_run"]
        assert r["finite"] and r["changed_frac"] > 0.5, r  # the bench's own first-step check
        assert r["ms"] > 0 and r["ms_per_1B"] == pytest.approx(r["ms"] * 1e9 / r["params"])
        assert r["vs_adamw"] == pytest.approx(r["ms"] / by["adamw_fused"]["ms"])
        assert r["peak_GB"] is None and r["state_GB"] > 0
    assert by["adamw_fused"]["vs_adamw"] == 1.0
    assert "exp_avg fp32" in by["lion_fused"]["state"] and "bf16" in by["adamw_fused"]["state"]
    assert by["lioncub_N8"]["world_size"] == 8 and by["lioncub_N8"]["buckets"] > 1
    assert {"local_ms", "apply_ms", "momentum_ms"} <= set(by["lioncub_N8"])
    # the table: a header naming the model and dtypes, one row per optimizer, the skip's reason, the peak line
    assert "544,256 parameters in 28 tensors" in out and "params and grads bf16" in out
    for name in big_step.OPTIMIZERS:
        assert any(line.strip().startswith(name) for line in out.splitlines()), name
    assert "skipped: Triton needs a CUDA device" in out and "peak GPU memory: - (no GPU)" in out
    for head in ("ms/step", "ms/1B params", "vs AdamW", "finite", "changed"):
        assert head in out


@pytest.mark.parametrize("name", ["lion_fused", "adamw_fused", "lioncub_N8"])
def test_one_step_of_each_optimizer_moves_every_parameter_finitely(name):
    shapes = big_step.gpt_shapes(**TINY)
    params = big_step.make_model(shapes, torch.device("cpu"))
    before = [p.detach().clone() for p in params]
    owner, phases, info, state = big_step.BUILDERS[name](params, torch.device("cpu"),
                                                         {"world_size": 8, "bucket_mb": 0.05})
    with torch.no_grad():
        for _, fn in phases:
            fn()
    for p, b in zip(params, before):
        assert torch.isfinite(p).all()
        assert (p != b).float().mean() > 0.5, (name, p.shape)
    assert state() and all(torch.isfinite(t.float()).all() for t in state() if t.is_floating_point())
    if name == "lioncub_N8":
        assert info["buckets"] > 1 and info["world_size"] == 8


def test_lioncub_halves_with_eight_agreeing_votes_equal_lion():
    """The kernel halves as the bench wires them (local step -> this rank's row -> the apply of 8 rows ->
    the momentum update): with 8 copies of this rank's votes the step is Lion's, bit for bit (parameters
    and momenta), over two steps."""
    shapes = big_step.gpt_shapes(**TINY)
    cpu = torch.device("cpu")
    a, b = big_step.make_model(shapes, cpu), big_step.make_model(shapes, cpu)
    opt, lion_phases, _, lion_state = big_step.BUILDERS["lion_fused"](a, cpu, {})
    _, cub_phases, _, cub_state = big_step.BUILDERS["lioncub_N8"](b, cpu, {"world_size": 8, "bucket_mb": 0.05,
                                                                         "other_votes": "copies"})
    with torch.no_grad():
        for _ in range(2):
            for phases in (lion_phases, cub_phases):
                for _, fn in phases:
                    fn()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    moms = [t for t in cub_state() if t.dtype == torch.float32]
    assert len(moms) == len(a)
    for m, n in zip([opt.state[p]["exp_avg"] for p in a], moms):
        assert torch.equal(m, n)


def test_full_scale_refuses_cpu(capsys):
    assert big_step.main(["--scale", "full", "--device", "cpu"]) == 2
    assert "needs a GPU" in capsys.readouterr().err
