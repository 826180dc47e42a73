"""Which served models the sas backend can run, decided at startup with a clear message."""

from __future__ import annotations

from sas_backend.geometry import ARCHITECTURES, supported_families


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
