"""fp8 KV scales as sas reads them from SGLang's attention layers (backend/kv_scales.py), and the CPU fp8 pool
hook (backend/cpu_fp8_pool.py) against the installed SGLang's check."""

import types

import pytest
import torch

from sas_backend.backend import cpu_fp8_pool
from sas_backend.backend.kv_scales import (check_param_path_file, check_param_path_loaded, layer_scales,
                                          model_kv_scales, share_with_dense_backend)

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


def test_param_path_scales_are_shared_with_the_dense_backend():
    """SGLang's FlashInfer backend writes with `k_scale` and reads `k_scale_float` (None after
    --quantization-param-path): sas sets the floats of those layers only, and still names their source."""
    layers = [_layer(0, k_scale=0.5, v_scale=0.5), _layer(1, k_scale=torch.tensor(2.0), v_scale=torch.tensor(4.0),
                                                         k_scale_float=2.0, v_scale_float=4.0), _layer(2)]
    model = types.SimpleNamespace(modules=lambda: iter(layers))
    scales, sources = model_kv_scales(model, [], E4M3)
    share_with_dense_backend(model, scales, sources)
    assert (layers[0].k_scale_float, layers[0].v_scale_float) == (0.5, 0.5)
    assert layers[2].k_scale_float is None  # 1.0 by default: SGLang reads None as 1.0 already
    assert model_kv_scales(model, [], E4M3) == (scales, sources)  # a second backend reads the same


def test_a_scales_file_that_set_no_scales_is_refused():
    """SGLang's loader logs a bad --quantization-param-path file (here: no table for tp rank 1) and serves 1.0;
    sas refuses it by name. A file that set every layer, or no file, passes."""
    with pytest.raises(ValueError, match=r"set no fp8 KV scales for layers \[0, 1\] on tp rank 1 of 3"):
        check_param_path_loaded({0: "default 1.0", 1: "default 1.0"}, "scales.json", 1, 3, "fp8_e4m3")
    check_param_path_loaded({0: "quantization-param-path", 1: "quantization-param-path"}, "scales.json", 1, 3,
                            "fp8_e4m3")
    check_param_path_loaded({0: "default 1.0"}, None, 0, 1, "fp8_e4m3")
    # SGLang reads the file for fp8_e4m3 only (0.5.15 to 0.5.23): e5m2 would serve 1.0.
    with pytest.raises(ValueError, match="only with --kv-cache-dtype fp8_e4m3"):
        check_param_path_loaded({0: "default 1.0"}, "scales.json", 0, 1, "fp8_e5m2")


def test_the_launcher_reads_a_scales_file_as_sglang_does(tmp_path):
    """With SGLang's own loader, per tp rank: a file with tables for ranks 0 and 1 serves tp 2 and is refused at
    tp 3 (SGLang checks the file has one table per rank: every rank would get 1.0)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"model_type": "llama", "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {
        str(rank): {"0": 2.0, "1": 3.0} for rank in range(2)}}}))
    check_param_path_file(str(path), "fp8_e4m3", 2, str(tmp_path))
    with pytest.raises(ValueError, match="on tp rank 0 of 3"):
        check_param_path_file(str(path), "fp8_e4m3", 3, str(tmp_path))
    with pytest.raises(ValueError, match="SGLang ignores it for fp8_e5m2"):
        check_param_path_file(str(path), "fp8_e5m2", 2, str(tmp_path))
    check_param_path_file(None, "fp8_e4m3", 3, str(tmp_path))


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
