"""Gate checkpoints: canonical round trip, SeerAttention-R import, refusals, TP sharding, seeded init, CLIs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sas_backend.gate.gate_file import checkpoint_identity
from sas_backend.gate.checkpoint import (
    CANONICAL,
    SEERATTENTION_R,
    GateCheckpointError,
    detect_format,
    init_gate_checkpoint,
    init_gate_state,
    load_gate_checkpoint,
    save_gate_checkpoint,
    shard_for_tp,
    sha256_file,
    tp_kv_head_range,
    validate_for_geometry,
    validate_for_model,
)
from sas_backend.gate.config import KEY_TEMPLATE, GateConfig
from sas_backend.gate.module import AttnGate
from sas_backend.gate.tensors import flatten
from sas_backend.geometry import ModelGeometry

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Small geometry: 3 layers, 6 query / 3 kv heads (G = 2), head dim 16, gate dim 32, block 16.
GEOM = ModelGeometry(num_layers=3, num_q_heads=6, num_kv_heads=3, head_dim=16, rope_theta=10000.0,
                     max_position_embeddings=4096, architecture="Qwen3ForCausalLM", model_name="tiny-qwen3")
GATE_DIM = 32
BLOCK = 16


def _init(seed: int = 0, dtype=torch.float32):
    return init_gate_state(GEOM, seed=seed, gate_dim=GATE_DIM, block_size=BLOCK, dtype=dtype)


def _assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for layer in a:
        assert sorted(a[layer]) == sorted(b[layer])
        for name in a[layer]:
            assert a[layer][name].dtype == b[layer][name].dtype, (layer, name)
            assert torch.equal(a[layer][name], b[layer][name]), (layer, name)


def _hf_config(**over) -> dict:
    """A Qwen3-style HF config for GEOM (as in a SeerAttention-R AttnGates config.json)."""
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": GEOM.num_layers,
        "num_attention_heads": GEOM.num_q_heads,
        "num_key_value_heads": GEOM.num_kv_heads,
        "head_dim": GEOM.head_dim,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "torch_dtype": "bfloat16",
        "vocab_size": 1000,
        "base_model": "Qwen/Qwen3-tiny",
        "seerattn_gate_block_size": BLOCK,
        "seerattn_gate_hidden_size": GATE_DIM,
        "seerattn_q_head_pooling_type": "Qproj",
        "seerattn_k_seq_pooling_type": "Kmaxminavg",
        "seerattn_use_qk_norm": True,
        "seerattn_use_rope": True,
        "seerattn_loss_slice_ratio": 0.0,
    }
    cfg.update(over)
    return cfg


def _write_seer(d, tensors: dict, cfg: dict | None = None, extra: dict | None = None) -> str:
    """A SeerAttention-R directory: config.json + torch.save of the flat gate state dict."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg if cfg is not None else _hf_config(), f)
    flat = flatten(tensors)
    if extra:
        flat.update(extra)
    torch.save(flat, os.path.join(d, "attn_gate_weights.pth"))
    return str(d)


# ---- canonical round trip -------------------------------------------------------------------


def test_round_trip_canonical(tmp_path):
    config, tensors = _init(seed=3)
    written = save_gate_checkpoint(tmp_path / "g", config, tensors)
    assert sorted(os.listdir(tmp_path / "g")) == ["config.json", "gate.safetensors"]
    assert detect_format(tmp_path / "g") == CANONICAL
    loaded_cfg, loaded = load_gate_checkpoint(tmp_path / "g")
    _assert_same(tensors, loaded)
    assert loaded_cfg == config == written
    assert loaded_cfg.source == str(tmp_path / "g")

    raw = json.loads((tmp_path / "g" / "config.json").read_text())
    for key in ("seerattn_gate_block_size", "seerattn_gate_hidden_size", "seerattn_q_head_pooling_type",
                "seerattn_k_seq_pooling_type", "seerattn_use_qk_norm", "seerattn_use_rope", "base_model",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
                "torch_dtype", "training"):
        assert key in raw, key
    assert raw["seerattn_gate_block_size"] == BLOCK and raw["seerattn_gate_hidden_size"] == GATE_DIM
    assert raw["training"]["init"]["seed"] == 3

    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "g" / "gate.safetensors")))
    assert KEY_TEMPLATE.format(layer=2, name="attngate_linear_q.weight") in keys
    assert len(keys) == 4 * GEOM.num_layers


def test_save_from_attngate_modules_and_dtype(tmp_path):
    config, tensors = _init(seed=1)
    gates = {}
    for layer, sd in tensors.items():
        g = AttnGate(GEOM.num_kv_heads, GEOM.group_size, GEOM.head_dim, GATE_DIM)
        g.load_state_dict(sd)
        gates[layer] = g
    written = save_gate_checkpoint(tmp_path / "g", config, gates, dtype="bfloat16")
    assert written.torch_dtype == "bfloat16"
    cfg, loaded = load_gate_checkpoint(tmp_path / "g" / "gate.safetensors")  # a file inside works too
    assert cfg.torch_dtype == "bfloat16"
    for layer in tensors:
        for name, t in tensors[layer].items():
            assert torch.equal(loaded[layer][name], t.to(torch.bfloat16))
    # Loaded tensors go straight into an AttnGate.
    AttnGate(GEOM.num_kv_heads, GEOM.group_size, GEOM.head_dim, GATE_DIM).load_state_dict(loaded[0])


def test_save_refuses_wrong_shapes_and_nonfinite(tmp_path):
    config, tensors = _init()
    bad = {k: dict(v) for k, v in tensors.items()}
    bad[1]["attngate_linear_k.weight"] = torch.zeros(3, 40, GATE_DIM)
    with pytest.raises(GateCheckpointError,
                       match=r"layer 1 attngate_linear_k.weight has shape \[3, 40, 32\], expected \[3, 48, 32\]"):
        save_gate_checkpoint(tmp_path / "g", config, bad)
    assert not (tmp_path / "g" / "gate.safetensors").exists()
    bad = {k: dict(v) for k, v in tensors.items()}
    bad[2]["attngate_qnorm.weight"] = torch.full((GATE_DIM,), float("nan"))
    with pytest.raises(GateCheckpointError, match="layer 2 attngate_qnorm.weight has 32 non-finite"):
        save_gate_checkpoint(tmp_path / "g", config, bad)


def test_gate_config_refuses_unsupported_variants():
    with pytest.raises(GateCheckpointError, match="only 'Qproj'"):
        GateConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8, q_pooling="Qavgproj")
    with pytest.raises(GateCheckpointError, match="only 'Kmaxminavg'"):
        GateConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8, k_pooling="Kmax")
    with pytest.raises(GateCheckpointError, match="seerattn_use_qk_norm is false"):
        GateConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8, use_qk_norm=False)
    with pytest.raises(GateCheckpointError, match="seerattn_use_rope is false"):
        GateConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8, use_rope=False)


# ---- load failures --------------------------------------------------------------------------


def test_truncated_safetensors_names_the_file(tmp_path):
    config, tensors = _init()
    save_gate_checkpoint(tmp_path / "g", config, tensors)
    w = tmp_path / "g" / "gate.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(GateCheckpointError) as e:
        load_gate_checkpoint(tmp_path / "g")
    assert str(w) in str(e.value) and "safetensors" in str(e.value)
    w.write_bytes(data[:5])  # not even a header
    with pytest.raises(GateCheckpointError, match=str(w).replace("\\", "\\\\")):
        load_gate_checkpoint(tmp_path / "g")
    assert isinstance(e.value, ValueError)


def test_missing_files_and_bad_config(tmp_path):
    with pytest.raises(GateCheckpointError, match="no such gate checkpoint"):
        load_gate_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(GateCheckpointError, match="no gate weights found"):
        load_gate_checkpoint(tmp_path / "empty")
    config, tensors = _init()
    save_gate_checkpoint(tmp_path / "g", config, tensors)
    cfg_path = tmp_path / "g" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.unlink()
    with pytest.raises(GateCheckpointError, match=r"config\.json: no such file"):
        load_gate_checkpoint(tmp_path / "g")
    cfg_path.write_text("{not json")
    with pytest.raises(GateCheckpointError, match="cannot read JSON"):
        load_gate_checkpoint(tmp_path / "g")
    del cfg["head_dim"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(GateCheckpointError, match="lacks required key.*head_dim"):
        load_gate_checkpoint(tmp_path / "g")
    cfg["head_dim"] = GEOM.head_dim
    cfg["torch_dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(GateCheckpointError, match="tensors are float32 but .* says torch_dtype 'bfloat16'"):
        load_gate_checkpoint(tmp_path / "g")


def test_missing_and_extra_layers(tmp_path):
    config, tensors = _init()
    fewer = {k: v for k, v in tensors.items() if k != 1}
    with pytest.raises(GateCheckpointError, match=r"missing layer\(s\) 1 \(config says num_hidden_layers=3\)"):
        save_gate_checkpoint(tmp_path / "a", config, fewer)
    more = dict(tensors)
    more[3] = tensors[0]
    with pytest.raises(GateCheckpointError, match=r"unexpected layer\(s\) 3"):
        save_gate_checkpoint(tmp_path / "b", config, more)
    # Same through the SeerAttention-R reader (files written by someone else).
    d = _write_seer(tmp_path / "seer", fewer)
    with pytest.raises(GateCheckpointError, match=r"attn_gate_weights\.pth: .*missing layer\(s\) 1"):
        load_gate_checkpoint(d)


# ---- SeerAttention-R format -----------------------------------------------------------------


def test_seerattention_r_fixture_loads_and_converts(tmp_path):
    _, tensors = _init(seed=7, dtype=torch.bfloat16)  # published gates are bf16
    src = _write_seer(tmp_path / "seer", tensors)
    assert detect_format(src) == SEERATTENTION_R
    cfg, loaded = load_gate_checkpoint(src)
    _assert_same(tensors, loaded)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (3, 6, 3, 16)
    assert (cfg.block_size, cfg.gate_dim, cfg.torch_dtype) == (BLOCK, GATE_DIM, "bfloat16")
    assert cfg.base_model == "Qwen/Qwen3-tiny"
    assert cfg.training["source_format"] == "seerattention-r"
    assert cfg.training["seerattn"] == {"seerattn_loss_slice_ratio": 0.0}

    from sas_backend.gate.convert import convert

    ident = convert(src, str(tmp_path / "canon"))
    assert ident["format"] == CANONICAL and ident["base_model"] == "Qwen/Qwen3-tiny"
    cfg2, canon = load_gate_checkpoint(tmp_path / "canon")
    _assert_same(tensors, canon)
    assert cfg2.training["converted_from"]["format"] == SEERATTENTION_R


def test_seerattention_r_ddp_prefix_and_inferred_qk_norm(tmp_path):
    _, tensors = _init(seed=2)
    d = tmp_path / "seer"
    cfg = _hf_config()
    del cfg["seerattn_use_qk_norm"]  # older configs: inferred from the presence of the norm tensors
    _write_seer(d, tensors, cfg)
    flat = {"module." + k: v for k, v in flatten(tensors).items()}
    torch.save(flat, d / "attn_gate_weights.pth")
    c, loaded = load_gate_checkpoint(d)
    _assert_same(tensors, loaded)
    assert c.use_qk_norm is True and any("seerattn_use_qk_norm" in a for a in c.training["assumed_defaults"])


def test_seerattention_r_unsupported_variants_refused(tmp_path):
    _, tensors = _init()
    d = _write_seer(tmp_path / "a", tensors, _hf_config(seerattn_q_head_pooling_type="Qavgproj"))
    with pytest.raises(GateCheckpointError, match=r"config\.json: .*only 'Qproj'"):
        load_gate_checkpoint(d)
    d = _write_seer(tmp_path / "b", tensors, _hf_config(seerattn_use_qk_norm=False))
    with pytest.raises(GateCheckpointError, match="seerattn_use_qk_norm is false"):
        load_gate_checkpoint(d)
    d = _write_seer(tmp_path / "c", tensors, extra={"model.layers.0.self_attn.q_proj.weight": torch.zeros(2)})
    with pytest.raises(GateCheckpointError, match="1 key.* not gate tensors.*q_proj"):
        load_gate_checkpoint(d)


class _Evil:
    """An object whose unpickling would run code (create a file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pth_needing_arbitrary_pickle_is_refused(tmp_path):
    _, tensors = _init()
    marker = tmp_path / "pwned"
    d = _write_seer(tmp_path / "seer", tensors, extra={"evil": _Evil(str(marker))})
    with pytest.raises(GateCheckpointError) as e:
        load_gate_checkpoint(d)
    assert "weights_only" in str(e.value) and "attn_gate_weights.pth" in str(e.value)
    assert not marker.exists()


def test_truncated_pth_names_the_file(tmp_path):
    _, tensors = _init()
    d = _write_seer(tmp_path / "seer", tensors)
    p = os.path.join(d, "attn_gate_weights.pth")
    data = open(p, "rb").read()
    open(p, "wb").write(data[: len(data) // 3])
    with pytest.raises(GateCheckpointError, match="attn_gate_weights.pth"):
        load_gate_checkpoint(d)


# ---- fit to the served model ----------------------------------------------------------------


def test_validate_for_model_accepts_match():
    config, tensors = _init()
    validate_for_model(config, tensors, num_layers=3, num_q_heads=6, num_kv_heads=3, head_dim=16, block_size=BLOCK,
                       gate_dim=GATE_DIM, rope_theta=10000.0)


def test_validate_for_model_names_each_mismatch(tmp_path):
    config, tensors = _init()
    save_gate_checkpoint(tmp_path / "g", config, tensors)
    config, tensors = load_gate_checkpoint(tmp_path / "g")
    with pytest.raises(GateCheckpointError) as e:
        validate_for_model(config, tensors, num_layers=30, num_q_heads=6, num_kv_heads=2, head_dim=64,
                           block_size=BLOCK)
    msg = str(e.value)
    assert msg.startswith(f"gate checkpoint {tmp_path / 'g'} (base model tiny-qwen3) was made for ")
    assert ("was made for 3 layers / 3 kv heads / head dim 16; "
            "the served model has 30 layers / 2 kv heads / head dim 64") in msg

    with pytest.raises(GateCheckpointError, match=r"was made for block size 16; the served model has block size 64"):
        validate_for_model(config, tensors, num_layers=3, num_q_heads=6, num_kv_heads=3, head_dim=16, block_size=64)
    with pytest.raises(GateCheckpointError, match=r"6 query heads.*12 query heads"):
        validate_for_model(config, tensors, num_layers=3, num_q_heads=12, num_kv_heads=3, head_dim=16, block_size=BLOCK)
    with pytest.raises(GateCheckpointError, match=r"rope theta 10000.*rope theta 1e\+06"):
        validate_for_model(config, tensors, num_layers=3, num_q_heads=6, num_kv_heads=3, head_dim=16, block_size=BLOCK,
                           rope_theta=1e6)


def test_validate_for_model_checks_tensors_too():
    config, tensors = _init()
    bad = {k: dict(v) for k, v in tensors.items()}
    bad[0]["attngate_linear_q.weight"] = torch.zeros(3, 2, 8, GATE_DIM)
    with pytest.raises(GateCheckpointError, match="layer 0 attngate_linear_q.weight has shape"):
        validate_for_model(config, bad, num_layers=3, num_q_heads=6, num_kv_heads=3, head_dim=16, block_size=BLOCK)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


def test_validate_for_geometry_checks_the_rope():
    """The server's one fit check: a gate trained under another RoPE theta or scaling is refused,
    naming both; the same scaling spelled differently (`type`, 4 vs 4.0) is the same RoPE."""
    import dataclasses

    config, tensors = _init()
    validate_for_geometry(config, tensors, GEOM, block_size=BLOCK)
    with pytest.raises(GateCheckpointError, match=r"made for rope theta 10000; the served model has rope theta "
                                                  r"1e\+06 \(the gate rotates .*train a gate on this model\)"):
        validate_for_geometry(config, tensors, dataclasses.replace(GEOM, rope_theta=1e6), block_size=BLOCK)
    with pytest.raises(GateCheckpointError, match=r"made for rope scaling none; the served model has rope scaling "
                                                  r"\{factor: 4.0, .*rope_type: 'yarn'\}"):
        validate_for_geometry(config, tensors, dataclasses.replace(GEOM, rope_scaling=YARN), block_size=BLOCK)

    yarn_gate = dataclasses.replace(config, rope_scaling=YARN)
    same = {"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024, "rope_theta": 10000.0}
    validate_for_geometry(yarn_gate, tensors, dataclasses.replace(GEOM, rope_scaling=same), block_size=BLOCK)
    with pytest.raises(GateCheckpointError, match="rope scaling"):
        validate_for_geometry(yarn_gate, tensors, dataclasses.replace(GEOM, rope_scaling={**YARN, "factor": 8.0}),
                              block_size=BLOCK)
    with pytest.raises(GateCheckpointError, match="block size 16; the served model has block size 64"):
        validate_for_geometry(config, tensors, GEOM, block_size=64)
    # a checkpoint that records no RoPE (SeerAttention-R configs may not) is not judged on it
    validate_for_geometry(dataclasses.replace(config, rope_theta=None), tensors,
                          dataclasses.replace(GEOM, rope_theta=1e6, rope_scaling=YARN), block_size=BLOCK)


def _load_default_gate():
    import importlib.util

    spec = importlib.util.spec_from_file_location("default_gate", os.path.join(REPO, "serve", "default_gate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_default_gate_picks_only_a_fitting_checkpoint(tmp_path):
    """serve/default_gate.py uses the server's check: block size and RoPE count, not only the shapes."""
    import dataclasses
    import pathlib

    default_gate = _load_default_gate()
    config, tensors = _init()
    save_gate_checkpoint(tmp_path / "a-distill", dataclasses.replace(config, training={"objective": "distill"}),
                         tensors)
    save_gate_checkpoint(tmp_path / "b-sas", dataclasses.replace(config, training={"objective": "lm"}), tensors)
    root = pathlib.Path(tmp_path)
    assert default_gate.shipped_gate(GEOM, BLOCK, root) == root / "b-sas"  # SAS-trained first
    assert default_gate.shipped_gate(GEOM, 64, root) is None  # another block size
    assert default_gate.shipped_gate(dataclasses.replace(GEOM, rope_theta=5e5), BLOCK, root) is None
    assert default_gate.shipped_gate(dataclasses.replace(GEOM, num_kv_heads=1, num_q_heads=2), BLOCK, root) is None


def test_sha256_file(tmp_path):
    import hashlib

    p = tmp_path / "blob"
    p.write_bytes(bytes(range(256)) * 5000)  # > one read chunk
    assert sha256_file(p) == hashlib.sha256(p.read_bytes()).hexdigest()


def test_geometry_from_hf_configs():
    g = ModelGeometry.from_hf_config(_hf_config())
    assert (g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim, g.rope_theta) == (3, 6, 3, 16, 10000.0)
    assert g.group_size == 2 and g.architecture == "Qwen3ForCausalLM" and g.rope_scaling is None
    # transformers 5 style: rope_parameters only, no head_dim.
    v5 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
          "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "architectures": ["LlamaForCausalLM"]}
    g = ModelGeometry.from_hf_config(v5)
    assert (g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim, g.rope_theta) == (30, 9, 3, 64, 100000.0)
    assert g.rope_scaling is None
    scaled = dict(v5, rope_parameters={"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0})
    g = ModelGeometry.from_hf_config(scaled)
    assert g.rope_theta == 5e5 and g.rope_scaling == {"rope_type": "llama3", "factor": 8.0}


# ---- tensor parallelism ---------------------------------------------------------------------


def test_shard_for_tp_slices_kv_heads():
    _, tensors = _init(seed=5)
    same = shard_for_tp(tensors, 0, 1)
    _assert_same(tensors, same)

    shards = [shard_for_tp(tensors, r, 3) for r in range(3)]
    for layer in tensors:
        for name in ("attngate_linear_q.weight", "attngate_linear_k.weight"):
            for r, s in enumerate(shards):
                assert s[layer][name].shape[0] == 1
                assert torch.equal(s[layer][name][0], tensors[layer][name][r])
            assert torch.equal(torch.cat([s[layer][name] for s in shards]), tensors[layer][name])
        for name in ("attngate_qnorm.weight", "attngate_knorm.weight"):
            assert all(torch.equal(s[layer][name], tensors[layer][name]) for s in shards)


def test_shard_for_tp_replicated_and_partition():
    _, tensors = _init(seed=5)
    # tp 6 > 3 kv heads: each kv head replicated on 2 ranks, rank r holds head r * 3 // 6.
    for r in range(6):
        s = shard_for_tp(tensors, r, 6)
        assert s[0]["attngate_linear_k.weight"].shape == (1, 3 * GEOM.head_dim, GATE_DIM)
        assert torch.equal(s[0]["attngate_linear_q.weight"][0], tensors[0]["attngate_linear_q.weight"][r // 2])
    assert [tp_kv_head_range(3, r, 6) for r in range(6)] == [(0, 1), (0, 1), (1, 1), (1, 1), (2, 1), (2, 1)]
    assert [tp_kv_head_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    with pytest.raises(GateCheckpointError, match="3 kv heads do not divide over tensor-parallel size 2"):
        shard_for_tp(tensors, 0, 2)
    with pytest.raises(GateCheckpointError, match="not a multiple of the 3 kv heads"):
        shard_for_tp(tensors, 0, 4)
    with pytest.raises(GateCheckpointError, match="invalid tensor-parallel rank"):
        shard_for_tp(tensors, 3, 3)


# ---- seeded init, identity ------------------------------------------------------------------


def test_seeded_init_is_deterministic_and_leaves_global_rng(tmp_path):
    state = torch.get_rng_state()
    _, a = _init(seed=11)
    assert torch.equal(state, torch.get_rng_state())
    _, b = _init(seed=11)
    _, c = _init(seed=12)
    _assert_same(a, b)
    assert not torch.equal(a[0]["attngate_linear_q.weight"], c[0]["attngate_linear_q.weight"])
    assert not torch.equal(a[0]["attngate_linear_q.weight"], a[1]["attngate_linear_q.weight"])
    assert torch.equal(a[0]["attngate_qnorm.weight"], torch.ones(GATE_DIM))
    # Same as driving AttnGate.reset_parameters by hand with one generator over the layers.
    gen = torch.Generator().manual_seed(11)
    for layer in range(GEOM.num_layers):
        g = AttnGate(GEOM.num_kv_heads, GEOM.group_size, GEOM.head_dim, GATE_DIM)
        g.reset_parameters(generator=gen)
        for name, t in g.state_dict().items():
            assert torch.equal(t, a[layer][name])

    ia = init_gate_checkpoint(tmp_path / "a", geometry=GEOM, seed=11, gate_dim=GATE_DIM, block_size=BLOCK)
    init_gate_checkpoint(tmp_path / "b", geometry=_hf_config(), seed=11, gate_dim=GATE_DIM, block_size=BLOCK)
    assert ia.training["init"]["seed"] == 11
    id_a, id_b = checkpoint_identity(tmp_path / "a"), checkpoint_identity(tmp_path / "b")
    assert id_a["sha256"] == id_b["sha256"]
    assert len(id_a["sha256"]) == 64
    assert id_a["format"] == CANONICAL and id_a["weights_file"] == "gate.safetensors" and id_a["layers"] == 3
    assert id_a["training"]["init"]["seed"] == 11


# ---- CLIs -----------------------------------------------------------------------------------


def _run(*args):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=300)


def test_convert_cli(tmp_path, capsys):
    _, tensors = _init(seed=4, dtype=torch.bfloat16)
    src = _write_seer(tmp_path / "seer", tensors)
    # The real command line, in a subprocess (torch import makes each one take seconds, so only one).
    r = _run("sas_backend.gate.convert", src, str(tmp_path / "out"), "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "gate.safetensors" in r.stdout and "float32" in r.stdout
    cfg, loaded = load_gate_checkpoint(tmp_path / "out")
    assert cfg.torch_dtype == "float32"
    for layer in tensors:
        for name, t in tensors[layer].items():
            assert torch.equal(loaded[layer][name], t.float())

    from sas_backend.gate.convert import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "SRC" in capsys.readouterr().out.upper()
    # Refuses to overwrite without --force; canonical -> canonical re-save with --dtype.
    assert main([src, str(tmp_path / "out")]) == 1
    assert "--force" in capsys.readouterr().err
    assert main([str(tmp_path / "out"), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    _, again = load_gate_checkpoint(tmp_path / "bf16")
    _assert_same(tensors, again)
    # A broken source is a clear one-line error, not a traceback.
    assert main([str(tmp_path / "missing"), str(tmp_path / "x")]) == 1
    assert "no such gate checkpoint" in capsys.readouterr().err


def test_init_cli(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(_hf_config()))
    r = _run("sas_backend.gate.init", "--model", str(model), "--seed", "11", "--gate-dim", str(GATE_DIM),
             "--block-size", str(BLOCK), str(tmp_path / "g"))
    assert r.returncode == 0, r.stderr
    assert "seed 11" in r.stdout
    _, loaded = load_gate_checkpoint(tmp_path / "g")
    _, ref = _init(seed=11)
    _assert_same(ref, loaded)


@pytest.mark.skipif(not os.path.isfile(os.path.join(REPO, "models", "SmolLM2-135M-Instruct", "config.json")),
                    reason="run serve/prepare_model.py first")
def test_prepared_model_geometry(tmp_path):
    d = os.path.join(REPO, "models", "SmolLM2-135M-Instruct")
    g = ModelGeometry.from_model_dir(d)
    assert (g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim, g.rope_theta) == (30, 9, 3, 64, 100000.0)
    cfg = init_gate_checkpoint(tmp_path / "g", model_dir=d, seed=0)
    c, t = load_gate_checkpoint(tmp_path / "g")
    validate_for_model(c, t, num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=64,
                       rope_theta=g.rope_theta)
    assert cfg.base_model == g.model_name


def test_serving_record_gives_the_serve_defaults(tmp_path):
    """`serving` in config.json is what the server uses when the launch names no budget or
    forced blocks; without it the training budget serves, unless the gate was trained with
    another K than budget // b (the old rule); a bad record is refused at load."""
    config, tensors = _init(seed=0)
    config.training = {"budget": 512, "top_k": 512 // BLOCK}
    assert config.serve_defaults() == {"budget": 512}
    config.training = {"budget": 512, "top_k": 512 // BLOCK - 1}  # the old rule: serving 512 would change K
    assert config.serve_defaults() == {}
    config.serving = {"budget": 4 * BLOCK, "sink_blocks": 1, "local_blocks": 2, "chosen_by": "bench/results/x.json"}
    save_gate_checkpoint(tmp_path / "g", config, tensors)
    loaded, _ = load_gate_checkpoint(tmp_path / "g")
    assert loaded.serving == config.serving
    assert loaded.serve_defaults() == {"budget": 4 * BLOCK, "sink_blocks": 1, "local_blocks": 2}
    from sas_backend.gate.gate_file import serve_defaults_of

    assert serve_defaults_of(tmp_path / "g") == loaded.serve_defaults()  # from config.json alone
    raw = json.loads((tmp_path / "g" / "config.json").read_text())
    raw["serving"]["sub_blocks"] = 4  # a record may choose sub-block summaries too
    (tmp_path / "g" / "config.json").write_text(json.dumps(raw))
    assert serve_defaults_of(tmp_path / "g")["sub_blocks"] == 4
    raw["serving"]["exact_rerank"] = 2  # and two levels (--sas-exact-rerank)
    (tmp_path / "g" / "config.json").write_text(json.dumps(raw))
    assert serve_defaults_of(tmp_path / "g")["exact_rerank"] == 2

    raw = json.loads((tmp_path / "g" / "config.json").read_text())
    for serving, needle in (({"budget": 100}, "multiple of the block size"),
                            ({"budget": 2 * BLOCK, "sink_blocks": 2, "local_blocks": 1}, "exceed"),
                            ({"local_blocks": -1}, "non-negative"), ([512], "JSON object"),
                            ({"sub_blocks": 3}, "power of two dividing"), ({"exact_rerank": 0}, "exact_rerank must be"),
                            ({"exact_rerank": -1}, "non-negative")):
        raw["serving"] = serving
        (tmp_path / "g" / "config.json").write_text(json.dumps(raw))
        with pytest.raises(GateCheckpointError, match=needle):
            load_gate_checkpoint(tmp_path / "g")
