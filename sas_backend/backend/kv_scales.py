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
source set it. With `--quantization-param-path`, SGLang's FlashInfer backend (0.5.15, 0.5.21 as read) writes with
`k_scale` and reads with `k_scale_float` (None: 1.0), so `share_with_dense_backend` sets the floats: the dense
branch sas hands to it (dense layers, covered steps, prefill over cached pages) then reads what was written.
A non-fp8 cache ignores the scales on write (SGLang divides only when casting), so they are 1.0.
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
    from_file = isinstance(getattr(layer, "k_scale", None), float)  # load_kv_cache_scales sets Python floats
    if k_float is not None and v_float is not None and not from_file:
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


def share_with_dense_backend(model, scales: dict, sources: dict) -> None:
    """Sets `k_scale_float` / `v_scale_float` of each layer whose scales came from `--quantization-param-path`
    (`scales` / `sources` as `model_kv_scales` returns them), so that a backend reading the floats (SGLang's
    FlashInfer) reads with the scales the cache was written with. `layer_scales` still names the source."""
    for m in (model.modules() if model is not None else ()):
        lid = getattr(m, "layer_id", None)
        if isinstance(lid, int) and hasattr(m, "tp_q_head_num") and sources.get(lid) == "quantization-param-path":
            m.k_scale_float, m.v_scale_float = scales[lid]


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


def check_param_path_loaded(sources: dict, param_path, tp_rank: int, tp_size: int, kv_cache_dtype: str) -> None:
    """Raises ValueError when `--quantization-param-path` was given for an fp8 cache but a layer's scales stayed
    at 1.0: SGLang reads the file only for fp8_e4m3, and its loader logs any error in the file (a missing tp rank,
    a wrong layer count, bad JSON) and goes on with 1.0, which reads every K and V of that layer off by its scale.
    `sources`: {layer_id: source}; `kv_cache_dtype`: the flag's value (fp8_e4m3, fp8_e5m2)."""
    if not param_path:
        return
    if kv_cache_dtype != "fp8_e4m3":
        raise ValueError(f"--quantization-param-path sets fp8 KV scales only with --kv-cache-dtype fp8_e4m3: SGLang "
                         f"ignores it for {kv_cache_dtype} and would serve scales of 1.0; sas refuses")
    defaulted = sorted(lid for lid, source in sources.items() if source == "default 1.0")
    if defaulted:
        raise ValueError(
            f"--quantization-param-path {param_path} set no fp8 KV scales for layers {defaulted[:4]}"
            f"{'...' if len(defaulted) > 4 else ''} on tp rank {tp_rank} of {tp_size} (SGLang logged why: the file "
            f"needs kv_cache.scaling_factor with one table for each tp rank 0..{tp_size - 1}, each with every "
            "layer); sas refuses to serve them at 1.0")


def check_param_path_file(param_path, kv_cache_dtype: str, tp_size: int, model_dir) -> None:
    """The launcher's form of `check_param_path_loaded`: reads `param_path` with SGLang's own loader for every tp
    rank (the model's layer count and type from `model_dir`'s config.json) and raises ValueError where it would
    set no scales. Nothing to check without a param path."""
    import json
    import os

    if not param_path:
        return
    check_param_path_loaded({}, param_path, 0, tp_size, kv_cache_dtype)
    config = os.path.join(model_dir or "", "config.json")
    if not os.path.isfile(config):  # a hub id: the scheduler checks what SGLang loaded
        return
    from sglang.srt.model_loader.weight_utils import kv_cache_scales_loader

    with open(config) as f:
        hf = json.load(f)
    hf = hf.get("text_config", hf)
    layers = int(hf["num_hidden_layers"])
    for rank in range(tp_size):
        loaded = {int(k) for k, _ in kv_cache_scales_loader(param_path, rank, tp_size, layers, hf.get("model_type"))}
        check_param_path_loaded({lid: "quantization-param-path" if lid in loaded else "default 1.0"
                                 for lid in range(layers)}, param_path, rank, tp_size, kv_cache_dtype)
