"""Where ``int8_train``'s forward+backward time goes: CUDA time per kernel (torch.profiler) of one
attention call with its backward, beside SDPA cuDNN, at hd128, B·N = 32K tokens, 16 heads.

    python benchmarks/diag_train.py --n 4096,16384 [--psi split] > results/diag_train_h200.log
"""
from __future__ import annotations

import argparse
import collections

import torch
import torch.nn.functional as F


def _kernel_ms(fn, reps=5):
    """Mean CUDA ms per call of each kernel ``fn`` launches (after one warm call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    acc = collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            acc[e.name[:60]] += e.device_time / 1000.0 / reps  # device_time: us
    return acc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="4096,16384")
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--psi", default="split")
    ap.add_argument("--causal", action="store_true")
    a = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import sage_compile

    opts = sage_compile.Options(int8_train_psi=a.psi)
    causal = "top_left" if a.causal else "none"
    for n in (int(x) for x in a.n.split(",")):
        b = max(1, 32768 // n)
        q, k, v = (torch.randn(b, 16, n, a.hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn(b, 16, n, a.hd, device="cuda", dtype=torch.bfloat16)

        def sage():
            o = sage_compile.attention(q, k, v, None, causal, None, "HND", "int8_train", opts)
            torch.autograd.grad(o, (q, k, v), do)

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=a.causal)
            torch.autograd.grad(o, (q, k, v), do)

        for name, fn in (("int8_train_" + a.psi, sage), ("sdpa_cudnn", cudnn)):
            ms = _kernel_ms(fn)
            tot = sum(ms.values())
            print(f"hd{a.hd} N={n} B={b} causal={a.causal} {name}: {tot:.3f} ms of kernels", flush=True)
            for kname, t in ms.most_common(12):
                print(f"    {t:8.3f} ms {100 * t / tot:5.1f} %  {kname}")


if __name__ == "__main__":
    main()
