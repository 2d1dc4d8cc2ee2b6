"""``int8_fp8`` (SageAttention2) Triton kernels: prologue (:mod:`.quantize`) and core (:mod:`.attention`).

Importing this package on a machine with CUDA and Triton registers the kernels as the CUDA
implementation of the scheme in :mod:`sage_compile.ops`. Reference: :mod:`sage_compile.reference.int8_fp8`.
"""
import types

from . import attention as _attention
from . import quantize as _quantize

impl = types.SimpleNamespace(quantize=_quantize.quantize, attention=_attention.attention)
