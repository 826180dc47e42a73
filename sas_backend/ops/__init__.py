"""The ops: one folder each (entry point, torch path, Triton kernel, plain statement). Shared here: the one rule for a
sub-block count, and the fp8 KV dtypes."""

import torch

# What an fp8 KV cache holds (`--kv-cache-dtype fp8_e4m3` / `fp8_e5m2`): K / k_scale and V / v_scale cast to one of
# these (SGLang's `set_kv_buffer`), so every op that reads K or V takes the stored number times its layer's scale.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def sub_blocks_ok(n: int, size: int) -> bool:
    """Whether `n` runs a block are allowed for blocks (or coarser runs) of `size` tokens: a power of two dividing it
    (`selection.SelectionRule.sub_blocks`; every place that takes a sub-block count checks it here)."""
    return isinstance(n, int) and n >= 1 and not n & (n - 1) and size % n == 0
