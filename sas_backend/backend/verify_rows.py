"""A speculative verify batch seen as decode rows: what makes the sparse verify step the decode step.

In SGLang's `TARGET_VERIFY` forward each of the batch's `bs` requests brings n draft tokens (a chain:
`--speculative-eagle-topk 1` or NGRAM's `--speculative-ngram-max-bfs-breadth 1`): rows `b*n .. b*n+n-1` of q/k/v
at positions `L_b .. L_b + n - 1`, where `seq_lens[b] = L_b` counts the verified tokens only, and the rows'
K/V go to `out_cache_loc = req_to_token[req, L_b : L_b + n]` (docs/speculative.md). Draft row j of request b
is what a decode step at position L_b + j would be: the request's req row, `seq_len = L_b + j + 1`, its own
q. So the verify step is the decode step over bs * n such rows (`expand`), with every row's K/V written first:
row j selects from the complete blocks before its own block (one completed by earlier drafts included: the
row whose token completes it writes its summary, as a decode step would, before any row selects) and attends
its selection and its own block up to itself (the drafts before it: causal). A draft-completed block whose
drafts are then rejected leaves a summary in the pool row of a page that the committed sequence has not
completed; it is never a candidate until that block completes again, and the row that completes it rewrites the
summary first (tests/test_sparse_verify.py: a rejected draft block, then a different completion).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def draft_tokens_from_args(server_args) -> int:
    """n of `--speculative-num-draft-tokens` when speculative decoding is on, else 0 (no verify steps)."""
    if not getattr(server_args, "speculative_algorithm", None):
        return 0
    return int(getattr(server_args, "speculative_num_draft_tokens", None) or 0)


def draft_tokens(forward_batch) -> int:
    """n: the draft tokens of each request of a verify batch (`spec_info.draft_token_num`)."""
    spec = getattr(forward_batch, "spec_info", None)
    n = getattr(spec, "draft_token_num", None)
    if not n:
        raise RuntimeError("sas: a TARGET_VERIFY batch without spec_info.draft_token_num (the drafts per request)")
    return int(n)


def expand(seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, n: int,
           out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The decode rows of a verify batch: (seq_lens `[bs * n]` = L_b + j + 1, req_pool_indices `[bs * n]`),
    row b * n + j for draft j of request b; from seq_lens `[bs]` (L_b) and req_pool_indices `[bs]`. Fixed shapes,
    no host sync (capturable); out: persistent `[>= bs * n]` buffers to write into (CUDA graphs)."""
    bs = seq_lens.shape[0]
    depth = torch.arange(1, n + 1, device=seq_lens.device, dtype=seq_lens.dtype)
    lens = (seq_lens[:, None] + depth[None, :]).reshape(bs * n)
    reqs = req_pool_indices[:, None].expand(bs, n).reshape(bs * n)
    if out is None:
        return lens, reqs
    out_lens, out_reqs = out[0][: bs * n], out[1][: bs * n]
    out_lens.copy_(lens)
    out_reqs.copy_(reqs)
    return out_lens, out_reqs


def expand_host(seq_lens_cpu: torch.Tensor, n: int) -> torch.Tensor:
    """The host mirror of `expand`'s seq_lens: int64 `[bs * n]`."""
    return (seq_lens_cpu.to(torch.int64)[:, None] + torch.arange(1, n + 1)[None, :]).reshape(-1)


def check_chain(forward_batch, n: int) -> None:
    """Eager CPU check that the verify batch is a chain: positions L_b + j, and a draft mask (if any) that
    is causal among the drafts. A tree draft is refused at launch (plugin.py); this catches an SGLang path
    that builds one anyway, before a wrong answer."""
    from sas_backend.dense_verify import draft_masks

    lens = forward_batch.seq_lens_cpu.to(torch.int64)
    want = expand_host(lens, n) - 1
    if not torch.equal(forward_batch.positions.to(torch.int64).cpu(), want):
        raise RuntimeError("sas: a verify batch whose draft positions are not a chain (L + 0 .. L + n - 1); "
                           "sas verifies chains only (--speculative-eagle-topk 1)")
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for b, mask in enumerate(draft_masks(forward_batch.spec_info, lens.tolist(), n)):
        if not torch.equal(mask.cpu(), causal):
            raise RuntimeError(f"sas: request {b} of a verify batch has a tree draft mask; sas verifies chains only "
                               "(--speculative-eagle-topk 1, or NGRAM with --speculative-ngram-max-bfs-breadth 1)")


class VerifyRowBuffers:
    """Persistent `expand` outputs for captured verify steps: `[max_rows]` int64 lengths and req rows."""

    def __init__(self, max_rows: int, device):
        self.lens = torch.ones(max_rows, dtype=torch.int64, device=device)
        self.reqs = torch.zeros(max_rows, dtype=torch.int64, device=device)

    def view(self, rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.lens[:rows], self.reqs[:rows]
