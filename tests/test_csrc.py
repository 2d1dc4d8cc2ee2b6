"""csrc/ on a CPU machine: the sm90 int8_fp8 kernel compiles with a plain ``nvcc -c`` for sm_90a (a CPU-only
torch cannot link the extension, so compile only), its SASS holds the INT8 (IGMMA) and FP8 (QGMMA) wgmma
instructions, bounded local-memory traffic, S's magic start (no int32 -> fp32 conversion) and, where its knobs
ask for it, the hd64 tensor-core ring, PV's lag into the next softmax and the three-input integer row max, and the
Python side falls back to the Triton core, with the reason, when the extension cannot be built. Skipped with a
note where nvcc is absent."""
import json
import os
import re
import shutil
import subprocess
import threading

import pytest
import torch

import sage_compile

import builds


def _cuobjdump():
    try:
        import triton
    except ImportError:
        return shutil.which("cuobjdump")
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return bundled if os.path.exists(bundled) else shutil.which("cuobjdump")


def background_builds(item):
    """tests/builds.py: the item's nvcc build starts when collection ends."""
    builds.start_nvcc(item, "int8_fp8")


LAG = "-DSAGE_PVLAG=7 -DSAGE_WG64=2"  # PV lagging into the next softmax (hd64 with two warpgroups: no spills)


@pytest.fixture(scope="module", params=["default", "-DSAGE_KPERM=0 -DSAGE_STAGES128=3", LAG,
                                        "-DSAGE_WGSHFL=0 -DSAGE_IMAX=0"])
def compiled(request):
    """(nvcc's run, the object, the knobs) of the build of the knobs ``request.param``."""
    return builds.nvcc_result("int8_fp8", request.param)


# The hd64 kernels run three consumer warpgroups at 160 registers (SAGE_WG64=3, 18 % faster on the H200 than
# two, benchmarks/results/cuda_variants_run14_*). The causal ones spilled a few scalars there (16 bytes before
# the uniform warpgroup index below), 36 with SAGE_KPERM=0; the non-causal ones nothing since S's magic start
# (SAGE_SMAGIC; 4 bytes before); bounded here so that growth is caught. The hd128 kernels spill nothing. The
# key-range kernels (KR: mask_structure's masks) are held to the same bounds; the kernels without masks are
# instruction for instruction those before KR existed (offline SASS diff).
# SAGE_PVLAG keeps PV's accumulator and operand live through the next row max: 0-4 bytes at hd128 (with the
# warpgroup index warp-uniform, which it implies); at hd64 it comes with two warpgroups (SAGE_WG64=2, 240
# registers), which spill nothing. SAGE_WGSHFL (the uniform index, default since run 84): no kernel spills with the
# default knobs; without it (SAGE_WGSHFL=0) the causal hd64 kernels spill up to 24 bytes with one tile loop, 40
# with the causal edge loops (SAGE_EDGELOOP 3, the default since run 98: two tile bodies).
HD64_SPILL_BYTES = {False: 0, True: 40}  # by causal, without the uniform index


def _spill_limit(knobs: str, d: str, causal: bool) -> int:
    if "SAGE_PVLAG=7" in knobs:
        return 8 if d == "128" else 0
    if "SAGE_KPERM=0" in knobs and d == "64":
        return 40
    if "SAGE_WGSHFL=0" not in knobs:
        return 0
    return HD64_SPILL_BYTES[causal] if d == "64" else 0


def _tile_loops(f: str) -> list:
    """The tile loops of one function's SASS: the bodies (instruction texts) of backward branches that hold one
    tile's exps (64 of P~ and 2 rescale factors) and no smaller such body, nor an EXIT (a retry stub's branch
    back into a loop from past the kernel's end spans more than the loop)."""
    ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", f)
    addr = {int(a, 16): i for i, (a, _) in enumerate(ins)}
    spans = []  # (first, last) instruction index of each backward branch's body with a tile's exps
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < int(a, 16) and int(m.group(1), 16) in addr:
            lo = addr[int(m.group(1), 16)]
            body = [t for _, t in ins[lo: i + 1]]
            if 64 <= sum("MUFU.EX2" in t for t in body) <= 70 and not any(t.startswith("EXIT") for t in body):
                spans.append((lo, i))
    return [[t for _, t in ins[lo: hi + 1]] for lo, hi in spans
            if not any(lo <= x and y <= hi and (x, y) != (lo, hi) for x, y in spans)]


def test_kernel_compiles_for_sm90a_without_spills(compiled):
    r, _, knobs = compiled
    assert r.returncode == 0, r.stderr[-3000:]
    entries = re.findall(r"Compiling entry function '(\w+)' for 'sm_90a'", r.stderr)
    assert len(entries) == 16, entries  # head dim 64/128 x causal or not x key ranges or not x bf16/fp16 output
    per = re.findall(r"Compiling entry function '_ZN9sage_sm9010fwd_kernelILi(\d+)ELi\d+ELb([01])ELb([01])E.*?"
                     r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr, re.S)
    assert len(per) == len(entries), per
    for d, causal, kr, st, ld in per:
        limit = _spill_limit(knobs, d, causal == "1")
        assert int(st) <= limit and int(ld) <= limit, (knobs, d, causal, kr, st, ld)
    assert "C7508" not in r.stderr  # ptxas ignored setmaxnreg
    assert "C7520" not in r.stderr  # ptxas serialized the wgmmas (an operand register defined in a divergent path)


def sass_functions(r, obj) -> list:
    """The SASS of each function of the object ``obj`` that the nvcc run ``r`` wrote (name on the first line);
    skips the test where there is no object or no cuobjdump."""
    tool = _cuobjdump()
    if r.returncode != 0 or tool is None:
        pytest.skip("no object or no cuobjdump")
    sass = subprocess.run([tool, "--dump-sass", obj], capture_output=True, text=True).stdout
    return re.split(r"\n\s*Function : ", sass)[1:]


def test_sass_has_int8_and_fp8_wgmma(compiled):
    r, obj, knobs = compiled
    funcs = sass_functions(r, obj)
    assert len(funcs) == 16
    for f in funcs:
        name = f.split("\n", 1)[0]
        assert "IGMMA.64x128x32.S8.S8" in f, name
        assert re.search(r"QGMMA\.64x(64|128)x32\.F32\.E4M3\.E4M3", f), name
        assert "UTMALDG" in f and "USETMAXREG" in f, name
        d, causal = re.search(r"fwd_kernelILi(\d+)ELi\d+ELb([01])ELb[01]E", name).groups()
        local = len(re.findall(r"\b(LDL|STL)\b", f))
        assert local <= (12 if _spill_limit(knobs, d, causal == "1") else 0), (knobs, name, local)
        # asynchronous: the wgmmas of a turn are issued back to back, one wait for the first S and one for
        # PV + next S in each tile loop (SAGE_EDGELOOP; a key range's first tile at hd128 one more), two with
        # SAGE_PVLAG (a serialized kernel waits after every wgmma: 20+ waits)
        lag = "SAGE_PVLAG=7" in knobs
        assert len(re.findall(r"WARPGROUP\.DEPBAR", f)) <= (8 if lag else 5), name
        loops = _tile_loops(f)
        assert loops, name
        for body in loops:  # SAGE_PVLAG: S waited alone; PV waited after (most of) the next tile's row max
            at = [i for i, t in enumerate(body) if t.startswith("WARPGROUP.DEPBAR")]
            waits = [body[i] for i in at]
            maxes = [i for i, t in enumerate(body) if t.startswith(("FMNMX", "VIMNMX"))]
            if lag:
                assert [w.split()[-1] for w in waits] == ["0x0", "0x1"], (name, waits)
                assert sum(i < at[0] for i in maxes) >= 0.7 * len(maxes), name
            else:
                assert len(waits) <= 1, (name, waits)
            # SAGE_IMAX: the row maxima on the logits' bits, three inputs a step (15 VIMNMX3 a row); without
            # it, two-input float maxima (31 FMNMX a row)
            three = sum(t.startswith("VIMNMX3") for t in body)
            if "SAGE_IMAX=0" not in knobs and "SAGE_KPERM=0" not in knobs:
                assert three >= 30 and len(maxes) <= 40, (name, three, len(maxes))
            else:
                assert three == 0 and len(maxes) >= 62, (name, len(maxes))
        # the tensor-core ring of the three hd64 warpgroups (SAGE_RING64C, on by default for causal; SAGE_RING64 for
        # the rest): in each tile loop one predicated wait at each of barriers 6-8, then every wgmma of the loop,
        # then one predicated pass to each; no such barrier in the other kernels
        knob_on = "-DSAGE_RING64=1" in knobs.split() if causal == "0" else "-DSAGE_RING64C=0" not in knobs.split()
        ring_on = d == "64" and knob_on and "SAGE_WG64=2" not in knobs  # (no ring with two warpgroups)
        for body in loops:
            syncs = [i for i, t in enumerate(body) if re.match(r"@!?P\d BAR\.SYNC\.DEFER_BLOCKING 0x[678], 0x100", t)]
            passes = [i for i, t in enumerate(body) if re.match(r"@!?P\d BAR\.ARV 0x[678], 0x100", t)]
            gmma = [i for i, t in enumerate(body) if "GMMA" in t]
            if ring_on:
                assert sorted(body[i].split()[-2] for i in syncs) == ["0x6,", "0x7,", "0x8,"], (knobs, name)
                assert len(passes) == 3 and max(syncs) < min(gmma) and max(gmma) < min(passes), (knobs, name)
            else:
                assert not syncs and not passes, (knobs, name)
        # S's magic start (SAGE_SMAGIC: every kernel with grouped K scales by default): S read as floats, no
        # int32 -> fp32 conversion; the accumulator filled by LDS.128 (16 a fill: the first S's and the loop's)
        if "SAGE_KPERM=0" not in knobs:
            assert not re.search(r"I2FP\.F32\.S32", f), (knobs, name)
            assert len(re.findall(r"LDS\.128 ", f)) >= 32, (knobs, name)


def test_build_failure_falls_back_with_the_reason(monkeypatch, caplog):
    """A GPU without a working build: load() returns None once, logs why, and status() keeps it."""
    from torch.utils import cpp_extension

    from sage_compile.kernels.int8_fp8 import cuda

    monkeypatch.setattr(cuda, "_state", cuda.fresh_state())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    calls = []

    def broken(**kw):
        calls.append(kw["name"])
        raise RuntimeError("Error building extension 'sage_int8_fp8_sm90': nvcc not found")

    monkeypatch.setattr(cpp_extension, "load", broken)
    with caplog.at_level("WARNING", logger="sage_compile"):
        assert cuda.load() is None
        assert cuda.load() is None  # tried once per process
    assert len(calls) == 1 and calls[0].startswith("sage_int8_fp8_sm90_")
    st = cuda.status()
    assert st["built"] is False and st["build_s"] >= 0 and st["select_s"] == 0 and st["prebuild_s"] is None
    assert st["error"] == "RuntimeError: Error building extension 'sage_int8_fp8_sm90': nvcc not found"
    assert "using the Triton core" in caplog.text
    assert os.environ.get("TORCH_CUDA_ARCH_LIST") != "9.0a"  # restored


def test_wrong_gpu_is_reported(monkeypatch):
    from sage_compile.kernels.int8_fp8 import cuda

    monkeypatch.setattr(cuda, "_state", cuda.fresh_state())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))
    assert cuda.load() is None
    assert "9.0" in cuda.status()["error"] and "8.9" in cuda.status()["error"]


def test_prebuild_runs_load_once_in_a_thread(monkeypatch):
    """The backend's prebuild: load() in a daemon thread, once; a later load() returns its result."""
    from sage_compile.kernels.int8_fp8 import cuda

    monkeypatch.setattr(cuda, "_state", cuda.fresh_state())
    monkeypatch.setattr(cuda, "_prebuild", {"thread": None})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    calls, threads = [], []
    sentinel = object()

    def fake_build():
        calls.append(threading.current_thread().name)
        return sentinel

    monkeypatch.setattr(cuda, "build", fake_build)
    cuda.prebuild()
    cuda.prebuild()  # a second call starts nothing
    threads.append(cuda._prebuild["thread"])
    threads[0].join(10)
    assert cuda.load() is sentinel
    assert calls == ["sage_compile-cuda-build"]
    st = cuda.status()
    assert st["prebuild_s"] is not None and st["build_s"] < 1  # the thread's time apart from the caller's
    cuda.prebuild()  # after the build: nothing either
    assert cuda._prebuild["thread"] is threads[0] and calls == ["sage_compile-cuda-build"]


def test_backend_starts_the_build_for_cuda_int8_fp8_sites(monkeypatch):
    """rewrite_graph asks for the prebuild when it replaced an int8_fp8 site on CUDA (not for CPU sites)."""
    from sage_compile import backend
    from sage_compile.kernels.int8_fp8 import cuda
    from sage_compile.passes.site import Site

    asked = []
    monkeypatch.setattr(cuda, "prebuild", lambda: asked.append(1))
    cfg = sage_compile.config.resolve(kernel="int8_fp8")
    rows = []

    def capture(gm, example_inputs):
        rows.extend(backend.rewrite_graph(gm, cfg))
        return gm.forward

    q = torch.randn(1, 2, 8, 16)
    f = lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q)  # noqa: E731
    torch._dynamo.reset()
    torch.compile(f, backend=capture)(q)  # a CPU site
    assert asked == [] and rows and rows[0]["decision"] != "kept", rows
    monkeypatch.setattr(Site, "device_type", property(lambda self: "cuda"))
    torch._dynamo.reset()
    torch.compile(f, backend=capture)(q)
    assert asked == [1]
    torch._dynamo.reset()


def test_core_choice_is_cached_on_disk(monkeypatch, tmp_path):
    """auto's measured choice goes to SAGE_COMPILE_CACHE_DIR/int8_fp8_core.json under a scope (GPU, torch,
    triton, sources); a new process (empty in-memory cache) reads it instead of timing the cores; another
    scope or a corrupt file measures again; SAGE_COMPILE_CACHE_DIR='' keeps choices in memory only."""
    from sage_compile.kernels.int8_fp8 import cuda

    monkeypatch.setenv("SAGE_COMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    scope = ["H200|a"]
    monkeypatch.setattr(cuda, "_cache_scope", lambda device: scope[0])
    monkeypatch.setattr(cuda, "_state", cuda.fresh_state())
    timed = []
    monkeypatch.setattr(cuda, "_time", lambda fn: (timed.append(fn()), 1.0 if fn() == "cuda" else 2.0)[1])
    q8, k8 = torch.zeros(1, 2, 300, 64, dtype=torch.int8), torch.zeros(1, 2, 300, 64, dtype=torch.int8)
    args = (q8, k8, "none", lambda: "cuda", lambda: "triton")

    def fresh_process():
        monkeypatch.setattr(cuda, "_choice", {})
        monkeypatch.setattr(cuda, "_unmeasured", set())
        timed.clear()

    fresh_process()
    assert cuda.known_choice(*args[:3]) is None  # (masked calls: nothing measured, nothing timed)
    assert cuda.prefer_cuda(*args) is True and timed == ["cuda", "triton"]
    data = json.loads((tmp_path / "int8_fp8_core.json").read_text())
    assert list(data) == ["H200|a"] and list(data["H200|a"].values()) == [True]
    fresh_process()
    assert cuda.prefer_cuda(*args) is True and timed == []  # read from disk, nothing timed
    assert cuda.status()["select_s"] > 0
    fresh_process()
    assert cuda.known_choice(*args[:3]) is True and timed == []
    scope[0] = "H200|b"  # new sources: measured again, the stale scope dropped
    fresh_process()
    assert cuda.prefer_cuda(*args) is True and timed == ["cuda", "triton"]
    assert list(json.loads((tmp_path / "int8_fp8_core.json").read_text())) == ["H200|b"]
    (tmp_path / "int8_fp8_core.json").write_text("{not json")
    fresh_process()
    assert cuda.prefer_cuda(*args) is True and timed == ["cuda", "triton"]
    monkeypatch.setenv("SAGE_COMPILE_CACHE_DIR", "")
    assert cuda.choice_cache_path() is None
    fresh_process()
    (tmp_path / "int8_fp8_core.json").unlink()
    assert cuda.prefer_cuda(*args) is True and timed == ["cuda", "triton"]
    assert not (tmp_path / "int8_fp8_core.json").exists()


@pytest.mark.parametrize("times,timed,cuda_wins", [
    ({"cuda": 1.0, "quick": 1.2}, ["cuda", "quick"], True),  # beats the one configuration by > 10 %
    ({"cuda": 1.3, "quick": 1.2}, ["cuda", "quick"], False),  # slower than it: slower than the autotuned too
    ({"cuda": 1.0, "quick": 1.05, "triton": 0.95}, ["cuda", "quick", "triton"], False),  # close: autotuned
    ({"cuda": 1.0, "quick": 1.05, "triton": 1.02}, ["cuda", "quick", "triton"], True),
])
def test_core_choice_times_one_triton_configuration_first(monkeypatch, times, timed, cuda_wins):
    """prefer_cuda with the Triton core's one-configuration run: the autotuned core (every configuration
    compiled and timed) is timed only where the CUDA core is within QUICK_MARGIN of that run."""
    from sage_compile.kernels.int8_fp8 import cuda

    monkeypatch.setenv("SAGE_COMPILE_CACHE_DIR", "")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(cuda, "_cache_scope", lambda device: "H200|a")
    monkeypatch.setattr(cuda, "_state", cuda.fresh_state())
    monkeypatch.setattr(cuda, "_choice", {})
    monkeypatch.setattr(cuda, "_unmeasured", set())
    seen = []
    monkeypatch.setattr(cuda, "_time", lambda fn: (seen.append(fn()), times[seen[-1]])[1])
    q8 = torch.zeros(1, 2, 300, 64, dtype=torch.int8)
    got = cuda.prefer_cuda(q8, q8, "none", lambda: "cuda", lambda: "triton", lambda: "quick")
    assert got is cuda_wins and seen == timed
    assert cuda.prefer_cuda(q8, q8, "none", lambda: "cuda", lambda: "triton", lambda: "quick") is cuda_wins
    assert seen == timed  # cached in the process


def test_quick_configuration_is_one_of_the_autotuners():
    """The one-configuration run bounds the autotuned time only if the autotuner tries that configuration."""
    from sage_compile.kernels.int8_fp8 import attention as A

    tried = {(c.kwargs["BLOCK_M"], c.num_warps, c.num_stages) for c in A._configs()}
    assert set(A.QUICK_CONFIG) == {64, 128} and set(A.QUICK_CONFIG.values()) <= tried


def test_build_name_follows_the_sources(tmp_path):
    from sage_compile.kernels import cuda_ext

    a, b = tmp_path / "a.cu", tmp_path / "b.cu"
    a.write_text("x")
    b.write_text("y")
    f = cuda_ext.cuda_flags()
    assert cuda_ext._build_name([str(a)], f) != cuda_ext._build_name([str(b)], f)
    assert cuda_ext._build_name([str(a)], f) == cuda_ext._build_name([str(a)], f)
    assert cuda_ext._build_name([str(a)], f) != cuda_ext._build_name([str(a)], cuda_ext.cuda_flags(("-DSAGE_KPERM=0",)))


def test_builds_in_two_threads_each_see_sm90a(monkeypatch):
    """The backend's background builds of both extensions may overlap: each build sees TORCH_CUDA_ARCH_LIST=9.0a
    for its whole length, and the caller's value comes back after both."""
    import time

    from torch.utils import cpp_extension

    from sage_compile.kernels import cuda_ext

    seen = []

    def fake_load(**kw):
        seen.append(os.environ.get("TORCH_CUDA_ARCH_LIST"))
        time.sleep(0.05)
        seen.append(os.environ.get("TORCH_CUDA_ARCH_LIST"))
        return kw["name"]

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    threads = [threading.Thread(target=cuda_ext.build_extension, args=(p, s))
               for p, s in (("a", ("int8_fp8_sm90.cu",)), ("b", ("int8_train_sm90.cu",)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == ["9.0a"] * 4 and os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0"


def test_flags_from_the_environment(monkeypatch):
    from sage_compile.kernels import cuda_ext

    monkeypatch.setenv("SAGE_COMPILE_CUDA_FLAGS", " -DSAGE_STAGES128=3  -DSAGE_KPERM=0 ")
    assert cuda_ext.cuda_flags(("-DX",))[-3:] == ("-DSAGE_STAGES128=3", "-DSAGE_KPERM=0", "-DX")
    assert cuda_ext.cuda_flags()[: len(cuda_ext.CUDA_FLAGS)] == cuda_ext.CUDA_FLAGS


def test_core_choice_from_the_environment():
    from sage_compile.config import int8_fp8_core

    assert int8_fp8_core({}) == "auto"
    assert int8_fp8_core({"SAGE_COMPILE_INT8_FP8_CORE": "CUDA"}) == "cuda"
    with pytest.raises(ValueError, match="SAGE_COMPILE_INT8_FP8_CORE"):
        int8_fp8_core({"SAGE_COMPILE_INT8_FP8_CORE": "fast"})


def test_sources_ship_as_package_data():
    from sage_compile.kernels.int8_fp8 import cuda

    paths = cuda.source_paths()
    assert [os.path.basename(p) for p in paths] == list(cuda.SOURCES)
    assert all(os.path.exists(p) for p in paths)


@pytest.mark.parametrize("shape,dtype", [((2, 3, 13, 64), torch.int8), ((2, 3, 13), torch.float32),
                                         ((1, 2, 5, 3), torch.int8), ((2, 1, 16, 64), torch.int8)])
def test_token_padding_for_the_tensor_maps(shape, dtype):
    """The wrapper's K / K-scale padding (whole groups of 4 keys) equals a zero pad, through any word size."""
    from sage_compile.kernels.int8_fp8 import cuda

    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 50).to(dtype)
    got = cuda.pad_tokens(x, 4)
    pad = (0, 0) * (len(shape) - 3) + (0, (-shape[2]) % 4)
    assert got.shape[2] == shape[2] + (-shape[2]) % 4 and got.is_contiguous()
    assert torch.equal(got, torch.nn.functional.pad(x.float(), pad).to(dtype))
