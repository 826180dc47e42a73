"""The soak's requests, as a pure function of a seed: what each sends, when, and how it ends.

Poisson arrivals; prompt lengths log-uniform from 16 tokens to the context limit; some prompts
start with one of a few shared prefixes (radix-cache hits); half streamed, a share of the streams
closed by the client mid-decode; a share over the context limit (the server must answer 400).
Prompts are token ids cut from real text, so every request decodes real language.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import List, Sequence

MIN_PROMPT = 16


@dataclasses.dataclass(frozen=True)
class SoakRequest:
    index: int
    at: float  # seconds after the start
    prompt: List[int]
    max_tokens: int
    stream: bool
    abort_after: int  # streamed chunks read before the client closes the connection; 0: read to the end
    over_limit: bool  # longer than the context limit: a 400 is the right answer
    shared_prefix: int  # which shared prefix it starts with, -1 for none

    @property
    def kind(self) -> str:
        if self.over_limit:
            return "over_limit"
        if self.abort_after:
            return "stream_abort"
        return "stream" if self.stream else "complete"


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    requests: int
    duration_s: float  # arrivals spread over this long (rate = requests / duration)
    context_len: int
    max_new_tokens: int = 64
    stream_share: float = 0.5
    abort_share: float = 0.2  # of the streams
    over_limit_share: float = 0.03
    prefix_share: float = 0.3
    prefixes: int = 4
    prefix_len: int = 512
    seed: int = 0

    def __post_init__(self):
        if self.context_len < 2 * MIN_PROMPT + self.max_new_tokens:
            raise ValueError(f"context_len {self.context_len} leaves no room for prompts and "
                             f"{self.max_new_tokens} new tokens")
        if self.prefix_len + MIN_PROMPT + self.max_new_tokens > self.context_len:
            raise ValueError(f"prefix_len {self.prefix_len} does not fit the context limit {self.context_len}")


def make_workload(spec: WorkloadSpec, text_ids: Sequence[int]) -> List[SoakRequest]:
    """`spec.requests` requests cut from `text_ids` (token ids of real text, longer than the context
    limit plus the shared prefixes), in arrival order."""
    need = spec.prefixes * spec.prefix_len + spec.context_len + 256
    if len(text_ids) < need:
        raise ValueError(f"the soak needs at least {need} tokens of text, got {len(text_ids)}")
    rng = random.Random(spec.seed)
    prefixes = [list(text_ids[i * spec.prefix_len:(i + 1) * spec.prefix_len]) for i in range(spec.prefixes)]
    body = text_ids[spec.prefixes * spec.prefix_len:]
    rate = spec.requests / spec.duration_s
    out, t = [], 0.0
    for i in range(spec.requests):
        t += rng.expovariate(rate)
        max_tokens = rng.randint(8, spec.max_new_tokens)
        over = rng.random() < spec.over_limit_share
        if over:
            length = spec.context_len + rng.randint(1, 256)
        else:
            longest = spec.context_len - max_tokens
            length = int(round(math.exp(rng.uniform(math.log(MIN_PROMPT), math.log(longest)))))
        prefix = -1
        if not over and length > spec.prefix_len + MIN_PROMPT and rng.random() < spec.prefix_share:
            prefix = rng.randrange(spec.prefixes)
        start = rng.randrange(0, len(body) - length)
        if prefix >= 0:
            prompt = prefixes[prefix] + list(body[start:start + length - spec.prefix_len])
        else:
            prompt = list(body[start:start + length])
        stream = rng.random() < spec.stream_share
        abort_after = rng.randint(1, max(1, max_tokens // 2)) if stream and rng.random() < spec.abort_share else 0
        out.append(SoakRequest(i, t, prompt, max_tokens, stream, abort_after, over, prefix))
    return out
