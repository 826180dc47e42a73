"""Which served models the sas backend can run, decided at startup with a clear message."""

from __future__ import annotations

import torch

from sas_backend.geometry import ARCHITECTURES, supported_families
from sas_backend.ops.rope import SUPPORTED_ROPE_SCALINGS, rope_scaling_type


class SASUnsupportedModel(ValueError):
    """The served model (or a server setting) is outside what the sas backend supports."""


def check_model_supported(hf_config, *, use_mla: bool = False) -> None:
    """Refuse MLA, sliding-window layers, encoder-decoder and architectures `geometry.ARCHITECTURES`
    does not mark as served.

    hf_config: the served model's transformers config.
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    name = archs[0] if archs else type(hf_config).__name__
    if use_mla or getattr(hf_config, "kv_lora_rank", None):
        raise SASUnsupportedModel(
            f"sas: {name} uses multi-head latent attention (MLA); the sas backend supports "
            f"GQA/MHA models only ({supported_families('serve')})"
        )
    if getattr(hf_config, "is_encoder_decoder", False):
        raise SASUnsupportedModel(f"sas: {name} is an encoder-decoder model; sas supports decoder-only LMs")
    layer_types = getattr(hf_config, "layer_types", None) or []
    uses_swa = getattr(hf_config, "use_sliding_window", False) or any(
        t != "full_attention" for t in layer_types
    )
    if archs and archs[0] in ("MistralForCausalLM",) and getattr(hf_config, "sliding_window", None):
        uses_swa = True
    if uses_swa:
        raise SASUnsupportedModel(
            f"sas: {name} has sliding-window (or non-full) attention layers; sas needs full attention "
            "in every layer"
        )
    if not any(a in ARCHITECTURES and ARCHITECTURES[a].serve for a in archs):
        served = ", ".join(f"{a} ({s.family})" for a, s in ARCHITECTURES.items() if s.serve)
        raise SASUnsupportedModel(
            f"sas: architecture {name} is not supported; serving supports: {served} "
            f"(gate training: {supported_families('train')})"
        )


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
