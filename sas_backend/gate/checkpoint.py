"""Gate checkpoints: save/load (canonical and SeerAttention-R), model fit, TP sharding, identity, init.

Canonical format (see gate_checkpoints/README.md): a directory with
- `config.json`: a `GateConfig` (sas_backend.gate.config);
- `gate.safetensors`: for every layer i in 0..L-1 the tensors
  `model.layers.{i}.self_attn.attn_gate.attngate_linear_q.weight [H_kv, G, D, Dg]`,
  `...attngate_linear_k.weight [H_kv, 3D, Dg]`, `...attngate_qnorm.weight [Dg]`,
  `...attngate_knorm.weight [Dg]`, all of the dtype named by `torch_dtype`.

In memory, tensors are `dict[int, dict[str, Tensor]]` (layer -> short name -> tensor), the short
names being `AttnGate.state_dict()` keys, so `gate.load_state_dict(tensors[i])` just works.

Every failure raises `GateCheckpointError` (a ValueError) naming the file and the problem.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from typing import Any, Mapping

import torch

from sas_backend.gate.config import GateConfig, dtype_from_name, dtype_name
from sas_backend.gate.errors import GateCheckpointError
from sas_backend.gate.module import AttnGate
from sas_backend.gate.seer_format import SEER_WEIGHTS, load_seer_checkpoint
from sas_backend.gate.tensors import LayerTensors, check_tensors, common_dtype, flatten, unflatten
from sas_backend.geometry import ModelGeometry, ModelGeometryError

__all__ = [
    "GateCheckpointError",
    "CANONICAL",
    "SEERATTENTION_R",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "detect_format",
    "save_gate_checkpoint",
    "load_gate_checkpoint",
    "validate_for_model",
    "validate_for_geometry",
    "tp_kv_head_range",
    "shard_for_tp",
    "sha256_file",
    "init_gate_state",
    "init_gate_checkpoint",
]

CANONICAL = "canonical"
SEERATTENTION_R = "seerattention-r"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "gate.safetensors"
_WEIGHTS_OF = {CANONICAL: WEIGHTS_FILE, SEERATTENTION_R: SEER_WEIGHTS}


# ---- format detection -----------------------------------------------------------------------


def _resolve_dir(path: str | os.PathLike) -> str:
    """A checkpoint directory, or a file inside one (gate.safetensors, attn_gate_weights.pth, config.json)."""
    p = os.fspath(path)
    if os.path.isfile(p) and os.path.basename(p) in (WEIGHTS_FILE, SEER_WEIGHTS, CONFIG_FILE):
        return os.path.dirname(os.path.abspath(p))
    if not os.path.exists(p):
        raise GateCheckpointError(f"{p}: no such gate checkpoint (directory or file)")
    if not os.path.isdir(p):
        raise GateCheckpointError(
            f"{p}: not a gate checkpoint directory (expected a directory with {CONFIG_FILE} + "
            f"{WEIGHTS_FILE}, or {CONFIG_FILE} + {SEER_WEIGHTS})"
        )
    return p


def detect_format(path: str | os.PathLike) -> str:
    """`"canonical"` if the directory has gate.safetensors, `"seerattention-r"` if it has
    attn_gate_weights.pth (canonical wins if both are present); otherwise GateCheckpointError."""
    d = _resolve_dir(path)
    if os.path.isfile(os.path.join(d, WEIGHTS_FILE)):
        return CANONICAL
    if os.path.isfile(os.path.join(d, SEER_WEIGHTS)):
        return SEERATTENTION_R
    try:
        found = sorted(os.listdir(d))
    except OSError:
        found = []
    raise GateCheckpointError(
        f"{d}: no gate weights found: expected {WEIGHTS_FILE} (canonical) or {SEER_WEIGHTS} "
        f"(SeerAttention-R); the directory holds {found[:10] or 'nothing'}"
    )


# ---- save / load ----------------------------------------------------------------------------


def _as_layer_tensors(gates: Any, source: str) -> LayerTensors:
    """dict[int, AttnGate] | dict[int, dict[str, Tensor]] | flat dict[str, Tensor] -> LayerTensors."""
    if not isinstance(gates, Mapping) or not gates:
        raise GateCheckpointError(f"{source}: nothing to save (expected a non-empty dict of layer gates)")
    if all(isinstance(k, str) for k in gates):
        return unflatten(gates, source)
    out: LayerTensors = {}
    for layer, g in gates.items():
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise GateCheckpointError(f"{source}: layer keys must be ints, got {layer!r}")
        if isinstance(g, torch.nn.Module):
            out[layer] = dict(g.state_dict())
        elif isinstance(g, Mapping):
            out[layer] = dict(g)
        else:
            raise GateCheckpointError(f"{source}: layer {layer} is a {type(g).__name__}, not an AttnGate or state dict")
    return out


def save_gate_checkpoint(
    path: str | os.PathLike,
    config: GateConfig,
    gates: Mapping,
    *,
    dtype: torch.dtype | str | None = None,
) -> GateConfig:
    """Write the canonical format (`config.json` + `gate.safetensors`) into directory `path`.

    gates: `{layer: AttnGate}`, `{layer: {short name: Tensor}}`, or a flat state dict with full
    keys. dtype: stored dtype (default: the tensors' own, which must then be uniform). The written
    config's `torch_dtype` is set to the stored dtype. Both files are written to temporary names
    and renamed, so a crash never leaves a half-written checkpoint under the final names.
    Returns the config as written.
    """
    out_dir = os.fspath(path)
    tensors = _as_layer_tensors(gates, out_dir)
    if dtype is None:
        target = common_dtype(tensors, out_dir)
    else:
        target = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
    name = dtype_name(target)
    tensors = {
        layer: {k: t.detach().to(device="cpu", dtype=target).contiguous().clone() for k, t in per.items()}
        for layer, per in tensors.items()
    }
    config = dataclasses.replace(config, torch_dtype=name, source=None)
    check_tensors(config, tensors, out_dir)

    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    final_w = os.path.join(out_dir, WEIGHTS_FILE)
    final_c = os.path.join(out_dir, CONFIG_FILE)
    fd, tmp_w = tempfile.mkstemp(prefix=".gate-", suffix=".safetensors.tmp", dir=out_dir)
    os.close(fd)
    fd, tmp_c = tempfile.mkstemp(prefix=".config-", suffix=".json.tmp", dir=out_dir)
    os.close(fd)
    try:
        # One metadata key only: safetensors writes a multi-key metadata map in arbitrary order,
        # which would make the file (and its sha256, the checkpoint identity) vary between saves.
        save_file(flatten(tensors), tmp_w, metadata={"format": "pt"})
        config.save_json(tmp_c)
        os.replace(tmp_w, final_w)
        os.replace(tmp_c, final_c)
    finally:
        for t in (tmp_w, tmp_c):
            if os.path.exists(t):
                os.unlink(t)
    return dataclasses.replace(config, source=out_dir)


def _load_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise GateCheckpointError(f"{path}: no such file")
    try:
        return load_file(path, device="cpu")
    except Exception as e:  # SafetensorError (truncated header/data), OSError, ...
        raise GateCheckpointError(
            f"{path}: cannot read safetensors file (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from e


def _load_canonical(d: str, config: GateConfig | None = None) -> tuple[GateConfig, LayerTensors]:
    """config: the checkpoint's config.json as already read (gate_file.GateFile), else read here."""
    cfg_path = os.path.join(d, CONFIG_FILE)
    w_path = os.path.join(d, WEIGHTS_FILE)
    if not os.path.isfile(cfg_path):
        raise GateCheckpointError(
            f"{cfg_path}: no such file (a canonical gate checkpoint needs it next to {WEIGHTS_FILE})")
    config = GateConfig.load_json(cfg_path) if config is None else config
    tensors = unflatten(_load_safetensors(w_path), w_path)
    check_tensors(config, tensors, w_path)
    stored = dtype_name(common_dtype(tensors, w_path))
    if stored != config.torch_dtype:
        raise GateCheckpointError(
            f"{w_path}: tensors are {stored} but {cfg_path} says torch_dtype {config.torch_dtype!r}"
        )
    config.source = d
    return config, tensors


def load_gate_checkpoint(path: str | os.PathLike) -> tuple[GateConfig, LayerTensors]:
    """Load a gate checkpoint of either format (autodetected, see `detect_format`).

    Returns `(config, tensors)` with tensors `{layer: {short name: Tensor}}` on CPU in the stored
    dtype, already checked: every layer present, shapes as the config implies, values finite.
    `config.source` is the checkpoint directory.
    """
    d = _resolve_dir(path)
    fmt = detect_format(d)
    if fmt == CANONICAL:
        return _load_canonical(d)
    return load_seer_checkpoint(d)






# ---- fit to the served model ----------------------------------------------------------------


def validate_for_model(
    config: GateConfig,
    tensors: LayerTensors | None,
    *,
    num_layers: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    gate_dim: int | None = None,
    rope_theta: float | None = None,
    rope_scaling: dict | None = None,
) -> None:
    """Refuse a checkpoint that does not fit the served model (full, unsharded geometry).

    Raises one GateCheckpointError naming every mismatch, e.g. "gate checkpoint X (base model M)
    was made for 32 layers / 8 kv heads / head dim 128; the served model has 30 layers / 3 kv heads
    / head dim 64". Checks layers, query heads, kv heads, head dim, block size, gate dim (when
    given) and, when `rope_theta` is given and the checkpoint records its model's RoPE, theta and
    scaling (`rope_scaling`: the served model's HF dict, None for plain RoPE): the gate's own RoPE
    table is built from them, so a gate trained under another RoPE would see rotated summaries it
    never saw in training. Then the tensors' own shapes against the served geometry.
    `validate_for_geometry` is the same check from a `ModelGeometry`.
    """
    name = config.source or "<in memory>"
    if config.base_model:
        name += f" (base model {config.base_model})"
    made: list[str] = []
    served: list[str] = []

    def cmp(have: Any, want: Any, fmt: str) -> None:
        if have != want:
            made.append(fmt.format(have))
            served.append(fmt.format(want))

    cmp(config.num_hidden_layers, num_layers, "{} layers")
    cmp(config.num_attention_heads, num_q_heads, "{} query heads")
    cmp(config.num_key_value_heads, num_kv_heads, "{} kv heads")
    cmp(config.head_dim, head_dim, "head dim {}")
    cmp(config.block_size, block_size, "block size {}")
    if gate_dim is not None:
        cmp(config.gate_dim, gate_dim, "gate dim {}")
    rope_differs = False
    if rope_theta is not None and config.rope_theta is not None:
        if abs(float(config.rope_theta) - float(rope_theta)) > 1e-6 * max(1.0, abs(float(rope_theta))):
            made.append(f"rope theta {config.rope_theta:g}")
            served.append(f"rope theta {float(rope_theta):g}")
            rope_differs = True
        if _scaling_key(config.rope_scaling) != _scaling_key(rope_scaling):
            made.append(f"rope scaling {_describe_scaling(config.rope_scaling)}")
            served.append(f"rope scaling {_describe_scaling(rope_scaling)}")
            rope_differs = True
    if made:
        msg = f"gate checkpoint {name} was made for {' / '.join(made)}; the served model has {' / '.join(served)}"
        if any(m.startswith("block size") for m in made):
            msg += (
                f" (the gate pools blocks of {config.block_size} tokens; serve with page/block size "
                f"{config.block_size} or use a gate trained for block size {block_size})"
            )
        if rope_differs:
            msg += " (the gate rotates its query and block summaries with its model's RoPE; train a gate on this model)"
        raise GateCheckpointError(msg)
    if tensors is not None:
        served_cfg = dataclasses.replace(
            config,
            num_hidden_layers=num_layers,
            num_attention_heads=num_q_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
        )
        check_tensors(served_cfg, tensors, f"gate checkpoint {name} (checked against the served model)")



def validate_for_geometry(
    config: GateConfig, tensors: LayerTensors | None, geometry: ModelGeometry, *, block_size: int
) -> None:
    """`validate_for_model` against a served model's `ModelGeometry`: layers, heads, head dim,
    block size, RoPE theta and scaling. The one "does this gate fit this model" check of the
    server, the launcher, the default-gate picker and the trainers."""
    validate_for_model(
        config,
        tensors,
        num_layers=geometry.num_layers,
        num_q_heads=geometry.num_q_heads,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        block_size=block_size,
        rope_theta=geometry.rope_theta,
        rope_scaling=geometry.rope_scaling,
    )


def _scaling_key(scaling: Mapping | None) -> tuple:
    """A RoPE scaling dict, comparable: "default" is plain RoPE (None), `type` is `rope_type`, and
    the theta (compared on its own) and unset keys drop out."""
    if not scaling:
        return ()
    d = {("rope_type" if k == "type" else k): v for k, v in scaling.items() if v is not None and k != "rope_theta"}
    if d.get("rope_type", "default") == "default":
        return ()
    # JSON may give 4 or 4.0 for the same factor
    num = lambda v: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v  # noqa: E731
    return tuple(sorted((k, repr(num(v))) for k, v in d.items()))


def _describe_scaling(scaling: Mapping | None) -> str:
    key = _scaling_key(scaling)
    return "none" if not key else "{" + ", ".join(f"{k}: {v}" for k, v in key) + "}"

# ---- tensor parallelism ---------------------------------------------------------------------


def tp_kv_head_range(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """`(first kv head, count)` held by `tp_rank`, as SGLang's QKVParallelLinear places kv heads.

    tp_size >= H_kv: each rank holds ONE kv head, replicated over tp_size / H_kv ranks:
    head `tp_rank * H_kv // tp_size`. Otherwise contiguous slices of H_kv / tp_size heads.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise GateCheckpointError(f"invalid tensor-parallel rank {tp_rank} of size {tp_size}")
    if tp_size >= num_kv_heads:
        if tp_size % num_kv_heads:
            raise GateCheckpointError(
                f"tensor-parallel size {tp_size} is not a multiple of the {num_kv_heads} kv heads"
            )
        return tp_rank * num_kv_heads // tp_size, 1
    if num_kv_heads % tp_size:
        raise GateCheckpointError(f"{num_kv_heads} kv heads do not divide over tensor-parallel size {tp_size}")
    per = num_kv_heads // tp_size
    return tp_rank * per, per


def shard_for_tp(tensors: LayerTensors, tp_rank: int, tp_size: int) -> LayerTensors:
    """This rank's gate tensors: `linear_q [H_kv, G, D, Dg]` / `linear_k [H_kv, 3D, Dg]` sliced
    along the kv-head axis (dim 0) like the model's kv heads (`tp_kv_head_range`); the norms
    `[Dg]` replicated (same tensor objects).

    Note on replication (tp_size > H_kv): the rank keeps the full `[1, G, D, Dg]` query projection
    of its kv head, but holds only H_q / tp_size of that group's G query heads; the gate query
    needs all G, so the backend must gather the group's q (or all-reduce partial projections over
    the replica ranks) before using it.
    """
    if not tensors:
        raise GateCheckpointError("shard_for_tp: no gate tensors")
    first = tensors[min(tensors)]
    num_kv = int(first["attngate_linear_q.weight"].shape[0])
    start, count = tp_kv_head_range(num_kv, tp_rank, tp_size)
    out: LayerTensors = {}
    for layer, per in tensors.items():
        out[layer] = {}
        for name, t in per.items():
            if name in ("attngate_linear_q.weight", "attngate_linear_k.weight"):
                if t.shape[0] != num_kv:
                    raise GateCheckpointError(
                        f"shard_for_tp: layer {layer} {name} has {t.shape[0]} kv heads, "
                        f"layer {min(tensors)} has {num_kv}"
                    )
                out[layer][name] = t.narrow(0, start, count).contiguous()
            else:
                out[layer][name] = t
    return out


# ---- identity -------------------------------------------------------------------------------


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks (a gate checkpoint's identity)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()






def _geometry_of(model_dir: Any, geometry: Any) -> ModelGeometry:
    if (model_dir is None) == (geometry is None):
        raise GateCheckpointError("give exactly one of model_dir= or geometry=")
    try:
        if model_dir is not None:
            return ModelGeometry.from_model_dir(model_dir)
        if isinstance(geometry, ModelGeometry):
            return geometry
        return ModelGeometry.from_hf_config(geometry)
    except ModelGeometryError as e:
        raise GateCheckpointError(str(e)) from e


def init_gate_state(
    geometry: ModelGeometry,
    *,
    seed: int,
    gate_dim: int = 128,
    block_size: int = 64,
    dtype: torch.dtype | str = torch.float32,
) -> tuple[GateConfig, LayerTensors]:
    """Seeded-init gates in memory: one `torch.Generator().manual_seed(seed)` drives
    `AttnGate.reset_parameters(generator=...)` for layers 0..L-1 in order (fp32, then cast to
    `dtype`). The global torch RNG is left untouched. Same seed + geometry -> same tensors."""
    target = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    tensors: LayerTensors = {}
    with torch.random.fork_rng(devices=[]):
        for layer in range(geometry.num_layers):
            gate = AttnGate(geometry.num_kv_heads, geometry.group_size, geometry.head_dim, gate_dim)
            gate.reset_parameters(generator=gen)
            tensors[layer] = {k: v.detach().to(target).clone() for k, v in gate.state_dict().items()}
    config = GateConfig.from_geometry(
        geometry,
        block_size=block_size,
        gate_dim=gate_dim,
        torch_dtype=dtype_name(target),
        training={
            "objective": "none (seeded init, untrained)",
            "init": {
                "seed": int(seed),
                "method": "AttnGate.reset_parameters with torch.Generator().manual_seed(seed), layers in order",
            },
            "steps": 0,
        },
    )
    return config, tensors


def init_gate_checkpoint(
    path: str | os.PathLike,
    *,
    model_dir: str | os.PathLike | None = None,
    geometry: ModelGeometry | Mapping | None = None,
    seed: int,
    gate_dim: int = 128,
    block_size: int = 64,
    dtype: torch.dtype | str = torch.float32,
) -> GateConfig:
    """Write a seeded-init canonical checkpoint for the model in `model_dir` (its config.json) or
    for `geometry` (a ModelGeometry or an HF config dict). Returns the written config."""
    geom = _geometry_of(model_dir, geometry)
    config, tensors = init_gate_state(geom, seed=seed, gate_dim=gate_dim, block_size=block_size, dtype=dtype)
    return save_gate_checkpoint(path, config, tensors)
