"""Which KV pages the allocator hands out, for the summary pool's validity marks (`SummaryPool.valid`).

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
