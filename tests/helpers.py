"""Shared test helpers (metrics, input sets)."""
import torch


def cos_rel(out, ref):
    o, r = out.double().flatten(), ref.double().flatten()
    cos = torch.nn.functional.cosine_similarity(o, r, dim=0).item()
    rel = ((o - r).abs().sum() / r.abs().sum()).item()
    return cos, rel


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
