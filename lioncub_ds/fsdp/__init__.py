"""FSDP2 / HSDP with 1-bit votes (docs/fsdp2.md): FSDP2 shards parameters, gradients and LionCub's
momenta inside a shard group (the fast link) and LionCub votes across the groups on the local
shards, in place of HSDP's gradient all-reduce (the slow link carries 1 bit per element).

    model, opt = lioncub_ds.fsdp.shard_and_vote(model, shard_size=8, lr=3e-5, weight_decay=0.1)

It broadcasts shard group 0's shards to the other groups (every voter starts from the same
weights); a model built on "meta" takes ``init_weights=fn`` (run after sharding and ``to_empty``).

Lower level: :func:`lioncub_ds.groups.make_shard_groups`, ``fully_shard(m, mesh=shard_mesh(sg))``
on the blocks and the root, then :class:`LionCubFSDP`. Checkpoints: :func:`save` / :func:`load`
(torch.distributed.checkpoint). The optimizer core never imports FSDP: only this package does.
"""
from .checkpoint import load, save
from .optimizer import LionCubFSDP, element_start, shard_and_vote, shard_mesh

__all__ = ["LionCubFSDP", "shard_and_vote", "shard_mesh", "element_start", "save", "load"]
