"""The graph prologue (:mod:`sage_compile.graph_prologue`): the reference quantizer's bits, eager and
compiled, and the GPU kernels Inductor writes for it after RoPE (generated on the CPU, never run:
:mod:`sage_compile.debug_codegen`)."""
import pytest
import torch

from sage_compile import _compat
from sage_compile import graph_prologue as GP
from sage_compile.reference import int8_fp8 as R


def _inputs(layout, hq, hkv, nq, nk, d=64, seed=0, special=False):
    g = torch.Generator().manual_seed(seed)

    def mk(h, n):
        x = torch.randn(2, h, n, d, generator=g) * (1 + 8 * torch.rand(d, generator=g))
        x[..., 3] += 20  # an outlier channel
        return x

    q, k, v = mk(hq, nq), mk(hkv, nk), mk(hkv, nk)
    if special:  # a zero Q row, a NaN in one K token and one V channel
        q[0, 0, 5] = 0
        k[1, 0, 7, 2] = float("nan")
        v[0, -1, 3, 9] = float("nan")
    q, k, v = (t.bfloat16() for t in (q, k, v))
    return tuple(t if layout == "HND" else t.transpose(1, 2).contiguous() for t in (q, k, v))


def bits(t):  # every dtype as its raw bits: NaN scales compare too
    return t.view({1: torch.uint8, 4: torch.int32}[t.element_size()])


def _same(got, want):
    for name, a, b in zip(("q8", "qs", "k8", "ks", "v8", "vs"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(bits(a), bits(b)), name


@pytest.mark.parametrize("rescale", [False, True])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("heads,nq,nk", [((4, 4), 77, 300), ((4, 2), 300, 131)])
def test_bits_equal_the_reference(layout, heads, nq, nk, rescale):
    """Eager: every output the reference's bits (GQA, ragged K tiles, Nq != Nk, outliers)."""
    q, k, v = _inputs(layout, *heads, nq, nk)
    _same(GP.int8_fp8(q, k, v, layout, rescale), R.quantize(q, k, v, layout, rescale))


@pytest.mark.parametrize("rescale", [False, True])
def test_zero_and_nan_rows_as_the_reference(rescale):
    """A zero row quantizes to zeros with scale 0; a NaN poisons its token's (Q), group's (K) and
    channel's (V) scale, as in the reference."""
    q, k, v = _inputs("NHD", 4, 2, 96, 200, special=True)
    got = GP.int8_fp8(q, k, v, "NHD", rescale)
    _same(got, R.quantize(q, k, v, "NHD", rescale))
    assert torch.isnan(got[3]).any() and torch.isnan(got[5]).any()


def test_compiled_bits_equal_eager():
    """Inductor (CPU) under the backend's graph-prologue options: the eager bits."""
    q, k, v = _inputs("NHD", 4, 2, 200, 200, seed=1)
    torch._dynamo.reset()
    with torch._inductor.config.patch(_compat.graph_prologue_inductor_patches()):
        got = torch.compile(lambda q, k, v: GP.int8_fp8(q, k, v, "NHD", False), backend="inductor")(q, k, v)
    _same(got, GP.int8_fp8(q, k, v, "NHD", False))
    torch._dynamo.reset()


def test_for_scheme():
    assert GP.for_scheme("int8_fp8") is GP.int8_fp8
    from sage_compile.reference import fp4

    assert GP.for_scheme("fp4") is fp4.quantize


def _rope(x, cos, sin):  # diffusers' apply_rotary_emb with use_real_unbind_dim=-1 (Flux)
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    rot = torch.stack([-x2, x1], dim=-1).flatten(3)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


@pytest.fixture(scope="module")
def sm90_code():
    """Inductor's sm90 code for RoPE + quantizer on NHD q/k (Flux's order: 1 x 256 tokens x 4 heads x
    64), channel balancing on, for the reference and the graph prologue."""
    pytest.importorskip("triton")
    from sage_compile.debug_codegen import generated_code, sm90_codegen

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 256, 4, 64, generator=g).bfloat16() for _ in range(3))
    ang = torch.rand(256, 1, 64, generator=g) * 6.28
    cos, sin = ang.cos(), ang.sin()
    out = {}
    for name, fn in (("reference", R.quantize), ("graph", GP.int8_fp8)):
        def f(q, k, v, fn=fn):
            return fn(_rope(q, cos, sin), _rope(k, cos, sin), v, "NHD", True)

        with sm90_codegen(), torch._inductor.config.patch(_compat.graph_prologue_inductor_patches()):
            out[name] = generated_code(f, q, k, v)
    return out


def test_graph_prologue_keeps_smoothed_k_out_of_memory(sm90_code):
    """The reference's HND order and its one smoothed-K expression with two consumers make Inductor
    store Q·s or (K - mean)/s in fp32 (a full-size buffer); the graph prologue's GPU code has none, and
    its kernels move fewer bytes by Inductor's estimate."""
    from sage_compile.debug_codegen import fp32_buffers, kernels

    numel = 256 * 4 * 64
    assert fp32_buffers(sm90_code["reference"], numel), "the control: the reference writes fp32 copies"
    assert not fp32_buffers(sm90_code["graph"], numel)
    mb = {k: sum(c * x for _, c, x in kernels(code)) for k, code in sm90_code.items()}
    assert mb["graph"] < 0.9 * mb["reference"], mb
