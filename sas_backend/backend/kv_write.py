"""Write the new K/V of a batch into SGLang's KV pool, across SGLang versions."""

from __future__ import annotations

try:  # 0.5.14+ (0.5.15 and 0.5.21 read): the pool takes a write location object (loc + SWA loc)
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc
except ImportError:  # older releases: the pool takes the slot tensor itself
    KVWriteLoc = None


def save_kv(token_to_kv_pool, layer, out_cache_loc, k, v) -> None:
    """Store k, v `[tokens, H_kv, D]` at slots `out_cache_loc` `[tokens]` of `layer`."""
    loc = out_cache_loc if KVWriteLoc is None else KVWriteLoc(out_cache_loc, None)
    token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
