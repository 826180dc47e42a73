"""Learned per-token index keys (`hf.learned_keys`, the `keys<R>` candidates): the mass targets are the oracle's
distribution over each query's candidates, training lowers the KL from the pca fit, and eval_ppl reads the file."""

from __future__ import annotations

import pytest
import torch

from sas_backend.hf.candidates import candidate_scores, fit_pca, token_max_scores
from sas_backend.hf.learned_keys import fit_learned_keys, fit_model_keys, mass_targets
from sas_backend.hf.sparse_eval import oracle_scores

B = 16


def _qk(seed=0, t=8 * B, h_kv=2, g=3, d=16):
    """Post-RoPE-like q / k whose scores hinge on a few directions the second moments hide: keys carry a rare
    large component along dim 0 that a query's dim 0 picks out."""
    torch.manual_seed(seed)
    q = torch.randn(t, h_kv * g, d)
    k = torch.randn(t, h_kv, d)
    k[torch.rand(t) < 0.05, :, 0] += 6.0
    q[..., 0] *= 2.0
    return q, k


def test_mass_targets_are_the_oracles_distribution_over_the_candidates():
    q, k = _qk()
    pos = torch.tensor([8 * B - 1, 5 * B + 3])
    got = mass_targets(q[pos], k, pos, B)
    assert got.shape == (2, 2, 8)
    assert torch.allclose(got.sum(-1), torch.ones(2, 2))
    assert (got[1, :, 5:] == 0).all() and (got[0, :, 7:] == 0).all()  # the query's own block is no candidate
    logits = torch.einsum("phgd,thd->hgpt", q[pos].view(2, 2, 3, 16), k)[:, :, :, :] * 16 ** -0.5
    logits = logits.masked_fill(torch.arange(8 * B)[None, None, None, :] > pos[None, None, :, None], float("-inf"))
    mass = oracle_scores(logits, pos, B, 8)
    want = mass[1, :, :5] / mass[1, :, :5].sum(-1, keepdim=True)
    assert torch.allclose(got[1, :, :5], want, atol=1e-6)


def test_training_lowers_the_kl_from_the_pca_fit_and_serves_as_a_candidate():
    q, k = _qk(1)
    pq, pk, rec = fit_learned_keys([(q, k)], 2, B, steps=80, queries=32, lr=1e-2)
    assert pq.shape == pk.shape == (2, 2, 16) and not pq.requires_grad
    assert rec["kl_end"] < 0.8 * rec["kl_start"], rec
    pos = torch.tensor([8 * B - 1])
    s = candidate_scores("keys2mass", 0, q[pos], k, pos, B, {0: (pq, pk)})
    assert torch.allclose(s, token_max_scores(q[pos], k, pos, B, proj=(pq, pk), mass=True))
    assert not torch.allclose(s, token_max_scores(q[pos], k, pos, B, proj=fit_pca(q, k, 2), mass=True))
    with pytest.raises(ValueError, match="has 2 dims"):
        candidate_scores("keys4", 0, q[pos], k, pos, B, {0: (pq, pk)})
    index, records = fit_model_keys([{0: (q, k), 1: (q, k)}], 2, B, steps=2, queries=8)
    assert sorted(index) == sorted(records) == [0, 1]


def test_eval_ppl_reads_the_keys_file(tmp_path):
    from sas_backend.training.eval_ppl import load_keys_index

    path = tmp_path / "keys.pt"
    fit = (torch.zeros(2, 4, 16), torch.zeros(2, 4, 16))
    torch.save({"index": {4: {0: fit}}}, path)
    index = {}
    sha = load_keys_index(str(path), ["keys4mass", "exactmax"], index)
    assert len(sha) == 64 and list(index) == ["keys4mass"] and index["keys4mass"][0][0].shape == (2, 4, 16)
    assert load_keys_index(None, ["exactmax"], {}) is None
    with pytest.raises(SystemExit, match="needs --keys-index"):
        load_keys_index(None, ["keys4"], {})
    with pytest.raises(SystemExit, match="not 8"):
        load_keys_index(str(path), ["keys8"], {})
    with pytest.raises(SystemExit, match="without a keys"):
        load_keys_index(str(path), ["exactmax"], {})
