"""AttnGate: the per-layer block selector, compatible with SeerAttention-R checkpoints.

Geometry (per attention layer): H_kv kv heads, G = H_q / H_kv query heads per group, head dim D,
gate dim Dg. Parameters, named like SeerAttention-R's so state dicts map one to one:

    attngate_linear_q.weight  [H_kv, G, D, Dg]   Qproj: the G query heads of a group, projected
    attngate_linear_k.weight  [H_kv, 3D, Dg]     Kmaxminavg: max|min|mean pooled block keys, projected
    attngate_qnorm.weight     [Dg]               RMSNorm (eps 1e-6, fp32 variance)
    attngate_knorm.weight     [Dg]

The math lives in `sas_backend.ops` (gate query, block summary): the serving backend, the
training integration and the tests all call the same functions through this module.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from sas_backend.ops.gate.torch_path import gate_query
from sas_backend.ops.summary.torch_path import summarize_blocks, summarize_pooled


class _Weight(nn.Module):
    """Holds one tensor as `.weight`, so state-dict keys read `attngate_linear_q.weight`."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class AttnGate(nn.Module):
    """One layer's gate. Shapes: see the module docstring."""

    def __init__(self, num_kv_heads: int, group_size: int, head_dim: int, gate_dim: int = 128):
        super().__init__()
        self.num_kv_heads = num_kv_heads
        self.group_size = group_size
        self.head_dim = head_dim
        self.gate_dim = gate_dim
        self.attngate_linear_q = _Weight(num_kv_heads, group_size, head_dim, gate_dim)
        self.attngate_linear_k = _Weight(num_kv_heads, 3 * head_dim, gate_dim)
        self.attngate_qnorm = _Weight(gate_dim)
        self.attngate_knorm = _Weight(gate_dim)
        self.reset_parameters()

    @staticmethod
    def nbytes_for(num_kv_heads: int, group_size: int, head_dim: int, gate_dim: int, element_size: int = 4) -> int:
        """Bytes of one gate's weights (Wq, Wk, the two norms) at `element_size` bytes an element."""
        return (num_kv_heads * group_size * head_dim * gate_dim + num_kv_heads * 3 * head_dim * gate_dim
                + 2 * gate_dim) * element_size

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Seeded init: projections ~ N(0, 1/fan_in) (unit-variance outputs), norms = 1."""
        fan_q = self.group_size * self.head_dim
        fan_k = 3 * self.head_dim
        w_q = torch.randn(self.attngate_linear_q.weight.shape, generator=generator)
        w_k = torch.randn(self.attngate_linear_k.weight.shape, generator=generator)
        self.attngate_linear_q.weight.copy_(w_q / math.sqrt(fan_q))
        self.attngate_linear_k.weight.copy_(w_k / math.sqrt(fan_k))
        self.attngate_qnorm.weight.fill_(1.0)
        self.attngate_knorm.weight.fill_(1.0)

    def query(self, q_pre: torch.Tensor, gate_cos_sin: torch.Tensor) -> torch.Tensor:
        """Gate query `[N, H_kv, Dg]` fp32 from pre-RoPE q `[N, H_q, D]`.

        gate_cos_sin: `[N, Dg]` rows of the gate's RoPE table at each token's position.
        """
        return gate_query(
            q_pre,
            self.attngate_linear_q.weight,
            self.attngate_qnorm.weight,
            gate_cos_sin,
        )

    def summarize(self, k_blocks_pre: torch.Tensor, block_cos_sin: torch.Tensor) -> torch.Tensor:
        """Block summaries `[N, H_kv, Dg]` fp32 from pre-RoPE keys `[N, b, H_kv, D]`.

        block_cos_sin: `[N, Dg]` rows of the gate's RoPE table at each block's FIRST position.
        """
        return summarize_blocks(
            k_blocks_pre,
            self.attngate_linear_k.weight,
            self.attngate_knorm.weight,
            block_cos_sin,
        )

    def summarize_pooled(self, pooled: torch.Tensor, block_cos_sin: torch.Tensor) -> torch.Tensor:
        """Block summaries `[N, H_kv, Dg]` fp32 from max|min|mean pooled pre-RoPE keys `[N, H_kv, 3D]`
        (`ops.summary.naive.pool_block_keys`); block_cos_sin as in `summarize`."""
        return summarize_pooled(pooled, self.attngate_linear_k.weight, self.attngate_knorm.weight, block_cos_sin)

    def read_as(self, dtype: torch.dtype) -> "AttnGate":
        """This gate with every parameter rounded to `dtype` and read back in its own dtype (fp32): the weights
        an fp32-computing kernel sees when it loads a `dtype` copy of them. A copy; `self` itself for its own
        dtype."""
        if all(p.dtype == dtype for p in self.parameters()):
            return self
        out = copy.deepcopy(self)
        with torch.no_grad():
            for p in out.parameters():
                p.copy_(p.to(dtype).to(p.dtype))
        return out


def gates_from_tensors(layers: dict, layer_ids, *, gate_dim: int, device=None) -> dict:
    """`{layer: AttnGate}` (fp32, frozen) from checkpoint tensors `{layer: {short name: Tensor}}`.

    The geometry comes from the tensors (`attngate_linear_q.weight` is `[H_kv, G, D, Dg]`), so a
    TP shard builds the rank-local gate.
    """
    gates = {}
    for lid in layer_ids:
        tensors = layers[lid]
        h_kv, g, d, _ = tensors["attngate_linear_q.weight"].shape
        gate = AttnGate(h_kv, g, d, gate_dim)
        gate.load_state_dict({k: v.float() for k, v in tensors.items()})
        gates[lid] = gate.to(device).requires_grad_(False)
    return gates
