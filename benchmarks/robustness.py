"""``backend="sage"`` in real use (issue 7's robustness items), on a CogVideoX transformer (diffusers, random
weights, real width: 30 heads x 64, bf16; 2 layers, 30 x 44 latents so each compile takes seconds):

    python benchmarks/robustness.py --out benchmarks/results/robustness_h200.json
    python benchmarks/robustness.py --tiny --device cpu          # smoke test (tiny config, reference kernels)

Items (each a record with ``metric: pass`` (1/0) and the numbers behind it):
- ``no_grad`` / ``inference_mode``: sites replaced, step output cos vs eager.
- ``reduce_overhead``: ``torch.compile(m, backend=make_backend(kernel=...), mode="reduce-overhead")`` (CUDA graphs): replayed
  output vs eager, no cudagraph skips (Inductor's counter), latency vs the same compile without CUDA graphs.
- ``dynamic``: ``dynamic=True``, three video lengths (latent frames 4/5/7): graphs compiled (Dynamo's
  ``unique_graphs``) at the first call and recompiles after it, for sage and, as the model's own baseline,
  for Inductor; outputs vs sage compiled for each length alone (and, reported, vs eager). (Not 3 frames:
  the model's configured length, where CogVideoX's patch embedding takes a Python branch of its own, so
  Dynamo specialises on it under any backend.)
- ``dynamic_llm``: the same on a transformers Llama at SmolLM2-135M's width (9 heads x 64, 3 KV heads, 4 of
  its 30 layers, random weights), three sequence lengths (1024/1500/2047 tokens, causal): sage must compile
  one graph and never recompile. (CogVideoX recompiles per frame count on the H200's torch 2.11 under
  Inductor as under sage: Dynamo specialised the frame dimension, ``results/robustness_h200.log`` run 17; the
  specialising line is diffusers' ``get_3d_sincos_pos_embed``, ``pos_embed_spatial.repeat_interleave(temporal_size,
  ...)`` (mark_dynamic's constraint violation names it: ``diag_dynamic.py``, ``results/dynamic_cogvideox_diag_run88_h200.log``);
  on torch 2.13 the same model and lengths compile once under both: ``results/robustness_cpu_dynamic.log``,
  CPU with the reference kernels, and ``--tiny`` in ``results/robustness_tiny_cpu_dynamic.log``.)
- ``batch``: default dynamism, batch 1 -> 2 -> 3: graphs compiled for sage vs Inductor (automatic dynamic
  shapes recompile once, then stay dynamic).
- ``pipeline``: an unmodified diffusers script (``CogVideoXPipeline`` with random weights, its transformer
  under a plain ``torch.compile``: ``benchmarks/pipeline_cogvideox.py``) run in a new process with ``SAGE_COMPILE=1``
  and without: sites replaced (from ``SAGE_COMPILE_DUMP``'s reports) and the latents' cos.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import _commit, write_records  # noqa: E402  (also puts tests/ on the path)
from helpers import cos_rel  # noqa: E402

PIPELINE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pipeline_cogvideox.py")


def build(tiny: bool, device: str):
    """``(model, config)``: CogVideoX transformer (2 layers at CogVideoX-2B's width, or a tiny config)."""
    from diffusers import CogVideoXTransformer3DModel

    cfg = dict(num_attention_heads=30, attention_head_dim=64, num_layers=2, sample_frames=9, sample_height=30,
               sample_width=44, text_embed_dim=4096, time_embed_dim=512)
    if tiny:
        cfg.update(num_attention_heads=2, attention_head_dim=32, num_layers=1, sample_height=8, sample_width=8,
                   text_embed_dim=32, time_embed_dim=16)
    torch.manual_seed(0)
    m = CogVideoXTransformer3DModel(**cfg).to(device, torch.bfloat16).eval()
    return m, cfg


def build_llm(tiny: bool, device: str):
    """A transformers Llama at SmolLM2-135M's width with 4 layers (or a tiny one), random weights, bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True)
    if tiny:
        cfg.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**cfg)).to(device, torch.bfloat16).eval()


def inputs(cfg, device, frames: int, batch: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h, w = cfg["sample_height"], cfg["sample_width"]
    return dict(hidden_states=torch.randn(batch, frames, 16, h, w, generator=g).to(device, torch.bfloat16),
                encoder_hidden_states=torch.randn(batch, 226, cfg["text_embed_dim"], generator=g).to(device, torch.bfloat16),
                timestep=torch.full((batch,), 500, dtype=torch.long, device=device), return_dict=False)


def cos(a, b) -> float:
    return cos_rel(a, b)[0]


def _recompiles(m, be, xs, goal, what, dynamic):
    """Compile ``m`` with Inductor and with sage, call it on each of ``xs``: (ok, note, numbers). Graphs
    compiled by the first call (graph breaks) vs by the later ones (recompiles), per backend; under
    ``dynamic=True`` sage must not recompile, else no more than Inductor. Outputs: under ``dynamic=True``, no
    accuracy lost to dynamic shapes: per shape, the dynamic graph's error vs eager (1 - cos) at most 1.1x that of
    sage compiled for that shape alone (``dynamic=False``), or the two agree to cos >= :data:`SAME_GRAPH_COS`
    (random-weight Llama logits sit at the scheme's own error, cos 0.9989-0.9993 vs exact eager on the H200
    kernels and the CPU reference alike, where Inductor's exact graph gives 0.99996 and sage's static graph
    0.99902 on the CPU at 1024 tokens; on the H200 the dynamic and static graphs' producers differ in rounding,
    cos 0.99993 between them, run 89); otherwise cos vs eager > ``goal``. Cos vs eager is reported in both cases."""
    from torch._dynamo.utils import counters

    graphs, coss, ys = {}, [], []
    for name, backend in (("inductor", "inductor"), ("sage", be)):
        torch._dynamo.reset()
        counters.clear()
        f = torch.compile(m, backend=backend, dynamic=dynamic)
        with torch.no_grad():
            for i, x in enumerate(xs):
                y = f(**x)[0]
                if i == 0:
                    first = counters["stats"]["unique_graphs"]
                if name == "sage":
                    coss.append(cos(y, m(**x)[0]))
                    ys.append(y)
        graphs[name] = (first, counters["stats"]["unique_graphs"] - first)
    (g1, rc), (g1i, rci) = graphs["sage"], graphs["inductor"]
    note = (f"{what}: sage {g1} graph(s) at the first call, {rc} recompile(s) after; inductor {g1i} and {rci}; "
            f"cos vs eager {', '.join(f'{c:.5f}' for c in coss)}")
    numbers = dict(graphs=g1, recompiles=rc, graphs_inductor=g1i, recompiles_inductor=rci, cos=min(coss))
    if dynamic:
        same, static = [], []
        for x, y in zip(xs, ys):
            torch._dynamo.reset()
            with torch.no_grad():
                ys_ = torch.compile(m, backend=be, dynamic=False)(**x)[0]
                same.append(cos(y, ys_))
                static.append(cos(ys_, m(**x)[0]))
        note += (f"; vs sage compiled for each shape alone {', '.join(f'{c:.6f}' for c in same)} (that one vs eager "
                 f"{', '.join(f'{c:.5f}' for c in static)})")
        numbers.update(cos_static=min(same), cos_static_vs_eager=min(static))
        # no accuracy lost to dynamic shapes: the dynamic graph's error vs eager at most 1.1x the static graph's
        # (conventions.md's error-ratio rule), or the two graphs agree to summation order
        no_loss = all(1 - c <= 1.1 * (1 - r) or d >= SAME_GRAPH_COS for c, r, d in zip(coss, static, same))
        ok = rc == 0 and no_loss
    else:
        ok = rc <= rci and min(coss) > goal
    return ok, note, numbers


SAME_GRAPH_COS = 0.99999  # a dynamic graph vs the static one of the same backend: their kernels' summation order


def main():
    import sage_compile
    from torch._dynamo.utils import counters

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--kernel", default="int8_fp8")
    ap.add_argument("--items", default="no_grad,inference_mode,reduce_overhead,dynamic,dynamic_llm,batch,pipeline")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = a.device
    goal = 0.99 if a.kernel == "fp4" else 0.999
    meta = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", torch=torch.__version__,
                date=datetime.date.today().isoformat(), commit=_commit(), command="python " + " ".join(sys.argv),
                model="cogvideox_2layer" + ("_tiny" if a.tiny else ""), kernel="sage_" + a.kernel)
    recs = []
    out_path = a.out or f"benchmarks/results/robustness{'_tiny' if a.tiny else ''}_{dev}.json"

    def rec(item, ok, note, numbers=None):
        print(f"{item:16s} {'PASS' if ok else 'FAIL'}  {note}", flush=True)
        recs.append(dict(meta, variant=item, metric="pass", value=int(bool(ok)), note=note, **(numbers or {})))
        write_records(out_path, recs)  # after every item: a run cut short keeps what it measured

    def sites():
        rows = [r for rep in sage_compile.debug.last_reports() for r in rep]
        return sum(r["decision"] != "kept" for r in rows), len(rows)

    m, cfg = build(a.tiny, dev)
    be = sage_compile.make_backend(kernel=a.kernel)
    items = a.items.split(",")
    x3 = inputs(cfg, dev, 3)
    with torch.no_grad():
        ref3 = m(**x3)[0]

    for item, ctx in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
        if item not in items:
            continue
        torch._dynamo.reset()
        sage_compile.debug.clear_reports()
        with ctx():
            y = torch.compile(m, backend=be)(**x3)[0]
        n, tot = sites()
        c = cos(y, ref3)
        rec(item, n == tot > 0 and c > goal, f"{n}/{tot} sites replaced, cos vs eager {c:.5f}", dict(cos=c))

    if "reduce_overhead" in items and dev == "cuda":
        import triton

        out = {}
        for mode in ("default", "reduce-overhead"):
            torch._dynamo.reset()
            counters.clear()
            sage_compile.debug.clear_reports()
            f = torch.compile(m, backend=be, mode=None if mode == "default" else mode)
            with torch.no_grad():
                for _ in range(3):  # warm-up, record, replay
                    y = f(**x3)[0].clone()
                ms = triton.testing.do_bench(lambda: f(**x3), warmup=3, rep=300)
            out[mode] = (y, ms, dict(counters["inductor"]), sites())
        y, ms, ind, (n, tot) = out["reduce-overhead"]
        skips = ind.get("cudagraph_skips", 0)
        c = cos(y, ref3)
        rec("reduce_overhead", skips == 0 and n == tot > 0 and c > goal,
            f"{n}/{tot} sites, cudagraph skips {skips}, cos vs eager {c:.5f}, {ms:.3f} ms vs {out['default'][1]:.3f} ms "
            f"without CUDA graphs", dict(cos=c, ms=ms, ms_without=out["default"][1]))

    if "dynamic" in items:
        rec("dynamic", *_recompiles(m, be, [inputs(cfg, dev, fr, seed=fr) for fr in (4, 5, 7)], goal,
                                   "3 lengths (latent frames 4/5/7)", dynamic=True))

    if "dynamic_llm" in items:
        llm = build_llm(a.tiny, dev)
        lens = (40, 77, 130) if a.tiny else (1024, 1500, 2047)
        xs = [dict(input_ids=torch.randint(0, llm.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
                   .to(dev)) for n in lens]
        what = (f"Llama ({'tiny' if a.tiny else 'SmolLM2 width'}, {llm.config.num_hidden_layers} layers), "
                f"3 lengths ({'/'.join(map(str, lens))} tokens)")
        ok, note, numbers = _recompiles(llm, be, xs, goal, what, dynamic=True)
        rec("dynamic_llm", ok, note, dict(numbers, model="llama_smollm2_width_4layer" + ("_tiny" if a.tiny else "")))
        del llm

    if "batch" in items:
        rec("batch", *_recompiles(m, be, [inputs(cfg, dev, 3, batch=b, seed=10 + b) for b in (1, 2, 3)], goal,
                                 "batch 1/2/3 (default dynamism)", dynamic=None))

    if "pipeline" in items:
        with tempfile.TemporaryDirectory() as tmp:
            lat = {}
            for name, env in (("plain", {}), ("sage", {"SAGE_COMPILE": "1", "SAGE_COMPILE_KERNEL": a.kernel,
                                                        "SAGE_COMPILE_DUMP": os.path.join(tmp, "dump")})):
                e = {k: v for k, v in os.environ.items() if not k.startswith("SAGE_COMPILE")}
                e.update(env)
                t0 = time.time()
                p = subprocess.run([sys.executable, PIPELINE_SCRIPT, dev, "1" if a.tiny else "0",
                                    os.path.join(tmp, name + ".pt")], env=e, capture_output=True, text=True, timeout=900)
                if p.returncode:
                    rec("pipeline", False, f"{name} run failed: {p.stderr[-800:]}")
                    break
                lat[name] = torch.load(os.path.join(tmp, name + ".pt"))
                print(f"  pipeline {name}: {time.time() - t0:.0f} s", flush=True)
            else:
                rows = [r for f in sorted(glob.glob(os.path.join(tmp, "dump", "*_report.json")))
                        for r in json.load(open(f))]
                n = sum(r["decision"] != "kept" for r in rows)
                c = cos(lat["sage"], lat["plain"])
                rec("pipeline", n == len(rows) > 0 and c > 0.99,
                    f"SAGE_COMPILE=1 on an unmodified CogVideoXPipeline script (3 steps, CFG): {n}/{len(rows)} sites "
                    f"replaced in the compiled transformer, latents cos vs the same script without it {c:.5f}", dict(cos=c))

    print("wrote", out_path, f"({sum(r['value'] for r in recs)}/{len(recs)} pass)")


if __name__ == "__main__":
    main()
