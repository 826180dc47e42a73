"""Tier 1: one decode step of a Qwen3-4B-shaped attention stack, dense FlashInfer vs the served SAS step.

No SGLang and no model: torch + Triton + FlashInfer, the package's op entry points
(`sas_backend.ops`), random K/V, random gates. Geometry of Qwen3-4B: 36 layers, 32 q / 8 kv
heads, head dim 128, gate dim 128, block 64, bf16 KV.

Per point (context, batch, budget), CUDA graphs on (each timed thing is one captured graph over
all layers, replayed; `triton.testing.do_bench` median, L2 flushed between replays):
- dense:  FlashInfer's paged decode (page 64, tensor cores) over the whole context, every layer;
- sas:    the step the server runs, `sas_backend.backend.decode_step.DecodeStep` over the world's slot table,
          planned as the backend plans a captured batch (persistent step buffers filled inside the graph):
          `NEW` (fused front / select / attend, three launches a layer) and `OLD` (the per-op kernels and
          FlashInfer's sparse decode, the first GPU run's step) at every budget, and at the middle budget the
          variants the measurement decides (`VARIANTS`: attention path, bf16 summaries, programs per launch,
          select chunk). Each timed twice: the block step, where every request's newest token completes a
          block (the front summarizes it), and the steady step, where none does (63 of 64 steps);
          `amortized` = (63 steady + 1 block) / 64, the per-token figure a server sees, `speedup` = dense /
          amortized;
- breakdown: each fused launch alone over all layers (its own graph), front in both kinds of step;
- chosen settings: the variant with the best geometric-mean speedup and the `--sas-dense-below` crossover,
  written as `chosen-settings.json` in the format of `sas_backend/backend/gpu_settings.json` (adopting the
  winner is copying that file; `docs/launch-budget.md` says what each launch is expected to cost);
- roofline: the bytes the attention step must read (dense: K and V of the whole context; sas:
  K and V of (K+1) blocks per kv head, every candidate's fp32 summary, the gate's query weights),
  its time at the device's peak bandwidth, and the achieved bandwidth.
Profile (issue 22's trace summary): one steady SAS step at the longest context, batch 1, the first budget, under
the torch profiler, eager and as a graph replay: its kernels (name, count, time), launches, the busy
time and the gaps between kernels on the device timeline, so the next optimisation can be planned
without a GPU (on CPU, the dry run: top-level torch ops stand in for kernels). In "profile".
Before timing, `--check` (default on) compares every compiled kernel of both steps with its torch reference
at these shapes (contexts up to 128K) and each captured step with the eager one: results in "checks".

K/V: the contexts and batches up to 256K x 8 do not fit 36 distinct layers; layers cycle over
`distinct_layers` buffer sets (as many as fit `--mem-fraction` of free memory, at least 2, so no
layer reads what the previous one left in L2). Recorded per point.

    python gpu_kit/bench_decode_step.py --out DIR            # full: 8K..256K, batch 1 8, budgets 1024 2048 4096
    python gpu_kit/bench_decode_step.py --quick --out DIR    # 8K 32K, batch 1 8, budget 2048
    python gpu_kit/bench_decode_step.py --dry-run --out DIR  # CPU: the same steps, tiny, fused kernels interpreted

The GPU session splits it (gpu_kit/run.py): `--checks-only --name kernel-checks` (every check, the served CUDA
configuration's included: `check_served`), `--variants core --points 8192x1 ...` (the new step vs dense and the
old one), `--variants tournament --name tournament` (the variants, chosen-settings.json). The world's slot table
is as wide as the server's (context + 4, SGLang's), so select gets the server's grid and merge tile.

Writes DIR/<name>.json, .md, .png (--name, default decode-step; the JSON and Markdown after every check, point and
variant) and DIR/chosen-settings.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

import torch

from sas_backend.testing.report import (
    env_markdown, environment, md_table, parse_points, pyplot, write_atomic, write_json_atomic,
)

BLOCK = 64
SLOT_PAD = 4  # SGLang's slot table (req_to_token) is context_length + 4 tokens wide
ANCHORS = 4  # prompt anchors per (request, kv head) of the Qwen gate's serve default


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Attention geometry of the stack; `params` only for the whole-model weight floor."""

    layers: int = 36
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    gate_dim: int = 128
    rope_theta: float = 1e6
    params: float = 4.02e9  # Qwen3-4B, bf16 weights read once per step by the real model

    @property
    def group(self) -> int:
        """G = H_q // H_kv, query heads per kv head."""
        return self.q_heads // self.kv_heads


QWEN3_4B = Geometry()
TINY = Geometry(layers=2, q_heads=4, kv_heads=2, head_dim=64, gate_dim=32, params=0)
# Peak HBM bandwidth (GB/s) by device name; `--peak-gbs` overrides.
PEAK_GBS = {"H200": 4800.0, "H100 NVL": 3900.0, "H100": 3350.0, "A100": 2039.0}


def peak_gbs(name: str) -> float | None:
    """The device's peak memory bandwidth from its name, or None if unknown."""
    for key, v in PEAK_GBS.items():
        if key in name:
            return v
    return None


# ----------------------------------------------------------------------------------- the world
class World:
    """One point's device state: paged KV per buffer set, block table, summaries, gates, RoPE rows.

    Request r owns `ctx // 64 (+1)` random pages; seq_len = ctx for every request, so each
    request's newest token completes a block (the summary update does real work: the block step);
    `seq_lens_steady` (ctx - 1) is what the summary update sees in a steady step (no block completes).
    The slot table is as wide as a server's whose context length is ctx (SGLang: context_length + 4), so the
    served step sizes its select grid and merge tile as that server does; `anchors` `[bs, H_kv, 4]` int32 is a
    prompt-anchor pool (random candidate blocks, some -1) as the Qwen gate's serve default reads.
    """

    def __init__(self, geo: Geometry, ctx: int, bs: int, distinct: int, device, seed: int = 0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.geo, self.ctx, self.bs, self.device = geo, ctx, bs, torch.device(device)
        self.distinct = distinct
        pages_per_req = ctx // BLOCK + 1
        self.num_pages = bs * pages_per_req + 1  # page 0: SGLang's padding page
        perm = torch.randperm(self.num_pages - 1, generator=g) + 1
        self.pages = perm[: bs * pages_per_req].view(bs, pages_per_req)  # [bs, blocks] physical page
        self.max_blocks = (ctx - 1) // BLOCK  # candidates of every request
        dev = self.device
        self.block_table = (self.pages[:, : self.max_blocks + 1] * BLOCK).long().to(dev)
        # SGLang's slot table for these requests (the decode step object reads its block table from it)
        offs = torch.arange(BLOCK, dtype=torch.int32)
        full = (self.pages.to(torch.int32)[:, :, None] * BLOCK + offs).reshape(bs, -1)
        self.req_to_token = full[:, : ctx + SLOT_PAD].contiguous().to(dev)
        self.req_pool_indices = torch.arange(bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.full((bs,), ctx, dtype=torch.int64, device=dev)
        self.seq_lens_cpu = torch.full((bs,), ctx, dtype=torch.int64)
        self.seq_lens_steady = self.seq_lens - 1
        self.num_candidates = torch.full((bs,), self.max_blocks, dtype=torch.int64, device=dev)
        # The summary pool's validity marks: every page summarized (the steady state of a served step)
        self.valid = torch.ones(self.num_pages, dtype=torch.bool, device=dev)
        slots = self.num_pages * BLOCK
        shape = (distinct, slots, geo.kv_heads, geo.head_dim)
        self.k = torch.randn(shape, dtype=torch.bfloat16, device=dev, generator=self._dev_gen(seed + 1))
        self.v = torch.randn(shape, dtype=torch.bfloat16, device=dev, generator=self._dev_gen(seed + 2))
        self.summaries = torch.randn(distinct, self.num_pages, geo.kv_heads, geo.gate_dim, device=dev,
                                     generator=self._dev_gen(seed + 3))
        self._summaries_bf16 = None
        self._kv_fp8 = {}  # fp8 dtype -> (K, V) of every buffer set rounded to it (scale 1), made on first use
        self._key_codes = None  # [(packed, scales)] a buffer set: 4-bit key codes, made on first use
        self._run_summaries = {}  # (sub_blocks, dtype) -> [distinct, pages, H_kv, sub_blocks * Dg], made on first use
        self._seed = seed
        from sas_backend.gate.module import AttnGate
        from sas_backend.ops.rope import rope_cos_sin_table

        self.gates = []
        for _ in range(geo.layers):
            gate = AttnGate(geo.kv_heads, geo.group, geo.head_dim, geo.gate_dim)
            gate.reset_parameters(g)
            self.gates.append(gate.to(dev).requires_grad_(False))
        self.model_table = rope_cos_sin_table(geo.head_dim, ctx + BLOCK, geo.rope_theta).to(dev)
        self.gate_table = rope_cos_sin_table(geo.gate_dim, ctx + BLOCK, geo.rope_theta).to(dev)
        pos = (self.seq_lens - 1).long()
        self.model_rows, self.gate_rows = self.model_table[pos], self.gate_table[pos]
        self.q = torch.randn(bs, geo.q_heads, geo.head_dim, generator=g).to(dev, torch.bfloat16)
        self.anchors = torch.randint(-1, max(self.max_blocks, 1), (bs, geo.kv_heads, ANCHORS), generator=g,
                                     dtype=torch.int32).to(dev)
        self.scale = geo.head_dim**-0.5

    def _dev_gen(self, seed):
        return torch.Generator(device=self.device).manual_seed(seed)

    def summaries_of(self, layer: int, dtype=torch.float32, sub_blocks: int = 1) -> torch.Tensor:
        """`[pages, H_kv, sub_blocks * Dg]` summary pool of the buffer set `layer` uses, fp32 or bf16 (sub-block
        pools: random, their own tensor per dtype, allocated when a variant first reads one)."""
        if sub_blocks > 1:
            key = (sub_blocks, dtype)
            if key not in self._run_summaries:
                shape = (self.distinct, self.num_pages, self.geo.kv_heads, sub_blocks * self.geo.gate_dim)
                self._run_summaries[key] = torch.randn(shape, device=self.device,
                                                       generator=self._dev_gen(self._seed + 4)).to(dtype)
            return self._run_summaries[key][layer % self.distinct]
        if dtype == torch.float32:
            return self.summaries[layer % self.distinct]
        if self._summaries_bf16 is None:
            self._summaries_bf16 = self.summaries.to(torch.bfloat16)
        return self._summaries_bf16[layer % self.distinct]

    def key_codes(self) -> dict:
        """`{layer: (packed, scales)}`: the 4-bit key codes (`ops.key_codes`) of every page of each layer's buffer
        set, encoded from its bf16 K on first use (one pair a buffer set, shared as the summaries are)."""
        if self._key_codes is None:
            from sas_backend.ops.key_codes import encode_pages

            sets = []
            for i in range(self.distinct):
                k = self.k[i]
                packed = torch.zeros(self.num_pages, k.shape[1], BLOCK * k.shape[2] // 2, dtype=torch.uint8,
                                     device=self.device)
                scales = torch.zeros(self.num_pages, k.shape[1], 2, k.shape[2], dtype=torch.float16, device=self.device)
                encode_pages(k, torch.arange(self.num_pages, device=self.device), BLOCK, packed, scales)
                sets.append((packed, scales))
            self._key_codes = sets
        return {layer: self._key_codes[layer % self.distinct] for layer in range(self.geo.layers)}

    def kv(self, layer: int, dtype=None):
        """`[slots, H_kv, D]` K and V of the buffer set `layer` uses: bf16, or (dtype an fp8 one) as an fp8 KV cache
        with scale 1 holds them (a copy of every set, made when a variant first reads one)."""
        i = layer % self.distinct
        if dtype is None or dtype == self.k.dtype:
            return self.k[i], self.v[i]
        if dtype not in self._kv_fp8:
            self._kv_fp8[dtype] = (self.k.to(dtype), self.v.to(dtype))
        k, v = self._kv_fp8[dtype]
        return k[i], v[i]

    @staticmethod
    def bytes_per_layer_set(geo: Geometry, ctx: int, bs: int) -> int:
        """Device bytes one buffer set takes (K, V, summaries)."""
        slots = bs * (ctx // BLOCK + 1) * BLOCK + BLOCK
        return slots * geo.kv_heads * (2 * geo.head_dim * 2 + geo.gate_dim * 4 // BLOCK)


# ----------------------------------------------------------------------------------- the steps
class LayerStack:
    """A decode step as `layer(i)` over the world's layers."""

    w: World

    def layer(self, layer: int) -> torch.Tensor:
        """One layer's attention output `[bs, H_q, D]`."""
        raise NotImplementedError

    def step(self):
        """All layers; returns the last layer's output."""
        out = None
        for lid in range(self.w.geo.layers):
            out = self.layer(lid)
        return out


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to run the served decode step (`sas_backend.backend.decode_step.DecodeStep`'s settings).

    launch: `ops.fused_step.LaunchOptions`' fields (pdl, front_warps, select_warps, attend_warps) as a sorted
    tuple of (name, value) pairs (hashable; empty: the defaults)."""

    name: str
    kernels: str = "triton"
    attention: str = "triton"
    summary_dtype: str = "fp32"
    gate_dtype: str = "fp32"
    target_programs: int | None = None
    chunk: int | None = None
    launch: tuple = ()
    anchors: bool = False  # select reads the world's prompt-anchor pool (World.anchors)
    sub_blocks: int = 1  # run summaries a block (--sas-sub-blocks): a quality setting, timed for its cost only
    kv: str = "bf16"  # the KV cache's dtype ("fp8_e4m3": --kv-cache-dtype fp8_e4m3, issue 66), timed for its cost only
    exact_rerank: int = 1  # --sas-exact-rerank X (issue 63's two levels), timed for its cost only
    rerank_keys: str = "kv"  # --sas-rerank-keys ("int4": the second level reads 4-bit key codes), cost only

    @property
    def kv_dtype(self):
        """The torch dtype of the K / V buffers this variant reads."""
        return {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}[self.kv]

    def launch_options(self):
        from sas_backend.ops.fused_step import LaunchOptions

        return LaunchOptions(**dict(self.launch)).check()

    def step_settings(self):
        """The `StepSettings` the served `DecodeStep` runs this variant with."""
        from sas_backend.backend.step_settings import StepSettings

        return StepSettings(self.kernels, self.attention, torch.bfloat16 if self.summary_dtype == "bf16" else
                            torch.float32, self.chunk, self.target_programs, source=self.name,
                            gate_dtype=torch.bfloat16 if self.gate_dtype == "bf16" else torch.float32,
                            launch=self.launch_options())

    def settings(self) -> dict:
        """The chosen-settings table's entry for this variant (`sas_backend/backend/gpu_settings.json`)."""
        return {"kernels": self.kernels, "attention": self.attention, "summary_dtype": self.summary_dtype,
                "gate_dtype": self.gate_dtype, "select_chunk": self.chunk, "target_programs": self.target_programs,
                "launch": dict(self.launch) or None}


# The old step (per-op kernels + FlashInfer: the first GPU run's) and the new one's variants the measurement
# decides between: attention path, summary and gate-weight dtypes, split sizes (programs per launch at batch 1),
# select chunk, PDL, per-launch warps.
OLD = Variant("old: per-op kernels + flashinfer", kernels="torch", attention="flashinfer")
NEW = Variant("new: fused, triton attend")
# The CUDA default shipped in sas_backend/backend/gpu_settings.json, with the Qwen gate's prompt anchors: checked
# (check_served) before anything is timed, never timed itself (its parts are the bf16 variants below).
SERVED = Variant("served: bf16 summaries + bf16 gate weights + anchors", summary_dtype="bf16", gate_dtype="bf16",
                 anchors=True)
VARIANTS = (
    NEW,
    Variant("new: fused, flashinfer attention", attention="flashinfer"),
    Variant("new: fused, bf16 summaries", summary_dtype="bf16"),
    Variant("new: fused, bf16 summaries + bf16 gate weights", summary_dtype="bf16", gate_dtype="bf16"),
    Variant("new: fused, 132 programs", target_programs=132),
    Variant("new: fused, 528 programs", target_programs=528),
    Variant("new: fused, select chunk 64", chunk=64),
    Variant("new: fused, select chunk 256", chunk=256),
    Variant("new: fused, select 8 warps", launch=(("select_warps", 8),)),
    Variant("new: fused, attend 8 warps", launch=(("attend_warps", 8),)),
    # Deferred: CUDA may refuse a PDL launch in a captured graph (the front follows StepBuffers.fill's copies).
    Variant("new: fused, PDL", launch=(("pdl", True),)),
)
# Variants whose failure might leave the device unusable (a refused PDL capture): timed after every other variant
# of every point (`run_deferred`), their errors caught and recorded with whether the device still works, so none
# of them can sink another variant.
DEFERRED = frozenset({"new: fused, PDL"})
# What a selector setting costs (not a speed variant: never "new", so `chosen_settings` never adopts one): the served
# configuration with one summary a block and with 4 sub-block summaries (issue 63's candidate), side by side at the
# middle budget of every point (`--variants costs`, or all); docs/launch-budget.md expects 1.1-1.5x at batch 1 and up
# to 2.2x at 256K batch 8.
COSTS = (
    dataclasses.replace(SERVED, name="cost: served, one summary a block"),
    dataclasses.replace(SERVED, name="cost: served, 4 sub-block summaries", sub_blocks=4),
    # An fp8 KV cache (issue 66): the attend and the block step's front read 1-byte K / V; docs/launch-budget.md
    # expects no gain at batch 1 and 1.3-1.6x at batch 8.
    dataclasses.replace(SERVED, name="cost: served, fp8 e4m3 KV", kv="fp8_e4m3"),
    # Two levels (issue 63, --sas-exact-rerank 2): select keeps 2 x K, one more launch reads their keys and leaves
    # its log-sum-exps, the attend ranks them (LaunchOptions.rank_in_attend, the default); docs/launch-budget.md
    # expects 1.2-1.5x over exact keys and 1.1-1.3x over 4-bit key codes (--sas-rerank-keys int4, written by the
    # front's block step), against 1.5-1.9x and 1.2-1.5x when the second level selects in its own launch.
    dataclasses.replace(SERVED, name="cost: served, exact rerank 2", exact_rerank=2),
    dataclasses.replace(SERVED, name="cost: served, exact rerank 2, 4-bit keys", exact_rerank=2, rerank_keys="int4"),
    dataclasses.replace(SERVED, name="cost: served, exact rerank 2, own select", exact_rerank=2,
                        launch=(("rank_in_attend", False),)),
    dataclasses.replace(SERVED, name="cost: served, exact rerank 2, 4-bit keys, own select", exact_rerank=2,
                        rerank_keys="int4", launch=(("rank_in_attend", False),)),
)


class ByLayer:
    """`[layer]` -> what `fn(layer)` gives: the world's shared buffer sets as the per-layer pools `DecodeStep`
    reads (summaries, prompt anchors); valid: the summary pool's validity marks `[num_pages]` bool (summaries);
    key_codes: `{layer: (packed, scales)}` 4-bit key codes (`--sas-rerank-keys int4`; {}: none)."""

    def __init__(self, fn, valid=None, key_codes=None):
        self.fn = fn
        self.valid = valid
        self.key_codes = key_codes or {}

    def __getitem__(self, layer: int):
        return self.fn(layer)


class ServedStep(LayerStack):
    """The decode step the server runs: a `DecodeStep` over the world's slot table, planned as the backend
    plans a captured batch (graph_bs = bs, persistent step buffers filled inside the graph) or an eager one.

    block_step: every request's newest token completes a block (the front summarizes it; 1 step in 64)
    rather than none (steady)."""

    def __init__(self, w: World, budget: int, graphs: bool, block_step: bool = True, variant: Variant = NEW):
        from sas_backend.backend.decode_step import DecodeStep
        from sas_backend.backend.rope_tables import FixedRopeTables
        from sas_backend.ops.fused_step import StepGeometry
        from sas_backend.selection import SelectionRule, make_selector

        geo = w.geo
        cuda = w.device.type == "cuda"
        if not cuda:  # the dry run: the interpreter for the fused kernels (no PDL there), torch for the rest
            variant = dataclasses.replace(variant, attention="torch" if variant.attention == "flashinfer"
                                          else variant.attention, launch=tuple(kv for kv in variant.launch
                                                                               if kv[0] != "pdl"))
        self.w, self.top_k, self.variant = w, budget // BLOCK, variant
        self.seq_lens = (w.seq_lens if block_step else w.seq_lens_steady).clone()
        self.positions = self.seq_lens - 1
        self.seq_lens_cpu = self.seq_lens.cpu()
        self.dtype = torch.bfloat16 if variant.summary_dtype == "bf16" else torch.float32
        self.step_obj = DecodeStep(
            make_selector("gate", SelectionRule(self.top_k, BLOCK, sub_blocks=variant.sub_blocks)),
            StepGeometry(geo.kv_heads, geo.group, geo.head_dim, geo.head_dim, geo.gate_dim, self.top_k, BLOCK,
                         variant.sub_blocks),
            w.req_to_token, w.device, torch.bfloat16, variant.kv_dtype, w.scale, variant.step_settings(),
            summaries=ByLayer(lambda layer: w.summaries_of(layer, self.dtype, variant.sub_blocks), valid=w.valid,
                              key_codes=w.key_codes() if variant.rerank_keys == "int4" else None),
            gates=w.gates, rope=FixedRopeTables(w.model_table, w.gate_table),
            anchors=ByLayer(lambda layer: w.anchors) if variant.anchors else None,
            repair_late=cuda,  # as a CUDA server runs it: the step lists its late blocks and repairs them
            exact_rerank=variant.exact_rerank,
        )
        self.graphs = graphs
        if graphs:
            self.step_obj.init_graph_state(w.bs, geo.head_dim, geo.gate_dim)
        self.plan = self.step_obj.plan(self.positions, self.seq_lens, w.req_pool_indices, self.seq_lens_cpu,
                                       graph_bs=w.bs if graphs else None)
        if graphs:
            self.step_obj.fill(self.plan)

    def layer(self, layer, update: bool = True):
        k, v = self.w.kv(layer, self.variant.kv_dtype)
        return self.step_obj.run(self.plan, layer, self.w.q, k, v, update=update)

    def step(self):
        if self.graphs:  # as in the server: the step's device state is recomputed inside the graph
            self.step_obj.fill(self.plan)
        # As the server: the late blocks (none in the steady state) of every layer before the layers; captured,
        # one IF node on the count
        self.step_obj.repair(self.plan, {lid: self.w.kv(lid, self.variant.kv_dtype)[0]
                                         for lid in range(self.w.geo.layers)})
        return super().step()

    def last_selected(self) -> torch.Tensor:
        """`[bs, H_kv, K]` the blocks the last layer of the last step selected."""
        return self.step_obj.last_selected

    # The breakdown: each fused launch alone over all layers (the new step), on the plan's step tensors.
    OPS = ("front", "select", "attend")

    def front(self, layer):
        from sas_backend.ops import fused_step as fused

        w, st = self.w, self.plan.step
        w_q, q_norm, w_k, k_norm = self.step_obj.front_weights(w.gates[layer])
        return fused.front(self.step_obj.fused_ws, w.q, st.model_cos_sin, st.gate_cos_sin, w_q, q_norm,
                           w.kv(layer)[0], w.model_table, w.gate_table, w_k, k_norm, w.summaries_of(layer, self.dtype),
                           st.block_table, st.seq_lens)

    def select(self, layer):
        from sas_backend.ops import fused_step as fused

        st = self.plan.step
        return fused.select(self.step_obj.fused_ws, self.step_obj.fused_ws.gate_q[: self.w.bs],
                            self.w.summaries_of(layer, self.dtype), st.block_table, st.num_candidates,
                            self.plan.max_blocks)

    def attend(self, layer):
        from sas_backend.ops import fused_step as fused

        st, (k, v) = self.plan.step, self.w.kv(layer)
        return fused.attend(self.step_obj.fused_ws, self.w.q, k, v, self.step_obj.fused_ws.selected[: self.w.bs],
                            st.block_table, st.seq_lens, self.w.scale)

    def op_over_layers(self, op):
        """A callable running one op for every layer (the breakdown)."""
        return lambda: [getattr(self, op)(lid) for lid in range(self.w.geo.layers)]


class BranchStep(LayerStack):
    """The steady served step and dense attention as two branches of one captured graph (conditional IF
    nodes, `sas_backend.backend.graph_branch`), as the backend captures `--sas-dense-below`: per layer the
    per-op summary update, then IF(sparse) the served sparse layer, IF(dense) FlashInfer's dense decode, each
    copying into one output buffer. `flags.set(True)` replays the sparse branch, `flags.set(False)` the
    dense one. Eagerly (CPU, warm-up) it runs the chosen branch, or both when `both` is set (before capture:
    everything a body launches must have run once)."""

    def __init__(self, w: World, budget: int, graphs: bool, variant: Variant = NEW):
        from sas_backend.backend.graph_branch import BranchFlags

        self.w = w
        self.sparse = ServedStep(w, budget, graphs, block_step=False, variant=variant)
        self.dense = DenseStep(w, graphs)
        self.flags = BranchFlags(w.device)
        self.flags.set(True)
        self.both = False
        self.out = torch.empty(w.bs, w.geo.q_heads, w.geo.head_dim, dtype=torch.bfloat16, device=w.device)

    def _sparse(self, layer):
        self.out.copy_(self.sparse.layer(layer, update=False))

    def _dense(self, layer):
        self.out.copy_(self.dense.layer(layer))

    def layer(self, layer):
        from sas_backend.backend.graph_branch import captured_if, capturing

        st, w = self.sparse, self.w
        st.step_obj.update_summaries(st.plan, layer, w.kv(layer, st.variant.kv_dtype)[0])
        if capturing():
            with captured_if(self.flags.first):
                self._sparse(layer)
            with captured_if(self.flags.second):
                self._dense(layer)
        else:
            if self.both or self.flags.value:
                self._sparse(layer)
            if self.both or not self.flags.value:
                self._dense(layer)
        return self.out

    def step(self):
        if self.sparse.graphs:
            self.sparse.step_obj.fill(self.sparse.plan)
        return super().step()

    def warm(self):
        """Run both branches once eagerly (the warm-up before capture)."""
        self.both = True
        try:
            self.step()
        finally:
            self.both = False


def all_blocks(w: World) -> torch.Tensor:
    """`[bs, H_kv, M]` int32: every candidate block selected (attention = dense)."""
    sel = torch.arange(w.max_blocks, dtype=torch.int32, device=w.device)
    return sel.expand(w.bs, w.geo.kv_heads, w.max_blocks).contiguous()


def reference_attention(w: World, layer: int, selected: torch.Tensor, seq_lens: torch.Tensor | None = None,
                        kv_dtype=None) -> torch.Tensor:
    """The torch oracle: plain SDPA over the selected blocks + the current block (all blocks = dense).
    seq_lens `[bs]`: the step's lengths (default the world's block step, every row at ctx); kv_dtype: the K / V the
    step read (`World.kv`; an fp8 cache's, dequantized exactly)."""
    from sas_backend.ops.gather.torch_path import build_kv_indices, kv_indptr_for
    from sas_backend.ops.sparse_decode.naive import sparse_decode_attention

    k, v = w.kv(layer, kv_dtype)
    seq_lens = w.seq_lens if seq_lens is None else seq_lens
    indptr = kv_indptr_for(seq_lens.cpu(), selected.shape[-1], BLOCK, w.geo.kv_heads).to(w.device)
    idx = torch.zeros(int(indptr[-1]), dtype=torch.int32, device=w.device)
    build_kv_indices(selected, w.block_table, seq_lens, BLOCK, indptr, idx)
    return sparse_decode_attention(w.q, k, v, indptr, idx, scale=w.scale)


class DenseStep(LayerStack):
    """Dense decode over the whole context in every layer: FlashInfer's paged decode (page = block)
    on CUDA; on CPU the torch oracle with every block selected (the dry run's stand-in)."""

    def __init__(self, w: World, graphs: bool):
        self.w = w
        geo = w.geo
        if w.device.type != "cuda":
            self.sel = all_blocks(w)
            return
        import flashinfer

        dev = w.device
        n = w.max_blocks + 1
        indptr = torch.arange(0, (w.bs + 1) * n, n, dtype=torch.int32)
        indices = w.pages[:, :n].reshape(-1).to(torch.int32)
        last = torch.full((w.bs,), w.ctx - w.max_blocks * BLOCK, dtype=torch.int32)
        self.workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
        kw = {}
        if graphs:
            kw = dict(use_cuda_graph=True, paged_kv_indptr_buffer=indptr.to(dev),
                      paged_kv_indices_buffer=indices.to(dev), paged_kv_last_page_len_buffer=last.to(dev))
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=geo.group >= 4, **kw)
        self.wrapper.plan(indptr, indices.to(dev), last, geo.q_heads, geo.kv_heads, geo.head_dim, BLOCK,
                          q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=w.scale)

    def layer(self, layer):
        """Dense attention of one layer `[bs, H_q, D]`."""
        w = self.w
        if w.device.type != "cuda":
            return reference_attention(w, layer, self.sel)
        k, v = w.kv(layer)
        shape = (-1, BLOCK, w.geo.kv_heads, w.geo.head_dim)
        return self.wrapper.run(w.q, (k.view(shape), v.view(shape)))



# ------------------------------------------------------------------------------------- timing
def time_ms(fn, graphs: bool, reps: int, outputs: dict | None = None, selected=None) -> float:
    """Median ms of fn: captured once in a CUDA graph and replayed (graphs), or called eagerly.
    On CPU: wall clock over `reps` calls. outputs: filled with copies of fn's result from its eager warm-up
    ("eager") and from the last timed replay or call ("last"), and of `selected()` (the step's last selection)
    as that replay left it ("selected"), for `check_variant`."""
    keep = outputs if outputs is not None else {}

    def last(res):
        if outputs is not None:
            keep["last"] = res.clone()
            if selected is not None:
                keep["selected"] = selected().clone()

    if not torch.cuda.is_available():
        res = fn()
        if outputs is not None:
            keep["eager"] = res.clone()
        t = time.perf_counter()
        for _ in range(reps):
            res = fn()
        ms = (time.perf_counter() - t) / reps * 1e3
        last(res)
        return ms
    from triton.testing import do_bench

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up off the default stream: compiles, autotunes, JIT
        fn()
        res = fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    if outputs is not None:
        keep["eager"] = res.clone()
    if not graphs:
        ms = do_bench(fn, warmup=5, rep=max(reps, 20), return_mode="median")
        last(fn())
        return ms
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = fn()
    graph.replay()
    torch.cuda.synchronize()
    ms = do_bench(graph.replay, warmup=5, rep=max(reps, 20), return_mode="median")
    torch.cuda.synchronize()
    last(res)  # the graph's buffers as the last timed replay left them (before the graph and its pool go)
    del graph
    return ms


def time_branches(br: BranchStep, reps: int) -> dict:
    """Median ms of one captured `BranchStep` graph replayed with the sparse branch on, then the dense
    one: {"sparse_ms", "dense_ms"}; {"unsupported": reason} where graphs cannot hold IF nodes.
    On CPU (no graphs): each branch eagerly, wall clock."""
    from sas_backend.backend.graph_branch import conditional_nodes_supported

    res = {}
    if not torch.cuda.is_available():
        for name, flag in (("sparse_ms", True), ("dense_ms", False)):
            br.flags.set(flag)
            res[name] = time_ms(br.step, graphs=False, reps=reps)
        return res
    if not conditional_nodes_supported():
        return {"unsupported": f"torch {torch.__version__} (CUDA {torch.version.cuda}) has no CUDA graph IF nodes"}
    from triton.testing import do_bench

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        br.warm()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        br.step()
    for name, flag in (("sparse_ms", True), ("dense_ms", False)):
        br.flags.set(flag)
        graph.replay()
        torch.cuda.synchronize()
        res[name] = do_bench(graph.replay, warmup=5, rep=max(reps, 20), return_mode="median")
    del graph
    return res


# ------------------------------------------------------------------------------------- profile
def timeline_summary(spans, top: int = 12) -> dict:
    """Summary of device work: `spans` = [(name, start_us, end_us)] of kernels (on CPU: top-level ops).
    Busy = union of the spans, gaps = span of the step - busy (the device idle between kernels)."""
    spans = sorted(spans, key=lambda x: x[1])
    if not spans:
        return {"kernels": 0}
    busy, cur_s, cur_e = 0.0, spans[0][1], spans[0][2]
    for _, s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, _, e in spans) - spans[0][1]
    by_name = {}
    for name, s, e in spans:
        n, t = by_name.get(name, (0, 0.0))
        by_name[name] = (n + 1, t + (e - s))
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels": len(spans), "distinct": len(by_name), "span_us": round(span, 1), "busy_us": round(busy, 1),
            "gaps_us": round(span - busy, 1),
            "top": [{"name": n[:120], "count": c, "total_us": round(t, 1)} for n, (c, t) in ranked]}


def profile_step(fn, graphs: bool) -> dict:
    """One call of `fn` (captured and replayed when `graphs`) under torch.profiler: the device kernels
    (CPU: top-level ops) summarized by `timeline_summary`, plus the CPU-side launch calls."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    target = fn
    if cuda:
        fn()
        torch.cuda.synchronize()
        if graphs:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            target = graph.replay
            target()
            torch.cuda.synchronize()
    else:
        fn()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        target()
        if cuda:
            torch.cuda.synchronize()
    events = list(prof.events())
    if cuda:
        spans = [(e.name, e.time_range.start, e.time_range.end) for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        spans = [(e.name, e.time_range.start, e.time_range.end) for e in events
                 if e.cpu_parent is None and not e.name.startswith("ProfilerStep")]
    launches = sum(1 for e in events if e.name.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch",
                                                            "cudaLaunchKernelExC")))
    return {**timeline_summary(spans), "launch_calls": launches, "graph_replay": bool(cuda and graphs)}


def profile_point(geo, ctx, bs, budget, args) -> dict:
    """The profile record of one steady served step (the new one's defaults), the typical one (no block completes;
    eager, and graph replay where CUDA graphs are on)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = World(geo, ctx, bs, distinct_sets(geo, ctx, bs, args.mem_fraction), dev)
    rec = {"context": ctx, "batch": bs, "budget": budget}
    st = ServedStep(w, budget, graphs=False, block_step=False)
    rec["eager"] = profile_step(st.step, graphs=False)
    del st
    if args.graphs:
        st = ServedStep(w, budget, graphs=True, block_step=False)
        rec["graph"] = profile_step(st.step, graphs=True)
        del st
    del w
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rec


def profile_markdown(p: dict) -> str:
    """The profile section of the summary."""
    lines = [f"## Profile of one steady SAS step: context {p['context']}, batch {p['batch']}, budget {p['budget']}", ""]
    for mode in ("eager", "graph"):
        r = p.get(mode)
        if not r or not r.get("kernels"):
            continue
        lines.append(f"- {mode}: {r['kernels']} kernels ({r['distinct']} distinct), {r['launch_calls']} launch calls; "
                     f"span {r['span_us']} us, busy {r['busy_us']} us, gaps {r['gaps_us']} us")
    for mode in ("graph", "eager"):
        r = p.get(mode)
        if r and r.get("top"):
            lines += ["", f"Top kernels ({mode}):", "",
                      md_table(["kernel", "count", "total us"],
                               [[t["name"], t["count"], t["total_us"]] for t in r["top"]])]
            break
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ roofline
def step_bytes(geo: Geometry, ctx: int, bs: int, budget: int | None) -> int:
    """Bytes the attention step of all layers must read (bf16 KV; None: dense)."""
    kv_token = geo.kv_heads * geo.head_dim * 2 * 2  # K and V, bf16
    cand = (ctx - 1) // BLOCK
    if budget is None:
        return geo.layers * bs * ctx * kv_token
    k = budget // BLOCK
    attended = min(k, cand) * BLOCK + (ctx - cand * BLOCK)
    summaries = cand * geo.kv_heads * geo.gate_dim * 4
    gate_w = geo.kv_heads * geo.group * geo.head_dim * geo.gate_dim * 4
    return geo.layers * (bs * (attended * kv_token + summaries) + gate_w)


# ------------------------------------------------------------------------------------- checks
def _err(a, b) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def check_point(w: World, budget: int, graphs: bool, branches: bool = False) -> list:
    """Every kernel of both steps vs its torch reference at this point, on layer 0 (fresh buffers), then each
    served step captured vs run eagerly (and, with `branches`, the IF-node graph's two branches vs the plain
    graphs). Returns [{"op", "max_abs_err", "tol", "ok"}]."""
    from sas_backend.ops import fused_step as fused
    from sas_backend.ops.fused_step import naive as fused_ref
    from sas_backend.ops.gate import gate_query_post_rope
    from sas_backend.ops.gate.naive import gate_query_post_rope as gq_ref
    from sas_backend.ops.score import score_blocks
    from sas_backend.ops.score.torch_path import score_blocks as score_ref
    from sas_backend.ops.summary import summarize_pages, update_summaries
    from sas_backend.ops.summary.torch_path import summarize_pages as pages_ref
    from sas_backend.ops.summary.naive import summary_update_decode as summary_ref
    from sas_backend.ops.topk import select_blocks
    from sas_backend.ops.topk.naive import select_blocks as topk_ref

    out = []

    def record(op, err, tol):
        out.append({"op": op, "context": w.ctx, "batch": w.bs, "budget": budget, "max_abs_err": err, "tol": tol,
                    "ok": bool(err <= tol)})

    k_top = budget // BLOCK
    gate = w.gates[0]
    wk, kn = gate.attngate_linear_k.weight, gate.attngate_knorm.weight
    before = w.summaries[0].clone()
    # --- the per-op kernels (the old step; still the extend path's and the training-free selectors')
    got = update_summaries(w.k[0], before.clone(), w.block_table, w.seq_lens, BLOCK, w.model_table, w.gate_table,
                           wk, kn)
    ref = summary_ref(w.k[0], before.clone(), w.block_table, w.seq_lens, BLOCK, w.model_table, w.gate_table, wk, kn)
    record("summary_update", _err(got, ref), 1e-3)
    n = min(512, w.max_blocks)
    args = (w.k[0], w.pages[0, :n].to(w.device), torch.arange(n, device=w.device) * BLOCK, w.model_table,
            w.gate_table, wk, kn, BLOCK)
    record("summarize_pages", _err(summarize_pages(*args), pages_ref(*args)), 1e-3)
    _check_late_repair(w, before, wk, kn, record)
    gq_args = (w.q, w.model_rows, gate.attngate_linear_q.weight, gate.attngate_qnorm.weight, w.gate_rows)
    gq = gate_query_post_rope(*gq_args)
    record("gate_query", _err(gq, gq_ref(*gq_args)), 1e-3)
    scores = score_blocks(gq, before, w.block_table, w.num_candidates, BLOCK, w.max_blocks)
    record("score", _err(scores, score_ref(gq, before, w.block_table, w.num_candidates, BLOCK, w.max_blocks)), 1e-3)
    sel = select_blocks(scores, w.num_candidates, k_top)
    record("topk (exact)", float((sel != topk_ref(scores, w.num_candidates, k_top)).sum()), 0.0)
    old = ServedStep(w, budget, graphs=False, variant=OLD)
    k0, v0 = w.kv(0)
    record("sparse_decode (per-op attention)",
           _err(old.step_obj.sparse_decode.run(w.q, k0, v0, sel, w.block_table, w.seq_lens),
                reference_attention(w, 0, sel)), 2e-2)
    del old
    dense = DenseStep(w, graphs=False).layer(0)
    record("dense_decode", _err(dense, reference_attention(w, 0, all_blocks(w))), 2e-2)
    # --- the fused kernels (the new step), on the same inputs
    new = ServedStep(w, budget, graphs=False, variant=NEW)
    ws = new.step_obj.fused_ws
    summ_fused, summ_ref = before.clone(), before.clone()
    gq_fused = fused.front(ws, w.q, w.model_rows, w.gate_rows, gate.attngate_linear_q.weight,
                           gate.attngate_qnorm.weight, w.k[0], w.model_table, w.gate_table, wk, kn, summ_fused,
                           w.block_table, w.seq_lens).clone()
    gq_want = fused_ref.front(w.q, w.model_rows, w.gate_rows, gate.attngate_linear_q.weight,
                              gate.attngate_qnorm.weight, w.k[0], w.model_table, w.gate_table, wk, kn, summ_ref,
                              w.block_table, w.seq_lens, BLOCK)
    record("fused front: gate query", _err(gq_fused, gq_want), 1e-3)
    record("fused front: summaries", _err(summ_fused, summ_ref), 1e-3)
    sel_fused = fused.select(ws, gq_fused, summ_ref, w.block_table, w.num_candidates, w.max_blocks).clone()
    ref_scores = fused_ref.scores(gq_fused, summ_ref, w.block_table, w.num_candidates, BLOCK, w.max_blocks)
    sel_want = topk_ref(ref_scores, w.num_candidates, k_top)
    record("fused select (blocks outside rounding ties)", _selection_misses(sel_fused, sel_want, ref_scores), 0.0)
    record("fused attend", _err(fused.attend(ws, w.q, k0, v0, sel_fused, w.block_table, w.seq_lens, w.scale),
                                reference_attention(w, 0, sel_fused)), 2e-2)
    del new
    if graphs and w.device.type == "cuda":
        # Each served step captured and replayed equals the same step run eagerly, bit for bit, and its
        # attention matches the oracle.
        for variant in (OLD, NEW):
            g_step = ServedStep(w, budget, graphs=True, variant=variant)
            w.summaries.copy_(before.expand_as(w.summaries))
            eager = g_step.step().clone()  # also the warm-up before capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                res = g_step.step()
            w.summaries.copy_(before.expand_as(w.summaries))
            graph.replay()
            torch.cuda.synchronize()
            tag = variant.name.split(":")[0]
            record(f"{tag} step: graph replay == eager step (exact)", _err(res, eager), 0.0)
            last = w.geo.layers - 1
            record(f"{tag} step: graph attention (last layer) vs oracle",
                   _err(res, reference_attention(w, last, g_step.step_obj.last_selected)), 2e-2)
            del graph, g_step
        w.summaries.copy_(before.expand_as(w.summaries))
        from sas_backend.backend.graph_branch import conditional_nodes_supported

        if branches and conditional_nodes_supported():
            # Both branches in one graph (IF nodes): each replay equals the plain steady step's graph,
            # or dense FlashInfer's, bit for bit (same kernels, same plans; the copy adds nothing).
            # A capture that fails is a failed check, not the end of the benchmark.
            try:
                _check_branches(w, budget, record)
            except Exception as e:  # noqa: BLE001 - reported in the record
                out.append({"op": "IF-node graph capture", "context": w.ctx, "batch": w.bs, "budget": budget,
                            "error": f"{type(e).__name__}: {e}"[:500], "ok": False})
                torch.cuda.synchronize()
    return out


def _check_late_repair(w: World, before: torch.Tensor, wk, kn, record) -> None:
    """The device-side validity marks (a PD decode server's transferred pages): every 7th block of each request
    unmarked; the step's late-block list against its plain statement, the repair of layer 0 against the host-count
    torch path; on CUDA the two captured in one graph, replayed on other marks (count and flag read on the device),
    equal to eager."""
    from sas_backend.ops.late_blocks import list_late_blocks
    from sas_backend.ops.late_blocks.naive import late_blocks
    from sas_backend.ops.summary import summarize_listed
    from sas_backend.ops.summary.torch_path import summarize_listed as listed_ref

    n = w.bs * w.max_blocks + 1
    pages, starts = (torch.zeros(n, dtype=torch.int64, device=w.device) for _ in range(2))
    count, total = (torch.zeros(1, dtype=torch.int64, device=w.device) for _ in range(2))
    flag = torch.zeros((), dtype=torch.bool, device=w.device)
    valid = torch.ones(w.num_pages, dtype=torch.bool, device=w.device)

    def repair(out):
        list_late_blocks(w.block_table, w.num_candidates, w.seq_lens, valid, BLOCK, pages, starts, count, flag, total)
        return summarize_listed(w.k[0], out, pages, starts, count, BLOCK, w.model_table, w.gate_table, wk, kn)

    def unmark(offset):
        valid.fill_(True)
        valid[w.pages[:, offset: w.max_blocks: 7].reshape(-1).to(w.device)] = False

    unmark(0)
    want_list, want_marks = late_blocks(w.block_table.cpu(), w.num_candidates.cpu(), w.seq_lens.cpu(), valid.cpu(),
                                        BLOCK)
    got = repair(before.clone())
    listed = set(zip(pages[: int(count)].tolist(), starts[: int(count)].tolist()))
    record("late-block list (vs the statement)", float(listed != set(want_list) or not torch.equal(
        valid.cpu(), want_marks | (torch.arange(w.num_pages) == 0) & valid.cpu())), 0.0)
    unmark(0)
    want = listed_ref(w.k[0], before.clone(), pages, starts, count, BLOCK, w.model_table, w.gate_table, wk, kn,
                      fixed_shapes=False)
    record("late repair (listed blocks)", _err(got, want), 1e-3)
    if w.device.type != "cuda":
        return
    out = before.clone()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        repair(out)
    worst = 0.0
    for offset in (3, 5):
        unmark(offset)
        out.copy_(before)
        graph.replay()
        unmark(offset)
        worst = max(worst, _err(out, repair(before.clone())))
    record("late repair: graph replay == eager (count on the device)", worst, 0.0)
    del graph


def _selection_misses(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor, tie: float = 1e-3) -> float:
    """Blocks one selection has and the other lacks whose reference scores differ by more than `tie` (the
    fused select scores with its own summation order, so exact ties of rounding may swap)."""
    misses = 0
    for r in range(got.shape[0]):
        for h in range(got.shape[1]):
            a, b = set(got[r, h].tolist()), set(want[r, h].tolist())
            for x, y in zip(sorted(a - b), sorted(b - a)):
                misses += abs(float(scores[r, h, x]) - float(scores[r, h, y])) > tie
    return float(misses)


def _check_branches(w: World, budget: int, record) -> None:
    """The IF-node graph's two branches against the plain graphs (see check_point)."""
    for name, step_cls in (("sparse", lambda: ServedStep(w, budget, graphs=True, block_step=False)),
                           ("dense", lambda: DenseStep(w, graphs=True))):
        plain = step_cls()
        plain.step()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            want = plain.step()
        g.replay()
        torch.cuda.synchronize()
        want = want.clone()
        del g, plain
        br = BranchStep(w, budget, graphs=True)
        br.warm()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got = br.step()
        br.flags.set(name == "dense")  # the other branch first: its output must be overwritten
        g.replay()
        br.flags.set(name == "sparse")
        g.replay()
        torch.cuda.synchronize()
        record(f"IF-node graph, {name} branch == plain {name} graph (exact)", _err(got, want), 0.0)
        del g, br


def check_served(w: World, budget: int, graphs: bool) -> list:
    """The served CUDA configuration (bf16 summaries, bf16 gate weights) with prompt anchors on and off, on layer 0
    and as a whole step: the fused front against the torch reference on the same bf16 weights and pool, the fused
    select against the reference selection with those anchors (blocks outside rounding ties), and the served step's
    last layer against the oracle over the blocks it selected; with graphs, its replay equals its eager step.
    Returns check rows as check_point's."""
    from sas_backend.ops import fused_step as fused
    from sas_backend.ops.fused_step import naive as fused_ref

    out = []

    def record(op, err, tol):
        out.append({"op": f"served: {op}", "context": w.ctx, "batch": w.bs, "budget": budget, "max_abs_err": err,
                    "tol": tol, "ok": bool(err <= tol)})

    k_top = budget // BLOCK
    st = ServedStep(w, budget, graphs=False, variant=SERVED)
    ws, gate = st.step_obj.fused_ws, w.gates[0]
    w_q, q_norm, w_k, k_norm = st.step_obj.front_weights(gate)  # the bf16 copies the server's front reads
    pool = w.summaries_of(0, torch.bfloat16)
    before = pool.clone()
    summ_fused, summ_ref = before.clone(), before.clone()
    gq = fused.front(ws, w.q, w.model_rows, w.gate_rows, w_q, q_norm, w.k[0], w.model_table, w.gate_table, w_k, k_norm,
                     summ_fused, w.block_table, w.seq_lens).clone()
    gq_want = fused_ref.front(w.q, w.model_rows, w.gate_rows, w_q, q_norm, w.k[0], w.model_table, w.gate_table, w_k,
                              k_norm, summ_ref, w.block_table, w.seq_lens, BLOCK)
    record("fused front, bf16 weights: gate query", _err(gq, gq_want), 1e-3)
    record("fused front, bf16 weights: bf16 summaries", _err(summ_fused, summ_ref), 1.6e-2)  # one bf16 ulp at 2
    for anchors in (None, w.anchors):
        tag = "anchors on" if anchors is not None else "anchors off"
        sel = fused.select(ws, gq, summ_ref, w.block_table, w.num_candidates, w.max_blocks, anchors=anchors).clone()
        scores = fused_ref.scores(gq, summ_ref, w.block_table, w.num_candidates, BLOCK, w.max_blocks, anchors)
        want = fused_ref.select(gq, summ_ref, w.block_table, w.num_candidates, BLOCK, w.max_blocks, k_top,
                                anchors=anchors)
        record(f"fused select, bf16 summaries, {tag} (blocks outside rounding ties)",
               _selection_misses(sel, want, scores), 0.0)
    del st
    for variant in (SERVED, dataclasses.replace(SERVED, anchors=False)):
        tag = "anchors on" if variant.anchors else "anchors off"
        step = ServedStep(w, budget, graphs=graphs and w.device.type == "cuda", variant=variant)
        eager = step.step().clone()
        last = w.geo.layers - 1
        record(f"step ({tag}): last layer vs oracle", _err(eager, reference_attention(w, last, step.last_selected())),
               2e-2)
        if step.graphs:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                res = step.step()
            graph.replay()
            torch.cuda.synchronize()
            record(f"step ({tag}): graph replay == eager step (exact)", _err(res, eager), 0.0)
            del graph
        del step
    return out


# ---------------------------------------------------------------------------------------- main
def distinct_sets(geo: Geometry, ctx: int, bs: int, mem_fraction: float) -> int:
    """Buffer sets that fit `mem_fraction` of free device memory (2 .. layers)."""
    if not torch.cuda.is_available():
        return min(geo.layers, 2)
    free = torch.cuda.mem_get_info()[0]
    per = World.bytes_per_layer_set(geo, ctx, bs)
    return max(2, min(geo.layers, int(free * mem_fraction // per)))


# A variant's last timed replay against its own eager step and against the oracle over the blocks it selected:
# bf16 outputs (one ulp near 1 is 2**-7), the tolerance of check_point's attention checks.
VARIANT_TOL = 2e-2
COUNTERS = ("front_counters", "select_counters", "attend_counters")


def check_variant(st: ServedStep, outputs: dict, tol: float = VARIANT_TOL) -> dict:
    """Whether a variant's timed replays computed the step: the last replay's output (the last layer's attention)
    equals the eager step's within `tol`, equals the torch oracle over the blocks that replay selected within
    `tol`, and every arrival counter of the fused workspace is back to zero (a merge that never ran, or ran twice,
    leaves one set). {"ok", "replay_vs_eager", "vs_oracle", "counters_set", "tol"}; ok False with "why" when an
    output is missing. Only a checked variant may win the tournament (`chosen_settings`)."""
    eager, last, selected = outputs.get("eager"), outputs.get("last"), outputs.get("selected")
    if eager is None or last is None or selected is None:
        return {"ok": False, "why": "no output of the timed step was kept", "tol": tol}
    w = st.w
    res = {"tol": tol, "replay_vs_eager": _err(last, eager),
           "vs_oracle": _err(last, reference_attention(w, w.geo.layers - 1, selected, st.seq_lens,
                                                       st.variant.kv_dtype))}
    ws = st.step_obj.fused_ws
    res["counters_set"] = {} if ws is None else {n: int((getattr(ws, n) != 0).sum()) for n in COUNTERS}
    res["ok"] = bool(max(res["replay_vs_eager"], res["vs_oracle"]) <= tol and not any(res["counters_set"].values()))
    return res


def time_variant(w: World, budget: int, variant: Variant, args, breakdown: bool = False) -> dict:
    """Block, steady and amortized ms of one served-step variant; with `breakdown`, each fused launch alone. Both
    steps are checked after their timed replays (`check_variant`): "check" {"block", "steady", "ok"}."""
    st = ServedStep(w, budget, args.graphs, block_step=True, variant=variant)
    # The settings as run (a CPU dry run drops what the interpreter cannot run: FlashInfer, PDL).
    outs = {}
    res = {"ms": time_ms(st.step, args.graphs, args.reps, outs, st.last_selected), "breakdown_ms": {},
           "settings": st.variant.settings()}
    res["check"] = {"block": check_variant(st, outs)}
    if breakdown and st.plan.fused:
        res["breakdown_ms"]["front_block"] = time_ms(st.op_over_layers("front"), args.graphs, args.reps)
    del st
    steady, outs = ServedStep(w, budget, args.graphs, block_step=False, variant=variant), {}
    res["steady_ms"] = time_ms(steady.step, args.graphs, args.reps, outs, steady.last_selected)
    res["check"]["steady"] = check_variant(steady, outs)
    res["check"]["ok"] = res["check"]["block"]["ok"] and res["check"]["steady"]["ok"]
    if breakdown and steady.plan.fused:
        for op in ServedStep.OPS:
            res["breakdown_ms"][op] = time_ms(steady.op_over_layers(op), args.graphs, args.reps)
    del steady
    res["amortized_ms"] = (63 * res["steady_ms"] + res["ms"]) / 64
    res["block_over_steady"] = res["ms"] / res["steady_ms"]
    return res


def device_ok() -> bool:
    """After a variant failed: whether the device still runs work (False: a sticky CUDA error; every later
    measurement of this process will fail, and the record says so)."""
    if not torch.cuda.is_available():
        return True
    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
        return True
    except Exception:  # noqa: BLE001 - the answer is the finding
        return False


def measure_variant(w: World, budget: int, variant: Variant, args, row: dict) -> dict:
    """`time_variant` into row["variants"][budget][name], with its speedup; an exception (a refused capture) is
    recorded as the variant's error, with whether the device still works, and ends nothing else."""
    try:
        timed = time_variant(w, budget, variant, args, breakdown=variant is NEW)
    except Exception as e:  # noqa: BLE001 - one variant failing (a refused PDL capture) must not lose the others
        timed = {"error": f"{type(e).__name__}: {e}"[:500], "device_ok_after": device_ok()}
        print(f"[step] {variant.name} at ctx {w.ctx} bs {w.bs} b{budget} failed: {timed['error']}", flush=True)
    if "error" not in timed:
        timed["speedup"] = row["dense_ms"] / timed["amortized_ms"]
    row["variants"].setdefault(str(budget), {})[variant.name] = timed
    return timed


def run_deferred(geo, rows: list, budgets, args, save=lambda: None) -> None:
    """The DEFERRED variants at every measured point's middle budget, after every other variant of every point."""
    middle = budgets[len(budgets) // 2]
    deferred = [v for v in VARIANTS if v.name in DEFERRED]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for row in rows:
        if str(middle) not in row.get("variants", {}):
            continue
        w = World(geo, row["context"], row["batch"], distinct_sets(geo, row["context"], row["batch"],
                                                                   args.mem_fraction), dev)
        for variant in deferred:
            measure_variant(w, middle, variant, args, row)
            save()
        del w


def run_point(geo, ctx, bs, budgets, args, checks: list, rows: list | None = None, save=lambda: None) -> dict:
    """Check (up to --check-max-context) and time one (context, batch) for dense and every budget. The row joins
    `rows` as soon as dense is timed and `save()` runs after every check and variant, so a step killed at its
    deadline (or ended by a sticky CUDA error) leaves everything measured before it in the record."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = World(geo, ctx, bs, distinct_sets(geo, ctx, bs, args.mem_fraction), dev)
    if args.check and ctx <= args.check_max_context:
        for b in budgets:
            checks.extend(check_point(w, b, args.graphs, branches=b == budgets[len(budgets) // 2]))
            save()
        checks.extend(check_served(w, budgets[len(budgets) // 2], args.graphs))
        save()
    if args.checks_only:
        del w
        return {"context": ctx, "batch": bs, "sas": {}, "variants": {}, "complete": True}
    dense = DenseStep(w, args.graphs)
    row = {"context": ctx, "batch": bs, "distinct_layers": w.distinct,
           "dense_ms": time_ms(dense.step, args.graphs, args.reps), "dense_bytes": step_bytes(geo, ctx, bs, None),
           "sas": {}, "variants": {}, "complete": False}
    del dense
    if rows is not None:
        rows.append(row)
    save()
    middle = budgets[len(budgets) // 2]
    for b in budgets:
        # The old step and the new one at every budget; the variants the tournament decides at the middle one.
        tournament = [v for v in VARIANTS[1:] if v.name not in DEFERRED] if b == middle and args.variants != "core" \
            else []
        costs = list(COSTS) if b == middle and args.variants in ("costs", "all") else []
        variants = [NEW] + ([OLD] if args.variants in ("core", "all") else []) + tournament + costs
        row["variants"][str(b)] = {}
        for variant in variants:
            measure_variant(w, b, variant, args, row)
            save()
        res = dict(row["variants"][str(b)][NEW.name])
        res["bytes"] = step_bytes(geo, ctx, bs, b)
        if "error" not in res:
            res["speedup_block_step"] = row["dense_ms"] / res["ms"]
            old = row["variants"][str(b)].get(OLD.name, {"error": "not run"})
            res["vs_old"] = old["amortized_ms"] / res["amortized_ms"] if "error" not in old else None
        res["roofline_speedup"] = row["dense_bytes"] / res["bytes"]
        if b == middle and args.branches:  # the branch cost of --sas-dense-below
            try:
                br = BranchStep(w, b, args.graphs)
                res["branch"] = time_branches(br, args.reps)
                del br
            except Exception as e:  # noqa: BLE001 - the plain timings above still count
                res["branch"] = {"error": f"{type(e).__name__}: {e}"[:500]}
                print(f"[step] IF-node branch timing failed: {res['branch']['error']}", flush=True)
        row["sas"][str(b)] = res
        save()
    peak = args.peak_gbs
    if peak:
        row["dense_roofline_ms"] = row["dense_bytes"] / peak / 1e6
        row["dense_achieved_gbs"] = row["dense_bytes"] / row["dense_ms"] / 1e6
        for res in row["sas"].values():
            if "error" in res:
                continue
            res["roofline_ms"] = res["bytes"] / peak / 1e6
            res["achieved_gbs"] = res["bytes"] / res["amortized_ms"] / 1e6
    row["complete"] = True
    save()
    del w
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def branch_costs(record: dict) -> dict:
    """{(context, batch): {"if_dense_ms", "if_sparse_over_steady"}} of the IF-node timings in `record` at its middle
    budget (the decode-step record's; a tournament runs without them): the branched graph's dense replay, and its
    sparse replay over the plain steady step's (what the IF nodes add to the sparse side)."""
    budget = str(record["budgets"][len(record["budgets"]) // 2])
    out = {}
    for r in record.get("rows", []):
        s = r.get("sas", {}).get(budget) or {}
        br = s.get("branch") or {}
        if br.get("dense_ms") and br.get("sparse_ms") and s.get("steady_ms"):
            out[(r["context"], r["batch"])] = {"if_dense_ms": br["dense_ms"],
                                               "if_sparse_over_steady": br["sparse_ms"] / s["steady_ms"]}
    return out


def decide_dense_below(points: list) -> dict:
    """`--sas-dense-below` from measured points, each {"context", "batch", "dense_ms", "sparse_ms", "if_dense_ms",
    "if_sparse_ms"} (ms per step; sparse: the chosen variant's amortized step; if_*: the same step in the branched
    graph, dense and sparse replays, None where not measured).

    The server sends a step dense when its requests hold at most T tokens in all (context x batch), so one
    threshold must serve every (context, batch): T = 0 runs the plain sparse graph (no IF nodes) at every point; T > 0
    runs the branched graph everywhere and pays its own cost (if_dense at or below T, if_sparse above). Candidates
    are 0 and each point's tokens (all points' branches measured); the one with the least geometric-mean step time
    over the points wins (ties: the smaller). Per point the record says which side the branched graph runs faster
    and which one T gives it. {"dense_below", "geomean_ms": {T: ms}, "points": [...]}."""
    import math

    if not points:
        return {"dense_below": 0, "geomean_ms": {}, "points": []}
    tokens = [p["context"] * p["batch"] for p in points]
    cands = {0: [p["sparse_ms"] for p in points]}
    if all(p.get("if_dense_ms") and p.get("if_sparse_ms") for p in points):
        for t in sorted(set(tokens)):
            cands[t] = [p["if_dense_ms"] if n <= t else p["if_sparse_ms"] for p, n in zip(points, tokens)]
    geo = {t: math.exp(sum(math.log(x) for x in xs) / len(xs)) for t, xs in cands.items()}
    best = min(geo, key=lambda t: (geo[t], t))
    rows = []
    for p, n, ms in zip(points, tokens, cands[best]):
        faster = None if not p.get("if_dense_ms") else "dense" if p["if_dense_ms"] < p["if_sparse_ms"] else "sparse"
        rows.append({"context": p["context"], "batch": p["batch"], "tokens": n, "faster_branched": faster,
                     "runs": "dense" if best and n <= best else "sparse", "ms": ms,
                     "plain_sparse_ms": p["sparse_ms"], "plain_dense_ms": p["dense_ms"]})
    return {"dense_below": best, "geomean_ms": {str(t): v for t, v in geo.items()}, "points": rows}


def decide_select_chunk(record: dict, budget: str) -> dict:
    """The select chunk per batch size (issue 64 item 6), from the chunk variants of `record` at `budget`: NEW
    (the default chunk for K = budget / 64) and each "select chunk N" variant differ only in the chunk, so at each
    batch size of the points the one with the best geometric-mean speedup over that batch size's points wins, where
    it ran and passed its check at every one of them. A batch size takes its chunk from the nearest measured batch
    size at or below it ({min_bs: chunk}; the smallest measured covers everything below).
    {"rule": None (the default everywhere) | chunk (one for all) | {"bs": chunk}, "per_batch": {bs: {...}}}."""
    import math

    from sas_backend.ops.fused_step import default_select_chunk

    chunks = {NEW.name: default_select_chunk(int(budget) // BLOCK)}
    chunks.update({v.name: v.chunk for v in VARIANTS if v.chunk and v.settings() == dataclasses.replace(
        NEW, chunk=v.chunk).settings()})
    per_batch = {}
    for bs in sorted({r["batch"] for r in record["rows"]}):
        rows = [r for r in record["rows"] if r["batch"] == bs]
        logs = {}
        for name, chunk in chunks.items():
            vals = [r.get("variants", {}).get(budget, {}).get(name) or {} for r in rows]
            if all("error" not in v and (v.get("check") or {}).get("ok") is True and v.get("speedup") for v in vals):
                logs[chunk] = sum(math.log(v["speedup"]) for v in vals) / len(vals)
        if logs:
            best = max(logs, key=lambda c: (logs[c], c == chunks[NEW.name]))
            per_batch[bs] = {"chunk": best, "geomean_speedup": {str(c): math.exp(x) for c, x in logs.items()}}
    picks = {bs: d["chunk"] for bs, d in per_batch.items()}
    if not picks or set(picks.values()) == {chunks[NEW.name]}:
        rule = None
    elif len(set(picks.values())) == 1:
        rule = next(iter(picks.values()))
    else:
        ordered = sorted(picks)
        rule = {"1" if bs == ordered[0] else str(bs): c for bs, c in picks.items()}
    return {"rule": rule, "per_batch": {str(bs): d for bs, d in per_batch.items()}}


def chosen_settings(record: dict, device_key: str, branches: dict | None = None) -> dict:
    """The settings table the backend reads at startup, from this run: the new-step variant with the best
    geometric-mean speedup over every (context, batch) at the middle budget, and `dense_below` decided per (context,
    batch) from the points with the branched mode's own cost (`decide_dense_below`; branches: `branch_costs` of the
    record that timed the IF nodes, default this one's; without them 0: a branched graph nobody timed is not adopted).
    A variant competes only where it ran and passed its check (`check_variant`) at every point: failed, errored or
    unchecked never win."""
    import math

    budget = str(record["budgets"][len(record["budgets"]) // 2])
    scores = {}
    for r in record["rows"]:
        for name, v in r.get("variants", {}).get(budget, {}).items():
            if name.startswith("new") and "error" not in v and (v.get("check") or {}).get("ok") is True:
                scores.setdefault(name, []).append(math.log(v["speedup"]))
    complete = {n: sum(x) / len(x) for n, x in scores.items() if len(x) == len(record["rows"])}
    if not complete:
        return {}
    best = max(complete, key=complete.get)
    as_run = record["rows"][0]["variants"][budget][best].get("settings")
    settings = dict(as_run or next(v for v in VARIANTS if v.name == best).settings())
    chunk = decide_select_chunk(record, budget)
    if settings.get("select_chunk") is None or chunk["rule"] is not None:
        # The chunk variants differ from NEW in the chunk alone; their per-batch-size winner joins the best variant
        # (whose own chunk is the default, or a chunk variant's that the rule measured against the others).
        settings["select_chunk"] = chunk["rule"]
    branches = branch_costs(record) if branches is None else branches
    points = []
    for r in record["rows"]:
        v, br = r["variants"][budget][best], branches.get((r["context"], r["batch"]), {})
        points.append({"context": r["context"], "batch": r["batch"], "dense_ms": r["dense_ms"],
                       "sparse_ms": v["amortized_ms"], "if_dense_ms": br.get("if_dense_ms"),
                       "if_sparse_ms": v["amortized_ms"] * br["if_sparse_over_steady"] if br else None})
    decision = decide_dense_below(points)
    entry = {**settings, "dense_below": decision["dense_below"]}
    measured = record["mode"] != "dry run"
    return {"measured": measured, "source": f"gpu_kit/bench_decode_step.py on {record['environment'].get('device')}, "
                                        f"budget {budget}, variant {best!r} (geometric-mean speedup "
                                        f"{math.exp(complete[best]):.2f}x over {len(record['rows'])} points)",
            "dense_below_decision": decision, "select_chunk_decision": chunk,
            "devices": {device_key: entry, "default": entry}}


def markdown(record: dict) -> str:
    """The summary: checks, then one table row per (context, batch, budget)."""
    bad = [c for c in record["checks"] if not c["ok"]]
    lines = [f"# Decode step, {record['geometry_name']}: dense FlashInfer vs SAS ({record['mode']})", "",
             env_markdown(record["environment"]), "",
             f"- graphs: {record['graphs']}; peak bandwidth used for the roofline: {record['peak_gbs']} GB/s; "
             f"whole-model weight floor {record['weights_floor_ms']} ms/step (not in the times below)",
             f"- checks vs torch references: {len(record['checks']) - len(bad)}/{len(record['checks'])} ok"
             + ("" if not bad else "; FAILED: " + ", ".join(f"{c['op']}@{c['context']}x{c['batch']}" for c in bad))]
    if not record.get("complete", True):
        done = sum(r.get("complete", True) for r in record["rows"])
        lines.append(f"- **partial record** (written as measured; the run ended or was killed after {done} complete "
                     f"point(s), {record.get('wall_s')} s)")
    lines.append("")
    head = ["context", "batch", "budget", "dense ms", "new steady ms", "new block ms", "new amortized ms", "speedup",
            "x old", "block/steady", "steady us/layer", "roofline x", "dense GB/s", "sas GB/s", "front", "front block",
            "select", "attend"]
    layers = record["geometry"]["layers"]
    rows = []
    for r in record["rows"]:
        for b, s in r["sas"].items():
            if "error" in s:
                rows.append([r["context"], r["batch"], int(b), r["dense_ms"], f"failed: {s['error'][:60]}"]
                            + ["-"] * 13)
                continue
            bd = s["breakdown_ms"]
            rows.append([r["context"], r["batch"], int(b), r["dense_ms"], s["steady_ms"], s["ms"], s["amortized_ms"],
                         s["speedup"], s.get("vs_old") or "-", s["block_over_steady"], s["steady_ms"] * 1e3 / layers,
                         s["roofline_speedup"], r.get("dense_achieved_gbs", "-"), s.get("achieved_gbs", "-"),
                         *[bd.get(k, "-") for k in ("front", "front_block", "select", "attend")]])
    lines.append(md_table(head, rows))
    lines.append("")
    lines.append("The new step (fused front / select / attend, the server's `DecodeStep`); times are ms for all "
                 "layers of one step (front / select / attend: that launch alone over all layers, steady step). "
                 "block: every "
                 "request's newest token completes a block (1 step in 64); steady: none does; amortized = (63 steady + "
                 "1 block) / 64; speedup = dense / amortized; x old = the old step's amortized ms / the new one's.")
    vrows = []
    for r in record["rows"]:
        for b, vs in r.get("variants", {}).items():
            for name, v in vs.items():
                if "error" in v:
                    vrows.append([name, r["context"], r["batch"], int(b), f"failed: {v['error'][:60]}", "-", "-", "-",
                                  "not run"])
                else:
                    vrows.append([name, r["context"], r["batch"], int(b), v["steady_ms"], v["ms"], v["amortized_ms"],
                                  v["speedup"], check_cell(v.get("check"))])
    if vrows:
        lines += ["", "## Every variant (the tournament)", "",
                  md_table(["variant", "context", "batch", "budget", "steady ms", "block ms", "amortized ms",
                            "speedup", "checked"], vrows), "",
                  f"checked: the last timed replay of the block and the steady step vs the eager step and the oracle "
                  f"(tolerance {VARIANT_TOL}), every workspace counter zero after it; only variants ok at every point "
                  f"compete."]
    chosen = record.get("chosen_settings")
    if chosen:
        lines += ["", "## Chosen settings (`chosen-settings.json`, "
                  "the format of `sas_backend/backend/gpu_settings.json`)",
                  "", "```json", json.dumps(chosen, indent=2), "```"]
    lines += branch_markdown(record)
    if record.get("profile"):
        lines += ["", profile_markdown(record["profile"])]
    return "\n".join(lines) + "\n"


def check_cell(check: dict | None) -> str:
    """A variant's check in the tournament table: ok, FAILED (with its largest error), or unchecked."""
    if not check:
        return "unchecked"
    if check.get("ok"):
        return "ok"
    parts = [check.get(k) or {} for k in ("block", "steady")]
    worst = max((p.get(k, 0) for p in parts for k in ("replay_vs_eager", "vs_oracle")), default=0)
    counters = sum(n for p in parts for n in (p.get("counters_set") or {}).values())
    return f"FAILED (err {worst:.3g}, {counters} counters set)"


def branch_markdown(record: dict) -> list:
    """The IF-node table: what choosing dense or sparse per replay costs on either side."""
    rows, notes = [], set()
    for r in record["rows"]:
        for b, s in r["sas"].items():
            br = s.get("branch")
            if not br or "error" in s:
                continue
            if "unsupported" in br or "error" in br:
                notes.add(br.get("unsupported") or f"failed: {br['error']}")
                continue
            rows.append([r["context"], r["batch"], int(b), r["dense_ms"], br["dense_ms"],
                         br["dense_ms"] / r["dense_ms"], s["steady_ms"], br["sparse_ms"],
                         br["sparse_ms"] / s["steady_ms"]])
    if not rows and not notes:
        return []
    out = ["", "## Dense or sparse per replay: both branches in one graph (IF nodes), steady step", ""]
    if rows:
        out += [md_table(["context", "batch", "budget", "dense ms", "IF dense ms", "x dense", "sas steady ms",
                          "IF sparse ms", "x steady"], rows), "",
                "IF dense / IF sparse: one captured graph per point holding both branches per layer (summary "
                "update, then IF(sparse) the selector + sparse decode, IF(dense) dense FlashInfer, each copied into "
                "one buffer), replayed with each flag; x: against the plain graph of that branch alone."]
    out += [f"- not timed: {n}" for n in sorted(notes)]
    return out


def plot(record: dict, path: pathlib.Path) -> bool:
    """Step time vs context per batch (dense, sas per budget, roofline dotted). False without matplotlib."""
    plt = pyplot()
    if plt is None or not record["rows"]:
        return False
    batches = sorted({r["batch"] for r in record["rows"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4), squeeze=False)
    for ax, bs in zip(axes[0], batches):
        rs = sorted((r for r in record["rows"] if r["batch"] == bs), key=lambda r: r["context"])
        x = [r["context"] for r in rs]
        ax.plot(x, [r["dense_ms"] for r in rs], "o-", color="k", label="dense FlashInfer")
        if "dense_roofline_ms" in rs[0]:
            ax.plot(x, [r["dense_roofline_ms"] for r in rs], "k:", label="dense roofline")
        for i, b in enumerate(record["budgets"]):
            ax.plot(x, [r["sas"][str(b)].get("amortized_ms", float("nan")) for r in rs], "s-", color=f"C{i}",
                    label=f"sas budget {b} (amortized)")
            if "roofline_ms" in rs[0]["sas"][str(b)]:
                ax.plot(x, [r["sas"][str(b)]["roofline_ms"] for r in rs], ":", color=f"C{i}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(f"attention ms per step ({record['geometry']['layers']} layers)")
        ax.set_title(f"batch {bs}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    env = record["environment"]
    fig.suptitle(f"{record['geometry_name']} decode step, {env['device']}, {record['mode']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    """CLI (see the module doc); exit 1 if a check failed, 2 without CUDA and --dry-run."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", help="default 8K 32K 128K 256K (dry run: 1024)")
    ap.add_argument("--batches", type=int, nargs="+", help="default 1 8 (dry run: 1)")
    ap.add_argument("--budgets", type=int, nargs="+", help="default 1024 2048 4096 (dry run: 256)")
    ap.add_argument("--layers", type=int, default=QWEN3_4B.layers)
    ap.add_argument("--reps", type=int, default=50, help="do_bench rep time in ms (CPU: calls)")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false", help="time eagerly instead")
    ap.add_argument("--no-check", dest="check", action="store_false")
    ap.add_argument("--check-max-context", type=int, default=131072)
    ap.add_argument("--mem-fraction", type=float, default=0.4, help="of free memory for the K/V buffer sets")
    ap.add_argument("--peak-gbs", type=float, default=None, help="peak HBM GB/s (default: from the device name)")
    ap.add_argument("--quick", action="store_true", help="8K and 32K, batch 1 and 8, budget 2048, no tournament")
    ap.add_argument("--points", nargs="+", metavar="CTXxBS",
                    help="(context, batch) points instead of every context x batch, e.g. 8192x1 32768x8")
    ap.add_argument("--variants", choices=("all", "core", "tournament", "costs"), default=None,
                    help="core: the new and the old step; tournament: the new one and its variants at the middle "
                    "budget; costs: the new one and what a selector setting costs (COSTS: the served step with 1 "
                    "and 4 sub-block summaries) at the middle budget; all (default; --quick: core): every one")
    ap.add_argument("--checks-only", action="store_true",
                    help="only the checks (every kernel vs its reference, the served configuration), nothing timed")
    ap.add_argument("--no-branches", dest="branches", action="store_false",
                    help="skip the IF-node branch timing at the middle budget")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="skip the profiler trace summary of one SAS step")
    ap.add_argument("--dry-run", action="store_true",
                    help="no CUDA needed: a tiny geometry through the torch paths (proves the plumbing only)")
    ap.add_argument("--out", default="bench/out/gpu")
    ap.add_argument("--name", default="decode-step", help="stem of the files written under --out")
    ap.add_argument("--branches-from", help="a decode-step JSON whose IF-node timings decide dense_below (the "
                    "tournament runs without them)")
    args = ap.parse_args(argv)
    geo, name = dataclasses.replace(QWEN3_4B, layers=args.layers), "Qwen3-4B shape"
    mode = "full"
    given = {k: getattr(args, k) for k in ("contexts", "batches", "budgets")}  # given sizes win in every mode
    args.contexts, args.batches, args.budgets = [8192, 32768, 131072, 262144], [1, 8], [1024, 2048, 4096]
    if args.quick:
        args.contexts, args.budgets, mode = [8192, 32768], [2048], "quick"
    if args.dry_run:
        geo, name, mode = TINY, "tiny (dry run)", "dry run"
        if not torch.cuda.is_available():  # the fused kernels in Triton's interpreter (before they are imported)
            os.environ["TRITON_INTERPRET"] = "1"
        # one point, one call per timing: the interpreter runs the fused kernels one program at a time
        args.contexts, args.batches, args.budgets, args.reps = [1024], [1], [256], 1
    elif not torch.cuda.is_available():
        print("bench_decode_step: needs a CUDA GPU (FlashInfer, compiled Triton, CUDA graphs); "
              "--dry-run rehearses the plumbing on CPU.")
        return 2
    for k, v in given.items():
        if v:
            setattr(args, k, v)
    args.variants = args.variants or ("core" if args.quick else "all")
    points = [(c, b) for c in args.contexts for b in args.batches]
    if args.points:
        try:
            points = parse_points(args.points)
        except ValueError:
            ap.error(f"--points takes CONTEXTxBATCH, got {args.points}")
        args.contexts = sorted({c for c, _ in points})
    if args.checks_only:
        args.check, args.profile = True, False
    args.graphs = args.graphs and torch.cuda.is_available()  # CPU: nothing to capture
    if args.peak_gbs is None and torch.cuda.is_available():
        args.peak_gbs = peak_gbs(torch.cuda.get_device_name())
    for b in args.budgets:
        if b % BLOCK:
            ap.error(f"budget {b} is not a multiple of {BLOCK}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    env = environment()
    checks, rows = [], []
    record = {
        "what": "attention part of one decode step over all layers: dense FlashInfer vs the full SAS step",
        "profile": None,
        "mode": mode, "geometry_name": name, "geometry": dataclasses.asdict(geo), "graphs": args.graphs,
        "budgets": args.budgets, "points": [list(p) for p in points], "variants": args.variants,
        "checks_only": args.checks_only, "peak_gbs": args.peak_gbs,
        "weights_floor_ms": round(geo.params * 2 / args.peak_gbs / 1e6, 3) if args.peak_gbs else None,
        "environment": env, "checks": checks, "rows": rows,
        "complete": False,  # True once every point, the profile and the chosen settings are in
    }

    def save():  # the record as measured so far, rewritten whole after every check, point and variant
        record["wall_s"] = round(time.time() - t0, 1)
        write_json_atomic(out / f"{args.name}.json", record)
        try:
            write_atomic(out / f"{args.name}.md", markdown(record))
        except Exception as e:  # noqa: BLE001 - the JSON is the record; a summary that cannot be drawn must not end it
            write_atomic(out / f"{args.name}.md", f"# Decode step\n\nsummary not drawn: {type(e).__name__}: {e}\n")

    torch.set_grad_enabled(False)
    save()
    for ctx, bs in points:
        row = run_point(geo, ctx, bs, args.budgets, args, checks, None if args.checks_only else rows, save)
        sas = "  ".join(f"b{b} {s['amortized_ms']:.3f} ms ({s['speedup']:.2f}x)" for b, s in row["sas"].items()
                        if "error" not in s)
        print(f"[step] ctx {ctx:7d} bs {bs}: dense {row.get('dense_ms', '-')} ms  {sas}", flush=True)
    if args.variants in ("tournament", "all") and not args.checks_only:
        run_deferred(geo, rows, args.budgets, args, save)
    if args.profile:
        record["profile"] = profile_point(geo, max(args.contexts), 1, args.budgets[0], args)
        print(profile_markdown(record["profile"]), flush=True)
    device = env.get("device") or ""
    key = next((k for k in PEAK_GBS if k in device), device or "default")
    # The tournament decides (the core run's one new-step variant decides nothing)
    branches = None
    if args.branches_from and pathlib.Path(args.branches_from).is_file():  # the IF-node timings of another run
        branches = branch_costs(json.loads(pathlib.Path(args.branches_from).read_text()))
    record["chosen_settings"] = (chosen_settings(record, key, branches) if args.variants in ("tournament", "all")
                                 else {})
    if record["chosen_settings"]:
        write_json_atomic(out / "chosen-settings.json", record["chosen_settings"])
    record["complete"] = True
    save()
    drew = plot(record, out / f"{args.name}.png")
    failed = [c for c in checks if not c["ok"]]
    print(markdown(record))
    print(f"[step] wrote {args.name}.json/.md{'/.png' if drew else ''} under {out}")
    if failed:
        print(f"[step] {len(failed)} check(s) FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
