"""FX passes: SDPA in every call form and hand-written attention in several spellings are found,
replaced (counters), and the compiled output matches eager; unsupported sites are kept with a reason.

Most tests use ``make_backend(compiler="eager")`` (same rewrite, no Inductor) to keep CPU CI fast;
test_backend.py and test_models.py cover the Inductor hand-off."""
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import cos_rel
from torch import nn
from torch._dynamo.utils import counters

import sage_compile
from sage_compile import debug


def compiled_matches(fn, args, replaced, kernel="int8_fp8", min_cos=0.999, compiler="eager", kept=0):
    debug.clear_reports()
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        ref = fn(*args)
        out = torch.compile(fn, backend=sage_compile.make_backend(compiler=compiler, kernel=kernel), fullgraph=True)(*args)
    c = counters["sage_compile"]
    assert c["replaced"] == replaced, debug.format_report(debug.last_reports()[-1])
    assert c["kept"] == kept, debug.format_report(debug.last_reports()[-1])
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if replaced:
        assert cos_rel(out, ref)[0] >= min_cos
    else:
        assert torch.equal(out, ref)
    return debug.last_reports()[-1]


def qkv(b=2, h=4, n=48, d=32, hkv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, n, d, generator=g), torch.randn(b, hkv or h, n, d, generator=g),
            torch.randn(b, hkv or h, n, d, generator=g))


# ----------------------------------------------------------------------------- hand-written spellings
def hw_div(q, k, v):
    return torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(q.shape[-1])).softmax(dim=-1).matmul(v)


def hw_mul_functional(q, k, v):
    return F.softmax(q @ k.transpose(-1, -2) * 0.17, dim=-1) @ v


def hw_einsum_upcast(q, k, v):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("bhqk,bhkd->bhqd", s.float().softmax(-1).to(q.dtype), v)


def hw_bmm_3d(q, k, v):
    q3, k3, v3 = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    return torch.bmm(torch.bmm(q3, k3.transpose(1, 2)).mul(0.2).softmax(-1), v3).unflatten(0, q.shape[:2])


def hw_prescaled_q(q, k, v):
    return torch.softmax((q * 0.125) @ k.transpose(2, 3), dim=-1) @ v


def hw_no_scale(q, k, v):
    return torch.softmax(torch.matmul(q, k.permute(0, 1, 3, 2)), dim=-1) @ v


def hw_softmax_dtype(q, k, v):
    return torch.softmax(q @ k.mT / 5.0, dim=-1, dtype=torch.float32).to(v.dtype) @ v


@pytest.mark.parametrize("fn", [hw_div, hw_mul_functional, hw_einsum_upcast, hw_bmm_3d, hw_prescaled_q,
                                hw_no_scale, hw_softmax_dtype])
def test_handwritten_spellings(fn):
    rows = compiled_matches(fn, qkv(), replaced=1)
    assert rows[0]["kind"] == "handwritten"


def test_handwritten_scale_value_is_kept():
    """No scale in the code means scale 1, not 1/sqrt(d)."""
    q, k, v = qkv(d=16)
    rows = compiled_matches(hw_no_scale, (q, k, v), replaced=1)
    assert rows[0]["scale"] == 1.0
    torch._dynamo.reset()
    assert compiled_matches(hw_div, (q, k, v), replaced=1)[0]["scale"] == pytest.approx(0.25)


def test_handwritten_masks():
    q, k, v = qkv(n=40)
    g = torch.Generator().manual_seed(5)
    keep = torch.rand(2, 1, 40, 40, generator=g) > 0.3
    keep[..., 0] = True
    add = torch.randn(2, 4, 1, 40, generator=g)

    def additive(q, k, v, m):
        return torch.softmax(q @ k.transpose(-2, -1) * 0.2 + m, dim=-1) @ v

    def masked_fill(q, k, v, m):
        return (q @ k.transpose(-2, -1) * 0.2).masked_fill(~m, float("-inf")).softmax(-1) @ v

    def where(q, k, v, m):
        s = q @ k.transpose(-2, -1) * 0.2
        return torch.where(m, s, torch.finfo(s.dtype).min).softmax(-1) @ v

    assert compiled_matches(additive, (q, k, v, add), 1)[0]["mask"] == "additive"
    assert compiled_matches(masked_fill, (q, k, v, keep), 1)[0]["mask"] == "bool"
    assert compiled_matches(where, (q, k, v, keep), 1)[0]["mask"] == "bool"


class DropoutAttn(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, q, k, v):
        return self.drop(torch.softmax(q @ k.transpose(-2, -1) * 0.2, dim=-1)) @ v


def test_dropout_in_training_is_kept_and_eval_is_replaced():
    m = DropoutAttn()
    rows = compiled_matches(m.eval(), qkv(), replaced=1)
    assert rows[0]["decision"] == "int8_fp8"
    torch._dynamo.reset()
    counters.clear()
    m.train()
    torch.manual_seed(0)
    with torch.no_grad():
        torch.compile(m, backend=sage_compile.make_backend(compiler="eager", kernel="int8_fp8"))(*qkv())
    rows = debug.last_reports()[-1]
    assert counters["sage_compile"]["replaced"] == 0 and "dropout" in rows[0]["reason"]


def test_probabilities_used_elsewhere_are_kept():
    def f(q, k, v):
        p = torch.softmax(q @ k.transpose(-2, -1) * 0.2, dim=-1)
        return p @ v, p

    with torch.no_grad():
        out, p = torch.compile(f, backend=sage_compile.make_backend(compiler="eager", kernel="int8_fp8"))(*qkv())
    assert counters["sage_compile"]["replaced"] == 0 and counters["sage_compile"]["kept"] == 1
    assert "several users" in debug.last_reports()[-1][0]["reason"]


def test_softmax_that_is_not_attention_is_ignored():
    def f(x, w):
        return torch.softmax(x @ w, dim=-1).sum()

    with torch.no_grad():
        torch.compile(f, backend=sage_compile.make_backend(compiler="eager", kernel="int8_fp8"))(torch.randn(4, 8), torch.randn(8, 8))
    assert counters["sage_compile"]["sites"] == 0


# ----------------------------------------------------------------------------- SDPA call forms
def sdpa_positional(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, None, 0.0, True)


def sdpa_kwargs(q, k, v):
    return F.scaled_dot_product_attention(query=q, key=k, value=v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=0.3)


def sdpa_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k[:, :2], v[:, :2], is_causal=True, enable_gqa=True)


def sdpa_repeat_interleave(q, k, v):
    k2, v2 = k[:, :2], v[:, :2]
    return F.scaled_dot_product_attention(q, k2.repeat_interleave(2, dim=1), v2.repeat_interleave(2, dim=1))


def sdpa_nhd(q, k, v):
    qn, kn, vn = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # (B, N, H, D) like diffusers
    o = F.scaled_dot_product_attention(qn.permute(0, 2, 1, 3), kn.permute(0, 2, 1, 3), vn.permute(0, 2, 1, 3))
    return o.transpose(1, 2).flatten(2)


def sdpa_aten(q, k, v):
    return torch.ops.aten.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("fn", [sdpa_positional, sdpa_kwargs, sdpa_gqa, sdpa_repeat_interleave, sdpa_nhd, sdpa_aten])
def test_sdpa_call_forms(fn):
    rows = compiled_matches(fn, qkv(), replaced=1)
    if fn is sdpa_nhd:
        assert rows[0]["layout"] == "NHD"
    if fn in (sdpa_gqa, sdpa_repeat_interleave):
        assert rows[0]["gqa"] == "4/2"
    if fn is sdpa_positional:
        assert rows[0]["causal"] == "top_left"


def test_sdpa_masks():
    q, k, v = qkv(n=24)
    keep = torch.rand(2, 1, 24, 24) > 0.3
    keep[..., 0] = True
    add = torch.randn(2, 1, 1, 24)
    f = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # noqa: E731
    assert compiled_matches(f, (q, k, v, keep), 1)[0]["mask"] == "bool"
    torch._dynamo.reset()
    counters.clear()
    assert compiled_matches(f, (q, k, v, add), 1)[0]["mask"] == "additive"


def _sdpa_with_mask(build):
    """SDPA whose bool mask ``build(q, k)`` makes inside the graph."""
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=build(q, k))


def _causal_keep(q, k, window=None):
    """(B, 1, Lq, Lk) bool, key n kept for query m iff n <= m + Lk - Lq (and, with ``window``, n > that - window): from
    aranges and the sizes alone, as transformers builds its mask under compile when called with input_ids."""
    lq, lk = q.shape[2], k.shape[2]
    rel = torch.arange(lk, device=q.device)[None, :] - torch.arange(lq, device=q.device)[:, None] - (lk - lq)
    keep = rel <= 0 if window is None else (rel <= 0) & (rel > -window)
    return keep[None, None].expand(q.shape[0], 1, lq, lk)


def _causal_then_written(q, k):
    m = _causal_keep(q, k).clone()
    m.view(-1)[5] = False  # (a key the first query row would see)
    return m


def test_constant_masks_become_rules():
    """A bool mask built in the graph from nothing the graph takes as input is evaluated at compile time: equal to
    the causal rule (bottom-right) or all true, the site takes that rule and no mask; another constant mask, or one
    computed from an input, stays a mask read by the op."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 20, 32, generator=g)
    k, v = (torch.randn(2, 4, 28, 32, generator=g) for _ in range(2))
    cases = [
        (_causal_keep, "none", "bottom_right"),
        (lambda q, k: torch.ones(q.shape[0], 1, 1, k.shape[2], dtype=torch.bool), "none", "none"),
        (lambda q, k: _causal_keep(q, k, window=6), "bool", "none"),  # a sliding window: not a rule
        (lambda q, k: (q.sum(-1, keepdim=True) > -1e9) & _causal_keep(q, k), "bool", "none"),  # from an input
        (_causal_then_written, "bool", "none"),  # causal as built, then written into through a view
    ]
    for build, mask, causal in cases:
        torch._dynamo.reset()
        row = compiled_matches(_sdpa_with_mask(build), (q, k, v), 1)[0]
        assert (row["mask"], row["causal"]) == (mask, causal), row
        assert any("constant bool mask" in u for u in row["unwrapped"]) == (mask == "none"), row


def test_unsupported_sites_are_kept_with_reason():
    q, k, v = qkv(d=288)
    rows = compiled_matches(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), (q, k, v), replaced=0, kept=1)
    assert "head_dim 288" in rows[0]["reason"]
    torch._dynamo.reset()
    counters.clear()
    rows = compiled_matches(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), qkv(), replaced=0,
                            kernel="exact", kept=1)
    assert rows[0]["reason"].startswith("exact")


def test_auto_on_cpu_is_exact():
    rows = compiled_matches(sdpa_kwargs, qkv(), replaced=0, kernel="auto", kept=1)
    assert "auto on cpu" in rows[0]["reason"]


def test_strict_mode_raises_on_fallback():
    q, k, v = qkv(d=288)
    with pytest.raises(Exception, match="strict"):
        with torch.no_grad():
            torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                          backend=sage_compile.make_backend(compiler="eager", kernel="int8_fp8", strict=True))(q, k, v)


def test_site_override_and_fp4_padding_note():
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v) + F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = qkv(d=40)
    override = lambda site: "fp4" if site.causal == "top_left" else "int8_fp8"  # noqa: E731
    with torch.no_grad():
        torch.compile(f, backend=sage_compile.make_backend(compiler="eager", site_override=override))(q, k, v)
    rows = debug.last_reports()[-1]
    assert [r["decision"] for r in rows] == ["int8_fp8", "fp4"]
    assert any("padded to 48" in n for n in rows[1]["notes"])
    assert any("always for fp4" in n for n in rows[1]["notes"])  # auto's op prologue, with its own reason


def test_dump_dir_and_report(tmp_path):
    dump = tmp_path / "dump"
    with sage_compile.options(dump_dir=str(dump), kernel="int8_fp8"):
        with torch.no_grad():
            torch.compile(sdpa_nhd, backend=sage_compile.make_backend(compiler="eager"))(*qkv())
    files = sorted(p.name for p in dump.iterdir())
    assert any(f.endswith("_before.py") for f in files) and any(f.endswith("_after.py") for f in files)
    after = next(dump.glob("*_after.py")).read_text()
    before = next(dump.glob("*_before.py")).read_text()
    assert "scaled_dot_product_attention" in before and "scaled_dot_product_attention" not in after
    # the default graph prologue: the reference quantizer's code in the graph, then the core op
    assert "sage_compile.attention_int8_fp8" in after and "sage_compile.quantize_int8_fp8" not in after
    assert "reference_int8_fp8_quantize" in after
    txt = next(dump.glob("*_report.txt")).read_text()
    assert "replaced 1/1" in txt and "test_passes.py" in txt and "NHD" in txt


def test_options_reach_the_ops():
    q, k, v = qkv(n=64)
    q = q * 3
    k[..., :4] *= 8
    f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    with torch.no_grad():
        out = torch.compile(f, backend=sage_compile.make_backend(compiler="eager", kernel="int8_fp8",
                                                                 int8_channel_rescale=True))(q, k, v)
    from sage_compile.reference import int8_fp8

    want = int8_fp8.attention(*int8_fp8.quantize(q, k, v, "HND", True), None, "none", None, "HND", q.dtype)
    plain = int8_fp8.attention(*int8_fp8.quantize(q, k, v), None, "none", None, "HND", q.dtype)
    assert torch.equal(out, want) and not torch.equal(out, plain)


def test_autocast_sites_are_replaced_with_autocast_dtype():
    """Under torch.autocast, Dynamo's graph holds SDPA's inputs uncast (fp32 q/k out of RoPE beside a
    bf16 v); the site runs in the dtype autocast gives it (its output's), with the casts made explicit."""
    lin = nn.Linear(32, 32)
    cos = torch.randn(48, 32)

    def f(x):
        q = lin(x) * cos  # bf16 * fp32 -> fp32 under autocast
        return F.scaled_dot_product_attention(q, q, lin(x), is_causal=True)

    x = torch.randn(2, 4, 48, 32)
    debug.clear_reports()
    torch._dynamo.reset()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        ref = f(x)
        out = torch.compile(f, backend=sage_compile.make_backend(compiler="eager", kernel="int8_fp8"))(x)
    (row,) = debug.last_reports()[-1]
    assert row["decision"] == "int8_fp8" and row["dtype"] == "bfloat16", row
    assert out.dtype == ref.dtype == torch.bfloat16
    assert cos_rel(out.float(), ref.float())[0] > 0.999


def test_policy_int8_train_head_dim_limit_on_cuda():
    """int8_train's CUDA kernels take head_dim <= 128: larger CUDA sites stay SDPA with the reason; the
    reference (CPU) takes them."""
    from types import SimpleNamespace

    from sage_compile import config, policy

    site = SimpleNamespace(reject_reason=None, dropout_p=0.0, dtype=torch.bfloat16, head_dim=160, head_dim_v=160,
                           dtypes=(torch.bfloat16,) * 3, hq=4, hkv=4, mask_kind="none", causal="top_left",
                           requires_grad=True)
    cfg = config.resolve(kernel="int8_train")
    dec = policy.decide(site, cfg, "cuda")
    assert dec.scheme is None and dec.fallback and "head_dim <= 128" in dec.reason
    assert policy.decide(site, cfg, "cpu").scheme == "int8_train"
    site.head_dim = site.head_dim_v = 128
    assert policy.decide(site, cfg, "cuda").scheme == "int8_train"


def test_policy_auto_runs_int8_fp8_where_measured_faster(monkeypatch):
    """``auto`` on CUDA for inference: ``int8_fp8`` at 16-bit sites of head dim 64 / 128 without an additive mask
    with at least AUTO_INT8_FP8_MIN_TOKENS queries and keys (AUTO_INT8_FP8_MIN_TOKENS_CAUSAL causal,
    AUTO_INT8_FP8_MIN_TOKENS_BOOL_MASK with a bool mask; hints of symbolic sizes too) where the sm90 CUDA core
    can serve; ``exact`` elsewhere, the reason in the decision; ``exact`` on CPU and
    where gradients are needed."""
    from types import SimpleNamespace

    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from sage_compile import config, ops, policy
    from sage_compile.kernels.int8_fp8 import cuda

    n = policy.AUTO_INT8_FP8_MIN_TOKENS
    monkeypatch.setattr(ops, "has_fast_impl", lambda scheme, device_type: device_type == "cuda")
    core = {"why": None}
    monkeypatch.setattr(cuda, "unavailable", lambda device=None: core["why"])

    def site(nq=n, nk=None, d=128, dtype=torch.bfloat16, mask="none", grad=False, causal="none"):
        nk = nq if nk is None else nk
        return SimpleNamespace(reject_reason=None, dropout_p=0.0, dtype=dtype, head_dim=d, head_dim_v=d,
                               dtypes=(dtype,) * 3, hq=4, hkv=4, mask_kind=mask, causal=causal, requires_grad=grad,
                               q_shape=(1, 4, nq, d), k_shape=(1, 4, nk, d), device=torch.device("cuda", 0))

    cfg = config.resolve()
    assert cfg.kernel == "auto"

    def dec(s, device_type="cuda"):
        return policy.decide(s, cfg, device_type)

    nc = policy.AUTO_INT8_FP8_MIN_TOKENS_CAUSAL
    assert nc > n
    nb = policy.AUTO_INT8_FP8_MIN_TOKENS_BOOL_MASK
    for s in (site(), site(nq=nc, causal="top_left"), site(d=64), site(dtype=torch.float16), site(nq=n + 1, nk=2 * n),
              site(nq=nb, mask="bool")):
        d = dec(s)
        assert d.scheme == "int8_fp8" and "auto on cuda" in d.reason and d.prologue == "traced", d
    env = ShapeEnv()
    hinted = env.create_symintnode(env.create_symbol(17776, ConstantSource("n")), hint=17776)
    assert dec(site(nq=hinted)).scheme == "int8_fp8"
    kept = {
        f"{n // 4} queries": site(nq=n // 4),
        f"{n} queries x 226 keys": site(nk=226),
        f"{n} queries x {n} keys: int8_fp8 beats SDPA from {nc} of each (causal)": site(causal="bottom_right"),
        "head_dim 80": site(d=80),
        "float32": site(dtype=torch.float32),
        f"beats SDPA from {nb} of each (with a bool mask)": site(nq=nb // 2, mask="bool"),
        "an additive mask": site(mask="additive"),
        "gradients needed": site(grad=True),
    }
    for why, s in kept.items():
        d = dec(s)
        assert d.scheme is None and not d.fallback and why in d.reason, (why, d)
    assert dec(site(), "cpu").scheme is None
    core["why"] = "SAGE_COMPILE_INT8_FP8_CORE=triton"
    d = dec(site())
    assert d.scheme is None and "no CUDA int8_fp8 core (SAGE_COMPILE_INT8_FP8_CORE=triton)" in d.reason
    core["why"] = None
    monkeypatch.setattr(ops, "has_fast_impl", lambda scheme, device_type: False)
    assert "no int8_fp8 kernel" in dec(site()).reason
    # named schemes are not the policy's speed choice
    assert policy.decide(site(nq=256), config.resolve(kernel="int8_fp8"), "cuda").scheme == "int8_fp8"


def test_cuda_core_unavailable_says_why_without_building(monkeypatch):
    from sage_compile.kernels.int8_fp8 import cuda

    monkeypatch.setenv("SAGE_COMPILE_INT8_FP8_CORE", "triton")
    assert cuda.unavailable() == "SAGE_COMPILE_INT8_FP8_CORE=triton"
    monkeypatch.delenv("SAGE_COMPILE_INT8_FP8_CORE")
    if not torch.cuda.is_available():
        assert cuda.unavailable() == "no CUDA device"
    assert not cuda.status()["built"] or cuda.unavailable() is None


def test_policy_notes_a_scheme_without_kernel_on_the_device():
    """A scheme that has no kernel on the site's device runs the reference there: the report says so."""
    from types import SimpleNamespace

    from sage_compile import config, ops, policy

    site = SimpleNamespace(reject_reason=None, dropout_p=0.0, dtype=torch.bfloat16, head_dim=64, head_dim_v=64,
                           dtypes=(torch.bfloat16,) * 3, hq=4, hkv=4, mask_kind="none", causal="none",
                           requires_grad=False)
    dec = policy.decide(site, config.resolve(kernel="int8_fp16"), "cuda")
    assert dec.scheme == "int8_fp16" and any("no int8_fp16 kernel on cuda" in n for n in dec.notes)
    assert not any("kernel on" in n for n in policy.decide(site, config.resolve(kernel="int8_fp16"), "cpu").notes)
    if ops.has_fast_impl("int8_fp8", "cuda"):  # registered where triton imports
        assert not any("kernel on" in n for n in policy.decide(site, config.resolve(kernel="int8_fp8"), "cuda").notes)
