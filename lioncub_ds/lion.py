"""Reference Lion (docs/conventions.md): a functional core with fused, single-tensor and foreach paths.

    c = β1·m + (1−β1)·g ;  θ ← θ·(1 − η·λ) − η·sign(c) ;  m ← β2·m + (1−β2)·g

sign(0) = 0 (no move). fp32 math with one rounding per operation and no fused multiply-add, the
arithmetic of :func:`lioncub_ds.kernels.reference.lion_step`, so LionCub on one rank reproduces this
optimizer bit for bit. By default CPU and CUDA tensors take the fused kernel of their device's
backend (one pass over g, m, θ); the foreach and single-tensor paths are the pure-torch fallback.
"""
from __future__ import annotations

import torch
from torch.optim import Optimizer

from . import kernels
from .config import LionCubConfigError, validate_common
from .kernels import reference

__all__ = ["Lion", "lion"]


def call_closure(closure):
    """torch.optim's closure: the loss re-evaluated with gradients on (step() runs under no_grad),
    or None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def count_steps(states) -> None:
    """Adds 1 to the "step" counter of each parameter state. The counters are 0-dim float32 CPU
    tensors (as torch.optim keeps them): one foreach op for all of them, since one op per
    parameter costs a small model's step more host time than the fused update itself."""
    steps = [s["step"] for s in states]
    if steps and all(t.__class__ is torch.Tensor and t.dtype is torch.float32 and t.is_cpu for t in steps):
        torch._foreach_add_(steps, _ONE, alpha=1.0)  # a loop in C++; the tensor 1 is not wrapped per counter
        return
    for s in states:  # anything else (another dtype or device, a plain int) as before
        s["step"] += 1


_ONE = torch.ones((), dtype=torch.float32)


def lr_value(lr, owner="Lion"):
    """``lr`` as a float. torch optimizers accept a 1-element tensor lr (schedulers and
    ``torch.compile`` users pass one): it is read with ``float()`` when used (one host read per
    step and group on an accelerator). Anything else is returned as is, for validate_common."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{owner}: Tensor lr must be 1-element (got shape {tuple(lr.shape)})")
        if lr.is_complex() or not lr.is_floating_point():
            raise LionCubConfigError(f"{owner}: invalid lr={lr!r}; allowed: a finite number > 0 or a 1-element "
                                     "floating-point tensor")
        return float(lr)
    return lr


SET_ERROR = ("optimizer parameters need to be organized in ordered collections, but the ordering of tensors in "
             "sets will change between runs. Please use a list instead.")


def check_param_group(param_group, owner, defaults=None, index=0):
    """What torch's add_param_group does not refuse but Lion cannot optimize correctly, raised
    before the group is added: complex parameters (a real cast would drop the imaginary part), the
    group's own lr / betas / weight_decay out of range (checked as the constructor checks its
    defaults). A one-shot iterable of parameters (a generator: ``model.head.parameters()``) is
    read once here and stored back as a list, so torch adds the parameters, not an exhausted
    generator. Returns the parameters."""
    if not isinstance(param_group, dict):
        return []
    params = param_group.get("params", [])
    if isinstance(params, set):
        raise TypeError(f"{owner}: {SET_ERROR}")
    if not isinstance(params, torch.Tensor):
        params = param_group["params"] = list(params)
    else:
        params = [params]
    if defaults is not None:
        own = {k: param_group[k] for k in ("lr", "betas", "weight_decay") if k in param_group}
        if own:
            merged = {k: own.get(k, defaults[k]) for k in ("lr", "betas", "weight_decay")}
            validate_common(lr=lr_value(merged["lr"], owner), betas=merged["betas"],
                            weight_decay=merged["weight_decay"], owner=f"{owner} (param group #{index})",
                            lr_zero_ok=True)
    for i, p in enumerate(params):
        if isinstance(p, tuple) and len(p) == 2:
            p = p[1]
        if isinstance(p, torch.Tensor) and p.is_complex():
            raise LionCubConfigError(f"{owner}: parameter #{i} of the group is complex ({p.dtype}); allowed: real "
                                     "floating-point parameters (optimize torch.view_as_real(p) of a real leaf "
                                     "instead)")
    return params


def saved_momenta(opt, state_dict, owner="Lion"):
    """{parameter: saved exp_avg} of a state dict about to be loaded into ``opt`` (torch's id
    mapping: saved ids in param-group order onto this optimizer's parameters). A momentum whose
    shape is not its parameter's is refused here, before anything is loaded (the kernels read
    elements in order: a (3, 4) momentum on a (4, 3) parameter would step silently wrong)."""
    saved_ids = [i for g in state_dict.get("param_groups", []) for i in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    id_map = {sid: (k, p) for k, (sid, p) in enumerate(zip(saved_ids, params))}
    out = {}
    for idx, st in state_dict.get("state", {}).items():
        if isinstance(st, dict) and "exp_avg" in st and idx in id_map:
            (k, p), m = id_map[idx], st["exp_avg"]
            if isinstance(m, torch.Tensor) and tuple(m.shape) != tuple(p.shape):
                raise LionCubConfigError(
                    f"{owner}.load_state_dict: the saved momentum of parameter #{k} has shape "
                    f"{tuple(m.shape)}, the parameter {tuple(p.shape)}; allowed: a state dict saved for these "
                    "parameters, in this order; no state was changed")
            out[p] = m
    return out


def nonfinite_count(t) -> int:
    """How many NaN/Inf values a saved state tensor holds (0 for anything that is not a float tensor)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return 0
    return int((~torch.isfinite(t)).sum())


def restore_momenta(opt, saved, momentum_dtype):
    """torch's load_state_dict casts floating state to each parameter's dtype (bf16 parameters would
    get a bf16 momentum, fp32 parameters an fp32 one): put back the saved momenta, cast to the
    optimizer's ``momentum_dtype`` only."""
    for p, m in saved.items():
        opt.state[p]["exp_avg"] = m.to(device=p.device, dtype=momentum_dtype).clone()


def checked_groups(param_groups, sparse_error):
    """[(group, its parameters with a gradient, its lr as a float)] of every group, checked before
    any group is stepped, so that a bad lr or a sparse gradient in a later group leaves the earlier
    ones untouched: ``sparse_error(p)`` is the exception raised for a sparse gradient."""
    out = []
    for g in param_groups:
        lr = lr_value(g["lr"])
        params = [p for p in g["params"] if p.grad is not None]
        for p in params:
            if p.grad.is_sparse:
                raise sparse_error(p)
        out.append((g, params, lr))
    return out


def _single_tensor_lion(params, grads, momenta, *, lr, beta1, beta2, weight_decay):
    reference.lion_step(params, grads, momenta, lr, weight_decay, beta1, beta2)


def _foreach_lion(params, grads, momenta, *, lr, beta1, beta2, weight_decay):
    decay = 1.0 - lr * weight_decay
    g32 = [g.float() for g in grads]
    m32 = [m.float() for m in momenta]
    c = torch._foreach_mul(m32, beta1)
    torch._foreach_add_(c, torch._foreach_mul(g32, 1.0 - beta1))
    if decay != 1.0:
        # torch._foreach_mul_ rounds a fp16/bf16 product differently from Tensor.mul_ (the
        # single-tensor path's op); only fp32/fp64 tensors take the foreach multiply.
        wide = [p for p in params if p.dtype in (torch.float32, torch.float64)]
        if wide:
            torch._foreach_mul_(wide, decay)
        for p in params:
            if p.dtype not in (torch.float32, torch.float64):
                p.mul_(decay)
    torch._foreach_add_(params, torch._foreach_sign(c), alpha=-lr)
    # m32 may alias the fp32 momenta themselves: multiply in place, then add.
    new_m = torch._foreach_mul(m32, beta2)
    torch._foreach_add_(new_m, torch._foreach_mul(g32, 1.0 - beta2))
    torch._foreach_copy_(momenta, new_m)


_FUSED_DEVICES = ("cpu", "cuda")


def _fused_lion(params, grads, momenta, lr, beta1, beta2, weight_decay):
    """Run the tensors whose device has native kernels through ``backend.lion_step`` (one call per
    device); returns the (params, grads, momenta) left for the pure-torch paths."""
    by_device: dict = {}
    for i, p in enumerate(params):
        by_device.setdefault(p.device, []).append(i)
    rest = []
    want = kernels.requested()
    for device, idx in by_device.items():
        native = "cuda" if device.type == "cuda" else "cpp"
        usable = device.type in _FUSED_DEVICES and want in ("auto", native)  # (LIONCUB_KERNELS=cuda: CPU stays torch)
        be = kernels.backend_for(device.type) if usable else None
        if be is None or be.name == "torch":  # no native kernels here: foreach is the faster pure-torch path
            rest += idx
            continue
        be.lion_step([params[i] for i in idx], [grads[i] for i in idx], [momenta[i] for i in idx], lr, weight_decay,
                     beta1, beta2)
    rest.sort()
    return [params[i] for i in rest], [grads[i] for i in rest], [momenta[i] for i in rest]


def lion(params, grads, momenta, *, lr, beta1, beta2, weight_decay, foreach=None):
    """Functional Lion over lists of tensors (momenta updated in place).

    ``foreach=None`` (auto): CPU and CUDA tensors take the fused kernel of their device's backend
    (``kernels.backend_for``; LIONCUB_KERNELS=torch, or kernels that cannot be built, leave them to
    the foreach path), other devices the foreach path. ``True`` / ``False``: the pure-torch
    foreach / single-tensor path. All of them give the same bits.
    """
    if foreach is None:
        if params:
            params, grads, momenta = _fused_lion(params, grads, momenta, lr, beta1, beta2, weight_decay)
        foreach = len(params) > 1 and all(p.device.type != "meta" for p in params)
    fn = _foreach_lion if foreach else _single_tensor_lion
    if params:
        fn(params, grads, momenta, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)


class Lion(Optimizer):
    """Lion (Chen et al., 2023) as a torch optimizer.

    Args:
        params: iterable of tensors or param groups (real floating-point tensors; complex ones are refused).
        lr: learning rate η > 0 (default 1e-4; 3-10x smaller than AdamW's); a float or a 1-element tensor.
        betas: (β1, β2), each in [0, 1) (default (0.9, 0.99)).
        weight_decay: decoupled λ >= 0 (default 0).
        momentum_dtype: dtype of the momentum buffer (torch.float32 or torch.bfloat16).
        foreach: None (auto: the fused kernels on CPU/CUDA), True (torch foreach) or False (single tensor).
    """

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *,
                 momentum_dtype=torch.float32, foreach=None):
        validate_common(lr=lr_value(lr), betas=betas, weight_decay=weight_decay, momentum_dtype=momentum_dtype,
                        foreach=foreach, owner="Lion")
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, foreach=foreach)
        self.momentum_dtype = momentum_dtype
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        check_param_group(param_group, "Lion", self.defaults, len(getattr(self, "param_groups", [])))
        super().add_param_group(param_group)

    # torch's Optimizer.__getstate__ keeps only defaults, state and param_groups: copy.deepcopy and
    # pickle would lose momentum_dtype.
    def __getstate__(self):
        return {**super().__getstate__(), "momentum_dtype": self.momentum_dtype}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("momentum_dtype", torch.float32)

    def load_state_dict(self, state_dict):
        saved = saved_momenta(self, state_dict, "Lion")
        super().load_state_dict(state_dict)
        restore_momenta(self, saved, self.momentum_dtype)

    def _momenta(self, params):
        out = []
        for p in params:
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, dtype=self.momentum_dtype, memory_format=torch.preserve_format)
            out.append(state["exp_avg"])
        return out

    @torch.no_grad()
    def step(self, closure=None):
        loss = call_closure(closure)
        work = checked_groups(self.param_groups, lambda p: RuntimeError("Lion does not support sparse gradients"))
        for group, params, lr in work:
            beta1, beta2 = group["betas"]
            # a group loaded from another optimizer's state dict (LionCub's) has no foreach key
            lion(params, [p.grad for p in params], self._momenta(params), lr=lr, beta1=beta1, beta2=beta2,
                 weight_decay=group["weight_decay"], foreach=group.get("foreach", self.defaults["foreach"]))
            count_steps([self.state[p] for p in params])
        return loss
