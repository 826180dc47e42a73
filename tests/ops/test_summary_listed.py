"""The late-block repair of the device-side validity marks (`ops.summary.summarize_listed`): the Triton kernel
(persistent, the count read on the device) and the torch path against the plain statement (`naive.summarize_run`,
run by run), on listed blocks with entries past the count that must stay untouched."""

import pytest
import torch

from sas_backend.ops.summary.naive import summarize_run
from sas_backend.ops.summary.torch_path import summarize_listed
from sas_backend.ops.summary.triton import summarize_listed_triton
from tests.devices import DEVICE
from tests.ops.test_summary_triton import MAX_POS, _gate_params


def _case(h_kv, d, dg, b, n_sub, summary_dtype, k_dtype=torch.float32, listed=40, seed=0):
    """(k_buffer, summaries, pages [listed + 5], starts, tables and weights) over 64 pages."""
    g = torch.Generator().manual_seed(seed)
    num_pages = 64
    model_cs, gate_cs, w_k, k_norm = _gate_params(h_kv, d, dg, seed=seed)
    k_buf = (torch.randn(num_pages * b, h_kv, d, generator=g) * 2).to(DEVICE)
    if k_dtype != torch.float32:
        k_buf = k_buf.to(k_dtype)
    summaries = torch.randn(num_pages, h_kv, n_sub * dg, generator=g).to(DEVICE, summary_dtype)
    pages = (torch.randperm(num_pages - 1, generator=g)[: listed + 5] + 1).to(DEVICE)
    starts = (torch.randint(0, MAX_POS // b - 1, (listed + 5,), generator=g) * b).to(DEVICE)
    return k_buf, summaries, pages, starts, model_cs, gate_cs, w_k, k_norm


def _statement(k_buf, summaries, pages, starts, n, b, n_sub, model_cs, gate_cs, w_k, k_norm, k_scale):
    """What the first n listed blocks' rows must hold afterwards: run j of block i summarized from its S tokens."""
    want = summaries.clone()
    size = b // n_sub
    keys = k_buf.float() * k_scale
    offs = torch.arange(size, device=k_buf.device)
    for i in range(n):
        p, s = int(pages[i]), int(starts[i])
        for j in range(n_sub):
            slots = (p * b + j * size + offs)[None, :]
            positions = (s + j * size + offs)[None, :]
            run = summarize_run(keys, slots, positions, model_cs, gate_cs, w_k, k_norm)[0]
            want[p, :, j * run.shape[-1]:(j + 1) * run.shape[-1]] = run.to(want.dtype)
    return want


@pytest.mark.parametrize("h_kv,d,dg", [(1, 16, 16), (3, 24, 32), (7, 16, 16)])
@pytest.mark.parametrize("n_sub", [1, 2, 4])
@pytest.mark.parametrize("count,programs", [(0, 2), (1, 1), (17, 2), (40, 1), (40, 3)])
def test_summarize_listed_kernel(h_kv, d, dg, n_sub, count, programs):
    b = 8
    k_buf, summaries, pages, starts, model_cs, gate_cs, w_k, k_norm = _case(h_kv, d, dg, b, n_sub, torch.float32,
                                                                         seed=h_kv + n_sub)
    want = _statement(k_buf, summaries, pages, starts, count, b, n_sub, model_cs, gate_cs, w_k, k_norm, 1.0)
    n = torch.tensor([count], dtype=torch.int64, device=DEVICE)
    args = (pages, starts, n, b, model_cs, gate_cs, w_k, k_norm)
    got = summarize_listed_triton(k_buf, summaries.clone(), *args, sub_blocks=n_sub, programs=programs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # rows past the count untouched (exactly)
    torch.testing.assert_close(summarize_listed(k_buf, summaries.clone(), *args, sub_blocks=n_sub), want,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("summary_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_dtype,k_scale", [(torch.bfloat16, 1.0), (torch.float8_e4m3fn, 0.37)])
def test_summarize_listed_kernel_dtypes(summary_dtype, k_dtype, k_scale):
    """bf16 / fp8 keys (fp8 holds K / k_scale) into fp32 / bf16 summaries, block size 64, 4 runs a block."""
    b, n_sub = 64, 4
    k_buf, summaries, pages, starts, model_cs, gate_cs, w_k, k_norm = _case(2, 16, 16, b, n_sub, summary_dtype,
                                                                         k_dtype, listed=20, seed=3)
    n = torch.tensor([18], dtype=torch.int64, device=DEVICE)
    want = _statement(k_buf, summaries, pages, starts, 18, b, n_sub, model_cs, gate_cs, w_k, k_norm, k_scale)
    got = summarize_listed_triton(k_buf, summaries.clone(), pages, starts, n, b, model_cs, gate_cs, w_k, k_norm,
                                  k_scale, sub_blocks=n_sub, programs=2)
    tol = dict(rtol=1e-2, atol=1e-2) if summary_dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    untouched = torch.ones(summaries.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[pages[:18]] = False
    assert torch.equal(got[untouched], summaries[untouched])


def test_summarize_listed_kernel_checks_its_shapes():
    k_buf, summaries, pages, starts, model_cs, gate_cs, w_k, k_norm = _case(2, 16, 16, 8, 2, torch.float32)
    n = torch.ones(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="must be \\[num_pages, 2, 16\\]"):
        summarize_listed_triton(k_buf, summaries, pages, starts, n, 8, model_cs, gate_cs, w_k, k_norm)


@pytest.mark.parametrize("n_sub", [1, 4])
def test_the_fixed_shape_torch_form_captures_and_replays(n_sub):
    """The torch form devices without the kernel run (fixed shapes: every entry summarized, those past the count
    into page 0, the padding page) states the same summaries, and a captured region of it (tests/cpu_graph.py:
    no host sync, no data-dependent shape) replays at a new count."""
    from tests.cpu_graph import CpuGraph

    b = 8
    k_buf, summaries, pages, starts, model_cs, gate_cs, w_k, k_norm = _case(2, 16, 16, b, n_sub, torch.float32,
                                                                         listed=12, seed=4)
    pages, starts, k_buf = pages.cpu(), starts.cpu(), k_buf.cpu()
    tables = (model_cs.cpu(), gate_cs.cpu(), w_k.cpu(), k_norm.cpu())
    count = torch.tensor([5], dtype=torch.int64)
    out = summaries.cpu().clone()
    graph = CpuGraph()
    with graph.capture():
        summarize_listed(k_buf, out, pages, starts, count, b, *tables, sub_blocks=n_sub, fixed_shapes=True)
    for n in (5, 11, 0):
        out.copy_(summaries.cpu())
        count.fill_(n)
        graph.replay()
        want = _statement(k_buf, summaries.cpu(), pages, starts, n, b, n_sub, *tables, 1.0)
        torch.testing.assert_close(out[1:], want[1:], rtol=1e-4, atol=1e-5)  # row 0: the padding page's scratch
