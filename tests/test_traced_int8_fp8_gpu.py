"""The traced ``int8_fp8`` ops (``sage_compile::quantize_int8_fp8_traced`` / ``attention_int8_fp8_traced``,
torch.library.triton_op) on the GPU: compiled, the graph holds their launches (no call of a sage_compile op in
Inductor's code) and the quantized tensors and the output are the opaque ops' bit for bit (the same kernels on the
same inputs, the same core), over causal rules, ragged lengths (K padded in the graph), both layouts, a structured
bool mask (decided on the device), an additive mask and dynamic shapes; a shape with no measured core choice is timed
while the call is traced, on real inputs, and keeps the choice the opaque op would use."""
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import sage_compile.ops  # noqa: F401  (registers the ops)

pytestmark = pytest.mark.gpu

OPS = torch.ops.sage_compile


def _inputs(b=2, hq=8, hkv=2, n=1024, d=128, layout="HND", seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (lambda h: (b, h, n, d)) if layout == "HND" else (lambda h: (b, n, h, d))
    q = torch.randn(shape(hq), generator=g)
    k, v = (torch.randn(shape(hkv), generator=g) for _ in range(2))
    k[..., 5] += 6  # a channel offset: K's mean matters
    return [t.cuda().to(torch.bfloat16) for t in (q, k, v)]


def _mask(kind, b, n):
    """None; a bool (B, 1, n, n) causal + key-padding mask (mask_structure's kind); an additive (B, 1, n, n) bias."""
    if kind is None:
        return None
    keep = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()[None, None].repeat(b, 1, 1, 1)
    keep[0, ..., : n // 8] = False  # batch 0: its first keys padded (left padding)
    if kind == "bool":
        return keep
    g = torch.Generator(device="cuda").manual_seed(3)
    return torch.randn(b, 1, n, n, device="cuda", generator=g).masked_fill(~keep, float("-inf")).to(torch.bfloat16)


def _call(quantize, attention, layout, causal):
    def f(q, k, v, mask):
        qt = quantize(q, k, v, layout, True)
        return (*qt, attention(*qt, mask, causal, None, layout, torch.bfloat16))
    return f


def _opaque(layout, causal):
    return _call(OPS.quantize_int8_fp8, OPS.attention_int8_fp8, layout, causal)


def _traced(layout, causal):
    return _call(OPS.quantize_int8_fp8_traced, OPS.attention_int8_fp8_traced, layout, causal)


CASES = [("none", None, "HND", 1024, 128), ("bottom_right", None, "HND", 1000, 128), ("top_left", None, "NHD", 777, 64),
         ("none", "bool", "HND", 512, 64), ("none", "additive", "HND", 384, 128)]


@pytest.mark.parametrize("causal,mask,layout,n,d", CASES, ids=lambda c: str(c))
def test_traced_ops_compiled_give_the_opaque_ops_bits(causal, mask, layout, n, d):
    torch._dynamo.reset()
    qkv = _inputs(n=n, d=d, layout=layout)
    m = _mask(mask, 2, n)
    want = _opaque(layout, causal)(*qkv, m)
    before = [t.clone() for t in qkv]
    got, code = run_and_get_code(torch.compile(_traced(layout, causal), fullgraph=True), *qkv, m)
    code = "\n".join(code)
    assert "triton_kernel" in code or "_quant_rows_int8" in code, "no Triton launch in Inductor's code"
    assert not re.search(r"torch\.ops\.sage_compile\.\w+", code), "a sage_compile op is called"
    for name, a, b in zip(("q8", "qs", "k8", "ks", "v8", "vs", "out"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), name
    assert all(torch.equal(a, b) for a, b in zip(qkv, before)), "an input was modified"


def test_traced_ops_with_k_on_its_capped_opaque_op_give_the_opaque_ops_bits(monkeypatch):
    """K_CAP_MIN_ELEMENTS lowered to 1: the compiled traced ops quantize K through ``quant_k_rows_capped`` (an op
    call in Inductor's code) and give the opaque ops' bits."""
    from sage_compile.kernels.int8_fp8 import quantize as QZ

    monkeypatch.setattr(QZ, "K_CAP_MIN_ELEMENTS", 1)
    torch._dynamo.reset()
    qkv = _inputs(n=1000, d=128)
    want = _opaque("HND", "none")(*qkv, None)
    got, code = run_and_get_code(torch.compile(_traced("HND", "none"), fullgraph=True), *qkv, None)
    torch._dynamo.reset()
    assert set(re.findall(r"torch\.ops\.sage_compile\.(\w+)", "\n".join(code))) == {"quant_k_rows_capped"}
    for name, a, b in zip(("q8", "qs", "k8", "ks", "v8", "vs", "out"), got, want):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), name


def test_traced_ops_eager_are_the_opaque_ops():
    qkv = _inputs(n=640)
    for a, b in zip(_traced("HND", "none")(*qkv, None), _opaque("HND", "none")(*qkv, None)):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


def test_unmeasured_shape_is_timed_while_traced(monkeypatch):
    """No choice known for the shape (no disk cache, the process's choices cleared): tracing the core times both
    cores on real inputs of the call's sizes and keeps the choice; the compiled output is then the opaque op's."""
    from sage_compile.kernels.int8_fp8 import cuda

    if cuda.unsupported(*_inputs(n=16, d=128)[:2], None, torch.bfloat16) is not None:
        pytest.skip(f"the CUDA core is unavailable: {cuda.status()['error']}")
    monkeypatch.setenv("SAGE_COMPILE_CACHE_DIR", "")
    monkeypatch.setattr(cuda, "_choice", {})
    monkeypatch.setattr(cuda, "_unmeasured", set())
    torch._dynamo.reset()
    qkv = _inputs(b=1, hq=4, hkv=4, n=2304, d=128, seed=1)
    got = torch.compile(_traced("HND", "none"), fullgraph=True)(*qkv, None)
    assert len(cuda._choice) == 1, cuda._choice  # (measured once, while traced)
    want = _opaque("HND", "none")(*qkv, None)
    assert len(cuda._choice) == 1  # (the opaque call found the choice)
    assert torch.equal(got[-1], want[-1])


def test_traced_ops_under_dynamic_shapes_compile_once(monkeypatch):
    """Three lengths under ``dynamic=True``: one compile (sizes and strides reach the launches and the CUDA core's
    op as symbols), each the opaque ops' output. (Symbolic sizes take the CUDA core unmeasured: both calls are given
    it here.)"""
    monkeypatch.setenv("SAGE_COMPILE_INT8_FP8_CORE", "cuda")
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    f = torch.compile(_traced("HND", "none"), dynamic=True, fullgraph=True)
    for n in (1024, 1536, 2048):
        qkv = _inputs(n=n, d=128)
        got, want = f(*qkv, None)[-1], _opaque("HND", "none")(*qkv, None)[-1]
        assert torch.equal(got, want), n
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_traced_ops_under_cuda_graphs():
    """``mode="reduce-overhead"``: the traced ops' launches are captured in a CUDA graph (no host sync, no choice
    timed at run time) and replay the opaque ops' bits on new inputs."""
    torch._dynamo.reset()
    f = torch.compile(_traced("HND", "bottom_right"), mode="reduce-overhead", fullgraph=True)
    for seed in (0, 1, 2):  # (the first calls record, the later ones replay)
        qkv = _inputs(n=1024, d=128, seed=seed)
        got = [t.clone() for t in f(*qkv, None)]
        want = _opaque("HND", "bottom_right")(*qkv, None)
        assert torch.equal(got[-1], want[-1]), seed
