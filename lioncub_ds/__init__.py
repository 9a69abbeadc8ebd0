"""lioncub_ds: communication-efficient distributed Lion (Lion Cub) for DeepSpeed and Megatron.

Public API: :class:`Lion` (reference), :class:`LionCub` (distributed), :mod:`checkpoint`
helpers. DeepSpeed registration lives in ``lioncub_ds.deepspeed``; Megatron's factory in
``lioncub_ds.megatron``; neither is imported here (start-up stays cheap).

The names below are imported on first use (PEP 562), so ``import lioncub_ds`` needs no torch:
``python -m lioncub_ds.plan`` runs on a machine that has none (its README command comes first,
before ``make setup``).
"""
from __future__ import annotations

import importlib
import importlib.util

__version__ = "0.1.0"

# public name -> the module (relative to this package) that defines it
_EXPORTS = {"Lion": ".lion", "LionCub": ".optimizer", "LionCubConfig": ".config",
            "LionCubConfigError": ".config", "NonFiniteError": ".optimizer", "ReplicaDriftError": ".optimizer",
            "CheckpointError": ".checkpoint", "CollectiveError": ".comm.base", "StepInputError": ".errors"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    # ``import lioncub_ds; lioncub_ds.kernels...`` worked while this file imported the runtime
    # eagerly (which imported the submodules): keep it working for any submodule
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
