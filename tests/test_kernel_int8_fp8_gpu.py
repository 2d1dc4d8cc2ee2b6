"""int8_fp8 Triton kernels on the GPU: bit-identical prologue, core vs reference (conventions.md rule 2),
accuracy goals vs fp32 SDPA on gaussian and outlier inputs, poisoned outputs, and the compiled path."""
import pytest
import torch
import torch.nn.functional as F
from helpers import bits, cos_rel, outlier_inputs, poison_cuda_cache, shape_case
from torch._dynamo.utils import counters

import sage_compile

pytestmark = pytest.mark.gpu


def _kernels():
    from sage_compile.kernels.int8_fp8 import attention as KA
    from sage_compile.kernels.int8_fp8 import quantize as KQ

    return KQ, KA


def _sets(d, n=4096, b=2, h=8):
    g = torch.Generator().manual_seed(d)
    gauss = tuple(torch.randn(b, h, n, d, generator=g) for _ in range(3))
    return {"gaussian": gauss, "outlier": outlier_inputs(b, h, n, d, g)}


@pytest.mark.parametrize("d", [64, 128])
def test_prologue_bit_identical_on_gpu(d):
    KQ, _ = _kernels()
    from sage_compile.reference import quant as Q
    from sage_compile.reference.quant import channel_balance

    q, k, v = (t.cuda().bfloat16() for t in _sets(d, n=1000)["outlier"])
    got = [t.cpu() for t in KQ.quantize(q, k, v)]
    # the CPU reference defines the bits: torch on CUDA divides by a Python scalar via its reciprocal
    mean = KQ.k_mean(k).cpu()
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    want = (*Q.quant_int8(q, 1), *Q.quant_int8_k_groups(k.float() - mean[..., None, :]), *Q.quant_fp8_v(v, 16))
    names = ("q8", "qs", "k8", "ks", "v8", "vs")
    # the channel-balanced prologue, given the GPU's channel factors (conventions.md: bit-identical given
    # identical smoothed inputs); the factors themselves agree to rounding (torch's CUDA sqrt/division); Q's
    # ranges from every 15th query (balance_tokens=64 of 1000), read in place as a strided view
    s_gpu = KQ.channel_scales(q.cuda(), k.cuda(), mean.cuda(), 64).cpu()
    s_cpu = channel_balance(q[:, :, ::15].float(), k.float() - mean[..., None, :])[:, :, 0]
    assert ((s_gpu - s_cpu).abs() <= 2e-7 * s_cpu.abs()).all()
    assert not torch.equal(s_gpu, KQ.channel_scales(q.cuda(), k.cuda(), mean.cuda(), 0).cpu())
    qr = q.float() * s_gpu.repeat_interleave(q.shape[1] // k.shape[1], dim=1)[:, :, None, :]
    kr = (k.float() - mean[..., None, :]) / s_gpu[:, :, None, :]
    got_r = [t.cpu() for t in KQ.quantize(q.cuda(), k.cuda(), v.cuda(), "HND", True, 64)[:4]]
    got, want = got + got_r, want + (*Q.quant_int8(qr, 1), *Q.quant_int8_k_groups(kr))
    names = names + ("q8_rescaled", "qs_rescaled", "k8_rescaled", "ks_rescaled")
    for name, a, b in zip(names, got, want):
        a, b = bits(a), bits(b)
        bad = a != b
        assert not bad.any(), f"{name}: {int(bad.sum())} of {a.numel()} differ, e.g. {a[bad][:5].tolist()} vs {b[bad][:5].tolist()}"


def test_prologue_bit_identical_on_both_division_paths_on_gpu():
    """Tiles with every divisor in div_by's range divide through reciprocals (FMA on the GPU), the others
    (a tiny row, an infinite value, a NaN key) with IEEE divisions: the CPU reference's bits either way,
    -0.0 in V included; NaN scales where the reference's are."""
    KQ, _ = _kernels()
    from sage_compile.reference import quant as Q

    q, k, v = (t.bfloat16() for t in _sets(128, n=1000)["outlier"])
    q[0, 1, 140] *= 1e-22
    q[0, 2, 7, 3] = float("inf")
    k[0, 1, 600, 5] = float("nan")
    v[0, 0, 3:9, 1] = -0.0
    got = [t.cpu() for t in KQ.quantize(q.cuda(), k.cuda(), v.cuda())]
    mean = KQ.k_mean(k.cuda()).cpu()
    want = (*Q.quant_int8(q, 1), *Q.quant_int8_k_groups(k.float() - mean[..., None, :]), *Q.quant_fp8_v(v, 16))
    for name, a, b in zip(("q8", "qs", "k8", "ks", "v8", "vs"), got, want):
        a, b = bits(a), bits(b)
        bad = (a != b) & ~(a.isnan() & b.isnan()) if a.is_floating_point() else a != b
        assert not bad.any(), f"{name}: {int(bad.sum())} of {a.numel()} differ, e.g. {a[bad][:5].tolist()} vs {b[bad][:5].tolist()}"
    assert int((bits(got[4])[0, 0, 1, 3:9] == 0x80).sum()) == 6


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", ["none", "top_left"])
@pytest.mark.parametrize("inputs", ["gaussian", "outlier"])
def test_accuracy_vs_fp32_and_reference(d, causal, inputs):
    KQ, KA = _kernels()
    from sage_compile.reference import int8_fp8 as R

    q, k, v = (t.cuda() for t in _sets(d)[inputs])
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=causal != "none")
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    qt = KQ.quantize(qb, kb, vb)
    poison_cuda_cache()
    out = KA.attention(*qt, None, causal, None, "HND", torch.bfloat16).float()
    ref = R.attention(*qt, None, causal, None, "HND", torch.bfloat16).float()
    assert torch.isfinite(out).all()
    kc, kl = cos_rel(out, exact)
    rc, rl = cos_rel(ref, exact)
    between = cos_rel(out, ref)[1]
    print(f"\nd={d} {causal} {inputs}: kernel cos {kc:.5f} rel-L1 {kl:.4f} | reference cos {rc:.5f} rel-L1 {rl:.4f} | kernel-vs-ref rel-L1 {between:.2e}")
    assert kl <= 1.1 * rl and (1 - kc) <= 1.1 * (1 - rc) + 1e-6
    assert between <= 1e-3
    if inputs == "gaussian":
        assert kc >= 0.9992 and kl <= 0.04


@pytest.mark.parametrize("d", [64, 128])
def test_outlier_goal_of_issue_3(d):
    """Issue 3's outlier goal (cos >= 0.998, rel-L1 <= 0.06), reached with the Q/K channel balancing
    (per-token scales alone measured cos 0.9978/0.9975, rel-L1 0.062/0.068 on the H200)."""
    KQ, KA = _kernels()
    q, k, v = (t.cuda() for t in _sets(d)["outlier"])
    exact = F.scaled_dot_product_attention(q, k, v)
    res = {}
    for rescale in (False, True):
        qt = KQ.quantize(q.bfloat16(), k.bfloat16(), v.bfloat16(), "HND", rescale)
        out = KA.attention(*qt, None, "none", None, "HND", torch.bfloat16)
        res[rescale] = cos_rel(out.float(), exact)
    print(f"\noutlier d={d}: per-token {res[False]} | channel-balanced {res[True]}")
    c, l1 = res[True]
    assert c >= 0.998 and l1 <= 0.06


@pytest.mark.parametrize("case", ["gqa_bottom_right_ragged", "bool_mask_nhd", "additive_mask", "hd80", "fp16"])
def test_shapes_and_masks(case):
    q, k, v, mask, causal, layout, dtype = shape_case(case, torch.Generator().manual_seed(7))
    ref = sage_compile.attention(q, k, v, mask, causal, None, layout, "int8_fp8")
    q, k, v, mask = (None if t is None else t.cuda() for t in (q, k, v, mask))
    out = sage_compile.attention(q, k, v, mask, causal, None, layout, "int8_fp8")
    assert out.dtype == dtype and out.shape == q.shape and torch.isfinite(out).all()
    assert cos_rel(out.float().cpu(), ref.float())[1] < 2e-3


def test_compiled_model_uses_kernel():
    m = sage_compile.models.TinyDiT(dim=512, heads=4).cuda().to(torch.bfloat16).eval()
    x = torch.randn(2, 2048, 16, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = m(x).float()
        out = torch.compile(m, backend="sage", options={"sage_kernel": "int8_fp8"})(x).float()
    assert counters["sage_compile"]["scheme:int8_fp8"] == 2
    assert sage_compile.ops.has_fast_impl("int8_fp8", "cuda")
    assert cos_rel(out, ref)[0] > 0.999


class _Sdpa(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_auto_runs_int8_fp8_on_long_attention_and_keeps_sdpa_on_short():
    """``backend="sage"`` with its default kernel (``auto``) on the sm90 CUDA core: ``int8_fp8`` at a site of
    AUTO_INT8_FP8_MIN_TOKENS_CAUSAL queries and keys (causal; within the scheme's accuracy), SDPA at one of a
    quarter of that, the reason in the match report."""
    from sage_compile.kernels.int8_fp8 import cuda
    from sage_compile.policy import AUTO_INT8_FP8_MIN_TOKENS_CAUSAL as least

    why = cuda.unavailable()
    if why is not None:
        pytest.skip(f"auto keeps SDPA here: {why}")
    for n, want in ((least, 1), (least // 4, 0)):
        q, k, v = (torch.randn(1, 2, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        counters.clear()
        sage_compile.debug.clear_reports()
        with torch.no_grad():
            out = torch.compile(_Sdpa(), backend="sage", fullgraph=True)(q, k, v)
        rows = [r for rows in sage_compile.debug.last_reports() for r in rows]
        assert counters["sage_compile"]["scheme:int8_fp8"] == want, rows
        assert len(rows) == 1 and "auto on cuda" in str(rows[0]), rows
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        c, l1 = cos_rel(out.float(), ref)
        assert c > (0.998 if want else 0.99999) and l1 < (0.08 if want else 0.005), (n, c, l1)


@pytest.mark.parametrize("side", ["right", "left"])
def test_llm_mask_runs_structured_and_equals_reading_it(side):
    """transformers' bool causal+padding mask: recognised on the device, the causal / key-range sweep
    gives the output of reading the mask (to compiled-code rounding: FMA contraction differs between the
    two kernels), and skips the masked tiles (timed, printed)."""
    from triton.testing import do_bench

    KQ, KA = _kernels()
    b, h, n, d = 2, 16, 4096, 128
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(b, h, n, d, generator=g).cuda().bfloat16() for _ in range(3))
    keep = torch.ones(b, n, dtype=torch.bool)
    keep[1, n - 1000:] = False if side == "right" else True
    if side == "left":
        keep[1, :1000] = False
    mask = (keep[:, None, :] & torch.ones(n, n, dtype=torch.bool).tril()[None])[:, None].cuda()
    qt = KQ.quantize(q, k, v)
    f, kr = KA.mask_structure(mask.view(torch.uint8).expand(b, h, n, n), n, n)
    assert f.item() == 1 and kr.tolist() == [[0, n], [0, n - 1000] if side == "right" else [1000, n]]
    poison_cuda_cache()
    fast = KA.attention(*qt, mask, "none", None, "HND", torch.bfloat16)
    poison_cuda_cache()
    read = KA.attention(*qt, mask, "none", None, "HND", torch.bfloat16, detect_mask=False)
    assert torch.isfinite(fast).all()
    causal = KA.attention(*qt, None, "top_left", None, "HND", torch.bfloat16)
    d_read, d_causal = cos_rel(fast.float(), read.float())[1], cos_rel(fast[0].float(), causal[0].float())[1]
    print(f"\nstructured vs read rel-L1 {d_read:.2e}, batch 0 vs the causal kernel {d_causal:.2e}")
    assert d_read < 1e-3 and d_causal < 1e-3  # batch 0 has no padding: the causal kernel's result
    t = {name: do_bench(fn, warmup=10, rep=50) for name, fn in (
        ("structured", lambda: KA.attention(*qt, mask, "none", None, "HND", torch.bfloat16)),
        ("read", lambda: KA.attention(*qt, mask, "none", None, "HND", torch.bfloat16, detect_mask=False)),
        ("causal", lambda: KA.attention(*qt, None, "top_left", None, "HND", torch.bfloat16)))}
    print(f"\nllm mask ({side} padding) ms: " + " ".join(f"{k}={v:.3f}" for k, v in t.items()))
