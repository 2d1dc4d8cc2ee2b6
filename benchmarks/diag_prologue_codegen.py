"""The GPU kernels Inductor generates for an attention block, read on a CPU machine (issue: fused prologue).

    python benchmarks/diag_prologue_codegen.py [--models flux,cogvideox] [--n 1024] [--variants base,op,graph] [--dump DIR]

Compiles :mod:`bench_block`'s blocks on the CPU with Inductor's Triton backend (``cpu_backend="triton"``)
and a stand-in Triton driver that names an sm90 target, so Inductor schedules, fuses and writes the same kind
of Triton kernels it writes for a GPU; the code is generated, never run (loading it fails at the end, as
no Triton backend for the CPU is installed). Three variants: ``base`` (plain Inductor, the model's own
RoPE/QK-norm kernels feeding SDPA), ``op`` (``backend="sage"``, prologue op) and ``graph`` (the graph
prologue: quantization as graph ops). Per variant: every Triton kernel with its launches per call and
Inductor's own estimate of the bytes it moves (``kernel_num_gb``: each buffer it touches counted once, so
a looped reduction's second read and a strided access's wasted sectors are not in it), their sum, and the
full-size fp32 buffers the wrapper allocates (a quantizer's intermediate that goes to memory). ``extra``:
the sum minus ``base``'s, per element of one of q/k/v (B·N·H·D); the prologue op's own kernels are not
Inductor's and not in the sums (with channel balancing they move 15 bytes per element,
``benchmarks/bench_prologue.py``).

What differs from a GPU compile: the device is ``cpu``, so Inductor's GPU-only options (comprehensive
padding) and CUDA-only lowerings do not apply, and block sizes are not tuned. The fusion decisions, the
buffers realized and the kernels' loads and stores are those of the SIMD scheduler that also serves CUDA.
The variants compile in one process in the order given, as in ``bench_block.py``: on torch 2.11 the graph
prologue compiled first in a process came out with one more kernel than when another sage compile preceded
it (Flux 1K: 16 kernels, 310.7 MB, against 15, 273.3 MB; the post-grad graphs identical; cause not found).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))


class _Sm90Driver:
    """Enough of a Triton driver for Inductor's code generation: the target it compiles for."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def generate(m: torch.nn.Module, kw: dict, variant: str) -> str:
    """The Inductor wrapper code (kernels included) of block ``m`` called with ``kw`` under ``variant``."""
    import sage_compile
    from torch._inductor.graph import GraphLowering

    codes = []
    GraphLowering.save_output_code = staticmethod(codes.append)
    backend = "inductor" if variant == "base" else sage_compile.make_backend(kernel="int8_fp8", prologue=variant)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(m, backend=backend)(**kw)
    except Exception:  # noqa: BLE001 - loading the kernels fails by design once the code exists
        if not codes:
            raise
    return codes[-1]


def kernels(code: str) -> list[tuple[str, int, float]]:
    """``(name, launches per call, MB Inductor estimates)`` of every Triton kernel the wrapper's ``call`` runs."""
    mb = {m.group(1): 1e3 * float(m.group(2))
          for m in re.finditer(r"'kernel_name': '(\w+)'.*?'kernel_num_gb': ([0-9.e+-]+)", code)}
    body = code[code.index("def call(self, args)"):]
    calls = collections.Counter(re.findall(r"^\s+(triton_\w+)\.run\(", body, re.M))
    return [(k, c, mb.get(k, float("nan"))) for k, c in calls.items()]


def fp32_buffers(code: str, numel: int) -> list[str]:
    """The wrapper's fp32 allocations of ``numel`` elements (full-size fp32 copies of q, k or v)."""
    out = []
    for m in re.finditer(r"(buf\d+) = empty_strided_\w+\(\(([\d, ]+)\), \([\d, ]+\), torch\.float32\)", code):
        sizes = [int(s) for s in m.group(2).split(",") if s.strip()]
        if torch.Size(sizes).numel() == numel:
            out.append(f"{m.group(1)}{tuple(sizes)}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="flux,cogvideox")
    ap.add_argument("--n", default="1024")
    ap.add_argument("--variants", default="base,op,graph")
    ap.add_argument("--dump", default=None, help="write each variant's generated code under this folder")
    a = ap.parse_args()
    import torch._inductor.config as ic
    import triton
    from triton.runtime.driver import driver

    ic.cpu_backend = "triton"
    ic.compile_threads = 1
    ic.benchmark_kernel = True  # puts kernel_num_gb in every kernel's metadata
    driver.set_active(_Sm90Driver())
    print(f"torch {torch.__version__}, triton {triton.__version__}: Triton kernels generated for sm90 on the CPU "
          "(not run); MB = Inductor's kernel_num_gb estimate")
    from bench_block import build

    for model in a.models.split(","):
        for n in (int(s) for s in a.n.split(",")):
            m, kw, heads, hd = build(model, n, "cpu")
            tokens = n + kw["encoder_hidden_states"].shape[1] if "encoder_hidden_states" in kw else n
            numel = tokens * heads * hd
            base_mb = None
            for variant in a.variants.split(","):
                code = generate(m, kw, variant)
                if a.dump:
                    os.makedirs(a.dump, exist_ok=True)
                    with open(os.path.join(a.dump, f"{model}_{n}_{variant}.py"), "w") as f:
                        f.write(code)
                ks = kernels(code)
                total = sum(c * mb for _, c, mb in ks)
                base_mb = total if variant == "base" else base_mb
                extra = "" if base_mb is None else (f", extra {total - base_mb:.1f} MB = "
                                                    f"{(total - base_mb) * 1e6 / numel:.1f} B per q/k/v element")
                if variant == "op":
                    extra += " (+ the prologue op's own kernels)"
                print(f"{model} N={n} ({tokens} tokens x {heads} heads x {hd}) {variant}: {len(ks)} kernels, "
                      f"{sum(c for _, c, _ in ks)} launches, {total:.1f} MB{extra}")
                for k, c, mb in ks:
                    print(f"    {c} x {mb:8.2f} MB  {k[:140]}")
                fp32 = fp32_buffers(code, numel)
                if fp32:
                    print(f"    full-size fp32 buffers: {', '.join(fp32)}")


if __name__ == "__main__":
    main()
