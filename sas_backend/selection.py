"""Block selection, the first half of a sparse decode step, as one component.

    per-page block summaries -> scores of each request's candidate blocks -> Top-K per (request, kv head)

Used by the serving backend (SGLang's paged KV cache) and by the transformers evaluation
(`hf/sparse_eval.py`, a contiguous sequence viewed as pages), so both select with the very same
ops. Each op is an `sas_backend.ops` entry point (Triton on CUDA where a kernel exists, batched
torch otherwise); all are fixed-shape and capturable in a CUDA graph.

Selectors share one interface (`Selector`) and are registered once by name (`register_selector`,
`selector_names`, `selector_class`, `make_selector`); what each needs and offers is declared on its class
(`needs_gate`, `fused_kernels`, `ranks`, `keeps_summaries`, `summary_dim`, `load_gates`), and every check,
choice list and allocation reads those, never a name. Built in:
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
from sas_backend.ops.summary import (
    completed_blocks, run_pages, runs_per_block, summarize_listed, summarize_pages, update_summaries,
)
from sas_backend.ops.topk import select_blocks


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

    summarize(gate, k_buffer `[slots, H_kv, D]`, pages `[N]`, starts `[N]`, model_table, gate_table, k_scale)
        -> summaries `[N, H_kv, summary_dim]` of whole blocks (after an extend).
    update(gate, k_buffer, summaries `[num_pages, H_kv, S]`, block_table, seq_lens, model_table, gate_table,
        k_scale) decode: the block each request's newest token completed, in place.
    k_scale (a float, 1.0 unless the KV cache is fp8): the cache holds K / k_scale, so the keys a selector reads
    are the stored numbers times k_scale.
    scores(gate, q_post `[bs, H_q, D]`, model_cos_sin `[bs, D]`, gate_cos_sin `[bs, Dg]`, summaries,
        block_table, num_candidates, max_blocks) -> `[bs, H_kv, max_blocks]` fp32, -inf past candidates.
    pick(scores, num_candidates) -> `[bs, H_kv, K]` int32 ascending, -1 padded.
    """

    #: The --sas-selector name it is registered under, and one line for the flag's help.
    name = ""
    help = ""
    #: Reads trained gate weights (a --sas-gate checkpoint, `load_gates`); the others get gate None per layer.
    needs_gate = False
    #: Has the fused front / select kernels (`--sas-kernels triton`); the others run the per-op path.
    fused_kernels = False
    #: Ranks blocks by score (prompt anchors take ranked places); False: every block it takes is forced.
    ranks = True
    #: Keeps per-page summaries (`summary_dim` > 0; `--sas-sub-blocks` sets how many a block has).
    keeps_summaries = True
    #: `repair` runs without a host sync (CUDA graphs): the pages' validity marks are served on CUDA.
    capturable_repair = False

    def __init__(self, rule: SelectionRule):
        self.rule = rule

    def summary_dim(self, head_dim: int, gate_dim: int) -> int:
        """Width S of its per-page state `[num_pages, H_kv, S]` (0: none), for a model's head_dim and the gate's
        width gate_dim (0 for selectors without gate weights)."""
        raise NotImplementedError

    @classmethod
    def gate_dim(cls, gate_path) -> int:
        """The width of its gate weights from the checkpoint's config.json alone (memory sizing); 0 without."""
        return 0

    @classmethod
    def load_gates(cls, cfg, geometry, sparse_layers, tp_rank: int, tp_size: int, device) -> "LoadedGates":
        """Its per-layer weights for this rank (`LoadedGates`); selectors without weights get None per layer."""
        return LoadedGates({lid: None for lid in sparse_layers}, 0, None, f"training-free selector {cls.name}")

    def summarize(self, gate, k_buffer, pages, starts, model_table, gate_table, k_scale: float = 1.0) -> torch.Tensor:
        raise NotImplementedError

    def update(self, gate, k_buffer, summaries, block_table, seq_lens, model_table, gate_table,
               k_scale: float = 1.0) -> None:
        raise NotImplementedError

    def scores(self, gate, q_post, model_cos_sin, gate_cos_sin, summaries, block_table, num_candidates, max_blocks):
        raise NotImplementedError

    def repair(self, gate, k_buffer, summaries, pages, starts, count, model_table, gate_table,
               k_scale: float = 1.0) -> None:
        """Summarize the first `count` listed blocks (a decode step's late blocks, `ops.late_blocks.
        list_late_blocks`) into their rows of `summaries` `[num_pages, H_kv, S]`, as `summarize` would. pages,
        starts: `[L]` int64; count: `[1]` int64. This default reads the count on the host (CPU); a selector
        with `capturable_repair` keeps it on the device."""
        n = int(count.reshape(-1)[0])
        if n:
            rows = pages[:n].long()
            summaries[rows] = self.summarize(gate, k_buffer, rows, starts[:n].long(), model_table, gate_table,
                                             k_scale).to(summaries.dtype)

    def _runs(self, pages: torch.Tensor, starts: torch.Tensor):
        """(run pages, run starts) `[N * n]` of each block's n = sub_blocks runs (`ops.summary.run_pages`)."""
        return run_pages(pages, starts, self.rule.sub_blocks, self.rule.sub_size)

    def _per_block(self, run_summaries: torch.Tensor) -> torch.Tensor:
        """`[N * n, H_kv, S]` run summaries -> `[N, H_kv, n * S]` (`ops.summary.runs_per_block`)."""
        return runs_per_block(run_summaries, self.rule.sub_blocks)

    def _update_masked(self, gate, k_buffer, summaries, block_table, seq_lens, model_table, gate_table,
                       k_scale: float = 1.0) -> None:
        """Decode update through `summarize`: every request summarizes its last complete block and writes it to
        its page if this step completed it, else to page 0 (SGLang's padding page); fixed shapes."""
        done, pages, starts = completed_blocks(block_table, seq_lens, self.rule.block_size)
        summ = self.summarize(gate, k_buffer, pages, starts, model_table, gate_table, k_scale)
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


@dataclasses.dataclass(frozen=True)
class LoadedGates:
    """What `Selector.load_gates` returns: gates `{layer_id: module or None}` (this rank's kv heads), gate_dim
    (0: none), sha256 of the checkpoint as read (None: none) and a line naming the source for the log."""

    gates: dict
    gate_dim: int
    sha256: "str | None"
    source: str


_REGISTRY: dict = {}


def register_selector(cls):
    """Class decorator: serve `cls` (a `Selector` subclass) as `--sas-selector cls.name`. Selectors outside this
    package register from a module named by `--sas-selector-module` (imported in every server process)."""
    if not (isinstance(cls, type) and issubclass(cls, Selector)) or not cls.name:
        raise TypeError(f"register_selector takes a Selector subclass with a name, got {cls!r}")
    if _REGISTRY.get(cls.name, cls) is not cls:
        raise ValueError(f"a selector named {cls.name!r} is registered already ({_REGISTRY[cls.name].__qualname__})")
    if not cls.keeps_summaries and cls.fused_kernels:
        raise ValueError(f"selector {cls.name!r}: the fused kernels read summaries, so fused_kernels needs "
                         "keeps_summaries")
    _REGISTRY[cls.name] = cls
    return cls


def selector_names() -> tuple:
    """The registered selector names, in registration order (the built-ins first)."""
    return tuple(_REGISTRY)


def selector_class(name: str) -> type:
    """The `Selector` subclass registered as `name` (ValueError naming the choices if none)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown selector {name!r}; choose one of {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


@register_selector
class GateSelector(Selector):
    """SAS: the trained AttnGate (see the module doc)."""

    name = "gate"
    help = "the trained gate, needs --sas-gate"
    needs_gate = True
    fused_kernels = True
    capturable_repair = True

    def summary_dim(self, head_dim: int, gate_dim: int) -> int:
        return gate_dim * self.rule.sub_blocks

    @classmethod
    def gate_dim(cls, gate_path) -> int:
        from sas_backend.gate.gate_file import open_gate

        return open_gate(gate_path).config.gate_dim

    @classmethod
    def load_gates(cls, cfg, geometry, sparse_layers, tp_rank: int, tp_size: int, device) -> LoadedGates:
        """The checkpoint read once (its hash is what /sas/info reports, whatever the file holds later), checked
        against the model's geometry, sharded to this rank's kv heads."""
        from sas_backend.gate.checkpoint import shard_for_tp, validate_for_geometry
        from sas_backend.gate.gate_file import open_gate
        from sas_backend.gate.module import gates_from_tensors

        gate_file = open_gate(cfg.gate_path)  # this process's one read of the checkpoint (memory sizing shares it)
        gate_cfg, layers = gate_file.loaded()
        validate_for_geometry(gate_cfg, layers, geometry, block_size=cfg.block_size)
        layers = shard_for_tp(layers, tp_rank, tp_size)
        gates = gates_from_tensors(layers, sparse_layers, gate_dim=gate_cfg.gate_dim, device=device)
        gate_file.release_tensors()  # the gates hold their own copies
        return LoadedGates(gates, gate_cfg.gate_dim, gate_file.sha256,
                           f"gate {cfg.gate_path} ({gate_cfg.base_model})")

    def summarize(self, gate: AttnGate, k_buffer, pages, starts, model_table, gate_table,
                  k_scale: float = 1.0) -> torch.Tensor:
        w_k, k_norm = gate.attngate_linear_k.weight, gate.attngate_knorm.weight
        if self.rule.sub_blocks == 1:
            return summarize_pages(k_buffer, pages, starts, model_table, gate_table, w_k, k_norm, self.rule.block_size,
                                   k_scale)
        run_pages, run_starts = self._runs(pages, starts)
        return self._per_block(summarize_pages(k_buffer, run_pages, run_starts, model_table, gate_table, w_k, k_norm,
                                               self.rule.sub_size, k_scale))

    def update(self, gate: AttnGate, k_buffer, summaries, block_table, seq_lens, model_table, gate_table,
               k_scale: float = 1.0) -> None:
        if self.rule.sub_blocks > 1:
            return self._update_masked(gate, k_buffer, summaries, block_table, seq_lens, model_table, gate_table,
                                       k_scale)
        update_summaries(
            k_buffer, summaries, block_table, seq_lens, self.rule.block_size, model_table, gate_table,
            gate.attngate_linear_k.weight, gate.attngate_knorm.weight, k_scale,
        )

    def repair(self, gate: AttnGate, k_buffer, summaries, pages, starts, count, model_table, gate_table,
               k_scale: float = 1.0) -> None:
        summarize_listed(k_buffer, summaries, pages, starts, count, self.rule.block_size, model_table, gate_table,
                         gate.attngate_linear_k.weight, gate.attngate_knorm.weight, k_scale, self.rule.sub_blocks)

    def scores(self, gate: AttnGate, q_post, model_cos_sin, gate_cos_sin, summaries, block_table, num_candidates,
               max_blocks):
        gate_q = gate_query_post_rope(
            q_post, model_cos_sin, gate.attngate_linear_q.weight, gate.attngate_qnorm.weight, gate_cos_sin
        )
        return score_blocks(gate_q, summaries, block_table, num_candidates, self.rule.block_size, max_blocks,
                            sub_blocks=self.rule.sub_blocks)


@register_selector
class QuestSelector(Selector):
    """Quest: per-block key min|max bound of q.k (see `ops.quest`)."""

    name = "quest"
    help = "training-free: per-block key min/max bound of q.k"

    def summary_dim(self, head_dim: int, gate_dim: int) -> int:
        return 2 * head_dim * self.rule.sub_blocks

    def summarize(self, gate, k_buffer, pages, starts, model_table, gate_table, k_scale: float = 1.0) -> torch.Tensor:
        if self.rule.sub_blocks == 1:
            return key_bounds(k_buffer, pages, self.rule.block_size, k_scale)
        return self._per_block(key_bounds(k_buffer, self._runs(pages, starts)[0], self.rule.sub_size, k_scale))

    def update(self, gate, k_buffer, summaries, block_table, seq_lens, model_table, gate_table,
               k_scale: float = 1.0) -> None:
        if self.rule.sub_blocks > 1:
            return self._update_masked(gate, k_buffer, summaries, block_table, seq_lens, model_table, gate_table,
                                       k_scale)
        update_key_bounds(k_buffer, summaries, block_table, seq_lens, self.rule.block_size, k_scale)

    def scores(self, gate, q_post, model_cos_sin, gate_cos_sin, summaries, block_table, num_candidates, max_blocks):
        if self.rule.sub_blocks == 1:
            return quest_scores(q_post, summaries, block_table, num_candidates, self.rule.block_size, max_blocks)
        return self._best_run(lambda runs: quest_scores(q_post, runs, block_table, num_candidates,
                                                        self.rule.block_size, max_blocks), summaries)


@register_selector
class SinkLocalSelector(Selector):
    """The first `sink_blocks` (default 1) and the blocks before the current one, K in all; no summaries."""

    name = "sink-local"
    help = "training-free: the first block(s) and the blocks right before the current one"
    ranks = False
    keeps_summaries = False

    def __init__(self, rule: SelectionRule):
        sink = min(rule.sink_blocks or 1, rule.top_k)
        super().__init__(dataclasses.replace(rule, sink_blocks=sink, local_blocks=rule.top_k - sink))

    def summary_dim(self, head_dim: int, gate_dim: int) -> int:
        return 0

    def summarize(self, gate, k_buffer, pages, starts, model_table, gate_table, k_scale: float = 1.0) -> torch.Tensor:
        return torch.zeros(pages.shape[0], k_buffer.shape[1], 0, device=k_buffer.device)

    def update(self, gate, k_buffer, summaries, block_table, seq_lens, model_table, gate_table,
               k_scale: float = 1.0) -> None:
        return None

    def scores(self, gate, q_post, model_cos_sin, gate_cos_sin, summaries, block_table, num_candidates, max_blocks):
        # Every candidate is forced or unranked: equal scores, so only the forced tiers decide.
        return torch.zeros(q_post.shape[0], summaries.shape[1], max_blocks, device=q_post.device)


def make_selector(name: str, rule: SelectionRule) -> Selector:
    """The selector registered as `name` (`selector_names()`) under `rule`."""
    return selector_class(name)(rule)


def import_selector_modules(modules) -> None:
    """Import each named module (a comma-separated string or a sequence; `--sas-selector-module`): importing one
    registers its selectors. ImportError names the module."""
    import importlib

    names = modules.split(",") if isinstance(modules, str) else list(modules or ())
    for name in (n.strip() for n in names):
        if name:
            try:
                importlib.import_module(name)
            except ImportError as e:
                raise ImportError(f"--sas-selector-module {name}: {e}") from e

