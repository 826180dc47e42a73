"""Gated sparse-scope attention for gate training: fused Triton kernel and its torch oracle."""

from .fused import gated_attention
from .naive import gated_attention_naive

__all__ = ["gated_attention", "gated_attention_naive"]
