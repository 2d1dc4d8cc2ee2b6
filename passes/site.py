"""The ``Site``: one attention in a graph, with everything the policy and the report need."""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

import torch
from torch import fx


def val(n: Any):
    """The FakeTensor / SymInt / constant behind an FX argument."""
    if isinstance(n, fx.Node):
        return n.meta.get("example_value", n.meta.get("val"))
    return n


@dataclasses.dataclass
class Site:
    """One attention site.

    ``node`` is the node whose value the attention output replaces (the SDPA call or the P·V matmul);
    ``q``/``k``/``v`` feed the op in ``layout`` (``HND`` = (B, H, N, D), ``NHD`` = (B, N, H, D)), after
    unwrapping permutes and ``repeat_kv``; ``rank3`` marks hand-written (B·H, N, D) attention.
    """

    kind: str
    node: fx.Node
    q: Optional[fx.Node] = None
    k: Optional[fx.Node] = None
    v: Optional[fx.Node] = None
    layout: str = "HND"
    rank3: bool = False
    mask: Any = None  # fx.Node | None; for hand-written masks possibly a (node, "invert") pair
    mask_kind: str = "none"
    causal: str = "none"
    scale: Any = None  # float | fx.Node | None (None = D ** -0.5)
    dropout_p: float = 0.0
    pattern_nodes: list = dataclasses.field(default_factory=list)
    reject_reason: Optional[str] = None
    unwrapped: list = dataclasses.field(default_factory=list)
    index: int = -1

    # ---------------------------------------------------------------- derived facts
    def _shape(self, n, layout=None):
        t = val(n)
        if t is None:
            return None
        s = tuple(t.shape)
        if self.rank3:
            s = (1,) + s
        if (layout or self.layout) == "NHD":
            s = (s[0], s[2], s[1], s[3])
        return s

    @property
    def q_shape(self):
        return self._shape(self.q)

    @property
    def k_shape(self):
        return self._shape(self.k)

    @property
    def v_shape(self):
        return self._shape(self.v)

    @property
    def autocast_dtype(self):
        """The 16-bit dtype autocast gives an SDPA call whose inputs differ from it (e.g. fp32 q/k out of
        RoPE beside a bf16 v under ``torch.autocast``): Dynamo's graph holds the inputs uncast, the output
        meta says what autocast computes in. None elsewhere."""
        out = val(self.node)
        ins = tuple(getattr(val(t), "dtype", None) for t in (self.q, self.k, self.v))
        if self.kind != "sdpa" or not isinstance(out, torch.Tensor) or None in ins:
            return None
        if out.dtype in (torch.float16, torch.bfloat16) and any(d != out.dtype for d in ins):
            return out.dtype
        return None

    @property
    def dtype(self):
        t = val(self.q)
        return None if t is None else (self.autocast_dtype or t.dtype)

    @property
    def dtypes(self) -> tuple:
        ac = self.autocast_dtype
        return (ac,) * 3 if ac else tuple(getattr(val(t), "dtype", None) for t in (self.q, self.k, self.v))

    @property
    def device_type(self) -> str:
        t = val(self.q)
        return "cpu" if t is None else t.device.type

    @property
    def device(self) -> Optional[torch.device]:
        t = val(self.q)
        return None if t is None else t.device

    @property
    def head_dim(self) -> int:
        return int(self.q_shape[-1])

    @property
    def head_dim_v(self) -> int:
        return int(self.v_shape[-1])

    @property
    def hq(self) -> int:
        return int(self.q_shape[1])

    @property
    def hkv(self) -> int:
        return int(self.k_shape[1])

    @property
    def requires_grad(self) -> bool:
        out = val(self.node)
        return bool(getattr(out, "requires_grad", False))

    @property
    def location(self) -> str:
        """'file:line in fn' of the user's code, from the node's stack trace."""
        st = self.node.meta.get("stack_trace") or ""
        frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', st)
        if not frames:
            return "<unknown>"
        f, line, fn = frames[-1]
        return f"{f}:{line} in {fn}"

    @property
    def scale_value(self):
        """The softmax scale as a number (None = D ** -0.5), or a string for a symbolic scale."""
        s = self.scale
        if isinstance(s, tuple) and s and s[0] == "factors":
            out = 1.0
            for op, f in s[1]:
                if not isinstance(f, (int, float)):
                    return str(s[1])
                out = out * f if op == "mul" else out / f
            return out
        return s if s is None or isinstance(s, (int, float)) else str(s)

    def describe(self) -> dict:
        def fmt(s):
            return None if s is None else [str(x) for x in s]

        return {
            "index": self.index, "kind": self.kind, "node": self.node.name, "location": self.location,
            "q": fmt(self.q_shape), "k": fmt(self.k_shape), "v": fmt(self.v_shape),
            "dtype": str(self.dtype).replace("torch.", ""), "layout": self.layout, "mask": self.mask_kind,
            "causal": self.causal, "gqa": f"{self.hq}/{self.hkv}" if self.q is not None and self.hq != self.hkv else None,
            "scale": self.scale_value,
            "unwrapped": list(self.unwrapped),
        }


def mask_kind_of(mask) -> str:
    if mask is None:
        return "none"
    t = val(mask)
    if t is None or not isinstance(t, torch.Tensor):
        return "unknown"
    return "bool" if t.dtype == torch.bool else "additive"
