"""lioncub_ds: communication-efficient distributed Lion (Lion Cub) for DeepSpeed and Megatron.

Public API: :class:`Lion` (reference), :class:`LionCub` (distributed), :mod:`checkpoint`
helpers. DeepSpeed registration lives in ``lioncub_ds.deepspeed``; Megatron's factory in
``lioncub_ds.megatron``; neither is imported here (start-up stays cheap).
"""
from .checkpoint import CheckpointError
from .comm.base import CollectiveError
from .config import LionCubConfig, LionCubConfigError
from .lion import Lion
from .optimizer import LionCub, NonFiniteError, ReplicaDriftError

__version__ = "0.1.0"
__all__ = ["Lion", "LionCub", "LionCubConfig", "LionCubConfigError", "NonFiniteError", "ReplicaDriftError",
           "CheckpointError", "CollectiveError"]
