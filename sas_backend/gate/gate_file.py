"""One gate checkpoint as the serving path reads it: each part at most once per process.

A launch used to read the same checkpoint up to five times (the plugin's fit check, the serving record for the
budget, the training record for the forced-block warning, /sas/info's identity and hash; then in the scheduler the
memory sizing, which loaded every tensor to read one dimension, the hash and the factory's load). `open_gate(path)`
returns one `GateFile` per checkpoint and process, whose parts are read on first use and kept: `config`
(config.json alone), `tensors` (loaded and checked once), `sha256` (the weights file, hashed once).

The object is keyed by the directory and the files' size and modification time, so a checkpoint rewritten in place
(a training run's output, a test) is a new object; a server, which reads its gate at startup, keeps what it read.
The four functions at the end are the checkpoint's facts by path, each through `open_gate`.
"""

from __future__ import annotations

import functools
import os

from sas_backend.gate.checkpoint import (
    CANONICAL, CONFIG_FILE, _WEIGHTS_OF, _load_canonical, _resolve_dir, detect_format, load_gate_checkpoint,
    sha256_file,
)
from sas_backend.gate.config import GateConfig
from sas_backend.gate.tensors import LayerTensors


class GateFile:
    """A gate checkpoint directory (either format), read lazily, each part once. Build with `open_gate`."""

    def __init__(self, directory: str):
        self.path = directory
        self.format = detect_format(directory)
        self.weights_path = os.path.join(directory, _WEIGHTS_OF[self.format])
        self._loaded = None

    @functools.cached_property
    def config(self) -> GateConfig:
        """The checkpoint's `GateConfig`: config.json alone for a canonical checkpoint (no tensor is read); a
        SeerAttention-R one records its geometry only with its weights, so they are loaded (once) for it."""
        if self.format != CANONICAL:
            return self.loaded()[0]
        config = GateConfig.load_json(os.path.join(self.path, CONFIG_FILE))
        config.source = self.path
        return config

    def loaded(self) -> tuple[GateConfig, LayerTensors]:
        """`load_gate_checkpoint`'s (config, tensors), loaded and checked on first call, then kept."""
        if self._loaded is None:  # a canonical checkpoint's config.json is read once, for both
            self._loaded = (_load_canonical(self.path, self.config) if self.format == CANONICAL
                            else load_gate_checkpoint(self.path))
        return self._loaded

    @property
    def tensors(self) -> LayerTensors:
        """`{layer: {short name: Tensor}}` on CPU in the stored dtype (loaded once)."""
        return self.loaded()[1]

    def release_tensors(self) -> None:
        """Drop the kept CPU tensors (the server holds its own device copies once built); config and hash stay."""
        self._loaded = None

    @functools.cached_property
    def sha256(self) -> str:
        """sha256 of the weights file, hashed once."""
        return sha256_file(self.weights_path)

    def serve_defaults(self) -> dict:
        """The checkpoint's serving record as `SASConfig` fields (`GateConfig.serve_defaults`); `{}` for a
        SeerAttention-R checkpoint, which records none."""
        return self.config.serve_defaults() if self.format == CANONICAL else {}

    def training_record(self) -> dict:
        """The checkpoint's `training` record; `{}` for a SeerAttention-R checkpoint."""
        return dict(self.config.training or {}) if self.format == CANONICAL else {}

    def identity(self) -> dict:
        """What /sas/info reports about the gate (`checkpoint_identity` below): format, weights file, its
        sha256, base model, geometry, training and serving records. Validates the checkpoint (loads it once)."""
        config, _ = self.loaded()
        return {
            "path": os.path.abspath(self.path),
            "format": self.format,
            "weights_file": os.path.basename(self.weights_path),
            "sha256": self.sha256,
            "base_model": config.base_model,
            "layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "gate_dim": config.gate_dim,
            "block_size": config.block_size,
            "torch_dtype": config.torch_dtype,
            "training": config.training,
            "serving": self.serve_defaults(),
        }


def _stamp(path: str) -> tuple:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return (None,)
    return (st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _open(directory: str, _stamps: tuple) -> GateFile:
    return GateFile(directory)


def open_gate(path: str | os.PathLike) -> GateFile:
    """The process's `GateFile` for the checkpoint at `path` (GateCheckpointError if it is not one)."""
    directory = os.path.abspath(_resolve_dir(path))
    fmt = detect_format(directory)
    stamps = (_stamp(os.path.join(directory, CONFIG_FILE)), _stamp(os.path.join(directory, _WEIGHTS_OF[fmt])))
    return _open(directory, stamps)


def serve_defaults_of(path: str | os.PathLike) -> dict:
    """`GateConfig.serve_defaults()` of a checkpoint from its config.json alone (no tensors read: the server loads
    and checks the whole checkpoint later anyway). A SeerAttention-R checkpoint records neither a serving nor a
    training budget: `{}`."""
    return open_gate(path).serve_defaults()


def read_training_record(path: str | os.PathLike) -> dict:
    """The `training` record of a checkpoint from its config.json alone; `{}` for a SeerAttention-R one."""
    return open_gate(path).training_record()


def weights_sha256(path: str | os.PathLike) -> str:
    """sha256 of a checkpoint's weights file (`gate.safetensors` or `attn_gate_weights.pth`), hashed once per
    process: which gate a result was measured with."""
    return open_gate(path).sha256


def checkpoint_identity(path: str | os.PathLike) -> dict:
    """What the server reports about its gate (/sas/info): format, weights file and its sha256, base model,
    geometry and the training record. Loads (and so validates) the checkpoint, once per process."""
    return open_gate(path).identity()
