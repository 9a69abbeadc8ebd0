"""Test-side defaults for the one rank spawner (lioncub_ds.testing): the NCCL contract is ON.

``LIONCUB_NCCL_CONTRACT=0`` turns the contract off for a whole run; ``run_ranks(...,
contract=False)`` for one launch.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from lioncub_ds.testing import RankError, free_port, nccl_contract  # noqa: F401 - re-exported
from lioncub_ds.testing import run_ranks as _run_ranks

CONTRACT_DEFAULT = os.environ.get("LIONCUB_NCCL_CONTRACT", "1") != "0"


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0, env: dict | None = None,
              contract: bool | None = None, **kw):
    """``lioncub_ds.testing.run_ranks`` with the NCCL contract on unless turned off."""
    return _run_ranks(fn, world_size, *args, timeout=timeout, env=env,
                      contract=CONTRACT_DEFAULT if contract is None else contract, **kw)


@contextmanager
def recording_optimizer_inits():
    """Yields a list that gets the class name of every torch.optim.Optimizer constructed inside the
    block: an empty list proves that an error came before any optimizer state existed."""
    import torch
    inits = []
    orig = torch.optim.Optimizer.__init__

    def spy(self, *a, **k):
        inits.append(type(self).__name__)
        return orig(self, *a, **k)

    torch.optim.Optimizer.__init__ = spy
    try:
        yield inits
    finally:
        torch.optim.Optimizer.__init__ = orig



class SmallNet(torch.nn.Module):
    """A tiny model with odd sizes whose embedding rows 6..10 no batch uses (c == 0: abstentions)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 5)
        self.fc1 = torch.nn.Linear(5, 13)
        self.fc2 = torch.nn.Linear(13, 3)

    def forward(self, idx):
        return self.fc2(torch.tanh(self.fc1(self.emb(idx).mean(1))))
