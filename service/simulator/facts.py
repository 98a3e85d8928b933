"""What a simulated text answer says (its facts) and how it says it (its wording).

Content. An answer states a list of facts, each a (subject, attribute, value) triple, drawn from a
content key alone (the prompt, or the prompt and a divergent variant): every model states the same
facts for the same prompt, and a longer answer states more of them (the first n facts of a key are
those of any longer answer). Subjects, attributes and values come from disjoint word pools, and no
template word is in a pool, so the facts of a sentence can be read back (`read_facts`): that is how
the simulated judge checks an answer against the facts it planted. `wrong_facts` keeps the subjects
and attributes and changes one value: a fluent answer with a wrong fact.

Wording. Each call renders its facts anew from a wording key (an opener, one of several sentence
templates per fact, connectors). Two renderings of the same facts are paraphrases: their local
embedding similarity (collectors.similarity) is mostly 0.85-0.98; renderings of other facts are at
0.1-0.6. So an exact comparison of two calls fails, as it does with real models, and a semantic one
holds. Wording key 0 is the canonical rendering (what JSON answers embed, so their fields are stable).
"""

from __future__ import annotations

import random
import re

Fact = tuple[str, str, str]

SUBJECTS = tuple("""
invoice account refund order payment subscription ticket shipment warranty password report contract
budget server database license backup profile cart coupon delivery parcel receipt statement loan
mortgage deposit transfer card wallet plan upgrade booking reservation flight hotel rental membership
policy claim appointment
""".split())
ATTRIBUTES = tuple("""
status deadline owner limit region balance priority fee schedule version size location currency
reason tier method duration frequency category threshold rate capacity discount penalty quota
""".split())
VALUES = tuple("""
approved pending blocked cancelled expired active suspended verified rejected delayed shipped
monday tuesday wednesday thursday friday saturday sunday january march june september december
berlin tokyo paris madrid lisbon oslo dublin vienna prague warsaw athens rome
euros dollars pounds yen francs twelve forty ninety thousands hundreds
weekly monthly yearly daily hourly urgent normal premium basic gold silver bronze
""".split())
POOLS = (frozenset(SUBJECTS), frozenset(ATTRIBUTES), frozenset(VALUES))

TEMPLATES = (
    "The {a} of the {s} is {v}.",
    "The {s} has {v} as its {a}.",
    "For the {s}, the {a} is {v}.",
    "The {s}'s {a} is {v}.",
    "{v} is the {a} of the {s}.",
    "The {s}: its {a} is {v}.",
)
OPENERS = ("", "", "Sure. ", "In short, ", "Well, ")
CONNECTORS = ("", "", "", "Also, ", "And ")
MAX_FACTS = 64
WORDS_PER_FACT = 8
_WORD = re.compile(r"[a-z]+")


def facts(key: int, n: int) -> list[Fact]:
    """The first n facts of a content key, with distinct (subject, attribute) pairs."""
    rng = random.Random(key)
    out: list[Fact] = []
    seen: set[tuple[str, str]] = set()
    while len(out) < min(n, MAX_FACTS):
        s, a, v = rng.choice(SUBJECTS), rng.choice(ATTRIBUTES), rng.choice(VALUES)
        if (s, a) not in seen:
            seen.add((s, a))
            out.append((s, a, v))
    return out


def fact_count(tokens: int) -> int:
    """How many facts an answer of about `tokens` words states."""
    return max(2, round(tokens / WORDS_PER_FACT))


def wrong_facts(stated: list[Fact], key: int) -> list[Fact]:
    """The same facts with one value changed (which one, and to what, from `key`)."""
    rng = random.Random(key)
    i = rng.randrange(len(stated))
    s, a, v = stated[i]
    other = rng.choice([x for x in VALUES if x != v])
    return [*stated[:i], (s, a, other), *stated[i + 1:]]


def render(stated: list[Fact], wording: int) -> list[str]:
    """The facts as words (stream pieces, one word each, with their leading spaces)."""
    rng = random.Random(wording) if wording else None
    text = ""
    for i, (s, a, v) in enumerate(stated):
        template = rng.choice(TEMPLATES) if rng else TEMPLATES[0]
        sentence = template.format(s=s, a=a, v=v)
        lead = (rng.choice(CONNECTORS) if i else rng.choice(OPENERS)) if rng else ""
        if lead.endswith(", ") or lead.endswith("And "):  # the sentence goes on after it
            sentence = sentence[0].lower() + sentence[1:]
        sentence = lead + sentence
        text += sentence[0].upper() + sentence[1:] + " "
    words = text.split()
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


def read_facts(text: str) -> list[Fact]:
    """The facts stated in a text: per sentence, its subject, attribute and value words."""
    out: list[Fact] = []
    for sentence in re.split(r"[.!?\n]", text.lower()):
        found: list[str | None] = [None, None, None]
        for word in _WORD.findall(sentence):
            for k, pool in enumerate(POOLS):
                if word in pool and found[k] is None:
                    found[k] = word
        if all(found):
            out.append((found[0], found[1], found[2]))  # type: ignore[arg-type]
    return out
