"""csrc/int8_train_sm90.cu on a CPU machine: the SageBwd forward, dK/dV and dQ kernels compile with a plain
``nvcc -c`` for sm_90a, their SASS holds the INT8 (IGMMA) and 16-bit (HGMMA) wgmmas of each 64-token step and
TMA loads, no local memory and no serialized wgmmas; the Python side reads SAGE_COMPILE_INT8_TRAIN_CORE, keeps
the Triton kernels unless asked, and falls back to them with the reason where the CUDA kernels cannot run. Skipped with a note where
nvcc is absent. (The kernels' numerics are checked on the GPU: tests/test_kernel_int8_train_cuda_gpu.py.)"""
import logging
import re

import pytest
import torch

import builds
from test_csrc import sass_functions


def background_builds(item):
    """tests/builds.py: the item's nvcc build starts when collection ends."""
    builds.start_nvcc(item, "int8_train")


@pytest.fixture(scope="module", params=["default", "-DSAGE_TRAIN_PARTS=0 -DSAGE_TRAIN_STAGES=2 "
                                                   "-DSAGE_TRAIN_DQ_PARTS=1 -DSAGE_TRAIN_DQ_STAGES=4 "
                                                   "-DSAGE_TRAIN_FWD_STAGES=2",
                                        "-DSAGE_TRAIN_EDGELOOP=0 -DSAGE_TRAIN_MAXCHAINS64=0 -DSAGE_TRAIN_MAXCHAINS128=8",
                                        "-DSAGE_TRAIN_SMAGIC=0 -DSAGE_TRAIN_LAZY=0 -DSAGE_TRAIN_FMAROUND=0 "
                                        "-DSAGE_TRAIN_EARLY=0 -DSAGE_TRAIN_DFILL=0 -DSAGE_TRAIN_PP=58",
                                        # (DQPIPE with three dQ warpgroups spills 1152 bytes at hd128)
                                        "-DSAGE_TRAIN_DQPIPE=1 -DSAGE_TRAIN_DQ_WG=2 -DSAGE_TRAIN_FWD_WG64=2 "
                                        "-DSAGE_TRAIN_PP=7"])
def compiled(request):
    """(nvcc's run, the object, the knobs) of the build of the knobs ``request.param``."""
    return builds.nvcc_result("int8_train", request.param)


def test_kernel_compiles_without_spills_or_serialized_wgmmas(compiled):
    r, _, knobs = compiled
    assert r.returncode == 0, r.stderr[-3000:]
    per = re.findall(r"Compiling entry function '_ZN9sage_sm905train\d+(dkdv|dq|fwd)_kernelILi(\d+)ELi\d+ELb([01])E.*?"
                     r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr, re.S)
    assert len(per) == 24, per  # forward, dK/dV and dQ x head dim 64/128 x causal or not x bf16/fp16
    for kind, d, causal, st, ld in per:
        # dK/dV's two int32 products whole at hd128 (SAGE_TRAIN_PARTS=0): 52-84 bytes (20-52 with one loop); the
        # default halves dK's: none
        # (one loop, SAGE_TRAIN_EDGELOOP=0, with the LSE pairs loaded early (SAGE_TRAIN_EARLY): 8 bytes at hd128)
        limit = {"SAGE_TRAIN_PARTS=0": 96, "SAGE_TRAIN_EDGELOOP=0": 16}
        limit = max([v for k, v in limit.items() if k in knobs] or [0]) if d == "128" and kind == "dkdv" else 0
        assert int(st) <= limit and int(ld) <= limit, (knobs, d, causal, st, ld)
    for code in ("C7508", "C7510", "C7511", "C7514", "C7519", "C7520"):  # setmaxnreg ignored; wgmmas serialized or fenced
        assert code not in r.stderr, (code, knobs)


def test_sass_has_the_steps_wgmmas(compiled):
    r, obj, knobs = compiled
    funcs = sass_functions(r, obj)
    assert len(funcs) == 24
    for f in funcs:
        name = f.split("\n", 1)[0]
        kind, d = re.search(r"(dkdv|dq|fwd)_kernelILi(\d+)E", name).groups()
        d = int(d)
        fp16 = "6__half" in name
        # per step: S (D / 32 s8 k-steps, n64; the forward's first S before its loop too), dP (D / 16 16-bit
        # k-steps; not in the forward), then PV, dV and dK, or dQ (two k-steps each, in one n128 / n64 wgmma per
        # channel part); with SAGE_TRAIN_EDGELOOP (default) the step's code stands in 2 or 3 loops (masked / not),
        # else in one
        rs = re.findall(r"IGMMA\.64x(\d+)x32\.S8\.S8 R\d+, R\d+, gdesc", f)
        if kind == "fwd":
            want = [str(d)] * 2
        elif kind == "dkdv":
            halves = d == 128 and "SAGE_TRAIN_PARTS=0" not in knobs
            want = [str(d)] * 2 + [str(d // 2 if halves else d)] * (4 if halves else 2)
        else:
            halves = d == 128 and "SAGE_TRAIN_DQ_PARTS=1" in knobs
            want = [str(d // 2 if halves else d)] * (4 if halves else 2)
        copies = len(rs) // len(want)
        assert copies in ((1,) if "SAGE_TRAIN_EDGELOOP=0" in knobs else (2, 3)), (name, copies)
        assert sorted(rs) == sorted(want * copies), (name, rs)
        # (SAGE_TRAIN_DQPIPE: dQ's first S and dP before its loops too; each step issues the next one's)
        first = kind == "fwd" or (kind == "dq" and "SAGE_TRAIN_DQPIPE=1" in knobs)
        n_s = d // 32 * (copies + first)
        assert len(re.findall(r"IGMMA\.64x64x32\.S8\.S8 R\d+, gdesc", f)) == n_s, name
        n_dp = 0 if kind == "fwd" else d // 16 * (copies + first)
        hgmma = r"HGMMA\.64x64x16\.F32%s " % ("" if fp16 else r"\.BF16")  # (fp16: no suffix)
        assert len(re.findall(hgmma, f)) == n_dp, name
        # SAGE_TRAIN_DFILL (default): dP's wgmmas take A negated onto the fill with delta (dS one FMUL)
        dfill = "SAGE_TRAIN_DFILL=0" not in knobs
        assert len(re.findall(hgmma + r"R\d+, gdesc\[UR\d+\]\.negA", f)) == n_dp * dfill, name
        assert "UTMALDG" in f and "USETMAXREG" in f, name
        # the consumers' registers: 160 with three consumer warpgroups (dQ, and the hd64 forward: SAGE_TRAIN_DQ_WG,
        # SAGE_TRAIN_FWD_WG64, 3 by default), else 240; the producer's 24
        three = {"dq": "SAGE_TRAIN_DQ_WG=2" not in knobs,
                 "fwd": d == 64 and "SAGE_TRAIN_FWD_WG64=2" not in knobs, "dkdv": False}[kind]
        assert set(re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d+, )?(0x[0-9a-f]+)", f)) == \
            {"0xa0" if three else "0xf0", "0x18"}, name
        spills_ok = kind == "dkdv" and d == 128 and ("SAGE_TRAIN_PARTS=0" in knobs or "SAGE_TRAIN_EDGELOOP=0" in knobs)
        assert not re.search(r"\b(LDL|STL)\b", f) or spills_ok, name
        # the exps of P (32 a step; the forward's two rescale factors, and with SAGE_TRAIN_FWDMAX (default with S's
        # magic start) ψ's two row maxima) and no IEEE-division slow path (FCHK / CALL)
        fwdmax = kind == "fwd" and "SAGE_TRAIN_SMAGIC=0" not in knobs and "SAGE_TRAIN_FWDMAX=0" not in knobs
        assert len(re.findall(r"MUFU\.EX2", f)) == (32 + 2 * (kind == "fwd") + 2 * fwdmax) * copies, name
        if fwdmax:  # the forward's row maxima on S's bits: 7 three-input integer maxima a row, no float max tree
            assert len(re.findall(r"VIMNMX3", f)) == 14 * copies, name
            assert len(re.findall(r"FMNMX", f)) <= 4 * copies, name
        assert "FCHK" not in f and "CALL" not in f, name
        # int32 -> fp32 conversions a step: the products' folds (D a step in dK / dV, D / 2 in dQ, PV's D / 2) and
        # dQ's two ψ row sums; S's 32 only without its magic start (SAGE_TRAIN_SMAGIC), whose accumulator fill is
        # 8 LDS.128 a step (and the forward's first S)
        magic = "SAGE_TRAIN_SMAGIC=0" not in knobs
        folds = {"dkdv": d, "dq": d // 2 + 2, "fwd": d // 2}[kind]
        assert len(re.findall(r"I2FP\.F32\.S32", f)) == (folds + 32 * (not magic)) * copies, name
        # (SAGE_TRAIN_DFILL: dQ's fill of dP with delta another 8 a step)
        n_lds = 8 * (copies + first) * magic + 8 * (copies + first) * (dfill and kind == "dq")
        assert len(re.findall(r"LDS\.128", f)) == n_lds, name
        # ψ's roundings (64 values a step in dK / dV, 32 in dQ and the forward): one FFMA onto 1.5 * 2^23 each
        # (SAGE_TRAIN_FMAROUND), else an FMUL and an FADD of 1.5 * 2^23
        n_psi = (64 if kind == "dkdv" else 32) * copies
        fma_round = "SAGE_TRAIN_FMAROUND=0" not in knobs
        assert len(re.findall(r"FFMA R\d+, R\d+(?:\.reuse)?, R\d+(?:\.reuse)?, 12582912 ", f)) == n_psi * fma_round, name
        assert len(re.findall(r"FADD R\d+, R\d+, 12582912 ", f)) == n_psi * (not fma_round), name
        # the forward's lazy rescale (SAGE_TRAIN_LAZY): one warp vote a step
        lazy = kind == "fwd" and "SAGE_TRAIN_LAZY=0" not in knobs
        assert len(re.findall(r"VOTE\.ALL", f)) == copies * lazy, name
        # SAGE_TRAIN_PP's turns (bits per kernel): one named-barrier wait and one pass (register ids) per turn of a
        # step (S / S and dP; with the products' bit each product part too; the forward's first S one more), the
        # start's pass and the finish's wait on barrier 1 once
        pp = int((re.search(r"SAGE_TRAIN_PP=(\d+)", knobs) or [0, "2"])[1])  # (default 2: the hd64 forward's)
        on, parts = {"fwd": (pp & (1 if d == 128 else 2), 0),
                     "dkdv": (pp & 4, (pp & 8 and (2 + halves if d == 128 else 2)) if kind == "dkdv" else 0),
                     "dq": (pp & 16, (pp & 32 and (1 + halves)) if kind == "dq" else 0)}[kind]
        turns = bool(on) * ((1 + parts) * copies + (kind == "fwd"))
        assert len(re.findall(r"BAR\.SYNC\.DEFER_BLOCKING R\d+, 0x100 ", f)) == turns, (name, turns)
        assert len(re.findall(r"BAR\.ARV R\d+, 0x100 ", f)) == turns, (name, turns)
        assert len(re.findall(r"BAR\.(?:ARV|SYNC\.DEFER_BLOCKING) 0x1, 0x100 ", f)) == 2 * bool(on), name
        if kind == "dq" and "SAGE_TRAIN_DQPIPE=1" in knobs:
            # each step waits for its product alone (S and dP of the next step still in flight), then for all
            assert len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x2", f)) == copies, name


def test_core_choice_from_the_environment():
    from sage_compile.config import int8_train_core

    assert int8_train_core({}) == "auto"
    assert int8_train_core({"SAGE_COMPILE_INT8_TRAIN_CORE": " CUDA "}) == "cuda"
    assert int8_train_core({"SAGE_COMPILE_INT8_TRAIN_CORE": "triton"}) == "triton"
    with pytest.raises(ValueError, match="SAGE_COMPILE_INT8_TRAIN_CORE"):
        int8_train_core({"SAGE_COMPILE_INT8_TRAIN_CORE": "fast"})


def test_unsupported_calls_name_the_reason(monkeypatch):
    from sage_compile.kernels.int8_train import cuda

    monkeypatch.setattr(cuda, "_state", cuda.fresh_state())
    q8, k8 = torch.zeros(1, 2, 64, 128, dtype=torch.int8), torch.zeros(1, 1, 64, 128, dtype=torch.int8)
    assert cuda.unsupported(q8, k8, 0, "split", torch.bfloat16) == "not a CUDA tensor"
    # the checks past the device (a CUDA-looking tensor without a GPU: only the metadata is read)
    meta = [(q8, "tile", 0, torch.bfloat16, "psi='tile'"), (q8, "split", 1, torch.bfloat16, "masks"),
            (q8[..., :80], "split", 0, torch.bfloat16, "head_dim 80"), (q8, "split", 0, torch.float32, "dtype"),
            (q8[:, :, :40], "split", 0, torch.bfloat16, "40 queries"), (q8, "split", 0, torch.bfloat16, "")]
    # the forward: any psi, any query count; keys still multiples of 16
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert "sm90" in cuda.unsupported(q8, k8, 0, "split", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert "40 keys" in cuda.unsupported(q8[:, :, :40], k8[:, :, :40], 0, "tile", torch.bfloat16, forward=True)
    k_odd = k8[:, :, :40]
    for q, psi, kind, dt, why in meta:
        kk = k_odd if not why else k8  # the last case: 40 keys
        assert (why or "40 keys") in cuda.unsupported(q, kk, kind, psi, dt), (psi, kind, dt)
    monkeypatch.setattr(cuda, "load", lambda: None)
    cuda._state["error"] = "RuntimeError: no CUDA device"
    assert cuda.unsupported(q8, k8, 0, "split", torch.bfloat16) == "RuntimeError: no CUDA device"


def test_backward_asks_for_the_cuda_kernel_only_when_told(monkeypatch, caplog):
    """``triton``: the CUDA kernels never looked at; ``auto`` (default) where they cannot run: the Triton kernels,
    the reason at debug level, once; ``cuda``: the same with a warning (asked for, not given)."""
    from sage_compile.kernels.int8_train import attention as A
    from sage_compile.kernels.int8_train import cuda

    q8, k8 = torch.zeros(1, 2, 64, 64, dtype=torch.int8), torch.zeros(1, 1, 64, 64, dtype=torch.int8)
    why = "sage_compile: int8_train on the Triton kernels, not the CUDA ones: not a CUDA tensor"
    for core, level in (("triton", None), ("", logging.DEBUG), ("cuda", logging.WARNING)):
        monkeypatch.setattr(cuda, "_state", cuda.fresh_state())
        monkeypatch.setenv("SAGE_COMPILE_INT8_TRAIN_CORE", core)
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="sage_compile"):
            assert A._use_cuda(q8, k8, 0, "split", torch.bfloat16) is False
            assert A._use_cuda(q8, k8, 0, "split", torch.bfloat16) is False
        assert cuda._state["tried"] is False  # never built for a CPU tensor
        notes = [(r.levelno, r.getMessage()) for r in caplog.records if "int8_train on the" in r.getMessage()]
        assert notes == ([] if level is None else [(level, why)]), (core, notes)


def test_prebuild_only_on_sm90_and_from_the_backend(monkeypatch):
    """The build starts in a daemon thread on an sm90 GPU (once), not elsewhere; the backend asks for it when it
    replaced an int8_train site on CUDA, unless SAGE_COMPILE_INT8_TRAIN_CORE=triton."""
    import threading

    from sage_compile import backend
    from sage_compile.kernels.int8_train import cuda

    monkeypatch.setattr(cuda, "_state", cuda.fresh_state())
    monkeypatch.setattr(cuda, "_prebuild", {"thread": None})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))
    cuda.prebuild()
    assert cuda._prebuild["thread"] is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    built = []
    monkeypatch.setattr(cuda, "build", lambda: built.append(threading.current_thread().name) or "module")
    cuda.prebuild()
    cuda.prebuild()
    cuda._prebuild["thread"].join(10)
    assert built == ["sage_compile-train-build"] and cuda.load() == "module"
    asked = []
    monkeypatch.setattr(cuda, "prebuild", lambda: asked.append(1))
    for core, want in (("triton", []), ("auto", [1])):
        monkeypatch.setenv("SAGE_COMPILE_INT8_TRAIN_CORE", core)
        asked.clear()
        backend._prebuild_train_kernels()
        assert asked == want, core


def test_build_name_follows_the_shared_header(monkeypatch, tmp_path):
    """Both extensions' names hash the header their sources include (an edit there rebuilds)."""
    from torch.utils import cpp_extension

    from sage_compile.kernels import cuda_ext

    src, hdr = tmp_path / "k.cu", tmp_path / "sm90_common.cuh"
    src.write_text("x")
    names = []
    monkeypatch.setattr(cuda_ext, "source_paths", lambda names_: [str(tmp_path / n) for n in names_])
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: names.append(kw["name"]))
    monkeypatch.setattr(cuda_ext, "HEADERS", ("sm90_common.cuh",))
    for text in ("a", "b"):
        hdr.write_text(text)
        cuda_ext.build_extension("p", ("k.cu",))
    assert names[0].startswith("p_") and names[0] != names[1]


def test_sources_ship_as_package_data():
    import os

    from sage_compile.kernels import cuda_ext
    from sage_compile.kernels.int8_train import cuda

    for names in (cuda.SOURCES, cuda_ext.HEADERS):
        paths = cuda_ext.source_paths(names)
        assert all(os.path.exists(p) for p in paths), paths
