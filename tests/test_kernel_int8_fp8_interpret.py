"""int8_fp8 Triton kernels on CPU under TRITON_INTERPRET=1 (small shapes): the prologue is bit-identical
to the reference given the same K mean; the core agrees with the reference to accumulation noise."""
import os

import pytest
import torch
from helpers import bits

if torch.cuda.is_available():
    pytest.skip("GPU machine: the kernels are tested compiled (test_kernel_int8_fp8_gpu.py)", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # read by triton at import and when the kernels are defined
triton = pytest.importorskip("triton")

from sage_compile.kernels.int8_fp8 import attention as KA  # noqa: E402
from sage_compile.kernels.int8_fp8 import quantize as KQ  # noqa: E402
from sage_compile.reference import int8_fp8 as R  # noqa: E402
from sage_compile.reference import quant as Q  # noqa: E402

if not KQ.EMULATE_FP8:
    pytest.skip("kernels were imported before TRITON_INTERPRET was set", allow_module_level=True)


def _inputs(b=1, hq=4, hkv=2, lq=150, lk=130, d=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g)
    k = torch.randn(b, hkv, lk, d, generator=g) + 3 * torch.randn(b, hkv, 1, d, generator=g)
    v = torch.randn(b, hkv, lk, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("d", [64, 80])
def test_prologue_bit_identical(d):
    q, k, v = _inputs(d=d)
    q[0, 0, 5] = 0  # a zero row
    k[0, 1, 7, :3] = 1e4  # an outlier token
    v[..., 2] = 0  # a zero channel
    got = KQ.quantize(q, k, v)
    mean = KQ.k_mean(k)
    want = (*Q.quant_int8(q, 1), *Q.quant_int8(k.float() - mean[..., None, :], 1), *Q.quant_fp8_v(v))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(bits(a), bits(b))


def test_prologue_nhd_layout_reads_in_place():
    q, k, v = _inputs()
    nhd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    a, b = KQ.quantize(*nhd, layout="NHD"), KQ.quantize(q, k, v)
    assert all(torch.equal(x.float(), y.float()) for x, y in zip(a, b))


@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
@pytest.mark.parametrize("lq,lk", [(150, 130), (64, 300)])
def test_core_matches_reference(causal, lq, lk):
    qt = KQ.quantize(*_inputs(lq=lq, lk=lk))
    out = KA.attention(*qt, None, causal, None, "HND", torch.float32, config=dict(BLOCK_M=64))
    ref = R.attention(*qt, None, causal, None, "HND", torch.float32)
    assert torch.isfinite(out).all()
    assert ((out - ref).abs().sum() / ref.abs().sum()).item() < 1e-4


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_core_masks_and_nhd_output(kind):
    qt = KQ.quantize(*_inputs())
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(1, 1, 150, 130, generator=g) > 0.4 if kind == "bool" else torch.randn(1, 4, 1, 130, generator=g)
    out = KA.attention(*qt, mask, "none", 0.2, "NHD", torch.bfloat16, config=dict(BLOCK_M=64))
    ref = R.attention(*qt, mask, "none", 0.2, "NHD", torch.bfloat16)
    assert out.shape == (1, 150, 4, 64) and out.dtype == torch.bfloat16
    assert ((out.float() - ref.float()).abs().sum() / ref.float().abs().sum()).item() < 5e-3


def test_prologue_with_channel_rescale_bit_identical():
    q, k, v = _inputs()
    got = KQ.quantize(q, k, v, "HND", True)
    qf, ksm = R.rescale_channels(q.float(), k.float() - KQ.k_mean(k)[..., None, :])
    want = (*Q.quant_int8(qf, 1), *Q.quant_int8(ksm, 1))
    for a, b in zip(got[:4], want):
        assert torch.equal(a, b)
