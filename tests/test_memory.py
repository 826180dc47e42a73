"""Memory accounting (backend/memory.py): the figure equals what the backend allocates, and the
KV-pool budget handed to SGLang leaves exactly room for it."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch

from sas_backend.backend.sglang_compat import profile_target
from sas_backend.backend.memory import (
    SASMemory,
    kv_budget_with_sas,
    reserve_sas_memory,
    sas_memory,
)

MODEL = os.path.join(os.path.dirname(__file__), "..", "models", "SmolLM2-135M-Instruct")
GEO = dict(num_sparse_layers=28, num_kv_heads=3, gate_dim=128, block_size=64, top_k=8)


@pytest.fixture(autouse=True)
def _reservation_stays_here(monkeypatch):
    """`reserve_sas_memory` records its figure in `memory.RESERVED` for the backend built after it: not for the
    backends later tests build in this process."""
    from sas_backend.backend import memory

    monkeypatch.setattr(memory, "RESERVED", None)


def _nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("graph_sizes", [0, 5])
def test_figure_matches_the_allocated_tensors(monkeypatch, graph_sizes):
    """Build the pieces as the backend does (summary pool on CPU, FlashInfer buffers on `meta`
    through a fake flashinfer module) and compare their bytes with `sas_memory`."""
    from sas_backend.backend.summary_pool import SummaryPool

    fake = types.ModuleType("flashinfer")
    fake.BatchDecodeWithPagedKVCacheWrapper = lambda *a, **k: types.SimpleNamespace(plan=lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    from sas_backend.ops.sparse_decode.flashinfer import FlashInferSparseDecode

    b, h, max_reqs, kv_tokens = GEO["block_size"], GEO["num_kv_heads"], 48, 64 * 1000
    kv_slots = kv_tokens + b  # SGLang's KV buffers: the pool plus one padding page
    pool = SummaryPool(range(30 - GEO["num_sparse_layers"], 30), kv_slots // b, h, GEO["gate_dim"], "cpu")
    rows = (max_reqs + 1) * h  # req_to_token has max_reqs + 1 rows
    fi = FlashInferSparseDecode(h, 3, 64, torch.bfloat16, torch.bfloat16, "meta", max_rows=rows,
                                top_k=GEO["top_k"], block_size=b)
    for bs in range(1, graph_sizes + 1):  # one graph wrapper per captured batch size
        fi.plan(torch.full((bs,), 100), 0.1, graph_bs=bs)
    from sas_backend.gate.module import AttnGate

    gates = [AttnGate(h, 3, 64, GEO["gate_dim"]) for _ in range(GEO["num_sparse_layers"])]
    gate_bytes = sum(_nbytes(*g.parameters()) for g in gates)

    mem = sas_memory(**GEO, max_reqs=max_reqs, on_cuda=True, num_graph_batch_sizes=graph_sizes,
                     group_size=3, head_dim=64)
    assert mem.fixed["gate weights"] == gate_bytes
    assert mem.total_bytes(kv_tokens) == pool.nbytes + fi.device_nbytes() + gate_bytes
    assert mem.summary_bytes_per_page == GEO["num_sparse_layers"] * h * GEO["gate_dim"] * 4 + 1  # + the page's mark

    cpu = sas_memory(**GEO, max_reqs=max_reqs, on_cuda=False)  # CPU: only the summary pool
    assert cpu.total_bytes(kv_tokens) == pool.nbytes


def test_training_free_selectors_count_their_own_summaries():
    """quest keeps min|max keys (2D floats per page and kv head) and no gate; sink-local keeps nothing."""
    from sas_backend.selection import SelectionRule, make_selector
    from sas_backend.backend.summary_pool import SummaryPool

    rule, d, h = SelectionRule(top_k=8), 64, GEO["num_kv_heads"]
    for name, want in (("quest", 2 * d), ("sink-local", 0)):
        dim = make_selector(name, rule).summary_dim(d, 0)
        assert dim == want
        mem = sas_memory(**{**GEO, "gate_dim": 0}, summary_dim=dim, max_reqs=8, on_cuda=False, group_size=3, head_dim=d)
        pool = SummaryPool(range(GEO["num_sparse_layers"]), 1000 + 1, h, dim, "cpu")
        assert mem.total_bytes(64 * 1000) == pool.nbytes and "gate weights" not in mem.fixed


def test_key_codes_are_counted_per_page():
    """`--sas-rerank-keys int4`: the summary pool also holds every sparse layer's 4-bit key codes per page and kv head
    (b x D / 2 code bytes + the fp16 min and step of D channels); the figure is the pool's own."""
    from sas_backend.backend.summary_pool import SummaryPool

    h, d = GEO["num_kv_heads"], 64
    plain = sas_memory(**{**GEO, "gate_dim": 0}, summary_dim=2 * d, max_reqs=8, on_cuda=False)
    coded = sas_memory(**{**GEO, "gate_dim": 0}, summary_dim=2 * d, max_reqs=8, on_cuda=False, code_head_dim=d)
    per_page = GEO["num_sparse_layers"] * h * (64 * d // 2 + 4 * d)
    assert coded.summary_bytes_per_page - plain.summary_bytes_per_page == per_page
    pool = SummaryPool(range(GEO["num_sparse_layers"]), 1000 + 1, h, 2 * d, "cpu", code_head_dim=d, block_size=64)
    assert coded.total_bytes(64 * 1000) == pool.nbytes
    packed, scales = pool.key_codes[0]
    assert packed.shape == (1001, h, 64 * d // 2) and scales.shape == (1001, h, 2, d)


def test_shared_workspace_is_not_counted():
    own = sas_memory(**GEO, max_reqs=8, on_cuda=True)
    shared = sas_memory(**GEO, max_reqs=8, on_cuda=True, shared_workspace=True)
    assert own.fixed_bytes - shared.fixed_bytes == 128 << 20


@pytest.mark.parametrize("available", [10 << 30, 3_000_000_123, 1 << 30])
def test_pool_shrinks_by_exactly_the_sas_memory(available):
    """SGLang makes tokens = budget // cell, rounded down to pages. With the sas budget, the pool
    plus sas's memory fits `available`, and one more page would not."""
    cell = 2 * 3 * 64 * 30 * 2  # SmolLM2 in bf16: 23040 bytes of K+V per token
    mem = sas_memory(**GEO, max_reqs=256, on_cuda=True, num_graph_batch_sizes=20)
    b = mem.page_size

    def sglang_tokens(budget):
        return budget // cell // b * b

    dense = sglang_tokens(available)
    tokens = sglang_tokens(kv_budget_with_sas(available, cell, mem))
    assert tokens < dense
    assert tokens * cell + mem.total_bytes(tokens) <= available
    assert (tokens + 2 * b) * cell + mem.total_bytes(tokens + 2 * b) > available  # tight (page rounding)
    # The pool lost what sas needs, in tokens at the dense cost per token (up to page rounding).
    lost = (dense - tokens) * cell
    assert abs(lost - mem.total_bytes(tokens)) <= 2 * b * (cell + mem.bytes_per_token)


def test_budget_is_zero_when_fixed_memory_does_not_fit():
    mem = SASMemory(page_size=64, summary_bytes_per_page=1000, fixed={"x": 5000})
    assert kv_budget_with_sas(4000, 100, mem) == 0


@pytest.fixture()
def sas_env(monkeypatch, tmp_path):
    from sas_backend.gate.checkpoint import init_gate_checkpoint

    cfg = json.load(open(os.path.join(MODEL, "config.json")))
    gate = tmp_path / "gate"
    init_gate_checkpoint(gate, geometry=cfg, seed=0)
    for k in list(os.environ):
        if k.startswith("SAS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("SAS_GATE", str(gate))
    monkeypatch.setenv("SAS_BUDGET", "512")
    return cfg


def _owner(cfg, backend="sas", device="cuda", **server_args):
    """What `_profile_available_bytes` is bound to: a ModelRunner (0.5.15) or a
    KVCacheConfigurator (0.5.21); the hook reads only these attributes."""
    args = dict(attention_backend=backend, tp_size=1, max_running_requests=64, disable_cuda_graph=False,
                cuda_graph_bs=[1, 2, 4, 8])
    args.update(server_args)
    return types.SimpleNamespace(
        server_args=types.SimpleNamespace(**args),
        model_config=types.SimpleNamespace(hf_config=cfg),
        kv_cache_dtype=torch.bfloat16,
        device=device,
    )


def test_hook_shrinks_the_budget_for_sas_only(sas_env, caplog):
    available = 4 << 30
    original = lambda owner, pre_model_load_memory: available  # noqa: E731
    assert reserve_sas_memory(original, _owner(sas_env, backend="flashinfer"), 0) == available

    with caplog.at_level("INFO", logger="sas_backend.backend.memory"):
        budget = reserve_sas_memory(original, _owner(sas_env), 0)
    cell = 2 * 3 * 64 * 30 * 2
    # The RoPE tables: SmolLM2's 8192 positions + SGLang's 256-row margin, aligned to 128.
    # The fused decode step (CUDA's default: kernels and attention "triton") instead of FlashInfer's buffers.
    from sas_backend.backend.memory import decode_step_workspace_bytes

    fused_bytes = decode_step_workspace_bytes(3, 3, 64, 128, 8, 64, 64, 8448, True)
    mem = sas_memory(num_sparse_layers=30, num_kv_heads=3, gate_dim=128, block_size=64, top_k=8,
                     max_reqs=64, on_cuda=True, num_graph_batch_sizes=4, group_size=3, head_dim=64,
                     shared_workspace=True,
                     rope_positions=8448, flashinfer_attention=False, decode_step_bytes=fused_bytes,
                     summary_bytes=2,  # the settings table's bf16 summary pool on CUDA
                     front_gate_bytes=2)  # and its bf16 gate copies for the fused front
    assert fused_bytes > 0 and "flashinfer sparse decode" not in mem.fixed
    assert mem.fixed["gate rope table"] == 8448 * 128 * 4 and "model rope table (fp32 copy)" not in mem.fixed
    assert mem.fixed["gate weights (front copy)"] == mem.fixed["gate weights"] // 2  # bf16 beside the fp32 gate
    assert budget == kv_budget_with_sas(available, cell, mem) < available
    assert "sas: reserving" in caplog.text and "KV budget 4.000 ->" in caplog.text

    # The fused step keeps no per-batch-size buffers: graphs or not, the same reservation (FlashInfer's graph
    # wrappers: test_no_graph_wrappers_are_reserved_whatever_the_flag_spelling).
    no_graph = reserve_sas_memory(original, _owner(sas_env, disable_cuda_graph=True), 0)
    assert no_graph == budget


def test_hook_refuses_the_launch_when_it_cannot_size_the_pool(sas_env, monkeypatch):
    """An unshrunk pool would start and run out of device memory later: the reason, and no server."""
    monkeypatch.setenv("SAS_GATE", "/nonexistent")
    with pytest.raises(RuntimeError, match=r"cannot size the KV pool.*nonexistent.*refusing to start"):
        reserve_sas_memory(lambda o, p: 123456789, _owner(sas_env), 0)
    # Other backends are never sized, whatever the sas settings say.
    assert reserve_sas_memory(lambda o, p: 123456789, _owner(sas_env, backend="flashinfer"), 0) == 123456789


def test_dp_attention_is_sized_for_the_attention_tp_group(sas_env, monkeypatch):
    """Before SGLang publishes its parallel state, the attention-TP width comes from the flags as SGLang derives
    it: under DP attention each rank holds tp/dp times more kv heads than plain TP would say."""
    from sas_backend.backend.memory import attention_tp_size_from_args, memory_for_sglang

    def unpublished():
        raise RuntimeError("parallel state not published")

    monkeypatch.setattr("sas_backend.backend.sglang_compat.attention_tp", unpublished)
    ns = types.SimpleNamespace
    assert attention_tp_size_from_args(ns(tp_size=8)) == 8
    assert attention_tp_size_from_args(ns(tp_size=8, dp_size=4, enable_dp_attention=True)) == 2
    assert attention_tp_size_from_args(ns(tp_size=8, dp_size=4, enable_dp_attention=False)) == 8
    assert attention_tp_size_from_args(ns(tp_size=8, dp_size=2, enable_dp_attention=True, attn_cp_size=2)) == 2
    # SmolLM2's 3 kv heads: tp 3 shards them 1 a rank; tp 3 with dp 3 attention keeps all 3 on each rank.
    plain, kv_plain = memory_for_sglang(_owner(sas_env, tp_size=3))
    dp, kv_dp = memory_for_sglang(_owner(sas_env, tp_size=3, dp_size=3, enable_dp_attention=True))
    assert kv_dp == 3 * kv_plain and dp.summary_bytes_per_page - 1 == 3 * (plain.summary_bytes_per_page - 1)


def test_hook_target_exists_in_this_sglang():
    import pkgutil

    target = profile_target()
    assert target is not None
    owner, name = target.rsplit(".", 1)
    assert callable(getattr(pkgutil.resolve_name(owner), name))


def test_plugin_registers_the_memory_hook():
    from sas_backend.plugin import _register_memory_hook

    calls = []
    registry = types.SimpleNamespace(register=lambda *a: calls.append(a))
    hook_type = types.SimpleNamespace(AROUND="around")
    _register_memory_hook(registry, hook_type)
    assert calls == [(profile_target(), reserve_sas_memory, "around")]


@pytest.mark.parametrize("spelling", [
    dict(disable_cuda_graph=True),  # legacy flag
    dict(disable_decode_cuda_graph=True),
    dict(cuda_graph_backend_decode="disabled"),
    dict(cuda_graph_config={"decode": {"backend": "disabled"}}),
])
def test_no_graph_wrappers_are_reserved_whatever_the_flag_spelling(sas_env, spelling, monkeypatch):
    """Every way of turning decode graphs off reserves no per-batch-size FlashInfer wrapper (8 MiB each)."""
    from sas_backend.backend.memory import memory_for_sglang

    monkeypatch.setenv("SAS_ATTENTION", "flashinfer")  # the FlashInfer sparse decode holds the wrappers

    graphs, _ = memory_for_sglang(_owner(sas_env))
    eager, _ = memory_for_sglang(_owner(sas_env, **spelling))
    monkeypatch.setenv("SAS_ATTENTION", "triton")
    fused, _ = memory_for_sglang(_owner(sas_env))
    assert "flashinfer sparse decode" not in fused.fixed and "decode step workspace" in fused.fixed
    # eager + 4 captured sizes' wrappers, against the eager one alone
    assert graphs.fixed["flashinfer sparse decode"] - eager.fixed["flashinfer sparse decode"] == 4 * (8 << 20)


def test_cpu_reservation_equals_what_the_backend_allocates(sas_env, caplog):
    """On CPU with --max-total-tokens 16384 (the test servers' setting): the KV budget shrinks by
    exactly the bytes the backend then allocates for that pool (summary pool, gate weights, RoPE
    tables), not by summaries for the whole of system RAM."""
    from sas_backend.backend.rope_tables import RopeTables
    from sas_backend.backend.summary_pool import SummaryPool
    from sas_backend.gate.checkpoint import load_gate_checkpoint
    from sas_backend.gate.module import gates_from_tensors
    from sas_backend.geometry import ModelGeometry
    from sas_backend.ops.rope import rope_cos_sin_table

    available, cell, max_total = 20 << 30, 2 * 3 * 64 * 30 * 2, 16384
    owner = _owner(sas_env, device="cpu", max_total_tokens=max_total)
    owner.model_config.context_len, owner.model_config.dtype = 8192, torch.bfloat16
    owner.kv_cache_dtype = torch.bfloat16
    with caplog.at_level("INFO", logger="sas_backend.backend.memory"):
        budget = reserve_sas_memory(lambda o, p: available, owner, 0)
    assert min(budget // cell, max_total) == max_total  # SGLang still builds the pool asked for

    geo = ModelGeometry.from_hf_config(sas_env)
    gate_cfg, layers = load_gate_checkpoint(os.environ["SAS_GATE"])
    gates = gates_from_tensors(layers, range(geo.num_layers), gate_dim=gate_cfg.gate_dim, device="cpu")
    pool = SummaryPool(range(geo.num_layers), max_total // 64 + 1, 3, gate_cfg.gate_dim, "cpu")  # + padding page
    rotary = torch.nn.Module()  # SGLang's CPU table: the model dtype, 8192 + 256 rows
    rotary.cos_sin_cache = rope_cos_sin_table(64, 8448, geo.rope_theta).to(torch.bfloat16)
    tables = RopeTables(rotary, gate_cfg.gate_dim, geo, "cpu")
    allocated = (
        pool.nbytes + sum(_nbytes(*g.parameters()) for g in gates.values()) + _nbytes(tables.model, tables.gate)
    )
    assert available - budget == allocated
    assert "for 16384 tokens" in caplog.text  # the log names the pool that is built


@pytest.mark.parametrize("on_cuda,sub,chunk", [(False, 1, None), (True, 1, None), (True, 4, None),
                                               (True, 1, {"1": 64, "16": 512})])
def test_decode_step_workspace_figure_matches_the_step_object(on_cuda, sub, chunk):
    """The reservation for the fused kernels' workspace equals what `DecodeStep` allocates (on `meta`); with
    sub-block summaries the front's per-run partials are counted too, and with a per-batch-size select chunk
    rule (a settings table's) the select partials of its hungriest batch."""
    from sas_backend.backend.decode_step import FUSED_MAX_ROWS, DecodeStep
    from sas_backend.backend.memory import decode_step_workspace_bytes
    from sas_backend.ops.fused_step import (
        CPU_TARGET_PROGRAMS, GPU_KCHUNK, GPU_QCHUNK, GPU_TARGET_PROGRAMS, StepGeometry,
    )
    from sas_backend.backend.step_settings import StepSettings
    from sas_backend.selection import SelectionRule, make_selector

    h, g, d, dg, k, b, max_reqs, ctx = 8, 4, 128, 128, 32, 64, 300, 256 * 1024
    req_to_token = torch.empty(max_reqs + 1, ctx, dtype=torch.int32, device="meta")
    step = DecodeStep(make_selector("gate", SelectionRule(k, b, sub_blocks=sub)),
                      StepGeometry(h, g, d, d, dg, k, b, sub), req_to_token, "meta", torch.bfloat16, torch.bfloat16,
                      0.1, StepSettings("triton", "triton", target_programs=GPU_TARGET_PROGRAMS if on_cuda
                                        else CPU_TARGET_PROGRAMS, select_chunk=chunk))
    if on_cuda:  # the workspace on `meta` standing in for CUDA: the GPU's front units
        step.fused_ws.__init__(step.geo, FUSED_MAX_ROWS, step.max_blocks, "meta", target_programs=GPU_TARGET_PROGRAMS,
                               qchunk=GPU_QCHUNK, kchunk=GPU_KCHUNK, chunk=chunk)
    assert step.fused_ws.max_bs == FUSED_MAX_ROWS
    got = decode_step_workspace_bytes(h, g, d, dg, k, b, max_reqs, ctx, on_cuda, chunk=chunk, sub_blocks=sub)
    if chunk is not None:  # 256 rows in 512-block chunks keep fewer survivors than in the default's 128
        assert got < decode_step_workspace_bytes(h, g, d, dg, k, b, max_reqs, ctx, on_cuda)
    assert got == step.device_nbytes
    if sub > 1:  # the front's summary partials per run: rows x H_kv x units x (sub - 1) x Dg fp32 more
        grown = FUSED_MAX_ROWS * h * step.fused_ws.uk * (sub - 1) * dg * 4
        assert got - decode_step_workspace_bytes(h, g, d, dg, k, b, max_reqs, ctx, on_cuda) == grown
        return
    assert got < 64 * 2**20  # Qwen3-4B shapes at 256K: tens of MiB, not hundreds
    mem = sas_memory(**GEO, max_reqs=max_reqs, on_cuda=True, decode_step_bytes=got, flashinfer_attention=False,
                     summary_bytes=2)
    assert mem.fixed["decode step workspace"] == got and "flashinfer sparse decode" not in mem.fixed
    assert mem.summary_bytes_per_page == GEO["num_sparse_layers"] * GEO["num_kv_heads"] * GEO["gate_dim"] * 2 + 1


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_exact_rerank_figure_matches_the_step_object(kernels):
    """`--sas-exact-rerank 2` on a device (`meta` standing in for CUDA): the reservation equals what `DecodeStep`
    allocates for the second level (the fused select's workspace at 2 x K with the fused kernels, the rerank kernel's
    workspace, the K-wide selection); the kernel's workspace stays small at a big batch (split batches only) unless the
    attend ranks the second level, where each fused row keeps its tile of log-sum-exps."""
    from sas_backend.backend.decode_step import DecodeStep
    from sas_backend.backend.memory import decode_step_workspace_bytes
    from sas_backend.backend.step_settings import StepSettings
    from sas_backend.ops.fused_step import CPU_TARGET_PROGRAMS, StepGeometry
    from sas_backend.ops.rerank import RerankWorkspace
    from sas_backend.selection import SelectionRule, make_selector

    h, g, d, dg, k, b, max_reqs, ctx = 8, 4, 128, 128, 32, 64, 300, 64 * 1024
    req_to_token = torch.empty(max_reqs + 1, ctx, dtype=torch.int32, device="meta")
    settings = StepSettings(kernels, "triton" if kernels == "triton" else "torch",
                            target_programs=CPU_TARGET_PROGRAMS)
    step = DecodeStep(make_selector("gate", SelectionRule(k, b)), StepGeometry(h, g, d, d, dg, k, b), req_to_token,
                      "meta", torch.bfloat16, torch.bfloat16, 0.1, settings, exact_rerank=2)
    fused = DecodeStep.fused_workspace(settings)
    first = decode_step_workspace_bytes(h, g, d, dg, 2 * k, b, max_reqs, ctx, False) if fused else 0
    ranked = DecodeStep.ranks_in_attend(settings)
    assert ranked == (kernels == "triton")  # the Triton attention ranks the second level itself by default
    want = DecodeStep.rerank_bytes_for(2, h, g, k, max_reqs + 1, True, fused, first, ranked)
    assert step.rerank_nbytes == want > 0
    if ranked:  # every (row, kv head) of the fused rows keeps its candidates' log-sum-exps: [256 x 8, 64, 16] fp32
        rows = DecodeStep.fused_rows(max_reqs + 1)
        assert step.rerank_ws.ranked_rows == rows == 256
        assert step.rerank_ws.nbytes == RerankWorkspace.nbytes_for(max_reqs + 1, h, g, 2 * k, ranked_rows=rows) \
            == rows * h * (64 * 16 * 4 + 4)
    else:  # split batches only
        assert step.rerank_ws.nbytes == RerankWorkspace.nbytes_for(max_reqs + 1, h, g, 2 * k) < 2**20
    assert (step.first_ws is not step.fused_ws) == fused
    assert DecodeStep.rerank_bytes_for(1, h, g, k, max_reqs + 1, True, fused, first) == 0


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_is_counted_at_one_byte_an_element(sas_env, fp8):
    """An fp8 KV cache: the pool's bytes a token are half bf16's; what sas keeps beside it (summaries, gates,
    workspaces) does not change with the KV dtype."""
    from sas_backend.backend.memory import memory_for_sglang

    bf16, kv_bf16 = memory_for_sglang(_owner(sas_env))
    owner = _owner(sas_env)
    owner.kv_cache_dtype = fp8
    mem, kv_fp8 = memory_for_sglang(owner)
    assert 2 * kv_fp8 == kv_bf16
    assert mem.summary_bytes_per_page == bf16.summary_bytes_per_page


@pytest.mark.parametrize("user_max,want_rows", [(None, 2048), (64, 64), (100000, 16384 // 2)])
def test_per_request_buffers_are_reserved_for_the_rows_sglang_gives(sas_env, monkeypatch, user_max, want_rows):
    """The prompt-anchor pool has a row per request slot: the reservation sizes it for the rows SGLang then gives
    the pool it builds (`resolve_max_num_reqs`: the launch's --max-running-requests, else 512 per context length of
    tokens within 2048..4096, at most tokens // 2), plus SGLang's padding row, not for the 4096 cap."""
    from sas_backend.backend import memory
    from sas_backend.backend.anchor_pool import AnchorPool
    from sas_backend.backend.summary_pool import SummaryPool

    monkeypatch.setenv("SAS_PROMPT_ANCHORS", "2")
    owner = _owner(sas_env, device="cpu", max_total_tokens=16384, max_running_requests=user_max)
    owner.model_config.context_len, owner.model_config.dtype = 8192, torch.float32
    reserve_sas_memory(lambda o, p: 20 << 30, owner, 0)
    assert memory.sglang_max_running_requests(owner.server_args, 8192, 16384) == want_rows
    assert memory.RESERVED["prompt anchors"] == AnchorPool.nbytes_for(30, want_rows + 1, 3, 2)
    # the pool SGLang builds (max_total_tokens) and its padding page, as SummaryPool allocates it
    assert memory.RESERVED["summary pool"] == SummaryPool(range(30), 16384 // 64 + 1, 3, 128, "meta").nbytes


def test_the_slot_table_width_comes_from_the_installed_sglang(monkeypatch):
    """The fused workspace is reserved for SGLang's `req_to_token` width: the model's context length plus the row
    headroom the installed release names (a rename would silently fall back to the RoPE table's length, an
    over-reservation the server tests catch as held < reserved); before SGLang publishes its state (a process that
    is no server), None: the caller keeps its upper bound."""
    import types

    from sglang.srt.mem_cache import allocation_sizing

    from sas_backend.backend.sglang_compat import req_to_token_width

    config = types.SimpleNamespace(context_len=8192)
    assert req_to_token_width(config) is None  # nothing published in this test process
    monkeypatch.setattr(allocation_sizing, "get_req_to_token_extra_context_len", lambda: 8)
    assert req_to_token_width(config) == 8200
