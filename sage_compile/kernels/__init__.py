"""GPU kernels (Triton); imported lazily on CUDA devices. Each kernel registers itself in sage_compile.ops."""
