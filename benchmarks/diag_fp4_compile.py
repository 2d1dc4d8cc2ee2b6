"""First-call (compile) time of the built-in TinyLlama under ``kernel="fp4"``: the graph prologue vs the prologue op,
with SageAttention3's amax scales and with the Q/K block-scale search. Why ``prologue="auto"`` gives fp4 the op
(:data:`sage_compile.policy.OP_PROLOGUE_ALWAYS`).

    python benchmarks/diag_fp4_compile.py > benchmarks/results/fp4_prologue_compile_cpu.log
"""
from __future__ import annotations

import time

import torch

import sage_compile
from sage_compile import models


def main():
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ids = torch.randint(0, 100, (2, 256), device=dev)
    for qk_scale in ("amax", "search"):
        for prologue in ("graph", "op"):
            torch._dynamo.reset()
            model = models.TinyLlama().to(dev)
            backend = sage_compile.make_backend(kernel="fp4", fp4_qk_scale=qk_scale, prologue=prologue)
            compiled = torch.compile(model, backend=backend)
            with torch.no_grad():
                t0 = time.perf_counter()
                compiled(ids)
                first = time.perf_counter() - t0
                t0 = time.perf_counter()
                compiled(ids)
                second = time.perf_counter() - t0
            print(f"{dev} fp4_qk_scale={qk_scale:6s} prologue={prologue:5s}: first call {first:6.1f} s, "
                  f"second {1000 * second:6.0f} ms", flush=True)


if __name__ == "__main__":
    main()
