"""A small GPT-style decoder for byte-level language modelling.

Token + learned position embeddings, pre-LayerNorm blocks (causal self-attention via
``torch.nn.functional.scaled_dot_product_attention``, GELU MLP), a final LayerNorm and
a tied (default) or untied output head. Parameter names are stable and meaningful::

    tok_emb.weight  pos_emb.weight
    blocks.{i}.ln1.weight/bias  blocks.{i}.attn.qkv.weight/bias  blocks.{i}.attn.proj.weight/bias
    blocks.{i}.ln2.weight/bias  blocks.{i}.mlp.fc.weight/bias    blocks.{i}.mlp.proj.weight/bias
    ln_f.weight/bias  [head.weight when untied]
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "PRESETS", "get_config", "build_model"]


@dataclass
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    seq_len: int = 128
    vocab: int = 256
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    # "sdpa": torch's fused scaled_dot_product_attention; "math": the same causal attention written out
    # (softmax(q k^T / sqrt(d)) v), which torch.func.vmap batches natively (sdpa has no batching rule on
    # CPU and falls back to a loop): the convergence simulation's vectorized gradients use it.
    attn: str = "sdpa"

    def __post_init__(self):
        for key in ("n_layer", "n_head", "d_model", "seq_len", "vocab", "mlp_ratio"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"GPTConfig.{key}={getattr(self, key)} must be >= 1")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if self.attn not in ("sdpa", "math"):
            raise ValueError(f"GPTConfig.attn={self.attn!r} is not allowed; allowed: sdpa, math")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout} must be in [0, 1)")

    def to_dict(self) -> dict:
        return asdict(self)


# Sizes (tied head, vocab 256): tiny 220,544 (0.22M), demo 1,298,880 (1.30M), bench20m 25,482,240 (25.5M).
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=4, n_head=2, d_model=64, seq_len=64),
    "demo": GPTConfig(n_layer=4, n_head=4, d_model=160, seq_len=128),
    "bench20m": GPTConfig(n_layer=8, n_head=8, d_model=512, seq_len=256),
}


def get_config(preset: str = "demo", **overrides) -> GPTConfig:
    """A copy of preset ``preset`` with ``overrides`` (None values are ignored)."""
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is not allowed; allowed: {', '.join(PRESETS)}")
    return replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.math = cfg.attn == "math"
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.math:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = F.dropout(att.masked_fill(~causal, float("-inf")).softmax(-1), self.dropout, self.training)
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.head = None if cfg.tie_weights else nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.reset_parameters()

    def reset_parameters(self):
        """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2·n_layer), zero biases."""
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln" in name or name.startswith("ln_f"):
                nn.init.ones_(p)
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, resid_std)
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def param_count(self, trainable_only: bool = True) -> int:
        """Number of distinct parameters (a tied head is counted once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def forward(self, idx, targets=None):
        """``idx``: (B, T) int64. Returns ``(logits, loss)``; ``loss`` is None without targets."""
        b, t = idx.shape
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds GPTConfig.seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos)[None])
        for blk in self.blocks:
            x = blk(x)
        x = self.ln_f(x)
        logits = F.linear(x, self.tok_emb.weight) if self.head is None else self.head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def optim_groups(self, weight_decay: float) -> list[dict]:
        """Two param groups: matrices of Linear layers decay; biases, norms and embeddings do not.

        Each group carries ``names`` (parallel to ``params``); every parameter appears exactly once."""
        decay, no_decay = ([], []), ([], [])
        for name, p in self.named_parameters():  # tied weights appear once (under tok_emb)
            if not p.requires_grad:
                continue
            is_matrix = p.dim() >= 2 and not name.startswith(("tok_emb", "pos_emb"))
            target = decay if is_matrix else no_decay
            target[0].append(name)
            target[1].append(p)
        groups = [{"params": decay[1], "names": decay[0], "weight_decay": float(weight_decay)},
                  {"params": no_decay[1], "names": no_decay[0], "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None):
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.cfg.seq_len:])
            logits = logits[:, -1, :] / max(temperature, 1e-6)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        return idx


def build_model(preset: str = "demo", seed: int | None = 0, **overrides) -> GPT:
    """Build preset ``preset`` (with config overrides); ``seed`` makes the init identical on every rank."""
    cfg = get_config(preset, **overrides)
    if seed is None:
        return GPT(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg)


def param_digest(model) -> str:
    """SHA-1 over parameter names and values: equal digests = bit-identical replicas."""
    import hashlib

    h = hashlib.sha1()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
