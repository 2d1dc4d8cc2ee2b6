"""Triton NVFP4 quantizer for ``fp4`` (SageAttention3; shared/docs/numerics.md §3.3).

One kernel quantizes the rows of a ``(rows, L)`` view in 1x16 blocks along L: scale =
E4M3_sat_RNE(amax/6), y = x · (1/scale) (IEEE reciprocal; 0 where the scale is 0), values E2M1 RNE
saturating, packed two per byte (low nibble first). Q and K are quantized along the head dim, V along
tokens (rows = channels of V transposed). Bit-identical to
:func:`sage_compile.reference.quant.quant_nvfp4` given the same input; the smoothing (token means, Q
block means, ΔS, V's token mean with ``v_smooth``) is the reference's own torch code
(:func:`sage_compile.reference.fp4.smooth`, :func:`~sage_compile.reference.fp4.v_transposed`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...reference import fp4 as _ref
from .._common import EMULATE_FP8, cdiv, e2m1_code, pow2, round_e2m1, to_e4m3


@triton.jit
def _nvfp4_scale(amax, nan, m, EMULATE: tl.constexpr):
    """E4M3 scale of amax/m as fp32 (NaN blocks: NaN) and its IEEE reciprocal (0 where the scale is 0)."""
    s = tl.math.div_rn(amax, tl.full(amax.shape, m, tl.float32))
    sf = to_e4m3(tl.minimum(s, 448.0), EMULATE).to(tl.float32)
    sf = tl.where(nan, float("nan"), sf)
    inv = tl.where(sf == 0.0, 0.0, tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), tl.where(sf == 0.0, 1.0, sf)))
    return sf, inv


@triton.jit
def _quant_nvfp4_rows(X, Y, S, R, L, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr, EMULATE: tl.constexpr,
                      SEARCH: tl.constexpr = False):
    """X: (R, L) contiguous fp32, L % 16 == 0; Y: (R, L/2) uint8; S: (R, L/16) e4m3. ``SEARCH``: the
    scale of the 13 block maxima 6, 5.75, ..., 3 whose dequantized block is nearest (fp64 squared error,
    ties to the larger), as the reference."""
    pid_r = tl.program_id(0)
    pid_l = tl.program_id(1)
    rr = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rl = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    inb = (rr[:, None] < R) & (rl[None, :] < L)
    x = tl.load(X + rr[:, None] * L + rl[None, :], mask=inb, other=0.0)
    xb = tl.reshape(x, (BLOCK_R, BLOCK_L // 16, 16))
    amax = tl.max(tl.abs(xb), axis=2)
    nan = tl.sum((xb != xb).to(tl.int32), axis=2) > 0
    sf, inv = _nvfp4_scale(amax, nan, 6.0, EMULATE)
    if SEARCH:
        xd = xb.to(tl.float64)
        d = (round_e2m1(tl.where(xb != xb, 0.0, xb * inv[:, :, None]), EMULATE) * sf[:, :, None]).to(tl.float64) - xd
        err = tl.sum(d * d, axis=2)
        for i in tl.static_range(1, 13):
            sf_m, inv_m = _nvfp4_scale(amax, nan, 6.0 - 0.25 * i, EMULATE)
            d = (round_e2m1(tl.where(xb != xb, 0.0, xb * inv_m[:, :, None]), EMULATE) * sf_m[:, :, None]).to(tl.float64) - xd
            e = tl.sum(d * d, axis=2)
            take = e < err
            sf = tl.where(take, sf_m, sf)
            inv = tl.where(take, inv_m, inv)
            err = tl.where(take, e, err)
    y = xb * inv[:, :, None]
    y = tl.where(y != y, 0.0, y)
    codes = tl.reshape(e2m1_code(round_e2m1(y, EMULATE)), (BLOCK_R, BLOCK_L // 2, 2))
    lo, hi = tl.split(codes)
    ro = pid_l * (BLOCK_L // 2) + tl.arange(0, BLOCK_L // 2)
    tl.store(Y + rr[:, None] * (L // 2) + ro[None, :], (lo | (hi << 4)).to(tl.uint8),
             mask=(rr[:, None] < R) & (ro[None, :] < L // 2))
    rs = pid_l * (BLOCK_L // 16) + tl.arange(0, BLOCK_L // 16)
    tl.store(S + rr[:, None] * (L // 16) + rs[None, :], to_e4m3(sf, EMULATE),
             mask=(rr[:, None] < R) & (rs[None, :] < L // 16))


def quant_nvfp4(x: torch.Tensor, search: bool = False):
    """NVFP4 along the last dim (a multiple of 16) of ``x``: ``(packed uint8 (..., L/2), e4m3 (..., L/16))``;
    ``search`` as :func:`sage_compile.reference.quant.quant_nvfp4`."""
    *lead, L = x.shape
    if L % 16:
        raise ValueError(f"fp4 kernel: last dim {L} is not a multiple of 16")
    xv = x.float().reshape(-1, L).contiguous()
    rows = xv.shape[0]
    y = torch.empty((*lead, L // 2), dtype=torch.uint8, device=x.device)
    s = torch.empty((*lead, L // 16), dtype=torch.float8_e4m3fn, device=x.device)
    block_l = min(128, pow2(L))
    block_r = max(1, (1024 if search else 4096) // block_l)
    grid = (cdiv(rows, block_r), cdiv(L, block_l))
    _quant_nvfp4_rows[grid](xv, y, s, rows, L, BLOCK_R=block_r, BLOCK_L=block_l, EMULATE=EMULATE_FP8, SEARCH=search)
    return y, s


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "HND", delta_s: str = "fp32",
             smooth_mode: str = "qk", q_block: int = _ref.BLOCK_M, v_smooth: bool = False, qk_scale: str = "amax",
             qk_balance: bool = False):
    """Same contract and bits as :func:`sage_compile.reference.fp4.quantize`."""
    _ref.check_options(q_block, qk_scale)
    qsm, ksm, ds = _ref.smooth(q, k, layout, delta_s, smooth_mode, q_block, qk_balance)
    qp, qsc = quant_nvfp4(qsm, qk_scale == "search")
    kp, ksc = quant_nvfp4(ksm, qk_scale == "search")
    vt, vbar = _ref.v_transposed(v, layout, v_smooth)
    vp, vsc = quant_nvfp4(vt)
    return qp, qsc, kp, ksc, vp, vsc, ds, vbar
