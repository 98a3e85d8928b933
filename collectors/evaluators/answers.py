"""Do two chat answers agree? Each answer is reduced to a canonical key, then keys are compared.

- tool calls: the list of (function name, canonical arguments); call ids do not matter;
- JSON content (an object or array, optionally inside one ```json fence): canonical JSON
  (sorted keys, no whitespace; 1 and 1.0 are equal);
- any other text: Unicode NFKC, case-folded, whitespace collapsed, trailing punctuation dropped.

A refusal is its own kind of answer (it never agrees with content). An answer that could
not be read (no body, no choices) has no key, and agreement with it is not measured (None).
"""

from __future__ import annotations

import json
import re
import unicodedata

AnswerKey = tuple

_SPACE = re.compile(r"\s+")
_FENCE = re.compile(r"^```[A-Za-z0-9_-]*\s*\n?(.*?)\n?```$", re.DOTALL)
_TRAILING = " .!?;:,。"


def normalize_text(text: str) -> str:
    """NFKC, case-folded, single spaces, no surrounding whitespace or trailing sentence punctuation."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return _SPACE.sub(" ", text).strip().rstrip(_TRAILING)


def canonical_json(value: object) -> str:
    """One spelling per JSON value: sorted keys, compact, integral floats as integers."""
    return json.dumps(_canon(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _canon(value: object) -> object:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {str(k): _canon(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canon(v) for v in value]
    return value


def _as_json(text: str) -> str | None:
    """Canonical JSON when the text is a JSON object or array (possibly fenced), else None."""
    s = text.strip()
    fenced = _FENCE.match(s)
    if fenced:
        s = fenced.group(1).strip()
    if not s or s[0] not in "{[":
        return None
    try:
        return canonical_json(json.loads(s))
    except (ValueError, RecursionError):
        return None


def _arguments(raw: object) -> str:
    if isinstance(raw, str):
        try:
            return canonical_json(json.loads(raw))
        except (ValueError, RecursionError):
            return "raw:" + raw.strip()
    return canonical_json(raw)


def answer_key(response: dict | None) -> AnswerKey | None:
    """The canonical form of the first choice of a chat completion, or None when there is none."""
    if not isinstance(response, dict):
        return None
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    message = choices[0].get("message")
    if not isinstance(message, dict):
        return None
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        out = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            fn = fn if isinstance(fn, dict) else {}
            out.append((str(fn.get("name") or ""), _arguments(fn.get("arguments") or "{}")))
        return ("tools", tuple(out))
    legacy = message.get("function_call")
    if isinstance(legacy, dict):
        return ("tools", ((str(legacy.get("name") or ""), _arguments(legacy.get("arguments") or "{}")),))
    if message.get("refusal"):
        return ("refusal", normalize_text(str(message["refusal"])))
    content = message.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    text = content if isinstance(content, str) else ""
    as_json = _as_json(text)
    if as_json is not None:
        return ("json", as_json)
    return ("text", normalize_text(text))


def agrees(a: dict | None, b: dict | None) -> bool | None:
    """True/False when both answers are readable, None when either is missing."""
    ka, kb = answer_key(a), answer_key(b)
    if ka is None or kb is None:
        return None
    return ka == kb
