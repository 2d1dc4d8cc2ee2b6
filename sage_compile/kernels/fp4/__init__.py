"""``fp4`` (SageAttention3 NVFP4) Triton kernels: quantizer (:mod:`.quantize`) and core (:mod:`.attention`).

Registered as the CUDA implementation of ``fp4`` (:mod:`sage_compile.kernels`); checked on CPU under
Triton's interpreter and on the H200 (tests/test_kernel_fp4_gpu.py). Blackwell-native FP4 MMA
(``tl.dot_scaled`` with E4M3 scales) is not implemented.
"""
import types

from . import attention as _attention
from . import quantize as _quantize

impl = types.SimpleNamespace(quantize=_quantize.quantize, attention=_attention.attention)
