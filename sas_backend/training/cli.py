"""What the two gate trainers (`train`: through the backbone; `distill_cached`: from cached features) share at
their command line and in their training records: the optimizer schedule's and the run's arguments, the
checkpoint a run starts from, and the record's command line, schedule and loss fields; and the evaluation tools'
window and budget checks. One place, so the two trainers take and record them alike."""

from __future__ import annotations

import argparse
import shlex


def add_run_args(p: argparse.ArgumentParser, *, steps: int, lr: float, save_every: int, state_file: str) -> None:
    """The schedule (--steps, --lr, --min-lr-ratio, --warmup, --weight-decay, --clip), the gate's start (--seed,
    --gate-dim, --init-gate) and the run's control (--save-every, --resume, --stop-at, --no-progress); each
    trainer gives its own defaults for the first three that differ."""
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to lr * this")
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: off)")
    p.add_argument("--seed", type=int, default=0, help="gate init seed and data order")
    p.add_argument("--gate-dim", type=int, default=None,
                   help="the gate's width Dg (default 128, or --init-gate's; narrower than --init-gate's: training "
                        "starts from its every (Dg / N)-th rotary pair, sas_backend.gate.narrow)")
    p.add_argument("--init-gate", default=None, metavar="DIR",
                   help="start from this gate checkpoint (it must fit the model and the block size) instead of "
                        "the seeded init")
    p.add_argument("--save-every", type=int, default=save_every,
                   help="write state + checkpoint every N steps (0: end only)")
    p.add_argument("--resume", action="store_true", help=f"continue from --out/{state_file}")
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop after this step as if interrupted (state saved; continue with --resume)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar (log lines only)")


def check_window_budgets(args) -> None:
    """The evaluation tools' common checks (eval_ppl, analysis): 1 <= --last < --window, and every budget a positive
    multiple of --block-size; SystemExit naming the bad values."""
    if args.last < 1 or args.window <= args.last:
        raise SystemExit("error: need 1 <= --last < --window")
    bad = [x for x in args.budgets if x < args.block_size or x % args.block_size]
    if bad:
        raise SystemExit(f"error: budgets {bad} are not positive multiples of the block size {args.block_size}")


def command_line(module: str, argv) -> str:
    """The command as a record keeps it: `python -m <module>` and the arguments, no absolute path of this
    machine, quoted so that it can be pasted back into a shell."""
    from sas_backend.provenance import portable_argv

    return f"python -m {module} " + shlex.join(portable_argv(argv))


def schedule_record(args) -> dict:
    """The optimizer schedule's fields of a training record."""
    return {"lr": args.lr, "min_lr_ratio": args.min_lr_ratio, "warmup": args.warmup,
            "weight_decay": args.weight_decay, "clip": args.clip}


def loss_record(losses: list, window: int) -> dict:
    """The first loss and the mean of the last `window` ones (fewer where the run is shorter)."""
    tail = losses[-min(window, len(losses)):] if losses else []
    return {"initial_loss": losses[0] if losses else None,
            "final_loss": sum(tail) / len(tail) if tail else None,
            "final_loss_window": len(tail)}


def initial_gate(args, geometry, block_size: int):
    """`(GateConfig, {layer: {name: tensor}}, init record)` a trainer starts from: `--init-gate`'s checkpoint (cut to
    `--gate-dim` when narrower) or the seeded init of `--gate-dim` (default: GateConfig's). Sets `args.gate_dim` to
    the resolved width, which a resume compares."""
    import dataclasses

    from sas_backend.gate.checkpoint import init_gate_state
    from sas_backend.gate.config import GateConfig

    width = args.gate_dim or GateConfig.gate_dim
    config, tensors = init_gate_state(geometry, seed=args.seed, gate_dim=width, block_size=block_size)
    record = {"seed": args.seed, "method": "init_gate_state(seed) (sas_backend.gate.checkpoint)"}
    if args.init_gate:
        tensors, record = load_init_gate(args.init_gate, geometry, block_size, args.gate_dim)
        config = dataclasses.replace(config, gate_dim=int(tensors[0]["attngate_linear_q.weight"].shape[-1]))
    args.gate_dim = config.gate_dim
    return config, tensors, record


def load_init_gate(path: str, geometry, block_size: int, width: int | None = None):
    """`(tensors, init record)` of the checkpoint a run starts from (`--init-gate`), as fp32 tensors
    `{layer: {name: tensor}}`, cut to `width` dims when that is narrower (`gate.narrow`); SystemExit with the reason
    where it does not fit `geometry` / `block_size` / `width`."""
    from sas_backend.gate.checkpoint import load_gate_checkpoint, validate_for_geometry
    from sas_backend.gate.errors import GateCheckpointError
    from sas_backend.gate.gate_file import checkpoint_identity
    from sas_backend.provenance import portable_path

    try:
        config, tensors = load_gate_checkpoint(path)
        validate_for_geometry(config, tensors, geometry, block_size=block_size)
        ident = checkpoint_identity(path)
    except GateCheckpointError as e:
        raise SystemExit(f"error: --init-gate: {e}") from None
    tensors = {i: {k: v.float() for k, v in t.items()} for i, t in tensors.items()}
    narrowed = {}
    if width is not None and width != config.gate_dim:
        from sas_backend.gate.narrow import narrow_gate_tensors

        if width > config.gate_dim:
            raise SystemExit(f"error: --gate-dim {width} is wider than --init-gate's {config.gate_dim}: a gate can "
                             "start from a wider one (cut), not a narrower one")
        try:
            tensors = narrow_gate_tensors(tensors, width)
        except ValueError as e:
            raise SystemExit(f"error: --gate-dim: {e}") from None
        narrowed = {"narrowed_from_gate_dim": config.gate_dim, "gate_dim": width,
                    "method": "every rotary pair whose frequency the narrow gate turns at (sas_backend.gate.narrow)"}
    # The record names the checkpoint relative to the repository (or as the user gave it), never by an absolute
    # path of this machine: records travel with the shipped checkpoint.
    return tensors, {"checkpoint": portable_path(path), "sha256": ident["sha256"], "training": config.training,
                     **narrowed}
