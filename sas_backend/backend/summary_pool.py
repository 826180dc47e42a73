"""Per-layer block summaries keyed by physical KV page, allocated once at startup."""

from __future__ import annotations

import torch

from sas_backend.ops.key_codes import code_bytes


class SummaryPool:
    """`summaries[layer]`: `[num_pages, H_kv, Dg]` in `dtype` (fp32, or bf16 for half the memory; the selectors
    score in fp32 either way), row = physical page (slot // block size).

    With page size = block size, logical block m of a request lives in page
    `req_to_token[r, m*b] // b`, so radix-shared prefix pages share their summaries for free.
    Page 0 is SGLang's padding page (never allocated to a request): masked writes land there.

    `valid` `[num_pages]` bool marks the pages whose summaries were written for the KV they hold now: set when
    an extend or a decode step summarizes a page, cleared when the allocator hands the page out again
    (`backend.page_marks.watch_allocations`). A page whose KV landed without an extend through sas (a
    prefill-decode transfer, a load-back) stays unmarked, and the decode step summarizes it before any selection
    reads it: planned on the host on CPU (`SASAttnBackend._summarize_unmarked`), listed on the device and
    summarized in each sparse layer on CUDA (`DecodeStep.repair`). All False at startup: nothing is written yet.

    `key_codes[layer]` (with `code_head_dim` D > 0: `--sas-rerank-keys int4`): (packed `[num_pages, H_kv, b * D / 2]`
    uint8, scales `[num_pages, H_kv, 2, D]` fp16), the 4-bit codes of each page's keys (`ops.key_codes`) that the
    second level reads; written wherever a page's summary is, so the same marks cover them.
    """

    def __init__(self, layer_ids, num_pages: int, num_kv_heads: int, gate_dim: int, device, dtype=torch.float32,
                 code_head_dim: int = 0, block_size: int = 64):
        self.num_pages = num_pages
        self.dtype = dtype
        self.summaries = {
            lid: torch.zeros(num_pages, num_kv_heads, gate_dim, dtype=dtype, device=device)
            for lid in layer_ids
        }
        self.key_codes = {
            lid: (torch.zeros(num_pages, num_kv_heads, block_size * code_head_dim // 2, dtype=torch.uint8,
                              device=device),
                  torch.zeros(num_pages, num_kv_heads, 2, code_head_dim, dtype=torch.float16, device=device))
            for lid in layer_ids
        } if code_head_dim else {}
        self.valid = torch.zeros(num_pages, dtype=torch.bool, device=device)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.summaries.values()) + self.valid.numel() \
            + sum(t.numel() * t.element_size() for ts in self.key_codes.values() for t in ts)

    @staticmethod
    def bytes_per_page(num_layers: int, num_kv_heads: int, dim: int, element_size: int = 4, code_head_dim: int = 0,
                       block_size: int = 64) -> int:
        """Bytes a pool of this shape holds per page (`nbytes / num_pages`): every layer's summaries at `element_size`
        bytes an element (4 fp32, 2 bf16), its key codes (`ops.key_codes.code_bytes` a kv head, with code_head_dim)
        and the page's validity mark."""
        codes = code_bytes(block_size, code_head_dim) if code_head_dim else 0
        return num_layers * num_kv_heads * (dim * element_size + codes) + 1

    def mark_valid(self, pages: torch.Tensor) -> None:
        """Pages `[N]` whose summaries this step writes (in every sparse layer)."""
        self.valid[pages.long()] = True

    def invalidate(self, pages: torch.Tensor) -> None:
        """Pages `[N]` handed to a request again: their summaries describe KV they no longer hold."""
        self.valid[pages.long()] = False

    def __getitem__(self, layer_id: int) -> torch.Tensor:
        return self.summaries[layer_id]
