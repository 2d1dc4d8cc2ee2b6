"""Triton core of ``int8_fp8`` (SageAttention2 numerics; shared/docs/numerics.md §2, §7.3).

Per (batch, head, BLOCK_M queries): S = int8 q̂·k̂ᵀ (exact int32) dequantized by per-token scales with
the softmax scale·log2e folded into Q's; online softmax in the exp2 domain over 128-key tiles with the
running row max mapped to 448; P̃ rounded to FP8 E4M3 and multiplied with the FP8 V tile, the tile's
product promoted to fp32 once per tile (two-level accumulation via ``max_num_imprecise_acc``); row sums
from unrounded fp32 P̃; O·δ_V/l at the end. Masks: causal (top_left / bottom_right) from indices;
bool / additive masks read in-kernel through broadcast strides. Same tiling as the reference
(BLOCK_N = 128), so the two agree to accumulation-order noise.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .._common import CAUSAL_CODES, EMULATE_FP8, output_and_mask, to_e4m3

LOG2E = 1.4426950408889634
LOG2_448 = math.log2(448.0)
BLOCK_N = 128


@triton.jit
def _tile(acc, m_i, l_i, q, qs, K8, KS, V8, MASK, n0, offs_m, LQ, LK, D,
          skn, svd, smq, smk, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, CHECK: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, P_OFF: tl.constexpr, EMULATE: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    if CHECK:
        k = tl.load(K8 + offs_n[:, None] * skn + rd[None, :], mask=(offs_n[:, None] < LK) & (rd[None, :] < D), other=0)
        ks = tl.load(KS + offs_n, mask=offs_n < LK, other=0.0)
        v = tl.load(V8 + rd[None, :] * svd + offs_n[:, None], mask=(offs_n[:, None] < LK) & (rd[None, :] < D), other=0.0)
    else:
        k = tl.load(K8 + offs_n[:, None] * skn + rd[None, :], mask=rd[None, :] < D, other=0)
        ks = tl.load(KS + offs_n)
        v = tl.load(V8 + rd[None, :] * svd + offs_n[:, None], mask=rd[None, :] < D, other=0.0)
    s = tl.dot(q, tl.trans(k), out_dtype=tl.int32)
    z = s.to(tl.float32) * qs[:, None] * ks[None, :]
    if MASK_KIND == 1:
        mk = tl.load(MASK + offs_m[:, None] * smq + offs_n[None, :] * smk,
                     mask=(offs_m[:, None] < LQ) & (offs_n[None, :] < LK), other=0)
        z = tl.where(mk != 0, z, float("-inf"))
    if MASK_KIND == 2:
        mk = tl.load(MASK + offs_m[:, None] * smq + offs_n[None, :] * smk,
                     mask=(offs_m[:, None] < LQ) & (offs_n[None, :] < LK), other=0.0)
        z = z + mk.to(tl.float32) * 1.4426950408889634
    if CHECK:
        keep = offs_n[None, :] < LK
        if CAUSAL == 1:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        if CAUSAL == 2:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + (LK - LQ))
        z = tl.where(keep, z, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(z, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(z - m_use[:, None] + P_OFF)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p8 = to_e4m3(tl.minimum(p, 448.0), EMULATE)
    acc = acc * alpha[:, None]
    acc = tl.dot(p8, v, acc, max_num_imprecise_acc=BLOCK_N)
    return acc, m_new, l_i


def _configs():
    return [triton.Config({"BLOCK_M": bm}, num_warps=w, num_stages=s)
            for bm, w, s in ((128, 8, 2), (128, 8, 3), (128, 4, 2), (64, 4, 2), (64, 4, 3))]


@triton.jit
def _fwd_body(Q8, QS, K8, KS, V8, VS, MASK, OUT, c,
              sqb, sqh, skb, skh, svb, svh, smb, smh, smq, smk, sob, soh, son,
              H, GROUP, LQ, LK, D,
              CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, P_OFF: tl.constexpr, EMULATE: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    q = tl.load(Q8 + b * sqb + h * sqh + offs_m[:, None] * D + rd[None, :],
                mask=(offs_m[:, None] < LQ) & (rd[None, :] < D), other=0)
    qs = tl.load(QS + (b * (sqb // D) + h * (sqh // D)) + offs_m, mask=offs_m < LQ, other=0.0) * c
    K8 = K8 + b * skb + hk * skh
    KS = KS + (b * (skb // D) + hk * (skh // D))
    V8 = V8 + b * svb + hk * svh
    MASK = MASK + b * smb + h * smh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    off = 0
    if CAUSAL == 2:
        off = LK - LQ
    hi = LK
    if CAUSAL != 0:
        hi = tl.minimum(LK, tl.maximum(0, m0 + BLOCK_M + off))
    # tiles every row sees entirely (no index checks), then the rest with checks
    full = (LK // BLOCK_N) * BLOCK_N
    if CAUSAL != 0:
        full = tl.minimum(full, tl.maximum(0, (m0 + off + 1) // BLOCK_N) * BLOCK_N)
    full = tl.minimum(full, hi)
    for n0 in range(0, full, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, qs, K8, KS, V8, MASK, n0, offs_m, LQ, LK, D, D, LK, smq, smk,
                              CAUSAL, MASK_KIND, False, BLOCK_N, BLOCK_D, P_OFF, EMULATE)
    for n0 in range(full, hi, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, qs, K8, KS, V8, MASK, n0, offs_m, LQ, LK, D, D, LK, smq, smk,
                              CAUSAL, MASK_KIND, True, BLOCK_N, BLOCK_D, P_OFF, EMULATE)
    vs = tl.load(VS + (b * (svb // LK) + hk * (svh // LK)) + rd, mask=rd < D, other=0.0)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None] * vs[None, :]
    o = tl.where(l_i[:, None] == 0.0, 0.0, o)
    tl.store(OUT + b * sob + h * soh + offs_m[:, None] * son + rd[None, :], o.to(OUT.dtype.element_ty),
             mask=(offs_m[:, None] < LQ) & (rd[None, :] < D))


_fwd = triton.autotune(configs=_configs(), key=["D", "CAUSAL", "MASK_KIND", "BLOCK_D"])(_fwd_body)


def attention(q8, qs, k8, ks, v8, vs, attn_mask: Optional[torch.Tensor], causal: str, scale: Optional[float],
              layout: str, out_dtype: torch.dtype, config: Optional[dict] = None) -> torch.Tensor:
    """Same contract as :func:`sage_compile.reference.int8_fp8.attention` (inputs from ``quantize``).

    ``config`` (``BLOCK_M``, ``num_warps``, ``num_stages``) bypasses autotuning (tests, interpreter)."""
    b, hq, lq, d = q8.shape
    hkv, lk = k8.shape[1], k8.shape[2]
    if d > 256:
        raise ValueError(f"int8_fp8 kernel: head_dim {d} > 256")
    c = (1.0 / math.sqrt(d) if scale is None else float(scale)) * LOG2E
    q8, k8, v8 = q8.contiguous(), k8.contiguous(), v8.contiguous()
    qs, ks, vs = qs.contiguous(), ks.contiguous(), vs.contiguous()
    out, (sob, soh, son), mask, kind, ms = output_and_mask(b, hq, lq, lk, d, layout, out_dtype, attn_mask,
                                                           q8.device, qs)
    block_d = max(32, triton.next_power_of_2(d))
    args = (q8, qs, k8, ks, v8, vs, mask, out, c, q8.stride(0), q8.stride(1), k8.stride(0), k8.stride(1),
            v8.stride(0), v8.stride(1), *ms, sob, soh, son, hq, hq // hkv, lq, lk, d)
    meta = dict(CAUSAL=CAUSAL_CODES[causal], MASK_KIND=kind, BLOCK_N=BLOCK_N, BLOCK_D=block_d, P_OFF=LOG2_448,
                EMULATE=EMULATE_FP8)
    if config is not None:
        bm = config["BLOCK_M"]
        _fwd_body[(triton.cdiv(lq, bm), b * hq)](*args, **meta, BLOCK_M=bm, num_warps=config.get("num_warps", 4),
                                                 num_stages=config.get("num_stages", 2))
    else:
        _fwd[lambda m: (triton.cdiv(lq, m["BLOCK_M"]), b * hq)](*args, **meta)
    return out
