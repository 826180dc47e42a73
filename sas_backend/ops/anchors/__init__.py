"""Prompt anchors (`--sas-prompt-anchors R`): torch on every device, see `torch_path`.

- `block_mass(logits, positions, block_size, width)`: `[P, H_kv, width]` block attention mass (the oracle's rule).
- `last_query_block_mass(q, k, scale, block_size)`: `[H_kv, T // b]` block attention mass of one query.
- `top_anchors(mass, num_candidates, count)`: `[H_kv, count]` its highest blocks, -1 padded.
- `force_anchors(scores, anchors, num_candidates)`: decode scores with the anchors raised to +inf.
- `extend_anchors(q_last, k_buffer, req_to_token, rows, seq_lens, max_seq_len, scale, block_size, count)`:
  `[n, H_kv, count]` the anchors of every request of an extend at once, from the paged KV in bounded chunks
  (`paged`; what the server runs).
"""

from sas_backend.ops.anchors.torch_path import block_mass, force_anchors, last_query_block_mass, top_anchors
from sas_backend.ops.anchors.paged import CHUNK_TOKENS, anchor_scratch_bytes, extend_anchors

__all__ = ["CHUNK_TOKENS", "anchor_scratch_bytes", "block_mass", "extend_anchors", "force_anchors",
           "last_query_block_mass", "top_anchors"]
