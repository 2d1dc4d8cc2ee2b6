"""SageAttention1 numerics (``int8_fp16``), reference. See shared/docs/numerics.md §1.

Prologue: K smoothing; INT8 Q per 128-token block, K per 64-token block; V in fp16.
Core: online softmax over 64-key tiles, P̃ = exp2(z − m) in fp16, P̃·V with an fp16 result per tile
(the SA1 "fp16 accumulator", emulated by rounding each tile's product to fp16) added into fp32.
An fp16 V that would overflow (|V| > 65504) is rejected by the policy; here it saturates.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import engine
from .layout import from_hnd, to_hnd
from .quant import quant_int8, smooth_k

BLOCK_Q, BLOCK_K, BLOCK_N = 128, 64, 64
FP16_MAX = 65504.0


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "HND"):
    """Returns ``(q8, qs (B,Hq,ceil(Nq/128)), k8, ks (B,Hkv,ceil(Nk/64)), v16 (B,Hkv,Nk,D) fp16)``."""
    q, k, v = (to_hnd(t, layout) for t in (q, k, v))
    ksm, _ = smooth_k(k)
    q8, qs = quant_int8(q, BLOCK_Q)
    k8, ks = quant_int8(ksm, BLOCK_K)
    v16 = v.float().clamp(-FP16_MAX, FP16_MAX).to(torch.float16).contiguous()
    return q8, qs, k8, ks, v16


def attention(q8, qs, k8, ks, v16, attn_mask: Optional[torch.Tensor], causal: str, scale: Optional[float],
              layout: str, out_dtype: torch.dtype) -> torch.Tensor:
    b, hq, lq, d = q8.shape
    lk, dv = k8.shape[2], v16.shape[-1]
    c = engine.default_scale(scale, d) * engine.LOG2E
    qf = q8.float()
    kf = engine.gqa_expand(k8, hq).float()
    qst = qs.repeat_interleave(BLOCK_Q, dim=-1)[..., :lq]
    kst = engine.gqa_expand(ks, hq).repeat_interleave(BLOCK_K, dim=-1)[..., :lk]
    vf = engine.gqa_expand(v16, hq).float()

    def logits(i0, i1, j0, j1):
        s = qf[:, :, i0:i1] @ kf[:, :, j0:j1].transpose(-1, -2)
        return s * (qst[:, :, i0:i1, None] * kst[:, :, None, j0:j1]) * c

    def pv(p, j0, j1):
        p16 = p.to(torch.float16).float()
        return (p16 @ vf[:, :, j0:j1]).clamp(-FP16_MAX, FP16_MAX).to(torch.float16).float(), p.sum(-1, keepdim=True)

    o = engine.run((b, hq, lq, dv), lk, logits, pv, attn_mask, causal, BLOCK_N, 0.0, q8.device)
    return from_hnd(o.to(out_dtype), layout)
