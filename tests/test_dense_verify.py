"""The torch_native verify step (sas_backend/dense_verify.py) on SGLang's real CPU pools and TorchNativeAttnBackend:
- every verify row equals attention written out by its definition (softmax over the verified tokens and the
  draft tokens the mask shows it, computed row by row), for draft trees and chains, both mask layouts;
- a chain verify equals SGLang's own causal extend of the same tokens (torch_native's unhooked forward_extend);
- every other forward mode goes to SGLang's own code.
"""

import random
from types import SimpleNamespace

import pytest
import torch

from sas_backend import dense_verify
from tests.test_cpu_shim_speculative import ancestor_mask, random_tree

sglang = pytest.importorskip("sglang")
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

H_Q, H_KV, D, SLOTS, MAX_CTX = 6, 2, 8, 512, 64
# the unhooked method: the plugin may have wrapped the class attribute in this process already
ORIGINAL_EXTEND = getattr(TorchNativeAttnBackend.forward_extend, "__wrapped__", TorchNativeAttnBackend.forward_extend)


def rig(seed=0):
    g = torch.Generator().manual_seed(seed)
    req_pool = ReqToTokenPool(4, MAX_CTX, "cpu", False)
    kv_pool = MHATokenToKVPool(SLOTS, 1, torch.float32, H_KV, D, 1, "cpu", False)
    runner = SimpleNamespace(device="cpu", req_to_token_pool=req_pool, token_to_kv_pool=kv_pool)
    backend = TorchNativeAttnBackend(runner)
    free = torch.randperm(SLOTS - 1, generator=g) + 1  # slot 0 is SGLang's padding slot
    for r in range(4):
        req_pool.req_to_token[r] = free[r * MAX_CTX : (r + 1) * MAX_CTX].to(torch.int32)
    kv_pool.k_buffer[0].copy_(torch.randn(kv_pool.k_buffer[0].shape, generator=g))
    kv_pool.v_buffer[0].copy_(torch.randn(kv_pool.v_buffer[0].shape, generator=g))
    return backend, req_pool, kv_pool, g


def verify_batch(reqs, seq_lens, n, req_pool, custom_mask):
    loc = torch.cat([req_pool.req_to_token[r, L : L + n] for r, L in zip(reqs, seq_lens)]).long()
    positions = torch.cat([torch.arange(L, L + n) for L in seq_lens])  # a chain's; unused by attention
    spec = SimpleNamespace(draft_token_num=n, custom_mask=custom_mask)
    return SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, spec_info=spec, batch_size=len(reqs),
                           seq_lens=torch.tensor(seq_lens), req_pool_indices=torch.tensor(reqs),
                           out_cache_loc=loc, positions=positions, encoder_lens=None)


def reference(q, k_new, v_new, kv_pool, req_pool, reqs, seq_lens, masks, n, scale):
    """Row by row: softmax(q . k / sqrt(d)) over the L verified tokens and the drafts the mask shows."""
    out = torch.zeros(q.shape[0], H_Q, D)
    group = H_Q // H_KV
    for b, (r, L) in enumerate(zip(reqs, seq_lens)):
        k_ctx = kv_pool.k_buffer[0][req_pool.req_to_token[r, :L].long()]
        v_ctx = kv_pool.v_buffer[0][req_pool.req_to_token[r, :L].long()]
        for i in range(n):
            row = b * n + i
            seen = [j for j in range(n) if masks[b][i, j]]
            keys = torch.cat([k_ctx, k_new[[b * n + j for j in seen]]])
            values = torch.cat([v_ctx, v_new[[b * n + j for j in seen]]])
            for h in range(H_Q):
                kh = h // group
                w = torch.softmax((keys[:, kh] @ q[row, h]) * scale, dim=0)
                out[row, h] = w @ values[:, kh]
    return out.reshape(q.shape[0], -1)


@pytest.mark.parametrize("layout", ["qlen", "full", "none"])
def test_verify_rows_match_definition(layout):
    backend, req_pool, kv_pool, g = rig()
    layer = RadixAttention(H_Q, D, D**-0.5, H_KV, 0)
    reqs, seq_lens, n = [2, 0, 3], [5, 17, 1], 6
    if layout == "none":  # no mask: a chain
        masks = [torch.ones(n, n, dtype=torch.bool).tril()] * 3
        custom = None
    else:
        rng = random.Random(7)
        masks = [ancestor_mask(random_tree(n, rng)[0]) for _ in reqs]
        if layout == "qlen":
            custom = torch.cat([m.reshape(-1) for m in masks])
        else:
            custom = torch.cat([torch.cat([torch.ones(n, L, dtype=torch.bool), m], 1).reshape(-1)
                                for m, L in zip(masks, seq_lens)])
    fb = verify_batch(reqs, seq_lens, n, req_pool, custom)
    T = len(reqs) * n
    q = torch.randn(T, H_Q * D, generator=g)
    k = torch.randn(T, H_KV, D, generator=g)
    v = torch.randn(T, H_KV, D, generator=g)
    backend.init_forward_metadata(fb)
    out = dense_verify.forward_extend_with_verify(ORIGINAL_EXTEND, backend, q, k, v, layer, fb)
    assert torch.equal(kv_pool.k_buffer[0][fb.out_cache_loc], k)  # the drafts' KV is written first
    want = reference(q.view(T, H_Q, D), k, v, kv_pool, req_pool, reqs, seq_lens, masks, n, D**-0.5)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_chain_verify_equals_sglang_causal_extend():
    """A chain's verify is a causal extend of the n draft tokens after the L verified ones."""
    layer = RadixAttention(H_Q, D, D**-0.5, H_KV, 0)
    reqs, seq_lens, n = [1, 3], [9, 30], 4
    outs = []
    for mode in ("verify", "extend"):
        backend, req_pool, _, g = rig(seed=5)
        T = len(reqs) * n
        q, k, v = (torch.randn(T, H_Q * D, generator=g), torch.randn(T, H_KV, D, generator=g),
                   torch.randn(T, H_KV, D, generator=g))
        fb = verify_batch(reqs, seq_lens, n, req_pool, torch.ones(n, n, dtype=torch.bool).tril().repeat(2, 1))
        if mode == "extend":
            fb.forward_mode = ForwardMode.EXTEND
            fb.seq_lens = torch.tensor(seq_lens) + n
            fb.extend_prefix_lens = torch.tensor(seq_lens)
            fb.extend_seq_lens = torch.full((len(reqs),), n)
        backend.init_forward_metadata(fb)
        outs.append(dense_verify.forward_extend_with_verify(ORIGINAL_EXTEND, backend, q, k, v, layer, fb))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)


def test_other_modes_go_to_sglang():
    calls = []

    def original(self, q, k, v, layer, fb, save_kv_cache=True):
        calls.append(fb.forward_mode)
        return "sglang"

    fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND)
    assert dense_verify.forward_extend_with_verify(original, None, None, None, None, None, fb) == "sglang"
    assert calls == [ForwardMode.EXTEND]


def test_mask_shorter_than_the_batch_is_refused():
    spec = SimpleNamespace(draft_token_num=3, custom_mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError):
        dense_verify.draft_masks(spec, [4, 4], 3)
