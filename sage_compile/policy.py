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
# prologue="auto" (the default) gives these schemes' CUDA sites the prologue op when the attention is large,
# B·Hq·Nq·Nk·D >= OP_PROLOGUE_MIN_WORK (static sizes, or their hints), and the graph prologue below. H200,
# int8_fp8, runs 49-51 (benchmarks/results/e2e_{cogvideox,flux}_run5[01]_*, block_h200_run49_*): with the
# op's fused channel statistics the op beats the graph prologue at both real models, CogVideoX-2B (17,776
# tokens: work 6.1e11) 222.8 vs 225.6 ms a step, first compile 44.5 vs 83.7 s (Inductor + cuDNN: 260.8 ms,
# 50.3 s), and Flux-dev (4,608 tokens: 6.5e10) 132.8 vs 135.7 ms, 74.8 vs 219.9 s (cuDNN 129.3 ms, 84.2 s);
# its kernels take less GPU time in a lone block at 4K and 16K tokens (CogVideoX 16K: 0.28 vs 0.41 ms), but
# ~0.3 ms of host time per call, which a small attention cannot hide (a lone CogVideoX block at 4K: 1.32 vs
# 0.89 ms wall), so small sites keep the graph prologue. Other schemes keep the graph prologue (not measured).
OP_PROLOGUE_MIN_WORK = 2 ** 34
OP_PROLOGUE_SCHEMES = ("int8_fp8",)
# prologue="auto" gives these schemes the prologue op on every device, whatever the size: fp4's graph prologue,
# with its Q/K block-scale search (13 candidate scales per block), made the CPU TinyLlama's first call 87.7 s
# (32.1 s with amax scales) against 4.5 s with the op (benchmarks/diag_fp4_compile.py,
# benchmarks/results/fp4_prologue_compile_cpu.log), and fp4 has no speed to gain from fusing its prologue
# (exact emulation on Hopper).
OP_PROLOGUE_ALWAYS = ("fp4",)
# prologue="traced": the schemes with traced prologue and core ops (torch.library.triton_op: Inductor launches the
# kernels; sage_compile.ops.quantize_int8_fp8_traced), on any device (on the CPU the reference, traced).
# prologue="auto" gives them to these schemes' CUDA sites of static sizes, whatever the size: the op's kernels
# without its host time per call. H100 run 160 (benchmarks/results/block_run160_*), a lone block's ms, traced /
# prologue op / graph prologue / cuDNN: Flux 1K 0.580 / 1.042 / 0.763 / 0.429, 4K 1.109 / 1.108 / 1.204 / 1.093,
# 16K 6.702 / 6.661 / 7.085 / 7.944; CogVideoX 4K 0.632 / 1.050 / 0.795 / 0.616, 16K 4.536 / 4.559 / 4.731 / 6.103
# (host time per call 0.46-0.64 ms traced, 0.96-1.32 op). Runs 160-162 (host-bound 1K and 4K blocks, noisy hosts):
# the fastest sage variant in 13 of 15 measurements. Flux-dev's step (run 163): 130.53 ms against cuDNN's 131.57
# and the op's 131.96. Symbolic sizes keep the rule above (a traced call of symbolic sizes cannot time the two
# cores: it takes the CUDA core unmeasured).
TRACED_SCHEMES = ("int8_fp8",)


def graph_prologue(options, device_type: str) -> bool:
    """Whether sites on ``device_type`` may get their prologue as graph ops (``prologue`` ``graph`` or
    ``auto``; else, or on another device type, the prologue op)."""
    return options.prologue in ("graph", "auto") and device_type in GRAPH_PROLOGUE_DEVICES


def _hint(n) -> Optional[int]:
    """A size as an int without guarding on it (a symbolic size's hint; None where it has none)."""
    if isinstance(n, torch.SymInt):
        return n.node.hint if hasattr(n.node, "hint") else None
    return int(n)


def static_sizes(site) -> bool:
    """Whether ``site``'s q and k sizes are known and all plain ints (no symbolic size)."""
    if site is None or getattr(site, "q_shape", None) is None or getattr(site, "k_shape", None) is None:
        return False
    return not any(isinstance(n, torch.SymInt) for n in (*site.q_shape, *site.k_shape))


def attention_work(site) -> Optional[int]:
    """B·Hq·Nq·Nk·D of ``site`` (size hints for symbolic sizes), None where a size (or the site) is unknown."""
    if site is None:
        return None
    qs, ks = site.q_shape, site.k_shape
    if qs is None or ks is None:
        return None
    sizes = [_hint(x) for x in (*qs, ks[2])]
    if any(x is None for x in sizes):
        return None
    b, h, nq, d, nk = sizes
    return b * h * nq * nk * d


def prologue_for(site, options, scheme: str, device_type: str) -> str:
    """``graph``, ``op`` or ``traced``: how ``site``'s prologue is emitted under ``options.prologue`` (see
    :data:`TRACED_SCHEMES`, :data:`OP_PROLOGUE_MIN_WORK` and :data:`OP_PROLOGUE_ALWAYS` for ``auto``; ``traced``
    for the schemes of :data:`TRACED_SCHEMES`, the op for the others)."""
    if options.prologue == "traced":
        return "traced" if scheme in TRACED_SCHEMES else "op"
    if options.prologue == "auto" and device_type == "cuda" and scheme in TRACED_SCHEMES and static_sizes(site):
        return "traced"
    if not graph_prologue(options, device_type):
        return "op"
    if options.prologue == "auto" and scheme in OP_PROLOGUE_ALWAYS:
        return "op"
    if options.prologue == "auto" and device_type == "cuda" and scheme in OP_PROLOGUE_SCHEMES:
        work = attention_work(site)
        if work is not None and work >= OP_PROLOGUE_MIN_WORK:
            return "op"
    return "graph"


def train_prologue(options, device_type: str) -> str:
    """``graph`` or ``op`` for an ``int8_train`` site: ``graph`` emits the traced op
    (:func:`sage_compile.ops.attention_train_traced`: torch.compile sees its prologue and launches; the kernels'
    host code runs once per compile), ``op`` the opaque one. ``auto``: the traced op on CUDA (the SmolLM2-shape
    compiled step is host-bound: run 125, 69.1 vs 98.7 ms a step with the opaque op), whatever the site: static and
    symbolic sizes (run 126), no mask, a bool mask (run 128) or an additive one (run 134) gave the opaque ops' values
    on a GPU; the opaque one on other devices (the CPU reference would be compiled by Inductor: longer compiles, no
    speed to gain); ``graph`` on the graph-prologue devices; ``traced`` on every device."""
    if options.prologue == "auto":
        return "graph" if device_type == "cuda" else "op"
    if options.prologue == "traced":
        return "graph"
    return "graph" if options.prologue == "graph" and device_type in GRAPH_PROLOGUE_DEVICES else "op"


@dataclasses.dataclass
class Decision:
    scheme: Optional[str]  # None: keep the site as it is
    reason: str
    notes: tuple = ()
    fallback: bool = False  # kept because unsupported (strict mode raises on these)
    prologue: Optional[str] = None  # graph | op: how a replaced site's quantization prologue is emitted

    @property
    def replaced(self) -> bool:
        return self.scheme is not None


class UnsupportedSite(RuntimeError):
    """Raised in strict mode (``SAGE_COMPILE_STRICT=1``) for a site that falls back."""


# auto on CUDA (inference): int8_fp8 at the sites where it is measured faster than SDPA with its default (traced,
# channel-balanced) prologue, SDPA elsewhere (conventions.md: auto is the fastest scheme meeting the accuracy goals
# for the site). That takes the sm90 CUDA core (the Triton core with its prologue ties cuDNN at hd128 16K and
# loses at hd64: 642 vs 643, 418 vs 476 TOPS, H100 run 151), head dim 64 or 128 (the CUDA core's), a 16-bit
# site without an additive mask, and at least AUTO_INT8_FP8_MIN_TOKENS queries and keys
# (AUTO_INT8_FP8_MIN_TOKENS_CAUSAL causal, where the core's work halves and the prologue's does not): the
# prologue's cost grows with N, the core's saving with N². H100 runs 168 and 170 (benchmarks/bench_auto.py: one
# SDPA call compiled by Inductor, cuDNN, against backend="sage" naming int8_fp8, batch 1, 24 heads at hd128 and
# 30 at hd64; results/auto_run1{68,70}_*), speed-up at 4K / 8K / 12K / 16K tokens: hd128 0.87 / 1.17 (1.15) /
# 1.30 (1.28) / 1.32x, causal 0.75 / 1.06 (1.06) / 1.24 (1.23) / 1.33x; hd64 0.97 / 1.17 (1.16) / 1.24 (1.24) /
# 1.27x, causal 0.52 / 0.98 (0.99) / 1.13 (1.14) / 1.20x (run 170's repeat in brackets). Attention blocks with
# RoPE and QK-norm agree at 4K and 16K (block_run16[67]_*, H100, traced prologue, attention part ms): Flux 16K
# 4.827 vs 6.144, 4K 0.600 vs 0.571; CogVideoX 16K 3.873 vs 5.408, 4K 0.431 vs 0.431; H200 (block_run155_*,
# prologue op, block ms): Flux 16K 6.495 vs 7.902, CogVideoX 16K 4.419 vs 6.039, Flux 4K attention part 0.562 vs
# 0.575.
# A bool mask (transformers' causal + padding mask, a key-padding mask) takes SDPA off its fast kernels, while
# int8_fp8 recognises the causal / key-range structures on the device and skips the masked tiles (other bool
# masks are read in-kernel). H200 run 66 (benchmarks/results/masks_run66_*, the op with the mask against SDPA with
# it, ms): a padded causal LLM batch (4 x 16 x 4,096, hd128) 0.757 vs 1.792; HunyuanVideo (1 x 24 x 32,896,
# hd128, key padding) 16.26 vs 31.46; a key mask at hd64 (2 x 24 x 16,384) 6.09 vs 10.84. So from
# AUTO_INT8_FP8_MIN_TOKENS_BOOL_MASK, the shortest measured. (A bool mask of neither structure is read in-kernel by
# the Triton core without skipping tiles, 0.84 ms at 2 x 16 x 4,096, hd128, H200: not timed against SDPA at that
# size; the compile cannot tell the structures apart, the device-side check picks the kernel per call.)
AUTO_INT8_FP8_MIN_TOKENS = 8192
AUTO_INT8_FP8_MIN_TOKENS_CAUSAL = 12288
AUTO_INT8_FP8_MIN_TOKENS_BOOL_MASK = 4096


def auto_int8_fp8(site) -> Optional[str]:
    """Why ``auto`` keeps SDPA at the CUDA inference ``site`` rather than run ``int8_fp8`` (None: it runs
    ``int8_fp8``); see :data:`AUTO_INT8_FP8_MIN_TOKENS`. Sizes are read as hints (a symbolic size's)."""
    from .kernels.int8_fp8 import cuda

    if site.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {site.dtype} (int8_fp8 is chosen for 16-bit sites only)"
    if site.mask_kind not in ("none", "bool"):
        return f"an {site.mask_kind} mask (not measured against SDPA)"
    if site.head_dim not in cuda.HEAD_DIMS:
        return f"head_dim {site.head_dim} (the CUDA core has {' and '.join(map(str, cuda.HEAD_DIMS))})"
    nq, nk = (_hint(s[2]) if s is not None else None for s in (site.q_shape, site.k_shape))
    if nq is None or nk is None:
        return "sequence lengths unknown"
    kind, least = (("with a bool mask", AUTO_INT8_FP8_MIN_TOKENS_BOOL_MASK) if site.mask_kind == "bool" else
                   ("causal", AUTO_INT8_FP8_MIN_TOKENS_CAUSAL) if site.causal != "none" else
                   ("", AUTO_INT8_FP8_MIN_TOKENS))
    if min(nq, nk) < least:
        return (f"{nq} queries x {nk} keys: int8_fp8 beats SDPA from {least} of each"
                + (f" ({kind})" if kind else "") + " on the sm90 CUDA core")
    why = cuda.unavailable(getattr(site, "device", None))
    return None if why is None else f"no CUDA int8_fp8 core ({why})"


def auto_scheme(site, device_type: str) -> tuple[str, str]:
    """``auto`` at ``site``: (scheme, why). On CUDA for inference ``int8_fp8`` where :func:`auto_int8_fp8` finds
    it faster than SDPA, else ``exact``; ``exact`` on other devices (no CPU emulation beats SDPA) and where
    gradients are needed (``int8_train``'s forward + backward is slower than cuDNN's: 0.82-0.90x at hd128, H100
    runs 146 and 152)."""
    why = f"auto on {device_type}"
    if site.requires_grad:
        return "exact", why + " (gradients needed)"
    if device_type != "cuda":
        return "exact", why
    from . import ops

    if not ops.has_fast_impl("int8_fp8", device_type):
        return "exact", why + ": no int8_fp8 kernel on this GPU"
    no = auto_int8_fp8(site)
    return ("exact", f"{why}: {no}") if no else ("int8_fp8", f"{why}: int8_fp8 is faster than SDPA at this size")


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
        scheme, why = auto_scheme(site, device_type)
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
    prologue = None
    if scheme == "int8_train":
        prologue = train_prologue(config.options, device_type)
    elif not config.options.switchable:
        prologue = prologue_for(site, config.options, scheme, device_type)
        if config.options.prologue == "traced":
            if prologue != "traced":
                notes.append(f"prologue='traced' has no traced ops for {scheme}: prologue op")
        elif config.options.prologue != "op" and not graph_prologue(config.options, device_type):
            notes.append(f"prologue='{config.options.prologue}' gives no graph prologue on {device_type} (not "
                         "validated there): prologue op")
        elif config.options.prologue == "auto" and prologue == "op" and scheme in OP_PROLOGUE_ALWAYS:
            notes.append(f"prologue op (auto: always for {scheme}, whose graph prologue compiles far slower)")
        elif config.options.prologue == "auto" and prologue == "op":
            notes.append(f"prologue op (auto: B·H·Nq·Nk·D = {attention_work(site):.3g} >= "
                         f"{OP_PROLOGUE_MIN_WORK:.3g}, where the op's kernels are faster than the graph prologue "
                         "and its host time is hidden)")
    if scheme == "fp4" and site.head_dim % 16:
        notes.append(f"head_dim {site.head_dim} padded to {site.head_dim + (-site.head_dim) % 16} for fp4")
    if device_type != "cpu":
        from . import ops

        if not ops.has_fast_impl(scheme, device_type):
            notes.append(f"no {scheme} kernel on {device_type}: the pure-PyTorch reference runs (same numerics, "
                         "O(N²) work in many small ops: far slower than SDPA at long sequences)")
    return Decision(scheme, why, tuple(notes), prologue=prologue)
