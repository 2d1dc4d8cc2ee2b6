"""``exact``: plain SDPA with the project's causal/mask/GQA/layout conventions (the baseline scheme)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import engine
from .layout import from_hnd, to_hnd


def combined_mask(attn_mask: Optional[torch.Tensor], causal: str, lq: int, lk: int, device) -> Optional[torch.Tensor]:
    """One SDPA ``attn_mask`` expressing both a user mask and a bottom-right causal rule."""
    cm = engine.visible_mask(0, lq, 0, lk, lq, lk, causal, device)
    if cm is None:
        return attn_mask
    if attn_mask is None:
        return cm
    if attn_mask.dtype == torch.bool:
        return attn_mask & cm
    return attn_mask.masked_fill(~cm, float("-inf"))


def attention(q, k, v, attn_mask: Optional[torch.Tensor], causal: str, scale: Optional[float], layout: str) -> torch.Tensor:
    """SDPA on ``(B, H, N, D)``/``(B, N, H, D)`` inputs; GQA when Hq is a multiple of Hkv."""
    q, k, v = (to_hnd(t, layout) for t in (q, k, v))
    lq, lk = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if causal == "top_left" and attn_mask is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        m = combined_mask(attn_mask, causal, lq, lk, q.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale, enable_gqa=gqa)
    return from_hnd(o, layout)
