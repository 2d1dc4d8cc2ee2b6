"""int8_train (SageBwd) Triton kernels on CPU under TRITON_INTERPRET=1 (small shapes): the prologue is
bit-identical to the reference; forward and backward agree with the reference to accumulation noise, and
their gradient error vs fp32 autograd is the reference's (conventions.md rule 2: error ratio)."""
import os

import pytest
import torch
from helpers import bits, check_bwd_prep, cos_rel

if torch.cuda.is_available():
    pytest.skip("GPU machine: the kernels are tested compiled (test_kernel_int8_train_gpu.py)", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from sage_compile.kernels.int8_train import attention as KA  # noqa: E402
from sage_compile.kernels.int8_train import quantize as KQ  # noqa: E402
from sage_compile.reference import int8_train as R  # noqa: E402
from sage_compile.reference.quant import quant_int8  # noqa: E402

if not KQ.EMULATE_FP8:
    pytest.skip("kernels were imported before TRITON_INTERPRET was set", allow_module_level=True)


def _inputs(b=1, hq=4, hkv=2, lq=200, lk=150, d=64, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g)
    k = torch.randn(b, hkv, lk, d, generator=g) + 2 * torch.randn(b, hkv, 1, d, generator=g)
    v = torch.randn(b, hkv, lk, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def test_prologue_bit_identical_and_nhd_in_place():
    q, k, v = _inputs(lq=300, lk=130, d=80)
    q[0, 1, 130:140] = 0  # zero rows inside a block
    k[0, 0, 64:128] = 0  # a whole zero K block (after smoothing: minus the mean)
    v[0, 1, :64] = 0  # a zero V block: scale 0, values 0
    k[0, 1, 3, :2] = 1e4  # an outlier token
    got, want = KQ.quantize(q, k, v), list(R.quantize(q, k, v))
    _assert_prologue_equal(got, want, k)
    assert (got[5][0, 1, 0] == 0) and (got[4][0, 1, :64] == 0).all()
    # NHD read in place: the same tuple (a smaller case: the interpreter's NaN-propagating maxima run per element)
    q, k, v = _inputs(hq=2, hkv=1, lq=140, lk=70, d=80, seed=1)
    nhd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    for a, b in zip(KQ.quantize(*nhd, layout="NHD"), KQ.quantize(q, k, v)):
        assert torch.equal(a, b)
    # the forward's prologue: the same tuple and V̂ transposed, in one launch for Q, K and V, whichever of Q's and
    # K's block counts is larger (here 1 Q block, 3 K blocks; then 3 and 1)
    for lq, lk in ((100, 130), (300, 40)):
        q, k, v = _inputs(hq=2, hkv=1, lq=lq, lk=lk, d=80, seed=lq)
        qt, v8t = KQ.quantize_vt(q, k, v)
        _assert_prologue_equal(list(qt), list(R.quantize(q, k, v)), k)
        assert v8t.is_contiguous() and torch.equal(v8t, qt[4].transpose(2, 3))


def _assert_prologue_equal(got, want, k):
    """The kernels' prologue equals the reference's bit for bit, K given the kernels' mean."""
    # the token mean may differ by summation order (conventions.md rule 1): K is compared given the kernel's
    mean = got[6]
    assert torch.allclose(mean, want[6], rtol=1e-6, atol=1e-6)
    want[2], want[3] = quant_int8(k.float() - mean, 64)
    want[6] = mean
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.dtype == torch.float32:  # (NaN scales compared by their bits)
            a, b = a.view(torch.int32), b.view(torch.int32)
        assert torch.equal(bits(a), bits(b))


def test_prologue_blocks_with_nan_inf_and_tiny_scales():
    """Blocks whose scale is NaN, inf or below the reciprocal path's range take the IEEE division: the same
    bits as the reference (NaN and inf in the scale, the block's finite values 0 under an inf scale)."""
    q, k, v = _inputs(lq=260, lk=200, d=64, seed=3)
    q[0, 0, 5, 7] = float("nan")  # Q block 0 of head 0: NaN scale
    v[0, 1, 70, 3] = float("inf")  # V block 1 of kv head 1: inf scale
    q[0, 2, 128:256] *= 1e-20  # a Q block with a scale under 2^-60
    v[0, 0, 128:192] = 3e38  # a V block with a scale above 2^60
    got, want = KQ.quantize(q.float(), k.float(), v.float()), list(R.quantize(q.float(), k.float(), v.float()))
    assert got[1][0, 0, 0].isnan() and got[5][0, 1, 1].isinf() and 0 < got[1][0, 2, 1] < 2.0 ** -60 < 2.0 ** 60 < got[5][0, 0, 2]
    _assert_prologue_equal(got, want, k.float())


CASES = {
    "causal_gqa_ragged": dict(causal="top_left", lq=200, lk=200),
    "bottom_right_lq_lt_lk": dict(causal="bottom_right", lq=100, lk=230),
    "bottom_right_lq_gt_lk": dict(causal="bottom_right", lq=230, lk=100),  # first rows see no key
    "none_mqa_hd80": dict(causal="none", lq=150, lk=190, hkv=1, d=80),
    "nhd_fp16": dict(causal="top_left", lq=140, lk=140, layout="NHD", dtype=torch.float16),
    "bool_mask": dict(causal="none", lq=150, lk=150, mask="bool"),
    "additive_mask": dict(causal="none", lq=150, lk=150, mask="additive"),
    "causal_even": dict(causal="top_left", lq=256, lk=256),  # lengths multiples of every tile
}


def _case(name):
    c = dict(CASES[name])
    causal, layout, mask = c.pop("causal"), c.pop("layout", "HND"), c.pop("mask", None)
    q, k, v = _inputs(**c, seed=len(name))
    lq, lk = q.shape[2], k.shape[2]
    g = torch.Generator().manual_seed(7)
    if mask == "bool":
        mask = torch.rand(q.shape[0], 1, lq, lk, generator=g) > 0.3
        mask[..., :3] = True  # no empty row
    elif mask == "additive":
        mask = torch.randn(q.shape[0], q.shape[1], lq, lk, generator=g)
    if layout == "NHD":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return q, k, v, mask, causal, layout


def _exact_grads(q, k, v, mask, causal, layout, do):
    """fp32 autograd of SDPA (the truth) in ``layout``."""
    t = (lambda x: x) if layout == "HND" else (lambda x: x.transpose(1, 2))
    qq, kk, vv = (x.detach().float().requires_grad_() for x in (q, k, v))
    lq, lk = t(qq).shape[2], t(kk).shape[2]
    vis = None
    if causal != "none":
        off = 0 if causal == "top_left" else lk - lq
        vis = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + off
    m = mask if vis is None else vis
    if m is not None and m.dtype == torch.bool:
        m = torch.where(m, 0.0, float("-inf"))
    s = (t(qq) @ t(kk).repeat_interleave(t(qq).shape[1] // t(kk).shape[1], 1).transpose(-1, -2)) * t(qq).shape[-1] ** -0.5
    if m is not None:
        s = s + m
    alive = torch.isfinite(s).any(-1, keepdim=True)  # rows without a visible key output 0
    p = torch.softmax(torch.where(alive, s, 0.0), -1) * alive
    o = p @ t(vv).repeat_interleave(t(qq).shape[1] // t(kk).shape[1], 1)
    return t(o).detach(), torch.autograd.grad(t(o), (qq, kk, vv), do.float())


# cases whose features other cases of the default run cover (the other psi, the other bottom-right shape): in the
# long matrices only (-m slow), for the CPU suite's time
SLOW_CASES = {("bottom_right_lq_lt_lk", "tile"), ("bool_mask", "tile"), ("causal_even", "tile"),
              ("bottom_right_lq_gt_lk", "split"), ("none_mqa_hd80", "split")}


SPLIT_CASES = ("causal_gqa_ragged", "bottom_right_lq_gt_lk", "bool_mask", "none_mqa_hd80", "causal_even")


@pytest.mark.parametrize("name,psi", [
    pytest.param(n, psi, marks=[pytest.mark.slow] if (n, psi) in SLOW_CASES else [])
    for n, psi in [(n, "tile") for n in CASES] + [(n, "split") for n in SPLIT_CASES]])
def test_forward_and_backward_match_reference(name, psi):
    q, k, v, mask, causal, layout = _case(name)
    got_q, want_q = KQ.quantize(q, k, v, layout), R.quantize(q, k, v, layout)
    o, lse = KA.forward(*got_q[:6], causal, None, layout, q.dtype, attn_mask=mask)
    ro, rlse = R.forward(*want_q[:6], causal, None, layout, q.dtype, attn_mask=mask)
    assert o.shape == ro.shape == q.shape and o.dtype == q.dtype
    assert torch.equal(torch.isfinite(lse), torch.isfinite(rlse))  # rows without keys: -inf in both
    fin = torch.isfinite(rlse)
    assert (lse[fin] - rlse[fin]).abs().max() < 1e-4
    assert cos_rel(o.float(), ro.float())[1] < 0.01
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    exact_o, want = _exact_grads(q, k, v, mask, causal, layout, do)
    got = KA.backward(*got_q, o, lse, do, causal, None, layout, q.dtype, attn_mask=mask, psi=psi)
    ref = R.backward(*want_q, ro, rlse, do, causal, None, layout, q.dtype, attn_mask=mask, psi=psi)
    for name_, a, r, w in zip("qkv", got, ref, want):
        assert a.shape == r.shape == w.shape and a.dtype == q.dtype and torch.isfinite(a).all(), name_
        ka, kr = cos_rel(a.float(), w), cos_rel(r.float(), w)
        # the kernel's error vs fp32 autograd is the reference's (same ψ tiles, other summation order)
        assert ka[1] <= 1.1 * kr[1] + 1e-3 and ka[0] >= kr[0] - 1e-3, (name_, ka, kr)
        # same ψ sets: kernel and reference agree far closer than either agrees with fp32
        assert cos_rel(a.float(), r.float())[1] < 0.4 * kr[1], (name_, cos_rel(a.float(), r.float()), kr)


def test_split_key_block_is_not_part_of_the_numerics():
    """psi="split"'s dK/dV kernel runs 128 keys per program on 8 warps or 64 on 4 (the autotuner's choice):
    the same gradients bit for bit."""
    q, k, v, mask, causal, layout = _case("causal_gqa_ragged")
    qt = KQ.quantize(q, k, v)
    o, lse = KA.forward(*qt[:6], causal, None, layout, q.dtype)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(3)).to(q.dtype)
    g128 = KA.backward(*qt, o, lse, do, causal, None, layout, q.dtype, psi="split")
    g64 = KA.backward(*qt, o, lse, do, causal, None, layout, q.dtype, psi="split", config={"BLOCK_N": 64})
    assert all(torch.equal(a, b) for a, b in zip(g128, g64))


def test_split_dkdv_two_passes_equal_one(monkeypatch):
    """At the head dims of ``DKDV_TWO_PASS`` the split dK/dV runs as a dV pass and a dK pass (each
    recomputing S and P): the same gradients bit for bit as the one-pass kernel, at hd128 and hd64."""
    for d in (128, 64):
        q, k, v = _inputs(lq=80, lk=72, d=d, seed=d)
        qt = KQ.quantize(q, k, v)
        o, lse = KA.forward(*qt[:6], "bottom_right", None, "HND", q.dtype)
        do = torch.randn(o.shape, generator=torch.Generator().manual_seed(5)).to(q.dtype)
        grads = {}
        for two in (False, True):
            monkeypatch.setattr(KA, "DKDV_TWO_PASS", frozenset({d}) if two else frozenset())
            assert KA._dkdv_parts(d) == ((1, 2) if two else (0,))
            grads[two] = KA.backward(*qt, o, lse, do, "bottom_right", None, "HND", q.dtype, psi="split")
        assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True])), d


def _no_host_sync(monkeypatch):
    """Reading a tensor's value on the host raises from here on (as it cannot under CUDA-graph capture)."""
    def refuse(*a, **k):
        raise AssertionError("host sync")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


MASKS = {  # name: (the mask (B, 1, Lq | 1, Lk) bool, the rule it is, or None: it is read)
    "causal": lambda lq, lk: torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)[None, None].expand(2, 1, lq, lk),
    "all_true": lambda lq, lk: torch.ones(2, 1, lq, lk, dtype=torch.bool),
    "key_mask": lambda lq, lk: torch.ones(2, 1, 1, lk, dtype=torch.bool),
    "padded_causal": lambda lq, lk: _padded(torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq), 20),
}


def _padded(m, n):
    """(B=2, 1, Lq, Lk): ``m`` for both batches, the last ``n`` keys masked in the second (key padding)."""
    m = m[None, None].repeat(2, 1, 1, 1)
    m[1, :, :, -n:] = False
    return m
RULE = {"causal": "bottom_right", "all_true": "none", "key_mask": "none", "padded_causal": None}


@pytest.mark.parametrize("name", MASKS)
def test_bool_mask_structure_decided_on_the_device(name, monkeypatch):
    """A head-shared bool mask is checked on the device, not on the host (no host sync: CUDA graphs can capture
    a training step, and the stream never waits): exactly causal (what transformers builds under compile) or all
    true runs the kernels of that rule, the same outputs and gradients bit for bit; any other mask is read, the
    same bits as the mask given per head (which no check looks at)."""
    lq, lk = 64, 100
    g = torch.Generator().manual_seed(len(name))
    q = torch.randn(2, 2, lq, 32, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 1, lk, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    do = torch.randn(2, 2, lq, 32, generator=g).to(torch.bfloat16)
    qt = KQ.quantize(q, k, v)
    mask = MASKS[name](lq, lk)
    rule = RULE[name]
    if rule is None:
        want_args = ("none", mask.expand(2, 2, -1, -1).contiguous())  # head stride != 0: read, never checked
    else:
        want_args = (rule, None)
    o1, l1 = KA.forward(*qt[:6], want_args[0], None, "HND", q.dtype, attn_mask=want_args[1])
    g1 = {psi: KA.backward(*qt, o1, l1, do, want_args[0], None, "HND", q.dtype, attn_mask=want_args[1], psi=psi)
          for psi in ("split", "tile")}
    _no_host_sync(monkeypatch)
    o2, l2 = KA.forward(*qt[:6], "none", None, "HND", q.dtype, attn_mask=mask)
    g2 = {psi: KA.backward(*qt, o1, l1, do, "none", None, "HND", q.dtype, attn_mask=mask, psi=psi)
          for psi in ("split", "tile")}
    monkeypatch.undo()
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    for psi in g1:
        assert all(torch.equal(a, b) for a, b in zip(g1[psi], g2[psi])), psi


@pytest.mark.parametrize("shape", [(2, 3, 130, 64), (1, 2, 77, 80), (1, 1, 256, 128)])
def test_tokens_last_is_the_transpose(shape):
    """The tiled (B, H, N, D) -> (B, H, D, N) copy of the INT8 operands: exactly torch's transpose, ragged N,
    head dims below the tile's."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    y = KQ.tokens_last(x)
    assert y.shape == (*shape[:2], shape[3], shape[2]) and y.is_contiguous()
    assert torch.equal(y, x.transpose(2, 3))
    assert torch.equal(KQ.tokens_last(x[:, :, :5]), x[:, :, :5].transpose(2, 3))  # a non-contiguous input


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lq, lk, d, layout", [(130, 77, 80, "HND"), (60, 200, 64, "NHD")])
def test_bwd_prep_is_torchs_bit_for_bit(lq, lk, d, layout, dtype, split, monkeypatch):
    """The backward's preparation launch: transposes, V̂ in 16 bits, dO, delta, LSE2, ψ(dO) (helpers.check_bwd_prep),
    more query blocks than key blocks and fewer, head dims below the tile's, O and dO read through NHD strides; in
    one launch and in two (``PREP_SPLIT_MIN_ELEMENTS``: dO's programs, then the others). An HND dO of the 16-bit type
    is read in place (no copy), an NHD one is copied to HND."""
    monkeypatch.setattr(KA, "PREP_SPLIT_MIN_ELEMENTS", 0 if split else None)
    p = check_bwd_prep(KA, "cpu", dtype, lq=lq, lk=lk, d=d, layout=layout, seed=lq)
    assert (p["do16"].shape == p["delta"].shape + (d,)) and p["do16"].is_contiguous()


def test_bwd_prep_copies_do_it_cannot_read_in_place():
    """dO is read in place only where the kernels can take it as their operand: HND, contiguous, the 16-bit type,
    16-byte aligned; otherwise the preparation writes the copy (the same values)."""
    b, h, n, d = 1, 2, 40, 64
    do = torch.randn(b, h, n, d).to(torch.bfloat16)
    assert KA.reads_do_in_place(do, "HND", torch.bfloat16)
    assert not KA.reads_do_in_place(do, "NHD", torch.bfloat16)
    assert not KA.reads_do_in_place(do, "HND", torch.float16)
    assert not KA.reads_do_in_place(do.transpose(2, 3).contiguous().transpose(2, 3), "HND", torch.bfloat16)
    shifted = torch.randn(b * h * n * d + 3).to(torch.bfloat16)[3:].view(b, h, n, d)  # 6 bytes past an aligned start
    assert shifted.is_contiguous() and not KA.reads_do_in_place(shifted, "HND", torch.bfloat16)
    q8 = torch.randint(-127, 128, (b, h, n, d), dtype=torch.int8)
    vs, o, lse = torch.rand(b, h, 1), torch.randn(b, h, n, d).to(torch.bfloat16), torch.randn(b, h, n)
    p = KA.bwd_prep(q8, q8, q8, vs, o, lse, shifted, "HND", torch.bfloat16)
    assert p["do16"].data_ptr() != shifted.data_ptr() and torch.equal(p["do16"], shifted)
    p = KA.bwd_prep(q8, q8, q8, vs, o, lse, do, "HND", torch.bfloat16)
    assert p["do16"] is do


@pytest.mark.parametrize("name", ["padded_causal", "key_mask"])
def test_bool_mask_handed_over_as_bool_gives_the_same_bits(name, monkeypatch):
    """A traced call hands a bool mask to the kernels as bool (``mask_view`` under ``in_graph``: Inductor cannot
    lower the uint8 view), an eager one as uint8: the device-side check and the kernels read both alike (``!= 0``;
    compiled Triton loads a bool pointer as bytes), so forward and backward give the same bits."""
    from sage_compile.kernels import _common

    lq, lk = 64, 100
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 2, lq, 32, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 1, lk, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    do = torch.randn(2, 2, lq, 32, generator=g).to(torch.bfloat16)
    qt = KQ.quantize(q, k, v)
    mask = MASKS[name](lq, lk)

    def run():
        o, lse = KA.forward(*qt[:6], "none", None, "HND", q.dtype, attn_mask=mask)
        return (o, lse, *KA.backward(*qt, o, lse, do, "none", None, "HND", q.dtype, attn_mask=mask, psi="split"))

    as_uint8 = run()
    assert _common.mask_view(mask, 2, 2, lq, lk, q)[0].dtype == torch.uint8
    monkeypatch.setattr(_common, "in_graph", lambda: True)  # (the interpreter's kernels are launched as they are)
    assert _common.mask_view(mask, 2, 2, lq, lk, q)[0].dtype == torch.bool
    as_bool = run()
    assert all(torch.equal(a, b) for a, b in zip(as_bool, as_uint8))


def test_mask_gate_op_names_the_masks_structure():
    """``sage_compile::train_mask_gate``, the traced ops' device-side check of a head-shared bool mask (one a graph):
    word 0 1 for causal bottom-right, 2 for all true, 0 where keys are padded out; word 1 the same within each batch's
    key range, which follows (the CUDA kernels read it); 0 and 0 for any other mask. The op passes ``opcheck``."""
    import sage_compile.ops  # noqa: F401  (registers the op)

    b, hq, lq, lk = 2, 4, 48, 80
    causal = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)[None, None].expand(b, 1, lq, lk)
    padded = causal.clone()
    padded[1, :, :, :5] = False  # batch 1 left-padded by 5 keys
    keys = torch.ones(b, 1, 1, lk, dtype=torch.bool)
    keys[0, ..., 60:] = False  # batch 0 right-padded to 60 keys, a key mask (B, 1, 1, Lk)
    other = torch.rand(b, 1, lq, lk, generator=torch.Generator().manual_seed(0)) > 0.3
    gate = torch.ops.sage_compile.train_mask_gate
    full = [0, lk, 0, lk]
    for mask, want in ((causal, [1, 1] + full), (torch.ones(b, 1, lq, lk, dtype=torch.bool), [2, 2] + full),
                       (padded, [0, 1, 0, lk, 5, lk]), (keys, [0, 2, 0, 60, 0, lk])):
        assert gate(mask, b, hq, lq, lk).tolist() == want
    assert gate(other, b, hq, lq, lk)[:2].tolist() == [0, 0]
    torch.library.opcheck(gate.default, (causal, b, hq, lq, lk))
