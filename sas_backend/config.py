"""SAS serving configuration: launch flags, environment variables, defaults.

Precedence (highest first): `--sas-*` flags on the SGLang launch command, then `SAS_*`
environment variables, then the defaults below. The launcher turns the flags into the
environment variables before SGLang spawns its scheduler processes, so every process reads one
source of truth: `SASConfig.from_env()`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional


class SASConfigError(ValueError):
    """A SAS setting that cannot work; the message says which and how to fix it."""


@dataclasses.dataclass(frozen=True)
class SASConfig:
    """What the `sas` backend needs besides the model.

    gate_path: gate checkpoint directory (canonical or SeerAttention-R format).
    budget: tokens of previous complete blocks each decode step attends, besides the current block;
        K = budget // block_size blocks are selected per (request, kv head).
    block_size: tokens per KV block; SGLang's page size must equal it.
    first_sparse_layer: layers below this index decode densely.
    sink_blocks / local_blocks: blocks always selected (first blocks / blocks right before the
        current one); they count inside K.
    debug_dir: if set, each decode step appends selection statistics there (slow; tests only).
    """

    gate_path: Optional[str] = None
    budget: int = 2048
    block_size: int = 64
    first_sparse_layer: int = 0
    sink_blocks: int = 0
    local_blocks: int = 0
    debug_dir: Optional[str] = None

    @property
    def top_k(self) -> int:
        """Blocks selected per (request, kv head), forced blocks included."""
        return self.budget // self.block_size

    def validate(self) -> "SASConfig":
        """Raise SASConfigError on settings that cannot work; returns self."""
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise SASConfigError(f"SAS block size must be a power of two, got {self.block_size}")
        if self.budget <= 0 or self.budget % self.block_size:
            raise SASConfigError(
                f"SAS budget must be a positive multiple of the block size {self.block_size} "
                f"(it is spent in whole blocks), got {self.budget}; "
                f"for example --sas-budget {max(1, round(self.budget / self.block_size)) * self.block_size}"
            )
        for name in ("first_sparse_layer", "sink_blocks", "local_blocks"):
            if getattr(self, name) < 0:
                raise SASConfigError(f"SAS {name} must be >= 0, got {getattr(self, name)}")
        if self.sink_blocks + self.local_blocks > self.top_k:
            raise SASConfigError(
                f"SAS sink ({self.sink_blocks}) + local ({self.local_blocks}) blocks exceed the "
                f"{self.top_k} blocks the budget {self.budget} allows"
            )
        if not self.gate_path:
            raise SASConfigError(
                "the sas attention backend needs a gate checkpoint: pass --sas-gate DIR "
                "(or set SAS_GATE); see gate_checkpoints/README.md"
            )
        return self

    @classmethod
    def from_env(cls, environ=None) -> "SASConfig":
        """Read `SAS_*` variables (unset ones keep the defaults). Does not validate."""
        env = os.environ if environ is None else environ
        kwargs = {}
        for f in dataclasses.fields(cls):
            raw = env.get(ENV_NAMES[f.name])
            if raw is None or raw == "":
                continue
            if f.name in INT_FIELDS:
                try:
                    kwargs[f.name] = int(raw)
                except ValueError:
                    raise SASConfigError(f"{ENV_NAMES[f.name]}={raw!r} is not an integer") from None
            else:
                kwargs[f.name] = raw
        return cls(**kwargs)

    def to_env(self) -> dict:
        """The `SAS_*` variables that reproduce this config."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[ENV_NAMES[f.name]] = str(value)
        return out

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["top_k"] = self.top_k
        return d


ENV_NAMES = {
    "gate_path": "SAS_GATE",
    "budget": "SAS_BUDGET",
    "block_size": "SAS_BLOCK_SIZE",
    "first_sparse_layer": "SAS_FIRST_SPARSE_LAYER",
    "sink_blocks": "SAS_SINK_BLOCKS",
    "local_blocks": "SAS_LOCAL_BLOCKS",
    "debug_dir": "SAS_DEBUG_DIR",
}
INT_FIELDS = {"budget", "block_size", "first_sparse_layer", "sink_blocks", "local_blocks"}

# The launch flags: (flag, field, help). `--sas-gate` etc. on `sglang serve`/`launch_server`.
CLI_FLAGS = [
    ("--sas-gate", "gate_path", "Gate checkpoint directory (config.json + gate.safetensors, or SeerAttention-R's)."),
    ("--sas-budget", "budget", "Tokens of previous blocks attended per decode step (multiple of the block size; default 2048)."),
    ("--sas-block-size", "block_size", "KV block size in tokens (default 64); the page size is set to it."),
    ("--sas-first-sparse-layer", "first_sparse_layer", "Layers below this index decode densely (default 0)."),
    ("--sas-sink-blocks", "sink_blocks", "Always attend the first N blocks (counted inside the budget; default 0)."),
    ("--sas-local-blocks", "local_blocks", "Always attend the N blocks before the current one (inside the budget; default 0)."),
]
