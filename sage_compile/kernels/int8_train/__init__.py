"""``int8_train`` (SageBwd) Triton kernels: prologue (:mod:`.quantize`), forward and backward
(:mod:`.attention`). Registered as the CUDA implementation of the scheme in :mod:`sage_compile.ops`;
reference: :mod:`sage_compile.reference.int8_train`."""
import types

from . import attention as _attention
from . import quantize as _quantize

impl = types.SimpleNamespace(quantize=_quantize.quantize, forward=_attention.forward, backward=_attention.backward,
                             quantize_forward=_attention.quantize_forward)
