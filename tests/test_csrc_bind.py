"""csrc/*_bind.cpp on a CPU machine: the torch bindings of both CUDA extensions compile (syntax and types, no code
generated) against the installed torch's headers, so that a mistake in a binding shows here and not at the first
build on the GPU, where a failed build costs device minutes and falls back to Triton. A CPU machine has the CUDA
runtime headers (they come with nvcc) but neither the CUDA math libraries' headers that ATen's CUDA context
includes nor torch's generated CUDA macros: those are stubbed with the few types the declarations name. A probe
of the bindings' includes alone runs beside them: where it does not compile (other headers, another torch) the
test is skipped with the probe's error, so that a failure is always the bindings'. Skipped without a C++ compiler or the
CUDA runtime headers."""
import os
import shutil
import subprocess
import sysconfig

import pytest
from torch.utils import cpp_extension

from sage_compile.kernels import cuda_ext

import builds

CXX = shutil.which("c++") or shutil.which("g++")
NVCC = shutil.which("nvcc")
BINDINGS = ("int8_fp8_sm90_bind.cpp", "int8_train_sm90_bind.cpp")
INCLUDES = ("torch/extension.h", "ATen/cuda/CUDAContext.h", "c10/cuda/CUDAGuard.h")
STUBS = {
    "cusparse.h": "typedef struct cusparseContext* cusparseHandle_t;\ntypedef int cusparseStatus_t;\n",
    "cublas_v2.h": "typedef struct cublasContext* cublasHandle_t;\ntypedef int cublasStatus_t;\n",
    "cublasLt.h": "typedef struct cublasLtContext* cublasLtHandle_t;\n",
    "cusolverDn.h": "typedef struct cusolverDnContext* cusolverDnHandle_t;\ntypedef int cusolverStatus_t;\n",
    "cusolver_common.h": "",
    os.path.join("c10", "cuda", "impl", "cuda_cmake_macros.h"): "",
}


def _cuda_include():
    roots = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    if NVCC:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(NVCC))))
    for root in roots:
        if root and os.path.exists(os.path.join(root, "include", "cuda_runtime_api.h")):
            return os.path.join(root, "include")
    return None


def _check(work: str, path):
    """The syntax check of ``path`` (None: the probe of INCLUDES, written in ``work``): its errors, "" where none,
    or None where there is no compiler or no CUDA runtime headers."""
    cuda_inc = _cuda_include()
    if CXX is None or cuda_inc is None:
        return None
    stubs = os.path.join(work, "stubs")
    for stub, text in STUBS.items():
        os.makedirs(os.path.dirname(os.path.join(stubs, stub)), exist_ok=True)
        with open(os.path.join(stubs, stub), "w") as f:
            f.write("#pragma once\n" + text)
    if path is None:
        path = os.path.join(work, "probe.cpp")
        with open(path, "w") as f:
            f.write("".join(f"#include <{h}>\n" for h in INCLUDES))
    # -std=c++17: the stricter of the standards the device's and this machine's torch build extensions with
    flags = ["-std=c++17", "-fsyntax-only", "-w", "-DTORCH_EXTENSION_NAME=sage_bind_check", f"-I{stubs}",
             *(f"-I{p}" for p in cpp_extension.include_paths()), f"-I{cuda_inc}",
             f"-I{sysconfig.get_paths()['include']}"]
    r = subprocess.run([CXX, *flags, path], capture_output=True, text=True)
    return "\n".join(line for line in r.stderr.splitlines() if "error" in line)[:3000] if r.returncode else ""


def _checks() -> dict:
    """The probe's and each binding's syntax check (one process each, the headers parsed in each: a precompiled
    header took longer to write than the three parses), started in the background (tests/builds.py) once."""
    jobs = {"probe": None, **dict(zip(BINDINGS, cuda_ext.source_paths(BINDINGS)))}
    return {name: builds.start(("bind", name), _check, path) for name, path in jobs.items()}


def background_builds(item):
    """tests/builds.py: the three syntax checks start when collection ends."""
    if item.name == "test_bindings_compile_against_torch_headers":
        _checks()


def test_bindings_compile_against_torch_headers():
    errors = {name: job.result() for name, job in _checks().items()}
    if errors["probe"] is None:
        pytest.skip("no C++ compiler or no CUDA runtime headers: the bindings are only checked where both exist")
    if errors.pop("probe"):
        pytest.skip("torch's CUDA headers do not compile here even with the stubs (not the bindings' fault)")
    assert not any(errors.values()), errors


def test_bindings_include_only_what_the_probe_covers():
    """The probe above stands for the bindings' includes: a binding including more would make a header problem
    look like a binding error."""
    for path in cuda_ext.source_paths(BINDINGS):
        with open(path) as f:
            included = {line.split("<", 1)[1].split(">", 1)[0] for line in f if line.startswith("#include <")}
        assert included <= set(INCLUDES), (os.path.basename(path), included - set(INCLUDES))
