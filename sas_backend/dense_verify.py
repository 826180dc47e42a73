"""The speculative verify forward (ForwardMode.TARGET_VERIFY) for SGLang's dense `torch_native` backend.

SGLang 0.5.21's `TorchNativeAttnBackend.forward_extend` handles prefill extends only: a verify batch carries
no `extend_prefix_lens` / `extend_seq_lens` and a draft-tree mask it does not read, so
`--speculative-algorithm NGRAM --attention-backend torch_native` crashes at the first verify step
(`'NoneType' object has no attribute 'shape'`). The plugin wraps that method (an AROUND hook, plugin.py):
verify batches go to `verify_attention` below, every other batch to SGLang's own code, untouched.

What a verify forward is (SGLang's CPU verify kernel, `intel_amx_backend.py::_build_extend_metadata`, is
the model for this): each of the batch's `bs` requests brings `n = spec_info.draft_token_num` draft tokens,
rows `b*n .. b*n+n-1` of q/k/v; `forward_batch.seq_lens[b]` = L_b counts the verified tokens only; the draft
tokens' KV slots are `out_cache_loc` (= `req_to_token[req, L_b : L_b + n]`), their positions
`forward_batch.positions` (L_b + depth in the draft tree). Draft row i attends to the L_b verified tokens and
to the draft tokens j that `spec_info.custom_mask` marks as i's ancestors or i itself. The mask's layout: on
CPU SGLang passes the QLEN_ONLY layout (n x n per request, `bs*n*n` bools, request after request); on GPU
the FULL layout (per request n rows of L_b + n columns, the first L_b all true). A missing mask means a
chain (causal among the drafts).
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

TARGET = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"


def register(registry, hook_type) -> None:
    registry.register(TARGET, forward_extend_with_verify, hook_type.AROUND)


def forward_extend_with_verify(original, self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    """AROUND hook: verify batches to `verify_attention`, all others to torch_native's own forward_extend."""
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None or not mode.is_target_verify():
        return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    return verify_attention(self, q, k, v, layer, forward_batch, save_kv_cache)


def draft_masks(spec_info, seq_lens: list, n: int) -> list:
    """Per request b, the [n, n] bool mask of draft row i over draft column j (i's ancestors and itself),
    read from `spec_info.custom_mask` in either of SGLang's layouts (module docstring); a chain's
    lower-triangular mask when there is none."""
    bs = len(seq_lens)
    mask = getattr(spec_info, "custom_mask", None)
    if mask is None or mask.numel() == 0:
        chain = torch.ones(n, n, dtype=torch.bool).tril()
        return [chain] * bs
    flat = mask.reshape(-1).to(torch.bool)
    full = sum(seq_lens) * n + bs * n * n
    if flat.numel() == full and flat.numel() != bs * n * n:
        out, at = [], 0
        for L in seq_lens:
            rows = flat[at : at + n * (L + n)].view(n, L + n)
            out.append(rows[:, L:])
            at += n * (L + n)
        return out
    if flat.numel() < bs * n * n:
        raise ValueError(f"verify mask has {flat.numel()} entries, fewer than bs*n*n = {bs * n * n}")
    return list(flat[: bs * n * n].view(bs, n, n).unbind(0))


def verify_attention(backend, q, k, v, layer, forward_batch, save_kv_cache=True) -> torch.Tensor:
    """Dense attention of a TARGET_VERIFY batch on a `TorchNativeAttnBackend` (module docstring)."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if layer.is_cross_attention or (layer.sliding_window_size is not None and layer.sliding_window_size > -1):
        raise NotImplementedError("the torch_native verify step (sas_backend.dense_verify) supports causal "
                                  "self-attention without a sliding window only")
    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v)
    spec = forward_batch.spec_info
    n = int(spec.draft_token_num)
    seq_lens = [int(x) for x in forward_batch.seq_lens.tolist()]
    bs = len(seq_lens)
    q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    if q_.shape[0] != bs * n:
        raise ValueError(f"verify batch has {q_.shape[0]} query rows, expected {bs} requests x {n} drafts")
    o = q.new_empty((q_.shape[0], layer.tp_q_head_num * layer.v_head_dim))
    o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    masks = draft_masks(spec, seq_lens, n)
    gqa = layer.tp_q_head_num != layer.tp_k_head_num
    for b, L in enumerate(seq_lens):
        slots = req_to_token[forward_batch.req_pool_indices[b], : L + n].long()
        key = k_cache[slots].movedim(0, 1)  # [Hkv, L + n, D]
        value = v_cache[slots].movedim(0, 1)
        query = q_[b * n : (b + 1) * n].movedim(0, 1)  # [Hq, n, D]
        if key.dtype != query.dtype:
            key, value = key.to(query.dtype), value.to(query.dtype)
        visible = torch.cat([torch.ones(n, L, dtype=torch.bool, device=query.device),
                             masks[b].to(query.device)], dim=1)
        out = scaled_dot_product_attention(query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0),
                                           attn_mask=visible, scale=layer.scaling, enable_gqa=gqa)
        o_[b * n : (b + 1) * n] = out.squeeze(0).movedim(0, 1)
    return o
