"""Triton prologue of ``int8_train`` (SageBwd): K smoothing and per-block INT8 of Q (128 tokens), K and
V (64 tokens), one scale per block over all channels.

Bit-identical to :func:`sage_compile.reference.int8_train.quantize` given the same K mean (conventions.md
rule 1): the IEEE quotients (through the block scale's reciprocal, :func:`sage_compile.kernels._common.div_by`,
as the ``int8_fp8`` quantizers), round-to-nearest-even, NaN carried in the block's scale. One program per
block, so the block's amax and its quantization are one pass over the tile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...reference.layout import to_hnd
from .._common import EMULATE_FP8, div_by, fast_div_ok, int8_bits, recip
from ..int8_fp8.quantize import _max_nan, _token_tile, int8_values, k_mean

BLOCK_Q, BLOCK_KV = 128, 64


@triton.jit
def _quant_block_int8(X, MEAN, Y, S, sxb, sxh, sxn, sxd, H, N, D, NBLK,
                      HAS_MEAN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EMULATE: tl.constexpr):
    """INT8 of one (BLOCK_N tokens x D) block of x (minus the per-(b, h) channel mean): scale = amax / 127.
    The quotients through the scale's reciprocal (:func:`div_by`, exact for scales in its range; IEEE divisions
    for any other scale, NaN and inf included: the same bits either way)."""
    x, bh, b, h, rn, rd, inb = _token_tile(X, sxb, sxh, sxn, sxd, H, N, D, BLOCK_N, BLOCK_D)
    if HAS_MEAN:
        mu = tl.load(MEAN + bh * D + rd, mask=rd < D, other=0.0)
        x = tl.where(inb, x - mu[None, :], 0.0)
    amax = tl.reduce(tl.abs(x), None, _max_nan)  # NaN iff the block holds one
    scale = tl.math.div_rn(amax, 127.0)
    if fast_div_ok(scale) > 0:  # (NaN and inf fail the test)
        r, ns = recip(scale)
        y = int8_bits(div_by(x, r, ns))
    else:
        y = int8_values(x, tl.full(x.shape, 1.0, tl.float32) * scale, EMULATE)
    tl.store(Y + bh * N * D + rn[:, None] * D + rd[None, :], y, mask=inb)
    tl.store(S + bh * NBLK + tl.program_id(0), scale)


def quant_blocks_int8(x_hnd: torch.Tensor, block: int, mean: torch.Tensor | None = None):
    """Per-block INT8 of ``x - mean`` (B, H, N, D) (any strides) -> (int8 (B,H,N,D), fp32 (B,H,ceil(N/block)))."""
    b, h, n, d = x_hnd.shape
    nblk = triton.cdiv(n, block)
    y = torch.empty((b, h, n, d), dtype=torch.int8, device=x_hnd.device)
    s = torch.empty((b, h, nblk), dtype=torch.float32, device=x_hnd.device)
    block_d = max(16, triton.next_power_of_2(d))
    _quant_block_int8[(nblk, b * h)](x_hnd, mean if mean is not None else s, y, s, *x_hnd.stride(), h, n, d, nblk,
                                     HAS_MEAN=mean is not None, BLOCK_N=block, BLOCK_D=block_d, EMULATE=EMULATE_FP8,
                                     num_warps=8 if block * block_d >= 8192 else 4)
    return y, s


@triton.jit
def _tokens_last(X, Y, N, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (BLOCK_N tokens x D) tile of head bh of X (B*H, N, D) stored transposed into Y (B*H, D, N)."""
    pid, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # (64-bit offsets: B*H*N*D may pass 2^31)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    m = (rn[:, None] < N) & (rd[None, :] < D)
    x = tl.load(X + (bh * N + rn[:, None]) * D + rd[None, :], mask=m)
    tl.store(Y + (bh * D + rd[None, :]) * N + rn[:, None], x, mask=m)


def tokens_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` (B, H, N, D) as a contiguous (B, H, D, N) copy (the K-major B operands of the INT8 dots: V^T for
    P·V, Q^T for dK, K^T for dQ), by tiles: torch's strided copy of one-byte elements runs at a fraction of the
    bandwidth (run 42's profile at 16K, benchmarks/results/diag_train_run42_*: 1.2 ms in torch's generic
    elementwise kernel, by my reading the three 64 MB transposes; this kernel is not yet timed)."""
    x = x.contiguous()
    b, h, n, d = x.shape
    y = torch.empty((b, h, d, n), dtype=x.dtype, device=x.device)
    if x.numel():
        _tokens_last[(triton.cdiv(n, 128), b * h)](x, y, n, d, BLOCK_N=128, BLOCK_D=max(16, triton.next_power_of_2(d)),
                                                   num_warps=4)
    return y


@triton.jit
def _dequant_16(X, S, Y, N, NBLK, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                RNE_BF16: tl.constexpr):
    """One scale block (BLOCK_N tokens x D) of head bh of X (B*H, N, D) int8: the values times the block's scale
    (fp32), rounded once to Y's 16-bit type (to nearest even; RNE_BF16: by hand to bf16's bits first, for the
    interpreter, whose cast to bf16 truncates)."""
    pid, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    m = (rn[:, None] < N) & (rd[None, :] < D)
    off = (bh * N + rn[:, None]) * D + rd[None, :]
    x = tl.load(X + off, mask=m, other=0).to(tl.float32)
    y = x * tl.load(S + bh * NBLK + pid)
    if RNE_BF16:
        b = y.to(tl.int32, bitcast=True)
        y = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    tl.store(Y + off, y.to(Y.dtype.element_ty), mask=m)


def dequant_16(x8: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """``x8`` (B, H, N, D) int8 with one fp32 scale per ``block`` tokens (B, H, ceil(N/block)) as (B, H, N, D) in
    the 16-bit ``dtype``: the bits of ``dequant_int8(x8, scale, block).to(dtype)`` in one pass (torch's takes four
    element-wise kernels and an fp32 copy; the backward's V̂ for dP = dO·V̂^T)."""
    x8, scale = x8.contiguous(), scale.contiguous()
    b, h, n, d = x8.shape
    y = torch.empty((b, h, n, d), dtype=dtype, device=x8.device)
    if x8.numel():
        _dequant_16[(triton.cdiv(n, block), b * h)](x8, scale, y, n, scale.shape[-1], d, BLOCK_N=block,
                                                    BLOCK_D=max(16, triton.next_power_of_2(d)),
                                                    RNE_BF16=EMULATE_FP8 and dtype == torch.bfloat16, num_warps=4)
    return y


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "HND"):
    """Same contract as :func:`sage_compile.reference.int8_train.quantize`: ``(q8, qs, k8, ks, v8, vs,
    k_mean (B,Hkv,1,D))``; inputs are never modified (NHD is read in place through strides)."""
    q, k, v = (to_hnd(t, layout) for t in (q, k, v))
    mean = k_mean(k).contiguous()
    q8, qs = quant_blocks_int8(q, BLOCK_Q)
    k8, ks = quant_blocks_int8(k, BLOCK_KV, mean)
    v8, vs = quant_blocks_int8(v, BLOCK_KV)
    return q8, qs, k8, ks, v8, vs, mean[:, :, None, :]
