"""Prefill-decode disaggregation on CPU: a dense prefill server and a `sas` decode server on loopback, the KV pages
moved by Mooncake over TCP, decode as a colocated `sas` server decodes.

A transferred request never runs an extend on the decode server (SGLang: `ForwardMode.PREBUILT`): its KV lands in
pages that server allocated, and the first forward `sas` sees is a decode step. The summary pool's validity
marks (backend/page_marks.py) make those pages' summaries at that step, before any selection. The decode server
runs the configuration of the suite's `sas_sparse_server` (seeded gate, budget 256: 4 of ~22-25 blocks, sink 1
+ local 1, fp32, no prompt anchors), which is the colocated reference: greedy tokens and logprobs within
compare.FP32. Two prompts (1600 and 1400 tokens) one after the other, so the second request's pages are the
first's, freed and handed out again. The negative control (SAS_PD_CONTROL=1; out of CI for time): the same decode
server with the marks off (SAS_SUMMARY_MARKS=0) selects over summaries that are zeros or the first request's, and
diverges. Prompt anchors: a `sas` prefill server computes them at the prompt's extend and they travel in SGLang's PD
metadata (backend/pd_anchors.py); the anchored pair decodes as a colocated server with the same anchors.

No router: the client sends each request to both servers with the prefill server's bootstrap address and a room
id (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`), as SGLang's router would. The prefill server needs
`--page-size 64` (sas's block size; SGLang refuses a transfer between different page sizes). The decode server
keeps retracted requests' KV as CPU tensors (`--disaggregation-decode-retraction-backup cpu_tensor`: the default
host pool needs HiCache's 10 GiB host reserve).
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import requests

from sas_backend.testing.server import ON_GPU, Server, cpu_threads_bind, free_port
from tests.server.compare import FP32, assert_same_decodes, decode_from_response, generate

pytestmark = pytest.mark.skipif(ON_GPU, reason="the PD pair runs on CPU (Mooncake over TCP between CPU tensors)")

NEW_TOKENS = 24
PROMPTS = ((5000, 1600), (40000, 1400))  # (start in the essays, length): both far above the budget
# Each PD server's KV pool: one request at a time (~1.6K tokens) fits; the suite runs beside other servers.
POOL = ["--max-total-tokens", "4096"]
SAS_DECODE = ["--sas-budget", "256", "--sas-sink-blocks", "1", "--sas-local-blocks", "1", "--sas-prompt-anchors",
              "0", "--dtype", "float32"]
# The anchored pair (a sas prefill server computing prompt anchors, a decode server receiving them in SGLang's PD
# metadata; backend/pd_anchors.py): 8 blocks a step, of which sink 1 + local 1 + 4 anchors, 2 chosen by the gate.
SAS_ANCHORED = ["--sas-budget", "512", "--sas-sink-blocks", "1", "--sas-local-blocks", "1", "--sas-prompt-anchors",
                "4", "--dtype", "float32"]
# SGLang's warmup request on a PD server (sglang.srt.entrypoints.http_server): its decode steps are the only dense ones.
PD_WARMUP_TOKENS = 8
PD_ENV = {"MC_FORCE_TCP": "1", "SGLANG_HOST_IP": "127.0.0.1"}  # Mooncake over TCP on loopback


@pytest.fixture(scope="module")
def mooncake():
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as e:
        pytest.fail(f"Mooncake's transfer engine is missing ({e}): `SAS_EXTRAS=test bash serve/install.sh` installs "
                    "mooncake-transfer-engine-non-cuda and, as root, the libibverbs1 / libnl-3-200 / "
                    "libnl-route-3-200 it loads")


@pytest.fixture(scope="module")
def prefill_server(mooncake, model_dir):
    """SGLang's dense torch-native backend as the prefill server; each test pairs a decode server of its own with
    it, one at a time (the suite runs beside other servers: 2 GiB a server counts)."""
    bootstrap = free_port()
    # --disable-radix-cache: on CPU a prefill server's prefix hit crashes it (SGLang 0.5.21 sends the cached
    # prefix's pages after a torch.cuda.Event, prefill.py maybe_send_cached_prefix_chunk)
    args = [*POOL, "--dtype", "float32", "--page-size", "64", "--disable-radix-cache", "--disaggregation-mode",
            "prefill", "--disaggregation-transfer-backend", "mooncake", "--disaggregation-bootstrap-port",
            str(bootstrap)]
    with Server(model_dir, backend="torch_native", extra_args=args, env=PD_ENV) as s:
        s.bootstrap_port = bootstrap
        yield s


def _decode_server(model_dir, seed_gate, marks: int, sas_args=SAS_DECODE, env=None):
    args = ["--sas-gate", seed_gate, *sas_args, *POOL, "--disaggregation-mode", "decode",
            "--disaggregation-transfer-backend", "mooncake", "--disaggregation-decode-retraction-backup",
            "cpu_tensor"]
    return Server(model_dir, backend="sas", extra_args=args,
                  env={**PD_ENV, "SAS_SUMMARY_MARKS": str(marks), **(env or {})})


def _pd_generate(prefill, decode, prompt):
    """One greedy request through the pair, as a router sends it: to both servers with one bootstrap room."""
    body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 2,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": random.randrange(2**62),
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}}
    replies = {}

    def send(name, server):
        r = requests.post(f"{server.url}/generate", json=body, timeout=900)
        r.raise_for_status()
        replies[name] = r.json()

    threads = [threading.Thread(target=send, args=(n, s)) for n, s in (("prefill", prefill), ("decode", decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(replies) == {"prefill", "decode"}, f"a server failed the request; decode log:\n{decode.log_tail()}"
    return decode_from_response(replies["decode"])


def _pool(server) -> dict:
    return requests.get(f"{server.url}/sas/info", timeout=60).json()["pool"][0]


def _pd_disconnect(prefill, decode, prompt, chunks: int) -> int:
    """One request through the pair whose client leaves the decode server's stream after `chunks` chunks (0: as
    soon as the response starts, while the prefill server still prefills and transfers), as a user closing the
    page does. The prefill server's reply is awaited 30 s at most: where the decode server dropped the request
    before it fetched the KV, the prefill server waits for that transfer until SGLang's bootstrap timeout (minutes;
    measured once: the test took 7 min instead of 2 waiting on it). Returns the chunks read."""
    body = {"input_ids": prompt, "stream": True, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": random.randrange(2**62),
            "sampling_params": {"max_new_tokens": 4 * NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}}
    sent = threading.Thread(target=lambda: requests.post(f"{prefill.url}/generate", json=body, timeout=600).content,
                            daemon=True)
    sent.start()
    read = 0
    with requests.post(f"{decode.url}/generate", json=body, stream=True, timeout=300) as r:
        for line in r.iter_lines() if chunks else ():
            read += bool(line)
            if read >= chunks:
                break  # leaving the block closes the connection
    sent.join(timeout=30)
    return read


def _pd_run(prefill, model_dir, seed_gate, essay_ids, marks: int, disconnect: bool = False):
    """(decodes of PROMPTS through `prefill` and a new sas decode server, its /sas/info pool after them). marks:
    SAS_SUMMARY_MARKS (1: CPU's host-planned form, 2: CUDA's device-side form, 0: off). With
    `disconnect`, then two requests whose clients leave mid-transfer and mid-decode (`_pd_disconnect`), and
    PROMPTS[0] again: its decode is appended to the decodes."""
    with _decode_server(model_dir, seed_gate, marks) as decode:
        outs = [_pd_generate(prefill, decode, essay_ids[s: s + n]) for s, n in PROMPTS]
        pool = _pool(decode)
        if disconnect:  # mid-transfer, then mid-decode
            start, n = PROMPTS[1]
            assert _pd_disconnect(prefill, decode, essay_ids[start + 100: start + 100 + n], chunks=0) == 0
            assert _pd_disconnect(prefill, decode, essay_ids[start + 200: start + 200 + n], chunks=3) == 3
            deadline = time.time() + 120
            while (left := _pool(decode))["kv_pages"]["in_use"] and time.time() < deadline:
                time.sleep(1)  # the abort reaches the scheduler at its next step
            assert left["kv_pages"]["in_use"] == 0 and left["summary_rows"]["held"] == 0, left
            start, n = PROMPTS[0]
            outs.append(_pd_generate(prefill, decode, essay_ids[start: start + n]))
            pool["after_disconnects"] = _pool(decode)
        return outs, pool


@pytest.fixture(scope="module")
def colocated(sas_sparse_server, essay_ids):
    requests.post(f"{sas_sparse_server.url}/flush_cache", timeout=60)
    return [generate(sas_sparse_server.url, essay_ids[s: s + n], NEW_TOKENS) for s, n in PROMPTS]


def test_pd_decode_server_decodes_as_colocated_sas(prefill_server, model_dir, seed_gate, essay_ids, colocated):
    """Both prompts decode as colocated sas; then clients leaving a request mid-transfer and mid-decode leave no page
    or summary row held on the decode server, and the first prompt again (on pages the aborted requests held)
    decodes as colocated sas: both servers go on serving."""
    outs, pool = _pd_run(prefill_server, model_dir, seed_gate, essay_ids, marks=1, disconnect=True)
    assert_same_decodes(colocated, outs[: len(PROMPTS)], FP32,
                        "PD (dense prefill, sas decode over Mooncake TCP) vs colocated sas", n=NEW_TOKENS)
    assert_same_decodes(colocated[:1], outs[len(PROMPTS):], FP32, "PD after a client disconnect vs colocated sas",
                        n=NEW_TOKENS)
    # Every step of the test's requests sparse (the dense ones are SGLang's PD warmup); each request's complete prompt
    # pages summarized at its first decode step, and nothing held once both finished.
    assert pool["decode_steps"]["sparse"] >= len(PROMPTS) * (NEW_TOKENS - 1), pool["decode_steps"]
    assert pool["decode_steps"]["dense"] <= PD_WARMUP_TOKENS, pool["decode_steps"]
    assert pool["late_summaries"] >= sum(n // 64 for _, n in PROMPTS), pool
    assert pool["kv_pages"]["in_use"] == 0 and pool["summary_rows"]["held"] == 0, pool
    # The two clients that left were aborted: of their 2 x 96 tokens the server decoded at most a few each (the
    # repeated prompt adds its own NEW_TOKENS - 1 steps), and nothing is held at the end.
    after = pool["after_disconnects"]
    extra = after["decode_steps"]["sparse"] - pool["decode_steps"]["sparse"] - (NEW_TOKENS - 1)
    assert 0 <= extra <= 2 * 8, (pool["decode_steps"], after["decode_steps"])
    assert after["decode_steps"]["dense"] == pool["decode_steps"]["dense"], (pool["decode_steps"], after)
    assert after["kv_pages"]["in_use"] == 0 and after["summary_rows"]["held"] == 0, after
    print(f"\nPD decode server: {pool['decode_steps']}, pages summarized at a first decode step "
          f"{pool['late_summaries']}; the aborted requests' decode steps: {extra}")


@pytest.fixture(scope="module")
def colocated_anchored(model_dir, seed_gate, essay_ids):
    """A colocated sas server with prompt anchors (SAS_ANCHORED): the anchored pair's reference."""
    with Server(model_dir, backend="sas", extra_args=["--sas-gate", seed_gate, *SAS_ANCHORED, *POOL]) as s:
        return [generate(s.url, essay_ids[st: st + n], NEW_TOKENS) for st, n in PROMPTS]


def test_pd_sas_prefill_anchors_and_device_side_marks(prefill_server, model_dir, seed_gate, essay_ids,
                                                      colocated_anchored):
    """A `sas` prefill server (its extend is dense; it summarizes, computes the prompt anchors and sends KV and
    anchors) and a decode server with prompt anchors, running the validity marks in the form a CUDA server runs them
    (SAS_SUMMARY_MARKS=2 here): each decode step lists its requests' complete blocks without a valid summary on the
    device, every sparse layer's summaries of them are written before the layers run, the step marks them. Both
    prompts at once, the decode server retracting one of them every third step (SGLANG_TEST_RETRACT: its KV backed
    up as CPU tensors) and resuming it in a new slot: its KV restored, its summaries repaired by the marks, its
    anchors restored (counted); the same decodes as a colocated sas server with the same anchors, both requests'
    anchors received, nothing held on either side afterwards. Control: the first prompt again through the dense
    prefill server, which sends no anchors: counted missing, and that request decodes otherwise. (The Triton
    kernels CUDA runs for the list and the summaries: tests/ops/test_late_blocks.py, tests/ops/test_summary_listed.py;
    here their torch paths. One request at a time through the pair: test_pd_decode_server_decodes_as_colocated_sas.)
    """
    bootstrap = free_port()
    args = ["--sas-gate", seed_gate, *SAS_ANCHORED, *POOL, "--disable-radix-cache", "--disaggregation-mode",
            "prefill", "--disaggregation-transfer-backend", "mooncake", "--disaggregation-bootstrap-port",
            str(bootstrap)]
    with Server(model_dir, backend="sas", extra_args=args, env=PD_ENV) as prefill:
        prefill.bootstrap_port = bootstrap
        with _decode_server(model_dir, seed_gate, 2, SAS_ANCHORED, {"SGLANG_TEST_RETRACT": "1"}) as decode:
            both = {}
            threads = [threading.Thread(target=lambda j=j, st=st, n=n: both.__setitem__(
                j, _pd_generate(prefill, decode, essay_ids[st: st + n]))) for j, (st, n) in enumerate(PROMPTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            pool = _pool(decode)
            start, n = PROMPTS[0]
            unanchored = _pd_generate(prefill_server, decode, essay_ids[start: start + n])
            after = _pool(decode)
        prefill_pool = _pool(prefill)
    # Retracted and restored (KV, summaries repaired by the marks, anchors) and still colocated sas's decodes.
    assert_same_decodes(colocated_anchored, [both.get(j) for j in range(len(PROMPTS))], FP32,
                        "PD (sas prefill with prompt anchors; sas decode, device-side marks), two requests at once, "
                        "retracted and restored on the decode server, vs colocated sas", n=NEW_TOKENS)
    anchors = pool["pd_prompt_anchors"]
    assert anchors["received"] == len(PROMPTS) and anchors["missing"] == 0 and anchors["restored"] >= 1, pool
    # Decoded sparsely (the decodes above equal colocated sas's, which selects). The two requests share steps as
    # often as their arrival and the retractions let them, and a step counts once whatever its rows (45 sparse steps
    # for 2 x 23 tokens was seen under load), so the floor is the longer request's. The steps counted dense are
    # SGLang's own PD warmup (http_server's decode-mode warmup: input_ids [10, 11, 12, 13], 8 new tokens, a context
    # the budget covers, so nothing to skip): none of the test's requests may decode densely.
    assert pool["decode_steps"]["sparse"] >= NEW_TOKENS - 1, pool["decode_steps"]
    assert pool["decode_steps"]["dense"] <= PD_WARMUP_TOKENS, pool["decode_steps"]
    # Listed at each request's first decode step (the device form counts listed blocks), again after a restore.
    assert pool["late_summaries"] >= sum(n // 64 for _, n in PROMPTS), pool
    assert pool["kv_pages"]["in_use"] == 0 and pool["summary_rows"]["held"] == 0, pool
    assert prefill_pool["kv_pages"]["in_use"] == 0 and prefill_pool["summary_rows"]["held"] == 0, prefill_pool
    assert prefill_pool["decode_steps"]["sparse"] == 0, prefill_pool  # it only prefills
    assert after["pd_prompt_anchors"] == {**anchors, "missing": 1}, after
    drift = max(abs(a - b) for a, b in zip(unanchored.logprobs, colocated_anchored[0].logprobs))
    assert drift > FP32.logprob, "the anchors made no difference to this request: the test proves nothing"
    assert after["kv_pages"]["in_use"] == 0 and after["summary_rows"]["held"] == 0, after
    print(f"\nPD, sas prefill with anchors, device-side marks, retraction: {pool['decode_steps']}, blocks listed "
          f"late {pool['late_summaries']}, anchors {anchors}; without them the first prompt's logprobs move by up to "
          f"{drift:.3g}")


@pytest.mark.skipif(os.environ.get("SAS_PD_CONTROL") != "1",
                    reason="the negative control's second decode server (~1.5 min): SAS_PD_CONTROL=1 runs it "
                           "(docs/pd.md has its figures); in CI test_pd_decode_server_decodes_as_colocated_sas "
                           "asserts the late summaries it depends on")
def test_pd_without_validity_marks_diverges(prefill_server, model_dir, seed_gate, essay_ids, colocated):
    """The negative control: with the marks off the transferred pages keep their rows' old summaries (zeros for
    the first request, the first request's for the second), and the decode is no longer colocated sas's."""
    outs, pool = _pd_run(prefill_server, model_dir, seed_gate, essay_ids, marks=0)
    assert pool["late_summaries"] == 0, pool
    gaps = [max(abs(a - b) for a, b in zip(ref.logprobs, got.logprobs)) for ref, got in zip(colocated, outs)]
    print(f"\nPD without validity marks: largest |dlogprob| per prompt {gaps}")
    assert all(g > 1e-2 for g in gaps), gaps


@pytest.mark.skipif(os.environ.get("SAS_PD_TP") != "1",
                    reason="tensor parallelism on both PD servers (two servers of 3 ranks on 2 cores, ~8 min): "
                           "SAS_PD_TP=1 runs it (docs/pd.md has its figures)")
def test_pd_tensor_parallel_decode_server(model_dir, seed_gate, essay_ids, colocated_anchored, mooncake):
    """TP 3 (SmolLM2's 3 kv heads, one a rank) on both servers, a sas prefill server and a decode server with prompt
    anchors: each rank sends and receives its own kv head's anchors in its PD metadata row, each rank's pool
    summarizes its kv head's transferred pages at the first decode step, and the decode is colocated sas's with the
    same anchors (at TP 1: the pages, their summaries and the anchors are per kv head either way). A decode server of
    another TP size than its prefill server fails in SGLang's transfer before sas sees the request (0.5.21: "Failed
    to get kvcache from prefill instance")."""
    start, n = PROMPTS[0]
    bootstrap = free_port()
    env = {**PD_ENV, "SGLANG_CPU_OMP_THREADS_BIND": cpu_threads_bind(3)}
    tp = ["--tp-size", "3"]
    args = ["--sas-gate", seed_gate, *SAS_ANCHORED, *POOL, "--disable-radix-cache", "--disaggregation-mode",
            "prefill", "--disaggregation-transfer-backend", "mooncake", "--disaggregation-bootstrap-port",
            str(bootstrap), *tp]
    decode_args = ["--sas-gate", seed_gate, *SAS_ANCHORED, *POOL, "--disaggregation-mode", "decode",
                   "--disaggregation-transfer-backend", "mooncake", "--disaggregation-decode-retraction-backup",
                   "cpu_tensor", *tp]
    with Server(model_dir, backend="sas", extra_args=args, env=env) as prefill:
        prefill.bootstrap_port = bootstrap
        with Server(model_dir, backend="sas", extra_args=decode_args, env=env) as decode:
            outs = [_pd_generate(prefill, decode, essay_ids[start: start + n])]
            pool = _pool(decode)  # rank 0's (SGLang's internal-state reply comes from it)
    # Each rank's kv head selects with its own anchors: a rank without them would move its head's attention.
    assert_same_decodes(colocated_anchored[:1], outs, FP32, "PD at TP 3 (both servers, prompt anchors) vs colocated "
                        "sas at TP 1", n=NEW_TOKENS)
    assert pool["pd_prompt_anchors"] == {"received": 1, "missing": 0, "restored": 0}, pool
    assert pool["decode_steps"]["sparse"] >= NEW_TOKENS - 1 and pool["late_summaries"] >= n // 64, pool
    assert pool["kv_pages"]["in_use"] == 0 and pool["summary_rows"]["held"] == 0, pool
