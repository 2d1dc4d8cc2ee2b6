"""Pure-PyTorch reference numerics: the CPU implementation of every scheme and the oracle for kernels.

One module per scheme (``int8_fp8`` SA2, ``int8_fp16`` SA1, ``fp4`` SA3, ``exact`` SDPA), the shared
quantizers in :mod:`.quant` and the tiled online-softmax engine in :mod:`.engine`.
"""
from . import exact, fp4, int8_fp8, int8_fp16, quant  # noqa: F401
