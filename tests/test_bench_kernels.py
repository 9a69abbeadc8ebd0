"""The kernel benchmarks' code paths on this machine: the CUDA bench as a dry run (CPU tensors, the C++
kernels, wall clocks: every record and floor it would write on a GPU) and the host-cost table of
``python -m benchmarks kernels --only host``. Figures are not asserted (a loaded machine), only that
every kernel is measured and the records say what they are."""
from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.unit


def test_cuda_bench_dry_run_times_every_kernel_with_its_floor(monkeypatch, capsys):
    from benchmarks import kernels_cuda as kc
    from lioncub_ds import kernels

    monkeypatch.setenv("LIONCUB_KERNELS", "auto")
    monkeypatch.setattr(kernels, "_cache", {})
    recs = kc.run_cuda(None, sizes=(4096,), repeats=2, warmup=1, dry_run=True, world_size=4)
    names = {r["kernel"] for r in recs}
    assert names == set(kc.floors(4, 4, 4, 2)), names ^ set(kc.floors(4, 4, 4, 2))
    assert {(r["dtype"], r["impl"]) for r in recs} == {("fp32", "fused"), ("bf16", "fused")}
    for r in recs:
        assert r["dry_run"] and r["numel"] == 4096 and r["kernel_timing"] == "wall (dry run)"
        for key in ("call_us", "kernel_us", "b2b_us", "host_us", "floor_us", "frac_of_floor"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["kernel"], key)
        esz = 4 if r["dtype"] == "fp32" else 2
        want, twice = kc.floors(esz, 4, 4, 2)[r["kernel"]]
        cast = esz if r["kernel"].startswith("zero_sign_apply") and esz == 2 else 0
        assert r["floor_bytes_per_param"] == want + cast
        assert r["passes"] == (1 if twice is None else 2)
        if twice is not None:  # a two-pass kernel says what it moves besides its floor
            assert r["kernel_bytes_per_param"] == twice > want
    assert {r["kernel"] for r in recs if r["passes"] == 2} == {"int8_local_step_l1", "bbit_local_step_l1_b2"}
    out = capsys.readouterr().out
    assert "of floor" in out and "2p (" in out


def test_host_table_covers_every_op(capsys):
    from benchmarks import kernels as kb
    from lioncub_ds.kernels import ops

    import torch.distributed as dist

    group_free = not dist.is_initialized()  # the whole-step row needs its own (fake) process group
    recs = kb.run_host(calls=5, rounds=2, buckets=3)
    assert not (group_free and dist.is_initialized())  # the fake group is gone again
    ops_timed = {r["op"] for r in recs}
    want = {n if n != "momentum_update" else "momentum_update_list" for n in ops.SCHEMAS}
    assert want <= ops_timed, want - ops_timed
    step = [r for r in recs if r["op"].startswith("step:")]
    assert len(step) == 1 and step[0]["buckets"] == 3
    whole = [r for r in recs if r["op"].startswith("LionCub.step()")]
    assert len(whole) == (1 if group_free else 0)
    assert not whole or (whole[0]["buckets"] == 3 and whole[0]["per_bucket_us"] > 0)
    for r in recs:
        assert r["us_per_call"] > 0 and r["torch_add_us"] > 0
    print(kb.format_host_table(recs))
    assert "x add" in capsys.readouterr().out
