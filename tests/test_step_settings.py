"""The decode step's settings: launch flags and SAS_* variables win, "auto" reads the GPU settings table on
CUDA (the longest device key that the device name contains, else "default"), CPU has its own defaults, and
the table the GPU benchmark writes (`gpu_kit/bench_decode_step.chosen_settings`) is one the backend reads."""

import json

import pytest
import torch

from sas_backend.backend.step_settings import TABLE, resolve, table_entry
from sas_backend.config import SASConfig, SASConfigError
from sas_backend.ops.fused_step import LaunchOptions


def _cfg(**kw):
    return SASConfig(gate_path="unused", budget=2048, **kw).validate()


TABLE_H = {"measured": True, "devices": {
    "default": {"kernels": "triton", "attention": "triton", "summary_dtype": "fp32", "dense_below": 0},
    "H200": {"kernels": "triton", "attention": "flashinfer", "summary_dtype": "bf16", "gate_dtype": "bf16",
             "select_chunk": 256, "target_programs": 528, "dense_below": 4096,
             "launch": {"pdl": True, "attend_warps": 8}}}}


def test_shipped_table_parses_and_says_whether_it_was_measured():
    table = json.loads(TABLE.read_text())
    entry, source = table_entry("NVIDIA H100 80GB HBM3", table)
    assert entry == table["devices"]["default"] and "default" in source
    assert ("not yet measured" in source) == (not table["measured"])


def test_sub_block_summaries_take_the_fused_kernels():
    """The fused front and select summarize and score sub-block runs (ops.fused_step, StepGeometry.sub_blocks):
    --sas-sub-blocks keeps the table's fused path on CUDA, and an explicit --sas-kernels triton is accepted."""
    for sub in (1, 4):
        s = resolve(_cfg(sub_blocks=sub), torch.device("cuda"), "NVIDIA H200", TABLE_H)
        assert s.kernels == "triton"
    assert resolve(_cfg(sub_blocks=4, kernels="triton"), torch.device("cpu")).kernels == "triton"
    assert resolve(_cfg(sub_blocks=4, selector="quest"), torch.device("cuda"), "NVIDIA H200", TABLE_H).kernels == \
        "torch"  # quest's runs stay per op


def test_auto_follows_the_table_on_cuda_and_flags_win():
    s = resolve(_cfg(), torch.device("cuda"), "NVIDIA H200", TABLE_H)
    assert (s.kernels, s.attention, s.summary_dtype, s.select_chunk, s.target_programs, s.dense_below) == \
        ("triton", "flashinfer", torch.bfloat16, 256, 528, 4096)
    s = resolve(_cfg(attention="triton", summary_dtype="fp32", dense_below=100), "cuda", "NVIDIA H200", TABLE_H)
    assert (s.attention, s.summary_dtype, s.dense_below) == ("triton", torch.float32, 100)
    assert resolve(_cfg(), "cuda", "NVIDIA H100", TABLE_H).attention == "triton"  # no H100 key: the default


def test_gate_dtype_and_launch_options_come_from_the_table_on_cuda_only():
    s = resolve(_cfg(), "cuda", "NVIDIA H200", TABLE_H)
    assert s.gate_dtype == torch.bfloat16 and s.launch == LaunchOptions(pdl=True, attend_warps=8)
    d = resolve(_cfg(), "cuda", "NVIDIA H100", TABLE_H)  # the default entry names neither
    assert d.gate_dtype == torch.float32 and d.launch == LaunchOptions()
    assert resolve(_cfg(gate_dtype="fp32"), "cuda", "NVIDIA H200", TABLE_H).gate_dtype == torch.float32
    c = resolve(_cfg(), "cpu", "", TABLE_H)
    assert c.gate_dtype == torch.float32 and c.launch == LaunchOptions()
    # The table's bf16 gate is the fused front's: the per-op path reads fp32, and asking for bf16 there is refused.
    assert resolve(_cfg(kernels="torch"), "cuda", "NVIDIA H200", TABLE_H).gate_dtype == torch.float32
    with pytest.raises(SASConfigError, match="--sas-kernels triton"):
        resolve(_cfg(kernels="torch", gate_dtype="bf16"), "cuda", "NVIDIA H200", TABLE_H)
    with pytest.raises(SASConfigError, match="must be one of"):
        _cfg(gate_dtype="fp16")
    with pytest.raises(ValueError, match="attend_warps"):
        resolve(_cfg(), "cuda", "H200", {"devices": {"default": {"launch": {"attend_warps": 3}}}})


def test_cpu_defaults_and_refusals():
    s = resolve(_cfg(), torch.device("cpu"), "", TABLE_H)
    assert (s.kernels, s.attention, s.summary_dtype) == ("torch", "torch", torch.float32)
    s = resolve(_cfg(kernels="triton"), "cpu", "", TABLE_H)
    assert (s.kernels, s.attention) == ("triton", "triton")
    with pytest.raises(SASConfigError, match="needs a CUDA device"):
        resolve(_cfg(attention="flashinfer"), "cpu", "")
    with pytest.raises(SASConfigError, match="must be one of"):
        _cfg(kernels="cuda")
    with pytest.raises(SASConfigError, match="selector runs with --sas-kernels torch"):
        SASConfig(selector="quest", budget=2048, kernels="triton").validate()
    # training-free selectors on CUDA: the table's fused kernels are the gate's, they run per op
    assert resolve(SASConfig(selector="quest", budget=2048).validate(), "cuda", "H200", TABLE_H).kernels == "torch"


def test_dense_below_defaults_per_device_and_an_explicit_zero_wins():
    """Issue 64 item 7, CPU half: unset, a CPU server attends densely up to budget + CPU_DENSE_MARGIN tokens (the
    measured batch-1 crossover), none with force_sparse; CUDA takes the table's; an explicit 0 means never on
    both (before, 0 could not be told from unset and fell back to the table)."""
    from sas_backend.config import CPU_DENSE_MARGIN

    assert resolve(_cfg(), "cpu", "", TABLE_H).dense_below == 2048 + CPU_DENSE_MARGIN
    assert resolve(SASConfig(gate_path="u", budget=512).validate(), "cpu", "").dense_below == 512 + CPU_DENSE_MARGIN
    assert resolve(_cfg(force_sparse=1), "cpu", "").dense_below == 0
    assert resolve(_cfg(dense_below=0), "cpu", "").dense_below == 0
    assert resolve(_cfg(dense_below=700), "cpu", "").dense_below == 700
    assert resolve(_cfg(), "cuda", "NVIDIA H200", TABLE_H).dense_below == 4096
    assert resolve(_cfg(dense_below=0), "cuda", "NVIDIA H200", TABLE_H).dense_below == 0
    assert SASConfig.from_env({"SAS_DENSE_BELOW": "0"}).dense_below == 0
    assert SASConfig.from_env({}).dense_below is None


def test_the_benchmarks_chosen_settings_are_a_table_the_backend_reads():
    import bench_decode_step as bds

    rows = []
    for ctx, dense in ((8192, 1.0), (65536, 4.0)):
        ok = {"check": {"ok": True}}  # only variants checked after their timed replays compete (issue 64 item 3)
        variants = {v.name: {"amortized_ms": 2.0 if ctx == 8192 else 1.0, "speedup": dense / 1.0, **ok}
                    for v in bds.VARIANTS}
        variants[bds.VARIANTS[2].name] = {"amortized_ms": 0.5, "speedup": dense / 0.5, **ok}  # bf16 summaries win
        rows.append({"context": ctx, "batch": 1, "dense_ms": dense, "variants": {"2048": variants}})
    record = {"budgets": [1024, 2048, 4096], "rows": rows, "mode": "full", "environment": {"device": "NVIDIA H200"}}
    chosen = bds.chosen_settings(record, "H200")
    assert chosen["measured"] is True
    assert chosen["devices"]["H200"]["summary_dtype"] == "bf16" and chosen["devices"]["H200"]["dense_below"] == 0
    s = resolve(_cfg(), "cuda", "NVIDIA H200", chosen)
    assert s.summary_dtype == torch.bfloat16 and s.kernels == "triton"
    # Every variant's entry is one the backend resolves (its launch options and gate dtype included).
    for v in bds.VARIANTS:
        entry = {**v.settings(), "dense_below": 0}
        s = resolve(_cfg(), "cuda", "NVIDIA H200", {"devices": {"default": entry}})
        assert s.launch == v.launch_options() and str(s.gate_dtype).endswith(v.gate_dtype.replace("bf", "bfloat")
                                                                               .replace("fp", "float")), v
