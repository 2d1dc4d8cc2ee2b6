"""Every torch-version difference in one place (torch 2.11 and 2.13 are supported)."""
from __future__ import annotations

import contextlib
import inspect
import logging

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


_ADDCDIV_RN: list = []


@torch.compiler.assume_constant_result
def inductor_addcdiv_divides_rn() -> bool:
    """Whether Inductor lowers ``aten.addcdiv`` itself (not decomposed) with an IEEE division on GPUs
    (``ops.div_rn``, whatever the graph-global division option: torch 2.13). Then
    ``addcdiv(-0.0, a, b)`` is ``a / b`` correctly rounded in a compiled graph at fp32 cost
    (:func:`sage_compile.reference.quant.div_rn`); else the quantizers divide in fp64."""
    if not _ADDCDIV_RN:
        _ADDCDIV_RN.append(_probe_addcdiv_rn())
    return _ADDCDIV_RN[0]


def _probe_addcdiv_rn() -> bool:
    try:
        from torch._inductor import decomposition, lowering
        from torch._inductor.codegen.triton import TritonOverrides

        aten = torch.ops.aten
        return (hasattr(TritonOverrides, "div_rn") and aten.addcdiv.default in lowering.lowerings
                and aten.addcdiv.default not in decomposition.select_decomp_table()
                and "ops.div_rn(" in inspect.getsource(lowering.addcdiv))
    except Exception:  # noqa: BLE001 - any doubt: the fp64 division
        return False


def graph_prologue_inductor_patches() -> dict:
    """Inductor options a graph with the prologue as graph ops needs (``prologue="graph"``):

    * ``comprehensive_padding`` off: on GPUs Inductor pads the strides of intermediate buffers whose
      stride exceeds ``padding_stride_threshold`` (1024 elements) to 128 bytes. On torch 2.11 a
      per-token scale buffer that feeds the core op (``(B, H, N)`` fp32 with N = 1250) was written
      unpadded (stride 1250) and read padded (stride 1280) by the next fused kernel: wrong INT8 values
      for every sequence length N > 1024 not a multiple of 32 (generated code of
      ``benchmarks/diag_graph_prologue.py``, H200, CogVideoX's 226 + 1024 tokens).

    Not IEEE division (:func:`inductor_division_rounding_key`): the quantizers' divisions are exact
    without it (:func:`sage_compile.reference.quant.div_rn`: ``addcdiv``, which Inductor lowers with
    ``div_rn``, or fp64 rounded once); the option is graph-global and made the model's own norms
    (Flux's RMSNorm) divide with ``div_rn`` per element, twice their time on the H200."""
    import torch._inductor.config as c

    return {"comprehensive_padding": False} if hasattr(c, "comprehensive_padding") else {}


def aot_cache_patches(functions) -> dict:
    """Inductor options under which AOTAutograd's cache accepts graphs calling ``functions`` (plain Python
    functions the rewrite puts in the graph: the graph prologue). Its safety check refuses any
    ``call_function`` target it does not know (every later compile of the graph then re-traces it:
    CogVideoX-2B's 30 prologues, seconds); ``unsafe_marked_cacheable_functions`` (torch 2.11, 2.13) maps a
    function's ``module.name`` to a string that joins the cache key: here the hash of this package's
    sources, so an edit of the prologue misses the cache. Empty where the option does not exist."""
    import torch._inductor.config as c

    if not hasattr(c, "unsafe_marked_cacheable_functions"):
        return {}
    from ._sources import package_hash

    marked = dict(c.unsafe_marked_cacheable_functions)
    marked.update({f"{f.__module__}.{f.__name__}": f"sage_compile {package_hash()}" for f in functions})
    return {"unsafe_marked_cacheable_functions": marked}


def prologue_choices_class():
    """:class:`sage_compile._prologue_choices.PrologueChoices`, or None where this torch lacks Inductor's
    ``InductorChoices.should_use_persistent_reduction`` hook or ``V.set_choices_handler``."""
    try:
        from torch._inductor.choices import InductorChoices
        from torch._inductor.virtualized import V
    except ImportError:
        return None
    hook = inspect.getattr_static(InductorChoices, "should_use_persistent_reduction", None)
    if not isinstance(hook, staticmethod) or not hasattr(V, "set_choices_handler"):
        return None
    if list(inspect.signature(hook.__func__).parameters) != ["features", "cooperative_reduction"]:
        return None  # another hook than the one PrologueChoices overrides (torch 2.11 and 2.13 have this one)
    from ._prologue_choices import PrologueChoices

    return PrologueChoices


@contextlib.contextmanager
def graph_prologue_choices():
    """Inside: Inductor compiles with :class:`~sage_compile._prologue_choices.PrologueChoices`'s heuristics
    (threadlocal, restored on exit), unless the hook is missing or the user installed choices of their own."""
    cls = prologue_choices_class()
    if cls is None:
        logging.getLogger("sage_compile").debug(
            "sage_compile: this torch lacks InductorChoices.should_use_persistent_reduction(features, "
            "cooperative_reduction); the graph prologue compiles with Inductor's own reduction choices")
        yield
        return
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    if type(V.choices) is not InductorChoices:
        logging.getLogger("sage_compile").debug(
            "sage_compile: Inductor choices %s installed by the user are kept for the graph prologue",
            type(V.choices).__name__)
        yield
        return
    with V.set_choices_handler(cls()):
        yield


@contextlib.contextmanager
def user_kernel_inputs_realized():
    """Inside: Inductor stores a value once where a user-defined Triton kernel (``wrap_triton``: the traced ops'
    launches) reads it beside other readers, as it does for its fallback ops. Without this, each such kernel's
    stride constraint (``triton_kernel_default_layout_constraint="needs_fixed_stride_order"``) copies an
    unrealized pointwise input for itself: RoPE's q and k were computed once but stored twice each, for the
    statistics pass and for the INT8 pass (torch 2.11 and 2.13: ``lowering.needs_realized_inputs``, read by
    ``GraphLowering.run_node``). Values are unchanged."""
    from torch._inductor import lowering

    try:
        from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_mutation as hop
    except ImportError:  # pragma: no cover - a torch without user-defined Triton kernels
        hop = None
    needs = getattr(lowering, "needs_realized_inputs", None)
    if hop is None or needs is None or hop in needs:
        yield
        return
    needs.add(hop)
    try:
        yield
    finally:
        needs.discard(hop)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def wrap_triton_enabled() -> bool:
    """Whether ``torch.library.wrap_triton`` wraps (it is off in a ``triton_op``'s eager run; on while one is
    traced). torch 2.11 and 2.13: ``torch._library.triton.is_wrap_triton_enabled``."""
    from torch._library.triton import is_wrap_triton_enabled

    return is_wrap_triton_enabled()


# torch's analysis of which tensors a wrap_triton kernel reads and writes (torch 2.13:
# ``identify_accessed_tensors``; 2.11: ``identify_mutated_tensors``) generates the kernel's TTIR at every call: on an
# sm90 target ~35 ms a launch, repeated for every launch of every attention site in the forward and the backward,
# and again when Inductor lowers each launch. Its answer depends only on the kernel, on which arguments are tensors
# (and their dtypes), on the other arguments' values (symbolic ones all count as 2) and on the target, so it is kept
# per such key, for this package's kernels only.
ACCESS_STATS = {"hits": 0, "misses": 0}
_ACCESS_CACHE: dict = {}
_ACCESS_CACHE_MAX = 4096


def _access_key(kernel, kwargs, rest, kw, prefix: str = "sage_compile."):
    """The key of one analysis call, or None where it is not cached (another package's kernel, a TMA descriptor,
    an argument of a kind the key cannot stand for)."""
    fn = getattr(kernel, "fn", kernel)  # (an Autotuner's JITFunction: torch wraps a launch's num_warps in a new one)
    if not str(getattr(fn, "__module__", "")).startswith(prefix) or kw or any(bool(r) for r in rest):
        return None
    configs = getattr(kernel, "configs", None)  # the analysis reads an Autotuner's first config's arguments
    first = tuple(sorted(configs[0].kwargs.items())) if configs else ()
    from torch._subclasses.fake_tensor import FakeTensor

    try:
        from torch._inductor.ir import TensorBox
    except ImportError:  # pragma: no cover
        TensorBox = ()
    import sympy

    items = []
    for name in sorted(kwargs):
        v = kwargs[name]
        if v is None:
            items.append((name, None))
        elif isinstance(v, FakeTensor):
            items.append((name, "T", v.dtype))
        elif TensorBox and isinstance(v, TensorBox):
            items.append((name, "T", v.get_dtype()))
        elif type(v) is torch.Tensor:  # a real tensor: Triton specialises on its pointer's alignment
            items.append((name, "R", v.dtype, v.data_ptr() % 16 == 0))
        elif isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Basic)):
            items.append((name, "S"))
        elif type(v) in (bool, int, float, str):
            items.append((name, type(v).__name__, v))
        else:
            return None
    target = _triton_target()
    return None if target is None else (fn, first, tuple(items), target)


def _triton_target():
    """The active Triton target's repr (the TTIR depends on it), or None where there is none."""
    try:
        import triton

        return repr(triton.runtime.driver.active.get_current_target())
    except Exception:  # noqa: BLE001 - no target: the analysis itself decides; not cached
        return None


def cache_triton_access_analysis() -> bool:
    """Keep torch's per-launch analysis of this package's Triton kernels (see above) per key, so that a graph with
    many attention sites analyses each kernel once. Idempotent; False where torch has no such function."""
    import copy
    import functools

    try:
        import torch._higher_order_ops.triton_kernel_wrap as W
    except ImportError:  # pragma: no cover
        return False
    name = next((n for n in ("identify_accessed_tensors", "identify_mutated_tensors") if hasattr(W, n)), None)
    if name is None:
        return False
    analyse = getattr(W, name)
    if getattr(analyse, "_sage_cached", False):
        return True

    @functools.wraps(analyse)
    def cached(kernel, kwargs, *rest, **kw):
        try:
            key = _access_key(kernel, kwargs, rest, kw)
            hash(key)
        except Exception:  # noqa: BLE001 - an argument the key cannot hold: torch's own analysis
            key = None
        if key is None:
            return analyse(kernel, kwargs, *rest, **kw)
        if key not in _ACCESS_CACHE:
            ACCESS_STATS["misses"] += 1
            if len(_ACCESS_CACHE) >= _ACCESS_CACHE_MAX:
                _ACCESS_CACHE.clear()
            _ACCESS_CACHE[key] = analyse(kernel, kwargs, *rest, **kw)
        else:
            ACCESS_STATS["hits"] += 1
        return copy.deepcopy(_ACCESS_CACHE[key])

    cached._sage_cached = True
    setattr(W, name, cached)
    return True
