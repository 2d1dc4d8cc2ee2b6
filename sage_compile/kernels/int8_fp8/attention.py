"""Triton core of ``int8_fp8`` (SageAttention2 numerics; shared/docs/numerics.md §2, §7.3).

Per (batch, head, BLOCK_M queries): S = int8 q̂·k̂ᵀ (exact int32) dequantized by per-token scales with
the softmax scale·log2e folded into Q's; online softmax in the exp2 domain over 128-key tiles with the
running row max mapped to 448; P̃ rounded to FP8 E4M3 and multiplied with the FP8 V tile, the tile's
product promoted to fp32 once per tile (two-level accumulation via ``max_num_imprecise_acc``); row sums
from unrounded fp32 P̃; O·δ_V/l at the end. Masks: causal (top_left / bottom_right) from indices;
bool / additive masks read in-kernel through broadcast strides, except the bool masks LLMs build
(causal + key padding, key padding alone), recognised on the device and run as causal / key-range sweeps.
Same tiling as the reference (BLOCK_N = 128), so the two agree to accumulation-order noise.
"""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ...config import int8_fp8_core
from .._common import CAUSAL_CODES, EMULATE_FP8, cdiv, launch, output_and_mask, pow2, to_e4m3
from ..._tracing import eager_launches, in_graph
from ...reference.int8_fp8 import V_KEY_MULTIPLE
from . import cuda

log = logging.getLogger("sage_compile")
LOG2E = 1.4426950408889634
LOG2_448 = math.log2(448.0)
BLOCK_N = 128


@triton.jit
def _tile(acc, m_i, l_i, q, qs, K8, KS, V8, MASK, n0, offs_m, LQ, LK, D: tl.constexpr, klo, khi, coff,
          skn, svd, smq, smk, MASK_KIND: tl.constexpr, CHECK: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, P_OFF: tl.constexpr, EMULATE: tl.constexpr,
          PV: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    if CHECK:
        kv = (offs_n[:, None] < LK) & (rd[None, :] < D)
        k = tl.load(K8 + offs_n[:, None] * skn + rd[None, :], mask=kv, other=0)
        ks = tl.load(KS + offs_n, mask=offs_n < LK, other=0.0)
        v = tl.load(V8 + rd[None, :] * svd + offs_n[:, None], mask=kv, other=0.0)
    elif BLOCK_D == D:  # interior tile, native head dim: no masks at all
        k = tl.load(K8 + offs_n[:, None] * skn + rd[None, :])
        ks = tl.load(KS + offs_n)
        v = tl.load(V8 + rd[None, :] * svd + offs_n[:, None])
    else:
        k = tl.load(K8 + offs_n[:, None] * skn + rd[None, :], mask=rd[None, :] < D, other=0)
        ks = tl.load(KS + offs_n)
        v = tl.load(V8 + rd[None, :] * svd + offs_n[:, None], mask=rd[None, :] < D, other=0.0)
    s = tl.dot(q, tl.trans(k), out_dtype=tl.int32)
    z = s.to(tl.float32) * qs[:, None] * ks[None, :]
    if MASK_KIND == 1:
        mk = tl.load(MASK + offs_m[:, None] * smq + offs_n[None, :] * smk,
                     mask=(offs_m[:, None] < LQ) & (offs_n[None, :] < LK), other=0)
        z = tl.where(mk != 0, z, float("-inf"))
    if MASK_KIND == 2:
        mk = tl.load(MASK + offs_m[:, None] * smq + offs_n[None, :] * smk,
                     mask=(offs_m[:, None] < LQ) & (offs_n[None, :] < LK), other=0.0)
        z = z + mk.to(tl.float32) * 1.4426950408889634
    if CHECK:  # keys in [klo, khi) and, causally, n <= m + coff (coff >= LK: not causal)
        keep = (offs_n[None, :] >= klo) & (offs_n[None, :] < khi) & (offs_n[None, :] <= offs_m[:, None] + coff)
        z = tl.where(keep, z, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(z, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(z - (m_use - P_OFF)[:, None])  # row max -> 448
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if EMULATE:  # the hardware cast saturates (cvt.satfinite); the emulation needs the clamp
        p = tl.minimum(p, 448.0)
    p8 = to_e4m3(p, EMULATE)
    if PV == 0:  # two-level: the tile's FP8 product is promoted to fp32 once (max_num_imprecise_acc)
        acc = acc * alpha[:, None]
        acc = tl.dot(p8, v, acc, max_num_imprecise_acc=BLOCK_N)
    else:  # two-level with an explicit fresh accumulator per tile
        acc = acc * alpha[:, None] + tl.dot(p8, v)
    return acc, m_new, l_i


_CONFIGS = ((128, 8, 3), (128, 4, 2), (64, 4, 2), (64, 4, 3), (64, 4, 4))  # (BLOCK_M, warps, stages)
# the autotuner's fastest at N=16K on the H200 by head dim (results/tune_int8_fp8_h200.log: hd64 431 TOPS,
# hd128 653): the configuration cuda.prefer_cuda times the Triton core at before (or instead of) autotuning it
QUICK_CONFIG = {64: (128, 4, 2), 128: (64, 4, 3)}


def _configs():
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": BLOCK_N, "WS": False, "PV": 0}, num_warps=w, num_stages=s)
            for bm, w, s in _CONFIGS]


@triton.jit
def _sweep(acc, m_i, l_i, q, qs, K8, KS, V8, MASK, offs_m, m0, LQ, LK, D: tl.constexpr, klo, khi, coff, svd,
           smq, smk, MASK_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
           P_OFF: tl.constexpr, EMULATE: tl.constexpr, WS: tl.constexpr, PV: tl.constexpr):
    """All key tiles this query block sees (keys in [klo, khi), causally n <= m + coff): the tiles every
    row sees entirely run without index checks, the (at most two) edge ranges with them."""
    hi = tl.maximum(klo, tl.minimum(khi, m0 + BLOCK_M + coff))
    lo = (klo // BLOCK_N) * BLOCK_N
    f0 = ((klo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    f1 = tl.minimum((khi // BLOCK_N) * BLOCK_N, tl.maximum(0, (m0 + coff + 1) // BLOCK_N) * BLOCK_N)
    e0 = tl.minimum(f0, hi)
    f1 = tl.maximum(f0, tl.minimum(f1, hi))
    for n0 in range(lo, e0, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, qs, K8, KS, V8, MASK, n0, offs_m, LQ, LK, D, klo, khi, coff,
                              D, svd, smq, smk, MASK_KIND, True, BLOCK_N, BLOCK_D, P_OFF, EMULATE, PV)
    for n0 in tl.range(f0, f1, BLOCK_N, warp_specialize=WS):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, qs, K8, KS, V8, MASK, n0, offs_m, LQ, LK, D, klo, khi, coff,
                              D, svd, smq, smk, MASK_KIND, False, BLOCK_N, BLOCK_D, P_OFF, EMULATE, PV)
    for n0 in range(f1, hi, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, qs, K8, KS, V8, MASK, n0, offs_m, LQ, LK, D, klo, khi, coff,
                              D, svd, smq, smk, MASK_KIND, True, BLOCK_N, BLOCK_D, P_OFF, EMULATE, PV)
    return acc, m_i, l_i


@triton.jit
def _fwd_body(Q8, QS, K8, KS, V8, VS, MASK, FLAG, KRANGE, OUT, c,
              sqb, sqh, skb, skh, svb, svh, svd, smb, smh, smq, smk, sob, soh, son,
              H, GROUP, LQ, LK, D: tl.constexpr,
              CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, P_OFF: tl.constexpr, EMULATE: tl.constexpr, WS: tl.constexpr,
              PV: tl.constexpr, GENERAL_ONLY: tl.constexpr):
    if GENERAL_ONLY:  # FLAG from mask_structure: other launches (the CUDA core) serve flags 1 and 2
        if tl.load(FLAG) != 0:
            return
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    q = tl.load(Q8 + b * sqb + h * sqh + offs_m[:, None] * D + rd[None, :],
                mask=(offs_m[:, None] < LQ) & (rd[None, :] < D), other=0)
    c = tl.cast(c, tl.float32)  # Inductor hands a Python float over as fp64 (a traced call)
    qs = tl.load(QS + (b * (sqb // D) + h * (sqh // D)) + offs_m, mask=offs_m < LQ, other=0.0) * c
    K8 = K8 + b * skb + hk * skh
    KS = KS + (b * (skb // D) + hk * (skh // D))
    V8 = V8 + b * svb + hk * svh
    MASK = MASK + b * smb + h * smh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    zero = b * 0  # runtime int32 scalars (LK may be specialised to a constant)
    klo = zero
    khi = zero + LK
    coff = zero + LK  # n <= m + LK always holds: not causal
    if CAUSAL == 1:
        coff = zero
    if CAUSAL == 2:
        coff = zero + (LK - LQ)
    if MASK_KIND == 3:  # a bool mask that may be causal(bottom-right)+key-range or key-range only
        flag = tl.load(FLAG)
        if flag != 0:
            klo = tl.load(KRANGE + 2 * b)
            khi = tl.load(KRANGE + 2 * b + 1)
            if flag == 1:
                coff = zero + (LK - LQ)
            acc, m_i, l_i = _sweep(acc, m_i, l_i, q, qs, K8, KS, V8, MASK, offs_m, m0, LQ, LK, D, klo, khi, coff,
                                   svd, smq, smk, 0, BLOCK_M, BLOCK_N, BLOCK_D, P_OFF, EMULATE, WS, PV)
        else:
            acc, m_i, l_i = _sweep(acc, m_i, l_i, q, qs, K8, KS, V8, MASK, offs_m, m0, LQ, LK, D, klo, khi, coff,
                                   svd, smq, smk, 1, BLOCK_M, BLOCK_N, BLOCK_D, P_OFF, EMULATE, WS, PV)
    else:
        acc, m_i, l_i = _sweep(acc, m_i, l_i, q, qs, K8, KS, V8, MASK, offs_m, m0, LQ, LK, D, klo, khi, coff,
                               svd, smq, smk, MASK_KIND, BLOCK_M, BLOCK_N, BLOCK_D, P_OFF, EMULATE, WS, PV)
    vs = tl.load(VS + (b * (svb // svd) + hk * (svh // svd)) + rd, mask=rd < D, other=0.0)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None] * vs[None, :]
    o = tl.where(l_i[:, None] == 0.0, 0.0, o)
    tl.store(OUT + b * sob + h * soh + offs_m[:, None] * son + rd[None, :], o.to(OUT.dtype.element_ty),
             mask=(offs_m[:, None] < LQ) & (rd[None, :] < D))


_fwd = triton.autotune(configs=_configs(), key=["D", "CAUSAL", "MASK_KIND", "BLOCK_D"])(_fwd_body)


@triton.jit
def _key_range(MASK, KRANGE, BAD, smb, smq, smk, LQ, LK, BLOCK_K: tl.constexpr):
    """KRANGE[b] = [first, last + 1) of the keys the mask's last query row keeps ([0, LK) where it keeps
    none, as an argmax from either end says). Program 0 also zeroes BAD[0:3] for :func:`_mask_mismatch`,
    which runs after it. One program per batch."""
    b = tl.program_id(0)
    if b == 0:
        z = tl.arange(0, 4)
        tl.store(BAD + z, tl.zeros([4], tl.int32), mask=z < 3)
    row = MASK + b * smb + (LQ - 1) * smq
    lo = tl.full([], 0, tl.int32) + LK
    hi = tl.full([], 0, tl.int32)
    for k0 in range(0, LK, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        m = tl.load(row + offs * smk, mask=offs < LK, other=0) != 0
        lo = tl.minimum(lo, tl.min(tl.where(m, offs, LK), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(m, offs + 1, 0), axis=0))
    tl.store(KRANGE + 2 * b, tl.where(lo == LK, 0, lo))
    tl.store(KRANGE + 2 * b + 1, tl.where(hi == 0, LK, hi))


@triton.jit
def _mask_mismatch(MASK, KRANGE, BAD, FLAG, smb, smq, smk, LQ, LK, COFF, KCHUNK, BLOCK_Q: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """Count the entries of a bool mask (B, ., LQ, LK) that differ from (a) causal (key <= query + COFF)
    within the key range [KRANGE[b, 0], KRANGE[b, 1]) and (b) that key range alone: BAD[0] += (a),
    BAD[1] += (b), atomically and only where not zero (a structured mask adds nothing). One program per
    (query block, batch, KCHUNK keys); the last program to finish (BAD[2] counts them) writes FLAG = 2 if
    (b) is 0, else 1 if (a) is 0, else 0."""
    b = tl.program_id(1)
    k_start = tl.program_id(2) * KCHUNK
    k_end = tl.minimum(k_start + KCHUNK, LK)
    offs_q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    klo = tl.load(KRANGE + 2 * b)
    khi = tl.load(KRANGE + 2 * b + 1)
    bad_r = tl.full([], 0, tl.int32)
    bad_c = tl.full([], 0, tl.int32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        inb = (offs_q[:, None] < LQ) & (offs_k[None, :] < k_end)
        m = tl.load(MASK + b * smb + offs_q[:, None] * smq + offs_k[None, :] * smk, mask=inb, other=0) != 0
        want_r = (offs_k[None, :] >= klo) & (offs_k[None, :] < khi)
        want_c = want_r & (offs_k[None, :] <= offs_q[:, None] + COFF)
        bad_r += tl.sum(tl.sum((inb & (m != want_r)).to(tl.int32), axis=1), axis=0)
        bad_c += tl.sum(tl.sum((inb & (m != want_c)).to(tl.int32), axis=1), axis=0)
    if bad_c != 0:
        tl.atomic_add(BAD, bad_c)
    if bad_r != 0:
        tl.atomic_add(BAD + 1, bad_r)
    done = tl.atomic_add(BAD + 2, 1)  # acq_rel: this program's counts are in before it is counted
    if done == tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2) - 1:
        r = tl.atomic_add(BAD + 1, 0)
        c = tl.atomic_add(BAD, 0)
        tl.store(FLAG, tl.where(r == 0, 2, tl.where(c == 0, 1, 0)))


CHECK_KEYS = (4096, 8192)  # keys per program of _mask_mismatch: the full check, the one-row check


def mask_structure(mask: torch.Tensor, lq: int, lk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Recognise, on the device and without a host sync (CUDA-graph safe), the bool masks LLMs build:
    causal (bottom-right) + key padding, or key padding alone, shared by all heads.

    ``mask``: bool as uint8, expanded to ``(B, H, Lq, Lk)`` with head stride 0. Returns ``(flag, krange)``:
    ``flag`` int32[1] = 1 causal + key range, 2 key range only, 0 anything else (the kernel then reads
    the mask); ``krange`` int32 (B, 2) = each batch's [first, last + 1) key, read from the last query row
    (it sees every unmasked key in both structures). Two launches (:func:`_key_range`,
    :func:`_mask_mismatch`) whatever the mask."""
    b = mask.shape[0]
    krange = torch.empty(b, 2, dtype=torch.int32, device=mask.device)
    flag = torch.empty(1, dtype=torch.int32, device=mask.device)
    bad = torch.empty(3, dtype=torch.int32, device=mask.device)
    launch(_key_range, (b,))(mask, krange, bad, mask.stride(0), mask.stride(2), mask.stride(3), lq, lk, BLOCK_K=4096,
                     num_warps=8)
    if mask.stride(2) == 0 or lq == 1:  # one row for all queries (a key mask, (B, 1, 1, Lk)): a key range iff
        # the row's kept keys are contiguous (flag 2; 1 cannot come first), checked on that row alone
        rows, coff, bq, bk, chunk = 1, lk - 1, 1, 2048, CHECK_KEYS[1]
    else:
        rows, coff, bq, bk, chunk = lq, lk - lq, 32, 256, CHECK_KEYS[0]
    launch(_mask_mismatch, (cdiv(rows, bq), b, cdiv(lk, chunk)))(
        mask, krange, bad, flag, mask.stride(0), mask.stride(2), mask.stride(3), rows, lk, coff, chunk,
        BLOCK_Q=bq, BLOCK_K=bk)
    return flag, krange


def _time_cores(q8, k8, causal: str, scale: Optional[float], out_dtype: torch.dtype) -> None:
    """For a call being traced (fake tensors): :func:`attention` without a mask on real random inputs of its sizes,
    outside the trace, so that :func:`cuda.prefer_cuda` times the two cores on them and keeps its choice."""
    from torch.utils._python_dispatch import _disable_current_modes

    b, hq, lq, d = (int(n) for n in q8.shape)
    hkv, lk = int(k8.shape[1]), int(k8.shape[2])
    dev = q8.device
    with _disable_current_modes(), eager_launches():
        g = torch.Generator(device=dev).manual_seed(0)
        i8 = lambda *shape: torch.randint(-127, 128, shape, dtype=torch.int8, device=dev, generator=g)  # noqa: E731
        sc = lambda *shape: torch.full(shape, 0.01, dtype=torch.float32, device=dev)  # noqa: E731
        v8 = torch.randn((b, hkv, d, lk + (-lk) % V_KEY_MULTIPLE), device=dev, generator=g).to(torch.float8_e4m3fn)
        attention(i8(b, hq, lq, d), sc(b, hq, lq), i8(b, hkv, lk, d), sc(b, hkv, lk), v8, sc(b, hkv, d), None, causal,
                  scale, "HND", out_dtype)


def attention(q8, qs, k8, ks, v8, vs, attn_mask: Optional[torch.Tensor], causal: str, scale: Optional[float],
              layout: str, out_dtype: torch.dtype, config: Optional[dict] = None,
              detect_mask: bool = True, general_only: bool = False) -> torch.Tensor:
    """Same contract as :func:`sage_compile.reference.int8_fp8.attention` (inputs from ``quantize``).

    Calls at head dim 64/128 with a bf16/fp16 output, without a mask or with a bool mask of
    :func:`mask_structure`'s, may run the CUDA sm90 core (:mod:`.cuda`, chosen by
    :func:`sage_compile.config.int8_fp8_core`); everything else runs here. A bool mask shared by the heads
    is checked on the device (:func:`mask_structure`): causal + key padding or key padding alone runs the
    causal / key-range path (skipped tiles, no mask reads; on the CUDA core where it serves, with this
    core's launch for any other mask doing nothing unless the device-side check says so);
    ``detect_mask=False`` forces reading the mask. ``config`` (``BLOCK_M``, ``BLOCK_N``, ``WS`` (warp
    specialisation), ``PV`` (0: max_num_imprecise_acc, 1: fresh accumulator), ``num_warps``,
    ``num_stages``) bypasses autotuning and the CUDA core (tests, interpreter, tuning). ``general_only``
    (tests): with a structured mask, only the Triton launch that serves ``mask_structure``'s flag 0 runs,
    into a NaN-filled output (which it leaves as is under flags 1 and 2)."""
    b, hq, lq, d = q8.shape
    hkv, lk = k8.shape[1], k8.shape[2]
    if d > 256:
        raise ValueError(f"int8_fp8 kernel: head_dim {d} > 256")
    c = (1.0 / math.sqrt(d) if scale is None else float(scale)) * LOG2E
    q8, k8, v8 = q8.contiguous(), k8.contiguous(), v8.contiguous()
    qs, ks, vs = qs.contiguous(), ks.contiguous(), vs.contiguous()
    out, (sob, soh, son), mask, kind, ms = output_and_mask(b, hq, lq, lk, d, layout, out_dtype, attn_mask,
                                                           q8.device, qs)
    flag, krange = qs, qs
    if kind == 1 and detect_mask and causal == "none" and ms[1] == 0 and lq > 0 and lk > 0:
        flag, krange = mask_structure(mask, lq, lk)
        kind = 3
    block_d = max(32, pow2(d))
    args = (q8, qs, k8, ks, v8, vs, mask, flag, krange, out, c, q8.stride(0), q8.stride(1), k8.stride(0),
            k8.stride(1), v8.stride(0), v8.stride(1), v8.stride(2), *ms, sob, soh, son, hq, hq // hkv, lq, lk, d)
    meta = dict(CAUSAL=CAUSAL_CODES[causal], MASK_KIND=kind, BLOCK_D=block_d, P_OFF=LOG2_448, EMULATE=EMULATE_FP8,
                GENERAL_ONLY=False)

    def run_body(cfg, **over):
        bm = cfg["BLOCK_M"]
        tune = dict(BLOCK_N=BLOCK_N, WS=False, PV=0, num_warps=4, num_stages=2)
        tune.update({k: v for k, v in cfg.items() if k != "BLOCK_M"})
        launch(_fwd_body, (cdiv(lq, bm), b * hq))(*args, **{**meta, **over}, BLOCK_M=bm, **tune)

    def run_triton():
        if config is not None:
            run_body(config)
        else:
            launch(_fwd, lambda m: (cdiv(lq, m["BLOCK_M"]), b * hq))(*args, **meta)
        return out

    # any mask but mask_structure's (flag 0): the Triton core reading it, one fixed configuration (no
    # autotuning for a launch that usually does nothing), beside the CUDA core's key-range launches
    general = dict(BLOCK_M=128, num_warps=8, num_stages=3) if config is None else config
    if general_only and kind == 3:
        out.fill_(float("nan"))
        run_body(general, MASK_KIND=1, GENERAL_ONLY=True)
        return out

    def run_ranged():
        """A mask of ``mask_structure``'s (kind 3) without a host sync: one launch per possible flag, each
        leaving at once unless the device-side flag is its own; every output element is written once."""
        k8p, ksp = k8, ks
        if ms[2] != 0 and lk % 4:  # two CUDA launches: pad K (whole groups of 4 keys) once for both
            k8p, ksp = cuda.pad_tokens(k8, 4), cuda.pad_tokens(ks, 4)
        cuda.attention(q8, qs, k8p, ksp, v8, vs, "none", scale, out, (sob, soh, son), krange=krange, flag=flag,
                       want=2, lk=lk)  # key range alone
        if ms[2] != 0:  # the mask varies along the queries: it may be causal (bottom-right) + key range
            cuda.attention(q8, qs, k8p, ksp, v8, vs, "bottom_right", scale, out, (sob, soh, son), krange=krange,
                           flag=flag, want=1, lk=lk)
        run_body(general, MASK_KIND=1, GENERAL_ONLY=True)
        return out

    core = int8_fp8_core()
    if config is None and core != "triton" and not EMULATE_FP8:
        ranged = kind == 3
        why = cuda.unsupported(q8, k8, None if ranged else attn_mask, out_dtype, scale)
        if why is None:
            def run_cuda():
                return cuda.attention(q8, qs, k8, ks, v8, vs, causal, scale, out, (sob, soh, son))

            def run_quick():  # one configuration of the autotuner's (QUICK_CONFIG), no autotuning
                bm, w, st = QUICK_CONFIG[q8.shape[3]]
                run_body(dict(BLOCK_M=bm, num_warps=w, num_stages=st))
                return out

            try:
                if ranged:  # the unmasked shape's measured choice where there is one, else the CUDA core
                    if core == "cuda" or cuda.known_choice(q8, k8, causal) is not False:
                        return run_ranged()
                elif core == "cuda" or (
                        cuda.prefer_cuda_traced(q8, k8, causal, lambda: _time_cores(q8, k8, causal, scale, out_dtype))
                        if in_graph() else cuda.prefer_cuda(q8, k8, causal, run_cuda, run_triton, run_quick)):
                    return run_cuda()
            except RuntimeError as e:  # the launcher refused (a TORCH_CHECK): the Triton core serves
                cuda.note_failure(e)
        elif core == "cuda":
            log.debug("sage_compile: int8_fp8 call runs the Triton core: %s", why)
    return run_triton()
