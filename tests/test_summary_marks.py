"""Summaries that know they are valid (issue 65 item 2, CPU): a page handed out again loses its summary's mark,
and a decode step summarizes the unmarked candidate pages of its requests before selecting, so a page reused by
a second request whose KV landed without an extend through sas (as a prefill-decode transfer lands it) never
lends the first request's summary. Driven on SGLang's real CPU pools (tests/backend_rig.py) and its real paged
allocator."""

from __future__ import annotations

import pytest
import torch

from tests.cpu_graph import CpuGraph

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
    (the allocator's hook clears their marks) whose KV is written straight into them, no extend through sas.
    check_marks False: the marks are not read (either form)."""
    if rig.backend.device_marks:
        rig.backend.step.repair_late = check_marks
    else:
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


@pytest.mark.parametrize("marks", [1, 2], ids=["host", "device"])
@pytest.mark.parametrize("sub_blocks", [1, 4])
def test_a_reused_page_never_lends_its_old_summary(sub_blocks, marks):
    """Both forms of the marks: planned on the host (CPU's), listed and repaired in each sparse layer (CUDA's,
    SAS_SUMMARY_MARKS=2 on CPU)."""
    rig = Rig(budget=3, sub_blocks=sub_blocks, seed=5, force_sparse=True, summary_marks=marks)
    assert rig.backend.device_marks == (marks == 2) and rig.backend.check_marks == (marks == 1)
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
    ref = Rig(budget=3, sub_blocks=sub_blocks, seed=5, force_sparse=True, summary_marks=marks)
    ref_pages = _reuse_pages(ref, 1, 2, check_marks=True)
    for lid in range(LAYERS):
        ref.backend.summaries[lid][ref_pages] = want[lid]
    ref.backend.summaries.mark_valid(ref_pages)
    assert torch.equal(_decode(ref, 2), got_sel) and ref.backend.late_summaries == 0

    # Negative control: marks not read, the step selects with the first request's summaries.
    old = Rig(budget=3, sub_blocks=sub_blocks, seed=5, force_sparse=True, summary_marks=marks)
    old_pages = _reuse_pages(old, 1, 2, check_marks=False)
    stale = {lid: old.backend.summaries[lid][old_pages].clone() for lid in range(LAYERS)}
    old_sel = _decode(old, 2)
    assert all(torch.equal(old.backend.summaries[lid][old_pages], stale[lid]) for lid in range(LAYERS))
    assert not all(torch.allclose(stale[lid], want[lid]) for lid in range(LAYERS))
    assert not torch.equal(old_sel, got_sel)


@pytest.mark.parametrize("marks", [1, 2], ids=["host", "device"])
def test_a_reused_page_never_lends_its_old_key_codes(marks):
    """`--sas-rerank-keys int4`: the 4-bit key codes share the summaries' marks: a reused page's codes are rewritten
    from the KV it holds now (host-planned or listed on the device) before the second level reads them; unread marks
    leave the first request's."""
    from sas_backend.ops.key_codes import encode_pages

    for check in (True, False):
        rig = Rig(budget=3, seed=6, force_sparse=True, summary_marks=marks, exact_rerank=2, rerank_keys="int4")
        codes = rig.backend.summaries.key_codes
        pages = _reuse_pages(rig, 1, 2, check_marks=check)
        stale = {lid: codes[lid][0][pages].clone() for lid in range(LAYERS)}
        want = {}
        for lid in range(LAYERS):
            packed, scales = torch.zeros_like(codes[lid][0]), torch.zeros_like(codes[lid][1])
            encode_pages(rig.kv_pool.k_buffer[lid], pages, B, packed, scales)
            want[lid] = (packed[pages], scales[pages])
        _decode(rig, 2)
        for lid in range(LAYERS):
            got = (codes[lid][0][pages], codes[lid][1][pages])
            if check:
                assert torch.equal(got[0], want[lid][0]) and torch.equal(got[1], want[lid][1]), lid
            else:
                assert torch.equal(got[0], stale[lid]) and not torch.equal(got[0], want[lid][0]), lid


@pytest.mark.parametrize("marks", [1, 2], ids=["host", "device"])
def test_the_block_a_decode_step_completes_is_marked(marks):
    rig = Rig(budget=3, seed=2, summary_marks=marks)
    rig.add_request(1, 4 * B - 1)  # the next token completes block 3
    assert _decode(rig, 1) is None  # 3 candidates, K = 3: a dense step, which still writes the summary
    page = int(rig.req_pool.req_to_token[1, 3 * B]) // B
    assert bool(rig.backend.summaries.valid[page]) and rig.backend.late_summaries == 0


def _random_marks_case(seed, bs=5, m=9, num_pages=100):
    g = torch.Generator().manual_seed(seed)
    req_to_token = torch.zeros(8, (m + 1) * B, dtype=torch.int64)
    pages = (torch.randperm(num_pages - 1, generator=g)[: 8 * (m + 1)] + 1).view(8, m + 1)
    for r in range(8):  # each row's blocks on its own random pages; rows 1 and 2 share their first three (a prefix)
        req_to_token[r] = (pages[r, :, None] * B + torch.arange(B)).reshape(-1)
    req_to_token[2, : 3 * B] = req_to_token[1, : 3 * B]
    rows = torch.tensor([1, 2, 5, 0, 7][:bs])
    present = torch.tensor([m * B, 3 * B + 5, 0, B - 1, 4 * B][:bs])  # tokens before the step's own
    valid = torch.rand(num_pages, generator=g) < 0.5
    valid[pages[1, 0]] = False  # the shared prefix's first page is late for both rows
    return req_to_token, rows, present, valid


@pytest.mark.parametrize("seed", range(4))
def test_the_device_list_states_what_the_host_plans(seed):
    """`ops.late_blocks.list_late_blocks` (fixed shapes) lists exactly the (page, first position) pairs its plain
    statement does, a page two rows share once per row, in row-major order (CPU), the same set `unmarked_blocks`
    plans on the host; its marks are the statement's (and page 0, the padding page, for the other columns)."""
    from sas_backend.backend.page_marks import unmarked_blocks
    from sas_backend.ops.late_blocks import list_late_blocks
    from sas_backend.ops.late_blocks.naive import late_blocks

    req_to_token, rows, present, valid = _random_marks_case(seed)
    table = req_to_token[rows, : 10 * B: B]
    ncand, lens = torch.div(present, B, rounding_mode="floor"), present + 1
    pages, starts = torch.full((rows.numel() * 9 + 1,), -1), torch.full((rows.numel() * 9 + 1,), -1)
    count, flag, total = torch.zeros(1, dtype=torch.int64), torch.zeros((), dtype=torch.bool), torch.ones(1).long()
    after = valid.clone()
    list_late_blocks(table, ncand, lens, after, B, pages, starts, count, flag, total)
    n = int(count)
    want, want_after = late_blocks(table, ncand, lens, valid, B)
    assert list(zip(pages[:n].tolist(), starts[:n].tolist())) == want and bool(flag) == (n > 0) and total == n + 1
    assert n > len(set(want))  # the shared prefix's late pages are listed twice
    host = unmarked_blocks(req_to_token, rows, present, valid, B)
    assert set(want) == set(zip(host[0].tolist(), host[1].tolist()))
    want_after[0] = True
    assert torch.equal(after, want_after)


def test_the_device_list_replays_in_a_captured_graph():
    """Captured once (tests/cpu_graph.py refuses host syncs and data-dependent shapes), replayed on new marks and
    lengths: the same list and marks as eager."""
    from sas_backend.ops.late_blocks import list_late_blocks
    from tests.cpu_graph import CpuGraph

    req_to_token, rows, present, valid = _random_marks_case(0)
    table = req_to_token[rows, : 10 * B: B].clone()
    lens = (present + 1).clone()
    marks = valid.clone()
    bufs = [torch.zeros(rows.numel() * 9 + 1, dtype=torch.int64) for _ in range(2)]
    bufs += [torch.zeros(1, dtype=torch.int64), torch.zeros((), dtype=torch.bool), torch.zeros(1, dtype=torch.int64)]

    def step():
        list_late_blocks(table, torch.div(lens - 1, B, rounding_mode="floor"), lens, marks, B, *bufs)

    graph = CpuGraph()
    with graph.capture():
        step()
    for seed in (1, 2):
        other_table, _, other_present, other_valid = _random_marks_case(seed)
        table.copy_(other_table[rows, : 10 * B: B])
        lens.copy_(other_present + 1)
        marks.copy_(other_valid)
        graph.replay()
        got = [t.clone() for t in bufs] + [marks.clone()]
        marks.copy_(other_valid)
        step()
        n = int(bufs[2])
        assert int(got[2]) == n and torch.equal(got[0][:n], bufs[0][:n]) and torch.equal(got[1][:n], bufs[1][:n])
        assert torch.equal(got[3], bufs[3]) and torch.equal(got[5], marks)


@pytest.mark.parametrize("if_node", [False, True], ids=["plain", "if-node"])
def test_a_captured_step_repairs_a_reused_page_on_replay(monkeypatch, if_node):
    """The CUDA form end to end under the CPU graph contract (tests/cpu_graph.py): captured on request 1's step, the
    graph replays request 2's first step on request 1's pages (handed out again, KV written without an extend):
    the step's buffers list them, every layer's summaries are repaired before the layers run, the step marks
    them, exactly as the host-planned form's eager step leaves them and decodes. The torch form runs with fixed
    shapes (the count stays a tensor), as on a device without the Triton kernel. With IF nodes the repairs sit in
    one on `count > 0`, which the next step, with nothing late, skips."""
    import functools

    import sas_backend.backend.decode_step as decode_step
    from sas_backend.ops.summary import torch_path
    from tests.backend_rig import MAX_BS, Static, capture

    monkeypatch.setattr(torch_path, "summarize_listed",
                        functools.partial(torch_path.summarize_listed, fixed_shapes=True))
    if if_node:
        monkeypatch.setattr(decode_step, "conditional_nodes_supported", lambda: True)
        monkeypatch.setattr(decode_step, "capturing", lambda: CpuGraph.current is not None)
        monkeypatch.setattr(decode_step, "captured_if", lambda flag: CpuGraph.current.if_body(flag))
    rig = Rig(budget=3, seed=5, force_sparse=True, summary_marks=2)
    ref = Rig(budget=3, seed=5, force_sparse=True, summary_marks=1)
    for r in (rig, ref):
        r.add_request(1, PROMPT)
    static = Static(MAX_BS, rig.backend.get_cuda_graph_seq_len_fill_value())
    static.load(rig.step_inputs([1]))
    ref.step_inputs([1])  # the same draws from the generator
    graph, outs = capture(rig, static)
    assert rig.backend.late_summaries == 0  # request 1's pages were marked by its "extend"
    pages = _reuse_pages(rig, 1, 2, check_marks=True)
    _reuse_pages(ref, 1, 2, check_marks=True)
    want_summaries = _fresh(rig, 2, pages)
    inp = rig.step_inputs([2])
    static.load(inp)
    rig.backend.init_forward_metadata_out_graph(static.fb())
    graph.replay()
    for lid in range(LAYERS):
        torch.testing.assert_close(rig.backend.summaries[lid][pages], want_summaries[lid], msg=f"layer {lid}")
    assert bool(rig.backend.summaries.valid[pages].all()) and rig.backend.late_summaries == pages.numel()

    ref_inp = ref.step_inputs([2])
    fb = decode_fb(ref_inp["seq_lens"], ref_inp["positions"], ref_inp["reqs"], ref_inp["out_cache_loc"], 1)
    ref.backend.init_forward_metadata(fb)
    want = decode_layers(ref, fb, ref_inp["qkv"])
    assert ref.backend.late_summaries == pages.numel()
    for lid in range(LAYERS):
        torch.testing.assert_close(outs[lid][:1], want[lid], atol=1e-5, rtol=1e-5, msg=f"layer {lid}")

    flag = rig.backend.step.buffers.view(*(torch.zeros(MAX_BS, dtype=torch.int64),) * 3).late_flag
    in_body = sum(entry[-1] is flag for entry in graph.log)  # ops captured in the IF node
    assert bool(in_body) is if_node and bool(flag)  # this replay: blocks were late
    rig.advance([2])
    static.load(rig.step_inputs([2]))
    rig.backend.init_forward_metadata_out_graph(static.fb())
    graph.replay()
    assert rig.backend.late_summaries == pages.numel() and not bool(flag)  # nothing late: an IF body is skipped
