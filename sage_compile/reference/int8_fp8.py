"""SageAttention2 numerics (``int8_fp8``), reference. See shared/docs/numerics.md §2 and §7.3.

Prologue: K smoothing (token mean, fp32, never in place); per-token INT8 Q (a strict refinement of the
sm90 per-thread Q groups), INT8 K in SageAttention2's per-thread groups of 32 keys per 128-key tile
(:func:`~sage_compile.reference.quant.quant_int8_k_groups`: the CUDA core's fast path); V per-channel
FP8 E4M3 (amax/448), stored transposed ``(B, H, D, N)``, tokens padded with zeros to a multiple of 16.
Core: S = (q̂·k̂ᵀ) exact, dequantized by the outer product of token scales; online softmax in the exp2
domain over 128-key tiles with the running row max mapped to 448; P̃ rounded to E4M3; P̂·V̂ per tile
added into an fp32 accumulator (two-level accumulation); row sums from unrounded fp32 P̃; O·δ_V at the end.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import engine
from .layout import from_hnd, to_hnd
from .quant import (channel_balance, div_rn, quant_fp8_v, quant_int8, quant_int8_k_groups, smooth_k, smoothed_amax,
                    to_e4m3)

BLOCK_N = 128
BALANCE_TOKENS = 512  # query tokens the channel balance's Q ranges read, at least (:func:`stats_stride`); 0: all
V_KEY_MULTIPLE = 16  # V^T's token axis is padded with zeros to this (the CUDA core's TMA needs it; no copies)
P_OFFSET = math.log2(448.0)


def stats_stride(n: int, tokens: int = BALANCE_TOKENS):
    """Token stride of a statistics sample over ``n`` tokens: every ``n // tokens``-th token from the first
    (``tokens`` to ``2·tokens - 1`` of them), every token when ``n < 2·tokens`` or ``tokens`` is 0. A SymInt for
    a symbolic ``n``."""
    return 1 if tokens <= 0 else torch.sym_max(1, n // tokens)


def token_sample(x: torch.Tensor, tokens: int = BALANCE_TOKENS) -> torch.Tensor:
    """The tokens of ``x`` ``(B, H, N, D)`` that a statistic with ``tokens`` reads (:func:`stats_stride`): a
    strided view, or ``x`` itself where that is every token (no view op in a traced graph)."""
    step = stats_stride(x.shape[2], tokens)
    return x if isinstance(step, int) and step == 1 else x[:, :, ::step]


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "HND", channel_rescale: bool = False,
             balance_tokens: int = BALANCE_TOKENS):
    """Prologue. q ``(B, Hq, Nq, D)``, k/v ``(B, Hkv, Nk, D)`` in ``layout``; inputs are never modified.

    ``channel_rescale``: balance per-channel ranges between Q and smoothed K before quantizing
    (:func:`~sage_compile.reference.quant.channel_balance`; exact in real arithmetic, it moves K's outlier
    channels into Q, where per-token scales absorb them). Q's channel ranges come from a strided sample of at
    least ``balance_tokens`` queries (:func:`token_sample`; 0: every query), K's from every key. Any factors
    are exact, and Q's per-token scales absorb whatever a sample misses, so Q's ranges need not read every
    query: on the outlier set the error is that of every query's ranges (a query outlier off the sample even
    leaves the factors better, tests/test_reference.py), and the prologue skips a pass over Q. K's mean and ranges
    read every key: from a sample, a key outlier off it costs accuracy (benchmarks/ablation_balance_sample.py).

    Returns ``(q8 (B,Hq,Nq,D) int8, qs (B,Hq,Nq) f32, k8 (B,Hkv,Nk,D) int8, ks (B,Hkv,Nk) f32 (one value
    per key, tied in the groups of :func:`~sage_compile.reference.quant.quant_int8_k_groups`),
    v8 (B,Hkv,D,Nk16) float8_e4m3fn, vs (B,Hkv,D) f32)``: V transposed, its keys padded with zeros to
    Nk16 = a multiple of :data:`V_KEY_MULTIPLE` (the key count is k8's).
    """
    q, k, v = (to_hnd(t, layout) for t in (q, k, v))
    ksm, mean = smooth_k(k)
    qf = q.float()
    if channel_rescale:  # Q's channel amax read in q's own dtype (exact): a compiled graph then keeps the
        # producer's output (RoPE, QK-norm) in that dtype for the reduction and the quantizer, not in fp32
        qf, ksm = rescale_channels(qf, ksm, smoothed_amax(k, mean), token_sample(q, balance_tokens))
    q8, qs = quant_int8(qf, 1)
    k8, ks = quant_int8_k_groups(ksm)
    v8, vs = quant_fp8_v(v, V_KEY_MULTIPLE)
    return q8, qs, k8, ks, v8, vs


def rescale_channels(qf: torch.Tensor, ksm: torch.Tensor, k_amax: Optional[torch.Tensor] = None,
                     q: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q·diag(s), K·diag(1/s)) with s from :func:`channel_balance` (fp32 in, fp32 out); ``q``: the queries whose
    channel amax sets s (``qf`` when None), in their own dtype (the same bits as in fp32): all of them or a
    :func:`token_sample`; ``k_amax``: K's smoothed channel amax (from ``ksm`` when None)."""
    s = channel_balance(qf if q is None else q, ksm, k_amax)
    return qf * engine.gqa_expand(s, qf.shape[1]), div_rn(ksm, s)


def attention(q8, qs, k8, ks, v8, vs, attn_mask: Optional[torch.Tensor], causal: str, scale: Optional[float],
              layout: str, out_dtype: torch.dtype) -> torch.Tensor:
    """Core. Quantized inputs as returned by :func:`quantize`; output ``(B, Hq, Nq, D)`` (HND) or
    ``(B, Nq, Hq, D)`` (NHD) in ``out_dtype``."""
    b, hq, lq, d = q8.shape
    lk, dv = k8.shape[2], v8.shape[2]
    c = engine.default_scale(scale, d) * engine.LOG2E
    qf = q8.float()
    kf = engine.gqa_expand(k8, hq).float()
    ksx = engine.gqa_expand(ks, hq)
    vf = engine.gqa_expand(v8, hq).float()  # (B, Hq, D, Nk16): the padded keys are never read

    def logits(i0, i1, j0, j1):
        s = qf[:, :, i0:i1] @ kf[:, :, j0:j1].transpose(-1, -2)
        return s * (qs[:, :, i0:i1, None] * ksx[:, :, None, j0:j1]) * c

    def pv(p, j0, j1):
        return to_e4m3(p).float() @ vf[:, :, :, j0:j1].transpose(-1, -2), p.sum(-1, keepdim=True)

    o = engine.run((b, hq, lq, dv), lk, logits, pv, attn_mask, causal, BLOCK_N, P_OFFSET, q8.device)
    o = o * engine.gqa_expand(vs, hq)[:, :, None, :]
    return from_hnd(o.to(out_dtype), layout)
