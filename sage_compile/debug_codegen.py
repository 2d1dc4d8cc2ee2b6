"""Inductor's GPU code on a CPU machine: the Triton kernels it would write for sm90, generated, never run.

Inductor's Triton backend also serves the CPU (``cpu_backend="triton"``); with a stand-in Triton driver
that names an sm90 target, the SIMD scheduler fuses, realizes buffers and writes kernels as it does for
CUDA. What differs from a GPU compile: the device is ``cpu``, so GPU-only options (comprehensive padding)
and CUDA-only lowerings do not apply, and block sizes are not tuned. Loading the kernels fails once the
code exists (no Triton backend for the CPU is installed): :func:`generated_code` returns the code and
swallows that failure.

    with sm90_codegen():
        code = generated_code(fn, *args, backend="inductor")
    for name, launches, mb in kernels(code): ...

Used by ``benchmarks/diag_prologue_codegen.py`` and ``tests/test_debug_codegen.py``.
"""
from __future__ import annotations

import collections
import contextlib
import re

import torch


class _Sm90Driver:
    """Enough of a Triton driver for Inductor's code generation: the target it compiles for."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


@contextlib.contextmanager
def sm90_codegen():
    """Inductor compiles CPU graphs with its Triton backend for a stand-in sm90 target; each kernel's
    metadata carries Inductor's estimate of the bytes it moves (``kernel_num_gb``). Restores Triton's
    driver on exit."""
    import torch._inductor.config as ic
    from triton.runtime.driver import driver

    prev = driver.__dict__.get("_active")  # None until first use: resolving the default needs a GPU
    driver.set_active(_Sm90Driver())
    try:
        with ic.patch(cpu_backend="triton", compile_threads=1, benchmark_kernel=True):
            yield
    finally:
        driver._active = prev


def generated_code(fn, *args, backend="inductor", **kwargs) -> str:
    """The wrapper code (kernels included) Inductor writes for ``fn(*args, **kwargs)`` compiled with
    ``backend``, under :func:`sm90_codegen`; the last graph's where there are several."""
    from torch._inductor.graph import GraphLowering

    codes = []
    saved = GraphLowering.__dict__["save_output_code"]
    GraphLowering.save_output_code = staticmethod(codes.append)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(fn, backend=backend)(*args, **kwargs)
    except Exception:  # noqa: BLE001 - loading the kernels fails by design once the code exists
        if not codes:
            raise
    finally:
        GraphLowering.save_output_code = saved
        torch._dynamo.reset()
    return codes[-1]


def kernels(code: str) -> list[tuple[str, int, float]]:
    """``(name, launches per call, MB Inductor estimates)`` of every Triton kernel the wrapper's ``call``
    runs; Inductor's estimate counts each buffer a kernel touches once (a looped reduction's second read
    and a strided access's wasted sectors are not in it)."""
    mb = {m.group(1): 1e3 * float(m.group(2))
          for m in re.finditer(r"'kernel_name': '(\w+)'.*?'kernel_num_gb': ([0-9.e+-]+)", code)}
    body = code[code.index("def call(self, args)"):]
    calls = collections.Counter(re.findall(r"^\s+(triton_\w+)\.run\(", body, re.M))
    return [(k, c, mb.get(k, float("nan"))) for k, c in calls.items()]


def fp32_buffers(code: str, numel: int) -> list[str]:
    """The wrapper's fp32 allocations of ``numel`` elements (e.g. full-size fp32 copies of q, k or v)."""
    out = []
    for m in re.finditer(r"(buf\d+) = empty_strided_\w+\(\(([\d, ]+)\), \([\d, ]+\), torch\.float32\)", code):
        sizes = [int(s) for s in m.group(2).split(",") if s.strip()]
        if torch.Size(sizes).numel() == numel:
            out.append(f"{m.group(1)}{tuple(sizes)}")
    return out
