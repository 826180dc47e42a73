"""Attention geometry of a served model, read from its Hugging Face config, and what sas supports.

`ModelGeometry` is the one place that turns an HF `config.json` (a dict or a transformers
`PretrainedConfig`) into the numbers the gate and the backend need: layer count, query / kv head
counts, head dim and the RoPE parameters. Gate checkpoint validation and the backend both use it.
`gate_rope_table` builds the gate's RoPE table from it (serving, training and evaluation alike).

`ARCHITECTURES` is the one table of the model architectures sas knows, saying per architecture
whether the backend serves it and whether the trainer trains gates for it (and why not).

Handles the two ways transformers writes RoPE parameters:
- 4.x: top-level `rope_theta` and optional `rope_scaling` dict;
- 5.x: a `rope_parameters` dict (`{"rope_type": "default", "rope_theta": ...}`), possibly
  without a top-level `rope_theta`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

if TYPE_CHECKING:
    import torch


class ModelGeometryError(ValueError):
    """The model config lacks (or has inconsistent) attention geometry."""


def _as_dict(config: Any) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):  # transformers PretrainedConfig
        return to_dict()
    raise TypeError(f"expected a config dict or a transformers PretrainedConfig, got {type(config).__name__}")


@dataclass(frozen=True)
class ModelGeometry:
    """Attention geometry of a decoder-only model.

    num_layers: attention layers (`num_hidden_layers`); num_q_heads `H_q`; num_kv_heads `H_kv`;
    head_dim `D`; rope_theta; rope_scaling (None for plain RoPE, else the HF scaling dict);
    max_position_embeddings; architecture (e.g. "LlamaForCausalLM"); model_name (`_name_or_path`
    or whatever the caller passed).
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict | None = None
    max_position_embeddings: int | None = None
    architecture: str | None = None
    model_name: str | None = None

    @property
    def group_size(self) -> int:
        """G = H_q / H_kv, query heads per kv head."""
        return self.num_q_heads // self.num_kv_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf_config(cls, config: Any, *, model_name: str | None = None) -> "ModelGeometry":
        """Geometry from an HF config dict or `PretrainedConfig`.

        Multimodal configs with a nested `text_config` use the text model's geometry.
        Raises ModelGeometryError naming any missing or inconsistent field.
        """
        cfg = _as_dict(config)
        if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
            outer = cfg
            cfg = dict(cfg["text_config"])
            cfg.setdefault("_name_or_path", outer.get("_name_or_path"))
            cfg.setdefault("architectures", outer.get("architectures"))

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise ModelGeometryError(f"model config has no {key!r}")
            return cfg[key]

        num_layers = int(need("num_hidden_layers"))
        num_q_heads = int(need("num_attention_heads"))
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_q_heads)
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            hidden = int(need("hidden_size"))
            if hidden % num_q_heads:
                raise ModelGeometryError(
                    f"hidden_size {hidden} is not a multiple of num_attention_heads {num_q_heads} "
                    "and the config has no head_dim"
                )
            head_dim = hidden // num_q_heads
        head_dim = int(head_dim)
        if num_q_heads % num_kv_heads:
            raise ModelGeometryError(
                f"num_attention_heads {num_q_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )

        rope_params = cfg.get("rope_parameters")
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        if isinstance(rope_params, Mapping):
            if rope_theta is None:
                rope_theta = rope_params.get("rope_theta")
            if rope_scaling is None:
                rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
                if rope_type not in (None, "default"):
                    rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_theta is None:
            rope_theta = 10000.0  # transformers' default for Llama-family configs without one
        if isinstance(rope_scaling, Mapping):
            rope_scaling = dict(rope_scaling)
            if rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
                rope_scaling = None

        archs = cfg.get("architectures") or []
        return cls(
            num_layers=num_layers,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling or None,
            max_position_embeddings=cfg.get("max_position_embeddings"),
            architecture=archs[0] if archs else None,
            model_name=model_name or cfg.get("_name_or_path") or None,
        )

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike) -> "ModelGeometry":
        """Geometry from `<path>/config.json` (model_name: `_name_or_path`, else the directory name)."""
        cfg_path = os.path.join(os.fspath(path), "config.json")
        try:
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        except FileNotFoundError:
            raise ModelGeometryError(f"{cfg_path}: no such file (is {path} a Hugging Face model directory?)")
        except (OSError, json.JSONDecodeError) as e:
            raise ModelGeometryError(f"{cfg_path}: cannot read JSON: {e}") from e
        name = cfg.get("_name_or_path") or os.path.basename(os.path.normpath(os.fspath(path)))
        return cls.from_hf_config(cfg, model_name=name)


def gate_rope_table(gate_dim: int, geometry: ModelGeometry, max_pos: int, device=None) -> "torch.Tensor":
    """The gate's RoPE table `[max_pos, gate_dim]` fp32 (cos|sin, YaRN's mscale included): the
    model's rotary formula, theta and scaling on the gate's Dg dims.

    The one place a gate table is made, so a gate is served with the table it was trained with.
    """
    from sas_backend.ops.rope import rope_cos_sin_table  # torch: imported only when a table is built

    return rope_cos_sin_table(gate_dim, max_pos, geometry.rope_theta, geometry.rope_scaling, device=device)


# ---- supported architectures ----------------------------------------------------------------


@dataclass(frozen=True)
class ArchitectureSupport:
    """What sas does with one HF architecture.

    family: the name messages use; model_type: the HF config's `model_type` (what a transformers
    model built from a config carries even without `architectures`); serve: the backend serves it;
    train_refusal: why the gate trainer refuses it, None when it trains gates for it.
    """

    family: str
    model_type: str
    serve: bool = True
    train_refusal: Optional[str] = None

    @property
    def train(self) -> bool:
        return self.train_refusal is None


#: HF architecture name -> support. Serving checks `architectures[0]`, training `model_type`.
ARCHITECTURES = {
    "LlamaForCausalLM": ArchitectureSupport("Llama", "llama"),
    "Qwen2ForCausalLM": ArchitectureSupport("Qwen2", "qwen2"),
    "Qwen3ForCausalLM": ArchitectureSupport("Qwen3", "qwen3"),
    "Qwen3MoeForCausalLM": ArchitectureSupport(
        "Qwen3-MoE", "qwen3_moe",
        train_refusal="the trainer is untested on mixture-of-experts backbones and replicates the whole "
                      "frozen backbone on every process (no expert or tensor parallelism; the smallest "
                      "Qwen3-MoE is ~61 GB in bf16)",
    ),
}


def architecture_by_model_type(model_type: Optional[str]) -> Optional[ArchitectureSupport]:
    """The table's entry for an HF `model_type` ("qwen3"), None if sas does not know it."""
    return next((a for a in ARCHITECTURES.values() if a.model_type == model_type), None)


def supported_families(use: str) -> str:
    """`"Llama, Qwen2, Qwen3"`: the families sas supports for `use` ("serve" or "train")."""
    if use not in ("serve", "train"):
        raise ValueError(f"use must be 'serve' or 'train', got {use!r}")
    return ", ".join(a.family for a in ARCHITECTURES.values() if getattr(a, use))
