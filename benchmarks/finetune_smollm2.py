"""Fine-tuning parity (issue 5): SmolLM2-135M (real weights, GGUF) fine-tuned on Shakespeare at sequence
length 2048, once compiled with Inductor (bf16 SDPA) and once with ``backend="sage"`` training
(``kernel="int8_train"``: SageBwd forward and backward), same seed, same data order, same optimizer.

    python benchmarks/finetune_smollm2.py --out benchmarks/results/finetune_smollm2_h200.json [--steps 200]
        [--variants sdpa,sage_split] [--mode reduce-overhead]

fp32 master weights, bf16 autocast (attention gets bf16 q/k/v), AdamW lr 1e-4 (20 warm-up steps, then
constant), batch 2 x 2048 tokens of the ``train`` split in a seeded random order. Records ``step``/``loss``
per variant, the step time, the mean loss of the last 20 steps and its ratio; a PNG of both curves.
See benchmarks/smollm2.py for the weights and the text.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import smollm2  # noqa: E402
from bench_attention import _commit  # noqa: E402
from train_step import train_step  # noqa: E402


def batches(tok, steps, batch, seq, seed=0):
    """``steps`` (batch, seq + 1) token tensors from the train split, in a seeded order (the same for
    every variant)."""
    need = steps * batch * (seq + 1)
    text = smollm2.text("train")
    ids = tok(text[: need * 6], return_tensors="pt").input_ids[0]
    if ids.numel() < need:
        raise RuntimeError(f"train text gives {ids.numel()} tokens, {need} needed")
    chunks = ids[: ids.numel() // (seq + 1) * (seq + 1)].view(-1, seq + 1)
    order = torch.randperm(chunks.shape[0], generator=torch.Generator().manual_seed(seed))
    return [chunks[order[(i * batch) % len(order):][:batch]] for i in range(steps)]


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def train(variant, data, steps, lr, device, mode=None):
    import sage_compile

    model, _ = smollm2.load(dtype=torch.float32, device=device)
    model.config.attention_dropout = 0.0
    model.config.use_cache = False
    model.train()
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    backend = ("inductor" if variant == "sdpa" else
               sage_compile.make_backend(kernel="int8_train", int8_train_psi=PSI[variant]))
    sage_compile.debug.clear_reports()
    cm = torch.compile(model, backend=backend, mode=mode)
    losses, times = [], []
    for step in range(steps):
        x = data[step].to(device)
        _sync(device)
        t0 = time.perf_counter()
        loss = train_step(cm, model, opt, x, device, sched)
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if step % 20 == 0 or step == steps - 1:
            print(f"{variant:10s} step {step:4d} loss {loss.item():.4f} {times[-1] * 1e3:8.1f} ms", flush=True)
    rows = [r for rep in sage_compile.debug.last_reports() for r in rep]
    n_train = sum(r["decision"] == "int8_train" for r in rows)
    n_traced = sum(r["decision"] == "int8_train" and r["prologue"] == "graph" for r in rows)
    sites = (f"{n_train}/{len(rows)} sites int8_train ({n_traced} on the traced ops)" if rows else "no sage sites")
    del cm, model, opt
    if device == "cuda":
        torch.cuda.empty_cache()
    return losses, times, sites


PSI = {"sage": "tile", "sage_split": "split"}  # Options.int8_train_psi of each sage variant
KERNELS = {"sdpa": "sdpa", "sage": "int8_train", "sage_split": "int8_train_split"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/finetune_smollm2_h200.json")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mode", default=None, help="torch.compile's mode, e.g. reduce-overhead (CUDA graphs)")
    ap.add_argument("--variants", default="sdpa,sage", help="sdpa, sage (ψ per tile), sage_split (ψ per row)")
    a = ap.parse_args()
    import triton

    _, tok = smollm2.load(device="cpu")
    data = batches(tok, a.steps, a.batch, a.seq)
    meta = dict(device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu", torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat(), commit=_commit(), command="python " + " ".join(sys.argv),
                model="smollm2-135m", seq_len=a.seq, batch=a.batch, inputs="shakespeare train split")
    recs, curves = [], {}
    for variant, kernel in KERNELS.items():
        if variant not in a.variants.split(","):
            continue
        losses, times, sites = train(variant, data, a.steps, a.lr, a.device, a.mode)
        curves[variant] = losses
        for s, l in enumerate(losses):
            recs.append(dict(meta, kernel=kernel, variant="finetune", step=s, metric="loss", value=l))
        step_ms = statistics.median(times[min(5, len(times) - 1):]) * 1e3
        last = statistics.mean(losses[-20:])
        recs.append(dict(meta, kernel=kernel, variant="finetune", metric="ms", value=step_ms,
                         note=f"median step time after 5 steps (first step incl. compile {times[0]:.1f} s); {sites}; "
                              f"mode={a.mode}"))
        recs.append(dict(meta, kernel=kernel, variant="finetune_last20", metric="loss", value=last))
        print(f"{variant}: last-20 mean loss {last:.4f}, step {step_ms:.1f} ms, first step {times[0]:.1f} s, {sites}",
              flush=True)
    for v in ("sage", "sage_split"):
        if v in curves and "sdpa" in curves:
            ratio = statistics.mean(curves[v][-20:]) / statistics.mean(curves["sdpa"][-20:])
            recs.append(dict(meta, kernel=KERNELS[v], variant="finetune_last20", metric="ratio", value=ratio,
                             note=f"{v} / sdpa mean loss over the last 20 steps (goal within 1 %)"))
            print(f"last-20 loss ratio {v}/sdpa {ratio:.4f}")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(recs, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for v, lab in (("sdpa", "bf16 SDPA (inductor)"), ("sage", 'backend="sage" int8_train (SageBwd, ψ per tile)'),
                       ("sage_split", 'backend="sage" int8_train, ψ per row (split)')):
            if v in curves:
                ax.plot(curves[v], label=lab, lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(f"SmolLM2-135M fine-tune, Shakespeare, {a.batch}x{a.seq} tokens/step, {meta['device']}"
                     + (f", mode={a.mode}" if a.mode else ""), fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.splitext(a.out)[0] + ".png", dpi=120)
    except ImportError:
        print("matplotlib missing: no chart")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
