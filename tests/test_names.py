"""Every global name a function of the package reads is defined: a cheap guard for the code paths the CPU
suite cannot run (the autotuned CUDA launches, Blackwell branches), where a lost module-level name
would only fail on the GPU."""
import builtins
import importlib
import pkgutil
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
