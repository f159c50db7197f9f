"""Seeded chat corpora with volatile fields planted at known places, for the cache advisor.

Each template is a system prompt of stable text with at most one slot (its kind and
sentence fixed per template, its place at the top, in the middle or near the end); each
request fills the slot with a fresh value of that kind and asks its own question in the
user turn. ``Planted`` records where the value went, in characters of the system prompt.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass

KINDS = ("timestamp", "date", "uuid", "hex_id", "number", "name", "text")
WORDS = [
    "support",
    "agent",
    "answer",
    "clearly",
    "politely",
    "concise",
    "helpful",
    "customer",
    "product",
    "billing",
    "order",
    "refund",
    "shipping",
    "account",
    "policy",
    "always",
    "never",
    "explain",
    "steps",
    "before",
    "after",
    "check",
    "verify",
    "details",
    "information",
    "question",
    "request",
    "service",
    "team",
    "manual",
    "guide",
    "section",
    "warranty",
    "return",
    "exchange",
    "delivery",
    "tracking",
    "invoice",
    "payment",
    "method",
    "card",
    "bank",
    "transfer",
    "limit",
]
FIRST = [
    "Alice",
    "Bob",
    "Carol",
    "David",
    "Erin",
    "Frank",
    "Grace",
    "Heidi",
    "Ivan",
    "Judy",
    "Mallory",
    "Niaj",
    "Olivia",
    "Peggy",
]
LAST = [
    "Johnson",
    "Smith",
    "Brown",
    "Garcia",
    "Miller",
    "Davis",
    "Wilson",
    "Moore",
    "Taylor",
    "Thomas",
    "Martin",
    "Lee",
]
MONTHS = "January February March April May June July August September October November December"
SENTENCES = {
    "timestamp": ("Current time: {}.", "The conversation started at {}."),
    "date": ("Today is {}.", "Knowledge of events up to {}."),
    "uuid": ("Session {} is active.", "Trace id {} for this call."),
    "hex_id": ("Request id: {}.", "Cache key {} applies."),
    "number": ("The account balance is {} credits.", "Ticket number {} is open."),
    "name": ("The user's name is {}.", "You are talking to {}."),
    "text": ("User note: {}.", "The user says about themselves: {}."),
}


@dataclass(frozen=True)
class Planted:
    template: int
    kind: str | None  # None: no slot, the system prompt is identical for every request
    value: str
    start: int  # character offset of the value in the system prompt
    system: str
    user: str


def value_of(kind: str, rng: random.Random) -> str:
    if kind == "timestamp":
        d = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        t = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}"
        return f"{d}T{t}Z" if rng.random() < 0.5 else f"{d} {t}"
    if kind == "date":
        month = rng.choice(MONTHS.split())
        if rng.random() < 0.5:
            return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        return f"{month} {rng.randint(1, 28)}, {rng.randint(2023, 2026)}"
    if kind == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128)))
    if kind == "hex_id":
        while True:
            text = f"{rng.getrandbits(64):016x}"
            if any(c.isalpha() for c in text) and any(c.isdigit() for c in text):
                return text
    if kind == "number":
        n = rng.randint(1, 999_999)
        return f"{n:,}" if rng.random() < 0.3 else str(n)
    if kind == "name":
        return f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6)))


def _paragraph(rng: random.Random, num_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(num_words)]
    return " ".join(words).capitalize() + "."


def make_corpus(num_requests: int, seed: int = 0, num_templates: int = 24) -> list[Planted]:
    """``num_requests`` requests over ``num_templates`` templates (a few with no slot)."""
    rng = random.Random(seed)
    templates = []
    for t in range(num_templates):
        kind = None if t % 8 == 7 else KINDS[t % len(KINDS)]
        sentence = rng.choice(SENTENCES[kind]) if kind else ""
        place = rng.choice(("top", "middle", "end"))
        intro = f"You are template {t}, a " + _paragraph(rng, 12)
        body = [_paragraph(rng, rng.randint(20, 40)) for _ in range(3)]
        templates.append((kind, sentence, place, intro, body))
    corpus = []
    for _ in range(num_requests):
        t = rng.randrange(num_templates)
        kind, sentence, place, intro, body = templates[t]
        value = value_of(kind, rng) if kind else ""
        parts = [intro, *body]
        slot = sentence.format(value) if kind else ""
        at = {"top": 0, "middle": 2, "end": 3}[place]
        head = " ".join(parts[:at])
        system = (head + " " if head else "") + slot + (" " if slot else "") + " ".join(parts[at:])
        start = system.index(slot) + sentence.index("{}") if kind else len(system)
        user = "Question " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + "?"
        corpus.append(Planted(t, kind, value, start, system, user))
    return corpus


def messages(p: Planted) -> list[dict[str, str]]:
    return [{"role": "system", "content": p.system}, {"role": "user", "content": p.user}]
