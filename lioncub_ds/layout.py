"""The bucket layout of a distributed step: which parameters share a flat vote bucket, where
each sits inside it, and which communication algorithm each bucket uses.

Pure functions of the parameter groups and the settings (no process group, no optimizer), so
the real step (:mod:`lioncub_ds.pipeline`) and the convergence simulation
(:mod:`benchmarks.converge`) build the very same layout: the hash tie rule (the element's
index inside its parameter) and the abstention lists see the same buckets in both.
"""
from __future__ import annotations

from dataclasses import dataclass

from .conventions import padded_numel
from .comm import make_algorithm
from .comm.abstain import next_mode
from .comm.cost import CostModel
from .config import DEFAULT_NETWORK


@dataclass
class Bucket:
    group_index: int
    params: list
    names: list
    offsets: list
    numel: int          # padded to a multiple of 8·N
    real_numel: int
    base: int
    algorithm: object = None
    mask: object = None      # uint8 plane: bit 1 at real elements (abstention lists are relative to it)
    capacity: int = 0        # entries of an abstention list (0: the plane always travels)
    # how abstentions travel this step: "list", "chunks" or "plane" (agreed through the flags); None
    # where nothing abstention-related travels (int8)
    mode: str | None = "list"
    # index inside its parameter of each parameter's (piece's) first element: None when every
    # parameter lies whole in the bucket (node voters' shards hold pieces; the hash tie rule keys on it)
    param_starts: list | None = None
    lengths: list | None = None   # elements of each piece (None: each parameter's numel)
    kind: tuple | None = None     # (device, dtype) of the votes' inputs (None: the first parameter's)
    # the bucket as the kernels keep it (comm.base.BucketKernels: the backend's layout of it, checked
    # once, and its tie-index table), made by the pipeline at the bucket's first local step
    kernels: object = None

    def piece_numels(self) -> list:
        return list(self.lengths) if self.lengths is not None else [p.numel() for p in self.params]

    def device_dtype(self) -> tuple:
        return self.kind if self.kind is not None else (self.params[0].device, self.params[0].dtype)


#: A tensor attribute: the index, inside the parameter it is a piece of, of the tensor's first
#: element. Set on the shards a framework hands to LionCub (Megatron's distributed optimizer:
#: lioncub_ds.megatron), so that the hash tie rule keys on the element's index inside its real
#: parameter, whatever the shard layout. Absent: the tensor is the whole parameter.
ELEMENT_START = "lioncub_element_start"


def group_names(group: dict) -> list:
    """A param group's parameter names (torch's ``param_names``; the simulation's ``names``), or Nones."""
    names = group.get("param_names", group.get("names"))
    if names is None:
        return [None] * len(group["params"])
    names = list(names)
    if len(names) != len(group["params"]):  # zip would drop the parameters past the names: never updated
        raise ValueError(f"LionCub: a param group has {len(names)} param_names for {len(group['params'])} parameters; "
                         "allowed: one name per parameter (as torch.optim keeps them)")
    return names


def build_buckets(param_groups, bucket_numel: int, world_size: int) -> tuple[list[Bucket], list]:
    """(buckets, frozen): the flat buckets of every group's trainable parameters, and the
    ``(param, name)`` pairs frozen now (``requires_grad=False``: not in any bucket).

    Per group and per (device, dtype), parameters in their order fill buckets of at most
    ``bucket_numel`` elements (a larger parameter gets a bucket of its own); each starts at an
    8-aligned offset (whole bytes of vote bits), and a bucket is padded to a multiple of 8·N so
    that every rank owns a whole number of bytes of it."""
    buckets, frozen, base = [], [], 0
    for gi, g in enumerate(param_groups):
        by_kind = {}
        for p, name in zip(g["params"], group_names(g)):
            if not p.requires_grad:
                frozen.append((p, name))
                continue
            by_kind.setdefault((p.device, p.dtype), []).append((p, name))
        for members in by_kind.values():
            cur, size = [], 0
            for p, name in members + [(None, None)]:
                aligned = (p.numel() + 7) // 8 * 8 if p is not None else 0
                if p is not None and (size + aligned <= bucket_numel or not cur):
                    cur.append((p, name, size))
                    size += aligned
                    continue
                total = padded_numel(size, world_size)
                starts = [int(getattr(q, ELEMENT_START, 0)) for q, _, _ in cur]
                buckets.append(Bucket(gi, [q for q, _, _ in cur], [nm for _, nm, _ in cur], [o for _, _, o in cur],
                                      total, sum(q.numel() for q, _, _ in cur), base,
                                      param_starts=starts if any(starts) else None))
                base += total
                cur, size = ([(p, name, 0)], aligned) if p is not None else ([], 0)
    return buckets, frozen


def cost_model(cfg) -> CostModel:
    """The α-β model ``comm="auto"`` chooses with: the settings' network over the defaults."""
    net = {**DEFAULT_NETWORK, **cfg.network}
    return CostModel.from_network(net["bandwidth_gbit"], net["latency_us"])


def assign_algorithms(buckets: list[Bucket], cfg, world_size: int) -> None:
    """Give every bucket its communication algorithm (``comm="auto"``: the cost model's choice
    for its size), and what the algorithm keeps of the bucket for its abstentions (the
    real-element mask, the list capacity, the first mode). Depends only on the settings and the
    layout: the same on every rank."""
    cost = cost_model(cfg)
    for b in buckets:
        if cfg.comm != "auto":
            name = cfg.comm
        elif cfg.quant != "sign":
            name = "int8"
        else:
            name = cost.choose(b.numel, world_size, vote=cfg.vote, tie_break=cfg.tie_break, pbit_bits=cfg.pbit_bits)
        b.algorithm = make_algorithm(name, pbit_bits=cfg.pbit_bits, vote_bits=cfg.bbit[0], rounding=cfg.bbit[1],
                                     quant=cfg.quant)
        b.mask, b.capacity, b.mode = b.algorithm.abstention_layout(b.offsets, b.piece_numels(), b.numel,
                                                                   b.device_dtype()[0], world_size)


def next_abstain_mode(mode, first=None, second=0) -> str:
    """How a bucket's abstentions travel next step (comm/abstain.py, :func:`~lioncub_ds.comm.abstain.next_mode`):
    from this step's mode and the bucket's two summed flag entries, so every rank switches
    together. A list while every rank's list fits, the chunk code while every rank's chunk list
    fits, else the plane.

    ``next_abstain_mode(overflowed)`` (one bool, the form before the chunk code) answers the old
    two-mode rule, "plane" after an overflow else "list", for callers that model only those two
    (benchmarks.converge's simulation)."""
    if first is None:
        return "plane" if mode else "list"
    return next_mode(mode, first, second)


def comm_batches(buckets, comm_bucket_mb: float, world_size: int) -> list[list[int]]:
    """Bucket indices per communication batch, in launch order (last buckets first).

    Consecutive buckets with the same algorithm, device and dtype share a batch while their
    votes (the algorithm's ``batch_bytes``: bits numel/8 bytes, int8 numel bytes) fit
    ``comm_bucket_mb`` MB."""
    cap = comm_bucket_mb * 2 ** 20
    batches, cur, size = [], [], 0
    for i in reversed(range(len(buckets))):
        b = buckets[i]
        width = b.algorithm.batch_bytes(b.numel)
        key = (b.algorithm.name,) + tuple(b.device_dtype())
        if cur and (key != cur_key or size + width > cap):
            batches.append(cur)
            cur, size = [], 0
        cur.append(i)
        cur_key = key
        size += width
    if cur:
        batches.append(cur)
    return batches
