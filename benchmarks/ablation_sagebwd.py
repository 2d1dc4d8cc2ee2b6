"""SageBwd ablations (issue 5), with the reference numerics (what the int8_train kernels compute for the
defaults; GPU tests hold the kernels to the reference's error): gradient cos / rel-L1 vs fp64 autograd of
exact attention, on the gaussian and outlier sets and on SmolLM2-135M's real q/k/v (random dO).

    python benchmarks/ablation_sagebwd.py --out benchmarks/results/ablation_sagebwd.json

Variants: ``sagebwd`` (the defaults: ψ(dS) per 128x64 tile, K per 64 tokens, dO·Vᵀ in bf16),
``dp_int8`` (dO·Vᵀ in INT8 too: the paper's ablation), finer ψ(dS) tiles (64x64, 16x64, 1x64 = one
scale per query row per key tile, for dQ and dK alike: a simulation only, dK's integer dot cannot
factor per-query scales), ``k_token`` (K per token), ``rescale`` (Q/K channel balancing, exact in real
arithmetic), ``rescale+ds_16x64``, ``psi_split`` (the finest scales a kernel can use: per query row for
dQ, per key for dK and for P in dV; the CUDA kernels' numerics) alone and with ``rescale``, and
``psi_split+fwd_tile128`` (the forward's softmax tiles, so its per-token P̃ scales, and V's scales over 128 keys
instead of 64: half the forward's per-step work, ``benchmarks/sass_mix.py --csrc``). ``--variants`` picks some.
Records cos / rel-L1 of O (the forward) and of the gradients. Writes JSON records and a PNG chart.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

VARIANTS = {
    "sagebwd": {},
    "dp_int8": dict(dp_int8=True),
    "ds_64x64": dict(ds_block=(64, 64)),
    "ds_16x64": dict(ds_block=(16, 64)),
    "ds_1x64": dict(ds_block=(1, 64)),
    "k_token": dict(k_block=1),
    "rescale": dict(rescale=True),
    "rescale+ds_16x64": dict(rescale=True, ds_block=(16, 64)),
    "psi_split": dict(psi="split"),
    "rescale+psi_split": dict(rescale=True, psi="split"),
    "psi_split+fwd_tile128": dict(psi="split", fwd_tile=128),
}


def exact_grads(q, k, v, do, causal):
    """fp64 O and autograd of exact attention (GQA by repetition): ``(o, dq, dk, dv)``."""
    qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    o = torch.nn.functional.scaled_dot_product_attention(qq, kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1),
                                                         is_causal=causal)
    return (o.detach(), *torch.autograd.grad(o, (qq, kk, vv), do.double()))


def metrics(got, want):
    from helpers import cos_rel

    return {n: cos_rel(a.double(), w) for n, a, w in zip(("o", "dq", "dk", "dv"), got, want)}


def sets(n, d, layers):
    from helpers import outlier_inputs

    g = torch.Generator().manual_seed(0)
    yield "gaussian", [(*(torch.randn(1, 4, n, d, generator=g).bfloat16() for _ in range(3)), False)]
    yield "outlier", [(*(t.bfloat16() for t in outlier_inputs(1, 4, n, d, g)), False)]
    if layers:
        import smollm2

        model, tok = smollm2.load(dtype=torch.float32)
        ids = tok(smollm2.text("heldout")[:40000], return_tensors="pt").input_ids[:, :2048]
        got = smollm2.capture_attention_inputs(model, ids)
        yield "smollm2", [(q.bfloat16(), k.bfloat16(), v.bfloat16(), c) for i, (q, k, v, c) in enumerate(got)
                          if i % layers == 0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/ablation_sagebwd.json")
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=6, help="every k-th SmolLM2 layer (0: skip SmolLM2)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    a = ap.parse_args()
    variants = {v: VARIANTS[v] for v in a.variants.split(",")}
    from sage_compile.reference.int8_train import gradients_ablation

    meta = dict(device="cpu", torch=torch.__version__, date=datetime.date.today().isoformat(),
                command="python " + " ".join(sys.argv), kernel="int8_train")
    recs, table = [], {}
    for name, cases in sets(a.n, a.d, a.layers):
        acc = {v: {"o": [], "dq": [], "dk": [], "dv": []} for v in variants}
        for q, k, v, causal in cases:
            do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
            want = exact_grads(q, k, v, do, causal)
            for var, kw in variants.items():
                got = gradients_ablation(q, k, v, do, "top_left" if causal else "none", **kw)
                for g, (c, r) in metrics(got, want).items():
                    acc[var][g].append((c, r))
        for var in variants:
            row = {}
            for g, vals in acc[var].items():
                c = sum(x[0] for x in vals) / len(vals)
                r = sum(x[1] for x in vals) / len(vals)
                row[g] = (c, r)
                base = dict(meta, variant=var, inputs=name, head_dim=cases[0][0].shape[-1], seq_len=cases[0][0].shape[2],
                            note=f"{g}; mean over {len(vals)} case(s)")
                recs += [dict(base, metric="cos", value=c), dict(base, metric="rel_l1", value=r)]
            table[(name, var)] = row
            print(f"{name:9s} {var:18s} " + "  ".join(f"{g} {c:.5f}/{r:.4f}" for g, (c, r) in row.items()), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(recs, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = sorted({k[0] for k in table}, key=["gaussian", "outlier", "smollm2"].index)
        fig, axes = plt.subplots(1, 4, figsize=(20, 4), sharey=False)
        for ax, g in zip(axes, ("o", "dq", "dk", "dv")):
            w = 0.8 / len(names)
            for i, nm in enumerate(names):
                ax.bar([j + i * w for j in range(len(variants))], [table[(nm, v)][g][0] for v in variants], w, label=nm)
            ax.set_xticks([j + 0.4 - w / 2 for j in range(len(variants))], list(variants), rotation=45, ha="right")
            ax.set_title(f"{g}: cos vs fp64" + (" autograd" if g != "o" else ""))
            ax.set_ylim(min(table[(nm, v)][g][0] for nm in names for v in variants) - 0.005, 1.0)
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(os.path.splitext(a.out)[0] + ".png", dpi=110)
    except ImportError:
        print("matplotlib missing: no chart")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
