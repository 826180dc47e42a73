"""Prompt anchors in the harness (`hf.sparse_eval.prompt_anchors`, `SparseEvalSpec.anchors`): the blocks the
prompt's last queries attend most, forced for every sparse query after the sink and local blocks."""

from __future__ import annotations

import torch

from sas_backend.gate.module import AttnGate
from sas_backend.hf.sparse_eval import SparseEvalSpec, prompt_anchors, sparse_eval

B = 16


def _model(group: int, kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(group)
    cfg = LlamaConfig(vocab_size=256, hidden_size=16 * group * kv_heads, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=group * kv_heads, num_key_value_heads=kv_heads, head_dim=16,
                      max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def _prefilled(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[None], past_key_values=cache, use_cache=True)
    return cache


def test_window_one_anchors_are_the_oracle_pick_of_the_last_prompt_query():
    model = _model(7, kv_heads=1)
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(1))
    cache = _prefilled(model, ids)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    anchors = prompt_anchors(model, ids, cache, 3, window=4, block_size=B)
    anchors = prompt_anchors(model, ids, cache, 3, window=1, block_size=B)
    assert cache.get_seq_length() == 100
    assert all(torch.equal(k, layer.keys) and torch.equal(v, layer.values)  # the cache is left as prefilled
               for (k, v), layer in zip(before, cache.layers))
    assert sorted(anchors) == [0, 1] and all(a.shape == (1, 3) for a in anchors.values())
    picked = {}
    # layer by layer on the dense model: the oracle's three blocks for query 99 (ascending) are the anchors
    for layer in (0, 1):
        spec = SparseEvalSpec(top_k=3, block_size=B, selector="oracle", sparse_from=99, first_sparse_layer=layer)
        with torch.no_grad(), sparse_eval(model, spec, max_pos=100, record=picked) as m:
            m(input_ids=ids[None])
        assert sorted(anchors[layer][0].tolist()) == picked[layer][0, 0].tolist()


def test_window_sums_block_mass_and_pads_short_prompts():
    model = _model(2, kv_heads=2)
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(2))
    one = prompt_anchors(model, ids, _prefilled(model, ids), 2, window=1, block_size=B)
    eight = prompt_anchors(model, ids, _prefilled(model, ids), 2, window=8, block_size=B)
    assert all(a.shape == (2, 2) for a in eight.values())
    assert any(not torch.equal(one[k], eight[k]) for k in one)  # the window changes the ranking here
    # 70 tokens: the last query sits in block 4, so blocks 0-3 are the candidates; asking for 6 pads with -1
    padded = prompt_anchors(model, ids, _prefilled(model, ids), 6, window=1, block_size=B)
    for a in padded.values():
        assert sorted(a[0, :4].tolist()) == [0, 1, 2, 3] and a[:, 4:].eq(-1).all()


def test_anchored_gate_attends_its_anchors_at_every_sparse_query():
    model = _model(3, kv_heads=1)
    ids = torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(3))
    gates = {i: AttnGate(1, 3, 16, 32) for i in range(2)}
    anchors = {0: torch.tensor([[2, 4]]), 1: torch.tensor([[1, -1]])}
    picked, plain = {}, {}
    for store, anc in ((picked, anchors), (plain, None)):
        spec = SparseEvalSpec(top_k=3, block_size=B, selector="gate", gates=gates, sink_blocks=1, sparse_from=100,
                              anchors=anc)
        with torch.no_grad(), sparse_eval(model, spec, max_pos=120, record=store) as m:
            m(input_ids=ids[None])
    assert picked[0].shape == (20, 1, 3)
    for p in range(20):
        assert {0, 2, 4} == set(picked[0][p, 0].tolist())
        assert {0, 1} <= set(picked[1][p, 0].tolist())
    assert any(not torch.equal(picked[k], plain[k]) for k in picked)
