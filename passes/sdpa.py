"""Find ``F.scaled_dot_product_attention`` calls (every call form) in a Dynamo graph."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from .layout import unwrap_heads_permute, unwrap_repeat_kv
from .mask import constant_mask_rule
from .site import Site, mask_kind_of, val

SDPA_TARGETS = {torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention}
_ATEN_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def is_sdpa(n: fx.Node) -> bool:
    return n.op == "call_function" and (n.target in SDPA_TARGETS or n.target is _ATEN_SDPA
                                        or n.target is torch.ops.aten.scaled_dot_product_attention)


def normalize_args(n: fx.Node) -> dict:
    """SDPA arguments by name, defaults filled in."""
    a = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    a.update(dict(zip(_NAMES, n.args)))
    a.update(n.kwargs)
    return a


def find_sdpa_sites(graph: fx.Graph) -> list[Site]:
    sites = []
    for n in graph.nodes:
        if is_sdpa(n):
            sites.append(site_from_sdpa(n))
    return sites


def site_from_sdpa(n: fx.Node) -> Site:
    a = normalize_args(n)
    s = Site("sdpa", n, a["query"], a["key"], a["value"], pattern_nodes=[n])
    s.mask = a["attn_mask"]
    s.mask_kind = mask_kind_of(s.mask)
    dp = a["dropout_p"]
    s.scale = a["scale"]
    if isinstance(dp, fx.Node) or not isinstance(a["is_causal"], bool):
        s.reject_reason = "dropout_p/is_causal not constant: kept"
        return s
    s.dropout_p = float(dp)
    s.causal = "top_left" if a["is_causal"] else "none"
    if any(not isinstance(val(t), torch.Tensor) or val(t).dim() != 4 for t in (s.q, s.k, s.v)):
        s.reject_reason = "q/k/v not 4-D tensors: kept"
        return s
    if isinstance(s.scale, fx.Node) and isinstance(val(s.scale), torch.Tensor):
        s.reject_reason = "tensor-valued scale: kept"
        return s
    # A bool mask that is a constant of the graph and equals an index rule becomes that rule (passes/mask.py).
    if s.mask_kind == "bool" and s.causal == "none":
        rule = constant_mask_rule(s.mask, val(s.q).shape[2], val(s.k).shape[2], n)
        if rule is not None:
            s.mask, s.mask_kind, s.causal = None, "none", rule
            s.unwrapped.append(f"constant bool mask -> {'causal ' + rule if rule != 'none' else 'no mask'}")
    # Native GQA: undo repeat_kv on K and V when both were repeated by the same factor.
    k0, rk = unwrap_repeat_kv(s.k)
    v0, rv = unwrap_repeat_kv(s.v)
    if rk == rv and rk != 1:
        s.pattern_nodes += [s.k, s.v]
        s.k, s.v = k0, v0
        s.unwrapped.append(f"repeat_kv x{rk}")
    hq, hkv = val(s.q).shape[1], val(s.k).shape[1]
    if hq != hkv and not a["enable_gqa"] and not s.unwrapped:
        s.reject_reason = f"{hq} query heads vs {hkv} kv heads without enable_gqa: kept"
        return s
    # Read (B, N, H, D) tensors directly when all three arrive through a heads permute.
    srcs = [unwrap_heads_permute(t) for t in (s.q, s.k, s.v)]
    if all(x is not None for x in srcs):
        s.pattern_nodes += [s.q, s.k, s.v]
        s.q, s.k, s.v = srcs
        s.layout = "NHD"
        s.unwrapped.append("permute(0,2,1,3) -> NHD")
    return s
