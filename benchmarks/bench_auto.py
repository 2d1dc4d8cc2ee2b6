"""Where ``auto`` should run ``int8_fp8`` (sage_compile.policy.AUTO_INT8_FP8_MIN_TOKENS): one SDPA call compiled
with Inductor (SDPA as torch dispatches it: cuDNN on sm90 with torch 2.11) and with ``backend="sage"`` naming
``int8_fp8`` (its default traced, channel-balanced prologue and the core chosen per shape), timed in one process
per sequence length, head dim and causal flag. The ratio is what a site of that size gains from ``auto`` choosing
``int8_fp8``.

    python benchmarks/bench_auto.py --out benchmarks/results/auto_<run>.json [--n 4096,8192,12288,16384]
        [--hd 128,64] [--causal 0,1]

Heads per head dim as in the block models: 24 at hd128 (Flux), 30 at hd64 (CogVideoX); batch ``--batch`` (1).
Records: ``metric: ms`` per kernel (``sdpa_cudnn`` = Inductor's SDPA, ``sage_int8_fp8``), ``metric: speedup``
(SDPA ms / sage ms), and the sage output's ``cos`` / ``rel_l1`` against fp32 SDPA.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import gpu_meta, write_records  # noqa: E402

HEADS = {128: 24, 64: 30}


class Sdpa(torch.nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def main():
    import triton

    import sage_compile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", default="4096,8192,12288,16384")
    ap.add_argument("--hd", default="128,64")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args()
    recs = []
    torch.manual_seed(0)
    for d in (int(x) for x in a.hd.split(",")):
        for causal in (bool(int(x)) for x in a.causal.split(",")):
            for n in (int(x) for x in a.n.split(",")):
                h = HEADS[d]
                q, k, v = (torch.randn(a.batch, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                m = Sdpa(causal)
                with torch.no_grad():
                    ind = torch.compile(m, dynamic=False)
                    sage = torch.compile(m, dynamic=False, backend=sage_compile.make_backend(kernel="int8_fp8"))
                    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
                    out = sage(q, k, v).float()
                    ind(q, k, v)
                    t = {name: triton.testing.do_bench(lambda f=f: f(q, k, v), warmup=50, rep=200)
                         for name, f in (("sdpa_cudnn", ind), ("sage_int8_fp8", sage))}
                cos = F.cosine_similarity(out.flatten().double(), ref.flatten().double(), dim=0).item()
                l1 = ((out - ref).abs().sum() / ref.abs().sum()).item()
                base = gpu_meta(variant="auto", head_dim=d, seq_len=n, batch=a.batch, heads=h, causal=causal)
                for name, ms in t.items():
                    recs.append(dict(base, kernel=name, metric="ms", value=ms))
                recs.append(dict(base, kernel="sage_int8_fp8", metric="speedup", value=t["sdpa_cudnn"] / t["sage_int8_fp8"]))
                recs.append(dict(base, kernel="sage_int8_fp8", metric="cos", value=cos))
                recs.append(dict(base, kernel="sage_int8_fp8", metric="rel_l1", value=l1))
                print(f"hd{d} causal={int(causal)} N={n:6d} B={a.batch} H={h}: SDPA {t['sdpa_cudnn']:.3f} ms, "
                      f"sage {t['sage_int8_fp8']:.3f} ms, speed-up {t['sdpa_cudnn'] / t['sage_int8_fp8']:.3f}x; "
                      f"cos {cos:.5f} rel-L1 {l1:.4f}", flush=True)
                del q, k, v, ref, out
                torch._dynamo.reset()
                write_records(a.out, recs)


if __name__ == "__main__":
    main()
