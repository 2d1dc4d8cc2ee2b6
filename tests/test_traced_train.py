"""The traced ``int8_train`` ops (torch.library.triton_op: torch.compile sees their launches): which sites get them,
that a compiled model trains through them as through the opaque ops (CPU: the reference traced), and that the
kernels' host code traces into graphs of ATen ops, Triton kernels and the CUDA extension's ops (no GPU needed)."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import sage_compile
from sage_compile import config, policy


@pytest.mark.parametrize("prologue,device,want", [("auto", "cuda", "graph"), ("auto", "cpu", "op"),
                                                   ("graph", "cpu", "graph"), ("graph", "cuda", "graph"),
                                                   ("op", "cuda", "op"), ("graph", "mps", "op")])
def test_train_sites_get_the_traced_op_where_asked(prologue, device, want):
    assert policy.train_prologue(config.Options(prologue=prologue), device) == want


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_every_training_site_gets_the_traced_op_under_auto_on_cuda(mask_kind, symbolic):
    """``auto``: the traced op at every CUDA training site, whatever its mask and sizes (each ran on a GPU: dynamic
    shapes in run 126, a bool mask in run 128, an additive one in run 134); the opaque one on the CPU, or where
    ``prologue="op"`` asks for it."""
    from types import SimpleNamespace

    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    n = ShapeEnv().create_unbacked_symint() if symbolic else 8
    site = SimpleNamespace(q_shape=(2, 4, n, 64), k_shape=(2, 2, n, 64), mask_kind=mask_kind, reject_reason=None,
                           dropout_p=0.0, dtype=torch.bfloat16, head_dim=64, head_dim_v=64,
                           dtypes=(torch.bfloat16,) * 3, hq=4, hkv=2, causal="none", requires_grad=True)
    for device, kw, want in (("cuda", {}, "graph"), ("cpu", {}, "op"), ("cuda", dict(prologue="op"), "op")):
        dec = policy.decide(site, config.resolve(kernel="int8_train", **kw), device)
        assert (dec.scheme, dec.prologue) == ("int8_train", want), (device, kw, dec)
        assert not any("opaque" in n for n in dec.notes), dec.notes


def _loss_and_grads(m, ids):
    logits = m(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in m.parameters()])
    m.zero_grad()
    return loss.detach(), grads


def test_compiled_model_trains_through_the_traced_op_as_through_the_opaque_one():
    """CPU, ``prologue="graph"``: the sites get the traced op, which Inductor decomposes (no call of either op in the
    generated code); loss and gradients are the opaque op's up to Inductor's fp32 rounding of the reference."""
    torch.manual_seed(0)
    model = sage_compile.models.TinyLlama(dim=64, heads=4, kv_heads=2, depth=1)
    ids = torch.randint(0, 512, (2, 33))
    opaque = _loss_and_grads(torch.compile(model, backend=sage_compile.make_backend(kernel="int8_train")), ids)
    traced_model = torch.compile(model, backend=sage_compile.make_backend(kernel="int8_train", prologue="graph"))
    traced, code = run_and_get_code(_loss_and_grads, traced_model, ids)
    code = "\n".join(code)
    assert code.count("def call(") == 2  # forward and backward compiled
    assert not re.search(r"sage_compile\.attention_train\w*\.default\(", code)
    assert abs(traced[0] - opaque[0]) < 1e-3 * opaque[0]
    assert torch.nn.functional.cosine_similarity(traced[1], opaque[1], dim=0) > 0.9999


def _probe_out(*args) -> str:
    """The stdout of ``traced_train_probe.py args`` (run without TRITON_INTERPRET)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = os.path.join(os.path.dirname(__file__), "traced_train_probe.py")
    out = subprocess.run([sys.executable, probe, *args], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _probe(*args):
    return [set(g) for g in json.loads(_probe_out(*args).strip().splitlines()[-1])]


def test_kernels_host_code_traces_into_launches_and_extension_ops():
    """Forward graph: K's mean (ATen), the prologue's Triton launch, the extension's forward; backward graph: the
    preparation's Triton launch, the extension's dK/dV and dQ; neither graph calls a sage_compile op. The stand-in
    extension is defined from the binding's schemas, so this also checks that they parse and fit the calls."""
    fwd, bwd = _probe()
    assert {"aten.mean", "triton:_quant_qkv", "sage_probe_ext.fwd"} <= fwd, fwd
    assert {"triton:_bwd_prep", "sage_probe_ext.dkdv", "sage_probe_ext.dq"} <= bwd, bwd
    assert not any(n.startswith("sage_compile.") for n in fwd | bwd), (fwd, bwd)


# what each Triton kernel of the traced ops writes: the tensors it fills, nothing it only reads
WRITES = {"_quant_qkv": {"Q8", "K8", "V8", "V8T", "QS", "KS", "VS"},
          "_bwd_prep": {"DELTA", "LSE2", "DO16", "DO8T", "SDO", "Q8T", "K8T", "V16"},
          "_fwd_kernel": {"OUT", "LSE"}, "_bwd_dkdv_split": {"DK", "DV"}, "_bwd_dq": {"DQ"}}


def test_traced_kernels_write_only_their_outputs():
    """torch's analysis of the Triton kernels under ``wrap_triton`` (their TTIR, for an sm90 target) finds each
    writing only its outputs, over the sm90 path and the Triton one with a bool mask. Where it takes an input for
    written (it did q, k, v for the prologue, q̂ for the forward and dQ, k̂ and V̂ for dK/dV: index helpers that took
    the tensor's pointer), Inductor clones that input for every launch."""
    written = json.loads(_probe_out("accesses").strip().splitlines()[-1])
    assert {k: set(v) for k, v in written.items()} == WRITES


def test_each_kernel_is_analysed_once_for_every_site_of_a_graph():
    """torch generates a kernel's TTIR at each ``wrap_triton`` launch to find what it writes (~35 ms on the CPU, for
    every launch of every site, forward and backward). Kept per kernel and arguments, a graph of three bool-masked
    sites (the Triton kernels, 15 launches a site) analyses nothing a graph of one has not."""
    one, three = json.loads(_probe_out("cache").strip().splitlines()[-1])
    assert one["misses"] > 0, one
    assert three == {"hits": 3 * (one["hits"] + one["misses"]), "misses": 0}, (one, three)


def test_sites_on_one_mask_check_it_once_a_graph():
    """The device-side check of a head-shared bool mask (three launches) is one opaque op in the traced ops; in a
    graph of three sites on one mask, partitioned as torch.compile does (CSE of the joint graph, then min-cut), the
    forward calls it once and the backward reuses its answer (it had run in each site's forward and backward)."""
    fwd, bwd = json.loads(_probe_out("cse").strip().splitlines()[-1])
    assert fwd.get("sage_compile.train_mask_gate") == 1 and "sage_compile.train_mask_gate" not in bwd, (fwd, bwd)
    for kernel in ("triton:_key_range", "triton:_mask_mismatch", "triton:_gate"):
        assert kernel not in fwd and kernel not in bwd, kernel
    assert fwd["triton:_fwd_kernel"] == 3 and bwd["triton:_bwd_dq"] == 3  # (each site's launches are still there)


def test_access_key_separates_what_the_analysis_depends_on(monkeypatch):
    """The analysis cache's key: the same for another tensor of the same dtype or another symbolic size; different
    for a dtype, an integer's value (Triton specialises on some), a constexpr, a None; no key (torch's own analysis)
    for TMA metadata, an argument it cannot stand for, or another package's kernel."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from sage_compile import _compat
    from sage_compile.kernels.int8_train.attention import _gate

    monkeypatch.setattr(_compat, "_triton_target", lambda: "sm90")
    with FakeTensorMode():
        i32, i32b, f32 = torch.empty(4, dtype=torch.int32), torch.empty(8, dtype=torch.int32), torch.empty(4)

    def key(kernel=_gate, rest=({},), **kw):
        return _compat._access_key(kernel, dict(dict(FLAG=i32, KRANGE=i32, GATE=i32, B=2, LK=128, BLOCK_B=16), **kw),
                                   rest, {})

    base = key()
    assert base is not None and key(FLAG=i32b) == base
    assert len({base, key(FLAG=f32), key(LK=16), key(BLOCK_B=32), key(FLAG=None)}) == 5
    sym = [ShapeEnv().create_unbacked_symint() for _ in range(2)]
    assert key(LK=sym[0]) == key(LK=sym[1]) != base
    assert key(rest=({"FLAG": ("stable", ([16],))},)) is None and key(LK=object()) is None
    assert key(kernel=SimpleNamespace(**{"__module__": "elsewhere"})) is None


def test_traced_op_compiles_once_for_three_sequence_lengths():
    """Under ``dynamic=True`` the traced op's host code keeps sizes symbolic: the launches' integer arguments, and
    the extension ops' causal offset and strides (``SymInt`` in their schemas: as ``int`` they were made constants,
    a compile per length). Three lengths, one forward and one backward graph."""
    graphs = _probe("dynamic")
    assert len(graphs) == 2, len(graphs)
