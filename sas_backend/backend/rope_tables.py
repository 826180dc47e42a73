"""Everything the sas backend knows about the served model's RoPE: the checks at startup (`check_rope_scaling`,
`find_model_rotary`, `check_gate_rope_formula`) and the two tables it reads, kept in step with the model's rotary
module (`RopeTables`; `FixedRopeTables` without a model).

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

from sas_backend.backend.model_checks import SASUnsupportedModel
from sas_backend.geometry import ModelGeometry, gate_rope_table
from sas_backend.ops.rope import SUPPORTED_ROPE_SCALINGS, rope_scaling_type


def check_rope_scaling(scaling) -> None:
    """Refuse a RoPE scaling the gate's table cannot reproduce (see `ops.rope.SUPPORTED_ROPE_SCALINGS`).

    scaling: the model's HF `rope_scaling` dict (`ModelGeometry.rope_scaling`), None for plain RoPE.
    """
    kind = rope_scaling_type(scaling)
    if kind not in SUPPORTED_ROPE_SCALINGS:
        raise SASUnsupportedModel(
            f"sas: the model uses RoPE scaling {kind!r}; the gate's RoPE supports "
            + ", ".join(SUPPORTED_ROPE_SCALINGS)
        )
    if isinstance(scaling, dict) and "mrope_section" in scaling:
        raise SASUnsupportedModel("sas: multimodal RoPE (mrope_section) is not supported")


def find_model_rotary(model: torch.nn.Module, head_dim: int) -> torch.nn.Module:
    """The served model's rotary module (SGLang's `RotaryEmbedding` or a subclass).

    Its `cos_sin_cache` `[max_pos, head_dim]` (cos|sin, YaRN's mscale included) is the table the
    backend undoes the model's RoPE with; all layers of Llama/Qwen share one module (SGLang's
    `get_rope` caches it). Partial rotary and non-neox layouts are refused: the inverse rotation
    would not be exact.
    """
    for module in model.modules():
        table = getattr(module, "cos_sin_cache", None)
        if isinstance(table, torch.Tensor) and table.dim() == 2:
            if getattr(module, "is_neox_style", True) is not True:
                raise SASUnsupportedModel("sas: the model's RoPE is not neox-style (rotate-half)")
            if table.shape[-1] != head_dim:
                raise SASUnsupportedModel(
                    f"sas: the model rotates {table.shape[-1]} of {head_dim} head dims (partial "
                    "rotary); sas needs full-dim RoPE"
                )
            return module
    raise SASUnsupportedModel("sas: could not find the model's RoPE table (cos_sin_cache)")


def find_model_rope_table(model: torch.nn.Module, head_dim: int) -> torch.Tensor:
    """The served model's current RoPE table `[max_pos, head_dim]` (cos|sin), as stored by SGLang.

    A snapshot: SGLang may replace the table later; the backend reads it through
    `backend.rope_tables.RopeTables`, which follows that.
    """
    return find_model_rotary(model, head_dim).cos_sin_cache


def check_gate_rope_formula(model_table: torch.Tensor, geometry: ModelGeometry, max_rows: int = 32768) -> None:
    """Refuse to serve when our RoPE formula (the one that builds the gate's table) does not
    reproduce the model's own table at the model's head dim: then the gate's table would not be
    "the model's rotary formula" either (e.g. a scaling key SGLang reads and we do not).

    model_table: `[max_pos, D]` the model's current cos|sin; geometry: the served model's (its
    RoPE theta and scaling). Compares the first `max_rows` positions (a formula error shows there;
    far positions only add fp32 angle rounding); the tolerance admits a bf16-stored table.
    """
    rows = min(int(model_table.shape[0]), max_rows)
    ours = gate_rope_table(model_table.shape[-1], geometry, rows, device=model_table.device)
    err = (ours - model_table[:rows].float()).abs().max().item()
    if err > 2e-2:
        raise SASUnsupportedModel(
            f"sas: the gate's RoPE formula does not reproduce the model's RoPE table (max |diff| "
            f"{err:.3g} over {rows} positions; theta {geometry.rope_theta}, scaling "
            f"{geometry.rope_scaling}); refusing rather than serving a gate rotated differently from its model"
        )


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
        """rotary: the served model's rotary module (`find_model_rotary`); geometry:
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

    @staticmethod
    def nbytes_for(max_pos: int, dim: int) -> int:
        """Bytes of one fp32 table `[max_pos, dim]` (the gate's; the model's where it is a copy)."""
        return max_pos * dim * 4

    def held_nbytes(self) -> dict:
        """{name: bytes} of the tables this object allocated: the gate's, and the model's where it is a copy of SGLang's
        (another dtype or device), by `backend.memory`'s names."""
        held = {"gate rope table": self._gate.numel() * self._gate.element_size()} if self._gate.shape[-1] else {}
        if self._model is not self.rotary.cos_sin_cache:
            held["model rope table (fp32 copy)"] = self._model.numel() * self._model.element_size()
        return held

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

    def held_nbytes(self) -> dict:
        """Nothing: the given tables are the caller's."""
        return {}

    def refresh(self) -> bool:
        return False
