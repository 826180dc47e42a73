"""The arms of bench/sas_vs_distill.sh as one record: each gate's training facts from its config.json.

    python bench/sas_vs_distill_arms.py OUT [--init GATE_DIR]   # writes OUT/arms.json

bench/readme_tables.py reads it beside the study's quality and analysis records (the gates themselves are not
committed: the sha256 of each is in those records and here)."""

from __future__ import annotations

import argparse
import json
import pathlib

from sas_backend.gate.gate_file import read_training_record, weights_sha256

ARMS = ("distill", "lm-sparse", "lm-full")


def arm_facts(gate_dir: pathlib.Path) -> dict:
    """What one gate was trained on and how, from its checkpoint's training record."""
    t = read_training_record(gate_dir)
    objective = t["objective"] + (f", {t['scope']} scope" if t.get("objective") == "lm" else "")
    return {
        "objective": objective, "steps": t.get("steps"), "seq_len": t.get("seq_len"),
        "rows": t.get("rows_seen") or (t.get("tokens_seen") or 0) // (t.get("seq_len") or 1),
        "train_last": t.get("train_last"), "data": " ".join((t.get("data") or {}).get("sources") or []),
        "budget": t.get("budget"), "forced": [t.get("sink_blocks"), t.get("local_blocks")], "lr": t.get("lr"),
        "initial_loss": t.get("initial_loss"), "final_loss": t.get("final_loss"),
        "train_seconds": t.get("train_seconds"),
        "sha256": weights_sha256(gate_dir),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the study's folder (OUT of bench/sas_vs_distill.sh)")
    ap.add_argument("--init", default=str(pathlib.Path(__file__).resolve().parents[1] / "gate_checkpoints"
                                          / "smollm2-135m-instruct-sas"), help="the starting gate")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    rec = {"shipped": arm_facts(pathlib.Path(args.init))}
    for arm in ARMS:
        if (out / f"train-{arm}" / "gate.safetensors").is_file():
            rec[arm] = arm_facts(out / f"train-{arm}")
    (out / "arms.json").write_text(json.dumps(rec, indent=1) + "\n")
    print(f"[arms] {', '.join(rec)} -> {out / 'arms.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
