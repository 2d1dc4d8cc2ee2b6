"""Time build variants of the CUDA sm90 int8_fp8 core against each other in one process (one GPU run):
the knobs at the top of ``csrc/int8_fp8_sm90.cu`` (SAGE_KPERM, SAGE_STAGES*, SAGE_PINGPONG*, SAGE_WG*). All variants
are compiled in parallel first (one process each), then timed shape by shape on the same quantized inputs,
kernel only, ``triton.testing.do_bench`` median; each variant's output is compared with the first's.
``--rounds R`` (default 3) times every variant R times per shape, the variants' order rotated each round, and
reports the median of the R timings with their range: run 101 saw identical builds timed one after the other differ
by up to 10 % (hd128 causal 16K 875 vs 786 TOPS), so a single pass in a fixed order favours whichever ran first.

    python benchmarks/cuda_variants.py --variants "base=;s3=-DSAGE_STAGES128=3" --out v.json

TOPS = 4·B·H·N²·D / t (halved for causal). Records per shared/docs/conventions.md (kernel ``sage_int8_fp8``,
``variant`` = ``cuda:<name>``, ``flags`` = the knobs). The inputs are the prologue's (K scales tied in the
groups of SAGE_KGROUP), which every build reads correctly.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import importlib
import json
import multiprocessing as mp
import os
import sys
import time

import torch


def _build(job: tuple) -> str:
    module, flags = job
    t0 = time.time()
    importlib.import_module(module).build(tuple(flags.split()))
    return f"{flags or '(default)'}: built in {time.time() - t0:.0f} s"


def parse_variants(spec: str) -> list[tuple[str, str]]:
    """``"name=flags;name=flags"`` (flags may be empty) as ``[(name, flags), ...]``."""
    return [tuple(x.split("=", 1)) for x in spec.split(";") if x]


def build_variants(module: str, variants: list) -> dict:
    """``{name: extension}`` of the build variants ``[(name, flags)]`` of ``module`` (a module with a
    ``build(extra_flags)``), compiled in parallel first (one process each), then loaded here."""
    t0 = time.time()
    with cf.ProcessPoolExecutor(max_workers=len(variants), mp_context=mp.get_context("spawn")) as ex:
        for msg in ex.map(_build, [(module, f) for _, f in variants]):
            print(msg, flush=True)
    build = importlib.import_module(module).build
    mods = {name: build(tuple(flags.split())) for name, flags in variants}
    print(f"[{time.time() - t0:4.0f}s] {len(mods)} variants built", flush=True)
    return mods


def main():
    import triton
    from triton.testing import do_bench

    from sage_compile.kernels._common import bhn_strides
    from sage_compile.kernels.int8_fp8 import cuda
    from sage_compile.kernels.int8_fp8 import quantize as KQ

    p = argparse.ArgumentParser()
    p.add_argument("--variants", required=True, help='"name=flags;name=flags" (flags may be empty)')
    p.add_argument("--shapes", default="128:16384:none,128:16384:top_left,128:4096:none,64:16384:none,64:4096:none",
                   help="head_dim:N:causal,...")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=3, help="timings per variant and shape (order rotated each round)")
    p.add_argument("--best-to", default=None, help="write the flags of the fastest variant on the first shape here")
    a = p.parse_args()
    variants = parse_variants(a.variants)
    mods = build_variants("sage_compile.kernels.int8_fp8.cuda", variants)
    base = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=os.environ.get("SAGE_COMPILE_COMMIT"), date=datetime.date.today().isoformat(),
                command=" ".join(sys.argv), heads=a.heads)
    recs = []
    for shape in a.shapes.split(","):
        d, n, causal = shape.split(":")
        d, n = int(d), int(n)
        q, k, v = (torch.randn(a.batch, a.heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qt = KQ.quantize(q, k, v, "HND", True)
        flops = 4 * a.batch * a.heads * n * n * d / (1 if causal == "none" else 2)
        row, first, runs, diffs = [], None, {}, {}
        for name, flags in variants:
            out = torch.empty_like(q)
            runs[name] = lambda m=mods[name], o=out: cuda.attention(*qt, causal, None, o, bhn_strides(o, "HND"), module=m)  # noqa: E731
            runs[name]()
            torch.cuda.synchronize()
            if first is None:
                first = out.float()
            diffs[name] = float((out.float() - first).abs().max())
        times = {name: [] for name, _ in variants}
        for r in range(a.rounds):  # the order rotated each round
            for name, _ in variants[r % len(variants):] + variants[:r % len(variants)]:
                times[name].append(do_bench(runs[name], warmup=25, rep=100))
        for name, flags in variants:
            tops = sorted(flops / ms / 1e9 for ms in times[name])
            med, diff = tops[len(tops) // 2], diffs[name]
            recs.append(dict(base, kernel="sage_int8_fp8", variant=f"cuda:{name}", flags=flags, head_dim=d, seq_len=n,
                             causal=causal != "none", batch=a.batch, metric="tops", value=med, rounds=tops,
                             max_abs_diff_vs_first=diff))
            spread = f"[{tops[0]:.0f}-{tops[-1]:.0f}]" if len(tops) > 1 else ""
            row.append(f"{name}={med:.0f}{spread}" + (f" (diff {diff:.1e})" if diff > 0 else ""))
        print(f"hd{d} N={n} {causal}: " + " ".join(row), flush=True)
        del q, k, v, qt
    if a.best_to:
        first = [r for r in recs if (r["head_dim"], r["seq_len"]) == (recs[0]["head_dim"], recs[0]["seq_len"])
                 and r["causal"] == recs[0]["causal"]]
        best = max(first, key=lambda r: r["value"])
        with open(a.best_to, "w") as f:
            f.write(best["flags"])
        print("fastest on the first shape:", best["variant"], f"{best['value']:.0f}", repr(best["flags"]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(recs, f, indent=1)
        print("wrote", a.out)


if __name__ == "__main__":
    main()
