"""sage-compile: quantized attention (SageAttention family) as a torch.compile backend.

    torch.compile(model, backend="sage")                    # every attention site -> sage ops
    torch.compile(model, backend=sage_compile.make_backend(kernel="fp4"))
    with sage_compile.options(kernel="int8_fp8"): ...       # configuration for compiles inside
    with sage_compile.enable(): model(x)                    # eager models, no compile
    sage_compile.attention(q, k, v, scheme="int8_fp8")      # the op itself, (B, H, N, D)
    sage_compile.HybridSteps(50, first=2, last=2)           # fp4 with 8-bit first/last steps (switchable)

Imports are lazy so the ``torch.backends`` autoload hook stays cheap.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "make_backend": ("backend", "make_backend"),
    "sage_backend": ("backend", "sage_backend"),
    "options": ("config", "options"),
    "Config": ("config", "Config"),
    "Options": ("config", "Options"),
    "enable": ("eager", "enable"),
    "install_global": ("hooks", "install_global"),
    "uninstall_global": ("hooks", "uninstall_global"),
    "last_reports": ("debug", "last_reports"),
    "format_report": ("debug", "format_report"),
    "override": ("steps", "override"),
    "HybridSteps": ("steps", "HybridSteps"),
}


def _map_source_passes() -> None:
    """Source checkouts keep the FX passes in the top-level ``passes/`` folder (installed wheels place
    them at ``sage_compile/passes``). Where no installer finder maps ``sage_compile.passes`` (e.g. an
    editable install in compat mode, or running from the checkout), map that one name to that folder with a
    finder of its own (appending the checkout's root to ``__path__`` instead would make every folder of the
    checkout a subpackage, ``sage_compile.sage_compile...`` without end for ``pkgutil.walk_packages``)."""
    import importlib.abc
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    folder = os.path.join(os.path.dirname(here), "passes")
    init = os.path.join(folder, "__init__.py")
    if os.path.isdir(os.path.join(here, "passes")) or not os.path.isfile(init):
        return
    name = __name__ + ".passes"
    if importlib.util.find_spec(name) is not None:
        return

    class _SourcePasses(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname != name:
                return None
            return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[folder])

    sys.meta_path.append(_SourcePasses())


_map_source_passes()


def attention(q, k, v, attn_mask=None, causal="none", scale=None, layout="HND", scheme="int8_fp8", options=None):
    """Quantized attention; see ``torch.ops.sage_compile.attention`` (:func:`sage_compile.ops.attention`).

    ``options``: a :class:`sage_compile.Options` (numeric variants; default ``Options()``).
    ``scheme="int8_train"`` runs SageBwd (8-bit forward and backward, its own gradients); the other
    schemes' gradients are exact attention's (straight-through)."""
    from . import ops

    if scheme == "int8_train":
        ops.check_inputs(q, k, v, attn_mask, causal, layout)
        return ops.run_scheme(q, k, v, attn_mask, causal, scale, layout, scheme, options)
    return ops.attention(q, k, v, attn_mask, causal, scale, layout, scheme, options.encode() if options else "")


def __getattr__(name):
    if name in _LAZY:
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{mod}", __name__), attr)
    if name in ("ops", "reference", "passes", "policy", "config", "debug", "models", "eager", "hooks", "steps"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'sage_compile' has no attribute {name!r}")


__all__ = ["attention", "__version__"] + list(_LAZY)
