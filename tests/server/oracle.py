"""The server's sparse decode against the transformers oracle (`sas_backend.hf.sparse_eval`)."""

from __future__ import annotations

import math

import torch

from sas_backend.server_harness import ON_GPU

# The server runs fp32 on CPU (same math as the oracle up to summation order); bf16 on GPU.
LOGPROB_TOL = 0.15 if ON_GPU else 2e-3


def oracle_check(prompt, out, records, model_dir, spec, prompt_len):
    """The server's decode logprobs and its first sparse step's selection (layer 0) equal the
    transformers oracle's under `spec`, and differ from dense by far more than the tolerance."""
    from transformers import AutoModelForCausalLM

    from sas_backend.hf.sparse_eval import sparse_eval

    server_logprobs = out["logprobs"]["token_logprobs"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generated = out["token_ids"]
    assert len(generated) == len(server_logprobs)
    ids = torch.tensor([prompt + generated[:-1]])
    record = {}
    with torch.no_grad():
        with sparse_eval(model, spec, record=record):
            sparse_logits = model(ids).logits[0].float()
        dense_logits = model(ids).logits[0].float()
    sparse_lp = torch.log_softmax(sparse_logits, -1)
    dense_lp = torch.log_softmax(dense_logits, -1)
    gaps_dense = []
    # Decode step i (i >= 1) reads the token at position prompt_len - 1 + i; the prefill's own
    # last position (i = 0) is dense in both.
    for i in range(1, len(generated)):
        pos = prompt_len - 1 + i
        oracle = sparse_lp[pos, generated[i]].item()
        assert math.isclose(server_logprobs[i], oracle, abs_tol=LOGPROB_TOL), (i, server_logprobs[i], oracle)
        gaps_dense.append(abs(dense_lp[pos, generated[i]].item() - oracle))
        if not ON_GPU:  # the token the server chose is the oracle's argmax (greedy decoding)
            assert sparse_lp[pos].argmax().item() == generated[i]
    # The comparison can tell sparse from dense: they differ by far more than the tolerance.
    assert max(gaps_dense) > 2e-2, gaps_dense
    # Same blocks chosen, layer 0, first decode step (query position prompt_len).
    if not ON_GPU:  # bf16 scores on GPU may order near-equal blocks differently
        assert records[0]["selected"][0] == record[0][0].tolist()
