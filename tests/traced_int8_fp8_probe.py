"""Run by tests/test_traced_int8_fp8.py in a process without TRITON_INTERPRET (the interpreter's kernels cannot be
wrapped for tracing): AOTAutograd traces the traced ``int8_fp8`` ops (prologue, then core) on meta tensors through the
kernels' host code, with a stand-in CUDA extension whose torch op has the schema of ``csrc/int8_fp8_sm90_bind.cpp``
(its TORCH_LIBRARY block), and prints as JSON each graph's ops (Triton kernels as ``triton:<name>``, once per
launch): ``cuda`` (the CUDA core; the core choice is stubbed: nothing can be timed here), ``triton`` (the Triton core,
autotuned) and ``mask`` (a head-shared bool mask: the device-side structure check, the ranged CUDA launches and the
general Triton launch); and ``accesses``, over all three, the tensors torch's analysis of each Triton kernel finds
written (what Inductor would clone for the kernel where it is an input): ``{kernel: [written argument, ...]}``;
``dynamic``, the graphs of three lengths under dynamic shapes; ``capped`` (``cuda`` with K's register-capped opaque
op from any size) and ``capped_dynamic`` (the last dynamic graph with it); ``stores``, the stores of Inductor's own
kernels for RoPE feeding the ops through the backend (Inductor's code for a stand-in sm90 target, never run), with
the prologue op, the traced ops, and the traced ops without :func:`sage_compile._compat.user_kernel_inputs_realized`."""
import contextlib
import json
import re
import types

import torch
import triton
from functorch.compile import aot_function
from helpers import graph_ops, op_schemas, record_kernel_writes
from triton.backends.compiler import GPUTarget

import sage_compile._compat as C
import sage_compile.ops as O
from sage_compile import make_backend
from sage_compile.debug_codegen import generated_code, sm90_codegen
from sage_compile.kernels import int8_fp8 as KF
from sage_compile.kernels.cuda_ext import register_fakes
from sage_compile.kernels.int8_fp8 import cuda as KC
from sage_compile.kernels.int8_fp8 import quantize as QZ

# no GPU here: a stand-in driver naming an sm90 target, so that torch reads each Triton kernel's TTIR to find the
# tensors it writes (without one it assumes every argument written)
triton.runtime.driver.set_active(types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32)))
O._IMPLS[("int8_fp8", "meta")] = KF.impl
ns = "sage_probe_fp8_ext"
lib = torch.library.Library(ns, "DEF")
for schema in op_schemas("int8_fp8_sm90_bind.cpp").values():
    lib.define(schema)
register_fakes(ns, KC.OPS)
KC.load = lambda: types.SimpleNamespace(__name__=ns)
KC.prefer_cuda_traced = lambda *a: True
graphs = []
K_CAP_MIN = QZ.K_CAP_MIN_ELEMENTS


def comp(g, _):
    graphs.append(graph_ops(g))
    return g


def unsupported_on(mask_ok: bool):
    """``cuda.unsupported`` without a device: the CUDA core for unmasked calls (and, with ``mask_ok``, the ranged
    launches of a structured mask), none otherwise."""
    return lambda q8, k8, attn_mask, out_dtype, scale=None: (
        None if attn_mask is None or mask_ok else "probe: masks run on the Triton core")


def f(q, k, v, mask=None):
    ops = torch.ops.sage_compile
    qt = ops.quantize_int8_fp8_traced(q, k, v, "HND", True)
    return ops.attention_int8_fp8_traced(*qt, mask, "none", None, "HND", torch.bfloat16)


q = torch.empty(1, 4, 256, 128, dtype=torch.bfloat16, device="meta")
k, v = (torch.empty(1, 2, 256, 128, dtype=torch.bfloat16, device="meta") for _ in range(2))
mask = torch.empty(1, 1, 256, 256, dtype=torch.bool, device="meta")


def trace(which):
    if which == "cuda":
        KC.unsupported = unsupported_on(False)
        aot_function(f, fw_compiler=comp)(q, k, v)
    elif which == "triton":
        KC.unsupported = lambda *a, **kw: "probe: the Triton core"
        aot_function(f, fw_compiler=comp)(q, k, v)
    else:  # mask
        KC.unsupported = unsupported_on(True)
        KC.known_choice = lambda *a: True
        aot_function(f, fw_compiler=comp)(q, k, v, mask)


written = record_kernel_writes()
result = {}
for which in ("cuda", "triton", "mask"):
    trace(which)
    result[which] = graphs.pop()
assert not graphs
result["accesses"] = {k: sorted(v) for k, v in written.items()}
# K from any size on the capped opaque op (its threshold lowered to one element): static sizes, then dynamic ones
QZ.K_CAP_MIN_ELEMENTS = 1
trace("cuda")
result["capped"] = graphs.pop()
# torch.compile(dynamic=True) over three lengths (the CUDA core): the graphs compiled
from torch._dynamo.backends.common import aot_autograd  # noqa: E402

KC.unsupported = unsupported_on(False)
cf = torch.compile(f, backend=aot_autograd(fw_compiler=comp), dynamic=True)
for n in (1024, 1536, 2048):
    cf(torch.empty(1, 4, n, 128, dtype=torch.bfloat16, device="meta"),
       *(torch.empty(1, 2, n, 128, dtype=torch.bfloat16, device="meta") for _ in range(2)))
result["dynamic"] = len(graphs)
result["capped_dynamic"] = graphs[-1]
graphs.clear()
QZ.K_CAP_MIN_ELEMENTS = K_CAP_MIN


# RoPE feeding the ops, through the backend (CPU tensors, the kernels registered for the CPU, Inductor's code for a
# stand-in sm90 target, never run): the stores of Inductor's own kernels with the prologue op, the traced ops, and
# the traced ops without sage_compile._compat.user_kernel_inputs_realized
def rope(x, cos, sin):
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return (x * cos + torch.stack([-x2, x1], -1).flatten(-2) * sin).to(x.dtype)


def rope_attention(q, k, v, cos, sin):
    return torch.nn.functional.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v)


def inductor_stores(prologue):
    with sm90_codegen():
        code = generated_code(rope_attention, *cpu_inputs, backend=make_backend(kernel="int8_fp8", prologue=prologue))
    return sum(m.group(0).count("tl.store") for m in re.finditer(r"def triton_\w+\(.*?(?=\n''')", code, re.S))


O._IMPLS[("int8_fp8", "cpu")] = KF.impl
cpu_inputs = [torch.randn(1, 4, 256, 128, dtype=torch.bfloat16) for _ in range(3)] + [torch.randn(256, 128)] * 2
result["stores"] = {p: inductor_stores(p) for p in ("op", "traced")}
C.user_kernel_inputs_realized = contextlib.nullcontext
result["stores"]["traced_unpatched"] = inductor_stores("traced")
print(json.dumps(result))
