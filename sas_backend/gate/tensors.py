"""Per-layer gate tensors: flat-key parsing, flattening, and checks against a `GateConfig`.

In memory a checkpoint's tensors are `dict[int, dict[str, Tensor]]`: layer index -> short name
(`attngate_linear_q.weight` ...) -> tensor, the same short names as `AttnGate.state_dict()`.
On disk they are flat: `model.layers.{i}.self_attn.attn_gate.{short name}`.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from sas_backend.gate.config import KEY_TEMPLATE, PARAM_NAMES, GateConfig
from sas_backend.gate.errors import GateCheckpointError

LayerTensors = dict[int, dict[str, torch.Tensor]]

_KEY_RE = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\.attn_gate\."
    r"(attngate_linear_q\.weight|attngate_linear_k\.weight|attngate_qnorm\.weight|attngate_knorm\.weight)$"
)

_SHAPE_LEGEND = {
    "attngate_linear_q.weight": "[H_kv, G, D, Dg]",
    "attngate_linear_k.weight": "[H_kv, 3D, Dg]",
    "attngate_qnorm.weight": "[Dg]",
    "attngate_knorm.weight": "[Dg]",
}


def _fmt_keys(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


def flatten(tensors: LayerTensors) -> dict[str, torch.Tensor]:
    """`{layer: {name: t}}` -> `{"model.layers.{layer}.self_attn.attn_gate.{name}": t}`."""
    return {
        KEY_TEMPLATE.format(layer=layer, name=name): t
        for layer in sorted(tensors)
        for name, t in tensors[layer].items()
    }


def unflatten(flat: Mapping[str, object], source: str, *, strip_prefix: str = "") -> LayerTensors:
    """Flat checkpoint keys -> `{layer: {name: tensor}}`.

    `strip_prefix` is removed from keys that start with it (e.g. `"module."` of a DDP state dict).
    Any key that is not a gate tensor, or a value that is not a tensor, is an error naming `source`.
    """
    out: LayerTensors = {}
    unknown: list[str] = []
    for key, value in flat.items():
        k = key[len(strip_prefix):] if strip_prefix and isinstance(key, str) and key.startswith(strip_prefix) else key
        m = _KEY_RE.match(k) if isinstance(k, str) else None
        if m is None:
            unknown.append(repr(key))
            continue
        if not isinstance(value, torch.Tensor):
            raise GateCheckpointError(f"{source}: {key} is a {type(value).__name__}, not a tensor")
        out.setdefault(int(m.group(1)), {})[m.group(2)] = value
    if unknown:
        raise GateCheckpointError(
            f"{source}: {len(unknown)} key(s) are not gate tensors "
            f"(expected model.layers.<i>.self_attn.attn_gate.<{'|'.join(PARAM_NAMES)}>): {_fmt_keys(unknown)}"
        )
    if not out:
        raise GateCheckpointError(f"{source}: holds no gate tensors")
    return out


def check_tensors(config: GateConfig, tensors: LayerTensors, source: str) -> None:
    """Every layer 0..L-1 present (no others), the four tensors each with the shapes implied by
    `config`, all finite. Raises one GateCheckpointError listing the problems found."""
    problems: list[str] = []
    want_layers = set(range(config.num_hidden_layers))
    have = set(tensors)
    missing = sorted(want_layers - have)
    extra = sorted(have - want_layers)
    if missing:
        problems.append(
            f"missing layer(s) {_fmt_keys([str(i) for i in missing], 8)} "
            f"(config says num_hidden_layers={config.num_hidden_layers})"
        )
    if extra:
        problems.append(
            f"unexpected layer(s) {_fmt_keys([str(i) for i in extra], 8)} "
            f"(config says num_hidden_layers={config.num_hidden_layers}, layers 0..{config.num_hidden_layers - 1})"
        )
    shapes = config.tensor_shapes()
    for layer in sorted(have & want_layers):
        per = tensors[layer]
        absent = [n for n in PARAM_NAMES if n not in per]
        if absent:
            problems.append(f"layer {layer} lacks {', '.join(absent)}")
        odd = [n for n in per if n not in shapes]
        if odd:
            problems.append(f"layer {layer} has unknown tensor(s) {', '.join(odd)}")
        for name, want in shapes.items():
            t = per.get(name)
            if t is None:
                continue
            if tuple(t.shape) != want:
                hint = ""
                if name == "attngate_linear_q.weight" and t.dim() == 3:
                    hint = " (a 3-d linear_q is a 'Qavgproj' gate, which is not supported)"
                problems.append(
                    f"layer {layer} {name} has shape {list(t.shape)}, expected {list(want)} "
                    f"{_SHAPE_LEGEND[name]}{hint}"
                )
            elif not t.is_floating_point():
                problems.append(f"layer {layer} {name} has non-float dtype {t.dtype}")
            elif not bool(torch.isfinite(t).all()):
                n_bad = int((~torch.isfinite(t)).sum())
                problems.append(f"layer {layer} {name} has {n_bad} non-finite value(s) (NaN/Inf)")
        if len(problems) > 12:
            break
    if problems:
        more = " ..." if len(problems) > 12 else ""
        raise GateCheckpointError(
            f"{source}: gate tensors do not match the gate config ({config.describe()}): "
            + "; ".join(problems[:12]) + more
        )


def common_dtype(tensors: LayerTensors, source: str) -> torch.dtype:
    """The single dtype of all tensors; a checkpoint mixing dtypes is an error."""
    dtypes = {t.dtype for per in tensors.values() for t in per.values()}
    if len(dtypes) != 1:
        raise GateCheckpointError(f"{source}: gate tensors mix dtypes {sorted(str(d) for d in dtypes)}")
    return dtypes.pop()
