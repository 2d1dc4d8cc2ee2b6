"""The CPU suite's long single-process jobs (nvcc builds of csrc/ with the knob variants its test files check, the
bindings' syntax check, the fresh Python processes of test_backend.py), in the background: when collection ends,
``conftest.py`` calls each collected test module's ``background_builds(item)``, which starts (``start``) the jobs
that item will need, on one core fewer than the machine has, and moves those modules to the end of the run, so
that the jobs overlap the rest of the suite; a test then waits for its job's result. On the 2-core CI machine
this did not measurably shorten the run (the suite's own process keeps both cores busy most of the time: a
clean-clone CI at 95d841d took 1,209 s of tests, about what the work left out of the default run saves); on more
cores the jobs run beside the suite. The nvcc builds are compile-only (no GPU, nothing linked); where nvcc is
absent their fixtures skip."""
import atexit
import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

NVCC = shutil.which("nvcc")

_lock = threading.Lock()
_pool = None
_dir = None
_jobs = {}


def start(key, fn, *args):
    """Start (once per key) ``fn(workdir, *args)`` on the pool; returns its future. ``workdir``: a directory of
    this session's (removed at exit)."""
    global _pool, _dir
    with _lock:
        if key not in _jobs:
            if _pool is None:
                # one core fewer than the machine has: the suite's own process keeps one (on 2 cores, two builds at
                # once slowed the Inductor tests running beside them up to 2x)
                _pool = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 1) - 1), thread_name_prefix="build")
                _dir = tempfile.mkdtemp(prefix="sage_builds_")
                atexit.register(shutil.rmtree, _dir, True)
            work = os.path.join(_dir, str(len(_jobs)))
            os.makedirs(work)
            _jobs[key] = _pool.submit(fn, work, *args)
        return _jobs[key]


def cancel_pending() -> None:
    """Drop the jobs that have not started (running ones finish: a compiler is not interrupted)."""
    with _lock:
        if _pool is not None:
            _pool.shutdown(wait=False, cancel_futures=True)


def start_for(items) -> None:
    """Start the jobs of the collected ``items``: each module's ``background_builds(item)``, where it has one."""
    for item in items:
        hook = getattr(getattr(item, "module", None), "background_builds", None)
        if hook is not None:
            hook(item)


def _kernel_source(scheme: str) -> str:
    from sage_compile.kernels import cuda_ext

    if scheme == "int8_fp8":
        from sage_compile.kernels.int8_fp8 import cuda

        paths = cuda.source_paths()
    else:
        from sage_compile.kernels.int8_train import cuda

        paths = cuda_ext.source_paths(cuda.SOURCES)
    return next(p for p in paths if p.endswith(".cu"))


def _nvcc(work: str, scheme: str, variant: str):
    from sage_compile.kernels import cuda_ext

    knobs = [] if variant == "default" else variant.split()  # the build knobs compile too
    flags = [f for f in cuda_ext.CUDA_FLAGS if f != "-lineinfo"] + knobs
    obj = os.path.join(work, f"{scheme}_sm90.o")
    r = subprocess.run([NVCC, "-c", *flags, "-Xptxas", "-v", _kernel_source(scheme), "-o", obj],
                       capture_output=True, text=True)
    return r, obj, " ".join(knobs)


def start_nvcc(item, scheme: str) -> None:
    """For a ``background_builds``: the build of ``scheme``'s kernel source with the item's ``compiled`` parameter."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if NVCC is not None and "compiled" in params:
        start(("nvcc", scheme, params["compiled"]), _nvcc, scheme, params["compiled"])


def nvcc_result(scheme: str, variant: str):
    """``(completed nvcc process, object path, knobs)`` of the build, started now if it was not; skips without nvcc."""
    if NVCC is None:
        pytest.skip("nvcc not on PATH: the CUDA sources are only compiled where nvcc exists")
    return start(("nvcc", scheme, variant), _nvcc, scheme, variant).result()
