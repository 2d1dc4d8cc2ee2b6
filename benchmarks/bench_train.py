"""SageBwd (``int8_train``) forward+backward speed beside SDPA cuDNN and SDPA flash, same run.

    python benchmarks/bench_train.py --out benchmarks/results/train_h200.json

TFLOP/s = 3.5 x forward FLOPs (4·B·H·N²·D, halved for causal) / time of forward + backward (issue 5's
convention), ``triton.testing.do_bench`` median; the sage row includes its quantization prologues (forward
and backward re-quantize Q, K, V); ``int8_train`` with the paper's per-tile ψ(P), ψ(dS) scales,
``int8_train_split`` with ``Options(int8_train_psi="split")`` (one scale per row of each matmul's operand),
``int8_train_split_cuda`` the same with ``SAGE_COMPILE_INT8_TRAIN_CORE=cuda`` (dK/dV on the CUDA sm90 kernel;
left out, with the reason, where that kernel did not build). ``--only`` picks the sage rows (the SDPA ones always
run: the ratios are against cuDNN), ``--causal`` the masks.
Also the forward alone. bf16, hd128 (and 64 with --hd), B·N = 32K
tokens, 16 heads (GQA off). Records follow shared/docs/conventions.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import gpu_meta  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/train_h200.json")
    ap.add_argument("--n", default="2048,4096,8192,16384")
    ap.add_argument("--hd", default="128")
    ap.add_argument("--causal", default="none,causal")
    ap.add_argument("--only", default=None, help="comma-separated sage rows to run (default: all)")
    a = ap.parse_args()
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import sage_compile
    from sage_compile.kernels.int8_train import cuda as train_cuda

    meta = gpu_meta(inputs="gaussian", heads=16)
    recs = []
    tile, split = sage_compile.Options(int8_train_psi="tile"), sage_compile.Options(int8_train_psi="split")

    def sage(opts, causal):
        return lambda q, k, v: sage_compile.attention(q, k, v, None, "top_left" if causal else "none", None, "HND",
                                                      "int8_train", opts)

    def sdpa(backend, causal):
        def f(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return f

    for hd in (int(x) for x in a.hd.split(",")):
        for causal in (c == "causal" for c in a.causal.split(",")):
            for n in (int(x) for x in a.n.split(",")):
                b = max(1, 32768 // n)
                q, k, v = (torch.randn(b, 16, n, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                do = torch.randn(b, 16, n, hd, device="cuda", dtype=torch.bfloat16)
                flops = 4 * b * 16 * n * n * hd * (0.5 if causal else 1.0)
                fns = {
                    "int8_train": sage(tile, causal),
                    "int8_train_split": sage(split, causal),
                    "int8_train_split_cuda": sage(split, causal),
                    "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION, causal),
                    "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION, causal),
                }
                row = {}
                for name, f in fns.items():
                    if a.only and name.startswith("int8") and name not in a.only.split(","):
                        continue
                    try:
                        def step():
                            o = f(q, k, v)
                            torch.autograd.grad(o, (q, k, v), do)

                        cuda = "_cuda" in name
                        os.environ["SAGE_COMPILE_INT8_TRAIN_CORE"] = "cuda" if cuda else "triton"
                        ms = triton.testing.do_bench(step, warmup=10, rep=100)
                        with torch.no_grad():
                            ms_f = triton.testing.do_bench(lambda: f(q, k, v), warmup=10, rep=100)
                    except Exception as e:  # reported, the others still run
                        print(f"{name} N={n}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    finally:
                        os.environ.pop("SAGE_COMPILE_INT8_TRAIN_CORE", None)
                    if cuda and not train_cuda.status()["built"]:
                        print(f"{name}: not built ({train_cuda.status()['error']}), left out", flush=True)
                        continue
                    row[name] = 3.5 * flops / ms / 1e9
                    base = dict(meta, kernel=name, head_dim=hd, seq_len=n, batch=b, causal=causal)
                    recs.append(dict(base, variant="fwd_bwd", metric="fwd_bwd_tflops", value=row[name]))
                    recs.append(dict(base, variant="fwd_bwd", metric="ms", value=ms))
                    recs.append(dict(base, variant="fwd", metric="tops", value=flops / ms_f / 1e9))
                ratios = {s: row[s] / row["sdpa_cudnn"] for s in row if s.startswith("int8") and row.get("sdpa_cudnn")}
                print(f"hd{hd} {'causal' if causal else 'full  '} N={n:6d} B={b:2d}  " +
                      "  ".join(f"{k} {v:6.1f}" for k, v in row.items()) +
                      "".join(f"  {s}/cudnn {r:.2f}" for s, r in ratios.items()), flush=True)
                for s, r in ratios.items():
                    recs.append(dict(meta, kernel=s, variant="fwd_bwd", head_dim=hd, seq_len=n, batch=b,
                                     causal=causal, metric="speedup", value=r, note="vs sdpa_cudnn"))
                os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
                with open(a.out, "w") as fh:
                    json.dump(recs, fh, indent=1)
                del q, k, v, do
    print("wrote", a.out)


if __name__ == "__main__":
    main()
