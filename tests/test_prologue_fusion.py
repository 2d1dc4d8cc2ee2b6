"""The prologue as graph ops (``prologue="graph"``): Inductor fuses RoPE and the quantizer into one kernel,
and the quantized tensors are the prologue op's bits given the same inputs."""
import re

import pytest
import torch
from helpers import bits, cos_rel
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import sage_compile
from sage_compile.reference import int8_fp8 as R


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@pytest.mark.parametrize("rescale", [False, True])
def test_rope_and_quantize_fuse_bit_identical(monkeypatch, rescale):
    """Inductor on the reference prologue after RoPE: one kernel, the eager bits (with eager's bf16
    intermediate rounding emulated, so both quantize identical inputs). With channel balancing the
    factors (a sqrt of a ratio: smoothing, not quantization) may round differently under Inductor's
    vectorised math: there the quantized tensors agree to those last bits."""
    monkeypatch.setattr(torch._inductor.config, "emulate_precision_casts", True)

    def f(q, k, v, cos, sin):
        return R.quantize(_rope(q, cos, sin), _rope(k, cos, sin), v, "HND", rescale)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g).bfloat16() for _ in range(3))
    k[..., 3] += 4  # an outlier channel
    cos, sin = (torch.randn(64, 32, generator=g).bfloat16() for _ in range(2))
    got, code = run_and_get_code(torch.compile(f, backend="inductor"), q, k, v, cos, sin)
    kernels = set(re.findall(r"cpp_fused_\w+", "\n".join(code)))
    assert len(kernels) == 1 and all(op in next(iter(kernels)) for op in ("cat", "neg", "round", "amax")), kernels
    for a, b in zip(got, f(q, k, v, cos, sin)):
        assert a.dtype == b.dtype
        if not rescale:
            assert torch.equal(bits(a), bits(b))
        elif a.dtype == torch.float32:  # scales
            assert ((a - b).abs() <= 4e-7 * b.abs()).all()
        else:
            assert (a.float() - b.float()).abs().max() <= 1 and (a != b).float().mean() < 0.01


@pytest.fixture(scope="module")
def llama_pair():
    m = sage_compile.models.TinyLlama(dim=64, heads=4, kv_heads=2, depth=1).eval()
    ids = torch.randint(0, 512, (2, 96), generator=torch.Generator().manual_seed(1))
    out = {}
    for mode in ("op", "graph"):
        torch._dynamo.reset()
        counters.clear()
        c = torch.compile(m, backend=sage_compile.make_backend(kernel="int8_fp8", prologue=mode))
        with torch.no_grad():
            out[mode] = run_and_get_code(c, ids)
        out[mode + "_replaced"] = counters["sage_compile"]["scheme:int8_fp8"]
    return out


def test_graph_prologue_asks_inductor_for_ieee_division(monkeypatch):
    """On the GPU Inductor's Triton '/' is approximate; the graph prologue switches division_rounding on."""
    from sage_compile import _compat

    key = _compat.inductor_division_rounding_key()
    assert key is not None
    seen = {}
    real = torch._inductor.compile_fx.compile_fx

    def spy(gm, example_inputs, config_patches=None, **kw):
        seen.update(config_patches or {})
        return real(gm, example_inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", spy)
    f = lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q)  # noqa: E731
    with torch.no_grad():
        torch.compile(f, backend=sage_compile.make_backend(kernel="int8_fp8", prologue="graph"))(torch.randn(1, 2, 8, 16))
    assert seen.get(key) is True


def test_compiled_model_graph_prologue(llama_pair):
    (o_op, code_op), (o_graph, code_graph) = llama_pair["op"], llama_pair["graph"]
    assert llama_pair["op_replaced"] == llama_pair["graph_replaced"] == 1
    assert "quantize_int8_fp8" in "\n".join(code_op)
    src = "\n".join(code_graph)
    assert "quantize_int8_fp8" not in src and "attention_int8_fp8" in src
    assert any("round" in k and "cat" in k for k in re.findall(r"cpp_fused_\w+", src))  # RoPE + quantize
    assert cos_rel(o_graph.float(), o_op.float())[0] > 0.9999


def test_fp4_graph_prologue_matches_op():
    """The fp4 prologue (smoothing, ΔS, NVFP4 packing) traces into the graph too."""
    m = sage_compile.models.TinyDiT(dim=64, heads=2, depth=1).eval()
    x = torch.randn(1, 64, 16, generator=torch.Generator().manual_seed(2))
    out = {}
    with torch.no_grad():
        for mode in ("op", "graph"):
            torch._dynamo.reset()
            out[mode] = torch.compile(m, backend=sage_compile.make_backend(kernel="fp4", prologue=mode))(x)
    assert cos_rel(out["graph"], out["op"])[0] > 0.99999


def _fused_kernels(src: str) -> set:
    """Names of the fused kernels Inductor generated (Triton on CUDA, C++ on CPU)."""
    return set(re.findall(r"\b(?:triton_(?:poi|per|red)|cpp)_fused_\w+", src))


def test_graph_prologue_is_cpu_only():
    """On CUDA the graph prologue gave wrong outputs (CogVideoX, block_h200.json): CUDA sites get the
    prologue op and the report says why; CPU sites keep the graph code."""
    from sage_compile.passes.rewrite import _prologue

    from sage_compile import ops, policy  # noqa: F401  (ops registers torch.ops.sage_compile.*)

    o = sage_compile.Options(prologue="graph")
    assert policy.graph_prologue(o, "cpu") and not policy.graph_prologue(o, "cuda")
    assert _prologue("int8_fp8", o, "cuda") is torch.ops.sage_compile.quantize_int8_fp8.default
    assert _prologue("int8_fp8", o, "cpu") is R.quantize
    with pytest.raises(ValueError, match="prologue must be"):
        _prologue("int8_fp8", sage_compile.Options(prologue="fused"), "cpu")


@pytest.mark.gpu
def test_rope_and_quantize_fuse_on_gpu():
    """On CUDA, Inductor fuses RoPE into the quantizer: RoPE never stands alone (every kernel with RoPE's
    cat/neg also reduces or rounds) and one kernel does RoPE + per-token amax + round. (With channel
    balancing RoPE's output also feeds a reduction over all tokens, so Inductor writes it once: no
    fusion claim there.)"""
    from sage_compile import _compat

    def f(q, k, v, cos, sin):
        return R.quantize(_rope(q, cos, sin), _rope(k, cos, sin), v, "HND", False)

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 8, 1000, 128, generator=g).bfloat16().cuda() for _ in range(3))
    cos, sin = (torch.randn(1000, 128, generator=g).bfloat16().cuda() for _ in range(2))
    with torch._inductor.config.patch({_compat.inductor_division_rounding_key(): True}):
        _, code = run_and_get_code(torch.compile(f, backend="inductor"), q, k, v, cos, sin)
    kernels = _fused_kernels("\n".join(code))
    rope = [n for n in kernels if "cat" in n or "neg" in n]
    assert rope and all(any(op in n for op in ("round", "amax", "max", "sum", "mean")) for n in rope), kernels
    assert any("cat" in n and "round" in n for n in kernels), kernels


@pytest.mark.gpu
@pytest.mark.parametrize("rescale", [False, True])
def test_graph_quantizer_matches_prologue_op_on_gpu(rescale):
    """The reference quantizer compiled by Inductor for CUDA (IEEE division asked for) against the prologue
    op's Triton kernels on the same inputs: Q and V bit for bit; K (and, with channel balancing, Q too)
    given the K-mean's summation order (conventions.md quantizer rule)."""
    from sage_compile import _compat
    from sage_compile.kernels.int8_fp8 import quantize as KQ

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 8, 1000, 128, generator=g).bfloat16().cuda() for _ in range(3))
    k[..., 3] += 4
    with torch._inductor.config.patch({_compat.inductor_division_rounding_key(): True}):
        got = torch.compile(lambda q, k, v: R.quantize(q, k, v, "HND", rescale), backend="inductor")(q, k, v)
    want = KQ.quantize(q, k, v, "HND", rescale)
    for name, a, b in zip(("q8", "qs", "k8", "ks", "v8", "vs"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if name in ("v8", "vs") or (name in ("q8", "qs") and not rescale):
            assert torch.equal(bits(a), bits(b)), name
        elif a.dtype == torch.float32:
            assert ((a - b).abs() <= 1e-6 * b.abs()).all(), name
        else:
            assert (a.float() - b.float()).abs().max() <= 1 and (a != b).float().mean() < 0.01, name


@pytest.mark.gpu
@pytest.mark.xfail(reason="issue 8: prologue='graph' on CUDA gives wrong outputs on CogVideoX's attention "
                          "(block_h200.json); kept CPU-only until understood", strict=False)
def test_cogvideox_graph_prologue_on_gpu_matches_op(monkeypatch):
    """The measured failure, small: CogVideoX's attn1 (LayerNorm QK-norm, RoPE written in place on the
    video tokens) compiled with the graph prologue forced on CUDA vs the prologue op."""
    pytest.importorskip("diffusers")
    from diffusers.models.transformers.cogvideox_transformer_3d import CogVideoXBlock

    from sage_compile import policy

    monkeypatch.setattr(policy, "GRAPH_PROLOGUE_DEVICES", ("cpu", "cuda"))
    torch.manual_seed(0)
    m = CogVideoXBlock(dim=256, num_attention_heads=4, attention_head_dim=64, time_embed_dim=64).attn1
    m = m.cuda().bfloat16().eval()
    ang = torch.rand(512, 64) * 6.28
    kw = dict(hidden_states=torch.randn(1, 512, 256).cuda().bfloat16(),
              encoder_hidden_states=torch.randn(1, 64, 256).cuda().bfloat16(),
              image_rotary_emb=(ang.cos().cuda(), ang.sin().cuda()))
    out = {}
    with torch.no_grad():
        for mode in ("op", "graph"):
            torch._dynamo.reset()
            o = torch.compile(m, backend=sage_compile.make_backend(kernel="int8_fp8", prologue=mode))(**kw)
            out[mode] = torch.cat([t.flatten().float() for t in o])
    assert cos_rel(out["graph"], out["op"])[0] > 0.9999
