"""The optimizer loop both trainers share (`train`, `distill_cached`): AdamW over the gates' parameters,
transformers' warmup + cosine schedule, `--resume` from `train_state.pt`, one JSON line per step in
`train_log.jsonl`, atomic state saves. Each trainer computes its own loss (and its backward) and record.

    loop = GateLoop(args, gates, params, resume_keys=..., resume_defaults=...)
    for step in range(loop.start, loop.end):
        loss = ...; loss.backward()             # the trainer's objective
        lr, grad_norm = loop.step()            # clip, optimizer and schedule step, zero the gradients
        rec = loop.record(step, loss, lr, grad_norm, seconds)   # kept, and logged on the main process
        if loop.should_save(step + 1): loop.save_state(step + 1); <write the checkpoint>

Batches are a pure function of (seed, step) (`batch_rows`), so a resumed run sees the same data as an
uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Dict, Iterable, Optional, Sequence

import torch

STATE_FILE = "train_state.pt"
LOG_FILE = "train_log.jsonl"


def lr_schedule(optimizer, warmup: int, total: int, min_ratio: float):
    """transformers' warmup + cosine schedule (the min-lr variant of `get_cosine_schedule_with_warmup`,
    for `--min-lr-ratio`): lr * s / warmup for 0-based steps s < warmup, then cosine from lr down to
    lr * min_ratio at the last step. Its cosine reaches the floor at `num_training_steps`, so that is
    `total - 1`, the last step."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=warmup, num_training_steps=max(total - 1, warmup), min_lr_rate=min_ratio
    )


def progress_bar(total: int, desc: str, initial: int = 0, enabled: bool = True):
    """A tqdm bar on stderr (ETA; callers add the loss as postfix), or None when not `enabled`.
    Off a terminal (a log file, CI) it redraws at most every 30 s instead of 10 times a second."""
    if not enabled:
        return None
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=desc, file=sys.stderr, dynamic_ncols=tty,
                mininterval=0.1 if tty else 30.0)


def batch_rows(step: int, micro: int, rank: int, *, world: int, batch: int, accum: int, n_rows: int,
               seed: int) -> torch.Tensor:
    """Row indices `[batch]` of one micro-batch: sample g = ((step*accum + micro)*world + rank)*batch + j
    of an endless stream of seeded epoch permutations (so resuming needs no data cursor)."""
    first = ((step * accum + micro) * world + rank) * batch
    out = []
    for g in range(first, first + batch):
        epoch, i = divmod(g, n_rows)
        perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perm[i]))
    return torch.tensor(out, dtype=torch.int64)


def resume_view(args, keys: Sequence[str]) -> dict:
    return {k: getattr(args, k) for k in keys}


def load_state(path: str, args, keys: Sequence[str], defaults: Dict) -> dict:
    """The state a run saved at `path`; SystemExit if there is none or if any of `keys` differs from
    `args` (a key a state lacks takes its value from `defaults`)."""
    if not os.path.isfile(path):
        raise SystemExit(f"error: --resume: no {path} (nothing to resume; drop --resume to start fresh)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    now = resume_view(args, keys)
    saved = {**defaults, **state.get("args", {})}
    diff = [f"{k}: saved {saved.get(k)!r}, now {now[k]!r}" for k in keys if saved.get(k) != now[k]]
    if diff:
        raise SystemExit("error: --resume with different settings than the saved run: " + "; ".join(diff))
    return state


class GateLoop:
    """The optimizer, schedule, resume, log and state of one training run over `gates` `{layer: module}`.

    args: the trainer's parsed arguments (lr, warmup, steps, min_lr_ratio, weight_decay, clip, save_every,
    stop_at, resume, out); params: the parameters trained (a subset of the gates' under `--layers`);
    resume_keys / resume_defaults: the arguments a resumed run must share with the saved one, and what a state
    saved before a key existed ran with. is_main: this process logs and saves (rank 0).
    After construction, `start`, `end`, `losses` and `saved` (the resumed state, or {}) are set.
    """

    def __init__(self, args, gates: Dict[int, torch.nn.Module], params: Iterable[torch.nn.Parameter], *,
                 resume_keys: Sequence[str], resume_defaults: Dict, is_main: bool = True):
        self.args, self.gates, self.params = args, gates, list(params)
        self.resume_keys, self.is_main = tuple(resume_keys), is_main
        self.optimizer = torch.optim.AdamW(self.params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
        self.scheduler = lr_schedule(self.optimizer, args.warmup, args.steps, args.min_lr_ratio)
        os.makedirs(args.out, exist_ok=True)
        self.state_path = os.path.join(args.out, STATE_FILE)
        self.log_path = os.path.join(args.out, LOG_FILE)
        self.start, self.losses, self.saved = 0, [], {}
        if args.resume:
            state = load_state(self.state_path, args, self.resume_keys, resume_defaults)
            for i, g in gates.items():
                g.load_state_dict(state["gates"][i])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.start, self.losses, self.saved = int(state["step"]), list(state["losses"]), state
        elif is_main and os.path.exists(self.log_path):
            os.unlink(self.log_path)
        self.end = args.steps if args.stop_at is None else min(args.steps, args.stop_at)

    def step(self) -> tuple[float, float]:
        """Clip the gradients, step the optimizer and the schedule, zero the gradients: (lr used, grad norm)."""
        clip = self.args.clip if self.args.clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        lr_used = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr_used, float(grad_norm)

    def record(self, step: int, loss: float, lr: float, grad_norm: float, seconds: float, **extra) -> dict:
        """Keep `loss` of 0-based `step` and append its log line (main process): the line as a dict."""
        self.losses.append(loss)
        rec = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "seconds": round(seconds, 3),
               **extra}
        if self.is_main:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
        return rec

    def should_save(self, done: int) -> bool:
        """Whether to save after `done` steps: every `--save-every` and at the last step of this run."""
        return self.is_main and ((bool(self.args.save_every) and done % self.args.save_every == 0) or done == self.end)

    def save_state(self, done: int, extra: Optional[dict] = None) -> None:
        """Write train_state.pt atomically: gates, optimizer, schedule, the resume arguments, the losses."""
        state = {
            "step": done,
            "gates": {i: {k: v.detach().cpu() for k, v in g.state_dict().items()} for i, g in self.gates.items()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "args": resume_view(self.args, self.resume_keys),
            "losses": list(self.losses),
            **(extra or {}),
        }
        tmp = self.state_path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.state_path)
