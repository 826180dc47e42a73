"""The gate checkpoints shipped under gate_checkpoints/ load, fit the default model, carry their
training record, and are what the default serve command picks."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SHIPPED = REPO / "gate_checkpoints" / "smollm2-135m-instruct-sas-b512"
MODEL_DIR = REPO / "models" / "SmolLM2-135M-Instruct"


def test_shipped_sas_gate_loads_and_records_its_training():
    from sas_backend.gate.checkpoint import load_gate_checkpoint, validate_for_model

    config, tensors = load_gate_checkpoint(SHIPPED)
    # SmolLM2-135M-Instruct: 30 layers, 9 query / 3 kv heads, head dim 64, RoPE theta 1e5
    validate_for_model(config, tensors, num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64,
                       block_size=64, gate_dim=128, rope_theta=100000.0)
    rec = config.training
    # Trained under the one budget rule (K = budget // block, as served), by the SAS objective last
    assert rec["objective"] == "lm" and rec["budget"] == 512 and rec["block_size"] == 64 and rec["top_k"] == 8
    assert rec["command"].startswith("python -m sas_backend.training.train ")
    assert rec["steps"] > 0 and rec["final_loss"] is not None
    assert "@essays" in rec["data"]["sources"] and rec["data"]["split"] == "train"
    # Every earlier stage is recorded under init, down to the seeded init
    stages, node = [], rec
    while "training" in node.get("init", {}):
        node = node["init"]["training"]
        stages.append(node["objective"])
    assert stages[0] == "distill" and node["init"]["seed"] == 0, stages
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
