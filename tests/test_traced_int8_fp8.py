"""The traced ``int8_fp8`` ops (``prologue="traced"``: torch.library.triton_op, so Inductor makes their launches and
the kernels' host code runs once per compile): which sites get them, that a compiled model gives the opaque ops'
values through them (CPU: the reference traced), and that the kernels' host code traces into a graph of allocations,
Triton launches and the CUDA extension's op, with no kernel taking an input for written (no GPU needed)."""
import collections
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


@pytest.mark.parametrize("scheme,want", [("int8_fp8", "traced"), ("fp4", "op"), ("int8_fp16", "op")])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_traced_prologue_goes_to_the_schemes_with_traced_ops(scheme, want, device):
    assert policy.prologue_for(None, config.Options(prologue="traced"), scheme, device) == want


def test_traced_prologue_decision_and_its_note():
    from types import SimpleNamespace

    site = SimpleNamespace(q_shape=(1, 4, 64, 64), k_shape=(1, 4, 64, 64), mask_kind="none", reject_reason=None,
                           dropout_p=0.0, dtype=torch.bfloat16, head_dim=64, head_dim_v=64,
                           dtypes=(torch.bfloat16,) * 3, hq=4, hkv=4, causal="none", requires_grad=False)
    dec = policy.decide(site, config.resolve(kernel="int8_fp8", prologue="traced"), "cuda")
    assert (dec.scheme, dec.prologue) == ("int8_fp8", "traced"), dec
    assert not any("prologue" in n for n in dec.notes), dec.notes
    dec = policy.decide(site, config.resolve(kernel="fp4", prologue="traced"), "cuda")
    assert dec.prologue == "op" and any("no traced ops for fp4" in n for n in dec.notes), dec
    train = dict(vars(site), requires_grad=True)
    dec = policy.decide(SimpleNamespace(**train), config.resolve(kernel="int8_train", prologue="traced"), "cuda")
    assert (dec.scheme, dec.prologue) == ("int8_train", "graph"), dec  # (the traced training op)


def test_compiled_model_runs_the_traced_ops_with_the_opaque_ops_values():
    """CPU: the sites get the traced ops, which Inductor decomposes (no call of a sage_compile op in the generated
    code); the output is the opaque ops' up to Inductor's fp32 rounding of the reference."""
    torch.manual_seed(0)
    model = sage_compile.models.TinyLlama(dim=64, heads=4, kv_heads=2, depth=1).eval()
    ids = torch.randint(0, 512, (2, 33))
    with torch.no_grad():
        opaque, code_op = run_and_get_code(
            torch.compile(model, backend=sage_compile.make_backend(kernel="int8_fp8", prologue="op")), ids)
        traced, code = run_and_get_code(
            torch.compile(model, backend=sage_compile.make_backend(kernel="int8_fp8", prologue="traced")), ids)
    assert re.search(r"sage_compile\.quantize_int8_fp8\.default\(", "\n".join(code_op))  # (the check can fail)
    assert not re.search(r"torch\.ops\.sage_compile\.\w+", "\n".join(code))
    assert torch.nn.functional.cosine_similarity(traced.flatten(), opaque.flatten(), dim=0) > 0.99999
    assert (traced - opaque).abs().max() < 1e-4 * opaque.abs().max()


@pytest.fixture(scope="module")
def probe():
    """``traced_int8_fp8_probe.py``'s graphs and written tensors (run without TRITON_INTERPRET)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = os.path.join(os.path.dirname(__file__), "traced_int8_fp8_probe.py")
    out = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


PROLOGUE = {"triton:_chan_stats": 1, "triton:_stats_finalize": 1, "triton:_quant_rows_int8": 2,
            "triton:_quant_v_fp8": 1}


@pytest.mark.parametrize("path,core", [
    ("cuda", {"sage_probe_fp8_ext.fwd": 1}),
    ("triton", {"triton:_fwd_body": 1}),  # (the autotuned core: its autotuner wraps _fwd_body)
    ("mask", {"triton:_key_range": 1, "triton:_mask_mismatch": 1, "sage_probe_fp8_ext.fwd": 2,
              "triton:_fwd_body": 1}),
])
def test_kernels_host_code_traces_into_launches_and_the_extension_op(probe, path, core):
    """The graph of a prologue + core call holds the prologue's five Triton launches (one statistics pass, its
    finalization, the INT8 passes of Q and K, the FP8 pass of V) and the core's launches, nothing else but
    allocations, views (the mask's; Q's balance sample, where the queries outnumber it) and the functionalization
    wrappers: no sage_compile op, no copy."""
    ops = collections.Counter(probe[path])
    launches = {k: n for k, n in ops.items() if k.startswith("triton:") or k.startswith("sage_probe_fp8_ext.")}
    assert launches == {**PROLOGUE, **core}, launches
    rest = set(ops) - set(launches)
    assert rest <= {"aten.empty", "aten.expand", "aten.slice", "higher_order.triton_kernel_wrapper_functional",
                    "higher_order.auto_functionalized_v2"}, rest


def test_large_k_runs_its_register_capped_quantizer_as_an_opaque_op(probe):
    """Inductor drops a user kernel's ``maxnreg``, so from K_CAP_MIN_ELEMENTS (lowered to 1 here) a traced call
    quantizes K (hd128) through the opaque ``quant_k_rows_capped`` instead of an Inductor launch; Q's pass stays a
    launch; at symbolic sizes K's does too (no size guard)."""
    ops = collections.Counter(probe["capped"])
    assert ops["sage_compile.quant_k_rows_capped"] == 1 and ops["triton:_quant_rows_int8"] == 1, ops
    dyn = collections.Counter(probe["capped_dynamic"])
    assert "sage_compile.quant_k_rows_capped" not in dyn and dyn["triton:_quant_rows_int8"] == 2, dyn


def test_no_traced_kernel_takes_an_input_for_written(probe):
    """torch's analysis of each Triton kernel finds only its outputs written: an input taken for written would be
    cloned by Inductor before every launch (q, k and v copied once more per call). The kernels' index helpers take
    no pointer for this (:func:`sage_compile.kernels.int8_fp8.quantize.token_tile_index`)."""
    assert probe["accesses"] == {
        "_chan_stats": ["MAX0", "MAX1", "MAX2", "MIN0", "SUM0"], "_stats_finalize": ["MEAN", "S", "VS"],
        "_quant_rows_int8": ["S", "Y"], "_quant_v_fp8": ["Y"], "_key_range": ["BAD", "KRANGE"],
        "_mask_mismatch": ["BAD", "FLAG"], "_fwd_body": ["OUT"]}


def test_traced_ops_compile_once_over_lengths_under_dynamic_shapes(probe):
    """torch.compile(dynamic=True) over three lengths: one graph (the host code's sizes stay symbols: the CUDA core
    takes them as SymInt, the K padding check guards nothing at these lengths)."""
    assert probe["dynamic"] == 1


def test_rope_outputs_are_stored_once_for_the_traced_ops(probe):
    """RoPE feeding the traced ops: Inductor's own kernels store as much as with the prologue op (q and k once each).
    Each user-defined Triton kernel's stride constraint copies an unrealized input for itself, so without the
    backend's :func:`sage_compile._compat.user_kernel_inputs_realized` q and k were stored twice (the statistics pass
    and the INT8 pass each read their own copy)."""
    stores = probe["stores"]
    assert stores["traced"] == stores["op"], stores
    assert stores["traced_unpatched"] >= stores["traced"], stores
