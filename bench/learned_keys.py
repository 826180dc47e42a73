"""Learned per-token index keys (issue 63, candidate (b)): fit the `keys<R>` projections of a model, evaluation only.

    .venv/bin/python bench/learned_keys.py --model models/Qwen2.5-Coder-0.5B-Instruct --ranks 8 \\
        --data @stdlib @essays --seq-len 16384 --steps 150 --out build/learned-keys/qwen-16k.pt

One training row of --seq-len tokens per --data source (the gates' training text, never an evaluation's) is run
densely once; every layer's post-RoPE q / k are kept (`hf.candidates.record_model_qk`) and each layer's projections
trained from their `pca<R>` fit (`hf.learned_keys`). Writes OUT (`{"index": {rank: {layer: (Pq, Pk)}}}`, what
`eval_ppl --candidates keys<R>mass --keys-index OUT` reads) and OUT.json (the command, the KL per layer at the start
and end, the seconds). Then, e.g.:

    python -m sas_backend.training.eval_ppl --model MODEL --candidates keys8mass exactmass --keys-index OUT ...
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sas_backend.provenance import git_state, portable_argv  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8], help="R: values a token and kv head")
    ap.add_argument("--data", nargs="+", default=["@stdlib", "@essays"], help="one training row per source")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=150, help="Adam steps per layer (rows in turn)")
    ap.add_argument("--queries", type=int, default=64, help="queries a step, from a row's second half")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", required=True, help="the projections (.pt); a .json record beside it")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sas_backend.hf.candidates import record_model_qk
    from sas_backend.hf.learned_keys import fit_model_keys
    from sas_backend.training.data import read_documents

    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    per_row = []
    for source in args.data:
        ids = []
        for doc in sorted(read_documents([source]), key=lambda d: d.name):  # tokenized until the row is full
            ids += tok(doc.text + "\n\n", add_special_tokens=False)["input_ids"]
            if len(ids) >= args.seq_len:
                break
        ids = ids[: args.seq_len]
        if len(ids) < args.seq_len:
            raise SystemExit(f"error: {source} holds {len(ids)} tokens, fewer than --seq-len {args.seq_len}")
        per_row.append(record_model_qk(model, torch.tensor(ids)))
        print(f"[learned_keys] {source}: {len(ids)} tokens recorded ({time.time() - t0:.0f} s)", flush=True)
    index, record = {}, {}
    for rank in args.ranks:
        index[rank], per_layer = fit_model_keys(per_row, rank, args.block_size, steps=args.steps,
                                                queries=args.queries, lr=args.lr)
        record[rank] = per_layer
        kl = [(r["kl_start"], r["kl_end"]) for r in per_layer.values()]
        print(f"[learned_keys] rank {rank}: KL over the layers {sum(a for a, _ in kl) / len(kl):.4f} -> "
              f"{sum(b for _, b in kl) / len(kl):.4f} ({time.time() - t0:.0f} s)", flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"index": index}, out)
    meta = {"command": shlex.join(["python", "bench/learned_keys.py", *portable_argv(sys.argv[1:] if argv is None
                                                                                    else argv)]),
            "git": git_state(), "seconds": round(time.time() - t0, 1),
            "kl_per_layer": {str(r): {str(layer): v for layer, v in per.items()} for r, per in record.items()}}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"[learned_keys] wrote {out} and {out.with_suffix('.json')}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
