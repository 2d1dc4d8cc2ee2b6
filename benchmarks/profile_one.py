"""One launch of the int8_fp8 core at hd128 (``--dim``), N=16K, B=4, H=32 (non-causal) for ncu (benchmarks/gpu_run.sh ncu):
the Triton core (``_fwd_body``) by default, the CUDA sm90 core (``fwd_kernel``) with ``--core cuda``."""
import argparse

import torch

from sage_compile.kernels.int8_fp8 import attention as KA
from sage_compile.kernels.int8_fp8 import quantize as KQ

p = argparse.ArgumentParser()
p.add_argument("--core", choices=("triton", "cuda"), default="triton")
p.add_argument("--dim", type=int, default=128)
a = p.parse_args()
core = a.core
q, k, v = (torch.randn(4, 32, 16384, a.dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
qt = KQ.quantize(q, k, v)
if core == "cuda":
    from sage_compile.kernels._common import bhn_strides
    from sage_compile.kernels.int8_fp8 import cuda

    out = torch.empty_like(q)
    cuda.attention(*qt, "none", None, out, bhn_strides(out, "HND"))
else:
    cfg = dict(BLOCK_M=64, num_warps=4, num_stages=3)  # the fastest at this shape (tune_int8_fp8_h200.json)
    KA.attention(*qt, None, "none", None, "HND", torch.bfloat16, config=cfg)
torch.cuda.synchronize()
