"""`SparseEvalSpec.gate_dtype` / `eval_ppl --gate-dtype`: the gate's weights (all of its parameters) read from a
bf16 copy by a kernel that computes in fp32. The bf16 option moves the gate's scores by at most what rounding its
weights to bf16 can (and by exactly what the rounded weights give), the fp32 default is the computation as it was,
bit for bit, the selectors without a gate do not see it, and eval_ppl records the dtype and reuses gate
measurements only across runs with the same one."""

from __future__ import annotations

import json

import pytest
import torch

from sas_backend.hf.sparse_eval import SparseEvalSpec, block_scores, select_for_queries
from sas_backend.ops.gate.torch_path import GATE_NORM_EPS, rms_norm
from sas_backend.ops.rope import invert_rope
from sas_backend.ops.summary.torch_path import pool_block_keys
from sas_backend.training.eval_ppl import prefix_cache, reuse_plan, window_nll
from test_eval_ppl import _gates
from test_summary_dtype import (B, BF16_UNIT, LAST, WINDOW, _by_hand, _layer_inputs, needs_real_assets,
                                tiny_eval_ppl_argv)
from tiny_llama import tiny_llama


def _gates_with_norms(seed: int = 0):
    """The tests' gates with RMSNorm weights that bf16 does not hold exactly (reset_parameters sets them to 1)."""
    gates = _gates(seed)
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for gate in gates.values():
            for norm in (gate.attngate_qnorm.weight, gate.attngate_knorm.weight):
                norm.copy_(1 + 0.3 * torch.randn(norm.shape, generator=g))
    return gates


def _spec(selector, gate_dtype=None, gates=None, summary_dtype=torch.float32):
    kw = {} if gate_dtype is None else {"gate_dtype": gate_dtype}
    return SparseEvalSpec(top_k=2, block_size=B, selector=selector, gates=gates, sparse_from=WINDOW - LAST,
                          summary_dtype=summary_dtype, **kw)


def test_read_as_rounds_every_parameter_and_leaves_the_gate_alone():
    gate = _gates_with_norms()[1]
    before = {k: v.clone() for k, v in gate.state_dict().items()}
    assert gate.read_as(torch.float32) is gate
    rounded = gate.read_as(torch.bfloat16)
    assert rounded is not gate and set(rounded.state_dict()) == set(before) == {
        "attngate_linear_q.weight", "attngate_linear_k.weight", "attngate_qnorm.weight", "attngate_knorm.weight"}
    for name, w in rounded.state_dict().items():
        assert w.dtype == torch.float32
        assert torch.equal(w, before[name].to(torch.bfloat16).float())  # w.to(bf16).to(fp32), every parameter
        assert not torch.equal(w, before[name])  # each one moves (the norms too)
        assert torch.equal(gate.state_dict()[name], before[name])  # the original is untouched


def test_gate_dtype_default_is_fp32_and_others_are_refused():
    assert SparseEvalSpec(top_k=2, selector="quest").gate_dtype == torch.float32
    with pytest.raises(ValueError, match="gate_dtype"):
        SparseEvalSpec(top_k=2, selector="quest", gate_dtype=torch.float16)


def _norm_bound(x, w, xabs):
    """First-order bound on ||delta rms_norm(x, w)||_2 `[..., 1]` when every weight (of the projection that made x,
    and w) moves by at most |weight| 2^-8: the norm weight moves each output by <= |out_i| u, the projection moves
    x_i by <= u xabs_i (xabs: |input| @ |weight|), and RMSNorm's Jacobian (I - n n^T / Dg) / rms has norm
    <= 1 / rms."""
    rms = (x.pow(2).mean(-1, keepdim=True) + GATE_NORM_EPS).sqrt()
    out = rms_norm(x, w)
    return BF16_UNIT * (out.norm(dim=-1, keepdim=True) + w.abs().max() * xabs.norm(dim=-1, keepdim=True) / rms)


def test_bf16_gate_weights_change_scores_by_bf16_rounding_only():
    q, k, positions, table, gate_table, _ = _layer_inputs()
    gates = _gates_with_norms()
    gate = gates[1]
    fp32 = block_scores(_spec("gate", gates=gates), 1, q, k, positions, table, gate_table)
    explicit = block_scores(_spec("gate", torch.float32, gates), 1, q, k, positions, table, gate_table)
    bf16 = block_scores(_spec("gate", torch.bfloat16, gates), 1, q, k, positions, table, gate_table)
    want_fp32, summaries, _ = _by_hand("gate", gate, q, k, positions, table, gate_table)
    want_bf16, _, _ = _by_hand("gate", gate.read_as(torch.bfloat16), q, k, positions, table, gate_table)
    # the default is the computation as it was, bit for bit; bf16 is exactly the scores of the rounded weights
    assert torch.equal(fp32, want_fp32) and torch.equal(explicit, fp32) and torch.equal(bf16, want_bf16)
    finite = torch.isfinite(fp32)
    assert torch.equal(finite, torch.isfinite(bf16)) and finite.any()
    diff = (bf16 - fp32)[finite].abs()
    assert diff.max() > 0  # the option is not a no-op
    # the bound: s = qg . kg / sqrt(Dg), so |ds| <= (|dqg| |kg| + |qg| |dkg| + |dqg| |dkg|) / sqrt(Dg), with |dqg|,
    # |dkg| the first-order bounds of `_norm_bound` (RoPE is a rotation: it keeps the norms) and 1% for second order
    w_q, w_k = gate.attngate_linear_q.weight, gate.attngate_linear_k.weight
    h_kv, g, d, dg = w_q.shape
    q_pre = invert_rope(q, table[positions]).reshape(q.shape[0], h_kv, g * d).transpose(0, 1)  # [H_kv, P, G*D]
    x_q = torch.bmm(q_pre, w_q.reshape(h_kv, g * d, dg)).transpose(0, 1)  # [P, H_kv, Dg]
    xa_q = torch.bmm(q_pre.abs(), w_q.abs().reshape(h_kv, g * d, dg)).transpose(0, 1)
    n_blocks = k.shape[0] // B
    k_pre = invert_rope(k[: n_blocks * B], table[: n_blocks * B]).view(n_blocks, B, h_kv, d)
    pooled = pool_block_keys(k_pre).transpose(0, 1)  # [H_kv, NB, 3D]
    x_k = torch.bmm(pooled, w_k).transpose(0, 1)  # [NB, H_kv, Dg]
    xa_k = torch.bmm(pooled.abs(), w_k.abs()).transpose(0, 1)
    dq = _norm_bound(x_q, gate.attngate_qnorm.weight, xa_q)[..., 0]  # [P, H_kv]
    dk = _norm_bound(x_k, gate.attngate_knorm.weight, xa_k)[..., 0]  # [NB, H_kv]
    nq = rms_norm(x_q, gate.attngate_qnorm.weight).norm(dim=-1)
    nk = summaries.norm(dim=-1)  # the fp32 summaries: rms_norm(x_k) rotated
    assert torch.allclose(nk, rms_norm(x_k, gate.attngate_knorm.weight).norm(dim=-1), rtol=1e-5)
    bound = (dq[:, :, None] * nk.T[None] + nq[:, :, None] * dk.T[None] + dq[:, :, None] * dk.T[None]) / dg ** 0.5
    bound = 1.01 * bound[..., : fp32.shape[-1]]
    slack = 1e-6 * fp32[finite].abs().max()  # fp32 rounding of the score itself
    assert (diff <= bound[finite] + slack).all()
    # and the selection from them is a valid one (ascending, -1 padded)
    picked = select_for_queries(_spec("gate", torch.bfloat16, gates), 1, q, k, positions, table, gate_table)
    assert picked.shape == (positions.numel(), k.shape[1], 2)


@pytest.mark.parametrize("selector", ["quest", "sink-local", "oracle", "random"])
def test_selectors_without_a_gate_ignore_the_gate_dtype(selector):
    q, k, positions, table, gate_table, _ = _layer_inputs()
    logits = None
    if selector == "oracle":
        h_kv, g = k.shape[1], q.shape[1] // k.shape[1]
        qs = q.reshape(q.shape[0], h_kv, g, -1).permute(1, 2, 0, 3)  # [H_kv, G, P, D]
        logits = torch.einsum("hgpd,thd->hgpt", qs, k) / q.shape[-1] ** 0.5
    a = block_scores(_spec(selector), 1, q, k, positions, table, None, logits)
    b = block_scores(_spec(selector, torch.bfloat16), 1, q, k, positions, table, None, logits)
    assert torch.equal(a, b)


@pytest.mark.parametrize("selector", ["gate", "quest"])
def test_window_nll_under_each_gate_dtype(selector):
    """fp32 given explicitly is the default bit for bit; bf16 gate weights change the gate's NLL by little and
    Quest's not at all; with bf16 summaries on top (the served configuration), by little too."""
    f32, b16 = torch.float32, torch.bfloat16
    model, g = tiny_llama(), (_gates_with_norms() if selector == "gate" else None)
    ids = torch.randint(0, 256, (WINDOW + 1,), generator=torch.Generator().manual_seed(1))
    cache = prefix_cache(model, ids, LAST)
    # (gate weights, summaries) -> NLL; None: the default
    nll = {dt: window_nll(model, ids, LAST, _spec(selector, dt[0], g, dt[1]), cache)
           for dt in ((None, f32), (f32, f32), (b16, f32), (b16, b16), (None, b16))}
    default, bf16, both, summaries_only = nll[None, f32], nll[b16, f32], nll[b16, b16], nll[None, b16]
    assert nll[f32, f32] == default
    if selector == "quest":
        assert bf16 == default and both == summaries_only
    else:
        assert bf16 == pytest.approx(default, rel=0.05) and both == pytest.approx(default, rel=0.05)


def _ref(gate_dtype=None, summary_dtype=None):
    """A results file's fields that `reuse_plan` reads: one gate variant, quest and sink-local, two budgets."""
    per = {"32": [1.0], "64": [2.0]}
    return {"data": {"d": 1}, "split": "train", "window": 128, "last": 32, "block_size": 16, "windows": 1,
            "gate_sha256": {"g": "abc"},
            "gate_variants": {"g+s0l0": {"gate": "g", "sink_blocks": 0, "local_blocks": 0}},
            "nll_per_window": {"g+s0l0": per, "quest": per, "sink-local": per},
            **({"gate_dtype": gate_dtype} if gate_dtype else {}),
            **({"summary_dtype": summary_dtype} if summary_dtype else {})}


def _plan(ref, **dtypes):
    return reuse_plan(ref, "ref.json", data_record={"d": 1}, split="train", windows=1, window=128, last=32,
                      block_size=16, budgets=[32, 64], variants={"g+s0l0": ("g", 0, 0, 0)}, gate_sha256={"g": "abc"},
                      baselines=["quest", "sink-local"], **dtypes)


def test_reuse_plan_takes_gates_only_across_the_same_gate_dtype():
    every = {"g+s0l0": {32: "g+s0l0", 64: "g+s0l0"}, "quest": {32: "quest", 64: "quest"},
             "sink-local": {32: "sink-local", 64: "sink-local"}}
    baselines = {n: m for n, m in every.items() if n != "g+s0l0"}
    assert _plan(_ref()) == every  # a file without the field is fp32, as the default run
    assert _plan(_ref(), gate_dtype="fp32") == every
    assert _plan(_ref(), gate_dtype="bf16") == baselines  # the baselines have no gate weights
    assert _plan(_ref("bf16"), gate_dtype="fp32") == baselines
    assert _plan(_ref("bf16"), gate_dtype="bf16") == every
    # both dtypes must agree for a gate; quest follows the summaries only
    assert _plan(_ref("bf16", "bf16"), gate_dtype="bf16", summary_dtype="bf16") == every
    assert _plan(_ref("bf16"), gate_dtype="bf16", summary_dtype="bf16") == {"sink-local": every["sink-local"]}
    assert _plan(_ref(None, "bf16"), gate_dtype="bf16", summary_dtype="bf16") == {
        "quest": every["quest"], "sink-local": every["sink-local"]}


@needs_real_assets
def test_eval_ppl_records_the_gate_dtype_and_reuses_only_like_with_like(tmp_path):
    from sas_backend.training import eval_ppl

    argv = tiny_eval_ppl_argv(tmp_path)  # gate g (g+s0l0), quest, sink-local; budgets 32, 64
    fp32_js, bf16_js, back_js, again_js = (str(tmp_path / n) for n in ("fp32.json", "bf16.json", "back.json",
                                                                        "again.json"))
    assert eval_ppl.main(argv + ["--json", fp32_js]) == 0
    assert eval_ppl.main(argv + ["--gate-dtype", "bf16", "--json", bf16_js]) == 0
    fp32, bf16 = json.load(open(fp32_js)), json.load(open(bf16_js))
    assert fp32["gate_dtype"] == "fp32" and bf16["gate_dtype"] == "bf16"
    assert fp32["summary_dtype"] == bf16["summary_dtype"] == "fp32"
    assert "--gate-dtype bf16" in bf16["command"]
    assert "- gate weights: fp32" in open(str(tmp_path / "fp32.md")).read()
    assert "- gate weights: bf16" in open(str(tmp_path / "bf16.md")).read()
    assert bf16["dense_nll_per_window"] == fp32["dense_nll_per_window"]
    for name in ("quest", "sink-local"):  # no gate weights: the same numbers
        assert bf16["nll_per_window"][name] == fp32["nll_per_window"][name]
    for bud in ("32", "64"):
        assert bf16["nll_per_window"]["g+s0l0"][bud][0] == pytest.approx(fp32["nll_per_window"]["g+s0l0"][bud][0],
                                                                          rel=0.05)
    # across gate dtypes, either way, only the baselines are taken; within one, the gate too
    baselines = {"quest": {"32": "quest", "64": "quest"}, "sink-local": {"32": "sink-local", "64": "sink-local"}}
    assert eval_ppl.main(argv + ["--gate-dtype", "bf16", "--reuse", fp32_js, "--json", back_js]) == 0
    back = json.load(open(back_js))
    assert back["reused"]["measurements"] == baselines and back["nll_per_window"] == bf16["nll_per_window"]
    assert eval_ppl.main(argv + ["--reuse", bf16_js, "--json", back_js]) == 0
    back = json.load(open(back_js))
    assert back["reused"]["measurements"] == baselines and back["nll_per_window"] == fp32["nll_per_window"]
    assert eval_ppl.main(argv + ["--gate-dtype", "bf16", "--reuse", bf16_js, "--json", again_js]) == 0
    again = json.load(open(again_js))
    assert again["reused"]["measurements"] == {**baselines, "g+s0l0": {"32": "g+s0l0", "64": "g+s0l0"}}


def test_reuse_plan_takes_summaries_only_across_the_same_sub_blocks():
    """--sub-blocks changes what the gates and quest summarize: across it only the summary-less baselines are
    taken; a file without the field was made with one summary a block."""
    every = {"g+s0l0": {32: "g+s0l0", 64: "g+s0l0"}, "quest": {32: "quest", 64: "quest"},
             "sink-local": {32: "sink-local", 64: "sink-local"}}
    assert _plan(_ref(), sub_blocks=1) == every
    assert _plan(_ref(), sub_blocks=4) == {"sink-local": every["sink-local"]}
    assert _plan({**_ref(), "sub_blocks": 4}, sub_blocks=4) == every


@needs_real_assets
def test_eval_ppl_records_sub_blocks_and_runs_them(tmp_path):
    from sas_backend.training import eval_ppl

    argv = tiny_eval_ppl_argv(tmp_path)  # gate g (g+s0l0), quest, sink-local; budgets 32, 64; block 16
    one_js, four_js = str(tmp_path / "one.json"), str(tmp_path / "four.json")
    assert eval_ppl.main(argv + ["--json", one_js]) == 0
    assert eval_ppl.main(argv + ["--sub-blocks", "4", "--json", four_js]) == 0
    one, four = json.load(open(one_js)), json.load(open(four_js))
    assert one["sub_blocks"] == 1 and four["sub_blocks"] == 4
    assert four["nll_per_window"]["sink-local"] == one["nll_per_window"]["sink-local"]  # no summaries
    for name in ("g+s0l0", "quest"):  # summarized by runs of 4 tokens: another selection somewhere
        assert four["nll_per_window"][name] != one["nll_per_window"][name], name


def test_reuse_plan_takes_calibrated_candidates_only_across_the_same_calibration():
    """--candidates: exactmax and exactmass read no calibration and are taken by name; pairs<R> / pca<R> only from a
    file calibrated on as many tokens (a file without the field calibrated nothing)."""
    per = {"32": [1.0], "64": [2.0]}
    ref = {**_ref(), "nll_per_window": {"exactmass": per, "pca8": per, "pairs4": per}}

    def plan(ref, calib):
        return reuse_plan(ref, "ref.json", data_record={"d": 1}, split="train", windows=1, window=128, last=32,
                          block_size=16, budgets=[32, 64], variants={}, gate_sha256={},
                          baselines=["exactmass", "pca8", "pairs4"], calib_tokens=calib)

    both = {32: None, 64: None}
    assert plan({**ref, "calib_tokens": 4096}, 4096) == {n: {b: n for b in both} for n in ("exactmass", "pca8",
                                                                                            "pairs4")}
    assert plan({**ref, "calib_tokens": 2048}, 4096) == {"exactmass": {b: "exactmass" for b in both}}
    assert plan(ref, 4096) == {"exactmass": {b: "exactmass" for b in both}}


def test_eval_ppl_refuses_what_is_not_a_gate_free_candidate():
    from sas_backend.training.eval_ppl import check_candidates

    assert check_candidates(["exactmax", "pca8mass"]) == ["exactmax", "pca8mass"]
    for bad in ("gatesub16", "pca", "maxmass"):
        with pytest.raises(SystemExit, match=f"--candidates {bad}: not a candidate eval_ppl runs"):
            check_candidates([bad])


@needs_real_assets
def test_eval_ppl_runs_candidates_calibrated_once(tmp_path):
    """--candidates beside the baselines: exactmax / exactmass / pca<R> measured, the calibration's size recorded,
    and a rerun with --reuse takes all of them (same calibration)."""
    from sas_backend.training import eval_ppl

    argv = tiny_eval_ppl_argv(tmp_path) + ["--candidates", "exactmax", "exactmass", "pca4", "--calib-tokens", "256"]
    first_js, again_js = str(tmp_path / "first.json"), str(tmp_path / "again.json")
    assert eval_ppl.main(argv + ["--json", first_js]) == 0
    first = json.load(open(first_js))
    assert first["calib_tokens"] == 256
    for name in ("exactmax", "exactmass", "pca4"):
        assert all(v[0] > 0 for v in first["nll_per_window"][name].values()), name
    assert eval_ppl.main(argv + ["--reuse", first_js, "--json", again_js]) == 0
    again = json.load(open(again_js))
    assert {"exactmax", "exactmass", "pca4"} <= set(again["reused"]["measurements"])


@needs_real_assets
def test_eval_ppl_runs_the_two_level_exact_candidate_from_its_one_gate(tmp_path):
    """--candidates gatec<X>exact takes its first level from the one --gate (its forced blocks, --sub-blocks): at
    X x K covering every candidate it is exactmass; it is measured anew under --reuse (its first level is a gate)."""
    from sas_backend.training import eval_ppl

    argv = tiny_eval_ppl_argv(tmp_path) + ["--candidates", "exactmass", "gatec8exact"]
    first_js, again_js = str(tmp_path / "first.json"), str(tmp_path / "again.json")
    assert eval_ppl.main(argv + ["--json", first_js]) == 0
    first = json.load(open(first_js))
    assert first["nll_per_window"]["gatec8exact"] == first["nll_per_window"]["exactmass"]  # 8 x K >= 7 blocks
    assert eval_ppl.main(argv + ["--reuse", first_js, "--json", again_js]) == 0
    assert "gatec8exact" not in json.load(open(again_js))["reused"]["measurements"]
    no_gate = [a for a in argv if a not in ("--gate-forced", "0,0")]
    no_gate = no_gate[: no_gate.index("--gate")] + no_gate[no_gate.index("--gate") + 2:]
    with pytest.raises(SystemExit, match="exactly one --gate"):
        eval_ppl.main(no_gate)
