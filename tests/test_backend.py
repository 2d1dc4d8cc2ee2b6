"""The backend: entry point without import, global enable (both routes), mode/options, configuration
changes after compilation, the eager context manager and pass chaining."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from helpers import cos_rel
from torch._dynamo.utils import counters

import sage_compile
from sage_compile.passes.rewrite import graph_prologue_functions
from sage_compile import hooks

import builds

SCRIPT = textwrap.dedent("""
    import sys, torch
    import torch.nn.functional as F
    from torch._dynamo.utils import counters
    torch._inductor.config.force_disable_caches = True
    f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    q = torch.randn(1, 2, 16, 32)
    kw = eval(sys.argv[1])
    with torch.no_grad():
        out = torch.compile(f, **kw)(q, q, q)
    ref = f(q, q, q)
    print("REPLACED", counters["sage_compile"]["replaced"], "COS", torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item())
    print("PREGRAD", type(torch._inductor.config.pre_grad_custom_pass).__name__)
""")


# the fresh processes each test runs (SCRIPT's argument, environment): started when collection ends, in the
# background (tests/builds.py), since each spends ~15 s importing and compiling on one core
RUNS = {
    "test_entry_point_backend_from_a_new_process": [
        ("{'backend': 'sage', 'options': {'sage_kernel': 'int8_fp8'}}", {})],
    "test_global_enable_default_backend_route": [("{}", dict(SAGE_COMPILE="1", SAGE_COMPILE_KERNEL="int8_fp8"))],
    "test_global_enable_pregrad_route_and_off_by_default": [
        ("{}", dict(SAGE_COMPILE="1", SAGE_COMPILE_KERNEL="int8_fp8", SAGE_COMPILE_HOOK="pregrad")),
        ("{}", dict(SAGE_COMPILE_KERNEL="int8_fp8"))],
}


def _script(work, kw: str, env: dict):
    e = {k: v for k, v in os.environ.items() if not k.startswith("SAGE_COMPILE")}
    e.update(env)
    return subprocess.run([sys.executable, "-c", SCRIPT, kw], capture_output=True, text=True, env=e, timeout=300,
                          cwd="/")


def _start(kw: str, env: dict):
    return builds.start(("backend", kw, tuple(sorted(env.items()))), _script, kw, env)


def background_builds(item):
    """tests/builds.py: the item's fresh processes (RUNS) start when collection ends."""
    for kw, env in RUNS.get(item.name, []):
        _start(kw, env)
    if item.name == "test_global_enable_on_an_unmodified_diffusers_pipeline":
        _pipeline_runs()


def _run(kw: str, env: dict):
    p = _start(kw, env).result()
    assert p.returncode == 0, p.stderr[-3000:]
    words = p.stdout.split()
    return int(words[words.index("REPLACED") + 1]), float(words[words.index("COS") + 1]), words[words.index("PREGRAD") + 1]


def test_entry_point_backend_from_a_new_process():
    n, cos, _ = _run(*RUNS["test_entry_point_backend_from_a_new_process"][0])
    assert n == 1 and cos > 0.999


def test_global_enable_default_backend_route():
    if not hasattr(torch.compiler, "set_default_backend"):
        pytest.skip("torch < 2.13 has no default-backend API (the pre-grad route is tested below)")
    n, cos, pregrad = _run(*RUNS["test_global_enable_default_backend_route"][0])
    assert n == 1 and cos > 0.999 and pregrad == "NoneType"


def test_global_enable_pregrad_route_and_off_by_default():
    on, off = RUNS["test_global_enable_pregrad_route_and_off_by_default"]
    n, cos, pregrad = _run(*on)
    assert n == 1 and cos > 0.999 and pregrad == "SagePreGradPass"
    n, _, pregrad = _run(*off)
    assert n == 0 and pregrad == "NoneType"


def test_pregrad_pass_chains_existing_pass_and_uninstalls():
    from torch._inductor import config as ic

    seen = []

    class Prev(hooks._compat.custom_graph_pass_base()):
        def __call__(self, graph):
            seen.append(sum(1 for n in graph.nodes if "sage_compile" in str(n.target)))

        def uuid(self):
            return "prev"

    prev = Prev()
    with ic.patch(pre_grad_custom_pass=prev):
        with sage_compile.options(kernel="int8_fp8"):
            hooks.install_global("pregrad")
            try:
                assert ic.pre_grad_custom_pass.previous is prev and ic.pre_grad_custom_pass.uuid()
                with torch.no_grad():
                    torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q))(torch.randn(1, 2, 8, 16))
            finally:
                hooks.uninstall_global()
            assert ic.pre_grad_custom_pass is prev
    assert seen and seen[0] >= 2  # the previous pass ran after ours and saw the sage ops (prologue op + core)


def test_mode_and_options_reach_inductor(monkeypatch):
    import torch._inductor.compile_fx as cfx

    got = {}
    real = cfx.compile_fx

    def spy(gm, inputs, config_patches=None, **kw):
        got.update(config_patches or {})
        return real(gm, inputs, config_patches=config_patches, **kw)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    f = lambda q: F.scaled_dot_product_attention(q, q, q)  # noqa: E731
    with torch.no_grad():
        torch.compile(f, backend="sage", mode="max-autotune-no-cudagraphs")(torch.randn(1, 2, 8, 16))
    assert got.get("max_autotune") is True
    torch._dynamo.reset()
    got.clear()
    with torch.no_grad():
        torch.compile(f, backend="sage", options={"sage_kernel": "int8_fp8", "epilogue_fusion": False})(torch.randn(1, 2, 8, 16))
    from sage_compile import _compat

    # the user's option, the graph prologue's own (no stride padding) and the AOT cache's marks
    assert got == {"epilogue_fusion": False, **_compat.graph_prologue_inductor_patches(),
                   **_compat.aot_cache_patches(graph_prologue_functions())}
    assert got["comprehensive_padding"] is False and counters["sage_compile"]["scheme:int8_fp8"] == 1


def test_rewritten_graphs_hit_the_aot_autograd_cache():
    """A graph with the graph prologue (Python functions in the graph) is cached by AOTAutograd: a second
    compile of the same model skips the re-trace (CogVideoX-2B on the H200: 30 s vs Inductor's 7 s before);
    the key carries this package's source hash, so an edited prologue misses."""
    from torch._inductor.utils import fresh_cache

    from sage_compile import _compat, _sources

    m = sage_compile.models.TinyDiT(dim=32, heads=2, depth=1).eval()
    x = torch.randn(1, 16, 16)
    marks = _compat.aot_cache_patches(graph_prologue_functions())["unsafe_marked_cacheable_functions"]
    assert marks["sage_compile.reference.int8_fp8.quantize"] == f"sage_compile {_sources.package_hash()}"
    seen = []
    with fresh_cache(), torch._inductor.config.patch(force_disable_caches=False), torch.no_grad():
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            torch.compile(m, backend=sage_compile.make_backend(kernel="int8_fp8", prologue="graph"))(x)
            seen.append(dict(counters["aot_autograd"]))
            assert counters["sage_compile"]["scheme:int8_fp8"] == 1  # the rewrite ran both times
    torch._dynamo.reset()
    assert seen[0].get("autograd_cache_miss") == 1 and not seen[0].get("autograd_cache_bypass"), seen
    assert seen[1].get("autograd_cache_hit") == 1, seen


def test_config_change_after_compilation_raises_never_stale():
    f = lambda q: F.scaled_dot_product_attention(q, q, q)  # noqa: E731
    q = torch.randn(1, 2, 8, 16)
    with torch.no_grad():
        with sage_compile.options(kernel="int8_fp8"):
            cf = torch.compile(f, backend="sage")
            cf(q)
            cf(q)
        with pytest.raises(Exception, match="configuration changed"):
            cf(q)
        with sage_compile.options(kernel="int8_fp8"):
            cf(q)  # back to the compiled configuration: fine
        torch._dynamo.reset()
        explicit = torch.compile(f, backend=sage_compile.make_backend(kernel="fp4"))
        explicit(q)
        with sage_compile.options(kernel="int8_fp8"):
            explicit(q)  # explicit arguments win: nothing changed for this graph


def test_config_guard_follows_the_environment_and_skips_resolve_when_unchanged(monkeypatch):
    monkeypatch.delenv("SAGE_COMPILE_KERNEL", raising=False)
    f = lambda q: F.scaled_dot_product_attention(q, q, q)  # noqa: E731
    q = torch.randn(1, 2, 8, 16)
    torch._dynamo.reset()
    with torch.no_grad():
        cf = torch.compile(f, backend=sage_compile.make_backend("eager"))
        cf(q)
        resolve = sage_compile.config.resolve
        with monkeypatch.context() as m:  # same environment, no context manager: the guard resolves nothing
            m.setattr(sage_compile.config, "resolve", lambda **kw: pytest.fail("resolved on the fast path"))
            cf(q)
        assert sage_compile.config.resolve is resolve
        monkeypatch.setenv("SAGE_COMPILE_KERNEL", "fp4")
        with pytest.raises(Exception, match="configuration changed"):
            cf(q)
        monkeypatch.setenv("SAGE_COMPILE_KERNEL", "auto")  # another environment, the same configuration
        cf(q)
        monkeypatch.delenv("SAGE_COMPILE_KERNEL")
        cf(q)
    torch._dynamo.reset()


def test_env_configuration(monkeypatch):
    monkeypatch.setenv("SAGE_COMPILE_KERNEL", "fp4")
    assert sage_compile.config.resolve().kernel == "fp4"
    with sage_compile.options(kernel="int8_fp16"):
        assert sage_compile.config.resolve().kernel == "int8_fp16"
        assert sage_compile.config.resolve(kernel="exact").kernel == "exact"
    monkeypatch.setenv("SAGE_COMPILE_KERNEL", "int3")
    with pytest.raises(ValueError, match="kernel must be one of"):
        sage_compile.config.resolve()
    with pytest.raises(TypeError, match="unknown option"):
        sage_compile.make_backend(kernal="fp4")


def test_eager_context_manager():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 32, 64, generator=g) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sage_compile.enable(kernel="fp4"):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        kept = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)  # unsupported: SDPA runs, not an error
    assert not torch.equal(out, ref) and cos_rel(out, ref)[0] > 0.95
    assert kept.shape == q.shape
    with sage_compile.enable(kernel="fp4", fp4_smooth="none"):  # numeric options reach the op
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                           sage_compile.attention(q, k, v, None, "top_left", None, "HND", "fp4",
                                                  sage_compile.Options(fp4_smooth="none")))
    assert not torch.equal(out, sage_compile.attention(q, k, v, None, "top_left", None, "HND", "fp4",
                                                       sage_compile.Options(fp4_smooth="none")))
    with sage_compile.enable(kernel="int8_fp8"):
        m = sage_compile.models.TinyDiT(dim=128, heads=2, depth=1).eval()
        x = torch.randn(1, 64, 16, generator=g)
        with torch.no_grad():
            assert cos_rel(m(x), torch.compile(m, backend="eager")(x))[0] > 0.999


def test_dynamic_shapes_compile_once():
    """dynamic=True: three sequence lengths and two batch sizes run one compiled graph (no recompile), and the
    rewrite's fake propagation of the graph prologue on symbolic shapes logs no failed meta kernel (it did:
    addcdiv's broadcast on torch 2.13, F.pad's symbolic pads on 2.11, each an error-level traceback)."""
    import logging

    failed = []

    class Grab(logging.Handler):
        def emit(self, record):
            failed.append(record.getMessage())

    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    grab = Grab(logging.ERROR)
    fake_log.addHandler(grab)
    m = sage_compile.models.TinyLlama(dim=64, heads=4, kv_heads=2, depth=1).eval()
    c = torch.compile(m, backend=sage_compile.make_backend(kernel="int8_fp8", prologue="graph"), dynamic=True)
    try:
        with torch.no_grad():
            for b, n in ((2, 40), (2, 77), (3, 130)):
                ids = torch.randint(0, 512, (b, n))
                assert cos_rel(c(ids), m(ids))[0] > 0.9999
    finally:
        fake_log.removeHandler(grab)
    assert not failed, failed[:2]
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["sage_compile"]["replaced"] >= 1 and counters["sage_compile"]["kept"] == 0


def _pipeline(work: str, env: dict):
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "pipeline_cogvideox.py")
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAGE_COMPILE")}
    env = {k: v.format(work=work) for k, v in env.items()}
    p = subprocess.run([sys.executable, script, "cpu", "1", os.path.join(work, "latents.pt")], env={**base, **env},
                       capture_output=True, text=True, timeout=600)
    return p, work


def _pipeline_runs() -> dict:
    """The script run eagerly and with SAGE_COMPILE=1, started in the background (tests/builds.py) once."""
    runs = {"eager": {"TORCHDYNAMO_DISABLE": "1"},
            "sage": {"SAGE_COMPILE": "1", "SAGE_COMPILE_KERNEL": "int8_fp8", "SAGE_COMPILE_DUMP": "{work}/dump"}}
    return {name: builds.start(("pipeline", name), _pipeline, env) for name, env in runs.items()}


def test_global_enable_on_an_unmodified_diffusers_pipeline():
    """SAGE_COMPILE=1 on an ordinary diffusers script (benchmarks/pipeline_cogvideox.py: a CogVideoX pipeline
    whose transformer goes through a plain torch.compile): every attention site of the compiled transformer
    is replaced (the dump's reports) and the latents of 3 guided steps match the same script run eagerly
    (TORCHDYNAMO_DISABLE=1: the script untouched, torch.compile a no-op)."""
    pytest.importorskip("diffusers")
    import glob
    import json

    lat, work = {}, {}
    for name, job in _pipeline_runs().items():
        p, work[name] = job.result()
        assert p.returncode == 0, p.stderr[-3000:]
        lat[name] = torch.load(os.path.join(work[name], "latents.pt"))
    rows = [r for f in glob.glob(os.path.join(work["sage"], "dump", "*_report.json")) for r in json.load(open(f))]
    assert rows and all(r["decision"] == "int8_fp8" for r in rows), rows
    assert cos_rel(lat["sage"], lat["eager"])[0] > 0.999  # the step-output goal of issue 7 (3 steps here)
