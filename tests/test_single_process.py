"""LionCub on one process (no torch.distributed, or a group of one) is exactly Lion; argument checks."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from lioncub_ds import Lion, LionCub, LionCubConfigError


def _pair(dtype, mdtype, **kw):
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(9, 31), torch.nn.Tanh(), torch.nn.Linear(31, 7)).to(dtype)
    b = torch.nn.Sequential(torch.nn.Linear(9, 31), torch.nn.Tanh(), torch.nn.Linear(31, 7)).to(dtype)
    b.load_state_dict(a.state_dict())
    return a, b, LionCub(a.parameters(), lr=2e-3, weight_decay=0.2, momentum_dtype=mdtype, **kw), \
        Lion(b.parameters(), lr=2e-3, weight_decay=0.2, momentum_dtype=mdtype)


def _train_both(dtype, mdtype, steps=100, **kw):
    a, b, oa, ob = _pair(dtype, mdtype, **kw)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(8, 9, generator=gen).to(dtype)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).float().pow(2).mean().backward()
            o.step()
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mdtype", [torch.float32, torch.bfloat16])
def test_single_process_is_exactly_lion(dtype, mdtype):
    a, b = _train_both(dtype, mdtype, comm="1bit", vote="majority")
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)


def test_group_of_one_is_exactly_lion():
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
        try:
            a, b = _train_both(torch.float32, torch.float32, steps=50, comm="pbit")
            for x, y in zip(a.parameters(), b.parameters()):
                assert torch.equal(x, y)
        finally:
            dist.destroy_process_group()


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
    a, b = _train_both(torch.bfloat16, torch.float32, steps=5, comm="1bit")
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
