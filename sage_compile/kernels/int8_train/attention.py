"""Triton forward and backward of ``int8_train`` (SageBwd numerics; shared/docs/numerics.md §4).

Forward, per (batch, head, BLOCK_M queries): S = int8 q̂·k̂ᵀ (exact int32) times the per-block scales
(Q: 128 tokens, K: 64); online softmax in the exp2 domain over 64-key tiles; P̃ quantized per token in
each tile (δ_P = row max / 127) and multiplied with the INT8 V tile (exact int32); O and the LSE saved.

Backward, FlashAttention-2 style in two kernels that recompute P = exp(S − LSE) from q̂, k̂:
a dK/dV kernel per key block (looping over the query heads of its GQA group and the query blocks):
dV += ψ(P)ᵀ·ψ(dO), dK += ψ(dS)ᵀ·Q̂ (INT8, int32); ``_bwd_dq`` per 128-query block: dQ += ψ(dS)·K̂ plus
rowsum(ψ(dS))·μ_K (the K-smoothing correction). dP = dO·Vᵀ in 16-bit with fp32 accumulation, V̂
dequantized once to the 16-bit type as the reference does; dS = P∘(dP − rowsum(dO∘O)). ψ: one INT8
scale per (128 queries x 64 keys) tile of P and dS and per (128 x D) tile of dO, tiles aligned at 0 as
in the reference, so kernels and reference quantize the same sets (``_bwd_dkdv``: 64 keys x 128-query
tiles); with ``psi="split"`` one scale per key over each 64-query block (``SPLIT_M``) for P and dS in
dV / dK (``_bwd_dkdv_split``: 128 keys x 64-query tiles), and per query row (over the 64-key tile) for dS
in dQ. Every tile is laid out so that the program's 8 warps split its rows: none computes a replica.
Masks: causal (top_left / bottom_right) from indices, bool / additive masks read in-kernel; a head-shared
bool mask that is exactly causal (or all true) is recognised on the device and run as the causal (or
unmasked) kernel, without a host sync (:func:`_mask_plan`); on the CUDA kernels also one that is causal and / or
key padding (each batch's key range read by the kernels).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ..._tracing import in_graph
from ...policy import MAX_HEAD_DIM_TRAIN_CUDA as MAX_HEAD_DIM  # sites above it stay SDPA
from ...reference.int8_train import SPLIT_M
from ...reference.layout import token_major_empty
from .._common import CAUSAL_CODES, EMULATE_FP8, bhn_strides, cdiv, launch, mask_view, pow2, rne
from .quantize import BLOCK_KV, BLOCK_Q, copy_tokens_last, quantize_vt, store_tokens_last, tokens_last

LOG2E = 1.4426950408889634
_DT16 = {torch.float32: torch.bfloat16, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16}


@triton.jit
def _masked(z, qi, kj, MASK, mbase, smq, smk, LQ, LK, coff, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
            EVEN_N: tl.constexpr):
    """Log2 logits ``z`` of a (queries x keys) tile with every invisible key set to -inf. ``qi`` / ``kj``:
    the query (column vector) / key (row vector) indices: keys out of bounds (checked unless ``EVEN_N``:
    LK is a multiple of the key tile), causally hidden (key > query + coff) or masked out (bool).
    Additive masks (natural-log units) are added. Query rows out of bounds or without any visible key are
    the callers' (never stored, or P = 0 through their LSE: :func:`_lse2`)."""
    if MASK_KIND == 2:
        mk = tl.load(MASK + mbase + qi * smq + kj * smk, mask=(qi < LQ) & (kj < LK), other=0.0)
        z = z + mk.to(tl.float32) * 1.4426950408889634
    if MASK_KIND == 1:
        mk = tl.load(MASK + mbase + qi * smq + kj * smk, mask=(qi < LQ) & (kj < LK), other=0)
        z = tl.where(mk != 0, z, float("-inf"))
    if CAUSAL != 0:
        z = tl.where(kj <= qi + coff, z, float("-inf"))
    if not EVEN_N:
        z = tl.where(kj < LK, z, float("-inf"))
    return z


@triton.jit
def _lse2(lse):
    """The saved LSE in log2 units for P = exp2(z − lse2); a row without keys (LSE −inf) gets +inf, so its
    P is exp2(−inf) = 0 everywhere without a per-element test."""
    return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


@triton.jit
def _to_i8(y, EMULATE: tl.constexpr):
    """fp32 values with |y| <= 127 (plus rounding) -> int8, round to nearest even. On the GPU one FADD
    per value, not an F2I (``cvt.rni``: a conversion, 16 per clock and SM; 1.09-1.20x on the H200,
    ``benchmarks/results/ab_kernels_run40_*``): the low byte of the bits of
    y + 1.5·2^23 is RNE(y) (``add.rn``, so it is never contracted with the scaling multiply); an
    amax-scaled value never rounds past 127 (|x|·RN(127/amax) <= 127·(1+2^-23)), so no clamp is needed;
    the interpreter path rounds in fp32 and clamps."""
    if EMULATE:
        r = tl.minimum(tl.maximum(rne(y, EMULATE), -127.0), 127.0).to(tl.int8)
    else:
        r = tl.inline_asm_elementwise("add.rn.f32 $0, $1, 0f4B400000;", "=r,r", [y], dtype=tl.int32,
                                      is_pure=True, pack=1).to(tl.int8)
    return r


@triton.jit
def _psi(x, EMULATE: tl.constexpr):
    """ψ: INT8 values of a whole tile with one scale (amax / 127); returns (int8 tile, scale)."""
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    r = tl.where(amax > 0, 127.0 / amax, 0.0)
    return _to_i8(x * r, EMULATE), amax / 127.0


@triton.jit
def _psi_rows(x, EMULATE: tl.constexpr):
    """ψ with one scale per row (row amax / 127): (int8 tile, scales (rows,)). Row scales factor out of
    an integer dot whose output rows they index (``psi="split"``, dS in dQ)."""
    amax = tl.max(tl.abs(x), axis=1)
    r = tl.where(amax > 0, 127.0 / amax, 0.0)
    return _to_i8(x * r[:, None], EMULATE), amax / 127.0


@triton.jit
def _mm16(x, EMULATE: tl.constexpr):
    """A 16-bit dP operand; the interpreter's bf16 dot multiplies raw bits, so there the (already
    rounded, hence identical) values go in as fp32."""
    if EMULATE:
        x = x.to(tl.float32)
    return x


@triton.jit
def _tile_mask(rows, LIMIT, rd, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """In-bounds mask of a (rows x BLOCK_D) tile: rows below LIMIT, and channels below D only where the
    tile is wider than the head (a mask that is constant along the channels keeps the loads vectorised)."""
    m = rows[:, None] < LIMIT
    if BLOCK_D != D:
        m = m & (rd[None, :] < D)
    return m


@triton.jit
def _query_tile(HQ, GROUP, LQ, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's BLOCK_M queries of one (batch, query head): ``(bh, b, h, bhk (its kv head), query offsets,
    channel offsets, in-bounds query mask, in-bounds tile mask)``; q̂'s tile is :func:`_rows` of them. (The
    index helpers take no pointer: torch's analysis of what a traced, ``wrap_triton``, kernel writes follows a
    store's offsets back into every argument of the calls that made them, and takes a tensor handed to such a
    call for written: then Inductor clones it for each launch.)"""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // HQ, bh % HQ
    bhk = b * (HQ // GROUP) + h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    qin = offs_m < LQ
    inb = _tile_mask(offs_m, LQ, rd, D, BLOCK_D)
    return bh, b, h, bhk, offs_m, rd, qin, inb


@triton.jit
def _rows(X, bh, rows, rd, N, D: tl.constexpr, inb, other):
    """Rows ``rows`` x channels ``rd`` of (batch x head) ``bh`` of a contiguous (B*H, N, D) X (``other`` out of
    bounds)."""
    return tl.load(X + (bh * N + rows[:, None]) * D + rd[None, :], mask=inb, other=other)


@triton.jit
def _fwd_kernel(Q8, QS, K8, KS, V8T, VS, MASK, GATE, WANT, OUT, LSE, c, smb, smh, smq, smk, sob, soh, son,
                HQ, GROUP, LQ, LK, D: tl.constexpr, NQB, NKB,
                CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_N: tl.constexpr, EMULATE: tl.constexpr):
    if GATED:  # (see _gate)
        if tl.load(GATE) != WANT:
            return
    c = tl.cast(c, tl.float32)  # Inductor hands a Python float over as fp64
    bh, b, h, bhk, offs_m, rd, min_, inb = _query_tile(HQ, GROUP, LQ, D, BLOCK_M, BLOCK_D)
    q = _rows(Q8, bh, offs_m, rd, LQ, D, inb, 0)
    pid_m = tl.program_id(0)
    qsc = tl.load(QS + bh * NQB + offs_m // 128, mask=min_, other=0.0) * c
    coff = LK - LQ if CAUSAL == 2 else 0
    hi = LK
    if CAUSAL != 0:
        hi = tl.minimum(LK, tl.maximum(0, (pid_m + 1) * BLOCK_M + coff))
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    mbase = b * smb + h * smh
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kv = _tile_mask(offs_n, LK, rd, D, BLOCK_D)
        k = tl.load(K8 + (bhk * LK + offs_n[:, None]) * D + rd[None, :], mask=kv, other=0)
        v = tl.load(V8T + (bhk * D + rd[None, :]) * LK + offs_n[:, None], mask=kv, other=0)  # tokens contiguous
        ksc = tl.load(KS + bhk * NKB + n0 // BLOCK_N)
        vsc = tl.load(VS + bhk * NKB + n0 // BLOCK_N)
        s = tl.dot(q, tl.trans(k), out_dtype=tl.int32)
        z = s.to(tl.float32) * (qsc * ksc)[:, None]
        # rows past LQ compute finite garbage that is never stored
        z = _masked(z, offs_m[:, None], offs_n[None, :], MASK, mbase, smq, smk, LQ, LK, coff, CAUSAL, MASK_KIND,
                    EVEN_N)
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(z - m_safe[:, None])
        pmax = tl.max(p, axis=1)
        r = tl.where(pmax > 0, 127.0 / pmax, 0.0)
        p8 = _to_i8(p * r[:, None], EMULATE)
        pv = tl.dot(p8, v, out_dtype=tl.int32)
        acc = acc * alpha[:, None] + pv.to(tl.float32) * ((pmax / 127.0) * vsc)[:, None]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    out = tl.where(empty[:, None], 0.0, out)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634)
    tl.store(OUT + b * sob + h * soh + offs_m[:, None] * son + rd[None, :], out.to(OUT.dtype.element_ty), mask=inb)
    tl.store(LSE + bh * LQ + offs_m, lse, mask=min_)


@triton.jit
def _bwd_prep(O, DO, LSE, DELTA, DO16, DO8T, SDO, LSE2, Q8, Q8T, K8, K8T, V8, VS, V16, sob, soh, son, sdb, sdh, sdn,
              BHQ, BHKV, HQ, LQ, LK, D: tl.constexpr, NQB, NKB, J0, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
              V_BLOCK: tl.constexpr, RNE_BF16: tl.constexpr, EMULATE: tl.constexpr, STORE_DO16: tl.constexpr,
              PART: tl.constexpr):
    """What the backward's kernels read besides the forward's operands, in one launch. Program (j, blk), j < BHQ,
    of the 128-row block ``blk`` of (batch x query head) j: delta = rowsum(dO∘O); dO as 16-bit HND (the dP
    operand) and ψ(dO) per 128-row block, stored transposed (B, H, D, N): the K-major operand of
    dV = ψ(P)ᵀ·ψ(dO); the LSE in log2 units as the CUDA kernels read it (:func:`_lse2`; the Triton kernels take it
    from the LSE themselves). BHQ <= j < 2 BHQ: that block of q̂ transposed (the K-major operand of
    dK = ψ(dS)ᵀ·Q̂). Then per V_BLOCK keys (V's scale block) of a (batch x kv head): k̂ transposed (of
    dQ = ψ(dS)·K̂), and in the last BHKV rows of programs V̂ dequantized to the 16-bit type (the dP operand, as the
    reference: each value times its block's scale, rounded once; ``RNE_BF16``: to bf16's bits by hand first, for
    the interpreter, whose cast to bf16 truncates). ``STORE_DO16`` False: dO is read where the kernels read the
    16-bit copy (already HND, contiguous, of that type), so none is written. ``PART`` 0 all of it; 1 dO's programs
    alone (j < BHQ), 2 the others alone (program j - J0 taking j's work, J0 = BHQ): each its own launch, compiled
    without the other's code."""
    j, blk = tl.program_id(0) + J0, tl.program_id(1)
    offs = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    if j < BHQ:
        if PART != 2 and blk < NQB:
            bh = j.to(tl.int64)  # (64-bit offsets: B*H*N*D may pass 2^31)
            b, h = bh // HQ, bh % HQ
            inb = _tile_mask(offs, LQ, rd, D, BLOCK_D)
            o = tl.load(O + b * sob + h * soh + offs[:, None] * son + rd[None, :], mask=inb, other=0.0).to(tl.float32)
            do = tl.load(DO + b * sdb + h * sdh + offs[:, None] * sdn + rd[None, :], mask=inb, other=0.0)
            dof = do.to(tl.float32)
            tl.store(DELTA + bh * LQ + offs, tl.sum(dof * o, axis=1), mask=offs < LQ)
            tl.store(LSE2 + bh * LQ + offs, _lse2(tl.load(LSE + bh * LQ + offs, mask=offs < LQ)), mask=offs < LQ)
            if STORE_DO16:
                tl.store(DO16 + (bh * LQ + offs[:, None]) * D + rd[None, :], do.to(DO16.dtype.element_ty), mask=inb)
            d8, sdo = _psi(dof, EMULATE)
            store_tokens_last(DO8T + bh * D * LQ, d8, offs, rd, LQ, inb)
            tl.store(SDO + bh * NQB + blk, sdo)
    elif PART == 1:
        pass
    elif j < 2 * BHQ:
        if blk < NQB:
            bh = (j - BHQ).to(tl.int64)
            inb = _tile_mask(offs, LQ, rd, D, BLOCK_D)
            copy_tokens_last(Q8, Q8T, bh, offs, rd, LQ, D, inb)
    elif j < 2 * BHQ + BHKV:
        if blk * V_BLOCK < LK:
            bh = (j - 2 * BHQ).to(tl.int64)
            rk = blk * V_BLOCK + tl.arange(0, V_BLOCK)
            inb = _tile_mask(rk, LK, rd, D, BLOCK_D)
            copy_tokens_last(K8, K8T, bh, rk, rd, LK, D, inb)
    else:
        if blk * V_BLOCK < LK:
            bh = (j - 2 * BHQ - BHKV).to(tl.int64)
            rk = blk * V_BLOCK + tl.arange(0, V_BLOCK)
            inb = _tile_mask(rk, LK, rd, D, BLOCK_D)
            off = (bh * LK + rk[:, None]) * D + rd[None, :]
            v = tl.load(V8 + off, mask=inb, other=0).to(tl.float32) * tl.load(VS + bh * NKB + blk)
            if RNE_BF16:
                bits = v.to(tl.int32, bitcast=True)
                v = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
            tl.store(V16 + off, v.to(V16.dtype.element_ty), mask=inb)


# _bwd_prep's launch: one (PREP_WARPS warps) or, from PREP_SPLIT_MIN_ELEMENTS values of dO (None: never), two, dO's
# programs (PREP_WARPS_DO) and the transposes and V̂'s (PREP_WARPS_REST), each compiled without the other's code. H100 run 186
# (benchmarks/bench_train_prep.py, B·N = 32K, 16 heads, hd128, same bits, GPU ms at 2K / 16K): one launch of 8 warps
# with dO copied 0.484 / 0.482, with dO read in place 0.333 / 0.307, in two launches of 8 and 4 warps 0.294 / 0.292
# (2.7-2.8 TB/s of its DRAM floor; 16 warps for dO's part 0.299). Offline (Triton 3.9, sm_90), one launch of 8 warps
# takes 254 registers a thread: one program per SM. Split from 2^25 values of dO, where the ~0.04 ms saved at 2^26
# (run 186) outweighs the second launch's host time (8-24 us a Triton launch, runs 125 / 139)
PREP_WARPS, PREP_WARPS_DO, PREP_WARPS_REST = 8, 8, 4
PREP_SPLIT_MIN_ELEMENTS = 1 << 25


def reads_do_in_place(do: torch.Tensor, layout: str, dtype16: torch.dtype) -> bool:
    """Whether the backward's kernels can read ``do`` as their 16-bit dO operand (HND, contiguous, ``dtype16``, its
    first value 16-byte aligned as the TMA needs: storage offset a multiple of 8 values), so that no copy is made."""
    off = do.storage_offset()
    return (layout == "HND" and do.dtype == dtype16 and do.is_contiguous() and isinstance(off, int) and off % 8 == 0)


def bwd_prep(q8, k8, v8, vs, o, lse, do, layout: str, dtype16: torch.dtype) -> dict:
    """The backward's derived operands (:func:`_bwd_prep`, one launch or two: ``PREP_SPLIT_MIN_ELEMENTS``) of
    contiguous HND
    ``q8``, ``k8``, ``v8`` (INT8 (B, H, N, D)), ``vs`` (V's 64-key block scales), O and dO in ``layout``, the LSE
    (B, Hq, Nq): ``delta``, ``lse2`` (B, Hq, Nq) fp32, ``do16`` (B, Hq, Nq, D) in ``dtype16`` (``do`` itself where
    :func:`reads_do_in_place`), ``do8t`` (B, Hq, D, Nq) int8 with ``sdo`` (B, Hq, ceil(Nq/128)) fp32, ``q8t``
    (B, Hq, D, Nq), ``k8t`` (B, Hkv, D, Lk) int8 and ``v16`` (B, Hkv, Nk, D) in ``dtype16``."""
    b, hq, lq, d = q8.shape
    hkv, lk = k8.shape[1], k8.shape[2]
    dev, i8, f32 = q8.device, torch.int8, torch.float32
    nqb = cdiv(lq, BLOCK_Q)
    in_place = reads_do_in_place(do, layout, dtype16)
    r = dict(delta=torch.empty((b, hq, lq), dtype=f32, device=dev), lse2=torch.empty((b, hq, lq), dtype=f32, device=dev),
             do16=do if in_place else torch.empty((b, hq, lq, d), dtype=dtype16, device=dev),
             do8t=torch.empty((b, hq, d, lq), dtype=i8, device=dev), sdo=torch.empty((b, hq, nqb), dtype=f32, device=dev),
             q8t=torch.empty((b, hq, d, lq), dtype=i8, device=dev), k8t=torch.empty((b, hkv, d, lk), dtype=i8, device=dev),
             v16=torch.empty((b, hkv, lk, d), dtype=dtype16, device=dev))
    nvb = vs.shape[-1]
    args = (o, do, lse, r["delta"], r["do16"], r["do8t"], r["sdo"], r["lse2"], q8, r["q8t"], k8, r["k8t"], v8, vs,
            r["v16"], *bhn_strides(o, layout), *bhn_strides(do, layout), b * hq, b * hkv, hq, lq, lk, d, nqb, nvb)
    meta = dict(BLOCK_M=BLOCK_Q, BLOCK_D=max(16, pow2(d)), V_BLOCK=BLOCK_KV, RNE_BF16=EMULATE_FP8 and dtype16 == torch.bfloat16,
                EMULATE=EMULATE_FP8, STORE_DO16=not in_place)
    split_from, n = PREP_SPLIT_MIN_ELEMENTS, do.numel()
    if split_from is not None and isinstance(n, int) and n >= split_from:
        parts = [(1, 0, (b * hq, nqb), PREP_WARPS_DO), (2, b * hq, (b * (hq + 2 * hkv), max(nqb, nvb)), PREP_WARPS_REST)]
    else:
        parts = [(0, 0, (b * (2 * hq + 2 * hkv), max(nqb, nvb)), PREP_WARPS)]
    for part, j0, grid, warps in parts:
        if grid[0] and grid[1]:
            launch(_bwd_prep, grid)(*args, j0, **meta, PART=part, num_warps=warps)
    return r


@triton.jit
def _key_block(HQ, GROUP, LQ, LK, D: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """This dK/dV program's BLOCK_N keys of one (batch, kv head): ``(b, kv head, bhk, key offsets, channel offsets,
    in-bounds tile mask, causal offset, first query block)`` (no pointer in: see :func:`_query_tile`)."""
    pid_n, bhk = tl.program_id(0), tl.program_id(1)
    HKV = HQ // GROUP
    b, hk = bhk // HKV, bhk % HKV
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    kv = _tile_mask(offs_n, LK, rd, D, BLOCK_D)
    coff = LK - LQ if CAUSAL == 2 else 0
    lo = 0
    if CAUSAL != 0:
        lo = (tl.maximum(0, n0 - coff) // BLOCK_M) * BLOCK_M
    return b, hk, bhk, offs_n, rd, kv, coff, lo


@triton.jit
def _query_step(Q8, QS, LSE, DELTA, bh, m0, LQ, NQB, rd, D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """One query step of a dK/dV program: ``(query offsets, in-bounds query mask, tile mask, q̂ tile, its
    raw scale (Q and dO scales: 128 tokens each), LSE in log2 units (rows past LQ: P = 0), delta)``."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    qin = offs_m < LQ
    inb = _tile_mask(offs_m, LQ, rd, D, BLOCK_D)
    q = tl.load(Q8 + (bh * LQ + offs_m[:, None]) * D + rd[None, :], mask=inb, other=0)
    qraw = tl.load(QS + bh * NQB + m0 // 128)
    lse2 = _lse2(tl.load(LSE + bh * LQ + offs_m, mask=qin, other=float("-inf")))
    delta = tl.load(DELTA + bh * LQ + offs_m, mask=qin, other=0.0)
    return offs_m, qin, inb, q, qraw, lse2, delta


@triton.jit
def _bwd_dkdv(Q8, Q8T, QS, K8, KS, V16, MASK, GATE, WANT, LSE, DELTA, DO16, DO8T, SDO, DK, DV, c, sm,
              smb, smh, smq, smk, skb, skh, skn, HQ, GROUP, LQ, LK, D: tl.constexpr, NQB, NKB,
              CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_N: tl.constexpr, EMULATE: tl.constexpr):
    """dK, dV of one BLOCK_N (64) -key block with ``psi="tile"`` (one scale per 128-query x 64-key tile of
    P and dS). Tiles are (queries x keys), BLOCK_M = 128 queries as rows, so the warps of the program split
    the rows and none computes a replica (a 64-row tile over 8 warps would be computed twice); Pᵀ and dSᵀ
    go to the INT8 dots through shared memory."""
    if GATED:
        if tl.load(GATE) != WANT:
            return
    c, sm = tl.cast(c, tl.float32), tl.cast(sm, tl.float32)  # Inductor hands Python floats over as fp64
    b, hk, bhk, offs_n, rd, kv, coff, lo = _key_block(HQ, GROUP, LQ, LK, D, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D)
    k = _rows(K8, bhk, offs_n, rd, LK, D, kv, 0)
    v16 = _mm16(_rows(V16, bhk, offs_n, rd, LK, D, kv, 0.0), EMULATE)
    ksc = tl.load(KS + bhk * NKB + tl.program_id(0))
    # transposed once here, so their shared-memory copies are made once, not per query block
    kT, v16T = tl.trans(k), tl.trans(v16)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * HQ + h
        mbase = b * smb + h * smh
        for m0 in range(lo, LQ, BLOCK_M):
            offs_m, qin, inb, q, qraw, lse2, delta = _query_step(Q8, QS, LSE, DELTA, bh, m0, LQ, NQB, rd, D, BLOCK_M,
                                                                 BLOCK_D)
            z = tl.dot(q, kT, out_dtype=tl.int32).to(tl.float32) * (qraw * c * ksc)
            z = _masked(z, offs_m[:, None], offs_n[None, :], MASK, mbase, smq, smk, LQ, LK, coff, CAUSAL, MASK_KIND,
                        EVEN_N)
            p = tl.math.exp2(z - lse2[:, None])
            do8 = tl.load(DO8T + (bh * D + rd[None, :]) * LQ + offs_m[:, None], mask=inb, other=0)
            sdo = tl.load(SDO + bh * NQB + m0 // 128)
            p8, sp = _psi(p, EMULATE)
            dv += tl.dot(tl.trans(p8), do8, out_dtype=tl.int32).to(tl.float32) * (sp * sdo)
            do16 = tl.load(DO16 + (bh * LQ + offs_m[:, None]) * D + rd[None, :], mask=inb, other=0.0)
            dp = tl.dot(_mm16(do16, EMULATE), v16T)
            qt = tl.load(Q8T + (bh * D + rd[None, :]) * LQ + offs_m[:, None], mask=inb, other=0)
            ds = p * (dp - delta[:, None])
            ds8, sds = _psi(ds, EMULATE)
            dk += tl.dot(tl.trans(ds8), qt, out_dtype=tl.int32).to(tl.float32) * (sds * qraw)
    optr = b * skb + hk * skh + offs_n[:, None] * skn + rd[None, :]
    tl.store(DK + optr, (dk * sm).to(DK.dtype.element_ty), mask=kv)
    tl.store(DV + optr, dv.to(DV.dtype.element_ty), mask=kv)


@triton.jit
def _bwd_dkdv_split(Q8, Q8T, QS, K8, KS, V16, MASK, GATE, WANT, LSE, DELTA, DO16, DO8T, SDO, DK, DV, c, sm,
                    smb, smh, smq, smk, skb, skh, skn, HQ, GROUP, LQ, LK, D: tl.constexpr, NQB, NKB,
                    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_N: tl.constexpr, EMULATE: tl.constexpr,
                    PART: tl.constexpr = 0):
    """dK, dV of one BLOCK_N (128) -key block with ``psi="split"``: tiles are (keys x queries), BLOCK_M
    (64) queries a step, so each warpgroup owns 64 keys, ψ(P) and ψ(dS) (one scale per key over the 64
    queries, ``SPLIT_M``) reduce inside a warp, and Pᵀ, dSᵀ are the INT8 dots' A operands as they are.
    dK and dV are accumulated as two channel halves each, so an INT8 dot's int32 product is half a tile
    (the registers of a whole one would spill). ``PART`` 0 computes both, 1 only dV, 2 only dK (two
    launches that each recompute S and P: :data:`DKDV_TWO_PASS`)."""
    if GATED:
        if tl.load(GATE) != WANT:
            return
    c, sm = tl.cast(c, tl.float32), tl.cast(sm, tl.float32)  # Inductor hands Python floats over as fp64
    HALF: tl.constexpr = BLOCK_D // 2
    b, hk, bhk, offs_n, rd, kv, coff, lo = _key_block(HQ, GROUP, LQ, LK, D, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D)
    k = _rows(K8, bhk, offs_n, rd, LK, D, kv, 0)
    v16 = _mm16(_rows(V16, bhk, offs_n, rd, LK, D, kv, 0.0), EMULATE)
    r0 = tl.arange(0, HALF)
    r1 = HALF + r0
    ksc = tl.load(KS + bhk * NKB + offs_n // 64, mask=offs_n < LK, other=0.0) * c  # K scales: 64 tokens each
    dk0 = tl.zeros((BLOCK_N, HALF), tl.float32)
    dk1 = tl.zeros((BLOCK_N, HALF), tl.float32)
    dv0 = tl.zeros((BLOCK_N, HALF), tl.float32)
    dv1 = tl.zeros((BLOCK_N, HALF), tl.float32)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * HQ + h
        mbase = b * smb + h * smh
        for m0 in range(lo, LQ, BLOCK_M):
            offs_m, qin, inb, q, qraw, lse2, delta = _query_step(Q8, QS, LSE, DELTA, bh, m0, LQ, NQB, rd, D, BLOCK_M,
                                                                 BLOCK_D)
            in0 = _tile_mask(offs_m, LQ, r0, D, BLOCK_D)
            in1 = _tile_mask(offs_m, LQ, r1, D, BLOCK_D)
            zt = tl.dot(k, tl.trans(q), out_dtype=tl.int32).to(tl.float32) * (ksc * qraw)[:, None]
            zt = _masked(zt, offs_m[None, :], offs_n[:, None], MASK, mbase, smq, smk, LQ, LK, coff, CAUSAL,
                         MASK_KIND, EVEN_N)
            pt = tl.math.exp2(zt - lse2[None, :])
            if PART != 2:
                sdo = tl.load(SDO + bh * NQB + m0 // 128)
                p8, sp = _psi_rows(pt, EMULATE)
                sv = (sp * sdo)[:, None]
                do8 = tl.load(DO8T + (bh * D + r0[None, :]) * LQ + offs_m[:, None], mask=in0, other=0)
                dv0 += tl.dot(p8, do8, out_dtype=tl.int32).to(tl.float32) * sv
                do8 = tl.load(DO8T + (bh * D + r1[None, :]) * LQ + offs_m[:, None], mask=in1, other=0)
                dv1 += tl.dot(p8, do8, out_dtype=tl.int32).to(tl.float32) * sv
            if PART != 1:
                do16 = tl.load(DO16 + (bh * LQ + offs_m[:, None]) * D + rd[None, :], mask=inb, other=0.0)
                dpt = tl.dot(v16, tl.trans(_mm16(do16, EMULATE)))
                ds8, sds = _psi_rows(pt * (dpt - delta[None, :]), EMULATE)
                sk = (sds * qraw)[:, None]
                qt = tl.load(Q8T + (bh * D + r0[None, :]) * LQ + offs_m[:, None], mask=in0, other=0)
                dk0 += tl.dot(ds8, qt, out_dtype=tl.int32).to(tl.float32) * sk
                qt = tl.load(Q8T + (bh * D + r1[None, :]) * LQ + offs_m[:, None], mask=in1, other=0)
                dk1 += tl.dot(ds8, qt, out_dtype=tl.int32).to(tl.float32) * sk
    optr = b * skb + hk * skh + offs_n[:, None] * skn
    st0 = _tile_mask(offs_n, LK, r0, D, BLOCK_D)
    st1 = _tile_mask(offs_n, LK, r1, D, BLOCK_D)
    if PART != 1:
        tl.store(DK + optr + r0[None, :], (dk0 * sm).to(DK.dtype.element_ty), mask=st0)
        tl.store(DK + optr + r1[None, :], (dk1 * sm).to(DK.dtype.element_ty), mask=st1)
    if PART != 2:
        tl.store(DV + optr + r0[None, :], dv0.to(DV.dtype.element_ty), mask=st0)
        tl.store(DV + optr + r1[None, :], dv1.to(DV.dtype.element_ty), mask=st1)


@triton.jit
def _bwd_dq(Q8, QS, K8, K8T, KS, V16, KMEAN, MASK, GATE, WANT, LSE, DELTA, DO16, DQ, c, sm,
            smb, smh, smq, smk, sqb, sqh, sqn, HQ, GROUP, LQ, LK, D: tl.constexpr, NQB, NKB,
            CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PSI_ROWS: tl.constexpr, EVEN_N: tl.constexpr,
            EMULATE: tl.constexpr):
    if GATED:
        if tl.load(GATE) != WANT:
            return
    c, sm = tl.cast(c, tl.float32), tl.cast(sm, tl.float32)  # Inductor hands Python floats over as fp64
    bh, b, h, bhk, offs_m, rd, qin, inb = _query_tile(HQ, GROUP, LQ, D, BLOCK_M, BLOCK_D)
    q = _rows(Q8, bh, offs_m, rd, LQ, D, inb, 0)
    pid_m = tl.program_id(0)
    qsc = tl.load(QS + bh * NQB + pid_m) * c
    lse2 = _lse2(tl.load(LSE + bh * LQ + offs_m, mask=qin, other=float("-inf")))
    delta = tl.load(DELTA + bh * LQ + offs_m, mask=qin, other=0.0)
    do16 = _mm16(tl.load(DO16 + (bh * LQ + offs_m[:, None]) * D + rd[None, :], mask=inb, other=0.0), EMULATE)
    coff = LK - LQ if CAUSAL == 2 else 0
    hi = LK
    if CAUSAL != 0:
        hi = tl.minimum(LK, tl.maximum(0, (pid_m + 1) * BLOCK_M + coff))
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    rs = tl.zeros((BLOCK_M,), tl.float32)
    mbase = b * smb + h * smh
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kv = _tile_mask(offs_n, LK, rd, D, BLOCK_D)
        k = tl.load(K8 + (bhk * LK + offs_n[:, None]) * D + rd[None, :], mask=kv, other=0)
        v16 = tl.load(V16 + (bhk * LK + offs_n[:, None]) * D + rd[None, :], mask=kv, other=0.0)
        ksc = tl.load(KS + bhk * NKB + n0 // BLOCK_N)
        z = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32) * (qsc * ksc)
        z = _masked(z, offs_m[:, None], offs_n[None, :], MASK, mbase, smq, smk, LQ, LK, coff, CAUSAL, MASK_KIND,
                    EVEN_N)
        p = tl.math.exp2(z - lse2[:, None])
        dp = tl.dot(do16, tl.trans(_mm16(v16, EMULATE)))
        kt = tl.load(K8T + (bhk * D + rd[None, :]) * LK + offs_n[:, None], mask=kv, other=0)
        if PSI_ROWS:  # one scale per query row in this key tile
            ds8, sds = _psi_rows(p * (dp - delta[:, None]), EMULATE)
            dq += tl.dot(ds8, kt, out_dtype=tl.int32).to(tl.float32) * (sds * ksc)[:, None]
        else:
            ds8, sds = _psi(p * (dp - delta[:, None]), EMULATE)
            dq += tl.dot(ds8, kt, out_dtype=tl.int32).to(tl.float32) * (sds * ksc)
        rs += tl.sum(ds8.to(tl.int32), axis=1).to(tl.float32) * sds  # exact integer row sums: one I2F per row
    mu = tl.load(KMEAN + bhk * D + rd, mask=rd < D, other=0.0)
    dq = (dq + rs[:, None] * mu[None, :]) * sm
    tl.store(DQ + b * sqb + h * sqh + offs_m[:, None] * sqn + rd[None, :], dq.to(DQ.dtype.element_ty), mask=inb)


# ------------------------------------------------------------------------------------------ host side
_FWD_DEFAULT = dict(BLOCK_M=128, num_warps=8, num_stages=2)
_BWD_DEFAULT = dict(num_warps=8, num_stages=2)


def _fwd_configs():
    return [triton.Config(dict(BLOCK_M=m), num_warps=w, num_stages=s)
            for m, w, s in ((128, 8, 2), (128, 8, 3), (64, 4, 2), (64, 4, 3), (128, 4, 2))]


def _bwd_configs():
    return [triton.Config({}, num_warps=w, num_stages=s) for w, s in ((8, 2), (8, 1), (4, 2), (8, 3))]


_fwd_tuned = triton.autotune(configs=_fwd_configs(), key=["D", "CAUSAL", "MASK_KIND", "BLOCK_D", "EVEN_N"])(_fwd_kernel)
_BWD_KEY = ["D", "CAUSAL", "MASK_KIND", "BLOCK_D", "EVEN_N"]
_dkdv_tuned = triton.autotune(configs=_bwd_configs(), key=_BWD_KEY)(_bwd_dkdv)
# (keys x queries) tiles: 128 keys on 8 warps (one warpgroup per 64 keys), or 64 keys on 4 warps (two
# programs fit an SM: 107 KB of shared memory); the key block is not part of the numerics (per-key scales)
SPLIT_BLOCK_N = 128  # keys per _bwd_dkdv_split program without autotuning
_dkdv_split_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_N": 128}, num_warps=8, num_stages=s) for s in (1, 2, 3)]
    + [triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=s) for s in (2, 3)],
    key=_BWD_KEY + ["PART"])(_bwd_dkdv_split)
# head dims whose split dK/dV runs as two passes (PART 1: dV, PART 2: dK; S and P computed in both): at hd128
# the one-pass kernel holds four fp32 accumulator halves and spills in every configuration (656-1384
# bytes of stack offline), each pass alone does not: 1.02-1.13x there; at hd64 (no spills at 128 keys
# on 8 warps) the second S/P costs more, 0.94x (H200, results/ab_kernels_run42_18add55_h200.*)
DKDV_TWO_PASS = frozenset({128})
_dq_tuned = triton.autotune(configs=_bwd_configs(), key=_BWD_KEY + ["PSI_ROWS"])(_bwd_dq)


@triton.jit
def _gate(FLAG, KRANGE, GATE, B, LK, BLOCK_B: tl.constexpr):
    """The gate words of :func:`mask_gate` from :func:`mask_structure`'s flag and key ranges (one program): GATE[0]
    the flag where every batch's key range is all LK keys (1: the mask is causal bottom-right, 2: all true), else 0
    (read the mask); GATE[1] the flag (1: causal bottom-right within each batch's key range, 2: the key range alone,
    0: read the mask); GATE[2 + 2b], GATE[3 + 2b] batch b's key range."""
    nbad = 0
    for b0 in range(0, B, BLOCK_B):
        rb = b0 + tl.arange(0, BLOCK_B)
        lo = tl.load(KRANGE + 2 * rb, mask=rb < B, other=0)
        hi = tl.load(KRANGE + 2 * rb + 1, mask=rb < B, other=LK)
        tl.store(GATE + 2 + 2 * rb, lo, mask=rb < B)
        tl.store(GATE + 3 + 2 * rb, hi, mask=rb < B)
        nbad += tl.sum(((lo != 0) | (hi != LK)).to(tl.int32))
    flag = tl.load(FLAG)
    tl.store(GATE, tl.where(nbad == 0, flag, 0))
    tl.store(GATE + 1, flag)


def _mask_plan(attn_mask, causal, b, hq, lq, lk, dummy):
    """The launches of a call: ``(gate, variants)``, each variant ``(mask view or dummy, MASK_KIND, mask strides,
    causal, want)``. Without a gate (None) one variant, ``want`` -1. A head-shared bool mask (no causal rule) is
    checked on the device instead of on the host (:func:`mask_gate`): one launch per answer, the mask read (want 0),
    no mask (2) and, where the mask varies along the queries, causal bottom-right (1), each leaving at once unless
    the gate names it: where the no-mask launches run on the CUDA kernels, the answer of ``gate[1]``, which counts a
    key-padded mask as structured (those kernels read the key ranges; :func:`_gate_word`), else of ``gate[0]``. No
    host sync: the stream never waits for the host, and CUDA graphs can capture the call. Traced
    (:func:`sage_compile._tracing.in_graph`), the check is one opaque op (``sage_compile::train_mask_gate``) whose
    calls on the same mask torch.compile's CSE merges: one check a graph for every site and for the backward."""
    mask, kind, strides = mask_view(attn_mask, b, hq, lq, lk, dummy)
    if kind == 1 and causal == "none" and mask.stride(1) == 0 and lq > 0 and lk > 0:
        gate = (torch.ops.sage_compile.train_mask_gate(attn_mask, b, hq, lq, lk) if in_graph()
                else mask_gate(mask, b, lq, lk))
        none = (dummy, 0, (0, 0, 0, 0))
        variants = [(mask, kind, strides, "none", 0), (*none, "none", 2)]
        if strides[2] != 0:  # (a mask constant along the queries has flag 0 or 2)
            variants.append((*none, "bottom_right", 1))
        return gate, variants
    return None, [(mask, kind, strides, causal, -1)]


def mask_gate(mask, b, lq, lk):
    """int32 (2 + 2B) on the device, the structure of the head-shared bool ``mask`` (a uint8 view expanded to (B, H,
    Lq, Lk)): [0] 1 where it is causal bottom-right, 2 where it is all true, else 0; [1] 1 where it is causal
    bottom-right within each batch's key range (left or right key padding), 2 where it is the key range alone, else
    0; [2 + 2b], [3 + 2b] batch b's key range [first, end) (:func:`mask_structure`, then :func:`_gate`: three
    launches, no host sync)."""
    from ..int8_fp8.attention import mask_structure

    flag, krange = mask_structure(mask, lq, lk)
    gate = torch.empty(2 + 2 * b, dtype=torch.int32, device=mask.device)
    launch(_gate, (1,))(flag, krange, gate, b, lk, BLOCK_B=max(16, min(1024, pow2(b))))
    return gate


# forward / backward ask once whether the CUDA kernels take a call's launches without a mask tensor (cuda0, which also
# decides keyrange; not asked where there is none: asking builds the extension).
def _mask_free(variants) -> bool:
    """Whether :func:`_mask_plan`'s launches include one without a mask tensor (MASK_KIND 0)."""
    return any(kind == 0 for _, kind, *_ in variants)


def _on_cuda(kind: int, want: int, cuda0: bool, ask) -> bool:
    """Whether one of :func:`_mask_plan`'s launches runs on the CUDA kernels: one without a mask tensor where
    ``cuda0`` says so; a gated call's mask-reading launch (``want`` 0) never, and without asking: ``ask`` would log
    "masks other than causal run on the Triton kernels" (a warning under SAGE_COMPILE_INT8_TRAIN_CORE=cuda) for a
    mask that the CUDA launches beside it compute wherever the check finds it causal and / or key padding; any other
    launch as ``ask(kind)`` says."""
    if kind == 0:
        return cuda0
    return want != 0 and ask(kind)


def _gate_word(gate, keyrange: bool):
    """The GATE argument of a call's Triton launches: ``gate`` itself (their test reads its first word), from its
    second word where the call's no-mask launches run on the CUDA kernels with key ranges (``keyrange``), so that
    the mask-reading launch computes exactly where those do not (None: no gate)."""
    return gate[1:] if gate is not None and keyrange else gate


def _dkdv_parts(d):
    """The PART values of the split dK/dV launches at head dim ``d``: (1, 2) two passes, (0,) one."""
    return (1, 2) if d in DKDV_TWO_PASS else (0,)


def _use_cuda(q8, k8, mask_kind: int, psi: str, dtype16, forward: bool = False) -> bool:
    """Whether the CUDA sm90 kernels compute this backward (dQ, dK, dV), or with ``forward`` this forward
    (``SAGE_COMPILE_INT8_TRAIN_CORE`` ``auto`` or ``cuda`` and they support the call; where they do not, the
    Triton kernels serve and the reason is logged once: a warning where ``cuda`` asked for them)."""
    from ...config import int8_train_core

    core = int8_train_core()
    if core == "triton":
        return False
    from . import cuda as train_cuda

    why = train_cuda.unsupported(q8, k8, mask_kind, psi, dtype16, forward)
    if why is not None:
        train_cuda.note_fallback(why, asked=core == "cuda")
    return why is None


def _check(d):
    if d > MAX_HEAD_DIM:
        raise ValueError(f"int8_train kernel: head_dim {d} > {MAX_HEAD_DIM}")


def forward(q8, qs, k8, ks, v8, vs, causal: str, scale: Optional[float], layout: str, out_dtype: torch.dtype,
            attn_mask: Optional[torch.Tensor] = None, config: Optional[dict] = None, v8t: Optional[torch.Tensor] = None):
    """Same contract as :func:`sage_compile.reference.int8_train.forward` (inputs from ``quantize``):
    ``(O (B, Hq, Nq, D) in layout / out_dtype, LSE fp32 (B, Hq, Nq))``. ``config`` (``BLOCK_M``,
    ``num_warps``, ``num_stages``) bypasses autotuning. ``v8t``: V̂ transposed (B, Hkv, D, Nk) where the prologue
    wrote it (:func:`sage_compile.kernels.int8_train.quantize.quantize_vt`), else made here."""
    q8, qs, k8, ks, v8, vs = (t.contiguous() for t in (q8, qs, k8, ks, v8, vs))  # the index math assumes it
    b, hq, lq, d = q8.shape
    hkv, lk = k8.shape[1], k8.shape[2]
    _check(d)
    out = token_major_empty(b, hq, lq, d, layout, dtype=out_dtype, device=q8.device)
    sob, soh, son = bhn_strides(out, layout)
    lse = torch.empty((b, hq, lq), dtype=torch.float32, device=q8.device)
    c = (1.0 / math.sqrt(d) if scale is None else float(scale)) * LOG2E
    if lq == 0:
        return out, lse
    gate, variants = _mask_plan(attn_mask, causal, b, hq, lq, lk, qs)
    # 8-bit wgmma wants both operands K-major (numerics.md §7.5): V with tokens contiguous for P·V
    v8t = tokens_last(v8) if v8t is None else v8t
    cuda0 = _mask_free(variants) and _use_cuda(q8, k8, 0, "split", out_dtype, forward=True)
    keyrange = gate is not None and cuda0
    for mask, kind, ms, rule, want in variants:
        if _on_cuda(kind, want, cuda0, lambda kind: _use_cuda(q8, k8, kind, "split", out_dtype, forward=True)):
            from . import cuda as train_cuda  # the sm90 kernel (SAGE_COMPILE_INT8_TRAIN_CORE auto or cuda)

            train_cuda.forward(q8, qs, k8, ks, v8t, vs, out, lse, rule, c, (sob, soh, son), gate=gate, want=want,
                               keyrange=keyrange)
            continue
        args = (q8, qs, k8, ks, v8t, vs, mask, _or_dummy(_gate_word(gate, keyrange), qs), want, out, lse, c, *ms,
                sob, soh, son, hq, hq // hkv, lq, lk, d, qs.shape[-1], ks.shape[-1])
        meta = dict(CAUSAL=CAUSAL_CODES[rule], MASK_KIND=kind, GATED=gate is not None, BLOCK_N=BLOCK_KV,
                    BLOCK_D=max(16, pow2(d)), EVEN_N=lk % BLOCK_KV == 0, EMULATE=EMULATE_FP8)
        if config is not None or EMULATE_FP8 or gate is not None:  # (no autotuning of a launch that may do nothing)
            cfg = dict(_FWD_DEFAULT, **(config or {}))
            launch(_fwd_kernel, (cdiv(lq, cfg["BLOCK_M"]), b * hq))(*args, **meta, **cfg)
        else:
            launch(_fwd_tuned, lambda m: (cdiv(lq, m["BLOCK_M"]), b * hq))(*args, **meta)
    return out, lse


def quantize_forward(q, k, v, attn_mask, causal: str, scale: Optional[float], layout: str):
    """Same contract as :func:`sage_compile.reference.int8_train.quantize_forward`: ``(O, LSE, quantize's tuple)``;
    the prologue also writes V̂ transposed for the forward (one launch fewer, one pass over V̂ fewer)."""
    qt, v8t = quantize_vt(q, k, v, layout)
    o, lse = forward(*qt[:6], causal, scale, layout, q.dtype, attn_mask=attn_mask, v8t=v8t)
    return o, lse, qt


def _or_dummy(gate, dummy):
    """The GATE argument of a Triton launch: ``gate``, or any tensor where the launch has none (not read)."""
    return dummy if gate is None else gate


def backward(q8, qs, k8, ks, v8, vs, k_mean, o, lse, do, causal: str, scale: Optional[float], layout: str,
             in_dtype: torch.dtype, attn_mask: Optional[torch.Tensor] = None, config: Optional[dict] = None,
             psi: str = "tile"):
    """Same contract as :func:`sage_compile.reference.int8_train.backward`: ``(dq, dk, dv)`` in ``layout``
    and ``in_dtype``; ``psi`` ``tile`` | ``split`` as there. ``config`` (``num_warps``, ``num_stages``;
    ``BLOCK_N``, the keys per program of the split dK/dV kernel, 128 or 64) bypasses autotuning."""
    if psi not in ("tile", "split"):
        raise ValueError(f"int8_train: psi must be 'tile' or 'split', got {psi!r}")
    q8, qs, k8, ks, v8, vs, lse = (t.contiguous() for t in (q8, qs, k8, ks, v8, vs, lse))
    o, do = (t if t.stride(-1) == 1 else t.contiguous() for t in (o, do))  # read at their strides (bwd_prep)
    b, hq, lq, d = q8.shape
    hkv, lk = k8.shape[1], k8.shape[2]
    _check(d)
    dev = q8.device
    sm = 1.0 / math.sqrt(d) if scale is None else float(scale)
    c = sm * LOG2E
    bd = max(16, pow2(d))
    nqb, nkb = qs.shape[-1], ks.shape[-1]
    dq = token_major_empty(b, hq, lq, d, layout, dtype=in_dtype, device=dev)
    dk = token_major_empty(b, hkv, lk, d, layout, dtype=in_dtype, device=dev)
    dv = token_major_empty(b, hkv, lk, d, layout, dtype=in_dtype, device=dev)
    if lq == 0 or lk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()

    p = bwd_prep(q8, k8, v8, vs, o, lse, do, layout, _DT16[in_dtype])
    delta, lse2, do16, do8t, sdo, q8t, k8t, v16 = (p[n] for n in ("delta", "lse2", "do16", "do8t", "sdo", "q8t", "k8t",
                                                                 "v16"))
    gate, variants = _mask_plan(attn_mask, causal, b, hq, lq, lk, qs)
    split = psi == "split"
    kblock = SPLIT_BLOCK_N if split else BLOCK_KV
    common = (hq, hq // hkv, lq, lk, d, nqb, nkb)
    kmean = k_mean.reshape(b, hkv, d).contiguous()
    cuda0 = split and _mask_free(variants) and _use_cuda(q8, k8, 0, psi, dk.dtype)  # (dk: the 16-bit type)
    keyrange = gate is not None and cuda0
    for mask, kind, ms, rule, want in variants:
        if _on_cuda(kind, want, cuda0, lambda kind: split and _use_cuda(q8, k8, kind, psi, dk.dtype)):
            from . import cuda as train_cuda  # dK, dV and dQ from the sm90 kernels (auto or cuda)

            train_cuda.dkdv(q8, q8t, qs, k8, ks, v16, lse2, delta, do16, do8t, sdo, dk, dv, rule, sm,
                            bhn_strides(dk, layout), gate=gate, want=want, keyrange=keyrange)
            train_cuda.dq(q8, qs, k8, k8t, ks, v16, kmean.float(), lse2, delta, do16, dq, rule, sm,
                          bhn_strides(dq, layout), gate=gate, want=want, keyrange=keyrange)
            continue
        g = (mask, _or_dummy(_gate_word(gate, keyrange), qs), want)
        dkdv_args = (q8, q8t, qs, k8, ks, v16, *g, lse, delta, do16, do8t, sdo, dk, dv, c, sm, *ms,
                     *bhn_strides(dk, layout), *common)
        dq_args = (q8, qs, k8, k8t, ks, v16, kmean, *g, lse, delta, do16, dq, c, sm, *ms,
                   *bhn_strides(dq, layout), *common)
        meta = dict(CAUSAL=CAUSAL_CODES[rule], MASK_KIND=kind, GATED=gate is not None, BLOCK_D=bd,
                    EMULATE=EMULATE_FP8)
        dq_meta = dict(meta, BLOCK_M=BLOCK_Q, BLOCK_N=BLOCK_KV, PSI_ROWS=split, EVEN_N=lk % BLOCK_KV == 0)
        # EVEN_N for the largest key block (then true for the smaller one the autotuner may pick)
        dkdv_meta = dict(meta, BLOCK_M=SPLIT_M if split else BLOCK_Q, EVEN_N=lk % kblock == 0)
        if config is not None or EMULATE_FP8 or gate is not None:  # (no autotuning of a launch that may do nothing)
            cfg = dict(_BWD_DEFAULT, **(config or {}))
            bn = cfg.pop("BLOCK_N", SPLIT_BLOCK_N) if split else BLOCK_KV  # tile: ψ's 64 keys fix the block
            cfg.pop("BLOCK_N", None)
            if split:
                for part in _dkdv_parts(d):
                    launch(_bwd_dkdv_split, (cdiv(lk, bn), b * hkv))(*dkdv_args, **dkdv_meta, BLOCK_N=bn, PART=part,
                                                                     **cfg)
            else:
                launch(_bwd_dkdv, (cdiv(lk, bn), b * hkv))(*dkdv_args, **dkdv_meta, BLOCK_N=bn, **cfg)
            launch(_bwd_dq, (nqb, b * hq))(*dq_args, **dq_meta, **cfg)
        elif split:
            for part in _dkdv_parts(d):
                grid = (lambda m: (cdiv(lk, m["BLOCK_N"]), b * hkv))
                launch(_dkdv_split_tuned, grid)(*dkdv_args, **dkdv_meta, PART=part)
            launch(_dq_tuned, (nqb, b * hq))(*dq_args, **dq_meta)
        else:
            launch(_dkdv_tuned, (cdiv(lk, BLOCK_KV), b * hkv))(*dkdv_args, **dkdv_meta, BLOCK_N=BLOCK_KV)
            launch(_dq_tuned, (nqb, b * hq))(*dq_args, **dq_meta)
    return dq, dk, dv
