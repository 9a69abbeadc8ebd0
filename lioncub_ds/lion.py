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
from .config import validate_common
from .kernels import reference

__all__ = ["Lion", "lion"]


def _single_tensor_lion(params, grads, momenta, *, lr, beta1, beta2, weight_decay):
    reference.lion_step(params, grads, momenta, lr, weight_decay, beta1, beta2)


def _foreach_lion(params, grads, momenta, *, lr, beta1, beta2, weight_decay):
    decay = 1.0 - lr * weight_decay
    g32 = [g.float() for g in grads]
    m32 = [m.float() for m in momenta]
    c = torch._foreach_mul(m32, beta1)
    torch._foreach_add_(c, torch._foreach_mul(g32, 1.0 - beta1))
    if decay != 1.0:
        torch._foreach_mul_(params, decay)
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
        params: iterable of tensors or param groups.
        lr: learning rate η > 0 (default 1e-4; 3-10x smaller than AdamW's).
        betas: (β1, β2), each in [0, 1) (default (0.9, 0.99)).
        weight_decay: decoupled λ >= 0 (default 0).
        momentum_dtype: dtype of the momentum buffer (torch.float32 or torch.bfloat16).
        foreach: None (auto: the fused kernels on CPU/CUDA), True (torch foreach) or False (single tensor).
    """

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *,
                 momentum_dtype=torch.float32, foreach=None):
        validate_common(lr=lr, betas=betas, weight_decay=weight_decay, momentum_dtype=momentum_dtype,
                        foreach=foreach, owner="Lion")
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, foreach=foreach)
        super().__init__(params, defaults)
        self.momentum_dtype = momentum_dtype

    def _init_group(self, group, params, grads, momenta):
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Lion does not support sparse gradients")
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, dtype=self.momentum_dtype, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            momenta.append(state["exp_avg"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, momenta = [], [], []
            self._init_group(group, params, grads, momenta)
            beta1, beta2 = group["betas"]
            lion(params, grads, momenta, lr=group["lr"], beta1=beta1, beta2=beta2,
                 weight_decay=group["weight_decay"], foreach=group["foreach"])
            for p in params:
                self.state[p]["step"] += 1
        return loss
