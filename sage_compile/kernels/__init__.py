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

    # auto=False: on the H200, with its default prologue, the scheme beats SDPA cuDNN only at hd128 N=16K on
    # the CUDA core (656 vs 603 TOPS, causal 600 vs 573), ties it at 8K (591 vs 598) and is behind at 4K and
    # at hd64 (410 vs 462; benchmarks/results/attention_cuda_h200.json, 7b80c98), so ``auto`` keeps SDPA;
    # ``kernel="int8_fp8"`` selects it.
    ops.register_impl("int8_fp8", "cuda", int8_fp8.impl, auto=False)
    from . import fp4

    # fp4 on Hopper: exact NVFP4 numerics, dequantized to bf16 tensor cores (never an FP4 speed-up)
    ops.register_impl("fp4", "cuda", fp4.impl)
    from . import int8_train

    # SageBwd (training): INT8 forward and backward; chosen by kernel="int8_train" (auto keeps exact SDPA
    # for sites needing gradients until the kernel is measured faster than cuDNN's backward)
    ops.register_impl("int8_train", "cuda", int8_train.impl)
