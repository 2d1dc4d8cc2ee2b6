"""Replace attention sites by the prologue + core ops of their scheme (in place on the FX graph)."""
from __future__ import annotations

import operator

import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher

from .site import Site, val


def _fake_mode(site: Site):
    """The fake mode of the site's own example values (the tracing context's may be another one: mixing
    the two fails, and the new nodes would get no ``example_value``, which AOTAutograd's cache needs)."""
    t = val(site.q)
    return getattr(t, "fake_mode", None) or torch._guards.detect_fake_mode([t])


def _set_meta(node: fx.Node, fake_mode) -> None:
    """Fill ``example_value`` of a new node by running it on fake tensors (best effort)."""
    if fake_mode is None:
        return
    args = fx.node.map_arg(node.args, val)
    kwargs = fx.node.map_arg(node.kwargs, val)
    try:
        # the python dispatcher, as Dynamo's own fake propagation: ops on symbolic shapes (addcdiv's broadcast,
        # F.pad's symbolic pads) take their Python meta functions, not C++ kernels that want concrete sizes
        with fake_mode, enable_python_dispatcher():
            if node.op == "call_method":
                out = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                out = node.target(*args, **kwargs)
        node.meta["example_value"] = out
    except Exception:  # metadata is an optimisation for later passes, never a reason to fail
        pass


def _scale_arg(graph: fx.Graph, site: Site, emit):
    s = site.scale
    if not (isinstance(s, tuple) and s and s[0] == "factors"):
        return s  # SDPA: None, a float or a symbolic node
    out = 1.0
    for op, f in s[1]:
        if isinstance(out, (int, float)) and isinstance(f, (int, float)):
            out = out * f if op == "mul" else out / f
        else:
            out = emit("call_function", operator.mul if op == "mul" else operator.truediv, (out, f))
    return float(out) if isinstance(out, (int, float)) else out


GRAPH_PROLOGUE_SCHEMES = ("int8_fp8", "int8_fp16", "fp4")  # the schemes whose sites call _prologue


def _reference_prologue(scheme: str):
    import importlib

    return importlib.import_module(f"sage_compile.reference.{scheme}").quantize


def graph_prologue_functions() -> list:
    """The Python functions the rewrite may put in a graph as the graph prologue (one per scheme)."""
    return [_reference_prologue(s) for s in GRAPH_PROLOGUE_SCHEMES]


def _prologue(scheme: str, options, device_type: str, choice=None):
    """The prologue a site calls: the custom op, or the reference's torch code (``graph``), which
    AOTAutograd traces into ATen ops that Inductor fuses with q/k/v's producers. ``choice`` (``graph`` |
    ``op``): the policy's decision for the site; without it, ``options.prologue`` as the policy reads it
    for a site of unknown size (:func:`sage_compile.policy.prologue_for`)."""
    from sage_compile.policy import prologue_for

    if choice is None:
        choice = prologue_for(None, options, scheme, device_type)
    if choice == "graph":
        return _reference_prologue(scheme)
    return getattr(torch.ops.sage_compile, f"quantize_{scheme}").default


def rewrite(gm, sites: list[Site], decisions: list, options=None) -> int:
    """Rewrite every site whose decision carries a scheme; returns the number replaced."""
    graph = getattr(gm, "graph", gm)
    ops = torch.ops.sage_compile
    if options is None:
        from sage_compile.config import Options

        options = Options()
    n_done = 0
    for site, dec in zip(sites, decisions):
        if dec.scheme is None:
            continue
        fm = _fake_mode(site)
        with graph.inserting_before(site.node):
            def emit(op, target, args, kwargs=None):
                n = graph.create_node(op, target, tuple(args), kwargs or {})
                _set_meta(n, fm)
                return n

            q, k, v = site.q, site.k, site.v
            mask = site.mask
            if isinstance(mask, tuple):  # masked_fill(cond) / where(cond, fill, x): keep = ~cond
                mask = emit("call_function", operator.invert, (mask[0],))
            if site.rank3:
                q, k, v = (emit("call_method", "unsqueeze", (t, 0)) for t in (q, k, v))
                if mask is not None and val(mask).dim() == 3:
                    mask = emit("call_method", "unsqueeze", (mask, 0))
            ac = site.autocast_dtype
            if ac is not None:  # what autocast would do to SDPA's inputs, done explicitly
                q, k, v = (t if val(t).dtype == ac else emit("call_method", "to", (t, ac)) for t in (q, k, v))
            scale = _scale_arg(graph, site, emit)
            out_dtype = site.dtype
            if options.switchable and dec.scheme != "int8_train":  # the composed op: run-time overrides
                out = emit("call_function", ops.attention.default,
                           (q, k, v, mask, site.causal, scale, site.layout, dec.scheme, options.encode()))
            elif dec.scheme == "int8_fp8":
                traced = dec.prologue == "traced"
                qt = emit("call_function", ops.quantize_int8_fp8_traced.default if traced else
                          _prologue("int8_fp8", options, site.device_type, dec.prologue),
                          (q, k, v, site.layout, options.int8_channel_rescale, options.int8_balance_tokens))
                parts = [emit("call_function", operator.getitem, (qt, i)) for i in range(6)]
                core = ops.attention_int8_fp8_traced if traced else ops.attention_int8_fp8
                out = emit("call_function", core.default, (*parts, mask, site.causal, scale, site.layout, out_dtype))
            elif dec.scheme == "int8_fp16":
                qt = emit("call_function", _prologue("int8_fp16", options, site.device_type, dec.prologue),
                          (q, k, v, site.layout))
                parts = [emit("call_function", operator.getitem, (qt, i)) for i in range(5)]
                out = emit("call_function", ops.attention_int8_fp16.default,
                           (*parts, mask, site.causal, scale, site.layout, out_dtype))
            elif dec.scheme == "fp4":
                o = options
                qt = emit("call_function", _prologue("fp4", options, site.device_type, dec.prologue),
                          (q, k, v, site.layout, o.fp4_delta_s, o.fp4_smooth, o.fp4_q_block, o.fp4_v_smooth,
                           o.fp4_qk_scale, o.fp4_qk_balance))
                parts = [emit("call_function", operator.getitem, (qt, i)) for i in range(8)]
                out = emit("call_function", ops.attention_fp4.default,
                           (*parts, mask, site.causal, scale, site.layout, out_dtype, site.head_dim, o.fp4_p_scale))
            elif dec.scheme == "int8_train":
                op = ops.attention_train_traced if dec.prologue == "graph" else ops.attention_train
                pair = emit("call_function", op.default,
                            (q, k, v, mask, site.causal, scale, site.layout, options.int8_train_psi))
                out = emit("call_function", operator.getitem, (pair, 0))
            else:
                raise ValueError(f"rewrite: no ops for scheme {dec.scheme!r}")
            if site.layout == "NHD":
                out = emit("call_method", "transpose", (out, 1, 2))
            if site.rank3:
                out = emit("call_method", "squeeze", (out, 0))
            want = val(site.node).dtype if isinstance(val(site.node), torch.Tensor) else out_dtype
            if want != out_dtype:
                out = emit("call_method", "to", (out, want))
        out.meta["stack_trace"] = site.node.meta.get("stack_trace")
        site.node.replace_all_uses_with(out)
        for n in reversed(sorted(set(site.pattern_nodes), key=_order(graph))):
            if not n.users and n.graph is graph:
                graph.erase_node(n)
        n_done += 1
    graph.lint()
    if hasattr(gm, "recompile"):
        gm.recompile()
    return n_done


def _order(graph):
    pos = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: pos.get(n, -1)
