"""The soak's parts without a server: the workload it sends, the checks that fail it, its RSS sampler
and log scan (the whole soak through a real server: tests/server/test_soak.py)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest

from sas_backend.soak.run import RssSampler, failures, group_rss, scan_log
from sas_backend.soak.workload import MIN_PROMPT, WorkloadSpec, make_workload

TEXT = list(range(100, 60_000))


def test_workload_mix_lengths_and_arrivals():
    spec = WorkloadSpec(requests=2000, duration_s=600, context_len=4096, max_new_tokens=96, seed=3)
    w = make_workload(spec, TEXT)
    assert [r.index for r in w] == list(range(2000))
    assert all(a.at < b.at for a, b in zip(w, w[1:])) and w[-1].at == pytest.approx(600, rel=0.1)
    kinds = {k: sum(r.kind == k for r in w) for k in ("complete", "stream", "stream_abort", "over_limit")}
    streams = kinds["stream"] + kinds["stream_abort"]
    assert streams / 2000 == pytest.approx(0.5, abs=0.04)
    assert kinds["stream_abort"] / streams == pytest.approx(0.2, abs=0.04)
    assert kinds["over_limit"] / 2000 == pytest.approx(0.03, abs=0.012)
    for r in w:
        if r.over_limit:
            assert len(r.prompt) > spec.context_len
        else:  # fits with its own max_tokens, from MIN_PROMPT up to the limit
            assert MIN_PROMPT <= len(r.prompt) <= spec.context_len - r.max_tokens
        assert 8 <= r.max_tokens <= 96 and (r.abort_after == 0 or r.stream)
    lengths = sorted(len(r.prompt) for r in w if not r.over_limit)
    assert lengths[0] < 32 and lengths[-1] > 3500  # log-uniform: both ends reached
    shared = [r for r in w if r.shared_prefix >= 0]
    assert len(shared) > 200 and len({r.shared_prefix for r in shared}) == spec.prefixes
    for r in shared:  # a radix hit needs the very same leading tokens
        k = r.shared_prefix
        assert r.prompt[:spec.prefix_len] == TEXT[k * spec.prefix_len:(k + 1) * spec.prefix_len]
    assert make_workload(spec, TEXT) == w  # seeded


def test_workload_refuses_what_cannot_fit():
    with pytest.raises(ValueError, match="does not fit"):
        WorkloadSpec(requests=1, duration_s=1, context_len=600, max_new_tokens=96)
    with pytest.raises(ValueError, match="needs at least"):
        make_workload(WorkloadSpec(requests=1, duration_s=1, context_len=4096), TEXT[:5000])


def _passing_report():
    pages = {"total": 128, "free": 17, "cached": 111, "in_use": 0}
    rows = {"total": 128, "reclaimable": 128, "held": 0, "one_per_page": True}
    return {
        "backend": "sas",
        "summary": {"results": {"ok": 10, "client_abort": 2}, "unexpected": []},
        "probes": {"tokens_equal": True},
        "pool_idle_after": {"idle": True, "kv_pages": pages, "summary_rows": rows},
        "pool_after_flush": {"kv_pages": dict(pages, free=128, cached=0), "leak_warnings": 0,
                             "decode_steps": {"sparse": 40, "dense": 12}, "late_summaries": 0},
        "log": {"leak_lines": 0, "tracebacks": 0},
        "rss_bytes": {"growth_after_warmup": 100 * 2**20},
        "server_alive": True,
    }


@pytest.mark.parametrize("break_it, message", [
    (lambda r: r["summary"]["results"].update(unexpected=1), "unexpected"),
    (lambda r: r["probes"].update(tokens_equal=False), "probe set changed"),
    (lambda r: r["pool_idle_after"]["kv_pages"].update(in_use=1), "pages still held"),
    (lambda r: r["pool_idle_after"].update(idle=False), "not idle"),
    (lambda r: r["pool_idle_after"]["summary_rows"].update(held=1), "summary rows"),
    (lambda r: r["pool_idle_after"]["summary_rows"].update(one_per_page=False), "summary rows"),
    (lambda r: r["pool_after_flush"]["kv_pages"].update(free=127), "pages lost"),
    (lambda r: r["pool_after_flush"].update(leak_warnings=2), "idle memory check"),
    (lambda r: r["log"].update(tracebacks=1), "server log"),
    (lambda r: r["rss_bytes"].update(growth_after_warmup=300 * 2**20), "RSS grew"),
    (lambda r: r.update(server_alive=False), "died"),
    (lambda r: r["pool_after_flush"]["decode_steps"].update(sparse=0), "no decode step was sparse"),
    (lambda r: r["pool_after_flush"].update(decode_steps=None), "no decode step was sparse"),
    (lambda r: r["pool_after_flush"].update(late_summaries=3), "validity marks were lost"),
])
def test_each_check_can_fail(break_it, message):
    assert failures(_passing_report(), 256 * 2**20) == []
    report = copy.deepcopy(_passing_report())
    break_it(report)
    bad = failures(report, 256 * 2**20)
    assert len(bad) == 1 and message in bad[0], bad


def test_a_dense_backend_has_no_summary_rows_to_check():
    report = _passing_report()
    report["backend"] = "torch_native"
    del report["pool_idle_after"]["summary_rows"]
    report["pool_after_flush"]["decode_steps"] = None
    assert failures(report, 256 * 2**20) == []


def test_rss_of_a_process_group_and_its_growth():
    per_process = group_rss(os.getpgrp())
    assert any(name.endswith(f":{os.getpid()}") for name in per_process)
    assert all(b > 0 for b in per_process.values())
    # A fresh process in its own group touches 64 MiB after a pause (a fresh process: the memory is
    # new, where this one's allocator might reuse pages it already holds).
    code = ("import time; time.sleep(0.5); b = bytearray(64 << 20)\n"
            "for i in range(0, len(b), 4096): b[i] = 1\n"
            "time.sleep(1.5)")
    child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        with RssSampler(child.pid, every_s=0.05) as sampler:
            child.wait(timeout=60)
    finally:
        child.kill()
    rss = [b for _, b in sampler.samples if b > 0]
    assert len(sampler.per_process) == len(sampler.samples) and len(rss) >= 2
    assert max(rss) - rss[0] > 48 * 2**20, rss


def test_scan_log_reads_sglangs_lines():
    log = "\n".join([
        "Decode batch, #running-req: 3, #token: 100, #queue-req: 4",
        "Prefill batch, #new-seq: 1, #queue-req: 11",
        "KV cache pool is full. Retract requests. #retracted_reqs: 2, #new_token_ratio: 0.3",
        "Retract requests. #retracted_reqs: 1",
        "token_to_kv_pool_allocator memory leak detected!",
        "Traceback (most recent call last):",
    ])
    assert scan_log(log) == {"retracted_requests": 3, "retraction_events": 2, "max_queue": 11,
                             "leak_lines": 1, "tracebacks": 1}
