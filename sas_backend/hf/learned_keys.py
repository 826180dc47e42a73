"""Learned per-token index keys (issue 63's candidate (b)), evaluation only: the `keys<R>` / `keys<R>mass` candidates.

`pca<R>` fits a rank-R map of the post-RoPE q and k from their second moments; here the same map (Pq, Pk), each
`[H_kv, R, D]`, is TRAINED per layer, from the `pca<R>` fit, so that the blocks' softmax mass under the projected
scores (`hf.candidates.token_max_scores(..., mass=True)`, the rule `keys<R>mass` ranks by) distributes over each
query's candidate blocks as the dense attention mass does (`ops.anchors.block_mass`, the oracle's): a KL per
(query, kv head), queries sampled from the second half of each calibration row. What DeepSeek's lightning indexer
does with its own small projections of the hidden state, here a projection of the model's own keys, so that
nothing but R values a token and kv head would be stored. Fitted once from dense forwards of training text
(`bench/learned_keys.py`); an `{layer: (Pq, Pk)}` file is the candidates' index.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from sas_backend.hf.candidates import fit_pca, token_max_scores
from sas_backend.ops.anchors.torch_path import block_mass


def mass_targets(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[P, H_kv, M]` the dense attention mass of each candidate block (complete, before the query's own), as a
    distribution over the candidates (max over the kv group's heads, then normalized); 0 elsewhere.
    q: `[P, H_q, D]` post-RoPE queries at `positions` `[P]`; k: `[T, H_kv, D]` post-RoPE keys."""
    p_cnt, h_q, d = q.shape
    t, h_kv, _ = k.shape
    logits = torch.einsum("phgd,thd->hgpt", q.float().view(p_cnt, h_kv, h_q // h_kv, d), k.float()) * d ** -0.5
    m = t // block_size
    mass = block_mass(logits, positions, block_size, m)  # [P, H_kv, M]
    cand = torch.arange(m, device=q.device)[None, :] < torch.div(positions, block_size, rounding_mode="floor")[:, None]
    mass = mass * cand[:, None, :]
    return mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)


def fit_learned_keys(rows: List[Tuple[torch.Tensor, torch.Tensor]], rank: int, block_size: int, *, steps: int = 150,
                     queries: int = 64, lr: float = 3e-3, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor, dict]:
    """(Pq, Pk, record) of one layer: `[H_kv, rank, D]` each, trained from the `pca<rank>` fit of the first row.

    rows: [(q `[T, H_q, D]`, k `[T, H_kv, D]`)] post-RoPE calibration tensors of this layer (rows may differ in T);
    each step takes `queries` queries of one row (rows in turn) from its second half. record: the KL at the start
    and the end (mean of the first and last 10 steps)."""
    g = torch.Generator().manual_seed(seed)
    pq, pk = fit_pca(rows[0][0], rows[0][1], rank)
    pq, pk = pq.clone().requires_grad_(True), pk.clone().requires_grad_(True)
    opt = torch.optim.Adam([pq, pk], lr=lr)
    losses = []
    for step in range(steps):
        q_all, k_all = rows[step % len(rows)]
        t = k_all.shape[0]
        pos = torch.randint(t // 2, t, (queries,), generator=g)
        k = k_all[: int(pos.max()) + 1]
        with torch.no_grad():
            target = mass_targets(q_all[pos], k, pos, block_size)
        scores = token_max_scores(q_all[pos], k, pos, block_size, proj=(pq, pk), mass=True)
        logp = torch.log_softmax(scores, dim=-1).nan_to_num(neginf=0.0)  # -inf past the candidates: 0 x log 0
        loss = (target * (target.clamp_min(1e-30).log() - logp)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    head, tail = losses[: min(10, steps)], losses[-min(10, steps):]
    return pq.detach(), pk.detach(), {"kl_start": sum(head) / len(head), "kl_end": sum(tail) / len(tail)}


def fit_model_keys(per_row: List[Dict[int, tuple]], rank: int, block_size: int, **kwargs):
    """({layer: (Pq, Pk)}, {layer: record}) for every layer of `per_row` (`hf.candidates.record_model_qk` of each
    calibration row), `fit_learned_keys` per layer."""
    index, records = {}, {}
    for layer in sorted(per_row[0]):
        pq, pk, rec = fit_learned_keys([row[layer] for row in per_row], rank, block_size, **kwargs)
        index[layer], records[layer] = (pq, pk), rec
    return index, records
