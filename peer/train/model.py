"""A small Llama-style causal decoder in plain torch: RMSNorm, RoPE, SwiGLU, untied embeddings, no biases.

``build_model(config, seed)`` is the only way the client makes a model: every peer of a run calls it with the
run's ``init_seed`` and gets bit-identical parameters, without touching torch's global RNG.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from hivetrain.peer.config import ModelConfig

INIT_STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:  # (..., C) -> (..., C)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin tables, each (max_seq_len, head_dim // 2)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))  # (hd/2,)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # (T_max, hd/2)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotates pairs (x[2i], x[2i+1]) of x (B, nh, T, hd) by position; cos, sin are (T, hd/2)."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # each (B, nh, T, hd/2)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, nh, T, hd/2, 2)
    return out.flatten(-2).type_as(x)  # (B, nh, T, hd)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.d_model // config.n_heads
        self.wqkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.wo = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.wqkv(x).split(C, dim=2)  # each (B, T, C)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        v = v.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        return self.wo(y.transpose(1, 2).contiguous().view(B, T, C))  # (B, T, C)


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(config.d_model, config.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(config.ffn_hidden, config.d_model, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:  # (B, T, C) -> (B, T, C)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # hidden (B, T, ffn_hidden)


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # (B, T, C) -> (B, T, C)
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        cos, sin = rope_tables(config.d_model // config.n_heads, config.max_seq_len, config.rope_theta)
        # Derived from the config, so not part of the state dict that peers average and checkpoint.
        self.rope_cos: Tensor
        self.rope_sin: Tensor
        self.register_buffer("rope_cos", cos, persistent=False)  # (T_max, hd/2)
        self.register_buffer("rope_sin", sin, persistent=False)  # (T_max, hd/2)
        self.checkpointing = False  # recompute each block in the backward pass instead of keeping its activations

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """idx (B, T) int64 -> logits (B, T, vocab) and, with targets (B, T), the mean cross entropy."""
        B, T = idx.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, hd/2)
        x = self.tok_emb(idx)  # (B, T, C)
        for block in self.blocks:
            if self.checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, use_reentrant=False)  # (B, T, C)
            else:
                x = block(x, cos, sin)  # (B, T, C)
        logits = self.lm_head(self.norm(x))  # (B, T, vocab)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))
        return logits, loss


@torch.no_grad()
def init_weights(model: Llama, seed: int) -> None:
    """Normal(0, 0.02) weights, residual projections scaled by 1/sqrt(2 * n_layers), norms at 1."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    resid_std = INIT_STD / math.sqrt(2 * model.config.n_layers)
    for name, p in model.named_parameters():  # fixed registration order -> same draws everywhere
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        std = resid_std if name.endswith(("wo.weight", "w2.weight")) else INIT_STD
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)


def build_model(config: ModelConfig, seed: int) -> Llama:
    """A freshly initialised model on the CPU in float32; the same (config, seed) gives bit-identical weights."""
    with torch.random.fork_rng(devices=[]):  # nn.Linear's default init draws from the global RNG
        model = Llama(config)
    init_weights(model, seed)
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
