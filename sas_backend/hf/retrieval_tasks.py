"""RULER-kind retrieval tasks, generated locally: one haystack holds many facts, asked in turn.

Every question of a haystack shares its prefix (the chat template's opening and the haystack text), so an
evaluation prefills the haystack once, densely, and asks each question from that cached prefix
(`bench/retrieval.py`). Four tasks, after RULER's (Hsieh et al., 2024) retrieval families:

- `single`: five facts, each in its own sentence template (no other fact shares its wording), value a
  7-digit number: RULER's single needle, five times.
- `multikey`: six facts "The special magic number for <key> is: <value>." with two-word keys; five are
  asked, every other one is a distractor of the same form (RULER's niah_multikey).
- `multivalue`: five keys with three values each, spread over the haystack; the answer is all three
  (RULER's niah_multivalue), scored as the share of values written.
- `vt`: five chains "VAR A = <n>." then "VAR B = VAR A." ... four names each, the statements at increasing
  depths; the answer is the four names (RULER's variable tracking), scored as the share written.

Facts sit at sentence ends of the filler text at seeded depths in [0.02, 0.95]. The templates are not the
ones the shipped gates' recall rows were trained on (sas_backend.training.recall). Everything is seeded:
the same (tokenizer, filler, length, seed) gives the same haystack, token for token.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import List, Sequence

TASKS = ("single", "multikey", "multivalue", "vt")

# (fact, question, answer prefix) per single-needle template; {key} a word, {value} the number.
SINGLE_TEMPLATES = (
    ("The secret passphrase of the {key} vault is {value}.",
     "What is the secret passphrase of the {key} vault?", "The secret passphrase of the {key} vault is"),
    ("The night train to {key} departs from platform {value}.",
     "From which platform does the night train to {key} depart?", "The night train to {key} departs from platform"),
    ("Locker {key} opens with the combination {value}.",
     "What combination opens locker {key}?", "Locker {key} opens with the combination"),
    ("The lighthouse keeper of {key} wrote the number {value} on the wall.",
     "What number did the lighthouse keeper of {key} write on the wall?",
     "The lighthouse keeper of {key} wrote the number"),
    ("The museum catalogue lists the {key} painting under inventory {value}.",
     "Under which inventory number does the museum catalogue list the {key} painting?",
     "The museum catalogue lists the {key} painting under inventory"),
)
SINGLE_KEYS = ("Ardmore", "Belvedere", "Calloway", "Dunmore", "Easterly", "Fairhaven", "Glenrock", "Holloway",
               "Inverness", "Juniper", "Kestrel", "Larkspur", "Marigold", "Northwind", "Oakridge", "Pemberton")
MULTIKEY_FACT = "The special magic number for {key} is: {value}."
MULTIKEY_QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
MULTIKEY_PREFIX = "The special magic number for {key} mentioned in the provided text is"
MULTIVALUE_FACT = "One of the special magic codes for {key} is: {value}."
MULTIVALUE_QUESTION = "What are all the special magic codes for {key} mentioned in the provided text?"
MULTIVALUE_PREFIX = "The special magic codes for {key} mentioned in the provided text are"
VT_FIRST = "VAR {name} = {value}."
VT_NEXT = "VAR {name} = VAR {prev}."
VT_QUESTION = ("Find all variables that are assigned the value {value} in the text above, directly or through "
               "a chain of assignments.")
VT_PREFIX = ("According to the chain(s) of variable assignment in the text above, {n} variables are assigned "
             "the value {value}, they are:")
ADJECTIVES = ("quiet", "amber", "brisk", "crooked", "dusty", "eager", "frozen", "gentle", "hollow", "ivory",
              "jagged", "lunar", "misty", "narrow", "olive", "pale", "rapid", "silent", "tawny", "velvet")
NOUNS = ("harbor", "falcon", "meadow", "lantern", "canyon", "orchard", "glacier", "compass", "thicket", "beacon",
         "quarry", "willow", "spindle", "tundra", "anchor", "marble", "prairie", "citadel", "ember", "fjord")
PER_TASK = 5
MULTIKEY_FACTS = 6
MULTIVALUE_VALUES = 3
VT_CHAIN = 4


@dataclasses.dataclass(frozen=True)
class Question:
    """One question of a haystack: `answers` are the items the reply must contain (one for single and
    multikey); `gold` is the reply a teacher-forced score follows (after `answer_prefix`)."""

    task: str
    question: str
    answer_prefix: str
    answers: tuple
    gold: str


@dataclasses.dataclass(frozen=True)
class Haystack:
    """A haystack's text (facts included) and its questions, with the depth of every fact sentence."""

    text: str
    questions: tuple
    facts: tuple  # (fact sentence, depth in [0, 1]) in document order


def _number(rng: random.Random, used: set) -> str:
    while True:
        v = str(rng.randint(1_000_000, 9_999_999))
        if v not in used:
            used.add(v)
            return v


def _facts_and_questions(rng: random.Random):
    """([(sentence, depth)], [Question]) for one haystack: PER_TASK questions of every task."""
    used: set = set()
    facts, questions = [], []

    def depth() -> float:
        return rng.uniform(0.02, 0.95)

    keys = rng.sample(SINGLE_KEYS, PER_TASK)
    for (fact, q, prefix), key in zip(SINGLE_TEMPLATES, keys):
        v = _number(rng, used)
        facts.append((fact.format(key=key, value=v), depth()))
        questions.append(Question("single", q.format(key=key), prefix.format(key=key), (v,), f" {v}."))
    pairs = rng.sample([f"{a}-{n}" for a in ADJECTIVES for n in NOUNS], MULTIKEY_FACTS + PER_TASK)
    mk_keys, mv_keys = pairs[:MULTIKEY_FACTS], pairs[MULTIKEY_FACTS:]
    for i, key in enumerate(mk_keys):
        v = _number(rng, used)
        facts.append((MULTIKEY_FACT.format(key=key, value=v), depth()))
        if i < PER_TASK:
            questions.append(Question("multikey", MULTIKEY_QUESTION.format(key=key),
                                      MULTIKEY_PREFIX.format(key=key), (v,), f" {v}."))
    for key in mv_keys:
        placed = sorted((depth(), _number(rng, used)) for _ in range(MULTIVALUE_VALUES))
        facts.extend((MULTIVALUE_FACT.format(key=key, value=v), d) for d, v in placed)
        vals = tuple(v for _, v in placed)
        questions.append(Question("multivalue", MULTIVALUE_QUESTION.format(key=key),
                                  MULTIVALUE_PREFIX.format(key=key), vals, " " + ", ".join(vals) + "."))
    names_used: set = set()
    for _ in range(PER_TASK):
        value = str(rng.randint(10_000, 99_999))
        names = []
        while len(names) < VT_CHAIN:
            name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
            if name not in names_used:
                names_used.add(name)
                names.append(name)
        depths = sorted(depth() for _ in range(VT_CHAIN))
        facts.append((VT_FIRST.format(name=names[0], value=value), depths[0]))
        facts.extend((VT_NEXT.format(name=n, prev=p), d) for n, p, d in zip(names[1:], names, depths[1:]))
        questions.append(Question("vt", VT_QUESTION.format(value=value),
                                  VT_PREFIX.format(n=VT_CHAIN, value=value), tuple(names), " " + " ".join(names)))
    return facts, questions


def make_haystack(tok, filler: str, n_tokens: int, seed: int) -> Haystack:
    """A haystack of about `n_tokens` tokens of `tok` (filler plus facts; the prompt's template and question
    come on top), its filler the first tokens of `filler` from a seeded sentence offset, facts at sentence ends.

    filler: plain text several times longer than needed is best (a shorter one raises ValueError).
    """
    rng = random.Random(seed)
    facts, questions = _facts_and_questions(rng)
    fact_tokens = sum(len(tok(" " + f, add_special_tokens=False)["input_ids"]) for f, _ in facts)
    want = n_tokens - fact_tokens
    if want <= 0:
        raise ValueError(f"{n_tokens} tokens do not hold the {len(facts)} facts ({fact_tokens} tokens)")
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", filler) if s.strip()]
    start = rng.randrange(max(len(sentences) // 2, 1))
    chosen, count = [], 0
    for s in sentences[start:] + sentences[:start]:
        if count >= want:
            break
        n = len(tok(" " + s, add_special_tokens=False)["input_ids"])
        if count + n > want:
            break
        chosen.append(s)
        count += n
    if count < want * 0.9:
        raise ValueError(f"filler holds {count} tokens of sentences, {want} needed")
    slots: List[List[str]] = [[] for _ in range(len(chosen) + 1)]  # slot i: after sentence i - 1
    for f, d in sorted(facts, key=lambda fd: fd[1]):
        slots[round(d * len(chosen))].append(f)
    parts, placed = [], []
    for i in range(len(chosen) + 1):
        for f in slots[i]:
            placed.append((f, i / max(len(chosen), 1)))
            parts.append(f)
        if i < len(chosen):
            parts.append(chosen[i])
    return Haystack(" ".join(parts), tuple(questions), tuple(placed))


def prompt_parts(tok, hay: Haystack, question: Question):
    """(haystack-prefix text, question-suffix text) of the chat prompt: the user turn is the haystack, a blank
    line and the question; the assistant turn opens with the answer prefix (RULER's). The prefix is the same
    for every question of a haystack."""
    marker = "\u0000QUESTION\u0000"
    prompt = tok.apply_chat_template([{"role": "user", "content": hay.text + "\n\n" + marker}],
                                     tokenize=False, add_generation_prompt=True)
    head, tail = prompt.split(marker)
    return head, question.question + tail.rstrip("\n") + "\n" + question.answer_prefix


def score_reply(question: Question, reply: str) -> float:
    """RULER's score of a reply: the share of the question's answers it contains (0 or 1 for one answer)."""
    return sum(a in reply for a in question.answers) / len(question.answers)


def shared_prefix_ids(tok, head: str, tails: Sequence[str]):
    """(prefix ids, [suffix ids]) with `prefix + suffix == tok(head + tail)` for every tail, the prefix as
    long as every full tokenization agrees on (tokens at the seam may merge, so it can be shorter than `head`
    alone)."""
    fulls = [tok(head + t, add_special_tokens=False)["input_ids"] for t in tails]
    n = len(tok(head, add_special_tokens=False)["input_ids"])
    while n > 0 and any(f[:n] != fulls[0][:n] for f in fulls):
        n -= 1
    return fulls[0][:n], [f[n:] for f in fulls]
