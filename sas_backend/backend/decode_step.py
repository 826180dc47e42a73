"""The sparse decode step as ONE object: what the server runs, the GPU benchmark times and the tests drive.

    step = DecodeStep(selector, geometry, req_to_token, ...)      # once per server (buffers owned)
    step.attach_gates(gates)                                       # the fused front's copies of the gate weights
    step.init_graph_state(max_bs)                                  # CUDA graphs: persistent step buffers
    plan = step.plan(positions, seq_lens, req_pool_indices, seq_lens_cpu, model_table, gate_table, graph_bs)
    step.fill(plan, model_table, gate_table)                       # captured: the step's device state
    out = step.run(plan, gate, q, k_buffer, v_buffer, summaries, model_table, gate_table, anchors)  # per layer

`plan` is frozen per batch (`decode_plan.DecodePlan`): it decides once whether the step is sparse or dense
(eager CPU steps whose requests have at most K candidates are exactly dense; `--sas-dense-below`) and, under
CUDA graphs, leaves the choice to the captured branches. Per sparse layer `run` is one of two paths:

- fused (`kernels="triton"`): `ops.decode_step` front -> select -> attend, three launches a layer, each
  split so batch 1 fills the GPU (the gate selector only; batches above the fused workspace's rows take
  the per-op path, whose grids are wide at such batches anyway);
- per op (`kernels="torch"`): the selector's summary update and selection (`sas_backend.selection`: torch on
  CPU, the per-op Triton kernels on CUDA), then the attention.

Attention (`attention`): "triton" (`ops.decode_step.attend`, over the block table), "flashinfer" (the token
rows gathered, FlashInfer's paged decode; CUDA only) or "torch" (one masked SDPA; CPU).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from sas_backend import config
from sas_backend.backend.decode_plan import DecodePlan, StepBuffers, StepTensors
from sas_backend.ops import decode_step as fused
from sas_backend.ops.sparse_decode import make_sparse_decode

# What the launch's settings resolve to (config's choices less "auto"; attention "torch" is what "auto" becomes
# on CPU, where FlashInfer does not run).
KERNELS = tuple(k for k in config.KERNELS if k != "auto")
ATTENTIONS = (*(a for a in config.ATTENTIONS if a != "auto"), "torch")
# Most rows the fused path serves in one step: its workspace grows with it (~57.5 MiB at Qwen3-4B shapes and
# 256K context); larger batches fill the device with the per-op kernels' own grids.
FUSED_MAX_ROWS = 256


class DecodeStep:
    """Selection + attention of every sparse layer of a decode step.

    selector: a `sas_backend.selection.Selector` (its rule gives K, b and the forced blocks); geometry:
    `ops.decode_step.StepGeometry` of a layer on this rank; req_to_token: SGLang's `[max_reqs, max_ctx]`
    slot table; device, q_dtype, kv_dtype: as served; scaling: the layers' softmax scale; kernels / attention:
    see the module doc; dense_below: `--sas-dense-below`; force_sparse: eager CPU steps select even where
    dense attention is exactly what selection would attend (tests: the sparse path itself is checked);
    workspace: a float workspace FlashInfer may share; chunk / target_programs: the fused launches' split
    sizes (`ops.decode_step.DecodeStepWorkspace`; None: the defaults); launch: their `LaunchOptions` (PDL,
    warps); gate_dtype: what the fused front reads the gate weights in (bf16: copies made by `attach_gates`);
    rows_per_request: decode rows a request may bring to one step (n draft tokens of a speculative verify).
    """

    def __init__(self, selector, geometry: fused.StepGeometry, req_to_token: torch.Tensor, device, q_dtype,
                 kv_dtype, scaling: float, kernels: str = "torch", attention: str = "torch", dense_below: int = 0,
                 force_sparse: bool = False, workspace: Optional[torch.Tensor] = None,
                 chunk: Union[int, dict, None] = None, target_programs: Optional[int] = None,
                 launch: Optional[fused.LaunchOptions] = None,
                 gate_dtype: torch.dtype = torch.float32, rows_per_request: int = 1):
        if kernels not in KERNELS or attention not in ATTENTIONS:
            raise ValueError(f"kernels must be one of {KERNELS}, attention one of {ATTENTIONS}")
        self.device = torch.device(device)
        if attention == "flashinfer" and self.device.type != "cuda":
            raise ValueError("the flashinfer attention path needs CUDA")
        if kernels == "triton" and not selector.fused_kernels:
            raise ValueError(f"the fused kernels compute the gate's query and summaries; the {selector.name} "
                             "selector runs the per-op path (kernels='torch')")
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
        self.kernels, self.attention = kernels, attention
        self.dense_below = int(dense_below)
        self.force_sparse = bool(force_sparse)
        if gate_dtype not in (torch.float32, torch.bfloat16) or (gate_dtype != torch.float32 and kernels != "triton"):
            raise ValueError(f"gate_dtype {gate_dtype} needs kernels='triton' (only the fused front reads a copy)")
        self.gate_dtype = gate_dtype
        self._front_weights: dict = {}  # id(gate) -> (w_q, q_norm, w_k, k_norm) in gate_dtype
        max_rows = req_to_token.shape[0] * max(1, int(rows_per_request))  # most decode rows of a step
        self.fused_ws = None
        if kernels == "triton" or attention == "triton":
            self.fused_ws = fused.DecodeStepWorkspace(geometry, min(max_rows, FUSED_MAX_ROWS), self.max_blocks,
                                                      self.device, chunk=chunk, target_programs=target_programs,
                                                      launch=launch)
        # The per-op attention: every step when attention is not "triton", else batches past the workspace.
        self.sparse_decode = make_sparse_decode(
            self.device, geometry.num_kv_heads, geometry.group, geometry.head_dim, self.top_k, self.block_size,
            max_rows=max_rows * geometry.num_kv_heads, q_dtype=q_dtype, kv_dtype=kv_dtype, workspace=workspace,
        ) if attention != "triton" or max_rows > FUSED_MAX_ROWS else None
        self.buffers: Optional[StepBuffers] = None
        self.last_selected: Optional[torch.Tensor] = None  # the last run's selection (debug log, tests)

    @property
    def device_nbytes(self) -> int:
        """Device bytes this object holds (the fused workspace and the front's gate-weight copies; FlashInfer's
        buffers are counted by `backend.memory` under their own names)."""
        ws = self.fused_ws.nbytes if self.fused_ws is not None else 0
        return ws + sum(t.numel() * t.element_size() for ts in self._front_weights.values() for t in ts)

    def attach_gates(self, gates) -> None:
        """Once, before any step: the gate weights the fused front reads. fp32 reads the gates' own tensors;
        bf16 keeps a bf16 copy of each (the front's largest read, the query projection, halves; every other
        path still reads the fp32 gate). gates: the sparse layers' `AttnGate`s (an iterable or a dict's values)."""
        if self.kernels != "triton" or self.gate_dtype == torch.float32:
            return
        for gate in (gates.values() if isinstance(gates, dict) else gates):
            self._front_weights[id(gate)] = tuple(
                t.detach().to(self.gate_dtype).contiguous()
                for t in (gate.attngate_linear_q.weight, gate.attngate_qnorm.weight, gate.attngate_linear_k.weight,
                          gate.attngate_knorm.weight))

    def front_weights(self, gate) -> tuple:
        """(w_q, q_norm, w_k, k_norm) of a gate as the fused front reads them."""
        if self.gate_dtype == torch.float32:
            return (gate.attngate_linear_q.weight, gate.attngate_qnorm.weight, gate.attngate_linear_k.weight,
                    gate.attngate_knorm.weight)
        try:
            return self._front_weights[id(gate)]
        except KeyError:
            raise RuntimeError("sas: the decode step's bf16 gate copies are made by attach_gates(), before the first "
                               "step (never inside a captured graph); this gate was not attached") from None

    # ------------------------------------------------------------------ plan (host)
    def init_graph_state(self, max_bs: int, model_dim: int, gate_dim: int) -> None:
        """Persistent step buffers for captured batches of up to max_bs rows."""
        self.buffers = StepBuffers(max_bs, self.max_blocks, model_dim, gate_dim, self.device)

    def short_step(self, seq_lens_cpu: torch.Tensor) -> bool:
        """`--sas-dense-below`: the step's requests hold at most that many tokens in all. Rows of length <= 1
        are a graph's padding (a decode row holds a prompt token and the new one): a padded graph step
        decides as the same batch does eagerly."""
        if not self.dense_below:
            return False
        return int(seq_lens_cpu[seq_lens_cpu > 1].sum()) <= self.dense_below

    def compute(self, positions, seq_lens, req_pool_indices, model_table, gate_table, max_blocks) -> StepTensors:
        """The step's device tensors (fixed shapes, no host sync)."""
        return StepTensors.compute(positions, seq_lens, req_pool_indices, self.req_to_token, model_table,
                                   gate_table, self.block_size, max_blocks)

    def plan(self, positions, seq_lens, req_pool_indices, seq_lens_cpu: torch.Tensor, model_table, gate_table,
             graph_bs: Optional[int] = None, branched: bool = False, short: Optional[bool] = None) -> DecodePlan:
        """The frozen plan of one decode batch, from the host lengths (never a device-to-host copy).

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
        step = self.compute(positions, seq_lens, req_pool_indices, model_table, gate_table, max_blocks)
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

    def _plan_attention(self, seq_lens_cpu, bs: int, graph: bool) -> None:
        if not self._triton_attention(bs):  # the per-op attention plans on the host (FlashInfer)
            self.sparse_decode.plan(seq_lens_cpu, self.scaling, graph_bs=bs if graph else None)

    def fill(self, plan: DecodePlan, model_table, gate_table) -> None:
        """Captured: recompute the step's device state into the persistent buffers."""
        StepBuffers.fill(plan.step, self.compute(plan.step.positions, plan.step.seq_lens, plan.step.req_pool_indices,
                                                 model_table, gate_table, plan.max_blocks))

    # ------------------------------------------------------------------ run (per layer)
    def run(self, plan: DecodePlan, gate, q: torch.Tensor, k_buffer, v_buffer, summaries, model_table, gate_table,
            anchors: Optional[torch.Tensor] = None, update: bool = True, k_scale: float = 1.0,
            v_scale: float = 1.0) -> torch.Tensor:
        """Summary update, selection and attention of one sparse layer: `[bs, H_q, Dv]` in q's dtype.

        gate: the layer's `AttnGate` (None for training-free selectors); q `[bs, H_q, D]` after RoPE; k/v
        buffers `[slots, H_kv, D]` holding the new token's K/V; summaries `[num_pages, H_kv, S]` (updated in
        place when a row's token completes a block); model_table `[max_pos, D]`, gate_table `[max_pos, Dg]`;
        anchors: optional `[max_reqs, H_kv, R]` int32 prompt-anchor pool, read at the batch's req rows;
        update: False when the caller already ran `update_summaries` for this layer (the per-op path skips it);
        k_scale / v_scale: the layer's fp8 KV scales (`backend.kv_scales`; the buffers hold K / k_scale and
        V / v_scale), 1.0 for a cache that is not fp8.
        """
        step = plan.step
        rule = self.selector.rule
        if plan.fused:
            ws = self.fused_ws
            w_q, q_norm, w_k, k_norm = self.front_weights(gate)
            gq = fused.front(ws, q, step.model_cos_sin, step.gate_cos_sin, w_q, q_norm, k_buffer, model_table,
                             gate_table, w_k, k_norm, summaries, step.block_table, step.seq_lens, k_scale)
            selected = fused.select(ws, gq, summaries, step.block_table, step.num_candidates, plan.max_blocks,
                                    rule.sink_blocks, rule.local_blocks, anchors, step.req_pool_indices)
        else:
            if update:
                self.update_summaries(plan, gate, k_buffer, summaries, model_table, gate_table, k_scale)
            rows = None if anchors is None else anchors[step.req_pool_indices.long()]
            selected = self.selector.select(gate, q, step.model_cos_sin, step.gate_cos_sin, summaries,
                                            step.block_table, step.num_candidates, plan.max_blocks, rows)
        self.last_selected = selected
        if self._triton_attention(plan.bs):
            return fused.attend(self.fused_ws, q, k_buffer, v_buffer, selected, step.block_table, step.seq_lens,
                                self.scaling, k_scale=k_scale, v_scale=v_scale)
        if not plan.graph and not self.on_device and plan.max_blocks < selected.shape[-1]:
            # Eager CPU: no row has more than max_blocks candidates, so the columns past it are all -1; the padded
            # SDPA then reads (max_blocks + 1) blocks a row, not K + 1 (a covering budget's rows stay short).
            selected = selected[..., : plan.max_blocks]
        return self.sparse_decode.run(q, k_buffer, v_buffer, selected, step.block_table, step.seq_lens,
                                      k_scale=k_scale, v_scale=v_scale)

    def update_summaries(self, plan: DecodePlan, gate, k_buffer, summaries, model_table, gate_table,
                         k_scale: float = 1.0) -> None:
        """The per-op summary update of the block each row's newest token completed (dense steps, the per-op
        path, and before a captured step's branches; the fused front does its own). k_scale: as `run`."""
        step = plan.step
        if plan.graph or plan.update_all_rows:  # every row runs the masked update (no host indices)
            self.selector.update(gate, k_buffer, summaries, step.block_table, step.seq_lens, model_table, gate_table,
                                 k_scale)
        elif plan.summary_rows is not None:  # eager CPU: only the rows whose newest token completed a block
            rows = plan.summary_rows
            self.selector.update(gate, k_buffer, summaries, step.block_table[rows], step.seq_lens[rows],
                                 model_table, gate_table, k_scale)
