"""Speculative decoding with `--attention-backend sas`: what a launch may ask for, and NGRAM's drafts as chains.

sas verifies chains: each verify row is the decode step at its own position over the request's KV in
req_to_token order (backend/verify_rows.py). So a launch is refused unless its drafts are chains:
- draft-model algorithms (EAGLE, EAGLE3, NEXTN, STANDALONE) with `--speculative-eagle-topk 1`; their draft model
  attends densely (`--speculative-draft-attention-backend`, set to flashinfer when not given: the draft is small,
  and the gate and summary pool are the target's). On CPU SGLang's draft workers have no attention backend to
  pair with (docs/speculative.md), so there only NGRAM runs;
- NGRAM with `--speculative-ngram-max-bfs-breadth 1`. Its C++ draft builder still pads a short match with token-0
  nodes hung off the root (siblings of the first draft, `ngram_corpus/result.cpp::fillResult`): a tree. The hook
  below re-links every request's draft as a chain in its stored order (each node's parent the one before it). Any
  chain is a valid draft (greedy verification accepts a draft only where it is the target's own token), so the
  output is unchanged; only a padded tail becomes chain nodes that are tried after the real ones.
Other algorithms (DFLASH, DSPARK, UNO, ...) are refused: not verified with sas.
"""

from __future__ import annotations

import logging

from sas_backend.config import SASConfigError

logger = logging.getLogger(__name__)

CHAIN_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")
NGRAM_TARGET = "sglang.srt.speculative.ngram_worker.NGRAMWorker._prepare_draft_tokens"


class SpeculativeConfigError(SASConfigError):
    """A speculative launch the sas verify step cannot serve."""


def check_launch(args, on_cuda: bool) -> None:
    """Refuse (SpeculativeConfigError) what the sas verify step cannot serve; set the draft model's dense
    attention backend when it is not given. args: SGLang's parsed launch namespace (speculative_* fields)."""
    algo = getattr(args, "speculative_algorithm", None)
    if not algo:
        return
    algo = str(algo).upper()
    if algo == "NGRAM":
        breadth = getattr(args, "speculative_ngram_max_bfs_breadth", None)
        if breadth != 1:
            raise SpeculativeConfigError(
                f"sas verifies chain drafts only: NGRAM needs --speculative-ngram-max-bfs-breadth 1 (got {breadth}; "
                "SGLang's default 10 builds tree drafts)")
        return
    if algo not in CHAIN_ALGORITHMS:
        raise SpeculativeConfigError(
            f"--speculative-algorithm {algo} is not supported with the sas backend; supported: NGRAM and "
            f"{', '.join(CHAIN_ALGORITHMS)} with chain drafts (docs/speculative.md)")
    if not on_cuda:
        raise SpeculativeConfigError(
            f"--speculative-algorithm {algo} needs a draft model, and SGLang's draft workers have no CPU attention "
            "backend to run it beside sas; on CPU use --speculative-algorithm NGRAM "
            "--speculative-ngram-max-bfs-breadth 1 (docs/speculative.md)")
    topk = getattr(args, "speculative_eagle_topk", None)
    if topk != 1:
        raise SpeculativeConfigError(
            f"sas verifies chain drafts only: pass --speculative-eagle-topk 1 with --speculative-num-steps N "
            f"(got topk {topk}; SGLang would choose tree drafts otherwise)")
    if getattr(args, "speculative_draft_attention_backend", None) in (None, "sas"):
        args.speculative_draft_attention_backend = "flashinfer"
        logger.info("sas: the draft model attends densely (--speculative-draft-attention-backend flashinfer)")


def register(registry, hook_type) -> None:
    registry.register(NGRAM_TARGET, chain_ngram_drafts, hook_type.AROUND)


def chain_ngram_drafts(original, self, batch, *args, **kwargs):
    """AROUND hook on NGRAMWorker._prepare_draft_tokens: with a sas target, every request's n x n draft mask
    becomes the chain's (lower triangular), so SGLang derives chain positions and retrieve links from it."""
    req_drafts, mask = original(self, batch, *args, **kwargs)
    from sas_backend.backend.sas_attention import SASAttnBackend

    if not isinstance(getattr(self.model_runner, "attn_backend", None), SASAttnBackend):
        return req_drafts, mask
    return req_drafts, chain_masks(mask, int(self.draft_token_num))


def chain_masks(mask, n: int):
    """A `[bs * n * n]` (or any shape with bs * n * n elements) draft mask made of bs chain masks, same type,
    dtype and shape (numpy or torch)."""
    import numpy as np

    bs = mask.size // (n * n) if isinstance(mask, np.ndarray) else mask.numel() // (n * n)
    chain = np.tril(np.ones((n, n), dtype=bool))
    out = np.tile(chain.reshape(-1), bs).reshape(mask.shape)
    if isinstance(mask, np.ndarray):
        return out.astype(mask.dtype)
    import torch

    return torch.from_numpy(out).to(dtype=mask.dtype, device=mask.device)
