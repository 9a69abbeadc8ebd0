"""TEST-ONLY: let megatron-core's DDP, optimizer wrappers and GPTModel run on CPU ranks.

Megatron hard-codes CUDA in a few places on the training path: ``torch.cuda.current_device()``
as a tensor device, ``device="cuda"`` factories, ``Tensor.cuda()``, the CUDA RNG state behind
its tensor-parallel RNG tracker, streams and events, and ``param.type() ==
'torch.cuda.FloatTensor'`` checks in the mixed-precision wrapper. :func:`install` redirects
exactly those to the CPU, in this process only. It is for tests and CPU demos only (the example
imports it only behind ``--cpu-shim``); real GPU training never needs it.

On a machine WITH CUDA it still runs the ranks on the CPU (gloo, CPU tensors): it also makes
``torch.cuda.is_available()`` answer False and ``device_count()`` 0 in the process, so every
code path megatron picks by "is there a GPU" takes the CPU branch, as on a CPU-only machine.

What it changes (all reversible with :func:`uninstall`):

* ``torch.cuda.current_device()`` returns ``torch.device("cpu")``; ``set_device``,
  ``synchronize``, ``empty_cache`` do nothing; ``Stream`` / ``Event`` / ``stream()`` /
  ``current_stream()`` / ``default_stream()`` are inert stand-ins.
* Tensor factories (``torch.tensor``, ``zeros``, ``empty``, ...) and ``Tensor.to`` map a CUDA
  device (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")`` or an integer index) to the CPU;
  ``Tensor.cuda()`` returns the tensor itself.
* The "CUDA" RNG is the CPU default generator (``torch.cuda.get_rng_state`` & co. and
  megatron's ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``).
* ``Tensor.type()`` (no argument) reports CPU float tensors under their ``torch.cuda.*`` names,
  so ``Float16OptimizerWithFloat16Params`` accepts CPU parameters.
* Not CUDA, but also in the way without TransformerEngine: megatron-core 0.16.1's MoE router
  reads the module global ``te_general_gemm``, which only exists when TransformerEngine is
  installed; the shim defines it as ``None`` (the router's own torch fallback).
"""
from __future__ import annotations

import contextlib
import functools
import logging

import torch

_SAVED: dict = {}
_CPU = torch.device("cpu")

_FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
              "randperm", "eye", "linspace", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
              "randn_like", "empty_strided", "scalar_tensor")


def _is_cuda(dev) -> bool:
    if isinstance(dev, bool):
        return False
    if isinstance(dev, int):
        return True  # a bare index means a CUDA device to torch
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return False


def _fix_kwargs(kwargs):
    if "device" in kwargs and _is_cuda(kwargs["device"]):
        kwargs["device"] = _CPU
    return kwargs


def _wrap_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **_fix_kwargs(kwargs))
    wrapper.__lioncub_shim__ = True
    return wrapper


class _Stream:
    """Inert stand-in for torch.cuda.Stream (CPU work is synchronous)."""

    def __init__(self, *args, **kwargs):
        self.device = _CPU

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_DEFAULT_STREAM = _Stream()


def _tensor_to(orig):
    @functools.wraps(orig)
    def to(self, *args, **kwargs):
        if args and _is_cuda(args[0]) and not isinstance(args[0], torch.Tensor):
            args = (_CPU,) + tuple(args[1:])
        return orig(self, *args, **_fix_kwargs(kwargs))
    return to


def _tensor_type(orig):
    names = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
             "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}

    @functools.wraps(orig)
    def type_(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if not args and not kwargs and isinstance(out, str):
            return names.get(out, out)
        return out
    return type_


class _QuietRngWarning(logging.Filter):
    # With one shared generator, megatron's "CPU RNG state changed within GPU RNG context"
    # warning is expected and meaningless.
    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _set(obj, name, value):
    key = (id(obj), name)
    if key not in _SAVED:
        _SAVED[key] = (obj, name, getattr(obj, name, None), hasattr(obj, name))
    setattr(obj, name, value)


def installed() -> bool:
    return bool(_SAVED)


def install() -> None:
    """Redirect megatron's CUDA calls to the CPU (idempotent). Call before building models."""
    if _SAVED:
        return
    cuda = torch.cuda
    # Even where CUDA exists: the ranks run on the CPU, so megatron must take its CPU branches.
    _set(cuda, "is_available", lambda: False)
    _set(cuda, "device_count", lambda: 0)
    _set(cuda, "current_device", lambda: _CPU)
    _set(cuda, "set_device", lambda *a, **k: None)
    _set(cuda, "synchronize", lambda *a, **k: None)
    _set(cuda, "empty_cache", lambda *a, **k: None)
    _set(cuda, "Stream", _Stream)
    _set(cuda, "Event", _Event)
    _set(cuda, "stream", lambda s=None: contextlib.nullcontext())
    _set(cuda, "current_stream", lambda *a, **k: _DEFAULT_STREAM)
    _set(cuda, "default_stream", lambda *a, **k: _DEFAULT_STREAM)
    _set(cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    _set(cuda, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    _set(cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)))
    _set(cuda.random, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    _set(cuda.random, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    for name in _FACTORIES:
        if hasattr(torch, name):
            _set(torch, name, _wrap_factory(getattr(torch, name)))
    _set(torch.Tensor, "cuda", lambda self, *a, **k: self)
    _set(torch.Tensor, "to", _tensor_to(torch.Tensor.to))
    _set(torch.Tensor, "type", _tensor_type(torch.Tensor.type))
    # megatron's tensor-parallel RNG tracker talks to the CUDA generator directly
    from megatron.core.tensor_parallel import random as mrandom
    _set(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    _set(mrandom, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_QuietRngWarning())
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:
        moe_utils = None
    if moe_utils is not None and not hasattr(moe_utils, "te_general_gemm"):
        _set(moe_utils, "te_general_gemm", None)


def uninstall() -> None:
    for obj, name, value, existed in reversed(list(_SAVED.values())):
        if existed:
            setattr(obj, name, value)
        else:
            delattr(obj, name)
    _SAVED.clear()
