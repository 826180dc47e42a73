"""`ExtendPlan`: what one extend (prefill) batch decides on the host, frozen, beside decode's `DecodePlan`.

Made once per extend batch in `init_forward_metadata` from SGLang's host mirrors of the lengths, read by every
layer of the batch: which whole blocks the extend completes (their summaries are written per sparse layer),
which requests sas's own CPU extend attends, and each request's last token for the prompt anchors.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch


def to_device(values: list, device: torch.device) -> torch.Tensor:
    """int64 `[n]` on `device` without a blocking copy: staged in pinned host memory and copied asynchronously (a
    pageable source would make the copy synchronous)."""
    host = torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


@dataclasses.dataclass(frozen=True)
class AnchorRows:
    """Each request's last token in an extend (the last chunk's is the prompt's last, and wins).

    rows `[n]`: req pool rows; last `[n]`: their flat indices in the batch's queries; seq_lens `[n]`: their lengths
    (all int64 on the device); longest: the largest seq len, a host int."""

    rows: torch.Tensor
    last: torch.Tensor
    seq_lens: torch.Tensor
    longest: int


@dataclasses.dataclass(frozen=True)
class ExtendPlan:
    """One extend batch. blocks: (physical pages `[N]`, first positions `[N]`) of the whole blocks this extend
    completes, per request logical blocks [prefix // b, seq_len // b) (None: none); own_rows: (req rows, prefix
    lens, extend lens) host ints when sas's own CPU extend attends this batch (None: the wrapped backend does);
    anchors: `AnchorRows` when prompt anchors are on (None otherwise or without host lengths)."""

    blocks: Optional[tuple] = None
    own_rows: Optional[tuple] = None
    anchors: Optional[AnchorRows] = None

    @staticmethod
    def make(fb, req_to_token: torch.Tensor, block_size: int, device: torch.device, own_extend: bool,
             anchors: bool) -> "ExtendPlan":
        """The plan of SGLang forward batch `fb`. req_to_token: `[max_reqs, max_ctx]` slot table; own_extend: sas's
        CPU extend is on (`own_cpu_extend`); anchors: prompt anchors are on."""
        return ExtendPlan(_completed_blocks(fb, req_to_token, block_size, device),
                          _own_rows(fb) if own_extend else None,
                          _anchor_rows(fb, device) if anchors else None)


def _completed_blocks(fb, req_to_token, b: int, device) -> Optional[tuple]:
    prefix, seq_lens_cpu = fb.extend_prefix_lens_cpu, fb.seq_lens_cpu
    if prefix is None or seq_lens_cpu is None:
        return None
    reqs, blocks = [], []
    for i, (p, s) in enumerate(zip(list(prefix), seq_lens_cpu.tolist())):
        first, end = int(p) // b, int(s) // b
        reqs.extend([i] * (end - first))
        blocks.extend(range(first, end))
    if not blocks:
        return None
    starts = to_device(blocks, device) * b
    rows = fb.req_pool_indices.long()[to_device(reqs, device)]
    pages = torch.div(req_to_token[rows, starts].long(), b, rounding_mode="floor")
    return pages, starts


def _own_rows(fb) -> Optional[tuple]:
    # A plain decoder batch (no encoder) with host lengths.
    if getattr(fb, "encoder_lens", None) is not None:
        return None
    prefix, lens = fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu
    if prefix is None or lens is None:
        return None
    return [int(r) for r in fb.req_pool_indices.tolist()], [int(p) for p in prefix], [int(e) for e in lens]


def _anchor_rows(fb, device) -> Optional[AnchorRows]:
    if fb.extend_seq_lens_cpu is None or fb.seq_lens_cpu is None:
        return None
    batch, last, lens, end = [], [], [], 0
    for i, (e, s) in enumerate(zip(list(fb.extend_seq_lens_cpu), fb.seq_lens_cpu.tolist())):
        end += int(e)
        if int(e) > 0:
            batch.append(i)
            last.append(end - 1)
            lens.append(int(s))
    if not batch:
        return None
    rows = fb.req_pool_indices.long()[to_device(batch, device)]
    return AnchorRows(rows, to_device(last, device), to_device(lens, device), max(lens))
