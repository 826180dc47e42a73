"""The fused sparse decode step of one layer: three launches (front, select, attend), ONE entry point each.

    front(...)   gate query of the new token, and the summary of a block its token completed
    select(...)  scores of every candidate block, forced blocks and anchors, Top-K -> `[bs, H_kv, K]`
    attend(...)  attention over the K selected blocks plus the current block -> `[bs, H_q, Dv]`

`triton.py` holds the kernels (its docstring says how each is split); `naive.py` states the same step with
the plain references of `ops.gate`, `ops.summary`, `ops.score`, `ops.anchors`, `ops.topk` and
`ops.sparse_decode` (tests only). The torch path a CPU server runs is the per-op one
(`sas_backend.selection` + `ops.sparse_decode`); `backend.decode_step.DecodeStep` picks between them.
Buffers live in a `DecodeStepWorkspace`, allocated once per server for the largest batch: no launch
allocates (CUDA graphs), and no launch syncs the host. The kernels are imported on first use only, so
CPU callers that never launch them never import Triton.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch

from sas_backend.ops import sub_blocks_ok

# The GPU the kernels' splits are sized for: programs per launch at batch 1 (about two waves of an
# H100/H200's 132 SMs). On CPU (the interpreter runs programs one by one) a handful, so that the split
# paths still run; `DecodeStepWorkspace(target_programs=...)` overrides both.
GPU_TARGET_PROGRAMS = 264
CPU_TARGET_PROGRAMS = 4
GPU_QCHUNK = 16  # w_q rows per RoPE half per front unit (16 KB of fp32 at Dg 128), as ops.gate.triton's split
GPU_KCHUNK = 8  # head dims per RoPE half per summary unit (24 KB of fp32 w_k at D = Dg = 128)


def default_sizes(cuda: bool) -> dict:
    """The split sizes a workspace takes unless told otherwise: on CUDA the GPU's (the ones the sm_90 compile must
    build: gpu_kit/compile_triton.py reads them here), on CPU the interpreter's (qchunk / kchunk None: D/2, one
    front unit per query head and one summary unit)."""
    if cuda:
        return dict(target_programs=GPU_TARGET_PROGRAMS, qchunk=GPU_QCHUNK, kchunk=GPU_KCHUNK)
    return dict(target_programs=CPU_TARGET_PROGRAMS, qchunk=None, kchunk=None)


def _interpreting() -> bool:
    """Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1): the kernels then work around its
    wrong bf16 `tl.dot` (seen with Triton 3.6 and 3.9) by computing that dot in fp32."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def default_select_chunk(top_k: int) -> int:
    """The select chunk a workspace takes unless told otherwise: max(64, 4 * next_pow2(K)) blocks."""
    return max(64, 4 * _pow2(max(int(top_k), 1)))


def select_chunk_rule(chunk, default: int) -> tuple:
    """The select launch's chunk per batch size as ((min_bs, chunk), ...) ascending from min_bs 1.

    chunk: None (`default` at every batch size), an int (that one at every batch size), or a per-batch-size rule
    {min_bs: chunk} (keys ints or, as JSON writes them, digit strings; batch sizes below the smallest key take
    `default`). Every chunk is a power of two >= 16."""
    if chunk is None:
        rule = {1: default}
    elif isinstance(chunk, dict):
        try:
            rule = {int(b): int(c) for b, c in chunk.items()}
        except (TypeError, ValueError):
            raise ValueError(f"select chunk rule {chunk!r}: keys are batch sizes, values chunks") from None
        if not rule or min(rule) < 1:
            raise ValueError(f"select chunk rule {chunk!r}: batch sizes start at 1")
        rule.setdefault(1, default)
    else:
        rule = {1: int(chunk)}
    for c in rule.values():
        if c < 16 or c & (c - 1):
            raise ValueError(f"select chunk must be a power of two >= 16, got {c}")
    return tuple(sorted(rule.items()))


@dataclasses.dataclass(frozen=True)
class StepGeometry:
    """Per-rank geometry of a sparse layer: H_kv kv heads, G query heads each, head dims D (keys) and
    Dv (values), gate dim Dg, K selected blocks of b tokens; sub_blocks n: summaries a block keeps, one per run
    of b / n tokens (`selection.SelectionRule.sub_blocks`), so a summary row is n * Dg wide."""

    num_kv_heads: int
    group: int
    head_dim: int
    v_head_dim: int
    gate_dim: int
    top_k: int
    block_size: int
    sub_blocks: int = 1

    @property
    def summary_width(self) -> int:
        """Columns of a summary row: the n run summaries side by side."""
        return self.sub_blocks * self.gate_dim

    def check(self) -> "StepGeometry":
        if self.head_dim % 2 or self.gate_dim % 2:
            raise ValueError(f"RoPE needs even dims, got D={self.head_dim}, Dg={self.gate_dim}")
        if self.block_size & (self.block_size - 1) or self.block_size <= 0:
            raise ValueError(f"block size must be a power of two, got {self.block_size}")
        n = self.sub_blocks
        if not sub_blocks_ok(n, self.block_size):
            raise ValueError(f"sub_blocks must be a power of two dividing the block size {self.block_size}, got {n}")
        if self.top_k < 0 or self.num_kv_heads <= 0 or self.group <= 0:
            raise ValueError(f"bad geometry {self}")
        return self


_WARPS = (1, 2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """How the three launches are issued, the variants a GPU measurement decides between.

    pdl: programmatic dependent launch (sm_90+, CUDA only): each kernel starts before its predecessor ends and
    waits for it in-kernel, so launch latency overlaps the previous launch's tail (`triton.py`'s docstring);
    front_warps / select_warps / attend_warps: num_warps of each launch (None: the launch's own default, 4, or 8
    for the wide select tiles and fp32 K/V attention); rank_in_attend: with two levels (`--sas-exact-rerank`) and
    this attend, the second level only writes its candidates' log-sum-exps and the attend's programs choose the K
    blocks (`ops.rerank.candidate_lse`; False: the second level selects them in its own launch, as the per-op
    attention needs)."""

    pdl: bool = False
    front_warps: Optional[int] = None
    select_warps: Optional[int] = None
    attend_warps: Optional[int] = None
    rank_in_attend: bool = True

    def check(self) -> "LaunchOptions":
        for name in ("front_warps", "select_warps", "attend_warps"):
            w = getattr(self, name)
            if w is not None and w not in _WARPS:
                raise ValueError(f"{name} must be one of {_WARPS} or None, got {w!r}")
        return self

    def kwargs(self, warps: Optional[int], default_warps: int) -> dict:
        """The launch's keyword arguments: the PDL constexpr, num_warps, and Triton's launch_pdl option."""
        if self.pdl and _interpreting():
            raise ValueError("PDL (LaunchOptions.pdl) needs a CUDA sm_90+ device; Triton's interpreter has no grid "
                             "dependency control")
        return dict(PDL=self.pdl, num_warps=warps or default_warps, **({"launch_pdl": True} if self.pdl else {}))


class DecodeStepWorkspace:
    """The three kernels' buffers for at most `max_bs` rows and `max_blocks` candidate blocks per row.

    gate_q `[max_bs, H_kv, Dg]` fp32 (front -> select); selected `[max_bs, H_kv, K]` int32 (select ->
    attend); partials and the zeroed arrival counters of each launch. Split sizes:
    - front: UQ = G * cdiv(D/2, qchunk) gate-query units and UK = cdiv(D/2, kchunk) summary units per (row, kv
      head) (CUDA: 16 and 8 head dims per RoPE half; CPU: D/2, one unit each);
    - select: chunks of `select_chunk(bs)` blocks, NC = cdiv(width, chunk) programs per (row, kv head), each
      keeping min(K, chunk) survivors. `chunk`: one size for every batch (default max(64, 4 * next_pow2(K))), or
      a per-batch-size rule {min_bs: chunk} (a batch of bs rows takes the entry of the largest min_bs <= bs, the
      default below the smallest): a long-context server's short rows at a big batch launch fewer idle programs
      with bigger chunks, a batch of one reads fastest in small ones, and a captured batch size always chunks alike;
    - attend: `attend_splits(bs)` splits of the K + 1 blocks, about `target_programs` programs at batch 1,
      one split (no partials) once bs * H_kv alone fills the device.
    launch: `LaunchOptions` (PDL, warps) of the three launches.
    """

    def __init__(self, geometry: StepGeometry, max_bs: int, max_blocks: int, device, chunk: Optional[int] = None,
                 target_programs: Optional[int] = None, qchunk: Optional[int] = None, kchunk: Optional[int] = None,
                 launch: Optional[LaunchOptions] = None):
        self.geo = geo = geometry.check()
        self.device = torch.device(device)
        self.launch = (launch or LaunchOptions()).check()
        if self.launch.pdl and self.device.type == "cuda" and torch.cuda.is_available() \
                and torch.cuda.get_device_capability(self.device) < (9, 0):
            raise ValueError(f"PDL needs sm_90+; {torch.cuda.get_device_name(self.device)} is sm_"
                             + "".join(map(str, torch.cuda.get_device_capability(self.device))))
        self.max_bs = int(max_bs)
        self.max_blocks = int(max_blocks)
        sizes = default_sizes(self.device.type == "cuda")
        self.target_programs = int(target_programs or sizes["target_programs"])
        half_d = geo.head_dim // 2
        # On CPU (the interpreter runs one program at a time, each op costing far more than its bytes) the front
        # is cut coarsely: one unit per query head and one summary unit; the tests pass the GPU's sizes.
        self.qchunk = min(qchunk or sizes["qchunk"] or half_d, _pow2(half_d))
        self.uq_per_head = -(-half_d // self.qchunk)
        self.uq = geo.group * self.uq_per_head
        self.kchunk = min(kchunk or sizes["kchunk"] or half_d, _pow2(half_d))
        self.uk = -(-half_d // self.kchunk)
        k = geo.top_k
        self.chunk_rule = select_chunk_rule(chunk, default_select_chunk(k))
        f32, i32 = dict(dtype=torch.float32, device=self.device), dict(dtype=torch.int32, device=self.device)
        rows = self.max_bs * geo.num_kv_heads
        dg = geo.gate_dim
        self.gate_q = torch.zeros(self.max_bs, geo.num_kv_heads, dg, **f32)
        self.selected = torch.full((self.max_bs, geo.num_kv_heads, max(k, 0)), -1, **i32)
        self.front_partials_q = torch.zeros(rows * self.uq * dg, **f32)
        self.front_partials_k = torch.zeros(rows * self.uk * geo.summary_width, **f32)  # per run
        self.front_counters = torch.zeros(rows * 2, **i32)
        # Sized for the batch whose rows keep the most survivors (the rule can change with bs; within one entry
        # the need grows with bs, so each entry's largest batch bounds it).
        need = [bs * geo.num_kv_heads * 2 * self.select_chunks(self.max_blocks, bs) * self.slots(bs)
                for bs in self._rule_edges() if self.select_chunks(self.max_blocks, bs) > 1]
        self.select_partials = torch.zeros(max(need + [1]), **i32)
        self.select_counters = torch.zeros(rows, **i32)
        self.gp = max(16, _pow2(geo.group))
        self.block_dv = max(16, _pow2(geo.v_head_dim))
        most = max(bs * self.attend_splits(bs) for bs in range(1, self.max_bs + 1))
        splits_rows = most * geo.num_kv_heads
        self.attend_stats = torch.zeros(splits_rows * 2 * self.gp, **f32)
        self.attend_partials = torch.zeros(splits_rows * self.gp * self.block_dv, **f32)
        self.attend_counters = torch.zeros(rows, **i32)

    def select_chunk(self, bs: int = 1) -> int:
        """Candidate blocks per select program for a batch of bs rows (`chunk_rule`)."""
        return next(c for b, c in reversed(self.chunk_rule) if b <= max(int(bs), 1))

    def slots(self, bs: int = 1) -> int:
        """Survivors each select chunk program keeps for a batch of bs rows: min(K, chunk)."""
        return max(1, min(self.geo.top_k, self.select_chunk(bs)))

    def select_chunks(self, width: int, bs: int = 1) -> int:
        """Programs per (row, kv head) of the select launch for rows of `width` candidate blocks."""
        return max(1, -(-max(int(width), 1) // self.select_chunk(bs)))

    def merge_tile(self, width: int, bs: int = 1) -> int:
        """The select merge's tile (survivors of every chunk of a row of `width` blocks, padded to a power of two)."""
        return max(16, min(4096, _pow2(self.select_chunks(width, bs) * self.slots(bs))))

    def select_warps(self, width: int, bs: int = 1) -> int:
        """The select launch's default num_warps: 8 for the wide chunk and merge tiles, else 4."""
        return 8 if self.select_chunk(bs) >= 512 or self.merge_tile(width, bs) >= 2048 else 4

    def _rule_edges(self) -> list:
        """The largest batch size of each chunk-rule entry that a batch of at most max_bs rows reaches."""
        starts = [b for b, _ in self.chunk_rule if b <= self.max_bs]
        return [min(nxt - 1, self.max_bs) for nxt in starts[1:] + [self.max_bs + 1]]

    def attend_splits(self, bs: int) -> int:
        """Splits of the K + 1 attended blocks for a batch of bs rows (a function of bs only, so a
        captured batch size always splits alike)."""
        entries = self.geo.top_k + 1
        want = max(1, -(-self.target_programs // max(1, bs * self.geo.num_kv_heads)))
        per = -(-entries // min(entries, want))
        return -(-entries // per)

    @property
    def nbytes(self) -> int:
        """Device bytes of every buffer."""
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))


def front(
    ws: DecodeStepWorkspace,
    q: torch.Tensor,
    model_cos_sin: torch.Tensor,
    gate_cos_sin: torch.Tensor,
    w_q: torch.Tensor,
    q_norm: torch.Tensor,
    k_buffer: torch.Tensor,
    model_table: torch.Tensor,
    gate_table: torch.Tensor,
    w_k: torch.Tensor,
    k_norm: torch.Tensor,
    summaries: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    k_scale: float = 1.0,
    key_codes=None,
) -> torch.Tensor:
    """One launch: the gate query of each row's new token, and the summary of the block it completed.

    q: `[bs, H_q, D]` after the model's RoPE (last axis contiguous); model_cos_sin `[bs, D]`, gate_cos_sin
    `[bs, Dg]`: fp32 table rows at each row's position; w_q `[H_kv, G, D, Dg]`, q_norm `[Dg]`; k_buffer
    `[slots, H_kv, D]` holding the new key already; model_table `[max_pos, D]`, gate_table `[max_pos, Dg]`
    fp32; w_k `[H_kv, 3D, Dg]`, k_norm `[Dg]` (weights fp32 or bf16); summaries `[num_pages, H_kv, n * Dg]`
    (fp32 or bf16; n = geometry.sub_blocks run summaries side by side, each pooled over its b / n tokens with the
    gate RoPE at its first position) written in place for rows whose seq_len is a positive multiple of b; block_table
    `[bs, >= M + 1]` int; seq_lens `[bs]`; k_scale: the layer's key scale (an fp8 k_buffer holds K / k_scale;
    1.0 otherwise); key_codes: optional (packed `[num_pages, H_kv, b * D / 2]` uint8, scales `[num_pages, H_kv, 2,
    D]` fp16) of `ops.key_codes`, the completed block's page written as `ops.key_codes.encode_pages` writes it.
    Returns `ws.gate_q[:bs]` `[bs, H_kv, Dg]` fp32 (= `naive.front`'s gate query; the summaries as
    `ops.summary.update_summaries` leaves them).
    """
    from sas_backend.ops.fused_step import triton as kernels
    from sas_backend.ops.gate import GATE_NORM_EPS

    geo = ws.geo
    bs, h_q, d = q.shape
    h_kv, dg = geo.num_kv_heads, geo.gate_dim
    if bs > ws.max_bs or h_q != h_kv * geo.group or d != geo.head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not fit the workspace ({ws.max_bs} rows, {h_kv}x{geo.group} "
                         f"heads of {geo.head_dim})")
    if w_q.shape != (h_kv, geo.group, d, dg) or w_k.shape != (h_kv, 3 * d, dg):
        raise ValueError(f"gate weights {tuple(w_q.shape)} / {tuple(w_k.shape)} do not fit the geometry {geo}")
    if summaries.shape[1:] != (h_kv, geo.summary_width) or summaries.stride(-1) != 1 or k_buffer.stride(-1) != 1:
        raise ValueError(f"summaries must be [num_pages, H_kv, {geo.summary_width}] (n * Dg) and k_buffer "
                         f"[slots, H_kv, D], last axes contiguous; got {tuple(summaries.shape)}")
    for name, t in (("model_cos_sin", model_cos_sin), ("gate_cos_sin", gate_cos_sin), ("model_table", model_table),
                    ("gate_table", gate_table)):
        if t.dtype != torch.float32 or t.stride(-1) != 1:
            raise ValueError(f"{name} must be fp32 with a contiguous last axis")
    gq = ws.gate_q[:bs]
    if bs == 0:
        return gq
    packed, cscales = key_codes if key_codes is not None else (summaries, summaries)  # unread without CODES
    if key_codes is not None and (packed.shape[1:] != (h_kv, geo.block_size * d // 2) or packed.dtype != torch.uint8
                                  or cscales.shape[1:] != (h_kv, 2, d) or cscales.dtype != torch.float16
                                  or not (packed.is_contiguous() and cscales.is_contiguous())):
        raise ValueError(f"key codes {tuple(packed.shape)} / {tuple(cscales.shape)} do not fit [pages, {h_kv}, "
                         f"{geo.block_size * d // 2}] uint8 and [pages, {h_kv}, 2, {d}] float16, contiguous")
    kernels._front_kernel[(bs, h_kv, ws.uq + ws.uk)](
        q, model_cos_sin, gate_cos_sin, w_q, q_norm, gq,
        k_buffer, model_table, gate_table, w_k, k_norm, summaries, block_table, seq_lens,
        ws.front_partials_q, ws.front_partials_k, ws.front_counters, packed, cscales,
        q.stride(0), q.stride(1), model_cos_sin.stride(0), gate_cos_sin.stride(0),
        w_q.stride(0), w_q.stride(1), w_q.stride(2), w_q.stride(3),
        gq.stride(0), gq.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), model_table.stride(0), gate_table.stride(0),
        w_k.stride(0), w_k.stride(1), w_k.stride(2),
        summaries.stride(0), summaries.stride(1), block_table.stride(0),
        packed.stride(0), packed.stride(1), cscales.stride(0), cscales.stride(1),
        h_kv, geo.group, ws.uq, ws.uq_per_head, ws.uk, GATE_NORM_EPS, float(k_scale),
        HALF_D=d // 2, HALF_DG=dg // 2, QCHUNK=ws.qchunk, KCHUNK=ws.kchunk, BLOCK_HDG=_pow2(dg // 2),
        BLOCK_SIZE=geo.block_size, SUB=geo.sub_blocks, CODES=key_codes is not None,
        **ws.launch.kwargs(ws.launch.front_warps, 4),
    )
    return gq


def anchor_launch_args(anchors: Optional[torch.Tensor], anchor_rows: Optional[torch.Tensor], h_kv: int, bs: int,
                       placeholder: torch.Tensor) -> tuple:
    """(anchors, R, rows) as a kernel reading prompt anchors takes them (select here, `ops.rerank`): the pool `[rows,
    H_kv, R]` int32 checked, R, and the batch rows' pool rows (`placeholder`, never read, where absent)."""
    if anchors is None:
        return placeholder, 0, placeholder
    if anchors.shape[1] != h_kv or anchors.dtype != torch.int32 or anchors.stride(-1) != 1:
        raise ValueError(f"anchors must be [rows, H_kv, R] int32, got {tuple(anchors.shape)} {anchors.dtype}")
    if anchor_rows is None and anchors.shape[0] < bs:
        raise ValueError(f"anchors has {anchors.shape[0]} rows for a batch of {bs}")
    return anchors, anchors.shape[2], anchor_rows if anchor_rows is not None else placeholder


def select(ws: DecodeStepWorkspace, gate_q: torch.Tensor, summaries: torch.Tensor, block_table: torch.Tensor,
           num_candidates: torch.Tensor, max_blocks: int, sink_blocks: int = 0, local_blocks: int = 0,
           anchors: Optional[torch.Tensor] = None, anchor_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One launch: the K blocks of each (row, kv head), as `naive.select`.

    gate_q `[bs, H_kv, Dg]` fp32; summaries `[num_pages, H_kv, n * Dg]` (a block scores its best of the n =
    geometry.sub_blocks run summaries); block_table `[bs, >= max_blocks]` int;
    num_candidates `[bs]` int (complete blocks before the current one); max_blocks: the plan's width M
    (the grid follows it, never a row's length); anchors: optional `[rows, H_kv, R]` int32 (-1 none), row
    `anchor_rows[r]` for batch row r (`[bs]` int, e.g. the batch's req pool indices: the server's anchor
    pool is read in place), row r without anchor_rows.
    Forced sink / local blocks count inside K, then anchors, then blocks by score, ties to the lower
    index; a row with at most K candidates takes them all. Returns `ws.selected[:bs]` `[bs, H_kv, K]`
    int32 ascending, -1 padded.
    """
    from sas_backend.ops.fused_step import triton as kernels

    geo = ws.geo
    bs, h_kv, dg = gate_q.shape
    k = geo.top_k
    out = ws.selected[:bs]
    if max_blocks > ws.max_blocks:
        raise ValueError(f"width {max_blocks} exceeds the workspace's {ws.max_blocks} blocks")
    if summaries.shape[1:] != (h_kv, geo.summary_width) or summaries.stride(-1) != 1:
        raise ValueError(f"summaries must be [num_pages, H_kv, {geo.summary_width}] (n * Dg) with a contiguous last "
                         f"axis; got {tuple(summaries.shape)}")
    if bs == 0 or k == 0:
        return out
    anchors_t, r_count, rows_t = anchor_launch_args(anchors, anchor_rows, h_kv, bs, out)
    nc = ws.select_chunks(max_blocks, bs)
    m = max(int(max_blocks), 0)
    merge_tile = ws.merge_tile(max_blocks, bs)
    chunk, slots = ws.select_chunk(bs), ws.slots(bs)
    kernels._select_kernel[(bs, h_kv, nc)](
        gate_q, summaries, block_table, num_candidates, anchors_t, rows_t, out, ws.select_partials,
        ws.select_counters,
        gate_q.stride(0), gate_q.stride(1), summaries.stride(0), summaries.stride(1), block_table.stride(0),
        anchors_t.stride(0), anchors_t.stride(1), out.stride(0), out.stride(1),
        h_kv, m, k, slots, nc, anchor_rows is not None, min(max(sink_blocks, 0), m), min(max(local_blocks, 0), m),
        r_count,
        dg**-0.5,
        DG=dg, BLOCK_DG=_pow2(dg), DG_TILE=min(32, _pow2(dg)), BLOCK_SIZE=geo.block_size, SUB=geo.sub_blocks,
        CHUNK=chunk,
        SLOT_TILE=max(16, _pow2(slots)), MERGE_TILE=merge_tile, K_TILE=max(16, _pow2(k)),
        **ws.launch.kwargs(ws.launch.select_warps, ws.select_warps(max_blocks, bs)),
    )
    return out


def attend(ws: DecodeStepWorkspace, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
           selected: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
           out: Optional[torch.Tensor] = None, k_scale: float = 1.0, v_scale: float = 1.0, rank=None) -> torch.Tensor:
    """One launch: attention of each row's new token over its selected blocks and its current block.

    q `[bs, H_q, D]`; k_buffer `[slots, H_kv, D]`, v_buffer `[slots, H_kv, Dv]` (q's dtype, fp32, or fp8
    holding K / k_scale and V / v_scale: loaded as fp8 and converted to q's dtype exactly, k_scale folded into
    the softmax scale and v_scale applied to the output, as FlashInfer does); selected `[bs, H_kv, K]` int32
    ascending, -1 padded; block_table `[bs, >= cur + 1]` int (token o of block m at slot block_table[r, m] + o);
    seq_lens `[bs]` (the current block is attended up to the newest token).
    rank: an `ops.rerank.CandidateLse` (two levels, `ops.rerank.candidate_lse` launched just before on the same
    q and cache): the attend's programs choose the K blocks themselves, from the first level's X x K candidates'
    log-sum-exps by the rule of `ops.rerank.rerank_blocks`, and `selected` is written with them (an output).
    Returns `[bs, H_q, Dv]` in q's dtype (out if given): plain `softmax(q K^T * scale) V`.
    """
    from sas_backend.ops.fused_step import triton as kernels

    geo = ws.geo
    bs, h_q, d = q.shape
    h_kv, g = geo.num_kv_heads, geo.group
    dv = v_buffer.shape[-1]
    if bs > ws.max_bs or h_q != h_kv * g or selected.shape != (bs, h_kv, geo.top_k):
        raise ValueError(f"q {tuple(q.shape)} / selected {tuple(selected.shape)} do not fit the workspace")
    if q.stride(-1) != 1 or k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1:
        raise ValueError("q, k_buffer and v_buffer need a contiguous last axis")
    ranked = {}
    if rank is not None:
        ranked = _rank_args(rank, bs, h_kv, g, geo.top_k, selected)
    if out is None:
        out = torch.empty(bs, h_q, dv, dtype=q.dtype, device=q.device)
    if bs == 0:
        return out
    splits = ws.attend_splits(bs)
    tok = max(16, geo.block_size)
    # fp32 K/V: 64-token fp32 tiles spill (ptxas, D = 128); the interpreter has no registers, only per-op costs.
    wide = k_buffer.element_size() >= 4 and not _interpreting()
    # e5m2 K/V: its conversion to bf16 (through fp16) costs the one-split program a few registers more than its 128
    # (ptxas spilled 4 B at 4 warps, Triton 3.6, sm_90): 8 warps share the tiles.
    e5m2 = k_buffer.dtype == torch.float8_e5m2
    per = -(-(geo.top_k + 1) // splits)
    # unranked: never-read placeholders, the step's own fixed buffers (a captured graph replays fixed pointers)
    r_ = ranked or dict(lse=ws.attend_stats, first=selected, ncand=seq_lens, anchors=selected, rows=selected, C=0,
                        sink=0, local=0, R=0, consts={})
    kernels._attend_kernel[(bs, h_kv, splits)](
        q, k_buffer, v_buffer, selected, block_table, seq_lens, out,
        ws.attend_stats, ws.attend_partials, ws.attend_counters,
        r_["lse"], r_["first"], r_["ncand"], r_["anchors"], r_["rows"],
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        selected.stride(0), selected.stride(1), block_table.stride(0), out.stride(0), out.stride(1),
        r_["first"].stride(0), r_["first"].stride(1), r_["anchors"].stride(0), r_["anchors"].stride(1),
        h_kv, g, geo.top_k, splits, per, float(scale) * float(k_scale), float(v_scale),
        r_["C"], r_["sink"], r_["local"], r_["R"],
        D=d, DV=dv, BLOCK_SIZE=geo.block_size, TOK=tok, TOK_TILE=min(tok, 16) if wide else tok, GP=ws.gp,
        BLOCK_D=max(16, _pow2(d)), BLOCK_DV=ws.block_dv, SPLITS_P=max(2, _pow2(splits)),
        IEEE=q.dtype == torch.float32,
        DOT_F32=q.dtype == torch.bfloat16 and _interpreting(), ONE_SPLIT=splits == 1, **r_["consts"],
        **ws.launch.kwargs(ws.launch.attend_warps, _attend_warps(wide, e5m2, ranked)),
    )
    return out


def _attend_warps(wide: bool, e5m2: bool, ranked: dict) -> int:
    """The attend's default num_warps. ptxas (Triton 3.6, sm_90) spills at 4 warps where the tiles do not fit: fp32
    K/V tiles and e5m2's conversion (8 warps); ranking candidates (two levels) beside the attention's tiles, which at 4
    warps spilled 12 B (X = 2, fp8 K/V) to ~410 B (X = 4) a thread: 8 warps, and 16 over fp32 K/V (8 B at 8
    warps' 64 registers)."""
    if ranked:
        return 16 if wide else 8
    return 8 if wide or e5m2 else 4


def _rank_args(rank, bs: int, h_kv: int, g: int, k: int, selected: torch.Tensor) -> dict:
    """The attend's ranking arguments from an `ops.rerank.CandidateLse` (checked against the step's shapes)."""
    first = rank.first
    if first.dim() != 3 or first.shape[:2] != (bs, h_kv) or first.dtype != torch.int32 or first.stride(-1) != 1:
        raise ValueError(f"rank.first must be [{bs}, {h_kv}, C] int32 with a contiguous last axis, got "
                         f"{tuple(first.shape)} {first.dtype}")
    c = first.shape[2]
    if not k <= c <= rank.cp or rank.gp != max(16, _pow2(g)) or rank.lse.numel() < bs * h_kv * rank.cp * rank.gp:
        raise ValueError(f"rank: {c} candidates for K = {k} (K <= C <= CP = {rank.cp}), group {g} in GP = {rank.gp}, "
                         f"and log-sum-exps for {bs} x {h_kv} rows")
    anchors, r_count, rows = anchor_launch_args(rank.anchors, rank.anchor_rows, h_kv, bs, selected)
    return dict(cp=rank.cp, lse=rank.lse, first=first, ncand=rank.num_candidates, anchors=anchors, rows=rows, C=c,
                sink=rank.sink_blocks, local=rank.local_blocks, R=r_count,
                consts=dict(RANKED=True, CP=rank.cp, RT=16, K_TILE=max(16, _pow2(k)),
                            ANCHOR_ROWS=rank.anchor_rows is not None))


__all__ = ["DecodeStepWorkspace", "LaunchOptions", "StepGeometry", "attend", "default_sizes", "front", "select"]
