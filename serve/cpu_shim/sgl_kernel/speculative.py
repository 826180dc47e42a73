"""Plain-torch stand-ins for the `sgl_kernel` ops SGLang 0.5.21's NGRAM speculative decoding calls on CPU.

With `SGLANG_USE_CPU_ENGINE=1 --device cpu --speculative-algorithm NGRAM`, SGLang imports
- `sgl_kernel.speculative.reconstruct_indices_from_tree_mask` (srt/speculative/ngram_worker.py: the verify
  metadata of the drafted token tree),
- `sgl_kernel.assign_extend_cache_locs_cpu` (kernels/ops/speculative/cache_locs.py and
  srt/speculative/spec_utils.py: the KV slots of the draft tokens / of the accepted tokens),
- `sgl_kernel.verify_tree_greedy_cpu` (srt/speculative/eagle_utils.py: greedy acceptance; on CPU SGLang
  always verifies greedily),
- `sgl_kernel.fill_accept_out_cache_loc_cpu` (kernels/ops/speculative/eagle.py: the KV slots of the accepted
  draft tokens, compacted),
- `sgl_kernel.copy_all_layer_kv_cache_cpu` (kernels/ops/kvcache/cache_move.py, called by
  `MHATokenToKVPool.move_kv_cache` and once at pool creation: a speculative server builds its KV pool with
  slot moves enabled, which moves the accepted tokens' K/V to their final slots after each verify).
The real CPU build of sgl_kernel (which no PyPI package ships) keeps its speculative ops in
`sgl_kernel.speculative` and re-exports them from `sgl_kernel`; this module does the same for all five (see
`sgl_kernel/__init__.py`).

Each op here follows the contract of SGLang's CUDA source (`sglang/kernels/jit/csrc/speculative/tree.cuh`,
`sglang/kernels/jit/include/sgl_kernel/speculative/ngram.cuh`), its Triton ports
(`sglang/kernels/ops/speculative/{reconstruct_tree,spec_tree,cache_locs,eagle}.py`) and the argument
order of sgl-kernel's CPU wrappers: outputs are written in place, shapes and dtypes as SGLang passes
them. SGLang ships no torch implementation of these five (only Triton/CUDA ones, and a numpy
`_derive_tree_links` in ngram_worker.py for two of the four outputs of the first), hence this module; the
tests (tests/test_cpu_shim_speculative.py) check each op against a loop-by-loop statement of its
definition, and the two tree ops also against SGLang's own Triton kernels run in the Triton interpreter.

Only torch is imported here, so the module also loads on its own (the tests load it from the source tree).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch


def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor,
    verified_seq_len: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
) -> None:
    """Positions and retrieval links of each request's draft tree, from its ancestor mask (in place).

    With n = draft_token_num, request b's mask is `tree_mask[b*n*n : (b+1)*n*n]` read as an n x n matrix
    (row-major, bool or uint8; the buffer may be longer): `M[i, j]` true means node j is an ancestor of
    node i (the diagonal is ignored: only j < i counts; node 0 is the tree's root, the request's last
    committed token, at position verified_seq_len[b]). For each node t of request b:
    - `positions[b*n + t] = verified_seq_len[b] + #{j < t : M[t, j]}` (its depth below the root);
    - `retrive_index[b, t] = b*n + t` (its row in the flattened verify batch);
    - `retrive_next_token[b, t]` = the smallest k > t with M[k, t], else -1 (its first child when the
      mask is closed under ancestry, as SGLang's are: the first descendant of t is then a child of t);
    - `retrive_next_sibling[b, t]` = the smallest k > t with parent(k) = parent(t) when parent(t) >= 0,
      else -1, where parent(k) = the largest j < k with M[k, j], else -1.
    The CUDA kernel (ngram.cuh) and SGLang's Triton port give these same values on any mask.
    positions: [bs*n] int64; retrive_*: [bs, n] int64; verified_seq_len: [bs] int64.
    """
    bs, n = int(batch_size), int(draft_token_num)
    if bs == 0:
        return
    device = verified_seq_len.device
    mask = tree_mask.reshape(-1)[: bs * n * n].view(bs, n, n).to(torch.bool)
    node = torch.arange(n, device=device)
    # anc[b, i, j]: j < i is an ancestor of i
    anc = mask & (node[None, :] < node[:, None])
    depth = anc.sum(dim=-1)
    positions.view(bs, n).copy_(depth + verified_seq_len.view(bs, 1).to(depth.dtype))
    retrive_index.copy_(torch.arange(bs * n, device=device).view(bs, n))
    minus_one = torch.full((), -1, device=device, dtype=torch.long)
    parent = torch.where(anc, node[None, None, :], minus_one).amax(dim=-1)  # [bs, n]
    # anc[b, k, t] with k > t: k is a descendant of t
    first_child = torch.where(anc, node[None, :, None], n).amin(dim=1)  # over k
    retrive_next_token.copy_(torch.where(first_child < n, first_child, minus_one))
    # later[b, k, t]: k > t shares t's parent, which exists
    later = (parent[:, :, None] == parent[:, None, :]) & (node[:, None] > node[None, :]) & (parent[:, None, :] >= 0)
    first_sibling = torch.where(later, node[None, :, None], n).amin(dim=1)
    retrive_next_sibling.copy_(torch.where(first_sibling < n, first_sibling, minus_one))


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy acceptance of each request's draft tree against the target's argmax tokens (in place).

    candidates, retrive_*, target_predict: [bs, n] int64 (target_predict[b, t] = the target's argmax
    after draft node t); accept_index: [bs, S] int32, S the most tokens one step may commit;
    predicts: [bs*n] int32; accept_token_num: [bs] int32. For request b, starting at the root
    (node 0): among the current node's children, in sibling order (retrive_next_token, then
    retrive_next_sibling), take the first whose candidate token equals the target's token after the
    current node; accept it and descend; stop when no child matches or S - 1 drafts are accepted.
    Writes `accept_index[b, 0..m] = retrive_index` of the root and of the m accepted nodes (the rest of
    the row is left as it is: SGLang fills it with -1), `accept_token_num[b] = m`, and
    `predicts[retrive_index of each node on the path] = target's token after that node` (for an accepted
    node's parent that is the accepted draft token; for the last node of the path it is the bonus token).
    Other entries of `predicts` are left unchanged. `retrive_index` holds flat row numbers, so
    `target_predict.view(-1)[retrive_index[b, t]]` is the target's token after node t.
    """
    bs = candidates.shape[0]
    steps = accept_index.shape[1]
    if bs == 0:
        return
    cand = candidates.tolist()
    ridx = retrive_index.tolist()
    nxt = retrive_next_token.tolist()
    sib = retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    acc = accept_index.tolist()
    pred_writes = {}
    nums = []
    for b in range(bs):
        last = ridx[b][0]
        acc[b][0] = last
        m = 0
        cur = 0
        for _ in range(1, steps):
            cur = nxt[b][cur]
            while cur != -1:
                if cand[b][cur] == target[last]:
                    pred_writes[last] = target[last]
                    m += 1
                    acc[b][m] = ridx[b][cur]
                    last = ridx[b][cur]
                    break
                cur = sib[b][cur]
            if cur == -1:
                break
        nums.append(m)
        pred_writes[last] = target[last]
    accept_index.copy_(torch.tensor(acc, dtype=accept_index.dtype))
    accept_token_num.copy_(torch.tensor(nums, dtype=accept_token_num.dtype))
    where = torch.tensor(list(pred_writes.keys()), dtype=torch.long, device=predicts.device)
    predicts[where] = torch.tensor(list(pred_writes.values()), dtype=predicts.dtype, device=predicts.device)


def request_ranges(req_pool_indices: torch.Tensor, start_offset: torch.Tensor, end_offset: torch.Tensor):
    """(rows, cols) `[total]` int64: the req->token cells of each request's range [start, end), request after
    request, i.e. output position o_i + j is cell (req_pool_indices[i], start_offset[i] + j). Shared by the two
    inverse ops: `assign_extend_cache_locs_cpu` (gather) and `assign_req_to_token_pool_cpu` (scatter)."""
    lens = (end_offset - start_offset).long()
    total = int(lens.sum()) if lens.numel() else 0
    first = torch.cumsum(lens, 0) - lens  # each range's first output index
    out_pos = torch.arange(total, device=lens.device)
    rows = req_pool_indices.long().repeat_interleave(lens)
    cols = start_offset.long().repeat_interleave(lens) + out_pos - first.repeat_interleave(lens)
    return rows, cols


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Gather the KV slots of each request's token range [start, end) from its req->token row (in place).

    `out_cache_loc[o_i + j] = req_to_token[req_pool_indices[i], start_offset[i] + j]` for j in
    [0, end_offset[i] - start_offset[i]), where o_i = sum over earlier requests of (end - start): the
    ranges are laid out request after request, the rest of `out_cache_loc` is left as it is.
    req_to_token: [max_reqs, pool_len] int32; out_cache_loc: int64.
    """
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"pool_len {pool_len} != req_to_token.shape[1] {req_to_token.shape[1]}")
    rows, cols = request_ranges(req_pool_indices, start_offset, end_offset)
    out_cache_loc[: rows.numel()] = req_to_token[rows, cols].to(out_cache_loc.dtype)


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,
    size: Optional[int] = None,
) -> None:
    """Compact the KV slots of the accepted tokens (in place).

    Reading `accept_index` flat (its first `size` entries; all of them when size is None, as SGLang
    0.5.21 calls it), the k-th entry that is not -1, `a`, gives `accept_out_cache_loc[k] =
    out_cache_loc[a]`; the rest of `accept_out_cache_loc` is left as it is. accept_index: int32, -1 for
    none; out_cache_loc, accept_out_cache_loc: int64.
    """
    flat = accept_index.reshape(-1)
    if size is not None:
        flat = flat[: int(size)]
    src = flat[flat > -1].long()
    accept_out_cache_loc[: src.numel()] = out_cache_loc[src].to(accept_out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy KV rows `src_loc[j]` -> `tgt_loc[j]` in every buffer of a KV pool, given only raw pointers.

    data_ptrs: [L] uint64, the address of buffer l's first byte (SGLang passes every layer's K and V
    buffers, `MHATokenToKVPool.data_ptrs`); strides: [L], the bytes of one slot row of buffer l
    (`data_strides`: head_num * head_dim * itemsize). For each l, the `strides[l]` bytes of row `src_loc[j]`
    are copied onto row `tgt_loc[j]`, for all j at once: every source row is read before any target row
    is written (as SGLang's Triton kernel `copy_all_layer_kv_cache_tiled` does), so overlapping source
    and target sets are safe. A target given twice takes one of its sources (unspecified which).
    The buffers are reached through their addresses (ctypes reads and writes of whole rows), as the
    pointer-based op this stands in for is: the caller guarantees they are live CPU tensors holding at
    least max(tgt_loc, src_loc) + 1 rows. A verify step moves a handful of rows (none for an accepted
    chain, whose targets are its sources), so a Python loop over rows is cheaper here than torch ops
    over 2 x layers buffers.
    """
    n = min(tgt_loc.numel(), src_loc.numel())
    if n == 0:
        return
    tgt = tgt_loc.reshape(-1)[:n].long()
    src = src_loc.reshape(-1)[:n].long()
    moved = tgt != src  # a row onto itself is a no-op (all of them when a chain's drafts are accepted)
    if not bool(moved.any()):
        return
    pairs = list(zip(tgt[moved].tolist(), src[moved].tolist()))
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        ptr, stride = int(ptr), int(stride)
        rows = [ctypes.string_at(ptr + s * stride, stride) for _, s in pairs]  # every source first
        for (t, _), row in zip(pairs, rows):
            ctypes.memmove(ptr + t * stride, row, stride)


__all__ = [
    "assign_extend_cache_locs_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "reconstruct_indices_from_tree_mask",
    "verify_tree_greedy_cpu",
]
