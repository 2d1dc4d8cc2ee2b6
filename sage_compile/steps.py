"""Run-time scheme switching for compiled models: the hybrid schedule SageAttention3's authors recommend
for diffusion (a higher-precision scheme on the first and last denoising steps, FP4 in between).

Sites compiled with ``switchable=True`` (``options={"sage_switchable": True}`` or
``make_backend(kernel="fp4", switchable=True)``) call the composed op, which reads the override below
at run time: switching costs no recompilation. Not with CUDA graphs (``mode="reduce-overhead"``): a
replayed graph keeps the scheme it was captured with.

    with sage_compile.override("int8_fp8"):   # every switchable site runs int8_fp8 inside
        out = model(x)
    hybrid = sage_compile.HybridSteps(num_steps=50, first=2, last=2)   # default scheme "int8_fp8"
    with hybrid:
        pipe(..., num_inference_steps=50, callback_on_step_end=hybrid)  # diffusers' step callback
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from .config import SCHEMES

_current: list = [None]  # the override in force (a scheme name) or None: each site's compiled scheme


def current() -> Optional[str]:
    """The scheme switchable sites run now instead of their own, or ``None``."""
    return _current[0]


def _check(scheme: Optional[str]) -> None:
    if scheme is not None and scheme not in SCHEMES:
        raise ValueError(f"sage_compile: override scheme must be one of {SCHEMES} or None, got {scheme!r}")
    if scheme == "int8_train":
        raise ValueError("sage_compile: int8_train is a training scheme; overrides are for inference sites")


def _set(scheme: Optional[str]) -> None:
    _check(scheme)
    _current[0] = scheme


@contextlib.contextmanager
def override(scheme: Optional[str]) -> Iterator[None]:
    """Run switchable sites with ``scheme`` (``exact`` = SDPA) inside the block; ``None`` = as compiled."""
    prev = _current[0]
    _set(scheme)
    try:
        yield
    finally:
        _current[0] = prev


class HybridSteps:
    """Per-step schedule: ``scheme`` on the first ``first`` and last ``last`` of ``num_steps`` steps, the
    compiled scheme (e.g. ``fp4``) in between.

    Use as a context manager around the loop (it arms step 0) and call it at the end of every step: it is
    a diffusers ``callback_on_step_end`` (``(pipe, step, timestep, callback_kwargs) -> callback_kwargs``);
    in a hand-written loop call ``hybrid.step_end(i)``. Leaving the block restores the previous override."""

    def __init__(self, num_steps: int, first: int = 1, last: int = 1, scheme: str = "int8_fp8"):
        if num_steps < 1 or first < 0 or last < 0:
            raise ValueError(f"HybridSteps: need num_steps >= 1, first/last >= 0 (got {num_steps}, {first}, {last})")
        _check(scheme)
        self.num_steps, self.first, self.last, self.scheme = num_steps, first, last, scheme
        self._prev: list = []

    def scheme_for(self, step: int) -> Optional[str]:
        """The override for denoising step ``step`` (0-based): ``scheme`` or ``None``."""
        return self.scheme if step < self.first or step >= self.num_steps - self.last else None

    def step_end(self, step: int) -> None:
        """Arm step ``step + 1``."""
        _set(self.scheme_for(step + 1) if step + 1 < self.num_steps else None)

    def __call__(self, pipe, step: int, timestep, callback_kwargs: dict) -> dict:
        self.step_end(step)
        return callback_kwargs

    def __enter__(self) -> "HybridSteps":
        self._prev.append(_current[0])
        _set(self.scheme_for(0))
        return self

    def __exit__(self, *exc) -> None:
        _current[0] = self._prev.pop()
