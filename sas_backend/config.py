"""SAS serving configuration: launch flags, environment variables, defaults.

Precedence (highest first): `--sas-*` flags on the SGLang launch command, then `SAS_*`
environment variables, then the defaults below. The launcher turns the flags into the
environment variables before SGLang spawns its scheduler processes, so every process reads one
source of truth: `SASConfig.from_env()`.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Optional

from sas_backend.ops import sub_blocks_ok


class SASConfigError(ValueError):
    """A SAS setting that cannot work; the message says which and how to fix it."""


#: Who runs extend attention on CPU (SASConfig.cpu_extend).
CPU_EXTENDS = ("sas", "torch_native")

#: Values of the decode-step settings (SASConfig.kernels, .attention, .summary_dtype, .gate_dtype).
KERNELS = ("auto", "triton", "torch")
ATTENTIONS = ("auto", "triton", "flashinfer")
SUMMARY_DTYPES = ("auto", "fp32", "bf16")
GATE_DTYPES = SUMMARY_DTYPES
RERANK_KEYS = ("kv", "int4")

#: Budget when neither the launch nor the gate's record names one (and for training-free selectors).
DEFAULT_BUDGET = 2048
# On CPU a sparse step pays a fixed cost (the selection's small ops in every sparse layer) worth up to this many
# tokens of dense reading: at batch 1 sparse decode is slower than dense up to budget + 1024 (a 2-core EPYC) to
# budget + 2560 (a 2-core Xeon) tokens of context (bench/results/2026-12-05-cpu-crossover), so the CPU default of
# --sas-dense-below is the budget + a margin covering both.
CPU_DENSE_MARGIN = 3072


def _selector_choices() -> str:
    """The registered selectors with their one-line help (imports the registry: called when the help is shown)."""
    from sas_backend.selection import selector_class, selector_names

    return "; ".join(f"{n} ({selector_class(n).help})" if selector_class(n).help else n for n in selector_names())


def _setting(default, env: str, flag: Optional[str] = None, help: str = "", default_text: Optional[str] = None):
    """A SASConfig field with how the outside world names it: its `SAS_*` variable, its
    `--sas-*` launch flag (None: environment only), the flag's help text, and how the help names
    its default (default_text; None: the default value itself)."""
    meta = {"env": env, "flag": flag, "help": help, "default_text": default_text}
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class SASConfig:
    """What the `sas` backend needs besides the model.

    selector: how blocks are chosen, a name registered in `sas_backend.selection` (`selector_names()`):
        "gate" (the trained AttnGate, needs gate_path), "quest" (training-free: per-block key min/max
        bound of q.k), "sink-local" (training-free: the first block(s) and the blocks right before the
        current one), or one a `selector_modules` module registers. What it needs and offers (gate
        weights, fused kernels, ranking, summaries) is read from its class, never its name.
    selector_modules: comma-separated Python modules imported before the selector is looked up (in
        every server process); importing one registers its selectors (`selection.register_selector`).
    gate_path: gate checkpoint directory (canonical or SeerAttention-R format).
    budget: tokens of previous complete blocks each decode step attends, besides the current block;
        K = budget // block_size blocks are selected per (request, kv head). None: the gate's
        recorded serving budget (`GateConfig.serve_defaults`), else DEFAULT_BUDGET; `resolved()`
        fills it in.
    block_size: tokens per KV block; SGLang's page size must equal it.
    first_sparse_layer: layers below this index decode densely.
    sink_blocks / local_blocks: blocks always selected (first blocks / blocks right before the
        current one); they count inside K. None: the gate's record, else 0.
    prompt_anchors: per request, layer and kv head, the blocks its last prompt token attended most (computed
        at the end of each extend, `ops.anchors`) are forced into every decode selection, inside K after the
        sink and local blocks: in a question over a long context they hold what the question asked for.
        None: the gate's record, else 0.
    sub_blocks: summaries per block (gate and quest): each b / sub_blocks-token run of a block is summarized as a
        block of its own and the block scores its best run (`SelectionRule.sub_blocks`). None: the gate's
        record, else 1.
    exact_rerank: X > 1: two levels. The selector picks X x K blocks (forced blocks and anchors in), and the K of
        highest exact attention mass among them are attended (`ops.rerank`). None: the gate's record, else 1.
    rerank_keys: what that second level reads: "kv" (the KV cache's keys) or "int4" (a 4-bit copy of each complete
        block's keys with its per-channel min and step, `ops.key_codes`: 0.28 of the bf16 key bytes, 4.5 KiB a page
        and kv head more in the summary pool at D = 128; the same ranking quality measured).
    dense_below: a decode step whose requests hold at most this many context tokens in all (the
        sum of their lengths: what dense attention reads) attends every block densely instead of
        selecting; 0: never. None: on CPU budget + CPU_DENSE_MARGIN tokens (the measured batch-1
        crossover; 0 with force_sparse), on CUDA the settings table's (`backend.step_settings.resolve`). A short
        step is bound by its fixed per-layer costs (kernel launches, small ops), not its bytes, and dense
        attention is faster there. Under CUDA graphs both branches are captured (conditional IF nodes, CUDA
        12.4+); without them graph steps stay sparse.
    kernels / attention / summary_dtype / gate_dtype: how the decode step runs (`backend.decode_step`), what
        the summary pool holds and what the fused front reads the gate weights in; "auto" resolves per device
        (`backend.step_settings.resolve`).
    force_sparse: 1: eager CPU steps select even when every candidate fits the budget (where dense attention
        is exactly the result), so tests run the sparse path itself; tests/debug only.
    summary_marks: the summary pool's validity marks (pages whose KV came without an extend through sas, e.g. a
        PD decode server's, are summarized at decode before any selection): 1 (default) in the device's form (CPU:
        planned on the host; CUDA: listed and repaired on the device, capturable, for selectors with a capturable
        repair); 2: the device-side form on CPU too (tests drive it there); 0: off, pages keep whatever summary
        their row holds (a negative control for tests only).
    debug_dir: if set, each decode step appends selection statistics there (slow; tests only).
    debug_layers: the layers whose selections a decode step appends to debug_dir: "first" (the first sparse
        layer) or "all" (every sparse layer: what a check needs to follow the server's selections).
    cpu_extend: who runs extend (prefill) attention on CPU: "sas" (ops/extend: the new queries only)
        or "torch_native" (SGLang's, which pads each request's queries to its whole length).

    Each field's metadata names its variable and flag; `SETTINGS` lists them.
    """

    selector: str = _setting(
        "gate", "SAS_SELECTOR", "--sas-selector", lambda: "Block selector: " + _selector_choices() + ".")
    selector_modules: Optional[str] = _setting(
        None, "SAS_SELECTOR_MODULES", "--sas-selector-module",
        "Comma-separated Python modules to import before choosing the selector: each registers its own with "
        "sas_backend.selection.register_selector (docs/development.md).", "default: none")
    gate_path: Optional[str] = _setting(
        None, "SAS_GATE", "--sas-gate",
        "Gate checkpoint directory (config.json + gate.safetensors, or SeerAttention-R's).")
    budget: Optional[int] = _setting(
        None, "SAS_BUDGET", "--sas-budget",
        "Tokens of previous blocks attended per decode step (a multiple of the block size).",
        f"default: the gate's recorded serving budget, else {DEFAULT_BUDGET}")
    block_size: int = _setting(
        64, "SAS_BLOCK_SIZE", "--sas-block-size",
        "KV block size in tokens; the page size is set to it.")
    first_sparse_layer: int = _setting(
        0, "SAS_FIRST_SPARSE_LAYER", "--sas-first-sparse-layer",
        "Layers below this index decode densely.")
    sink_blocks: Optional[int] = _setting(
        None, "SAS_SINK_BLOCKS", "--sas-sink-blocks",
        "Always attend the first N blocks (counted inside the budget).",
        "default: the gate's record, else 0")
    local_blocks: Optional[int] = _setting(
        None, "SAS_LOCAL_BLOCKS", "--sas-local-blocks",
        "Always attend the N blocks before the current one (inside the budget).",
        "default: the gate's record, else 0")
    prompt_anchors: Optional[int] = _setting(
        None, "SAS_PROMPT_ANCHORS", "--sas-prompt-anchors",
        "Per request and kv head, always attend the N blocks its last prompt token attended most (inside the "
        "budget, after the sink and local blocks); 0: none.",
        "default: the gate's record, else 0")
    sub_blocks: Optional[int] = _setting(
        None, "SAS_SUB_BLOCKS", "--sas-sub-blocks",
        "Summaries per block for the gate and quest selectors: each run of block-size / N tokens is summarized "
        "on its own and a block scores its best run (keeps needle-like keys; N x the summary pool and the bytes "
        "selection reads). 1: one summary a block.",
        "default: the gate's record, else 1")
    exact_rerank: Optional[int] = _setting(
        None, "SAS_EXACT_RERANK", "--sas-exact-rerank",
        "Two-level selection: the selector picks X x K blocks, then the K of highest exact attention mass among them "
        "are attended (reads the keys of X x K blocks a step: X x the attention's K bytes; keeps what pooled "
        "summaries rank coarsely). 1: one level.",
        "default: the gate's record, else 1")
    rerank_keys: str = _setting(
        "kv", "SAS_RERANK_KEYS", "--sas-rerank-keys",
        "Keys the exact second level (--sas-exact-rerank X > 1) reads: kv (the KV cache's) or int4 (a 4-bit copy of "
        "each complete block's keys kept beside its summary: 0.28 of the bf16 key bytes, 4.5 KiB a page and kv head "
        "at head dim 128).")
    dense_below: Optional[int] = _setting(
        None, "SAS_DENSE_BELOW", "--sas-dense-below",
        "Decode steps whose requests hold at most N context tokens in all attend densely (where dense "
        "attention is faster than selecting); 0: never.",
        f"CPU: the budget + {CPU_DENSE_MARGIN} (the measured crossover); CUDA: the settings table's")
    kernels: str = _setting(
        "auto", "SAS_KERNELS", "--sas-kernels",
        "Decode-step kernels: triton (front / select / attend, three launches a layer; on CPU under "
        "TRITON_INTERPRET=1), torch (the per-op path) or auto (triton on CUDA with the gate selector, else torch).")
    attention: str = _setting(
        "auto", "SAS_ATTENTION", "--sas-attention",
        "Sparse attention path: triton (over the block table), flashinfer (gathered token rows; CUDA) or auto "
        "(CUDA: the measured settings table, backend/gpu_settings.json; CPU: triton with --sas-kernels triton, "
        "else torch).")
    summary_dtype: str = _setting(
        "auto", "SAS_SUMMARY_DTYPE", "--sas-summary-dtype",
        "Block summary pool dtype: fp32, bf16 (half the pool) or auto (CUDA: the settings table; CPU: fp32).")
    gate_dtype: str = _setting(
        "auto", "SAS_GATE_DTYPE", "--sas-gate-dtype",
        "Gate weights as the fused front kernel reads them: fp32, bf16 (a bf16 copy: half the front's weight bytes; "
        "--sas-kernels triton only) or auto (CUDA: the settings table; CPU: fp32).")
    force_sparse: int = _setting(0, "SAS_FORCE_SPARSE")
    summary_marks: int = _setting(1, "SAS_SUMMARY_MARKS")
    debug_dir: Optional[str] = _setting(None, "SAS_DEBUG_DIR")
    debug_layers: str = _setting("first", "SAS_DEBUG_LAYERS")
    cpu_extend: str = _setting("sas", "SAS_CPU_EXTEND")

    @property
    def top_k(self) -> int:
        """Blocks selected per (request, kv head), forced blocks included."""
        return self.budget // self.block_size

    def _selector_class(self):
        """The registered class of `selector`, after importing `selector_modules` (SASConfigError if unknown)."""
        from sas_backend.selection import import_selector_modules, selector_class

        try:
            import_selector_modules(self.selector_modules)
            return selector_class(self.selector)
        except (ImportError, ValueError) as e:
            raise SASConfigError(f"--sas-selector {self.selector}: {e}") from None

    def resolved(self) -> "SASConfig":
        """A copy with budget, sink_blocks and local_blocks filled in where the launch left them
        unset: from the gate checkpoint's record (a selector reading gate weights), else DEFAULT_BUDGET, 0, 0.
        Reads the gate's config.json only (GateCheckpointError, a ValueError, if it is bad)."""
        unset = [name for name in _FROM_GATE if getattr(self, name) is None]
        if not unset:
            return self
        recorded = {}
        if self._selector_class().needs_gate and self.gate_path and os.path.isdir(self.gate_path):
            from sas_backend.gate.gate_file import serve_defaults_of

            recorded = serve_defaults_of(self.gate_path)
        fill = {name: recorded.get(name, _FROM_GATE[name]) for name in unset}
        return dataclasses.replace(self, **fill)

    def origins(self) -> dict:
        """Where `resolved()` takes budget, sink_blocks and local_blocks from, per name: "launch" (a
        --sas-* flag or SAS_* variable), "the gate's serving record" or "default". Call it on the
        unresolved config (on a resolved one every value reads as "launch")."""
        recorded = {}
        if self._selector_class().needs_gate and self.gate_path and os.path.isdir(self.gate_path):
            from sas_backend.gate.gate_file import serve_defaults_of

            recorded = serve_defaults_of(self.gate_path)
        return {name: "launch" if getattr(self, name) is not None else
                "the gate's serving record" if name in recorded else "default" for name in _FROM_GATE}

    def describe_selection(self, origins: dict) -> str:
        """One line for the server log: the budget and the forced blocks this (resolved) config serves,
        and where each came from (`origins()` of the unresolved config)."""
        free = self.top_k - self.sink_blocks - self.local_blocks - (self.prompt_anchors or 0)
        ranked = (f"the {self.selector} selector chooses the other {free} of {self.top_k} blocks" if free < self.top_k
                  else f"the {self.selector} selector chooses all {self.top_k} blocks, none forced")
        anchors = f", prompt anchors {self.prompt_anchors} ({origins['prompt_anchors']})" if self.prompt_anchors else ""
        x = self.exact_rerank or 1
        if x > 1:
            ranked += (f" from {x * self.top_k} it picks, by their exact attention mass (--sas-exact-rerank {x}, "
                       f"{origins['exact_rerank']})")
        return (f"budget {self.budget} tokens ({origins['budget']}); forced blocks: sink {self.sink_blocks} "
                f"({origins['sink_blocks']}), local {self.local_blocks} ({origins['local_blocks']}){anchors}; {ranked}")

    @classmethod
    def for_serving(cls, environ=None) -> "SASConfig":
        """`from_env(environ).resolved().validate()`: what a serving process runs with."""
        return cls.from_env(environ).resolved().validate()

    def validate(self) -> "SASConfig":
        """Raise SASConfigError on settings that cannot work; returns self. Settings still unset
        (left to the gate's record, see `resolved()`) are checked once resolved."""
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise SASConfigError(f"SAS block size must be a power of two, got {self.block_size}")
        if self.budget is not None and (self.budget <= 0 or self.budget % self.block_size):
            raise SASConfigError(
                f"SAS budget must be a positive multiple of the block size {self.block_size} "
                f"(it is spent in whole blocks), got {self.budget}; "
                f"for example --sas-budget {max(1, round(self.budget / self.block_size)) * self.block_size}"
            )
        if self.exact_rerank is not None and self.exact_rerank < 1:
            raise SASConfigError(f"--sas-exact-rerank must be >= 1 (1: one level), got {self.exact_rerank}")
        if self.rerank_keys not in RERANK_KEYS:
            raise SASConfigError(f"--sas-rerank-keys must be one of {', '.join(RERANK_KEYS)}, got {self.rerank_keys!r}")
        if self.rerank_keys != "kv" and self.exact_rerank is not None and self.exact_rerank <= 1:
            raise SASConfigError(f"--sas-rerank-keys {self.rerank_keys} sets what the second level of "
                                 "--sas-exact-rerank X reads: it needs X > 1 (two levels)")
        for name in ("first_sparse_layer", "sink_blocks", "local_blocks", "prompt_anchors", "dense_below"):
            if (getattr(self, name) or 0) < 0:
                raise SASConfigError(f"SAS {name} must be >= 0, got {getattr(self, name)}")
        sub = self.sub_blocks
        if sub is not None and not sub_blocks_ok(sub, self.block_size):
            raise SASConfigError(f"--sas-sub-blocks must be a power of two dividing the block size {self.block_size} "
                                 f"(summaries of block-size / N tokens each), got {sub}")
        kind = self._selector_class()
        if (sub or 1) > 1 and not kind.keeps_summaries:
            raise SASConfigError(f"--sas-sub-blocks sets how a selector summarizes a block; {self.selector} keeps no "
                                 "summaries")
        forced = (self.sink_blocks or 0) + (self.local_blocks or 0)
        if self.budget is not None and forced > self.top_k:
            raise SASConfigError(
                f"SAS sink ({self.sink_blocks}) + local ({self.local_blocks}) blocks exceed the "
                f"{self.top_k} blocks the budget {self.budget} allows"
            )
        if self.budget is not None and forced + (self.prompt_anchors or 0) > self.top_k:
            raise SASConfigError(
                f"SAS sink ({self.sink_blocks}) + local ({self.local_blocks}) + prompt anchor "
                f"({self.prompt_anchors}) blocks exceed the {self.top_k} blocks the budget {self.budget} allows"
            )
        if (self.exact_rerank or 1) > 1 and not kind.ranks:
            raise SASConfigError(f"--sas-exact-rerank ranks the blocks a selector picks; {self.selector} forces every "
                                 "block it selects (choose gate or quest)")
        if self.prompt_anchors and not kind.ranks:
            raise SASConfigError(f"--sas-prompt-anchors needs a ranking selector: {self.selector} forces every block "
                                 "it selects")
        if kind.needs_gate and not self.gate_path:
            raise SASConfigError(
                "the sas attention backend needs a gate checkpoint: pass --sas-gate DIR "
                "(or set SAS_GATE; a directory with config.json and gate.safetensors, written by "
                "python -m sas_backend.training.train or converted from a SeerAttention-R gate with "
                "python -m sas_backend.gate.convert), or choose a training-free "
                "selector with --sas-selector quest or --sas-selector sink-local"
            )
        for name, allowed in (("kernels", KERNELS), ("attention", ATTENTIONS), ("summary_dtype", SUMMARY_DTYPES),
                              ("gate_dtype", GATE_DTYPES)):
            if getattr(self, name) not in allowed:
                raise SASConfigError(f"--sas-{name.replace('_', '-')} must be one of {', '.join(allowed)}, "
                                     f"got {getattr(self, name)!r}")
        if self.kernels == "triton" and not kind.fused_kernels:
            raise SASConfigError(f"--sas-kernels triton runs the fused kernels, which the {self.selector} selector "
                                 "does not have: that selector runs with --sas-kernels torch (or auto)")
        if self.summary_marks not in (0, 1, 2):
            raise SASConfigError(f"SAS_SUMMARY_MARKS must be 0 (off), 1 (the device's form) or 2 (the device-side "
                                 f"form everywhere), got {self.summary_marks}")
        if self.debug_layers not in ("first", "all"):
            raise SASConfigError(f"SAS_DEBUG_LAYERS must be first or all, got {self.debug_layers!r}")
        if self.cpu_extend not in CPU_EXTENDS:
            raise SASConfigError(f"SAS_CPU_EXTEND must be one of {', '.join(CPU_EXTENDS)}, got {self.cpu_extend!r}")
        return self

    @classmethod
    def from_env(cls, environ=None) -> "SASConfig":
        """Read `SAS_*` variables (unset ones keep the defaults). Does not validate."""
        env = os.environ if environ is None else environ
        kwargs = {}
        for s in SETTINGS:
            raw = env.get(s.env)
            if raw is None or raw == "":
                continue
            try:
                kwargs[s.field] = s.type(raw)
            except ValueError:
                raise SASConfigError(f"{s.env}={raw!r} is not an integer") from None
        return cls(**kwargs)

    def to_env(self) -> dict:
        """The `SAS_*` variables that reproduce this config."""
        out = {}
        for s in SETTINGS:
            value = getattr(self, s.field)
            if value is not None:
                out[s.env] = str(value)
        return out

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["top_k"] = None if self.budget is None else self.top_k
        return d


#: Settings a gate checkpoint may supply (`GateConfig.serve_defaults`), with their fallbacks.
_FROM_GATE = {"budget": DEFAULT_BUDGET, "sink_blocks": 0, "local_blocks": 0, "prompt_anchors": 0, "sub_blocks": 1,
              "exact_rerank": 1}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One SASConfig field as launch flags and the environment name it.

    field: SASConfig attribute; env: its `SAS_*` variable; flag: its `--sas-*` launch flag (None:
    environment only); help: the flag's help text (`help_text()`); type: int or str, how a value is parsed;
    default: the field's default.
    """

    field: str
    env: str
    flag: Optional[str]
    help: object  # str, or a callable giving it when shown (the selector's choices read the registry)
    type: type
    default: object
    default_text: Optional[str] = None

    def help_text(self) -> str:
        return self.help() if callable(self.help) else self.help


def _settings() -> tuple[Setting, ...]:
    hints = typing.get_type_hints(SASConfig)
    return tuple(
        Setting(f.name, f.metadata["env"], f.metadata["flag"], f.metadata["help"],
                int if hints[f.name] in (int, Optional[int]) else str, f.default, f.metadata["default_text"])
        for f in dataclasses.fields(SASConfig)
    )


#: Every setting, in field order: the one table `from_env`, `to_env` and the plugin's flags read.
SETTINGS = _settings()
