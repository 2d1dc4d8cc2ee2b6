"""Diagnose prologue="graph" on CUDA (issue 8): where the Inductor-compiled quantizer's bits differ from the
prologue op's, and why CogVideoX's attention came out wrong with it (block_h200.json: cos 0.85-0.93).

    python benchmarks/diag_graph_prologue.py [--code-dir DIR]

1. ``quant``: the reference quantizer compiled by Inductor (IEEE division asked for) vs the prologue op's
   Triton kernels, N=1000 hd128 bf16: mismatches per tensor, with the scale divisor as a constant (Inductor
   turns ``x / c`` into ``x * (1/c)`` on GPUs) and as a tensor it cannot fold.
2. ``attn``: diffusers' CogVideoX ``attn1`` at several sizes, compiled with prologue="op" and "graph": the
   core op's inputs captured per mode and compared (bits, dequantized cos), each core input set run
   through the Triton core, the CUDA core and the reference core, every output vs eager SDPA.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os

import torch

import sage_compile
from sage_compile import _compat, ops
from sage_compile.reference import int8_fp8 as R
from sage_compile.reference import quant as RQ


def cos(a, b):
    a, b = a.flatten().double(), b.flatten().double()
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


def bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def compare(name, a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{name}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    ne = (bits(a) != bits(b))
    s = f"{name}: {int(ne.sum())}/{ne.numel()} differ"
    if ne.any():
        d = (a.float() - b.float()).abs()
        idx = ne.nonzero()[:3].tolist()
        s += f", max |diff| {d.max().item():.3g}, first at {idx}"
        if a.dim() >= 3:
            tok = ne.flatten(0, 1).any(0)
            tok = tok if tok.dim() == 1 else tok.any(-1)
            s += f", token/channel positions with a difference: {int(tok.sum())} of {tok.numel()}"
    return s


def layout_str(t):
    return f"shape {tuple(t.shape)} stride {t.stride()} offset {t.storage_offset()} ptr%16 {t.data_ptr() % 16}"


def section_quant(code_dir):
    print("===== quant: Inductor-compiled reference quantizer vs the prologue op's kernels (N=1000, hd128)")
    from torch._inductor.utils import run_and_get_code

    from sage_compile.kernels.int8_fp8 import quantize as KQ

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 8, 1000, 128, generator=g).bfloat16().cuda() for _ in range(3))
    k[..., 3] += 4
    old = RQ._div_exact
    variants = {"divisor as written": None,
                "constant divisor (a / full_like(a, c))": lambda a, c: a / torch.full_like(a, c)}
    for label, fn in variants.items():
        for rescale in (False, True):
            if fn is not None:
                RQ._div_exact = fn
            try:
                torch._dynamo.reset()
                with torch._inductor.config.patch({_compat.inductor_division_rounding_key(): True}):
                    f = torch.compile(lambda q, k, v: R.quantize(q, k, v, "HND", rescale), backend="inductor")
                    got, code = run_and_get_code(f, q, k, v)
            finally:
                RQ._div_exact = old
            want = KQ.quantize(q, k, v, "HND", rescale)
            print(f"-- {label}, rescale={rescale}")
            for name, a, b in zip(("q8", "qs", "k8", "ks", "v8", "vs"), got, want):
                print("   " + compare(name, a, b))
            src = "\n".join(code)
            recips = sorted(set(x for x in ("0.007874015748031496", "0.002232142857142857") if x in src))
            print(f"   reciprocal constants of 1/127, 1/448 in the generated code: {recips or 'none'}; "
                  f"div_rn calls: {src.count('div_rn')}")
            if code_dir:
                with open(os.path.join(code_dir, f"quant_{'const' if fn else 'asis'}_{int(rescale)}.py"), "w") as fh:
                    fh.write(src)


def cogvideox(dim, heads, n, txt):
    from diffusers.models.transformers.cogvideox_transformer_3d import CogVideoXBlock

    torch.manual_seed(0)
    m = CogVideoXBlock(dim=dim, num_attention_heads=heads, attention_head_dim=64, time_embed_dim=512).attn1
    m = m.cuda().bfloat16().eval()
    ang = torch.rand(n, 64) * 2 * math.pi
    kw = dict(hidden_states=torch.randn(1, n, dim).cuda().bfloat16(),
              encoder_hidden_states=torch.randn(1, txt, dim).cuda().bfloat16(),
              image_rotary_emb=(ang.cos().cuda(), ang.sin().cuda()))
    return m, kw


@contextlib.contextmanager
def spy_core(store):
    mod = ops.impl_for("int8_fp8", "cuda")
    real = mod.attention

    def spy(*args, **kwargs):
        store.append(tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
        return real(*args, **kwargs)

    mod.attention = spy
    try:
        yield real
    finally:
        mod.attention = real


def flat(o):
    return torch.cat([t.flatten().float() for t in (o if isinstance(o, tuple) else (o,))])


def section_attn(configs, code_dir):
    from torch._inductor.utils import run_and_get_code

    from sage_compile.kernels._common import bhn_strides
    from sage_compile.kernels.int8_fp8 import attention as KA
    from sage_compile.kernels.int8_fp8 import cuda as KC

    for dim, heads, n, txt in configs:
        print(f"===== attn: CogVideoX attn1 dim {dim}, {heads} heads x 64, {txt} text + {n} video tokens")
        m, kw = cogvideox(dim, heads, n, txt)
        with torch.no_grad():
            eager = flat(m(**kw))
            caps, outs = {}, {}
            for mode, patch in (("op", {}), ("graph", {}), ("graph_emulate", {"emulate_precision_casts": True})):
                torch._dynamo.reset()
                store = []
                be = sage_compile.make_backend(kernel="int8_fp8", prologue="graph" if "graph" in mode else "op")
                with spy_core(store) as real_core, torch._inductor.config.patch(patch):
                    o, code = run_and_get_code(torch.compile(m, backend=be), **kw)
                outs[mode] = flat(o)
                caps[mode] = store[0] if store else None
                if code_dir:
                    with open(os.path.join(code_dir, f"attn_{dim}_{heads}_{n}_{mode}.py"), "w") as fh:
                        fh.write("\n".join(code))
                print(f"-- {mode}: output cos vs eager {cos(outs[mode], eager):.6f}; core calls {len(store)}")
            a, b = caps["op"], caps["graph"]
            if a is None or b is None:
                print("   no core call captured")
                continue
            for name, x, y in zip(("q8", "qs", "k8", "ks", "v8", "vs"), b[:6], a[:6]):
                print("   graph vs op " + compare(name, x, y))
                print(f"      graph {layout_str(x)}\n      op    {layout_str(y)}")
            dq = lambda c: (c[0].float() * c[1][..., None], c[2].float() * c[3][..., None],  # noqa: E731
                            c[4].float() * c[5][..., None])
            for name, x, y in zip(("Q", "K-mean", "V^T"), dq(b), dq(a)):
                print(f"   dequantized {name}: cos graph vs op {cos(x, y):.6f}")
            print(f"   core args after the tensors: graph {b[6:] if b[6] is None else ('mask',) + b[7:]}, "
                  f"op {a[6:] if a[6] is None else ('mask',) + a[7:]}")
            # each captured input set through each core
            for cname, cap in (("op", a), ("graph", b)):
                res = {}
                res["reference"] = R.attention(*cap)
                res["triton"] = KA.attention(*cap, config=dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2))
                why = KC.unsupported(cap[0], cap[2], cap[6], cap[10], cap[8])
                if why is None:
                    o = torch.empty_like(res["triton"])
                    res["cuda"] = KC.attention(*cap[:6], cap[7], cap[8], o, bhn_strides(o, cap[9]))
                else:
                    print(f"   cuda core not usable: {why}")
                res["default path"] = real_core(*cap)
                line = ", ".join(f"{k} {cos(v, res['reference']):.6f}" for k, v in res.items() if k != "reference")
                print(f"   {cname}-captured inputs, cos vs the reference core on them: {line}")
                if cname == "graph":
                    print(f"   graph-captured reference core vs op-captured reference core: "
                          f"{cos(res['reference'], R.attention(*a)):.6f}")
        del m, kw
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--code-dir", default=os.environ.get("OUT"))
    ap.add_argument("--sections", default="quant,attn")
    a = ap.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    if "quant" in a.sections:
        section_quant(a.code_dir)
    if "attn" in a.sections:
        section_attn([(1920, 30, 1024, 226), (256, 4, 512, 64), (1920, 30, 512, 64), (256, 4, 1024, 226)], a.code_dir)


if __name__ == "__main__":
    main()
