"""torch.distributed.checkpoint (DCP) for an FSDP2 model and its :class:`LionCubFSDP`.

One checkpoint holds the model (FSDP2's sharded state dict: the replicas of a shard are identical
across shard groups, so DCP writes each piece once) and the optimizer's
:meth:`~lioncub_ds.fsdp.LionCubFSDP.sharded_state_dict`: every shard group's momenta (each group
is a voter with its own), the step counters (the tie rule's step) and the layout. A load first
reads the layout alone and refuses another shard size by name; then DCP loads the model in place
and the optimizer's state into fresh tensors, and the optimizer takes them: resume is bit-exact (the
momentum sync's schedule and counters included).
"""
from __future__ import annotations

import json

import torch

from .optimizer import check_layout


def save(checkpoint_id, model: torch.nn.Module, optimizer, **dcp_kwargs) -> None:
    """``dcp.save({"model": ..., "optim": ...})``. Collective: every rank."""
    import torch.distributed.checkpoint as dcp
    dcp.save({"model": model.state_dict(), "optim": optimizer.sharded_state_dict()}, checkpoint_id=checkpoint_id,
             **dcp_kwargs)


def load(checkpoint_id, model: torch.nn.Module, optimizer, **dcp_kwargs) -> None:
    """Load what :func:`save` wrote into ``model`` (in place: FSDP2's shards keep their storage)
    and ``optimizer``. Collective: every rank. Raises LionCubConfigError on every rank, before
    anything is loaded, when the checkpoint's shard size, voters or parameters differ."""
    import torch.distributed.checkpoint as dcp
    mine = optimizer.fsdp_layout()
    probe = {"optim": {"layout": mine}}  # read first, alone: the same file on every rank
    dcp.load(probe, checkpoint_id=checkpoint_id, **dcp_kwargs)
    check_layout(probe["optim"]["layout"], mine)
    sd = {"model": model.state_dict(), "optim": optimizer.sharded_state_dict(placeholders=True)}
    if json.loads(probe["optim"]["layout"]).get("format", 1) < 2:  # saved before the momentum sync's state was
        sd["optim"].pop("momentum_sync")                            # in it: this run's own schedule goes on
    dcp.load(sd, checkpoint_id=checkpoint_id, **dcp_kwargs)
    model.load_state_dict(sd["model"])  # DCP filled FSDP2's own tensors; this copies nothing new in
    optimizer.load_sharded_state_dict(sd["optim"])
