"""One launch of the int8_fp8 core at hd128 (``--dim``), N=16K, B=4, H=32 (non-causal) for ncu (benchmarks/gpu_run.sh ncu):
the Triton core (``_fwd_body``) by default, the CUDA sm90 core (``fwd_kernel``) with ``--core cuda``. With ``--train``:
one int8_train forward + backward (``psi="split"``) at N=16K, B=2, H=16 on ``--core`` (the CUDA SageBwd kernels
``fwd_kernel``, ``dkdv_kernel``, ``dq_kernel`` with ``cuda``)."""
import argparse

import torch

from sage_compile.kernels.int8_fp8 import attention as KA
from sage_compile.kernels.int8_fp8 import quantize as KQ

p = argparse.ArgumentParser()
p.add_argument("--core", choices=("triton", "cuda"), default="triton")
p.add_argument("--dim", type=int, default=128)
p.add_argument("--train", action="store_true")
a = p.parse_args()
core = a.core
if a.train:
    import os

    from sage_compile.kernels.int8_train import attention as TA
    from sage_compile.kernels.int8_train import quantize as TQ

    os.environ["SAGE_COMPILE_INT8_TRAIN_CORE"] = core
    q, k, v, do = (torch.randn(2, 16, 16384, a.dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qt = TQ.quantize(q, k, v)
    o, lse = TA.forward(*qt[:6], "none", None, "HND", torch.bfloat16)
    TA.backward(*qt, o, lse, do, "none", None, "HND", torch.bfloat16, psi="split")
    torch.cuda.synchronize()
    raise SystemExit(0)
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
