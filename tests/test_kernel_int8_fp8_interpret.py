"""int8_fp8 Triton kernels on CPU under TRITON_INTERPRET=1 (small shapes): the prologue is bit-identical
to the reference given the same K mean; the core agrees with the reference to accumulation noise."""
import os

import pytest
import torch
from helpers import bits, llm_mask

if torch.cuda.is_available():
    pytest.skip("GPU machine: the kernels are tested compiled (test_kernel_int8_fp8_gpu.py)", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # read by triton at import and when the kernels are defined
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from sage_compile.kernels.int8_fp8 import attention as KA  # noqa: E402
from sage_compile.kernels._common import div_by, int8_bits, recip  # noqa: E402
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
    want = (*Q.quant_int8(q, 1), *Q.quant_int8_k_groups(k.float() - mean[..., None, :]), *Q.quant_fp8_v(v, 16))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(bits(a), bits(b))
    v8 = got[4]  # V^T's keys padded to 16 (130 -> 144) with zeros, so the CUDA core needs no copy
    pad = bits(v8[..., 130:])
    assert v8.shape[-1] == 144 and v8.is_contiguous() and torch.equal(pad, torch.zeros_like(pad))


def test_prologue_bit_identical_on_both_division_paths():
    """Tiles whose scales are in div_by's range divide through reciprocals, the others (a row with a
    scale below 2^-60, an infinite row, a NaN) with IEEE divisions: the reference's bits either way, -0.0
    in V included (div_by alone would give +0.0)."""
    q, k, v = _inputs(lq=200, lk=260)
    q[0, 1, 140] *= 1e-22  # a tiny row: the IEEE path for its tile (rows 128-191)
    q[0, 2, 7, 3] = float("inf")  # an infinite value: IEEE path, the row's scale inf, its values 0
    k[0, 1, 200, 5] = float("nan")  # a NaN key: K's mean of channel 5 is NaN, so every key of the head
    # has a NaN scale and values 0
    v[0, 0, 3:9, 1] = -0.0
    v[0, 1, 2, 4] = -0.0
    got = KQ.quantize(q, k, v)
    mean = KQ.k_mean(k)
    want = (*Q.quant_int8(q, 1), *Q.quant_int8_k_groups(k.float() - mean[..., None, :]), *Q.quant_fp8_v(v, 16))
    for a, b in zip(got, want):  # values bit for bit, scales exactly (NaN where the reference's are)
        torch.testing.assert_close(bits(a), bits(b), rtol=0, atol=0, equal_nan=True)
    assert int((bits(got[4])[0, 0, 1, 3:9] == 0x80).sum()) == 6  # the -0.0 kept their sign
    assert torch.isinf(got[1][0, 2, 7]) and torch.isnan(got[3][0, 1, 200])


@triton.jit
def _div_probe(X, S, Y, I8, N, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    x = tl.load(X + o, mask=m, other=0.0)
    s = tl.load(S + o, mask=m, other=1.0)
    r, ns = recip(s)
    y = div_by(x, r, ns)
    tl.store(Y + o, y, mask=m)
    tl.store(I8 + o, int8_bits(y), mask=m)


def test_div_by_is_the_ieee_quotient_near_every_tie():
    """div_by (reciprocal + one Markstein correction) against IEEE division on quotients within a few
    ulps of every half-integer up to 127 and of random values, divisors over [2^-60, 2^60]; int8_bits
    against round-half-even (|quotient| <= 127.5 there, as in the quantizers)."""
    g = torch.Generator().manual_seed(3)
    n = 1 << 18
    s = (torch.rand(n, generator=g, dtype=torch.float64) + 1) * torch.exp2(torch.randint(-60, 60, (n,), generator=g).double())
    s = s.float()
    half = torch.randint(-127, 127, (n,), generator=g).double() + 0.5
    jitter = torch.randint(-4, 5, (n,), generator=g).double() * 2.0 ** -23
    x = torch.where(torch.rand(n, generator=g) < 0.5, half * (1 + jitter) * s.double(),
                    (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1) * 127 * s.double()).float()
    y, i8 = torch.empty_like(x), torch.empty(n, dtype=torch.int8)
    _div_probe[(triton.cdiv(n, 4096),)](x, s, y, i8, n, BLOCK=4096)
    want = x / s  # IEEE on the CPU
    assert torch.equal(y.view(torch.int32), want.view(torch.int32).where(want != 0, 0))  # (+0 for -0)
    assert torch.equal(i8, torch.round(want).to(torch.int8))
    assert int((torch.round(want) != torch.round(x.double() * (1 / s.double())).float()).sum()) > 0  # ties were hit


def _small_chunks(monkeypatch) -> int:
    """Statistics chunks of 128 tokens here (one unrolled step of 4 tiles at hd64; 256 in the package up to
    8K tokens): the chunk logic with half the tokens through the interpreter."""
    c = 128
    assert c == KQ.STATS_UNROLL * min(64, KQ.STATS_TILE // 64) and c < KQ.stats_chunk(1)
    monkeypatch.setattr(KQ, "stats_chunk", lambda n: c)
    return c


def test_prologue_token_stats_over_several_chunks(monkeypatch):
    """Token reductions split over chunks of stats_chunk(N) tokens (a ragged last one): the mean agrees with
    torch's to rounding, the rest of the prologue (channel factors, V scales, every value) is the
    reference's bits given that mean; NaN poisons exactly its channel's V scale and K's factor is 1."""
    c = _small_chunks(monkeypatch)
    lk = 2 * c + 77
    q, k, v = _inputs(lq=70, lk=lk)
    k[0, 1, lk - 3, 5] = 500.0  # an outlier in the last (ragged) chunk
    v[0, 0, c + 1, 9] = -300.0  # V's amax in the middle chunk, negative
    got = KQ.quantize(q, k, v, "HND", True)
    mean = KQ.k_mean(k)
    assert torch.allclose(mean, k.float().mean(dim=-2), rtol=1e-6, atol=1e-6)
    qf, ksm = R.rescale_channels(q.float(), k.float() - mean[..., None, :])
    want = (*Q.quant_int8(qf, 1), *Q.quant_int8_k_groups(ksm), *Q.quant_fp8_v(v, 16))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(bits(a), bits(b))
    v[0, 1, c + 5, 3] = float("nan")
    v8, vs = KQ.quantize(q, k, v)[4:]
    assert torch.isnan(vs[0, 1, 3]) and int(torch.isnan(vs).sum()) == 1
    # the NaN channel's values are NaN (as the reference's), not the clamp's -448; the other channels' bits
    # are the reference's
    v8_ref = Q.quant_fp8_v(v, 16)[0]
    assert torch.isnan(v8[0, 1, 3, :lk].float()).all() and torch.isnan(v8_ref[0, 1, 3, :lk].float()).all()
    assert int(torch.isnan(v8.float()).sum()) == lk
    v8[0, 1, 3], v8_ref[0, 1, 3] = 0, 0
    assert torch.equal(bits(v8), bits(v8_ref))
    k[0, 0, 2 * c + 1, 7] = float("nan")
    s = KQ.channel_scales(q, k, KQ.k_mean(k))
    assert s[0, 0, 7] == 1 and torch.isfinite(s).all()


def test_prologue_statistics_over_batches_and_query_head_groups(monkeypatch):
    """The statistics' partials reach the right (batch, kv head) in the finalize: with two batches, three query
    heads per kv head and Q and K over different chunk counts, an outlier in the last chunk of the last query
    head of a group, and one of V's, land in that unit's factors and scales only; the K mean alone
    (``k_mean``) and the factors for a given mean (``channel_scales``) are the same bits as the full
    prologue's. (Written for run 99's finalize inside the statistics launch, each unit's last program
    counted by an atomic; kept for the separate finalize.)"""
    c = _small_chunks(monkeypatch)
    q, k, v = _inputs(b=2, hq=6, hkv=2, lq=c + 5, lk=2 * c + 77)
    q[1, 5, c + 2, 11] = 90.0  # batch 1, query head 5 (kv head 1), Q's last chunk
    v[1, 0, 2 * c + 70, 4] = -200.0  # batch 1, kv head 0, V's last chunk
    got = KQ.quantize(q, k, v, "HND", True)
    mean = KQ.k_mean(k)
    assert torch.allclose(mean, k.float().mean(dim=-2), rtol=1e-6, atol=1e-6)
    s = KQ.channel_scales(q, k, mean)
    assert torch.equal(s, Q.channel_balance(q, k.float() - mean[..., None, :])[..., 0, :])
    assert s[1, 1, 11] != 1 and s[1, 0, 11] != s[1, 1, 11]
    qf, ksm = R.rescale_channels(q.float(), k.float() - mean[..., None, :])
    want = (*Q.quant_int8(qf, 1), *Q.quant_int8_k_groups(ksm), *Q.quant_fp8_v(v, 16))
    for a, b in zip(got, want):
        assert torch.equal(bits(a), bits(b))
    assert got[5][1, 0, 4] == torch.tensor(200.0) / torch.tensor(448.0)


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
    want = (*Q.quant_int8(qf, 1), *Q.quant_int8_k_groups(ksm))
    for a, b in zip(got[:4], want):
        assert torch.equal(a, b)


def test_k_rows_capped_op_is_the_wide_k_quantizer():
    """``quant_k_rows_capped`` (what a traced call on a large K runs: the register-capped launch as an opaque op)
    gives :func:`quant_rows_int8`'s K bits (hd128, with mean and channel divisors) and passes ``opcheck``."""
    q, k, v = _inputs(d=128, lk=200)
    mean = KQ.k_mean(k)
    ch = 0.5 + torch.rand(k.shape[0], k.shape[1], 128, generator=torch.Generator().manual_seed(3))
    got = torch.ops.sage_compile.quant_k_rows_capped(k, mean, ch, 2)
    want = KQ.quant_rows_int8(k, mean, ch, 2, k_groups=True)
    ref = Q.quant_int8_k_groups((k.float() - mean[..., None, :]) / ch[:, :, None, :])
    for a, b, c in zip(got, want, ref):
        assert torch.equal(a, b) and torch.equal(a, c)
    torch.library.opcheck(torch.ops.sage_compile.quant_k_rows_capped.default, (k, mean, ch, 2))


def test_prologue_balance_from_a_query_sample_bit_identical():
    """Q's balance ranges from a strided sample (``balance_tokens=16``: every 9th of 150 queries, a strided
    view the statistics launch reads in place, HND and NHD): the values are the reference's bits given the
    K mean; a query outlier off the sample leaves the factors alone, one on it moves them."""
    q, k, v = _inputs()
    q[0, 3, 100, 7] = 500.0  # off the sample (100 % 9 != 0)
    got = KQ.quantize(q, k, v, "HND", True, 16)
    mean = KQ.k_mean(k)
    qf, ksm = R.rescale_channels(q.float(), k.float() - mean[..., None, :], None, q[:, :, ::9])
    want = (*Q.quant_int8(qf, 1), *Q.quant_int8_k_groups(ksm), *Q.quant_fp8_v(v, 16))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(bits(a), bits(b))
    nhd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(KQ.quantize(*nhd, "NHD", True, 16), got))
    s = KQ.channel_scales(q, k, mean, 16)
    q2 = q.clone()
    q2[0, 3, 100, 7] = 0.0
    assert torch.equal(s, KQ.channel_scales(q2, k, mean, 16)) and not torch.equal(s, KQ.channel_scales(q, k, mean, 0))
    q2[0, 3, 99, 7] = 500.0  # on the sample
    assert not torch.equal(s[0, 1, 7], KQ.channel_scales(q2, k, mean, 16)[0, 1, 7])


@pytest.mark.parametrize("case,flag", [
    (dict(lq=150, lk=150, pad=[0, 37]), 1),  # causal + right padding (training batch)
    # causal + left padding (generation)
    pytest.param(dict(lq=150, lk=150, pad=[130, 5], side="left"), 1, marks=pytest.mark.slow),
    (dict(lq=40, lk=300, pad=[0, 200], side="left"), 1),  # Lq < Lk (KV cache), bottom-right
    (dict(lq=150, lk=130, pad=[0, 129], causal=False), 2),  # key padding only
    # all True (flag 2 as key padding)
    pytest.param(dict(lq=150, lk=130, pad=[0, 0], causal=False), 2, marks=pytest.mark.slow),
])
def test_llm_masks_take_the_structured_path(case, flag):
    b = len(case["pad"])  # two query heads on one kv head: the masks are per batch, heads only cost interpreter time
    qt = KQ.quantize(*_inputs(b=b, hq=2, hkv=1, lq=case["lq"], lk=case["lk"]))
    mask = llm_mask(b, **case)
    f, _ = KA.mask_structure(mask.view(torch.uint8).expand(b, 2, case["lq"], case["lk"]), case["lq"], case["lk"])
    assert f.item() == flag
    fast = KA.attention(*qt, mask, "none", None, "HND", torch.float32, config=dict(BLOCK_M=64))
    read = KA.attention(*qt, mask, "none", None, "HND", torch.float32, config=dict(BLOCK_M=64), detect_mask=False)
    assert torch.equal(fast, read)  # skipped tiles are exactly the fully masked ones
    ref = R.attention(*qt, mask, "none", None, "HND", torch.float32)
    assert ((fast - ref).abs().sum() / ref.abs().sum()).item() < 1e-4


@pytest.mark.parametrize("row,flag", [("right_pad", 2), ("both_ends", 2), ("hole", 0), ("none_kept", 0)])
def test_key_masks_are_checked_on_their_one_row(row, flag):
    """A key mask shared by all queries ((B, 1, 1, Lk)) is checked on its row alone: the same flag and
    key ranges as the full check of the same mask materialized over the queries."""
    b, lq, lk = 2, 150, 130
    keep = torch.ones(b, lk, dtype=torch.bool)
    keep[1, 100:] = False
    if row == "both_ends":
        keep[0, :7] = False
    if row == "hole":
        keep[0, 50] = False
    if row == "none_kept":
        keep[1] = False
    shared = keep[:, None, None, :]
    got = KA.mask_structure(shared.view(torch.uint8).expand(b, 4, lq, lk), lq, lk)
    full = KA.mask_structure(shared.expand(b, 1, lq, lk).clone().view(torch.uint8).expand(b, 4, lq, lk), lq, lk)
    assert got[0].item() == full[0].item() == flag
    assert torch.equal(got[1], full[1])


@pytest.mark.parametrize("chunks", [None, (512, 1000)])
def test_key_ranges_and_flags_against_torch(chunks, monkeypatch):
    """mask_structure's two kernels against the same decisions made in torch, on rows longer than one
    key block: each batch's [first, last + 1) kept key of the last row (argmax semantics: [0, Lk) for a
    row keeping none), and the flag from comparing the whole mask with both structures; the check in one
    program or in several along the keys (``chunks``)."""
    if chunks:
        monkeypatch.setattr(KA, "CHECK_KEYS", chunks)
    lq, lk = 40, 2100
    g = torch.Generator().manual_seed(5)
    keep = torch.zeros(6, lk, dtype=torch.bool)
    keep[0] = True
    keep[1, 1500:2099] = True  # starts in the second key block, ends before the last key
    keep[2, 7] = True  # one key
    keep[4, :1030] = True
    keep[5] = torch.rand(lk, generator=g) > 0.5  # holes
    for causal in (False, True):
        mask = keep[:, None, None, :].expand(6, 1, lq, lk)
        if causal:
            mask = mask & torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        flag, krange = KA.mask_structure(mask.view(torch.uint8).expand(6, 4, lq, lk), lq, lk)
        last = mask[:, 0, -1]
        first = last.int().argmax(1)
        end = lk - last.flip(1).int().argmax(1)
        assert torch.equal(krange, torch.stack([first, end], 1).int())
        assert flag.item() == 0  # rows 3 (none kept) and 5 (holes)
        ok = [0, 1, 2, 4]
        f2, _ = KA.mask_structure(mask[ok].contiguous().view(torch.uint8).expand(4, 4, lq, lk), lq, lk)
        assert f2.item() == (1 if causal else 2)


@pytest.mark.parametrize("bad", ["hole", pytest.param("top_left_offset", marks=pytest.mark.slow), "per_head"])
def test_other_bool_masks_are_read(bad):
    lq, lk = 150, 130
    mask = llm_mask(2, lq, lk, [0, 10])
    if bad == "hole":
        mask[1, 0, 100, 3] = False  # one masked key inside the range
    if bad == "top_left_offset":
        mask = torch.ones(2, 1, lq, lk, dtype=torch.bool).tril()[:, :, :, :lk]  # top-left with Lq != Lk
    if bad == "per_head":
        mask = mask.expand(2, 4, lq, lk).clone()
        mask[:, 1, :, :7] = False
    qt = KQ.quantize(*_inputs(b=2, lq=lq, lk=lk))
    if bad != "per_head":
        f, _ = KA.mask_structure(mask.view(torch.uint8).expand(2, 4, lq, lk), lq, lk)
        assert f.item() == 0
    out = KA.attention(*qt, mask, "none", None, "HND", torch.float32, config=dict(BLOCK_M=64))
    ref = R.attention(*qt, mask, "none", None, "HND", torch.float32)
    assert ((out - ref).abs().sum() / ref.abs().sum()).item() < 1e-4


@pytest.mark.parametrize("hole", [False, True])
def test_general_mask_launch_serves_flag_zero_alone(hole):
    """The Triton launch that runs beside the CUDA core's key-range launches (``general_only``) leaves the
    output untouched under a key-range structure and writes all of it for any other mask."""
    lq, lk = 150, 130
    mask = llm_mask(2, lq, lk, [0, 10])
    if hole:
        mask[1, 0, 100, 3] = False  # flag 0
    qt = KQ.quantize(*_inputs(b=2, lq=lq, lk=lk))
    out = KA.attention(*qt, mask, "none", None, "HND", torch.float32, config=dict(BLOCK_M=64), general_only=True)
    if not hole:
        assert torch.isnan(out).all()
    else:
        ref = R.attention(*qt, mask, "none", None, "HND", torch.float32)
        assert torch.isfinite(out).all()
        assert ((out - ref).abs().sum() / ref.abs().sum()).item() < 1e-4


@pytest.mark.parametrize("cfg", [dict(PV=1), dict(PV=1, num_warps=8)])
def test_core_tuning_variants_match_reference(cfg):
    """Variants that keep 128-key tiles keep the numerics (the P scale follows the running max per tile,
    so other BLOCK_N are different numerics, not tuning)."""
    qt = KQ.quantize(*_inputs(lq=150, lk=200))
    out = KA.attention(*qt, None, "bottom_right", None, "HND", torch.float32, config=dict(BLOCK_M=64, **cfg))
    ref = R.attention(*qt, None, "bottom_right", None, "HND", torch.float32)
    assert ((out - ref).abs().sum() / ref.abs().sum()).item() < 1e-4


def test_channel_scales_equal_channel_balance():
    """The prologue's min/max route to the channel factors gives the reference's factors exactly, the lower
    bound (K's widest finite channel range) included."""
    from sage_compile.reference.quant import channel_balance

    q, k, _ = _inputs()
    k[0, 1, 5, 7] = 300.0  # an outlier channel
    q[0, 2, :, 9] = 0  # a zero channel: factor 1
    q[0, 1, 3, 11] = float("nan")  # a NaN channel: factor 1 (as the reference)
    k[0, 0, 4, 12] = float("inf")  # an infinite K channel: factor 1
    q[0, 0, 2, 20] = 400.0  # a query outlier: its channel's factor is the bound's
    mean = KQ.k_mean(k)
    got = KQ.channel_scales(q, k, mean)
    want = channel_balance(q.float(), k.float() - mean[..., None, :])[:, :, 0]
    assert torch.equal(got, want)
    assert got[0, 0, 11] == 1 and got[0, 0, 12] == 1 and torch.isfinite(got).all()
    ak = (k.float() - mean[..., None, :]).abs().amax(-2)[0, 0]
    assert got[0, 0, 20] == ak[20] / ak[torch.isfinite(ak)].max() > (ak[20] / 400.0).sqrt()
