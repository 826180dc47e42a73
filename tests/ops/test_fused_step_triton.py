"""The fused decode step's three kernels (ops.fused_step: front, select, attend) against the plain
references (ops.fused_step.naive), on random and edge-case inputs: partial and exactly-full blocks, budgets
covering the context, GQA groups 1-8 (3 and 7 included), head dims 64 and 128, mixed lengths in one batch,
padded graph rows, forced blocks and prompt anchors, multi-chunk selects and multi-split attention, and
fp32 / bf16 / fp16."""

import pytest
import torch

from sas_backend.ops import fused_step as fused
from sas_backend.ops.fused_step import naive
from sas_backend.ops.rope import apply_rope, rope_cos_sin_table
from sas_backend.ops.score.torch_path import candidate_counts
from sas_backend.ops.summary.torch_path import summarize_pages
from tests.devices import DEVICE


class StepCase:
    """A decode batch over a paged cache (tests/ops/conftest.PagedCase) with gate weights, post-RoPE keys at
    the positions their slots hold, values, summaries of every complete block, and the batch's RoPE rows."""

    def __init__(self, paged_case, lens, group, d=16, dg=16, b=4, h_kv=2, kv_dtype=torch.float32, seed=0,
                 weight_dtype=torch.float32, summary_dtype=torch.float32, integer_summaries=False, sub_blocks=1):
        self.case = case = paged_case(lens, b, h_kv, d, seed=seed)
        g = case.gen
        self.b, self.h_kv, self.d, self.dg, self.group, self.sub = b, h_kv, d, dg, group, sub_blocks
        self.lens = lens

        def randn(*shape):
            return torch.randn(*shape, generator=g).to(DEVICE)

        max_pos = case.max_blocks * b + 2 * b
        self.model_table = rope_cos_sin_table(d, max_pos, 10000.0, device=DEVICE)
        self.gate_table = rope_cos_sin_table(dg, max_pos, 10000.0, device=DEVICE)
        slot_pos = torch.zeros(case.slots, dtype=torch.int64, device=DEVICE)
        for r, n in enumerate(lens):
            slot_pos[case.req_to_token[int(case.req_pool_indices[r]), :n].long()] = torch.arange(n, device=DEVICE)
        self.k_buf = apply_rope(randn(case.slots, h_kv, d), self.model_table[slot_pos]).to(kv_dtype)
        self.v_buf = randn(case.slots, h_kv, d).to(kv_dtype)
        self.w_q = (randn(h_kv, group, d, dg) / (group * d) ** 0.5).to(weight_dtype)
        self.w_k = (randn(h_kv, 3 * d, dg) / (3 * d) ** 0.5).to(weight_dtype)
        self.q_norm = (torch.rand(dg, generator=g) + 0.5).to(DEVICE)
        self.k_norm = (torch.rand(dg, generator=g) + 0.5).to(DEVICE)
        self.q = randn(len(lens), h_kv * group, d).to(kv_dtype)
        pos = (case.seq_lens - 1).clamp_min(0)
        self.model_cs, self.gate_cs = self.model_table[pos], self.gate_table[pos]
        self.table = case.block_table()
        self.seq_lens = case.seq_lens
        self.n_cand = candidate_counts(case.seq_lens, b)
        self.max_blocks = case.max_blocks
        summ = torch.zeros(case.num_pages + 1, h_kv, sub_blocks * dg, device=DEVICE)
        pages, starts = [], []
        for r, n in enumerate(lens):
            for m in range(n // b):
                pages.append(int(case.req_to_token[int(case.req_pool_indices[r]), m * b]) // b)
                starts.append(m * b)
        size = b // sub_blocks
        for j in range(sub_blocks if pages else 0):  # run j of page p: S = b / n slots from p*b + j*S
            pages_t, starts_t = torch.tensor(pages, device=DEVICE), torch.tensor(starts, device=DEVICE)
            summ[pages_t, :, j * dg:(j + 1) * dg] = summarize_pages(
                self.k_buf, pages_t * sub_blocks + j, starts_t + j * size, self.model_table, self.gate_table,
                self.w_k.float(), self.k_norm, size)
        if integer_summaries:  # exact scores in any summation order: ties are real ties on both sides
            summ = torch.randint(-2, 3, summ.shape, generator=g).float().to(DEVICE)
        self.summaries = summ.to(summary_dtype)

    def workspace(self, top_k, **kw):
        # Several front units per (row, kv head), as on a GPU (the CPU default is one of each).
        kw.setdefault("qchunk", 4 if self.d <= 16 else 16)
        kw.setdefault("kchunk", 2 if self.d <= 16 else 8)
        geo = fused.StepGeometry(self.h_kv, self.group, self.d, self.d, self.dg, top_k, self.b, self.sub)
        return fused.DecodeStepWorkspace(geo, len(self.lens), self.max_blocks, DEVICE, **kw)


LENS = [1, 4, 7, 8, 13, 24, 37]  # empty history, exactly full blocks (4, 8, 24), partial ones


@pytest.mark.parametrize("group", [1, 3, 7, 8])
def test_front_matches_reference(paged_case, group):
    c = StepCase(paged_case, LENS, group, seed=group)
    ws = c.workspace(top_k=2)
    ref_summ = c.summaries.clone()
    ref_gq = naive.front(c.q, c.model_cs, c.gate_cs, c.w_q, c.q_norm, c.k_buf, c.model_table, c.gate_table, c.w_k,
                         c.k_norm, ref_summ, c.table, c.seq_lens, c.b)
    summ = c.summaries.clone()
    summ[1:] += 1.0  # rows the kernel must overwrite differ from the reference's until it does
    summ_before = summ.clone()
    gq = fused.front(ws, c.q, c.model_cs, c.gate_cs, c.w_q, c.q_norm, c.k_buf, c.model_table, c.gate_table,
                     c.w_k, c.k_norm, summ, c.table, c.seq_lens)
    torch.testing.assert_close(gq, ref_gq, rtol=1e-5, atol=1e-5)
    assert ws.uq == group * 2 and ws.uk == 4  # the last-arriving-unit merges ran
    done = [r for r, n in enumerate(LENS) if n % c.b == 0]
    written = set()
    for r in done:
        page = int(c.table[r, LENS[r] // c.b - 1]) // c.b
        written.add(page)
        torch.testing.assert_close(summ[page], ref_summ[page], rtol=1e-5, atol=1e-5)
    others = [p for p in range(summ.shape[0]) if p not in written]
    assert torch.equal(summ[others], summ_before[others])  # no other page touched (page 0 included)
    assert int(ws.front_counters.abs().sum()) == 0  # every counter reset for the next launch


@pytest.mark.parametrize("d,dg,b,dtype", [(64, 32, 4, torch.bfloat16), (128, 32, 4, torch.float16),
                                          (128, 32, 4, torch.float32), (64, 128, 64, torch.bfloat16),
                                          (128, 128, 64, torch.bfloat16)])
def test_front_head_dims_and_dtypes(paged_case, d, dg, b, dtype):
    """Head dims 64/128, the served block size 64 and gate dim 128, bf16 weights and a bf16 summary pool: the
    gate query, and the summary written to exactly the pages of the blocks the new tokens complete."""
    lens = [2 * b, b + 1, 4 * b, 3]  # rows 0 and 2 complete a block
    c = StepCase(paged_case, lens, 4, d=d, dg=dg, b=b, kv_dtype=dtype, weight_dtype=torch.bfloat16,
                 summary_dtype=torch.bfloat16, seed=d + dg + b)
    ws = c.workspace(top_k=1)
    ref_summ = c.summaries.clone()
    ref_gq = naive.front(c.q, c.model_cs, c.gate_cs, c.w_q, c.q_norm, c.k_buf, c.model_table, c.gate_table, c.w_k,
                         c.k_norm, ref_summ, c.table, c.seq_lens, c.b)
    summ = c.summaries.clone()
    summ[1:] += 1.0  # a page the kernel must write differs from the reference's until it does
    summ_before = summ.clone()
    gq = fused.front(ws, c.q, c.model_cs, c.gate_cs, c.w_q, c.q_norm, c.k_buf, c.model_table, c.gate_table,
                     c.w_k, c.k_norm, summ, c.table, c.seq_lens)
    torch.testing.assert_close(gq, ref_gq, rtol=1e-4, atol=1e-4)
    written = {int(c.table[r, n // b - 1]) // b for r, n in enumerate(lens) if n % b == 0}
    assert len(written) == 2
    for page in written:  # bf16 pool: the same value rounded once (the reference casts its fp32 summary alike)
        torch.testing.assert_close(summ[page].float(), ref_summ[page].float(), rtol=1e-2, atol=1e-2)
    others = [p for p in range(summ.shape[0]) if p not in written]
    assert torch.equal(summ[others], summ_before[others])


@pytest.mark.parametrize("d,b,dtype,sub", [(16, 8, torch.float32, 1), (64, 64, torch.bfloat16, 4)])
def test_front_writes_the_completed_blocks_4bit_key_codes(paged_case, d, b, dtype, sub):
    """key_codes (`--sas-rerank-keys int4`): each front unit writes its channels' 4-bit codes of the completed block
    (channel i and i + D/2 in one byte) and their fp16 min and step: bit for bit the plain statement
    (`ops.key_codes.naive`) at exactly the completed blocks' pages, nothing else touched, the summaries as without."""
    from sas_backend.ops.key_codes import naive as codes_naive

    lens = [2 * b, b + 1, 4 * b, 3]  # rows 0 and 2 complete a block
    c = StepCase(paged_case, lens, 4, d=d, dg=32, b=b, kv_dtype=dtype, sub_blocks=sub, seed=d + b)
    ws = c.workspace(top_k=1)
    pages = c.summaries.shape[0]
    packed = torch.full((pages, c.h_kv, b * d // 2), 9, dtype=torch.uint8, device=DEVICE)
    scales = torch.full((pages, c.h_kv, 2, d), -2.0, dtype=torch.float16, device=DEVICE)
    plain = c.summaries.clone()
    fused.front(ws, c.q, c.model_cs, c.gate_cs, c.w_q, c.q_norm, c.k_buf, c.model_table, c.gate_table, c.w_k,
                c.k_norm, plain, c.table, c.seq_lens)
    summ = c.summaries.clone()
    fused.front(ws, c.q, c.model_cs, c.gate_cs, c.w_q, c.q_norm, c.k_buf, c.model_table, c.gate_table, c.w_k,
                c.k_norm, summ, c.table, c.seq_lens, key_codes=(packed, scales))
    assert torch.equal(summ, plain)
    written = {int(c.table[r, n // b - 1]) // b for r, n in enumerate(lens) if n % b == 0}
    want = codes_naive.encode_pages(c.k_buf.cpu(), sorted(written), b)
    for page in range(pages):
        if page in want:
            assert torch.equal(packed[page].cpu(), want[page][0]) and torch.equal(scales[page].cpu(), want[page][1])
        else:
            assert bool((packed[page] == 9).all()) and bool((scales[page] == -2.0).all()), page
    assert int(ws.front_counters.abs().sum()) == 0


@pytest.mark.parametrize("top_k,sink,local,chunk", [(2, 0, 0, None), (3, 1, 1, 16), (5, 1, 2, 16), (40, 0, 0, None),
                                                    (1, 1, 0, 16), (4, 0, 0, 16)])
def test_select_matches_reference_with_ties(paged_case, top_k, sink, local, chunk):
    # Integer summaries and gate queries: exact scores, many exact ties (the lower block index wins).
    lens = [1, 5, 64, 65, 130, 260, 77]
    c = StepCase(paged_case, lens, 3, integer_summaries=True, seed=top_k)
    gq = torch.randint(-2, 3, (len(lens), c.h_kv, c.dg), generator=c.case.gen).float().to(DEVICE)
    ws = c.workspace(top_k=top_k, chunk=chunk)
    ref = naive.select(gq, c.summaries, c.table, c.n_cand, c.b, c.max_blocks, top_k, sink, local)
    got = fused.select(ws, gq, c.summaries, c.table, c.n_cand, c.max_blocks, sink, local)
    assert torch.equal(got, ref)
    assert int(ws.select_counters.abs().sum()) == 0
    if chunk == 16:
        assert ws.select_chunks(c.max_blocks) > 1  # the merge ran


def test_select_chunk_rule_per_batch_size(paged_case):
    """A per-batch-size chunk rule ({min_bs: chunk}, as the settings table may hold one): a batch below the edge
    and one above it each select with their own chunk (own grid, survivors and merge tile) from one workspace
    whose partials fit both, and both equal the reference; the rule changes no selection."""
    lens = [1, 5, 64, 65, 130, 260, 77, 200]
    c = StepCase(paged_case, lens, 3, integer_summaries=True, seed=21)
    gq = torch.randint(-2, 3, (len(lens), c.h_kv, c.dg), generator=c.case.gen).float().to(DEVICE)
    ws = c.workspace(top_k=3, chunk={1: 16, 4: 32, "6": 64})
    assert [ws.select_chunk(bs) for bs in (1, 3, 4, 5, 6, 8)] == [16, 16, 32, 32, 64, 64]
    assert ws.slots(1) == 3 and ws.select_chunks(c.max_blocks, 1) > ws.select_chunks(c.max_blocks, 8)
    for bs in (3, 5, 8):
        ref = naive.select(gq[:bs], c.summaries, c.table[:bs], c.n_cand[:bs], c.b, c.max_blocks, 3, 1, 1)
        got = fused.select(ws, gq[:bs], c.summaries, c.table[:bs], c.n_cand[:bs], c.max_blocks, 1, 1)
        assert torch.equal(got, ref), bs
        assert int(ws.select_counters.abs().sum()) == 0
    # The partials hold the hungriest batch of each rule entry (here the 3-row batch of 16-block chunks).
    need = max(bs * c.h_kv * 2 * ws.select_chunks(c.max_blocks, bs) * ws.slots(bs) for bs in range(1, 9))
    assert ws.select_partials.numel() == need


@pytest.mark.parametrize("rule,message", [({0: 64}, "start at 1"), ({1: 48}, "power of two"), (8, "power of two"),
                                          ({"x": 64}, "batch sizes")])
def test_select_chunk_rule_is_checked(rule, message):
    geo = fused.StepGeometry(2, 2, 16, 16, 16, 4, 4)
    with pytest.raises(ValueError, match=message):
        fused.DecodeStepWorkspace(geo, 4, 64, DEVICE, chunk=rule)


@pytest.mark.parametrize("dg,summary_dtype", [(64, torch.bfloat16), (128, torch.bfloat16), (128, torch.float32)])
def test_select_gate_dims_and_bf16_summaries(paged_case, dg, summary_dtype):
    """The served geometry: block size 64, gate dim 128 (the select's dot in several Dg tiles), a bf16 summary
    pool (the GPU default). Integer summaries and queries are exact in bf16, so the selection is exact."""
    b = 64
    lens = [1, b + 1, 9 * b + 3, 12 * b, 40 * b + 17]
    c = StepCase(paged_case, lens, 4, d=16, dg=dg, b=b, integer_summaries=True, summary_dtype=summary_dtype,
                 seed=dg)
    gq = torch.randint(-2, 3, (len(lens), c.h_kv, c.dg), generator=c.case.gen).float().to(DEVICE)
    ws = c.workspace(top_k=5, chunk=16)
    ref = naive.select(gq, c.summaries, c.table, c.n_cand, c.b, c.max_blocks, 5, 1, 1)
    got = fused.select(ws, gq, c.summaries, c.table, c.n_cand, c.max_blocks, 1, 1)
    assert ws.select_chunks(c.max_blocks) > 1
    assert torch.equal(got, ref)


@pytest.mark.parametrize("anchor_count", [1, 3])
def test_select_anchors_and_padded_rows(paged_case, anchor_count):
    lens = [300, 1, 1, 97, 33]  # rows 1 and 2 stand for a graph's padding rows (seq_len 1)
    c = StepCase(paged_case, lens, 2, seed=11 + anchor_count)
    gq = torch.randn(len(lens), c.h_kv, c.dg, generator=c.case.gen).to(DEVICE)
    anchors = torch.randint(-1, 80, (len(lens), c.h_kv, anchor_count), generator=c.case.gen).to(DEVICE, torch.int32)
    ws = c.workspace(top_k=6, chunk=16)
    ref = naive.select(gq, c.summaries, c.table, c.n_cand, c.b, c.max_blocks, 6, 1, 1, anchors=anchors)
    got = fused.select(ws, gq, c.summaries, c.table, c.n_cand, c.max_blocks, 1, 1, anchors=anchors)
    assert torch.equal(got, ref)
    # The server's way: a pool of anchor rows read at the batch's req pool indices.
    pool = torch.full((len(lens) + 3, c.h_kv, anchor_count), -1, dtype=torch.int32, device=DEVICE)
    rows = torch.randperm(len(lens) + 3, generator=c.case.gen)[: len(lens)].to(DEVICE)
    pool[rows] = anchors
    got_pool = fused.select(ws, gq, c.summaries, c.table, c.n_cand, c.max_blocks, 1, 1, anchors=pool,
                            anchor_rows=rows)
    assert torch.equal(got_pool, ref)
    for r, n in enumerate(lens):  # every anchor that is a candidate is selected
        for h in range(c.h_kv):
            for a in anchors[r, h].tolist():
                if 0 <= a < (n - 1) // c.b:
                    assert a in got[r, h].tolist()


def test_select_random_scores_agree_up_to_rounding(paged_case):
    # Continuous scores: the kernel sums the dot in another order, so a selection may differ only where two
    # reference scores are within rounding of each other.
    lens = [513, 260, 129]
    c = StepCase(paged_case, lens, 4, dg=32, seed=5)
    gq = torch.randn(len(lens), c.h_kv, c.dg, generator=c.case.gen).to(DEVICE)
    ws = c.workspace(top_k=7, chunk=32)
    scores = naive.scores(gq, c.summaries, c.table, c.n_cand, c.b, c.max_blocks)
    ref = naive.select(gq, c.summaries, c.table, c.n_cand, c.b, c.max_blocks, 7)
    got = fused.select(ws, gq, c.summaries, c.table, c.n_cand, c.max_blocks)
    assert got.shape == ref.shape and bool((got >= 0).all())  # every row has more than 7 candidates
    assert bool((got[..., 1:] > got[..., :-1]).all())  # ascending, no repeats
    for r in range(len(lens)):
        for h in range(c.h_kv):
            a, b = set(ref[r, h].tolist()), set(got[r, h].tolist())
            assert len(a - b) == len(b - a)
            for x, y in zip(sorted(a - b), sorted(b - a)):
                assert abs(float(scores[r, h, x]) - float(scores[r, h, y])) < 1e-5


@pytest.mark.parametrize("group", [1, 3, 4, 7, 8])
@pytest.mark.parametrize("target", [1, 64])
def test_attend_matches_reference(paged_case, group, target):
    c = StepCase(paged_case, LENS + [70], group, seed=20 + group)
    ws = c.workspace(top_k=3, target_programs=target)
    sel = naive.select(c.gate_cs[:, None, :].expand(-1, c.h_kv, -1).contiguous(), c.summaries, c.table, c.n_cand,
                       c.b, c.max_blocks, 3)
    ref = naive.attend(c.q, c.k_buf, c.v_buf, sel, c.table, c.seq_lens, c.b, c.d**-0.5)
    got = fused.attend(ws, c.q, c.k_buf, c.v_buf, sel, c.table, c.seq_lens, c.d**-0.5)
    if target > 1:
        assert ws.attend_splits(len(c.lens)) > 1  # the in-kernel merge ran
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert int(ws.attend_counters.abs().sum()) == 0


@pytest.mark.parametrize("d,dtype,b", [(64, torch.bfloat16, 64), (128, torch.float16, 16), (128, torch.bfloat16, 64),
                                       (64, torch.float32, 64)])
def test_attend_head_dims_dtypes_and_block_64(paged_case, d, dtype, b):
    lens = [3 * b, 2 * b + 5, 1, 5 * b - 1]
    c = StepCase(paged_case, lens, 4, d=d, dg=32, b=b, kv_dtype=dtype, seed=d + b)
    ws = c.workspace(top_k=2, target_programs=16)
    sel = naive.select(torch.randn(len(lens), c.h_kv, c.dg, generator=c.case.gen).to(DEVICE), c.summaries, c.table,
                       c.n_cand, b, c.max_blocks, 2)
    ref = naive.attend(c.q, c.k_buf, c.v_buf, sel, c.table, c.seq_lens, b, d**-0.5)
    got = fused.attend(ws, c.q, c.k_buf, c.v_buf, sel, c.table, c.seq_lens, d**-0.5)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_attend_fp32_token_tiles(paged_case, monkeypatch):
    """The GPU's fp32 K/V path: each 64-token block read in 16-token tiles, tiles past the newest token all
    masked. The interpreter reads whole blocks, so it is told it is not interpreting to take that path."""
    monkeypatch.setattr(fused, "_interpreting", lambda: False)
    b, d = 64, 64
    lens = [3 * b, 2 * b + 5, 1, 5 * b - 1, b + 17]
    c = StepCase(paged_case, lens, 3, d=d, dg=32, b=b, seed=31)
    ws = c.workspace(top_k=2, target_programs=8)
    sel = naive.select(torch.randn(len(lens), c.h_kv, c.dg, generator=c.case.gen).to(DEVICE), c.summaries, c.table,
                       c.n_cand, b, c.max_blocks, 2)
    ref = naive.attend(c.q, c.k_buf, c.v_buf, sel, c.table, c.seq_lens, b, d**-0.5)
    got = fused.attend(ws, c.q, c.k_buf, c.v_buf, sel, c.table, c.seq_lens, d**-0.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_attend_covering_budget_is_dense(paged_case):
    # Budget >= context: every block is selected, so the sparse result is dense decode attention.
    lens = [1, 4, 9, 17, 30]
    c = StepCase(paged_case, lens, 3, seed=3)
    ws = c.workspace(top_k=8, target_programs=8)
    sel = naive.select(torch.zeros(len(lens), c.h_kv, c.dg, device=DEVICE), c.summaries, c.table, c.n_cand, c.b,
                       c.max_blocks, 8)
    got = fused.attend(ws, c.q, c.k_buf, c.v_buf, sel, c.table, c.seq_lens, c.d**-0.5)
    for r, n in enumerate(lens):
        slots = c.case.req_to_token[int(c.case.req_pool_indices[r]), :n].long()
        ks = c.k_buf[slots].transpose(0, 1).repeat_interleave(3, 0)
        vs = c.v_buf[slots].transpose(0, 1).repeat_interleave(3, 0)
        dense = torch.nn.functional.scaled_dot_product_attention(c.q[r][:, None], ks, vs, scale=c.d**-0.5)
        torch.testing.assert_close(got[r], dense[:, 0], rtol=1e-5, atol=1e-5)


def test_whole_step_matches_reference_chain(paged_case):
    """front -> select -> attend, twice over one workspace (counters reset), equals the reference chain."""
    lens = [64, 129, 1, 200]
    c = StepCase(paged_case, lens, 4, seed=9)
    ws = c.workspace(top_k=5, chunk=16, target_programs=8)
    for _ in range(2):
        ref_summ, summ = c.summaries.clone(), c.summaries.clone()
        gq_ref = naive.front(c.q, c.model_cs, c.gate_cs, c.w_q, c.q_norm, c.k_buf, c.model_table, c.gate_table,
                             c.w_k, c.k_norm, ref_summ, c.table, c.seq_lens, c.b)
        sel_ref = naive.select(gq_ref, ref_summ, c.table, c.n_cand, c.b, c.max_blocks, 5, 1, 1)
        out_ref = naive.attend(c.q, c.k_buf, c.v_buf, sel_ref, c.table, c.seq_lens, c.b, c.d**-0.5)
        gq = fused.front(ws, c.q, c.model_cs, c.gate_cs, c.w_q, c.q_norm, c.k_buf, c.model_table, c.gate_table,
                         c.w_k, c.k_norm, summ, c.table, c.seq_lens)
        sel = fused.select(ws, gq, summ, c.table, c.n_cand, c.max_blocks, 1, 1)
        out = fused.attend(ws, c.q, c.k_buf, c.v_buf, sel, c.table, c.seq_lens, c.d**-0.5)
        assert torch.equal(sel, sel_ref)
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)


def test_attend_with_one_split_writes_its_output_directly(paged_case):
    """Issue 64 item 6: with one split (a batch that fills the device alone) attend stores no partials and takes no
    arrival counter: the partial buffers keep a sentinel, the counters stay zero, and the output is the reference's
    and bit-identical to the merged path's answer for one split (acc / l)."""
    c = StepCase(paged_case, LENS + [70], 4, seed=41)
    ws = c.workspace(top_k=3, target_programs=1)
    assert ws.attend_splits(len(c.lens)) == 1
    sel = naive.select(c.gate_cs[:, None, :].expand(-1, c.h_kv, -1).contiguous(), c.summaries, c.table, c.n_cand,
                       c.b, c.max_blocks, 3)
    ws.attend_stats.fill_(float("nan"))
    ws.attend_partials.fill_(float("nan"))
    got = fused.attend(ws, c.q, c.k_buf, c.v_buf, sel, c.table, c.seq_lens, c.d**-0.5)
    ref = naive.attend(c.q, c.k_buf, c.v_buf, sel, c.table, c.seq_lens, c.b, c.d**-0.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    if DEVICE.type == "cpu":  # the interpreter runs the kernel as written: nothing stored beside out
        assert bool(ws.attend_stats.isnan().all()) and bool(ws.attend_partials.isnan().all())
    assert int(ws.attend_counters.abs().sum()) == 0


# ------------------------------------------------------------------ sub-block summaries (issue 63)
def _runs_statement(c, gq, summaries, sub):
    """The best-run rule stated from the one-summary score: each run's columns scored alone, max over runs."""
    from sas_backend.ops.score.torch_path import score_blocks

    dg = c.dg
    return torch.stack([score_blocks(gq, summaries[..., j * dg:(j + 1) * dg].float(), c.table, c.n_cand, c.b,
                                     c.max_blocks) for j in range(sub)]).amax(dim=0)


@pytest.mark.parametrize("group,sub", [(1, 2), (3, 4), (7, 2), (8, 4)])
def test_front_sub_blocks_matches_reference(paged_case, group, sub):
    """With n sub-block summaries the front writes each run of b / n tokens' summary (its pooling, RoPE undone at
    the run's positions, gate RoPE at its start) into columns j*Dg.. of the page's row, every run equal to the
    whole-block summary of a block of b / n tokens; split front units (several per row) merge per run."""
    c = StepCase(paged_case, LENS, group, seed=50 + group, sub_blocks=sub)
    ws = c.workspace(top_k=2)
    ref_summ = c.summaries.clone()
    ref_gq = naive.front(c.q, c.model_cs, c.gate_cs, c.w_q, c.q_norm, c.k_buf, c.model_table, c.gate_table, c.w_k,
                         c.k_norm, ref_summ, c.table, c.seq_lens, c.b, sub_blocks=sub)
    summ = c.summaries.clone()
    summ[1:] += 1.0
    summ_before = summ.clone()
    gq = fused.front(ws, c.q, c.model_cs, c.gate_cs, c.w_q, c.q_norm, c.k_buf, c.model_table, c.gate_table,
                     c.w_k, c.k_norm, summ, c.table, c.seq_lens)
    torch.testing.assert_close(gq, ref_gq, rtol=1e-5, atol=1e-5)
    written = {int(c.table[r, n // c.b - 1]) // c.b for r, n in enumerate(LENS) if n % c.b == 0}
    assert written and ws.uk > 1
    for page in written:
        torch.testing.assert_close(summ[page], ref_summ[page], rtol=1e-5, atol=1e-5)
        assert not torch.equal(summ[page, :, :c.dg], summ[page, :, c.dg:2 * c.dg])  # the runs differ
    others = [p for p in range(summ.shape[0]) if p not in written]
    assert torch.equal(summ[others], summ_before[others])
    assert int(ws.front_counters.abs().sum()) == 0


def test_front_sub_blocks_served_geometry(paged_case):
    """Block 64, head dim 64, gate dim 128, 4 runs of 16 tokens, bf16 K/V, weights and pool (the Qwen gate's)."""
    b = 64
    lens = [2 * b, b + 1, 4 * b, 3]
    c = StepCase(paged_case, lens, 7, d=64, dg=128, b=b, kv_dtype=torch.bfloat16, weight_dtype=torch.bfloat16,
                 summary_dtype=torch.bfloat16, seed=77, sub_blocks=4)
    ws = c.workspace(top_k=1)
    ref_summ = c.summaries.clone()
    naive.front(c.q, c.model_cs, c.gate_cs, c.w_q, c.q_norm, c.k_buf, c.model_table, c.gate_table, c.w_k,
                c.k_norm, ref_summ, c.table, c.seq_lens, c.b, sub_blocks=4)
    summ = c.summaries.clone()
    summ[1:] += 1.0
    fused.front(ws, c.q, c.model_cs, c.gate_cs, c.w_q, c.q_norm, c.k_buf, c.model_table, c.gate_table,
                c.w_k, c.k_norm, summ, c.table, c.seq_lens)
    for r in (0, 2):
        page = int(c.table[r, lens[r] // b - 1]) // b
        torch.testing.assert_close(summ[page].float(), ref_summ[page].float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("sub,anchors", [(2, 0), (4, 2), (4, 0)])
def test_select_sub_blocks_with_ties_and_anchors(paged_case, sub, anchors):
    """Integer run summaries and queries (exact scores, many ties): the fused select takes the best run of each
    block, as the stated rule (`_runs_statement`) ranks them, over several chunks and the in-kernel merge."""
    lens = [1, 5, 64, 65, 130, 260, 77]
    c = StepCase(paged_case, lens, 3, integer_summaries=True, seed=60 + sub + anchors, sub_blocks=sub)
    gq = torch.randint(-2, 3, (len(lens), c.h_kv, c.dg), generator=c.case.gen).float().to(DEVICE)
    anc = (torch.randint(-1, 60, (len(lens), c.h_kv, anchors), generator=c.case.gen).to(DEVICE, torch.int32)
           if anchors else None)
    ws = c.workspace(top_k=5, chunk=16)
    torch.testing.assert_close(naive.scores(gq, c.summaries, c.table, c.n_cand, c.b, c.max_blocks, sub_blocks=sub),
                               _runs_statement(c, gq, c.summaries, sub))
    ref = naive.select(gq, c.summaries, c.table, c.n_cand, c.b, c.max_blocks, 5, 1, 1, anchors=anc, sub_blocks=sub)
    got = fused.select(ws, gq, c.summaries, c.table, c.n_cand, c.max_blocks, 1, 1, anchors=anc)
    assert ws.select_chunks(c.max_blocks) > 1
    assert torch.equal(got, ref)
    assert int(ws.select_counters.abs().sum()) == 0


def test_select_sub_blocks_keeps_a_needle_run(paged_case):
    """One run of one block scores high and that block's other runs very low: the best-run rule selects it (its
    mean over runs would rank it last), where every other block's runs are all middling."""
    lens = [40 * 4 + 1]
    c = StepCase(paged_case, lens, 2, seed=5, sub_blocks=4)
    gq = torch.ones(1, c.h_kv, c.dg, device=DEVICE)
    summ = torch.zeros_like(c.summaries)
    needle_block = 17
    page = int(c.table[0, needle_block]) // c.b
    summ[page] = -5.0
    summ[page, :, 2 * c.dg:3 * c.dg] = 3.0  # run 2: the needle
    for m in range(40):
        if m != needle_block:
            summ[int(c.table[0, m]) // c.b] = 1.0
    ws = c.workspace(top_k=3, chunk=16)
    got = fused.select(ws, gq, summ, c.table, c.n_cand, c.max_blocks)
    assert needle_block in got[0, 0].tolist() and needle_block in got[0, 1].tolist()
    mean_rule = summ.view(summ.shape[0], c.h_kv, 4, c.dg).mean(2)  # one pooled summary would lose it
    assert float(mean_rule[page, 0].sum()) < float(mean_rule[int(c.table[0, 0]) // c.b, 0].sum())


def test_whole_step_sub_blocks_matches_reference_chain(paged_case):
    """front -> select -> attend with 4 sub-block summaries, twice over one workspace, equals the reference chain."""
    lens = [64, 129, 1, 200]
    c = StepCase(paged_case, lens, 4, seed=19, sub_blocks=4)
    ws = c.workspace(top_k=5, chunk=16, target_programs=8)
    for _ in range(2):
        ref_summ, summ = c.summaries.clone(), c.summaries.clone()
        gq_ref = naive.front(c.q, c.model_cs, c.gate_cs, c.w_q, c.q_norm, c.k_buf, c.model_table, c.gate_table,
                             c.w_k, c.k_norm, ref_summ, c.table, c.seq_lens, c.b, sub_blocks=4)
        sel_ref = naive.select(gq_ref, ref_summ, c.table, c.n_cand, c.b, c.max_blocks, 5, 1, 1, sub_blocks=4)
        out_ref = naive.attend(c.q, c.k_buf, c.v_buf, sel_ref, c.table, c.seq_lens, c.b, c.d**-0.5)
        gq = fused.front(ws, c.q, c.model_cs, c.gate_cs, c.w_q, c.q_norm, c.k_buf, c.model_table, c.gate_table,
                         c.w_k, c.k_norm, summ, c.table, c.seq_lens)
        sel = fused.select(ws, gq, summ, c.table, c.n_cand, c.max_blocks, 1, 1)
        out = fused.attend(ws, c.q, c.k_buf, c.v_buf, sel, c.table, c.seq_lens, c.d**-0.5)
        torch.testing.assert_close(summ, ref_summ, rtol=1e-5, atol=1e-5)
        assert torch.equal(sel, sel_ref)
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)


def test_sub_blocks_shape_is_checked(paged_case):
    """A pool one summary wide given to a sub-block geometry (or the reverse) is refused by name, not misread."""
    c = StepCase(paged_case, [9, 13], 2, seed=1)
    geo = fused.StepGeometry(c.h_kv, c.group, c.d, c.d, c.dg, 2, c.b, sub_blocks=2)
    ws = fused.DecodeStepWorkspace(geo, 2, c.max_blocks, DEVICE)
    gq = torch.zeros(2, c.h_kv, c.dg, device=DEVICE)
    with pytest.raises(ValueError, match="n \\* Dg"):
        fused.select(ws, gq, c.summaries, c.table, c.n_cand, c.max_blocks)
    with pytest.raises(ValueError, match="sub_blocks must be a power of two"):
        fused.StepGeometry(c.h_kv, c.group, c.d, c.d, c.dg, 2, c.b, sub_blocks=3).check()
