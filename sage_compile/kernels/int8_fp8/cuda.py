"""The CUDA sm90 core of ``int8_fp8`` (``csrc/int8_fp8_sm90.cu``): built at first use, chosen per shape.

The extension is compiled with ninja through :func:`torch.utils.cpp_extension.load` the first time a
CUDA site needs it (``pip install`` stays pure Python; CPU machines never build it), cached by torch
under a name that carries the hash of the sources and flags, so an edit rebuilds. If it cannot be built
or loaded (no nvcc, not an sm90 GPU, a compile error) the Triton core serves and the reason is logged
once and kept in :func:`status`.

Which core runs (``SAGE_COMPILE_INT8_FP8_CORE``, :func:`sage_compile.config.int8_fp8_core`): ``triton``,
``cuda`` (where it supports the call, else Triton), or ``auto`` (default): the CUDA core where it is
supported and measured faster than the Triton core on that shape — both are timed once per shape bucket
(head dim, causal, GQA ratio, powers of two of Lq, Lk and B·H) on the call's own inputs, and the winner
is cached for the process and on disk (:func:`choice_cache_path`: keyed by GPU, torch, triton and the
sources of both cores, so a later process skips the timing and the Triton core's autotuning). During
CUDA-graph capture nothing is timed: an unmeasured shape takes the CUDA core. Same numerics in both:
outputs agree to accumulation order (conventions.md rule 2).

First-call cost: the backend starts the build in a background thread (:func:`prebuild`) as soon as it
rewrites a CUDA ``int8_fp8`` site, so nvcc runs while Dynamo and Inductor compile the graph; the seconds
spent are in :func:`status` (``build_s``: the callers' waiting or building, ``prebuild_s``: the background
thread's build, ``select_s``: timing the cores).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from typing import Optional

import torch

from ..._tracing import in_graph
from ..cuda_ext import HEADERS, build_extension, call, cuda_flags, load_once, register_fakes, start_prebuild
from ..cuda_ext import source_paths as _source_paths

log = logging.getLogger("sage_compile")

SOURCES = ("int8_fp8_sm90.cu", "int8_fp8_sm90_bind.cpp")
OPS = ("fwd",)  # the torch op of its TORCH_LIBRARY block
LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)  # the head dims the kernel is built for

_lock = threading.Lock()


def fresh_state() -> dict:
    """The state before :func:`load` (tests reset it with this)."""
    return {"tried": False, "module": None, "error": None, "build_s": 0.0, "select_s": 0.0, "prebuild_s": None}


_state: dict = fresh_state()
_prebuild: dict = {"thread": None}
_PREBUILD_THREAD = "sage_compile-cuda-build"
_choice: dict = {}
_unmeasured: set = set()
_failures: set = set()


def source_paths(names=SOURCES) -> list[str]:
    """Paths of the CUDA sources ``names`` (default: this core's; installed as package data)."""
    return _source_paths(names)


def build(extra: tuple = ()):
    """Compile (or find in torch's extension cache) and import the extension with :func:`cuda_flags`
    ``(extra)``; raises on failure. :func:`load` is the guarded, once-per-process entry. Its function is also a
    torch op, ``torch.ops.<module name>.fwd`` (what a traced call's graph holds), given a fake implementation here."""
    mod = build_extension("sage_int8_fp8_sm90", SOURCES, extra)
    register_fakes(mod.__name__, OPS)
    return mod


def prebuild() -> None:
    """Start :func:`load` in a daemon thread (once per process; nothing where it already ran), so that the
    build overlaps the caller's work (the backend: Dynamo and Inductor compiling the graph)."""
    if torch.cuda.is_available():
        start_prebuild(_state, _lock, _prebuild, load, _PREBUILD_THREAD)


def load():
    """The built extension module, or None (the reason in :func:`status`). Builds once per process."""
    t0 = time.perf_counter()
    try:
        return _load()
    finally:
        dt = time.perf_counter() - t0
        if threading.current_thread().name == _PREBUILD_THREAD:
            _state["prebuild_s"] = dt
        else:
            _state["build_s"] += dt


def _load():
    return load_once(_state, _lock, build, "CUDA int8_fp8 core unavailable, using the Triton core")


def status() -> dict:
    """``{"built", "error", "build_s", "prebuild_s", "select_s"}``: ``built`` False before :func:`load` was
    tried; ``build_s`` the seconds callers spent in :func:`load` (the build itself, or the wait for
    :func:`prebuild`'s thread), ``prebuild_s`` that thread's own seconds (None: it did not run),
    ``select_s`` the seconds :func:`prefer_cuda` spent timing the two cores (or reading the disk cache)."""
    return {"built": _state["module"] is not None, "error": _state["error"], "build_s": _state["build_s"],
            "prebuild_s": _state["prebuild_s"], "select_s": _state["select_s"]}


def unavailable(device=None) -> Optional[str]:
    """Why the CUDA core cannot serve calls on ``device`` (default: the current CUDA device), None where it can
    or may: its build has not failed and nothing rules it out before building (``SAGE_COMPILE_INT8_FP8_CORE``,
    the device's compute capability, a CUDA toolkit to build with). Never builds: the ``auto`` policy asks this
    of every CUDA site while a graph compiles (:func:`sage_compile.policy.auto_scheme`)."""
    from ...config import int8_fp8_core

    if int8_fp8_core() == "triton":
        return "SAGE_COMPILE_INT8_FP8_CORE=triton"
    if not torch.cuda.is_available():
        return "no CUDA device"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return f"the CUDA core needs compute capability 9.0 (sm90a), the device has {cap[0]}.{cap[1]}"
    if _state["error"]:  # a build that failed (one still running in the background counts as may)
        return _state["error"]
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return "no CUDA toolkit (nvcc) to build the CUDA core"
    return None


def unsupported(q8: torch.Tensor, k8: torch.Tensor, attn_mask: Optional[torch.Tensor], out_dtype: torch.dtype,
                scale: Optional[float] = None) -> Optional[str]:
    """Why the CUDA core cannot run this call (None when it can). Builds the extension on first use."""
    if not q8.is_cuda:
        return "not a CUDA tensor"
    if scale is not None and not float(scale) > 0:
        return f"softmax scale {scale} (the CUDA core folds a positive row scale into the exp argument)"
    if attn_mask is not None:
        return "masks other than key ranges (with or without bottom-right causal) run on the Triton core"
    if q8.shape[-1] not in HEAD_DIMS:
        return f"head_dim {q8.shape[-1]} (the CUDA core has 64 and 128)"
    if out_dtype not in (torch.bfloat16, torch.float16):
        return f"output dtype {out_dtype}"
    if q8.shape[0] * q8.shape[1] > 65535 or q8.shape[2] == 0 or k8.shape[2] == 0:
        return "grid size"
    if load() is None:
        return _state["error"]
    return None


def attention(q8, qs, k8, ks, v8, vs, causal: str, scale: Optional[float], out: torch.Tensor,
              out_strides: tuple, module=None, krange: Optional[torch.Tensor] = None,
              flag: Optional[torch.Tensor] = None, want: int = 0, lk: Optional[int] = None) -> torch.Tensor:
    """Run the CUDA core into ``out`` (values at ``out_strides`` = (batch, head, token) strides, channel
    stride 1). Inputs as :func:`sage_compile.kernels.int8_fp8.quantize.quantize` returns them (HND);
    ``causal`` in none / top_left / bottom_right; ``module``: a :func:`build` of other knobs (benchmarks).

    Key-range masks (``krange`` and ``flag`` together, as
    :func:`sage_compile.kernels.int8_fp8.attention.mask_structure` makes them on the device): batch ``b``
    sees keys ``[krange[b, 0], krange[b, 1])`` only, and the kernel runs only where ``flag[0] == want``
    (read on the device: every CTA of a launch with another flag leaves at once and ``out`` is untouched).
    ``lk``: the keys when ``k8`` / ``ks`` come already padded by :func:`pad_tokens` (default: all of them)."""
    mod = load() if module is None else module
    lq, d = q8.shape[2], q8.shape[3]
    lk = k8.shape[2] if lk is None else lk
    c = (1.0 / math.sqrt(d) if scale is None else float(scale)) * LOG2E
    nv = v8.shape[3]  # the prologue pads V^T's keys to 16 (no copy here); other callers may not
    if nv % 16:  # TMA row strides are multiples of 16 bytes: pad V^T's keys with zeros
        vp = torch.zeros(*v8.shape[:3], nv + (-nv) % 16, dtype=v8.dtype, device=v8.device)
        vp[..., :nv] = v8
        v8 = vp
    if k8.shape[2] % 4:  # K is read as (D, key % 4, key / 4) boxes (csrc key order): whole groups of 4 rows
        ks, k8 = pad_tokens(ks, 4), pad_tokens(k8, 4)
    coff = 0 if causal == "top_left" else lk - lq
    call(mod, "fwd", q8.contiguous(), qs.contiguous(), k8.contiguous(), ks.contiguous(), v8.contiguous(),
         vs.contiguous(), out, lk, c, causal != "none", coff, *out_strides, krange, flag, want)
    return out


def pad_tokens(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """``x`` (B, H, N, ...) with zero tokens appended along dim 2 up to a multiple of ``multiple``. The copy
    moves 8-byte words where a token's bytes allow (torch's strided copy of int8 elements ran at a tenth of
    the bandwidth: 0.07 ms for CogVideoX's K at 16K tokens, H200 run 21)."""
    b, h, n = x.shape[:3]
    pad = (-n) % multiple
    if pad == 0:
        return x
    if in_graph():  # a traced call: one ATen op Inductor lowers (it makes its own copy kernel)
        return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
    out = x.new_empty((b, h, n + pad, *x.shape[3:]))
    row = x.element_size() * math.prod(x.shape[3:])  # bytes per token
    word = next(t for t in (torch.int64, torch.int32, torch.int16, torch.uint8) if row % t.itemsize == 0)
    src = x.contiguous().reshape(b * h, -1).view(torch.uint8).view(word)
    dst = out.reshape(b * h, -1).view(torch.uint8).view(word)
    dst[:, :src.shape[1]].copy_(src)
    dst[:, src.shape[1]:].zero_()
    return out


def note_failure(e: Exception) -> None:
    """A call the CUDA core refused at run time: logged once per message; the caller runs Triton."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if msg not in _failures:
        _failures.add(msg)
        log.warning("sage_compile: CUDA int8_fp8 core failed, this call runs the Triton core (%s)", msg)


def _bucket(q8, k8, causal: str) -> tuple:
    p2 = lambda n: 1 << max(0, int(n) - 1).bit_length()  # noqa: E731
    return (q8.shape[3], causal, q8.shape[1] // k8.shape[1], p2(q8.shape[2]), p2(k8.shape[2]),
            p2(q8.shape[0] * q8.shape[1]), str(q8.device))


def _time(fn, reps: int = 3) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def choice_cache_path() -> Optional[str]:
    """The JSON file of measured core choices: ``SAGE_COMPILE_CACHE_DIR`` (default
    ``~/.cache/sage_compile``) / ``int8_fp8_core.json``; None when ``SAGE_COMPILE_CACHE_DIR`` is empty
    (no disk cache)."""
    root = os.environ.get("SAGE_COMPILE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "sage_compile"))
    return os.path.join(root, "int8_fp8_core.json") if root else None


def _cache_scope(device) -> str:
    """What a measured choice depends on besides the shape: the GPU, torch, triton and both cores' sources (with
    the header the CUDA core includes)."""
    import triton

    from . import attention as triton_core

    h = hashlib.sha256()
    for path in (*source_paths(), *source_paths(HEADERS), triton_core.__file__):
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(" ".join(cuda_flags()).encode())
    return f"{torch.cuda.get_device_name(device)}|torch {torch.__version__}|triton {triton.__version__}|{h.hexdigest()[:16]}"


def _disk_choices(device) -> tuple[dict, str]:
    path, scope = choice_cache_path(), _cache_scope(device)
    if path is None:
        return {}, scope
    try:
        with open(path) as f:
            return json.load(f).get(scope, {}), scope
    except (OSError, ValueError, AttributeError):
        return {}, scope


def _save_choice(scope: str, key: str, cuda_wins: bool) -> None:
    path = choice_cache_path()
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = {}
        if not isinstance(data, dict):
            data = {}
        data = {scope: {**data.get(scope, {}), key: cuda_wins}}  # other scopes are stale: dropped
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: the choice stays in this process only
        log.debug("sage_compile: cannot write %s (%s)", path, e)


def known_choice(q8, k8, causal: str) -> Optional[bool]:
    """The choice :func:`prefer_cuda` made (in this process or on disk) for this shape bucket, None where
    none was measured; timing nothing."""
    key = _bucket(q8, k8, causal)
    if key not in _choice and key not in _unmeasured:
        disk, _ = _disk_choices(q8.device)
        got = disk.get(repr(key[:-1]))  # (the device is the scope's)
        if isinstance(got, bool):
            _choice[key] = got
            log.debug("sage_compile: int8_fp8 core for %s: %s (cached in %s)", key, "cuda" if got else "triton",
                      choice_cache_path())
        else:
            _unmeasured.add(key)  # (read the disk once per process; prefer_cuda may fill _choice later)
    return _choice.get(key)


QUICK_MARGIN = 0.10  # see prefer_cuda


def prefer_cuda(q8, k8, causal: str, run_cuda, run_triton, run_triton_quick=None) -> bool:
    """``auto``: whether the CUDA core is faster on this shape bucket (measured once, cached in the
    process and in :func:`choice_cache_path`).

    ``run_triton`` is the autotuned Triton core: its first call compiles and times every configuration
    (~9 s of a first call at CogVideoX's shape on the H200, run 78). ``run_triton_quick``, the Triton core at one
    configuration of its autotuner's list, comes first when given: it bounds the autotuned time from above,
    so a CUDA core slower than it loses, and one faster by more than :data:`QUICK_MARGIN` wins without the
    autotuner; in between the autotuned core is timed."""
    key = _bucket(q8, k8, causal)
    if key not in _choice:
        if torch.cuda.is_current_stream_capturing():
            return True
        t0 = time.perf_counter()
        if known_choice(q8, k8, causal) is None:
            t_cuda = _time(run_cuda)
            t_quick = _time(run_triton_quick) if run_triton_quick is not None else None
            if t_quick is not None and (t_cuda > t_quick or t_cuda * (1 + QUICK_MARGIN) <= t_quick):
                _choice[key], t_triton, how = t_cuda <= t_quick, t_quick, "one configuration"
            else:
                t_triton, how = _time(run_triton), "autotuned"
                _choice[key] = t_cuda <= t_triton
            _save_choice(_cache_scope(q8.device), repr(key[:-1]), _choice[key])
            log.debug("sage_compile: int8_fp8 core for %s: %s (cuda %.3f ms, triton %s %.3f ms)", key,
                      "cuda" if _choice[key] else "triton", t_cuda, how, t_triton)
        _state["select_s"] += time.perf_counter() - t0
    return _choice[key]


def prefer_cuda_traced(q8, k8, causal: str, measure) -> bool:
    """:func:`prefer_cuda` for a call being traced (its tensors fake: nothing to time): the known choice for the
    shape bucket; where none is known, ``measure()`` (the call run again on real inputs of its sizes, outside the
    trace: :func:`prefer_cuda` then times the cores and keeps the choice) makes it. Symbolic sizes take the CUDA
    core (as an unmeasured shape during CUDA-graph capture; reading their bucket would specialize them)."""
    if any(isinstance(n, torch.SymInt) for n in (*q8.shape, *k8.shape)):
        return True
    got = known_choice(q8, k8, causal)
    if got is None:
        measure()
        got = known_choice(q8, k8, causal)
    return True if got is None else got
