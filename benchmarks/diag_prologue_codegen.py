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

The estimates rank fusion, not speed: a graph prologue that moved 13.8 instead of 25.6 bytes per element here
(Flux 1K, 3e6dd2c) ran slower on the H200 at 1K, 4K and 16K tokens (run 155; at 16K tokens the GPU's code
also differs: Inductor splits the token reductions in two kernels each). Time candidates with bench_block.py.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from sage_compile.debug_codegen import fp32_buffers, generated_code, kernels, sm90_codegen

sys.path.insert(0, os.path.dirname(__file__))


def generate(m: torch.nn.Module, kw: dict, variant: str) -> str:
    """The Inductor wrapper code (kernels included) of block ``m`` called with ``kw`` under ``variant``."""
    import sage_compile

    backend = "inductor" if variant == "base" else sage_compile.make_backend(kernel="int8_fp8", prologue=variant)
    return generated_code(m, backend=backend, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="flux,cogvideox")
    ap.add_argument("--n", default="1024")
    ap.add_argument("--variants", default="base,op,graph")
    ap.add_argument("--dump", default=None, help="write each variant's generated code under this folder")
    a = ap.parse_args()
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}: Triton kernels generated for sm90 on the CPU "
          "(not run); MB = Inductor's kernel_num_gb estimate")
    from bench_block import build

    with sm90_codegen():
        _run(a, build)


def _run(a, build):
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
