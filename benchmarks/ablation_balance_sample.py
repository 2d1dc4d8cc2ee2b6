"""Q's channel ranges from a token sample (``Options.int8_balance_tokens``), with the reference numerics (what the
int8_fp8 kernels compute, bit for bit given the K mean): output cos / rel-L1 vs fp64 SDPA of the channel-balanced
prologue with Q's ranges from every query (``bt0``) and from strided samples of at least 512 (the default), 128 and
32 queries (on the outlier sets also without the balance), on the gaussian and outlier sets (B=1, 4 query / 2 key
heads, hd64 and hd128, 2048 tokens), the outlier set with a query outlier off the samples (``outlier+q``) and on
them (``outlier+q0``: the first query, which every sample reads), and SmolLM2-135M's real q/k/v (every 5th layer,
2048 tokens, causal; needs the weights, see smollm2.py; ``--smollm2-layers 0`` skips them). ``ks<N>``: K's statistics
(its smoothing mean and the balance's channel ranges) from a strided sample of at least N keys as well, Q's from the
default sample (not the package's numerics: what a statistics pass reading neither K nor Q in full would cost in
accuracy; any mean and any factors are exact in real arithmetic, K's group scales absorb what the sample misses); the
outlier sets also with a key outlier off the K samples (``outlier+k``) and on them (``outlier+k0``, the first key).
CPU only:

    python benchmarks/ablation_balance_sample.py --out benchmarks/results/ablation_balance_sample_cpu.json
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

TOKENS = (0, 512, 128, 32)
K_TOKENS = (512, 128)  # ks<N> variants


def sets(n, smollm2_layers):
    from helpers import outlier_inputs

    g = torch.Generator().manual_seed(0)
    for d in (64, 128):
        yield "gaussian", d, [(*(torch.randn(1, h, n, d, generator=g).bfloat16() for h in (4, 2, 2)), False)]
        q, k, v = (t.bfloat16() for t in outlier_inputs(1, 4, n, d, g, hkv=2))
        yield "outlier", d, [(q, k, v, False)]
        qo = q.clone()
        qo[0, 2, 1001, :8] = 300.0  # off every sample here (1001 is odd)
        qo[0, 3, 77, 4:12] = -200.0
        yield "outlier+q", d, [(qo, k, v, False)]
        qo = q.clone()
        qo[0, 2, 0, :8] = 300.0  # on every sample (the first query)
        yield "outlier+q0", d, [(qo, k, v, False)]
        ko = k.clone()
        ko[0, 1, 1001, 8:16] = 150.0  # off every key sample (1001 is odd)
        yield "outlier+k", d, [(q, ko, v, False)]
        ko = k.clone()
        ko[0, 1, 0, 8:16] = 150.0  # on every key sample (the first key)
        yield "outlier+k0", d, [(q, ko, v, False)]
    if smollm2_layers:
        import smollm2

        model, tok = smollm2.load(dtype=torch.float32)
        ids = tok(smollm2.text("heldout")[:40000], return_tensors="pt").input_ids[:, :n]
        got = smollm2.capture_attention_inputs(model, ids)
        yield "real", 64, [(q.bfloat16(), k.bfloat16(), v.bfloat16(), c) for i, (q, k, v, c) in enumerate(got)
                           if i % smollm2_layers == 0]


def quantize_k_sample(q, k, v, k_tokens):
    """:func:`sage_compile.reference.int8_fp8.quantize` with the channel balance, K's mean and smoothed channel
    ranges taken over :func:`token_sample` (k, k_tokens) instead of every key (Q's over the default sample)."""
    from sage_compile.reference import int8_fp8 as R
    from sage_compile.reference import quant as Qn

    ks = R.token_sample(k, k_tokens)
    mean = Qn.smooth_k(ks)[1]
    ksm = k.float() - mean
    qf, ksm = R.rescale_channels(q.float(), ksm, Qn.smoothed_amax(ks, mean), R.token_sample(q, R.BALANCE_TOKENS))
    return (*Qn.quant_int8(qf, 1), *Qn.quant_int8_k_groups(ksm), *Qn.quant_fp8_v(v, R.V_KEY_MULTIPLE))


def variants(outlier_set: bool) -> dict:
    """``{variant: (its record note, quantize(q, k, v))}``: ``bt<N>`` Q's ranges from N queries (0: every one),
    ``ks<N>`` K's statistics from N keys as well, and on the outlier sets ``no_balance``."""
    from sage_compile.reference import int8_fp8 as R

    out = {f"bt{bt}": (f"balance_tokens={bt} (0: every query)",
                       lambda q, k, v, bt=bt: R.quantize(q, k, v, "HND", True, bt)) for bt in TOKENS}
    out.update({f"ks{n}": (f"K's mean and ranges from a sample of >= {n} keys, Q's from {R.BALANCE_TOKENS}",
                           lambda q, k, v, n=n: quantize_k_sample(q, k, v, n)) for n in K_TOKENS})
    if outlier_set:
        out["no_balance"] = ("no channel balance", lambda q, k, v: R.quantize(q, k, v, "HND", False))
    return out


def main():
    from helpers import cos_rel
    from sage_compile.reference import int8_fp8 as R

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/ablation_balance_sample_cpu.json")
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--smollm2-layers", type=int, default=5, help="every k-th SmolLM2 layer (0: none)")
    a = ap.parse_args()
    meta = dict(device="cpu", torch=torch.__version__, date=datetime.date.today().isoformat(),
                command="python " + " ".join(sys.argv), kernel="ablation_balance_sample")
    recs = []
    for name, d, cases in sets(a.n, a.smollm2_layers):
        row = []
        refs = [torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal,
                                                                 enable_gqa=True) for q, k, v, causal in cases]
        for var, (what, quantize) in variants(name.startswith("outlier")).items():
            vals = []
            for (q, k, v, causal), ref in zip(cases, refs):
                out = R.attention(*quantize(q, k, v), None, "top_left" if causal else "none", None, "HND", torch.float32)
                vals.append(cos_rel(out, ref))
            c, r = (sum(x[i] for x in vals) / len(vals) for i in (0, 1))
            base = dict(meta, variant=var, inputs=name, head_dim=d, seq_len=a.n, causal=cases[0][3],
                        note=f"{what}; mean over {len(vals)} case(s)")
            recs += [dict(base, metric="cos", value=c), dict(base, metric="rel_l1", value=r)]
            row.append(f"{var} {c:.6f}/{r:.5f}")
        print(f"{name:10s} hd{d:<3d} " + "  ".join(row), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(recs, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
