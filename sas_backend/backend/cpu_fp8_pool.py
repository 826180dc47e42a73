"""`--kv-cache-dtype fp8_e4m3` on CPU for a `sas` server: SGLang's CPU FP8 KV pool, opened to sas.

SGLang 0.5.21 builds a CPU fp8_e4m3 KV pool (`CPUFP8KVCacheMethod`: float8 buffers, `set_kv_buffer` storing
K / k_scale and V / v_scale) but `KVCacheConfigurator.configure` then refuses every attention backend except
its `intel_amx` one, and any CPU without Intel AMX (whose kernels intel_amx runs): "CPU FP8 KV cache requires
Intel AMX support" / "... requires the intel_amx attention backend". sas's CPU ops read fp8 with torch and need
neither. So, around `configure` and only when every configured attention backend is `sas`, the check reads
"AMX present, intel_amx configured"; everything else of `configure` runs as written. (fp8_e5m2 SGLang refuses
on CPU earlier, in `configure_kv_cache_dtype`; sas leaves that refusal standing: CUDA serves e5m2.)
"""

from __future__ import annotations

import contextlib
import logging

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure"


def register(registry, hook_type) -> None:
    registry.register(TARGET, configure_with_sas_cpu_fp8, hook_type.AROUND)


def sas_only(backends) -> bool:
    """Whether every configured attention backend (SGLang's (prefill, decode) pair) is sas."""
    names = {b for b in backends if b}
    return bool(names) and names <= {"sas"}


@contextlib.contextmanager
def _check_passes(module):
    """The CPU FP8 check of `module` (kv_cache_configurator) reads AMX present and intel_amx configured."""
    saved = module.cpu_has_amx_support, module.attention_backends
    module.cpu_has_amx_support = lambda: True
    module.attention_backends = lambda: ("intel_amx", "intel_amx")
    try:
        yield
    finally:
        module.cpu_has_amx_support, module.attention_backends = saved


def configure_with_sas_cpu_fp8(original, self, *args, **kwargs):
    """AROUND hook of `KVCacheConfigurator.configure` (module doc): SGLang's own configure, with its CPU FP8
    backend check passed for a sas-only CPU server with an fp8_e4m3 KV cache; untouched otherwise."""
    import torch
    from sglang.srt.mem_cache import kv_cache_configurator as module

    if not (module.current_platform.is_cpu() and getattr(self, "kv_cache_dtype", None) == torch.float8_e4m3fn
            and sas_only(module.attention_backends())):
        return original(self, *args, **kwargs)
    logger.info("sas: CPU fp8_e4m3 KV cache: SGLang's CPU FP8 pool, read by sas's torch ops (no AMX or intel_amx "
                "needed)")
    with _check_passes(module):
        return original(self, *args, **kwargs)
