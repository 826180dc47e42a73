"""Print the gate checkpoint the default serve command uses for a model directory.

The gate shipped under gate_checkpoints/ that fits the model and block size (the server's own
check, `validate_for_geometry`: layers, heads, head dim, block size, RoPE theta and scaling; an
SAS-trained one, objective "lm", before any other); otherwise a seeded-init gate (same code path,
untrained selection) made once under models/gates/.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def shipped_gate(geometry, block_size: int, root: pathlib.Path = REPO / "gate_checkpoints") -> pathlib.Path | None:
    """The checkpoint directory under `root` that fits `geometry` (a `ModelGeometry`) at
    `block_size`, SAS-trained ones first (then by name); None if none fits."""
    from sas_backend.gate.checkpoint import validate_for_geometry
    from sas_backend.gate.config import GateConfig
    from sas_backend.gate.errors import GateCheckpointError

    fitting = []
    for cfg_path in sorted(root.glob("*/config.json")):
        if not (cfg_path.parent / "gate.safetensors").exists():
            continue
        try:
            cfg = GateConfig.load_json(cfg_path)
            validate_for_geometry(cfg, None, geometry, block_size=block_size)
        except GateCheckpointError:
            continue  # made for another model, block size or RoPE
        fitting.append((cfg.training.get("objective") != "lm", cfg_path.parent))
    return min(fitting)[1] if fitting else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="HF model directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=None,
                    help="SAS block size the server will run (default: SAS_BLOCK_SIZE, else 64)")
    args = ap.parse_args()

    from sas_backend.config import SASConfig
    from sas_backend.geometry import ModelGeometry

    block_size = args.block_size or SASConfig.from_env().block_size
    found = shipped_gate(ModelGeometry.from_model_dir(args.model), block_size)
    if found is not None:
        print(found)
        return 0
    # the default block size keeps the name docs and records cite (models/gates/<model>-seed0)
    block_tag = "" if block_size == SASConfig().block_size else f"-b{block_size}"
    out = REPO / "models" / "gates" / f"{pathlib.Path(args.model).name}{block_tag}-seed{args.seed}"
    if not (out / "gate.safetensors").exists():
        from sas_backend.gate.checkpoint import init_gate_checkpoint

        init_gate_checkpoint(out, model_dir=args.model, seed=args.seed, block_size=block_size)
        print(f"[default_gate] no trained gate for this model; wrote a seeded init to {out}", file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
