"""The sparse verify step (speculative decoding, TARGET_VERIFY) on CPU, without a server: every draft row of a
verify batch decodes as the decode step at its own position would (backend/verify_rows.py), on SGLang's real CPU
pools, eager and replayed from a captured graph.

The reference is the backend's own decode step, run n times: step j decodes row j of every request from the
state the verify started from. Equal are the outputs of every row and layer, the first sparse layer's selection,
the KV written and every page's summary, including a block completed inside the draft by earlier drafts (its
summary written from the K the verify just wrote, before any row selects from it). A draft block that is then
rejected and completed again by other tokens leaves no trace: the next verify equals the decode steps of the
committed tokens.
"""

import pytest
import torch

from sas_backend.dense_verify import forward_extend_with_verify
from tests.backend_rig import (
    B, LAYERS, Rig, Static, capture, decode_fb, decode_layers, spy_selection, verify_fb, verify_layers,
)

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402

# Committed lengths whose drafts cross a block boundary (B = 8) at every draft row, sit inside a block, or hold
# fewer candidates than K (dense rows beside sparse ones).
PROMPTS = {0: 70, 1: 13, 2: 7, 3: 130, 4: 31}


@pytest.fixture(autouse=True)
def dense_verify_hook(monkeypatch):
    """The plugin's AROUND hook on torch_native's forward_extend (dense verify for dense layers and steps)."""
    original = TorchNativeAttnBackend.forward_extend

    def hooked(self, *args, **kwargs):
        return forward_extend_with_verify(original, self, *args, **kwargs)

    monkeypatch.setattr(TorchNativeAttnBackend, "forward_extend", hooked)


def _rows(qkv, idx):
    return [(q[idx], k[idx], v[idx]) for q, k, v in qkv]


def _decode_reference(rig, inp):
    """The n decode steps a verify batch stands for, from the current state: (outputs per layer `[bs * n, ...]`
    in verify row order, the first sparse layer's selection `[bs * n, H_kv, K]` or None for a dense step)."""
    n, reqs, lens = inp["n"], inp["reqs"], inp["seq_lens"]
    bs = len(reqs)
    outs = [torch.empty(0)] * LAYERS
    sel = []
    seen = spy_selection(rig)
    for j in range(n):
        idx = torch.arange(bs) * n + j
        fb = decode_fb(lens + j + 1, lens + j, reqs, inp["out_cache_loc"][idx], bs)
        rig.backend.init_forward_metadata(fb)
        count = len(seen)
        got = decode_layers(rig, fb, _rows(inp["qkv"], idx))
        sel.append(seen[count] if len(seen) > count else None)
        outs = [torch.cat([o, g[:, None]], 1) if o.numel() else g[:, None] for o, g in zip(outs, got)]
    outs = [o.reshape(bs * n, -1) for o in outs]
    selection = None if any(s is None for s in sel) else torch.stack(sel, 1).flatten(0, 1)
    return outs, selection


def _assert_state_equal(a, b, what):
    for lid in range(LAYERS):
        assert torch.equal(a[0][lid][B:], b[0][lid][B:]), f"{what}: K layer {lid}"
        assert torch.equal(a[1][lid][B:], b[1][lid][B:]), f"{what}: V layer {lid}"
        torch.testing.assert_close(a[2][lid][1:], b[2][lid][1:], msg=f"{what}: summaries layer {lid}")


def _verify(rig, inp):
    seen = spy_selection(rig)
    fb = verify_fb(inp["seq_lens"], inp["positions"], inp["reqs"], inp["out_cache_loc"], len(inp["reqs"]), inp["n"])
    rig.backend.init_forward_metadata(fb)
    outs = verify_layers(rig, fb, inp["qkv"])
    return outs, (seen[0] if seen else None), rig.backend._plan.dense


@pytest.mark.parametrize("budget,sink,local,anchors,n,force,sub", [
    (2, 0, 0, 0, 4, False, 1), (3, 1, 1, 0, 5, False, 1), (5, 1, 1, 2, 3, False, 1), (4, 0, 1, 0, 1, False, 1),
    (40, 0, 0, 0, 4, False, 1), (40, 1, 1, 0, 4, True, 1), (3, 1, 1, 0, 5, False, 4), (5, 1, 1, 2, 3, False, 2),
])
def test_verify_rows_decode_as_decode_steps_at_their_positions(budget, sink, local, anchors, n, force, sub):
    """force: SAS_FORCE_SPARSE, so a covering budget runs the selection and the sparse attention too; sub: sub-block
    summaries a block (a draft-completed block's runs summarized before any row selects from it)."""
    rig = Rig(budget, sink, local, anchors=anchors, draft_tokens=n, force_sparse=force, sub_blocks=sub)
    for r, length in PROMPTS.items():
        rig.add_request(r, length)
    reqs = list(PROMPTS)
    inp = rig.verify_inputs(reqs, n)
    before = rig.snapshot()
    got, got_sel, dense = _verify(rig, inp)
    after = rig.snapshot()
    assert dense == (budget == 40 and not force)  # a covering budget: eager CPU attends densely (wrapped verify)
    rig.restore(before)
    want, want_sel = _decode_reference(rig, inp)
    for lid in range(LAYERS):
        torch.testing.assert_close(got[lid], want[lid], atol=1e-5, rtol=1e-5, msg=f"layer {lid}")
    if not dense:
        assert torch.equal(got_sel, want_sel), "verify selection differs from the decode steps'"
    _assert_state_equal(after, rig.snapshot(), "after the verify vs after the decode steps")


def test_a_rejected_draft_block_leaves_nothing_the_next_verify_reads():
    """A request of 30 tokens: draft row 1 (position 31) completes block 3 from a draft. Only the first row is
    accepted; the next verify's row 0 (a different token at 31) completes block 3 again, and rows after it select
    among blocks 0-3 (K = 2), so they rank block 3. The second verify equals the decode steps of the committed
    tokens from the state before the first verify: the draft-made summary is rewritten before anything reads it.
    (Request 1, 13 tokens: its rejected row 2 completes block 1; its next rows have 2 candidates, dense.)"""
    n = 4
    rig = Rig(2, draft_tokens=n)
    rig.add_request(4, 30)
    rig.add_request(1, PROMPTS[1])
    reqs = [4, 1]
    first = rig.verify_inputs(reqs, n)
    start = rig.snapshot()
    _verify(rig, first)
    rig.advance(reqs)  # one token committed each: draft row 0; the rest rejected
    second = rig.verify_inputs(reqs, n)
    got, got_sel, dense = _verify(rig, second)
    assert not dense
    after = rig.snapshot()

    rig.restore(start)
    committed = dict(first, n=1, positions=first["positions"][::n], out_cache_loc=first["out_cache_loc"][::n],
                     qkv=_rows(first["qkv"], torch.arange(len(reqs)) * n))
    _decode_reference(rig, committed)  # the one committed token of each request
    want, want_sel = _decode_reference(rig, second)
    for lid in range(LAYERS):
        torch.testing.assert_close(got[lid], want[lid], atol=1e-5, rtol=1e-5, msg=f"layer {lid}")
    assert torch.equal(got_sel, want_sel)
    _assert_state_equal(after, rig.snapshot(), "after the second verify")


def test_captured_verify_replays_like_eager():
    """The verify step under the CUDA-graph contract (tests/test_graph_replay_contract.py's): captured on one
    batch, replayed on others (fewer requests than captured, other lengths, blocks completed inside drafts),
    each equal to a fresh eager verify from the same state."""
    n, max_bs = 3, 4
    rig = Rig(3, 1, 1, draft_tokens=n)
    for r, length in PROMPTS.items():
        rig.add_request(r, length)
    static = Static(max_bs, rig.backend.get_cuda_graph_seq_len_fill_value(), rows=n, verify=True)
    seen = spy_selection(rig)
    cap = rig.verify_inputs([3, 1], n)
    snap = rig.snapshot()
    static.load(cap)
    graph, graph_outs = capture(rig, static)
    graph_sel = seen[-1]
    rig.restore(snap)
    for step, reqs in enumerate([[0, 1, 2], [0, 4], [4, 0, 2, 3], [2]]):
        inp = rig.verify_inputs(reqs, n)
        before = rig.snapshot()
        static.load(inp)
        rig.backend.init_forward_metadata_out_graph(static.fb())
        graph.replay()
        t = len(reqs) * n
        got = [o[:t].clone() for o in graph_outs]
        got_sel = graph_sel[:t].clone()
        after_graph = rig.snapshot()
        rig.restore(before)
        want, want_sel, dense = _verify(rig, inp)
        for lid in range(LAYERS):
            torch.testing.assert_close(got[lid], want[lid], atol=1e-5, rtol=1e-5, msg=f"step {step} layer {lid}")
        if not dense:
            assert torch.equal(got_sel, want_sel), f"step {step}: graph selection differs from eager"
        _assert_state_equal(after_graph, rig.snapshot(), f"step {step}: graph vs eager")
        for r in reqs:  # accept a different number of drafts per request
            rig.lens[r] += 1 + (r + step) % n


def test_tree_drafts_are_refused_eagerly():
    n = 3
    rig = Rig(2, draft_tokens=n)
    rig.add_request(0, PROMPTS[0])
    inp = rig.verify_inputs([0], n)
    fb = verify_fb(inp["seq_lens"], inp["positions"], inp["reqs"], inp["out_cache_loc"], 1, n)
    fb.spec_info.custom_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).reshape(-1)
    with pytest.raises(RuntimeError, match="tree draft mask"):
        rig.backend.init_forward_metadata(fb)
    fb.spec_info.custom_mask = None
    fb.positions = inp["positions"].clone()
    fb.positions[2] -= 1  # a sibling of row 1
    with pytest.raises(RuntimeError, match="not a chain"):
        rig.backend.init_forward_metadata(fb)
