"""Cached dense features and distillation from them: the same loss and gradients as `train`'s
distill objective, a resumable and self-checking cache, and the CLIs end to end on a tiny model."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import pytest
import torch

import sas_backend.training.features as feats
from sas_backend.training.distill_cached import RowBatch, mean_loss
from sas_backend.training.features import FeatureCacheError, FeatureSpec, build_feature_cache, load_feature_cache
from sas_backend.training.model import GateTrainSpec, attach_gates, detach_gates, objective_loss
from tiny_llama import ESSAYS_DIR, have_real_assets, save_tiny_model_dir, tiny_llama

REPO = pathlib.Path(__file__).resolve().parents[2]

SEQ, B, TAIL = 80, 16, 48  # 5 blocks of 16; the last 48 positions are queries


def _rows(n=2, seed=0):
    return torch.randint(0, 256, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def _gates(seed=3):
    from sas_backend.gate.module import AttnGate

    torch.manual_seed(seed)
    return {i: AttnGate(2, 2, 16, 32) for i in range(2)}


def _manifest(spec, rows=2):
    return {"format_version": feats.FORMAT_VERSION, "num_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, **spec.__dict__, "rows": rows, "seed": 0,
            "data": {}, "recall": None, "model": "tiny"}


@pytest.mark.parametrize("target,forced", [("mass", (0, 0)), ("mass", (1, 1)), ("max", (1, 0))])
def test_cached_loss_and_gradients_equal_train_distill(monkeypatch, target, forced):
    """The loss (sum over layers of the mean per-query KL) and every gate gradient computed from
    cached features equal `train`'s distill objective on the same rows with train_last = tail."""
    monkeypatch.setattr(feats, "STORE_DTYPE", torch.float32)  # compare the math, not fp16 rounding
    from sas_backend.geometry import ModelGeometry, gate_rope_table

    model = tiny_llama()
    ids = _rows()
    spec = FeatureSpec(SEQ, TAIL, B, target)
    cached = [feats.row_features(model, ids[i], spec) for i in range(2)]
    sink, local = forced
    gates = _gates()
    attached = attach_gates(model, GateTrainSpec(block_size=B, budget=48, objective="distill", distill_target=target,
                                                 train_last=TAIL, sink_blocks=sink, local_blocks=local), gates)
    want = objective_loss(model, ids)
    want.backward()
    want_grads = {i: {n: p.grad.clone() for n, p in g.named_parameters()} for i, g in attached.items()}
    detach_gates(model)
    table = gate_rope_table(32, ModelGeometry.from_hf_config(model.config), SEQ)
    got = mean_loss(gates, cached, spec, table, 3, sink, local)
    assert got == pytest.approx(float(want.detach()), rel=1e-5)
    for i, g in gates.items():
        for n, p in g.named_parameters():
            torch.testing.assert_close(p.grad, want_grads[i][n], rtol=1e-4, atol=1e-6)


def test_rows_of_two_lengths_train_together_weighted_by_rows(monkeypatch):
    """`mean_loss` over rows of SEQ and 2 x SEQ tokens (`lengths`): each length stacked on its own and weighted by
    its share of the rows, so the loss and every gradient are the row-weighted mean of each length's own
    `mean_loss`; one length given explicitly is the plain call."""
    monkeypatch.setattr(feats, "STORE_DTYPE", torch.float32)
    from sas_backend.geometry import ModelGeometry, gate_rope_table

    model = tiny_llama()
    short, long_ = FeatureSpec(SEQ, TAIL, B, "mass"), FeatureSpec(2 * SEQ, TAIL, B, "mass")
    rows_s = [feats.row_features(model, r, short) for r in _rows(2, seed=1)]
    rows_l = [feats.row_features(model, r, long_)
              for r in torch.randint(0, 256, (1, 2 * SEQ), generator=torch.Generator().manual_seed(2))]
    table = gate_rope_table(32, ModelGeometry.from_hf_config(model.config), 2 * SEQ)

    def run(rows, spec, lengths=None):
        gates = _gates()
        loss = mean_loss(gates, rows, spec, table, 3, 1, 1, lengths=lengths)
        return loss, {i: {n: p.grad.clone() for n, p in g.named_parameters()} for i, g in gates.items()}

    both, both_grads = run([rows_l[0], *rows_s], short, [2 * SEQ, SEQ, SEQ])
    only_s, grads_s = run(rows_s, short)
    only_l, grads_l = run(rows_l, long_)
    assert both == pytest.approx(2 / 3 * only_s + 1 / 3 * only_l, rel=1e-5)
    for i in both_grads:
        for n, g in both_grads[i].items():
            torch.testing.assert_close(g, 2 / 3 * grads_s[i][n] + 1 / 3 * grads_l[i][n], rtol=1e-4, atol=1e-6)
    same, _ = run(rows_s, short, [SEQ, SEQ])
    assert same == only_s


def test_row_features_shapes_and_target():
    """q is the tail's pre-RoPE q, pooled the complete blocks' max|min|mean, the target a
    distribution over each query's previous blocks (zero elsewhere)."""
    model = tiny_llama()
    spec = FeatureSpec(SEQ, TAIL, B, "mass")
    out = feats.row_features(model, _rows(1)[0], spec)
    assert set(out) == {f"{n}.{i}" for n in ("q", "pooled", "target") for i in range(2)}
    assert out["q.0"].shape == (TAIL, 4, 16) and out["q.0"].dtype == torch.float16
    assert out["pooled.1"].shape == (SEQ // B, 2, 48)
    tgt = out["target.0"].float()  # [Hkv, N, NB]
    assert tgt.shape == (2, TAIL, 5)
    own = torch.arange(SEQ - TAIL, SEQ) // B
    prev = torch.arange(5)[None, :] < own[:, None]
    assert (tgt[:, ~prev] == 0).all()
    torch.testing.assert_close(tgt.sum(-1), torch.ones(2, TAIL), atol=2e-3, rtol=0)
    with pytest.raises(ValueError, match="tail"):
        FeatureSpec(SEQ, SEQ, B)
    with pytest.raises(ValueError, match="target"):
        FeatureSpec(SEQ, TAIL, B, "mean")


def test_bfloat16_forward_gives_the_fp32_features_within_rounding():
    """`--dtype bfloat16` runs the frozen model in bf16; q, k and the target are still computed in fp32
    from its q and k, so the features differ from an fp32 forward by bf16 rounding only."""
    model = tiny_llama()
    spec = FeatureSpec(SEQ, TAIL, B, "mass")
    ids = _rows(1)[0]
    want = feats.row_features(model, ids, spec)
    got = feats.row_features(model.to(torch.bfloat16), ids, spec)
    assert got.keys() == want.keys() and all(t.dtype == torch.float16 for t in got.values())
    for name in want:
        torch.testing.assert_close(got[name].float(), want[name].float(), atol=0.05, rtol=0.05)
    tgt = got["target.1"].float()
    torch.testing.assert_close(tgt.sum(-1), torch.ones_like(tgt.sum(-1)), atol=2e-3, rtol=0)  # still distributions


def test_cache_resumes_shards_and_refuses_bad_input(tmp_path):
    model = tiny_llama()
    spec = FeatureSpec(SEQ, TAIL, B, "mass")
    ids = _rows(3)
    out = str(tmp_path / "cache")
    man = _manifest(spec, rows=3)
    assert build_feature_cache(model, ids, spec, out, man, shard=(1, 2)) == 1  # row 1 only
    with pytest.raises(FeatureCacheError, match="row 0 of 3 missing"):
        load_feature_cache(out)
    assert build_feature_cache(model, ids, spec, out, man) == 2  # rows 0 and 2; row 1 kept
    cache = load_feature_cache(out)
    assert len(cache.rows) == 3 and cache.spec == spec
    torch.testing.assert_close(cache.rows[1]["q.0"], feats.row_features(model, ids[1], spec)["q.0"])
    lazy = load_feature_cache(out, lazy=True)  # checked from the headers, read when used
    assert isinstance(lazy.rows, feats.LazyRows) and len(lazy.rows) == 3
    for i in range(3):
        assert lazy.rows[i].keys() == cache.rows[i].keys()
        assert all(torch.equal(lazy.rows[i][k], cache.rows[i][k]) for k in cache.rows[i])
    with pytest.raises(FeatureCacheError, match="other settings.*tail"):
        build_feature_cache(model, ids, FeatureSpec(SEQ, 32, B), out, _manifest(FeatureSpec(SEQ, 32, B), rows=3))
    with open(os.path.join(out, feats.row_file(2)), "wb") as f:
        f.write(b"not a safetensors file")
    with pytest.raises(FeatureCacheError, match="row-00002.*unreadable"):
        load_feature_cache(out)
    with pytest.raises(FeatureCacheError, match="row-00002.*unreadable"):
        load_feature_cache(out, lazy=True)
    with pytest.raises(FeatureCacheError, match="no manifest.json"):
        load_feature_cache(str(tmp_path))


def test_row_batch_packs_rows():
    spec = FeatureSpec(SEQ, TAIL, B, "mass")
    rows = [{"q.0": torch.full((TAIL, 4, 16), float(i)), "pooled.0": torch.zeros(5, 2, 48),
             "target.0": torch.zeros(2, TAIL, 5)} for i in range(3)]
    batch = RowBatch(rows, 0, spec)
    assert batch.q.shape == (3 * TAIL, 4, 16) and batch.q[TAIL, 0, 0] == 1
    assert batch.target.shape == (2, 3 * TAIL, 5)
    assert batch.bounds == [(0, SEQ), (SEQ, 2 * SEQ), (2 * SEQ, 3 * SEQ)] and batch.query_start == SEQ - TAIL


def test_run_pooling_regroups_to_any_coarser_run():
    """A cache pooled per run of b / 4 tokens holds what b / 2 and whole-block pooling hold (`pool_runs`: max of
    maxes, min of mins, mean of means), and row r's runs sit at rows m * n + j."""
    model = tiny_llama()
    ids = _rows(1)[0]
    by = {n: feats.row_features(model, ids, FeatureSpec(SEQ, TAIL, B, "mass", sub_blocks=n)) for n in (1, 2, 4)}
    assert by[4]["pooled.0"].shape == (SEQ // B * 4, 2, 48)
    for layer in range(2):
        fine = by[4][f"pooled.{layer}"].float()
        for n in (1, 2, 4):
            torch.testing.assert_close(feats.pool_runs(fine, 4, n), by[n][f"pooled.{layer}"].float(), atol=2e-3,
                                       rtol=1e-3)  # fp16 storage: the mean of fp16 means
    assert torch.equal(by[4]["target.1"], by[1]["target.1"]) and torch.equal(by[4]["q.1"], by[1]["q.1"])
    with pytest.raises(ValueError, match="must divide"):
        feats.pool_runs(fine, 2, 4)
    with pytest.raises(ValueError, match="sub_blocks"):
        FeatureSpec(SEQ, TAIL, B, "mass", sub_blocks=3)


@pytest.mark.parametrize("sink,local", [(0, 0), (1, 1)])
def test_sub_block_loss_and_gradients_equal_the_stated_rule(monkeypatch, sink, local):
    """`distill_cached` with n runs a block: the loss is the KL of the target to the gates' log-softmax over
    blocks scored by their best run (each run summarized from its own pooled keys, RoPE at its first position),
    stated here with plain autograd ops; loss and every gradient agree. n = 1 on a 4-run cache is the whole-block
    loss of a 1-run cache."""
    import math

    from sas_backend.geometry import ModelGeometry, gate_rope_table
    from sas_backend.training.model import distill_kl, target_over_candidates
    from sas_backend.training.scoring import candidate_blocks

    monkeypatch.setattr(feats, "STORE_DTYPE", torch.float32)
    model = tiny_llama()
    ids = _rows()
    spec4 = FeatureSpec(SEQ, TAIL, B, "mass", sub_blocks=4)
    cached = [feats.row_features(model, ids[i], spec4) for i in range(2)]
    table = gate_rope_table(32, ModelGeometry.from_hf_config(model.config), SEQ)
    whole = [feats.row_features(model, ids[i], FeatureSpec(SEQ, TAIL, B, "mass")) for i in range(2)]
    one = mean_loss(_gates(), [dict(r) for r in cached], FeatureSpec(SEQ, TAIL, B, "mass", sub_blocks=1), table, 3,
                    sink, local)
    assert one == pytest.approx(mean_loss(_gates(), whole, FeatureSpec(SEQ, TAIL, B, "mass"), table, 3, sink, local),
                                rel=1e-5)
    n, spec2 = 2, FeatureSpec(SEQ, TAIL, B, "mass", sub_blocks=2)
    gates = _gates()
    got = mean_loss(gates, cached, spec2, table, 3, sink, local)
    got_grads = {i: {k: p.grad.clone() for k, p in g.named_parameters()} for i, g in gates.items()}
    ref_gates = _gates()
    want = 0.0
    full = SEQ // B
    starts = (torch.arange(full)[:, None] * B + torch.arange(n) * (B // n)).reshape(-1)
    pos = torch.arange(SEQ - TAIL, SEQ)
    cand, forced = candidate_blocks(pos, full, B, sink, local)
    for layer, gate in ref_gates.items():
        loss = 0.0
        for r in cached:
            pooled = feats.pool_runs(r[f"pooled.{layer}"].float(), 4, n)  # [full * n, Hkv, 3D]
            kg = gate.summarize_pooled(pooled, table[starts]).view(full, n, 2, 32)
            qg = gate.query(r[f"q.{layer}"].float(), table[pos])  # [TAIL, Hkv, Dg]
            s = torch.einsum("thd,mnhd->htmn", qg, kg).amax(-1) / math.sqrt(32)
            lg = torch.log_softmax(s.masked_fill(~cand, float("-inf")), dim=-1)
            lg = torch.where(cand, lg, torch.full_like(lg, float("-inf"))).masked_fill(forced, 0.0)
            target = target_over_candidates(r[f"target.{layer}"].float(), pos, B, sink, local)
            loss = loss + distill_kl(target, lg) * TAIL
        loss = loss / (2 * TAIL)  # the per-query mean over both rows
        loss.backward()
        want += float(loss.detach())
    assert got == pytest.approx(want, rel=1e-5)
    for i, g in ref_gates.items():
        for k, p in g.named_parameters():
            torch.testing.assert_close(got_grads[i][k], p.grad, rtol=1e-4, atol=1e-6)


# ---- the CLIs on a tiny model and the real essays -------------------------------------------


@pytest.fixture(scope="module")
def cli_caches(tmp_path_factory):
    if not have_real_assets():
        pytest.skip("needs models/SmolLM2-135M-Instruct (tokenizer) and models/text/essays")
    os.environ.setdefault("SAS_ESSAYS_DIR", ESSAYS_DIR)
    root = tmp_path_factory.mktemp("features")
    model_dir = save_tiny_model_dir(str(root / "model"))
    from sas_backend.training.features import main

    common = ["--model", model_dir, "--data", ESSAYS_DIR, "--seq-len", "512", "--tail", "192", "--no-progress"]
    train = common + ["--out", str(root / "train"), "--max-rows", "6", "--recall-rows", "0.5", "--recall-facts", "2"]
    assert main(train + ["--shard", "1/2"]) == 0  # two shards fill one cache
    assert main(train + ["--shard=0/2"]) == 0
    assert main(common + ["--out", str(root / "val"), "--split", "heldout", "--max-rows", "2"]) == 0
    return root, model_dir


def test_cli_records_a_bfloat16_forward_and_keeps_fp32_manifests_as_they_were(cli_caches, tmp_path):
    from sas_backend.training.features import main

    root, model_dir = cli_caches
    assert "compute_dtype" not in json.load(open(root / "val" / "manifest.json"))  # fp32: as before the option
    out = tmp_path / "bf16"
    args = ["--model", model_dir, "--data", ESSAYS_DIR, "--seq-len", "512", "--tail", "192", "--no-progress",
            "--out", str(out), "--split", "heldout", "--max-rows", "1"]
    assert main(args + ["--dtype", "bfloat16"]) == 0
    manifest = json.load(open(out / "manifest.json"))
    assert manifest["compute_dtype"] == "bfloat16" and "--dtype bfloat16" in manifest["command"]
    assert len(load_feature_cache(str(out)).rows) == 1
    with pytest.raises(SystemExit, match="other settings.*compute_dtype"):  # an fp32 build may not mix in
        main(args)


def _distill(root, model_dir, out, *extra):
    from sas_backend.training.distill_cached import main

    return main(["--model", model_dir, "--cache", str(root / "train"), "--val-cache", str(root / "val"),
                 "--out", str(out), "--budget", "192", "--steps", "30", "--rows-per-step", "2", "--lr", "1e-2",
                 "--warmup", "2", "--eval-every", "10", "--no-progress", *extra])


def test_cli_distills_resumes_and_writes_a_servable_checkpoint(cli_caches, tmp_path):
    from sas_backend.gate.checkpoint import load_gate_checkpoint, validate_for_geometry
    from sas_backend.geometry import ModelGeometry

    root, model_dir = cli_caches
    manifest = json.load(open(root / "train" / "manifest.json"))
    assert manifest["recall"]["facts_placed"] > 0 and manifest["data"]["split"] == "train"
    assert _distill(root, model_dir, tmp_path / "a") == 0
    log = [json.loads(line) for line in open(tmp_path / "a" / "train_log.jsonl")]
    assert len(log) == 30
    config, tensors = load_gate_checkpoint(str(tmp_path / "a"))
    validate_for_geometry(config, tensors, ModelGeometry.from_model_dir(model_dir), block_size=64)
    rec = config.training
    kl = [v["kl"] for v in rec["heldout_kl"]]
    assert [v["step"] for v in rec["heldout_kl"]] == [0, 10, 20, 30]
    assert kl[-1] < kl[0]  # distillation generalizes to held-out text
    assert rec["objective"] == "distill" and rec["sink_blocks"] == 1 and rec["top_k"] == 3
    assert rec["data"]["caches"][0]["recall"]["facts_placed"] > 0
    built = rec["data"]["caches"][0]["command"]  # how the cache was built, shard-free and portable
    assert built.startswith("python -m sas_backend.training.features ") and "--recall-rows 0.5" in built
    assert "--shard" not in built and "/tmp" not in built
    assert "/tmp" not in rec["command"] and "distill_cached" in rec["command"]
    # interrupted at step 12, resumed: the same gates as the uninterrupted run
    assert _distill(root, model_dir, tmp_path / "b", "--stop-at", "12") == 0
    assert _distill(root, model_dir, tmp_path / "b", "--resume") == 0
    _, resumed = load_gate_checkpoint(str(tmp_path / "b"))
    for layer, ts in tensors.items():
        for name, t in ts.items():
            torch.testing.assert_close(resumed[layer][name], t, rtol=1e-5, atol=1e-6)
    with pytest.raises(SystemExit, match="different settings.*lr"):
        _distill(root, model_dir, tmp_path / "b", "--resume", "--lr", "1e-3")
    with pytest.raises(SystemExit, match="leave none"):
        _distill(root, model_dir, tmp_path / "c", "--budget", "128")
    with pytest.raises(SystemExit, match="not a multiple"):
        _distill(root, model_dir, tmp_path / "c", "--budget", "100")


def test_cli_trains_caches_of_two_row_lengths_together(cli_caches, tmp_path):
    """Issue 63: 16K and 32K rows in one run. A cache of 1024-token rows beside the 512-token ones (same tail and
    block): the run reports both lengths, records them, and its held-out KL falls; a cache of another tail is
    still refused."""
    from sas_backend.gate.checkpoint import load_gate_checkpoint
    from sas_backend.training.features import main as features

    root, model_dir = cli_caches
    common = ["--model", model_dir, "--data", ESSAYS_DIR, "--tail", "192", "--no-progress", "--max-rows", "2"]
    assert features(common + ["--seq-len", "1024", "--out", str(tmp_path / "long")]) == 0
    assert _distill(root, model_dir, tmp_path / "gate", "--cache", str(root / "train"), str(tmp_path / "long"),
                    "--steps", "20") == 0
    config, _ = load_gate_checkpoint(str(tmp_path / "gate"))
    rec = config.training
    assert rec["data"]["seq_lens"] == [512, 1024] and rec["data"]["rows"] == 8
    kl = [v["kl"] for v in rec["heldout_kl"]]
    assert kl[-1] < kl[0]
    assert features(["--model", model_dir, "--data", ESSAYS_DIR, "--tail", "128", "--no-progress", "--max-rows", "1",
                     "--seq-len", "1024", "--out", str(tmp_path / "tail128")]) == 0
    with pytest.raises(SystemExit, match="differs from .* in tail"):
        _distill(root, model_dir, tmp_path / "bad", "--cache", str(root / "train"), str(tmp_path / "tail128"))


def test_cli_coverage_term_raises_held_out_coverage_and_is_recorded(cli_caches, tmp_path):
    """--coverage-weight trains the top-k coverage of a budget (logged held out at every evaluation)
    and the record says so; a coverage budget the forced blocks fill is refused."""
    from sas_backend.gate.checkpoint import load_gate_checkpoint

    root, model_dir = cli_caches
    assert _distill(root, model_dir, tmp_path / "cov", "--coverage-weight", "5", "--coverage-budgets", "192",
                    "--coverage-temperature", "0.3") == 0
    rec = load_gate_checkpoint(str(tmp_path / "cov"))[0].training
    assert rec["coverage"] == {"weight": 5.0, "budgets": [192], "temperature": 0.3}
    assert "top-k coverage" in rec["method"]
    cov = [v["coverage"]["192"] for v in rec["heldout_kl"]]
    assert len(cov) == 4 and all(0 < c <= 1 for c in cov) and cov[-1] > cov[0]
    oracle = rec["heldout_oracle_coverage"]["192"]  # the target's own top k: no selector covers more
    assert all(c <= oracle + 1e-5 for c in cov) and oracle < 1
    assert _distill(root, model_dir, tmp_path / "regret", "--coverage-weight", "5", "--coverage-budgets", "192",
                    "--coverage-temperature", "0.3", "--coverage-regret") == 0
    rec = load_gate_checkpoint(str(tmp_path / "regret"))[0].training
    assert rec["coverage"]["regret"] is True and "(the oracle's top-k coverage" in rec["method"]
    cov = [v["coverage"]["192"] for v in rec["heldout_kl"]]
    assert cov[-1] > cov[0]  # less regret: the gate's top k covers more

    # bench/coverage_gap.py reads the same held-out numbers per layer: their means are what training logged
    spec = importlib.util.spec_from_file_location("coverage_gap", REPO / "bench" / "coverage_gap.py")
    coverage_gap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(coverage_gap)
    out = tmp_path / "gap.json"
    assert coverage_gap.main(["--model", model_dir, "--val-cache", str(root / "val"),
                              "--gate", f"regret={tmp_path / 'regret'}", "--budgets", "192",
                              "--sink-blocks", "1", "--local-blocks", "1", "--json", str(out)]) == 0
    gap = json.loads(out.read_text())["gaps"]["regret"]["192"]
    assert sum(gap["gate"]) / len(gap["gate"]) == pytest.approx(cov[-1], abs=1e-4)
    assert sum(gap["oracle"]) / len(gap["oracle"]) == pytest.approx(rec["heldout_oracle_coverage"]["192"], abs=1e-4)
    assert all(g <= o + 1e-6 for g, o in zip(gap["gate"], gap["oracle"]))
    shares = list(gap["worst_share"].values())
    assert shares == sorted(shares) and 0 < shares[0] <= shares[-1] <= 1
    with pytest.raises(SystemExit, match="coverage-budgets"):
        _distill(root, model_dir, tmp_path / "bad", "--coverage-weight", "1", "--coverage-budgets", "128")


def test_cli_layers_trains_only_those_gates(cli_caches, tmp_path):
    """--layers trains the named layers' gates and keeps the others exactly as --init-gate had them."""
    from sas_backend.gate.checkpoint import load_gate_checkpoint

    root, model_dir = cli_caches
    assert _distill(root, model_dir, tmp_path / "init", "--steps", "5") == 0
    assert _distill(root, model_dir, tmp_path / "one", "--layers", "1", "--init-gate", str(tmp_path / "init")) == 0
    _, init = load_gate_checkpoint(str(tmp_path / "init"))
    config, got = load_gate_checkpoint(str(tmp_path / "one"))
    assert config.training["layers"] == [1]
    for name, t in init[0].items():
        torch.testing.assert_close(got[0][name], t, rtol=0, atol=0)
    assert any(not torch.equal(got[1][n], t) for n, t in init[1].items())
    with pytest.raises(SystemExit, match="needs --init-gate"):
        _distill(root, model_dir, tmp_path / "bad", "--layers", "1")
    with pytest.raises(SystemExit, match="must name layers"):
        _distill(root, model_dir, tmp_path / "bad", "--layers", "7", "--init-gate", str(tmp_path / "init"))


def test_cli_refuses_to_train_on_a_held_out_cache(cli_caches, tmp_path):
    """A held-out (or out-of-domain) cache is for --val-cache only: given as --cache it is refused."""
    from sas_backend.training.distill_cached import main

    root, model_dir = cli_caches
    with pytest.raises(SystemExit, match="train on training splits only"):
        main(["--model", model_dir, "--cache", str(root / "val"), "--out", str(tmp_path / "x"), "--budget", "192",
              "--steps", "1", "--no-progress"])
    assert not (tmp_path / "x" / "gate.safetensors").exists()


def test_cli_sub_block_gates_train_and_serve_with_their_runs(cli_caches, tmp_path):
    """`features --sub-blocks 2` pools runs of 32 tokens; `distill_cached --sub-blocks 2` trains gates that score a
    block by its best run, lowers the held-out KL, and writes a checkpoint whose `serving.sub_blocks` makes a server
    serve it so (and its record says so); a cache pooled per whole block is refused for it, by name."""
    from sas_backend.gate.checkpoint import load_gate_checkpoint
    from sas_backend.training.distill_cached import main as distill
    from sas_backend.training.features import main

    root, model_dir = cli_caches
    common = ["--model", model_dir, "--data", ESSAYS_DIR, "--seq-len", "512", "--tail", "192", "--no-progress",
              "--sub-blocks", "2"]
    assert main(common + ["--out", str(tmp_path / "train2"), "--max-rows", "4"]) == 0
    assert main(common + ["--out", str(tmp_path / "val2"), "--split", "heldout", "--max-rows", "2"]) == 0
    assert json.load(open(tmp_path / "train2" / "manifest.json"))["sub_blocks"] == 2
    assert "sub_blocks" not in json.load(open(root / "val" / "manifest.json"))  # whole blocks: as before the option
    args = ["--model", model_dir, "--cache", str(tmp_path / "train2"), "--val-cache", str(tmp_path / "val2"),
            "--out", str(tmp_path / "g"), "--budget", "192", "--steps", "20", "--rows-per-step", "2", "--lr", "1e-2",
            "--warmup", "2", "--eval-every", "10", "--no-progress"]
    assert distill(args + ["--sub-blocks", "2"]) == 0
    config, _ = load_gate_checkpoint(str(tmp_path / "g"))
    assert config.serving == {"sub_blocks": 2} and config.training["sub_blocks"] == 2
    assert config.serve_defaults()["sub_blocks"] == 2
    kl = [v["kl"] for v in config.training["heldout_kl"]]
    assert kl[-1] < kl[0]
    with pytest.raises(SystemExit, match="caches pool runs of block / 1"):
        _distill(root, model_dir, tmp_path / "h", "--sub-blocks", "2")
    with pytest.raises(SystemExit, match="differs.*sub_blocks"):  # a whole-block val cache beside run caches
        distill(args[:4] + ["--val-cache", str(root / "val")] + args[6:] + ["--sub-blocks", "2"])
