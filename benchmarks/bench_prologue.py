"""The ``int8_fp8`` prologue op (``prologue="op"``: :func:`sage_compile.kernels.int8_fp8.quantize.quantize`)
timed against other versions of it in one process, on the q/k/v that diffusers hands attention (views of
(B, N, H, D) projections, channel balancing on, the default):

    git show <sha>:sage_compile/kernels/int8_fp8/quantize.py > sage_compile/kernels/int8_fp8/_ab_quant_base.py
    python benchmarks/bench_prologue.py --out benchmarks/results/prologue_<run>.json

(the copy is a scratch file: delete it afterwards). Per shape and variant: GPU ms (the op captured in a
CUDA graph, ``do_bench_cudagraph`` median, variants interleaved: without the graph the op is host-bound,
~0.5 ms per call on the H200 whatever the shape), wall ms per call (``do_bench``), host ms per call (the Python side: launches, allocations; mean over 50 calls
issued back to back), and how many quantized values differ from the first variant's (the K mean may
differ by summation order between versions, which moves a few K values by one step; Q and V must not;
``--balance-tokens`` variants move Q's and K's values with their channel factors).
"""
from __future__ import annotations

import argparse
import glob
import importlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import gpu_meta, write_records  # noqa: E402

SHAPES = {  # model: (heads, head dim, extra text tokens)
    "cogvideox": (30, 64, 226),
    "flux": (24, 128, 512),
}


def _mods():
    import sage_compile.kernels.int8_fp8 as pkg

    here = os.path.dirname(pkg.__file__)
    mods = {os.path.basename(f)[10:-3]: importlib.import_module(f"sage_compile.kernels.int8_fp8.{os.path.basename(f)[:-3]}")
            for f in sorted(glob.glob(os.path.join(here, "_ab_quant_*.py")))}
    mods["new"] = importlib.import_module("sage_compile.kernels.int8_fp8.quantize")
    return mods


# bytes each prologue kernel moves per element of one of Q, K, V (bf16 reads, 1-byte writes; scales, partials and
# Q's balance sample left out): the statistics read K and V, the row quantizer reads and writes Q and K, V's reads
# and writes V
KERNEL_BYTES = {"_chan_stats": 4, "_quant_rows_int8": 6, "_quant_v_fp8": 3, "_stats_finalize": 0}


# bytes the op moves per element of one of Q, K, V with channel balancing: K and V read twice in bf16 (statistics,
# quantization), Q once (its balance sample left out), each written once in one byte: its DRAM floor (variants
# reading every query move 2 more)
OP_BYTES = 2 * (2 * 2 + 1) + (2 + 1)


def kernel_times(fn, qkv, base: dict, label: str, calls: int = 20) -> list:
    """CUDA time per call of each kernel ``fn`` launches (:func:`diag_train._kernel_ms`: torch.profiler over
    ``calls`` calls), printed with the bandwidth it implies (:data:`KERNEL_BYTES`); records ``metric: ms``,
    ``variant: <variant>/<kernel>``."""
    from diag_train import _kernel_ms

    numel = qkv[0].numel()
    recs = []
    for name, ms in _kernel_ms(fn, calls).most_common():
        nb = next((v for kk, v in KERNEL_BYTES.items() if kk in name), None)
        bw = f"  {nb * numel / ms / 1e9:5.2f} TB/s" if nb else ""
        print(f"{label} kernel {name[:40]:40s} {ms:7.4f} ms{bw}", flush=True)
        recs.append(dict(base, variant=f"{base['variant']}/{name}", metric="ms", value=ms,
                         note=f"CUDA time per call (torch.profiler, {calls} calls)"))
    return recs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="cogvideox,flux")
    ap.add_argument("--n", default="4096,16384")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/prologue.json")
    ap.add_argument("--balance-tokens", default="",
                    help="comma list: the current op also with these balance_tokens (variant new_bt<N>; 0: every query)")
    ap.add_argument("--kernels", action="store_true",
                    help="also each kernel's CUDA time in every variant (torch.profiler, 20 calls) with its bandwidth")
    a = ap.parse_args()
    import triton

    mods = _mods()
    meta = gpu_meta(kernel="sage_int8_fp8", inputs="gaussian", batch=1)
    recs = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for model in a.models.split(","):
        h, d, txt = SHAPES[model]
        for n in (int(x) for x in a.n.split(",")):
            nt = n + txt
            q, k, v = (torch.randn(1, nt, h, d, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                       for _ in range(3))
            fns = {name: (lambda m=m: m.quantize(q, k, v, "HND", True)) for name, m in mods.items()}
            for bt in (int(x) for x in a.balance_tokens.split(",") if x):
                fns[f"new_bt{bt}"] = lambda bt=bt: mods["new"].quantize(q, k, v, "HND", True, bt)
            outs = {name: f() for name, f in fns.items()}
            ms = {name: [] for name in fns}
            for _ in range(a.reps):
                for name, f in fns.items():
                    ms[name].append(triton.testing.do_bench_cudagraph(f, rep=200))
            first = next(iter(outs))
            for name, f in fns.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(50):
                    f()
                host = (time.perf_counter() - t0) / 50 * 1e3
                torch.cuda.synchronize()
                wall = triton.testing.do_bench(f, warmup=25, rep=200)
                gpu = sorted(ms[name])[len(ms[name]) // 2]
                diff = {lbl: int((x.view(torch.uint8) != y.view(torch.uint8)).sum()) if x.element_size() == 1
                        else int((x != y).sum()) for lbl, x, y in zip(("q8", "qs", "k8", "ks", "v8", "vs"),
                                                                     outs[name], outs[first])}
                tbs = OP_BYTES * q.numel() / gpu / 1e9
                print(f"{model:9s} N={nt:6d} {name:8s} gpu {gpu:7.4f} ms ({tbs:4.2f} TB/s)  wall {wall:6.3f} ms  host {host:6.3f} ms  "
                      f"differs from {first}: {diff}", flush=True)
                base = dict(meta, model=model, variant=name, heads=h, head_dim=d, seq_len=nt)
                recs += [dict(base, metric="ms", value=gpu, note="GPU time of the prologue op (CUDA graph, do_bench_cudagraph median)"),
                         dict(base, metric="ms", variant=name + "_wall", value=wall, note="wall time per call (do_bench median)"),
                         dict(base, metric="host_ms", value=host, note="host time per call, 50 calls back to back"),
                         dict(base, metric="values_differing", value=sum(diff.values()), note=f"vs {first}: {diff}")]
            for name in (fns if a.kernels else ()):
                try:
                    recs += kernel_times(fns[name], (q, k, v), dict(meta, model=model, variant=name, heads=h,
                                                                    head_dim=d, seq_len=nt), f"{model:9s} N={nt:6d} {name:8s}")
                except Exception as e:  # (the profiler is a diagnostic: the timings above stand without it)
                    print(f"kernel times failed: {e!r}", flush=True)
    write_records(a.out, recs)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
