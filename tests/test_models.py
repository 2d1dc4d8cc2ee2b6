"""Tiny diffusers and transformers models built from configs (no downloads): every attention layer is
replaced, and the compiled output matches eager within the scheme's tolerance.

Inductor compiles are expensive on 2 CPU cores, so most models go through the same rewrite with
``compiler="eager"``; Flux and Llama also go through Inductor (the real hand-off)."""
import pytest
import torch
from helpers import cos_rel
from torch._dynamo.utils import counters

import sage_compile
from sage_compile import debug

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")


def _flux():
    m = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    inp = dict(hidden_states=torch.randn(1, 16, 4), encoder_hidden_states=torch.randn(1, 48, 32),
               pooled_projections=torch.randn(1, 32), img_ids=torch.randn(16, 3), txt_ids=torch.randn(48, 3),
               timestep=torch.tensor([1.0]))
    return m, inp, 2


def _sd3():
    m = diffusers.SD3Transformer2DModel(sample_size=32, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8,
                                        num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
                                        pooled_projection_dim=64, out_channels=4, pos_embed_max_size=96,
                                        dual_attention_layers=(), qk_norm=None)
    inp = dict(hidden_states=torch.randn(2, 4, 8, 8), encoder_hidden_states=torch.randn(2, 16, 32),
               pooled_projections=torch.randn(2, 64), timestep=torch.randint(0, 1000, (2,)))
    return m, inp, 1


def _cogvideox():
    m = diffusers.CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                              time_embed_dim=2, text_embed_dim=8, num_layers=1, sample_width=8,
                                              sample_height=8, sample_frames=8, patch_size=2, patch_size_t=None,
                                              temporal_compression_ratio=4, max_text_seq_length=8)
    inp = dict(hidden_states=torch.randn(2, 1, 4, 8, 8), encoder_hidden_states=torch.randn(2, 8, 8),
               timestep=torch.randint(0, 1000, (2,)))
    return m, inp, 1


def _hunyuan():
    m = diffusers.HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10,
                                                 num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=1,
                                                 patch_size_t=1, guidance_embeds=True, text_embed_dim=16,
                                                 pooled_projection_dim=8, rope_axes_dim=(2, 4, 4), image_condition_type=None)
    mask = torch.ones(1, 12)
    mask[:, 9:] = 0  # padded text tokens: a real bool mask
    inp = dict(hidden_states=torch.randn(1, 4, 1, 16, 16), timestep=torch.tensor([3.0]),
               encoder_hidden_states=torch.randn(1, 12, 16), pooled_projections=torch.randn(1, 8),
               encoder_attention_mask=mask, guidance=torch.tensor([2.0]))
    return m, inp, 3


def _ltx():
    m = diffusers.LTXVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                             cross_attention_dim=16, num_layers=1, qk_norm="rms_norm_across_heads",
                                             caption_channels=16)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, 10:] = False
    inp = dict(hidden_states=torch.randn(2, 2 * 16 * 16, 4), encoder_hidden_states=torch.randn(2, 16, 16),
               timestep=torch.randint(0, 1000, (2,)), encoder_attention_mask=mask, num_frames=2, height=16, width=16)
    return m, inp, 2


def _wan():
    m = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                        out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=1,
                                        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    inp = dict(hidden_states=torch.randn(1, 4, 2, 16, 16), encoder_hidden_states=torch.randn(1, 12, 16),
               timestep=torch.randint(0, 1000, (1,)))
    return m, inp, 2


def _llm(cls_cfg, cls_model):
    cfg = cls_cfg(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, use_cache=False, attn_implementation="sdpa")
    m = cls_model(cfg)
    ids = torch.randint(0, 128, (2, 24))
    am = torch.ones(2, 24, dtype=torch.long)
    am[1, :5] = 0  # left padding
    return m, dict(input_ids=ids, attention_mask=am), 2


MODELS = {
    "flux": _flux, "sd3": _sd3, "cogvideox": _cogvideox, "hunyuanvideo": _hunyuan, "ltx": _ltx, "wan": _wan,
    "llama": lambda: _llm(transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": lambda: _llm(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}


def _out(o):
    if hasattr(o, "sample"):
        return o.sample
    if hasattr(o, "logits"):
        return o.logits
    return o[0] if isinstance(o, tuple) else o


def _valid(ref, inp):
    """Rows of LLM logits whose query is a real token (padded queries are undefined in every backend)."""
    if "attention_mask" in inp:
        return inp["attention_mask"].bool()
    return ...


@pytest.mark.parametrize("name", list(MODELS))
def test_model_sites_replaced_and_output_matches(name):
    torch.manual_seed(0)
    model, inp, n_attn = MODELS[name]()
    model.eval()
    compiler = "inductor" if name in ("flux", "llama") else "eager"
    debug.clear_reports()
    with torch.no_grad():
        ref = _out(model(**inp))
        out = _out(torch.compile(model, backend=sage_compile.make_backend(compiler=compiler, kernel="int8_fp8"))(**inp))
    report = "\n".join(debug.format_report(r) for r in debug.last_reports())
    c = counters["sage_compile"]
    assert c["sites"] == n_attn and c["replaced"] == n_attn, report
    rows = [r for rep in debug.last_reports() for r in rep]
    if name in ("llama", "qwen2"):
        assert all(r["gqa"] == "4/2" and r["mask"] == "bool" for r in rows), report  # repeat_kv undone
    if name in ("flux", "wan", "ltx"):
        assert any(r["layout"] == "NHD" for r in rows), report
    sel = _valid(ref, inp)
    cos, rel = cos_rel(out[sel].float(), ref[sel].float())
    assert torch.isfinite(out[sel]).all()
    assert cos >= 0.999 and rel <= 0.05, (cos, rel, report)


def test_llm_in_training_keeps_exact_and_trains():
    """Until SageBwd lands, sites needing gradients stay exact SDPA: gradients equal eager's."""
    torch.manual_seed(0)
    model, inp, n = MODELS["llama"]()
    model.train()
    model.config.attention_dropout = 0.0
    ref_loss = model(**inp, labels=inp["input_ids"]).loss
    ref_loss.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    debug.clear_reports()
    cm = torch.compile(model, backend=sage_compile.make_backend(kernel="int8_fp8"))
    loss = cm(**inp, labels=inp["input_ids"]).loss
    loss.backward()
    rows = [r for rep in debug.last_reports() for r in rep]
    assert len(rows) == n and all(r["decision"] == "kept" and "gradients needed" in r["reason"] for r in rows)
    assert torch.allclose(loss, ref_loss, atol=1e-5)
    for p, g in zip(model.parameters(), ref_grads):
        assert torch.allclose(p.grad, g, atol=1e-4, rtol=1e-3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()
    assert cm(**inp, labels=inp["input_ids"]).loss < loss


def test_training_with_int8_train_uses_sagebwd():
    """kernel="int8_train": training sites run SageBwd; gradients close to exact, the model trains."""
    torch.manual_seed(0)
    model = sage_compile.models.TinyLlama(dim=64, heads=4, kv_heads=2, depth=2)
    ids = torch.randint(0, 512, (2, 48))

    def loss_of(m):
        logits = m(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    ref = loss_of(model)
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    debug.clear_reports()
    cm = torch.compile(model, backend=sage_compile.make_backend(kernel="int8_train"))
    loss = cm(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(loss.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    rows = [r for rep in debug.last_reports() for r in rep]
    assert len(rows) == 2 and all(r["decision"] == "int8_train" for r in rows), rows
    assert abs(loss.item() - ref.item()) < 0.01 * ref.item()
    g = torch.cat([p.grad.flatten() for p in model.parameters()])
    w = torch.cat([x.flatten() for x in ref_grads])
    assert torch.nn.functional.cosine_similarity(g, w, dim=0) > 0.995
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.step()
    after = torch.nn.functional.cross_entropy(cm(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    assert after < loss
