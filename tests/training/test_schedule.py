"""The trainer's lr schedule (transformers' warmup + cosine) and its progress bar."""

from __future__ import annotations

import io
import math

import pytest
import torch

from sas_backend.training.loop import lr_schedule, progress_bar


def _lrs(steps: int, warmup: int, min_ratio: float) -> list:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = lr_schedule(opt, warmup, steps, min_ratio)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("steps, warmup", [(200, 20), (8, 0), (40, 2), (1, 0)])
def test_warmup_then_cosine_to_the_floor_at_the_last_step(steps, warmup):
    """lr * s / warmup while warming up, then cosine from lr to lr * min_ratio at step `steps - 1`:
    the curve the trainer's hand-written schedule had after warmup (whose warmup ran one step ahead,
    (s + 1) / warmup)."""
    ratio = 0.1
    got = _lrs(steps, warmup, ratio)
    for s, lr in enumerate(got):
        if s < warmup:
            want = s / warmup
        else:
            frac = min(1.0, (s - warmup) / max(1, steps - warmup - 1))
            want = ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * frac))
        assert lr == pytest.approx(want, abs=1e-9), (s, lr, want)
    if steps > 1:
        assert got[-1] == pytest.approx(ratio)


def test_progress_bar_off_a_terminal_redraws_rarely(monkeypatch):
    """Writing to a file (not a TTY) the bar keeps the ETA line but does not flood the log."""
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    bar = progress_bar(100, "train")
    for _ in range(100):
        bar.set_postfix(loss="1.0", refresh=False)  # as the trainer does
        bar.update(1)
    bar.close()
    assert err.getvalue().count("\r") <= 3 and "100/100" in err.getvalue()
    assert progress_bar(10, "train", enabled=False) is None
