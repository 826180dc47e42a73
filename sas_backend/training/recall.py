"""Recall rows: training rows that need a far block, so the gate learns retrieval, not just locality.

Ordinary text rarely makes a token depend on one particular far block; a gate trained on it alone learns
to rank by recency and by the sink, and a decode that must copy a fact from 2K tokens back (the needle
test) finds the fact's block missing. A recall row fixes that inside the ordinary LM loss: `facts`
sentences ("Note that the access code for the amber lantern is 48213.") are spliced into a training row
before its trained tail, and a restatement of each ("As noted, the access code for the amber lantern is
48213.") into the tail, where the loss is taken. Predicting the value in the tail needs the block that
holds the fact.

The vocabulary (keys, templates, value words) shares no word with the needle test's (`bench/needle.py`:
"secret passphrase", its places and codes), so the needle stays a held-out format. Rows are changed in
place of their own tokens: the prefix keeps its length (its last tokens give way to the facts), the tail
keeps its length (its last tokens give way to the restatements); a row stays `seq_len` long.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Dict, List, Sequence, Tuple

import torch

METHOD = ("facts spliced at sentence ends before the trained tail, a restatement of each in the tail (another "
          "order); rows keep their length")
ADJECTIVES = ("amber", "crimson", "quiet", "northern", "hollow", "velvet", "rusty", "frozen", "golden", "narrow",
              "ancient", "wooden", "scarlet", "misty", "broken", "eastern", "painted", "sunken", "gentle", "iron")
NOUNS = ("lantern", "orchard", "station", "archive", "chapel", "quarry", "workshop", "lighthouse", "vineyard",
         "observatory", "granary", "ferry", "theater", "kiosk", "stable", "foundry", "pavilion", "cellar", "canal",
         "monastery")
VALUE_WORDS = ("falcon", "ember", "willow", "quartz", "harvest", "comet", "pepper", "lotus", "anchor", "tundra",
               "meadow", "cinder", "orbit", "prism", "badger", "ripple")
# (fact, restatement): the restatement names the key before the value, so only the fact's block tells it
TEMPLATES = (
    ("Note that the access code for the {key} is {value}.", "As noted, the access code for the {key} is {value}."),
    ("The registration number of the {key} was recorded as {value}.",
     "To repeat, the registration number of the {key} is {value}."),
    ("Keep in mind that the {key} uses the key {value}.", "Recall that the {key} uses the key {value}."),
    ("For the record, the {key} was assigned the label {value}.",
     "Once more: the {key} was assigned the label {value}."),
)


@dataclasses.dataclass(frozen=True)
class RecallSpec:
    """Which rows become recall rows and how many facts each carries.

    fraction: share of rows made recall rows (a seeded choice); facts: facts per recall row;
    tail: the trained tail (`--train-last`, or the whole row's last tokens) that holds the restatements;
    min_distance: at least this many tokens between each fact's end and the tail's start (0: anywhere before
    the tail), so every restatement must reach that far back, as a needle early in a long context does.
    """

    fraction: float
    facts: int
    tail: int
    seed: int = 0
    min_distance: int = 0

    def __post_init__(self):
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"recall fraction must be in [0, 1], got {self.fraction}")
        if self.facts < 1:
            raise ValueError(f"recall facts per row must be >= 1, got {self.facts}")
        if self.tail < 2:
            raise ValueError(f"recall tail must be >= 2 tokens, got {self.tail}")
        if self.min_distance < 0:
            raise ValueError(f"recall min distance must be >= 0, got {self.min_distance}")

    def record(self) -> dict:
        rec = {"fraction": self.fraction, "facts": self.facts, "tail": self.tail, "seed": self.seed,
               "templates": [list(t) for t in TEMPLATES], "method": METHOD}
        if self.min_distance:  # recorded only when set: records made before the option stay equal
            rec["min_distance"] = self.min_distance
        return rec


def _value(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return str(rng.randrange(10_000, 100_000))
    return f"{rng.choice(VALUE_WORDS)}-{rng.randrange(1000, 10_000)}"


def make_facts(n: int, rng: random.Random) -> List[Tuple[str, str]]:
    """`n` (fact, restatement) sentence pairs with distinct keys."""
    keys = rng.sample([f"{a} {b}" for a in ADJECTIVES for b in NOUNS], n)
    out = []
    for key in keys:
        fact, again = rng.choice(TEMPLATES)
        value = _value(rng)
        out.append((fact.format(key=key, value=value), again.format(key=key, value=value)))
    return out


def _splice(tokens: List[int], spans: Sequence[List[int]], rng: random.Random, boundaries: set) -> List[int]:
    """`tokens` with each span inserted at a distinct position (after a sentence end where there is room),
    cut back to len(tokens): the last tokens give way."""
    n, need = len(tokens), sum(len(s) for s in spans)
    if need >= n:
        raise ValueError(f"{need} tokens of recall text do not fit in a segment of {n}")
    room = n - need  # positions that keep every inserted span inside the segment
    if room + 1 < len(spans):
        raise ValueError(f"{len(spans)} recall sentences do not fit at distinct places in a segment of {n}")
    ends = [i + 1 for i in range(room) if tokens[i] in boundaries]
    pool = ends if len(ends) >= len(spans) else list(range(room + 1))
    cuts = sorted(rng.sample(pool, len(spans)))
    out, prev = [], 0
    for cut, span in zip(cuts, spans):
        out += tokens[prev:cut] + span
        prev = cut
    out += tokens[prev:]
    return out[:n]


def add_recall_rows(rows: torch.Tensor, tokenizer, spec: RecallSpec) -> Tuple[torch.Tensor, Dict[str, int]]:
    """Turn a seeded `spec.fraction` of `rows` into recall rows.

    rows: `[N, L]` int64 (packed rows); returns a new `[N, L]` tensor (the other rows unchanged) and
    counts {"rows_changed", "facts_placed"}. Facts land in the prefix `[0, L - tail)`, restatements in the tail.
    """
    n, length = rows.shape
    if spec.tail >= length:
        raise ValueError(f"recall tail {spec.tail} must be shorter than the rows ({length} tokens)")
    rng = random.Random(spec.seed)
    chosen = sorted(rng.sample(range(n), round(spec.fraction * n)))
    boundary_cache: Dict[int, bool] = {}

    def boundaries(ids: List[int]) -> set:
        for t in set(ids) - boundary_cache.keys():
            boundary_cache[t] = tokenizer.decode([t]).rstrip(" ").endswith((".", "\n", "?", "!"))
        return {t for t in set(ids) if boundary_cache[t]}

    out = rows.clone()
    for r in chosen:
        pairs = make_facts(spec.facts, rng)
        facts = [tokenizer(" " + f, add_special_tokens=False)["input_ids"] for f, _ in pairs]
        again = [tokenizer(" " + a, add_special_tokens=False)["input_ids"] for _, a in pairs]
        order = list(range(spec.facts))
        rng.shuffle(order)  # restated in another order than stated
        ids = rows[r].tolist()
        head, tail = ids[: length - spec.tail], ids[length - spec.tail:]
        if spec.min_distance:  # facts go into the head's first part only; its last min_distance tokens stay text
            if spec.min_distance >= len(head):
                raise ValueError(f"recall min distance {spec.min_distance} leaves no room before the tail "
                                 f"({len(head)} tokens)")
            near = head[len(head) - spec.min_distance:]
            far = head[: len(head) - spec.min_distance]
            head = _splice(far, facts, rng, boundaries(far)) + near
        else:
            head = _splice(head, facts, rng, boundaries(head))
        tail = _splice(tail, [again[i] for i in order], rng, boundaries(tail))
        out[r] = torch.tensor(head + tail, dtype=rows.dtype)
    return out, {"rows_changed": len(chosen), "facts_placed": len(chosen) * spec.facts}
