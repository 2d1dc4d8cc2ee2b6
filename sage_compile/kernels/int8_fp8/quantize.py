"""Triton prologue of ``int8_fp8``: per-token INT8 Q, INT8 (smoothed) K with its scales tied in the
per-thread groups of :func:`sage_compile.reference.quant.quant_int8_k_groups`, per-channel FP8 V
transposed (its tokens padded with zeros to a multiple of 16).

Bit-identical to :mod:`sage_compile.reference.int8_fp8` given the same K mean (conventions.md rule 1):
IEEE-exact divisions (``div_rn``), round-to-nearest-even via the 1.5·2²³ trick, clamp before the fp8 cast.
The token reductions (K mean, V channel amax) run as torch reductions; the element-wise work is one
Triton pass over each of Q, K and V.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...reference.int8_fp8 import V_KEY_MULTIPLE
from ...reference.quant import K_GROUP_TILE
from ...reference.layout import to_hnd
from .._common import EMULATE_FP8, rne, to_e4m3


@triton.jit
def _token_tile(X, sxb, sxh, sxn, sxd, H, N, D, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's (BLOCK_N tokens, BLOCK_D channels) tile of a strided (B, H, N, D) tensor, as fp32
    (zeros outside), with ``(bh, b, h, token offsets, channel offsets, in-bounds mask)``."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    inb = (rn[:, None] < N) & (rd[None, :] < D)
    x = tl.load(X + b * sxb + h * sxh + rn[:, None] * sxn + rd[None, :] * sxd, mask=inb, other=0.0).to(tl.float32)
    return x, bh, b, h, rn, rd, inb


@triton.jit
def int8_values(x, scale, EMULATE: tl.constexpr):
    """RNE(x / scale) clamped to ±127 as int8 (IEEE division; 0 where the scale is 0; NaN -> 0, the NaN
    stays in the scale). ``scale`` broadcast to x's shape."""
    y = tl.math.div_rn(x, tl.where(scale == 0.0, 1.0, scale))
    y = tl.where(scale == 0.0, 0.0, y)
    y = tl.minimum(tl.maximum(rne(y, EMULATE), -127.0), 127.0)
    return tl.where(y != y, 0.0, y).to(tl.int8)


@triton.jit
def _quant_rows_int8(X, MEAN, CH, Y, S, sxb, sxh, sxn, sxd, H, GROUP, N, D,
                     HAS_MEAN: tl.constexpr, CH_MODE: tl.constexpr, KGROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, EMULATE: tl.constexpr):
    """Per-token INT8 of rows of x (optionally x - mean, then x·s or x/s per channel: CH_MODE 1 / 2,
    s of shape (B, H // GROUP, D)). KGROUP (BLOCK_N = 128, one 128-key tile): the scales tied in the
    groups of :func:`sage_compile.reference.quant.quant_int8_k_groups` (the tile's key 16a + 4t + u in
    group t)."""
    x, bh, b, h, rn, rd, inb = _token_tile(X, sxb, sxh, sxn, sxd, H, N, D, BLOCK_N, BLOCK_D)
    if HAS_MEAN:
        mu = tl.load(MEAN + bh * D + rd, mask=rd < D, other=0.0)
        x = tl.where(inb, x - mu[None, :], 0.0)
    if CH_MODE != 0:
        ch = tl.load(CH + (b * (H // GROUP) + h // GROUP) * D + rd, mask=rd < D, other=1.0)
        if CH_MODE == 1:
            x = x * ch[None, :]
        else:
            x = tl.math.div_rn(x, tl.broadcast_to(ch[None, :], x.shape))
    amax = tl.max(tl.abs(x), axis=1)
    nan = tl.sum((x != x).to(tl.int32), axis=1) > 0
    if KGROUP:
        ga = tl.max(tl.max(tl.reshape(amax, (8, 4, 4)), axis=2), axis=0)
        gn = tl.max(tl.max(tl.reshape(nan.to(tl.int32), (8, 4, 4)), axis=2), axis=0)
        amax = tl.reshape(tl.broadcast_to(ga[None, :, None], (8, 4, 4)), (BLOCK_N,))
        nan = tl.reshape(tl.broadcast_to(gn[None, :, None], (8, 4, 4)), (BLOCK_N,)) > 0
    scale = tl.where(nan, float("nan"), tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)))
    y = int8_values(x, tl.broadcast_to(scale[:, None], x.shape), EMULATE)
    tl.store(Y + bh * N * D + rn[:, None] * D + rd[None, :], y, mask=inb)
    tl.store(S + bh * N + rn, scale, mask=rn < N)


@triton.jit
def _quant_v_fp8(V, SC, Y, svb, svh, svn, svd, H, N, NP, D, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 EMULATE: tl.constexpr):
    """V / scale as E4M3, stored transposed (B, H, D, NP); tokens N..NP-1 (the padding) are zeros."""
    v, bh, b, h, rn, rd, inb = _token_tile(V, svb, svh, svn, svd, H, N, D, BLOCK_N, BLOCK_D)
    sc = tl.load(SC + bh * D + rd, mask=rd < D, other=1.0)
    safe = tl.where(sc == 0.0, 1.0, sc)
    y = tl.math.div_rn(v, tl.broadcast_to(safe[None, :], v.shape))
    y = tl.where(sc[None, :] == 0.0, 0.0, y)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    # transposed store: (B, H, D, NP), tokens contiguous (the K-major operand of the FP8 PV matmul)
    tl.store(Y + bh * D * NP + rd[None, :] * NP + rn[:, None], to_e4m3(y, EMULATE),
             mask=(rn[:, None] < NP) & (rd[None, :] < D))


def _grid_rows(n, bh, block):
    return (triton.cdiv(n, block), bh)


def k_mean(k_hnd: torch.Tensor) -> torch.Tensor:
    """fp32 token mean of K per (batch, head): ``(B, H, D)``."""
    return k_hnd.mean(dim=-2, dtype=torch.float32)


def quant_rows_int8(x_hnd: torch.Tensor, mean: torch.Tensor | None = None, channel: torch.Tensor | None = None,
                    channel_mode: int = 0, k_groups: bool = False):
    """Per-token INT8 of ``x - mean`` (B, H, N, D) -> (int8 (B,H,N,D), fp32 scales (B,H,N)); with
    ``channel`` (B, Hc, D) fp32 (Hc divides H) the rows are first multiplied (``channel_mode=1``) or
    divided (2) by it per channel. ``k_groups``: the scales tied in K's groups
    (:func:`sage_compile.reference.quant.quant_int8_k_groups`)."""
    b, h, n, d = x_hnd.shape
    y = torch.empty((b, h, n, d), dtype=torch.int8, device=x_hnd.device)
    s = torch.empty((b, h, n), dtype=torch.float32, device=x_hnd.device)
    block_d = max(16, triton.next_power_of_2(d))
    block_n = K_GROUP_TILE if k_groups else max(1, min(64, 8192 // block_d))
    group = h // channel.shape[1] if channel is not None else 1
    _quant_rows_int8[_grid_rows(n, b * h, block_n)](
        x_hnd, mean if mean is not None else s, channel if channel is not None else s, y, s, *x_hnd.stride(),
        h, group, n, d, HAS_MEAN=mean is not None, CH_MODE=channel_mode if channel is not None else 0,
        KGROUP=k_groups, BLOCK_N=block_n, BLOCK_D=block_d, EMULATE=EMULATE_FP8,
        num_warps=8 if k_groups and block_d >= 128 else 4)
    return y, s


@triton.jit
def _channel_factors(QMIN, QMAX, KMIN, KMAX, MEAN, S, G, D, BLOCK_D: tl.constexpr):
    """One program per (batch, kv head): s = sqrt(ak / aq) per channel, aq = max |q| over the G query
    heads' token ranges, ak = max |k - mean| = max(kmax - mean, mean - kmin) (exact: x -> x - mean is
    monotone); 1 where either is 0 or not finite. NaN propagates as in torch (then s = 1); IEEE division
    and square root, so the factors are the reference's bits."""
    bhk = tl.program_id(0)
    rd = tl.arange(0, BLOCK_D)
    m = rd < D
    aq = tl.zeros((BLOCK_D,), tl.float32)
    for g in range(0, G):
        row = (bhk * G + g) * D + rd
        qmax = tl.load(QMAX + row, mask=m, other=0.0).to(tl.float32)
        qmin = tl.load(QMIN + row, mask=m, other=0.0).to(tl.float32)
        aq = tl.maximum(aq, tl.maximum(qmax, -qmin, propagate_nan=tl.PropagateNan.ALL),
                        propagate_nan=tl.PropagateNan.ALL)
    mu = tl.load(MEAN + bhk * D + rd, mask=m, other=0.0)
    kmax = tl.load(KMAX + bhk * D + rd, mask=m, other=0.0).to(tl.float32)
    kmin = tl.load(KMIN + bhk * D + rd, mask=m, other=0.0).to(tl.float32)
    ak = tl.maximum(kmax - mu, mu - kmin, propagate_nan=tl.PropagateNan.ALL)
    inf = float("inf")
    ok = (aq > 0) & (ak > 0) & (aq == aq) & (ak == ak) & (aq != inf) & (ak != inf)
    s = tl.sqrt_rn(tl.math.div_rn(ak, tl.where(ok, aq, 1.0)))
    tl.store(S + bhk * D + rd, tl.where(ok, s, 1.0), mask=m)


def channel_scales(q_hnd: torch.Tensor, k_hnd: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """:func:`sage_compile.reference.quant.channel_balance` of (Q, K - mean) without materialising either:
    the channel ranges come from min/max reductions (two torch launches) and one small Triton kernel
    turns them into the factors (it replaced ~20 element-wise torch launches: host time at small shapes).
    ``mean``: (B, Hkv, D) fp32, contiguous. Returns (B, Hkv, D) fp32."""
    b, hq, _, d = q_hnd.shape
    hkv = k_hnd.shape[1]
    qmin, qmax = torch.aminmax(q_hnd, dim=-2)
    kmin, kmax = torch.aminmax(k_hnd, dim=-2)
    s = torch.empty((b, hkv, d), dtype=torch.float32, device=q_hnd.device)
    _channel_factors[(b * hkv,)](qmin.contiguous(), qmax.contiguous(), kmin.contiguous(), kmax.contiguous(),
                                 mean.contiguous(), s, hq // hkv, d, BLOCK_D=max(16, triton.next_power_of_2(d)))
    return s


def quant_v_fp8(v_hnd: torch.Tensor, key_multiple: int = V_KEY_MULTIPLE):
    """Per-channel FP8 of V (B, H, N, D) -> (float8_e4m3fn (B,H,D,Np), fp32 scales (B,H,D)); Np = N
    rounded up to ``key_multiple``, zeros past N (:func:`sage_compile.reference.quant.quant_fp8_v`)."""
    b, h, n, d = v_hnd.shape
    npad = n + (-n) % key_multiple
    vmin, vmax = torch.aminmax(v_hnd, dim=-2)  # = |V|'s amax (exactly) without writing |V|
    amax = torch.maximum(vmax, -vmin).abs().float()  # (abs: a column of -0.0 gives +0.0, as |V| would)
    scale = (amax / torch.full_like(amax, 448.0)).contiguous()  # IEEE division (see reference.quant)
    y = torch.empty((b, h, d, npad), dtype=torch.float8_e4m3fn, device=v_hnd.device)
    block_d = max(16, triton.next_power_of_2(d))
    block_n = max(1, min(64, 8192 // block_d))
    _quant_v_fp8[_grid_rows(npad, b * h, block_n)](v_hnd, scale, y, *v_hnd.stride(), h, n, npad, d,
                                                   BLOCK_N=block_n, BLOCK_D=block_d, EMULATE=EMULATE_FP8)
    return y, scale


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "HND", channel_rescale: bool = False):
    """Same contract as :func:`sage_compile.reference.int8_fp8.quantize`; inputs are never modified.

    With ``channel_rescale`` the Q/K channel balance factors come from one min/max reduction over Q and
    K (:func:`channel_scales`) and are applied inside the same INT8 pass (Q·s, (K - mean)/s)."""
    q, k, v = (to_hnd(t, layout) for t in (q, k, v))
    mean = k_mean(k).contiguous()
    if channel_rescale:
        s = channel_scales(q, k, mean)
        q8, qs = quant_rows_int8(q, None, s, 1)
        k8, ks = quant_rows_int8(k, mean, s, 2, k_groups=True)
    else:
        q8, qs = quant_rows_int8(q)
        k8, ks = quant_rows_int8(k, mean, k_groups=True)
    v8, vs = quant_v_fp8(v)
    return q8, qs, k8, ks, v8, vs
