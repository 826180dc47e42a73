"""The exact second level of a two-level selection (`--sas-exact-rerank X`): ONE entry point, the Triton kernel on
CUDA, torch elsewhere.

The first level (the selector's pick, at X x K blocks: forced sink / local blocks and prompt anchors in) names a
candidate set per (row, kv head); this level reads those blocks' keys and keeps the K whose exact attention mass
among them is highest (each query head's softmax over the set's tokens, a block's mass summed over its tokens, max
over the kv group's heads), forced blocks kept. Pooled summaries rank the far blocks coarsely; the exact mass is
what the attention will spend (bench/results/2026-12-06-long-ppl: Qwen2.5-Coder code at 16K, budget 1024, X = 2:
+1.5% perplexity where the gate alone loses +6.6% and the attention-mass oracle +0.8%).

- `rerank_blocks(q, k_buffer, first, block_table, num_candidates, k, max_blocks, scale, block_size, ...)`: the K
  blocks `[bs, H_kv, K]` int32; with `key_codes` the keys come from each page's 4-bit codes (`ops.key_codes`,
  0.28 of the bf16 key bytes; `--sas-rerank-keys int4`).
- `rerank_attend(q, k_buffer, v_buffer, first, ..., seq_lens, ...)`: the same level and the attention over the K
  kept in one pass (the torch path off CUDA): the candidates' keys gathered once serve the ranking and the
  attention's logits; returns the attention `[bs, H_q, Dv]` and the K blocks.
- `candidate_lse(...)`: the same level without its select, for the fused attend to rank (`CandidateLse`; the
  Triton launch only): the K chosen inside the attend's programs, so no launch of its own ends in a Top-K.
- `exact_block_scores(...)`: the torch path's `[bs, H_kv, C]` log-masses (tests, analysis).
- `RerankWorkspace`: the kernel's buffers, planned once for a server's most rows (plan once, run many).

`naive.rerank_blocks` is the plain statement (tests); `torch_path` the torch path; `triton` the kernel (imported on
first CUDA use only).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from sas_backend.ops.fused_step import _pow2
from sas_backend.ops.rerank.torch_path import exact_block_scores, rerank_attend_torch, rerank_blocks_torch


class RerankWorkspace:
    """The kernel's buffers for at most `max_bs` rows of `num_kv_heads` kv heads with `group` query heads each and
    first levels of `first_k` blocks. A launch splits each (row, kv head) over about `target_programs` / (bs * H_kv)
    programs, which meet in block log-sum-exps `[rows, CP, GP]` fp32 and an arrival counter (zero, left zero by each
    launch); a batch whose rows alone reach target_programs runs one program a row, in registers. So only the
    (row, kv head) pairs of the split batches, fewer than target_programs, take room. ranked_rows: batch rows whose
    log-sum-exps the attend ranks (`candidate_lse`: every (row, kv head) of a batch of up to that many rows keeps
    its `[CP, GP]` tile; 0: none)."""

    def __init__(self, max_bs: int, num_kv_heads: int, group: int, first_k: int, device,
                 target_programs: int = 128, ranked_rows: int = 0):
        self.max_bs, self.num_kv_heads, self.group, self.first_k = int(max_bs), int(num_kv_heads), int(group), \
            int(first_k)
        self.target_programs = int(target_programs)
        self.ranked_rows = min(int(ranked_rows), self.max_bs)
        self.cp, self.gp = max(16, _pow2(first_k)), max(16, _pow2(group))
        rows = self.lse_rows(self.max_bs, self.num_kv_heads, self.target_programs, self.ranked_rows)
        self.lse = torch.zeros(rows * self.cp * self.gp, dtype=torch.float32, device=device)
        self.counters = torch.zeros(rows, dtype=torch.int32, device=device)

    @staticmethod
    def split_rows(max_bs: int, num_kv_heads: int, target_programs: int) -> int:
        """(row, kv head) pairs a split launch may hold: bs * H_kv < target_programs splits (`splits`)."""
        return max(1, min(max_bs * num_kv_heads, target_programs - 1))

    @classmethod
    def lse_rows(cls, max_bs: int, num_kv_heads: int, target_programs: int, ranked_rows: int = 0) -> int:
        """(row, kv head) pairs the log-sum-exps hold: the split launches' and the ranked batches'."""
        return max(cls.split_rows(max_bs, num_kv_heads, target_programs),
                   min(int(ranked_rows), int(max_bs)) * num_kv_heads)

    @classmethod
    def nbytes_for(cls, max_bs: int, num_kv_heads: int, group: int, first_k: int, target_programs: int = 128,
                   ranked_rows: int = 0) -> int:
        """Device bytes a workspace of these sizes holds (`backend.memory` reserves them)."""
        rows = cls.lse_rows(max_bs, num_kv_heads, target_programs, ranked_rows)
        return rows * max(16, _pow2(first_k)) * max(16, _pow2(group)) * 4 + rows * 4

    @property
    def nbytes(self) -> int:
        return self.lse.numel() * 4 + self.counters.numel() * 4

    def splits(self, bs: int) -> int:
        """Programs per (row, kv head): a function of bs only (a captured batch size always splits alike); 1 once
        bs * H_kv reaches target_programs."""
        want = -(-self.target_programs // max(1, bs * self.num_kv_heads))
        per = -(-self.first_k // max(1, min(self.first_k, want)))
        return -(-self.first_k // per)


@dataclasses.dataclass(frozen=True)
class CandidateLse:
    """What `candidate_lse` leaves for the attend to rank (`ops.fused_step.attend(rank=...)`): lse, the workspace's
    `[rows, CP, GP]` fp32 log-sum-exps of each (row, kv head) = r * H_kv + h, entry (c, g) candidate c's tokens for
    query head g of the group (-inf at padding and past G); the first level's blocks and the selection rule."""

    lse: torch.Tensor
    cp: int
    gp: int
    first: torch.Tensor
    num_candidates: torch.Tensor
    sink_blocks: int
    local_blocks: int
    anchors: Optional[torch.Tensor]
    anchor_rows: Optional[torch.Tensor]


def rerank_blocks(q: torch.Tensor, k_buffer: torch.Tensor, first: torch.Tensor, block_table: torch.Tensor,
                  num_candidates: torch.Tensor, k: int, max_blocks: int, scale: float, block_size: int,
                  sink_blocks: int = 0, local_blocks: int = 0, anchors: Optional[torch.Tensor] = None,
                  anchor_rows: Optional[torch.Tensor] = None, k_scale: float = 1.0,
                  workspace: Optional[RerankWorkspace] = None, out: Optional[torch.Tensor] = None,
                  launch=None, kernel: Optional[bool] = None, key_codes=None) -> torch.Tensor:
    """The K blocks of each (row, kv head) of highest exact attention mass among its first-level blocks.

    q `[bs, H_q, D]` after RoPE; k_buffer `[slots, H_kv, D]` (an fp8 cache holds K / k_scale); first `[bs, H_kv, C]`
    int32 the first level's blocks, ascending, -1 padded, holding every forced block of its row (the first level's
    pick forced them in); block_table `[bs, >= max_blocks]` slot of each block's first token; num_candidates `[bs]`
    complete blocks before each row's current one; k: K (<= C); max_blocks: the plan's width M (every block < M);
    scale: the softmax scale; anchors: optional prompt anchors `[rows, H_kv, R]` int32 (-1 none), row
    `anchor_rows[r]` for batch row r (`[bs]`; None: row r), forced like sink / local blocks.
    Per query head, each block's log-mass is its tokens' log-sum-exp of q.k * scale * k_scale minus that of every
    token of the row's first-level blocks; a block scores the max over the kv group; sink / local blocks and
    anchors are kept, the rest by score, ties to the lower block index (`ops.topk.select_blocks`' rule).
    Returns `[bs, H_kv, K]` int32 ascending, -1 padded (`out` if given). Fixed shapes, no host sync.
    key_codes: optional (packed `[num_pages, H_kv, b * D / 2]` uint8, scales `[num_pages, H_kv, 2, D]` fp16) of
    `ops.key_codes`, every first-level block's page encoded (page = slot // b): the keys are read from the codes
    (lo + step * code, K itself: k_scale unused) instead of k_buffer, a quarter of the bytes.
    The Triton kernel on CUDA (kernel None; True: also on CPU, in Triton's interpreter), which needs `workspace` (a
    `RerankWorkspace` for at least bs rows and C blocks) and takes `launch` (`ops.fused_step.LaunchOptions`).
    """
    bs, h_q, d = q.shape
    h_kv, c = first.shape[1], first.shape[2]
    if h_q % h_kv or k_buffer.shape[1] != h_kv or k_buffer.shape[2] != d:
        raise ValueError(f"q {tuple(q.shape)}, k_buffer {tuple(k_buffer.shape)} and first {tuple(first.shape)} "
                         "disagree on the heads")
    if not 0 < k <= c:
        raise ValueError(f"K = {k} must be in 1..C = {c} (the first level keeps at least K blocks)")
    _check_codes(key_codes, h_kv, block_size, d)
    if q.is_cuda if kernel is None else kernel:
        from sas_backend.ops.rerank.triton import rerank_blocks_triton

        return rerank_blocks_triton(q, k_buffer, first, block_table, num_candidates, k, scale, block_size,
                                    sink_blocks, local_blocks, anchors, anchor_rows, k_scale, workspace, out, launch,
                                    key_codes)
    anchors_b = anchors if anchors is None or anchor_rows is None else anchors[anchor_rows.long()]
    res = rerank_blocks_torch(q, k_buffer, first, block_table, num_candidates, k, max_blocks, scale, block_size,
                              sink_blocks, local_blocks, anchors_b, k_scale, key_codes)
    return res if out is None else out.copy_(res)


def rerank_attend(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, first: torch.Tensor,
                  block_table: torch.Tensor, seq_lens: torch.Tensor, num_candidates: torch.Tensor, k: int,
                  max_blocks: int, scale: float, block_size: int, sink_blocks: int = 0, local_blocks: int = 0,
                  anchors: Optional[torch.Tensor] = None, anchor_rows: Optional[torch.Tensor] = None,
                  k_scale: float = 1.0, v_scale: float = 1.0) -> "tuple[torch.Tensor, torch.Tensor]":
    """The second level and the decode attention over what it keeps, in one pass (the torch path: off CUDA, where
    the ranking attend's Triton launch is not the attention).

    The candidates' keys and the current block's are gathered once; their logits rank the candidates by
    `rerank_blocks`' rule (the same K blocks) and, masked to those K plus the current block, are the attention's
    (`sparse_decode`: softmax(q K^T * scale * k_scale) V * v_scale over the K blocks' tokens and the current block
    up to the newest token). So the step reads the candidates' keys once, not again for the attention.
    Arguments as `rerank_blocks`, plus v_buffer `[slots, H_kv, Dv]` and seq_lens `[bs]`. The first level never
    holds the current block (`num_candidates` ends before it); C may be below K (a short row's first level cut to
    its blocks: every candidate kept, the rest -1). Exact keys only: `--sas-rerank-keys int4` ranks by the codes,
    so its attention reads K anyway. Returns (attention `[bs, H_q, Dv]` in q's dtype, computed in fp32; the K
    blocks `[bs, H_kv, K]` int32 ascending, -1 padded). Fixed shapes, no host sync."""
    bs, h_q, d = q.shape
    h_kv = first.shape[1]
    if h_q % h_kv or k_buffer.shape[1] != h_kv or k_buffer.shape[2] != d or v_buffer.shape[:2] != k_buffer.shape[:2]:
        raise ValueError(f"q {tuple(q.shape)}, k_buffer {tuple(k_buffer.shape)}, v_buffer {tuple(v_buffer.shape)} "
                         f"and first {tuple(first.shape)} disagree on the heads or slots")
    if k <= 0:
        raise ValueError(f"K = {k} must be positive")
    anchors_b = anchors if anchors is None or anchor_rows is None else anchors[anchor_rows.long()]
    return rerank_attend_torch(q, k_buffer, v_buffer, first, block_table, seq_lens, num_candidates, k, max_blocks,
                               scale, block_size, sink_blocks, local_blocks, anchors_b, k_scale, v_scale)


def candidate_lse(q: torch.Tensor, k_buffer: torch.Tensor, first: torch.Tensor, block_table: torch.Tensor,
                  num_candidates: torch.Tensor, scale: float, block_size: int, sink_blocks: int = 0,
                  local_blocks: int = 0, anchors: Optional[torch.Tensor] = None,
                  anchor_rows: Optional[torch.Tensor] = None, k_scale: float = 1.0,
                  workspace: Optional[RerankWorkspace] = None, launch=None, key_codes=None) -> CandidateLse:
    """The second level without its select: one Triton launch (CUDA, or Triton's interpreter) writes each first-level
    block's per-query-head log-sum-exp into `workspace.lse`, and the attend ranks them (`ops.fused_step.attend(...,
    rank=)`: the same K blocks `rerank_blocks` keeps, chosen inside the attend's programs, so the second level has
    no last arrival and no select). Arguments as `rerank_blocks`; workspace: a `RerankWorkspace` with ranked_rows >=
    bs. Returns the `CandidateLse` the attend reads (valid until the workspace's next launch)."""
    bs, h_q, d = q.shape
    h_kv = first.shape[1]
    if h_q % h_kv or k_buffer.shape[1] != h_kv or k_buffer.shape[2] != d:
        raise ValueError(f"q {tuple(q.shape)}, k_buffer {tuple(k_buffer.shape)} and first {tuple(first.shape)} "
                         "disagree on the heads")
    _check_codes(key_codes, h_kv, block_size, d)
    from sas_backend.ops.rerank.triton import candidate_lse_triton

    candidate_lse_triton(q, k_buffer, first, block_table, scale, block_size, k_scale, workspace, launch, key_codes)
    return CandidateLse(workspace.lse, workspace.cp, workspace.gp, first, num_candidates, max(int(sink_blocks), 0),
                        max(int(local_blocks), 0), anchors, anchor_rows)


def _check_codes(key_codes, h_kv: int, block_size: int, d: int) -> None:
    if key_codes is not None:
        packed, scales = key_codes
        if (packed.dtype != torch.uint8 or tuple(packed.shape[1:]) != (h_kv, block_size * d // 2)
                or scales.dtype != torch.float16 or tuple(scales.shape[1:]) != (h_kv, 2, d)):
            raise ValueError(f"key codes {tuple(packed.shape)} {packed.dtype} / {tuple(scales.shape)} {scales.dtype}: "
                             f"want [pages, {h_kv}, {block_size * d // 2}] uint8 and [pages, {h_kv}, 2, {d}] float16")


__all__ = ["CandidateLse", "RerankWorkspace", "candidate_lse", "exact_block_scores", "rerank_attend",
           "rerank_blocks"]
