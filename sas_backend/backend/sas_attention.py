"""The `sas` attention backend: dense extend, block-sparse decode.

Wraps a dense SGLang backend (FlashInfer on CUDA, torch-native on CPU) for extend and for the
layers below `first_sparse_layer`. Per sparse layer and decode step:

    write K/V -> summary of a block that just completed -> gate query (q with RoPE undone)
    -> block scores over the request's paged summaries -> Top-K per (request, kv head)
    -> token rows of the selected blocks + the current block -> attention over those rows

Selection is one component (`sas_backend.selection`, the gate selector), attention one plan/run object
(`ops.sparse_decode.make_sparse_decode`); every op picks the Triton kernel / FlashInfer on CUDA and
batched torch ops on CPU. The whole decode step is capturable in a CUDA graph: `_out_graph` plans
on the host what is fixed for the batch shape, `_in_graph` (captured) computes the step's device
state into persistent buffers (decode_plan.py says why).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Dict, Optional

import torch

from sas_backend.backend import pd_anchors
from sas_backend.backend.anchor_pool import AnchorPool
from sas_backend.backend.decode_plan import DecodePlan
from sas_backend.backend.decode_step import DecodeStep
from sas_backend.backend.extend_plan import ExtendPlan
from sas_backend.backend.graph_branch import BranchFlags, captured_if, capturing, conditional_nodes_supported
from sas_backend.backend.kv_scales import model_kv_scales, share_with_dense_backend
from sas_backend.backend.page_marks import completing_pages, unmarked_blocks, watch_allocations
from sas_backend.backend.sglang_compat import save_kv
from sas_backend.backend.summary_pool import SummaryPool
from sas_backend.backend import verify_rows
from sas_backend.backend.verify_rows import check_chain, draft_tokens
from sas_backend.config import SASConfig, SASConfigError
from sas_backend.gate.module import AttnGate
from sas_backend.ops import FP8_DTYPES
from sas_backend.ops.extend import paged_extend_attention
from sas_backend.backend.step_settings import StepSettings, device_name, resolve
from sas_backend.ops.fused_step import StepGeometry
from sas_backend.selection import SelectionRule, make_selector

try:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
except ImportError:  # pragma: no cover - sglang is a hard dependency of the backend
    AttentionBackend = object

logger = logging.getLogger(__name__)


def model_attention_scaling(model, layer_ids, default: float) -> float:
    """The softmax scale of the model's sparse attention layers (`RadixAttention.scaling`).

    FlashInfer is planned before the first layer runs, so the scale must be known up front; all
    sparse layers must agree (one plan serves them all). Falls back to `default` without a model.
    """
    scales = {
        float(m.scaling)
        for m in (model.modules() if model is not None else ())
        if getattr(m, "layer_id", None) in layer_ids and hasattr(m, "scaling") and hasattr(m, "tp_q_head_num")
    }
    if len(scales) > 1:
        raise ValueError(f"sas: the sparse layers use different attention scales {sorted(scales)}")
    return scales.pop() if scales else default


class SASAttnBackend(AttentionBackend):
    """SGLang AttentionBackend for SAS block-sparse decode. Built by `factory.create_sas_backend`.

    gates: `{layer_id: AttnGate}` for every sparse layer (values None under a training-free
    selector, `cfg.selector`); layers not in it decode densely. rope_tables: the model's `[max_pos, D]` and the
    gate's `[max_pos, Dg]` fp32 tables (`rope_tables.RopeTables`, or `FixedRopeTables` without a model).
    kv_head_offset: the model's first kv head on this rank (tensor parallelism); gate_sha256: of the gate file
    as loaded; own_cpu_extend: CPU extend by `ops.extend` instead of the wrapped backend. settings: the decode
    step's resolved settings (`backend.step_settings.resolve`; None: resolved here from cfg and the device).
    draft_tokens: n of `--speculative-num-draft-tokens` when speculative decoding is on (a verify step decodes n
    rows a request; 0: off).
    """

    def __init__(
        self,
        runner,
        inner,
        cfg: SASConfig,
        gates: Dict[int, Optional[AttnGate]],
        rope_tables,
        num_kv_heads: int,
        num_q_heads: int,
        head_dim: int,
        settings: Optional[StepSettings] = None,
        draft_tokens: int = 0,
        kv_head_offset: int = 0,
        gate_sha256: Optional[str] = None,
        own_cpu_extend: bool = False,
    ):
        super().__init__()
        self.inner = inner
        # A wrapper must hand SGLang the wrapped backend's translator (0.5.20+ asserts it).
        self.kv_index_translator = getattr(inner, "kv_index_translator", None)
        cfg = cfg.resolved()  # settings the launch left to the gate's record (a no-op when resolved)
        self.cfg = cfg
        self.device = torch.device(runner.device) if isinstance(runner.device, str) else runner.device
        self.req_to_token_pool = runner.req_to_token_pool
        self.token_to_kv_pool = runner.token_to_kv_pool
        self.gates = gates
        self.num_kv_heads = num_kv_heads
        # The model's first kv head on this rank (tensor parallelism shards kv heads): the selection log names
        # the global heads it holds.
        self.kv_head_offset = int(kv_head_offset)
        self.gate_sha256 = gate_sha256  # of the gate file as loaded (reported by /sas/info)
        gate_dim = rope_tables.gate.shape[-1]
        self.num_q_heads = num_q_heads
        self.head_dim = head_dim
        self.block_size = cfg.block_size
        self.top_k = cfg.top_k
        self.max_blocks = self.req_to_token_pool.req_to_token.shape[1] // self.block_size
        # Device (CUDA, or `meta` standing in for it in tests): host decisions must not become
        # host-to-device copies; CPU: host tensors index directly.
        self.on_device = self.device.type != "cpu"
        self.scaling = model_attention_scaling(getattr(runner, "model", None), set(gates), head_dim**-0.5)
        # An fp8 KV cache holds K / k_scale and V / v_scale: each attention layer's scales, written and read alike
        # (backend/kv_scales.py); (1.0, 1.0) for a cache that is not fp8.
        self.kv_dtype = self.token_to_kv_pool.get_key_buffer(min(gates)).dtype
        self.kv_fp8 = self.kv_dtype in FP8_DTYPES
        self.kv_scales, self.kv_scale_sources = model_kv_scales(getattr(runner, "model", None), set(gates),
                                                                self.kv_dtype)
        share_with_dense_backend(getattr(runner, "model", None), self.kv_scales, self.kv_scale_sources)
        # CPU with an fp8 cache: every dense step (dense layers, covered or short steps, dense verify) attends
        # through sas's own rows, since SGLang's torch-native attention would read the cache without its scales.
        self.dense_by_own_rows = self.kv_fp8 and not self.on_device

        rule = SelectionRule(cfg.top_k, cfg.block_size, cfg.sink_blocks, cfg.local_blocks, cfg.sub_blocks or 1)
        selector = make_selector(cfg.selector, rule)
        if settings is None:
            settings = resolve(cfg, self.device, device_name(self.device))
        self.settings = settings
        num_pages = self.token_to_kv_pool.get_key_buffer(min(gates)).shape[0] // self.block_size
        summary_dim = selector.summary_dim(head_dim, gate_dim)
        # --sas-rerank-keys int4: each page's 4-bit key codes live beside its summaries (written where they are)
        code_head_dim = head_dim if cfg.rerank_keys == "int4" and (cfg.exact_rerank or 1) > 1 else 0
        if code_head_dim % 2:
            raise SASConfigError(f"--sas-rerank-keys int4 packs two channels a byte: head_dim {head_dim} is odd")
        summaries = SummaryPool(sorted(gates), num_pages, num_kv_heads, summary_dim, self.device,
                                dtype=settings.summary_dtype, code_head_dim=code_head_dim, block_size=self.block_size)
        # Validity marks (SummaryPool.valid): a page handed out again loses its mark; the complete blocks of a decode
        # step's requests without one are summarized before any selection (a PD decode server's transferred pages,
        # pages handed to another request). Two forms (backend/page_marks.py): on CPU the host plans them
        # (_summarize_unmarked); on CUDA (or SAS_SUMMARY_MARKS=2) the step lists them on the device and summarizes
        # them in every sparse layer before its layers run, capturable (DecodeStep.repair, _repair_late).
        # SAS_SUMMARY_MARKS=0 turns them off (a test control).
        marks = int(cfg.summary_marks) if selector.keeps_summaries else 0
        if marks == 2 and self.on_device and not selector.capturable_repair:
            raise SASConfigError(f"SAS_SUMMARY_MARKS=2 (validity marks kept on the device) needs a selector whose "
                                 f"late summaries run without a host sync; {selector.name}'s do not")
        self.check_marks = marks == 1 and not self.on_device
        self.device_marks = marks == 2 or (marks == 1 and self.on_device and selector.capturable_repair)
        allocator = getattr(runner, "token_to_kv_pool_allocator", None)
        if (self.check_marks or self.device_marks) and allocator is not None:
            watched = watch_allocations(allocator, self.block_size, summaries.invalidate)
            logger.info("sas: summary validity marks (%s): pages handed out by %s lose theirs",
                        "device" if self.device_marks else "host", "/".join(watched))
        self._late_host = 0  # pages summarized at host decode planning (their KV came without an extend through sas)
        max_reqs = self.req_to_token_pool.req_to_token.shape[0]
        # --sas-prompt-anchors: per request row, sparse layer and kv head, the blocks its last prompt token
        # attended most (written at each extend, read by every decode step; ops/anchors).
        anchor_count = cfg.prompt_anchors or 0
        anchors = AnchorPool(gates, max_reqs, num_kv_heads, anchor_count, self.device) if anchor_count else None
        if anchors is not None:  # under PD, the prefill side sends them and the decode side receives them here
            pd_anchors.attach(anchors)
        v_dim = self.token_to_kv_pool.get_value_buffer(min(gates)).shape[-1]
        geometry = StepGeometry(num_kv_heads, num_q_heads // num_kv_heads, head_dim, v_dim, max(gate_dim, 2),
                                self.top_k, self.block_size, selector.rule.sub_blocks)
        # The decode step: selection and sparse attention of every sparse layer, and what they read: the pools,
        # the gates, the RoPE tables' one source (`step.rope`: follows SGLang replacing its cos_sin_cache) and
        # the fp8 scales (backend/decode_step.py).
        self.step = DecodeStep(
            selector, geometry, self.req_to_token_pool.req_to_token, self.device, runner.dtype,
            self.kv_dtype, self.scaling, settings, summaries=summaries, gates=gates, rope=rope_tables,
            anchors=anchors, kv_scales=self.kv_scales, force_sparse=bool(cfg.force_sparse),
            # The wrapped FlashInfer backend's float workspace: used in stream order, never at the
            # same time as ours, so one buffer serves both (backend/memory.py counts it so).
            workspace=getattr(inner, "workspace_buffer", None), rows_per_request=max(1, int(draft_tokens)),
            repair_late=self.device_marks, exact_rerank=cfg.exact_rerank or 1,
        )
        self.draft_tokens = int(draft_tokens)
        self._verify_buffers = None  # captured verify steps: persistent decode-row lengths and req rows
        self._plan: Optional[DecodePlan] = None
        # CPU extend: our own (the new queries only, ops/extend) instead of the wrapped torch-native
        # one, which pads every request's queries to its whole length.
        self.own_cpu_extend = bool(own_cpu_extend)
        self._extend: Optional[ExtendPlan] = None  # the current extend batch's plan
        self._debug_step = -1  # the first logged step is 0
        # Decode and verify steps served so far, by path (host counts, read by /sas/info's pool state): whether
        # a workload really decoded sparsely. Captures are not steps and are not counted.
        self.decode_steps = {"sparse": 0, "dense": 0}
        # Dense steps under CUDA graphs: the flags of the two captured branches (init_cuda_graph_state;
        # None: graph steps always select).
        self._branch: Optional[BranchFlags] = None
        if settings.dense_below:
            logger.info("sas: decode steps whose requests hold at most %d tokens in all attend densely "
                        "(--sas-dense-below)", settings.dense_below)
        if cfg.force_sparse:
            logger.info("sas: SAS_FORCE_SPARSE: eager CPU steps select and attend sparsely even where every block "
                        "fits the budget (tests and debugging)")
        self._log_memory()
        logger.info("sas: decode step kernels %s, attention %s, summaries %s, front gate weights %s, launches %s (%s)",
                    settings.kernels, settings.attention, str(settings.summary_dtype).replace("torch.", ""),
                    str(settings.gate_dtype).replace("torch.", ""), settings.launch, settings.source)
        logger.info(
            "sas: %s selector, %d sparse layers from layer %d, budget %d tokens (K=%d blocks of %d), "
            "sink %d, local %d, prompt anchors %d, %d summaries a block, exact rerank %d%s; summary pool %d pages x %d "
            "kv heads x %d dims = %.1f MiB",
            cfg.selector, len(gates), cfg.first_sparse_layer, cfg.budget, self.top_k, self.block_size,
            selector.rule.sink_blocks, selector.rule.local_blocks, anchor_count, selector.rule.sub_blocks,
            self.step.exact_rerank, (" over 4-bit key codes" if code_head_dim else "") + self._second_level_note(
                settings, bool(code_head_dim)), num_pages,
            num_kv_heads, summary_dim, summaries.nbytes / 2**20,
        )

    def _second_level_note(self, settings, codes: bool) -> str:
        """How the second level meets the attention (the launch log): ranked inside the Triton attend, or over the
        torch path's one gather of the candidates (`ops.rerank.rerank_attend`), or neither (two passes)."""
        if self.step.exact_rerank == 1:
            return ""
        if self.step.ranks_in_attend(settings):
            return ", its top-K in the attend"
        if self.step.attends_in_rerank(settings.kernels == "triton", settings.attention == "triton", codes):
            return ", ranked and attended over one gather"
        return ""

    def _log_memory(self) -> None:
        """What the backend holds beside the KV pool, and (after a launch's reservation) a warning for any
        item held beyond what was reserved for it: SGLang's KV pool was sized without that room."""
        from sas_backend.backend import memory

        held = self.held_bytes()
        logger.info("sas: holds %.1f MiB beside the KV pool (%s)", sum(held.values()) / memory.MiB,
                    ", ".join(f"{k} {v / memory.MiB:.1f}" for k, v in held.items()))
        if memory.RESERVED is not None:
            over = {k: (v, memory.RESERVED.get(k, 0)) for k, v in held.items() if v > memory.RESERVED.get(k, 0)}
            if over:
                logger.warning("sas: holds more than the launch reserved for %s (held, reserved bytes): device memory "
                               "meant for activations and CUDA graphs pays for it", over)

    def held_bytes(self) -> dict:
        """{name: device bytes} of what this backend holds, by `backend.memory`'s names (what it reserves)."""
        step = self.step
        held = {"summary pool": step.summaries.nbytes, **step.rope.held_nbytes()}
        gates = [g for g in self.gates.values() if g is not None]
        if gates:
            held["gate weights"] = sum(t.numel() * t.element_size() for g in gates for t in g.parameters())
        if step.front_weight_nbytes:
            held["gate weights (front copy)"] = step.front_weight_nbytes
        if step.anchors is not None:
            held["prompt anchors"] = step.anchors.nbytes
        if step.fused_ws is not None:
            held["decode step workspace"] = step.fused_ws.nbytes
        if step.rerank_nbytes:
            held["exact rerank"] = step.rerank_nbytes
        per_op = step.sparse_decode.device_nbytes() if step.sparse_decode is not None else 0
        if per_op:
            held["flashinfer sparse decode"] = per_op
        return held

    # ------------------------------------------------------------------ metadata
    @property
    def selector(self):
        """The decode step's `sas_backend.selection.Selector`."""
        return self.step.selector

    @property
    def late_summaries(self) -> int:
        """Blocks summarized at decode because their pages held no valid summary (reads the device counter: for
        /sas/info and tests, never a step)."""
        return self._late_host + int(self.step.late_total.item())

    @property
    def summaries(self):
        """The decode step's `SummaryPool`."""
        return self.step.summaries

    def init_forward_metadata(self, forward_batch):
        """Eager step (no CUDA graph): plan and step state from the live batch."""
        self.step.follow_rope()
        mode = forward_batch.forward_mode
        if mode.is_decode() or mode.is_target_verify():
            if mode.is_target_verify() and not self.on_device:
                check_chain(forward_batch, draft_tokens(forward_batch))
            if self.check_marks:
                self._summarize_unmarked(forward_batch)
            self._plan = self._plan_decode(forward_batch, graph_bs=None)
            self._repair_late()
            self._count_step(self._plan)
            self._extend = None
            # The wrapped backend's decode metadata (on CUDA a full-KV plan) is read only by dense
            # layers: those below first_sparse_layer, or all of them in a dense step.
            if self.cfg.first_sparse_layer > 0 or self._plan.dense:
                self.inner.init_forward_metadata(forward_batch)
        else:
            self.inner.init_forward_metadata(forward_batch)
            self._plan = None
            self._extend = self._plan_extend(forward_batch) if mode.is_extend() else None

    def _inner_in_graphs(self) -> bool:
        """Whether captured steps use the wrapped backend: dense layers, or the dense branch."""
        return self.cfg.first_sparse_layer > 0 or self._branch is not None

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        if self.step.dense_below:
            if conditional_nodes_supported():
                self._branch = BranchFlags(self.device)
            else:
                logger.warning(
                    "sas: --sas-dense-below %d needs CUDA graph IF nodes (CUDA 12.4+ and a torch that exposes them); "
                    "without them captured decode steps always select (eager steps still follow the rule)",
                    self.step.dense_below)
        if self.device_marks and not conditional_nodes_supported():
            logger.warning(
                "sas: the summary validity marks' repairs need CUDA graph IF nodes (CUDA 12.4+ and a torch that "
                "exposes them) to be skipped when nothing is late; without them each captured decode step launches "
                "them in every sparse layer (they exit at once)")
        # The wrapped backend's graph buffers serve only dense layers and the dense branch: none without.
        if self._inner_in_graphs():
            self.inner.init_cuda_graph_state(max_bs, max_num_tokens)
        # A captured verify step has n decode rows a request: the step buffers hold max_num_tokens rows.
        rows = max(max_bs, max_num_tokens) if self.draft_tokens else max_bs
        self.step.init_graph_state(rows, self.head_dim, self.step.rope.gate.shape[-1])
        self._verify_buffers = verify_rows.VerifyRowBuffers(rows, self.device) if self.draft_tokens else None

    def get_cuda_graph_seq_len_fill_value(self):
        # A padded row of length 1 attends one real slot (its current block): always well defined.
        return self.inner.get_cuda_graph_seq_len_fill_value() if self._inner_in_graphs() else 1

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Host part of a captured decode step (capture and every replay): plan, no step state."""
        # The wrapped backend plans for dense layers always, for the dense branch at capture and when the
        # step takes it (a sparse step skips FlashInfer's dense plan and its index kernel).
        if self.cfg.first_sparse_layer > 0 or (self._branch is not None and (
                in_capture or self.step.short_step(self._host_seq_lens(forward_batch)))):
            self.inner.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        if not (forward_batch.forward_mode.is_decode() or forward_batch.forward_mode.is_target_verify()):
            # The extend path plans on the host per batch (which blocks complete): it runs eagerly,
            # as under SGLang's default breakable prefill graphs, never inside a full prefill graph.
            raise NotImplementedError(
                f"sas runs {forward_batch.forward_mode} eagerly; the full prefill CUDA graph backend is not "
                "supported (keep SGLang's default breakable prefill graphs, or disable prefill graphs)"
            )
        self.step.follow_rope()
        if self.check_marks:
            self._summarize_unmarked(forward_batch)
        self._plan = self._plan_decode(forward_batch, graph_bs=forward_batch.batch_size)
        if not in_capture:
            self._count_step(self._plan)
        self._extend = None
        # From the first out_graph on, captured layers may hold the tables' addresses.
        self.step.rope.freeze()

    def init_forward_metadata_in_graph(self, forward_batch):
        """Captured: recompute the step's device state into the persistent buffers."""
        if self._inner_in_graphs():
            self.inner.init_forward_metadata_in_graph(forward_batch)
        if forward_batch.forward_mode.is_target_verify():  # the decode rows' lengths and req rows, captured
            verify_rows.expand(forward_batch.seq_lens, forward_batch.req_pool_indices, draft_tokens(forward_batch),
                               out=(self._plan.step.seq_lens, self._plan.step.req_pool_indices))
        self.step.fill(self._plan)
        self._repair_late()

    def _repair_late(self) -> None:
        """Device-side validity marks: the step's late blocks summarized in every sparse layer before its layers run
        (`DecodeStep.repair`; nothing without them)."""
        if self.device_marks:
            self.step.repair(self._plan, {lid: self.token_to_kv_pool.get_key_buffer(lid) for lid in self.gates})

    @staticmethod
    def _host_seq_lens(fb) -> torch.Tensor:
        """int64 host sequence lengths of the batch (SGLang's CPU mirror)."""
        seq_lens_cpu = fb.seq_lens_cpu
        if seq_lens_cpu is None:
            # Copying fb.seq_lens over would be a silent device-to-host sync every step (and illegal in capture).
            raise RuntimeError("sas: this forward batch has no seq_lens_cpu (SGLang's host mirror of the sequence "
                               "lengths), which the sas backend plans every decode step from; the SGLang path that "
                               "built it is not one the backend supports")
        return seq_lens_cpu.to(torch.int64)

    def _count_step(self, plan: DecodePlan) -> None:
        self.decode_steps["dense" if plan.dense else "sparse"] += 1

    def _plan_decode(self, fb, graph_bs) -> DecodePlan:
        """Host part of a decode or verify step (outside any CUDA graph): the step object's frozen plan. A verify
        batch's n draft rows per request are planned as n decode rows at their own positions (verify_rows.py)."""
        host = self._host_seq_lens(fb)
        short = self.step.short_step(host)  # on the requests' lengths, not a verify's decode rows'
        seq_lens, reqs, rows_host = fb.seq_lens, fb.req_pool_indices, host
        if fb.forward_mode.is_target_verify():
            n = draft_tokens(fb)
            if fb.positions.shape[0] != fb.seq_lens.shape[0] * n:  # shapes only: no sync
                raise RuntimeError(f"sas: a verify batch of {fb.seq_lens.shape[0]} requests has "
                                   f"{fb.positions.shape[0]} draft rows, not {n} a request (ragged verify batches "
                                   "are not supported)")
            rows_host = verify_rows.expand_host(host, n)
            if graph_bs is None:
                seq_lens, reqs = verify_rows.expand(fb.seq_lens, fb.req_pool_indices, n)
            else:  # filled inside the graph (init_forward_metadata_in_graph)
                graph_bs *= n
                if self._verify_buffers is None or self._verify_buffers.lens.shape[0] < graph_bs:
                    raise RuntimeError(f"sas: a captured verify step of {graph_bs} rows exceeds the "
                                       "init_cuda_graph_state buffers")
                seq_lens, reqs = self._verify_buffers.view(graph_bs)
        plan = self.step.plan(fb.positions, seq_lens, reqs, rows_host, graph_bs=graph_bs,
                              branched=self._branch is not None, short=short)
        if graph_bs is not None and self._branch is not None:
            # Both branches are captured; the sparse one reads this plan, the dense one the wrapped
            # backend's (planned in out_graph), and the flags pick one per replay.
            self._branch.set(not short)
        return plan

    def _summarize_unmarked(self, fb) -> None:
        """Before a decode or verify step is planned (host side, CPU): every complete block already in the cache
        of the batch's requests whose page holds no valid summary (`SummaryPool.valid`: KV that landed without
        an extend through sas, or a page handed out since its summary was written) is summarized now, in every
        sparse layer, from the KV the page holds; the block this step's token completes is marked (the step's
        layers write its summary). A verify step's drafts are marked by nothing: rejected drafts leave a block
        that a later step completes and summarizes again."""
        host = self._host_seq_lens(fb)
        verify = fb.forward_mode.is_target_verify()
        present = host if verify else host - 1  # tokens in the cache before this step's own rows
        rows = fb.req_pool_indices.long()
        req_to_token = self.req_to_token_pool.req_to_token
        late = unmarked_blocks(req_to_token, rows, present, self.summaries.valid, self.block_size)
        if late is not None:
            for lid in self.gates:
                self.step.summarize_blocks(lid, self.token_to_kv_pool.get_key_buffer(lid), *late)
            self.summaries.mark_valid(late[0])
            self._late_host += late[0].numel()
        if not verify:
            self.summaries.mark_valid(completing_pages(req_to_token, rows, host, self.block_size))

    def _plan_extend(self, fb) -> ExtendPlan:
        """The extend batch's plan; the pages it completes are marked valid (forward_extend writes their summaries
        in every sparse layer)."""
        plan = ExtendPlan.make(fb, self.req_to_token_pool.req_to_token, self.block_size, self.device,
                               self.own_cpu_extend, self.step.anchors is not None)
        if (self.check_marks or self.device_marks) and plan.blocks is not None:
            self.summaries.mark_valid(plan.blocks[0])
        return plan

    def _own_extend(self, q, k, v, layer, forward_batch, save_kv_cache, reqs=None):
        """Causal self-attention of the batch's new tokens (ops/extend); K/V stored first. reqs: (req rows, prefix
        lens, extend lens) host ints (default: this extend's, `ExtendPlan.own_rows`)."""
        if save_kv_cache and k is not None and v is not None:
            self._save_kv(layer, forward_batch, k, v)
        rows, prefix, lens = reqs or self._extend.own_rows
        q3 = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = q.new_empty(q3.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        k_scale, v_scale = self.step.scales(layer.layer_id)
        paged_extend_attention(
            q3, out, self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id), self.req_to_token_pool.req_to_token,
            rows, prefix, lens, layer.scaling, block=self.block_size, k_scale=k_scale, v_scale=v_scale,
        )
        return out.view(q3.shape[0], layer.tp_q_head_num * layer.v_head_dim)

    def _own_dense_rows(self, q, k, v, layer, forward_batch, save_kv_cache=False, **kwargs):
        """Dense attention of a decode or (chain) verify step through ops/extend: each request's rows are an
        extend of its newest token(s) against the cache (exact dense attention). CPU with an fp8 KV cache: the
        wrapped torch-native backend would read the fp8 cache without its scales."""
        host = self._host_seq_lens(forward_batch)
        verify = forward_batch.forward_mode.is_target_verify()
        n = draft_tokens(forward_batch) if verify else 1
        # A decode row's seq_len counts its new token; a verify batch's counts the verified tokens only.
        prefix = (host if verify else host - 1).tolist()
        reqs = ([int(r) for r in forward_batch.req_pool_indices.tolist()], [int(p) for p in prefix],
                [n] * len(prefix))
        return self._own_extend(q, k, v, layer, forward_batch, save_kv_cache, reqs)

    def _dense(self, inner_forward):
        """The dense attention of a decode or verify step: the wrapped backend's `inner_forward`, or sas's own rows
        (`dense_by_own_rows`)."""
        return self._own_dense_rows if self.dense_by_own_rows else inner_forward

    def _save_kv(self, layer, forward_batch, k, v) -> None:
        """Store the step's K/V; into an fp8 cache divided by the layer's scales (SGLang's contract)."""
        k_scale, v_scale = self.step.scales(layer.layer_id) if self.kv_fp8 else (None, None)
        save_kv(self.token_to_kv_pool, layer, forward_batch.out_cache_loc, k, v, k_scale, v_scale)

    @staticmethod
    def _plain_causal(layer) -> bool:
        """A causal decoder self-attention layer without a sliding window or logit cap."""
        window = getattr(layer, "sliding_window_size", None)
        return (
            not getattr(layer, "is_cross_attention", False)
            and getattr(getattr(layer, "attn_type", None), "value", "decoder") == "decoder"
            and (window is None or window < 0)
            and not getattr(layer, "logit_cap", 0)
        )

    # ------------------------------------------------------------------ forward
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if forward_batch.forward_mode.is_target_verify():
            return self._verify(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        plan = self._extend
        if plan is not None and plan.own_rows is not None and not kwargs and self._plain_causal(layer):
            out = self._own_extend(q, k, v, layer, forward_batch, save_kv_cache)
        elif self.dense_by_own_rows:
            raise NotImplementedError(f"sas: layer {layer.layer_id}'s extend is not one sas's CPU extend runs (a "
                                      "plain causal self-attention), and torch-native would read the fp8 KV cache "
                                      "without its scales")
        else:
            out = self.inner.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        lid = layer.layer_id
        if plan is None or lid not in self.gates:
            return out
        k_buffer = self.token_to_kv_pool.get_key_buffer(lid)
        if plan.anchors is not None:
            self.step.anchors.write_extend(lid, plan.anchors, q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim),
                                           k_buffer, self.req_to_token_pool.req_to_token, layer.scaling,
                                           self.block_size, k_scale=self.step.scales(lid)[0])
        if plan.blocks is not None:
            self.step.summarize_blocks(lid, k_buffer, *plan.blocks)
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        dense = self._dense(self.inner.forward_decode)
        if layer.layer_id not in self.gates:  # a dense layer (below first_sparse_layer)
            return dense(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        return self._decode_rows(q, k, v, layer, forward_batch, save_kv_cache, dense, **kwargs)

    def _verify(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """A speculative verify forward (TARGET_VERIFY): its bs * n draft rows decode as bs * n decode steps at
        their own positions (verify_rows.py); dense layers and dense steps through the wrapped backend's verify."""
        dense = self._dense(self.inner.forward_extend)
        if layer.layer_id not in self.gates:
            return dense(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        return self._decode_rows(q, k, v, layer, forward_batch, save_kv_cache, dense, **kwargs)

    def _decode_rows(self, q, k, v, layer, forward_batch, save_kv_cache, dense_forward, **kwargs):
        """One sparse layer of a decode or verify step: K/V written, then the planned step (dense_forward: the
        wrapped backend's attention of the same batch, for dense steps)."""
        plan = self._plan
        lid = layer.layer_id
        if save_kv_cache and k is not None and v is not None:
            self._save_kv(layer, forward_batch, k, v)
        k_buffer = self.token_to_kv_pool.get_key_buffer(lid)
        v_buffer = self.token_to_kv_pool.get_value_buffer(lid)
        if plan.graph and self._branch is not None:
            return self._branched_decode(q, k, v, layer, forward_batch, k_buffer, v_buffer, dense_forward, **kwargs)
        if plan.dense:
            # The summary of a block this token completed is still due (the next steps select from it).
            self.step.update_summaries(plan, lid, k_buffer)
            return dense_forward(q, k, v, layer, forward_batch, save_kv_cache=False, **kwargs)
        return self._sparse_attention(q, layer, k_buffer, v_buffer)

    def _sparse_attention(self, q, layer, k_buffer, v_buffer, update=True) -> torch.Tensor:
        """Summary update, selection and attention over the selected blocks (`DecodeStep.run`): `[bs, H_q * Dv]`."""
        plan = self._plan
        q3 = q.reshape(plan.bs, layer.tp_q_head_num, layer.qk_head_dim)
        out = self.step.run(plan, layer.layer_id, q3, k_buffer, v_buffer, update=update)
        if self.cfg.debug_dir and (self.cfg.debug_layers == "all" or layer.layer_id == self.cfg.first_sparse_layer):
            self._debug_record(plan, layer.layer_id, self.step.last_selected)
        return out.reshape(plan.bs, layer.tp_q_head_num * layer.v_head_dim)

    def _branched_decode(self, q, k, v, layer, forward_batch, k_buffer, v_buffer, dense_forward, **kwargs):
        """A captured step with --sas-dense-below: the sparse and the dense attention as two IF nodes
        (`backend/graph_branch.py`) writing one buffer; the flags set in out_graph pick one per replay."""
        plan = self._plan
        # Outside both bodies: the next steps select from this block's summary whichever branch runs (the fused
        # front of the sparse body writes it again, to the same value up to rounding).
        self.step.update_summaries(plan, layer.layer_id, k_buffer)
        out = q.new_empty(plan.bs, layer.tp_q_head_num * layer.v_head_dim)  # made before the bodies: read after

        def dense():
            return dense_forward(q, k, v, layer, forward_batch, save_kv_cache=False, **kwargs)

        if capturing():
            with captured_if(self._branch.first):
                out.copy_(self._sparse_attention(q, layer, k_buffer, v_buffer, update=False))
            with captured_if(self._branch.second):
                out.copy_(dense())
        else:  # the graph runner's warm-up before capture: every kernel of both bodies runs once here
            sparse = self._sparse_attention(q, layer, k_buffer, v_buffer, update=False)
            dense_out = dense()
            out.copy_(dense_out if plan.dense else sparse)
        return out

    def _debug_record(self, plan: DecodePlan, layer_id: int, selected: torch.Tensor) -> None:
        """Append this step's selection at `layer_id` (`selected` `[bs, H_kv, K]`) as one JSON line. Debug/tests
        only."""
        os.makedirs(self.cfg.debug_dir, exist_ok=True)
        if layer_id == self.cfg.first_sparse_layer:
            self._debug_step += 1  # a step's records share its number, whichever layers are logged
        rec = {
            "step": self._debug_step,
            "layer": layer_id,
            "seq_lens": plan.step.seq_lens.tolist(),
            "anchors": None if self.step.anchors is None else
            self.step.anchors[layer_id][plan.step.req_pool_indices.long()].tolist(),
            "num_candidates": plan.step.num_candidates.tolist(),
            "selected": selected.tolist(),
            "kv_heads": list(range(self.kv_head_offset, self.kv_head_offset + self.num_kv_heads)),
        }
        with open(os.path.join(self.cfg.debug_dir, f"selection-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")

    def support_triton(self):
        return self.inner.support_triton()
