"""Triton helpers shared by the kernels: exact rounding (RNE), the fp8 E4M3 cast, the E2M1 grid.

Triton's interpreter (``TRITON_INTERPRET=1``, the CPU test path) rounds fp32 -> e4m3 wrongly (no carry
into the exponent: 124 -> 64) and has no libdevice; there (``EMULATE``) the helpers round in fp32
arithmetic first so every cast is exact. Compiled kernels use the hardware conversions.
"""
import os

import torch
import triton
import triton.language as tl

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


@triton.jit
def to_e4m3(x, EMULATE: tl.constexpr):
    """fp32 (already clamped to ±448) -> float8e4nv, round to nearest even."""
    if EMULATE:
        bits = x.to(tl.int32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
        step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        y = x / step
        x = rne(y, EMULATE) * step
    return x.to(tl.float8e4nv)


@triton.jit
def round_e2m1(y, EMULATE: tl.constexpr):
    """fp32 -> nearest E2M1 value {0, .5, 1, 1.5, 2, 3, 4, 6} (RNE on ties, saturating at ±6), as fp32."""
    a = tl.minimum(tl.abs(y), 6.0)
    r = tl.where(a < 2.0, rne(a * 2.0, EMULATE) * 0.5,
                 tl.where(a < 4.0, rne(a, EMULATE), rne(a * 0.5, EMULATE) * 2.0))
    # copysign through the bits: Triton negates as 0 - r, which turns -0.0 into +0.0 on the GPU
    sign = (y.to(tl.int32, bitcast=True) >> 31) << 31
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


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
    uint8), 2 additive; expanded to ``(B, Hq, Lq, Lk)`` as a view (stride 0 on broadcast dims, no copy)."""
    if attn_mask is None:
        return dummy, 0, (0, 0, 0, 0)
    kind = 1 if attn_mask.dtype == torch.bool else 2
    mask = (attn_mask.view(torch.uint8) if kind == 1 else attn_mask).expand(b, hq, lq, lk)
    return mask, kind, mask.stride()
