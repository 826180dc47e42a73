"""`gate_file.open_gate`: the serving path reads each part of a gate checkpoint once per process (config.json,
the weights, their hash), config-only readers read no tensor, and a checkpoint rewritten in place is read anew."""

from __future__ import annotations

import pytest
import torch

import sas_backend.gate.checkpoint as checkpoint
import sas_backend.gate.gate_file as gate_file
from sas_backend.config import SASConfig
from sas_backend.gate.checkpoint import init_gate_checkpoint
from sas_backend.gate.config import GateConfig
from sas_backend.geometry import ModelGeometry

GEOM = ModelGeometry(num_layers=3, num_q_heads=6, num_kv_heads=3, head_dim=16, rope_theta=10000.0,
                     max_position_embeddings=4096)


@pytest.fixture
def reads(monkeypatch):
    """Counts of the reads: {"weights": n, "config": n, "hash": n}."""
    counts = {"weights": 0, "config": 0, "hash": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(checkpoint, "_load_safetensors", counted("weights", checkpoint._load_safetensors))
    monkeypatch.setattr(gate_file, "sha256_file", counted("hash", gate_file.sha256_file))
    monkeypatch.setattr(GateConfig, "load_json", staticmethod(counted("config", GateConfig.load_json)))
    gate_file._open.cache_clear()
    return counts


def _gate(path, seed=0):
    init_gate_checkpoint(path, geometry=GEOM, seed=seed, gate_dim=32, block_size=16)
    return path


def test_a_launch_reads_each_part_once(tmp_path, reads):
    path = _gate(tmp_path / "g")
    gate_file._open.cache_clear()
    reads.update(weights=0, config=0, hash=0)
    # What the launcher and a scheduler ask of it, in the order they ask.
    cfg = SASConfig(gate_path=str(path))
    cfg.resolved(), cfg.origins(), gate_file.read_training_record(path)  # serving and training records
    assert reads == {"weights": 0, "config": 1, "hash": 0}  # config.json alone so far
    assert gate_file.open_gate(path).config.gate_dim == 32  # memory sizing: config.json only
    assert reads["weights"] == 0
    config, tensors = gate_file.open_gate(path).loaded()  # the plugin's fit check
    identity = gate_file.checkpoint_identity(path)  # /sas/info
    assert gate_file.weights_sha256(path) == identity["sha256"]  # the factory's hash
    again = gate_file.open_gate(path).loaded()  # the factory's load
    assert again[1] is tensors and reads == {"weights": 1, "config": 1, "hash": 1}, reads
    assert identity["layers"] == 3 and identity["gate_dim"] == 32


def test_released_tensors_are_read_again_only_when_asked(tmp_path, reads):
    path = _gate(tmp_path / "g")
    gate_file._open.cache_clear()
    reads.update(weights=0, config=0, hash=0)
    gf = gate_file.open_gate(path)
    gf.loaded()
    gf.release_tensors()
    assert gf.sha256 and gf.config.num_hidden_layers == 3 and reads["weights"] == 1
    gf.loaded()
    assert reads["weights"] == 2


def test_a_checkpoint_rewritten_in_place_is_a_new_object(tmp_path):
    path = _gate(tmp_path / "g", seed=0)
    first = gate_file.open_gate(path)
    w0, h0 = first.tensors[0]["attngate_linear_q.weight"].clone(), first.sha256
    assert gate_file.open_gate(path) is first
    _gate(path, seed=1)  # a training run writing its output again
    second = gate_file.open_gate(path)
    assert second is not first and second.sha256 != h0 and first.sha256 == h0  # first keeps what it read
    assert not torch.equal(second.tensors[0]["attngate_linear_q.weight"], w0)
