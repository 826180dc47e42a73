"""`SparseEvalSpec.summary_dtype` / `eval_ppl --summary-dtype`: block summaries kept in bf16 between summarizing
and scoring, as a bf16 summary pool stores them. The bf16 option moves the gate's and Quest's scores by at most
bf16 rounding of the summaries (and by exactly what rounding them gives), the fp32 default is the computation as
it was, bit for bit, and eval_ppl records the dtype and reuses summary-dependent measurements only across runs
with the same one."""

from __future__ import annotations

import json
import os

import pytest
import torch

from sas_backend.hf.sparse_eval import SparseEvalSpec, block_scores, model_rope_table, select_for_queries
from sas_backend.selection import SelectionRule, make_selector
from sas_backend.training.eval_ppl import prefix_cache, window_nll
from test_eval_ppl import _gates
from tiny_llama import ESSAYS_DIR, have_real_assets, save_tiny_model_dir, tiny_llama

WINDOW, LAST, B = 96, 40, 16
BF16_UNIT = 2.0 ** -8  # bf16 keeps 8 significand bits: round to nearest moves a value by at most |x| * 2^-8


def _layer_inputs(layer: int = 1):
    """A window's post-RoPE q (its sparse queries) and k at one layer of the tiny Llama, the RoPE tables, gates."""
    from transformers import AttentionInterface

    from sas_backend.geometry import ModelGeometry, gate_rope_table
    from sas_backend.hf.causal import causal_sdpa

    model = tiny_llama()
    ids = torch.randint(0, 256, (1, WINDOW), generator=torch.Generator().manual_seed(3))
    got = {}

    def grab(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if module.layer_idx == layer:
            got["q"], got["k"] = query[0].transpose(0, 1).clone(), key[0].transpose(0, 1).clone()
        return causal_sdpa(query, key, value, scaling).transpose(1, 2), None

    AttentionInterface.register("sas_test_grab_qk", grab)
    previous = model.config._attn_implementation
    model.set_attn_implementation("sas_test_grab_qk")
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    gates = _gates()
    table = model_rope_table(model, WINDOW)
    gate_table = gate_rope_table(gates[0].gate_dim, ModelGeometry.from_hf_config(model.config), WINDOW)
    positions = torch.arange(WINDOW - LAST, WINDOW)
    return got["q"][WINDOW - LAST:], got["k"], positions, table, gate_table, gates


def _spec(selector, dtype=None, gates=None):
    kw = {} if dtype is None else {"summary_dtype": dtype}
    return SparseEvalSpec(top_k=2, block_size=B, selector=selector, gates=gates, sparse_from=WINDOW - LAST, **kw)


def _by_hand(selector_name, gate, q, k, positions, table, gate_table, round_to=None):
    """The scores computed step by step from the server's selector: summarize, optionally store in `round_to`
    and read back as fp32, score."""
    sel = make_selector(selector_name, SelectionRule(2, B))
    n_blocks = k.shape[0] // B
    pages = torch.arange(n_blocks)
    summaries = sel.summarize(gate, k, pages, pages * B, table, gate_table)
    if round_to is not None:
        summaries = summaries.to(round_to).float()
    block_table = (torch.arange(n_blocks + 1) * B).expand(positions.numel(), -1)
    n_cand = torch.div(positions, B, rounding_mode="floor")
    rows = gate_table[positions] if gate is not None else None
    return sel.scores(gate, q, table[positions], rows, summaries, block_table, n_cand, n_blocks), summaries, sel


@pytest.mark.parametrize("selector", ["gate", "quest"])
def test_bf16_summaries_change_scores_by_bf16_rounding_only(selector):
    q, k, positions, table, gate_table, gates = _layer_inputs()
    gate = gates[1] if selector == "gate" else None
    g = gates if selector == "gate" else None
    fp32 = block_scores(_spec(selector, gates=g), 1, q, k, positions, table, gate_table)
    bf16 = block_scores(_spec(selector, torch.bfloat16, g), 1, q, k, positions, table, gate_table)
    want_fp32, summaries, sel = _by_hand(selector, gate, q, k, positions, table, gate_table)
    want_bf16, rounded, _ = _by_hand(selector, gate, q, k, positions, table, gate_table, torch.bfloat16)
    # the default is the computation as it was (summaries as computed), bit for bit; bf16 is exactly the
    # scores of the rounded summaries, which are what a bf16 pool stores
    assert torch.equal(fp32, want_fp32) and torch.equal(bf16, want_bf16)
    assert torch.equal(rounded, summaries.to(torch.bfloat16).float())
    assert ((rounded - summaries).abs() <= BF16_UNIT * summaries.abs()).all()
    finite = torch.isfinite(fp32)
    assert torch.equal(finite, torch.isfinite(bf16)) and finite.any()
    diff = (bf16 - fp32)[finite].abs()
    assert diff.max() > 0  # the option is not a no-op
    # the bound: each summary entry moves by at most |s| 2^-8, and the score is linear in the entries
    # (gate: qg . kg / sqrt(Dg); quest: sum over dims of max(q*lo, q*hi), 1-Lipschitz in each bound * |q|)
    if selector == "gate":
        from sas_backend.ops.gate import gate_query_post_rope

        qg = gate_query_post_rope(q, table[positions], gate.attngate_linear_q.weight,
                                  gate.attngate_qnorm.weight, gate_table[positions])  # [P, H_kv, Dg]
        bound = torch.einsum("phd,mhd->phm", qg.abs(), summaries.abs()) / summaries.shape[-1] ** 0.5
    else:
        h_kv, d = k.shape[1], k.shape[2]
        qa = q.abs().view(q.shape[0], h_kv, -1, d)  # [P, H_kv, G, D]
        lo, hi = summaries.abs().view(summaries.shape[0], h_kv, 2, d).unbind(2)
        bound = torch.einsum("phgd,mhd->phgm", qa, torch.maximum(lo, hi)).amax(2)  # max over the group's heads
    bound = BF16_UNIT * bound[..., : fp32.shape[-1]]
    slack = 1e-6 * fp32[finite].abs().max()  # fp32 rounding of the score itself
    assert (diff <= bound[finite] + slack).all()
    # and the selection from either is a valid one (ascending, -1 padded)
    picked = select_for_queries(_spec(selector, torch.bfloat16, g), 1, q, k, positions, table, gate_table)
    assert picked.shape == (positions.numel(), k.shape[1], 2)


def test_summary_dtype_default_is_fp32_and_others_are_refused():
    assert SparseEvalSpec(top_k=2, selector="quest").summary_dtype == torch.float32
    with pytest.raises(ValueError, match="summary_dtype"):
        SparseEvalSpec(top_k=2, selector="quest", summary_dtype=torch.float16)


@pytest.mark.parametrize("selector", ["gate", "quest", "sink-local", "oracle"])
def test_window_nll_under_each_summary_dtype(selector):
    """fp32 given explicitly is the default bit for bit; bf16 changes only what reads summaries (the gate,
    Quest), and then by little."""
    model = tiny_llama()
    ids = torch.randint(0, 256, (WINDOW + 1,), generator=torch.Generator().manual_seed(1))
    g = _gates() if selector == "gate" else None
    cache = prefix_cache(model, ids, LAST)
    default = window_nll(model, ids, LAST, _spec(selector, gates=g), cache)
    assert window_nll(model, ids, LAST, _spec(selector, torch.float32, g), cache) == default
    bf16 = window_nll(model, ids, LAST, _spec(selector, torch.bfloat16, g), cache)
    if selector in ("sink-local", "oracle"):
        assert bf16 == default
    else:
        assert bf16 == pytest.approx(default, rel=0.05)


needs_real_assets = pytest.mark.skipif(
    not have_real_assets(), reason="needs models/SmolLM2-135M-Instruct (tokenizer) and models/text/essays: run "
    "serve/prepare_model.py and serve/prepare_text.py")


def tiny_eval_ppl_argv(tmp_path) -> list:
    """eval_ppl arguments for a quick run: the tiny Llama saved with SmolLM2's tokenizer, an initialized gate `g`
    (variant g+s0l0), quest and sink-local, one window of 128 tokens (32 scored), budgets 32 and 64."""
    from sas_backend.gate.checkpoint import init_gate_checkpoint

    model_dir = save_tiny_model_dir(str(tmp_path / "model"))
    gate_dir = str(tmp_path / "gate")
    init_gate_checkpoint(gate_dir, model_dir=model_dir, seed=0, gate_dim=32, block_size=16)
    essays = sorted(os.path.join(ESSAYS_DIR, n) for n in os.listdir(ESSAYS_DIR) if n.endswith(".txt"))[:8]
    return ["--model", model_dir, "--data", *essays, "--split", "train", "--window", "128", "--last", "32",
            "--block-size", "16", "--budgets", "32", "64", "--gate", f"g={gate_dir}", "--gate-forced", "0,0",
            "--baselines", "quest", "sink-local", "--max-windows", "1", "--no-recall", "--no-progress"]


@needs_real_assets
def test_eval_ppl_records_the_summary_dtype_and_reuses_only_like_with_like(tmp_path):
    from sas_backend.training import eval_ppl

    argv = tiny_eval_ppl_argv(tmp_path)
    fp32_js, bf16_js, reuse_js = (str(tmp_path / n) for n in ("fp32.json", "bf16.json", "reuse.json"))
    assert eval_ppl.main(argv + ["--json", fp32_js]) == 0
    assert eval_ppl.main(argv + ["--summary-dtype", "bf16", "--json", bf16_js]) == 0
    fp32, bf16 = json.load(open(fp32_js)), json.load(open(bf16_js))
    assert fp32["summary_dtype"] == "fp32" and bf16["summary_dtype"] == "bf16"
    assert "--summary-dtype bf16" in bf16["command"]
    assert "- block summaries (gates, quest): fp32" in open(str(tmp_path / "fp32.md")).read()
    assert "- block summaries (gates, quest): bf16" in open(str(tmp_path / "bf16.md")).read()
    assert bf16["dense_nll_per_window"] == fp32["dense_nll_per_window"]
    assert bf16["nll_per_window"]["sink-local"] == fp32["nll_per_window"]["sink-local"]  # no summaries
    for name in ("g+s0l0", "quest"):
        for bud in ("32", "64"):
            assert bf16["nll_per_window"][name][bud][0] == pytest.approx(fp32["nll_per_window"][name][bud][0],
                                                                         rel=0.05)
    # a bf16 run reusing the fp32 one takes only what does not read summaries, and ends with the bf16 numbers
    assert eval_ppl.main(argv + ["--summary-dtype", "bf16", "--reuse", fp32_js, "--json", reuse_js]) == 0
    reused = json.load(open(reuse_js))
    assert reused["reused"]["measurements"] == {"sink-local": {"32": "sink-local", "64": "sink-local"}}
    assert reused["nll_per_window"] == bf16["nll_per_window"] and reused["summary_dtype"] == "bf16"
