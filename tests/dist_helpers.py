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


def disagreement(votes: torch.Tensor, delta: torch.Tensor) -> tuple[int, int]:
    """A voter's drift-signal counts by plain comparison (an oracle's, not lioncub_ds's packed
    planes): (its votes that disagree with Δ where both are nonzero, the coordinates where both are)."""
    cast = (votes != 0) & (delta != 0)
    return int((cast & (votes != delta)).sum()), int(cast.sum())


class DriftDecisions:
    """momentum_sync schedule="drift" replayed by an oracle over ``world_size`` ranks: :meth:`step`
    takes each applied step's summed signal (every rank's :meth:`units`) and says whether the sync
    after that step runs; ``rows`` keeps per step what comm_stats()["momentum_sync"] should say after
    it: (the step whose signal was read, that summed signal, syncs so far, the last sync's step).
    The rule is lioncub_ds's own DriftTrigger; the signal is the oracle's."""

    def __init__(self, sync, world_size: int):
        from lioncub_ds.config import MomentumSyncConfig
        from lioncub_ds.momentum_sync import DriftTrigger, drift_scale
        self.cfg = MomentumSyncConfig.from_value(sync)
        self.trigger = DriftTrigger(self.cfg.threshold, self.cfg.min_every, world_size)
        self.scale = drift_scale(world_size)
        self.unit = world_size * self.scale  # comm_stats' signal (a mean fraction) times this = the sum
        self.rows, self.prev, self.syncs, self.last = [], None, 0, 0

    def units(self, differ: int, both: int) -> int:
        """One rank's disagreement fraction in drift units (floored; 0 where it cast no vote)."""
        return differ * self.scale // both if both else 0

    def step(self, step: int, summed: int) -> bool:
        """Applied step ``step`` (1-based) had the summed signal ``summed``: whether its sync runs."""
        from lioncub_ds.momentum_sync import drift_due
        if step > 1:  # the previous step's signal is read with this step's flags
            self.trigger.observe(step - 1, self.prev)
        synced = drift_due(self.cfg, self.trigger, step - 1)  # after this step's momentum update
        if synced:
            self.trigger.synced(step)
            self.syncs, self.last = self.syncs + 1, step
        self.rows.append((step - 1, self.prev, self.syncs, self.last) if step > 1
                         else (None, None, self.syncs, self.last))
        self.prev = int(summed)
        return synced


class SmallNet(torch.nn.Module):
    """A tiny model with odd sizes whose embedding rows 6..10 no batch uses (c == 0: abstentions)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 5)
        self.fc1 = torch.nn.Linear(5, 13)
        self.fc2 = torch.nn.Linear(13, 3)

    def forward(self, idx):
        return self.fc2(torch.tanh(self.fc1(self.emb(idx).mean(1))))
