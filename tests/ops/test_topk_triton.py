"""select_blocks_triton vs the plain-torch select_blocks: integer outputs must be identical."""

import pytest
import torch

from sas_backend.ops.topk.naive import select_blocks
from sas_backend.ops.topk.triton import select_blocks_triton
from tests.devices import DEVICE


def _both(scores, n_cand, k, sink=0, local=0):
    n_cand = torch.as_tensor(n_cand, dtype=torch.int64, device=DEVICE)
    ref = select_blocks(scores, n_cand, k, sink, local)
    out = select_blocks_triton(scores, n_cand, k, sink, local)
    assert out.dtype == torch.int32 and out.shape == ref.shape
    assert torch.equal(out, ref), f"\nref={ref}\nout={out}"
    return out


def _structure_ok(sel, n_cand, k):
    """Ascending, -1 padded, exactly min(n, K) distinct candidates per row."""
    for r, n in enumerate(n_cand):
        for row in sel[r]:
            take = row[row >= 0]
            assert take.numel() == min(int(n), k)
            assert torch.all(row[take.numel():] == -1)
            assert torch.all(take[1:] > take[:-1]) and (take.numel() == 0 or int(take[-1]) < int(n))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_topk_random(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(5, 3, 70, generator=g).to(DEVICE)
    k = 8
    # 0 candidates, fewer than K, exactly K, K + 1, many, all M
    n_cand = [0, 5, k, k + 1, 40, 70]
    n_cand = (n_cand[seed:] + n_cand[:seed])[:5]
    out = _both(scores, n_cand, k)
    _structure_ok(out, n_cand, k)


def test_topk_exact_fewer_more_than_k():
    scores = torch.randn(3, 2, 32, device=DEVICE)
    out = _both(scores, [4, 6, 20], 6)
    assert out[0, 0].tolist() == [0, 1, 2, 3, -1, -1]  # fewer than K: all, padded
    assert out[1, 1].tolist() == [0, 1, 2, 3, 4, 5]  # exactly K: all
    _structure_ok(out, [4, 6, 20], 6)


def test_topk_ties_go_to_lower_index():
    scores = torch.zeros(1, 2, 16, device=DEVICE)
    scores[0, 0, [3, 9]] = 1.0  # two winners, then the 2 lowest of the zero ties
    twos = [1.0, 2, 2, 1, 2, 0, 2, 2, 1, 1, 2, 0, 0, 0, 0, 0]  # 6 twos for K=4
    scores[0, 1] = torch.tensor(twos, device=DEVICE)
    out = _both(scores, [16], 4)
    assert out[0, 0].tolist() == [0, 1, 3, 9]
    assert out[0, 1].tolist() == [1, 2, 4, 6]


def test_topk_heavy_ties_random():
    g = torch.Generator().manual_seed(11)
    scores = torch.randint(0, 4, (4, 3, 300), generator=g).float().to(DEVICE)
    scores[1] = 0.5  # a row of all-equal scores
    _both(scores, [300, 257, 100, 33], 32)


def test_topk_special_values():
    scores = torch.randn(2, 2, 24, device=DEVICE)
    scores[0, 0, [1, 5]] = float("nan")  # NaN counts as -inf
    scores[0, 0, 2:5] = float("-inf")
    scores[0, 0, 6:20] = float("nan")
    scores[0, 1, [0, 7]] = float("inf")
    scores[1, 0] = 0.0
    scores[1, 0, 1::2] = -0.0  # -0.0 ties with +0.0: lower index wins
    scores[1, 1, :] = float("-inf")
    out = _both(scores, [24, 24], 10)
    assert out[1, 0].tolist() == list(range(10))
    assert out[1, 1].tolist() == list(range(10))


def test_topk_ignores_non_candidates():
    scores = torch.randn(2, 2, 40, device=DEVICE)
    scores[:, :, 20:] = 100.0  # beyond num_candidates: never chosen
    scores[:, :, 25] = float("nan")
    out = _both(scores, [20, 30], 5)
    assert (out[0] < 20).all()


@pytest.mark.parametrize(
    "n,k,sink,local,expected",
    [
        (10, 3, 2, 3, [0, 1, 9]),  # more forced than K: sinks, then the nearest local block
        (10, 4, 2, 3, [0, 1, 8, 9]),
        (10, 1, 2, 3, [0]),  # K below the sink count: lowest sinks
        (4, 3, 2, 3, [0, 1, 3]),  # sink and local overlap at block 1 (counts as a sink)
        (10, 5, 0, 7, [5, 6, 7, 8, 9]),  # local only, more than K: nearest ones
        (3, 5, 2, 2, [0, 1, 2, -1, -1]),  # fewer candidates than K: all
    ],
)
def test_topk_forced_priority(n, k, sink, local, expected):
    # Scores favour the non-forced middle blocks, to show forced blocks still win.
    scores = torch.full((1, 2, 12), 5.0, device=DEVICE)
    scores[0, 1] = float("inf")  # forced blocks outrank even +inf scores
    out = _both(scores, [n], k, sink, local)
    assert out[0, 0].tolist() == expected
    assert out[0, 1].tolist() == expected


@pytest.mark.parametrize("seed", [0, 1])
def test_topk_forced_priority_ignores_scores(seed):
    # Random scores inside the forced sets must not change which forced blocks are kept.
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(2, 3, 30, generator=g).to(DEVICE)
    out = _both(scores, [30, 12], 4, sink=3, local=4)
    assert out[0].tolist() == [[0, 1, 2, 29]] * 3
    assert out[1].tolist() == [[0, 1, 2, 11]] * 3
    out = _both(scores, [30, 12], 2, sink=3, local=4)
    assert out[0].tolist() == [[0, 1]] * 3
    out = _both(scores, [30, 12], 3, sink=0, local=6)
    assert out[0].tolist() == [[27, 28, 29]] * 3


@pytest.mark.parametrize("sink,local", [(1, 0), (0, 2), (2, 2), (3, 5)])
def test_topk_forced_plus_scores(sink, local):
    g = torch.Generator().manual_seed(sink * 10 + local)
    scores = torch.randn(4, 3, 64, generator=g).to(DEVICE)
    n_cand = [64, 17, 9, 3]
    out = _both(scores, n_cand, 12, sink, local)
    _structure_ok(out, n_cand, 12)
    for r, n in enumerate(n_cand):
        forced = set(range(min(sink, n))) | set(range(max(n - local, 0), n))
        for h in range(3):
            assert forced <= set(out[r, h].tolist())


def test_topk_k_edge_cases():
    scores = torch.randn(2, 2, 6, device=DEVICE)
    _both(scores, [6, 2], 10)  # K > M: all candidates, padded
    _both(scores, [9, 6], 4)  # num_candidates > M is clamped to M
    assert select_blocks_triton(scores, torch.tensor([6, 2], device=DEVICE), 0).shape == (2, 2, 0)


def test_topk_non_contiguous_and_preallocated():
    big = torch.randn(3, 4, 50, device=DEVICE)
    scores = big[:, 1:3, :40]  # strided rows
    out = torch.full((3, 2, 7), 99, dtype=torch.int32, device=DEVICE)
    n_cand = torch.tensor([40, 7, 3], device=DEVICE)
    res = select_blocks_triton(scores, n_cand, 7, out=out)
    assert res is out
    assert torch.equal(out, select_blocks(scores, n_cand, 7))


def test_topk_large_m():
    # Several chunks per row: thresholds and tie ranks carry across chunks.
    g = torch.Generator().manual_seed(5)
    m = 8192
    scores = torch.randn(2, 2, m, generator=g).to(DEVICE)
    scores[1, 0] = torch.randint(0, 50, (m,), generator=g).float().to(DEVICE)  # ties spanning chunks
    scores[1, 1, 100:] = scores[1, 1, :100].repeat(m // 100 + 1)[: m - 100]
    out = _both(scores, [m, m - 77], 64, sink=1, local=2)
    _structure_ok(out, [m, m - 77], 64)
    _both(scores, [m, 5000], 300)


def test_topk_stress_distributions():
    # Rows that end the radix search at different passes: distinct magnitudes (decided by the
    # top byte), continuous values (usually a middle byte), exact ties (all four bytes), and
    # mixes of +-inf, NaN, negatives and denormals.
    g = torch.Generator().manual_seed(123)
    m, rows = 96, []
    rows.append(10.0 ** torch.linspace(-30, 30, m))  # one value per top-byte bucket
    rows.append(-(10.0 ** torch.linspace(-30, 30, m)))
    rows.append(torch.randn(m, generator=g))
    rows.append(torch.randn(m, generator=g) * 1e-3 - 5)
    rows.append(torch.randint(-2, 3, (m,), generator=g).float())
    rows.append(torch.where(torch.rand(m, generator=g) < 0.5, float("-inf"), torch.randn(m, generator=g)))
    rows.append(torch.where(torch.rand(m, generator=g) < 0.3, float("nan"), torch.randn(m, generator=g)))
    rows.append(torch.randint(0, 3, (m,), generator=g).float() * 1e-40)  # denormals and zeros
    scores = torch.stack(rows).reshape(4, 2, m).to(DEVICE)  # drawn on CPU: same data everywhere
    for k in (1, 7, 31, 95):
        _both(scores, [m, m - 1, 50, 40], k)


# Rows wider than one chunk (1024 blocks for K <= 256) take the two-phase path: each chunk keeps
# its local top K in the workspace, then one program per row selects among the survivors.


@pytest.mark.parametrize("m,k", [(4096, 32), (8192, 64)])
def test_topk_long_rows_many_chunks(m, k):
    g = torch.Generator().manual_seed(m + k)
    scores = torch.randn(2, 2, m, generator=g)
    scores[1, 1] = torch.randint(0, 20, (m,), generator=g).float()  # heavy ties across chunks
    scores = scores.to(DEVICE)
    n_cand = [m, m - 1000]
    out = _both(scores, n_cand, k)
    _structure_ok(out, n_cand, k)
    _both(scores, n_cand, k, sink=2, local=3)


def test_topk_ties_across_chunk_borders():
    m, k = 4096, 40
    scores = torch.zeros(1, 3, m)
    scores[0, 0, 1000:1031] = 1.0  # 31 winners straddling the 1024 border, then 9 zero ties
    scores[0, 1, 1020:1028] = 2.0
    scores[0, 1, ::97] = 1.0  # ties for the last places in every chunk
    scores = scores.to(DEVICE)  # row 2: all equal
    out = _both(scores, [m], k)
    assert out[0, 0].tolist() == list(range(9)) + list(range(1000, 1031))
    assert out[0, 2].tolist() == list(range(k))


def test_topk_forced_blocks_in_other_chunks():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(3, 2, 5000, generator=g).to(DEVICE)
    # sinks in chunk 0, local blocks in the last chunk; in row 1 they straddle a chunk border
    n_cand = [5000, 1026, 3000]
    out = _both(scores, n_cand, 32, sink=3, local=5)
    for r, n in enumerate(n_cand):
        for h in range(2):
            assert {0, 1, 2} | set(range(n - 5, n)) <= set(out[r, h].tolist())
    # more forced than K: sinks, then local blocks nearest the current one, across chunks
    out = _both(scores, n_cand, 6, sink=3, local=5)
    assert out[1, 0].tolist() == [0, 1, 2, 1023, 1024, 1025]


def test_topk_rows_of_very_different_lengths():
    g = torch.Generator().manual_seed(9)
    m, k = 8192, 64
    scores = torch.randn(6, 2, m, generator=g)
    n_cand = [3, m, 0, 1025, 64, 2000]  # chunk programs past a row's end do nothing
    for r, n in enumerate(n_cand):
        scores[r, :, n:] = 100.0  # beyond num_candidates: never chosen
    scores = scores.to(DEVICE)
    out = _both(scores, n_cand, k, sink=1, local=2)
    _structure_ok(out, n_cand, k)


def test_topk_workspace_reused():
    from sas_backend.ops.topk.triton import topk_workspace_numel

    g = torch.Generator().manual_seed(4)
    m, k = 4096, 32
    ws = torch.full((topk_workspace_numel(4, 2, m, k),), 7, dtype=torch.int32, device=DEVICE)
    scores = torch.randn(4, 2, m, generator=g).to(DEVICE)
    n_cand = torch.tensor([m, 100, 3000, 0], device=DEVICE)
    res = select_blocks_triton(scores, n_cand, k, 1, 2, workspace=ws)
    assert torch.equal(res, select_blocks(scores, n_cand, k, 1, 2))
    # a smaller batch and narrower rows reuse the same buffer (stale contents must not matter)
    res = select_blocks_triton(scores[:2, :, :2500], n_cand[:2], k, workspace=ws)
    assert torch.equal(res, select_blocks(scores[:2, :, :2500], n_cand[:2], k))
    with pytest.raises(ValueError):
        select_blocks_triton(scores, n_cand, k, workspace=ws[:10])


@pytest.mark.parametrize("chunk", [16, 64, 256])
def test_topk_any_chunk_width_gives_the_same_answer(chunk):
    """The tuning knob (`chunk`): narrower chunks than the default change the work split, not the result,
    with forced blocks, ties across chunk borders, rows shorter than one chunk and K above a chunk's width."""
    g = torch.Generator().manual_seed(chunk)
    m = 700
    scores = torch.randn(3, 2, m, generator=g)
    scores[1, 0] = torch.randint(0, 5, (m,), generator=g).float()
    scores = scores.to(DEVICE)
    n_cand = torch.tensor([m, 150, 10], device=DEVICE)
    for k, sink, local in ((8, 0, 0), (32, 1, 2), (100, 0, 0)):
        got = select_blocks_triton(scores, n_cand, k, sink, local, chunk=chunk)
        assert torch.equal(got, select_blocks(scores, n_cand, k, sink, local)), (k, sink, local)
    with pytest.raises(ValueError, match="power of two"):
        select_blocks_triton(scores, n_cand, 8, chunk=100)
    # the width is really used: these rows fit one default chunk (no workspace), not one of `chunk`
    tiny = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    select_blocks_triton(scores, n_cand, 8, workspace=tiny)
    with pytest.raises(ValueError, match="workspace"):
        select_blocks_triton(scores, n_cand, 8, chunk=chunk, workspace=tiny)
