"""Drive a soak against a running server and check that it came back whole.

    probes (greedy, cache flushed) -> RSS -> the workload (Poisson arrivals, threads) -> idle wait
    -> pool state (every page free or cached, every summary row reclaimable) -> probes again
    -> flush -> pool state (every page free) -> RSS

`soak(...)` returns the report (a JSON-able dict); `failures(report, ...)` lists what broke.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import statistics
import threading
import time
from typing import Callable, List, Optional, Sequence

import requests

from sas_backend.soak.client import Outcome, send
from sas_backend.soak.workload import SoakRequest

RETRACT_RE = re.compile(r"Retract requests\. #retracted_reqs: (\d+)")
QUEUE_RE = re.compile(r"#queue-req: (\d+)")


# ------------------------------------------------------------------------------ server state
def pool_state(url: str, timeout: float = 600.0) -> dict:
    """The first scheduler's entry of GET /sas/info's `pool` (pool_state.scheduler_pool_state)."""
    r = requests.get(f"{url}/sas/info", timeout=timeout)
    r.raise_for_status()
    pools = r.json().get("pool")
    if not isinstance(pools, list) or not pools or not isinstance(pools[0], dict):
        raise RuntimeError(f"/sas/info has no pool state: {pools!r}")
    return pools[0]


def wait_idle(url: str, timeout: float = 300.0) -> dict:
    """Poll until no request is queued or running and no page is held by one; the last state."""
    deadline = time.monotonic() + timeout
    while True:
        state = pool_state(url)
        if state.get("idle") and state.get("kv_pages", {}).get("in_use") == 0:
            return state
        if time.monotonic() > deadline:
            return state
        time.sleep(1.0)


def flush_cache(url: str) -> None:
    r = requests.post(f"{url}/flush_cache", timeout=120)
    if r.status_code != 200:
        raise RuntimeError(f"/flush_cache answered {r.status_code}: {r.text[:200]}")


def group_rss(pgid: int) -> dict:
    """Resident memory in bytes of every process in process group `pgid` (the server: launcher,
    scheduler(s), detokenizer), from /proc, keyed by "<command name>:<pid>"."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
            if int(rest.split()[2]) != pgid:  # field 5 (pgrp) is the 3rd after the command name
                continue
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        out[f"{head.split('(', 1)[1]}:{pid}"] = int(line.split()[1]) * 1024
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
    return out


def group_rss_bytes(pgid: int) -> int:
    """The server's resident memory in bytes, all its processes together."""
    return sum(group_rss(pgid).values())


class RssSampler:
    """Samples the server's RSS every `every_s` seconds in a thread: `.samples` is [(seconds, bytes)]."""

    def __init__(self, pgid: int, every_s: float = 10.0):
        self.pgid, self.every_s, self.samples, self.per_process = pgid, every_s, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        t0 = time.monotonic()
        while True:
            per_process = group_rss(self.pgid)
            self.samples.append((time.monotonic() - t0, sum(per_process.values())))
            self.per_process.append(per_process)
            if self._stop.wait(self.every_s):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


# ------------------------------------------------------------------------------------ probes
def greedy(url: str, prompt: Sequence[int], max_tokens: int, timeout: float = 1800.0, **extra) -> dict:
    """One greedy completion of token ids: {token_ids, logprobs, cached_tokens} (cached_tokens: the
    prompt tokens the radix cache served, when the server runs with --enable-cache-report, else 0).
    extra: more fields of the request body (`min_tokens=...`)."""
    body = {"model": "default", "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": 1, "return_token_ids": True, **extra}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=timeout)
    r.raise_for_status()
    out = r.json()
    choice = out["choices"][0]
    cached = (out.get("usage", {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"token_ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"], "cached_tokens": cached}


def run_probes(url: str, prompts: Sequence[List[int]], max_tokens: int) -> list:
    """Greedy outputs of the probe prompts, one at a time on a flushed cache: [{token_ids, logprobs}]."""
    flush_cache(url)
    out = []
    for p in prompts:
        run = greedy(url, p, max_tokens)
        out.append({"token_ids": run["token_ids"], "logprobs": run["logprobs"]})
    return out


def compare_probes(before: list, after: list) -> dict:
    same = [a["token_ids"] == b["token_ids"] for a, b in zip(before, after)]
    diff = max((abs(x - y) for a, b in zip(before, after) for x, y in zip(a["logprobs"], b["logprobs"])), default=0.0)
    return {"probes": len(before), "tokens_equal": all(same) and len(before) == len(after),
            "max_abs_logprob_diff": diff}


# ---------------------------------------------------------------------------------- workload
def drive(url: str, workload: Sequence[SoakRequest], max_workers: int = 128,
          progress: Optional[Callable[[int, int, float], None]] = None) -> List[Outcome]:
    """Send each request at its arrival time (threads); the outcomes in request order."""
    t0 = time.monotonic()
    done, lock = [0], threading.Lock()

    def task(req):
        out = send(url, req)
        with lock:
            done[0] += 1
            if progress is not None:
                progress(done[0], len(workload), time.monotonic() - t0)
        return out

    with concurrent.futures.ThreadPoolExecutor(max_workers) as pool:
        futures = []
        for req in workload:
            delay = req.at - (time.monotonic() - t0)
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(task, req))
        outcomes = [f.result() for f in futures]
    return outcomes


def percentiles(values: Sequence[float]) -> Optional[dict]:
    if not values:
        return None
    v = sorted(values)
    q = statistics.quantiles(v, n=100, method="inclusive") if len(v) > 1 else [v[0]] * 99
    return {"n": len(v), "p50": q[49], "p90": q[89], "p99": q[98], "max": v[-1]}


def summarize(workload: Sequence[SoakRequest], outcomes: Sequence[Outcome]) -> dict:
    by = {}
    for req, out in zip(workload, outcomes):
        k = by.setdefault(req.kind, {"sent": 0})
        k["sent"] += 1
        k[out.result] = k.get(out.result, 0) + 1
    results = {}
    for out in outcomes:
        results[out.result] = results.get(out.result, 0) + 1
    ok = [o for o in outcomes if o.result == "ok"]
    return {
        "requests": len(outcomes),
        "results": results,
        "by_kind": by,
        "prompt_tokens": {"min": min(len(r.prompt) for r in workload), "max": max(len(r.prompt) for r in workload),
                          "sum": sum(len(r.prompt) for r in workload)},
        "shared_prefix_requests": sum(r.shared_prefix >= 0 for r in workload),
        "latency_s": {
            "ttft_stream": percentiles([o.ttft_s for o in ok if o.ttft_s is not None]),
            "e2e_complete": percentiles([o.e2e_s for o, r in zip(outcomes, workload)
                                         if o.result == "ok" and not r.stream]),
            "e2e_stream": percentiles([o.e2e_s for o, r in zip(outcomes, workload) if o.result == "ok" and r.stream]),
        },
        "unexpected": [{"index": o.index, "kind": o.kind, "status": o.status, "error": o.error}
                       for o in outcomes if o.result == "unexpected"][:20],
    }


def scan_log(text: str) -> dict:
    """What the server's log says happened: retractions, the longest queue, leaks, tracebacks."""
    return {
        "retracted_requests": sum(int(m) for m in RETRACT_RE.findall(text)),
        "retraction_events": len(RETRACT_RE.findall(text)),
        "max_queue": max((int(m) for m in QUEUE_RE.findall(text)), default=0),
        "leak_lines": sum("memory leak" in line for line in text.splitlines()),
        "tracebacks": text.count("Traceback (most recent call last)"),
    }


# -------------------------------------------------------------------------------------- soak
def soak(server, workload: Sequence[SoakRequest], probes: Sequence[List[int]], probe_tokens: int = 16,
         progress=None) -> dict:
    """Run the whole soak against `server` (a `sas_backend.testing.server.Server`); the report."""
    url = server.url
    report: dict = {}
    before = run_probes(url, probes, probe_tokens)
    report["pool_before"] = pool_state(url)
    rss_before = group_rss_bytes(server.proc.pid)
    t0 = time.monotonic()
    with RssSampler(server.proc.pid) as sampler:
        outcomes = drive(url, workload, progress=progress)
    report["wall_s"] = time.monotonic() - t0
    report["summary"] = summarize(workload, outcomes)
    report["pool_idle_after"] = wait_idle(url)
    after = run_probes(url, probes, probe_tokens)
    report["probes"] = compare_probes(before, after)
    flush_cache(url)
    report["pool_after_flush"] = pool_state(url)
    rss_after = group_rss_bytes(server.proc.pid)
    # First-touch allocations (new batch shapes, allocator arenas) land early; a leak keeps growing.
    # So the bound is on growth after the first quarter of the arrivals; the total is reported too.
    warm_t = 0.25 * max((r.at for r in workload), default=0.0)
    warm = next((b for t, b in sampler.samples if t >= warm_t), rss_before)
    report["rss_bytes"] = {"before": rss_before, "after": rss_after, "growth": rss_after - rss_before,
                           "at_warmup": warm, "growth_after_warmup": rss_after - warm,
                           "samples": [(round(t, 1), b) for t, b in sampler.samples],
                           "per_process_first": sampler.per_process[0] if sampler.per_process else {},
                           "per_process_last": sampler.per_process[-1] if sampler.per_process else {},
                           "per_process_after": group_rss(server.proc.pid)}
    report["log"] = scan_log(server.log_text())
    report["server_alive"] = server.alive()
    return report


def failures(report: dict, rss_bound_bytes: int) -> List[str]:
    """Everything the soak must show, as the list of what it did not (empty: passed)."""
    bad = []
    s = report["summary"]
    if s["results"].get("unexpected"):
        bad.append(f"{s['results']['unexpected']} unexpected errors: {s['unexpected'][:3]}")
    if not report["probes"]["tokens_equal"]:
        bad.append(f"probe set changed: {report['probes']}")
    idle = report["pool_idle_after"]
    if not idle.get("idle") or idle["kv_pages"]["in_use"] != 0:
        bad.append(f"not idle after the soak, or pages still held: {idle}")
    sas = report.get("backend", "sas") == "sas"  # a dense backend has no summary rows
    if sas and (idle.get("summary_rows", {}).get("held") != 0 or not idle.get("summary_rows", {}).get("one_per_page")):
        bad.append(f"summary rows not all reclaimable: {idle.get('summary_rows')}")
    flushed = report["pool_after_flush"]["kv_pages"]
    if flushed["free"] != flushed["total"]:
        bad.append(f"pages lost: after the flush {flushed['free']} of {flushed['total']} are free")
    if report["pool_after_flush"].get("leak_warnings"):
        bad.append(f"SGLang's idle memory check warned {report['pool_after_flush']['leak_warnings']} times")
    if report["log"]["leak_lines"] or report["log"]["tracebacks"]:
        bad.append(f"server log: {report['log']}")
    if report["rss_bytes"]["growth_after_warmup"] > rss_bound_bytes:
        bad.append(f"RSS grew {report['rss_bytes']['growth_after_warmup'] / 2**20:.0f} MiB after warm-up "
                   f"(bound {rss_bound_bytes / 2**20:.0f} MiB)")
    late = report["pool_after_flush"].get("late_summaries")
    if sas and late:  # a colocated server marks every page it fills: a late summary means a mark went missing
        bad.append(f"{late} pages were summarized late at decode planning (their validity marks were lost)")
    steps = report["pool_after_flush"].get("decode_steps")
    if sas and not (steps or {}).get("sparse"):  # a soak that never selected proves nothing about sparse decode
        bad.append(f"no decode step was sparse: {steps}")
    if not report["server_alive"]:
        bad.append("the server died")
    return bad
