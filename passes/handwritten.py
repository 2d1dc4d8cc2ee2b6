"""Find hand-written attention, ``softmax(q @ kᵀ · s [+ mask]) @ v``, in a Dynamo graph.

Starting from each softmax, walk back through casts, an additive / masked_fill / where mask and
mul/div scales to the score matmul (``matmul``/``@``/``bmm``/``einsum`` of q and a transposed k, the
scale possibly applied to q), and forward through casts and an inactive dropout to the P·V matmul.
Dropout active in training between softmax and P·V, probabilities used elsewhere, or an unrecognised
operand leave the site alone (reported with the reason).
"""
from __future__ import annotations

import operator
import re
from typing import Optional

import torch
import torch.nn.functional as F
from torch import fx

from .site import Site, val

_SOFTMAX_FNS = {torch.softmax, F.softmax, torch.nn.functional.softmax, torch._softmax, torch.special.softmax}
_MATMUL_FNS = {torch.matmul, operator.matmul, torch.bmm}
_CASTS = {"float", "to", "type", "half", "bfloat16", "type_as"}
_MUL = {operator.mul, torch.mul}
_DIV = {operator.truediv, torch.div, torch.true_divide}
_ADD = {operator.add, torch.add}
_DROPOUT = {F.dropout, torch.dropout, torch.nn.functional.dropout}
NEG_LARGE = -1e4


def _fn(n, fns, method):
    return isinstance(n, fx.Node) and ((n.op == "call_function" and n.target in fns) or
                                       (n.op == "call_method" and n.target == method))


def _rank(n) -> Optional[int]:
    t = val(n)
    return t.dim() if isinstance(t, torch.Tensor) else None


def _is_tensor(x) -> bool:
    return isinstance(val(x), torch.Tensor)


def _number(x):
    """A Python number or a symbolic scalar node, else None."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return x
    if isinstance(x, fx.Node) and isinstance(val(x), (torch.SymFloat, torch.SymInt, int, float)):
        return x
    return None


def _softmax_dim_ok(n: fx.Node) -> bool:
    if n.op == "call_method":
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    else:
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    r = _rank(n.args[0])
    return r is not None and dim is not None and dim % r == r - 1


def _is_cast(n) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_method" and n.target in _CASTS and len(n.args) >= 1


def _transposed_k(n) -> Optional[fx.Node]:
    """k if n is kᵀ (last two dims swapped), else None."""
    if not isinstance(n, fx.Node):
        return None
    r = _rank(n)
    if r is None:
        return None
    if _fn(n, {torch.transpose}, "transpose") and len(n.args) >= 3:
        if sorted(d % r for d in n.args[1:3]) == [r - 2, r - 1]:
            return n.args[0]
    if _fn(n, {torch.permute}, "permute"):
        dims = n.args[1:] if n.op == "call_method" else n.args[1]
        if n.op == "call_method" and len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = dims[0]
        if list(dims) == list(range(r - 2)) + [r - 1, r - 2]:
            return n.args[0]
    if n.op == "call_function" and n.target is getattr and n.args[1] == "mT":
        return n.args[0]
    return None


def _einsum_eq(n) -> Optional[tuple[str, str, str]]:
    if not _fn(n, {torch.einsum}, "__never__") or not isinstance(n.args[0], str):
        return None
    eq = n.args[0].replace(" ", "")
    m = re.fullmatch(r"([\w.]+),([\w.]+)->([\w.]+)", eq)
    return m.groups() if m and len(n.args) == 3 else None


def _score_operands(n) -> Optional[tuple[fx.Node, fx.Node]]:
    """(q, k) if n computes q @ kᵀ."""
    if _fn(n, _MATMUL_FNS, "matmul") or _fn(n, set(), "bmm") or _fn(n, set(), "__matmul__"):
        if len(n.args) == 2:
            k = _transposed_k(n.args[1])
            if k is not None:
                return n.args[0], k
    eq = _einsum_eq(n)
    if eq:
        a, b, c = eq
        if len(a) >= 2 and a[:-2] == b[:-2] == c[:-2] and a[-1] == b[-1] and c[-2:] == a[-2] + b[-2]:
            return n.args[1], n.args[2]
    return None


def _pv_operands(n, p) -> Optional[fx.Node]:
    """v if n computes p @ v."""
    if (_fn(n, _MATMUL_FNS, "matmul") or _fn(n, set(), "bmm")) and len(n.args) == 2 and n.args[0] is p:
        return n.args[1]
    eq = _einsum_eq(n)
    if eq and n.args[1] is p:
        a, b, c = eq
        if len(a) >= 2 and a[:-2] == b[:-2] == c[:-2] and a[-1] == b[-2] and c[-2:] == a[-2] + b[-1]:
            return n.args[2]
    return None


def _single_user(n: fx.Node) -> Optional[fx.Node]:
    users = list(n.users)
    return users[0] if len(users) == 1 else None


def find_handwritten_sites(graph: fx.Graph) -> list[Site]:
    sites = []
    for n in graph.nodes:
        if _fn(n, _SOFTMAX_FNS, "softmax") and _softmax_dim_ok(n):
            s = match_from_softmax(n)
            if s is not None:
                sites.append(s)
    return sites


def match_from_softmax(sm: fx.Node) -> Optional[Site]:
    """Match a hand-written attention around softmax node ``sm``; None if it is not attention."""
    nodes = [sm]
    # ---- backward: casts, mask, scale, score matmul
    x = sm.args[0]
    scale_factors: list = []
    mask = None
    mask_kind = "none"
    scale_seen = False  # walking back: a scale met before the mask is applied after it in the code
    scale_after_mask = False
    while True:
        if _is_cast(x):
            nodes.append(x)
            x = x.args[0]
            continue
        if _fn(x, _MUL, "mul") and len(x.args) == 2:
            a, b = x.args
            f = _number(b) if _is_tensor(a) else _number(a)
            if f is not None:
                if mask is None:
                    scale_seen = True
                scale_factors.append(("mul", f))
                nodes.append(x)
                x = a if _is_tensor(a) else b
                continue
        if _fn(x, _DIV, "div") and len(x.args) == 2 and _is_tensor(x.args[0]) and _number(x.args[1]) is not None:
            if mask is None:
                scale_seen = True
            scale_factors.append(("div", _number(x.args[1])))
            nodes.append(x)
            x = x.args[0]
            continue
        if mask is None and _fn(x, _ADD, "add") and len(x.args) == 2 and all(_is_tensor(t) for t in x.args):
            a, b = x.args
            # the score side is the one that leads to a matmul of rank >= 3 of the same shape as x
            side = a if _leads_to_scores(a) else (b if _leads_to_scores(b) else None)
            if side is None:
                return None
            mask = b if side is a else a
            mask_kind = "bool" if val(mask).dtype == torch.bool else "additive"
            scale_after_mask = scale_seen
            if mask_kind == "bool":
                return None  # adding a bool tensor is not a mask idiom we understand
            nodes.append(x)
            x = side
            continue
        if mask is None and _fn(x, {torch.masked_fill}, "masked_fill") and len(x.args) == 3:
            fill = x.args[2]
            if isinstance(fill, (int, float)) and fill <= NEG_LARGE:
                mask, mask_kind = (x.args[1], "invert"), "bool"
                scale_after_mask = scale_seen
                nodes.append(x)
                x = x.args[0]
                continue
            return None
        if mask is None and _fn(x, {torch.where}, "__never__") and len(x.args) == 3:
            cond, a, b = x.args
            if isinstance(b, (int, float)) and b <= NEG_LARGE and _is_tensor(a):
                mask, mask_kind, x2 = cond, "bool", a
                scale_after_mask = scale_seen
            elif isinstance(a, (int, float)) and a <= NEG_LARGE and _is_tensor(b):
                mask, mask_kind, x2 = (cond, "invert"), "bool", b
                scale_after_mask = scale_seen
            else:
                return None
            nodes.append(x)
            x = x2
            continue
        break
    ops = _score_operands(x)
    if ops is None:
        return None
    nodes.append(x)
    q, k = ops
    # scale applied to q
    while True:
        if _fn(q, _MUL, "mul") and len(q.args) == 2 and _is_tensor(q.args[0]) and _number(q.args[1]) is not None:
            scale_factors.append(("mul", _number(q.args[1])))
            q = q.args[0]
            continue
        if _fn(q, _MUL, "mul") and len(q.args) == 2 and _is_tensor(q.args[1]) and _number(q.args[0]) is not None:
            scale_factors.append(("mul", _number(q.args[0])))
            q = q.args[1]
            continue
        if _fn(q, _DIV, "div") and len(q.args) == 2 and _is_tensor(q.args[0]) and _number(q.args[1]) is not None:
            scale_factors.append(("div", _number(q.args[1])))
            q = q.args[0]
            continue
        break
    # ---- forward: casts, dropout, P·V
    p = sm
    reject = None
    while True:
        u = _single_user(p)
        if u is None:
            return _rejected(sm, "attention probabilities have several users (e.g. returned): kept")
        if _is_cast(u):
            nodes.append(u)
            p = u
            continue
        if _fn(u, _DROPOUT, "__never__") or (u.op == "call_method" and u.target == "dropout"):
            pr = u.args[1] if len(u.args) > 1 else u.kwargs.get("p", 0.5)
            training = u.args[2] if len(u.args) > 2 else u.kwargs.get("training", True if u.target is not torch.dropout else None)
            if u.target is torch.dropout:
                training = u.args[2] if len(u.args) > 2 else u.kwargs.get("train")
            if not isinstance(pr, (int, float)) or (pr > 0 and training is not False):
                reject = f"dropout p={pr} between softmax and P@V in training: kept"
            nodes.append(u)
            p = u
            continue
        break
    v = _pv_operands(u, p)
    if v is None:
        return None
    nodes.append(u)
    r = _rank(q)
    s = Site("handwritten", u, q, k, v, pattern_nodes=nodes)
    if reject:
        s.reject_reason = reject
        return s
    if scale_after_mask:
        s.reject_reason = "scale applied after the mask: kept"
        return s
    rk, rv = _rank(k), _rank(v)
    if r not in (3, 4) or rk != r or rv != r:
        s.reject_reason = f"rank {r} attention unsupported (3-D or 4-D only): kept"
        return s
    tq, tk, tv = val(q), val(k), val(v)
    if tk.shape != tv.shape or tq.shape[0] != tk.shape[0] or (r == 4 and tk.shape[1] not in (1, tq.shape[1])):
        s.reject_reason = f"q {tuple(tq.shape)} / k {tuple(tk.shape)} / v {tuple(tv.shape)} broadcast unsupported: kept"
        return s
    if r == 4 and tk.shape[1] == 1 and tq.shape[1] > 1:
        s.unwrapped.append("broadcast k/v heads -> MQA")
    s.rank3 = r == 3
    s.mask, s.mask_kind = mask, mask_kind
    s.scale = ("factors", scale_factors)
    return s


def _leads_to_scores(n) -> bool:
    """True when n is (a scaled/cast) q @ kᵀ."""
    for _ in range(6):
        if _score_operands(n) is not None:
            return True
        if _is_cast(n) or (_fn(n, _MUL | _DIV, "mul") or _fn(n, _DIV, "div")) and len(n.args) == 2:
            n = n.args[0] if _is_tensor(n.args[0]) else n.args[1]
            continue
        return False
    return False


def _rejected(sm, reason) -> Optional[Site]:
    """A softmax whose probabilities escape is still reported if it looks like attention."""
    x = sm.args[0]
    for _ in range(6):
        if _score_operands(x) is not None:
            s = Site("handwritten", sm, pattern_nodes=[sm])
            s.q, s.k = _score_operands(x)
            s.v = s.k
            s.reject_reason = reason
            return s
        if isinstance(x, fx.Node) and x.args and isinstance(x.args[0], fx.Node):
            x = x.args[0]
        else:
            break
    return None
