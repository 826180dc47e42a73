"""SGLang's own benchmark scripts with `--attention-backend sas`: `python -m sas_backend.sglang_bench TOOL ...`.

SGLang's benchmark scripts (`python -m sglang.benchmark.one_batch`, `...one_batch_server`,
`...offline_throughput`, `...serving`, and their older `sglang.bench_*` names) parse their
arguments without loading SGLang's plugins, so they refuse `--attention-backend sas` ("invalid
choice"). This entry point loads the plugins (`sglang.srt.plugins.load_plugins()`, which runs
`sas_backend.plugin.register`), then runs SGLang's script unchanged, as `python -m <module>`
would (`runpy.run_module` with the remaining arguments as `sys.argv[1:]`).

Child processes. A forked child inherits the loaded plugins. SGLang's benchmarks also start
children with multiprocessing's *spawn* method, which begin with a fresh interpreter:
`one_batch --tp-size N` starts one process per rank that builds the model runner (and so the
attention backend) itself; `one_batch_server` starts its server in a spawned process;
`offline_throughput` starts the engine's scheduler processes. SGLang's scheduler process loads
the plugins itself, the others do not. So this wrapper makes every process that *it* spawns load
the plugins before it unpickles its work (`multiprocessing.spawn.get_preparation_data` gains one
entry whose unpickling loads them); processes those children start load them as SGLang's own
launch path does (its scheduler processes call `load_plugins()`). `serving` only talks HTTP to a
running server; it is offered here for uniformity.

`python -m sas_backend.sglang_bench` (or `--help`) lists the tools and the SGLang module each runs in the
installed SGLang; `python -m sas_backend.sglang_bench TOOL --help` prints that script's own help (with
the `--sas-*` flags, as the plugin adds them).
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import runpy
import sys
from typing import Optional, Sequence

logger = logging.getLogger(__name__)

#: tool -> (what it measures, candidate SGLang modules, newest location first)
TOOLS = {
    "one_batch": (
        "latency of one static batch (prefill + decode steps), no server, in this process",
        ("sglang.benchmark.one_batch", "sglang.bench_one_batch"),
    ),
    "one_batch_server": (
        "latency of one batch through a server it launches (or --base-url)",
        ("sglang.benchmark.one_batch_server", "sglang.bench_one_batch_server"),
    ),
    "offline_throughput": (
        "throughput of the offline Engine on a dataset (e.g. --dataset-name random)",
        ("sglang.benchmark.offline_throughput", "sglang.bench_offline_throughput"),
    ),
    "serving": (
        "online serving benchmark over HTTP against a running server (--base-url)",
        ("sglang.benchmark.serving", "sglang.bench_serving"),
    ),
}

PLUGIN_BACKEND = "sas"
_PREP_KEY = "sas_backend_load_plugins"


def resolve_module(tool: str) -> Optional[str]:
    """The SGLang module that runs `tool` in the installed SGLang, or None if it has none."""
    for name in TOOLS[tool][1]:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except ImportError:  # a parent package missing (e.g. no sglang.benchmark in old releases)
            continue
    return None


def canonical_tool(name: str) -> Optional[str]:
    """`one_batch`, also spelled `bench_one_batch`, `one-batch` or as one of its SGLang modules."""
    key = name.strip().replace("-", "_")
    for prefix in ("sglang.benchmark.", "sglang."):
        if key.startswith(prefix):
            key = key[len(prefix):]
    if key.startswith("bench_"):
        key = key[len("bench_"):]
    return key if key in TOOLS else None


def load_plugins() -> None:
    """SGLang's `load_plugins()` (every installed plugin, as `sglang serve` does); if `sas` is
    still not an attention backend (the entry point filtered out by SGLANG_PLUGINS, or this
    package not installed as a distribution), register this plugin directly."""
    from sglang.srt.plugins import load_plugins as sglang_load_plugins

    sglang_load_plugins()
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    if PLUGIN_BACKEND not in ATTENTION_BACKEND_CHOICES:
        from sglang.srt.plugins.hook_registry import HookRegistry

        from sas_backend.plugin import register

        logger.info("sas: the plugin entry point was not loaded; registering the sas backend directly")
        register()
        HookRegistry.apply_hooks()


def plugin_state() -> dict:
    """Whether `sas` is registered in this process: an argument choice of ServerArgs and a factory
    in SGLang's attention registry. Importing this module registers nothing, so a spawned child
    that reports True got the plugin from `install_spawn_hook`. For tests and diagnosis."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    return {
        "process": multiprocessing.current_process().name,
        "choice": PLUGIN_BACKEND in ATTENTION_BACKEND_CHOICES,
        "factory": PLUGIN_BACKEND in ATTENTION_BACKENDS,
    }


# ---------------------------------------------------------------- spawned children load plugins too
def _load_plugins_in_child(process_name: str) -> None:
    """Runs in a spawned child while it unpickles its preparation data, before its work.

    The process name is set first (multiprocessing's `prepare()` sets the same one right after):
    the plugin does launcher-only work (the /sas/info route) only in a process named MainProcess.
    """
    multiprocessing.current_process().name = process_name
    try:
        load_plugins()
    except Exception:  # the child's own error (e.g. "unknown attention backend") will follow
        logger.exception("sas: loading SGLang plugins in spawned process %s failed", process_name)


class _LoadPluginsOnUnpickle:
    def __init__(self, process_name: str):
        self.process_name = process_name

    def __reduce__(self):
        return _load_plugins_in_child, (self.process_name,)


def install_spawn_hook() -> None:
    """Make each process this one starts with the spawn (or forkserver) method load SGLang's
    plugins first. Idempotent."""
    import multiprocessing.spawn as spawn

    original = spawn.get_preparation_data
    if getattr(original, "_sas_loads_plugins", False):
        return

    def get_preparation_data(name):
        data = original(name)
        data[_PREP_KEY] = _LoadPluginsOnUnpickle(name)  # prepare() ignores keys it does not know
        return data

    get_preparation_data._sas_loads_plugins = True
    spawn.get_preparation_data = get_preparation_data


# --------------------------------------------------------------------------------------- CLI
def usage() -> str:
    import sglang

    lines = [
        "usage: python -m sas_backend.sglang_bench TOOL [ARGS ...]",
        "",
        "Runs one of SGLang's benchmark scripts unchanged, after loading SGLang's plugins, so that",
        "`--attention-backend sas` (and the --sas-* flags) are accepted. ARGS are the script's own;",
        "`python -m sas_backend.sglang_bench TOOL --help` prints them.",
        "",
        f"Tools, and the SGLang module each runs in this SGLang ({sglang.__version__}):",
    ]
    width = max(map(len, TOOLS))
    for tool, (what, _) in TOOLS.items():
        module = resolve_module(tool) or "(not in this SGLang)"
        lines.append(f"  {tool:<{width}}  python -m {module}")
        lines.append(f"  {'':<{width}}    {what}")
    lines += [
        "",
        "Example (CPU):",
        "  SGLANG_USE_CPU_ENGINE=1 TRITON_INTERPRET=1 python -m sas_backend.sglang_bench one_batch \\",
        "    --model-path MODEL --attention-backend sas --sas-gate GATE_DIR --device cpu \\",
        "    --max-total-tokens 16384 --batch-size 1 --input-len 128 --output-len 4",
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    tool = canonical_tool(argv[0])
    if tool is None:
        print(f"error: unknown tool {argv[0]!r}; choose one of: {', '.join(TOOLS)}\n", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 2
    module = resolve_module(tool)
    if module is None:
        import sglang

        print(f"error: this SGLang ({sglang.__version__}) has none of {', '.join(TOOLS[tool][1])}",
              file=sys.stderr)
        return 2
    load_plugins()
    install_spawn_hook()
    print(f"[sas_backend.sglang_bench] SGLang plugins loaded; running python -m {module}", file=sys.stderr, flush=True)
    # As `python -m module ARGS`: run_module sets sys.argv[0] to the module's file and runs it as
    # __main__; its SystemExit (argparse errors, sys.exit) passes through unchanged.
    sys.argv = [sys.argv[0], *argv[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0
