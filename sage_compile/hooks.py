"""Global enable (``SAGE_COMPILE=1``): every ``torch.compile`` goes through the rewrite.

torch >= 2.13: ``torch.compiler.set_default_backend("sage")`` (plain ``torch.compile(m)`` uses sage).
torch 2.11 (or ``SAGE_COMPILE_HOOK=pregrad``): an Inductor ``pre_grad_custom_pass`` that chains any pass
already installed, with a cache uuid covering this package's sources and the configuration. A pass cannot
set the Inductor options the graph prologue needs (:func:`sage_compile._compat.graph_prologue_inductor_patches`),
so sites rewritten there always get the prologue op.
"""
from __future__ import annotations

import hashlib
import os

from . import _compat


def _op_prologue(cfg):
    """``cfg`` with the prologue op: inside Inductor's passes the graph prologue's options cannot be set."""
    import dataclasses

    return dataclasses.replace(cfg, options=dataclasses.replace(cfg.options, prologue="op"))


def _make_pass_class():
    base = _compat.custom_graph_pass_base()

    class SagePreGradPass(base):
        """Runs the attention rewrite inside Inductor's pre-grad passes, then the previous pass."""

        def __init__(self, previous=None):
            self.previous = previous

        def __call__(self, graph):
            from . import config
            from .backend import rewrite_graph

            if not getattr(graph, "_sage_compile_done", False):  # backend="sage" already rewrote it
                rewrite_graph(graph, _op_prologue(config.resolve()))
            if self.previous is not None:
                self.previous(graph)

        def uuid(self):
            from . import config

            from ._sources import package_hash

            h = hashlib.sha256(package_hash().encode())
            h.update(repr(_op_prologue(config.resolve()).fingerprint()).encode())
            prev = getattr(self.previous, "uuid", None)
            h.update(repr(prev() if callable(prev) else None).encode())
            return h.hexdigest()

    return SagePreGradPass


_PASS_CLASS = None


def pre_grad_pass_class():
    global _PASS_CLASS
    if _PASS_CLASS is None:
        _PASS_CLASS = _make_pass_class()
    return _PASS_CLASS


def install_global(route: str | None = None) -> str:
    """Make every torch.compile use sage_compile; returns the route used (``default_backend``|``pregrad``)."""
    if route is None:
        route = os.environ.get("SAGE_COMPILE_HOOK") or ("default_backend" if _compat.has_default_backend_api() else "pregrad")
    if route == "default_backend":
        _compat.set_default_backend("sage")
        return route
    if route != "pregrad":
        raise ValueError(f"sage_compile: unknown hook route {route!r} (default_backend | pregrad)")
    from torch._inductor import config as ic

    cls = pre_grad_pass_class()
    if not isinstance(ic.pre_grad_custom_pass, cls):
        ic.pre_grad_custom_pass = cls(ic.pre_grad_custom_pass)
    return route


def uninstall_global() -> None:
    from torch._inductor import config as ic

    if _compat.has_default_backend_api() and _compat.get_default_backend() == "sage":
        _compat.set_default_backend(None)
    p = ic.pre_grad_custom_pass
    if _PASS_CLASS is not None and isinstance(p, _PASS_CLASS):
        ic.pre_grad_custom_pass = p.previous
