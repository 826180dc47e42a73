"""The harness's fused sparse rows (SDPA with the selection as a boolean mask, `hf.sparse_eval`) give the
same logits as its explicit masked softmax, for every selector, GQA group sizes 1-8, partial blocks, mixed
positions and a budget that covers the context; and sparsity still changes the result."""

from __future__ import annotations

import pytest
import torch

from sas_backend.gate.module import AttnGate
from sas_backend.hf.sparse_eval import SparseEvalSpec, sparse_eval

B = 16


def _model(group: int, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(group)
    cfg = LlamaConfig(vocab_size=256, hidden_size=16 * group * kv_heads, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=group * kv_heads, num_key_value_heads=kv_heads, head_dim=16,
                      max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def _spec(selector, model, top_k, sparse_from):
    gates = None
    if selector == "gate":
        c = model.config
        gates = {i: AttnGate(c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads, 16, 32)
                 for i in range(2)}
    return SparseEvalSpec(top_k=top_k, block_size=B, selector=selector, gates=gates, sparse_from=sparse_from,
                          sink_blocks=1 if selector == "gate" else 0)


def _logits(model, spec, ids, fused):
    with torch.no_grad(), sparse_eval(model, spec, max_pos=ids.shape[1], fused=fused) as m:
        return m(input_ids=ids).logits[0]


@pytest.mark.parametrize("group", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("selector", ["gate", "quest", "sink-local", "oracle", "random"])
def test_fused_equals_masked_softmax(group, selector):
    model = _model(group, kv_heads=1 if group in (3, 7) else 2)
    ids = torch.randint(0, 256, (1, 101), generator=torch.Generator().manual_seed(group))  # last block partial
    spec = _spec(selector, model, top_k=2, sparse_from=37)  # sparse rows start mid-block
    fused, masked = _logits(model, spec, ids, True), _logits(model, spec, ids, False)
    torch.testing.assert_close(fused, masked, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        dense = model(input_ids=ids).logits[0]
    torch.testing.assert_close(fused[:37], dense[:37], rtol=1e-5, atol=1e-5)  # dense rows stay dense
    assert (fused[37:] - dense[37:]).abs().max() > 1e-3  # sparse, not silently dense


def test_budget_covering_the_context_is_dense():
    model = _model(3, kv_heads=1)
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        dense = model(input_ids=ids).logits[0]
    for selector in ("gate", "quest", "sink-local"):
        got = _logits(model, _spec(selector, model, top_k=90 // B + 1, sparse_from=0), ids, True)
        torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
