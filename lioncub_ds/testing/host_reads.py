"""TEST-ONLY: count the host reads of tensor values that lioncub_ds code makes.

On CUDA a host read of a tensor's values (``tolist()``, ``item()``, ``bool(t)``, ``int(t)``,
``float(t)``, an index taken from a tensor) waits for every kernel queued before it: the
NCCL contract allows one small read per step (the flags). On a GPU torch's sync debug mode
checks the kernels' part of that (tests/test_cuda_kernels.py); this counter checks the step's
own logic on any machine, CPU included, where nothing synchronizes: within :func:`counting`,
every such call made *from* a lioncub_ds module is recorded with its place.

Calls from the kernels (``lioncub_ds/kernels/``: the pure-torch reference reads freely on CPU;
the CUDA backend is checked under the sync debug mode) and from this testing package are not
counted, nor are reads made by other libraries.
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch

import lioncub_ds

__all__ = ["counting", "READS"]

# The Tensor methods that hand a tensor's values to the host.
READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy")

_PACKAGE = os.path.dirname(os.path.abspath(lioncub_ds.__file__)) + os.sep
_NOT_COUNTED = tuple(os.path.join(_PACKAGE, d) + os.sep for d in ("kernels", "testing"))


def _counted(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE) and not path.startswith(_NOT_COUNTED)


@contextlib.contextmanager
def counting():
    """Record (method, "module.py:line", shape) of every host read made from lioncub_ds code
    inside the block; yields the list (filled as the block runs). Not thread-safe: one block at
    a time per process."""
    records: list[tuple] = []
    saved = {name: torch.Tensor.__dict__.get(name) for name in READS}

    def wrap(name, orig):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1)
            if _counted(caller.f_code.co_filename):
                where = f"{os.path.relpath(caller.f_code.co_filename, _PACKAGE)}:{caller.f_lineno}"
                records.append((name, where, tuple(self.shape)))
            return orig(self, *args, **kwargs)
        read.__name__ = name
        return read

    for name in READS:
        setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    try:
        yield records
    finally:
        for name, orig in saved.items():
            if orig is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, orig)
