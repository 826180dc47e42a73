"""Gated sparse-scope attention: the torch oracle against independent formulations and
gradcheck, then the fused Triton kernel (forward and all four gradients) against the oracle.

Inputs live on tests.devices.DEVICE: on a GPU the kernels compile; on CPU they run under
TRITON_INTERPRET=1 (set in tests/conftest.py), so sizes stay tiny.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sas_backend.training.ops.gated_attention import gated_attention, gated_attention_naive
from tests.devices import DEVICE

JUNK = 30.0  # planted in ignored log_g entries (own and later blocks): above every threshold


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def _positions(lens):
    """In-sequence position of every packed token, `[T]`."""
    if not lens:
        return torch.zeros(0, dtype=torch.long, device=DEVICE)
    return torch.cat([torch.arange(n, device=DEVICE) for n in lens])


def _case(lens, h_q, h_kv, d, bs, dtype=torch.float32, thr="quantile", seed=0, dead_block=None):
    """Random inputs on DEVICE, drawn on a CPU generator (the same data on every device).

    thr: 'quantile' (per-row mix of selected / not), '-inf' (all), '+inf' (none)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE)

    t = sum(lens)
    nb = max(1, -(-max(lens) // bs))
    q = randn(t, h_q, d).to(dtype)
    k = randn(t, h_kv, d).to(dtype)
    v = randn(t, h_kv, d).to(dtype)
    gate_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    log_g = torch.log_softmax(2 * randn(h_kv, t, nb), -1).to(gate_dtype)
    if dead_block is not None:  # a block no query selects: the kernels must skip it everywhere
        log_g[:, :, dead_block] = -100.0
    own = _positions(lens) // bs  # [T]
    ignored = torch.arange(nb, device=DEVICE)[None, :] >= own[:, None]  # [T, NB]: own and later blocks
    if thr == "quantile":
        valid = log_g.masked_fill(ignored, float("nan"))
        threshold = torch.nanquantile(valid, 0.5, dim=-1).nan_to_num(0.0)
        threshold += 0.05 * randn(threshold.shape).to(gate_dtype)  # no ties
    else:
        threshold = torch.full((h_kv, t), float(thr), dtype=gate_dtype, device=DEVICE)
    log_g = log_g.masked_fill(ignored, JUNK)  # must never be selected nor biased
    return q, k, v, log_g, threshold, _cu(lens)


# ---------------------------------------------------------------- the oracle


def _per_query_loop(q, k, v, log_g, threshold, lens, bs, scale):
    """Independent formulation: for every (token, query head) gather the attended set explicitly."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    bos = 0
    for n in lens:
        for p in range(n):
            t, c = bos + p, p // bs
            for qh in range(q.shape[1]):
                h = qh // group
                keys = list(range(c * bs, p + 1))
                bias = [0.0] * len(keys)
                for m in range(c):
                    if log_g[h, t, m] >= threshold[h, t]:
                        keys += range(m * bs, (m + 1) * bs)
                        bias += [float(log_g[h, t, m])] * bs
                idx = torch.tensor(keys, device=q.device) + bos
                s = k[idx, h] @ q[t, qh] * scale + torch.tensor(bias, dtype=q.dtype, device=q.device)
                out[t, qh] = torch.softmax(s, 0) @ v[idx, h]
        bos += n
    return out


def test_naive_matches_per_query_loop():
    lens, bs = [13, 9], 3
    q, k, v, log_g, thr, cu = _case(lens, 4, 2, 8, bs, torch.float64)
    scale = 0.3
    ref = _per_query_loop(q, k, v, log_g, thr, lens, bs, scale)
    torch.testing.assert_close(gated_attention_naive(q, k, v, log_g, thr, cu, bs, scale), ref)


@pytest.mark.parametrize("group", [1, 2])
def test_naive_all_blocks_is_causal_attention(group):
    lens, bs, h_kv, d = [17, 30, 6], 4, 2, 8
    q, k, v, log_g, _, cu = _case(lens, h_kv * group, h_kv, d, bs, torch.float64)
    thr = torch.full(log_g.shape[:2], float("-inf"), dtype=torch.float64, device=DEVICE)
    out = gated_attention_naive(q, k, v, torch.zeros_like(log_g), thr, cu, bs)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs = q[a:b].transpose(0, 1)
        ks = k[a:b].transpose(0, 1).repeat_interleave(group, 0)
        vs = v[a:b].transpose(0, 1).repeat_interleave(group, 0)
        ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
        torch.testing.assert_close(out[a:b], ref)


def test_naive_no_blocks_is_block_local_causal():
    lens, bs = [17, 30, 6], 4
    q, k, v, log_g, _, cu = _case(lens, 4, 2, 8, bs, torch.float64)
    thr = torch.full(log_g.shape[:2], float("inf"), dtype=torch.float64, device=DEVICE)
    out = gated_attention_naive(q, k, v, log_g, thr, cu, bs)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        pos = torch.arange(b - a, device=DEVICE)
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] // bs == pos[:, None] // bs)
        qs = q[a:b].transpose(0, 1)
        ks = k[a:b].transpose(0, 1).repeat_interleave(2, 0)
        vs = v[a:b].transpose(0, 1).repeat_interleave(2, 0)
        ref = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(out[a:b], ref)


@pytest.mark.parametrize("bs", [4, 5])
def test_naive_gradcheck(bs):
    lens = [13, 7]
    q, k, v, log_g, thr, cu = _case(lens, 2, 1, 4, bs, torch.float64, seed=1)
    # the selection is a step in log_g: keep every entry off its threshold by more than eps
    assert (log_g - thr[..., None]).abs().min() > 1e-4
    inputs = [x.clone().requires_grad_() for x in (q, k, v, log_g)]
    fn = lambda q_, k_, v_, g_: gated_attention_naive(q_, k_, v_, g_, thr, cu, bs)  # noqa: E731
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny ops: intra-op threads only add contention
    try:
        assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6)
    finally:
        torch.set_num_threads(threads)


def test_naive_log_g_grad_only_on_selected_blocks():
    lens, bs = [14, 9], 4
    q, k, v, log_g, thr, cu = _case(lens, 4, 2, 6, bs, torch.float64)
    log_g.requires_grad_()
    gated_attention_naive(q, k, v, log_g, thr, cu, bs).square().sum().backward()
    own = _positions(lens) // bs
    blocks = torch.arange(log_g.shape[2], device=DEVICE)
    selected = (log_g.detach() >= thr[..., None]) & (blocks < own[:, None])
    assert (log_g.grad[~selected] == 0).all()
    assert (log_g.grad[selected] != 0).all()


# ---------------------------------------------------------------- the fused kernel


def _max_err_ok(got, ref, tol):
    """max |got - ref| <= tol * max(1, max |ref|)."""
    err = (got.float() - ref.float()).abs().max().item()
    bound = tol * max(1.0, ref.abs().max().item())
    assert err <= bound, f"max err {err:.3g} > {bound:.3g}"


KERNEL_CASES = {
    # name: (lens, Hq, Hkv, D, block_size, dtype, threshold, dead_block)
    "shorter-than-a-block": ([5, 0, 11, 9], 2, 2, 32, 16, torch.float32, "quantile", None),
    "all-selected-gqa4": ([70], 4, 1, 32, 16, torch.float32, "-inf", None),
    "none-selected-gqa3": ([50, 19], 6, 2, 32, 16, torch.float32, "inf", None),
    "packed-mixed-gqa3-d24": ([37, 64, 5, 50], 6, 2, 24, 16, torch.float32, "quantile", 1),
    "two-tiles-per-block-gqa4": ([90, 33], 8, 2, 32, 32, torch.float32, "quantile", None),
    "bf16-gqa4": ([60, 45], 8, 2, 32, 16, torch.bfloat16, "quantile", None),
    "bf16-all-selected-gqa1": ([75], 2, 2, 32, 16, torch.bfloat16, "-inf", None),
    "packed-gqa7": ([45, 30], 7, 1, 32, 16, torch.float32, "quantile", None),  # Qwen2.5-Coder's group
    "bf16-gqa8": ([50], 16, 2, 32, 16, torch.bfloat16, "quantile", None),  # the widest group tile
    "served-block-64": ([200, 70], 4, 2, 32, 64, torch.float32, "quantile", None),
}


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_matches_naive(name):
    lens, h_q, h_kv, d, bs, dtype, thr_mode, dead = KERNEL_CASES[name]
    q, k, v, log_g, thr, cu = _case(lens, h_q, h_kv, d, bs, dtype, thr_mode, dead_block=dead)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE, dtype)

    ins = [x.clone().requires_grad_() for x in (q, k, v, log_g)]
    out = gated_attention(*ins, thr, cu, bs)
    out.backward(do)
    # oracle in fp32 on the same (possibly bf16-rounded) values
    refs = [x.detach().float().requires_grad_() for x in (q, k, v, log_g)]
    ref = gated_attention_naive(*refs, thr, cu, bs)
    ref.backward(do.float())

    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert out.dtype == dtype and out.shape == q.shape
    _max_err_ok(out, ref, tol)
    for name_, got, want in zip(["dq", "dk", "dv", "dlog_g"], ins, refs):
        assert got.grad.dtype == got.dtype, name_
        _max_err_ok(got.grad, want.grad, tol)
    # unselected and ignored entries of d(log_g) are exactly zero
    own = _positions(lens) // bs
    selected = (log_g >= thr[..., None]) & (torch.arange(log_g.shape[2], device=DEVICE) < own[:, None])
    assert (ins[3].grad[~selected] == 0).all()
    if thr_mode == "inf":
        assert not selected.any()


def test_kernel_default_scale_and_no_log_g_grad():
    lens, bs = [40], 16
    q, k, v, log_g, thr, cu = _case(lens, 2, 1, 16, bs, thr="-inf")
    qq = q.clone().requires_grad_()
    out = gated_attention(qq, k, v, log_g, thr, cu, bs)
    ref = gated_attention_naive(q, k, v, log_g, thr, cu, bs, scale=1 / math.sqrt(16))
    _max_err_ok(out, ref, 1e-4)
    out.sum().backward()
    assert qq.grad is not None and log_g.grad is None


def test_kernel_rejects_bad_block_size():
    q, k, v, log_g, thr, cu = _case([20], 2, 1, 16, 12)
    with pytest.raises(ValueError, match="power of two"):
        gated_attention(q, k, v, log_g, thr, cu, 12)


@pytest.mark.parametrize("start", [3, 16, 33])
def test_naive_query_start_equals_whole_rows_sliced(start):
    """The reference with queries only at positions >= start (keys: every token) equals those rows
    of the whole-row reference, forward and gradients (q, k, v, log g)."""
    g = torch.Generator().manual_seed(7)
    lens, bs = [70, 37, 20], 16
    t, nb = sum(lens), 5
    cu = torch.tensor([0, 70, 107, 127], dtype=torch.int32)
    q, k, v = (torch.randn(t, h, 16, generator=g, dtype=torch.float64) for h in (6, 2, 2))
    log_g = torch.log_softmax(torch.randn(2, t, nb, generator=g, dtype=torch.float64), -1)
    thr = torch.topk(log_g, 2, -1).values[..., -1]
    rows = torch.cat([torch.arange(b + start, e) for b, e in zip(cu[:-1].tolist(), cu[1:].tolist()) if e - b > start])
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, log_g)]
    full = gated_attention_naive(*leaves, thr, cu, bs)[rows]
    w = torch.randn(full.shape, generator=g, dtype=torch.float64)
    (full * w).sum().backward()
    ref_grads = [leaves[0].grad[rows], leaves[1].grad, leaves[2].grad, leaves[3].grad[:, rows]]
    tq, tk, tv, tg = (x.clone().requires_grad_(True) for x in (q[rows], k, v, log_g[:, rows]))
    tail = gated_attention_naive(tq, tk, tv, tg, thr[:, rows], cu, bs, query_start=start)
    torch.testing.assert_close(tail, full)
    (tail * w).sum().backward()
    for got, want in zip((tq.grad, tk.grad, tv.grad, tg.grad), ref_grads):
        torch.testing.assert_close(got, want)
