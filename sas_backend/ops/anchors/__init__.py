"""Prompt anchors (`--sas-prompt-anchors R`): torch on every device, see `naive`.

- `last_query_block_mass(q, k, scale, block_size)`: `[H_kv, T // b]` block attention mass of one query.
- `top_anchors(mass, num_candidates, count)`: `[H_kv, count]` its highest blocks, -1 padded.
- `force_anchors(scores, anchors, num_candidates)`: decode scores with the anchors raised to +inf.
"""

from sas_backend.ops.anchors.naive import force_anchors, last_query_block_mass, top_anchors

__all__ = ["force_anchors", "last_query_block_mass", "top_anchors"]
