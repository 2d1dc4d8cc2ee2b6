"""Every global name a function of the package reads is defined, and every Triton kernel reads only globals
the Triton compiler accepts: cheap guards for what the CPU suite cannot run (the autotuned CUDA launches,
Blackwell branches, compiled kernels: the interpreter is laxer), which would only fail on the GPU."""
import builtins
import importlib
import os
import pkgutil
import subprocess
import sys
import types

import pytest

import sage_compile
import sage_compile.passes


def _modules():
    names = set()
    for pkg in (sage_compile, sage_compile.passes):
        names.add(pkg.__name__)
        for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            names.add(m.name)
    return sorted(n for n in names if not n.endswith("__main__"))


def _codes(co):
    yield co
    for c in co.co_consts:
        if isinstance(c, types.CodeType):
            yield from _codes(c)


def _global_reads(co):
    """Names ``co`` (and the code nested in it) reads as globals."""
    import dis

    for c in _codes(co):
        for ins in dis.get_instructions(c):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                yield ins.argval if isinstance(ins.argval, str) else ins.argval[1]


@pytest.mark.parametrize("name", _modules())
def test_module_reads_no_undefined_global(name):
    mod = importlib.import_module(name)
    src = getattr(mod, "__file__", None)
    assert src and src.endswith(".py"), name
    co = compile(open(src, encoding="utf-8").read(), src, "exec")
    defined = set(vars(mod)) | set(dir(builtins)) | {"__annotations__"}
    missing = sorted({n for n in _global_reads(co) if n not in defined})
    assert not missing, f"{name} reads undefined globals: {missing}"


def _jit_functions(mod):
    for v in vars(mod).values():
        fn = getattr(v, "fn", None)
        if type(v).__name__ in ("JITFunction", "InterpretedFunction") and isinstance(getattr(fn, "__code__", None), types.CodeType):
            if fn.__module__ == mod.__name__:
                yield fn


@pytest.mark.parametrize("name", _modules())
def test_triton_kernels_read_only_constexpr_globals(name):
    """A @triton.jit function may read, as globals, other jit functions, modules and tl.constexpr values,
    never a plain number, string or container: the compiler rejects those (the interpreter, the CPU
    suite's path, accepts them: H200 run 52 failed on an int global the interpreter tests had passed)."""
    pytest.importorskip("triton")
    mod = importlib.import_module(name)
    bad = []
    for fn in _jit_functions(mod):
        for g in set(_global_reads(fn.__code__)):
            v = fn.__globals__.get(g)
            if isinstance(v, (bool, int, float, str, tuple, list, dict, set)):
                bad.append(f"{fn.__name__} reads {g} = {v!r}")
    assert not bad, f"{name}: {bad} (make them tl.constexpr(...))"


def test_a_source_checkout_maps_only_the_passes_folder():
    """Run from the checkout without an install (``python -S``: no site-packages, so no installer's finder),
    ``sage_compile.passes`` is the checkout's ``passes/`` and the package's path stays its own folder: the
    checkout's root on that path had made every folder of it a subpackage (``sage_compile.sage_compile...``),
    and ``walk_packages`` (this file's ``_modules``) recurse until a RecursionError."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(sage_compile.__file__)))
    if not os.path.isfile(os.path.join(root, "passes", "__init__.py")):
        pytest.skip("an installed wheel: no checkout beside the package")
    code = ("import importlib.util, pkgutil, sage_compile\n"
            "print(importlib.util.find_spec('sage_compile.passes').origin)\n"
            "print(len(sage_compile.__path__), sorted(m.name for m in pkgutil.iter_modules(sage_compile.__path__)))")
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=root, capture_output=True, text=True, check=True)
    origin, listing = out.stdout.splitlines()
    assert origin == os.path.join(root, "passes", "__init__.py")
    n, names = listing.split(" ", 1)
    assert n == "1" and "'kernels'" in names and "'reference'" in names, listing
    assert not any(f"'{d}'" in names for d in ("sage_compile", "passes", "tests", "benchmarks")), listing
