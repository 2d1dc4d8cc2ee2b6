"""Main job: ``python -m sage_compile`` — compile built-in models with ``backend="sage"`` and report.

For a small DiT-style and a small Llama-style model it prints the match report (every attention site,
its decision and reason), the accuracy of each site against exact SDPA on the same inputs (cos,
rel-L1), the model-output accuracy of the compiled model against eager, and timings (eager, Inductor,
sage). On CPU the sage ops run the reference numerics (slow by design); on CUDA the fast kernels.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def metrics(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(cosine similarity, relative L1) of ``out`` against ``ref``, in fp64."""
    o, r = out.double().flatten(), ref.double().flatten()
    return F.cosine_similarity(o, r, dim=0).item(), ((o - r).abs().sum() / r.abs().sum().clamp_min(1e-30)).item()


class _Capture(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls.append((args, dict(kwargs)))
        return func(*args, **kwargs)


def _time(fn, iters: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e3


def run(kernel: str, device: str, tokens: int, iters: int) -> None:
    import sage_compile
    from sage_compile import debug, models

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    cases = [
        ("TinyDiT", models.TinyDiT().to(device, dtype).eval(), (torch.randn(2, tokens, 16, device=device, dtype=dtype),)),
        ("TinyLlama", models.TinyLlama().to(device, dtype).eval(), (torch.randint(0, 512, (2, tokens), device=device),)),
    ]
    from sage_compile import ops

    impl = "kernel" if kernel in ops.QUANT_SCHEMES and ops.has_fast_impl(kernel, device) else "reference numerics"
    print(f"sage_compile {sage_compile.__version__} | torch {torch.__version__} | device {device} | kernel {kernel} "
          f"| {impl if kernel in ops.QUANT_SCHEMES else 'policy decides per site'}")
    for name, model, inputs in cases:
        print(f"\n=== {name} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params, {tokens} tokens)")
        with torch.no_grad():
            cap = _Capture()
            with cap:
                ref = model(*inputs)
            print(f"per-site accuracy vs exact SDPA ({kernel}):")
            for i, (args, kw) in enumerate(cap.calls):
                q, k, v = args[:3]
                causal = "top_left" if kw.get("is_causal") else "none"
                exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=bool(kw.get("is_causal")))
                if kernel in ("auto", "exact"):
                    print(f"  site {i}: exact")
                    continue
                out = sage_compile.attention(q, k, v, None, causal, None, "HND", kernel)
                c, l1 = metrics(out, exact)
                print(f"  site {i}: q {tuple(q.shape)} k {tuple(k.shape)} causal={causal}: cos {c:.6f}  rel-L1 {l1:.4f}")
            debug.clear_reports()
            t0 = time.perf_counter()
            sage = torch.compile(model, backend=sage_compile.make_backend(kernel=kernel))
            out = sage(*inputs)
            t_sage_compile = time.perf_counter() - t0
            for rows in debug.last_reports():
                print(debug.format_report(rows))
            c, l1 = metrics(out.float(), ref.float())
            print(f"model output vs eager: cos {c:.6f}  rel-L1 {l1:.4f}")
            t0 = time.perf_counter()
            ind = torch.compile(model)
            ind(*inputs)
            t_ind_compile = time.perf_counter() - t0
            te, ti, ts = (_time(lambda f=f: f(*inputs), iters) for f in (model, ind, sage))
            print(f"time per forward: eager {te:.2f} ms | inductor {ti:.2f} ms | sage {ts:.2f} ms "
                  f"(compile: inductor {t_ind_compile:.1f} s, sage {t_sage_compile:.1f} s)")
            if device == "cuda":  # models this small are bound by the host's launches: replayed, the GPU's time shows
                graphs = [torch.compile(model, mode="reduce-overhead"),
                          torch.compile(model, backend=sage_compile.make_backend(kernel=kernel), mode="reduce-overhead")]
                for g in graphs:
                    for _ in range(3):  # record, then replay
                        g(*inputs)
                tig, tsg = (_time(lambda g=g: g(*inputs), iters) for g in graphs)
                print(f"time per forward in CUDA graphs (mode='reduce-overhead'): inductor {tig:.2f} ms | "
                      f"sage {tsg:.2f} ms (speed-up {tig / tsg:.2f}x)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m sage_compile", description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    p.add_argument("--kernel", default="int8_fp8",
                   help="scheme for every site (default int8_fp8: the Triton kernel on CUDA sm89+, the reference on CPU)")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--tokens", type=int, default=4096 if cuda else 256)
    p.add_argument("--iters", type=int, default=20 if cuda else 3)
    a = p.parse_args(argv)
    run(a.kernel, a.device, a.tokens, a.iters)


if __name__ == "__main__":
    main()
