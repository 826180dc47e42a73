"""Recall rows: facts spliced before the trained tail and restated in it, rows keep their length."""

from __future__ import annotations

import ast
import os
import re

import pytest
import torch

from sas_backend.training import recall
from sas_backend.training.recall import RecallSpec, add_recall_rows, make_facts
from tiny_llama import ESSAYS_DIR, REPO, SMOLLM_DIR, have_real_assets

pytestmark = pytest.mark.skipif(not have_real_assets(), reason="needs models/SmolLM2-135M-Instruct (tokenizer) "
                                "and models/text/essays: run serve/prepare_model.py and serve/prepare_text.py")

L, TAIL = 1024, 256
# a fact sentence or its restatement: the key (two words) and the value
FACT = re.compile(r"(?:Note that the access code for the|The registration number of the|Keep in mind that the|"
                  r"For the record, the) "
                  r"(\w+ \w+)(?: is| was recorded as| uses the key| was assigned the label) ([\w-]+)\.")
AGAIN = re.compile(r"(?:As noted, the access code for the|To repeat, the registration number of the|Recall that the|"
                   r"Once more: the) (\w+ \w+)(?: is| uses the key| was assigned the label) ([\w-]+)\.")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOLLM_DIR)


@pytest.fixture(scope="module")
def rows(tok):
    names = sorted(n for n in os.listdir(ESSAYS_DIR) if n.endswith(".txt"))[:6]
    text = "\n\n".join(open(os.path.join(ESSAYS_DIR, n), encoding="utf-8").read() for n in names)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n = len(ids) // L
    assert n >= 6
    return torch.tensor(ids[: n * L]).view(n, L)


def test_facts_before_the_tail_restated_in_it(tok, rows):
    spec = RecallSpec(fraction=0.5, facts=3, tail=TAIL, seed=1)
    out, made = add_recall_rows(rows, tok, spec)
    assert out.shape == rows.shape and out.dtype == rows.dtype
    changed = [r for r in range(rows.shape[0]) if not torch.equal(out[r], rows[r])]
    assert len(changed) == round(0.5 * rows.shape[0]) == made["rows_changed"]
    assert made["facts_placed"] == 3 * len(changed)
    for r in changed:
        head, tail = tok.decode(out[r, : L - TAIL]), tok.decode(out[r, L - TAIL:])
        stated = dict(FACT.findall(head))
        again = dict(AGAIN.findall(tail))
        assert len(stated) == 3 and again == stated, (head, tail)  # same keys, same values, in the tail only
        assert not AGAIN.findall(head) and not FACT.findall(tail)
        # the row's own text survives in order: the first original tokens of the prefix lead it
        first = min(head.find(m.group(0)) for m in FACT.finditer(head))
        assert tok.decode(rows[r, : L - TAIL])[: max(first - 2, 0)] == head[: max(first - 2, 0)]


def test_min_distance_keeps_every_fact_that_far_from_the_tail(tok, rows):
    far = (L - TAIL) // 2
    spec = RecallSpec(fraction=1.0, facts=2, tail=TAIL, seed=3, min_distance=far)
    out, made = add_recall_rows(rows, tok, spec)
    assert made["facts_placed"] == 2 * rows.shape[0] and spec.record()["min_distance"] == far
    for r in range(rows.shape[0]):
        assert len(FACT.findall(tok.decode(out[r, : L - TAIL - far]))) == 2  # both facts in the far part
        assert torch.equal(out[r, L - TAIL - far: L - TAIL], rows[r, L - TAIL - far: L - TAIL])  # near text kept
        assert len(AGAIN.findall(tok.decode(out[r, L - TAIL:]))) == 2
    assert "min_distance" not in RecallSpec(1.0, 2, TAIL).record()  # unset: records as before the option
    with pytest.raises(ValueError, match="no room"):
        add_recall_rows(rows, tok, RecallSpec(1.0, 1, TAIL, min_distance=L - TAIL))
    with pytest.raises(ValueError, match="min distance"):
        RecallSpec(1.0, 1, TAIL, min_distance=-1)


def test_seeded(tok, rows):
    a, _ = add_recall_rows(rows, tok, RecallSpec(1.0, 2, TAIL, seed=0))
    b, _ = add_recall_rows(rows, tok, RecallSpec(1.0, 2, TAIL, seed=0))
    c, _ = add_recall_rows(rows, tok, RecallSpec(1.0, 2, TAIL, seed=1))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_distinct_keys_and_bad_specs(tok, rows):
    import random

    facts = make_facts(12, random.Random(0))
    assert len({FACT.search(f).group(1) for f, _ in facts}) == 12
    for bad in (dict(fraction=1.5, facts=1, tail=8), dict(fraction=0.5, facts=0, tail=8),
                dict(fraction=0.5, facts=1, tail=1)):
        with pytest.raises(ValueError):
            RecallSpec(**bad)
    with pytest.raises(ValueError, match="shorter than the rows"):
        add_recall_rows(rows, tok, RecallSpec(1.0, 1, tail=L))
    with pytest.raises(ValueError, match="do not fit"):
        add_recall_rows(rows, tok, RecallSpec(1.0, 40, tail=64))


def test_needle_format_stays_held_out():
    """No word of the training facts is a word of the needle test's facts (bench/needle.py)."""
    tree = ast.parse(open(os.path.join(REPO, "bench", "needle.py"), encoding="utf-8").read())
    consts = {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name) and t.id in ("NEEDLE", "QUESTION", "PLACES", "CODES")}
    needle_words = {w for p in consts["PLACES"] for w in p.split()} | {c.split("-")[0] for c in consts["CODES"]}
    needle_words |= {"secret", "passphrase"}
    ours = set(recall.ADJECTIVES) | set(recall.NOUNS) | set(recall.VALUE_WORDS)
    ours |= {w.strip(".,:").lower() for pair in recall.TEMPLATES for s in pair for w in s.split()}
    assert not ours & needle_words


def test_the_dense_model_recalls_the_facts(tok, rows):
    """The task is learnable: the real model, dense, predicts the restated values from the facts far
    back (the prefix is worth several nats per fact more in a recall row than in the row it came from)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(SMOLLM_DIR, dtype=torch.float32).eval()
    facts = 2
    out, _ = add_recall_rows(rows[:1], tok, RecallSpec(1.0, facts, TAIL, seed=0))

    def tail_nll(ids: torch.Tensor) -> float:
        with torch.no_grad():
            logits = model(ids[None, :-1]).logits[0, -(TAIL - 1):]
        return float(torch.nn.functional.cross_entropy(logits, ids[-(TAIL - 1):], reduction="sum"))

    def prefix_gain(ids: torch.Tensor) -> float:  # NLL of the tail alone minus in context
        return tail_nll(ids[-TAIL:]) - tail_nll(ids)

    assert prefix_gain(out[0]) - prefix_gain(rows[0]) > 5.0 * facts
