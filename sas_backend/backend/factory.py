"""Build the `sas` backend for a SGLang ModelRunner, refusing what cannot work with clear messages."""

from __future__ import annotations

import logging
import os

import torch

from sas_backend.backend.kv_scales import check_param_path_loaded, model_kv_scales
from sas_backend.backend.model_checks import SASUnsupportedModel, check_model_supported
from sas_backend.backend.rope_tables import RopeTables, check_gate_rope_formula, check_rope_scaling, find_model_rotary
from sas_backend.backend.sas_attention import SASAttnBackend
from sas_backend.backend.sglang_compat import attention_cp_size, attention_tp, decode_cuda_graph_disabled
from sas_backend.backend.verify_rows import draft_tokens_from_args
from sas_backend.config import SASConfig, SASConfigError
from sas_backend.geometry import ModelGeometry
from sas_backend.ops import FP8_DTYPES
from sas_backend.selection import selector_class

logger = logging.getLogger(__name__)


def create_sas_backend(runner) -> SASAttnBackend:
    """Factory registered as attention backend "sas" (runs in each scheduler/TP process)."""
    if getattr(runner, "is_draft_worker", False):
        # The gate and summary pool are the target model's; the small draft model attends densely.
        raise SASConfigError("the sas backend serves the target model only; the draft model needs a dense backend: "
                             "--speculative-draft-attention-backend flashinfer (sas sets it when not given)")
    cfg = SASConfig.for_serving()
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
            "in the environment: export TRITON_INTERPRET=1 before the launch (in a clone of the "
            "repository, serve/serve.sh sets it)"
        )
    if cfg.debug_dir and device.type == "cuda" and not decode_cuda_graph_disabled(runner.server_args):
        raise SASConfigError(
            "SAS_DEBUG_DIR reads selections on the host each step: add --cuda-graph-backend-decode disabled"
        )
    hf_config = runner.model_config.hf_config
    check_model_supported(hf_config, use_mla=getattr(runner, "use_mla_backend", False))
    geo = ModelGeometry.from_hf_config(hf_config)
    check_rope_scaling(geo.rope_scaling)
    tp_rank, tp_size = attention_tp()
    if tp_size > geo.num_kv_heads:
        raise SASUnsupportedModel(
            f"sas: attention tensor parallel size {tp_size} exceeds the model's {geo.num_kv_heads} "
            "kv heads; the gate query needs every query head of a kv group on one rank"
        )
    if attention_cp_size() > 1:
        raise SASUnsupportedModel(
            "sas: attention context parallelism splits a request's KV over ranks; sas needs each "
            "request's blocks on one rank"
        )
    if cfg.first_sparse_layer >= geo.num_layers:
        raise SASConfigError(
            f"--sas-first-sparse-layer {cfg.first_sparse_layer} is past the model's {geo.num_layers} layers"
        )
    kv_dtype = runner.token_to_kv_pool.get_key_buffer(0).dtype
    if kv_dtype != runner.dtype and kv_dtype not in FP8_DTYPES:
        raise SASConfigError(f"sas serves the model's own KV dtype or an fp8 KV cache (--kv-cache-dtype fp8_e4m3 / "
                             f"fp8_e5m2), not a {kv_dtype} KV cache (model {runner.dtype})")
    own_cpu_extend = device.type == "cpu" and cfg.cpu_extend == "sas"
    if kv_dtype in FP8_DTYPES and device.type == "cpu" and not own_cpu_extend:
        raise SASConfigError("an fp8 KV cache on CPU needs sas's own extend (SAS_CPU_EXTEND=sas, the default): "
                             "SGLang's torch-native attention reads the fp8 cache without its scales")

    if kv_dtype in FP8_DTYPES:  # the scales SGLang loaded, before any are used
        try:
            check_param_path_loaded(model_kv_scales(runner.model, (), kv_dtype)[1],
                                    getattr(runner.server_args, "quantization_param_path", None), tp_rank, tp_size,
                                    "fp8_e4m3" if kv_dtype == torch.float8_e4m3fn else "fp8_e5m2")
        except ValueError as e:
            raise SASConfigError(str(e)) from None

    kv_local = geo.num_kv_heads // tp_size
    q_local = geo.num_q_heads // tp_size
    sparse_layers = range(cfg.first_sparse_layer, geo.num_layers)
    rotary = find_model_rotary(runner.model, geo.head_dim)
    loaded = selector_class(cfg.selector).load_gates(cfg, geo, sparse_layers, tp_rank, tp_size, device)
    gates, gate_dim, gate_sha256, source = loaded.gates, loaded.gate_dim, loaded.sha256, loaded.source
    if gate_dim:  # the gate's table is built with the model's formula on Dg dims: checked against the model's first
        check_gate_rope_formula(rotary.cos_sin_cache, geo)
    # The model's table is read from its rotary module (SGLang may replace it at runtime).
    rope = RopeTables(rotary, gate_dim, geo, device)
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    inner = ATTENTION_BACKENDS["flashinfer" if device.type == "cuda" else "torch_native"](runner)
    logger.info("sas: %s, dense backend %s, KV cache %s", source, type(inner).__name__,
                str(kv_dtype).replace("torch.", ""))
    backend = SASAttnBackend(
        runner,
        inner,
        cfg,
        gates,
        rope,
        num_kv_heads=kv_local,
        num_q_heads=q_local,
        head_dim=geo.head_dim,
        draft_tokens=draft_tokens_from_args(runner.server_args),
        kv_head_offset=tp_rank * kv_local,
        gate_sha256=gate_sha256,
        own_cpu_extend=own_cpu_extend,
    )
    if device.type == "cpu":
        logger.info("sas: CPU extend attention by %s (SAS_CPU_EXTEND)", "sas (ops/extend)" if own_cpu_extend
                    else "torch_native")
    return backend
