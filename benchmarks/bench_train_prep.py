"""``int8_train``'s memory-bound kernels (the forward's prologue: K's mean and ``_quant_qkv``; the backward's
``_bwd_prep``) under other launch configurations, against the default in one process (GPU).

    python benchmarks/bench_train_prep.py [--shapes 16x16x2048x128,2x16x16384x128] [--rounds 3] [--out F.json]

Per shape (B x H x N x D, bf16, HND): each variant's median GPU ms (``triton.testing.do_bench``, ``--rounds``
rounds in rotated order, the median of their medians), the bandwidth of its DRAM floor (each tensor read and
written once: Q, K, V read and K read again for its mean, q̂, k̂, V̂, V̂ᵀ written; O and dO read, q̂, k̂, V̂ read,
the 16-bit dO (where copied), ψ(dO)ᵀ, q̂ᵀ, k̂ᵀ and V̂ in 16 bits written), whether its outputs equal the default's
bit for bit, and the forward + backward of a whole ``int8_train`` call (CUDA core) with each backward variant.
``--profile``: the CPU ops of one forward + backward by their CUDA time (what launched each kernel).
Records: ``metric`` ``ms`` (``kernel`` prologue / bwd_prep / fwd_bwd, ``variant``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import gpu_meta  # noqa: E402

QKV = {"w4": 4, "w8": 8, "w16": 16}  # QKV_WARPS
# (two launches, PREP_WARPS, PREP_WARPS_DO, PREP_WARPS_REST, dO read in place)
PREP = {"base_copy": (False, 8, 8, 4, False), "one_8": (False, 8, 8, 4, True), "one_16": (False, 16, 8, 4, True),
        "split_8_4": (True, 8, 8, 4, True), "split_16_4": (True, 8, 16, 4, True), "split_8_8": (True, 8, 8, 8, True),
        "split_16_8": (True, 8, 16, 8, True), "split_8_4_copy": (True, 8, 8, 4, False)}


def _median_rounds(fns: dict, rounds: int) -> dict:
    import triton

    names, times = list(fns), {n: [] for n in fns}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(triton.testing.do_bench(fns[n], warmup=25, rep=150))
    return {n: statistics.median(t) for n, t in times.items()}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return all(_same(x, y) for x, y in zip(a, b))
    return (a is b) if a is None or b is None else torch.equal(a, b)


def _run_variants(variants: dict, call, rounds: int):
    """``call(v)`` for each variant's value: ``(median ms of each, each one's outputs)``."""
    fns = {name: (lambda v=v: call(v)) for name, v in variants.items()}
    outs = {name: f() for name, f in fns.items()}
    return _median_rounds(fns, rounds), outs


def _report(recs, meta, kernel, shape, ms, outs, base, floor=None):
    """Print and record each variant's time, its bandwidth over ``floor(name)`` bytes, and whether its outputs are
    ``base``'s bits."""
    for name in ms:
        same = _same(outs[name], outs[base])
        bw = f"  {floor(name) / ms[name] / 1e9:6.2f} TB/s" if floor else ""
        print(f"{shape} {kernel:8s} {name:14s} {ms[name]:.4f} ms{bw}  same {same}", flush=True)
        recs.append(dict(meta, kernel=kernel, variant=name, shape=shape, metric="ms", value=ms[name],
                         note=f"same bits as {base}: {same}"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16x16x2048x128,2x16x16384x128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/train_prep.json")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    os.environ["SAGE_COMPILE_INT8_TRAIN_CORE"] = "cuda"
    import sage_compile
    from sage_compile.kernels.int8_train import attention as KA
    from sage_compile.kernels.int8_train import quantize as KQ

    meta = gpu_meta(inputs="gaussian")
    recs = []
    opts = sage_compile.Options(int8_train_psi="split")

    def set_prep(v):
        split, KA.PREP_WARPS, KA.PREP_WARPS_DO, KA.PREP_WARPS_REST, in_place = v
        KA.PREP_SPLIT_MIN_ELEMENTS = 0 if split else None  # (the variant says whether to split)
        KA.reads_do_in_place = (lambda *x: False) if not in_place else _in_place

    _in_place = KA.reads_do_in_place
    for shape in a.shapes.split(","):
        b, h, n, d = (int(x) for x in shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, o, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(5))
        e = b * h * n * d
        # prologue
        def prologue(w):
            KQ.QKV_WARPS = w
            return KQ.quantize_vt(q, k, v)

        ms, outs = _run_variants(QKV, prologue, a.rounds)
        _report(recs, meta, "prologue", shape, ms, outs, "w4", lambda name: e * (2 * 4 + 4))
        KQ.QKV_WARPS = QKV["w4"]
        qt, _ = KQ.quantize_vt(q, k, v)
        q8, qs, k8, ks, v8, vs = qt[:6]
        lse = torch.randn(b, h, n, device="cuda")

        def prep(var):
            set_prep(var)
            return KA.bwd_prep(q8, k8, v8, vs, o, lse, do, "HND", torch.bfloat16)

        ms, outs = _run_variants(PREP, prep, a.rounds)
        _report(recs, meta, "bwd_prep", shape, ms, outs, "base_copy",
                lambda name: e * (2 * 2 + 3 + (0 if PREP[name][4] else 2) + 3 + 2))
        # a whole forward + backward with each backward variant
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

        def step():
            out = sage_compile.attention(qg, kg, vg, None, "none", None, "HND", "int8_train", opts)
            return torch.autograd.grad(out, (qg, kg, vg), do)

        def fwd_bwd(var):
            set_prep(var)
            return step()

        ms, grads = _run_variants(PREP, fwd_bwd, a.rounds)
        _report(recs, meta, "fwd_bwd", shape, ms, grads, "base_copy")
        set_prep(PREP["split_8_4"])
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))
        del q, k, v, o, do, qg, kg, vg
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(recs, fh, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
