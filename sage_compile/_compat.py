"""Every torch-version difference in one place (torch 2.11 and 2.13 are supported)."""
from __future__ import annotations

import torch

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def has_default_backend_api() -> bool:
    """``torch.compiler.set_default_backend`` exists from torch 2.13."""
    return hasattr(torch.compiler, "set_default_backend")


def set_default_backend(name) -> None:
    torch.compiler.set_default_backend(name)


def get_default_backend():
    return torch.compiler.get_default_backend() if hasattr(torch.compiler, "get_default_backend") else None


def custom_graph_pass_base():
    """Base class for Inductor custom passes with a cache uuid (``CustomGraphPass`` on both versions)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def inductor_division_rounding_key():
    """The Inductor option that makes generated Triton code divide with ``div_rn`` (IEEE) instead of the
    approximate ``div.full``: ``eager_numerics.division_rounding`` (2.13), ``emulate_divison_rounding``
    (sic; 2.10/2.11). ``None`` if neither exists."""
    import torch._inductor.config as c

    if hasattr(getattr(c, "eager_numerics", None), "division_rounding"):
        return "eager_numerics.division_rounding"
    return "emulate_divison_rounding" if hasattr(c, "emulate_divison_rounding") else None


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
