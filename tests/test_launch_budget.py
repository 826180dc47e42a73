"""docs/launch-budget.md is what bench/launch_budget.py prints from the code's own grid sizes, so the paper
budget the next GPU run checks follows every change to the fused kernels' splits."""


import launch_budget  # noqa: E402


def test_launch_budget_doc_is_generated_from_the_code():
    assert launch_budget.main(["--check"]) == 0, "regenerate: python bench/launch_budget.py > docs/launch-budget.md"


def test_budget_rows_follow_the_workspace():
    rows = {name: grid for name, grid, *_ in launch_budget.kernel_rows(262144, 1)}
    assert rows["front (steady)"] == (1, 8, 16 + 8)  # G * 64/16 gate-query units + 64/8 summary units
    assert rows["select"] == (1, 8, 4096 // 128)  # chunks of 4 * K = 128 blocks over the graph width
    assert rows["attend"][2] > 1  # batch 1 splits the K + 1 blocks


def test_merge_tails_add_and_every_program_pays_its_fence(monkeypatch):
    """Issue 64 item 6: the merge starts after the bandwidth phase (it adds), and a split launch's programs each pay
    FENCE_US. With the device made bandwidth-bound (1 GB/s), attend at 8K batch 1 costs its bytes plus its merge
    tail; with bandwidth free, its longest program plus the fence plus the tail."""
    rows = {n: (g, b, t) for n, g, b, _, t in launch_budget.kernel_rows(8192, 1)}
    grid, kv, fast = rows["attend"]
    splits = grid[2]
    assert splits > 1
    merge_us = (splits * launch_budget.G * launch_budget.D * 4 + splits * 2 * launch_budget.G * 4) \
        / launch_budget.PROGRAM_GBS / 1e3
    prog_us = launch_budget.B * launch_budget.D * 2 * 2 / launch_budget.PROGRAM_GBS / 1e3  # one block a split
    assert fast == max(launch_budget.FLOOR_US, kv / launch_budget.DEVICE_GBS / 1e3,
                       prog_us + launch_budget.FENCE_US) + merge_us
    monkeypatch.setattr(launch_budget, "DEVICE_GBS", 1.0)
    slow = {n: t for n, _, _, _, t in launch_budget.kernel_rows(8192, 1)}["attend"]
    assert slow == kv / 1.0 / 1e3 + merge_us  # the tail is not hidden under the bandwidth phase


def test_cheaper_second_level_designs_change_only_what_they_name():
    """The cheaper second-level designs (docs/launch-budget.md, not served): a 4-bit key copy scales the second
    level's bytes by INT4_KEY_BYTES / 2 and nothing else; ranking in the attend drops the second level's select
    tail (it costs its floor at least, even reading nothing) and adds the rank prologue to the attend alone."""
    def rows(**kw):
        return {n: (b, t) for n, _, b, _, t in launch_budget.kernel_rows(32768, 8, 2, 2, rerank=2, **kw)}

    bf16, int4 = rows(), rows(rerank_key_bytes=launch_budget.INT4_KEY_BYTES)
    assert int4["rerank"][0] == int(bf16["rerank"][0] * launch_budget.INT4_KEY_BYTES / 2)
    assert int4["rerank"][1] < bf16["rerank"][1]
    assert {n: v for n, v in int4.items() if n != "rerank"} == {n: v for n, v in bf16.items() if n != "rerank"}
    ranked = rows(rank_in_attend=True)
    assert ranked["rerank"][1] < bf16["rerank"][1] and ranked["attend"][1] > bf16["attend"][1]
    assert ranked["attend"][0] == bf16["attend"][0] and ranked["select"] == bf16["select"]
    nothing = {n: t for n, _, _, _, t in launch_budget.kernel_rows(8192, 1, 2, 2, rerank=2, rerank_key_bytes=0,
                                                                 rank_in_attend=True)}
    assert nothing["rerank"] == launch_budget.FLOOR_US


def test_four_bit_summaries_scale_only_what_select_reads():
    """4-bit sub-block summaries (docs/launch-budget.md, a screen): select's bytes scale by INT4_SUMMARY_BYTES / 2
    and no other kernel's row changes; 4 of them a block read about one bf16 summary's bytes."""
    def rows(summary_bytes):
        return {n: (b, t) for n, _, b, _, t in launch_budget.kernel_rows(
            262144, 8, summary_bytes, 2, sub_blocks=4, rerank=2, rank_in_attend=True)}

    bf16, int4 = rows(2), rows(launch_budget.INT4_SUMMARY_BYTES)
    cand = (262144 - 1) // launch_budget.B
    marks = 8 * cand * 8  # the rows' validity / position bytes select reads beside the summaries
    assert int4["select"][0] - marks == (bf16["select"][0] - marks) * launch_budget.INT4_SUMMARY_BYTES / 2
    assert int4["select"][1] < bf16["select"][1]
    assert {n: v for n, v in int4.items() if n != "select"} == {n: v for n, v in bf16.items() if n != "select"}
    assert 1.0 < 4 * launch_budget.INT4_SUMMARY_BYTES / 2 < 1.1
