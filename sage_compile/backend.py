"""The ``sage`` torch.compile backend: rewrite attention sites in the Dynamo graph, then Inductor.

Registered through the ``torch_dynamo_backends`` entry point (``backend="sage"`` works without importing
this package). ``sage_compile.make_backend(kernel="fp4", ...)`` returns a backend with explicit options;
``torch.compile(m, backend="sage", options={"sage_kernel": "fp4"})`` does the same through ``options``
(keys starting with ``sage_``; the rest go to Inductor).
"""
from __future__ import annotations

import contextlib
import functools

import torch

from . import _compat
from . import config as _config
from . import debug, ops, policy  # noqa: F401  (ops registers torch.ops.sage_compile.*)


def rewrite_graph(gm, cfg: _config.Config) -> list[dict]:
    """Find sites, decide, rewrite ``gm`` (GraphModule or Graph) in place; returns the report rows."""
    from . import passes

    graph = getattr(gm, "graph", gm)
    before = graph.python_code("self").src
    sites = passes.find_sites(graph)
    decisions = [policy.decide(s, cfg, s.device_type) for s in sites]
    if cfg.strict:
        bad = [(s, d) for s, d in zip(sites, decisions) if d.fallback]
        if bad:
            raise policy.UnsupportedSite("sage_compile (strict): " + "; ".join(
                f"site {s.index} at {s.location}: {d.reason}" for s, d in bad))
    passes.rewrite(gm, sites, decisions, cfg.options)
    graph._sage_compile_done = True
    graph._sage_compile_graph_prologue = any(d.prologue == "graph" for d in decisions if d.scheme)
    graph._sage_compile_traced = any(d.prologue == "traced" for d in decisions if d.scheme)
    if any(d.scheme == "int8_fp8" and s.device_type == "cuda" for s, d in zip(sites, decisions)):
        _prebuild_cuda_core()
    if any(d.scheme == "int8_train" and s.device_type == "cuda" for s, d in zip(sites, decisions)):
        _prebuild_train_kernels()
    return debug.record(before, graph.python_code("self").src, sites, decisions, cfg.dump_dir)


def _prebuild_cuda_core() -> None:
    """Start building the CUDA int8_fp8 core in the background (it builds at its first call otherwise,
    after the whole compile): nvcc runs while Inductor compiles."""
    if _config.int8_fp8_core() == "triton" or not _compat.triton_available():
        return
    from .kernels.int8_fp8 import cuda

    cuda.prebuild()


def _prebuild_train_kernels() -> None:
    """The same for the CUDA SageBwd kernels (``int8_train``), unless ``SAGE_COMPILE_INT8_TRAIN_CORE=triton``."""
    if _config.int8_train_core() == "triton" or not _compat.triton_available():
        return
    from .kernels.int8_train import cuda

    cuda.prebuild()


def sage_backend(gm: torch.fx.GraphModule, example_inputs, mode=None, options=None, **explicit):
    """torch.compile backend: the attention rewrite followed by Inductor's ``compile_fx``.

    ``mode``/``options`` are honoured as with ``backend="inductor"``; ``options`` keys ``sage_<field>``
    set sage_compile configuration (see :class:`sage_compile.config.Config`).
    """
    from torch._inductor.compile_fx import compile_fx

    options = dict(options or {})
    for key in [k for k in options if k.startswith("sage_")]:
        explicit.setdefault(key[len("sage_"):], options.pop(key))
    cfg = _config.resolve(**explicit)
    rewrite_graph(gm, cfg)
    graph_prologue = gm.graph._sage_compile_graph_prologue  # a site got the prologue as graph ops
    patches = dict(torch._inductor.list_mode_options(mode)) if mode else {}
    if graph_prologue:
        patches.update(_compat.graph_prologue_inductor_patches())
    # always: the package hash then joins every cache key of a graph we rewrote (our ops' fakes included)
    from .passes.rewrite import graph_prologue_functions

    patches.update(_compat.aot_cache_patches(graph_prologue_functions()))
    patches.update(options)
    traced = gm.graph._sage_compile_traced  # a site got the traced int8_fp8 ops
    with _compat.graph_prologue_choices() if graph_prologue else contextlib.nullcontext(), \
            _compat.user_kernel_inputs_realized() if traced else contextlib.nullcontext():
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
    return _guard_config(compiled, cfg.fingerprint(), explicit)


def _guard_config(compiled, fingerprint, explicit):
    """Refuse to run a compiled graph under a different configuration than it was compiled with. While no
    context manager is open and the environment is the one of the compilation (:func:`config.state_key`), the
    configuration cannot have changed and is not resolved again."""
    state = _config.state_key()

    @functools.wraps(compiled)
    def run(*args, **kwargs):
        if state is not None and _config.state_key() == state:
            return compiled(*args, **kwargs)
        now = _config.resolve(**explicit).fingerprint()
        if now != fingerprint:
            raise RuntimeError(
                "sage_compile: configuration changed since this graph was compiled "
                f"(compiled with kernel={fingerprint[0]!r}, options={fingerprint[2]}; now kernel={now[0]!r}, "
                f"options={now[2]}). Recompile (torch._dynamo.reset() or a new torch.compile), or pass the "
                "configuration explicitly: sage_compile.make_backend(kernel=...).")
        return compiled(*args, **kwargs)

    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True
    return run


def sage_eager_backend(gm: torch.fx.GraphModule, example_inputs, mode=None, options=None, **explicit):
    """Debug backend: the same rewrite, then the rewritten graph runs as Python (no Inductor)."""
    cfg = _config.resolve(**explicit)
    rewrite_graph(gm, cfg)
    return _guard_config(gm.forward, cfg.fingerprint(), explicit)


def make_backend(compiler: str = "inductor", **config_kwargs):
    """A ``sage`` backend with explicit configuration, e.g. ``torch.compile(m, backend=make_backend(kernel="fp4"))``.

    ``compiler="eager"`` runs the rewritten graph without Inductor (fast to compile; for debugging/tests).
    """
    _config._check(config_kwargs)
    if compiler not in ("inductor", "eager"):
        raise ValueError(f"sage_compile: compiler must be 'inductor' or 'eager', got {compiler!r}")
    fn = functools.partial(sage_backend if compiler == "inductor" else sage_eager_backend, **config_kwargs)
    fn.__name__ = "sage"  # type: ignore[attr-defined]
    return fn
