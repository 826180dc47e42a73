"""Write a seeded-init (untrained) gate checkpoint for a model.

    python -m sas_backend.gate.init --model MODEL_DIR --seed N DST [--gate-dim 128] [--block-size 64]
                                    [--dtype float32]

The same seed and model give bit-identical tensors (see `init_gate_state`), so tests and the
trainer can start from the same init.
"""

from __future__ import annotations

import argparse
import sys

from sas_backend.gate.checkpoint import GateCheckpointError, init_gate_checkpoint
from sas_backend.gate.gate_file import checkpoint_identity
from sas_backend.gate.config import SUPPORTED_DTYPES


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sas_backend.gate.init",
        description="Write a seeded-init canonical gate checkpoint (config.json + gate.safetensors).",
    )
    p.add_argument("dst", help="destination directory")
    p.add_argument("--model", required=True, help="Hugging Face model directory (its config.json gives the geometry)")
    p.add_argument("--seed", type=int, required=True, help="seed of the torch.Generator driving the init")
    p.add_argument("--gate-dim", type=int, default=128, help="gate dim Dg (default 128)")
    p.add_argument("--block-size", type=int, default=64, help="block size in tokens (default 64)")
    p.add_argument("--dtype", choices=sorted(SUPPORTED_DTYPES), default="float32",
                   help="stored dtype (default float32)")
    args = p.parse_args(argv)
    try:
        init_gate_checkpoint(args.dst, model_dir=args.model, seed=args.seed, gate_dim=args.gate_dim,
                             block_size=args.block_size, dtype=args.dtype)
        ident = checkpoint_identity(args.dst)
    except GateCheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {ident['path']}/config.json and {ident['weights_file']}  sha256 {ident['sha256']}")
    print(
        f"  seed {args.seed}, base_model {ident['base_model']}: {ident['layers']} layers, "
        f"{ident['num_key_value_heads']} kv heads, head dim {ident['head_dim']}, gate dim {ident['gate_dim']}, "
        f"block size {ident['block_size']}, {ident['torch_dtype']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
