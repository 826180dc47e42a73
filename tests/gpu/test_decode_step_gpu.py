"""One decode step of the real `sas` backend on CUDA (SGLang's pools, FlashInfer, Triton):
no host sync anywhere in the step, and three sas kernels per sparse layer (the fused step) beside the KV write.

The dense backend sas wraps is a stub here: with every layer sparse and contexts longer than
the budget, a decode step never calls it (a call would fail the test).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu

B, H_Q, H_KV, D, DG, LAYERS, BUDGET = 64, 8, 2, 128, 128, 4, 256
MAX_REQS, MAX_CTX, MAX_BS = 8, 8192, 4
LENS_WARMUP, LENS = [1000, 2000, 3000], [1500, 2600, 4000]  # all > (K + 1) * b: selection runs
# The fused step (the CUDA default): front, select, attend; beside them SGLang's KV write (sas's save_kv: one or
# two copy kernels). The old per-op step launched ~10-12.
SAS_KERNELS = ("_front_kernel", "_select_kernel", "_attend_kernel")
KERNELS_PER_LAYER_BOUND = 3 + 3


class _NoDenseDecode:
    """The wrapped dense backend: a sparse decode step must not use it."""

    kv_index_translator = None
    workspace_buffer = None  # sas would borrow a real FlashInfer backend's; this stub has none

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        pass

    def __getattr__(self, name):
        raise AssertionError(f"the dense backend was called ({name}) in an all-sparse decode step")


class _Rig:
    def __init__(self):
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        from sas_backend.backend.sas_attention import SASAttnBackend
        from sas_backend.config import SASConfig
        from sas_backend.gate.module import AttnGate
        from sas_backend.backend.rope_tables import FixedRopeTables
        from sas_backend.ops.rope import rope_cos_sin_table

        g = torch.Generator().manual_seed(0)
        self.req_pool = ReqToTokenPool(MAX_REQS, MAX_CTX, "cuda", False)
        pages = MAX_REQS * MAX_CTX // B + 1
        self.kv_pool = MHATokenToKVPool(pages * B, B, torch.bfloat16, H_KV, D, LAYERS, "cuda", False)
        for lid in range(LAYERS):
            self.kv_pool.k_buffer[lid].normal_()
            self.kv_pool.v_buffer[lid].normal_()
        for r in range(MAX_REQS):  # request r owns pages [1 + r * MAX_CTX / b, ...)
            self.req_pool.req_to_token[r] = torch.arange(MAX_CTX, device="cuda") + B + r * MAX_CTX
        runner = SimpleNamespace(device="cuda", req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool,
                                 dtype=torch.bfloat16, model=None, page_size=B)
        gates = {}
        for lid in range(LAYERS):
            gate = AttnGate(H_KV, H_Q // H_KV, D, DG)
            gate.reset_parameters(g)
            gates[lid] = gate.cuda().requires_grad_(False)
        self.backend = SASAttnBackend(
            runner, _NoDenseDecode(), SASConfig(gate_path="unused", budget=BUDGET, block_size=B), gates,
            FixedRopeTables(rope_cos_sin_table(D, MAX_CTX + 8, 10000.0).cuda(),
                            rope_cos_sin_table(DG, MAX_CTX + 8, 10000.0).cuda()),
            num_kv_heads=H_KV, num_q_heads=H_Q, head_dim=D,
        )
        self.backend.init_cuda_graph_state(MAX_BS, MAX_BS)
        self.layers = [RadixAttention(H_Q, D, D**-0.5, H_KV, lid) for lid in range(LAYERS)]
        self.summaries_filled = False

    def batch(self, lens):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        seq = torch.tensor(lens, dtype=torch.int64)
        reqs = torch.arange(len(lens), device="cuda")
        loc = self.req_pool.req_to_token[reqs, seq.cuda() - 1].long()
        fb = SimpleNamespace(
            forward_mode=ForwardMode.DECODE, batch_size=len(lens), seq_lens=seq.cuda(), seq_lens_cpu=seq,
            positions=(seq - 1).cuda(), req_pool_indices=reqs, out_cache_loc=loc, encoder_lens=None,
        )
        qkv = (torch.randn(len(lens), H_Q * D, device="cuda", dtype=torch.bfloat16),
               torch.randn(len(lens), H_KV, D, device="cuda", dtype=torch.bfloat16),
               torch.randn(len(lens), H_KV, D, device="cuda", dtype=torch.bfloat16))
        return fb, qkv

    def metadata(self, fb, graph: bool):
        """The host part (SGLang: outside the graph) and, under graphs, the captured part."""
        if graph:
            self.backend.init_forward_metadata_out_graph(fb, in_capture=False)
            self.backend.init_forward_metadata_in_graph(fb)
        else:
            self.backend.init_forward_metadata(fb)

    def layers_forward(self, fb, qkv):
        return [self.backend.forward_decode(*qkv, layer, fb) for layer in self.layers]


@pytest.fixture(scope="module")
def rig():
    r = _Rig()
    for graph in (False, True):  # warm-up: Triton / FlashInfer JIT, wrapper creation
        fb, qkv = r.batch(LENS_WARMUP)
        r.metadata(fb, graph)
        r.layers_forward(fb, qkv)
    torch.cuda.synchronize()
    return r


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_decode_step_has_no_host_sync(rig, graph):
    """Plan (FlashInfer, host offsets) and every layer run without one synchronizing CUDA call:
    a device-to-host copy or `.item()` in the step raises here."""
    fb, qkv = rig.batch(LENS)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rig.metadata(fb, graph)
        outs = rig.layers_forward(fb, qkv)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(o.shape == (len(LENS), H_Q * D) for o in outs)
    assert all(bool(torch.isfinite(o.float()).all()) for o in outs)


def test_kernel_launches_per_sparse_layer(rig):
    """CUDA kernels (and memcpy/memset) one sparse layer launches in a captured-style step."""
    from torch.profiler import ProfilerActivity, profile

    fb, qkv = rig.batch(LENS)
    rig.metadata(fb, graph=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rig.layers_forward(fb, qkv)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_layer = len(names) / LAYERS
    print(f"\nsas decode: {per_layer:.1f} CUDA launches per sparse layer; layer 0: {names[: len(names) // LAYERS]}")
    assert per_layer <= KERNELS_PER_LAYER_BOUND, names
    ours = [n for n in names if any(k in n for k in SAS_KERNELS)]
    assert len(ours) == 3 * LAYERS, names  # exactly the three fused launches per sparse layer
