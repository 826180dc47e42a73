"""Train AttnGates for a frozen causal LM and write a canonical gate checkpoint.

    python -m sas_backend.training.train --model DIR --data PATH [PATH ...] --out DIR
        [--seq-len 4096] [--block-size 64] [--budget 512] [--objective lm|distill] [--steps 200]
        [--distill-target max|mass] [--sink-blocks S] [--local-blocks W] [--lr 1e-3] [--warmup 20]
        [--batch-size 1] [--grad-accum 1] [--clip 1.0] [--bf16]
        [--save-every 50] [--resume] [--seed 0] [--kernel auto|triton|naive] [--train-last N]
        [--init-gate DIR] [--recall-rows FRACTION] [--recall-facts N]

Multi-GPU: `torchrun --nproc-per-node N -m sas_backend.training.train ...` (DDP over the gate
parameters; WORLD_SIZE / RANK / LOCAL_RANK come from torchrun; only rank 0 writes).

The gates start from the seeded init (`init_gate_state(--seed)`, the same tensors as
`python -m sas_backend.gate.init --seed`), so "before training" is exactly that init; or, with
`--init-gate DIR`, from an earlier gate checkpoint (a curriculum stage, a fine-tune), whose training
record is kept in the new record's `init`. Only the
gates train (AdamW, transformers' linear warmup then cosine decay to `--min-lr-ratio` at the last
step, gradient clipping); the backbone is frozen.

Output in --out: `config.json` + `gate.safetensors` (canonical format, config `training` = the
record: objective, budget, block size, data, steps, seq len, lr, losses, the command line),
`train_state.pt` (gates + optimizer + step, for --resume) and `train_log.jsonl` (one line per step).
Batches are a pure function of (seed, step), so a resumed run sees the same data as an
uninterrupted one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from typing import Optional

import torch

from sas_backend.geometry import supported_families
from sas_backend.training.cli import add_run_args, command_line, initial_gate, loss_record, schedule_record
from sas_backend.training.loop import STATE_FILE, GateLoop, batch_rows, progress_bar

# Arguments a resumed run must share with the run that wrote the state.
_RESUME_KEYS = ("model", "seq_len", "block_size", "budget", "objective", "scope", "distill_target", "gate_dim",
                "steps", "seed",
                "batch_size", "grad_accum", "lr", "warmup", "min_lr_ratio", "weight_decay", "clip", "data",
                "heldout_fraction", "max_tokens", "max_rows", "train_last", "init_gate", "sink_blocks",
                "local_blocks", "recall_rows", "recall_facts")

# Keys added after some runs were saved: what a state without them meant.
_RESUME_DEFAULTS = {"scope": "sparse", "distill_target": "max", "sink_blocks": 0, "local_blocks": 0,
                    "recall_rows": 0.0, "recall_facts": 4}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sas_backend.training.train",
        description="Train SAS AttnGates (backbone frozen) and write a canonical gate checkpoint.",
    )
    p.add_argument("--model", required=True, help=f"Hugging Face model directory ({supported_families('train')})")
    p.add_argument("--data", required=True, nargs="+",
                   help="text files, JSONL (text or chat messages), directories, @essays, @stdlib")
    p.add_argument("--out", required=True, help="output directory (checkpoint, state, log)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per packed training row")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--budget", type=int, default=512,
                   help="tokens of previous blocks per query: K = budget // block (as --sas-budget serves it)")
    p.add_argument("--objective", choices=("lm", "distill"), default="lm",
                   help="lm: SAS next-token loss through the gated attention; distill: SeerAttention-R KL")
    p.add_argument("--scope", choices=("sparse", "full"), default="sparse",
                   help="lm only: sparse = the Top-K blocks per query (the serving regime); full = every "
                        "previous block with its soft gate (dense cost, every block learns from step 1)")
    p.add_argument("--distill-target", choices=("max", "mass"), default="max",
                   help="distill only: pool each block's dense attention by its max (SeerAttention-R) or "
                        "its sum (mass: what the oracle selector ranks by and the harness's recall measures)")
    p.add_argument("--sink-blocks", type=int, default=0,
                   help="train with the first N blocks forced in, inside K, as --sas-sink-blocks serves them "
                        "(the gate ranks only the other blocks)")
    p.add_argument("--local-blocks", type=int, default=0,
                   help="train with the N blocks before the query's own forced in, inside K, as "
                        "--sas-local-blocks serves them")
    p.add_argument("--recall-rows", type=float, default=0.0, metavar="FRACTION",
                   help="make this share of the rows recall rows: facts spliced before the trained tail and "
                        "restated in it (sas_backend.training.recall), so the gate learns to fetch a far block")
    p.add_argument("--recall-facts", type=int, default=4, help="facts per recall row")
    p.add_argument("--batch-size", type=int, default=1, help="rows per micro-batch per process")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--bf16", action="store_true", help="bf16 backbone + autocast (CUDA only)")
    p.add_argument("--kernel", choices=("auto", "triton", "naive"), default="auto",
                   help="gated attention: Triton kernel (CUDA) or torch reference; auto picks by device")
    p.add_argument("--heldout-fraction", type=float, default=None,
                   help="share of each source's text held out as whole documents (by name hash), "
                        "never trained on (default 0.2)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="use only about this many training tokens of each source")
    p.add_argument("--max-rows", type=int, default=None, help="use only the first N packed rows (smoke tests)")
    p.add_argument("--grad-checkpoint", action="store_true",
                   help="recompute each decoder layer in backward (lm objective; saves activation memory)")
    p.add_argument("--query-chunk", type=int, default=4096, help="queries scored at a time (memory bound)")
    p.add_argument("--train-last", type=int, default=None, metavar="N",
                   help="gate only the last N tokens of each row: the first seq-len - N run dense without "
                        "gradient (as after a dense prefill) and serve as their keys; the loss is over those N. "
                        "Cheap long-context training with the torch reference (CPU); default: whole rows")
    add_run_args(p, steps=200, lr=1e-3, save_every=50, state_file=STATE_FILE)
    return p


# ---- distributed ----------------------------------------------------------------------------


def setup_distributed():
    """`(rank, world, device)`; initializes torch.distributed when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def _all_mean(x: float, world: int, device) -> float:
    if world <= 1:
        return x
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / world


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


# ---- checkpoints ----------------------------------------------------------------------------


def training_record(args, argv, data, rows_used, spec, kernel, step, losses, world, elapsed) -> dict:
    return {
        "objective": args.objective,
        "scope": args.scope if args.objective == "lm" else None,
        "distill_target": args.distill_target if args.objective == "distill" else None,
        "method": ("SAS: backbone frozen, gates trained end to end by the next-token loss through "
                   "gated sparse attention" if args.objective == "lm" else
                   "SeerAttention-R style distillation: KL(block-max-pooled dense attention || gate)"
                   if args.distill_target == "max" else
                   "distillation of the oracle: KL(block attention mass of the dense attention, max over "
                   "the group's heads || gate)"),
        "budget": args.budget,
        "block_size": args.block_size,
        "top_k": spec.top_k,
        "sink_blocks": args.sink_blocks,
        "local_blocks": args.local_blocks,
        "data": {**data.record(), "rows_used": rows_used, "recall": getattr(args, "recall_record", None)},
        "steps": step,
        "seq_len": args.seq_len,
        "train_last": args.train_last,
        "batch_size": args.batch_size,
        "grad_accum": args.grad_accum,
        "world_size": world,
        "tokens_seen": step * args.batch_size * args.grad_accum * world * args.seq_len,
        **schedule_record(args),
        "bf16": args.bf16,
        "kernel": kernel,
        "init": args.init_record,
        **loss_record(losses, 10),
        "last_step_loss": losses[-1] if losses else None,
        "train_seconds": round(elapsed, 1),
        "command": command_line("sas_backend.training.train", argv),
    }


def write_checkpoint(out: str, config, model, record: dict) -> None:
    from sas_backend.gate.checkpoint import save_gate_checkpoint
    from sas_backend.training.model import gates_of

    cfg = dataclasses.replace(config, training=record)
    save_gate_checkpoint(out, cfg, gates_of(model), dtype=torch.float32)


# ---- main -----------------------------------------------------------------------------------


def recall_tail(args) -> int:
    """Where recall rows restate their facts: the trained tail (`--train-last`), else the row's last eighth."""
    return args.train_last if args.train_last is not None else args.seq_len // 8


def _check_args(args, device) -> None:
    bad = []
    for name in ("seq_len", "block_size", "budget", "steps", "batch_size", "grad_accum", "gate_dim", "query_chunk"):
        if getattr(args, name) is not None and getattr(args, name) < 1:  # gate_dim None: 128 or --init-gate's
            bad.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.save_every < 0 or args.clip < 0:
        bad.append("--warmup, --save-every and --clip must be >= 0")
    if args.block_size >= 1:
        from sas_backend.training.scoring import check_forced

        try:  # the rule GateTrainSpec enforces, reported with the other argument errors
            check_forced(args.budget // args.block_size, args.sink_blocks, args.local_blocks)
        except ValueError as e:
            bad.append(f"--sink-blocks/--local-blocks at budget {args.budget}: {e}")
    if not 0.0 <= args.recall_rows <= 1.0 or args.recall_facts < 1:
        bad.append("--recall-rows must be in [0, 1] and --recall-facts >= 1")
    if args.bf16 and device.type != "cuda":
        bad.append("--bf16 needs a CUDA device (on CPU the backbone runs in fp32)")
    if args.seq_len <= args.budget:
        bad.append(f"--seq-len {args.seq_len} <= --budget {args.budget}: no query would ever be sparse")
    if args.train_last is not None and not 2 <= args.train_last < args.seq_len:
        bad.append(f"--train-last {args.train_last} must be in [2, --seq-len {args.seq_len})")
    if args.train_last is not None and args.kernel == "triton":
        bad.append("--train-last runs the torch reference (the Triton kernel trains whole rows): drop --kernel triton")
    if args.train_last is not None and args.grad_checkpoint:
        bad.append("--grad-checkpoint covers whole rows; with --train-last only the tail keeps activations")
    if bad:
        raise SystemExit("error: " + "; ".join(bad))


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    from sas_backend.training.data import DEFAULT_HELDOUT_FRACTION

    if args.heldout_fraction is None:
        args.heldout_fraction = DEFAULT_HELDOUT_FRACTION
    rank, world, device = setup_distributed()
    _check_args(args, device)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sas_backend.geometry import ModelGeometry
    from sas_backend.training.data import load_packed
    from sas_backend.training.model import (GateTrainSpec, attach_gates, gate_parameters, gates_of,
                                            objective_loss)

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = load_packed(args.data, tokenizer, args.seq_len, split="train", heldout_fraction=args.heldout_fraction,
                       seed=args.seed, max_tokens=args.max_tokens)
    rows = data.rows if args.max_rows is None else data.rows[: args.max_rows]
    if args.recall_rows > 0:
        from sas_backend.training.recall import RecallSpec, add_recall_rows

        recall = RecallSpec(args.recall_rows, args.recall_facts, tail=recall_tail(args), seed=args.seed)
        try:
            rows, made = add_recall_rows(rows, tokenizer, recall)
        except ValueError as e:  # the facts do not fit the tail (or the prefix)
            raise SystemExit(f"error: --recall-facts {args.recall_facts}: {e}") from None
        args.recall_record = {**recall.record(), **made}
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    spec = GateTrainSpec(block_size=args.block_size, budget=args.budget, objective=args.objective,
                         scope=args.scope, kernel=args.kernel, query_chunk=args.query_chunk, train_last=args.train_last,
                         distill_target=args.distill_target, sink_blocks=args.sink_blocks,
                         local_blocks=args.local_blocks)
    geometry = ModelGeometry.from_model_dir(args.model)
    gate_config, init_tensors, init_record = initial_gate(args, geometry, args.block_size)
    args.init_record = init_record
    attach_gates(model, spec, init_tensors, max_pos=max(args.seq_len, geometry.max_position_embeddings or 0))
    kernel = model.model.layers[0].self_attn._sas_train.kernel
    if args.grad_checkpoint and args.objective == "lm":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # transformers only checkpoints in training mode (dropout is 0 in these models)
    else:
        model.eval()
    params = gate_parameters(model)
    runner = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # gradients exist only for the gate parameters, so only they are all-reduced
        runner = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    loop = GateLoop(args, gates_of(model), params, resume_keys=_RESUME_KEYS, resume_defaults=_RESUME_DEFAULTS,
                    is_main=rank == 0)
    start, end, losses = loop.start, loop.end, loop.losses

    if rank == 0:
        print(f"[train] {data.record()['rows']} rows x {args.seq_len} tokens ({data.tokens} tokens, "
              f"{data.documents} documents) | objective {args.objective} | block {args.block_size} "
              f"budget {args.budget} (K={spec.top_k}) | kernel {kernel} | "
              + (f"gated: last {args.train_last} of each row | " if args.train_last else "")
              + f"{world} process(es) on {device} | "
              f"steps {start}->{end}", flush=True)
    bar = progress_bar(args.steps, "train", initial=start, enabled=rank == 0 and not args.no_progress)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    tokens_per_step = args.batch_size * args.grad_accum * world * args.seq_len
    t_start = time.time()
    step = start
    for step in range(start, end):
        t0 = time.time()
        total = 0.0
        for micro in range(args.grad_accum):
            idx = batch_rows(step, micro, rank, world=world, batch=args.batch_size, accum=args.grad_accum,
                             n_rows=rows.shape[0], seed=args.seed)
            ids = rows[idx].to(device)
            sync = world == 1 or micro == args.grad_accum - 1
            ctx = runner.no_sync() if not sync else contextlib.nullcontext()
            with ctx:
                with autocast:
                    loss = objective_loss(model, ids, runner) / args.grad_accum
                loss.backward()
            total += float(loss.detach())
        lr_used, grad_norm = loop.step()
        loss_val = _all_mean(total, world, device)
        dt = time.time() - t0
        rec = loop.record(step, loss_val, lr_used, grad_norm, dt, tokens_per_s=round(tokens_per_step / dt, 1))
        if rank == 0:
            if bar is not None:  # refresh=False: update() redraws, at the bar's own pace
                bar.set_postfix(loss=f"{loss_val:.4f}", tok_s=f"{tokens_per_step / dt:.0f}",
                                lr=f"{rec['lr']:.2e}", refresh=False)
                bar.update(1)
            else:
                print(f"[train] step {step + 1}/{args.steps} loss {loss_val:.4f} "
                      f"{tokens_per_step / dt:.0f} tok/s", flush=True)
        done = step + 1
        if loop.should_save(done):
            loop.save_state(done)
            rec = training_record(args, argv, data, int(rows.shape[0]), spec, kernel, done, losses, world,
                                  time.time() - t_start)
            write_checkpoint(args.out, gate_config, model, rec)
        _barrier(world)
    if bar is not None:
        bar.close()
    if rank == 0 and start >= end:
        print(f"[train] nothing to do: already at step {start} of {args.steps}", flush=True)
    if rank == 0 and end > start:
        print(f"[train] wrote {args.out} (step {end}, final loss {losses[-1]:.4f})", flush=True)
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
