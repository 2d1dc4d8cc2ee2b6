"""Tiled online-softmax engine shared by the quantized references.

Every quantized kernel visits keys in tiles and keeps a running row max; FP8/FP4 rounding of the
probabilities happens relative to that running max. To let kernels match the reference to
accumulation-order noise (conventions.md rule 2), the reference walks the same tiles (keys in tiles of
``block_n`` aligned at key 0) with the same running-max recurrence, in fp32. Queries are processed in
chunks so memory stays O(chunk · block_n), never O(N²): a 17K-token video model fits.

The scheme supplies two callbacks per (query chunk, key tile):
``logits(i0, i1, j0, j1) -> z`` (fp32, log2 domain, ``(B, Hq, i1-i0, j1-j0)``), and
``pv(p, m_offset_rows, j0, j1) -> (contrib, rowsum)`` which turns the unnormalised probabilities into
the tile's PV contribution (quantizing them as the scheme says) and returns the row sums to add to l.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

LOG2E = 1.4426950408889634


def visible_mask(i0: int, i1: int, j0: int, j1: int, lq: int, lk: int, causal: str, device) -> Optional[torch.Tensor]:
    """Bool (i1-i0, j1-j0) mask of the causal rule (True = visible), or None when everything is visible.

    ``top_left``: key j visible to query i iff j <= i (SDPA's ``is_causal``).
    ``bottom_right``: j <= i + (lk - lq) (FlashAttention's ``causal``).
    """
    if causal == "none":
        return None
    off = 0 if causal == "top_left" else lk - lq
    qi = torch.arange(i0, i1, device=device)[:, None]
    kj = torch.arange(j0, j1, device=device)[None, :]
    return kj <= qi + off


def causal_last_key(i1: int, lq: int, lk: int, causal: str) -> int:
    """Exclusive upper bound of keys any query < i1 can see."""
    if causal == "none":
        return lk
    off = 0 if causal == "top_left" else lk - lq
    return max(0, min(lk, i1 + off))


def apply_masks(z: torch.Tensor, mask_tile: Optional[torch.Tensor], causal_tile: Optional[torch.Tensor]) -> torch.Tensor:
    """Apply a bool (True = keep) or additive (natural-log units) mask tile and the causal rule to log2 logits."""
    if mask_tile is not None:
        if mask_tile.dtype == torch.bool:
            z = z.masked_fill(~mask_tile, float("-inf"))
        else:
            z = z + mask_tile.float() * LOG2E
    if causal_tile is not None:
        z = z.masked_fill(~causal_tile, float("-inf"))
    return z


def run(
    shape: tuple[int, int, int, int],
    lk: int,
    logits: Callable[[int, int, int, int], torch.Tensor],
    pv: Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]],
    mask: Optional[torch.Tensor],
    causal: str,
    block_n: int,
    p_offset: float,
    device,
    chunk_elems: int = 1 << 24,
    lse_out: Optional[torch.Tensor] = None,
    v_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Online softmax over key tiles; returns fp32 ``(B, Hq, Lq, Dv)`` normalised output.

    Args:
        shape: ``(B, Hq, Lq, Dv)`` of the output.
        p_offset: log2 of the value the running row max maps to (log2 448 for FP8 P, log2 2688 for
            two-level FP4 P, 0 for plain softmax numerators).
        mask: None, or bool/additive tensor broadcastable to ``(B, Hq, Lq, lk)``.
        lse_out: optional fp32 ``(B, Hq, Lq)`` filled with the natural-log sum-exp of the scaled logits
            (what a backward pass needs); -inf on fully masked rows.
        v_bias: optional fp32 ``(B, Hq, 1, Dv)`` added to every normalised row that sees a key (the V
            token mean when V was quantized minus it).
    """
    b, h, lq, dv = shape
    out = torch.empty(shape, dtype=torch.float32, device=device)
    if mask is not None:
        mask = mask.expand(b, h, lq, lk)
    chunk = max(16, min(lq, chunk_elems // max(1, b * h * max(block_n, dv))))  # noqa: E501
    for i0 in range(0, lq, chunk):
        i1 = min(lq, i0 + chunk)
        m = torch.full((b, h, i1 - i0, 1), float("-inf"), device=device)
        l = torch.zeros((b, h, i1 - i0, 1), device=device)
        acc = torch.zeros((b, h, i1 - i0, dv), device=device)
        for j0 in range(0, causal_last_key(i1, lq, lk, causal), block_n):
            j1 = min(lk, j0 + block_n)
            z = logits(i0, i1, j0, j1)
            z = apply_masks(z, None if mask is None else mask[..., i0:i1, j0:j1],
                            visible_mask(i0, i1, j0, j1, lq, lk, causal, device))
            m_new = torch.maximum(m, z.amax(dim=-1, keepdim=True))
            m_safe = torch.where(torch.isinf(m_new) & (m_new < 0), torch.zeros_like(m_new), m_new)
            alpha = torch.exp2(m - m_safe)
            p = torch.exp2(z - m_safe + p_offset)
            contrib, rowsum = pv(p, j0, j1)
            l = alpha * l + rowsum
            acc = alpha * acc + contrib
            m = m_new
        # fully masked rows (l == 0) give 0, as FlashAttention; NaN/Inf propagate (never a plausible output)
        o = acc / torch.where(l == 0, torch.ones_like(l), l)
        if v_bias is not None:
            o = o + v_bias
        out[:, :, i0:i1] = torch.where(l == 0, torch.zeros_like(acc), o)
        if lse_out is not None:
            lse_out[:, :, i0:i1] = ((m + torch.log2(l) - p_offset) / LOG2E).squeeze(-1)
    return out


def gqa_expand(x: torch.Tensor, hq: int) -> torch.Tensor:
    """Repeat KV heads (dim 1) to ``hq`` query heads: kv head = q head // (hq / hkv)."""
    hkv = x.shape[1]
    if hkv == hq:
        return x
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of key/value heads {hkv}")
    return x.repeat_interleave(hq // hkv, dim=1)


def default_scale(scale: Optional[float], head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
