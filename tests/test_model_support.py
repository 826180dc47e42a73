"""Which models the backend accepts, and exact pre-RoPE recovery against transformers' tensors."""

from __future__ import annotations

import types

import pytest
import torch

from sas_backend.backend.model_checks import SASUnsupportedModel, check_model_supported, find_model_rope_table
from sas_backend.ops.rope import invert_rope, rope_cos_sin_table


def _cfg(arch, **kw):
    return types.SimpleNamespace(architectures=[arch], **kw)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_supported_families(arch):
    check_model_supported(_cfg(arch, use_sliding_window=False, sliding_window=4096))


@pytest.mark.parametrize(
    "cfg, needle",
    [
        (_cfg("DeepseekV3ForCausalLM", kv_lora_rank=512), "multi-head latent attention"),
        (_cfg("Qwen2ForCausalLM", use_sliding_window=True), "sliding-window"),
        (_cfg("Gemma3ForCausalLM", layer_types=["sliding_attention", "full_attention"]), "sliding-window"),
        (_cfg("MistralForCausalLM", sliding_window=4096), "sliding-window"),
        (_cfg("T5ForConditionalGeneration", is_encoder_decoder=True), "encoder-decoder"),
        (_cfg("GPT2LMHeadModel"), "not supported"),
    ],
)
def test_unsupported_models_are_refused(cfg, needle):
    with pytest.raises(SASUnsupportedModel, match=needle):
        check_model_supported(cfg)


def test_mla_runner_flag_is_refused():
    with pytest.raises(SASUnsupportedModel, match="latent"):
        check_model_supported(_cfg("LlamaForCausalLM"), use_mla=True)


def test_sglang_rope_table_matches_ours_and_is_found():
    """The table the backend undoes RoPE with is SGLang's own `cos_sin_cache` (CPU engine build)."""
    import subprocess
    import sys

    script = """
import torch
from sglang.srt.layers.rotary_embedding import get_rope
rope = get_rope(64, 64, 4096, 100000, is_neox_style=True, dtype=torch.float32)
model = torch.nn.Module(); model.rotary_emb = rope
from sas_backend.backend.model_checks import find_model_rope_table
torch.save(find_model_rope_table(model, 64).float(), sys_argv_out)
"""
    import os
    import tempfile

    out = os.path.join(tempfile.mkdtemp(), "table.pt")
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    subprocess.run([sys.executable, "-c", f"sys_argv_out = {out!r}\n" + script], env=env, check=True)
    table = torch.load(out)
    assert table.shape == (4096, 64)
    # Same formula; fp32 angle rounding at large positions differs by < 1e-4.
    torch.testing.assert_close(table, rope_cos_sin_table(64, 4096, 100000.0), atol=1e-4, rtol=0)
    fake = torch.nn.Module()
    fake.rotary_emb = torch.nn.Module()
    fake.rotary_emb.cos_sin_cache = table[:, :32]
    with pytest.raises(SASUnsupportedModel, match="partial rotary"):
        find_model_rope_table(fake, 64)


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=1000000.0,
    )
    return Qwen3ForCausalLM(cfg).eval()


def test_pre_rope_recovery_matches_transformers_qwen3():
    """Undoing RoPE on the post-RoPE q/k gives transformers' own post-q/k-norm, pre-RoPE tensors."""
    from transformers import AttentionInterface

    model = _tiny_qwen3()
    attn = model.model.layers[1].self_attn
    seen = {}
    attn.q_norm.register_forward_hook(lambda m, i, o: seen.__setitem__("q_pre", o.detach()))
    attn.k_norm.register_forward_hook(lambda m, i, o: seen.__setitem__("k_pre", o.detach()))

    def capture(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        if module is attn:
            seen["q_post"], seen["k_post"] = query.detach(), key.detach()
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2), None

    AttentionInterface.register("sas_capture_test", capture)
    model.set_attn_implementation("sas_capture_test")
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids)
    table = rope_cos_sin_table(16, 200, 1000000.0)
    q_pre = invert_rope(seen["q_post"][0].transpose(0, 1), table)  # [T, H, D]
    k_pre = invert_rope(seen["k_post"][0].transpose(0, 1), table)
    torch.testing.assert_close(q_pre, seen["q_pre"][0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(k_pre, seen["k_pre"][0], atol=2e-5, rtol=1e-5)
