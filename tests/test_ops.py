"""Custom ops: opcheck over a grid of call forms, clear errors on bad input, exact gradients."""
import pytest
import torch
import torch.nn.functional as F

import sage_compile
from sage_compile import ops  # noqa: F401  (registers the ops)

A = torch.ops.sage_compile.attention.default


def _grid():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    yield "plain", (r(1, 2, 20, 16), r(1, 2, 20, 16), r(1, 2, 20, 16), None, "none", None, "HND")
    yield "gqa_causal", (r(2, 4, 17, 16), r(2, 2, 9, 16), r(2, 2, 9, 16), None, "bottom_right", 0.3, "HND")
    yield "nhd_permuted", (r(1, 20, 2, 16), r(1, 20, 2, 16), r(1, 20, 2, 16), None, "top_left", None, "NHD")
    yield "bool_mask", (r(2, 2, 8, 16), r(2, 2, 8, 16), r(2, 2, 8, 16), torch.rand(2, 1, 8, 8, generator=g) > 0.2, "none", None, "HND")
    yield "float_mask_bf16", (r(1, 2, 8, 16).bfloat16(), r(1, 2, 8, 16).bfloat16(), r(1, 2, 8, 16).bfloat16(),
                              r(1, 2, 1, 8).bfloat16(), "none", None, "HND")
    q = r(1, 6, 2, 16).transpose(1, 2)  # non-contiguous (B, H=2, N=6, D) view
    yield "noncontig", (q, q.clone(), q.clone(), None, "none", None, "HND")


@pytest.mark.parametrize("scheme", ["exact", "int8_fp8", "int8_fp16", "fp4"])
@pytest.mark.parametrize("name,args", list(_grid()), ids=[n for n, _ in _grid()])
def test_opcheck(scheme, name, args):
    args = tuple(a.clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) and i < 3 else a
                 for i, a in enumerate(args))
    torch.library.opcheck(A, args + (scheme,))


@pytest.mark.parametrize("scheme", ["int8_fp8", "fp4"])
def test_prologue_and_core_opcheck(scheme):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=g) for _ in range(3))
    quant = getattr(torch.ops.sage_compile, f"quantize_{scheme}").default
    core = getattr(torch.ops.sage_compile, f"attention_{scheme}").default
    torch.library.opcheck(quant, (q, k, v, "HND"))
    qt = quant(q, k, v, "HND")
    extra = (32, "rounded") if scheme == "fp4" else ()
    # test_schema compares inputs arithmetically, which float8 CPU tensors do not support
    torch.library.opcheck(core, (*qt, None, "top_left", None, "HND", torch.float32, *extra),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("bad,match", [
    (dict(q=torch.randn(1, 2, 8, 16, dtype=torch.float64)), "dtype"),
    (dict(q=torch.randn(2, 8, 16)), "4-D"),
    (dict(k=torch.randn(1, 3, 8, 16), v=torch.randn(1, 3, 8, 16)), "multiple"),
    (dict(v=torch.randn(1, 2, 9, 16)), "shapes differ"),
    (dict(mask=torch.ones(1, 1, 3, 3, dtype=torch.bool)), "broadcast"),
    (dict(mask=torch.ones(1, 1, 8, 8, dtype=torch.int64)), "bool or floating"),
    (dict(causal="yes"), "causal"),
    (dict(layout="BHSD"), "layout"),
])
def test_bad_inputs_raise_clear_errors(bad, match):
    a = dict(q=torch.randn(1, 2, 8, 16), k=torch.randn(1, 2, 8, 16), v=torch.randn(1, 2, 8, 16), mask=None,
             causal="none", layout="HND")
    a.update(bad)
    with pytest.raises(ValueError, match=match):
        sage_compile.attention(a["q"], a["k"], a["v"], a["mask"], a["causal"], None, a["layout"], "int8_fp8")


def test_unknown_scheme_raises():
    x = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match="scheme"):
        sage_compile.attention(x, x, x, scheme="int4")


@pytest.mark.parametrize("scheme", ["exact", "int8_fp8"])
def test_gradients_are_exact_sdpa_gradients(scheme):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 12, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 12, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 12, 16, generator=g, requires_grad=True)
    go = torch.randn(2, 4, 12, 16, generator=g)
    out = sage_compile.attention(q, k, v, None, "top_left", None, "HND", scheme)
    grads = torch.autograd.grad(out, (q, k, v), go)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want = torch.autograd.grad(ref, (q, k, v), go)
    for a, b in zip(grads, want):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_attention_train_returns_o_and_gradients_token_major(layout):
    """O, dQ, dK and dV come back stored token-major ((B, N, H, D) in memory) in either layout, as SDPA's flash and
    cuDNN kernels return them: a model's ``o.transpose(1, 2).reshape(B, N, H*D)`` and the gradient of a head-split
    projection are then views (Inductor copied them before); the fake kernels say the same strides (opcheck)."""
    g = torch.Generator().manual_seed(5)

    def make(h):
        shape = (1, h, 40, 32) if layout == "HND" else (1, 40, h, 32)
        return torch.randn(shape, generator=g)

    def token_major(t):
        return (t.transpose(1, 2) if layout == "HND" else t).is_contiguous()

    q, k, v = make(4), make(2), make(2)
    out = torch.ops.sage_compile.attention_train(q, k, v, None, "top_left", None, layout)
    assert token_major(out[0]) and (layout == "NHD") == out[0].is_contiguous()
    go = torch.randn(out[0].shape, generator=g).transpose(1, 2).contiguous().transpose(1, 2)  # dO as autograd hands it
    args = (*out[2:], out[0], out[1], go, None, "top_left", None, layout)
    grads = torch.ops.sage_compile.attention_train_backward(*args)
    assert all(token_major(t) for t in grads), [t.stride() for t in grads]
    torch.library.opcheck(torch.ops.sage_compile.attention_train.default, (q, k, v, None, "top_left", None, layout))
    torch.library.opcheck(torch.ops.sage_compile.attention_train_backward.default, args)


def test_attention_train_op_and_sagebwd_gradients():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 40, 32, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 40, 32, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 40, 32, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.sage_compile.attention_train.default, (q, k, v, None, "top_left", None, "HND"))
    out = sage_compile.attention(q, k, v, None, "top_left", None, "HND", "int8_train")
    go = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), go)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want = torch.autograd.grad(ref, (q, k, v), go)
    for a, b in zip(grads, want):
        cos = F.cosine_similarity(a.flatten(), b.flatten(), dim=0)
        assert 0.99 < cos < 1  # SageBwd's own (quantized) gradients, not exact ones
    # a bool mask equal to the causal rule gives the same output and gradients as the rule
    causal_mask = torch.ones(40, 40, dtype=torch.bool).tril()
    out_m = sage_compile.attention(q, k, v, causal_mask, scheme="int8_train")
    assert torch.equal(out_m, out)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out_m, (q, k, v), go), grads))
    with pytest.raises(ValueError, match="not both"):
        sage_compile.attention(q, k, v, causal_mask, "top_left", scheme="int8_train")
    # Options.int8_train_psi reaches the backward: the paper's per-tile ψ scales give other (farther)
    # gradients than the default per-row ones
    assert sage_compile.Options().int8_train_psi == "split"
    tile = sage_compile.Options(int8_train_psi="tile")
    out_t = sage_compile.attention(q, k, v, None, "top_left", None, "HND", "int8_train", options=tile)
    grads_t = torch.autograd.grad(out_t, (q, k, v), go)
    assert torch.equal(out_t, out) and not torch.equal(grads_t[0], grads[0])
    assert F.cosine_similarity(grads[0].flatten(), want[0].flatten(), dim=0) > \
        F.cosine_similarity(grads_t[0].flatten(), want[0].flatten(), dim=0)
    with pytest.raises(ValueError, match="int8_train_psi"):
        sage_compile.attention(q, k, v, None, "top_left", None, "HND", "int8_train",
                               options=sage_compile.Options(int8_train_psi="rows"))


def test_attention_train_backward_fills_no_zero_gradients():
    """Only O's gradient flows back: autograd hands the backward None for the LSE and the quantized operands instead
    of a zero tensor for each (q̂, k̂ and V̂ are as large as q, k, v in int8: 3 x 67 MB a backward at B·N = 32K,
    hd128, 16 heads), and the gradients stay those of the forward's operands."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 48, 16, generator=g, requires_grad=True) for _ in range(3))
    go = torch.randn(1, 2, 48, 16, generator=g)
    out = sage_compile.attention(q, k, v, None, "none", None, "HND", "int8_train")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        grads = torch.autograd.grad(out, (q, k, v), go)
    zeroed = [tuple(map(tuple, e.input_shapes)) for e in prof.events() if e.name in ("aten::zero_", "aten::fill_")]
    assert not [s for s in zeroed if s and s[0] in ((1, 2, 48, 16), (1, 2, 48), (1, 2, 1), (1, 2, 1, 16))], zeroed
    assert all(torch.isfinite(t).all() and t.abs().sum() > 0 for t in grads)


def test_attention_train_backward_reuses_the_forwards_quantization(monkeypatch):
    """The backward takes the forward's quantized operands (the op's extra outputs, saved by autograd) instead of
    quantizing q, k, v again: one prologue per forward and backward, the same gradients, and q, k, v are not saved
    (changing them in place after the forward is no error for autograd and does not reach the gradients)."""
    impl = ops.impl_for("int8_train", "cpu")
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 48, 16, generator=g, requires_grad=True) for _ in range(3))
    go = torch.randn(1, 2, 48, 16, generator=g)
    qt = impl.quantize(q.detach(), k.detach(), v.detach(), "HND")
    o, lse = impl.forward(*qt[:6], "top_left", None, "HND", q.dtype)
    want = impl.backward(*qt, o, lse, go, "top_left", None, "HND", q.dtype, psi="split")
    calls = []
    real = impl.quantize
    monkeypatch.setattr(impl, "quantize", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ins = (qq * 1, kk * 1, vv * 1)
    out = sage_compile.attention(*ins, None, "top_left", None, "HND", "int8_train")
    assert torch.equal(out, o)
    for t in ins:
        t.add_(1.0)
    out.backward(go)
    assert len(calls) == 1
    assert all(torch.equal(a.grad, b) for a, b in zip((qq, kk, vv), want))
