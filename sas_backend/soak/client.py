"""One soak request over HTTP (`/v1/completions`), and what became of it."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Optional

import requests

from sas_backend.soak.workload import SoakRequest


@dataclasses.dataclass
class Outcome:
    index: int
    kind: str
    result: str  # ok | client_abort | rejected (a 400 where one is right) | unexpected
    status: Optional[int] = None
    ttft_s: Optional[float] = None  # streams: first chunk; others: None
    e2e_s: Optional[float] = None
    tokens: int = 0  # completion tokens received (chunks, for a stream)
    error: str = ""


def send(url: str, req: SoakRequest, timeout: float = 1800.0) -> Outcome:
    """Send `req`, read the answer as a client would (closing a stream early when it says so)."""
    body = {"model": "default", "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": req.stream}
    out = Outcome(req.index, req.kind, "unexpected")
    t0 = time.monotonic()
    try:
        with requests.post(f"{url}/v1/completions", json=body, stream=req.stream, timeout=timeout) as r:
            out.status = r.status_code
            if r.status_code != 200:
                text = r.text[:300]
                out.result = "rejected" if (req.over_limit and r.status_code == 400) else "unexpected"
                out.error = "" if out.result == "rejected" else text
                return out
            if req.over_limit:
                out.error = "a request over the context limit was served"
                return out
            if not req.stream:
                data = r.json()
                out.tokens = int(data["usage"]["completion_tokens"])
                out.e2e_s = time.monotonic() - t0
                out.result = "ok" if out.tokens == req.max_tokens else "unexpected"
                if out.result != "ok":
                    out.error = f"{out.tokens} tokens, asked {req.max_tokens} (ignore_eos)"
                return out
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    out.error = json.dumps(payload["error"])[:300]
                    return out
                if out.ttft_s is None:
                    out.ttft_s = time.monotonic() - t0
                if payload["choices"] and payload["choices"][0].get("text") is not None:
                    out.tokens += 1
                if req.abort_after and out.tokens >= req.abort_after:
                    out.result = "client_abort"  # leaving the block closes the connection mid-decode
                    out.e2e_s = time.monotonic() - t0
                    return out
            out.e2e_s = time.monotonic() - t0
            # One chunk per token (stream_interval 1) unless the detokenizer held one back.
            out.result = "ok" if out.tokens >= 1 else "unexpected"
            if out.result != "ok":
                out.error = "a stream ended without a token"
            return out
    except Exception as e:  # connection reset, timeout: never expected
        out.error = f"{type(e).__name__}: {e}"[:300]
        return out
