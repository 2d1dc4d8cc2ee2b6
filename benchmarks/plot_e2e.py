"""Chart of ``bench_e2e.py`` results: one denoising step per model and variant (latency split into attention
kernels and the rest, speed-up vs the compiled cuDNN baseline, output cos vs eager).

    python benchmarks/plot_e2e.py benchmarks/results/e2e_cogvideox_h200.json benchmarks/results/e2e_flux_h200.json \
        --out benchmarks/results/e2e_h200.png
"""
from __future__ import annotations

import argparse
import json


def load(path: str) -> tuple[str, dict]:
    """(model, {variant: {metric: value}}) of one results file (cos = the one vs the run's first variant:
    eager where it ran, else the compiled baseline; its name under ``"ref"``)."""
    rows = json.load(open(path))
    out: dict = {}
    for r in rows:
        note = r.get("note") or ""
        if r["metric"] == "cos":
            if not (note.startswith("vs eager") or ";" in note):
                continue  # the extra 'vs inductor' record of the sage variants
            out.setdefault("ref", note[3:].split(";")[0])
        if r["metric"] == "ms" and "Amdahl" in note:
            out.setdefault(r["kernel"], {})["amdahl_ms"] = r["value"]
            continue
        out.setdefault(r["kernel"], {})[r["metric"]] = r["value"]
    return rows[0]["model"], out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", default="benchmarks/results/e2e_h200.png")
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(a.files), figsize=(6.5 * len(a.files), 4.6), squeeze=False)
    for ax, path in zip(axes[0], a.files):
        model, res = load(path)
        ref = res.pop("ref", "eager")
        names = list(res)
        base = res.get("inductor_cudnn") or res.get("inductor")
        ms = [res[n]["ms"] for n in names]
        # the step's wall time split by the CUDA-time share of the attention kernels
        attn = [res[n]["ms"] * res[n]["attention_ms"] / res[n]["cuda_ms"] for n in names]
        x = range(len(names))
        ax.bar(x, attn, color="#d62728", label="attention kernels (incl. prologue)")
        ax.bar(x, [m - t for m, t in zip(ms, attn)], bottom=attn, color="#7f7f7f", label="rest of the step")
        for i, n in enumerate(names):
            r = res[n]
            label = f"{base['ms'] / r['ms']:.2f}x\ncos {r['cos']:.5f}" if base else f"cos {r['cos']:.5f}"
            ax.text(i, r["ms"] * 1.01, label, ha="center", va="bottom", fontsize=8)
            if "amdahl_ms" in r:
                ax.plot([i - 0.4, i + 0.4], [r["amdahl_ms"]] * 2, "k--", lw=1)
        ax.set_xticks(list(x), [n.replace("sage_", "sage\n") for n in names], fontsize=8)
        ax.set_ylabel("ms per denoising step")
        ax.set_ylim(0, max(ms) * 1.25)
        ax.set_title(f"{model}: one step, H200, bf16\n(x = speed-up vs Inductor+cuDNN; cos vs {ref}; -- Amdahl)",
                     fontsize=9)
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
