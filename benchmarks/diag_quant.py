"""Diagnose INT8 quantizer ties: kernel vs torch (GPU and CPU) division at x/scale ~ k + 0.5."""
import sys

import torch

sys.path.insert(0, "tests")
from helpers import outlier_inputs  # noqa: E402

from sage_compile.kernels.int8_fp8 import quantize as KQ  # noqa: E402
from sage_compile.reference import quant as Q  # noqa: E402

g = torch.Generator().manual_seed(64)
q = outlier_inputs(2, 8, 1000, 64, g)[0].cuda().bfloat16()
k8, ks = KQ.quant_rows_int8(q)
r8, rs = Q.quant_int8(q, 1)
c8, cs = Q.quant_int8(q.cpu(), 1)
print("scales equal gpu-ref:", torch.equal(ks, rs), "cpu-ref:", torch.equal(ks.cpu(), cs))
print("values: kernel vs gpu-ref differ", int((k8 != r8).sum()), "| kernel vs cpu-ref differ", int((k8.cpu() != c8).sum()),
      "| gpu-ref vs cpu-ref differ", int((r8.cpu() != c8).sum()))
bad = (k8.cpu() != c8) | (r8.cpu() != c8)
x = q.float().cpu()[bad][:4]
s = cs[..., None].expand_as(c8)[bad][:4]
print("x", x.tolist(), "s", s.tolist())
print("cpu x/s", (x / s).tolist(), "fp64", (x.double() / s.double()).tolist())
print("gpu x/s", (x.cuda() / s.cuda()).tolist(), "kernel", k8.cpu()[bad][:4].tolist(), "cpu-ref", c8[bad][:4].tolist())
