"""Masks that are constants of the graph.

Under ``torch.compile`` transformers materialises its causal mask in the graph (compile.md §6.3). Called with
``input_ids`` alone and static shapes, that mask is built from ``arange`` and the sizes only: nothing the graph
takes as input reaches it, so every call computes the same mask. Such a bool mask is evaluated once here, at
compile time; where it equals the causal rule (bottom-right) or is all true, the site takes the rule and no mask
(the mask's nodes then die in the graph, and the op needs no check of its structure at run time). Any other mask is
left to the op: one that depends on an input (an ``attention_mask``, symbolic sizes), on a module attribute or on
randomness, one written into before the call reads it, one too large to evaluate cheaply.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch import fx

from .site import val

MAX_ELEMENTS = 1 << 26  # a constant mask larger than this (64M values) is left to the op's device-side check
# ops whose values differ from call to call: a mask built with one is no constant
_RANDOM = ("rand", "randn", "randint", "randperm", "bernoulli", "multinomial", "normal", "dropout", "uniform",
           "exponential", "poisson", "rand_like", "randn_like", "randint_like")


def _name(target) -> str:
    """An FX target's name: a method's string, a function's or an aten overload's ``__name__``."""
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _random(target) -> bool:
    """Whether an FX target draws random numbers (torch functions, Tensor methods by name, aten overloads)."""
    if torch.Tag.nondeterministic_seeded in getattr(target, "tags", ()):
        return True
    return any(tok == r or tok.startswith(r + "_") for tok in _name(target).split(".") for r in _RANDOM)


def _ancestors(node: fx.Node) -> Optional[list]:
    """``node`` and every node it depends on, in graph order; None where a placeholder (an input of the graph), a
    module attribute (a buffer the caller may change between calls) or an op that is not a pure function is among
    them."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op not in ("call_function", "call_method"):
            return None
        if _random(n.target):
            return None
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def _mutates(n: fx.Node) -> bool:
    """Whether ``n`` may write into one of its inputs: ``x[i] = ...``, an in-place op (``*_``), an ``out=`` argument."""
    if n.op not in ("call_function", "call_method"):
        return False
    if n.target in (operator.setitem, operator.delitem):
        return True
    name = _name(n.target)
    return (name.endswith("_") and not name.endswith("__")) or "out" in n.kwargs


def _written_before(nodes: list, use: fx.Node) -> bool:
    """Whether a node before ``use`` in the graph writes into one of ``nodes`` or into anything derived from them
    (a view of one, say) before ``use`` reads them."""
    reach = set(nodes)
    for n in use.graph.nodes:
        if n is use:
            return False
        if n in reach:
            continue
        if any(a in reach for a in n.all_input_nodes):
            if _mutates(n):
                return True
            reach.add(n)  # (may alias: its writes count too)
    return False


def _static_shape(t) -> Optional[tuple]:
    if not isinstance(t, torch.Tensor) or any(not isinstance(s, int) for s in t.shape):
        return None
    return tuple(t.shape)


def constant_mask_rule(mask: fx.Node, lq: int, lk: int, use: fx.Node) -> Optional[str]:
    """The index rule a bool ``attn_mask`` node stands for when it is a constant of its graph: ``"bottom_right"``
    (key n kept for query m iff n <= m + lk - lq, every batch and head), ``"none"`` (all kept), else None (a mask
    that depends on an input or on randomness, is written into before ``use`` (the SDPA call) reads it, has
    symbolic sizes, is not bool, is larger than :data:`MAX_ELEMENTS`, or is neither rule). ``lq``, ``lk``: the
    call's query and key counts."""
    t = val(mask)
    shape = _static_shape(t)
    if shape is None or t.dtype != torch.bool or len(shape) < 2 or tuple(shape[-2:]) not in ((lq, lk), (1, lk)):
        return None
    if t.numel() > MAX_ELEMENTS:
        return None
    nodes = _ancestors(mask)
    if nodes is None or _written_before(nodes, use):
        return None
    g = fx.Graph()
    env: dict = {}
    for n in nodes:
        env[n] = g.node_copy(n, lambda x: env[x])
    g.output(env[mask])
    try:
        with torch.no_grad():
            m = fx.GraphModule(torch.nn.Module(), g)()
    except Exception:  # noqa: BLE001  (whatever fails to run here is left to the op)
        return None
    if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or tuple(m.shape) != shape:
        return None
    if bool(m.all()):
        return "none"
    if shape[-2] != lq:
        return None
    rule = torch.ones(lq, lk, dtype=torch.bool, device=m.device).tril(lk - lq)
    return "bottom_right" if bool((m == rule).all()) else None
