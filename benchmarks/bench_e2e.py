"""One denoising step of real-size diffusion transformers (random weights, real configs, bf16, no
downloads), compiled several ways in one process (issue 7):

    python benchmarks/bench_e2e.py --model cogvideox --out benchmarks/results/e2e_cogvideox_h200.json
    python benchmarks/bench_e2e.py --model flux --out benchmarks/results/e2e_flux_h200.json
    python benchmarks/bench_e2e.py --model cogvideox --tiny --device cpu --variants eager,sage_int8_fp8   # smoke test

Models: ``cogvideox`` = CogVideoX-2B's transformer (30 layers, 30 heads x 64, 49 frames at 480x720 ->
13 x 30 x 45 = 17,550 video tokens + 226 text), ``flux`` = Flux-dev's (19 + 38 blocks, 24 heads x 128,
1024² -> 4,096 image tokens + 512 text), ``wan`` = Wan2.1-T2V-1.3B's (30 layers, 12 heads x 128, 81 frames
at 480x832 -> 32,760 video tokens, cross-attention to 512 text tokens), ``hunyuan`` = HunyuanVideo blocks
(its real width, 24 heads x 128, with 2 dual- and 4 single-stream blocks of its 20 + 40; 61 frames at
544x960 -> 32,640 video tokens + 256 text, a text padding mask). Variants: ``eager``, ``inductor`` (SDPA as Inductor picks it),
``inductor_cudnn`` (the same under ``sdpa_kernel(CUDNN_ATTENTION)``),
``sage_<scheme>`` (``backend="sage"``, ``kernel=<scheme>``; ``sage_<scheme>@op`` with the prologue op instead
of the graph prologue). Per variant: step latency
(``triton.testing.do_bench`` median), compile time (first call), the attention kernels' share of the CUDA
time of one step (profiler, by kernel name), and the output's cos / rel-L1 vs eager. The Amdahl
prediction for each sage variant uses the base step's attention share and the attention kernels'
measured speed-up in the same process: predicted = t_base * ((1 - a) + a / r), the base being
``inductor_cudnn`` where it ran, else ``inductor``.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import datetime
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import _commit, write_records  # noqa: E402

# attention kernels by name: SDPA's (cuDNN, flash, mem-efficient), our cores (Triton _fwd_body, CUDA
# sage_sm90::fwd_kernel) and our prologue kernels (statistics, quantizers, mask check). Inductor's own kernels
# (triton_poi/per/red_fused_...) never count, though it names a kernel after the SDPA node it feeds (CogVideoX's
# QK-norm kernel is triton_per_fused__scaled_dot_product_cudnn_attention_native_layer_norm_...: 2.1 ms of a
# step, counted as cuDNN's attention before run 64); nor do cuDNN's convolutions.
_ATTN = re.compile(r"^(?!triton_)(.*(sdpa|flash|fmha|attention|fwd_kernel)|_fwd_|_bwd_|_quant_|_chan_stats|"
                   r"_stats_finalize|_mask_mismatch|_delta_s|_deq|_split_reduce)", re.I)


def build(model: str, tiny: bool, device: str, batch: int):
    """(module, kwargs) with random weights (bf16) and inputs of the real shapes (or tiny ones)."""
    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16

    def rnd(*s):
        return torch.randn(*s, generator=g, device="cpu").to(device, dt)

    with torch.device(device):
        if model == "cogvideox":
            from diffusers import CogVideoXTransformer3DModel

            cfg = dict(num_attention_heads=30, attention_head_dim=64, num_layers=30, sample_frames=49,
                       sample_height=60, sample_width=90, text_embed_dim=4096, time_embed_dim=512)
            f, h, w, txt, emb = 13, 60, 90, 226, 4096
            if tiny:
                cfg.update(num_attention_heads=2, attention_head_dim=32, num_layers=1, sample_frames=5,
                           sample_height=8, sample_width=8, text_embed_dim=32, time_embed_dim=16)
                f, h, w, emb = 2, 8, 8, 32
            m = CogVideoXTransformer3DModel(**cfg).to(dt).eval()
            kw = dict(hidden_states=rnd(batch, f, 16, h, w), encoder_hidden_states=rnd(batch, txt, emb),
                      timestep=torch.full((batch,), 500, dtype=torch.long, device=device), return_dict=False)
        elif model == "flux":
            from diffusers import FluxTransformer2DModel

            cfg = dict(num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
                       joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True)
            n, txt = 4096, 512
            if tiny:
                cfg.update(num_layers=1, num_single_layers=1, attention_head_dim=32, num_attention_heads=2,
                           joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(8, 12, 12))
                n, txt = 64, 16
            m = FluxTransformer2DModel(**cfg).to(dt).eval()
            side = int(n ** 0.5)
            ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(side).float(), torch.arange(side).float(),
                                             indexing="ij"),
                              -1).reshape(-1, 3).to(device)
            kw = dict(hidden_states=rnd(batch, n, 64), encoder_hidden_states=rnd(batch, txt, cfg["joint_attention_dim"]),
                      pooled_projections=rnd(batch, cfg["pooled_projection_dim"]),
                      timestep=torch.full((batch,), 0.5, device=device, dtype=dt), img_ids=ids,
                      txt_ids=torch.zeros(txt, 3, device=device), guidance=torch.full((batch,), 3.5, device=device, dtype=dt),
                      return_dict=False)
        elif model == "wan":
            from diffusers import WanTransformer3DModel

            # Wan2.1-T2V-1.3B: 30 layers, 12 heads x 128; 81 frames at 480x832 -> latents 21 x 60 x 104,
            # patches (1, 2, 2) -> 32,760 video tokens; 512 text tokens (cross-attention)
            cfg = dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30, text_dim=4096,
                       freq_dim=256)
            f, h, w, txt = 21, 60, 104, 512
            if tiny:
                cfg.update(num_attention_heads=2, attention_head_dim=32, ffn_dim=64, num_layers=1, text_dim=32,
                           freq_dim=16)
                f, h, w, txt = 2, 8, 8, 16
            m = WanTransformer3DModel(**cfg).to(dt).eval()
            kw = dict(hidden_states=rnd(batch, 16, f, h, w), encoder_hidden_states=rnd(batch, txt, cfg["text_dim"]),
                      timestep=torch.full((batch,), 500, dtype=torch.long, device=device), return_dict=False)
        elif model == "hunyuan":
            from diffusers import HunyuanVideoTransformer3DModel

            # HunyuanVideo blocks: the real width (24 heads x 128, MLP 4x, token refiner) with 2 dual-stream
            # and 4 single-stream blocks (the full 20 + 40 is 13B parameters); 61 frames at 544x960 ->
            # latents 16 x 68 x 120, patches 2x2 -> 32,640 video tokens; 256 text tokens, the last 56 padding
            # (encoder_attention_mask: attention with a key mask)
            cfg = dict(num_attention_heads=24, attention_head_dim=128, num_layers=2, num_single_layers=4,
                       num_refiner_layers=2, text_embed_dim=4096, pooled_projection_dim=768)
            f, h, w, txt, pad = 16, 68, 120, 256, 56
            if tiny:
                cfg.update(num_attention_heads=2, attention_head_dim=32, num_layers=1, num_single_layers=1,
                           num_refiner_layers=1, text_embed_dim=32, pooled_projection_dim=16, rope_axes_dim=(8, 12, 12))
                f, h, w, txt, pad = 2, 8, 8, 16, 4
            m = HunyuanVideoTransformer3DModel(**cfg).to(dt).eval()
            mask = torch.ones(batch, txt, dtype=torch.bool, device=device)
            mask[:, txt - pad:] = False
            kw = dict(hidden_states=rnd(batch, 16, f, h, w), encoder_hidden_states=rnd(batch, txt, cfg["text_embed_dim"]),
                      encoder_attention_mask=mask, pooled_projections=rnd(batch, cfg["pooled_projection_dim"]),
                      timestep=torch.full((batch,), 500, dtype=torch.long, device=device),
                      guidance=torch.full((batch,), 6000.0, device=device, dtype=dt), return_dict=False)
        else:
            raise ValueError(model)
    return m, kw


# attention ops (what a step's attention costs, whatever kernels they launch: our prologue's torch
# reductions too): our custom ops and ATen's SDPA ops, the outermost such op only. Inductor's kernel launches
# show as CPU events named after the kernel (triton_..._scaled_dot_product_...): not attention ops.
_ATTN_OP = re.compile(r"^(sage_compile::|aten::_?scaled_dot_product)", re.I)


def attention_op_ms(events) -> float:
    """CUDA ms of the kernels launched under the outermost attention ops among profiler ``events``."""
    ms = 0.0
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or not _ATTN_OP.search(e.name):
            continue
        p = e.cpu_parent
        while p is not None and not _ATTN_OP.search(p.name):
            p = p.cpu_parent
        if p is None:
            ms += e.device_time_total / 1e3
    return ms


def attention_share(fn, device) -> tuple[float, float, float, dict]:
    """(attention kernels' CUDA ms, all kernels' CUDA ms, attention ops' CUDA ms, {kernel name: [launches,
    CUDA ms]}) of one call."""
    if device != "cuda":
        return float("nan"), float("nan"), float("nan"), {}
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    attn = total = 0.0
    events = prof.events()
    kernels: dict = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total += e.device_time / 1e3
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.device_time / 1e3
            if _ATTN.search(e.name):
                attn += e.device_time / 1e3
    return attn, total, attention_op_ms(events), kernels


def kernel_table(kernels: dict, top: int) -> str:
    """The ``top`` kernels of :func:`attention_share`'s table by CUDA time, a line each."""
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    return "\n".join(f"  {ms:9.3f} ms {n:5d}x  {name[:150]}" for name, (n, ms) in rows)


def _variant(m, var: str):
    """``(callable, context factory)`` of one variant: ``eager``, ``inductor``, ``inductor_cudnn`` (SDPA
    pinned to cuDNN, else Inductor's SDPA picks per call) or ``sage_<kernel>``. The context is a factory:
    a generator context manager cannot be entered twice."""
    import sage_compile

    if var == "eager":
        return m, contextlib.nullcontext
    if var in ("inductor", "inductor_cudnn"):
        if var == "inductor":
            return torch.compile(m), contextlib.nullcontext
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return torch.compile(m), functools.partial(sdpa_kernel, [SDPBackend.CUDNN_ATTENTION])
    if var.startswith("sage_"):  # sage_<kernel>[@<prologue>]: e.g. sage_int8_fp8@op
        kernel, _, prologue = var[len("sage_"):].partition("@")
        opts = dict(prologue=prologue) if prologue else {}
        return torch.compile(m, backend=sage_compile.make_backend(kernel=kernel, **opts)), contextlib.nullcontext
    raise ValueError(var)


# where a first call's compile time goes (Dynamo's compile-time metrics, seconds summed over the call)
_PHASES = ("OutputGraph.call_user_compiler", "create_aot_dispatcher_function", "GraphLowering.run",
           "Scheduler.__init__", "GraphLowering.codegen", "async_compile.wait", "PyCodeCache.load_by_key_path")


def compile_phases() -> dict:
    """{phase: seconds} of the compiles since the last :func:`reset_phases` (empty where torch lacks the metrics)."""
    m = getattr(torch._dynamo.utils, "compilation_time_metrics", {})
    return {k: round(sum(m[k]), 2) for k in _PHASES if k in m}


def reset_phases() -> None:
    getattr(torch._dynamo.utils, "compilation_time_metrics", {}).clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="cogvideox", choices=["cogvideox", "flux", "wan", "hunyuan"])
    ap.add_argument("--variants", default="eager,inductor,sage_int8_fp8")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny config (smoke test)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--recompile", action="store_true",
                    help="after the timings, compile each variant again in the process (warm caches) and time "
                         "that first call too")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="print each variant's N kernels with the most CUDA time in one step")
    a = ap.parse_args()
    import sage_compile

    out_path = a.out or f"benchmarks/results/e2e_{a.model}{'_tiny' if a.tiny else ''}.json"
    m, kw = build(a.model, a.tiny, a.device, a.batch)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    meta = dict(device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu", torch=torch.__version__,
                date=datetime.date.today().isoformat(), commit=_commit(), command="python " + " ".join(sys.argv),
                model=a.model + ("_tiny" if a.tiny else ""), batch=a.batch, inputs="random weights and latents")
    recs, ref, res, outs = [], None, {}, {}
    for var in a.variants.split(","):
        torch._dynamo.reset()
        fn_m, ctx = _variant(m, var)
        with torch.no_grad(), ctx():
            sage_compile.debug.clear_reports()
            reset_phases()
            t0 = time.perf_counter()
            y = fn_m(**kw)[0]
            sync()
            first = time.perf_counter() - t0
            phases = compile_phases()
            if phases:
                print(f"{a.model} {var:16s} compile phases (s): {phases}", flush=True)
                recs += [dict(meta, kernel=var, variant="step", metric="compile_phase_s", value=v, note=k)
                         for k, v in phases.items()]
            split = ""
            if var.startswith("sage_int8_fp8") and a.device == "cuda":  # the first call's seconds outside the compile
                from sage_compile.kernels.int8_fp8 import cuda as sage_cuda

                st = sage_cuda.status()
                pre = "not run" if st["prebuild_s"] is None else f"{st['prebuild_s']:.1f} s"
                split = (f" (CUDA core: build wait {st['build_s']:.1f} s, background build {pre}, core selection "
                         f"{st['select_s']:.1f} s)")
                recs += [dict(meta, kernel=var, variant="step", metric="build_wait_s", value=st["build_s"],
                              note="first call: seconds the first call spent in the CUDA core's load (its "
                                   "build, or the wait for the background build started at the rewrite)"),
                         dict(meta, kernel=var, variant="step", metric="prebuild_s",
                              value=-1.0 if st["prebuild_s"] is None else st["prebuild_s"],
                              note="the background build thread's own seconds (-1: it did not run)"),
                         dict(meta, kernel=var, variant="step", metric="select_s", value=st["select_s"],
                              note="first call: seconds timing the CUDA vs Triton cores (auto; incl. Triton "
                                   "autotuning) or reading the on-disk choice")]
            fn = lambda: fn_m(**kw)  # noqa: E731
            if a.device == "cuda":
                import triton

                ms = triton.testing.do_bench(fn, warmup=3, rep=1000)
            else:
                t0 = time.perf_counter()
                fn()
                ms = (time.perf_counter() - t0) * 1e3
            attn, total, attn_op, kernels = attention_share(fn, a.device)
            if a.kernels:
                print(f"{a.model} {var}: the {a.kernels} kernels with the most CUDA time in one step\n"
                      f"{kernel_table(kernels, a.kernels)}", flush=True)
        y = y.float().flatten()
        if ref is None:  # the first variant is the reference of every cos / rel-L1 (eager where it ran first)
            ref, ref_name = y, var
        outs[var] = y
        cos = torch.nn.functional.cosine_similarity(y.double(), ref.double(), dim=0).item()
        rel = ((y - ref).abs().sum() / ref.abs().sum()).item()
        vs_ind = ""
        comp = next((c for c in ("inductor", "inductor_cudnn") if c in outs), None)
        if comp and var.startswith("sage_"):  # compiled bf16 differs from eager by itself: compare with it too
            ci = torch.nn.functional.cosine_similarity(y.double(), outs[comp].double(), dim=0).item()
            vs_ind = f" (vs {comp} cos {ci:.5f})"
            recs.append(dict(meta, kernel=var, variant="step", metric="cos", value=ci, note=f"vs {comp}"))
        rows = [r for rep in sage_compile.debug.last_reports() for r in rep]
        sites = f"{sum(r['decision'] != 'kept' for r in rows)}/{len(rows)} sites replaced" if rows else ""
        res[var] = dict(ms=ms, attn=attn, total=total, attn_op=attn_op)
        print(f"{a.model} {var:16s} step {ms:9.2f} ms  first call {first:7.1f} s  attention {attn:8.2f} "
              f"(ops {attn_op:8.2f}) of {total:8.2f} ms CUDA  cos {cos:.5f} rel-L1 {rel:.4f}{vs_ind}  {sites}"
              f"{split}", flush=True)
        if a.recompile and var != "eager":
            torch._dynamo.reset()
            fn_m, ctx = _variant(m, var)
            with torch.no_grad(), ctx():
                t0 = time.perf_counter()
                fn_m(**kw)
                sync()
                again = time.perf_counter() - t0
            print(f"{a.model} {var:16s} second compile in this process: first call {again:7.1f} s", flush=True)
            recs.append(dict(meta, kernel=var, variant="step", metric="compile_s", value=again,
                             note="second compile in the same process (warm in-process and on-disk caches)"))
        base = dict(meta, kernel=var, variant="step", note=sites)
        recs += [dict(base, metric="ms", value=ms), dict(base, metric="compile_s", value=first),
                 dict(base, metric="cos", value=cos, note=f"vs {ref_name}; {sites}"),
                 dict(base, metric="rel_l1", value=rel, note=f"vs {ref_name}; {sites}"),
                 dict(base, metric="attention_ms", value=attn), dict(base, metric="cuda_ms", value=total),
                 dict(base, metric="attention_op_ms", value=attn_op,
                      note="CUDA time under the attention ops (prologue + core, or SDPA), all their kernels")]
        del fn_m
        write_records(out_path, recs)  # after every variant: a run cut short keeps what it measured
    base_name = "inductor_cudnn" if "inductor_cudnn" in res else "inductor"  # the baseline: cuDNN SDPA
    ind = res.get(base_name)
    if ind and ind["total"] == ind["total"] and ind["total"] > 0:
        for var, r in res.items():
            if not var.startswith("sage_"):
                continue
            # the ops' time counts the prologue's torch kernels too; a variant without attention ops (the traced
            # ops: Inductor launches their kernels) is compared by kernel names
            key = "attn_op" if ind["attn_op"] > 0 and r["attn_op"] > 0 else "attn"
            if not r[key] or not ind[key]:
                continue
            share = ind[key] / ind["total"]
            speed = ind[key] / r[key]
            pred = ind["ms"] * ((1 - share) + share / speed)  # Amdahl: the attention part runs `speed` x faster
            print(f"{var}: {base_name} attention share {share:.2f}, attention speed-up {speed:.2f}x -> Amdahl "
                  f"{pred:.2f} ms (measured {r['ms']:.2f} ms, {r['ms'] / pred - 1:+.1%}); step speed-up vs "
                  f"{base_name} {ind['ms'] / r['ms']:.2f}x", flush=True)
            base = dict(meta, kernel=var, variant="step")
            recs += [dict(base, metric="speedup", value=ind["ms"] / r["ms"], note=f"vs {base_name}"),
                     dict(base, metric="ms", value=pred,
                          note=f"Amdahl prediction from the attention speed-up ({'ops' if key == 'attn_op' else 'kernels'})")]
    write_records(out_path, recs)
    print("wrote", out_path)


if __name__ == "__main__":
    main()
