"""An ordinary diffusers script (nothing here knows about sage_compile): a CogVideoX pipeline with random
weights (2 layers at CogVideoX-2B's width, or a tiny config) whose transformer goes through a plain
``torch.compile``, 3 denoising steps with classifier-free guidance; saves the latents.

    python benchmarks/pipeline_cogvideox.py cuda 0 latents.pt              # as is
    SAGE_COMPILE=1 SAGE_COMPILE_KERNEL=int8_fp8 python benchmarks/pipeline_cogvideox.py cuda 0 latents.pt

``benchmarks/robustness.py`` (item ``pipeline``) and ``tests/test_backend.py`` run it both ways.
"""
import sys

import torch
from diffusers import CogVideoXDDIMScheduler, CogVideoXPipeline, CogVideoXTransformer3DModel

dev, tiny, out = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
torch.manual_seed(0)
cfg = dict(num_attention_heads=30, attention_head_dim=64, num_layers=2, sample_frames=9, sample_height=30,
           sample_width=44, text_embed_dim=4096, time_embed_dim=512)
if tiny:
    cfg.update(num_attention_heads=2, attention_head_dim=32, num_layers=1, sample_height=8, sample_width=8,
               text_embed_dim=32, time_embed_dim=16)
transformer = CogVideoXTransformer3DModel(**cfg).to(dev, torch.bfloat16).eval()
pipe = CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer,
                         scheduler=CogVideoXDDIMScheduler())
pipe.transformer = torch.compile(pipe.transformer)
emb = torch.randn(1, 226, cfg["text_embed_dim"], generator=torch.Generator().manual_seed(1)).to(dev, torch.bfloat16)
with torch.no_grad():
    lat = pipe(prompt_embeds=emb, negative_prompt_embeds=torch.zeros_like(emb), num_frames=9,
               height=8 * cfg["sample_height"], width=8 * cfg["sample_width"], num_inference_steps=3,
               output_type="latent", generator=torch.Generator().manual_seed(2)).frames
torch.save(lat.float().cpu(), out)
