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
