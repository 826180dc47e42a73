"""The documentation's links hold: every relative Markdown link and image in the README, docs/ and the
results READMEs names a file (or folder) that exists, and every study folder under bench/results/ is
listed in bench/results/README.md. Plain file reads; no server, no model."""

from __future__ import annotations

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"

# [text](target) and ![alt](target), target up to the first space or ")" (an optional "title" may follow)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_SRC = re.compile(r"<(?:img|a)\s[^>]*(?:src|href)=\"([^\"]+)\"", re.IGNORECASE)
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def doc_files():
    files = [REPO / "README.md", REPO / "sas_backend" / "training" / "README.md",
             REPO / "gate_checkpoints" / "README.md"]
    files += sorted((REPO / "docs").glob("*.md"))
    files += sorted(RESULTS.glob("**/README.md"))
    return [f for f in files if f.is_file()]


def strip_code(text: str) -> str:
    """The text without fenced code blocks, indented code blocks and inline code spans (their brackets
    are code, not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    ") or line.startswith("\t"):
            continue
        out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def relative_links(path: pathlib.Path):
    text = strip_code(path.read_text(encoding="utf-8"))
    for target in LINK.findall(text) + HTML_SRC.findall(text):
        if target.startswith(EXTERNAL) or target.startswith("#"):
            continue
        yield target


def test_the_docs_exist():
    assert (REPO / "README.md").is_file() and (RESULTS / "README.md").is_file()
    assert len(list((REPO / "docs").glob("*.md"))) >= 6


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    broken = []
    for target in relative_links(doc):
        file_part = target.split("#", 1)[0].split("?", 1)[0]
        if not file_part:
            continue
        resolved = (doc.parent / file_part).resolve()
        if not resolved.exists():
            broken.append(target)
        elif not resolved.is_relative_to(REPO):
            broken.append(f"{target} (outside the repository)")
    assert not broken, f"{doc.relative_to(REPO)}: broken links {broken}"


def test_every_results_folder_is_indexed():
    index = RESULTS / "README.md"
    linked = {t.split("#", 1)[0].rstrip("/").split("/", 1)[0] for t in relative_links(index)}
    folders = sorted(p.name for p in RESULTS.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
    missing = [f for f in folders if f not in linked]
    assert not missing, f"bench/results/README.md does not list {missing}: add a row for each study folder"


def test_link_checker_sees_links(tmp_path):
    """The checker is not vacuous: it finds links and images, and ignores code and external links."""
    sample = tmp_path / "sample.md"
    sample.write_text("[a](x.md) ![b](img/y.png \"t\") [c](https://e.org) [d](#top) `[e](code.md)`\n\n"
                      "    [f](indented.md)\n```\n[g](fenced.md)\n```\n<img src=\"z.png\">\n", encoding="utf-8")
    assert list(relative_links(sample)) == ["x.md", "img/y.png", "z.png"]
