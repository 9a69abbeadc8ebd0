"""LionCub on CUDA tensors with several ranks on one GPU (gloo; NCCL cannot put two ranks on one GPU):
every comm at 2 and 4 ranks, node voters (2 x 2) and master-only sharding.

* The replicas are bit-identical after every run, and equal bit for bit to the same run on CPU
  tensors: every fused kernel (C++ on the CPU, CUDA on the GPU) gives the reference's bits, and the
  gradients are made on the CPU from seeds (a model's backward would differ between devices).
* The NCCL contract holds on the GPU run (every collective's tensors on the parameters' device).
* The local half of a step (every bucket's fused local step and abstention payload) and the step's
  flag vector issue no host synchronization (torch's sync debug mode "error"): the step's one host
  read is the flags' after their all-reduce.

Needs a GPU (skipped without one; ``make gpu-check`` runs this file, and a skip fails it there). The
CPU leg (``test_cpu_leg_replicas_agree``) runs everywhere: it is the half of the comparison that needs
no GPU, and keeps the rank functions of this file exercised on CPU machines.
"""
from __future__ import annotations

import pytest
import torch

from dist_helpers import run_ranks

pytestmark = pytest.mark.dist

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="needs a CUDA GPU (torch.cuda.is_available() is False); make gpu-check runs it")

LR, WD, STEPS = 0.01, 0.1, 3
SIZES = [37, (5, 9), 1001, 3, (7, 17)]  # odd sizes; several buckets of bucket_size_mb=0.0002
COMMS = {
    "allgather": dict(comm="allgather"),
    "1bit": dict(comm="1bit"),
    "1bit_average": dict(comm="1bit", vote="average"),
    "pbit": dict(comm="pbit"),
    "int8": dict(comm="int8", quant="l1"),
    "bbit_l1_dither": dict(comm="bbit", quant="l1", vote_bits=2, rounding="dither"),
    "bbit_l0_nearest": dict(comm="bbit", quant="l0", vote_bits=3, rounding="nearest"),
}
FOUR_RANKS = {
    **COMMS,
    "node_voters_2x2_1bit": dict(comm="1bit", voters="node", node_size=2),
    "node_voters_2x2_bbit": dict(comm="bbit", quant="l1", voters="node", node_size=2),
    "master_only_1bit_bf16": dict(comm="1bit", node_size=2, dtype=torch.bfloat16),
    # node voters' overlap path (its reduce-scatters issued at step(): the gradients here are set,
    # not accumulated by a backward) with double-buffered momentum shards, bf16 with fp32 masters
    "node_voters_2x2_overlap_bf16": dict(comm="1bit", voters="node", node_size=2, overlap=True,
                                         momentum_double_buffer=True, dtype=torch.bfloat16),
}


def _params(device, dtype):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s).to(device, dtype)) for s in SIZES]


def _grad(rank, step, k, shape):
    """Rank ``rank``'s gradient of parameter k at ``step`` (the same on every device): a few exact zeros
    (abstentions) and, at step 2, rank 1 without a gradient for the last parameter."""
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + k)
    t = torch.randn(shape, generator=g)
    t.view(-1)[::7] = 0.0
    return None if (step == 2 and rank == 1 and k == len(SIZES) - 1) else t


def _run_cases(rank, world_size, device, cases, sync_free_step=None):
    """Every case on this device: STEPS steps of LionCub from the same start; each case's parameters
    after the run (fp32 on the CPU). At ``sync_free_step`` the local half of the step and the flag
    vector run first -- on CUDA under sync debug mode "error" -- then the step as usual (it launches
    the buckets prepared here): the same parameters as without."""
    from lioncub_ds import LionCub

    out = {}
    for name, kw in cases.items():
        kw = dict(kw)
        params = _params(device, kw.pop("dtype", torch.float32))
        opt = LionCub(params, lr=LR, weight_decay=WD, bucket_size_mb=0.0002, **kw)
        for step in range(1, STEPS + 1):
            for k, p in enumerate(params):
                g = _grad(rank, step, k, p.shape)
                p.grad = None if g is None else g.to(device, p.dtype)
            if step == sync_free_step:
                _local_half_first(opt, device)
            opt.step()
        out[name] = torch.cat([p.detach().float().cpu().reshape(-1) for p in params])
    return out


def _local_half_first(opt, device):
    """Every bucket's local step (fused kernel, abstention payload) and the step's flag vector, before
    step(); on CUDA any host synchronization in them raises (torch's sync debug mode "error")."""
    pipe, cuda = opt.plan.pipe, device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(len(opt.plan.buckets)):
            pipe.prepare(i)
        flags = pipe._own_flags(None, False)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
    assert flags.device.type == device and flags.dtype == torch.int32


def _compare(results, reference=None):
    """Every rank's parameters equal rank 0's (and the reference run's, when given), per case."""
    for name, flat in results[0].items():
        for r, res in enumerate(results[1:], 1):
            assert torch.equal(res[name].view(torch.int32), flat.view(torch.int32)), f"{name}: rank {r} != rank 0"
        if reference is not None:
            ref = reference[0][name]
            bad = int((ref.view(torch.int32) != flat.view(torch.int32)).sum())
            assert bad == 0, f"{name}: {bad} of {flat.numel()} parameters differ between the CUDA and the CPU run"


def _cpu_leg(rank, world_size):
    return _run_cases(rank, world_size, "cpu", COMMS), _run_cases(rank, world_size, "cpu", COMMS, sync_free_step=2)


def test_cpu_leg_replicas_agree():
    """The CPU half of the comparisons below, at 2 ranks: replicas identical for every case, also when
    the local half runs before step() (what the sync test does on CUDA), and then equal to the plain run."""
    res = run_ranks(_cpu_leg, 2, timeout=600, env={"OMP_NUM_THREADS": "1"})
    _compare([r[0] for r in res])
    _compare([r[1] for r in res], [res[0][0]])


@needs_gpu
@pytest.mark.parametrize("world", [2, 4])
def test_cuda_runs_equal_the_cpu_runs(world):
    cases = COMMS if world == 2 else FOUR_RANKS
    cuda = run_ranks(_run_cases, world, "cuda", cases, timeout=600, contract=True, device="cuda")
    cpu = run_ranks(_run_cases, world, "cpu", cases, timeout=600, env={"OMP_NUM_THREADS": "1"})
    _compare(cpu)
    _compare(cuda, cpu)


@needs_gpu
def test_local_half_and_flags_never_synchronize():
    res = run_ranks(_run_cases, 2, "cuda", COMMS, 2, timeout=600, contract=True, device="cuda")
    _compare(res)  # the parameters themselves: test_cuda_runs_equal_the_cpu_runs
