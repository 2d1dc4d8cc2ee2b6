"""On CUDA: the reference numerics run on the device and agree with the CPU reference; a compiled model
on CUDA (bf16) goes through the rewrite and Inductor. Kernel tests live beside each kernel."""
import pytest
import torch
from helpers import cos_rel, outlier_inputs
from torch._dynamo.utils import counters

import sage_compile

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("scheme", ["int8_fp8", "int8_fp16", "fp4"])
def test_cuda_reference_equals_cpu_reference(scheme):
    g = torch.Generator().manual_seed(0)
    q, k, v = outlier_inputs(1, 4, 300, 64, g, hkv=2)
    mod = getattr(sage_compile.reference, scheme)
    extra = {"head_dim": 64} if scheme == "fp4" else {}

    def run(*t):
        return mod.attention(*mod.quantize(*t), None, "bottom_right", None, "HND", torch.float32, **extra)

    cpu = run(q, k, v)
    gpu = run(q.cuda(), k.cuda(), v.cuda())
    c, rel = cos_rel(gpu.cpu(), cpu)
    assert c > 0.99999 and rel < 1e-3, (c, rel)


def test_compiled_model_on_cuda_bf16():
    m = sage_compile.models.TinyLlama().cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, 512, (2, 512), device="cuda")
    with torch.no_grad():
        ref = m(ids).float()
        out = torch.compile(m, backend=sage_compile.make_backend(kernel="int8_fp8"))(ids).float()
    assert counters["sage_compile"]["replaced"] == 2
    assert cos_rel(out, ref)[0] > 0.999
