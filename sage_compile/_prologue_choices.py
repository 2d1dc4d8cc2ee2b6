"""Inductor heuristics for graphs that hold the quantization prologue as graph ops (``prologue="graph"``),
installed only while such a graph compiles (:func:`sage_compile._compat.graph_prologue_choices`).

One heuristic changes: a reduction Inductor would loop over because its hint is DEFAULT runs persistent
(each row read once, held in registers) when its rows are short: a static length of at most
:data:`PERSISTENT_ROWS_MAX`. The per-token INT8 quantizer of Q and K reads (B, N, H, D) rows and writes
its scales as (B, H, N): Inductor's hint drops from INNER to DEFAULT, whose persistence threshold is 64, so
at head dim 128 (Flux) the fused RoPE + quantize kernel looped and read every row three times (0.307 ms of
a 0.677 ms prologue at 16K tokens, H200 run 23, ``benchmarks/results/block_h200_run23_c2e01b5.log``).
Results are unchanged: the kernels' reductions are amax and any, exact in any order.
"""
from __future__ import annotations

from torch._inductor import config as inductor_config
from torch._inductor.choices import InductorChoices
from torch._inductor.runtime.hints import ReductionHint

PERSISTENT_ROWS_MAX = 256


class PrologueChoices(InductorChoices):
    @staticmethod
    def should_use_persistent_reduction(features, cooperative_reduction=False) -> bool:
        if InductorChoices.should_use_persistent_reduction(features, cooperative_reduction):
            return True
        if cooperative_reduction or not inductor_config.triton.persistent_reductions:
            return False
        try:
            rows = int(features.reduction_numel)
            return rows <= PERSISTENT_ROWS_MAX and features.get_reduction_hint() == ReductionHint.DEFAULT
        except (TypeError, ValueError):  # a symbolic row length: Inductor's own answer stands
            return False
