"""The IF-node helpers (`sas_backend.backend.graph_branch`): their contract on CPU, and on a GPU the
behaviour the decode-step benchmark's dense/sparse branch timing relies on."""

from __future__ import annotations

import pytest
import torch

from sas_backend.backend.graph_branch import BranchFlags, captured_if, capturing, conditional_nodes_supported


def test_no_if_nodes_without_cuda_and_flags_follow_the_host_choice():
    if not torch.cuda.is_available():
        assert not conditional_nodes_supported() and not capturing()
    flags = BranchFlags("cpu")
    for first in (True, False, True):
        flags.set(first)
        assert flags.value is first
        assert (bool(flags.first), bool(flags.second)) == (first, not first)
        assert flags.first.dim() == 0 and flags.first.dtype == torch.bool


@pytest.mark.parametrize("flag", [torch.tensor(True), torch.ones(1, dtype=torch.bool), torch.tensor(1)])
def test_an_if_node_flag_must_be_a_0d_bool_cuda_tensor(flag):
    if flag.dim() == 0 and flag.dtype == torch.bool and torch.cuda.is_available():
        pytest.skip("a valid flag on this machine")
    with pytest.raises(ValueError, match="0-d bool CUDA tensor"):
        with captured_if(flag):
            pass


@pytest.mark.gpu
def test_if_nodes_run_the_flagged_branch_each_replay():
    """Two IF bodies in one graph write one buffer: each replay runs exactly the flagged body, and the
    flags are read at replay (set after capture, by an async copy from pinned memory)."""
    if not conditional_nodes_supported():
        pytest.skip("needs a CUDA >= 12.4 GPU with CUDA graph IF nodes")
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    out = torch.zeros_like(x)
    flags = BranchFlags("cuda")
    flags.set(True)
    out.copy_(x * 2)  # warm both bodies' kernels before capture
    out.copy_(x + 100)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert capturing()
        with captured_if(flags.first):
            out.copy_(x * 2)
        with captured_if(flags.second):
            out.copy_(x + 100)
    for first in (False, True, False):
        out.fill_(-1)
        flags.set(first)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x * 2 if first else x + 100)
