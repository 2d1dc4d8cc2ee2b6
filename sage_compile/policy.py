"""The policy: the only place that knows what each scheme supports, and says why not.

``decide(site, config, device_type)`` -> :class:`Decision` (a scheme, or ``None`` = keep the original
SDPA / hand-written code, with the reason). Passes know nothing of kernels; kernels know nothing of FX.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_HEAD_DIM_TRAIN_CUDA = 128  # the int8_train Triton kernels (registers of the backward's accumulators)
# Schemes with an implementation (reference on any device); int8_train lands with the SageBwd issue.
IMPLEMENTED = ("exact", "int8_fp16", "int8_fp8", "fp4", "int8_train")


# prologue="graph" (the quantizer as graph ops Inductor fuses with RoPE / QK-norm) is honoured on these device
# types. CUDA needs stride padding off (sage_compile._compat.graph_prologue_inductor_patches, set by the
# backend: on torch 2.11 it read a per-token scale buffer with padded strides that had been written unpadded:
# CogVideoX's attention came out wrong, benchmarks/diag_graph_prologue.py). The quantizers' divisions are
# exact without an Inductor option (fp64, rounded once: sage_compile.reference.quant.div_rn).
GRAPH_PROLOGUE_DEVICES = ("cpu", "cuda")


def graph_prologue(options, device_type: str) -> bool:
    """Whether a site on ``device_type`` gets its prologue as graph ops (else the prologue op)."""
    return options.prologue == "graph" and device_type in GRAPH_PROLOGUE_DEVICES


@dataclasses.dataclass
class Decision:
    scheme: Optional[str]  # None: keep the site as it is
    reason: str
    notes: tuple = ()
    fallback: bool = False  # kept because unsupported (strict mode raises on these)

    @property
    def replaced(self) -> bool:
        return self.scheme is not None


class UnsupportedSite(RuntimeError):
    """Raised in strict mode (``SAGE_COMPILE_STRICT=1``) for a site that falls back."""


def auto_scheme(device_type: str, needs_grad: bool) -> str:
    """``auto``: on CUDA the fastest scheme meeting the accuracy goals; on CPU ``exact`` (no CPU
    emulation beats SDPA). A kernel is eligible only once it is registered as faster than SDPA
    (``ops.register_impl(..., auto=True)``); until then the CUDA choice is ``exact`` too."""
    if needs_grad or device_type != "cuda":
        return "exact"
    from . import ops

    return "int8_fp8" if ops.auto_enabled("int8_fp8", device_type) else "exact"


def decide(site, config, device_type: str) -> Decision:
    """Choose a scheme for ``site`` (a :class:`sage_compile.passes.site.Site`)."""
    if site.reject_reason:
        return Decision(None, site.reject_reason, fallback=True)
    if site.dropout_p:
        return Decision(None, f"dropout_p={site.dropout_p:g} in training: kept", fallback=True)
    if site.dtype not in SUPPORTED_DTYPES:
        return Decision(None, f"dtype {site.dtype} unsupported (fp16/bf16/fp32 only): kept", fallback=True)
    if site.head_dim > MAX_HEAD_DIM or site.head_dim_v != site.head_dim:
        return Decision(None, f"head_dim {site.head_dim}/{site.head_dim_v} unsupported (equal and <= {MAX_HEAD_DIM}): kept", fallback=True)
    if site.dtypes != (site.dtype,) * 3:
        return Decision(None, f"q/k/v dtypes differ {site.dtypes}: kept", fallback=True)
    if site.hq % site.hkv:
        return Decision(None, f"{site.hq} query heads not a multiple of {site.hkv} kv heads: kept", fallback=True)
    if site.mask_kind not in ("none", "bool", "additive"):
        return Decision(None, f"mask {site.mask_kind} unsupported: kept", fallback=True)
    if site.causal != "none" and site.mask_kind != "none":
        return Decision(None, "causal together with an explicit mask (SDPA rejects it): kept", fallback=True)
    scheme = config.kernel
    if config.site_override is not None:
        scheme = config.site_override(site) or scheme
    if scheme == "auto":
        scheme = auto_scheme(device_type, site.requires_grad)
        why = f"auto on {device_type}" + (" (gradients needed)" if site.requires_grad else "")
    else:
        why = f"requested {scheme}"
    if site.requires_grad and scheme not in ("exact", "int8_train"):
        return Decision(None, f"gradients needed: {scheme} is inference-only, kept exact (use int8_train)",
                        fallback=True)
    if scheme not in IMPLEMENTED:
        return Decision(None, f"scheme {scheme} not implemented yet: kept", fallback=True)
    if scheme == "int8_train" and device_type == "cuda" and site.head_dim > MAX_HEAD_DIM_TRAIN_CUDA:
        return Decision(None, f"int8_train on CUDA supports head_dim <= {MAX_HEAD_DIM_TRAIN_CUDA}, not "
                              f"{site.head_dim}: kept", fallback=True)
    if scheme == "exact":
        return Decision(None, f"exact ({why}): kept as SDPA", fallback=False)
    notes = []
    if config.options.prologue == "graph" and scheme != "int8_train" and not graph_prologue(config.options, device_type):
        notes.append(f"prologue='graph' is not used on {device_type} (not validated there): prologue op")
    if scheme == "fp4" and site.head_dim % 16:
        notes.append(f"head_dim {site.head_dim} padded to {site.head_dim + (-site.head_dim) % 16} for fp4")
    if device_type != "cpu":
        from . import ops

        if not ops.has_fast_impl(scheme, device_type):
            notes.append(f"no {scheme} kernel on {device_type}: the pure-PyTorch reference runs (same numerics, "
                         "O(N²) work in many small ops: far slower than SDPA at long sequences)")
    return Decision(scheme, why, tuple(notes))
