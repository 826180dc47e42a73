"""The documentation's links hold: every relative Markdown link and image in the README, docs/ and the
results READMEs names a file (or folder) that exists, every file a results README names in inline code is
committed, and every study folder under bench/results/ is listed in bench/results/README.md. Plain file
reads; no server, no model."""

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
# a result file named in inline code: `name.json`, `quality-{code,essays}.{json,md}` (no folder, no placeholder)
RESULT_FILE = re.compile(r"[\w.{},\-]+\.(?:json|jsonl|md|tsv|csv|png|svg|txt|log|\{[\w,]+\})")


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


def brace_expand(name: str) -> list[str]:
    """`a.{json,md}` -> [a.json, a.md]; nested and repeated groups multiply."""
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [x for alt in m.group(1).split(",") for x in brace_expand(name[:m.start()] + alt + name[m.end():])]


def named_result_files(readme: pathlib.Path) -> list[str]:
    """The file names a results README writes in inline code outside code blocks (`-ppl.png`-style suffixes
    of the name before them are not names)."""
    text = re.sub(r"```.*?```", "", readme.read_text(encoding="utf-8"), flags=re.S)
    spans = re.findall(r"`([^`\s]+)`", text)
    return [n for span in spans if RESULT_FILE.fullmatch(span) and not span.startswith("-")
            for n in brace_expand(span)]


@pytest.mark.parametrize("readme", sorted(RESULTS.glob("*/README.md")), ids=lambda p: p.parent.name)
def test_named_result_files_are_committed(readme):
    """A study's README that names a record (`ruler-...json`) names a file that is in the repository: in its
    folder, or in another results folder it refers to (a .gitignored partial record would fail here)."""
    everywhere = {p.name for p in RESULTS.rglob("*") if p.is_file()}
    missing = [n for n in named_result_files(readme) if not (readme.parent / n).exists() and n not in everywhere]
    assert not missing, f"{readme.relative_to(REPO)} names files that are not committed: {missing}"


def test_named_result_files_reads_inline_code(tmp_path):
    """The name reader expands braces, skips suffixes, paths, placeholders and code blocks."""
    sample = tmp_path / "README.md"
    sample.write_text("`q-{a,b}.{json,md}`, `-ppl.png`, `x/y.json`, `train-<arm>.jsonl`, `r.partial.json`\n"
                      "```\n`fenced.json`\n```\n", encoding="utf-8")
    assert named_result_files(sample) == ["q-a.json", "q-a.md", "q-b.json", "q-b.md", "r.partial.json"]


def test_link_checker_sees_links(tmp_path):
    """The checker is not vacuous: it finds links and images, and ignores code and external links."""
    sample = tmp_path / "sample.md"
    sample.write_text("[a](x.md) ![b](img/y.png \"t\") [c](https://e.org) [d](#top) `[e](code.md)`\n\n"
                      "    [f](indented.md)\n```\n[g](fenced.md)\n```\n<img src=\"z.png\">\n", encoding="utf-8")
    assert list(relative_links(sample)) == ["x.md", "img/y.png", "z.png"]
