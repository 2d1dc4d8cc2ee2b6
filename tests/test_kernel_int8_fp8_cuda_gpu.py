"""The CUDA sm90 core of int8_fp8 (csrc/int8_fp8_sm90.cu) on the GPU: it builds, agrees with the
reference of the scheme (conventions.md rule 2) and with the Triton core on gaussian and outlier inputs,
every causal mode, GQA, ragged and odd lengths, NHD output, fp16; every output element written; the
dispatch (``SAGE_COMPILE_INT8_FP8_CORE``) and the compiled path use it."""
import pytest
import torch
import torch.nn.functional as F
from helpers import cos_rel, llm_mask, outlier_inputs, poison_cuda_cache

pytestmark = pytest.mark.gpu


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="the CUDA core is sm90a code")


def _mods():
    from sage_compile.kernels.int8_fp8 import attention as KA
    from sage_compile.kernels.int8_fp8 import cuda as KC
    from sage_compile.kernels.int8_fp8 import quantize as KQ

    return KQ, KA, KC


def _run_cuda(qt, causal, layout="HND", dtype=torch.bfloat16, scale=None):
    """The CUDA core alone, into a NaN-poisoned output."""
    _, _, KC = _mods()
    from sage_compile.kernels._common import bhn_strides
    from sage_compile.reference.layout import out_shape

    b, h, n, d = qt[0].shape
    out = torch.full(out_shape(b, h, n, d, layout), float("nan"), dtype=dtype, device="cuda")
    return KC.attention(*qt, causal, scale, out, bhn_strides(out, layout))


@needs_sm90
def test_extension_builds():
    _, _, KC = _mods()
    assert KC.load() is not None, KC.status()
    st = KC.status()
    assert st["built"] is True and st["error"] is None and st["build_s"] >= 0, st


@needs_sm90
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
@pytest.mark.parametrize("inputs", ["gaussian", "outlier"])
def test_cuda_core_vs_reference_and_fp32(d, causal, inputs):
    KQ, KA, _ = _mods()
    from sage_compile.reference import int8_fp8 as R

    g = torch.Generator().manual_seed(d + len(causal))
    b, hq, hkv, lq, lk = 2, 8, 2, 1000, 1300  # GQA 4, ragged tiles, Lq != Lk
    if inputs == "gaussian":
        q, k, v = torch.randn(b, hq, lq, d, generator=g), torch.randn(b, hkv, lk, d, generator=g), torch.randn(
            b, hkv, lk, d, generator=g)
    else:
        q, k, v = outlier_inputs(b, hq, lk, d, g, hkv=hkv)
        q = q[:, :, :lq]
    q, k, v = (t.cuda() for t in (q, k, v))
    qt = KQ.quantize(q.bfloat16(), k.bfloat16(), v.bfloat16(), "HND", True)
    poison_cuda_cache()
    out = _run_cuda(qt, causal).float()
    ref = R.attention(*qt, None, causal, None, "HND", torch.bfloat16).float()
    tri = KA.attention(*qt, None, causal, None, "HND", torch.bfloat16, config={"BLOCK_M": 64}).float()
    if causal == "none":
        mask = None
    else:
        off = 0 if causal == "top_left" else lk - lq
        mask = torch.ones(lq, lk, dtype=torch.bool, device="cuda").tril(off)
    rep = lambda t: t.repeat_interleave(hq // hkv, dim=1)  # noqa: E731
    exact = F.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=mask)
    assert torch.isfinite(out).all()
    _agrees(out, ref, tri, exact, f"d={d} {causal} {inputs}")


def _agrees(out, ref, tri, exact, label):
    """The CUDA core's output vs exact attention within 1.1x the reference's error (conventions.md rule 2),
    and vs the reference and the Triton core to accumulation order (rel-L1 <= 1e-3)."""
    kc, kl = cos_rel(out, exact)
    rc, rl = cos_rel(ref, exact)
    vs_ref, vs_tri = cos_rel(out, ref)[1], cos_rel(out, tri)[1]
    print(f"\n{label}: cuda cos {kc:.5f} rel-L1 {kl:.4f} | reference {rc:.5f} / {rl:.4f} | "
          f"cuda-vs-ref {vs_ref:.2e} cuda-vs-triton {vs_tri:.2e}")
    assert kl <= 1.1 * rl and (1 - kc) <= 1.1 * (1 - rc) + 1e-6
    assert vs_ref <= 1e-3 and vs_tri <= 1e-3


# key-range masks (mask_structure's flags 1 and 2): (Lq, Lk, padded keys per batch, side, causal, mask
# shared by the queries (B, 1, 1, Lk)), the flag the mask gives
_RANGES = {
    "key_pad": ((1000, 1300, [0, 300], "right", False, True), 2),  # HunyuanVideo's text padding
    "left_pad_unaligned": ((700, 1300, [0, 200], "left", False, False), 2),  # the range starts inside a tile
    "causal_pad": ((1000, 1000, [0, 37], "right", True, False), 1),  # a training batch
    "causal_left_kv": ((300, 1300, [0, 517], "left", True, False), 1),  # generation, KV cache, bottom-right
    "causal_pad_odd_keys": ((1000, 1003, [0, 37], "right", True, False), 1),  # K padded to 4 keys, once
}


@needs_sm90
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", list(_RANGES))
def test_cuda_core_key_ranges(d, case, monkeypatch):
    """Key-range masks run on the CUDA core: its launch for the mask's flag writes every element (vs the
    reference, the Triton core and exact attention), a launch for another flag touches nothing, and the op
    serves the mask with the CUDA core."""
    KQ, KA, KC = _mods()
    from sage_compile.kernels._common import bhn_strides
    from sage_compile.reference import int8_fp8 as R

    (lq, lk, pad, side, causal, shared), want = _RANGES[case]
    b, hq, hkv = 2, 8, 2
    g = torch.Generator().manual_seed(d + lq)
    q, k, v = torch.randn(b, hq, lq, d, generator=g), torch.randn(b, hkv, lk, d, generator=g), torch.randn(
        b, hkv, lk, d, generator=g)
    q, k, v = (t.cuda() for t in (q, k, v))
    mask = llm_mask(b, lq, lk, pad, causal=causal, side=side)
    if shared:
        mask = mask[:, :, -1:]  # (B, 1, 1, Lk)
    mask = mask.cuda()
    qt = KQ.quantize(q.bfloat16(), k.bfloat16(), v.bfloat16(), "HND", True)
    flag, krange = KA.mask_structure(mask.view(torch.uint8).expand(b, hq, lq, lk), lq, lk)
    assert flag.item() == want
    ref = R.attention(*qt, mask, "none", None, "HND", torch.bfloat16).float()
    tri = KA.attention(*qt, mask, "none", None, "HND", torch.bfloat16, config={"BLOCK_M": 64}).float()
    mode = "bottom_right" if want == 1 else "none"
    outs = {}
    for w in (1, 2):
        poison_cuda_cache()
        outs[w] = torch.full((b, hq, lq, d), float("nan"), dtype=torch.bfloat16, device="cuda")
        KC.attention(*qt, mode, None, outs[w], bhn_strides(outs[w], "HND"), krange=krange, flag=flag, want=w)
    assert torch.isnan(outs[3 - want]).all()  # the other flag's launch left at once
    out = outs[want].float()
    assert torch.isfinite(out).all()
    rep = lambda t: t.repeat_interleave(hq // hkv, dim=1)  # noqa: E731
    keep = mask.expand(b, 1, lq, lk)
    exact = F.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=keep)
    seen = keep.any(-1, keepdim=True)  # rows that see no key: 0 from our cores, NaN from SDPA
    exact = torch.where(seen, exact, 0.0)
    assert (out[~seen.expand_as(out)] == 0).all()
    _agrees(out, ref, tri, exact, f"d={d} {case}")
    # through the op's dispatch: the CUDA core serves (its launches for both possible flags where the mask
    # varies along the queries), the result is the one above
    calls, pads = [], []
    real, real_pad = KC.attention, KC.pad_tokens
    monkeypatch.setattr(KC, "attention", lambda *a, **kw: calls.append(kw.get("want")) or real(*a, **kw))
    monkeypatch.setattr(KC, "pad_tokens", lambda x, m: pads.append(x.dtype) or real_pad(x, m))
    monkeypatch.setenv("SAGE_COMPILE_INT8_FP8_CORE", "cuda")
    got = KA.attention(*qt, mask, "none", None, "HND", torch.bfloat16).float()
    assert calls == ([2] if shared else [2, 1])
    assert len(pads) == (2 if lk % 4 else 0)  # K and its scales, once for both launches
    assert torch.equal(got, out)


@needs_sm90
@pytest.mark.parametrize("d", [64, 128])
def test_other_masks_beside_the_cuda_core_read_the_mask(d, monkeypatch):
    """A bool mask of no key-range structure (flag 0) under the CUDA core's dispatch: its key-range
    launches leave at once and the Triton launch reading the mask writes the whole output."""
    KQ, KA, KC = _mods()
    from sage_compile.reference import int8_fp8 as R

    b, hq, lq, lk = 2, 4, 700, 900
    g = torch.Generator().manual_seed(d)
    q, k, v = (torch.randn(b, hq, n, d, generator=g).cuda().bfloat16() for n in (lq, lk, lk))
    mask = llm_mask(b, lq, lk, [0, 100])
    mask[1, 0, 500, 3] = False  # one masked key inside the range: flag 0
    mask = mask.cuda()
    qt = KQ.quantize(q, k, v, "HND", True)
    assert KA.mask_structure(mask.view(torch.uint8).expand(b, hq, lq, lk), lq, lk)[0].item() == 0
    calls = []
    real = KC.attention
    monkeypatch.setattr(KC, "attention", lambda *a, **kw: calls.append(kw.get("want")) or real(*a, **kw))
    monkeypatch.setenv("SAGE_COMPILE_INT8_FP8_CORE", "cuda")
    poison_cuda_cache()
    out = KA.attention(*qt, mask, "none", None, "HND", torch.bfloat16).float()
    assert calls == [2, 1]
    ref = R.attention(*qt, mask, "none", None, "HND", torch.bfloat16).float()
    assert torch.isfinite(out).all() and cos_rel(out, ref)[1] <= 1e-3


@needs_sm90
@pytest.mark.parametrize("case", ["lk_odd", "tiny", "one_query", "lq_gt_lk_bottom_right", "nhd_fp16", "scale"])
def test_cuda_core_shapes(case):
    KQ, _, _ = _mods()
    from sage_compile.reference import int8_fp8 as R

    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g).cuda().bfloat16()  # noqa: E731
    d, causal, layout, dtype, scale = 128, "none", "HND", torch.bfloat16, None
    shapes = {"lk_odd": (1, 4, 300, 4, 333), "tiny": (1, 2, 5, 2, 7), "one_query": (2, 4, 1, 2, 4099),
              "lq_gt_lk_bottom_right": (1, 4, 700, 4, 300), "nhd_fp16": (2, 6, 515, 3, 515), "scale": (1, 2, 256, 2, 256)}
    b, hq, lq, hkv, lk = shapes[case]
    if case == "lq_gt_lk_bottom_right":
        causal = "bottom_right"  # the first 400 queries see no key: 0, as FlashAttention
    if case == "tiny":
        d, causal = 64, "top_left"
    if case == "nhd_fp16":
        layout, dtype, d = "NHD", torch.float16, 64
    if case == "scale":
        scale = 0.3
    q, k, v = r(b, hq, lq, d), r(b, hkv, lk, d), r(b, hkv, lk, d)
    qt = KQ.quantize(q.to(dtype), k.to(dtype), v.to(dtype), "HND", True)
    poison_cuda_cache()
    out = _run_cuda(qt, causal, layout, dtype, scale)
    ref = R.attention(*qt, None, causal, scale, layout, dtype)
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    rel = cos_rel(out.float(), ref.float())[1] if ref.abs().sum() > 0 else float(out.abs().max())
    assert rel <= 1e-3, rel
    if case == "lq_gt_lk_bottom_right":
        assert (out[:, :, :400] == 0).all()


@needs_sm90
@pytest.mark.parametrize("core", ["cuda", "auto", "triton"])
def test_dispatch_through_the_op(core, monkeypatch):
    """The op runs the CUDA core when told (and when auto measures it faster); general masks run Triton."""
    import sage_compile
    _, _, KC = _mods()

    calls = []
    real = KC.attention
    monkeypatch.setattr(KC, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setenv("SAGE_COMPILE_INT8_FP8_CORE", core)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 2048, 128, generator=g).cuda().bfloat16() for _ in range(3))
    out = sage_compile.attention(q, k, v, causal="none", scheme="int8_fp8")
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert cos_rel(out.float(), exact)[0] >= 0.999
    if core == "cuda":
        assert calls
    if core == "triton":
        assert not calls
    n = len(calls)
    mask = torch.rand(2, 1, 2048, 2048, generator=g).cuda() > 0.3
    masked = sage_compile.attention(q, k, v, attn_mask=mask, scheme="int8_fp8")
    # a mask of no key-range structure: the CUDA core's launches (under cuda / auto) leave at once and the
    # Triton core reads the mask
    serves = core == "cuda" or (core == "auto" and KC.known_choice(q, k, "none") is not False)
    assert len(calls) == (n + 2 if serves else n)
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    assert cos_rel(masked.float(), exact)[0] >= 0.999


def test_unsupported_reasons():
    _, _, KC = _mods()
    q8 = torch.zeros(1, 2, 8, 80, dtype=torch.int8, device="cuda")
    assert "head_dim 80" in KC.unsupported(q8, q8, None, torch.bfloat16)
    q8 = torch.zeros(1, 2, 8, 64, dtype=torch.int8, device="cuda")
    assert "mask" in KC.unsupported(q8, q8, torch.ones(8, 8, dtype=torch.bool, device="cuda"), torch.bfloat16)
    assert "dtype" in KC.unsupported(q8, q8, None, torch.float32)
    assert "scale" in KC.unsupported(q8, q8, None, torch.bfloat16, -0.5)


@needs_sm90
def test_runtime_failure_falls_back_to_triton(monkeypatch, caplog):
    """A launch the CUDA core refuses is logged and the call runs the Triton core (exact same contract)."""
    import sage_compile
    _, _, KC = _mods()

    def refuse(*a, **kw):
        raise RuntimeError("sage_compile sm90 int8_fp8 kernel failed (code 11: tensor map)")

    monkeypatch.setattr(KC, "attention", refuse)
    monkeypatch.setenv("SAGE_COMPILE_INT8_FP8_CORE", "cuda")
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 512, 64, generator=g).cuda().bfloat16() for _ in range(3))
    with caplog.at_level("WARNING", logger="sage_compile"):
        out = sage_compile.attention(q, k, v, scheme="int8_fp8")
    assert "runs the Triton core" in caplog.text
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert cos_rel(out.float(), exact)[0] >= 0.999
