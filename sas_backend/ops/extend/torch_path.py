"""Extend attention, the fast torch path for CPU: only the new queries, block by block.

SGLang's torch-native extend pads each request's queries to its whole length (prefix + new tokens)
and runs one causal SDPA, so extending a cached L-token prefix by E tokens costs an L x L attention
instead of E x L, and a prompt prefilled in chunks of C tokens pays sum_k (kC)^2 / 2 instead of
L^2 / 2 (3.2x the attention at 32K in chunks of 4096, SGLang's CPU default).

Here ("blocks", the default) the new queries go in blocks aligned to absolute positions (multiples
of `block`, the KV page): the queries of block [jb, jb + b) attend to the keys before the block
(no mask; the query heads of a kv head folded into one query, so K/V are not copied per query head)
and to the keys of their own block (causal, a b x b mask); the two partial results are merged by
the log-sum-exp that torch's CPU flash-attention op returns
(`aten._scaled_dot_product_flash_attention_for_cpu`). Every step of a query's computation depends
on its position and the keys only, never on where its extend started or ended, so a prompt gives
bit-identical outputs whether prefilled whole, in chunks, or after a radix-cache hit (a greedy
answer does not change with the cache; SGLang's own extend is not exact in this). Where a torch
lacks that op, "mask" runs chunks of queries against all their visible keys under a boolean mask,
chunks keeping the mask under `max_mask_elems` (slower: the kernel reads the mask and skips nothing).
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

#: The largest causal mask one chunk of the fallback materializes (bools): 32 MiB.
MAX_MASK_ELEMS = 1 << 25


def _flash_with_lse(q, k, v, causal: bool, scale: float, mask: torch.Tensor | None = None):
    """`[H, Lq, D]` x `[H, Lk, D]` (one kv head per query head), optional additive mask `[Lq, Lk]` in
    q's dtype -> (out `[H, Lq, D]`, log-sum-exp `[H, Lq]` fp32)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, causal, attn_mask=mask, scale=scale
    )[:2]
    return out.squeeze(0), lse.squeeze(0)


def _lse_available() -> bool:
    try:
        x = torch.zeros(1, 2, 4)  # both call forms "blocks" makes: causal, and with an additive mask
        _flash_with_lse(x, x, x, True, 1.0)
        _flash_with_lse(x, x, x, False, 1.0, torch.zeros(2, 2))
        return True
    except (AttributeError, RuntimeError, TypeError):
        return False


#: "blocks" where this torch has the CPU flash op with its log-sum-exp, else "mask".
DEFAULT_METHOD = "blocks" if _lse_available() else "mask"
METHODS = ("blocks", "mask")


def extend_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    scale: float,
    max_mask_elems: int = MAX_MASK_ELEMS,
    out: torch.Tensor | None = None,
    method: str = DEFAULT_METHOD,
    block: int = 64,
) -> torch.Tensor:
    """Attention of one request's extend; same contract as `naive.extend_attention_naive`.

    q: `[E, H_q, D]`; k, v: `[P + E, H_kv, D]` (prefix first); prefix_len: P; scale: softmax scale.
    out: optional `[E, H_q, D]` to write into (a view of the batch output). method: "blocks"
    (position-aligned query blocks of `block` tokens, merged by log-sum-exp) or "mask" (chunks of
    queries under a boolean mask, at most `max_mask_elems` mask entries each). Returns `[E, H_q, D]`.
    """
    e, h_q, d = q.shape
    total, h_kv, _ = k.shape
    if total != prefix_len + e:
        raise ValueError(f"k holds {total} tokens, expected prefix {prefix_len} + extend {e}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if out is None:
        out = q.new_empty(e, h_q, v.shape[-1])
    if k.dtype != q.dtype:  # one dtype for the kernel (a lower-precision KV cache is read up)
        k, v = k.to(q.dtype), v.to(q.dtype)
    if method == "blocks":
        _aligned_blocks(q, k, v, prefix_len, scale, block, out)
    else:
        _masked_chunks(q, k, v, prefix_len, scale, max_mask_elems, out)
    return out


def _aligned_blocks(q, k, v, p: int, scale: float, b: int, out: torch.Tensor) -> None:
    e, h_q, d = q.shape
    h_kv = k.shape[1]
    group = h_q // h_kv
    s = 0
    while s < e:
        first = p + s  # absolute position of this piece's first query
        start = first // b * b  # its block's first position
        end = min(start + b, p + e)
        c = end - first
        qh = q[s : s + c].movedim(0, 1)  # [H_q, c, D]
        # Own block: keys [start, end), query t sees keys <= t (an additive mask in q's dtype).
        own_k = k[start:end].movedim(0, 1).repeat_interleave(group, dim=0)  # [H_q, end - start, D]
        own_v = v[start:end].movedim(0, 1).repeat_interleave(group, dim=0)
        later = torch.arange(start, end)[None, :] > torch.arange(first, end)[:, None]
        mask = torch.zeros(later.shape, dtype=q.dtype).masked_fill_(later, float("-inf"))
        o_own, lse_own = _flash_with_lse(qh, own_k, own_v, False, scale, mask)
        if start == 0:
            out[s : s + c] = o_own.movedim(0, 1)
        else:  # keys before the block: the G query heads of a kv head as one query of G * c rows
            q_fold = qh.reshape(h_kv, group * c, d)
            o_pre, lse_pre = _flash_with_lse(q_fold, k[:start].movedim(0, 1), v[:start].movedim(0, 1), False, scale)
            o_pre, lse_pre = o_pre.reshape(h_q, c, -1), lse_pre.reshape(h_q, c)
            top = torch.maximum(lse_pre, lse_own)
            w_pre, w_own = (lse_pre - top).exp(), (lse_own - top).exp()  # fp32
            merged = (o_pre.float() * w_pre[..., None] + o_own.float() * w_own[..., None]) / (w_pre + w_own)[..., None]
            out[s : s + c] = merged.movedim(0, 1)
        s += c


def _masked_chunks(q, k, v, p: int, scale: float, max_mask_elems: int, out: torch.Tensor) -> None:
    e, h_q, _ = q.shape
    total, h_kv, _ = k.shape
    qh, kh, vh = q.movedim(0, 1), k.movedim(0, 1), v.movedim(0, 1)  # [H, tokens, D]
    chunk = max(1, min(e, max_mask_elems // max(total, 1)))
    for s in range(0, e, chunk):
        c = min(chunk, e - s)
        a = p + s  # absolute position of the chunk's first query
        if a == 0:  # square: the kernel's own causal rule is the right one
            mask, causal = None, True
        else:
            mask = torch.arange(a + c)[None, :] <= a + torch.arange(c)[:, None]  # [c, a + c]
            causal = False
        o = scaled_dot_product_attention(
            qh[:, s : s + c].unsqueeze(0), kh[:, : a + c].unsqueeze(0), vh[:, : a + c].unsqueeze(0),
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=h_q != h_kv,
        )  # [1, H_q, c, D]
        out[s : s + c] = o.squeeze(0).movedim(0, 1)
