"""Per-batch decode metadata, split the way CUDA graphs need it.

- `DecodePlan` (frozen): what is fixed for one batch shape, made on the host outside any graph
  (`init_forward_metadata` / `_out_graph`): batch size, score width, and the views of the step
  buffers to read. (The sparse decode plans its own host part: `ops.sparse_decode`.)
- `StepTensors`: the device tensors every sparse layer of a step shares (RoPE rows at each
  position, candidate counts, the block table). They depend on the step's positions and
  lengths, so under CUDA graphs they are computed INSIDE the graph (`_in_graph`) into
  `StepBuffers`, persistent buffers whose addresses the captured layers hold. Eager steps
  compute them directly.

A captured graph replays kernels, not Python: nothing a layer reads may be a Python-side cache
filled during warm-up or capture. This module is the only place the step's state lives.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from sas_backend.ops.score import candidate_counts


@dataclasses.dataclass(frozen=True)
class StepTensors:
    """Device tensors of one decode step, read by every sparse layer. bs rows, M = max_blocks.

    positions, seq_lens, req_pool_indices: `[bs]` the batch's own tensors (the graph runner's
    static buffers under CUDA graphs). num_candidates: `[bs]` int64 complete blocks before the
    current one. model_cos_sin `[bs, D]`, gate_cos_sin `[bs, Dg]`: RoPE table rows at each
    position. block_table: `[bs, M + 1]` int64 KV slot of the first token of each logical block
    (column M covers the current block of the longest request; see `sas_backend.selection`).
    late_pages, late_starts `[bs * M + 1]` int64, late_count `[1]` int64, late_flag 0-d bool: where the step lists
    the complete blocks whose pages hold no valid summary (`ops.late_blocks`; written by `DecodeStep.repair`, not
    by `compute`; None: the step keeps no device-side validity marks).
    """

    positions: torch.Tensor
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    num_candidates: torch.Tensor
    model_cos_sin: torch.Tensor
    gate_cos_sin: torch.Tensor
    block_table: torch.Tensor
    late_pages: Optional[torch.Tensor] = None
    late_starts: Optional[torch.Tensor] = None
    late_count: Optional[torch.Tensor] = None
    late_flag: Optional[torch.Tensor] = None

    @staticmethod
    def compute(
        positions: torch.Tensor,
        seq_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        model_rope_table: torch.Tensor,
        gate_rope_table: torch.Tensor,
        block_size: int,
        max_blocks: int,
        late: bool = False,
    ) -> "StepTensors":
        """Fresh step tensors from the batch's device tensors; fixed shapes, no host sync. late: with (empty)
        buffers for the step's late blocks."""
        # Padded graph rows may carry any position: clamp so the table lookup stays in range.
        pos = positions.long().clamp(0, model_rope_table.shape[0] - 1)
        table = req_to_token[req_pool_indices.long(), : (max_blocks + 1) * block_size : block_size].long()
        if table.shape[1] < max_blocks + 1:  # context width not a multiple of b: pad the last column
            table = torch.nn.functional.pad(table, (0, max_blocks + 1 - table.shape[1]))
        num_candidates = candidate_counts(seq_lens.long(), block_size)
        bufs = late_buffers(table.shape[0] * max_blocks + 1, table.device) if late else {}
        return StepTensors(
            positions=positions,
            seq_lens=seq_lens,
            req_pool_indices=req_pool_indices,
            num_candidates=num_candidates,
            model_cos_sin=model_rope_table[pos],
            gate_cos_sin=gate_rope_table[pos],
            block_table=table,
            **bufs,
        )

    def tensors(self) -> list:
        """Every tensor this step owns (not the batch's own inputs), in a fixed order."""
        return [self.num_candidates, self.model_cos_sin, self.gate_cos_sin, self.block_table]


def late_buffers(entries: int, device) -> dict:
    """Empty `StepTensors` late-block buffers of `entries` list entries."""
    return dict(late_pages=torch.zeros(entries, dtype=torch.int64, device=device),
                late_starts=torch.zeros(entries, dtype=torch.int64, device=device),
                late_count=torch.zeros(1, dtype=torch.int64, device=device),
                late_flag=torch.zeros((), dtype=torch.bool, device=device))


class StepBuffers:
    """Persistent `StepTensors` for CUDA graphs: allocated once for the largest captured batch.

    `view(...)` gives the captured layers fixed addresses; `fill(...)` (called inside the graph)
    recomputes the step into them, so every replay sees its own positions and lengths.
    """

    def __init__(self, max_bs: int, max_blocks: int, head_dim: int, gate_dim: int, device, late: bool = False):
        self.max_blocks = max_blocks
        self._num_candidates = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self._model_cs = torch.zeros(max_bs, head_dim, dtype=torch.float32, device=device)
        self._gate_cs = torch.zeros(max_bs, gate_dim, dtype=torch.float32, device=device)
        self._table = torch.zeros(max_bs, max_blocks + 1, dtype=torch.int64, device=device)
        # late: the step lists its late blocks (the device-side validity marks): as many entries as the table.
        self._late = late_buffers(max_bs * max_blocks + 1, device) if late else None
        self.nbytes = sum(t.numel() * t.element_size() for t in self._all())

    def _all(self) -> list:
        return [self._num_candidates, self._model_cs, self._gate_cs, self._table] + list((self._late or {}).values())

    def view(self, positions, seq_lens, req_pool_indices) -> StepTensors:
        """Views of the first bs rows, bound to the batch's (static) input tensors."""
        bs = seq_lens.shape[0]
        late = {}
        if self._late is not None:
            n = bs * self.max_blocks + 1
            late = dict(self._late, late_pages=self._late["late_pages"][:n], late_starts=self._late["late_starts"][:n])
        return StepTensors(
            positions=positions,
            seq_lens=seq_lens,
            req_pool_indices=req_pool_indices,
            num_candidates=self._num_candidates[:bs],
            model_cos_sin=self._model_cs[:bs],
            gate_cos_sin=self._gate_cs[:bs],
            block_table=self._table[:bs],
            **late,
        )

    @staticmethod
    def fill(step: StepTensors, fresh: StepTensors) -> None:
        """Copy a freshly computed step into the persistent views (in place: addresses stay)."""
        for dst, src in zip(step.tensors(), fresh.tensors()):
            dst.copy_(src)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """What is fixed for one decode batch, made on the host outside any graph.

    bs: rows of the batch (padded batch size under graphs). max_blocks: width M of the score
    matrix (eager: the batch's most candidates; graphs: the pool's most blocks, fixed).
    graph: shapes and buffers are those of a captured batch size. step: the step tensors to read
    (persistent views under graphs). summary_rows: eager CPU only, `[n]` host tensor of the batch
    rows whose newest token completed a block (None: none did). update_all_rows: eager on a device,
    some row's newest token completed a block, so every row runs the masked summary update (as
    under graphs, which always do): the rows are never copied to the device. dense: the step attends
    densely through the wrapped backend and selection is skipped: eager CPU when no request has more
    candidate blocks than K (attention is exactly dense), or any step whose requests hold at most
    `SASConfig.dense_below` tokens in all (under graphs: the dense IF branch, `backend/graph_branch.py`).
    fused: sparse layers run the three fused launches (`ops.fused_step`), not the per-op path.
    """

    bs: int
    max_blocks: int
    graph: bool
    step: StepTensors
    summary_rows: Optional[torch.Tensor] = None
    update_all_rows: bool = False
    dense: bool = False
    fused: bool = False
