"""Bad input fails at startup with a message a user understands; bad requests don't stop serving."""

from __future__ import annotations

import shutil

import requests

from sas_backend.testing.server import complete, launch_expect_failure


def _fails_with(args, *needles):
    code, out = launch_expect_failure(backend="sas", extra_args=args, timeout=600)
    assert code != 0, out[-3000:]
    for needle in needles:
        assert needle in out, f"expected {needle!r} in the output:\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]  # a message, not a crash dump
    return out


def test_gate_for_another_model(tmp_path):
    from sas_backend.gate.checkpoint import init_gate_checkpoint

    other = tmp_path / "qwen-like-gate"
    geometry = {
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rope_theta": 1000000.0, "architectures": ["Qwen3ForCausalLM"], "_name_or_path": "Qwen/Qwen3-8B",
    }
    init_gate_checkpoint(other, geometry=geometry, seed=0, gate_dim=16)
    _fails_with(["--sas-gate", other], "36 layers", "30 layers", "8 kv heads", "3 kv heads")


def test_truncated_gate_file(seed_gate, tmp_path):
    broken = tmp_path / "truncated"
    shutil.copytree(seed_gate, broken)
    weights = broken / "gate.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    _fails_with(["--sas-gate", broken], str(weights))


def test_budget_not_a_multiple_of_block(seed_gate):
    _fails_with(["--sas-gate", seed_gate, "--sas-budget", "100"], "multiple of the block size 64", "100")


def test_wrong_page_size(seed_gate):
    _fails_with(["--sas-gate", seed_gate, "--page-size", "16"], "page size must equal", "--page-size 64")


def test_missing_gate():
    _fails_with([], "needs a gate checkpoint", "--sas-gate")


def test_request_longer_than_context_then_keeps_serving(essay_ids, sas_full_server):
    too_long = (essay_ids * 2)[:9000]  # the model's context is 8192
    r = requests.post(
        f"{sas_full_server.url}/v1/completions",
        json={"model": "default", "prompt": too_long, "max_tokens": 4},
        timeout=300,
    )
    assert r.status_code == 400, r.text
    # SGLang's refusal (tokenizer_manager: the input alone, or input + max_tokens) names the length it refused
    assert "context length" in r.text and "9000 tokens" in r.text, r.text
    out = complete(sas_full_server.url, "The capital of France is", max_tokens=4)
    assert out["choices"][0]["text"].strip()
    assert sas_full_server.alive()


def test_fp8_scales_file_that_sets_no_scales(seed_gate, tmp_path):
    """A --quantization-param-path file SGLang cannot use (here: scales for 10 of the model's 30 layers; SGLang
    logs it and would serve 1.0) is refused by name rather than served with the scales it meant to set."""
    import json

    scales = tmp_path / "kv_cache_scales.json"
    scales.write_text(json.dumps({"model_type": "llama", "kv_cache": {
        "dtype": "float8_e4m3fn", "scaling_factor": {"0": {str(layer): 4.0 for layer in range(10)}}}}))
    _fails_with(["--sas-gate", seed_gate, "--dtype", "float32", "--kv-cache-dtype", "fp8_e4m3",
                 "--quantization-param-path", scales], f"--quantization-param-path {scales} set no fp8 KV scales",
                "tp rank 0 of 1")
