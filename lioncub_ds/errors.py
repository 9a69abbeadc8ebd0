"""The errors a distributed step raises (every rank raises the same one, at the same point)."""
from __future__ import annotations


class NonFiniteError(FloatingPointError):
    """A gradient or momentum was NaN/Inf on some rank and ``nonfinite='raise'``."""


class ReplicaDriftError(RuntimeError):
    """Parameters differ across ranks."""


class StepInputError(RuntimeError):
    """A step's input is unusable on some rank (e.g. a gradient on a parameter frozen at the
    first step, or a learning rate that differs across ranks). Agreed through the step's flags
    (summed over ranks), so every rank raises it together and no rank is left waiting in a
    collective; no state was changed."""
