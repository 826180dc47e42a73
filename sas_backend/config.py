"""SAS serving configuration: launch flags, environment variables, defaults.

Precedence (highest first): `--sas-*` flags on the SGLang launch command, then `SAS_*`
environment variables, then the defaults below. The launcher turns the flags into the
environment variables before SGLang spawns its scheduler processes, so every process reads one
source of truth: `SASConfig.from_env()`.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Optional


class SASConfigError(ValueError):
    """A SAS setting that cannot work; the message says which and how to fix it."""


def _setting(default, env: str, flag: Optional[str] = None, help: str = ""):
    """A SASConfig field with how the outside world names it: its `SAS_*` variable, its
    `--sas-*` launch flag (None: environment only) and the flag's help text."""
    return dataclasses.field(default=default, metadata={"env": env, "flag": flag, "help": help})


@dataclasses.dataclass(frozen=True)
class SASConfig:
    """What the `sas` backend needs besides the model.

    selector: how blocks are chosen: "gate" (the trained AttnGate, needs gate_path), "quest"
        (training-free: per-block key min/max bound of q.k) or "sink-local" (training-free: the
        first block(s) and the blocks right before the current one). See `sas_backend.selection`.
    gate_path: gate checkpoint directory (canonical or SeerAttention-R format).
    budget: tokens of previous complete blocks each decode step attends, besides the current block;
        K = budget // block_size blocks are selected per (request, kv head).
    block_size: tokens per KV block; SGLang's page size must equal it.
    first_sparse_layer: layers below this index decode densely.
    sink_blocks / local_blocks: blocks always selected (first blocks / blocks right before the
        current one); they count inside K.
    debug_dir: if set, each decode step appends selection statistics there (slow; tests only).

    Each field's metadata names its variable and flag; `SETTINGS` lists them.
    """

    selector: str = _setting(
        "gate", "SAS_SELECTOR", "--sas-selector",
        "Block selector: gate (the trained gate, needs --sas-gate), quest or sink-local (training-free).")
    gate_path: Optional[str] = _setting(
        None, "SAS_GATE", "--sas-gate",
        "Gate checkpoint directory (config.json + gate.safetensors, or SeerAttention-R's).")
    budget: int = _setting(
        2048, "SAS_BUDGET", "--sas-budget",
        "Tokens of previous blocks attended per decode step (a multiple of the block size).")
    block_size: int = _setting(
        64, "SAS_BLOCK_SIZE", "--sas-block-size",
        "KV block size in tokens; the page size is set to it.")
    first_sparse_layer: int = _setting(
        0, "SAS_FIRST_SPARSE_LAYER", "--sas-first-sparse-layer",
        "Layers below this index decode densely.")
    sink_blocks: int = _setting(
        0, "SAS_SINK_BLOCKS", "--sas-sink-blocks",
        "Always attend the first N blocks (counted inside the budget).")
    local_blocks: int = _setting(
        0, "SAS_LOCAL_BLOCKS", "--sas-local-blocks",
        "Always attend the N blocks before the current one (inside the budget).")
    debug_dir: Optional[str] = _setting(None, "SAS_DEBUG_DIR")

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
        from sas_backend.selection import SELECTORS

        if self.selector not in SELECTORS:
            raise SASConfigError(f"--sas-selector must be one of {', '.join(SELECTORS)}, got {self.selector!r}")
        if self.selector == "gate" and not self.gate_path:
            raise SASConfigError(
                "the sas attention backend needs a gate checkpoint: pass --sas-gate DIR "
                "(or set SAS_GATE; see gate_checkpoints/README.md), or choose a training-free "
                "selector with --sas-selector quest or --sas-selector sink-local"
            )
        return self

    @classmethod
    def from_env(cls, environ=None) -> "SASConfig":
        """Read `SAS_*` variables (unset ones keep the defaults). Does not validate."""
        env = os.environ if environ is None else environ
        kwargs = {}
        for s in SETTINGS:
            raw = env.get(s.env)
            if raw is None or raw == "":
                continue
            try:
                kwargs[s.field] = s.type(raw)
            except ValueError:
                raise SASConfigError(f"{s.env}={raw!r} is not an integer") from None
        return cls(**kwargs)

    def to_env(self) -> dict:
        """The `SAS_*` variables that reproduce this config."""
        out = {}
        for s in SETTINGS:
            value = getattr(self, s.field)
            if value is not None:
                out[s.env] = str(value)
        return out

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["top_k"] = self.top_k
        return d


@dataclasses.dataclass(frozen=True)
class Setting:
    """One SASConfig field as launch flags and the environment name it.

    field: SASConfig attribute; env: its `SAS_*` variable; flag: its `--sas-*` launch flag (None:
    environment only); help: the flag's help text; type: int or str, how a value is parsed;
    default: the field's default.
    """

    field: str
    env: str
    flag: Optional[str]
    help: str
    type: type
    default: object


def _settings() -> tuple[Setting, ...]:
    hints = typing.get_type_hints(SASConfig)
    return tuple(
        Setting(f.name, f.metadata["env"], f.metadata["flag"], f.metadata["help"],
                int if hints[f.name] is int else str, f.default)
        for f in dataclasses.fields(SASConfig)
    )


#: Every setting, in field order: the one table `from_env`, `to_env` and the plugin's flags read.
SETTINGS = _settings()
