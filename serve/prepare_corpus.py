#!/usr/bin/env python
"""Prepare the larger training corpus (prose from Debian's documentation packages), offline-reproducible.

    python serve/prepare_corpus.py [--out models/text/corpus] [--cache-dir ~/.cache/sas-backend]

Downloads pinned Debian packages (`apt-get download NAME=VERSION`, sha256 checked, kept in
`<cache>/debs`), unpacks them (`dpkg-deb -x`, nothing is installed), turns their manuals into plain
text (`sas_backend.training.doc_text`: HTML, POD, reStructuredText/AsciiDoc as they are), leaves out
license, copyright and changelog files and license paragraphs, removes duplicate documents and
paragraphs that repeat across 3 or more documents (navigation, footers), and writes one .txt per
document:

    <out>/docs/<package>/<path>.txt        training prose (`@docs`; the trainer's document-level
                                           held-out split applies: `--split heldout`)
    <out>/handbook/<package>/<path>.txt    out-of-domain prose (`@handbook`): The Debian Administrator's
                                           Handbook, a book no training set touches
    <out>/manifest.json                    packages, versions, sha256, what was kept and dropped

Code needs no download: `@stdlib` (the interpreter's standard library) is the training code, and
`@site-packages` (pinned third-party packages of the venv, `sas_backend.training.data`) is the
out-of-domain code, kept out of every training set. Idempotent: files are rewritten only if different.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from sas_backend import corpus
from sas_backend.training.doc_text import (
    TextDoc, dedupe, drop_license_paragraphs, html_text, is_boilerplate_path, pod_text,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prepare_model import DEFAULT_CACHE, PrepareError  # noqa: E402


@dataclasses.dataclass(frozen=True)
class DebSource:
    """A pinned Debian package and which of its files are documents."""

    package: str
    version: str
    sha256: str
    domain: str  # "docs" (training prose) or "handbook" (out-of-domain prose)
    include: tuple  # fnmatch patterns on the path inside the package
    fmt: str  # "html", "pod" or "text"
    exclude: tuple = ()

    @property
    def deb_name(self) -> str:
        return f"{self.package}_{self.version.replace(':', '%3a')}_all.deb"


SOURCES = (
    DebSource("python3.11-doc", "3.11.2-6+deb12u8", "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b",
              "docs", ("usr/share/doc/python3.11/html/_sources/*.rst.txt",), "text", ("*/whatsnew/*",)),
    DebSource("postgresql-doc-15", "15.18-0+deb12u1",
              "3c598277a463c44d672daa2c335deb8d8252e1852fb025fd4578ea2d9a1b90f0",
              "docs", ("usr/share/doc/postgresql-doc-15/html/*.html",), "html", ("*/release-*.html",)),
    DebSource("perl-doc", "5.36.0-7+deb12u3", "e9e3564ff5ade27de0585835f2acad769bcc545c0a0045a9f55d5401f27f7591",
              "docs", ("usr/share/perl/5.36.0/pod/*.pod",), "pod", ("*delta.pod", "*/perlhist.pod")),
    DebSource("git-doc", "1:2.39.5-0+deb12u3", "3c89668a11053a6bafade3de1f611f4613db31e082af63f43d8c5b69ad8795ec",
              "docs", ("usr/share/doc/git-doc/*.txt",), "text", ("*/RelNotes/*",)),
    DebSource("developers-reference", "12.18", "0dba82f6fa16e373f2a84ad07e7971aa9264ad2e7d2ae46b37edbc9c5fd57e2e",
              "docs", ("usr/share/developers-reference/_sources/*.rst.txt",), "text"),
    DebSource("debian-policy", "4.6.2.0", "ef9d01b625c3b87c3a845c2cd1b66f1a16e9240b2b9e5bee53472a00e8457a39",
              "docs", ("usr/share/doc/debian-policy/policy.html/_sources/*.rst.txt",), "text"),
    DebSource("debian-reference-en", "2.100", "9f31d3a17df505de09689ca255512ea58c1fc47c59bb1b0c7bf1c23362e9743f",
              "docs", ("usr/share/debian-reference/*.en.html",), "html"),
    DebSource("maint-guide", "1.2.53", "762c8a400a36668d2eb814a3ba356b06488fd889dfce478eb11d5cfb189a47b5",
              "docs", ("usr/share/doc/maint-guide/html/*.en.html",), "html"),
    DebSource("gnu-standards", "2022.03.23-0.1", "2087dda531c69d8505856a45e0334746f3f25211a237c95d375eed13a7d8c201",
              "docs", ("usr/share/doc/gnu-standards/*.html",), "html"),
    DebSource("debian-handbook", "11.20220922", "3d5dbeac1f1afc9c094eab9d0f701f6ecff99c4927d5a4794cf6c85678134faa",
              "handbook", ("usr/share/doc/debian-handbook/html/en-US/*.html",), "html"),
)
DOMAINS = ("docs", "handbook")
CONVERT = {"html": html_text, "pod": pod_text, "text": lambda s: s}


def log(msg: str) -> None:
    print(f"[prepare_corpus] {msg}", flush=True)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_deb(src: DebSource, cache_dir: str) -> str:
    """The package's .deb in `<cache>/debs`, downloaded with apt-get if missing; sha256 checked."""
    debs = os.path.join(cache_dir, "debs")
    os.makedirs(debs, exist_ok=True)
    path = os.path.join(debs, src.deb_name)
    if not os.path.exists(path):
        log(f"downloading {src.package}={src.version}")
        r = subprocess.run(["apt-get", "download", f"{src.package}={src.version}"], cwd=debs,
                           capture_output=True, text=True)
        if r.returncode != 0 or not os.path.exists(path):
            raise PrepareError(f"apt-get download {src.package}={src.version} failed (exit {r.returncode}): "
                               f"{(r.stderr or r.stdout).strip()[-400:]}\nOn a Debian 12 machine with network "
                               f"access run `apt-get update` first; elsewhere fetch {src.deb_name} from a Debian "
                               f"mirror into {debs}")
    got = sha256_file(path)
    if got != src.sha256:
        raise PrepareError(f"{path}: sha256 {got}, expected {src.sha256} (a different build of the package?)")
    return path


def package_documents(src: DebSource, deb: str) -> tuple[list[TextDoc], dict]:
    """The package's documents as text, named `<package>/<path inside the package>`; and what was skipped."""
    stats = {"files_matched": 0, "boilerplate_files": [], "excluded_files": 0, "license_paragraphs": 0}
    docs = []
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["dpkg-deb", "-x", deb, tmp], check=True)
        root = pathlib.Path(tmp)
        files = sorted(p for p in root.rglob("*") if p.is_file())
        for p in files:
            rel = p.relative_to(root).as_posix()
            if not any(fnmatch.fnmatch(rel, pat) for pat in src.include):
                continue
            stats["files_matched"] += 1
            if any(fnmatch.fnmatch(rel, pat) for pat in src.exclude):
                stats["excluded_files"] += 1
                continue
            if is_boilerplate_path(rel.removesuffix(".txt").removesuffix(".rst")):
                stats["boilerplate_files"].append(rel)
                continue
            text = CONVERT[src.fmt](p.read_text(encoding="utf-8", errors="replace"))
            text, dropped = drop_license_paragraphs(text)
            stats["license_paragraphs"] += dropped
            if text.strip():
                docs.append(TextDoc(f"{src.package}/{rel}", text))
    return docs, stats


def write_documents(docs: list[TextDoc], out_dir: pathlib.Path) -> int:
    """One .txt per document under out_dir (rewritten only if different); stale .txt files removed."""
    wanted = {}
    for d in docs:
        name = d.name if d.name.endswith(".txt") else d.name + ".txt"
        wanted[out_dir / name] = d.text + "\n"
    for path in out_dir.rglob("*.txt") if out_dir.exists() else []:
        if path not in wanted:
            path.unlink()
    for path, text in wanted.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
    return len(wanted)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=corpus.default_corpus_dir(), help="output directory (default %(default)s)")
    p.add_argument("--cache-dir", default=os.environ.get("SAS_CACHE_DIR", DEFAULT_CACHE),
                   help=f"download cache (default $SAS_CACHE_DIR or {DEFAULT_CACHE})")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    manifest = {"what": "training and out-of-domain prose from Debian documentation packages (serve/prepare_corpus.py)",
                "packages": [], "domains": {}}
    by_domain: dict[str, list[TextDoc]] = {d: [] for d in DOMAINS}
    try:
        for src in SOURCES:
            deb = fetch_deb(src, args.cache_dir)
            docs, stats = package_documents(src, deb)
            by_domain[src.domain] += docs
            manifest["packages"].append({**dataclasses.asdict(src), "documents": len(docs),
                                         "chars": sum(len(d.text) for d in docs), **stats})
            log(f"{src.package} {src.version}: {len(docs)} documents, {sum(len(d.text) for d in docs)} chars "
                f"({len(stats['boilerplate_files'])} license/changelog files and {stats['license_paragraphs']} "
                f"license paragraphs left out)")
    except (PrepareError, subprocess.CalledProcessError) as e:
        print(f"[prepare_corpus] error: {e}", file=sys.stderr)
        return 1
    for domain, docs in by_domain.items():
        kept, stats = dedupe(docs)
        n = write_documents(kept, out / domain)
        manifest["domains"][domain] = {"documents": n, "chars": sum(len(d.text) for d in kept), **stats}
        log(f"{domain}: {n} documents, {manifest['domains'][domain]['chars']} chars in {out / domain} ({stats})")
    text = json.dumps(manifest, indent=1) + "\n"
    (out / "manifest.json").write_text(text)
    log(f"manifest sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}: {out / 'manifest.json'}")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
