"""The paper's analysis (sas_backend.hf.analysis) against a brute-force statement of its definitions: plain Python
loops over layers, heads, queries and keys for the coverage, sets for the overlap recall, on the queries, keys,
values and selections the tiny random Llama's forward really had; plus the edge cases (a budget covering the
context: coverage 1, recall 1; the oracle's raw coverage at least every selector's where it is the coverage
maximizer) and the CLI."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from sas_backend.gate.module import AttnGate
from sas_backend.hf.analysis import BlockAnalysis, analysis_attention, block_analysis, oracle_sets
from sas_backend.hf.sparse_eval import SparseEvalSpec
from sas_backend.training.eval_ppl import prefix_cache, window_nll
from sas_backend.training.analysis import analysed_nll
from tiny_llama import ESSAYS_DIR, have_real_assets, save_tiny_model_dir, tiny_config, tiny_llama

WINDOW, LAST, B = 112, 40, 16  # 7 blocks; the measured queries sit in blocks 4-6 (4-6 candidates)
SPY = "sas_analysis_spy"


def _gates(h_kv=2, g=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(2):
        gate = AttnGate(h_kv, g, 16, 32)
        gate.reset_parameters(generator=gen)
        out[i] = gate
    return out


def _spec(selector, top_k, h_kv=2, g=2, **kw):
    gates = _gates(h_kv, g) if selector == "gate" else None
    return SparseEvalSpec(top_k=top_k, block_size=B, selector=selector, gates=gates, sparse_from=WINDOW - LAST, **kw)


def _ids(seed=1):
    return torch.randint(0, 256, (WINDOW + 1,), generator=torch.Generator().manual_seed(seed))


def _run(model, spec, activations="sparse", ids=None):
    """(the analysis' result, {layer: (q [H_q, P, D], k [H_kv, T, D], v, scale, selected [P, H_kv, K])}) of one
    window's measured forward; the spy attention records what `analysis_attention` was given."""
    from transformers import AttentionInterface

    ids = _ids() if ids is None else ids
    seen = {}

    def spy(module, query, key, value, attention_mask, scaling, **kw):
        out = analysis_attention(module, query, key, value, attention_mask, scaling, **kw)
        sel = module._sas_eval["record"].get(module.layer_idx)
        seen[module.layer_idx] = (query[0, :, -LAST:].double(), key[0].double(), value[0].double(), scaling, sel)
        return out

    AttentionInterface.register(SPY, spy)
    acc = BlockAnalysis(spec.top_k, B)
    cache = prefix_cache(model, ids, LAST)
    with torch.no_grad(), block_analysis(model, spec, acc, activations, max_pos=WINDOW):
        model.set_attn_implementation(SPY)
        model(input_ids=ids[None, WINDOW - LAST:WINDOW], past_key_values=cache, use_cache=True)
    return acc.result(), seen


def _brute(seen, top_k):
    """The definitions (hf/analysis.py's module doc) in plain Python: per layer mean raw / value-aware coverage and
    per-layer recall; per kv head and over all heads the union recall."""
    cov_raw, cov_val, layer_rec = {}, {}, {}
    union_o, union_s = {}, {}  # (h, p) -> set
    for layer, (q, k, v, scale, sel) in sorted(seen.items()):
        h_q, n_p, _ = q.shape
        h_kv, t, _ = k.shape
        g_n = h_q // h_kv
        q, k, v, sel = q.tolist(), k.tolist(), v.tolist(), sel.tolist()  # plain Python numbers from here on
        raw_sum = val_sum = 0.0
        rec_sum, rec_n = 0.0, 0
        for h in range(h_kv):
            vnorm = [math.sqrt(sum(x * x for x in v[h][j])) for j in range(t)]
            for p in range(n_p):
                pos = t - n_p + p
                own = pos // B
                chosen = {m for m in sel[p][h] if m >= 0}
                votes = {}
                for g in range(g_n):
                    qv = q[h * g_n + g][p]
                    lg = [sum(a * c for a, c in zip(qv, k[h][j])) * scale for j in range(pos + 1)]
                    top = max(lg)
                    w_raw = [math.exp(x - top) for x in lg]
                    w_val = [w * vnorm[j] for j, w in enumerate(w_raw)]
                    attended = [j for j in range(pos + 1) if j // B in chosen or j // B == own]
                    raw_sum += sum(w_raw[j] for j in attended) / sum(w_raw)
                    val_sum += sum(w_val[j] for j in attended) / sum(w_val)
                    mass = {m: sum(w_raw[m * B:(m + 1) * B]) / sum(w_raw) for m in range(own)}
                    for m in sorted(mass, key=lambda m: (-mass[m], m))[:top_k]:
                        votes[m] = votes.get(m, 0) + 1
                oracle = {m for m, c in votes.items() if 2 * c >= g_n}
                if oracle:
                    rec_sum += len(oracle & chosen) / len(oracle)
                    rec_n += 1
                union_o.setdefault((h, p), set()).update(oracle)
                union_s.setdefault((h, p), set()).update(chosen)
        cov_raw[layer] = raw_sum / (h_q * n_p)
        cov_val[layer] = val_sum / (h_q * n_p)
        layer_rec[layer] = rec_sum / rec_n
    heads = sorted({h for h, _ in union_o})
    queries = sorted({p for _, p in union_o})
    per_head = []
    for h in heads:
        r = [len(union_o[h, p] & union_s[h, p]) / len(union_o[h, p]) for p in queries if union_o[h, p]]
        per_head.append(sum(r) / len(r))
    every = []
    for p in queries:
        uo = set().union(*(union_o[h, p] for h in heads))
        us = set().union(*(union_s[h, p] for h in heads))
        if uo:
            every.append(len(uo & us) / len(uo))
    return cov_raw, cov_val, layer_rec, per_head, sum(every) / len(every)


@pytest.mark.parametrize("selector", ["gate", "quest", "sink-local", "oracle", "random"])
@pytest.mark.parametrize("activations", ["sparse", "dense"])
def test_analysis_equals_the_brute_force_statement(selector, activations):
    model = tiny_llama()
    spec = _spec(selector, 2, **({"sink_blocks": 1, "local_blocks": 0} if selector == "gate" else {}))
    got, seen = _run(model, spec, activations)
    assert sorted(seen) == [0, 1] and all(s[4] is not None for s in seen.values())
    cov_raw, cov_val, layer_rec, per_head, every = _brute(seen, 2)
    for layer in (0, 1):
        assert got["coverage_raw"][layer] == pytest.approx(cov_raw[layer], rel=1e-5)
        assert got["coverage_value"][layer] == pytest.approx(cov_val[layer], rel=1e-5)
        assert got["layer_recall"][layer] == pytest.approx(layer_rec[layer], rel=1e-6)
    assert got["union_recall_per_kv_head"] == pytest.approx(per_head, rel=1e-6)
    assert got["union_recall_kv_mean"] == pytest.approx(sum(per_head) / len(per_head), rel=1e-6)
    assert got["union_recall_all_heads"] == pytest.approx(every, rel=1e-6)
    assert 0 < got["coverage_raw_mean"] < 1 and got["forwards"] == 1
    if selector != "oracle":  # the selection is not the majority vote's: the numbers say something
        assert got["union_recall_kv_mean"] < 1 or got["layer_recall_mean"] < 1


def test_majority_vote_rule_and_ties():
    """G = 2: a block one of the two heads takes is in (2 * 1 >= 2); G = 3: two of three needed; equal masses go
    to the lower block index; at most K candidates: all of them."""
    b, t = 4, 16  # 4 blocks; the query at position 15 has 3 candidates
    pos = torch.tensor([15])

    def logits_for(masses_per_head):  # one query; keys of block m all get log(mass_m / b)
        rows = []
        for masses in masses_per_head:
            row = torch.full((t,), -30.0)
            for m, x in enumerate(masses):
                row[m * b:(m + 1) * b] = math.log(x / b)
            rows.append(row)
        return torch.stack(rows)[None, :, None, :]  # [1, G, 1, T]

    two = oracle_sets(logits_for([[0.5, 0.2, 0.1, 0.2], [0.1, 0.5, 0.2, 0.2]]), pos, b, 1)
    assert two[0, 0].tolist() == [True, True, False, False]
    three = oracle_sets(logits_for([[0.5, 0.2, 0.1, 0.2], [0.1, 0.5, 0.2, 0.2], [0.5, 0.1, 0.2, 0.2]]), pos, b, 1)
    assert three[0, 0].tolist() == [True, False, False, False]
    tie = oracle_sets(logits_for([[0.2, 0.2, 0.2, 0.4]]), pos, b, 2)  # block 3 is the own block: no candidate
    assert tie[0, 0].tolist() == [True, True, False, False]
    every = oracle_sets(logits_for([[0.2, 0.2, 0.2, 0.4]]), pos, b, 5)
    assert every[0, 0].tolist() == [True, True, True, False]


@pytest.mark.parametrize("selector", ["gate", "quest", "sink-local", "random"])
def test_a_budget_covering_the_context_covers_everything(selector):
    model = tiny_llama()
    got, _ = _run(model, _spec(selector, WINDOW // B))
    for key in ("coverage_raw", "coverage_value", "layer_recall"):
        assert all(v == pytest.approx(1.0, abs=1e-6) for v in got[key].values()), key
    assert got["union_recall_per_kv_head"] == [1.0, 1.0] and got["union_recall_all_heads"] == 1.0
    blocks = got["union_blocks"]
    assert blocks["selected_per_kv_head"] == blocks["candidates"] == blocks["selected_all_heads"]


def test_the_oracle_covers_at_least_every_selector_where_it_is_the_maximizer():
    """With one query head per kv head (G = 1) the oracle's ranking (max over the group's heads of the block mass)
    is the head's own mass, so its K blocks maximize the raw coverage; with dense activations every selector sees
    the same queries and keys at every layer. Then its raw coverage is at least every other selector's, layer by
    layer, and its overlap recall is 1 (its selection is the vote's set)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config()
    cfg.num_key_value_heads = cfg.num_attention_heads  # G = 1
    model = LlamaForCausalLM(cfg).eval()
    for top_k in (1, 2, 3):
        oracle, _ = _run(model, _spec("oracle", top_k, h_kv=4, g=1), "dense")
        assert oracle["layer_recall_mean"] == 1.0 and oracle["union_recall_all_heads"] == 1.0
        for selector in ("gate", "quest", "sink-local", "random"):
            other, _ = _run(model, _spec(selector, top_k, h_kv=4, g=1), "dense")
            for layer, c in other["coverage_raw"].items():
                assert oracle["coverage_raw"][layer] >= c - 1e-6, (selector, top_k, layer)


def test_activations_and_the_harness_agree():
    """"sparse": the forward is eval_ppl's sparse forward (same NLL); "dense": the dense model's (same NLL as dense);
    the model's attention implementation is restored; several forwards in one context each count."""
    model = tiny_llama()
    ids = _ids(2)
    spec = _spec("quest", 2)
    cache = prefix_cache(model, ids, LAST)
    before = model.config._attn_implementation
    acc = BlockAnalysis(2, B)
    assert analysed_nll(model, ids, LAST, spec, cache, acc, "sparse") == pytest.approx(
        window_nll(model, ids, LAST, spec, cache), rel=1e-6)
    assert analysed_nll(model, ids, LAST, spec, cache, BlockAnalysis(2, B), "dense") == pytest.approx(
        window_nll(model, ids, LAST, None, cache), rel=1e-6)
    assert model.config._attn_implementation == before
    assert acc.result()["forwards"] == 1
    two = BlockAnalysis(2, B)
    with block_analysis(model, spec, two, "sparse", max_pos=WINDOW):
        for _ in range(2):
            model(input_ids=ids[None, :WINDOW], use_cache=False)
    assert two.result()["forwards"] == 2
    with pytest.raises(ValueError):
        with block_analysis(model, spec, BlockAnalysis(3, B)):
            pass


@pytest.mark.skipif(not have_real_assets(), reason="needs models/SmolLM2-135M-Instruct (tokenizer) and "
                    "models/text/essays: run serve/prepare_model.py and serve/prepare_text.py")
def test_cli_writes_json_and_tables(tmp_path):
    from sas_backend.gate.checkpoint import init_gate_checkpoint
    from sas_backend.training import analysis

    model_dir = save_tiny_model_dir(str(tmp_path / "model"))
    gate_dir = str(tmp_path / "gate")
    init_gate_checkpoint(gate_dir, model_dir=model_dir, seed=0, gate_dim=32, block_size=16)
    essays = sorted(os.path.join(ESSAYS_DIR, n) for n in os.listdir(ESSAYS_DIR) if n.endswith(".txt"))[:8]
    out = str(tmp_path / "an.json")
    assert analysis.main(["--model", model_dir, "--data", *essays, "--split", "train", "--window", "128",
                          "--last", "32", "--block-size", "16", "--budgets", "32", "128", "--gate", f"g={gate_dir}",
                          "--baselines", "oracle", "quest", "sink-local", "--max-windows", "2", "--no-progress",
                          "--json", out]) == 0
    rec = json.load(open(out))
    assert set(rec["results"]) == {"g", "oracle", "quest", "sink-local"} and rec["windows"] == 2
    for per in rec["results"].values():
        assert per["32"]["forwards"] == 2 and len(per["32"]["coverage_raw"]) == 2
        assert per["128"]["union_recall_all_heads"] == 1.0  # 128 tokens: the whole window
        assert per["128"]["coverage_raw_mean"] == pytest.approx(1.0, abs=1e-6)
    md = open(str(tmp_path / "an.md")).read()
    assert "| oracle | 32 (2) |" in md and "union recall, all heads" in md and "--baselines oracle" in md
