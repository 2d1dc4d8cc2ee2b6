"""Layout helpers: every quantized tensor is stored HND ``(B, H, N, D)``; callers may hand NHD ``(B, N, H, D)``."""
from __future__ import annotations

import torch

LAYOUTS = ("HND", "NHD")


def to_hnd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """View ``x`` as ``(B, H, N, D)`` (no copy)."""
    if layout == "HND":
        return x
    if layout == "NHD":
        return x.transpose(1, 2)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def from_hnd(o: torch.Tensor, layout: str) -> torch.Tensor:
    """Contiguous output in ``layout`` from an HND ``(B, H, N, D)`` tensor."""
    return o.contiguous() if layout == "HND" else o.transpose(1, 2).contiguous()


def out_shape(b: int, h: int, n: int, d: int, layout: str) -> tuple[int, int, int, int]:
    return (b, h, n, d) if layout == "HND" else (b, n, h, d)


def token_major_empty(b: int, h: int, n: int, d: int, layout: str, **kw) -> torch.Tensor:
    """An empty tensor of shape :func:`out_shape` stored token-major, ``(B, N, H, D)`` in memory, whatever ``layout``
    says: an HND one is the transpose of a contiguous NHD one. What the training op returns (O, and dQ, dK, dV),
    as SDPA's flash and cuDNN kernels do: a model's ``o.transpose(1, 2).reshape(B, N, H·D)`` is then a view, and the
    gradient of a head-split projection ``x.view(B, N, H, D).transpose(1, 2)`` needs no copy either."""
    t = torch.empty((b, n, h, d), **kw)
    return t if layout == "NHD" else t.transpose(1, 2)


def as_token_major(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t`` (in ``layout``) stored as :func:`token_major_empty` stores it: ``t`` itself where its strides are those,
    else a copy."""
    b, h, n, d = t.shape if layout == "HND" else (t.shape[0], t.shape[2], t.shape[1], t.shape[3])
    want = (n * h * d, d, h * d, 1) if layout == "HND" else (n * h * d, h * d, d, 1)
    if tuple(t.stride()) == want:
        return t
    out = token_major_empty(b, h, n, d, layout, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out
