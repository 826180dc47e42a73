"""The training-free selectors (Quest's key bound, sink + local) and the evaluation oracle, against
their definitions written out here by hand; and the selector table of `sas_backend.selection`."""

import pytest
import torch

from sas_backend.hf.sparse_eval import oracle_scores
from sas_backend.ops.quest import key_bounds, quest_scores, update_key_bounds
from sas_backend.config import SETTINGS
from sas_backend.selection import (
    SelectionRule,
    Selector,
    make_selector,
    register_selector,
    selector_class,
    selector_names,
)


def test_quest_bound_is_an_upper_bound_tight_per_dimension(paged_case):
    b, h_kv, group, d = 4, 2, 3, 8
    lens = [1, b + 1, 5 * b, 7 * b + 2]
    case = paged_case(lens, b, h_kv, d, seed=1)
    g = torch.Generator().manual_seed(1)
    k_buf = torch.randn(case.slots, h_kv, d, generator=g)
    pages = torch.arange(case.num_pages + 1)
    bounds = key_bounds(k_buf, pages, b)
    keys = k_buf.view(-1, b, h_kv, d)
    assert torch.equal(bounds, torch.cat([keys.amin(1), keys.amax(1)], -1))
    q = torch.randn(len(lens), h_kv * group, d, generator=g)
    table, n_cand = case.block_table().cpu(), case.num_candidates.cpu()
    scores = quest_scores(q, bounds, table, n_cand, b, case.max_blocks)
    for r in range(len(lens)):
        for h in range(h_kv):
            for m in range(case.max_blocks):
                if m >= int(n_cand[r]):
                    assert scores[r, h, m] == float("-inf")
                    continue
                page = int(table[r, m]) // b
                blk = keys[page, :, h]  # [b, D]
                qs = q[r, h * group : (h + 1) * group]  # the group's query heads
                # The bound: per dimension the larger of q*min, q*max; it bounds every key's q.k.
                want = torch.maximum(qs * blk.amin(0), qs * blk.amax(0)).sum(-1).max()
                torch.testing.assert_close(scores[r, h, m], want, atol=1e-5, rtol=1e-5)
                assert scores[r, h, m] >= (qs @ blk.T).max() - 1e-5


def test_quest_update_writes_the_completed_blocks(paged_case):
    b, h_kv, d = 4, 2, 8
    lens = [b, 2 * b + 1, 3 * b, 1]
    case = paged_case(lens, b, h_kv, d, seed=2)
    k_buf = torch.randn(case.slots, h_kv, d, generator=torch.Generator().manual_seed(2))
    start = torch.full((case.num_pages + 1, h_kv, 2 * d), 7.0)
    got = update_key_bounds(k_buf, start.clone(), case.block_table().cpu(), case.seq_lens.cpu(), b)
    want = start.clone()
    for r, n in enumerate(lens):
        if n % b == 0:
            page = int(case.block_table()[r, n // b - 1]) // b
            want[page] = key_bounds(k_buf, torch.tensor([page]), b)[0]
    torch.testing.assert_close(got[1:], want[1:])  # page 0 (padding) may take the masked rows' writes


def test_sink_local_takes_the_first_and_the_latest_blocks():
    sel = make_selector("sink-local", SelectionRule(top_k=4, block_size=64))
    assert (sel.rule.sink_blocks, sel.rule.local_blocks) == (1, 3)
    n_cand = torch.tensor([10, 3, 0])
    summaries = torch.zeros(1, 2, 0)
    scores = sel.scores(None, torch.zeros(3, 4, 8), None, None, summaries, None, n_cand, 10)
    got = sel.pick(scores, n_cand)
    assert got[0, 0].tolist() == [0, 7, 8, 9] and got[0, 1].tolist() == [0, 7, 8, 9]
    assert got[1, 0].tolist() == [0, 1, 2, -1]  # at most K candidates: all of them
    assert got[2, 0].tolist() == [-1, -1, -1, -1]


def test_selector_table():
    """The built-ins are registered by name and declare what they need; nothing else tells them apart."""
    assert selector_names()[:3] == ("gate", "quest", "sink-local")
    caps = {n: (c.needs_gate, c.fused_kernels, c.ranks, c.keeps_summaries)
            for n, c in ((n, selector_class(n)) for n in ("gate", "quest", "sink-local"))}
    assert caps == {"gate": (True, True, True, True), "quest": (False, False, True, True),
                    "sink-local": (False, False, False, False)}
    rule = SelectionRule(top_k=8)
    assert [make_selector(n, rule).summary_dim(64, 128) for n in ("gate", "quest", "sink-local")] == [128, 128, 0]
    with pytest.raises(ValueError, match="gate, quest, sink-local"):
        make_selector("h2o", rule)


def test_registering_a_selector_and_its_refusals():
    """`register_selector` takes a named Selector subclass once; the config reads its capabilities (a selector
    without summaries refuses sub-blocks, one that does not rank refuses anchors, one without fused kernels
    refuses --sas-kernels triton, one without gate weights needs no --sas-gate)."""
    from sas_backend.config import SASConfig, SASConfigError

    from tests import toy_selector

    assert selector_class("toy-recency") is toy_selector.RecencySelector  # registered on import
    assert register_selector(toy_selector.RecencySelector) is toy_selector.RecencySelector  # idempotent
    clash = type("Clash", (Selector,), {"name": "quest"})
    with pytest.raises(ValueError, match="registered already"):
        register_selector(clash)
    with pytest.raises(TypeError, match="Selector subclass with a name"):
        register_selector(type("Nameless", (Selector,), {}))
    with pytest.raises(ValueError, match="needs keeps_summaries"):
        register_selector(type("Odd", (Selector,), {"name": "odd", "fused_kernels": True, "keeps_summaries": False}))
    assert "odd" not in selector_names()

    cfg = SASConfig(selector="toy-recency", budget=256, sink_blocks=1).validate()  # no gate needed
    assert cfg.resolved().budget == 256
    with pytest.raises(SASConfigError, match="fused kernels, which the toy-recency selector does not have"):
        SASConfig(selector="toy-recency", kernels="triton").validate()
    with pytest.raises(SASConfigError, match="sink-local keeps no summaries"):
        SASConfig(selector="sink-local", sub_blocks=4).validate()
    with pytest.raises(SASConfigError, match="sink-local forces every block"):
        SASConfig(selector="sink-local", budget=256, prompt_anchors=1).validate()
    # A module named by --sas-selector-module is imported before the name is looked up; a missing one is named.
    assert SASConfig(selector="quest", selector_modules="tests.toy_selector").validate().selector == "quest"
    with pytest.raises(SASConfigError, match="--sas-selector-module no_such_selector_module"):
        SASConfig(selector="quest", selector_modules="no_such_selector_module").validate()
    help_text = next(s for s in SETTINGS if s.field == "selector").help_text()
    assert "gate (the trained gate, needs --sas-gate)" in help_text and "toy-recency (test toy" in help_text


def test_oracle_ranks_blocks_by_attention_mass():
    # 2 kv heads x 2 query heads, 3 queries at positions 9..11 over 12 keys, blocks of 3.
    b, t = 3, 12
    logits = torch.full((2, 2, 3, t), -5.0)
    logits[0, 1, :, 3:6] = 4.0  # kv head 0: one of its query heads attends block 1
    logits[1, 0, :, 0:3] = 4.0  # kv head 1: block 0
    logits[:, :, :, 10:] = 50.0  # future / own-block keys: excluded from candidates, masked where causal
    positions = torch.tensor([9, 10, 11])
    mass = oracle_scores(logits, positions, b, width=4)
    assert mass.shape == (3, 2, 4)
    assert int(mass[0, 0, :3].argmax()) == 1 and int(mass[0, 1, :3].argmax()) == 0
    for i, pos in enumerate(positions.tolist()):  # by hand: softmax over keys 0..pos, per block, max over heads
        probs = torch.softmax(logits[:, :, i, : pos + 1], -1)
        probs = torch.nn.functional.pad(probs, (0, t - pos - 1))
        want = probs.view(2, 2, 4, b).sum(-1).amax(1)  # [H_kv, blocks]
        torch.testing.assert_close(mass[i], want)
