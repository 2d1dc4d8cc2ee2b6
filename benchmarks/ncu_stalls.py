"""Where a kernel's warps stall, from Nsight Compute's source page: the share of all warp-stall samples per
SASS opcode (with its top five reasons), then the hottest instructions.

    ncu --import r.ncu-rep --page source --csv --print-source sass > r_sass.csv
    python benchmarks/ncu_stalls.py r_sass.csv > results/ncu_..._stalls.txt
"""
from __future__ import annotations

import collections
import csv
import sys


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def main(path: str, top: int = 25) -> None:
    rows = list(csv.reader(open(path, errors="replace")))
    head = next(i for i, r in enumerate(rows) if "Source" in r and any("Sampling" in c for c in r))
    hdr = rows[head]
    data = [r for r in rows[head + 1:] if len(r) == len(hdr)]
    src, addr = hdr.index("Source"), hdr.index("Address") if "Address" in hdr else 0
    reasons = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]

    def opcode(r):
        t = r[src].split()
        return (t[1] if t and t[0].startswith("@") else t[0] if t else "?").split(".")[0]

    per_op = collections.defaultdict(collections.Counter)
    for r in data:
        for i in reasons:
            per_op[opcode(r)][hdr[i][6:]] += _num(r[i])
    total = sum(sum(c.values()) for c in per_op.values()) or 1.0
    for op, c in sorted(per_op.items(), key=lambda x: -sum(x[1].values()))[:14]:
        print(f"{op:10s} {sum(c.values()) / total * 100:5.1f}% ",
              " ".join(f"{k}={v / total * 100:.1f}" for k, v in c.most_common(5)))
    weight = lambda r: sum(_num(r[i]) for i in reasons)  # noqa: E731
    for r in sorted(data, key=weight, reverse=True)[:top]:
        worst = max(reasons, key=lambda i: _num(r[i]))
        print(f"{r[addr]:>8s} {weight(r) / total * 100:5.2f}% {hdr[worst][6:]:14s} {r[src][:70]}")


if __name__ == "__main__":
    main(sys.argv[1])
