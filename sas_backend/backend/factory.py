"""Build the `sas` backend for a SGLang ModelRunner, refusing what cannot work with clear messages."""

from __future__ import annotations

import logging
import os

import torch

from sas_backend.backend.model_checks import SASUnsupportedModel, check_model_supported, find_model_rope_table
from sas_backend.backend.sas_attention import SASAttnBackend
from sas_backend.config import SASConfig, SASConfigError
from sas_backend.gate.checkpoint import load_gate_checkpoint, shard_for_tp, validate_for_model
from sas_backend.gate.module import gates_from_tensors
from sas_backend.geometry import ModelGeometry
from sas_backend.ops.rope import rope_cos_sin_table

logger = logging.getLogger(__name__)


def create_sas_backend(runner) -> SASAttnBackend:
    """Factory registered as attention backend "sas" (runs in each scheduler/TP process)."""
    cfg = SASConfig.from_env().validate()
    device = torch.device(runner.device)
    page_size = runner.page_size or 1
    if page_size != cfg.block_size:
        raise SASConfigError(
            f"sas needs the KV page size to equal the SAS block size {cfg.block_size}, but the "
            f"server runs with page size {page_size}; launch with --page-size {cfg.block_size}"
        )
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SASConfigError(
            "on CPU, SGLang's paged KV allocator runs Triton kernels, which need TRITON_INTERPRET=1 "
            "in the environment (serve/serve.sh sets it)"
        )
    if cfg.debug_dir and device.type == "cuda" and not getattr(runner.server_args, "disable_cuda_graph", False):
        raise SASConfigError("SAS_DEBUG_DIR reads selections on the host each step: add --disable-cuda-graph")
    hf_config = runner.model_config.hf_config
    check_model_supported(hf_config, use_mla=getattr(runner, "use_mla_backend", False))
    geo = ModelGeometry.from_hf_config(hf_config)
    tp_rank, tp_size = runner.tp_rank, runner.tp_size
    if tp_size > geo.num_kv_heads:
        raise SASUnsupportedModel(
            f"sas: tensor parallel size {tp_size} exceeds the model's {geo.num_kv_heads} kv heads; "
            "the gate query needs every query head of a kv group on one rank"
        )
    if cfg.first_sparse_layer >= geo.num_layers:
        raise SASConfigError(
            f"--sas-first-sparse-layer {cfg.first_sparse_layer} is past the model's {geo.num_layers} layers"
        )
    kv_dtype = runner.token_to_kv_pool.get_key_buffer(0).dtype
    if kv_dtype != runner.dtype:
        raise SASConfigError(f"sas does not support a quantized KV cache yet (KV {kv_dtype}, model {runner.dtype})")

    gate_cfg, layers = load_gate_checkpoint(cfg.gate_path)
    validate_for_model(
        gate_cfg,
        layers,
        num_layers=geo.num_layers,
        num_q_heads=geo.num_q_heads,
        num_kv_heads=geo.num_kv_heads,
        head_dim=geo.head_dim,
        block_size=cfg.block_size,
    )
    layers = shard_for_tp(layers, tp_rank, tp_size)
    kv_local = geo.num_kv_heads // tp_size
    q_local = geo.num_q_heads // tp_size
    gates = gates_from_tensors(
        layers, range(cfg.first_sparse_layer, geo.num_layers), gate_dim=gate_cfg.gate_dim, device=device
    )

    model_rope = find_model_rope_table(runner.model, geo.head_dim).float()
    gate_rope = rope_cos_sin_table(
        gate_cfg.gate_dim, model_rope.shape[0], geo.rope_theta, geo.rope_scaling, device=device
    )
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    inner = ATTENTION_BACKENDS["flashinfer" if device.type == "cuda" else "torch_native"](runner)
    logger.info("sas: gate %s (%s), dense backend %s", cfg.gate_path, gate_cfg.base_model, type(inner).__name__)
    return SASAttnBackend(
        runner,
        inner,
        cfg,
        gates,
        model_rope,
        gate_rope,
        num_kv_heads=kv_local,
        num_q_heads=q_local,
        head_dim=geo.head_dim,
    )
