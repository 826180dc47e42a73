"""Which KV pages the allocator hands out, for the summary pool's validity marks (`SummaryPool.valid`), and which
complete blocks of a decode batch have no valid summary yet, planned on the host (`unmarked_blocks`, CPU; on CUDA
the decode step lists them on the device: `ops.late_blocks`).

A page is handed to a request by one of the allocator's public `alloc*` methods (`alloc`, `alloc_extend`,
`alloc_decode`, on every SGLang release we support), which return the token slots they allocated: every page
those slots lie on holds KV its summary (if any) does not describe until the page is summarized again. Watching
the hand-outs, not the frees, covers every way a page can be released (free, free_page_ids, free_segment, groups,
eviction from the radix cache) with three wrappers whose signatures do not matter.
"""

from __future__ import annotations

import functools

import torch

ALLOC_METHODS = ("alloc", "alloc_extend", "alloc_decode")


def watch_allocations(allocator, page_size: int, on_pages) -> list:
    """Wrap `allocator`'s alloc methods (this instance only) so that each successful call reports the pages of
    the slots it returns: `on_pages(pages [N] int64)` (pages may repeat). Returns the names wrapped (the methods
    the allocator has). A failed allocation (None) reports nothing."""
    wrapped = []
    for name in ALLOC_METHODS:
        method = getattr(allocator, name, None)
        if method is None:
            continue

        @functools.wraps(method)
        def alloc(*args, _method=method, **kwargs):
            out = _method(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.numel():
                on_pages(torch.div(out.long(), page_size, rounding_mode="floor"))
            return out

        setattr(allocator, name, alloc)
        wrapped.append(name)
    return wrapped


def unmarked_blocks(req_to_token: torch.Tensor, rows: torch.Tensor, present: torch.Tensor, valid: torch.Tensor,
                    block_size: int) -> "tuple[torch.Tensor, torch.Tensor] | None":
    """The complete blocks of some requests whose pages hold no valid summary: (pages `[N]`, first positions `[N]`)
    int64, each page once (a radix prefix shared by two requests is summarized once), or None. req_to_token
    `[max_reqs, max_ctx]`; rows `[bs]` the requests' rows in it; present `[bs]` int64 host: tokens already in each
    request's cache; valid `[num_pages]` bool (`SummaryPool.valid`). Host tensors (CPU)."""
    b = block_size
    n_done = torch.div(present, b, rounding_mode="floor")
    most = int(n_done.max()) if n_done.numel() else 0
    if not most:
        return None
    pages = torch.div(req_to_token[rows, : most * b : b].long(), b, rounding_mode="floor")
    stale = (torch.arange(most)[None, :] < n_done[:, None]) & ~valid[pages]
    if not bool(stale.any()):
        return None
    r, m = stale.nonzero(as_tuple=True)
    first = {}
    for i, page in enumerate(pages[r, m].tolist()):
        first.setdefault(page, i)
    keep = torch.tensor(list(first.values()), dtype=torch.long)
    return pages[r, m][keep], m[keep] * b


def completing_pages(req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                     block_size: int) -> torch.Tensor:
    """`[n]` int64 pages of the blocks that the newest token of each request completes (seq_len a multiple of the
    block size); rows `[bs]`, seq_lens `[bs]` int64 host, counting that token."""
    done = (seq_lens > 0) & (seq_lens % block_size == 0)
    firsts = req_to_token[rows[done], (seq_lens[done] // block_size - 1) * block_size].long()
    return torch.div(firsts, block_size, rounding_mode="floor")

