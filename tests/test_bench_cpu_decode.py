"""bench/bench_cpu_decode.py's server keys and byte model (its servers run in the benchmark, not here)."""

from __future__ import annotations

import pytest

GEO = {"layers": 30, "kv_heads": 3, "head_dim": 64, "params": 134515008, "gate_q_params": 2215680, "gate_dim": 128,
       "bytes_per_elem": 4}


def test_keys_name_every_setting_and_its_flags():
    from bench_cpu_decode import key_flags, key_label, key_setting, sas_keys

    assert sas_keys([512], 1) == ["512"]
    assert sas_keys([512, 1024], 2) == ["512", "1024", "512r2", "1024r2"]
    keys = sas_keys([512], 2, 4)
    assert keys == ["512", "512r2", "512s4", "512s4r2"]
    assert [key_setting(k) for k in keys] == [(512, 1, 1), (512, 2, 1), (512, 1, 4), (512, 2, 4)]
    assert key_flags("512s4r2") == ["--sas-sub-blocks", "4", "--sas-exact-rerank", "2"] and key_flags("512") == []
    assert key_label("512s4r2") == "b512 sub-blocks 4 rerank 2"
    with pytest.raises(ValueError, match="not a sas server key"):
        key_setting("512x")


def test_step_bytes_count_run_summaries_and_reranked_keys():
    from bench_cpu_decode import BLOCK, step_bytes

    ctx, budget = 7680.0, 512
    one, runs, both = (step_bytes(GEO, ctx, 1, budget, r, n) for r, n in ((1, 1), (1, 4), (2, 4)))
    summary_bytes = GEO["layers"] * GEO["kv_heads"] * int(ctx // BLOCK) * GEO["gate_dim"] * 4
    assert runs - one == pytest.approx(3 * summary_bytes)  # 4 run summaries a block instead of 1
    per_token_kv = GEO["layers"] * GEO["kv_heads"] * GEO["head_dim"] * 2 * 4
    assert both - runs == pytest.approx(2 * (budget // BLOCK) * BLOCK * per_token_kv / 2)  # the keys of 2 x K blocks
    assert step_bytes(GEO, 300.0, 1, budget, 2, 4) == step_bytes(GEO, 300.0, 1, None)  # covered: read as dense
