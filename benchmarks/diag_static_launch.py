"""Does Inductor launch the traced ops' Triton kernels with its static CUDA launcher? Over one compiled TinyLlama
training step (``kernel="int8_train"``, the traced ops on CUDA): cProfile's calls of Triton's own launcher
(``launch_metadata``, once per launch it makes) and of Inductor's static one, and the reasons Inductor logs for
bypassing the static launcher. ``TAG`` names the run in the output; run it under the Inductor settings to compare,
e.g. ``TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=1`` (run 142: ``results/diag_static_launch_run142_*``).

    TAG=default python benchmarks/diag_static_launch.py
"""
import cProfile
import logging
import os
import pstats
import sys

import torch

sys.path.insert(0, "tests")
msgs = []


class H(logging.Handler):
    def emit(self, r):
        msgs.append(r.getMessage())


lg = logging.getLogger("torch._inductor.runtime.triton_heuristics")
lg.setLevel(logging.INFO)
lg.addHandler(H())
import sage_compile  # noqa: E402
from helpers import llm_step  # noqa: E402

torch.manual_seed(0)
model = sage_compile.models.TinyLlama(dim=256, heads=4, kv_heads=2, depth=2).cuda()
ids = torch.randint(0, 512, (2, 513), device="cuda")
cm = torch.compile(model, backend=sage_compile.make_backend(kernel="int8_train"))
for _ in range(2):
    llm_step(cm, ids)
torch.cuda.synchronize()
pr = cProfile.Profile()
pr.enable()
llm_step(cm, ids)
torch.cuda.synchronize()
pr.disable()
st = pstats.Stats(pr)
n = {f"{k[0].split('/')[-1]}:{k[2]}": v[0] for k, v in st.stats.items()
     if k[2] in ("launch_metadata", "_launch_kernel", "run")}
print(os.environ.get("TAG"), {k: v for k, v in n.items() if "launch" in k or "heuristics" in k or "static" in k})
print("bypass:", sorted({m[:240] for m in msgs if "Bypass" in m}))
