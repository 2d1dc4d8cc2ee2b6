"""Attention with the bool masks models build (key padding; causal + key padding), the ``int8_fp8`` op on
each core, beside SDPA with the same mask, in one process:

    python benchmarks/bench_masks.py --out benchmarks/results/masks_<run>.json

Cases: ``hunyuan`` = HunyuanVideo's attention (24 heads x 128, 32,640 video + 256 text tokens, the last 56
text tokens padding: a (B, 1, 1, N) key mask), ``llm`` = a padded causal batch as transformers builds it
((B, 1, N, N) bool, bottom-right causal, each row padded on the right by a different amount), ``hd64`` =
the key mask at head dim 64. Variants: ``sdpa`` (the backend torch picks for a bool mask), ``sdpa_cudnn``
where cuDNN takes the mask, ``sage_triton`` / ``sage_cuda`` (the op with ``SAGE_COMPILE_INT8_FP8_CORE``
triton / cuda: the prologue, the device-side mask check and the core), and ``sage_cuda_nomask`` (the same
op without the mask: what the mask costs). Per case and variant: ms (``do_bench`` median) and the
output's cos / rel-L1 vs fp32 SDPA with the mask. ``--breakdown`` adds the op's pieces timed alone
(``piece:<name>``): the device-side mask check, the prologue, the CUDA core with the mask's key ranges, a
CUDA launch for the other flag (it leaves at once), the CUDA core without the mask; ``--builds`` times the
two CUDA pieces again on other builds of the kernel (``;``-separated nvcc flag sets, e.g.
``--builds=-DSAGE_KRLOOP64=0;-DSAGE_KRLOOP128=2``: ``piece:cuda_core_masked@<flags>``).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import gpu_meta, write_records  # noqa: E402

CASES = {  # name: (batch, heads, tokens, head dim, padded keys per batch element, causal)
    "hunyuan": (1, 24, 32896, 128, [56], False),
    "llm": (4, 16, 4096, 128, [0, 500, 1000, 1500], True),
    "hd64": (2, 24, 16384, 64, [0, 1000], False),
}


def make_mask(b, n, pad, causal, device):
    keep = torch.ones(b, n, dtype=torch.bool, device=device)
    for i, p in enumerate(pad):
        if p:
            keep[i, n - p:] = False
    if not causal:
        return keep[:, None, None, :]
    return (keep[:, None, :] & torch.ones(n, n, dtype=torch.bool, device=device).tril()[None])[:, None]


def breakdown(q, k, v, mask, builds=()) -> dict:
    """ms of the op's pieces alone (``do_bench``) on (B, H, N, D) bf16 q/k/v and a bool mask; the CUDA core's
    again for each ``builds`` flag set."""
    from triton.testing import do_bench

    from sage_compile.kernels._common import bhn_strides
    from sage_compile.kernels.int8_fp8 import attention as KA
    from sage_compile.kernels.int8_fp8 import cuda as KC
    from sage_compile.kernels.int8_fp8 import quantize as KQ

    b, h, n, _ = q.shape
    m8 = mask.view(torch.uint8).expand(b, h, n, n)
    flag, krange = KA.mask_structure(m8, n, n)
    want = int(flag.item())
    qt = KQ.quantize(q, k, v, "HND", True)
    out = torch.empty_like(q)
    st = bhn_strides(out, "HND")
    mode = "bottom_right" if want == 1 else "none"
    pieces = {"mask_structure": lambda: KA.mask_structure(m8, n, n),
              "prologue": lambda: KQ.quantize(q, k, v, "HND", True),
              "cuda_core_masked": lambda: KC.attention(*qt, mode, None, out, st, krange=krange, flag=flag, want=want),
              "cuda_launch_other_flag": lambda: KC.attention(*qt, mode, None, out, st, krange=krange, flag=flag,
                                                             want=3 - want),
              "cuda_core_nomask": lambda: KC.attention(*qt, "none", None, out, st)}
    for flags in builds:
        mod = _build(flags)
        pieces[f"cuda_core_masked@{flags}"] = lambda m=mod: KC.attention(*qt, mode, None, out, st, module=m,
                                                                         krange=krange, flag=flag, want=want)
        pieces[f"cuda_core_nomask@{flags}"] = lambda m=mod: KC.attention(*qt, "none", None, out, st, module=m)
    return {name: do_bench(fn, warmup=25, rep=200) for name, fn in pieces.items()}


_BUILDS: dict = {}


def _build(flags: str):
    from sage_compile.kernels.int8_fp8 import cuda as KC

    if flags not in _BUILDS:
        _BUILDS[flags] = KC.build(tuple(flags.split()))
    return _BUILDS[flags]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default="benchmarks/results/masks.json")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--builds", default="")
    a = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    import sage_compile

    meta = gpu_meta(inputs="gaussian", variant="forward")
    recs = []
    for name in a.cases.split(","):
        b, h, n, d, pad, causal = CASES[name]
        pad = (pad * b)[:b]
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
        mask = make_mask(b, n, pad, causal, "cuda")
        exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
        note = f"B={b} H={h} N={n} D={d} pad={pad} causal={causal}"

        def sage(core, m=mask):
            def run():
                os.environ["SAGE_COMPILE_INT8_FP8_CORE"] = core
                return sage_compile.attention(q, k, v, attn_mask=m, scheme="int8_fp8")
            return run

        def sdpa(backend=None):
            def run():
                if backend is None:
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return run

        variants = {"sdpa": sdpa(), "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "sage_triton": sage("triton"),
                    "sage_cuda": sage("cuda"), "sage_cuda_nomask": sage("cuda", None)}
        for var, fn in variants.items():
            try:
                out = fn().float()
                ms = do_bench(fn, warmup=25, rep=200)
            except RuntimeError as e:
                print(f"{name} {var}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                continue
            if var.endswith("nomask"):
                cos = rel = None
            else:
                o, r = out.double().flatten(), exact.double().flatten()
                cos = torch.nn.functional.cosine_similarity(o, r, dim=0).item()
                rel = ((o - r).abs().sum() / r.abs().sum()).item()
            recs.append(dict(meta, model=name, kernel=var, metric="ms", value=ms, note=note))
            if cos is not None:
                recs += [dict(meta, model=name, kernel=var, metric="cos", value=cos, note=note),
                         dict(meta, model=name, kernel=var, metric="rel_l1", value=rel, note=note)]
            acc = "" if cos is None else f"  cos {cos:.5f} rel-L1 {rel:.4f}"
            print(f"{name:8s} {var:17s} {ms:8.3f} ms{acc}", flush=True)
        os.environ.pop("SAGE_COMPILE_INT8_FP8_CORE", None)
        if a.breakdown:
            for piece, ms in breakdown(q, k, v, mask, [f for f in a.builds.split(";") if f]).items():
                recs.append(dict(meta, model=name, kernel=f"piece:{piece}", metric="ms", value=ms, note=note))
                print(f"{name:8s} {'piece:' + piece:28s} {ms:8.3f} ms", flush=True)
    write_records(a.out, recs)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
