"""TEST-ONLY: check NCCL's rules on CPU while the code under test runs on gloo.

Real clusters run torch.distributed on NCCL; this machine runs gloo, which accepts much that
NCCL refuses. :func:`install` wraps torch.distributed's collectives in this process and checks,
call by call:

1. **Device.** Every tensor handed to a collective lives on the *expected device*, the device
   of the parameters (declared with :func:`expect_device`; ``cpu`` unless declared). NCCL takes
   CUDA tensors only, so a tensor built without ``device=`` (the CPU default) next to CUDA
   parameters breaks on a cluster. A tensor on ``meta`` or on any other device is refused too:
   see :func:`stray_default_device` for how to provoke that situation on a CPU machine.
2. **dtype / reduce op.** Only pairs NCCL supports (table below). Also: dense, contiguous
   tensors (ProcessGroupNCCL's ``check_gpu_single_tensor``), no ``monitored_barrier`` (gloo only).
3. **Same sequence.** Every call is logged as (op, group ranks, dtype, shape, reduce op);
   group creations too. :func:`compare_logs` checks, for every pair of ranks, that the calls
   on groups holding both of them came in the same order with the same signature (a
   collective one rank skips, repeats or issues with another dtype deadlocks or corrupts under
   NCCL), and that world-synchronised ``new_group`` calls came in the same order on all ranks.
   The comparison runs outside the wrapper: the spawner (:mod:`lioncub_ds.testing.spawn`)
   collects every rank's log and compares them in the parent.

Violations of 1 and 2 raise :class:`NCCLContractError` at the call (before the backend runs)
and are also kept in the log, so a library that catches and re-wraps the exception still fails
the test.

Where the names are reached: code calls ``dist.X`` / ``torch.distributed.X`` (both the same
module attribute), ``torch.distributed.distributed_c10d.X`` (DeepSpeed's coalesced all-gather),
or a reference taken at import time (``_all_gather_single = dist.all_gather_into_tensor`` in
our comm layer, megatron's ``dist_all_gather_func`` / ``dist_reduce_scatter_func``,
DeepSpeed's ``all_gather_function`` cached by ``init_distributed``). :func:`install` patches the
two modules and then replaces every module-level reference to an original function in
``sys.modules``; install it before importing the code under test where possible (the spawner
does). Nested calls (torch's own ``all_gather_into_tensor`` → ``all_gather_single``,
``new_subgroups`` → ``new_group``) are logged once, at the outermost call.

This module imports only torch and the standard library, so a script that must not import
``lioncub_ds`` (the DeepSpeed test script) can load it by file path.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading

import torch

__all__ = ["NCCLContractError", "install", "uninstall", "installed", "expect_device", "expected_device",
           "stray_default_device", "no_group_creation", "expecting_violation", "log", "violations", "reset", "snapshot",
           "compare_logs", "check_dtype_op", "NCCL_DTYPES", "NCCL_REDUCE_OPS"]


class NCCLContractError(AssertionError):
    """A collective call that NCCL would refuse or that would deadlock / diverge under NCCL."""


# ----------------------------------------------------------------------------- NCCL's tables
# dtypes ProcessGroupNCCL can hand to NCCL: the ``ncclDataType`` map in PyTorch's
# torch/csrc/distributed/c10d/NCCLUtils.hpp (kChar->ncclInt8, kByte->ncclUint8, kFloat, kDouble,
# kInt->ncclInt32, kLong->ncclInt64, kHalf, kBool->ncclUint8, kBFloat16, the float8 types);
# anything else (int16, uint16/32/64, ...) fails "Input tensor data type is not supported for NCCL
# process group". Complex tensors never reach the map: torch.distributed's Python layer views
# them as real (``torch.view_as_real``) and allows only SUM / AVG / PREMUL_SUM on them
# (``supports_complex`` in distributed_c10d.py).
NCCL_DTYPES = frozenset({torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                         torch.float32, torch.float64, torch.bool}
                        | {getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz",
                                                       "float8_e4m3fnuz") if hasattr(torch, n)})
_COMPLEX = frozenset({torch.complex64, torch.complex128})
_FLOAT8 = frozenset(d for d in NCCL_DTYPES if "float8" in str(d))
# Reduce ops: ProcessGroupNCCL::getNcclReduceOp (same file family, ProcessGroupNCCL.cpp) maps
# SUM, PRODUCT, MIN, MAX, AVG (NCCL >= 2.10) and PREMUL_SUM (half/float/double only, NCCL >= 2.11);
# BAND / BOR / BXOR raise "Cannot use ReduceOp.BAND with NCCL". Bool inputs: SUM is mapped to
# ncclMax (a logical or), AVG raises "Cannot use ReduceOp.AVG with boolean inputs"; PRODUCT / MIN /
# MAX on bool run on the uint8 view. Float8 reductions raise "Unsupported Float8 type for NCCL
# reduction" on the NCCL builds torch ships against (treated as unsupported here). NCCL's own
# ncclAvg is defined for every NCCL dtype, integers included (integer division), so AVG on ints
# is allowed.
NCCL_REDUCE_OPS = frozenset({"SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM"})
_PREMUL_DTYPES = frozenset({torch.float16, torch.float32, torch.float64})


def _op_name(op) -> str:
    if op is None:
        return "SUM"
    name = getattr(op, "name", None)
    if isinstance(name, str):
        return name
    inner = getattr(op, "op", None)  # a ReduceOp object (e.g. PREMUL_SUM) wraps a RedOpType
    if inner is not None and getattr(inner, "name", None):
        return inner.name
    s = str(op)
    return s.rsplit(".", 1)[-1]


def check_dtype_op(dtype: torch.dtype, op: str | None) -> str | None:
    """None if NCCL can run ``op`` (None: a non-reducing collective) on ``dtype``; else why not."""
    if dtype in _COMPLEX:
        if op is not None and op not in ("SUM", "AVG", "PREMUL_SUM"):
            return f"ReduceOp.{op} on complex tensors is refused by torch.distributed (only SUM/AVG/PREMUL_SUM)"
        return None
    if dtype not in NCCL_DTYPES:
        return f"dtype {dtype} is not supported by NCCL (NCCL dtypes: {sorted(str(d) for d in NCCL_DTYPES)})"
    if op is None:
        return None
    if op not in NCCL_REDUCE_OPS:
        return f"ReduceOp.{op} is not supported by NCCL (only {sorted(NCCL_REDUCE_OPS)})"
    if dtype == torch.bool and op == "AVG":
        return "ReduceOp.AVG on bool tensors is refused by ProcessGroupNCCL"
    if dtype in _FLOAT8:
        return f"reductions on {dtype} are refused by ProcessGroupNCCL"
    if op == "PREMUL_SUM" and dtype not in _PREMUL_DTYPES:
        return f"ReduceOp.PREMUL_SUM needs half/float/double, not {dtype}"
    return None


# ----------------------------------------------------------------------------- state
class _State:
    def __init__(self):
        self.log: list[tuple] = []          # comparable entries
        self.sites: list[str] = []          # call site of each entry (for diffs only)
        self.violations: list[str] = []
        self.device: torch.device | None = None
        self.forbid_groups = 0
        self.enforce = True
        self.local = threading.local()


_S = _State()
_PATCHED: list[tuple] = []  # (owner, name, original)
_ORIG: dict[str, object] = {}

# name -> (kind, reducing). kind: "coll" compared across ranks, "p2p" checked but not compared,
# "group" a group creation, "object" pickled-object collectives (torch picks their device itself).
_OPS = {
    "all_reduce": ("coll", True), "all_reduce_coalesced": ("coll", True), "reduce": ("coll", True),
    "reduce_scatter": ("coll", True), "reduce_scatter_tensor": ("coll", True),
    "reduce_scatter_single": ("coll", True), "_reduce_scatter_base": ("coll", True),
    "all_gather": ("coll", False), "all_gather_into_tensor": ("coll", False), "all_gather_single": ("coll", False),
    "_all_gather_base": ("coll", False), "all_gather_coalesced": ("coll", False),
    "all_to_all_single": ("coll", False), "all_to_all": ("coll", False), "broadcast": ("coll", False),
    "gather": ("coll", False), "scatter": ("coll", False), "barrier": ("coll", False),
    "monitored_barrier": ("coll", False),
    "send": ("p2p", False), "recv": ("p2p", False), "isend": ("p2p", False), "irecv": ("p2p", False),
    "batch_isend_irecv": ("p2p", False),
    "all_gather_object": ("object", False), "broadcast_object_list": ("object", False),
    "gather_object": ("object", False), "scatter_object_list": ("object", False),
    "new_group": ("group", False), "new_subgroups": ("group", False),
    "new_subgroups_by_enumeration": ("group", False), "split_group": ("group", False),
}
# all_gather_into_tensor and friends are one collective under several names: log one name.
_CANON = {"all_gather_into_tensor": "all_gather_single", "_all_gather_base": "all_gather_single",
          "reduce_scatter_tensor": "reduce_scatter_single", "_reduce_scatter_base": "reduce_scatter_single"}


def installed() -> bool:
    return bool(_PATCHED)


def expect_device(device) -> None:
    """Declare the parameters' device: every tensor in a collective must live there."""
    _S.device = torch.device(device) if device is not None else None


def expected_device() -> torch.device:
    return _S.device if _S.device is not None else torch.device("cpu")


def log() -> list[tuple]:
    return list(_S.log)


def violations() -> list[str]:
    return list(_S.violations)


def reset() -> None:
    _S.log.clear()
    _S.sites.clear()
    _S.violations.clear()


def snapshot() -> dict:
    """What a rank sends back to the parent: its log, call sites and violations (plain data)."""
    return {"log": list(_S.log), "sites": list(_S.sites), "violations": list(_S.violations)}


@contextlib.contextmanager
def stray_default_device(device="meta"):
    """Run a block with torch's default device set to ``device`` (``meta`` by default).

    Use it around ``optimizer.step()`` (after the model and optimizer exist): every tensor the
    library creates without ``device=`` then lands on ``meta`` instead of the parameters'
    device, which is what happens on a GPU cluster (CUDA parameters, CPU default device). The
    contract refuses such a tensor at the first collective it reaches, naming the call site.
    Tensors created with ``device=param.device`` / ``*_like`` are unaffected.
    """
    prev = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(prev)


class _Caught:
    message: str | None = None


@contextlib.contextmanager
def expecting_violation():
    """For the contract's own tests: swallow the NCCLContractError raised in the block (and drop it
    from the recorded violations); ``.message`` is its text, None if nothing was raised."""
    caught = _Caught()
    n = len(_S.violations)
    try:
        yield caught
    except NCCLContractError as exc:
        caught.message = str(exc)
        del _S.violations[n:]


@contextlib.contextmanager
def no_group_creation(reason: str = "inside a training step"):
    """Refuse ``new_group`` & co. in a block: groups must be created at construction, on all ranks."""
    _S.forbid_groups += 1
    prev = getattr(_S.local, "forbid_reason", None)
    _S.local.forbid_reason = reason
    try:
        yield
    finally:
        _S.forbid_groups -= 1
        _S.local.forbid_reason = prev


# ----------------------------------------------------------------------------- the wrapper
_HERE = os.path.abspath(__file__)


def _call_site(depth: int = 5) -> tuple:
    """The innermost ``depth`` frames outside this module and torch.distributed (cheap: no source)."""
    out = []
    f = sys._getframe(1)
    while f is not None and len(out) < depth:
        fn = f.f_code.co_filename
        if fn != _HERE and "/torch/distributed/" not in fn and "contextlib" not in fn:
            out.append((fn, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    return tuple(out)


def _fmt_site(site) -> str:
    if not site:
        return "(unknown)"
    return "\n".join(f'File "{fn}", line {ln}, in {name}' for fn, ln, name in reversed(site))


def _violation(name: str, msg: str):
    site = _indent(_fmt_site(_call_site()))
    text = f"NCCL contract: {name}: {msg}\n  called from (innermost last):\n{site}"
    _S.violations.append(text)
    if _S.enforce:
        raise NCCLContractError(text)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                yield v
            elif isinstance(v, (list, tuple)):
                yield from _tensors(v)


def _group_ranks(group):
    import torch.distributed as dist
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _shape(t):
    return tuple(t.shape) if t is not None else None


def _resolved(device: torch.device) -> torch.device:
    # torch.device("cuda") names the current device: parameters declared as "cuda" and a tensor on
    # "cuda:0" are the same place when device 0 is current.
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_tensor(name, i, t, device):
    if _resolved(t.device) != _resolved(device):
        hint = (" (a tensor created without device=: under NCCL it would be a CPU tensor next to CUDA "
                "parameters)" if t.device.type == "meta" else "")
        _violation(name, f"tensor argument #{i} ({t.dtype}, shape {tuple(t.shape)}) is on {t.device}; the "
                         f"parameters are on {device}{hint}")
    if t.layout != torch.strided:
        _violation(name, f"tensor argument #{i} has layout {t.layout}; NCCL takes dense tensors")
    if not t.is_contiguous() and not t.is_contiguous(memory_format=torch.channels_last):
        _violation(name, f"tensor argument #{i} (shape {tuple(t.shape)}, stride {t.stride()}) is not "
                         "contiguous; ProcessGroupNCCL refuses it")


def _make_wrapper(name, orig):
    kind, reducing = _OPS[name]
    sig = inspect.signature(orig)
    canon = _CANON.get(name, name)

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        local = _S.local
        if getattr(local, "depth", 0):
            return orig(*args, **kwargs)
        local.depth = 1
        try:
            _record(name, canon, kind, reducing, sig, args, kwargs)
        finally:
            local.depth = 0
        local.depth = 1
        try:
            return orig(*args, **kwargs)
        finally:
            local.depth = 0

    wrapper.__lioncub_nccl_contract__ = orig
    return wrapper


def _record(name, canon, kind, reducing, sig, args, kwargs):
    import torch.distributed as dist
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return  # the original will raise the same TypeError
    a = bound.arguments
    if kind == "group":
        if _S.forbid_groups:
            _violation(name, f"process group created {getattr(_S.local, 'forbid_reason', '')}; create every "
                             "group at construction, on all ranks, in the same order")
        if name == "new_group":
            ranks = a.get("ranks")
            ranks = tuple(ranks) if ranks is not None else tuple(range(dist.get_world_size()))
            local_sync = bool(a.get("use_local_synchronization", False))
            entry = ("new_group", ranks, "local" if local_sync else "world")
        elif name == "new_subgroups":
            entry = (name, None, "world", a.get("group_size"))
        elif name == "new_subgroups_by_enumeration":
            entry = (name, None, "world", tuple(tuple(r) for r in a.get("ranks_per_subgroup_list") or ()))
        else:
            entry = (name, None, "world", tuple(tuple(r) for r in (a.get("split_ranks") or ())))
        _S.log.append(entry)
        _S.sites.append(_call_site())
        return
    group = a.get("group")
    if name == "batch_isend_irecv":
        ops = a.get("p2p_op_list") or []
        for op in ops:
            for t in _tensors(getattr(op, "tensor", None)):
                _check_tensor(name, 0, t, expected_device())
                why = check_dtype_op(t.dtype, None)
                if why:
                    _violation(name, why)
        return
    if group is not None and group is dist.GroupMember.NON_GROUP_MEMBER:
        return  # torch skips the call on non-members
    if name == "monitored_barrier":
        _violation(name, "monitored_barrier is implemented by gloo only; NCCL has no monitored_barrier")
    ranks = _group_ranks(group)
    if kind == "object":
        entry = (canon, ranks, "object", None, None)
    else:
        tensors = [t for v in a.values() for t in _tensors(v)]
        device = expected_device()
        for i, t in enumerate(tensors):
            _check_tensor(name, i, t, device)
        op = _op_name(a.get("op")) if reducing else None
        for t in tensors:
            why = check_dtype_op(t.dtype, op)
            if why:
                _violation(name, why)
        first = tensors[0] if tensors else None
        if name in ("all_to_all_single",) and (a.get("output_split_sizes") or a.get("input_split_sizes")):
            shape = None  # uneven splits: sizes legitimately differ per rank
        elif name in ("gather", "scatter"):
            shape = _shape(a.get("tensor"))
        else:
            shape = _shape(first)
        entry = (canon, ranks, str(first.dtype) if first is not None else None, shape, op)
    if kind == "p2p":
        return  # sends and receives pair up; they are not one sequence on every rank
    _S.log.append(entry)
    _S.sites.append(_call_site())


# ----------------------------------------------------------------------------- install
def install(device=None, enforce: bool = True) -> None:
    """Wrap torch.distributed's collectives in this process (idempotent).

    ``enforce=False``: record violations (``violations()``) without raising; the log is kept either way.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    if device is not None:
        expect_device(device)
    _S.enforce = enforce
    if _PATCHED:
        return
    replace = {}
    for name in _OPS:
        orig = getattr(c10d, name, None) or getattr(dist, name, None)
        if orig is None or not callable(orig):
            continue
        orig = getattr(orig, "__lioncub_nccl_contract__", orig)
        _ORIG[name] = orig
        wrapper = _make_wrapper(name, orig)
        replace[id(orig)] = (orig, wrapper)
        # the deprecated aliases may be distinct objects in dist and c10d
        for mod in (dist, c10d):
            other = getattr(mod, name, None)
            if other is not None and other is not orig:
                replace[id(other)] = (other, _make_wrapper(name, other))
    for mod in (dist, c10d):
        for name in _OPS:
            cur = getattr(mod, name, None)
            if cur is not None and id(cur) in replace:
                _PATCHED.append((mod, name, cur))
                setattr(mod, name, replace[id(cur)][1])
    # references captured at import time (``_all_gather_single = dist.all_gather_into_tensor``)
    for modname, mod in list(sys.modules.items()):
        if mod is None or mod is dist or mod is c10d:
            continue
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        for attr, value in items:
            if callable(value) and id(value) in replace and replace[id(value)][0] is value:
                _PATCHED.append((mod, attr, value))
                setattr(mod, attr, replace[id(value)][1])
        # DeepSpeed's TorchBackend caches all_gather / reduce_scatter functions on its instance
        if modname == "deepspeed.comm.comm":
            cdb = getattr(mod, "cdb", None)
            for attr in ("all_gather_function", "reduce_scatter_function"):
                value = getattr(cdb, attr, None) if cdb is not None else None
                if value is not None and id(value) in replace:
                    _PATCHED.append((cdb, attr, value))
                    setattr(cdb, attr, replace[id(value)][1])


def uninstall() -> None:
    for owner, name, value in reversed(_PATCHED):
        setattr(owner, name, value)
    _PATCHED.clear()
    _ORIG.clear()


# ----------------------------------------------------------------------------- comparison
def _involves(entry, a: int, b: int) -> bool:
    op, ranks, mode = entry[0], entry[1], entry[2]
    if op in ("new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group"):
        if mode == "world":
            return True
        return a in ranks and b in ranks
    return a in ranks and b in ranks


def _fmt(entry) -> str:
    if entry is None:
        return "(nothing: the log ends here)"
    op, ranks = entry[0], entry[1]
    if op in ("new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group"):
        return f"{op}(ranks={ranks}, sync={entry[2]}{', ' + repr(entry[3]) if len(entry) > 3 else ''})"
    _, _, dtype, shape, rop = entry
    return f"{op}(group={ranks}, dtype={dtype}, shape={shape}{', op=' + rop if rop else ''})"


def compare_logs(snapshots: list[dict]) -> str | None:
    """None if every pair of ranks issued the same collectives on the groups they share, in the
    same order; else a description of the first mismatch (rank pair, position, both calls, sites)."""
    n = len(snapshots)
    for a in range(n):
        for b in range(a + 1, n):
            la = [(e, s) for e, s in zip(snapshots[a]["log"], snapshots[a]["sites"]) if _involves(e, a, b)]
            lb = [(e, s) for e, s in zip(snapshots[b]["log"], snapshots[b]["sites"]) if _involves(e, a, b)]
            for i in range(max(len(la), len(lb))):
                ea, sa = la[i] if i < len(la) else (None, ())
                eb, sb = lb[i] if i < len(lb) else (None, ())
                if _norm(ea) != _norm(eb):
                    ctx = "\n".join(f"    {j}: {_fmt(la[j][0])}" for j in range(max(0, i - 3), i))
                    return (f"NCCL contract: ranks {a} and {b} issued different collectives on the groups they "
                            f"share (they would deadlock or corrupt data under NCCL).\n"
                            f"  call #{i} among the calls both take part in ({len(la)} on rank {a}, {len(lb)} on "
                            f"rank {b}):\n"
                            f"    rank {a}: {_fmt(ea)}\n    rank {b}: {_fmt(eb)}\n"
                            f"  the calls before it (same on both):\n{ctx or '    (none)'}\n"
                            f"  rank {a} called it from:\n{_indent(_fmt_site(sa))}\n  rank {b} called it from:\n{_indent(_fmt_site(sb))}")
    return None


def _norm(entry):
    if entry is None:
        return None
    return tuple(tuple(x) if isinstance(x, list) else x for x in entry)


def _indent(s: str) -> str:
    return "\n".join("      " + line for line in (s or "(none)").splitlines())
