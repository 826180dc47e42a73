"""A SAS backend over SGLang's real CPU pools and torch-native dense backend, driven as SGLang's model runner
drives it: decode and verify forward batches, the CUDA-graph runner's static buffers and capture
(`tests.cpu_graph.CpuGraph`). Shared by tests/test_graph_replay_contract.py and tests/test_sparse_verify.py."""

from types import SimpleNamespace

import pytest
import torch

from sas_backend.backend.rope_tables import FixedRopeTables
from sas_backend.backend.sas_attention import SASAttnBackend
from sas_backend.config import SASConfig
from sas_backend.ops.key_codes import encode_pages
from sas_backend.gate.module import AttnGate
from sas_backend.ops.rope import apply_rope, rope_cos_sin_table
from tests.cpu_graph import CpuGraph

sglang = pytest.importorskip("sglang")
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

B, H_Q, H_KV, D, DG, LAYERS = 8, 6, 2, 16, 16, 2
MAX_BS, MAX_REQS, MAX_CTX, PAGES = 4, 8, 256, 160


class Rig:
    """A SAS backend over real SGLang CPU pools, with requests placed on random pages."""

    def __init__(self, budget, sink=0, local=0, seed=0, dense_below=0, inner=None, anchors=0, draft_tokens=0,
                 force_sparse=False, sub_blocks=1, summary_marks=1, exact_rerank=1, rerank_keys="kv"):
        self.g = torch.Generator().manual_seed(seed)
        self.req_pool = ReqToTokenPool(MAX_REQS, MAX_CTX, "cpu", False)
        self.kv_pool = MHATokenToKVPool(PAGES * B, B, torch.float32, H_KV, D, LAYERS, "cpu", False)
        runner = SimpleNamespace(
            device="cpu", req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool,
            dtype=torch.float32, model=None, page_size=B,
        )
        cfg = SASConfig(gate_path="unused", budget=budget * B, block_size=B, sink_blocks=sink, local_blocks=local,
                        dense_below=dense_below, prompt_anchors=anchors,
                        force_sparse=force_sparse, sub_blocks=sub_blocks, summary_marks=summary_marks,
                        exact_rerank=exact_rerank, rerank_keys=rerank_keys)
        gates = {}
        for lid in range(LAYERS):
            gate = AttnGate(H_KV, H_Q // H_KV, D, DG)
            gate.reset_parameters(self.g)
            gates[lid] = gate.requires_grad_(False)
        self.layers = [RadixAttention(H_Q, D, D**-0.5, H_KV, lid) for lid in range(LAYERS)]
        self.backend = SASAttnBackend(
            runner, inner(runner) if inner else TorchNativeAttnBackend(runner), cfg, gates,
            FixedRopeTables(rope_cos_sin_table(D, MAX_CTX + 8, 10000.0),
                            rope_cos_sin_table(DG, MAX_CTX + 8, 10000.0)),
            num_kv_heads=H_KV, num_q_heads=H_Q, head_dim=D, draft_tokens=draft_tokens,
        )
        self.free_pages = list(torch.randperm(PAGES - 1, generator=self.g).add(1).tolist())  # page 0: padding
        self.lens = {}

    def add_request(self, req, prompt_len):
        """A request whose first prompt_len tokens are cached, with summaries of its complete blocks."""
        self.lens[req] = prompt_len
        for m in range(-(-(prompt_len + 2 * B) // B)):  # the prompt and room to decode
            self.req_pool.req_to_token[req, m * B : (m + 1) * B] = self.free_pages.pop() * B + torch.arange(B)
        slots = self.req_pool.req_to_token[req, :prompt_len].long()
        cos_sin = self.backend.step.model_table[:prompt_len]
        for lid in range(LAYERS):
            self.kv_pool.k_buffer[lid][slots] = apply_rope(torch.randn(prompt_len, H_KV, D, generator=self.g), cos_sin)
            self.kv_pool.v_buffer[lid][slots] = torch.randn(prompt_len, H_KV, D, generator=self.g)
            n_blocks = prompt_len // B
            anchors = self.backend.step.anchors
            if anchors is not None:  # as an extend would leave them: blocks of the prompt, -1 padded
                picks = torch.randperm(max((prompt_len - 1) // B, 1), generator=self.g)[: anchors.count]
                row = torch.full((H_KV, anchors.count), -1, dtype=torch.int32)
                row[:, : picks.numel()] = picks.to(torch.int32) if (prompt_len - 1) // B else -1
                anchors[lid][req] = row
            if n_blocks:
                pages = self.req_pool.req_to_token[req, : n_blocks * B : B].long() // B
                starts = torch.arange(n_blocks) * B
                gate = self.backend.gates[lid]
                self.backend.summaries[lid][pages] = self.backend.selector.summarize(
                    gate, self.kv_pool.k_buffer[lid], pages, starts, self.backend.step.model_table,
                    self.backend.step.gate_table,
                )
                if self.backend.summaries.key_codes:  # --sas-rerank-keys int4: the codes beside them
                    encode_pages(self.kv_pool.k_buffer[lid], pages, B, *self.backend.summaries.key_codes[lid])
                self.backend.summaries.mark_valid(pages)  # as an extend through sas leaves them

    def step_inputs(self, reqs):
        """Decode inputs of one step: the new token of each request (its slot, position, q/k/v)."""
        seq_lens = torch.tensor([self.lens[r] + 1 for r in reqs])
        pos = seq_lens - 1
        loc = torch.stack([self.req_pool.req_to_token[r, int(p)] for r, p in zip(reqs, pos)]).long()
        cos_sin = self.backend.step.model_table[pos]
        qkv = [
            (
                apply_rope(torch.randn(len(reqs), H_Q, D, generator=self.g), cos_sin).reshape(len(reqs), -1),
                apply_rope(torch.randn(len(reqs), H_KV, D, generator=self.g), cos_sin),
                torch.randn(len(reqs), H_KV, D, generator=self.g),
            )
            for _ in range(LAYERS)
        ]
        return dict(reqs=torch.tensor(reqs), seq_lens=seq_lens, positions=pos, out_cache_loc=loc, qkv=qkv)

    def verify_inputs(self, reqs, n):
        """Verify inputs of one step: n draft rows per request at positions L .. L + n - 1 (the committed
        length L: the request's `lens`), their slots req_to_token[req, L : L + n], rows request after request."""
        seq_lens = torch.tensor([self.lens[r] for r in reqs])
        pos = (seq_lens[:, None] + torch.arange(n)[None, :]).reshape(-1)
        rows = torch.tensor(reqs).repeat_interleave(n)
        loc = self.req_pool.req_to_token[rows, pos].long()
        cos_sin = self.backend.step.model_table[pos]
        t = len(reqs) * n
        qkv = [
            (
                apply_rope(torch.randn(t, H_Q, D, generator=self.g), cos_sin).reshape(t, -1),
                apply_rope(torch.randn(t, H_KV, D, generator=self.g), cos_sin),
                torch.randn(t, H_KV, D, generator=self.g),
            )
            for _ in range(LAYERS)
        ]
        return dict(reqs=torch.tensor(reqs), seq_lens=seq_lens, positions=pos, out_cache_loc=loc, qkv=qkv, n=n)

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


def decode_fb(seq_lens, positions, reqs, loc, batch_size):
    return SimpleNamespace(
        forward_mode=ForwardMode.DECODE, batch_size=batch_size, seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
        positions=positions, req_pool_indices=reqs, out_cache_loc=loc, encoder_lens=None,
    )


def verify_fb(seq_lens, positions, reqs, loc, batch_size, n):
    """A TARGET_VERIFY batch as SGLang's worker builds it for a chain (no draft mask: causal)."""
    return SimpleNamespace(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=batch_size, seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(), positions=positions, req_pool_indices=reqs, out_cache_loc=loc,
        encoder_lens=None, spec_info=SimpleNamespace(draft_token_num=n, custom_mask=None),
        extend_prefix_lens=None, extend_prefix_lens_cpu=None, extend_seq_lens=None, extend_seq_lens_cpu=None,
    )


def verify_layers(rig, fb, qkv):
    return [rig.backend.forward_extend(q, k, v, layer, fb) for layer, (q, k, v) in zip(rig.layers, qkv)]


def decode_layers(rig, fb, qkv):
    return [
        rig.backend.forward_decode(q, k, v, layer, fb) for layer, (q, k, v) in zip(rig.layers, qkv)
    ]


def spy_selection(rig):
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
    """The graph runner's static input buffers for one captured batch size: bs requests of `rows` query rows each
    (a decode batch: 1; a verify batch: its n draft tokens, `verify=True`). Padded requests as SGLang pads them:
    seq_len = the fill value, req row 0; their rows position 0, slot 0, zero q/k/v."""

    def __init__(self, bs, fill, rows=1, verify=False):
        self.bs, self.fill, self.rows, self.verify = bs, fill, rows, verify
        t = bs * rows
        self.seq_lens = torch.full((bs,), fill, dtype=torch.int64)
        self.reqs = torch.zeros(bs, dtype=torch.int64)
        self.positions = torch.zeros(t, dtype=torch.int64)
        self.loc = torch.zeros(t, dtype=torch.int64)
        self.qkv = [(torch.zeros(t, H_Q * D), torch.zeros(t, H_KV, D), torch.zeros(t, H_KV, D)) for _ in range(LAYERS)]

    def load(self, inp):
        """In-place copies, padded rows as SGLang pads them."""
        m = len(inp["reqs"])
        t = m * self.rows
        for buf, val, pad, k in ((self.seq_lens, inp["seq_lens"], self.fill, m), (self.reqs, inp["reqs"], 0, m),
                                 (self.positions, inp["positions"], 0, t), (self.loc, inp["out_cache_loc"], 0, t)):
            buf[:k] = val
            buf[k:] = pad
        for (q, k, v), (q1, k1, v1) in zip(self.qkv, inp["qkv"]):
            q[:t], k[:t], v[:t] = q1, k1, v1
            q[t:], k[t:], v[t:] = 0, 0, 0

    def fb(self):
        if self.verify:
            return verify_fb(self.seq_lens, self.positions, self.reqs, self.loc, self.bs, self.rows)
        return decode_fb(self.seq_lens, self.positions, self.reqs, self.loc, self.bs)


def capture(rig, static):
    """As SGLang's decode graph runner: init_cuda_graph_state (max_num_tokens = bs x rows, what it passes when it
    captures verify), out_graph, two warm-ups (eager runs on the same plan), the capture; returns (graph, the
    captured outputs per layer)."""
    be = rig.backend
    be.init_cuda_graph_state(static.bs, static.bs * static.rows)
    fb = static.fb()
    run_layers = verify_layers if static.verify else decode_layers
    be.init_forward_metadata_out_graph(fb, in_capture=True)
    for _ in range(2):
        be.init_forward_metadata_in_graph(fb)
        run_layers(rig, fb, static.qkv)
    graph = CpuGraph()
    with graph.capture():
        be.init_forward_metadata_in_graph(fb)
        outs = run_layers(rig, fb, static.qkv)
    return graph, outs
