"""Attention blocks of real diffusion transformers (random weights): RoPE + QK-norm + attention + output
projection, as diffusers runs them, compiled up to five ways in one process (issue: fused prologue):

    inductor   torch.compile, SDPA as Inductor picks it          variant "default"
    sdpa_cudnn torch.compile under sdpa_kernel(CUDNN_ATTENTION)  variant "cudnn"
    int8_fp8   backend="sage", prologue="op" (custom op kernels) variant "unfused"
    int8_fp8   backend="sage", prologue="graph" (Inductor fuses the quantizer into RoPE/QK-norm) variant "fused"
    int8_fp8   backend="sage", prologue="traced" (the op's kernels, launched by Inductor's code) variant "traced"

    python benchmarks/bench_block.py --out benchmarks/results/block_h200.json [--models cogvideox,flux] [--n 1024,4096,16384]
        [--variants default,cudnn,unfused,fused] [--profile-host unfused]

Models: ``cogvideox`` = CogVideoX-2B's ``attn1`` (dim 1920, 30 heads x 64, LayerNorm QK-norm, RoPE on the
video tokens, 226 text tokens); ``flux`` = Flux's joint ``attn`` (dim 3072, 24 heads x 128, RMSNorm QK-norm,
RoPE on all tokens, 512 text tokens); ``wan`` = Wan2.1-14B's self-attention ``attn1`` (dim 5120, 40 heads x 128,
RMSNorm across heads, RoPE, no text: 32,760 tokens at 480p x 81 frames); ``hunyuan`` = HunyuanVideo's dual-stream
``attn`` (dim 3072, 24 heads x 128, RMSNorm QK-norm, RoPE on the video tokens, 256 text tokens appended, no
text padding mask). N = image/video tokens; batch 1; bf16.

Per variant: the module's time (``triton.testing.do_bench`` median, ms), its host time per call (``host_ms``:
enqueue time from an idle GPU; ``--profile-host VARIANTS`` prints cProfile's largest costs), and from one profiled iteration
its CUDA kernel time split by kernel name into ``gemm`` (projections), ``core`` (the attention kernel) and
``other`` (QK-norm, RoPE, the quantization prologue, elementwise); ``attention`` = core + other = what the
projections do not take; ``prologue`` = other minus the ``cudnn`` variant's other (what the quantization
adds: its kernels and the producers' extra cost), also as ``prologue_pct`` of the attention part. Also the
first call's wall time (compile) and the output's cos / rel-L1 vs the first variant run (``default``). Records follow
shared/docs/conventions.md with a ``part`` field. ``--dump DIR`` writes the sage variants' Inductor code.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import _commit  # noqa: E402

# attention cores: SDPA's kernels, our Triton core (_fwd_body) and CUDA core (sage_sm90::fwd_kernel); never an
# Inductor-generated kernel (triton_poi/per/red_fused_..., whose names list the ATen ops they fuse)
_CORE = re.compile(r"sdpa|flash|fmha|attention|cudnn|_fwd_body|fwd_kernel|attn", re.I)
_INDUCTOR = re.compile(r"^triton_(poi|per|red)_")
_GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|splitk|cublas", re.I)


def build(model: str, n: int, device: str):
    """(module, kwargs, heads, head_dim) with random weights and inputs; RoPE tables from random angles."""
    g = torch.Generator(device="cpu").manual_seed(0)
    if model == "cogvideox":
        from diffusers.models.transformers.cogvideox_transformer_3d import CogVideoXBlock

        heads, hd, dim, txt = 30, 64, 1920, 226
        m = CogVideoXBlock(dim=dim, num_attention_heads=heads, attention_head_dim=hd, time_embed_dim=512).attn1
        rope_len = n
    elif model == "flux":
        from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

        heads, hd, dim, txt = 24, 128, 3072, 512
        m = FluxTransformerBlock(dim=dim, num_attention_heads=heads, attention_head_dim=hd).attn
        rope_len = n + txt
    elif model == "wan":
        from diffusers.models.transformers.transformer_wan import WanTransformerBlock

        heads, hd, dim, txt = 40, 128, 5120, 0
        m = WanTransformerBlock(dim=dim, ffn_dim=13824, num_heads=heads).attn1
        rope_len = n
    elif model == "hunyuan":
        from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoTransformerBlock

        heads, hd, dim, txt = 24, 128, 3072, 256
        m = HunyuanVideoTransformerBlock(num_attention_heads=heads, attention_head_dim=hd, mlp_ratio=4.0).attn
        rope_len = n
    else:
        raise ValueError(model)
    m = m.to(device=device, dtype=torch.bfloat16).eval()
    ang = torch.rand(rope_len, hd, generator=g) * 2 * math.pi
    rope = (ang.cos().to(device), ang.sin().to(device))
    x = torch.randn(1, n, dim, generator=g).to(device, torch.bfloat16)
    if model == "wan":  # self-attention only; RoPE tables (1, N, 1, D) for its (B, N, H, D) q / k
        return m, dict(hidden_states=x, rotary_emb=tuple(t[None, :, None] for t in rope)), heads, hd
    enc = torch.randn(1, txt, dim, generator=g).to(device, torch.bfloat16)
    return m, dict(hidden_states=x, encoder_hidden_states=enc, image_rotary_emb=rope), heads, hd


def variants():
    import sage_compile
    from torch.nn.attention import SDPBackend, sdpa_kernel

    nullctx = lambda: torch.autograd.grad_mode.no_grad()  # noqa: E731

    def cudnn_ctx():
        return _Both(torch.no_grad(), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]))

    return {
        ("inductor", "default"): ("inductor", nullctx),
        ("sdpa_cudnn", "cudnn"): ("inductor", cudnn_ctx),
        ("int8_fp8", "unfused"): (sage_compile.make_backend(kernel="int8_fp8", prologue="op"), nullctx),
        ("int8_fp8", "fused"): (sage_compile.make_backend(kernel="int8_fp8", prologue="graph"), nullctx),
        ("int8_fp8", "traced"): (sage_compile.make_backend(kernel="int8_fp8", prologue="traced"), nullctx),
    }


class _Both:
    def __init__(self, *cms):
        self.cms = cms

    def __enter__(self):
        for c in self.cms:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.cms):
            c.__exit__(*exc)


def kernel_split(fn) -> dict:
    """CUDA kernel time (ms) of one call of ``fn``, split into gemm / core / other by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    split = {"gemm": 0.0, "core": 0.0, "other": 0.0}
    names = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = e.device_time / 1e3  # us -> ms
        part = ("core" if _CORE.search(e.name) and not _INDUCTOR.search(e.name)
                else "gemm" if _GEMM.search(e.name) else "other")
        split[part] += t
        names[e.name[:90]] = (part, round(names.get(e.name[:90], (part, 0.0))[1] + t, 4))
    return split, names


HOST_CALLS = 20  # ~25 launches a call: 500 launches, within CUDA's launch queue (~1024), so enqueueing never waits


def host_ms(fn, calls: int = HOST_CALLS) -> float:
    """Host time of one call (ms): the mean over ``calls`` calls enqueued from an idle GPU, without a sync (what
    the CPU spends per call; the GPU hides it only where its own time per call is longer)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) * 1e3 / calls
    torch.cuda.synchronize()
    return t


def host_profile(fn, calls: int = 100, top: int = 25) -> str:
    """cProfile of ``calls`` calls: the ``top`` functions by their own time."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for i in range(calls):
        fn()
        if i % HOST_CALLS == HOST_CALLS - 1:
            torch.cuda.synchronize()  # (the queue never fills: host time only)
    pr.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/block_h200.json")
    ap.add_argument("--models", default="cogvideox,flux")
    ap.add_argument("--n", default="1024,4096,16384")
    ap.add_argument("--verbose", action="store_true", help="print every kernel with its class")
    ap.add_argument("--dump", default=None, help="write the Inductor code of each sage variant under this folder")
    ap.add_argument("--variants", default="default,cudnn,unfused,fused", help="comma list of the variants to run")
    ap.add_argument("--profile-host", default="", help="comma list of variants: print cProfile's largest host costs")
    a = ap.parse_args()
    import triton

    import sage_compile
    from sage_compile.debug import last_reports

    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    dev = torch.cuda.get_device_name()
    meta = dict(device=dev, torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat(), commit=_commit(),
                command="python " + " ".join(sys.argv), batch=1, inputs="random weights, gaussian activations")
    recs = []

    def rec(**kw):
        recs.append({**meta, **kw})
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(recs, f, indent=1)

    for model in a.models.split(","):
        for n in (int(s) for s in a.n.split(",")):
            m, kw, heads, hd = build(model, n, "cuda")
            ref, base_other = None, None
            for (kernel, variant), (backend, ctx) in variants().items():
                if variant not in a.variants.split(","):
                    continue
                torch._dynamo.reset()
                c = torch.compile(m, backend=backend)
                base = dict(kernel=kernel, variant=variant, model=model, seq_len=n, heads=heads, head_dim=hd)
                try:
                    with ctx():
                        t0 = time.perf_counter()
                        if a.dump and kernel == "int8_fp8":
                            from torch._inductor.utils import run_and_get_code

                            out, code = run_and_get_code(c, **kw)
                        else:
                            out, code = c(**kw), None
                        torch.cuda.synchronize()
                        compile_s = time.perf_counter() - t0
                        if code:  # written after the timing, which stays the first call's alone
                            os.makedirs(a.dump, exist_ok=True)
                            with open(os.path.join(a.dump, f"{model}_{n}_{variant}.py"), "w") as f:
                                f.write("\n\n".join(code))
                        fn = lambda: c(**kw)  # noqa: E731
                        ms = triton.testing.do_bench(fn, warmup=50, rep=300)
                        split, names = kernel_split(fn)
                        host = host_ms(fn)
                        if a.profile_host and variant in a.profile_host.split(","):
                            print(host_profile(fn), flush=True)
                except Exception as e:  # a variant that fails is reported, the others still run
                    print(f"{model} N={n} {kernel}/{variant}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    rec(**base, metric="failed", value=1, note=f"{type(e).__name__}: {str(e)[:300]}")
                    continue
                y = torch.cat([t.flatten().float() for t in out])
                sites = ""
                if kernel == "int8_fp8":
                    rep = last_reports()
                    sites = sage_compile.format_report(rep[-1]) if rep else "no report"
                if ref is None:
                    ref = y
                cos = torch.nn.functional.cosine_similarity(y.double(), ref.double(), dim=0).item()
                rel = ((y - ref).abs().sum() / ref.abs().sum()).item()
                attn = split["core"] + split["other"]
                if variant == "cudnn":
                    base_other = split["other"]
                print(f"{model:9s} N={n:6d} {kernel:10s} {variant:8s} {ms:8.3f} ms  host {host:6.3f}  compile {compile_s:6.1f} s  "
                      f"gemm {split['gemm']:.3f} core {split['core']:.3f} other {split['other']:.3f} "
                      f"(attention {attn:.3f})  cos {cos:.5f} rel-L1 {rel:.4f}", flush=True)
                if a.verbose:
                    for k_, (part, t) in sorted(names.items(), key=lambda x: -x[1][1]):
                        print(f"      {part:5s} {t:8.4f}  {k_}")
                if sites:
                    print("      " + sites.splitlines()[0], flush=True)
                    base["note"] = sites.splitlines()[0]
                rec(**base, part="block", metric="ms", value=ms)
                for part in ("gemm", "core", "other"):
                    rec(**base, part=part, metric="ms", value=split[part])
                rec(**base, part="attention", metric="ms", value=attn)
                if kernel == "int8_fp8" and base_other is not None:
                    pro = split["other"] - base_other
                    print(f"      prologue {pro:.3f} ms = {100 * pro / attn:.1f} % of the attention part", flush=True)
                    rec(**base, part="prologue", metric="ms", value=pro)
                    rec(**base, part="prologue", metric="prologue_pct", value=100 * pro / attn)
                rec(**base, part="block", metric="host_ms", value=host)
                rec(**base, part="block", metric="compile_s", value=compile_s)
                rec(**base, part="block", metric="cos", value=cos)
                rec(**base, part="block", metric="rel_l1", value=rel)
            del m, kw
            torch.cuda.empty_cache()
    print("wrote", a.out)


if __name__ == "__main__":
    main()
