"""Attention kernel benchmark (one GPU run): sage int8_fp8 (kernel only and with its prologue) beside SDPA
cuDNN / flash, FlexAttention, FA3 bf16 / FP8 (``fa3-fwd`` wheel) and ``sageattention==1.0.6``, plus the
accuracy table on the same inputs. Peers that are not installed are skipped with a note.

    python benchmarks/bench_attention.py --out benchmarks/results/attention_h200.json

TOPS = 4·B·H·N²·D / t (halved for causal), ``triton.testing.do_bench`` median. Records follow
shared/docs/conventions.md; a bar chart PNG is written beside the JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def _commit():
    """``SAGE_COMPILE_COMMIT`` when set (the GPU machine's copy may carry a stale .git), else git HEAD."""
    if os.environ.get("SAGE_COMPILE_COMMIT"):
        return os.environ["SAGE_COMPILE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(__file__)).stdout.strip()
        return out if len(out) == 40 else None
    except OSError:
        return None


def gpu_meta(**extra) -> dict:
    """The fields every GPU result record carries (conventions.md): device, torch, triton, date, commit and
    the command line, plus ``extra``."""
    import triton

    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat(), commit=_commit(), command="python " + " ".join(sys.argv),
                **extra)


def write_records(path, recs):
    """Write result records (conventions.md: a flat JSON list), creating the folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(recs, f, indent=1)


def peers(hd, causal, with_flex=False):
    """name -> (prepare(q, k, v) -> state, run(state)); only what is installed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out, notes = {}, []

    def sdpa(backend):
        def run(s):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(*s, is_causal=causal)
        return (lambda q, k, v: (q, k, v)), run

    out["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    out["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    try:
        if not with_flex:
            raise RuntimeError("skipped (--flex not given)")
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        # one compiled graph per shape: past Dynamo's recompile limit (8) flex silently runs eagerly
        # (materialised scores: single-digit TOPS / OOM), so lift the limit for the sweep
        for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 1024)
        flex = torch.compile(flex_attention, dynamic=False)

        def prep(q, k, v):
            bm = None
            if causal:
                bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, q.shape[2], k.shape[2])
            return q, k, v, bm

        out["flex"] = (prep, lambda s: flex(s[0], s[1], s[2], block_mask=s[3]))
    except Exception as e:  # noqa: BLE001
        notes.append(f"flex: {e!r}")
    try:
        from fa3_fwd_interface import flash_attn_func

        def fa3_prep(q, k, v):
            return tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))

        out["fa3_bf16"] = (fa3_prep, lambda s: flash_attn_func(*s, causal=causal))

        def fa3_fp8_prep(q, k, v):
            b, h = q.shape[:2]
            ts = fa3_prep(q, k, v)
            ts8 = []
            descale = []
            for t in ts:
                sc = (t.float().abs().amax(dim=(1, 3)) / 448.0).clamp_min(1e-12)  # (B, H) per head
                ts8.append((t.float() / sc[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn))
                descale.append(sc.contiguous())
            return (*ts8, *descale)

        out["fa3_fp8"] = (fa3_fp8_prep, lambda s: flash_attn_func(s[0], s[1], s[2], causal=causal, q_descale=s[3],
                                                                  k_descale=s[4], v_descale=s[5]))
    except Exception as e:  # noqa: BLE001
        notes.append(f"fa3: {e!r}")
    try:
        import sageattention

        out["sageattn1"] = ((lambda q, k, v: (q, k, v)),
                            lambda s: sageattention.sageattn(s[0], s[1].clone(), s[2], is_causal=causal))
    except Exception as e:  # noqa: BLE001
        notes.append(f"sageattention 1.0.6: {e!r}")
    return out, notes


class _core:
    """Pin the int8_fp8 core (``SAGE_COMPILE_INT8_FP8_CORE``) around one call."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.old = os.environ.get("SAGE_COMPILE_INT8_FP8_CORE")
        os.environ["SAGE_COMPILE_INT8_FP8_CORE"] = self.name

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("SAGE_COMPILE_INT8_FP8_CORE", None)
        else:
            os.environ["SAGE_COMPILE_INT8_FP8_CORE"] = self.old


def ours(causal, schemes=("int8_fp8", "fp4")):
    """Our kernels, kernel-only (inputs already quantized) and with the prologue; int8_fp8 with the
    Triton core (variants without a suffix) and the CUDA sm90 core (``_cuda``) where it builds."""
    import importlib

    c = "top_left" if causal else "none"
    out = {}
    for scheme in schemes:
        KQ = importlib.import_module(f"sage_compile.kernels.{scheme}.quantize")
        KA = importlib.import_module(f"sage_compile.kernels.{scheme}.attention")
        extra = (lambda q: (q.shape[-1],)) if scheme == "fp4" else (lambda q: ())
        cores = [("", "triton")]
        if scheme == "int8_fp8":
            from sage_compile.kernels.int8_fp8 import cuda

            if cuda.load() is not None:
                cores.append(("_cuda", "cuda"))
            else:
                print("note: CUDA int8_fp8 core:", cuda.status()["error"], flush=True)
        for suffix, core in cores:
            out[f"sage_{scheme}:kernel_only{suffix}"] = (
                (lambda q, k, v, KQ=KQ, extra=extra: (KQ.quantize(q, k, v), extra(q))),
                lambda s, KA=KA, core=core: _run(core, lambda: KA.attention(*s[0], None, c, None, "HND",
                                                                            torch.bfloat16, *s[1])))
            if scheme != "int8_fp8":
                out[f"sage_{scheme}:with_prologue{suffix}"] = (
                    (lambda q, k, v: (q, k, v)),
                    lambda s, KQ=KQ, KA=KA, extra=extra: KA.attention(*KQ.quantize(*s), None, c, None, "HND",
                                                                       torch.bfloat16, *extra(s[0])))
                continue
            out[f"sage_{scheme}:with_prologue{suffix}"] = (  # without channel balancing
                (lambda q, k, v: (q, k, v)),
                lambda s, KQ=KQ, KA=KA, core=core: _run(core, lambda: KA.attention(*KQ.quantize(*s), None, c, None,
                                                                                   "HND", torch.bfloat16)))
            # the default prologue: Q/K channel balancing (Options.int8_channel_rescale)
            out[f"sage_{scheme}:with_prologue_rescale{suffix}"] = (
                (lambda q, k, v: (q, k, v)),
                lambda s, KQ=KQ, KA=KA, core=core: _run(core, lambda: KA.attention(*KQ.quantize(*s, "HND", True),
                                                                                   None, c, None, "HND",
                                                                                   torch.bfloat16)))
    return out


def _run(core, fn):
    with _core(core):
        return fn()


def main():
    import triton
    from triton.testing import do_bench

    from helpers import cos_rel, outlier_inputs

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/attention_h200.json")
    p.add_argument("--seqs", default="1024,4096,8192,16384")
    p.add_argument("--dims", default="128,64")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--flex", action="store_true", help="also time FlexAttention (compiles per shape)")
    p.add_argument("--schemes", default="int8_fp8,fp4", help="our schemes to time")
    p.add_argument("--only", default=None, help="regex: time only the kernels (peers and ours) it matches")
    p.add_argument("--no-accuracy", action="store_true", help="skip the accuracy table")
    a = p.parse_args()
    import re

    keep = (lambda name: re.search(a.only, name) is not None) if a.only else (lambda name: True)  # noqa: E731
    dev = torch.cuda.get_device_name()
    base = dict(device=dev, torch=torch.__version__, triton=triton.__version__, commit=_commit(),
                date=datetime.date.today().isoformat(), command=" ".join(sys.argv), batch=a.batch, heads=a.heads)
    recs = []
    t0 = time.time()
    for hd in (int(x) for x in a.dims.split(",")):
        for causal in (False, True):
            kernels, notes = peers(hd, causal, a.flex)
            for n in notes:
                print("note:", n, flush=True)
            kernels.update(ours(causal, a.schemes.split(",")))
            kernels = {name: kv for name, kv in kernels.items() if keep(name)}
            for n in (int(x) for x in a.seqs.split(",")):
                b = a.batch if n <= 16384 else 2
                q, k, v = (torch.randn(b, a.heads, n, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = 4 * b * a.heads * n * n * hd / (2 if causal else 1)
                row = []
                for name, (prep, run) in kernels.items():
                    try:
                        s = prep(q, k, v)
                        ms = do_bench(lambda: run(s), warmup=25, rep=100)
                    except Exception as e:  # noqa: BLE001
                        print(f"  {name} hd{hd} causal={causal} N={n}: failed {e!r}"[:200], flush=True)
                        continue
                    kern, _, variant = name.partition(":")
                    recs.append(dict(base, kernel=kern, variant=variant or None, head_dim=hd, seq_len=n, causal=causal,
                                     batch=b, metric="tops", value=flops / ms / 1e9))
                    row.append(f"{name}={flops / ms / 1e9:.0f}")
                print(f"[{time.time() - t0:5.0f}s] hd{hd} causal={int(causal)} N={n}: " + " ".join(row), flush=True)
                del q, k, v
                _write(a.out, recs)  # partial results survive a time limit
    # accuracy on the same kind of inputs (N=4096, B=2, H=16, vs fp32 SDPA)
    g = torch.Generator().manual_seed(0)
    for hd in (int(x) for x in a.dims.split(",") if not a.no_accuracy):
        sets = {"gaussian": tuple(torch.randn(2, 16, 4096, hd, generator=g) for _ in range(3)),
                "outlier": outlier_inputs(2, 16, 4096, hd, g)}
        kernels, _ = peers(hd, False)
        kernels.update(ours(False, a.schemes.split(",")))
        kernels = {name: kv for name, kv in kernels.items() if keep(name)}
        for inputs, (q, k, v) in sets.items():
            q, k, v = (t.cuda() for t in (q, k, v))
            exact = F.scaled_dot_product_attention(q, k, v)
            for name, (prep, run) in kernels.items():
                if name.endswith("kernel_only") or name == "flex":
                    continue
                try:
                    o = run(prep(q.bfloat16(), k.bfloat16(), v.bfloat16()))
                except Exception as e:  # noqa: BLE001
                    print(f"  accuracy {name}: failed {e!r}"[:300])
                    continue
                if name.startswith("fa3"):
                    o = o.transpose(1, 2)
                c, l1 = cos_rel(o.float(), exact)
                kern, _, variant = name.partition(":")
                for metric, val in (("cos", c), ("rel_l1", l1)):
                    recs.append(dict(base, kernel=kern, variant=variant or None, head_dim=hd, seq_len=4096,
                                     causal=False, batch=2, heads=16, inputs=inputs, metric=metric, value=val))
                print(f"accuracy hd{hd} {inputs} {name}: cos {c:.5f} rel-L1 {l1:.4f}", flush=True)
    _write(a.out, recs)
    chart(recs, a.out.replace(".json", ".png"))
    print("wrote", a.out, flush=True)


def _write(path, recs):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(recs, f, indent=1)


def chart(recs, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib missing, no chart")
        return
    tops = [r for r in recs if r["metric"] == "tops"]
    combos = sorted({(r["head_dim"], r["causal"]) for r in tops}, key=lambda x: (-x[0], x[1]))
    fig, axes = plt.subplots(1, len(combos), figsize=(5 * len(combos), 4), squeeze=False)
    for ax, (hd, causal) in zip(axes[0], combos):
        rs = [r for r in tops if r["head_dim"] == hd and r["causal"] == causal]
        names = sorted({(r["kernel"] + (":" + r["variant"] if r["variant"] else "")) for r in rs})
        seqs = sorted({r["seq_len"] for r in rs})
        w = 0.8 / max(1, len(names))
        for i, nm in enumerate(names):
            vals = [next((r["value"] for r in rs if (r["kernel"] + (":" + r["variant"] if r["variant"] else "")) == nm
                          and r["seq_len"] == s), 0) for s in seqs]
            ax.bar([j + i * w for j in range(len(seqs))], vals, w, label=nm)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(seqs))], [f"{s // 1024}K" for s in seqs])
        ax.set_title(f"hd{hd} {'causal' if causal else 'non-causal'}")
        ax.set_ylabel("TOPS")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"{recs[0]['device']} attention forward")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
