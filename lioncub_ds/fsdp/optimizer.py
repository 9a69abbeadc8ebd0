"""LionCub on FSDP2's sharded parameters: shard inside a group, vote across groups (docs/node_voters.md).

The seam (torch >= 2.6 ``fully_shard``, read in torch 2.13's ``_fully_shard``): FSDP2 runs on a
1-D DeviceMesh made from this rank's shard group (:func:`shard_mesh`), so its reduce-scatter
(ReduceOp.AVG) gives this rank the mean gradient of its shard group (ḡ, one voter's gradient),
and its all-gather rebuilds the full parameters for forward from the local shards. LionCub then
steps the local shards with ``shard_groups=``: it votes with the peers (the one rank per shard
group that holds the same shard), so the link between groups carries the 1-bit votes, never a
gradient or a parameter. HSDP's 2-D mesh was not used: it all-reduces the reduce-scatter output
across replicas itself, and ``set_requires_all_reduce(False)`` leaves ``param.grad`` unset (the
output is kept for a later all-reduce), so the mean gradient of a group never reaches an optimizer.

What LionCub steps: per sharded parameter (a DTensor on the shard mesh, ``Shard(0)``) a plain
tensor aliasing FSDP2's local shard (``p.to_local()`` detached: the same storage, so the update is
what the next all-gather reads), tagged with the index of its first element inside the full
parameter (:data:`lioncub_ds.layout.ELEMENT_START`: the hash tie rule keys on it, docs/conventions.md). FSDP2
cuts dim 0 like ``torch.chunk`` (the first shards ``ceil(d0/L)`` rows, the last ones shorter or
empty, padded inside FSDP2), so peers hold shards of equal shape.
"""
from __future__ import annotations

import json
import math

import torch
import torch.distributed as dist

from ..config import LionCubConfig, LionCubConfigError
from ..groups import ShardGroups, group_ranks, make_shard_groups, resolve_ranks_per_node
from ..layout import ELEMENT_START
from ..lion import call_closure, check_param_group
from ..optimizer import LionCub, check_shard_settings

# 2: the param groups' names in the layout, and the momentum sync's state per rank
LAYOUT_FORMAT = 2


def shard_mesh(shard_groups: ShardGroups, device_type: str | None = None):
    """The 1-D DeviceMesh of this rank's shard group: ``fully_shard(module, mesh=shard_mesh(sg))``.

    ``device_type`` None: "cuda" when CUDA is available, else "cpu" (the parameters' device; NCCL
    takes CUDA tensors only). Creates no process group: the mesh wraps ``shard_groups.shard``."""
    from torch.distributed.device_mesh import DeviceMesh
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return DeviceMesh.from_group(shard_groups.shard, device_type)


def element_start(shape, shard_rank: int, shard_size: int) -> tuple[int, int]:
    """(index of the first element inside the flattened full parameter, rows) of shard
    ``shard_rank`` of ``shard_size`` when dim 0 is cut as FSDP2 cuts it (``torch.chunk``: blocks of
    ``ceil(d0/L)`` rows, the last shards shorter or empty)."""
    d0 = shape[0]
    inner = math.prod(shape[1:])
    chunk = -(-d0 // shard_size)
    first = min(shard_rank * chunk, d0)
    return first * inner, min(chunk, d0 - first)


def _refuse(msg: str):
    raise LionCubConfigError("LionCubFSDP: " + msg)


def _check_sharded(name, p, sg: ShardGroups):
    """``p`` must be a parameter FSDP2 sharded on this rank's shard mesh, dim 0; the same on
    every rank (the model and its fully_shard calls are the program's), so every rank raises."""
    from torch.distributed.tensor import DTensor, Shard
    where = ("allowed: fully_shard(module, mesh=lioncub_ds.fsdp.shard_mesh(shard_groups)) on the model (and its "
             "blocks) before the optimizer, or lioncub_ds.fsdp.shard_and_vote(model)")
    if not isinstance(p, DTensor):
        _refuse(f"parameter {name!r} is not sharded by FSDP2 (a plain tensor); {where}")
    mesh = p.device_mesh
    if mesh.ndim != 1:
        _refuse(f"parameter {name!r} lives on a {mesh.ndim}-D mesh {mesh.mesh_dim_names}: HSDP's mesh all-reduces "
                f"gradients across replicas itself, which the votes replace; {where}")
    if group_ranks(mesh.get_group()) != group_ranks(sg.shard):
        _refuse(f"parameter {name!r} is sharded over ranks {group_ranks(mesh.get_group())}, not this rank's shard "
                f"group {group_ranks(sg.shard)}; {where}")
    if tuple(p.placements) != (Shard(0),):
        _refuse(f"parameter {name!r} has placements {tuple(p.placements)}; allowed: Shard(0) (fully_shard's "
                "default: no shard_placement_fn), whose shards are contiguous pieces of the parameter")


def backend_takes(backend: str, device_type: str) -> bool:
    """Whether a process group of ``backend`` (``dist.get_backend(group)``: "nccl", "gloo", or
    "cpu:gloo,cuda:nccl") carries tensors on ``device_type``; an unknown backend: True."""
    backend = str(backend).lower()
    if ":" in backend:
        return device_type in {part.split(":")[0].strip() for part in backend.split(",")}
    caps = dist.Backend.backend_capability.get(backend)
    return caps is None or device_type in caps


def _check_devices(fsdp, sg: ShardGroups):
    """The shards must be materialized and on a device the peer group's backend carries (FSDP2's
    CPUOffloadPolicy keeps them in CPU memory, which NCCL refuses). The same on every rank."""
    backend = dist.get_backend(sg.peers)
    for name, _, leaf in fsdp:
        dev = leaf.device.type
        if dev == "meta":
            _refuse(f"parameter {name!r} is on the meta device (not materialized); allowed: after fully_shard, "
                    "model.to_empty(device=...) and your weight init, then the optimizer (or "
                    "lioncub_ds.fsdp.shard_and_vote(model, init_weights=fn))")
        if not backend_takes(backend, dev):
            _refuse(f"parameter {name!r}: FSDP2's shard is in {dev} memory (CPUOffloadPolicy?) but the peer group's "
                    f"backend {backend!r} carries {dist.Backend.backend_capability.get(str(backend), '?')} tensors "
                    "only; allowed: fully_shard without offload_policy (shards on the accelerator)")


def _check_identical(fsdp, sg: ShardGroups):
    """Every shard group must start from the same shards (the votes keep equal replicas equal,
    never make them equal): their checksums are compared across the peers, the verdict agreed over
    the shard group, so every rank raises or none. Two small integer all-reduces."""
    from ..sharding import replicas_differ
    leaves = [leaf for _, _, leaf in fsdp]
    if sg.groups == 1 or not leaves:
        return
    differs = replicas_differ(leaves, leaves[0].device,
                              lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=sg.peers))
    count = differs.sum().reshape(1)
    dist.all_reduce(count, group=sg.shard)
    if int(count.item()):
        names = [repr(fsdp[i][0]) for i in differs.nonzero().reshape(-1).tolist()]
        which = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        which = which or "the other shards of this group"
        _refuse(f"the {sg.groups} shard groups start from different weights ({which} differ across the peers); "
                "the votes keep equal replicas equal, never make them equal; allowed: the same initial weights in "
                "every shard group (e.g. one seed on every rank, or a broadcast from rank 0 before fully_shard), or "
                "lioncub_ds.fsdp.shard_and_vote (it broadcasts shard group 0's shards)")


class LionCubFSDP(LionCub):
    """LionCub stepping the local shards of an FSDP2 model: one voter per shard group.

    ``model``: every parameter (or those in ``params``: None, or ``(name, parameter)`` pairs /
    param groups of them, as torch.optim takes) sharded by ``fully_shard`` on
    :func:`shard_mesh` ``(shard_groups)``. ``shard_groups``: :func:`lioncub_ds.groups.make_shard_groups`.
    Every other keyword is a LionCub setting (or ``config=``); voters, node_size, overlap and
    momentum_sync.group='node' are refused (the shard groups are the layout).

    Collective: every rank. The model must start from the same weights in every shard group (as
    for DDP without its broadcast; :func:`shard_and_vote` broadcasts): checked at construction
    (checksums across the peers), refused by name otherwise; so are shards on "meta" (build it
    after ``to_empty`` and the init) and shards on a device the peer group's backend does not
    carry (FSDP2's ``CPUOffloadPolicy`` under NCCL).

    ``step()`` hands each shard FSDP2's reduced gradient (``p.grad.to_local()``: this shard
    group's mean) and votes with the peers; ``zero_grad()`` clears FSDP2's gradients too. Gradient
    clipping: ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` before ``step()`` clips
    each group's mean gradient by its own norm (FSDP2's DTensor norm: one float all-reduce inside
    the shard group). Checkpoints: :func:`lioncub_ds.fsdp.save` / :func:`lioncub_ds.fsdp.load`
    (torch.distributed.checkpoint), or :meth:`sharded_state_dict` in your own DCP state.
    """

    def __init__(self, model: torch.nn.Module, params=None, *, shard_groups: ShardGroups, **settings):
        if not isinstance(shard_groups, ShardGroups):
            _refuse(f"shard_groups={type(shard_groups).__name__}; allowed: lioncub_ds.groups.make_shard_groups(...)")
        groups = _named_groups(model, params)
        self._fsdp = []  # (name, FSDP2's sharded parameter, the leaf LionCub steps)
        leaf_groups = []
        for g in groups:
            leaves = []
            for name, p in g["params"]:
                _check_sharded(name, p, shard_groups)
                leaves.append((name, self._leaf(name, p, shard_groups)))
            leaf_groups.append(dict(g, params=leaves))
        _check_devices(self._fsdp, shard_groups)
        _check_identical(self._fsdp, shard_groups)  # collective: every rank, before any state
        self.fsdp_shard_groups = shard_groups
        super().__init__(leaf_groups, shard_groups=shard_groups, **settings)

    def __getstate__(self):
        # the leaves alias FSDP2's shards: a copy (or an unpickled one) would step copies that no
        # all-gather reads, a silent no-op
        raise TypeError("LionCubFSDP cannot be copied or pickled: it steps FSDP2's shards in place, and a copy would "
                        "step tensors the model never reads; allowed: lioncub_ds.fsdp.save / load (DCP), or "
                        "sharded_state_dict() in your own DCP state")

    def __deepcopy__(self, memo):
        self.__getstate__()

    def _leaf(self, name, p, sg):
        with torch.no_grad():
            local = p.to_local()
        start, rows = element_start(tuple(p.shape), sg.shard_rank, sg.shard_size)
        if local.shape[0] != rows or tuple(local.shape[1:]) != tuple(p.shape[1:]):
            # FSDP2 cut dim 0 otherwise than torch.chunk: the element index would be wrong
            _refuse(f"parameter {name!r}: FSDP2's local shard has shape {tuple(local.shape)}, expected {rows} rows "
                    f"of {tuple(p.shape)} cut in {sg.shard_size} (torch.chunk); this torch's FSDP2 shards otherwise")
        leaf = local.detach()  # shares the storage FSDP2 all-gathers from
        leaf.requires_grad_(p.requires_grad)
        setattr(leaf, ELEMENT_START, start)
        self._fsdp.append((name, p, leaf))
        return leaf

    @property
    def sharded_params(self) -> list:
        """(name, FSDP2's sharded parameter, the tensor LionCub steps: its local shard) per parameter."""
        return list(self._fsdp)

    # ------------------------------------------------------------------ step
    def _bind_grads(self) -> None:
        """Each leaf's gradient: FSDP2's reduced shard (a view, no copy). Checks first that FSDP2
        still keeps the parameter in the leaf's storage (``load_state_dict(assign=True)`` or
        ``model.to()`` after construction replace it: the update would be lost)."""
        with torch.no_grad():
            for name, p, leaf in self._fsdp:
                local = p.to_local()
                if (local.untyped_storage().data_ptr() != leaf.untyped_storage().data_ptr()
                        or local.storage_offset() != leaf.storage_offset() or local.shape != leaf.shape):
                    raise LionCubConfigError(
                        f"LionCubFSDP: FSDP2's shard of parameter {name!r} is no longer the tensor this optimizer "
                        "steps (the model's parameters were replaced after construction, e.g. by "
                        "load_state_dict(assign=True) or .to()); allowed: build the optimizer after them, or load "
                        "with lioncub_ds.fsdp.load (in place)")
                leaf.grad = p.grad.to_local() if p.grad is not None else None
                # frozen or unfrozen on FSDP2's parameter after construction: the leaf says the same
                # (LionCub's own rules then apply: e.g. one frozen at the first step stays frozen)
                if leaf.requires_grad != p.requires_grad:
                    leaf.requires_grad_(p.requires_grad)

    @torch.no_grad()
    def step(self, closure=None):
        loss = call_closure(closure)  # its backward fills FSDP2's gradients before they are bound
        self._bind_grads()
        super().step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad(set_to_none=set_to_none)  # the leaves' views: zeroed in place or dropped
        for _, p, _ in self._fsdp:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.to_local().zero_()

    # ------------------------------------------------------------------ checkpoints (DCP)
    def fsdp_layout(self) -> str:
        """What this rank's momenta are pieces of, as one JSON string (saved with them; a load
        must match it): shard size L, voters Nn, the parameters' names and shapes."""
        sg = self.fsdp_shard_groups
        name_of = {id(leaf): name for name, _, leaf in self._fsdp}
        return json.dumps({"format": LAYOUT_FORMAT, "shard_size": sg.shard_size, "voters": sg.groups,
                           "params": [[name, list(p.shape)] for name, p, _ in self._fsdp],
                           "groups": [[name_of[id(leaf)] for leaf in g["params"]] for g in self.param_groups]})

    def sharded_state_dict(self, *, placeholders: bool = False) -> dict:
        """LionCub's state in torch.distributed.checkpoint's terms: each momentum as a DTensor of
        its parameter's shape and sharding (its voter's key: ``momenta.voter<j>.<name>``, since
        every shard group keeps its own), the per-parameter step counters, the step count, the
        momentum sync's schedule and counters (``momentum_sync.rank<r>``: a drift schedule's pending
        signal is this rank's own), and the layout. ``placeholders``: blanks to load into (nothing
        of this optimizer is touched)."""
        from torch.distributed.tensor import DTensor
        sg = self.fsdp_shard_groups
        sync = "" if placeholders else json.dumps(self.current_momentum_sync_state())
        momenta, steps = {}, {}
        for name, p, leaf in self._fsdp:
            st = self.state.get(leaf, {})
            m = st.get("exp_avg")
            if placeholders or m is None:
                m = torch.zeros_like(leaf, dtype=self.config.momentum_dtype, memory_format=torch.contiguous_format)
            momenta[name] = DTensor.from_local(m, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                               stride=p.stride())
            steps[name] = 0.0 if placeholders or "step" not in st else float(st["step"])
        groups = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in self.param_groups]
        return {"layout": self.fsdp_layout(), "step": self._step_count, "skipped_steps": self._skipped_steps,
                "param_steps": steps, "param_groups": groups, "momenta": {f"voter{sg.group_index}": momenta},
                "momentum_sync": {f"rank{dist.get_rank()}": sync}}

    def load_sharded_state_dict(self, sd: dict) -> None:
        """Take the state :func:`torch.distributed.checkpoint.load` filled into
        :meth:`sharded_state_dict` ``(placeholders=True)``. Refuses another layout by name."""
        check_layout(sd["layout"], self.fsdp_layout())
        if len(sd["param_groups"]) != len(self.param_groups):  # (a layout of format 1 has no group names)
            raise LionCubConfigError(f"LionCubFSDP: the checkpoint has {len(sd['param_groups'])} param groups, this "
                                     f"optimizer {len(self.param_groups)}; allowed: the param groups it was saved "
                                     "with; nothing was loaded")
        sync = (sd.get("momentum_sync") or {}).get(f"rank{dist.get_rank()}")
        sync = json.loads(sync) if sync else None
        momenta = sd["momenta"][f"voter{self.fsdp_shard_groups.group_index}"]
        index = {id(leaf): i for i, leaf in enumerate(p for g in self.param_groups for p in g["params"])}
        state = {index[id(leaf)]: {"exp_avg": momenta[name].to_local(),
                                   "step": torch.tensor(float(sd["param_steps"][name]), dtype=torch.float32)}
                 for name, _, leaf in self._fsdp}
        base = super().state_dict()
        groups = [dict(saved, params=g["params"], **({"param_names": g["param_names"]} if "param_names" in g else {}))
                  for saved, g in zip(sd["param_groups"], base["param_groups"])]
        lioncub = dict(base["lioncub"], step=int(sd["step"]), skipped_steps=int(sd["skipped_steps"]))
        lioncub.pop("comm_stats", None)  # per-rank telemetry: not in the checkpoint, kept as it is
        if sync is not None:  # the schedule resumes where it was (else this run's own stays)
            lioncub["momentum_sync"] = sync
        self.load_state_dict({"state": state, "param_groups": groups, "lioncub": lioncub})


def check_layout(saved: str, mine: str) -> None:
    """Refuse, by name, state saved under another shard layout, other parameters or other param
    groups (before anything is loaded)."""
    if saved == mine:
        return
    s, m = json.loads(saved), json.loads(mine)

    def text(x):
        n = x.get("voters")
        return f"shard_size={x.get('shard_size')} ({n} shard group{'' if n == 1 else 's'} voting)"
    if (s.get("shard_size"), s.get("voters")) != (m.get("shard_size"), m.get("voters")):
        raise LionCubConfigError(
            f"LionCubFSDP: the checkpoint was saved with {text(s)}, this run has {text(m)}: each shard group keeps "
            "its own momentum of its shards; allowed: the shard_size (and world size) it was saved with; nothing "
            "was loaded")
    sp, mp = s.get("params", []), m.get("params", [])
    if sorted(map(str, sp)) != sorted(map(str, mp)):
        raise LionCubConfigError(
            "LionCubFSDP: the checkpoint's parameters (names, shapes) differ from this model's: "
            f"{_first_difference(sp, mp)}; allowed: the model it was saved from; nothing was loaded")
    groups = s.get("groups")  # absent in a format-1 layout: the order of the parameters alone
    if sp == mp and (groups is None or groups == m.get("groups")):
        return
    raise LionCubConfigError(
        "LionCubFSDP: the checkpoint's param groups differ from this optimizer's (the same parameters, grouped or "
        f"ordered otherwise): saved {_groups_text(groups, sp)}, here {_groups_text(m.get('groups'), mp)}; each "
        "group's lr, betas and weight decay are restored by position; allowed: the param groups it was saved with; "
        "nothing was loaded")


def _groups_text(groups, params) -> str:
    groups = groups if groups is not None else [[name for name, _ in params]]
    return "[" + "; ".join(", ".join(g[:3]) + (f" (+{len(g) - 3})" if len(g) > 3 else "") for g in groups) + "]"


def _first_difference(a, b) -> str:
    for x, y in zip(a, b):
        if x != y:
            return f"saved {x}, here {y}"
    return f"saved {len(a)} parameters, here {len(b)}"


def _named_groups(model, params):
    """``params`` (None: the model's parameters) as param groups of (name, parameter) pairs.
    Refuses, naming it, a name the model lacks, a tensor that is not the model's, and a parameter
    listed twice (in one group or two: it would be stepped twice), before anything is changed."""
    named = dict(model.named_parameters())
    if params is None:
        return [{"params": list(named.items())}]
    names = {id(p): n for n, p in named.items()}
    allowed = "allowed: the model's parameters, or (name, parameter) pairs as model.named_parameters() gives them"
    params = list(params)
    groups = [dict(g) for g in params] if params and isinstance(params[0], dict) else [{"params": params}]
    seen = {}
    for i, g in enumerate(groups):
        g.pop("names", None)  # a parallel list of names (benchmarks' GPT groups): the pairs below carry them
        if "params" not in g:
            _refuse(f"params: param group {i} has no 'params' key; allowed: dicts with 'params' (as torch.optim takes)")
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        pairs = []
        for p in ps:
            if isinstance(p, tuple):
                if len(p) != 2 or not isinstance(p[0], str):
                    _refuse(f"params entry {p!r:.80} is not a (name, parameter) pair; {allowed}")
                name, t = p
                if name not in named:
                    some = ", ".join(map(repr, list(named)[:4]))
                    _refuse(f"params has the name {name!r}, which is not a parameter of the model "
                            f"(model.named_parameters(): {some}{', ...' if len(named) > 4 else ''}); {allowed}")
                if t is not named[name]:
                    _refuse(f"params pairs the name {name!r} with a tensor that is not the model's parameter {name!r}; "
                            f"{allowed}")
            elif isinstance(p, torch.Tensor) and id(p) in names:
                name = names[id(p)]
            else:
                what = f"a tensor of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else f"{type(p).__name__}"
                _refuse(f"{what} given in params is not a parameter of the model; {allowed}")
            if name in seen:
                where = f"param group {i}" if seen[name] == i else f"param groups {seen[name]} and {i}"
                _refuse(f"parameter {name!r} is listed twice in params ({where}): it would be stepped twice; "
                        "allowed: each parameter listed once, in one group")
            seen[name] = i
            pairs.append((name, named[name]))
        g["params"] = pairs
    return groups


def _module_list(model, modules):
    """The submodules to shard on their own before the root, children first (FSDP2 needs a
    module's sharded descendants before it: the reverse of ``model.modules()``). ``modules``: a
    module class or a tuple of them (every instance inside ``model``, e.g. the transformer block),
    or an iterable of ``model``'s submodules (e.g. ``model.layers``). Checked before anything is
    sharded: a bad value is refused by name."""
    if modules is None:
        return []
    allowed = ("allowed: None, a module class (e.g. modules=Block: every Block inside the model), a tuple of module "
               "classes, or a list of the model's submodules (e.g. model.layers)")
    order = list(model.modules())  # parents before their children
    at = {id(m): i for i, m in enumerate(order)}
    if isinstance(modules, type) or (isinstance(modules, tuple) and modules
                                     and all(isinstance(t, type) for t in modules)):
        types = modules if isinstance(modules, tuple) else (modules,)
        bad = [t for t in types if not issubclass(t, torch.nn.Module)]
        if bad:
            _refuse(f"modules={modules!r}: {bad[0].__name__} is not a torch.nn.Module class; {allowed}")
        chosen = [m for m in order if isinstance(m, types)]
    else:
        if isinstance(modules, (str, bytes)):
            _refuse(f"modules={modules!r} is a string; {allowed}")
        try:
            chosen = list(modules)
        except TypeError:
            _refuse(f"modules={type(modules).__name__} (not iterable); {allowed}")
        for m in chosen:
            if not isinstance(m, torch.nn.Module):
                _refuse(f"modules contains {type(m).__name__} {m!r:.60}, not a module; {allowed}")
            if id(m) not in at:
                _refuse(f"modules contains a {type(m).__name__} that is not inside the model; {allowed}")
        chosen = sorted({id(m): m for m in chosen}.values(), key=lambda m: at[id(m)])
    return [m for m in reversed(chosen) if m is not model]


def shard_and_vote(model: torch.nn.Module, shard_size: int | None = None, *, modules=None, mp_policy=None,
                   reshard_after_forward: bool = True, device_type: str | None = None, params=None,
                   timeout_s: float | None = None, init_weights=None, **settings):
    """Shard ``model`` with FSDP2 inside groups of ``shard_size`` consecutive ranks and vote across
    them: returns ``(model, optimizer)`` (the model is sharded in place, as ``fully_shard`` does).

    * ``shard_size``: L, the ranks of one shard group (FSDP2's fast link); None: the ranks per node
      (``LOCAL_WORLD_SIZE``). Nn = world / L groups vote (1 group: global Lion on the shards).
    * ``modules``: a module class (e.g. the transformer block) or tuple of classes, or a list of
      submodules, to ``fully_shard`` on their own first (children before parents), so each is
      all-gathered only around its forward; the root last.
    * ``mp_policy``, ``reshard_after_forward``: FSDP2's (e.g. ``MixedPrecisionPolicy(param_dtype=
      torch.bfloat16)``: fp32 sharded parameters and momenta, bf16 all-gathers and reduce-scatters).
    * ``params``: which parameters LionCub steps and their groups (see :class:`LionCubFSDP`).
    * ``timeout_s``: the process groups' timeout and LionCub's collective deadline.
    * ``init_weights``: ``fn(model)``, run once after sharding (after ``model.to_empty(device)``
      when the model was built on "meta"), under ``torch.no_grad()``; needed for a meta model.
    * every other keyword: a LionCub setting (``lr``, ``betas``, ``weight_decay``, ``comm``, ...).

    After sharding (and ``init_weights``) every parameter's shard is broadcast from shard group 0
    to its peers, as DDP broadcasts from rank 0: every group starts from the same weights.

    Collective: call it on every rank. Settings, the shard size, ``params``, ``modules`` and
    ``init_weights`` are checked on every rank before any process group or state exists."""
    if init_weights is not None and not callable(init_weights):
        _refuse(f"init_weights={init_weights!r:.60} is not callable; allowed: None or fn(model) (your weight init)")
    if timeout_s is not None:
        settings["timeout_s"] = timeout_s  # LionCub's own collective deadline too (and checked here)
    cfg = LionCubConfig.from_kwargs(**settings)  # a mistyped or bad setting: named, on every rank
    check_shard_settings(cfg)                      # settings that contradict the shard groups
    if not (dist.is_available() and dist.is_initialized()):
        _refuse("torch.distributed is not initialized; allowed: init_process_group first (torchrun)")
    size = _shard_size(shard_size)
    # the groups by name: fully_shard replaces every parameter with a DTensor of the same name
    groups = _named_groups(model, params)
    defaults = dict(lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    for i, g in enumerate(groups):  # a group's own lr / betas / weight decay: before the model is sharded
        check_param_group(g, "LionCubFSDP", defaults, i)
    submodules = _module_list(model, modules)
    meta = any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())
    if meta and init_weights is None:
        _refuse("the model is on the meta device; allowed: init_weights=fn (shard_and_vote runs model.to_empty() "
                "and fn(model) after sharding), or a model built on its device")
    sg = make_shard_groups(size, timeout_s=cfg.timeout_s)
    from torch.distributed.fsdp import fully_shard
    mesh = shard_mesh(sg, device_type)
    kw = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    for m in submodules:
        fully_shard(m, **kw)
    fully_shard(model, **kw)
    if meta:
        model.to_empty(device=mesh.device_type)
    if init_weights is not None:
        with torch.no_grad():
            init_weights(model)
    _broadcast_shards(model, sg)
    sharded = dict(model.named_parameters())
    groups = [dict(g, params=[(n, sharded[n]) for n, _ in g["params"]]) for g in groups]
    return model, LionCubFSDP(model, groups, shard_groups=sg, config=cfg)


def _broadcast_shards(model, sg: ShardGroups) -> None:
    """Every parameter's local shard from shard group 0 to its peers (the replicas start equal,
    as DDP's broadcast from rank 0 makes them); a parameter FSDP2 did not shard: from rank 0 of
    the world. On the parameters' own device (NCCL: CUDA tensors only)."""
    from torch.distributed.tensor import DTensor
    from ..groups import broadcast
    with torch.no_grad():
        for p in model.parameters():
            sharded = isinstance(p, DTensor)
            if sharded and sg.groups == 1:
                continue
            t = (p.to_local() if sharded else p).detach()
            if t.numel() == 0:  # an empty last shard: empty on every peer too (the same shapes)
                continue
            group = sg.peers if sharded else sg.world
            buf = t if t.is_contiguous() else t.contiguous()
            broadcast(buf, 0, group)
            if buf is not t:
                t.copy_(buf)


def _shard_size(shard_size) -> int:
    """L resolved and checked against the world (the same on every rank), named ``shard_size``."""
    try:
        size = resolve_ranks_per_node(shard_size, "shard_size")
    except ValueError as exc:
        raise LionCubConfigError(str(exc).replace("LionCub:", "LionCubFSDP:", 1)) from None
    world = dist.get_world_size()
    if not isinstance(size, int) or isinstance(size, bool) or size < 1 or world % size:
        _refuse(f"shard_size={size!r} (the ranks of one shard group) must be a positive divisor of the {world} ranks; "
                f"allowed: one of {[d for d in range(1, world + 1) if world % d == 0]}")
    return size
