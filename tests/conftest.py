import os

import pytest
import torch

if not torch.cuda.is_available():
    # CPU machines run the small Triton kernels in Triton's interpreter; triton reads this at import.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_finish(session):
    """The selected tests' long single-process jobs (nvcc builds, the bindings' check, test_backend's fresh
    processes) start now, in the background (tests/builds.py)."""
    import builds

    if not session.config.option.collectonly:
        builds.start_for(session.items)


def pytest_sessionfinish(session):
    """Jobs not started by now are not needed (a run stopped early, -x): dropped."""
    import builds

    builds.cancel_pending()


def pytest_collection_modifyitems(config, items):
    # the modules with background jobs (tests/builds.py) run last, in their order, so that their jobs have the
    # rest of the suite's time to finish
    items.sort(key=lambda item: hasattr(getattr(item, "module", None), "background_builds"))  # (stable)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Counters are asserted: no FX/AOT cache hits (the rewrite would not run), a clean Dynamo state."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with torch._inductor.config.patch(force_disable_caches=True):
        yield
    torch._dynamo.reset()


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
