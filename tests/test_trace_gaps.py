"""benchmarks/trace_gaps.py's attribution of GPU idle time to host ops, on a hand-made trace."""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "trace_gaps", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "trace_gaps.py"))
trace_gaps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_gaps)


def _x(cat, name, ts, dur, tid=1, corr=None):
    e = dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, tid=tid, pid=1, args={})
    if corr is not None:
        e["args"]["correlation"] = corr
    return e


def test_idle_is_credited_to_the_outermost_host_op_before_the_launch():
    ev = [_x("cpu_op", "## Call CompiledFxGraph abc", 0, 1000),  # container: looked through
          _x("cpu_op", "sage_compile::attention_train", 100, 300),
          _x("cpu_op", "aten::empty", 120, 10),  # nested: not credited on its own
          _x("cuda_driver", "cuLaunchKernel", 150, 5, corr=1),
          _x("kernel", "k1", 160, 20, tid=7, corr=1),  # GPU busy 160-180
          _x("cpu_op", "aten::mm", 450, 50),
          _x("cuda_runtime", "cudaLaunchKernel", 490, 5, corr=2),
          _x("kernel", "k2", 500, 100, tid=7, corr=2),  # idle 180-500: op 180-400, none 400-450, mm 450-490
          _x("cuda_runtime", "cudaLaunchKernel", 560, 5, corr=3),
          _x("kernel", "k3", 605, 10, tid=7, corr=3)]  # launched before k2 ended: latency 600-605
    busy, idle, credit, span = trace_gaps.gaps(ev, min_us=2)
    assert (busy, idle, span) == (130, 325, 455)
    assert credit["sage_compile::attention_train"] == 220
    assert credit["(no op)"] == 50
    assert credit["aten::mm"] == 40
    assert credit["(launch latency)"] == 10 + 5
    assert "aten::empty" not in credit and not any(k.startswith("##") for k in credit)
