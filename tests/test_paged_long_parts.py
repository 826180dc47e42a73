"""bench/paged_long.py's log reading: where a retracted request resumed (the server study runs by hand)."""

from __future__ import annotations

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]

from paged_long import compare, resumed_lengths  # noqa: E402

# SGLang 0.5.21's lines around a retraction (server B of the --quick rehearsal, 2 prompts of 1077 tokens)
LOG = (
    "[t] Prefill batch, #new-seq: 1, #new-token: 320, #cached-token: 0, token usage: 0.20, #running-req: 0, "
    "#queue-req: 1, #pending-token: 757, cpu graph: False\n"
    "[t] Prefill batch, #new-seq: 1, #new-token: 320, #cached-token: 0, token usage: 0.29, #running-req: 0, "
    "#queue-req: 1, #pending-token: 437, cpu graph: False\n"
    "[t] Decode batch, #running-req: 2, #token: 3200, token usage: 0.98, cpu graph: False\n"
    "[t] KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_tokens_gained: 576, "
    "#new_token_ratio: 0.0088 -> 0.9035\n"
    "[t] Decode batch, #running-req: 1, #token: 1664, token usage: 0.51, cpu graph: False, #queue-req: 1\n"
    "[t] Prefill batch, #new-seq: 1, #new-token: 320, #cached-token: 1024, token usage: 0.49, #running-req: 0, "
    "#queue-req: 0, #pending-token: 256, cpu graph: False\n"
    "[t] Prefill batch, #new-seq: 1, #new-token: 256, #cached-token: 0, token usage: 0.51, #running-req: 0, "
    "#queue-req: 0, #pending-token: 0, cpu graph: False\n"
)


def test_resume_point_is_read_from_the_first_prefill_after_the_retraction():
    # 1024 cached + 320 + 256 pending = 1600 = the 1077-token prompt and 523 tokens decoded before it
    assert resumed_lengths(LOG, 1077) == [523]


def test_chunks_of_a_resume_are_one_resume_even_when_longer_than_the_prompt():
    log = LOG.split("[t] KV")[0] + (
        "[t] KV cache pool is full. Retract requests. #retracted_reqs: 1\n"
        "[t] Prefill batch, #new-seq: 1, #new-token: 320, #cached-token: 0, #pending-token: 1600, x\n"
        "[t] Prefill batch, #new-seq: 1, #new-token: 320, #cached-token: 0, #pending-token: 1280, x\n")
    assert resumed_lengths(log, 1077) == [1920 - 1077]


def test_no_retraction_no_resume():
    assert resumed_lengths(LOG.split("[t] KV")[0], 1077) == []


def test_compare_needs_equal_tokens_and_close_logprobs():
    ref = {"token_ids": [1, 2, 3], "logprobs": [-0.5, -1.0, -2.0]}
    assert compare({"token_ids": [1, 2, 3], "logprobs": [-0.5, -1.001, -2.0]}, ref, 2e-3)["equal"]
    assert not compare({"token_ids": [1, 2, 3], "logprobs": [-0.5, -1.01, -2.0]}, ref, 2e-3)["equal"]
    assert not compare({"token_ids": [1, 2, 4], "logprobs": [-0.5, -1.0, -2.0]}, ref, 2e-3)["equal"]
