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
from .._common import EMULATE_FP8, cdiv, div_by, fast_div_ok, int8_bits, launch, pow2, recip
from ..int8_fp8.quantize import _max_nan, int8_values, load_token_tile, token_tile_index

BLOCK_Q, BLOCK_KV = 128, 64
# :func:`_quant_qkv`'s warps. H100 run 186 (benchmarks/bench_train_prep.py, B·N = 32K, 16 heads, hd128, same bits),
# the prologue (K's mean and this launch) at 2K / 16K: 8 warps 0.442 / 0.433 ms, 4 warps 0.354 / 0.345, 16 warps 0.455
# / 0.446 (offline, Triton 3.9: 168, 110 and 78 registers a thread). hd64 (8 warps before, as hd128) is not timed on
# 4: its tiles are half as wide
QKV_WARPS = 4
_BQ, _BKV = tl.constexpr(BLOCK_Q), tl.constexpr(BLOCK_KV)  # (inside kernels)


@triton.jit
def store_tokens_last(YT, x, rn, rd, N, inb):
    """Tile ``x`` (tokens ``rn`` x channels ``rd``, in bounds where ``inb``) into YT, one (batch x head)'s (D, N)
    tokens-contiguous matrix, through an explicit transpose. Offline for sm_90a (this machine's Triton, ptxas 13.0),
    ``_tokens_last`` at 128 x 128 on 4 warps: through transposed pointers 255 registers and 968 bytes of spills,
    through ``tl.trans`` 48 registers, none (not yet timed on a GPU)."""
    tl.store(YT + rd[:, None] * N + rn[None, :], tl.trans(x), mask=tl.trans(inb))


@triton.jit
def copy_tokens_last(X, XT, bh, rn, rd, N, D, inb):
    """Tokens ``rn`` x channels ``rd`` of (batch x head) ``bh`` of X (B*H, N, D), contiguous, into XT (B*H, D, N)
    (:func:`store_tokens_last`)."""
    x = tl.load(X + (bh * N + rn[:, None]) * D + rd[None, :], mask=inb)
    store_tokens_last(XT + bh * D * N, x, rn, rd, N, inb)


@triton.jit
def _quant_tile(X, MEAN, Y, YT, S, bh, blk, sxb, sxh, sxn, sxd, H, N, D, NBLK, HAS_MEAN: tl.constexpr,
                TRANSPOSED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EMULATE: tl.constexpr):
    """INT8 of token block ``blk`` (BLOCK_N tokens x D) of (batch x head) ``bh`` of x (minus the per-(b, h) channel
    mean): scale = amax / 127; with ``TRANSPOSED`` the values also into YT (B*H, D, N), tokens contiguous. The
    quotients through the scale's reciprocal (:func:`div_by`, exact for scales in its range; IEEE divisions for
    any other scale, NaN and inf included: the same bits either way)."""
    b, h, rn, rd, inb = token_tile_index(bh, blk, H, N, D, BLOCK_N, BLOCK_D)  # (no pointer in: see there)
    x = load_token_tile(X, b, h, rn, rd, inb, sxb, sxh, sxn, sxd)
    bh = bh.to(tl.int64)  # (64-bit offsets: B*H*N*D may pass 2^31)
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
    if TRANSPOSED:
        store_tokens_last(YT + bh * D * N, y, rn, rd, N, inb)
    tl.store(S + bh * NBLK + blk, scale)


@triton.jit
def _quant_qkv(Q, K, V, MEAN, Q8, K8, V8, V8T, QS, KS, VS, sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
               HQ, HKV, BHQ, BHKV, NQ, NK, D, NQB, NKB, V_TRANSPOSED: tl.constexpr, BLOCK_D: tl.constexpr,
               EMULATE: tl.constexpr):
    """The whole prologue after K's mean in one launch: program (j, blk) quantizes Q's 128-token block ``blk`` of
    (batch x head) j (j < BHQ), K's 64-token block (minus the mean) or V's (then also V̂ transposed, the forward's
    K-major P·V operand, with ``V_TRANSPOSED``); blocks past a tensor's end do nothing."""
    j, blk = tl.program_id(0), tl.program_id(1)
    if j < BHQ:
        if blk < NQB:
            _quant_tile(Q, MEAN, Q8, Q8, QS, j, blk, sqb, sqh, sqn, sqd, HQ, NQ, D, NQB, False, False, _BQ, BLOCK_D,
                        EMULATE)
    elif j < BHQ + BHKV:
        if blk < NKB:
            _quant_tile(K, MEAN, K8, K8, KS, j - BHQ, blk, skb, skh, skn, skd, HKV, NK, D, NKB, True, False, _BKV,
                        BLOCK_D, EMULATE)
    else:
        if blk < NKB:
            _quant_tile(V, MEAN, V8, V8T, VS, j - BHQ - BHKV, blk, svb, svh, svn, svd, HKV, NK, D, NKB, False,
                        V_TRANSPOSED, _BKV, BLOCK_D, EMULATE)


@triton.jit
def _tokens_last(X, Y, N, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (BLOCK_N tokens x D) tile of head bh of X (B*H, N, D) stored transposed into Y (B*H, D, N)."""
    pid, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # (64-bit offsets: B*H*N*D may pass 2^31)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    m = (rn[:, None] < N) & (rd[None, :] < D)
    copy_tokens_last(X, Y, bh, rn, rd, N, D, m)


def tokens_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` (B, H, N, D) as a contiguous (B, H, D, N) copy (the K-major B operands of the INT8 dots: V^T for
    P·V, Q^T for dK, K^T for dQ), by tiles: torch's strided copy of one-byte elements runs at a fraction of the
    bandwidth (run 42's profile at 16K, benchmarks/results/diag_train_run42_*: 1.2 ms in torch's generic
    elementwise kernel, by my reading the three 64 MB transposes; this kernel is not yet timed)."""
    x = x.contiguous()
    b, h, n, d = x.shape
    y = torch.empty((b, h, d, n), dtype=x.dtype, device=x.device)
    if x.numel():
        launch(_tokens_last, (cdiv(n, 128), b * h))(x, y, n, d, BLOCK_N=128, BLOCK_D=max(16, pow2(d)), num_warps=4)
    return y


def k_token_mean(k_hnd: torch.Tensor) -> torch.Tensor:
    """K's fp32 token mean per (batch, head), ``(B, H, D)`` contiguous: torch's reduction (the reference's mean,
    :func:`sage_compile.reference.quant.smooth_k`, up to summation order; deterministic). One ATen launch where
    ``int8_fp8``'s :func:`k_mean` takes two Triton launches: run 121 (an H100) timed the host side of a Triton launch
    of the prologue at ~40-50 us, which a small model's compiled step waits for."""
    return torch.mean(k_hnd, dim=2, dtype=torch.float32).contiguous()


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "HND"):
    """Same contract as :func:`sage_compile.reference.int8_train.quantize`: ``(q8, qs, k8, ks, v8, vs,
    k_mean (B,Hkv,1,D))``; inputs are never modified (NHD is read in place through strides)."""
    return quantize_vt(q, k, v, layout, False)[0]


def quantize_vt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "HND", v_transposed: bool = True):
    """:func:`quantize`'s tuple and V̂ transposed (B, Hkv, D, Nk) (None without ``v_transposed``): K's mean (one
    torch reduction, fp32 sums: :func:`k_token_mean`), then Q, K, V and V̂ᵀ in one launch (:func:`_quant_qkv`)."""
    q, k, v = (to_hnd(t, layout) for t in (q, k, v))
    mean = k_token_mean(k)
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    nqb, nkb = cdiv(nq, BLOCK_Q), cdiv(nk, BLOCK_KV)
    f32, i8, dev = torch.float32, torch.int8, q.device
    q8, k8, v8 = (torch.empty(t.shape, dtype=i8, device=dev) for t in (q, k, v))
    qs = torch.empty((b, hq, nqb), dtype=f32, device=dev)
    ks, vs = (torch.empty((b, hkv, nkb), dtype=f32, device=dev) for _ in range(2))
    v8t = torch.empty((b, hkv, d, nk), dtype=i8, device=dev) if v_transposed else None
    if q.numel() or k.numel():
        launch(_quant_qkv, (b * hq + 2 * b * hkv, max(nqb, nkb)))(
            q, k, v, mean, q8, k8, v8, v8 if v8t is None else v8t, qs, ks, vs, *q.stride(), *k.stride(), *v.stride(),
            hq, hkv, b * hq, b * hkv, nq, nk, d, nqb, nkb, V_TRANSPOSED=v_transposed, BLOCK_D=max(16, pow2(d)),
            EMULATE=EMULATE_FP8, num_warps=QKV_WARPS)
    return (q8, qs, k8, ks, v8, vs, mean[:, :, None, :]), v8t
