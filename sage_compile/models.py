"""Built-in small models for the main job and tests (no downloads, no transformers/diffusers needed).

* :class:`TinyDiT`: a DiT-style transformer (QK-RMSNorm, 2-D RoPE-free, NHD attention through a permute,
  like diffusers' dispatcher) over image tokens.
* :class:`TinyLlama`: a Llama-style decoder (RMSNorm, RoPE, GQA through ``repeat_kv``, causal SDPA).
* :class:`HandwrittenAttention`: ``softmax(q @ kᵀ / √d) @ v`` written by hand.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class DiTBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.qn, self.kn = RMSNorm(self.hd), RMSNorm(self.hd)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, self.hd).unbind(2)  # (B, N, H, D)
        q, k = self.qn(q), self.kn(k)
        o = F.scaled_dot_product_attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3))
        x = x + self.proj(o.transpose(1, 2).reshape(b, n, -1))
        return x + self.mlp(self.norm2(x))


class TinyDiT(nn.Module):
    """DiT-style denoiser: (B, N, C) tokens -> (B, N, C)."""

    def __init__(self, channels=16, dim=256, heads=4, depth=2):
        super().__init__()
        self.inp, self.out = nn.Linear(channels, dim), nn.Linear(dim, channels)
        self.blocks = nn.ModuleList(DiTBlock(dim, heads) for _ in range(depth))

    def forward(self, x):
        h = self.inp(x)
        for blk in self.blocks:
            h = blk(h)
        return self.out(h)


def _rope(x, pos):
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(x.dtype), torch.cat((ang.sin(), ang.sin()), -1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), -1) * sin


def repeat_kv(x, n_rep):
    """transformers' repeat_kv: (B, Hkv, N, D) -> (B, Hkv·n_rep, N, D)."""
    b, h, n, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n_rep, n, d).reshape(b, h * n_rep, n, d)


class LlamaBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.h, self.hkv, self.hd = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, heads * self.hd, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.n1, self.n2 = RMSNorm(dim), RMSNorm(dim)
        self.up, self.gate, self.down = (nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False),
                                         nn.Linear(2 * dim, dim, bias=False))

    def forward(self, x):
        b, n, _ = x.shape
        y = self.n1(x)
        q = self.q(y).view(b, n, self.h, self.hd).transpose(1, 2)
        k, v = self.kv(y).view(b, n, 2, self.hkv, self.hd).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        pos = torch.arange(n, device=x.device)
        q, k = _rope(q, pos), _rope(k, pos)
        r = self.h // self.hkv
        o = F.scaled_dot_product_attention(q, repeat_kv(k, r), repeat_kv(v, r), is_causal=True)
        x = x + self.o(o.transpose(1, 2).reshape(b, n, -1))
        y = self.n2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class TinyLlama(nn.Module):
    """Llama-style decoder: token ids (B, N) -> logits (B, N, vocab)."""

    def __init__(self, vocab=512, dim=256, heads=4, kv_heads=2, depth=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(LlamaBlock(dim, heads, kv_heads) for _ in range(depth))
        self.norm, self.head = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h))


class HandwrittenAttention(nn.Module):
    """``softmax(q @ kᵀ / √d) @ v`` on (B, H, N, D) tensors, written by hand."""

    def forward(self, q, k, v):
        s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        return torch.matmul(s.softmax(dim=-1), v)
