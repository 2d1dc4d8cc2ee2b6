"""SageAttention3 (fp4) accuracy ablations on the reference numerics — the same numbers the kernel
computes (GPU tests: kernel vs reference rel-L1 <= 7e-6 on every set) — so the study runs on any device.

Rows (``variant``): ``default`` (the shipped options), ``nvfp4`` (SageAttention3 as published, every
other row's base: two-level P, Q+K smoothing over 128-row Q blocks, P / unrounded scale, ΔS fp32),
``mxfp4``, ``p_direct`` (one-level P), ``smooth_none``, ``smooth_k``, ``p_scale_rounded``,
``delta_s_input`` (ΔS rounded to bf16, as upstream), beyond the paper ``q_block_32`` / ``q_block_16``
(finer Q smoothing), ``v_smooth`` (V minus its token mean), ``qk_balance`` (Q/K channel ranges balanced)
and ``qk_scale_search`` (Q/K block scales searched), plus ``int8_fp8`` (per-token, no channel balancing) for
scale. Sets: gaussian and
outlier (B=1, H=4, N=1024, hd128, non-causal) and real SmolLM2-135M activations (every layer's q, k, v
from one 2048-token held-back Shakespeare window, causal, GQA 9/3, hd64; see benchmarks/smollm2.py).
``default`` is what ``kernel="fp4"`` ships (:class:`sage_compile.Options`); on CUDA the row ``kernel`` is
the Triton fp4 kernel itself (prologue + core ops, fp32 out) and ``kernel_vs_default`` its rel-L1 / cos
distance to the ``default`` reference row (issue 4's goal 1: equal to accumulation-order noise).
Metrics vs fp64 attention: cos and rel-L1 (per layer, and the mean over layers). Runs on the GPU when there
is one (reference and kernel alike), else on the CPU.

    python benchmarks/ablation_fp4.py --out benchmarks/results/ablation_fp4.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

def _shipped():
    from sage_compile import Options

    o = Options()
    return dict(q_block=o.fp4_q_block, p_scale=o.fp4_p_scale, delta_s=o.fp4_delta_s, smooth_mode=o.fp4_smooth,
                v_smooth=o.fp4_v_smooth, qk_scale=o.fp4_qk_scale, qk_balance=o.fp4_qk_balance)


VARIANTS = {
    "default": _shipped(),
    "nvfp4": {},
    "mxfp4": dict(fmt="mxfp4"),
    "p_direct": dict(p_levels=1),
    "smooth_none": dict(smooth_mode="none"),
    "smooth_k": dict(smooth_mode="k"),
    "p_scale_rounded": dict(p_scale="rounded"),
    "delta_s_input": dict(delta_s="input"),
    "q_block_32": dict(q_block=32),  # beyond SageAttention3: finer Q smoothing (ΔS grows 4x)
    "q_block_16": dict(q_block=16),
    "v_smooth": dict(v_smooth=True),
    "q_block_16+v_smooth": dict(q_block=16, v_smooth=True),
    "qk_balance": dict(qk_balance=True),  # beyond SageAttention3: Q/K channel ranges balanced (α = 0.5)
    "qk_scale_search": dict(qk_scale="search"),  # Q/K block scales searched among 13 maxima
    "q_block_16+v_smooth+qk_scale_search": dict(q_block=16, v_smooth=True, qk_scale="search"),
}


def exact(q, k, v, causal):
    import torch.nn.functional as F

    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)


def run_set(name, q, k, v, causal, rows):
    from helpers import cos_rel

    from sage_compile.reference import fp4, int8_fp8

    want = exact(q, k, v, causal)
    c = "top_left" if causal else "none"
    out = {}
    for var, kw in VARIANTS.items():
        out[var] = fp4.attention_ablation(q, k, v, c, **kw)
    out["int8_fp8"] = int8_fp8.attention(*int8_fp8.quantize(q, k, v, "HND"), None, c, None, "HND", torch.float32)
    if q.is_cuda:
        out["kernel"] = kernel_fp4(q, k, v, c)
    for var, o in out.items():
        cs, l1 = cos_rel(o.double(), want)
        rows.append((name, var, cs, l1))
    if "kernel" in out:
        cs, l1 = cos_rel(out["kernel"].double(), out["default"].double())
        rows.append((name, "kernel_vs_default", cs, l1))
    return out


def kernel_fp4(q, k, v, causal):
    """The fp4 scheme's two ops with the shipped options, fp32 out (HND)."""
    import sage_compile
    import sage_compile.ops  # noqa: F401  (registers the ops)

    o = sage_compile.Options()
    ops = torch.ops.sage_compile
    qt = ops.quantize_fp4(q, k, v, "HND", o.fp4_delta_s, o.fp4_smooth, o.fp4_q_block, o.fp4_v_smooth, o.fp4_qk_scale,
                          o.fp4_qk_balance)
    return ops.attention_fp4(*qt, None, causal, None, "HND", torch.float32, q.shape[-1], o.fp4_p_scale)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/ablation_fp4.json")
    p.add_argument("--layers", default="all", help="SmolLM2 layers: all | comma list | none")
    p.add_argument("--ctx", type=int, default=2048)
    a = p.parse_args()
    from bench_attention import _commit
    from helpers import outlier_inputs

    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    run_on = "cuda" if cuda else "cpu"
    dev = torch.cuda.get_device_name() if cuda else "cpu"
    base = dict(device=dev, torch=torch.__version__,
                commit=_commit(), date=datetime.date.today().isoformat(), command=" ".join(sys.argv), kernel="sage_fp4")
    recs, t0 = [], time.time()

    def emit(rows, **extra):
        for name, var, cs, l1 in rows:
            for metric, val in (("cos", cs), ("rel_l1", l1)):
                recs.append(dict(base, **extra, inputs=name, variant=var, metric=metric, value=val))

    g = torch.Generator().manual_seed(0)
    synth = {"gaussian": tuple(torch.randn(1, 4, 1024, 128, generator=g) for _ in range(3)),
             "outlier": outlier_inputs(1, 4, 1024, 128, g)}
    for name, (q, k, v) in synth.items():
        rows = []
        run_set(name, *(t.bfloat16().to(run_on) for t in (q, k, v)), False, rows)
        emit(rows, head_dim=128, seq_len=1024, heads=4, causal=False)
        line = " ".join(f"{v}={c:.4f}/{l:.3f}" for _, v, c, l in rows)
        print(f"[{time.time() - t0:4.0f}s] {name}: {line}", flush=True)
    if a.layers != "none":
        import smollm2

        model, tok = smollm2.load(device=run_on)
        ids = tok(smollm2.text("heldout")[:400000], return_tensors="pt").input_ids[:, 1000:1000 + a.ctx].to(run_on)
        caps = smollm2.capture_attention_inputs(model, ids)
        layers = range(len(caps)) if a.layers == "all" else [int(x) for x in a.layers.split(",")]
        for li in layers:
            q, k, v, causal = caps[li]
            rows = []
            run_set("smollm2", q, k, v, causal, rows)
            emit(rows, model="SmolLM2-135M", step=li, head_dim=q.shape[-1], seq_len=q.shape[2], heads=q.shape[1],
                 causal=causal)
            print(f"[{time.time() - t0:4.0f}s] smollm2 layer {li}: " + " ".join(f"{v}={c:.4f}" for _, v, c, _ in rows),
                  flush=True)
        for var in sorted({r["variant"] for r in recs if r["inputs"] == "smollm2"}, key=_order):
            for metric in ("cos", "rel_l1"):
                vals = [r["value"] for r in recs
                        if r["inputs"] == "smollm2" and r["variant"] == var and r["metric"] == metric]
                recs.append(dict(base, model="SmolLM2-135M", inputs="smollm2_mean", variant=var, metric=metric,
                                 value=sum(vals) / len(vals), layers=len(vals), seq_len=a.ctx))
    with open(a.out, "w") as f:
        json.dump(recs, f, indent=1)
    chart(recs, a.out.replace(".json", ".png"))
    for r in recs:
        if r["inputs"] in ("gaussian", "outlier", "smollm2_mean") and r["metric"] == "cos":
            print(f"{r['inputs']:13s} {r['variant']:16s} cos {r['value']:.5f}")
    print("wrote", a.out)


def _order(var):
    names = list(VARIANTS) + ["int8_fp8", "kernel", "kernel_vs_default"]
    return names.index(var) if var in names else len(names)


def chart(recs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = [s for s in ("gaussian", "outlier", "smollm2_mean") if any(r["inputs"] == s for r in recs)]
    variants = list(VARIANTS) + ["int8_fp8"] + (["kernel"] if any(r["variant"] == "kernel" for r in recs) else [])
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 4), squeeze=False)
    for ax, s in zip(axes[0], sets):
        vals = [next(r["value"] for r in recs if r["inputs"] == s and r["variant"] == v and r["metric"] == "cos")
                for v in variants]
        colors = {"default": "C0", "kernel": "C0", "int8_fp8": "C2"}
        ax.bar(range(len(variants)), vals, color=[colors.get(v, "C1") for v in variants])
        ax.set_xticks(range(len(variants)), variants, rotation=45, ha="right", fontsize=8)
        lo = min(vals)
        ax.set_ylim(max(0.0, lo - (1 - lo) * 0.3), 1.0)
        ax.set_title(f"{s}: cos vs fp64")
        for i, val in enumerate(vals):
            ax.text(i, val, f"{val:.4f}", ha="center", va="bottom", fontsize=6)
    fig.suptitle("fp4 (SageAttention3 numerics) ablations: reference numerics (default = shipped options), "
                 "kernel = the Triton fp4 kernel")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
