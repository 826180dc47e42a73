"""Sparse decode attention (plain torch) over per-(request, kv head) token rows.

The oracle for the FlashInfer path: same inputs (`kv_indptr`, `kv_indices` with
index = slot * H_kv + h), plain `softmax(q K_S^T * scale) V_S`, no gate bias. An fp8 KV cache holds
K / k_scale and V / v_scale (SGLang's `set_kv_buffer`): the stated K and V are the stored numbers times them.
"""

from __future__ import annotations

import torch


def sparse_decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_indptr: torch.Tensor,
                            kv_indices: torch.Tensor, scale: float, k_scale: float = 1.0,
                            v_scale: float = 1.0) -> torch.Tensor:
    """Decode attention of one new token per request over its selected tokens.

    q: `[bs, H_q, D]`; k_buffer: `[slots, H_kv, D]`; v_buffer: `[slots, H_kv, Dv]` (q's dtype, fp32, or fp8
    holding K / k_scale and V / v_scale); kv_indptr: `[bs*H_kv + 1]`; kv_indices: `[kv_indptr[-1]]`.
    Returns `[bs, H_q, Dv]` in q's dtype.
    The rows of one request must have equal lengths (they do: every kv head selects K blocks).
    Each request runs one GQA `scaled_dot_product_attention` over its gathered K/V in the order
    given, so rows holding every token in order are computed exactly like dense decode.
    """
    bs, h_q, d = q.shape
    slots, h_kv, _ = k_buffer.shape
    k_rows = k_buffer.reshape(slots * h_kv, d)
    v_rows = v_buffer.reshape(slots * h_kv, v_buffer.shape[-1])
    out = q.new_empty(bs, h_q, v_buffer.shape[-1])
    indptr = kv_indptr.tolist()
    for r in range(bs):
        # Rows of one request have the same length for every kv head (same block count), so one
        # GQA SDPA call covers all heads, shaped exactly like SGLang's torch-native decode.
        lo, hi = indptr[r * h_kv], indptr[(r + 1) * h_kv]
        idx = kv_indices[lo:hi].long().view(h_kv, -1)  # [H_kv, L]
        ks = (k_rows[idx].float() * k_scale).to(q.dtype)  # [H_kv, L, D], dequantized
        vs = (v_rows[idx].float() * v_scale).to(q.dtype)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[r].unsqueeze(1).unsqueeze(0),  # [1, H_q, 1, D]
            ks.unsqueeze(0),
            vs.unsqueeze(0),
            scale=scale,
            enable_gqa=h_q != h_kv,
        )
        out[r] = o[0, :, 0]
    return out
