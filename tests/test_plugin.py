"""The plugin entry point: backend choice, `--sas-*` flags -> env, page size, early refusals."""

from __future__ import annotations

import os
import types

import pytest
import torch

from sas_backend.config import SASConfig, SASConfigError

MODEL = os.path.join(os.path.dirname(__file__), "..", "models", "SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def parse(tmp_path_factory):
    """`prepare_server_args` with the sas plugin loaded, as `launch_server` runs it."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()

    def run(*argv):
        return prepare_server_args(["--model-path", MODEL, *map(str, argv)])

    return run


@pytest.fixture()
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("SAS_"):
            monkeypatch.delenv(k)
    yield monkeypatch


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    from sas_backend.gate.checkpoint import init_gate_checkpoint

    out = tmp_path_factory.mktemp("g") / "gate"
    init_gate_checkpoint(out, model_dir=MODEL, seed=0)
    return out


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("sas") == "sas_backend.plugin:register"


def test_sas_is_a_backend_choice(parse):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    assert "sas" in ATTENTION_BACKEND_CHOICES
    assert "sas" in ATTENTION_BACKENDS


def test_flags_set_env_and_page_size(parse, clean_env, gate):
    args = parse("--attention-backend", "sas", "--sas-gate", gate, "--sas-budget", "512", "--sas-sink-blocks", "1")
    assert args.page_size == 64
    cfg = SASConfig.from_env()
    assert (cfg.gate_path, cfg.budget, cfg.sink_blocks, cfg.top_k) == (str(gate), 512, 1, 8)


def test_flag_wins_over_env(parse, clean_env, gate):
    clean_env.setenv("SAS_BUDGET", "1024")
    clean_env.setenv("SAS_LOCAL_BLOCKS", "2")
    parse("--attention-backend", "sas", "--sas-gate", gate, "--sas-budget", "256")
    cfg = SASConfig.from_env()
    assert cfg.budget == 256 and cfg.local_blocks == 2  # flag beat env; env beat default


def test_other_backends_keep_their_page_size(parse, clean_env):
    assert parse("--attention-backend", "torch_native").page_size in (None, 1)
    assert parse("--attention-backend", "torch_native", "--page-size", "16").page_size == 16


def test_explicit_matching_page_size_is_accepted(parse, clean_env, gate):
    assert parse("--attention-backend", "sas", "--sas-gate", gate, "--page-size", "64").page_size == 64


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--sas-budget", "100"], "multiple of the block size 64"),
        (["--page-size", "16"], "--page-size 64"),
        (["--sas-sink-blocks", "20", "--sas-budget", "512"], "exceed"),
        (["--speculative-algorithm", "EAGLE"], "on CPU use --speculative-algorithm NGRAM"),
        (["--speculative-algorithm", "NGRAM"], "--speculative-ngram-max-bfs-breadth 1 (got 10"),
        (["--speculative-algorithm", "DFLASH"], "not supported with the sas backend"),
        (["--enable-hierarchical-cache"], "hierarchical"),
        (["--sas-prompt-anchors", "2", "--enable-mixed-chunk"], "--enable-mixed-chunk"),
        (["--sas-prompt-anchors", "31", "--sas-budget", "2048", "--sas-sink-blocks", "1", "--sas-local-blocks", "1"],
         "prompt anchor"),
        (["--disaggregation-mode", "decode", "--sas-prompt-anchors", "9", "--sas-budget", "4096"],
         "at most 8 anchors per layer and kv head"),
        (["--disaggregation-mode", "decode", "--speculative-algorithm", "NGRAM", "--speculative-ngram-max-bfs-breadth",
          "1"], "_maybe_init_ngram_bufs"),
        (["--disaggregation-mode", "decode", "--speculative-algorithm", "EAGLE"], "is not verified"),
        (["--disaggregation-mode", "decode", "--device", "cuda", "--sas-selector", "quest"],
         "CUDA with the gate selector only"),
        (["--enable-lmcache"], "external cache yet (--enable-lmcache)"),
        (["--hicache-storage-backend", "file"], "external cache yet (--hicache-storage-backend)"),
        (["--sas-sub-blocks", "3"], "power of two dividing the block size 64"),
        (["--sas-sub-blocks", "128"], "power of two dividing the block size 64"),
        (["--sas-sub-blocks", "4", "--sas-selector", "sink-local"], "sink-local keeps no summaries"),
        (["--sas-exact-rerank", "0"], "--sas-exact-rerank must be >= 1"),
        (["--sas-exact-rerank", "2", "--sas-selector", "sink-local"], "sink-local forces every block"),
    ],
)
def test_refusals_are_messages(parse, clean_env, gate, argv, needle):
    with pytest.raises(SystemExit) as e:
        parse("--attention-backend", "sas", "--sas-gate", gate, *argv)
    assert needle in str(e.value)


def test_pd_servers_are_accepted(parse, clean_env, gate):
    """A PD prefill server's extend is dense and sends KV (and prompt anchors) only; a CPU decode server
    summarizes the transferred pages at their first decode step (tests/server/test_pd.py)."""
    assert parse("--attention-backend", "sas", "--sas-gate", gate, "--disaggregation-mode", "prefill").page_size == 64
    assert parse("--attention-backend", "sas", "--sas-gate", gate, "--disaggregation-mode", "decode",
                 "--device", "cpu").page_size == 64
    # CUDA: the gate's late summaries are listed and repaired on the device (capturable; tests/test_summary_marks.py)
    assert parse("--attention-backend", "sas", "--sas-gate", gate, "--disaggregation-mode", "decode",
                 "--device", "cuda").page_size == 64
    # prompt anchors arrive from a sas prefill server in SGLang's PD metadata (backend/pd_anchors.py)
    assert parse("--attention-backend", "sas", "--sas-gate", gate, "--disaggregation-mode", "decode",
                 "--device", "cpu", "--sas-prompt-anchors", "4").page_size == 64


def test_ngram_chain_launch_is_accepted(parse, clean_env, gate):
    args = parse("--attention-backend", "sas", "--sas-gate", gate, "--speculative-algorithm", "NGRAM",
                 "--speculative-ngram-max-bfs-breadth", "1")
    assert args.speculative_algorithm == "NGRAM" and args.page_size == 64


def test_draft_model_launch_on_cuda_needs_a_chain_and_gets_a_dense_draft_backend():
    """What check_launch decides on a CUDA launch (this machine has none, so called directly)."""
    from types import SimpleNamespace

    from sas_backend.speculative import SpeculativeConfigError, check_launch

    for topk in (None, 4):
        with pytest.raises(SpeculativeConfigError, match="--speculative-eagle-topk 1"):
            check_launch(SimpleNamespace(speculative_algorithm="EAGLE", speculative_eagle_topk=topk), on_cuda=True)
    args = SimpleNamespace(speculative_algorithm="STANDALONE", speculative_eagle_topk=1,
                           speculative_draft_attention_backend=None)
    check_launch(args, on_cuda=True)
    assert args.speculative_draft_attention_backend == "flashinfer"
    args = SimpleNamespace(speculative_algorithm="EAGLE3", speculative_eagle_topk=1,
                           speculative_draft_attention_backend="fa3")
    check_launch(args, on_cuda=True)
    assert args.speculative_draft_attention_backend == "fa3"  # the user's choice is kept


def test_ngram_padded_drafts_become_chains():
    """NGRAM's C++ builder pads a short match with token-0 children of the root (a tree even at breadth 1); the
    hook's masks are chains, as numpy (what the worker returns) and as torch."""
    import numpy as np

    from sas_backend.speculative import chain_masks

    n = 4
    padded = np.zeros((n, n), dtype=np.uint8)  # root, d1, then two pads hung off the root
    for i, parents in enumerate([[0], [0, 1], [0, 2], [0, 3]]):
        padded[i, parents] = 1
    mask = np.concatenate([padded.reshape(-1), np.tril(np.ones((n, n), np.uint8)).reshape(-1)])
    out = chain_masks(mask, n)
    assert out.dtype == mask.dtype and out.shape == mask.shape
    assert (out.reshape(2, n, n) == np.tril(np.ones((n, n), np.uint8))).all()
    t = chain_masks(torch.from_numpy(mask).bool(), n)
    chain = torch.ones(n, n, dtype=torch.bool).tril()
    assert t.dtype == torch.bool and torch.equal(t.view(2, n, n), chain.expand(2, n, n))


def test_missing_gate_dir_is_refused(parse, clean_env, tmp_path):
    with pytest.raises(SystemExit) as e:
        parse("--attention-backend", "sas", "--sas-gate", tmp_path / "nope")
    assert "does not exist" in str(e.value)


def test_config_validation_rules():
    with pytest.raises(SASConfigError, match="power of two"):
        SASConfig(gate_path="x", block_size=48).validate()
    with pytest.raises(SASConfigError, match="needs a gate"):
        SASConfig().validate()
    with pytest.raises(SASConfigError, match="not an integer"):
        SASConfig.from_env({"SAS_BUDGET": "lots"})
    cfg = SASConfig(gate_path="g", budget=2048)
    assert cfg.validate().top_k == 32
    assert SASConfig.from_env(cfg.to_env()) == cfg
    # Training-free selectors need no gate; an unknown selector is refused by name.
    assert SASConfig(selector="quest").validate().selector == "quest"
    assert SASConfig.from_env({"SAS_SELECTOR": "sink-local"}).validate().selector == "sink-local"
    with pytest.raises(SASConfigError, match="gate, quest, sink-local"):
        SASConfig(selector="h2o").validate()
    with pytest.raises(SASConfigError, match="--sas-selector quest"):
        SASConfig(selector="gate").validate()
    # Who runs CPU extend attention: ours by default, SGLang's on request, nothing else.
    assert SASConfig(selector="quest").cpu_extend == "sas"
    cfg = SASConfig.from_env({"SAS_SELECTOR": "quest", "SAS_CPU_EXTEND": "torch_native"}).validate()
    assert cfg.cpu_extend == "torch_native"
    with pytest.raises(SASConfigError, match="SAS_CPU_EXTEND must be one of sas, torch_native"):
        SASConfig(selector="quest", cpu_extend="flash").validate()
    assert SASConfig.from_env({"SAS_SELECTOR": "quest", "SAS_DEBUG_LAYERS": "all"}).validate().debug_layers == "all"
    with pytest.raises(SASConfigError, match="SAS_DEBUG_LAYERS must be first or all"):
        SASConfig(selector="quest", debug_layers="0").validate()


def test_training_free_selector_needs_no_gate_flag(parse, clean_env):
    args = parse("--attention-backend", "sas", "--sas-selector", "quest", "--sas-budget", "512")
    assert args.page_size == 64 and SASConfig.from_env().selector == "quest"


def test_settings_table_is_the_fields(parse):
    """One table: every SASConfig field has its variable; the flags, their types and help come from it."""
    import dataclasses

    from sas_backend.config import SETTINGS

    envs, flags = [s.env for s in SETTINGS], [s.flag for s in SETTINGS if s.flag is not None]
    assert all(e.startswith("SAS_") for e in envs) and len(set(envs)) == len(envs) == len(dataclasses.fields(SASConfig))
    assert all(f.startswith("--sas-") for f in flags) and len(set(flags)) == len(flags)
    assert {s.field: s.env for s in SETTINGS}["block_size"] == "SAS_BLOCK_SIZE"
    assert [s.field for s in SETTINGS if s.flag is None] == [
        "force_sparse", "summary_marks", "debug_dir", "debug_layers", "cpu_extend"]
    assert {s.field for s in SETTINGS if s.type is int} == {
        "budget", "block_size", "first_sparse_layer", "sink_blocks", "local_blocks", "prompt_anchors", "sub_blocks",
        "exact_rerank", "dense_below", "force_sparse", "summary_marks"}
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)  # with the plugin's flags (the `parse` fixture loaded it)
    args = parser.parse_args(["--model-path", MODEL, "--sas-budget", "256"])
    assert args.sas_budget == 256 and args.sas_gate_path is None  # typed, and a flag not given stays None
    assert "env SAS_BUDGET" in parser._option_string_actions["--sas-budget"].help


def test_sas_info_hashes_the_gate_once(clean_env, gate, monkeypatch):
    """/sas/info serves a body computed once per server, not a re-read and re-hash per request."""
    from sas_backend import info
    from sas_backend.gate import gate_file

    calls = []
    real = gate_file.checkpoint_identity
    monkeypatch.setattr(gate_file, "checkpoint_identity", lambda p: calls.append(p) or real(p))
    info._info_for.cache_clear()
    clean_env.setenv("SAS_GATE", str(gate))
    first, second = info.sas_info(), info.sas_info()
    assert first == second and len(calls) == 1 and len(first["gate"]["sha256"]) == 64
    clean_env.setenv("SAS_BUDGET", "512")  # other settings: another body
    assert info.sas_info()["config"]["budget"] == 512 and len(calls) == 2
    info._info_for.cache_clear()


# ---------------------------------------------------------------- SGLang API contracts of the factory
def test_releases_read_are_recorded():
    from sas_backend.backend.sglang_compat import SGLANG_RELEASES_READ

    assert set(SGLANG_RELEASES_READ) == {"0.5.15", "0.5.21", "0.5.23"}


def test_attention_tp_comes_from_sglang_parallel_state():
    """SGLang's parallel context carries the attention-TP rank/size (0.5.15 .. 0.5.23; the
    ModelRunner's tp_rank/tp_size are gone in 0.5.23 and are the wrong group under DP attention)."""
    from sglang.srt.runtime_context import get_parallel

    from sas_backend.backend.sglang_compat import attention_cp_size, attention_tp

    with get_parallel().override(attn_tp_rank=2, attn_tp_size=4, attn_cp_size=1):
        assert attention_tp() == (2, 4)
        assert attention_cp_size() == 1


class _Pool:
    def get_key_buffer(self, layer_id):
        return torch.empty(0, dtype=torch.bfloat16)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_factory_shards_the_gate_by_attention_tp_rank(clean_env, gate, monkeypatch, rank):
    """With attention TP 3 (SmolLM2 has 3 kv heads) rank r gets kv head r of every gate layer, and
    the factory reads no tp_rank/tp_size from the runner (0.5.23 has none)."""
    from sglang.srt.layers.attention import attention_registry
    from sglang.srt.runtime_context import get_parallel
    from transformers import AutoConfig

    from sas_backend.backend import factory
    from sas_backend.gate.checkpoint import load_gate_checkpoint
    from sas_backend.ops.rope import rope_cos_sin_table

    clean_env.setenv("SAS_GATE", str(gate))
    clean_env.setenv("TRITON_INTERPRET", "1")
    built = {}

    def fake_backend(runner, inner, cfg, gates, rope_tables, **kw):
        built.update(gates=gates, rope_tables=rope_tables, returned=types.SimpleNamespace(), **kw)
        return built["returned"]

    monkeypatch.setattr(factory, "SASAttnBackend", fake_backend)
    monkeypatch.setitem(attention_registry.ATTENTION_BACKENDS, "torch_native", lambda runner: object())
    model = torch.nn.Module()
    model.rotary_emb = torch.nn.Module()
    model.rotary_emb.cos_sin_cache = rope_cos_sin_table(64, 8192, 100000.0).to(torch.bfloat16)
    runner = types.SimpleNamespace(
        device="cpu", page_size=64, server_args=types.SimpleNamespace(), dtype=torch.bfloat16,
        model_config=types.SimpleNamespace(hf_config=AutoConfig.from_pretrained(MODEL)),
        token_to_kv_pool=_Pool(), model=model, use_mla_backend=False,
    )
    with get_parallel().override(attn_tp_rank=rank, attn_tp_size=3, attn_cp_size=1):
        backend = factory.create_sas_backend(runner)
    assert built["num_kv_heads"] == 1 and built["num_q_heads"] == 3 and built["kv_head_offset"] == rank
    assert len(built["gate_sha256"]) == 64 and built["own_cpu_extend"]  # one-phase: all given to the constructor
    _, layers = load_gate_checkpoint(gate)
    for lid, g in built["gates"].items():
        full = layers[lid]["attngate_linear_q.weight"].float()
        torch.testing.assert_close(g.attngate_linear_q.weight, full[rank:rank + 1])
    # The live tables: the model's current table (upcast) and the gate's own.
    tables = built["rope_tables"]
    assert tables.rotary is model.rotary_emb and tables.model.dtype == torch.float32
    assert tables.gate.shape == (8192, 128)
    assert backend is built["returned"] and not vars(backend)  # returned as constructed: nothing set afterwards


@pytest.mark.parametrize(
    "argv, disabled",
    [
        ([], False),
        (["--disable-cuda-graph"], True),
        (["--disable-decode-cuda-graph"], True),
        (["--cuda-graph-backend-decode", "disabled"], True),
        (["--cuda-graph-config", '{"decode": {"backend": "disabled"}}'], True),
        (["--disable-prefill-cuda-graph"], False),
        (["--disable-cuda-graph", "--cuda-graph-backend-decode", "full"], False),
    ],
)
def test_decode_cuda_graph_disabled_reads_every_spelling(parse, clean_env, argv, disabled):
    from sas_backend.backend.sglang_compat import decode_cuda_graph_disabled

    assert decode_cuda_graph_disabled(parse(*argv)) is disabled


def _gate_with_serving(tmp_path, serving):
    from sas_backend.gate.checkpoint import load_gate_checkpoint, save_gate_checkpoint

    config, tensors = load_gate_checkpoint(_seed_gate_dir(tmp_path))
    config.serving = serving
    save_gate_checkpoint(tmp_path / "served", config, tensors)
    return str(tmp_path / "served")


def _seed_gate_dir(tmp_path):
    from sas_backend.gate.checkpoint import init_gate_checkpoint

    init_gate_checkpoint(tmp_path / "seed", model_dir=MODEL, seed=0)
    return tmp_path / "seed"


def test_budget_and_forced_blocks_default_from_the_gate(parse, clean_env, tmp_path):
    """The launch's flags win; what they leave unset comes from the gate's serving record and is
    pinned in the environment, so every scheduler process serves the same K."""
    gate = _gate_with_serving(tmp_path, {"budget": 1024, "sink_blocks": 1, "local_blocks": 2})
    parse("--attention-backend", "sas", "--sas-gate", gate)
    pinned = (os.environ["SAS_BUDGET"], os.environ["SAS_SINK_BLOCKS"], os.environ["SAS_LOCAL_BLOCKS"])
    assert pinned == ("1024", "1", "2")
    cfg = SASConfig.for_serving()
    assert (cfg.budget, cfg.top_k, cfg.sink_blocks, cfg.local_blocks) == (1024, 16, 1, 2)

    for k in ("SAS_BUDGET", "SAS_SINK_BLOCKS", "SAS_LOCAL_BLOCKS"):
        clean_env.delenv(k)
    parse("--attention-backend", "sas", "--sas-gate", gate, "--sas-budget", "256", "--sas-local-blocks", "0")
    cfg = SASConfig.for_serving()
    assert (cfg.budget, cfg.sink_blocks, cfg.local_blocks) == (256, 1, 0)  # flags beat the record

    # No record, training-free selectors: the documented fallbacks
    from sas_backend.config import DEFAULT_BUDGET

    assert SASConfig(selector="quest").resolved().budget == DEFAULT_BUDGET
    seed = SASConfig(gate_path=str(_seed_gate_dir(tmp_path / "b"))).resolved()
    assert (seed.budget, seed.sink_blocks, seed.local_blocks) == (DEFAULT_BUDGET, 0, 0)
    # A record that the flags make impossible is refused with the usual message
    with pytest.raises(SASConfigError, match="exceed"):
        SASConfig(gate_path=gate, budget=128).resolved().validate()


def test_launch_logs_the_forced_blocks_and_where_they_came_from(parse, clean_env, tmp_path, capfd):
    """The server says which blocks it forces and why; serving a gate without the forced blocks it was
    trained with draws a warning."""
    from sas_backend.gate.checkpoint import load_gate_checkpoint, save_gate_checkpoint

    gate = _gate_with_serving(tmp_path, {"budget": 1024, "sink_blocks": 1, "local_blocks": 1})
    config, tensors = load_gate_checkpoint(gate)
    config.training = {**config.training, "sink_blocks": 1, "local_blocks": 1}
    save_gate_checkpoint(gate, config, tensors)
    capfd.readouterr()
    parse("--attention-backend", "sas", "--sas-gate", gate, "--sas-local-blocks", "1")
    text = capfd.readouterr().err
    assert ("budget 1024 tokens (the gate's serving record); forced blocks: sink 1 (the gate's serving record), "
            "local 1 (launch); the gate selector chooses the other 14 of 16 blocks") in text
    assert "trained with" not in text
    for k in ("SAS_BUDGET", "SAS_SINK_BLOCKS", "SAS_LOCAL_BLOCKS"):
        clean_env.delenv(k)
    parse("--attention-backend", "sas", "--sas-gate", gate, "--sas-sink-blocks", "0", "--sas-local-blocks", "0")
    text = capfd.readouterr().err
    assert "forced blocks: sink 0 (launch), local 0 (launch); the gate selector chooses all 16 blocks" in text
    assert "trained with sink 1 + local 1 forced blocks and is served with sink 0 + local 0" in text
    # A gate trained with no forced blocks ranks the first and the recent blocks itself: forcing them is no risk
    config.training = {**config.training, "sink_blocks": 0, "local_blocks": 0}
    save_gate_checkpoint(gate, config, tensors)
    for k in ("SAS_BUDGET", "SAS_SINK_BLOCKS", "SAS_LOCAL_BLOCKS"):
        clean_env.delenv(k)
    parse("--attention-backend", "sas", "--sas-gate", gate)
    text = capfd.readouterr().err
    assert "forced blocks: sink 1 (the gate's serving record), local 1 (the gate's serving record)" in text
    assert "trained with" not in text
    assert SASConfig(selector="quest").origins() == {"budget": "default", "sink_blocks": "default",
                                                     "local_blocks": "default", "prompt_anchors": "default",
                                                     "sub_blocks": "default", "exact_rerank": "default"}


def test_records_keep_no_machine_paths():
    """What a checkpoint's record or a results file keeps: repository paths relative to it, other
    absolute paths by name only, @sources and relative paths as given."""
    from sas_backend.paths import source_checkout
    from sas_backend.provenance import portable_argv, portable_path

    repo = source_checkout()
    assert portable_path(str(repo / "models" / "m")) == "models/m"
    assert portable_path("/somewhere/else/gate") == "gate"
    assert portable_path("@essays") == "@essays" and portable_path("./a/../b") == "b"
    assert portable_argv(["--model", str(repo / "models" / "m"), "--out=/x/y/run", "--steps", "5"]) == [
        "--model", "models/m", "--out=run", "--steps", "5"]
