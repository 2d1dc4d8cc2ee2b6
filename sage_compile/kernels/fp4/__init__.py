"""``fp4`` (SageAttention3 NVFP4) Triton kernels: quantizer (:mod:`.quantize`) and core (:mod:`.attention`).

Not registered in :mod:`sage_compile.ops` yet: checked on CPU under Triton's interpreter only; they are
registered once the GPU tests (tests/test_kernel_fp4_gpu.py) pass on the H200. Blackwell-native FP4 MMA
(``tl.dot_scaled`` with E4M3 scales) is not implemented.
"""
import types

from . import attention as _attention
from . import quantize as _quantize

impl = types.SimpleNamespace(quantize=_quantize.quantize, attention=_attention.attention)
