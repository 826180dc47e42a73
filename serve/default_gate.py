"""Print the gate checkpoint the default serve command uses for a model directory.

The gate shipped under gate_checkpoints/ whose base model matches (an SAS-trained one, objective
"lm", before any other); otherwise a seeded-init gate (same code path, untrained selection) made once
under models/gates/.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="HF model directory")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from sas_backend.geometry import ModelGeometry

    geo = ModelGeometry.from_model_dir(args.model)
    fitting = []
    for cfg_path in sorted((REPO / "gate_checkpoints").glob("*/config.json")):
        cfg = json.loads(cfg_path.read_text())
        same = (
            cfg.get("num_hidden_layers") == geo.num_layers
            and cfg.get("num_key_value_heads") == geo.num_kv_heads
            and cfg.get("num_attention_heads") == geo.num_q_heads
            and cfg.get("head_dim") == geo.head_dim
        )
        if same and (cfg_path.parent / "gate.safetensors").exists():
            sas = (cfg.get("training") or {}).get("objective") == "lm"
            fitting.append((not sas, cfg_path.parent))
    if fitting:
        print(min(fitting)[1])
        return 0
    out = REPO / "models" / "gates" / f"{pathlib.Path(args.model).name}-seed{args.seed}"
    if not (out / "gate.safetensors").exists():
        from sas_backend.gate.checkpoint import init_gate_checkpoint

        init_gate_checkpoint(out, model_dir=args.model, seed=args.seed)
        print(f"[default_gate] no trained gate for this model; wrote a seeded init to {out}", file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
