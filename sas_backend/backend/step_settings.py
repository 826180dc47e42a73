"""The decode step's GPU settings: a small table a GPU measurement writes, read once at startup.

`gpu_settings.json` (beside this file) maps a device name (a substring of `torch.cuda.get_device_name()`,
e.g. "H200") or "default" to the settings the decode-step tournament chose (`gpu_kit/run.py session`
writes `chosen-settings.json` in this format): kernels, attention path, summary dtype, the dtype the fused front
reads the gate weights in, select chunk, programs per launch at batch 1, PDL and per-launch warps (`launch`:
`ops.fused_step.LaunchOptions`' fields), `--sas-dense-below`. Adopting a new measurement is a data change: copy the
file here. `"measured": false` says the values are still the pre-measurement expectation.

Launch flags and `SAS_*` variables win over the table; on CPU the table is not read.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Optional, Union

import torch

from sas_backend import config
from sas_backend.ops.fused_step import LaunchOptions
from sas_backend.selection import selector_class

TABLE = pathlib.Path(__file__).with_name("gpu_settings.json")
# What the launch's settings resolve to (config's choices less "auto"; attention "torch" is what "auto" becomes
# on CPU, where FlashInfer does not run).
KERNELS = tuple(k for k in config.KERNELS if k != "auto")
ATTENTIONS = (*(a for a in config.ATTENTIONS if a != "auto"), "torch")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """Resolved decode-step settings of one server. kernels: "triton" | "torch"; attention: "triton" |
    "flashinfer" | "torch"; summary_dtype: torch dtype of the summary pool; gate_dtype: what the fused front
    reads the gate weights in; select_chunk (one chunk, or a per-batch-size rule {min_bs: chunk}: `ops.fused_step.
    select_chunk_rule`), target_programs: the fused launches' split sizes (None:
    `ops.fused_step` defaults); launch: their `LaunchOptions` (PDL, warps); dense_below: tokens; source: where
    they came from (for the log and /sas/info)."""

    kernels: str = "torch"
    attention: str = "torch"
    summary_dtype: torch.dtype = torch.float32
    select_chunk: Optional[Union[int, dict]] = None
    target_programs: Optional[int] = None
    dense_below: int = 0
    source: str = "given"
    gate_dtype: torch.dtype = torch.float32
    launch: LaunchOptions = LaunchOptions()

    def check(self, device, selector) -> "StepSettings":
        """The cross-field rules a decode step relies on (ValueError naming the rule); returns self.
        device: where the step runs; selector: a `sas_backend.selection.Selector`."""
        if self.kernels not in KERNELS or self.attention not in ATTENTIONS:
            raise ValueError(f"kernels must be one of {KERNELS}, attention one of {ATTENTIONS}")
        if self.attention == "flashinfer" and torch.device(device).type != "cuda":
            raise ValueError("the flashinfer attention path needs CUDA")
        if self.kernels == "triton" and not selector.fused_kernels:
            raise ValueError(f"the fused kernels compute the gate's query and summaries; the {selector.name} "
                             "selector runs the per-op path (kernels='torch')")
        if self.gate_dtype not in (torch.float32, torch.bfloat16) or (
                self.gate_dtype != torch.float32 and self.kernels != "triton"):
            raise ValueError(f"gate_dtype {self.gate_dtype} needs kernels='triton' (only the fused front reads a "
                             "copy)")
        if self.dense_below < 0:
            raise ValueError(f"dense_below {self.dense_below} must be >= 0")
        return self


def table_entry(device_name: str, table: Optional[dict] = None) -> tuple[dict, str]:
    """(settings, key) for a device name: the longest matching device key, else "default"."""
    table = json.loads(TABLE.read_text()) if table is None else table
    devices = table["devices"]
    keys = sorted((k for k in devices if k != "default" and k in device_name), key=len, reverse=True)
    key = keys[0] if keys else "default"
    measured = "measured" if table.get("measured") else "not yet measured"
    return devices[key], f"{TABLE.name}[{key}] ({measured})"


def resolve(cfg, device: torch.device, device_name: str = "", table: Optional[dict] = None) -> StepSettings:
    """The settings one server runs with: cfg's explicit values (flags, SAS_* variables), the table's for
    "auto" on CUDA, the CPU defaults otherwise. cfg: a validated `SASConfig`."""
    cuda = torch.device(device).type == "cuda"
    entry, source = table_entry(device_name, table) if cuda else ({}, "CPU defaults")
    fused = selector_class(cfg.selector).fused_kernels
    kernels = cfg.kernels if cfg.kernels != "auto" else (entry.get("kernels", "triton") if cuda and fused else "torch")
    if kernels == "triton" and not fused:
        kernels = "torch"  # the table's choice covers the selectors with fused kernels; the others run per op
    if cfg.attention != "auto":
        attention = cfg.attention
    elif cuda:
        attention = entry.get("attention", "triton")
    else:
        attention = "triton" if kernels == "triton" else "torch"
    if attention == "flashinfer" and not cuda:
        from sas_backend.config import SASConfigError

        raise SASConfigError("--sas-attention flashinfer needs a CUDA device; on CPU use triton (under "
                             "TRITON_INTERPRET=1) or leave it to auto")
    dtype = cfg.summary_dtype
    if dtype == "auto":
        dtype = entry.get("summary_dtype", "fp32") if cuda else "fp32"
    gate_dtype = cfg.gate_dtype if cfg.gate_dtype != "auto" else (entry.get("gate_dtype", "fp32") if cuda else "fp32")
    if gate_dtype == "bf16" and kernels != "triton":
        if cfg.gate_dtype == "bf16":
            from sas_backend.config import SASConfigError

            raise SASConfigError("--sas-gate-dtype bf16 is what the fused front kernel reads (--sas-kernels triton); "
                                 f"the decode step here runs the {kernels} path, which reads the gate in fp32")
        gate_dtype = "fp32"  # the table's choice is for the fused front
    if cfg.dense_below is not None:  # the launch's, 0 (never) included
        dense_below = cfg.dense_below
    elif cuda:
        dense_below = int(entry.get("dense_below", 0) or 0)
    else:  # CPU: where a sparse step stops being slower than dense at batch 1 (config.CPU_DENSE_MARGIN)
        from sas_backend.config import CPU_DENSE_MARGIN, DEFAULT_BUDGET

        dense_below = 0 if cfg.force_sparse else (cfg.budget or DEFAULT_BUDGET) + CPU_DENSE_MARGIN
    launch = LaunchOptions(**(entry.get("launch") or {})).check() if cuda else LaunchOptions()
    return StepSettings(kernels, attention, _DTYPES[dtype], entry.get("select_chunk"), entry.get("target_programs"),
                        dense_below, source, _DTYPES[gate_dtype], launch)


def device_name(device) -> str:
    """The CUDA device's name (the table's key), "" elsewhere or where CUDA cannot be queried (tests on a
    CPU machine stand a CUDA device in)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return ""
    return torch.cuda.get_device_name(device)
