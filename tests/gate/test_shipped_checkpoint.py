"""The gate checkpoints shipped under gate_checkpoints/ load, fit the default model, carry their
training record, and are what the default serve command picks."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SHIPPED = REPO / "gate_checkpoints" / "smollm2-135m-instruct-sas"
MODEL_DIR = REPO / "models" / "SmolLM2-135M-Instruct"


def test_shipped_sas_gate_loads_and_records_its_training():
    from sas_backend.gate.checkpoint import load_gate_checkpoint, validate_for_model

    config, tensors = load_gate_checkpoint(SHIPPED)
    # SmolLM2-135M-Instruct: 30 layers, 9 query / 3 kv heads, head dim 64, RoPE theta 1e5
    validate_for_model(config, tensors, num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64,
                       block_size=64, gate_dim=128, rope_theta=100000.0)
    rec = config.training
    # Distilled last from cached dense features with no forced blocks: the target covers the first and the
    # recent blocks too, so the gate ranks them itself and serving it without them costs little (issue 24)
    assert rec["objective"] == "distill" and rec["distill_target"] == "mass"
    assert rec["budget"] == 2048 and rec["block_size"] == 64 and rec["top_k"] == 32
    assert (rec["sink_blocks"], rec["local_blocks"]) == (0, 0)
    assert rec["command"].startswith("python -m sas_backend.training.distill_cached ")
    assert rec["layers"] is None and rec["steps"] > 0 and rec["final_loss"] is not None and rec["heldout_kl"]
    caches = rec["data"]["caches"]
    assert {c["data"]["split"] for c in caches} == {"train"}
    assert {s for c in caches for s in c["data"]["sources"]} == {"@docs", "@essays", "@stdlib"}
    docs = next(c for c in caches if c["data"]["sources"] == ["@docs"])
    assert docs["data"]["corpus"]["manifest_sha256"] and docs["data"]["corpus"]["packages"]  # pinned Debian packages
    assert all(c["command"].startswith("python -m sas_backend.training.features ") for c in caches)
    assert "bench/gate_generalization.sh" in rec["reproduce"]
    # Every earlier stage is recorded under init, down to the seeded init (the stage-6 gate it started from
    # first: its last stage trained the 11 hardest layers)
    assert rec["init"]["training"]["layers"] == [7, 14, 17, 18, 20, 21, 22, 23, 24, 26, 29]
    stages, node = [], rec
    while "training" in node.get("init", {}):
        node = node["init"]["training"]
        stages.append(node["objective"])
    assert (stages == ["distill", "distill", "distill", "lm", "distill", "lm", "distill"]
            and node["init"]["seed"] == 0), stages
    assert not any(part.startswith("/") for part in rec["command"].split()), "the record names a machine path"


def test_shipped_gate_names_its_serve_defaults_and_why():
    """The serving record (what serve.sh serves: no budget flag) names the results it was chosen from,
    and they are committed."""
    from sas_backend.gate.checkpoint import load_gate_checkpoint

    config, _ = load_gate_checkpoint(SHIPPED)
    assert config.serve_defaults() == {"budget": 2048, "sink_blocks": 1, "local_blocks": 1}
    for path in config.serving["chosen_by"]:
        assert (REPO / path).is_file(), path


@pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="needs serve/prepare_model.py's model")
def test_default_serve_gate_is_the_shipped_one():
    out = subprocess.run([sys.executable, str(REPO / "serve" / "default_gate.py"), "--model", str(MODEL_DIR)],
                         capture_output=True, text=True, check=True, cwd=REPO)
    assert pathlib.Path(out.stdout.strip()).resolve() == SHIPPED.resolve()


QWEN_SHIPPED = REPO / "gate_checkpoints" / "qwen2.5-coder-0.5b-instruct-sas"
QWEN_MODEL_DIR = REPO / "models" / "Qwen2.5-Coder-0.5B-Instruct"


def test_shipped_qwen_gate_fits_the_second_model_and_records_its_training():
    """The gate for Qwen2.5-Coder-0.5B-Instruct: 24 layers, 14 query / 2 kv heads (G = 7), head dim 64,
    RoPE theta 1e6; distilled from 8K-token rows of cached dense features (the SmolLM2 recipe, longer rows)."""
    from sas_backend.gate.checkpoint import load_gate_checkpoint, validate_for_model

    config, tensors = load_gate_checkpoint(QWEN_SHIPPED)
    validate_for_model(config, tensors, num_layers=24, num_q_heads=14, num_kv_heads=2, head_dim=64,
                       block_size=64, gate_dim=128, rope_theta=1000000.0)
    rec = config.training
    assert rec["objective"] == "distill" and rec["distill_target"] == "mass"
    assert rec["seq_len"] == 8192 and rec["budget"] == 2048 and (rec["sink_blocks"], rec["local_blocks"]) == (1, 1)
    caches = rec["data"]["caches"]
    assert {c["data"]["split"] for c in caches} == {"train"}
    assert {c["data"]["seq_len"] for c in caches} == {8192}
    assert {s for c in caches for s in c["data"]["sources"]} == {"@essays", "@stdlib"}
    assert not any(part.startswith("/") for part in rec["command"].split()), "the record names a machine path"
    for path in config.serving["chosen_by"]:
        assert (REPO / path).is_file(), path
    # served with 4 prompt anchors: the 16K needle is recalled at every depth with them, 3/5 without
    # (bench/results/2026-11-28-prompt-anchors)
    assert config.serve_defaults() == {"budget": 2048, "sink_blocks": 1, "local_blocks": 1, "prompt_anchors": 4}


@pytest.mark.skipif(not (QWEN_MODEL_DIR / "config.json").is_file(),
                    reason="needs serve/prepare_model.py --model qwen2.5-coder-0.5b")
def test_default_serve_gate_for_the_second_model_is_its_shipped_one():
    out = subprocess.run([sys.executable, str(REPO / "serve" / "default_gate.py"), "--model", str(QWEN_MODEL_DIR)],
                         capture_output=True, text=True, check=True, cwd=REPO)
    assert pathlib.Path(out.stdout.strip()).resolve() == QWEN_SHIPPED.resolve()
