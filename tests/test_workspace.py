"""The step's buffers kept across steps (lioncub_ds.sharding.Workspace, used by node voters): the
same buffer comes back while its size, dtype and device hold, a new one when they change, and
``zero=True`` clears it. The node-voter oracle tests (test_node_voters.py) check that the reuse
changes no bit of the step, including a parameter that has a gradient on some steps only."""
import pytest
import torch

from lioncub_ds.sharding import Workspace

pytestmark = pytest.mark.unit


def test_the_same_buffer_comes_back_while_its_shape_holds():
    ws = Workspace()
    a = ws.get("send", 0, 37, torch.bfloat16, "cpu")
    assert a.dtype == torch.bfloat16 and a.numel() == 37 and not a.any()
    a.fill_(3)
    b = ws.get("send", 0, 37, torch.bfloat16, "cpu")
    assert b.data_ptr() == a.data_ptr() and torch.all(b == 3)   # kept, not cleared
    assert ws.get("send", 1, 37, torch.bfloat16, "cpu").data_ptr() != a.data_ptr()  # per bucket
    assert ws.get("grad", 0, 37, torch.bfloat16, "cpu").data_ptr() != a.data_ptr()  # per name


@pytest.mark.parametrize("change", [dict(numel=38), dict(dtype=torch.float32)])
def test_a_new_buffer_when_size_or_dtype_changes(change):
    ws = Workspace()
    spec = dict(numel=37, dtype=torch.bfloat16)
    ws.get("work", 2, spec["numel"], spec["dtype"], "cpu").fill_(1)
    spec.update(change)
    c = ws.get("work", 2, spec["numel"], spec["dtype"], "cpu")
    assert c.numel() == spec["numel"] and c.dtype == spec["dtype"] and not c.any()


def test_zero_clears_a_kept_buffer():
    ws = Workspace()
    ws.get("send", 0, 5, torch.float32, "cpu").fill_(-2)
    d = ws.get("send", 0, 5, torch.float32, "cpu", zero=True)
    assert torch.equal(d, torch.zeros(5))
