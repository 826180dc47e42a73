"""The ops: one folder each (entry point, torch path, Triton kernel, plain statement). Shared here: the one rule for a
sub-block count."""


def sub_blocks_ok(n: int, size: int) -> bool:
    """Whether `n` runs a block are allowed for blocks (or coarser runs) of `size` tokens: a power of two dividing it
    (`selection.SelectionRule.sub_blocks`; every place that takes a sub-block count checks it here)."""
    return isinstance(n, int) and n >= 1 and not n & (n - 1) and size % n == 0
