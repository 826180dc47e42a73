"""The host/device contract of FlashInferSparseDecode with FlashInfer's decode wrapper, on CPU.

A fake `flashinfer` module records what `plan()` / `run()` and the constructor receive. The
"device" is torch's `meta` device, so a host tensor (CPU) and a device tensor can be told
apart without a GPU. FlashInfer (0.6.12, 0.7.2) reads `indptr` and `last_page_len` on the
host in `plan()`: handing it device tensors is a device-to-host sync every decode step, which
this test catches here instead of on a user's GPU.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

DEVICE = torch.device("meta")  # stands for the GPU


class FakeDecodeWrapper:
    instances: list = []

    def __init__(self, workspace, layout, use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, **kwargs):
        self.workspace = workspace
        self.use_cuda_graph = use_cuda_graph
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.plans, self.fast_plans, self.runs = [], [], []
        self.row_loops = 0  # Python-level iterations over rows, as FlashInfer 0.6.12's plan() does
        FakeDecodeWrapper.instances.append(self)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kwargs):
        self.plans.append(dict(indptr=indptr, indices=indices, last_page_len=last_page_len,
                               heads=(num_qo_heads, num_kv_heads, head_dim, page_size), **kwargs))
        # 0.6.12 / 0.6.18, tensor-core path: `max(kv_lens_arr_host)`, Python's max over every row.
        self.row_loops += sum(1 for _ in indptr[1:])

    def run(self, q, kv, *, q_scale=None, k_scale=None, v_scale=None, out=None):
        # 0.6.12's signature: the KV scales keyword-only; it folds k_scale into sm_scale, v_scale onto the output.
        self.runs.append((q, kv))
        self.scales = (k_scale, v_scale)
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def fake_fast_decode_plan(wrapper, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                          **kwargs):
    """FlashInfer's `fast_decode_plan`: the C++ planner gets the host offsets; no Python row loop."""
    wrapper.fast_plans.append(dict(indptr=indptr, indices=indices, last_page_len=last_page_len,
                                   heads=(num_qo_heads, num_kv_heads, head_dim, page_size), **kwargs))


@pytest.fixture()
def gathers(monkeypatch):
    """Calls of the gather op from run(), recorded (its kernel needs a GPU; the op is tested in tests/ops)."""
    calls = []
    import sas_backend.ops.sparse_decode.flashinfer as mod

    monkeypatch.setattr(mod, "gather_kv_indices", lambda *args: calls.append(args) or args[-1])
    return calls


def _make(monkeypatch, kv_dtype=torch.bfloat16, **kwargs):
    fake = types.ModuleType("flashinfer")
    fake.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    fake.fast_decode_plan = fake_fast_decode_plan
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    FakeDecodeWrapper.instances = []
    from sas_backend.ops.sparse_decode.flashinfer import FlashInferSparseDecode

    # H_kv 2, G 4, D 64; K = 2 blocks of 64.
    return FlashInferSparseDecode(2, 4, 64, torch.bfloat16, kv_dtype, DEVICE, max_rows=16, top_k=2,
                                  block_size=64, **kwargs)


@pytest.fixture()
def fi(monkeypatch):
    return _make(monkeypatch)


def _indptr(lens):
    return torch.cumsum(torch.tensor([0, *lens]), 0).to(torch.int32)


def _same_memory(view, base):
    return view.device == base.device and (view is base or view._base is base)


@pytest.mark.parametrize("graph_bs", [None, 3])
def test_plan_reads_only_host_tensors(fi, graph_bs):
    fi.plan(torch.tensor([5, 70, 300]), 0.125, graph_bs=graph_bs)  # 3 requests x 2 kv heads
    wrapper = fi._graph_wrappers[graph_bs] if graph_bs else fi._eager
    (p,) = wrapper.plans
    assert p["indptr"].device.type == "cpu" and p["indptr"].dtype == torch.int32
    # Row lengths: min(K, candidates) whole blocks + the current block up to the newest token (300 tokens:
    # 4 candidates, K = 2 of them, then the 44 tokens of block 4).
    assert torch.equal(p["indptr"], _indptr([5, 5, 70, 70, 172, 172]))
    assert p["last_page_len"].device.type == "cpu"
    assert torch.equal(p["last_page_len"], torch.ones(6, dtype=torch.int32))
    # The index buffer stays on the device: FlashInfer never reads it on the host on this path.
    assert p["indices"] is fi.indices_buf
    assert p["heads"] == (4, 1, 64, 1) and p["sm_scale"] == 0.125
    for name, value in p.items():  # nothing else crosses as a device tensor
        if isinstance(value, torch.Tensor) and name != "indices":
            assert value.device.type == "cpu", name

    # Every later step: FlashInfer's fast plan, host offsets handed over as such, device buffers
    # (the ones the gather kernel reads) for what it keeps; nothing copied back to the host.
    fi.plan(torch.tensor([6, 71, 64]), 0.125, graph_bs=graph_bs)
    assert len(wrapper.plans) == 1
    (f,) = wrapper.fast_plans
    host = f["global_override_indptr_cpu"]
    assert host.device.type == "cpu" and torch.equal(host, _indptr([6, 6, 71, 71, 64, 64]))
    assert _same_memory(f["indptr"], fi.gather_indptr) and f["indptr"].numel() == 7
    assert _same_memory(f["last_page_len"], fi.last_page_len_buf) and f["last_page_len"].numel() == 6
    assert f["indices"] is fi.indices_buf and f["heads"] == (4, 1, 64, 1) and f["sm_scale"] == 0.125
    assert f["q_data_type"] == torch.bfloat16 and f["kv_data_type"] == torch.bfloat16


@pytest.mark.parametrize("graph_bs", [None, 64])
def test_plan_cost_is_flat_in_kv_heads(monkeypatch, graph_bs):
    """Host work per step does not grow with rows (requests x kv heads): only a wrapper's first
    plan goes through FlashInfer's full plan (a Python loop over rows in 0.6.12 / 0.6.18)."""
    loops = {}
    for h_kv in (1, 8):
        FakeDecodeWrapper.instances = []
        fake = types.ModuleType("flashinfer")
        fake.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
        fake.fast_decode_plan = fake_fast_decode_plan
        monkeypatch.setitem(sys.modules, "flashinfer", fake)
        from sas_backend.ops.sparse_decode.flashinfer import FlashInferSparseDecode

        fi = FlashInferSparseDecode(h_kv, 4, 64, torch.bfloat16, torch.bfloat16, DEVICE, max_rows=64 * h_kv,
                                    top_k=2, block_size=64)
        for step in range(20):
            fi.plan(torch.full((64,), 1000 + step), 0.125, graph_bs=graph_bs)
        loops[h_kv] = sum(w.row_loops for w in FakeDecodeWrapper.instances)
    assert loops == {1: 64, 8: 512}  # one full plan of 64 x H_kv rows; 19 fast plans with no row loop


def test_graph_wrapper_is_built_over_the_fixed_device_buffers(fi):
    fi.plan(torch.tensor([64] * 3), 0.125, graph_bs=3)
    w = fi._graph_wrappers[3]
    assert w.use_cuda_graph
    indptr_buf, indices_buf, last_buf = w.buffers
    assert indices_buf is fi.indices_buf  # the buffer the gather kernel fills inside the graph
    assert _same_memory(indptr_buf, fi.gather_indptr) and indptr_buf.numel() == 7  # refilled by every plan
    assert _same_memory(last_buf, fi.last_page_len_buf) and last_buf.numel() == 6
    assert w.workspace is fi.workspace and w.workspace.device == DEVICE
    # A replay re-plans the same wrapper (same buffers), never a new one.
    fi.plan(torch.tensor([100] * 3), 0.125, graph_bs=3)
    assert fi._graph_wrappers[3] is w and len(w.plans) == 1 and len(w.fast_plans) == 1


def test_run_gathers_into_the_planned_buffers_then_decodes(fi, gathers):
    fi.plan(torch.tensor([64] * 3), 0.125, graph_bs=3)
    q = torch.empty(3, 8, 64, dtype=torch.bfloat16, device=DEVICE)
    kv = torch.empty(100, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    sel = torch.empty(3, 2, 2, dtype=torch.int32, device=DEVICE)
    table = torch.empty(3, 5, dtype=torch.int64, device=DEVICE)
    seq = torch.empty(3, dtype=torch.int64, device=DEVICE)
    out = fi.run(q, kv, kv, sel, table, seq)
    ((g_sel, g_table, g_seq, g_b, g_indptr, g_out),) = gathers
    assert g_sel is sel and g_table is table and g_seq is seq and g_b == 64
    # Fixed device addresses a captured gather keeps reading / writing.
    assert _same_memory(g_indptr, fi.gather_indptr) and g_indptr.numel() == 7 and g_out is fi.indices_buf
    (q_rows, (k_rows, v_rows)), = fi._graph_wrappers[3].runs
    assert q_rows.shape == (6, 4, 64) and k_rows.shape == (200, 1, 1, 64) and q_rows.device == DEVICE
    assert out.shape == (3, 8, 64)
    fi.plan(torch.tensor([64] * 2), 0.125)  # an eager step after it runs the eager wrapper
    fi.run(q[:2], kv, kv, sel[:2], table[:2], seq[:2])
    assert len(fi._eager.runs) == 1
    with pytest.raises(ValueError, match="plan"):  # a batch other than the planned one
        fi.run(q, kv, kv, sel, table, seq)


def test_fp8_kv_is_planned_as_fp8_and_run_with_the_layer_scales(monkeypatch, gathers):
    """An fp8 KV cache: planned with kv_data_type fp8, each run passes the layer's k_scale / v_scale to FlashInfer
    (which folds them as SGLang's FlashInfer backend relies on); a buffer of another dtype is refused, since
    FlashInfer would read its bytes as fp8."""
    fi = _make(monkeypatch, kv_dtype=torch.float8_e4m3fn)
    fi.plan(torch.tensor([64] * 2), 0.125)
    assert fi._eager.plans[-1]["kv_data_type"] == torch.float8_e4m3fn
    q = torch.empty(2, 8, 64, dtype=torch.bfloat16, device=DEVICE)
    kv = torch.empty(100, 2, 64, dtype=torch.float8_e4m3fn, device=DEVICE)
    sel, table = torch.empty(2, 2, 2, dtype=torch.int32, device=DEVICE), torch.empty(2, 5, device=DEVICE)
    seq = torch.empty(2, dtype=torch.int64, device=DEVICE)
    fi.run(q, kv, kv, sel, table, seq, k_scale=0.5, v_scale=3.0)
    assert fi._eager.scales == (0.5, 3.0)
    with pytest.raises(ValueError, match="planned for torch.float8_e4m3fn"):
        fi.run(q, kv.view(torch.uint8), kv.view(torch.uint8), sel, table, seq)


def test_the_scales_keywords_exist_in_the_kit_flashinfer():
    """The GPU kit's FlashInfer (0.6.12) takes k_scale / v_scale in BatchDecodeWithPagedKVCacheWrapper.run, folding
    k_scale into sm_scale and multiplying the output by v_scale (read from the wheel's source)."""
    import pathlib
    import zipfile

    wheels = sorted(pathlib.Path(__file__).resolve().parents[2].glob("shared/gpu-kit/flashinfer_python-*.whl"))
    if not wheels:
        pytest.skip("no FlashInfer wheel in ../shared/gpu-kit")
    src = zipfile.ZipFile(wheels[-1]).read("flashinfer/decode.py").decode()
    run = src[src.index("class BatchDecodeWithPagedKVCacheWrapper"):]
    run = run[run.index("    def run("):]
    assert "k_scale: Optional[float] = None" in run[:2000] and "v_scale: Optional[float] = None" in run[:2000]
    assert "sm_scale *= k_scale" in run and "out *= v_scale" in run


def test_device_seq_lens_are_refused(fi):
    with pytest.raises(ValueError, match="CPU tensor"):
        fi.plan(torch.tensor([64, 64]).to(DEVICE), 0.125)


def test_shared_workspace_is_used_not_owned(monkeypatch):
    ws = torch.empty(1024, dtype=torch.uint8, device=DEVICE)
    fi = _make(monkeypatch, workspace=ws)
    fi.plan(torch.tensor([64] * 2), 0.1)
    assert fi.workspace is ws and not fi.owns_workspace and fi._eager.workspace is ws
    # The index buffer holds max_rows rows of (K + 1) * b tokens.
    assert fi.indices_buf.numel() == 16 * 3 * 64 and fi.indices_buf.dtype == torch.int32
