"""The N workers' gradients of a step: one pass per worker (bit-identical to real ranks) or one
vectorized pass (``vmap``, optionally compiled)."""
from __future__ import annotations

import torch


GRADS = ("loop", "vmap", "vmap_compiled")


_TEMPLATES = {}  # (model shape, compiled?) -> the vectorized gradient function (built once per process)


class WorkerGrads:
    """Each worker's own gradient of its own mean loss on the shared parameters, {param: [N, *shape]}.

    ``cfg["grads"]`` picks how:

    * ``loop``: one forward/backward per worker on the model itself: exactly what rank i of a real
      run computes (the bit-exact path; tests/test_converge.py compares it with real ranks).
    * ``vmap``: one vectorized pass for all N workers: ``torch.func.grad`` of the loss, ``vmap``-ed over
      the workers' batches with the parameters shared, so the forward and input-gradient matmuls
      become one GEMM over every worker's tokens and the weight gradients one batched GEMM. It runs a
      template of the same model with the attention written out (``GPTConfig.attn="math"``: vmap
      batches it natively; ``sdpa`` would fall back to a per-worker loop). Another summation order
      than ``loop``'s, so not bit-identical: tests/test_converge.py checks that the votes agree on
      >= 99.9% of coordinates and that the losses agree within float noise.
    * ``vmap_compiled``: the same function through ``torch.compile`` (compiled once per process and
      model shape: the template, not the run's model, is what the compiled graph holds).
    """

    def __init__(self, model, cfg):
        self.model, self.mode = model, cfg.get("grads", "loop")
        if self.mode not in GRADS:
            raise ValueError(f"converge setting grads={self.mode!r} is not allowed; allowed: {', '.join(GRADS)}")
        self.named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if self.mode != "loop":
            self.fn = self._vectorized(model.cfg, self.mode == "vmap_compiled")
            self.shared = {name: p.detach() for name, p in model.named_parameters()}  # live views of the run's params

    @staticmethod
    def _vectorized(model_cfg, compiled):
        from dataclasses import replace

        from torch.func import functional_call, grad, vmap

        from ..models.gpt import GPT

        key = (tuple(sorted(replace(model_cfg, attn="math").to_dict().items())), compiled)
        if key not in _TEMPLATES:
            template = GPT(replace(model_cfg, attn="math"))  # its own values are never used: functional_call

            def loss(params, x, y):
                return functional_call(template, params, (x, y))[1]

            fn = vmap(grad(loss), in_dims=(None, 0, 0))
            _TEMPLATES[key] = torch.compile(fn, dynamic=False) if compiled else fn
        return _TEMPLATES[key]

    def __call__(self, batches):
        """``batches``: the N workers' (x, y), in worker order."""
        n = len(batches)
        if self.mode != "loop":
            g = self.fn(self.shared, torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches]))
            return {p: g[name] for name, p in self.named}
        grads = {p: torch.empty((n,) + tuple(p.shape), dtype=p.dtype, device=p.device) for _, p in self.named}
        for i, (x, y) in enumerate(batches):  # each worker's own gradient, exactly as on rank i
            for _, p in self.named:
                p.grad = None
            self.model(x, y)[1].backward()
            for _, p in self.named:
                grads[p][i].copy_(p.grad)
        for _, p in self.named:
            p.grad = None
        return grads
