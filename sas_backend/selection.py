"""Block selection, the first half of a sparse decode step, as one component.

    per-page block summaries -> scores of each request's candidate blocks -> Top-K per (request, kv head)

Used by the serving backend (SGLang's paged KV cache) and by the transformers evaluation
(`hf/sparse_eval.py`, a contiguous sequence viewed as pages), so both select with the very same
ops. Each op is an `sas_backend.ops` entry point (Triton on CUDA where a kernel exists, batched
torch otherwise); all are fixed-shape and capturable in a CUDA graph.

Three selectors share one interface (`SELECTORS`, `make_selector`):
- `gate` (SAS): the trained AttnGate; summaries `[pages, H_kv, Dg]` from the keys with the model's
  RoPE undone; scores = gate query . summary / sqrt(Dg).
- `quest` (training-free): summaries `[pages, H_kv, 2D]` = min|max of the post-RoPE keys; scores =
  the upper bound of q.k over the block, max over the kv group's query heads.
- `sink-local` (training-free, StreamingLLM-like): no summaries; the first block(s) and the blocks
  right before the current one.

Vocabulary (the ops' docstrings use it too): a page is one block of b tokens; `block_table`
`[bs, >= M + 1]` holds the KV slot of the first token of each logical block of each request
(token o of block m sits at slot block_table[r, m] + o, its summary in row block_table[r, m] // b);
`num_candidates` `[bs]` counts the complete blocks before the current one.
"""

from __future__ import annotations

import dataclasses

import torch

from sas_backend.gate.module import AttnGate
from sas_backend.ops import sub_blocks_ok
from sas_backend.ops.anchors import force_anchors
from sas_backend.ops.gate import gate_query_post_rope
from sas_backend.ops.quest import key_bounds, quest_scores, update_key_bounds
from sas_backend.ops.score import score_blocks
from sas_backend.ops.summary import completed_blocks, summarize_pages, update_summaries
from sas_backend.ops.topk import select_blocks

SELECTORS = ("gate", "quest", "sink-local")


@dataclasses.dataclass(frozen=True)
class SelectionRule:
    """What to select: K = budget // b previous blocks per (request, kv head), of which the first
    `sink_blocks` and the `local_blocks` before the current block are forced (inside K).

    sub_blocks: summaries per block for the selectors that keep them (gate, quest): each of a block's
    `sub_blocks` runs of b / sub_blocks tokens is summarized as a block of its own (the gate's pooling and
    RoPE at the run's first position; quest's min / max), and the block scores the MAX of its runs' scores,
    so one needle-like key in a run is not averaged away by the other b - b / sub_blocks. 1: today's rule.
    """

    top_k: int
    block_size: int = 64
    sink_blocks: int = 0
    local_blocks: int = 0
    sub_blocks: int = 1

    def __post_init__(self):
        n = self.sub_blocks
        if not sub_blocks_ok(n, self.block_size):
            raise ValueError(f"sub_blocks must be a power of two dividing the block size {self.block_size}, got {n}")

    @property
    def sub_size(self) -> int:
        """Tokens per summarized run (the block size when sub_blocks is 1)."""
        return self.block_size // self.sub_blocks


class Selector:
    """One selector under one `SelectionRule`. Per layer, the caller passes the layer's gate (None
    for the training-free selectors) and the RoPE tables; the selector holds no per-step state.

    summarize(gate, k_buffer `[slots, H_kv, D]`, pages `[N]`, starts `[N]`, model_table, gate_table)
        -> summaries `[N, H_kv, summary_dim]` of whole blocks (after an extend).
    update(gate, k_buffer, summaries `[num_pages, H_kv, S]`, block_table, seq_lens, model_table, gate_table)
        decode: the block each request's newest token completed, in place.
    scores(gate, q_post `[bs, H_q, D]`, model_cos_sin `[bs, D]`, gate_cos_sin `[bs, Dg]`, summaries,
        block_table, num_candidates, max_blocks) -> `[bs, H_kv, max_blocks]` fp32, -inf past candidates.
    pick(scores, num_candidates) -> `[bs, H_kv, K]` int32 ascending, -1 padded.
    """

    name = ""
    needs_gate = False

    def __init__(self, rule: SelectionRule):
        self.rule = rule

    def summary_dim(self, head_dim: int, gate_dim: int) -> int:
        raise NotImplementedError

    def summarize(self, gate, k_buffer, pages, starts, model_table, gate_table) -> torch.Tensor:
        raise NotImplementedError

    def update(self, gate, k_buffer, summaries, block_table, seq_lens, model_table, gate_table) -> None:
        raise NotImplementedError

    def scores(self, gate, q_post, model_cos_sin, gate_cos_sin, summaries, block_table, num_candidates, max_blocks):
        raise NotImplementedError

    def _runs(self, pages: torch.Tensor, starts: torch.Tensor):
        """(run pages `[N * n]`, run starts `[N * n]`) of the n = sub_blocks runs of each block, as pages of
        sub_size tokens: run j of physical page p is run page p * n + j (its slots p*b + j*S ..), in order."""
        n, size = self.rule.sub_blocks, self.rule.sub_size
        j = torch.arange(n, device=pages.device)
        return (pages.long()[:, None] * n + j).reshape(-1), (starts.long()[:, None] + j * size).reshape(-1)

    def _per_block(self, run_summaries: torch.Tensor) -> torch.Tensor:
        """`[N * n, H_kv, S]` run summaries -> `[N, H_kv, n * S]`, run j in columns j*S .. (j+1)*S - 1."""
        n = self.rule.sub_blocks
        rows, h_kv, width = run_summaries.shape
        return run_summaries.view(rows // n, n, h_kv, width).transpose(1, 2).reshape(rows // n, h_kv, n * width)

    def _update_masked(self, gate, k_buffer, summaries, block_table, seq_lens, model_table, gate_table) -> None:
        """Decode update through `summarize`: every request summarizes its last complete block and writes it to
        its page if this step completed it, else to page 0 (SGLang's padding page); fixed shapes."""
        done, pages, starts = completed_blocks(block_table, seq_lens, self.rule.block_size)
        summ = self.summarize(gate, k_buffer, pages, starts, model_table, gate_table)
        summaries.index_copy_(0, torch.where(done, pages, 0), summ.to(summaries.dtype))

    def _best_run(self, score, summaries: torch.Tensor) -> torch.Tensor:
        """max over the n runs of `score(run summaries [num_pages, H_kv, S])`: each run's columns scored by the
        one-summary statement (its own gather and -inf past the candidates), the block taking its best run
        (quest; the gate's `ops.score` takes the runs itself)."""
        width = summaries.shape[-1] // self.rule.sub_blocks
        return torch.stack([score(summaries[..., j * width:(j + 1) * width])
                            for j in range(self.rule.sub_blocks)]).amax(dim=0)

    def pick(self, scores: torch.Tensor, num_candidates: torch.Tensor) -> torch.Tensor:
        r = self.rule
        return select_blocks(scores, num_candidates, r.top_k, r.sink_blocks, r.local_blocks)

    def select(self, gate, q_post, model_cos_sin, gate_cos_sin, summaries, block_table, num_candidates, max_blocks,
               anchors=None):
        """`pick(scores(...))`: selected blocks `[bs, H_kv, K]` int32 (ascending, -1 padded). anchors: optional
        `[bs, H_kv, R]` blocks each row takes right after its forced ones (`ops.anchors.force_anchors`)."""
        scores = self.scores(
            gate, q_post, model_cos_sin, gate_cos_sin, summaries, block_table, num_candidates, max_blocks
        )
        if anchors is not None:
            scores = force_anchors(scores, anchors, num_candidates)
        return self.pick(scores, num_candidates)


class GateSelector(Selector):
    """SAS: the trained AttnGate (see the module doc)."""

    name = "gate"
    needs_gate = True

    def summary_dim(self, head_dim: int, gate_dim: int) -> int:
        return gate_dim * self.rule.sub_blocks

    def summarize(self, gate: AttnGate, k_buffer, pages, starts, model_table, gate_table) -> torch.Tensor:
        w_k, k_norm = gate.attngate_linear_k.weight, gate.attngate_knorm.weight
        if self.rule.sub_blocks == 1:
            return summarize_pages(k_buffer, pages, starts, model_table, gate_table, w_k, k_norm, self.rule.block_size)
        run_pages, run_starts = self._runs(pages, starts)
        return self._per_block(summarize_pages(k_buffer, run_pages, run_starts, model_table, gate_table, w_k, k_norm,
                                               self.rule.sub_size))

    def update(self, gate: AttnGate, k_buffer, summaries, block_table, seq_lens, model_table, gate_table) -> None:
        if self.rule.sub_blocks > 1:
            return self._update_masked(gate, k_buffer, summaries, block_table, seq_lens, model_table, gate_table)
        update_summaries(
            k_buffer, summaries, block_table, seq_lens, self.rule.block_size, model_table, gate_table,
            gate.attngate_linear_k.weight, gate.attngate_knorm.weight,
        )

    def scores(self, gate: AttnGate, q_post, model_cos_sin, gate_cos_sin, summaries, block_table, num_candidates,
               max_blocks):
        gate_q = gate_query_post_rope(
            q_post, model_cos_sin, gate.attngate_linear_q.weight, gate.attngate_qnorm.weight, gate_cos_sin
        )
        return score_blocks(gate_q, summaries, block_table, num_candidates, self.rule.block_size, max_blocks,
                            sub_blocks=self.rule.sub_blocks)


class QuestSelector(Selector):
    """Quest: per-block key min|max bound of q.k (see `ops.quest`)."""

    name = "quest"

    def summary_dim(self, head_dim: int, gate_dim: int) -> int:
        return 2 * head_dim * self.rule.sub_blocks

    def summarize(self, gate, k_buffer, pages, starts, model_table, gate_table) -> torch.Tensor:
        if self.rule.sub_blocks == 1:
            return key_bounds(k_buffer, pages, self.rule.block_size)
        return self._per_block(key_bounds(k_buffer, self._runs(pages, starts)[0], self.rule.sub_size))

    def update(self, gate, k_buffer, summaries, block_table, seq_lens, model_table, gate_table) -> None:
        if self.rule.sub_blocks > 1:
            return self._update_masked(gate, k_buffer, summaries, block_table, seq_lens, model_table, gate_table)
        update_key_bounds(k_buffer, summaries, block_table, seq_lens, self.rule.block_size)

    def scores(self, gate, q_post, model_cos_sin, gate_cos_sin, summaries, block_table, num_candidates, max_blocks):
        if self.rule.sub_blocks == 1:
            return quest_scores(q_post, summaries, block_table, num_candidates, self.rule.block_size, max_blocks)
        return self._best_run(lambda runs: quest_scores(q_post, runs, block_table, num_candidates,
                                                        self.rule.block_size, max_blocks), summaries)


class SinkLocalSelector(Selector):
    """The first `sink_blocks` (default 1) and the blocks before the current one, K in all; no summaries."""

    name = "sink-local"

    def __init__(self, rule: SelectionRule):
        sink = min(rule.sink_blocks or 1, rule.top_k)
        super().__init__(dataclasses.replace(rule, sink_blocks=sink, local_blocks=rule.top_k - sink))

    def summary_dim(self, head_dim: int, gate_dim: int) -> int:
        return 0

    def summarize(self, gate, k_buffer, pages, starts, model_table, gate_table) -> torch.Tensor:
        return torch.zeros(pages.shape[0], k_buffer.shape[1], 0, device=k_buffer.device)

    def update(self, gate, k_buffer, summaries, block_table, seq_lens, model_table, gate_table) -> None:
        return None

    def scores(self, gate, q_post, model_cos_sin, gate_cos_sin, summaries, block_table, num_candidates, max_blocks):
        # Every candidate is forced or unranked: equal scores, so only the forced tiers decide.
        return torch.zeros(q_post.shape[0], summaries.shape[1], max_blocks, device=q_post.device)


def make_selector(name: str, rule: SelectionRule) -> Selector:
    """The selector called `name` (one of `SELECTORS`) under `rule`."""
    kinds = {"gate": GateSelector, "quest": QuestSelector, "sink-local": SinkLocalSelector}
    if name not in kinds:
        raise ValueError(f"unknown selector {name!r}; choose one of {', '.join(SELECTORS)}")
    return kinds[name](rule)

