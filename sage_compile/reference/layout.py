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
