"""LionCub inside Megatron-LM's own training scripts (``pretrain_gpt.py`` & co.): :func:`install`.

Megatron-LM's training loop (``megatron.training``, not on the package index) has no optimizer
hook. :func:`install` swaps LionCub in where its call sites look the names up, for
megatron-core / Megatron-LM 0.16 through main (0.20); every patched name and the call site it
serves is listed in :data:`lioncub_ds.megatron._compat.MEGATRON_LM_PATCHES`:

* ``megatron.training.arguments.add_megatron_arguments``: Megatron's parser also gets every
  ``--lioncub-*`` flag (``parse_args`` calls it by its module-global name on every version;
  ``pretrain()`` lost ``extra_args_provider`` in 0.18, so this is the one hook that works on all).
* ``validate_args`` (``megatron.training.initialize`` in 0.16/0.17, ``megatron.training.arguments``
  from 0.18, where ``parse_and_validate_args`` calls it): before Megatron's own validation, and
  so before any process group or model exists, :func:`check_megatron_args` raises ONE
  :class:`LionCubMegatronArgsError` listing every incompatible flag by its command-line name.
* ``megatron.training.training.get_megatron_optimizer`` (imported into that module, so patching
  ``megatron.core.optimizer`` would do nothing): :func:`lioncub_ds.megatron.get_megatron_lioncub_optimizer`
  with the settings read from ``get_args()`` (:func:`settings_from_megatron_args`).
* ``megatron.training.training.save_checkpoint``: every rank writes its LionCub files into the
  iteration directory (``get_checkpoint_name(save_dir, iteration, return_base_dir=True)``) BEFORE
  Megatron's save, so they are complete before Megatron's tracker says "latest"; then Megatron saves.
  ``--no-save-optim`` writes none; ``--lioncub-checkpoint-mode sync`` averages the momenta instead.
* ``megatron.training.training.load_checkpoint``: after Megatron's load, the per-rank files of the
  loaded iteration are read back; nothing is read with ``--finetune`` (also when Megatron fell back
  to ``--pretrained-checkpoint``), ``--no-load-optim``, a release checkpoint, or no checkpoint.

Use it in place of ``pretrain_gpt.py`` (same arguments plus ``--lioncub-*``)::

    torchrun --nproc_per_node 8 -m lioncub_ds.megatron.run pretrain_gpt.py <Megatron args> --lioncub-comm 1bit

or in a script of your own: ``lioncub_ds.megatron.training.install()`` before Megatron-LM's
``pretrain(...)`` runs (see docs/megatron.md).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import logging
import os

from ..config import LionCubConfigError
from ..groups import requested
from . import _compat
from .args import add_lioncub_args, lioncub_settings_from_args

log = logging.getLogger("lioncub_ds")

#: Megatron's default Adam betas; taken silently for Lion they would give β2 = 0.999.
MEGATRON_ADAM_DEFAULTS = (0.9, 0.999)
#: ``--optimizer`` values whose optimizer LionCub replaces (others build another optimizer elsewhere).
LIONCUB_OPTIMIZER_CHOICES = ("adam", "lion")


class LionCubMegatronArgsError(LionCubConfigError):
    """Megatron-LM arguments that cannot work with LionCub (all of them, in one message)."""


# (dest, test(args) -> bool, why). The command-line name comes from Megatron's own parser.
def _on(name):
    return lambda a: bool(getattr(a, name, False))


_NEEDS_DIST_OPT = "needs the distributed optimizer, which LionCub replaces (except with --lioncub-voters node)"
_NEEDS_DIST_OPT_OR_FSDP = "needs the distributed optimizer (or FSDP)"


def _node(a) -> bool:
    """--lioncub-voters node: LionCub runs inside Megatron's distributed optimizer (instances vote)."""
    return requested(a).node_voters


def _node_size_problem(a) -> bool:
    """--lioncub-node-size given and not DP / K (checked once Megatron has derived the DP size)."""
    size, dp = requested(a).node_size, getattr(a, "data_parallel_size", None)
    if not _node(a) or size is None or not dp:
        return False
    k = getattr(a, "num_distributed_optimizer_instances", 1) or 1
    dp_cp = dp * (getattr(a, "context_parallel_size", 1) or 1)
    return dp_cp % k != 0 or size != dp_cp // k


def _node_size_why(a) -> str:
    dp = (getattr(a, "data_parallel_size", 0) or 0) * (getattr(a, "context_parallel_size", 1) or 1)
    k = getattr(a, "num_distributed_optimizer_instances", 1) or 1
    return (f"with --lioncub-voters node a voter is a distributed-optimizer instance of data-parallel size {dp} / "
            f"--num-distributed-optimizer-instances {k} = {dp // k if k else '?'} ranks; allowed: "
            f"--lioncub-node-size {dp // k if k else '?'} or leave it unset (it is taken from the instances)")


INCOMPATIBLE_FLAGS = (
    ("use_distributed_optimizer", lambda a: bool(getattr(a, "use_distributed_optimizer", False)) and not _node(a),
     "the distributed optimizer reduce-scatters gradients and shards optimizer state over data-parallel ranks; "
     "LionCub keeps one full local momentum per rank and exchanges only 1-bit votes (or add --lioncub-voters node: "
     "the distributed optimizer's instances then vote, see docs/megatron.md)"),
    ("lioncub_voters", lambda a: _node(a) and not getattr(a, "use_distributed_optimizer", False),
     "node voters run inside Megatron's distributed optimizer: add --use-distributed-optimizer "
     "--num-distributed-optimizer-instances K (K instances vote; each instance's DP/K ranks shard the parameters)"),
    ("lioncub_node_size", lambda a: requested(a).node_size is not None and not _node(a),
     "node_size without --lioncub-voters node (master-only sharding) is Megatron's own distributed optimizer's "
     "job; allowed: leave it unset, or --lioncub-voters node with --use-distributed-optimizer"),
    ("lioncub_node_size", _node_size_problem, _node_size_why),
    ("overlap_grad_reduce", lambda a: bool(getattr(a, "overlap_grad_reduce", False))
     and not getattr(a, "lioncub_keep_grad_allreduce", False) and not _node(a),
     "no data-parallel gradient reduction is left to overlap (LionCub votes after backward), and the flag makes "
     "DDP's backward hooks issue reduce collectives"),
    ("lioncub_keep_grad_allreduce", lambda a: _node(a) and bool(getattr(a, "lioncub_keep_grad_allreduce", False)),
     "with --lioncub-voters node each instance reduce-scatters its gradients and the instances vote: there is no "
     "all-reduce across them to keep; leave it out (or use it without node voters, as the global-Lion baseline)"),
    ("lioncub_checkpoint_mode", lambda a: _node(a) and getattr(a, "lioncub_checkpoint_mode", None) == "sync",
     "with --lioncub-voters node Megatron's checkpoint holds no optimizer tensors: the momentum and fp32 main "
     "shards are in the per-rank files; allowed: --lioncub-checkpoint-mode per_rank (the default)"),
    # with node voters Megatron's distributed optimizer all-gathers the parameters after LionCub's
    # step; --overlap-param-gather defers that to the next forward's pre-hooks (Megatron's own)
    ("overlap_param_gather", lambda a: _on("overlap_param_gather")(a) and not _node(a), _NEEDS_DIST_OPT),
    # with node voters Megatron splits the first model chunk's optimizer off (virtual pipeline: its
    # own validation asks for one) and starts that chunk's all-gather while the others step
    ("overlap_param_gather_with_optimizer_step",
     lambda a: _on("overlap_param_gather_with_optimizer_step")(a) and not _node(a), _NEEDS_DIST_OPT),
    ("fp8_param_gather", _on("fp8_param_gather"), "the fp8 parameter all-gather " + _NEEDS_DIST_OPT_OR_FSDP),
    ("fp4_param_gather", _on("fp4_param_gather"), "the fp4 parameter all-gather " + _NEEDS_DIST_OPT_OR_FSDP),
    ("reuse_grad_buf_for_mxfp8_param_ag", _on("reuse_grad_buf_for_mxfp8_param_ag"), _NEEDS_DIST_OPT),
    ("num_distributed_optimizer_instances", lambda a: (getattr(a, "num_distributed_optimizer_instances", 1) or 1) > 1
     and not _node(a), _NEEDS_DIST_OPT),
    ("use_megatron_fsdp", _on("use_megatron_fsdp"),
     "FSDP shards parameters and gradients over data-parallel ranks; LionCub needs full local ones"),
    ("use_custom_fsdp", _on("use_custom_fsdp"),
     "FSDP shards parameters and gradients over data-parallel ranks; LionCub needs full local ones"),
    ("use_torch_fsdp2", _on("use_torch_fsdp2"),
     "FSDP shards parameters and gradients over data-parallel ranks; LionCub needs full local ones"),
    ("optimizer_cpu_offload", _on("optimizer_cpu_offload"), "CPU offload wraps Megatron's Adam/SGD, not LionCub"),
    ("use_precision_aware_optimizer", _on("use_precision_aware_optimizer"),
     "a TransformerEngine FusedAdam feature; use --lioncub-momentum-dtype bf16 for a bf16 momentum"),
    ("optimizer_cuda_graph", _on("optimizer_cuda_graph"),
     "LionCub's step reads one agreed flag on the host (skip / NaN agreement), which a CUDA graph cannot capture"),
    ("use_layer_wise_distributed_optimizer", _on("use_layer_wise_distributed_optimizer"),
     "the layer-wise distributed optimizer shards optimizer state over data-parallel ranks"),
    ("optimizer", lambda a: getattr(a, "optimizer", "adam") not in LIONCUB_OPTIMIZER_CHOICES,
     "LionCub replaces the optimizer Megatron builds for --optimizer adam (or lion); other values build "
     "Megatron's own optimizer elsewhere and LionCub would silently not run"),
    ("optimizer", lambda a: getattr(a, "optimizer", "adam") == "lion"
     and (_compat.megatron_version() or (0, 99)) < (0, 18),
     "Megatron-LM before 0.18 builds no optimizer config for --optimizer lion (\"Invalid optimizer type!\"); use "
     "--optimizer adam with --lioncub-beta1 / --lioncub-beta2"),
    ("lioncub_overlap", _on("lioncub_overlap"),
     "Megatron hands the optimizer its gradients (main_grad, unscaled and clipped) only inside step(), so no "
     "vote can start during backward; leave it out (votes start in step(), one per optimizer step)"),
    ("non_persistent_ckpt_type",
     lambda a: getattr(a, "non_persistent_ckpt_type", None) == "local"
     and getattr(a, "non_persistent_save_interval", None)
     and getattr(a, "lioncub_checkpoint_mode", "per_rank") == "per_rank",
     "local non-persistent checkpoints are restored by Megatron's local checkpoint manager, which does not "
     "know the per-rank LionCub files; use --lioncub-checkpoint-mode sync or global non-persistent checkpoints"),
    ("lioncub_momentum_sync_schedule", lambda a: _drift_with_model_parallel(a),
     "schedule drift with tensor or pipeline parallelism: each model-parallel position would decide its own sync "
     "steps, and parameters held alike by several positions (layer norms, biases replicated over tensor-parallel "
     "ranks, tied embeddings) would drift apart; allowed: a fixed schedule (--lioncub-momentum-sync-every K, or "
     "geometric), or drift with TP = PP = 1"),
)


def _drift_with_model_parallel(a) -> bool:
    """--lioncub-momentum-sync-schedule drift (or "schedule": "drift" in --lioncub-momentum-sync) with
    TP or PP > 1: the optimizer factory would refuse it after the model is built."""
    tp = getattr(a, "tensor_model_parallel_size", 1) or 1
    pp = getattr(a, "pipeline_model_parallel_size", 1) or 1
    if tp * pp == 1:
        return False
    ms = lioncub_settings_from_args(a).get("momentum_sync")
    return isinstance(ms, dict) and ms.get("schedule") == "drift"

_state = {"installed": False, "saved": [], "option_names": {}}


def _flag_name(dest: str) -> str:
    names = _state["option_names"].get(dest)
    if names:
        longs = [n for n in names if n.startswith("--")]
        return (longs or names)[0]
    return "--" + dest.replace("_", "-")


def _flag_text(args, dest: str) -> str:
    name = _flag_name(dest)
    value = getattr(args, dest, None)
    if isinstance(value, bool) or value is None:
        return name
    return f"{name} {value}"


def beta_problem(args) -> str | None:
    """Why Lion's betas cannot be taken from ``args`` (None if they can)."""
    b1, b2 = getattr(args, "lioncub_beta1", None), getattr(args, "lioncub_beta2", None)
    if b1 is not None and b2 is not None:
        return None
    if (b1 is None) != (b2 is None):
        return "give both --lioncub-beta1 and --lioncub-beta2 (or neither, with --optimizer lion)"
    if getattr(args, "optimizer", "adam") == "lion" and getattr(args, "lion_beta2", None) is not None:
        return None
    adam = (getattr(args, "adam_beta1", None), getattr(args, "adam_beta2", None))
    if adam == MEGATRON_ADAM_DEFAULTS:
        return ("set Lion's betas with --lioncub-beta1 and --lioncub-beta2 (Lion's defaults 0.9 / 0.99; LLM "
                "recipes use 0.95 / 0.98): without them LionCub would take --adam-beta1 / --adam-beta2, and "
                "Megatron's --adam-beta2 default 0.999 is Adam's (a momentum that decays ten times slower than "
                "Lion's). To really use the Adam betas, pass them as --lioncub-beta1 / --lioncub-beta2")
    return None


def megatron_args_problems(args) -> list[str]:
    """Every reason ``args`` cannot run with LionCub, each naming its command-line flag."""
    problems = []
    for dest, test, why in INCOMPATIBLE_FLAGS:
        try:
            bad = test(args)
        except Exception:  # an attribute of an unexpected type: not ours to judge
            bad = False
        if bad:
            problems.append(f"{_flag_text(args, dest)}: {why(args) if callable(why) else why}")
    beta = beta_problem(args)
    if beta is not None:
        problems.append(f"betas: {beta}")
    return problems


def check_megatron_args(args) -> None:
    """Raise ONE :class:`LionCubMegatronArgsError` listing every problem (before the model is built)."""
    problems = megatron_args_problems(args)
    if problems:
        raise LionCubMegatronArgsError(
            "LionCub cannot run with these Megatron-LM arguments (change all of them, then relaunch):\n  - "
            + "\n  - ".join(problems)
            + "\n(Without the distributed optimizer a rank holds ~14 bytes per parameter: see docs/megatron.md.)")


def settings_from_megatron_args(args) -> dict:
    """The ``lioncub`` settings dict from Megatron-LM's parsed arguments (``get_args()``)."""
    settings = lioncub_settings_from_args(args)
    if "betas" not in settings:
        if getattr(args, "optimizer", "adam") == "lion" and getattr(args, "lion_beta2", None) is not None:
            settings["betas"] = (args.lion_beta1, args.lion_beta2)
        else:
            problem = beta_problem(args)
            if problem is not None:
                raise LionCubMegatronArgsError(f"LionCub: {problem}")
            settings["betas"] = (args.adam_beta1, args.adam_beta2)
    return settings


# ----------------------------------------------------------------------------- the swaps
def _modules(training=None, checkpointing=None, arguments=None, initialize=None):
    def load(name, given):
        if given is not None:
            return given
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            raise _compat.MegatronNotAvailableError(
                f"lioncub_ds.megatron.training.install() needs Megatron-LM's training package ({name}); it is not "
                "on the package index: put a Megatron-LM checkout (the tag matching your megatron-core) on "
                f"PYTHONPATH, e.g. run from its root. Import failed: {exc}") from exc
    return (load("megatron.training.training", training), load("megatron.training.checkpointing", checkpointing),
            load("megatron.training.arguments", arguments), load("megatron.training.initialize", initialize))


def _patch(module, name, new):
    old = getattr(module, name)
    _state["saved"].append((module, name, old))
    setattr(module, name, new)
    return old


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _get_args(training):
    fn = getattr(training, "get_args", None)
    if fn is None:
        from megatron.training import get_args as fn  # noqa: N813
    return fn()


def install(*, training=None, checkpointing=None, arguments=None, initialize=None) -> None:
    """Swap LionCub into Megatron-LM's training loop (idempotent; :func:`uninstall` undoes it).

    The keyword arguments are for tests only: module objects standing in for
    ``megatron.training.training`` / ``.checkpointing`` / ``.arguments`` / ``.initialize``.
    """
    if _state["installed"]:
        return
    modules = _modules(training, checkpointing, arguments, initialize)
    try:
        _install(*modules)
    except BaseException:
        uninstall()  # all or nothing
        raise
    _state["installed"] = True


def _install(training, checkpointing, arguments, initialize) -> None:
    from . import checkpoint as mckpt
    from .optimizer import get_megatron_lioncub_optimizer, lioncub_optimizers

    # --- arguments: the flags, recorded option names, the early check
    orig_add = arguments.add_megatron_arguments

    @functools.wraps(orig_add)
    def add_megatron_arguments(parser: argparse.ArgumentParser):
        parser = orig_add(parser) or parser
        if "--lioncub-comm" not in getattr(parser, "_option_string_actions", {}):
            add_lioncub_args(parser)
        for action in parser._actions:
            _state["option_names"].setdefault(action.dest, list(action.option_strings))
        return parser

    _patch(arguments, "add_megatron_arguments", add_megatron_arguments)

    def wrap_validate(orig):
        @functools.wraps(orig)
        def validate_args(args, *a, **kw):
            check_megatron_args(args)  # what the user typed, before Megatron's own checks
            out = orig(args, *a, **kw)
            check_megatron_args(args)  # anything Megatron's validation derived (still before the model)
            return out
        validate_args._lioncub = True
        return validate_args

    for module in (arguments, initialize):
        fn = getattr(module, "validate_args", None)
        if fn is not None and not getattr(fn, "_lioncub", False):
            _patch(module, "validate_args", wrap_validate(fn))

    # --- the optimizer
    def get_megatron_optimizer(config, model_chunks, *a, **kw):
        args = _get_args(training)
        check_megatron_args(args)  # fallback when validate_args was not called (e.g. --yaml-cfg)
        settings = settings_from_megatron_args(args)
        known = _compat.FACTORY_KWARGS
        dropped = sorted(k for k in kw if k not in known)
        if dropped:
            log.warning("LionCub (Megatron-LM): ignoring get_megatron_optimizer arguments %s", dropped)
        kw = {k: v for k, v in kw.items() if k in known}
        return get_megatron_lioncub_optimizer(
            config, model_chunks, *a, lioncub=settings,
            disable_grad_reduction=not getattr(args, "lioncub_keep_grad_allreduce", False), **kw)

    _patch(training, "get_megatron_optimizer", get_megatron_optimizer)

    # --- checkpoints
    orig_save = training.save_checkpoint

    @functools.wraps(orig_save)
    def save_checkpoint(iteration, model, optimizer, *a, **kw):
        args = _get_args(training)
        mode = getattr(args, "lioncub_checkpoint_mode", "per_rank")
        if optimizer is None or not lioncub_optimizers(optimizer) or getattr(args, "no_save_optim", False):
            return orig_save(iteration, model, optimizer, *a, **kw)
        if mode != "per_rank":  # sync: the momenta averaged into Megatron's own checkpoint, no files of ours
            mckpt.before_checkpoint_save(optimizer, mode)
            return orig_save(iteration, model, optimizer, *a, **kw)
        iter_dir = save_iteration_dir(args, checkpointing, iteration,
                                      non_persistent=kw.get("non_persistent_ckpt", False),
                                      release=kw.get("release", False))
        mckpt.before_checkpoint_save(optimizer, mode, checkpoint_dir=iter_dir)
        with mckpt.quiet_nonempty_dir_warning(iter_dir), _keeping_last_finished(checkpointing, kw):
            return orig_save(iteration, model, optimizer, *a, **kw)

    _patch(training, "save_checkpoint", save_checkpoint)

    orig_load = training.load_checkpoint

    @functools.wraps(orig_load)
    def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, *a, **kw):
        result = orig_load(ddp_model, optimizer, opt_param_scheduler, *a, **kw)
        if optimizer is None or not lioncub_optimizers(optimizer):
            return result
        args = _get_args(training)
        iteration = result[0] if isinstance(result, tuple) else result
        if getattr(args, "finetune", False) or getattr(args, "no_load_optim", False):
            return result  # Megatron loaded no optimizer state either
        load_arg = kw.get("load_arg", a[0] if a else "load")
        found = loaded_iteration_dir(args, checkpointing, load_arg, iteration)
        if found is None:
            if iteration and _rank() == 0:
                log.warning("LionCub: Megatron loaded iteration %s, but no directory of that iteration was found "
                            "under --%s (or its non-persistent folder): LionCub's per-rank files were not read, the "
                            "momenta are what Megatron's checkpoint holds", iteration, load_arg.replace("_", "-"))
            return result  # no checkpoint, or a release checkpoint (no optimizer state)
        mode = getattr(args, "lioncub_checkpoint_mode", "per_rank")
        mckpt.after_checkpoint_load(optimizer, found, mode, reshard=getattr(args, "lioncub_reshard", "average"),
                                    iteration=iteration)
        if _rank() == 0:
            log.info("LionCub: %s (iteration %s)", f"restored every rank's momentum from {found}/{mckpt.SUBDIR}"
                     if mode == "per_rank" else "momenta from Megatron's checkpoint (sync mode)", iteration)
        return result

    _patch(training, "load_checkpoint", load_checkpoint)


def uninstall() -> None:
    """Put back every name :func:`install` replaced."""
    while _state["saved"]:
        module, name, old = _state["saved"].pop()
        setattr(module, name, old)
    _state["installed"] = False


def installed() -> bool:
    return _state["installed"]


# ----------------------------------------------------------------------------- directories
@contextlib.contextmanager
def _keeping_last_finished(checkpointing, save_kw):
    """Around a non-persistent save in per_rank mode: Megatron's save first removes all but the
    newest non-persistent iteration folder (``cleanup_old_non_persistent_checkpoint``, keep 1),
    and the newest is now the one LionCub just wrote its files into, not finished yet; it keeps
    one more, so the last finished checkpoint survives until this one is complete (afterwards
    the same folders remain as without LionCub)."""
    cleanup = getattr(checkpointing, "cleanup_old_non_persistent_checkpoint", None)
    if not save_kw.get("non_persistent_ckpt", False) or cleanup is None:
        yield
        return

    def keep_one_more(save_dir, leave_ckpt_num=1, *a, **kw):
        return cleanup(save_dir, leave_ckpt_num + 1, *a, **kw)

    checkpointing.cleanup_old_non_persistent_checkpoint = keep_one_more
    try:
        yield
    finally:
        checkpointing.cleanup_old_non_persistent_checkpoint = cleanup


def save_iteration_dir(args, checkpointing, iteration, non_persistent=False, release=False) -> str:
    """The directory Megatron's ``save_checkpoint`` is about to write (what it computes itself)."""
    save_dir = args.save
    if non_persistent:
        kind = getattr(args, "non_persistent_ckpt_type", None)
        if kind == "global":
            sub = getattr(checkpointing, "_NON_PERSISTENT_CKPT_SUBDIR", "non_persistent")
            save_dir = getattr(args, "non_persistent_global_ckpt_dir", None) or os.path.join(save_dir, sub)
        else:
            raise LionCubMegatronArgsError(
                f"LionCub: non-persistent checkpoints of type {kind!r} are not supported with per-rank LionCub "
                "files; use --non-persistent-ckpt-type global or --lioncub-checkpoint-mode sync")
    return checkpointing.get_checkpoint_name(save_dir, iteration, release=release, return_base_dir=True)


def _read_tracker(path):
    """(iteration, release) from Megatron's tracker file, read locally (no collective), or None."""
    if not path or not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if text == "release":
        return 0, True
    try:
        return int(text), False
    except ValueError:
        return None


def loaded_iteration_dir(args, checkpointing, load_arg, iteration) -> str | None:
    """The iteration directory Megatron just loaded (persistent or global non-persistent), or None
    (no checkpoint, or a release checkpoint: no optimizer state).

    Where Megatron looks: ``<load>`` and, for global non-persistent checkpoints,
    ``--non-persistent-global-ckpt-dir`` or ``<load>/non_persistent`` (its subfolder of the LOAD
    directory; ``<save>/non_persistent`` is looked at last, for a resume with --load == --save). A
    folder whose tracker names ``iteration`` wins; else one that holds ``iter_<iteration>`` (what
    ``--ckpt-step`` loads while the tracker names a later one)."""
    load_dir = getattr(args, load_arg, None)
    candidates = []
    if load_dir:
        candidates.append(load_dir)
    if getattr(args, "non_persistent_ckpt_type", None) == "global":
        sub = getattr(checkpointing, "_NON_PERSISTENT_CKPT_SUBDIR", "non_persistent")
        explicit = getattr(args, "non_persistent_global_ckpt_dir", None)
        bases = [explicit] if explicit else [os.path.join(d, sub) for d in (load_dir, getattr(args, "save", None)) if d]
        candidates += [b for b in bases if b not in candidates]
    for base in candidates:
        meta = _read_tracker(checkpointing.get_checkpoint_tracker_filename(base))
        if meta is None:
            continue
        it, release = meta
        if release:
            return None  # Megatron loads no optimizer state from a release checkpoint
        if it == iteration:
            return checkpointing.get_checkpoint_name(base, it, release=False, return_base_dir=True)
    if not iteration:
        return None
    for base in candidates:
        path = checkpointing.get_checkpoint_name(base, iteration, release=False, return_base_dir=True)
        if os.path.isdir(path):
            return path
    return None