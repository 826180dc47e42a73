"""Plain text out of documentation files, with boilerplate and duplicates kept out.

The training corpus (`serve/prepare_corpus.py`) is built from documentation that Debian packages
ship: HTML manuals, POD, reStructuredText and AsciiDoc sources. Here: the format converters, the
license filter and the cross-document deduplication; no I/O beyond strings.

Why the filters: license and copyright texts repeat verbatim across packages, so a document-level
held-out split still leaks them, and a model scores them near-perfectly, which flatters every
selector alike. Navigation bars and footers of HTML manuals repeat on every page the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import html.parser
import re
from typing import Dict, Iterable, List, Sequence, Tuple

# A paragraph naming one of these is a license or copyright notice, not prose.
LICENSE_MARKERS = re.compile(
    r"GNU (?:Lesser |Library |Affero )?General Public License|Permission is hereby granted|"
    r"Redistribution and use in source and binary forms|THE SOFTWARE IS PROVIDED|"
    r"WITHOUT ANY WARRANTY|Licensed under the Apache License|Creative Commons|"
    r"PYTHON SOFTWARE FOUNDATION LICENSE|GNU Free Documentation License|Artistic License|"
    r"All rights reserved|Copyright \(c\)|Copyright ©|©\s*\d{4}|Copyright \d{4}",
    re.IGNORECASE,
)
# Files that are license texts (or changelogs) by their name.
BOILERPLATE_NAME = re.compile(r"(^|/)(licen[cs]e|copying|copyright|legalnotice|changelog|changes|news|authors)"
                              r"([._-][^/]*)?$", re.IGNORECASE)


def is_boilerplate_path(path: str) -> bool:
    """True for a license, copyright or changelog file by its name (`.../LICENSE.txt`, `legalnotice.html`)."""
    return bool(BOILERPLATE_NAME.search(path))


def paragraphs(text: str) -> List[str]:
    """Blank-line separated paragraphs, stripped, empty ones dropped."""
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def drop_license_paragraphs(text: str) -> Tuple[str, int]:
    """The text without its license/copyright paragraphs; and how many were dropped."""
    keep, dropped = [], 0
    for p in paragraphs(text):
        if LICENSE_MARKERS.search(p):
            dropped += 1
        else:
            keep.append(p)
    return "\n\n".join(keep), dropped


# ------------------------------------------------------------------------------------- HTML
class _HTMLText(html.parser.HTMLParser):
    """Text of an HTML page: block elements end paragraphs, <pre> keeps its lines, navigation,
    scripts, styles and headers/footers are skipped."""

    BLOCK = {"p", "div", "section", "article", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "tr",
             "table", "ul", "ol", "dl", "blockquote", "pre", "br", "hr", "title", "caption", "figure"}
    SKIP = {"script", "style", "nav", "head", "header", "footer", "noscript", "svg"}
    SKIP_CLASSES = re.compile(r"\b(navheader|navfooter|sphinxsidebar|related|breadcrumb|toc|footer|header|"
                              r"headerlink|docnav|legalnotice|copyright)\b")

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out: List[str] = []
        self.stack: List[Tuple[str, bool]] = []  # (tag, skipped) for elements that have an end tag
        self.pre = 0

    @property
    def skipping(self) -> bool:
        return any(skipped for _, skipped in self.stack)

    VOID = {"br", "hr", "img", "meta", "link", "input", "area", "base", "col", "embed", "source", "wbr"}

    def handle_starttag(self, tag, attrs):
        if tag in self.BLOCK:
            self.out.append("\n\n" if tag not in ("br", "li", "tr", "dt", "dd") else "\n")
        if tag in self.VOID:
            return
        cls = " ".join(v or "" for k, v in attrs if k in ("class", "id", "role"))
        skipped = tag in self.SKIP or bool(self.SKIP_CLASSES.search(cls))
        self.stack.append((tag, skipped))
        if tag == "pre":
            self.pre += 1

    def handle_endtag(self, tag):
        # pop to the matching start tag (HTML in the wild leaves some unclosed)
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in self.BLOCK:
            self.out.append("\n\n")

    def handle_data(self, data):
        if self.skipping:
            return
        self.out.append(data if self.pre else re.sub(r"\s+", " ", data))


def html_text(page: str) -> str:
    """Readable text of an HTML page (str -> str): paragraphs separated by blank lines."""
    parser = _HTMLText()
    parser.feed(page)
    parser.close()
    text = "".join(parser.out)
    lines = [ln.rstrip() for ln in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


# -------------------------------------------------------------------------------------- POD
_POD_CODE = re.compile(r"[BICFSXZLE]<<+\s(.*?)\s>>+|[BICFSXZLE]<([^<>]*)>", re.DOTALL)
_POD_ESCAPES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/", "quot": '"', "amp": "&", "apos": "'"}


def _pod_codes(text: str) -> str:
    """Formatting codes to their text: B<x> -> x, L<text|target> -> text, E<gt> -> >, nested ones too."""
    def one(m):
        inner = m.group(1) if m.group(1) is not None else m.group(2)
        code = m.group(0)[0]
        if code == "E":
            return _POD_ESCAPES.get(inner, "")
        if code in "XZ":
            return ""
        if code == "L":
            return inner.split("|", 1)[0] if "|" in inner else inner.split("/", 1)[-1].strip('"')
        return inner
    for _ in range(8):  # innermost first until none is left
        new = _POD_CODE.sub(one, text)
        if new == text:
            break
        text = new
    return text


def pod_text(pod: str) -> str:
    """Text of a Perl POD document (str -> str): headings and items as paragraphs, verbatim blocks kept,
    formatting codes resolved, `=begin`/`=for` blocks for other formats and `=cut` code dropped."""
    out, in_pod, skip_block = [], False, None  # text before the first command is code
    for para in re.split(r"\n\s*\n", pod):
        stripped = para.strip("\n")
        if not stripped.strip():
            continue
        if stripped.startswith("="):
            cmd, _, rest = stripped[1:].partition(" ")
            cmd = cmd.strip().split("\n")[0]
            if cmd == "cut":
                in_pod = False
            elif cmd == "pod":
                in_pod = True
            elif cmd == "begin":
                in_pod, skip_block = True, rest.strip().split()[0] if rest.strip() else ""
            elif cmd == "end":
                skip_block = None
            elif cmd in ("head1", "head2", "head3", "head4", "item"):
                in_pod = True
                if skip_block is None and rest.strip() and rest.strip() not in ("*", "-"):
                    out.append(_pod_codes(rest.strip()))
            elif cmd in ("over", "back", "encoding", "for"):
                in_pod = True
            continue
        if not in_pod or skip_block is not None:
            continue
        if stripped[0] in " \t":  # verbatim
            out.append(stripped)
        else:
            out.append(_pod_codes(" ".join(stripped.split())))
    return "\n\n".join(out)


# ---------------------------------------------------------------------------------- dedup
@dataclasses.dataclass
class TextDoc:
    """One extracted document: a stable name (`<package>/<path>`) and its text."""

    name: str
    text: str


def _norm(text: str) -> str:
    return " ".join(text.split()).lower()


def dedupe(docs: Sequence[TextDoc], *, repeat_threshold: int = 3,
           min_chars: int = 40) -> Tuple[List[TextDoc], Dict[str, int]]:
    """Documents with duplicates removed, and counts of what went.

    - A document whose whole (whitespace-normalized) text equals an earlier one's is dropped.
    - A paragraph of at least `min_chars` characters found in `repeat_threshold` or more documents is
      boilerplate (navigation, footers, notices) and is dropped from all of them.
    - A document left empty is dropped.
    Order is kept; the first of equal documents stays.
    """
    seen_docs, unique = set(), []
    dup_docs = 0
    for d in docs:
        h = hashlib.sha1(_norm(d.text).encode()).hexdigest()
        if h in seen_docs:
            dup_docs += 1
            continue
        seen_docs.add(h)
        unique.append(d)
    counts: Dict[str, int] = {}
    per_doc = []
    for d in unique:
        keys = {_norm(p) for p in paragraphs(d.text) if len(p) >= min_chars}
        per_doc.append(keys)
        for k in keys:
            counts[k] = counts.get(k, 0) + 1
    repeated = {k for k, n in counts.items() if n >= repeat_threshold}
    out, dropped_paras, emptied = [], 0, 0
    for d in unique:
        keep = []
        for p in paragraphs(d.text):
            if len(p) >= min_chars and _norm(p) in repeated:
                dropped_paras += 1
            else:
                keep.append(p)
        if keep:
            out.append(TextDoc(d.name, "\n\n".join(keep)))
        else:
            emptied += 1
    return out, {"duplicate_documents": dup_docs, "repeated_paragraphs_dropped": dropped_paras,
                 "distinct_repeated_paragraphs": len(repeated), "documents_emptied": emptied}


def total_chars(docs: Iterable[TextDoc]) -> int:
    return sum(len(d.text) for d in docs)
