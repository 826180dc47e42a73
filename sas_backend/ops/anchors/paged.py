"""Prompt anchors at extend, batched over the extend's requests and read from the paged KV in bounded chunks.

`torch_path.last_query_block_mass` (the statement) takes one request's whole context as one fp32 tensor: at 128K
tokens and 8 kv heads of 128 dims that is 0.5 GB a layer, per request, beside a pageable host-to-device copy.
Here every request of the extend is scored in one pass over token chunks: a chunk's keys are gathered through
`req_to_token` and cast to fp32 only for `CHUNK_TOKENS` (rows x tokens) at a time, and each block keeps the
log-sum-exp of its keys' logits, so the block masses `exp(lse_block - lse_all)` need no whole-context tensor.
No host sync and no pageable copy: the caller passes device tensors (`backend.extend_plan.to_device` stages them
pinned); the chunk loop runs over host ints (the longest prompt).
"""

from __future__ import annotations

import torch

# Keys (rows x tokens) gathered and cast to fp32 at once; the scratch `anchor_scratch_bytes` sizes.
CHUNK_TOKENS = 8192


def anchor_scratch_bytes(num_kv_heads: int, group: int, head_dim: int, kv_elem: int, block_size: int,
                         context_len: int) -> int:
    """Upper bound of the device bytes `extend_anchors` holds at once beyond its inputs and output: a chunk's
    gathered keys (KV dtype and fp32) and logits, plus the per-block log-sum-exps and masses of the widest row
    group (one row of the longest context, or CHUNK_TOKENS tokens of shorter rows)."""
    chunk = CHUNK_TOKENS * (num_kv_heads * head_dim * (kv_elem + 4) + 2 * num_kv_heads * group * 4 + 8)
    blocks = num_kv_heads * group * (max(context_len, CHUNK_TOKENS) // block_size + 1) * 4 * 4
    return chunk + blocks


def _row_groups(n: int, width: int, block_size: int) -> tuple[int, int]:
    """(rows per group, tokens per chunk): chunks of at most CHUNK_TOKENS keys in all, whole blocks."""
    tokens = max(block_size, min(-(-width // block_size) * block_size, CHUNK_TOKENS // block_size * block_size))
    return max(1, min(n, CHUNK_TOKENS // tokens)), tokens


def extend_anchors(q_last: torch.Tensor, k_buffer: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
                   seq_lens: torch.Tensor, max_seq_len: int, scale: float, block_size: int,
                   count: int, k_scale: float = 1.0) -> torch.Tensor:
    """The prompt anchors of each request's last extend token: `[n, H_kv, count]` int32.

    q_last `[n, H_q, D]` the queries (after RoPE) of each request's last token; k_buffer `[slots, H_kv, D]` the
    layer's keys (the extend's already written); req_to_token `[max_reqs, max_ctx]` slot table; rows `[n]` each
    request's row in it; seq_lens `[n]` its length (the keys it sees: positions < seq_len); max_seq_len: a host
    int >= every seq_len (the chunk loop's extent); scale: the softmax scale; k_scale: the layer's key scale (an
    fp8 cache holds K / k_scale; folded into the logits' scale). Per kv head, the `count` complete
    blocks before the last token's own (index < (seq_len - 1) // b) of highest attention mass (the dense softmax
    summed over the block, max over the group's query heads), highest first, ties to the lower index, -1 padded:
    `torch_path.top_anchors(torch_path.last_query_block_mass(...))` row by row, up to fp32 rounding of the masses.
    """
    n, h_q, d = q_last.shape
    h_kv = k_buffer.shape[1]
    g = h_q // h_kv
    dev = q_last.device
    out = torch.full((n, h_kv, count), -1, dtype=torch.int32, device=dev)
    if n == 0 or count == 0 or max_seq_len <= 0:
        return out
    n_blocks = -(-max_seq_len // block_size)
    per, tokens = _row_groups(n, max_seq_len, block_size)
    q32 = q_last.float().view(n, h_kv, g, d) * (scale * k_scale)
    seq = seq_lens.long()
    for r0 in range(0, n, per):
        r1 = min(n, r0 + per)
        lse = torch.full((r1 - r0, h_kv, g, n_blocks), float("-inf"), device=dev)
        for t0 in range(0, n_blocks * block_size, tokens):
            t = torch.arange(t0, min(t0 + tokens, n_blocks * block_size), device=dev)
            # [R, C] slots (positions past a row's length are read at a clamped column and masked below)
            slots = req_to_token[rows[r0:r1].long()[:, None], t.clamp_max(req_to_token.shape[1] - 1)[None, :]].long()
            k = k_buffer[slots].float()  # [R, C, H_kv, D]: the chunk only
            logits = torch.einsum("rhgd,rchd->rhgc", q32[r0:r1], k)
            logits = logits.masked_fill((t[None, :] >= seq[r0:r1, None])[:, None, None, :], float("-inf"))
            b0 = t0 // block_size
            lse[..., b0:b0 + t.numel() // block_size] = torch.logsumexp(
                logits.unflatten(-1, (t.numel() // block_size, block_size)), dim=-1)
            del k, logits  # before the next chunk's gather: one chunk alive at a time
        mass = torch.exp(lse - torch.logsumexp(lse, dim=-1, keepdim=True)).amax(dim=2)  # [R, H_kv, NB]
        candidates = (seq[r0:r1] - 1).clamp_min(0) // block_size  # complete blocks before the last token's own
        is_cand = torch.arange(n_blocks, device=dev)[None, :] < candidates[:, None]
        mass = mass.masked_fill(~is_cand[:, None, :], -1.0)
        take = min(count, n_blocks)
        order = torch.sort(mass, dim=-1, descending=True, stable=True).indices[..., :take]
        ok = order < candidates[:, None, None]
        out[r0:r1, :, :take] = torch.where(ok, order, -1).to(torch.int32)
    return out
