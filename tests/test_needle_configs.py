"""bench/needle.py's server list: every selector x budget, the gate per forced-block setting."""

from __future__ import annotations

import argparse
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent


def _args(**kw):
    base = dict(gate="g", gate_forced=None, serve_default=False, selectors=["gate"], budgets=[1024],
                prompt_anchors=None)
    return argparse.Namespace(**{**base, **kw})


def test_training_free_selector_without_forced_blocks():  # it crashed (unpacked None) before 7edcd15
    import needle

    names = [name for name, _, _ in needle.server_configs(_args(selectors=["quest", "gate"], budgets=[2048]))]
    assert names == ["dense", "sas quest b2048", "sas gate b2048"]


def test_gate_once_per_forced_setting_and_training_free_once():
    import needle

    configs = needle.server_configs(_args(selectors=["gate", "sink-local"], gate_forced=["1,1", "0,0"]))
    assert [c[0] for c in configs] == ["dense", "sas gate+s1l1 b1024", "sas gate+s0l0 b1024", "sas sink-local b1024"]
    assert configs[1][2][-4:] == ["--sas-sink-blocks", "1", "--sas-local-blocks", "1"]
    assert "--sas-gate" not in configs[3][2]


def test_prompt_anchors_go_to_ranking_selectors_only():
    import needle

    configs = needle.server_configs(_args(selectors=["gate", "quest", "sink-local"], gate_forced=["1,1"],
                                          prompt_anchors=4))
    assert [c[0] for c in configs] == ["dense", "sas gate+s1l1+a4 b1024", "sas quest+a4 b1024", "sas sink-local b1024"]
    for _, _, extra in configs[1:3]:
        assert extra[extra.index("--sas-prompt-anchors") + 1] == "4"
    assert "--sas-prompt-anchors" not in configs[0][2] + configs[3][2]


def test_dense_from_reuses_an_earlier_records_dense_answers(tmp_path, monkeypatch):
    """--dense-from: a second gate's run asks only its own servers; the dense row is the earlier record's."""
    import json

    import pytest

    import needle

    if not pathlib.Path(needle.DEFAULT_MODEL).exists():
        pytest.skip("the default model is not prepared (serve/prepare_model.py)")
    launched = []

    class FakeServer:
        def __init__(self, model, backend, extra_args):
            launched.append(backend)
            self.url = "http://fake"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(needle, "Server", FakeServer)
    monkeypatch.setattr(needle, "ask", lambda url, prompt: f"{len(launched)}: {needle.CODES[0]}")
    common = ["--depths", "0.3", "--context", "256", "--budgets", "512", "--selectors", "gate", "--out", str(tmp_path)]
    assert needle.main([*common, "--tag", "first"]) == 0
    assert launched == ["torch_native", "sas"]
    first = next(tmp_path.glob("needle-*-first.json"))
    launched.clear()
    assert needle.main([*common, "--tag", "second", "--dense-from", str(first)]) == 0
    assert launched == ["sas"]  # dense not asked again
    second = json.loads(next(tmp_path.glob("needle-*-second.json")).read_text())
    dense = [r for r in second["rows"] if r["server"] == "dense"][0]["answers"]
    assert dense == [r for r in json.loads(first.read_text())["rows"] if r["server"] == "dense"][0]["answers"]
    assert dense[0]["answer"].startswith("1:") and dense[0]["recalled"]
    assert second["dense_answers_from"].endswith(first.name)
    with pytest.raises(SystemExit, match="another model, context or depths"):
        needle.main([*common[:2], "--context", "300", *common[4:], "--tag", "third", "--dense-from", str(first)])
