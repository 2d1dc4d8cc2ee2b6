"""A PyTorch model of the CUDA SageBwd extension's contract (csrc/int8_train_sm90_bind.cpp ``fwd``, ``dkdv``, ``dq``;
the formats and the numerics its launchers' comments in csrc/int8_train_sm90.cu state): what the kernels compute
from exactly the arguments the binding receives, written to the outputs at the strides given. It stands in for the
built module on a CPU machine, so that the Python side that prepares those arguments
(sage_compile/kernels/int8_train/cuda.py and attention.py) is checked end to end without a GPU: units (c, sm, the
LSE in log2 with +inf), the causal offset, the transposed operands (q̂^T, k̂^T, V̂^T, dO8^T are what the products
read), GQA, the output strides of either layout. Not the kernels' arithmetic order: fp32 sums in torch's order.

Each function first checks its arguments as the binding does (types per :data:`KINDS`, dtypes, contiguity, shapes,
the launchers' length rules), so a call the binding would refuse fails here too."""
from __future__ import annotations

import math

import torch

from sage_compile.reference.int8_train import _tile_quant

LN2 = math.log(2.0)
# the binding's parameter kinds, in order (tests/test_csrc_train_glue.py checks them against the .cpp)
KINDS = {
    "fwd": ("T", "T", "T", "T", "T", "T", "T", "T", "f", "b", "i", "i", "i", "i", "T", "i", "b"),
    "dkdv": ("T",) * 13 + ("f", "f", "b", "i", "i", "i", "i", "T", "i", "b"),
    "dq": ("T",) * 11 + ("f", "f", "b", "i", "i", "i", "i", "T", "i", "b"),
}
CALLS: list = []  # (function name, the call's shapes, causal, coff, want, keyrange) of every call, for the tests
RAN: list = []  # (function name, causal, key ranges read) of the calls that computed (not gated off)


def _gate(gate, want, keyrange, b):
    """The binding's gate_args: ``(off, krange)``. want >= 0: the kernel computes only where gate[0] == want (int32),
    with keyrange where gate[1] == want, and then batch i sees keys [gate[2 + 2i], gate[3 + 2i]) only (krange
    (B, 2), else None)."""
    if want < 0:
        assert not keyrange
        return False, None
    assert gate.dtype == torch.int32 and gate.is_contiguous() and gate.numel() >= (2 + 2 * b if keyrange else 1)
    if keyrange:
        return int(gate[1]) != want, gate[2:2 + 2 * b].view(b, 2)
    return int(gate[0]) != want, None


def _kinds(name, args):
    kinds = KINDS[name]
    assert len(args) == len(kinds), (name, len(args), len(kinds))
    for i, (a, k) in enumerate(zip(args, kinds)):
        ok = {"T": isinstance(a, torch.Tensor), "f": isinstance(a, (int, float)) and not isinstance(a, bool),
              "b": isinstance(a, bool), "i": isinstance(a, int) and not isinstance(a, bool)}[k]
        assert ok, (name, i, type(a), k)


def _check(t, dtype, dim, name):
    assert t.dtype == dtype and t.dim() == dim and t.is_contiguous(), (name, t.dtype, t.shape)


def _scales(s, b, h, n, block, name):
    assert s.shape == (b, h, -(-n // block)), (name, s.shape, (b, h, n, block))


def _deq(x8, s, block):
    """(B, H, N, D) int8 with one scale per ``block`` tokens: fp32 values."""
    return x8.float() * s.repeat_interleave(block, -1)[..., : x8.shape[2], None]


def _group(x, hq):
    return x.repeat_interleave(hq // x.shape[1], 1)


def _visible(lq, lk, causal, coff, krange, device):
    """Key n visible from query m iff n <= m + coff (causal) and, with ``krange`` (B, 2), n in its batch's range
    clamped to [0, lk), as the launchers define it: broadcastable to (B, H, Lq, Lk), or None (every key)."""
    n = torch.arange(lk, device=device)
    vis = None
    if causal:
        vis = n[None, :] <= torch.arange(lq, device=device)[:, None] + coff
    if krange is not None:
        kr = krange.long()
        inr = ((n >= kr[:, :1].clamp(0, lk)) & (n < kr[:, 1:].clamp(max=lk)))[:, None, None, :]
        vis = inr if vis is None else vis & inr
    return vis


def _logits2(q8, qs, k8, ks, c):
    """S in log2 units: the exact integer q̂·k̂^T times the Q scale (128 queries), the K scale (64 keys) and c."""
    hq = q8.shape[1]
    s = q8.float() @ _group(k8, hq).float().transpose(-1, -2)
    return s * qs.repeat_interleave(128, -1)[..., : q8.shape[2], None] * c \
        * _group(ks, hq).repeat_interleave(64, -1)[..., None, : k8.shape[2]]


def _write(out, vals, sob, soh, son):
    b, h, n, d = vals.shape
    assert out.stride(-1) == 1 and out.numel() == b * h * n * d
    assert (b - 1) * sob + (h - 1) * soh + (n - 1) * son + d <= out.numel()
    torch.as_strided(out, (b, h, n, d), (sob, soh, son, 1)).copy_(vals.to(out.dtype))


def fwd(*args):
    _kinds("fwd", args)
    q8, qs, k8, ks, v8t, vs, out, lse, c, causal, coff, sob, soh, son, gate, want, keyrange = args
    for t, n in ((q8, "q8"), (k8, "k8"), (v8t, "v8t")):
        _check(t, torch.int8, 4, n)
    _check(lse, torch.float32, 3, "lse")
    assert out.dtype in (torch.bfloat16, torch.float16)
    b, hq, lq, d = q8.shape
    hkv, lk = k8.shape[1], k8.shape[2]
    assert d in (64, 128) and lk % 16 == 0 and hq % hkv == 0 and v8t.shape == (b, hkv, d, lk)
    _scales(qs, b, hq, lq, 128, "qs"), _scales(ks, b, hkv, lk, 64, "ks"), _scales(vs, b, hkv, lk, 64, "vs")
    CALLS.append(("fwd", tuple(q8.shape), tuple(k8.shape), causal, coff, want, keyrange))
    off, krange = _gate(gate, want, keyrange, b)
    if off:
        return
    RAN.append(("fwd", causal, krange is not None))
    z = _logits2(q8, qs, k8, ks, c)
    vis = _visible(lq, lk, causal, coff, krange, q8.device)
    if vis is not None:
        z = z.masked_fill(~vis, float("-inf"))
    m = z.amax(-1, keepdim=True)
    alive = torch.isfinite(m)
    pt = torch.exp2(z - torch.where(alive, m, 0.0))  # P~ against the row's final max (ψ per row is scale-free)
    ps = _tile_quant(pt, 1, 64)  # ψ per query row in each 64-key step
    v = _deq(v8t.transpose(-1, -2).contiguous(), vs, 64)
    l_ = pt.sum(-1, keepdim=True)
    o = torch.where(l_ > 0, (ps @ _group(v, hq)) / l_.clamp_min(1e-30), 0.0)
    _write(out, o, sob, soh, son)
    lse.copy_(torch.where(l_ > 0, (m + torch.log2(l_.clamp_min(1e-30))) * LN2, float("-inf"))[..., 0])


def _dp_ds(q8, qs, k8, ks, v16, lse2, delta, do16, c, causal, coff, krange):
    """P (B, Hq, Lq, Lk) from S and the log2 LSE (+inf: 0), dP = dO·V̂^T in fp32, dS = P ∘ (dP - delta)."""
    hq, lq, lk = q8.shape[1], q8.shape[2], k8.shape[2]
    z = _logits2(q8, qs, k8, ks, c) - lse2[..., None]
    vis = _visible(lq, lk, causal, coff, krange, q8.device)
    if vis is not None:
        z = z.masked_fill(~vis, float("-inf"))
    p = torch.exp2(z)
    dp = do16.float() @ _group(v16, hq).float().transpose(-1, -2)
    return p, p * (dp - delta[..., None])


def _backward_args(q8, qs, k8, ks, v16, lse2, delta, do16, int8, fp32):
    """The checks dkdv and dq share (``int8`` / ``fp32``: their own operands of those types, by name); returns
    ``(b, hq, lq, d, hkv, lk)``."""
    for n, t in dict(q8=q8, k8=k8, **int8).items():
        _check(t, torch.int8, 4, n)
    for n, t in dict(qs=qs, ks=ks, lse2=lse2, delta=delta, **fp32).items():
        _check(t, torch.float32, 3, n)
    b, hq, lq, d = q8.shape
    hkv, lk = k8.shape[1], k8.shape[2]
    _check(v16, v16.dtype, 4, "v16"), _check(do16, v16.dtype, 4, "do16")
    assert v16.dtype in (torch.bfloat16, torch.float16) and v16.shape == k8.shape and do16.shape == q8.shape
    assert d in (64, 128) and hq % hkv == 0 and lse2.shape == delta.shape == (b, hq, lq)
    _scales(qs, b, hq, lq, 128, "qs"), _scales(ks, b, hkv, lk, 64, "ks")
    return b, hq, lq, d, hkv, lk


def _sum_group(x, hkv):
    return x.unflatten(1, (hkv, x.shape[1] // hkv)).sum(2)


def dkdv(*args):
    _kinds("dkdv", args)
    q8, q8t, qs, k8, ks, v16, lse2, delta, do16, do8t, sdo, dk, dv, c, sm, causal, coff, sob, soh, son = args[:-3]
    gate, want, keyrange = args[-3:]
    b, hq, lq, d, hkv, lk = _backward_args(q8, qs, k8, ks, v16, lse2, delta, do16,
                                           int8=dict(q8t=q8t, do8t=do8t), fp32=dict(sdo=sdo))
    assert lq % 16 == 0 and q8t.shape == do8t.shape == (b, hq, d, lq)
    _scales(sdo, b, hq, lq, 128, "sdo")
    assert dk.dtype == dv.dtype == v16.dtype and dk.stride() == dv.stride()
    CALLS.append(("dkdv", tuple(q8.shape), tuple(k8.shape), causal, coff, want, keyrange))
    off, krange = _gate(gate, want, keyrange, b)
    if off:
        return
    RAN.append(("dkdv", causal, krange is not None))
    p, ds = _dp_ds(q8, qs, k8, ks, v16, lse2, delta, do16, c, causal, coff, krange)
    dof = _deq(do8t.transpose(-1, -2).contiguous(), sdo, 128)  # ψ(dO), what the dV product reads
    dvx = _tile_quant(p, 64, 1).transpose(-1, -2) @ dof  # ψ(P^T) per key over 64 queries
    qf = _deq(q8t.transpose(-1, -2).contiguous(), qs, 128)  # q̂ as the dK product reads it: from q̂^T
    dkx = _tile_quant(ds, 64, 1).transpose(-1, -2) @ qf * sm
    _write(dk, _sum_group(dkx, hkv), sob, soh, son)
    _write(dv, _sum_group(dvx, hkv), sob, soh, son)


def dq(*args):
    _kinds("dq", args)
    q8, qs, k8, k8t, ks, v16, kmean, lse2, delta, do16, dq_, c, sm, causal, coff, sob, soh, son = args[:-3]
    gate, want, keyrange = args[-3:]
    b, hq, lq, d, hkv, lk = _backward_args(q8, qs, k8, ks, v16, lse2, delta, do16, int8=dict(k8t=k8t),
                                           fp32=dict(kmean=kmean))
    assert lk % 16 == 0 and k8t.shape == (b, hkv, d, lk) and kmean.shape == (b, hkv, d)
    assert dq_.dtype == v16.dtype
    CALLS.append(("dq", tuple(q8.shape), tuple(k8.shape), causal, coff, want, keyrange))
    off, krange = _gate(gate, want, keyrange, b)
    if off:
        return
    RAN.append(("dq", causal, krange is not None))
    _, ds = _dp_ds(q8, qs, k8, ks, v16, lse2, delta, do16, c, causal, coff, krange)
    dsq = _tile_quant(ds, 1, 64)  # ψ per query row over each 64-key step
    kf = _deq(k8t.transpose(-1, -2).contiguous(), ks, 64)  # k̂ as the dQ product reads it: from k̂^T
    out = (dsq @ _group(kf, hq) + dsq.sum(-1, keepdim=True) * _group(kmean, hq)[:, :, None, :]) * sm
    _write(dq_, out, sob, soh, son)
