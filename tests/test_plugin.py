"""The plugin entry point: backend choice, `--sas-*` flags -> env, page size, early refusals."""

from __future__ import annotations

import os

import pytest

from sas_backend.config import SASConfig, SASConfigError

MODEL = os.path.join(os.path.dirname(__file__), "..", "models", "SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def parse(tmp_path_factory):
    """`prepare_server_args` with the sas plugin loaded, as `launch_server` runs it."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()

    def run(*argv):
        return prepare_server_args(["--model-path", MODEL, *map(str, argv)])

    return run


@pytest.fixture()
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("SAS_"):
            monkeypatch.delenv(k)
    yield monkeypatch


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    from sas_backend.gate.checkpoint import init_gate_checkpoint

    out = tmp_path_factory.mktemp("g") / "gate"
    init_gate_checkpoint(out, model_dir=MODEL, seed=0)
    return out


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("sas") == "sas_backend.plugin:register"


def test_sas_is_a_backend_choice(parse):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    assert "sas" in ATTENTION_BACKEND_CHOICES
    assert "sas" in ATTENTION_BACKENDS


def test_flags_set_env_and_page_size(parse, clean_env, gate):
    args = parse("--attention-backend", "sas", "--sas-gate", gate, "--sas-budget", "512", "--sas-sink-blocks", "1")
    assert args.page_size == 64
    cfg = SASConfig.from_env()
    assert (cfg.gate_path, cfg.budget, cfg.sink_blocks, cfg.top_k) == (str(gate), 512, 1, 8)


def test_flag_wins_over_env(parse, clean_env, gate):
    clean_env.setenv("SAS_BUDGET", "1024")
    clean_env.setenv("SAS_LOCAL_BLOCKS", "2")
    parse("--attention-backend", "sas", "--sas-gate", gate, "--sas-budget", "256")
    cfg = SASConfig.from_env()
    assert cfg.budget == 256 and cfg.local_blocks == 2  # flag beat env; env beat default


def test_other_backends_keep_their_page_size(parse, clean_env):
    assert parse("--attention-backend", "torch_native").page_size in (None, 1)
    assert parse("--attention-backend", "torch_native", "--page-size", "16").page_size == 16


def test_explicit_matching_page_size_is_accepted(parse, clean_env, gate):
    assert parse("--attention-backend", "sas", "--sas-gate", gate, "--page-size", "64").page_size == 64


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--sas-budget", "100"], "multiple of the block size 64"),
        (["--page-size", "16"], "--page-size 64"),
        (["--sas-sink-blocks", "20", "--sas-budget", "512"], "exceed"),
        (["--speculative-algorithm", "EAGLE"], "speculative decoding"),
    ],
)
def test_refusals_are_messages(parse, clean_env, gate, argv, needle):
    with pytest.raises(SystemExit) as e:
        parse("--attention-backend", "sas", "--sas-gate", gate, *argv)
    assert needle in str(e.value)


def test_missing_gate_dir_is_refused(parse, clean_env, tmp_path):
    with pytest.raises(SystemExit) as e:
        parse("--attention-backend", "sas", "--sas-gate", tmp_path / "nope")
    assert "does not exist" in str(e.value)


def test_config_validation_rules():
    with pytest.raises(SASConfigError, match="power of two"):
        SASConfig(gate_path="x", block_size=48).validate()
    with pytest.raises(SASConfigError, match="needs a gate"):
        SASConfig().validate()
    with pytest.raises(SASConfigError, match="not an integer"):
        SASConfig.from_env({"SAS_BUDGET": "lots"})
    cfg = SASConfig(gate_path="g", budget=2048)
    assert cfg.validate().top_k == 32
    assert SASConfig.from_env(cfg.to_env()) == cfg
