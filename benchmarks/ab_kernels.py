"""A/B of the Triton kernels against other versions in one process (same GPU, same inputs): the other
versions are copies of kernel files placed beside the current ones as ``_ab_<name>.py`` (they import the
package's helpers relatively, so they run unchanged), timed in name order, then the current (``new``):

    git show <sha>:sage_compile/kernels/int8_train/attention.py > sage_compile/kernels/int8_train/_ab_base.py
    git show <sha>:sage_compile/kernels/int8_fp8/attention.py > sage_compile/kernels/int8_fp8/_ab_base.py
    python benchmarks/ab_kernels.py --out benchmarks/results/ab_<run>.json

(the copies are scratch files: delete them afterwards). Per shape: ``int8_train`` forward and backward
(``psi="split"``) and the ``int8_fp8`` Triton core (``SAGE_COMPILE_INT8_FP8_CORE=triton``), median ms by
``triton.testing.do_bench`` interleaved (every variant once per round), TOPS (4·B·H·N²·D per forward, 2.5× that
for a backward: 5 matmul-sized products), and whether the outputs are bit-identical to the first variant's.
Part ``train_prologue``: ``int8_train``'s ``quantize`` against copies of ``quantize.py`` placed as
``_abq_<name>.py`` (GB/s of its traffic: Q, K, V read, K twice for its mean, and their INT8 written).
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import _commit, write_records  # noqa: E402


def _mods(pkg, base="attention", prefix="_ab_"):
    """{variant: module}: every ``<prefix><name>.py`` beside the package's ``<base>.py`` (as ``<name>``), then
    the current ``<base>`` as ``new``."""
    import glob

    here = os.path.dirname(importlib.import_module(f"sage_compile.kernels.{pkg}").__file__)
    mods = {}
    for f in sorted(glob.glob(os.path.join(here, prefix + "*.py"))):
        name = os.path.basename(f)[:-3]
        mods[name[len(prefix):]] = importlib.import_module(f"sage_compile.kernels.{pkg}.{name}")
    mods["new"] = importlib.import_module(f"sage_compile.kernels.{pkg}.{base}")
    return mods


def _time(fns, reps):
    import time

    import triton

    def bench(f):
        if not torch.cuda.is_available():  # interpreter smoke test: one timed call
            t = time.perf_counter()
            f()
            return (time.perf_counter() - t) * 1e3
        return triton.testing.do_bench(f, warmup=25, rep=100)

    out = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            out[k].append(bench(f))
    return {k: sorted(v)[len(v) // 2] for k, v in out.items()}


def _same(a, b):
    a = a if isinstance(a, (tuple, list)) else (a,)
    b = b if isinstance(b, (tuple, list)) else (b,)
    return all(torch.equal(x.view(torch.uint8) if x.dtype.is_floating_point else x,
                           y.view(torch.uint8) if y.dtype.is_floating_point else y) for x, y in zip(a, b))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="128:16384:0,128:16384:1,128:4096:0,64:16384:0",
                    help="hd:N:causal, B = 32K tokens / N, 16 heads (train) / 32K tokens, 32 heads (int8_fp8)")
    ap.add_argument("--parts", default="train_fwd,train_bwd,int8_fp8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32768, help="B = tokens // N")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    os.environ["SAGE_COMPILE_INT8_FP8_CORE"] = "triton"
    from sage_compile.kernels.int8_fp8.quantize import quantize as q_fp8
    from sage_compile.kernels.int8_train.quantize import quantize as q_train

    tmods, fmods, pmods = _mods("int8_train"), _mods("int8_fp8"), _mods("int8_train", "quantize", "_abq_")
    recs = []
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    meta = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu (TRITON_INTERPRET=1)",
                torch=torch.__version__, date=str(datetime.date.today()), commit=_commit(),
                command="python " + " ".join(sys.argv))
    for spec in a.shapes.split(","):
        d, n, cz = (int(x) for x in spec.split(":"))
        causal = "top_left" if cz else "none"
        b = max(1, a.tokens // n)
        g = torch.Generator(device=dev).manual_seed(0)
        for part in a.parts.split(","):
            h = 32 if part == "int8_fp8" else 16
            q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
            flops = 4 * b * h * n * n * d * (0.5 if cz else 1.0)
            if part == "train_prologue":
                flops = 0.0
                gbytes = 3 * q.numel() * 3 + k.numel() * 2  # bf16 read + int8 written each, K read twice
                run = {m: (lambda mod=mod: mod.quantize(q, k, v, "HND")) for m, mod in pmods.items()}
            elif part == "int8_fp8":
                x = q_fp8(q, k, v, "HND")
                cfg = None if dev == "cuda" else {"BLOCK_M": 64}  # the interpreter cannot autotune
                run = {m: (lambda mod=mod: mod.attention(*x, None, causal, None, "HND", torch.bfloat16, config=cfg))
                       for m, mod in fmods.items()}
            else:
                q8, qs, k8, ks, v8, vs, mean = q_train(q, k, v, "HND")
                o, lse = tmods["new"].forward(q8, qs, k8, ks, v8, vs, causal, None, "HND", torch.bfloat16)
                do = torch.randn_like(q)
                if part == "train_fwd":
                    run = {m: (lambda mod=mod: mod.forward(q8, qs, k8, ks, v8, vs, causal, None, "HND", torch.bfloat16))
                           for m, mod in tmods.items()}
                else:
                    flops *= 2.5
                    run = {m: (lambda mod=mod: mod.backward(q8, qs, k8, ks, v8, vs, mean, o, lse, do, causal, None,
                                                            "HND", torch.bfloat16, psi="split"))
                           for m, mod in tmods.items()}
            res = {m: f() for m, f in run.items()}  # warm (autotune) and outputs
            first = next(iter(res))
            same = {m: _same(res[first], r) for m, r in res.items() if m != first}
            ms = _time(run, a.reps)
            rate = (lambda t: f"{gbytes / t / 1e6:6.0f} GB/s") if not flops else (
                lambda t: f"{flops / t / 1e9:6.1f} TOPS")
            line = f"{part:9s} hd{d} N={n:6d} B={b} causal={cz}: " + "  ".join(
                f"{m} {t:7.3f} ms {rate(t)}" for m, t in ms.items())
            for m in same:
                line += f"  {m}: {ms[first] / ms[m]:.3f}x {first}'s speed, bit-identical {same[m]}"
            print(line, flush=True)
            for m, t in ms.items():
                recs.append(dict(meta, kernel=part, variant=m, metric="ms", value=t, head_dim=d, n=n, batch=b,
                                 heads=h, causal=bool(cz), **({"tops": flops / t / 1e9} if flops else {}),
                                 note=f"bit-identical to {first}: {same.get(m, True)}"))
    if a.out:
        write_records(a.out, recs)
        print("wrote", a.out)


if __name__ == "__main__":
    main()
