"""The two RoPE tables the sas backend reads, kept in step with the served model's rotary module.

The backend undoes the model's RoPE with the model's own table (`model`) and rotates the gate's
query and block summaries with the gate's table (`gate`). The model's table is SGLang's
`rotary_emb.cos_sin_cache`, which SGLang may REPLACE after the backend is built:

- `RotaryEmbedding._match_cos_sin_cache_dtype` swaps in a copy cast to the activation dtype on
  the first forward of the fallback kernel path (CUDA head sizes other than 64/128/256/512, and
  from 0.5.23 the CPU path), so the model then rotates with bf16-rounded cos/sin;
- `_ensure_cos_sin_cache_length` (called by `reserve_rope_cache_for_long_sequences` at load,
  before the backend exists, and at runtime by QSA indexers and speculative KV materialisation)
  concatenates rows for longer positions, including YaRN's (with its mscale).

So the backend must read the current table, not a startup copy. `RopeTables` does that with a
cheap identity check of the module's attribute, and keeps its tensors' storage when it can:
a same-length replacement is copied into the existing fp32 buffer (pointers captured in a CUDA
graph stay valid), only a longer table reallocates (and bumps `version`).
"""

from __future__ import annotations

from typing import Optional

import torch

from sas_backend.geometry import ModelGeometry, gate_rope_table


class RopeTables:
    """The served model's RoPE table and the gate's, current.

    model: `[max_pos, D]` fp32 on `device`: the cos|sin the model's RoPE uses now (SGLang's
        `cos_sin_cache` upcast; aliased without a copy when that is already fp32 on the device).
        For YaRN it carries the mscale magnitude; invert with `ops.rope.invert_rope` (exact).
    gate: `[max_pos, Dg]` fp32 on `device`: `geometry.gate_rope_table(Dg, geometry, max_pos)`,
        the model's rotary formula on the gate's dims (the table the gate was trained with).
    version: starts at 1, +1 each time `model`/`gate` are reallocated (the model's table grew);
        a CUDA graph captured at an older version holds stale pointers.

    Reading `.model` or `.gate` refreshes first (an identity check; work only when SGLang replaced
    its table), except while a CUDA graph is being captured.
    """

    def __init__(
        self,
        rotary: torch.nn.Module,
        gate_dim: int,
        geometry: ModelGeometry,
        device,
    ):
        """rotary: the served model's rotary module (`model_checks.find_model_rotary`); geometry:
        the served model's, for the gate table's theta and scaling."""
        self.rotary = rotary
        self.gate_dim = int(gate_dim)
        self.geometry = geometry
        self.device = torch.device(device)
        self.version = 0
        self.frozen = False  # set by freeze(): CUDA graphs hold the tensors' addresses
        self._src: Optional[torch.Tensor] = None
        self._model: Optional[torch.Tensor] = None
        self._gate: Optional[torch.Tensor] = None
        self.refresh()

    @property
    def model(self) -> torch.Tensor:
        """`[max_pos, D]` fp32: the model's current cos|sin table."""
        self._maybe_refresh()
        return self._model

    @property
    def gate(self) -> torch.Tensor:
        """`[max_pos, Dg]` fp32: the gate's RoPE table, as long as the model's."""
        self._maybe_refresh()
        return self._gate

    @property
    def max_pos(self) -> int:
        """Positions both tables cover (the model's current table length)."""
        return int(self.model.shape[0])

    def _maybe_refresh(self) -> None:
        # Never copy or allocate inside a graph capture (SGLang itself never replaces its table
        # then: it reserves the full context length before capturing).
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        self.refresh()

    def freeze(self) -> None:
        """From now on captured CUDA graphs hold `model`/`gate`'s addresses: a longer table can no
        longer be followed, and `refresh` refuses it (whichever path reads first, eager or graph)
        instead of reallocating and leaving the graphs to read freed memory."""
        self.frozen = True

    def refresh(self) -> bool:
        """Follow the model's `cos_sin_cache`. Returns True when the tensors were reallocated."""
        src = self.rotary.cos_sin_cache
        if src is self._src:
            return False
        if self._model is not None and tuple(src.shape) == tuple(self._model.shape):
            if src.data_ptr() != self._model.data_ptr():
                self._model.copy_(src)  # same length: refill in place, pointers stay valid
            self._src = src
            return False
        if self.frozen:
            raise RuntimeError(
                f"sas: the model's RoPE table grew from {self._model.shape[0]} to {src.shape[0]} positions "
                "after CUDA graphs were captured, which hold the old table's address; restart with a "
                "larger --context-length or with --cuda-graph-backend-decode disabled"
            )
        self._model = src.to(device=self.device, dtype=torch.float32)
        self._gate = gate_rope_table(self.gate_dim, self.geometry, self._model.shape[0], device=self.device)
        self._src = src
        self.version += 1
        return True


class FixedRopeTables:
    """Two given tables with `RopeTables`' interface, for a backend built without a model (tests, tools).

    model: `[max_pos, D]` fp32; gate: `[max_pos, Dg]` fp32 (`[max_pos, 0]` for a training-free selector).
    """

    def __init__(self, model: torch.Tensor, gate: torch.Tensor):
        self.model, self.gate = model, gate
        self.version = 1
        self.frozen = False

    @property
    def max_pos(self) -> int:
        return int(self.model.shape[0])

    def freeze(self) -> None:
        self.frozen = True

    def refresh(self) -> bool:
        return False
