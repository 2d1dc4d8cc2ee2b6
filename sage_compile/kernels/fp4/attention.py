"""Triton core of ``fp4`` (SageAttention3 NVFP4 numerics, exact on Hopper; numerics.md §3, §7.3(a)).

Hopper has no FP4 tensor cores: every NVFP4 operand is dequantized in registers to fp16 — exactly, since
each E2M1 x E4M3 product is an fp16 (and a bf16) value; the codes are decoded from their bits — and
multiplied on 16-bit tensor cores with fp32 accumulation,
so the kernel computes what a Blackwell block-scaled FP4 MMA computes (up to accumulation order) at bf16
speed: storage is 4.5 bits per value, the arithmetic is not faster than bf16.
Per 128-key tile: S = ΔS + deq(Q)·deq(K)ᵀ; online softmax with the running row max mapped to 448·6
(level 1); per 16-key group s_P = max P̃ / 6 rounded to E4M3, P̂ = E2M1(P̃ · (1/s)) (level 2; dividing by the
unrounded s as upstream, or by the rounded one with ``p_scale="rounded"``); P̂·s_P times deq(V) added to
an fp32 accumulator; the output rows are acc / l plus V's token mean (``v_smooth``; zeros otherwise).
Reference: :mod:`sage_compile.reference.fp4` (same tiling, BLOCK_N = 128).

Blackwell (sm_100 / sm_120, ``NATIVE``): both matmuls go to ``tl.dot_scaled`` on the packed E2M1 operands
with their E4M3 scales (P packed in registers), the same products and accumulation.
**Untested**: no Blackwell GPU here; the path is chosen by capability (:data:`NATIVE_FP4`) and only
compile-checked for sm_100 (tests/test_kernel_fp4_interpret.py). Triton 3.6 cannot build NVFP4
``dot_scaled`` for sm_90 (numerics.md §7.4), hence the manual dequantization there.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ...reference.fp4 import q_block_of
from .._common import (CAUSAL_CODES, EMULATE_FP8, cdiv, e2m1_code, e2m1_f16, output_and_mask, pow2, round_e2m1,
                       round_e2m1_pos, to_e4m3)

LOG2E = 1.4426950408889634
P_OFF = math.log2(448.0 * 6.0)
BLOCK_N = 128


def _native_fp4() -> bool:
    """Blackwell block-scaled FP4 MMA through ``tl.dot_scaled`` (sm_100 / sm_120; untested here)."""
    if EMULATE_FP8 or not torch.cuda.is_available() or not hasattr(tl, "dot_scaled"):
        return False
    return torch.cuda.get_device_capability()[0] in (10, 12)


NATIVE_FP4 = _native_fp4()


@triton.jit
def _packed(P, S, rows, col0, NROWS, NCOLS_P, sp, ss, R: tl.constexpr, C: tl.constexpr):
    """An (R, C) NVFP4 tile as stored: packed bytes P[rows, col0 : col0 + C/2] (uint8, two E2M1 codes,
    first in the low nibble) and its E4M3 scales S[rows, col0/8 ...] (R, C/16); zeros outside."""
    cols_p = col0 + tl.arange(0, C // 2)
    pk = tl.load(P + rows[:, None] * sp + cols_p[None, :], mask=(rows[:, None] < NROWS) & (cols_p[None, :] < NCOLS_P),
                 other=0)
    cs = col0 // 8 + tl.arange(0, C // 16)
    sc = tl.load(S + rows[:, None] * ss + cs[None, :], mask=(rows[:, None] < NROWS) & (cs[None, :] < NCOLS_P // 8),
                 other=0.0)
    return pk, sc


@triton.jit
def _deq(P, S, rows, col0, NROWS, NCOLS_P, sp, ss, R: tl.constexpr, C: tl.constexpr):
    """Dequantize an (R, C) NVFP4 tile (:func:`_packed`) to fp16 — exact: E2M1 x E4M3 products have at
    most 5 significant bits and lie in [2^-10, 2688] (the codes decoded from their bits, :func:`e2m1_f16`)."""
    pk, sc = _packed(P, S, rows, col0, NROWS, NCOLS_P, sp, ss, R, C)
    pk = pk.to(tl.int32)
    vals = tl.reshape(tl.join(e2m1_f16(pk & 15), e2m1_f16(pk >> 4)), (R, C))
    return tl.reshape(tl.reshape(vals, (R, C // 16, 16)) * sc.to(tl.float16)[:, :, None], (R, C))


@triton.jit
def _pack_e2m1(r, R: tl.constexpr, C: tl.constexpr):
    """Exact E2M1 values (R, C) fp32 -> (R, C/2) uint8, pairs along C, first in the low nibble."""
    lo, hi = tl.split(tl.reshape(e2m1_code(r), (R, C // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _mma_in(x, EMULATE: tl.constexpr):
    """fp16 tensor-core operand (exact for dequantized NVFP4 values and for dequantized P). The
    interpreter's 16-bit dot is not usable (it multiplies raw bits), so there the operands are fp32: the
    same exact values."""
    if EMULATE:
        y = x.to(tl.float32)
    else:
        y = x.to(tl.float16)
    return y


@triton.jit
def _delta_s(DS, m0, offs_n, LK, NBLK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr):
    """The (BLOCK_M, BLOCK_N) ΔS tile of query rows m0... (one fp32 row per QB queries), loaded once per
    row block and broadcast (so only the distinct rows move into the MMA layout)."""
    if QB < BLOCK_M:
        rb = m0 // QB + tl.arange(0, BLOCK_M // QB)
        d = tl.load(DS + rb[:, None] * LK + offs_n[None, :], mask=(rb[:, None] < NBLK) & (offs_n[None, :] < LK),
                    other=0.0)
        ds = tl.reshape(tl.broadcast_to(d[:, None, :], (BLOCK_M // QB, QB, BLOCK_N)), (BLOCK_M, BLOCK_N))
    else:
        d = tl.load(DS + (m0 // QB) * LK + offs_n, mask=offs_n < LK, other=0.0)
        ds = tl.broadcast_to(d[None, :], (BLOCK_M, BLOCK_N))
    return ds


@triton.jit
def _fwd_body(QP, QS, KP, KS, VP, VS, DS, VM, MASK, OUT, c,
              H, GROUP, LQ, LK, DP, DV, NK16, NBLK,
              smb, smh, smq, smk, sob, soh, son,
              CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, P_ROUNDED: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, P_OFF: tl.constexpr,
              EMULATE: tl.constexpr, QB: tl.constexpr = 128, NATIVE: tl.constexpr = False):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    bhk = b * (H // GROUP) + h // GROUP
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    if NATIVE:
        q_pk, q_sc = _packed(QP + bh * LQ * (DP // 2), QS + bh * LQ * (DP // 16), offs_m, 0, LQ, DP // 2, DP // 2,
                             DP // 16, BLOCK_M, BLOCK_D)
    else:
        q = _mma_in(_deq(QP + bh * LQ * (DP // 2), QS + bh * LQ * (DP // 16), offs_m, 0, LQ, DP // 2, DP // 2,
                         DP // 16, BLOCK_M, BLOCK_D), EMULATE)
    KP = KP + bhk * LK * (DP // 2)
    KS = KS + bhk * LK * (DP // 16)
    VP = VP + bhk * DP * (NK16 // 2)
    VS = VS + bhk * DP * (NK16 // 16)
    DS = DS + bh * NBLK * LK
    MASK = MASK + b * smb + h * smh
    rd = tl.arange(0, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    off = 0
    if CAUSAL == 2:
        off = LK - LQ
    hi = LK
    if CAUSAL != 0:
        hi = tl.minimum(LK, tl.maximum(0, m0 + BLOCK_M + off))
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ds = _delta_s(DS, m0, offs_n, LK, NBLK, BLOCK_M, BLOCK_N, QB)
        if NATIVE:  # block-scaled FP4 MMA (untested: Blackwell)
            k_pk, k_sc = _packed(KP, KS, offs_n, 0, LK, DP // 2, DP // 2, DP // 16, BLOCK_N, BLOCK_D)
            z = (ds + tl.dot_scaled(q_pk, q_sc, "e2m1", tl.trans(k_pk), k_sc, "e2m1")) * c
        else:
            k = _mma_in(_deq(KP, KS, offs_n, 0, LK, DP // 2, DP // 2, DP // 16, BLOCK_N, BLOCK_D), EMULATE)
            z = (ds + tl.dot(q, tl.trans(k))) * c
        keep = (offs_n[None, :] < LK) & (offs_m[:, None] >= 0)
        if CAUSAL == 1:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        if CAUSAL == 2:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + off)
        if MASK_KIND == 1:
            mk = tl.load(MASK + offs_m[:, None] * smq + offs_n[None, :] * smk,
                         mask=(offs_m[:, None] < LQ) & (offs_n[None, :] < LK), other=0)
            keep = keep & (mk != 0)
        if MASK_KIND == 2:
            mk = tl.load(MASK + offs_m[:, None] * smq + offs_n[None, :] * smk,
                         mask=(offs_m[:, None] < LQ) & (offs_n[None, :] < LK), other=0.0)
            z = z + mk.to(tl.float32) * 1.4426950408889634
        z = tl.where(keep, z, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(z - m_use[:, None] + P_OFF)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # two-level P quantization: per 16-key group, E4M3 scale of max/6, E2M1 values
        pg = tl.reshape(p, (BLOCK_M, BLOCK_N // 16, 16))
        sp = tl.math.div_rn(tl.max(pg, axis=2), tl.full((BLOCK_M, BLOCK_N // 16), 6.0, tl.float32))
        sp8 = to_e4m3(tl.minimum(sp, 448.0), EMULATE).to(tl.float32)
        if P_ROUNDED:
            div = sp8
        else:
            div = sp
        # P / s as P · (1/s), the IEEE reciprocal once per group (the Q/K/V quantizers' rule); 0 where s = 0
        inv = tl.where(div > 0, tl.math.div_rn(tl.full(div.shape, 1.0, tl.float32), tl.where(div > 0, div, 1.0)),
                       0.0)
        y = pg * inv[:, :, None]
        if NATIVE:  # P packed in registers, V as stored (packed along tokens): block-scaled FP4 MMA
            p_pk = _pack_e2m1(tl.reshape(round_e2m1(y, EMULATE), (BLOCK_M, BLOCK_N)), BLOCK_M, BLOCK_N)
            v_pk, v_sc = _packed(VP, VS, rd, n0 // 2, DP, NK16 // 2, NK16 // 2, NK16 // 16, BLOCK_D, BLOCK_N)
            pv = tl.dot_scaled(p_pk, to_e4m3(tl.minimum(sp, 448.0), EMULATE), "e2m1", tl.trans(v_pk), v_sc, "e2m1")
        else:
            pq = _mma_in(tl.reshape(round_e2m1_pos(y) * sp8[:, :, None], (BLOCK_M, BLOCK_N)), EMULATE)
            v = _mma_in(_deq(VP, VS, rd, n0 // 2, DP, NK16 // 2, NK16 // 2, NK16 // 16, BLOCK_D, BLOCK_N), EMULATE)
            pv = tl.dot(pq, tl.trans(v))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    vm = tl.load(VM + bhk * DV + rd, mask=rd < DV, other=0.0)  # V's token mean (zeros without v_smooth)
    o = tl.where(l_i[:, None] == 0.0, 0.0, acc / l_safe[:, None] + vm[None, :])
    tl.store(OUT + b * sob + h * soh + offs_m[:, None] * son + rd[None, :], o.to(OUT.dtype.element_ty),
             mask=(offs_m[:, None] < LQ) & (rd[None, :] < DV))


def _configs():
    return [triton.Config({"BLOCK_M": bm}, num_warps=w, num_stages=s)
            for bm, w, s in ((128, 8, 2), (128, 8, 3), (64, 4, 2), (64, 4, 3))]


_fwd = triton.autotune(configs=_configs(), key=["DP", "CAUSAL", "MASK_KIND", "P_ROUNDED", "QB"])(_fwd_body)


def attention(qp, qsc, kp, ksc, vp, vsc, ds, vbar, attn_mask: Optional[torch.Tensor], causal: str,
              scale: Optional[float], layout: str, out_dtype: torch.dtype, head_dim: int,
              p_scale: str = "unrounded", config: Optional[dict] = None,
              native: Optional[bool] = None) -> torch.Tensor:
    """Same contract as :func:`sage_compile.reference.fp4.attention` (inputs from ``quantize``).
    ``native``: force the ``tl.dot_scaled`` path on or off (default :data:`NATIVE_FP4`)."""
    b, hq, lq, dp2 = qp.shape
    hkv, lk = kp.shape[1], kp.shape[2]
    dp, nk16 = 2 * dp2, 2 * vp.shape[-1]
    c = (1.0 / math.sqrt(head_dim) if scale is None else float(scale)) * LOG2E
    qp, qsc, kp, ksc, vp, vsc, ds = (t.contiguous() for t in (qp, qsc, kp, ksc, vp, vsc, ds))
    vbar = vbar.float().contiguous()
    out, (sob, soh, son), mask, kind, ms = output_and_mask(b, hq, lq, lk, head_dim, layout, out_dtype, attn_mask,
                                                           qp.device, ds)
    block_d = max(16, pow2(dp))
    args = (qp, qsc, kp, ksc, vp, vsc, ds, vbar, mask, out, c, hq, hq // hkv, lq, lk, dp, head_dim, nk16, ds.shape[2],
            *ms, sob, soh, son)
    meta = dict(CAUSAL=CAUSAL_CODES[causal], MASK_KIND=kind, P_ROUNDED=p_scale == "rounded", BLOCK_N=BLOCK_N,
                BLOCK_D=block_d, P_OFF=P_OFF, EMULATE=EMULATE_FP8, QB=q_block_of(lq, ds.shape[2]),
                NATIVE=NATIVE_FP4 if native is None else native)
    if config is not None:
        bm = config["BLOCK_M"]
        _fwd_body[(cdiv(lq, bm), b * hq)](*args, **meta, BLOCK_M=bm, num_warps=config.get("num_warps", 4),
                                          num_stages=config.get("num_stages", 2))
    else:
        _fwd[lambda m: (cdiv(lq, m["BLOCK_M"]), b * hq)](*args, **meta)
    return out
