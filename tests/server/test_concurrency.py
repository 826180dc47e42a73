"""Many simultaneous streaming requests and radix-cached prefixes give uncorrupted outputs."""

from __future__ import annotations

import concurrent.futures
import json

import requests

from sas_backend.testing.server import complete

# At the sas_sparse_server's K = 4 blocks: within one block, exactly one block, one block + 1 token,
# two blocks, K complete blocks (all selected: dense rows); then sparse rows: on a block boundary,
# one completing a block during decode (700 + 12 crosses 704), 28 blocks. One batch mixes both kinds.
LENGTHS = [30, 64, 65, 128, 300, 640, 700, 1800]
NEW_TOKENS = 12


def _stream(url, prompt):
    body = {"model": "default", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0, "stream": True}
    text, chunks = "", 0
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            payload = json.loads(line[6:])
            text += payload["choices"][0].get("text") or ""
            chunks += 1
    return text, chunks


def test_concurrent_streams_match_solo_runs(essay_ids, sas_sparse_server):
    url = sas_sparse_server.url
    prompts = [essay_ids[40000 + 3000 * i : 40000 + 3000 * i + n] for i, n in enumerate(LENGTHS)]
    solo = [complete(url, p, max_tokens=NEW_TOKENS)["choices"][0]["text"] for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        streamed = list(pool.map(lambda p: _stream(url, p), prompts))
    for i, ((text, chunks), ref) in enumerate(zip(streamed, solo)):
        assert chunks >= 2, f"request {i} was not streamed"
        assert text == ref, f"request {i} (prompt {LENGTHS[i]} tokens): {text!r} != {ref!r}"
    assert sas_sparse_server.alive()


def test_radix_cached_prefix_gives_same_output(essay_ids, sas_sparse_server):
    url = sas_sparse_server.url
    prefix = essay_ids[90000:91500]
    complete(url, prefix + essay_ids[92000:92040], max_tokens=4)  # fills the cache with the prefix
    query = prefix + essay_ids[93000:93050]
    cached = complete(url, query, max_tokens=NEW_TOKENS)
    details = cached["usage"].get("prompt_tokens_details") or {}
    assert details.get("cached_tokens", 0) >= 1472, cached["usage"]  # whole 64-token pages of the prefix
    assert requests.post(f"{url}/flush_cache", timeout=60).status_code == 200
    fresh = complete(url, query, max_tokens=NEW_TOKENS)
    assert ((fresh["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0) == 0
    assert cached["choices"][0]["text"] == fresh["choices"][0]["text"]
