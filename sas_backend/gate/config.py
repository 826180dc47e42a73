"""`GateConfig`: the gate geometry, base-model identity and training record of a gate checkpoint.

Stored as `config.json` next to `gate.safetensors`. Keys follow SeerAttention-R's config names
where they exist (`seerattn_*`, `base_model`, and the HF names `num_hidden_layers`,
`num_attention_heads`, `num_key_value_heads`, `head_dim`, `rope_theta`, `torch_dtype`):

    {
      "sas_gate_format_version": 1,
      "seerattn_gate_block_size": 64,            # b, tokens per block
      "seerattn_gate_hidden_size": 128,          # Dg, gate dim
      "seerattn_q_head_pooling_type": "Qproj",   # only Qproj is supported
      "seerattn_k_seq_pooling_type": "Kmaxminavg",  # only Kmaxminavg (max|min|mean) is supported
      "seerattn_use_qk_norm": true,              # must be true
      "seerattn_use_rope": true,                 # must be true
      "base_model": "SmolLM2-135M-Instruct",     # name or path of the model the gate was made for
      "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
      "rope_theta": 100000.0, "rope_scaling": null,
      "torch_dtype": "float32",                  # dtype of the tensors in gate.safetensors
      "training": {...},                         # free-form: objective, budget, data, steps, loss...
      "serving": {"budget": 512, "sink_blocks": 1, "local_blocks": 1, "chosen_by": "..."}  # optional
    }

`serving` holds the settings the server uses when the launch names none (`--sas-budget`,
`--sas-sink-blocks`, `--sas-local-blocks` still win): the budget and forced blocks the quality
harness chose for this gate, and `chosen_by`, the results file (relative to the repository) that
shows why.

Per layer the tensors are (H_kv kv heads, G = H_q / H_kv, D head dim, Dg gate dim):
`attngate_linear_q.weight [H_kv, G, D, Dg]`, `attngate_linear_k.weight [H_kv, 3D, Dg]`,
`attngate_qnorm.weight [Dg]`, `attngate_knorm.weight [Dg]`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from sas_backend.gate.errors import GateCheckpointError
from sas_backend.ops import sub_blocks_ok

FORMAT_VERSION = 1

#: Short per-layer tensor names (the keys of `AttnGate.state_dict()`).
PARAM_NAMES = (
    "attngate_linear_q.weight",
    "attngate_linear_k.weight",
    "attngate_qnorm.weight",
    "attngate_knorm.weight",
)

#: Full checkpoint key of a per-layer tensor, shared by our format and SeerAttention-R's.
KEY_TEMPLATE = "model.layers.{layer}.self_attn.attn_gate.{name}"

SUPPORTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`; raises GateCheckpointError for unsupported dtypes."""
    for name, dt in SUPPORTED_DTYPES.items():
        if dt == dtype:
            return name
    raise GateCheckpointError(f"unsupported gate tensor dtype {dtype}; use one of {sorted(SUPPORTED_DTYPES)}")


def dtype_from_name(name: str) -> torch.dtype:
    """`"bfloat16"` (or `"torch.bfloat16"`) -> `torch.bfloat16`."""
    key = str(name).removeprefix("torch.")
    if key not in SUPPORTED_DTYPES:
        raise GateCheckpointError(f"unsupported gate tensor dtype {name!r}; use one of {sorted(SUPPORTED_DTYPES)}")
    return SUPPORTED_DTYPES[key]


#: Integer settings a gate's `serving` record may hold (see `GateConfig.serve_defaults`).
_SERVING_INTS = ("budget", "sink_blocks", "local_blocks", "prompt_anchors", "sub_blocks", "exact_rerank")


def _serving_problems(serving: Any, block_size: int) -> list[str]:
    """What is wrong with a `serving` record (empty when nothing)."""
    if not isinstance(serving, dict):
        return [f"serving must be a JSON object, got {type(serving).__name__}"]
    problems = []
    for k in _SERVING_INTS:
        v = serving.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            problems.append(f"serving.{k} must be a non-negative integer, got {v!r}")
    if problems:
        return problems
    if serving.get("exact_rerank") == 0:
        problems.append("serving.exact_rerank must be >= 1 (1: one level), got 0")
    sub = serving.get("sub_blocks")
    if sub is not None and not sub_blocks_ok(sub, block_size):
        problems.append(f"serving.sub_blocks {sub} is not a power of two dividing the block size {block_size}")
    budget = serving.get("budget")
    if budget is not None and (budget <= 0 or budget % block_size):
        problems.append(f"serving.budget {budget} is not a positive multiple of the block size {block_size}")
    elif budget is not None and serving.get("sink_blocks", 0) + serving.get("local_blocks", 0) > budget // block_size:
        problems.append(f"serving sink + local blocks exceed the {budget // block_size} blocks of budget {budget}")
    elif budget is not None and (serving.get("sink_blocks", 0) + serving.get("local_blocks", 0)
                                 + serving.get("prompt_anchors", 0)) > budget // block_size:
        problems.append(f"serving sink + local + prompt anchor blocks exceed the {budget // block_size} blocks of "
                        f"budget {budget}")
    return problems


# JSON key -> dataclass attribute, for the fields whose names differ.
_JSON_TO_ATTR = {
    "seerattn_gate_block_size": "block_size",
    "seerattn_gate_hidden_size": "gate_dim",
    "seerattn_q_head_pooling_type": "q_pooling",
    "seerattn_k_seq_pooling_type": "k_pooling",
    "seerattn_use_qk_norm": "use_qk_norm",
    "seerattn_use_rope": "use_rope",
}
_REQUIRED_JSON = (
    "seerattn_gate_block_size",
    "seerattn_gate_hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


@dataclass
class GateConfig:
    """Geometry + identity + training record of one gate checkpoint (see the module docstring).

    Attribute <-> JSON key: block_size <-> seerattn_gate_block_size, gate_dim <->
    seerattn_gate_hidden_size, q_pooling <-> seerattn_q_head_pooling_type, k_pooling <->
    seerattn_k_seq_pooling_type, use_qk_norm <-> seerattn_use_qk_norm, use_rope <->
    seerattn_use_rope; the rest keep their JSON names. `source` (where it was loaded from) is not
    stored. Construction refuses pooling types other than Qproj/Kmaxminavg and disabled
    qk-norm/RoPE: the backend implements exactly that gate.
    """

    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int = 64
    gate_dim: int = 128
    q_pooling: str = "Qproj"
    k_pooling: str = "Kmaxminavg"
    use_qk_norm: bool = True
    use_rope: bool = True
    base_model: str | None = None
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    torch_dtype: str = "float32"
    training: dict = field(default_factory=dict)
    serving: dict = field(default_factory=dict)
    source: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        where = f"{self.source}: " if self.source else ""
        problems = []
        if self.q_pooling != "Qproj":
            problems.append(
                f"seerattn_q_head_pooling_type is {self.q_pooling!r}; only 'Qproj' "
                "(per-group projection of the G query heads) is supported"
            )
        if self.k_pooling != "Kmaxminavg":
            problems.append(
                f"seerattn_k_seq_pooling_type is {self.k_pooling!r}; only 'Kmaxminavg' "
                "(max|min|mean block pooling) is supported"
            )
        if self.use_qk_norm is not True:
            problems.append("seerattn_use_qk_norm is false; the backend needs a gate with q/k RMSNorm")
        if self.use_rope is not True:
            problems.append("seerattn_use_rope is false; the backend needs a gate with RoPE")
        for name in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "block_size", "gate_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                problems.append(f"{name} must be a positive integer, got {v!r}")
        if not problems and self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not problems and self.gate_dim % 2:
            problems.append(f"seerattn_gate_hidden_size {self.gate_dim} must be even (RoPE rotates pairs)")
        if self.torch_dtype.removeprefix("torch.") not in SUPPORTED_DTYPES:
            problems.append(f"torch_dtype {self.torch_dtype!r} is not one of {sorted(SUPPORTED_DTYPES)}")
        else:
            self.torch_dtype = self.torch_dtype.removeprefix("torch.")
        if not isinstance(self.training, dict):
            problems.append(f"training must be a JSON object, got {type(self.training).__name__}")
        if not problems:
            problems += _serving_problems(self.serving, self.block_size)
        if problems:
            raise GateCheckpointError(where + "invalid gate config: " + "; ".join(problems))

    def serve_defaults(self) -> dict:
        """`{"budget", "sink_blocks", "local_blocks", "prompt_anchors", "sub_blocks", "exact_rerank"}` the server uses
        when the launch names none:
        the `serving` record, else the training budget (under the one budget rule K = budget // b,
        the K the gate was trained with) and no forced blocks; keys it cannot tell are left out."""
        out = {k: self.serving[k] for k in _SERVING_INTS if k in self.serving}
        budget, top_k = self.training.get("budget"), self.training.get("top_k")
        if ("budget" not in out and isinstance(budget, int) and budget > 0 and budget % self.block_size == 0
                and top_k in (None, budget // self.block_size)):  # not for a gate trained with another K
            out["budget"] = budget
        return out

    # ---- geometry helpers -------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def group_size(self) -> int:
        """G = H_q / H_kv."""
        return self.num_attention_heads // self.num_key_value_heads

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Expected per-layer shapes, keyed by short tensor name."""
        h, g, d, dg = self.num_key_value_heads, self.group_size, self.head_dim, self.gate_dim
        return {
            "attngate_linear_q.weight": (h, g, d, dg),
            "attngate_linear_k.weight": (h, 3 * d, dg),
            "attngate_qnorm.weight": (dg,),
            "attngate_knorm.weight": (dg,),
        }

    def describe(self) -> str:
        """`"30 layers / 9 query heads / 3 kv heads / head dim 64 / gate dim 128 / block size 64"`."""
        return (
            f"{self.num_hidden_layers} layers / {self.num_attention_heads} query heads / "
            f"{self.num_key_value_heads} kv heads / head dim {self.head_dim} / gate dim {self.gate_dim} / "
            f"block size {self.block_size}"
        )

    @classmethod
    def from_geometry(cls, geometry: Any, **kwargs: Any) -> "GateConfig":
        """From a `sas_backend.geometry.ModelGeometry` (base_model defaults to its model_name)."""
        kwargs.setdefault("base_model", geometry.model_name)
        kwargs.setdefault("rope_theta", geometry.rope_theta)
        kwargs.setdefault("rope_scaling", geometry.rope_scaling)
        return cls(
            num_hidden_layers=geometry.num_layers,
            num_attention_heads=geometry.num_q_heads,
            num_key_value_heads=geometry.num_kv_heads,
            head_dim=geometry.head_dim,
            **kwargs,
        )

    # ---- JSON -------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The `config.json` object (SeerAttention-R key names where they exist)."""
        return {
            "sas_gate_format_version": FORMAT_VERSION,
            "seerattn_gate_block_size": self.block_size,
            "seerattn_gate_hidden_size": self.gate_dim,
            "seerattn_q_head_pooling_type": self.q_pooling,
            "seerattn_k_seq_pooling_type": self.k_pooling,
            "seerattn_use_qk_norm": self.use_qk_norm,
            "seerattn_use_rope": self.use_rope,
            "base_model": self.base_model,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "torch_dtype": self.torch_dtype,
            "training": self.training,
            **({"serving": self.serving} if self.serving else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str | None = None) -> "GateConfig":
        """Parse a canonical `config.json` object; GateCheckpointError names `source` and the key."""
        where = f"{source}: " if source else ""
        if not isinstance(d, Mapping):
            raise GateCheckpointError(f"{where}config must be a JSON object, got {type(d).__name__}")
        version = d.get("sas_gate_format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise GateCheckpointError(
                f"{where}sas_gate_format_version {version!r} is not supported (this build reads {FORMAT_VERSION})"
            )
        missing = [k for k in _REQUIRED_JSON if d.get(k) is None]
        if missing:
            raise GateCheckpointError(f"{where}gate config lacks required key(s): {', '.join(missing)}")
        kwargs: dict[str, Any] = {}
        for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "base_model", "rope_theta", "rope_scaling", "torch_dtype", "training", "serving"):
            if d.get(key) is not None:
                kwargs[key] = d[key]
        for key, attr in _JSON_TO_ATTR.items():
            if d.get(key) is not None:
                kwargs[attr] = d[key]
        return cls(**kwargs, source=source)

    def save_json(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=False)
            f.write("\n")

    @classmethod
    def load_json(cls, path: str | os.PathLike) -> "GateConfig":
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except FileNotFoundError:
            raise GateCheckpointError(f"{path}: no such file") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise GateCheckpointError(f"{path}: cannot read JSON: {e}") from e
        return cls.from_dict(d, source=path)
