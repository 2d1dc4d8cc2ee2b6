"""Training attention (forward + backward) with the bool masks a padded batch brings (causal + key padding; key
padding alone): the ``int8_train`` op on each core beside SDPA with the same mask, in one process:

    python benchmarks/bench_train_masks.py --out benchmarks/results/train_masks_<run>_<commit>_<gpu>.json

Cases (``bench_masks.make_mask``'s masks): ``llm`` = a padded causal batch as transformers builds it ((B, 1, N, N)
bool, bottom-right causal, each row padded on the right by a different amount), ``llm_hd64`` the same at head dim
64, ``keys`` = a (B, 1, 1, N) key mask. Variants: ``sdpa`` (the backend torch picks for a bool mask),
``sdpa_cudnn`` where cuDNN takes the mask, ``sage_triton`` / ``sage_cuda`` (``sage_compile.attention`` with
``kernel="int8_train"``, ``psi="split"``, and ``SAGE_COMPILE_INT8_TRAIN_CORE`` triton / cuda: prologue, the
device-side mask check, forward, backward; on the CUDA kernels a key-padded mask runs as key ranges, on Triton's
it is read in-kernel), ``sage_cuda_nomask`` (the CUDA kernels without the mask: causal as an index rule where the
case is causal). Per case and variant: ms of forward + backward (``do_bench`` median), and the speed-up of each
sage variant over ``sdpa``.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import gpu_meta, write_records  # noqa: E402
from bench_masks import make_mask  # noqa: E402

CASES = {  # name: (batch, heads, tokens, head dim, padded keys per batch element, causal)
    "llm": (4, 16, 4096, 128, [0, 500, 1000, 1500], True),
    "llm_hd64": (4, 16, 4096, 64, [0, 500, 1000, 1500], True),
    "keys": (2, 16, 8192, 128, [0, 1000], False),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default=",".join(CASES))
    a = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    import sage_compile
    from sage_compile.kernels.int8_train import cuda as train_cuda

    meta = gpu_meta(inputs="gaussian")
    opts = sage_compile.Options(int8_train_psi="split")
    recs = []
    for name in a.cases.split(","):
        b, h, n, d, pad, causal = CASES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for _ in range(3))
        do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        mask = make_mask(b, n, pad, causal, "cuda")

        def sage(m, rule="none"):
            return lambda: sage_compile.attention(q, k, v, m, rule, None, "HND", "int8_train", opts)

        def sdpa(backend=None):
            def f():
                if backend is None:
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return f

        fns = {"sdpa": (sdpa(), None), "sdpa_cudnn": (sdpa(SDPBackend.CUDNN_ATTENTION), None),
               "sage_triton": (sage(mask), "triton"), "sage_cuda": (sage(mask), "cuda"),
               "sage_cuda_nomask": (sage(None, "bottom_right" if causal else "none"), "cuda")}
        row = {}
        for var, (f, core) in fns.items():
            if core:
                os.environ["SAGE_COMPILE_INT8_TRAIN_CORE"] = core
            try:
                def step():
                    torch.autograd.grad(f(), (q, k, v), do)

                step()
                row[var] = do_bench(step, warmup=10, rep=100)
            except Exception as e:  # reported, the others still run
                print(f"{name} {var}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            finally:
                os.environ.pop("SAGE_COMPILE_INT8_TRAIN_CORE", None)
            if core == "cuda" and not train_cuda.status()["built"]:
                print(f"{name} {var}: not built ({train_cuda.status()['error']}), left out", flush=True)
                row.pop(var)
                continue
            recs.append(dict(meta, kernel=var, variant=f"fwd_bwd_{name}", heads=h, head_dim=d, seq_len=n, batch=b,
                             causal=causal, metric="ms", value=row[var], note=f"padded keys per batch element {pad}"))
        base = row.get("sdpa")
        print(f"{name} (B={b}, H={h}, N={n}, D={d}, pad {pad}, causal {causal}): "
              + "  ".join(f"{k} {v:.3f} ms" for k, v in row.items())
              + "".join(f"  {k}/sdpa {base / v:.2f}x" for k, v in row.items() if k.startswith("sage") and base),
              flush=True)
        for var, ms in row.items():
            if var.startswith("sage") and base:
                recs.append(dict(meta, kernel=var, variant=f"fwd_bwd_{name}", heads=h, head_dim=d, seq_len=n, batch=b,
                                 causal=causal, metric="speedup", value=base / ms, note="vs sdpa (torch's pick)"))
        if a.out:
            write_records(a.out, recs)
    if a.out:
        print("wrote", a.out)


if __name__ == "__main__":
    main()
