"""`ops.anchors.extend_anchors` (what the server runs at extend) against the plain statement, request by request
(`naive.top_anchors(naive.last_query_block_mass(...))`), and its memory bound at 128K tokens with real shapes.

The statement gathers a request's whole context as one fp32 tensor (0.5 GB a layer at 128K tokens and 8 kv heads
of 128 dims); the batched path holds at most `anchor_scratch_bytes` at once, which backend/memory.py reserves.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sas_backend.ops.anchors import anchor_scratch_bytes, extend_anchors, paged
from sas_backend.ops.anchors.torch_path import last_query_block_mass, top_anchors


def _world(lens, h_kv, g, d, b, dtype=torch.float32, seed=0, max_ctx=None):
    gen = torch.Generator().manual_seed(seed)
    max_ctx = max_ctx or max(lens) + 3 * b
    n_req = len(lens) + 2
    slots = n_req * max_ctx + b
    perm = torch.randperm(slots - b, generator=gen) + b  # slot order unrelated to positions
    req_to_token = perm[: n_req * max_ctx].view(n_req, max_ctx).to(torch.int32)
    k_buffer = torch.randn(slots, h_kv, d, generator=gen).to(dtype)
    q = torch.randn(len(lens), h_kv * g, d, generator=gen).to(dtype) * 2
    rows = torch.randperm(n_req, generator=gen)[: len(lens)]
    return q, k_buffer, req_to_token, rows


def _reference(q, k_buffer, req_to_token, rows, lens, scale, b, count):
    out = []
    for i, n in enumerate(lens):
        slots = req_to_token[rows[i], :n].long()
        mass = last_query_block_mass(q[i], k_buffer[slots], scale, b)
        out.append(top_anchors(mass, (n - 1) // b, count))
    return torch.stack(out)


@pytest.mark.parametrize("g", [1, 3, 4, 7])
@pytest.mark.parametrize("chunk", [None, 32])
def test_matches_the_statement_request_by_request(g, chunk, monkeypatch):
    """Mixed lengths in one extend: shorter than a block, exactly full blocks, partial blocks, fewer candidates
    than anchors (-1 padded); chunk 32 tokens forces several chunks per row and one row per group."""
    if chunk:
        monkeypatch.setattr(paged, "CHUNK_TOKENS", chunk)
    b, h_kv, d, count = 8, 2, 16, 3
    lens = [5, 8, 16, 33, 70, 100, 17]
    q, kb, r2t, rows = _world(lens, h_kv, g, d, b, seed=g)
    got = extend_anchors(q, kb, r2t, rows, torch.tensor(lens), max(lens), d**-0.5, b, count)
    want = _reference(q, kb, r2t, rows, lens, d**-0.5, b, count)
    assert got.dtype == torch.int32 and got.shape == (len(lens), h_kv, count)
    assert torch.equal(got, want), (got, want)
    assert (got[0] == -1).all() and (got[1] == -1).all()  # seq 5 and 8: no complete block before the last token's
    assert (got[2, :, 1:] == -1).all()  # seq 16: one candidate


def test_bf16_keys_and_ties_to_the_lower_block():
    """bf16 KV as served; equal keys in every block (equal masses) rank by block index."""
    b, h_kv, g, d = 8, 2, 2, 16
    lens = [64, 41]
    q, kb, r2t, rows = _world(lens, h_kv, g, d, b, dtype=torch.bfloat16, seed=3)
    got = extend_anchors(q, kb, r2t, rows, torch.tensor(lens), max(lens), d**-0.5, b, 4)
    assert torch.equal(got, _reference(q, kb, r2t, rows, lens, d**-0.5, b, 4))
    kb[:] = kb[:1]  # every key the same: every complete block has the same mass
    tied = extend_anchors(q, kb, r2t, rows, torch.tensor(lens), max(lens), d**-0.5, b, 4)
    assert tied[0].tolist() == [[0, 1, 2, 3]] * h_kv and tied[1].tolist() == [[0, 1, 2, 3]] * h_kv


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors ops produce while the mode is on, alive at once (outputs only; a storage counted
    once, released when the tensor that brought it is collected)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.largest = 0
        self._storages = set()

    def _release(self, ptr, nbytes):
        self._storages.discard(ptr)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                ptr, nbytes = st.data_ptr(), st.nbytes()
                if ptr in self._storages or nbytes == 0:
                    continue
                self._storages.add(ptr)
                self.live += nbytes
                self.largest = max(self.largest, nbytes)
                weakref.finalize(t, self._release, ptr, nbytes)
        self.peak = max(self.peak, self.live)
        return out


def test_memory_at_128k_tokens_is_bounded_by_the_reserved_scratch():
    """Qwen3-4B's attention shapes (8 kv heads x 4, head dim 128, bf16 KV), one request of 128K tokens and two
    short ones in one extend: the batched path's live scratch stays under `anchor_scratch_bytes` (what
    backend/memory.py reserves), while the statement's whole-context fp32 copy alone is 0.5 GB."""
    b, h_kv, g, d, count = 64, 8, 4, 128, 4
    lens = [131072, 700, 64]
    gen = torch.Generator().manual_seed(0)
    max_ctx = 131072 + b
    r2t = torch.arange(3 * max_ctx, dtype=torch.int32).view(3, max_ctx)
    kb = torch.randn(3 * max_ctx, h_kv, d, generator=gen).to(torch.bfloat16)
    q = torch.randn(3, h_kv * g, d, generator=gen).to(torch.bfloat16)
    rows = torch.tensor([2, 0, 1])
    bound = anchor_scratch_bytes(h_kv, g, d, 2, b, max_ctx)
    with LiveBytes() as spy:
        got = extend_anchors(q, kb, r2t, rows, torch.tensor(lens), max(lens), d**-0.5, b, count)
    assert spy.peak <= bound, (spy.peak, bound)
    assert bound < 64 * 2**20  # vs 512 MiB for the statement's fp32 copy of the 128K request's keys
    with LiveBytes() as ref_spy:
        want = _reference(q, kb, r2t, rows, lens, d**-0.5, b, count)
    assert ref_spy.largest >= 131072 * h_kv * d * 4  # the whole-context fp32 copy the batched path avoids
    assert torch.equal(got, want)
