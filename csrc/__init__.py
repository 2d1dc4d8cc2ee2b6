"""CUDA/C++ sources, installed as ``sage_compile.csrc`` package data and built at first use on a CUDA
machine (:mod:`sage_compile.kernels.int8_fp8.cuda`); nothing here is imported as Python."""
