"""The CPU stand-in's speculative-decoding ops (serve/cpu_shim/sgl_kernel/speculative.py, and
`assign_req_to_token_pool_cpu` in its __init__), each against a loop-by-loop statement of its definition on small
random and edge-case inputs, and, where SGLang ships one, against SGLang's own Triton kernel (run in the Triton
interpreter). The module under test is loaded from the source tree, not from the installed copy; a last test
checks that the installed copy (serve/install.sh installs the shim non-editable) is the source's."""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import pathlib
import random
import sys

import pytest
import torch

SHIM = pathlib.Path(__file__).resolve().parents[1] / "serve" / "cpu_shim" / "sgl_kernel"


def _load_source_shim():
    spec = importlib.util.spec_from_file_location(
        "sgl_kernel_shim_src", SHIM / "__init__.py", submodule_search_locations=[str(SHIM)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its `from .speculative import ...` resolves against this name
    spec.loader.exec_module(mod)
    return mod


shim = _load_source_shim()


def _case_id(value):
    return value if isinstance(value, str) else None
needs_interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="SGLang's Triton kernels run on CUDA here; "
                                       "the CPU-tensor comparison needs the Triton interpreter (CPU hosts)")


# ----------------------------------------------------------------------------------- trees
def random_tree(n: int, rng: random.Random):
    """A random draft tree of n nodes in topological order (parent[i] < i, node 0 the root), as parent
    indices and each node's children in a random sibling order."""
    parent = [-1] + [rng.randrange(i) for i in range(1, n)]
    children = [[c for c in range(n) if parent[c] == p] for p in range(n)]
    for ch in children:
        rng.shuffle(ch)
    return parent, children


def ancestor_mask(parent) -> torch.Tensor:
    """M[i, j]: j is i or one of i's ancestors (SGLang's tree masks include the diagonal)."""
    n = len(parent)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parent[j]
    return m


def links_from_children(children, n):
    """retrive_next_token / retrive_next_sibling of one tree: first child, next sibling in the given order."""
    nxt, sib = [-1] * n, [-1] * n
    for p, ch in enumerate(children):
        if ch:
            nxt[p] = ch[0]
        for a, b in zip(ch, ch[1:]):
            sib[a] = b
    return nxt, sib


# ------------------------------------------------------------------- reconstruct_indices_from_tree_mask
def reconstruct_reference(masks, seq_lens, n):
    """The definition, loop by loop (docstring of the op)."""
    positions, ridx, nxt, sib = [], [], [], []
    for b, m in enumerate(masks):
        par = [max([j for j in range(k) if m[k, j]], default=-1) for k in range(n)]
        for t in range(n):
            positions.append(seq_lens[b] + sum(bool(m[t, j]) for j in range(t)))
            ridx.append(b * n + t)
            nxt.append(min([k for k in range(t + 1, n) if m[k, t]], default=-1))
            sib.append(min([k for k in range(t + 1, n) if par[k] == par[t]], default=-1) if par[t] >= 0 else -1)
    return [torch.tensor(x, dtype=torch.int64) for x in (positions, ridx, nxt, sib)]


def run_reconstruct(op, masks, seq_lens, n, dtype=torch.bool, pad=0):
    bs = len(masks)
    flat = torch.cat([m.reshape(-1) for m in masks] + [torch.ones(pad, dtype=torch.bool)]).to(dtype) if bs else \
        torch.zeros(pad, dtype=dtype)
    positions = torch.full((bs * n,), -9, dtype=torch.int64)
    ridx, nxt, sib = (torch.full((bs, n), -9, dtype=torch.int64) for _ in range(3))
    op(flat, torch.tensor(seq_lens, dtype=torch.int64), positions, ridx, nxt, sib, bs, n)
    return positions, ridx.reshape(-1), nxt.reshape(-1), sib.reshape(-1)


def reconstruct_cases():
    rng = random.Random(0)
    cases = []
    for n in (1, 2, 4, 7, 12):
        for bs in (1, 3):
            trees = [ancestor_mask(random_tree(n, rng)[0]) for _ in range(bs)]
            cases.append((f"trees-n{n}-bs{bs}", trees, [rng.randrange(1, 100) for _ in range(bs)], n))
        g = torch.Generator().manual_seed(n)
        arbitrary = [torch.rand(n, n, generator=g) < 0.4 for _ in range(2)]  # not closed under ancestry
        cases.append((f"arbitrary-n{n}", arbitrary, [5, 0], n))
    chain = torch.ones(6, 6, dtype=torch.bool).tril()
    cases.append(("chain", [chain], [17], 6))
    cases.append(("roots-only", [torch.eye(5, dtype=torch.bool)], [3], 5))  # no node has a parent
    return cases


@pytest.mark.parametrize("name,masks,seq_lens,n", reconstruct_cases(), ids=_case_id)
def test_reconstruct_indices_matches_definition(name, masks, seq_lens, n):
    want = reconstruct_reference(masks, seq_lens, n)
    for dtype, pad in ((torch.bool, 0), (torch.uint8, 5)):  # uint8 masks and longer buffers are accepted too
        got = run_reconstruct(shim.reconstruct_indices_from_tree_mask, masks, seq_lens, n, dtype, pad)
        for w, g, what in zip(want, got, ("positions", "retrive_index", "next_token", "next_sibling")):
            assert torch.equal(w, g), (name, what, w, g)


def test_reconstruct_indices_empty_batch():
    positions = torch.full((0,), -9, dtype=torch.int64)
    empty = torch.full((0, 4), -9, dtype=torch.int64)
    shim.reconstruct_indices_from_tree_mask(torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.int64),
                                            positions, empty, empty.clone(), empty.clone(), 0, 4)


@needs_interpreter
@pytest.mark.parametrize("name,masks,seq_lens,n", reconstruct_cases(), ids=_case_id)
def test_reconstruct_indices_matches_sglang_triton(name, masks, seq_lens, n):
    from sglang.kernels.ops.speculative.reconstruct_tree import reconstruct_indices_from_tree_mask_triton

    want = run_reconstruct(reconstruct_indices_from_tree_mask_triton, masks, seq_lens, n)
    got = run_reconstruct(shim.reconstruct_indices_from_tree_mask, masks, seq_lens, n)
    for w, g in zip(want, got):
        assert torch.equal(w, g), name


# ---------------------------------------------------------------------------------- verify_tree_greedy
def verify_reference(trees, cand, target, steps, n):
    """Greedy acceptance by its definition: from the root, take the first child (in sibling order) whose
    draft token is the target's token after the current node; at most steps - 1 drafts."""
    bs = len(trees)
    predicts = [-7] * (bs * n)
    accept = [[-1] * steps for _ in range(bs)]
    nums = []
    for b, children in enumerate(trees):
        path = [0]
        while len(path) < steps:
            cur = path[-1]
            match = [c for c in children[cur] if cand[b][c] == target[b][cur]]
            if not match:
                break
            path.append(match[0])
        for i, p in enumerate(path):
            accept[b][i] = b * n + p
            predicts[b * n + p] = target[b][p]
        nums.append(len(path) - 1)
    return (torch.tensor(predicts, dtype=torch.int32), torch.tensor(accept, dtype=torch.int32),
            torch.tensor(nums, dtype=torch.int32))


def run_verify(op, trees, cand, target, steps, n):
    bs = len(trees)
    links = [links_from_children(ch, n) for ch in trees]
    predicts = torch.full((bs * n,), -7, dtype=torch.int32)
    accept = torch.full((bs, steps), -1, dtype=torch.int32)
    nums = torch.full((bs,), -5, dtype=torch.int32)
    op(predicts, accept, nums, torch.tensor(cand, dtype=torch.int64),
       torch.arange(bs * n, dtype=torch.int64).view(bs, n),
       torch.tensor([lk[0] for lk in links], dtype=torch.int64).view(bs, n),
       torch.tensor([lk[1] for lk in links], dtype=torch.int64).view(bs, n),
       torch.tensor(target, dtype=torch.int64).view(bs, n))
    return predicts, accept, nums


def verify_cases():
    rng = random.Random(1)
    cases = []
    for n in (1, 3, 6, 12):
        for steps in (1, 2, n, n + 2):
            bs = 4
            trees = [random_tree(n, rng)[1] for _ in range(bs)]
            vocab = 2  # few tokens: matches, misses and sibling fallbacks all happen
            cand = [[rng.randrange(vocab) for _ in range(n)] for _ in range(bs)]
            target = [[rng.randrange(vocab) for _ in range(n)] for _ in range(bs)]
            cases.append((f"random-n{n}-steps{steps}", trees, cand, target, steps, n))
    chain = [[[i + 1] if i + 1 < 5 else [] for i in range(5)]]
    cases.append(("chain-all-accepted", chain, [[9, 1, 2, 3, 4]], [[1, 2, 3, 4, 8]], 5, 5))
    cases.append(("chain-capped-by-steps", chain, [[9, 1, 2, 3, 4]], [[1, 2, 3, 4, 8]], 3, 5))
    cases.append(("chain-first-rejected", chain, [[9, 1, 2, 3, 4]], [[7, 2, 3, 4, 8]], 5, 5))
    # the second sibling matches after the first misses, then the walk continues below it
    tree = [[2, 1], [3], [], [], []]
    cases.append(("sibling-fallback", [tree], [[0, 5, 6, 7, 0]], [[5, 7, 0, 1, 0]], 5, 5))
    return cases


@pytest.mark.parametrize("name,trees,cand,target,steps,n", verify_cases(),
                         ids=_case_id)
def test_verify_tree_greedy_matches_definition(name, trees, cand, target, steps, n):
    want = verify_reference(trees, cand, target, steps, n)
    got = run_verify(shim.verify_tree_greedy_cpu, trees, cand, target, steps, n)
    for w, g, what in zip(want, got, ("predicts", "accept_index", "accept_token_num")):
        assert torch.equal(w, g), (name, what, w, g)


def test_verify_tree_greedy_known_chain():
    """A hand-checked chain: drafts 1, 2, 3 after the root; the target says 1, 2, then 5 (not 3)."""
    chain = [[[1], [2], [3], []]]
    predicts, accept, nums = run_verify(shim.verify_tree_greedy_cpu, chain, [[0, 1, 2, 3]], [[1, 2, 5, 6]], 4, 4)
    assert nums.tolist() == [2]
    assert accept.tolist() == [[0, 1, 2, -1]]
    assert predicts.tolist() == [1, 2, 5, -7]  # two accepted drafts, then the bonus token 5


@needs_interpreter
@pytest.mark.parametrize("name,trees,cand,target,steps,n", verify_cases(),
                         ids=_case_id)
def test_verify_tree_greedy_matches_sglang_triton(name, trees, cand, target, steps, n):
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_kernel_triton

    def triton_op(predicts, accept, nums, cand_t, ridx, nxt, sib, target_t):
        bs = cand_t.shape[0]
        verify_tree_greedy_kernel_triton[(bs,)](predicts, accept, nums, cand_t, ridx, nxt, sib, target_t,
                                                batch_size=bs, num_speculative_tokens=accept.shape[1],
                                                num_draft_tokens=cand_t.shape[1])

    want = run_verify(triton_op, trees, cand, target, steps, n)
    got = run_verify(shim.verify_tree_greedy_cpu, trees, cand, target, steps, n)
    for w, g in zip(want, got):
        assert torch.equal(w, g), name


# ------------------------------------------------------------------------------------- cache slots
def test_assign_extend_cache_locs_matches_definition():
    g = torch.Generator().manual_seed(2)
    req_to_token = torch.randint(0, 10_000, (6, 40), generator=g, dtype=torch.int32)
    rpi = torch.tensor([4, 0, 2, 5], dtype=torch.int64)
    start = torch.tensor([3, 0, 10, 39], dtype=torch.int64)
    end = torch.tensor([7, 0, 22, 40], dtype=torch.int64)  # an empty range, one ending at the row's end
    out = torch.full((30,), -3, dtype=torch.int64)
    shim.assign_extend_cache_locs_cpu(rpi, req_to_token, start, end, out, 40)
    want = []
    for i in range(4):
        want += [int(req_to_token[rpi[i], j]) for j in range(int(start[i]), int(end[i]))]
    assert out[: len(want)].tolist() == want
    assert (out[len(want):] == -3).all()  # the rest is left as it was
    with pytest.raises(ValueError):
        shim.assign_extend_cache_locs_cpu(rpi, req_to_token, start, end, out, 41)
    shim.assign_extend_cache_locs_cpu(rpi[:0], req_to_token, start[:0], end[:0], out, 40)  # empty batch


def test_assign_req_to_token_pool_matches_definition():
    g = torch.Generator().manual_seed(3)
    req_to_token = torch.zeros((5, 32), dtype=torch.int32)
    rpi = torch.tensor([3, 1, 4], dtype=torch.int64)
    start = torch.tensor([5, 0, 31], dtype=torch.int64)
    end = torch.tensor([9, 0, 32], dtype=torch.int64)
    locs = torch.randint(1, 1000, (5,), generator=g, dtype=torch.int64)
    want = req_to_token.clone()
    at = 0
    for i in range(3):
        for j in range(int(start[i]), int(end[i])):
            want[rpi[i], j] = int(locs[at])
            at += 1
    shim.assign_req_to_token_pool_cpu(rpi, req_to_token, start, end, locs, req_to_token.shape[1])
    assert torch.equal(req_to_token, want)


def test_fill_accept_out_cache_loc_matches_definition():
    accept = torch.tensor([[0, 1, -1, -1], [4, 6, 7, -1], [8, -1, -1, -1]], dtype=torch.int32)
    out_cache_loc = torch.arange(100, 112, dtype=torch.int64)
    for size in (None, 12, 6, 0):
        got = torch.full((12,), -2, dtype=torch.int64)
        shim.fill_accept_out_cache_loc_cpu(accept, out_cache_loc, got, size)
        flat = accept.reshape(-1).tolist()[: 12 if size is None else size]
        want = [int(out_cache_loc[a]) for a in flat if a != -1]
        assert got[: len(want)].tolist() == want and (got[len(want):] == -2).all(), size
    none = torch.full((3,), -2, dtype=torch.int64)
    shim.fill_accept_out_cache_loc_cpu(torch.full((1, 3), -1, dtype=torch.int32), out_cache_loc, none)
    assert (none == -2).all()


# --------------------------------------------------------------------------------------- KV moves
@pytest.mark.parametrize("tgt,src", [
    ([0, 1], [1, 0]),  # a swap: every source must be read before any target is written
    ([2, 3, 4], [3, 4, 5]),  # a shift onto overlapping rows
    ([5, 6, 7], [5, 6, 7]),  # onto themselves: nothing changes
    ([9, 1, 3, 0], [0, 0, 8, 9]),  # a source used twice
    ([], []),
])
def test_copy_all_layer_kv_cache_matches_definition(tgt, src):
    g = torch.Generator().manual_seed(4)
    buffers = [torch.randn(10, 3, 4, generator=g), torch.randn(10, 2, 8, generator=g).to(torch.bfloat16),
               torch.randn(10, 5, generator=g)]
    before = [b.clone() for b in buffers]
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in buffers])
    shim.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor(tgt, dtype=torch.int64),
                                     torch.tensor(src, dtype=torch.int64))
    for b, old in zip(buffers, before):
        want = old.clone()
        for t, s in zip(tgt, src):
            want[t] = old[s]
        assert torch.equal(b, want)


def test_copy_all_layer_kv_cache_reads_raw_rows():
    """The op writes exactly the target rows' bytes and nothing beside them (rows are `strides` bytes apart)."""
    buf = torch.arange(6 * 4, dtype=torch.int32).view(6, 4)
    guard = bytes((ctypes.c_uint8 * 96).from_address(buf.data_ptr()))
    shim.copy_all_layer_kv_cache_cpu(torch.tensor([buf.data_ptr()], dtype=torch.uint64), torch.tensor([16]),
                                     torch.tensor([5]), torch.tensor([0]))
    after = bytes((ctypes.c_uint8 * 96).from_address(buf.data_ptr()))
    assert after[:80] == guard[:80] and after[80:] == guard[:16]


# ------------------------------------------------------------------------------------ the installed copy
def test_installed_shim_is_the_source():
    """serve/install.sh installs the shim as a copy: after editing it, reinstall
    (`.venv/bin/pip install --no-deps ./serve/cpu_shim`) or servers run the old ops."""
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or spec.origin is None:
        pytest.skip("no sgl_kernel installed (a GPU host, or the shim was never installed)")
    installed = pathlib.Path(spec.origin).parent
    if "CPU stand-in" not in (installed / "__init__.py").read_text():
        pytest.skip(f"{installed} is a real sgl_kernel, not the CPU stand-in")
    for name in ("__init__.py", "speculative.py"):
        src = hashlib.sha256((SHIM / name).read_bytes()).hexdigest()
        dst = installed / name
        assert dst.exists() and hashlib.sha256(dst.read_bytes()).hexdigest() == src, (
            f"the installed {dst} differs from serve/cpu_shim/sgl_kernel/{name}: "
            "reinstall with `.venv/bin/pip install --no-deps ./serve/cpu_shim`")
