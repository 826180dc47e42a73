"""Eager steps on a device make no blocking host-to-device copy (the overlap scheduler's stall).

Without CUDA graphs (large batches, `--cuda-graph-backend-decode disabled`) every decode step and
every extend plans eagerly on the host. A host tensor moved to the device with a blocking copy
there makes the CPU wait for the GPU to drain: SGLang's overlap scheduler loses its overlap. The
backend runs here on torch's `meta` device standing in for the GPU (host tensors stay on CPU, so
every host-to-device move is visible), under a dispatch spy that records each op reading a CPU
tensor and producing a device one. A `.item()`/`nonzero` on a device tensor fails on `meta` by
itself (no data), so device-to-host syncs cannot pass either.
"""

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sas_backend.backend.rope_tables import FixedRopeTables
from sas_backend.backend.sas_attention import SASAttnBackend
from sas_backend.config import SASConfig
from sas_backend.gate.module import AttnGate
from sas_backend.ops.rope import rope_cos_sin_table

sglang = pytest.importorskip("sglang")
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

DEV = torch.device("meta")
B, H_Q, H_KV, D, DG, LAYERS, SLOTS = 8, 6, 2, 16, 16, 2, 160 * 8


class MetaKVPool:
    """SGLang's KV pool interface over `meta` buffers (its real pools need a device module)."""

    def __init__(self):
        self.k = [torch.zeros(SLOTS, H_KV, D, device=DEV) for _ in range(LAYERS)]
        self.v = [torch.zeros(SLOTS, H_KV, D, device=DEV) for _ in range(LAYERS)]

    def get_key_buffer(self, lid):
        return self.k[lid]

    def get_value_buffer(self, lid):
        return self.v[lid]

    def set_kv_buffer(self, layer, loc, k, v):
        loc = getattr(loc, "loc", loc)  # KVWriteLoc or a bare slot tensor
        self.k[layer.layer_id][loc] = k
        self.v[layer.layer_id][loc] = v


class HostToDeviceSpy(TorchDispatchMode):
    """Records (op, non_blocking) for every op that reads a CPU tensor and returns a device one."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if any(t.device.type == "cpu" for t in ins) and any(t.device.type != "cpu" for t in outs):
            self.copies.append((func.overloadpacket.__name__, bool(kwargs.get("non_blocking", False))))
        return out


def _backend():
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    req_pool = ReqToTokenPool(8, 256, DEV, False)
    runner = SimpleNamespace(device=DEV, req_to_token_pool=req_pool, token_to_kv_pool=MetaKVPool(),
                             dtype=torch.float32, model=None, page_size=B)
    cfg = SASConfig(gate_path="unused", budget=3 * B, block_size=B, dense_below=0)  # the sparse plan's copies
    gates = {lid: AttnGate(H_KV, H_Q // H_KV, D, DG).to(DEV).requires_grad_(False) for lid in range(LAYERS)}
    return SASAttnBackend(
        runner, TorchNativeAttnBackend(runner), cfg, gates,
        FixedRopeTables(rope_cos_sin_table(D, 300, 1e4).to(DEV), rope_cos_sin_table(DG, 300, 1e4).to(DEV)),
        num_kv_heads=H_KV, num_q_heads=H_Q, head_dim=D,
    )


def _decode_batch(seq_lens):
    seq = torch.tensor(seq_lens)
    bs = len(seq_lens)
    return SimpleNamespace(
        forward_mode=ForwardMode.DECODE, batch_size=bs, seq_lens=seq.to(DEV), seq_lens_cpu=seq,
        positions=(seq - 1).to(DEV), req_pool_indices=torch.arange(bs).to(DEV),
        out_cache_loc=torch.arange(bs).to(DEV), encoder_lens=None,
    )


def test_a_decode_batch_without_host_lengths_is_refused_not_synced():
    """No `seq_lens_cpu`: copying the device lengths over would be a device-to-host sync every step; refused."""
    be = _backend()
    fb = _decode_batch([24, 17, 9])
    fb.seq_lens_cpu = None
    with pytest.raises(RuntimeError, match="no seq_lens_cpu"):
        be.init_forward_metadata(fb)


@pytest.mark.parametrize("seq_lens,completes", [([24, 17, 9], True), ([25, 17, 9], False), ([64, 128], True)])
def test_eager_decode_step_copies_nothing_blocking(seq_lens, completes):
    """A whole eager decode step (plan + every layer), with and without a row whose newest token
    completes a block (24, 64, 128 are multiples of B = 8): that case used to copy the row
    indices to the device with a blocking `.to()`."""
    be = _backend()
    fb = _decode_batch(seq_lens)
    layers = [RadixAttention(H_Q, D, D**-0.5, H_KV, lid) for lid in range(LAYERS)]
    bs = len(seq_lens)
    with HostToDeviceSpy() as spy:
        be.init_forward_metadata(fb)
        for layer in layers:
            q = torch.zeros(bs, H_Q * D, device=DEV)
            k, v = torch.zeros(bs, H_KV, D, device=DEV), torch.zeros(bs, H_KV, D, device=DEV)
            out = be.forward_decode(q, k, v, layer, fb)
    blocking = [c for c in spy.copies if not c[1]]
    assert not blocking, f"blocking host-to-device copies in an eager decode step: {blocking}"
    assert out.shape == (bs, H_Q * D) and out.device == DEV
    assert be._plan.update_all_rows == completes and be._plan.summary_rows is None


def test_eager_extend_plan_copies_nothing_blocking():
    """An extend that completes blocks (chunked prefill ending mid-block, a radix prefix) builds
    their page list on the device with async copies only, and the right pages."""
    be = _backend()
    req_pool = be.req_to_token_pool
    req_pool.req_to_token[:2, :64] = torch.arange(128, device=DEV).view(2, 64) + B  # meta: shapes only
    fb = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, batch_size=2, seq_lens=torch.tensor([20, 40]).to(DEV),
        seq_lens_cpu=torch.tensor([20, 40]), extend_prefix_lens_cpu=[5, 16],
        req_pool_indices=torch.tensor([0, 1]).to(DEV), positions=torch.zeros(35, dtype=torch.int64, device=DEV),
        out_cache_loc=torch.zeros(35, dtype=torch.int64, device=DEV), encoder_lens=None,
    )
    with HostToDeviceSpy() as spy:
        be.init_forward_metadata(fb)
    pages, starts = be._extend.blocks
    # Request 0 completes blocks 0, 1 (tokens 0..15); request 1 blocks 2..4 (its prefix held 0, 1).
    assert pages.shape == (5,) and starts.shape == (5,) and pages.device == DEV
    assert spy.copies and all(non_blocking for _, non_blocking in spy.copies), spy.copies
