"""Instruction mix of the Triton cores, compiled offline for sm_90 (no GPU needed): how many
conversion (I2F / F2I / F2FP), MUFU, tensor-core (IMMA/QGMMA/HGMMA...) and other SASS instructions each
kernel has, in total and in its loops (every loop of the kernel together, edge loops included). F2I and
MUFU.EX2 issue at 16 per clock and SM on sm_90 (an eighth of the FP32 rate): replacing the INT8 kernels'
F2I roundings paid 1.09-1.20x; I2FP (int32 -> fp32) is not that slow (results/ab_kernels_run39_*).

    python benchmarks/sass_mix.py [--kernels fwd,dkdv_split,dq,int8_fp8] [--hd 128] [--dump DIR]

Signatures are specialised as the JIT does on the GPU (pointers and sizes divisible by 16).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

NODIV = {"c", "sm", "HQ", "H", "GROUP", "NQB", "NKB", "smb", "smh", "smq", "smk", "LQ", "LK"}
FLOATS = {"c", "sm"}
CLASSES = ("I2F", "I2FP", "F2I", "F2FP", "I2I", "MUFU", "IMMA", "HMMA", "QGMMA", "IGMMA", "HGMMA", "FSEL",
           "FMNMX", "FFMA", "FMUL", "FADD", "IADD3", "LOP3", "PRMT")


def _compile(fn, ptrs, const, warps, stages):
    sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n in FLOATS else "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] != "constexpr" and n not in NODIV}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", 90, 128), options=dict(num_warps=warps, num_stages=stages))


def sass_of(kernel, dump=None, name="k"):
    d = dump or tempfile.mkdtemp()
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, name + ".cubin")
    open(path, "wb").write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    if dump:
        open(os.path.join(d, name + ".sass"), "w").write(sass)
    return sass, res


def mix(sass: str):
    """(counts over the whole kernel, counts inside loops) by instruction class (the mnemonic before its
    first dot). A loop is the range from a branch's target up to a later branch back to it."""
    ins = []  # (address, mnemonic, branch target or None)
    for l in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)([^;]*)", l)
        if m:
            t = re.match(r"\s+(0x[0-9a-f]+)", m.group(3)) if m.group(2) == "BRA" else None
            ins.append((int(m.group(1), 16), m.group(2), int(t.group(1), 16) if t else None))
    loops = [(t, a) for a, _, t in ins if t is not None and t < a]
    tot, lp = collections.Counter(), collections.Counter()
    for a, op, _ in ins:
        for c in (op, "ALL"):
            tot[c] += 1
            if any(lo <= a <= hi for lo, hi in loops):
                lp[c] += 1
    return tot, lp


def kernels(hd: int):
    from sage_compile.kernels.int8_fp8 import attention as F
    from sage_compile.kernels.int8_train import attention as A
    i8, f32, b16, f8 = "*i8", "*fp32", "*bf16", "*fp8e4nv"
    base = dict(D=hd, CAUSAL=0, MASK_KIND=0, GATED=False, BLOCK_D=hd, EVEN_N=True, EMULATE=False, GROUP=1)
    return {
        "fwd": (A._fwd_kernel, dict(Q8=i8, QS=f32, K8=i8, KS=f32, V8T=i8, VS=f32, MASK=f32, OUT=b16, LSE=f32),
                dict(base, BLOCK_M=128, BLOCK_N=64), 8, 2),
        "dkdv_split": (A._bwd_dkdv_split, dict(Q8=i8, Q8T=i8, QS=f32, K8=i8, KS=f32, V16=b16, MASK=f32, LSE=f32,
                                               DELTA=f32, DO16=b16, DO8T=i8, SDO=f32, DK=b16, DV=b16),
                       dict(base, BLOCK_M=64, BLOCK_N=64), 4, 2),
        "dq": (A._bwd_dq, dict(Q8=i8, QS=f32, K8=i8, K8T=i8, KS=f32, V16=b16, KMEAN=f32, MASK=f32, LSE=f32,
                               DELTA=f32, DO16=b16, DQ=b16), dict(base, BLOCK_M=128, BLOCK_N=64, PSI_ROWS=True), 8, 3),
        "int8_fp8": (F._fwd_body, dict(Q8=i8, QS=f32, K8=i8, KS=f32, V8=f8, VS=f32, MASK=f32, FLAG="*i32",
                                       KRANGE="*i32", OUT=b16),
                     dict(D=hd, CAUSAL=0, MASK_KIND=0, BLOCK_D=hd, EMULATE=False, BLOCK_M=128, BLOCK_N=128,
                          P_OFF=8.807354922057604, WS=False, PV=0, GENERAL_ONLY=False), 8, 3),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default="fwd,dkdv_split,dq,int8_fp8")
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--dump", default=None)
    a = ap.parse_args()
    ks = kernels(a.hd)
    cols = ("ALL",) + CLASSES
    print(f"hd{a.hd}  loop instructions by class (whole kernel in brackets); STACK = spill bytes")
    print("kernel".ljust(12) + "".join(c.rjust(7) for c in cols) + "  STACK")
    for name in a.kernels.split(","):
        fn, ptrs, const, w, s = ks[name]
        sass, res = sass_of(_compile(fn, ptrs, const, w, s), a.dump, f"{name}_hd{a.hd}")
        tot, lp = mix(sass)
        stack = re.search(r"STACK:(\d+)", res).group(1)
        print(name.ljust(12) + "".join(str(lp[c]).rjust(7) for c in cols) + f"  {stack}")
        print("".ljust(12) + "".join(f"({tot[c]})".rjust(7) for c in cols))


if __name__ == "__main__":
    main()
