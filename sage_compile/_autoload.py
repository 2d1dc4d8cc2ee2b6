"""``torch.backends`` entry point: runs at the end of ``import torch`` in every process.

Tiny and env-gated: does nothing unless ``SAGE_COMPILE=1``, and never raises (a failure would break
``import torch``); problems become a warning.
"""
import os


def autoload() -> None:
    if os.environ.get("SAGE_COMPILE", "").strip().lower() not in ("1", "true", "yes", "on"):
        return
    try:
        from .hooks import install_global

        install_global()
    except Exception as e:  # pragma: no cover - defensive
        import warnings

        warnings.warn(f"sage_compile: SAGE_COMPILE=1 but the global hook failed: {e!r}")
