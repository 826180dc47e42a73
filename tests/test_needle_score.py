"""bench/needle_score.py: the teacher-forced needle scores what the server's decode would attend."""

from __future__ import annotations

import pathlib

import pytest
import torch

from tests.training.tiny_llama import SMOLLM_DIR, have_real_assets

REPO = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not have_real_assets(),
                                reason="needs models/SmolLM2-135M-Instruct and models/text/essays")


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import needle_score

    tok = AutoTokenizer.from_pretrained(SMOLLM_DIR)
    tok.model_max_length = 1 << 30
    model = AutoModelForCausalLM.from_pretrained(SMOLLM_DIR, dtype=torch.float32).eval()
    return needle_score, tok, model, needle_score.needle_cases(tok, 320, [0.2, 0.8])


def test_cases_locate_the_passphrase(setup):
    needle_score, tok, _, cases = setup
    for i, (depth, p_ids, a_ids, code) in enumerate(cases):
        assert tok.decode(a_ids[code]).strip() == needle_score.CODES[i]
        assert needle_score.PLACES[i] in tok.decode(p_ids[-40:])  # the question ends the prompt
        assert needle_score.CODES[i] in tok.decode(p_ids)  # the fact is in the haystack


def test_sparse_scores_follow_the_serving_rule(setup):
    """Dense spec == plain model; a budget covering the context == dense; a budget of one block
    (sink-local keeps only block 0) loses the fact placed late."""
    from sas_backend.hf.sparse_eval import SparseEvalSpec

    needle_score, _, model, cases = setup
    _, p_ids, a_ids, code = cases[1]
    dense = needle_score.passphrase_nll(model, p_ids, a_ids, code)
    spec = lambda **kw: SparseEvalSpec(block_size=64, sparse_from=len(p_ids), **kw)  # noqa: E731
    as_dense = needle_score.passphrase_nll(model, p_ids, a_ids, code, spec(top_k=1, selector="dense"))
    assert as_dense == pytest.approx(dense)
    covering = needle_score.passphrase_nll(model, p_ids, a_ids, code, spec(top_k=64, selector="sink-local"))
    assert covering[0] == pytest.approx(dense[0], rel=1e-4, abs=1e-4) and covering[1] == dense[1]
    starved = needle_score.passphrase_nll(model, p_ids, a_ids, code, spec(top_k=1, selector="sink-local"))
    assert starved[0] > dense[0] + 2.0


def test_fact_block_and_what_each_layer_chose(setup):
    """The passphrase's block is found in the prompt; the oracle at a small budget chooses it in some
    layers, a one-block sink-local never (the fact is not in block 0)."""
    from sas_backend.hf.sparse_eval import SparseEvalSpec

    needle_score, tok, model, cases = setup
    _, p_ids, a_ids, code = cases[1]
    block = needle_score.fact_block(p_ids, a_ids, code, 64)
    assert block is not None and block > 0
    assert needle_score.CODES[1] in tok.decode(p_ids[block * 64:(block + 1) * 64 + len(a_ids)])
    for selector, top_k, chosen in (("oracle", 2, True), ("sink-local", 1, False)):
        selected = {}
        needle_score.passphrase_nll(model, p_ids, a_ids, code,
                                    SparseEvalSpec(top_k=top_k, block_size=64, selector=selector,
                                                   sparse_from=len(p_ids)), selected)
        assert len(selected) == model.config.num_hidden_layers
        assert any(bool((sel == block).any()) for sel in selected.values()) == chosen


def test_prefilled_prompt_gives_the_same_scores(setup):
    """The prompt prefilled once and its cache reused (cropped back after each answer) scores as a full
    forward does, for dense and sparse selectors alike, and leaves the cache at the prompt's length."""
    from sas_backend.hf.sparse_eval import SparseEvalSpec

    needle_score, _, model, cases = setup
    _, p_ids, a_ids, code = cases[1]
    prefilled = needle_score.prefill(model, p_ids)
    for spec in (None, SparseEvalSpec(top_k=2, block_size=64, selector="oracle", sparse_from=len(p_ids)),
                 SparseEvalSpec(top_k=1, block_size=64, selector="sink-local", sparse_from=len(p_ids))):
        full_sel, pre_sel = {}, {}
        full = needle_score.passphrase_nll(model, p_ids, a_ids, code, spec, full_sel)
        pre = needle_score.passphrase_nll(model, p_ids, a_ids, code, spec, pre_sel, prefilled)
        assert pre[0] == pytest.approx(full[0], rel=1e-4, abs=1e-4) and pre[1] == full[1]
        assert prefilled[0].get_seq_length() == len(p_ids)
        assert full_sel.keys() == pre_sel.keys() and all(torch.equal(full_sel[k], pre_sel[k]) for k in full_sel)


def test_passphrase_answer_is_what_the_server_decodes(setup):
    """--answer passphrase: the answer is the passphrase alone; its first token is predicted by the prompt's last
    position (dense prefill), so a starved selection cannot change it, only the tokens after it."""
    from sas_backend.hf.sparse_eval import SparseEvalSpec

    needle_score, tok, model, _ = setup
    cases = needle_score.needle_cases(tok, 320, [0.2, 0.8], answer="passphrase")
    _, p_ids, a_ids, code = cases[1]
    assert code == slice(0, len(a_ids)) and tok.decode(a_ids).strip() == needle_score.CODES[1]
    prefilled = needle_score.prefill(model, p_ids)
    dense = needle_score.passphrase_nll(model, p_ids, a_ids, code, prefilled=prefilled)
    starved = needle_score.passphrase_nll(
        model, p_ids, a_ids, code, SparseEvalSpec(top_k=1, block_size=64, selector="sink-local",
                                                  sparse_from=len(p_ids)), prefilled=prefilled)
    assert starved[1] == dense[1] and starved[0] > dense[0] + 2.0
    with pytest.raises(ValueError, match="answer must be one of"):
        needle_score.needle_cases(tok, 320, [0.5], answer="word")
