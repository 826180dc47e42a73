"""The per-layer scales of an fp8 KV cache, read once per layer from SGLang's attention layer.

SGLang stores K / k_scale and V / v_scale cast to fp8 (`set_kv_buffer` divides by the scales its caller passes;
SGLang's own backends pass `layer.k_scale` / `layer.v_scale`), and its FlashInfer backend reads with
`layer.k_scale_float` / `layer.v_scale_float`. Where the scales come from:
- a checkpoint's `k_scale` / `v_scale` (the quantization config's KV-cache method): both attributes, the float
  set from the tensor once after loading;
- `--quantization-param-path` (the model's `load_kv_cache_scales`): `layer.k_scale` set to a Python float, the
  `*_float` attributes left None;
- neither: 1.0 (SGLang warns "Defaulting to scaling factors of 1.0").
`sas` writes and reads with the same number, `layer_scales`, so a sparse read is the dequantized cache whichever
source set it. A non-fp8 cache ignores the scales on write (SGLang divides only when casting), so they are 1.0.
"""

from __future__ import annotations

import torch

from sas_backend.ops import FP8_DTYPES

# Where `layer_scales` found a layer's scales (reported by /sas/info).
SOURCES = ("checkpoint", "quantization-param-path", "default 1.0", "not fp8")


def _as_float(value) -> "float | None":
    """A scale attribute as a Python float (None when unset). A tensor is read once, on the host, at the first
    step that uses the layer (never inside a captured graph: graph capture runs after a warm-up step)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().cpu().reshape(-1)[0])
    return float(value)


def layer_scales(layer, kv_dtype: torch.dtype) -> "tuple[float, float, str]":
    """(k_scale, v_scale, source) of an SGLang attention layer for a KV pool of `kv_dtype` (1.0, 1.0 for a cache
    that is not fp8). Raises ValueError for a scale that is not positive (SGLang would store inf or nan)."""
    if kv_dtype not in FP8_DTYPES:
        return 1.0, 1.0, "not fp8"
    k_float, v_float = getattr(layer, "k_scale_float", None), getattr(layer, "v_scale_float", None)
    if k_float is not None and v_float is not None:
        k, v, source = float(k_float), float(v_float), "checkpoint"
    else:
        k, v = _as_float(getattr(layer, "k_scale", None)), _as_float(getattr(layer, "v_scale", None))
        if k is None and v is None:
            return 1.0, 1.0, "default 1.0"
        k = v if k is None else k
        v = k if v is None else v
        source = "quantization-param-path"
    if not (k > 0 and v > 0):
        raise ValueError(f"layer {getattr(layer, 'layer_id', '?')}: fp8 KV scales must be positive, got k_scale {k}, "
                         f"v_scale {v}")
    return k, v, source


def model_kv_scales(model, layer_ids, kv_dtype: torch.dtype) -> "tuple[dict, dict]":
    """({layer_id: (k_scale, v_scale)}, {layer_id: source}) of every attention layer of the model (SGLang's
    `RadixAttention`s, by layer_id) and of `layer_ids`; read once, after the weights are loaded (SGLang builds the
    attention backend after loading). A layer id without a module (tests, tools) gets (1.0, 1.0)."""
    layers = {m.layer_id: m for m in (model.modules() if model is not None else ())
              if isinstance(getattr(m, "layer_id", None), int) and hasattr(m, "tp_q_head_num")}
    scales, sources = {}, {}
    for lid in sorted(set(layer_ids) | set(layers)):
        if lid in layers:
            k, v, source = layer_scales(layers[lid], kv_dtype)
        else:
            k, v, source = 1.0, 1.0, "default 1.0" if kv_dtype in FP8_DTYPES else "not fp8"
        scales[lid], sources[lid] = (k, v), source
    return scales, sources
