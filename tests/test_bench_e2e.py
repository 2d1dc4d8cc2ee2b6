"""benchmarks/bench_e2e.py's attention accounting (what the Amdahl prediction of issue 7 rests on): which
kernels and which profiler ops count as attention."""
from types import SimpleNamespace

import torch
from helpers import benchmark_module

bench_e2e = benchmark_module("bench_e2e")


def test_attention_kernels_by_name():
    # kernel names seen in run 64's CogVideoX step (H200 profiler)
    attention = ["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_kernel0_0",
                 "void sage_sm90::fwd_kernel<64, 4, false, false, __nv_bfloat16>(CUtensorMap_st, sage_sm90::Params)",
                 "_quant_rows_int8", "_chan_stats", "_quant_v_fp8", "_stats_finalize", "_fwd_body", "_mask_mismatch",
                 "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4> >(Flash_fwd_params)"]
    other = ["triton_per_fused__scaled_dot_product_cudnn_attention_native_layer_norm_transpose_view_7",
             "triton_per_fused_native_layer_norm_quantize_int8_fp8_transpose_view_7", "triton_poi_fused_gelu_view_11",
             "nvjet_sm90_tst_192x176_64x4_1x2_h_bz_coopB_bias_TNT", "Memset (Device)",
             "void cutlass__5x_cudnn::Kernel<cutlass_tensorop_bf16_s16816fprop_optimized_bf16_256x128_64x3_nhwc_align8>",
             "void cudnn::engines_precompiled::nhwcToNchwKernel<__nv_bfloat16, __nv_bfloat16, float, true, false>"]
    assert [n for n in attention if not bench_e2e._ATTN.search(n)] == []
    assert [n for n in other if bench_e2e._ATTN.search(n)] == []


def _ev(name, ms, parent=None):
    return SimpleNamespace(device_type=torch.autograd.DeviceType.CPU, name=name, cpu_parent=parent,
                           device_time_total=ms * 1e3)


def test_attention_ops_outermost_and_not_inductor_launches():
    sdpa = _ev("aten::scaled_dot_product_attention", 5.0)
    inner = _ev("aten::_scaled_dot_product_cudnn_attention", 5.0, sdpa)  # under the outer op: not again
    cudnn = _ev("aten::_scaled_dot_product_cudnn_attention", 3.0)  # Inductor's extern call
    op = _ev("sage_compile::attention_int8_fp8", 2.0)
    launch = _ev("triton_per_fused__scaled_dot_product_cudnn_attention_native_layer_norm_7", 0.5)  # Inductor's
    mm = _ev("aten::mm", 7.0)
    cuda = SimpleNamespace(device_type=torch.autograd.DeviceType.CUDA, name="_fwd_body", cpu_parent=op,
                           device_time_total=2e3)
    assert bench_e2e.attention_op_ms([sdpa, inner, cudnn, op, launch, mm, cuda]) == 10.0
