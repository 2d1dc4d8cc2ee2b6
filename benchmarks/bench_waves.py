"""The CUDA sm90 core alone against its number of CTA waves: CogVideoX-2B's head shape (1 x 30 heads, hd64,
192-row CTAs) and an hd128 one (1 x 24 heads, 128-row CTAs) at token counts around CogVideoX's 17,776, so
that the CTAs fill 20 to 21.4 waves of the H200's 132 SMs (one CTA per SM):

    python benchmarks/bench_waves.py

Prints ms and TOPS (4 B H N^2 D / t) per shape. A last wave that runs few CTAs would show as TOPS lower at
21.14 waves than at 20.00 (run 64: it does not at hd64, 536.6 vs 537.3).
"""
import math

import torch
from triton.testing import do_bench

from sage_compile.kernels._common import bhn_strides
from sage_compile.kernels.int8_fp8 import cuda as KC
from sage_compile.kernels.int8_fp8 import quantize as KQ


def main():
    torch.manual_seed(0)
    for b, h, d, bm in ((1, 30, 64, 192), (1, 24, 128, 128)):
        for n in (16896, 17280, 17664, 17776, 17856, 18048):
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            qt = KQ.quantize(q, k, v, "HND", True)
            out = torch.empty_like(q)
            st = bhn_strides(out, "HND")
            ms = do_bench(lambda: KC.attention(*qt, "none", None, out, st), warmup=25, rep=300)
            ctas = math.ceil(n / bm) * b * h
            print(f"hd{d} N={n:6d} ctas {ctas:5d} waves {ctas / 132:6.2f}  {ms:7.3f} ms  "
                  f"{4 * b * h * n * n * d / ms / 1e9:6.1f} TOPS", flush=True)


if __name__ == "__main__":
    main()
