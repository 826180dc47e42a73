"""Documentation text extraction for the training corpus: formats, license filter, deduplication."""

from __future__ import annotations

from sas_backend.training.doc_text import (
    TextDoc,
    dedupe,
    drop_license_paragraphs,
    html_text,
    is_boilerplate_path,
    pod_text,
)


def test_html_text_keeps_prose_and_code_and_drops_navigation():
    page = """<html><head><title>T</title><script>var x = 1;</script><style>p {}</style></head><body>
    <div class="navheader"><a href="a.html">Prev</a> Next</div>
    <h1>Chapter&nbsp;1</h1><p>First   paragraph
    spans lines &amp; has an entity.</p>
    <pre>def f():
    return 1</pre>
    <ul><li>one</li><li>two</li></ul><br>
    <div class="footer">Copyright footer</div></body></html>"""
    text = html_text(page)
    assert "First paragraph spans lines & has an entity." in text
    assert "def f():\n    return 1" in text  # <pre> keeps its lines and indentation
    assert "Chapter 1" in text and "one\n\ntwo" in text  # list items are paragraphs
    for gone in ("var x", "Prev", "Copyright footer", "p {}"):
        assert gone not in text
    assert "\n\n\n" not in text


def test_pod_text_resolves_codes_and_skips_non_pod():
    pod = """#!/usr/bin/perl
code before pod

=head1 NAME

perlfoo - the B<bold> and I<italic> of C<< $x->y >>

=head2 See L<perlsyn/Loops> and L<the docs|perlfunc>

=over 4

=item *

An item with E<lt>escapesE<gt>.

=back

    verbatim   block

=begin html

<p>html only</p>

=end html

=cut

sub more_code {}
"""
    text = pod_text(pod)
    assert "perlfoo - the bold and italic of $x->y" in text
    assert "See Loops and the docs" in text
    assert "An item with <escapes>." in text
    assert "    verbatim   block" in text
    for gone in ("code before pod", "html only", "more_code", "=head", "=over", "B<"):
        assert gone not in text


def test_license_paragraphs_and_files_are_left_out():
    text = "Real prose here.\n\nPermission is hereby granted, free of charge, to any person.\n\nMore prose."
    kept, dropped = drop_license_paragraphs(text)
    assert kept == "Real prose here.\n\nMore prose." and dropped == 1
    assert drop_license_paragraphs("Copyright (c) 2001 Someone\n\nok")[1] == 1
    for path in ("pkg/LICENSE", "x/COPYING.txt", "doc/copyright", "html/legalnotice.html", "whatsnew/changelog.rst"):
        assert is_boilerplate_path(path), path
    for path in ("html/tutorial.html", "pod/perlsyn.pod", "licensed-features.html.txt"):
        assert not is_boilerplate_path(path), path


def test_dedupe_drops_duplicate_documents_and_repeated_paragraphs():
    nav = "Home | Chapters | Index | Search the whole manual here"
    docs = [TextDoc("a", f"{nav}\n\nAlpha text that is long enough to count.\n\nshort"),
            TextDoc("b", f"{nav}\n\nBeta text, also long enough to count here."),
            TextDoc("c", f"{nav}\n\nGamma text, long enough to be counted too."),
            TextDoc("d", f"{nav}\n\nAlpha text that is long enough to count.\n\nshort"),  # a duplicate of a
            TextDoc("e", nav)]  # nothing but boilerplate
    kept, stats = dedupe(docs)
    assert [d.name for d in kept] == ["a", "b", "c"]
    assert kept[0].text == "Alpha text that is long enough to count.\n\nshort"
    assert stats == {"duplicate_documents": 1, "repeated_paragraphs_dropped": 4, "distinct_repeated_paragraphs": 1,
                     "documents_emptied": 1}
