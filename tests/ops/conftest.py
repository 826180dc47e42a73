"""TRITON_INTERPRET=1 (Triton kernels on CPU) is set by the top-level tests/conftest.py only
where CUDA is unavailable, before any `sas_backend.ops.*.triton` import; on a GPU the kernels
compile. Kernel tests build their inputs on tests.devices.DEVICE."""

import pytest
import torch

from tests.devices import DEVICE, _no_tf32  # noqa: F401  (_no_tf32: autouse fixture)


class PagedCase:
    """A decode batch over an SGLang-style paged cache with page size = block size b.

    Pages 1..num_pages hold tokens (page 0 is SGLang's padding page); each request's pages are
    drawn at random, request 1 shares request 0's first page (a radix-cache prefix) when both
    have one, and req_pool_indices is not the identity. Built on CPU (same data on every
    device), then moved to DEVICE.
    """

    def __init__(self, seq_lens, block_size, num_kv_heads, head_dim, seed=0, extra_pages=3):
        g = torch.Generator().manual_seed(seed)
        b = block_size
        self.block_size = b
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int64)
        bs = len(seq_lens)
        pages_per_req = [-(-n // b) for n in seq_lens]
        self.num_pages = sum(pages_per_req) + extra_pages
        self.max_blocks = max(max(pages_per_req), 1) + 2
        max_ctx = self.max_blocks * b + b
        max_reqs = bs + 3
        perm = torch.randperm(self.num_pages, generator=g) + 1
        self.req_pool_indices = torch.randperm(max_reqs, generator=g)[:bs]
        # Unused entries hold garbage (but in-range, page-aligned) slots: results must not depend on them.
        garbage = torch.randint(0, self.num_pages, (max_reqs, max_ctx), generator=g, dtype=torch.int32)
        self.req_to_token = garbage * b
        used = 0
        offs = torch.arange(b, dtype=torch.int32)
        for r, np_ in enumerate(pages_per_req):
            req = int(self.req_pool_indices[r])
            for m in range(np_):
                page = int(perm[used])
                used += 1
                if r == 1 and m == 0 and pages_per_req[0] > 0 and seq_lens[1] > b:
                    page = int(self.req_to_token[int(self.req_pool_indices[0]), 0]) // b
                self.req_to_token[req, m * b : (m + 1) * b] = page * b + offs
        self.seq_lens = self.seq_lens.to(DEVICE)
        self.req_pool_indices = self.req_pool_indices.to(DEVICE)
        self.req_to_token = self.req_to_token.to(DEVICE)
        self.slots = (self.num_pages + 1) * b
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.gen = g

    def block_table(self, width=None) -> torch.Tensor:
        """`[bs, width]` int64 KV slot of each logical block's first token (the ops' block table,
        see sas_backend.selection); width defaults to max_blocks + 1."""
        width = self.max_blocks + 1 if width is None else width
        b = self.block_size
        return self.req_to_token[self.req_pool_indices.long(), : width * b : b].long()

    @property
    def num_candidates(self) -> torch.Tensor:
        """`[bs]` complete blocks before each request's current block."""
        return torch.div(self.seq_lens - 1, self.block_size, rounding_mode="floor").clamp_min(0)

    def randn(self, *shape, dtype=torch.float32):
        return torch.randn(*shape, generator=self.gen).to(DEVICE, dtype)


@pytest.fixture
def paged_case():
    """Factory: paged_case(seq_lens, block_size, num_kv_heads, head_dim, seed=0) -> PagedCase."""
    return PagedCase
