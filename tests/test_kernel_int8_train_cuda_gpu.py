"""The CUDA sm90 SageBwd kernels (csrc/int8_train_sm90.cu: forward, dK/dV and dQ, SAGE_COMPILE_INT8_TRAIN_CORE=cuda)
on the GPU: they must have built (no silent fallback); O, LSE, dQ, dK, dV agree with the Triton kernels' (same
quantized sets, fp32 sums in another order) and are as close to fp32 (error ratio), over head dims, causal kinds,
GQA, token counts that are not multiples of the tiles (64 / 128 queries, 64 / 128 keys), bf16 and fp16; issue 5's
gradient goal holds with every kernel on CUDA; a token count they do not take falls back to Triton exactly."""
import pytest
import torch
import torch.nn.functional as F
from helpers import cos_rel, llm_step, poison_cuda_cache, train_launches

import sage_compile

pytestmark = pytest.mark.gpu

CASES = [  # (d, causal, B, Hq, Hkv, Lq, Lk, dtype)
    (128, "none", 2, 8, 2, 2048, 2048, torch.bfloat16),
    (128, "top_left", 2, 8, 2, 2048, 2048, torch.bfloat16),
    (64, "none", 2, 8, 2, 2048, 2048, torch.bfloat16),
    (64, "top_left", 1, 4, 4, 1024, 1024, torch.float16),
    (128, "bottom_right", 2, 4, 2, 1008, 1040, torch.bfloat16),  # Lq not a multiple of 64 (nor 128), Lk of 128
    (64, "none", 1, 6, 3, 496, 1504, torch.float16),
    (128, "bottom_right", 1, 2, 1, 592, 1040, torch.bfloat16),  # fewer queries than keys
]


def _backward(core, monkeypatch, qt, o, lse, do, causal, dtype):
    from sage_compile.kernels.int8_train import attention as KA

    monkeypatch.setenv("SAGE_COMPILE_INT8_TRAIN_CORE", core)
    poison_cuda_cache()
    return KA.backward(*qt, o, lse, do, causal, None, "HND", dtype, psi="split")


def _grads_fp32(q, k, v, causal, do):
    qq, kk, vv = (t.detach().float().requires_grad_() for t in (q, k, v))
    lq, lk = q.shape[2], k.shape[2]
    mask = None
    if causal != "none":
        off = 0 if causal == "top_left" else lk - lq
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(off)
    o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)
    return torch.autograd.grad(o, (qq, kk, vv), do.float())


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}-{c[1]}-{c[5]}x{c[6]}-{str(c[7])[6:]}")
def test_cuda_dkdv_matches_triton(case, monkeypatch):
    from sage_compile.kernels.int8_train import attention as KA
    from sage_compile.kernels.int8_train import cuda
    from sage_compile.kernels.int8_train import quantize as KQ

    d, causal, b, hq, hkv, lq, lk, dtype = case
    g = torch.Generator().manual_seed(d + lq)
    q = torch.randn(b, hq, lq, d, generator=g).cuda().to(dtype)
    k, v = (torch.randn(b, hkv, lk, d, generator=g).cuda().to(dtype) for _ in range(2))
    do = torch.randn(b, hq, lq, d, generator=g).cuda().to(dtype)
    qt = KQ.quantize(q, k, v)
    o, lse = KA.forward(*qt[:6], causal, None, "HND", dtype)
    tri = _backward("triton", monkeypatch, qt, o, lse, do, causal, dtype)
    got = _backward("cuda", monkeypatch, qt, o, lse, do, causal, dtype)
    assert cuda.status()["built"], cuda.status()  # the CUDA kernel ran, not a fallback
    want = _grads_fp32(q, k, v, causal, do)
    line = []
    for n, a, t, w in zip(("dq", "dk", "dv"), got, tri, want):
        assert a.shape == t.shape and a.dtype == t.dtype and torch.isfinite(a).all(), n
        same = cos_rel(a.float(), t.float())
        ka, kt = cos_rel(a.float(), w), cos_rel(t.float(), w)
        line.append(f"{n} vs triton {same[0]:.6f}/{same[1]:.5f}, vs fp32 cuda {ka[1]:.5f} triton {kt[1]:.5f}")
        assert same[0] > 0.9999 and same[1] < 0.01, (n, same)
        assert ka[1] <= 1.05 * kt[1] + 1e-3, (n, ka, kt)
    print(f"\nint8_train cuda backward {case[:7]}: " + "; ".join(line))


def test_query_count_it_does_not_take_falls_back_exactly(monkeypatch):
    from sage_compile.kernels.int8_train import attention as KA
    from sage_compile.kernels.int8_train import quantize as KQ

    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, 2, 777, 64, generator=g).cuda().bfloat16() for _ in range(4))
    qt = KQ.quantize(q, k, v)
    o, lse = KA.forward(*qt[:6], "none", None, "HND", torch.bfloat16)
    tri = _backward("triton", monkeypatch, qt, o, lse, do, "none", torch.bfloat16)
    got = _backward("cuda", monkeypatch, qt, o, lse, do, "none", torch.bfloat16)
    for a, t in zip(got, tri):
        assert torch.equal(a, t)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}-{c[1]}-{c[5]}x{c[6]}-{str(c[7])[6:]}")
def test_cuda_forward_matches_triton(case, monkeypatch):
    from sage_compile.kernels.int8_train import attention as KA
    from sage_compile.kernels.int8_train import cuda
    from sage_compile.kernels.int8_train import quantize as KQ

    d, causal, b, hq, hkv, lq, lk, dtype = case
    g = torch.Generator().manual_seed(7 * d + lk)
    q = torch.randn(b, hq, lq, d, generator=g).cuda().to(dtype)
    k, v = (torch.randn(b, hkv, lk, d, generator=g).cuda().to(dtype) for _ in range(2))
    qt = KQ.quantize(q, k, v)
    res = {}
    for core in ("triton", "cuda"):
        monkeypatch.setenv("SAGE_COMPILE_INT8_TRAIN_CORE", core)
        poison_cuda_cache()
        res[core] = KA.forward(*qt[:6], causal, None, "HND", dtype)
    assert cuda.status()["built"], cuda.status()
    (o, lse), (ot, lset) = res["cuda"], res["triton"]
    assert o.shape == ot.shape and o.dtype == ot.dtype and torch.isfinite(o).all()
    same = cos_rel(o.float(), ot.float())
    assert same[0] > 0.99999 and same[1] < 0.005, same
    assert torch.allclose(lse, lset, rtol=1e-5, atol=1e-4), (lse - lset).abs().max()
    off = 0 if causal == "top_left" else lk - lq
    mask = None if causal == "none" else torch.ones(lq, lk, dtype=torch.bool, device="cuda").tril(off)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    kc, kt = cos_rel(o.float(), ref), cos_rel(ot.float(), ref)
    assert kc[1] <= 1.05 * kt[1] + 1e-4, (kc, kt)
    print(f"\nint8_train cuda forward {case[:7]}: vs triton {same[0]:.7f}/{same[1]:.5f}; vs fp32 cuda {kc[1]:.5f} "
          f"triton {kt[1]:.5f}")


@pytest.mark.parametrize("d", [64, 128])
def test_token_major_layout_gives_the_same_values(d, monkeypatch):
    """O and dQ, dK, dV written in (B, N, H, D) ("NHD": what the layout pass hands over when the model's
    tensors are token-major) through the kernels' output strides: the (B, H, N, D) values, bit for bit."""
    from sage_compile.kernels.int8_train import attention as KA
    from sage_compile.kernels.int8_train import cuda
    from sage_compile.kernels.int8_train import quantize as KQ

    monkeypatch.setenv("SAGE_COMPILE_INT8_TRAIN_CORE", "cuda")
    g = torch.Generator().manual_seed(11 + d)
    q, do = (torch.randn(1, 4, 320, d, generator=g).cuda().bfloat16() for _ in range(2))
    k, v = (torch.randn(1, 2, 384, d, generator=g).cuda().bfloat16() for _ in range(2))
    qt = KQ.quantize(q, k, v)
    o, lse = KA.forward(*qt[:6], "bottom_right", None, "HND", torch.bfloat16)
    on, lsen = KA.forward(*qt[:6], "bottom_right", None, "NHD", torch.bfloat16)
    assert cuda.status()["built"], cuda.status()
    assert on.shape == (1, 320, 4, d) and torch.equal(on.transpose(1, 2), o) and torch.equal(lsen, lse)
    got = KA.backward(*qt, o, lse, do, "bottom_right", None, "HND", torch.bfloat16, psi="split")
    gotn = KA.backward(*qt, on, lsen, do.transpose(1, 2).contiguous(), "bottom_right", None, "NHD", torch.bfloat16,
                       psi="split")
    for n, a, an in zip(("dq", "dk", "dv"), got, gotn):
        assert an.shape == (a.shape[0], a.shape[2], a.shape[1], d), n
        assert torch.equal(an.transpose(1, 2), a), n


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", ["none", "top_left"])
def test_gradient_goal_on_the_cuda_kernels(d, causal, monkeypatch):
    """Issue 5's goal with the forward and the backward on the CUDA kernels: dQ, dK, dV cos >= 0.998 vs fp32
    autograd on gaussian inputs (N=2048, GQA 8/2)."""
    from sage_compile.kernels.int8_train import attention as KA
    from sage_compile.kernels.int8_train import quantize as KQ

    monkeypatch.setenv("SAGE_COMPILE_INT8_TRAIN_CORE", "cuda")
    g = torch.Generator().manual_seed(d)
    q = torch.randn(2, 8, 2048, d, generator=g).cuda().bfloat16()
    k, v = (torch.randn(2, 2, 2048, d, generator=g).cuda().bfloat16() for _ in range(2))
    do = torch.randn(2, 8, 2048, d, generator=g).cuda().bfloat16()
    qt = KQ.quantize(q, k, v)
    o, lse = KA.forward(*qt[:6], causal, None, "HND", torch.bfloat16)
    got = KA.backward(*qt, o, lse, do, causal, None, "HND", torch.bfloat16, psi="split")
    want = _grads_fp32(q, k, v, causal, do)
    res = {n: cos_rel(a.float(), w) for n, a, w in zip(("dq", "dk", "dv"), got, want)}
    print(f"\nint8_train all-CUDA d={d} {causal}: " + "  ".join(f"{n} {c:.5f}/{r:.4f}" for n, (c, r) in res.items()))
    for n, (c, _) in res.items():
        assert c >= 0.998, (n, res[n])


@pytest.mark.parametrize("core", ["cuda", None], ids=["cuda", "default"])
@pytest.mark.parametrize("prologue", ["auto", "op"])
def test_compiled_llm_trains_on_the_cuda_kernels(core, prologue, monkeypatch):
    """TinyLlama (causal GQA, head dim 64, 512 tokens) trained through backend="sage"
    with kernel="int8_train", SAGE_COMPILE_INT8_TRAIN_CORE=cuda and unset (the default, ``auto``), with the traced ops
    (``prologue="auto"`` on CUDA) and the opaque ones (``op``): every site's forward and backward run on the CUDA
    kernels (their launches counted in a profiled step); loss and gradients close to exact."""
    if core is None:
        monkeypatch.delenv("SAGE_COMPILE_INT8_TRAIN_CORE", raising=False)
    else:
        monkeypatch.setenv("SAGE_COMPILE_INT8_TRAIN_CORE", core)
    torch.manual_seed(0)
    model = sage_compile.models.TinyLlama(dim=256, heads=4, kv_heads=2, depth=2).cuda()  # head dim 64
    ids = torch.randint(0, 512, (2, 513), device="cuda")
    ref, ref_grads = llm_step(model, ids)
    cm = torch.compile(model, backend=sage_compile.make_backend(kernel="int8_train", prologue=prologue))
    llm_step(cm, ids)  # compiles
    (loss, g), calls = train_launches(lambda: llm_step(cm, ids))
    assert calls == {"fwd_kernel": 2, "dkdv_kernel": 2, "dq_kernel": 2}, calls
    assert abs(loss.item() - ref.item()) < 0.01 * ref.item()
    assert F.cosine_similarity(g, ref_grads, dim=0) > 0.99


@pytest.mark.parametrize("core", ["cuda", "triton"])
def test_bool_causal_mask_step_captures_in_a_cuda_graph(core, monkeypatch):
    """transformers' bool causal mask (B, 1, N, N, what it builds under compile) on the training op: its structure is
    decided on the device, so a CUDA graph captures the op's forward and backward (a host sync fails a capture),
    and the graph's replay gives the eager step's O and gradients bit for bit; those are the causal rule's (bit for
    bit on the CUDA kernels; on Triton's the gated launches have a fixed configuration, the rule's an autotuned one)."""
    from sage_compile.kernels.int8_train import cuda

    monkeypatch.setenv("SAGE_COMPILE_INT8_TRAIN_CORE", core)
    g = torch.Generator().manual_seed(3)
    b, hq, hkv, n, d = 2, 8, 2, 1024, 64
    q = torch.randn(b, hq, n, d, generator=g).cuda().to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(b, hkv, n, d, generator=g).cuda().to(torch.bfloat16).requires_grad_() for _ in range(2))
    do = torch.randn(b, hq, n, d, generator=g).cuda().to(torch.bfloat16)
    mask = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()[None, None].expand(b, 1, n, n)
    op = torch.ops.sage_compile.attention_train

    def step(m, causal, leaves=(q, k, v)):
        o = op(*leaves, m, causal, None, "HND", "split")[0]
        return (o, *torch.autograd.grad(o, leaves, do))

    rule = step(None, "top_left")
    eager = step(mask, "none")
    if core == "cuda":
        assert cuda.status()["built"], cuda.status()
        assert all(torch.equal(a, r) for a, r in zip(eager, rule))
    else:
        assert all(cos_rel(a.float(), r.float())[0] > 0.99999 for a, r in zip(eager, rule))
    # the captured step's leaves are made, warmed up and captured on one side stream: autograd keeps the stream a
    # leaf was first used on, and a leaf first used on the default stream breaks any capture of its backward
    # (pytorch/pytorch#164302), whatever the op
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        leaves = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
        for _ in range(2):
            step(mask, "none", leaves)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            captured = step(mask, "none", leaves)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, r) for a, r in zip(captured, eager))


PADDED = {  # name: (d, B, Hq, Hkv, Lq, Lk, causal, {batch: kept keys [lo, hi)})
    # causal bottom-right, batch 0 right-padded mid-step, batch 1 left-padded (its first 300 rows see no key),
    # batch 2 whole; GQA
    "causal_d128": (128, 3, 8, 2, 1040, 1040, True, {0: (0, 700), 1: (300, 1040)}),
    # a (B, 1, 1, Lk) key mask: batch 0 left-padded, batch 1 keeps the first 333 keys (whole dK/dV key blocks
    # past them: no steps, zeros stored); fewer queries than keys
    "keys_d64": (64, 2, 4, 4, 512, 1536, False, {0: (200, 1536), 1: (0, 333)}),
}


@pytest.mark.parametrize("name", PADDED)
def test_padded_bool_mask_on_the_cuda_kernels_matches_triton(name, monkeypatch):
    """A bool mask with key padding (a padded batch) on the CUDA kernels, which read each batch's key range from the
    device-side check and skip the key steps outside it, against the Triton kernels reading the mask in-kernel: O,
    LSE (rows without keys -inf in both), dQ, dK, dV agree, and are as close to fp32 attention under the mask. The
    check's word 1 names the structure, so the mask-reading launch beside the CUDA ones left at once."""
    from sage_compile.kernels._common import mask_view
    from sage_compile.kernels.int8_train import attention as KA
    from sage_compile.kernels.int8_train import cuda
    from sage_compile.kernels.int8_train import quantize as KQ

    d, b, hq, hkv, lq, lk, causal, kept = PADDED[name]
    keep = torch.ones(b, lk, dtype=torch.bool, device="cuda")
    for i, (lo, hi) in kept.items():
        keep[i, :lo] = False
        keep[i, hi:] = False
    if causal:
        mask = (keep[:, None, :] & torch.ones(lq, lk, dtype=torch.bool, device="cuda").tril(lk - lq))[:, None]
    else:
        mask = keep[:, None, None, :].expand(b, 1, lq, lk)
    g = torch.Generator().manual_seed(d + lq)
    q, do = (torch.randn(b, hq, lq, d, generator=g).cuda().bfloat16() for _ in range(2))
    k, v = (torch.randn(b, hkv, lk, d, generator=g).cuda().bfloat16() for _ in range(2))
    gate = KA.mask_gate(mask_view(mask, b, hq, lq, lk, q)[0], b, lq, lk)
    assert gate[:2].tolist() == [0, 1 if causal else 2], gate
    qt = KQ.quantize(q, k, v)
    res = {}
    for core in ("triton", "cuda"):
        monkeypatch.setenv("SAGE_COMPILE_INT8_TRAIN_CORE", core)
        o, lse = KA.forward(*qt[:6], "none", None, "HND", torch.bfloat16, attn_mask=mask)
        res[core] = (o, lse, *KA.backward(*qt, o, lse, do, "none", None, "HND", torch.bfloat16, attn_mask=mask,
                                          psi="split"))
    assert cuda.status()["built"], cuda.status()
    (o, lse, *got), (ot, lset, *tri) = res["cuda"], res["triton"]
    fin = torch.isfinite(lset)
    assert torch.equal(torch.isfinite(lse), fin) and bool((~fin).any()) == causal
    assert torch.allclose(lse[fin], lset[fin], rtol=1e-5, atol=1e-4)
    qq, kk, vv = (t.float().requires_grad_() for t in (q, k, v))
    s = (qq @ kk.repeat_interleave(hq // hkv, 1).transpose(-1, -2) * d ** -0.5).masked_fill(~mask, float("-inf"))
    alive = torch.isfinite(s).any(-1, keepdim=True)
    ref = (torch.softmax(torch.where(alive, s, 0.0), -1) * alive) @ vv.repeat_interleave(hq // hkv, 1)
    want = (ref, *torch.autograd.grad(ref, (qq, kk, vv), do.float()))
    line = []
    for n, a, t, w in zip(("o", "dq", "dk", "dv"), (o, *got), (ot, *tri), want):
        assert a.shape == t.shape and torch.isfinite(a).all(), n
        same, ka, kt = cos_rel(a.float(), t.float()), cos_rel(a.float(), w), cos_rel(t.float(), w)
        line.append(f"{n} vs triton {same[0]:.6f}/{same[1]:.5f}, vs fp32 cuda {ka[1]:.5f} triton {kt[1]:.5f}")
        assert same[0] > 0.9999 and same[1] < 0.01, (n, same)
        assert ka[1] <= 1.05 * kt[1] + 1e-3, (n, ka, kt)
    for i, (lo, hi) in kept.items():  # padded keys: no gradient
        assert all((x[i, :, :lo] == 0).all() and (x[i, :, hi:] == 0).all() for x in got[1:]), i
    print(f"\nint8_train cuda padded mask {name}: " + "; ".join(line))
