"""An independent GPT, written for the tests from the published architecture descriptions alone.

Nothing here imports megatron_hydra: attention is the textbook softmax(q kᵀ / √d + causal mask) v
written out with explicit loops over query groups, rotary embeddings use the complex-number form
of RoFormer (Su et al. 2021) rather than a rotate-half, norms and the loss are computed from their
formulas. It uses the same parameter *names* and *logical shapes* as megatron-hydra's checkpoints
(``layers.3.attention.qkv.weight``, ...), so the same weights load into both, and the layout tests
(every tp/pp/dp run equals the tp1 run) rest on a model the package did not produce.

Layout conventions it must agree on (they are the checkpoint format, not an implementation):
- the fused QKV weight is grouped per query group as [q heads of the group, k, v], each d rows;
- the vocabulary tables have ``padded_vocab`` rows, of which only the first ``vocab`` are real;
- a gated MLP computes act(gate(x)) * fc1(x).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class RefConfig:
    vocab: int
    padded_vocab: int
    hidden: int
    layers: int
    heads: int
    groups: int
    ffn: int
    max_positions: int
    rope: bool = False  # else learned absolute positions
    rope_theta: float = 10000.0
    rmsnorm: bool = False  # else LayerNorm with bias
    eps: float = 1e-5
    swiglu: bool = False  # else GELU (erf form)
    bias: bool = True
    tied: bool = True


class RefNorm(nn.Module):
    def __init__(self, c: RefConfig):
        super().__init__()
        self.c = c
        self.weight = nn.Parameter(torch.ones(c.hidden))
        if not c.rmsnorm:
            self.bias = nn.Parameter(torch.zeros(c.hidden))

    def forward(self, x):
        if self.c.rmsnorm:
            return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.c.eps) * self.weight
        centred = x - x.mean(-1, keepdim=True)
        var = (centred * centred).mean(-1, keepdim=True)
        return centred / torch.sqrt(var + self.c.eps) * self.weight + self.bias


class RefLinear(nn.Module):
    """y = x Wᵀ + b with W stored [out, in], as nn.Linear and Megatron store it."""

    def __init__(self, n_in: int, n_out: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_out, n_in))
        self.bias = nn.Parameter(torch.zeros(n_out)) if bias else None

    def forward(self, x):
        y = x @ self.weight.t()
        return y if self.bias is None else y + self.bias


def rope_rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoFormer's rotation, pairing dimension i with i + d/2 (the Hugging Face Llama layout):
    z_i = x_i + j x_{i+d/2} is multiplied by exp(j · pos · theta^(-2i/d))."""
    s, d = x.shape[-2], x.shape[-1]
    half = d // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * freqs[None, :]
    rot = torch.polar(torch.ones_like(angle), angle).to(torch.complex128)
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * rot
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


class RefAttention(nn.Module):
    def __init__(self, c: RefConfig):
        super().__init__()
        self.c = c
        d = c.hidden // c.heads
        self.qkv = RefLinear(c.hidden, (c.heads + 2 * c.groups) * d, c.bias)
        self.proj = RefLinear(c.heads * d, c.hidden, c.bias)

    def forward(self, x):
        c = self.c
        b, s, _ = x.shape
        d, per_group = c.hidden // c.heads, c.heads // c.groups
        qkv = self.qkv(x).view(b, s, c.groups, per_group + 2, d)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        outs = []
        for g in range(c.groups):
            k, v = qkv[:, :, g, per_group], qkv[:, :, g, per_group + 1]  # [b, s, d]
            if c.rope:
                k = rope_rotate(k, c.rope_theta)
            for h in range(per_group):
                q = qkv[:, :, g, h]
                if c.rope:
                    q = rope_rotate(q, c.rope_theta)
                scores = (q @ k.transpose(1, 2)) / math.sqrt(d)
                scores = scores.masked_fill(~causal, float("-inf"))
                outs.append(torch.softmax(scores, dim=-1) @ v)  # head g * per_group + h
        return self.proj(torch.cat(outs, dim=-1))


class RefMLP(nn.Module):
    def __init__(self, c: RefConfig):
        super().__init__()
        self.c = c
        self.fc1 = RefLinear(c.hidden, c.ffn, c.bias)
        if c.swiglu:
            self.gate = RefLinear(c.hidden, c.ffn, c.bias)
        self.fc2 = RefLinear(c.ffn, c.hidden, c.bias)

    def forward(self, x):
        if self.c.swiglu:
            g = self.gate(x)
            h = g * torch.sigmoid(g) * self.fc1(x)
        else:
            u = self.fc1(x)
            h = 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))
        return self.fc2(h)


class RefBlock(nn.Module):
    def __init__(self, c: RefConfig):
        super().__init__()
        self.norm1, self.attention = RefNorm(c), RefAttention(c)
        self.norm2, self.mlp = RefNorm(c), RefMLP(c)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ReferenceGPT(nn.Module):
    def __init__(self, c: RefConfig):
        super().__init__()
        self.c = c
        self.embedding = nn.Module()
        self.embedding.weight = nn.Parameter(torch.zeros(c.padded_vocab, c.hidden))
        if not c.rope:
            self.position_embedding = nn.Module()
            self.position_embedding.weight = nn.Parameter(torch.zeros(c.max_positions, c.hidden))
        self.layers = nn.ModuleDict({str(i): RefBlock(c) for i in range(c.layers)})
        self.final_norm = RefNorm(c)
        if not c.tied:
            self.output_weight = nn.Parameter(torch.zeros(c.padded_vocab, c.hidden))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy over every position, on the real vocabulary only."""
        x = self.embedding.weight[tokens]
        if not self.c.rope:
            x = x + self.position_embedding.weight[: tokens.shape[1]]
        for block in self.layers.values():
            x = block(x)
        head = self.embedding.weight if self.c.tied else self.output_weight
        logits = self.final_norm(x) @ head[: self.c.vocab].t()
        top = logits.max(-1, keepdim=True).values.detach()
        log_z = ((logits - top).exp().sum(-1)).log() + top[..., 0]
        picked = logits.gather(-1, labels[..., None])[..., 0]
        return (log_z - picked).mean()
