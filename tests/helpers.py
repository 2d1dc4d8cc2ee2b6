"""Shared test helpers (metrics, input sets)."""
import torch


def cos_rel(out, ref):
    o, r = out.double().flatten(), ref.double().flatten()
    cos = torch.nn.functional.cosine_similarity(o, r, dim=0).item()
    rel = ((o - r).abs().sum() / r.abs().sum()).item()
    return cos, rel


def benchmark_module(name: str):
    """The script ``benchmarks/<name>.py`` loaded as a module (the benchmarks are no package)."""
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location(
        name, os.path.join(os.path.dirname(__file__), "..", "benchmarks", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def outlier_inputs(b, h, n, d, g, hkv=None):
    """conventions.md 'outlier' set: K per-channel bias σ=4 shared by tokens, 4 channels ×8, Q ×2."""
    hkv = hkv or h
    q = torch.randn(b, h, n, d, generator=g) * 2
    k = torch.randn(b, hkv, n, d, generator=g) + 4 * torch.randn(b, hkv, 1, d, generator=g)
    k[..., :4] *= 8
    v = torch.randn(b, hkv, n, d, generator=g)
    return q, k, v



def bits(t):
    """A tensor comparable bit for bit with torch.equal (float8 viewed as its bytes)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def shape_case(case, g):
    """Inputs of the kernel shape/mask tests (CPU tensors): ``(q, k, v, mask, causal, layout, dtype)``.
    Cases: gqa_bottom_right_ragged, bool_mask_nhd, additive_mask, hd80, hd80_fp16, fp16, or any other
    name for the plain GQA set."""
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    mask, causal, layout, dtype = None, "none", "HND", torch.bfloat16
    q, k, v = r(2, 8, 1000, 128), r(2, 2, 1300, 128), r(2, 2, 1300, 128)
    if case == "gqa_bottom_right_ragged":
        causal = "bottom_right"
    elif case == "bool_mask_nhd":
        q, k, v = r(2, 777, 4, 64), r(2, 777, 4, 64), r(2, 777, 4, 64)
        layout = "NHD"
        mask = torch.rand(2, 1, 777, 777, generator=g) > 0.5
        mask[..., 0] = True
    elif case == "additive_mask":
        mask = r(2, 8, 1, 1300)
    elif case.startswith("hd80"):
        q, k, v = r(1, 4, 500, 80), r(1, 4, 500, 80), r(1, 4, 500, 80)
    if case.endswith("fp16"):
        dtype = torch.float16
    return q.to(dtype), k.to(dtype), v.to(dtype), mask, causal, layout, dtype


def poison_cuda_cache():
    """Fill the CUDA caching allocator's free blocks with NaN, so a kernel output it never writes cannot pass."""
    x = torch.full((1 << 28,), float("nan"), device="cuda")
    del x


def llm_mask(b, lq, lk, pad, causal=True, side="right"):
    """transformers-style bool mask (B, 1, Lq, Lk): bottom-right causal and/or key padding."""
    j = torch.arange(lk)
    keep = torch.ones(b, lk, dtype=torch.bool)
    for i, p in enumerate(pad):
        if p and side == "right":
            keep[i, lk - p:] = False
        elif p:
            keep[i, :p] = False
    m = keep[:, None, :].expand(b, lq, lk)
    if causal:
        m = m & (j[None, :] <= torch.arange(lq)[:, None] + (lk - lq))
    return m[:, None].clone()


def llm_step(model, ids):
    """One next-token training step's ``(loss, flattened parameter gradients)`` of ``model`` (ids (B, N+1) ->
    logits of the first N) under bf16 autocast; the gradients are cleared again afterwards."""
    import torch.nn.functional as F

    with torch.autocast("cuda", torch.bfloat16):
        logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    grads = torch.cat([p.grad.flatten() for p in params])
    for p in params:
        p.grad = None
    return loss.detach(), grads


def check_bwd_prep(KA, device, dtype, b=2, hq=4, hkv=2, lq=130, lk=77, d=80, layout="HND", seed=0):
    """The int8_train backward's one preparation launch (``KA.bwd_prep``) against torch, on ``device``: q̂ and k̂
    transposed, V̂ in ``dtype`` with the bits of the reference's dequantization cast (scales that round, a zero
    block), dO in ``dtype``, delta = rowsum(dO∘O), the LSE in log2 units (+inf for a row without keys) and ψ(dO)
    (one scale per 128 rows, stored transposed) dequantizing to dO within its rounding. O and dO in ``layout``."""
    from sage_compile.reference.quant import dequant_int8

    g = torch.Generator().manual_seed(seed)
    i8 = (lambda *s: torch.randint(-127, 128, s, generator=g, dtype=torch.int8))
    q8, k8, v8 = i8(b, hq, lq, d), i8(b, hkv, lk, d), i8(b, hkv, lk, d)
    vs = torch.rand(b, hkv, -(-lk // 64), generator=g) * 3.7
    vs[0, 0, 0] = 0.0
    o, do = (torch.randn(b, hq, lq, d, generator=g).to(dtype) for _ in range(2))
    lse = torch.randn(b, hq, lq, generator=g)
    lse[0, 0, 3] = float("-inf")
    dev = (lambda t: t.to(device))
    ol, dol = ((t if layout == "HND" else t.transpose(1, 2).contiguous()).to(device) for t in (o, do))  # (B, N, H, D)
    p = KA.bwd_prep(dev(q8), dev(k8), dev(v8), dev(vs), ol, dev(lse), dol, layout, dtype)
    p = {n: t.cpu() for n, t in p.items()}
    assert torch.equal(p["q8t"], q8.transpose(2, 3)) and torch.equal(p["k8t"], k8.transpose(2, 3))
    assert torch.equal(bits(p["v16"]), bits(dequant_int8(v8, vs, 64).to(dtype)))
    assert torch.equal(p["do16"], do)
    assert torch.allclose(p["delta"], (do.float() * o.float()).sum(-1), rtol=1e-5, atol=1e-5)
    want2 = lse * 1.4426950408889634
    want2[0, 0, 3] = float("inf")
    assert torch.allclose(p["lse2"], want2, rtol=1e-6, atol=0) and p["lse2"][0, 0, 3] == float("inf")
    sdo = p["sdo"].repeat_interleave(128, dim=-1)[..., :lq, None]
    assert (p["do8t"].transpose(2, 3).float() * sdo - do.float()).abs().max() <= 0.51 * sdo.max()
    return p


def train_launches(fn, names=("fwd_kernel", "dkdv_kernel", "dq_kernel"), sm90=True):
    """``fn()``'s kernel launches by name (torch.profiler): of the sm90 SageBwd kernels (``sage_sm90::train::<name><``),
    or with ``sm90=False`` of the Triton kernels whose names start with each of ``names``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    seen = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    if sm90:
        return out, {n: sum(f"sage_sm90::train::{n}<" in s for s in seen) for n in names}
    return out, {n: sum(s.startswith(n) for s in seen) for n in names}


def op_schemas(binding: str = "int8_train_sm90_bind.cpp") -> dict:
    """The torch-op schemas of a ``csrc/`` binding (its TORCH_LIBRARY block), name -> ``"name(...) -> ()"``, the
    string literals' continuation lines joined."""
    import re

    from sage_compile.kernels import cuda_ext

    with open(cuda_ext.source_paths((binding,))[0]) as f:
        text = f.read().replace('"\n        "', "")
    return {name: schema for schema, name in re.findall(r'm\.def\("((\w+)\(.*?\) -> \(\))"\);', text, re.S)}


def train_op_schemas() -> dict:
    """The torch-op schemas of ``csrc/int8_train_sm90_bind.cpp`` (:func:`op_schemas`)."""
    return op_schemas("int8_train_sm90_bind.cpp")


def graph_ops(g) -> list:
    """An FX graph's ops and Triton kernels (``triton:<name>``), once per call or launch (the traced-op probes)."""
    import re

    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    kernels = [kernel_side_table.get_kernel(int(i)) for i in re.findall(r"kernel_idx = (\d+)", g.code)]
    return (re.findall(r"torch\.ops\.(\w+\.\w+)", g.code)
            + ["triton:" + getattr(getattr(k, "fn", k), "__name__", "?") for k in kernels])


def record_kernel_writes() -> dict:
    """From now on, the tensors torch's analysis of each traced Triton kernel finds written (what Inductor clones for
    the kernel where it is an input): ``{kernel name: {argument name, ...}}``, filled as kernels are traced."""
    import torch._higher_order_ops.triton_kernel_wrap as W

    entry = "identify_accessed_tensors" if hasattr(W, "identify_accessed_tensors") else "identify_mutated_tensors"
    written, analyse = {}, getattr(W, entry)  # (torch 2.13; older ones return the written names)

    def recording(kernel, kwargs, *rest):
        acc = analyse(kernel, kwargs, *rest)
        got = [d.name for d in acc.read_writes.writes] if hasattr(acc, "read_writes") else list(acc)
        name = getattr(getattr(kernel, "fn", kernel), "__name__", "?")
        written.setdefault(name, set()).update(n for n in got if isinstance(kwargs.get(n), torch.Tensor))
        return acc

    setattr(W, entry, recording)
    return written
