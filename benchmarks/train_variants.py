"""Time build variants of the CUDA sm90 SageBwd kernels (csrc/int8_train_sm90.cu: SAGE_TRAIN_STAGES, SAGE_TRAIN_PARTS,
SAGE_TRAIN_DQ_*, SAGE_TRAIN_FWD_STAGES) against each other and against the Triton kernels, in one process (one GPU
run). All variants are compiled in parallel first, then timed shape by shape on the same quantized inputs:
``int8_train.attention.forward`` and ``backward(psi="split")`` (the backward's small preparation kernels are the
same for all), ``triton.testing.do_bench`` median; each variant's outputs are compared with the first's. ``--rounds R``
times each variant R times per shape in rotated order and reports the median and range. Builds of the same source
can differ by up to 8 % in the hd128 16K backward (run 114: the same gap with and without rotation), so build each
variant twice (a second name with an explicit default flag) and compare builds, not single numbers.

    python benchmarks/train_variants.py --variants "base=;s2=-DSAGE_TRAIN_STAGES=2" --out v.json

TFLOP/s: forward 4·B·H·N²·D / t, backward 2.5 x that (the 5 matmuls of the backward), halved for causal. Records
per shared/docs/conventions.md (kernel ``sage_int8_train``, ``variant`` = ``cuda:<name>`` or ``triton``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from cuda_variants import build_variants, parse_variants  # noqa: E402


def main():
    import triton
    from triton.testing import do_bench

    from sage_compile.kernels.int8_train import attention as KA
    from sage_compile.kernels.int8_train import cuda
    from sage_compile.kernels.int8_train import quantize as KQ

    p = argparse.ArgumentParser()
    p.add_argument("--variants", required=True, help='"name=flags;name=flags" (flags may be empty)')
    p.add_argument("--shapes", default="128:16384:none,128:16384:top_left,128:4096:none,64:16384:none",
                   help="head_dim:N:causal,...")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--out", default=None)
    p.add_argument("--no-triton", action="store_true", help="time the CUDA variants only")
    p.add_argument("--rounds", type=int, default=1,
                   help="timings per variant and shape, the order rotated each round (median and range reported)")
    a = p.parse_args()
    variants = parse_variants(a.variants)
    mods = build_variants("sage_compile.kernels.int8_train.cuda", variants)
    base = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=os.environ.get("SAGE_COMPILE_COMMIT"), date=datetime.date.today().isoformat(),
                command=" ".join(sys.argv), heads=a.heads, batch=a.batch, kernel="sage_int8_train")
    recs = []
    allv = variants + ([] if a.no_triton else [("triton", None)])  # (Triton last: vs the first)

    def use(name, flags):
        if flags is None:
            os.environ["SAGE_COMPILE_INT8_TRAIN_CORE"] = "triton"
        else:  # this variant's module serves every call of the CUDA path
            os.environ["SAGE_COMPILE_INT8_TRAIN_CORE"] = "cuda"
            cuda._state.update(tried=True, module=mods[name], error=None)

    def span(t):  # the range of a variant's rounds
        return "" if len(t) == 1 else f" [{min(t):.3f}-{max(t):.3f}]"

    for shape in a.shapes.split(","):
        d, n, causal = shape.split(":")
        d, n = int(d), int(n)
        q, k, v, do = (torch.randn(a.batch, a.heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        qt = KQ.quantize(q, k, v)
        flops = 4 * a.batch * a.heads * n * n * d / (1 if causal == "none" else 2)
        first, fns, diffs = None, {}, {}
        for name, flags in allv:
            use(name, flags)
            fwd = lambda: KA.forward(*qt[:6], causal, None, "HND", torch.bfloat16)  # noqa: E731
            o, lse = fwd()
            bwd = lambda o=o, lse=lse: KA.backward(*qt, o, lse, do, causal, None, "HND", torch.bfloat16,  # noqa: E731
                                                   psi="split")
            grads = bwd()
            torch.cuda.synchronize()
            outs = [o.float(), lse, *(g.float() for g in grads)]
            if flags is not None and first is None:
                first = outs
            diffs[name] = 0.0 if first is None else max(float((x - y).abs().max()) for x, y in zip(outs, first))
            fns[name] = (fwd, bwd)
        times = {name: ([], []) for name, _ in allv}
        for r in range(a.rounds):  # the order rotated each round
            for name, flags in allv[r % len(allv):] + allv[:r % len(allv)]:
                use(name, flags)
                fwd, bwd = fns[name]
                times[name][0].append(do_bench(fwd, warmup=10, rep=50))
                times[name][1].append(do_bench(bwd, warmup=10, rep=50))
        for name, flags in allv:
            tf, tb = times[name]
            ms_f, ms_b = statistics.median(tf), statistics.median(tb)
            row = dict(base, variant=name if flags is None else f"cuda:{name}", flags=flags, head_dim=d, seq_len=n,
                       causal=causal, rounds=a.rounds)
            recs += [dict(row, metric="fwd_ms", value=ms_f, all=tf), dict(row, metric="bwd_ms", value=ms_b, all=tb),
                     dict(row, metric="fwd_tflops", value=flops / ms_f / 1e9),
                     dict(row, metric="bwd_tflops", value=2.5 * flops / ms_b / 1e9),
                     dict(row, metric="max_abs_diff_vs_first_cuda", value=diffs[name])]
            print(f"hd{d} N={n} {causal:8s} {name:12s} fwd {ms_f:7.3f} ms{span(tf)} "
                  f"({flops / ms_f / 1e9:6.1f})  bwd {ms_b:7.3f} ms{span(tb)} "
                  f"({2.5 * flops / ms_b / 1e9:6.1f})  max|diff| vs the first CUDA variant {diffs[name]:.3g}", flush=True)
        os.environ.pop("SAGE_COMPILE_INT8_TRAIN_CORE", None)
        if a.out:
            with open(a.out, "w") as fh:
                json.dump(recs, fh, indent=1)


if __name__ == "__main__":
    main()
