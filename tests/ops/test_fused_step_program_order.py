"""Program order cannot matter (issue 64 item 5): each fused kernel (ops.fused_step: front, select, attend) merges
in its last-arriving program, in a fixed order whichever program that is, and resets its arrival counters. On a GPU
the programs of a launch run in any order; Triton's interpreter runs them in grid order (x, then y, then z). Here
the interpreter is made to run them reversed and shuffled (seeded), with the kernels unchanged: every output must
be bit-identical to grid order, and every counter zero after each launch.

The permutation is applied where the interpreter names each program (`interpreter_builder.set_grid_idx`, called
once per program with the grid-order index): the n-th program run gets the n-th index of the permutation."""

from __future__ import annotations

import random

import pytest
import torch

from sas_backend.ops import fused_step as fused
from tests.devices import DEVICE
from tests.ops.test_fused_step_triton import StepCase

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="program order is the interpreter's (CPU) to permute")

ORDERS = ("grid", "reversed", "shuffled-0", "shuffled-1", "shuffled-2")


class ProgramOrder:
    """Runs every launch's programs in `order` ("grid", "reversed", "shuffled-<seed>"); `permuted` counts the
    launches of more than one program whose order differed from grid order."""

    def __init__(self, monkeypatch, order: str):
        from triton.runtime import interpreter

        self.builder = builder = interpreter.interpreter_builder
        self.order, self.perm, self.permuted = order, None, 0
        self.rng = random.Random(int(order.split("-")[1])) if order.startswith("shuffled") else None
        original = type(builder).set_grid_idx

        def set_grid_idx(x, y, z):
            nx, ny, nz = builder.grid_dim
            i = (x * ny + y) * nz + z
            if i == 0:  # a new launch: a new permutation of its programs
                self.perm = self._permutation(nx * ny * nz)
                self.permuted += self.perm != list(range(len(self.perm)))
            j = self.perm[i]
            original(builder, j // (ny * nz), (j // nz) % ny, j % nz)

        monkeypatch.setattr(builder, "set_grid_idx", set_grid_idx)

    def _permutation(self, n: int) -> list:
        p = list(range(n))
        if self.order == "reversed":
            p.reverse()
        elif self.rng is not None:
            self.rng.shuffle(p)
        return p


def counters_zero(ws) -> bool:
    return all(int(t.abs().sum()) == 0 for t in (ws.front_counters, ws.select_counters, ws.attend_counters))


def run_step(c: StepCase, kv_dtype, anchors) -> dict:
    """front -> select -> attend over one workspace split as on a GPU (several front units, select chunks and
    attend splits per (row, kv head)); each output cloned, counters checked after every launch."""
    ws = c.workspace(top_k=5, chunk=16, target_programs=64)
    assert ws.uq > 1 and ws.uk > 1 and ws.select_chunks(c.max_blocks) > 1 and ws.attend_splits(len(c.lens)) > 1
    summ = c.summaries.clone()
    out = {}
    out["gate_q"] = fused.front(ws, c.q, c.model_cs, c.gate_cs, c.w_q, c.q_norm, c.k_buf, c.model_table, c.gate_table,
                                c.w_k, c.k_norm, summ, c.table, c.seq_lens).clone()
    out["summaries"] = summ.clone()
    assert counters_zero(ws)
    out["selected"] = fused.select(ws, out["gate_q"], summ, c.table, c.n_cand, c.max_blocks, 1, 1,
                                   anchors=anchors).clone()
    assert counters_zero(ws)
    out["attention"] = fused.attend(ws, c.q, c.k_buf, c.v_buf, out["selected"], c.table, c.seq_lens,
                                    c.d**-0.5).clone()
    assert counters_zero(ws)
    return out


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_are_bit_identical_in_any_program_order(paged_case, monkeypatch, kv_dtype):
    lens = [64, 129, 1, 200, 37]  # exactly full blocks (the front summarizes), a padding row, partial blocks
    c = StepCase(paged_case, lens, 4, kv_dtype=kv_dtype, seed=17)
    anchors = torch.randint(-1, 40, (len(lens), c.h_kv, 2), generator=c.case.gen).to(DEVICE, torch.int32)
    want = run_step(c, kv_dtype, anchors)
    for order in ORDERS[1:]:
        with monkeypatch.context() as m:
            po = ProgramOrder(m, order)
            got = run_step(c, kv_dtype, anchors)
        assert po.permuted == 3, (order, po.permuted)  # all three launches ran out of grid order
        for name, t in want.items():
            assert torch.equal(got[name], t), f"{name} differs when programs run {order}"


def test_the_permutation_reaches_the_kernels(monkeypatch):
    """The patch itself: a one-launch kernel that records its program ids sees them in the permuted order."""
    import triton
    import triton.language as tl

    @triton.jit
    def _order_kernel(out, counter):
        slot = tl.atomic_add(counter, 1)
        tl.store(out + slot, tl.program_id(0) * 100 + tl.program_id(1))

    def run():
        out = torch.full((12,), -1, dtype=torch.int32)
        _order_kernel[(3, 4)](out, torch.zeros(1, dtype=torch.int32))
        return out.tolist()

    grid = [x * 100 + y for x in range(3) for y in range(4)]
    assert run() == grid
    with monkeypatch.context() as m:
        ProgramOrder(m, "reversed")
        assert run() == grid[::-1]
    with monkeypatch.context() as m:
        ProgramOrder(m, "shuffled-0")
        got = run()
    assert sorted(got) == grid and got != grid
