"""`backend.decode_step.DecodeStep`, the one object the server, the GPU benchmark and these tests drive.

- launch count: a sparse layer of a fused step is exactly three Triton launches (front, select, attend), in a
  steady step and in a block step alike, and the per-batch plan and step state launch none;
- graph shape: two captured-batch steps with other lengths (one completing blocks, padded rows) launch the same
  grids over the same buffers (what a CUDA graph replays), and leave every counter zeroed;
- the fused path selects and attends as the per-op path does (the CPU server's, checked against the oracle by
  the server tests), over several layers, mixed lengths, forced blocks and prompt anchors.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); on a GPU they compile.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from sas_backend.backend.decode_step import DecodeStep
from sas_backend.backend.rope_tables import FixedRopeTables
from sas_backend.backend.step_settings import StepSettings
from sas_backend.gate.module import AttnGate
from sas_backend.ops.fused_step import StepGeometry
from sas_backend.ops.rope import apply_rope, rope_cos_sin_table
from sas_backend.ops.summary.torch_path import summarize_pages
from sas_backend.selection import SelectionRule, make_selector
from tests.devices import DEVICE

B, H_KV, G, D, DG, LAYERS, MAX_REQS, MAX_CTX = 8, 2, 3, 16, 16, 2, 6, 512


@contextlib.contextmanager
def launches():
    """Record every Triton launch: (kernel name, grid, {arg name: data_ptr of each tensor argument})."""
    from triton.runtime import interpreter, jit

    seen = []
    saved = {cls: cls.run for cls in (jit.JITFunction, interpreter.InterpretedFunction)}

    def recorder(cls):
        def run(self, *args, grid, warmup, **kwargs):
            names = list(self.arg_names) if hasattr(self, "arg_names") else [p.name for p in self.params]
            ptrs = {n: a.data_ptr() for n, a in zip(names, args) if isinstance(a, torch.Tensor)}
            seen.append((self.fn.__name__ if hasattr(self, "fn") else self.__name__, tuple(grid), ptrs))
            return saved[cls](self, *args, grid=grid, warmup=warmup, **kwargs)
        return run

    for cls in saved:
        cls.run = recorder(cls)
    try:
        yield seen
    finally:
        for cls, fn in saved.items():
            cls.run = fn


class World:
    """A paged cache with requests on random pages, a gate per layer, summaries of the complete blocks."""

    def __init__(self, budget_blocks=3, sink=1, local=1, anchors=0, seed=0, sub_blocks=1):
        g = self.g = torch.Generator().manual_seed(seed)
        pages = MAX_REQS * MAX_CTX // B + 1
        self.req_to_token = torch.zeros(MAX_REQS, MAX_CTX, dtype=torch.int32)
        perm = torch.randperm(pages - 1, generator=g) + 1  # page 0: SGLang's padding page
        for r in range(MAX_REQS):
            for m in range(MAX_CTX // B):
                self.req_to_token[r, m * B:(m + 1) * B] = int(perm[r * (MAX_CTX // B) + m]) * B + torch.arange(B)
        self.req_to_token = self.req_to_token.to(DEVICE)
        self.model_table = rope_cos_sin_table(D, MAX_CTX + B, 10000.0, device=DEVICE)
        self.gate_table = rope_cos_sin_table(DG, MAX_CTX + B, 10000.0, device=DEVICE)
        slots = pages * B
        pos_of_slot = torch.zeros(slots, dtype=torch.int64)
        pos_of_slot[self.req_to_token.cpu().reshape(-1).long()] = torch.arange(MAX_CTX).repeat(MAX_REQS)
        self.k = [apply_rope(torch.randn(slots, H_KV, D, generator=g).to(DEVICE), self.model_table[pos_of_slot])
                  for _ in range(LAYERS)]
        self.v = [torch.randn(slots, H_KV, D, generator=g).to(DEVICE) for _ in range(LAYERS)]
        self.gates = []
        for _ in range(LAYERS):
            gate = AttnGate(H_KV, G, D, DG)
            gate.reset_parameters(g)
            self.gates.append(gate.to(DEVICE).requires_grad_(False))
        self.summaries = []
        all_pages = torch.arange(1, pages, device=DEVICE)
        starts = pos_of_slot.to(DEVICE)[all_pages * B]
        for lid in range(LAYERS):
            s = torch.zeros(pages, H_KV, sub_blocks * DG, device=DEVICE)
            w = self.gates[lid]
            size = B // sub_blocks
            for j in range(sub_blocks):  # run j of page p: slots p*b + j*S .. (a "page" p*n + j of S slots)
                s[all_pages, :, j * DG:(j + 1) * DG] = summarize_pages(
                    self.k[lid], all_pages * sub_blocks + j, starts + j * size, self.model_table, self.gate_table,
                    w.attngate_linear_k.weight, w.attngate_knorm.weight, size)
            self.summaries.append(s)
        self.anchors = None
        if anchors:
            self.anchors = torch.randint(-1, 20, (MAX_REQS, H_KV, anchors), generator=g).to(DEVICE, torch.int32)
        self.rule = SelectionRule(budget_blocks, B, sink, local, sub_blocks)
        self.geo = StepGeometry(H_KV, G, D, D, DG, budget_blocks, B, sub_blocks)

    def step(self, kernels, attention, summaries=None, force_sparse=False, q_dtype=torch.float32,
             kv_dtype=torch.float32, exact_rerank=1, **settings):
        """A `DecodeStep` over this world (summaries: the per-layer pools it reads and updates; default the
        world's own)."""
        return DecodeStep(make_selector("gate", self.rule), self.geo, self.req_to_token, DEVICE, q_dtype, kv_dtype,
                          D**-0.5, StepSettings(kernels, attention, **settings),
                          summaries=self.summaries if summaries is None else summaries, gates=self.gates,
                          rope=FixedRopeTables(self.model_table, self.gate_table),
                          anchors=None if self.anchors is None else {lid: self.anchors for lid in range(LAYERS)},
                          force_sparse=force_sparse, exact_rerank=exact_rerank)

    def batch(self, lens, rows):
        seq = torch.tensor(lens, dtype=torch.int64)
        q = torch.randn(len(lens), H_KV * G, D, generator=self.g).to(DEVICE)
        return dict(positions=(seq - 1).clamp_min(0).to(DEVICE), seq_lens=seq.to(DEVICE),
                    req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=DEVICE), seq_lens_cpu=seq), q

    def run(self, step, plan, q):
        return [(step.run(plan, lid, q, self.k[lid], self.v[lid]), step.last_selected.clone())
                for lid in range(LAYERS)]


def _plan(step, world, inp, graph_bs=None):
    return step.plan(inp["positions"], inp["seq_lens"], inp["req_pool_indices"], inp["seq_lens_cpu"],
                     graph_bs=graph_bs)


@pytest.mark.parametrize("lens", [[100, 37, 61], [96, 40, 64]], ids=["steady", "block"])
def test_fused_sparse_layer_is_three_launches(lens):
    world = World()
    step = world.step("triton", "triton")
    inp, q = world.batch(lens, [0, 3, 5])
    with launches() as seen:
        plan = _plan(step, world, inp)
    assert seen == [] and plan.fused and not plan.dense  # planning launches nothing
    with launches() as seen:
        world.run(step, plan, q)
    names = [s[0] for s in seen]
    assert names == ["_front_kernel", "_select_kernel", "_attend_kernel"] * LAYERS, names


@pytest.mark.parametrize("rerank", [1, 2])
def test_fused_step_replays_fixed_grids_over_fixed_buffers(rerank):
    """Captured-batch plans (graph_bs 4) of two unlike steps launch identical grids over identical buffers; with two
    levels (rerank 2) a fourth launch, the rerank's log-sum-exps, which the attend ranks from its fixed workspace."""
    world = World(anchors=2)
    step = world.step("triton", "triton", exact_rerank=rerank)
    step.init_graph_state(4, D, DG)
    records = []
    static = None  # the graph runner's static input buffers, refilled in place
    for lens, rows in (([100, 37, 1, 1], [0, 3, 0, 0]), ([64, 200, 96, 1], [5, 1, 2, 0])):  # padded rows: length 1
        inp, q = world.batch(lens, rows)
        if static is None:
            static = {k: v.clone() for k, v in inp.items()}
        for k, v in inp.items():
            static[k].copy_(v)
        inp = static
        plan = _plan(step, world, inp, graph_bs=4)
        step.fill(plan)
        with launches() as seen:
            world.run(step, plan, q)
        records.append(seen)
    launched = ["_front_kernel", "_select_kernel"] + ["_rerank_kernel"] * (rerank > 1) + ["_attend_kernel"]
    assert [n for n, _, _ in records[0]] == [n for n, _, _ in records[1]] == launched * LAYERS  # no extra launch
    for (n1, g1, p1), (n2, g2, p2) in zip(*records):
        assert n1 == n2 and g1 == g2, (n1, g1, g2)
        moving = {"q_ptr", "out_ptr"}  # the layer's input and its freshly allocated output (graph pool under capture)
        assert {k: v for k, v in p1.items() if k not in moving} == {k: v for k, v in p2.items() if k not in moving}, n1
    ws = step.fused_ws
    assert int(ws.front_counters.abs().sum() + ws.select_counters.abs().sum() + ws.attend_counters.abs().sum()) == 0
    if rerank > 1:  # the attend ranked: the selection it wrote is the step's persistent buffer
        assert step.last_selected.data_ptr() == step.rerank_out.data_ptr()


@pytest.mark.parametrize("budget,sink,local,anchors,sub", [(3, 1, 1, 0, 1), (4, 0, 0, 2, 1), (40, 0, 0, 0, 1),
                                                         (3, 1, 1, 0, 4), (4, 0, 0, 2, 2)])
def test_fused_step_equals_the_per_op_step(budget, sink, local, anchors, sub):
    """Same batch, same state: the fused kernels and the per-op torch path select the same blocks, attend to
    the same result and leave the same summaries (blocks completed by this step's tokens included), with one
    summary a block and with sub-block summaries (the per-op path: `selection`'s runs as blocks of b / n)."""
    world = World(budget, sink, local, anchors, seed=budget + sub, sub_blocks=sub)
    lens, rows = [64, 257, 9, 130, 200], [0, 1, 2, 3, 4]
    inp, q = world.batch(lens, rows)
    results = {}
    for kernels, attention in (("torch", "torch"), ("triton", "triton"), ("torch", "triton"), ("triton", "torch")):
        summaries = [s.clone() for s in world.summaries]
        step = world.step(kernels, attention, summaries, force_sparse=True)
        plan = _plan(step, world, inp)
        assert not plan.dense
        results[kernels, attention] = world.run(step, plan, q), summaries
    (ref, ref_summ) = results["torch", "torch"]
    for key, (got, summ) in results.items():
        for lid in range(LAYERS):
            assert torch.equal(got[lid][1], ref[lid][1]), (key, lid)
            torch.testing.assert_close(got[lid][0], ref[lid][0], rtol=1e-5, atol=1e-5, msg=str(key))
            torch.testing.assert_close(summ[lid], ref_summ[lid], rtol=1e-5, atol=1e-5, msg=str(key))


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the torch path's one pass runs off CUDA")
@pytest.mark.parametrize("graph_bs", [None, 5], ids=["eager", "graph"])
def test_two_levels_in_one_pass_equal_two_passes_and_the_fused_step(graph_bs):
    """`--sas-exact-rerank 2` on the per-op torch path: the one pass (`ops.rerank.rerank_attend`, the CPU default)
    keeps the blocks the second level then the sparse decode keep (`rerank_attends` False) and the fused Triton
    step's ranking attend keeps, and attends the same, eager (the first level cut to the plan's widest row) and
    planned for a captured batch (full width, padded rows); rows with fewer candidates than 2 x K and than K."""
    world = World(3, 1, 1, 2, seed=21)
    inp, q = world.batch([64, 257, 9, 130, 200], [0, 1, 2, 3, 4])
    results = {}
    for name, kernels, attention, one_pass in (("one pass", "torch", "torch", True),
                                               ("two passes", "torch", "torch", False),
                                               ("fused", "triton", "triton", True)):
        step = world.step(kernels, attention, [s.clone() for s in world.summaries], force_sparse=True,
                          exact_rerank=2)
        step.rerank_attends = one_pass
        if graph_bs:
            step.init_graph_state(graph_bs, D, DG)
        captured = graph_bs if kernels == "torch" else None
        plan = _plan(step, world, inp, graph_bs=captured)
        if captured:
            step.fill(plan)
        results[name] = world.run(step, plan, q)
    ref = results["two passes"]
    for name, got in results.items():
        for lid in range(LAYERS):
            assert torch.equal(got[lid][1], ref[lid][1]), (name, lid)
            torch.testing.assert_close(got[lid][0], ref[lid][0], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="FlashInfer's attention path needs CUDA")
def test_triton_attention_equals_flashinfer_attention():
    """`--sas-attention triton|flashinfer`: the same selection attended by the block-table kernel and by
    FlashInfer's decode over the gathered rows gives the same result (bf16, eager and planned as a graph)."""
    world = World(budget_blocks=4, seed=7)
    world.k = [k.bfloat16() for k in world.k]
    world.v = [v.bfloat16() for v in world.v]
    inp, q = world.batch([64, 257, 9, 130, 200], [0, 1, 2, 3, 4])
    q = q.bfloat16()
    outs = {}
    for attention in ("triton", "flashinfer"):
        step = world.step("triton", attention, [s.clone() for s in world.summaries], q_dtype=torch.bfloat16,
                          kv_dtype=torch.bfloat16)
        outs[attention] = world.run(step, _plan(step, world, inp), q)
    for lid in range(LAYERS):
        assert torch.equal(outs["triton"][lid][1], outs["flashinfer"][lid][1])
        torch.testing.assert_close(outs["triton"][lid][0].float(), outs["flashinfer"][lid][0].float(),
                                   rtol=2e-2, atol=2e-2)


def test_bf16_gate_copies_are_what_the_front_reads():
    """gate_dtype bf16: the fused front reads bf16 copies of the step's gates made when it is built (counted in
    device_nbytes), exactly as an fp32 step over gates rounded to bf16; every other path keeps the fp32 gate; a gate
    that is not the step's is refused."""
    world = World(3, 1, 1, seed=11)
    inp, q = world.batch([64, 257, 9, 130, 200], [0, 1, 2, 3, 4])
    summ_bf16 = [s.clone() for s in world.summaries]
    bf16 = world.step("triton", "triton", summ_bf16, gate_dtype=torch.bfloat16)
    fp32_gates = world.step("triton", "triton")
    per_gate = sum(t.numel() * 2 for t in bf16.front_weights(world.gates[0]))
    assert bf16.device_nbytes == fp32_gates.device_nbytes + LAYERS * per_gate
    assert all(t.dtype == torch.bfloat16 for t in bf16.front_weights(world.gates[1]))
    assert world.gates[0].attngate_linear_q.weight.dtype == torch.float32  # the gate itself is untouched
    with pytest.raises(RuntimeError, match="not among them"):
        bf16.front_weights(World(3, 1, 1, seed=12).gates[0])
    plan = _plan(bf16, world, inp)
    got = world.run(bf16, plan, q)

    rounded = World(3, 1, 1, seed=11)  # the same world, its gates rounded to bf16 and back
    for gate in rounded.gates:
        for t in gate.parameters():
            t.copy_(t.to(torch.bfloat16).float())
    summ_ref = [s.clone() for s in rounded.summaries]  # summarized by the unrounded gates, as the world's
    fp32 = rounded.step("triton", "triton", summ_ref)
    inp2, q2 = rounded.batch([64, 257, 9, 130, 200], [0, 1, 2, 3, 4])
    assert torch.equal(q, q2)
    ref = rounded.run(fp32, _plan(fp32, rounded, inp2), q2)
    for lid in range(LAYERS):
        assert torch.equal(got[lid][1], ref[lid][1]), lid
        torch.testing.assert_close(got[lid][0], ref[lid][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(summ_bf16[lid], summ_ref[lid], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="kernels='triton'"):
        world.step("torch", "torch", gate_dtype=torch.bfloat16)


def test_launch_options_warps_change_no_result_and_pdl_is_refused_by_the_interpreter():
    """Other warps give the same selection and output: a check on CUDA only (Triton's interpreter drops
    num_warps, so on CPU the two runs are the same launch); bad warps and, under the interpreter, PDL are
    refused everywhere."""
    from sas_backend.ops.fused_step import LaunchOptions, _interpreting

    world = World(3, 1, 1, seed=5)
    inp, q = world.batch([64, 257, 9, 130, 200], [0, 1, 2, 3, 4])
    outs = []
    for launch in (LaunchOptions(), LaunchOptions(front_warps=2, select_warps=8, attend_warps=8)):
        step = world.step("triton", "triton", [s.clone() for s in world.summaries], launch=launch)
        outs.append(world.run(step, _plan(step, world, inp), q))
    for lid in range(LAYERS):
        assert torch.equal(outs[0][lid][1], outs[1][lid][1])
        torch.testing.assert_close(outs[0][lid][0], outs[1][lid][0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="select_warps"):
        LaunchOptions(select_warps=3).check()
    if _interpreting():
        step = world.step("triton", "triton", launch=LaunchOptions(pdl=True))
        with pytest.raises(ValueError, match="PDL"):
            world.run(step, _plan(step, world, inp), q)
