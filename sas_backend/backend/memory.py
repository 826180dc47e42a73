"""Device memory the `sas` backend allocates beside SGLang's KV pool, and the hook that makes
SGLang size the KV pool with room for it.

SGLang sizes the KV pool from the memory that is free after the weights are loaded
(`_profile_available_bytes`: free memory minus the `1 - mem_fraction_static` slack), then
`tokens = available // kv_bytes_per_token`. The attention backend is built AFTER that and no
backend hook reserves memory (0.5.15 and 0.5.21 alike), so whatever sas allocates comes out of
the slack meant for activations and CUDA graphs: at a high `--mem-fraction-static` the graph
capture can run out of memory. We therefore wrap `_profile_available_bytes` (plugin.py) and
hand the pool sizer a smaller budget, so that pool + sas memory fits the original budget.

What sas allocates (per rank; H_kv = kv heads on the rank, Dg gate dim, b block = page size,
K = budget // b, R = max running requests + 1 = rows of `req_to_token`):

- summary pool (per KV page, so it grows with the pool): per sparse layer `[pages, H_kv, Dg]`
  fp32, with `pages = kv slots // b` and SGLang's KV buffers holding one padding page beyond
  the pool: `(tokens / b + 1) * (layers * H_kv * Dg * 4 + 1)` bytes (the 1: the page's validity mark).
- gate weights, fp32 per sparse layer: Wq `[H_kv, G, D, Dg]`, Wk `[H_kv, 3D, Dg]`, two norms `[Dg]`.
- RoPE tables (backend/rope_tables.py), `[max_pos, ...]` fp32 on the device: the gate's
  `[max_pos, Dg]` always, and a fp32 copy `[max_pos, D]` of the model's table where SGLang keeps
  its own in another dtype (see `model_rope_table_is_copied`). max_pos: the model's RoPE table
  length, SGLang's context length or max_position_embeddings, whichever is longer.
- CUDA only, fixed: the kv index buffer `[R * H_kv * (K + 1) * b]` int32 (allocated once, in
  FlashInferSparseDecode), the row offsets `[R * H_kv + 1]` int32 (read by the gather kernel and
  FlashInfer alike) and FlashInfer's last-page-len `[R * H_kv]` int32 buffer (also there),
  FlashInfer's 128 MiB float workspace (unless shared with the wrapped backend's) and 8 MiB of int
  workspace per FlashInfer wrapper (one eager + one per captured decode batch size).
- `--sas-exact-rerank X` (two levels): the second level's `[rows, H_kv, K]` int32 selection, on CUDA its kernel's
  per-(row, kv head) block log-sum-exps (`ops.rerank.RerankWorkspace`) and, under the fused kernels, the first level's
  select workspace at X x K (`DecodeStep.rerank_bytes_for`). With `--sas-rerank-keys int4`, per page the summary
  pool's 4-bit key codes of every sparse layer and kv head (`ops.key_codes.code_bytes`: b x D / 2 + 4 x D bytes).

Not reserved here: the wrapped dense backend's own buffers (the dense FlashInfer backend
allocates the same ones when SGLang serves dense, and SGLang's default mem_fraction_static
already leaves room for them) and transient per-step tensors (gate-query partials, scores, Top-K) that live in the
activation / CUDA-graph pool like the model's own activations.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, Optional, Union

import torch

logger = logging.getLogger(__name__)

MiB = 1 << 20
# The one reserved figure no object holds between steps (the prompt anchors' scratch at extend).
TRANSIENT = "prompt anchor scratch"
# What this process's last launch reserved, by name (`reserve_sas_memory`; "summary pool": the pool of the tokens
# SGLang builds, its padding page included), for the backend to set beside what it holds (`SASAttnBackend.held_bytes`,
# /sas/info's pool state). None before any reservation (CPU tools, tests building a backend by hand).
RESERVED: Optional[Dict[str, int]] = None
# SGLang's own cap on its max_running_requests estimate (min(max(est, 2048), 4096)) in 0.5.15
# and 0.5.21: the req pool never has more rows unless the user asks for more.
SGLANG_MAX_REQS_ESTIMATE_CAP = 4096


@dataclasses.dataclass(frozen=True)
class SASMemory:
    """Bytes sas allocates on one rank. `summary_bytes_per_page`: the summary pool's cost per KV
    page (all sparse layers); `fixed`: name -> bytes that do not depend on the pool size."""

    page_size: int
    summary_bytes_per_page: int
    fixed: Dict[str, int]

    @property
    def fixed_bytes(self) -> int:
        return sum(self.fixed.values())

    @property
    def bytes_per_token(self) -> float:
        return self.summary_bytes_per_page / self.page_size

    def total_bytes(self, kv_tokens: int) -> int:
        """Everything sas allocates beside a KV pool of `kv_tokens` tokens (a page multiple)."""
        return (kv_tokens // self.page_size) * self.summary_bytes_per_page + self.fixed_bytes


def sas_memory(
    *,
    num_sparse_layers: int,
    num_kv_heads: int,
    gate_dim: int,
    block_size: int,
    top_k: int,
    max_reqs: int,
    on_cuda: bool,
    summary_dim: Optional[int] = None,
    num_graph_batch_sizes: int = 0,
    shared_workspace: bool = False,
    group_size: int = 0,
    head_dim: int = 0,
    rope_positions: int = 0,
    model_rope_copied: bool = False,
    prompt_anchors: int = 0,
    summary_bytes: int = 4,
    flashinfer_attention: bool = True,
    decode_step_bytes: int = 0,
    front_gate_bytes: int = 0,
    anchor_scratch_bytes: int = 0,
    rows_per_request: int = 1,
    rerank_bytes: int = 0,
    code_head_dim: int = 0,
) -> SASMemory:
    """The sas backend's allocation on one rank (see the module doc for each term).

    max_reqs: SGLang's max running requests (the req pool has `max_reqs + 1` rows).
    num_graph_batch_sizes: captured decode batch sizes (0 without CUDA graphs).
    shared_workspace: FlashInfer's float workspace is the wrapped backend's (not allocated).
    group_size, head_dim: G and D, for the gate weights (0: not counted; gate_dim 0: no gate).
    summary_dim: floats per page and kv head in the summary pool (default gate_dim; the selector's
    `summary_dim`: 2D for quest, 0 for sink-local).
    rope_positions: rows of the RoPE tables (`rope_table_positions`; 0: not counted);
    model_rope_copied: the backend holds a fp32 copy of the model's table (`model_rope_table_is_copied`).
    prompt_anchors: R of `--sas-prompt-anchors` (its pool: `[max_reqs + 1, H_kv, R]` int32 per sparse layer).
    summary_bytes: bytes per summary element (4 fp32, 2 bf16: `--sas-summary-dtype`).
    flashinfer_attention: the FlashInfer sparse decode exists on CUDA (`DecodeStep.per_op_attention`: `--sas-attention
    flashinfer`, or batches larger than the fused path serves); decode_step_bytes: the fused kernels' workspace
    (`decode_step_workspace_bytes`); front_gate_bytes: bytes per element of the fused front's copy of the gate
    weights (2 under `--sas-gate-dtype bf16`; 0: it reads the gate itself); anchor_scratch_bytes: the prompt
    anchors' scratch at extend (`ops.anchors.anchor_scratch_bytes`, one layer at a time); rows_per_request: decode
    rows a request brings to one step (n draft tokens under speculative decoding: a verify step); rerank_bytes: the
    second level's buffers under `--sas-exact-rerank` (`DecodeStep.rerank_bytes_for`); code_head_dim: D of the
    summary pool's 4-bit key codes under `--sas-rerank-keys int4` (0: none).
    """
    from sas_backend.backend.anchor_pool import AnchorPool
    from sas_backend.backend.rope_tables import RopeTables
    from sas_backend.backend.summary_pool import SummaryPool
    from sas_backend.gate.module import AttnGate
    from sas_backend.ops.sparse_decode.flashinfer import FlashInferSparseDecode

    # Each figure is the allocating class's own (`nbytes_for`), so a change to an allocation changes its reservation.
    per_page = SummaryPool.bytes_per_page(num_sparse_layers, num_kv_heads,
                                          gate_dim if summary_dim is None else summary_dim, summary_bytes,
                                          code_head_dim, block_size)
    fixed = {"summary padding page": per_page}
    if head_dim and gate_dim:
        fixed["gate weights"] = num_sparse_layers * AttnGate.nbytes_for(num_kv_heads, group_size, head_dim, gate_dim)
        if front_gate_bytes:
            fixed["gate weights (front copy)"] = num_sparse_layers * AttnGate.nbytes_for(
                num_kv_heads, group_size, head_dim, gate_dim, front_gate_bytes)
    if rope_positions and gate_dim:
        fixed["gate rope table"] = RopeTables.nbytes_for(rope_positions, gate_dim)
    if rope_positions and model_rope_copied:
        fixed["model rope table (fp32 copy)"] = RopeTables.nbytes_for(rope_positions, head_dim)
    if prompt_anchors:
        fixed["prompt anchors"] = AnchorPool.nbytes_for(num_sparse_layers, max_reqs + 1, num_kv_heads, prompt_anchors)
        if anchor_scratch_bytes:
            fixed[TRANSIENT] = anchor_scratch_bytes
    if decode_step_bytes:
        fixed["decode step workspace"] = decode_step_bytes
    if rerank_bytes:
        fixed["exact rerank"] = rerank_bytes
    if on_cuda and flashinfer_attention:
        fixed["flashinfer sparse decode"] = FlashInferSparseDecode.nbytes_for(
            (max_reqs + 1) * rows_per_request * num_kv_heads, top_k, block_size, 1 + num_graph_batch_sizes,
            own_workspace=not shared_workspace)
    return SASMemory(page_size=block_size, summary_bytes_per_page=per_page, fixed=fixed)


def decode_step_workspace_bytes(num_kv_heads: int, group_size: int, head_dim: int, gate_dim: int, top_k: int,
                                block_size: int, max_reqs: int, context_len: int, on_cuda: bool,
                                chunk: Union[int, dict, None] = None, target_programs: Optional[int] = None,
                                rows_per_request: int = 1, sub_blocks: int = 1) -> int:
    """Device bytes of the fused decode step's workspace (`backend.decode_step.DecodeStep.fused_ws`), sized as the
    backend sizes it (built on `meta`: nothing is allocated)."""
    from sas_backend.backend.decode_step import DecodeStep
    from sas_backend.ops.fused_step import (CPU_TARGET_PROGRAMS, GPU_KCHUNK, GPU_QCHUNK, GPU_TARGET_PROGRAMS,
                                             DecodeStepWorkspace, StepGeometry)

    geo = StepGeometry(num_kv_heads, group_size, head_dim, head_dim, max(gate_dim, 2), top_k, block_size, sub_blocks)
    programs = target_programs or (GPU_TARGET_PROGRAMS if on_cuda else CPU_TARGET_PROGRAMS)
    ws = DecodeStepWorkspace(geo, DecodeStep.fused_rows((max_reqs + 1) * rows_per_request), context_len // block_size,
                             "meta", chunk=chunk, target_programs=programs,
                             qchunk=GPU_QCHUNK if on_cuda else None, kchunk=GPU_KCHUNK if on_cuda else None)
    return ws.nbytes


def kv_budget_with_sas(
    available_bytes: int, kv_bytes_per_token: int, mem: SASMemory, max_total_tokens: Optional[int] = None
) -> int:
    """The KV budget to hand SGLang's pool sizer instead of `available_bytes`.

    SGLang makes `tokens = min(budget // kv_bytes_per_token, max_total_tokens)` (rounded down to
    pages). We want `tokens * kv_bytes_per_token + mem.total_bytes(tokens) <= available_bytes`, i.e.
    `tokens = (available - fixed) / (kv_bytes_per_token + sas bytes per token)`. When the user's
    `--max-total-tokens` caps the pool below that, only the capped pool's summaries are reserved.
    """
    rest = available_bytes - mem.fixed_bytes
    if rest <= 0:
        return 0
    tokens = int(rest // (kv_bytes_per_token + mem.bytes_per_token))
    if max_total_tokens is not None and 0 < max_total_tokens < tokens:
        return available_bytes - mem.total_bytes(sas_pool_tokens(max_total_tokens, mem.page_size))
    return tokens * kv_bytes_per_token


def sas_pool_tokens(tokens: int, page_size: int) -> int:
    """The KV pool SGLang builds for a token count: whole pages."""
    return tokens // page_size * page_size


def rope_table_positions(server_args, model_config, max_position_embeddings: Optional[int]) -> int:
    """Rows of the model's RoPE table in a SGLang server: the rotary module is built for
    max_position_embeddings and SGLang's `reserve_rope_cache_for_long_sequences` (0.5.15..0.5.23)
    extends it at load to the context length plus speculative room plus a margin, aligned."""
    from sglang.srt.environ import envs

    base = (
        getattr(server_args, "context_length", None)
        or getattr(model_config, "context_len", None)
        or max_position_embeddings
        or 2048
    )
    steps = int(getattr(server_args, "speculative_num_steps", None) or 0)
    draft = int(getattr(server_args, "speculative_num_draft_tokens", None) or 0)
    align = envs.SGLANG_ROPE_CACHE_ALIGN.get()
    reserve = (base + steps * draft * envs.SGLANG_SPEC_EXPANSION_SAFETY_FACTOR.get()
               + envs.SGLANG_ROPE_CACHE_SAFETY_MARGIN.get())
    reserve = (reserve + align - 1) // align * align
    return max(int(max_position_embeddings or 0), reserve)


def model_rope_table_is_copied(on_cuda: bool, model_dtype: torch.dtype) -> bool:
    """Whether `RopeTables` holds a fp32 copy of the model's table rather than aliasing it. SGLang
    keeps its table in fp32 on CUDA (a later dtype swap is refilled in place into the aliased
    buffer) and in the model's dtype elsewhere (unless SGLANG_ROPE_CACHE_FP32 is set)."""
    if on_cuda or model_dtype == torch.float32:
        return False
    try:
        from sglang.srt.environ import envs

        return not envs.SGLANG_ROPE_CACHE_FP32.get()
    except Exception:  # a release without that switch
        return True


# ---------------------------------------------------------------- the SGLang hook


def _graph_batch_size_count(server_args) -> int:
    """How many decode batch sizes SGLang will capture (0 without decode CUDA graphs, whichever
    flag spelling turned them off: `sglang_compat.decode_cuda_graph_disabled`)."""
    from sas_backend.backend.sglang_compat import decode_cuda_graph_disabled

    if decode_cuda_graph_disabled(server_args):
        return 0
    cfg = getattr(server_args, "cuda_graph_config", None)
    decode = getattr(cfg, "decode", None) if cfg is not None else None
    bs = getattr(decode, "bs", None) if decode is not None else None
    if bs is None:
        bs = getattr(server_args, "cuda_graph_bs", None)
    if bs:
        return len(set(bs))
    # Not resolved yet: SGLang's default list is 1, 2, 4, 8 then steps of >= 8 up to max_bs.
    max_bs = getattr(server_args, "cuda_graph_max_bs", None) or 256
    return 4 + max_bs // 8


def attention_tp_size_from_args(server_args) -> int:
    """The attention-TP width SGLang derives from the launch flags (`runtime_context.derive_attention_widths`):
    tp_size / (dp_size under --enable-dp-attention) / attn_cp_size. Under DP attention each rank holds more kv
    heads than tp_size alone says, so the plain TP size would under-reserve."""
    tp = int(getattr(server_args, "tp_size", None) or 1)
    dp = int(getattr(server_args, "dp_size", None) or 1) if getattr(server_args, "enable_dp_attention", False) else 1
    cp = int(getattr(server_args, "attn_cp_size", None) or 1)
    return max(1, tp // max(dp, 1) // max(cp, 1))


def sglang_max_running_requests(server_args, context_len: int, tokens: int) -> int:
    """The request rows SGLang gives a pool of `tokens` tokens (`KVCacheConfigurator.resolve_max_num_reqs`, 0.5.21 to
    0.5.23): the launch's `--max-running-requests` (per DP-attention worker), else its estimate (512 requests per
    context length of tokens, within 2048..4096); at most tokens // 2 either way."""
    user = getattr(server_args, "max_running_requests", None)
    if user:
        dp_attention = getattr(server_args, "enable_dp_attention", False)
        dp = int(getattr(server_args, "dp_size", None) or 1) if dp_attention else 1
        return min(int(user) // dp, tokens // 2)
    estimated = max(min(int(tokens / max(int(context_len or 1), 1) * 512), SGLANG_MAX_REQS_ESTIMATE_CAP), 2048)
    return min(estimated, tokens // 2)


def memory_for_sglang(owner, max_reqs: Optional[int] = None) -> tuple:
    """(SASMemory, KV bytes per token) for the object whose `_profile_available_bytes` runs:
    0.5.15 a ModelRunner, 0.5.21 a KVCacheConfigurator. Both carry `server_args`,
    `model_config`, `kv_cache_dtype` and `device`. max_reqs: the request rows to size for (default: the most
    SGLang may give, the launch's `--max-running-requests` or its estimate's cap)."""
    from sas_backend.config import SASConfig
    from sas_backend.geometry import ModelGeometry

    server_args = owner.server_args
    cfg = SASConfig.for_serving()
    geo = ModelGeometry.from_hf_config(owner.model_config.hf_config)
    try:  # kv heads are sharded over the attention-TP group (smaller than tp_size under DP attention)
        from sas_backend.backend.sglang_compat import attention_tp

        tp_size = attention_tp()[1]
    except Exception:  # parallel state not published yet: derived from the flags as SGLang derives it
        tp_size = attention_tp_size_from_args(server_args)
    kv_heads = max(1, geo.num_kv_heads // tp_size)
    kv_elem = torch.empty(0, dtype=owner.kv_cache_dtype).element_size()
    kv_bytes_per_token = 2 * kv_heads * geo.head_dim * geo.num_layers * kv_elem
    from sas_backend.selection import SelectionRule, make_selector, selector_class

    gate_dim = selector_class(cfg.selector).gate_dim(cfg.gate_path)  # config.json alone
    selector = make_selector(cfg.selector, SelectionRule(cfg.top_k, cfg.block_size, sub_blocks=cfg.sub_blocks or 1))
    summary_dim = selector.summary_dim(geo.head_dim, gate_dim)
    on_cuda = torch.device(owner.device).type == "cuda"
    if max_reqs is None:
        max_reqs = getattr(server_args, "max_running_requests", None) or SGLANG_MAX_REQS_ESTIMATE_CAP
    from sas_backend.backend.decode_step import DecodeStep
    from sas_backend.backend.step_settings import device_name, resolve
    from sas_backend.ops.anchors import anchor_scratch_bytes

    settings = resolve(cfg, owner.device, device_name(owner.device))
    context_len = rope_table_positions(server_args, owner.model_config, geo.max_position_embeddings)
    from sas_backend.backend.verify_rows import draft_tokens_from_args

    rows_per_request = max(1, draft_tokens_from_args(server_args))  # a verify step: n decode rows a request
    fused_bytes = first_bytes = 0
    rerank = cfg.exact_rerank or 1
    if DecodeStep.fused_workspace(settings):
        from sas_backend.backend.sglang_compat import req_to_token_width

        # sized, as DecodeStep sizes it, for the slot table's width (else the RoPE table's: never narrower)
        width = req_to_token_width(owner.model_config) or context_len

        def fused_at(top_k: int) -> int:
            return decode_step_workspace_bytes(kv_heads, geo.group_size, geo.head_dim, gate_dim, top_k,
                                               cfg.block_size, max_reqs, width, on_cuda, settings.select_chunk,
                                               settings.target_programs, rows_per_request, selector.rule.sub_blocks)

        fused_bytes = fused_at(cfg.top_k)
        first_bytes = fused_at(rerank * cfg.top_k) if rerank > 1 else 0  # the first level's select at X x K
    mem = sas_memory(
        num_sparse_layers=geo.num_layers - cfg.first_sparse_layer,
        num_kv_heads=kv_heads,
        gate_dim=gate_dim,
        summary_dim=summary_dim,
        block_size=cfg.block_size,
        top_k=cfg.top_k,
        max_reqs=max_reqs,
        on_cuda=on_cuda,
        num_graph_batch_sizes=_graph_batch_size_count(server_args) if on_cuda else 0,
        group_size=geo.group_size,
        head_dim=geo.head_dim,
        shared_workspace=on_cuda,  # the backend borrows the wrapped FlashInfer backend's workspace
        rope_positions=rope_table_positions(server_args, owner.model_config, geo.max_position_embeddings),
        model_rope_copied=model_rope_table_is_copied(on_cuda, getattr(owner.model_config, "dtype", torch.float32)),
        prompt_anchors=cfg.prompt_anchors or 0,
        summary_bytes=torch.empty(0, dtype=settings.summary_dtype).element_size(),
        flashinfer_attention=DecodeStep.per_op_attention(settings, (max_reqs + 1) * rows_per_request),
        rows_per_request=rows_per_request,
        decode_step_bytes=fused_bytes,
        code_head_dim=geo.head_dim if cfg.rerank_keys == "int4" and rerank > 1 else 0,
        rerank_bytes=DecodeStep.rerank_bytes_for(rerank, kv_heads, geo.group_size, cfg.top_k,
                                                 (max_reqs + 1) * rows_per_request, on_cuda,
                                                 DecodeStep.fused_workspace(settings), first_bytes,
                                                 DecodeStep.ranks_in_attend(settings)),
        anchor_scratch_bytes=anchor_scratch_bytes(kv_heads, geo.group_size, geo.head_dim, kv_elem, cfg.block_size,
                                                  context_len) if cfg.prompt_anchors else 0,
        # DecodeStep's copies of the gate weights for the fused front (--sas-gate-dtype bf16)
        front_gate_bytes=torch.empty(0, dtype=settings.gate_dtype).element_size()
        if settings.kernels == "triton" and settings.gate_dtype != torch.float32 else 0,
    )
    return mem, kv_bytes_per_token


def reserve_sas_memory(original, owner, *args, **kwargs) -> int:
    """AROUND hook on `_profile_available_bytes`: shrink SGLang's KV budget by what sas needs."""
    available = original(owner, *args, **kwargs)
    server_args = getattr(owner, "server_args", None)
    if getattr(server_args, "attention_backend", None) != "sas":
        return available
    try:
        mem, kv_bytes_per_token = memory_for_sglang(owner)
    except Exception as e:
        # An unshrunk pool would start and then run out of device memory under load: refuse the launch instead.
        raise RuntimeError(f"sas: cannot size the KV pool beside the sas backend's own memory ({type(e).__name__}: "
                           f"{e}); refusing to start rather than risk running out of device memory later") from e
    max_total = getattr(server_args, "max_total_tokens", None)

    def pool_for(mem):  # (the KV budget, the pool SGLang builds from it)
        budget = kv_budget_with_sas(available, kv_bytes_per_token, mem, max_total)
        tokens = budget // kv_bytes_per_token
        return budget, sas_pool_tokens(min(tokens, max_total) if max_total else tokens, mem.page_size)

    budget, tokens = pool_for(mem)  # sized for the most request rows SGLang may give
    # SGLang sets its request rows from the pool it builds: size the per-request buffers for those rows when the
    # pool they lead to gets the same rows (else keep the upper bound: never less than is allocated).
    context_len = getattr(owner.model_config, "context_len", None)
    try:
        rows = sglang_max_running_requests(server_args, context_len, tokens)
        exact, _ = memory_for_sglang(owner, max_reqs=rows)
        exact_budget, exact_tokens = pool_for(exact)
        if sglang_max_running_requests(server_args, context_len, exact_tokens) == rows:
            mem, budget, tokens = exact, exact_budget, exact_tokens
    except Exception as e:  # the upper bound stands
        logger.warning("sas: sizing the per-request buffers for SGLang's request rows failed (%s); reserving for "
                       "the most rows it may give", e)
    global RESERVED
    RESERVED = {"summary pool": mem.total_bytes(tokens) - mem.fixed_bytes + mem.fixed["summary padding page"],
                **{k: v for k, v in mem.fixed.items() if k != "summary padding page"}}
    logger.info(
        "sas: reserving %.1f MiB beside the KV pool (summaries %.1f MiB for %d tokens + fixed %.1f MiB: %s); "
        "KV budget %.3f -> %.3f GiB",
        mem.total_bytes(tokens) / MiB, (mem.total_bytes(tokens) - mem.fixed_bytes) / MiB, tokens,
        mem.fixed_bytes / MiB, ", ".join(f"{k} {v / MiB:.1f}" for k, v in mem.fixed.items()),
        available / 2**30, budget / 2**30,
    )
    return budget
