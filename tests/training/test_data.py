"""Training data: sources, the deterministic held-out split, EOS packing."""

from __future__ import annotations

import json

import pytest
import torch

from sas_backend.training.data import DataError, Document, pack, read_documents, split_documents, tokenize_documents


class _Tok:
    """A whitespace 'tokenizer' with a chat template, enough for the data helpers."""

    eos_token_id = 0
    chat_template = "x"

    def __call__(self, texts, add_special_tokens=False, verbose=False):
        return {"input_ids": [[len(w) for w in t.split()] for t in texts]}

    def apply_chat_template(self, messages, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages)


def test_sources_text_jsonl_and_directories(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_text("alpha beta")
    (tmp_path / "d" / "sub" / "b.py").write_text("x = 1")
    (tmp_path / "d" / "skip.bin").write_text("not text")
    recs = [{"text": "one two"}, {"messages": [{"role": "user", "content": "hi"}]}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    docs = read_documents([str(tmp_path / "d"), str(tmp_path / "c.jsonl")], _Tok())
    assert [d.name for d in docs] == ["d/a.txt", "d/sub/b.py",
                                      f"{tmp_path.name}/c.jsonl:1", f"{tmp_path.name}/c.jsonl:2"]
    assert docs[3].text == "<user>hi\n"
    with pytest.raises(DataError, match="no such file"):
        read_documents([str(tmp_path / "missing")])
    (tmp_path / "bad.jsonl").write_text('{"other": 1}\n')
    with pytest.raises(DataError, match="bad.jsonl:1"):
        read_documents([str(tmp_path / "bad.jsonl")])


def test_split_is_deterministic_disjoint_and_sized():
    docs = [Document(f"src/{i}.txt", "w " * (10 + i), source="src") for i in range(100)]
    train, held = split_documents(docs, 0.2)
    train2, held2 = split_documents(list(reversed(docs)), 0.2)
    assert {d.name for d in held} == {d.name for d in held2}  # order-independent
    assert not {d.name for d in held} & {d.name for d in train}
    share = sum(len(d.text) for d in held) / sum(len(d.text) for d in docs)
    assert 0.15 < share <= 0.2
    # a source's split does not depend on other sources listed with it
    other = [Document(f"o/{i}", "z " * 50, source="o") for i in range(30)]
    _, held3 = split_documents(docs + other, 0.2)
    assert {d.name for d in held3 if d.source == "src"} == {d.name for d in held}


def test_pack_with_eos():
    ids = tokenize_documents([Document("a", "aa b"), Document("b", "ccc")], _Tok())
    assert ids == [[2, 1, 0], [3, 0]]
    rows = pack(ids, 2, seed=None)
    assert torch.equal(rows, torch.tensor([[2, 1], [0, 3]]))  # the short tail [0] is dropped


# ---- the documentation corpus and the out-of-domain sets -------------------------------------

def test_docs_corpus_reads_the_prepared_tree_with_stable_names(tmp_path, monkeypatch):
    from sas_backend import corpus
    from sas_backend.training import data

    monkeypatch.setattr(corpus, "default_corpus_dir", lambda: str(tmp_path))
    with pytest.raises(DataError, match="serve/prepare_corpus.py"):
        read_documents(["@docs"])
    (tmp_path / "docs" / "pkg" / "html").mkdir(parents=True)
    (tmp_path / "docs" / "pkg" / "html" / "a.html.txt").write_text("alpha beta")
    (tmp_path / "docs" / "pkg" / "b.pod.txt").write_text("gamma")
    (tmp_path / "handbook" / "book").mkdir(parents=True)
    (tmp_path / "handbook" / "book" / "c.html.txt").write_text("delta")
    docs = read_documents(["@docs", "@handbook"])
    assert [(d.name, d.source) for d in docs] == [("docs/pkg/b.pod.txt", "@docs"),
                                                ("docs/pkg/html/a.html.txt", "@docs"),
                                                ("handbook/book/c.html.txt", "@handbook")]
    assert "@handbook" in data.OUT_OF_DOMAIN and "@docs" not in data.OUT_OF_DOMAIN


def test_out_of_domain_sets_are_never_a_training_split(tmp_path, monkeypatch):
    from sas_backend import corpus
    from sas_backend.training.data import load_packed

    monkeypatch.setattr(corpus, "default_corpus_dir", lambda: str(tmp_path))
    (tmp_path / "handbook" / "book").mkdir(parents=True)
    for i in range(6):
        (tmp_path / "handbook" / "book" / f"{i}.txt").write_text(" ".join(["word"] * 50))
    with pytest.raises(DataError, match="reserved for out-of-domain evaluation"):
        load_packed(["@handbook"], _Tok(), 16, split="train")
    with pytest.raises(DataError, match="reserved for out-of-domain evaluation"):
        load_packed(["@essays", "@site-packages"], _Tok(), 16, split="train")
    every = load_packed(["@handbook"], _Tok(), 16, split="all", seed=None)
    held = load_packed(["@handbook"], _Tok(), 16, split="heldout", seed=None)
    assert every.tokens == 6 * 51 and held.tokens < every.tokens and every.record()["split"] == "all"
    assert "site_packages" not in every.record()


def test_docs_record_names_the_corpus_packages_and_manifest(tmp_path, monkeypatch):
    import hashlib
    import json

    from sas_backend import corpus
    from sas_backend.training.data import load_packed

    monkeypatch.setattr(corpus, "default_corpus_dir", lambda: str(tmp_path))
    (tmp_path / "docs" / "pkg").mkdir(parents=True)
    for i in range(4):
        (tmp_path / "docs" / "pkg" / f"{i}.txt").write_text(" ".join(["word"] * 40))
    assert load_packed(["@docs"], _Tok(), 16, split="train").record()["corpus"] == {}  # prepared by hand
    manifest = {"packages": [
        {"package": "a-doc", "version": "1.0", "sha256": "ab" * 32, "domain": "docs", "documents": 3},
        {"package": "b-book", "version": "2.0", "sha256": "cd" * 32, "domain": "handbook", "documents": 1}]}
    text = json.dumps(manifest)
    (tmp_path / "manifest.json").write_text(text)
    rec = load_packed(["@docs"], _Tok(), 16, split="train").record()["corpus"]
    assert rec == {"manifest_sha256": hashlib.sha256(text.encode()).hexdigest(),
                   "packages": [{"package": "a-doc", "version": "1.0", "sha256": "ab" * 32, "domain": "docs"}]}
    assert "corpus" not in load_packed(["@essays"], _Tok(), 16, split="train").record()


def test_site_packages_are_third_party_code_with_versions():
    from sas_backend.training.data import SITE_PACKAGES, site_packages_documents, site_packages_versions

    docs = site_packages_documents()
    versions = site_packages_versions()
    assert set(versions) == set(SITE_PACKAGES) and versions["requests"]
    assert all(d.name.startswith("site-packages/") and d.name.endswith(".py") for d in docs)
    assert any(d.name.startswith("site-packages/requests/") for d in docs)
    assert not any("/sas_backend/" in d.name or d.name.startswith("site-packages/torch/") for d in docs)
    from sas_backend.training.data import load_packed

    rec = load_packed(["@site-packages"], _Tok(), 64, split="all", max_tokens=2000).record()
    assert rec["site_packages"] == versions  # what was read is recorded
