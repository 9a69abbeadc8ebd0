"""The NCCL-contract wrapper (lioncub_ds.testing.nccl_contract) catches every rule it claims to,
on real gloo ranks (positive controls), and lets correct code through."""
from __future__ import annotations

import datetime
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist

from lioncub_ds.testing import nccl_contract as nc
from lioncub_ds.testing.spawn import RankError
from dist_helpers import run_ranks

pytestmark = pytest.mark.dist


# ----------------------------------------------------------------------------- tables (no ranks)
@pytest.mark.unit
@pytest.mark.parametrize("dtype,op,ok", [
    (torch.float32, "SUM", True), (torch.bfloat16, "SUM", True), (torch.float16, "MAX", True),
    (torch.uint8, "SUM", True), (torch.int8, "SUM", True), (torch.int32, "MAX", True), (torch.int64, "MIN", True),
    (torch.float64, "PRODUCT", True), (torch.float32, "AVG", True), (torch.bool, "SUM", True),
    (torch.uint8, "BAND", False), (torch.uint8, "BOR", False), (torch.int32, "BXOR", False),
    (torch.bool, "AVG", False), (torch.int16, "SUM", False), (torch.int16, None, False),
    (torch.uint8, None, True), (torch.bfloat16, None, True), (torch.float8_e4m3fn, None, True),
    (torch.float8_e4m3fn, "SUM", False), (torch.complex64, "SUM", True), (torch.complex64, "MAX", False),
    (torch.int32, "PREMUL_SUM", False), (torch.float32, "PREMUL_SUM", True),
])
def test_dtype_op_table(dtype, op, ok):
    assert (nc.check_dtype_op(dtype, op) is None) == ok, nc.check_dtype_op(dtype, op)


@pytest.mark.unit
def test_compare_logs_reports_the_first_difference():
    w = (0, 1, 2)
    a = {"log": [("new_group", (0, 1), "world"), ("all_reduce", w, "torch.int32", (3,), "SUM"),
                 ("all_reduce", (0, 1), "torch.float32", (4,), "SUM")], "sites": [(), (), ()], "violations": []}
    b = {"log": [("new_group", (0, 1), "world"), ("all_reduce", w, "torch.int32", (3,), "SUM"),
                 ("all_reduce", (0, 1), "torch.float32", (4,), "SUM")], "sites": [(), (), ()], "violations": []}
    # rank 2 is not in group (0, 1): its calls there are not expected
    c = {"log": [("new_group", (0, 1), "world"), ("all_reduce", w, "torch.int32", (3,), "SUM")],
         "sites": [(), ()], "violations": []}
    assert nc.compare_logs([a, b, c]) is None
    b2 = dict(b, log=b["log"][:2] + [("all_reduce", (0, 1), "torch.float32", (5,), "SUM")])
    diff = nc.compare_logs([a, b2, c])
    assert diff and "ranks 0 and 1" in diff and "shape=(4,)" in diff and "shape=(5,)" in diff, diff
    c2 = dict(c, log=[("all_reduce", w, "torch.int32", (3,), "SUM")], sites=[()])  # skipped a world group creation
    diff = nc.compare_logs([a, b, c2])
    assert diff and "ranks 0 and 2" in diff and "new_group" in diff, diff


# ----------------------------------------------------------------------------- positive controls on ranks
def _violations(rank, n):
    """Each rule broken on purpose (the same way on every rank, so the call sequences stay equal)."""
    out = {}
    x = torch.ones(4)
    # 1. device: the parameters are declared on another device than this CPU tensor
    nc.expect_device("cuda")
    with nc.expecting_violation() as v:
        dist.all_reduce(x)
    out["cpu_vs_declared_cuda"] = v.message
    nc.expect_device("cpu")
    # ... and a tensor created without device= under a stray default device (meta)
    with nc.expecting_violation() as v:
        with nc.stray_default_device("meta"):
            flags = torch.zeros(2, dtype=torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    out["meta"] = v.message
    # 2. dtype / op pairs NCCL refuses (gloo runs all of them)
    for name in ("BAND", "BOR", "BXOR"):
        with nc.expecting_violation() as v:
            dist.all_reduce(torch.ones(8, dtype=torch.uint8), op=getattr(dist.ReduceOp, name))
        out[name] = v.message
    with nc.expecting_violation() as v:
        out16 = torch.zeros(2 * n, dtype=torch.int16)
        dist.all_gather_into_tensor(out16, torch.ones(2, dtype=torch.int16))
    out["int16"] = v.message
    with nc.expecting_violation() as v:
        dist.all_reduce(torch.ones(4, 4).t())
    out["non_contiguous"] = v.message
    with nc.expecting_violation() as v:
        dist.monitored_barrier()
    out["monitored_barrier"] = v.message
    with nc.expecting_violation() as v:
        with nc.no_group_creation("inside a training step"):
            dist.new_group(list(range(n)))
    out["late_group"] = v.message
    # a reference taken BEFORE install() (like `_all_gather_single = dist.all_gather_into_tensor`)
    nc.uninstall()
    mod = types.ModuleType("_contract_probe")
    mod.captured_all_reduce = dist.all_reduce
    sys.modules["_contract_probe"] = mod
    nc.install()
    with nc.expecting_violation() as v:
        mod.captured_all_reduce(torch.ones(8, dtype=torch.uint8), op=dist.ReduceOp.BAND)
    out["captured_before_install"] = v.message
    # 3. what NCCL accepts goes through, and really communicates
    y = torch.full((4,), float(rank + 1))
    dist.all_reduce(y)
    flags = torch.zeros(3, dtype=torch.int32)
    flags[rank % 3] = 1
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    g = torch.zeros(2 * n, dtype=torch.uint8)
    dist.all_gather_into_tensor(g, torch.full((2,), rank, dtype=torch.uint8))
    a2a = torch.empty(n, dtype=torch.uint8)
    dist.all_to_all_single(a2a, torch.full((n,), rank, dtype=torch.uint8))
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=0)
    dist.barrier()
    out["ok"] = (y.tolist(), flags.tolist(), g.tolist(), a2a.tolist(), b.tolist())
    out["log_ops"] = [e[0] for e in nc.log()]
    return out


def test_contract_catches_each_violation_on_real_ranks():
    n = 2
    res = run_ranks(_violations, n, timeout=300)
    for r, out in enumerate(res):
        assert "is on cpu; the parameters are on cuda" in out["cpu_vs_declared_cuda"], out["cpu_vs_declared_cuda"]
        assert "is on meta; the parameters are on cpu" in out["meta"] and "without device=" in out["meta"], out["meta"]
        assert "_violations" in out["meta"], "the message must name the call site"
        for name in ("BAND", "BOR", "BXOR"):
            assert out[name] and f"ReduceOp.{name} is not supported by NCCL" in out[name], out[name]
        assert out["int16"] and "torch.int16 is not supported by NCCL" in out["int16"], out["int16"]
        assert out["non_contiguous"] and "not contiguous" in out["non_contiguous"], out["non_contiguous"]
        assert out["monitored_barrier"] and "gloo only" in out["monitored_barrier"]
        assert out["late_group"] and "process group created inside a training step" in out["late_group"]
        assert out["captured_before_install"] and "BAND" in out["captured_before_install"]
        y, flags, g, a2a, b = out["ok"]
        assert y == [3.0] * 4 and flags == [1, 1, 0] and g == [0, 0, 1, 1] and a2a == [0, 1] and b == [0.0] * 3
        # refused calls never reached the backend, accepted ones are logged once (nested torch calls are not)
        assert out["log_ops"][-6:] == ["all_reduce", "all_reduce", "all_gather_single", "all_to_all_single",
                                       "broadcast", "barrier"], out["log_ops"]


def _extra_all_reduce(rank, n):
    g = dist.new_group(list(range(n)), timeout=datetime.timedelta(seconds=5))
    x = torch.ones(3)
    dist.all_reduce(x, group=g)
    dist.all_reduce(x, group=g)
    if rank == 1:
        dist.all_reduce(x, group=g)  # one more than rank 0: a deadlock under NCCL
    return True


def test_contract_catches_an_extra_collective_on_one_rank():
    with pytest.raises(nc.NCCLContractError) as info:
        run_ranks(_extra_all_reduce, 2, timeout=120, grace=30)
    msg = str(info.value)
    assert "ranks 0 and 1 issued different collectives" in msg, msg
    assert "rank 0: (nothing: the log ends here)" in msg and "rank 1: all_reduce(group=(0, 1)" in msg, msg
    assert "_extra_all_reduce" in msg, "the diff must name the call site"


def _group_on_one_rank(rank, n):
    if rank == 0:
        dist.new_group([0, 1])  # gloo hangs in its connect; NCCL would hang or desync group names
    x = torch.ones(2)
    dist.all_reduce(x)
    return float(x[0])


def test_contract_catches_a_group_created_on_one_rank_only():
    with pytest.raises(nc.NCCLContractError) as info:
        run_ranks(_group_on_one_rank, 2, timeout=20)  # both ranks hang: the spawner asks them for their logs
    msg = str(info.value)
    assert "ranks 0 and 1" in msg and "rank 0: new_group(ranks=(0, 1), sync=world" in msg, msg
    assert "rank 1: all_reduce(group=(0, 1)" in msg, msg
    assert "hung; its main thread is at" in msg, msg


def _same_count_other_dtype(rank, n):
    x = torch.ones(4, dtype=torch.float32 if rank == 0 else torch.int32)
    flag = torch.zeros(4, dtype=torch.int32)
    dist.all_reduce(flag)  # matched
    try:
        dist.all_reduce(x)  # same op, another dtype on rank 1: garbage or a hang under NCCL
    except Exception:  # noqa: BLE001 - whatever gloo makes of it; the contract must report it
        pass
    return True


def test_contract_catches_a_dtype_that_differs_across_ranks():
    with pytest.raises(nc.NCCLContractError) as info:
        run_ranks(_same_count_other_dtype, 2, timeout=120, grace=30)
    msg = str(info.value)
    assert "dtype=torch.float32" in msg and "dtype=torch.int32" in msg, msg


def _clean(rank, n):
    x = torch.ones(3)
    dist.all_reduce(x)
    return nc.installed(), len(nc.log())


def test_contract_switch():
    on = run_ranks(_clean, 2)
    assert on == [(True, 1), (True, 1)]
    off = run_ranks(_clean, 2, contract=False)
    assert off == [(False, 0), (False, 0)]


def _one_rank_finishes_one_hangs(rank, n):
    # both ranks through gloo's set-up first: a rank 0 that exits while rank 1 still connects makes
    # rank 1 fail ("connection closed by peer", seen on a loaded machine) instead of going silent
    dist.barrier()
    if rank == 1:
        time.sleep(120)  # silent past the spawner's deadline
    return rank


def test_spawner_reports_a_silent_rank_after_another_has_exited():
    """Rank 0 returns and its process exits; rank 1 stays silent past the deadline. The spawner
    must report rank 1 as hung within seconds (it once waited forever: its 'where are you'
    request went through a multiprocessing Event, whose set() waits for the exited rank too)."""
    t = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_one_rank_finishes_one_hangs, 2, timeout=8)
    assert time.monotonic() - t < 60
    msg = str(info.value)
    assert "rank 1" in msg and ("hung" in msg or "no report" in msg), msg


def _world_sum(rank, n):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return float(t)


def test_spawner_launches_again_when_the_free_port_is_taken(monkeypatch):
    """Between free_port() and rank 0's store listening on it, another process can take the port
    (EADDRINUSE: the suite once failed that way on a busy machine). Forced here: the first port
    handed out is one this test is listening on; the spawner must launch again on another port."""
    import socket

    from lioncub_ds.testing import spawn

    busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    busy.bind(("127.0.0.1", 0))
    busy.listen(8)
    handed = []
    real = spawn.free_port

    def first_taken():
        handed.append(busy.getsockname()[1] if not handed else real())
        return handed[-1]

    monkeypatch.setattr(spawn, "free_port", first_taken)
    try:
        t = time.monotonic()
        assert run_ranks(_world_sum, 2, timeout=60) == [3.0, 3.0]
        assert len(handed) == 2 and handed[1] != handed[0]
        assert time.monotonic() - t < 60
    finally:
        busy.close()
