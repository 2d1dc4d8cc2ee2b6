"""GPU kernels (Triton), imported lazily by :mod:`sage_compile.ops` for CUDA devices.

Each scheme's kernel package exposes ``impl`` (``quantize``/``attention`` with the reference's
signatures) and is registered here: one line per kernel. Kernels need Triton and a GPU with INT8 and
FP8 tensor cores (sm89 / sm90); elsewhere the reference serves.
"""
import torch

from .. import ops


def _capability_ok(major_minor: tuple[int, int]) -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= major_minor


try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

if triton is not None and _capability_ok((8, 9)):
    from . import int8_fp8

    # ``auto`` takes it at the sites where it beats SDPA (long attention on the sm90 CUDA core:
    # sage_compile.policy.AUTO_INT8_FP8_MIN_TOKENS); ``kernel="int8_fp8"`` everywhere
    ops.register_impl("int8_fp8", "cuda", int8_fp8.impl)
    from . import fp4

    # fp4 on Hopper: exact NVFP4 numerics, dequantized to bf16 tensor cores (never an FP4 speed-up)
    ops.register_impl("fp4", "cuda", fp4.impl)
    from . import int8_train

    # SageBwd (training): INT8 forward and backward; chosen by kernel="int8_train" (auto keeps exact SDPA
    # for sites needing gradients until the kernel is measured faster than cuDNN's backward)
    ops.register_impl("int8_train", "cuda", int8_train.impl)
