"""Triton helpers shared by the kernels: exact rounding (RNE), the fp8 E4M3 cast, the E2M1 grid.

Triton's interpreter (``TRITON_INTERPRET=1``, the CPU test path) rounds fp32 -> e4m3 wrongly (no carry
into the exponent: 124 -> 64) and has no libdevice; there (``EMULATE``) the helpers round in fp32
arithmetic first so every cast is exact. Compiled kernels use the hardware conversions.
"""
import os

import torch
import triton
import triton.language as tl

from .._tracing import in_graph
from ..reference.layout import out_shape

EMULATE_FP8 = os.environ.get("TRITON_INTERPRET", "0") == "1"
_RNE = tl.constexpr(12582912.0)  # 1.5 * 2**23: (x + c) - c rounds |x| < 2**22 to the nearest integer, ties to even


@triton.jit
def rne(y, EMULATE: tl.constexpr):
    """Round fp32 to the nearest integer, ties to even (|y| < 2**22)."""
    if EMULATE:
        r = (y + _RNE) - _RNE
    else:
        r = tl.extra.cuda.libdevice.rint(y)
    return r


# Scales (and channel factors) in [FAST_DIV_MIN, FAST_DIV_MAX], or 0, divide through their reciprocal
# (:func:`div_by`); a tile with any other (tiny, huge, inf, NaN) takes the IEEE division.
FAST_DIV_MIN = tl.constexpr(8.673617379884035e-19)  # 2**-60
FAST_DIV_MAX = tl.constexpr(1.152921504606847e18)  # 2**60


@triton.jit
def fast_div_ok(s):
    """1 where ``s`` may be a divisor of :func:`div_by` (0, or within [2^-60, 2^60]), else 0 (int32)."""
    return ((s == 0.0) | ((s >= FAST_DIV_MIN) & (s <= FAST_DIV_MAX))).to(tl.int32)


@triton.jit
def recip(s):
    """``(RN(1/s), -s)``, the operands of :func:`div_by` for the divisor ``s`` (``(1, -1)`` where s is 0)."""
    safe = tl.where(s == 0.0, 1.0, s)
    return tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), safe), -safe


@triton.jit
def div_by(x, r, ns):
    """``x / s`` correctly rounded (the IEEE fp32 quotient; but +0 for x = -0) from ``r = RN(1/s)`` and
    ``ns = -s``, in three FMA-pipe instructions instead of a division per element (whose MUFU.RCP, FCHK and
    slow-path call made the prologue's quantizers issue-bound): q = x·r, then Markstein's correction
    q + (x - q·s)·r, the residual exact by the FMA. Exact for s in [2^-60, 2^60] (:func:`fast_div_ok`;
    10^8 pairs around rounding ties: benchmarks/diag_div_by.py; tests/test_kernel_int8_fp8_interpret.py) for
    every x whose quotient matters to INT8 or E4M3 (|x/s| >= 2^-11 keeps the residual normal; smaller ones
    round to 0 either way). For s = 0 pass r = 1, ns = -1: x itself."""
    q = x * r
    return tl.fma(tl.fma(q, ns, x), r, q)


@triton.jit
def int8_bits(y):
    """RNE(y) as int8 for |y| < 127.5 (so no clamp: y = x / RN(amax / 127) with |x| <= amax, a normal
    scale, is at most 127·(1 + 2^-23)) without a rounding or conversion instruction: y + 1.5·2^23 rounds
    to an integer, ties to even, whose two's complement is the float's low byte."""
    return (y + _RNE).to(tl.int32, bitcast=True).to(tl.int8)


@triton.jit
def or_sign(r, x):
    """``r`` (fp32) with ``x``'s sign bit OR-ed in: copysign for r >= 0 (|r| or +0.0), and -0.0 kept where
    arithmetic drops it (Triton negates as 0 - r, rne(-0.0) is +0.0; one LOP3 on the GPU)."""
    sign = (x.to(tl.int32, bitcast=True) >> 31) << 31
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(x, EMULATE: tl.constexpr):
    """fp32 (already clamped to ±448) -> float8e4nv, round to nearest even."""
    if EMULATE:
        bits = x.to(tl.int32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
        step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        y = x / step
        r = or_sign(rne(y, EMULATE) * step, x)  # (rne(-0.0) is +0.0: keep -0.0, and -tiny -> -0.0)
        # the interpreter's cast turns NaN into a number: NaN is 0x7F, as the GPU's satfinite cast gives
        nan = tl.full(x.shape, 0x7F, tl.int8).to(tl.float8e4nv, bitcast=True)
        return tl.where(x != x, nan, r.to(tl.float8e4nv))
    return x.to(tl.float8e4nv)


@triton.jit
def round_e2m1(y, EMULATE: tl.constexpr):
    """fp32 -> nearest E2M1 value {0, .5, 1, 1.5, 2, 3, 4, 6} (RNE on ties, saturating at ±6), as fp32."""
    a = tl.minimum(tl.abs(y), 6.0)
    r = tl.where(a < 2.0, rne(a * 2.0, EMULATE) * 0.5,
                 tl.where(a < 4.0, rne(a, EMULATE), rne(a * 0.5, EMULATE) * 2.0))
    return or_sign(r, y)  # (copysign through the bits: -r would turn -0.0 into +0.0)


@triton.jit
def e2m1_code(r):
    """Exact E2M1 value (fp32) -> 4-bit code (int32): magnitude index in bits 0-2, sign in bit 3."""
    a = tl.abs(r)
    mag = tl.where(a < 2.0, a * 2.0, tl.where(a < 4.0, a + 2.0, a * 0.5 + 4.0)).to(tl.int32)
    sign = (r.to(tl.int32, bitcast=True) >> 31) & 1  # the sign bit, so -0.0 keeps it (as the reference)
    return mag | (sign << 3)


@triton.jit
def round_e2m1_pos(a):
    """Non-negative fp32 -> nearest E2M1 value (RNE on ties, saturating at 6), as fp32: the same values as
    :func:`round_e2m1` for a >= 0, in two adds — (a + C) - C rounds to a multiple of ulp(C), ties to
    even, with C = 1.5·2^22 / 2^23 / 2^24 for the grid steps 0.5 / 1 / 2 of [0, 2) / [2, 4) / [4, 6]."""
    a = tl.minimum(a, 6.0)
    c = tl.where(a < 2.0, 6291456.0, tl.where(a < 4.0, 12582912.0, 25165824.0))
    return (a + c) - c


@triton.jit
def e2m1_f16(code):
    """4-bit E2M1 code (int32: magnitude index in bits 0-2, sign in bit 3) -> its exact value as fp16.
    The bits (e1 e0 m) placed at fp16 bits 9-11 read as value · 2^-14 (e = 0, the 0.5 code, lands on
    the subnormal 2^-15: the same formula), so one exact multiply by 2^14 finishes the decode."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True) * 16384.0


CAUSAL_CODES = {"none": 0, "top_left": 1, "bottom_right": 2}


def launch(kernel, grid):
    """``kernel[grid]``: the launcher, or under :func:`sage_compile._tracing.in_graph` its traceable wrapper (same
    arguments): then the launch is a graph op, which Inductor makes."""
    if in_graph():
        return torch.library.wrap_triton(kernel)[grid]
    return kernel[grid]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the host side of a launch (``triton.cdiv`` is a constexpr function in recent Tritons:
    a few microseconds a call through its wrapper, ~10 calls a training site-step)."""
    return -(-a // b)


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for 0): ``triton.next_power_of_2`` without its wrapper
    (see :func:`cdiv`)."""
    return 1 << max(0, int(n) - 1).bit_length()


def output_and_mask(b, hq, lq, lk, d_out, layout, out_dtype, attn_mask, device, dummy):
    """Allocate the output in ``layout`` and describe the mask for a kernel launch.

    Returns ``(out, (stride_b, stride_h, stride_n) of out, mask tensor, MASK_KIND, mask strides)``:
    MASK_KIND 0 none (``dummy`` stands in), 1 bool (read as uint8), 2 additive; the mask is expanded to
    ``(B, Hq, Lq, Lk)`` as a view (stride 0 on broadcast dims, no copy)."""
    out = torch.empty(out_shape(b, hq, lq, d_out, layout), dtype=out_dtype, device=device)
    return (out, bhn_strides(out, layout), *mask_view(attn_mask, b, hq, lq, lk, dummy))


def bhn_strides(t, layout):
    """(batch, head, token) strides of a (B, H, N, D) tensor stored in ``layout``."""
    s = t.stride()
    return (s[0], s[1], s[2]) if layout == "HND" else (s[0], s[2], s[1])


def mask_view(attn_mask, b, hq, lq, lk, dummy):
    """``(mask, MASK_KIND, strides)`` for a kernel launch: 0 none (``dummy`` stands in), 1 bool (read as
    uint8, or as bool under :func:`sage_compile._tracing.in_graph`), 2 additive; expanded to ``(B, Hq, Lq, Lk)``
    as a view (stride 0 on broadcast dims, no copy)."""
    if attn_mask is None:
        return dummy, 0, (0, 0, 0, 0)
    kind = 1 if attn_mask.dtype == torch.bool else 2
    # a traced call hands the bool mask over as it is (Inductor 2.11 cannot lower a bool -> uint8 view, run 125; the
    # kernels read either as ``!= 0``)
    reinterpret = kind == 1 and not in_graph()
    mask = (attn_mask.view(torch.uint8) if reinterpret else attn_mask).expand(b, hq, lq, lk)
    return mask, kind, mask.stride()
