"""The KV pages and `sas` summary rows of a running scheduler, for GET /sas/info.

A summary row has no allocator of its own: row p belongs to physical KV page p (backend/summary_pool.py),
so a row is held exactly while its page is, and reclaimable exactly when its page is free or held
only by the radix cache (evictable). This module reads SGLang's own accounting (the KV allocator, the
radix tree, the request-slot pool) in the scheduler process and states it per page, so a soak can
check that every page and every summary row came back; the scheduler answers through SGLang's
`get_internal_state` request, to which the plugin adds a `"sas"` entry (`add_to_internal_state`).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

logger = logging.getLogger(__name__)

# The scheduler method whose reply carries the state (a plugin AROUND hook; see plugin.py).
INTERNAL_STATE_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_internal_state"
STATE_KEY = "sas"


def _attn_backend(scheduler):
    worker = getattr(scheduler, "tp_worker", None)
    runner = getattr(worker, "model_runner", None)
    if runner is None:  # older workers wrap the runner once more
        runner = getattr(getattr(worker, "worker", None), "model_runner", None)
    return getattr(runner, "attn_backend", None)


def _call(obj, name) -> Optional[int]:
    fn = getattr(obj, name, None)
    try:
        return int(fn()) if callable(fn) else None
    except Exception:  # a pool kind without the method: report nothing rather than break the route
        return None


def scheduler_pool_state(scheduler) -> dict:
    """The scheduler's KV pages and summary rows, in pages (= blocks of `page_size` tokens).

    `kv_pages`: `total` (the pool, without SGLang's padding page 0), `free` (in the allocator),
    `cached` (held only by the radix cache, evictable), `in_use` (held by queued or running
    requests: total - free - cached). `summary_rows`: `total` (rows for real pages), `reclaimable`
    (rows of free or cached pages), `held` (rows of pages in use); `idle`: no request queued or
    running; `leak_warnings`: SGLang's idle memory check's warning count (None where it keeps none);
    `decode_steps`: the sas backend's decode and verify steps so far, `{"sparse": n, "dense": n}` (None on
    another backend); `dense_below`: the tokens at or under which its steps attend densely as resolved (the
    launch's `--sas-dense-below`, else the device's default; None on another backend); `late_summaries`: pages the
    sas backend summarized at decode planning because their KV came without an extend through it (0 in a
    colocated server; None on another backend); `kv_cache`: the KV dtype the sas backend reads and, for an fp8
    cache, where its layers' scales came from (`backend.kv_scales.SOURCES`: layers per source) and their range
    (None on another backend); `memory`: the sas backend's device bytes by name, `held` and `reserved`
    (`_memory_state`); `pd_prompt_anchors`: on a PD decode server keeping prompt anchors, the transferred requests
    whose anchors arrived, were missing or were restored after a retraction (`_pd_anchor_counts`).
    """
    backend = _attn_backend(scheduler)
    page = int(getattr(backend, "block_size", 0) or getattr(scheduler, "page_size", 1) or 1)
    total_tokens = int(getattr(scheduler, "max_total_num_tokens", 0) or 0)
    free_tokens = _call(getattr(scheduler, "token_to_kv_pool_allocator", None), "available_size")
    cached_tokens = _call(getattr(scheduler, "tree_cache", None), "evictable_size")
    state: dict = {"page_size": page, "idle": _is_idle(scheduler)}
    if free_tokens is not None and cached_tokens is not None and total_tokens:
        total, free, cached = total_tokens // page, free_tokens // page, cached_tokens // page
        state["kv_pages"] = {"total": total, "free": free, "cached": cached, "in_use": total - free - cached}
    summaries = getattr(backend, "summaries", None)
    if summaries is not None and "kv_pages" in state:
        pages = state["kv_pages"]
        rows = summaries.num_pages - 1  # row 0 mirrors the padding page
        state["summary_rows"] = {
            "total": rows,
            "reclaimable": pages["free"] + pages["cached"],
            "held": pages["in_use"],
            # Every real page has its row: a pool sized apart from the KV pool would break the mirror.
            "one_per_page": rows == pages["total"],
        }
    req_pool = getattr(scheduler, "req_to_token_pool", None)
    slots_free, slots = _call(req_pool, "available_size"), getattr(req_pool, "size", None)
    if slots_free is not None and slots is not None:
        state["request_slots"] = {"total": int(slots), "free": slots_free}
    checker = getattr(scheduler, "invariant_checker", scheduler)
    warnings = getattr(checker, "count_memory_leak_warnings", None)
    state["leak_warnings"] = None if warnings is None else int(warnings)
    state["gate_sha256"] = getattr(backend, "gate_sha256", None)  # of the gate this scheduler loaded
    steps = getattr(backend, "decode_steps", None)  # {"sparse": n, "dense": n} on a sas backend
    state["decode_steps"] = dict(steps) if isinstance(steps, dict) else None
    settings = getattr(backend, "settings", None)
    state["dense_below"] = getattr(settings, "dense_below", None)
    state["late_summaries"] = getattr(backend, "late_summaries", None)
    state["pd_prompt_anchors"] = _pd_anchor_counts(backend)
    state["kv_cache"] = _kv_cache_state(backend)
    state["memory"] = _memory_state(backend)
    state["pid"] = os.getpid()
    return state


def _pd_anchor_counts(backend) -> Optional[dict]:
    """On a sas backend keeping prompt anchors: the transferred requests whose anchors arrived from the prefill server
    (`received`) or did not (`missing`: they decode without), and retracted requests whose anchors went with them to
    the slot they resumed in (`restored`; backend/pd_anchors.py). None elsewhere."""
    from sas_backend.backend import pd_anchors

    step = getattr(backend, "step", None)
    if getattr(step, "anchors", None) is None or pd_anchors.SERVED.pool is not step.anchors:
        return None
    return pd_anchors.SERVED.counts()


def _memory_state(backend) -> Optional[dict]:
    """The sas backend's device bytes by name: `held` (what its objects hold now) and `reserved` (what the launch set
    aside beside the KV pool, `backend.memory.RESERVED`; None where nothing was reserved). None on another backend."""
    if not hasattr(backend, "held_bytes"):
        return None
    from sas_backend.backend import memory

    return {"held": backend.held_bytes(), "reserved": memory.RESERVED}


def _kv_cache_state(backend) -> Optional[dict]:
    """The sas backend's KV dtype and (fp8) its scales: sources by layer count, smallest and largest k / v scale."""
    dtype = getattr(backend, "kv_dtype", None)
    if dtype is None:
        return None
    state = {"dtype": str(dtype).replace("torch.", "")}
    if getattr(backend, "kv_fp8", False):
        sources: dict = {}
        for source in backend.kv_scale_sources.values():
            sources[source] = sources.get(source, 0) + 1
        ks = [k for k, _ in backend.kv_scales.values()]
        vs = [v for _, v in backend.kv_scales.values()]
        state["scales"] = {"sources": sources, "k_scale": [min(ks), max(ks)], "v_scale": [min(vs), max(vs)]}
    return state


def _is_idle(scheduler) -> Optional[bool]:
    waiting = getattr(scheduler, "waiting_queue", None)
    running = getattr(scheduler, "running_batch", None)
    if waiting is None or running is None:
        return None
    running_empty = running.is_empty() if hasattr(running, "is_empty") else not getattr(running, "reqs", None)
    return len(waiting) == 0 and bool(running_empty) and getattr(scheduler, "chunked_req", None) is None


def add_to_internal_state(original, scheduler, *args, **kwargs):
    """AROUND hook of `Scheduler.get_internal_state`: its reply plus `"sas"` (this module's state)."""
    reply = original(scheduler, *args, **kwargs)
    try:
        target = getattr(reply, "internal_state", reply)  # a dict, or an output object holding one
        if isinstance(target, dict):
            target[STATE_KEY] = scheduler_pool_state(scheduler)
    except Exception as e:  # never break SGLang's own route
        logger.warning("sas: pool state unavailable: %s", e)
    return reply
