"""A Qwen3 served by `sas` (the SAS paper's model family: q/k RMSNorm before RoPE), checked against the independent
oracle (tests/server/oracle.py, which reads the pre-RoPE query and key after the model's q_norm / k_norm in
transformers' own forward). A small random-weight Qwen3 (2 layers, 4 q / 2 kv heads, head dim 64) with the default
model's tokenizer, a seeded gate for it, budget 256 from a 1278-token prompt (a decode-made block ranked); with one
summary a block and with --sas-sub-blocks 4, the latter also through the fused Triton kernels."""

from __future__ import annotations

import json
import shutil

import pytest

from sas_backend.testing.server import ON_GPU, Server
from tests.server.compare import generate
from tests.server.memory_check import assert_held_as_reserved
from tests.server.oracle import Rule, oracle_check

BLOCK = 64
PROMPT_LEN = 1278
NEW_TOKENS = 5
BUDGET = 256
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@pytest.fixture(scope="module")
def qwen3_dir(model_dir, tmp_path_factory):
    """A random Qwen3 whose attention is not flat (q/k projections scaled up), saved with the default tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(8.0)
            layer.self_attn.q_norm.weight.normal_(1.0, 0.5)  # norms that matter to the pre-RoPE recovery
            layer.self_attn.k_norm.weight.normal_(1.0, 0.5)
    out = tmp_path_factory.mktemp("qwen3-tiny")
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def qwen3_gates(qwen3_dir, tmp_path_factory):
    """Seeded gates of width 128 and 32 (a quarter-width gate: with 4 runs a block it reads one summary's bytes)."""
    from sas_backend.gate.checkpoint import init_gate_checkpoint

    gates = {}
    for dg in (128, 32):
        gates[dg] = tmp_path_factory.mktemp("gates") / f"qwen3-tiny-seed0-dg{dg}"
        init_gate_checkpoint(gates[dg], model_dir=qwen3_dir, seed=0, gate_dim=dg)
    return gates


@pytest.mark.parametrize("sub_blocks,kernels,gate_dim,rerank,keys", [
    (1, "auto", 128, 1, "kv"), (4, "auto", 32, 1, "kv"), (4, "triton", 128, 2, "kv"), (1, "triton", 128, 2, "int4")])
def test_qwen3_decode_matches_the_oracle(qwen3_dir, qwen3_gates, essay_ids, tmp_path, sub_blocks, kernels, gate_dim,
                                         rerank, keys):
    """kernels "triton": the fused front / select / attend (Triton's interpreter on CPU) summarize each decode-made
    block's 4 runs and rank by the best run, as the oracle states it, the select picking 2 x K blocks and the rerank
    kernel keeping K by their exact attention mass (--sas-exact-rerank 2). gate_dim 32: a gate a quarter as wide, its
    4 runs a block as wide as one summary of the 128-wide gate. keys "int4": that rerank kernel reads each block's
    4-bit key codes (`--sas-rerank-keys int4`), the codes of decode-made blocks written beside the fused front. With
    the Triton attention the rerank launch only writes its candidates' log-sum-exps and the attend's programs keep
    the K (`ops.rerank.candidate_lse`), so the oracle checks that path's selections."""
    qwen3_gate = qwen3_gates[gate_dim]
    if kernels == "triton" and ON_GPU:
        pytest.skip("on a GPU the fused kernels are the default path (the auto cases)")
    args = ["--sas-gate", str(qwen3_gate), "--sas-budget", str(BUDGET), "--sas-sink-blocks", "1",
            "--sas-local-blocks", "1", "--sas-sub-blocks", str(sub_blocks), "--sas-kernels", kernels,
            "--sas-exact-rerank", str(rerank), "--sas-rerank-keys", keys,
            "--dtype", "bfloat16" if ON_GPU else "float32"]
    if ON_GPU:
        args.append("--disable-cuda-graph")  # the selection log reads the host each step
    prompt = essay_ids[9000 : 9000 + PROMPT_LEN]
    with Server(qwen3_dir, backend="sas", extra_args=args, env={"SAS_DEBUG_DIR": str(tmp_path)}) as server:
        out = generate(server.url, prompt, NEW_TOKENS)
        memory = assert_held_as_reserved(server.url, exact=not ON_GPU)  # this geometry's pools and workspace
        if kernels == "triton":
            assert memory["held"]["decode step workspace"] > 0
        if rerank > 1:  # the first level's select workspace at 2 x K and the second level's selection
            assert memory["held"]["exact rerank"] > memory["held"]["decode step workspace"]
        if rerank > 1 and kernels == "triton":  # the attend keeps the second level's K (LaunchOptions.rank_in_attend)
            assert "its top-K in the attend" in server.log_text(), server.log_tail()
    records = [json.loads(line) for f in sorted(tmp_path.glob("*.jsonl")) for line in f.open()]
    assert len(records) >= NEW_TOKENS - 1
    for rec in records:
        for head in rec["selected"][0]:
            assert len([m for m in head if m >= 0]) == BUDGET // BLOCK < rec["num_candidates"][0]
    rule = Rule(budget=BUDGET, sparse_from=PROMPT_LEN, gate=qwen3_gate, sink_blocks=1, local_blocks=1,
                block_size=BLOCK, sub_blocks=sub_blocks, exact_rerank=rerank, rerank_keys=keys)
    oracle_check(prompt, out, records, qwen3_dir, rule, NEW_TOKENS)
