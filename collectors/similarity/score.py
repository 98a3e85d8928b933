"""Similarity of two chat answers, in [0, 1], by answer kind.

- text: the cosine of the two texts' embeddings, clipped to [0, 1];
- JSON (the request asked for it): the share of leaves that match after canonicalisation, so one
  wrong field costs one field; a key present on one side only is a mismatched leaf;
- tool calls: the function names must match (as a multiset, else 0), then the arguments of
  the calls paired by name (in order of appearance) are scored like JSON, and averaged;
- refusal vs anything else: 0; two refusals: 1; two empty answers: 1; one empty answer: 0;
- answers of different kinds (text vs tool calls, ...): 0.

Only text needs the embedder. A caller scores several pairs with one batched embed call, each
distinct text embedded once (`similarities`): for one shadow record, `score_record` embeds the
live stable answer, the candidate's and the stable-again one, and returns both scores.

Canonical JSON leaves: a path of object keys and array positions (arrays are compared position
by position), and a value where 1 == 1.0, true != 1, strings are NFC-normalised and stripped,
and an empty object or array is a leaf of its own. A JSON answer that does not parse matches
nothing (0) unless neither side parses: then both are compared as text.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np

from collectors.similarity.base import Embedder

Kind = Literal["text", "json", "tool_calls", "refusal"]
_FENCE = re.compile(r"^```[A-Za-z0-9_-]*\s*\n?(.*?)\n?```$", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str = ""          # the JSON text, as the model wrote it


@dataclass(frozen=True, slots=True)
class Answer:
    kind: Kind
    text: str = ""               # content (text, json) or the refusal message
    tool_calls: tuple[ToolCall, ...] = ()

    @property
    def empty(self) -> bool:
        return self.kind in ("text", "json") and not self.text


@dataclass(frozen=True, slots=True)
class RecordSimilarity:
    """One shadow record's scores (None where that answer is missing); EvaluationRecord.similarity."""

    candidate_vs_stable: float | None
    stable_vs_stable: float | None

    def as_dict(self) -> dict[str, float | None]:
        return {"candidate_vs_stable": self.candidate_vs_stable, "stable_vs_stable": self.stable_vs_stable}


# ---- parsing --------------------------------------------------------------------------------------

def wants_json(request: Mapping) -> bool:
    """Whether a chat request asked for JSON output (`response_format` json_object or json_schema)."""
    fmt = request.get("response_format")
    return isinstance(fmt, Mapping) and fmt.get("type") in ("json_object", "json_schema")


def answer_of(message: Mapping, wants_json: bool = False) -> Answer:
    """The Answer in an OpenAI chat message (`choices[i].message`): tool calls first (also the
    legacy `function_call`), then a refusal, then the content (a string or text parts)."""
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        out = []
        for call in calls:
            fn = call.get("function") if isinstance(call, Mapping) else None
            fn = fn if isinstance(fn, Mapping) else {}
            out.append(ToolCall(str(fn.get("name") or ""), _arguments_text(fn.get("arguments"))))
        return Answer("tool_calls", tool_calls=tuple(out))
    legacy = message.get("function_call")
    if isinstance(legacy, Mapping) and legacy.get("name"):
        return Answer("tool_calls", tool_calls=(ToolCall(str(legacy["name"]), _arguments_text(legacy.get("arguments"))),))
    refusal = message.get("refusal")
    if isinstance(refusal, str) and refusal.strip():
        return Answer("refusal", text=refusal.strip())
    content = message.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    text = content.strip() if isinstance(content, str) else ""
    return Answer("json" if wants_json else "text", text=text)


def answer_of_completion(response: Mapping | None, wants_json: bool = False) -> Answer | None:
    """The Answer of a chat completion's first choice; None when there is no readable message."""
    if not isinstance(response, Mapping):
        return None
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return None
    message = choices[0].get("message")
    return answer_of(message, wants_json) if isinstance(message, Mapping) else None


def _arguments_text(raw: object) -> str:
    if raw is None:
        return ""
    if isinstance(raw, str):
        return raw
    return json.dumps(raw, ensure_ascii=False)


# ---- JSON -----------------------------------------------------------------------------------------

_INVALID = object()
Leaves = dict[tuple, tuple]


def _canon_leaf(value: object) -> tuple:
    if value is None:
        return ("null",)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, (int, float)):
        return ("num", value)
    if isinstance(value, str):
        return ("str", unicodedata.normalize("NFC", value).strip())
    if isinstance(value, dict):
        return ("object",)                                  # an empty one
    return ("array",)


def _flatten(value: object, path: tuple, out: Leaves) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(v, (*path, str(k)), out)
    elif isinstance(value, list) and value:
        for i, v in enumerate(value):
            _flatten(v, (*path, i), out)
    else:
        out[path] = _canon_leaf(value)


def leaves(value: object) -> Leaves:
    """A parsed JSON value as {path: canonical leaf}; keys are str, array positions int."""
    out: Leaves = {}
    _flatten(value, (), out)
    return out


@lru_cache(maxsize=256)
def _leaves_of_text(text: str) -> Leaves | object:
    s = text.strip()
    fenced = _FENCE.match(s)
    if fenced:
        s = fenced.group(1).strip()
    try:
        return leaves(json.loads(s))
    except (ValueError, RecursionError):
        return _INVALID


def _same_leaf(a: tuple, b: tuple) -> bool:
    if a[0] == "num" and b[0] == "num":
        return a[1] == b[1] or math.isclose(a[1], b[1], rel_tol=1e-9, abs_tol=0.0)
    return a == b


def leaf_similarity(a: Leaves, b: Leaves) -> float:
    """Matching leaves over all leaf paths of either side."""
    paths = a.keys() | b.keys()
    if not paths:
        return 1.0
    matched = sum(1 for p in a.keys() & b.keys() if _same_leaf(a[p], b[p]))
    return matched / len(paths)


def json_similarity(a: object, b: object) -> float:
    """The structural score of two parsed JSON values."""
    return leaf_similarity(leaves(a), leaves(b))


def _json_text_similarity(a: str, b: str) -> float | None:
    """The score of two JSON texts; None when neither parses (compare them as text instead)."""
    la, lb = _leaves_of_text(a), _leaves_of_text(b)
    if la is _INVALID and lb is _INVALID:
        return None
    if la is _INVALID or lb is _INVALID:
        return 0.0
    return leaf_similarity(la, lb)  # type: ignore[arg-type]


def _arguments_similarity(a: str, b: str) -> float:
    a, b = a.strip() or "{}", b.strip() or "{}"
    score = _json_text_similarity(a, b)
    if score is None:  # neither is JSON: equal text or nothing
        return 1.0 if a == b else 0.0
    return score


def tool_calls_similarity(a: Sequence[ToolCall], b: Sequence[ToolCall]) -> float:
    if not a and not b:
        return 1.0
    if sorted(c.name for c in a) != sorted(c.name for c in b):
        return 0.0
    pending: dict[str, list[ToolCall]] = {}
    for call in b:
        pending.setdefault(call.name, []).append(call)
    scores = [_arguments_similarity(call.arguments, pending[call.name].pop(0).arguments) for call in a]
    return sum(scores) / len(scores)


# ---- pairs ----------------------------------------------------------------------------------------

def _direct(a: Answer, b: Answer) -> float | None:
    """The score when it needs no embedding, else None (then: cosine of a.text and b.text)."""
    if a.kind != b.kind:
        return 0.0
    if a.kind == "refusal":
        return 1.0
    if a.kind == "tool_calls":
        return tool_calls_similarity(a.tool_calls, b.tool_calls)
    if a.empty or b.empty:
        return 1.0 if a.empty and b.empty else 0.0
    if a.kind == "json":
        return _json_text_similarity(a.text, b.text)
    if a.text == b.text:
        return 1.0
    return None


def texts_to_embed(pairs: Iterable[tuple[Answer | None, Answer | None]]) -> list[str]:
    """The distinct texts the pairs need embedded, in first-seen order (a missing answer needs none)."""
    seen: dict[str, None] = {}
    for a, b in pairs:
        if a is not None and b is not None and _direct(a, b) is None:
            seen.setdefault(a.text)
            seen.setdefault(b.text)
    return list(seen)


def similarity(a: Answer, b: Answer, vectors: Mapping[str, np.ndarray] | None = None) -> float:
    """The similarity of two answers; `vectors` maps text → L2-normalised embedding and must hold
    both texts when the pair is text to be embedded (see `texts_to_embed`)."""
    direct = _direct(a, b)
    if direct is not None:
        return direct
    if vectors is None or a.text not in vectors or b.text not in vectors:
        raise KeyError("similarity of two texts needs their embeddings: pass vectors for texts_to_embed(...)")
    cos = float(np.dot(vectors[a.text], vectors[b.text]))
    return min(1.0, max(0.0, cos))


def _score(pairs: Sequence[tuple[Answer | None, Answer | None]], texts: list[str], matrix: np.ndarray | None) -> list[float | None]:
    vectors = dict(zip(texts, matrix)) if matrix is not None else {}
    return [None if a is None or b is None else similarity(a, b, vectors) for a, b in pairs]


def similarities_with(pairs: Sequence[tuple[Answer | None, Answer | None]],
                      embed: Callable[[list[str]], np.ndarray]) -> list[float | None]:
    """`similarities` with a synchronous embed function (e.g. LocalEmbedder().embed_sync)."""
    texts = texts_to_embed(pairs)
    return _score(pairs, texts, embed(texts) if texts else None)


async def similarities(pairs: Sequence[tuple[Answer | None, Answer | None]], embedder: Embedder) -> list[float | None]:
    """The similarity of each pair (None where an answer is missing), with at most one embed call
    in which each distinct text appears once."""
    texts = texts_to_embed(pairs)
    return _score(pairs, texts, await embedder.embed(texts) if texts else None)


async def score_record(live: Answer | None, candidate: Answer | None, stable_again: Answer | None,
                       embedder: Embedder) -> RecordSimilarity:
    """Candidate vs the live stable answer, and stable-again vs it (the noise floor): one embed call,
    the live answer in it once."""
    cand, noise = await similarities([(live, candidate), (live, stable_again)], embedder)
    return RecordSimilarity(candidate_vs_stable=cand, stable_vs_stable=noise)


async def score_records(records: Sequence[tuple[Answer | None, Answer | None, Answer | None]],
                        embedder: Embedder) -> list[RecordSimilarity]:
    """`score_record` for many (live, candidate, stable_again) triples with one embed call in all."""
    pairs = [p for live, cand, again in records for p in ((live, cand), (live, again))]
    flat = await similarities(pairs, embedder)
    return [RecordSimilarity(flat[2 * i], flat[2 * i + 1]) for i in range(len(records))]


def pairwise_pairs(answers: Sequence[Answer]) -> list[tuple[Answer, Answer]]:
    return [(answers[i], answers[j]) for i in range(len(answers)) for j in range(i + 1, len(answers))]


async def mean_pairwise_similarity(answers: Sequence[Answer], embedder: Embedder) -> float | None:
    """Stability: the mean similarity over all pairs of one model's k answers (None below 2 answers)."""
    pairs = pairwise_pairs(answers)
    if not pairs:
        return None
    scores = await similarities(pairs, embedder)
    return sum(s for s in scores if s is not None) / len(pairs)
