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

    # auto=False: on the H200, with its default prologue, the scheme beats SDPA cuDNN only at hd128 16K
    # non-causal on the CUDA core (640 vs 624 TOPS; benchmarks/results/attention_cuda_b851cb4_h200.json), not
    # causal (552 vs 590) nor at 4K-8K or hd64 (attention_cuda_h200.json), so ``auto`` keeps SDPA;
    # ``kernel="int8_fp8"`` selects it.
    ops.register_impl("int8_fp8", "cuda", int8_fp8.impl, auto=False)
    from . import fp4

    # fp4 on Hopper: exact NVFP4 numerics, dequantized to bf16 tensor cores (never an FP4 speed-up)
    ops.register_impl("fp4", "cuda", fp4.impl)
    from . import int8_train

    # SageBwd (training): INT8 forward and backward; chosen by kernel="int8_train" (auto keeps exact SDPA
    # for sites needing gradients until the kernel is measured faster than cuDNN's backward)
    ops.register_impl("int8_train", "cuda", int8_train.impl)
