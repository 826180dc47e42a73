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

from types import SimpleNamespace

import pytest
import torch

from sas_backend.backend.sas_attention import SASAttnBackend
from sas_backend.config import SASConfig
from sas_backend.gate.module import AttnGate
from sas_backend.ops.rope import apply_rope, rope_cos_sin_table
from tests.cpu_graph import CpuGraph, GraphCaptureError

sglang = pytest.importorskip("sglang")
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

B, H_Q, H_KV, D, DG, LAYERS = 8, 6, 2, 16, 16, 2
MAX_BS, MAX_REQS, MAX_CTX, PAGES = 4, 8, 256, 160


class Rig:
    """A SAS backend over real SGLang CPU pools, with requests placed on random pages."""

    def __init__(self, budget, sink=0, local=0, seed=0, dense_below=0, inner=None, anchors=0):
        self.g = torch.Generator().manual_seed(seed)
        self.req_pool = ReqToTokenPool(MAX_REQS, MAX_CTX, "cpu", False)
        self.kv_pool = MHATokenToKVPool(PAGES * B, B, torch.float32, H_KV, D, LAYERS, "cpu", False)
        runner = SimpleNamespace(
            device="cpu", req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool,
            dtype=torch.float32, model=None, page_size=B,
        )
        cfg = SASConfig(gate_path="unused", budget=budget * B, block_size=B, sink_blocks=sink, local_blocks=local,
                        dense_below=dense_below, prompt_anchors=anchors)
        gates = {}
        for lid in range(LAYERS):
            gate = AttnGate(H_KV, H_Q // H_KV, D, DG)
            gate.reset_parameters(self.g)
            gates[lid] = gate.requires_grad_(False)
        self.layers = [RadixAttention(H_Q, D, D**-0.5, H_KV, lid) for lid in range(LAYERS)]
        self.backend = SASAttnBackend(
            runner, inner(runner) if inner else TorchNativeAttnBackend(runner), cfg, gates,
            rope_cos_sin_table(D, MAX_CTX + 8, 10000.0), rope_cos_sin_table(DG, MAX_CTX + 8, 10000.0),
            num_kv_heads=H_KV, num_q_heads=H_Q, head_dim=D,
        )
        self.free_pages = list(torch.randperm(PAGES - 1, generator=self.g).add(1).tolist())  # page 0: padding
        self.lens = {}

    def add_request(self, req, prompt_len):
        """A request whose first prompt_len tokens are cached, with summaries of its complete blocks."""
        self.lens[req] = prompt_len
        for m in range(-(-(prompt_len + 2 * B) // B)):  # the prompt and room to decode
            self.req_pool.req_to_token[req, m * B : (m + 1) * B] = self.free_pages.pop() * B + torch.arange(B)
        slots = self.req_pool.req_to_token[req, :prompt_len].long()
        cos_sin = self.backend.model_rope_table[:prompt_len]
        for lid in range(LAYERS):
            self.kv_pool.k_buffer[lid][slots] = apply_rope(torch.randn(prompt_len, H_KV, D, generator=self.g), cos_sin)
            self.kv_pool.v_buffer[lid][slots] = torch.randn(prompt_len, H_KV, D, generator=self.g)
            n_blocks = prompt_len // B
            if self.backend.anchors is not None:  # as an extend would leave them: blocks of the prompt, -1 padded
                picks = torch.randperm(max((prompt_len - 1) // B, 1), generator=self.g)[: self.backend.anchor_count]
                row = torch.full((H_KV, self.backend.anchor_count), -1, dtype=torch.int32)
                row[:, : picks.numel()] = picks.to(torch.int32) if (prompt_len - 1) // B else -1
                self.backend.anchors[lid][req] = row
            if n_blocks:
                pages = self.req_pool.req_to_token[req, : n_blocks * B : B].long() // B
                starts = torch.arange(n_blocks) * B
                gate = self.backend.gates[lid]
                self.backend.summaries[lid][pages] = self.backend.selector.summarize(
                    gate, self.kv_pool.k_buffer[lid], pages, starts, self.backend.model_rope_table,
                    self.backend.gate_rope_table,
                )

    def step_inputs(self, reqs):
        """Decode inputs of one step: the new token of each request (its slot, position, q/k/v)."""
        seq_lens = torch.tensor([self.lens[r] + 1 for r in reqs])
        pos = seq_lens - 1
        loc = torch.stack([self.req_pool.req_to_token[r, int(p)] for r, p in zip(reqs, pos)]).long()
        cos_sin = self.backend.model_rope_table[pos]
        qkv = [
            (
                apply_rope(torch.randn(len(reqs), H_Q, D, generator=self.g), cos_sin).reshape(len(reqs), -1),
                apply_rope(torch.randn(len(reqs), H_KV, D, generator=self.g), cos_sin),
                torch.randn(len(reqs), H_KV, D, generator=self.g),
            )
            for _ in range(LAYERS)
        ]
        return dict(reqs=torch.tensor(reqs), seq_lens=seq_lens, positions=pos, out_cache_loc=loc, qkv=qkv)

    def advance(self, reqs):
        for r in reqs:
            self.lens[r] += 1

    def snapshot(self):
        return (
            [t.clone() for t in self.kv_pool.k_buffer], [t.clone() for t in self.kv_pool.v_buffer],
            {lid: t.clone() for lid, t in self.backend.summaries.summaries.items()},
        )

    def restore(self, snap):
        k, v, s = snap
        for lid in range(LAYERS):
            self.kv_pool.k_buffer[lid].copy_(k[lid])
            self.kv_pool.v_buffer[lid].copy_(v[lid])
            self.backend.summaries.summaries[lid].copy_(s[lid])


def _fb(seq_lens, positions, reqs, loc, batch_size):
    return SimpleNamespace(
        forward_mode=ForwardMode.DECODE, batch_size=batch_size, seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
        positions=positions, req_pool_indices=reqs, out_cache_loc=loc, encoder_lens=None,
    )


def _layers(rig, fb, qkv):
    return [
        rig.backend.forward_decode(q, k, v, layer, fb) for layer, (q, k, v) in zip(rig.layers, qkv)
    ]


def _spy_selection(rig):
    """Keep the first sparse layer's selection tensor of each forward (at capture: the one replay writes)."""
    seen = []
    select = rig.backend.selector.select

    def spy(gate, *args):
        out = select(gate, *args)
        if gate is rig.backend.gates[0]:
            seen.append(out)
        return out

    rig.backend.selector.select = spy
    return seen


class Static:
    """The graph runner's static input buffers for one captured batch size."""

    def __init__(self, bs, fill):
        self.bs, self.fill = bs, fill
        self.seq_lens = torch.full((bs,), fill, dtype=torch.int64)
        self.positions = torch.zeros(bs, dtype=torch.int64)
        self.reqs = torch.zeros(bs, dtype=torch.int64)
        self.loc = torch.zeros(bs, dtype=torch.int64)
        self.qkv = [
            (torch.zeros(bs, H_Q * D), torch.zeros(bs, H_KV, D), torch.zeros(bs, H_KV, D)) for _ in range(LAYERS)
        ]

    def load(self, inp):
        """In-place copies, padded rows as SGLang pads them."""
        n = len(inp["reqs"])
        for buf, val, pad in (
            (self.seq_lens, inp["seq_lens"], self.fill), (self.positions, inp["positions"], 0),
            (self.reqs, inp["reqs"], 0), (self.loc, inp["out_cache_loc"], 0),
        ):
            buf[:n] = val
            buf[n:] = pad
        for (q, k, v), (q1, k1, v1) in zip(self.qkv, inp["qkv"]):
            q[:n], k[:n], v[:n] = q1, k1, v1
            q[n:], k[n:], v[n:] = 0, 0, 0

    def fb(self):
        return _fb(self.seq_lens, self.positions, self.reqs, self.loc, self.bs)


def _capture(rig, static):
    be = rig.backend
    be.init_cuda_graph_state(MAX_BS, MAX_BS)
    fb = static.fb()
    be.init_forward_metadata_out_graph(fb, in_capture=True)
    for _ in range(2):  # warm-ups: eager runs on the same plan, as SGLang does
        be.init_forward_metadata_in_graph(fb)
        _layers(rig, fb, static.qkv)
    graph = CpuGraph()
    with graph.capture():
        be.init_forward_metadata_in_graph(fb)
        outs = _layers(rig, fb, static.qkv)
    return graph, outs


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
    selections = _spy_selection(rig)
    # Capture on a batch unlike every later one (other lengths, positions and requests).
    cap = rig.step_inputs([3, 1])
    snap = rig.snapshot()
    static.load(cap)
    graph, graph_outs = _capture(rig, static)
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
        fb = _fb(inp["seq_lens"], inp["positions"], inp["reqs"], inp["out_cache_loc"], n)
        rig.backend.init_forward_metadata(fb)
        want = _layers(rig, fb, inp["qkv"])
        for lid in range(LAYERS):
            torch.testing.assert_close(got[lid], want[lid], atol=1e-5, rtol=1e-5, msg=f"step {step} layer {lid}")
        if not rig.backend._plan.dense:  # a dense eager step selects nothing to compare with
            assert torch.equal(got_sel, selections[-1]), f"step {step}: graph selection differs from eager"
            if anchors:  # each row's prompt anchors are among its selected blocks (layer 0)
                for i, r in enumerate(reqs):
                    for h in range(H_KV):
                        want_in = {m for m in rig.backend.anchors[0][r, h].tolist() if m >= 0}
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
    graph, graph_outs = _capture(rig, static)
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
        fb = _fb(inp["seq_lens"], inp["positions"], inp["reqs"], inp["out_cache_loc"], n)
        be.init_forward_metadata(fb)
        want = _layers(rig, fb, inp["qkv"])
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
    backend.rope_tables = RopeTables(rotary, DG, geo, "cpu")
    return rotary


def test_rope_table_reallocation_is_followed_eagerly_and_refused_after_capture():
    """Before capture a grown table is adopted; after it, EVERY path refuses one (an eager step
    between capture and replay included), so a replay never reads a table that was let go."""
    rig = Rig(3)
    be = rig.backend
    rotary = _live_rope_tables(be, MAX_CTX + 8)
    rig.add_request(0, 20)
    inp = rig.step_inputs([0])
    fb = _fb(inp["seq_lens"], inp["positions"], inp["reqs"], inp["out_cache_loc"], 1)
    rotary.cos_sin_cache = rope_cos_sin_table(D, MAX_CTX + 64, 10000.0)  # grown before capture
    be.init_forward_metadata(fb)
    assert be.model_rope_table.shape[0] == MAX_CTX + 64 and be.gate_rope_table.shape == (MAX_CTX + 64, DG)
    static = Static(MAX_BS, be.get_cuda_graph_seq_len_fill_value())
    static.load(inp)
    graph, graph_outs = _capture(rig, static)
    captured = (be.model_rope_table.data_ptr(), be.gate_rope_table.data_ptr())

    # Same length (SGLang's dtype cast): refilled in place, the graphs keep working.
    rotary.cos_sin_cache = rotary.cos_sin_cache.to(torch.bfloat16)
    be.init_forward_metadata(fb)
    be.init_forward_metadata_out_graph(static.fb())
    graph.replay()
    assert (be.model_rope_table.data_ptr(), be.gate_rope_table.data_ptr()) == captured

    rotary.cos_sin_cache = rope_cos_sin_table(D, MAX_CTX + 128, 10000.0)  # SGLang grew its table again
    with pytest.raises(RuntimeError, match="after CUDA graphs were captured"):
        be.init_forward_metadata(fb)  # the eager step between capture and replay
    with pytest.raises(RuntimeError, match="after CUDA graphs were captured"):
        be.init_forward_metadata_out_graph(static.fb())
    # Nothing was adopted: the captured tables are the ones the backend still reads.
    assert (be.model_rope_table.data_ptr(), be.gate_rope_table.data_ptr()) == captured
    assert (be.rope_tables._model.data_ptr(), be.rope_tables._gate.data_ptr()) == captured
