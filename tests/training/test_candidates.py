"""Candidate long-context selectors (`hf.candidates`) against plain loop statements of their rules, and
served through the harness (`hf.sparse_eval`): a per-token max over complete blocks before each query's own,
RoPE pairs as exact partial dot products, the gate over sub-blocks with S = b equal to the gate itself."""

from __future__ import annotations

import pytest
import torch

from sas_backend.gate.module import AttnGate
from sas_backend.hf.candidates import (
    calibrate_pairs, candidate_scores, fit_pca, gate_exact_factor, is_candidate, pair_dims, token_max_scores,
)
from sas_backend.hf.sparse_eval import SparseEvalSpec, block_scores, model_rope_table, select_for_queries, sparse_eval

B = 16
inf = float("inf")


def _loop_token_max(q, k, positions, b, dims=None):
    """The rule written out: block m (complete, m < pos // b) scores max_{t in m, g} sum_{c in dims} q[g,c] k[t,c]."""
    p_cnt, h_q, d = q.shape
    t, h_kv, _ = k.shape
    g = h_q // h_kv
    m_w = max(t // b, 1)
    out = torch.full((p_cnt, h_kv, m_w), float("-inf"))
    for p in range(p_cnt):
        for h in range(h_kv):
            chans = list(range(d)) if dims is None else dims[h].tolist()
            for m in range(int(positions[p]) // b):
                best = max(float(sum(q[p, h * g + j, c] * k[tok, h, c] for c in chans))
                           for j in range(g) for tok in range(m * b, (m + 1) * b))
                out[p, h, m] = best
    return out


@pytest.mark.parametrize("group", [1, 3, 7])
def test_token_max_matches_the_loop(group):
    torch.manual_seed(group)
    h_kv, d, t = 2, 8, 5 * B + 7  # a partial last block
    q = torch.randn(4, h_kv * group, d)
    k = torch.randn(t, h_kv, d)
    positions = torch.tensor([5, 16, 40, t - 1])  # no candidate, one, two, all complete before its own
    want = _loop_token_max(q, k, positions, B)
    assert torch.allclose(token_max_scores(q, k, positions, B), want, atol=1e-5)
    dims = torch.tensor([[0, 3, 4, 7], [1, 2, 5, 6]])
    assert torch.allclose(token_max_scores(q, k, positions, B, dims), _loop_token_max(q, k, positions, B, dims),
                          atol=1e-5)
    assert torch.isinf(token_max_scores(q, k, positions, B)[0]).all()


def test_pairs_are_rotation_invariant_shares_of_qk():
    """A RoPE pair's partial dot is the same before and after rotating q and k by their positions' angles
    relative to each other: pairs (i, i + D/2) are what RoPE rotates, so the candidate is position-exact."""
    torch.manual_seed(0)
    d = 8
    pairs = torch.tensor([[1, 3]])
    dims = pair_dims(pairs, d)[0]
    assert dims.tolist() == [1, 3, 5, 7]
    q, k = torch.randn(d), torch.randn(d)

    def rot(x, angle):
        half = d // 2
        theta = angle * torch.arange(1, half + 1).float()
        c, s = torch.cos(theta), torch.sin(theta)
        return torch.cat([x[:half] * c - x[half:] * s, x[half:] * c + x[:half] * s])

    before = (rot(q, 5.0)[dims] * rot(k, 2.0)[dims]).sum()
    after = (rot(q, 9.0)[dims] * rot(k, 6.0)[dims]).sum()  # the same relative offset
    assert torch.allclose(before, after, atol=1e-5)


def test_calibration_prefers_pairs_that_spread_scores():
    """A pair with huge but constant products (every key the same there) must lose to a pair whose products
    vary across keys, however small."""
    torch.manual_seed(0)
    t, d = 128, 8
    q = torch.randn(t, 2, d) * 0.1
    k = torch.randn(t, 1, d) * 0.1
    q[..., 0] = 100.0  # pair 0: large, constant
    k[..., 0] = 100.0
    q[..., 2] = 1.0  # pair 2 (dims 2, 6): keys vary
    k[..., 2] = torch.randn(t, 1) * 3
    chosen = calibrate_pairs(q, k, 1)
    assert chosen.tolist() == [[2]]


def test_pair_spread_is_the_variance_over_causal_keys():
    """The prefix-sum form equals the statement: per sampled query i and head, the variance over keys j <= i
    of the pair's share of q.k, averaged."""
    from sas_backend.hf.candidates import pair_spread

    torch.manual_seed(2)
    t, d, h_kv, g = 40, 8, 2, 3
    q, k = torch.randn(t, h_kv * g, d), torch.randn(t, h_kv, d)
    got = pair_spread(q, k, queries=7, seed=5)
    rows = torch.randint(t // 2, t, (7,), generator=torch.Generator().manual_seed(5))
    want = torch.zeros(h_kv, d // 2)
    for h in range(h_kv):
        for p in range(d // 2):
            vals = []
            for i in rows.tolist():
                for j in range(g):
                    c = torch.tensor([float(q[i, h * g + j, p] * k[x, h, p] + q[i, h * g + j, p + d // 2]
                                            * k[x, h, p + d // 2]) for x in range(i + 1)])
                    vals.append(float(c.var(unbiased=False)))
            want[h, p] = sum(vals) / len(vals)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def _gate_world():
    from transformers import LlamaConfig, LlamaForCausalLM

    from sas_backend.geometry import ModelGeometry, gate_rope_table

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    gate = AttnGate(2, 2, 16, 32)
    for p in gate.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return gate, model_rope_table(model, 256), gate_rope_table(32, ModelGeometry.from_hf_config(cfg), 256)


def test_sub_block_scores_are_the_best_run():
    """gatesub<S> / questsub<S>: each S-token run summarized as a block of S tokens (the ops' own statement of a
    block, RoPE at the run's start), the block scoring the max of its runs; S = b is today's selector."""
    gate, table, gtable = _gate_world()
    t = 6 * B + 3
    k = torch.randn(t, 2, 16)
    q = torch.randn(3, 4, 16)
    positions = torch.tensor([20, 70, t - 1])
    for base in ("gate", "quest"):
        spec = SparseEvalSpec(top_k=2, block_size=B, selector=base, gates={0: gate})
        whole = block_scores(spec, 0, q, k, positions, table, gtable)
        same = SparseEvalSpec(top_k=2, block_size=B, selector=f"{base}sub{B}", gates={0: gate})
        assert torch.equal(block_scores(same, 0, q, k, positions, table, gtable), whole)
        size = B // 4
        run_spec = SparseEvalSpec(top_k=2, block_size=size, selector=base, gates={0: gate})
        # the runs scored as blocks of `size` tokens: a query at p has p // size runs before its own run
        run_scores = block_scores(run_spec, 0, q, k, positions, table, gtable)  # [P, H, t // size]
        got = block_scores(SparseEvalSpec(top_k=2, block_size=B, selector=f"{base}sub{size}", gates={0: gate}),
                           0, q, k, positions, table, gtable)
        for p, pos in enumerate(positions.tolist()):
            for m in range(t // B):
                want = run_scores[p, :, m * 4:(m + 1) * 4].amax(-1) if m < pos // B else torch.full((2,), -inf)
                assert torch.allclose(got[p, :, m], want, atol=1e-5), (base, p, m)
        assert not torch.allclose(got, whole)
    with pytest.raises(ValueError, match="divide"):
        block_scores(SparseEvalSpec(top_k=2, block_size=B, selector="gatesub5", gates={0: gate}), 0, q, k,
                     positions, table, gtable)


def _two_level_world(seed: int):
    """(gate, model table, gate table, q [3, 4, 16], k [12 * B + 5, 2, 16], positions [3]) for the two-level tests:
    12 complete blocks, queries with 1, 6 and 12 candidates."""
    gate, table, gtable = _gate_world()
    t = 12 * B + 5
    torch.manual_seed(seed)
    k = torch.randn(t, 2, 16)
    q = torch.randn(3, 4, 16)
    return gate, table, gtable, q, k, torch.tensor([20, 100, t - 1])


def test_two_level_keeps_the_first_levels_best_then_ranks_by_runs():
    """gatesub<S>c<X>: the one-summary gate keeps each row's X x K best candidate blocks, which keep their
    gatesub<S> scores; every other block scores -inf. X x K >= the candidates: gatesub<S> itself."""
    gate, table, gtable, q, k, positions = _two_level_world(3)
    spec = lambda name: SparseEvalSpec(top_k=2, block_size=B, selector=name, gates={0: gate})  # noqa: E731
    first = block_scores(spec("gate"), 0, q, k, positions, table, gtable).detach()
    runs = block_scores(spec("gatesub4"), 0, q, k, positions, table, gtable)
    got = block_scores(spec("gatesub4c2"), 0, q, k, positions, table, gtable)
    for p, pos in enumerate(positions.tolist()):
        n_cand = pos // B
        for h in range(2):
            ranked = sorted(range(n_cand), key=lambda m: -float(first[p, h, m]))
            kept = set(ranked[:4])  # X x K = 2 x 2
            for m in range(got.shape[-1]):
                want = runs[p, h, m] if m in kept else torch.tensor(-inf)
                assert torch.equal(got[p, h, m], want), (p, h, m)
    assert torch.equal(block_scores(spec("gatesub4c6"), 0, q, k, positions, table, gtable), runs)  # 12 >= 12
    assert is_candidate("gatesub16c4") and not is_candidate("gatesub16c")
    with pytest.raises(ValueError, match="two levels"):
        block_scores(SparseEvalSpec(top_k=2, block_size=B, selector="questsub4c2"), 0, q, k, positions, table,
                     gtable)


def test_two_level_exact_keeps_the_gates_best_then_ranks_by_block_mass():
    """gatec<X>exact selects as the server's `--sas-exact-rerank X`: the gate (with the spec's sub_blocks) picks
    each row's X x K blocks (forced sink / local blocks in, then by score), and of those the K of highest mass among
    themselves are kept (stated here by the loop: each query head's softmax over the KEPT blocks' keys, a block's
    share max over the group's heads), forced blocks first. X x K >= the candidates: exactmass's own pick."""
    gate, table, gtable, q, k, positions = _two_level_world(4)
    for sub, sink, local in ((1, 0, 0), (4, 0, 0), (1, 1, 1)):
        spec = lambda name: SparseEvalSpec(top_k=2, block_size=B, selector=name, gates={0: gate},  # noqa: E731
                                           sub_blocks=sub, sink_blocks=sink, local_blocks=local)
        first = block_scores(spec("gate"), 0, q, k, positions, table, gtable).detach()
        got = select_for_queries(spec("gatec2exact"), 0, q, k, positions, table, gtable)
        for p, pos in enumerate(positions.tolist()):
            n_cand = pos // B
            for h in range(2):
                forced = sorted({m for m in range(n_cand) if m < sink or m >= n_cand - local})
                ranked = sorted((m for m in range(n_cand) if m not in forced), key=lambda m: -float(first[p, h, m]))
                order = sorted(forced + ranked[:4 - len(forced)])  # X x K = 2 x 2
                keys = torch.cat([k[m * B:(m + 1) * B, h] for m in order])  # the kept blocks' keys only
                logits = (q[p, 2 * h: 2 * h + 2] @ keys.T) / 4.0  # [G, 4 * B] (D = 16)
                mass = torch.softmax(logits, dim=-1).view(2, len(order), B).sum(-1).amax(0)
                best = sorted((m for m in order if m not in forced), key=lambda m: -float(mass[order.index(m)]))
                want = sorted(forced + best[:2 - len(forced)])
                assert got[p, h].tolist() == want + [-1] * (2 - len(want)), (sub, sink, p, h)
        exact = select_for_queries(spec("exactmass"), 0, q, k, positions, table, gtable)
        assert torch.equal(select_for_queries(spec("gatec6exact"), 0, q, k, positions, table, gtable), exact)
    assert is_candidate("gatec2exact") and not is_candidate("gatecexact")
    with pytest.raises(ValueError, match="needs gates"):
        SparseEvalSpec(top_k=2, selector="gatec2exact")
    # gatesub<S>c<X>exact names its first level's runs itself (bench/retrieval.py has no --sub-blocks): the same
    # selection as gatec<X>exact over b / S summaries a block, which here differs from one summary's.
    spec = lambda name, sub: SparseEvalSpec(top_k=2, block_size=B, selector=name, gates={0: gate},  # noqa: E731
                                            sub_blocks=sub)
    runs = select_for_queries(spec(f"gatesub{B // 4}c2exact", 1), 0, q, k, positions, table, gtable)
    assert torch.equal(runs, select_for_queries(spec("gatec2exact", 4), 0, q, k, positions, table, gtable))
    assert not torch.equal(runs, select_for_queries(spec("gatec2exact", 1), 0, q, k, positions, table, gtable))
    assert is_candidate(f"gatesub{B // 4}c2exact") and gate_exact_factor(f"gatesub{B // 4}c3exact") == 3


def test_quantized_keys_round_each_block_and_channel_to_its_own_range():
    """quantize_keys: per (block, kv head, channel) the values land on 2^bits - 1 even steps between the block's min
    and max (both exact), within half a step of the input; a partial last block keeps its own range."""
    from sas_backend.hf.candidates import quantize_keys

    torch.manual_seed(5)
    keys = torch.randn(3 * B + 5, 2, 16) * torch.linspace(0.1, 4.0, 16)  # channels of very different ranges
    for bits in (2, 4, 8):
        got = quantize_keys(keys, bits, B)
        assert got.shape == keys.shape and got.dtype == keys.dtype
        for s0 in range(0, keys.shape[0], B):
            blk, out = keys[s0:s0 + B], got[s0:s0 + B]
            lo, hi = blk.amin(0), blk.amax(0)
            step = (hi - lo) / (2 ** bits - 1)
            assert torch.allclose(out.amin(0), lo, atol=1e-5) and torch.allclose(out.amax(0), hi, atol=1e-5)
            assert ((out - blk).abs() <= step / 2 + 1e-5).all()
            levels = (out - lo) / step
            assert torch.allclose(levels, levels.round(), atol=1e-3)
    assert (quantize_keys(keys, 4, B) - keys).abs().mean() < (quantize_keys(keys, 2, B) - keys).abs().mean()


def test_quantized_summaries_round_each_run_summary_to_its_own_range():
    """quantize_summaries: each run's summary (width values of one block and kv head) lands on 2^bits - 1 even steps
    from its own min (fp16-rounded, as a pool keeps it), within half a step of the input plus that rounding; and
    gate...c<X>exact[q<b>]s<bits> scores the gate over those summaries: the selection of `s8` is the unquantized
    one's in this world, `s1` changes it."""
    from sas_backend.hf.candidates import quantize_summaries, summary_bits

    torch.manual_seed(6)
    runs, width = 4, 16
    summ = torch.randn(5, 2, runs * width) * torch.linspace(0.1, 4.0, runs * width)
    for bits in (2, 4, 8):
        got = quantize_summaries(summ, bits, width)
        assert got.shape == summ.shape and got.dtype == torch.float32
        x, out = summ.view(5, 2, runs, width), got.view(5, 2, runs, width)
        lo = x.amin(-1, keepdim=True).half().float()
        step = ((x.amax(-1, keepdim=True) - lo) / (2 ** bits - 1)).half().float()
        assert ((out - x).abs() <= step / 2 + (x.amin(-1, keepdim=True) - lo).abs() + 1e-5).all()
        levels = (out - lo) / step
        assert torch.allclose(levels, levels.round(), atol=1e-3) and (levels >= -1e-3).all()
        assert (levels <= 2 ** bits - 1 + 1e-3).all()
    assert (quantize_summaries(summ, 4, width) - summ).abs().mean() < \
        (quantize_summaries(summ, 2, width) - summ).abs().mean()
    constant = torch.full((1, 1, width), 0.5)
    assert torch.equal(quantize_summaries(constant, 4, width), constant)  # step 0: the min itself
    assert summary_bits("gatesub16c2exactq4s4") == 4 and summary_bits("gatec2exacts2") == 2
    assert summary_bits("gatec2exactq4") is None and is_candidate("gatesub16c2exactq4s4")
    with pytest.raises(ValueError, match="summary bits"):
        summary_bits("gatec2exacts9")
    gate, table, gtable, q, k, positions = _two_level_world(4)
    spec = lambda name: SparseEvalSpec(top_k=2, block_size=B, selector=name, gates={0: gate},  # noqa: E731
                                       sub_blocks=4)
    plain = select_for_queries(spec("gatec2exact"), 0, q, k, positions, table, gtable)
    assert torch.equal(select_for_queries(spec("gatec2exacts8"), 0, q, k, positions, table, gtable), plain)
    first = block_scores(spec("gatec2exact"), 0, q, k, positions, table, gtable)
    assert not torch.equal(block_scores(spec("gatec2exacts1"), 0, q, k, positions, table, gtable), first)


@pytest.mark.parametrize("rule", ["group", "tier"])
def test_grouped_second_level_keeps_the_best_of_each_group(rule):
    """gatec<X>group / gatec<X>tier: the gate keeps each row's X x K blocks (forced ones in); the non-forced ones,
    ranked by the gate, form K - forced groups of X (`group`: ranks laid out back and forth over X rows, rank r
    of n groups joins r % n on even rows and n - 1 - r % n on odd ones; `tier`: the r // n-th tier, the i-th of a
    tier in block order joins group i); each group keeps its block of highest mass among the group's own blocks
    (each query head's softmax over the group's keys, max over the kv group's heads). Stated by the loop."""
    gate, table, gtable, q, k, positions = _two_level_world(6)
    for sub, sink, local, top in ((1, 0, 0, 2), (1, 1, 1, 3), (4, 1, 0, 3)):
        spec = lambda name: SparseEvalSpec(top_k=top, block_size=B, selector=name, gates={0: gate},  # noqa: E731
                                           sub_blocks=sub, sink_blocks=sink, local_blocks=local)
        first = block_scores(spec("gate"), 0, q, k, positions, table, gtable).detach()
        got = select_for_queries(spec(f"gatec2{rule}"), 0, q, k, positions, table, gtable)
        for p, pos in enumerate(positions.tolist()):
            n_cand = pos // B
            for h in range(2):
                forced = sorted({m for m in range(n_cand) if m < sink or m >= n_cand - local})
                ranked = sorted((m for m in range(n_cand) if m not in forced), key=lambda m: -float(first[p, h, m]))
                n = top - len(forced)
                ranked = ranked[:2 * n]  # X x K = 2 x top, forced ones among them
                groups = {}
                for r, m in enumerate(ranked):
                    if rule == "group":
                        g = r % n if (r // n) % 2 == 0 else n - 1 - r % n
                    else:
                        tier = sorted(ranked[(r // n) * n:(r // n + 1) * n])
                        g = tier.index(m)
                    groups.setdefault(g, []).append(m)
                want = list(forced)
                for members in groups.values():
                    keys = torch.cat([k[m * B:(m + 1) * B, h] for m in members])
                    logits = (q[p, 2 * h: 2 * h + 2] @ keys.T) / 4.0  # D = 16
                    mass = torch.softmax(logits, -1).view(2, len(members), B).sum(-1).amax(0)
                    want.append(members[int(torch.argmax(mass))])
                want = sorted(want)
                assert got[p, h].tolist() == want + [-1] * (top - len(want)), (rule, sub, sink, p, h)
    assert is_candidate("gatec2groupq4") and is_candidate("gatesub16c2tier") and not is_candidate("gatec2groupq")


def test_sub_block_decode_update_writes_only_completed_blocks():
    """The decode update with sub-blocks writes the run summaries of the block a step completed to its page,
    and nothing to any page a request owns otherwise (page 0 is the padding page)."""
    from sas_backend.selection import SelectionRule, make_selector

    gate, table, gtable = _gate_world()
    pages = 6
    k_buffer = torch.randn(pages * B, 2, 16)
    for name in ("gate", "quest"):
        sel = make_selector(name, SelectionRule(2, B, sub_blocks=4))
        dim = sel.summary_dim(16, 32)
        assert dim == {"gate": 32, "quest": 2 * 16}[name] * 4  # Dg or quest's 2D, per run
        pool = torch.zeros(pages, 2, dim)
        block_table = torch.tensor([[3 * B, 5 * B, 0], [1 * B, 2 * B, 4 * B]])  # request r's block m -> page
        seq_lens = torch.tensor([2 * B, 2 * B + 5])  # r0 completed its block 1 (page 5); r1 completed nothing
        sel.update(gate, k_buffer, pool, block_table, seq_lens, table, gtable)
        want = sel.summarize(gate, k_buffer, torch.tensor([5]), torch.tensor([B]), table, gtable)[0]
        assert torch.allclose(pool[5], want)
        assert pool[[1, 2, 3, 4]].abs().sum() == 0


def test_pairs_calibrated_from_a_model_forward():
    """calibrate_model_pairs records every layer's post-RoPE q / k in one dense forward; top_pairs takes each kv
    head's R most spreading pairs, ascending."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sas_backend.hf.candidates import calibrate_model_pairs, top_pairs

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    spread = calibrate_model_pairs(model, torch.randint(0, 64, (96,)))
    assert sorted(spread) == [0, 1] and spread[0].shape == (2, 8) and (spread[0] >= 0).all()
    pairs = top_pairs(spread, 3)
    assert pairs[1].shape == (2, 3) and (pairs[1].diff(dim=-1) > 0).all()
    assert set(pairs[0][0].tolist()) == set(spread[0][0].topk(3).indices.tolist())
    from sas_backend.hf.candidates import calibrate_model_pca

    fitted = calibrate_model_pca(model, torch.randint(0, 64, (96,)), [2, 16])
    assert fitted[2][1][0].shape == fitted[2][1][1].shape == (2, 2, 16)
    assert torch.allclose(fitted[16][0][0].transpose(1, 2) @ fitted[16][0][1], torch.eye(16).expand(2, 16, 16),
                          atol=1e-4)


@pytest.mark.parametrize("group", [1, 3])
def test_pca_at_full_rank_is_exact_and_keeps_the_varying_directions(group):
    """fit_pca: at rank D the projection is the identity on q.k (Pq^T Pk = I: pca<D> is exactmax). At rank 1 it
    keeps the direction along which q.k varies most over keys, which the queries' scale decides, not the keys'
    alone: keys vary 10x more (variance) along dim 1 than along dim 0, but queries are 100x larger along dim 0, so dim 0
    is kept and every key's score is kept up to a per-query offset (the key mean's share), and with one query
    head a kv head blocks rank as under exactmax."""
    torch.manual_seed(group)
    h_kv, d, t = 2, 8, 6 * B
    q_scale = torch.ones(d)
    q_scale[0], q_scale[1] = 10.0, 0.1
    q = torch.randn(t, h_kv * group, d) * q_scale
    k = 3.0 + 1e-3 * torch.randn(t, h_kv, d)
    k[..., 0] += torch.randn(t, h_kv)
    k[..., 1] += 10 ** 0.5 * torch.randn(t, h_kv)
    pq, pk = fit_pca(q, k, d)
    assert pq.shape == pk.shape == (h_kv, d, d)
    assert torch.allclose(pq.transpose(1, 2) @ pk, torch.eye(d).expand(h_kv, d, d), atol=1e-4)
    positions = torch.tensor([t - 1, 3 * B + 2])
    exact = token_max_scores(q[-2:], k, positions, B)
    assert torch.allclose(token_max_scores(q[-2:], k, positions, B, proj=(pq, pk)), exact, atol=1e-3)
    pq1, pk1 = fit_pca(q, k, 1)
    kept = (pq1.transpose(1, 2) @ pk1)[:, 0, 0]  # the map's weight on dim 0's product q0 k0
    assert torch.allclose(kept, torch.ones(h_kv), atol=0.05), kept
    if group == 1:  # with several query heads the max may take another head than exact's
        low = token_max_scores(q[-2:], k, positions, B, proj=(pq1, pk1))
        ok = torch.isfinite(exact)
        assert torch.equal(torch.isfinite(low), ok)
        for row_low, row_exact in zip(low[ok.any(-1)], exact[ok.any(-1)]):
            diff = (row_low - row_exact)[torch.isfinite(row_exact)]
            assert (diff - diff.mean()).abs().max() < 0.2 * row_exact[torch.isfinite(row_exact)].std(), diff
    with pytest.raises(ValueError, match="rank"):
        fit_pca(q, k, d + 1)


def test_exactmass_ranks_blocks_as_the_oracle():
    """exactmass is the oracle's block mass up to each query head's normalization: with one query head a kv head,
    log(oracle mass) - exactmass is the same for every candidate block of a query (so both rank alike), and a
    block of many moderate keys can outrank one holding the single best key, which exactmax never lets happen."""
    from sas_backend.hf.sparse_eval import oracle_scores

    torch.manual_seed(5)
    h_kv, d, t = 2, 8, 6 * B + 3
    q = torch.randn(3, h_kv, d)
    k = torch.randn(t, h_kv, d)
    positions = torch.tensor([t - 1, 4 * B + 1, 2 * B])
    logits = torch.einsum("phd,thd->hpt", q, k)[:, None] * d ** -0.5  # [H_kv, G, P, T]
    logits = logits.masked_fill(torch.arange(t)[None, None, None, :] > positions[None, None, :, None], -inf)
    oracle = oracle_scores(logits, positions, B, t // B).log()
    got = token_max_scores(q, k, positions, B, mass=True)
    ok = torch.isfinite(got)
    assert torch.equal(ok, torch.isfinite(oracle.masked_fill(~ok, -inf)))
    for row_o, row_g in zip(oracle[ok.any(-1)], got[ok.any(-1)]):
        diff = (row_o - row_g)[torch.isfinite(row_g)]
        assert (diff - diff[0]).abs().max() < 1e-4, diff
    # one key of score 3 against a block of 16 keys of score 2.5 (in q.k / sqrt(D) units)
    q1 = torch.zeros(1, 1, d)
    q1[..., 0] = d ** 0.5
    k1 = torch.zeros(2 * B, 1, d)
    k1[3, 0, 0] = 3.0
    k1[B:, 0, 0] = 2.5
    pos = torch.tensor([2 * B + 1])
    assert token_max_scores(q1, k1, pos, B)[0, 0].argmax() == 0
    assert token_max_scores(q1, k1, pos, B, mass=True)[0, 0].argmax() == 1


def test_candidates_through_the_harness():
    """Served by `sparse_eval`: at a budget covering the context every candidate is dense attention; below it
    exactmax changes the logits, and pairs<R> with every pair is exactmax."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 8 * B + 5))
    with torch.no_grad():
        dense = model(input_ids=ids).logits[0]

    def logits(selector, top_k, index=None):
        spec = SparseEvalSpec(top_k=top_k, block_size=B, selector=selector, sparse_from=2 * B, index=index)
        with torch.no_grad(), sparse_eval(model, spec, max_pos=ids.shape[1]) as m:
            return m(input_ids=ids).logits[0]

    all_pairs = {layer: torch.arange(8)[None].expand(2, -1) for layer in range(2)}
    assert torch.allclose(logits("exactmax", 8), dense, atol=1e-4)
    assert torch.allclose(logits("pairs8", 8, all_pairs), dense, atol=1e-4)
    sparse = logits("exactmax", 2)
    assert (sparse - dense).abs().max() > 1e-3
    assert torch.allclose(logits("pairs8", 2, all_pairs), sparse, atol=1e-4)
    with pytest.raises(ValueError, match="calibrated"):
        logits("pairs4", 2)
    full_pca = {layer: (torch.eye(16).expand(2, 16, 16), torch.eye(16).expand(2, 16, 16)) for layer in range(2)}
    assert torch.allclose(logits("pca16", 2, full_pca), sparse, atol=1e-4)
    with pytest.raises(ValueError, match="fitted projection"):
        logits("pca4", 2)
    with pytest.raises(ValueError, match="has 16 dims"):
        logits("pca4", 2, full_pca)
    assert is_candidate("gatesub16") and is_candidate("pairs4") and not is_candidate("pairs")
    assert is_candidate("exactmass") and is_candidate("pca8mass") and not is_candidate("pairs8mass")
    assert torch.allclose(logits("pca16mass", 2, full_pca), logits("exactmass", 2), atol=1e-4)
    with pytest.raises(ValueError, match="needs gates"):
        SparseEvalSpec(top_k=2, selector="gatesub16")
    with pytest.raises(ValueError, match="unknown candidate"):
        candidate_scores("maxmin", 0, None, None, None, B, None)
