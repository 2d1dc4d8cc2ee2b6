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
