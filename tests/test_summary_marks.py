"""Summaries that know they are valid (issue 65 item 2, CPU): a page handed out again loses its summary's mark,
and a decode step summarizes the unmarked candidate pages of its requests before selecting, so a page reused by
a second request whose KV landed without an extend through sas (as a prefill-decode transfer lands it) never
lends the first request's summary. Driven on SGLang's real CPU pools (tests/backend_rig.py) and its real paged
allocator."""

from __future__ import annotations

import pytest
import torch

from sas_backend.backend.page_marks import watch_allocations
from sas_backend.ops.rope import apply_rope
from tests.backend_rig import B, H_KV, D, LAYERS, Rig, decode_fb, decode_layers, spy_selection

PROMPT = 100  # 12 complete blocks of 8, K = 3


def test_allocations_report_their_pages():
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    allocator = PagedTokenToKVPoolAllocator(16 * B, B, torch.float32, "cpu", None, False)
    seen = []
    assert watch_allocations(allocator, B, seen.append) == ["alloc", "alloc_extend", "alloc_decode"]
    out = allocator.alloc(3 * B)
    assert sorted(set(torch.cat(seen).tolist())) == sorted(set((out // B).tolist())) and len(set(out.tolist())) == 3 * B
    seen.clear()
    assert allocator.alloc(100 * B) is None and seen == []  # a failed allocation hands nothing out
    allocator.free(out)
    again = allocator.alloc(16 * B - B)  # every page but the padding page, the freed ones among them
    assert set((out // B).tolist()) <= set(torch.cat(seen).tolist()) == set((again // B).tolist())


def _reuse_pages(rig, first, second, check_marks):
    """Request `first` served (summaries marked, as an extend leaves them), then its pages handed to `second`
    (the allocator's hook clears their marks) whose KV is written straight into them, no extend through sas."""
    rig.backend.check_marks = check_marks
    rig.add_request(first, PROMPT)
    pages = rig.req_pool.req_to_token[first, : PROMPT : B].long() // B
    rig.backend.summaries.invalidate(pages)  # what watch_allocations does when the pages are handed out again
    rig.req_pool.req_to_token[second] = rig.req_pool.req_to_token[first]
    rig.lens[second] = PROMPT
    slots = rig.req_pool.req_to_token[second, :PROMPT].long()
    for lid in range(LAYERS):
        rig.kv_pool.k_buffer[lid][slots] = apply_rope(torch.randn(PROMPT, H_KV, D, generator=rig.g),
                                                     rig.backend.step.model_table[:PROMPT])
        rig.kv_pool.v_buffer[lid][slots] = torch.randn(PROMPT, H_KV, D, generator=rig.g)
    return pages[: PROMPT // B]


def _fresh(rig, req, pages):
    """The summaries the second request's KV calls for, per layer."""
    starts = torch.arange(pages.numel()) * B
    return {lid: rig.backend.selector.summarize(rig.backend.gates[lid], rig.kv_pool.k_buffer[lid], pages, starts,
                                                rig.backend.step.model_table, rig.backend.step.gate_table)
            for lid in range(LAYERS)}


def _decode(rig, req):
    selections = spy_selection(rig)
    inp = rig.step_inputs([req])
    fb = decode_fb(inp["seq_lens"], inp["positions"], inp["reqs"], inp["out_cache_loc"], 1)
    rig.backend.init_forward_metadata(fb)
    decode_layers(rig, fb, inp["qkv"])
    rig.advance([req])
    return selections[-1] if selections else None  # a covered step attends densely and selects nothing


@pytest.mark.parametrize("sub_blocks", [1, 4])
def test_a_reused_page_never_lends_its_old_summary(sub_blocks):
    rig = Rig(budget=3, sub_blocks=sub_blocks, seed=5, force_sparse=True)
    pages = _reuse_pages(rig, 1, 2, check_marks=True)
    want = _fresh(rig, 2, pages)
    got_sel = _decode(rig, 2)
    for lid in range(LAYERS):
        torch.testing.assert_close(rig.backend.summaries[lid][pages], want[lid], msg=f"layer {lid}")
    assert rig.backend.late_summaries == pages.numel() and bool(rig.backend.summaries.valid[pages].all())
    late = rig.backend.late_summaries
    _decode(rig, 2)  # marked now: nothing is summarized twice
    assert rig.backend.late_summaries == late

    # The same step where the summaries were written as an extend would have: the same selection.
    ref = Rig(budget=3, sub_blocks=sub_blocks, seed=5, force_sparse=True)
    ref_pages = _reuse_pages(ref, 1, 2, check_marks=True)
    for lid in range(LAYERS):
        ref.backend.summaries[lid][ref_pages] = want[lid]
    ref.backend.summaries.mark_valid(ref_pages)
    assert torch.equal(_decode(ref, 2), got_sel) and ref.backend.late_summaries == 0

    # Negative control: marks not read, the step selects with the first request's summaries.
    old = Rig(budget=3, sub_blocks=sub_blocks, seed=5, force_sparse=True)
    old_pages = _reuse_pages(old, 1, 2, check_marks=False)
    stale = {lid: old.backend.summaries[lid][old_pages].clone() for lid in range(LAYERS)}
    old_sel = _decode(old, 2)
    assert all(torch.equal(old.backend.summaries[lid][old_pages], stale[lid]) for lid in range(LAYERS))
    assert not all(torch.allclose(stale[lid], want[lid]) for lid in range(LAYERS))
    assert not torch.equal(old_sel, got_sel)


def test_the_block_a_decode_step_completes_is_marked():
    rig = Rig(budget=3, seed=2)
    rig.add_request(1, 4 * B - 1)  # the next token completes block 3
    assert _decode(rig, 1) is None  # 3 candidates, K = 3: a dense step, which still writes the summary
    page = int(rig.req_pool.req_to_token[1, 3 * B]) // B
    assert bool(rig.backend.summaries.valid[page]) and rig.backend.late_summaries == 0
