"""Convert a gate checkpoint to the canonical format.

    python -m sas_backend.gate.convert SRC DST [--dtype float32|bfloat16|float16] [--base-model NAME]

SRC: a SeerAttention-R gate directory (config.json + attn_gate_weights.pth, read with
torch.load(weights_only=True)) or a canonical one (config.json + gate.safetensors, re-saved, e.g.
with another --dtype). DST: the canonical directory to write (config.json + gate.safetensors).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from sas_backend.gate.checkpoint import (
    GateCheckpointError,
    detect_format,
    load_gate_checkpoint,
    save_gate_checkpoint,
)
from sas_backend.gate.config import SUPPORTED_DTYPES
from sas_backend.gate.gate_file import checkpoint_identity


def convert(src: str, dst: str, *, dtype: str | None = None, base_model: str | None = None,
            force: bool = False) -> dict:
    """Load `src` (either format), write canonical `dst`; returns dst's `checkpoint_identity`."""
    if os.path.abspath(src) == os.path.abspath(dst):
        raise GateCheckpointError(f"{dst}: destination is the source directory; write elsewhere")
    if os.path.exists(os.path.join(dst, "gate.safetensors")) and not force:
        raise GateCheckpointError(f"{dst}: already holds a gate checkpoint (pass --force to overwrite)")
    fmt = detect_format(src)
    config, tensors = load_gate_checkpoint(src)
    training = dict(config.training)
    training["converted_from"] = {"format": fmt, "path": os.path.abspath(src)}
    config = dataclasses.replace(config, training=training)
    if base_model:
        config = dataclasses.replace(config, base_model=base_model)
    save_gate_checkpoint(dst, config, tensors, dtype=dtype)
    return checkpoint_identity(dst)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sas_backend.gate.convert",
        description="Convert a SeerAttention-R gate (config.json + attn_gate_weights.pth) or re-save a "
        "canonical one (config.json + gate.safetensors) as a canonical SAS gate checkpoint.",
    )
    p.add_argument("src", help="source checkpoint directory (either format)")
    p.add_argument("dst", help="destination directory (canonical format)")
    p.add_argument("--dtype", choices=sorted(SUPPORTED_DTYPES), default=None,
                   help="stored dtype of the tensors (default: keep the source dtype)")
    p.add_argument("--base-model", default=None, help="override the base_model recorded in the config")
    p.add_argument("--force", action="store_true", help="overwrite an existing checkpoint at DST")
    args = p.parse_args(argv)
    try:
        ident = convert(args.src, args.dst, dtype=args.dtype, base_model=args.base_model, force=args.force)
    except GateCheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {os.path.join(ident['path'], 'config.json')}")
    print(f"wrote {os.path.join(ident['path'], ident['weights_file'])}  sha256 {ident['sha256']}")
    print(
        f"  base_model {ident['base_model']}: {ident['layers']} layers, {ident['num_attention_heads']} query / "
        f"{ident['num_key_value_heads']} kv heads, head dim {ident['head_dim']}, gate dim {ident['gate_dim']}, "
        f"block size {ident['block_size']}, {ident['torch_dtype']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
