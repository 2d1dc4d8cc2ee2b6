"""What the host was doing while the GPU waited: GPU idle time of a torch.profiler Chrome trace, attributed to
host ops.

For each gap between the GPU's activities (kernels, copies, sets; all streams merged), the window from the end of
the GPU's last activity to the host's launch of the next one is spent on the launching thread: its time is
credited to the outermost host op running there (containers such as the compiled graph's call or the compiled
autograd function are looked through), and to ``(no op)`` where none runs. A gap whose next activity was launched
before the GPU went idle is ``(launch latency)``. Per trace: the total GPU idle and the largest credits. With
``--kernels``, also the GPU kernels by name (a trailing ``_<n>`` of Inductor's dropped) per step, and where two
traces are given the kernels whose counts differ most between them. A trace cut off while written (a gzip stream
without its end, the time limit of a run) is read up to its last whole event, and said so.

    python benchmarks/trace_gaps.py TRACE.json.gz [TRACE2.json.gz ...] [--top 25] [--min-us 2] [--kernels --steps 3]

(``train_step.py --trace PREFIX`` writes such traces.)
"""
from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import re
import sys
import zlib

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
HOST_CATS = ("cpu_op", "user_annotation")
CONTAINERS = ("## Call CompiledFxGraph", "Torch-Compiled Region", "CompiledFunction", "autograd::engine::",
              "ProfilerStep", "## ")


def load(path: str) -> list:
    """The trace's events; of a truncated gzip trace, those before the cut (a note on stderr)."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            return json.load(f)["traceEvents"]
    except EOFError:
        pass
    with open(path, "rb") as f:
        text = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(f.read()).decode("utf-8", "replace")
    cut = text.rfind("\n  },\n  {")  # torch.profiler writes one event per "  {" ... "  }" block
    if cut < 0:
        raise ValueError(f"{path}: truncated before its first whole event")
    events = json.loads(text[:cut] + "\n  }\n]}")["traceEvents"]
    print(f"{path}: truncated trace, read its first {len(events)} events", file=sys.stderr)
    return events


def _is_container(name: str) -> bool:
    return name.startswith(CONTAINERS)


class Thread:
    """One host thread's ops, with the outermost non-container op over any instant."""

    def __init__(self, ops: list):
        ops = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
        top = []  # the outermost non-container ops (start, end, name), in order
        for e in ops:
            s, t = e["ts"], e["ts"] + e["dur"]
            if not _is_container(e["name"]) and not (top and top[-1][1] > s):
                top.append((s, t, e["name"]))
        self.top = top
        self.starts = [s for s, _, _ in top]

    def credit(self, a: float, b: float, out: collections.Counter) -> None:
        """Credit the window [a, b) to the outermost ops over it, and the rest to ``(no op)``."""
        i = max(0, bisect.bisect_right(self.starts, a) - 1)
        covered = 0.0
        while i < len(self.top) and self.top[i][0] < b:
            s, t, name = self.top[i]
            o = min(b, t) - max(a, s)
            if o > 0:
                out[name] += o
                covered += o
            i += 1
        out["(no op)"] += max(0.0, (b - a) - covered)


def gaps(events: list, min_us: float = 2.0):
    """``(GPU busy us, GPU idle us, Counter of idle us by host op, span us)`` over the trace's GPU span."""
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    by_tid = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in HOST_CATS:
            by_tid[e["tid"]].append(e)
    threads = {tid: Thread(ops) for tid, ops in by_tid.items()}
    credit, busy, idle = collections.Counter(), 0.0, 0.0
    end = None
    for e in gpu:
        s, t = e["ts"], e["ts"] + e["dur"]
        if end is not None and s - end > min_us:
            idle += s - end
            launch = launches.get(e["args"].get("correlation"))
            if launch is None:
                credit["(launch not in trace)"] += s - end
            elif launch["ts"] <= end:
                credit["(launch latency)"] += s - end
            else:
                th = threads.get(launch["tid"])
                if th is None:
                    credit["(no op)"] += launch["ts"] - end
                else:
                    th.credit(end, launch["ts"], credit)
                credit["(launch latency)"] += s - launch["ts"]
        busy += max(0.0, t - max(s, end if end is not None else s))
        end = t if end is None else max(end, t)
    span = (end - gpu[0]["ts"]) if gpu else 0.0
    return busy, idle, credit, span


def kernels(events: list, steps: float = 1.0) -> dict:
    """GPU kernels by name (Inductor's trailing ``_<n>`` dropped): ``{name: (launches, ms)}`` per step."""
    out = collections.defaultdict(lambda: [0.0, 0.0])
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            row = out[re.sub(r"_\d+$", "", e["name"])]
            row[0] += 1 / steps
            row[1] += e["dur"] / 1e3 / steps
    return {k: tuple(v) for k, v in out.items()}


def kernel_diff(a: dict, b: dict, top: int) -> list:
    """The ``top`` kernel names whose per-step launches differ most between ``a`` and ``b``:
    ``(name, launches a, ms a, launches b, ms b)``."""
    zero = (0.0, 0.0)
    names = sorted(set(a) | set(b), key=lambda n: (-abs(b.get(n, zero)[0] - a.get(n, zero)[0]), n))
    return [(n, *a.get(n, zero), *b.get(n, zero)) for n in names[:top]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--min-us", type=float, default=2.0, help="gaps shorter than this are not counted")
    ap.add_argument("--kernels", action="store_true", help="also the kernels by name, per step")
    ap.add_argument("--steps", type=float, default=1.0, help="steps in each trace (train_step.py --trace: 3)")
    a = ap.parse_args()
    per = []
    for path in a.traces:
        events = load(path)
        busy, idle, credit, span = gaps(events, a.min_us)
        print(f"{path}: GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle {idle / 1e3:.1f} ms "
              f"(gaps > {a.min_us:g} us)")
        for name, us in credit.most_common(a.top):
            print(f"    {us / 1e3:8.3f} ms  {name[:100]}")
        if a.kernels:
            per.append(kernels(events, a.steps))
            rows = sorted(per[-1].items(), key=lambda kv: -kv[1][1])
            print(f"  kernels a step: {sum(n for n, _ in per[-1].values()):.0f} launches, "
                  f"{sum(ms for _, ms in per[-1].values()):.2f} ms")
            for name, (n, ms) in rows[:a.top]:
                print(f"    {n:7.1f} x {ms:8.3f} ms  {name[:90]}")
    if a.kernels and len(per) == 2:
        print(f"kernels whose launches a step differ most: {a.traces[0]} | {a.traces[1]}")
        for name, n0, ms0, n1, ms1 in kernel_diff(per[0], per[1], a.top):
            print(f"    {n0:7.1f} x {ms0:7.3f} ms | {n1:7.1f} x {ms1:7.3f} ms  {name[:80]}")


if __name__ == "__main__":
    main()
