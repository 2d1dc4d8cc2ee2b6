"""Eager-mode routing: ``with sage_compile.enable(kernel=...):`` sends SDPA calls of un-compiled code to
the sage op (a ``TorchFunctionMode``; Dynamo traces it too). Same policy as the compiled path."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import config as _config
from . import ops, policy  # noqa: F401

log = logging.getLogger("sage_compile.eager")
_SDPA = {torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention}
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


@dataclasses.dataclass
class TensorSite:
    """The policy's view of one eager SDPA call."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]
    causal: str
    dropout_p: float
    reject_reason: Optional[str] = None

    dtype = property(lambda s: s.q.dtype)
    dtypes = property(lambda s: (s.q.dtype, s.k.dtype, s.v.dtype))
    head_dim = property(lambda s: s.q.shape[-1])
    head_dim_v = property(lambda s: s.v.shape[-1])
    hq = property(lambda s: s.q.shape[1])
    hkv = property(lambda s: s.k.shape[1])
    q_shape = property(lambda s: tuple(s.q.shape))
    k_shape = property(lambda s: tuple(s.k.shape))
    requires_grad = property(lambda s: torch.is_grad_enabled() and any(t.requires_grad for t in (s.q, s.k, s.v)))
    device_type = property(lambda s: s.q.device.type)
    device = property(lambda s: s.q.device)
    location = "<eager>"
    index = -1

    @property
    def mask_kind(self):
        if self.mask is None:
            return "none"
        return "bool" if self.mask.dtype == torch.bool else "additive"


class _SageMode(TorchFunctionMode):
    def __init__(self, cfg: _config.Config):
        super().__init__()
        self.cfg = cfg
        self.options = cfg.options.encode()  # a plain string: traced cleanly when Dynamo runs inside the mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _SDPA:
            return func(*args, **kwargs)
        a = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
        a.update(dict(zip(_NAMES, args)))
        a.update(kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        site = TensorSite(q, k, v, a["attn_mask"], "top_left" if a["is_causal"] else "none", float(a["dropout_p"]))
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            site.reject_reason = "q/k/v not 4-D"
        elif q.shape[1] != k.shape[1] and not a["enable_gqa"]:
            site.reject_reason = "head counts differ without enable_gqa"
        dec = policy.decide(site, self.cfg, q.device.type)
        if dec.scheme is None:
            if self.cfg.strict and dec.fallback:
                raise policy.UnsupportedSite(f"sage_compile (strict): {dec.reason}")
            log.debug("eager SDPA kept: %s", dec.reason)
            return func(*args, **kwargs)
        from . import attention, ops

        if dec.scheme == "int8_train":
            return attention(q, k, v, a["attn_mask"], site.causal, a["scale"], "HND", dec.scheme, self.cfg.options)
        return ops.attention(q, k, v, a["attn_mask"], site.causal, a["scale"], "HND", dec.scheme, self.options)


@contextlib.contextmanager
def enable(**config_kwargs):
    """Route ``F.scaled_dot_product_attention`` inside the block to sage_compile's op.

    Example: ``with sage_compile.enable(kernel="int8_fp8"): y = model(x)``. Configuration keywords as in
    :class:`sage_compile.config.Config`; unsupported calls run SDPA unchanged (logged).
    """
    cfg = _config.resolve(**config_kwargs)
    with _SageMode(cfg):
        yield cfg
