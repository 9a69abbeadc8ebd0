"""Reliability (issue 8): non-finite gradients, replica drift, a dead or stalled rank, and
checkpoints that are corrupted, truncated, mismatched, resharded or half-written.

Multi-rank scenarios run on 3 gloo ranks, one launch per scenario with several checks
inside (process start-up dominates the cost). Each runs twice: with the pure-torch kernels
(``LIONCUB_KERNELS=torch``) and with the native kernels of the ranks' device (``cpp``: the
ranks hold CPU tensors; must load, no silent fallback). The native extension is built once,
in the parent, before the ranks start (``_build_native``), so three ranks never JIT-build it
at once.
"""
from __future__ import annotations

import io
import logging
import os
import pickle
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lioncub_ds import LionCub, NonFiniteError, ReplicaDriftError, checkpoint
from lioncub_ds.checkpoint import CheckpointError
from dist_helpers import free_port, run_ranks

pytestmark = pytest.mark.dist  # the single-process checkpoint checks are unit

N = 3
KERNELS = ("torch", "cpp")


def _rank_env(kernels):
    if kernels == "cpp":
        _build_native()
    return {"LIONCUB_KERNELS": kernels}


def _build_native():
    """Build (or load from the cache) the C++ kernels once here, before the ranks import them."""
    from lioncub_ds import kernels
    try:
        kernels._load_native("cpp")
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"the C++ kernels do not build here: {exc}")


def _backend_name():
    from lioncub_ds import kernels
    return kernels.backend_for("cpu").name


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 9)
        self.fc2 = torch.nn.Linear(9, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _fresh(**kw):
    torch.manual_seed(0)  # identical initial parameters on every rank
    model = Net()
    return model, LionCub(model.named_parameters(), lr=1e-2, weight_decay=0.1, **kw)


def _backward(model, gen):
    model.zero_grad(set_to_none=True)
    x = torch.randn(5, 6, generator=gen)
    y = torch.randn(5, 2, generator=gen)
    torch.nn.functional.mse_loss(model(x), y).backward()


def _momenta(opt, model):
    return [opt.state[p]["exp_avg"].clone() if "exp_avg" in opt.state[p] else None for p in model.parameters()]


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _same(a, b):
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b))


def _identical_across_ranks(model) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    got = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(got, flat)
    return all(torch.equal(got[0], g) for g in got)


# ============================================================================ non-finite gradients
BAD_STEP = 5
NONFINITE_CASES = (("allgather", "sign", float("nan")), ("1bit", "sign", float("nan")),
                   ("pbit", "sign", float("inf")), ("int8", "l1", float("nan")), ("1bit", "sign", float("-inf")))


def _nonfinite_scenario(rank, n, directory):
    out = {"skip": [], "raise": None}
    for comm, quant, bad in NONFINITE_CASES:
        model, opt = _fresh(comm=comm, quant=quant)
        gen = torch.Generator().manual_seed(100 + rank)  # different data per rank
        rec = {"case": (comm, quant, bad)}
        for step in range(1, 9):
            _backward(model, gen)
            if step == BAD_STEP:
                if rank == 1:
                    model.fc1.weight.grad[2, 3] = bad
                m0, p0 = _momenta(opt, model), _params(model)
                steps0 = [opt.state[p]["step"].clone() for p in model.parameters()]
                count0 = opt.step_count
            opt.step()
            if step == BAD_STEP:
                rec["momenta_unchanged"] = _same(m0, _momenta(opt, model))
                rec["params_unchanged"] = _same(p0, _params(model))
                rec["state_steps_unchanged"] = _same(steps0, [opt.state[p]["step"] for p in model.parameters()])
                rec["count_before_after"] = (count0, opt.step_count)
                rec["skipped_after_bad"] = opt.comm_stats()["skipped_steps"]
        rec["skipped"] = opt.comm_stats()["skipped_steps"]
        rec["step_count"] = opt.step_count
        rec["identical"] = _identical_across_ranks(model)
        rec["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters()) and all(
            bool(torch.isfinite(m).all()) for m in _momenta(opt, model))
        out["skip"].append(rec)
        if comm == "1bit" and bad != bad:  # NaN case: keep this rank's state for the reshard checks
            checkpoint.save(opt, directory)
            out["saved_momenta"] = _momenta(opt, model)
            out["saved_step"] = opt.step_count

    # nonfinite="raise": every rank raises at the bad step, nothing changes, training goes on.
    model, opt = _fresh(comm="1bit", nonfinite="raise")
    gen = torch.Generator().manual_seed(200 + rank)
    rec = {"raised": None}
    for step in range(1, 9):
        _backward(model, gen)
        if step == BAD_STEP:
            if rank == 2:
                model.fc2.bias.grad[0] = float("nan")
            m0, p0, count0 = _momenta(opt, model), _params(model), opt.step_count
            try:
                opt.step()
            except NonFiniteError as exc:
                rec["raised"] = str(exc)
            rec["momenta_unchanged"] = _same(m0, _momenta(opt, model))
            rec["params_unchanged"] = _same(p0, _params(model))
            rec["count_before_after"] = (count0, opt.step_count)
            rec["skipped_after_raise"] = opt.comm_stats()["skipped_steps"]
            continue
        opt.step()
    rec["step_count"] = opt.step_count
    rec["identical"] = _identical_across_ranks(model)
    out["raise"] = rec
    out["backend"] = _backend_name()
    return out


@pytest.fixture(scope="module", params=KERNELS)
def nonfinite_run(request, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ckpt3"))
    t = time.time()
    results = run_ranks(_nonfinite_scenario, N, directory, timeout=600, env=_rank_env(request.param))
    assert {r["backend"] for r in results} == {request.param}, "the ranks ran other kernels than asked"
    return results, directory, time.time() - t


def test_nonfinite_gradient_on_one_rank_skips_the_step_everywhere(nonfinite_run):
    results, _, _ = nonfinite_run
    for rank, res in enumerate(results):
        for rec in res["skip"]:
            case = rec["case"]
            assert rec["skipped_after_bad"] == 1 and rec["skipped"] == 1, (rank, case)
            # the bad step is not counted: 8 calls, 7 applied steps; it lags by one from then on
            assert rec["count_before_after"] == (BAD_STEP - 1, BAD_STEP - 1), (rank, case)
            assert rec["step_count"] == 7, (rank, case)
            assert rec["momenta_unchanged"] and rec["params_unchanged"] and rec["state_steps_unchanged"], (rank, case)
            assert rec["identical"], f"rank {rank} {case}: replicas differ after a skipped step"
            assert rec["finite"], (rank, case)


def test_nonfinite_raise_raises_on_every_rank_and_changes_nothing(nonfinite_run):
    results, _, _ = nonfinite_run
    for rank, res in enumerate(results):
        rec = res["raise"]
        assert rec["raised"] is not None, f"rank {rank} did not raise NonFiniteError"
        assert "non-finite gradient or momentum on 1 of 3 ranks at step 5" in rec["raised"]
        assert "(non-finite values in all: 1)" in rec["raised"]  # the one planted NaN, counted on the device, summed over ranks
        assert "No state was changed" in rec["raised"]
        assert rec["momenta_unchanged"] and rec["params_unchanged"], rank
        assert rec["count_before_after"] == (BAD_STEP - 1, BAD_STEP - 1)
        assert rec["step_count"] == 7 and rec["identical"], rank


# ============================================================================ replica drift
class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _drift_scenario(rank, n):
    out = {}
    # drift_action="raise", checked every 3 steps: a perturbation after step 1 is reported at step 3
    model, opt = _fresh(comm="1bit", drift_check_every=3)
    gen = torch.Generator().manual_seed(300 + rank)
    out["clean_check"] = opt.check_replicas()
    events = []
    for step in range(1, 5):
        _backward(model, gen)
        if step == 2 and rank == 2:
            with torch.no_grad():
                model.fc1.weight[4, 1] += 1e-3
        try:
            opt.step()
            events.append((step, None))
        except ReplicaDriftError as exc:
            events.append((step, str(exc)))
            break
    out["raise_events"] = events

    # drift_action="resync": warns and re-synchronizes from rank 0
    handler = _Records()
    logging.getLogger("lioncub_ds").addHandler(handler)
    try:
        model, opt = _fresh(comm="pbit", drift_check_every=2, drift_action="resync")
        gen = torch.Generator().manual_seed(400 + rank)
        identical = []
        for step in range(1, 7):
            _backward(model, gen)
            if step == 3 and rank == 1:
                with torch.no_grad():
                    model.fc2.bias[1] -= 0.5
            opt.step()
            identical.append(_identical_across_ranks(model))
        out["resync_identical"] = identical
        out["resync_warnings"] = [m for m in handler.messages if "differ" in m]
        out["after_resync_check"] = opt.check_replicas()
        # check_replicas(action=...) on demand, overriding the configured action
        if rank == 0:
            with torch.no_grad():
                model.fc1.bias[0] += 1.0
        try:
            opt.check_replicas(action="raise")
            out["on_demand"] = None
        except ReplicaDriftError as exc:
            out["on_demand"] = str(exc)
        out["on_demand_resync"] = opt.check_replicas(action="resync")
        out["final_identical"] = _identical_across_ranks(model)
    finally:
        logging.getLogger("lioncub_ds").removeHandler(handler)
    out["backend"] = _backend_name()
    return out


@pytest.mark.parametrize("kernels", KERNELS)
def test_replica_drift_is_detected_named_and_resynchronized(kernels):
    results = run_ranks(_drift_scenario, N, timeout=600, env=_rank_env(kernels))
    assert {r["backend"] for r in results} == {kernels}
    for rank, res in enumerate(results):
        assert res["clean_check"] is True
        # steps 1-2 pass, the check at step 3 reports the parameter rank 2 changed after step 1... on every rank
        events = res["raise_events"]
        assert [s for s, _ in events] == [1, 2, 3], (rank, events)
        assert events[0][1] is None and events[1][1] is None
        msg = events[2][1]
        assert msg is not None, f"rank {rank}: no ReplicaDriftError at the step-3 check"
        assert "parameters differ across the 3 ranks at step 3: fc1.weight" in msg, msg
        assert "fc2" not in msg and "fc1.bias" not in msg, msg
        # resync: checks at steps 2, 4, 6; perturbed at step 3, re-synchronized at step 4
        assert res["resync_identical"] == [True, True, False, True, True, True], (rank, res["resync_identical"])
        assert len(res["resync_warnings"]) == 1, res["resync_warnings"]
        warning = res["resync_warnings"][0]
        assert "fc2.bias" in warning and "re-synchronizing every parameter from rank 0" in warning, warning
        assert res["after_resync_check"] is True
        assert res["on_demand"] is not None and "fc1.bias" in res["on_demand"], res["on_demand"]
        assert res["on_demand_resync"] is False and res["final_identical"], rank
    # everyone ends with rank 0's parameters, identical on every rank (checked by all_gather above)


# ============================================================================ dead / stalled rank
TIMEOUT_S = 5.0
VICTIM = 2


def _collective_failure_worker(rank, n, port, mode, killed_at, queue, kernels):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1", "LIONCUB_KERNELS": kernels})
    torch.set_num_threads(1)
    # The default group keeps torch's default timeout (30 min for gloo): only LionCub's
    # timeout_s can make the survivors fail quickly.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    model, opt = _fresh(comm="1bit", timeout_s=TIMEOUT_S)
    gen = torch.Generator().manual_seed(500 + rank)
    started = None
    try:
        for step in range(1, 9):
            _backward(model, gen)
            if step == BAD_STEP and rank == VICTIM:
                killed_at.value = time.time()
                if mode == "die":
                    os._exit(17)  # no clean-up, no goodbye: like a segfault or an OOM kill
                time.sleep(6 * TIMEOUT_S)  # stalled (e.g. a hung data loader), then gone
                os._exit(18)
            started = time.time()
            opt.step()
        queue.put((rank, "finished", started, time.time(), "", ""))
    except BaseException as exc:  # noqa: BLE001 - report what the survivor saw
        queue.put((rank, type(exc).__name__, started, time.time(), str(exc), repr(exc.__cause__)))
    # then exit normally (no destroy_process_group): a survivor must not hang on the way out


def _run_with_victim(mode, kernels):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    killed_at = ctx.Value("d", 0.0)
    port = free_port()
    procs = [ctx.Process(target=_collective_failure_worker, args=(r, N, port, mode, killed_at, queue, kernels))
             for r in range(N)]
    for p in procs:
        p.start()
    reports, exits = {}, {}
    survivors = [r for r in range(N) if r != VICTIM]
    deadline = time.time() + 300

    def done():  # every survivor reported and exited (a stalled victim is killed below)
        return all(r in reports and r in exits for r in survivors) and (mode == "stall" or VICTIM in exits)

    try:
        while time.time() < deadline and not done():
            try:
                rank, kind, started, when, msg, cause = queue.get(timeout=0.1)
                reports[rank] = (kind, started, when, msg, cause)
            except Exception:  # noqa: BLE001 - queue.Empty
                pass
            for r, p in enumerate(procs):
                if r not in exits and p.exitcode is not None:
                    exits[r] = (p.exitcode, time.time())
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    return reports, exits, killed_at.value


@pytest.mark.parametrize("mode,kernels", [("die", "torch"), ("stall", "torch"), ("die", "cpp"), ("stall", "cpp")])
def test_survivors_fail_within_the_timeout_when_a_rank_dies_or_stalls(mode, kernels):
    """A rank exits (os._exit) or stalls at step 5: every survivor raises a clear
    CollectiveError within timeout_s (+ margin for a loaded machine) and its process ends."""
    _rank_env(kernels)
    reports, exits, killed_at = _run_with_victim(mode, kernels)
    assert killed_at > 0, f"the victim never reached step {BAD_STEP}: reports={reports} exits={exits}"
    survivors = [r for r in range(N) if r != VICTIM]
    margin = 15.0
    for r in survivors:
        assert r in reports, f"rank {r} never reported (hung?): reports={reports} exits={exits}"
        kind, started, when, msg, cause = reports[r]
        assert kind == "CollectiveError", f"rank {r}: {kind}: {msg}"
        elapsed = when - killed_at
        assert elapsed <= TIMEOUT_S + margin, f"rank {r} failed {elapsed:.1f} s after the victim stopped"
        if mode == "stall":  # only the timeout can end the wait on a live but silent peer
            waited = when - started
            assert waited >= TIMEOUT_S - 0.2, f"rank {r} failed after {waited:.1f} s in step {BAD_STEP}, before the timeout"
            # The first survivor to time out exits and closes its connections, so a second survivor may
            # see that closure instead of its own timeout, at the same moment: both are the timeout's doing.
            timed_out = [q for q in survivors if "timed out" in reports.get(q, ("",) * 4)[3].lower()]
            assert timed_out, f"no survivor reports a timeout: {reports}"
            low = msg.lower()
            # gloo words it "timed out", "Connection closed", "reset" or "timeout caused pair closure"
            assert any(w in low for w in ("timed out", "closed", "closure", "reset")), msg
        # the message names the collective, the group size and the timeout
        assert "LionCub: all_reduce (control," in msg or "LionCub: all_to_all (1bit," in msg \
            or "LionCub: all_gather (1bit," in msg, msg
        assert "of a group of 3 ranks" in msg and "collective timeout: 5 s" in msg, msg
        assert cause and cause != "None"  # the backend's error is chained
        assert r in exits, f"rank {r} did not exit after its error (hung on the way out?)"
        assert exits[r][1] - when <= 60, f"rank {r} took {exits[r][1] - when:.1f} s to exit after its error"
    if mode == "die":
        assert exits.get(VICTIM, (None,))[0] == 17


# ============================================================================ checkpoints
def _trained(steps=3, seed=0, shape=(6, 9)):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(shape[0], shape[1]), torch.nn.Linear(shape[1], 2))
    opt = LionCub(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(torch.randn(4, shape[0], generator=gen)), torch.randn(4, 2, generator=gen)).backward()
        opt.step()
    return model, opt


def _state_snapshot(opt):
    moms = [opt.state[p]["exp_avg"].clone() for g in opt.param_groups for p in g["params"] if "exp_avg" in opt.state[p]]
    return moms, opt.step_count, [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups]


def _assert_state_equal(opt, snap):
    moms, count, groups = snap
    now = _state_snapshot(opt)
    assert len(now[0]) == len(moms) and all(torch.equal(a, b) for a, b in zip(now[0], moms)), "momenta changed"
    assert now[1] == count and now[2] == groups


@pytest.fixture
def saved(tmp_path):
    model, opt = _trained(steps=3, seed=1)
    path = checkpoint.save(opt, str(tmp_path))
    assert os.path.basename(path) == "lioncub-rank00000-of-00001.pt"
    other_model, other = _trained(steps=2, seed=2)  # the running optimizer a bad load must not touch
    return str(tmp_path), path, opt, other


@pytest.mark.unit
def test_checkpoint_roundtrip(saved):
    directory, path, opt, other = saved
    checkpoint.load(other, directory)
    _assert_state_equal(other, _state_snapshot(opt))
    assert [f for f in os.listdir(directory) if f.startswith(".tmp")] == []


def _momentum_offset(data: bytes, opt) -> int:
    m = next(iter(opt.state.values()))["exp_avg"]
    pos = data.find(m.reshape(-1)[:8].numpy().tobytes())
    assert pos > 0
    return pos


@pytest.mark.unit
@pytest.mark.parametrize("damage", ["flip-tensor-byte", "flip-pickle-byte", "truncate-half", "truncate-tail",
                                    "empty", "garbage", "zeroed-middle"])
def test_corrupted_or_truncated_file_raises_and_leaves_state(saved, damage):
    directory, path, opt, other = saved
    data = bytearray(open(path, "rb").read())
    if damage == "flip-tensor-byte":
        data[_momentum_offset(bytes(data), opt) + 5] ^= 0x10  # torch.load does not notice this one
    elif damage == "flip-pickle-byte":
        data[120] ^= 0xFF
    elif damage == "truncate-half":
        data = data[:len(data) // 2]
    elif damage == "truncate-tail":
        data = data[:-10]
    elif damage == "empty":
        data = b""
    elif damage == "garbage":
        data = bytes(range(256)) * 8
    elif damage == "zeroed-middle":
        mid = len(data) // 2
        data[mid:mid + 64] = bytes(64)
    with open(path, "wb") as f:
        f.write(bytes(data))
    snap = _state_snapshot(other)
    with pytest.raises(CheckpointError, match=r"lioncub-rank00000-of-00001\.pt (is corrupted|is not a LionCub)"):
        checkpoint.load(other, directory)
    _assert_state_equal(other, snap)


class _Payload:
    """Not a tensor, dict or number: weights_only=True must refuse to unpickle it."""

    def __reduce__(self):
        return (print, ("this must never run",))


@pytest.mark.unit
def test_foreign_and_unsafe_files_are_refused(saved, capsys):
    directory, path, opt, other = saved
    snap = _state_snapshot(other)
    torch.save({"kind": "lioncub_optimizer_state", "format": 2, "evil": _Payload()}, path)
    with pytest.raises(CheckpointError, match="is corrupted or truncated.*(Unpickl|[Ww]eights only)"):
        checkpoint.load(other, directory)
    assert "this must never run" not in capsys.readouterr().out
    torch.save({"step": 3, "exp_avg": torch.zeros(3)}, path)
    with pytest.raises(CheckpointError, match="is not a LionCub optimizer checkpoint"):
        checkpoint.load(other, directory)
    _assert_state_equal(other, snap)


@pytest.mark.unit
def test_missing_directory_content(tmp_path):
    _, opt = _trained(steps=1)
    with pytest.raises(CheckpointError, match="no LionCub checkpoint files in"):
        checkpoint.load(opt, str(tmp_path))
    with pytest.raises(CheckpointError, match="file not found"):
        checkpoint.read(str(tmp_path / "nope.pt"))
    with pytest.raises(ValueError, match="reshard='mean' is not allowed; allowed: average, error"):
        checkpoint.load(opt, str(tmp_path), reshard="mean")


@pytest.mark.unit
def test_format_version_mismatch(saved):
    directory, path, opt, other = saved
    payload = torch.load(path, weights_only=True)
    snap = _state_snapshot(other)
    for fmt in (99, 0, None, "2"):
        bad = dict(payload, format=fmt)
        checkpoint.atomic_torch_save(bad, path)
        with pytest.raises(CheckpointError, match=f"has checkpoint format {fmt!r}; this lioncub_ds reads formats"):
            checkpoint.load(other, directory)
        _assert_state_equal(other, snap)
    # a format-1 file (written before the digest existed) still loads
    legacy = {k: v for k, v in payload.items() if k != "sha256"}
    legacy["format"] = 1
    checkpoint.atomic_torch_save(legacy, path)
    checkpoint.load(other, directory)
    _assert_state_equal(other, _state_snapshot(opt))


@pytest.mark.unit
def test_mismatched_parameters(saved, tmp_path):
    directory, path, opt, other = saved
    _, wider = _trained(steps=1, shape=(6, 7))
    snap = _state_snapshot(wider)
    with pytest.raises(CheckpointError, match=r"parameter #0 has shape \(9, 6\) in the checkpoint but \(7, 6\) in the optimizer"):
        checkpoint.load(wider, directory)
    _assert_state_equal(wider, snap)
    torch.manual_seed(0)
    lone = torch.nn.Linear(6, 9)
    small = LionCub(lone.parameters(), lr=1e-2)
    with pytest.raises(CheckpointError, match="holds state for 4 parameters; the optimizer has 2"):
        checkpoint.load(small, directory)
    # a file whose shapes list matches but whose momentum does not (crafted, with a valid digest)
    payload = torch.load(path, weights_only=True)
    payload.pop("sha256")
    payload["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3, 3)
    payload["sha256"] = checkpoint.payload_digest(payload)
    checkpoint.atomic_torch_save(payload, path)
    snap = _state_snapshot(other)
    with pytest.raises(CheckpointError, match=r"the momentum of parameter #0 has shape \(3, 3\); the parameter has \(9, 6\)"):
        checkpoint.load(other, directory)
    _assert_state_equal(other, snap)


def test_world_size_change_error_or_average(nonfinite_run):
    results, directory, _ = nonfinite_run
    files = sorted(f for f in os.listdir(directory) if f.endswith(".pt"))
    assert files == [f"lioncub-rank{r:05d}-of-00003.pt" for r in range(N)]
    saved = [r["saved_momenta"] for r in results]
    assert not all(torch.equal(saved[0][0], s[0]) for s in saved)  # momenta differ per rank (local data)
    # this process is a world of 1
    model, opt = _fresh(comm="1bit")
    gen = torch.Generator().manual_seed(9)
    _backward(model, gen)
    opt.step()
    snap = _state_snapshot(opt)
    with pytest.raises(CheckpointError, match=r": the voters change from 3 to 1 \(saved with .* on 3 ranks; this run "
                                              r"has .* on 1 ranks\).*pass reshard='average'"):
        checkpoint.load(opt, directory, reshard="error")
    _assert_state_equal(opt, snap)
    checkpoint.load(opt, directory, reshard="average")
    for i, p in enumerate(model.parameters()):
        mean = sum(s[i].float() for s in saved) / N
        assert torch.equal(opt.state[p]["exp_avg"], mean), f"param {i}: not the mean of the 3 ranks' momenta"
    assert opt.step_count == results[0]["saved_step"] == 7
    # a directory with two world sizes is refused
    checkpoint.save(opt, directory)  # adds lioncub-rank00000-of-00001.pt ... which now matches this rank
    os.rename(os.path.join(directory, "lioncub-rank00000-of-00001.pt"), os.path.join(directory, "lioncub-rank00001-of-00002.pt"))
    with pytest.raises(CheckpointError, match=r"mixes checkpoints of world sizes \[2, 3\]"):
        checkpoint.load(opt, directory)


def _tmp_files(directory):
    return [f for f in os.listdir(directory) if f.startswith(".tmp")]


@pytest.mark.unit
def test_failed_save_leaves_no_temporary_file_and_keeps_the_old_one(saved, monkeypatch):
    directory, path, opt, other = saved
    before = open(path, "rb").read()
    real_save = torch.save

    def disk_full(obj, f, *a, **k):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(opt, directory)
    monkeypatch.setattr(torch, "save", real_save)
    assert _tmp_files(directory) == []
    assert open(path, "rb").read() == before

    # an object that cannot be serialized (e.g. a lambda smuggled into the state)
    def bad_state_dict():
        sd = LionCub.state_dict(opt)
        sd["lioncub"]["hook"] = lambda: None
        return sd

    monkeypatch.setattr(opt, "state_dict", bad_state_dict)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        checkpoint.save(opt, directory)
    assert _tmp_files(directory) == []
    assert open(path, "rb").read() == before

    # interrupted (Ctrl-C) half-way through the write
    def interrupted(obj, f, *a, **k):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.atomic_torch_save({"x": 1}, path)
    monkeypatch.setattr(torch, "save", real_save)
    assert _tmp_files(directory) == []
    checkpoint.load(other, directory)  # the old file is intact and loads
    monkeypatch.undo()
    _assert_state_equal(other, _state_snapshot(opt))


@pytest.mark.unit
def test_checkpoint_payload_loads_with_weights_only(saved):
    _, path, _, _ = saved
    payload = checkpoint.read(path)
    assert payload["kind"] == "lioncub_optimizer_state" and payload["format"] == checkpoint.FORMAT_VERSION
    buf = io.BytesIO(open(path, "rb").read())
    torch.load(buf, weights_only=True)  # no custom classes inside


@pytest.mark.unit
def test_reshard_refuses_rank_files_from_different_steps(saved, tmp_path):
    """Averaging needs one consistent save: rank files of different steps (a save that died
    half-way through the ranks) are refused; consistent ones average."""
    directory, path, opt, other = saved
    payload = torch.load(path, weights_only=True)
    two = tmp_path / "two"
    for r, step in ((0, 3), (1, 2)):
        pl = {k: v for k, v in payload.items() if k != "sha256"}
        pl.update(rank=r, world_size=2)
        pl["optimizer"] = dict(pl["optimizer"], lioncub=dict(pl["optimizer"]["lioncub"], step=step))
        pl["optimizer"]["state"] = {i: dict(st, exp_avg=st["exp_avg"] * (r + 1)) for i, st in payload["optimizer"]["state"].items()}
        pl["sha256"] = checkpoint.payload_digest(pl)
        checkpoint.atomic_torch_save(pl, checkpoint.rank_file(str(two), r, 2))
    snap = _state_snapshot(other)
    with pytest.raises(CheckpointError, match=r"the 2 rank files were saved at different steps \[2, 3\]"):
        checkpoint.load(other, str(two))
    _assert_state_equal(other, snap)
    # same step on both: the mean, i.e. 1.5x rank 0's momenta
    pl = checkpoint.read(checkpoint.rank_file(str(two), 1, 2))
    pl["optimizer"]["lioncub"]["step"] = 3
    pl["sha256"] = checkpoint.payload_digest(pl)
    checkpoint.atomic_torch_save(pl, checkpoint.rank_file(str(two), 1, 2))
    checkpoint.load(other, str(two))
    for i, p in enumerate(q for g in other.param_groups for q in g["params"]):
        m0 = payload["optimizer"]["state"][i]["exp_avg"]
        assert torch.equal(other.state[p]["exp_avg"], (m0 + m0 * 2) / 2)
    assert other.step_count == 3


# ============================================================================ a bad checkpoint on some ranks
BAD_FILE_CASES = ("flip-byte", "truncate", "missing", "foreign")


def _bad_checkpoint_scenario(rank, n, directory):
    """Every rank saves; then ONE rank's file is damaged. Every rank must raise CheckpointError
    (the ranks with a good file too: the error is agreed before anyone raises), leave its state
    untouched, and the ranks must still step together afterwards."""
    out = {}
    for case in BAD_FILE_CASES:
        d = os.path.join(directory, case)
        model, opt = _fresh(comm="1bit")
        gen = torch.Generator().manual_seed(600 + rank)
        for _ in range(2):
            _backward(model, gen)
            opt.step()
        checkpoint.save(opt, d)
        dist.barrier()
        if rank == 1:
            path = checkpoint.rank_file(d, 1, n)
            data = bytearray(open(path, "rb").read())
            if case == "flip-byte":
                m = opt.state[next(iter(model.parameters()))]["exp_avg"]
                pos = bytes(data).find(m.reshape(-1)[:8].numpy().tobytes())
                data[pos + 3] ^= 0x20
                open(path, "wb").write(bytes(data))
            elif case == "truncate":
                open(path, "wb").write(bytes(data[: len(data) // 2]))
            elif case == "missing":
                os.remove(path)
            else:
                torch.save({"step": 3, "exp_avg": torch.zeros(3)}, path)
        dist.barrier()
        snap = (_momenta(opt, model), opt.step_count)
        try:
            checkpoint.load(opt, d)
            err = None
        except CheckpointError as exc:
            err = str(exc)
        except Exception as exc:  # noqa: BLE001 - any other error type is a failure of the rule
            err = f"NOT A CheckpointError: {type(exc).__name__}: {exc}"
        unchanged = _same(snap[0], _momenta(opt, model)) and snap[1] == opt.step_count
        _backward(model, gen)
        opt.step()  # the ranks are still in step with each other
        out[case] = {"error": err, "unchanged": unchanged, "identical": _identical_across_ranks(model)}
    return out


def test_a_bad_checkpoint_file_on_one_rank_raises_on_every_rank(tmp_path):
    results = run_ranks(_bad_checkpoint_scenario, N, str(tmp_path), timeout=600, env=_rank_env("torch"))
    for rank, res in enumerate(results):
        for case in BAD_FILE_CASES:
            r = res[case]
            assert r["error"] is not None, f"rank {rank}, {case}: no CheckpointError (only rank 1's file is bad)"
            assert not r["error"].startswith("NOT A"), (rank, case, r["error"])
            assert r["unchanged"] and r["identical"], (rank, case, r)
        # the rank whose file is damaged names it; the others say which rank's file failed
        if rank == 1:
            assert "lioncub-rank00001-of-00003.pt" in res["flip-byte"]["error"], res["flip-byte"]["error"]


@pytest.mark.unit
@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_checkpoint_files_get_the_mode_a_plain_open_gives(tmp_path, umask):
    """0666 less the umask, as torch.save(path) would write (a temporary file's 0600 survived the
    rename: a copy job or another user on shared storage could not read the checkpoint)."""
    old = os.umask(umask)
    try:
        path = str(tmp_path / "f.pt")
        checkpoint.atomic_torch_save({"x": torch.ones(3)}, path)
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask
    assert _tmp_files(str(tmp_path)) == []


@pytest.mark.unit
def test_param_groups_of_another_structure_are_refused_before_anything_loads(tmp_path):
    """The same shapes in all, split into other groups: prepare_load refuses (a CheckpointError that
    every rank agrees on), not torch's ValueError after an integration loaded the rest."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
    opt = LionCub(ps, lr=1e-3)
    for p in ps:
        p.grad = torch.randn(4)
    opt.step()
    checkpoint.save(opt, str(tmp_path))
    qs = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
    new = LionCub([{"params": qs[:2]}, {"params": qs[2:], "weight_decay": 0.0}], lr=1e-3)
    with pytest.raises(CheckpointError, match=r"param groups hold \[3\] parameters, the optimizer's \[2, 1\]"):
        checkpoint.prepare_load(new, str(tmp_path))
    assert len(new.state) == 0 and new.step_count == 0


def _node_shard_damaged(rank, world_size, directory, how):
    """Node voters 1 x 2: save, then rank 1's file gets a NaN (or a short) momentum shard with a
    valid digest; the load must raise on both ranks with nothing changed."""
    from lioncub_ds.checkpoint import atomic_torch_save, payload_digest
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(37)), torch.nn.Parameter(torch.randn(5, 3))]
    opt = LionCub(ps, lr=1e-3, comm="1bit", voters="node", node_size=2)
    for step in range(2):
        g = torch.Generator().manual_seed(10 * rank + step)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    path = checkpoint.save(opt, directory)
    dist.barrier()
    if rank == 1:
        payload = torch.load(path, weights_only=True)
        payload.pop("sha256")
        shards = payload["optimizer"]["lioncub"]["node"]["momentum"]
        k = sorted(shards)[0]
        if how == "nan":
            shards[k][0] = float("nan")
        else:
            shards[k] = shards[k][:-1].clone()
        payload["sha256"] = payload_digest(payload)
        atomic_torch_save(payload, path)
    dist.barrier()
    before = [t.clone() for t in opt.momenta.shards["momentum"].values()]
    try:
        checkpoint.load(opt, directory)
        err = None
    except CheckpointError as exc:
        err = str(exc)
    after = list(opt.momenta.shards["momentum"].values())
    return {"error": err, "unchanged": all(torch.equal(a, b) for a, b in zip(before, after))}


@pytest.mark.parametrize("how", ["nan", "short"])
def test_a_damaged_node_voter_shard_is_refused_on_every_rank(tmp_path, how):
    res = run_ranks(_node_shard_damaged, 2, str(tmp_path), how, timeout=240, env={"LIONCUB_KERNELS": "torch"})
    want = "non-finite" if how == "nan" else "elements; this rank's shard of that bucket has"
    assert want in (res[1]["error"] or ""), res[1]
    assert res[0]["error"] is not None, "rank 0 went on while rank 1 refused"
    assert res[0]["unchanged"] and res[1]["unchanged"]


def _stale_file_of_another_run(rank, world_size, directory):
    """Run A saves at step 3 on both ranks; run B (other data) saves at step 3 on rank 0 only (rank 1
    was killed before its save): rank 1's file is run A's. The load must refuse on both ranks."""
    def model():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(64)), torch.nn.Parameter(torch.randn(8, 8))]

    for run, seed in (("A", 1), ("B", 2)):
        ps = model()
        opt = LionCub(ps, lr=1e-3, comm="1bit")
        for step in range(1, 4):
            g = torch.Generator().manual_seed(1000 * rank + step + 7919 * seed)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        if run == "A" or rank == 0:
            checkpoint.save(opt, directory)
        dist.barrier()
    fresh = LionCub(model(), lr=1e-3, comm="1bit")
    try:
        checkpoint.load(fresh, directory)
        return {"error": None, "state": len(fresh.state)}
    except CheckpointError as exc:
        return {"error": str(exc), "state": len(fresh.state)}


def test_a_rank_file_left_by_another_run_at_the_same_step_is_refused(tmp_path):
    res = run_ranks(_stale_file_of_another_run, 2, str(tmp_path), timeout=240, env={"LIONCUB_KERNELS": "torch"})
    for r in res:
        assert r["error"] is not None and "come from different saves" in r["error"], r
        assert r["state"] == 0


@pytest.mark.unit
def test_frozen_one_byte_parameters_do_not_stop_a_save(tmp_path):
    """A frozen uint8 (quantized) weight of an odd size beside trainable ones: the save's checksum
    covers the voting parameters only and reads any dtype."""
    w = torch.nn.Parameter(torch.randint(0, 255, (7,), dtype=torch.uint8), requires_grad=False)
    p = torch.nn.Parameter(torch.randn(5))
    opt = LionCub([p, w], lr=1e-3)
    p.grad = torch.randn(5)
    opt.step()
    checkpoint.save(opt, str(tmp_path))
    fresh = LionCub([torch.nn.Parameter(p.detach().clone()), w], lr=1e-3)
    checkpoint.load(fresh, str(tmp_path))
    assert torch.equal(fresh.state[fresh.param_groups[0]["params"][0]]["exp_avg"], opt.state[p]["exp_avg"])


def _frozen_per_rank_value(rank, world_size, directory):
    """A frozen Parameter holding a per-rank value (never stepped, ignored by the replica check):
    the same run's checkpoint loads again."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(9))
    stat = torch.nn.Parameter(torch.full((3,), float(rank)), requires_grad=False)
    opt = LionCub([p, stat], lr=1e-3, comm="1bit")
    p.grad = torch.randn(9, generator=torch.Generator().manual_seed(rank))
    opt.step()
    checkpoint.save(opt, directory)
    dist.barrier()
    checkpoint.load(opt, directory)
    return "loaded"


def test_a_frozen_parameter_that_differs_across_ranks_does_not_refuse_the_load(tmp_path):
    assert run_ranks(_frozen_per_rank_value, 2, str(tmp_path), timeout=240,
                     env={"LIONCUB_KERNELS": "torch"}) == ["loaded", "loaded"]
