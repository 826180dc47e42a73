"""Reader for SeerAttention-R's published gate layout ("AttnGates" repositories).

A directory with
- `config.json`: the base model's full HF config plus `seerattn_*` keys and `base_model`
  (written by `model.config.save_pretrained(...)` in SeerAttention's `distillation_decode.py`);
- `attn_gate_weights.pth`: `torch.save` of `{k: v for k, v in model.state_dict().items()
  if "attn_gate" in k}`, i.e. keys `model.layers.{i}.self_attn.attn_gate.attngate_*.weight`.

Stored shapes equal ours, no transposition: `attngate_linear_q.weight` is SeerAttention's
`HeadPoolingLinear.weight [num_k_head, gqa_group_size, head_dim, gate_hidden_size]`
(= `[H_kv, G, D, Dg]`, used as `einsum('skgi,kgio->sko')`), `attngate_linear_k.weight` is
`MultiHeadLinear.weight [num_k_head, 3*head_dim, gate_hidden_size]` (= `[H_kv, 3D, Dg]`, input
channels ordered max|min|avg as in the class name `Kmaxminavg`), the norms are `RMSNorm.weight [Dg]`.

The `.pth` is read with `torch.load(weights_only=True)` only: a pickle that needs anything beyond
tensors and plain containers is refused.
"""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

import torch

from sas_backend.gate.config import GateConfig, dtype_name
from sas_backend.gate.errors import GateCheckpointError
from sas_backend.gate.tensors import LayerTensors, check_tensors, common_dtype, unflatten
from sas_backend.geometry import ModelGeometry, ModelGeometryError

SEER_WEIGHTS = "attn_gate_weights.pth"
SEER_CONFIG = "config.json"

# SeerAttention-R's defaults (SeerAttnQwen3Config / distillation_decode.py ModelArguments),
# applied when a config.json omits the key, as their own loader would.
_SEER_DEFAULTS = {
    "seerattn_gate_block_size": 64,
    "seerattn_gate_hidden_size": 128,
    "seerattn_q_head_pooling_type": "Qproj",
    "seerattn_k_seq_pooling_type": "Kmaxminavg",
    "seerattn_use_rope": True,
}
# Keys mapped onto GateConfig fields; every other seerattn_* key goes to the training record.
_MAPPED = set(_SEER_DEFAULTS) | {"seerattn_use_qk_norm"}


def load_weights_pth(path: str) -> dict[str, Any]:
    """`torch.load(path, map_location="cpu", weights_only=True)`, errors re-raised with the path."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise GateCheckpointError(f"{path}: no such file") from None
    except pickle.UnpicklingError as e:
        raise GateCheckpointError(
            f"{path}: refused by torch.load(weights_only=True) (it needs to unpickle objects other than "
            f"tensors, or is not a torch file): {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from e
    except Exception as e:  # truncated zip, bad magic, ...
        raise GateCheckpointError(f"{path}: cannot read torch file: {type(e).__name__}: {e}") from e
    if not isinstance(obj, dict):
        raise GateCheckpointError(f"{path}: expected a state dict (dict of tensors), got {type(obj).__name__}")
    return obj


def read_seer_config(cfg: dict, *, tensors: LayerTensors | None, source: str) -> GateConfig:
    """SeerAttention-R `config.json` dict -> GateConfig (torch_dtype from `tensors` if given).

    `seerattn_use_qk_norm` missing: inferred from whether the norm tensors are present (older
    configs); explicitly false: refused by GateConfig.
    """
    if not isinstance(cfg, dict):
        raise GateCheckpointError(f"{source}: config must be a JSON object")
    try:
        geom = ModelGeometry.from_hf_config(cfg)
    except ModelGeometryError as e:
        raise GateCheckpointError(f"{source}: {e}") from e
    seer = {k: (cfg[k] if cfg.get(k) is not None else v) for k, v in _SEER_DEFAULTS.items()}
    assumed = sorted(k for k in _SEER_DEFAULTS if cfg.get(k) is None)
    use_qk_norm = cfg.get("seerattn_use_qk_norm")
    if use_qk_norm is None:
        use_qk_norm = bool(tensors) and all(
            "attngate_qnorm.weight" in per and "attngate_knorm.weight" in per for per in tensors.values()
        )
        assumed.append("seerattn_use_qk_norm (inferred from the tensors)")
    torch_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if tensors:
        torch_dtype = dtype_name(common_dtype(tensors, source))
    training = {
        "source_format": "seerattention-r",
        "objective": "distillation (SeerAttention-R: KL to block-pooled dense attention)",
        "seerattn": {k: v for k, v in sorted(cfg.items()) if k.startswith("seerattn_") and k not in _MAPPED},
        "base_model_type": cfg.get("model_type"),
        "architectures": cfg.get("architectures"),
    }
    if assumed:
        training["assumed_defaults"] = assumed
    base_model = cfg.get("base_model") or cfg.get("_name_or_path") or None
    try:
        return GateConfig.from_geometry(
            geom,
            block_size=int(seer["seerattn_gate_block_size"]),
            gate_dim=int(seer["seerattn_gate_hidden_size"]),
            q_pooling=seer["seerattn_q_head_pooling_type"],
            k_pooling=seer["seerattn_k_seq_pooling_type"],
            use_qk_norm=bool(use_qk_norm),
            use_rope=bool(seer["seerattn_use_rope"]),
            base_model=base_model,
            torch_dtype=str(torch_dtype).removeprefix("torch."),
            training=training,
            source=source,
        )
    except GateCheckpointError as e:
        raise GateCheckpointError(f"{e} (SeerAttention-R checkpoint)") from e


def load_seer_checkpoint(directory: str) -> tuple[GateConfig, LayerTensors]:
    """Load `config.json` + `attn_gate_weights.pth` from `directory` and check them."""
    cfg_path = os.path.join(directory, SEER_CONFIG)
    pth_path = os.path.join(directory, SEER_WEIGHTS)
    for p in (cfg_path, pth_path):
        if not os.path.isfile(p):
            raise GateCheckpointError(
                f"{p}: no such file (SeerAttention-R layout needs {SEER_CONFIG} + {SEER_WEIGHTS})")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GateCheckpointError(f"{cfg_path}: cannot read JSON: {e}") from e
    flat = load_weights_pth(pth_path)
    strip = "module." if flat and all(isinstance(k, str) and k.startswith("module.") for k in flat) else ""
    tensors = unflatten(flat, pth_path, strip_prefix=strip)
    config = read_seer_config(cfg, tensors=tensors, source=cfg_path)
    check_tensors(config, tensors, pth_path)
    config.source = directory
    return config, tensors
