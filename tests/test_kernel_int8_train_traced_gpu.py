"""The traced ``int8_train`` ops (``sage_compile::attention_train_traced`` and its backward, torch.library.triton_op)
on the GPU: eager, they are the opaque ops bit for bit; compiled, the graph holds their launches (Triton kernels
launched by Inductor, the sm90 kernels as the extension's torch ops, no call of either opaque op), and O, the
quantized operands and the gradients are the opaque ops' (K's mean is Inductor's reduction there: its summation
order may differ, so values downstream of it are compared closely, not bit for bit), over causal rules, a bool mask
(decided on the device), an additive mask and the token-major layout."""
import re

import pytest
import torch
from helpers import cos_rel
from torch._inductor.utils import run_and_get_code

import sage_compile.ops  # noqa: F401  (registers the ops)

pytestmark = pytest.mark.gpu

OPS = torch.ops.sage_compile


def _inputs(b=2, hq=8, hkv=2, n=1024, d=64, layout="HND", seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (lambda h: (b, h, n, d)) if layout == "HND" else (lambda h: (b, n, h, d))
    q = torch.randn(shape(hq), generator=g)
    k, v = (torch.randn(shape(hkv), generator=g) for _ in range(2))
    k[..., 5] += 6  # a channel offset: K's mean matters
    do = torch.randn(shape(hq), generator=g)
    return [t.cuda().to(torch.bfloat16).requires_grad_() for t in (q, k, v)], do.cuda().to(torch.bfloat16)


def _run(op, qkv, do, mask, causal, layout):
    """The op's 9 outputs and (dq, dk, dv); ``op`` a function of ``(q, k, v, mask)`` or an op."""
    out = op(*qkv, mask) if not hasattr(op, "default") else op(*qkv, mask, causal, None, layout, "split")
    return (*out, *torch.autograd.grad(out[0], qkv, do))


CASES = [("top_left", None, "HND"), ("none", None, "HND"), ("none", "bool", "HND"), ("none", "additive", "HND"),
         ("top_left", None, "NHD")]


def _mask(kind, n):
    """None, a causal bool (2, 1, n, n) mask (a broadcast view), or an additive (2, 1, n, n) bf16 bias: a causal
    -inf part and a random finite part."""
    if kind is None:
        return None
    causal = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()[None, None].expand(2, 1, n, n)
    if kind == "bool":
        return causal
    g = torch.Generator(device="cuda").manual_seed(3)
    bias = torch.randn(2, 1, n, n, device="cuda", generator=g)
    return bias.masked_fill(~causal, float("-inf")).to(torch.bfloat16)


@pytest.mark.parametrize("causal,mask,layout", CASES, ids=lambda c: str(c))
def test_traced_op_compiled_gives_the_opaque_ops_values(causal, mask, layout):
    from sage_compile.kernels.int8_train import cuda

    qkv, do = _inputs(layout=layout)
    n = qkv[0].shape[2 if layout == "HND" else 1]
    m = _mask(mask, n)
    want = _run(OPS.attention_train, qkv, do, m, causal, layout)
    eager = _run(OPS.attention_train_traced, qkv, do, m, causal, layout)
    assert all(torch.equal(a, w) for a, w in zip(eager, want))  # eager: the same host code and launches
    compiled = torch.compile(lambda q, k, v, m: OPS.attention_train_traced(q, k, v, m, causal, None, layout, "split"),
                             fullgraph=True)
    got, code = run_and_get_code(_run, compiled, qkv, do, m, causal, layout)
    code = "\n".join(code)
    assert not re.search(r"sage_compile\.attention_train(_backward)?\.default", code)
    assert not re.search(r"sage_compile\.attention_train\w*_traced\.default", code)  # decomposed, not called
    assert mask == "additive" or cuda.status()["built"], cuda.status()  # (an additive mask builds nothing)
    for name in ("fwd", "dkdv", "dq"):  # the extension's ops (an additive mask: the Triton kernels' alone)
        assert bool(re.search(rf"sage_int8_train_sm90_\w+\.{name}\.default", code)) == (mask != "additive"), name
    for name in ("_fwd_kernel", "_bwd_dkdv", "_bwd_dq") if mask else ():  # (the bool mask's gated launches too)
        assert name in code, name
    assert "_quant_qkv" in code and "_bwd_prep" in code  # Triton launches made by Inductor
    # the bool mask's device-side check: one opaque op a graph, the backward reusing its answer
    assert len(re.findall(r"sage_compile\.train_mask_gate\.default\(", code)) == (1 if mask == "bool" else 0), code
    names = ("o", "lse", "q8", "qs", "k8", "ks", "v8", "vs", "k_mean", "dq", "dk", "dv")
    exact = ("q8", "qs", "v8", "vs")  # nothing of K's mean in them
    for name, a, w in zip(names, got, want):
        assert a.shape == w.shape and a.dtype == w.dtype and a.stride() == w.stride(), name
        if name in exact:
            assert torch.equal(a, w), name
        elif name == "k8":
            assert (a.int() - w.int()).abs().max() <= 1 and (a != w).float().mean() < 1e-3, name
        else:
            c, r = cos_rel(a.float(), w.float())
            assert c > 0.99999 and r < 2e-3, (name, c, r)


def test_traced_op_in_a_cuda_graph_replays_the_compiled_step():
    """mode="reduce-overhead" (CUDA graphs) over the traced op: the replayed step gives the compiled step's values."""
    qkv, do = _inputs(n=512)
    f = torch.compile(lambda q, k, v, m: OPS.attention_train_traced(q, k, v, m, "top_left", None, "HND", "split"),
                      mode="reduce-overhead")
    first = [t.clone() for t in _run(f, qkv, do, None, "top_left", "HND")]
    for _ in range(3):
        again = [t.clone() for t in _run(f, qkv, do, None, "top_left", "HND")]
    assert all(torch.equal(a, b) for a, b in zip(again, first))


def test_traced_op_under_dynamic_shapes_compiles_once_and_matches():
    """``dynamic=True`` over three sequence lengths (each more than one 128-query block): one compile (the extension
    ops take SymInt strides), and each length's O and gradients are the opaque ops'."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    f = torch.compile(lambda q, k, v, m: OPS.attention_train_traced(q, k, v, m, "top_left", None, "HND", "split"),
                      backend=counter, dynamic=True)
    for n in (192, 256, 320):
        qkv, do = _inputs(n=n, seed=n)
        got = _run(f, qkv, do, None, "top_left", "HND")
        want = _run(OPS.attention_train, qkv, do, None, "top_left", "HND")
        for name, a, w in zip(("o", "dq", "dk", "dv"), (got[0], *got[9:]), (want[0], *want[9:])):
            c, r = cos_rel(a.float(), w.float())
            assert c > 0.99999 and r < 2e-3, (n, name, c, r)
    assert counter.frame_count == 1, counter.frame_count
