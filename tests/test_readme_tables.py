"""The README's and docs' result tables agree with the committed records: every block that
bench/readme_tables.py generates is regenerated and compared with the page it sits in, and the checker
itself is shown to catch a hand edit, a missing block and a stray one. Plain JSON and Markdown reads."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("readme_tables", REPO / "bench" / "readme_tables.py")
tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tables)


@pytest.mark.parametrize("name", sorted(tables.BLOCKS))
def test_generated_block_matches_its_records(name):
    page, make = tables.BLOCKS[name]
    text = page.read_text(encoding="utf-8")
    found = tables.find_blocks(text)
    assert name in found, f"{page.relative_to(REPO)} has no block {name!r}: add its markers and run --write"
    start, end = found[name]
    assert text[start:end] == make(page).rstrip("\n") + "\n", (
        f"{page.relative_to(REPO)}: block {name!r} disagrees with its records; "
        f"`python bench/readme_tables.py --show {name}` prints what they say, `--write` puts it in")


def test_no_page_holds_an_unknown_or_misplaced_block():
    assert tables.problems() == []


def test_every_quality_table_names_its_window_count():
    """Each quality table's columns say how many windows their numbers rest on."""
    for name in ("smollm2-quality", "qwen-quality", "qwen-prose"):
        page, make = tables.BLOCKS[name]
        header = next(line for line in make(page).splitlines() if line.startswith("| selector |"))
        columns = [c.strip() for c in header.strip("|").split("|")][1:]
        assert columns and all(re.search(r"\b\d+ windows? of \d+ tokens\b", c) for c in columns), (name, columns)


def test_the_checker_catches_a_hand_edit_a_missing_block_and_a_stray_one():
    readme = tables.README
    text = readme.read_text(encoding="utf-8")
    start, end = tables.find_blocks(text)["cpu-decode"]
    body = text[start:end]
    edited = text[:start] + body.replace("4.60x", "4.70x", 1) + text[end:]
    assert body != edited[start:start + len(body)]
    assert any("'cpu-decode' differs" in p for p in tables.problems({readme: edited}))

    begin = "<!-- generated: cpu-decode (bench/readme_tables.py) -->\n"
    missing = text[:text.index(begin)] + text[end + len(tables.END):]
    assert any("'cpu-decode' is missing" in p for p in tables.problems({readme: missing}))

    stray = text + "\n<!-- generated: made-up (bench/readme_tables.py) -->\nx\n<!-- /generated -->\n"
    assert any("'made-up' is not generated" in p for p in tables.problems({readme: stray}))

    unclosed = text + "\n<!-- generated: made-up (bench/readme_tables.py) -->\nx\n"
    assert any("has no" in p for p in tables.problems({readme: unclosed}))


def test_replace_block_rewrites_only_between_the_markers():
    text = "intro\n<!-- generated: soak (bench/readme_tables.py) -->\nold\n<!-- /generated -->\noutro\n"
    out = tables.replace_block(text, "soak", "new line")
    assert out == "intro\n<!-- generated: soak (bench/readme_tables.py) -->\nnew line\n<!-- /generated -->\noutro\n"
    assert tables.replace_block(out, "soak", "new line") == out


def test_the_numbers_are_the_records_numbers():
    """Spot checks against the JSON, computed here independently of the generator's helpers."""
    rec = tables.record(tables.CPU_DECODE)
    row = next(r for r in rec["rows"] if r["context"] == 7680 and r["batch"] == 8)
    ratio = row["sas"]["512"]["tok_s"] / row["dense"]["tok_s"]
    page, make = tables.BLOCKS["cpu-decode"]
    assert f"| 7680 | 8 | {row['dense']['tok_s']:.2f} | {row['sas']['512']['tok_s']:.2f} ({ratio:.2f}x) |" in make(page)

    res = tables.record(tables.QWEN_CODE[32000])
    gate = [100 * (res["results"]["gate+s1l1"][str(b["budget"])] / res["dense"] - 1) for b in res["budgets"]]
    page, make = tables.BLOCKS["qwen-quality"]
    assert " / ".join(f"{g:+.1f}" for g in gate) + "%" in make(page)
    assert "1 window of 32000 tokens" in make(page)

    soak = tables.record(tables.SOAK[0])
    page, make = tables.BLOCKS["soak"]
    assert str(soak["failures"]) in make(page)  # the record's own verdict is quoted, not restated


def test_paired_change_and_its_noise():
    """The head-to-head's "vs start": per window the difference of mean NLL per scored token, exp(mean) - 1,
    with two standard errors over the windows; "better" only beyond them."""
    import math

    last = 100
    res = {"last": last, "nll_per_window": {
        "a+s1l1": {"512": [100.0 - 1.0, 200.0 - 1.2, 150.0 - 0.8]},  # lower on every window: ~-1% per token
        "shipped+s1l1": {"512": [100.0, 200.0, 150.0]},
        "b+s1l1": {"512": [100.0 + 3.0, 200.0 - 3.0, 150.0]},  # no consistent difference
    }}
    mean, two_se = tables.paired(res, "a+s1l1", "shipped+s1l1", 512)
    assert math.isclose(mean, 100 * math.expm1(-0.01), rel_tol=1e-9)
    assert math.isclose(two_se, 100 * 2 * 0.002 / math.sqrt(3), rel_tol=1e-6) and two_se < abs(mean)
    assert tables.svd_verdict(res, "a", 512) == "better" and tables.svd_verdict(res, "b", 512) == "within noise"
    res["nll_per_window"]["c+s1l1"] = {"512": [101.0, 201.2, 150.8]}
    assert tables.svd_verdict(res, "c", 512) == "worse"
