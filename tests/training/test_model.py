"""Gates attached to a tiny random Llama: frozen backbone, pre-RoPE inputs, dense equivalence, kernels."""

from __future__ import annotations

import pytest
import torch

import sas_backend.training.model as tm
from sas_backend.training.model import (GateTrainSpec, UnsupportedModelError, attach_gates, detach_gates,
                                        gate_parameters, gated_attention_op, objective_loss)
from sas_backend.training.scoring import GateScores
from tiny_llama import tiny_llama

SEQ = 80  # 5 blocks of 16


def _ids(rows=2, seq=SEQ, seed=0):
    return torch.randint(0, 256, (rows, seq), generator=torch.Generator().manual_seed(seed))


def test_refuses_other_architectures():
    import types

    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="gpt2"))
    with pytest.raises(UnsupportedModelError, match="llama, qwen2, qwen3"):
        attach_gates(model, GateTrainSpec(block_size=16, budget=32))


def test_served_but_untrainable_architecture_says_why():
    """Qwen3-MoE is in the serving table but not the training one: the refusal says both and why."""
    import types

    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="qwen3_moe"))
    with pytest.raises(UnsupportedModelError, match=r"does not support Qwen3-MoE \(qwen3_moe\), which the backend "
                                                    r"serves: the trainer is untested on mixture-of-experts.*; "
                                                    r"gate training supports model types llama, qwen2, qwen3"):
        attach_gates(model, GateTrainSpec(block_size=16, budget=32))


def test_spec_validation():
    assert GateTrainSpec(block_size=64, budget=512).top_k == 8  # the serving rule: K = B // b
    with pytest.raises(ValueError, match="positive multiple of the block size"):
        GateTrainSpec(block_size=64, budget=32)
    with pytest.raises(ValueError, match="positive multiple of the block size"):
        GateTrainSpec(block_size=64, budget=100)
    with pytest.raises(ValueError, match="objective"):
        GateTrainSpec(objective="rl")
    with pytest.raises(ValueError, match="train_last must be >= 2"):
        GateTrainSpec(train_last=1)


@pytest.mark.parametrize("objective", ["lm", "distill"])
def test_gradients_reach_gates_only(objective):
    model = tiny_llama()
    gates = attach_gates(model, GateTrainSpec(block_size=16, budget=32, objective=objective))
    assert set(gates) == {0, 1}
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names == {f"model.layers.{i}.self_attn.attn_gate.{t}.weight" for i in (0, 1)
                     for t in ("attngate_linear_q", "attngate_linear_k", "attngate_qnorm", "attngate_knorm")}
    loss = objective_loss(model, _ids())
    assert torch.isfinite(loss) and loss > 0
    loss.backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert p.grad is None, n
    detach_gates(model)
    assert not any(hasattr(m, "attn_gate") for m in model.modules())
    assert model.config._attn_implementation != tm.ATTN_NAME


def _spy_gate_inputs(monkeypatch, attn, q_mod, k_mod):
    """`(seen, produced)`: seen["q"/"k"] get the pre-RoPE q/k that `attn`'s gate is scored on,
    produced["q"/"k"] the outputs of the modules `q_mod` / `k_mod` they must equal."""
    real = tm.score_gate
    seen, produced = {}, {}

    def spy(gate, q_pre, k_pre, *a, **kw):
        if gate is attn.attn_gate:
            seen["q"], seen["k"] = q_pre, k_pre
        return real(gate, q_pre, k_pre, *a, **kw)

    monkeypatch.setattr(tm, "score_gate", spy)
    q_mod.register_forward_hook(lambda m, i, o: produced.__setitem__("q", o))
    k_mod.register_forward_hook(lambda m, i, o: produced.__setitem__("k", o))
    return seen, produced


def test_gate_reads_pre_rope_q_and_k(monkeypatch):
    """The inverse rotation recovers the projections the model rotated (Llama: q_proj / k_proj)."""
    model = tiny_llama()
    attach_gates(model, GateTrainSpec(block_size=16, budget=32))
    attn = model.model.layers[1].self_attn
    seen, proj = _spy_gate_inputs(monkeypatch, attn, attn.q_proj, attn.k_proj)
    with torch.no_grad():
        objective_loss(model, _ids())
    t = 2 * SEQ
    torch.testing.assert_close(seen["q"], proj["q"].reshape(t, 4, 16), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(seen["k"], proj["k"].reshape(t, 2, 16), rtol=1e-5, atol=1e-5)


def test_all_blocks_with_zero_log_g_is_dense(monkeypatch):
    """Every block selected with log g = 0: the training model's loss equals the dense model's."""
    model = tiny_llama()
    ids = _ids()
    with torch.no_grad():
        dense = model(input_ids=ids, labels=ids, use_cache=False).loss
    attach_gates(model, GateTrainSpec(block_size=16, budget=32))

    def all_blocks(gate, q_pre, k_pre, cu, block_size, top_k, table, **kw):
        t, nb = q_pre.shape[0], -(-SEQ // block_size)
        return GateScores(torch.zeros(2, t, nb), torch.full((2, t), float("-inf")), top_k, block_size, nb)

    monkeypatch.setattr(tm, "score_gate", all_blocks)
    with torch.no_grad():
        gated = objective_loss(model, ids)
    torch.testing.assert_close(gated, dense, rtol=1e-5, atol=1e-5)


def test_gated_op_all_selected_equals_sdpa():
    g = torch.Generator().manual_seed(0)
    lens = [48, 21]
    t = sum(lens)
    q, k, v = (torch.randn(t, h, 16, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0, 48, 69], dtype=torch.int32)
    out = gated_attention_op(q, k, v, torch.zeros(2, t, 3), torch.full((2, t), float("-inf")), cu, 16, 0.25, "naive")
    for bos, eos in [(0, 48), (48, 69)]:
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[bos:eos].transpose(0, 1), k[bos:eos].transpose(0, 1), v[bos:eos].transpose(0, 1),
            is_causal=True, scale=0.25, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[bos:eos], ref, rtol=1e-5, atol=1e-5)


def test_distill_target_is_block_distribution():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(40, 4, 16, generator=g), torch.randn(40, 2, 16, generator=g)
    tgt = tm.pooled_attention_target(q, k, [(0, 40)], 8, 5, 0.25)
    n_prev = torch.arange(40) // 8
    sums = tgt.sum(-1)
    torch.testing.assert_close(sums[:, n_prev > 0], torch.ones(2, int((n_prev > 0).sum())))
    assert (sums[:, n_prev == 0] == 0).all()
    blk = torch.arange(5)
    assert (tgt[:, blk[None, :] >= n_prev[:, None]] == 0).all()  # only previous blocks


def test_distill_mass_target_is_the_oracle_renormalized():
    """pool "mass": the target is the eval oracle's block attention mass (sum over the block's keys,
    max over the group's heads) over the previous blocks, renormalized; "max" differs from it."""
    from sas_backend.hf.sparse_eval import oracle_scores

    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(40, 4, 16, generator=g), torch.randn(40, 2, 16, generator=g)
    tgt = tm.pooled_attention_target(q, k, [(0, 40)], 8, 5, 0.25, pool="mass")
    logits = torch.einsum("phd,thd->hpt", q, k.repeat_interleave(2, 1))  # query head h reads kv head h // G
    logits = logits.view(2, 2, 40, 40) * 0.25  # [Hkv, G, P, T]
    mass = oracle_scores(logits, torch.arange(40), 8, 5).transpose(0, 1)  # [Hkv, P, NB]
    mass = mass * (torch.arange(5)[None, None, :] < (torch.arange(40) // 8)[None, :, None])
    want = mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)
    torch.testing.assert_close(tgt, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(tgt, tm.pooled_attention_target(q, k, [(0, 40)], 8, 5, 0.25, pool="max"))
    with pytest.raises(ValueError, match="distill_target"):
        GateTrainSpec(distill_target="mean")


def test_triton_kernel_matches_reference():
    """Same loss and gate gradients through the fused kernel (TRITON_INTERPRET=1 on CPU) and the reference."""
    res = {}
    for kernel in ("naive", "triton"):
        model = tiny_llama()
        attach_gates(model, GateTrainSpec(block_size=16, budget=32, kernel=kernel))
        loss = objective_loss(model, _ids(rows=1, seq=64))
        loss.backward()
        res[kernel] = (loss.detach(), [p.grad for p in gate_parameters(model)])
    torch.testing.assert_close(res["triton"][0], res["naive"][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(res["triton"][1], res["naive"][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_gradient_checkpointing_gives_the_same_gradients():
    res = []
    for ckpt in (False, True):
        model = tiny_llama()
        attach_gates(model, GateTrainSpec(block_size=16, budget=32))
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        objective_loss(model, _ids()).backward()
        res.append([p.grad for p in gate_parameters(model)])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_qwen3_gate_reads_post_norm_pre_rope(monkeypatch):
    """Qwen3: the gate input is q/k after the model's q_norm/k_norm and before RoPE."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256)).eval()
    attach_gates(model, GateTrainSpec(block_size=16, budget=32))
    attn = model.model.layers[0].self_attn
    seen, normed = _spy_gate_inputs(monkeypatch, attn, attn.q_norm, attn.k_norm)
    loss = objective_loss(model, _ids())
    loss.backward()
    torch.testing.assert_close(seen["q"], normed["q"].reshape(2 * SEQ, 4, 16), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(seen["k"], normed["k"].reshape(2 * SEQ, 2, 16), rtol=1e-5, atol=1e-5)
    assert all(p.grad is not None for p in gate_parameters(model))


def test_qwen2_is_supported():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256)).eval()
    attach_gates(model, GateTrainSpec(block_size=16, budget=32))
    objective_loss(model, _ids()).backward()
    assert all(p.grad is not None for p in gate_parameters(model))


@pytest.mark.parametrize("n_last", [2, 20, 48])
def test_train_last_with_all_blocks_and_zero_log_g_is_dense(monkeypatch, n_last):
    """train_last: the dense no-grad prefix + gated tail queries (every block, log g = 0) give the
    dense model's loss over the tail, so the cached prefix and the tail positions are right."""
    model = tiny_llama()
    ids = _ids()
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[:, -n_last:-1]
    dense = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, -n_last + 1:].reshape(-1))
    attach_gates(model, GateTrainSpec(block_size=16, budget=32, train_last=n_last))
    seen = []

    def all_blocks(gate, q_pre, k_pre, cu, block_size, top_k, table, query_start=0, **kw):
        seen.append((q_pre.shape[0], k_pre.shape[0], query_start))
        t, nb = q_pre.shape[0], -(-SEQ // block_size)
        return GateScores(torch.zeros(2, t, nb), torch.full((2, t), float("-inf")), top_k, block_size, nb)

    monkeypatch.setattr(tm, "score_gate", all_blocks)
    with torch.no_grad():
        gated = objective_loss(model, ids)
    assert seen == [(2 * n_last, 2 * SEQ, SEQ - n_last)] * 2  # both layers: tail queries, every key
    torch.testing.assert_close(gated, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("objective", ["lm", "distill"])
def test_train_last_gradients_reach_every_gate(objective):
    model = tiny_llama()
    attach_gates(model, GateTrainSpec(block_size=16, budget=32, objective=objective, train_last=32))
    loss = objective_loss(model, _ids())
    assert torch.isfinite(loss) and loss > 0
    loss.backward()
    for n, p in model.named_parameters():
        assert (p.grad is not None and p.grad.abs().sum() > 0) == p.requires_grad, n
    with pytest.raises(ValueError, match="smaller than the row length"):
        objective_loss(model, _ids(seq=32))


def test_train_last_distill_target_equals_whole_rows_sliced():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(80, 4, 16, generator=g), torch.randn(80, 2, 16, generator=g)
    full = tm.pooled_attention_target(q, k, [(0, 40), (40, 80)], 8, 5, 0.25)
    rows = torch.cat([torch.arange(13, 40), torch.arange(53, 80)])
    tail = tm.pooled_attention_target(q[rows], k, [(0, 40), (40, 80)], 8, 5, 0.25, query_start=13)
    torch.testing.assert_close(tail, full[:, rows])


def test_train_last_refuses_the_triton_kernel():
    with pytest.raises(ValueError, match="train_last runs the torch reference"):
        GateTrainSpec(block_size=16, budget=32, kernel="triton", train_last=16)
    assert tm.resolve_kernel("auto", torch.device("cuda"), train_last=16) == "naive"


@pytest.mark.parametrize("train_last", [None, 32])
def test_full_scope_gives_every_previous_block_a_gradient(monkeypatch, train_last):
    """Full scope: every previous block is attended with its soft gate (threshold -inf), so d loss /
    d log g is nonzero for every previous block of every trained query; sparse scope (K = 1 of up
    to 4 blocks) leaves the unselected blocks without any."""
    seen = {}

    def spy(q, k, v, log_g, threshold, *args):
        log_g.retain_grad()
        seen["log_g"], seen["threshold"] = log_g, threshold
        return real(q, k, v, log_g, threshold, *args)

    real = tm.gated_attention_op
    monkeypatch.setattr(tm, "gated_attention_op", spy)
    grads = {}
    for scope in ("sparse", "full"):
        model = tiny_llama()
        attach_gates(model, GateTrainSpec(block_size=16, budget=16, scope=scope, train_last=train_last))
        objective_loss(model, _ids()).backward()
        grads[scope] = seen["log_g"].grad  # last layer's [Hkv, Tq, NB]
        if scope == "full":
            assert torch.isinf(seen["threshold"]).all() and (seen["threshold"] < 0).all()
    q_len = grads["full"].shape[1] // 2  # two packed rows of the same positions
    pos = torch.arange(SEQ - q_len, SEQ).repeat(2)
    prev = torch.arange(grads["full"].shape[2])[None, :] < (pos // 16)[:, None]  # [Tq, NB] previous blocks
    # queries with more than K = 1 previous blocks, except each row's last (it predicts no token)
    prev = prev & ((pos // 16 >= 2) & (pos < SEQ - 1))[:, None]
    assert (grads["full"].abs()[:, prev] > 0).all()
    assert (grads["sparse"].abs()[:, prev] == 0).any()  # sparse: unselected blocks get nothing
    with pytest.raises(ValueError, match="scope"):
        GateTrainSpec(scope="partial")


@pytest.mark.parametrize("objective", ["lm", "distill"])
def test_forced_blocks_train_the_gate_on_the_other_blocks(monkeypatch, objective):
    """sink 1 + local 1 (as served): lm attends the forced blocks with log g 0 and the gate's K - 2
    picks; distill's target is renormalized over the blocks not forced in. Gradients reach every gate."""
    seen = {}
    real_op, real_kl = tm.gated_attention_op, tm.distill_kl

    def op_spy(q, k, v, log_g, threshold, *args):
        seen["log_g"], seen["threshold"] = log_g.detach(), threshold
        return real_op(q, k, v, log_g, threshold, *args)

    def kl_spy(target, log_g):
        seen["target"] = target
        return real_kl(target, log_g)

    monkeypatch.setattr(tm, "gated_attention_op", op_spy)
    monkeypatch.setattr(tm, "distill_kl", kl_spy)
    model = tiny_llama()
    attach_gates(model, GateTrainSpec(block_size=16, budget=48, objective=objective, sink_blocks=1, local_blocks=1,
                                      train_last=48))
    loss = objective_loss(model, _ids())
    loss.backward()
    for n, p in model.named_parameters():
        assert (p.grad is not None and p.grad.abs().sum() > 0) == p.requires_grad, n
    pos = torch.arange(SEQ - 48, SEQ).repeat(2)
    own = pos // 16
    blk = torch.arange(5)[None, :]
    forced = ((blk < 1) | (blk >= own[:, None] - 1)) & (blk < own[:, None])  # [Tq, NB]
    cand = (blk < own[:, None]) & ~forced
    if objective == "lm":
        lg = seen["log_g"]
        assert (lg[:, forced] == 0).all()
        chosen = (lg >= seen["threshold"][..., None]) & (blk < own[:, None])[None]
        # K = 3 previous blocks: both forced ones plus one pick wherever more than 3 exist
        torch.testing.assert_close(chosen.sum(-1), own.clamp(max=3).expand_as(chosen[..., 0]))
    else:
        tgt = seen["target"]
        assert (tgt[:, forced] == 0).all()
        has = cand.any(-1)
        torch.testing.assert_close(tgt.sum(-1)[:, has], torch.ones(2, int(has.sum())))
    with pytest.raises(ValueError, match="sink \\+ local < K"):
        GateTrainSpec(block_size=16, budget=32, sink_blocks=1, local_blocks=1)


def _coverage_case(seed=0, h=2, t=40, nb=10, b=16):
    from sas_backend.training.scoring import candidate_blocks

    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(nb * b - t, nb * b)
    cand, _ = candidate_blocks(pos, nb, b, 1, 1)
    log_g = torch.randn(h, t, nb, generator=g).masked_fill(~cand[None], float("-inf"))
    target = torch.rand(h, t, nb, generator=g) * cand[None]
    return target / target.sum(-1, keepdim=True).clamp_min(1e-30), log_g, cand


def _loop_coverages(target, log_g, cand, k):
    """[(the gate's k best-scored candidates' target mass, the k heaviest candidates' mass)] per
    (head, query) with previous blocks: the loop reference of topk_coverage / topk_regret."""
    out = []
    for h in range(target.shape[0]):
        for t in range(target.shape[1]):
            if target[h, t].sum() == 0:
                continue
            idx = cand[t].nonzero().flatten()
            chosen = idx[torch.argsort(log_g[h, t, idx], descending=True)[:k]]
            heaviest = target[h, t, idx].sort(descending=True).values[:k]
            out.append((float(target[h, t, chosen].sum()), float(heaviest.sum())))
    return out


@pytest.mark.parametrize("k", [1, 3, 5, 8, 12])
def test_topk_coverage_is_the_mass_a_budget_keeps(k):
    """Hard coverage = target mass of each query's k best-scored candidates (all of them when it has
    at most k), averaged over queries; the soft one tends to it as the temperature falls."""
    target, log_g, cand = _coverage_case()
    per_query = _loop_coverages(target, log_g, cand, k)
    want, n = sum(got for got, _ in per_query), len(per_query)
    got = tm.topk_coverage(target, log_g, cand, k)
    assert float(got) == pytest.approx(want / n, rel=1e-6)
    assert float(tm.topk_coverage(target, log_g, cand, k, temperature=1e-4)) == pytest.approx(want / n, abs=1e-3)


def test_topk_coverage_gradient_is_finite_and_moves_boundary_blocks():
    """The soft coverage's gradient is finite (masked -inf blocks, queries that keep everything) and
    raising it means raising the targets' heavy blocks that sit just outside the top k."""
    target, log_g, cand = _coverage_case(seed=1)
    log_g.requires_grad_(True)
    tm.topk_coverage(target, log_g, cand, 3, temperature=0.5).backward()
    grad = log_g.grad
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert (grad[:, ~cand] == 0).all()  # blocks the gate does not rank get nothing
    improved = tm.topk_coverage(target, (log_g + 0.5 * grad).detach(), cand, 3, temperature=0.5)
    assert improved > tm.topk_coverage(target, log_g.detach(), cand, 3, temperature=0.5)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_topk_regret_is_the_squared_shortfall_from_the_oracles_top_k(k):
    """Regret per query = mass of the target's k heaviest candidates - mass of the gate's k best-scored
    ones, squared and averaged; zero for the oracle's own scores; the soft one's gradient lowers it."""
    target, log_g, cand = _coverage_case(seed=2)
    per_query = _loop_coverages(target, log_g, cand, k)
    want, n = sum((best - got) ** 2 for got, best in per_query), len(per_query)
    has_prev = target.sum(-1) > 0
    assert tm.oracle_topk_mass(target, k)[has_prev].tolist() == pytest.approx([best for _, best in per_query])
    assert float(tm.topk_regret(target, log_g, cand, k)) == pytest.approx(want / n, rel=1e-5, abs=1e-12)
    if k >= int(cand.sum(-1).max()):  # every query keeps all its candidates: nothing to regret
        assert want == pytest.approx(0.0, abs=1e-10)
        return
    oracle_scores = torch.log(target.clamp_min(1e-30)).masked_fill(~cand[None], float("-inf"))
    assert float(tm.topk_regret(target, oracle_scores, cand, k)) == pytest.approx(0.0, abs=1e-7)
    soft = log_g.clone().requires_grad_(True)
    tm.topk_regret(target, soft, cand, k, temperature=0.5).backward()
    assert torch.isfinite(soft.grad).all() and (soft.grad[:, ~cand] == 0).all()
    moved = (soft - 0.5 * soft.grad).detach()
    assert tm.topk_regret(target, moved, cand, k, temperature=0.5) < tm.topk_regret(target, log_g, cand, k, 0.5)


def test_hard_topk_coverage_counts_exactly_k_blocks_when_scores_tie():
    """Tied scores at the cut: the hard coverage counts k blocks, the lower block index first (the
    serving rule), never every tied block; the oracle's mass bounds it."""
    from sas_backend.training.scoring import candidate_blocks

    nb, b = 6, 4
    pos = torch.tensor([nb * b - 1])  # the last query: blocks 0-4 before its own
    cand, _ = candidate_blocks(pos, nb, b, 0, 0)
    target = torch.tensor([[[0.1, 0.4, 0.2, 0.2, 0.1, 0.0]]])
    log_g = torch.zeros(1, 1, nb).masked_fill(~cand[None], float("-inf"))  # every candidate ties
    assert float(tm.topk_coverage(target, log_g, cand, 2)) == pytest.approx(0.5)  # blocks 0 and 1
    assert float(tm.oracle_topk_mass(target, 2)) == pytest.approx(0.6)  # blocks 1 and 2 (or 3)
