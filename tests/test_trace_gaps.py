"""benchmarks/trace_gaps.py's attribution of GPU idle time to host ops, on a hand-made trace."""
from helpers import benchmark_module

trace_gaps = benchmark_module("trace_gaps")


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


def test_kernels_per_step_and_their_difference():
    ev = [_x("kernel", "triton_poi_fused_add_3", 0, 1000), _x("kernel", "triton_poi_fused_add_7", 0, 3000),
          _x("kernel", "fwd_kernel", 0, 500), _x("cpu_op", "aten::mm", 0, 9)]
    a = trace_gaps.kernels(ev, steps=2)
    assert a == {"triton_poi_fused_add": (1.0, 2.0), "fwd_kernel": (0.5, 0.25)}
    b = trace_gaps.kernels(ev[:1], steps=1)
    assert trace_gaps.kernel_diff(a, b, top=5) == [("fwd_kernel", 0.5, 0.25, 0.0, 0.0),
                                                  ("triton_poi_fused_add", 1.0, 2.0, 1.0, 1.0)]


def test_a_truncated_gzip_trace_is_read_to_its_last_whole_event(tmp_path, capsys):
    import gzip
    import json

    ev = [_x("kernel", f"k{i}", 10 * i, 5) for i in range(50)]
    text = json.dumps({"schemaVersion": 1, "traceEvents": ev}, indent=2)  # "  {" ... "  }" blocks, as the profiler
    text = text.replace('\n    {', '\n  {').replace('\n    }', '\n  }')
    assert trace_gaps.load(_write(tmp_path / "whole.json.gz", text.encode())) == ev
    raw = gzip.compress(text.encode())
    got = trace_gaps.load(_write(tmp_path / "cut.json.gz", raw[: len(raw) * 2 // 3]))
    assert 0 < len(got) < len(ev) and got == ev[: len(got)]
    assert "truncated trace" in capsys.readouterr().err


def _write(path, data: bytes) -> str:
    import gzip

    if data[:2] != b"\x1f\x8b":
        data = gzip.compress(data)
    path.write_bytes(data)
    return str(path)
