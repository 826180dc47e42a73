"""tests/server/compare.py, the one comparison of two servers' greedy decodes, on made-up decodes (no server):
it fails on a short decode, on a logprob off by more than the tolerance at any step, on a differing token that is
not a near tie, and on more near-tie swaps than allowed; a near-tie swap within the allowance is reported (a
NearTieWarning and the report), never skipped silently. The helper it replaced (tests/server/conftest.py's
`assert_identical_up_to_a_near_tie` and tests/gpu's `_assert_same_greedy`) passed every one of the failing cases
below: `zip` cut the longer decode, logprobs were never compared, and any swap within 0.3 ended the comparison."""

from __future__ import annotations

import pytest

from tests.server.compare import EXACT, Decode, NearTieWarning, Tolerance, assert_same_decodes, decode_from_response

TOL = Tolerance(logprob=1e-3, near_tie=1e-2, max_near_ties=1)


def _decode(steps):
    """steps: [(chosen token, [(logprob, token), (logprob, token)])]; the chosen token's logprob from its top-2."""
    tokens = [t for t, _ in steps]
    top = [sorted(top2, reverse=True) for _, top2 in steps]
    logprobs = [next(lp for lp, x in t2 if x == t) for t, t2 in zip(tokens, top)]
    return Decode(tokens, logprobs, top, text=" ".join(map(str, tokens)))


REF = _decode([(5, [(-0.1, 5), (-2.5, 7)]), (6, [(-0.7, 6), (-0.701, 8)]), (9, [(-0.2, 9), (-3.0, 4)]),
               (3, [(-0.05, 3), (-4.0, 1)])])


def _with(step, chosen, top2, base=REF):
    steps = [(t, [(lp, x) for lp, x in tp]) for t, tp in zip(base.token_ids, base.top)]
    steps[step] = (chosen, top2)
    return _decode(steps)


def test_identical_decodes_pass_exactly():
    report = assert_same_decodes(REF, _decode([(t, tp) for t, tp in zip(REF.token_ids, REF.top)]), EXACT, "same", n=4)
    assert report.tokens_compared == 4 and report.max_logprob_diff == 0 and not report.near_ties


def test_a_short_decode_fails():
    short = Decode(REF.token_ids[:3], REF.logprobs[:3], REF.top[:3], text="")
    with pytest.raises(AssertionError, match="has 3 tokens"):
        assert_same_decodes(REF, short, TOL, "short", n=4)
    with pytest.raises(AssertionError, match="has 3 tokens"):  # either side
        assert_same_decodes(short, REF, TOL, "short", n=4)


def test_a_logprob_off_by_more_than_the_tolerance_fails_at_any_step():
    for step in range(4):
        t = REF.token_ids[step]
        top2 = [(lp - 5e-3 if x == t else lp, x) for lp, x in REF.top[step]]
        with pytest.raises(AssertionError, match=f"step {step} "):
            assert_same_decodes(REF, _with(step, t, top2), TOL, "off", n=4)
    # within the tolerance: passes, and the report says how far
    t = REF.token_ids[2]
    report = assert_same_decodes(REF, _with(2, t, [(-0.2004, 9), (-3.0, 4)]), TOL, "close", n=4)
    assert report.max_logprob_diff == pytest.approx(4e-4)


def test_a_differing_token_that_is_not_a_near_tie_fails():
    with pytest.raises(AssertionError, match="not a near tie"):
        assert_same_decodes(REF, _with(0, 7, [(-0.1, 7), (-2.5, 5)]), TOL, "swap", n=4)


def test_a_near_tie_swap_is_reported_and_counted():
    got = _with(1, 8, [(-0.7004, 8), (-0.7006, 6)])  # tokens 6 and 8 swapped (gaps 1e-3 / 2e-4), each within 1e-3
    got = _with(2, 4, [(-0.1, 4), (-3.0, 9)], base=got)  # the continuation differs: not compared
    with pytest.warns(NearTieWarning, match="step 1 of 4"):
        report = assert_same_decodes(REF, got, TOL, "tie", n=4)
    assert [(t.sequence, t.step, t.ref_token, t.got_token) for t in report.near_ties] == [(0, 1, 6, 8)]
    assert report.tokens_compared == 1
    assert "1 near-tie swap(s)" in report.line()
    # more swaps than allowed fail (two sequences, one allowed)
    with pytest.warns(NearTieWarning), pytest.raises(AssertionError, match="more near-tie swaps than the 1"):
        assert_same_decodes([REF, REF], [got, got], TOL, "ties", n=4)
    none_allowed = Tolerance(logprob=1e-3, near_tie=1e-2, max_near_ties=0)
    with pytest.warns(NearTieWarning), pytest.raises(AssertionError, match="more near-tie swaps than the 0"):
        assert_same_decodes(REF, got, none_allowed, "none allowed", n=4)
    with pytest.raises(AssertionError, match="not a near tie"):  # EXACT: any swap fails
        assert_same_decodes(REF, got, EXACT, "exact", n=4)


def test_a_near_tie_swap_must_have_the_same_two_tokens_with_the_same_logprobs():
    with pytest.raises(AssertionError, match="token 6's logprobs"):  # the runner-up's logprob moved
        assert_same_decodes(REF, _with(1, 8, [(-0.7004, 8), (-0.702, 6)]), TOL, "moved", n=4)
    with pytest.raises(AssertionError, match="token 6's logprobs"):  # another token came second
        assert_same_decodes(REF, _with(1, 8, [(-0.7004, 8), (-0.7006, 2)]), TOL, "third", n=4)


def test_decode_from_a_generate_response():
    out = {"text": "ab", "meta_info": {"finish_reason": {"type": "length"},
                                       "output_token_logprobs": [[-0.1, 5, None], [-0.7, 6, None]],
                                       "output_top_logprobs": [[[-0.1, 5, None], [-2.5, 7, None]],
                                                               [[-0.705, 8, None], [-0.7, 6, None]]]}}
    d = decode_from_response(out)
    assert d.token_ids == [5, 6] and d.logprobs == [-0.1, -0.7]
    assert d.top == [[(-0.1, 5), (-2.5, 7)], [(-0.7, 6), (-0.705, 8)]]  # highest first
    assert d.head(1).token_ids == [5]
