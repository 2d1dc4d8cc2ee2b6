"""Tuning sweep of the int8_fp8 core (one GPU run): explicit configurations — tile sizes, warps, stages,
warp specialisation, the two ways of two-level PV accumulation — timed at a few large shapes, each
checked against the autotuned kernel's output first (a variant that changes results is reported, not timed).

    python benchmarks/tune_int8_fp8.py --out benchmarks/results/tune_int8_fp8_h200.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

VARIANTS = [  # BLOCK_M, BLOCK_N, warps, stages, WS, PV
    (128, 128, 8, 2, False, 0), (128, 128, 8, 3, False, 0), (128, 128, 8, 4, False, 0),
    (128, 128, 8, 2, False, 1), (128, 128, 8, 3, False, 1),
    (128, 128, 4, 2, False, 0), (128, 128, 4, 3, False, 1),
    (64, 128, 4, 2, False, 0), (64, 128, 4, 3, False, 0), (64, 128, 4, 3, False, 1),
    (128, 128, 8, 2, True, 0), (128, 128, 8, 3, True, 1), (128, 128, 4, 2, True, 0),
]  # BLOCK_N stays 128: the P scale follows the running max per 128-key tile (the reference's numerics)
SHAPES = [(128, "none"), (128, "top_left"), (64, "none")]


def main():
    import triton
    from triton.testing import do_bench

    sys.path.insert(0, os.path.join(os.path.dirname(__file__)))
    from bench_attention import _commit
    from sage_compile.kernels.int8_fp8 import attention as KA
    from sage_compile.kernels.int8_fp8 import quantize as KQ

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/tune_int8_fp8_h200.json")
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    a = p.parse_args()
    base = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=_commit(), date=datetime.date.today().isoformat(), command=" ".join(sys.argv),
                batch=a.batch, heads=a.heads, seq_len=a.n, kernel="sage_int8_fp8", metric="tops")
    recs, t0 = [], time.time()
    for hd, causal in SHAPES:
        q, k, v = (torch.randn(a.batch, a.heads, a.n, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qt = KQ.quantize(q, k, v)
        want = KA.attention(*qt, None, causal, None, "HND", torch.bfloat16).float()
        flops = 4 * a.batch * a.heads * a.n * a.n * hd / (2 if causal != "none" else 1)
        for bm, bn, w, st, ws, pv in VARIANTS:
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st, WS=ws, PV=pv)
            name = f"m{bm}n{bn}w{w}s{st}{'ws' if ws else ''}pv{pv}"
            try:
                got = KA.attention(*qt, None, causal, None, "HND", torch.bfloat16, config=cfg).float()
                err = ((got - want).abs().sum() / want.abs().sum()).item()
                if not err < 2e-3:
                    print(f"hd{hd} {causal} {name}: output differs (rel-L1 {err:.2e}), not timed", flush=True)
                    continue
                ms = do_bench(lambda: KA.attention(*qt, None, causal, None, "HND", torch.bfloat16, config=cfg),
                              warmup=25, rep=100)
            except Exception as e:  # noqa: BLE001
                print(f"hd{hd} {causal} {name}: failed {e!r}"[:300], flush=True)
                continue
            tops = flops / ms / 1e9
            recs.append(dict(base, head_dim=hd, causal=causal != "none", variant=name, config=cfg, value=tops))
            print(f"[{time.time() - t0:4.0f}s] hd{hd} {causal} {name}: {tops:.0f} TOPS", flush=True)
        del q, k, v, qt
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(recs, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
