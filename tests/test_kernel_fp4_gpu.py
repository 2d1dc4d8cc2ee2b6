"""fp4 (NVFP4) Triton kernels on the GPU: quantizer bit-identical to the CPU reference, core vs the
reference (conventions.md rule 2: error <= 1.1x the reference's, rel-L1 between them <= 5e-3)."""
import pytest
import torch
import torch.nn.functional as F
from helpers import bits, cos_rel, outlier_inputs, shape_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("d", [64, 128, 80])
def test_quantizer_bit_identical_on_gpu(d):
    from sage_compile.kernels.fp4 import quantize as KQ
    from sage_compile.reference import fp4 as R
    from sage_compile.reference.quant import quant_nvfp4

    g = torch.Generator().manual_seed(d)
    q, k, v = (t.bfloat16() for t in outlier_inputs(1, 4, 1000, d, g, hkv=2))
    qsm, ksm, _ = R.smooth(q, k)  # smoothing on the CPU: the reductions' order is not part of rule 1
    vt = R.v_transposed(v)[0]
    for x in (qsm, ksm, vt):
        for search in (False, True):
            got = KQ.quant_nvfp4(x.cuda(), search)
            want = quant_nvfp4(x, search)
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
    qt = KQ.quantize(q.bfloat16(), k.bfloat16(), v.bfloat16(), v_smooth=inputs == "outlier")
    out = KA.attention(*qt, None, causal, None, "HND", torch.bfloat16, d).float()
    ref = R.attention(*qt, None, causal, None, "HND", torch.bfloat16, d).float()
    assert torch.isfinite(out).all()
    kc, kl = cos_rel(out, exact)
    rc, rl = cos_rel(ref, exact)
    print(f"\nfp4 d={d} {causal} {inputs}: kernel cos {kc:.5f} rel-L1 {kl:.4f} | reference {rc:.5f} {rl:.4f} "
          f"| between {cos_rel(out, ref)[1]:.2e}")
    assert kl <= 1.1 * rl and cos_rel(out, ref)[1] <= 5e-3


@pytest.mark.parametrize("case", ["gqa_bottom_right_ragged", "bool_mask_nhd", "hd80_fp16", "upstream_options"])
def test_shapes_masks_and_options_vs_reference(case):
    """The op on CUDA (kernel) vs the op on CPU (reference): GQA, Lq != Lk, ragged tails, masks, NHD,
    padded head dims, fp16, and the numeric options."""
    import sage_compile
    from sage_compile import ops

    assert ops.has_fast_impl("fp4", "cuda")
    q, k, v, mask, causal, layout, dtype = shape_case(case, torch.Generator().manual_seed(5))
    opts = sage_compile.Options()
    if case == "upstream_options":  # SageAttention3 as published (the defaults are rounded / fp32)
        opts = sage_compile.Options(fp4_p_scale="unrounded", fp4_delta_s="input", fp4_q_block=128,
                                    fp4_v_smooth=False, fp4_qk_scale="amax", fp4_qk_balance=False)
    out = ops.attention(q.cuda(), k.cuda(), v.cuda(), None if mask is None else mask.cuda(), causal, None, layout,
                        "fp4", opts.encode()).cpu()
    ref = ops.attention(q, k, v, mask, causal, None, layout, "fp4", opts.encode())
    assert out.dtype == dtype and out.shape == q.shape and torch.isfinite(out).all()
    assert cos_rel(out.float(), ref.float())[1] < 5e-3


def test_compiled_model_runs_fp4_kernel_with_hybrid_steps():
    import sage_compile
    from torch._dynamo.utils import counters

    m = sage_compile.models.TinyDiT(dim=512, heads=4).cuda().to(torch.bfloat16).eval()
    x = torch.randn(2, 2048, 16, device="cuda", dtype=torch.bfloat16)
    c = torch.compile(m, backend="sage", options={"sage_kernel": "fp4", "sage_switchable": True})
    h = sage_compile.HybridSteps(num_steps=3, first=1, last=1)
    with torch.no_grad():
        ref = m(x).float()
        outs = []
        with h:
            for i in range(3):
                outs.append(c(x).float())
                h.step_end(i)
    assert counters["sage_compile"]["scheme:fp4"] == 2
    cf, ci = cos_rel(outs[1], ref)[0], cos_rel(outs[0], ref)[0]
    print(f"\nTinyDiT fp4 step cos {cf:.5f}, int8_fp8 (hybrid) step cos {ci:.5f}")
    assert torch.equal(outs[0], outs[2]) and ci > 0.999 and cf > 0.98 and not torch.equal(outs[0], outs[1])
