"""The graph prologues: each scheme's quantizer as torch code that the rewrite puts in the model's graph
(``prologue="graph"``), so that Inductor fuses it with the ops that produce q/k/v (RoPE, QK-norm).

They compute the bits of the scheme's reference quantizer (``sage_compile.reference.<scheme>.quantize``;
tests compare them bit for bit on CPU and GPU), written for Inductor's fusion rather than for reading:

* ``int8_fp8`` works in token-major order ``(B, N, H, D)``: the order of the NHD tensors diffusers'
  models hand to attention and of the projections' output that RoPE and QK-norm read, so the statistics
  pass, the quantizing pass and the producers share one loop order (the HND reference's order made
  Inductor split producer and quantizer: generated code of ``benchmarks/diag_prologue_codegen.py``).
  The smoothed K, ``(k - mean) / s``, is written out twice, once for the per-token amax and once for the
  quantizing pass: one expression with two consumers in two kernels is one Inductor stores in fp32
  (``should_realize_on_reuse``: more than ``realize_reads_threshold`` reads, here RoPE's inputs and the
  statistics), a write and a read of 8 bytes per element of K, where each copy re-reads RoPE's bf16 inputs
  instead. Inductor's loop-level CSE never merges the copies across kernels.

With :func:`sage_compile._compat.graph_prologue_inductor_patches` (``realize_opcount_threshold`` 100) the
generated GPU code for Flux's joint attention block at 1K tokens (``diag_prologue_codegen.py``, torch 2.11)
has 12 kernels and moves 13.8 bytes per q/k/v element over plain Inductor's (the reference: 15 kernels,
25.6; the prologue op: 15); CogVideoX-2B's: 14.7 (reference 19.0).

The other schemes use their reference quantizer as it is.
"""
from __future__ import annotations

import importlib

import torch

from .reference.int8_fp8 import V_KEY_MULTIPLE
from .reference.layout import to_hnd
from .reference.quant import (_int8_values, channel_balance, div_rn, int8_token_scales, k_group_scales, quant_fp8_v,
                              smoothed_amax)


def int8_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "HND", channel_rescale: bool = False):
    """:func:`sage_compile.reference.int8_fp8.quantize`'s bits, token-major (see the module docstring).

    q ``(B, Hq, Nq, D)``, k/v ``(B, Hkv, Nk, D)`` in ``layout`` (never modified). Returns ``(q8 (B,Hq,Nq,D)
    int8, qs (B,Hq,Nq) f32, k8 (B,Hkv,Nk,D) int8, ks (B,Hkv,Nk) f32, v8 (B,Hkv,D,Nk16) float8_e4m3fn,
    vs (B,Hkv,D) f32)``, contiguous."""
    qn, kn = (to_hnd(t, layout).transpose(1, 2) for t in (q, k))  # (B, N, H, D) views
    hq, hkv = qn.shape[2], kn.shape[2]
    mean = kn.float().mean(dim=1, keepdim=True)  # (B, 1, Hkv, D)
    qf = qn.float()
    s = None
    if channel_rescale:  # channel_balance on HND views of the same tensors: (B, Hkv, 1, D) -> (B, 1, Hkv, D)
        k_amax = smoothed_amax(kn.transpose(1, 2), mean.transpose(1, 2))
        s = channel_balance(qn.transpose(1, 2), kn.transpose(1, 2), k_amax).transpose(1, 2)
        qf = qf * (s if hq == hkv else s.repeat_interleave(hq // hkv, dim=2))

    def smoothed_k():  # a fresh expression per call: one consumer each
        ksm = kn.float() - mean
        return ksm if s is None else div_rn(ksm, s)

    qs = int8_token_scales(qf)  # (B, Nq, Hq)
    q8 = _int8_values(qf, qs)
    ks = k_group_scales(int8_token_scales(smoothed_k()).transpose(1, 2))  # (B, Hkv, Nk)
    k8 = _int8_values(smoothed_k(), ks.transpose(1, 2))
    v8, vs = quant_fp8_v(to_hnd(v, layout), V_KEY_MULTIPLE)
    return (q8.transpose(1, 2).contiguous(), qs.transpose(1, 2).contiguous(), k8.transpose(1, 2).contiguous(),
            ks.contiguous(), v8, vs)


_GRAPH = {"int8_fp8": int8_fp8}


def for_scheme(scheme: str):
    """The graph prologue of ``scheme``: this module's where it has one, else the reference quantizer."""
    if scheme in _GRAPH:
        return _GRAPH[scheme]
    return importlib.import_module(f"sage_compile.reference.{scheme}").quantize
