"""LionCub on one process (no torch.distributed, or a group of one) is exactly Lion (docs/conventions.md, checked
against a step-by-step numpy oracle and against lion-pytorch); argument checks."""
import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lioncub_ds import LionCub, LionCubConfigError

pytestmark = pytest.mark.unit


LR, WD, BETAS = 2e-3, 0.2, (0.9, 0.99)


# ----------------------------------------------------------------------------- the oracle
# Lion (docs/conventions.md) written out step by step in numpy, sharing no code with lioncub_ds (LionCub and Lion
# both call lioncub_ds.lion.lion, so comparing them with each other proves nothing). Every
# operation is one IEEE fp32 operation with one rounding, in the order docs/conventions.md writes:
#   c = β1·m + (1−β1)·g ;  θ ← θ·(1 − η·λ) − η·sign(c) ;  m ← β2·m + (1−β2)·g
# The scalars are Python doubles rounded once to fp32 (as torch does for a float tensor times a
# Python scalar), 1 − η·λ and 1 − β computed in double first. numpy never fuses a multiply-add,
# so for fp32 the expected agreement is bit for bit.
def _round_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 -> nearest bf16 (ties to even), returned as fp32; finite inputs only."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def _oracle_step(p, m, g, *, lr, wd, betas, p_bf16=False, m_bf16=False):
    """One Lion step on numpy fp32 arrays (bf16 tensors are held as their exact fp32 values)."""
    f = np.float32
    b1, b2 = betas
    c = m * f(b1) + g * f(1.0 - b1)
    c_sign = np.sign(c).astype(np.float32)  # sign(0) = 0: no move
    p = p * f(1.0 - lr * wd)
    if p_bf16:
        p = _round_bf16(p)
    p = p + f(-lr) * c_sign  # exact product (±lr or 0), one rounding in the add
    if p_bf16:
        p = _round_bf16(p)
    m = m * f(b2) + g * f(1.0 - b2)
    if m_bf16:
        m = _round_bf16(m)
    return p, m


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy().copy()


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 31), torch.nn.Tanh(), torch.nn.Linear(31, 7)).to(dtype)


def _check_against_oracle(dtype, mdtype, steps=100, **kw):
    """Train LionCub; before every step run the oracle from the same state on the same gradient
    and require LionCub's parameters and momenta to equal the oracle's bit for bit."""
    model = _model(dtype)
    opt = LionCub(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, momentum_dtype=mdtype, **kw)
    params = list(model.parameters())
    ref_p = [_np(p) for p in params]
    ref_m = [np.zeros(p.shape, np.float32) for p in params]
    gen = torch.Generator().manual_seed(3)
    moved = 0
    for step in range(steps):
        x = torch.randn(8, 9, generator=gen).to(dtype)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        for i, p in enumerate(params):
            assert np.array_equal(_np(p), ref_p[i])  # the oracle's trajectory is LionCub's
            ref_p[i], ref_m[i] = _oracle_step(ref_p[i], ref_m[i], _np(p.grad), lr=LR, wd=WD, betas=BETAS,
                                              p_bf16=dtype == torch.bfloat16, m_bf16=mdtype == torch.bfloat16)
        before = [_np(p) for p in params]
        opt.step()
        for i, p in enumerate(params):
            got = _np(p)
            assert np.array_equal(got, ref_p[i]), (step, i, np.abs(got - ref_p[i]).max())
            assert np.array_equal(_np(opt.state[p]["exp_avg"]), ref_m[i]), (step, i)
            moved += int((got != before[i]).sum())
    assert moved > 0  # the comparison is not vacuous


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mdtype", [torch.float32, torch.bfloat16])
def test_single_process_equals_the_spec_oracle(dtype, mdtype):
    _check_against_oracle(dtype, mdtype, comm="1bit", vote="majority")


def test_group_of_one_equals_the_spec_oracle():
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
        try:
            _check_against_oracle(torch.float32, torch.float32, steps=50, comm="pbit")
        finally:
            dist.destroy_process_group()


def test_oracle_itself_sign_zero_and_decay():
    # the oracle follows docs/conventions.md on hand-computed values: c = 0 does not move, decay is decoupled
    p, m = _oracle_step(np.array([1.0, 1.0, 1.0], np.float32), np.zeros(3, np.float32),
                        np.array([2.0, -3.0, 0.0], np.float32), lr=0.5, wd=0.5, betas=(0.9, 0.99))
    assert p.tolist() == [0.25, 1.25, 0.75]  # 1·(1 − 0.25) ∓ 0.5, and 0.75 where sign(c) = 0
    assert m.tolist() == pytest.approx([0.02, -0.03, 0.0], rel=1e-6)
    assert _round_bf16(np.array([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8], np.float32)).tolist() == \
        [1.0, 1.0 + 2.0 ** -6]  # ties to even


def test_single_process_matches_lion_pytorch_fp32():
    """Against lion-pytorch (an independent implementation, fp32), both fed the same gradients.
    Not bit for bit: lion-pytorch forms c and m with ``add(grad, alpha=1−β)``, which torch's CPU
    kernel evaluates as a fused multiply-add (one rounding instead of two). So momenta agree to a
    few ulp of their typical size (|m| ~ 0.1-1 here, ulp <= 6e-8: rtol 1e-6, atol 1e-7; rtol alone
    fails where m nearly cancels to 0), and a parameter can differ only where c is within a few ulp of 0 and the
    two signs differ: at most a few coordinates, each by a multiple of 2·lr (+ decay rounding)."""
    lion_pytorch = pytest.importorskip("lion_pytorch")
    a, b = _model(torch.float32), _model(torch.float32)
    b.load_state_dict(a.state_dict())
    oa = LionCub(a.parameters(), lr=LR, betas=BETAS, weight_decay=WD, comm="1bit")
    ob = lion_pytorch.Lion(b.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    gen = torch.Generator().manual_seed(5)
    for _ in range(100):
        for pa, pb in zip(a.parameters(), b.parameters()):
            g = torch.randn(pa.shape, generator=gen)
            pa.grad, pb.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    total = mismatched = 0
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(oa.state[pa]["exp_avg"], ob.state[pb]["exp_avg"], rtol=1e-6, atol=1e-7)
        diff = (pa.detach() - pb.detach()).abs()
        total += diff.numel()
        mismatched += int((diff > 1e-6).sum())
        assert float(diff.max()) <= 2 * LR * 3 + 1e-6
    assert mismatched <= max(1, total // 1000), (mismatched, total)


@pytest.mark.parametrize("kwargs, text", [
    ({"vote": "mean"}, r"vote='mean'.*'majority' \| 'average'"),
    ({"comm": "2bit"}, r"comm='2bit'.*'auto' \| 'allgather' \| '1bit' \| 'pbit' \| 'int8'"),
    ({"quant": "l2"}, r"quant='l2'.*'sign' \| 'l1' \| 'l0' \| 'linf'"),
    ({"tie_break": "random"}, r"tie_break='random'.*'zero' \| 'alternate' \| 'hash'"),
    ({"comm": "int8"}, r"comm='int8' needs a scaled quantizer"),
    ({"comm": "1bit", "quant": "l1"}, r"comm='1bit' sends 1-bit signs and needs quant='sign'"),
    ({"quant": "l1", "vote": "average"}, r"vote='average' is not meaningful"),
    ({"momentum_sync": {"evry": 3}}, r"unknown momentum_sync key 'evry' \(did you mean 'every'\?\)"),
    ({"bucket_size_mb": 0}, r"bucket_size_mb=0"),
    ({"pbit_bits": 3, "comm": "pbit"}, r"pbit_bits=3.*1, 2, 4, 8"),
    ({"momentum_dtype": torch.float16}, r"momentum_dtype"),
    ({"tie_brake": "zero"}, r"unknown LionCub argument key 'tie_brake' \(did you mean 'tie_break'\?\)"),
])
def test_invalid_arguments_raise_before_state(kwargs, text):
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(LionCubConfigError, match=text):
        LionCub([p], **kwargs)
    assert torch.equal(p.detach(), torch.ones(3))


def test_state_dict_round_trip_keeps_fp32_momentum_for_bf16_params():
    a = _model(torch.bfloat16)
    opt = LionCub(a.parameters(), lr=1e-3)
    for p in a.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    opt2 = LionCub(a.parameters(), lr=1e-3)
    opt2.load_state_dict(sd)
    for p in a.parameters():
        assert opt2.state[p]["exp_avg"].dtype == torch.float32
        assert torch.equal(opt2.state[p]["exp_avg"], opt.state[p]["exp_avg"])
    assert opt2.step_count == 1
