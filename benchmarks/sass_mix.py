"""Instruction mix of the Triton cores, compiled offline for sm_90 (no GPU needed): how many
conversion (I2F / F2I / F2FP), MUFU, tensor-core (IMMA/QGMMA/HGMMA...) and other SASS instructions each
kernel has, in total and in its loops (every loop of the kernel together, edge loops included). F2I and
MUFU.EX2 issue at 16 per clock and SM on sm_90 (an eighth of the FP32 rate): replacing the INT8 kernels'
F2I roundings paid 1.09-1.20x; I2FP (int32 -> fp32) is not that slow (results/ab_kernels_run39_*).

    python benchmarks/sass_mix.py [--kernels fwd,dkdv_split,dq,int8_fp8] [--hd 128] [--dump DIR]
    python benchmarks/sass_mix.py --csrc [--hd 128]

Signatures are specialised as the JIT does on the GPU (pointers and sizes divisible by 16). ``--csrc``: the CUDA
kernels of ``csrc/`` instead (nvcc -cubin with the extension's flags, needs nvcc, not a GPU): the non-causal bf16
kernels at ``--hd``, each innermost loop of 64 or more instructions (one step of the kernel's main or edge loop)
with its length and mix: a consumer warp issues at most one instruction a clock, so a loop's length sets the
step's issue time, beside the tensor cores' time for the step's products.
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


def _parse(sass: str):
    """The instructions of a SASS listing as (address, mnemonic, branch target or None), and its loops: the
    ranges (lo, hi) from a branch's target up to a later branch back to it."""
    ins = []
    for l in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)([^;]*)", l)
        if m:
            t = re.match(r"\s+(0x[0-9a-f]+)", m.group(3)) if m.group(2) == "BRA" else None
            ins.append((int(m.group(1), 16), m.group(2), int(t.group(1), 16) if t else None))
    return ins, [(t, a) for a, _, t in ins if t is not None and t < a]


def mix(sass: str):
    """(counts over the whole kernel, counts inside loops) by instruction class (the mnemonic before its
    first dot)."""
    ins, loops = _parse(sass)
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


# --csrc: (source, mangled name of the kernel's non-causal bf16 instance at head dim {d} (the masks' key-range
# variant of the int8_fp8 core excluded), what one step of a warpgroup multiplies)
CSRC = {
    "int8_fp8": ("int8_fp8_sm90.cu", r"_ZN9sage_sm9010fwd_kernelILi{d}ELi\d+ELb0ELb0E13__nv_bfloat16E",
                 "64 queries x 128 keys: S (s8) and PV (e4m3)"),
    "train_fwd": ("int8_train_sm90.cu", r"_ZN9sage_sm905train10fwd_kernelILi{d}ELi\d+ELb0E13__nv_bfloat16",
                  "64 queries x 64 keys: S and PV (s8)"),
    "train_dkdv": ("int8_train_sm90.cu", r"_ZN9sage_sm905train11dkdv_kernelILi{d}ELi\d+ELb0E13__nv_bfloat16",
                   "64 keys x 64 queries: S^T, dV, dK (s8), dP^T (bf16)"),
    "train_dq": ("int8_train_sm90.cu", r"_ZN9sage_sm905train9dq_kernelILi{d}ELi\d+ELb0E13__nv_bfloat16",
                 "64 queries x 64 keys: S, dQ (s8), dP (bf16)"),
}


def csrc_loops(hd: int, dump=None):
    """``{kernel: (step, [(loop length, Counter of its mnemonics), ...])}`` for :data:`CSRC`'s kernels, each
    innermost loop of 64 or more instructions (nvcc -cubin of the csrc sources with the extension's flags)."""
    from sage_compile.kernels import cuda_ext

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "csrc")
    d = dump or tempfile.mkdtemp()
    os.makedirs(d, exist_ok=True)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out = {}
    for src in sorted({v[0] for v in CSRC.values()}):
        cubin = os.path.join(d, src.replace(".cu", ".cubin"))
        subprocess.run(["nvcc", *cuda_ext.cuda_flags(), "-cubin", "-o", cubin, os.path.join(root, src)], check=True,
                       capture_output=True, text=True)
        listing = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
        funcs = re.split(r"\n\s*Function : ", listing)
        for name, (s, pat, step) in CSRC.items():
            if s != src:
                continue
            body = next(f for f in funcs if re.match(pat.format(d=hd), f))
            ins, loops = _parse(body)
            inner = [(lo, hi) for lo, hi in loops
                     if not any((lo, hi) != (l2, h2) and lo <= l2 and h2 <= hi for l2, h2 in loops)]
            res = []
            for lo, hi in sorted(set(inner)):
                ops = collections.Counter(op for a, op, _ in ins if lo <= a <= hi)
                if sum(ops.values()) >= 64:
                    res.append((sum(ops.values()), ops))
            out[name] = (step, res)
    return out


def main_csrc(hd: int, dump=None):
    print(f"hd{hd}  CUDA kernels (csrc/, nvcc offline): each innermost loop of >= 64 instructions (a step of "
          "one consumer warp), its length and mix")
    for name, (step, loops) in csrc_loops(hd, dump).items():
        print(f"{name}: one step of a warpgroup = {step}")
        for n, ops in loops:
            top = ", ".join(f"{op} {c}" for op, c in ops.most_common(12))
            print(f"  {n:4d} instructions: {top}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default="fwd,dkdv_split,dq,int8_fp8")
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--dump", default=None)
    ap.add_argument("--csrc", action="store_true", help="the CUDA kernels of csrc/ instead of the Triton cores")
    a = ap.parse_args()
    if a.csrc:
        main_csrc(a.hd, a.dump)
        return
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
