"""fp4 (NVFP4) Triton kernels on CPU under TRITON_INTERPRET=1: the quantizer is bit-identical to the
reference (random and adversarial inputs), the core matches the reference to accumulation noise."""
import os

import pytest
import torch
from helpers import bits

if torch.cuda.is_available():
    pytest.skip("GPU machine: the kernels are tested compiled (test_kernel_fp4_gpu.py)", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from sage_compile.kernels import _common  # noqa: E402
from sage_compile.kernels.fp4 import attention as KA  # noqa: E402
from sage_compile.kernels.fp4 import quantize as KQ  # noqa: E402
from sage_compile.reference import fp4 as R  # noqa: E402
from sage_compile.reference import quant as Q  # noqa: E402

if not _common.EMULATE_FP8:
    pytest.skip("kernels were imported before TRITON_INTERPRET was set", allow_module_level=True)


def test_quantizer_bit_identical_adversarial():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 37, 64, generator=g) * torch.logspace(-4, 4, 37)[:, None]
    x[0, 0, 0, :16] = 0                      # zero block
    x[0, 0, 1, 3] = 3000                     # past 6*448: scale saturates, values clip
    x[0, 0, 2, :] = 0.5                      # flat block
    x[0, 1, 0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5, 6, 7, -1e-9, 1e-9, 0, 1.0])
    x[1, 2, 5, 16:32] = 0.004                # scale rounds to an E4M3 subnormal / zero
    for search in (False, True):
        got, want = KQ.quant_nvfp4(x, search), Q.quant_nvfp4(x, search)
        assert torch.equal(got[0], want[0]) and torch.equal(bits(got[1]), bits(want[1]))


@pytest.mark.parametrize("d,lk", [(64, 130), (40, 77)])
def test_prologue_bit_identical(d, lk):
    g = torch.Generator().manual_seed(d)
    q = torch.randn(1, 4, 150, d, generator=g).bfloat16()
    k = (torch.randn(1, 2, lk, d, generator=g) + 3 * torch.randn(1, 2, 1, d, generator=g)).bfloat16()
    v = torch.randn(1, 2, lk, d, generator=g).bfloat16()
    for kw in (dict(v_smooth=False), dict(v_smooth=True), dict(v_smooth=True, qk_scale="search", qk_balance=True)):
        got, want = KQ.quantize(q, k, v, **kw), R.quantize(q, k, v, **kw)
        assert len(got) == len(want) == 8
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
@pytest.mark.parametrize("p_scale,q_block,v_smooth", [("unrounded", 128, False), ("rounded", 128, False),
                                                       ("rounded", 16, True)])
def test_core_matches_reference(causal, p_scale, q_block, v_smooth):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4 if i == 0 else 2, 150 if i == 0 else 200, 64, generator=g).bfloat16() for i in range(3))
    qt = R.quantize(q, k, v + 2.0, q_block=q_block, v_smooth=v_smooth)
    assert qt[6].shape[2] == -(-150 // q_block)
    out = KA.attention(*qt, None, causal, None, "HND", torch.float32, 64, p_scale, config=dict(BLOCK_M=64))
    ref = R.attention(*qt, None, causal, None, "HND", torch.float32, 64, p_scale)
    assert torch.isfinite(out).all()
    assert ((out - ref).abs().sum() / ref.abs().sum()).item() < 1e-4


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_core_masks_padded_head_dim_nhd(kind):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 70, 2, 40, generator=g) for _ in range(3))  # NHD, head dim 40 -> 48
    qt = R.quantize(q, k, v, "NHD", v_smooth=True)
    mask = torch.rand(2, 1, 70, 70, generator=g) > 0.4 if kind == "bool" else torch.randn(2, 2, 1, 70, generator=g)
    if kind == "bool":
        mask[:, :, 3] = False  # a row that sees no key: 0, not V's mean
    out = KA.attention(*qt, mask, "none", 0.3, "NHD", torch.bfloat16, 40, config=dict(BLOCK_M=64))
    ref = R.attention(*qt, mask, "none", 0.3, "NHD", torch.bfloat16, 40)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert ((out.float() - ref.float()).abs().sum() / ref.float().abs().sum()).item() < 5e-3
    if kind == "bool":
        assert not out[:, 3].any() and out[:, 4].any()


def test_tile_dequant_exact_for_every_code_and_scale():
    """The core's bit-level decode (codes -> fp16, times the E4M3 scale in fp16) equals the reference
    dequantization for all 256 packed bytes under every finite E4M3 scale, subnormals included."""
    import triton.language as tl

    @triton.jit
    def deq(P, S, Y, R: tl.constexpr, C: tl.constexpr):
        rows = tl.arange(0, R)
        tl.store(Y + rows[:, None] * C + tl.arange(0, C)[None, :],
                 KA._deq(P, S, rows, 0, R, C // 2, C // 2, C // 16, R, C).to(tl.float32))

    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E                                # the two NaN codes -> 448
    scales = codes.view(torch.float8_e4m3fn)                            # every finite E4M3 value, both zeros
    r = scales.numel()
    packed = torch.arange(256, dtype=torch.uint8).repeat(r, 1)          # (r, 256): C = 512 values per row
    sc = scales[:, None].repeat(1, 32)                                  # one scale per 16 values
    out = torch.empty(r, 512)
    deq[(1,)](packed, sc, out, r, 512)
    assert torch.equal(out, Q.dequant_nvfp4(packed, sc).float())


def test_round_e2m1_pos_matches_reference_on_ties():
    import triton.language as tl

    @triton.jit
    def rnd(X, Y, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(Y + i, _common.round_e2m1_pos(tl.load(X + i)))

    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e9, 0.0])
    x = torch.cat([ties, torch.nextafter(ties, torch.tensor(-1.0)).abs(), torch.nextafter(ties, ties + 1),
                   torch.rand(4096, generator=torch.Generator().manual_seed(3)) * 8])
    x = torch.cat([x, torch.zeros(8192 - x.numel())])
    y = torch.empty_like(x)
    rnd[(1,)](x, y, x.numel())
    assert torch.equal(y, Q.round_e2m1(x))
