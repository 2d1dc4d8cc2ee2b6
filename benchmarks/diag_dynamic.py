"""Why a CogVideoX transformer recompiles per frame count under ``dynamic=True`` (issue 7's ``dynamic`` item):
Dynamo alone (``backend="eager"``), the frame dimension marked dynamic, so that the constraint violation names
the line that specialised it; then the symbolic-shapes log's specialisation lines for ``dynamic=True`` over two
frame counts. The model of ``robustness.py`` (2 layers at CogVideoX-2B's width on CUDA, its tiny config on CPU).

    python benchmarks/diag_dynamic.py > results/dynamic_cogvideox_diag_<run>.log

H200 run 88 (torch 2.11): diffusers' ``get_3d_sincos_pos_embed`` (``repeat_interleave``) specialises it; torch 2.13
compiles the same model once.
"""
from __future__ import annotations

import io
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from robustness import build, inputs  # noqa: E402

SPECIALISATION = ("specializ", "set_replacement", "recompil", "guard failure", "size mismatch", "eval eq", "eval ne",
                  "guard added")


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m, cfg = build(dev == "cpu", dev)
    print("torch", torch.__version__)
    torch._dynamo.reset()
    x = inputs(cfg, dev, 4)
    torch._dynamo.mark_dynamic(x["hidden_states"], 1)
    try:
        with torch.no_grad():
            torch.compile(m, backend="eager")(**x)
        print("mark_dynamic: compiled without a constraint violation")
    except Exception as e:  # the constraint violation, with the specialising line
        print("mark_dynamic:", type(e).__name__, str(e)[:6000])
    torch._dynamo.reset()
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    torch._logging.set_logs(dynamic=logging.DEBUG, recompiles=True)
    for name in ("torch.fx.experimental.symbolic_shapes", "torch._dynamo"):
        logging.getLogger(name).addHandler(handler)
    f = torch.compile(m, backend="eager", dynamic=True)
    with torch.no_grad():
        for frames in (4, 5):
            f(**inputs(cfg, dev, frames))
    torch._logging.set_logs()
    lines = buf.getvalue().splitlines()
    keep = [ln for ln in lines if any(s in ln.lower() for s in SPECIALISATION)]
    print(f"{len(lines)} log lines, {len(keep)} about specialisation:")
    print("\n".join(keep[:80]))


if __name__ == "__main__":
    main()
