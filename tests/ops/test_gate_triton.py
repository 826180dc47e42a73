"""gate_query_triton (fused gate query from the post-RoPE query) vs the plain-torch reference."""

import pytest
import torch

from sas_backend.ops.gate import gate_query_post_rope
from sas_backend.ops.gate.torch_path import gate_query
from sas_backend.ops.gate.naive import gate_query_post_rope as gate_query_post_rope_ref
from sas_backend.ops.gate.triton import gate_query_triton
from sas_backend.ops.rope import apply_rope, rope_inv_freq
from tests.devices import DEVICE

TOL = dict(rtol=1e-4, atol=1e-4)


def _table_rows(dim, positions, theta, scale=1.0):
    """`[N, dim]` fp32 cos|sin rows at `positions` (scale: a YaRN-like mscale baked into the table)."""
    freqs = torch.outer(positions.double(), rope_inv_freq(dim, theta).double())
    return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scale).float().to(DEVICE)


def _case(n, h_kv, g, d, dg, positions="mixed", scale=1.0, seed=0):
    """(q_pre fp32 `[N, H_q, D]`, q_post fp32, model rows, w_q, q_norm, gate rows)."""
    gen = torch.Generator().manual_seed(seed)
    if positions == "zero":
        pos = torch.zeros(n, dtype=torch.int64)
    elif positions == "large":
        pos = torch.randint(100_000, 130_000, (n,), generator=gen)
    else:
        pos = torch.randint(0, 4096, (n,), generator=gen)
    q_pre = (torch.randn(n, h_kv * g, d, generator=gen) * 2 + 0.1).to(DEVICE)
    w_q = (torch.randn(h_kv, g, d, dg, generator=gen) / (g * d) ** 0.5).to(DEVICE)
    q_norm = (torch.rand(dg, generator=gen) + 0.5).to(DEVICE)
    model_cs = _table_rows(d, pos, 1_000_000.0, scale)
    gate_cs = _table_rows(dg, pos, 10_000.0)
    q_post = apply_rope(q_pre, model_cs)
    return q_pre, q_post, model_cs, w_q, q_norm, gate_cs


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("g", [1, 3, 4, 7, 8])
def test_gate_query_fp32(g, d):
    _, q_post, mcs, w_q, qn, gcs = _case(3, 2, g, d, 128, seed=g * d)  # small N: interpreter time
    out = gate_query_triton(q_post, mcs, w_q, qn, gcs)
    assert out.dtype == torch.float32 and out.shape == (3, 2, 128)
    torch.testing.assert_close(out, gate_query_post_rope_ref(q_post, mcs, w_q, qn, gcs), **TOL)


@pytest.mark.parametrize("n", [1, 3])  # small N: the split launch has N x H_kv x G x D/32 programs to interpret
@pytest.mark.parametrize("g,d,dg", [(8, 128, 64), (1, 64, 64), (2, 96, 128), (3, 80, 64)])
def test_gate_query_fp32_batch_sizes_and_dims(g, d, dg, n):
    # Decode batch 1 and 3, gate dim 64, head dims whose half is not a power of two (96: 3 full split
    # units; 80: a partial last unit).
    _, q_post, mcs, w_q, qn, gcs = _case(n, 3, g, d, dg, seed=100 + n + g)
    out = gate_query_triton(q_post, mcs, w_q, qn, gcs)
    assert out.shape == (n, 3, dg)
    torch.testing.assert_close(out, gate_query_post_rope_ref(q_post, mcs, w_q, qn, gcs), **TOL)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("g,d,dg", [(4, 128, 128), (3, 64, 64)])
def test_gate_query_bf16(g, d, dg, n):
    _, q_post, mcs, w_q, qn, gcs = _case(n, 2, g, d, dg, seed=n + g)
    q_bf = q_post.to(torch.bfloat16)
    out = gate_query_triton(q_bf, mcs, w_q, qn, gcs)
    # Both sides upcast the same bf16 values: fp32 tolerance holds.
    torch.testing.assert_close(out, gate_query_post_rope_ref(q_bf, mcs, w_q, qn, gcs), **TOL)


@pytest.mark.parametrize("positions", ["zero", "large"])
@pytest.mark.parametrize("scale", [1.0, 1.3])
def test_gate_query_recovers_pre_rope(positions, scale):
    # The kernel on post-RoPE q equals the gate query of the pre-RoPE q the gate was trained on,
    # also for a table with a magnitude (YaRN's mscale: q_post is scaled by it, then divided out).
    q_pre, q_post, mcs, w_q, qn, gcs = _case(3, 2, 4, 128, 128, positions, scale, seed=3)
    out = gate_query_triton(q_post, mcs, w_q, qn, gcs)
    torch.testing.assert_close(out, gate_query_post_rope_ref(q_post, mcs, w_q, qn, gcs), **TOL)
    torch.testing.assert_close(out, gate_query(q_pre, w_q, qn, gcs), **TOL)


def test_gate_query_reference_matches_cpu_fast_path():
    # The reference and the backend's CPU fast path (ops.gate.cpu) agree, YaRN-like table included.
    from sas_backend.ops.gate.torch_path import gate_query_torch

    _, q_post, mcs, w_q, qn, gcs = _case(3, 2, 3, 64, 64, scale=1.2, seed=9)
    fast = gate_query_torch(q_post.cpu(), mcs.cpu(), w_q.cpu(), qn.cpu(), gcs.cpu())
    torch.testing.assert_close(gate_query_post_rope_ref(q_post, mcs, w_q, qn, gcs).cpu(), fast, **TOL)


def test_gate_query_out_buffer_and_strided_q():
    # q as a view into a fused qkv tensor (row stride > H_q*D), results written into `out`.
    _, q_post, mcs, w_q, qn, gcs = _case(6, 2, 4, 64, 128, seed=5)
    n, h_q, d = q_post.shape
    qkv = torch.randn(n, (h_q + 4) * d, device=DEVICE)
    qkv[:, : h_q * d] = q_post.reshape(n, -1)
    q_view = qkv[:, : h_q * d].view(n, h_q, d)
    assert not q_view.is_contiguous()
    out = torch.full((n, 2, 128), float("nan"), device=DEVICE)
    res = gate_query_triton(q_view, mcs, w_q, qn, gcs, out=out)
    assert res is out
    torch.testing.assert_close(out, gate_query_post_rope_ref(q_post, mcs, w_q, qn, gcs), **TOL)


@pytest.mark.parametrize("g,d,dg,dtype", [(1, 64, 64, torch.float32), (3, 80, 64, torch.float32),
                                          (7, 128, 128, torch.float32), (4, 128, 128, torch.bfloat16)])
def test_gate_query_unsplit_kernel(g, d, dg, dtype):
    """The one-launch kernel (`split=False`, timed beside the split one by the decode-step benchmark)."""
    _, q_post, mcs, w_q, qn, gcs = _case(3, 2, g, d, dg, seed=40 + g)
    q = q_post.to(dtype)
    out = gate_query_triton(q, mcs, w_q, qn, gcs, split=False)
    torch.testing.assert_close(out, gate_query_post_rope_ref(q, mcs, w_q, qn, gcs), **TOL)
    torch.testing.assert_close(out, gate_query_triton(q, mcs, w_q, qn, gcs), **TOL)  # = the split launch


def test_gate_query_empty_and_bad_shapes():
    _, q_post, mcs, w_q, qn, gcs = _case(2, 2, 2, 64, 64)
    assert gate_query_triton(q_post[:0], mcs[:0], w_q, qn, gcs[:0]).shape == (0, 2, 64)
    with pytest.raises(ValueError):
        gate_query_triton(q_post, mcs, w_q[:1], qn, gcs)
    with pytest.raises(ValueError):
        gate_query_triton(q_post, mcs, w_q, qn, gcs, out=torch.empty(2, 2, 32, device=DEVICE))
    with pytest.raises(ValueError, match="workspace"):  # too small for the split's partials
        gate_query_triton(q_post, mcs, w_q, qn, gcs, workspace=torch.empty(8, device=DEVICE))


def test_gate_query_split_workspace_is_reused_and_independent_of_batch():
    """A workspace sized for the largest batch serves every smaller one (a CUDA-graph step allocates
    nothing); the split is fixed by the geometry, so a token's result does not depend on the batch
    it is in (a padded graph batch computes what the eager batch does), bit for bit."""
    from sas_backend.ops.gate.triton import gate_query_workspace_numel, split_units

    assert split_units(4, 128) == (16, 16) and split_units(7, 128) == (28, 16)
    assert split_units(3, 80) == (9, 16) and split_units(1, 16) == (1, 8)
    _, q_post, mcs, w_q, qn, gcs = _case(5, 2, 4, 128, 128, seed=21)
    ws = torch.full((gate_query_workspace_numel(5, 2, 4, 128, 128),), float("nan"), device=DEVICE)
    whole = gate_query_triton(q_post, mcs, w_q, qn, gcs, workspace=ws)
    part = gate_query_triton(q_post[:2], mcs[:2], w_q, qn, gcs[:2], workspace=ws)
    assert torch.equal(part, whole[:2])
    torch.testing.assert_close(whole, gate_query_post_rope_ref(q_post, mcs, w_q, qn, gcs), **TOL)


def test_entry_point_dispatch():
    # One entry point: the Triton kernel on CUDA, the CPU path elsewhere; same numbers, same `out`.
    _, q_post, mcs, w_q, qn, gcs = _case(4, 2, 3, 64, 128, seed=11)
    ref = gate_query_post_rope_ref(q_post, mcs, w_q, qn, gcs)
    torch.testing.assert_close(gate_query_post_rope(q_post, mcs, w_q, qn, gcs), ref, **TOL)
    out = torch.empty(4, 2, 128, device=DEVICE)
    assert gate_query_post_rope(q_post, mcs, w_q, qn, gcs, out=out) is out
    torch.testing.assert_close(out, ref, **TOL)
