"""Quantizers: exact expected values (grids, ties, saturation, zero groups, NaN/Inf, packing) and
round-trip error bounds."""
import math

import pytest
import torch

from sage_compile.reference import quant as Q


def test_e2m1_grid_and_ties():
    x = torch.tensor([0.0, 0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 6.0, 7.0, 1e9, -0.75, -5.0, -100.0])
    want = [0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0, -1.0, -4.0, -6.0]
    assert Q.round_e2m1(x).tolist() == want


def test_e2m1_codes_roundtrip_all_values():
    vals = torch.tensor([s * g for s in (1.0, -1.0) for g in Q.E2M1_GRID])
    codes = Q.e2m1_codes(vals)
    assert codes.tolist()[:8] == list(range(8))
    assert codes.tolist()[9:] == list(range(9, 16))  # -0.0 encodes as 8
    assert torch.equal(Q.e2m1_decode(codes), vals)


def test_pack_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = Q.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(Q.unpack_fp4(packed), codes)


def test_e4m3_saturates_and_rounds_to_even():
    x = torch.tensor([460.0, 464.0, 470.0, 1e6, -1e6, 2.0 ** -10, 3 * 2.0 ** -10, float("nan")])
    got = Q.to_e4m3(x).float()
    assert got[:7].tolist() == [448.0, 448.0, 448.0, 448.0, -448.0, 0.0, 2.0 ** -8]
    assert math.isnan(got[7].item())


def test_int8_per_token_values_and_zero_rows():
    x = torch.tensor([[[1.0, -2.0, 0.5, 127.0], [0.0, 0.0, 0.0, 0.0], [0.5, -0.5, 0.25, 0.0]]])
    vals, scale = Q.quant_int8(x, 1)
    assert scale.tolist()[0] == pytest.approx([1.0, 0.0, 0.5 / 127])
    assert vals[0, 0].tolist() == [1, -2, 0, 127]  # 0.5 -> 0 (ties to even)
    assert vals[0, 1].tolist() == [0, 0, 0, 0]
    assert vals[0, 2].tolist() == [127, -127, 64, 0]  # 63.5 -> 64 (ties to even)
    assert torch.equal(Q.dequant_int8(vals, scale, 1)[0, 1], torch.zeros(4))


def test_int8_block_groups_share_scale():
    x = torch.randn(2, 3, 200, 16)
    vals, scale = Q.quant_int8(x, 64)
    assert scale.shape == (2, 3, 4)
    assert torch.allclose(scale[..., 0], x[..., :64, :].abs().amax(dim=(-1, -2)) / 127)
    err = (Q.dequant_int8(vals, scale, 64) - x).abs()
    assert (err <= scale.repeat_interleave(64, -1)[..., :200, None] / 2 + 1e-7).all()


def test_int8_k_groups_tie_32_keys_of_each_tile():
    """K's scale groups (the CUDA core's per-thread groups): in each 128-key tile, the keys with equal
    (k >> 2) & 3; the group's scale is the largest per-token scale of its keys; a NaN poisons its group only."""
    x = torch.randn(2, 3, 300, 16)
    x[1, 2, 133, 5] = float("nan")  # tile 1, key 5 of it: group 4 + 1
    vals, scale = Q.quant_int8_k_groups(x)
    _, tok = Q.quant_int8(x, 1)
    gid = Q.k_group_ids(300)
    assert gid[:20].tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4 + [0] * 4 and gid[299] == 8 + 2
    assert scale.shape == tok.shape
    for g in range(int(gid.max()) + 1):
        keys = gid == g
        want = tok[..., keys].amax(-1, keepdim=True).expand(-1, -1, int(keys.sum()))
        if g == 5:
            assert scale[1, 2, keys].isnan().all() and not scale[1, 2, ~keys].isnan().any()
            want = want.clone()
            want[1, 2] = float("nan")
        torch.testing.assert_close(scale[..., keys], want, rtol=0, atol=0, equal_nan=True, msg=f"group {g}")
    ok = ~scale.isnan()[..., None].expand_as(x)
    err = (vals.float() * scale[..., None] - x).abs()
    assert (err[ok] <= scale[..., None].expand_as(x)[ok] / 2 + 1e-7).all()
    assert torch.equal(vals, torch.round(Q.div_rn(x, scale[..., None])).clamp(-127, 127).nan_to_num(0.0).to(torch.int8))


def test_int8_nan_and_inf_propagate_to_scale():
    x = torch.ones(1, 1, 2, 4)
    x[0, 0, 0, 1] = float("nan")
    x[0, 0, 1, 2] = float("inf")
    _, scale = Q.quant_int8(x, 1)
    assert math.isnan(scale[0, 0, 0].item()) and math.isinf(scale[0, 0, 1].item())


def test_fp8_v_per_channel():
    v = torch.randn(1, 2, 50, 8)
    v[..., 3] = 0.0
    vals, scale = Q.quant_fp8_v(v)
    assert vals.shape == (1, 2, 8, 50) and vals.dtype == torch.float8_e4m3fn
    assert torch.allclose(scale, v.abs().amax(dim=-2) / 448)
    back = Q.dequant_fp8_v(vals, scale)
    assert torch.equal(back[..., 3], torch.zeros(1, 2, 50))  # zero channel: no NaN
    assert ((back - v).abs() <= v.abs() * 2 ** -4 + scale[..., None, :] * 2 ** -9).all()
    assert vals.float().abs().max() <= 448


def test_nvfp4_scale_rules():
    x = torch.zeros(4, 16)
    x[0, 0] = 6.0              # amax 6 -> scale 1, value 6
    x[1, :] = 3000.0           # past 6*448: scale saturates at 448, values clip to 6
    x[2, 0] = 0.005            # amax/6 below half the smallest E4M3 subnormal -> scale 0, block flushed
    x[3, 0], x[3, 1] = 1.0, 0.3  # scale 1/6 -> e4m3 0.171875 (0.125 * 1.375)
    packed, scale = Q.quant_nvfp4(x)
    sf = scale.float()[:, 0].tolist()
    assert sf[0] == 1.0 and sf[1] == 448.0 and sf[2] == 0.0 and sf[3] == 0.171875
    deq = Q.dequant_nvfp4(packed, scale)
    assert deq[0, 0] == 6.0 and (deq[1] == 2688.0).all() and (deq[2] == 0).all()
    # y = 1/0.171875 = 5.82 -> 6 ; 0.3/0.171875 = 1.745 -> 1.5
    assert deq[3, :2].tolist() == [6 * 0.171875, 1.5 * 0.171875]


def test_nvfp4_roundtrip_error_bound_and_dequant_exact_in_bf16():
    x = torch.randn(8, 4, 128) * torch.logspace(-1, 2, 8)[:, None, None]
    packed, scale = Q.quant_nvfp4(x)
    deq = Q.dequant_nvfp4(packed, scale)
    assert torch.equal(deq.to(torch.bfloat16).float(), deq)
    blocks = x.unflatten(-1, (-1, 16)).abs().amax(-1, keepdim=True)
    # worst case: E2M1 half-step at the top of the grid (1.0 of 6) plus the 1/16 scale rounding
    err = (deq - x).unflatten(-1, (-1, 16)).abs()
    assert (err <= blocks * (1.0 / 6 + 1.0 / 16) * 1.07).all()
    assert torch.nn.functional.cosine_similarity(deq.flatten(), x.flatten(), dim=0) > 0.99


def test_nvfp4_scale_search_is_never_worse_per_block_and_keeps_special_blocks():
    """The searched scale is one of the 13 candidates' E4M3 scales, no block's squared error exceeds
    amax/6's, the total drops well below it on Gaussian blocks; zero blocks keep scale 0, NaN blocks NaN."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 8, 64, generator=g) * torch.logspace(-2, 2, 64)[:, None, None]
    x[0, 0, :16] = 0
    x[0, 1, 3] = float("nan")
    x[0, 2, :16] = 0.5       # flat block: amax/6 rounds to e4m3 0.0859 (0.5 -> 0.516); amax/4 is exact
    plain, search = Q.quant_nvfp4(x), Q.quant_nvfp4(x, search=True)
    dp, ds = Q.dequant_nvfp4(*plain), Q.dequant_nvfp4(*search)

    def block_err(d):
        return (d.double() - x.double()).unflatten(-1, (-1, 16)).square().sum(-1)

    ep, es = block_err(dp), block_err(ds)
    ok = torch.isfinite(ep)
    assert (es[ok] <= ep[ok]).all() and es[ok].sum() < 0.85 * ep[ok].sum()
    sc = search[1].float()
    assert sc[0, 0, 0] == 0 and torch.isnan(sc[0, 1, 0]) and (ds[0, 2, :16] == 0.5).all() and (dp[0, 2, :16] != 0.5).all()
    amax = x.unflatten(-1, (-1, 16)).abs().amax(-1)
    cands = torch.stack([Q.to_e4m3(amax / m).float() for m in Q.NVFP4_SEARCH_MAXES])
    fin = torch.isfinite(sc)
    assert ((cands == sc[None]).any(0) | ~fin).all()
    assert (sc[fin] != plain[1].float()[fin]).float().mean() > 0.2  # the search does move scales


def test_nvfp4_rejects_bad_width_and_mxfp4_power_of_two_scales():
    with pytest.raises(ValueError, match="multiple of 16"):
        Q.quant_nvfp4(torch.randn(3, 20))
    x = torch.randn(4, 64)
    packed, e = Q.quant_mxfp4(x)
    deq = Q.dequant_mxfp4(packed, e)
    amax = x.unflatten(-1, (-1, 32)).abs().amax(-1)
    assert torch.equal(e.float(), torch.floor(torch.log2(amax)) - 2)
    assert torch.nn.functional.cosine_similarity(deq.flatten(), x.flatten(), dim=0) > 0.97
    assert torch.equal(Q.dequant_mxfp4(*Q.quant_mxfp4(torch.zeros(1, 32))), torch.zeros(1, 32))


def test_smoothing_never_in_place_and_exact_identity():
    k = torch.randn(2, 3, 37, 16)
    q = torch.randn(2, 3, 300, 16)
    k0, q0 = k.clone(), q.clone()
    ks, mean = Q.smooth_k(k)
    qs, qbar = Q.smooth_q_blocks(q, 128)
    assert torch.equal(k, k0) and torch.equal(q, q0)
    assert torch.allclose(ks.mean(-2), torch.zeros(2, 3, 16), atol=1e-6)
    assert qbar.shape == (2, 3, 3, 16)
    assert torch.allclose(qbar[:, :, 2], q[:, :, 256:].mean(-2), atol=1e-6)  # ragged last block
    s_full = q @ ks.transpose(-1, -2)
    s_split = qs @ ks.transpose(-1, -2) + (qbar @ ks.transpose(-1, -2)).repeat_interleave(128, 2)[:, :, :300]
    assert torch.allclose(s_full, s_split, atol=1e-4)


def test_smoothed_amax_is_the_amax_of_the_smoothed_tensor_bit_for_bit():
    """max/min of k then the mean subtracted = amax |k - mean| exactly (rounding is monotonic), with
    outlier channels, a constant channel (mean rounding past its values) and NaN."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, 3, 777, 64, generator=g).bfloat16()
    k[..., 3] += 40
    k[..., 5] = 0.1  # all equal: fl(mean) may differ from the values, |k - mean| is one tiny number
    k[1, 2, 100, 7] = float("nan")
    ksm, mean = Q.smooth_k(k)
    want = ksm.abs().amax(dim=-2, keepdim=True)
    got = Q.smoothed_amax(k, mean)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == 1
    assert torch.equal(got.nan_to_num(-1).view(torch.int32), want.nan_to_num(-1).view(torch.int32))
