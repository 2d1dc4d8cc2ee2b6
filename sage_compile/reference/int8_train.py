"""SageBwd numerics (``int8_train``), reference: 8-bit trainable attention (shared/docs/numerics.md §4).

Forward: K smoothing; INT8 Q per 128-token block and K, V per 64-token block (ψ, per-block scales);
S = δ_Q δ_K q̂·k̂ᵀ; online softmax over 64-key tiles; P̃ quantized per token within each tile
(δ_P = row max / 127) and multiplied with V̂ in INT8; O and the log-sum-exp saved for backward.
Backward (6 of the 7 matmuls INT8): S recomputed from q̂, k̂; P = exp(S·scale − LSE);
dV = ψ(P)ᵀ ψ(dO); **dP = dO·Vᵀ in the input's 16-bit dtype with fp32 accumulation**;
dS = P ∘ (dP − rowsum(dO ∘ O)); dQ = ψ(dS)·K̂ (+ rowsum(ψ(dS))·μ_K, the K-smoothing correction);
dK = ψ(dS)ᵀ·Q̂; ψ on (BLOCK_M x BLOCK_N) tiles of P and dS, (BLOCK_M x D) tiles of dO. GQA: dK, dV
summed over each query-head group. The backward materialises (Lq, Lk) per head: an oracle for kernels
and small models, not a training path for long sequences.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import engine
from .layout import from_hnd, to_hnd
from .quant import dequant_int8, quant_int8, smooth_k

BLOCK_M, BLOCK_N = 128, 64
SPLIT_M = 64  # psi="split": queries per ψ(P) / ψ(dS) scale of one key (dV, dK)
_DTYPE16 = {torch.float32: torch.bfloat16}


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "HND", k_block: int = BLOCK_N,
             v_block: int = BLOCK_N):
    """Returns ``(q8, qs (B,Hq,ceil(Nq/128)), k8, ks (B,Hkv,ceil(Nk/64)), v8, vs (B,Hkv,ceil(Nk/64)),
    k_mean (B,Hkv,1,D))``; inputs are never modified. ``k_block`` / ``v_block``: tokens per K / V scale
    (ablations; the kernels use 64)."""
    q, k, v = (to_hnd(t, layout) for t in (q, k, v))
    ksm, mean = smooth_k(k)
    q8, qs = quant_int8(q, BLOCK_M)
    k8, ks = quant_int8(ksm, k_block)
    v8, vs = quant_int8(v, v_block)
    return q8, qs, k8, ks, v8, vs, mean


def _tile_quant(x: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    """ψ: symmetric INT8 fake-quantization with one scale per (bm x bn) tile of the last two dims."""
    *lead, r, c = x.shape
    xp = torch.nn.functional.pad(x, (0, (-c) % bn, 0, (-r) % bm))
    t = xp.unflatten(-1, (-1, bn)).unflatten(-3, (-1, bm))  # (..., R/bm, bm, C/bn, bn)
    scale = t.abs().amax(dim=(-3, -1), keepdim=True) / 127.0
    q = torch.where(scale == 0, torch.zeros_like(t), torch.round(t / torch.where(scale == 0, torch.ones_like(scale), scale)))
    return (q * scale).flatten(-2).flatten(-3, -2)[..., :r, :c]


def forward(q8, qs, k8, ks, v8, vs, causal: str, scale: Optional[float], layout: str, out_dtype: torch.dtype,
            attn_mask: Optional[torch.Tensor] = None, k_block: int = BLOCK_N, tile: int = BLOCK_N):
    """Returns ``(O in layout/out_dtype, LSE fp32 (B, Hq, Nq))``. ``attn_mask``: bool (True = attend) or
    additive, broadcastable to ``(B, Hq, Nq, Nk)``. ``tile``: keys per softmax tile, so per P̃ scale of a
    token, and per V scale (V quantized with ``v_block=tile``); the kernels use 64 (an ablation)."""
    b, hq, lq, d = q8.shape
    lk = k8.shape[2]
    c = engine.default_scale(scale, d) * engine.LOG2E
    qf = dequant_int8(q8, qs, BLOCK_M)
    kf = engine.gqa_expand(dequant_int8(k8, ks, k_block), hq)
    vq = engine.gqa_expand(v8, hq).float()
    vsx = engine.gqa_expand(vs, hq)

    def logits(i0, i1, j0, j1):
        return (qf[:, :, i0:i1] @ kf[:, :, j0:j1].transpose(-1, -2)) * c

    def pv(p, j0, j1):
        dp = p.amax(dim=-1, keepdim=True) / 127.0  # per-token P scale in this tile
        pq = torch.round(p / torch.where(dp == 0, torch.ones_like(dp), dp))
        contrib = dp * (pq @ vq[:, :, j0:j1]) * vsx[:, :, j0 // tile, None, None]
        return contrib, p.sum(-1, keepdim=True)

    lse = torch.empty((b, hq, lq), device=q8.device)
    o = engine.run((b, hq, lq, d), lk, logits, pv, attn_mask, causal, tile, 0.0, q8.device, lse_out=lse)
    return from_hnd(o.to(out_dtype), layout), lse


def quantize_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor], causal: str,
                     scale: Optional[float], layout: str):
    """The training op's forward: :func:`quantize`, then :func:`forward` in the inputs' dtype: ``(O, LSE, the
    quantized tuple)`` (what the backward takes)."""
    qt = quantize(q, k, v, layout)
    o, lse = forward(*qt[:6], causal, scale, layout, q.dtype, attn_mask=attn_mask)
    return o, lse, qt


def backward(q8, qs, k8, ks, v8, vs, k_mean, o, lse, do, causal: str, scale: Optional[float], layout: str,
             in_dtype: torch.dtype, dp_int8: bool = False, attn_mask: Optional[torch.Tensor] = None,
             k_block: int = BLOCK_N, ds_block: tuple = (BLOCK_M, BLOCK_N), psi: str = "tile", v_block: int = BLOCK_N):
    """SageBwd gradients ``(dq, dk, dv)`` in ``layout`` and ``in_dtype``. ``attn_mask`` as in
    :func:`forward`. Ablations (the kernels implement the defaults): ``dp_int8=True`` also quantizes
    dO·Vᵀ (the SageBwd paper shows it hurts dQ); ``k_block`` / ``v_block`` tokens per K / V scale; ``ds_block`` the
    (queries, keys) tile sharing one ψ(dS) scale. ``psi="split"``: one scale per row of each matmul's
    own operand (the finest that still factors out of an integer dot): ψ(dS) per query row in each
    64-key tile for dQ, per key over each ``SPLIT_M`` (64) -query block for dK, ψ(P) the same for dV."""
    b, hq, lq, d = q8.shape
    hkv, lk = k8.shape[1], k8.shape[2]
    sm = engine.default_scale(scale, d)
    qf = dequant_int8(q8, qs, BLOCK_M)
    kf = engine.gqa_expand(dequant_int8(k8, ks, k_block), hq)
    vf = engine.gqa_expand(dequant_int8(v8, vs, v_block), hq)
    of, dof = to_hnd(o, layout).float(), to_hnd(do, layout).float()
    s = (qf @ kf.transpose(-1, -2)) * sm
    vis = engine.visible_mask(0, lq, 0, lk, lq, lk, causal, q8.device)
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.float()
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    split = psi == "split"
    if psi not in ("tile", "split"):
        raise ValueError(f"int8_train: psi must be 'tile' or 'split', got {psi!r}")
    pq = _tile_quant(p, SPLIT_M, 1) if split else _tile_quant(p, BLOCK_M, BLOCK_N)
    dvx = pq.transpose(-1, -2) @ _tile_quant(dof, BLOCK_M, d)
    d16 = _DTYPE16.get(in_dtype, in_dtype)
    if dp_int8:
        dp = _tile_quant(dof, BLOCK_M, d) @ _tile_quant(vf, BLOCK_N, d).transpose(-1, -2)
    else:
        dp = dof.to(d16).float() @ vf.to(d16).float().transpose(-1, -2)
    delta = (dof * of).sum(-1, keepdim=True)
    ds_full = p * (dp - delta)
    ds = _tile_quant(ds_full, 1, BLOCK_N) if split else _tile_quant(ds_full, *ds_block)
    dq = (ds @ kf + ds.sum(-1, keepdim=True) * engine.gqa_expand(k_mean, hq)) * sm
    dsk = _tile_quant(ds_full, SPLIT_M, 1) if split else ds
    dkx = (dsk.transpose(-1, -2) @ qf) * sm
    g = hq // hkv
    dk, dv = dkx.unflatten(1, (hkv, g)).sum(2), dvx.unflatten(1, (hkv, g)).sum(2)
    back = (lambda t: t) if layout == "HND" else (lambda t: t.transpose(1, 2))
    return back(dq).to(in_dtype), back(dk).to(in_dtype), back(dv).to(in_dtype)


def gradients_ablation(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: str = "none",
                       scale: Optional[float] = None, k_block: int = BLOCK_N, ds_block: tuple = (BLOCK_M, BLOCK_N),
                       dp_int8: bool = False, rescale: bool = False, psi: str = "tile", fwd_tile: int = BLOCK_N):
    """SageBwd forward + backward with the study's knobs (HND, fp32 out): ``(o, dq, dk, dv)``.

    Defaults are :func:`forward` + :func:`backward` exactly. ``rescale`` balances Q/K channel ranges
    first (:func:`~sage_compile.reference.quant.channel_balance`; S = (Q·s)(K/s)ᵀ is exact), so the
    gradients come back as dQ = dQ'·s and dK = dK'/s. ``fwd_tile``: the forward's keys per tile, with V's scales
    per as many keys (:func:`forward`'s ``tile``)."""
    from .quant import channel_balance

    q, k, v, do = (t.float() for t in (q, k, v, do))
    s = None
    if rescale:
        s = channel_balance(q, smooth_k(k)[0])
        q, k = q * engine.gqa_expand(s, q.shape[1]), k / s
    qt = quantize(q, k, v, k_block=k_block, v_block=fwd_tile)
    o, lse = forward(*qt[:6], causal, scale, "HND", torch.float32, k_block=k_block, tile=fwd_tile)
    dq, dk, dv = backward(*qt, o, lse, do, causal, scale, "HND", torch.float32, dp_int8=dp_int8,
                          k_block=k_block, ds_block=tuple(ds_block), psi=psi, v_block=fwd_tile)
    if s is not None:
        dq, dk = dq * engine.gqa_expand(s, dq.shape[1]), dk / s
    return o, dq, dk, dv
