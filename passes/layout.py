"""Undo layout plumbing around attention so the op reads tensors where the model wrote them.

* ``repeat_kv`` (transformers: ``x[:, :, None].expand(B, Hkv, r, N, D).reshape(B, Hkv·r, N, D)``) and
  ``repeat_interleave(x, r, dim=1)`` -> the un-repeated K/V (native GQA, r× less K/V traffic).
* ``permute(0, 2, 1, 3)`` / ``transpose(1, 2)`` of a (B, N, H, D) tensor (diffusers' dispatcher, most
  models) -> read the NHD tensor directly (layout ``NHD``).
Matching is by operation and verified by the shapes in the nodes' example values.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch import fx

from .site import val


def _is(n, method: str, fns=()) -> bool:
    return isinstance(n, fx.Node) and ((n.op == "call_method" and n.target == method) or
                                       (n.op == "call_function" and n.target in fns))


def _shape(n):
    t = val(n)
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def unwrap_repeat_kv(n: fx.Node) -> tuple[fx.Node, int]:
    """(source, repeats) if ``n`` repeats the heads of a (B, Hkv, N, D) tensor, else (n, 1)."""
    out = _shape(n)
    if out is None or len(out) != 4:
        return n, 1
    # transformers repeat_kv: reshape(expand(getitem(x, (:, :, None, ...))))
    if _is(n, "reshape", (torch.reshape,)) or _is(n, "view"):
        e = n.args[0]
        if _is(e, "expand") and isinstance(e.args[0], fx.Node):
            g = e.args[0]
            if g.op == "call_function" and g.target is operator.getitem and isinstance(g.args[0], fx.Node):
                src, gs, es = g.args[0], _shape(g), _shape(e)
                s = _shape(src)
                if (s and gs and es and len(s) == 4 and len(gs) == 5 and gs[2] == 1 and gs[:2] == s[:2]
                        and gs[3:] == s[2:] and es[:2] == s[:2] and es[3:] == s[2:] and out == (s[0], s[1] * es[2], s[2], s[3])):
                    return src, int(es[2]) if not isinstance(es[2], torch.SymInt) else es[2]
    if _is(n, "repeat_interleave", (torch.repeat_interleave,)):
        src = n.args[0]
        reps = n.args[1] if len(n.args) > 1 else n.kwargs.get("repeats")
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
        s = _shape(src)
        if isinstance(reps, int) and dim in (1, -3) and s and len(s) == 4 and out == (s[0], s[1] * reps, s[2], s[3]):
            return src, reps
    return n, 1


def unwrap_heads_permute(n: fx.Node) -> Optional[fx.Node]:
    """The (B, N, H, D) source if ``n`` is its (B, H, N, D) permute/transpose, else None."""
    if not isinstance(n, fx.Node):
        return None
    src = None
    if _is(n, "permute", (torch.permute,)):
        dims = n.args[1:] if n.op == "call_method" else n.args[1]
        if n.op == "call_method" and len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = dims[0]
        if tuple(dims) == (0, 2, 1, 3):
            src = n.args[0]
    elif _is(n, "transpose", (torch.transpose,)):
        if tuple(sorted(d % 4 for d in n.args[1:3])) == (1, 2):
            src = n.args[0]
    if not isinstance(src, fx.Node):
        return None
    s, o = _shape(src), _shape(n)
    if s and o and len(s) == 4 and o == (s[0], s[2], s[1], s[3]):
        return src
    return None
