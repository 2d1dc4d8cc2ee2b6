"""Diagnostics for where time goes (GPU), printed as it runs; one short GPU call:

    python benchmarks/diag_overhead.py [--parts graph,overhead,train,train_host]

overhead: the int8_fp8 prologue op / core op / composed op at a small shape (CogVideoX 1K-token block:
    B=1 H=30 N=1250 D=64): wall time per call (``do_bench``), host time per call through the custom ops and
    straight into the kernel modules (the op layer's cost), and the CPU-side profile of the prologue op
    (what the host spends per call: the block benchmark saw ~2 ms of host time at 1K).
train_host: the host time of one int8_train site (SmolLM2's: B=2 Hq=9 Hkv=3 D=64, N=128 so the GPU waits for the
    host): per call of the op's forward, its autograd forward+backward, the backward op, the kernel module's
    quantize/forward/backward without the dispatcher, beside SDPA's; then cProfile's largest host costs.
train: int8_train at hd128 N=8K B=4 H=16: forward, backward, and the backward's kernels by name (CUDA
    time from the profiler), beside SDPA cuDNN's forward and backward.
graph: CogVideoX attn1 (small) with prologue='graph' forced on CUDA vs the op, toggling the IEEE-division
    patch and channel balancing, to locate the wrong outputs the block benchmark measured.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def _bench(fn, rep=200):
    import triton

    return triton.testing.do_bench(fn, warmup=20, rep=rep)


def _prof(fn, activities, sort, n=15):
    from torch.profiler import profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=activities) as p:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by=sort, row_limit=n), flush=True)


def overhead():
    from torch.profiler import ProfilerActivity

    import sage_compile
    from sage_compile import ops  # noqa: F401

    q, k, v = (torch.randn(1, 30, 1250, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o = torch.ops.sage_compile
    qt = o.quantize_int8_fp8(q, k, v, "HND", True)
    for name, fn in (("quantize op (rescale)", lambda: o.quantize_int8_fp8(q, k, v, "HND", True)),
                     ("quantize op (no rescale)", lambda: o.quantize_int8_fp8(q, k, v, "HND", False)),
                     ("core op", lambda: o.attention_int8_fp8(*qt, None, "none", None, "HND", torch.bfloat16)),
                     ("composed", lambda: sage_compile.attention(q, k, v, scheme="int8_fp8")),
                     ("sdpa", lambda: F.scaled_dot_product_attention(q, k, v))):
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        host = (time.perf_counter() - t0) / 50 * 1e3
        torch.cuda.synchronize()
        print(f"{name:26s} {_bench(fn):7.3f} ms/call (do_bench)   host {host:7.3f} ms/call (50 calls, no sync)",
              flush=True)
    # the same calls through the dispatcher (the custom ops) and straight into the kernel modules: what the op layer
    # costs on the host (run 159: torch's custom-op backend_impl took 0.35 ms of own time per call in a Flux block)
    from sage_compile.kernels.int8_fp8 import attention as KA
    from sage_compile.kernels.int8_fp8 import quantize as KQ

    for name, via_op, direct in (
            ("quantize (rescale)", lambda: o.quantize_int8_fp8(q, k, v, "HND", True),
             lambda: KQ.quantize(q, k, v, "HND", True)),
            ("core", lambda: o.attention_int8_fp8(*qt, None, "none", None, "HND", torch.bfloat16),
             lambda: KA.attention(*qt, None, "none", None, "HND", torch.bfloat16))):
        a, b = _host_ms(via_op), _host_ms(direct)
        print(f"{name:26s} host ms/call: op {a:.3f}, kernel module {b:.3f} (op layer {a - b:+.3f})", flush=True)
    _prof(lambda: o.quantize_int8_fp8(q, k, v, "HND", True), [ProfilerActivity.CPU], "self_cpu_time_total")


def train():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity

    from sage_compile.kernels.int8_train import attention as KA
    from sage_compile.kernels.int8_train import quantize as KQ

    b, h, n, d = 4, 16, 8192, 128
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    flops = 4 * b * h * n * n * d
    qt = KQ.quantize(q, k, v)
    o_, lse = KA.forward(*qt[:6], "none", None, "HND", q.dtype)
    for name, fn, fl in (("quantize", lambda: KQ.quantize(q, k, v), 0),
                         ("forward", lambda: KA.forward(*qt[:6], "none", None, "HND", q.dtype), flops),
                         ("backward", lambda: KA.backward(*qt, o_, lse, do, "none", None, "HND", q.dtype), 2.5 * flops)):
        ms = _bench(fn, rep=100)
        print(f"int8_train {name:9s} {ms:8.3f} ms  {fl / ms / 1e9 if fl else 0:7.1f} TOPS", flush=True)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ms_f = _bench(lambda: F.scaled_dot_product_attention(q, k, v), rep=100)
        out = F.scaled_dot_product_attention(qq, kk, vv)
        ms_b = _bench(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True), rep=100)
    print(f"cudnn forward {ms_f:.3f} ms ({flops / ms_f / 1e9:.1f} TOPS)  backward {ms_b:.3f} ms "
          f"({2.5 * flops / ms_b / 1e9:.1f} TOPS)", flush=True)
    _prof(lambda: KA.backward(*qt, o_, lse, do, "none", None, "HND", q.dtype), [ProfilerActivity.CUDA],
          "cuda_time_total", 10)
    for name in ("_fwd_tuned", "_dkdv_tuned", "_dq_tuned"):
        tuner = getattr(KA, name)
        print(name, "best config:", {str(k_): str(c) for k_, c in tuner.cache.items()}, flush=True)


def _host_ms(fn, n=100):
    """Host milliseconds per call of ``fn`` after one warm-up call (``bench_block.host_ms`` over n calls; the GPU
    work is tiny)."""
    from bench_block import host_ms

    fn()
    return host_ms(fn, n)


def train_host():
    import cProfile
    import pstats

    from sage_compile import ops  # noqa: F401
    from sage_compile.kernels.int8_train import attention as KA
    from sage_compile.kernels.int8_train import quantize as KQ

    b, hq, hkv, n, d = 2, 9, 3, 128, 64
    q = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    do = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16)
    op, bwd = torch.ops.sage_compile.attention_train, torch.ops.sage_compile.attention_train_backward
    with torch.no_grad():
        out = op(q, k, v, None, "bottom_right", None, "HND", "split")
    qt = KQ.quantize(q.detach(), k.detach(), v.detach(), "HND")

    def fwd_bwd():
        o = op(q, k, v, None, "bottom_right", None, "HND", "split")[0]
        torch.autograd.grad(o, (q, k, v), do)

    def sdpa_fwd_bwd():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(o, (q, k, v), do)

    cases = (("op forward (no grad)", lambda: op(q.detach(), k.detach(), v.detach(), None, "bottom_right", None,
                                                 "HND", "split")),
             ("op forward+backward (autograd)", fwd_bwd),
             ("backward op", lambda: bwd(*out[2:], out[0], out[1], do, None, "bottom_right", None, "HND", "split")),
             ("module quantize", lambda: KQ.quantize(q.detach(), k.detach(), v.detach(), "HND")),
             ("module forward", lambda: KA.forward(*qt[:6], "bottom_right", None, "HND", q.dtype)),
             ("module backward", lambda: KA.backward(*qt, out[0], out[1], do, "bottom_right", None, "HND", q.dtype,
                                                     psi="split")),
             ("sdpa forward+backward", sdpa_fwd_bwd))
    for name, fn in cases:
        print(f"{name:32s} host {_host_ms(fn):7.3f} ms/call", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        fwd_bwd()
    prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(45)


def graph():
    from diffusers.models.transformers.cogvideox_transformer_3d import CogVideoXBlock

    import sage_compile
    from sage_compile import _compat

    torch.manual_seed(0)
    m = CogVideoXBlock(dim=256, num_attention_heads=4, attention_head_dim=64, time_embed_dim=64).attn1
    m = m.cuda().bfloat16().eval()
    ang = torch.rand(512, 64) * 6.28
    kw = dict(hidden_states=torch.randn(1, 512, 256).cuda().bfloat16(),
              encoder_hidden_states=torch.randn(1, 64, 256).cuda().bfloat16(),
              image_rotary_emb=(ang.cos().cuda(), ang.sin().cuda()))
    key = _compat.inductor_division_rounding_key()

    def run(prologue, rescale, div, compiler="inductor"):
        torch._dynamo.reset()
        be = sage_compile.make_backend(compiler=compiler, kernel="int8_fp8", prologue=prologue,
                                       int8_channel_rescale=rescale)
        # div: Inductor's graph-global IEEE division on top (the backend no longer asks for it: the
        # quantizers' divisions are exact by themselves, sage_compile.reference.quant.div_rn)
        with torch._inductor.config.patch({key: bool(div)}), torch.no_grad():
            o = torch.compile(m, backend=be)(**kw)
        return torch.cat([t.flatten().float() for t in o])

    with torch.no_grad():
        eager = torch.cat([t.flatten().float() for t in m(**kw)])
    ref = run("op", True, False)
    print("op vs eager cos", F.cosine_similarity(ref, eager, dim=0).item(), flush=True)
    for prologue, rescale, div, comp in (("graph", True, True, "inductor"), ("graph", True, False, "inductor"),
                                         ("graph", False, True, "inductor"), ("graph", True, True, "eager")):
        try:
            got = run(prologue, rescale, div, comp)
            print(f"graph rescale={rescale} div_patch={div} compiler={comp}: cos vs op "
                  f"{F.cosine_similarity(got, ref, dim=0).item():.6f}", flush=True)
        except Exception as e:
            print(f"graph rescale={rescale} div={div} {comp}: {type(e).__name__}: {str(e)[:300]}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="graph,overhead,train,train_host")
    for part in ap.parse_args().parts.split(","):
        print(f"===== {part}", flush=True)
        try:
            globals()[part]()
        except Exception as e:  # one part failing leaves the others
            print(f"{part} failed: {type(e).__name__}: {str(e)[:500]}", flush=True)


if __name__ == "__main__":
    main()
