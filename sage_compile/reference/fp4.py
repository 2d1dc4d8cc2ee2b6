"""SageAttention3 numerics (``fp4``, NVFP4 microscaling), reference. See shared/docs/numerics.md §3.

Prologue: K mean smoothing; Q per-128-row block-mean smoothing with ΔS = q̄·Kᵀ kept in fp32 (upstream
rounds it to the input dtype: option ``delta_s="input"``); NVFP4 (E2M1 values, 1x16 blocks, E4M3 scales)
for Q and K along the head dim and for V along tokens (V stored transposed, tokens padded to 16).
Core: S = ΔS + deq(Q)·deq(K)ᵀ in fp32 (every dequantized product is exact); online softmax over 128-key
tiles with the running row max mapped to 448·6 = 2688 (level 1); then per 16-key group
s_P = max P̃ / 6 rounded to E4M3 and P̂ = E2M1(P̃ · (1/s)) (level 2, IEEE reciprocal). Upstream divides by the *unrounded*
s_P (``p_scale="unrounded"``, this module's default); ``"rounded"`` divides by the E4M3 value actually
used: slightly better on every set of benchmarks/ablation_fp4.py, so the scheme's default
(``Options.fp4_p_scale``). PV with NVFP4 P and V, fp32 across tiles.

Beyond SageAttention3 (options, on in the scheme's defaults, :class:`sage_compile.Options`): ``qk_balance``
moves channel ranges between the smoothed Q and K (SmoothQuant, α = 0.5) and ``qk_scale="search"`` picks
each Q/K block's E4M3 scale among 13 (:func:`~sage_compile.reference.quant.quant_nvfp4`).

Head dims that are not a multiple of 16 are zero-padded (exact: zero channels add nothing).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from . import engine
from .int8_fp8 import rescale_channels
from .layout import from_hnd, to_hnd
from .quant import (E2M1_MAX, dequant_nvfp4, fake_quant_fp4, quant_nvfp4, round_e2m1, smooth_k, smooth_q_blocks,
                    to_e4m3)

BLOCK_M, BLOCK_N, GROUP = 128, 128, 16
P_OFFSET = math.log2(448.0 * 6.0)


def _pad_last(x: torch.Tensor, mult: int) -> torch.Tensor:
    pad = (-x.shape[-1]) % mult
    return F.pad(x, (0, pad)) if pad else x


def smooth(q: torch.Tensor, k: torch.Tensor, layout: str = "HND", delta_s: str = "fp32", smooth: str = "qk",
           q_block: int = BLOCK_M, balance: bool = False):
    """The smoothing half of the prologue (fp32): ``(q − q̄_block, k − mean, ΔS = q̄·(k − mean)ᵀ)``, with Q
    and K zero-padded along the head dim to a multiple of 16. ``smooth`` in ``qk | k | none``
    (ablations); ``delta_s`` in ``fp32 | input`` (upstream rounds ΔS to the input dtype); ``q_block``:
    query rows per mean (128; the ablation tries finer). ``balance``: then the smoothed Q times
    diag(s) and K times diag(1/s), s = :func:`~sage_compile.reference.quant.channel_balance` of the two
    (exact in real arithmetic; ΔS is taken before, from the unbalanced values)."""
    q, k = to_hnd(q, layout), to_hnd(k, layout)
    b, hq, lq, d = q.shape
    ksm = smooth_k(k)[0] if smooth in ("qk", "k") else k.float()
    if smooth == "qk":
        qsm, qbar = smooth_q_blocks(q, q_block)
        kx = engine.gqa_expand(ksm, hq)
        if delta_s == "input":
            ds = (qbar.to(q.dtype) @ kx.to(q.dtype).transpose(-1, -2)).float()
        else:
            ds = qbar @ kx.transpose(-1, -2)
    else:
        qsm = q.float()
        ds = torch.zeros((b, hq, -(-lq // q_block), k.shape[2]), device=q.device)
    if balance:
        qsm, ksm = rescale_channels(qsm, ksm)
    return _pad_last(qsm, GROUP), _pad_last(ksm, GROUP), ds


def v_transposed(v: torch.Tensor, layout: str = "HND", v_smooth: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(V as (B, H, Dp, Nk16) fp32, V's token mean (B, H, D) fp32)``: V transposed, minus its token mean
    if ``v_smooth`` (else the mean is zeros), head dim and tokens zero-padded to multiples of 16."""
    vh = to_hnd(v, layout).float()
    vbar = vh.mean(dim=2) if v_smooth and vh.shape[2] else vh.new_zeros(vh.shape[0], vh.shape[1], vh.shape[3])
    vt = (vh - vbar[:, :, None]).transpose(-1, -2) if v_smooth else vh.transpose(-1, -2)
    d = vt.shape[-2]
    return F.pad(vt, (0, (-vt.shape[-1]) % GROUP, 0, (-d) % GROUP)), vbar


Q_BLOCKS = (16, 32, 64, 128)


def q_block_of(lq: int, n_blocks: int) -> int:
    """The Q-smoothing block size a ΔS with ``n_blocks`` rows was made with (one of :data:`Q_BLOCKS`):
    for n_blocks = ceil(lq / b) >= 2, ceil(lq / n_blocks) lies in (b/2, b]; one block is the same for all."""
    if n_blocks <= 1:
        return BLOCK_M
    return max(Q_BLOCKS[0], min(BLOCK_M, 1 << (-(-lq // n_blocks) - 1).bit_length()))


QK_SCALES = ("amax", "search")


def check_options(q_block: int, qk_scale: str) -> None:
    """Clear errors for prologue options out of range (reference and kernel share them)."""
    if q_block not in Q_BLOCKS:
        raise ValueError(f"sage_compile: fp4 q_block must be one of {Q_BLOCKS}, got {q_block}")
    if qk_scale not in QK_SCALES:
        raise ValueError(f"sage_compile: fp4 qk_scale must be one of {QK_SCALES}, got {qk_scale!r}")


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "HND", delta_s: str = "fp32",
             smooth_mode: str = "qk", q_block: int = BLOCK_M, v_smooth: bool = False, qk_scale: str = "amax",
             qk_balance: bool = False):
    """Returns ``(qp (B,Hq,Nq,Dp/2) u8, qsc (B,Hq,Nq,Dp/16) e4m3, kp, ksc, vp (B,Hkv,Dp,Nk16/2) u8,
    vsc (B,Hkv,Dp,Nk16/16) e4m3, ds (B,Hq,ceil(Nq/q_block),Nk) f32, vbar (B,Hkv,D) f32)``; Dp = D rounded
    up to 16, Nk16 = Nk rounded up to 16. See :func:`smooth` for the options; ``q_block`` in
    :data:`Q_BLOCKS` (ΔS takes Nq·Nk·4/q_block bytes per head); ``v_smooth``: V is quantized minus its
    token mean ``vbar`` (zeros when off), which the core adds back to each normalised row. ``qk_scale``:
    Q's and K's block scales, ``amax`` (amax/6, SageAttention3) or ``search`` (the nearest of 13, see
    :func:`~sage_compile.reference.quant.quant_nvfp4`; V keeps amax/6: searching its scales made
    SmolLM2's attention outputs worse); ``qk_balance``: see :func:`smooth`."""
    check_options(q_block, qk_scale)
    qsm, ksm, ds = smooth(q, k, layout, delta_s, smooth_mode, q_block, qk_balance)
    qp, qsc = quant_nvfp4(qsm, qk_scale == "search")
    kp, ksc = quant_nvfp4(ksm, qk_scale == "search")
    vt, vbar = v_transposed(v, layout, v_smooth)
    vp, vsc = quant_nvfp4(vt)
    return qp, qsc, kp, ksc, vp, vsc, ds, vbar


def quant_p(p: torch.Tensor, p_scale: str = "unrounded") -> torch.Tensor:
    """Level 2 of the P quantization (fake, fp32 out): per 16 keys s = max/6 -> E4M3, values E2M1 of
    P / s (``unrounded`` s, as upstream) or P / E4M3(s) (``rounded``), times E4M3(s). The division is
    P · (1/s) with the IEEE fp32 reciprocal (0 where s = 0), the rule of the Q/K/V quantizers: one
    reciprocal per group in the kernel instead of a correctly rounded division per element."""
    n = p.shape[-1]
    pg = F.pad(p, (0, (-n) % GROUP)).unflatten(-1, (-1, GROUP))
    sp = pg.amax(dim=-1, keepdim=True) / E2M1_MAX
    sp8 = to_e4m3(sp).float()
    div = sp if p_scale == "unrounded" else sp8
    inv = torch.where(div > 0, 1.0 / torch.where(div > 0, div, torch.ones_like(div)), torch.zeros_like(div))
    return (round_e2m1(pg * inv) * sp8).flatten(-2)[..., :n]


def attention(qp, qsc, kp, ksc, vp, vsc, ds, vbar, attn_mask: Optional[torch.Tensor], causal: str,
              scale: Optional[float], layout: str, out_dtype: torch.dtype, head_dim: int,
              p_scale: str = "unrounded") -> torch.Tensor:
    """Core; ``head_dim`` is the unpadded D (for the default scale and the output width); ``vbar`` (V's
    token mean, :func:`quantize`) is added to every row that sees a key."""
    b, hq, lq, _ = qp.shape
    lk = kp.shape[2]
    c = engine.default_scale(scale, head_dim) * engine.LOG2E
    qf = dequant_nvfp4(qp, qsc)
    kf = engine.gqa_expand(dequant_nvfp4(kp, ksc), hq)
    vf = engine.gqa_expand(dequant_nvfp4(vp, vsc), hq)[..., :head_dim, :lk]  # (B,Hq,D,Nk)
    dsx = ds.repeat_interleave(q_block_of(lq, ds.shape[2]), dim=2)[:, :, :lq]

    def logits(i0, i1, j0, j1):
        s = dsx[:, :, i0:i1, j0:j1] + qf[:, :, i0:i1] @ kf[:, :, j0:j1].transpose(-1, -2)
        return s * c

    def pv(p, j0, j1):
        return quant_p(p, p_scale) @ vf[:, :, :, j0:j1].transpose(-1, -2), p.sum(-1, keepdim=True)

    o = engine.run((b, hq, lq, head_dim), lk, logits, pv, attn_mask, causal, BLOCK_N, P_OFFSET, qp.device,
                   v_bias=engine.gqa_expand(vbar.float(), hq)[:, :, None, :head_dim])
    return from_hnd(o.to(out_dtype), layout)


# ------------------------------------------------------------------------------------------ ablations
def _fake(x: torch.Tensor, fmt: str, search: bool = False) -> torch.Tensor:
    """Quantize-dequantize along the last dim (zero-padded to the block) and cut back."""
    n = x.shape[-1]
    if search and fmt == "nvfp4":
        return dequant_nvfp4(*quant_nvfp4(_pad_last(x, 16), True))[..., :n]
    blk = 16 if fmt == "nvfp4" else 32
    return fake_quant_fp4(_pad_last(x, blk), fmt)[..., :n]


def attention_ablation(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: str = "none",
                       scale: Optional[float] = None, fmt: str = "nvfp4", p_levels: int = 2, smooth_mode: str = "qk",
                       p_scale: str = "unrounded", delta_s: str = "fp32", q_block: int = BLOCK_M,
                       v_smooth: bool = False, qk_scale: str = "amax", qk_balance: bool = False) -> torch.Tensor:
    """The fp4 numerics with the paper's ablation switches, as fake quantization (fp32 out, HND in).

    ``fmt``: ``nvfp4`` (1x16, E4M3 scales) or ``mxfp4`` (1x32, power-of-two scales) for Q, K, V and P.
    ``p_levels``: 2 = two-level P (row max -> 448·6, then per-group scales), 1 = direct (row max -> 1,
    per-group scales only). ``smooth_mode``/``p_scale``/``delta_s`` as in :func:`quantize` /
    :func:`attention`; ``q_block``: query rows per smoothing mean; ``v_smooth``: quantize V minus its
    token mean and add the mean back to each normalised row (exact in real arithmetic: normalised P rows
    sum to 1); ``qk_scale``/``qk_balance`` (nvfp4 only) as in :func:`quantize`. With the same options this
    is :func:`attention` of :func:`quantize` (tested)."""
    check_options(q_block, qk_scale)
    b, hq, lq, d = q.shape
    lk = k.shape[2]
    qsm, ksm, ds = smooth(q, k, "HND", delta_s, smooth_mode, q_block, qk_balance)
    srch = qk_scale == "search"
    qf, kf = _fake(qsm, fmt, srch), engine.gqa_expand(_fake(ksm, fmt, srch), hq)
    vt, vbar = v_transposed(v, "HND", v_smooth)  # zero-padded (exact: zero channels / tokens add nothing)
    vf = engine.gqa_expand(_fake(vt, fmt)[..., :d, :lk], hq)  # (B, Hq, D, Nk)
    dsx = ds.repeat_interleave(q_block, dim=2)[:, :, :lq]
    c = engine.default_scale(scale, d) * engine.LOG2E
    def logits(i0, i1, j0, j1):
        return (dsx[:, :, i0:i1, j0:j1] + qf[:, :, i0:i1] @ kf[:, :, j0:j1].transpose(-1, -2)) * c

    def pv(p, j0, j1):
        pq = _fake(p, "mxfp4") if fmt == "mxfp4" else quant_p(p, p_scale)
        return pq @ vf[:, :, :, j0:j1].transpose(-1, -2), p.sum(-1, keepdim=True)

    off = P_OFFSET if p_levels == 2 else 0.0
    return engine.run((b, hq, lq, d), lk, logits, pv, None, causal, BLOCK_N, off, q.device,
                      v_bias=engine.gqa_expand(vbar, hq)[:, :, None] if v_smooth else None)
