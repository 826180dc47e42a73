"""Which models the backend accepts, and exact pre-RoPE recovery against transformers' tensors."""

from __future__ import annotations

import math
import types

import pytest
import torch

from sas_backend.backend.model_checks import SASUnsupportedModel, check_model_supported
from sas_backend.backend.rope_tables import check_rope_scaling, find_model_rope_table
from sas_backend.geometry import ARCHITECTURES, ModelGeometry, gate_rope_table
from sas_backend.ops.rope import apply_rope, invert_rope, rope_cos_sin_table


def _cfg(arch, **kw):
    return types.SimpleNamespace(architectures=[arch], **kw)


def _rope_geo(theta, scaling=None, head_dim=16):
    """A geometry that only its RoPE matters for."""
    return ModelGeometry(num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=head_dim, rope_theta=theta,
                         rope_scaling=scaling)


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


def test_unsupported_architecture_message_names_what_serving_supports():
    with pytest.raises(SASUnsupportedModel,
                       match=r"serving supports: LlamaForCausalLM \(Llama\), .*Qwen3MoeForCausalLM"):
        check_model_supported(_cfg("GPT2LMHeadModel"))


def test_one_table_says_what_is_served_and_trained():
    """Serving and training read one table; Qwen3-MoE is served but training refuses it, with a reason."""
    assert all(a.serve for a in ARCHITECTURES.values())
    assert [a.model_type for a in ARCHITECTURES.values() if a.train] == ["llama", "qwen2", "qwen3"]
    moe = ARCHITECTURES["Qwen3MoeForCausalLM"]
    assert not moe.train and "mixture-of-experts" in moe.train_refusal


def test_mla_runner_flag_is_refused():
    with pytest.raises(SASUnsupportedModel, match="latent"):
        check_model_supported(_cfg("LlamaForCausalLM"), use_mla=True)


# RoPE configurations checked against SGLang's own `get_rope` (the tiny Qwen3 below has head_dim 16,
# 256 positions; "original" context 64 so positions past it exercise the scaled bands).
TINY_THETA, TINY_MAX_POS, TINY_D, TINY_DG = 1000000.0, 256, 16, 8
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}

_SGLANG_TABLES = """
import torch
from sglang.srt.layers.rotary_embedding import get_rope
from sas_backend.backend.rope_tables import find_model_rotary
from sas_backend.backend.rope_tables import RopeTables
from sas_backend.geometry import ModelGeometry
out = {}
for name, sc in SCALINGS.items():
    for dim in (TINY_D, TINY_DG, 64):
        # max_position as SGLang's Qwen3/Llama pass it (the config's max_position_embeddings)
        rope = get_rope(dim, dim, TINY_MAX_POS, TINY_THETA, is_neox_style=True, rope_scaling=sc, dtype=torch.float32)
        out[name, dim] = rope.cos_sin_cache.clone()
# Runtime growth: SGLang replaces a YaRN module's table with a longer one; RopeTables follows it.
rope = get_rope(TINY_D, TINY_D, TINY_MAX_POS, TINY_THETA, rope_scaling=SCALINGS["yarn"], dtype=torch.float32)
model = torch.nn.Module(); model.rotary_emb = rope
geo = ModelGeometry(num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=TINY_D, rope_theta=TINY_THETA,
                    rope_scaling=SCALINGS["yarn"])
tables = RopeTables(find_model_rotary(model, TINY_D), TINY_DG, geo, "cpu")
before = (tables.max_pos, tables.version)
rope._ensure_cos_sin_cache_length(3 * TINY_MAX_POS)
out["grown"] = (before, tables.max_pos, tables.version, tables.model.clone(), rope.cos_sin_cache.clone(),
                tables.gate.clone())
torch.save(out, OUT)
"""


@pytest.fixture(scope="module")
def sglang_tables(tmp_path_factory):
    """Tables built by SGLang's `get_rope` (CPU engine build, own process) for every SCALINGS entry."""
    import os
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("rope") / "tables.pt"
    head = (
        f"OUT = {str(out)!r}\nSCALINGS = {SCALINGS!r}\nTINY_THETA, TINY_MAX_POS, TINY_D, TINY_DG = "
        f"{TINY_THETA!r}, {TINY_MAX_POS}, {TINY_D}, {TINY_DG}\n"
    )
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    subprocess.run([sys.executable, "-c", head + _SGLANG_TABLES], env=env, check=True)
    return torch.load(out)


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_gate_rope_table_is_sglangs_get_rope(sglang_tables, name):
    """Our single gate-table builder equals SGLang's `get_rope` table at any dim (the gate's
    table is the model's rotary formula on Dg dims), YaRN's mscale magnitude included."""
    for dim in (TINY_D, TINY_DG, 64):
        table = sglang_tables[name, dim]
        torch.testing.assert_close(rope_cos_sin_table(dim, table.shape[0], TINY_THETA, SCALINGS[name]), table,
                                   atol=1e-6, rtol=0)
    if name == "yarn":  # the magnitude really is there: cos^2 + sin^2 = mscale^2 = (0.1 ln 4 + 1)^2
        t = sglang_tables[name, TINY_D]
        mag = t[:, : TINY_D // 2] ** 2 + t[:, TINY_D // 2:] ** 2
        torch.testing.assert_close(mag, torch.full_like(mag, (0.1 * math.log(4.0) + 1) ** 2))


def test_rope_tables_follow_sglang_table_growth(sglang_tables):
    (len0, ver0), len1, ver1, model, cache, gate = sglang_tables["grown"]
    assert len1 > len0 and len1 >= 3 * TINY_MAX_POS and ver1 == ver0 + 1
    torch.testing.assert_close(model, cache, atol=0, rtol=0)  # the current table, not the startup one
    torch.testing.assert_close(gate, rope_cos_sin_table(TINY_DG, len1, TINY_THETA, SCALINGS["yarn"]), atol=1e-6, rtol=0)


def test_rope_tables_refill_in_place_on_same_length_replacement():
    """SGLang's `_match_cos_sin_cache_dtype` swaps in a bf16 copy: follow it without moving storage."""
    from sas_backend.backend.rope_tables import RopeTables

    rotary = torch.nn.Module()
    rotary.cos_sin_cache = rope_cos_sin_table(16, 100, 10000.0)
    tables = RopeTables(rotary, 8, _rope_geo(10000.0), "cpu")
    ptr, gate_ptr, version = tables.model.data_ptr(), tables.gate.data_ptr(), tables.version
    rotary.cos_sin_cache = rotary.cos_sin_cache.to(torch.bfloat16)
    assert tables.model.data_ptr() == ptr and tables.gate.data_ptr() == gate_ptr and tables.version == version
    torch.testing.assert_close(tables.model, rotary.cos_sin_cache.float(), atol=0, rtol=0)
    assert tables.model.dtype == torch.float32


def test_invert_rope_is_exact_for_a_scaled_table():
    table = rope_cos_sin_table(32, 300, 10000.0, SCALINGS["yarn"])  # mscale 1.139
    x = torch.randn(300, 3, 32, generator=torch.Generator().manual_seed(0))
    y = apply_rope(x, table)
    assert (y.norm() / x.norm()).item() == pytest.approx(0.1 * math.log(4.0) + 1, rel=1e-5)
    torch.testing.assert_close(invert_rope(y, table), x, atol=1e-5, rtol=1e-5)


def test_unknown_rope_scaling_is_refused():
    check_rope_scaling(SCALINGS["yarn"])
    with pytest.raises(SASUnsupportedModel, match="dynamic"):
        check_rope_scaling({"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(SASUnsupportedModel, match="longrope"):
        check_rope_scaling({"rope_type": "longrope", "short_factor": [1.0]})


def test_sglang_rope_table_is_found(sglang_tables):
    """The table the backend undoes RoPE with is the rotary module's `cos_sin_cache`."""
    table = sglang_tables["default", 64]
    model = torch.nn.Module()
    model.rotary_emb = torch.nn.Module()
    model.rotary_emb.cos_sin_cache = table
    assert find_model_rope_table(model, 64) is table
    model.rotary_emb.cos_sin_cache = table[:, :32]
    with pytest.raises(SASUnsupportedModel, match="partial rotary"):
        find_model_rope_table(model, 64)


def _tiny_qwen3(scaling=None):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    rope = {"rope_type": "default", "rope_theta": TINY_THETA}
    if scaling:
        rope = {**scaling, "rope_theta": TINY_THETA}
    cfg = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=TINY_D, max_position_embeddings=TINY_MAX_POS, rope_parameters=rope,
    )
    return Qwen3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("name", ["default", "yarn", "llama3"])
def test_pre_rope_recovery_matches_transformers_qwen3(sglang_tables, name):
    """Undoing RoPE on transformers' post-RoPE q/k with the table SGLang builds for the same config
    gives transformers' own post-q/k-norm, pre-RoPE tensors (YaRN: mscale undone exactly)."""
    from transformers import AttentionInterface

    model = _tiny_qwen3(SCALINGS[name])
    geo = ModelGeometry.from_hf_config(model.config)
    assert (geo.rope_scaling or None) == (None if SCALINGS[name] is None else SCALINGS[name])
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
    n = 200  # past original_max_position_embeddings (64): the interpolated bands are exercised
    ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids)
    table = sglang_tables[name, TINY_D][:n]
    q_pre = invert_rope(seen["q_post"][0].transpose(0, 1), table)  # [T, H, D]
    k_pre = invert_rope(seen["k_post"][0].transpose(0, 1), table)
    torch.testing.assert_close(q_pre, seen["q_pre"][0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(k_pre, seen["k_pre"][0], atol=2e-5, rtol=1e-5)
    # The gate table the factory builds for this model: the same formula on Dg dims.
    torch.testing.assert_close(gate_rope_table(TINY_DG, geo, n), sglang_tables[name, TINY_DG][:n], atol=1e-6, rtol=0)


def test_factory_refuses_a_gate_formula_that_misses_the_model_table(sglang_tables):
    """Startup cross-check: our formula at the model's head dim must reproduce SGLang's table."""
    from sas_backend.backend.rope_tables import check_gate_rope_formula

    yarn = sglang_tables["yarn", TINY_D]
    check_gate_rope_formula(yarn, _rope_geo(TINY_THETA, SCALINGS["yarn"]))
    check_gate_rope_formula(yarn.to(torch.bfloat16), _rope_geo(TINY_THETA, SCALINGS["yarn"]))  # CPU stores bf16
    with pytest.raises(SASUnsupportedModel, match="does not reproduce"):
        check_gate_rope_formula(yarn, _rope_geo(TINY_THETA))
