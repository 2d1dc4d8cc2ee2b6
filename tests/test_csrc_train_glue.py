"""The Python side of the CUDA SageBwd kernels (SAGE_COMPILE_INT8_TRAIN_CORE=cuda) on a CPU machine: the forward and
the psi="split" backward of sage_compile.kernels.int8_train, with the built extension replaced by a PyTorch model of
its contract (tests/cuda_train_model.py), give the reference's O, LSE and gradients (conventions.md rule 2: the same
error vs fp32 autograd, far closer to the reference than either is to fp32). That checks what the GPU cannot check
before its first run: the arguments the glue prepares (units, causal offset, the transposed operands, GQA, the output
strides of both layouts) and that the model takes exactly the binding's parameters. The prologue, the transposes
and the backward's preparation kernel run in Triton's interpreter. The kernels themselves are tested on the GPU
(test_kernel_int8_train_cuda_gpu.py)."""
import os
import re

import pytest
import torch
from helpers import cos_rel, train_op_schemas

if torch.cuda.is_available():
    pytest.skip("GPU machine: the CUDA kernels themselves are tested there", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

import cuda_train_model as M  # noqa: E402

from sage_compile.kernels import cuda_ext  # noqa: E402
from sage_compile.kernels.int8_train import attention as KA  # noqa: E402
from sage_compile.kernels.int8_train import cuda  # noqa: E402
from sage_compile.kernels.int8_train import quantize as KQ  # noqa: E402
from sage_compile.reference import int8_train as R  # noqa: E402

if not KQ.EMULATE_FP8:
    pytest.skip("kernels were imported before TRITON_INTERPRET was set", allow_module_level=True)

CPP_KINDS = {"const at::Tensor&": "T", "at::Tensor&": "T", "double": "f", "bool": "b", "int64_t": "i"}
SCHEMA_KINDS = {"Tensor": "T", "float": "f", "bool": "b", "int": "i", "SymInt": "i"}


def test_model_takes_the_bindings_parameters():
    """The model's parameter kinds (tensor, float, bool, int) are the binding's, in order, and its torch ops'
    schemas' (TORCH_LIBRARY: a schema that does not fit the function fails the extension's load on the GPU)."""
    with open(cuda_ext.source_paths(("int8_train_sm90_bind.cpp",))[0]) as f:
        text = f.read()
    for name, kinds in M.KINDS.items():
        params = re.search(rf"\nvoid {name}\((.*?)\) {{", text, re.S).group(1)
        got = tuple(CPP_KINDS[" ".join(p.split()[:-1])] for p in params.replace("\n", " ").split(","))
        assert got == kinds, name
        assert re.search(rf'm\.def\("{name}", &{name},', text), name
        # the same function as a torch op (what a traced call's graph holds): its schema's kinds, a CUDA kernel
        schema = train_op_schemas()[name]
        schema = schema[schema.index("(") + 1:schema.rindex(") -> ")]
        ops_kinds = tuple(SCHEMA_KINDS[p.split()[0].split("(")[0]] for p in schema.split(","))
        assert ops_kinds == kinds, name
        assert re.search(rf'm\.impl\("{name}", &{name}\);', text), name


@pytest.fixture
def model(monkeypatch):
    """The CUDA path asked for, its device check skipped (the call rules kept), the model as the built module."""
    monkeypatch.setenv("SAGE_COMPILE_INT8_TRAIN_CORE", "cuda")
    monkeypatch.setattr(cuda, "unsupported", cuda.call_rules)
    monkeypatch.setattr(cuda, "load", lambda: M)
    M.CALLS.clear()
    M.RAN.clear()
    return M


CASES = {  # (d, causal, B, Hq, Hkv, Lq, Lk, layout, dtype)
    "d64_causal_gqa": (64, "top_left", 1, 4, 2, 192, 192, "HND", torch.bfloat16),
    "d128_bottom_right_nhd": (128, "bottom_right", 1, 4, 2, 96, 160, "NHD", torch.float16),  # (H > 1: strides seen)
    "d64_more_queries_than_keys": (64, "bottom_right", 2, 2, 2, 160, 96, "HND", torch.bfloat16),  # rows see no key
    "d128_none_ragged": (128, "none", 1, 2, 2, 80, 144, "HND", torch.bfloat16),
}


def _inputs(d, b, hq, hkv, lq, lk, layout, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(b, hq, lq, d, generator=g) for _ in range(2))
    k = torch.randn(b, hkv, lk, d, generator=g) + 2 * torch.randn(b, hkv, 1, d, generator=g)  # a mean to smooth
    v = torch.randn(b, hkv, lk, d, generator=g)
    t = (lambda x: x) if layout == "HND" else (lambda x: x.transpose(1, 2).contiguous())
    return tuple(t(x).to(dtype) for x in (q, k, v, do))


def _fp32_grads(q, k, v, do, causal, layout):
    t = (lambda x: x) if layout == "HND" else (lambda x: x.transpose(1, 2))
    qq, kk, vv = (x.detach().float().requires_grad_() for x in (q, k, v))
    hq, lq, lk = t(qq).shape[1], t(qq).shape[2], t(kk).shape[2]
    s = t(qq) @ t(kk).repeat_interleave(hq // t(kk).shape[1], 1).transpose(-1, -2) * t(qq).shape[-1] ** -0.5
    if causal != "none":
        off = 0 if causal == "top_left" else lk - lq
        s = s.masked_fill(torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + off, float("-inf"))
    alive = torch.isfinite(s).any(-1, keepdim=True)
    o = (torch.softmax(torch.where(alive, s, 0.0), -1) * alive) @ t(vv).repeat_interleave(hq // t(vv).shape[1], 1)
    return torch.autograd.grad(t(o), (qq, kk, vv), do.float())


@pytest.mark.parametrize("name", CASES)
def test_glue_gives_the_reference(name, model):
    d, causal, b, hq, hkv, lq, lk, layout, dtype = CASES[name]
    q, k, v, do = _inputs(d, b, hq, hkv, lq, lk, layout, dtype, seed=len(name))
    got_q, want_q = KQ.quantize(q, k, v, layout), R.quantize(q, k, v, layout)
    o, lse = KA.forward(*got_q[:6], causal, None, layout, dtype)
    ro, rlse = R.forward(*want_q[:6], causal, None, layout, dtype)
    assert o.shape == ro.shape == q.shape and o.dtype == dtype
    assert torch.equal(torch.isfinite(lse), torch.isfinite(rlse))  # rows without keys: -inf in both
    fin = torch.isfinite(rlse)
    assert (lse[fin] - rlse[fin]).abs().max() < 1e-4
    assert cos_rel(o.float(), ro.float())[1] < 0.01
    got = KA.backward(*got_q, o, lse, do, causal, None, layout, dtype, psi="split")
    ref = R.backward(*want_q, ro, rlse, do, causal, None, layout, dtype, psi="split")
    want = _fp32_grads(q, k, v, do, causal, layout)
    for n, a, r, w in zip(("dq", "dk", "dv"), got, ref, want):
        assert a.shape == r.shape == w.shape and a.dtype == dtype and torch.isfinite(a).all(), n
        ka, kr = cos_rel(a.float(), w), cos_rel(r.float(), w)
        assert ka[1] <= 1.1 * kr[1] + 1e-3 and ka[0] >= kr[0] - 1e-3, (n, ka, kr)
        assert cos_rel(a.float(), r.float())[1] < 0.4 * kr[1], (n, cos_rel(a.float(), r.float()), kr)
    coff = 0 if causal == "top_left" else lk - lq
    calls = [(c[0], c[3], c[4]) for c in M.CALLS]
    assert calls == [(f, causal != "none", coff) for f in ("fwd", "dkdv", "dq")], calls  # all three on "CUDA"


def test_backward_the_kernels_do_not_take_stays_on_triton(model):
    """Queries not a multiple of 16: the forward still goes to the kernel, the backward to Triton (the reason
    logged), with the reference's gradients."""
    q, k, v, do = _inputs(64, 1, 2, 2, 100, 96, "HND", torch.bfloat16, seed=5)
    got_q, want_q = KQ.quantize(q, k, v), R.quantize(q, k, v)
    o, lse = KA.forward(*got_q[:6], "none", None, "HND", torch.bfloat16)
    got = KA.backward(*got_q, o, lse, do, "none", None, "HND", torch.bfloat16, psi="split")
    assert [c[0] for c in M.CALLS] == ["fwd"]
    ro, rlse = R.forward(*want_q[:6], "none", None, "HND", torch.bfloat16)
    ref = R.backward(*want_q, ro, rlse, do, "none", None, "HND", torch.bfloat16, psi="split")
    for a, r in zip(got, ref):
        assert cos_rel(a.float(), r.float())[0] > 0.999


def test_causal_bool_mask_runs_gated_cuda_launches(model):
    """A bool causal mask (transformers' under compile): the kernels are launched once per answer of the
    device-side check, gated (want 2: no mask, 1: causal bottom-right), the mask-reading Triton launch beside them;
    only the causal one computes, so outputs and gradients are those of the causal rule's launches."""
    q, k, v, do = _inputs(64, 2, 4, 2, 96, 128, "HND", torch.bfloat16, seed=7)
    qt = KQ.quantize(q, k, v)
    mask = torch.ones(96, 128, dtype=torch.bool).tril(32)[None, None].expand(2, 1, 96, 128)
    o1, l1 = KA.forward(*qt[:6], "bottom_right", None, "HND", torch.bfloat16)
    g1 = KA.backward(*qt, o1, l1, do, "bottom_right", None, "HND", torch.bfloat16, psi="split")
    M.CALLS.clear()
    M.RAN.clear()
    o2, l2 = KA.forward(*qt[:6], "none", None, "HND", torch.bfloat16, attn_mask=mask)
    g2 = KA.backward(*qt, o1, l1, do, "none", None, "HND", torch.bfloat16, attn_mask=mask, psi="split")
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    calls = [(c[0], c[3], c[5], c[6]) for c in M.CALLS]  # (function, causal, want, key ranges)
    assert calls == [("fwd", False, 2, True), ("fwd", True, 1, True), ("dkdv", False, 2, True),
                     ("dq", False, 2, True), ("dkdv", True, 1, True), ("dq", True, 1, True)], calls
    assert M.RAN == [("fwd", True, True), ("dkdv", True, True), ("dq", True, True)], M.RAN


def _fp32_masked(q, k, v, do, mask):
    """fp32 autograd gradients of attention under a bool ``mask`` (rows without keys: 0), HND, GQA."""
    qq, kk, vv = (x.detach().float().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    s = (qq @ kk.repeat_interleave(g, 1).transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~mask, float("-inf"))
    alive = torch.isfinite(s).any(-1, keepdim=True)
    o = (torch.softmax(torch.where(alive, s, 0.0), -1) * alive) @ vv.repeat_interleave(g, 1)
    return torch.autograd.grad(o, (qq, kk, vv), do.float())


def _padded_masks(b, lq, lk):
    """Bool masks with key padding: causal bottom-right with batch 0 right-padded (100 keys) and batch 1
    left-padded (40 keys out: its first 8 rows see none), and a key mask (B, 1, 1, Lk) with batch 1 right-padded to
    70 keys (its last 64-key step partly in)."""
    causal = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)[None, None].repeat(b, 1, 1, 1)
    causal[0, ..., 100:] = False
    causal[1, ..., :40] = False
    keys = torch.ones(b, 1, 1, lk, dtype=torch.bool)
    keys[1, ..., 70:] = False
    return {"causal_padded": (causal, True), "key_padding": (keys.expand(b, 1, lq, lk), False)}


@pytest.mark.parametrize("name", ["causal_padded", "key_padding"])
def test_padded_bool_mask_runs_the_cuda_launches_on_key_ranges(name, model, monkeypatch, caplog):
    """A bool mask with key padding (a batch of padded sequences) runs on the CUDA kernels, which read each batch's
    key range from the device-side check (gate word 1), and not on the mask-reading Triton kernels: exactly one
    launch of each kernel computes, with the key ranges, and O, the LSE and the gradients are the reference's under
    that mask (the same error vs fp32 autograd; fully masked rows 0). With the CUDA kernels asked for by name, no
    warning says the mask went to Triton."""
    monkeypatch.setitem(cuda._state, "logged", set())  # (each reason is logged once a process)
    b, hq, hkv, lq, lk = 2, 4, 2, 96, 128
    mask, causal = _padded_masks(b, lq, lk)[name]
    q, k, v, do = _inputs(64, b, hq, hkv, lq, lk, "HND", torch.bfloat16, seed=11)
    got_q, want_q = KQ.quantize(q, k, v), R.quantize(q, k, v)
    o, lse = KA.forward(*got_q[:6], "none", None, "HND", torch.bfloat16, attn_mask=mask)
    ro, rlse = R.forward(*want_q[:6], "none", None, "HND", torch.bfloat16, attn_mask=mask)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(rlse))  # rows without keys: -inf in both
    assert bool((~torch.isfinite(rlse)).any()) == causal
    fin = torch.isfinite(rlse)
    assert (lse[fin] - rlse[fin]).abs().max() < 1e-4
    assert cos_rel(o.float(), ro.float())[1] < 0.01
    got = KA.backward(*got_q, o, lse, do, "none", None, "HND", torch.bfloat16, attn_mask=mask, psi="split")
    ref = R.backward(*want_q, ro, rlse, do, "none", None, "HND", torch.bfloat16, attn_mask=mask, psi="split")
    want = _fp32_masked(q, k, v, do, mask)
    for n, a, r, w in zip(("dq", "dk", "dv"), got, ref, want):
        assert torch.isfinite(a).all(), n
        ka, kr = cos_rel(a.float(), w), cos_rel(r.float(), w)
        assert ka[1] <= 1.1 * kr[1] + 1e-3 and ka[0] >= kr[0] - 1e-3, (n, ka, kr)
        assert cos_rel(a.float(), r.float())[1] < 0.4 * kr[1], (n, cos_rel(a.float(), r.float()), kr)
    out = [(1, slice(70, None))] if name == "key_padding" else [(0, slice(100, None)), (1, slice(0, 40))]
    assert all((g[i, :, keys] == 0).all() for g in got[1:] for i, keys in out)  # dK, dV of padded keys
    assert M.RAN == [(f, causal, True) for f in ("fwd", "dkdv", "dq")], M.RAN
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.records


class _Counted:
    """A Triton kernel whose launches are logged (by name) before they run."""

    def __init__(self, fn, name, log, wrap=lambda launch: launch):
        self.fn, self.name, self.log, self.wrap = fn, name, log, wrap

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.wrap(self.fn[grid])

    def __call__(self, *args, **kwargs):  # (a helper called inside a kernel: not a launch)
        return self.fn(*args, **kwargs)


def test_a_site_step_is_six_launches(model, monkeypatch):
    """The op's forward (``quantize_forward``) and the psi="split" backward on the CUDA kernels: 3 launches (K's
    mean in one torch reduction, Q, K, V and V̂ᵀ in one Triton launch, the core) and 3 (the preparation, dK/dV, dQ),
    where there were 7 and 6: each launch costs host time, which a small model's step waits for (run 119; run 121:
    ~40-50 us a Triton launch). Besides allocations and views, the only ATen op either side runs is that mean. The
    forward's O and LSE, with V̂ᵀ from the prologue, are those of the forward that makes V̂ᵀ itself."""
    from types import SimpleNamespace

    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    from sage_compile.kernels.int8_fp8 import quantize as F8Q

    class AtenOps(TorchDispatchMode):
        """The ATen ops run, less allocations and views (no kernel launch on a GPU)."""
        FREE = {"empty", "empty_like", "new_empty", "view", "reshape", "_reshape_alias", "unsqueeze", "transpose",
                "permute", "expand", "slice", "select", "as_strided", "alias", "detach", "t"}

        def __init__(self, log):
            super().__init__()
            self.log = log

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in self.FREE:
                self.log.append(f"aten.{name}")
            return func(*args, **(kwargs or {}))

    def unseen(fn):  # a launch: what the interpreter or the model computes in torch is not the glue's
        def run(*args, **kwargs):
            with _disable_current_modes():
                return fn(*args, **kwargs)
        return run

    log = []
    for mod in (KA, KQ, F8Q):
        for name in dir(mod):
            obj = getattr(mod, name)
            if type(obj).__module__.startswith("triton.runtime") and callable(getattr(obj, "run", None)):
                monkeypatch.setattr(mod, name, _Counted(obj, name, log, unseen))
    monkeypatch.setattr(cuda, "load", lambda: SimpleNamespace(**{f: unseen(getattr(M, f)) for f in M.KINDS}))
    q, k, v, do = _inputs(64, 1, 2, 1, 64, 128, "HND", torch.bfloat16, seed=11)
    with AtenOps(log):
        o, lse, qt = KA.quantize_forward(q, k, v, None, "top_left", None, "HND")
    fwd = log + [c[0] for c in M.CALLS]
    log.clear()
    M.CALLS.clear()
    with AtenOps(log):
        KA.backward(*qt, o, lse, do, "top_left", None, "HND", torch.bfloat16, psi="split")
    bwd = log + [c[0] for c in M.CALLS]
    assert sorted(fwd) == sorted(["aten.mean", "_quant_qkv", "fwd"]), fwd
    assert sorted(bwd) == sorted(["_bwd_prep", "dkdv", "dq"]), bwd
    o2, lse2 = KA.forward(*qt[:6], "top_left", None, "HND", torch.bfloat16)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
