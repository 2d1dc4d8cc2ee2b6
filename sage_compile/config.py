"""Configuration, read in one place. Precedence: explicit argument > context manager > environment > default.

Environment (conventions.md): ``SAGE_COMPILE=1`` (global enable, handled by :mod:`sage_compile._autoload`),
``SAGE_COMPILE_KERNEL=<scheme|auto>``, ``SAGE_COMPILE_DUMP=<dir>``, ``SAGE_COMPILE_STRICT=1``,
``SAGE_COMPILE_INT8_FP8_CORE=auto|triton|cuda`` (which implementation of the ``int8_fp8`` core runs on
CUDA: an implementation choice with the same numerics, read at call time, not part of what a compiled
graph depends on), ``SAGE_COMPILE_INT8_TRAIN_CORE=auto|triton|cuda`` (the same for ``int8_train``'s forward and split backward).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
from typing import Any, Callable, Iterator, Optional

SCHEMES = ("exact", "int8_fp16", "int8_fp8", "fp4", "int8_train")
KERNEL_CHOICES = ("auto",) + SCHEMES
PROLOGUES = ("auto", "graph", "op", "traced")


@dataclasses.dataclass(frozen=True)
class Options:
    """Numeric options beyond the scheme name (ablations and variants).

    fp4_p_scale: ``rounded`` (divide P by the E4M3 scale actually used; default: SmolLM2 mean cos
        0.98805 vs 0.98802, gaussian 0.98193 vs 0.98179, benchmarks/results/ablation_fp4.json) or
        ``unrounded`` (SageAttention3: divide by the fp32 scale). fp4_delta_s: ``fp32`` or ``input``
        (upstream rounds ΔS to bf16/fp16; no measurable difference, fp32 costs nothing).
        fp4_smooth: ``qk`` | ``k`` | ``none``. fp4_q_block: query rows per Q-smoothing mean (16 | 32 | 64 |
        128; SageAttention3 uses 128): 16 takes SmolLM2's mean cos over its 30 layers from 0.9880 to 0.9901
        (the only setting past issue 4's 0.99; gaussian 0.9818 -> 0.9823, outlier 0.935 -> 0.940,
        benchmarks/results/ablation_fp4.json) for a ΔS of Nq·Nk/16 fp32 per head (N=16K: 64 MB per head).
        fp4_v_smooth: quantize V minus its token mean and add the mean back to each output row (beyond
        SageAttention3; on by default): with 16-row Q blocks, SmolLM2's mean cos 0.99015 -> 0.99062, outlier
        0.93977 -> 0.93997, gaussian 0.98232 -> 0.98222 (zero-mean V gains nothing; H200,
        benchmarks/results/ablation_fp4.json); SmolLM2 perplexity (CPU reference, 2K, 6 windows) +3.34 % ->
        +2.99 % vs exact (benchmarks/results/ppl_smollm2_cpu_fp4_vsmooth.json).
        fp4_qk_scale: Q's and K's NVFP4 block scales, ``amax`` (amax/6, SageAttention3) or ``search``
        (default: per 16-value block the E4M3 scale of amax/m, m in 6, 5.75, ..., 3, nearest in squared
        error — "Four Over Six"-style adaptive block scaling, same format and core; on Gaussian blocks at
        least 15 % less squared error, tests/test_quant.py; V keeps amax/6: searching its scales worsened
        SmolLM2's attention outputs in a CPU probe at 2K).
        fp4_qk_balance: Q·diag(s), K·diag(1/s) before quantizing (s: SmoothQuant's α = 0.5 per channel, as
        ``int8_channel_rescale``; exact in real arithmetic), on by default. SmolLM2 perplexity vs exact over
        all held-back text, H200 kernels (run 94, benchmarks/results/ppl_smollm2_run94_c15f884_h200_*): at
        2K / 4K / 8K amax +2.92 / +2.96 / +3.25 %, search +2.39 / +2.59 / +2.60 %, balance +2.91 / +2.99 /
        +3.02 %, both +2.17 / +2.33 / +2.50 %. Cost: the fp4 prologue op 3.24 -> 5.26 ms at hd128, 16 heads,
        16K tokens (core 15.1 ms).
    int8_channel_rescale: balance Q/K channel ranges before INT8 quantization (``int8_fp8``), on by
        default: on the outlier set (N=4096) the H200 kernel goes from cos 0.9975 / rel-L1 0.068 to
        0.9991 / 0.041 (hd128; gaussian unchanged, 0.9993 / 0.038) for 7 % of the time with prologue at
        hd128 N=16K (615 -> 569 TOPS), 2 % at hd64 (benchmarks/results/attention_h200.json).
    int8_balance_tokens: with ``int8_channel_rescale``, Q's channel ranges come from every ``Nq //
        int8_balance_tokens``-th query (at least that many; 0: every query; default 512), K's from every key. Any
        factors are exact and Q's per-token scales absorb what a sample misses, so the prologue reads Q once
        instead of twice at no cost in accuracy: CPU reference, 2048 tokens, cos / rel-L1 vs fp64 SDPA, every
        query vs 512 (benchmarks/results/ablation_balance_sample_cpu.json): gaussian 0.99931 / 0.0371 vs 0.99931 /
        0.0372, outlier hd64 0.99924 / 0.0369 vs 0.99922 / 0.0374, SmolLM2 layers 0.99967 / 0.0231 vs 0.99968 /
        0.0229; with a query outlier off the sample 0.9989 / 0.045 vs 0.9991 / 0.038 (hd64). A query outlier that
        is read (the first query always is) moves the factors, but each factor is at least K's channel range over
        its widest (:func:`sage_compile.reference.quant.channel_balance`), so it cannot widen a K channel past
        all others: on ``outlier+q0`` (300 in 8 channels of query 0) cos 0.9988 against 0.9978 without the
        balance at hd64, 0.9985 vs 0.9972 at hd128 (0.9949 / 0.9926 before that bound).
    int8_train_psi: SageBwd's INT8 scales of P and dS in the backward: ``split`` (default: one per row of
        each matmul's own operand — per query row over each 64-key tile for dQ, per key over each 64-query
        block for dK and dV) or ``tile`` (one per 128x64 tile, the paper's). Reference study
        (benchmarks/results/ablation_sagebwd.json, N=1024 hd128, made when split's per-key scales spanned
        128 queries): dQ cos gaussian 0.9983 -> 0.9998, outlier 0.949 -> 0.995, SmolLM2 layers 0.9976 ->
        0.9991. H200 run 37 (benchmarks/results/train_h200.json): forward+backward 4-14 % faster than
        ``tile``; SmolLM2 fine-tune last-20 loss 1.0002x bf16 SDPA's (finetune_smollm2_split64_h200.json).
    prologue: ``auto`` (default), ``graph``, ``op`` or ``traced``. ``graph``: the prologue as plain torch ops in the graph, so
        Inductor fuses it with the ops producing q/k/v — RoPE, QK-norm (compiled with stride padding off,
        :func:`sage_compile._compat.graph_prologue_inductor_patches`; its divisions exact by themselves,
        :func:`sage_compile.reference.quant.div_rn`). ``op``: the prologue custom op (Triton kernels on CUDA: two
        passes over Q, K and V, the token reductions fused into one). Same quantized values given the same inputs
        (the graph quantizes the producers' unrounded fp32 values). ``auto``: per site
        (:func:`sage_compile.policy.prologue_for`): ``traced`` (below) for ``int8_fp8`` attention on CUDA of static
        sizes (H100 run 160: a lone Flux block at 1K tokens 0.580 ms against 1.042 with the op, 0.763 with the graph
        prologue; equal to the op at 4K and 16K); for symbolic sizes the op for ``int8_fp8`` attention on CUDA with
        B·H·Nq·Nk·D >= 2^34; the op for ``fp4`` everywhere (with its graph prologue and the Q/K scale search the CPU TinyLlama's first
        call took 87.7 s, with the op 4.5 s: :data:`sage_compile.policy.OP_PROLOGUE_ALWAYS`), the graph prologue
        elsewhere. H200 (runs 49-51): the op is faster at both real models measured, with about half the first
        compile of the graph prologue (CogVideoX-2B step 222.8 vs 225.6 ms, first call 44.5 vs 83.7 s; Flux-dev
        132.8 vs 135.7 ms, 74.8 vs 219.9 s), while the graph prologue saves host time on small attention (a lone
        CogVideoX-2B block at 4K tokens 0.89 vs 1.32 ms).
        ``traced``: ``int8_fp8`` sites call the prologue and core as ``torch.library.triton_op`` s
        (:func:`sage_compile.ops.quantize_int8_fp8_traced`, :func:`sage_compile.ops.attention_int8_fp8_traced`):
        the op's kernels, launched by Inductor's generated code (the kernels' host code and the custom-op dispatch
        run once per compile, not once per call); ``int8_train`` sites the traced training op (as ``graph``);
        other schemes the op.
    switchable: sites call the composed op, which honours :func:`sage_compile.override` and
        :class:`sage_compile.HybridSteps` at run time (no prologue/core split in the graph).
    """

    fp4_p_scale: str = "rounded"
    fp4_delta_s: str = "fp32"
    fp4_smooth: str = "qk"
    fp4_q_block: int = 16
    fp4_v_smooth: bool = True
    fp4_qk_scale: str = "search"
    fp4_qk_balance: bool = True
    int8_channel_rescale: bool = True
    int8_balance_tokens: int = 512
    int8_train_psi: str = "split"
    switchable: bool = False
    prologue: str = "auto"

    def __post_init__(self):
        if self.prologue not in PROLOGUES:
            raise ValueError(f"sage_compile: prologue must be one of {PROLOGUES}, got {self.prologue!r}")
        if self.fp4_qk_scale not in ("amax", "search"):
            raise ValueError(f"sage_compile: fp4_qk_scale must be 'amax' or 'search', got {self.fp4_qk_scale!r}")
        if isinstance(self.int8_balance_tokens, bool) or not isinstance(self.int8_balance_tokens, int) \
                or self.int8_balance_tokens < 0:
            raise ValueError(f"sage_compile: int8_balance_tokens must be an int >= 0 (0: every query), got "
                             f"{self.int8_balance_tokens!r}")

    def encode(self) -> str:
        """The numeric options as a string (an argument of the composed op)."""
        skip = ("switchable", "prologue")  # graph-shape choices, not numerics
        return json.dumps({k: v for k, v in dataclasses.asdict(self).items() if k not in skip}, sort_keys=True)

    @classmethod
    def decode(cls, s: str) -> "Options":
        return cls(**json.loads(s)) if s else cls()


@dataclasses.dataclass(frozen=True)
class Config:
    """Resolved configuration of one compilation.

    kernel: a scheme name or ``auto`` (per site: the fastest scheme meeting the accuracy goals on CUDA,
        ``exact`` on CPU). dump_dir: where graph dumps and match reports go. strict: unsupported sites
        raise instead of falling back. site_override: optional ``callable(site) -> scheme | None``.
    """

    kernel: str = "auto"
    dump_dir: Optional[str] = None
    strict: bool = False
    options: Options = Options()
    site_override: Optional[Callable[[Any], Optional[str]]] = None

    def __post_init__(self):
        if self.kernel not in KERNEL_CHOICES:
            raise ValueError(f"sage_compile: kernel must be one of {KERNEL_CHOICES}, got {self.kernel!r}")

    def fingerprint(self) -> tuple:
        """What a compiled graph depends on (the dump dir does not change the graph)."""
        return (self.kernel, self.strict, self.options, id(self.site_override) if self.site_override else None)


_FIELDS = {f.name for f in dataclasses.fields(Config)} | {f.name for f in dataclasses.fields(Options)}
_local = threading.local()


def _stack() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


INT8_FP8_CORES = ("auto", "triton", "cuda")


def int8_fp8_core(environ=None) -> str:
    """``SAGE_COMPILE_INT8_FP8_CORE``: ``auto`` (default: the CUDA sm90 core where it supports the call
    and is measured faster on the shape, else Triton), ``triton``, or ``cuda`` (wherever it supports the
    call). See :mod:`sage_compile.kernels.int8_fp8.cuda`."""
    return _env_choice(environ, "SAGE_COMPILE_INT8_FP8_CORE", INT8_FP8_CORES)


def _env_choice(environ, name: str, choices: tuple) -> str:
    """The environment's ``name`` (case and spaces ignored; unset or empty: ``choices[0]``), one of ``choices``."""
    env = os.environ if environ is None else environ
    v = env.get(name, choices[0]).strip().lower() or choices[0]
    if v not in choices:
        raise ValueError(f"sage_compile: {name} must be one of {choices}, got {v!r}")
    return v


INT8_TRAIN_CORES = ("auto", "triton", "cuda")


def int8_train_core(environ=None) -> str:
    """``SAGE_COMPILE_INT8_TRAIN_CORE``: ``auto`` (default) or ``cuda``: the CUDA sm90 kernels of the forward and
    the ``psi="split"`` backward wherever they support the call, the Triton kernels elsewhere (``cuda`` logs why
    once, as a warning; ``auto`` at debug level); ``triton``: the Triton kernels only. H200 (runs 82-83): forward +
    backward 0.81x cuDNN at hd128 16K with them, 0.56x on Triton. See :mod:`sage_compile.kernels.int8_train.cuda`."""
    return _env_choice(environ, "SAGE_COMPILE_INT8_TRAIN_CORE", INT8_TRAIN_CORES)


def state_key() -> Optional[tuple]:
    """What :func:`resolve` reads besides its arguments, where no context manager is open: the environment's
    part (:func:`from_env`). ``None`` inside a context manager. Equal keys give equal configurations for equal
    explicit arguments, so a compiled graph's guard can skip :func:`resolve` (~27 us a call on the CPU machine)
    while the key is the one it was compiled under."""
    return None if _stack() else tuple(from_env().items())


def from_env(environ=None) -> dict:
    env = os.environ if environ is None else environ
    out: dict = {}
    if env.get("SAGE_COMPILE_KERNEL"):
        out["kernel"] = env["SAGE_COMPILE_KERNEL"].strip().lower()
    if env.get("SAGE_COMPILE_DUMP"):
        out["dump_dir"] = env["SAGE_COMPILE_DUMP"]
    if env.get("SAGE_COMPILE_STRICT"):
        out["strict"] = env["SAGE_COMPILE_STRICT"].strip().lower() in ("1", "true", "yes", "on")
    return out


def _check(kw: dict) -> None:
    bad = set(kw) - _FIELDS
    if bad:
        raise TypeError(f"sage_compile: unknown option(s) {sorted(bad)}; known: {sorted(_FIELDS)}")


def resolve(**explicit) -> Config:
    """The configuration in force: explicit > innermost context manager > environment > default."""
    _check(explicit)
    merged: dict = dict(from_env())
    for layer in _stack():
        merged.update(layer)
    merged.update({k: v for k, v in explicit.items() if v is not None})
    opt_names = {f.name for f in dataclasses.fields(Options)}
    opts = {k: merged.pop(k) for k in list(merged) if k in opt_names}
    base = merged.pop("options", None) or Options()
    return Config(options=dataclasses.replace(base, **opts), **merged)


@contextlib.contextmanager
def options(**kw) -> Iterator[Config]:
    """Context manager overriding configuration for compilations (and eager :func:`sage_compile.enable`
    calls) that start inside it, e.g. ``with sage_compile.options(kernel="fp4"): ...``."""
    _check(kw)
    _stack().append(kw)
    try:
        yield resolve()
    finally:
        _stack().pop()
