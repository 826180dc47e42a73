"""The late-block list of the device-side validity marks (`ops.late_blocks`): the Triton kernel and the torch path
against the plain statement, on rows of mixed lengths (none complete, one completing its block, more than one
chunk of blocks), a radix prefix two rows share, and random marks."""

import collections

import pytest
import torch

from sas_backend.ops.late_blocks.naive import late_blocks
from sas_backend.ops.late_blocks.torch_path import list_late_blocks_torch
from sas_backend.ops.late_blocks.triton import CHUNK, list_late_blocks_triton
from tests.devices import DEVICE

B = 64


def _case(seed, lens, num_pages=6000):
    """(block table `[bs, M + 1]`, candidates, seq_lens, marks): each row on its own random pages, rows 0 and 1
    sharing their first 5 blocks; seq_lens = lens (the step's), candidates (lens - 1) // b."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens, dtype=torch.int64)
    width = int((lens.max() - 1) // B) + 1
    pages = (torch.randperm(num_pages - 1, generator=g)[: lens.numel() * width] + 1).view(lens.numel(), width)
    pages[1, :5] = pages[0, :5]
    valid = torch.rand(num_pages, generator=g) < 0.6
    valid[pages[0, 2]] = False  # a shared page that is late for both rows
    return pages * B, (lens - 1) // B, lens, valid


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("seed,lens", [(0, [900, 700, 1, 64, 65, 128]), (1, [CHUNK * B + 5 * B, 320, 3 * B]),
                                       (2, [2 * CHUNK * B + 1, 2 * CHUNK * B])])
def test_list_late_blocks(impl, seed, lens):
    table, ncand, seq_lens, valid = _case(seed, lens)
    want, want_after = late_blocks(table, ncand, seq_lens, valid, B)
    n_max = table.shape[0] * (table.shape[1] - 1) + 1
    pages, starts = (torch.full((n_max,), -7, dtype=torch.int64, device=DEVICE) for _ in range(2))
    count, total = torch.full((1,), 99, dtype=torch.int64, device=DEVICE), torch.full((1,), 5, dtype=torch.int64,
                                                                                        device=DEVICE)
    flag = torch.zeros((), dtype=torch.bool, device=DEVICE)
    marks = valid.to(DEVICE)
    fn = list_late_blocks_triton if impl == "triton" else list_late_blocks_torch
    if impl == "torch":
        count.zero_()
    fn(table.to(DEVICE), ncand.to(DEVICE), seq_lens.to(DEVICE), marks, B, pages, starts, count, flag, total)
    n = int(count)
    got = list(zip(pages[:n].tolist(), starts[:n].tolist()))
    # The torch path lists row-major, a shared page once per row. The kernel's rows land in any order, and a shared
    # page is listed by every row that read its mark before another row set it: at least once.
    if impl == "torch":
        assert got == want
    else:
        assert set(got) == set(want) and len(set(want)) <= n <= len(want)
        assert max(collections.Counter(got).values(), default=1) <= max(collections.Counter(want).values(), default=1)
    assert bool(flag) == (n > 0) and int(total) == 5 + n
    want_after[0] |= impl == "torch"  # the torch path marks page 0 (padding) for the other columns
    assert torch.equal(marks.cpu(), want_after)


def test_list_late_blocks_nothing_late_and_padded_rows():
    """Marked pages and graph padding rows (length 1, request row 0): nothing listed, the flag cleared."""
    table, ncand, seq_lens, valid = _case(3, [500, 1, 1])
    valid[:] = True
    pages, starts = (torch.zeros(table.shape[0] * (table.shape[1] - 1) + 1, dtype=torch.int64, device=DEVICE)
                     for _ in range(2))
    count, total = torch.zeros(1, dtype=torch.int64, device=DEVICE), torch.zeros(1, dtype=torch.int64, device=DEVICE)
    flag = torch.ones((), dtype=torch.bool, device=DEVICE)
    list_late_blocks_triton(table.to(DEVICE), ncand.to(DEVICE), seq_lens.to(DEVICE), valid.to(DEVICE), B, pages,
                            starts, count, flag, total)
    assert int(count) == 0 and not bool(flag) and int(total) == 0
