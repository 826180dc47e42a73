"""An fp8 KV cache (`--kv-cache-dtype fp8_e4m3` / `fp8_e5m2`) read by every op that reads K or V: SGLang stores
K / k_scale and V / v_scale cast to fp8 (`set_kv_buffer`), so each reader must see the stored number times its
layer's scale. Each kernel and torch path against its plain reference with fp8 buffers and non-unit scales, and
the references themselves against the statement "the same op over the dequantized fp32 cache"."""

import pytest
import torch

from sas_backend.ops import fused_step as fused
from sas_backend.ops.fused_step import naive
from sas_backend.ops.sparse_decode.torch_path import TorchSparseDecode
from tests.devices import DEVICE
from tests.ops.test_fused_step_triton import LENS, StepCase

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SCALES = [(1.0, 1.0), (0.37, 2.5)]


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What SGLang's `set_kv_buffer` stores for `x` with a layer scale: (x / scale) cast to fp8."""
    return (x.float() / scale).to(dtype)


def fp8_case(paged_case, lens, group, dtype, k_scale, v_scale, q_dtype=torch.float32, **kw):
    """A StepCase whose K / V buffers are fp8 (quantized with the scales), plus their dequantized fp32 copies."""
    c = StepCase(paged_case, lens, group, **kw)
    c.k8, c.v8 = quantize(c.k_buf, dtype, k_scale), quantize(c.v_buf, dtype, v_scale)
    c.k_deq, c.v_deq = c.k8.float() * k_scale, c.v8.float() * v_scale
    c.q = c.q.to(q_dtype)
    return c


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("group,target", [(1, 1), (3, 64), (7, 64), (8, 1)])
def test_attend_reads_fp8_with_scales(paged_case, dtype, k_scale, v_scale, group, target):
    """The fused attend over fp8 K / V equals the reference, and the reference equals attention over the
    dequantized fp32 cache (k_scale folded into the softmax scale, v_scale onto the output)."""
    c = fp8_case(paged_case, LENS + [70], group, dtype, k_scale, v_scale, seed=40 + group)
    ws = c.workspace(top_k=3, target_programs=target)
    sel = naive.select(c.gate_cs[:, None, :].expand(-1, c.h_kv, -1).contiguous(), c.summaries, c.table, c.n_cand,
                       c.b, c.max_blocks, 3)
    ref = naive.attend(c.q, c.k8, c.v8, sel, c.table, c.seq_lens, c.b, c.d**-0.5, k_scale, v_scale)
    stated = naive.attend(c.q, c.k_deq, c.v_deq, sel, c.table, c.seq_lens, c.b, c.d**-0.5)
    torch.testing.assert_close(ref, stated, rtol=1e-6, atol=1e-6)
    got = fused.attend(ws, c.q, c.k8, c.v8, sel, c.table, c.seq_lens, c.d**-0.5, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    if (k_scale, v_scale) != (1.0, 1.0):  # the scales matter: dropping them is a different answer
        dropped = fused.attend(ws, c.q, c.k8, c.v8, sel, c.table, c.seq_lens, c.d**-0.5)
        assert not torch.allclose(dropped, ref, rtol=1e-3, atol=1e-3)
    assert int(ws.attend_counters.abs().sum()) == 0


@pytest.mark.parametrize("dtype", FP8)
def test_attend_fp8_with_bf16_queries_at_the_served_geometry(paged_case, dtype):
    """bf16 queries over fp8 K / V at head dim 128 and 64-token blocks (the served case): fp8 converts to bf16
    exactly, so the kernel agrees with the reference over the dequantized cache within bf16 rounding."""
    b, d = 64, 128
    lens = [3 * b, 2 * b + 5, 1, 5 * b - 1]
    c = fp8_case(paged_case, lens, 4, dtype, 0.5, 1.75, q_dtype=torch.bfloat16, d=d, dg=32, b=b, seed=7)
    ws = c.workspace(top_k=2, target_programs=16)
    sel = naive.select(torch.randn(len(lens), c.h_kv, c.dg, generator=c.case.gen).to(DEVICE), c.summaries, c.table,
                       c.n_cand, b, c.max_blocks, 2)
    ref = naive.attend(c.q.float(), c.k_deq, c.v_deq, sel, c.table, c.seq_lens, b, d**-0.5)
    got = fused.attend(ws, c.q, c.k8, c.v8, sel, c.table, c.seq_lens, d**-0.5, k_scale=0.5, v_scale=1.75)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("sub", [1, 4])
def test_front_summarizes_fp8_keys_with_their_scale(paged_case, dtype, sub):
    """The front's summary of a completed block is the summary of the dequantized keys; its gate query does not
    read the cache."""
    k_scale = 3.0
    c = fp8_case(paged_case, LENS, 3, dtype, k_scale, 1.0, seed=5, sub_blocks=sub)
    ws = c.workspace(top_k=2)
    ref_summ = c.summaries.clone()
    ref_gq = naive.front(c.q, c.model_cs, c.gate_cs, c.w_q, c.q_norm, c.k8, c.model_table, c.gate_table, c.w_k,
                         c.k_norm, ref_summ, c.table, c.seq_lens, c.b, sub, k_scale=k_scale)
    stated = c.summaries.clone()
    naive.front(c.q, c.model_cs, c.gate_cs, c.w_q, c.q_norm, c.k_deq, c.model_table, c.gate_table, c.w_k, c.k_norm,
                stated, c.table, c.seq_lens, c.b, sub)
    torch.testing.assert_close(ref_summ, stated, rtol=0, atol=0)
    summ = c.summaries.clone()
    gq = fused.front(ws, c.q, c.model_cs, c.gate_cs, c.w_q, c.q_norm, c.k8, c.model_table, c.gate_table, c.w_k,
                     c.k_norm, summ, c.table, c.seq_lens, k_scale=k_scale)
    torch.testing.assert_close(gq, ref_gq, rtol=1e-5, atol=1e-5)
    written = {int(c.table[r, n // c.b - 1]) // c.b for r, n in enumerate(LENS) if n % c.b == 0}
    assert written
    for page in written:
        torch.testing.assert_close(summ[page], ref_summ[page], rtol=1e-5, atol=1e-5)
    # A per-tensor key scale passes through the pooling and projection linearly and the gate's RMSNorm then
    # removes it (up to the norm's eps): the gate's summaries hardly depend on k_scale, quest's bounds do.
    unscaled = c.summaries.clone()
    fused.front(ws, c.q, c.model_cs, c.gate_cs, c.w_q, c.q_norm, c.k8, c.model_table, c.gate_table, c.w_k,
                c.k_norm, unscaled, c.table, c.seq_lens)
    for page in written:
        torch.testing.assert_close(unscaled[page], ref_summ[page], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_torch_sparse_decode_reads_fp8_with_scales(paged_case, dtype, q_dtype):
    """The CPU sparse decode (one masked SDPA) over fp8 K / V with the layer's scales equals the reference."""
    k_scale, v_scale = 0.6, 1.3
    c = fp8_case(paged_case, LENS + [70], 4, dtype, k_scale, v_scale, q_dtype=q_dtype, seed=11)
    sel = naive.select(c.gate_cs[:, None, :].expand(-1, c.h_kv, -1).contiguous(), c.summaries, c.table, c.n_cand,
                       c.b, c.max_blocks, 3)
    sd = TorchSparseDecode(c.h_kv, c.b)
    sd.plan(c.seq_lens.cpu(), c.d**-0.5)
    got = sd.run(c.q, c.k8, c.v8, sel, c.table, c.seq_lens, k_scale=k_scale, v_scale=v_scale)
    ref = naive.attend(c.q.float(), c.k_deq, c.v_deq, sel, c.table, c.seq_lens, c.b, c.d**-0.5)
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)


def _fp8_keys(dtype, k_scale, num_pages=12, b=8, h_kv=2, d=16, seed=0):
    """(fp8 post-RoPE keys `[(num_pages + 1) * b, H_kv, D]` as SGLang stores them, the dequantized fp32 keys,
    page starts) for the summary tests."""
    from tests.ops.test_summary_triton import MAX_POS, _gate_params, _post_rope_cache

    g = torch.Generator().manual_seed(seed)
    starts = (torch.randint(0, MAX_POS // b - 1, (num_pages + 1,), generator=g) * b).to(DEVICE)
    model_cs, gate_cs, w_k, k_norm = _gate_params(h_kv, d, 16, seed=seed)
    k32, _ = _post_rope_cache(num_pages, b, h_kv, d, starts, model_cs, torch.float32, seed=seed)
    k8 = quantize(k32, dtype, k_scale)
    return k8, k8.float() * k_scale, starts, (model_cs, gate_cs, w_k, k_norm)


@pytest.mark.parametrize("dtype", FP8)
def test_block_summaries_read_fp8_keys_with_their_scale(dtype):
    """The summary of whole pages and the decode update (torch path, Triton kernels in the interpreter, the plain
    statement) of fp8 keys with k_scale equal those of the dequantized keys."""
    from sas_backend.ops.summary import summarize_pages
    from sas_backend.ops.summary.naive import summary_update_decode
    from sas_backend.ops.summary.torch_path import summary_update_decode_masked
    from sas_backend.ops.summary.triton import summarize_pages_triton, summary_update_decode_triton

    b, k_scale = 8, 0.25
    k8, kd, starts, (model_cs, gate_cs, w_k, k_norm) = _fp8_keys(dtype, k_scale, b=b)
    pages = torch.tensor([3, 1, 7, 12], device=DEVICE)
    want = summarize_pages(kd, pages, starts[pages], model_cs, gate_cs, w_k, k_norm, b)
    got = summarize_pages(k8, pages, starts[pages], model_cs, gate_cs, w_k, k_norm, b, k_scale)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    tri = summarize_pages_triton(k8, pages, starts[pages], model_cs, gate_cs, w_k, k_norm, b, k_scale)
    torch.testing.assert_close(tri, want, rtol=1e-4, atol=1e-5)
    # decode: request r's newest token completed the block of page pages[r] (block index starts // b)
    seq_lens = starts[pages] + b
    table = torch.zeros(len(pages), int(seq_lens.max()) // b + 1, dtype=torch.int32, device=DEVICE)
    table[torch.arange(len(pages)), (starts[pages] // b).long()] = (pages * b).to(torch.int32)
    base = torch.zeros(13, 2, 16, device=DEVICE)
    stated = summary_update_decode(kd, base.clone(), table, seq_lens, b, model_cs, gate_cs, w_k, k_norm)
    ref = summary_update_decode(k8, base.clone(), table, seq_lens, b, model_cs, gate_cs, w_k, k_norm,
                                k_scale=k_scale)
    torch.testing.assert_close(ref, stated, rtol=0, atol=0)
    masked = summary_update_decode_masked(k8, base.clone(), table, seq_lens, b, model_cs, gate_cs, w_k, k_norm,
                                          k_scale)
    torch.testing.assert_close(masked[1:], stated[1:], rtol=0, atol=0)  # page 0: the padding page
    tri_upd = summary_update_decode_triton(k8, base.clone(), table, seq_lens, b, model_cs, gate_cs, w_k, k_norm,
                                           k_scale)
    torch.testing.assert_close(tri_upd, stated, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("sub", [1, 2])
def test_quest_bounds_and_selectors_read_fp8_keys_with_their_scale(dtype, sub):
    """Quest's min / max bounds scale with the keys (a dropped k_scale changes them); the gate and quest
    selectors' summarize / update of fp8 keys with k_scale equal theirs of the dequantized keys."""
    from sas_backend.gate.module import AttnGate
    from sas_backend.ops.quest import key_bounds
    from sas_backend.selection import SelectionRule, make_selector

    b, k_scale = 8, 4.0
    k8, kd, starts, (model_cs, gate_cs, _, _) = _fp8_keys(dtype, k_scale, b=b, seed=3)
    pages = torch.tensor([2, 9, 4], device=DEVICE)
    torch.testing.assert_close(key_bounds(k8, pages, b, k_scale), key_bounds(kd, pages, b), rtol=0, atol=0)
    assert not torch.allclose(key_bounds(k8, pages, b), key_bounds(kd, pages, b))
    gate = AttnGate(2, 2, 16, 16).to(DEVICE)
    for name in ("gate", "quest"):
        sel = make_selector(name, SelectionRule(top_k=2, block_size=b, sub_blocks=sub))
        want = sel.summarize(gate, kd, pages, starts[pages], model_cs, gate_cs)
        got = sel.summarize(gate, k8, pages, starts[pages], model_cs, gate_cs, k_scale)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        seq_lens = starts[pages] + b
        table = torch.zeros(len(pages), int(seq_lens.max()) // b + 1, dtype=torch.int32, device=DEVICE)
        table[torch.arange(len(pages)), (starts[pages] // b).long()] = (pages * b).to(torch.int32)
        width = want.shape[-1]
        s_want, s_got = torch.zeros(13, 2, width, device=DEVICE), torch.zeros(13, 2, width, device=DEVICE)
        sel.update(gate, kd, s_want, table, seq_lens, model_cs, gate_cs)
        sel.update(gate, k8, s_got, table, seq_lens, model_cs, gate_cs, k_scale)
        torch.testing.assert_close(s_got, s_want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", FP8)
def test_prompt_anchors_read_fp8_keys_with_their_scale(dtype):
    """The extend's prompt anchors over fp8 keys with k_scale are those over the dequantized keys; a scale that
    sharpens the softmax changes which blocks carry the mass, so it is not dropped."""
    from sas_backend.ops.anchors import extend_anchors
    from tests.ops.test_anchors_paged import _world

    b, h_kv, d, count, k_scale = 8, 2, 16, 3, 6.0
    lens = [16, 33, 70, 100]
    q, kb, r2t, rows = _world(lens, h_kv, 3, d, b, seed=5)
    k8 = quantize(kb, dtype, k_scale)
    args = (r2t, rows, torch.tensor(lens), max(lens), d**-0.5, b, count)
    want = extend_anchors(q, k8.float() * k_scale, *args)
    assert torch.equal(extend_anchors(q, k8, *args, k_scale=k_scale), want)
    assert not torch.equal(extend_anchors(q, k8, *args), want)
