"""Sparse decode attention, the fast torch path for CPU: a whole batch in one masked SDPA.

Same result as the reference (`naive.sparse_decode_attention` over `gather.torch_path.build_kv_indices`
rows), without a Python loop over requests: every (request, kv head) row is padded to the fixed
width (K + 1) * b (its K selected blocks, then the current block), padding masked out. Fixed
shapes and no host sync, so it is also what the CUDA-graph contract test captures on CPU.
"""

from __future__ import annotations

import torch


def padded_token_rows(
    selected: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_heads: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of every (request, kv head), padded to (K + 1) * b.

    selected: `[bs, H_kv, K]` int32 ascending, -1 padded; block_table: `[bs, >= cur + 1]`
    int KV slot of each logical block's first token (a page is one block, so token o of block
    m sits at slot block_table[r, m] + o); seq_lens: `[bs]`.
    Returns (rows `[bs, H_kv, (K+1)*b]` int64 = slot * H_kv + h, valid `[bs, H_kv, (K+1)*b]` bool):
    the selected blocks in ascending order, then the current block up to the newest token.
    """
    bs, h_kv, k = selected.shape
    lens = seq_lens.long()
    current = torch.div(lens - 1, block_size, rounding_mode="floor").clamp_min(0)  # [bs]
    blocks = torch.cat([selected.long().clamp_min(0), current[:, None, None].expand(bs, h_kv, 1)], dim=-1)
    offs = torch.arange(block_size, device=selected.device)
    first = torch.gather(block_table.long(), 1, blocks.reshape(bs, -1)).view(bs, h_kv, k + 1, 1)
    heads = torch.arange(num_kv_heads, device=selected.device).view(1, h_kv, 1, 1)
    rows = ((first + offs) * num_kv_heads + heads).view(bs, h_kv, -1)
    sel_valid = (selected >= 0)[..., None].expand(bs, h_kv, k, block_size)
    cur_valid = (current[:, None] * block_size + offs < lens[:, None])[:, None, None, :].expand(bs, h_kv, 1, -1)
    valid = torch.cat([sel_valid, cur_valid], dim=2).reshape(bs, h_kv, -1)
    return rows, valid


def sparse_decode_padded(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, rows: torch.Tensor,
                         valid: torch.Tensor, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Decode attention of one new token per request over its padded token rows.

    q: `[bs, H_q, D]`; k_buffer: `[slots, H_kv, D]`; v_buffer: `[slots, H_kv, Dv]` (q's dtype, fp32, or fp8
    holding K / k_scale and V / v_scale); rows, valid: `[bs, H_kv, L]` from `padded_token_rows` (every row has
    at least one valid token). Returns `[bs, H_q, Dv]` in q's dtype: plain `softmax(q K^T * scale) V` over the
    valid tokens; the G query heads of a kv group share its row. The KV scales are folded as FlashInfer folds
    them: k_scale into the softmax scale, v_scale onto the output (fp8 converts to bf16 / fp32 exactly).
    """
    bs, h_q, d = q.shape
    slots, h_kv, _ = k_buffer.shape
    dv = v_buffer.shape[-1]
    # index_select, not k_buffer[rows]: ~10x faster on CPU for these short rows (2026-12-07-cpu-one-gather)
    ks = torch.index_select(k_buffer.reshape(slots * h_kv, d), 0, rows.reshape(-1)).view(*rows.shape, d).to(q.dtype)
    vs = torch.index_select(v_buffer.reshape(slots * h_kv, dv), 0, rows.reshape(-1)).view(*rows.shape, dv).to(q.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.view(bs, h_kv, h_q // h_kv, d), ks, vs, attn_mask=valid[:, :, None, :], scale=scale * k_scale
    )
    if v_scale != 1.0:
        out = out * v_scale
    return out.reshape(bs, h_q, dv)


class TorchSparseDecode:
    """CPU sparse decode with FlashInfer's plan/run shape (`flashinfer.FlashInferSparseDecode`).

    plan() remembers the step's batch size and softmax scale; run() gathers the padded rows of
    the selected blocks plus the current block (`padded_token_rows`) and runs one masked SDPA.
    Fixed shapes and no host sync in run(), so it is also what the CUDA-graph contract test
    captures on CPU.
    """

    def __init__(self, num_kv_heads: int, block_size: int):
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self._bs = None
        self._scale = None

    def device_nbytes(self) -> int:
        """Persistent device bytes (none: every step's rows are temporaries)."""
        return 0

    def plan(self, seq_lens_host: torch.Tensor, scale: float, graph_bs=None) -> None:
        """Remember the step's batch size `[bs]` = seq_lens_host.shape and the softmax scale."""
        self._bs = int(seq_lens_host.shape[0])
        self._scale = float(scale)

    def run(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, selected: torch.Tensor,
            block_table: torch.Tensor, seq_lens: torch.Tensor, k_scale: float = 1.0,
            v_scale: float = 1.0) -> torch.Tensor:
        """Attention `[bs, H_q, Dv]` over the selected blocks plus the current block.

        q: `[bs, H_q, D]`; k/v buffers: `[slots, H_kv, D]` (fp8: holding K / k_scale, V / v_scale, the layer's
        scales); selected: `[bs, H_kv, K]` int32 ascending, -1 padded; block_table: `[bs, >= cur + 1]`;
        seq_lens: `[bs]`. bs must be the planned batch.
        """
        if self._bs is None or q.shape[0] != self._bs:
            raise ValueError(f"run() got a batch of {q.shape[0]} requests; plan() was for {self._bs}")
        rows, valid = padded_token_rows(selected, block_table, seq_lens, self.num_kv_heads, self.block_size)
        return sparse_decode_padded(q, k_buffer, v_buffer, rows, valid, self._scale, k_scale, v_scale)
