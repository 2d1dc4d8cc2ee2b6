"""Triton prologue of ``int8_fp8``: per-token INT8 Q, INT8 (smoothed) K with its scales tied in the
per-thread groups of :func:`sage_compile.reference.quant.quant_int8_k_groups`, per-channel FP8 V
transposed (its tokens padded with zeros to a multiple of 16).

Bit-identical to :mod:`sage_compile.reference.int8_fp8` given the same K mean (conventions.md rule 1):
the IEEE quotients, through each row's or channel's correctly rounded reciprocal and one Markstein
correction (:func:`sage_compile.kernels._common.div_by`; ``div_rn`` for a tile with a divisor out of its
range), round-to-nearest-even via the 1.5·2²³ trick, clamp before the fp8 cast.
Two passes over each of K and V, one over Q plus a read of its balance sample (at least ``BALANCE_TOKENS``
strided tokens, with the channel balance): the token reductions (K's channel sum, min and max, Q's and V's
largest channel magnitudes) as per-chunk partials (:func:`_chan_stats`, one launch for all three) that one small kernel
turns into the K mean, the channel factors and V's scales (:func:`_stats_finalize`); then the element-wise
quantization (one launch per tensor). Five launches in all, where torch's reductions over the token axis
of a strided (B, N, H, D) view took ~17 launches and most of the prologue's time (H200 run 20: an
``aminmax`` over Q and K 0.14 ms at CogVideoX's 16K tokens, the whole prologue 0.39 ms).
Timed and reverted (run 99, an H100, ``benchmarks/results/prologue_run99_0c27a82_h100.*``): the finalize inside
the statistics launch, run by each (batch, kv head)'s last program (a barrier, a GPU-scope fence and an atomic
at the end of every statistics program). The op, same process: CogVideoX 4K / 16K 0.0670 -> 0.0693 / 0.2048 ->
0.2065 ms, Flux 0.1149 -> 0.1279 / 0.3443 -> 0.3573 ms; its statistics kernel took 0.087 / 0.147 ms at 16K, where
run 97's profile of the five launches had 0.076 / 0.119 ms plus the finalize's 0.010 / 0.016 ms. Run 96 had merged
all five launches, slower still. Also dropped (code at a45f921): ``prologue="split"``, Q quantized by Inductor after
RoPE (no bf16 Q in memory) and K, V by a traced op given Q's balance sample: slower on an H100 (run 172, the Flux 16K
block's prologue 0.395 vs 0.273 ms with this op traced, CogVideoX 16K 0.250 vs 0.234 ms). Read in Inductor's sm90 code on
the CPU (Flux 4K): its Q quantizer divides per element (IEEE) where :func:`_quant_rows_int8` multiplies by each row's
reciprocal and corrects once, and diffusers' RoPE still writes its rotated half (a bf16 stack) for it to read.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..._tracing import eager_launches, in_graph
from ...reference.int8_fp8 import BALANCE_TOKENS, V_KEY_MULTIPLE, token_sample
from ...reference.quant import K_GROUP_TILE
from ...reference.layout import to_hnd
from .._common import EMULATE_FP8, cdiv, div_by, fast_div_ok, int8_bits, launch, or_sign, pow2, recip, rne, to_e4m3


@triton.jit
def token_tile_index(bh, blk, H, N, D, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """``(b, h, rn, rd, inb)`` of token block ``blk`` of (batch x head) ``bh``: batch, head, token and channel
    indices, and where they are in bounds. No pointer goes in: torch's analysis of the tensors a traced
    (``wrap_triton``) kernel writes follows a store's offsets back into every argument of the calls that made them,
    and would take a tensor handed to such a call for written."""
    rn = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    return bh // H, bh % H, rn, rd, (rn[:, None] < N) & (rd[None, :] < D)


@triton.jit
def load_token_tile(X, b, h, rn, rd, inb, sxb, sxh, sxn, sxd):
    """The fp32 values of X at batch ``b``, head ``h``, tokens ``rn`` x channels ``rd`` (0 where not ``inb``)."""
    return tl.load(X + b * sxb + h * sxh + rn[:, None] * sxn + rd[None, :] * sxd, mask=inb, other=0.0).to(tl.float32)


@triton.jit
def int8_values(x, scale, EMULATE: tl.constexpr):
    """RNE(x / scale) clamped to ±127 as int8 (IEEE division; 0 where the scale is 0; NaN -> 0, the NaN
    stays in the scale). ``scale`` broadcast to x's shape."""
    y = tl.math.div_rn(x, tl.where(scale == 0.0, 1.0, scale))
    y = tl.where((scale == 0.0) | (y != y), 0.0, y)  # (before the clamp: max(NaN, -127) is -127)
    return tl.minimum(tl.maximum(rne(y, EMULATE), -127.0), 127.0).to(tl.int8)


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quant_rows_int8(X, MEAN, CH, Y, S, sxb, sxh, sxn, sxd, H, GROUP, N, D,
                     HAS_MEAN: tl.constexpr, CH_MODE: tl.constexpr, KGROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, EMULATE: tl.constexpr):
    """Per-token INT8 of rows of x (optionally x - mean, then x·s or x/s per channel: CH_MODE 1 / 2,
    s of shape (B, H // GROUP, D)). KGROUP (BLOCK_N = 128, one 128-key tile): the scales tied in the
    groups of :func:`sage_compile.reference.quant.quant_int8_k_groups` (the tile's key 16a + 4t + u in
    group t). Divisions through the divisors' reciprocals (:func:`div_by`, exact) unless a divisor of the
    tile is out of its range (then IEEE divisions: the same bits, slower)."""
    bh = tl.program_id(1)
    b, h, rn, rd, inb = token_tile_index(bh, tl.program_id(0), H, N, D, BLOCK_N, BLOCK_D)
    x = load_token_tile(X, b, h, rn, rd, inb, sxb, sxh, sxn, sxd)
    if HAS_MEAN:
        mu = tl.load(MEAN + bh * D + rd, mask=rd < D, other=0.0)
        x = tl.where(inb, x - mu[None, :], 0.0)
    if CH_MODE != 0:
        ch = tl.load(CH + (b * (H // GROUP) + h // GROUP) * D + rd, mask=rd < D, other=1.0)
        if CH_MODE == 1:
            x = x * ch[None, :]
        else:
            rc, nch = recip(ch)
            if tl.min(fast_div_ok(ch)) > 0:
                x = div_by(x, rc[None, :], nch[None, :])
            else:
                x = tl.math.div_rn(x, tl.broadcast_to(ch[None, :], x.shape))
    amax = tl.reduce(tl.abs(x), 1, _max_nan)  # NaN iff the row holds one (then its scale is NaN)
    if KGROUP:
        ga = tl.reduce(tl.reduce(tl.reshape(amax, (8, 4, 4)), 2, _max_nan), 0, _max_nan)
        amax = tl.reshape(tl.broadcast_to(ga[None, :, None], (8, 4, 4)), (BLOCK_N,))
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    r, ns = recip(scale)
    if tl.min(fast_div_ok(scale)) > 0:  # (no NaN or inf in the tile: those scales fail the test)
        y = int8_bits(div_by(x, r[:, None], ns[:, None]))
    else:
        y = int8_values(x, tl.broadcast_to(scale[:, None], x.shape), EMULATE)
    tl.store(Y + bh * N * D + rn[:, None] * D + rd[None, :], y, mask=inb)
    tl.store(S + bh * N + rn, scale, mask=rn < N)


@triton.jit
def _quant_v_fp8(V, SC, Y, svb, svh, svn, svd, H, N, NP, D, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 EMULATE: tl.constexpr):
    """V / scale as E4M3, stored transposed (B, H, D, NP); tokens N..NP-1 (the padding) are zeros."""
    bh = tl.program_id(1)
    b, h, rn, rd, inb = token_tile_index(bh, tl.program_id(0), H, N, D, BLOCK_N, BLOCK_D)
    v = load_token_tile(V, b, h, rn, rd, inb, svb, svh, svn, svd)
    sc = tl.load(SC + bh * D + rd, mask=rd < D, other=1.0)
    r, ns = recip(sc)
    if tl.min(fast_div_ok(sc)) > 0:
        y = or_sign(div_by(v, r[None, :], ns[None, :]), v)  # -0.0 / s is -0.0 (div_by gives +0.0)
    else:
        y = tl.math.div_rn(v, tl.broadcast_to(tl.where(sc == 0.0, 1.0, sc)[None, :], v.shape))
        y = tl.where(rn[:, None] >= N, 0.0, y)  # the padding stays 0 under a NaN or inf scale (0 / NaN)
    y = tl.where(sc[None, :] == 0.0, 0.0, y)
    y = _min_nan(_max_nan(y, -448.0), 448.0)  # a NaN channel's values stay NaN (max(NaN, -448) is -448)
    # transposed store: (B, H, D, NP), tokens contiguous (the K-major operand of the FP8 PV matmul)
    tl.store(Y + bh * D * NP + rd[None, :] * NP + rn[:, None], to_e4m3(y, EMULATE),
             mask=(rn[:, None] < NP) & (rd[None, :] < D))


STATS_TILE = 2048  # elements per load of :func:`_chan_stats` (16 tokens at hd128; 4096 ran 1.5 waves
# at Flux's 16K, 0.14 -> 0.21 ms: H200 run 53)


def stats_chunk(n: int) -> int:
    """Tokens per program of :func:`_chan_stats` for ``n`` tokens: a function of n alone, so the K mean's
    summation order (and so its bits) is the same in every call on a shape (k_mean == quantize's mean).
    256 up to 8K tokens (more programs: the op's statistics at 4K 1.2-1.3x faster), 512 above (equal
    within 3 %; fewer partials): H200 run 54, benchmarks/results/prologue_run54_*."""
    return 256 if n <= 8192 else 512


@triton.jit
def _fold_stats(acc, lo, hi, x, x_lo, x_hi, DO_SUM: tl.constexpr, RANGE: tl.constexpr):
    """One tile into :func:`_chan_stats`' accumulators: x into the sum, x_lo / x_hi into the min / max
    (RANGE 1: x with masked entries at +inf / -inf), |x| into the max (RANGE 2)."""
    if DO_SUM:
        acc += x
    if RANGE == 1:
        lo = _min_nan(lo, x_lo)
        hi = _max_nan(hi, x_hi)
    if RANGE == 2:
        hi = _max_nan(hi, tl.abs(x))
    return acc, lo, hi


@triton.jit
def _stats_program(X, SUM, MIN, MAX, sxb, sxh, sxn, sxd, H, N, D, NSPLIT, pid, DO_SUM: tl.constexpr,
                   RANGE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   UNROLL: tl.constexpr):
    """Per-channel partials over chunk ``pid % NSPLIT`` (CHUNK tokens) of (batch·head) ``pid // NSPLIT`` of
    a strided (B, H, N, D) tensor: the fp32 sum (DO_SUM); RANGE 1 the min and the max, 2 the max of |x|
    (into MAX), both NaN-propagating, as torch's; each stored at ``[bh, chunk, :]`` of a (B·H, NSPLIT, D)
    fp32 buffer. The tiles fold in token order whatever UNROLL (tiles loaded per step), so the bits too."""
    sp = pid % NSPLIT
    bh = pid // NSPLIT
    b = bh // H
    h = bh % H
    rd = tl.arange(0, BLOCK_D)
    md = rd < D
    base = X + b * sxb + h * sxh + sp * CHUNK * sxn
    # element-wise accumulators over the chunk's tiles, reduced across tokens once at the end (a reduction
    # per tile was 2.5-3.5x slower than the bandwidth allows: H200 run 48); the full tiles load without a
    # token mask, so only the ragged tail selects (lanes past D are loaded as zeros and never stored);
    # UNROLL tiles per step put that many loads in flight before the first is folded
    acc = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    lo = tl.full((BLOCK_N, BLOCK_D), float("inf"), tl.float32)
    hi = tl.full((BLOCK_N, BLOCK_D), 0.0 if RANGE == 2 else float("-inf"), tl.float32)
    n_here = tl.minimum(N - sp * CHUNK, CHUNK)
    n_step = (n_here // (BLOCK_N * UNROLL)) * (BLOCK_N * UNROLL)
    n_full = (n_here // BLOCK_N) * BLOCK_N
    rn = tl.arange(0, BLOCK_N)
    ptrs = base + rn[:, None] * sxn + rd[None, :] * sxd
    for i in range(0, n_step, BLOCK_N * UNROLL):
        for u in tl.static_range(UNROLL):
            x = tl.load(ptrs + (i + u * BLOCK_N) * sxn, mask=md[None, :], other=0.0).to(tl.float32)
            acc, lo, hi = _fold_stats(acc, lo, hi, x, x, x, DO_SUM, RANGE)
    for i in range(n_step, n_full, BLOCK_N):
        x = tl.load(ptrs + i * sxn, mask=md[None, :], other=0.0).to(tl.float32)
        acc, lo, hi = _fold_stats(acc, lo, hi, x, x, x, DO_SUM, RANGE)
    if n_full < n_here:
        m = ((n_full + rn[:, None]) < n_here) & md[None, :]
        x = tl.load(ptrs + n_full * sxn, mask=m, other=0.0).to(tl.float32)
        # (the sum and max |x| take the masked zeros as they are; the min and max skip them)
        acc, lo, hi = _fold_stats(acc, lo, hi, x, tl.where(m, x, float("inf")), tl.where(m, x, float("-inf")),
                                  DO_SUM, RANGE)
    out = (bh * NSPLIT + sp) * D + rd
    if DO_SUM:
        tl.store(SUM + out, tl.sum(acc, axis=0), mask=md)
    if RANGE == 1:
        tl.store(MIN + out, tl.reduce(lo, 0, _min_nan), mask=md)
    if RANGE != 0:
        tl.store(MAX + out, tl.reduce(hi, 0, _max_nan), mask=md)


@triton.jit
def _chan_stats(X0, SUM0, MIN0, MAX0, sb0, sh0, sn0, sd0, H0, N0, NS0, P0,
                X1, SUM1, MIN1, MAX1, sb1, sh1, sn1, sd1, H1, N1, NS1, P1,
                X2, SUM2, MIN2, MAX2, sb2, sh2, sn2, sd2, H2, N2, NS2, D,
                DO_SUM0: tl.constexpr, RANGE0: tl.constexpr, CHUNK0: tl.constexpr,
                DO_SUM1: tl.constexpr, RANGE1: tl.constexpr, CHUNK1: tl.constexpr,
                DO_SUM2: tl.constexpr, RANGE2: tl.constexpr, CHUNK2: tl.constexpr,
                NT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UNROLL: tl.constexpr):
    """:func:`_stats_program` over NT (1-3) tensors of one head dim in one launch: programs [0, P0) take
    tensor 0's (chunk, batch·head) pairs, [P0, P0 + P1) tensor 1's, the rest tensor 2's (one launch keeps
    more loads in flight than a launch per tensor, each of them a few programs per SM: STATS_UNROLL)."""
    pid = tl.program_id(0)
    if pid < P0:
        _stats_program(X0, SUM0, MIN0, MAX0, sb0, sh0, sn0, sd0, H0, N0, D, NS0, pid, DO_SUM0, RANGE0, CHUNK0,
                       BLOCK_N, BLOCK_D, UNROLL)
    elif pid < P0 + P1:
        if NT >= 2:
            _stats_program(X1, SUM1, MIN1, MAX1, sb1, sh1, sn1, sd1, H1, N1, D, NS1, pid - P0, DO_SUM1, RANGE1,
                           CHUNK1, BLOCK_N, BLOCK_D, UNROLL)
    elif NT >= 3:
        _stats_program(X2, SUM2, MIN2, MAX2, sb2, sh2, sn2, sd2, H2, N2, D, NS2, pid - P0 - P1, DO_SUM2,
                       RANGE2, CHUNK2, BLOCK_N, BLOCK_D, UNROLL)


SPLIT_BLOCK = tl.constexpr(32)  # partial rows per load of :func:`_stats_finalize` (run 59: loading every
# partial tile before the first reduction, up to 64 rows on up to 16 warps, was within 2.5 % of this, f460fa9)


@triton.jit
def _split_reduce(P, row0, nsplit, rd, m, D, OP: tl.constexpr, SB: tl.constexpr, BLOCK_D: tl.constexpr):
    """Sum (OP 0), min (1) or max (2) over ``nsplit`` partial rows of P starting at row ``row0``
    (NaN-propagating), SB rows per load."""
    init = 0.0 if OP == 0 else (float("inf") if OP == 1 else float("-inf"))
    res = tl.full((BLOCK_D,), init, tl.float32)
    rs = tl.arange(0, SB)
    for s0 in range(0, nsplit, SB):
        mm = ((s0 + rs[:, None]) < nsplit) & m[None, :]
        a = tl.load(P + (row0 + s0 + rs[:, None]) * D + rd[None, :], mask=mm, other=init)
        if OP == 0:
            res += tl.sum(a, axis=0)
        elif OP == 1:
            res = _min_nan(res, tl.reduce(a, 0, _min_nan))
        else:
            res = _max_nan(res, tl.reduce(a, 0, _max_nan))
    return res


@triton.jit
def _stats_finalize(QAMAX, KSUM, KMIN, KMAX, VAMAX, MEAN, S, VS, G, SQ, SK, NK, D,
                    MEAN_GIVEN: tl.constexpr, RESCALE: tl.constexpr, DO_V: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (batch, kv head), from :func:`_chan_stats`' partials (SQ chunks of each of the G
    query heads, SK chunks of the key head): the K mean (fp32 sum / NK, IEEE division; read from MEAN
    when MEAN_GIVEN, else written there), the channel factors s = max(sqrt(ak / aq), ak / max ak) (RESCALE;
    aq = max |q| over the G query heads, ak = max |k - mean| = max(kmax - mean, mean - kmin), exact since x ->
    x - mean is monotone, max ak over the finite channels; 1 where either is 0 or not finite, NaN included, as
    :func:`sage_compile.reference.quant.channel_balance`) and V's scales amax / 448 (DO_V), all with IEEE
    division and square root: the reference's bits given the mean."""
    bhk = tl.program_id(0)
    rd = tl.arange(0, BLOCK_D)
    m = rd < D
    if MEAN_GIVEN:
        mu = tl.load(MEAN + bhk * D + rd, mask=m, other=0.0)
    else:
        tot = _split_reduce(KSUM, bhk * SK, SK, rd, m, D, 0, SPLIT_BLOCK, BLOCK_D)
        mu = tl.math.div_rn(tot, tl.full((BLOCK_D,), NK, tl.float32))
        tl.store(MEAN + bhk * D + rd, mu, mask=m)
    if RESCALE:
        aq = tl.zeros((BLOCK_D,), tl.float32)
        for g in range(0, G):
            aq = _max_nan(aq, _split_reduce(QAMAX, (bhk * G + g) * SQ, SQ, rd, m, D, 2, SPLIT_BLOCK, BLOCK_D))
        kmin = _split_reduce(KMIN, bhk * SK, SK, rd, m, D, 1, SPLIT_BLOCK, BLOCK_D)
        kmax = _split_reduce(KMAX, bhk * SK, SK, rd, m, D, 2, SPLIT_BLOCK, BLOCK_D)
        ak = _max_nan(kmax - mu, mu - kmin)
        inf = float("inf")
        ok = (aq > 0) & (ak > 0) & (aq == aq) & (ak == ak) & (aq != inf) & (ak != inf)
        s = tl.sqrt_rn(tl.math.div_rn(ak, tl.where(ok, aq, 1.0)))
        widest = tl.max(tl.where(m & (ak == ak) & (ak != inf), ak, 0.0), axis=0)  # K's widest finite range
        s = tl.maximum(s, tl.math.div_rn(ak, tl.where(ok, widest, 1.0)))
        tl.store(S + bhk * D + rd, tl.where(ok, s, 1.0), mask=m)
    if DO_V:
        amax = _split_reduce(VAMAX, bhk * SK, SK, rd, m, D, 2, SPLIT_BLOCK, BLOCK_D)  # max |v| (+0.0 for -0.0)
        tl.store(VS + bhk * D + rd, tl.math.div_rn(amax, tl.full((BLOCK_D,), 448.0, tl.float32)), mask=m)


def _block_d(d: int) -> int:
    return max(16, pow2(d))


def _or(t: Optional[torch.Tensor], buf: torch.Tensor) -> torch.Tensor:
    """``t``, or ``buf`` for a pointer argument the kernel does not read (its constexpr flag is off)."""
    return buf if t is None else t


STATS_UNROLL = 4  # tiles of :func:`_stats_program` loaded per step. H200 run 56 (the op in a CUDA graph, channel
# balancing on, results/prologue_run56_*): one launch per tensor 0.189 / 0.326 ms at CogVideoX / Flux 16K; one
# launch for all three 0.178 / 0.301 with 1 tile per step, 0.167 / 0.287 with 2, 0.164 / 0.285 with 4


def chan_stats(*specs):
    """Per-chunk channel partials of up to three tensors of one head dim in one launch: each spec is
    ``(x_hnd (B, H, N, D) any strides, do_sum, range_mode)``; returns per spec ``(sum, min, max, nsplit)``,
    each (B·H, nsplit, D) fp32 or None (:func:`_stats_program`): the sum if ``do_sum``; ``range_mode`` 1
    the min and max, 2 the max of |x| (as ``max``), 0 neither."""
    args, consts, outs = [], [], []
    for x, do_sum, range_mode in specs:
        b, h, n, d = x.shape
        chunk = stats_chunk(n)
        nsplit = max(1, cdiv(n, chunk))
        e = lambda: torch.empty((b * h, nsplit, d), dtype=torch.float32, device=x.device)  # noqa: E731
        sm = e() if do_sum else None
        lo = e() if range_mode == 1 else None
        hi = e() if range_mode else None
        any_buf = next(t for t in (sm, hi) if t is not None)
        args.append([x, *(_or(t, any_buf) for t in (sm, lo, hi)), *x.stride(), h, n, nsplit, nsplit * b * h])
        consts.append((do_sum, range_mode, chunk))
        outs.append((sm, lo, hi, nsplit))
    nt = len(specs)
    d = args[0][0].shape[3]
    assert 1 <= nt <= 3 and all(a[0].shape[3] == d for a in args), "one to three tensors of one head dim"
    programs = sum(a[-1] for a in args)
    while len(args) < 3:  # unused slots: tensor 0 again, with no programs (never read: NT)
        args.append(args[0][:-1] + [0])
        consts.append(consts[0])
    flat = [*args[0], *args[1], *args[2][:-1], d]
    block_d = _block_d(d)
    launch(_chan_stats, (programs,))(*flat, *(c for cs in consts for c in cs), NT=nt,
                             BLOCK_N=max(1, min(64, STATS_TILE // block_d)), BLOCK_D=block_d, UNROLL=STATS_UNROLL)
    return outs


def token_stats(q_hnd: Optional[torch.Tensor], k_hnd: torch.Tensor, v_hnd: Optional[torch.Tensor],
                mean: Optional[torch.Tensor] = None):
    """The prologue's token reductions in two steps (:func:`chan_stats` over each given tensor, then one
    :func:`_stats_finalize`): ``(mean (B, Hkv, D), s (B, Hkv, D) or None, v scales (B, Hkv, D) or None)``,
    fp32. ``q_hnd`` given: the channel factors of (Q, K - mean); ``v_hnd`` given: V's FP8 scales;
    ``mean`` given (B, Hkv, D): used instead of K's own (then K's sum is not taken). K needs its min and
    max (max |k - mean| comes from them), Q and V only their largest magnitude (one accumulator)."""
    b, hkv, nk, d = k_hnd.shape
    rescale, do_v = q_hnd is not None, v_hnd is not None
    specs = {}
    if mean is None or rescale:
        specs["k"] = (k_hnd, mean is None, 1 if rescale else 0)
    if rescale:
        specs["q"] = (q_hnd, False, 2)
    if do_v:
        specs["v"] = (v_hnd, False, 2)
    parts = dict(zip(specs, chan_stats(*specs.values()))) if specs else {}
    none = (None, None, None, 1)
    ksum, kmin, kmax, sk = parts.get("k", none)
    _, _, qamax, sq = parts.get("q", none)
    vamax = parts.get("v", none)[2]
    dev = k_hnd.device
    mean_out = mean.contiguous() if mean is not None else torch.empty((b, hkv, d), dtype=torch.float32, device=dev)
    s = torch.empty((b, hkv, d), dtype=torch.float32, device=dev) if rescale else None
    vs = torch.empty((b, hkv, d), dtype=torch.float32, device=dev) if do_v else None
    g = q_hnd.shape[1] // hkv if rescale else 1
    launch(_stats_finalize, (b * hkv,))(*(_or(t, mean_out) for t in (qamax, ksum, kmin, kmax, vamax)), mean_out,
                                _or(s, mean_out), _or(vs, mean_out), g, sq, sk, nk, d, MEAN_GIVEN=mean is not None,
                                RESCALE=rescale, DO_V=do_v, BLOCK_D=_block_d(d))
    return mean_out, s, vs


def _grid_rows(n, bh, block):
    return (cdiv(n, block), bh)


def k_mean(k_hnd: torch.Tensor) -> torch.Tensor:
    """fp32 token mean of K per (batch, head): ``(B, H, D)`` (:func:`token_stats`' mean: the same bits as
    the one :func:`quantize` smooths with)."""
    return token_stats(None, k_hnd, None)[0]


ROWS_TILE = 8192  # elements per program of :func:`_quant_rows_int8` without K's groups (64 tokens at hd64)
K_WIDE_D = 128  # K's 128-token tiles from this head dim up run on 8 warps
# (run 56: 4096 and 64 were slower at CogVideoX 16K, 0.180 vs 0.167 ms, and equal at Flux, 0.285 vs 0.287;
# run 57: K's 168 registers at hd128 are not what limits it: 16 warps, or each tile read in 2 or 4 channel
# slices (fewer registers, more programs per SM), made the op 0.285 -> 0.30-0.37 ms at Flux 16K)
# Offline (Triton 3.6, sm_90, with the channel balance): K's hd128 program takes 168 registers, so one program of 8
# warps per SM (no second one whose loads overlap its arithmetic); capped at K_MAXNREG = 128 (two per SM) it spills
# 96 bytes around the calls of the channel reciprocals' IEEE divisions. The cap goes in a one-configuration
# ``triton.autotune``: torch 2.13's wrap_triton moves num_warps / num_stages into a config but leaves ``maxnreg``
# among the kernel's arguments (``SPECIAL_CONFIG_NAMES``), so a keyword would not reach Inductor's launch.
# H100 run 179 (bench_prologue --kernels, same process; Q's and K's row launches together, K's alone changed): Flux
# 16K 0.149 -> 0.122 ms, 4.6K 0.045 -> 0.037 ms, the same bits. Inductor (torch 2.11 / 2.13) drops ``maxnreg`` twice
# on the way to its launch of a user kernel (its ``config_to_dict`` and its compile options keep num_warps /
# num_stages only): H100 run 181, the traced op in Flux's 16K block, 0.155 ms (Q's and K's launches). So a traced call
# runs this kernel as an opaque op (:func:`quant_k_rows_capped`) from K_CAP_MIN_ELEMENTS elements of K, where the
# calls are long enough for the host to run ahead of the GPU (the op's Python call costs more host time than a launch
# of Inductor's); below, and at symbolic sizes, it stays an Inductor launch (uncapped). H100 runs 183-184, Flux's 16K
# block: the row launches 0.154 -> 0.125 ms, the block's non-GEMM, non-core kernels 0.816 -> 0.790 and 0.814 -> 0.788
# ms (the block's total within the core's spread).
K_MAXNREG = 128
K_CAP_MIN_ELEMENTS = 1 << 25  # (Flux 16K: 24 x 16384 x 128 = 50M; 4K: 13M)
_quant_rows_int8_wide = triton.autotune(configs=[triton.Config({}, num_warps=8, maxnreg=K_MAXNREG)],
                                        key=[])(_quant_rows_int8)


@torch.library.custom_op("sage_compile::quant_k_rows_capped", mutates_args=())
def quant_k_rows_capped(x_hnd: torch.Tensor, mean: Optional[torch.Tensor], channel: Optional[torch.Tensor],
                        channel_mode: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quant_rows_int8` of K (``k_groups``, head dim >= K_WIDE_D) as one opaque op, so that a traced call
    launches the kernel with its register cap (see K_MAXNREG). ``x_hnd`` (B, H, N, D) -> (int8 (B, H, N, D),
    fp32 scales (B, H, N))."""
    with eager_launches():
        return quant_rows_int8(x_hnd, mean, channel, channel_mode, k_groups=True)


@quant_k_rows_capped.register_fake
def _(x_hnd, mean, channel, channel_mode):
    b, h, n, d = x_hnd.shape
    return x_hnd.new_empty((b, h, n, d), dtype=torch.int8), x_hnd.new_empty((b, h, n), dtype=torch.float32)


def quant_rows_int8(x_hnd: torch.Tensor, mean: torch.Tensor | None = None, channel: torch.Tensor | None = None,
                    channel_mode: int = 0, k_groups: bool = False):
    """Per-token INT8 of ``x - mean`` (B, H, N, D) -> (int8 (B,H,N,D), fp32 scales (B,H,N)); with
    ``channel`` (B, Hc, D) fp32 (Hc divides H) the rows are first multiplied (``channel_mode=1``) or
    divided (2) by it per channel. ``k_groups``: the scales tied in K's groups
    (:func:`sage_compile.reference.quant.quant_int8_k_groups`)."""
    b, h, n, d = x_hnd.shape
    block_d = _block_d(d)
    wide = k_groups and block_d >= K_WIDE_D
    if wide and in_graph() and isinstance(x_hnd.numel(), int) and x_hnd.numel() >= K_CAP_MIN_ELEMENTS:
        return torch.ops.sage_compile.quant_k_rows_capped(x_hnd, mean, channel, channel_mode)
    y = torch.empty((b, h, n, d), dtype=torch.int8, device=x_hnd.device)
    s = torch.empty((b, h, n), dtype=torch.float32, device=x_hnd.device)
    block_n = K_GROUP_TILE if k_groups else max(1, min(64, ROWS_TILE // block_d))
    group = h // channel.shape[1] if channel is not None else 1
    launch(_quant_rows_int8_wide if wide else _quant_rows_int8, _grid_rows(n, b * h, block_n))(
        x_hnd, mean if mean is not None else s, channel if channel is not None else s, y, s, *x_hnd.stride(),
        h, group, n, d, HAS_MEAN=mean is not None, CH_MODE=channel_mode if channel is not None else 0,
        KGROUP=k_groups, BLOCK_N=block_n, BLOCK_D=block_d, EMULATE=EMULATE_FP8, **({} if wide else {"num_warps": 4}))
    return y, s


def channel_scales(q_hnd: torch.Tensor, k_hnd: torch.Tensor, mean: torch.Tensor,
                   balance_tokens: int = BALANCE_TOKENS) -> torch.Tensor:
    """:func:`sage_compile.reference.quant.channel_balance` of (Q's balance sample, K - mean) without
    materialising either (:func:`token_stats` with the given mean; Q's sample:
    :func:`sage_compile.reference.int8_fp8.token_sample`). ``mean``: (B, Hkv, D) fp32. Returns (B, Hkv, D)
    fp32."""
    return token_stats(token_sample(q_hnd, balance_tokens), k_hnd, None, mean=mean)[1]


def quant_v_fp8(v_hnd: torch.Tensor, scale: torch.Tensor, key_multiple: int = V_KEY_MULTIPLE):
    """Per-channel FP8 of V (B, H, N, D) given its scales (B, H, D) fp32 (:func:`token_stats`) -> (float8_e4m3fn
    (B,H,D,Np), the scales); Np = N rounded up to ``key_multiple``, zeros past N
    (:func:`sage_compile.reference.quant.quant_fp8_v`)."""
    b, h, n, d = v_hnd.shape
    npad = n + (-n) % key_multiple
    y = torch.empty((b, h, d, npad), dtype=torch.float8_e4m3fn, device=v_hnd.device)
    block_d = _block_d(d)
    block_n = max(1, min(64, 8192 // block_d))
    launch(_quant_v_fp8, _grid_rows(npad, b * h, block_n))(v_hnd, scale, y, *v_hnd.stride(), h, n, npad, d,
                                                   BLOCK_N=block_n, BLOCK_D=block_d, EMULATE=EMULATE_FP8)
    return y, scale


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "HND", channel_rescale: bool = False,
             balance_tokens: int = BALANCE_TOKENS):
    """Same contract as :func:`sage_compile.reference.int8_fp8.quantize`; inputs are never modified.

    The token reductions of Q (its balance sample, a strided view: ``balance_tokens``), K and V in one
    :func:`token_stats` (the K mean, with ``channel_rescale`` the Q/K channel factors, V's scales), then one
    INT8 / FP8 pass over each tensor (Q·s, (K - mean)/s).
    (Tried and dropped, code at 295bc0b: K's statistics last and K's pass first in reverse program order, so
    that its first tiles would still be in L2; the same bits, 0.7-2.9 % slower at CogVideoX 16K and Flux 4K / 16K,
    2 % faster at CogVideoX 4K: H100 run 153, ``benchmarks/results/prologue_run153_fd9c6b8_h100.log``.)"""
    q, k, v = (to_hnd(t, layout) for t in (q, k, v))
    mean, s, vs = token_stats(token_sample(q, balance_tokens) if channel_rescale else None, k, v)
    q8, qs = quant_rows_int8(q, None, s, 1) if channel_rescale else quant_rows_int8(q)
    k8, ks = quant_rows_int8(k, mean, s, 2, k_groups=True)  # (s is None without channel_rescale)
    v8, vs = quant_v_fp8(v, vs)
    return q8, qs, k8, ks, v8, vs
