"""SGLang plugin entry point (group `sglang.srt.plugins`): makes `--attention-backend sas` work.

SGLang calls `register()` in the launcher and in every scheduler process. It
- adds "sas" to the attention-backend choices and registers the backend factory;
- adds the `--sas-*` launch flags and turns them into `SAS_*` environment variables before
  the scheduler processes start (flags win over variables);
- sets the page size to the SAS block size when none is given, and refuses any other;
- makes SGLang size the KV pool with room for the memory sas allocates beside it
  (backend/memory.py);
- serves the SAS configuration, gate identity and pool state at GET /sas/info (the schedulers
  add their KV pages and summary rows to SGLang's internal-state reply: pool_state.py);
- gives SGLang's dense `torch_native` backend the speculative verify step it lacks (dense_verify.py), so
  that `--speculative-algorithm NGRAM --attention-backend torch_native` runs on CPU (docs/speculative.md);
- refuses the speculative launches sas cannot verify (tree drafts) and turns NGRAM's drafts into chains for a
  sas target (speculative.py);
- opens SGLang's CPU fp8_e4m3 KV pool, which SGLang reserves for its intel_amx backend, to a sas-only server
  (backend/cpu_fp8_pool.py).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os

from sas_backend.config import SETTINGS, SASConfig, SASConfigError

logger = logging.getLogger(__name__)

BACKEND_NAME = "sas"
_UNSET = None  # --page-size default while parsing, so "not given" can be told from "1"
_page_size_default = {}


def register() -> None:
    """Plugin hook: called by `sglang.srt.plugins.load_plugins()` in every SGLang process."""
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import add_attention_backend_choices

    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register_attention_backend(BACKEND_NAME)(_create_backend)

    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.add_cli_args", _add_cli_args, HookType.AROUND
    )
    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.from_cli_args", _from_cli_args, HookType.AROUND
    )
    _register_memory_hook(HookRegistry, HookType)
    _register_pool_state_hook(HookRegistry, HookType)
    from sas_backend import dense_verify

    dense_verify.register(HookRegistry, HookType)
    from sas_backend.backend import pd_anchors

    pd_anchors.register(HookRegistry, HookType)  # prompt anchors ride in SGLang's PD metadata (both sides)
    from sas_backend import speculative

    speculative.register(HookRegistry, HookType)  # NGRAM drafts as chains, for a sas target only
    from sas_backend.backend import cpu_fp8_pool

    cpu_fp8_pool.register(HookRegistry, HookType)  # --kv-cache-dtype fp8_e4m3 on CPU for a sas-only server
    if multiprocessing.current_process().name == "MainProcess":
        _add_info_route()


def _register_memory_hook(registry, hook_type) -> None:
    from sas_backend.backend.memory import reserve_sas_memory
    from sas_backend.backend.sglang_compat import profile_target

    target = profile_target()
    if target is None:  # an SGLang we do not know: serve, but say the pool is not shrunk
        logger.warning("sas: no KV-pool profiling function found; sas memory is not reserved")
        return
    registry.register(target, reserve_sas_memory, hook_type.AROUND)


def _register_pool_state_hook(registry, hook_type) -> None:
    # Resolved by SGLang when it applies the hooks (the scheduler module is imported then anyway);
    # an SGLang without this method logs the failed hook and /sas/info has no pool state.
    from sas_backend.pool_state import INTERNAL_STATE_TARGET, add_to_internal_state

    registry.register(INTERNAL_STATE_TARGET, add_to_internal_state, hook_type.AROUND)


def _create_backend(runner):
    # Imported lazily: the backend pulls in torch/triton pieces the launcher never needs.
    from sas_backend.backend.factory import create_sas_backend

    return create_sas_backend(runner)


def _add_cli_args(original, parser: argparse.ArgumentParser):
    original(parser)
    group = parser.add_argument_group("SAS sparse decode (--attention-backend sas)")
    for s in SETTINGS:
        if s.flag is None:
            continue
        default = s.default_text or (f"default {s.default}" if s.default is not None
                                     else "required with --attention-backend sas")
        # default=None, not the field's: a flag not given must not override its SAS_* variable
        group.add_argument(
            s.flag, dest=f"sas_{s.field}", type=s.type, default=None,
            help=f"{s.help_text()} ({default}; env {s.env})",
        )
    action = parser._option_string_actions.get("--page-size")
    if action is not None:
        _page_size_default["value"] = action.default
        action.default = _UNSET


def _from_cli_args(original, cls, args: argparse.Namespace):
    try:
        _apply_sas_args(args)
    except ValueError as e:  # SASConfigError, GateCheckpointError: a message for the user
        raise SystemExit(f"error: {e}") from None
    return original(cls, args)


def _apply_sas_args(args: argparse.Namespace) -> None:
    """Flags -> environment (for the scheduler processes), page size, unsupported features."""
    for s in SETTINGS:
        value = getattr(args, f"sas_{s.field}", None)
        if value is not None:
            os.environ[s.env] = str(value)
    page_size_given = getattr(args, "page_size", _UNSET) is not _UNSET
    if getattr(args, "attention_backend", None) != BACKEND_NAME:
        if not page_size_given and "value" in _page_size_default:
            args.page_size = _page_size_default["value"]
        return
    os.environ["SAS_ACTIVE"] = "1"
    given = SASConfig.from_env()
    cfg = given.resolved().validate()
    # Every scheduler process must serve the same budget and forced blocks: pin the resolved ones.
    os.environ.update(cfg.to_env())
    # Which blocks are forced and why: a gate trained with forced blocks depends on them being served
    logger.info("sas: %s", cfg.describe_selection(given.origins()))
    _check_gate_fits(cfg, getattr(args, "model_path", None))
    trained = _trained_forced_blocks(cfg)
    # Only fewer forced blocks than in training is a risk: more are blocks the gate would rank itself.
    if trained is not None and (cfg.sink_blocks < trained[0] or cfg.local_blocks < trained[1]):
        logger.warning("sas: the gate was trained with sink %d + local %d forced blocks and is served with sink %d + "
                       "local %d: the blocks it never learned to rank are left to it (measure quality before serving)",
                       *trained, cfg.sink_blocks, cfg.local_blocks)
    if multiprocessing.current_process().name == "MainProcess":
        # The gate's identity as launched (/sas/info caches it): a file replaced later changes nothing.
        from sas_backend.info import sas_info

        sas_info()
    if _needs_gate(cfg):
        from sas_backend.gate.gate_file import open_gate

        open_gate(cfg.gate_path).release_tensors()  # checked and hashed: the launcher needs no tensors
    if not page_size_given:
        args.page_size = cfg.block_size
        logger.info("sas: page size set to the SAS block size %d", cfg.block_size)
    elif args.page_size != cfg.block_size:
        raise SASConfigError(
            f"the sas backend stores one block summary per KV page, so the page size must equal "
            f"the SAS block size {cfg.block_size}; got --page-size {args.page_size}. "
            f"Drop --page-size (sas sets it) or pass --page-size {cfg.block_size}."
        )
    if getattr(args, "enable_hierarchical_cache", None):
        raise SASConfigError("the sas backend does not support the hierarchical (host) KV cache yet; drop that flag")
    # KV pages loaded from an external store land without an extend through sas: no block summaries for them.
    for flag, name in (("enable_lmcache", "--enable-lmcache"),
                       ("hicache_storage_backend", "--hicache-storage-backend")):
        if getattr(args, flag, None):
            raise SASConfigError(f"the sas backend cannot serve KV pages loaded from an external cache yet ({name}): "
                                 "they arrive without block summaries; drop that flag")
    if getattr(args, "disaggregation_mode", None) == "decode":
        _check_pd_decode(cfg, on_cuda=_launch_on_cuda(args), speculative=getattr(args, "speculative_algorithm", None))
    if str(getattr(args, "kv_cache_dtype", "")).startswith("fp8"):
        from sas_backend.backend.kv_scales import check_param_path_file

        check_param_path_file(getattr(args, "quantization_param_path", None), args.kv_cache_dtype,
                              int(getattr(args, "tp_size", 1) or 1), getattr(args, "model_path", None))
    from sas_backend.speculative import check_launch

    if getattr(args, "speculative_algorithm", None):  # the CUDA query only where it decides something
        check_launch(args, on_cuda=_launch_on_cuda(args))
    if cfg.prompt_anchors and getattr(args, "enable_mixed_chunk", False):
        # a mixed batch extends running requests by their decode token: their anchors would follow it
        raise SASConfigError(
            f"--sas-prompt-anchors {cfg.prompt_anchors} cannot be combined with --enable-mixed-chunk (a mixed "
            "batch extends running requests by one decode token, which would replace their prompt's anchors); "
            "drop --enable-mixed-chunk or pass --sas-prompt-anchors 0")
    for attr in ("prefill_attention_backend", "decode_attention_backend"):
        other = getattr(args, attr, None)
        if other not in (None, BACKEND_NAME):
            raise SASConfigError(
                f"--{attr.replace('_', '-')} {other} cannot be combined with --attention-backend sas "
                "(sas runs dense prefill itself)"
            )


def _check_pd_decode(cfg, on_cuda: bool, speculative=None) -> None:
    """A prefill-decode disaggregation decode server: a transferred request's KV lands in pages this server
    allocated without an extend through sas. The summary pool's validity marks summarize those pages at the
    request's first decode step (on CPU planned on the host; on CUDA listed and repaired on the device, which needs
    a selector with a capturable repair); prompt anchors arrive from a sas prefill server (backend/pd_anchors.py)."""
    from sas_backend.selection import selector_class

    kind = selector_class(cfg.selector)
    if on_cuda and kind.keeps_summaries and not kind.capturable_repair:
        raise SASConfigError(
            f"the sas backend serves a prefill-decode disaggregation decode server (--disaggregation-mode decode) on "
            f"CUDA with the gate selector only: the {cfg.selector} selector's late summaries of transferred KV pages "
            "need a host sync, which CUDA graphs cannot hold. Use --sas-selector gate, serve the decode side on CPU, "
            "or with a dense backend")
    if str(speculative or "").upper() == "NGRAM":
        raise SASConfigError(
            "--speculative-algorithm NGRAM on a prefill-decode disaggregation decode server: SGLang 0.5.21's decode "
            "scheduler fails on the first transferred request (overlap_utils._maybe_init_ngram_bufs reads the "
            "draft tokens a transferred NGRAM request does not have), whatever the attention backend. Drop the "
            "speculative flags on the decode server")
    if speculative:
        raise SASConfigError(
            f"--speculative-algorithm {speculative} on a prefill-decode disaggregation decode server with the sas "
            "backend is not verified: a transferred request's first draft step reads the prefill server's draft "
            "state, and no test has run that pair (it needs CUDA on both sides). Drop the speculative flags on the "
            "decode server")
    if cfg.prompt_anchors:
        _check_pd_anchors(cfg.prompt_anchors)


def _check_pd_anchors(count: int) -> None:
    """Prompt anchors on a PD decode server: they come from the prefill server's extend, through one more buffer of
    SGLang's PD metadata (backend/pd_anchors.py)."""
    from sas_backend.backend import pd_anchors

    fix = "Pass --sas-prompt-anchors 0 on the decode server"
    if not pd_anchors.hooks_available():
        raise SASConfigError(
            f"--sas-prompt-anchors {count} on a prefill-decode disaggregation decode server: the anchors are computed "
            "at the prompt's extend on the prefill server and travel in SGLang's PD metadata, whose functions this "
            f"SGLang release does not have ({', '.join(pd_anchors.TARGETS)}). {fix}")
    if count > pd_anchors.CAPACITY:
        raise SASConfigError(
            f"--sas-prompt-anchors {count} on a prefill-decode disaggregation decode server: the PD metadata row "
            f"carries at most {pd_anchors.CAPACITY} anchors per layer and kv head. Pass at most "
            f"{pd_anchors.CAPACITY}, or 0")


def _needs_gate(cfg) -> bool:
    """Whether cfg's selector reads a gate checkpoint (its registered class says; selection imports torch, so
    lazily)."""
    from sas_backend.selection import selector_class

    return selector_class(cfg.selector).needs_gate


def _launch_on_cuda(args) -> bool:
    """Whether this launch serves on CUDA (--device, else what torch sees)."""
    device = getattr(args, "device", None)
    if device:
        return str(device).startswith("cuda")
    import torch

    return torch.cuda.is_available()


def _trained_forced_blocks(cfg) -> "tuple[int, int] | None":
    """(sink, local) blocks the gate was trained with forced (its training record), None if unrecorded."""
    if not _needs_gate(cfg) or not cfg.gate_path:
        return None
    from sas_backend.gate.gate_file import read_training_record

    rec = read_training_record(cfg.gate_path)
    if rec.get("sink_blocks") is None or rec.get("local_blocks") is None:
        return None
    return int(rec["sink_blocks"]), int(rec["local_blocks"])


def _check_gate_fits(cfg: SASConfig, model_path) -> None:
    """Fail in the launcher, in a second, on a gate that is missing, corrupt or for another model.

    The scheduler checks again (it is the only check for the offline Engine API); this one
    spares the user the model load before the error.
    """
    from sas_backend.gate.checkpoint import validate_for_geometry
    from sas_backend.gate.gate_file import open_gate
    from sas_backend.geometry import ModelGeometry

    if not _needs_gate(cfg):  # training-free selectors read no checkpoint
        return
    if not os.path.isdir(cfg.gate_path):
        raise SASConfigError(f"gate checkpoint directory {cfg.gate_path!r} does not exist")
    gate_cfg, layers = open_gate(cfg.gate_path).loaded()  # GateCheckpointError is a ValueError
    if model_path and os.path.isfile(os.path.join(model_path, "config.json")):
        validate_for_geometry(gate_cfg, layers, ModelGeometry.from_model_dir(model_path), block_size=cfg.block_size)


def _add_info_route() -> None:
    try:
        from sglang.srt.entrypoints.http_server import app
    except Exception as e:  # the HTTP server is optional (e.g. offline Engine use)
        logger.debug("sas: no HTTP app to add /sas/info to: %s", e)
        return
    if any(getattr(r, "path", None) == "/sas/info" for r in app.routes):
        return

    from sas_backend.info import sas_info_route

    app.add_api_route("/sas/info", sas_info_route, methods=["GET"])
