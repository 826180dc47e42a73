"""fp8 KV scales as sas reads them from SGLang's attention layers (backend/kv_scales.py), and the CPU fp8 pool
hook (backend/cpu_fp8_pool.py) against the installed SGLang's check."""

import types

import pytest
import torch

from sas_backend.backend import cpu_fp8_pool
from sas_backend.backend.kv_scales import layer_scales, model_kv_scales

E4M3 = torch.float8_e4m3fn


def _layer(layer_id=0, **attrs):
    base = dict(layer_id=layer_id, tp_q_head_num=2, k_scale=None, v_scale=None, k_scale_float=None,
                v_scale_float=None)
    base.update(attrs)
    return types.SimpleNamespace(**base)


def test_scales_by_source():
    """A checkpoint's scales (the *_float attributes SGLang sets after loading) win; --quantization-param-path
    sets k_scale / v_scale to floats only; none: 1.0; a cache that is not fp8 ignores them all."""
    ckpt = _layer(k_scale=torch.tensor(0.5), v_scale=torch.tensor(2.0), k_scale_float=0.5, v_scale_float=2.0)
    assert layer_scales(ckpt, E4M3) == (0.5, 2.0, "checkpoint")
    assert layer_scales(_layer(k_scale=0.25, v_scale=0.25), E4M3) == (0.25, 0.25, "quantization-param-path")
    assert layer_scales(_layer(k_scale=torch.tensor(3.0)), E4M3) == (3.0, 3.0, "quantization-param-path")
    assert layer_scales(_layer(), torch.float8_e5m2) == (1.0, 1.0, "default 1.0")
    assert layer_scales(ckpt, torch.bfloat16) == (1.0, 1.0, "not fp8")
    with pytest.raises(ValueError, match="positive"):
        layer_scales(_layer(k_scale_float=-1.0, v_scale_float=1.0), E4M3)


def test_model_scales_cover_every_attention_layer():
    """Every RadixAttention of the model (dense layers below the first sparse one included) and every asked-for
    layer id; a layer id without a module reads 1.0."""
    layers = [_layer(0, k_scale=0.5, v_scale=0.5), _layer(1, k_scale_float=2.0, v_scale_float=4.0)]
    model = types.SimpleNamespace(modules=lambda: iter(layers + [types.SimpleNamespace()]))
    scales, sources = model_kv_scales(model, [1, 2], E4M3)
    assert scales == {0: (0.5, 0.5), 1: (2.0, 4.0), 2: (1.0, 1.0)}
    assert sources == {0: "quantization-param-path", 1: "checkpoint", 2: "default 1.0"}


def test_cpu_fp8_check_is_passed_for_a_sas_only_server_and_kept_otherwise(monkeypatch):
    """The installed SGLang's CPU fp8_e4m3 check (kv_cache_configurator: Intel AMX and the intel_amx backend)
    reads 'passed' inside the hook for a sas-only server, and is SGLang's own for any other server or dtype;
    the module's functions are restored after the call."""
    from sglang.srt.mem_cache import kv_cache_configurator as module

    seen = []

    def original(self):
        seen.append((module.cpu_has_amx_support(), tuple(module.attention_backends())))
        return "configured"

    monkeypatch.setattr(module.current_platform, "is_cpu", lambda: True)
    monkeypatch.setattr(module, "cpu_has_amx_support", lambda: False)
    for backends, dtype, passed in [(("sas", "sas"), E4M3, True), (("sas", "torch_native"), E4M3, False),
                                    (("sas", "sas"), torch.bfloat16, False)]:
        monkeypatch.setattr(module, "attention_backends", lambda b=backends: b)
        me = types.SimpleNamespace(kv_cache_dtype=dtype)
        assert cpu_fp8_pool.configure_with_sas_cpu_fp8(original, me) == "configured"
        assert seen[-1] == ((True, ("intel_amx", "intel_amx")) if passed else (False, backends))
        assert module.cpu_has_amx_support() is False and module.attention_backends() == backends
    # The names the hook swaps are the ones SGLang's configure reads for its check.
    import inspect

    source = inspect.getsource(module.KVCacheConfigurator.configure)
    assert "cpu_has_amx_support()" in source and "attention_backends()" in source and "intel_amx" in source
