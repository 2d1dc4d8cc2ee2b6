"""Run by tests/test_traced_train.py in a process without TRITON_INTERPRET (the interpreter's kernels cannot be
wrapped for tracing): AOTAutograd traces the traced ``int8_train`` op's forward and backward on meta tensors through
the kernels' host code (the CUDA path, with a stand-in extension whose torch ops have the schemas of
``csrc/int8_train_sm90_bind.cpp``: its TORCH_LIBRARY block), and prints each graph's ops (Triton kernels as
``triton:<name>``) as JSON; with ``dynamic``, the graphs torch.compile(dynamic=True) makes over three lengths; with
``accesses``, the tensors torch's analysis of each Triton kernel finds written (what it clones for the kernel, and
writes back where it is an input), over the sm90 path without a mask and the Triton path with a head-shared bool
mask: ``{kernel: [written argument, ...]}``; with ``cache``, the misses and hits of the cached analysis
(:func:`sage_compile._compat.cache_triton_access_analysis`) over graphs of one and then three bool-masked sites;
with ``cse``, how often each op and kernel appears in the forward and backward graphs of three sites on one bool
mask, partitioned as torch.compile does."""
import collections
import json
import sys
import types

import torch
import triton
import sage_compile.ops as O
import sage_compile.kernels.int8_train as KT
from sage_compile.kernels.int8_train import cuda as KC
from functorch.compile import aot_function
from helpers import graph_ops, record_kernel_writes, train_op_schemas
from sage_compile.kernels.cuda_ext import register_fakes

# no GPU here: a stand-in driver naming an sm90 target, so that torch reads each Triton kernel's TTIR to find the
# tensors it writes (without one it assumes every argument written, dO and the saved O included, as on no GPU)
from triton.backends.compiler import GPUTarget  # noqa: E402
triton.runtime.driver.set_active(types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32)))
O._IMPLS[("int8_train", "meta")] = KT.impl
ns = "sage_probe_ext"
lib = torch.library.Library(ns, "DEF")
for schema in train_op_schemas().values():
    lib.define(schema)
register_fakes(ns, KC.OPS)
KC.load = lambda: types.SimpleNamespace(__name__=ns)
KC.unsupported = KC.call_rules
graphs = []

def comp(g, _):
    """Record the graph's ops (the compiler of both graphs; runs nothing)."""
    graphs.append(sorted(set(graph_ops(g))))
    return g

def f(q, k, v):
    return torch.ops.sage_compile.attention_train_traced(q, k, v, None, "top_left", None, "HND", "split")[0]


def masked_sites(n):
    """A function of (q, k, v, mask) summing ``n`` traced-op sites on one mask (no causal rule)."""
    def g(q, k, v, mask):
        return sum(torch.ops.sage_compile.attention_train_traced(q, k, v, mask, "none", None, "HND", "split")[0]
                   for _ in range(n))
    return g


MASK = torch.empty(1, 1, 128, 128, dtype=torch.bool, device="meta")  # a head-shared bool mask at 128 tokens


def inputs(n):
    q = torch.empty(1, 4, n, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    return (q, *(torch.empty(1, 2, n, 64, dtype=torch.bfloat16, device="meta", requires_grad=True) for _ in range(2)))


if sys.argv[1:] == ["accesses"]:
    written = record_kernel_writes()
    aot_function(f, fw_compiler=comp, bw_compiler=comp)(*inputs(128)).sum().backward()  # the sm90 path
    KC.unsupported = lambda *a, **k: "probe: the Triton kernels"
    aot_function(masked_sites(1), fw_compiler=comp, bw_compiler=comp)(*inputs(128), MASK).sum().backward()
    print(json.dumps({k: sorted(v) for k, v in written.items()}))
    sys.exit()
if sys.argv[1:] == ["cache"]:  # torch's access analysis over graphs of 1 and then 3 bool-masked sites: misses, hits
    from sage_compile import _compat as C

    KC.unsupported = lambda *a, **k: "probe: the Triton kernels"
    seen = []
    for n in (1, 3):
        before = dict(C.ACCESS_STATS)
        aot_function(masked_sites(n), fw_compiler=comp, bw_compiler=comp)(*inputs(128), MASK).sum().backward()
        seen.append({k: C.ACCESS_STATS[k] - before[k] for k in before})
    print(json.dumps(seen))
    sys.exit()
if sys.argv[1:] == ["cse"]:  # three sites on one head-shared bool mask, partitioned as torch.compile does (min-cut,
    # after CSE of the joint graph): per graph, how often each op and Triton kernel appears
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    counts = []

    def count(g, _):
        counts.append(dict(collections.Counter(graph_ops(g))))
        return g

    aot_function(masked_sites(3), fw_compiler=count, bw_compiler=count,
                 partition_fn=min_cut_rematerialization_partition)(*inputs(128), MASK).sum().backward()
    print(json.dumps(counts))
    sys.exit()
if sys.argv[1:] == ["dynamic"]:  # torch.compile(dynamic=True) over three sequence lengths: the graphs compiled
    from torch._dynamo.backends.common import aot_autograd

    cf = torch.compile(f, backend=aot_autograd(fw_compiler=comp, bw_compiler=comp), dynamic=True)
    for n in (192, 256, 320):  # (more than one 128-query block each: a single block is a size-1 dimension, guarded)
        cf(*inputs(n)).sum().backward()
else:  # AOTAutograd at 128 tokens: the forward's and the backward's ops
    aot_function(f, fw_compiler=comp, bw_compiler=comp)(*inputs(128)).sum().backward()
print(json.dumps(graphs))
