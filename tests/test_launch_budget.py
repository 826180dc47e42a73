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
