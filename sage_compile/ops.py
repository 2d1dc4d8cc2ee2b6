"""Custom ops (``torch.ops.sage_compile.*``): one prologue and one core op per scheme, plus the composed
``attention`` op (the eager/API entry point), all with ``register_fake`` for dynamic shapes.

Dispatch goes through one registry, scheme x device type -> implementation module (``quantize`` and
``attention`` functions with the reference's signatures). The reference (:mod:`sage_compile.reference`)
serves every device; a kernel registers itself with :func:`register_impl` (one line per kernel).

Tensor layouts: q ``(B, Hq, Nq, D)`` and k/v ``(B, Hkv, Nk, D)`` for ``layout="HND"``, or
``(B, N, H, D)`` for ``"NHD"``; quantized tensors are always HND; the output follows ``layout``.
"""
from __future__ import annotations

import types
from typing import Optional

import torch
from torch import Tensor

from ._compat import cache_triton_access_analysis
from ._tracing import graph_launches
from .reference import exact as _exact
from .reference import fp4 as _ref_fp4
from .reference import int8_fp8 as _ref_int8_fp8
from .reference import int8_fp16 as _ref_int8_fp16
from .reference import int8_train as _ref_int8_train
from .reference.layout import LAYOUTS, as_token_major, out_shape, token_major_empty

CAUSAL = ("none", "top_left", "bottom_right")
QUANT_SCHEMES = ("int8_fp8", "int8_fp16", "fp4")

_REFERENCE = {"int8_fp8": _ref_int8_fp8, "int8_fp16": _ref_int8_fp16, "fp4": _ref_fp4, "int8_train": _ref_int8_train}
_IMPLS: dict[tuple[str, str], types.ModuleType] = {}


def register_impl(scheme: str, device_type: str, module) -> None:
    """Register a kernel module (``quantize``/``attention`` as in the reference) for scheme x device. Where
    ``auto`` chooses it is the policy's matter (:func:`sage_compile.policy.auto_scheme`)."""
    _IMPLS[(scheme, device_type)] = module


def impl_for(scheme: str, device_type: str):
    """The implementation used for ``scheme`` on ``device_type``: a registered kernel, else the reference."""
    _load_kernels(device_type)
    return _IMPLS.get((scheme, device_type), _REFERENCE[scheme])


def has_fast_impl(scheme: str, device_type: str) -> bool:
    _load_kernels(device_type)
    return (scheme, device_type) in _IMPLS


_loaded: set = set()


def _load_kernels(device_type: str) -> None:
    """Import the kernel package for a device type once (it registers what it can build there)."""
    if device_type in _loaded:
        return
    _loaded.add(device_type)
    if device_type == "cuda":
        try:
            from . import kernels  # noqa: F401  (registers CUDA implementations when triton is present)
        except ImportError:
            pass


# ------------------------------------------------------------------------------------------ checks
def check_inputs(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], causal: str, layout: str) -> None:
    """Raise a ValueError naming the problem for anything the ops cannot compute correctly."""
    if layout not in LAYOUTS:
        raise ValueError(f"sage_compile: layout must be one of {LAYOUTS}, got {layout!r}")
    if causal not in CAUSAL:
        raise ValueError(f"sage_compile: causal must be one of {CAUSAL}, got {causal!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"sage_compile: {name} must be 4-D ({layout}), got shape {tuple(t.shape)}")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"sage_compile: {name} dtype {t.dtype} unsupported (float16/bfloat16/float32)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"sage_compile: q/k/v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    hd = 1 if layout == "HND" else 2
    nd = 2 if layout == "HND" else 1
    b, hq, hkv = q.shape[0], q.shape[hd], k.shape[hd]
    if k.shape != v.shape:
        raise ValueError(f"sage_compile: k {tuple(k.shape)} and v {tuple(v.shape)} shapes differ")
    if k.shape[0] != b or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"sage_compile: q {tuple(q.shape)} and k {tuple(k.shape)} are incompatible")
    if hq % hkv:
        raise ValueError(f"sage_compile: {hq} query heads is not a multiple of {hkv} key/value heads")
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise ValueError(f"sage_compile: attn_mask must be bool or floating point, got {attn_mask.dtype}")
        try:
            torch.broadcast_shapes(attn_mask.shape, (b, hq, q.shape[nd], k.shape[nd]))
        except RuntimeError:
            raise ValueError(f"sage_compile: attn_mask {tuple(attn_mask.shape)} does not broadcast to "
                             f"(B, H, Lq, Lk) = {(b, hq, q.shape[nd], k.shape[nd])}") from None


def _hnd(t: Tensor, layout: str) -> tuple[int, int, int, int]:
    return tuple(t.shape) if layout == "HND" else (t.shape[0], t.shape[2], t.shape[1], t.shape[3])


def _contig(ts):
    return tuple(t.contiguous() for t in ts)


# ------------------------------------------------------------------------------------------ int8_fp8
@torch.library.custom_op("sage_compile::quantize_int8_fp8", mutates_args=())
def quantize_int8_fp8(q: Tensor, k: Tensor, v: Tensor, layout: str, channel_rescale: bool = False,
                      balance_tokens: int = _ref_int8_fp8.BALANCE_TOKENS
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """SageAttention2 prologue: K smoothing, (optional Q/K channel balancing), per-token INT8 Q, INT8 K
    with its token scales tied in SageAttention2's per-thread groups (reference.quant.quant_int8_k_groups),
    per-channel FP8 V (transposed, keys padded with zeros to a multiple of 16). ``balance_tokens``: the channel
    balance reads Q's ranges from a strided sample of at least that many queries (0: all; reference.int8_fp8)."""
    return _contig(impl_for("int8_fp8", q.device.type).quantize(q, k, v, layout, channel_rescale, balance_tokens))


@quantize_int8_fp8.register_fake
def _(q, k, v, layout, channel_rescale=False, balance_tokens=_ref_int8_fp8.BALANCE_TOKENS):
    b, hq, nq, d = _hnd(q, layout)
    _, hkv, nk, _ = _hnd(k, layout)
    e = q.new_empty
    return (e((b, hq, nq, d), dtype=torch.int8), e((b, hq, nq), dtype=torch.float32),
            e((b, hkv, nk, d), dtype=torch.int8), e((b, hkv, nk), dtype=torch.float32),
            e((b, hkv, d, nk + (-nk) % _ref_int8_fp8.V_KEY_MULTIPLE), dtype=torch.float8_e4m3fn),
            e((b, hkv, d), dtype=torch.float32))


@torch.library.custom_op("sage_compile::attention_int8_fp8", mutates_args=())
def attention_int8_fp8(q8: Tensor, qs: Tensor, k8: Tensor, ks: Tensor, v8: Tensor, vs: Tensor,
                       attn_mask: Optional[Tensor], causal: str, scale: Optional[float], layout: str,
                       out_dtype: torch.dtype) -> Tensor:
    """SageAttention2 core: INT8 QKᵀ, FP8 PV with two-level accumulation."""
    return impl_for("int8_fp8", q8.device.type).attention(q8, qs, k8, ks, v8, vs, attn_mask, causal, scale, layout, out_dtype)


@attention_int8_fp8.register_fake
def _(q8, qs, k8, ks, v8, vs, attn_mask, causal, scale, layout, out_dtype):
    b, h, n, d = q8.shape
    return q8.new_empty(out_shape(b, h, n, d, layout), dtype=out_dtype)


# ------------------------------------------------------------------------------------------ int8_fp16
@torch.library.custom_op("sage_compile::quantize_int8_fp16", mutates_args=())
def quantize_int8_fp16(q: Tensor, k: Tensor, v: Tensor, layout: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """SageAttention1 prologue: K smoothing, per-block INT8 Q (128 tokens) / K (64 tokens), fp16 V."""
    return _contig(impl_for("int8_fp16", q.device.type).quantize(q, k, v, layout))


@quantize_int8_fp16.register_fake
def _(q, k, v, layout):
    b, hq, nq, d = _hnd(q, layout)
    _, hkv, nk, _ = _hnd(k, layout)
    e = q.new_empty
    return (e((b, hq, nq, d), dtype=torch.int8), e((b, hq, -(-nq // 128)), dtype=torch.float32),
            e((b, hkv, nk, d), dtype=torch.int8), e((b, hkv, -(-nk // 64)), dtype=torch.float32),
            e((b, hkv, nk, d), dtype=torch.float16))


@torch.library.custom_op("sage_compile::attention_int8_fp16", mutates_args=())
def attention_int8_fp16(q8: Tensor, qs: Tensor, k8: Tensor, ks: Tensor, v16: Tensor, attn_mask: Optional[Tensor],
                        causal: str, scale: Optional[float], layout: str, out_dtype: torch.dtype) -> Tensor:
    """SageAttention1 core: INT8 QKᵀ, fp16 PV."""
    return impl_for("int8_fp16", q8.device.type).attention(q8, qs, k8, ks, v16, attn_mask, causal, scale, layout, out_dtype)


@attention_int8_fp16.register_fake
def _(q8, qs, k8, ks, v16, attn_mask, causal, scale, layout, out_dtype):
    b, h, n, d = q8.shape
    return q8.new_empty(out_shape(b, h, n, d, layout), dtype=out_dtype)


# ------------------------------------------------------------------------------------------ fp4
@torch.library.custom_op("sage_compile::quantize_fp4", mutates_args=())
def quantize_fp4(q: Tensor, k: Tensor, v: Tensor, layout: str, delta_s: str = "fp32", smooth: str = "qk",
                 q_block: int = 128, v_smooth: bool = False, qk_scale: str = "amax", qk_balance: bool = False
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """SageAttention3 prologue: K and Q-block-mean smoothing (ΔS, ``q_block`` query rows per mean), NVFP4
    Q/K (along D; ``qk_scale`` ``amax`` or ``search``, ``qk_balance``: Q/K channel ranges balanced first)
    and V (along N; minus its token mean with ``v_smooth``, returned last: (B, Hkv, D) fp32)."""
    return _contig(impl_for("fp4", q.device.type).quantize(q, k, v, layout, delta_s, smooth, q_block, v_smooth,
                                                            qk_scale, qk_balance))


@quantize_fp4.register_fake
def _(q, k, v, layout, delta_s="fp32", smooth="qk", q_block=128, v_smooth=False, qk_scale="amax", qk_balance=False):
    b, hq, nq, d = _hnd(q, layout)
    _, hkv, nk, _ = _hnd(k, layout)
    dp = d + (-d) % 16
    nk16 = nk + (-nk) % 16
    e = q.new_empty
    f8 = torch.float8_e4m3fn
    return (e((b, hq, nq, dp // 2), dtype=torch.uint8), e((b, hq, nq, dp // 16), dtype=f8),
            e((b, hkv, nk, dp // 2), dtype=torch.uint8), e((b, hkv, nk, dp // 16), dtype=f8),
            e((b, hkv, dp, nk16 // 2), dtype=torch.uint8), e((b, hkv, dp, nk16 // 16), dtype=f8),
            e((b, hq, -(-nq // q_block), nk), dtype=torch.float32), e((b, hkv, d), dtype=torch.float32))


@torch.library.custom_op("sage_compile::attention_fp4", mutates_args=())
def attention_fp4(qp: Tensor, qsc: Tensor, kp: Tensor, ksc: Tensor, vp: Tensor, vsc: Tensor, ds: Tensor,
                  vbar: Tensor, attn_mask: Optional[Tensor], causal: str, scale: Optional[float], layout: str,
                  out_dtype: torch.dtype, head_dim: int, p_scale: str = "unrounded") -> Tensor:
    """SageAttention3 core: NVFP4 QKᵀ + ΔS, two-level NVFP4 P, NVFP4 V (plus V's token mean ``vbar``)."""
    return impl_for("fp4", qp.device.type).attention(qp, qsc, kp, ksc, vp, vsc, ds, vbar, attn_mask, causal, scale,
                                                     layout, out_dtype, head_dim, p_scale)


@attention_fp4.register_fake
def _(qp, qsc, kp, ksc, vp, vsc, ds, vbar, attn_mask, causal, scale, layout, out_dtype, head_dim, p_scale="unrounded"):
    b, h, n, _ = qp.shape
    return qp.new_empty(out_shape(b, h, n, head_dim, layout), dtype=out_dtype)


# ------------------------------------------------------------------------------------------ int8_train
_TrainOut = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


@torch.library.custom_op("sage_compile::attention_train", mutates_args=())
def attention_train(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], causal: str, scale: Optional[float],
                    layout: str, psi: str = "split") -> _TrainOut:
    """SageBwd forward (INT8 QKᵀ and PV): returns ``(O in layout, LSE fp32 (B, Hq, Nq), q8, qs, k8, ks, v8, vs,
    k_mean)``, the last seven the quantized operands the forward used (the prologue's contract: INT8 (B, H, N, D),
    per-block fp32 scales, K's fp32 token mean (B, Hkv, 1, D)); its autograd formula is the SageBwd backward
    (:func:`attention_train_backward`), which takes those as they are: they are what autograd saves, not q, k, v
    (one byte a value kept instead of two, and no second quantization). ``attn_mask``: None, bool or additive,
    broadcastable to ``(B, Hq, Nq, Nk)`` (no gradient flows to it). ``psi``: the backward's INT8 scale granularity
    (``Options.int8_train_psi``)."""
    return _train_forward(q, k, v, attn_mask, causal, scale, layout, psi)


def _train_forward(q, k, v, attn_mask, causal, scale, layout, psi):
    if psi not in ("tile", "split"):
        raise ValueError(f"sage_compile: int8_train_psi must be 'tile' or 'split', got {psi!r}")
    o, lse, qt = impl_for("int8_train", q.device.type).quantize_forward(q, k, v, attn_mask, causal, scale, layout)
    return (as_token_major(o, layout), lse, *_contig(qt))


@attention_train.register_fake
def _(q, k, v, attn_mask, causal, scale, layout, psi="split"):
    b, hq, nq, d = _hnd(q, layout)
    hkv, nk = _hnd(k, layout)[1:3]
    f32, i8 = torch.float32, torch.int8
    nqb, nkb = -(-nq // _ref_int8_train.BLOCK_M), -(-nk // _ref_int8_train.BLOCK_N)
    return (token_major_empty(b, hq, nq, d, layout, dtype=q.dtype, device=q.device), q.new_empty((b, hq, nq), dtype=f32),
            q.new_empty((b, hq, nq, d), dtype=i8), q.new_empty((b, hq, nqb), dtype=f32),
            q.new_empty((b, hkv, nk, d), dtype=i8), q.new_empty((b, hkv, nkb), dtype=f32),
            q.new_empty((b, hkv, nk, d), dtype=i8), q.new_empty((b, hkv, nkb), dtype=f32),
            q.new_empty((b, hkv, 1, d), dtype=f32))


@torch.library.custom_op("sage_compile::attention_train_backward", mutates_args=())
def attention_train_backward(q8: Tensor, qs: Tensor, k8: Tensor, ks: Tensor, v8: Tensor, vs: Tensor, k_mean: Tensor,
                             o: Tensor, lse: Tensor, do: Tensor, attn_mask: Optional[Tensor], causal: str,
                             scale: Optional[float], layout: str, psi: str = "split") -> tuple[Tensor, Tensor, Tensor]:
    """SageBwd backward from the forward's quantized operands (:func:`attention_train`'s outputs 2-8): INT8 dV, dQ,
    dK; dO·Vᵀ in 16-bit. Returns ``(dq, dk, dv)`` in ``layout`` and O's dtype (the inputs')."""
    return _train_backward_impl(q8, qs, k8, ks, v8, vs, k_mean, o, lse, do, attn_mask, causal, scale, layout, psi)


def _train_backward_impl(q8, qs, k8, ks, v8, vs, k_mean, o, lse, do, attn_mask, causal, scale, layout, psi):
    impl = impl_for("int8_train", q8.device.type)
    dq, dk, dv = impl.backward(q8, qs, k8, ks, v8, vs, k_mean, o, lse, do, causal, scale, layout, o.dtype,
                               attn_mask=attn_mask, psi=psi)
    return tuple(as_token_major(t, layout) for t in (dq, dk, dv))


@attention_train_backward.register_fake
def _(q8, qs, k8, ks, v8, vs, k_mean, o, lse, do, attn_mask, causal, scale, layout, psi="split"):
    b, hq, nq, d = q8.shape
    hkv, nk = k8.shape[1:3]
    kw = dict(dtype=o.dtype, device=o.device)
    return (token_major_empty(b, hq, nq, d, layout, **kw), token_major_empty(b, hkv, nk, d, layout, **kw),
            token_major_empty(b, hkv, nk, d, layout, **kw))


def _train_setup(ctx, inputs, output):
    q, k, v, attn_mask, causal, scale, layout, psi = inputs
    o, lse, *qt = output
    ctx.save_for_backward(*qt, o, lse, attn_mask)
    ctx.causal, ctx.scale, ctx.layout, ctx.psi = causal, scale, layout, psi
    # the outputs past O carry no gradient: autograd would otherwise fill a zero tensor for each (q̂, k̂, V̂ included:
    # 3 x 67 MB at B·N = 32K, hd128, 16 heads; H100 run 186, 68 us a backward)
    ctx.set_materialize_grads(False)


def _backward_through(op):
    def backward(ctx, grad_o, grad_lse, *_quantized):
        if grad_o is None:  # (O unused: nothing flows back)
            return None, None, None, None, None, None, None, None
        *qt, o, lse, attn_mask = ctx.saved_tensors
        do = grad_o if grad_o.stride(-1) == 1 else grad_o.contiguous()  # (the kernels read dO at its strides)
        dq, dk, dv = op(*qt, o, lse, do, attn_mask, ctx.causal, ctx.scale, ctx.layout, ctx.psi)
        return dq, dk, dv, None, None, None, None, None

    return backward


attention_train.register_autograd(_backward_through(torch.ops.sage_compile.attention_train_backward),
                                  setup_context=_train_setup)


@torch.library.custom_op("sage_compile::train_mask_gate", mutates_args=())
def train_mask_gate(attn_mask: Tensor, b: int, hq: int, lq: int, lk: int) -> Tensor:
    """The training kernels' device-side check of a head-shared bool ``attn_mask`` (broadcastable to (B, Hq, Lq, Lk)):
    int32 (2 + 2B), [0] 1 causal bottom-right, 2 all true, 0 anything else, [1] the same within each batch's key
    range (key padding), then the key ranges (:func:`sage_compile.kernels.int8_train.attention.mask_gate`). The
    traced training ops call it as one opaque op, so that torch.compile's CSE merges the calls of every site on the
    same mask, and the backward's, into one."""
    from .kernels._common import mask_view
    from .kernels.int8_train.attention import mask_gate

    return mask_gate(mask_view(attn_mask, b, hq, lq, lk, attn_mask)[0], b, lq, lk)


@train_mask_gate.register_fake
def _(attn_mask, b, hq, lq, lk):
    return attn_mask.new_empty((2 + 2 * b,), dtype=torch.int32)


# The same two ops as triton_ops, which torch.compile traces through (what the graph rewrite emits on CUDA; see
# ``Options.prologue``): the graph then holds K's mean and the allocations as ATen ops, the Triton launches
# (``torch.library.wrap_triton``) and the CUDA kernels (the extension's torch ops), and the kernels' Python host
# code (mask plan, kernel choice, launch arguments) runs once per compile instead of once per call. Same kernels,
# same quantized values; K's mean is Inductor's reduction (summation order may differ).
cache_triton_access_analysis()  # (each launch of every site would generate its kernel's TTIR again)


@torch.library.triton_op("sage_compile::attention_train_traced", mutates_args=())
def attention_train_traced(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], causal: str,
                           scale: Optional[float], layout: str, psi: str = "split") -> _TrainOut:
    """:func:`attention_train`, traced by torch.compile (same arguments and results)."""
    with graph_launches():
        return _train_forward(q, k, v, attn_mask, causal, scale, layout, psi)


@torch.library.triton_op("sage_compile::attention_train_backward_traced", mutates_args=())
def attention_train_backward_traced(q8: Tensor, qs: Tensor, k8: Tensor, ks: Tensor, v8: Tensor, vs: Tensor,
                                    k_mean: Tensor, o: Tensor, lse: Tensor, do: Tensor, attn_mask: Optional[Tensor],
                                    causal: str, scale: Optional[float], layout: str,
                                    psi: str = "split") -> tuple[Tensor, Tensor, Tensor]:
    """:func:`attention_train_backward`, traced by torch.compile (same arguments and results)."""
    with graph_launches():
        return _train_backward_impl(q8, qs, k8, ks, v8, vs, k_mean, o, lse, do, attn_mask, causal, scale, layout,
                                    psi)


attention_train_traced.register_autograd(
    _backward_through(torch.ops.sage_compile.attention_train_backward_traced), setup_context=_train_setup)


@torch.library.triton_op("sage_compile::quantize_int8_fp8_traced", mutates_args=())
def quantize_int8_fp8_traced(q: Tensor, k: Tensor, v: Tensor, layout: str, channel_rescale: bool = False,
                             balance_tokens: int = _ref_int8_fp8.BALANCE_TOKENS
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`quantize_int8_fp8`, traced by torch.compile (same arguments and results): the graph holds its
    allocations and Triton launches, Inductor makes them, and the kernels' host code runs once per compile."""
    with graph_launches():
        return _contig(impl_for("int8_fp8", q.device.type).quantize(q, k, v, layout, channel_rescale, balance_tokens))


@torch.library.triton_op("sage_compile::attention_int8_fp8_traced", mutates_args=())
def attention_int8_fp8_traced(q8: Tensor, qs: Tensor, k8: Tensor, ks: Tensor, v8: Tensor, vs: Tensor,
                              attn_mask: Optional[Tensor], causal: str, scale: Optional[float], layout: str,
                              out_dtype: torch.dtype) -> Tensor:
    """:func:`attention_int8_fp8`, traced by torch.compile (same arguments and results): the Triton launches and
    the CUDA core's torch op in the graph. The core (CUDA or Triton) is chosen while the call is traced: the
    measured choice for the shape, measured then on real inputs of the call's sizes where none is known
    (:func:`sage_compile.kernels.int8_fp8.cuda.prefer_cuda_traced`)."""
    with graph_launches():
        return impl_for("int8_fp8", q8.device.type).attention(q8, qs, k8, ks, v8, vs, attn_mask, causal, scale,
                                                              layout, out_dtype)


# ------------------------------------------------------------------------------------------ composed
def run_scheme(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], causal: str, scale: Optional[float],
               layout: str, scheme: str, options=None) -> Tensor:
    """Prologue op + core op of ``scheme`` (what the graph rewrite emits, as plain calls)."""
    ops = torch.ops.sage_compile
    if scheme == "exact":
        return _exact.attention(q, k, v, attn_mask, causal, scale, layout)
    from .config import Options

    o = options or Options()
    if scheme == "int8_fp8":
        qt = ops.quantize_int8_fp8(q, k, v, layout, o.int8_channel_rescale, o.int8_balance_tokens)
        return ops.attention_int8_fp8(*qt, attn_mask, causal, scale, layout, q.dtype)
    if scheme == "int8_fp16":
        return ops.attention_int8_fp16(*ops.quantize_int8_fp16(q, k, v, layout), attn_mask, causal, scale, layout, q.dtype)
    if scheme == "fp4":
        qt = ops.quantize_fp4(q, k, v, layout, o.fp4_delta_s, o.fp4_smooth, o.fp4_q_block, o.fp4_v_smooth,
                              o.fp4_qk_scale, o.fp4_qk_balance)
        return ops.attention_fp4(*qt, attn_mask, causal, scale, layout, q.dtype, q.shape[-1], o.fp4_p_scale)
    if scheme == "int8_train":
        if attn_mask is not None and causal != "none":
            raise ValueError("sage_compile: int8_train takes a causal rule or an attn_mask, not both")
        return ops.attention_train(q, k, v, attn_mask, causal, scale, layout, o.int8_train_psi)[0]
    raise ValueError(f"sage_compile: unknown or unimplemented scheme {scheme!r}")


@torch.library.custom_op("sage_compile::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, causal: str = "none",
              scale: Optional[float] = None, layout: str = "HND", scheme: str = "int8_fp8",
              options: str = "") -> Tensor:
    """Quantized attention, eager/API entry point (prologue and core composed).

    Args:
        q: ``(B, Hq, Nq, D)`` (HND) or ``(B, Nq, Hq, D)`` (NHD); k, v: same with Hkv heads, Nk tokens.
            Hq must be a multiple of Hkv (GQA/MQA).
        attn_mask: bool (True = attend) or additive float, broadcastable to ``(B, Hq, Nq, Nk)``.
        causal: ``none``, ``top_left`` (SDPA's is_causal) or ``bottom_right`` (FlashAttention's).
        scale: softmax scale, default ``D ** -0.5``.
        scheme: ``exact`` | ``int8_fp16`` | ``int8_fp8`` | ``fp4``; :func:`sage_compile.override` (run
            time) replaces it.
        options: :meth:`sage_compile.config.Options.encode` of the numeric options ("" = defaults).
    Returns:
        Output in ``layout`` and q's dtype. Gradients (if needed) are those of exact attention
        (straight-through); use the ``int8_train`` scheme for quantized training once it lands.
    """
    from . import steps
    from .config import Options

    check_inputs(q, k, v, attn_mask, causal, layout)
    scheme = steps.current() or scheme
    return run_scheme(q, k, v, attn_mask, causal, scale, layout, scheme, Options.decode(options)).contiguous()


@attention.register_fake
def _(q, k, v, attn_mask=None, causal="none", scale=None, layout="HND", scheme="int8_fp8", options=""):
    return q.new_empty(q.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, causal, scale, layout, scheme, options = inputs
    ctx.save_for_backward(q, k, v, attn_mask)
    ctx.causal, ctx.scale, ctx.layout = causal, scale, layout


def _backward(ctx, grad_out):
    q, k, v, attn_mask = ctx.saved_tensors
    dq, dk, dv = exact_backward(q, k, v, attn_mask, ctx.causal, ctx.scale, ctx.layout, grad_out)
    return dq, dk, dv, None, None, None, None, None, None


def exact_backward(q, k, v, attn_mask, causal, scale, layout, grad_out):
    """Gradients of exact attention (fp32 math; O(N²) memory), summed over GQA groups."""
    from .reference import engine
    from .reference.layout import to_hnd

    qh, kh, vh, go = (to_hnd(t, layout).float() for t in (q, k, v, grad_out))
    hq, hkv = qh.shape[1], kh.shape[1]
    kx, vx = engine.gqa_expand(kh, hq), engine.gqa_expand(vh, hq)
    sm = engine.default_scale(scale, qh.shape[-1])
    s = (qh @ kx.transpose(-1, -2)) * sm
    m = _exact.combined_mask(attn_mask, causal, qh.shape[2], kh.shape[2], q.device)
    if m is not None:
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    dvx = p.transpose(-1, -2) @ go
    dp = go @ vx.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq = (ds @ kx) * sm
    dkx = (ds.transpose(-1, -2) @ qh) * sm
    g = hq // hkv
    dk = dkx.unflatten(1, (hkv, g)).sum(2)
    dv = dvx.unflatten(1, (hkv, g)).sum(2)
    back = (lambda t: t) if layout == "HND" else (lambda t: t.transpose(1, 2))
    return back(dq).to(q.dtype), back(dk).to(k.dtype), back(dv).to(v.dtype)


attention.register_autograd(_backward, setup_context=_setup_context)
