"""Build LionCub as a Megatron optimizer (same signature as ``get_megatron_optimizer``).

What Megatron keeps doing: its parameter groups (``_get_param_groups`` with the standard
overrides: no weight decay on biases and 1-D parameters, lr/wd multipliers, decoupled lr),
its wrappers (``FP32Optimizer``; ``Float16OptimizerWithFloat16Params`` with fp32 main
parameters for bf16/fp16, with the grad scaler for fp16; ``ChainedOptimizer`` over the
dense and expert optimizers), so ``OptimizerParamScheduler`` (lr / wd schedule through
each group's ``max_lr``, ``min_lr``, ``lr_mult``, ``wd_mult``), grad-norm clipping and
logging, and ``state_dict`` / ``sharded_state_dict`` keep working.

What changes: the inner optimizer is :class:`lioncub_ds.LionCub`, voting over Megatron's
data-parallel group *with* context parallel (``dp_cp``) for dense parameters and over the
expert data-parallel group for expert parameters, so with TP/PP every model-parallel rank
votes only with its data-parallel peers; and (by default) DDP's data-parallel gradient
reduction is switched off (:func:`lioncub_ds.megatron.disable_dp_grad_reduction`).

Megatron settings and what they become:

* ``lr`` -> LionCub lr (and each group's starting lr = max_lr * lr_mult; the scheduler
  sets it from then on); ``min_lr`` -> the groups' ``min_lr`` (scheduler);
  ``weight_decay`` -> decoupled weight decay (times each group's ``wd_mult``);
* betas: ``lioncub['betas']`` if given, else ``(lion_beta1, lion_beta2)`` when
  ``config.optimizer == 'lion'`` (OptimizerConfig has them from megatron-core 0.17), else ``(adam_beta1, adam_beta2)``;
* ``bf16`` / ``fp16`` -> ``Float16OptimizerWithFloat16Params`` (LionCub steps the fp32 main
  params; momentum dtype is LionCub's ``momentum_dtype``, fp32 by default);
  ``params_dtype`` only shapes the model; ``loss_scale`` / dynamic fp16 scaling as in Megatron;
* ``clip_grad`` -> Megatron clips each rank's *local* gradient by its norm over TP/PP
  (the reported grad norm is this rank's local norm); 0 turns clipping off.

With a loss scaler (fp16, or ``loss_scale``) a step is skipped when *any* rank found an
inf/NaN: ONE extra 4-byte all-reduce over the world per step, issued by the
``ChainedOptimizer`` (not per wrapper), so every rank issues it exactly once whatever its
number of sub-optimizers (a rank with no expert parameters has no expert optimizer, as in
Megatron), and data-parallel peers never disagree about whether to vote.

``voters='node'`` (with ``OptimizerConfig.use_distributed_optimizer`` and K
``num_distributed_optimizer_instances``): Megatron's DistributedOptimizer steps a flat LionCub
over this rank's fp32 main shards, voting across the K instances; the all-reduce across
instances is switched off (:func:`lioncub_ds.megatron.ddp.vote_across_instances`); see
:func:`_node_voters_optimizer` and docs/megatron.md.

Process groups (the NCCL contract, docs/conventions.md): every group the LionCubs need (the vote groups with
``timeout_s``, the per-node momentum-sync subgroups, for dense AND expert parameters) is
created here, at construction, in ONE call of :func:`lioncub_ds.groups.create_on_all_ranks`
by every rank of the world (it all-gathers the wanted member lists, then every rank creates
the union in one sorted order), whatever kinds of parameters a rank has; a step never creates
a group. See :func:`premake_process_groups`.
"""
from __future__ import annotations

import contextlib
import logging
import types

import torch
import torch.distributed as dist

from ..config import LionCubConfig, LionCubConfigError
from ..groups import (INSTANCES, Strategy, Topology, consecutive_blocks, create_on_all_ranks, group_ranks,
                      requested, resolve_ranks_per_node)
from ..layout import ELEMENT_START
from ..momentum_sync import node_group_size
from ..optimizer import LionCub
from . import _compat
from .ddp import LocalMomentumConfigError, check_local_momentum_ddp, disable_dp_grad_reduction

log = logging.getLogger("lioncub_ds")

# OptimizerConfig settings whose behaviour LionCub cannot honour.
_UNSUPPORTED = (
    ("use_distributed_optimizer", "the distributed optimizer reduce-scatters gradients and shards optimizer state "
                                  "over data-parallel ranks; Lion Cub keeps one full local momentum per rank "
                                  "(or use voters='node': the distributed optimizer's instances then vote)"),
    ("optimizer_cpu_offload", "CPU offload wraps Adam/SGD in HybridDeviceOptimizer"),
    ("use_precision_aware_optimizer", "precision-aware state is a TransformerEngine FusedAdam feature; "
                                      "use lioncub momentum_dtype='bf16' for a bf16 momentum"),
    ("overlap_param_gather", "needs the distributed optimizer"),
    ("overlap_param_gather_with_optimizer_step", "needs the distributed optimizer"),
    ("reuse_grad_buf_for_mxfp8_param_ag", "needs the distributed optimizer"),
)
# voters="node" runs on Megatron's distributed optimizer (--use-distributed-optimizer
# --num-distributed-optimizer-instances K): Megatron owns the instance's gradient reduce-scatter
# and parameter all-gather, LionCub votes across the K instances (docs/megatron.md).
NODE_VOTERS_NEED_DIST_OPT = (
    "LionCub: voters='node' (--lioncub-voters node) under Megatron needs Megatron's distributed optimizer: "
    "--use-distributed-optimizer (OptimizerConfig.use_distributed_optimizer=True and "
    "DistributedDataParallelConfig.use_distributed_optimizer=True) with --num-distributed-optimizer-instances K "
    "(K instances vote; each instance's L = DP/K ranks shard the parameters, Megatron reduce-scatters inside the "
    "instance); allowed: voters='node' with --use-distributed-optimizer, or voters='rank' (the default) without it")
# Master-only sharding (voters='rank' with node_size) is Megatron's own distributed optimizer's job.
MASTER_ONLY_UNSUPPORTED = (
    "LionCub: node_size (--lioncub-node-size) with voters='rank' (master-only sharding) is not supported under "
    "Megatron: Megatron's fp32 main parameters are Megatron's own; allowed: leave node_size unset with "
    "voters='rank', or use voters='node' with --use-distributed-optimizer (the main parameters are then "
    "sharded 1/L by Megatron)")
# overlap=True (votes started from gradient-ready hooks during backward) cannot be real here.
OVERLAP_UNSUPPORTED = (
    "LionCub: overlap=True (--lioncub-overlap, lioncub={'overlap': True}) is not supported under Megatron: "
    "Megatron's DDP accumulates gradients into its main_grad buffers, and its optimizer wrappers hand them to "
    "the parameters LionCub steps (param.grad = main_grad; the fp32 main parameters with bf16/fp16) only inside "
    "optimizer.step(), after unscaling and clip_grad (which a vote must see). No gradient-ready hook on those "
    "parameters fires during backward, so no vote can start there; overlap would only vote twice. Use "
    "overlap=False (the default): the votes start in step(), one vote per optimizer step (Megatron's gradient "
    "accumulation only fills main_grad).")
# --overlap-param-gather-with-optimizer-step splits the first model chunk off (Megatron's design).
OVERLAP_WITH_STEP_NEEDS_CHUNKS = (
    "LionCub: OptimizerConfig.overlap_param_gather_with_optimizer_step (--overlap-param-gather-with-optimizer-step) "
    "with voters='node' needs two or more model chunks (a virtual pipeline: "
    "--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank): the first chunk's "
    "optimizer steps first and its all-gather overlaps the other chunks' steps; got one model chunk; allowed: a "
    "virtual pipeline, or --overlap-param-gather alone (the all-gather overlaps the next forward)")
# LionCub settings that come from OptimizerConfig instead.
_FROM_MEGATRON = {"lr": "OptimizerConfig.lr (--lr)", "weight_decay": "OptimizerConfig.weight_decay (--weight-decay)",
                  "process_group": "Megatron's data-parallel groups",
                  "shard_groups": "Megatron's distributed-optimizer instances (voters='node')",
                  "config": "the lioncub settings (made by the integration from them)"}


class MegatronLionCub(LionCub):
    """LionCub whose ``state_dict`` is the same on every data-parallel rank apart from the momenta.

    Megatron stores the optimizer's non-tensor state once (from rank 0) and warns when ranks
    differ, so the per-rank telemetry (``rank``, ``comm_stats``) is left out of
    ``state_dict()``; the per-rank checkpoint files (:mod:`lioncub_ds.megatron.checkpoint`)
    keep the full state through :meth:`full_state`.
    """

    megatron_kind = "dense"
    megatron_tag = None
    _full = False

    def __init__(self, params, *args, megatron_groups: dict | None = None, **kwargs):
        # Groups made by the factory on every rank (premake_process_groups): {"vote": group or
        # None (= Megatron's own group), "node": group or None}. With them, this LionCub creates
        # no process group itself (its own creation is a world collective, which a rank without
        # this kind of parameters would not join).
        given = vars(kwargs["config"]) if isinstance(kwargs.get("config"), LionCubConfig) else kwargs
        if given.get("overlap"):
            raise LionCubConfigError(OVERLAP_UNSUPPORTED)  # before any state exists
        # the inner LionCub always votes flat; voters='node' is the factory's layout (instances)
        req = requested(given)
        if req.node_voters:
            raise LionCubConfigError(NODE_VOTERS_NEED_DIST_OPT)
        if req.node_size is not None:
            raise LionCubConfigError(MASTER_ONLY_UNSUPPORTED)
        self._premade = megatron_groups
        super().__init__(params, *args, **kwargs)

    def resolve_topology(self, group, strategy: Strategy, sync_size: int | None = None):
        premade = getattr(self, "_premade", None)
        if premade is None:
            return super().resolve_topology(group, strategy, sync_size)
        if premade.get("agree") is not None:  # voters='node': shard peers vote, the instance agrees
            vote, agree = premade["vote"], premade["agree"]
            k, size = dist.get_world_size(vote), dist.get_world_size(agree)
            return Topology(vote, k, dist.get_rank(vote), premade.get("node"), full_group=premade["full"],
                            agree_group=agree, agree_size=size, agree_rank=dist.get_rank(agree),
                            vote_scope="inter_node", strategy=Strategy(INSTANCES, k * size, k))
        return Topology(premade.get("vote") or group, dist.get_world_size(group), dist.get_rank(group),
                        premade.get("node"), strategy=strategy)

    #: voters='node': {"instances": K, "instance_size": L} (set by the factory); the shards this
    #: rank steps are its shards under that layout only
    megatron_layout = None
    #: voters='node': per parameter of this optimizer (a shard), the model parameter it is a piece
    #: of: (name, first element inside the flattened parameter, elements); set by the factory
    megatron_param_pieces = None

    def state_layout(self) -> dict:
        """LionCub's, plus the instance layout and which piece of which model parameter each shard
        is: what :mod:`lioncub_ds.checkpoint` reshards the per-rank files by (another
        ``--num-distributed-optimizer-instances`` or data-parallel size)."""
        out = super().state_layout()
        if self.megatron_layout is not None:
            out["megatron_layout"] = dict(self.megatron_layout)
            out["param_pieces"] = [list(x) for x in self.megatron_param_pieces or ()]
        return out

    def state_dict(self):
        sd = super().state_dict()
        if "lioncub" in sd and self.megatron_layout is not None:
            sd["lioncub"]["megatron_layout"] = dict(self.megatron_layout)
            if self._full:  # the fp32 main shards this rank steps (Megatron's checkpoint may hold bf16 only)
                sd["lioncub"]["main_shards"] = [p.detach().clone() for g in self.param_groups for p in g["params"]]
                sd["lioncub"]["param_pieces"] = self.state_layout()["param_pieces"]
        if not self._full and "lioncub" in sd:
            sd["lioncub"] = {k: v for k, v in sd["lioncub"].items() if k not in ("rank", "comm_stats")}
        return sd

    def check_saved_layout(self, lioncub_state: dict) -> None:
        """Refuse a per-rank file saved under another distributed-optimizer layout (before loading)."""
        saved, mine = lioncub_state.get("megatron_layout"), self.megatron_layout
        if saved == mine:
            return
        def text(layout):
            if layout is None:
                return "voters='rank' (no distributed-optimizer instances)"
            return (f"--num-distributed-optimizer-instances {layout['instances']} x {layout['instance_size']} ranks "
                    "per instance")
        raise LionCubConfigError(
            f"LionCub: this checkpoint was saved with {text(saved)}, this run has {text(mine)}; node-voter shards "
            "follow the instance layout; allowed: load the same layout here, or the per-rank files through "
            "lioncub_ds.megatron's checkpoint hooks (after_checkpoint_load, --lioncub-reshard average), which "
            "reshard them, or start the optimizer fresh with --no-load-optim")

    def load_state_dict(self, state_dict):
        extra = state_dict.get("lioncub") if isinstance(state_dict, dict) else None
        if isinstance(extra, dict) and ("megatron_layout" in extra or self.megatron_layout is not None):
            self.check_saved_layout(extra)  # before anything changes
        shards = extra.get("main_shards") if isinstance(extra, dict) else None
        params = [p for g in self.param_groups for p in g["params"]]
        if shards is not None and [tuple(t.shape) for t in shards] != [tuple(p.shape) for p in params]:
            raise LionCubConfigError("LionCub: the saved main-parameter shards do not fit this rank's shards; "
                                     "allowed: the same layout it was saved with")
        if isinstance(extra, dict):
            state_dict = dict(state_dict)
            state_dict["lioncub"] = {k: v for k, v in extra.items()
                                     if k not in ("megatron_layout", "main_shards", "param_pieces")}
        super().load_state_dict(state_dict)
        if shards is not None:
            with torch.no_grad():
                for p, t in zip(params, shards):
                    p.copy_(t)

    @contextlib.contextmanager
    def full_state(self):
        self._full = True
        try:
            yield self
        finally:
            self._full = False


def lioncub_settings(lioncub=None, **kwargs) -> dict:
    """Merge the ``lioncub`` dict and keyword settings; refuse keys that Megatron owns."""
    settings = dict(lioncub or {})
    for key, value in kwargs.items():
        if key in settings and settings[key] != value:
            raise LionCubConfigError(f"LionCub: setting {key!r} given twice (lioncub={settings[key]!r}, "
                                     f"keyword={value!r})")
        settings[key] = value
    for key, where in _FROM_MEGATRON.items():
        if key in settings:
            raise LionCubConfigError(f"LionCub: {key!r} is not a lioncub setting under Megatron; it comes from {where}")
    if "betas" in settings and isinstance(settings["betas"], list):
        settings["betas"] = tuple(settings["betas"])
    # Validate early (names, types, combinations) with a placeholder lr. voters='node' runs a flat
    # LionCub over Megatron's shards (the factory's layout), so the settings are checked as that
    # inner LionCub sees them (plain node voters' own refusals do not apply); node_size's type here,
    # its value against the instances in the factory.
    req = requested(settings)
    if req.node_voters:
        LionCubConfig.from_kwargs(where="lioncub setting", lr=1.0, node_size=req.node_size)
        LionCubConfig.from_kwargs(where="lioncub setting", lr=1.0,
                                  **{k: v for k, v in settings.items() if k not in ("voters", "node_size")})
    else:
        LionCubConfig.from_kwargs(where="lioncub setting", lr=1.0, **settings)
    if settings.get("overlap"):
        raise LionCubConfigError(OVERLAP_UNSUPPORTED)
    if not req.node_voters and req.node_size is not None:
        raise LionCubConfigError(MASTER_ONLY_UNSUPPORTED)
    return settings


def check_optimizer_config(config, node_voters: bool = False) -> None:
    if node_voters and not getattr(config, "use_distributed_optimizer", False):
        raise LocalMomentumConfigError(NODE_VOTERS_NEED_DIST_OPT)
    for name, why in _UNSUPPORTED:
        if node_voters and name in ("use_distributed_optimizer", "overlap_param_gather",
                                    "overlap_param_gather_with_optimizer_step"):
            # the instances are the voters; Megatron's own all-gather may overlap the next forward,
            # or (the first model chunk's, split into an optimizer of its own) the rest of the step
            continue
        if getattr(config, name, False):
            raise LocalMomentumConfigError(f"lioncub_ds.megatron: OptimizerConfig.{name}=True is not supported with "
                                           f"LionCub ({why}); set it to False")
    if config.lr is None:
        raise LionCubConfigError("lioncub_ds.megatron: OptimizerConfig.lr is None; set the peak learning rate (--lr)")


def resolve_betas(config, settings) -> tuple:
    if "betas" in settings:
        return tuple(settings["betas"])
    if getattr(config, "optimizer", None) == "lion" and hasattr(config, "lion_beta1"):
        return (config.lion_beta1, config.lion_beta2)
    return (config.adam_beta1, config.adam_beta2)


def ranks_per_node(ranks, local_world_size: int) -> int:
    """How many of ``ranks`` (global ranks, in group order) share a node, rank r on node r // local_world_size.

    The ranks on each node must be consecutive in group order and equally many on every node
    (true for Megatron's default rank order); otherwise :class:`LionCubConfigError`.
    """
    if not isinstance(local_world_size, int) or local_world_size < 1:
        raise LionCubConfigError(f"LionCub: LOCAL_WORLD_SIZE={local_world_size!r} must be an integer >= 1")
    runs = []
    for r in ranks:
        node = r // local_world_size
        if runs and runs[-1][0] == node:
            runs[-1][1] += 1
        else:
            runs.append([node, 1])
    nodes = [n for n, _ in runs]
    sizes = {c for _, c in runs}
    if not runs or len(set(nodes)) != len(nodes) or len(sizes) != 1:
        raise LionCubConfigError(
            f"LionCub: the data-parallel group {list(ranks)} is not split evenly into consecutive per-node runs "
            f"(LOCAL_WORLD_SIZE={local_world_size}); pass momentum_sync.group_size explicitly")
    return sizes.pop()


def dp_ranks_per_node(group, local_world_size: int | None = None) -> int:
    """Data-parallel peers of this rank on its node, for ``momentum_sync.group='node'`` (see :func:`ranks_per_node`)."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    if local_world_size is None:
        try:  # the ranks on this machine, by the one rule (LOCAL_WORLD_SIZE, then LOCAL_SIZE)
            local_world_size = resolve_ranks_per_node(None, "momentum_sync.group_size")
        except ValueError as exc:
            raise LionCubConfigError(f"{exc} (under Megatron: the data-parallel peers per node)") from None
    return ranks_per_node(ranks, local_world_size)


def check_model_parallel_sync(cfgs: dict, mp_group) -> None:
    """Refuse momentum_sync schedule="drift" with tensor or pipeline parallelism: each model-parallel
    position's LionCub decides its syncs from its own vote group's signal, so positions would sync
    at different steps and the parameters they hold alike (layer norms, biases replicated over
    tensor-parallel ranks; tied embeddings on the first and last stage) would drift apart."""
    mp = dist.get_world_size(mp_group) if dist.is_initialized() and mp_group is not None else 1
    if mp > 1 and any(c.momentum_sync is not None and c.momentum_sync.drift for c in cfgs.values()):
        raise LionCubConfigError(
            f"LionCub: momentum_sync schedule='drift' is not supported with tensor or pipeline parallelism "
            f"({mp} model-parallel ranks): each position would decide its own sync steps, and parameters held "
            "alike by several positions would drift apart. Allowed: a fixed schedule (every=K, the default, or "
            "'geometric'), or schedule='drift' with TP = PP = 1.")


def _momentum_sync_for_group(settings, group):
    ms = settings.get("momentum_sync")
    if not isinstance(ms, dict) or ms.get("group") != "node" or ms.get("group_size") is not None:
        return settings
    out = dict(settings)
    out["momentum_sync"] = {**ms, "group_size": dp_ranks_per_node(group)}
    return out


def premake_process_groups(settings: dict, local: dict) -> dict:
    """Create every process group the Megatron LionCubs will use, on ALL ranks, in one order.

    ``local``: ``{kind: vote group}`` for the kinds ("dense", "expert") this rank has optimizer
    parameter groups for. Whether groups are needed at all depends only on the settings
    (``timeout_s``; ``momentum_sync.group='node'``), which are the same on every rank, so every
    rank calls :func:`lioncub_ds.groups.create_on_all_ranks` exactly once here, with the member
    lists it needs for all its kinds (possibly none): one world collective, whatever kinds a
    rank has. Returns ``{kind: {"vote": group or None, "node": group or None}}``; the LionCubs
    then create nothing (:class:`MegatronLionCub`), not here and not in a step.
    """
    timeout_s = settings.get("timeout_s")
    out = {kind: {"vote": None, "node": None} for kind in local}
    ms = settings.get("momentum_sync")
    node = isinstance(ms, dict) and ms.get("group") == "node"
    if timeout_s is None and not node:
        return out
    wanted, where = [], []
    for kind in ("dense", "expert"):
        if kind not in local:
            continue
        group = local[kind]
        ranks = group_ranks(group)
        n = len(ranks)
        if n <= 1:
            continue
        if timeout_s is not None:
            wanted.append(ranks)
            where.append((kind, "vote"))
        if node:
            kw = _momentum_sync_for_group(settings, group)
            size = node_group_size(kw["momentum_sync"].get("group_size"), n)
            me = dist.get_rank(group)
            wanted.append(consecutive_blocks(ranks, size)[me // size])
            where.append((kind, "node"))
    created = create_on_all_ranks(wanted, timeout_s)
    for (kind, role), g in zip(where, created):
        out[kind][role] = g
    return out


def _init_state_fn(opt, config=None):
    """Create LionCub's state for every parameter (Megatron calls this before loading a checkpoint)."""
    if opt is None:
        return
    for g in opt.param_groups:
        for p in g["params"]:
            opt.momenta.get(p)


def _param_names(model_chunks) -> dict:
    names = {}
    many = len(model_chunks) > 1
    for i, chunk in enumerate(model_chunks):
        for name, p in chunk.named_parameters():
            names.setdefault(p, f"chunk{i}.{name}" if many else name)
    return names


def _prepare_groups(param_groups, names, config):
    out = []
    for g in param_groups:
        g = dict(g)
        g["params"] = list(g["params"])
        g["param_names"] = [names.get(p, None) for p in g["params"]]
        # Megatron's scheduler sets lr / weight_decay every step; start from the same values.
        g["lr"] = float(g.get("max_lr", config.lr) or config.lr) * float(g.get("lr_mult", 1.0))
        g["weight_decay"] = float(config.weight_decay) * float(g.get("wd_mult", 1.0))
        out.append(g)
    return out


def _flag_device(optimizers):
    for w in optimizers:
        t = getattr(w, "found_inf", None)
        if isinstance(t, torch.Tensor):
            return t.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_found_inf_once_per_step(chained, config) -> None:
    """Skip decisions must agree on every rank once gradients are local (see module doc).

    Megatron's wrappers each reduce ``found_inf`` over their own model-parallel group and
    update their grad scaler with it. Here every wrapper's scaler update is deferred; the
    ChainedOptimizer then issues ONE world all-reduce (MAX) of "any wrapper found inf/NaN"
    per step and updates every scaler with the agreed flag. The all-reduce is issued whenever
    the config has a loss scaler (the same on every rank), independent of how many
    sub-optimizers (dense, expert) this rank has.
    """
    if not (config.fp16 or config.loss_scale):
        return
    wrappers = list(chained.chained_optimizers)
    scalers = []
    for w in wrappers:
        scaler = getattr(w, "grad_scaler", None)
        if scaler is None or hasattr(scaler, "_lioncub_update"):
            continue
        scaler._lioncub_update = scaler.update
        scaler.update = lambda found_inf: None  # deferred: the ChainedOptimizer updates it
        scalers.append(scaler)
    orig = chained.prepare_grads
    device = _flag_device(wrappers)

    def prepare_grads(self):
        local = bool(orig())
        flag = torch.tensor([1.0 if local else 0.0], dtype=torch.float32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        found = flag.item() > 0
        for scaler in scalers:
            scaler._lioncub_update(found)
        return found

    chained.prepare_grads = types.MethodType(prepare_grads, chained)


def _grad_scaler(config):
    """Megatron's loss scaler for ``config`` (None for bf16/fp32 without a loss scale), as Megatron makes it."""
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale,
                                 growth_factor=2.0, backoff_factor=0.5,
                                 growth_interval=config.loss_scale_window, hysteresis=config.hysteresis)
    return None


def _wrap(config, inner, stats_group, tp_group, expert_tp_group):
    from megatron.core.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer
    init_state_fn = _init_state_fn if inner is not None else None
    if config.fp16 or config.bf16:
        grad_scaler = _grad_scaler(config)
        opt = Float16OptimizerWithFloat16Params(inner, config, grad_scaler, init_state_fn)
        # The wrapper's fp32 main params are detached copies (requires_grad=False); LionCub only
        # steps parameters that require grad, so mark them (they never enter an autograd graph).
        for group in getattr(opt, "fp32_from_float16_groups", []):
            for main_param in group:
                main_param.requires_grad_(True)
    else:
        opt = FP32Optimizer(inner, config, init_state_fn)
    opt.grad_stats_parallel_group = stats_group
    opt.tp_group = tp_group
    opt.expert_tp_group = expert_tp_group
    return opt


def _model_parallel_tag(kind, groups):
    """Where this rank sits outside its vote group (names the per-rank checkpoint folder)."""
    if kind.startswith("dense"):
        return f"mp{dist.get_rank(groups['mp']):05d}"
    ep = groups.get("ep")
    ep_rank = dist.get_rank(ep) if ep is not None else 0
    return f"emp{dist.get_rank(groups['expt_mp']):05d}-ep{ep_rank:05d}"


def get_megatron_lioncub_optimizer(config, model_chunks, config_overrides=None, use_gloo_process_groups=True,
                                   pg_collection=None, dump_param_to_param_group_map=None, *, lioncub=None,
                                   disable_grad_reduction=True, **lioncub_kwargs):
    """LionCub in Megatron's wrappers: a drop-in for ``megatron.core.optimizer.get_megatron_optimizer``.

    Args: the six arguments of ``get_megatron_optimizer`` (megatron-core 0.16-0.19), then
        lioncub: dict of LionCub settings (vote, comm, quant, tie_break, momentum_sync, betas,
            momentum_dtype, bucket_size_mb, pbit_bits, network, nonfinite, drift_check_every,
            drift_action, timeout_s, foreach, comm_bucket_mb); keyword arguments are merged in.
            ``overlap=True`` is refused (:data:`OVERLAP_UNSUPPORTED` says why), before anything
            is changed. ``voters="node"`` (``node_size`` = DP/K or unset) needs
            ``config.use_distributed_optimizer`` and DDP chunks with the distributed optimizer:
            the K distributed-optimizer instances vote (returns a ChainedOptimizer over Megatron's
            DistributedOptimizer around LionCub).
            ``momentum_sync={"group": "node", ...}`` without ``group_size`` uses the number of
            data-parallel peers on this node (from LOCAL_WORLD_SIZE).
        disable_grad_reduction: switch off DDP's data-parallel gradient reduction on
            ``model_chunks`` (local-momentum mode; default). False keeps Megatron's all-reduce,
            so every rank votes with the same averaged gradient (= global Lion; a baseline).

    ``use_gloo_process_groups`` is accepted and ignored (gloo groups serve the distributed
    optimizer only). Returns a ``ChainedOptimizer`` (dense, then expert if the model has
    expert parameters), like Megatron. Each inner LionCub is reachable with
    :func:`lioncub_optimizers`.
    """
    _compat.require_megatron("lioncub_ds.megatron.get_megatron_lioncub_optimizer")
    from megatron.core.optimizer import ChainedOptimizer, _get_param_groups

    model_chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    settings = lioncub_settings(lioncub, **lioncub_kwargs)
    if requested(settings).node_voters:
        check_optimizer_config(config, node_voters=True)
        return _node_voters_optimizer(config, model_chunks, settings, config_overrides, pg_collection,
                                      dump_param_to_param_group_map)
    check_optimizer_config(config)
    if disable_grad_reduction:  # checked now, switched off last (below): an error leaves Megatron's reduction on
        for chunk in model_chunks:
            check_local_momentum_ddp(chunk)
    if config_overrides is None:
        config_overrides = _compat.standard_overrides(config)
    _compat.check_overrides(config, config_overrides)
    groups = _compat.optimizer_process_groups(pg_collection, model_chunks)
    betas = resolve_betas(config, settings)
    settings = {k: v for k, v in settings.items() if k != "betas"}

    all_groups = _get_param_groups(model_chunks, config, config_overrides)
    names = _param_names(model_chunks)
    dense = _prepare_groups([g for g in all_groups if not g["is_expert_parallel"]], names, config)
    expert = _prepare_groups([g for g in all_groups if g["is_expert_parallel"]], names, config)

    kinds = (("dense", dense, groups["dp_cp"], groups["mp"], groups["tp"]),
             ("expert", expert, groups["expt_dp"], groups["expt_mp"], groups["expt_tp"]))
    local = {kind: vote_group for kind, pgroups, vote_group, _, _ in kinds if pgroups}
    # the one validation of each optimizer's settings (Megatron's lr and weight decay included),
    # before anything changes (process groups, DDP's gradient reduction)
    cfgs = {kind: LionCubConfig.from_kwargs(where="lioncub setting", lr=config.lr, betas=betas,
                                            weight_decay=config.weight_decay,
                                            **_momentum_sync_for_group(settings, local[kind]))
            for kind in local}
    check_model_parallel_sync(cfgs, groups["mp"])
    premade = premake_process_groups(settings, local) if dist.is_initialized() else {}

    optimizers = []
    for kind, pgroups, vote_group, stats_group, tp_group in kinds:
        if kind == "expert" and not pgroups:
            continue  # as in Megatron: no expert optimizer where this rank has no expert parameters
        inner = None
        if pgroups:
            cfg = cfgs[kind]
            inner = MegatronLionCub(pgroups, config=cfg, process_group=vote_group, megatron_groups=premade.get(kind))
            inner.megatron_kind = kind
            inner.megatron_tag = _model_parallel_tag(kind, groups)
        optimizers.append(_wrap(config, inner, stats_group, tp_group, groups["expt_tp"]))
    if dump_param_to_param_group_map is not None:
        _dump_param_map(model_chunks, all_groups, dump_param_to_param_group_map)
    if disable_grad_reduction:  # last: an error above leaves Megatron's reduction as it was
        disable_dp_grad_reduction(model_chunks)
    if dist.get_rank() == 0:
        log.info("LionCub (Megatron): %s; betas=%s; settings=%s", ", ".join(
            f"{o.optimizer.megatron_kind}: {sum(p.numel() for p in o.get_parameters())} params voting over "
            f"{o.optimizer.world_size} ranks" for o in optimizers if o.optimizer is not None), betas, settings)
    chained = ChainedOptimizer(optimizers)
    agree_found_inf_once_per_step(chained, config)
    return chained


def instance_layout(dp_size: int, instances: int, node_size=None) -> int:
    """L, the ranks per distributed-optimizer instance (= node_size of voters='node'); a
    ``node_size`` that disagrees with DP / K is refused with both settings and the allowed value."""
    if instances < 1 or dp_size % instances:
        raise LionCubConfigError(f"LionCub: --num-distributed-optimizer-instances {instances} does not divide the "
                                 f"data-parallel size {dp_size}; allowed: a divisor of {dp_size}")
    size = dp_size // instances
    if node_size is not None and node_size != size:
        raise LionCubConfigError(
            f"LionCub: --lioncub-node-size {node_size} (node_size) does not match the distributed optimizer's "
            f"instances: data-parallel size {dp_size} / --num-distributed-optimizer-instances {instances} = {size} "
            f"ranks per instance; allowed: --lioncub-node-size {size}, or leave it unset (it is taken from the "
            f"instances)")
    return size


def _leaf_shards(dopt):
    """Megatron's fp32 parameter shards are views of the model parameters (non-leaf tensors, which
    a torch optimizer refuses: Megatron assigns its inner optimizer's groups directly). Give
    Megatron and LionCub one leaf per shard, on the same memory, with the model parameter's
    tensor-parallel attributes (the grad norm reads them); Megatron then sets its ``.grad`` and
    copies it back into the parameter buffer as before. The fp32 main copies of bf16/fp16
    parameters are leaves already; they only need ``requires_grad`` (LionCub steps only those)."""
    from megatron.core import tensor_parallel
    for gi, rng in enumerate(dopt.opt_group_ranges):
        shards = dopt.shard_fp32_groups[gi]
        for j, (view, model_param) in enumerate(zip(list(shards), dopt.model_fp32_groups[gi])):
            leaf = view.detach()
            tensor_parallel.copy_tensor_model_parallel_attributes(leaf, model_param)
            if hasattr(model_param, "shared"):
                leaf.shared = model_param.shared
            shards[j] = leaf.requires_grad_(True)
        for main in dopt.shard_fp32_from_float16_groups[gi]:
            main.requires_grad_(True)
        rng["orig_group"]["params"] = [*shards, *dopt.shard_fp32_from_float16_groups[gi]]


def _common_state_dict(self, *args, **kwargs):
    """What Megatron's checkpoint keeps of a node-voter optimizer: the common part only (the
    param groups' hyper-parameters and the loss scale), the same on every rank. The
    DistributedOptimizer's own state_dict / sharded_state_dict read Adam's per-parameter state
    (``exp_avg``, ``exp_avg_sq``, ``step``); LionCub's momentum shards and fp32 main shards go to
    its per-rank files instead (lioncub_ds.megatron.checkpoint), written and read by every rank."""
    inner = self.optimizer.state_dict()
    out = {"lioncub_node_voters": True, "kind": self.optimizer.megatron_kind,
           "param_groups": [{k: v for k, v in g.items() if k not in ("params", "param_names")}
                            for g in inner["param_groups"]]}
    if self.grad_scaler:
        out["grad_scaler"] = self.grad_scaler.state_dict()
    return out


def _load_common_state_dict(self, state_dict):
    """Inverse of :func:`_common_state_dict` (Megatron's load, before the per-rank files are read)."""
    _check_optimizer_split(state_dict, [self.optimizer.megatron_kind])
    if not isinstance(state_dict, dict) or not state_dict.get("lioncub_node_voters"):
        raise LionCubConfigError(
            "LionCub: this optimizer checkpoint was not written by LionCub with voters='node' (the distributed "
            "optimizer's state of another optimizer, e.g. Adam); allowed: a checkpoint saved with the same "
            "--lioncub-voters node layout, or --no-load-optim to start the optimizer fresh")
    saved = state_dict.get("param_groups", [])
    if len(saved) != len(self.optimizer.param_groups):
        raise LionCubConfigError(f"LionCub: the checkpoint has {len(saved)} parameter groups, this optimizer "
                                 f"{len(self.optimizer.param_groups)}; allowed: the same model and settings")
    for group, old in zip(self.optimizer.param_groups, saved):
        group.update({k: v for k, v in old.items() if k not in ("params", "param_names")})
    if self.grad_scaler and "grad_scaler" in state_dict:
        self.grad_scaler.load_state_dict(state_dict["grad_scaler"])


def _writes_parameter_state(dopt) -> bool:
    """The one writer of the parameter-state file: every instance has a rank 0, and the file name
    is the same for all of them."""
    return dopt.data_parallel_group.rank() == 0 and dopt.distributed_optimizer_instance_id == 0


def _save_parameter_state(self, filename):
    """Megatron-LM's legacy checkpoints (``--ckpt-format torch``) save the distributed optimizer's
    parameter state to one more file, on the instance's rank 0. Under node voters that state
    (momentum and fp32 main shards) is in LionCub's per-rank files; this file only says so."""
    if _writes_parameter_state(self):
        torch.save(_PARAMETER_STATE_MARKER, filename)


def _load_parameter_state(self, filename, *, update_legacy_format=False):
    """Nothing to read here: the per-rank files are read after Megatron's load (see above)."""
    return None


def _chained_save_parameter_state(self, filename):
    """The same for the ChainedOptimizer of two or more distributed optimizers (the first model
    chunk's apart, or expert parameters): Megatron's own gathers every optimizer's Adam state to
    the instance's rank 0 (``get_parameter_state_dp_zero``), which a LionCub optimizer does not have."""
    if any(_writes_parameter_state(o) for o in self.chained_optimizers):
        torch.save(_PARAMETER_STATE_MARKER, filename)


def _chained_load_state_dict(self, state_dict):
    """Megatron's ChainedOptimizer.load_state_dict, after the split check: it would give a split's
    per-optimizer list to the wrong optimizers, or one optimizer's dict entry by entry."""
    _check_optimizer_split(state_dict, [o.optimizer.megatron_kind for o in self.chained_optimizers])
    type(self).load_state_dict(self, state_dict)


def _check_optimizer_split(state_dict, kinds):
    """Refuse Megatron's optimizer checkpoint of LionCub node-voter optimizers split otherwise than
    this run's (``kinds``), naming --overlap-param-gather-with-optimizer-step. Megatron's chain
    saves one dict (one optimizer), a list (``state_dict``) or a dict keyed 0, 1, ...
    (``sharded_state_dict``, the torch_dist format). A checkpoint that is not LionCub's passes
    (:func:`_load_common_state_dict` refuses it)."""
    if isinstance(state_dict, dict) and state_dict.get("lioncub_node_voters"):
        entries = [state_dict]
    elif isinstance(state_dict, dict) and state_dict and all(isinstance(k, int) for k in state_dict):
        entries = [v for _, v in sorted(state_dict.items())]
    elif isinstance(state_dict, (list, tuple)):
        entries = list(state_dict)
    else:
        return
    if not entries or not all(isinstance(e, dict) and e.get("lioncub_node_voters") for e in entries):
        return
    saved = [e.get("kind", "?") for e in entries]  # "?": saved before the kinds were recorded
    if len(saved) == len(kinds) and all(a in ("?", b) for a, b in zip(saved, kinds)):
        return
    raise LionCubConfigError(split_refusal("the optimizer checkpoint", saved, kinds) + " The optimizer loaded nothing")


def split_refusal(what: str, saved, mine) -> str:
    """The refusal of a checkpoint whose LionCub optimizers (``saved`` kinds) are split otherwise
    than this run's (``mine``): Megatron's optimizer checkpoint, or the per-rank files."""
    def text(kinds):
        apart = "the first model chunk's dense optimizer apart" if "dense_chunk0" in kinds else \
            "one dense optimizer for every model chunk"
        return f"{apart} ({', '.join(kinds)})"
    return (f"LionCub: {what} was saved with {text(saved)}, this run has {text(mine)}: "
            "--overlap-param-gather-with-optimizer-step gives the first model chunk's dense parameters an optimizer "
            "of their own, and each optimizer's state holds its own shards; allowed: resume with the "
            "--overlap-param-gather-with-optimizer-step setting of the saving run (change it after the next save), "
            "or --no-load-optim to start the optimizer fresh.")


_PARAMETER_STATE_MARKER = {"lioncub_node_voters": True, "state": "in the LionCub per-rank files (lioncub/)"}


def instance_sync_group_size(vote_ranks, local_world_size=None) -> int:
    """``momentum_sync={"group": "node"}`` with node voters under Megatron: how many voters (the
    ranks of the inter-instance vote group, one per instance) share a node, rank r on node
    r // (ranks per node) (several instances per node when an instance is smaller than a node)."""
    if local_world_size is None:
        try:
            local_world_size = resolve_ranks_per_node(None, "momentum_sync.group_size")
        except ValueError as exc:
            raise LionCubConfigError(f"{exc} (with voters='node' under Megatron: the instances per node)") from None
    return ranks_per_node(vote_ranks, local_world_size)


def _node_voters_optimizer(config, model_chunks, settings, config_overrides, pg_collection, dump_map):
    """voters='node': LionCub inside Megatron's DistributedOptimizer, voting across its K instances.

    Megatron does what it does with K instances (reduce-scatter of the gradients inside the
    instance, fp32 main shards, clipping by the instance's gradient norm, all-gather of the
    parameters inside the instance) except the all-reduce of the gradient shards across
    instances: :func:`lioncub_ds.megatron.ddp.vote_across_instances` switches it off, and the
    inner optimizer is a flat LionCub over this rank's shards whose vote group is the
    inter-instance group (the K ranks at this rank's place in every instance). Its step's
    decisions (skip, refuse) are also summed over the instance, so all DP ranks agree.

    Expert (MoE) parameters get a DistributedOptimizer of their own, as in Megatron: sharded over
    the instance's part of the expert data-parallel group, voting over the same inter-instance
    group (Megatron all-reduces their shards over it too), agreeing over that part.
    """
    from megatron.core.optimizer import ChainedOptimizer, _get_param_groups
    from megatron.core.process_groups_config import ProcessGroupCollection
    from .ddp import instances_of, restore_instance_all_reduce, vote_across_instances

    # --- every check first: nothing changes before they all pass
    k = instances_of(model_chunks)
    pgs = ProcessGroupCollection.setup_process_groups_for_optimizer(pg_collection, model_chunks, False)
    dp_group, instance = pgs["dp_cp_group"], pgs["intra_dp_cp_group"]
    dp = dist.get_world_size(dp_group)
    size = instance_layout(dp, k, requested(settings).node_size)
    if dist.get_world_size(instance) != size:
        raise LionCubConfigError(f"LionCub: Megatron's instance group has {dist.get_world_size(instance)} ranks, "
                                 f"expected {size} (data-parallel size {dp} / {k} instances)")
    if config_overrides is None:
        config_overrides = _compat.standard_overrides(config)
    _compat.check_overrides(config, config_overrides)
    groups = _compat.optimizer_process_groups(pg_collection, model_chunks)
    betas = resolve_betas(config, settings)
    inner_settings = {key: v for key, v in settings.items() if key not in ("betas", "voters", "node_size")}
    all_groups = _get_param_groups(model_chunks, config, config_overrides)
    names = _param_names(model_chunks)
    # --overlap-param-gather-with-optimizer-step: as Megatron does, the first model chunk's dense
    # parameters get an optimizer of their own, stepped first; Megatron's ChainedOptimizer then
    # starts that chunk's all-gather while the other chunks' optimizer steps (and votes)
    first_apart = bool(getattr(config, "overlap_param_gather_with_optimizer_step", False))
    if first_apart and len(model_chunks) < 2:
        raise LionCubConfigError(OVERLAP_WITH_STEP_NEEDS_CHUNKS)
    dense_parts = ([("dense_chunk0", 0, 1), ("dense_later_chunks", 1, len(model_chunks))] if first_apart
                   else [("dense", 0, len(model_chunks))])
    # (kind, param groups, its model chunks and the first one's index, Megatron's buffers, the
    # instance's part of the DP group, the whole DP group, the group Megatron indexes the optimizer by)
    kinds = [(kind, _prepare_groups([g for g in _get_param_groups(model_chunks[lo:hi], config, config_overrides)
                                     if not g["is_expert_parallel"]], names, config),
              (model_chunks[lo:hi], lo), "buffers", instance, dp_group, groups["mp"])
             for kind, lo, hi in dense_parts]
    kinds.append(("expert", _prepare_groups([g for g in all_groups if g["is_expert_parallel"]], names, config),
                  (model_chunks, 0), "expert_parallel_buffers", pgs["intra_expt_dp_group"], pgs["expt_dp_group"],
                  pgs["expt_tp_pp_group"]))
    # a rank without expert parameters has no expert optimizer (as in Megatron)
    kinds = [x for x in kinds if x[1] or x[0] != "expert"]
    cfg = LionCubConfig.from_kwargs(where="lioncub setting", lr=config.lr, betas=betas,
                                    weight_decay=config.weight_decay, **inner_settings)
    check_model_parallel_sync({"dense": cfg}, groups["mp"])

    # --- the vote group: Megatron's inter-instance group (a group of one rank when K = 1: no
    # votes); with timeout_s LionCub makes its own copy; momentum_sync's node subgroup: the voters
    # on one node. Every rank of the world takes part, whatever kinds of parameters it has.
    inter = pgs.get("inter_dist_opt_group") if k > 1 else None
    vote_ranks = group_ranks(inter) if inter is not None else [dist.get_rank()]
    ms = cfg.momentum_sync
    sync_size = None
    if ms is not None and ms.group == "node":
        sync_size = ms.group_size or instance_sync_group_size(vote_ranks)
        sync_size = node_group_size(sync_size, len(vote_ranks))
    wanted = []
    if inter is None or cfg.timeout_s is not None:
        wanted.append(vote_ranks)
    if sync_size is not None:
        me = vote_ranks.index(dist.get_rank())
        wanted.append(consecutive_blocks(vote_ranks, sync_size)[me // sync_size])
    created = create_on_all_ranks(wanted, cfg.timeout_s)
    vote = created.pop(0) if inter is None or cfg.timeout_s is not None else inter
    sync_node = created.pop(0) if sync_size is not None else None

    # --- Megatron's side: no all-reduce across instances, then its distributed optimizers
    vote_across_instances(model_chunks)
    try:  # an error while building leaves Megatron's all-reduce across instances as it was
        for i, chunk in enumerate(model_chunks):  # what Megatron's own factory sets (its DDP reads it)
            chunk.overlap_param_gather_with_optimizer_step = first_apart and i == 0
        optimizers = []
        for kind, pgroups, chunks, attr, part, whole, mp in kinds:
            dopt = _distributed_optimizer(config, chunks, pgroups, attr, part, mp, vote if k > 1 else None)
            shard_groups, pieces = _shard_groups(dopt, pgroups, names)
            premade = {"vote": vote, "agree": part, "full": whole, "node": sync_node}
            inner = MegatronLionCub(shard_groups, config=cfg, process_group=vote, megatron_groups=premade)
            inner.megatron_kind = kind
            inner.megatron_tag = _model_parallel_tag(kind, groups)
            inner.megatron_layout = {"instances": k, "instance_size": dist.get_world_size(part)}
            inner.megatron_param_pieces = pieces
            dopt.optimizer = inner
            for name, fn in (("state_dict", _common_state_dict), ("sharded_state_dict", _common_state_dict),
                             ("load_state_dict", _load_common_state_dict), ("save_parameter_state", _save_parameter_state),
                             ("load_parameter_state", _load_parameter_state)):
                setattr(dopt, name, types.MethodType(fn, dopt))
            # with K instances Megatron reduces gradient statistics (norm for clipping, zeros) inside the
            # instance: the instance's shards are one gradient, the instance mean
            dopt.grad_stats_parallel_group = pgs["intra_dist_opt_group"]
            dopt.tp_group = groups["expt_tp"] if kind == "expert" else groups["tp"]
            optimizers.append(dopt)
    except BaseException:
        restore_instance_all_reduce(model_chunks)
        raise
    if dump_map is not None:
        _dump_param_map(model_chunks, all_groups, dump_map)
    if dist.get_rank() == 0:
        sizes = ", ".join(f"{o.optimizer.megatron_kind}: {sum(p.numel() for g in o.optimizer.param_groups for p in g['params'])}"
                          " shard elements" for o in optimizers)
        log.info("LionCub (Megatron, voters='node'): %d instances x %d ranks; %s voting over %d instances; betas=%s; "
                 "settings=%s", k, size, sizes, k, betas, inner_settings)
    chained = ChainedOptimizer(optimizers)
    # Megatron's checkpoint calls on the chain: its own would hand them to Adam's code paths
    chained.save_parameter_state = types.MethodType(_chained_save_parameter_state, chained)
    chained.load_parameter_state = types.MethodType(_load_parameter_state, chained)
    chained.load_state_dict = types.MethodType(_chained_load_state_dict, chained)
    agree_found_inf_once_per_step(chained, config)
    return chained


def _distributed_optimizer(config, chunks, pgroups, buffer_attr, part, mp, vote):
    """Megatron's DistributedOptimizer over ``pgroups``' buffers, sharded over ``part`` (this
    rank's instance), with one leaf per shard (:func:`_leaf_shards`). ``chunks``: (its model
    chunks, the index of the first one among all chunks: Megatron's key for their buffers)."""
    model_chunks, first = chunks
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    # DistributedOptimizer accepts only Adam as the inner optimizer at construction (its
    # checkpoint code); it is a placeholder without state, replaced by LionCub once Megatron has
    # cut the groups into this rank's shards.
    placeholder = torch.optim.AdamW([dict(g, params=list(g["params"])) for g in pgroups], lr=config.lr)
    buffers = {first + i: list(getattr(chunk, buffer_attr)) for i, chunk in enumerate(model_chunks)}
    dopt = DistributedOptimizer(placeholder, config, _grad_scaler(config), _init_state_fn, model_chunks=model_chunks,
                                per_model_buffers=buffers, data_parallel_group=part, data_parallel_group_gloo=None,
                                data_parallel_group_idx=dist.get_rank(mp),
                                distributed_optimizer_instance_id=dist.get_rank(vote) if vote is not None else 0)
    _leaf_shards(dopt)
    return dopt


def _shard_groups(dopt, pgroups, names):
    """LionCub's parameter groups over the shards of ``dopt`` (Megatron's groups' settings, the
    model parameters' names), and the piece of which parameter each shard is."""
    shard_groups, pieces = [], []
    for gi, rng in enumerate(dopt.opt_group_ranges):
        models = [*dopt.model_fp32_groups[gi], *dopt.model_float16_groups[gi]]
        g = {key: v for key, v in pgroups[gi].items() if key not in ("params", "param_names")}
        g["params"] = list(rng["orig_group"]["params"])
        g["param_names"] = [names.get(p) for p in models]
        shard_groups.append(g)
        for model_param, shard in zip(models, g["params"]):  # which piece of which parameter each shard is
            start = int(_compat.shard_range(dopt, model_param).start)
            pieces.append((names.get(model_param), start, shard.numel()))
            # the hash tie rule keys on the element's index inside the model parameter, not the shard
            setattr(shard, ELEMENT_START, start)
    return shard_groups, pieces


def _dump_param_map(model_chunks, param_groups, path):
    """Same file as Megatron's ``dump_param_to_param_group_map`` (dense groups first, then expert)."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.transformer.fsdp_dtensor_checkpoint import get_global_unique_param_name
    mapping = {}
    ordered = [g for g in param_groups if not g["is_expert_parallel"]] + \
              [g for g in param_groups if g["is_expert_parallel"]]
    for gid, g in enumerate(ordered):
        for p in g["params"]:
            mapping[get_global_unique_param_name(model_chunks, p)] = gid
    dcp.save(state_dict=mapping, checkpoint_id=path)


# Drop-in name: ``from lioncub_ds.megatron import get_megatron_optimizer``.
get_megatron_optimizer = get_megatron_lioncub_optimizer


def lioncub_optimizers(optimizer) -> list:
    """The LionCub instances inside a Megatron optimizer (ChainedOptimizer / wrapper / LionCub)."""
    if isinstance(optimizer, LionCub):
        return [optimizer]
    subs = getattr(optimizer, "chained_optimizers", None)
    if subs is None:
        subs = [optimizer]
    out = []
    for sub in subs:
        inner = getattr(sub, "optimizer", None)
        if isinstance(inner, LionCub):
            out.append(inner)
    return out
