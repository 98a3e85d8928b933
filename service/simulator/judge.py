"""A simulated model with `judge: true` answers pairwise-judge prompts from the facts it planted.

The prompt is the layout of `collectors.evaluators.llm_judge` (prompt version `pairwise-1`): the
last user message is "Conversation:\\n<JSON>\\n\\nAnswer A:\\n<JSON>\\n\\nAnswer B:\\n<JSON>". The
conversation's messages give the prompt's content key, hence its planted facts (facts.py); each
answer scores the share of the facts it states that are planted ones (facts read from its text,
also from text inside JSON; a refusal, a tool call or an answer stating no fact scores 0). The
higher score wins, equal scores tie. With probability `judge_error` the verdict is a random one
instead. A prompt that is not in this layout is answered like any other chat request.
"""

from __future__ import annotations

import json
import re

from service.simulator.facts import MAX_FACTS, facts, read_facts

PAIRWISE = re.compile(r"Conversation:\n(?P<conversation>.*)\n\nAnswer A:\n(?P<a>.*)\n\nAnswer B:\n(?P<b>.*)\Z",
                      re.DOTALL)
WINNERS = ("A", "B", "tie")


def pairwise_prompt(messages: list) -> tuple[list, object, object] | None:
    """(the judged conversation's messages, answer A, answer B), or None for any other prompt."""
    user = next((m for m in reversed(messages) if isinstance(m, dict) and m.get("role") == "user"), None)
    content = user.get("content") if user else None
    match = PAIRWISE.match(content) if isinstance(content, str) else None
    if match is None:
        return None
    try:
        shown, a, b = (json.loads(match.group(k)) for k in ("conversation", "a", "b"))
    except ValueError:
        return None
    conversation = shown.get("messages") if isinstance(shown, dict) else None
    if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
        return None
    return conversation, a, b


def _texts(value: object) -> list[str]:
    """Every string inside a JSON value (an answer's content may itself be JSON)."""
    if isinstance(value, str):
        try:
            inner = json.loads(value)
        except ValueError:
            return [value]
        return _texts(inner) if isinstance(inner, (dict, list)) else [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _texts(v)]
    if isinstance(value, list):
        return [t for v in value for t in _texts(v)]
    return []


def correctness(answer: object, content_key: int) -> float:
    """The share of the facts an answer states that are the ones planted under `content_key`."""
    if not isinstance(answer, dict) or answer.get("refusal"):
        return 0.0
    stated = read_facts(". ".join(_texts(answer.get("content"))))
    if not stated:
        return 0.0
    truth = {(s, a): v for s, a, v in facts(content_key, MAX_FACTS)}
    return sum(truth.get((s, a)) == v for s, a, v in stated) / len(stated)


def verdict(a: object, b: object, content_key: int, error: bool, pick: float) -> dict:
    """The judge's JSON answer: {"winner": "A" | "B" | "tie", "reason": ...}."""
    if error:
        return {"winner": WINNERS[min(int(pick * 3), 2)], "reason": "a guess"}
    sa, sb = correctness(a, content_key), correctness(b, content_key)
    reason = f"facts correct: A {sa:.2f}, B {sb:.2f}"
    if sa == sb:
        return {"winner": "tie", "reason": reason}
    return {"winner": "A" if sa > sb else "B", "reason": reason}
