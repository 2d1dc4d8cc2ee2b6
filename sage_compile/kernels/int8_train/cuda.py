"""The CUDA sm90 kernels of ``int8_train`` (``csrc/int8_train_sm90.cu``): built at first use on an sm90 GPU.

``SAGE_COMPILE_INT8_TRAIN_CORE`` (:func:`sage_compile.config.int8_train_core`) ``auto`` (default) or ``cuda`` sends
the forward and the ``psi="split"`` backward (dK/dV, dQ) to these kernels wherever they support the call (head
dim 64 or 128, no mask other than causal (a bool mask that is causal and / or key padding, found on the device, runs
here too: gated launches that read each batch's key range), keys (and for the backward queries) multiples of 16, a
16-bit dtype, an sm90 GPU); the quantization prologue and the backward's small preparation kernels stay on Triton. The
backend starts their build in a background thread (:func:`prebuild`) when it rewrites a CUDA ``int8_train``
site. Same numerics as ``_fwd_kernel``, ``_bwd_dkdv_split`` and ``_bwd_dq``: the same quantized sets (ψ's
roundings of the exact products, where the Triton kernels round the product to fp32 first: about one value in
10⁵ differs), fp32 sums in another order. H200 (runs 82-83, benchmarks/results/train_*_run8[23]_*): 24/24 GPU
tests; forward + backward at hd128 16K 447 TFLOPS vs cuDNN's 555 (0.81x; the Triton kernels 310, 0.56x). The
extension is compiled with ninja through :func:`torch.utils.cpp_extension.load` on first use (cached by torch under a name that carries the hash of the sources, the shared header and the
flags); if it cannot be built or loaded, the Triton kernels serve and the reason is logged once and kept in
:func:`status`.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional

import torch

from ..cuda_ext import build_extension, load_once, register_fakes, start_prebuild
from ..cuda_ext import call as _call
from .attention import LOG2E

log = logging.getLogger("sage_compile")

SOURCES = ("int8_train_sm90.cu", "int8_train_sm90_bind.cpp")
OPS = ("fwd", "dkdv", "dq")  # the torch ops of its TORCH_LIBRARY block
_lock = threading.Lock()


def fresh_state() -> dict:
    """The state before :func:`load` (tests reset it with this)."""
    return {"tried": False, "module": None, "error": None, "logged": set()}


_state: dict = fresh_state()
_prebuild: dict = {"thread": None}


def build(extra: tuple = ()):
    """Compile (or find in torch's extension cache) and import the extension; raises on failure. Its functions are
    also torch ops, ``torch.ops.<module name>.{fwd,dkdv,dq}`` (what a traced call's graph holds:
    :func:`sage_compile.kernels.cuda_ext.call`),
    given fake implementations here."""
    mod = build_extension("sage_int8_train_sm90", SOURCES, extra)
    register_fakes(mod.__name__, OPS)
    return mod


def load():
    """The built extension module, or None (the reason in :func:`status`). Builds once per process."""
    return load_once(_state, _lock, build, "CUDA int8_train kernels unavailable, using Triton")


def status() -> dict:
    """``{"built", "error"}``: ``built`` False before :func:`load` was tried or where it failed."""
    return {"built": _state["module"] is not None, "error": _state["error"]}


def unsupported(q8: torch.Tensor, k8: torch.Tensor, mask_kind: int, psi: str, dtype16: torch.dtype,
                forward: bool = False) -> Optional[str]:
    """Why the CUDA kernels cannot run this backward (or, with ``forward``, this forward; its numerics do not
    depend on ``psi``) (None when they can): not on a GPU, :func:`call_rules`, or the extension not built.
    ``mask_kind``: 0 none (causal comes as an index rule), else a mask read in-kernel. Builds the extension on
    first use."""
    if not q8.is_cuda:
        return "not a CUDA tensor"
    if torch.cuda.get_device_capability(q8.device) != (9, 0):
        return "not an sm90 GPU (the kernels are built for sm_90a)"
    why = call_rules(q8, k8, mask_kind, psi, dtype16, forward)
    if why is None and load() is None:
        return _state["error"]
    return why


def call_rules(q8: torch.Tensor, k8: torch.Tensor, mask_kind: int, psi: str, dtype16: torch.dtype,
               forward: bool = False) -> Optional[str]:
    """The kernels' rules on a call, whatever the device: numerics, masks, head dims, dtypes, lengths, grid
    (None when the call keeps them)."""
    b, hq, lq, d = q8.shape
    lk = k8.shape[2]
    if psi != "split" and not forward:
        return f"psi={psi!r} (the CUDA kernels have the split numerics)"
    if mask_kind != 0:
        return "masks other than causal run on the Triton kernels"
    if d not in (64, 128):
        return f"head_dim {d} (the CUDA kernels have 64 and 128)"
    if dtype16 not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype16}"
    if b == 0 or hq == 0:
        return "an empty batch"
    if (lq % 16 and not forward) or lk % 16 or lq == 0 or lk == 0:
        return f"{lq} queries, {lk} keys (the CUDA kernels need multiples of 16{'' if not forward else ' keys'})"
    if b * hq > 65535:
        return "grid size"
    return None


def note_fallback(why: str, asked: bool = True) -> None:
    """The CUDA kernels cannot run a call: logged once per reason (a warning where ``asked``,
    ``SAGE_COMPILE_INT8_TRAIN_CORE=cuda``; debug level under ``auto``); Triton serves."""
    if why not in _state["logged"]:
        _state["logged"].add(why)
        log.log(logging.WARNING if asked else logging.DEBUG,
                "sage_compile: int8_train on the Triton kernels, not the CUDA ones: %s", why)


def prebuild() -> None:
    """Start :func:`load` in a daemon thread on an sm90 GPU (once per process), so that nvcc runs while the
    backend's caller compiles the graph (the first training step would wait for it otherwise)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        start_prebuild(_state, _lock, _prebuild, load, "sage_compile-train-build")


def forward(q8, qs, k8, ks, v8t, vs, out, lse, causal: str, c: float, out_strides: tuple, module=None,
            gate: Optional[torch.Tensor] = None, want: int = -1, keyrange: bool = False) -> None:
    """The ``int8_train`` forward into ``out`` (values at ``out_strides``, channel stride 1, bf16/fp16) and
    ``lse`` (B, Hq, Lq) fp32 (natural log, -inf for rows without keys). Operands as
    :func:`sage_compile.kernels.int8_train.attention.forward` prepares them for ``_fwd_kernel`` (HND,
    contiguous; ``v8t`` (B, Hkv, D, Lk) V̂ transposed); ``c`` the softmax scale times log2(e). ``gate`` (int32,
    on the device), ``want`` >= 0 and ``keyrange``: see :func:`_gate_args`."""
    mod = load() if module is None else module
    _call(mod, "fwd", q8, qs, k8, ks, v8t, vs, out, lse, c, causal != "none", _coff(causal, q8.shape[2], k8.shape[2]),
          *out_strides, *_gate_args(gate, want, keyrange, qs))


def _gate_args(gate: Optional[torch.Tensor], want: int, keyrange: bool, dummy: torch.Tensor) -> tuple:
    """The binding's last three arguments: ``(gate, want, keyrange)``, or ``(dummy, -1, False)`` without a gate (then
    not read). A gated kernel leaves at its start unless the device-side ``gate[0]`` is ``want``; with ``keyrange``
    unless ``gate[1]`` is, and then batch b sees keys ``[gate[2 + 2b], gate[3 + 2b])`` only (``gate`` as
    :func:`sage_compile.kernels.int8_train.attention.mask_gate` writes it; the masks of ``_mask_plan`` there: no
    host sync)."""
    return (dummy, -1, False) if gate is None else (gate, int(want), bool(keyrange))


def _coff(causal: str, lq: int, lk: int) -> int:
    return 0 if causal == "top_left" else lk - lq


def dq(q8, qs, k8, k8t, ks, v16, kmean, lse2, delta, do16, dq_out, causal: str, sm: float, out_strides: tuple,
       module=None, gate: Optional[torch.Tensor] = None, want: int = -1, keyrange: bool = False) -> None:
    """dQ of the ``psi="split"`` backward into ``dq_out`` (values at ``out_strides``, channel stride 1, in
    ``v16``'s dtype), with the K-smoothing correction and the softmax scale. ``k8t`` (B, Hkv, D, Lk) k̂
    transposed, ``kmean`` (B, Hkv, D), ``lse2`` as :func:`dkdv`'s; the rest as :func:`dkdv`."""
    mod = load() if module is None else module
    _call(mod, "dq", q8, qs, k8, k8t, ks, v16, kmean, lse2, delta, do16, dq_out, sm * LOG2E, sm, causal != "none",
          _coff(causal, q8.shape[2], k8.shape[2]), *out_strides, *_gate_args(gate, want, keyrange, lse2))


def dkdv(q8, q8t, qs, k8, ks, v16, lse2, delta, do16, do8t, sdo, dk, dv, causal: str, sm: float,
         out_strides: tuple, module=None, gate: Optional[torch.Tensor] = None, want: int = -1,
         keyrange: bool = False) -> None:
    """dK, dV of the ``psi="split"`` backward into ``dk``, ``dv`` (values at ``out_strides`` = (batch, head,
    token) strides, channel stride 1, in ``v16``'s dtype). Operands as :func:`sage_compile.kernels.int8_train.
    attention.backward` prepares them for ``_bwd_dkdv_split`` (HND, contiguous); ``lse2`` (B, Hq, Lq) the LSE in
    log2 units, +inf for rows without keys (P = exp2(z - lse2) is 0 there without a test; ``_bwd_prep`` writes it);
    ``sm`` the softmax scale; ``module``: a :func:`build` of other knobs (benchmarks); ``gate``, ``want``,
    ``keyrange`` as :func:`forward`'s."""
    mod = load() if module is None else module
    _call(mod, "dkdv", q8, q8t, qs, k8, ks, v16, lse2, delta, do16, do8t, sdo, dk, dv, sm * LOG2E, sm,
          causal != "none", _coff(causal, q8.shape[2], k8.shape[2]), *out_strides,
          *_gate_args(gate, want, keyrange, lse2))
