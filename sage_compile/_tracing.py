"""Whether kernel host code runs inside a trace of a ``torch.library.triton_op`` (the traced ``int8_train`` and
``int8_fp8`` ops of :mod:`sage_compile.ops`): there its Triton launches go through ``torch.library.wrap_triton`` and its CUDA
extension calls through their custom ops, so that torch.compile's graph holds them and Inductor makes the
launches; the host code itself then runs once per compile instead of once per call."""
from __future__ import annotations

import contextlib
import threading

_state = threading.local()


@contextlib.contextmanager
def _launch_mode(on: bool):
    before = getattr(_state, "on", False)
    _state.on = on
    try:
        yield
    finally:
        _state.on = before


def graph_launches():
    """Within: :func:`in_graph` holds while the enclosing ``triton_op`` is traced (its fake run and torch.compile's
    decomposition), not in its eager run (where ``wrap_triton`` is off)."""
    return _launch_mode(True)


def eager_launches():
    """Within: launches run now, even inside :func:`graph_launches` (host code that must run real kernels while its
    call is traced: timing a choice on real inputs)."""
    return _launch_mode(False)


def in_graph() -> bool:
    """Whether launches must be graph ops now (inside :func:`graph_launches`, ``wrap_triton`` on)."""
    if not getattr(_state, "on", False):
        return False
    from ._compat import wrap_triton_enabled

    return wrap_triton_enabled()
