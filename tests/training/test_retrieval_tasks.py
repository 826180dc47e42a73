"""RULER-kind haystacks (`hf.retrieval_tasks`) and the retrieval benchmark's pieces (`bench/retrieval.py`):
seeded, every fact placed once at its depth, questions that share the haystack's prefix token for token,
RULER's scoring, and the benchmark's paired summary."""

from __future__ import annotations

import importlib.util
import os

import pytest

from sas_backend.hf.retrieval_tasks import (
    PER_TASK, TASKS, VT_CHAIN, make_haystack, prompt_parts, score_reply, shared_prefix_ids,
)
from tests.training.tiny_llama import SMOLLM_DIR, have_real_assets

pytestmark = pytest.mark.skipif(not have_real_assets(), reason="needs the prepared SmolLM2 tokenizer and essays")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tok_and_filler():
    from transformers import AutoTokenizer

    from sas_backend.corpus import read_essays

    essays = read_essays()
    return AutoTokenizer.from_pretrained(SMOLLM_DIR), "\n\n".join(essays[k] for k in sorted(essays))


def test_haystack_is_seeded_and_holds_every_fact_once(tok_and_filler):
    tok, filler = tok_and_filler
    hay = make_haystack(tok, filler, 4096, seed=3)
    assert hay == make_haystack(tok, filler, 4096, seed=3)
    assert hay.text != make_haystack(tok, filler, 4096, seed=4).text
    n = len(tok(hay.text, add_special_tokens=False)["input_ids"])
    assert 0.9 * 4096 <= n <= 4096 + 16
    assert [sum(q.task == t for q in hay.questions) for t in TASKS] == [PER_TASK] * len(TASKS)
    for fact, depth in hay.facts:
        assert hay.text.count(fact) == 1, fact
        assert 0.0 <= depth <= 1.0
    depths = [d for _, d in hay.facts]
    assert depths == sorted(depths) and depths[-1] - depths[0] > 0.5  # spread over the haystack
    for q in hay.questions:
        for a in q.answers:
            assert a in hay.text and a in q.gold
        if q.task == "vt":
            assert len(q.answers) == VT_CHAIN
            assert all(f"VAR {a} =" in hay.text for a in q.answers)


def test_questions_share_the_prefix(tok_and_filler):
    tok, filler = tok_and_filler
    hay = make_haystack(tok, filler, 2048, seed=0)
    parts = [prompt_parts(tok, hay, q) for q in hay.questions]
    assert len({head for head, _ in parts}) == 1
    prefix, suffixes = shared_prefix_ids(tok, parts[0][0], [tail for _, tail in parts])
    for (head, tail), suffix in zip(parts, suffixes):
        assert prefix + suffix == tok(head + tail, add_special_tokens=False)["input_ids"]
        assert len(suffix) < 128
    assert len(prefix) > 1900
    full = tok.apply_chat_template([{"role": "user", "content": hay.text + "\n\n" + hay.questions[0].question}],
                                   tokenize=False, add_generation_prompt=True)
    assert (parts[0][0] + parts[0][1]).startswith(full.rstrip("\n"))
    assert parts[0][1].endswith(hay.questions[0].answer_prefix)


def test_ruler_score():
    from sas_backend.hf.retrieval_tasks import Question

    q = Question("multivalue", "?", "are", ("111", "222", "333"), " 111, 222, 333.")
    assert score_reply(q, "1. 111\n2. 333") == pytest.approx(2 / 3)
    assert score_reply(q, "none") == 0.0
    assert score_reply(Question("single", "?", "is", ("42",), " 42."), " 42.") == 1.0


def test_too_short_filler_is_refused(tok_and_filler):
    tok, _ = tok_and_filler
    with pytest.raises(ValueError, match="filler holds"):
        make_haystack(tok, "One sentence. Two sentences.", 4096, seed=0)
    with pytest.raises(ValueError, match="do not hold"):
        make_haystack(tok, "x. " * 10, 64, seed=0)


def _bench():
    spec = importlib.util.spec_from_file_location("bench_retrieval", os.path.join(REPO, "bench", "retrieval.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_summary_pairs_by_question():
    bench = _bench()
    assert bench.parse_config("gate@a4") == ("gate", 4) and bench.parse_config("pairs4") == ("pairs4", 0)
    with pytest.raises(ValueError):
        bench.parse_config("gate@x")
    rows = []
    for qid, (dense, sparse) in enumerate([(1.0, 1.0), (1.0, 0.0), (0.0, 0.0)]):
        for label, score, nll in (("dense", dense, 1.0), ("gate/b512", sparse, 3.0)):
            rows.append({"length": 4096, "seed": 0, "qid": qid, "task": "single", "label": label,
                         "config": label.split("/")[0], "score": score, "nll": nll})
    s = bench.summary(rows)
    assert s["gate/b512"]["single"]["n"] == 3
    assert s["gate/b512"]["single"]["score"] == pytest.approx(100 / 3)
    assert s["gate/b512"]["single"]["vs_dense"] == pytest.approx(-100 / 3)
    assert s["gate/b512"]["single"]["excess_nll"] == pytest.approx(2.0)
    assert s["dense"]["single"]["vs_dense"] == 0.0
    table = bench.markdown(rows)
    assert "gate/b512" in table and "-33" in table


def test_bench_reads_a_studys_records_together(tmp_path):
    import json

    bench = _bench()
    key = {"model": "m"}
    row = {"length": 4096, "seed": 0, "qid": 0, "label": "dense"}
    (tmp_path / "a.json").write_text(json.dumps({"key": key, "rows": [row]}))
    (tmp_path / "b.json").write_text(json.dumps({"key": key, "rows": [{**row, "seed": 1}]}))
    assert [r["seed"] for r in bench.read_rows([tmp_path / "a.json", tmp_path / "b.json"])] == [0, 1]
    (tmp_path / "c.json").write_text(json.dumps({"key": key, "rows": [row]}))
    with pytest.raises(ValueError, match="two records"):
        bench.read_rows([tmp_path / "a.json", tmp_path / "c.json"])
    (tmp_path / "d.json").write_text(json.dumps({"key": {"model": "other"}, "rows": []}))
    with pytest.raises(ValueError, match="measured with"):
        bench.read_rows([tmp_path / "a.json", tmp_path / "d.json"])
