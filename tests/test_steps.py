"""Run-time scheme switching (sage_compile.steps): the hybrid first/last-step schedule for fp4."""
import pytest
import torch
from helpers import cos_rel
from torch._dynamo.utils import counters

import sage_compile
from sage_compile import steps


def test_schedule_and_callback():
    h = sage_compile.HybridSteps(num_steps=5, first=1, last=2, scheme="int8_fp8")
    assert [h.scheme_for(i) for i in range(5)] == ["int8_fp8", None, None, "int8_fp8", "int8_fp8"]
    seen = []
    with h:
        for i in range(5):
            seen.append(steps.current())
            assert h(None, i, 0, {"latents": 1}) == {"latents": 1}  # diffusers' callback_on_step_end
    assert seen == ["int8_fp8", None, None, "int8_fp8", "int8_fp8"]
    assert steps.current() is None
    with pytest.raises(ValueError, match="override scheme"):
        sage_compile.HybridSteps(4, scheme="fp8")
    with sage_compile.override("exact"):
        sage_compile.HybridSteps(4)  # building a schedule leaves the override in force alone
        assert steps.current() == "exact"
    with pytest.raises(ValueError, match="training scheme"):
        with sage_compile.override("int8_train"):
            pass


def test_switchable_compiled_model_switches_without_recompiling():
    m = sage_compile.models.TinyDiT(dim=64, heads=2, depth=2).eval()
    x = torch.randn(1, 64, 16, generator=torch.Generator().manual_seed(0))
    c = torch.compile(m, backend=sage_compile.make_backend(kernel="fp4", switchable=True,
                                                           compiler="eager"))
    with torch.no_grad():
        exact = m(x)
        fp4 = c(x)
        frames = counters["stats"]["unique_graphs"]
        with sage_compile.override("exact"):
            as_exact = c(x)
        with sage_compile.override("int8_fp8"):
            as_int8 = c(x)
        again = c(x)
    assert counters["sage_compile"]["scheme:fp4"] == 2
    assert counters["stats"]["unique_graphs"] == frames  # no recompilation
    assert torch.allclose(as_exact, exact, atol=1e-5)
    assert torch.equal(again, fp4) and not torch.allclose(fp4, exact, atol=1e-3)
    assert cos_rel(as_int8, exact)[0] > cos_rel(fp4, exact)[0]
