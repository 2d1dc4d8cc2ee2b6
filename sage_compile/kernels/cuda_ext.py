"""Building the CUDA extensions of ``csrc/`` (the ``int8_fp8`` core, the ``int8_train`` kernels): source paths, nvcc
flags, the build name (a hash of the sources, the shared header and the flags, so that an edit rebuilds), the build
through :func:`torch.utils.cpp_extension.load`, and the guarded once-per-process load (sm90 only; any failure logged
with its reason, the Triton kernels serve)."""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from importlib import resources

import torch

from .._tracing import in_graph

log = logging.getLogger("sage_compile")

HEADERS = ("sm90_common.cuh",)  # included by the sources: part of every build's hash
# one build at a time: each sets TORCH_CUDA_ARCH_LIST for its build and restores it after, so two at once (the
# backend's background builds of both extensions) could see each other's restore and build for plain sm_90
_build_lock = threading.Lock()
CUDA_FLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo")


def source_paths(names) -> list[str]:
    """Paths of the CUDA sources ``names`` (installed as the ``sage_compile.csrc`` package data)."""
    root = resources.files("sage_compile.csrc")
    return [str(root / name) for name in names]


def cuda_flags(extra: tuple = ()) -> tuple:
    """nvcc flags: :data:`CUDA_FLAGS`, then ``SAGE_COMPILE_CUDA_FLAGS`` (whitespace-separated; the kernels'
    build knobs, e.g. ``-DSAGE_STAGES128=3``: see the tops of the ``csrc/*.cu`` files), then ``extra``."""
    return CUDA_FLAGS + tuple(os.environ.get("SAGE_COMPILE_CUDA_FLAGS", "").split()) + tuple(extra)


def _build_name(paths, flags, prefix: str = "sage_int8_fp8_sm90") -> str:
    """``prefix`` + the hash of the files at ``paths``, the flags and torch's version."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            h.update(f.read())
    h.update(" ".join(flags).encode())
    h.update(torch.__version__.encode())
    return f"{prefix}_{h.hexdigest()[:12]}"


def build_extension(prefix: str, sources: tuple, extra: tuple = ()):
    """Compile (or find in torch's extension cache) and import the extension of ``sources`` (csrc file names)
    with :func:`cuda_flags` ``(extra)``, named ``prefix`` + the hash of the sources, :data:`HEADERS` and the
    flags; raises on failure."""
    from torch.utils import cpp_extension

    paths, flags = source_paths(sources), cuda_flags(extra)
    with _build_lock:
        old = os.environ.get("TORCH_CUDA_ARCH_LIST")
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"  # torch's own -gencode list: sm_90a only
        try:
            return cpp_extension.load(name=_build_name(paths + source_paths(HEADERS), flags, prefix), sources=paths,
                                      extra_cuda_cflags=list(flags), extra_cflags=["-O3"],
                                      verbose=os.environ.get("SAGE_COMPILE_VERBOSE_BUILD") == "1")
        finally:
            if old is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = old


_faked: set = set()
_fake_lock = threading.Lock()


def register_fakes(ns: str, ops) -> None:
    """Fake implementations of an extension's torch ops ``ns::<op>`` for each of ``ops``: they only write their
    output arguments (``Tensor(a!)``, returning nothing), so there is nothing to make. Once per namespace."""
    with _fake_lock:
        if ns in _faked:
            return
        for op in ops:
            torch.library.register_fake(f"{ns}::{op}")(_writes_only)
        _faked.add(ns)


def _writes_only(*args, **kwargs) -> None:
    return None


def call(mod, name: str, *args) -> None:
    """``mod.<name>(*args)``, or while a traced op is traced (:func:`sage_compile._tracing.in_graph`) the same function
    as the extension's torch op (its TORCH_LIBRARY block), which the graph then holds."""
    if in_graph():
        getattr(getattr(torch.ops, mod.__name__), name)(*args)
    else:
        getattr(mod, name)(*args)


def start_prebuild(state: dict, lock, holder: dict, load_fn, name: str) -> None:
    """Start ``load_fn`` in a daemon thread called ``name``, once per ``state`` (its ``tried``) and ``holder``
    (its ``thread``): nothing where the load already ran or a thread already started."""
    with lock:
        if state["tried"] or holder["thread"] is not None:
            return
        holder["thread"] = threading.Thread(target=load_fn, name=name, daemon=True)
        holder["thread"].start()


def load_once(state: dict, lock, build_fn, what: str):
    """``build_fn()`` once per ``state`` (its ``tried``, ``module``, ``error``) under ``lock``: on a device
    of compute capability 9.0 only; any failure is logged once as ``what`` with the reason (kept in
    ``state["error"]``) and gives None, so that the Triton kernels serve."""
    with lock:
        if state["tried"]:
            return state["module"]
        state["tried"] = True
        try:
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device")
            cap = torch.cuda.get_device_capability()
            if cap != (9, 0):
                raise RuntimeError(f"needs compute capability 9.0 (sm90a), the device has {cap[0]}.{cap[1]}")
            state["module"] = build_fn()
        except Exception as e:  # noqa: BLE001 - any failure means: the Triton kernels serve
            state["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            log.warning("sage_compile: %s (%s)", what, state["error"])
        return state["module"]
