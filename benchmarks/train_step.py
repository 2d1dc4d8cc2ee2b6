"""Where a compiled training step's time goes: ``backend="sage"`` with ``kernel="int8_train"`` against Inductor
with SDPA, on a Llama of SmolLM2-135M's shape with random weights (no download: the step's time does not depend
on the weights), the step of ``finetune_smollm2.py`` (bf16 autocast, AdamW, gradient clipping).

Per variant: the median step time (synchronized steps, after warm-up), and from ``torch.profiler`` over a few
steps, per step: the kernels' summed CUDA time (what the GPU computed; the rest of the step it waited for the
host), the number of kernel launches, the host syncs (``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` calls;
the profiled steps end with one), and the largest kernels. ``--mask`` passes an ``attention_mask`` of ones
(transformers then hands every site a bool mask; transformers 5.17 does so even without one); ``--pad N`` pads the
first sequence's last N tokens out of it (a padded batch: causal + key padding).

    python benchmarks/train_step.py [--seq 2048] [--batch 2] [--steps 20] [--rounds 1] [--mask [--pad N]]
        [--variants sdpa,sage]
        [--mode reduce-overhead] [--cprofile 40] [--trace PREFIX] [--out results/train_step_<run>_<commit>_<gpu>.json]
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import _commit, write_records  # noqa: E402

# SmolLM2-135M's shape (its config.json): what finetune_smollm2.py trains
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize")  # the CUDA runtime calls a host sync makes


def model(layers: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**dict(SMOLLM2, num_hidden_layers=layers), attn_implementation="sdpa", use_cache=False,
                      attention_dropout=0.0)
    return LlamaForCausalLM(cfg).to(device).train()


def stepper(variant: str, m, device: str, mask: bool, mode=None, pad: int = 0):
    """A function running one training step of ``m`` compiled for ``variant`` (``sdpa``: Inductor; ``sage``: the
    ``int8_train`` backend, its defaults (on CUDA the traced ops); ``sage_op``: the same with the opaque ops,
    ``prologue="op"``; ``mode``: torch.compile's, e.g. ``reduce-overhead`` for CUDA graphs) on a (B, N + 1) id
    tensor; with ``mask`` an ``attention_mask``, the first sequence's last ``pad`` tokens 0."""
    import sage_compile

    opts = dict(sage=dict(kernel="int8_train"), sage_op=dict(kernel="int8_train", prologue="op"))
    backend = "inductor" if variant == "sdpa" else sage_compile.make_backend(**opts[variant])
    cm = torch.compile(m, backend=backend, mode=mode)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.0)

    def step(ids):
        kw = {}
        if mask:
            kw["attention_mask"] = torch.ones_like(ids[:, :-1])
            if pad:
                kw["attention_mask"][0, -pad:] = 0
        return train_step(cm, m, opt, ids, device, **kw)

    return step


def train_step(cm, m, opt, ids, device: str, sched=None, **model_kw):
    """One step of next-token training of ``m`` (run through ``cm``, its compiled form) on ``ids`` (B, N + 1): bf16
    autocast, fp32 cross-entropy, gradient clipping at 1.0, ``opt`` (and ``sched``) stepped; returns the loss (not
    synchronized). ``finetune_smollm2.py`` trains with it too."""
    with torch.autocast(device, torch.bfloat16):
        logits = cm(input_ids=ids[:, :-1], **model_kw).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    if sched is not None:
        sched.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def profile(step, ids, device: str, steps: int = 3, trace=None):
    """Per step: (kernels' CUDA ms, kernel launches, host syncs, Counter of ms by kernel name) from torch.profiler;
    with ``trace``, the same steps' Chrome trace (host ops of every thread, runtime calls, kernels) written there."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_ctx

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with prof_ctx(activities=acts) as prof:
        for _ in range(steps):
            step(ids)
        _sync(device)
    by_name, launches, syncs = collections.Counter(), 0, 0
    for e in prof.events():
        if e.device_type.name == "CUDA":
            by_name[e.name[:70]] += e.device_time / 1e3 / steps
            launches += 1
        elif any(s in e.name for s in SYNCS):
            syncs += 1
    if trace:
        prof.export_chrome_trace(trace)
        print("wrote", trace, flush=True)
    return sum(by_name.values()), launches / steps, syncs / steps, by_name


def host_profile(step, ids, device: str, top: int, steps: int = 3):
    """Where the host's time of a step goes, over ``steps`` synchronized steps: torch.profiler's CPU ops by their
    own host time (every thread: the compiled backward runs on the autograd engine's device thread), then cProfile's
    ``top`` Python functions by own and by cumulative time (the main thread only: the forward, the optimizer)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_ctx

    with prof_ctx(activities=[ProfilerActivity.CPU]) as tp:
        for _ in range(steps):
            step(ids)
        _sync(device)
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=top), flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step(ids)
    _sync(device)
    prof.disable()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--layers", type=int, default=SMOLLM2["num_hidden_layers"])
    ap.add_argument("--steps", type=int, default=20, help="timed steps a round (after 5 warm-up steps)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of timed steps, the variants interleaved")
    ap.add_argument("--mask", action="store_true", help="pass an attention_mask of ones")
    ap.add_argument("--pad", type=int, default=0, help="with --mask: the first sequence's last PAD tokens padded out")
    ap.add_argument("--variants", default="sdpa,sage", help="of sdpa, sage, sage_op")
    ap.add_argument("--mode", default=None, help="torch.compile's mode, e.g. reduce-overhead (CUDA graphs)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cprofile", type=int, default=0, help="then print this many of the largest host costs over 3 "
                    "steps (torch.profiler's CPU ops, cProfile's Python functions)")
    ap.add_argument("--trace", default=None, help="also write the profiled steps' Chrome trace (3 steps) to "
                    "TRACE_<variant>.json.gz (read it with trace_gaps.py --steps 3)")
    a = ap.parse_args()
    dev = a.device
    ids = torch.randint(0, SMOLLM2["vocab_size"], (a.batch, a.seq + 1), device=dev,
                        generator=torch.Generator(device=dev).manual_seed(0))
    meta = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", torch=torch.__version__,
                commit=_commit(), command="python " + " ".join(sys.argv), model=f"smollm2-135m-shape-{a.layers}l",
                seq_len=a.seq, batch=a.batch, inputs="random ids, random weights")
    recs, steps, first = [], {}, {}
    variants = a.variants.split(",")
    for variant in variants:  # compile and warm up each
        steps[variant] = stepper(variant, model(a.layers, dev), dev, a.mask, a.mode, a.pad)
        t0 = time.perf_counter()
        for _ in range(5):
            steps[variant](ids)
        _sync(dev)
        first[variant] = time.perf_counter() - t0
        print(f"{variant}: compiled and warmed up in {first[variant]:.1f} s", flush=True)
    times = {v: [] for v in variants}
    for _ in range(a.rounds):  # the variants' timed steps interleaved: a host slower for a while slows them all
        for variant in variants:
            for _ in range(a.steps):
                t = time.perf_counter()
                steps[variant](ids)
                _sync(dev)
                times[variant].append((time.perf_counter() - t) * 1e3)
    for variant in variants:
        step = steps[variant]
        ms = statistics.median(times[variant])
        busy, launches, syncs, by_name = profile(step, ids, dev, trace=a.trace and f"{a.trace}_{variant}.json.gz")
        print(f"{variant}: step {ms:.1f} ms (median of {a.rounds} x {a.steps}; warm-up incl. compile "
              f"{first[variant]:.1f} s), kernels {busy:.1f} ms a step ({launches:.0f} launches), GPU idle "
              f"{ms - busy:.1f} ms, host syncs {syncs:.0f} a step", flush=True)
        for name, t in by_name.most_common(a.top):
            print(f"    {t:8.3f} ms  {name}")
        if a.cprofile:
            host_profile(step, ids, dev, a.cprofile)
        kernel = dict(sdpa="sdpa_inductor", sage="sage_int8_train", sage_op="sage_int8_train_op")[variant]
        note = (f"mask={a.mask}, pad={a.pad}, mode={a.mode}; {launches:.0f} launches and {syncs:.0f} host syncs a step; "
                f"median of {a.rounds} rounds of {a.steps} steps, the variants interleaved")
        recs.append(dict(meta, kernel=kernel, variant="train_step", metric="ms", value=ms, note=note))
        recs.append(dict(meta, kernel=kernel, variant="train_step_kernels", metric="ms", value=busy, note=note))
        recs.append(dict(meta, kernel=kernel, variant="train_step_warmup", metric="ms", value=first[variant] * 1e3,
                         note=f"mask={a.mask}, pad={a.pad}, mode={a.mode}; compile and 5 warm-up steps"))
        if a.out:  # after each variant: a later one's failure or timeout keeps these
            write_records(a.out, recs)
    if a.out:
        print("wrote", a.out)


if __name__ == "__main__":
    main()
