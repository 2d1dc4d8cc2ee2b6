"""The fp4 core's Blackwell path (``tl.dot_scaled`` on packed E2M1 + E4M3 scales) — untested on hardware
(no Blackwell GPU here): it is compiled for sm_100 on this machine (Triton cross-compiles to PTX/cubin
without a GPU) and the PTX must hold the block-scaled FP4 MMA; the in-register P packing is checked in the
interpreter against the reference packing. (The interpreter's ``dot_scaled`` reads every scale as E8M0,
so the NVFP4 product itself cannot be checked there.)"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

triton = pytest.importorskip("triton")

_COMPILE = textwrap.dedent('''
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from sage_compile.kernels.fp4 import attention as KA

    ptr = {"QP": "*u8", "QS": "*fp8e4nv", "KP": "*u8", "KS": "*fp8e4nv", "VP": "*u8", "VS": "*fp8e4nv",
           "DS": "*fp32", "VM": "*fp32", "MASK": "*fp32", "OUT": "*bf16", "c": "fp32"}
    ints = ["H", "GROUP", "LQ", "LK", "DP", "DV", "NK16", "NBLK", "smb", "smh", "smq", "smk", "sob", "soh", "son"]
    const = dict(CAUSAL=1, MASK_KIND=0, P_ROUNDED=True, BLOCK_M=128, BLOCK_N=128, BLOCK_D=128, P_OFF=KA.P_OFF,
                 EMULATE=False, QB=16, NATIVE=True)
    sig = dict(ptr, **{k: "i32" for k in ints}, **{k: "constexpr" for k in const})
    src = ASTSource(fn=KA._fwd_body, signature=sig, constexprs=const)
    ptx = triton.compile(src, target=GPUTarget("cuda", 100, 32)).asm["ptx"]
    print("tcgen05.mma" in ptx, "block_scale" in ptx)
''')


def test_native_fp4_path_compiles_for_sm100():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0 and ("ptxas" in r.stderr or "No module named 'triton.backends.nvidia'" in r.stderr):
        pytest.skip(f"Triton cannot cross-compile for sm_100 here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-2:] == ["True", "True"], r.stdout  # block-scaled FP4 MMA in the PTX


def test_pack_e2m1_matches_reference_packing():
    code = textwrap.dedent('''
        import torch, triton, triton.language as tl
        from sage_compile.kernels.fp4.attention import _pack_e2m1
        from sage_compile.reference import quant as Q

        @triton.jit
        def k(X, Y, R: tl.constexpr, C: tl.constexpr):
            r = tl.arange(0, R)[:, None]
            x = tl.load(X + r * C + tl.arange(0, C)[None, :])
            tl.store(Y + r * (C // 2) + tl.arange(0, C // 2)[None, :], _pack_e2m1(x, R, C))

        g = torch.Generator().manual_seed(0)
        x = Q.round_e2m1(torch.randn(16, 64, generator=g) * 3).abs()  # P is non-negative
        y = torch.empty(16, 32, dtype=torch.uint8)
        k[(1,)](x, y, 16, 64)
        print(torch.equal(y, Q.pack_fp4(Q.e2m1_codes(x))))
    ''')
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == "True", r.stdout
