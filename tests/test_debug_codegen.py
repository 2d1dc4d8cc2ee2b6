"""sage_compile.debug_codegen: Inductor's sm90 Triton code generated on the CPU (never run)."""
import pytest
import torch

pytest.importorskip("triton")

from sage_compile import _compat  # noqa: E402
from sage_compile.debug_codegen import fp32_buffers, generated_code, kernels, sm90_codegen  # noqa: E402
from sage_compile.reference import int8_fp8 as R  # noqa: E402


def _rope(x, cos, sin):  # diffusers' apply_rotary_emb with use_real_unbind_dim=-1 (Flux)
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    rot = torch.stack([-x2, x1], dim=-1).flatten(3)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


def test_graph_prologue_sm90_code():
    """RoPE + the reference quantizer on NHD q/k (1 x 256 tokens x 4 heads x 64, channel balancing):
    Triton kernels with Inductor's byte estimates, and the fp32 copies the graph prologue writes (Q·s and
    (K - mean)/s: diag_prologue_codegen.py's finding at Flux's size); Triton's driver is restored."""
    from triton.runtime.driver import driver

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 256, 4, 64, generator=g).bfloat16() for _ in range(3))
    ang = torch.rand(256, 1, 64, generator=g) * 6.28
    cos, sin = ang.cos(), ang.sin()

    def f(q, k, v):
        return R.quantize(_rope(q, cos, sin), _rope(k, cos, sin), v, "NHD", True)

    before = driver.__dict__.get("_active")
    with sm90_codegen(), torch._inductor.config.patch(_compat.graph_prologue_inductor_patches()):
        code = generated_code(f, q, k, v)
    assert driver.__dict__.get("_active") is before
    ks = kernels(code)
    assert len(ks) >= 3 and all(name.startswith("triton_") and c >= 1 and mb > 0 for name, c, mb in ks), ks
    assert any("round" in name for name, _, _ in ks), ks  # the quantizing pass is a Triton kernel
    assert len(fp32_buffers(code, 256 * 4 * 64)) >= 1
    assert not fp32_buffers(code, 256 * 4 * 64 + 1)
