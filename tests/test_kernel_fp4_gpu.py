"""fp4 (NVFP4) Triton kernels on the GPU: quantizer bit-identical to the CPU reference, core vs the
reference (conventions.md rule 2: error <= 1.1x the reference's, rel-L1 between them <= 5e-3)."""
import pytest
import torch
import torch.nn.functional as F
from helpers import bits, cos_rel, outlier_inputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("d", [64, 128, 80])
def test_quantizer_bit_identical_on_gpu(d):
    from sage_compile.kernels.fp4 import quantize as KQ
    from sage_compile.reference import fp4 as R
    from sage_compile.reference.quant import quant_nvfp4

    g = torch.Generator().manual_seed(d)
    q, k, v = (t.bfloat16() for t in outlier_inputs(1, 4, 1000, d, g, hkv=2))
    qsm, ksm, _ = R.smooth(q, k)  # smoothing on the CPU: the reductions' order is not part of rule 1
    vt = R.v_transposed(v)
    for x in (qsm, ksm, vt):
        got = KQ.quant_nvfp4(x.cuda())
        want = quant_nvfp4(x)
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(bits(got[1]).cpu(), bits(want[1]))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", ["none", "top_left"])
@pytest.mark.parametrize("inputs", ["gaussian", "outlier"])
def test_core_vs_reference_and_fp32(d, causal, inputs):
    from sage_compile.kernels.fp4 import attention as KA
    from sage_compile.kernels.fp4 import quantize as KQ
    from sage_compile.reference import fp4 as R

    g = torch.Generator().manual_seed(d)
    if inputs == "gaussian":
        q, k, v = (torch.randn(1, 8, 2048, d, generator=g) for _ in range(3))
    else:
        q, k, v = outlier_inputs(1, 8, 2048, d, g)
    q, k, v = (t.cuda() for t in (q, k, v))
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=causal != "none")
    qt = KQ.quantize(q.bfloat16(), k.bfloat16(), v.bfloat16())
    out = KA.attention(*qt, None, causal, None, "HND", torch.bfloat16, d).float()
    ref = R.attention(*qt, None, causal, None, "HND", torch.bfloat16, d).float()
    assert torch.isfinite(out).all()
    kc, kl = cos_rel(out, exact)
    rc, rl = cos_rel(ref, exact)
    print(f"\nfp4 d={d} {causal} {inputs}: kernel cos {kc:.5f} rel-L1 {kl:.4f} | reference {rc:.5f} {rl:.4f} "
          f"| between {cos_rel(out, ref)[1]:.2e}")
    assert kl <= 1.1 * rl and cos_rel(out, ref)[1] <= 5e-3
