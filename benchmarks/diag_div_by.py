"""The arithmetic of :func:`sage_compile.kernels._common.div_by` checked against IEEE fp32 division on many
(x, s) pairs, CPU only (numpy, exact FMA emulation): q = RN(x·r) with r = RN(1/s), then q' = RN(q + (x -
q·s)·r) with the residual exact. Divisors over [2^-60, 2^60]; numerators random, at half-integer quotients
(INT8's rounding ties) and within a few ulps of them. Prints the mismatches of q' and of its INT8 rounding
(both must be 0) and how often the uncorrected RN(x·r) would have rounded differently.

    python benchmarks/diag_div_by.py [--batches 50]   # 50 x 2M = 10^8 pairs, ~2 min
"""
from __future__ import annotations

import argparse

import numpy as np

f32, f64 = np.float32, np.float64


def fma32(a, b, c):
    """RN32(a·b + c) exactly for fp32 arrays: a·b is exact in fp64, the sum is kept exact as (s, e) by
    TwoSum, and a sum that fp64 rounded onto an fp32 midpoint is sent to e's side of it."""
    p = a.astype(f64) * b.astype(f64)
    c = c.astype(f64)
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    r = s.astype(f32)
    half = np.spacing(np.abs(r)).astype(f64) / 2
    mid = (np.abs(s - r.astype(f64)) == half) & (e != 0)
    return np.where(mid, (s + np.sign(e) * half).astype(f32), r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--n", type=int, default=2_000_000)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    rne = lambda v: (v + f32(12582912.0)).astype(f32) - f32(12582912.0)  # noqa: E731
    tot = naive = bad_q = bad_i = 0
    for _ in range(a.batches):
        n = a.n
        s = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-60, 60, n)).astype(f32)
        k = rng.integers(-127, 127, n) + 0.5
        mode = rng.random(n)
        x = np.where(mode < 0.4, rng.uniform(-1, 1, n) * 127 * s.astype(f64),
                     np.where(mode < 0.8, k * s.astype(f64) * (1 + rng.normal(0, 3e-7, n)), k * s.astype(f64))).astype(f32)
        ref = x / s  # IEEE fp32 division
        r = (f32(1) / s).astype(f32)
        q = (x * r).astype(f32)
        q1 = fma32(fma32(q, -s, x), r, q)
        tot += n
        naive += int((rne(q) != rne(ref)).sum())
        bad_q += int((q1 != ref).sum())
        bad_i += int((rne(q1) != rne(ref)).sum())
    print(f"{tot} pairs: corrected quotient mismatches {bad_q}, INT8 rounding mismatches {bad_i} "
          f"(uncorrected x*r: {naive} INT8 roundings differ)")


if __name__ == "__main__":
    main()
