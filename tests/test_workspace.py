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


def test_a_ring_slot_serves_every_bucket_at_its_position_modulo_the_window():
    ws = Workspace(window=3)
    caps = [40, 16, 8]  # bytes
    a, other = ws.ring("send", 0, 7, 5, torch.float32, "cpu", caps[0])
    assert not other and not a.any()  # new: zeroed, and nobody else had it
    a.fill_(7)
    b, other = ws.ring("send", 3, 8, 9, torch.float32, "cpu", caps[0])  # position 3: slot 0 again
    assert other and b.data_ptr() == a.data_ptr() and b.numel() == 9 and torch.all(b[:5] == 7)  # not cleared
    assert not ws.ring("send", 3, 8, 9, torch.float32, "cpu", caps[0])[1]  # the same bucket again
    c, other = ws.ring("send", 3, 7, 20, torch.bfloat16, "cpu", caps[0])  # another dtype in the same bytes
    assert other and c.data_ptr() == a.data_ptr() and c.dtype == torch.bfloat16 and c.numel() == 20
    assert ws.ring("send", 1, 9, 4, torch.float32, "cpu", caps[1])[0].data_ptr() != a.data_ptr()
    assert ws.ring("received", 0, 7, 5, torch.float32, "cpu", caps[0])[0].data_ptr() != a.data_ptr()  # per name
    assert ws.nbytes() == caps[0] + caps[1] + caps[0]
    # a larger capacity asked for remakes the slot (zeroed)
    d = ws.ring("send", 0, 7, 12, torch.float32, "cpu", 48)[0]
    assert d.data_ptr() != a.data_ptr() and not d.any()


def test_padding_is_what_no_parameter_covers():
    from types import SimpleNamespace

    from lioncub_ds.sharding import padding_of

    b = SimpleNamespace(params=[torch.empty(5), torch.empty(8), torch.empty(1)], offsets=[0, 8, 16], numel=32)
    assert padding_of(b) == [(5, 8), (17, 32)]
    full = SimpleNamespace(params=[torch.empty(16)], offsets=[0], numel=16)
    assert padding_of(full) == []


def test_ring_capacity_is_each_slots_largest_bucket():
    from types import SimpleNamespace

    from lioncub_ds.sharding import ring_capacity

    def bucket(numel, dtype=torch.float32):
        return SimpleNamespace(numel=numel, params=[torch.empty(0, dtype=dtype)])

    sizes = [64, 8, 96, 32, 16, 40, 8]
    assert ring_capacity([bucket(n) for n in sizes], window=4) == [4 * 64, 4 * 40, 4 * 96, 4 * 32]
    assert ring_capacity([bucket(n, torch.bfloat16) for n in sizes[:2]], window=4) == [128, 16, 0, 0]
