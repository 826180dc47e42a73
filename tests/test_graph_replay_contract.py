"""The CUDA-graph contract, on CPU: a captured decode step replayed later equals a fresh eager step.

SGLang (0.5.15 .. 0.5.23, `decode_cuda_graph_runner.py`) drives a backend like this:
`init_cuda_graph_state(max_bs, ...)` once; per captured batch size one
`init_forward_metadata_out_graph(fb, in_capture=True)`, then warm-up forwards and the capture, each
running `init_forward_metadata_in_graph(fb)` and the layers on the runner's static buffers; per
replay, in-place copies into those buffers (padded rows: seq_len = the backend's fill value,
req_pool_index 0, slot 0), `init_forward_metadata_out_graph(view)` on the host, and the graph.
The graph here is `tests.cpu_graph.CpuGraph` (kernels and addresses kept, Python not), driving
the real backend on SGLang's real CPU pools and torch-native dense backend.
"""

import pytest
import torch

from tests.backend_rig import (
    B, D, DG, H_KV, H_Q, LAYERS, MAX_BS, MAX_CTX, Rig, Static, capture, decode_fb, decode_layers, spy_selection,
)
from tests.cpu_graph import CpuGraph, GraphCaptureError
from sas_backend.ops.rope import rope_cos_sin_table

# Steps after the capture: lengths cross block boundaries (B = 8), requests leave and join,
# fewer live requests than the captured batch size (padded rows).
SCHEDULE = [[0, 1, 2], [0, 1, 2], [0, 1, 2, 3], [0, 2], [0, 2, 3], [4, 0], [4, 0, 2, 3]]
PROMPTS = {0: 70, 1: 15, 2: 7, 3: 130, 4: 40}


def _steps(rig):
    """The SCHEDULE's steps as (step, reqs, inputs, batch size, the state before the step); request 4
    joins when first scheduled, and every request advances by a token after its step."""
    for step, reqs in enumerate(SCHEDULE):
        if 4 in reqs and 4 not in rig.lens:
            rig.add_request(4, PROMPTS[4])
        inp = rig.step_inputs(reqs)
        yield step, reqs, inp, len(reqs), rig.snapshot()
        rig.advance(reqs)


@pytest.mark.parametrize("budget,sink,local,anchors", [(3, 0, 0, 0), (4, 1, 1, 0), (40, 0, 0, 0), (5, 1, 1, 2)])
def test_captured_decode_replays_like_eager(budget, sink, local, anchors):
    rig = Rig(budget, sink, local, anchors=anchors)
    for r, n in PROMPTS.items():
        if r != 4:
            rig.add_request(r, n)
    static = Static(MAX_BS, rig.backend.get_cuda_graph_seq_len_fill_value())
    selections = spy_selection(rig)
    # Capture on a batch unlike every later one (other lengths, positions and requests).
    cap = rig.step_inputs([3, 1])
    snap = rig.snapshot()
    static.load(cap)
    graph, graph_outs = capture(rig, static)
    graph_sel = selections[-1]
    rig.restore(snap)

    for step, reqs, inp, n, before in _steps(rig):
        # Replay: in-place loads, host planning on the view, the graph.
        static.load(inp)
        rig.backend.init_forward_metadata_out_graph(static.fb())
        graph.replay()
        got = [o[:n].clone() for o in graph_outs]
        got_sel = graph_sel[:n].clone()
        after_graph = rig.snapshot()
        # A fresh eager step on the same batch from the same state.
        rig.restore(before)
        fb = decode_fb(inp["seq_lens"], inp["positions"], inp["reqs"], inp["out_cache_loc"], n)
        rig.backend.init_forward_metadata(fb)
        want = decode_layers(rig, fb, inp["qkv"])
        for lid in range(LAYERS):
            torch.testing.assert_close(got[lid], want[lid], atol=1e-5, rtol=1e-5, msg=f"step {step} layer {lid}")
        if not rig.backend._plan.dense:  # a dense eager step selects nothing to compare with
            assert torch.equal(got_sel, selections[-1]), f"step {step}: graph selection differs from eager"
            if anchors:  # each row's prompt anchors are among its selected blocks (layer 0)
                for i, r in enumerate(reqs):
                    for h in range(H_KV):
                        want_in = {m for m in rig.backend.step.anchors[0][r, h].tolist() if m >= 0}
                        assert want_in <= set(got_sel[i, h].tolist()), (step, r, h)
        for lid in range(LAYERS):  # the KV and the summaries of every page a request owns
            assert torch.equal(after_graph[0][lid][B:], rig.kv_pool.k_buffer[lid][B:]), f"step {step}: K"
            s_graph, s_eager = after_graph[2][lid][1:], rig.backend.summaries[lid][1:]
            torch.testing.assert_close(s_graph, s_eager, msg=f"step {step} layer {lid}: summaries")


class PaddedDenseDecode:
    """The wrapped dense backend in the IF-node test: plain attention over each request's first
    seq_len slots, padded to MAX_CTX (fixed shapes, no host sync: capturable, unlike SGLang's
    torch-native backend, whose per-request loop reads lengths on the host). Counts its decodes."""

    kv_index_translator = None

    def __init__(self, runner):
        self.req_pool, self.kv_pool = runner.req_to_token_pool, runner.token_to_kv_pool
        self.calls = self.planned = 0

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        pass

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def init_forward_metadata(self, fb):
        pass

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        self.planned += 1

    def init_forward_metadata_in_graph(self, fb):
        pass

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
        assert not save_kv_cache  # sas wrote the new token's K/V already
        self.calls += 1
        slots = self.req_pool.req_to_token[fb.req_pool_indices.long(), :MAX_CTX].long()
        keys = self.kv_pool.get_key_buffer(layer.layer_id)[slots]  # [bs, T, H_kv, D]
        values = self.kv_pool.get_value_buffer(layer.layer_id)[slots]
        bs = q.shape[0]
        q4 = q.view(bs, H_KV, H_Q // H_KV, D)
        scores = torch.einsum("bhgd,bthd->bhgt", q4, keys) * layer.scaling
        valid = torch.arange(MAX_CTX) < fb.seq_lens[:, None]
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        out = torch.einsum("bhgt,bthd->bhgd", scores.softmax(-1), values)
        return out.reshape(bs, H_Q * D)


def test_dense_below_captures_both_branches_and_replays_the_host_choice(monkeypatch):
    """--sas-dense-below under graphs: the warm-up runs both attentions, the capture holds both as IF
    nodes, and each replay runs the one the host chose in out_graph (the step's total tokens vs the
    threshold), equal to the eager step, which makes the same choice. The schedule has both kinds."""
    import sas_backend.backend.sas_attention as sas_attention

    monkeypatch.setattr(sas_attention, "conditional_nodes_supported", lambda: True)
    monkeypatch.setattr(sas_attention, "capturing", lambda: CpuGraph.current is not None)
    monkeypatch.setattr(sas_attention, "captured_if", lambda flag: CpuGraph.current.if_body(flag))
    rig = Rig(3, dense_below=120, inner=PaddedDenseDecode)
    be, dense = rig.backend, rig.backend.inner
    for r, n in PROMPTS.items():
        if r != 4:
            rig.add_request(r, n)
    static = Static(MAX_BS, be.get_cuda_graph_seq_len_fill_value())
    cap = rig.step_inputs([3, 1])  # 131 + 16 tokens: a sparse step
    snap = rig.snapshot()
    static.load(cap)
    graph, graph_outs = capture(rig, static)
    assert be._branch is not None and be._branch.value is True  # the sparse branch chosen ...
    assert dense.calls == 3 * LAYERS  # ... yet the dense one ran in both warm-ups and was captured
    rig.restore(snap)

    kinds = []
    for step, reqs, inp, n, before in _steps(rig):
        static.load(inp)
        planned = dense.planned
        be.init_forward_metadata_out_graph(static.fb())
        calls = dense.calls
        graph.replay()
        assert dense.calls == calls  # replay runs kernels, not Python
        got = [o[:n].clone() for o in graph_outs]
        short = int(inp["seq_lens"].sum()) <= 120  # the padded rows (length 1) do not count
        assert be._branch.value is not short and be._plan.dense is short
        assert dense.planned == planned + short  # the dense plan only for a step that takes the dense branch
        kinds.append(short)
        rig.restore(before)
        fb = decode_fb(inp["seq_lens"], inp["positions"], inp["reqs"], inp["out_cache_loc"], n)
        be.init_forward_metadata(fb)
        want = decode_layers(rig, fb, inp["qkv"])
        assert be._plan.dense is short
        for lid in range(LAYERS):
            torch.testing.assert_close(got[lid], want[lid], atol=1e-5, rtol=1e-5, msg=f"step {step} layer {lid}")
    assert any(kinds) and not all(kinds), kinds


def test_capture_refuses_host_syncs():
    """The emulated graph must catch what a CUDA graph cannot hold, or the test above proves little."""
    x = torch.arange(5)
    graph = CpuGraph()
    with pytest.raises(GraphCaptureError):
        with graph.capture():
            int(x.max())
    with pytest.raises(GraphCaptureError):
        with graph.capture():
            x[x > 2]


def test_replay_recomputes_from_buffers_not_python():
    x = torch.zeros(3)
    graph = CpuGraph()
    with graph.capture():
        y = (x + 1) * 2
        z = y.sum()
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))
    graph.replay()
    assert torch.equal(y, torch.tensor([4.0, 6.0, 8.0])) and float(z) == 18.0


def _live_rope_tables(backend, max_pos):
    """Real `RopeTables` over a stand-in rotary module whose `cos_sin_cache` the test replaces as
    SGLang does (a longer table: `_ensure_cos_sin_cache_length`; same length: a dtype cast)."""
    from sas_backend.backend.rope_tables import RopeTables
    from sas_backend.geometry import ModelGeometry

    rotary = torch.nn.Module()
    rotary.cos_sin_cache = rope_cos_sin_table(D, max_pos, 10000.0)
    geo = ModelGeometry(num_layers=LAYERS, num_q_heads=H_Q, num_kv_heads=H_KV, head_dim=D, rope_theta=10000.0)
    backend.step.rope = RopeTables(rotary, DG, geo, "cpu")  # in place of the rig's fixed tables
    return rotary


def test_rope_table_reallocation_is_followed_eagerly_and_refused_after_capture():
    """Before capture a grown table is adopted; after it, EVERY path refuses one (an eager step
    between capture and replay included), so a replay never reads a table that was let go."""
    rig = Rig(3)
    be = rig.backend
    rotary = _live_rope_tables(be, MAX_CTX + 8)
    rig.add_request(0, 20)
    inp = rig.step_inputs([0])
    fb = decode_fb(inp["seq_lens"], inp["positions"], inp["reqs"], inp["out_cache_loc"], 1)
    rotary.cos_sin_cache = rope_cos_sin_table(D, MAX_CTX + 64, 10000.0)  # grown before capture
    be.init_forward_metadata(fb)
    assert be.step.model_table.shape[0] == MAX_CTX + 64 and be.step.gate_table.shape == (MAX_CTX + 64, DG)
    static = Static(MAX_BS, be.get_cuda_graph_seq_len_fill_value())
    static.load(inp)
    graph, graph_outs = capture(rig, static)
    captured = (be.step.model_table.data_ptr(), be.step.gate_table.data_ptr())

    # Same length (SGLang's dtype cast): refilled in place, the graphs keep working.
    rotary.cos_sin_cache = rotary.cos_sin_cache.to(torch.bfloat16)
    be.init_forward_metadata(fb)
    be.init_forward_metadata_out_graph(static.fb())
    graph.replay()
    assert (be.step.model_table.data_ptr(), be.step.gate_table.data_ptr()) == captured

    rotary.cos_sin_cache = rope_cos_sin_table(D, MAX_CTX + 128, 10000.0)  # SGLang grew its table again
    with pytest.raises(RuntimeError, match="after CUDA graphs were captured"):
        be.init_forward_metadata(fb)  # the eager step between capture and replay
    with pytest.raises(RuntimeError, match="after CUDA graphs were captured"):
        be.init_forward_metadata_out_graph(static.fb())
    # Nothing was adopted: the captured tables are the ones the backend still reads.
    assert (be.step.model_table.data_ptr(), be.step.gate_table.data_ptr()) == captured
    assert (be.step.rope._model.data_ptr(), be.step.rope._gate.data_ptr()) == captured


def test_decode_steps_are_counted_by_path_and_captures_are_not():
    """The backend's step counts (GET /sas/info's pool state: did a workload decode sparsely?): a replay and an
    eager sparse step count as sparse, an eager step of short requests only (CPU: the covering dense decode) as
    dense, the capture and its warm-ups not at all."""
    from types import SimpleNamespace

    from sas_backend.pool_state import scheduler_pool_state

    rig = Rig(3)  # K = 3 blocks of 8: a step selects when its longest request holds more than 32 tokens
    rig.add_request(0, 70)
    rig.add_request(1, 15)
    static = Static(MAX_BS, rig.backend.get_cuda_graph_seq_len_fill_value())
    static.load(rig.step_inputs([1, 0]))
    graph, _ = capture(rig, static)
    assert rig.backend.decode_steps == {"sparse": 0, "dense": 0}
    static.load(rig.step_inputs([0, 1]))
    rig.backend.init_forward_metadata_out_graph(static.fb())
    graph.replay()
    assert rig.backend.decode_steps == {"sparse": 1, "dense": 0}
    for reqs, want in (([1], {"sparse": 1, "dense": 1}), ([0, 1], {"sparse": 2, "dense": 1})):
        inp = rig.step_inputs(reqs)
        fb = decode_fb(inp["seq_lens"], inp["positions"], inp["reqs"], inp["out_cache_loc"], len(reqs))
        rig.backend.init_forward_metadata(fb)
        decode_layers(rig, fb, inp["qkv"])
        assert rig.backend.decode_steps == want
    scheduler = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=SimpleNamespace(attn_backend=rig.backend)))
    assert scheduler_pool_state(scheduler)["decode_steps"] == {"sparse": 2, "dense": 1}
