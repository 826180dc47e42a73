"""bench/ruler.py's pure parts: the servers it runs, the lm_eval command, reading lm_eval's results."""

from __future__ import annotations

import json

import pytest

from sas_backend.testing.server import DEFAULT_MODEL, default_gate


def test_servers_dense_first_then_serve_default_then_budgets():
    import ruler

    gate = str(default_gate(DEFAULT_MODEL))
    configs = ruler.server_configs(gate, [512, 1024])
    assert [c[0] for c in configs] == ["dense", "sas gate serve default (b2048, sink 1, local 1)", "sas gate b512",
                                       "sas gate b1024"]
    assert configs[0][1:] == ("torch_native", [])
    assert configs[1][2] == ["--sas-gate", gate]  # no budget flag: the gate's serving record decides
    assert configs[2][2] == ["--sas-selector", "gate", "--sas-budget", "512", "--sas-gate", gate]


def test_sas_args_go_to_the_sas_servers_only_and_name_their_rows():
    """--sas-arg (e.g. --sas-sub-blocks 4): dense gets none of it, each sas server all of it, in its name too."""
    import ruler

    gate = str(default_gate(DEFAULT_MODEL))
    plain = ruler.server_configs(gate, [512])
    configs = ruler.server_configs(gate, [512], ("--sas-sub-blocks", "4"))
    assert configs[0] == plain[0] == ("dense", "torch_native", [])
    for (name, backend, extra), (name0, _, extra0) in zip(configs[1:], plain[1:]):
        assert backend == "sas" and name == f"{name0} --sas-sub-blocks 4"
        assert extra == [*extra0, "--sas-sub-blocks", "4"]


def test_lm_eval_command_one_length_and_its_tokenizer():
    import ruler

    cmd = ruler.lm_eval_cmd("m", "http://h:1", ["niah_single_1", "ruler_vt"], 8192, 3, "/o")
    assert cmd[1:5] == ["-m", "lm_eval", "--model", "local-completions"]
    args = dict(kv.split("=", 1) for kv in cmd[cmd.index("--model_args") + 1].split(","))
    assert args["base_url"] == "http://h:1/v1/completions" and args["max_length"] == "8192"
    assert args["tokenized_requests"] == "False"  # strings: SGLang tokenizes
    assert json.loads(cmd[cmd.index("--metadata") + 1]) == {"max_seq_lengths": [8192], "pretrained": "m"}
    assert cmd[cmd.index("--tasks") + 1] == "niah_single_1,ruler_vt"
    assert "--log_samples" in cmd  # each answer kept (read_samples)
    assert not set(ruler.LOCAL_TASKS) & set(ruler.DOWNLOADED_TASKS)


def test_read_scores_takes_the_length_metric_and_refuses_a_missing_task(tmp_path):
    import ruler

    sub = tmp_path / "model"
    sub.mkdir()
    results = {"niah_single_1": {"4096,none": 1.0, "8192,none": -1.0}, "ruler_vt": {"4096,none": 0.4}}
    (sub / "results_2026.json").write_text(json.dumps({"results": results}))
    assert ruler.read_scores(str(tmp_path), ["niah_single_1", "ruler_vt"], 4096) == {"niah_single_1": 1.0,
                                                                                   "ruler_vt": 0.4}
    with pytest.raises(RuntimeError, match="ruler_vt"):
        ruler.read_scores(str(tmp_path), ["niah_single_1", "ruler_vt"], 8192)
    with pytest.raises(RuntimeError, match="no results"):
        ruler.read_scores(str(tmp_path / "model" / "none"), ["ruler_vt"], 4096)


def test_table_has_a_row_per_server_and_length_the_mean_and_the_tasks_changed():
    import ruler

    rows = [{"server": "dense", "scores": {"4096": {"a": 1.0, "b": 0.5}}},
            {"server": "sas b512", "scores": {"4096": {"a": 0.0, "b": 0.5}}},
            {"server": "sas b2048", "scores": {"4096": {"a": 0.0, "b": 1.0}}}]
    lines = ruler.table_markdown(rows, ["a", "b"], [4096, 8192]).splitlines()
    assert lines[2] == "| dense | 4096 | 1.00 | 0.50 | 0.75 |  |"
    assert lines[3] == "| sas b512 | 4096 | 0.00 | 0.50 | 0.25 | 1 of 2 |"
    assert lines[4] == "| sas b2048 | 4096 | 0.00 | 1.00 | 0.50 | 2 of 2 |"
    assert len(lines) == 5  # no 8192 rows: not measured
    assert ruler.tasks_differing(rows, ["b"], "4096") == {"dense": 0, "sas b512": 0, "sas b2048": 1}


def test_table_without_a_dense_server_leaves_the_comparison_empty():
    import ruler

    rows = [{"server": "sas b512", "scores": {"4096": {"a": 0.25}}}]
    assert ruler.table_markdown(rows, ["a"], [4096]).splitlines()[2] == "| sas b512 | 4096 | 0.25 | 0.25 |  |"


def test_read_samples_keeps_each_answer_and_its_score(tmp_path):
    import ruler

    sub = tmp_path / "model"
    sub.mkdir()
    lines = [{"doc_id": 1, "target": ["b"], "filtered_resps": [["no"]], "4096": 0.0, "doc": {"input": "long"}},
             {"doc_id": 0, "target": ["a"], "filtered_resps": ["a"], "4096": 1.0}]
    (sub / "samples_ruler_vt_2026-12-03T10.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    got = ruler.read_samples(str(tmp_path), ["ruler_vt"], 4096)
    with pytest.raises(RuntimeError, match="niah_single_1"):
        ruler.read_samples(str(tmp_path), ["ruler_vt", "niah_single_1"], 4096)
    assert got == {"ruler_vt": [{"doc_id": 0, "target": ["a"], "response": "a", "score": 1.0},
                                {"doc_id": 1, "target": ["b"], "response": "no", "score": 0.0}]}
