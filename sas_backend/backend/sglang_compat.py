"""Where this package meets SGLang's internals that moved between releases: one module, so that reading a new
release means reading this file (and tests/test_plugin.py, which pins the same contracts against the installed
SGLang).

- `attention_tp()`, `attention_cp_size()`: the attention tensor- and context-parallel groups;
- `decode_cuda_graph_disabled(server_args)`: whether decode steps run eagerly, however it was spelled;
- `save_kv(...)`: a K/V write into the pool (a write-location object from 0.5.14, the slot tensor before);
- `profile_target()`: the function whose KV-pool budget the plugin wraps (ModelRunner mixin or configurator).
"""

from __future__ import annotations

from typing import Optional

try:  # 0.5.14+ (0.5.15 and 0.5.21 read): the pool takes a write location object (loc + SWA loc)
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc
except ImportError:  # older releases: the pool takes the slot tensor itself
    KVWriteLoc = None


def save_kv(token_to_kv_pool, layer, out_cache_loc, k, v, k_scale=None, v_scale=None) -> None:
    """Store k, v `[tokens, H_kv, D]` at slots `out_cache_loc` `[tokens]` of `layer`; an fp8 pool stores them
    divided by k_scale / v_scale (floats; None: SGLang's 1.0), and SGLang's plain pool divides k / v IN PLACE."""
    loc = out_cache_loc if KVWriteLoc is None else KVWriteLoc(out_cache_loc, None)
    if k_scale is None and v_scale is None:
        token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
    else:
        token_to_kv_pool.set_kv_buffer(layer, loc, k, v, k_scale=k_scale, v_scale=v_scale)


# The SGLang releases whose source was read for the APIs this factory depends on (2026-11-23).
# tests/test_plugin.py pins the same contracts against the installed SGLang.
SGLANG_RELEASES_READ = {
    # release: (attention-TP rank/size, "decode CUDA graph off" as resolved, run here)
    "0.5.15": ("get_parallel().attn_tp_rank/attn_tp_size (also dp_attention.get_attention_tp_*)",
               "get_global_server_args().cuda_graph_config.decode.backend", "read"),
    "0.5.21": ("get_parallel().attn_tp_rank/attn_tp_size (dp_attention getters removed)",
               "get_exec().graph.cuda_graph_config.decode.backend", "read, installed, run on CPU"),
    "0.5.23": ("get_parallel().attn_tp_rank/attn_tp_size (ModelRunner.tp_rank/tp_size removed)",
               "get_exec().graph.cuda_graph_config.decode.backend", "read"),
}


def req_to_token_width(model_config) -> Optional[int]:
    """Columns of SGLang's `req_to_token` table, the decode step's widest block table: the model's context length
    plus the row headroom (`allocation_sizing.get_req_to_token_extra_context_len`, 0.5.21 and 0.5.23); None where
    the release or its published state does not say (the caller keeps an upper bound)."""
    try:
        from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len

        return int(model_config.context_len) + int(get_req_to_token_extra_context_len())
    except Exception:
        return None


def attention_tp() -> tuple[int, int]:
    """(rank, size) of this process in SGLang's attention tensor-parallel group.

    The model shards its kv heads over this group (attn_tp_size = tp_size / attn_dp_size /
    attn_cp_size), so the gate's kv-head axis is sharded the same way; under DP attention it is
    smaller than tp_size. `sglang.srt.runtime_context.get_parallel()` carries it in 0.5.15 through
    0.5.23 (the ModelRunner's own tp_rank/tp_size are gone in 0.5.23 and are the wrong group
    under DP attention anyway).
    """
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return int(parallel.attn_tp_rank), int(parallel.attn_tp_size)


def attention_cp_size() -> int:
    """Width of SGLang's attention context-parallel group (1 when off)."""
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().attn_cp_size)


def decode_cuda_graph_disabled(server_args) -> bool:
    """Whether SGLang will run decode steps eagerly (no decode CUDA graph).

    SGLang resolves every spelling into one config: `--disable-cuda-graph` (deprecated since
    0.5.21, sets `disable_cuda_graph`), `--disable-decode-cuda-graph`,
    `--cuda-graph-backend-decode disabled`, `--cuda-graph-config '{"decode": {"backend":
    "disabled"}}'`, and model hooks that switch graphs off. The resolved value is read when it is
    published (always so in a scheduler process); otherwise the raw flags are combined with
    SGLang's precedence (explicit config > per-phase backend > per-phase switch > legacy flag).
    """
    resolved = _published_decode_backend()
    if resolved is not None:
        return str(resolved) == "disabled"  # cuda_graph_config.Backend.DISABLED
    disabled = bool(getattr(server_args, "disable_cuda_graph", False))
    disabled = disabled or bool(getattr(server_args, "disable_decode_cuda_graph", False))
    backend = getattr(server_args, "cuda_graph_backend_decode", None)
    if backend is not None:
        disabled = str(backend) == "disabled"
    config = getattr(server_args, "cuda_graph_config", None)
    decode = config.get("decode") if isinstance(config, dict) else getattr(config, "decode", None)
    backend = decode.get("backend") if isinstance(decode, dict) else getattr(decode, "backend", None)
    if backend is not None:
        disabled = str(backend) == "disabled"
    return disabled


def _published_decode_backend():
    """The decode backend of SGLang's published CUDA-graph config, or None when unpublished."""
    try:
        from sglang.srt.runtime_context import get_exec

        cfg = get_exec().graph.cuda_graph_config
    except Exception:  # unpublished (tests, early startup) or a release without get_exec
        try:
            from sglang.srt.server_args import get_global_server_args

            cfg = get_global_server_args().cuda_graph_config
        except Exception:
            return None
    decode = getattr(cfg, "decode", None)
    return getattr(decode, "backend", None)


# `_profile_available_bytes` lives on the ModelRunner mixin in 0.5.15 and on the KV-cache
# configurator from 0.5.20 on; the plugin hooks whichever this SGLang has.
PROFILE_TARGETS = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes",
    "sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin._profile_available_bytes",
)


def profile_target() -> Optional[str]:
    """The first of PROFILE_TARGETS whose module exists here (found without importing it)."""
    import importlib.util

    for target in PROFILE_TARGETS:
        module = target.rsplit(".", 2)[0]
        try:
            if importlib.util.find_spec(module) is not None:
                return target
        except ModuleNotFoundError:
            continue
    return None
