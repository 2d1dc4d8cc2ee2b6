"""SmolLM2-135M perplexity on held-back Shakespeare with every scheme (issue: end to end on real models).

Each scheme runs through ``sage_compile.enable(kernel=...)`` (every SDPA call of the model -> the op): on
CUDA the kernels, on CPU the reference numerics (the same numbers to accumulation order). Baseline:
``exact`` (the model's own bf16 SDPA). Non-overlapping windows of ``--ctx`` tokens from the held-back plays.

    python benchmarks/ppl_smollm2.py --ctx 2048 --windows 6 --out benchmarks/results/ppl_smollm2_cpu.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def parse_scheme(entry: str) -> tuple[str, dict]:
    """``"fp4:fp4_v_smooth=0;fp4_q_block=128"`` -> ``("fp4", {"fp4_v_smooth": False, "fp4_q_block": 128})``:
    each value takes the type of the :class:`sage_compile.Options` field's default."""
    import dataclasses

    import sage_compile

    scheme, _, rest = entry.partition(":")
    defaults = {f.name: f.default for f in dataclasses.fields(sage_compile.Options)}
    opts = {}
    for item in filter(None, rest.split(";")):
        key, _, val = item.partition("=")
        if key not in defaults:
            raise SystemExit(f"unknown option {key!r}; known: {sorted(defaults)}")
        kind = type(defaults[key])
        opts[key] = val.strip().lower() in ("1", "true", "yes", "on") if kind is bool else kind(val)
    return scheme, opts


def main():
    import smollm2
    from bench_attention import _commit

    import sage_compile

    p = argparse.ArgumentParser()
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--windows", type=int, default=6)
    p.add_argument("--schemes", default="exact,int8_fp8,int8_fp16,fp4",
                   help="comma list; a scheme may carry Options after a colon, e.g. fp4:fp4_v_smooth=0")
    p.add_argument("--out", default="benchmarks/results/ppl_smollm2_cpu.json")
    a = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = smollm2.load(device=dev)
    ids = tok(smollm2.text("heldout"), return_tensors="pt").input_ids[0]
    wins = [ids[i * a.ctx:(i + 1) * a.ctx] for i in range(a.windows)]
    assert all(len(w) == a.ctx for w in wins), "not enough held-back text for these windows"
    base = dict(device=dev if dev == "cpu" else torch.cuda.get_device_name(), torch=torch.__version__,
                commit=_commit(), date=datetime.date.today().isoformat(), command=" ".join(sys.argv),
                model="SmolLM2-135M", seq_len=a.ctx, batch=1, metric="ppl")
    recs, t0, ppl = [], time.time(), {}
    for entry in a.schemes.split(","):
        scheme, opts = parse_scheme(entry)
        nll, n, per_window = 0.0, 0, []
        for i, w in enumerate(wins):
            x = w[None].to(dev)
            with torch.no_grad(), sage_compile.enable(kernel=scheme, **opts):
                logits = model(x).logits.float()
            per_window.append(torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum").item())
            nll += per_window[-1]
            n += a.ctx - 1
            if dev == "cpu":  # slow there: each window's mean NLL as it comes
                print(f"[{time.time() - t0:5.0f}s] {entry} window {i}: mean NLL {per_window[-1] / (a.ctx - 1):.5f}",
                      flush=True)
        ppl[entry] = math.exp(nll / n)
        rel = ppl[entry] / ppl.get("exact", ppl[entry]) - 1
        recs.append(dict(base, kernel=f"sage_{scheme}" if scheme != "exact" else "sdpa", variant=entry,
                         value=ppl[entry], tokens=n, rel_to_exact=rel, window_nll=per_window,
                         **({"options": opts} if opts else {})))
        print(f"[{time.time() - t0:5.0f}s] {entry}: ppl {ppl[entry]:.4f} ({100 * rel:+.2f} % vs exact)", flush=True)
    with open(a.out, "w") as f:
        json.dump(recs, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
