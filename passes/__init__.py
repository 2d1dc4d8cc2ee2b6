"""FX graph passes of sage_compile (installed as ``sage_compile.passes``).

``find_sites(gm)`` lists every attention site of a Dynamo (pre-dispatch) graph: SDPA calls
(:mod:`.sdpa`) and hand-written ``softmax(q @ kᵀ · s) @ v`` (:mod:`.handwritten`), with layouts and
``repeat_kv`` already unwrapped (:mod:`.layout`). ``rewrite(gm, sites, decisions)`` replaces the chosen
sites by the prologue and core ops of their scheme (:mod:`.rewrite`). Passes know nothing of kernels.
"""
from .handwritten import find_handwritten_sites
from .rewrite import rewrite
from .sdpa import find_sdpa_sites
from .site import Site


def find_sites(gm) -> list:
    """All attention sites of ``gm`` (an ``fx.GraphModule`` or ``fx.Graph``), in graph order."""
    graph = getattr(gm, "graph", gm)
    sites = find_sdpa_sites(graph) + find_handwritten_sites(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    sites.sort(key=lambda s: order[s.node])
    for i, s in enumerate(sites):
        s.index = i
    return sites


__all__ = ["Site", "find_sites", "rewrite", "find_sdpa_sites", "find_handwritten_sites"]
