"""The sparse decode step as ONE object: what the server runs, the GPU benchmark times and the tests drive.

    step = DecodeStep(selector, geometry, req_to_token, device, q_dtype, kv_dtype, scaling, settings,
                      summaries=pool, gates=gates, rope=tables, anchors=anchor_pool, kv_scales=scales)  # once
    step.init_graph_state(max_bs)                                  # CUDA graphs: persistent step buffers
    plan = step.plan(positions, seq_lens, req_pool_indices, seq_lens_cpu, graph_bs)
    step.fill(plan)                                                # captured: the step's device state
    step.repair(plan, {layer_id: k_buffer})                        # repair_late: the late blocks, every layer
    out = step.run(plan, layer_id, q, k_buffer, v_buffer)          # per sparse layer

The step holds what its layers read: the summary pool, the prompt-anchor pool, the gates (and the fused front's
copies of their weights), the layers' fp8 KV scales and the RoPE tables (`follow_rope`, called before each forward,
takes the step's snapshot of them: every layer of one step reads the same tensors). Its settings are one
`StepSettings` (`step_settings.py`).

`plan` is frozen per batch (`decode_plan.DecodePlan`): it decides once whether the step is sparse or dense
(eager CPU steps whose requests have at most K candidates are exactly dense; `--sas-dense-below`) and, under
CUDA graphs, leaves the choice to the captured branches. Per sparse layer `run` is one of two paths:

- fused (`kernels="triton"`): `ops.fused_step` front -> select -> attend, three launches a layer, each
  split so batch 1 fills the GPU (the gate selector only; batches above the fused workspace's rows take
  the per-op path, whose grids are wide at such batches anyway);
- per op (`kernels="torch"`): the selector's summary update and selection (`sas_backend.selection`: torch on
  CPU, the per-op Triton kernels on CUDA), then the attention.

Attention (`attention`): "triton" (`ops.fused_step.attend`, over the block table), "flashinfer" (the token
rows gathered, FlashInfer's paged decode; CUDA only) or "torch" (one masked SDPA; CPU).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import torch

from sas_backend.backend.decode_plan import DecodePlan, StepBuffers, StepTensors
from sas_backend.backend.graph_branch import captured_if, capturing, conditional_nodes_supported
from sas_backend.backend.step_settings import StepSettings
from sas_backend.ops import fused_step
from sas_backend.ops.key_codes import encode_pages
from sas_backend.ops.late_blocks import list_late_blocks
from sas_backend.ops.rerank import RerankWorkspace, candidate_lse, rerank_attend, rerank_blocks
from sas_backend.ops.sparse_decode import make_sparse_decode
from sas_backend.ops.summary import completed_blocks

# Most rows the fused path serves in one step: its workspace grows with it (~57.5 MiB at Qwen3-4B shapes and
# 256K context); larger batches fill the device with the per-op kernels' own grids.
FUSED_MAX_ROWS = 256
NO_SCALES = (1.0, 1.0)


class DecodeStep:
    """Selection + attention of every sparse layer of a decode step.

    selector: a `sas_backend.selection.Selector` (its rule gives K, b and the forced blocks); geometry:
    `ops.fused_step.StepGeometry` of a layer on this rank; req_to_token: SGLang's `[max_reqs, max_ctx]`
    slot table; device, q_dtype, kv_dtype: as served; scaling: the layers' softmax scale; settings: a
    `StepSettings` (kernels / attention: see the module doc; dense_below: `--sas-dense-below`; the fused
    launches' split sizes and `LaunchOptions`; gate_dtype: what the fused front reads the gate weights in, bf16:
    copies made here).

    What the layers read, by layer id: summaries `{layer: [num_pages, H_kv, S]}` (a `SummaryPool`, or any
    mapping; updated in place when a row's token completes a block); gates `{layer: AttnGate}` (None values, or
    no mapping, for training-free selectors); rope: the tables' source (`rope_tables.RopeTables` or
    `FixedRopeTables`: `.model` `[max_pos, D]`, `.gate` `[max_pos, Dg]`); anchors: `{layer: [max_reqs, H_kv, R]}`
    int32 prompt anchors (an `AnchorPool`; None: off); kv_scales `{layer: (k_scale, v_scale)}` of an fp8 cache
    (missing layers: 1.0).

    force_sparse: eager CPU steps select even where dense attention is exactly what selection would attend
    (tests: the sparse path itself is checked); workspace: a float workspace FlashInfer may share;
    rows_per_request: decode rows a request may bring to one step (n draft tokens of a speculative verify);
    repair_late: the step keeps the summary pool's validity marks on the device (`summaries.valid`; the form CUDA
    graphs can hold): `repair` lists the complete blocks whose pages hold no valid summary, marks the step's
    complete blocks and summarizes the listed ones in every sparse layer before the step's layers run
    (`ops.late_blocks`); exact_rerank: X > 1 selects in two levels (`--sas-exact-rerank`): the selector (or the fused
    select) picks X x K blocks, `ops.rerank` keeps the K of highest exact attention mass among them.
    """

    def __init__(self, selector, geometry: fused_step.StepGeometry, req_to_token: torch.Tensor, device, q_dtype,
                 kv_dtype, scaling: float, settings: StepSettings = StepSettings(), *,
                 summaries: Optional[Mapping] = None, gates=None, rope=None, anchors: Optional[Mapping] = None,
                 kv_scales: Optional[Mapping] = None, force_sparse: bool = False,
                 workspace: Optional[torch.Tensor] = None, rows_per_request: int = 1, repair_late: bool = False,
                 exact_rerank: int = 1):
        self.device = torch.device(device)
        self.settings = settings.check(self.device, selector)
        if geometry.sub_blocks != selector.rule.sub_blocks:
            raise ValueError(f"geometry.sub_blocks {geometry.sub_blocks} differs from the selector's "
                             f"{selector.rule.sub_blocks}: the fused kernels would misread the summary rows")
        self.selector = selector
        self.geo = geometry.check()
        self.req_to_token = req_to_token
        self.block_size = geometry.block_size
        self.top_k = geometry.top_k
        self.max_blocks = req_to_token.shape[1] // self.block_size
        self.on_device = self.device.type != "cpu"
        self.scaling = float(scaling)
        self.kernels, self.attention = settings.kernels, settings.attention
        self.dense_below = int(settings.dense_below)
        self.force_sparse = bool(force_sparse)
        self.gate_dtype = settings.gate_dtype
        self.summaries = summaries
        # --sas-rerank-keys int4: {layer: (packed, scales)} 4-bit key codes the second level reads (`ops.key_codes`),
        # held by the summary pool and written wherever a page's summary is ({}: the second level reads the cache)
        self.key_codes = getattr(summaries, "key_codes", None) or {}
        self.gates = gates if gates is not None else {}
        self.rope = rope
        self.anchors = anchors
        self.kv_scales = kv_scales if kv_scales is not None else {}
        # The RoPE tables every layer of the current step reads (`follow_rope`, host side, before a step).
        self.model_table = self.gate_table = None
        self.follow_rope()
        self._front_weights: dict = {}  # id(gate) -> (w_q, q_norm, w_k, k_norm) in gate_dtype
        max_rows = req_to_token.shape[0] * max(1, int(rows_per_request))  # most decode rows of a step
        self.fused_ws = None
        if self.fused_workspace(settings):
            self.fused_ws = fused_step.DecodeStepWorkspace(geometry, self.fused_rows(max_rows), self.max_blocks,
                                                           self.device, chunk=settings.select_chunk,
                                                           target_programs=settings.target_programs,
                                                           launch=settings.launch)
        # Two levels (--sas-exact-rerank X): the first picks X x K blocks (its own fused select workspace), the
        # second keeps K by exact mass (its kernel's workspace on CUDA; its K-wide output persists for graphs).
        self.exact_rerank = max(1, int(exact_rerank))
        self.first_selector, self.first_ws, self.rerank_ws, self.rerank_out = selector, self.fused_ws, None, None
        if self.exact_rerank > 1:
            first_k = self.exact_rerank * self.top_k
            if not selector.ranks:
                raise ValueError(f"exact_rerank ranks the blocks a selector picks; {selector.name} forces them all")
            self.first_selector = type(selector)(dataclasses.replace(selector.rule, top_k=first_k))
            if self.fused_ws is not None:
                self.first_ws = fused_step.DecodeStepWorkspace(
                    dataclasses.replace(geometry, top_k=first_k), self.fused_rows(max_rows), self.max_blocks,
                    self.device, chunk=settings.select_chunk, target_programs=settings.target_programs,
                    launch=settings.launch)
            if self.rerank_kernel(self.on_device, self.fused_ws is not None):
                ranked = self.fused_rows(max_rows) if self.ranks_in_attend(settings) else 0
                self.rerank_ws = RerankWorkspace(max_rows, geometry.num_kv_heads, geometry.group, first_k,
                                                 self.device, ranked_rows=ranked)
            self.rerank_out = torch.full((max_rows, geometry.num_kv_heads, self.top_k), -1, dtype=torch.int32,
                                         device=self.device)
        # Off CUDA the per-op step ranks and attends over one gather of the candidates (`ops.rerank.rerank_attend`);
        # False: the second level, then the sparse decode over what it kept (what benchmarks compare against).
        self.rerank_attends = not self.on_device
        # The per-op attention: every step when attention is not "triton", else batches past the workspace.
        self.sparse_decode = make_sparse_decode(
            self.device, geometry.num_kv_heads, geometry.group, geometry.head_dim, self.top_k, self.block_size,
            max_rows=max_rows * geometry.num_kv_heads, q_dtype=q_dtype, kv_dtype=kv_dtype, workspace=workspace,
        ) if self.per_op_attention(settings, max_rows) else None
        self.buffers: Optional[StepBuffers] = None
        self.repair_late = bool(repair_late)
        if self.repair_late and getattr(summaries, "valid", None) is None:
            raise ValueError("repair_late needs summaries with validity marks (a SummaryPool's `valid`)")
        self.late_total = torch.zeros(1, dtype=torch.int64, device=self.device)  # blocks listed late (/sas/info)
        self.last_selected: Optional[torch.Tensor] = None  # the last run's selection (debug log, tests)
        self._attach_gates()

    # What a step of these settings allocates, decided here once (backend.memory reserves by the same rules).
    @staticmethod
    def fused_workspace(settings: StepSettings) -> bool:
        """Whether the fused kernels' workspace exists (either fused launch runs)."""
        return settings.kernels == "triton" or settings.attention == "triton"

    @staticmethod
    def fused_rows(max_rows: int) -> int:
        """Rows the fused workspace serves for steps of up to `max_rows` decode rows."""
        return min(max_rows, FUSED_MAX_ROWS)

    @staticmethod
    def per_op_attention(settings: StepSettings, max_rows: int) -> bool:
        """Whether the per-op sparse attention exists (FlashInfer's on CUDA): every step's when attention is not
        "triton", else the batches past the fused workspace's rows."""
        return settings.attention != "triton" or max_rows > FUSED_MAX_ROWS

    @property
    def front_weight_nbytes(self) -> int:
        """Device bytes of the fused front's copies of the gate weights (0 where it reads the gates themselves)."""
        return sum(t.numel() * t.element_size() for ts in self._front_weights.values() for t in ts)

    @property
    def rerank_nbytes(self) -> int:
        """Device bytes of the second level's buffers (the first level's fused select workspace, the rerank kernel's
        workspace, the selection it writes); 0 with one level."""
        if self.exact_rerank == 1:
            return 0
        first = self.first_ws.nbytes if self.first_ws is not None else 0
        return first + (self.rerank_ws.nbytes if self.rerank_ws is not None else 0) + self.rerank_out.numel() * 4

    @staticmethod
    def rerank_kernel(on_device: bool, fused: bool) -> bool:
        """Whether the second level's Triton kernel (and its workspace) exists: on a device, or beside the fused
        kernels (Triton's interpreter on CPU). `__init__` and `rerank_bytes_for` decide by this one rule."""
        return on_device or fused

    @staticmethod
    def ranks_in_attend(settings: StepSettings) -> bool:
        """Whether the fused attend chooses the second level's K blocks itself (`LaunchOptions.rank_in_attend`, the
        Triton attention): the rerank kernel then keeps every (row, kv head)'s log-sum-exps for the fused rows."""
        return settings.attention == "triton" and settings.launch.rank_in_attend

    def attends_in_rerank(self, fused: bool, triton_attention: bool, codes: bool) -> bool:
        """Whether the second level and the attention run as one torch pass (`ops.rerank.rerank_attend`): two
        levels, `rerank_attends` (off CUDA), the per-op selection and attention, exact keys (4-bit codes rank from
        the codes, so their attention reads K anyway). `run` and the launch log decide by this one rule."""
        return self.exact_rerank > 1 and self.rerank_attends and not fused and not triton_attention and not codes

    @classmethod
    def rerank_bytes_for(cls, exact_rerank: int, num_kv_heads: int, group: int, top_k: int, max_rows: int,
                         on_device: bool, fused: bool, first_workspace_bytes: int = 0, ranked: bool = False) -> int:
        """`rerank_nbytes` of a step of these sizes (`backend.memory` reserves it): fused, whether the fused kernels'
        workspace exists (`fused_workspace`); first_workspace_bytes, their select workspace at X x K
        (`memory.decode_step_workspace_bytes`); ranked, whether the attend ranks (`ranks_in_attend`)."""
        if exact_rerank <= 1:
            return 0
        kernel = cls.rerank_kernel(on_device, fused)
        ranked_rows = cls.fused_rows(max_rows) if ranked else 0
        ws = RerankWorkspace.nbytes_for(max_rows, num_kv_heads, group, exact_rerank * top_k,
                                        ranked_rows=ranked_rows) if kernel else 0
        return first_workspace_bytes + ws + max_rows * num_kv_heads * top_k * 4

    @property
    def device_nbytes(self) -> int:
        """Device bytes this object allocated (the fused workspace, the front's gate-weight copies and the second
        level's buffers; the pools it was handed and FlashInfer's buffers are counted by `backend.memory` under their
        own names)."""
        return (self.fused_ws.nbytes if self.fused_ws is not None else 0) + self.front_weight_nbytes \
            + self.rerank_nbytes

    def follow_rope(self) -> None:
        """Take the RoPE tables' current tensors (host side, before a step or an extend: `RopeTables` follows SGLang
        replacing its table). Once graphs are captured the tables are frozen: a reallocation raises there."""
        if self.rope is not None:
            self.model_table, self.gate_table = self.rope.model, self.rope.gate

    def _attach_gates(self) -> None:
        """The gate weights the fused front reads: fp32 reads the gates' own tensors; bf16 keeps a bf16 copy of each
        (the front's largest read, the query projection, halves; every other path still reads the fp32 gate)."""
        if self.kernels != "triton" or self.gate_dtype == torch.float32:
            return
        gates = self.gates.values() if isinstance(self.gates, Mapping) else self.gates
        for gate in gates:
            if gate is not None:
                self._front_weights[id(gate)] = tuple(
                    t.detach().to(self.gate_dtype).contiguous()
                    for t in (gate.attngate_linear_q.weight, gate.attngate_qnorm.weight,
                              gate.attngate_linear_k.weight, gate.attngate_knorm.weight))

    def front_weights(self, gate) -> tuple:
        """(w_q, q_norm, w_k, k_norm) of a gate as the fused front reads them."""
        if self.gate_dtype == torch.float32:
            return (gate.attngate_linear_q.weight, gate.attngate_qnorm.weight, gate.attngate_linear_k.weight,
                    gate.attngate_knorm.weight)
        try:
            return self._front_weights[id(gate)]
        except KeyError:
            raise RuntimeError("sas: the decode step's bf16 gate copies are made when the step is built, from its "
                               "gates (never inside a captured graph); this gate was not among them") from None

    def gate(self, layer_id: int):
        """The layer's `AttnGate` (None under a training-free selector)."""
        return self.gates[layer_id] if self.selector.needs_gate else None

    def scales(self, layer_id: int) -> "tuple[float, float]":
        """(k_scale, v_scale) of a layer's fp8 KV ((1.0, 1.0) when the cache is not fp8)."""
        return self.kv_scales.get(layer_id, NO_SCALES)

    def summarize_blocks(self, layer_id: int, k_buffer: torch.Tensor, pages: torch.Tensor,
                         starts: torch.Tensor) -> None:
        """Write the summaries of whole blocks (physical `pages` `[N]`, first positions `starts` `[N]`) of one sparse
        layer from the keys `k_buffer` `[slots, H_kv, D]` holds: an extend's completed blocks, late ones."""
        self.summaries[layer_id][pages] = self.selector.summarize(
            self.gate(layer_id), k_buffer, pages, starts, self.model_table, self.gate_table,
            self.scales(layer_id)[0])
        if self.key_codes:
            encode_pages(k_buffer, pages, self.block_size, *self.key_codes[layer_id], self.scales(layer_id)[0])

    def encode_completed(self, layer_id: int, k_buffer: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor) -> None:
        """The 4-bit key codes of the block each row's newest token completed (`--sas-rerank-keys int4`; nothing
        otherwise): as the summary update, fixed shapes (rows that completed nothing list page -1)."""
        if not self.key_codes:
            return
        done, pages, _ = completed_blocks(block_table, seq_lens, self.block_size)
        encode_pages(k_buffer, torch.where(done, pages, -1), self.block_size, *self.key_codes[layer_id],
                     self.scales(layer_id)[0])

    # ------------------------------------------------------------------ plan (host)
    def init_graph_state(self, max_bs: int, model_dim: int, gate_dim: int) -> None:
        """Persistent step buffers for captured batches of up to max_bs rows."""
        self.buffers = StepBuffers(max_bs, self.max_blocks, model_dim, gate_dim, self.device, late=self.repair_late)

    def short_step(self, seq_lens_cpu: torch.Tensor) -> bool:
        """`--sas-dense-below`: the step's requests hold at most that many tokens in all. Rows of length <= 1
        are a graph's padding (a decode row holds a prompt token and the new one): a padded graph step
        decides as the same batch does eagerly."""
        if not self.dense_below:
            return False
        return int(seq_lens_cpu[seq_lens_cpu > 1].sum()) <= self.dense_below

    def compute(self, positions, seq_lens, req_pool_indices, max_blocks, late: bool = False) -> StepTensors:
        """The step's device tensors (fixed shapes, no host sync), at the step's RoPE tables; late: with buffers
        for its late blocks (an eager step's own; a captured one's are `StepBuffers`')."""
        return StepTensors.compute(positions, seq_lens, req_pool_indices, self.req_to_token, self.model_table,
                                   self.gate_table, self.block_size, max_blocks, late=late)

    def plan(self, positions, seq_lens, req_pool_indices, seq_lens_cpu: torch.Tensor, graph_bs: Optional[int] = None,
             branched: bool = False, short: Optional[bool] = None) -> DecodePlan:
        """The frozen plan of one decode batch, from the host lengths (never a device-to-host copy).

        positions, seq_lens, req_pool_indices: `[bs]` the batch's device tensors; seq_lens_cpu: `[bs]` int64 their
        host mirror.

        graph_bs: the captured batch size (capture and replay: fixed shapes, the state is filled in the
        graph by `fill`); branched: the captured step holds both a sparse and a dense branch
        (`--sas-dense-below` with IF nodes), so `dense` names the branch this replay takes; short: the
        `short_step` decision when the caller made it on other lengths (a verify step: its requests', not its
        decode rows').
        """
        bs = seq_lens.shape[0]
        short = self.short_step(seq_lens_cpu) if short is None else short
        if graph_bs is not None:
            if self.buffers is None:
                raise RuntimeError("sas: init_graph_state must run before a captured decode step")
            self._plan_attention(seq_lens_cpu, graph_bs, graph=True)
            step = self.buffers.view(positions, seq_lens, req_pool_indices)
            return DecodePlan(bs, self.max_blocks, True, step, dense=short and branched,
                              fused=self._fused(graph_bs))
        most = int(seq_lens_cpu.max()) if bs else 1
        max_blocks = max(1, (most - 1) // self.block_size)  # the longest request's candidates
        step = self.compute(positions, seq_lens, req_pool_indices, max_blocks, late=self.repair_late)
        # Which rows' newest token completes a block is known on the host. On a device, copying their indices
        # over would be a blocking host-to-device copy every such step: every row runs the masked update.
        done = (seq_lens_cpu > 0) & (seq_lens_cpu % self.block_size == 0)
        if not self.on_device:
            rows = done.nonzero().flatten()  # host tensors on CPU: indexing with them copies nothing
            update = dict(summary_rows=rows) if rows.numel() else {}
        else:
            update = dict(update_all_rows=bool(done.any()))
        # Nothing to skip on CPU: the wrapped dense decode is exactly what selection would attend.
        covered = not self.on_device and (most - 1) // self.block_size <= self.top_k and not self.force_sparse
        dense = short or covered
        if not dense:
            self._plan_attention(seq_lens_cpu, bs, graph=False)
        return DecodePlan(bs, max_blocks, False, step, dense=dense, fused=self._fused(bs), **update)

    def _fused(self, bs: int) -> bool:
        return self.kernels == "triton" and bs <= self.fused_ws.max_bs

    def _triton_attention(self, bs: int) -> bool:
        return self.attention == "triton" and bs <= self.fused_ws.max_bs

    def _ranked(self, bs: int) -> bool:
        """Two levels whose attend ranks the second level (`ranks_in_attend`) at this batch size."""
        return self.rerank_ws is not None and bs <= self.rerank_ws.ranked_rows and self._triton_attention(bs)

    def _plan_attention(self, seq_lens_cpu, bs: int, graph: bool) -> None:
        if not self._triton_attention(bs):  # the per-op attention plans on the host (FlashInfer)
            self.sparse_decode.plan(seq_lens_cpu, self.scaling, graph_bs=bs if graph else None)

    def fill(self, plan: DecodePlan) -> None:
        """Captured: recompute the step's device state into the persistent buffers."""
        StepBuffers.fill(plan.step, self.compute(plan.step.positions, plan.step.seq_lens, plan.step.req_pool_indices,
                                                 plan.max_blocks))

    # ------------------------------------------------------------------ run (per layer)
    def run(self, plan: DecodePlan, layer_id: int, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
            update: bool = True) -> torch.Tensor:
        """Summary update, selection and attention of one sparse layer: `[bs, H_q, Dv]` in q's dtype.

        q `[bs, H_q, D]` after RoPE; k/v buffers `[slots, H_kv, D]` holding the new token's K/V (an fp8 cache: K /
        k_scale and V / v_scale, the layer's `kv_scales`); the layer's summaries are updated in place when a row's
        token completes a block; update: False when the caller already ran `update_summaries` for this layer
        (the per-op path skips it).
        """
        step = plan.step
        rule = self.selector.rule
        gate = self.gate(layer_id)
        summaries = self.summaries[layer_id]
        anchors = None if self.anchors is None else self.anchors[layer_id]
        k_scale, v_scale = self.scales(layer_id)
        codes = self.key_codes.get(layer_id)
        if plan.fused:
            ws = self.fused_ws
            w_q, q_norm, w_k, k_norm = self.front_weights(gate)
            gq = fused_step.front(ws, q, step.model_cos_sin, step.gate_cos_sin, w_q, q_norm, k_buffer,
                                  self.model_table, self.gate_table, w_k, k_norm, summaries, step.block_table,
                                  step.seq_lens, k_scale, key_codes=codes)
            selected = fused_step.select(self.first_ws, gq, summaries, step.block_table, step.num_candidates,
                                         plan.max_blocks, rule.sink_blocks, rule.local_blocks, anchors,
                                         step.req_pool_indices)
        else:
            if update:
                self.update_summaries(plan, layer_id, k_buffer)
            rows = None if anchors is None else anchors[step.req_pool_indices.long()]
            selected = self.first_selector.select(gate, q, step.model_cos_sin, step.gate_cos_sin, summaries,
                                                  step.block_table, step.num_candidates, plan.max_blocks, rows)
        if self.exact_rerank > 1 and self._ranked(plan.bs):
            # the attend keeps the second level's K itself, from the log-sum-exps the rerank launch leaves
            cands = candidate_lse(q, k_buffer, selected, step.block_table, step.num_candidates, self.scaling,
                                  self.block_size, rule.sink_blocks, rule.local_blocks, anchors,
                                  step.req_pool_indices, k_scale, self.rerank_ws, self.settings.launch,
                                  key_codes=codes)
            self.last_selected = selected = self.rerank_out[:plan.bs]
            return fused_step.attend(self.fused_ws, q, k_buffer, v_buffer, selected, step.block_table,
                                     step.seq_lens, self.scaling, k_scale=k_scale, v_scale=v_scale, rank=cands)
        if self.attends_in_rerank(plan.fused, self._triton_attention(plan.bs), codes is not None):
            # the torch path: the candidates' keys, gathered once, rank them and are the attention's own (the
            # anchors: the batch's rows the first level read)
            if not plan.graph and plan.max_blocks < selected.shape[-1]:  # eager: columns past max_blocks are -1
                selected = selected[..., : plan.max_blocks]
            out, kept = rerank_attend(q, k_buffer, v_buffer, selected, step.block_table, step.seq_lens,
                                      step.num_candidates, self.top_k, plan.max_blocks, self.scaling, self.block_size,
                                      rule.sink_blocks, rule.local_blocks, rows, None, k_scale, v_scale)
            self.last_selected = self.rerank_out[:plan.bs].copy_(kept)
            return out
        if self.exact_rerank > 1:
            # the fused path launches the kernel on CPU too (Triton's interpreter), as it does its own three
            selected = rerank_blocks(q, k_buffer, selected, step.block_table, step.num_candidates, self.top_k,
                                     plan.max_blocks, self.scaling, self.block_size, rule.sink_blocks,
                                     rule.local_blocks, anchors, step.req_pool_indices, k_scale, self.rerank_ws,
                                     self.rerank_out[:plan.bs], self.settings.launch,
                                     kernel=True if plan.fused else None, key_codes=codes)
        self.last_selected = selected
        if self._triton_attention(plan.bs):
            return fused_step.attend(self.fused_ws, q, k_buffer, v_buffer, selected, step.block_table, step.seq_lens,
                                     self.scaling, k_scale=k_scale, v_scale=v_scale)
        if not plan.graph and not self.on_device and plan.max_blocks < selected.shape[-1]:
            # Eager CPU: no row has more than max_blocks candidates, so the columns past it are all -1; the padded
            # SDPA then reads (max_blocks + 1) blocks a row, not K + 1 (a covering budget's rows stay short).
            selected = selected[..., : plan.max_blocks]
        return self.sparse_decode.run(q, k_buffer, v_buffer, selected, step.block_table, step.seq_lens,
                                      k_scale=k_scale, v_scale=v_scale)

    def repair(self, plan: DecodePlan, k_buffers: Mapping[int, torch.Tensor]) -> None:
        """`repair_late`: list the step's late blocks and mark its rows' complete blocks (`ops.late_blocks`), then
        summarize the listed blocks in every sparse layer from `k_buffers` {layer: `[slots, H_kv, D]`} (as `run`),
        before any layer of the step runs (after `plan`, or `fill` in a graph). Their KV is in the cache already: a
        late block is complete before the step's own rows. (A verify step's later draft rows may list a block an
        earlier draft completes: that row's update writes its summary again in each layer before anything selects
        from it.) Fixed shapes, no host sync (CUDA: `Selector.capturable_repair`); under CUDA-graph capture with IF
        nodes the summaries sit in one IF node on the list's flag, so a step with nothing late replays the list's
        launch and one condition, not a launch a layer."""
        if not self.repair_late:
            return
        step = plan.step
        list_late_blocks(step.block_table, step.num_candidates, step.seq_lens, self.summaries.valid, self.block_size,
                         step.late_pages, step.late_starts, step.late_count, step.late_flag, self.late_total)

        def summarize():
            listed = None
            if self.key_codes:  # the listed pages past the count are -1 (skipped)
                index = torch.arange(step.late_pages.shape[0], device=step.late_pages.device)
                listed = torch.where(index < step.late_count.reshape(-1)[0], step.late_pages, -1)
            for lid, k_buffer in k_buffers.items():
                self.selector.repair(self.gate(lid), k_buffer, self.summaries[lid], step.late_pages,
                                     step.late_starts, step.late_count, self.model_table, self.gate_table,
                                     self.scales(lid)[0])
                if listed is not None:
                    encode_pages(k_buffer, listed, self.block_size, *self.key_codes[lid], self.scales(lid)[0])

        if capturing() and conditional_nodes_supported():
            with captured_if(step.late_flag):
                summarize()
        else:
            summarize()

    def update_summaries(self, plan: DecodePlan, layer_id: int, k_buffer: torch.Tensor) -> None:
        """The per-op summary update of the block each row's newest token completed (dense steps, the per-op
        path, and before a captured step's branches; the fused front does its own). k_buffer: as `run`."""
        step = plan.step
        gate = self.gate(layer_id)
        summaries, k_scale = self.summaries[layer_id], self.scales(layer_id)[0]
        if plan.graph or plan.update_all_rows:  # every row runs the masked update (no host indices)
            self.selector.update(gate, k_buffer, summaries, step.block_table, step.seq_lens, self.model_table,
                                 self.gate_table, k_scale)
            self.encode_completed(layer_id, k_buffer, step.block_table, step.seq_lens)
        elif plan.summary_rows is not None:  # eager CPU: only the rows whose newest token completed a block
            rows = plan.summary_rows
            self.selector.update(gate, k_buffer, summaries, step.block_table[rows], step.seq_lens[rows],
                                 self.model_table, self.gate_table, k_scale)
            self.encode_completed(layer_id, k_buffer, step.block_table[rows], step.seq_lens[rows])
