"""Where the CUDA sm90 SageBwd kernels (csrc/int8_train_sm90.cu) disagree with the Triton kernels, if they do: O,
LSE, dQ, dK, dV of one small call each way, and for each output the relative error per block of 16 rows x 32
channels (a wrong row order shows along rows, a wrong channel chunk or descriptor step along channels, one
warpgroup's mistake in one half of a 128-row block). A debugging aid for the first GPU runs of those kernels.

    python benchmarks/diag_train_cuda.py [--d 64,128] [--causal none,top_left] [--n 256]
"""
from __future__ import annotations

import argparse
import os

import torch


def _with_core(core, fn):
    os.environ["SAGE_COMPILE_INT8_TRAIN_CORE"] = core
    try:
        out = fn()
    finally:
        os.environ.pop("SAGE_COMPILE_INT8_TRAIN_CORE", None)
    torch.cuda.synchronize()
    return out


def _run(core, qt, do, causal, dtype, fwd=None):
    """(O, LSE, dQ, dK, dV) on ``core``; the backward from ``fwd`` (another core's O, LSE) when given, so that
    the backward kernels are compared on the same inputs."""
    from sage_compile.kernels.int8_train import attention as KA

    o, lse = _with_core(core, lambda: KA.forward(*qt[:6], causal, None, "HND", dtype))
    o2, lse2 = fwd if fwd is not None else (o, lse)
    grads = _with_core(core, lambda: KA.backward(*qt, o2, lse2, do, causal, None, "HND", dtype, psi="split"))
    return o, lse, *grads


def _blocks(a, b):
    """Relative error (|a - b| summed / |b| summed) per block of 16 rows x 32 channels of the first (batch, head)."""
    a, b = a[0, 0].float(), b[0, 0].float()
    if a.dim() == 1:
        a, b = a[:, None], b[:, None]
    n, d = a.shape
    err = (a - b).abs()
    ref = b.abs()
    rb, cb = 16, min(32, d)
    e = err[: n // rb * rb, : d // cb * cb].reshape(n // rb, rb, d // cb, cb).sum((1, 3))
    r = ref[: n // rb * rb, : d // cb * cb].reshape(n // rb, rb, d // cb, cb).sum((1, 3)).clamp_min(1e-12)
    return e / r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--causal", default="none,top_left")
    ap.add_argument("--n", type=int, default=256)
    a = ap.parse_args()
    from sage_compile.kernels.int8_train import cuda
    from sage_compile.kernels.int8_train import quantize as KQ

    torch.set_printoptions(precision=3, linewidth=200, sci_mode=True)
    for d in (int(x) for x in a.d.split(",")):
        for causal in a.causal.split(","):
            g = torch.Generator().manual_seed(d)
            q, k, v, do = (torch.randn(1, 2, a.n, d, generator=g).cuda().bfloat16() for _ in range(4))
            qt = KQ.quantize(q, k, v)
            tri = _run("triton", qt, do, causal, torch.bfloat16)
            got = _run("cuda", qt, do, causal, torch.bfloat16, fwd=tri[:2])
            again = _run("cuda", qt, do, causal, torch.bfloat16, fwd=tri[:2])
            det = all(torch.equal(x, y) for x, y in zip(got, again))
            print(f"== d={d} {causal} n={a.n}: cuda built {cuda.status()}, deterministic {det} "
                  "(the backward of both from Triton's O and LSE)")
            for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), got, tri):
                finite = bool(torch.isfinite(x).all())
                err = (x.float() - y.float()).abs()
                rel = (err.sum() / y.float().abs().sum().clamp_min(1e-12)).item()
                print(f"{name}: rel-L1 {rel:.3e}  finite {finite}  max|diff| {err.max().item():.3e}")
                if rel > 1e-2 or not finite:
                    print(_blocks(x, y))


if __name__ == "__main__":
    main()
